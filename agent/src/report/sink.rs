//! Where KV events enter the reporting state: [`PodSink`], the [`EventSink`] the reader thread
//! (see [`crate::engine::subscriber`]) calls for one pod. It applies each batch to the pod's
//! record on the reader thread and, at the end of each read pass, sends what the pod applied as
//! one delta. So a change waits at most one `block_flush_ms` window and the tokio side is woken
//! once per window by the deltas, with no per-batch hand-off and no flush timer of its own.
//!
//! Concurrency: runs on the reader thread only; writes the pod under the pod's mutex (see
//! [`crate::report::hub`]). The sink closes when the agent drops the strong `alive` it holds a
//! weak reference to.

use crate::engine::kv_events::{KvEvent, KvMessage};
use crate::engine::subscriber::EventSink;
use crate::report::hub::Pod;
use crate::telemetry::{AgentMetrics, pod_label};
use prometheus_client::metrics::counter::Counter;
use std::sync::{Arc, Weak};

/// The agent's [`EventSink`] for one pod.
pub(crate) struct PodSink {
    pod: Arc<Pod>,
    alive: Weak<()>,
    dropped: Counter,
    block_events: Counter,
    /// Whether the engine's block size was already reported as unusable (logged once).
    warned_block_size: bool,
}

impl PodSink {
    /// A sink writing into `pod` while `alive` has a strong reference.
    pub(crate) fn new(pod: Arc<Pod>, alive: Weak<()>, metrics: &AgentMetrics) -> Self {
        let labels = pod_label(pod.name());
        let dropped = metrics.kv_blocks_dropped.get_or_create(&labels).clone();
        let block_events = metrics.kv_block_events.get_or_create(&labels).clone();
        Self { pod, alive, dropped, block_events, warned_block_size: false }
    }
}

impl EventSink for PodSink {
    fn batch(&mut self, msg: KvMessage) {
        let blocks: usize = msg
            .batch
            .events
            .iter()
            .map(|e| match e {
                KvEvent::Stored(s) => s.block_hashes.len(),
                KvEvent::Removed { block_hashes, .. } => block_hashes.len(),
                KvEvent::AllCleared | KvEvent::Untrusted(_) => 0,
            })
            .sum();
        self.block_events.inc_by(blocks as u64);
        let out = self.pod.apply_batch(&msg.batch);
        let dropped = out.dropped_unknown_parent
            + out.skipped_extra_keys
            + out.dropped_short_tokens
            + out.dropped_capacity
            + out.dropped_block_size;
        if out.dropped_block_size > 0 && !self.warned_block_size {
            self.warned_block_size = true;
            tracing::warn!(pod = %self.pod.name(), index_block_size = self.pod.index_block_size(),
                "engine block size is not a multiple of the index block size: its blocks are dropped (set the agent's index_block_size to a divisor of the engine's --block-size, equal to the pickers' block_size)");
        }
        if dropped > 0 {
            self.dropped.inc_by(dropped);
            tracing::debug!(pod = %self.pod.name(), seq = msg.seq, ?out, "blocks dropped");
        }
    }

    fn reset(&mut self, reason: &str) {
        tracing::warn!(pod = %self.pod.name(), %reason, "clearing pod blocks");
        self.pod.clear_blocks();
    }

    fn flush(&mut self) {
        self.pod.flush_blocks();
    }

    fn is_closed(&self) -> bool {
        self.alive.strong_count() == 0
    }
}

#[cfg(test)]
mod tests {
    //! The reader thread with the agent's sink, over real ZeroMQ sockets: batches of several pods
    //! published inside one window go out as one delta per pod; a gap that cannot be replayed
    //! clears the pod; the thread exits once the sinks are closed.
    use super::*;
    use crate::engine::subscriber::{self, SubscriberConfig};
    use crate::report::hub::Hub;
    use kvroute_proto::agent::v1::PodInfo;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

    /// The three frames (topic, seq, payload) of fixture batch `n` (seq = n).
    fn frames(n: usize) -> Vec<Vec<u8>> {
        let dir = format!("{}/../tests/fixtures/vllm-kv-events/v0.33", env!("CARGO_MANIFEST_DIR"));
        ["topic", "seq", "msgpack"]
            .iter()
            .map(|e| std::fs::read(format!("{dir}/batch-{n}.{e}")).expect("fixture"))
            .collect()
    }

    fn info(pod: &str) -> PodInfo {
        PodInfo { pod: pod.into(), model: MODEL.into(), block_size: 16, ..Default::default() }
    }

    /// An engine's publisher: XPUB (a PUB that also reports subscriptions) on a free port.
    struct Publisher {
        socket: zmq::Socket,
        endpoint: String,
    }

    impl Publisher {
        fn new(ctx: &zmq::Context) -> Self {
            let socket = ctx.socket(zmq::XPUB).expect("xpub");
            socket.set_rcvtimeo(10_000).expect("rcvtimeo");
            socket.bind("tcp://127.0.0.1:*").expect("bind");
            let endpoint = socket.get_last_endpoint().expect("endpoint").expect("utf-8");
            Self { socket, endpoint }
        }

        /// Blocks until a subscriber has subscribed (so nothing published after is lost).
        fn wait_subscriber(&self) {
            self.socket.recv_bytes(0).expect("a subscription within 10 s");
        }

        fn publish(&self, n: usize) {
            self.socket.send_multipart(frames(n), 0).expect("publish");
        }
    }

    /// Starts the reader on one publisher per pod of `hub`; returns the thread, the publishers,
    /// the strong `alive` of the sinks and the stop flag.
    fn start_reader(
        hub: &Hub,
        window: Duration,
        metrics: &Arc<AgentMetrics>,
    ) -> (std::thread::JoinHandle<()>, Vec<Publisher>, Arc<()>, Arc<AtomicBool>) {
        let ctx = zmq::Context::new();
        let alive = Arc::new(());
        let publishers: Vec<Publisher> = hub.pods().iter().map(|_| Publisher::new(&ctx)).collect();
        let subscriptions = hub
            .pods()
            .iter()
            .zip(&publishers)
            .map(|(pod, p)| {
                let cfg = SubscriberConfig {
                    pod: pod.name().into(),
                    kv_events: p.endpoint.clone(),
                    kv_replay: None,
                    replay_timeout: Duration::from_secs(1),
                };
                (cfg, PodSink::new(pod.clone(), Arc::downgrade(&alive), metrics))
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let reader =
            subscriber::spawn(ctx, subscriptions, window, metrics.clone(), stop.clone()).expect("reader thread");
        for p in &publishers {
            p.wait_subscriber();
        }
        (reader, publishers, alive, stop)
    }

    async fn next_delta(
        deltas: &mut tokio::sync::broadcast::Receiver<Arc<crate::report::hub::Outgoing>>,
    ) -> kvroute_proto::agent::v1::PodDelta {
        loop {
            let o = tokio::time::timeout(Duration::from_secs(5), deltas.recv()).await.expect("a delta").expect("open");
            if let crate::report::hub::Outgoing::Delta { delta, .. } = &*o {
                return delta.clone();
            }
        }
    }

    #[tokio::test]
    async fn one_window_sends_one_delta_per_pod_with_every_batch() {
        let hub = Hub::new(vec![info("a"), info("b")], 64);
        let mut deltas = hub.subscribe();
        let metrics = AgentMetrics::new();
        let (reader, publishers, alive, _stop) = start_reader(&hub, Duration::from_millis(200), &metrics);
        // Both pods' engines publish two batches, well inside one 200 ms window.
        for p in &publishers {
            p.publish(0);
            p.publish(1);
        }
        let got = [next_delta(&mut deltas).await, next_delta(&mut deltas).await];
        let mut pods: Vec<&str> = got.iter().map(|d| d.pod.as_str()).collect();
        pods.sort_unstable();
        assert_eq!(pods, ["a", "b"]);
        let events: u64 = ["a", "b"].iter().map(|p| metrics.kv_block_events.get_or_create(&pod_label(p)).get()).sum();
        // Per pod: batch 0 stores 3 blocks, batch 1 stores 2.
        assert_eq!(events, 2 * 5);
        for d in &got {
            let blocks = d.blocks.as_ref().expect("block changes");
            let stored: usize = blocks.stored.iter().map(|r| r.hashes.len()).sum();
            // Batch 0 stores A's 3 blocks, batch 1 B's 2 new ones: both in the one delta.
            assert_eq!((d.seq, stored), (1, 5), "{d:?}");
        }
        // Nothing else in that window.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(deltas.try_recv().is_err());
        // A later batch opens a new window.
        publishers[0].publish(2);
        let d = next_delta(&mut deltas).await;
        assert_eq!((d.pod.as_str(), d.seq), ("a", 2));
        assert_eq!(d.blocks.as_ref().map(|b| b.removed.len()), Some(1));
        // The sinks closed (the agent's tasks gone), the thread exits.
        drop(alive);
        tokio::task::spawn_blocking(move || reader.join().expect("reader exits cleanly")).await.expect("join");
    }

    #[tokio::test]
    async fn engines_come_and_go_on_the_running_reader() {
        let hub = Hub::new(vec![], 64);
        let mut deltas = hub.subscribe();
        let metrics = AgentMetrics::new();
        let alive = Arc::new(());
        let ctx = zmq::Context::new();
        let stop = Arc::new(AtomicBool::new(false));
        let (reader, handle) =
            subscriber::spawn_dynamic::<PodSink>(ctx.clone(), Duration::from_millis(20), metrics.clone(), stop)
                .expect("reader thread");
        // No engine: the thread idles rather than ending.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!reader.is_finished());

        let publisher = Publisher::new(&ctx);
        let pod = hub.add(info("a"));
        let cfg = SubscriberConfig {
            pod: "a".into(),
            kv_events: publisher.endpoint.clone(),
            kv_replay: None,
            replay_timeout: Duration::from_secs(1),
        };
        assert!(handle.add(cfg, PodSink::new(pod, Arc::downgrade(&alive), &metrics)));
        publisher.wait_subscriber();
        publisher.publish(0);
        let d = next_delta(&mut deltas).await;
        let stored: usize = d.blocks.as_ref().expect("blocks").stored.iter().map(|r| r.hashes.len()).sum();
        assert_eq!((d.pod.as_str(), stored), ("a", 3));

        // Removed: its SUB closes at once (the publisher sees the unsubscription).
        assert!(handle.remove("a"));
        let unsubscribe = publisher.socket.recv_bytes(0).expect("an unsubscription within 10 s");
        assert_eq!(unsubscribe.first(), Some(&0u8), "{unsubscribe:?}");
        publisher.publish(1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(metrics.kv_events_received.get_or_create(&pod_label("a")).get(), 1, "nothing read after removal");

        // The handle gone and no engine left: the thread ends.
        drop(handle);
        tokio::task::spawn_blocking(move || reader.join().expect("reader exits cleanly")).await.expect("join");
    }

    #[tokio::test]
    async fn a_gap_without_replay_clears_the_pod_and_stop_ends_the_reader() {
        let hub = Hub::new(vec![info("a")], 64);
        let mut deltas = hub.subscribe();
        let (reader, publishers, _alive, stop) = start_reader(&hub, Duration::from_millis(20), &AgentMetrics::new());
        publishers[0].publish(0);
        let d = next_delta(&mut deltas).await;
        assert!(!d.blocks.as_ref().expect("blocks").cleared, "{d:?}");
        // seq 1 lost, no replay endpoint: the record is cleared (under-claim), then batch 2
        // applies to the empty record.
        publishers[0].publish(2);
        let d = next_delta(&mut deltas).await;
        assert!(d.blocks.as_ref().expect("blocks").cleared, "{d:?}");
        assert_eq!(hub.pods()[0].snapshot().blocks.iter().map(|r| r.hashes.len()).sum::<usize>(), 0);
        stop.store(true, Ordering::Relaxed);
        tokio::task::spawn_blocking(move || reader.join().expect("reader exits cleanly")).await.expect("join");
    }
}
