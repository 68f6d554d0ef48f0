//! Shared by the discovery tests: a recording picker (the real `AgentIngest` gRPC service),
//! emulated vLLM engines on their own loopback addresses (one "pod IP" each, as in a cluster),
//! Kubernetes objects as the API server holds them, and a bounded poll.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use clap::Parser;
use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvroute_cluster::crd::{InferencePool, InferencePoolSpec, PoolPort, PoolSelector};
use kvroute_proto::agent::v1::agent_ingest_server::{AgentIngest, AgentIngestServer};
use kvroute_proto::agent::v1::{AgentMessage, PickerMessage, PodStats, agent_message};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

pub const NS: &str = "inference";
pub const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";
/// Every change must show within this bound.
pub const BOUND: Duration = Duration::from_secs(5);

/// What one agent stream told the picker.
#[derive(Debug, Default, Clone)]
pub struct StreamLog {
    /// Pods of every `Hello`, in order.
    pub hellos: Vec<Vec<String>>,
    /// Pods snapshotted, in order.
    pub snapshots: Vec<String>,
    /// Latest stats per pod.
    pub stats: HashMap<String, PodStats>,
    /// Block hashes the pod holds, from snapshots and deltas.
    pub blocks: HashMap<String, usize>,
    /// Pods whose last delta said goodbye (cleared, not ready).
    pub farewells: Vec<String>,
    /// The agent ended the stream.
    pub ended: bool,
}

impl StreamLog {
    /// Pods of the last `Hello`, sorted.
    pub fn pods(&self) -> Vec<String> {
        let mut p = self.hellos.last().cloned().unwrap_or_default();
        p.sort();
        p
    }

    fn apply(&mut self, m: AgentMessage) {
        match m.msg {
            Some(agent_message::Msg::Hello(h)) => self.hellos.push(h.pods.into_iter().map(|p| p.pod).collect()),
            Some(agent_message::Msg::Snapshot(s)) => {
                let pod = s.info.map(|i| i.pod).unwrap_or_default();
                self.blocks.insert(pod.clone(), s.blocks.iter().map(|r| r.hashes.len()).sum());
                if let Some(st) = s.stats {
                    self.stats.insert(pod.clone(), st);
                }
                self.snapshots.push(pod);
            }
            Some(agent_message::Msg::Delta(d)) => {
                let n = self.blocks.entry(d.pod.clone()).or_default();
                let cleared = d.blocks.as_ref().is_some_and(|b| b.cleared);
                if let Some(b) = &d.blocks {
                    if b.cleared {
                        *n = 0;
                    }
                    *n += b.stored.iter().map(|r| r.hashes.len()).sum::<usize>();
                    *n = n.saturating_sub(b.removed.len());
                }
                if let Some(st) = d.stats {
                    if cleared && !st.ready && st.health_score == 0.0 {
                        self.farewells.push(d.pod.clone());
                    }
                    self.stats.insert(d.pod, st);
                }
            }
            None => {}
        }
    }
}

/// A picker replica that records every stream (tonic `AgentIngest` on a real socket).
#[derive(Clone, Default)]
pub struct Recorder {
    pub streams: Arc<Mutex<Vec<StreamLog>>>,
}

#[tonic::async_trait]
impl AgentIngest for Recorder {
    type ReportStream = Pin<Box<dyn Stream<Item = Result<PickerMessage, Status>> + Send>>;
    async fn report(&self, req: Request<Streaming<AgentMessage>>) -> Result<Response<Self::ReportStream>, Status> {
        let mut inbound = req.into_inner();
        let streams = self.streams.clone();
        let i = {
            let mut s = streams.lock().unwrap();
            s.push(StreamLog::default());
            s.len() - 1
        };
        let (keep, rx) = mpsc::channel::<Result<PickerMessage, Status>>(1);
        tokio::spawn(async move {
            let _keep = keep;
            while let Some(Ok(m)) = inbound.next().await {
                streams.lock().unwrap()[i].apply(m);
            }
            streams.lock().unwrap()[i].ended = true;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl Recorder {
    /// Serves on `addr` (port 0: any); returns the bound address.
    pub async fn serve(&self, addr: SocketAddr) -> SocketAddr {
        let l = tokio::net::TcpListener::bind(addr).await.expect("bind picker");
        let bound = l.local_addr().expect("addr");
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(AgentIngestServer::new(self.clone()))
                .serve_with_incoming(TcpListenerStream::new(l)),
        );
        bound
    }

    /// A copy of every stream's log.
    pub fn logs(&self) -> Vec<StreamLog> {
        self.streams.lock().unwrap().clone()
    }

    /// The latest stream, if any.
    pub fn last(&self) -> Option<StreamLog> {
        self.logs().pop()
    }

    /// Polls until the latest stream satisfies `pred`; returns it.
    pub async fn wait(&self, what: &str, pred: impl Fn(&StreamLog) -> bool) -> StreamLog {
        let start = tokio::time::Instant::now();
        let deadline = start + BOUND;
        loop {
            if let Some(l) = self.last()
                && pred(&l)
            {
                eprintln!("{what}: within {:?}", start.elapsed());
                return l;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within {BOUND:?}; streams: {:#?}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A free TCP port on every address in `ips` (checked by binding each).
pub fn free_port(ips: &[&str]) -> u16 {
    'next: for _ in 0..50 {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        for ip in ips {
            if std::net::TcpListener::bind((*ip, port)).is_err() {
                continue 'next;
            }
        }
        return port;
    }
    panic!("no port free on {ips:?}");
}

/// An emulated vLLM engine serving `MODEL` on `ip:http`, KV events on `ip:kv`, replay on
/// `ip:replay`.
pub async fn engine(ip: &str, http: u16, kv: u16, replay: u16) -> kvroute_emulator::RunningEmulator {
    let tokenizer = format!("{}/../tests/fixtures/tokenizer-qwen2.5", env!("CARGO_MANIFEST_DIR"));
    let args = [
        "kvroute-emulator".to_string(),
        "--host".into(),
        ip.into(),
        "--port".into(),
        http.to_string(),
        "--model".into(),
        MODEL.into(),
        "--tokenizer".into(),
        tokenizer,
        "--time-scale".into(),
        "0.01".into(),
        "--kv-events-endpoint".into(),
        format!("tcp://{ip}:{kv}"),
        "--kv-replay-endpoint".into(),
        format!("tcp://{ip}:{replay}"),
        "--log-level".into(),
        "warn".into(),
    ];
    kvroute_emulator::start(kvroute_emulator::EmulatorConfig::parse_from(args)).await.expect("emulator starts")
}

/// A completion of `tokens` prompt token ids on the engine at `http` (fills its prefix cache, so
/// it publishes KV events).
pub async fn complete(http: SocketAddr, tokens: usize) {
    let prompt: Vec<u32> = (0..tokens as u32).map(|t| 1000 + t).collect();
    let r = reqwest::Client::new()
        .post(format!("http://{http}/v1/completions"))
        .json(&serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert!(r.status().is_success(), "{}", r.status());
}

pub fn pool(name: &str, port: u16) -> InferencePool {
    let mut p = InferencePool::new(
        name,
        InferencePoolSpec {
            selector: PoolSelector { match_labels: [("app".to_string(), "vllm".to_string())].into() },
            target_ports: vec![PoolPort { number: i32::from(port) }],
            app_protocol: None,
            endpoint_picker_ref: None,
        },
    );
    p.metadata.namespace = Some(NS.into());
    p
}

/// A Ready vLLM pod of the pool on `node` at `ip`, serving on `http` with KV events on `*:kv`
/// and replay on `*:replay` (`--kv-events-config`, as a vLLM Deployment would write it).
pub fn vllm_pod(name: &str, node: &str, ip: &str, http: u16, kv: u16, replay: u16) -> Pod {
    let kv_config = format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{kv}","replay_endpoint":"tcp://*:{replay}"}}"#
    );
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            uid: Some(format!("uid-{name}")),
            labels: Some([("app".to_string(), "vllm".to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "vllm".into(),
                image: Some("vllm/vllm-openai:v0.33.0".into()),
                command: Some(vec!["vllm".into(), "serve".into(), MODEL.into()]),
                args: Some(vec!["--port".into(), http.to_string(), "--kv-events-config".into(), kv_config]),
                ports: Some(vec![ContainerPort {
                    container_port: i32::from(http),
                    name: Some("http".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.into()),
            conditions: Some(vec![PodCondition { type_: "Ready".into(), status: "True".into(), ..Default::default() }]),
            ..Default::default()
        }),
    }
}

/// An EndpointSlice of Service `service` with one endpoint per address, port `ingest`.
pub fn slice(name: &str, service: &str, ips: &[&str], port: u16) -> EndpointSlice {
    kvroute_kube_stand_in::endpoint_slice(NS, name, service, ips, "ingest", port)
}

/// Polls `cond` every 20 ms until it holds or [`BOUND`] passes.
pub async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + BOUND;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

/// A mock-NVML scenario file in `dir`: the node's GPUs `uuids`; `ecc` of them report
/// uncorrected ECC errors.
pub fn scenario(dir: &std::path::Path, uuids: &[&str], ecc: &[&str]) -> String {
    let mut text = format!("uuids: [{}]\ngpus:\n", uuids.join(", "));
    for u in ecc {
        text.push_str(&format!("  {u}: [{{at_s: 0, ecc_uncorrected_volatile: 2}}]\n"));
    }
    if ecc.is_empty() {
        text = format!("uuids: [{}]\n", uuids.join(", "));
    }
    let path = dir.join("gpus.yaml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}
