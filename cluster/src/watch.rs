//! Shared machinery of the watchers: a local copy of one kube-runtime `watcher` stream (a
//! reflector store that swaps its contents whole when a relist completes), the retry backoff,
//! counters, and publication of immutable snapshots through a `tokio::sync::watch` channel.
//!
//! Errors are logged once: the first error of a run of identical ones is a WARN naming the
//! resource (kind, group/version, namespace), repeats go to DEBUG, and the first progress after
//! errors is an INFO "recovered". A resource the API refuses as not installed (404) or not
//! permitted (403) is retried on the slow timer ([`SLOW_RETRY`]): only an operator's action
//! brings it back.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// Counters of one watcher task (for metrics, logs and tests).
#[derive(Debug, Default)]
pub struct WatchStats {
    /// Watch events applied (objects added, changed, removed, relist markers).
    pub events: AtomicU64,
    /// Errors from the API (each followed by a backed-off retry).
    pub errors: AtomicU64,
    /// Completed (re)lists: 1 after the first sync, +1 per relist after a `410 Gone` or restart.
    pub lists: AtomicU64,
    /// Snapshots published.
    pub published: AtomicU64,
    /// Log lines at WARN this watcher wrote (one per run of identical errors of a resource).
    pub warnings: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Resources whose last outcome was an error → that error (a watcher may follow several).
    failing: Mutex<BTreeMap<String, String>>,
}

impl WatchStats {
    /// The last error seen, if any.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Counts an error of the watch of `what` (the resource, named for the log) and logs it at
    /// WARN with `note` unless it repeats the previous error with no progress in between.
    pub(crate) fn error_noted(&self, what: &str, e: &dyn std::fmt::Display, note: &str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let msg = format!("{what}: {e}");
        let mut failing = self.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let repeat = failing.insert(what.to_owned(), msg.clone()).is_some_and(|m| m == msg);
        drop(failing);
        if repeat {
            tracing::debug!(resource = what, error = %e, "watch error again");
        } else {
            self.warnings.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(resource = what, error = %e, "{note}");
        }
        *self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(msg);
    }

    /// [`WatchStats::error_noted`] with the usual note (retried with backoff).
    pub(crate) fn error(&self, what: &str, e: &dyn std::fmt::Display) {
        self.error_noted(what, e, "watch error; retrying with backoff (repeats are logged at debug)");
    }

    /// The watch of `what` delivered data: after errors, logs that it recovered.
    pub(crate) fn progressed(&self, what: &str) {
        let was = self.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(what);
        if let Some(last_error) = was {
            tracing::info!(resource = what, last_error, "watch recovered");
        }
    }
}

/// How a watcher names its resource in logs and errors: `Kind group/version in namespace ns`
/// (`Pod v1 in namespace ns` for the core group).
pub(crate) fn resource_name<K: Resource<DynamicType = ()>>(namespace: &str) -> String {
    let (kind, group, version) = (K::kind(&()), K::group(&()), K::version(&()));
    if group.is_empty() {
        format!("{kind} {version} in namespace {namespace}")
    } else {
        format!("{kind} {group}/{version} in namespace {namespace}")
    }
}

/// A snapshot type published by a watcher.
pub trait Snapshot: Debug + Send + Sync + 'static {
    /// Equal but for the generation.
    fn same_content(&self, other: &Self) -> bool;
    /// Sets the generation.
    fn set_generation(&mut self, generation: u64);
    /// The generation.
    fn generation(&self) -> u64;
}

/// Implements [`Snapshot`] for a type with `same_content(&self, &Self)` and a `generation: u64`
/// field. Each snapshot's own module invokes it, so this module names none of them: the concrete
/// sources depend on the generic watcher, never the other way round.
macro_rules! snapshot_impl {
    ($t:ty) => {
        impl $crate::watch::Snapshot for $t {
            fn same_content(&self, other: &Self) -> bool {
                <$t>::same_content(self, other)
            }
            fn set_generation(&mut self, generation: u64) {
                self.generation = generation;
            }
            fn generation(&self) -> u64 {
                self.generation
            }
        }
    };
}
pub(crate) use snapshot_impl;

/// The receiving side of a watcher: the latest snapshot, change notification, counters.
/// The watcher task runs while any receiver (this handle or a clone of [`Watched::subscribe`])
/// is alive.
#[derive(Debug, Clone)]
pub struct Watched<T> {
    rx: watch::Receiver<Arc<T>>,
    stats: Arc<WatchStats>,
}

impl<T: Snapshot> Watched<T> {
    pub(crate) fn new(rx: watch::Receiver<Arc<T>>, stats: Arc<WatchStats>) -> Self {
        Self { rx, stats }
    }

    /// The latest snapshot (cheap: an `Arc` clone).
    pub fn current(&self) -> Arc<T> {
        self.rx.borrow().clone()
    }

    /// A receiver of every new snapshot.
    pub fn subscribe(&self) -> watch::Receiver<Arc<T>> {
        self.rx.clone()
    }

    /// Counters of the watcher task.
    pub fn stats(&self) -> &Arc<WatchStats> {
        &self.stats
    }

    /// Waits until a snapshot satisfies `pred` (checking the current one first), or `timeout`.
    /// Returns that snapshot, or `None` on timeout or when the watcher stopped.
    pub async fn wait_for(&self, timeout: Duration, mut pred: impl FnMut(&T) -> bool) -> Option<Arc<T>> {
        let mut rx = self.rx.clone();
        tokio::time::timeout(timeout, async move {
            loop {
                let snap = rx.borrow_and_update().clone();
                if pred(&snap) {
                    return Some(snap);
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        })
        .await
        .ok()
        .flatten()
    }
}

/// Publishes a snapshot when its content differs from the last one, with the next generation.
pub(crate) struct Publisher<T> {
    tx: watch::Sender<Arc<T>>,
    stats: Arc<WatchStats>,
}

impl<T: Snapshot> Publisher<T> {
    /// A publisher starting from `initial` (generation 0), and its receiving side.
    pub(crate) fn new(initial: T) -> (Self, Watched<T>) {
        let stats = Arc::new(WatchStats::default());
        let (tx, rx) = watch::channel(Arc::new(initial));
        (Self { tx, stats: stats.clone() }, Watched::new(rx, stats))
    }

    pub(crate) fn stats(&self) -> &Arc<WatchStats> {
        &self.stats
    }

    /// Publishes `next` if it differs from the current snapshot; returns whether it did.
    pub(crate) fn publish(&self, mut next: T) -> bool {
        let current = self.tx.borrow().clone();
        if next.same_content(&current) {
            return false;
        }
        next.set_generation(current.generation() + 1);
        self.tx.send_replace(Arc::new(next));
        self.stats.published.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Resolves when every receiver is gone (the task should stop).
    pub(crate) async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// The retry backoff of the watchers: exponential from 200 ms, factor 2, each delay drawn
/// uniformly from its upper half, capped at 30 s, or at [`SLOW_RETRY`] while the API answers
/// 404 (resource not installed) or 403 (not permitted); reset by data (listed objects, changes),
/// never by the `Init` marker kube-runtime emits before each list attempt (a reset there kept a
/// failing list at the first step: about 6 lists a second, for ever). kube's default starts at
/// 800 ms; a relist after `410 Gone` is routine, and routing should follow the pool within about
/// a second.
///
/// Cloning shares the state: [`watch_stream`] resets and caps it from the events it sees.
#[derive(Clone)]
pub struct WatchBackoff(Arc<Mutex<BackoffState>>);

struct BackoffState {
    next: Duration,
    cap: Duration,
    seed: u64,
}

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Longest wait between lists of a resource the API refuses as not installed (404) or not
/// permitted (403): 5 minutes. Installing the CRD or granting RBAC takes effect within it.
pub const SLOW_RETRY: Duration = Duration::from_secs(300);

impl Default for WatchBackoff {
    fn default() -> Self {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1;
        Self(Arc::new(Mutex::new(BackoffState { next: BACKOFF_MIN, cap: BACKOFF_MAX, seed })))
    }
}

impl WatchBackoff {
    fn state(&self) -> std::sync::MutexGuard<'_, BackoffState> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Back to the first step and the usual cap.
    pub fn restart(&self) {
        let mut s = self.state();
        s.next = BACKOFF_MIN;
        s.cap = BACKOFF_MAX;
    }

    /// Caps the delays at [`SLOW_RETRY`] (`slow`) or 30 s.
    pub fn set_slow(&self, slow: bool) {
        self.state().cap = if slow { SLOW_RETRY } else { BACKOFF_MAX };
    }
}

impl std::fmt::Debug for WatchBackoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        f.debug_struct("WatchBackoff").field("next", &s.next).field("cap", &s.cap).finish()
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let mut s = self.state();
        // xorshift64: jitter only, no need for a cryptographic source.
        s.seed ^= s.seed << 13;
        s.seed ^= s.seed >> 7;
        s.seed ^= s.seed << 17;
        let upper = s.next.min(s.cap);
        let frac = 0.5 + (s.seed % 1000) as f64 / 2000.0;
        s.next = (upper * 2).min(s.cap);
        Some(upper.mul_f64(frac))
    }
}

/// The backoff as `StreamBackoff` drives it: its `reset` (called on every `Ok` item, the `Init`
/// marker included) does nothing; [`watch_stream`] resets on data instead.
struct ResetOnData(WatchBackoff);

impl Iterator for ResetOnData {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        self.0.next()
    }
}

impl Backoff for ResetOnData {
    fn reset(&mut self) {}
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.restart();
    }
}

/// Whether the API refused the resource itself: 404 (its type is not installed) or 403 (this
/// service account may not read it), answers that only an operator's action changes.
pub(crate) fn refused(e: &watcher::Error) -> Option<u16> {
    let code = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code,
        watcher::Error::WatchError(s) => s.code,
        _ => return None,
    };
    matches!(code, 403 | 404).then_some(code)
}

/// A kube-runtime watcher stream with the watchers' backoff (see [`WatchBackoff`]).
pub(crate) fn watch_stream<K>(
    api: kube::Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = watcher::Result<watcher::Event<K>>> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let backoff = WatchBackoff::default();
    let control = backoff.clone();
    watcher(api, config)
        .inspect(move |ev| match ev {
            Ok(watcher::Event::Init) => {}
            Ok(_) => control.restart(),
            Err(e) => control.set_slow(refused(e).is_some()),
        })
        .backoff(ResetOnData(backoff))
}

/// A local copy of one watch: objects by name; a relist fills a buffer that replaces the copy
/// whole at its end (so a relist after `410 Gone` also forgets objects deleted meanwhile).
#[derive(Debug)]
pub(crate) struct Cache<K> {
    pub(crate) live: BTreeMap<String, K>,
    filling: Option<BTreeMap<String, K>>,
    /// A list has completed at least once.
    pub(crate) listed: bool,
    /// The resource, as [`WatchStats`] names it in its logs.
    resource: String,
}

impl<K> Default for Cache<K> {
    fn default() -> Self {
        Self::of(String::new())
    }
}

impl<K> Cache<K> {
    /// An empty copy of the watch of `resource` (its name in logs, [`resource_name`]).
    pub(crate) fn of(resource: String) -> Self {
        Self { live: BTreeMap::new(), filling: None, listed: false, resource }
    }
}

impl<K: Resource> Cache<K> {
    /// Applies one watcher event; returns whether `live` or `listed` may have changed.
    pub(crate) fn apply(&mut self, event: watcher::Event<K>, stats: &WatchStats) -> bool {
        stats.events.fetch_add(1, Ordering::Relaxed);
        if !matches!(event, watcher::Event::Init) {
            stats.progressed(&self.resource);
        }
        let name = |o: &K| o.meta().name.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => {
                self.filling = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(o) => {
                let n = name(&o);
                self.filling.get_or_insert_with(BTreeMap::new).insert(n, o);
                false
            }
            watcher::Event::InitDone => {
                self.live = self.filling.take().unwrap_or_default();
                self.listed = true;
                stats.lists.fetch_add(1, Ordering::Relaxed);
                true
            }
            watcher::Event::Apply(o) => {
                self.live.insert(name(&o), o);
                true
            }
            watcher::Event::Delete(o) => {
                self.live.remove(&name(&o));
                true
            }
        }
    }
}

/// Drops `metadata.managedFields` (large, unused) before an object is cached.
pub(crate) fn slim<K: Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot of the generic machinery's own: content and readiness, compared without the
    /// generation, as every source's snapshot is.
    #[derive(Debug, Clone, Default)]
    struct View {
        content: Vec<u32>,
        synced: bool,
        generation: u64,
    }

    impl View {
        fn same_content(&self, other: &Self) -> bool {
            self.content == other.content && self.synced == other.synced
        }
    }

    snapshot_impl!(View);

    #[test]
    fn publisher_sends_only_changes_with_the_next_generation() {
        let (p, w) = Publisher::new(View::default());
        let mut v = View { content: vec![1], synced: true, generation: 0 };
        assert!(p.publish(v.clone()));
        assert_eq!(w.current().generation, 1);
        v.generation = 77;
        assert!(!p.publish(v.clone()), "same content, other generation: not a change");
        v.synced = false;
        assert!(p.publish(v));
        assert_eq!((w.current().generation, w.current().synced), (2, false));
        assert_eq!(w.stats().published.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn backoff_grows_to_its_cap_and_resets() {
        let mut b = WatchBackoff::default();
        let first = b.next().unwrap();
        assert!(first >= BACKOFF_MIN / 2 && first <= BACKOFF_MIN, "{first:?}");
        let late = (0..20).filter_map(|_| b.next()).last().unwrap();
        assert!(late >= BACKOFF_MAX / 2 && late <= BACKOFF_MAX, "{late:?}");
        b.reset();
        assert!(b.next().unwrap() <= BACKOFF_MIN);
    }

    #[test]
    fn slow_backoff_climbs_to_the_slow_timer_and_only_data_resets_it() {
        let b = WatchBackoff::default();
        b.set_slow(true);
        let mut driven = ResetOnData(b.clone());
        let late = (0..30).filter_map(|_| driven.next()).last().unwrap();
        assert!(late >= SLOW_RETRY / 2 && late <= SLOW_RETRY, "{late:?}");
        // StreamBackoff resets on every Ok item, kube-runtime's Init marker included: no effect.
        driven.reset();
        assert!(driven.next().unwrap() >= SLOW_RETRY / 2);
        b.restart();
        assert!(driven.next().unwrap() <= BACKOFF_MIN);
    }

    #[test]
    fn repeated_errors_warn_once_until_progress() {
        let stats = WatchStats::default();
        for _ in 0..5 {
            stats.error("Thing x/v1 in namespace ns", &"404 not found");
        }
        assert_eq!((stats.errors.load(Ordering::Relaxed), stats.warnings.load(Ordering::Relaxed)), (5, 1));
        stats.error("Thing x/v1 in namespace ns", &"500 other");
        assert_eq!(stats.warnings.load(Ordering::Relaxed), 2, "a different error is logged");
        stats.progressed("Thing x/v1 in namespace ns");
        stats.error("Thing x/v1 in namespace ns", &"500 other");
        assert_eq!(stats.warnings.load(Ordering::Relaxed), 3, "the same error after a recovery is logged");
        assert!(stats.last_error().unwrap().contains("Thing x/v1 in namespace ns"));
        // Two resources failing in turn (one watcher, two CRDs) are each logged once.
        for _ in 0..4 {
            stats.error("A", &"404");
            stats.error("B", &"404");
        }
        assert_eq!(stats.warnings.load(Ordering::Relaxed), 5);
    }
}
