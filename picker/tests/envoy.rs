//! The picker behind a real Envoy 1.40 with the repository's own `deploy/envoy/envoy.yaml` (ports
//! rewritten): requests reach the pod the picker chose, errors come back as the picker's JSON, and
//! 5 MB prompts pass. Skipped (with a message) when Envoy is not installed: `scripts/install-envoy`
//! puts it in `.tools/envoy`, or set `KVROUTE_ENVOY` to a binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::HeaderMap;
use kvroute_common::{BlockHash, BlockHasher};
use kvroute_picker::RunningPicker;
use kvroute_picker::config::PickerConfig;
use kvroute_proto::agent::v1::agent_ingest_client::AgentIngestClient;
use kvroute_proto::agent::v1::{AgentMessage, BlockRun, Hello, PodInfo, PodSnapshot, PodStats, agent_message};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";

fn envoy_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KVROUTE_ENVOY") {
        return Some(PathBuf::from(p));
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/envoy/envoy/_bin/envoy");
    p.is_file().then_some(p)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Kills Envoy when the test ends, however it ends.
struct EnvoyProcess(Child);
impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_envoy(bin: &PathBuf, listener: u16, ext_proc: u16) -> EnvoyProcess {
    let template =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/envoy/envoy.yaml")).unwrap();
    let config = template
        .replace("port_value: 9901", &format!("port_value: {}", free_port()))
        .replace("{ address: 0.0.0.0, port_value: 8081 }", &format!("{{ address: 127.0.0.1, port_value: {listener} }}"))
        .replace("port_value: 9002", &format!("port_value: {ext_proc}"));
    let dir = std::env::temp_dir().join(format!("kvroute-picker-envoy-{}-{listener}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let base_id = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos() % 1_000_000;
    let child = Command::new(bin)
        .args(["-c", path.to_str().unwrap(), "--concurrency", "1", "-l", "warn", "--base-id"])
        .arg(base_id.to_string())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("envoy.log")).unwrap())
        .spawn()
        .unwrap();
    EnvoyProcess(child)
}

/// What a fake engine saw: (x-request-id, x-gateway-destination-endpoint) per request.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

async fn fake_engine() -> (SocketAddr, Seen) {
    async fn completions(
        State(seen): State<Seen>,
        headers: HeaderMap,
        body: axum::body::Bytes,
    ) -> axum::Json<serde_json::Value> {
        let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        seen.lock().push((h("x-request-id"), h("x-gateway-destination-endpoint")));
        axum::Json(serde_json::json!({
            "id": "cmpl-1", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65,
                      "prompt_tokens_details": {"cached_tokens": 64}},
            "body_bytes": body.len(),
        }))
    }
    let seen: Seen = Arc::default();
    let app = axum::Router::new()
        .route("/v1/completions", axum::routing::post(completions))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(seen.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, seen)
}

async fn report_pods(picker: &RunningPicker, pods: &[(&str, String, Vec<BlockHash>)]) -> mpsc::Sender<AgentMessage> {
    let mut client = AgentIngestClient::connect(format!("http://{}", picker.ingest_addr)).await.unwrap();
    let (tx, rx) = mpsc::channel(16);
    let infos: Vec<PodInfo> = pods
        .iter()
        .map(|(n, e, _)| PodInfo {
            pod: (*n).into(),
            endpoint: e.clone(),
            model: MODEL.into(),
            block_size: 16,
            annotations: Default::default(),
        })
        .collect();
    let hello = Hello { agent_id: "t".into(), node_name: "n".into(), protocol_version: 1, pods: infos.clone() };
    tx.send(AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }).await.unwrap();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64;
    for ((_, _, blocks), info) in pods.iter().zip(infos) {
        let stats = PodStats { observed_at_unix_ms: now, health_score: 1.0, ready: true, ..Default::default() };
        let blocks = vec![BlockRun { parent: 0, hashes: blocks.iter().map(|h| h.0).collect() }];
        let snap = PodSnapshot { info: Some(info), seq: 1, stats: Some(stats), blocks };
        tx.send(AgentMessage { msg: Some(agent_message::Msg::Snapshot(snap)) }).await.unwrap();
    }
    let mut replies = client.report(ReceiverStream::new(rx)).await.unwrap().into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = replies.message().await {} });
    let deadline = Instant::now() + Duration::from_secs(10);
    while picker.gateway.pool.pods().iter().filter(|p| p.ready).count() < pods.len() {
        assert!(Instant::now() < deadline, "pods never became ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx
}

/// One HTTP/1.1 POST through Envoy: (status, lower-cased head, body).
async fn post(addr: SocketAddr, path: &str, body: &[u8], extra: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_real_envoy() {
    // scripts/test installs Envoy; a missing one is a failure, not a skip.
    let envoy_bin = envoy_binary().expect("Envoy not installed: run scripts/install-envoy (scripts/test does)");
    let config = PickerConfig::from_yaml(&format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\nmodels: [{{name: {MODEL}}}]\n"
    ))
    .unwrap();
    let picker = kvroute_picker::start(&config).await.unwrap();
    let (cold_addr, cold_seen) = fake_engine().await;
    let (hot_addr, hot_seen) = fake_engine().await;
    let prompt: Vec<u32> = (0..64).map(|i| 500 + i).collect();
    let mut hot_blocks = Vec::new();
    BlockHasher::new(MODEL, None, 16).hash_prompt(&prompt, &mut hot_blocks);
    let _agent =
        report_pods(&picker, &[("cold", cold_addr.to_string(), vec![]), ("hot", hot_addr.to_string(), hot_blocks)])
            .await;

    let listener = free_port();
    let _envoy = start_envoy(&envoy_bin, listener, picker.ext_proc_addr.port());
    let gw: SocketAddr = format!("127.0.0.1:{listener}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(gw).await.is_err() {
        assert!(Instant::now() < deadline, "Envoy did not start listening");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A client-supplied destination is ignored; the prefix holder gets the request.
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let (status, head, resp) = post(
        gw,
        "/v1/completions",
        body.as_bytes(),
        &format!("x-request-id: e2e-1\r\nx-gateway-destination-endpoint: {cold_addr}\r\n"),
    )
    .await;
    assert_eq!(status, 200, "{head}\n{resp}");
    assert!(head.contains("x-request-id: e2e-1"), "{head}");
    assert_eq!(hot_seen.lock().as_slice(), &[("e2e-1".to_owned(), hot_addr.to_string())]);
    assert!(cold_seen.lock().is_empty());

    // Picker errors arrive as its JSON.
    let (status, _, resp) = post(gw, "/v1/completions", br#"{"model":"nope","prompt":"x"}"#, "").await;
    assert_eq!(status, 404, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
    assert_eq!(v["error"]["type"], "not_found_error");

    // A 5 MB prompt passes Envoy's buffer and the gRPC limits and is routed.
    let big = serde_json::json!({"model": MODEL, "prompt": prompt, "user": "z".repeat(5 << 20)}).to_string();
    let (status, _, resp) = post(gw, "/v1/completions", big.as_bytes(), "").await;
    assert_eq!(status, 200, "{}", &resp[..resp.len().min(500)]);
    assert_eq!(hot_seen.lock().len(), 2);

    // 9 MB: above the picker's 8 MiB limit, below Envoy's 16 MiB buffer: the picker's 413.
    let huge = serde_json::json!({"model": MODEL, "prompt": "z".repeat(9 << 20)}).to_string();
    let (status, _, resp) = post(gw, "/v1/completions", huge.as_bytes(), "").await;
    assert_eq!(status, 413, "{}", &resp[..resp.len().min(500)]);
    assert!(resp.contains("request_too_large"), "{resp}");

    // Every slot was released once the responses ended.
    let deadline = Instant::now() + Duration::from_secs(5);
    while picker.gateway.pool.pods().iter().any(|p| p.in_flight > 0) {
        assert!(Instant::now() < deadline, "in-flight slots leaked: {:?}", picker.gateway.pool.pods());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    picker.shutdown();
}
