//! Frozen engines (docs/decisions/0043-frozen-engines.md): an engine that stops answering with
//! requests in flight (SIGSTOP, a wedged process; its kernel still accepts and ACKs, so neither
//! Envoy's connect nor TCP keepalive notices) would hold them until the route's 600 s timeout.
//!
//! [`watch_engines`] probes every pod that has requests in flight with `GET /health` (any HTTP
//! status counts as an answer) every `limits.frozen_engine_ms / 4` (at most 1 s); a pod whose
//! engine has not answered for `limits.frozen_engine_ms` is frozen: it is marked unreachable
//! here and on the peer replicas (as for Envoy's connect failure), and [`FrozenPods`] tells its
//! ext_proc streams, which end their requests with a 503 immediate response (Envoy resets the
//! upstream request). The mark clears when the engine answers the unreachable probe again.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::pool::Pool;

/// The pods found frozen in the last probe round, for the ext_proc streams routed to them.
#[derive(Debug)]
pub struct FrozenPods {
    tx: watch::Sender<Arc<HashSet<Arc<str>>>>,
    after: Duration,
}

impl FrozenPods {
    /// No pod frozen yet; a pod counts as frozen after `after` without an answer.
    pub fn new(after: Duration) -> Self {
        Self { tx: watch::channel(Arc::default()).0, after }
    }

    /// How long a busy engine may stay silent (`limits.frozen_engine_ms`).
    pub fn after(&self) -> Duration {
        self.after
    }

    /// A receiver that changes whenever the set does.
    pub fn subscribe(&self) -> watch::Receiver<Arc<HashSet<Arc<str>>>> {
        self.tx.subscribe()
    }

    /// Whether `pod` is frozen now.
    pub fn contains(&self, pod: &str) -> bool {
        self.tx.borrow().contains(pod)
    }

    /// Replaces the set (receivers are woken only when it changed).
    fn set(&self, pods: HashSet<Arc<str>>) {
        self.tx.send_if_modified(|cur| {
            if **cur == pods {
                return false;
            }
            *cur = Arc::new(pods);
            true
        });
    }
}

/// The probe period for `frozen_after`: a quarter of it, at most 1 s, at least 50 ms.
pub fn probe_period(frozen_after: Duration) -> Duration {
    (frozen_after / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// Probes the engines of `pool`'s pods with requests in flight until `stop` resolves (see the
/// module doc): each round's frozen pods go to `frozen`, and each is passed to `mark` (which marks
/// it unreachable here and on the peers).
pub async fn watch_engines(
    pool: Arc<Pool>,
    frozen: Arc<FrozenPods>,
    mark: impl Fn(&Arc<str>),
    stop: impl std::future::Future<Output = ()>,
) {
    let frozen_after = frozen.after();
    let every = probe_period(frozen_after);
    let mut silent_since: HashMap<Arc<str>, Instant> = HashMap::new();
    let rounds = async {
        loop {
            tokio::time::sleep(every).await;
            let busy: Vec<(Arc<str>, String)> =
                pool.pods().into_iter().filter(|p| p.in_flight > 0).map(|p| (Arc::from(p.name), p.endpoint)).collect();
            let probes = busy.iter().map(|(_, endpoint)| crate::pool::answers_http(endpoint, every));
            let answers = futures::future::join_all(probes).await;
            let now = Instant::now();
            let mut still_silent = HashMap::with_capacity(silent_since.len());
            let mut now_frozen = HashSet::new();
            for ((name, endpoint), answered) in busy.into_iter().zip(answers) {
                if answered {
                    continue;
                }
                let since = silent_since.get(&name).copied().unwrap_or(now);
                if now.duration_since(since) + every >= frozen_after {
                    if !frozen.contains(&name) {
                        tracing::warn!(pod = %name, %endpoint, silent_ms = now.duration_since(since).as_millis() as u64,
                            "engine answers nothing with requests in flight: frozen; its requests get 503");
                    }
                    mark(&name);
                    now_frozen.insert(name.clone());
                }
                still_silent.insert(name, since);
            }
            silent_since = still_silent;
            frozen.set(now_frozen);
        }
    };
    tokio::select! {
        () = rounds => {}
        () = stop => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn period_and_set() {
        assert_eq!(probe_period(Duration::from_secs(5)), Duration::from_secs(1));
        assert_eq!(probe_period(Duration::from_millis(400)), Duration::from_millis(100));
        assert_eq!(probe_period(Duration::from_millis(1)), Duration::from_millis(50));
        let f = FrozenPods::new(Duration::from_secs(5));
        let mut rx = f.subscribe();
        assert!(!f.contains("a"));
        f.set(HashSet::from([Arc::from("a")]));
        assert!(rx.has_changed().unwrap() && f.contains("a"));
        rx.borrow_and_update();
        f.set(HashSet::from([Arc::from("a")]));
        assert!(!rx.has_changed().unwrap(), "the same set wakes nobody");
    }
}
