//! One test per health band (docs/design.md §7), each driven by a shipped mock-NVML scenario
//! (`agent/scenarios/`): the agent library runs against a fake engine (axum: `/metrics` fixture,
//! `/health`, `/v1/models`, a fast completion probe) and the test reads the score the agent would
//! report from its per-pod state.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use kvroute_agent::app::{self, RunningAgent};
use kvroute_agent::config::AgentConfig;
use kvroute_agent::gpu::mock::MockGpuSource;
use kvroute_agent::health::band;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// Faults of the fake engine, switchable while it runs.
#[derive(Default)]
struct Faults {
    /// `/health` answers 503.
    unhealthy: AtomicBool,
    /// `/metrics` answers a page that does not parse (an HTML error page).
    metrics_broken: AtomicBool,
}

fn no_faults() -> Arc<Faults> {
    Arc::new(Faults::default())
}

/// A fake engine with switchable `faults`.
async fn fake_engine(faults: Arc<Faults>) -> std::net::SocketAddr {
    use axum::http::StatusCode;
    use axum::routing::{get, post};
    let page = std::fs::read_to_string(format!(
        "{}/../tests/fixtures/vllm-metrics/vllm-metrics-busy-lora.txt",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("fixture");
    let on_metrics = faults.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let broken = on_metrics.metrics_broken.load(Ordering::Relaxed);
                std::future::ready(if broken { "<html>502 Bad Gateway</html>\n".to_string() } else { page.clone() })
            }),
        )
        .route(
            "/health",
            get(move || {
                let bad = faults.unhealthy.load(Ordering::Relaxed);
                async move { if bad { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK } }
            }),
        )
        .route("/v1/models", get(|| async { axum::Json(serde_json::json!({"data": [{"id": MODEL}]})) }))
        .route("/v1/completions", post(|| async { axum::Json(serde_json::json!({"choices": [{"text": "x"}]})) }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// Starts the agent on GPU 0 with `scenario`; no picker listens (the stream just retries).
async fn agent_with(scenario: &str, faults: Arc<Faults>) -> RunningAgent {
    let http = fake_engine(faults).await;
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let yaml = format!(
        "pickers: [\"http://{nobody}\"]\ninsecure_ingest: true\nmetrics_addr: 127.0.0.1:0\nscrape_interval_ms: 50\n\
         probe_interval_ms: 200\nprobe_timeout_ms: 1000\n\
         engines:\n  - pod: engine-0\n    endpoint: {http}\n    model: {MODEL}\n    gpus: [0]\n    max_num_seqs: 8\n"
    );
    let config: AgentConfig = serde_norway::from_str(&yaml).expect("config");
    config.validate().expect("valid");
    let path = format!("{}/scenarios/{scenario}", env!("CARGO_MANIFEST_DIR"));
    let gpu = Arc::new(MockGpuSource::from_file(&path).expect("scenario"));
    app::start(config, gpu).await.expect("agent starts")
}

/// Polls the pod's reported stats until `pred(score, reason)` holds; returns them.
async fn wait_health(agent: &RunningAgent, what: &str, pred: impl Fn(f64, &str) -> bool) -> (f64, String) {
    let pod = agent.hub.pod("engine-0-rank-0").expect("pod");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stats = pod.snapshot().stats.expect("stats");
        // Scores once a probe answered (the pod is then ready).
        if stats.ready && pred(stats.health_score, &stats.health_reason) {
            return (stats.health_score, stats.health_reason);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: last score {} ({:?}, ready {})",
            stats.health_score,
            stats.health_reason,
            stats.ready
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn band_of(scenario: &str) -> (f64, String) {
    let agent = agent_with(scenario, no_faults()).await;
    // Give the probe and a few scrapes time, so a penalty that is about to appear has appeared.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let got = wait_health(&agent, scenario, |_, _| true).await;
    agent.shutdown().await;
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_scenario_scores_one() {
    let (score, reason) = band_of("healthy.yaml").await;
    if reason == "host memory pressure" {
        // The host running the test is itself short of memory (> 90 % used): a real input.
        eprintln!("host memory pressure on this machine: {score}");
        return;
    }
    assert_eq!((score, reason.as_str()), (1.0, ""));
    assert_eq!(band(score), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moderate_thermal_throttling_is_minor() {
    let (score, reason) = band_of("thermal-moderate.yaml").await;
    assert!((0.7..=0.9).contains(&score), "{score} {reason}");
    assert_eq!(reason, "thermal throttling");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn critical_thermal_throttling_is_significant() {
    let (score, reason) = band_of("thermal-critical.yaml").await;
    assert!((0.3..=0.6).contains(&score), "{score} {reason}");
    assert_eq!(reason, "thermal throttling");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrected_ecc_burst_is_significant() {
    let agent = agent_with("ecc-corrected-burst.yaml", no_faults()).await;
    let (score, reason) =
        wait_health(&agent, "corrected ECC burst", |s, r| r == "corrected ECC errors" && s < 0.7).await;
    assert!((0.3..=0.6).contains(&score), "{score} {reason}");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncorrected_ecc_is_excluded() {
    let (score, reason) = band_of("ecc-uncorrected-gpu0.yaml").await;
    assert!(score > 0.0 && score < 0.3, "{score} {reason}");
    assert_eq!(reason, "uncorrected ECC errors");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ecc_timeline_moves_the_pod_from_healthy_to_excluded() {
    let agent = agent_with("ecc-starts-at-3s.yaml", no_faults()).await;
    let (early, _) = wait_health(&agent, "healthy before t=3 s", |_, _| true).await;
    assert_eq!(early, 1.0);
    let (late, reason) = wait_health(&agent, "excluded after t=3 s", |s, _| s < 0.3).await;
    assert_eq!((band(late), reason.as_str()), (1, "uncorrected ECC errors"));
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_engine_health_scores_zero() {
    let faults = no_faults();
    let agent = agent_with("healthy.yaml", faults.clone()).await;
    wait_health(&agent, "healthy first", |s, _| s == 1.0).await;
    faults.unhealthy.store(true, Ordering::Relaxed);
    let pod = agent.hub.pod("engine-0-rank-0").expect("pod");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = pod.snapshot().stats.expect("stats");
        if s.health_score == 0.0 {
            assert_eq!(s.health_reason, "engine /health failing");
            assert!(!s.ready, "a failing engine is not ready");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "score stayed {}", s.health_score);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_annotations_are_reported_in_pod_info() {
    let http = fake_engine(no_faults()).await;
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let yaml = format!(
        "pickers: [\"http://{nobody}\"]\ninsecure_ingest: true\nmetrics_addr: 127.0.0.1:0\n\
         engines:\n  - pod: engine-0\n    endpoint: {http}\n    model: {MODEL}\n    gpus: [0]\n\
         \x20   annotations: {{\"kvroute.io/cost-per-hour\": \"3.67\", zone: b}}\n"
    );
    let config: AgentConfig = serde_norway::from_str(&yaml).expect("config");
    let path = format!("{}/scenarios/healthy.yaml", env!("CARGO_MANIFEST_DIR"));
    let agent = app::start(config, Arc::new(MockGpuSource::from_file(&path).expect("scenario"))).await.expect("starts");
    let pod = agent.hub.pod("engine-0-rank-0").expect("pod");
    // Hello and every snapshot carry this PodInfo.
    let info = pod.snapshot().info.expect("info");
    assert_eq!(info.annotations.get("kvroute.io/cost-per-hour").map(String::as_str), Some("3.67"));
    assert_eq!(info.annotations.get("zone").map(String::as_str), Some("b"));
    assert_eq!(info.annotations.len(), 2);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_frozen_by_a_broken_metrics_page_age_into_a_penalty_and_recover() {
    let faults = no_faults();
    let agent = agent_with("healthy.yaml", faults.clone()).await;
    let healthy = |s: f64, r: &str| s == 1.0 || r == "host memory pressure";
    wait_health(&agent, "healthy first", healthy).await;
    faults.metrics_broken.store(true, Ordering::Relaxed);
    // Past 1 s (5 × 50 ms scrapes, at least 1 s) the last good figures are stale: minor first,
    // growing; the figures themselves stay the last good page's (7 running, 3 waiting).
    let (score, reason) = wait_health(&agent, "stale", |_, r| r == "engine stats stale").await;
    assert!((0.7..1.0).contains(&score), "{score} {reason}");
    let stats = agent.hub.pod("engine-0-rank-0").expect("pod").snapshot().stats.expect("stats");
    assert_eq!((stats.num_requests_running, stats.num_requests_waiting), (7, 3));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (later, _) = wait_health(&agent, "still stale", |_, r| r == "engine stats stale").await;
    assert!(later < score, "the penalty grows with the age: {later} after {score}");
    faults.metrics_broken.store(false, Ordering::Relaxed);
    wait_health(&agent, "fresh again", healthy).await;
    agent.shutdown().await;
}
