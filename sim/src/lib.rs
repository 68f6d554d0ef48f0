//! kvroute-sim: a discrete-event simulator that measures routing quality (docs/design.md §10).
//!
//! It drives kvroute's *real* pool, prefix index, router and approximate store
//! ([`policy::KvroutePolicy`]) and re-implementations of the peers' policies ([`policy`]) with
//! seeded workloads ([`workload`]) on modelled vLLM pods ([`engine`]: vLLM-style steps with chunked
//! prefill, decode slowing with batch size, KV held by running requests, prefix cache with LRU
//! eviction, preemption) whose cache changes reach the routers after a report delay ([`sim`]:
//! router replicas, traffic straight to pods, cache resets). [`report`] turns runs into tables
//! (cache hit rate, TTFT p50/p90/p99, throughput, per-pod load spread; warm-up left out) and
//! charts (SVG and PNG).
//!
//! Single-threaded apart from each kvroute pool's own writer thread; every run is deterministic
//! for a given seed.

pub mod engine;
pub mod policy;
pub mod report;
pub mod sim;
pub mod workload;

use std::path::PathBuf;

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A policy name that [`policy::build`] does not know.
    #[error("unknown policy '{0}'; known: {known}", known = policy::ALL.join(", "))]
    UnknownPolicy(String),
    /// The kvroute router refused its scoring config.
    #[error("kvroute scoring config rejected: {0}")]
    Scoring(String),
    /// The kvroute pool's writer stopped.
    #[error("kvroute pool: {0}")]
    Pool(#[from] kvroute_picker::pool::PoolError),
    /// No tokio runtime for the pool's async API.
    #[error("cannot build a tokio runtime: {0}")]
    Runtime(std::io::Error),
    /// A pod's engine cannot make progress (a request larger than its KV capacity).
    #[error("pod {pod}: {message}")]
    Engine {
        /// Pod index.
        pod: usize,
        /// What is stuck.
        message: String,
    },
    /// A run was given no router.
    #[error("a run needs at least one router replica")]
    NoRouter,
    /// A policy returned a pod outside the fleet.
    #[error("policy {policy} picked pod {pod}, outside the fleet")]
    BadPick {
        /// Policy name.
        policy: String,
        /// The bad index.
        pod: usize,
    },
    /// A trace file could not be read.
    #[error("cannot read trace {path}: {source}")]
    TraceOpen {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A trace line is not a valid request.
    #[error("trace {path}, line {line}: {message}")]
    TraceLine {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// Writing a report or chart failed.
    #[error("cannot write {path}: {message}")]
    Output {
        /// The file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
}
