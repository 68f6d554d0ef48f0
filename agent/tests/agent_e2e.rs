//! End to end inside one process: a fake picker (tonic `AgentIngest` server), a fake vLLM engine
//! (axum serving the fixture `/metrics`, plus a ZeroMQ XPUB publishing the fixture KV-event
//! batches once the agent subscribes), and the agent's library entry point in between.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use kvroute_agent::app;
use kvroute_agent::config::AgentConfig;
use kvroute_agent::gpu::mock::MockGpuSource;
use kvroute_common::{BlockHash, BlockHasher};
use kvroute_proto::agent::v1::agent_ingest_server::{AgentIngest, AgentIngestServer};
use kvroute_proto::agent::v1::{AgentMessage, PickerMessage, agent_message};
use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn fixture(rel: &str) -> Vec<u8> {
    std::fs::read(format!("{}/../tests/fixtures/{rel}", env!("CARGO_MANIFEST_DIR"))).expect("fixture")
}

struct FakePicker {
    seen: mpsc::UnboundedSender<AgentMessage>,
}

#[tonic::async_trait]
impl AgentIngest for FakePicker {
    type ReportStream = Pin<Box<dyn Stream<Item = Result<PickerMessage, Status>> + Send>>;
    async fn report(&self, req: Request<Streaming<AgentMessage>>) -> Result<Response<Self::ReportStream>, Status> {
        let mut inbound = req.into_inner();
        let seen = self.seen.clone();
        let (_keep, rx) = mpsc::channel::<Result<PickerMessage, Status>>(1);
        tokio::spawn(async move {
            let _keep = _keep;
            while let Some(Ok(m)) = inbound.next().await {
                let _ = seen.send(m);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

async fn fake_engine_http() -> std::net::SocketAddr {
    use axum::routing::{get, post};
    let page = String::from_utf8(fixture("vllm-metrics/vllm-metrics-busy-lora.txt")).expect("utf8");
    let app = axum::Router::new()
        .route("/metrics", get(move || std::future::ready(page.clone())))
        .route("/health", get(|| async { "" }))
        .route("/v1/models", get(|| async { axum::Json(serde_json::json!({"data": [{"id": MODEL}]})) }))
        .route("/v1/completions", post(|| async { axum::Json(serde_json::json!({"choices": [{"text": "x"}]})) }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// XPUB that publishes batches 0..3 of the v0.33 fixture once a subscriber shows up.
fn fake_engine_pub() -> (String, std::thread::JoinHandle<()>) {
    let ctx = zmq::Context::new();
    let xpub = ctx.socket(zmq::XPUB).expect("socket");
    xpub.bind("tcp://127.0.0.1:*").expect("bind");
    let ep = xpub.get_last_endpoint().expect("endpoint").expect("utf8");
    let h = std::thread::spawn(move || {
        xpub.set_rcvtimeo(10_000).expect("rcvtimeo");
        let sub = xpub.recv_bytes(0).expect("a subscriber arrives");
        assert_eq!(sub.first(), Some(&1u8));
        for n in 0..3 {
            let dir = "vllm-kv-events/v0.33";
            let frames = ["topic", "seq", "msgpack"].map(|e| fixture(&format!("{dir}/batch-{n}.{e}")));
            xpub.send_multipart(frames, 0).expect("send");
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
        drop(ctx);
    });
    (ep, h)
}

fn chain(tokens: &[u32]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    BlockHasher::new(MODEL, None, 16).hash_prompt(tokens, &mut out);
    out
}

fn prompts() -> (Vec<u32>, Vec<u32>) {
    let v: serde_json::Value = serde_json::from_slice(&fixture("vllm-kv-events/v0.33/prompts.json")).expect("json");
    let ids = |k: &str| v[k].as_array().expect("arr").iter().map(|x| x.as_u64().expect("u64") as u32).collect();
    (ids("prompt_a_token_ids"), ids("prompt_b_token_ids"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_streams_snapshot_blocks_and_stats_to_picker() {
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let picker_addr = l.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentIngestServer::new(FakePicker { seen: seen_tx }))
            .serve_with_incoming(TcpListenerStream::new(l)),
    );
    let http = fake_engine_http().await;
    let (pub_ep, publisher) = fake_engine_pub();

    let yaml = format!(
        "node_name: test-node\npickers: [\"http://{picker_addr}\"]\ninsecure_ingest: true\nmetrics_addr: 127.0.0.1:0\n\
         scrape_interval_ms: 50\nreport_interval_ms: 200\nprobe_interval_ms: 500\n\
         engines:\n  - pod: engine-0\n    endpoint: {http}\n    model: {MODEL}\n    kv_events: {pub_ep}\n    gpus: [0]\n    max_num_seqs: 8\n"
    );
    let config: AgentConfig = serde_norway::from_str(&yaml).expect("config");
    config.validate().expect("valid");
    let scenario = format!("{}/scenarios/healthy.yaml", env!("CARGO_MANIFEST_DIR"));
    let gpu = Arc::new(MockGpuSource::from_file(&scenario).expect("scenario"));
    let agent = app::start(config, gpu).await.expect("agent starts");

    let (a, b) = prompts();
    let (ca, cb) = (chain(&a), chain(&b));
    // After batches 0-2: A's chain and B's blocks 3-4, minus A's third block (removed in batch 2).
    let want_stored: HashSet<u64> = ca[..2].iter().chain(&cb[2..4]).map(|h| h.0).collect();

    let (mut hello, mut snapshot, mut stats_ok) = (false, false, false);
    let mut stored = HashSet::new();
    let mut removed = HashSet::new();
    let mut last_seq = 0;
    let mut seen_stored_a3 = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !(hello && snapshot && stats_ok && stored == want_stored && removed.contains(&ca[2].0)) {
        seen_stored_a3 |= stored.contains(&ca[2].0);
        let msg = tokio::time::timeout_at(deadline, seen.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out: hello {hello} snapshot {snapshot} stats {stats_ok} stored {stored:?} removed {removed:?}"))
            .expect("channel open");
        match msg.msg.expect("message set") {
            agent_message::Msg::Hello(h) => {
                assert_eq!(h.node_name, "test-node");
                assert_eq!(h.pods[0].pod, "engine-0-rank-0", "engines are named as the picker names endpoints");
                hello = true;
            }
            agent_message::Msg::Snapshot(s) => {
                assert!(hello, "Hello comes first");
                let info = s.info.expect("info");
                assert_eq!((info.model.as_str(), info.block_size), (MODEL, 16));
                last_seq = s.seq;
                for run in s.blocks {
                    stored.extend(run.hashes);
                }
                snapshot = true;
            }
            agent_message::Msg::Delta(d) => {
                assert!(snapshot, "deltas follow the snapshot");
                assert_eq!(d.seq, last_seq + 1, "seq increments by one per delta");
                last_seq = d.seq;
                if let Some(bc) = d.blocks {
                    for run in &bc.stored {
                        // Runs are real chains: the first block's parent is 0 or a known block.
                        assert!(
                            run.parent == 0 || stored.contains(&run.parent) || ca.iter().any(|h| h.0 == run.parent)
                        );
                    }
                    stored.extend(bc.stored.iter().flat_map(|r| r.hashes.iter().copied()));
                    for r in bc.removed {
                        stored.remove(&r);
                        removed.insert(r);
                    }
                }
                if let Some(s) = d.stats
                    && s.num_requests_running == 7
                {
                    assert_eq!(s.num_requests_waiting, 3);
                    assert!((s.kv_cache_usage - 0.4213).abs() < 1e-9);
                    assert_eq!(s.running_adapters, vec!["sql-lora", "chat-lora"]);
                    // NVML's meaning: a stepping engine reads fully utilized, whatever its batch.
                    assert_eq!(s.gpu_utilization, 1.0, "mock util reads busy while requests run");
                    assert!(s.observed_at_unix_ms > 0);
                    stats_ok = s.health_score > 0.7 && s.ready;
                }
            }
        }
    }
    assert!(seen_stored_a3 || removed.contains(&ca[2].0));
    assert!(hello && snapshot);
    let metrics =
        reqwest::get(format!("http://{}/metrics", agent.metrics_addr)).await.expect("get").text().await.expect("text");
    assert!(
        metrics.contains("kvroute_agent_kv_event_batches_received_total{model_server_pod=\"engine-0-rank-0\"} 3"),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_agent_health_score{model_server_pod=\"engine-0-rank-0\"}"));
    // The scraped load, per pod, as the engine's page gave it (running 7, waiting 3, KV 0.4213).
    for (family, value) in [
        ("kvroute_agent_requests_running", 7.0),
        ("kvroute_agent_requests_waiting", 3.0),
        ("kvroute_agent_kv_cache_usage", 0.4213),
        ("kvroute_agent_engine_ready", 1.0),
    ] {
        let line = format!("{family}{{model_server_pod=\"engine-0-rank-0\"}} ");
        let got = metrics.lines().find_map(|l| l.strip_prefix(line.as_str())).and_then(|v| v.parse::<f64>().ok());
        assert!(got.is_some_and(|g| (g - value).abs() < 1e-9), "{family}: {got:?}, want {value}\n{metrics}");
    }
    agent.shutdown().await;
    publisher.join().expect("publisher thread");
}

#[test]
fn nvml_absent_gives_the_clear_error() {
    match kvroute_agent::gpu::nvml::NvmlGpuSource::new() {
        Ok(_) => eprintln!("NVML present on this host: nothing to check"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("libnvidia-ml.so") && msg.contains("--gpu-source mock:"), "{msg}");
        }
    }
}
