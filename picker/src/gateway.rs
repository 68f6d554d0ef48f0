//! [`Gateway`]: what the request path shares (docs/design.md §3–§5): the pod pool with its prefix
//! index, the router, the configured InferenceModels and the metrics. Built once from a validated
//! config; the ext_proc tasks and the admin server hold it by `Arc`.
//!
//! Concurrency: immutable after start; the pool's own writer/reader model is described in
//! [`crate::pool`].

use std::sync::Arc;

use crate::admin::metrics::Metrics;
use crate::config::PickerConfig;
use crate::model::ModelRegistry;
use crate::pool::Pool;
use crate::replicas::ReplicaIdentity;
use crate::score::Router;
use crate::server::StartError;

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
    /// Model used for requests without a body (the first configured model).
    pub default_model: Option<String>,
    /// This picker on the replica stream (docs/design.md §4): its id and counters.
    pub replica: Arc<ReplicaIdentity>,
}

impl Gateway {
    /// Builds the pool, router and models from a validated config.
    pub fn new(config: &PickerConfig) -> Result<Self, StartError> {
        let pool = Pool::new(config.pool());
        let router = Router::new(pool.clone(), config.scoring.clone())?;
        Ok(Self {
            pool,
            router,
            models: ModelRegistry::load(&config.models, config.block_size),
            metrics: Metrics::new(),
            body_limit_bytes: config.body_limit_bytes,
            default_model: config.models.first().map(|m| m.name.clone()),
            replica: ReplicaIdentity::new(),
        })
    }
}
