//! Fault injection: the switches a test flips to make this engine misbehave like a sick vLLM.
//!
//! Concurrency: one [`FaultState`] is shared by the HTTP handlers, the engine tasks and the KV-event
//! publisher thread; it is a short `parking_lot` mutex, never held across an `.await`.
//! `drop_kv_events` is a countdown consumed by the publisher, one per batch.

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// The current fault setting, as `GET /emulator/faults` returns it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Faults {
    /// `/health` answers 503.
    pub unhealthy: bool,
    /// `/health` answers 200 but completions never start (an active probe must time out).
    pub stuck: bool,
    /// Added before scheduling each request, in milliseconds (not time-scaled).
    pub extra_latency_ms: u64,
    /// The next N KV-event batches are not sent, but still consume a sequence number.
    pub drop_kv_events: u32,
    /// Streams are cut (connection aborted) after their first chunk.
    pub die_mid_stream: bool,
}

/// A `POST /emulator/faults` body: every field optional; given fields replace the current ones.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsPatch {
    /// See [`Faults::unhealthy`].
    pub unhealthy: Option<bool>,
    /// See [`Faults::stuck`].
    pub stuck: Option<bool>,
    /// See [`Faults::extra_latency_ms`].
    pub extra_latency_ms: Option<u64>,
    /// See [`Faults::drop_kv_events`].
    pub drop_kv_events: Option<u32>,
    /// See [`Faults::die_mid_stream`].
    pub die_mid_stream: Option<bool>,
}

/// Shared, mutable fault setting.
#[derive(Debug, Default)]
pub struct FaultState {
    inner: Mutex<Faults>,
}

impl FaultState {
    /// A state starting at `initial`.
    pub fn new(initial: Faults) -> Self {
        Self { inner: Mutex::new(initial) }
    }

    /// A copy of the current setting.
    pub fn get(&self) -> Faults {
        self.inner.lock().clone()
    }

    /// Applies a patch and returns the resulting setting.
    pub fn apply(&self, patch: &FaultsPatch) -> Faults {
        let mut faults = self.inner.lock();
        if let Some(v) = patch.unhealthy {
            faults.unhealthy = v;
        }
        if let Some(v) = patch.stuck {
            faults.stuck = v;
        }
        if let Some(v) = patch.extra_latency_ms {
            faults.extra_latency_ms = v;
        }
        if let Some(v) = patch.drop_kv_events {
            faults.drop_kv_events = v;
        }
        if let Some(v) = patch.die_mid_stream {
            faults.die_mid_stream = v;
        }
        faults.clone()
    }

    /// Consumes one pending KV-event drop; true when the current batch must not be sent.
    pub fn take_kv_drop(&self) -> bool {
        let mut faults = self.inner.lock();
        if faults.drop_kv_events > 0 {
            faults.drop_kv_events -= 1;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_replaces_only_given_fields_and_drops_count_down() {
        let state = FaultState::new(Faults { extra_latency_ms: 5, ..Faults::default() });
        let patch: FaultsPatch = serde_json::from_str(r#"{"unhealthy": true, "drop_kv_events": 2}"#).unwrap();
        let now = state.apply(&patch);
        assert!(now.unhealthy);
        assert_eq!(now.extra_latency_ms, 5);
        assert!(state.take_kv_drop());
        assert!(state.take_kv_drop());
        assert!(!state.take_kv_drop());
        assert!(serde_json::from_str::<FaultsPatch>(r#"{"bogus": 1}"#).is_err());
    }
}
