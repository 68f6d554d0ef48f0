//! Gateway overhead: the same request stream, at a fixed rate, through Envoy + kvroute picker
//! (`deploy/envoy/envoy.yaml`), through Envoy with the same config but a no-op ext_proc server
//! (`kvroute-noop-ext-proc`: the picker's reply shapes, a fixed destination, no decision) and
//! through Envoy alone doing round robin (`deploy/envoy/envoy-round-robin.yaml`), over the same
//! emulated engines, in one run (docs/design.md §10: added p50 ≤ 0.5 ms, p99 ≤ 2 ms for prompts
//! ≤ 1k tokens at a rate the box sustains). The no-op layout is the floor: what Envoy's ext_proc
//! exchange costs; the picker's own share is its latency above the no-op's.
//!
//! The engines run with zero prefill and decode time so that routing quality (cache hits) does not
//! enter the latency: what differs between the two paths is the ext_proc hop and the decision.
//! Requests alternate between the gateways on one fixed-rate clock (request i goes to each, one
//! after the other, evenly spaced within the period; the order rotates with i), non-streaming
//! completions of `--prompt-words` words (≈ 1.3 tokens per word) with `max_tokens: 1`. Latency is
//! measured by the client from send to the last body byte (`--stream`: to the first chunk with
//! text, the TTFT a streaming client sees). `--also FILE` adds an Envoy + picker
//! gateway on another kvroute Envoy config (same picker), to compare ext_proc layouts in one run.
//! Every kvroute Envoy also logs how long each ext_proc exchange took as Envoy timed it (request
//! headers, request body, response headers, response body), and the run ends with each
//! layout's medians against the no-op's: where the picker's share goes, phase by phase.
//! Binaries: see the harness's `$KVROUTE_BIN_DIR` (use release builds for numbers worth
//! reporting).

use anyhow::{Result, bail};
use clap::Parser;
use hdrhistogram::Histogram;
use kvroute_harness::fleet::{ExtProcPhases, KvrouteEnvoy};
use kvroute_harness::{Fleet, FleetSpec, GatewayClient};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(version = kvroute_cli::LONG_VERSION, about = "Added latency of Envoy + kvroute picker over Envoy alone (round robin), same run")]
struct Args {
    /// Requests per second sent to each gateway.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Seconds of load per gateway (after the warm-up).
    #[arg(long, default_value_t = 15)]
    duration_s: u64,
    /// Rounds of `--duration-s` each on the same fleet; with more than one, the picker's share
    /// over the no-op is also printed per round with its median.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    rounds: u64,
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
    /// Streamed completions (`"stream": true`): latency is then the time to the first chunk with
    /// text (TTFT), which the response phases of the ext_proc layout can delay.
    #[arg(long)]
    stream: bool,
    /// Output tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 1)]
    max_tokens: u32,
    /// The picker's log level (`info` is its default in deploy/: three JSON lines per request).
    #[arg(long, default_value = "warn")]
    picker_log_level: String,
    /// Another kvroute Envoy config to measure in the same run (path relative to the workspace
    /// root, e.g. deploy/envoy/envoy-full-duplex.yaml); repeatable.
    #[arg(long)]
    also: Vec<PathBuf>,
    /// Leave the round-robin gateway out of the request stream (its Envoy still starts): at high
    /// rates every request it takes is CPU the ext_proc servers being compared do not get. The
    /// added-latency lines are then judged against the no-op only.
    #[arg(long)]
    no_round_robin: bool,
}

fn prompt(group: usize, i: usize, words: usize) -> String {
    let mut s = String::with_capacity(words * 8);
    for w in 0..words.saturating_sub(8) {
        s.push_str(["alpha ", "route ", "cache ", "block ", "token ", "pod ", "queue "][(w * (group + 3)) % 7]);
    }
    s.push_str(&format!("question {i} for group {group}?"));
    s
}

/// An empty latency histogram: microseconds, 1 µs to 1 h, 3 significant digits.
fn histogram() -> Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 3_600_000_000, 3)?)
}

/// CPU seconds (user + system) process `pid` has used, from `/proc/<pid>/stat`; `None` where
/// that is unreadable (not Linux, process gone).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after its closing parenthesis;
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after it.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut f = rest.split_ascii_whitespace().skip(11);
    let ticks = f.next()?.parse::<f64>().ok()? + f.next()?.parse::<f64>().ok()?;
    let hz: f64 = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())?;
    (hz > 0.0).then(|| ticks / hz)
}

/// The `q`-quantile of `h` in ms; NaN when empty.
fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() { f64::NAN } else { h.value_at_quantile(q) as f64 / 1e3 }
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
        picker_log_level: args.picker_log_level.clone(),
        extra_gateway_configs: args.also.clone(),
        noop_ext_proc_gateway: true,
        ext_proc_phase_log: true,
        ..Default::default()
    };
    let model = spec.model.clone();
    let fleet = Fleet::start(spec).await?;
    let Some(rr) = fleet.round_robin_gateway.clone() else { bail!("the round-robin gateway did not start") };
    let Some(noop) = fleet.noop_gateway.clone() else { bail!("the no-op ext_proc gateway did not start") };
    // Index 1 is the baseline every other gateway is compared with; index 2 the no-op floor.
    let mut gateways = vec![
        ("envoy+picker".to_owned(), GatewayClient::new(fleet.gateway.clone())?),
        ("envoy-round-robin".to_owned(), GatewayClient::new(rr)?),
        ("envoy+noop-ext-proc".to_owned(), GatewayClient::new(noop)?),
    ];
    for (path, url) in args.also.iter().zip(&fleet.extra_gateways) {
        let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
        gateways.push((format!("{name}+picker"), GatewayClient::new(url.clone())?));
    }
    let n = gateways.len();
    // The picker's CPU over the run (its decisions, and everything else it does meanwhile: agent
    // streams, index, metrics), for its sustained decisions per CPU-second.
    // Its CPU with no request first (agent streams, index, probes): subtracted, so what remains
    // is what the decisions cost.
    let picker_pid = fleet.picker_pid(0);
    let servers = [("picker", picker_pid), ("no-op ext_proc", fleet.noop_ext_proc_pid())];
    const IDLE: Duration = Duration::from_secs(5);
    let idle_before = servers.map(|(_, pid)| pid.and_then(cpu_seconds));
    tokio::time::sleep(IDLE).await;
    let idle_cpu_per_s: [Option<f64>; 2] = std::array::from_fn(|k| {
        let after = servers[k].1.and_then(cpu_seconds);
        Some((after? - idle_before[k]?) / IDLE.as_secs_f64())
    });
    let cpu_before = servers.map(|(_, pid)| pid.and_then(cpu_seconds));
    let decisions_before = sample(&fleet.picker_metrics().await?, "epp_decision_latency_us_count");

    let per_round = (args.rate * args.duration_s as f64).round() as usize;
    let rounds = usize::try_from(args.rounds).unwrap_or(1);
    let total = args.warmup + per_round * rounds;
    let period = Duration::from_secs_f64(1.0 / args.rate);
    let sending = if args.no_round_robin { n - 1 } else { n };
    let mut tick = tokio::time::interval(period / sending as u32);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut lat: Vec<Histogram<u64>> = (0..n).map(|_| histogram()).collect::<Result<_>>()?;
    let mut errors = vec![0usize; n];
    // Each round's p50 per gateway: the picker's share over the no-op is judged round by round,
    // since one run's share moves with the box's load (docs/benchmarks.md "Picker latency").
    let mut round_p50s: Vec<Vec<f64>> = Vec::with_capacity(rounds);
    let started = Instant::now();
    let mut next = 0usize;
    for round in 0..rounds {
        let warmup = if round == 0 { args.warmup } else { 0 };
        let mut tasks = Vec::with_capacity((warmup + per_round) * n);
        for _ in 0..warmup + per_round {
            let i = next;
            next += 1;
            let body = serde_json::to_vec(&serde_json::json!({
                "model": model, "prompt": prompt(i % args.groups, i, args.prompt_words),
                "max_tokens": args.max_tokens, "stream": args.stream,
            }))?;
            // Rotate which gateway goes first so none always gets the same slot of the period.
            for k in 0..n {
                let g = (i + k) % n;
                if args.no_round_robin && g == 1 {
                    continue;
                }
                tick.tick().await;
                let client = gateways[g].1.clone();
                let body = body.clone();
                tasks.push((g, i, tokio::spawn(async move { client.post_raw("/v1/completions", body, &[]).await })));
            }
        }
        let mut this_round: Vec<Histogram<u64>> = (0..n).map(|_| histogram()).collect::<Result<_>>()?;
        for (g, i, t) in tasks {
            match t.await? {
                Ok(o) if o.status == 200 => {
                    if i >= args.warmup {
                        let t = if args.stream { o.ttft.unwrap_or(o.latency) } else { o.latency };
                        this_round[g].saturating_record(t.as_micros().try_into().unwrap_or(u64::MAX));
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
        round_p50s.push(this_round.iter().map(|h| quantile_ms(h, 0.5)).collect());
        for (all, one) in lat.iter_mut().zip(&this_round) {
            all.add(one)?;
        }
    }
    let wall = started.elapsed();
    let cpu_after = servers.map(|(_, pid)| pid.and_then(cpu_seconds));
    println!(
        "{} requests per gateway at {} req/s each ({} warm-up not counted), prompts ≈ {} tokens, {} engines, {:.1} s; {}",
        total,
        args.rate,
        args.warmup,
        args.prompt_words * 13 / 10,
        args.engines,
        wall.as_secs_f64(),
        if args.stream {
            format!("streamed, {} output tokens, latency = time to first text chunk", args.max_tokens)
        } else {
            format!("not streamed, {} output tokens, latency = whole response", args.max_tokens)
        }
    );
    let mut p = vec![[0.0; 3]; n];
    for g in 0..n {
        p[g] = [quantile_ms(&lat[g], 0.5), quantile_ms(&lat[g], 0.9), quantile_ms(&lat[g], 0.99)];
        println!(
            "{:<32} n={:<5} errors={:<3} p50 {:>7.3} ms  p90 {:>7.3} ms  p99 {:>7.3} ms",
            gateways[g].0,
            lat[g].len(),
            errors[g],
            p[g][0],
            p[g][1],
            p[g][2]
        );
    }
    for g in (0..n).filter(|&g| g != 1 && !args.no_round_robin) {
        let who = match g {
            0 => "added by the picker".to_owned(),
            2 => "added by the no-op ext_proc".to_owned(),
            _ => format!("added by the picker ({})", gateways[g].0),
        };
        println!(
            "{who}: p50 {:+.3} ms (ratio {:.2}), p99 {:+.3} ms (ratio {:.2})",
            p[g][0] - p[1][0],
            p[g][0] / p[1][0],
            p[g][2] - p[1][2],
            p[g][2] / p[1][2]
        );
    }
    for g in (0..n).filter(|&g| g != 1 && g != 2) {
        println!(
            "the picker's own share{}: p50 {:+.3} ms, p99 {:+.3} ms over the no-op ext_proc (targets ≤ +0.1 / ≤ +0.5)",
            if g == 0 { String::new() } else { format!(" ({})", gateways[g].0) },
            p[g][0] - p[2][0],
            p[g][2] - p[2][2]
        );
    }
    if args.rounds > 1 {
        let mut shares: Vec<f64> = round_p50s.iter().map(|p| p[0] - p[2]).collect();
        let listed: Vec<String> = shares.iter().map(|x| format!("{x:+.3}")).collect();
        shares.sort_by(f64::total_cmp);
        println!(
            "the picker's own share by round: p50 {} ms; median {:+.3} ms over {} rounds",
            listed.join(" / "),
            shares[shares.len() / 2],
            shares.len()
        );
    }
    // Where the share goes: each ext_proc exchange as Envoy timed it, against the no-op's.
    tokio::time::sleep(Duration::from_millis(1500)).await; // Envoy flushes its access logs every 500 ms
    // Gateways 0 and 2 are the picker's and the no-op's, 3.. the extra configs' in order.
    let mut layouts = vec![(gateways[0].0.as_str(), KvrouteEnvoy::Picker)];
    for (i, (name, _)) in gateways.iter().enumerate().skip(3) {
        layouts.push((name.as_str(), KvrouteEnvoy::Extra(i - 3)));
    }
    layouts.push((gateways[2].0.as_str(), KvrouteEnvoy::NoOp));
    let mut medians = Vec::new();
    for &(label, envoy) in &layouts {
        let phases = fleet.ext_proc_phases(envoy)?;
        // The warm-up requests were logged first.
        let counted = phases.get(args.warmup.min(phases.len())..).unwrap_or_default();
        medians.push((label, envoy, phase_medians(counted), counted.len()));
    }
    let floor = medians.last().map(|m| m.2);
    println!(
        "ext_proc exchanges as Envoy timed them, median µs (request headers / request body / response headers / response body):"
    );
    for (label, envoy, m, count) in &medians {
        let over = match floor {
            Some(f) if *envoy != KvrouteEnvoy::NoOp => {
                let d: Vec<String> = m.iter().zip(&f).map(|(a, b)| fmt_diff(*a, *b)).collect();
                format!("; over the no-op {}", d.join(" / "))
            }
            _ => String::new(),
        };
        let v: Vec<String> = m.iter().map(|x| x.map_or("-".to_owned(), |x| format!("{x:.0}"))).collect();
        println!("  {label:<30} {} (n={count}){over}", v.join(" / "));
    }
    // CPU per request of each ext_proc server over the same requests, idle CPU subtracted: what
    // one routed request costs the picker against what the bare ext_proc exchange costs.
    let metrics = fleet.picker_metrics().await?;
    let wall_s = wall.as_secs_f64();
    let counted = |g: usize| (lat[g].len() as usize + errors[g] + args.warmup) as f64;
    let per_request: [Option<f64>; 2] = std::array::from_fn(|k| {
        let used = cpu_after[k]? - cpu_before[k]?;
        let marginal = (used - idle_cpu_per_s[k]? * wall_s).max(0.0);
        println!(
            "{} CPU: {used:.2} s over {wall_s:.1} s ({:.1} % of a core idle before the load), {:.0} µs per request above idle",
            servers[k].0,
            idle_cpu_per_s[k]? * 100.0,
            marginal / counted(if k == 0 { 0 } else { 2 }) * 1e6
        );
        Some(marginal / counted(if k == 0 { 0 } else { 2 }))
    });
    if let [Some(picker), Some(noop)] = per_request {
        println!(
            "CPU per request: picker {:.0} µs, no-op {:.0} µs, ratio {:.2} (target ≤ 1.5); {:.0} decisions per picker core-second",
            picker * 1e6,
            noop * 1e6,
            picker / noop,
            if picker > 0.0 { 1.0 / picker } else { f64::INFINITY }
        );
    }
    if let (Some(before), Some(after), Some(d0), Some(d1), Some(idle)) = (
        cpu_before[0],
        cpu_after[0],
        decisions_before,
        sample(&metrics, "epp_decision_latency_us_count"),
        idle_cpu_per_s[0],
    ) && d1 > d0
    {
        let (cpu, made, secs) = (after - before, d1 - d0, wall_s);
        let marginal = (cpu - idle * secs).max(0.0);
        println!(
            "picker decisions: {made:.0}, {:.0} µs of CPU per decision above idle, so one core sustains ≈ {:.0} decisions/s",
            marginal / made * 1e6,
            if marginal > 0.0 { made / marginal } else { f64::INFINITY },
        );
    }
    if let (Some(sum), Some(count)) =
        (sample(&metrics, "epp_decision_latency_us_sum"), sample(&metrics, "epp_decision_latency_us_count"))
        && count > 0.0
    {
        println!("picker decision time (in the added latency): mean {:.0} µs over {count} decisions", sum / count);
        // The histogram's buckets, cumulative: the mean hides whether a typical decision is the
        // code's own time (the decision bench's ≈ 10 µs) or a cold, preempted one.
        let shares: Vec<String> = decision_buckets(&metrics)
            .into_iter()
            .filter(|(le, _)| *le <= 1000.0)
            .map(|(le, n)| format!("≤ {le:.0} µs {:.0} %", 100.0 * n / count))
            .collect();
        println!("picker decisions by time: {}", shares.join(", "));
    }
    println!("logs: {}", fleet.work.display());
    Ok(())
}

/// Median µs of each phase (request headers, request body, response headers, response body) over
/// the requests that had it; `None` where none did.
fn phase_medians(phases: &[ExtProcPhases]) -> [Option<f64>; 4] {
    let pick: [fn(&ExtProcPhases) -> Option<u64>; 4] =
        [|p| p.request_headers, |p| p.request_body, |p| p.response_headers, |p| p.response_body];
    pick.map(|f| {
        let mut v: Vec<u64> = phases.iter().filter_map(f).collect();
        v.sort_unstable();
        match v.len() {
            0 => None,
            n if n % 2 == 1 => Some(v[n / 2] as f64),
            n => Some((v[n / 2 - 1] + v[n / 2]) as f64 / 2.0),
        }
    })
}

/// `a - b` as `+12`, or `-` when either is missing.
fn fmt_diff(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:+.0}", a - b),
        _ => "-".to_owned(),
    }
}

/// The value of the unlabelled sample `name` in the picker's metrics text.
/// `(upper bound µs, cumulative count)` of each `epp_decision_latency_us` bucket, in order.
fn decision_buckets(metrics: &str) -> Vec<(f64, f64)> {
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("epp_decision_latency_us_bucket{le=\"")?;
            let (le, count) = rest.split_once("\"}")?;
            Some((le.parse().ok()?, count.trim().parse().ok()?))
        })
        .collect()
}

fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
