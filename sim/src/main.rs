//! `kvroute-sim`: runs the routing-quality simulation and writes tables and charts.
//! See `docs/benchmarks.md` for the commands that regenerate the published numbers.
//!
//! Tables go to stdout (also when it is piped) and to `<out>/tables.md` (one table per seed) and
//! `<out>/summary.md` (seeds side by side); charts to `<out>/<workload>.svg|png` (first seed).

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvroute_sim::engine::CostModel;
use kvroute_sim::sim::{GpuUtilization, SimConfig};
use kvroute_sim::workload::{self, SharedPrefixConfig, Workload};
use kvroute_sim::{policy, report, sim};

/// The seed's workloads (`classic`) and the ones with their own fleet (`december`: replicas,
/// KV size and warm-up per workload, docs/design.md §10).
const CLASSIC: [&str; 5] = ["shared-prefix", "chat", "herd", "lora", "zipf"];
const DECEMBER: [&str; 6] = ["w1", "w2", "pressure", "cold-start", "llm-d", "background"];
/// Workloads that reproduce an end-to-end benchmark's stream and fleet (`chat-groups`: the
/// multi-turn chat bench's; `all` includes them).
const ISSUE16: [&str; 1] = ["chat-groups"];
/// llm-d's shape: rates rising past the cache-aware policies' saturation (random's is ≈ 6 req/s).
const LLMD_RATES: [f64; 7] = [4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0];

#[derive(Parser, Debug)]
#[command(version = kvroute_cli::LONG_VERSION, name = "kvroute-sim", about = "Discrete-event routing-quality simulation on kvroute's real router")]
struct Args {
    /// Workloads, comma-separated: shared-prefix, chat, herd, lora, zipf (`classic`), w1, w2,
    /// pressure, cold-start, llm-d, background (`december`, docs/design.md §10), chat-groups (the end-to-end
    /// chat benchmark's stream and fleet), `all`, or `none` (only the `--trace` files).
    #[arg(long, default_value = "all", value_delimiter = ',')]
    workload: Vec<String>,
    /// JSONL trace files to run as extra workloads (see workload::trace for the format).
    #[arg(long)]
    trace: Vec<PathBuf>,
    /// Policies, comma-separated, or `all`.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    policies: Vec<String>,
    /// Pods in the fleet. Default: the workload's (chat-groups: 4), else 8.
    #[arg(long)]
    pods: Option<usize>,
    /// Engine cost model: 8b or 70b (docs/design.md §4: 0.9 s / 8.2 s prefill per 4096 tokens on A100).
    #[arg(long, default_value = "8b")]
    model: String,
    /// KV capacity per pod, tokens. Default: the workload's (W1, W2, llm-d: 307 328; pressure:
    /// 100 000), else 450 000.
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// Router (picker) replicas; requests go to them in turn. Default: the workload's (W1 and cold
    /// start: 3), else 1.
    #[arg(long)]
    routers: Option<usize>,
    /// kvroute replicas do not share pending chains and in-flight counts (by default they do,
    /// over the replica stream, as deploy/ configures them).
    #[arg(long)]
    independent_replicas: bool,
    /// Scoring fields (JSON object) laid over every kvroute policy's preset, as in the picker's
    /// `scoring:` section, e.g. `{"pile_guard_margin": 0}`.
    #[arg(long)]
    kvroute_scoring: Option<String>,
    /// Delay of the replica stream between kvroute replicas, ms.
    #[arg(long, default_value_t = 1.0)]
    peer_delay_ms: f64,
    /// Share of requests sent straight to a random pod, bypassing the routers (left out of the
    /// figures).
    #[arg(long, default_value_t = 0.0)]
    direct_share: f64,
    /// Every this many seconds one pod (in turn) empties its prefix cache; 0 = never.
    #[arg(long, default_value_t = 0.0)]
    cache_reset_interval_s: f64,
    /// Estimated-cache capacity per pod of the approximate policies, in 64-character chunks
    /// (GIE's default 31 250 ≈ 500k tokens; never told of evictions).
    #[arg(long, default_value_t = policy::GIE_CAPACITY_BLOCKS)]
    approx_capacity_blocks: usize,
    /// Requests running at once per pod (vLLM `max_num_seqs`). Default: the workload's
    /// (chat-groups: 16), else 256.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// What pods report as GPU utilization: `busy` (default: the share of time since the
    /// previous read spent in engine steps, as NVML counts it: ≈ 1 for any pod that is stepping)
    /// or `running` (running requests ÷ max-num-seqs, the emulator's former mock rule).
    #[arg(long, default_value = "busy")]
    gpu_utilization: String,
    /// Tokens per engine step (vLLM `max_num_batched_tokens`, chunked prefill).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Delay from an engine read to the routers seeing it, ms.
    #[arg(long, default_value_t = 20)]
    report_delay_ms: u64,
    /// Stage rates of shared-prefix and llm-d, req/s (rising). Default 2,4,6,8,10 (shared-prefix)
    /// and 4,8,…,28 (llm-d: to the cache-aware policies' saturation). chat-groups takes the
    /// first (default 12, the end-to-end benchmark's near-saturation rate).
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Stage length of shared-prefix and llm-d, simulated seconds.
    #[arg(long, default_value_t = 60.0)]
    stage_s: f64,
    /// Workload seeds, comma-separated; each runs every policy.
    #[arg(long, default_value = "1", value_delimiter = ',')]
    seeds: Vec<u64>,
    /// Also write every request's outcome to `<out>/<workload>-<policy>-seed<N>.csv` (arrival,
    /// router, pod, session, group, stage, prompt and cached tokens, TTFT, finish).
    #[arg(long)]
    dump_requests: bool,
    /// Also write every kvroute decision, with its best candidates' factors, to
    /// `<out>/<workload>-<policy>-seed<N>-decisions.csv` (see `policy::DECISIONS_CSV_HEADER`).
    #[arg(long)]
    dump_decisions: bool,
    /// Also write every pod's stats reads (waiting, running, KV usage, preemptions so far) to
    /// `<out>/<workload>-<policy>-seed<N>-pods.csv`.
    #[arg(long)]
    dump_pods: bool,
    /// Where tables (`tables.md`, `summary.md`) and charts go.
    #[arg(long, default_value = "target/sim")]
    out: PathBuf,
}

fn workloads(a: &Args, seed: u64) -> anyhow::Result<Vec<Workload>> {
    let mut names: Vec<&str> = Vec::new();
    for w in &a.workload {
        match w.as_str() {
            "all" => names.extend(CLASSIC.iter().chain(DECEMBER.iter()).chain(ISSUE16.iter())),
            "classic" => names.extend(CLASSIC),
            "december" => names.extend(DECEMBER),
            "none" => {}
            other if CLASSIC.contains(&other) || DECEMBER.contains(&other) || ISSUE16.contains(&other) => {
                names.push(other)
            }
            other => anyhow::bail!(
                "unknown workload '{other}': use {}, {}, {}, classic, december, all or none (traces via --trace)",
                CLASSIC.join(", "),
                DECEMBER.join(", "),
                ISSUE16.join(", ")
            ),
        }
    }
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(*n));
    let rates =
        |default: &'static [f64]| -> Vec<f64> { if a.rates.is_empty() { default.to_vec() } else { a.rates.clone() } };
    let mut v = Vec::new();
    for n in names {
        v.push(match n {
            "shared-prefix" => {
                let cfg = SharedPrefixConfig {
                    stages: workload::staged(&rates(&[2.0, 4.0, 6.0, 8.0, 10.0]), a.stage_s),
                    ..SharedPrefixConfig::default()
                };
                workload::shared_prefix(&cfg, seed, 16)
            }
            "chat" => workload::chat(300, 5, 2.0, seed, 16),
            "herd" => workload::herd(5, 64, 4096, seed, 16),
            "lora" => workload::lora(16, 8.0, 120.0, seed, 16),
            "zipf" => workload::zipf_prefixes(2000, 12.0, 120.0, seed, 16),
            "w1" => workload::w1(seed, 16),
            "w2" => workload::w2(seed, 16),
            "pressure" => workload::pressure(seed, 16),
            "cold-start" => workload::cold_start(seed, 16),
            "background" => workload::background(seed, 16),
            "chat-groups" => workload::chat_groups(a.rates.first().copied().unwrap_or(12.0), seed, 16),
            _ => workload::llmd(&workload::staged(&rates(&LLMD_RATES), a.stage_s), seed, 16),
        });
    }
    for t in &a.trace {
        v.push(workload::trace(t, 16)?);
    }
    Ok(v)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut cost = match a.model.as_str() {
        "8b" => CostModel::llama_8b(),
        "70b" => CostModel::llama_70b(),
        m => anyhow::bail!("unknown --model '{m}': use 8b or 70b"),
    };
    cost.max_num_batched_tokens = a.max_num_batched_tokens;
    let gpu_utilization = match a.gpu_utilization.as_str() {
        "running" => GpuUtilization::Running,
        "busy" => GpuUtilization::Busy,
        g => anyhow::bail!("unknown --gpu-utilization '{g}': use running or busy"),
    };
    if !(0.0..=1.0).contains(&a.direct_share) {
        anyhow::bail!("--direct-share must be in [0, 1], got {}", a.direct_share);
    }
    if a.seeds.is_empty() {
        anyhow::bail!("--seeds needs at least one seed");
    }
    let policies: Vec<String> = if a.policies.iter().any(|p| p == "all") {
        policy::ALL.iter().map(|s| s.to_string()).collect()
    } else {
        a.policies.clone()
    };
    for p in &policies {
        if !policy::ALL.contains(&p.as_str()) {
            anyhow::bail!("unknown policy '{p}'; known: {}", policy::ALL.join(", "));
        }
    }
    let overlay: Option<serde_json::Map<String, serde_json::Value>> = match &a.kvroute_scoring {
        None => None,
        Some(text) => Some(serde_json::from_str(text).context("--kvroute-scoring must be a JSON object")?),
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut per_seed: Vec<Vec<Workload>> = a.seeds.iter().map(|s| workloads(&a, *s)).collect::<Result<_, _>>()?;
    if let Some(r) = a.routers {
        per_seed.iter_mut().flatten().for_each(|w| w.set_routers(r.max(1)));
    }
    let total: u64 = per_seed.iter().flatten().map(|w| w.requests.len() as u64).sum::<u64>() * policies.len() as u64;
    let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (mut tables, mut summary) = (String::new(), String::new());
    let first: &[Workload] = per_seed.first().map_or(&[], Vec::as_slice);
    for (wi, w0) in first.iter().enumerate() {
        let mut runs: Vec<Vec<report::Summary>> = Vec::new();
        for (si, seed) in a.seeds.iter().enumerate() {
            let w = &per_seed[si][wi];
            let kv_tokens = a.kv_tokens.or(w.fleet.kv_tokens).unwrap_or(450_000);
            let routers = a.routers.or(w.fleet.routers).unwrap_or(1).max(1);
            let mut c = cost.clone();
            c.kv_capacity_blocks = kv_tokens / 16;
            c.max_batch = a.max_num_seqs.or(w.fleet.max_num_seqs).unwrap_or(256).max(1);
            let cfg = SimConfig {
                pods: a.pods.or(w.fleet.pods).unwrap_or(8).max(1),
                cost: c,
                report_delay_us: a.report_delay_ms * 1000,
                peer_delay_us: (a.peer_delay_ms * 1000.0) as u64,
                direct_share: a.direct_share,
                cache_reset_interval_us: (a.cache_reset_interval_s * 1e6) as u64,
                seed: *seed,
                gpu_utilization,
                ..SimConfig::default()
            };
            let mut rows = Vec::new();
            for p in &policies {
                pb.set_message(format!("{} seed {seed} / {p}", w.name));
                let mut replicas = (0..routers)
                    .map(|r| {
                        let opts = policy::PolicyOptions {
                            approx_capacity_blocks: a.approx_capacity_blocks,
                            seed: seed.wrapping_mul(1000) + r as u64,
                            shared_view: !a.independent_replicas,
                            scoring_overlay: overlay.clone(),
                            record_decisions: a.dump_decisions,
                        };
                        policy::build(p, cfg.pods, &opts)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let run = sim::run(w, &mut replicas, &cfg, Some(&pb))?;
                let decisions: Vec<String> = replicas.iter_mut().flat_map(|r| r.take_decisions()).collect();
                if a.dump_decisions && !decisions.is_empty() {
                    let path = a.out.join(format!("{}-{p}-seed{seed}-decisions.csv", w.name));
                    let text =
                        std::iter::once(policy::DECISIONS_CSV_HEADER.to_string()).chain(decisions).collect::<String>();
                    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
                }
                if a.dump_requests {
                    let path = a.out.join(format!("{}-{p}-seed{seed}.csv", w.name));
                    std::fs::write(&path, report::outcomes_csv(&run))
                        .with_context(|| format!("writing {}", path.display()))?;
                }
                if a.dump_pods {
                    let path = a.out.join(format!("{}-{p}-seed{seed}-pods.csv", w.name));
                    std::fs::write(&path, report::pod_samples_csv(&run))
                        .with_context(|| format!("writing {}", path.display()))?;
                }
                rows.push(report::summarize(&run, w.stages.len()));
            }
            let fleet = format!(
                "Seed {seed}; {} pods × {kv_tokens} KV tokens, {} running per pod, {routers} router replica{}{}{}.\n\n",
                cfg.pods,
                cfg.cost.max_batch,
                if routers == 1 { "" } else { "s" },
                if a.direct_share > 0.0 {
                    format!(", {:.0} % of requests straight to pods", a.direct_share * 100.0)
                } else {
                    String::new()
                },
                if a.cache_reset_interval_s > 0.0 {
                    format!(", a pod's cache reset every {} s", a.cache_reset_interval_s)
                } else {
                    String::new()
                },
            );
            tables.push_str(&report::table(w, &rows).replacen("\n\n", &format!("\n\n{fleet}"), 1));
            tables.push('\n');
            if si == 0 {
                let files = report::charts(w, &rows, &a.out.join(&w.name))?;
                let list: Vec<String> = files.iter().map(|f| format!("`{}`", f.display())).collect();
                tables.push_str(&format!("Charts: {}\n\n", list.join(", ")));
            }
            runs.push(rows);
        }
        let t = report::seeds_table(w0, &a.seeds, &runs);
        pb.suspend(|| println!("{t}"));
        summary.push_str(&t);
        summary.push('\n');
    }
    pb.finish_and_clear();
    for (name, text) in [("tables.md", &tables), ("summary.md", &summary)] {
        let path = a.out.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!(
        "wrote {} and {} and the charts beside them",
        a.out.join("tables.md").display(),
        a.out.join("summary.md").display()
    );
    Ok(())
}
