//! The agent's node watcher against the API stand-in: only the pool's pods on its node (asked
//! with the field selector `spec.nodeName`), engines with KV endpoints from `--kv-events-config`,
//! following adds, re-addressing, annotation overrides and deletions, and surviving a relist.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kvroute_cluster::crd::InferencePool;
use kvroute_cluster::engine::KV_EVENTS_PORT_ANNOTATION;
use kvroute_cluster::{NodeView, PoolRef, watch_node};

fn engines(v: &NodeView) -> Vec<(String, String, Option<String>, Option<String>)> {
    v.engines
        .iter()
        .map(|e| (e.endpoint.clone(), e.http.to_string(), e.kv_events.clone(), e.kv_replay.clone()))
        .collect()
}

fn eng(name: &str, http: &str, kv: &str, replay: &str) -> (String, String, Option<String>, Option<String>) {
    (name.into(), http.into(), Some(kv.into()), Some(replay.into()))
}

#[tokio::test]
async fn node_view_follows_its_pods_only() {
    let server = server().await;
    server.create(&pool("llama", &[("app", "vllm")], &[8000])).unwrap();
    server.create(&pod("a", "n1", Some("10.0.0.1"), true)).unwrap();
    server.create(&pod("b", "n2", Some("10.0.0.2"), true)).unwrap();
    server.create(&pod("pending", "n1", None, false)).unwrap();

    let view =
        watch_node(server.client(NS).unwrap(), PoolRef { namespace: NS.into(), name: "llama".into() }, "n1".into());
    let v = view.wait_for(BOUND, |v| v.synced).await.expect("synced");
    assert_eq!(engines(&v), [eng("a-rank-0", "10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")]);
    let a = &v.engines[0];
    assert_eq!(
        (a.container.as_deref(), a.model.as_deref(), a.ready),
        (Some("vllm"), Some("Qwen/Qwen2.5-7B-Instruct"), true)
    );
    assert!(
        server
            .store()
            .requests()
            .iter()
            .any(|r| r.contains("/pods?") && r.contains("fieldSelector=spec.nodeName%3Dn1")),
        "the pod watch is narrowed to the node by the server: {:?}",
        server.store().requests()
    );

    // The pending pod gets its IP: its engine starts.
    server.modify::<Pod>(NS, "pending", |p| set_ip(p, "10.0.0.3")).unwrap();
    let v = view.wait_for(BOUND, |v| v.engine("pending-rank-0").is_some()).await.expect("pending started");
    assert!(!v.engine("pending-rank-0").unwrap().ready, "running but not Ready yet: the agent watches it anyway");

    // Re-addressed, with an annotation moving the KV port.
    server
        .modify::<Pod>(NS, "a", |p| {
            set_ip(p, "10.0.9.1");
            p.metadata.annotations = Some([(KV_EVENTS_PORT_ANNOTATION.to_string(), "6000".to_string())].into());
        })
        .unwrap();
    let v = view
        .wait_for(BOUND, |v| v.engine("a-rank-0").is_some_and(|e| e.http.to_string() == "10.0.9.1:8000"))
        .await
        .expect("a moved");
    let a = v.engine("a-rank-0").unwrap();
    assert_eq!(
        (a.kv_events.as_deref(), a.kv_replay.as_deref()),
        (Some("tcp://10.0.9.1:6000"), Some("tcp://10.0.9.1:5558"))
    );

    // A second target port: a second engine, its KV ports offset by the rank as vLLM does.
    server
        .modify::<Pod>(NS, "pending", |p| {
            p.spec.as_mut().unwrap().containers[0]
                .ports
                .as_mut()
                .unwrap()
                .push(k8s_openapi::api::core::v1::ContainerPort { container_port: 8001, ..Default::default() });
        })
        .unwrap();
    server
        .modify::<InferencePool>(NS, "llama", |p| {
            p.spec.target_ports.push(kvroute_cluster::crd::PoolPort { number: 8001 })
        })
        .unwrap();
    let v = view.wait_for(BOUND, |v| v.engine("pending-rank-1").is_some()).await.expect("rank 1");
    let r1 = v.engine("pending-rank-1").unwrap();
    assert_eq!((r1.http.to_string().as_str(), r1.kv_events.as_deref()), ("10.0.0.3:8001", Some("tcp://10.0.0.3:5558")));

    // Deleted: its engines stop.
    server.delete::<Pod>(NS, "pending").unwrap();
    view.wait_for(BOUND, |v| v.engines.iter().all(|e| e.pod != "pending")).await.expect("pending deleted");

    // A pod moving onto the node (a new pod of the same name, scheduled here) shows up.
    server.delete::<Pod>(NS, "b").unwrap();
    server.create(&pod("b", "n1", Some("10.0.0.22"), true)).unwrap();
    view.wait_for(BOUND, |v| v.engine("b-rank-0").is_some()).await.expect("b on n1");

    // A relist after 410 keeps the view right.
    server.store().pause();
    server.delete::<Pod>(NS, "b").unwrap();
    server.store().expire_history();
    server.store().resume();
    let v = view.wait_for(BOUND, |v| v.engine("b-rank-0").is_none()).await.expect("relisted");
    assert_eq!(v.engines.len(), 2, "a's two ranks remain: {:?}", engines(&v));
    assert!(eventually(|| server.counts::<Pod>().expired >= 1).await);
}
