//! Types shared by the kvroute agent and picker.
//!
//! - [`config`]: the field-structured error of both binaries' config files, and (feature `yaml`)
//!   the one way a YAML file is read and parsed.
//! - [`hash`]: the kvroute block hash (docs/design.md §2). Agent and picker must compute identical chains, so
//!   the one implementation lives here.
//! - `image` (feature `image`): inline images as vLLM identifies and sizes them.
//! - [`ids`]: newtypes for the hash kinds, so an engine's opaque hash can never stand in for ours.
//! - [`telemetry`]: JSON logging set-up used by every binary.
//! - [`listener`]: an HTTP/1 listener with header-read and idle timeouts and a connection bound.

pub mod config;
pub mod hash;
pub mod ids;
#[cfg(feature = "image")]
pub mod image;
#[cfg(feature = "listener")]
pub mod listener;
#[cfg(feature = "telemetry")]
pub mod telemetry;

/// Health-score penalty for a pod whose GPUs cannot be seen (docs/design.md §7): the agent
/// subtracts it when NVML has no such GPU or the pod's GPU assignment is unknown.
pub const GPU_UNSEEN_PENALTY: f64 = 0.3;

/// The health score of a pod whose GPU state is unknown, `1 − GPU_UNSEEN_PENALTY` = 0.7: what
/// the agent reports for a pod it cannot see the GPUs of, and what the picker counts for a Ready
/// pod no agent reports on, so that neither unknown ranks above the other.
pub const UNKNOWN_GPU_HEALTH: f64 = 1.0 - GPU_UNSEEN_PENALTY;

pub use hash::{BlockHasher, BlockKeys, DEFAULT_BLOCK_SIZE, ExtraKey, MmItem};
pub use ids::{BlockHash, EngineBlockHash};
