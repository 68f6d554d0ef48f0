//! `kube-apiserver-stand-in`: serves the Kubernetes list/watch API (and optionally the kubelet
//! PodResources API) for the local demo and manual tests on hosts without a cluster.
//!
//! ```text
//! kube-apiserver-stand-in --listen 127.0.0.1:6443 --objects demo.yaml --kubeconfig-out kubeconfig \
//!     [--pod-resources-socket /tmp/kubelet.sock --pod-resources gpus.yaml]
//! ```
//! `--objects`: multi-document YAML of Pods, EndpointSlices, InferencePools, InferenceObjectives,
//! InferenceModelRewrites, created at start. Afterwards objects change through the API itself
//! (`POST`/`PUT`/`DELETE`, e.g. with curl). `--kubeconfig-out` writes a kubeconfig pointing at the
//! server, for `KUBECONFIG=…`. `--pod-resources`: YAML list of
//! `{namespace, name, containers: [{name, gpus: [GPU-…]}]}`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use kvroute_kube_stand_in::kubelet::{PodResourcesServer, proto};
use kvroute_kube_stand_in::{ApiServer, Options, ResourceType};
use serde::Deserialize;

#[derive(Parser)]
#[command(version = kvroute_cli::LONG_VERSION, about = "Kubernetes API server and kubelet PodResources stand-ins (no cluster needed)")]
struct Args {
    /// Listen address of the API.
    #[arg(long, default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Objects to create at start (multi-document YAML); repeatable.
    #[arg(long)]
    objects: Vec<PathBuf>,
    /// Write a kubeconfig for this server here.
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// Default namespace written into the kubeconfig.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Serve the kubelet PodResources API on this unix socket.
    #[arg(long)]
    pod_resources_socket: Option<PathBuf>,
    /// GPUs per pod for the PodResources API (YAML).
    #[arg(long, requires = "pod_resources_socket")]
    pod_resources: Option<PathBuf>,
    /// Seconds between watch BOOKMARKs.
    #[arg(long, default_value_t = 60)]
    bookmark_interval_s: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuPod {
    namespace: String,
    name: String,
    containers: Vec<GpuContainer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuContainer {
    name: String,
    #[serde(default)]
    gpus: Vec<String>,
}

/// The custom resources kvroute reads.
fn custom_resources() -> [ResourceType; 5] {
    [
        ResourceType::custom("inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"),
        ResourceType::custom("llm-d.ai", "v1alpha2", "InferenceObjective", "inferenceobjectives"),
        ResourceType::custom("llm-d.ai", "v1alpha2", "InferenceModelRewrite", "inferencemodelrewrites"),
        ResourceType::custom("inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective", "inferenceobjectives"),
        ResourceType::custom(
            "inference.networking.x-k8s.io",
            "v1alpha2",
            "InferenceModelRewrite",
            "inferencemodelrewrites",
        ),
    ]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let args = Args::parse();
    let options = Options {
        bookmark_interval: std::time::Duration::from_secs(args.bookmark_interval_s.max(1)),
        ..Options::default()
    };
    let server =
        ApiServer::start_with(args.listen, options).await.with_context(|| format!("listen on {}", args.listen))?;
    for r in custom_resources() {
        server.store().register(r);
    }
    for path in &args.objects {
        let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        for doc in serde_norway::Deserializer::from_str(&text) {
            let obj = serde_json::Value::deserialize(doc).with_context(|| format!("parse {}", path.display()))?;
            if obj.is_null() {
                continue;
            }
            let (api_version, kind) = (obj["apiVersion"].as_str().unwrap_or(""), obj["kind"].as_str().unwrap_or(""));
            let Some(res) = server.store().resource_of(api_version, kind) else {
                bail!("{}: {api_version} {kind} is not served by the stand-in", path.display());
            };
            server
                .store()
                .create(&res, None, obj.clone())
                .with_context(|| format!("create {kind} from {}", path.display()))?;
        }
    }
    if let Some(out) = &args.kubeconfig_out {
        let kubeconfig = server.kubeconfig(&args.namespace);
        std::fs::write(out, kubeconfig).with_context(|| format!("write {}", out.display()))?;
    }
    let _kubelet = match &args.pod_resources_socket {
        Some(sock) => {
            let kubelet = PodResourcesServer::start(sock).await.with_context(|| format!("bind {}", sock.display()))?;
            if let Some(path) = &args.pod_resources {
                let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
                let pods: Vec<GpuPod> =
                    serde_norway::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
                let pods = pods
                    .into_iter()
                    .map(|p| proto::PodResources {
                        name: p.name,
                        namespace: p.namespace,
                        containers: p
                            .containers
                            .into_iter()
                            .map(|c| proto::ContainerResources {
                                name: c.name,
                                devices: vec![proto::ContainerDevices {
                                    resource_name: kvroute_kube_stand_in::kubelet::NVIDIA_GPU.into(),
                                    device_ids: c.gpus,
                                    topology: None,
                                }],
                                ..Default::default()
                            })
                            .collect(),
                        ..Default::default()
                    })
                    .collect();
                kubelet.set_pods(pods);
            }
            Some(kubelet)
        }
        None => None,
    };
    tracing::info!(url = %server.url(), "kube-apiserver stand-in serving");
    println!("{}", server.url());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
