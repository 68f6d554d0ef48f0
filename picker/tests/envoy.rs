//! The picker behind a real Envoy 1.40 running the repository's own `deploy/envoy/` files (ports,
//! addresses and the fail-open pod list rewritten, nothing else): both request-body modes
//! (`envoy.yaml` BUFFERED, `envoy-full-duplex.yaml` FULL_DUPLEX_STREAMED) with bodies from 0 B to
//! 8 MB, prompts tokenized like the reference, every docs/design.md §5 error as JSON, the subset hint,
//! request ids, and the picker killed under fail-open (`envoy-fail-open.yaml`, still serves) and
//! fail-closed (`envoy.yaml`, 5xx). A missing Envoy fails the tests: `scripts/install-envoy` puts
//! it in `.tools/envoy`, or set `KVROUTE_ENVOY` to a binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_harness::paths::free_port;
use kvroute_harness::{FakeAgent, FakePod, poll_until};
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
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";

fn envoy_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KVROUTE_ENVOY") {
        return Some(PathBuf::from(p));
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/envoy/envoy/_bin/envoy");
    p.is_file().then_some(p)
}

/// Kills Envoy when the test ends, however it ends.
struct EnvoyProcess(Child);
impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One of the repository's `deploy/envoy/` files.
fn deploy_file(name: &str) -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/envoy").join(name)).unwrap()
}

/// The fail-open file's static pod list (one example endpoint), as written in deploy/.
const EXAMPLE_POD: &str = "              - endpoint:
                  address:
                    socket_address: { address: 127.0.0.1, port_value: 8000 }
";

/// Rewrites the fail-open file's example pod into `pods`.
fn with_pods(config: String, pods: &[SocketAddr]) -> String {
    assert!(config.contains(EXAMPLE_POD), "deploy file changed: the example pod entry is gone");
    let list: String = pods
        .iter()
        .map(|p| EXAMPLE_POD.replace("127.0.0.1, port_value: 8000", &format!("{}, port_value: {}", p.ip(), p.port())))
        .collect();
    config.replace(EXAMPLE_POD, &list)
}

/// Adds an `envoy.filters.http.set_metadata` filter before ext_proc that sets the GIE subset hint.
fn with_subset_hint(config: String, allowed: &[String]) -> String {
    let anchor = "                  - name: envoy.filters.http.ext_proc\n";
    assert!(config.contains(anchor));
    let list = allowed.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(", ");
    let filter = format!(
        "                  - name: envoy.filters.http.set_metadata
                    typed_config:
                      \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
                      metadata:
                        - metadata_namespace: envoy.lb.subset_hint
                          value:
                            x-gateway-destination-endpoint-subset: [{list}]
{anchor}"
    );
    config.replace(anchor, &filter)
}

/// Starts Envoy on `config` (a deploy file's text) with its ports rewritten; waits until it listens.
async fn start_envoy(config: &str, ext_proc: u16) -> (EnvoyProcess, SocketAddr) {
    let bin = envoy_binary().expect("Envoy not installed: run scripts/install-envoy (scripts/test does)");
    let listener = free_port().unwrap();
    let config = config
        .replace("port_value: 9901", &format!("port_value: {}", free_port().unwrap()))
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
    let envoy = EnvoyProcess(child);
    let gw: SocketAddr = format!("127.0.0.1:{listener}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(gw).await.is_err() {
        assert!(Instant::now() < deadline, "Envoy did not start listening: {}", dir.join("envoy.log").display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (envoy, gw)
}

/// What a fake engine saw per request.
#[derive(Debug, Clone)]
struct SeenRequest {
    request_id: String,
    destination: String,
    body: Vec<u8>,
}

type Seen = Arc<Mutex<Vec<SeenRequest>>>;

/// An OpenAI-shaped engine stand-in that records what reached it and answers with usage.
async fn fake_engine() -> (SocketAddr, Seen) {
    async fn answer(
        State(seen): State<Seen>,
        headers: HeaderMap,
        body: axum::body::Bytes,
    ) -> axum::Json<serde_json::Value> {
        let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        seen.lock().push(SeenRequest {
            request_id: h("x-request-id"),
            destination: h("x-gateway-destination-endpoint"),
            body: body.to_vec(),
        });
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
        .route("/v1/completions", axum::routing::post(answer))
        .route("/v1/chat/completions", axum::routing::post(answer))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(seen.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, seen)
}

/// An idle pod of [`MODEL`] at `endpoint` holding `blocks`.
fn pod(name: &str, endpoint: SocketAddr, blocks: Vec<BlockHash>) -> FakePod {
    FakePod::new(name, endpoint, MODEL).with_blocks(blocks)
}

/// Reports `pods` through the shared fake agent and waits until the pool shows them all ready.
async fn report_pods(picker: &RunningPicker, pods: &[FakePod]) -> FakeAgent {
    let agent = FakeAgent::connect(picker.ingest_addr, pods).await.unwrap();
    let ready = || picker.gateway.pool.pods().iter().filter(|p| p.ready).count() >= pods.len();
    assert!(poll_until(Duration::from_secs(10), ready).await, "pods never became ready");
    agent
}

async fn start_picker(extra_yaml: &str) -> RunningPicker {
    let config = PickerConfig::from_yaml(&format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\n{extra_yaml}"
    ))
    .unwrap();
    kvroute_picker::start(&config).await.unwrap()
}

fn simple_models() -> String {
    format!("models: [{{name: {MODEL}}}]\n")
}

fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    BlockHasher::new(MODEL, None, 16).hash_prompt(tokens, &mut out);
    out
}

/// One HTTP/1.1 POST through Envoy: (status, lower-cased head, body).
async fn post(addr: SocketAddr, path: &str, body: &[u8], extra: &str) -> (u16, String, String) {
    try_post(addr, path, body, extra).await.unwrap()
}

/// [`post`] that returns I/O errors (a reset connection) instead of failing the test.
async fn try_post(addr: SocketAddr, path: &str, body: &[u8], extra: &str) -> std::io::Result<(u16, String, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer from Envoy within 30 s"))??;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, head.to_ascii_lowercase(), body.to_owned()))
}

/// The value of a header in a lower-cased response head.
fn header_of(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| l.strip_prefix(&format!("{name}: ")).map(|v| v.trim().to_owned()))
}

/// Waits until every in-flight slot is released.
async fn assert_slots_released(picker: &RunningPicker) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while picker.gateway.pool.pods().iter().any(|p| p.in_flight > 0) {
        assert!(Instant::now() < deadline, "in-flight slots leaked: {:?}", picker.gateway.pool.pods());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5")
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// Both body modes through the deploy files: an empty body is the picker's 400, bodies up to just
/// under the 8 MiB limit reach the chosen pod byte for byte, a client-sent destination is ignored, request ids are kept or
/// made and returned, 9 MB is the picker's 413, and every in-flight slot is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_in_both_modes_through_real_envoy() {
    let picker = start_picker(&simple_models()).await;
    let (cold_addr, cold_seen) = fake_engine().await;
    let (hot_addr, hot_seen) = fake_engine().await;
    let prompt: Vec<u32> = (0..64).map(|i| 500 + i).collect();
    let _agent = report_pods(&picker, &[pod("cold", cold_addr, vec![]), pod("hot", hot_addr, hashes(&prompt))]).await;
    let port = picker.ext_proc_addr.port();
    let (_b, buffered) = start_envoy(&deploy_file("envoy.yaml"), port).await;
    let (_f, full_duplex) = start_envoy(&deploy_file("envoy-full-duplex.yaml"), port).await;

    for (mode, gw) in [("BUFFERED", buffered), ("FULL_DUPLEX_STREAMED", full_duplex)] {
        // 0 B: an inference request without a body is the picker's 400 with a JSON error
        // (docs/design.md §5), answered on the headers, not hung and not sent upstream.
        let before = hot_seen.lock().len() + cold_seen.lock().len();
        let (status, head, resp) = post(gw, "/v1/completions", b"", "").await;
        assert_eq!(status, 400, "{mode}: {head}\n{resp}");
        let err: serde_json::Value = serde_json::from_str(&resp).unwrap_or_else(|e| panic!("{mode}: {e}: {resp}"));
        assert_eq!(err["error"]["type"], "invalid_request_error", "{mode}: {resp}");
        assert_eq!(hot_seen.lock().len() + cold_seen.lock().len(), before, "{mode}: an empty body went upstream");
        // No x-request-id from the client: one is made (Envoy's or the picker's UUID v4) and returned.
        let rid = header_of(&head, "x-request-id").unwrap_or_else(|| panic!("{mode}: no request id\n{head}"));
        assert_eq!(uuid::Uuid::parse_str(&rid).unwrap().get_version_num(), 4, "{rid}");

        // Token-array prompts of growing size, padded with a field the picker ignores.
        let sizes = [0usize, 64 << 10, 1 << 20, 5 << 20, 8_000_000];
        for (i, pad) in sizes.into_iter().enumerate() {
            let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "user": "z".repeat(pad)})
                .to_string();
            let rid = format!("{}-{i}", mode.to_ascii_lowercase());
            let (status, head, resp) = post(
                gw,
                "/v1/completions",
                body.as_bytes(),
                &format!("x-request-id: {rid}\r\nx-gateway-destination-endpoint: {cold_addr}\r\n"),
            )
            .await;
            assert_eq!(status, 200, "{mode} {} B: {head}\n{}", body.len(), &resp[..resp.len().min(300)]);
            assert_eq!(header_of(&head, "x-request-id").as_deref(), Some(rid.as_str()), "{head}");
            let last = hot_seen.lock().last().cloned().unwrap();
            assert_eq!(last.request_id, rid, "{mode} {} B went elsewhere", body.len());
            assert_eq!(last.destination, hot_addr.to_string());
            assert!(
                last.body == body.as_bytes(),
                "{mode}: body of {} B altered ({} B arrived)",
                body.len(),
                last.body.len()
            );
        }
        assert!(cold_seen.lock().iter().all(|r| r.body.is_empty()), "{mode}: the spoofed destination was obeyed");

        // 9 MB: over the picker's 8 MiB limit, under Envoy's 16 MiB buffer: the picker's 413.
        let huge = serde_json::json!({"model": MODEL, "prompt": "z".repeat(9 << 20)}).to_string();
        let (status, _, resp) = post(gw, "/v1/completions", huge.as_bytes(), "").await;
        assert_eq!(status, 413, "{mode}: {}", &resp[..resp.len().min(300)]);
        let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
        assert_eq!(v["error"]["type"], "request_too_large", "{resp}");
        assert_eq!(v["error"]["code"], 413, "{resp}");
    }
    assert_slots_released(&picker).await;
    picker.shutdown();
}

/// docs/design.md §5 errors come back through Envoy as OpenAI-style JSON with the request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_as_openai_json_through_real_envoy() {
    let picker = start_picker(&format!(
        "models: [{{name: {MODEL}}}, {{name: orphan, target_model: nobody/serves-this}}]\n\
         scoring: {{max_queue: 4, shed_when_saturated: true}}\n"
    ))
    .await;
    let (a, _) = fake_engine().await;
    let (b, seen_b) = fake_engine().await;
    let mut busy = [pod("a", a, vec![]), pod("b", b, vec![])];
    for p in &mut busy {
        p.num_requests_waiting = 10;
    }
    let _agent = report_pods(&picker, &busy).await;
    let port = picker.ext_proc_addr.port();
    let (_e, gw) = start_envoy(&deploy_file("envoy.yaml"), port).await;
    let (_f, gw_fd) = start_envoy(&deploy_file("envoy-full-duplex.yaml"), port).await;

    let cases: [(&str, &[u8], u16, &str); 6] = [
        ("/v1/completions", b"{not json", 400, "invalid_request_error"),
        ("/v1/completions", br#"{"prompt":"no model"}"#, 400, "invalid_request_error"),
        (
            "/v1/chat/completions",
            br#"{"model":"nope","messages":[{"role":"user","content":"hi"}]}"#,
            404,
            "not_found_error",
        ),
        ("/v1/completions", br#"{"model":"orphan","prompt":"x"}"#, 503, "service_unavailable"),
        ("/v1/completions", br#"{"model":"Qwen/Qwen2.5-7B-Instruct","prompt":"x"}"#, 429, "rate_limit_exceeded"),
        ("/v1/completions", br#"{"model":"Qwen/Qwen2.5-7B-Instruct","prompt":[1,2,3]}"#, 429, "rate_limit_exceeded"),
    ];
    for (mode, gw) in [("BUFFERED", gw), ("FULL_DUPLEX_STREAMED", gw_fd)] {
        for (i, (path, body, status, kind)) in cases.iter().enumerate() {
            let rid = format!("err-{i}");
            let (got, head, resp) = post(gw, path, body, &format!("x-request-id: {rid}\r\n")).await;
            assert_eq!(got, *status, "{mode} {}: {resp}", String::from_utf8_lossy(body));
            assert!(head.contains("content-type: application/json"), "{head}");
            assert_eq!(header_of(&head, "x-request-id").as_deref(), Some(rid.as_str()), "{head}");
            let v: serde_json::Value = serde_json::from_str(&resp).unwrap_or_else(|e| panic!("{e}: {resp}"));
            assert_eq!(v["error"]["type"], *kind, "{resp}");
            assert_eq!(v["error"]["code"], *status, "{resp}");
            assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{resp}");
        }
    }
    assert!(seen_b.lock().is_empty());
    assert_slots_released(&picker).await;
    picker.shutdown();
}

/// Completions (string prompts) and chat requests (system/user/assistant/tool messages, array
/// content parts, tool calls, unicode) are tokenized by the picker exactly as the reference ids in
/// the Qwen2.5 fixture (computed by HuggingFace transformers): the pod holding those ids' blocks
/// wins over an idler pod, in both body modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_tokenized_like_the_reference_through_real_envoy() {
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(fixtures().join(f)).unwrap()).unwrap()
    };
    let (chat, text) = (read("expected-chat.json"), read("expected-text.json"));
    let mut requests = Vec::new();
    let mut blocks = Vec::new();
    for (name, case) in chat.as_object().unwrap() {
        let ids = ids_of(&case["token_ids"]);
        assert!(ids.len() >= 16, "{name}: no full block");
        blocks.extend(hashes(&ids));
        let mut r = case["request"].clone();
        r["model"] = MODEL.into();
        requests.push((format!("chat/{name}"), "/v1/chat/completions", r));
    }
    for (name, case) in text.as_object().unwrap() {
        let ids = ids_of(&case["token_ids"]);
        if ids.len() < 16 {
            continue;
        }
        blocks.extend(hashes(&ids));
        let r = serde_json::json!({"model": MODEL, "prompt": case["text"], "max_tokens": 1});
        requests.push((format!("text/{name}"), "/v1/completions", r));
    }
    assert!(requests.len() >= 6);
    let picker = start_picker(&format!("models: [{{name: {MODEL}, tokenizer: {}}}]\n", fixtures().display())).await;
    let (idle_addr, idle_seen) = fake_engine().await;
    let (hot_addr, hot_seen) = fake_engine().await;
    let mut hot = pod("hot", hot_addr, blocks);
    // Busier: without an exact match the idle pod wins, so a wrong tokenization fails the test.
    hot.gpu_utilization = 0.5;
    let _agent = report_pods(&picker, &[pod("idle", idle_addr, vec![]), hot]).await;
    let port = picker.ext_proc_addr.port();
    let (_b, buffered) = start_envoy(&deploy_file("envoy.yaml"), port).await;
    let (_f, full_duplex) = start_envoy(&deploy_file("envoy-full-duplex.yaml"), port).await;
    for (mode, gw) in [("BUFFERED", buffered), ("FULL_DUPLEX_STREAMED", full_duplex)] {
        for (name, path, body) in &requests {
            let rid = format!("{mode}-{name}");
            let (status, _, resp) =
                post(gw, path, body.to_string().as_bytes(), &format!("x-request-id: {rid}\r\n")).await;
            assert_eq!(status, 200, "{rid}: {resp}");
            assert_eq!(
                hot_seen.lock().last().map(|r| r.request_id.clone()),
                Some(rid.clone()),
                "{rid} not on the prefix holder"
            );
        }
    }
    assert!(idle_seen.lock().is_empty());
    picker.shutdown();
}

/// Envoy's subset hint (`envoy.lb.subset_hint`, set here by a set_metadata filter and forwarded by
/// the deploy file's `forwarding_namespaces`) restricts the candidates: the prefix holder outside
/// the subset is not chosen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subset_hint_through_real_envoy() {
    let picker = start_picker(&simple_models()).await;
    let (cold_addr, cold_seen) = fake_engine().await;
    let (hot_addr, hot_seen) = fake_engine().await;
    let prompt: Vec<u32> = (0..64).map(|i| 900 + i).collect();
    let _agent = report_pods(&picker, &[pod("cold", cold_addr, vec![]), pod("hot", hot_addr, hashes(&prompt))]).await;
    let config = with_subset_hint(deploy_file("envoy.yaml"), &[cold_addr.to_string()]);
    let (_e, gw) = start_envoy(&config, picker.ext_proc_addr.port()).await;
    let body = serde_json::json!({"model": MODEL, "prompt": prompt}).to_string();
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(cold_seen.lock().len(), 1, "the subset hint was not honoured");
    assert!(hot_seen.lock().is_empty());
    picker.shutdown();
}

/// Waits until nothing accepts connections on the picker's ext_proc port.
async fn wait_picker_down(picker: &RunningPicker) {
    picker.shutdown();
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(picker.ext_proc_addr).await.is_ok() {
        assert!(Instant::now() < deadline, "the picker kept listening after shutdown");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// deploy/envoy/envoy-fail-open.yaml: with the picker up its choice (metadata, override_host) is
/// obeyed; with the picker killed Envoy still serves through round robin over the pod list, and a
/// client-sent destination header is still ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_serves_without_the_picker() {
    let picker = start_picker(&simple_models()).await;
    let (cold_addr, cold_seen) = fake_engine().await;
    let (hot_addr, hot_seen) = fake_engine().await;
    let prompt: Vec<u32> = (0..64).map(|i| 700 + i).collect();
    let _agent = report_pods(&picker, &[pod("cold", cold_addr, vec![]), pod("hot", hot_addr, hashes(&prompt))]).await;
    let config = with_pods(deploy_file("envoy-fail-open.yaml"), &[cold_addr, hot_addr]);
    let (_e, gw) = start_envoy(&config, picker.ext_proc_addr.port()).await;
    let body = serde_json::json!({"model": MODEL, "prompt": prompt}).to_string();
    for _ in 0..4 {
        let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
        assert_eq!(status, 200, "{resp}");
    }
    assert_eq!(hot_seen.lock().len(), 4, "the picker's choice was not obeyed");
    assert!(cold_seen.lock().is_empty());

    wait_picker_down(&picker).await;
    let spoof = format!("x-gateway-destination-endpoint: {hot_addr}\r\n");
    // The picker's graceful shutdown drains the HTTP/2 connection Envoy already holds, so a
    // request racing the GOAWAY may still be decided by it (and carry its destination header).
    // Settle first: wait for a request that Envoy served without the picker.
    let deadline = Instant::now() + Duration::from_secs(10);
    let served_without_picker = || {
        let (hot, cold) = (hot_seen.lock(), cold_seen.lock());
        hot.iter().skip(4).chain(cold.iter()).any(|r| r.destination.is_empty())
    };
    while !served_without_picker() {
        let (status, head, resp) = post(gw, "/v1/completions", body.as_bytes(), &spoof).await;
        assert_eq!(status, 200, "fail-open did not serve: {head}\n{resp}");
        assert!(Instant::now() < deadline, "Envoy kept asking the stopped picker");
    }
    let (hot_before, cold_before) = (hot_seen.lock().len(), cold_seen.lock().len());
    for _ in 0..6 {
        let (status, head, resp) = post(gw, "/v1/completions", body.as_bytes(), &spoof).await;
        assert_eq!(status, 200, "fail-open did not serve: {head}\n{resp}");
    }
    // Round robin over both pods despite the header naming one; the header never reached a pod.
    let (hot, cold) = (hot_seen.lock(), cold_seen.lock());
    assert_eq!(hot.len() - hot_before + cold.len() - cold_before, 6);
    assert!(cold.len() - cold_before >= 2, "not round robin: cold got {}", cold.len() - cold_before);
    assert!(hot.iter().skip(hot_before).chain(cold.iter().skip(cold_before)).all(|r| r.destination.is_empty()));
}

/// deploy/k8s/overlays/fail-open/envoy.yaml (GIE's FailOpen on Kubernetes): its clusters resolve
/// Services by DNS; here the picker Service is 127.0.0.1 and the pool's headless Service is
/// `localhost` (one pod, resolved by Envoy's STRICT_DNS like a cluster's A records). With the
/// picker up its choice is obeyed; with the picker stopped Envoy still serves, by its own
/// balancing over the resolved pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_fail_open_overlay_serves_without_the_picker() {
    let picker = start_picker(&simple_models()).await;
    let (addr, seen) = fake_engine().await;
    let _agent = report_pods(&picker, &[pod("p0", addr, vec![])]).await;
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/overlays/fail-open/envoy.yaml"),
    )
    .unwrap();
    let pool = "kvroute-pool.kvroute.svc.cluster.local, port_value: 8000";
    assert!(text.contains(pool), "the overlay's pool Service address changed");
    let config = text
        .replace("kvroute-picker.kvroute.svc.cluster.local", "127.0.0.1")
        .replace(pool, &format!("localhost, port_value: {}", addr.port()));
    let (_e, gw) = start_envoy(&config, picker.ext_proc_addr.port()).await;
    let body = serde_json::json!({"model": MODEL, "prompt": "hello"}).to_string();
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(seen.lock().last().map(|r| r.destination.clone()), Some(addr.to_string()), "picked by the picker");

    wait_picker_down(&picker).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, head, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
        assert_eq!(status, 200, "fail-open did not serve: {head}\n{resp}");
        if seen.lock().last().is_some_and(|r| r.destination.is_empty()) {
            break;
        }
        assert!(Instant::now() < deadline, "Envoy kept asking the stopped picker");
    }
    for _ in 0..3 {
        let (status, head, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
        assert_eq!(status, 200, "fail-open did not serve: {head}\n{resp}");
    }
}

/// deploy/envoy/envoy.yaml (fail closed): with the picker killed Envoy answers 5xx and no pod is
/// reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_answers_5xx_without_the_picker() {
    let picker = start_picker(&simple_models()).await;
    let (addr, seen) = fake_engine().await;
    let _agent = report_pods(&picker, &[pod("only", addr, vec![])]).await;
    let (_e, gw) = start_envoy(&deploy_file("envoy.yaml"), picker.ext_proc_addr.port()).await;
    let body = serde_json::json!({"model": MODEL, "prompt": [1, 2, 3]}).to_string();
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    assert_eq!(status, 200, "{resp}");
    wait_picker_down(&picker).await;
    let spoof = format!("x-gateway-destination-endpoint: {addr}\r\n");
    // The picker's graceful shutdown drains the HTTP/2 connection Envoy already holds, so a
    // request racing the GOAWAY may still be decided (or see a reset). Once Envoy has answered
    // 5xx the picker is gone for it: from then on every request must fail closed.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let outcome = try_post(gw, "/v1/completions", body.as_bytes(), &spoof).await;
        if matches!(outcome, Ok((status, _, _)) if (500..600).contains(&status)) {
            break;
        }
        assert!(Instant::now() < deadline, "Envoy never failed closed after the picker stopped: {outcome:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reached = seen.lock().len();
    let mut answered_5xx = 0;
    for _ in 0..3 {
        match try_post(gw, "/v1/completions", body.as_bytes(), &spoof).await {
            Ok((status, head, resp)) => {
                assert!((500..600).contains(&status), "fail-closed answered {status}: {head}\n{resp}");
                answered_5xx += 1;
            }
            // Under parallel tests Envoy occasionally resets instead of answering; the request was
            // still refused, which the pod's request count below checks.
            Err(e) => eprintln!("fail-closed request refused by a reset: {e}"),
        }
    }
    assert!(answered_5xx >= 1, "Envoy never answered 5xx with the picker down");
    assert_eq!(seen.lock().len(), reached, "a request reached the pod with the picker down");
}

/// The SSE stream an engine sends for a streamed completion with `include_usage`: the usage says
/// nothing was cached.
const SSE: &str = "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"ok\"}]}\n\n\
data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"completion_tokens\":1,\"total_tokens\":65,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n\
data: [DONE]\n\n";

/// A streamed response passes through Envoy byte for byte; its final usage chunk (0 cached tokens
/// where the picker predicted 64) counts one stale routing, and the in-flight slot is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_response_untouched_and_usage_judged_through_real_envoy() {
    let picker = start_picker(&simple_models()).await;
    let app = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(|| async { ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], SSE) }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    let prompt: Vec<u32> = (0..64).map(|i| 300 + i).collect();
    let _agent = report_pods(&picker, &[pod("hot", engine, hashes(&prompt))]).await;
    let (_e, gw) = start_envoy(&deploy_file("envoy.yaml"), picker.ext_proc_addr.port()).await;
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "stream": true,
        "stream_options": {"include_usage": true}})
    .to_string();
    assert_eq!(picker.gateway.metrics.stale_cache_routing.get(), 0);
    let (status, head, resp) = post(gw, "/v1/completions", body.as_bytes(), "x-request-id: sse-1\r\n").await;
    assert_eq!(status, 200, "{head}\n{resp}");
    assert_eq!(header_of(&head, "x-request-id").as_deref(), Some("sse-1"));
    // Envoy re-chunks HTTP/1.1 (transfer-encoding: chunked): strip the chunk framing.
    let payload = if head.contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut rest = resp.as_str();
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        resp
    };
    assert_eq!(payload, SSE, "the stream was altered");
    let deadline = Instant::now() + Duration::from_secs(5);
    while picker.gateway.metrics.stale_cache_routing.get() != 1 {
        assert!(Instant::now() < deadline, "stale routing not counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_slots_released(&picker).await;
    picker.shutdown();
}

/// Only the inference API reaches the engines (docs/design.md §14): an engine's admin paths
/// (`/reset_prefix_cache`, `/v1/load_lora_adapter`, ...) get Envoy's own 404 from every deploy
/// config, the engine never sees them and the picker is not asked; a completion still goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_admin_paths_are_refused_through_real_envoy() {
    let picker = start_picker(&simple_models()).await;
    let paths: Seen = Arc::default();
    let record = |seen: Seen| {
        move |uri: axum::http::Uri| async move {
            seen.lock().push(SeenRequest {
                request_id: uri.path().to_owned(),
                destination: String::new(),
                body: vec![],
            });
            axum::Json(serde_json::json!({"choices": [{"index": 0, "text": "ok"}]}))
        }
    };
    let app = axum::Router::new().fallback(record(paths.clone()));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    let _agent = report_pods(&picker, &[pod("a", engine, vec![])]).await;
    let port = picker.ext_proc_addr.port();
    let (_e, gw) = start_envoy(&deploy_file("envoy.yaml"), port).await;
    let (_f, gw_fd) = start_envoy(&deploy_file("envoy-full-duplex.yaml"), port).await;
    let (_o, gw_open) = start_envoy(&with_pods(deploy_file("envoy-fail-open.yaml"), &[engine]), port).await;
    let admin = [
        "/reset_prefix_cache",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/sleep",
        "/collective_rpc",
        "/metrics",
        "/v1/completions/../../reset_prefix_cache",
        "/v1/completionsX",
    ];
    let decisions = || {
        picker
            .gateway
            .metrics
            .routing_decisions
            .get_or_create(&kvroute_picker::metrics::ModelLabel { model: MODEL.into() })
            .get()
    };
    for gw in [gw, gw_fd, gw_open] {
        for path in admin {
            let before = decisions();
            let status = status_of(gw, path, b"").await.unwrap();
            assert_eq!(status, 404, "{path}");
            // With a body Envoy answers before reading it, so the close may reset the connection
            // before the 404 is read: refused either way.
            let got = status_of(gw, path, br#"{"lora_name":"x","lora_path":"/tmp/x"}"#).await;
            let refused = match &got {
                Ok(status) => *status == 404,
                Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
            };
            assert!(refused, "{path}: {got:?}");
            assert_eq!(decisions(), before, "{path}: the picker was asked");
        }
        let body = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":1}}"#);
        let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
        assert_eq!(status, 200, "{resp}");
    }
    // `/health` is the fail-open file's own health check of the pods, not a client's request.
    let seen: Vec<String> = paths.lock().iter().map(|r| r.request_id.clone()).filter(|p| p != "/health").collect();
    assert_eq!(seen, ["/v1/completions"; 3], "only completions reached the engine");
    assert_slots_released(&picker).await;
    picker.shutdown();
}

/// The status of one HTTP/1.1 POST through Envoy, read from the status line alone (no wait for
/// Envoy's delayed close after a local reply).
async fn status_of(addr: SocketAddr, path: &str, body: &[u8]) -> std::io::Result<u16> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let head = format!("POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: {}\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).await?;
    s.write_all(body).await?;
    let mut buf = [0u8; 64];
    let mut got = Vec::new();
    while !got.windows(2).any(|w| w == b"\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no status line within 10 s"))??;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed before a status line"));
        }
        got.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&got);
    Ok(line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0))
}

/// Reads until Envoy closes the connection (or 10 s pass); returns what it sent and when it closed.
async fn read_until_closed(s: &mut tokio::net::TcpStream) -> (String, Option<Instant>) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into_owned(), Some(Instant::now())),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&out).into_owned(), None),
        }
    }
}

/// deploy/'s listener bounds, with the real Envoy (docs/decisions/0024-bounded-outside-input.md): a
/// request whose head never ends is closed at `request_headers_timeout`, one whose body stalls gets
/// a 408 at `request_timeout` (both shortened here from the deploy file's 10 s / 60 s, the rest
/// untouched), and 1,100 half-open connections neither starve a normal request nor outlive the head
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_are_closed_and_do_not_starve_envoy() {
    let picker = start_picker(&simple_models()).await;
    let (engine, _seen) = fake_engine().await;
    let _agent = report_pods(&picker, &[pod("a", engine, vec![])]).await;
    let deployed = deploy_file("envoy.yaml");
    for line in
        ["request_headers_timeout: 10s", "request_timeout: 60s", "stream_idle_timeout: 300s", "idle_timeout: 60s"]
    {
        assert!(deployed.contains(line), "deploy/envoy/envoy.yaml lost `{line}`");
    }
    let config = deployed
        .replace("request_headers_timeout: 10s", "request_headers_timeout: 1s")
        .replace("request_timeout: 60s", "request_timeout: 2s");
    let (_envoy, gw) = start_envoy(&config, picker.ext_proc_addr.port()).await;
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":1}}"#);

    // A head that never ends: closed after ~1 s.
    let mut s = tokio::net::TcpStream::connect(gw).await.unwrap();
    let t = Instant::now();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n").await.unwrap();
    let (_, closed) = read_until_closed(&mut s).await;
    let head_took = closed.expect("a half-sent head is closed").duration_since(t);
    assert!(head_took >= Duration::from_millis(900) && head_took < Duration::from_secs(4), "head: {head_took:?}");

    // A body that stalls: 408 after ~2 s.
    let mut s = tokio::net::TcpStream::connect(gw).await.unwrap();
    let t = Instant::now();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{\"model\"").await.unwrap();
    let (answer, closed) = read_until_closed(&mut s).await;
    let body_took = closed.expect("a stalled body is answered and closed").duration_since(t);
    assert!(answer.starts_with("HTTP/1.1 408"), "stalled body: {answer}");
    assert!(body_took >= Duration::from_millis(1900) && body_took < Duration::from_secs(5), "body: {body_took:?}");

    // 1,100 half-open connections, then a normal request.
    let mut open = Vec::new();
    for _ in 0..1100 {
        let mut s = tokio::net::TcpStream::connect(gw).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n").await.unwrap();
        open.push(s);
    }
    let t = Instant::now();
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    let normal = t.elapsed();
    assert_eq!(status, 200, "{resp}");
    assert!(normal < Duration::from_secs(2), "a normal request took {normal:?} beside 1,100 half-open ones");
    let closers = open.into_iter().map(|mut s| tokio::spawn(async move { read_until_closed(&mut s).await.1 }));
    let mut still_open = 0;
    for c in closers {
        if c.await.unwrap().is_none() {
            still_open += 1;
        }
    }
    assert_eq!(still_open, 0, "half-open connections outlived the head timeout");
    eprintln!(
        "envoy bounds: half-sent head closed after {head_took:?} (1 s timeout), stalled body 408+close after \
         {body_took:?} (2 s timeout), a normal request beside 1,100 half-open connections {normal:?}"
    );
    picker.shutdown();
}

/// One request with `method` (no body) to `addr`; the status and the body.
async fn request(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!("{method} {path} HTTP/1.1\r\nHost: stats\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (status, body.to_owned());
    }
    // Chunked: `<hex size>\r\n<data>\r\n`… until size 0.
    let (mut rest, mut plain) = (body, String::new());
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        plain.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    (status, plain)
}

/// deploy/k8s/components/envoy/envoy.yaml's `stats` listener, on the real Envoy: GET
/// /stats/prometheus reaches the admin interface and parses as the Prometheus text format (the
/// picker cluster's series among them); every other admin path, and any other method, is refused
/// there, and the Envoy keeps serving (`/quitquitquit` did not reach the admin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_envoy_stats_listener_exposes_only_prometheus_stats() {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/components/envoy/envoy.yaml"),
    )
    .unwrap();
    let stats_port = free_port().unwrap();
    assert!(text.contains("port_value: 9902"), "the stats listener's port changed");
    let config = text.replace("kvroute-picker.kvroute.svc.cluster.local", "127.0.0.1").replace(
        "{ address: 0.0.0.0, port_value: 9902 }",
        &format!("{{ address: 127.0.0.1, port_value: {stats_port} }}"),
    );
    let (_e, gw) = start_envoy(&config, free_port().unwrap()).await;
    let stats: SocketAddr = format!("127.0.0.1:{stats_port}").parse().unwrap();

    let (status, body) = request(stats, "GET", "/stats/prometheus").await;
    assert_eq!(status, 200, "{body}");
    let mut samples = 0;
    for line in body.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let kind = rest.split(' ').nth(1);
            assert!(matches!(kind, Some("counter" | "gauge" | "histogram" | "summary" | "untyped")), "{line}");
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample: {line}"));
        let name = series.split('{').next().unwrap();
        assert!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line}"
        );
        assert!(value.parse::<f64>().is_ok() || matches!(value, "NaN" | "+Inf" | "-Inf"), "bad value in {line}");
        samples += 1;
    }
    assert!(samples > 50, "too few samples: {samples}");
    assert!(
        body.lines().any(|l| l.starts_with("envoy_cluster_") && l.contains("envoy_cluster_name=\"kvroute_picker\"")),
        "no kvroute_picker cluster series"
    );

    for (method, path) in [
        ("GET", "/stats"),
        ("GET", "/server_info"),
        ("GET", "/config_dump"),
        ("POST", "/quitquitquit"),
        ("POST", "/stats/prometheus"),
        ("GET", "/stats/prometheus/../../quitquitquit"),
    ] {
        let (status, body) = request(stats, method, path).await;
        assert_eq!(status, 404, "{method} {path} was not refused: {body}");
    }
    // Envoy is still up: /quitquitquit did not reach its admin.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(request(stats, "GET", "/stats/prometheus").await.0, 200);
    assert_eq!(request(gw, "GET", "/not-inference").await.0, 404, "the gateway listener is unchanged");
}

/// deploy/'s listener filter: a connection that sends no byte, or part of an HTTP/2 preface,
/// opens no stream (so no `request_headers_timeout`); the HTTP inspector closes it at
/// `listener_filters_timeout` (5 s in deploy/, 1 s here). 1,100 such connections neither starve a
/// normal request nor outlive it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_a_request_are_closed_by_envoy() {
    let picker = start_picker(&simple_models()).await;
    let (engine, _seen) = fake_engine().await;
    let _agent = report_pods(&picker, &[pod("a", engine, vec![])]).await;
    let deployed = deploy_file("envoy.yaml");
    assert!(deployed.contains("listener_filters_timeout: 5s"), "deploy/envoy/envoy.yaml lost its listener filter");
    let config = deployed.replace("listener_filters_timeout: 5s", "listener_filters_timeout: 1s");
    let (_envoy, gw) = start_envoy(&config, picker.ext_proc_addr.port()).await;
    let t = Instant::now();
    let mut open = Vec::new();
    for i in 0..1100 {
        let mut s = tokio::net::TcpStream::connect(gw).await.unwrap();
        if i % 2 == 1 {
            s.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        }
        open.push(s);
    }
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":1}}"#);
    let t_normal = Instant::now();
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    let normal = t_normal.elapsed();
    assert_eq!(status, 200, "{resp}");
    let closers = open.into_iter().map(|mut s| tokio::spawn(async move { read_until_closed(&mut s).await.1 }));
    let (mut still_open, mut last) = (0, Duration::ZERO);
    for c in closers {
        match c.await.unwrap() {
            Some(at) => last = last.max(at.duration_since(t)),
            None => still_open += 1,
        }
    }
    assert_eq!(still_open, 0, "connections without a request outlived the listener filter timeout");
    assert!(last < Duration::from_secs(8), "the last one closed after {last:?}");
    eprintln!(
        "envoy listener filter: 1,100 connections (550 silent, 550 with a partial HTTP/2 preface) all closed \
         {last:?} after the first opened (1 s timeout); a normal request beside them {normal:?}"
    );
    picker.shutdown();
}

/// An engine stand-in that freezes like a SIGSTOPped process on its first completion: from then
/// on nothing it holds or receives is answered (health checks included), its port still accepts.
async fn freezing_engine() -> (SocketAddr, Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let frozen = Arc::new(AtomicBool::new(false));
    let (f1, f2) = (frozen.clone(), frozen.clone());
    let app = axum::Router::new()
        .route(
            "/health",
            axum::routing::get(move || {
                let f = f1.clone();
                async move {
                    if f.load(Ordering::Acquire) {
                        std::future::pending::<()>().await;
                    }
                    "ok"
                }
            }),
        )
        .route(
            "/v1/completions",
            axum::routing::post(move || {
                let f = f2.clone();
                async move {
                    f.store(true, Ordering::Release);
                    std::future::pending::<()>().await;
                    "never"
                }
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, frozen)
}

/// Whether the picker holds pod `name` unreachable.
fn unreachable(picker: &RunningPicker, name: &str) -> bool {
    picker.gateway.pool.pods().iter().any(|p| p.name == name && p.unreachable)
}

/// deploy/envoy/envoy-fail-open.yaml's retry: a request routed to a pod whose port refuses
/// connections is tried again on another pod (the client sees a 200, never the dead pod's 503),
/// and the picker marks the dead pod from the attempt count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_failure_is_retried_on_another_pod_through_real_envoy() {
    let picker = start_picker(&simple_models()).await;
    let (live, live_seen) = fake_engine().await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let prompt: Vec<u32> = (0..64).map(|i| 900 + i).collect();
    let _agent = report_pods(&picker, &[pod("live", live, vec![]), pod("dead", dead, hashes(&prompt))]).await;
    let config = with_pods(deploy_file("envoy-fail-open.yaml"), &[live, dead]);
    let (_e, gw) = start_envoy(&config, picker.ext_proc_addr.port()).await;

    // The picker chooses the cache-hot dead pod; Envoy's retry serves the request on the other.
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let (status, head, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    assert_eq!(status, 200, "a connect failure reached the client: {head}\n{resp}");
    assert_eq!(header_of(&head, "x-kvroute-upstream-attempts"), None, "the attempt count is removed");
    let seen = live_seen.lock().last().cloned().expect("the retry reached the live pod");
    assert_eq!(seen.destination, dead.to_string(), "the picker had chosen the dead pod");
    assert!(unreachable(&picker, "dead"), "the attempt count marks the pod Envoy could not connect to");
    // Marked: the next request is routed to the live pod in one attempt.
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(live_seen.lock().last().unwrap().destination, live.to_string());
    assert_eq!(picker.gateway.metrics.upstream_connect_failures.get(), 1, "one failed connect counted");
    picker.shutdown();
}

/// A pod whose engine freezes (like SIGSTOP: its port accepts, nothing answers) with a request in
/// flight, through deploy/envoy/envoy.yaml (fail closed, the chaos suite's file): the picker
/// finds the engine silent for `limits.frozen_engine_ms` (2 s here), ends the request with a 503
/// within seconds instead of the route's 600 s, and keeps the pod out while it stays silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_engine_fails_its_requests_in_seconds_through_real_envoy() {
    let picker = start_picker(&format!("{}limits: {{frozen_engine_ms: 2000}}\n", simple_models())).await;
    let (live, live_seen) = fake_engine().await;
    let (frozen, is_frozen) = freezing_engine().await;
    let prompt: Vec<u32> = (0..64).map(|i| 2000 + i).collect();
    let _agent = report_pods(&picker, &[pod("live", live, vec![]), pod("frozen", frozen, hashes(&prompt))]).await;
    let (_e, gw) = start_envoy(&deploy_file("envoy.yaml"), picker.ext_proc_addr.port()).await;

    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let t = Instant::now();
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    let failed_after = t.elapsed();
    assert!(is_frozen.load(std::sync::atomic::Ordering::Acquire), "the request did not reach the freezing pod");
    assert_eq!(status, 503, "{resp}");
    assert!(resp.contains("stopped answering"), "{resp}");
    assert!(failed_after >= Duration::from_millis(1500), "ended before the engine was silent 2 s: {failed_after:?}");
    assert!(failed_after < Duration::from_secs(10), "an in-flight request to a frozen engine took {failed_after:?}");
    assert!(unreachable(&picker, "frozen"), "the frozen pod is marked");
    assert_slots_released(&picker).await;
    // Its port accepts but nothing answers: the unreachable probe keeps it out.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(unreachable(&picker, "frozen"), "a frozen engine's accepting port does not clear the mark");
    let (status, _, resp) = post(gw, "/v1/completions", body.as_bytes(), "").await;
    assert_eq!(status, 200, "with the frozen pod out, the other serves: {resp}");
    assert_eq!(live_seen.lock().last().unwrap().destination, live.to_string());
    eprintln!("frozen engine: its in-flight request ended with a 503 after {failed_after:?} (frozen_engine_ms 2000)");
    picker.shutdown();
}
