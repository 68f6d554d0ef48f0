//! kvroute picker: KV-cache-aware Envoy ext_proc endpoint picker (docs/design.md §1, §3–§5, §9).
//!
//! Four listeners, all started by [`start`]:
//! - ext_proc gRPC ([`ext_proc`]): Envoy asks, per request, which pod serves it ([`decision`]);
//! - gRPC health alone (GIE's `--grpc-health-port`), the probes' port;
//! - AgentIngest gRPC ([`ingest`]): agents stream pod state and KV blocks into the [`pool`];
//! - admin HTTP ([`admin`]): `/metrics`, `/healthz`, `/explain` (the same [`decision`] pipeline,
//!   scored without routing).
//!
//! Rooms: [`server`] is the wiring (listeners, tasks, shutdown), [`gateway`] the state the request
//! path shares ([`Gateway`]: pool, router, models, metrics; immutable after start, shared by
//! `Arc`). The pool's own writer/reader model is described in [`pool`]. Shutdown is cooperative
//! through [`RunningPicker::shutdown`].
//!
//! Layers (imports point down only; `scripts/check-imports` fails on a cycle):
//! - [`server`] wires everything below;
//! - [`ext_proc`], [`admin`] and [`replicas`] carry requests, scrapes and peer events in and out;
//! - [`decision`], the pipeline shared by routing and `/explain`, sits on
//! - [`gateway`], the shared state, which sits on [`model`] (resolution, tokenization), [`score`]
//!   (the router) and [`pending`]; [`config`] gathers the sections that [`approx`], [`ingest`],
//!   [`limits`], [`pool`] and [`score`] define, and [`gie`] reads GIE's `EndpointPickerConfig`
//!   onto it;
//! - [`score`] sits on [`pending`], which sits on [`pool`]; [`ingest`] and [`limits`] on [`pool`];
//! - leaves: [`request`] (what the request says, before any state), [`metrics`] (fed plain
//!   numbers at scrape time) and [`pool`].

pub mod admin;
pub mod approx;
pub mod config;
pub mod decision;
pub mod ext_proc;
pub mod frozen;
pub mod gateway;
pub mod gie;
pub mod ingest;
pub mod limits;
pub mod metrics;
pub mod model;
pub mod pending;
pub mod pool;
pub mod replicas;
pub mod request;
pub mod score;
pub mod server;

/// The prefix index lives in its own crate (no async runtime, fast benches); re-exported here.
pub use kvroute_index as index;

pub use gateway::Gateway;
pub use server::{
    DrainHandle, MIN_GRPC_MESSAGE_BYTES, RunningPicker, ShutdownHandle, StartError, start, start_with_kube,
    start_with_scope,
};
