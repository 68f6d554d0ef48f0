//! End-to-end multi-turn chat benchmark against a real peer router (docs/benchmarks.md): the same
//! seeded open-loop stream of streaming `/v1/chat/completions` requests goes through Envoy +
//! kvroute (picker in precise mode, agents, KV events), then — every engine's prefix cache emptied
//! — through SMG (`smg launch --backend vllm --policy cache_aware`, the SGLang router's Rust
//! successor, installed by `scripts/install-smg`; clients send to it directly and it is given the
//! engines' URLs), then through an Envoy doing plain round robin, all over the same engines
//! (emulated, or real vLLM with `--engine-kind vllm`); with `--approximate` also through a second
//! fleet whose picker runs in approximate mode, and with `--independent-pickers` through one
//! whose `--pickers` replicas do not follow each other. TTFT (first streamed chunk with text) is measured by the client.
//!
//! The stream: `--groups` system prompts × `--users` conversations each × `--turns` turns; each
//! turn re-sends the whole conversation (earlier answers are seeded stand-in text, so every
//! router gets byte-identical prompts). Arrivals are Poisson at `--rate`; a conversation's next
//! turn is due at its own arrival time but never sent before its previous reply is in.
//! `scripts/bench-smg` installs SMG and runs this at a busy rate and near saturation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvroute_harness::fleet::Engine;
use kvroute_harness::process::ManagedProcess;
use kvroute_harness::{EngineKind, Fleet, FleetSpec, GatewayClient, VllmSpec, Workload, paths};

#[derive(Parser, Debug)]
#[command(version = kvroute_cli::LONG_VERSION, about = "Multi-turn chat through Envoy + kvroute vs SMG vs Envoy round robin; client-side TTFT p50/p90/p99")]
struct Args {
    /// System prompts (groups).
    #[arg(long, default_value_t = 24)]
    groups: usize,
    /// Conversations per system prompt.
    #[arg(long, default_value_t = 5)]
    users: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Words per system prompt (≈ 1.1 Qwen2.5 tokens per word: ≈ 1.5k tokens).
    #[arg(long, default_value_t = 1400)]
    system_words: usize,
    /// Words per user message.
    #[arg(long, default_value_t = 100)]
    user_words: usize,
    /// Words per stand-in assistant answer carried in later turns.
    #[arg(long, default_value_t = 100)]
    reply_words: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Offered rate, requests per second.
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// What the engines are: `emulator`, or `vllm` (vLLM's CPU build, `scripts/install-vllm`;
    /// 32-token blocks, one core each: size the stream for a few requests per second).
    #[arg(long, default_value = "emulator", value_parser = ["emulator", "vllm"])]
    engine_kind: String,
    /// KV cache per engine, 16-token blocks (default: the working set is ≈ 1.6× the fleet's;
    /// with `--engine-kind vllm`, rounded down to its 32-token blocks).
    #[arg(long, default_value_t = 1000)]
    num_gpu_blocks: u32,
    /// Requests each engine runs at once (vLLM `--max-num-seqs`); the rest queue.
    #[arg(long, default_value_t = 16)]
    max_num_seqs: u32,
    /// Prefills each engine runs at once (vLLM `--max-num-partial-prefills`).
    #[arg(long, default_value_t = 1)]
    max_num_partial_prefills: u32,
    /// Emulator time scale (1.0 = the seed's 8B prefill speed).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Workload seed (texts and arrivals).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// SMG executable (default: `.tools/smg/bin/smg` of the repo, from `scripts/install-smg`).
    #[arg(long)]
    smg: Option<PathBuf>,
    /// Extra argument for `smg launch` (repeatable, e.g. `--smg-arg=--cache-threshold=0.5`).
    #[arg(long, allow_hyphen_values = true)]
    smg_arg: Vec<String>,
    /// Skip SMG (kvroute and round robin only).
    #[arg(long)]
    no_smg: bool,
    /// Picker replicas behind the kvroute Envoy (it spreads ext_proc streams over them, as
    /// deploy/ ships 3).
    #[arg(long, default_value_t = 1)]
    pickers: usize,
    /// Independent SMG processes, each told every engine; requests go to them in turn (as a
    /// Service spreads clients over router replicas). Each knows only its own routing.
    #[arg(long, default_value_t = 1)]
    smg_replicas: usize,
    /// Join the SMG replicas in SMG's mesh (`--enable-mesh`, each told the others as
    /// `--mesh-peer-urls`), its HA coordination between routers.
    #[arg(long)]
    smg_mesh: bool,
    /// Skip the round-robin run.
    #[arg(long)]
    no_rr: bool,
    /// Picker log level (`debug` writes every decision's candidates to the picker's log under
    /// `target/kvroute-runs/<fleet>/`).
    #[arg(long, default_value = "warn")]
    picker_log_level: String,
    /// Also run a second fleet whose picker runs in approximate mode.
    #[arg(long)]
    approximate: bool,
    /// Also run a fleet whose picker replicas do not follow each other (no `replicas.peers`):
    /// each shares only the agents' KV events, not routed chains, in-flight counts or
    /// unreachable marks. What one view across replicas buys (with `--pickers` ≥ 2).
    #[arg(long)]
    independent_pickers: bool,
    /// Background stream beside the chat: unrelated single-message prompts (nothing shared with
    /// each other or with the chat) at this Poisson rate, requests per second, over the chat
    /// stream's span. 0: none. Reported apart from the chat requests.
    #[arg(long, default_value_t = 0.0)]
    background_rate: f64,
    /// Words per background prompt (≈ 3 Qwen2.5 tokens per word: 2000 words ≈ 6k tokens).
    #[arg(long, default_value_t = 2000)]
    background_words: usize,
    /// Another kvroute run on a fresh fleet whose picker config sets these top-level keys:
    /// `LABEL=JSON`, e.g. `--variant 'ttft={"scoring":{"preset":"ttft"}}'`. Repeatable.
    #[arg(long)]
    variant: Vec<String>,
}

/// One request's result.
struct Sample {
    /// A background request (not part of the chat stream).
    background: bool,
    group: usize,
    turn: usize,
    ttft_ms: Option<f64>,
    /// 0 when the request never got an HTTP answer.
    status: u16,
    prompt_tokens: u32,
    cached_tokens: u32,
    served_by: Option<String>,
}

/// Sends the whole stream through `clients` (requests to each in turn): one task per conversation,
/// each turn at its scheduled time or once the previous reply is in, whichever is later.
async fn drive(clients: Vec<GatewayClient>, model: &str, w: &Workload, a: &Args) -> Result<Vec<Sample>> {
    let clients = Arc::new(clients);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let replies = w.synthetic_replies(a.seed, a.reply_words);
    let mut per_conversation: BTreeMap<usize, Vec<(f64, usize)>> = BTreeMap::new();
    for s in w.open_loop_schedule(a.seed, a.rate) {
        per_conversation.entry(s.conversation).or_default().push((s.at_s, s.turn));
    }
    let span = per_conversation.values().flatten().map(|&(at, _)| at).fold(0.0, f64::max);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (i, at) in background_schedule(a.seed, a.background_rate, span).into_iter().enumerate() {
        let (clients, next, model, max_tokens) = (clients.clone(), next.clone(), model.to_string(), a.max_tokens);
        let prompt = kvroute_harness::workload::seeded_words(
            a.seed.wrapping_mul(1_000_003).wrapping_add(i as u64 + 1),
            a.background_words,
        );
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
            let client = &clients[next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % clients.len()];
            let messages = [serde_json::json!({"role": "user", "content": format!("Background job {i}: {prompt}")})];
            let o = client.chat(&model, &messages, max_tokens).await.unwrap_or_default();
            vec![Sample {
                background: true,
                group: usize::MAX,
                turn: 0,
                ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1000.0),
                status: o.status,
                prompt_tokens: o.prompt_tokens,
                cached_tokens: o.cached_tokens,
                served_by: o.served_by,
            }]
        }));
    }
    for (c, turns) in per_conversation {
        let conversation = w.conversations[c].clone();
        let bodies: Vec<_> = turns.iter().map(|&(at, t)| (at, t, w.messages(&conversation, t, &replies[c]))).collect();
        let (clients, next, model, max_tokens) = (clients.clone(), next.clone(), model.to_string(), a.max_tokens);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for (at, turn, messages) in bodies {
                tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
                let client = &clients[next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % clients.len()];
                let o = client.chat(&model, &messages, max_tokens).await.unwrap_or_default();
                out.push(Sample {
                    background: false,
                    group: conversation.system_prompt,
                    turn,
                    ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1000.0),
                    status: o.status,
                    prompt_tokens: o.prompt_tokens,
                    cached_tokens: o.cached_tokens,
                    served_by: o.served_by,
                });
            }
            out
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.extend(t.await?);
    }
    Ok(out)
}

/// Arrival times (s) of the background stream: Poisson at `rate` per second over `[0, span_s]`,
/// seeded apart from the chat stream's clock. Empty when `rate` is not positive.
fn background_schedule(seed: u64, rate: f64, span_s: f64) -> Vec<f64> {
    use rand::{Rng, SeedableRng};
    if !(rate.is_finite() && rate > 0.0) {
        return Vec::new();
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x6261_636b_6772_6e64);
    let mut out = Vec::new();
    let mut at = 0.0;
    loop {
        at -= rng.random_range(f64::EPSILON..1.0f64).ln() / rate;
        if at > span_s {
            return out;
        }
        out.push(at);
    }
}

/// TTFT percentiles (ms) and cache hit rate (%) of one layout's samples.
struct Summary {
    requests: usize,
    errors: usize,
    hit: f64,
    p50: f64,
    p90: f64,
    p99: f64,
}

fn summarize(s: &[&Sample]) -> Summary {
    let mut t: Vec<f64> = s.iter().filter(|x| x.status == 200).filter_map(|x| x.ttft_ms).collect();
    t.sort_by(f64::total_cmp);
    let pct = |q: f64| kvroute_harness::stats::percentile(&t, q).unwrap_or(f64::NAN);
    let prompt: u64 = s.iter().map(|x| u64::from(x.prompt_tokens)).sum();
    let cached: u64 = s.iter().map(|x| u64::from(x.cached_tokens)).sum();
    Summary {
        requests: s.len(),
        errors: s.iter().filter(|x| x.status != 200).count(),
        hit: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 * 100.0 },
        p50: pct(0.5),
        p90: pct(0.9),
        p99: pct(0.99),
    }
}

/// Where a layout put each group: requests per engine, engines per group, and the share of a
/// group's requests on its most-used engine (what "keeping each group on one engine" means).
fn placement(name: &str, s: &[&Sample]) {
    let mut per_engine: BTreeMap<&str, usize> = BTreeMap::new();
    let mut per_group: BTreeMap<usize, BTreeMap<&str, usize>> = BTreeMap::new();
    for x in s.iter().filter(|x| x.status == 200) {
        let e = x.served_by.as_deref().unwrap_or("?");
        *per_engine.entry(e).or_default() += 1;
        *per_group.entry(x.group).or_default().entry(e).or_default() += 1;
    }
    let groups = per_group.len().max(1) as f64;
    let engines_per_group = per_group.values().map(|m| m.len() as f64).sum::<f64>() / groups;
    let top_share = per_group
        .values()
        .map(|m| *m.values().max().unwrap_or(&0) as f64 / m.values().sum::<usize>().max(1) as f64)
        .sum::<f64>()
        / groups;
    let homes: BTreeMap<&str, usize> = per_group
        .values()
        .filter_map(|m| m.iter().max_by_key(|(_, n)| **n).map(|(e, _)| *e))
        .fold(BTreeMap::new(), |mut h, e| {
            *h.entry(e).or_default() += 1;
            h
        });
    let turns = s.iter().map(|x| x.turn + 1).max().unwrap_or(0);
    let by_turn: Vec<String> = (0..turns)
        .map(|t| {
            let of: Vec<&Sample> = s.iter().copied().filter(|x| x.turn == t).collect();
            let m = summarize(&of);
            format!("turn {t}: hit {:.1} %, p50 {:.0}, p90 {:.0}, p99 {:.0} ms", m.hit, m.p50, m.p90, m.p99)
        })
        .collect();
    println!("{name}: {}", by_turn.join("; "));
    let home: BTreeMap<usize, &str> =
        per_group.iter().filter_map(|(g, m)| m.iter().max_by_key(|(_, n)| **n).map(|(e, _)| (*g, *e))).collect();
    let mut away = vec![0usize; turns];
    for x in s.iter().filter(|x| x.status == 200) {
        if home.get(&x.group).copied() != Some(x.served_by.as_deref().unwrap_or("?")) {
            away[x.turn] += 1;
        }
    }
    println!(
        "{name}: requests per engine {per_engine:?}; engines per group {engines_per_group:.2}, \
         a group's requests on its most-used engine {:.0} % (elsewhere, by turn: {away:?}), \
         groups whose most-used engine is each engine {homes:?}",
        top_share * 100.0
    );
}

/// Starts SMG in front of `engines` (the command line, SMG's defaults otherwise) and
/// waits until it answers `/readiness`. Returns the process and its base URL.
async fn start_smg(exe: &Path, engines: &[Engine], extra: &[String], work: &Path) -> Result<(ManagedProcess, String)> {
    let (port, metrics_port) = (paths::free_port()?, paths::free_port()?);
    let mut args: Vec<String> = ["launch", "--host", "127.0.0.1", "--backend", "vllm", "--policy", "cache_aware"]
        .into_iter()
        .map(String::from)
        .collect();
    args.extend(["--port".into(), port.to_string(), "--prometheus-port".into(), metrics_port.to_string()]);
    args.extend(["--prometheus-host".into(), "127.0.0.1".into(), "--log-level".into(), "warn".into()]);
    args.push("--worker-urls".into());
    args.extend(engines.iter().map(Engine::url));
    args.extend(extra.iter().cloned());
    eprintln!("{} {}", exe.display(), args.join(" "));
    let mut proc = ManagedProcess::start("smg", exe, &args, work)?;
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Ok(r) = http.get(format!("{base}/readiness")).send().await
            && r.status().is_success()
        {
            return Ok((proc, base));
        }
        if proc.pid().is_none() || Instant::now() > deadline {
            let tail = proc.log_tail(30);
            proc.kill().await;
            bail!("smg did not become ready; last log lines:\n{tail}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn fleet_spec(a: &Args, label: &str) -> FleetSpec {
    let engine_kind = if a.engine_kind == "vllm" {
        let v = VllmSpec::default();
        let blocks = a.num_gpu_blocks * 16 / v.block_size;
        // vLLM keeps one block back and refuses a model length its cache cannot hold.
        let max_model_len = v.max_model_len.min(blocks.saturating_sub(1) * v.block_size);
        EngineKind::Vllm(VllmSpec { num_gpu_blocks: Some(blocks), max_model_len, ..v })
    } else {
        EngineKind::Emulator
    };
    FleetSpec {
        label: label.into(),
        engine_kind,
        engines: a.engines,
        num_gpu_blocks: a.num_gpu_blocks,
        time_scale: a.time_scale,
        max_num_seqs: a.max_num_seqs,
        max_num_partial_prefills: a.max_num_partial_prefills,
        picker_log_level: a.picker_log_level.clone(),
        picker_replicas: a.pickers,
        ..FleetSpec::default()
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    if !(a.rate.is_finite() && a.rate > 0.0) {
        bail!("--rate must be positive, got {}", a.rate);
    }
    if a.pickers == 0 || a.smg_replicas == 0 {
        bail!("--pickers and --smg-replicas must be at least 1");
    }
    let smg = a.smg.clone().unwrap_or_else(|| paths::repo_root().join(".tools/smg/bin/smg"));
    if !a.no_smg && !smg.exists() {
        bail!("{} not found: run scripts/install-smg (or pass --smg, or --no-smg)", smg.display());
    }
    let w = Workload::multi_turn_chat(a.seed, a.groups, a.users, a.turns, a.system_words, a.user_words);
    let spec = FleetSpec { round_robin_baseline: !a.no_rr, ..fleet_spec(&a, "chat-bench") };
    let model = spec.model.clone();
    eprintln!("starting {} engines ({}), agents, picker and Envoys ...", a.engines, a.engine_kind);
    let fleet = Fleet::start(spec).await?;
    let mut runs: Vec<(&str, Vec<Sample>)> = Vec::new();
    // Prompt tokens each engine processed in a run, by its own `vllm:prompt_tokens_total`.
    let mut shares: Vec<(&str, Vec<f64>)> = Vec::new();
    eprintln!("kvroute ...");
    let before = prompt_tokens(&fleet).await;
    runs.push(("Envoy + kvroute", drive(vec![fleet.client(&fleet.gateway)?], &model, &w, &a).await?));
    shares.push(("Envoy + kvroute", token_shares(&before, &prompt_tokens(&fleet).await)));
    // The picker's own account of its decisions in that run (docs/design.md §4: pile guard,
    // pending credit withheld, stale cache routing), to explain where groups spread.
    let metrics = fleet.picker_metrics().await.unwrap_or_default();
    let counters: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            [
                "epp_routing_decisions",
                "epp_pile_guard_redirects",
                "epp_full_fleet_stays",
                "epp_pending_credit_withheld",
                "epp_stale_cache_routing",
                "epp_new_prefix_placements",
            ]
            .iter()
            .any(|n| l.starts_with(n))
        })
        .collect();
    eprintln!("kvroute picker counters: {}", counters.join("; "));
    if !a.no_smg {
        fleet.reset_prefix_caches().await?;
        let (mut procs, mut bases) = (Vec::new(), Vec::new());
        let mesh_ports: Vec<u16> = if a.smg_mesh {
            (0..a.smg_replicas).map(|_| paths::free_port()).collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        for i in 0..a.smg_replicas {
            let mut extra = a.smg_arg.clone();
            if let Some(port) = mesh_ports.get(i) {
                extra.extend(["--enable-mesh".into(), "--mesh-host".into(), "127.0.0.1".into()]);
                extra.extend(["--mesh-port".into(), port.to_string(), "--mesh-server-name".into(), format!("smg-{i}")]);
                extra.push("--mesh-peer-urls".into());
                extra.extend(mesh_ports.iter().filter(|p| *p != port).map(|p| format!("127.0.0.1:{p}")));
            }
            let (proc, base) = start_smg(&smg, &fleet.engines, &extra, &fleet.work).await?;
            procs.push(proc);
            bases.push(base);
        }
        eprintln!("SMG ({} replicas{}) ...", a.smg_replicas, if a.smg_mesh { ", mesh" } else { "" });
        let clients = bases.iter().map(|b| GatewayClient::new(b.as_str())).collect::<Result<Vec<_>>>()?;
        let before = prompt_tokens(&fleet).await;
        let samples = drive(clients, &model, &w, &a).await;
        shares.push(("SMG cache_aware", token_shares(&before, &prompt_tokens(&fleet).await)));
        for mut p in procs {
            p.kill().await;
        }
        runs.push(("SMG cache_aware", samples.context("SMG run")?));
    }
    if !a.no_rr {
        fleet.reset_prefix_caches().await?;
        eprintln!("round robin ...");
        let rr = fleet.round_robin_gateway.clone().context("round-robin gateway")?;
        let before = prompt_tokens(&fleet).await;
        runs.push(("Envoy round robin", drive(vec![fleet.client(&rr)?], &model, &w, &a).await?));
        shares.push(("Envoy round robin", token_shares(&before, &prompt_tokens(&fleet).await)));
    }
    fleet.shutdown().await;
    if a.approximate {
        eprintln!("starting a second fleet whose picker runs in approximate mode ...");
        let fleet = Fleet::start(FleetSpec { picker_approximate: true, ..fleet_spec(&a, "chat-bench-approx") }).await?;
        runs.push((
            "Envoy + kvroute, approximate mode",
            drive(vec![fleet.client(&fleet.gateway)?], &model, &w, &a).await?,
        ));
        fleet.shutdown().await;
    }
    for v in &a.variant {
        let (label, overrides) = parse_variant(v)?;
        eprintln!("starting a fleet for variant {label} ...");
        let spec = FleetSpec { picker_overrides: Some(overrides), ..fleet_spec(&a, "chat-bench-variant") };
        let fleet = Fleet::start(spec).await?;
        let name: &'static str = Box::leak(format!("Envoy + kvroute, {label}").into_boxed_str());
        runs.push((name, drive(vec![fleet.client(&fleet.gateway)?], &model, &w, &a).await?));
        fleet.shutdown().await;
    }
    if a.independent_pickers {
        eprintln!("starting a fleet whose picker replicas do not follow each other ...");
        let spec = FleetSpec {
            picker_overrides: Some(serde_json::json!({ "replicas": {} })),
            ..fleet_spec(&a, "chat-bench-independent")
        };
        let fleet = Fleet::start(spec).await?;
        runs.push((
            "Envoy + kvroute, independent replicas",
            drive(vec![fleet.client(&fleet.gateway)?], &model, &w, &a).await?,
        ));
        fleet.shutdown().await;
    }

    let words = a.groups * a.system_words + a.groups * a.users * a.turns * (a.user_words + a.reply_words);
    println!(
        "multi-turn chat, seed {}: {} system prompts × {} words, {} conversations each × {} turns ({} + {} words per turn), \
         {} output tokens, {} req/s Poisson; {} engines ({}) × {} KV blocks of 16 tokens (working set ≈ {:.1}× the fleet's at 1.1 tokens per word), \
         max {} running and {} prefilling each, time scale {}; {} picker replica(s), {} SMG replica(s){}\n",
        a.seed,
        a.groups,
        a.system_words,
        a.users,
        a.turns,
        a.user_words,
        a.reply_words,
        a.max_tokens,
        a.rate,
        a.engines,
        a.engine_kind,
        a.num_gpu_blocks,
        words as f64 * 1.1 / (f64::from(a.num_gpu_blocks) * 16.0 * a.engines as f64),
        a.max_num_seqs,
        a.max_num_partial_prefills,
        a.time_scale,
        a.pickers,
        a.smg_replicas,
        if a.smg_mesh { " in SMG's mesh" } else { "" }
    );
    println!("| router | requests | errors | cache hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let chat: Vec<(&str, Vec<&Sample>)> =
        runs.iter().map(|(n, s)| (*n, s.iter().filter(|x| !x.background).collect())).collect();
    let background: Vec<(&str, Vec<&Sample>)> =
        runs.iter().map(|(n, s)| (*n, s.iter().filter(|x| x.background).collect())).collect();
    let sums: Vec<Summary> = chat.iter().map(|(_, s)| summarize(s)).collect();
    let bg_sums: Vec<Summary> = background.iter().map(|(_, s)| summarize(s)).collect();
    for (((name, _), s), b) in runs.iter().zip(&sums).zip(&bg_sums) {
        println!(
            "| {name} | {} | {} | {:.1} % | {:.1} | {:.1} | {:.1} |",
            s.requests, s.errors, s.hit, s.p50, s.p90, s.p99
        );
        if b.requests > 0 {
            println!(
                "| {name}, background | {} | {} | {:.1} % | {:.1} | {:.1} | {:.1} |",
                b.requests, b.errors, b.hit, b.p50, b.p90, b.p99
            );
        }
    }
    println!();
    if let Some((k, others)) = sums.split_first() {
        for ((name, _), o) in runs.iter().skip(1).zip(others) {
            println!(
                "{name} ÷ kvroute (chat): TTFT p50 {:.2}×, p90 {:.2}×, p99 {:.2}×",
                o.p50 / k.p50,
                o.p90 / k.p90,
                o.p99 / k.p99
            );
        }
    }
    println!();
    for (name, s) in &chat {
        placement(name, s);
    }
    for (name, share) in &shares {
        let per: Vec<String> =
            share.iter().enumerate().map(|(i, x)| format!("engine-{i} {:.1} %", x * 100.0)).collect();
        println!("{name}: prompt tokens per engine, by the engines' own counters: {}", per.join(", "));
    }
    Ok(())
}

/// `LABEL=JSON` of `--variant`: the label and the top-level picker config keys (a JSON object).
fn parse_variant(v: &str) -> Result<(String, serde_json::Value)> {
    let (label, json) = v.split_once('=').with_context(|| format!("--variant {v:?}: want LABEL=JSON"))?;
    let overrides: serde_json::Value =
        serde_json::from_str(json).with_context(|| format!("--variant {label}: the JSON does not parse"))?;
    if !overrides.is_object() || label.is_empty() {
        bail!("--variant {v:?}: want a non-empty label and a JSON object of picker config keys");
    }
    Ok((label.to_owned(), overrides))
}

/// Every engine's `vllm:prompt_tokens_total` (0 where it cannot be read).
async fn prompt_tokens(fleet: &Fleet) -> Vec<f64> {
    let http = reqwest::Client::new();
    let mut out = Vec::with_capacity(fleet.engines.len());
    for e in &fleet.engines {
        let text = match http.get(format!("{}/metrics", e.url())).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        out.push(kvroute_harness::fleet::metric_value(&text, "vllm:prompt_tokens_total", "").unwrap_or(0.0));
    }
    out
}

/// Each engine's share of the prompt tokens counted between `before` and `after`.
fn token_shares(before: &[f64], after: &[f64]) -> Vec<f64> {
    let grown: Vec<f64> = after.iter().zip(before).map(|(a, b)| (a - b).max(0.0)).collect();
    let total: f64 = grown.iter().sum();
    grown.iter().map(|g| if total > 0.0 { g / total } else { 0.0 }).collect()
}
