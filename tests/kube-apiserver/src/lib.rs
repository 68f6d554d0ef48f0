//! Stand-ins for the two Kubernetes APIs kvroute reads, for tests and the local demo where no
//! cluster can run (no registry reachable here ships a kube-apiserver or a kubelet):
//! - [`apiserver`]: the API server's REST list/watch protocol over HTTP, as kube-rs speaks it;
//! - [`kubelet`]: the kubelet's PodResources v1 gRPC service on a unix socket.
//!
//! Both exist only because the real thing cannot run here; their wire formats follow the real
//! ones (recorded API-server responses are checked in `tests/wire.rs`).

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod apiserver;
pub mod kubelet;
pub mod objects;

pub use apiserver::{ApiError, ApiServer, BoundPod, Options, ResourceType, Store, TokenSpec};
pub use objects::endpoint_slice;
