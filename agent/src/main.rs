//! `kvroute-agent --config agent.yaml [--pool-name P [--pool-namespace NS]] [--gpu-source nvml|mock:<scenario.yaml>] [--log-level info]`
//! Thin: parse flags, load config, build the GPU source, start, print READY, wait for a signal.
//! Exit codes (`kvroute_cli`, the same in every binary): 2 for a bad flag, log level or config
//! (including an unreadable mock GPU scenario), 1 for a runtime failure (NVML unavailable, a
//! listener that cannot bind). `--check-config` loads and validates the config (with the flags
//! applied) and the GPU source it names, prints `config OK` and exits 0 (or 2/1).

use anyhow::Context;
use clap::Parser;
use kvroute_agent::config::{AgentConfig, GpuSourceSpec, PoolConfig};

/// kvroute node agent: engine + GPU telemetry, KV events, health, deltas to the picker.
#[derive(Parser, Debug)]
#[command(version = kvroute_cli::LONG_VERSION)]
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
    /// Report to the pickers in plaintext (local demo only; logged as a warning). Same as
    /// `insecure_ingest: true`; without it, or `picker_tls`, the agent refuses to start.
    #[arg(long)]
    insecure_ingest: bool,
    /// TLS to the pickers from a directory holding `ca.crt` (the CA bundle the picker's
    /// certificate must chain to) and, without a token, the agent's `tls.crt` and `tls.key`
    /// (certificate identity); sets the config's `picker_tls`.
    #[arg(long, conflicts_with = "insecure_ingest")]
    picker_tls_dir: Option<String>,
    /// Token identity: the projected ServiceAccount token file sent to the pickers (re-read for
    /// every connection); sets the config's `picker_token`.
    #[arg(long)]
    picker_token_file: Option<String>,
    /// Load and validate the config and its GPU source, print `config OK` and exit.
    #[arg(long)]
    check_config: bool,
}

/// A failure and the exit code it takes.
struct Failure(kvroute_cli::Exit, anyhow::Error);

trait Kind<T> {
    fn or_exit(self, kind: kvroute_cli::Exit) -> Result<T, Failure>;
}

impl<T, E: Into<anyhow::Error>> Kind<T> for Result<T, E> {
    fn or_exit(self, kind: kvroute_cli::Exit) -> Result<T, Failure> {
        self.map_err(|e| Failure(kind, e.into()))
    }
}

// One thread runs every task (scrapes, flushes, picker streams, metrics: light, mostly idle);
// KV events are decoded and applied on their own subscriber threads. A multi-thread runtime would
// start one worker per core (dozens on a GPU node) and pay cross-worker wake-ups
// (docs/decisions/0023-agent-cpu-budget.md).
#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(Failure(kind, e)) => {
            eprintln!("kvroute-agent: {}", describe(&e));
            kind.into()
        }
    }
}

/// `e` and its causes joined by ": ", skipping a cause whose text the message already holds (our
/// errors' messages name their source, so anyhow's `{:#}` printed it twice).
fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

async fn run(cli: Cli) -> Result<(), Failure> {
    use kvroute_agent::gpu::GpuError;
    use kvroute_cli::Exit::{Runtime, Usage};
    let telemetry = kvroute_common::telemetry::init(
        "kvroute-agent",
        &cli.log_level,
        &kvroute_common::telemetry::TelemetryConfig::from_env(),
    )
    .or_exit(Usage)?;
    let check_only = cli.check_config;
    let config = AgentConfig::load_with(&cli.config, |config| {
        if cli.insecure_ingest {
            config.insecure_ingest = true;
        }
        if let Some(path) = &cli.picker_token_file {
            config.picker_token = Some(kvroute_agent::config::PickerTokenConfig { token_file: path.clone() });
        }
        if let Some(dir) = &cli.picker_tls_dir {
            let file = |name: &str| std::path::Path::new(dir).join(name).display().to_string();
            let server_name = config.picker_tls.as_ref().map(|t| t.server_name.clone());
            // With a token the directory holds only the CA bundle (the picker Secret's ca.crt).
            let own = config.picker_token.is_none();
            config.picker_tls = Some(kvroute_agent::config::PickerTlsConfig {
                ca_file: file("ca.crt"),
                cert_file: own.then(|| file("tls.crt")),
                key_file: own.then(|| file("tls.key")),
                server_name: server_name.unwrap_or_else(|| kvroute_agent::config::DEFAULT_PICKER_SERVER_NAME.into()),
            });
        }
        if let Some(spec) = cli.gpu_source {
            config.gpu_source = spec;
        }
        if let Some(name) = cli.pool_name {
            let namespace = cli.pool_namespace.or_else(|| config.pool.as_ref().and_then(|p| p.namespace.clone()));
            config.pool = Some(PoolConfig { name, namespace });
            config.engines.clear();
            config.engine_file = None;
        }
    })
    .or_exit(Usage)?;
    // A mock scenario is part of the configuration; NVML missing on this host is a runtime failure.
    let gpu = kvroute_agent::gpu::from_spec(&config.gpu_source).map_err(|e| {
        let kind =
            if matches!(config.gpu_source, kvroute_agent::config::GpuSourceSpec::Mock(_)) { Usage } else { Runtime };
        Failure(kind, anyhow::Error::new::<GpuError>(e))
    })?;
    if check_only {
        println!("config OK");
        return Ok(());
    }
    let agent = kvroute_agent::app::start(config, gpu).await.context("starting agent").or_exit(Runtime)?;
    // The SIGTERM handler is in place before READY: a stop right after READY must not kill us.
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing SIGTERM handler")
        .or_exit(Runtime)?;
    println!("READY");
    wait_for_signal(term).await.or_exit(Runtime)?;
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
