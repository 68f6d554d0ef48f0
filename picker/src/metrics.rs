//! The picker's Prometheus metrics (docs/design.md §9), through `prometheus-client`.
//!
//! Request-path metrics are updated by the ext_proc tasks through handles created once at start
//! (atomics; no allocation except a label set's first use). Pod metrics (`epp_queue_depth`,
//! `epp_pod_health_score`), index size and the counters other parts keep (pending chains, cache
//! credit, the replica stream) are set at scrape time from a [`Scrape`] of plain numbers that the
//! caller reads from the pool, the router and the replica stream, so a pod that left the pool
//! also leaves the scrape.
//!
//! Layering: a leaf. It imports nothing else in the picker: what it shows arrives as numbers
//! ([`Scrape`]) or through the handles below, so every module can count into it and none is
//! tied to another through it.
//!
//! prometheus-client appends `_total` to counter names itself: counters are registered without it.
//!
//! Names: the `epp_*` families are the contract of docs/design.md §9 and keep their names. Beside
//! them the picker exports the Gateway API Inference Extension's standard EPP families (GIE
//! `pkg/epp/metrics`, "Metrics & Observability" guide), so GIE dashboards and HPA recipes work
//! unchanged: `inference_pool_ready_pods{name}`, `inference_pool_average_kv_cache_utilization{name}`,
//! `inference_pool_average_queue_size{name}`, `inference_pool_per_pod_queue_size{name,
//! model_server_pod}`, `inference_objective_request_total{model_name,target_model_name}`,
//! `inference_objective_request_error_total{model_name,target_model_name,error_code}`,
//! `inference_objective_running_requests{model_name}`, `inference_objective_request_duration_seconds`,
//! `inference_objective_request_sizes`, `inference_objective_response_sizes`,
//! `inference_objective_input_tokens`, `inference_objective_output_tokens` (each
//! `{model_name,target_model_name}`, GIE's buckets), `inference_extension_scheduler_e2e_duration_seconds`
//! and `inference_extension_info{commit, build_ref}`. `name` is the InferencePool's name
//! ([`Metrics::set_pool_name`]).
//!
//! Pool gauges count what the router can route to (docs/operations.md "Metrics"):
//! `epp_pool_ready_pods` (= `inference_pool_ready_pods`) the endpoints Ready in the pool and not
//! reported unready, `epp_pool_routable_pods` those the router's filter passes now,
//! `epp_pool_reported_pods` those an agent reports on. A pool without agents reads its Ready
//! endpoints in the first two and 0 in the third.
//!
//! Per-pod label: `model_server_pod` (GIE's name for the model-server pod), never `pod`: a
//! Prometheus Operator scrape sets its own `pod` target label (the picker's pod) and renames a
//! clashing exposed `pod` label to `exported_pod`, which broke every per-pod query and alert.

use std::sync::atomic::AtomicU64;

use parking_lot::{Mutex, RwLock};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::time::Instant;

/// The `name` label of the `inference_pool_*` families until [`Metrics::set_pool_name`] names the
/// InferencePool (a picker fed by a static pool file has no pool object).
pub const DEFAULT_POOL_LABEL: &str = "kvroute";

/// Codes the picker answers itself (docs/design.md §5), pre-created at 0 so `rate()` and
/// `increase()` see the first error (a series born at 1 has no increase).
pub const ERROR_CODES: [u16; 6] = [400, 404, 413, 429, 500, 503];

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

/// `{model_server_pod}` label (GIE's name for the model-server pod; see the module docs for why
/// not `pod`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabel {
    /// Model-server pod name.
    pub model_server_pod: String,
}

/// GIE `{name}` label: the InferencePool.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    /// InferencePool name.
    pub name: String,
}

/// GIE `{name, model_server_pod}` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolPodLabel {
    /// InferencePool name.
    pub name: String,
    /// Model-server pod name.
    pub model_server_pod: String,
}

/// GIE `{model_name, target_model_name}` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ObjectiveLabel {
    /// Client-facing model name ("" when the request named none we could read).
    pub model_name: String,
    /// Model (or adapter) the request is served by.
    pub target_model_name: String,
}

/// GIE `{model_name, target_model_name, error_code}` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ObjectiveErrorLabel {
    /// Client-facing model name ("" when unknown).
    pub model_name: String,
    /// Target model name ("" when unknown).
    pub target_model_name: String,
    /// HTTP status the picker answered.
    pub error_code: String,
}

/// GIE `inference_extension_info{commit, build_ref}` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InfoLabel {
    /// Git commit the binary was built from.
    pub commit: String,
    /// Version.
    pub build_ref: String,
}

/// `{source}` label of `epp_cache_credit_blocks_total`: `index` (KV events) or `pending`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// Where the credited blocks came from.
    pub source: &'static str,
}

/// `{rule}` label of `epp_new_prefix_placements_total`: `traffic` or `cache`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabel {
    /// The placement rule a new prefix was placed by.
    pub rule: &'static str,
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

/// `{reason}` label of `epp_ingest_refusals_total`: why ingest refused an agent's connection or
/// report (`ingest::Refusal::as_str`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The refusal's name.
    pub reason: &'static str,
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
    /// `epp_candidate_pods`: candidates scored in the last decision (not the pool's state: see
    /// `epp_pool_routable_pods`).
    pub candidate_pods: Gauge,
    /// `epp_stale_cache_routing_total`: engine's cached tokens fell short of the prediction.
    pub stale_cache_routing: Counter,
    /// `epp_upstream_connect_failures_total`: Envoy's 503s for a connection failure to the
    /// endpoint the picker chose (each marks the pod unreachable until a TCP probe connects).
    pub upstream_connect_failures: Counter,
    /// `epp_tokenizations_cancelled_total`: tokenizations stopped because the request's ext_proc
    /// stream ended before the decision.
    pub tokenizations_cancelled: Counter,
    /// `epp_image_reads_deferred_total`: inline images sized from their header whose identifier
    /// was queued for the background reader (docs/decisions/0049-image-identifier-off-the-decision.md).
    pub image_reads_deferred: Counter,
    /// `epp_image_reads_dropped_total`: such reads dropped because the reader's queue was full.
    pub image_reads_dropped: Counter,
    pod_unreachable: Family<PodLabel, Gauge>,
    /// `epp_adapter_loads_triggered_total{adapter}`: routed to a pod not running the adapter.
    pub adapter_loads_triggered: Family<AdapterLabel, Counter>,
    /// `epp_request_errors_total{code}`: requests the picker answered itself (400/404/408/413/429/503).
    pub request_errors: Family<CodeLabel, Counter>,
    /// `epp_ingest_refusals_total{reason}`: agent connections and reports refused
    /// (docs/design.md §14 "Trust"; reasons in `ingest::Refusal`).
    pub ingest_refusals: Family<ReasonLabel, Counter>,
    /// GIE `inference_objective_request_total{model_name,target_model_name}`: requests routed.
    pub objective_requests: Family<ObjectiveLabel, Counter>,
    /// GIE `inference_objective_request_error_total{…,error_code}`: requests answered with an error.
    pub objective_errors: Family<ObjectiveErrorLabel, Counter>,
    /// GIE `inference_extension_scheduler_e2e_duration_seconds`: scoring and selection, seconds.
    pub scheduler_e2e_seconds: Histogram,
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
    full_fleet_stays: Counter,
    pending_withheld: Counter,
    new_prefix_placements: Family<RuleLabel, Counter>,
    ttft: TtftMetrics,
    replica_events: Family<ResultLabel, Counter>,
    replica_peers: Gauge,
    replica_disconnects: Counter,
    replica_lagged: Counter,
    /// `epp_requests_by_priority_total{priority}`: routed requests by their InferenceObjective's
    /// priority (docs/design.md §14; 0 without an objective).
    pub requests_by_priority: Family<PriorityLabel, Counter>,
    pool_pods: Gauge,
    pool_ready_pods: Gauge,
    pool_routable_pods: Gauge,
    gie_ready_pods: Family<PoolLabel, Gauge>,
    gie_avg_kv_cache: Family<PoolLabel, Gauge<f64, AtomicU64>>,
    gie_avg_queue: Family<PoolLabel, Gauge<f64, AtomicU64>>,
    gie_pod_queue: Family<PoolPodLabel, Gauge>,
    info: Family<InfoLabel, Gauge>,
    /// GIE's per-request families (`inference_objective_running_requests`, request duration,
    /// sizes and token counts): see [`RequestFamilies`].
    pub requests: RequestFamilies,
    pool_reported_pods: Gauge,
    pool_name: RwLock<String>,
    scrape: Mutex<()>,
}

/// Label: an InferenceObjective priority.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PriorityLabel {
    /// The priority (an integer, higher = more important).
    pub priority: i32,
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
        let upstream_connect_failures = Counter::default();
        let tokenizations_cancelled = Counter::default();
        let image_reads_deferred = Counter::default();
        let image_reads_dropped = Counter::default();
        let pod_unreachable = Family::<PodLabel, Gauge>::default();
        let adapter_loads_triggered = Family::<AdapterLabel, Counter>::default();
        let request_errors = Family::<CodeLabel, Counter>::default();
        let queue_depth = Family::<PodLabel, Gauge>::default();
        let ingest_refusals = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "epp_ingest_refusals",
            "Agent connections and reports refused (identity, scope, ownership, caps, ranges), by reason",
            ingest_refusals.clone(),
        );
        let pod_health_score = Family::<PodLabel, Gauge<f64, AtomicU64>>::default();
        let prefix_tree_nodes = Gauge::default();
        let prefix_index_entries = Gauge::default();
        let prefix_index_bytes = Gauge::default();
        let max_queue = Gauge::default();
        let cache_credit_blocks = Family::<SourceLabel, Counter>::default();
        let pending_chains = Family::<OutcomeLabel, Counter>::default();
        let pending_entries = Gauge::default();
        let pile_guard_redirects = Counter::default();
        let full_fleet_stays = Counter::default();
        let pending_withheld = Counter::default();
        let new_prefix_placements = Family::<RuleLabel, Counter>::default();
        let ttft = TtftMetrics::register(&mut registry);
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
        registry.register(
            "epp_full_fleet_stays",
            "Decisions that kept a request on a pod holding its prefix, at max_queue or past the pile guard, because the candidates' KV was nearly full",
            full_fleet_stays.clone(),
        );
        registry.register(
            "epp_pending_credit_withheld",
            "Candidates scored without their pending credit: queued pending_queue_share of max_queue above the least queued",
            pending_withheld.clone(),
        );
        registry.register(
            "epp_new_prefix_placements",
            "Requests no candidate held a block of, placed among several by the rule taken: traffic (routed rate and cached blocks) or cache (cached blocks alone, while the recent prefixes are equally popular)",
            new_prefix_placements.clone(),
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
        let objective_requests = Family::<ObjectiveLabel, Counter>::default();
        let objective_errors = Family::<ObjectiveErrorLabel, Counter>::default();
        // GIE's own buckets for this family (seconds).
        let scheduler_e2e_seconds =
            Histogram::new([0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1]);
        let pool_pods = Gauge::default();
        let pool_ready_pods = Gauge::default();
        let pool_routable_pods = Gauge::default();
        let gie_ready_pods = Family::<PoolLabel, Gauge>::default();
        let gie_avg_kv_cache = Family::<PoolLabel, Gauge<f64, AtomicU64>>::default();
        let gie_avg_queue = Family::<PoolLabel, Gauge<f64, AtomicU64>>::default();
        let gie_pod_queue = Family::<PoolPodLabel, Gauge>::default();
        let info = Family::<InfoLabel, Gauge>::default();
        for code in ERROR_CODES {
            let _ = request_errors.get_or_create(&CodeLabel { code });
        }

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
            "epp_upstream_connect_failures",
            "Envoy 503s for a connection failure to the routed endpoint (the pod leaves the candidates until a TCP probe connects)",
            upstream_connect_failures.clone(),
        );
        registry.register(
            "epp_tokenizations_cancelled",
            "Tokenizations stopped because the request's ext_proc stream ended first (Envoy gave up)",
            tokenizations_cancelled.clone(),
        );
        registry.register(
            "epp_image_reads_deferred",
            "Inline images sized from their header, their identifier queued for the background reader",
            image_reads_deferred.clone(),
        );
        registry.register(
            "epp_image_reads_dropped",
            "Inline images sized from their header whose background read was dropped (the reader's queue full)",
            image_reads_dropped.clone(),
        );
        registry.register(
            "epp_pod_unreachable",
            "1 while Envoy's last connection to the pod failed and no probe connected since (not a candidate)",
            pod_unreachable.clone(),
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
        let requests_by_priority = Family::<PriorityLabel, Counter>::default();
        registry.register(
            "epp_requests_by_priority",
            "Requests routed, by the priority of their InferenceObjective (0 without one)",
            requests_by_priority.clone(),
        );
        registry.register(
            "epp_pool_pods",
            "Pods the picker knows (reported by an agent, connected or within the grace period)",
            pool_pods.clone(),
        );
        registry.register(
            "epp_pool_ready_pods",
            "Endpoints the router counts as ready: Ready in the pool and not reported unready by an agent \
             (an endpoint no agent reports on routes by load)",
            pool_ready_pods.clone(),
        );
        registry.register(
            "epp_pool_routable_pods",
            "Endpoints that are candidates now, as the router's filter decides: ready, healthy enough, \
             reachable, queue below maxQueue",
            pool_routable_pods.clone(),
        );
        registry.register(
            "inference_objective_request",
            "Counter of inference objective requests broken out for each model and target model",
            objective_requests.clone(),
        );
        registry.register(
            "inference_objective_request_error",
            "Counter of inference objective requests errors broken out for each model and target model",
            objective_errors.clone(),
        );
        registry.register(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency distribution in seconds",
            scheduler_e2e_seconds.clone(),
        );
        registry.register(
            "inference_pool_ready_pods",
            "The number of ready pods in the inference server pool",
            gie_ready_pods.clone(),
        );
        registry.register(
            "inference_pool_average_kv_cache_utilization",
            "The average kv cache utilization for an inference server pool",
            gie_avg_kv_cache.clone(),
        );
        registry.register(
            "inference_pool_average_queue_size",
            "The average number of requests pending in the model server queue",
            gie_avg_queue.clone(),
        );
        registry.register(
            "inference_pool_per_pod_queue_size",
            "The total number of requests pending in the model server queue for each underlying pod",
            gie_pod_queue.clone(),
        );
        registry.register("inference_extension_info", "General information of the current build", info.clone());
        let requests = RequestFamilies::register(&mut registry);
        let pool_reported_pods = Gauge::default();
        registry.register(
            "epp_pool_reported_pods",
            "Endpoints of the pool with an agent report (connected or within the grace period)",
            pool_reported_pods.clone(),
        );
        Self {
            requests_by_priority,
            registry,
            objective_requests,
            objective_errors,
            scheduler_e2e_seconds,
            pool_pods,
            pool_ready_pods,
            pool_routable_pods,
            gie_ready_pods,
            gie_avg_kv_cache,
            gie_avg_queue,
            gie_pod_queue,
            info,
            requests,
            pool_reported_pods,
            pool_name: RwLock::new(DEFAULT_POOL_LABEL.to_owned()),
            routing_decisions,
            cache_match_ratio,
            scoring_latency_us,
            decision_latency_us,
            composite_score,
            candidate_pods,
            stale_cache_routing,
            upstream_connect_failures,
            tokenizations_cancelled,
            image_reads_deferred,
            image_reads_dropped,
            pod_unreachable,
            adapter_loads_triggered,
            request_errors,
            ingest_refusals,
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
            full_fleet_stays,
            pending_withheld,
            new_prefix_placements,
            ttft,
            replica_events,
            replica_peers,
            replica_disconnects,
            replica_lagged,
            scrape: Mutex::new(()),
        }
    }

    /// Names the InferencePool in the `inference_pool_*` families' `name` label (default
    /// [`DEFAULT_POOL_LABEL`]).
    pub fn set_pool_name(&self, name: &str) {
        name.clone_into(&mut self.pool_name.write());
    }

    /// Sets `inference_extension_info{commit, build_ref}` to 1 (the binary knows its commit; the
    /// library does not, so that a new commit does not recompile it).
    pub fn set_build_info(&self, commit: &str, version: &str) {
        self.info.clear();
        self.info.get_or_create(&InfoLabel { commit: commit.to_owned(), build_ref: version.to_owned() }).set(1);
    }

    /// Creates the per-model series at 0 for `models` (client name, target model), so the first
    /// request shows as an increase.
    pub fn register_models<'a>(&self, models: impl IntoIterator<Item = (&'a str, &'a str)>) {
        for (model, target) in models {
            let _ = self.routing_decisions.get_or_create(&ModelLabel { model: model.to_owned() });
            let _ = self
                .objective_requests
                .get_or_create(&ObjectiveLabel { model_name: model.to_owned(), target_model_name: target.to_owned() });
        }
    }

    /// Counts a request the picker answered with `code`, for `model` (client name, target) when
    /// the request got that far.
    pub fn count_error(&self, code: u16, model: Option<(&str, &str)>) {
        self.request_errors.get_or_create(&CodeLabel { code }).inc();
        let (model_name, target_model_name) = model.unwrap_or(("", ""));
        self.objective_errors
            .get_or_create(&ObjectiveErrorLabel {
                model_name: model_name.to_owned(),
                target_model_name: target_model_name.to_owned(),
                error_code: code.to_string(),
            })
            .inc();
    }

    /// Sets the scrape-time metrics from `read()` (called under the scrape lock, so concurrent
    /// scrapes read and apply one after the other) and encodes everything in the OpenMetrics
    /// text format. Counters mirror the monotonic counts of [`Scrape`]: each grows by what its
    /// count grew since the last scrape.
    pub fn render(&self, read: impl FnOnce() -> Scrape) -> Result<String, std::fmt::Error> {
        let _one_scrape_at_a_time = self.scrape.lock();
        let scrape = read();
        self.mirror_counts(&scrape.routing, &scrape.replica);
        self.set_pool_gauges(&scrape);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// The router's and the replica stream's counts (pending chains, cache credit, pile guard).
    fn mirror_counts(&self, routing: &RoutingCounts, replica: &ReplicaCounts) {
        let mirror = |c: &Counter, v: u64| {
            c.inc_by(v.saturating_sub(c.get()));
        };
        mirror(&self.cache_credit_blocks.get_or_create(&SourceLabel { source: "index" }), routing.indexed_blocks);
        mirror(&self.cache_credit_blocks.get_or_create(&SourceLabel { source: "pending" }), routing.pending_blocks);
        mirror(&self.pile_guard_redirects, routing.pile_redirects);
        mirror(&self.full_fleet_stays, routing.full_fleet_stays);
        mirror(&self.pending_withheld, routing.pending_withheld);
        mirror(
            &self.new_prefix_placements.get_or_create(&RuleLabel { rule: "traffic" }),
            routing.new_prefix_by_traffic,
        );
        mirror(&self.new_prefix_placements.get_or_create(&RuleLabel { rule: "cache" }), routing.new_prefix_by_cache);
        let t = &routing.ttft;
        for (c, v) in [
            (&self.ttft.load_fallbacks, t.load_fallbacks),
            (&self.ttft.ttft_fallbacks, t.ttft_fallbacks),
            (&self.ttft.slo_misses, t.slo_misses),
            (&self.ttft.refused, t.refused),
            (&self.ttft.observed, t.observed),
            (&self.ttft.predicted, t.predicted),
        ] {
            mirror(c, v);
        }
        // Kept in whole ms, exported in seconds.
        for (c, ms) in [(&self.ttft.abs_error_seconds, t.abs_error_ms), (&self.ttft.over_seconds, t.over_ms)] {
            let v = ms as f64 / 1000.0;
            if v > c.get() {
                c.inc_by(v - c.get());
            }
        }
        for (outcome, v) in [
            ("recorded", routing.recorded_local),
            ("recorded_from_peer", routing.recorded_peer),
            ("confirmed", routing.confirmed),
            ("expired", routing.expired),
            ("evicted", routing.evicted),
        ] {
            mirror(&self.pending_chains.get_or_create(&OutcomeLabel { outcome }), v);
        }
        self.pending_entries.set(i64::try_from(routing.pending_entries).unwrap_or(i64::MAX));
        mirror(&self.replica_events.get_or_create(&ResultLabel { result: "applied" }), replica.applied);
        mirror(&self.replica_events.get_or_create(&ResultLabel { result: "refused" }), replica.refused);
        self.replica_peers.set(i64::try_from(replica.connected).unwrap_or(0));
        mirror(&self.replica_disconnects, replica.disconnects);
        mirror(&self.replica_lagged, replica.lagged);
    }

    /// The per-pod, pool and index gauges.
    fn set_pool_gauges(&self, scrape: &Scrape) {
        self.max_queue.set(i64::from(scrape.max_queue));
        self.queue_depth.clear();
        self.pod_health_score.clear();
        self.gie_pod_queue.clear();
        self.pod_unreachable.clear();
        self.gie_ready_pods.clear();
        self.gie_avg_kv_cache.clear();
        self.gie_avg_queue.clear();
        let pool_name = self.pool_name.read().clone();
        let pods = &scrape.pods;
        let (mut ready, mut routable, mut reported, mut kv_sum, mut queue_sum) = (0_i64, 0_i64, 0_i64, 0.0_f64, 0_u64);
        for p in pods {
            let label = PodLabel { model_server_pod: p.name.clone() };
            self.queue_depth.get_or_create(&label).set(i64::from(p.queue_depth));
            self.pod_health_score.get_or_create(&label).set(p.health_score);
            self.pod_unreachable.get_or_create(&label).set(i64::from(p.unreachable));
            self.gie_pod_queue
                .get_or_create(&PoolPodLabel { name: pool_name.clone(), model_server_pod: p.name.clone() })
                .set(i64::from(p.queue_depth));
            ready += i64::from(p.ready);
            routable += i64::from(p.routable);
            reported += i64::from(p.reported);
            kv_sum += p.kv_cache_usage;
            queue_sum += u64::from(p.queue_depth);
        }
        let total = i64::try_from(pods.len()).unwrap_or(i64::MAX);
        self.pool_pods.set(total);
        self.pool_ready_pods.set(ready);
        self.pool_routable_pods.set(routable);
        self.pool_reported_pods.set(reported);
        let pool_label = PoolLabel { name: pool_name };
        self.gie_ready_pods.get_or_create(&pool_label).set(ready);
        // GIE averages over the pool's pods; an empty pool reads 0, not NaN.
        let n = pods.len().max(1) as f64;
        self.gie_avg_kv_cache.get_or_create(&pool_label).set(kv_sum / n);
        self.gie_avg_queue.get_or_create(&pool_label).set(queue_sum as f64 / n);
        self.prefix_tree_nodes.set(i64::try_from(scrape.index_nodes).unwrap_or(i64::MAX));
        self.prefix_index_entries.set(i64::try_from(scrape.index_entries).unwrap_or(i64::MAX));
        self.prefix_index_bytes.set(i64::try_from(scrape.index_bytes).unwrap_or(i64::MAX));
    }
}

/// What a scrape shows that the metrics do not count themselves, read from the rest of the
/// picker as plain numbers ([`Metrics::render`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    /// Configured `max_queue` (`epp_max_queue`).
    pub max_queue: u32,
    /// The pool's pods.
    pub pods: Vec<PodGauges>,
    /// Distinct blocks in the prefix index.
    pub index_nodes: u64,
    /// (block, pod) entries in the prefix index.
    pub index_entries: u64,
    /// Estimated prefix index memory, bytes.
    pub index_bytes: u64,
    /// The router's counts.
    pub routing: RoutingCounts,
    /// The replica stream's counts.
    pub replica: ReplicaCounts,
}

/// One pod's figures at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodGauges {
    /// Pod name (the `model_server_pod` label).
    pub name: String,
    /// Queue depth (waiting + routed since the report).
    pub queue_depth: u32,
    /// Health score in [0,1].
    pub health_score: f64,
    /// Held unreachable (Envoy's last connection failed, no probe connected since).
    pub unreachable: bool,
    /// Ready as the router counts it: Ready in the pool and not reported unready by its agent
    /// (a pod no agent reports on routes by load, so it counts).
    pub ready: bool,
    /// A candidate now, as the router's filter decides: ready, healthy enough, reachable, queue
    /// below `max_queue`.
    pub routable: bool,
    /// An agent reports on it (connected, or within the grace period).
    pub reported: bool,
    /// KV-cache usage in [0,1].
    pub kv_cache_usage: f64,
}

/// The router's monotonic counts (docs/design.md §3 pending entries, §4 pile guard) and the
/// pending table's size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoutingCounts {
    /// Blocks credited to chosen pods by the KV-event index.
    pub indexed_blocks: u64,
    /// Blocks credited to chosen pods only because they were pending.
    pub pending_blocks: u64,
    /// Decisions the pile guard sent to the least loaded candidate.
    pub pile_redirects: u64,
    /// Decisions kept on a pod holding the prefix because the fleet was full.
    pub full_fleet_stays: u64,
    /// Candidates scored without their pending credit.
    pub pending_withheld: u64,
    /// New prefixes placed by routed rate and cached blocks.
    pub new_prefix_by_traffic: u64,
    /// New prefixes placed by cached blocks alone (equally popular prefixes).
    pub new_prefix_by_cache: u64,
    /// Pending chains recorded by this replica's decisions.
    pub recorded_local: u64,
    /// Pending chains recorded from peer replicas.
    pub recorded_peer: u64,
    /// Pending chains confirmed by the pod's events.
    pub confirmed: u64,
    /// Pending chains that expired unconfirmed.
    pub expired: u64,
    /// Pending chains evicted because the table was full.
    pub evicted: u64,
    /// (block, pod) pending entries held now.
    pub pending_entries: usize,
    /// The load and TTFT models' counts.
    pub ttft: TtftCounts,
}

/// The in-flight load and TTFT models' monotonic counts (docs/design.md §4 "Load and predicted
/// TTFT"), read from the router's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TtftCounts {
    /// Candidates scored by the seed's load formula (their TTFT model had not learned yet).
    pub load_fallbacks: u64,
    /// `spill_rule: ttft` decisions taken by the seed's rule (a candidate had no prediction).
    pub ttft_fallbacks: u64,
    /// Decisions whose `x-slo-ttft-ms` no candidate was predicted to meet.
    pub slo_misses: u64,
    /// First tokens refused as absurd.
    pub refused: u64,
    /// First tokens learned.
    pub observed: u64,
    /// Of `observed`, those with a prediction.
    pub predicted: u64,
    /// Σ |predicted − actual| over `predicted`, ms.
    pub abs_error_ms: u64,
    /// Σ (predicted − actual) where positive, ms.
    pub over_ms: u64,
}

/// The counters of [`TtftCounts`] as exported.
#[derive(Debug, Default)]
struct TtftMetrics {
    load_fallbacks: Counter,
    ttft_fallbacks: Counter,
    slo_misses: Counter,
    refused: Counter,
    observed: Counter,
    predicted: Counter,
    abs_error_seconds: Counter<f64, AtomicU64>,
    over_seconds: Counter<f64, AtomicU64>,
}

impl TtftMetrics {
    fn register(registry: &mut Registry) -> Self {
        let m = TtftMetrics::default();
        for (name, help, c) in [
            (
                "epp_load_fallbacks",
                "Candidates scored by the seed's GPU-utilization load (their TTFT model had not learned yet) under load_source inflight",
                &m.load_fallbacks,
            ),
            (
                "epp_ttft_spill_fallbacks",
                "spill_rule ttft decisions taken by the seed's rule: a candidate had no TTFT prediction, or the cache-hot pod's KV was 90 % held",
                &m.ttft_fallbacks,
            ),
            ("epp_slo_ttft_misses", "Requests whose x-slo-ttft-ms no candidate was predicted to meet", &m.slo_misses),
            (
                "epp_ttft_observations_refused",
                "First tokens not learned: negative, not finite or over ten minutes",
                &m.refused,
            ),
            ("epp_ttft_observations", "First tokens the per-pod TTFT models learned from", &m.observed),
            (
                "epp_ttft_predictions_scored",
                "First tokens that had a TTFT prediction at routing (the error counters' denominator)",
                &m.predicted,
            ),
        ] {
            registry.register(name, help, c.clone());
        }
        registry.register(
            "epp_ttft_prediction_abs_error_seconds",
            "Sum of |predicted - actual| time to first token (mean error = rate of this / rate of epp_ttft_predictions_scored_total)",
            m.abs_error_seconds.clone(),
        );
        registry.register(
            "epp_ttft_prediction_over_seconds",
            "Sum of (predicted - actual) time to first token where the prediction was too high",
            m.over_seconds.clone(),
        );
        m
    }
}

/// The replica stream's counts (docs/design.md §4 "One view across replicas").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaCounts {
    /// Peer events applied.
    pub applied: u64,
    /// Peer events refused.
    pub refused: u64,
    /// Peers subscribed to now.
    pub connected: u64,
    /// Subscriptions to peers that ended.
    pub disconnects: u64,
    /// Subscribers cut off for falling behind.
    pub lagged: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_records_count_running_and_observe_on_finish_only() {
        let m = Metrics::new();
        let text = |m: &Metrics| m.render(Scrape::default).unwrap();
        let running = |t: &str| {
            t.lines()
                .find(|l| l.starts_with("inference_objective_running_requests{model_name=\"chat\"}"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
        };
        let a = m.requests.start("chat", "base", Instant::now(), 300, 40);
        let mut b = m.requests.start("chat", "lora-1", Instant::now(), 5000, 0);
        assert_eq!(running(&text(&m)), Some(2));
        drop(a);
        assert_eq!(running(&text(&m)), Some(1), "a stream that ended leaves the running count");
        b.response_bytes(700);
        b.response_bytes(300);
        b.finish(Some(12));
        let t = text(&m);
        assert_eq!(running(&t), Some(0));
        let line = |prefix: &str| t.lines().find(|l| l.starts_with(prefix)).map(str::to_owned);
        let lora = "{model_name=\"chat\",target_model_name=\"lora-1\"}";
        let base = "{model_name=\"chat\",target_model_name=\"base\"}";
        assert_eq!(
            line(&format!("inference_objective_request_duration_seconds_count{lora}")).as_deref(),
            Some(&*format!("inference_objective_request_duration_seconds_count{lora} 1"))
        );
        assert_eq!(
            line(&format!("inference_objective_request_duration_seconds_count{base}")).as_deref(),
            Some(&*format!("inference_objective_request_duration_seconds_count{base} 0")),
            "a never finished: no duration"
        );
        assert!(line(&format!("inference_objective_response_sizes_sum{lora} 1000")).is_some(), "{t}");
        assert!(line(&format!("inference_objective_output_tokens_sum{lora} 12")).is_some(), "{t}");
        assert!(line(&format!("inference_objective_input_tokens_sum{base} 40")).is_some(), "{t}");
        assert_eq!(line(&format!("inference_objective_input_tokens_count{lora}")), None, "0 tokens: not observed");
        assert!(line(&format!("inference_objective_request_sizes_sum{lora} 5000")).is_some(), "{t}");
    }

    #[test]
    fn pool_gauges_count_ready_routable_and_reported_apart() {
        let m = Metrics::new();
        let pod = |name: &str, ready, routable, reported| PodGauges {
            name: name.into(),
            ready,
            routable,
            reported,
            ..PodGauges::default()
        };
        // Three Ready pods and no agent (GIE-only): ready and routable, none reported.
        let pods = vec![pod("a", true, true, false), pod("b", true, true, false), pod("c", true, false, true)];
        let t = m.render(|| Scrape { pods, ..Scrape::default() }).unwrap();
        for (name, want) in [
            ("epp_pool_ready_pods", 3),
            ("epp_pool_routable_pods", 2),
            ("epp_pool_reported_pods", 1),
            ("inference_pool_ready_pods{name=\"kvroute\"}", 3),
        ] {
            let got = t.lines().find(|l| l.starts_with(&format!("{name} "))).and_then(|l| l.rsplit(' ').next());
            assert_eq!(got, Some(&*want.to_string()), "{name}: {t}");
        }
    }

    #[test]
    fn new_prefix_placements_mirror_their_counts_by_rule() {
        let m = Metrics::new();
        let scrape = |traffic, cache| Scrape {
            routing: RoutingCounts {
                new_prefix_by_traffic: traffic,
                new_prefix_by_cache: cache,
                ..RoutingCounts::default()
            },
            ..Scrape::default()
        };
        let count = |t: &str, rule: &str| {
            let name = format!("epp_new_prefix_placements_total{{rule=\"{rule}\"}} ");
            t.lines().find(|l| l.starts_with(&name)).and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        };
        let t = m.render(|| scrape(3, 0)).unwrap();
        assert_eq!((count(&t, "traffic"), count(&t, "cache")), (Some(3), Some(0)), "{t}");
        let t = m.render(|| scrape(5, 7)).unwrap();
        assert_eq!((count(&t, "traffic"), count(&t, "cache")), (Some(5), Some(7)), "{t}");
    }

    #[test]
    fn latency_buckets_hit_the_seed_thresholds() {
        let b = one_two_five_buckets(1.0, 100_000.0);
        assert_eq!(&b[..4], &[1.0, 2.0, 5.0, 10.0]);
        assert!(b.contains(&1000.0) && b.contains(&5000.0));
        assert_eq!(b.last(), Some(&100_000.0));
        assert!(b.windows(2).all(|w| w[0] < w[1]));
    }
}

/// `{model_name}` label of `inference_objective_running_requests`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelNameLabel {
    /// Client-facing model name.
    pub model_name: String,
}

/// A histogram family with fixed buckets.
type HistogramFamily = Family<ObjectiveLabel, Histogram, fn() -> Histogram>;

/// GIE's `inference_objective_request_duration_seconds` buckets (seconds).
const DURATION_BUCKETS: [f64; 35] = [
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0,
    45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0,
];
/// GIE's token-count buckets (input; output stops at 8192).
const TOKEN_BUCKETS: [f64; 19] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32778.0, 65536.0,
    131072.0, 262144.0, 524288.0, 1048576.0,
];
/// GIE's `inference_objective_response_sizes` buckets (bytes).
const RESPONSE_SIZE_BUCKETS: [f64; 15] =
    [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32778.0, 65536.0];

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}
fn request_size_histogram() -> Histogram {
    // GIE: 64 B to 64 KiB by doubling, then up to 1 GiB.
    Histogram::new((6..=30).map(|e| f64::from(1_u32 << e)))
}
fn response_size_histogram() -> Histogram {
    Histogram::new(RESPONSE_SIZE_BUCKETS)
}
fn input_token_histogram() -> Histogram {
    Histogram::new(TOKEN_BUCKETS)
}
fn output_token_histogram() -> Histogram {
    Histogram::new(TOKEN_BUCKETS[..12].iter().copied())
}

/// GIE's per-request families (GIE `pkg/epp/metrics`: names, labels and buckets as there).
#[derive(Debug, Clone)]
pub struct RequestFamilies {
    running: Family<ModelNameLabel, Gauge>,
    duration: HistogramFamily,
    request_sizes: HistogramFamily,
    response_sizes: HistogramFamily,
    input_tokens: HistogramFamily,
    output_tokens: HistogramFamily,
}

impl RequestFamilies {
    fn register(registry: &mut Registry) -> Self {
        let family = |f: fn() -> Histogram| HistogramFamily::new_with_constructor(f);
        let s = Self {
            running: Family::default(),
            duration: family(duration_histogram),
            request_sizes: family(request_size_histogram),
            response_sizes: family(response_size_histogram),
            input_tokens: family(input_token_histogram),
            output_tokens: family(output_token_histogram),
        };
        registry.register(
            "inference_objective_running_requests",
            "Inference objective number of running requests in each model",
            s.running.clone(),
        );
        registry.register(
            "inference_objective_request_duration_seconds",
            "Inference objective response latency distribution in seconds for each model and target model",
            s.duration.clone(),
        );
        registry.register(
            "inference_objective_request_sizes",
            "Inference objective requests size distribution in bytes for each model and target model",
            s.request_sizes.clone(),
        );
        registry.register(
            "inference_objective_response_sizes",
            "Inference objective responses size distribution in bytes for each model and target model",
            s.response_sizes.clone(),
        );
        registry.register(
            "inference_objective_input_tokens",
            "Inference objective input token count distribution for requests in each model",
            s.input_tokens.clone(),
        );
        registry.register(
            "inference_objective_output_tokens",
            "Inference objective output token count distribution for requests in each model",
            s.output_tokens.clone(),
        );
        s
    }

    /// A request routed for `model_name` (client name) served as `target_model_name` (the target
    /// model, or its adapter), received at `received`, `request_bytes` long, of `input_tokens`
    /// tokens (0 when not tokenized: not observed, as GIE): observes its size and tokens and
    /// counts it running until the returned record is dropped.
    pub fn start(
        &self,
        model_name: &str,
        target_model_name: &str,
        received: Instant,
        request_bytes: usize,
        input_tokens: usize,
    ) -> RequestRecord {
        let label =
            ObjectiveLabel { model_name: model_name.to_owned(), target_model_name: target_model_name.to_owned() };
        self.request_sizes.get_or_create(&label).observe(request_bytes as f64);
        if input_tokens > 0 {
            self.input_tokens.get_or_create(&label).observe(input_tokens as f64);
        }
        let running = self.running.get_or_create(&ModelNameLabel { model_name: model_name.to_owned() }).clone();
        running.inc();
        RequestRecord {
            running,
            duration: self.duration.get_or_create(&label).clone(),
            response_sizes: self.response_sizes.get_or_create(&label).clone(),
            output_tokens: self.output_tokens.get_or_create(&label).clone(),
            received,
            response_bytes: 0,
        }
    }
}

/// One routed request on GIE's per-request families: counted in
/// `inference_objective_running_requests` while alive; [`RequestRecord::finish`] (the response
/// ended) observes its duration, response size and output tokens. Dropped without `finish` (the
/// stream ended first) it only leaves the running count.
#[derive(Debug)]
pub struct RequestRecord {
    running: Gauge,
    duration: Histogram,
    response_sizes: Histogram,
    output_tokens: Histogram,
    received: Instant,
    response_bytes: u64,
}

impl RequestRecord {
    /// Adds `n` bytes of response body.
    pub fn response_bytes(&mut self, n: usize) {
        self.response_bytes = self.response_bytes.saturating_add(n as u64);
    }

    /// The response ended: observes the time since the request was received, the response's
    /// size and, when the engine reported it (`usage.completion_tokens`), its output tokens.
    pub fn finish(self, output_tokens: Option<u32>) {
        self.duration.observe(self.received.elapsed().as_secs_f64());
        self.response_sizes.observe(self.response_bytes as f64);
        if let Some(n) = output_tokens.filter(|n| *n > 0) {
            self.output_tokens.observe(f64::from(n));
        }
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.running.dec();
    }
}
