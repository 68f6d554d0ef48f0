//! `kvroute-emulator`: parse flags, start, print `READY http://HOST:PORT`, run until SIGINT/SIGTERM.

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use kvroute_emulator::EmulatorConfig;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = EmulatorConfig::parse();
    tracing_subscriber::fmt()
        .json()
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_new(&config.log_level).context("invalid --log-level")?)
        .init();
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
