//! The agent's configuration file (YAML, `--config agent.yaml`). One struct, unknown fields
//! rejected, every default and unit documented; [`AgentConfig::validate`] checks it once at start.
//! `--gpu-source` overrides `gpu_source`; `--pool-name` / `--pool-namespace` set `pool`;
//! `NODE_NAME` (else, outside Kubernetes, the host name) fills `node_name`.
//!
//! Two choices (docs/design.md §14), each made by which field is set:
//! - engines ([`EngineSource`]): `pool` (Kubernetes: the InferencePool's pods on this node),
//!   `engine_file` (a static engine file, re-read when it changes) or `engines` (a static list
//!   in this file, fixed until restart);
//! - pickers ([`PickerSource`]): `picker_service` (every replica behind the picker's headless
//!   Service, from its EndpointSlices) or `pickers` (a static list).

use kvroute_cluster::engine::{EngineSpec, GpuRef};
use kvroute_cluster::pool::endpoint_name;
use kvroute_cluster::{NodeView, PoolRef, Source};
use kvroute_common::config::{InvalidField, YamlFileError, load_yaml};
use serde::Deserialize;
use std::fmt::Display;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Configuration errors: what was wrong and where.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read, or its YAML did not match the schema (also: an unknown
    /// `gpu_source`).
    #[error(transparent)]
    File(#[from] YamlFileError),
    /// A value is out of range or inconsistent: which field, its value, what to do.
    #[error("invalid config: {0}")]
    Invalid(#[from] InvalidField),
}

impl ConfigError {
    fn invalid(field: impl Into<String>, value: impl Display, fix: impl Into<String>) -> Self {
        ConfigError::Invalid(InvalidField::new(field, value, fix))
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
/// Smallest `delta_queue`, and the smallest broadcast backlog of deltas the hub makes.
pub const MIN_DELTA_QUEUE: usize = 16;
/// Default `metrics_header_timeout_ms`.
pub const DEFAULT_METRICS_HEADER_TIMEOUT_MS: u64 = 10_000;
/// Default `metrics_max_connections`.
pub const DEFAULT_METRICS_MAX_CONNECTIONS: usize = kvroute_common::listener::DEFAULT_MAX_CONNECTIONS;
/// Default `max_blocks_per_engine`.
pub const DEFAULT_MAX_BLOCKS_PER_ENGINE: usize = crate::engine::blocks::DEFAULT_MAX_BLOCKS;
/// Largest `index_block_size`, in tokens.
pub const MAX_INDEX_BLOCK_SIZE: u32 = 4096;
/// Default `engines[].max_num_seqs` (vLLM's default `--max-num-seqs`).
pub const DEFAULT_MAX_NUM_SEQS: u32 = 256;
/// Default `engine_file_poll_ms`.
pub const DEFAULT_ENGINE_FILE_POLL_MS: u64 = 500;
/// Default `pod_resources_socket`: the kubelet's PodResources API.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = kvroute_cluster::podresources::DEFAULT_SOCKET;
/// Default `pod_resources_poll_ms`.
pub const DEFAULT_POD_RESOURCES_POLL_MS: u64 = 2000;
/// Default `picker_service.port`: the name of the picker Service's agent-ingest port.
pub const DEFAULT_PICKER_PORT_NAME: &str = "ingest";

/// The agent's configuration (see `agent/agent.example.yaml`). One engine source (`pool`,
/// `engine_file` or `engines`) and one picker source (`picker_service` or `pickers`) are
/// required; every other field has the default named in its doc.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Node name, sent in `Hello` and (Kubernetes) the `spec.nodeName` whose pods the agent
    /// serves. Default: `$NODE_NAME` (the downward API's `spec.nodeName`), else, outside
    /// Kubernetes only, the host name.
    pub node_name: Option<String>,
    /// Static picker agent-ingest gRPC endpoints (`http://host:port`); each gets the full
    /// stream. One picker source is required: this or `picker_service`.
    pub pickers: Vec<String>,
    /// The picker's headless Service: every replica behind it gets the full stream, streams
    /// opening and closing as replicas come and go (EndpointSlices). Default none.
    pub picker_service: Option<PickerServiceConfig>,
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
    /// Tokens per block of the kvroute hashes sent to the pickers: their `block_size` (the index
    /// granularity, docs/design.md §2). Each engine's `--block-size` must be a multiple of it
    /// (16 serves engines of 16, 32 and 64); an engine block is re-hashed as that many index
    /// blocks. Default [`kvroute_common::DEFAULT_BLOCK_SIZE`] (16), at most
    /// [`MAX_INDEX_BLOCK_SIZE`].
    pub index_block_size: u32,
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
    /// A static list of the engines on this node, fixed until restart. One engine source is
    /// required: this, `engine_file` or `pool`.
    pub engines: Vec<EngineConfig>,
    /// A static engine file (format: `kvroute_cluster::file`, docs/operations.md), re-read when
    /// its content changes: engines start and stop with its entries, without a restart.
    /// Default none.
    pub engine_file: Option<String>,
    /// How often `engine_file` is checked for changes, ms. Default
    /// [`DEFAULT_ENGINE_FILE_POLL_MS`] (500).
    pub engine_file_poll_ms: u64,
    /// Kubernetes: the InferencePool whose pods on this node are the engines (one per pod and
    /// target port). `--pool-name` / `--pool-namespace` set it. Default none.
    pub pool: Option<PoolConfig>,
    /// Kubernetes: the kubelet's PodResources socket (pod → GPU UUIDs). Default
    /// [`DEFAULT_POD_RESOURCES_SOCKET`].
    pub pod_resources_socket: String,
    /// Kubernetes: how often PodResources is listed, ms (also at once when a pod appears).
    /// Default [`DEFAULT_POD_RESOURCES_POLL_MS`] (2000).
    pub pod_resources_poll_ms: u64,
    /// TLS to the pickers (docs/design.md §14): the agent verifies the picker's certificate and
    /// proves its node with `picker_token`, or with its own certificate (`cert_file`,
    /// `key_file`). One of this and `insecure_ingest` is required to start. Default none.
    pub picker_tls: Option<PickerTlsConfig>,
    /// Token identity towards the pickers (needs `picker_tls`). Default none.
    pub picker_token: Option<PickerTokenConfig>,
    /// Report to the pickers in plaintext (the local demo); logged as a warning. Also
    /// `--insecure-ingest`. Default false.
    pub insecure_ingest: bool,
}

/// Default `picker_tls.server_name`: the DNS SAN every picker certificate carries.
pub const DEFAULT_PICKER_SERVER_NAME: &str = "picker.kvroute";

/// The agent's TLS files (PEM, as a Kubernetes Secret mounts them), read again for every new
/// connection, so a rotated certificate, or a CA bundle with a CA added or removed, is used from
/// the next (re)connect on.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PickerTlsConfig {
    /// CA bundle the picker's certificate must chain to (`ca.crt`): one or more PEM
    /// certificates (during a CA rotation, the old and the new CA; docs/operations.md).
    pub ca_file: String,
    /// This agent's certificate chain (`tls.crt`), naming the node as DNS SAN
    /// `<node>.agent.kvroute`: certificate identity. Leave out with `picker_token`.
    #[serde(default)]
    pub cert_file: Option<String>,
    /// Its private key (`tls.key`); with `cert_file`.
    #[serde(default)]
    pub key_file: Option<String>,
    /// The name the picker's certificate must carry. Default [`DEFAULT_PICKER_SERVER_NAME`].
    #[serde(default = "default_picker_server_name")]
    pub server_name: String,
}

/// Default `picker_token.token_file`: where the DaemonSet's projected token volume puts it.
pub const DEFAULT_PICKER_TOKEN_FILE: &str = "/var/run/secrets/kvroute/token";
/// Longest token file read, in bytes.
pub const MAX_PICKER_TOKEN_BYTES: u64 = 16 * 1024;

/// Token identity towards the pickers (docs/design.md §14): the pod's projected, audience-bound
/// ServiceAccount token, sent as `authorization: Bearer <token>` when a stream opens. The file is
/// read again for every new connection (the kubelet rewrites it before it expires).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PickerTokenConfig {
    /// The token file. Default [`DEFAULT_PICKER_TOKEN_FILE`].
    #[serde(default = "default_picker_token_file")]
    pub token_file: String,
}

fn default_picker_token_file() -> String {
    DEFAULT_PICKER_TOKEN_FILE.into()
}

fn default_picker_server_name() -> String {
    DEFAULT_PICKER_SERVER_NAME.into()
}

/// The InferencePool an agent serves (docs/design.md §14).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The pool's name (the GIE EPP's `--pool-name`).
    pub name: String,
    /// Its namespace (`--pool-namespace`). Default: `$NAMESPACE`, else `default`, as the EPP.
    #[serde(default)]
    pub namespace: Option<String>,
}

/// The picker's headless Service (docs/design.md §14).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PickerServiceConfig {
    /// Service name (its EndpointSlices carry `kubernetes.io/service-name=<name>`).
    pub name: String,
    /// Namespace. Default: the pool's namespace, else `$NAMESPACE`, else `default`.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Name of the Service port agents report to. Default [`DEFAULT_PICKER_PORT_NAME`]
    /// (`ingest`).
    #[serde(default = "default_picker_port")]
    pub port: String,
}

fn default_picker_port() -> String {
    DEFAULT_PICKER_PORT_NAME.into()
}

/// Where the agent's engines come from.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineSource {
    /// `engines:` in the config file.
    Static(Arc<NodeView>),
    /// `engine_file:`, polled every `poll`.
    File {
        /// The file.
        path: String,
        /// Poll period.
        poll: Duration,
    },
    /// `pool:`: the pool's pods on this node.
    Kubernetes(PoolRef),
}

/// Where the picker replicas come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickerSource {
    /// `pickers:`.
    Static(Vec<String>),
    /// `picker_service:`: namespace, Service, port name.
    Service {
        /// Namespace.
        namespace: String,
        /// Service name.
        name: String,
        /// Port name.
        port: String,
    },
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
            index_block_size: kvroute_common::DEFAULT_BLOCK_SIZE as u32,
            max_blocks_per_engine: DEFAULT_MAX_BLOCKS_PER_ENGINE,
            scrape_interval_ms: DEFAULT_SCRAPE_INTERVAL_MS,
            report_interval_ms: DEFAULT_REPORT_INTERVAL_MS,
            block_flush_ms: DEFAULT_BLOCK_FLUSH_MS,
            probe_interval_ms: DEFAULT_PROBE_INTERVAL_MS,
            probe_timeout_ms: DEFAULT_PROBE_TIMEOUT_MS,
            kv_replay_timeout_ms: DEFAULT_KV_REPLAY_TIMEOUT_MS,
            delta_queue: DEFAULT_DELTA_QUEUE,
            engines: Vec::new(),
            picker_service: None,
            engine_file: None,
            engine_file_poll_ms: DEFAULT_ENGINE_FILE_POLL_MS,
            pool: None,
            pod_resources_socket: DEFAULT_POD_RESOURCES_SOCKET.into(),
            pod_resources_poll_ms: DEFAULT_POD_RESOURCES_POLL_MS,
            picker_tls: None,
            picker_token: None,
            insecure_ingest: false,
        }
    }
}

/// One vLLM engine: a pod's target port. Reported to the pickers as `<pod>-rank-<rank>`, the
/// name the GIE endpoint picker gives a pod's port (docs/design.md §14).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Pod name, unique in the InferencePool.
    pub pod: String,
    /// Index of the port in the pool's target ports (data-parallel rank). Default 0.
    #[serde(default)]
    pub rank: u32,
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
    /// GPUs this engine uses: NVML indices or UUIDs (`GPU-…`). Default none.
    #[serde(default)]
    pub gpus: Vec<GpuRef>,
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

impl EngineConfig {
    /// `<pod>-rank-<rank>`: the engine's name towards the pickers.
    pub fn name(&self) -> String {
        endpoint_name(&self.pod, self.rank)
    }

    /// The engine as the discovery sources describe one (`endpoint` must be `ip:port`, as
    /// [`AgentConfig::validate`] checks).
    pub fn to_spec(&self) -> Option<EngineSpec> {
        Some(EngineSpec {
            endpoint: self.name(),
            pod: self.pod.clone(),
            namespace: String::new(),
            uid: None,
            rank: self.rank,
            http: self.endpoint.parse().ok()?,
            ready: true,
            container: None,
            kv_events: self.kv_events.clone(),
            kv_replay: self.kv_replay.clone(),
            kv_topic: String::new(),
            model: self.model.clone(),
            served_model_names: Vec::new(),
            block_size: Some(self.block_size),
            max_num_seqs: Some(self.max_num_seqs),
            gpus: self.gpus.clone(),
            labels: Arc::default(),
            annotations: Arc::new(self.annotations.clone()),
            problems: Vec::new(),
        })
    }
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
        Self::load_with(path, |_| {})
    }

    /// Reads a YAML file, applies `overrides` (command-line flags), then validates.
    pub fn load_with(path: &str, overrides: impl FnOnce(&mut Self)) -> Result<Self, ConfigError> {
        let mut cfg: AgentConfig = load_yaml("config", Path::new(path))?;
        overrides(&mut cfg);
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and uniqueness; the error names the field, its value and the fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, value: &dyn Display, fix: &str| Err(ConfigError::invalid(field, value, fix));
        self.picker_source()?;
        if let Some(tls) = &self.picker_tls {
            match (&tls.cert_file, &tls.key_file, &self.picker_token) {
                (Some(_), None, _) | (None, Some(_), _) => {
                    return bad("picker_tls", &"cert_file/key_file", "give both cert_file and key_file, or neither");
                }
                (None, None, None) => {
                    return bad(
                        "picker_tls",
                        &"(no identity)",
                        "set picker_token (a projected ServiceAccount token) or cert_file and key_file",
                    );
                }
                _ => {}
            }
        }
        if self.picker_token.is_some() && self.picker_tls.is_none() {
            return bad("picker_token", &"set", "needs picker_tls (ca_file): the token travels only over TLS");
        }
        if self.picker_tls.is_some() && self.insecure_ingest {
            return bad("insecure_ingest", &true, "picker_tls is set too; choose mTLS or plaintext, not both");
        }
        for p in &self.pickers {
            if !(p.starts_with("http://") || p.starts_with("https://")) {
                return bad("pickers", &format!("{p:?}"), "must start with http:// or https://");
            }
        }
        if let Some(s) = &self.picker_service {
            if s.name.is_empty() {
                return bad("picker_service.name", &"\"\"", "name the picker's headless Service");
            }
            if s.port.is_empty() {
                return bad("picker_service.port", &"\"\"", "name the Service port agents report to (e.g. ingest)");
            }
        }
        for (name, v) in [
            ("scrape_interval_ms", self.scrape_interval_ms),
            ("report_interval_ms", self.report_interval_ms),
            ("probe_interval_ms", self.probe_interval_ms),
            ("probe_timeout_ms", self.probe_timeout_ms),
            ("kv_replay_timeout_ms", self.kv_replay_timeout_ms),
            ("metrics_header_timeout_ms", self.metrics_header_timeout_ms),
            ("engine_file_poll_ms", self.engine_file_poll_ms),
            ("pod_resources_poll_ms", self.pod_resources_poll_ms),
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
        if !(1..=MAX_INDEX_BLOCK_SIZE).contains(&self.index_block_size) {
            return bad(
                "index_block_size",
                &self.index_block_size,
                "must be 1..=4096 tokens: the pickers' block_size, a divisor of every engine's --block-size",
            );
        }
        if self.delta_queue < MIN_DELTA_QUEUE {
            return bad("delta_queue", &self.delta_queue, "must be at least 16 (deltas)");
        }
        if let Some(p) = &self.pool
            && p.name.is_empty()
        {
            return bad("pool.name", &"\"\"", "name the InferencePool (or pass --pool-name)");
        }
        if self.engine_file.as_deref() == Some("") {
            return bad("engine_file", &"\"\"", "give the engine file's path, or leave the field out");
        }
        self.engine_source_kind()?;
        let mut pods = std::collections::HashSet::new();
        for e in &self.engines {
            if e.pod.is_empty() || !pods.insert((e.pod.as_str(), e.rank)) {
                return bad(
                    "engines[].pod",
                    &format!("{:?}", e.pod),
                    "is empty or repeated with the same rank; give each engine its pod's name",
                );
            }
            let field = |f: &str| format!("engines[{:?}].{f}", e.name());
            if e.endpoint.parse::<SocketAddr>().is_err() {
                return bad(
                    &field("endpoint"),
                    &format!("{:?}", e.endpoint),
                    "expected ip:port (Envoy dials it as given)",
                );
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

    /// Which engine source is set: exactly one is required.
    fn engine_source_kind(&self) -> Result<&'static str, ConfigError> {
        let set: Vec<&'static str> = [
            (!self.engines.is_empty(), "engines"),
            (self.engine_file.is_some(), "engine_file"),
            (self.pool.is_some(), "pool"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        match set.as_slice() {
            [one] => Ok(one),
            [] => Err(ConfigError::invalid(
                "engines",
                "[]",
                "one engine source is required: pool (Kubernetes, or --pool-name), engine_file, or engines",
            )),
            many => Err(ConfigError::invalid(
                many.join(" + "),
                "both set",
                "choose one engine source: pool, engine_file or engines",
            )),
        }
    }

    /// The engine source. Node name and namespaces are resolved from the environment here.
    ///
    /// # Errors
    /// No source or several (as [`AgentConfig::validate`]).
    pub fn engine_source(&self) -> Result<EngineSource, ConfigError> {
        Ok(match self.engine_source_kind()? {
            "pool" => {
                let p = self.pool.as_ref().ok_or_else(|| ConfigError::invalid("pool", "none", "unreachable"))?;
                EngineSource::Kubernetes(PoolRef {
                    namespace: kvroute_cluster::pool_namespace(p.namespace.as_deref()),
                    name: p.name.clone(),
                })
            }
            "engine_file" => EngineSource::File {
                path: self.engine_file.clone().unwrap_or_default(),
                poll: Duration::from_millis(self.engine_file_poll_ms),
            },
            _ => {
                let mut engines: Vec<EngineSpec> = self.engines.iter().filter_map(EngineConfig::to_spec).collect();
                engines.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
                EngineSource::Static(Arc::new(NodeView {
                    source: Source::File("agent config engines".into()),
                    node: self.resolved_node_name(),
                    pool: None,
                    engines,
                    synced: true,
                    dropped_pods: 0,
                    generation: 1,
                }))
            }
        })
    }

    /// The picker source: exactly one of `pickers` and `picker_service`.
    ///
    /// # Errors
    /// Neither or both.
    pub fn picker_source(&self) -> Result<PickerSource, ConfigError> {
        match (&self.picker_service, self.pickers.is_empty()) {
            (Some(_), false) => Err(ConfigError::invalid(
                "pickers + picker_service",
                "both set",
                "choose one picker source: picker_service (Kubernetes) or pickers",
            )),
            (None, true) => Err(ConfigError::invalid(
                "pickers",
                "[]",
                "one picker source is required: picker_service (the picker's headless Service) or pickers",
            )),
            (None, false) => Ok(PickerSource::Static(self.pickers.clone())),
            (Some(s), true) => {
                let namespace = s.namespace.clone().or_else(|| self.pool.as_ref().and_then(|p| p.namespace.clone()));
                Ok(PickerSource::Service {
                    namespace: kvroute_cluster::pool_namespace(namespace.as_deref()),
                    name: s.name.clone(),
                    port: s.port.clone(),
                })
            }
        }
    }

    /// The node whose pods a Kubernetes agent serves: `node_name`, else `$NODE_NAME`; never the
    /// host name (a pod's host name is not its node's name).
    ///
    /// # Errors
    /// Neither is set.
    pub fn kubernetes_node_name(&self) -> Result<String, ConfigError> {
        self.node_name
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|s| !s.is_empty()))
            .ok_or_else(|| {
                ConfigError::invalid(
                    "node_name",
                    "unset",
                    "set NODE_NAME from the downward API (env valueFrom fieldRef spec.nodeName)",
                )
            })
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
        assert_eq!(cfg.engines[0].gpus, vec![GpuRef::Index(0)]);
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
            // Engine and picker sources: none, or two at once.
            "pickers: [\"http://x:1\"]\n",
            "pickers: [\"http://x:1\"]\nengine_file: e.yaml\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\n",
            "pickers: [\"http://x:1\"]\nengine_file: e.yaml\npool: {name: p}\n",
            "pool: {name: p}\n",
            "pickers: [\"http://x:1\"]\npicker_service: {name: s}\npool: {name: p}\n",
            "picker_service: {name: \"\"}\npool: {name: p}\n",
            "picker_service: {name: s}\npool: {name: \"\"}\n",
            "picker_service: {name: s}\nengine_file: \"\"\n",
            "picker_service: {name: s}\npool: {name: p}\npod_resources_poll_ms: 0\n",
            // An endpoint Envoy cannot dial as given.
            "pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"vllm.local:80\"}]\n",
            // TLS without an identity, half a certificate, or a token without TLS.
            "pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\npicker_tls: {ca_file: ca}\n",
            "pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\npicker_tls: {ca_file: ca, cert_file: c}\n",
            "pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\"}]\npicker_token: {}\n",
        ] {
            let cfg: AgentConfig = serde_norway::from_str(yaml).expect("parses");
            match cfg.validate() {
                Err(ConfigError::Invalid(InvalidField { field, value, fix })) => {
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

    #[test]
    fn sources_resolve_as_documented() {
        const K8S: &str = include_str!("../agent.kubernetes.example.yaml");
        let k: AgentConfig = serde_norway::from_str(K8S).expect("kubernetes example parses");
        k.validate().expect("kubernetes example valid");
        match k.engine_source().expect("engine source") {
            EngineSource::Kubernetes(p) => {
                assert_eq!((p.name.as_str(), p.namespace.as_str()), ("vllm-qwen", "inference"))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            k.picker_source().expect("picker source"),
            PickerSource::Service {
                namespace: "inference".into(),
                name: "kvroute-picker-ingest".into(),
                port: "ingest".into()
            },
            "the Service's namespace and port default to the pool's and `ingest`"
        );
        assert_eq!(k.pod_resources_socket, DEFAULT_POD_RESOURCES_SOCKET);
        let mut k = k;
        k.node_name = Some("gpu-node-7".into());
        assert_eq!(k.kubernetes_node_name().expect("node"), "gpu-node-7");

        let f: AgentConfig =
            serde_norway::from_str("pickers: [\"http://x:1\"]\nengine_file: /etc/e.yaml\n").expect("parses");
        f.validate().expect("a file source alone is enough: it may list no engine yet");
        assert_eq!(
            f.engine_source().expect("file"),
            EngineSource::File { path: "/etc/e.yaml".into(), poll: Duration::from_millis(DEFAULT_ENGINE_FILE_POLL_MS) }
        );

        // Static engines are named as the picker names endpoints: <pod>-rank-<rank>.
        let s: AgentConfig = serde_norway::from_str(
            "pickers: [\"http://x:1\"]\nengines: [{pod: p, endpoint: \"1.2.3.4:80\", gpus: [GPU-a]}, {pod: p, rank: 1, endpoint: \"1.2.3.4:81\"}]\n",
        )
        .expect("parses");
        s.validate().expect("two ranks of one pod");
        let EngineSource::Static(view) = s.engine_source().expect("static") else { panic!("static") };
        let names: Vec<_> = view.engines.iter().map(|e| (e.endpoint.as_str(), e.http.port())).collect();
        assert_eq!(names, [("p-rank-0", 80), ("p-rank-1", 81)]);
        assert_eq!(view.engines[0].gpus, [GpuRef::Uuid("GPU-a".into())]);
    }
}
