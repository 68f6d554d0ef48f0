//! The node agent against real processes (docs/design.md §7): emulated vLLM engines (`kvroute-emulator`,
//! faults through `POST /emulator/faults`), the agent binary in mock-NVML mode and the picker,
//! all over real sockets. Requests go straight to the engines (no routing involved); what the
//! picker believes is read back from its `/explain` (matched blocks per pod) and `/metrics`.
//!
//! Needs the workspace binaries (`cargo build --bins`) and Envoy (`scripts/install-envoy`), as
//! every fleet does. One fleet at a time (2-core machines).

#![allow(clippy::unwrap_used, clippy::expect_used)]
use kvroute_harness::fleet::metric_value;
use kvroute_harness::{Fleet, FleetSpec};
use serde_json::{Value, json};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

static ONE_FLEET_AT_A_TIME: LazyLock<tokio::sync::Mutex<()>> = LazyLock::new(|| tokio::sync::Mutex::new(()));

use kvroute_harness::DEFAULT_MODEL as MODEL;

fn spec(label: &str, engines: usize) -> FleetSpec {
    FleetSpec { label: label.into(), engines, engines_per_agent: engines, time_scale: 0.1, ..Default::default() }
}

/// A chat body whose prompt spans several blocks and is unique to `tag`.
fn body(tag: &str) -> Value {
    let words: Vec<String> = (0..120).map(|i| format!("{tag}{i}")).collect();
    json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": format!("You are assistant {tag}. {}", words.join(" "))},
        {"role": "user", "content": format!("Tell me about {tag}.")},
    ]})
}

/// Sends `body` straight to engine `i` (bypassing the gateway) and checks it succeeded.
async fn send_to_engine(fleet: &Fleet, i: usize, body: &Value) {
    let url = format!("{}/v1/chat/completions", fleet.engines[i].url());
    let r = reqwest::Client::new().post(url).json(body).send().await.expect("engine answers");
    assert!(r.status().is_success(), "engine {i}: {}", r.status());
}

/// Blocks of `body` the picker believes `pod` holds, and the prompt's total blocks.
async fn matched(fleet: &Fleet, body: &Value, pod: &str) -> (u64, u64) {
    let ex = fleet.explain_chat(body).await.expect("explain");
    let total = ex["total_blocks"].as_u64().expect("total_blocks");
    let m = ex["candidates"]
        .as_array()
        .expect("candidates")
        .iter()
        .find(|c| c["pod"] == pod)
        .and_then(|c| c["matched_blocks"].as_u64())
        .unwrap_or(0);
    (m, total)
}

/// Polls until `pred(matched, total)` holds for `pod`; returns the last pair.
async fn wait_matched(
    fleet: &Fleet,
    body: &Value,
    pod: &str,
    what: &str,
    pred: impl Fn(u64, u64) -> bool,
) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (m, t) = matched(fleet, body, pod).await;
        if pred(m, t) {
            return (m, t);
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {pod} matched {m} of {t} blocks\nagent log:\n{}\npicker log:\n{}",
            fleet.agent_log_tail(0, 30),
            fleet.picker_log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn agent_counter(fleet: &Fleet, name: &str, pod: &str) -> f64 {
    let text = fleet.agent_metrics(0).await.expect("agent metrics");
    metric_value(&text, name, &format!("model_server_pod=\"{pod}\"")).unwrap_or(0.0)
}

/// The whole prompt (all full blocks but possibly the last) is indexed on `pod`.
fn fully(m: u64, t: u64) -> bool {
    t > 2 && m + 1 >= t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_kv_events_are_recovered_by_replay() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let fleet = Fleet::start(spec("agent-replay", 1)).await.expect("fleet starts");
    let (a, b) = (body("alpha"), body("bravo"));
    // Warm the subscriber: one batch seen, so the next loss is a gap after a known seq.
    send_to_engine(&fleet, 0, &body("warmup")).await;
    wait_matched(&fleet, &body("warmup"), "engine-0-rank-0", "warm-up indexed", fully).await;

    fleet.inject_fault(0, json!({"drop_kv_events": 1})).await.expect("fault");
    send_to_engine(&fleet, 0, &a).await; // its BlockStored batch is never published
    tokio::time::sleep(Duration::from_millis(300)).await;
    send_to_engine(&fleet, 0, &b).await; // the next batch reveals the gap → replay
    let (m, t) = wait_matched(&fleet, &a, "engine-0-rank-0", "alpha recovered by replay", fully).await;
    assert!(m > 0 && t > 0);
    wait_matched(&fleet, &b, "engine-0-rank-0", "bravo indexed", fully).await;
    assert!(agent_counter(&fleet, "kvroute_agent_kv_event_batches_replayed_total", "engine-0-rank-0").await >= 1.0);
    assert_eq!(
        agent_counter(&fleet, "kvroute_agent_kv_resyncs_total", "engine-0-rank-0").await,
        0.0,
        "a replayable gap must not clear the pod"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_restart_is_followed_by_a_resync_restoring_the_same_index() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let mut fleet = Fleet::start(spec("agent-picker-restart", 2)).await.expect("fleet starts");
    let bodies = [body("charlie"), body("delta"), body("echo")];
    for (i, b) in bodies.iter().enumerate() {
        send_to_engine(&fleet, i % 2, b).await;
    }
    let mut before = Vec::new();
    for (i, b) in bodies.iter().enumerate() {
        let pod = format!("engine-{}-rank-0", i % 2);
        wait_matched(&fleet, b, &pod, "indexed before restart", fully).await;
        before.push((matched(&fleet, b, "engine-0-rank-0").await, matched(&fleet, b, "engine-1-rank-0").await));
    }
    let entries = |t: &str| {
        metric_value(t, "epp_prefix_index_entries", "").or_else(|| gauge_plain(t, "epp_prefix_index_entries"))
    };
    let entries_before = entries(&fleet.picker_metrics().await.expect("metrics"));
    assert!(entries_before.is_some_and(|e| e > 0.0), "index entries exported: {entries_before:?}");

    fleet.restart_picker().await.expect("picker restarts");
    let pods = vec!["engine-0-rank-0".to_string(), "engine-1-rank-0".to_string()];
    fleet.wait_for_pods(&pods, Duration::from_secs(30)).await.expect("agent reconnects");
    for (i, b) in bodies.iter().enumerate() {
        let pod = format!("engine-{}-rank-0", i % 2);
        wait_matched(&fleet, b, &pod, "indexed after restart", fully).await;
        let after = (matched(&fleet, b, "engine-0-rank-0").await, matched(&fleet, b, "engine-1-rank-0").await);
        assert_eq!(after, before[i], "prompt {i}: per-pod matches differ after the resync");
    }
    let entries_after = entries(&fleet.picker_metrics().await.expect("metrics"));
    assert_eq!(entries_after, entries_before, "index size differs after the resync");
    fleet.shutdown().await;
}

/// An unlabelled gauge sample `name value`.
fn gauge_plain(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_with_sequence_reset_resyncs_the_pod() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let mut fleet = Fleet::start(spec("agent-engine-restart", 1)).await.expect("fleet starts");
    let (old, new) = (body("foxtrot"), body("golf"));
    // A few batches, so the restarted engine's sequence clearly goes back.
    for tag in ["hotel", "india", "juliet"] {
        send_to_engine(&fleet, 0, &body(tag)).await;
    }
    send_to_engine(&fleet, 0, &old).await;
    wait_matched(&fleet, &old, "engine-0-rank-0", "indexed before the engine restart", fully).await;

    fleet.restart_engine(0).await.expect("engine restarts");
    // libzmq reconnects 0.2–0.3 s after a publisher restart; events before that are unseen.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    send_to_engine(&fleet, 0, &new).await;
    wait_matched(&fleet, &new, "engine-0-rank-0", "new engine's blocks indexed", fully).await;
    let (m, _) = wait_matched(&fleet, &old, "engine-0-rank-0", "old blocks forgotten", |m, _| m == 0).await;
    assert_eq!(m, 0, "blocks of the dead engine must not be claimed");
    assert!(agent_counter(&fleet, "kvroute_agent_kv_resyncs_total", "engine-0-rank-0").await >= 1.0);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_engine_with_healthy_endpoint_falls_below_exclusion() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let fleet = Fleet::start(spec("agent-stuck", 2)).await.expect("fleet starts");
    fleet
        .wait_pod_gauge("epp_pod_health_score", "engine-1-rank-0", Duration::from_secs(15), |h| h >= 0.9)
        .await
        .expect("engine-1 healthy first");
    fleet.inject_fault(1, json!({"stuck": true})).await.expect("fault");
    let health = reqwest::get(format!("{}/health", fleet.engines[1].url())).await.expect("health");
    assert_eq!(health.status().as_u16(), 200, "a stuck engine still answers /health");
    // Probe every 5 s with a 2 s deadline (docs/design.md §7 defaults).
    let h = fleet
        .wait_pod_gauge("epp_pod_health_score", "engine-1-rank-0", Duration::from_secs(20), |h| h < 0.3)
        .await
        .expect("stuck engine excluded");
    assert!(h > 0.0, "stuck is 'probe failing' (excluded), not 'failed' (0.0): {h}");
    let other = fleet.pod_gauge("epp_pod_health_score", "engine-0-rank-0").await.expect("metrics").unwrap_or(0.0);
    assert!(other >= 0.9, "engine-0 unaffected: {other}");
    fleet.inject_fault(1, json!({"stuck": false})).await.expect("fault cleared");
    fleet
        .wait_pod_gauge("epp_pod_health_score", "engine-1-rank-0", Duration::from_secs(20), |h| h >= 0.9)
        .await
        .expect("recovers once unstuck");
    fleet.shutdown().await;
}

/// The restarted engine's sequence need not visibly go back: the old engine sent one batch and
/// the new one publishes several at once, some before the SUB reconnected. The agent treats the
/// reconnect itself as a possible restart (clear, then rebuild from the engine's replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_seen_only_as_a_reconnect_still_resyncs() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let mut fleet = Fleet::start(spec("agent-engine-reconnect", 1)).await.expect("fleet starts");
    let old = body("kilo");
    send_to_engine(&fleet, 0, &old).await;
    wait_matched(&fleet, &old, "engine-0-rank-0", "indexed before the engine restart", fully).await;

    fleet.restart_engine(0).await.expect("engine restarts");
    let new: Vec<Value> = ["lima", "mike", "november"].iter().map(|t| body(t)).collect();
    for b in &new {
        send_to_engine(&fleet, 0, b).await;
    }
    for b in &new {
        wait_matched(&fleet, b, "engine-0-rank-0", "new engine's blocks indexed (live or replayed)", fully).await;
    }
    wait_matched(&fleet, &old, "engine-0-rank-0", "old blocks forgotten", |m, _| m == 0).await;
    assert!(agent_counter(&fleet, "kvroute_agent_kv_resyncs_total", "engine-0-rank-0").await >= 1.0);
    fleet.shutdown().await;
}
