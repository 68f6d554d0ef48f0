//! `kvroute-picker [--config picker.yaml] [--config-file plugins.yaml] [--pool-name P
//! [--pool-namespace NS]] [--grpc-port N] [--grpc-health-port N] [--metrics-port N]
//! [--log-level info] [--check-config]`: load and validate the config (a pool source is required:
//! docs/design.md §14), bind the ext_proc, gRPC health, AgentIngest and admin listeners, print
//! `READY` on stdout, serve until SIGINT/SIGTERM. GIE's EPP flags are accepted as its Helm chart
//! passes them (docs/operations.md "From GIE's inferencepool chart"): `--config-file` (an
//! `EndpointPickerConfig`, mapped by `kvroute_picker::gie`), the port flags (all interfaces,
//! flags over the files), `--pool-group`, `--zap-encoder`, `--secure-serving`. Exit codes (`kvroute_cli`, the same in every binary): 2 for a bad flag, log
//! level or config (the reason on stderr), 1 for a runtime failure (a listener cannot bind, a
//! server failed). `--check-config` loads the config and builds what it names (tokenizers,
//! scoring) without binding anything, prints `config OK` and exits 0 (or 2).
//! Traces go over OTLP gRPC when `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` is set (flushed on exit).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvroute_cli::Exit;
use kvroute_picker::config::PickerConfig;

/// mimalloc instead of glibc malloc: a decision allocates a JSON tree, the template's values and
/// strings, and `tokenizers` allocates per word; under glibc, perf showed about a third of the
/// template step in malloc/free/consolidation and page faults, and cold tokenization ran 3-6×
/// slower (`benches/decision.rs`, which links the same allocator;
/// docs/decisions/0008-picker-allocator-mimalloc.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// KV-cache-aware Envoy ext_proc endpoint picker.
#[derive(Debug, Parser)]
#[command(name = "kvroute-picker", version = kvroute_cli::LONG_VERSION)]
struct Cli {
    /// kvroute's picker configuration file (YAML). Without it the picker starts from GIE's
    /// defaults (every listener on all interfaces) or the `kvroute-picker` plugin of
    /// `--config-file`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// GIE's EPP config file: an `EndpointPickerConfig` whose scheduling profile's scorer weights
    /// map onto kvroute's (or, when its `kind` is not `EndpointPickerConfig`, a kvroute picker
    /// config).
    #[arg(long)]
    config_file: Option<PathBuf>,
    /// Log level or `tracing` filter directive (e.g. `info`, `kvroute_picker=debug,info`).
    #[arg(long, env = "EPP_LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// The InferencePool whose Ready pods are the candidates (GIE EPP flag); overrides the
    /// config's `pool` / `pool_file`.
    #[arg(long)]
    pool_name: Option<String>,
    /// The pool's namespace (GIE EPP flag). Default: the config's, else `$NAMESPACE`, else `default`.
    #[arg(long)]
    pool_namespace: Option<String>,
    /// The InferencePool's API group (GIE EPP flag); only `inference.networking.k8s.io` (v1).
    #[arg(long, default_value = "inference.networking.k8s.io")]
    pool_group: String,
    /// ext_proc gRPC port, on all interfaces (GIE EPP flag, 9002); overrides `ext_proc_addr`.
    #[arg(long)]
    grpc_port: Option<u16>,
    /// gRPC health port, on all interfaces (GIE EPP flag, 9003); overrides `health_addr`.
    #[arg(long)]
    grpc_health_port: Option<u16>,
    /// Metrics (admin HTTP) port, on all interfaces (GIE EPP flag, 9090); overrides `admin_addr`.
    #[arg(long)]
    metrics_port: Option<u16>,
    /// TLS on the ext_proc listener (GIE EPP flag). Without `--config` it defaults to true, as
    /// GIE's EPP: a self-signed certificate unless `ext_proc_tls` names one. With `--config`,
    /// `ext_proc_tls` decides unless this flag is given.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    secure_serving: Option<bool>,
    /// GIE's log encoder flag: kvroute logs JSON lines either way.
    #[arg(long, value_parser = ["json", "console"])]
    zap_encoder: Option<String>,
    /// GIE's log level flag (`debug`, `info`, `error`, ...); overrides `--log-level`.
    #[arg(long)]
    zap_log_level: Option<String>,
    /// GIE's log verbosity (`-v N`): up to 2 is `info`, 3 and 4 `debug`, 5 and more `trace`;
    /// overrides `--log-level`, not `--zap-log-level`.
    #[arg(short = 'v', long = "v")]
    verbosity: Option<u8>,
    /// GIE's engine-metric flags (its chart passes them for Triton): kvroute's agents read the
    /// engines, so they are accepted and not applied.
    #[arg(long, hide = true)]
    total_queued_requests_metric: Option<String>,
    #[arg(long, hide = true)]
    kv_cache_usage_percentage_metric: Option<String>,
    #[arg(long, hide = true)]
    lora_info_metric: Option<String>,
    /// Accept agents over plaintext, unauthenticated (local demo only; logged as a warning).
    /// Same as `insecure_ingest: true`; without it, or `ingest_tls`, the picker refuses to start.
    #[arg(long)]
    insecure_ingest: bool,
    /// mTLS on the ingest listener from a directory holding `ca.crt`, `tls.crt` and `tls.key` (a
    /// mounted cert-manager Secret); sets the config's `ingest_tls`.
    #[arg(long, conflicts_with = "insecure_ingest")]
    ingest_tls_dir: Option<PathBuf>,
    /// Load and validate the config (and the tokenizers and scoring it names), print `config OK`
    /// and exit without serving.
    #[arg(long)]
    check_config: bool,
}

/// The log filter: `--zap-log-level`, else GIE's `-v` verbosity (GIE's levels: 2 default, 4
/// debug, 5 trace), else `--log-level`.
fn log_level(cli: &Cli) -> String {
    if let Some(level) = &cli.zap_log_level {
        return level.clone();
    }
    match cli.verbosity {
        Some(0..=2) => "info".into(),
        Some(3..=4) => "debug".into(),
        Some(_) => "trace".into(),
        None => cli.log_level.clone(),
    }
}

/// The only InferencePool group kvroute watches (`inference.networking.k8s.io/v1`).
const POOL_GROUP: &str = "inference.networking.k8s.io";

/// Builds the config from the files and flags (flags win over the files).
fn load_config(cli: &Cli) -> Result<PickerConfig, kvroute_picker::config::ConfigError> {
    if cli.config.is_none() && cli.config_file.is_none() && cli.pool_name.is_none() {
        return Err(kvroute_picker::config::ConfigError::Invalid(kvroute_common::config::InvalidField::new(
            "--config",
            "(none)",
            "pass --config picker.yaml, or GIE's --pool-name (with --config-file)",
        )));
    }
    if cli.pool_group != POOL_GROUP {
        return Err(kvroute_picker::config::ConfigError::Invalid(kvroute_common::config::InvalidField::new(
            "--pool-group",
            &cli.pool_group,
            format!("kvroute watches InferencePools of {POOL_GROUP} (v1) only"),
        )));
    }
    let (mut c, warnings) = kvroute_picker::gie::load_with(cli.config.as_deref(), cli.config_file.as_deref())?;
    for w in &warnings {
        tracing::warn!(config_file = ?cli.config_file, "EndpointPickerConfig: {w}");
    }
    if cli.zap_encoder.as_deref() == Some("console") {
        tracing::info!("--zap-encoder console: kvroute logs JSON lines either way");
    }
    for (flag, value) in [
        ("--total-queued-requests-metric", &cli.total_queued_requests_metric),
        ("--kv-cache-usage-percentage-metric", &cli.kv_cache_usage_percentage_metric),
        ("--lora-info-metric", &cli.lora_info_metric),
    ] {
        if value.is_some() {
            tracing::warn!(flag, "not applied: kvroute's agents read the engines' state");
        }
    }
    c.apply_pool_flags(cli.pool_name.as_deref(), cli.pool_namespace.as_deref());
    c.apply_port_flags(cli.grpc_port, cli.grpc_health_port, cli.metrics_port);
    c.insecure_ingest |= cli.insecure_ingest;
    if let Some(dir) = &cli.ingest_tls_dir {
        c.ingest_tls = Some(kvroute_picker::ingest::tls::TlsFiles {
            ca_file: dir.join("ca.crt"),
            cert_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
        });
    }
    let secure = cli.secure_serving.unwrap_or(cli.config.is_none() && c.ext_proc_tls.is_none());
    match (secure, c.ext_proc_tls.is_some()) {
        (true, false) => c.ext_proc_tls = Some(kvroute_picker::gie::self_signed_ext_proc_tls()?),
        (false, true) if cli.secure_serving == Some(false) => c.ext_proc_tls = None,
        _ => {}
    }
    c.validate()?;
    c.require_pool_source()?;
    Ok(c)
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let telemetry = match kvroute_common::telemetry::init(
        "kvroute-picker",
        &log_level(&cli),
        &kvroute_common::telemetry::TelemetryConfig::from_env(),
    ) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvroute-picker: {e}");
            return Exit::Usage.into();
        }
    };
    let config = match load_config(&cli) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "refusing to start");
            eprintln!("kvroute-picker: {e}");
            return Exit::Usage.into();
        }
    };
    if cli.check_config {
        // What start() builds before binding: the pool, router (scoring) and models (tokenizers).
        return match kvroute_picker::gateway::Gateway::new(&config) {
            Ok(_) => {
                println!("config OK");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvroute-picker: {e}");
                Exit::Usage.into()
            }
        };
    }
    // Descriptors for the ext_proc connection cap and a reserve for the rest (limits.rs).
    let nofile = kvroute_picker::limits::raise_nofile_limit();
    tracing::debug!(nofile, "RLIMIT_NOFILE soft limit");
    let running = match kvroute_picker::start(&config).await {
        Ok(r) => r,
        Err(e @ kvroute_picker::StartError::InsecureIngest { .. }) => {
            tracing::error!(error = %e, "refusing to start");
            eprintln!("kvroute-picker: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            tracing::error!(error = %e, "refusing to start");
            eprintln!("kvroute-picker: {e}");
            return match e {
                // Files named in the config that cannot be read (pool file, TLS material, the
                // /explain token) are config errors too.
                kvroute_picker::server::StartError::Gateway(_)
                | kvroute_picker::server::StartError::Pool(_)
                | kvroute_picker::server::StartError::Tls { .. }
                | kvroute_picker::server::StartError::ExplainToken { .. } => Exit::Usage.into(),
                _ => Exit::Runtime.into(),
            };
        }
    };
    running.gateway.metrics.set_build_info(kvroute_cli::GIT_COMMIT, kvroute_cli::VERSION);
    // The SIGTERM handler is in place before READY: a stop right after READY must not kill us.
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let mut out = std::io::stdout();
    let _ = writeln!(out, "READY");
    let _ = out.flush();

    let stopper = async {
        #[cfg(unix)]
        shutdown_signal(term).await;
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down");
    };
    tokio::pin!(stopper);
    let shutdown = running.shutdown_handle();
    let drainer = running.drain_handle();
    let drain = std::time::Duration::from_millis(config.shutdown_drain_ms);
    let wait = running.wait();
    tokio::pin!(wait);
    let result = tokio::select! {
        r = &mut wait => r,
        () = &mut stopper => {
            // NOT_SERVING first, still answering: Envoy's health checks move new streams to the
            // other replicas; then close (open streams finish).
            drainer.drain().await;
            tokio::time::sleep(drain).await;
            shutdown.shutdown();
            // Open streams get STREAM_CLOSE_GRACE to finish; a peer that keeps its stream open
            // (an agent that ignores GOAWAY) must not keep the process from exiting.
            match tokio::time::timeout(STREAM_CLOSE_GRACE, &mut wait).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(grace_ms = STREAM_CLOSE_GRACE.as_millis() as u64,
                        "open streams did not finish after shutdown; exiting anyway");
                    Ok(())
                }
            }
        }
    };
    telemetry.shutdown().await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "picker stopped");
            eprintln!("kvroute-picker: {e}");
            Exit::Runtime.into()
        }
    }
}

/// SIGINT or `term` (SIGTERM, registered by the caller; `None` if that failed: SIGINT only).
#[cfg(unix)]
/// How long open streams may take to finish once the listeners stopped (after the drain).
const STREAM_CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

async fn shutdown_signal(term: Option<tokio::signal::unix::Signal>) {
    match term {
        Some(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
