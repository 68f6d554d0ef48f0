//! Shared machinery of the watchers: a local copy of one kube-runtime `watcher` stream (a
//! reflector store that swaps its contents whole when a relist completes), the retry backoff,
//! counters, and publication of immutable snapshots through a `tokio::sync::watch` channel.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
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
    last_error: Mutex<Option<String>>,
}

impl WatchStats {
    /// The last error seen, if any.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    pub(crate) fn error(&self, what: &str, e: &dyn std::fmt::Display) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let msg = format!("{what}: {e}");
        tracing::warn!(watch = what, error = %e, "watch error; retrying");
        *self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(msg);
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

/// The retry backoff of the watchers: exponential from 200 ms to 30 s, factor 2, each delay drawn
/// uniformly from its upper half; reset by any successful event. (kube's default starts at 800 ms;
/// a relist after `410 Gone` is routine, and routing should follow the pool within about a second.)
pub struct WatchBackoff {
    next: Duration,
    seed: u64,
}

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

impl Default for WatchBackoff {
    fn default() -> Self {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1;
        Self { next: BACKOFF_MIN, seed }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        // xorshift64: jitter only, no need for a cryptographic source.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let upper = self.next;
        let frac = 0.5 + (self.seed % 1000) as f64 / 2000.0;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        Some(upper.mul_f64(frac))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = BACKOFF_MIN;
    }
}

/// A kube-runtime watcher stream with the watchers' backoff.
pub(crate) fn watch_stream<K>(
    api: kube::Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = watcher::Result<watcher::Event<K>>> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    watcher(api, config).backoff(WatchBackoff::default())
}

/// A local copy of one watch: objects by name; a relist fills a buffer that replaces the copy
/// whole at its end (so a relist after `410 Gone` also forgets objects deleted meanwhile).
#[derive(Debug)]
pub(crate) struct Cache<K> {
    pub(crate) live: BTreeMap<String, K>,
    filling: Option<BTreeMap<String, K>>,
    /// A list has completed at least once.
    pub(crate) listed: bool,
}

impl<K> Default for Cache<K> {
    fn default() -> Self {
        Self { live: BTreeMap::new(), filling: None, listed: false }
    }
}

impl<K: Resource> Cache<K> {
    /// Applies one watcher event; returns whether `live` or `listed` may have changed.
    pub(crate) fn apply(&mut self, event: watcher::Event<K>, stats: &WatchStats) -> bool {
        stats.events.fetch_add(1, Ordering::Relaxed);
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
}
