//! What the node offers every engine's scrape loop: its GPUs ([`GpuSource`]), its host memory
//! ([`HostMemory`], read once for all engines) and the shared start that keeps every loop in
//! phase.
//!
//! Concurrency: shared by every scrape task through an `Arc`; [`HostMemory`] holds its
//! `parking_lot` mutex only while it reads `/proc/meminfo`, never across an `.await`.

use crate::gpu::GpuSource;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What every engine's scrape task reads from the node.
pub(crate) struct NodeSources {
    /// GPU telemetry.
    pub(crate) gpu: Arc<dyn GpuSource>,
    /// Host memory use, shared by all engines.
    pub(crate) host_memory: HostMemory,
    /// First tick of every scrape task (they tick in phase).
    pub(crate) first_scrape: tokio::time::Instant,
}

impl NodeSources {
    /// The node's sources, every scrape loop's first tick now.
    pub(crate) fn new(gpu: Arc<dyn GpuSource>) -> Self {
        Self { gpu, host_memory: HostMemory::new(), first_scrape: tokio::time::Instant::now() }
    }
}

/// The host's memory use, read at most once per `max_age` for all engines: there is one host,
/// and reading `/proc/meminfo` once per engine per scrape costs a visible share of the agent's
/// CPU under load (docs/decisions/0023-agent-cpu-budget.md).
pub(crate) struct HostMemory {
    state: parking_lot::Mutex<HostMemoryState>,
}

/// The reader (absent where sysinfo cannot read the host) and the last reading (when, used).
type HostMemoryState = (Option<sysinfo::System>, Option<(Instant, f64)>);

impl HostMemory {
    fn new() -> Self {
        Self { state: parking_lot::Mutex::new((sysinfo::System::new().ok(), None)) }
    }

    /// Used fraction of host memory (1 − available / total), at most `max_age` old; `None` when
    /// unknown.
    pub(crate) fn used(&self, max_age: Duration) -> Option<f64> {
        let mut g = self.state.lock();
        if let Some((at, used)) = g.1
            && at.elapsed() < max_age
        {
            return Some(used);
        }
        let sys = g.0.as_mut()?;
        sys.refresh_memory();
        let total = sys.total_memory();
        if total == 0 {
            return None;
        }
        let used = 1.0 - sys.available_memory() as f64 / total as f64;
        g.1 = Some((Instant::now(), used));
        Some(used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_read_once_per_max_age() {
        let host = HostMemory::new();
        let Some(first) = host.used(Duration::from_secs(3600)) else { return }; // no /proc here
        assert!((0.0..=1.0).contains(&first), "{first}");
        let at = host.state.lock().1.map(|(t, _)| t);
        // Within max_age: the same reading, not a new one.
        assert_eq!(host.used(Duration::from_secs(3600)), Some(first));
        assert_eq!(host.state.lock().1.map(|(t, _)| t), at);
        // Past max_age (zero): a fresh reading.
        host.used(Duration::ZERO);
        assert_ne!(host.state.lock().1.map(|(t, _)| t), at);
    }
}
