//! Fixtures shared by the picker's trust tests (`trust.rs`, `token_identity.rs`).

use std::sync::Arc;

use kvroute_cluster::{PoolPod, PoolSpecView, PoolView, Source};
use kvroute_common::BlockHash;

/// The engines of [`two_node_pool_view`]'s pods, and their addresses.
pub const E0: &str = "engine-0-rank-0";
pub const E1: &str = "engine-1-rank-0";
pub const E0_ADDR: &str = "10.0.0.1:8000";
pub const E1_ADDR: &str = "10.0.0.2:8000";
/// An address outside the pool, which a rogue agent claims.
pub const ROGUE_ADDR: &str = "10.66.6.6:8000";

/// The prompt the real engine-0 holds: block hashes 1..=8.
pub fn prompt() -> Vec<BlockHash> {
    (1..=8).map(BlockHash).collect()
}

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
