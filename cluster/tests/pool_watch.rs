//! The picker's pool watcher against the API stand-in: it follows pods being added, turning
//! unready, moving to a new IP, leaving the selector and being deleted, pool spec changes, a
//! dropped watch connection and a `410 Gone` relist, each within the bound.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kvroute_cluster::crd::InferencePool;
use kvroute_cluster::{PoolRef, PoolView, watch_pool};

fn endpoints(v: &PoolView) -> Vec<(String, String, bool)> {
    v.endpoints.iter().map(|e| (e.name.clone(), e.addr.to_string(), e.ready)).collect()
}

fn e(name: &str, addr: &str, ready: bool) -> (String, String, bool) {
    (name.into(), addr.into(), ready)
}

#[tokio::test]
async fn pool_view_follows_pods_and_the_pool() {
    let server = server().await;
    server.create(&pool("llama", &[("app", "vllm")], &[8000])).unwrap();
    server.create(&pod("a", "n1", Some("10.0.0.1"), true)).unwrap();
    server.create(&pod("b", "n2", Some("10.0.0.2"), false)).unwrap();
    let mut other = pod("sglang", "n1", Some("10.0.0.9"), true);
    other.metadata.labels = Some([("app".to_string(), "sglang".to_string())].into());
    server.create(&other).unwrap();
    let client = server.client(NS).unwrap();

    let view = watch_pool(client, PoolRef { namespace: NS.into(), name: "llama".into() });
    let v = view.wait_for(BOUND, |v| v.synced).await.expect("synced");
    assert_eq!(endpoints(&v), [e("a-rank-0", "10.0.0.1:8000", true), e("b-rank-0", "10.0.0.2:8000", false)]);
    assert_eq!(v.candidates().count(), 1);
    assert_eq!(v.pool.as_ref().unwrap().target_ports, [8000]);
    // The pod watch asked the server for the pool's selector, in the pool's namespace.
    assert!(
        server
            .store()
            .requests()
            .iter()
            .any(|r| r.starts_with("GET /api/v1/namespaces/inference/pods?") && r.contains("labelSelector=app%3Dvllm"))
    );

    // A new Ready pod is a candidate at once.
    server.create(&pod("c", "n1", Some("10.0.0.3"), true)).unwrap();
    view.wait_for(BOUND, |v| v.endpoint("c-rank-0").is_some_and(|e| e.ready)).await.expect("c added");

    // Unready: no longer a candidate.
    server.modify::<Pod>(NS, "a", |p| set_ready(p, false)).unwrap();
    view.wait_for(BOUND, |v| v.endpoint("a-rank-0").is_some_and(|e| !e.ready)).await.expect("a unready");

    // Terminating (deletionTimestamp set) is not ready either, even with Ready=True.
    server
        .modify::<Pod>(NS, "c", |p| {
            p.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()))
        })
        .unwrap();
    view.wait_for(BOUND, |v| v.endpoint("c-rank-0").is_some_and(|e| !e.ready)).await.expect("c terminating");

    // Re-addressed: the endpoint moves with the Pod object.
    server
        .modify::<Pod>(NS, "b", |p| {
            set_ip(p, "10.0.1.2");
            set_ready(p, true);
        })
        .unwrap();
    let v = view
        .wait_for(BOUND, |v| v.endpoint("b-rank-0").is_some_and(|e| e.addr.to_string() == "10.0.1.2:8000" && e.ready))
        .await
        .expect("b moved");
    assert!(v.endpoint_at("10.0.0.2:8000".parse().unwrap()).is_none(), "the old address is gone");

    // Deleted.
    server.delete::<Pod>(NS, "c").unwrap();
    view.wait_for(BOUND, |v| v.endpoint("c-rank-0").is_none() && !v.pods.contains_key("c")).await.expect("c deleted");

    // Leaving and joining the selector (labels change: the server turns them into DELETED/ADDED).
    server
        .modify::<Pod>(NS, "b", |p| p.metadata.labels = Some([("app".to_string(), "other".to_string())].into()))
        .unwrap();
    view.wait_for(BOUND, |v| !v.pods.contains_key("b")).await.expect("b left the selector");
    server
        .modify::<Pod>(NS, "sglang", |p| p.metadata.labels = Some([("app".to_string(), "vllm".to_string())].into()))
        .unwrap();
    view.wait_for(BOUND, |v| v.endpoint("sglang-rank-0").is_some()).await.expect("sglang joined");

    // More target ports: one endpoint per rank.
    server
        .modify::<InferencePool>(NS, "llama", |p| {
            p.spec.target_ports.push(kvroute_cluster::crd::PoolPort { number: 8001 })
        })
        .unwrap();
    let v = view.wait_for(BOUND, |v| v.endpoint("sglang-rank-1").is_some()).await.expect("rank 1");
    assert_eq!(v.endpoint("sglang-rank-1").unwrap().addr.to_string(), "10.0.0.9:8001");

    // A new selector restarts the pod watch with it; the view switches from the old pods to the
    // new ones in one step (never an unsynced or empty view in between).
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut rx = view.subscribe();
    let record = seen.clone();
    let collector = tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let v = rx.borrow_and_update().clone();
            record.lock().unwrap().push((v.synced, v.pods.len()));
        }
    });
    server
        .modify::<InferencePool>(NS, "llama", |p| {
            p.spec.selector.match_labels = [("app".to_string(), "other".to_string())].into();
        })
        .unwrap();
    let v = view
        .wait_for(BOUND, |v| v.synced && v.pods.keys().collect::<Vec<_>>() == ["b"])
        .await
        .expect("selector switched");
    assert_eq!(v.endpoint("b-rank-0").unwrap().addr.to_string(), "10.0.1.2:8000");
    assert!(server.store().requests().iter().any(|r| r.contains("labelSelector=app%3Dother")));
    collector.abort();
    let seen = seen.lock().unwrap().clone();
    assert!(seen.iter().all(|(synced, pods)| *synced && *pods > 0), "{seen:?}");

    // The pool goes away: no pool, no endpoints.
    server.delete::<InferencePool>(NS, "llama").unwrap();
    let v = view.wait_for(BOUND, |v| v.pool.is_none()).await.expect("pool deleted");
    assert!(v.endpoints.is_empty() && v.synced);
    assert_eq!(view.stats().errors.load(std::sync::atomic::Ordering::Relaxed), 0, "{:?}", view.stats().last_error());
}

#[tokio::test]
async fn pool_view_survives_dropped_watches_and_410_relists() {
    let server = server().await;
    server.create(&pool("llama", &[("app", "vllm")], &[8000])).unwrap();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        server.create(&pod(name, "n1", Some(&format!("10.0.0.{i}")), true)).unwrap();
    }
    let view = watch_pool(server.client(NS).unwrap(), PoolRef { namespace: NS.into(), name: "llama".into() });
    view.wait_for(BOUND, |v| v.synced && v.candidates().count() == 3).await.expect("synced");
    let lists_before = server.counts::<Pod>().lists;

    // A dropped connection: the watcher resumes from its resourceVersion, no relist, and misses nothing.
    let watches_before = server.counts::<Pod>().watches;
    server.store().drop_watches();
    assert!(eventually(|| server.counts::<Pod>().watches > watches_before).await, "the watcher reconnects");
    server.create(&pod("d", "n1", Some("10.0.0.4"), true)).unwrap();
    view.wait_for(BOUND, |v| v.endpoint("d-rank-0").is_some()).await.expect("d after reconnect");
    assert_eq!(server.counts::<Pod>().lists, lists_before, "a resumed watch needs no list");

    // The server is unreachable for a while; meanwhile a pod is deleted and the history is
    // compacted. The resumed watch gets 410 Expired, the watcher relists, and the relist (which
    // replaces the local copy whole) drops the pod it never saw a DELETED event for.
    server.store().pause();
    server.delete::<Pod>(NS, "a").unwrap();
    server.store().expire_history();
    server.store().resume();
    let v = view.wait_for(BOUND, |v| !v.pods.contains_key("a")).await.expect("relisted");
    assert_eq!(v.candidates().count(), 3);
    assert!(eventually(|| server.counts::<Pod>().expired >= 1).await, "the stand-in answered 410");
    assert!(eventually(|| server.counts::<Pod>().lists > lists_before).await, "and the watcher relisted");
    assert!(view.stats().lists.load(std::sync::atomic::Ordering::Relaxed) >= 2);

    // Still live after the relist.
    server.modify::<Pod>(NS, "b", |p| set_ready(p, false)).unwrap();
    view.wait_for(BOUND, |v| v.endpoint("b-rank-0").is_some_and(|e| !e.ready)).await.expect("live after relist");
}

#[tokio::test]
async fn a_missing_pool_is_synced_and_empty_until_created() {
    let server = server().await;
    server.create(&pod("a", "n1", Some("10.0.0.1"), true)).unwrap();
    let view = watch_pool(server.client(NS).unwrap(), PoolRef { namespace: NS.into(), name: "later".into() });
    let v = view.wait_for(BOUND, |v| v.synced).await.expect("synced");
    assert!(v.pool.is_none() && v.endpoints.is_empty());
    server.create(&pool("later", &[("app", "vllm")], &[8000])).unwrap();
    let v = view.wait_for(BOUND, |v| v.synced && v.candidates().count() == 1).await.expect("pool created");
    assert!(v.generation >= 2);
}
