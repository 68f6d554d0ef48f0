//! End-to-end observability: real engines, agents, picker and Envoy; the picker's `/metrics` is
//! scraped while traffic runs and must move as the traffic dictates: decisions counted per model,
//! queue gauges rising under a burst and draining after it, a stale-routing count after an
//! injected eviction race (an engine drops its cache and the KV event announcing it is lost, so
//! the next turn is routed on cache the engine no longer holds).
//!
//! Needs the workspace binaries (`cargo build --bins`) and Envoy (`scripts/install-envoy`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_harness::fleet::metric_value;
use kvroute_harness::{ChatOutcome, Fleet, FleetSpec, GatewayClient, Workload};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

use kvroute_harness::DEFAULT_MODEL as MODEL;
/// Time for a KV event to travel engine → agent → picker (docs/design.md §10 target p99 ≤ 50 ms).
const PROPAGATION: Duration = Duration::from_millis(400);

async fn chat(client: &GatewayClient, messages: &[Value], max_tokens: u32) -> ChatOutcome {
    client.chat_served(MODEL, messages, max_tokens).await.expect("request served through Envoy")
}

/// An unlabelled sample (`name value`).
fn plain(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Every `epp_queue_depth{model_server_pod=…}` sample.
fn queue_depths(text: &str) -> Vec<f64> {
    text.lines().filter_map(|l| l.strip_prefix("epp_queue_depth{")?.rsplit_once(' ')?.1.trim().parse().ok()).collect()
}

fn decisions(text: &str) -> f64 {
    metric_value(text, "epp_routing_decisions_total", &format!("model=\"{MODEL}\"")).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_metrics_follow_the_traffic() {
    // One sequence per engine: a burst queues in the engines, so the queue gauges must move.
    let spec = FleetSpec { label: "obs-metrics".into(), time_scale: 0.2, max_num_seqs: 1, ..Default::default() };
    let fleet = Fleet::start(spec).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    let m = fleet.picker_metrics().await.expect("scrape");
    assert_eq!(decisions(&m), 0.0, "{m}");
    assert_eq!(plain(&m, "epp_stale_cache_routing_total"), Some(0.0), "{m}");
    assert_eq!(queue_depths(&m), vec![0.0; 4], "idle fleet: {m}");
    // The pool's state reads from the first scrape on an idle fleet (epp_candidate_pods is the
    // last decision's and reads 0 here), under kvroute's names and GIE's.
    assert_eq!(plain(&m, "epp_pool_ready_pods"), Some(4.0), "{m}");
    assert_eq!(plain(&m, "epp_pool_routable_pods"), Some(4.0), "{m}");
    assert_eq!(metric_value(&m, "inference_pool_ready_pods", "name=\"kvroute\""), Some(4.0), "{m}");
    assert_eq!(metric_value(&m, "inference_pool_average_queue_size", "name=\"kvroute\""), Some(0.0), "{m}");
    assert_eq!(m.matches("inference_pool_per_pod_queue_size{").count(), 4, "{m}");
    // Error counters exist at 0 before any error.
    assert_eq!(metric_value(&m, "epp_request_errors_total", "code=\"503\""), Some(0.0), "{m}");

    // Sequential turns: one decision each, counted under the model.
    let w = Workload::multi_turn_chat(23, 4, 1, 2, 300, 20);
    let mut first = Vec::new();
    for c in &w.conversations {
        first.push(chat(&client, &w.messages(c, 0, &[]), 4).await);
    }
    let m = fleet.picker_metrics().await.expect("scrape");
    assert_eq!(decisions(&m), 4.0, "{m}");
    assert_eq!(plain(&m, "epp_candidate_pods"), Some(4.0), "{m}");
    assert!(plain(&m, "epp_prefix_tree_nodes").unwrap_or(0.0) > 0.0, "{m}");
    assert!(m.contains("epp_cache_match_ratio_count 4"), "{m}");

    // A burst of 12 long, distinct requests on 4 single-sequence engines: requests wait in the
    // engines and the picker's queue gauges rise; once the burst is over they drain to 0.
    let burst = Workload::multi_turn_chat(99, 12, 1, 1, 60, 10);
    let mut tasks = Vec::new();
    for c in &burst.conversations {
        let (client, messages) = (client.clone(), burst.messages(c, 0, &[]));
        tasks.push(tokio::spawn(async move { client.chat(MODEL, &messages, 150).await }));
    }
    let mut peak = 0.0f64;
    let deadline = Instant::now() + Duration::from_secs(20);
    while peak < 1.0 && Instant::now() < deadline && tasks.iter().any(|t| !t.is_finished()) {
        let m = fleet.picker_metrics().await.expect("scrape");
        peak = peak.max(queue_depths(&m).into_iter().fold(0.0, f64::max));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for t in tasks {
        let out = t.await.expect("task").expect("request");
        assert_eq!(out.status, 200, "{:?}", out.error);
    }
    assert!(peak >= 1.0, "no queue gauge rose during the burst");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = fleet.picker_metrics().await.expect("scrape");
        let depths = queue_depths(&m);
        if depths.iter().all(|d| *d == 0.0) {
            assert_eq!(decisions(&m), 16.0, "{m}");
            break;
        }
        assert!(Instant::now() < deadline, "queue gauges did not drain: {depths:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Eviction race: the engine that served conversation 0 drops its prefix cache and the KV
    // event saying so is lost; turn 2 is still routed there on the stale index and the engine
    // reports (almost) nothing cached: one stale routing.
    tokio::time::sleep(PROPAGATION).await;
    let c = &w.conversations[0];
    let pod = first[0].served_by.clone().expect("x-served-by");
    let i = fleet.engines.iter().position(|e| e.name() == pod).expect("serving engine");
    fleet.inject_fault(i, json!({"drop_kv_events": 1})).await.expect("fault");
    let http = reqwest::Client::new();
    let url = format!("{}/reset_prefix_cache", fleet.engines[i].url());
    http.post(url).send().await.expect("reset").error_for_status().expect("reset ok");
    let before = fleet.picker_metrics().await.expect("scrape");
    let out = chat(&client, &w.messages(c, 1, &[first[0].text.clone()]), 4).await;
    assert_eq!(out.served_by.as_deref(), Some(pod.as_str()), "turn 2 should follow the stale index");
    assert!(out.cached_tokens * 4 < out.prompt_tokens, "engine still had the prefix: {out:?}");
    let m = fleet.picker_metrics().await.expect("scrape");
    assert_eq!(plain(&before, "epp_stale_cache_routing_total"), Some(0.0), "{before}");
    assert_eq!(plain(&m, "epp_stale_cache_routing_total"), Some(1.0), "{m}\n{}", fleet.picker_log_tail(20));
    assert_eq!(decisions(&m), 17.0, "{m}");
    fleet.shutdown().await;
}
