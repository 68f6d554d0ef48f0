//! Runs a kvroute fleet as real processes on this machine: emulated vLLM engines, node agents in
//! mock-NVML mode, the picker and a real Envoy 1.40 with the config from `deploy/envoy/`.
//!
//! Used by the demo (`kvroute-demo`) and by the end-to-end tests in `tests/harness/tests/`.
//! Every process binds ephemeral ports on 127.0.0.1 and writes its logs under the run's work
//! directory (`target/kvroute-runs/<label>/`), which is kept after the run for post-mortems.
//! Dropping a [`Fleet`] kills every process it started. Also the shared test pieces: a fake node
//! agent for picker tests ([`FakeAgent`]) and the reports' percentile ([`stats::percentile`]).
//!
//! Binaries are looked up in `$KVROUTE_BIN_DIR`, else in `target/<profile>/` of this workspace
//! (the profile this crate was built with); build them first (`cargo build --bins`).

pub mod client;
pub mod fake_agent;
pub mod fleet;
pub mod inference_perf;
pub mod paths;
pub mod process;
pub mod run;
pub mod stats;
pub mod tls;
pub mod workload;

pub use client::{ChatOutcome, GatewayClient};
pub use fake_agent::{FakeAgent, FakePod, poll_until};
pub use fleet::{DEFAULT_MODEL, EngineKind, Fleet, FleetSpec, VllmSpec};
pub use run::{Pacing, RunSummary, TurnRecord, run_chat_workload};
pub use workload::{Conversation, ScheduledTurn, Workload};
