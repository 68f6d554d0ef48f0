//! A stand-in for the kubelet's PodResources v1 gRPC service, served on a unix socket like
//! `/var/lib/kubelet/pod-resources/kubelet.sock`, from the same proto the client compiles
//! (`cluster/proto/kubelet/podresources/v1/api.proto`). Tests set what each pod's containers were
//! given; `List` answers with it, `Get` with one pod (`NotFound` otherwise).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

/// The generated PodResources v1 messages and server.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("v1");
}

use proto::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};

/// The extended resource name of NVIDIA GPUs (the NVIDIA device plugin's).
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";

#[derive(Default)]
struct State {
    pods: Mutex<Vec<proto::PodResources>>,
    allocatable: Mutex<Vec<proto::ContainerDevices>>,
    list_calls: AtomicU64,
}

struct Service(Arc<State>);

fn pods(state: &State) -> std::sync::MutexGuard<'_, Vec<proto::PodResources>> {
    state.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[tonic::async_trait]
impl PodResourcesLister for Service {
    async fn list(
        &self,
        _request: Request<proto::ListPodResourcesRequest>,
    ) -> Result<Response<proto::ListPodResourcesResponse>, Status> {
        self.0.list_calls.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(proto::ListPodResourcesResponse { pod_resources: pods(&self.0).clone() }))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<proto::AllocatableResourcesRequest>,
    ) -> Result<Response<proto::AllocatableResourcesResponse>, Status> {
        let devices = self.0.allocatable.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        Ok(Response::new(proto::AllocatableResourcesResponse { devices, cpu_ids: vec![], memory: vec![] }))
    }

    async fn get(
        &self,
        request: Request<proto::GetPodResourcesRequest>,
    ) -> Result<Response<proto::GetPodResourcesResponse>, Status> {
        let r = request.into_inner();
        pods(&self.0)
            .iter()
            .find(|p| p.name == r.pod_name && p.namespace == r.pod_namespace)
            .map(|p| Response::new(proto::GetPodResourcesResponse { pod_resources: Some(p.clone()) }))
            .ok_or_else(|| Status::not_found(format!("pod {} in namespace {} not found", r.pod_name, r.pod_namespace)))
    }
}

/// A running PodResources stand-in; removes its socket and stops when dropped.
pub struct PodResourcesServer {
    path: PathBuf,
    state: Arc<State>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl PodResourcesServer {
    /// Serves on a new unix socket at `path` (an existing file there is replaced).
    ///
    /// # Errors
    /// The socket could not be bound.
    pub async fn start(path: &Path) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)?;
        let state = Arc::new(State::default());
        let svc = PodResourcesListerServer::new(Service(state.clone()));
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            // Graceful: open connections are closed too (GOAWAY), as when the kubelet exits.
            let served = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stop.await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "PodResources stand-in stopped");
            }
        });
        Ok(Self { path: path.to_path_buf(), state, shutdown: Some(shutdown) })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces every pod's resources.
    pub fn set_pods(&self, pods_now: Vec<proto::PodResources>) {
        *pods(&self.state) = pods_now;
    }

    /// Sets (or replaces) one pod whose container `container` holds `gpus` (`nvidia.com/gpu`
    /// device ids, e.g. `GPU-…` UUIDs).
    pub fn set_gpu_pod(&self, namespace: &str, name: &str, container: &str, gpus: &[&str]) {
        let pod = gpu_pod(namespace, name, container, gpus);
        let mut all = pods(&self.state);
        all.retain(|p| !(p.name == name && p.namespace == namespace));
        all.push(pod);
    }

    /// Removes one pod.
    pub fn remove_pod(&self, namespace: &str, name: &str) {
        pods(&self.state).retain(|p| !(p.name == name && p.namespace == namespace));
    }

    /// Sets what `GetAllocatableResources` answers.
    pub fn set_allocatable(&self, devices: Vec<proto::ContainerDevices>) {
        *self.state.allocatable.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = devices;
    }

    /// `List` calls served so far.
    pub fn list_calls(&self) -> u64 {
        self.state.list_calls.load(Ordering::Relaxed)
    }
}

impl Drop for PodResourcesServer {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A pod whose container `container` holds the `nvidia.com/gpu` devices `gpus`, with one NUMA node.
pub fn gpu_pod(namespace: &str, name: &str, container: &str, gpus: &[&str]) -> proto::PodResources {
    proto::PodResources {
        name: name.into(),
        namespace: namespace.into(),
        containers: vec![proto::ContainerResources {
            name: container.into(),
            devices: vec![proto::ContainerDevices {
                resource_name: NVIDIA_GPU.into(),
                device_ids: gpus.iter().map(|g| (*g).to_string()).collect(),
                topology: Some(proto::TopologyInfo { nodes: vec![proto::NumaNode { id: 0 }] }),
            }],
            cpu_ids: vec![],
            memory: vec![],
            dynamic_resources: vec![],
        }],
        cpu_ids: vec![],
        memory: vec![],
    }
}
