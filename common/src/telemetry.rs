//! Logging set-up shared by every kvroute binary: structured JSON lines on stderr through
//! `tracing`, level from a flag or the binary's environment variable (e.g. `EPP_LOG_LEVEL`).

use tracing_subscriber::{EnvFilter, fmt};

/// Installs the global JSON subscriber. `level` is an `EnvFilter` directive such as `info` or
/// `kvroute_picker=debug,info`; an invalid directive falls back to `info` and says so.
/// Calling it twice is harmless (the second call is ignored).
pub fn init_logging(level: &str) {
    let (filter, bad) = match EnvFilter::try_new(level) {
        Ok(f) => (f, false),
        Err(_) => (EnvFilter::new("info"), true),
    };
    let _ = fmt()
        .json()
        .with_current_span(false)
        .with_target(true)
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .try_init();
    if bad {
        tracing::warn!(level, "invalid log level directive, using info");
    }
}
