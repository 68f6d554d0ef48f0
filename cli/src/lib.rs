//! What every kvroute binary shares on its command line: the version string and the exit codes.
//! A crate of its own (with the build script that reads the commit) so that a new commit
//! recompiles only this and the binaries' `main`, not the libraries.
//!
//! Exit codes (the same kind of error exits the same way in every binary; README "Command line"):
//!
//! | code | meaning |
//! |------|---------|
//! | 0 | success (served until SIGINT/SIGTERM, `--check-config` passed, `--help`, `--version`) |
//! | 1 | runtime failure: a listener cannot bind, a server or connection failed, a run's check failed |
//! | 2 | usage or configuration error: bad flag (clap's own code), unreadable or invalid config, bad log level |

use std::process::ExitCode;

/// Crate version (the workspace's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Git commit the binary was built from (12 hex digits; `unknown` without git;
/// `KVROUTE_GIT_COMMIT` at build time overrides it).
pub const GIT_COMMIT: &str = env!("KVROUTE_GIT_COMMIT");
/// `--version` text: `0.1.0 (commit 0123456789ab)`.
pub const LONG_VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("KVROUTE_GIT_COMMIT"), ")");

/// Exit code of a runtime failure.
pub const EXIT_RUNTIME: u8 = 1;
/// Exit code of a usage or configuration error (clap uses 2 for bad flags too).
pub const EXIT_USAGE: u8 = 2;

/// The kind of failure a binary exits with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Usage or configuration error: [`EXIT_USAGE`].
    Usage,
    /// Runtime failure: [`EXIT_RUNTIME`].
    Runtime,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> Self {
        ExitCode::from(match e {
            Exit::Usage => EXIT_USAGE,
            Exit::Runtime => EXIT_RUNTIME,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_names_the_commit() {
        assert!(LONG_VERSION.starts_with(VERSION));
        assert!(LONG_VERSION.contains(&format!("(commit {GIT_COMMIT})")));
        assert!(!GIT_COMMIT.is_empty());
    }
}
