//! End-to-end shared-prefix benchmark (docs/design.md §10's routing-quality shape, scaled down to
//! what emulated engines on this machine sustain): the same open-loop Poisson stream of
//! `/v1/completions` requests (G groups × a shared prefix × Q questions) goes through real Envoy +
//! picker + agents + emulated engines (precise mode: KV events), then — prefix caches emptied —
//! through an Envoy doing plain round robin over the same engines (with `--least-request`, caches
//! emptied again, through an Envoy doing least-request, the least-loaded baseline), then through a
//! second fleet whose picker runs in approximate mode (no tokenizer: docs/design.md §6's text
//! blocks and per-pod LRU of its own routing, GIE's estimated prefix cache). TTFT (first streamed
//! chunk with text) is measured by the client, as inference-perf does.
//!
//! Engines prefill one request at a time by default (`--max-num-partial-prefills 1`, vLLM's
//! default), so prefill compute is each pod's bottleneck and a cache-blind router saturates once
//! the fleet's uncached tokens per second exceed what its pods prefill.
//!
//! `--client inference-perf` sends the stream with inference-perf 0.7.0 instead (docs/design.md §13; its
//! `shared_prefix` generator, Poisson stages of rising rate, streaming `/v1/completions`) and reads
//! its per-stage reports; `scripts/bench-shared-prefix-inference-perf` installs it and runs this.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::{Parser, ValueEnum};
use kvroute_harness::inference_perf::{self, LoadStage, SharedPrefixShape, StageReport};
use kvroute_harness::{Fleet, FleetSpec, GatewayClient, paths};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

/// Which load client sends the requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Client {
    /// This binary's own open-loop Poisson client: `--rate` × `--requests`, or with `--rates` the
    /// same stages as inference-perf, each request's group and question drawn at random.
    Builtin,
    /// inference-perf 0.7.0 as a child process (`--rates`, `--stage-seconds`).
    InferencePerf,
}

#[derive(Parser, Debug)]
#[command(version = kvroute_cli::LONG_VERSION, about = "Shared-prefix workload through Envoy + kvroute vs Envoy round robin; client-side TTFT p50/p90")]
struct Args {
    /// Prefix groups.
    #[arg(long, default_value_t = 24)]
    groups: u64,
    /// Words per shared prefix (≈ 1.2 tokens per word).
    #[arg(long, default_value_t = 1200)]
    prefix_words: usize,
    /// Distinct questions per group.
    #[arg(long, default_value_t = 5)]
    questions: u64,
    /// Words per question.
    #[arg(long, default_value_t = 200)]
    question_words: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Offered rate, requests per second.
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Requests per gateway.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Emulated engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// KV cache per engine, 16-token blocks (default: about half the working set per engine).
    #[arg(long, default_value_t = 1024)]
    num_gpu_blocks: u32,
    /// Requests each engine runs at once (vLLM `--max-num-seqs`); the rest queue.
    #[arg(long, default_value_t = 16)]
    max_num_seqs: u32,
    /// Prefills each engine runs at once (vLLM `--max-num-partial-prefills`); 0 = no limit (every
    /// running request prefills at once, so misses cost latency but no throughput).
    #[arg(long, default_value_t = 1)]
    max_num_partial_prefills: u32,
    /// Emulator time scale (1.0 = the seed's 8B prefill speed).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Skip the approximate-mode fleet (precise kvroute and round robin only).
    #[arg(long)]
    no_approximate: bool,
    /// Also run an Envoy doing least-request over the first fleet's engines (caches emptied first).
    #[arg(long)]
    least_request: bool,
    /// Load client.
    #[arg(long, value_enum, default_value_t = Client::Builtin)]
    client: Client,
    /// Poisson stage rates, requests per second, in order (inference-perf's default 2,4,6; the
    /// builtin client runs stages only when this is given, replacing `--rate` and `--requests`).
    #[arg(long, value_delimiter = ',')]
    rates: Option<Vec<f64>>,
    /// Seconds per stage (`--rates`).
    #[arg(long, default_value_t = 30)]
    stage_seconds: u64,
    /// inference-perf: tokens per shared prefix (default: `--prefix-words` × 1.2).
    #[arg(long)]
    prefix_tokens: Option<u64>,
    /// inference-perf: tokens per question (default: `--question-words` × 1.2).
    #[arg(long)]
    question_tokens: Option<u64>,
    /// inference-perf executable (default: `.tools/iperf-venv/bin/inference-perf` of the repo).
    #[arg(long)]
    inference_perf: Option<std::path::PathBuf>,
    /// inference-perf: kill a run after this many seconds (default: the stages' total + 300).
    #[arg(long)]
    inference_perf_timeout_s: Option<u64>,
}

const WORDS: &[&str] = &[
    "cache", "router", "prefix", "token", "block", "engine", "queue", "latency", "policy", "adapter", "gateway",
    "cluster", "manual", "section", "answer", "question", "the", "of", "and", "with",
];

fn text(seed: u64, words: usize) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..words).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
}

struct Sample {
    /// Load stage (0 without `--rates`).
    stage: usize,
    /// Seconds from the run's start: sent, and done (last byte).
    sent_s: f64,
    done_s: f64,
    ttft_ms: Option<f64>,
    status: u16,
    prompt_tokens: u32,
    cached_tokens: u32,
}

async fn run(gateway: &str, model: &str, a: &Args) -> Result<Vec<Sample>> {
    let client = Arc::new(GatewayClient::new(gateway)?);
    let mut rng = StdRng::seed_from_u64(a.seed);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (stage, at) in arrivals(a, &mut rng) {
        let (g, q) = (rng.random_range(0..a.groups), rng.random_range(0..a.questions));
        let prompt =
            format!("{}\n\n{}", text(1000 + g, a.prefix_words), text(1_000_000 + g * 1000 + q, a.question_words));
        let body = json!({
            "model": model, "prompt": prompt, "max_tokens": a.max_tokens, "ignore_eos": true,
            "stream": true, "stream_options": {"include_usage": true},
        });
        let when = start + Duration::from_secs_f64(at);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(when.into()).await;
            let o = client.post_raw("/v1/completions", serde_json::to_vec(&body)?, &[]).await?;
            anyhow::Ok(Sample {
                stage,
                sent_s: at,
                done_s: start.elapsed().as_secs_f64(),
                ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1000.0),
                status: o.status,
                prompt_tokens: o.prompt_tokens,
                cached_tokens: o.cached_tokens,
            })
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await??);
    }
    Ok(out)
}

/// (stage, seconds from the start) of every request: Poisson arrivals at `--rate` for
/// `--requests`, or with `--rates` at each stage's rate for `--stage-seconds` each.
fn arrivals(a: &Args, rng: &mut StdRng) -> Vec<(usize, f64)> {
    let mut next = |at: f64, rate: f64| at - rng.random_range(f64::EPSILON..1.0f64).ln() / rate;
    let mut out = Vec::new();
    let mut at = 0.0;
    match &a.rates {
        None => {
            for _ in 0..a.requests {
                at = next(at, a.rate);
                out.push((0, at));
            }
        }
        Some(rates) => {
            for (stage, &rate) in rates.iter().enumerate() {
                let end = (stage as f64 + 1.0) * a.stage_seconds as f64;
                loop {
                    at = next(at, rate);
                    if at >= end {
                        at = end;
                        break;
                    }
                    out.push((stage, at));
                }
            }
        }
    }
    out
}

/// Nearest-rank percentile of sorted values; NaN when empty.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    kvroute_harness::stats::percentile(sorted, q).unwrap_or(f64::NAN)
}

/// The builtin client's samples of each `--rates` stage, summarised as inference-perf's reports are.
fn builtin_stage_reports(a: &Args, samples: &[Sample]) -> Vec<StageReport> {
    let rates = a.rates.as_deref().unwrap_or_default();
    rates
        .iter()
        .enumerate()
        .map(|(stage, &rate)| {
            let s: Vec<&Sample> = samples.iter().filter(|x| x.stage == stage).collect();
            let ok: Vec<&&Sample> = s.iter().filter(|x| x.status == 200).collect();
            let mut t: Vec<f64> = ok.iter().filter_map(|x| x.ttft_ms).collect();
            t.sort_by(f64::total_cmp);
            let first = s.iter().map(|x| x.sent_s).fold(f64::INFINITY, f64::min);
            let last = s.iter().map(|x| x.done_s).fold(0.0, f64::max);
            StageReport {
                stage,
                requested_rate: rate,
                achieved_rate: s.len() as f64 / a.stage_seconds as f64,
                successes: ok.len() as u64,
                failures: (s.len() - ok.len()) as u64,
                ttft_p50_ms: percentile(&t, 0.5),
                ttft_p90_ms: percentile(&t, 0.9),
                ttft_p99_ms: percentile(&t, 0.99),
                requests_per_sec: ok.len() as f64 / (last - first),
                prompt_tokens: ok.iter().map(|x| f64::from(x.prompt_tokens)).sum(),
                cached_prompt_tokens: ok.iter().map(|x| f64::from(x.cached_tokens)).sum(),
                ..StageReport::default()
            }
        })
        .collect()
}

fn summary(name: &str, s: &[Sample]) -> (f64, f64) {
    let mut t: Vec<f64> = s.iter().filter_map(|x| x.ttft_ms).collect();
    t.sort_by(f64::total_cmp);
    let pct = |q: f64| percentile(&t, q);
    let prompt: u64 = s.iter().map(|x| u64::from(x.prompt_tokens)).sum();
    let cached: u64 = s.iter().map(|x| u64::from(x.cached_tokens)).sum();
    let errors = s.iter().filter(|x| x.status != 200).count();
    let hit = if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 * 100.0 };
    println!("| {name} | {} | {errors} | {hit:.1} % | {:.1} | {:.1} | {:.1} |", s.len(), pct(0.5), pct(0.9), pct(0.99));
    (pct(0.5), pct(0.9))
}

/// What one gateway's run produced.
enum Outcome {
    Builtin(Vec<Sample>),
    InferencePerf(Vec<StageReport>),
}

/// Sends the workload through `gateway` with the chosen client. `name` names the inference-perf
/// files under `work` (config, log, reports).
async fn drive(gateway: &str, model: &str, a: &Args, name: &str, work: &std::path::Path) -> Result<Outcome> {
    match a.client {
        Client::Builtin => Ok(Outcome::Builtin(run(gateway, model, a).await?)),
        Client::InferencePerf => {
            let dir = work.join("inference-perf").join(name);
            std::fs::create_dir_all(&dir)?;
            let (config_path, reports) = (dir.join("config.yaml"), dir.join("reports"));
            let stages = stages(a);
            let config = inference_perf::config(&shape(a), &stages, gateway, model, &paths::tokenizer_dir(), &reports);
            inference_perf::write_config(&config_path, &config)?;
            let exe = a
                .inference_perf
                .clone()
                .unwrap_or_else(|| paths::repo_root().join(".tools/iperf-venv/bin/inference-perf"));
            let total: u64 = stages.iter().map(|s| s.duration_s).sum();
            let timeout = Duration::from_secs(a.inference_perf_timeout_s.unwrap_or(total + 300));
            eprintln!(
                "{name}: inference-perf --config_file {} (log: {})",
                config_path.display(),
                dir.join("inference-perf.log").display()
            );
            inference_perf::run(&exe, &config_path, &dir.join("inference-perf.log"), timeout).await?;
            let reports = inference_perf::read_stage_reports(&reports, stages.len())?;
            for r in &reports {
                if let Some(e) = &r.first_error {
                    eprintln!("{name}: stage {}: {} requests failed, e.g. {e}", r.stage, r.failures);
                }
            }
            Ok(Outcome::InferencePerf(reports))
        }
    }
}

fn stages(a: &Args) -> Vec<LoadStage> {
    a.rates
        .as_deref()
        .unwrap_or(&[2.0, 4.0, 6.0])
        .iter()
        .map(|&rate| LoadStage { rate, duration_s: a.stage_seconds })
        .collect()
}

/// The workload in tokens. The builtin client's prompts are exactly one fixture token per word
/// (every word of `WORDS` with its leading space is one Qwen2.5 token); inference-perf's lengths
/// default to words × 1.2, the estimate its earlier tables were run with.
fn shape(a: &Args) -> SharedPrefixShape {
    let tokens = |words: usize| match a.client {
        Client::Builtin => words as u64,
        Client::InferencePerf => (words as u64 * 6).div_ceil(5),
    };
    SharedPrefixShape {
        num_groups: a.groups,
        num_prompts_per_group: a.questions,
        system_prompt_len: a.prefix_tokens.unwrap_or_else(|| tokens(a.prefix_words)),
        question_len: a.question_tokens.unwrap_or_else(|| tokens(a.question_words)),
        output_len: u64::from(a.max_tokens),
        seed: a.seed,
    }
}

/// One row per stage of one gateway.
fn stage_rows(name: &str, reports: &[StageReport]) {
    for r in reports {
        println!(
            "| {name} | {:.1} | {:.2} | {} | {} | {:.1} % | {:.1} | {:.1} | {:.1} | {:.2} |",
            r.requested_rate,
            r.achieved_rate,
            r.successes,
            r.failures,
            r.hit_rate() * 100.0,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.requests_per_sec
        );
    }
}

/// Per stage: `other ÷ kvroute` at p50 and p90.
fn stage_ratios(label: &str, kv: &[StageReport], other: &[StageReport]) {
    for (k, o) in kv.iter().zip(other) {
        println!(
            "{label} ÷ kvroute at {:.1} req/s: TTFT p50 {:.1}×, p90 {:.1}×",
            k.requested_rate,
            o.ttft_p50_ms / k.ttft_p50_ms,
            o.ttft_p90_ms / k.ttft_p90_ms
        );
    }
}

fn print_stages(a: &Args, runs: &[(&str, Vec<StageReport>)]) {
    let s = shape(a);
    let client = match a.client {
        Client::Builtin => "builtin (group and question drawn at random per request)",
        Client::InferencePerf => "inference-perf 0.7.0",
    };
    println!(
        "shared prefix through Envoy, client {client}: {} groups × {}-token prefix + {} questions × {} tokens, \
         {} output tokens, Poisson stages {:?} req/s × {} s, {} engines × {} KV blocks, max {} running and {} prefilling each, \
         time scale {}\n",
        s.num_groups,
        s.system_prompt_len,
        s.num_prompts_per_group,
        s.question_len,
        s.output_len,
        stages(a).iter().map(|s| s.rate).collect::<Vec<_>>(),
        a.stage_seconds,
        a.engines,
        a.num_gpu_blocks,
        a.max_num_seqs,
        a.max_num_partial_prefills,
        a.time_scale
    );
    println!(
        "| gateway | rate req/s | achieved | ok | failed | cache hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | throughput req/s |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, reports) in runs {
        stage_rows(name, reports);
    }
    println!();
    if let Some(((_, kv), others)) = runs.split_first() {
        for (name, reports) in others {
            stage_ratios(name, kv, reports);
        }
    }
}

fn print_builtin(a: &Args, runs: &[(&str, Vec<Sample>)]) {
    println!(
        "shared prefix through Envoy: {} groups × {} words + {} questions × {} words, {} output tokens, {} req/s Poisson, \
         {} engines × {} KV blocks, max {} running and {} prefilling each, time scale {}\n",
        a.groups,
        a.prefix_words,
        a.questions,
        a.question_words,
        a.max_tokens,
        a.rate,
        a.engines,
        a.num_gpu_blocks,
        a.max_num_seqs,
        a.max_num_partial_prefills,
        a.time_scale
    );
    println!("| gateway | requests | errors | cache hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let pcts: Vec<(f64, f64)> = runs.iter().map(|(name, samples)| summary(name, samples)).collect();
    println!();
    if let Some(((k50, k90), others)) = pcts.split_first() {
        for ((name, _), (o50, o90)) in runs.iter().skip(1).zip(others) {
            println!("{name} ÷ kvroute: TTFT p50 {:.1}×, p90 {:.1}×", o50 / k50, o90 / k90);
        }
    }
}

fn fleet_spec(a: &Args, label: &str) -> FleetSpec {
    FleetSpec {
        label: label.into(),
        engines: a.engines,
        num_gpu_blocks: a.num_gpu_blocks,
        time_scale: a.time_scale,
        max_num_seqs: a.max_num_seqs,
        max_num_partial_prefills: a.max_num_partial_prefills,
        picker_log_level: "warn".into(),
        ..FleetSpec::default()
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let spec = FleetSpec {
        round_robin_baseline: true,
        least_request_baseline: a.least_request,
        ..fleet_spec(&a, "shared-prefix-bench")
    };
    let model = spec.model.clone();
    eprintln!("starting {} engines, agents, picker and Envoys (kvroute and the baselines) ...", a.engines);
    let fleet = Fleet::start(spec).await?;
    let mut runs = vec![("Envoy + kvroute", drive(&fleet.gateway, &model, &a, "kvroute", &fleet.work).await?)];
    let baselines = [
        ("Envoy round robin", "round-robin", fleet.round_robin_gateway.clone()),
        ("Envoy least request", "least-request", fleet.least_request_gateway.clone()),
    ];
    for (label, name, gateway) in baselines {
        if let Some(gateway) = gateway {
            fleet.reset_prefix_caches().await?;
            runs.push((label, drive(&gateway, &model, &a, name, &fleet.work).await?));
        }
    }
    fleet.shutdown().await;
    if !a.no_approximate {
        eprintln!("starting a second fleet whose picker runs in approximate mode ...");
        let spec = FleetSpec { picker_approximate: true, ..fleet_spec(&a, "shared-prefix-bench-approx") };
        let fleet = Fleet::start(spec).await?;
        runs.push((
            "Envoy + kvroute, approximate mode",
            drive(&fleet.gateway, &model, &a, "approximate", &fleet.work).await?,
        ));
        fleet.shutdown().await;
    }
    let mut builtin = Vec::new();
    let mut iperf = Vec::new();
    for (label, outcome) in runs {
        match outcome {
            Outcome::Builtin(samples) => builtin.push((label, samples)),
            Outcome::InferencePerf(reports) => iperf.push((label, reports)),
        }
    }
    match (builtin.is_empty(), iperf.is_empty()) {
        (false, true) if a.rates.is_some() => {
            let staged: Vec<(&str, Vec<StageReport>)> =
                builtin.iter().map(|(label, samples)| (*label, builtin_stage_reports(&a, samples))).collect();
            print_stages(&a, &staged);
        }
        (false, true) => print_builtin(&a, &builtin),
        (true, false) => print_stages(&a, &iperf),
        _ => anyhow::bail!("gateways ran with different clients"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_arrivals_stay_in_their_stage_at_about_its_rate() {
        let a = Args::try_parse_from(["b", "--rates", "2,10", "--stage-seconds", "100"]).unwrap();
        let at = arrivals(&a, &mut StdRng::seed_from_u64(1));
        assert!(at.windows(2).all(|w| w[0].1 <= w[1].1), "arrivals are in time order");
        for (stage, rate) in [(0usize, 2.0), (1, 10.0)] {
            let (from, to) = (stage as f64 * 100.0, (stage as f64 + 1.0) * 100.0);
            let n = at.iter().filter(|x| x.0 == stage).inspect(|x| assert!(x.1 >= from && x.1 < to)).count() as f64;
            // Poisson count, mean rate × 100 s: within 4 standard deviations.
            assert!((n - rate * 100.0).abs() < 4.0 * (rate * 100.0f64).sqrt(), "stage {stage}: {n}");
        }
        let single = Args::try_parse_from(["b", "--rate", "4", "--requests", "50"]).unwrap();
        assert_eq!(arrivals(&single, &mut StdRng::seed_from_u64(1)).len(), 50);
    }
}
