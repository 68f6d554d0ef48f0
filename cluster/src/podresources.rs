//! GPUs per pod from the kubelet's PodResources API v1 (gRPC on the unix socket
//! `/var/lib/kubelet/pod-resources/kubelet.sock`, `List`), so the agent can tie NVML devices to
//! engines by UUID. docs/design.md §14.
//!
//! Device ids of `nvidia.com/gpu` are what the NVIDIA device plugin advertises: GPU UUIDs
//! (`GPU-…`) by default (`--device-id-strategy=uuid`), NVML indices with `index`, `MIG-…` UUIDs
//! for MIG devices (resources `nvidia.com/gpu` or `nvidia.com/mig-<profile>`), and `<id>::<n>`
//! for time-sliced replicas of one device (the suffix is dropped here).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::ClusterError;
use crate::watch::{Publisher, Watched};

/// The generated PodResources v1 client and messages.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("v1");
}

/// The kubelet's socket path.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// The NVIDIA GPU extended resource.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";
/// Deadline of one `List` call.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest `List` answer accepted.
pub const MAX_LIST_BYTES: usize = 16 << 20;

/// One GPU given to a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGpu {
    /// Container name.
    pub container: String,
    /// Resource name (`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`, …).
    pub resource: String,
    /// Device id as the kubelet lists it (time-slicing suffix removed).
    pub device_id: String,
    /// The UUID (`GPU-…` / `MIG-…`) when the id is one.
    pub uuid: Option<String>,
    /// The NVML index when the id is one (device plugin `--device-id-strategy=index`).
    pub index: Option<u32>,
}

impl PodGpu {
    fn new(container: &str, resource: &str, id: &str) -> Self {
        let id = id.split_once("::").map_or(id, |(base, _)| base);
        let uuid = (id.starts_with("GPU-") || id.starts_with("MIG-")).then(|| id.to_string());
        let index = id.parse::<u32>().ok();
        Self { container: container.into(), resource: resource.into(), device_id: id.into(), uuid, index }
    }
}

/// Whether `resource` is an NVIDIA GPU resource.
pub fn is_gpu_resource(resource: &str) -> bool {
    resource == NVIDIA_GPU || resource.starts_with("nvidia.com/mig-")
}

/// GPUs of every pod on the node: an immutable snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeGpus {
    /// `(namespace, pod)` → its GPUs (pods without GPUs are absent).
    pub pods: BTreeMap<(String, String), Vec<PodGpu>>,
    /// A `List` has succeeded.
    pub synced: bool,
    /// Bumped on every published change.
    pub generation: u64,
}

crate::watch::snapshot_impl!(NodeGpus);

impl NodeGpus {
    /// From a `List` answer.
    pub fn from_list(resp: &proto::ListPodResourcesResponse) -> Self {
        let mut pods = BTreeMap::new();
        for p in &resp.pod_resources {
            let gpus: Vec<PodGpu> = p
                .containers
                .iter()
                .flat_map(|c| {
                    c.devices.iter().filter(|d| is_gpu_resource(&d.resource_name)).flat_map(move |d| {
                        d.device_ids.iter().map(move |id| PodGpu::new(&c.name, &d.resource_name, id))
                    })
                })
                .collect();
            if !gpus.is_empty() {
                pods.insert((p.namespace.clone(), p.name.clone()), gpus);
            }
        }
        Self { pods, synced: true, generation: 0 }
    }

    /// The GPUs of `namespace/pod`, optionally of one container.
    pub fn of_pod(&self, namespace: &str, pod: &str, container: Option<&str>) -> Vec<&PodGpu> {
        self.pods
            .get(&(namespace.to_string(), pod.to_string()))
            .map(|g| g.iter().filter(|g| container.is_none_or(|c| g.container == c)).collect())
            .unwrap_or_default()
    }

    /// Content equality, generation aside.
    pub fn same_content(&self, other: &Self) -> bool {
        self.pods == other.pods && self.synced == other.synced
    }
}

/// A PodResources client on the kubelet's unix socket.
#[derive(Debug, Clone)]
pub struct PodResourcesClient {
    inner: proto::pod_resources_lister_client::PodResourcesListerClient<Channel>,
}

impl PodResourcesClient {
    /// Connects lazily to the socket at `path` (the first call dials; a kubelet restart is
    /// survived by the channel's reconnect).
    ///
    /// # Errors
    /// The endpoint could not be built.
    pub fn connect(path: &Path) -> Result<Self, ClusterError> {
        let path: PathBuf = path.to_path_buf();
        let p = path.clone();
        // The URI is required by the API and ignored by the connector.
        let channel = Endpoint::from_static("http://kubelet.sock")
            .connect_timeout(Duration::from_secs(2))
            .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let p = p.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
            }));
        let inner = proto::pod_resources_lister_client::PodResourcesListerClient::new(channel)
            .max_decoding_message_size(MAX_LIST_BYTES);
        Ok(Self { inner })
    }

    /// `List`: the GPUs of every pod on the node.
    ///
    /// # Errors
    /// The call failed or took longer than [`LIST_TIMEOUT`].
    pub async fn list(&mut self) -> Result<NodeGpus, ClusterError> {
        let call = self.inner.list(proto::ListPodResourcesRequest {});
        let resp = tokio::time::timeout(LIST_TIMEOUT, call)
            .await
            .map_err(|_| ClusterError::PodResourcesTimeout(LIST_TIMEOUT))??;
        Ok(NodeGpus::from_list(resp.get_ref()))
    }
}

/// Polls `List` every `interval` and publishes the node's GPUs when they change (pods come and
/// go with their GPUs). Errors keep the last good snapshot and are counted in the stats.
pub fn watch_node_gpus(path: &Path, interval: Duration) -> Result<Watched<NodeGpus>, ClusterError> {
    let mut client = PodResourcesClient::connect(path)?;
    let (publisher, watched) = Publisher::new(NodeGpus::default());
    tokio::spawn(async move {
        let stats = publisher.stats().clone();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = publisher.closed() => return,
                _ = tick.tick() => match client.list().await {
                    Ok(gpus) => {
                        stats.events.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        publisher.publish(gpus);
                    }
                    Err(e) => stats.error("PodResources", &e),
                },
            }
        }
    });
    Ok(watched)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_classified() {
        let g = PodGpu::new("c", NVIDIA_GPU, "GPU-8f2a-11aa::3");
        assert_eq!((g.device_id.as_str(), g.uuid.as_deref(), g.index), ("GPU-8f2a-11aa", Some("GPU-8f2a-11aa"), None));
        let i = PodGpu::new("c", NVIDIA_GPU, "2");
        assert_eq!((i.uuid, i.index), (None, Some(2)));
        let m = PodGpu::new("c", "nvidia.com/mig-1g.10gb", "MIG-aa-bb");
        assert_eq!(m.uuid.as_deref(), Some("MIG-aa-bb"));
        assert!(is_gpu_resource("nvidia.com/mig-3g.40gb") && !is_gpu_resource("example.com/fpga"));
    }

    #[test]
    fn list_answer_maps_pods_to_gpus() {
        let resp = proto::ListPodResourcesResponse {
            pod_resources: vec![
                proto::PodResources {
                    name: "vllm-0".into(),
                    namespace: "ns".into(),
                    containers: vec![proto::ContainerResources {
                        name: "vllm".into(),
                        devices: vec![
                            proto::ContainerDevices {
                                resource_name: NVIDIA_GPU.into(),
                                device_ids: vec!["GPU-a".into(), "GPU-b".into()],
                                topology: None,
                            },
                            proto::ContainerDevices {
                                resource_name: "example.com/nic".into(),
                                device_ids: vec!["nic0".into()],
                                topology: None,
                            },
                        ],
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                proto::PodResources { name: "cpu-only".into(), namespace: "ns".into(), ..Default::default() },
            ],
        };
        let g = NodeGpus::from_list(&resp);
        assert_eq!(g.pods.len(), 1);
        let uuids: Vec<_> = g.of_pod("ns", "vllm-0", Some("vllm")).iter().filter_map(|g| g.uuid.as_deref()).collect();
        assert_eq!(uuids, ["GPU-a", "GPU-b"]);
        assert!(g.of_pod("ns", "vllm-0", Some("other")).is_empty());
        assert!(g.of_pod("ns", "cpu-only", None).is_empty());
    }
}
