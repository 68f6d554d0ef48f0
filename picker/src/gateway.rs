//! [`Gateway`]: what the request path shares (docs/design.md §3–§5): the pod pool with its prefix
//! index, the router, the configured InferenceModels and the metrics. Built once from a validated
//! config; the ext_proc tasks and the admin server hold it by `Arc`.
//!
//! Concurrency: immutable after start; the pool's own writer/reader model is described in
//! [`crate::pool`].
//!
//! Layering: under the decision pipeline and the servers, on the router, the pool, the models
//! and the pending view; it has its own build error ([`GatewayError`]), which the server's
//! `StartError` wraps, so it needs nothing from the wiring above it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwapOption;
use kvroute_cluster::ModelTable;

use crate::config::PickerConfig;
use crate::config::PoolSource;
use crate::metrics::{Metrics, PodGauges, ReplicaCounts, RoutingCounts, Scrape};
use crate::model::{ModelRegistry, ResolvedModel};
use crate::pending::ReplicaIdentity;
use crate::pool::{InFlightSlot, Pool, Served};
use crate::request::ModelError;
use crate::score::{Router, ScoringConfigError};

/// Why the request path's state could not be built from a validated config.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// The scoring section was rejected by the router.
    #[error("invalid scoring config: {0}")]
    Scoring(#[from] ScoringConfigError),
}

/// What the request path shares: read-only after start.
#[derive(Debug)]
pub struct Gateway {
    /// Pods, their state and the prefix index.
    pub pool: Arc<Pool>,
    /// Scoring and selection.
    pub router: Router,
    /// Configured InferenceModels.
    pub models: ModelRegistry,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Largest request body parsed, in bytes (413 above).
    pub body_limit_bytes: usize,
    /// Longest wait from an ext_proc stream's request headers to the end of its body (408 after).
    pub body_timeout: std::time::Duration,
    /// Model used for requests without a body (the first configured model).
    pub default_model: Option<String>,
    /// This picker on the replica stream (docs/design.md §4): its id and counters.
    pub replica: Arc<ReplicaIdentity>,
    /// The pool source's model table (InferenceObjective priorities, docs/design.md §14);
    /// `None` without a pool source.
    pub model_table: ArcSwapOption<ModelTable>,
    /// Readiness (docs/design.md §14): false until the pool view synced and agents cover
    /// `ready_coverage` of its Ready endpoints or `ready_timeout_ms` passed; true from the start
    /// without a pool source. Never goes back to false.
    pub ready: AtomicBool,
    /// Set on SIGTERM: readiness stays NOT_SERVING from then on.
    pub draining: AtomicBool,
    /// Client models resolve through the watched InferenceModelRewrite table before `models`
    /// (the Kubernetes pool source, docs/design.md §14); file mode resolves through `models` only.
    pub rewrites: bool,
    /// Pods whose engine stopped answering with requests in flight ([`crate::frozen`]).
    pub frozen: Arc<crate::frozen::FrozenPods>,
    /// Bounds on what one request may cost to decide (`limits:`).
    pub request_bounds: crate::limits::RequestBounds,
}

/// What a request's `model` resolved to.
#[derive(Debug, Clone)]
pub struct Resolution {
    /// The model scoring and hashing use (the rewrite target's base model and adapter).
    pub model: Arc<ResolvedModel>,
    /// The model id the engine must see when it differs from the client's (the body's `model` is
    /// rewritten to it, as the GIE endpoint picker does).
    pub rewrite: Option<String>,
}

impl Gateway {
    /// Builds the pool, router and models from a validated config.
    pub fn new(config: &PickerConfig) -> Result<Self, GatewayError> {
        let pool = Pool::new(config.pool());
        let router = Router::new(pool.clone(), config.scoring.clone())?;
        let metrics = Metrics::new();
        // GIE's target model is what the engine serves: the adapter when there is one.
        metrics.register_models(
            config.models.iter().map(|m| (m.name.as_str(), m.adapter.as_deref().unwrap_or(m.target()))),
        );
        Ok(Self {
            pool,
            router,
            models: ModelRegistry::load(&config.models, config.block_size),
            metrics,
            body_limit_bytes: config.body_limit_bytes,
            body_timeout: config.limits.body_timeout(),
            default_model: config.models.first().map(|m| m.name.clone()),
            replica: ReplicaIdentity::new(),
            model_table: ArcSwapOption::empty(),
            ready: AtomicBool::new(config.pool_source().is_none()),
            draining: AtomicBool::new(false),
            rewrites: matches!(config.pool_source(), Some(PoolSource::Kubernetes(_))),
            frozen: Arc::new(crate::frozen::FrozenPods::new(std::time::Duration::from_millis(
                config.limits.frozen_engine_ms,
            ))),
            request_bounds: config.limits.request_bounds(),
        })
    }

    /// Whether the picker reports SERVING (see [`Gateway::ready`]).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.draining.load(Ordering::Acquire)
    }

    /// Envoy could not connect to the pod `slot` was reserved on: the pod leaves the candidates
    /// until a TCP probe connects to it, and, when the mark is new, peer replicas are told so
    /// they stop routing there too (docs/design.md §4 "One view across replicas").
    pub fn endpoint_unreachable(&self, slot: &InFlightSlot) {
        if slot.mark_unreachable() {
            self.router.shared().unreachable(slot.pod_name().clone());
        }
    }

    /// The engine of pod `name` answers nothing with requests in flight ([`crate::frozen`]): the
    /// pod leaves the candidates until it answers the probe, and, when the mark is new, peer
    /// replicas are told.
    pub fn engine_frozen(&self, name: &Arc<str>) {
        if self.pool.mark_unreachable_by(name, "the frozen-engine probe") == Some(true) {
            self.router.shared().unreachable(name.clone());
        }
    }

    /// Resolves the client model `name` (docs/design.md §14). With the Kubernetes pool source, a
    /// rule of the InferenceModelRewrite table matching `name` picks a target (weighted draw);
    /// the target's base model and adapter come from a `models[]` entry of that name, else from
    /// what the engines report (a base model they serve, or a running LoRA adapter), else the
    /// target is taken as a base model. Without a rule: the `models[]` entry `name`, else (with
    /// the Kubernetes source) a model id the engines serve, passed through unchanged.
    /// Errors: [`ModelError::UnknownModel`] when nothing resolves `name` (404).
    pub fn resolve(&self, name: &str) -> Result<Resolution, ModelError> {
        if self.rewrites
            && let Some(table) = self.model_table.load().as_ref()
            && let Some(target) = table.rule_for(name).and_then(|r| r.pick(rand::random()))
        {
            let model = self.target_model(&target.model, target.adapter.as_deref());
            let rewrite = (target.model != name).then(|| target.model.clone());
            return Ok(Resolution { model, rewrite });
        }
        if let Some(m) = self.models.resolve(name) {
            return Ok(Resolution { model: m.clone(), rewrite: None });
        }
        if self.rewrites && self.pool.served_as(name) != Served::Unknown {
            return Ok(Resolution { model: self.target_model(name, None), rewrite: None });
        }
        Err(ModelError::UnknownModel(name.to_owned()))
    }

    /// The model of rewrite target `target` (see [`Gateway::resolve`]).
    fn target_model(&self, target: &str, adapter: Option<&str>) -> Arc<ResolvedModel> {
        if let Some(a) = adapter {
            return self.models.target(target, Some(a));
        }
        if let Some(m) = self.models.resolve(target) {
            return m.clone();
        }
        match self.pool.served_as(target) {
            Served::Adapter { base } => self.models.target(&base, Some(target)),
            Served::Base | Served::Unknown => self.models.target(target, None),
        }
    }

    /// `/metrics`: what the metrics count themselves, and what the pool, the router and the
    /// replica stream hold now, in the OpenMetrics text format. Ready and routable are the
    /// router's own filter's judgement ([`crate::score::pod_routing`], docs/design.md §4): a Ready
    /// endpoint no agent reports on is ready and routable (it routes by load), one an agent
    /// reports unready is neither; routable adds health at or above
    /// `health_exclusion_threshold`, reachable and queue below `max_queue`.
    pub fn render_metrics(&self) -> Result<String, std::fmt::Error> {
        self.metrics.render(|| {
            let scoring = self.router.config();
            let max_queue = scoring.max_queue;
            let routing: std::collections::HashMap<_, _> =
                crate::score::pod_routing(&self.pool, scoring).into_iter().map(|r| (r.name.to_string(), r)).collect();
            let pods = self
                .pool
                .pods()
                .into_iter()
                .map(|p| {
                    let r = routing.get(&p.name);
                    PodGauges {
                        ready: r.is_some_and(|r| r.ready),
                        routable: r.is_some_and(|r| r.routable),
                        reported: r.is_some_and(|r| r.reported),
                        name: p.name,
                        queue_depth: p.queue_depth,
                        health_score: p.health_score,
                        unreachable: p.unreachable,
                        kv_cache_usage: p.kv_cache_usage,
                    }
                })
                .collect();
            let index = self.pool.index_stats();
            let shared = self.router.shared();
            let credit = &shared.credit;
            let (pending, pending_entries) = {
                let st = shared.lock();
                (st.pending.counts(), st.pending.size().0)
            };
            let counters = &self.replica.counters;
            Scrape {
                max_queue,
                pods,
                index_nodes: index.nodes,
                index_entries: index.entries,
                index_bytes: index.bytes_estimate,
                routing: RoutingCounts {
                    indexed_blocks: credit.indexed_blocks.load(Ordering::Relaxed),
                    pending_blocks: credit.pending_blocks.load(Ordering::Relaxed),
                    pile_redirects: credit.pile_redirects.load(Ordering::Relaxed),
                    full_fleet_stays: credit.full_fleet_stays.load(Ordering::Relaxed),
                    pending_withheld: credit.pending_withheld.load(Ordering::Relaxed),
                    new_prefix_by_traffic: credit.new_prefix_by_traffic.load(Ordering::Relaxed),
                    new_prefix_by_cache: credit.new_prefix_by_cache.load(Ordering::Relaxed),
                    recorded_local: pending.recorded_local,
                    recorded_peer: pending.recorded_peer,
                    confirmed: pending.confirmed,
                    expired: pending.expired,
                    evicted: pending.evicted,
                    pending_entries,
                    ttft: credit.ttft_counts(),
                },
                replica: ReplicaCounts {
                    applied: counters.applied.load(Ordering::Relaxed),
                    refused: counters.refused.load(Ordering::Relaxed),
                    connected: counters.connected.load(Ordering::Relaxed),
                    disconnects: counters.disconnects.load(Ordering::Relaxed),
                    lagged: counters.lagged.load(Ordering::Relaxed),
                },
            }
        })
    }

    /// The priority of the request's InferenceObjective (header `x-llm-d-inference-objective`):
    /// 0 without one, for an unknown one, or without a pool source.
    pub fn priority(&self, objective: Option<&str>) -> i32 {
        self.model_table.load().as_ref().map_or(0, |t| t.priority(objective))
    }
}
