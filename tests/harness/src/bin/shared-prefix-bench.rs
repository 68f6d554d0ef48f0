//! End-to-end shared-prefix benchmark (issue 9; SPEC §10's routing-quality shape, scaled down to
//! what emulated engines on this machine sustain): the same open-loop Poisson stream of
//! `/v1/completions` requests (G groups × a shared prefix × Q questions) goes through real Envoy +
//! picker + agents + emulated engines (precise mode: KV events), then — prefix caches emptied —
//! through an Envoy doing plain round robin over the same engines, then through a second fleet
//! whose picker runs in approximate mode (no tokenizer: SPEC §6's text blocks and per-pod LRU of
//! its own routing, GIE's estimated prefix cache). TTFT (first streamed chunk with text) is
//! measured by the client, as inference-perf does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use kvroute_harness::{Fleet, FleetSpec, GatewayClient};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "Shared-prefix workload through Envoy + kvroute vs Envoy round robin; client-side TTFT p50/p90")]
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
    /// Emulator time scale (1.0 = the seed's 8B prefill speed).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Skip the approximate-mode fleet (precise kvroute and round robin only).
    #[arg(long)]
    no_approximate: bool,
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
    ttft_ms: Option<f64>,
    status: u16,
    prompt_tokens: u32,
    cached_tokens: u32,
}

async fn run(gateway: &str, model: &str, a: &Args) -> Result<Vec<Sample>> {
    let client = Arc::new(GatewayClient::new(gateway)?);
    let mut rng = StdRng::seed_from_u64(a.seed);
    let start = Instant::now();
    let mut at = 0.0f64;
    let mut tasks = Vec::new();
    for _ in 0..a.requests {
        at += -rng.random_range(f64::EPSILON..1.0f64).ln() / a.rate;
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

fn summary(name: &str, s: &[Sample]) -> (f64, f64) {
    let mut t: Vec<f64> = s.iter().filter_map(|x| x.ttft_ms).collect();
    t.sort_by(f64::total_cmp);
    let pct = |q: f64| t.get(((t.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN);
    let prompt: u64 = s.iter().map(|x| u64::from(x.prompt_tokens)).sum();
    let cached: u64 = s.iter().map(|x| u64::from(x.cached_tokens)).sum();
    let errors = s.iter().filter(|x| x.status != 200).count();
    let hit = if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 * 100.0 };
    println!("| {name} | {} | {errors} | {hit:.1} % | {:.1} | {:.1} | {:.1} |", s.len(), pct(0.5), pct(0.9), pct(0.99));
    (pct(0.5), pct(0.9))
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let spec = FleetSpec {
        label: "shared-prefix-bench".into(),
        engines: a.engines,
        num_gpu_blocks: a.num_gpu_blocks,
        time_scale: a.time_scale,
        max_num_seqs: a.max_num_seqs,
        round_robin_baseline: true,
        picker_log_level: "warn".into(),
        ..FleetSpec::default()
    };
    let model = spec.model.clone();
    eprintln!("starting {} engines, agents, picker, Envoy (kvroute) and Envoy (round robin) ...", a.engines);
    let fleet = Fleet::start(spec).await?;
    let kv = run(&fleet.gateway, &model, &a).await?;
    fleet.reset_prefix_caches().await?;
    let rr_gateway = fleet.round_robin_gateway.clone().unwrap_or_default();
    let rr = run(&rr_gateway, &model, &a).await?;
    fleet.shutdown().await;
    let approx = if a.no_approximate {
        None
    } else {
        eprintln!("starting a second fleet whose picker runs in approximate mode ...");
        let spec = FleetSpec {
            label: "shared-prefix-bench-approx".into(),
            engines: a.engines,
            num_gpu_blocks: a.num_gpu_blocks,
            time_scale: a.time_scale,
            max_num_seqs: a.max_num_seqs,
            picker_approximate: true,
            picker_log_level: "warn".into(),
            ..FleetSpec::default()
        };
        let fleet = Fleet::start(spec).await?;
        let samples = run(&fleet.gateway, &model, &a).await?;
        fleet.shutdown().await;
        Some(samples)
    };
    println!(
        "shared prefix through Envoy: {} groups × {} words + {} questions × {} words, {} output tokens, {} req/s Poisson, \
         {} engines × {} KV blocks, max {} running each\n",
        a.groups,
        a.prefix_words,
        a.questions,
        a.question_words,
        a.max_tokens,
        a.rate,
        a.engines,
        a.num_gpu_blocks,
        a.max_num_seqs
    );
    println!("| gateway | requests | errors | cache hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let (k50, k90) = summary("Envoy + kvroute", &kv);
    let (r50, r90) = summary("Envoy round robin", &rr);
    let approx = approx.as_deref().map(|s| summary("Envoy + kvroute, approximate mode", s));
    println!("\nround robin ÷ kvroute: TTFT p50 {:.1}×, p90 {:.1}×", r50 / k50, r90 / k90);
    if let Some((a50, a90)) = approx {
        println!("approximate mode ÷ kvroute: TTFT p50 {:.1}×, p90 {:.1}×", a50 / k50, a90 / k90);
    }
    Ok(())
}
