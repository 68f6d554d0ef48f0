//! The agent's configuration file (YAML, `--config agent.yaml`). One struct, unknown fields
//! rejected, every default and unit documented; [`AgentConfig::validate`] checks it once at start.
//! `--gpu-source` overrides `gpu_source`; `NODE_NAME` (else the host name) fills `node_name`.

use crate::report::hub::MIN_DELTA_QUEUE;
use serde::Deserialize;
use std::fmt::Display;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

/// Configuration errors: what was wrong and where.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// Path given.
        path: String,
        /// I/O error.
        source: std::io::Error,
    },
    /// The YAML did not match the schema (also: an unknown `gpu_source`).
    #[error("invalid config {path}: {source}")]
    Parse {
        /// Path given.
        path: String,
        /// Parser error (names the field and position).
        source: serde_norway::Error,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid config: {field} = {value}: {fix}")]
    Invalid {
        /// Which field, e.g. `engines["p"].endpoint`.
        field: String,
        /// Its value as given.
        value: String,
        /// What is wrong and what to do.
        fix: String,
    },
}

impl ConfigError {
    fn invalid(field: impl Into<String>, value: impl Display, fix: impl Into<String>) -> Self {
        ConfigError::Invalid { field: field.into(), value: value.to_string(), fix: fix.into() }
    }
}

/// Where GPU telemetry comes from: `nvml` or `mock:<scenario.yaml>` in the file and on the
/// command line, parsed once.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum GpuSourceSpec {
    /// Real GPUs through NVML (libnvidia-ml.so).
    Nvml,
    /// A mock scenario file replayed per GPU.
    Mock(String),
}

impl std::str::FromStr for GpuSourceSpec {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "nvml" => Ok(GpuSourceSpec::Nvml),
            Some(("mock", path)) if !path.is_empty() => Ok(GpuSourceSpec::Mock(path.to_string())),
            _ => Err(ConfigError::invalid(
                "gpu_source",
                format!("{s:?}"),
                "expected \"nvml\" or \"mock:<scenario.yaml>\"",
            )),
        }
    }
}

impl TryFrom<String> for GpuSourceSpec {
    type Error = ConfigError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// Default `metrics_addr`.
pub const DEFAULT_METRICS_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9091));
/// Default `scrape_interval_ms`.
pub const DEFAULT_SCRAPE_INTERVAL_MS: u64 = 200;
/// Default `report_interval_ms` (docs/design.md §7: the pod report interval).
pub const DEFAULT_REPORT_INTERVAL_MS: u64 = 2000;
/// Default `block_flush_ms`.
pub const DEFAULT_BLOCK_FLUSH_MS: u64 = 10;
/// Default `probe_interval_ms`.
pub const DEFAULT_PROBE_INTERVAL_MS: u64 = 5000;
/// Default `probe_timeout_ms`.
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 2000;
/// Default `kv_replay_timeout_ms`.
pub const DEFAULT_KV_REPLAY_TIMEOUT_MS: u64 = 1000;
/// Default `delta_queue`, in deltas.
pub const DEFAULT_DELTA_QUEUE: usize = 4096;
/// Default `metrics_header_timeout_ms`.
pub const DEFAULT_METRICS_HEADER_TIMEOUT_MS: u64 = 10_000;
/// Default `metrics_max_connections`.
pub const DEFAULT_METRICS_MAX_CONNECTIONS: usize = kvroute_common::listener::DEFAULT_MAX_CONNECTIONS;
/// Default `max_blocks_per_engine`.
pub const DEFAULT_MAX_BLOCKS_PER_ENGINE: usize = crate::engine::blocks::DEFAULT_MAX_BLOCKS;
/// Default `engines[].max_num_seqs` (vLLM's default `--max-num-seqs`).
pub const DEFAULT_MAX_NUM_SEQS: u32 = 256;

/// The agent's configuration (see `agent/agent.example.yaml`). `pickers` and `engines` are
/// required; every other field has the default named in its doc.
///
/// Sources: `engines:` is the static engine list of this node. The Kubernetes work adds the other
/// source of the same list, the engines discovered from the cluster (the node's pods of the
/// InferencePool); every other field applies to both.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Kubernetes node name. Default: `$NODE_NAME`, else the host name.
    pub node_name: Option<String>,
    /// Picker agent-ingest gRPC endpoints (`http://host:port`); each gets the full stream.
    /// Required, at least one.
    pub pickers: Vec<String>,
    /// `"nvml"` or `"mock:<scenario.yaml>"`. Default `"nvml"`; the `--gpu-source` flag overrides.
    pub gpu_source: GpuSourceSpec,
    /// Listen address of the agent's own `/metrics` and `/healthz`. Default
    /// [`DEFAULT_METRICS_ADDR`] (`127.0.0.1:9091`; port 0 = ephemeral).
    pub metrics_addr: SocketAddr,
    /// Longest wait of the metrics listener for a request's head, and for the next request on
    /// a kept-alive connection, ms; then the connection is closed. Default
    /// [`DEFAULT_METRICS_HEADER_TIMEOUT_MS`] (10 000).
    pub metrics_header_timeout_ms: u64,
    /// Most connections the metrics listener keeps open; past it the oldest connection that has
    /// not sent a request head is closed. Default [`DEFAULT_METRICS_MAX_CONNECTIONS`] (256).
    pub metrics_max_connections: usize,
    /// Most engine blocks the agent records per engine (all media; about 116 bytes each); stores
    /// past it are dropped and counted in `kvroute_agent_kv_blocks_dropped_total` (under-claim).
    /// Default [`DEFAULT_MAX_BLOCKS_PER_ENGINE`] (262 144, about 29 MiB per engine).
    pub max_blocks_per_engine: usize,
    /// Engine `/metrics` scrape period, ms. Default [`DEFAULT_SCRAPE_INTERVAL_MS`] (200).
    pub scrape_interval_ms: u64,
    /// Period of stats reports to the picker, ms. Default [`DEFAULT_REPORT_INTERVAL_MS`] (2000).
    pub report_interval_ms: u64,
    /// Longest time block changes are held to coalesce them, ms. Default
    /// [`DEFAULT_BLOCK_FLUSH_MS`] (10).
    pub block_flush_ms: u64,
    /// Active inference probe period (and `/health`, `/v1/models` checks), ms. Default
    /// [`DEFAULT_PROBE_INTERVAL_MS`] (5000).
    pub probe_interval_ms: u64,
    /// Deadline of one probe request, ms. Default [`DEFAULT_PROBE_TIMEOUT_MS`] (2000).
    pub probe_timeout_ms: u64,
    /// Deadline of one KV-event replay request to an engine's ROUTER socket, ms; a gap not
    /// replayed by then clears the pod's blocks (under-claim). Default
    /// [`DEFAULT_KV_REPLAY_TIMEOUT_MS`] (1000).
    pub kv_replay_timeout_ms: u64,
    /// Deltas queued for the picker streams (all pods together) before a slower stream falls
    /// behind and resends snapshots. Default [`DEFAULT_DELTA_QUEUE`] (4096); at least 16.
    pub delta_queue: usize,
    /// The engines on this node. Required, at least one.
    pub engines: Vec<EngineConfig>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            node_name: None,
            pickers: Vec::new(),
            gpu_source: GpuSourceSpec::Nvml,
            metrics_addr: DEFAULT_METRICS_ADDR,
            metrics_header_timeout_ms: DEFAULT_METRICS_HEADER_TIMEOUT_MS,
            metrics_max_connections: DEFAULT_METRICS_MAX_CONNECTIONS,
            max_blocks_per_engine: DEFAULT_MAX_BLOCKS_PER_ENGINE,
            scrape_interval_ms: DEFAULT_SCRAPE_INTERVAL_MS,
            report_interval_ms: DEFAULT_REPORT_INTERVAL_MS,
            block_flush_ms: DEFAULT_BLOCK_FLUSH_MS,
            probe_interval_ms: DEFAULT_PROBE_INTERVAL_MS,
            probe_timeout_ms: DEFAULT_PROBE_TIMEOUT_MS,
            kv_replay_timeout_ms: DEFAULT_KV_REPLAY_TIMEOUT_MS,
            delta_queue: DEFAULT_DELTA_QUEUE,
            engines: Vec::new(),
        }
    }
}

/// One vLLM engine (one pod).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Pod name, unique in the InferencePool.
    pub pod: String,
    /// `ip:port` of the engine's HTTP server (requests and `/metrics`); what Envoy dials.
    pub endpoint: String,
    /// Base model id (hash root). Default: the first id from `/v1/models`.
    #[serde(default)]
    pub model: Option<String>,
    /// The engine's ZeroMQ PUB endpoint, e.g. `tcp://127.0.0.1:5557`. Absent: no block reports.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// The engine's ZeroMQ ROUTER replay endpoint. Absent: gaps always lead to a clear.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// GPU indices this engine uses. Default none.
    #[serde(default)]
    pub gpus: Vec<u32>,
    /// The engine's `--max-num-seqs` (requests); mock GPU utilization = running / this. Default
    /// [`DEFAULT_MAX_NUM_SEQS`] (256).
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: u32,
    /// Tokens per block when `/metrics` does not say (vLLM `--block-size`). Default
    /// [`kvroute_common::DEFAULT_BLOCK_SIZE`] (16).
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Operator annotations of the pod (as on the Kubernetes Pod), reported in `PodInfo` for
    /// custom scorers, e.g. `kvroute.io/cost-per-hour: "3.67"`. Default none.
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
}

fn default_max_num_seqs() -> u32 {
    DEFAULT_MAX_NUM_SEQS
}
fn default_block_size() -> u32 {
    kvroute_common::DEFAULT_BLOCK_SIZE as u32
}

impl AgentConfig {
    /// Reads and validates a YAML file.
    pub fn load(path: &str) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        let cfg: AgentConfig =
            serde_norway::from_str(&text).map_err(|source| ConfigError::Parse { path: path.into(), source })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and uniqueness; the error names the field, its value and the fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, value: &dyn Display, fix: &str| Err(ConfigError::invalid(field, value, fix));
        if self.pickers.is_empty() {
            return bad("pickers", &"[]", "at least one picker endpoint is required");
        }
        for p in &self.pickers {
            if !(p.starts_with("http://") || p.starts_with("https://")) {
                return bad("pickers", &format!("{p:?}"), "must start with http:// or https://");
            }
        }
        for (name, v) in [
            ("scrape_interval_ms", self.scrape_interval_ms),
            ("report_interval_ms", self.report_interval_ms),
            ("probe_interval_ms", self.probe_interval_ms),
            ("probe_timeout_ms", self.probe_timeout_ms),
            ("kv_replay_timeout_ms", self.kv_replay_timeout_ms),
            ("metrics_header_timeout_ms", self.metrics_header_timeout_ms),
        ] {
            if v == 0 {
                return bad(name, &v, "must be > 0 (ms)");
            }
        }
        for (name, v) in [
            ("metrics_max_connections", self.metrics_max_connections),
            ("max_blocks_per_engine", self.max_blocks_per_engine),
        ] {
            if v == 0 {
                return bad(name, &v, "must be > 0");
            }
        }
        if self.delta_queue < MIN_DELTA_QUEUE {
            return bad("delta_queue", &self.delta_queue, "must be at least 16 (deltas)");
        }
        if self.engines.is_empty() {
            return bad("engines", &"[]", "at least one engine is required");
        }
        let mut pods = std::collections::HashSet::new();
        for e in &self.engines {
            if e.pod.is_empty() || !pods.insert(e.pod.as_str()) {
                return bad(
                    "engines[].pod",
                    &format!("{:?}", e.pod),
                    "is empty or repeated; give each engine its pod's name",
                );
            }
            let field = |f: &str| format!("engines[{:?}].{f}", e.pod);
            if e.endpoint.parse::<SocketAddr>().is_err() && !e.endpoint.contains(':') {
                return bad(&field("endpoint"), &format!("{:?}", e.endpoint), "expected ip:port");
            }
            for (f, ep) in [("kv_events", &e.kv_events), ("kv_replay", &e.kv_replay)] {
                if let Some(ep) = ep
                    && !ep.contains("://")
                {
                    return bad(&field(f), &format!("{ep:?}"), "expected a ZeroMQ endpoint like tcp://ip:port");
                }
            }
            for (f, v) in [("max_num_seqs", e.max_num_seqs), ("block_size", e.block_size)] {
                if v == 0 {
                    return bad(&field(f), &v, "must be > 0");
                }
            }
        }
        Ok(())
    }

    /// `node_name`, else `$NODE_NAME`, else the host name, else "unknown-node".
    pub fn resolved_node_name(&self) -> String {
        self.node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|s| !s.is_empty()))
            .or_else(|| sysinfo::System::host_name().ok())
            .unwrap_or_else(|| "unknown-node".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../agent.example.yaml");

    #[test]
    fn example_parses_with_defaults() {
        let cfg: AgentConfig = serde_norway::from_str(EXAMPLE).expect("example parses");
        cfg.validate().expect("example valid");
        assert_eq!(cfg.engines[0].gpus, vec![0]);
        assert_eq!(cfg.block_flush_ms, 10);
        let min: AgentConfig =
            serde_norway::from_str("pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n")
                .expect("minimal parses");
        assert_eq!((min.scrape_interval_ms, min.report_interval_ms, min.probe_timeout_ms), (200, 2000, 2000));
        assert_eq!(min.gpu_source, GpuSourceSpec::Nvml);
        assert_eq!((min.kv_replay_timeout_ms, min.delta_queue), (1000, 4096));
        assert!(min.engines[0].annotations.is_empty());
        assert_eq!(
            cfg.engines[0].annotations.get("kvroute.io/cost-per-hour").map(String::as_str),
            Some("3.67"),
            "annotations are read from the example"
        );
    }

    #[test]
    fn bad_configs_are_rejected() {
        assert!(serde_norway::from_str::<AgentConfig>("pickers: []\nengines: []\nbogus: 1\n").is_err());
        for yaml in [
            "pickers: []\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
            "pickers: [\"x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
            "pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}, {pod: p, endpoint: \"1.2.3.4:81\"}]\n",
            "pickers: [\"http://x:1\"]\nscrape_interval_ms: 0\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
            "pickers: [\"http://x:1\"]\nkv_replay_timeout_ms: 0\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
            "pickers: [\"http://x:1\"]\ndelta_queue: 8\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
            "pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\", max_num_seqs: 0}]\n",
        ] {
            let cfg: AgentConfig = serde_norway::from_str(yaml).expect("parses");
            match cfg.validate() {
                Err(ConfigError::Invalid { field, value, fix }) => {
                    assert!(!field.is_empty() && !value.is_empty() && !fix.is_empty(), "{yaml}")
                }
                other => panic!("{yaml}: {other:?}"),
            }
        }
        assert_eq!("mock:a.yaml".parse::<GpuSourceSpec>().expect("mock"), GpuSourceSpec::Mock("a.yaml".into()));
        // An unknown GPU source is refused when the file is read, naming the field.
        let err = serde_norway::from_str::<AgentConfig>(
            "pickers: [\"http://x:1\"]\ngpu_source: cuda\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
        )
        .expect_err("cuda is no GPU source")
        .to_string();
        assert!(err.contains("gpu_source") && err.contains("cuda"), "{err}");
    }
}
