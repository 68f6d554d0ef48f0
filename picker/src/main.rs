//! `kvroute-picker --config picker.yaml [--pool-name P [--pool-namespace NS]] [--log-level info]
//! [--check-config]`: load and validate the config (a pool source is required: docs/design.md
//! §14), bind the ext_proc, AgentIngest and admin listeners, print `READY` on stdout, serve until
//! SIGINT/SIGTERM. Exit codes (`kvroute_cli`, the same in every binary): 2 for a bad flag, log
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
    /// Picker configuration file (YAML).
    #[arg(long)]
    config: PathBuf,
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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let telemetry = match kvroute_common::telemetry::init(
        "kvroute-picker",
        &cli.log_level,
        &kvroute_common::telemetry::TelemetryConfig::from_env(),
    ) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvroute-picker: {e}");
            return Exit::Usage.into();
        }
    };
    let config = match PickerConfig::load(&cli.config).and_then(|mut c| {
        c.apply_pool_flags(cli.pool_name.as_deref(), cli.pool_namespace.as_deref());
        c.insecure_ingest |= cli.insecure_ingest;
        if let Some(dir) = &cli.ingest_tls_dir {
            c.ingest_tls = Some(kvroute_picker::ingest::tls::TlsFiles {
                ca_file: dir.join("ca.crt"),
                cert_file: dir.join("tls.crt"),
                key_file: dir.join("tls.key"),
            });
        }
        c.validate()?;
        c.require_pool_source()?;
        Ok(c)
    }) {
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
