//! The kvroute demo: a fleet of 4 emulated vLLM engines (or, with `--engines vllm`, 2 real vLLM
//! CPU engines), agents (mock NVML), the picker and a real Envoy; a multi-turn chat workload with
//! shared system prompts goes through Envoy, first routed by kvroute, then (caches emptied) by
//! plain round robin, and the two are compared by the engines' own `cached_tokens`.

use anyhow::Result;
use clap::Parser;
use kvroute_harness::{
    EngineKind, Fleet, FleetSpec, Pacing, RunSummary, TurnRecord, VllmSpec, Workload, run_chat_workload,
};
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(version = kvroute_cli::LONG_VERSION, about = "Run a local kvroute fleet behind Envoy and route a multi-turn chat workload through it")]
struct Args {
    /// Engines: `emulator` (4 emulated engines) or `vllm` (2 real vLLM CPU engines, installed by
    /// `scripts/install-vllm`; a smaller workload unless the sizes are given).
    #[arg(long, default_value = "emulator", value_parser = ["emulator", "vllm"])]
    engines: String,
    /// Number of distinct system prompts (default 8; 4 with `--engines vllm`).
    #[arg(long)]
    system_prompts: Option<usize>,
    /// Conversations per system prompt.
    #[arg(long, default_value_t = 3)]
    conversations_per_prompt: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Words per system prompt, about 1.2 tokens per word (default 1200; 600 with `--engines vllm`).
    #[arg(long)]
    system_words: Option<usize>,
    /// Output tokens per reply (default 24; 8 with `--engines vllm`).
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Milliseconds between the arrivals of consecutive conversations.
    #[arg(long, default_value_t = 150)]
    arrival_gap_ms: u64,
    /// Milliseconds a user waits after a reply before the next turn.
    #[arg(long, default_value_t = 200)]
    think_time_ms: u64,
    /// KV cache per engine, in 16-token blocks (512 blocks = 8192 tokens: the system prompts
    /// together need more than one engine holds, less than the fleet does).
    #[arg(long, default_value_t = 512)]
    num_gpu_blocks: u32,
    /// Emulator time scale (1.0 = the seed's 8B-model prefill speed on an A100).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let real = args.engines == "vllm";
    let mut spec = FleetSpec {
        label: "demo".into(),
        time_scale: args.time_scale,
        round_robin_baseline: true,
        ..Default::default()
    };
    if real {
        // Two engines on two cores, one agent each; the same KV budget in tokens as asked.
        let v = VllmSpec::default();
        let blocks = (args.num_gpu_blocks * 16).div_ceil(v.block_size);
        spec = FleetSpec {
            engines: 2,
            engines_per_agent: 1,
            engine_kind: EngineKind::Vllm(VllmSpec { num_gpu_blocks: Some(blocks), ..v }),
            ..spec
        };
    }
    let (system_prompts, system_words, max_tokens) = if real {
        (args.system_prompts.unwrap_or(4), args.system_words.unwrap_or(600), args.max_tokens.unwrap_or(8))
    } else {
        (args.system_prompts.unwrap_or(8), args.system_words.unwrap_or(1200), args.max_tokens.unwrap_or(24))
    };
    let model = spec.model.clone();
    println!(
        "starting the fleet: {} {} engines, {} agents (mock NVML), picker, Envoy 1.40 ...{}",
        spec.engines,
        if real { "real vLLM (CPU)" } else { "emulated vLLM" },
        spec.engines.div_ceil(spec.engines_per_agent),
        if real { " (vLLM takes about 2 minutes to start)" } else { "" }
    );
    let fleet = Fleet::start(spec).await?;
    println!(
        "gateway (kvroute): {}   baseline (round robin): {}",
        fleet.gateway,
        fleet.round_robin_gateway.as_deref().unwrap_or("-")
    );
    println!("logs and configs: {}\n", fleet.work.display());

    let workload = Workload::multi_turn_chat(
        args.seed,
        system_prompts,
        args.conversations_per_prompt,
        args.turns,
        system_words,
        40,
    );
    let pacing = Pacing {
        arrival_gap: Duration::from_millis(args.arrival_gap_ms),
        think_time: Duration::from_millis(args.think_time_ms),
        max_tokens,
    };
    let print = |label: &'static str| {
        move |r: &TurnRecord| {
            let o = &r.outcome;
            println!(
                "[{label:<11}] conv {:>2} (system prompt {}) turn {}  -> {:<9} status {}  prompt {:>5} tok  cached {:>5} tok  ttft {:>6.1} ms",
                r.conversation,
                r.system_prompt,
                r.turn + 1,
                o.served_by.as_deref().unwrap_or("?"),
                o.status,
                o.prompt_tokens,
                o.cached_tokens,
                o.ttft.map(|d| d.as_secs_f64() * 1000.0).unwrap_or(f64::NAN),
            );
        }
    };

    let kvroute =
        run_chat_workload(&fleet.client(&fleet.gateway)?, &model, &workload, pacing, print("kvroute")).await?;
    fleet.reset_prefix_caches().await?;
    println!();
    let rr_gateway = fleet.round_robin_gateway.clone().unwrap_or_default();
    let baseline =
        run_chat_workload(&fleet.client(&rr_gateway)?, &model, &workload, pacing, print("round-robin")).await?;

    let (k, b) = (RunSummary::of(&kvroute), RunSummary::of(&baseline));
    println!("\nsummary ({} requests each, same workload, caches emptied in between):", k.requests);
    for (name, s) in [("kvroute", &k), ("round-robin", &b)] {
        println!(
            "  {name:<11}: cache hit rate {:>5.1}% ({} of {} prompt tokens cached), mean TTFT {:>7.1} ms, p90 TTFT {:>7.1} ms, errors {}",
            s.hit_rate() * 100.0,
            s.cached_tokens,
            s.prompt_tokens,
            s.mean_ttft_ms,
            s.p90_ttft_ms,
            s.errors
        );
    }
    if b.mean_ttft_ms > 0.0 {
        println!("  kvroute mean TTFT = {:.2} x round robin's", k.mean_ttft_ms / b.mean_ttft_ms);
    }
    fleet.shutdown().await;
    Ok(())
}
