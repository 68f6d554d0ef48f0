//! The model watcher against the API stand-in: InferenceObjective and InferenceModelRewrite
//! objects of the pool become the model table, follow updates and deletions, survive a relist;
//! without the CRDs installed the table is synced and empty.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kvroute_cluster::crd::*;
use kvroute_cluster::{PoolRef, watch_models};
use kvroute_kube_stand_in::ApiServer;

fn objective(name: &str, priority: Option<i32>, pool: &str) -> InferenceObjective {
    let mut o = InferenceObjective::new(
        name,
        InferenceObjectiveSpec { priority, pool_ref: PoolObjectReference { name: pool.into(), ..Default::default() } },
    );
    o.metadata.namespace = Some(NS.into());
    o
}

fn rewrite(name: &str, pool: &str, model: &str, targets: &[(&str, i32)]) -> InferenceModelRewrite {
    let mut r = InferenceModelRewrite::new(
        name,
        InferenceModelRewriteSpec {
            pool_ref: Some(PoolObjectReference {
                group: Some("inference.networking.k8s.io".into()),
                kind: Some("InferencePool".into()),
                name: pool.into(),
            }),
            rules: vec![InferenceModelRewriteRule {
                matches: vec![RewriteMatch {
                    model: Some(ModelMatch { match_type: Some("Exact".into()), value: model.into() }),
                }],
                targets: targets
                    .iter()
                    .map(|(m, w)| RewriteTarget { weight: Some(*w), model_rewrite: (*m).into() })
                    .collect(),
            }],
        },
    );
    r.metadata.namespace = Some(NS.into());
    r
}

#[tokio::test]
async fn model_table_follows_the_crds() {
    let server = server().await;
    server.create(&objective("premium", Some(10), "llama")).unwrap();
    server.create(&objective("other-pool", Some(99), "mistral")).unwrap();
    server.create(&rewrite("canary", "llama", "chat", &[("llama-v1", 90), ("llama-v2", 10)])).unwrap();

    let table = watch_models(server.client(NS).unwrap(), PoolRef { namespace: NS.into(), name: "llama".into() });
    let t = table.wait_for(BOUND, |t| t.synced).await.expect("synced");
    assert_eq!(t.priority(Some("premium")), 10);
    assert_eq!(t.priority(Some("other-pool")), 0, "another pool's objective does not apply");
    let rule = t.rule_for("chat").unwrap();
    assert_eq!(
        rule.targets.iter().map(|t| (t.model.as_str(), t.weight)).collect::<Vec<_>>(),
        [("llama-v1", Some(90)), ("llama-v2", Some(10))]
    );

    // Shift the canary, add a priority, delete an objective.
    server
        .modify::<InferenceModelRewrite>(NS, "canary", |r| {
            r.spec.rules[0].targets[0].weight = Some(50);
            r.spec.rules[0].targets[1].weight = Some(50);
        })
        .unwrap();
    table
        .wait_for(BOUND, |t| t.rule_for("chat").is_some_and(|r| r.targets[0].weight == Some(50)))
        .await
        .expect("weights");
    server.create(&objective("batch", Some(-5), "llama")).unwrap();
    table.wait_for(BOUND, |t| t.priority(Some("batch")) == -5).await.expect("batch");
    server.delete::<InferenceObjective>(NS, "premium").unwrap();
    table.wait_for(BOUND, |t| t.priority(Some("premium")) == 0).await.expect("premium gone");

    // A relist after 410 (the rewrite deleted while the server was unreachable).
    let lists = server.counts::<InferenceModelRewrite>().lists;
    server.store().pause();
    server.delete::<InferenceModelRewrite>(NS, "canary").unwrap();
    server.store().expire_history();
    server.store().resume();
    table.wait_for(BOUND, |t| t.rule_for("chat").is_none()).await.expect("relisted");
    assert!(eventually(|| server.counts::<InferenceModelRewrite>().lists > lists).await);
}

#[tokio::test]
async fn without_the_crds_the_table_is_synced_and_empty() {
    // The model CRDs are not registered: lists answer 404, as a cluster without them does.
    let server = ApiServer::start().await.unwrap();
    let table = watch_models(server.client(NS).unwrap(), PoolRef { namespace: NS.into(), name: "llama".into() });
    let t = table.wait_for(BOUND, |t| t.synced).await.expect("synced although absent");
    assert!(t.rules.is_empty() && t.objectives.is_empty());
    assert!(table.stats().errors.load(std::sync::atomic::Ordering::Relaxed) >= 2, "both 404s counted");
}

/// A GIE-only cluster (no llm-d CRDs) stays quiet: the 404 lists back off exponentially towards
/// the slow timer instead of repeating about 6 times a second each, and each missing CRD is
/// logged once, naming it.
#[tokio::test]
async fn without_the_crds_lists_back_off_and_log_once() {
    use std::sync::atomic::Ordering::Relaxed;
    let server = ApiServer::start().await.unwrap();
    let table = watch_models(server.client(NS).unwrap(), PoolRef { namespace: NS.into(), name: "llama".into() });
    table.wait_for(BOUND, |t| t.synced).await.expect("synced although absent");
    // Over 5 s the delays (each drawn from the upper half of 0.2, 0.4, 0.8, 1.6, 3.2 s) allow at
    // most 7 lists per CRD; without the backoff it was about 30.
    const WINDOW: std::time::Duration = std::time::Duration::from_secs(5);
    tokio::time::sleep(WINDOW).await;
    let requests = server.store().requests();
    let lists = |plural: &str| {
        requests.iter().filter(|r| r.starts_with("GET ") && r.contains(plural) && !r.contains("watch=true")).count()
    };
    for plural in ["/inferenceobjectives", "/inferencemodelrewrites"] {
        let n = lists(plural);
        assert!((1..=8).contains(&n), "{plural}: {n} lists in {WINDOW:?}: {requests:?}");
    }
    let stats = table.stats();
    assert_eq!(stats.warnings.load(Relaxed), 2, "one WARN per missing CRD, {} errors", stats.errors.load(Relaxed));
    let last = stats.last_error().unwrap();
    assert!(last.contains("llm-d.ai/") && last.contains("in namespace inference"), "names the resource: {last}");
    assert!(table.current().synced && table.current().rules.is_empty());
}
