//! The pod pool: registry of pods (name → [`PodIdx`]), their latest reported state, in-flight
//! counts, and the prefix index they feed (docs/design.md §3, §4, §7).
//!
//! Concurrency model:
//! - One writer thread (`kvroute-pool-writer`, started by [`Pool::new`], with its own small tokio
//!   runtime for its timer) owns the [`IndexWriter`](crate::index::IndexWriter) and the pod
//!   registry. Ingest streams feed it [`PoolUpdate`]s through a bounded channel
//!   ([`UPDATE_QUEUE`]); it applies them in batches, publishes one index snapshot per batch, then
//!   per-pod status. It also expires pods whose agent stream ended more than `grace_ttl_ms` ago.
//! - Readers (`Router`, metrics) load the pod table, each pod's status and the index through
//!   `arc-swap`: never blocked by the writer.
//! - In-flight counters are per pod (see `inflight`); decisions that reserve them serialise on
//!   [`Pool`]'s selection mutex ([`Pool::lock_selection`]) for the few microseconds of scoring +
//!   reservation only.
//!
//! Invariants: a pod's [`PodIdx`] is unique among live pods; a freed index is reused only after all
//! 65 536 fresh ones were handed out (so a reader holding an old index snapshot cannot attribute a
//! dropped pod's blocks to a new pod); the writer stops when the last [`Pool`] handle is dropped.
//!
//! Layering: the pool sits under scoring, pending chains and the request path and imports none
//! of them; what it parses from a pod (annotations, the price) is its own (`annotations.rs`), and
//! what happens when an in-flight slot is released is a [`ReleaseHook`] its users install.

mod annotations;
mod column;
mod inflight;
mod ttft;
mod writer;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use kvroute_cluster::PoolView;
use kvroute_common::BlockHash;
use kvroute_proto::agent::v1::{PodInfo, PodStats};
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::{mpsc, oneshot};

pub use crate::index::IndexStats;
use crate::index::{IndexSnapshot, PodIdx};
pub use annotations::COST_ANNOTATION;
pub(crate) use column::Column;
pub(crate) use inflight::{InFlight, ROUTED_RATE_TAU_MS};
pub use inflight::{InFlightSlot, ReleaseHook, TtftObservation};
pub(crate) use ttft::SharedFit;
pub use ttft::{DECODE_TOKENS_PER_REQUEST, FLEET_MIN_OBSERVATIONS, SolvedFit, TtftFit, TtftLine};

/// Capacity of the update channel from ingest streams to the writer (messages).
pub const UPDATE_QUEUE: usize = 4096;

/// Default of [`PoolConfig::grace_ttl_ms`] (and the config's `pod_grace_ttl_ms`), in ms.
pub const DEFAULT_POD_GRACE_TTL_MS: u64 = 10_000;
/// Default of [`PoolConfig::max_blocks_per_pod`] (and the config's field), in blocks: an H100
/// holding ~30 GB of KV cache at 16 tokens per block is well under this (≈ 8 bytes of index per
/// block, 16 MB per full pod).
pub const DEFAULT_MAX_BLOCKS_PER_POD: usize = 2_000_000;
/// Default of [`PoolConfig::max_report_age_ms`] (and the config's `limits.max_report_age_ms`), in
/// ms: five of the agent's default 2 s report intervals.
pub const DEFAULT_MAX_REPORT_AGE_MS: u64 = 10_000;
/// Health a pod's stats count for once its agent's last report is older than
/// [`PoolConfig::max_report_age_ms`] (the reported score if lower): a silent agent's figures are
/// unknown, not perfect (docs/design.md §15).
pub const STALE_REPORT_HEALTH: f64 = 0.5;
/// The health reason of a pod whose agent's stats are older than the report-age limit.
pub const STALE_REPORT_REASON: &str = "agent report stale";
/// The health score of a Ready pod of the pool that no agent reports on: its GPUs' state is
/// unknown, as for a pod whose agent cannot see its GPUs
/// ([`kvroute_common::UNKNOWN_GPU_HEALTH`], 0.7), so neither ranks below the other.
pub const NO_REPORT_HEALTH: f64 = kvroute_common::UNKNOWN_GPU_HEALTH;
/// Its health reason.
pub const NO_REPORT_REASON: &str = "no agent report: GPU state unknown";

/// Pool settings. The picker builds them from its config file (`PickerConfig::pool`).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    /// Tokens per block (vLLM `--block-size`). Default [`kvroute_common::DEFAULT_BLOCK_SIZE`] (16).
    /// Pods reporting another size are logged.
    pub block_size: usize,
    /// How long a pod whose agent stream ended keeps its blocks and stays a candidate, in ms.
    /// Default [`DEFAULT_POD_GRACE_TTL_MS`].
    pub grace_ttl_ms: u64,
    /// Cap on blocks (index entries) per pod; stores beyond it are dropped and counted.
    /// Default [`DEFAULT_MAX_BLOCKS_PER_POD`].
    pub max_blocks_per_pod: usize,
    /// Age, in ms, past which a pod's last stats report counts as unknown: health at most
    /// [`STALE_REPORT_HEALTH`] (reason [`STALE_REPORT_REASON`]) and every in-flight request in its
    /// queue depth, until the agent reports again. Default [`DEFAULT_MAX_REPORT_AGE_MS`].
    pub max_report_age_ms: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            block_size: kvroute_common::DEFAULT_BLOCK_SIZE,
            grace_ttl_ms: DEFAULT_POD_GRACE_TTL_MS,
            max_blocks_per_pod: DEFAULT_MAX_BLOCKS_PER_POD,
            max_report_age_ms: DEFAULT_MAX_REPORT_AGE_MS,
        }
    }
}

/// Errors of the pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The writer thread is gone (it failed to start, or the process is shutting down).
    #[error("pool writer is not running; agent updates cannot be applied")]
    WriterGone,
}

/// Identifies one agent stream (assigned by ingest), so a stream's end only disconnects the pods
/// it still owns.
pub type StreamId = u64;

/// A change to the pool, as ingest decodes it from an agent stream.
#[derive(Debug)]
#[non_exhaustive]
pub enum PoolUpdate {
    /// A stream announced the pods it reports for: register them (connected, not yet ready).
    Hello { stream: StreamId, pods: Vec<PodInfo> },
    /// Full state of a pod: replaces its info, stats and blocks atomically.
    Snapshot { stream: StreamId, info: PodInfo, seq: u64, stats: Option<PodStats>, blocks: Vec<BlockHash> },
    /// Incremental change (already sequence-checked by ingest): `cleared` first, then `stored`,
    /// then `removed`; then `stats` if present.
    Delta {
        stream: StreamId,
        pod: String,
        seq: u64,
        cleared: bool,
        stored: Vec<BlockHash>,
        removed: Vec<BlockHash>,
        stats: Option<PodStats>,
    },
    /// The stream ended: its pods are disconnected and enter the grace period.
    StreamEnded { stream: StreamId },
    /// Changes to a pod's CPU tier (docs/design.md §2 tiers: vLLM KV offloading, LMCache):
    /// `cleared` first (with `stored` after a snapshot: the whole tier), then `stored`, then
    /// `removed`. Kept in a second index; a block in both tiers counts as GPU.
    Offloaded { stream: StreamId, pod: String, cleared: bool, stored: Vec<BlockHash>, removed: Vec<BlockHash> },
    /// The InferencePool (or pool file) changed (docs/design.md §14): from now on the pool's
    /// endpoints are the only pods. Each endpoint is a pod here, named `<pod>-rank-<i>`, with the
    /// address from the view; endpoints that left are dropped at once, new Ready ones are
    /// candidates at once (by load until their agent reports), agents' reports for any other
    /// name are ignored.
    Membership { view: Arc<PoolView> },
}

enum WriterMsg {
    Update(Box<PoolUpdate>),
    Barrier(oneshot::Sender<()>),
}

/// The pool's Ready endpoints by what their agents say of the engines behind them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Endpoints of Ready pods in the pool view.
    pub ready_endpoints: usize,
    /// Of those, endpoints whose agent reports an engine that answers and serves its model.
    pub engines_ready: usize,
    /// Of those, endpoints whose agent reports an engine that does not answer (yet).
    pub engines_unready: usize,
}

impl Coverage {
    /// Share of Ready endpoints whose engine is reported ready (1 for an empty pool).
    pub fn share(&self) -> f64 {
        if self.ready_endpoints == 0 { 1.0 } else { self.engines_ready as f64 / self.ready_endpoints as f64 }
    }

    /// Whether some endpoint may take a request: an empty pool (every request gets its 503 from
    /// routing), an engine reported ready, or an endpoint no agent reports on (routed by load).
    pub fn any_routable(&self) -> bool {
        self.ready_endpoints == 0 || self.engines_unready < self.ready_endpoints
    }
}

/// What readers know about a pod; replaced as a whole by the writer.
#[derive(Debug, Clone)]
pub(crate) struct PodStatus {
    /// "ip:port" (shared with decisions' candidate lists without copying).
    pub(crate) endpoint: Arc<str>,
    pub(crate) model: String,
    /// Tokens per engine block (vLLM `--block-size`; 0 = unknown, the index's is assumed).
    pub(crate) block_size: u32,
    /// The pod's block hashes are of another granularity than the index's (a misconfigured
    /// agent): they are not indexed, the pod is routed by load alone.
    pub(crate) index_mismatch: bool,
    /// Latest stats; `None` until the first report (the pod is then not ready).
    pub(crate) stats: Option<PodStats>,
    /// When `stats` arrived (monotonic, the picker's clock), for the report-age limit.
    pub(crate) stats_at: Option<Instant>,
    pub(crate) connected: bool,
    /// When the agent stream ended (monotonic), if disconnected.
    pub(crate) disconnected_at: Option<Instant>,
    /// Operator annotations from `PodInfo`, sorted by key (for custom scorers).
    pub(crate) annotations: Vec<(String, String)>,
    /// `kvroute.io/cost-per-hour` parsed ($/hour, finite and > 0), if present and valid.
    pub(crate) cost_per_hour: Option<f64>,
    /// Where the pod's membership comes from.
    pub(crate) member: Membership,
    /// GPU utilization per running request in the last report that had requests running and a
    /// utilization above 0 (in (0, 1]; `None` before such a report): what scoring adds to a
    /// report's utilization for each request routed since (docs/design.md §4 loadRatio).
    pub(crate) utilization_per_request: Option<f64>,
}

/// How a pod became a pod of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Membership {
    /// Registered by an agent's report (no pool source: library use and unit tests only; the
    /// picker binary always has a pool source). Needs stats before it is a candidate.
    Agent,
    /// An endpoint of the pool view whose pod is Ready: a candidate, by load until its agent
    /// reports.
    PoolReady,
    /// An endpoint of the pool view whose pod is not Ready (or terminating): never a candidate.
    PoolUnready,
}

/// A live pod: immutable identity plus the cells readers load.
///
/// Laid out in field order from a cache-line boundary: what every decision reads of each
/// candidate (slot, unreachable flag, name, in-flight count and TTFT fit, in that order) fills
/// the record's first two lines, where the compiler's own order spread it over four. A pod with
/// requests in flight is read on a third line too: its count of requests since its report, read
/// without a lock. The in-flight list's lock and header lie after it.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct PodRecord {
    pub(crate) idx: PodIdx,
    /// Envoy reported a connection failure to the endpoint ([`InFlightSlot::mark_unreachable`]):
    /// not a candidate until it answers HTTP again ([`Pool::probe_unreachable`]).
    pub(crate) unreachable: AtomicBool,
    /// Pod name (shared with decisions' candidate lists without copying).
    pub(crate) name: Arc<str>,
    pub(crate) inflight: InFlight,
    pub(crate) status: ArcSwap<PodStatus>,
    pub(crate) blocks: AtomicU64,
}

/// The published list of live pods, with each pod's status as of this publication and the pods
/// of each model, so a decision reads one snapshot: no per-pod lock or atomic read-modify-write,
/// no scan of other models' pods.
#[derive(Debug, Default)]
pub(crate) struct PodTable {
    /// The live pods (shared between publications while no pod comes or goes).
    pub(crate) pods: Arc<[Arc<PodRecord>]>,
    /// `status[i]` is `pods[i]`'s status when the table was published.
    pub(crate) status: Column<Arc<PodStatus>>,
    /// `hot[i]` is what a decision's filters and load stages read of `status[i]`, copied.
    /// Both columns share every chunk no changed status lies in with the previous publication.
    pub(crate) hot: Column<PodHot>,
    /// Model name → indices into `pods` of the pods serving it, ascending (shared between
    /// publications while no pod comes, goes or changes model).
    pub(crate) by_model: Arc<ModelPods>,
}

/// What a decision's filters and load stages read of a pod's status (docs/design.md §4
/// "Decision speed"), copied when the table is published: 72 bytes per pod in one array read in
/// order, where the status itself lies behind a pointer per pod, its fields over several cache
/// lines. Without stats, every reported figure is 0.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PodHot {
    /// When the stats arrived; `None` without stats (see [`PodHot::report_stale_before`]).
    pub(crate) stats_at: Option<Instant>,
    /// The report's `observed_at_unix_ms`.
    pub(crate) observed_at_unix_ms: i64,
    pub(crate) gpu_utilization: f64,
    pub(crate) kv_cache_usage: f64,
    pub(crate) health_score: f64,
    /// [`PodStatus::utilization_per_request`], 1.0 (NVML's meaning of one stepping request)
    /// before one is known.
    pub(crate) utilization_per_request: f64,
    pub(crate) num_requests_waiting: u32,
    pub(crate) num_requests_running: u32,
    /// [`PodStatus::block_size`].
    pub(crate) block_size: u32,
    pub(crate) has_stats: bool,
    /// The report's `ready`.
    pub(crate) ready: bool,
    /// The agent stream ended ([`PodStatus::disconnected_at`] is set).
    pub(crate) disconnected: bool,
    pub(crate) member: Membership,
}

impl PodHot {
    /// The copy of `status`.
    pub(crate) fn of(status: &PodStatus) -> PodHot {
        let s = status.stats.as_ref();
        PodHot {
            stats_at: s.and(status.stats_at),
            observed_at_unix_ms: s.map_or(0, |s| s.observed_at_unix_ms),
            gpu_utilization: s.map_or(0.0, |s| s.gpu_utilization),
            kv_cache_usage: s.map_or(0.0, |s| s.kv_cache_usage),
            health_score: s.map_or(0.0, |s| s.health_score),
            utilization_per_request: status.utilization_per_request.unwrap_or(1.0),
            num_requests_waiting: s.map_or(0, |s| s.num_requests_waiting),
            num_requests_running: s.map_or(0, |s| s.num_requests_running),
            block_size: status.block_size,
            has_stats: s.is_some(),
            ready: s.is_some_and(|s| s.ready),
            disconnected: status.disconnected_at.is_some(),
            member: status.member,
        }
    }

    /// [`PodStatus::report_stale_before`] of the status copied.
    pub(crate) fn report_stale_before(&self, cutoff: Option<Instant>) -> bool {
        matches!((self.stats_at, cutoff), (Some(t), Some(c)) if t < c)
    }

    /// The health score of [`PodStatus::effective_health`], without its reason.
    pub(crate) fn effective_health_score(&self, stale: bool) -> f64 {
        if stale_caps_health(self.health_score, stale) { STALE_REPORT_HEALTH } else { self.health_score }
    }
}

/// Model name → indices into [`PodTable::pods`] of the pods serving it.
pub(crate) type ModelPods = std::collections::HashMap<String, Vec<u32>>;

impl PodTable {
    /// Groups `status` (one per pod, in table order) by model.
    pub(crate) fn group_by_model(status: &[Arc<PodStatus>]) -> ModelPods {
        let mut by_model = ModelPods::new();
        for (i, st) in status.iter().enumerate() {
            if let Ok(i) = u32::try_from(i) {
                by_model.entry(st.model.clone()).or_default().push(i);
            }
        }
        by_model
    }
}

/// Shared pod pool. Cheap to share as `Arc<Pool>`; see the module docs for concurrency.
#[derive(Debug)]
pub struct Pool {
    config: PoolConfig,
    pub(crate) table: Arc<ArcSwap<PodTable>>,
    pub(crate) index: Arc<ArcSwap<IndexSnapshot>>,
    /// The CPU tier's blocks (docs/design.md §2 tiers), published with `index`.
    pub(crate) cpu_index: Arc<ArcSwap<IndexSnapshot>>,
    /// Held only while a decision scores candidates and reserves its slot ([`Selection`]).
    select_lock: Mutex<()>,
    tx: mpsc::Sender<WriterMsg>,
    next_slot: AtomicU64,
    /// The pool view last handed to the writer; `None` without a pool source.
    membership: arc_swap::ArcSwapOption<PoolView>,
}

/// How the pool's pods serve a model id ([`Pool::served_as`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Served {
    /// Some pod serves it as its base model.
    Base,
    /// Some pod runs it as a LoRA adapter on base model `base`.
    Adapter {
        /// The pod's base model.
        base: String,
    },
    /// No reporting pod serves it.
    Unknown,
}

/// A pod as seen by metrics and `/explain`.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    /// Pod name, unique in the pool.
    pub name: String,
    /// "ip:port" Envoy sends requests to.
    pub endpoint: String,
    /// Base model served.
    pub model: String,
    /// True while its agent stream is up (false during the grace period).
    pub connected: bool,
    /// Engine ready, as last reported (false before the first stats).
    pub ready: bool,
    /// Agent's health score in [0,1].
    pub health_score: f64,
    /// Agent's reason for the dominant health penalty ("" if healthy).
    pub health_reason: String,
    /// Reported `num_requests_waiting` + picker in-flight requests routed since that report.
    pub queue_depth: u32,
    /// Requests the picker routed to the pod and has not seen finish.
    pub in_flight: u32,
    /// Envoy could not connect to the pod's endpoint and no probe has succeeded since (not a
    /// candidate meanwhile).
    pub unreachable: bool,
    /// The agent's last stats are older than the report-age limit (health capped, see
    /// [`STALE_REPORT_HEALTH`]).
    pub report_stale: bool,
    /// GPU utilization in [0,1] (max over the pod's GPUs).
    pub gpu_utilization: f64,
    /// vLLM KV-cache usage in [0,1].
    pub kv_cache_usage: f64,
    /// LoRA adapters loaded and running.
    pub running_adapters: Vec<String>,
    /// Blocks the pod holds in the index.
    pub blocks: u64,
    /// Price in $/hour from the `kvroute.io/cost-per-hour` annotation, if valid.
    pub cost_per_hour: Option<f64>,
}

/// Wall clock in ms since the Unix epoch (0 if the clock is before 1970).
pub(crate) fn now_unix_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl PodRecord {
    /// docs/design.md §4 queueDepth: reported waiting + in-flight routed at/after the report's timestamp.
    /// Without a report, every in-flight request counts; with a stale one (`stale`, see
    /// [`PodStatus::report_stale`]) too, on top of the last reported waiting count.
    pub(crate) fn queue_depth(&self, status: &PodStatus, stale: bool) -> u32 {
        let reported = status.stats.as_ref().map(|s| (s.num_requests_waiting, s.observed_at_unix_ms));
        self.queue_depth_from(reported, stale)
    }

    /// [`PodRecord::queue_depth`] from the copy of the status a decision reads.
    pub(crate) fn queue_depth_hot(&self, hot: &PodHot, stale: bool) -> u32 {
        let reported = hot.has_stats.then_some((hot.num_requests_waiting, hot.observed_at_unix_ms));
        self.queue_depth_from(reported, stale)
    }

    /// queueDepth from the report's `(waiting, observed_at_unix_ms)`, if any.
    fn queue_depth_from(&self, reported: Option<(u32, i64)>, stale: bool) -> u32 {
        match reported {
            Some((waiting, _)) if stale => waiting.saturating_add(self.inflight.len()),
            Some((waiting, observed_at)) => waiting.saturating_add(self.inflight.since(observed_at)),
            None => self.inflight.len(),
        }
    }

    /// Whether Envoy's last connection attempt to the pod failed (and no probe succeeded since).
    pub(crate) fn is_unreachable(&self) -> bool {
        self.unreachable.load(Ordering::Acquire)
    }
}

/// The instant before which a report received is older than `max_age` at `now` (`None` when
/// that lies before any instant the clock can hold, so no report can be). A decision computes it
/// once: comparing instants is cheaper than a duration per pod.
pub(crate) fn stale_before(now: Instant, max_age: Duration) -> Option<Instant> {
    now.checked_sub(max_age)
}

impl PodStatus {
    /// Whether the pod has stats older than `max_age` (its agent went silent: SIGSTOPped,
    /// partitioned, wedged) at `now`.
    pub(crate) fn report_stale(&self, now: Instant, max_age: Duration) -> bool {
        self.report_stale_before(stale_before(now, max_age))
    }

    /// [`PodStatus::report_stale`] with its cutoff computed once for many pods
    /// ([`stale_before`]): stats received before `cutoff`.
    pub(crate) fn report_stale_before(&self, cutoff: Option<Instant>) -> bool {
        self.stats.is_some() && matches!((self.stats_at, cutoff), (Some(t), Some(c)) if t < c)
    }

    /// Health score and reason as scoring counts them: the reported ones, or with a stale report
    /// at most [`STALE_REPORT_HEALTH`] with [`STALE_REPORT_REASON`]. `None` without stats.
    pub(crate) fn effective_health(&self, stale: bool) -> Option<(f64, &str)> {
        let s = self.stats.as_ref()?;
        if stale_caps_health(s.health_score, stale) {
            return Some((STALE_REPORT_HEALTH, STALE_REPORT_REASON));
        }
        Some((s.health_score, s.health_reason.as_str()))
    }
}

/// Whether a stale report's `health` is counted as [`STALE_REPORT_HEALTH`] instead: a report older
/// than the age limit is unknown, not perfect. A NaN health is never capped (it stays unhealthy).
pub(crate) fn stale_caps_health(health: f64, stale: bool) -> bool {
    stale && health >= STALE_REPORT_HEALTH
}

impl Pool {
    /// Creates the pool and starts its writer thread.
    pub fn new(config: PoolConfig) -> Arc<Pool> {
        let (tx, rx) = mpsc::channel(UPDATE_QUEUE);
        let table = Arc::new(ArcSwap::from_pointee(PodTable::default()));
        let index = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
        let cpu_index = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
        writer::spawn(config.clone(), rx, table.clone(), index.clone(), cpu_index.clone());
        Arc::new(Pool {
            config,
            table,
            index,
            cpu_index,
            select_lock: Mutex::new(()),
            tx,
            next_slot: AtomicU64::new(1),
            membership: arc_swap::ArcSwapOption::empty(),
        })
    }

    /// Makes `view` the pool's membership (docs/design.md §14) and waits until the writer applied
    /// it: when this returns, decisions see exactly the view's Ready endpoints as candidates.
    /// Once set, the pool never goes back to agent-registered pods.
    pub async fn set_membership(&self, view: Arc<PoolView>) -> Result<(), PoolError> {
        self.membership.store(Some(view.clone()));
        self.update(PoolUpdate::Membership { view }).await?;
        self.sync().await
    }

    /// The pool view in force, if the pool has a pool source.
    pub fn membership(&self) -> Option<Arc<PoolView>> {
        self.membership.load_full()
    }

    /// Whether endpoint `name` (`<pod>-rank-<i>`) is a member: always without a pool source,
    /// otherwise only an endpoint of the pool view. The ingest checks reports with the stricter
    /// `ReportScope for Pool` (member and on the reporting agent's node); the writer checks
    /// membership again when it applies a report.
    pub fn admits(&self, name: &str) -> bool {
        match &*self.membership.load() {
            None => true,
            Some(view) => view.endpoint(name).is_some(),
        }
    }

    /// How far the engines behind the pool view's Ready endpoints answer, as their agents report
    /// (readiness, docs/design.md §14); `None` without a pool source or before the view synced.
    pub fn agent_coverage(&self) -> Option<Coverage> {
        let view = self.membership.load_full()?;
        if !view.synced {
            return None;
        }
        let table = self.table.load();
        let mut c = Coverage::default();
        for s in table.status.iter().filter(|s| s.member == Membership::PoolReady) {
            c.ready_endpoints += 1;
            match &s.stats {
                Some(st) if st.ready => c.engines_ready += 1,
                Some(_) => c.engines_unready += 1,
                None => {}
            }
        }
        // The view is stored before the writer applies it to the table: until it has, the
        // view's Ready endpoints count with no report, so that an empty table cannot read as
        // full coverage of a pool that has endpoints.
        c.ready_endpoints = c.ready_endpoints.max(view.candidates().count());
        Some(c)
    }

    /// How the pool's pods serve model id `name`, as their agents report it: as a base model,
    /// as a running LoRA adapter (on the base model of the first pod that runs it), or not at all
    /// (also when no agent has reported yet). Reads one table snapshot; the adapter lookup scans
    /// the pods (rewrite targets only, docs/design.md §14).
    pub fn served_as(&self, name: &str) -> Served {
        if name.is_empty() {
            return Served::Unknown;
        }
        let table = self.table.load();
        if table.by_model.contains_key(name) {
            return Served::Base;
        }
        table
            .status
            .iter()
            .filter(|s| !s.model.is_empty())
            .find(|s| s.stats.as_ref().is_some_and(|st| st.running_adapters.iter().any(|a| a == name)))
            .map_or(Served::Unknown, |s| Served::Adapter { base: s.model.clone() })
    }

    /// The configuration the pool runs with.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Queues an update for the writer (waits while the queue is full: backpressure).
    pub async fn update(&self, update: PoolUpdate) -> Result<(), PoolError> {
        self.tx.send(WriterMsg::Update(Box::new(update))).await.map_err(|_| PoolError::WriterGone)
    }

    /// Resolves once every update queued before this call is applied and visible to readers.
    pub async fn sync(&self) -> Result<(), PoolError> {
        let (done, wait) = oneshot::channel();
        self.tx.send(WriterMsg::Barrier(done)).await.map_err(|_| PoolError::WriterGone)?;
        wait.await.map_err(|_| PoolError::WriterGone)
    }

    /// Every live pod (allocates; for metrics and explain, not the hot path).
    pub fn pods(&self) -> Vec<PodView> {
        let table = self.table.load();
        let (now, max_age) = (Instant::now(), self.report_max_age());
        table
            .pods
            .iter()
            .map(|rec| {
                let st = rec.status.load();
                let stale = st.report_stale(now, max_age);
                let mut stats = st.stats.clone().unwrap_or_default();
                if let Some((score, reason)) = st.effective_health(stale) {
                    stats.health_score = score;
                    if stale {
                        stats.health_reason = reason.to_owned();
                    }
                } else if st.member == Membership::PoolReady {
                    // As scoring counts it (`epp_pod_health_score`, `/explain`): unknown, not 0.
                    stats.health_score = NO_REPORT_HEALTH;
                    stats.health_reason = NO_REPORT_REASON.to_owned();
                }
                PodView {
                    name: rec.name.to_string(),
                    endpoint: st.endpoint.to_string(),
                    model: st.model.clone(),
                    connected: st.connected,
                    ready: st.stats.as_ref().is_some_and(|s| s.ready),
                    health_score: stats.health_score,
                    health_reason: stats.health_reason,
                    queue_depth: rec.queue_depth(&st, stale),
                    in_flight: rec.inflight.len(),
                    unreachable: rec.is_unreachable(),
                    report_stale: stale,
                    gpu_utilization: stats.gpu_utilization,
                    kv_cache_usage: stats.kv_cache_usage,
                    running_adapters: stats.running_adapters,
                    blocks: rec.blocks.load(Ordering::Relaxed),
                    cost_per_hour: st.cost_per_hour,
                }
            })
            .collect()
    }

    /// The report-age limit ([`PoolConfig::max_report_age_ms`]).
    pub(crate) fn report_max_age(&self) -> Duration {
        Duration::from_millis(self.config.max_report_age_ms)
    }

    /// Marks pod `name` unreachable (Envoy could not connect to it, seen by a peer replica): it
    /// leaves the candidates until [`Pool::probe_unreachable`] finds it answering. Returns false for
    /// an unknown pod.
    pub fn mark_unreachable(&self, name: &str) -> bool {
        self.mark_unreachable_by(name, "a peer replica").is_some()
    }

    /// Marks pod `name` unreachable as seen by `seen_by`: None for an unknown pod, else whether
    /// the mark is new.
    pub fn mark_unreachable_by(&self, name: &str, seen_by: &str) -> Option<bool> {
        let table = self.table.load();
        table.pods.iter().find(|r| &*r.name == name).map(|rec| mark(rec, seen_by))
    }

    /// One probe round: to every pod marked unreachable, concurrently, a TCP connect (bounded by
    /// `timeout`) and `GET /health`; a pod whose engine answers with any HTTP status line within
    /// [`probe_answer_timeout`]`(timeout)` is a candidate again. An answer, not a connect alone:
    /// the kernel completes the handshake of a frozen (SIGSTOPped, wedged) engine's listening
    /// socket, which then never answers. Returns how many pods were marked before the round.
    pub async fn probe_unreachable(&self, timeout: Duration) -> usize {
        let marked: Vec<(Arc<PodRecord>, Arc<str>)> = {
            let table = self.table.load();
            table
                .pods
                .iter()
                .zip(table.status.iter())
                .filter(|(r, _)| r.is_unreachable())
                .map(|(r, s)| (r.clone(), s.endpoint.clone()))
                .collect()
        };
        let n = marked.len();
        let probes = marked.into_iter().map(|(rec, endpoint)| async move {
            if answers_http(&endpoint, timeout).await && rec.unreachable.swap(false, Ordering::AcqRel) {
                tracing::info!(pod = %rec.name, %endpoint, "endpoint answers again: a candidate again");
            }
        });
        futures::future::join_all(probes).await;
        n
    }

    /// Size of the prefix index as last published.
    pub fn index_stats(&self) -> IndexStats {
        self.index.load().stats()
    }

    /// Takes the selection lock: queue depths read while it is held count every reservation made
    /// before, and the reservation made through it is atomic with the read (see the module docs).
    /// Never hold it across an await.
    pub(crate) fn lock_selection(&self) -> Selection<'_> {
        Selection { pool: self, _guard: self.select_lock.lock() }
    }
}

/// How long [`Pool::probe_unreachable`] waits for an engine's answer after connecting: the
/// connect timeout, at least 1 s (a loaded engine's HTTP server may take a while to answer).
pub fn probe_answer_timeout(connect: Duration) -> Duration {
    connect.max(Duration::from_secs(1))
}

/// Whether `endpoint` accepts a TCP connection within `timeout` and answers `GET /health` with
/// an HTTP status line (any status) within [`probe_answer_timeout`]. Reads at most 5 bytes.
pub(crate) async fn answers_http(endpoint: &str, timeout: Duration) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(Ok(mut tcp)) = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(endpoint)).await else {
        return false;
    };
    let exchange = async {
        tcp.write_all(b"GET /health HTTP/1.1\r\nHost: kvroute-probe\r\nConnection: close\r\n\r\n").await?;
        let mut head = [0u8; 5];
        tcp.read_exact(&mut head).await?;
        Ok::<_, std::io::Error>(&head == b"HTTP/")
    };
    matches!(tokio::time::timeout(probe_answer_timeout(timeout), exchange).await, Ok(Ok(true)))
}

/// Marks `rec` unreachable, logging the first mark with who saw the failure (`seen_by`); true
/// when it was not marked before.
pub(crate) fn mark(rec: &PodRecord, seen_by: &str) -> bool {
    let fresh = !rec.unreachable.swap(true, Ordering::AcqRel);
    if fresh {
        tracing::warn!(pod = %rec.name, seen_by, "Envoy could not connect to the endpoint: not a candidate until it accepts connections");
    }
    fresh
}

/// The selection lock, held ([`Pool::lock_selection`]); released when dropped or when it reserves.
pub(crate) struct Selection<'a> {
    pool: &'a Pool,
    _guard: MutexGuard<'a, ()>,
}

impl Selection<'_> {
    /// Reserves an in-flight slot on `rec` (whose published status is `status`) routed at
    /// `routed_ms` (ms since the Unix epoch, the router's clock), predicting `matched_blocks`
    /// cached blocks, and releases the lock.
    pub(crate) fn reserve(
        self,
        rec: &Arc<PodRecord>,
        status: &PodStatus,
        matched_blocks: u32,
        routed_ms: i64,
    ) -> InFlightSlot {
        let Selection { pool, _guard: guard } = self;
        let id = pool.next_slot.fetch_add(1, Ordering::Relaxed);
        rec.inflight.reserve(routed_ms, id);
        drop(guard);
        // The claim is counted in index blocks; the engine caches (and its usage counts) whole
        // engine blocks, so the staleness tolerance is one engine block.
        let index_block = pool.config.block_size as u64;
        let engine_block = match status.block_size {
            0 => index_block,
            b => u64::from(b),
        };
        InFlightSlot {
            rec: rec.clone(),
            id,
            routed_ms,
            predicted_tokens: u64::from(matched_blocks) * index_block,
            block_size: engine_block,
            on_release: None,
            ttft: None,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
