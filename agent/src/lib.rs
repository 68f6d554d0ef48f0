//! kvroute node agent (docs/design.md §7): watches the vLLM engines of one GPU node, scores their health,
//! translates their KV-cache events into kvroute block hashes and streams per-pod deltas to the
//! picker(s).

pub mod app;
pub mod config;
pub mod engine;
mod engines;
pub mod gpu;
pub mod health;
mod node;
mod pickers;
pub mod report;
mod scrape_loop;
pub mod telemetry;
