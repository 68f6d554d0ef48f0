//! The agent's configuration file (YAML, `--config agent.yaml`). One struct, unknown fields
//! rejected, every default and unit documented; [`AgentConfig::validate`] checks it once at start.
//! `--gpu-source` overrides `gpu_source`; `NODE_NAME` (else the host name) fills `node_name`.

use serde::Deserialize;
use std::net::SocketAddr;

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
    /// The YAML did not match the schema.
    #[error("invalid config {path}: {source}")]
    Parse {
        /// Path given.
        path: String,
        /// Parser error (names the field and position).
        source: serde_norway::Error,
    },
    /// A value is out of range.
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Where GPU telemetry comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
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
            _ => Err(ConfigError::Invalid(format!("gpu_source {s:?}: expected \"nvml\" or \"mock:<scenario.yaml>\""))),
        }
    }
}

/// The agent's configuration (see `agent/agent.example.yaml`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Kubernetes node name. Default: `$NODE_NAME`, else the host name.
    #[serde(default)]
    pub node_name: Option<String>,
    /// Picker agent-ingest gRPC endpoints (`http://host:port`); each gets the full stream.
    /// Required, at least one.
    pub pickers: Vec<String>,
    /// `"nvml"` or `"mock:<scenario.yaml>"`. Default `"nvml"`; the `--gpu-source` flag overrides.
    #[serde(default = "default_gpu_source")]
    pub gpu_source: String,
    /// Listen address of the agent's own `/metrics` and `/healthz`. Default `127.0.0.1:9091`
    /// (port 0 = ephemeral).
    #[serde(default = "default_metrics_addr")]
    pub metrics_addr: SocketAddr,
    /// Engine `/metrics` scrape period, ms. Default 200.
    #[serde(default = "d200")]
    pub scrape_interval_ms: u64,
    /// Period of stats reports to the picker, ms. Default 2000 (seed: podReportIntervalMs).
    #[serde(default = "d2000")]
    pub report_interval_ms: u64,
    /// Longest time block changes are held to coalesce them, ms. Default 10.
    #[serde(default = "d10")]
    pub block_flush_ms: u64,
    /// Active inference probe period (and `/health`, `/v1/models` checks), ms. Default 5000.
    #[serde(default = "d5000")]
    pub probe_interval_ms: u64,
    /// Deadline of one probe request, ms. Default 2000.
    #[serde(default = "d2000")]
    pub probe_timeout_ms: u64,
    /// The engines on this node. Required, at least one.
    pub engines: Vec<EngineConfig>,
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
    /// The engine's `--max-num-seqs` (requests); mock GPU utilization = running / this. Default 256.
    #[serde(default = "d256")]
    pub max_num_seqs: u32,
    /// Tokens per block when `/metrics` does not say (vLLM `--block-size`). Default 16.
    #[serde(default = "d16")]
    pub block_size: u32,
    /// Operator annotations of the pod (as on the Kubernetes Pod), reported in `PodInfo` for
    /// custom scorers, e.g. `kvroute.io/cost-per-hour: "3.67"`. Default none.
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
}

fn default_gpu_source() -> String {
    "nvml".into()
}
fn default_metrics_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9091))
}
const fn d10() -> u64 {
    10
}
const fn d200() -> u64 {
    200
}
const fn d2000() -> u64 {
    2000
}
const fn d5000() -> u64 {
    5000
}
const fn d256() -> u32 {
    256
}
const fn d16() -> u32 {
    16
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

    /// Checks ranges and uniqueness; says which field is wrong.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.pickers.is_empty() {
            return bad("pickers: at least one picker endpoint is required".into());
        }
        for p in &self.pickers {
            if !(p.starts_with("http://") || p.starts_with("https://")) {
                return bad(format!("pickers: {p:?} must start with http:// or https://"));
            }
        }
        self.gpu_source.parse::<GpuSourceSpec>()?;
        for (name, v) in [
            ("scrape_interval_ms", self.scrape_interval_ms),
            ("report_interval_ms", self.report_interval_ms),
            ("probe_interval_ms", self.probe_interval_ms),
            ("probe_timeout_ms", self.probe_timeout_ms),
        ] {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        if self.engines.is_empty() {
            return bad("engines: at least one engine is required".into());
        }
        let mut pods = std::collections::HashSet::new();
        for e in &self.engines {
            if e.pod.is_empty() || !pods.insert(e.pod.as_str()) {
                return bad(format!("engines: pod name {:?} is empty or repeated", e.pod));
            }
            if e.endpoint.parse::<SocketAddr>().is_err() && !e.endpoint.contains(':') {
                return bad(format!("engines[{}].endpoint {:?}: expected ip:port", e.pod, e.endpoint));
            }
            for (field, ep) in [("kv_events", &e.kv_events), ("kv_replay", &e.kv_replay)] {
                if let Some(ep) = ep
                    && !ep.contains("://")
                {
                    return bad(format!(
                        "engines[{}].{field} {ep:?}: expected a ZeroMQ endpoint like tcp://ip:port",
                        e.pod
                    ));
                }
            }
            if e.max_num_seqs == 0 || e.block_size == 0 {
                return bad(format!("engines[{}]: max_num_seqs and block_size must be > 0", e.pod));
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
        assert_eq!(min.gpu_source.parse::<GpuSourceSpec>().expect("spec"), GpuSourceSpec::Nvml);
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
            "pickers: [\"http://x:1\"]\ngpu_source: cuda\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
            "pickers: [\"http://x:1\"]\nscrape_interval_ms: 0\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
        ] {
            let cfg: AgentConfig = serde_norway::from_str(yaml).expect("parses");
            assert!(cfg.validate().is_err(), "{yaml}");
        }
        assert_eq!("mock:a.yaml".parse::<GpuSourceSpec>().expect("mock"), GpuSourceSpec::Mock("a.yaml".into()));
    }
}
