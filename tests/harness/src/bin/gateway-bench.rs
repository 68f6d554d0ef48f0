//! Gateway overhead: the same request stream, at a fixed rate, through Envoy + kvroute picker
//! (`deploy/envoy/envoy.yaml`) and through Envoy alone doing round robin
//! (`deploy/envoy/envoy-round-robin.yaml`), over the same emulated engines, in one run (SPEC §10:
//! added p50 ≤ 0.5 ms, p99 ≤ 2 ms for prompts ≤ 1k tokens at a rate the box sustains).
//!
//! The engines run with zero prefill and decode time so that routing quality (cache hits) does not
//! enter the latency: what differs between the two paths is the ext_proc hop and the decision.
//! Requests alternate between the two gateways on one fixed-rate clock (request i goes to both,
//! one after the other, half a period apart), non-streaming completions of `--prompt-words` words
//! (≈ 1.3 tokens per word) with `max_tokens: 1`. Latency is measured by the client from send to
//! the last body byte. Binaries: see the harness's `$KVROUTE_BIN_DIR` (use release builds for
//! numbers worth reporting).

use anyhow::{Result, bail};
use clap::Parser;
use kvroute_harness::{Fleet, FleetSpec, GatewayClient};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Added latency of Envoy + kvroute picker over Envoy alone (round robin), same run")]
struct Args {
    /// Requests per second sent to each gateway.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Seconds of load per gateway (after the warm-up).
    #[arg(long, default_value_t = 15)]
    duration_s: u64,
    /// Warm-up requests per gateway, not counted.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Words per prompt (about 1.3 tokens per word; keep it under 1k tokens).
    #[arg(long, default_value_t = 600)]
    prompt_words: usize,
    /// Distinct prompt prefixes cycled through (shared-prefix traffic).
    #[arg(long, default_value_t = 8)]
    groups: usize,
    /// Emulated engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
}

fn prompt(group: usize, i: usize, words: usize) -> String {
    let mut s = String::with_capacity(words * 8);
    for w in 0..words.saturating_sub(8) {
        s.push_str(["alpha ", "route ", "cache ", "block ", "token ", "pod ", "queue "][(w * (group + 3)) % 7]);
    }
    s.push_str(&format!("question {i} for group {group}?"));
    s
}

/// p-th quantile (nearest rank) in ms.
fn quantile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[idx.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if !args.rate.is_finite() || args.rate <= 0.0 {
        bail!("--rate must be positive, got {}", args.rate);
    }
    let spec = FleetSpec {
        label: "gateway-bench".into(),
        engines: args.engines,
        round_robin_baseline: true,
        prefill_us_per_token: 0,
        decode_ms_per_token: 0,
        max_num_seqs: 64,
        picker_log_level: "warn".into(),
        ..Default::default()
    };
    let model = spec.model.clone();
    let fleet = Fleet::start(spec).await?;
    let Some(rr) = fleet.round_robin_gateway.clone() else { bail!("the round-robin gateway did not start") };
    let gateways =
        [("envoy+picker", GatewayClient::new(fleet.gateway.clone())?), ("envoy-round-robin", GatewayClient::new(rr)?)];

    let total = args.warmup + (args.rate * args.duration_s as f64).round() as usize;
    let period = Duration::from_secs_f64(1.0 / args.rate);
    let mut tick = tokio::time::interval(period / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks = Vec::with_capacity(total * 2);
    let started = Instant::now();
    for i in 0..total {
        let body = serde_json::to_vec(&serde_json::json!({
            "model": model, "prompt": prompt(i % args.groups, i, args.prompt_words), "max_tokens": 1,
        }))?;
        // Alternate which gateway goes first so neither always gets the fresher half-period.
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for g in order {
            tick.tick().await;
            let client = gateways[g].1.clone();
            let body = body.clone();
            tasks.push((g, i, tokio::spawn(async move { client.post_raw("/v1/completions", body, &[]).await })));
        }
    }
    let mut lat: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut errors = [0usize; 2];
    for (g, i, t) in tasks {
        match t.await? {
            Ok(o) if o.status == 200 => {
                if i >= args.warmup {
                    lat[g].push(o.latency);
                }
            }
            Ok(o) => {
                errors[g] += 1;
                eprintln!("{}: request {i} answered {}: {:?}", gateways[g].0, o.status, o.error);
            }
            Err(e) => {
                errors[g] += 1;
                eprintln!("{}: request {i} failed: {e:#}", gateways[g].0);
            }
        }
    }
    let wall = started.elapsed();
    println!(
        "{} requests per gateway at {} req/s each ({} warm-up not counted), prompts ≈ {} tokens, {} engines, {:.1} s",
        total,
        args.rate,
        args.warmup,
        args.prompt_words * 13 / 10,
        args.engines,
        wall.as_secs_f64()
    );
    let mut p = [[0.0; 3]; 2];
    for g in 0..2 {
        lat[g].sort_unstable();
        p[g] = [quantile_ms(&lat[g], 0.5), quantile_ms(&lat[g], 0.9), quantile_ms(&lat[g], 0.99)];
        println!(
            "{:<18} n={:<5} errors={:<3} p50 {:>7.3} ms  p90 {:>7.3} ms  p99 {:>7.3} ms",
            gateways[g].0,
            lat[g].len(),
            errors[g],
            p[g][0],
            p[g][1],
            p[g][2]
        );
    }
    println!(
        "added by the picker: p50 {:+.3} ms (ratio {:.2}), p99 {:+.3} ms (ratio {:.2})",
        p[0][0] - p[1][0],
        p[0][0] / p[1][0],
        p[0][2] - p[1][2],
        p[0][2] / p[1][2]
    );
    // Attribution: the picker's own decision time (parse + tokenize + hash + score), mean over the run.
    let metrics = fleet.picker_metrics().await?;
    let value = |name: &str| -> Option<f64> {
        metrics.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
    };
    if let (Some(sum), Some(count)) = (value("epp_decision_latency_us_sum "), value("epp_decision_latency_us_count "))
        && count > 0.0
    {
        println!("picker decision time (in the added latency): mean {:.0} µs over {count} decisions", sum / count);
    }
    println!("logs: {}", fleet.work.display());
    Ok(())
}
