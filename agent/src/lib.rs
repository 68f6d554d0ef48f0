//! kvroute node agent (docs/design.md §7): watches the vLLM engines of one GPU node, scores their health,
//! translates their KV-cache events into kvroute block hashes and streams per-pod deltas to the
//! picker(s).
//!
//! Layers (imports point down only; `scripts/check-imports` fails on a cycle): [`app`] wires the
//! rest; `engines` follows the engine set and starts one `scrape_loop` per engine; `pickers`
//! follows the picker set; [`report`] (the hub and the picker streams), [`gpu`] and `node` (the
//! node's shared sources) sit under them; [`config`] under those, on [`engine`] (the vLLM
//! readers); [`health`] and [`telemetry`] are leaves.

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
