//! Chaos suite (docs/operations.md "Faults and recovery"): a live fleet (4 emulated engines, 2
//! agents, 2 picker replicas, Envoy with `deploy/envoy/envoy.yaml`) under steady load through
//! Envoy, while the test kills, stops and restarts its parts. What a client sees is recorded per
//! request (send time, status, served by, whether Envoy could not connect to the chosen engine) and
//! asserted per phase:
//!
//! 1. SIGSTOP an agent (its engines alive): no 5xx; its pods' health falls to the stale-report
//!    cap once `limits.max_report_age_ms` passes.
//! 2. With that agent still stopped, kill -9 one of its engines: the first failed connect, on
//!    either replica, marks the pod on both (the replicas share unreachable marks); no request
//!    sent 250 ms after that failure's answer reaches the dead engine; after its restart the pod
//!    returns (unreachable mark cleared).
//! 3. kill -9 an engine whose agent runs, restart it: no request reaches the dead engine 1 s
//!    after its death.
//! 4. kill -9 an agent and restart it: no 5xx (its pods ride the grace period).
//! 5. Rolling restart of the 2 picker replicas (SIGTERM, drain, restart, one at a time): no 5xx.
//! 6. kill -9 one picker replica, restart it 2 s later: the 5xx it costs stop within Envoy's
//!    health-check interval + timeout (1.5 s); the restart costs none.
//!
//! Bounded: about 60 s of wall time on 2 cores. Figures are printed (`--nocapture`) and recorded
//! in docs/operations.md.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use kvroute_harness::fleet::metric_value;
use kvroute_harness::{DEFAULT_MODEL as MODEL, Fleet, FleetSpec, GatewayClient};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One request as the client saw it.
#[derive(Clone, Debug)]
struct Rec {
    sent: Instant,
    /// When the answer (or the error) was in.
    done: Instant,
    status: u16,
    /// Envoy's 503 "upstream connect error": the request was routed to an engine that was down.
    connect_error: bool,
}

/// Closed-loop load: `workers` clients, each sending the next request when the last one ended
/// (plus a short pause), over a few shared system prompts (cache-hot pods exist).
struct Load {
    records: Arc<std::sync::Mutex<Vec<Rec>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(gateway: &str, workers: usize) -> Load {
        let records = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..workers)
            .map(|w| {
                let (records, stop) = (records.clone(), stop.clone());
                let client = GatewayClient::new(gateway).unwrap();
                tokio::spawn(async move {
                    let mut i = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let sent = Instant::now();
                        let rec = match client.chat(MODEL, &messages(w, i), 2).await {
                            Ok(out) => Rec {
                                sent,
                                done: Instant::now(),
                                status: out.status,
                                connect_error: out.error.as_ref().is_some_and(|e| {
                                    e.to_string().contains("upstream connect error or disconnect/reset before headers")
                                }),
                            },
                            Err(_) => Rec { sent, done: Instant::now(), status: 599, connect_error: false },
                        };
                        records.lock().unwrap().push(rec);
                        tokio::time::sleep(Duration::from_millis(25)).await;
                    }
                })
            })
            .collect();
        Load { records, stop, tasks }
    }

    /// Records of requests sent in `[from, to)`.
    fn window(&self, from: Instant, to: Instant) -> Vec<Rec> {
        self.records.lock().unwrap().iter().filter(|r| r.sent >= from && r.sent < to).cloned().collect()
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Worker `w`'s `i`-th chat: one of four shared system prompts (several blocks), a fresh question.
fn messages(w: usize, i: usize) -> Vec<Value> {
    let topic = (w + i) % 4;
    let words: Vec<String> = (0..80).map(|k| format!("t{topic}w{k}")).collect();
    vec![
        json!({"role": "system", "content": format!("You are assistant {topic}. {}", words.join(" "))}),
        json!({"role": "user", "content": format!("Question {w}-{i}?")}),
    ]
}

/// What one phase cost the clients.
#[derive(Debug, Default)]
struct Phase {
    requests: usize,
    server_errors: usize,
    /// Requests routed to a dead engine (Envoy's connect error), all of them / sent ≥ 1 s after
    /// the death.
    to_dead: usize,
    to_dead_after_1s: usize,
    /// Requests to the dead engine sent ≥ 250 ms after the first one's answer came back.
    to_dead_after_first: usize,
}

fn phase(recs: &[Rec], death: Option<Instant>) -> Phase {
    let late = |r: &Rec| death.is_some_and(|d| r.sent >= d + Duration::from_secs(1));
    Phase {
        requests: recs.len(),
        server_errors: recs.iter().filter(|r| r.status >= 500).count(),
        to_dead: recs.iter().filter(|r| r.connect_error).count(),
        to_dead_after_1s: recs.iter().filter(|r| r.connect_error && late(r)).count(),
        to_dead_after_first: recs.iter().filter(|r| r.connect_error).map(|r| r.done).min().map_or(0, |first| {
            recs.iter().filter(|r| r.connect_error && r.sent >= first + Duration::from_millis(250)).count()
        }),
    }
}

/// A per-pod gauge of picker replica `r`.
async fn pod_gauge(fleet: &Fleet, r: usize, name: &str, pod: &str) -> Option<f64> {
    let text = reqwest::get(format!("{}/metrics", fleet.picker_admins[r])).await.ok()?.text().await.ok()?;
    metric_value(&text, name, &format!("model_server_pod=\"{pod}\""))
}

/// Polls every picker replica until `pred` holds for its gauge `name{pod}`; returns the time it took.
async fn wait_all(fleet: &Fleet, name: &str, pod: &str, timeout: Duration, pred: impl Fn(f64) -> bool) -> Duration {
    let start = Instant::now();
    for r in 0..fleet.picker_admins.len() {
        loop {
            if pod_gauge(fleet, r, name, pod).await.is_some_and(&pred) {
                break;
            }
            assert!(
                start.elapsed() < timeout,
                "{name}{{{pod}}} on picker {r} = {:?} after {timeout:?}; picker log:\n{}",
                pod_gauge(fleet, r, name, pod).await,
                fleet.picker_log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    start.elapsed()
}

/// Waits until picker replica `r` answers `/readyz` with 200 and Envoy's health check (0.5 s
/// interval) had time to see it.
async fn wait_picker_ready(fleet: &Fleet, r: usize) -> Duration {
    let start = Instant::now();
    let url = format!("{}/readyz", fleet.picker_admins[r]);
    while !reqwest::get(&url).await.is_ok_and(|x| x.status().is_success()) {
        assert!(start.elapsed() < Duration::from_secs(20), "picker {r} not ready:\n{}", fleet.picker_log_tail(20));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ready = start.elapsed();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    ready
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_under_load_through_envoy() {
    let spec = FleetSpec {
        label: "chaos".into(),
        engines: 4,
        engines_per_agent: 2,
        time_scale: 0.1,
        report_interval_ms: 300,
        picker_replicas: 2,
        // Approximate mode: no tokenizer to load, so a picker (re)starts in milliseconds, not the
        // ~15 s a debug build takes to load Qwen2.5's; routing, faults and recovery are the same.
        picker_approximate: true,
        // The shipped `shutdown_drain_ms` (2 s): a shorter drain leaves too little time for
        // Envoy's health check (every 0.5 s) to move new streams off a stopping replica.
        picker_overrides: Some(json!({
            "limits": {"max_report_age_ms": 1500, "unreachable_probe_ms": 200},
        })),
        ..Default::default()
    };
    let mut fleet = Fleet::start(spec).await.expect("fleet");
    for r in 0..2 {
        wait_picker_ready(&fleet, r).await;
    }
    // The replicas follow each other over ReplicaSync, as deploy/ runs them.
    for r in 0..2 {
        let start = Instant::now();
        loop {
            let url = format!("{}/metrics", fleet.picker_admins[r]);
            let text = reqwest::get(url).await.unwrap().text().await.unwrap();
            if text.lines().any(|l| l == "epp_replica_peers 1") {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "picker {r} does not follow its peer");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let pod = |i: usize| fleet_pod(i);
    let load = Load::start(&fleet.gateway, 3);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut report = Vec::new();

    // 1. A silent agent, engines alive.
    let t = Instant::now();
    fleet.signal_agent(0, "STOP").unwrap();
    let stale_after = wait_all(&fleet, "epp_pod_health_score", &pod(0), Duration::from_secs(5), |h| h <= 0.5).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let p = phase(&load.window(t, Instant::now()), None);
    report.push(format!("1 agent SIGSTOP: {p:?}; health capped after {stale_after:?}"));
    assert_eq!((p.server_errors, p.to_dead), (0, 0), "a silent agent costs no request: {p:?}");

    // 2. Its engine dies while it is silent.
    let death = Instant::now();
    fleet.kill_engine(0).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = phase(&load.window(death, Instant::now()), Some(death));
    let marked = [
        pod_gauge(&fleet, 0, "epp_pod_unreachable", &pod(0)).await,
        pod_gauge(&fleet, 1, "epp_pod_unreachable", &pod(0)).await,
    ];
    fleet.restart_engine(0).await.unwrap();
    let back = Instant::now();
    let returned = wait_all(&fleet, "epp_pod_unreachable", &pod(0), Duration::from_secs(5), |v| v == 0.0).await;
    fleet.signal_agent(0, "CONT").unwrap();
    let fresh = wait_all(&fleet, "epp_pod_health_score", &pod(0), Duration::from_secs(10), |h| h > 0.5).await;
    report.push(format!(
        "2 engine kill -9, agent SIGSTOPped: {p:?}; pod back {returned:?} after restart, fresh stats {:?} after SIGCONT",
        fresh
    ));
    // Nothing tells the pickers of the death until Envoy fails to connect (the agent is stopped),
    // and the pod's stale stats make it a rare pick, so the first failure can come late. That
    // failure marks the pod on the replica that routed it, and over the replica stream on the
    // other: only requests already on their way (3 clients) can follow it to the dead engine.
    assert_eq!(p.to_dead_after_first, 0, "the first failed connect marks the pod on both replicas: {p:?}");
    assert!(p.to_dead <= 3, "at most the 3 clients' requests in flight reach the dead engine: {p:?}");
    if p.to_dead > 0 {
        assert_eq!(marked, [Some(1.0), Some(1.0)], "one replica's failed connect marks the pod on both: {p:?}");
    }
    let _ = back;

    // 3. An engine dies with its agent running.
    let death = Instant::now();
    fleet.kill_engine(2).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let p = phase(&load.window(death, Instant::now()), Some(death));
    fleet.restart_engine(2).await.unwrap();
    let returned = wait_all(&fleet, "epp_pod_unreachable", &pod(2), Duration::from_secs(5), |v| v == 0.0).await;
    let ready = wait_all(&fleet, "epp_pod_health_score", &pod(2), Duration::from_secs(10), |h| h > 0.5).await;
    report.push(format!("3 engine kill -9: {p:?}; unreachable cleared {returned:?}, healthy {ready:?} after restart"));
    assert_eq!(p.to_dead_after_1s, 0, "no request reaches the dead engine 1 s after its death: {p:?}");

    // 4. An agent dies and comes back.
    let t = Instant::now();
    fleet.restart_agent(1).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let p = phase(&load.window(t, Instant::now()), None);
    report.push(format!("4 agent kill -9 + restart: {p:?}"));
    assert_eq!(p.server_errors, 0, "an agent restart costs no request: {p:?}");

    // 5. Rolling restart of the two picker replicas.
    let t = Instant::now();
    let mut ready_after = Vec::new();
    for r in 0..2 {
        fleet.stop_picker(r, true).await.unwrap();
        fleet.start_picker(r).await.unwrap();
        ready_after.push(wait_picker_ready(&fleet, r).await);
    }
    let p = phase(&load.window(t, Instant::now()), None);
    report.push(format!("5 picker rolling restart (2 replicas): {p:?}; each ready after {ready_after:?}"));
    assert_eq!(p.server_errors, 0, "a rolling restart of 2 replicas costs no request: {p:?}");

    // 6. One picker replica killed, left dead for 2 s, restarted. Envoy's health check of the
    // ext_proc cluster (every 0.5 s, timeout 1 s, one failure ejects) bounds how long new streams
    // still reach the dead replica: 5xx must stop within interval + timeout; the restart itself
    // must cost nothing (the replica is SERVING only once it can route).
    let t = Instant::now();
    fleet.stop_picker(0, false).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let restart = Instant::now();
    fleet.start_picker(0).await.unwrap();
    let ready = wait_picker_ready(&fleet, 0).await;
    let end = Instant::now();
    let recs = load.window(t, end);
    let p = phase(&recs, None);
    let errors = || recs.iter().filter(|r| r.status >= 500);
    let last_error = errors().filter(|r| r.sent < restart).map(|r| r.sent - t).max();
    let after_restart = errors().filter(|r| r.sent >= restart).count();
    report.push(format!(
        "6 picker kill -9 (1 of 2) + restart: {p:?}; last 5xx sent {last_error:?} after the kill; \
         {after_restart} after the restart; ready {ready:?}"
    ));
    assert!(
        last_error.is_none_or(|d| d < Duration::from_millis(1500)),
        "5xx from a killed replica stop within Envoy's health-check interval + timeout: {last_error:?}"
    );
    assert_eq!(after_restart, 0, "restarting the killed replica costs no request: {p:?}");

    // Everything is back: the whole fleet serves.
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let p = phase(&load.window(t, Instant::now()), None);
    load.stop().await;
    report.push(format!("7 after: {p:?}"));
    eprintln!("chaos figures:\n{}", report.join("\n"));
    assert_eq!(p.server_errors, 0, "after the faults: {p:?}");
    assert!(p.requests > 10, "load kept flowing: {p:?}");
    fleet.shutdown().await;
}

fn fleet_pod(i: usize) -> String {
    format!("engine-{i}-rank-0")
}

/// Index entries of picker replica `r` (`epp_prefix_index_entries`), if it answers.
async fn index_entries(fleet: &Fleet, r: usize) -> Option<f64> {
    let text = reqwest::get(format!("{}/metrics", fleet.picker_admins[r])).await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix("epp_prefix_index_entries ")).and_then(|v| v.trim().parse().ok())
}

/// kill -9 of either picker replica under load, through both shipped Envoy configs at once
/// (docs/decisions/0020-fail-open-and-picker-restarts.md): `deploy/envoy/envoy.yaml` (fail closed)
/// and `deploy/envoy/envoy-fail-open.yaml`, each with the 2 replicas as its ext_proc cluster and 3
/// clients. Fail-open: no 5xx. Fail-closed: the requests in flight at the kill fail, and of those
/// sent after it at most the first stream each of Envoy's 2 workers opens to the dead replica
/// (its refused connection ejects the replica: outlier detection; Envoy does not retry an ext_proc
/// stream). The restarted replica holds as many index entries as its peer within 1 s of its
/// start (its agents redial every 400 ms at most and replay their pods) and is SERVING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_kills_under_load_fail_open_and_fail_closed() {
    let spec = FleetSpec {
        label: "chaos-pickers".into(),
        engines: 4,
        engines_per_agent: 2,
        time_scale: 0.1,
        report_interval_ms: 300,
        picker_replicas: 2,
        picker_approximate: true,
        extra_gateway_configs: vec!["deploy/envoy/envoy-fail-open.yaml".into()],
        ..Default::default()
    };
    let mut fleet = Fleet::start(spec).await.expect("fleet");
    for r in 0..2 {
        wait_picker_ready(&fleet, r).await;
    }
    let closed = Load::start(&fleet.gateway, 3);
    let open = Load::start(&fleet.extra_gateways[0], 3);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut report = Vec::new();
    for r in [0, 1] {
        let t = Instant::now();
        fleet.stop_picker(r, false).await.unwrap();
        let killed = Instant::now();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let peer = index_entries(&fleet, 1 - r).await.unwrap_or(0.0);
        fleet.start_picker(r).await.unwrap();
        let started = Instant::now();
        let full = loop {
            let mine = index_entries(&fleet, r).await.unwrap_or(0.0);
            let peer_now = index_entries(&fleet, 1 - r).await.unwrap_or(peer);
            if mine > 0.0 && mine >= 0.95 * peer_now {
                break started.elapsed();
            }
            assert!(started.elapsed() < Duration::from_secs(10), "replica {r} index {mine}, peer {peer_now}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let ready = wait_picker_ready(&fleet, r).await;
        let end = Instant::now();
        let (c, o) = (closed.window(t, end), open.window(t, end));
        let failed = |recs: &[Rec]| recs.iter().filter(|x| x.status >= 500).cloned().collect::<Vec<_>>();
        let (c_failed, o_failed) = (failed(&c), failed(&o));
        let in_flight = closed.window(t - Duration::from_secs(30), killed).iter().filter(|x| x.done >= t).count();
        let c_after = c_failed.iter().filter(|x| x.sent >= killed).count();
        report.push(format!(
            "picker {r} kill -9 + restart after 2 s: fail-closed {} of {} requests 5xx ({c_after} sent after the kill, \
             {in_flight} in flight at it); fail-open {} of {} 5xx; restarted replica's index full after {full:?} \
             (peer {peer} entries), ready after {ready:?}",
            c_failed.len(),
            c.len(),
            o_failed.len(),
            o.len()
        ));
        assert_eq!(o_failed.len(), 0, "fail-open: a picker kill is invisible to clients: {}", report.join("\n"));
        assert!(
            c_after <= 2,
            "fail-closed: one refused stream per Envoy worker ejects the replica: {}",
            report.join("\n")
        );
        assert!(full < Duration::from_secs(1), "the restarted replica's index: {}", report.join("\n"));
        // Past the killed replica's outlier ejection (2 s) before the next kill.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    closed.stop().await;
    open.stop().await;
    eprintln!("picker kills:\n{}", report.join("\n"));
    fleet.shutdown().await;
}
