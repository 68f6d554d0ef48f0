//! `kvroute-emulator`: parse flags, start, print `READY http://HOST:PORT`, run until SIGINT/SIGTERM.
//! Exit codes as every kvroute binary (`kvroute_cli`): 2 for a bad flag or log level, 1 for a
//! runtime failure (a listener that cannot bind).

use std::io::Write;

use clap::Parser;
use kvroute_emulator::EmulatorConfig;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = EmulatorConfig::parse();
    let filter = match EnvFilter::try_new(&config.log_level) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("kvroute-emulator: invalid --log-level {:?}: {e}", config.log_level);
            return kvroute_cli::Exit::Usage.into();
        }
    };
    tracing_subscriber::fmt().json().with_writer(std::io::stderr).with_env_filter(filter).init();
    match run(config).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-emulator: {e:#}");
            kvroute_cli::Exit::Runtime.into()
        }
    }
}

async fn run(config: EmulatorConfig) -> anyhow::Result<()> {
    let running = kvroute_emulator::start(config).await?;
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "READY http://{}", running.http_addr)?;
        stdout.flush()?;
    }
    shutdown_signal().await;
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the emulator");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
