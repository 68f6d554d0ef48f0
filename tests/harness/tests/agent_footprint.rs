//! Footprint benchmark of the node agent (docs/design.md §10: ≤ 30 MB RSS, ≤ 2 % of a core; event → picker
//! p99 ≤ 50 ms): one agent watching 8 emulated engines under load for a minute
//! (`AGENT_FOOTPRINT_SECS`, default 60). Ignored by default (it is a measurement, not a check):
//! run it with `scripts/agent-footprint`.
//!
//! Two load profiles (`AGENT_FOOTPRINT_PROFILE`):
//! - `node` (default): engines as fast as the seed's 8B model on an A100 (prefill 220 µs per
//!   uncached token, decode 20 ms per token, time scale 1) with vLLM's default of one prefill at a
//!   time, kept busy by 4 closed-loop clients per engine: the KV-event volume a saturated node of
//!   8 such GPUs produces (a few thousand block events/s).
//! - `stress`: the same engines 20× faster (time scale 0.05) with every admitted request
//!   prefilling at once, 8 closed-loop clients: ~25 000–30 000 block events/s, beyond what 8 real
//!   GPUs can prefill; it shows how the agent's CPU grows with event volume.
//!
//! `AGENT_FOOTPRINT_CLIENTS` overrides the client count, `AGENT_FOOTPRINT_TIME_SCALE` the engines'
//! speed (e.g. 0.33 for GPUs three times an A100's prefill speed). The benchmark prints the block events/s
//! of the load phase and the CPU points per 1 000 block events/s above idle, so a node's share can
//! be read off for its own event rate.
//!
//! Baseline, in the same run: the same agent watching the same 8 engines idle for
//! `AGENT_FOOTPRINT_IDLE_SECS` (default 15) first, so only scrapes (every 200 ms), probes (every
//! 5 s) and reports run; the load phase is reported against it as a ratio.
//!
//! - RSS: `VmRSS` of the agent process from `/proc/<pid>/status`, sampled every second.
//! - CPU: `utime + stime` of the agent from `/proc/<pid>/stat` over the run / wall time, as a
//!   share of one core. The same numbers for the picker's host share are not taken (not its job).
//! - Event → picker: a prober sends a fresh prompt to an engine (streamed); t0 = first token (the
//!   emulator publishes `BlockStored` when prefill ends, just before it); t1 = first time the
//!   picker's `/explain` shows the prompt's blocks on that pod (polled every 2 ms). The latency is
//!   t1 − t0: agent decode + coalescing (`block_flush_ms` 10) + gRPC + picker apply, measured from
//!   outside; it slightly under-counts the engine → first-token gap, and over-counts by up to
//!   one `/explain` round trip (its mean is printed as the resolution).

#![allow(clippy::unwrap_used, clippy::expect_used)]
use kvroute_harness::{Fleet, FleetSpec, GatewayClient};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_harness::DEFAULT_MODEL as MODEL;

fn messages(tag: &str, words: usize) -> Vec<Value> {
    let text: Vec<String> = (0..words).map(|i| format!("{tag}w{i}")).collect();
    vec![json!({"role": "system", "content": text.join(" ")}), json!({"role": "user", "content": tag})]
}

fn proc_field(pid: u32, file: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap_or_default()
}

fn rss_kb(pid: u32) -> u64 {
    proc_field(pid, "status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// utime + stime in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = proc_field(pid, "stat");
    // Fields after the `(comm)`; utime and stime are fields 14 and 15 (1-based).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let p = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    p(11) + p(12)
}

fn clock_ticks_per_s() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Nearest-rank percentile of sorted values; NaN when empty.
fn pct(sorted: &[f64], q: f64) -> f64 {
    kvroute_harness::stats::percentile(sorted, q).unwrap_or(f64::NAN)
}

/// Sum over pods of an agent counter (`name` = the sample's prefix up to its labels).
async fn agent_counter(fleet: &Fleet, name: &str) -> f64 {
    let metrics = fleet.agent_metrics(0).await.unwrap_or_default();
    metrics.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok()).sum()
}

/// RSS samples (MiB, sorted) and CPU share (% of one core) of `pid` over `secs`.
struct Phase {
    wall_s: f64,
    rss_mib: Vec<f64>,
    cpu_pct: f64,
}

async fn measure(pid: u32, secs: u64) -> Phase {
    let (cpu0, wall0) = (cpu_ticks(pid), Instant::now());
    let mut rss_mib = Vec::new();
    while wall0.elapsed() < Duration::from_secs(secs) {
        rss_mib.push(rss_kb(pid) as f64 / 1024.0);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let cpu_s = cpu_ticks(pid).saturating_sub(cpu0) as f64 / clock_ticks_per_s();
    let wall_s = wall0.elapsed().as_secs_f64();
    rss_mib.sort_by(f64::total_cmp);
    Phase { wall_s, rss_mib, cpu_pct: 100.0 * cpu_s / wall_s }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a one-minute measurement; run scripts/agent-footprint"]
async fn agent_footprint_eight_engines_under_load() {
    let secs: u64 = std::env::var("AGENT_FOOTPRINT_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let profile = std::env::var("AGENT_FOOTPRINT_PROFILE").unwrap_or_else(|_| "node".into());
    // (time scale, prefills at once (0 = no limit), default clients)
    let (time_scale, max_num_partial_prefills, default_clients) = match profile.as_str() {
        "node" => (1.0, 1, 32),
        "stress" => (0.05, 0, 8),
        other => panic!("AGENT_FOOTPRINT_PROFILE must be node or stress, not {other:?}"),
    };
    let time_scale: f64 =
        std::env::var("AGENT_FOOTPRINT_TIME_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(time_scale);
    let spec = FleetSpec {
        label: "agent-footprint".into(),
        engines: 8,
        engines_per_agent: 8,
        time_scale,
        max_num_partial_prefills,
        report_interval_ms: 2000,
        ..Default::default()
    };
    let fleet = Arc::new(Fleet::start(spec).await.expect("fleet starts"));
    let pid = fleet.agent_pid(0).expect("agent pid");
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let idle_secs: u64 = std::env::var("AGENT_FOOTPRINT_IDLE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let idle = measure(pid, idle_secs).await;

    // Load: closed-loop clients, each cycling over the engines with ~200-word prompts from a
    // rotating set of 40 (so prefixes repeat and evict).
    let clients: usize =
        std::env::var("AGENT_FOOTPRINT_CLIENTS").ok().and_then(|s| s.parse().ok()).unwrap_or(default_clients);
    let mut load = Vec::new();
    for c in 0..clients {
        let (fleet, stop, sent) = (fleet.clone(), stop.clone(), sent.clone());
        load.push(tokio::spawn(async move {
            let clients: Vec<GatewayClient> =
                fleet.engines.iter().map(|e| GatewayClient::new(e.url()).expect("client")).collect();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let client = &clients[(c + n) % clients.len()];
                let _ = client.chat(MODEL, &messages(&format!("load{c}x{}", n % 40), 200), 16).await;
                sent.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
        }));
    }

    // Event → picker prober.
    let prober = {
        let (fleet, stop) = (fleet.clone(), stop.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut lat_ms = Vec::new();
            let mut rtt_ms = Vec::new();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let e = n % fleet.engines.len();
                let pod = fleet.engines[e].name();
                let msgs = messages(&format!("probe{n}"), 150);
                let client = GatewayClient::new(fleet.engines[e].url()).expect("client");
                let start = Instant::now();
                // One output token: the response ends right after the first token, so polling
                // starts at t0 (with more tokens it would start only after their decode time).
                let out = client.chat(MODEL, &msgs, 1).await.expect("probe request");
                let Some(ttft) = out.ttft else { continue };
                let t0 = start + ttft;
                let explain = json!({"model": MODEL, "messages": msgs});
                let url = format!("{}/explain?path=/v1/chat/completions", fleet.picker_admin);
                let deadline = Instant::now() + Duration::from_secs(2);
                while Instant::now() < deadline {
                    let q = Instant::now();
                    let Ok(r) = http.post(&url).json(&explain).send().await else { break };
                    let v: Value = r.json().await.unwrap_or_default();
                    rtt_ms.push(q.elapsed().as_secs_f64() * 1e3);
                    let total = v["total_blocks"].as_u64().unwrap_or(0);
                    let hit = v["candidates"].as_array().into_iter().flatten().any(|c| {
                        c["pod"] == pod.as_str() && c["matched_blocks"].as_u64().unwrap_or(0) + 1 >= total && total > 0
                    });
                    if hit {
                        lat_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (lat_ms, rtt_ms)
        })
    };

    // Warm-up, then measure.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let events_before = agent_counter(&fleet, "kvroute_agent_kv_block_events_total{").await;
    let loaded = measure(pid, secs).await;
    let block_events_per_s =
        (agent_counter(&fleet, "kvroute_agent_kv_block_events_total{").await - events_before) / loaded.wall_s;
    stop.store(true, Ordering::Relaxed);
    for h in load {
        let _ = h.await;
    }
    let (mut lat, rtt) = prober.await.expect("prober");
    lat.sort_by(f64::total_cmp);
    let rtt_mean = rtt.iter().sum::<f64>() / rtt.len().max(1) as f64;
    let batches = agent_counter(&fleet, "kvroute_agent_kv_event_batches_received_total{").await;
    println!(
        "agent footprint, 8 engines, profile {profile} (time scale {time_scale}); baseline = the same agent with the engines idle ({:.0} s)\n  \
         load: {:.0} s, {clients} clients, {} requests, {batches} KV-event batches, \
         {block_events_per_s:.0} block events/s\n  \
         RSS MiB: idle max {:.1}; load median {:.1}, max {:.1} (×{:.2} of idle; target ≤ 30 MB)\n  \
         CPU % of one core: idle {:.2}; load {:.2} (×{:.1} of idle; target ≤ 2 %); \
         {} points per 1 000 block events/s above idle\n  \
         event → picker ms over {} probes: p50 {:.1}, p99 {:.1}, max {:.1} (target p99 ≤ 50; \
         /explain round trip, the resolution: mean {:.1})",
        idle.wall_s,
        loaded.wall_s,
        sent.load(Ordering::Relaxed),
        pct(&idle.rss_mib, 1.0),
        pct(&loaded.rss_mib, 0.5),
        pct(&loaded.rss_mib, 1.0),
        pct(&loaded.rss_mib, 1.0) / pct(&idle.rss_mib, 1.0),
        idle.cpu_pct,
        loaded.cpu_pct,
        loaded.cpu_pct / idle.cpu_pct.max(1e-9),
        // An agent without the block-event counter (older builds) reports none.
        if block_events_per_s > 0.0 {
            format!("{:.3}", (loaded.cpu_pct - idle.cpu_pct) / (block_events_per_s / 1000.0))
        } else {
            "n/a".to_string()
        },
        lat.len(),
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        pct(&lat, 1.0),
        rtt_mean,
    );
    assert!(!lat.is_empty(), "no probe reached the picker");
    if let Ok(f) = Arc::try_unwrap(fleet) {
        f.shutdown().await;
    }
}
