//! The picker's Prometheus metrics (docs/design.md §9), through `prometheus-client`.
//!
//! Request-path metrics are updated by the ext_proc tasks through handles created once at start
//! (atomics; no allocation except a label set's first use). Pod metrics (`epp_queue_depth`,
//! `epp_pod_health_score`) and index size are computed at scrape time from `Pool::pods()` and
//! `Pool::index_stats()`, so a pod that left the pool also leaves the scrape.
//!
//! prometheus-client appends `_total` to counter names itself: counters are registered without it.

use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use std::sync::atomic::Ordering;

use crate::pending::SharedView;
use crate::pool::Pool;
use crate::replicas::ReplicaCounters;

/// `{model}` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// Client-facing model name.
    pub model: String,
}

/// `{adapter}` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdapterLabel {
    /// LoRA adapter name.
    pub adapter: String,
}

/// `{pod}` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabel {
    /// Pod name.
    pub pod: String,
}

/// `{source}` label of `epp_cache_credit_blocks_total`: `index` (KV events) or `pending`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// Where the credited blocks came from.
    pub source: &'static str,
}

/// `{outcome}` label of `epp_pending_chains_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `recorded`, `recorded_from_peer`, `confirmed`, `expired`, `evicted`.
    pub outcome: &'static str,
}

/// `{result}` label of `epp_replica_events_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `applied` or `refused`.
    pub result: &'static str,
}

/// `{code}` label: HTTP status the picker answered itself.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// HTTP status code.
    pub code: u16,
}

/// Latency bucket bounds in microseconds: the 1-2-5 series from `lo` to `hi` inclusive
/// (1, 2, 5, 10, 20, 50, …). It puts bounds exactly on docs/design.md §9 thresholds (1000 µs
/// "should stay below", 5000 µs alert), so `histogram_quantile` is exact at those points.
pub fn one_two_five_buckets(lo: f64, hi: f64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut decade = lo;
    while decade <= hi {
        for m in [1.0, 2.0, 5.0] {
            let b = decade * m;
            if b <= hi {
                out.push(b);
            }
        }
        decade *= 10.0;
    }
    out
}

/// Every metric the picker exports, registered once.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `epp_routing_decisions_total{model}`: requests routed.
    pub routing_decisions: Family<ModelLabel, Counter>,
    /// `epp_cache_match_ratio`: the chosen pod's match ratio, [0,1] (0.1 steps, plus 0.95; the
    /// 0.4 bound is docs/design.md §9 alert threshold).
    pub cache_match_ratio: Histogram,
    /// `epp_scoring_latency_us`: time in `Router::route`, microseconds (1-2-5 buckets, 1 µs–100 ms).
    pub scoring_latency_us: Histogram,
    /// `epp_decision_latency_us`: body parse + tokenize + hash + route, microseconds (1-2-5
    /// buckets, 10 µs–2 s: tokenizing a multi-MB prompt takes hundreds of ms).
    pub decision_latency_us: Histogram,
    /// `epp_composite_score`: the chosen pod's composite score, [0,1] (0.05 steps).
    pub composite_score: Histogram,
    /// `epp_candidate_pods`: candidates scored in the last decision.
    pub candidate_pods: Gauge,
    /// `epp_stale_cache_routing_total`: engine's cached tokens fell short of the prediction.
    pub stale_cache_routing: Counter,
    /// `epp_adapter_loads_triggered_total{adapter}`: routed to a pod not running the adapter.
    pub adapter_loads_triggered: Family<AdapterLabel, Counter>,
    /// `epp_request_errors_total{code}`: requests the picker answered itself (400/404/413/429/503).
    pub request_errors: Family<CodeLabel, Counter>,
    queue_depth: Family<PodLabel, Gauge>,
    pod_health_score: Family<PodLabel, Gauge<f64, AtomicU64>>,
    prefix_tree_nodes: Gauge,
    prefix_index_entries: Gauge,
    prefix_index_bytes: Gauge,
    max_queue: Gauge,
    cache_credit_blocks: Family<SourceLabel, Counter>,
    pending_chains: Family<OutcomeLabel, Counter>,
    pending_entries: Gauge,
    pile_guard_redirects: Counter,
    replica_events: Family<ResultLabel, Counter>,
    replica_peers: Gauge,
    replica_disconnects: Counter,
    replica_lagged: Counter,
    scrape: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let routing_decisions = Family::<ModelLabel, Counter>::default();
        let cache_match_ratio = Histogram::new([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]);
        let scoring_latency_us = Histogram::new(one_two_five_buckets(1.0, 100_000.0));
        let decision_latency_us = Histogram::new(one_two_five_buckets(10.0, 2_000_000.0));
        let composite_score = Histogram::new((1..=20).map(|i| f64::from(i) * 0.05));
        let candidate_pods = Gauge::default();
        let stale_cache_routing = Counter::default();
        let adapter_loads_triggered = Family::<AdapterLabel, Counter>::default();
        let request_errors = Family::<CodeLabel, Counter>::default();
        let queue_depth = Family::<PodLabel, Gauge>::default();
        let pod_health_score = Family::<PodLabel, Gauge<f64, AtomicU64>>::default();
        let prefix_tree_nodes = Gauge::default();
        let prefix_index_entries = Gauge::default();
        let prefix_index_bytes = Gauge::default();
        let max_queue = Gauge::default();
        let cache_credit_blocks = Family::<SourceLabel, Counter>::default();
        let pending_chains = Family::<OutcomeLabel, Counter>::default();
        let pending_entries = Gauge::default();
        let pile_guard_redirects = Counter::default();
        let replica_events = Family::<ResultLabel, Counter>::default();
        let replica_peers = Gauge::default();
        let replica_disconnects = Counter::default();
        let replica_lagged = Counter::default();
        registry.register(
            "epp_cache_credit_blocks",
            "Blocks credited to chosen pods, by source: the KV-event index, or pending (routed, not yet confirmed)",
            cache_credit_blocks.clone(),
        );
        registry.register(
            "epp_pending_chains",
            "Pending chains recorded (here or from a peer replica) and how their life ended",
            pending_chains.clone(),
        );
        registry.register("epp_pending_entries", "(block, pod) pending entries held", pending_entries.clone());
        registry.register(
            "epp_pile_guard_redirects",
            "Decisions the pile guard sent to the least loaded candidate",
            pile_guard_redirects.clone(),
        );
        registry.register("epp_replica_events", "Peer replicas' events, applied or refused", replica_events.clone());
        registry.register("epp_replica_peers", "Peer replicas followed now", replica_peers.clone());
        registry.register(
            "epp_replica_disconnects",
            "Subscriptions to peer replicas that ended",
            replica_disconnects.clone(),
        );
        registry.register(
            "epp_replica_subscribers_lagged",
            "Subscribers cut off for falling behind this replica's events",
            replica_lagged.clone(),
        );

        registry.register("epp_routing_decisions", "Requests routed, by model", routing_decisions.clone());
        registry.register("epp_cache_match_ratio", "Chosen pod's prefix match ratio", cache_match_ratio.clone());
        registry.register("epp_scoring_latency_us", "Scoring and selection time (µs)", scoring_latency_us.clone());
        registry.register(
            "epp_decision_latency_us",
            "Body parse, tokenization, hashing and routing time (µs)",
            decision_latency_us.clone(),
        );
        registry.register("epp_composite_score", "Chosen pod's composite score", composite_score.clone());
        registry.register("epp_candidate_pods", "Candidate pods in the last decision", candidate_pods.clone());
        registry.register(
            "epp_stale_cache_routing",
            "Requests whose engine-reported cached tokens fell more than a block short of the prediction",
            stale_cache_routing.clone(),
        );
        registry.register(
            "epp_adapter_loads_triggered",
            "Requests routed to a pod not running their LoRA adapter",
            adapter_loads_triggered.clone(),
        );
        registry.register(
            "epp_request_errors",
            "Requests answered by the picker with an error",
            request_errors.clone(),
        );
        registry.register("epp_queue_depth", "Pod queue depth (waiting + routed since report)", queue_depth.clone());
        registry.register("epp_pod_health_score", "Pod health score [0,1]", pod_health_score.clone());
        registry.register("epp_prefix_tree_nodes", "Distinct blocks in the prefix index", prefix_tree_nodes.clone());
        registry.register(
            "epp_prefix_index_entries",
            "(block, pod) entries in the prefix index",
            prefix_index_entries.clone(),
        );
        registry.register(
            "epp_prefix_index_bytes",
            "Estimated prefix index memory (bytes)",
            prefix_index_bytes.clone(),
        );
        registry.register(
            "epp_max_queue",
            "Configured maxQueue: a pod at or above it is not a candidate (alert threshold base)",
            max_queue.clone(),
        );
        Self {
            registry,
            routing_decisions,
            cache_match_ratio,
            scoring_latency_us,
            decision_latency_us,
            composite_score,
            candidate_pods,
            stale_cache_routing,
            adapter_loads_triggered,
            request_errors,
            queue_depth,
            pod_health_score,
            prefix_tree_nodes,
            prefix_index_entries,
            prefix_index_bytes,
            max_queue,
            cache_credit_blocks,
            pending_chains,
            pending_entries,
            pile_guard_redirects,
            replica_events,
            replica_peers,
            replica_disconnects,
            replica_lagged,
            scrape: Mutex::new(()),
        }
    }

    /// Refreshes the pool-derived metrics and the configured `max_queue` (requests), and encodes
    /// everything in the OpenMetrics text format.
    pub fn render(&self, pool: &Pool, max_queue: u32) -> Result<String, std::fmt::Error> {
        let _one_scrape_at_a_time = self.scrape.lock();
        self.max_queue.set(i64::from(max_queue));
        self.queue_depth.clear();
        self.pod_health_score.clear();
        for p in pool.pods() {
            let label = PodLabel { pod: p.name };
            self.queue_depth.get_or_create(&label).set(i64::from(p.queue_depth));
            self.pod_health_score.get_or_create(&label).set(p.health_score);
        }
        let stats = pool.index_stats();
        self.prefix_tree_nodes.set(i64::try_from(stats.nodes).unwrap_or(i64::MAX));
        self.prefix_index_entries.set(i64::try_from(stats.entries).unwrap_or(i64::MAX));
        self.prefix_index_bytes.set(i64::try_from(stats.bytes_estimate).unwrap_or(i64::MAX));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// Refreshes the routing metrics kept by the router (pending chains, cache credit, pile
    /// guard) and the replica stream's, then renders like [`Metrics::render`].
    pub fn render_all(
        &self,
        pool: &Pool,
        max_queue: u32,
        shared: &SharedView,
        replica: &ReplicaCounters,
    ) -> Result<String, std::fmt::Error> {
        {
            let _one_scrape_at_a_time = self.scrape.lock();
            // Counters mirror monotonic atomics: add what they grew by since the last scrape.
            let mirror = |c: &Counter, v: u64| {
                c.inc_by(v.saturating_sub(c.get()));
            };
            let credit = &shared.credit;
            mirror(
                &self.cache_credit_blocks.get_or_create(&SourceLabel { source: "index" }),
                credit.indexed_blocks.load(Ordering::Relaxed),
            );
            mirror(
                &self.cache_credit_blocks.get_or_create(&SourceLabel { source: "pending" }),
                credit.pending_blocks.load(Ordering::Relaxed),
            );
            mirror(&self.pile_guard_redirects, credit.pile_redirects.load(Ordering::Relaxed));
            let (counts, entries) = {
                let st = shared.lock();
                (st.pending.counts(), st.pending.size().0)
            };
            for (outcome, v) in [
                ("recorded", counts.recorded_local),
                ("recorded_from_peer", counts.recorded_peer),
                ("confirmed", counts.confirmed),
                ("expired", counts.expired),
                ("evicted", counts.evicted),
            ] {
                mirror(&self.pending_chains.get_or_create(&OutcomeLabel { outcome }), v);
            }
            self.pending_entries.set(i64::try_from(entries).unwrap_or(i64::MAX));
            mirror(
                &self.replica_events.get_or_create(&ResultLabel { result: "applied" }),
                replica.applied.load(Ordering::Relaxed),
            );
            mirror(
                &self.replica_events.get_or_create(&ResultLabel { result: "refused" }),
                replica.refused.load(Ordering::Relaxed),
            );
            self.replica_peers.set(i64::try_from(replica.connected.load(Ordering::Relaxed)).unwrap_or(0));
            mirror(&self.replica_disconnects, replica.disconnects.load(Ordering::Relaxed));
            mirror(&self.replica_lagged, replica.lagged.load(Ordering::Relaxed));
        }
        self.render(pool, max_queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_hit_the_seed_thresholds() {
        let b = one_two_five_buckets(1.0, 100_000.0);
        assert_eq!(&b[..4], &[1.0, 2.0, 5.0, 10.0]);
        assert!(b.contains(&1000.0) && b.contains(&5000.0));
        assert_eq!(b.last(), Some(&100_000.0));
        assert!(b.windows(2).all(|w| w[0] < w[1]));
    }
}
