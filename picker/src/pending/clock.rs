//! Where routing takes its time from: the wall clock in a running picker, a clock the caller moves
//! in the simulator and in tests, so that time-to-live rules replay faithfully.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};

/// A source of "now" in milliseconds since the Unix epoch. Pending entries expire by it
/// (docs/design.md §3), and in-flight reservations are stamped with it, to be compared with the
/// agents' `observed_at_unix_ms` (docs/design.md §4 queueDepth).
pub trait Clock: Send + Sync + fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_unix_ms(&self) -> i64;
}

/// The system's wall clock (what a running picker uses).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_unix_ms(&self) -> i64 {
        crate::pool::now_unix_ms()
    }
}

/// A clock that only moves when told to (simulation, tests). Starts at the given instant.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock reading `unix_ms`.
    pub fn new(unix_ms: i64) -> Self {
        ManualClock(AtomicI64::new(unix_ms))
    }

    /// Sets the time (it may go backwards: callers own the clock).
    pub fn set(&self, unix_ms: i64) {
        self.0.store(unix_ms, Ordering::Release);
    }

    /// Moves the time forward by `ms`.
    pub fn advance(&self, ms: i64) {
        self.0.fetch_add(ms, Ordering::AcqRel);
    }
}

impl Clock for ManualClock {
    fn now_unix_ms(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }
}
