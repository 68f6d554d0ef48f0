//! `kvroute-sim`: runs the routing-quality simulation and writes tables and charts.
//! See `docs/benchmarks.md` for the commands that regenerate the published numbers.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_sim::engine::CostModel;
use kvroute_sim::sim::SimConfig;
use kvroute_sim::workload::{self, SharedPrefixConfig, Workload};
use kvroute_sim::{policy, report, sim};

#[derive(Parser, Debug)]
#[command(name = "kvroute-sim", about = "Discrete-event routing-quality simulation on kvroute's real router")]
struct Args {
    /// Workloads, comma-separated: shared-prefix, chat, herd, lora, zipf, `all`, or `none` (only
    /// the `--trace` files).
    #[arg(long, default_value = "all", value_delimiter = ',')]
    workload: Vec<String>,
    /// JSONL trace files to run as extra workloads (see workload::trace for the format).
    #[arg(long)]
    trace: Vec<PathBuf>,
    /// Policies, comma-separated, or `all`.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    policies: Vec<String>,
    /// Pods in the fleet.
    #[arg(long, default_value_t = 8)]
    pods: usize,
    /// Engine cost model: 8b or 70b (docs/design.md §4: 0.9 s / 8.2 s prefill per 4096 tokens on A100).
    #[arg(long, default_value = "8b")]
    model: String,
    /// KV capacity per pod, tokens.
    #[arg(long, default_value_t = 450_000)]
    kv_tokens: usize,
    /// KV capacity per pod the approximate policies assume, tokens (default: `--kv-tokens`, i.e.
    /// a perfect guess).
    #[arg(long)]
    approx_capacity_tokens: Option<usize>,
    /// Delay from an engine read to the router seeing it, ms.
    #[arg(long, default_value_t = 20)]
    report_delay_ms: u64,
    /// Shared-prefix stage rates, req/s (rising).
    #[arg(long, default_value = "2,4,6,8,10", value_delimiter = ',')]
    rates: Vec<f64>,
    /// Shared-prefix stage length, simulated seconds.
    #[arg(long, default_value_t = 60.0)]
    stage_s: f64,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where tables (`tables.md`) and charts (`<workload>.svg`) go.
    #[arg(long, default_value = "target/sim")]
    out: PathBuf,
}

fn workloads(a: &Args) -> anyhow::Result<Vec<Workload>> {
    let all = a.workload.iter().any(|w| w == "all");
    let want = |n: &str| all || a.workload.iter().any(|w| w == n);
    let mut v = Vec::new();
    if want("shared-prefix") {
        let cfg =
            SharedPrefixConfig { rates_rps: a.rates.clone(), stage_s: a.stage_s, ..SharedPrefixConfig::default() };
        v.push(workload::shared_prefix(&cfg, a.seed, 16));
    }
    if want("chat") {
        v.push(workload::chat(300, 5, 2.0, a.seed, 16));
    }
    if want("herd") {
        v.push(workload::herd(5, 64, 4096, a.seed, 16));
    }
    if want("lora") {
        v.push(workload::lora(16, 8.0, 120.0, a.seed, 16));
    }
    if want("zipf") {
        v.push(workload::zipf_prefixes(2000, 12.0, 120.0, a.seed, 16));
    }
    for t in &a.trace {
        v.push(workload::trace(t, 16)?);
    }
    for w in &a.workload {
        if !matches!(w.as_str(), "all" | "none" | "shared-prefix" | "chat" | "herd" | "lora" | "zipf") {
            anyhow::bail!(
                "unknown workload '{w}': use shared-prefix, chat, herd, lora, zipf, all or none (traces via --trace)"
            );
        }
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
    cost.kv_capacity_blocks = a.kv_tokens / 16;
    let cfg = SimConfig { pods: a.pods, cost, report_delay_us: a.report_delay_ms * 1000, ..SimConfig::default() };
    let policies: Vec<String> = if a.policies.iter().any(|p| p == "all") {
        policy::ALL.iter().map(|s| s.to_string()).collect()
    } else {
        a.policies.clone()
    };
    let loads = workloads(&a)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let total: u64 = loads.iter().map(|w| w.requests.len() as u64).sum::<u64>() * policies.len() as u64;
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut md = String::new();
    for w in &loads {
        let mut rows = Vec::new();
        for p in &policies {
            pb.set_message(format!("{} / {p}", w.name));
            let approx_blocks = a.approx_capacity_tokens.map_or(cfg.cost.kv_capacity_blocks, |t| t / 16);
            let mut pol = policy::build(p, cfg.pods, approx_blocks, a.seed)?;
            let run = sim::run(w, pol.as_mut(), &cfg, Some(&pb))?;
            rows.push(report::summarize(&run, w.stages.len()));
        }
        let t = report::table(w, &rows);
        pb.println(&t);
        md.push_str(&t);
        md.push('\n');
        let svg = a.out.join(format!("{}.svg", w.name));
        report::chart(w, &rows, &svg)?;
        md.push_str(&format!("Chart: `{}`\n\n", svg.display()));
    }
    pb.finish_and_clear();
    let path = a.out.join("tables.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {} and the charts beside it", path.display());
    Ok(())
}
