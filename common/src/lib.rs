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

pub use hash::{BlockHasher, BlockKeys, DEFAULT_BLOCK_SIZE, ExtraKey, MmItem};
pub use ids::{BlockHash, EngineBlockHash};
