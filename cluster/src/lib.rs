//! kvroute's view of the cluster (docs/design.md §14): which pods the picker may route to, which
//! engines the agent on a node serves, which GPUs they hold, which models clients may ask for, and
//! where the picker replicas are, from the Kubernetes API or, without Kubernetes, from watched
//! files. Every source publishes the same immutable snapshots through [`Watched`], so the picker
//! and the agent consume one type whichever the source.
//!
//! | Snapshot | From Kubernetes | From a file |
//! |---|---|---|
//! | [`PoolView`] (picker candidates) | [`watch_pool`]: InferencePool + selected Pods | [`watch_pool_file`] |
//! | [`ModelTable`] (rewrites, priorities) | [`watch_models`]: InferenceModelRewrite + InferenceObjective | [`watch_pool_file`] |
//! | [`NodeView`] (the agent's engines) | [`watch_node`]: the pool's Pods with `spec.nodeName` | [`watch_engine_file`] |
//! | [`NodeGpus`] (pod → GPU UUIDs) | [`watch_node_gpus`]: kubelet PodResources `List` | engine file `gpus` |
//! | [`ReplicaView`] (picker replicas) | [`watch_picker_replicas`]: EndpointSlices | agent config |

pub mod api;
pub mod crd;
pub mod engine;
pub mod error;
pub mod file;
pub mod models;
pub mod podresources;
pub mod pool;
pub mod replicas;
pub mod watch;

pub use api::{PoolRef, client_from_env, pool_namespace, watch_models, watch_node, watch_pool};
pub use engine::{EngineSpec, GpuRef, NodeView};
pub use error::ClusterError;
pub use file::{watch_engine_file, watch_pool_file};
pub use models::{ModelRule, ModelTable, ModelTarget};
pub use podresources::{NodeGpus, PodGpu, PodResourcesClient, watch_node_gpus};
pub use pool::{PoolEndpoint, PoolPod, PoolSpecView, PoolView, Source};
pub use replicas::{PickerReplica, ReplicaView, watch_picker_replicas};
pub use watch::{WatchStats, Watched};
