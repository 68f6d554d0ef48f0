//! Observability (docs/design.md §9):
//! - the Grafana dashboard and the alert rules under `deploy/observability/` query only metrics the
//!   picker exports, and carry docs/design.md §9 panels and thresholds;
//! - `/explain` reports factors, exclusions and the would-be choice without changing state;
//! - the `kvroute-picker` binary exports OTLP spans to a real OTLP gRPC receiver started here (the
//!   decision span continues the request's W3C `traceparent`, its steps are child spans, and the
//!   `traceparent` set on the upstream request names the decision span), and every JSON log line
//!   about the request carries its request id.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_harness::paths::free_port;
use kvroute_harness::{FakeAgent, FakePod};
use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use kvroute_common::{BlockHash, BlockHasher};
use kvroute_picker::RunningPicker;
use kvroute_picker::config::PickerConfig;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";
const TIMEOUT: Duration = Duration::from_secs(15);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn config_yaml(ext_proc: &str, ingest: &str, admin: &str) -> String {
    format!(
        "ext_proc_addr: {ext_proc}\nhealth_addr: 127.0.0.1:0\ningest_addr: {ingest}\ninsecure_ingest: true\nadmin_addr: {admin}\nblock_size: 16\n\
         models:\n  - name: {MODEL}\n    target_model: {MODEL}\n    tokenizer: {tok}\n\
           \x20 - name: sql\n    target_model: {MODEL}\n    adapter: sql-lora\n\
         scoring: {{ max_queue: 20, health_exclusion_threshold: 0.3 }}\n",
        tok = repo().join("tests/fixtures/tokenizer-qwen2.5").display()
    )
}

async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
}

async fn metrics_text(admin: SocketAddr) -> String {
    let (status, text) = http(admin, "GET", "/metrics", "").await;
    assert_eq!(status, 200, "{text}");
    text
}

/// Every series name the exposition can contain, from its `# TYPE` lines (a family without samples
/// yet still has one): counters as `<name>_total`, histograms as `_bucket`/`_sum`/`_count`.
fn exported_series(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        if parts.next() != Some("#") || parts.next() != Some("TYPE") {
            continue;
        }
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else { continue };
        match kind {
            "counter" => {
                out.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{s}"));
                }
            }
            _ => {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

/// `epp_*` / `kvroute_*` identifiers in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start_ok = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if start_ok && (expr[i..].starts_with("epp_") || expr[i..].starts_with("kvroute_")) {
            let end = expr[i..].find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(expr.len(), |e| i + e);
            out.push(expr[i..end].to_owned());
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + i * 7 + salt).collect()
}

fn hashes_of(toks: &[u32]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    BlockHasher::new(MODEL, None, 16).hash_prompt(toks, &mut out);
    out
}

/// Waits until `/metrics` shows every pod.
async fn wait_pods(admin: SocketAddr, pods: &[FakePod]) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let m = metrics_text(admin).await;
        // Reported: a pool pod is listed (health 0) before its agent's first report.
        let reported = |p: &FakePod| {
            let key = format!("epp_pod_health_score{{model_server_pod=\"{}\"}} ", p.name);
            m.lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .is_some_and(|v| v > 0.0)
        };
        if pods.iter().all(reported) {
            return;
        }
        assert!(Instant::now() < deadline, "pods never showed up: {m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn pods(hot: Vec<BlockHash>) -> Vec<FakePod> {
    vec![
        FakePod::new("pod-a", "10.0.0.1:8000", MODEL),
        FakePod::new("pod-b", "10.0.0.2:8000", MODEL).with_blocks(hot),
        FakePod::new("pod-sick", "10.0.0.3:8000", MODEL).with_health(0.1),
    ]
}

async fn start_in_process() -> RunningPicker {
    let config = PickerConfig::from_yaml(&config_yaml("127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")).unwrap();
    config.validate().unwrap();
    kvroute_picker::start(&config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alert_rules_query_only_exported_metrics() {
    let picker = start_in_process().await;
    // Labelled families appear once they have a sample: pods reported, one LoRA request routed.
    let fleet = pods(Vec::new());
    let _agent = FakeAgent::connect(picker.ingest_addr, &fleet).await.unwrap();
    wait_pods(picker.admin_addr, &fleet).await;
    let body = serde_json::json!({"model": "sql", "prompt": tokens(40, 1)}).to_string();
    let r = route_one(picker.ext_proc_addr, &[("x-request-id", "r1")], &body).await;
    assert!(matches!(r.response, Some(Response::RequestBody(_))), "{r:?}");
    let exported = exported_series(&metrics_text(picker.admin_addr).await);
    for name in [
        "epp_routing_decisions_total",
        "epp_cache_match_ratio_bucket",
        "epp_queue_depth",
        "epp_pod_health_score",
        "epp_scoring_latency_us_bucket",
        "epp_prefix_tree_nodes",
        "epp_stale_cache_routing_total",
        "epp_adapter_loads_triggered_total",
        "epp_candidate_pods",
        "epp_composite_score_bucket",
        "epp_max_queue",
    ] {
        assert!(exported.contains(name), "docs/design.md §9 metric {name} not exported: {exported:?}");
    }
    let dir = repo().join("deploy/observability");

    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("grafana-dashboard.json")).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    assert!(panels.len() >= 8, "docs/design.md §9 recommends eight panels, the operator's view adds more");
    let vars: Vec<&str> =
        dashboard["templating"]["list"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    for v in ["datasource", "namespace", "instance"] {
        assert!(vars.contains(&v), "dashboard variable ${v} missing: {vars:?}");
    }
    let mut queried = BTreeSet::new();
    for p in panels {
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            let names = metric_names(expr);
            assert!(!names.is_empty(), "panel {} queries no kvroute metric", p["title"]);
            assert!(expr.contains("namespace=~\"$namespace\""), "panel {} ignores $namespace: {expr}", p["title"]);
            // The agents' families are checked against the agent's own exposition (agent/src/telemetry.rs).
            queried.extend(names.into_iter().filter(|n| !n.starts_with("kvroute_agent_")));
        }
    }
    for want in [
        "epp_cache_match_ratio_bucket",
        "epp_queue_depth",
        "epp_routing_decisions_total",
        "epp_composite_score_bucket",
        "epp_stale_cache_routing_total",
        "epp_scoring_latency_us_bucket",
        "epp_pod_health_score",
        "epp_adapter_loads_triggered_total",
        "epp_pool_routable_pods",
        "epp_request_errors_total",
        "epp_decision_latency_us_bucket",
    ] {
        assert!(queried.contains(want), "no panel for {want}");
    }

    let rules: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("alerts.yaml")).unwrap()).unwrap();
    let mut alerts = HashMap::new();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let expr = rule["expr"].as_str().unwrap().to_owned();
            queried.extend(metric_names(&expr));
            alerts.insert(rule["alert"].as_str().unwrap().to_owned(), (expr, rule["for"].as_str().unwrap().to_owned()));
        }
    }
    let unknown: Vec<_> = queried.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(unknown.is_empty(), "dashboard/rules query metrics the picker does not export: {unknown:?}");

    // docs/design.md §9 thresholds.
    let has = |alert: &str, needles: &[&str], dur: &str| {
        let (expr, d) = alerts.get(alert).unwrap_or_else(|| panic!("alert {alert} missing"));
        assert_eq!(d, dur, "{alert} duration");
        for n in needles {
            assert!(expr.contains(n), "{alert}: `{expr}` lacks `{n}`");
        }
    };
    has("EppCacheMatchLow", &["histogram_quantile(0.5", "epp_cache_match_ratio_bucket", "< 0.40"], "10m");
    has("EppQueueNearMax", &["epp_queue_depth", "model_server_pod", "0.8 * max by (namespace) (epp_max_queue)"], "5m");
    has("EppStaleRoutingHigh", &["epp_stale_cache_routing_total", "epp_routing_decisions_total", "> 0.05"], "5m");
    has("EppScoringLatencyHigh", &["histogram_quantile(0.99", "epp_scoring_latency_us_bucket", "> 5000"], "5m");
    has("EppNoRoutablePods", &["epp_pool_routable_pods", "== 0"], "1m");
    has("EppErrorRateHigh", &["epp_request_errors_total", "> 0.05"], "5m");
    has("EppFleetKvFull", &["epp_full_fleet_stays_total", "epp_routing_decisions_total", "> 0.01"], "10m");

    // Every alert has a promtool unit test that makes it fire (alerts.test.yaml), and the rules
    // and those tests pass the real promtool.
    let tests: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("alerts.test.yaml")).unwrap()).unwrap();
    let mut fired = BTreeSet::new();
    for t in tests["tests"].as_array().unwrap() {
        for a in t["alert_rule_test"].as_array().unwrap() {
            if !a["exp_alerts"].as_array().unwrap().is_empty() {
                fired.insert(a["alertname"].as_str().unwrap().to_owned());
            }
        }
    }
    for alert in alerts
        .keys()
        .filter(|a| !["EppCacheMatchLow", "EppStaleRoutingHigh", "EppScoringLatencyHigh"].contains(&a.as_str()))
    {
        assert!(fired.contains(alert), "alert {alert} has no promtool test that fires it");
    }
    let promtool = promtool();
    for args in [vec!["check", "rules", "alerts.yaml"], vec!["test", "rules", "alerts.test.yaml"]] {
        let out = Command::new(&promtool).args(&args).current_dir(&dir).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    picker.shutdown();
}

/// `promtool` (`$KVROUTE_PROMTOOL`, else on `PATH`); Debian's `prometheus` package ships it
/// (`scripts/install-promtool`, run by scripts/test, installs it).
fn promtool() -> PathBuf {
    let p = std::env::var_os("KVROUTE_PROMTOOL").map_or_else(|| PathBuf::from("promtool"), PathBuf::from);
    let found = Command::new(&p).arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(
        found,
        "promtool not found: run scripts/install-promtool (Debian package prometheus) or set KVROUTE_PROMTOOL"
    );
    p
}

/// Findings of `promtool check metrics` that the contract's names force (docs/operations.md
/// "Metrics"): the two `_us` latency histograms of docs/design.md §9.
const ALLOWED_LINT: [&str; 2] = [
    "epp_scoring_latency_us metric names should not contain abbreviated units",
    "epp_decision_latency_us metric names should not contain abbreviated units",
];

/// The page in the Prometheus text format 0.0.4 that `promtool check metrics` parses: an
/// OpenMetrics counter family `x` has samples `x_total`, so its HELP/TYPE lines are renamed to
/// `x_total` (the 0.0.4 convention); `# UNIT` and `# EOF` do not exist there. The samples are
/// unchanged.
fn as_text_format(openmetrics: &str) -> String {
    let counters: BTreeSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::new();
    for l in openmetrics.lines() {
        if l.starts_with("# UNIT ") || l == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = l.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(l));
        out.push('\n');
    }
    out
}

/// The real `/metrics` page, with every family populated, passes `promtool check metrics` except
/// for what the contract's `epp_*` names force (ALLOWED_LINT).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_page_passes_promtool_check_metrics() {
    let picker = start_in_process().await;
    picker.gateway.metrics.set_build_info("0123456789ab", "0.1.0");
    let fleet = pods(Vec::new());
    let _agent = FakeAgent::connect(picker.ingest_addr, &fleet).await.unwrap();
    wait_pods(picker.admin_addr, &fleet).await;
    let body = serde_json::json!({"model": "sql", "prompt": tokens(40, 1)}).to_string();
    let r = route_one(picker.ext_proc_addr, &[("x-request-id", "r1")], &body).await;
    assert!(matches!(r.response, Some(Response::RequestBody(_))), "{r:?}");
    let text = metrics_text(picker.admin_addr).await;
    // Pool gauges and GIE families, populated.
    for needle in [
        "epp_pool_pods 3",
        "epp_pool_ready_pods 3",
        "epp_pool_routable_pods 2",
        "inference_pool_ready_pods{name=\"kvroute\"} 3",
        // (its value is 0 or 1: the routed request's in-flight slot may not be released yet)
        "inference_pool_per_pod_queue_size{name=\"kvroute\",model_server_pod=\"pod-a\"} ",
        "inference_objective_request_total{model_name=\"sql\",target_model_name=\"sql-lora\"} 1",
        "inference_objective_request_total{model_name=\"Qwen/Qwen2.5-7B-Instruct\",target_model_name=\"Qwen/Qwen2.5-7B-Instruct\"} 0",
        "inference_extension_info{commit=\"0123456789ab\",build_ref=\"0.1.0\"} 1",
        "inference_extension_scheduler_e2e_duration_seconds_count 1",
        "epp_request_errors_total{code=\"503\"} 0",
        "epp_pool_reported_pods 3",
        // GIE's per-request families: the routed request's size; running while its stream is
        // open (this stream ends without a response: no duration).
        "inference_objective_request_sizes_count{model_name=\"sql\",target_model_name=\"sql-lora\"} 1",
        "inference_objective_running_requests{model_name=\"sql\"} ",
        "inference_objective_request_duration_seconds_count{model_name=\"sql\",target_model_name=\"sql-lora\"} 0",
    ] {
        assert!(text.contains(needle), "no `{needle}` in {text}");
    }
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(as_text_format(&text).as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let findings = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let unexpected: Vec<&str> =
        findings.lines().filter(|l| !l.trim().is_empty() && !ALLOWED_LINT.iter().any(|a| l.contains(a))).collect();
    assert!(unexpected.is_empty(), "promtool check metrics: {unexpected:?}\nfull: {findings}");
    picker.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_reports_factors_exclusions_and_choice_without_changing_state() {
    let picker = start_in_process().await;
    let prompt = tokens(64, 0);
    let fleet = pods(hashes_of(&prompt));
    let _agent = FakeAgent::connect(picker.ingest_addr, &fleet).await.unwrap();
    wait_pods(picker.admin_addr, &fleet).await;
    let before = metrics_text(picker.admin_addr).await;
    let in_flight = |p: &RunningPicker| {
        let mut v: Vec<_> = p.gateway.pool.pods().into_iter().map(|p| (p.name, p.in_flight, p.queue_depth)).collect();
        v.sort();
        v
    };
    let state_before = in_flight(&picker);

    let body = serde_json::json!({"model": MODEL, "prompt": prompt}).to_string();
    for _ in 0..3 {
        let (status, text) = http(picker.admin_addr, "POST", "/explain", &body).await;
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choice"], "pod-b", "{v}");
        assert_eq!(v["total_blocks"].as_u64(), Some(4), "{v}");
        let cands = v["candidates"].as_array().unwrap();
        assert_eq!(cands.len(), 2, "the sick pod is excluded, not scored: {v}");
        for c in cands {
            for f in ["score", "cache", "load", "queue", "health", "adapter", "matched_blocks", "endpoint"] {
                assert!(!c[f].is_null(), "candidate lacks {f}: {c}");
            }
        }
        let b = cands.iter().find(|c| c["pod"] == "pod-b").unwrap();
        assert_eq!(b["cache"].as_f64(), Some(1.0), "{b}");
        let excluded = v["excluded"].as_array().unwrap();
        assert_eq!(excluded.len(), 1, "{v}");
        assert_eq!(excluded[0]["pod"], "pod-sick");
        assert!(excluded[0]["reason"].as_str().unwrap().contains("health"), "{v}");
    }
    // Nothing routed, nothing reserved.
    assert_eq!(in_flight(&picker), state_before);
    let after = metrics_text(picker.admin_addr).await;
    let decided: Vec<&str> = after.lines().filter(|l| l.starts_with("epp_routing_decisions_total{")).collect();
    assert!(!decided.is_empty() && decided.iter().all(|l| l.ends_with(" 0")), "explain counted a decision: {after}");
    let count = |t: &str| t.lines().find(|l| l.starts_with("epp_scoring_latency_us_count")).map(str::to_owned);
    assert_eq!(count(&before), count(&after), "explain observed a scoring latency");

    // Unknown model and bad JSON: clear errors, not panics.
    let (status, text) = http(picker.admin_addr, "POST", "/explain", r#"{"model":"nope","prompt":"x"}"#).await;
    assert_eq!(status, 404, "{text}");
    let (status, _) = http(picker.admin_addr, "POST", "/explain", "{not json").await;
    assert_eq!(status, 400);
    picker.shutdown();
}

/// A real OTLP gRPC trace receiver: keeps every span it is sent, with its resource's service name.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    any_value::Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                spans.extend(ss.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

fn hdr(k: &str, v: &str) -> HeaderValue {
    HeaderValue { key: k.into(), value: String::new(), raw_value: v.as_bytes().to_vec() }
}

fn set_header(common: &CommonResponse, key: &str) -> Option<String> {
    let h =
        common.header_mutation.as_ref()?.set_headers.iter().find_map(|h| h.header.as_ref().filter(|h| h.key == key))?;
    Some(String::from_utf8(h.raw_value.clone()).unwrap())
}

async fn recv(replies: &mut tonic::Streaming<ProcessingResponse>) -> ProcessingResponse {
    tokio::time::timeout(TIMEOUT, replies.message()).await.unwrap().unwrap().unwrap()
}

/// One BUFFERED-mode request over ext_proc (headers, then the whole body); the answer to the body.
async fn route_one(ext_proc: SocketAddr, extra: &[(&str, &str)], body: &str) -> ProcessingResponse {
    let mut client = ExternalProcessorClient::connect(format!("http://{ext_proc}")).await.unwrap();
    let (tx, rx) = mpsc::channel(4);
    let mut replies = client.process(ReceiverStream::new(rx)).await.unwrap().into_inner();
    let mut headers = vec![hdr(":method", "POST"), hdr(":path", "/v1/completions")];
    headers.extend(extra.iter().map(|(k, v)| hdr(k, v)));
    let headers = HttpHeaders { headers: Some(HeaderMap { headers }), end_of_stream: false, ..Default::default() };
    let msg = ProcessingRequest { request: Some(Request::RequestHeaders(headers)), ..Default::default() };
    tx.send(msg).await.unwrap();
    assert!(matches!(recv(&mut replies).await.response, Some(Response::RequestHeaders(_))));
    let body = HttpBody { body: body.as_bytes().to_vec(), end_of_stream: true, ..Default::default() };
    tx.send(ProcessingRequest { request: Some(Request::RequestBody(body)), ..Default::default() }).await.unwrap();
    recv(&mut replies).await
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_exports_otlp_spans_continues_traceparent_and_logs_request_id_everywhere() {
    // The receiver.
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);

    // The picker binary, exporting to it, logging at TRACE.
    let (ext_proc, ingest, admin) = (free_port().unwrap(), free_port().unwrap(), free_port().unwrap());
    let dir = std::env::temp_dir().join(format!("kvroute-picker-otel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("picker.yaml");
    let addr = |p: u16| format!("127.0.0.1:{p}");
    // The binary routes only to its pool's pods (docs/design.md §14): a pool file with the fake
    // pods, named as the pool names its endpoints (`<pod>-rank-0`).
    let yaml = binary_config_yaml(&dir, &addr(ext_proc), &addr(ingest), &addr(admin));
    std::fs::write(&config, yaml).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
        .args(["--config", config.to_str().unwrap()])
        .env("EPP_LOG_LEVEL", "trace,h2=info,tonic=info,hyper=info,hyper_util=info,tower=info,tokenizers=info")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{otlp}"))
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env_remove("OTEL_SDK_DISABLED")
        .env_remove("OTEL_TRACES_EXPORTER")
        .env_remove("OTEL_SERVICE_NAME")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut child = KillOnDrop(child);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = ready_tx.send(line);
    });
    let log_lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let log_reader = {
        let lines = log_lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        })
    };
    let ready = ready_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(ready.trim(), "READY", "logs: {:?}", log_lines.lock().unwrap());
    let admin: SocketAddr = addr(admin).parse().unwrap();

    let prompt = tokens(64, 0);
    let fleet = pool_pods(hashes_of(&prompt));
    let _agent = FakeAgent::connect(addr(ingest).parse().unwrap(), &fleet).await.unwrap();
    wait_pods(admin, &fleet).await;

    // One request with a W3C traceparent, as Envoy would send it.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_span = "00f067aa0ba902b7";
    let request_id = "req-otel-1";
    let traceparent = format!("00-{trace_id}-{parent_span}-01");
    let body = serde_json::json!({"model": MODEL, "prompt": prompt}).to_string();
    let r = route_one(
        addr(ext_proc).parse().unwrap(),
        &[("x-request-id", request_id), ("traceparent", &traceparent), ("tracestate", "vendor=1")],
        &body,
    )
    .await;
    let Some(Response::RequestBody(b)) = &r.response else { panic!("expected a body answer: {r:?}") };
    let common = b.response.as_ref().unwrap();
    assert_eq!(set_header(common, "x-gateway-destination-endpoint").as_deref(), Some("10.0.0.2:8000"));
    // Upstream traceparent: same trace, the picker's decision span as parent, sampled.
    let upstream = set_header(common, "traceparent").expect("traceparent passed upstream");
    let parts: Vec<&str> = upstream.split('-').collect();
    assert_eq!(parts.len(), 4, "{upstream}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", trace_id, "01"), "{upstream}");
    assert_ne!(parts[2], parent_span, "the upstream parent must be the picker's span");
    assert_eq!(set_header(common, "tracestate").as_deref(), Some("vendor=1"));
    let decision_span_id = parts[2].to_owned();

    // The spans reach the receiver (batch delay 100 ms).
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let deadline = Instant::now() + TIMEOUT;
    let spans = loop {
        let spans = receiver.spans.lock().unwrap().clone();
        let names: BTreeSet<_> =
            spans.iter().filter(|(_, s)| hex(&s.trace_id) == trace_id).map(|(_, s)| s.name.clone()).collect();
        if ["epp.decision", "epp.parse", "epp.tokenize", "epp.hash", "epp.score"].iter().all(|n| names.contains(*n)) {
            break spans;
        }
        assert!(Instant::now() < deadline, "spans never arrived; got {names:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ours: Vec<_> = spans.iter().filter(|(_, s)| hex(&s.trace_id) == trace_id).collect();
    let (service, decision) = ours.iter().find(|(_, s)| s.name == "epp.decision").unwrap();
    assert_eq!(service, "kvroute-picker");
    assert_eq!(hex(&decision.parent_span_id), parent_span, "decision span continues the request's trace");
    assert_eq!(hex(&decision.span_id), decision_span_id, "upstream traceparent names the decision span");
    let attr = |s: &opentelemetry_proto::tonic::trace::v1::Span, k: &str| {
        s.attributes.iter().find(|kv| kv.key == k).and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            any_value::Value::StringValue(v) => Some(v.clone()),
            _ => None,
        })
    };
    assert_eq!(attr(decision, "request_id").as_deref(), Some(request_id));
    assert_eq!(attr(decision, "pod").as_deref(), Some("pod-b-rank-0"));
    assert_eq!(attr(decision, "model").as_deref(), Some(MODEL));
    for step in ["epp.parse", "epp.tokenize", "epp.hash", "epp.score"] {
        let (_, s) = ours.iter().find(|(_, s)| s.name == step).unwrap();
        assert_eq!(s.parent_span_id, decision.span_id, "{step} is a step of the decision");
        assert!(
            s.start_time_unix_nano >= decision.start_time_unix_nano
                && s.end_time_unix_nano <= decision.end_time_unix_nano
        );
    }

    // Stop the picker (flushes), then read every log line.
    stop_on_sigterm(&mut child);
    log_reader.join().unwrap();
    let lines = log_lines.lock().unwrap().clone();
    let mut about_request = 0;
    let mut messages = BTreeSet::new();
    for line in &lines {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        let target = v["target"].as_str().unwrap_or_default();
        // The request path: the ext_proc stream and the decision pipeline it runs.
        if !["kvroute_picker::ext_proc", "kvroute_picker::decision"].iter().any(|m| target.starts_with(m)) {
            continue;
        }
        about_request += 1;
        assert_eq!(v["fields"]["request_id"].as_str(), Some(request_id), "log line without the request id: {line}");
        messages.insert(v["fields"]["message"].as_str().unwrap_or_default().to_owned());
    }
    for m in
        ["request received", "request scored", "pod selected", "candidate", "timings", "block walk", "block hashes"]
    {
        assert!(messages.contains(m), "no `{m}` line among {messages:?}");
    }
    assert!(about_request >= 6, "{about_request} request lines: {lines:?}");
}

/// The binary's config for these listeners, with the fake pods as its pool file (written to
/// `dir/pool.yaml`): the binary routes only to its pool's pods and accepts their reports only
/// from their node's agent.
fn binary_config_yaml(dir: &std::path::Path, ext_proc: &str, ingest: &str, admin: &str) -> String {
    write_pool_file(dir);
    format!("{}pool_file: pool.yaml\n", config_yaml(ext_proc, ingest, admin))
}

/// [`pods`] named as the pool file names its endpoints (`<pod>-rank-0`), for the binary's tests.
fn pool_pods(hot: Vec<BlockHash>) -> Vec<FakePod> {
    pods(hot)
        .into_iter()
        .map(|mut p| {
            p.name = format!("{}-rank-0", p.name);
            p
        })
        .collect()
}

/// Sends SIGTERM to the picker and waits (at most [`TIMEOUT`]) until it exited.
fn stop_on_sigterm(child: &mut KillOnDrop) {
    let _ = Command::new("kill").args(["-TERM", &child.0.id().to_string()]).status();
    let deadline = Instant::now() + TIMEOUT;
    while child.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "picker did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The fake pods as a pool file in `dir` (`pool.yaml`), on the fake agent's node.
fn write_pool_file(dir: &std::path::Path) {
    let pool: String = ["pod-a:10.0.0.1", "pod-b:10.0.0.2", "pod-sick:10.0.0.3"]
        .iter()
        .map(|p| p.split_once(':').unwrap())
        .map(|(name, ip)| format!("  - {{name: {name}, ip: {ip}, ports: [8000], node: fake-node}}\n"))
        .collect();
    std::fs::write(dir.join("pool.yaml"), format!("pods:\n{pool}")).unwrap();
}

/// At `--log-level debug` and with no OTLP endpoint (the usual production set-up), the DEBUG
/// `candidate` (one per candidate, with the factor breakdown) and `timings` lines are logged,
/// also without an exporter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_at_debug_without_otlp_logs_candidates_and_timings() {
    let (ext_proc, ingest, admin) = (free_port().unwrap(), free_port().unwrap(), free_port().unwrap());
    let dir = std::env::temp_dir().join(format!("kvroute-picker-debug-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("picker.yaml");
    let addr = |p: u16| format!("127.0.0.1:{p}");
    let yaml = binary_config_yaml(&dir, &addr(ext_proc), &addr(ingest), &addr(admin));
    std::fs::write(&config, yaml).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
        .args(["--config", config.to_str().unwrap(), "--log-level", "debug"])
        .env_remove("EPP_LOG_LEVEL")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut child = KillOnDrop(child);
    let mut ready = String::new();
    BufReader::new(stdout).read_line(&mut ready).unwrap();
    assert_eq!(ready.trim(), "READY");
    let log_reader =
        std::thread::spawn(move || BufReader::new(stderr).lines().map_while(Result::ok).collect::<Vec<_>>());
    let prompt = tokens(64, 0);
    let fleet = pool_pods(hashes_of(&prompt));
    let _agent = FakeAgent::connect(addr(ingest).parse().unwrap(), &fleet).await.unwrap();
    wait_pods(addr(admin).parse().unwrap(), &fleet).await;
    let body = serde_json::json!({"model": MODEL, "prompt": prompt}).to_string();
    let r = route_one(addr(ext_proc).parse().unwrap(), &[("x-request-id", "req-debug-1")], &body).await;
    assert!(matches!(r.response, Some(Response::RequestBody(_))), "{r:?}");
    stop_on_sigterm(&mut child);
    let lines = log_reader.join().unwrap();
    let about = |msg: &str| -> Vec<serde_json::Value> {
        lines
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["fields"]["message"] == msg && v["fields"]["request_id"] == "req-debug-1")
            .collect()
    };
    let candidates = about("candidate");
    assert_eq!(candidates.len(), 2, "one DEBUG line per candidate (the sick pod is excluded): {lines:?}");
    for c in &candidates {
        assert_eq!(c["level"], "DEBUG");
        for f in ["pod", "score", "cache", "load", "queue", "health", "adapter", "matched_blocks"] {
            assert!(!c["fields"][f].is_null(), "candidate line lacks {f}: {c}");
        }
    }
    let timings = about("timings");
    assert_eq!(timings.len(), 1, "{lines:?}");
    assert!(timings[0]["fields"]["decision_us"].as_u64().is_some(), "{}", timings[0]);
    // Nothing at TRACE when asked for DEBUG.
    assert!(about("block walk").is_empty());
    // No Rust `Some(..)`/`None` debug formatting in any field of any line.
    for l in &lines {
        assert!(!l.contains("Some(") && !l.contains(":\"None\""), "Rust Option formatting in a log field: {l}");
    }
}
