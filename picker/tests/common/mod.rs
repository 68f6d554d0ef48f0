//! Fixtures shared by the picker's trust tests (`trust.rs`, `token_identity.rs`).

use std::sync::Arc;

use kvroute_cluster::{PoolPod, PoolSpecView, PoolView, Source};

/// A file-sourced pool view of two Ready pods on port 8000 in `namespace`: `engine-0` on
/// `node-a` (10.0.0.1) and `engine-1` on `node-b` (10.0.0.2), the nodes agents report for.
pub fn two_node_pool_view(namespace: &str) -> PoolView {
    let pod = |name: &str, node: &str, ip: &str| PoolPod {
        name: name.into(),
        namespace: namespace.into(),
        uid: None,
        node: Some(node.into()),
        ip: Some(ip.parse().unwrap()),
        ready: true,
        terminating: false,
        ports: vec![(0, 8000)],
        labels: Arc::default(),
        annotations: Arc::default(),
    };
    let spec = PoolSpecView { target_ports: vec![8000], ..Default::default() };
    PoolView::build(
        Source::File("pool.yaml".into()),
        Some(spec),
        [pod("engine-0", "node-a", "10.0.0.1"), pod("engine-1", "node-b", "10.0.0.2")],
        true,
    )
}
