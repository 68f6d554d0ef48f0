//! `kvroute-agent --config agent.yaml [--pool-name P [--pool-namespace NS]] [--gpu-source nvml|mock:<scenario.yaml>] [--log-level info]`
//! Thin: parse flags, load config, build the GPU source, start, print READY, wait for a signal.

use anyhow::Context;
use clap::Parser;
use kvroute_agent::config::{AgentConfig, GpuSourceSpec, PoolConfig};

/// kvroute node agent: engine + GPU telemetry, KV events, health, deltas to the picker.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Agent config file (YAML).
    #[arg(long)]
    config: String,
    /// GPU telemetry source, overrides the config: `nvml` or `mock:<scenario.yaml>`.
    #[arg(long)]
    gpu_source: Option<GpuSourceSpec>,
    /// The InferencePool whose pods on this node (`$NODE_NAME`) are the engines (the GIE EPP's
    /// flag); sets the config's `pool`, replacing its engine source.
    #[arg(long)]
    pool_name: Option<String>,
    /// The pool's namespace (the GIE EPP's flag). Default: the config's, else `$NAMESPACE`,
    /// else `default`.
    #[arg(long, requires = "pool_name")]
    pool_namespace: Option<String>,
    /// Log level or EnvFilter directive.
    #[arg(long, env = "AGENT_LOG_LEVEL", default_value = "info")]
    log_level: String,
}

// One thread runs every task (scrapes, flushes, picker streams, metrics: light, mostly idle);
// KV events are decoded and applied on their own subscriber threads. A multi-thread runtime would
// start one worker per core (dozens on a GPU node) and pay cross-worker wake-ups (issue 5).
#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let telemetry = kvroute_common::telemetry::init(
        "kvroute-agent",
        &cli.log_level,
        &kvroute_common::telemetry::TelemetryConfig::from_env(),
    )?;
    let config = AgentConfig::load_with(&cli.config, |config| {
        if let Some(spec) = cli.gpu_source {
            config.gpu_source = spec;
        }
        if let Some(name) = cli.pool_name {
            let namespace = cli.pool_namespace.or_else(|| config.pool.as_ref().and_then(|p| p.namespace.clone()));
            config.pool = Some(PoolConfig { name, namespace });
            config.engines.clear();
            config.engine_file = None;
        }
    })?;
    let gpu = kvroute_agent::gpu::from_spec(&config.gpu_source)?;
    let agent = kvroute_agent::app::start(config, gpu).await.context("starting agent")?;
    // The SIGTERM handler is in place before READY: a stop right after READY must not kill us.
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing SIGTERM handler")?;
    println!("READY");
    wait_for_signal(term).await?;
    agent.shutdown().await;
    telemetry.shutdown().await;
    Ok(())
}

/// SIGINT or SIGTERM (`term`, registered by the caller; Kubernetes stops pods with SIGTERM).
async fn wait_for_signal(mut term: tokio::signal::unix::Signal) -> anyhow::Result<()> {
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for ctrl-c")?,
        _ = term.recv() => {}
    }
    Ok(())
}
