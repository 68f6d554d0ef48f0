//! The picker's one configuration file (YAML, `--config picker.yaml`).
//!
//! Parsed with `serde_norway`, every struct `deny_unknown_fields`, every field defaulted as
//! documented below. [`PickerConfig::validate`] checks everything that can be checked before start
//! (including the scoring weights through `ScoringConfig::validate`); the binary refuses to start
//! with the error's message otherwise.
//!
//! ```yaml
//! ext_proc_addr: 127.0.0.1:9002     # Envoy ext_proc gRPC (+ grpc.health.v1)
//! ext_proc_threads: 0               # event loops serving ext_proc (0: one per available core)
//! health_addr: 127.0.0.1:9003       # grpc.health.v1 alone (GIE's --grpc-health-port, probes)
//! ingest_addr: 127.0.0.1:9004       # agents' AgentIngest gRPC (+ ReplicaSync)
//! admin_addr: 127.0.0.1:9090        # /metrics, /healthz, /explain
//! block_size: 16
//! body_limit_bytes: 8388608         # 8 MiB → 413 above it
//! pod_grace_ttl_ms: 10000
//! ingest_tls:                       # mTLS with the agents (docs/design.md §14); paths relative to this file
//!   ca_file: /etc/kvroute/ingest-tls/ca.crt       # agents' client certs must chain to it
//!   cert_file: /etc/kvroute/ingest-tls/tls.crt    # the picker's (DNS SAN picker.kvroute)
//!   key_file: /etc/kvroute/ingest-tls/tls.key     # files re-read when they rotate
//! # insecure_ingest: true           # plaintext ingest instead (local demo only; logged as a warning)
//! agent_auth: token                 # agents' identity: token (default with a Kubernetes pool) | certificate
//! agent_token:                      # agent_auth: token (picker/src/ingest/token.rs)
//!   audience: kvroute-picker        # the agents' projected token volume's audience
//!   service_account: kvroute-agent  # the agents' ServiceAccount, in the pool's namespace unless
//!   # service_account_namespace: ops
//!   cache_ttl_ms: 60000             # positive reviews reused (never past the token's exp)
//!   cache_entries: 4096
//!   review_timeout_ms: 5000
//! max_pods_per_stream: 256          # pods one agent stream may hold
//! max_pods: 16384                   # pods all agent streams may hold
//! # ext_proc_tls: {cert_file: .., key_file: ..}   # TLS on ext_proc (GIE's --secure-serving)
//! # explain_token_file: /etc/kvroute/admin/token  # /explain from off-host with "Authorization: Bearer <token>"
//! limits: { body_timeout_ms: 30000, keepalive_ms: 10000 }   # listener bounds: crate::limits
//! models:                           # InferenceModel-style: client model name → base model (+ LoRA)
//!   - name: Qwen/Qwen2.5-7B-Instruct
//!     target_model: Qwen/Qwen2.5-7B-Instruct
//!     adapter: null
//!     tokenizer: tests/fixtures/tokenizer-qwen2.5   # dir; relative to the config file's dir
//!     # mode: precise                 # default: precise with a tokenizer, approximate without
//!   - name: other-model               # no tokenizer: approximate mode (docs/design.md §6)
//!     approximate: { block_chars: 64, capacity_blocks_per_pod: 31250, max_blocks: 256 }
//!   - name: Qwen/Qwen2.5-VL-7B-Instruct
//!     tokenizer: /models/qwen2.5-vl
//!     image_tokens: 256              # placeholder tokens per image, when fixed (docs/design.md §2)
//!     # image_placeholder: "<|image_pad|>"
//!   - name: Qwen/Qwen2.5-VL-3B-Instruct
//!     tokenizer: /models/qwen2.5-vl
//!     vision: {}                     # count from each inline image's size (Qwen2-VL defaults)
//!     # image_hash_model: /models/qwen2.5-vl-3b   # the engine's `vllm serve <model>`, if not the target
//! scoring: { weights: {cache: 0.6, load: 0.2, queue: 0.1, health: 0.05, adapter: 0.05},
//!            max_queue: 20, max_utilization: 1.0, health_exclusion_threshold: 0.3, seed: 0 }
//! # or a preset (README "Tuning guide") with overrides and custom scorers:
//! # replicas: { peers: [10.0.0.11:9004, 10.0.0.12:9004] }   # share pending chains and in-flight counts
//! # replicas: { service: { name: kvroute-picker-peers } }     # ... with the Service's endpoints (Kubernetes)
//! # scoring:
//! #   preset: latency-api
//! #   weights: {cache: 0.40, load: 0.15, queue: 0.25, health: 0.05, adapter: 0.05}
//! #   custom: [{scorer: cost, weight: 0.10, margin: 0.20}]
//! ```
//!
//! Sources (docs/design.md §14): the candidate endpoints come from the pool source only, either
//! an InferencePool (`pool: {name, namespace}`, or the GIE EPP's flags `--pool-name` /
//! `--pool-namespace`, which win over the file) watched through the Kubernetes API with its
//! InferenceObjective / InferenceModelRewrite objects, or a static pool file (`pool_file:`,
//! re-read when it changes) with its `models:` and `objectives:`. Agents only add cache and stats
//! to the pool's pods. `models:` here stays the file source of client models and tokenizers.
//! Readiness: NOT_SERVING until the pool view synced and agents reported for `ready_coverage` of
//! its Ready endpoints, or `ready_timeout_ms` passed.
//!
//! ```yaml
//! pool: {name: vllm-pool, namespace: inference}   # or: pool_file: pool.yaml (relative to this file)
//! ready_coverage: 0.9
//! ready_timeout_ms: 10000
//! shutdown_drain_ms: 2000                          # NOT_SERVING after SIGTERM, still answering
//! ```
//!
//! Defaults: every default is a named `DEFAULT_*` constant of the module that owns the setting,
//! used both by serde (absent fields) and by `Default`. Errors name the field, the value and what
//! to do ([`ConfigError::Invalid`]).
//!
//! Concurrency: built once at start-up, then shared read-only.

use std::collections::HashSet;
use std::fmt::Display;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};

use kvroute_common::config::{InvalidField, YamlFileError, load_yaml, parse_yaml, parse_yaml_str};
use kvroute_common::image::{MAX_IMAGE_PIXELS, SmartResize};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};

use crate::approx::{ApproxConfig, RoutingMode};
use crate::ingest::guard::{DEFAULT_MAX_PODS, DEFAULT_MAX_PODS_PER_STREAM};
use crate::ingest::tls::TlsFiles;
use crate::ingest::token::{AgentAuth, AgentTokenConfig};
use crate::limits::Limits;
use crate::pool::{DEFAULT_MAX_BLOCKS_PER_POD, DEFAULT_POD_GRACE_TTL_MS, PoolConfig};
use crate::score::{ScoringConfig, ScoringConfigError};

/// Errors from reading or validating the configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read, or its YAML did not parse or had unknown/mistyped fields (or
    /// an unknown scoring preset); the path is empty for text.
    #[error(transparent)]
    File(#[from] YamlFileError),
    /// A value is out of range or inconsistent: which field, its value, what to do.
    #[error("invalid config: {0}")]
    Invalid(#[from] InvalidField),
    /// The scoring section is inconsistent (weights, ranges, custom scorers).
    #[error("invalid config: scoring: {source}")]
    Scoring {
        /// What the scoring rules rejected.
        #[from]
        source: ScoringConfigError,
    },
}

/// What the picker's config file is called in its errors ("cannot read config file …").
const CONFIG_FILE: &str = "config file";

impl ConfigError {
    fn invalid(field: impl Into<String>, value: impl Display, fix: impl Into<String>) -> Self {
        ConfigError::Invalid(InvalidField::new(field, value, fix))
    }
}

/// Default `ext_proc_addr`: Envoy's ext_proc gRPC.
pub const DEFAULT_EXT_PROC_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9002));
/// Default `health_addr`: `grpc.health.v1` alone, the port GIE's EPP serves its health on
/// (`--grpc-health-port`, 9003) and its Helm chart's probes call.
pub const DEFAULT_HEALTH_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9003));
/// Default `ingest_addr`: the agents' AgentIngest gRPC (and ReplicaSync), on 9004, a port GIE's
/// EPP and llm-d's router leave free.
pub const DEFAULT_INGEST_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9004));
/// Default `admin_addr`: `/metrics`, `/healthz`, `/explain`.
pub const DEFAULT_ADMIN_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9090));
/// Default `body_limit_bytes`: 8 MiB.
pub const DEFAULT_BODY_LIMIT_BYTES: usize = 8 * 1024 * 1024;
/// Largest body limit accepted: the ext_proc gRPC server's receive limit is sized from it.
pub const MAX_BODY_LIMIT_BYTES: usize = 256 * 1024 * 1024;
/// Default `ready_coverage`: the share of the pool's Ready endpoints agents must have reported
/// for before the picker reports SERVING (docs/design.md §14).
pub const DEFAULT_READY_COVERAGE: f64 = 0.9;
/// Default `ready_timeout_ms`: SERVING after this long even below `ready_coverage`, in ms.
pub const DEFAULT_READY_TIMEOUT_MS: u64 = 10_000;
/// Default `shutdown_drain_ms`: NOT_SERVING this long after SIGTERM before the listeners close.
pub const DEFAULT_SHUTDOWN_DRAIN_MS: u64 = 2_000;
/// Largest `shutdown_drain_ms` accepted (Kubernetes' default termination grace is 30 s).
pub const MAX_SHUTDOWN_DRAIN_MS: u64 = 25_000;

/// An InferencePool by name (`pool:`), as the GIE EPP's `--pool-name` / `--pool-namespace` name it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRefConfig {
    /// The InferencePool's name.
    pub name: String,
    /// Its namespace. Default: `$NAMESPACE`, else `default` (as the GIE EPP).
    #[serde(default)]
    pub namespace: Option<String>,
}

/// Where the candidate endpoints come from (docs/design.md §14).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolSource {
    /// An InferencePool through the Kubernetes API.
    Kubernetes(kvroute_cluster::PoolRef),
    /// A pool file, watched.
    File(PathBuf),
}

/// The picker's configuration file. Every field is optional.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PickerConfig {
    /// Envoy ext_proc gRPC listen address (also serves `grpc.health.v1`). Default
    /// [`DEFAULT_EXT_PROC_ADDR`] (`127.0.0.1:9002`).
    pub ext_proc_addr: SocketAddr,
    /// Event loops serving ext_proc: threads, each with its own single-threaded runtime; every
    /// connection stays on the loop it was handed to, the least loaded at accept
    /// (docs/decisions/0050-ext-proc-event-loops.md). 0 (the default): one per core available to
    /// the process ([`std::thread::available_parallelism`], which follows a container's CPU
    /// quota); see [`PickerConfig::ext_proc_loops`].
    pub ext_proc_threads: usize,
    /// `grpc.health.v1` listen address, the health service alone (GIE's `--grpc-health-port`:
    /// Kubernetes probes and gateways that check health apart from ext_proc). Default: the
    /// ext_proc address's interface on port 9003 ([`DEFAULT_HEALTH_ADDR`]'s), or on a free port
    /// when `ext_proc_addr` asks for one (port 0); see [`PickerConfig::health_addr`].
    pub health_addr: Option<SocketAddr>,
    /// Agents' `AgentIngest` gRPC listen address. Default [`DEFAULT_INGEST_ADDR`] (`127.0.0.1:9004`).
    pub ingest_addr: SocketAddr,
    /// Admin HTTP listen address (`/metrics`, `/healthz`, `/explain`). Default
    /// [`DEFAULT_ADMIN_ADDR`] (`127.0.0.1:9090`).
    pub admin_addr: SocketAddr,
    /// Tokens per KV block; must equal vLLM's `--block-size`. Default
    /// [`kvroute_common::DEFAULT_BLOCK_SIZE`] (16).
    pub block_size: usize,
    /// Largest request body, in bytes, the picker parses; above it the request gets a 413.
    /// Default [`DEFAULT_BODY_LIMIT_BYTES`] (8 MiB). Envoy's own buffer limit should be set higher
    /// (docs/design.md §5).
    pub body_limit_bytes: usize,
    /// How long, in ms, a disconnected pod's blocks are kept before removal. Default
    /// [`DEFAULT_POD_GRACE_TTL_MS`] (10000).
    pub pod_grace_ttl_ms: u64,
    /// Most blocks the prefix index keeps for one pod; stores beyond it are dropped and counted
    /// (`epp_index_dropped_blocks_total`). Bounds the index's memory against a misbehaving agent.
    /// Default [`DEFAULT_MAX_BLOCKS_PER_POD`] (2 000 000, ≈ 16 MB of index per full pod).
    pub max_blocks_per_pod: usize,
    /// Client-facing model names and what they resolve to (InferenceModel-style). A request
    /// whose `model` is not listed gets a 404. Default none.
    pub models: Vec<ModelConfig>,
    /// Scoring weights and thresholds (docs/design.md §4): an optional `preset`, then any
    /// [`ScoringConfig`] field over it. Default: the `chatbot` preset ([`ScoringConfig::default`]).
    #[serde(deserialize_with = "scoring_over_preset")]
    pub scoring: ScoringConfig,
    /// The other picker replicas (docs/design.md §4 "One view across replicas"). Default none:
    /// this picker routes on its own view.
    pub replicas: ReplicasConfig,
    /// Time and count bounds of the listeners (body deadline, HTTP/2 keepalive, stream and
    /// connection caps): see [`crate::limits`]. Default [`Limits::default`].
    pub limits: Limits,
    /// The InferencePool whose Ready pods are the candidates (Kubernetes). `--pool-name` /
    /// `--pool-namespace` override it. Exclusive with `pool_file`.
    pub pool: Option<PoolRefConfig>,
    /// A pool file (hosts without Kubernetes, the demo; format in `kvroute_cluster::file`),
    /// relative to the config file's directory, re-read when it changes. Exclusive with `pool`.
    pub pool_file: Option<PathBuf>,
    /// Share (0–1] of the pool's Ready endpoints agents must have reported for before readiness
    /// turns SERVING. Default [`DEFAULT_READY_COVERAGE`] (0.9).
    pub ready_coverage: f64,
    /// SERVING after this long (ms, counted from start) even below `ready_coverage` (the pool view
    /// must still have synced). Default [`DEFAULT_READY_TIMEOUT_MS`] (10 000).
    pub ready_timeout_ms: u64,
    /// On SIGTERM the binary reports NOT_SERVING for this long (ms) while still answering, so
    /// Envoy's health checks move new ext_proc streams to the other replicas before this one
    /// closes (open streams then finish). Default [`DEFAULT_SHUTDOWN_DRAIN_MS`] (2000), at most
    /// [`MAX_SHUTDOWN_DRAIN_MS`].
    pub shutdown_drain_ms: u64,
    /// mTLS on the ingest listener (docs/design.md §14): the CA agents' client certificates must
    /// chain to and the picker's own certificate and key (PEM files, re-read when they change).
    /// Relative paths resolve against the config file's directory. One of this and
    /// `insecure_ingest` is required to start. Default none.
    pub ingest_tls: Option<TlsFiles>,
    /// Serve the ingest listener in plaintext, any agent's `Hello` node taken on trust (the local
    /// demo); logged as a warning at start. Also `--insecure-ingest`. Default false.
    pub insecure_ingest: bool,
    /// Most pods one agent stream may hold; further claims are refused and counted
    /// (`epp_ingest_refusals_total{reason="stream_pod_cap"}`). Default
    /// [`DEFAULT_MAX_PODS_PER_STREAM`] (256).
    pub max_pods_per_stream: usize,
    /// Most pods all agent streams may hold (pods in their grace period count); further claims are
    /// refused and counted (`reason="pod_cap"`). Default [`DEFAULT_MAX_PODS`] (16384).
    pub max_pods: usize,
    /// Server TLS on the ext_proc listener (GIE's `--secure-serving`): `cert_file`, `key_file`.
    /// Envoy's ext_proc cluster then needs an `UpstreamTlsContext`. Default none (plaintext).
    pub ext_proc_tls: Option<ServerTlsFiles>,
    /// A file holding the bearer token that opens `/explain` to callers off the loopback
    /// interface (`Authorization: Bearer <token>`). Without it `/explain` answers loopback
    /// callers only (e.g. `kubectl port-forward`). Default none.
    pub explain_token_file: Option<PathBuf>,
    /// How agents prove their node on the TLS ingest (docs/design.md §14): `token` (a projected
    /// ServiceAccount token verified with TokenReview) or `certificate` (a client certificate
    /// per node). Default: `token` with a Kubernetes pool source, else `certificate`; see
    /// [`PickerConfig::agent_auth`].
    pub agent_auth: Option<AgentAuth>,
    /// Settings of `agent_auth: token` (audience, agents' ServiceAccount, review cache).
    pub agent_token: AgentTokenConfig,
}

/// Server-only TLS files (PEM): the listener's certificate chain and key.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsFiles {
    /// Certificate chain (`tls.crt`).
    pub cert_file: PathBuf,
    /// Private key (`tls.key`).
    pub key_file: PathBuf,
}

/// Picker replicas this one shares its view with: pending chains and in-flight requests go both
/// ways over `ReplicaSync`, served on each replica's ingest listener.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicasConfig {
    /// Every replica's ingest address (`ip:port`), this one's included or not (a replica that
    /// reaches itself recognises its own id and stops dialing that address). Default empty.
    /// Hosts without Kubernetes; exclusive with `service`.
    pub peers: Vec<SocketAddr>,
    /// Kubernetes: the peers are the endpoints of this headless Service (in the pool's
    /// namespace), followed through its EndpointSlices, this replica excluded; peers join and
    /// leave without a restart. Needs a Kubernetes pool (`pool` / `--pool-name`); exclusive with
    /// `peers`. Default none.
    pub service: Option<ReplicaServiceConfig>,
}

/// `replicas.service`: the picker replicas' headless Service (the one agents report through).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaServiceConfig {
    /// Service name (its EndpointSlices carry `kubernetes.io/service-name=<name>`).
    pub name: String,
    /// Name of the Service's ingest port. Default [`DEFAULT_REPLICA_PORT_NAME`] (`ingest`).
    #[serde(default = "default_replica_port")]
    pub port: String,
}

/// Default `replicas.service.port`: the name of the picker Service's ingest port.
pub const DEFAULT_REPLICA_PORT_NAME: &str = "ingest";

fn default_replica_port() -> String {
    DEFAULT_REPLICA_PORT_NAME.to_string()
}

/// Most event loops [`PickerConfig::ext_proc_threads`] may ask for.
pub const MAX_EXT_PROC_THREADS: usize = 256;

impl Default for PickerConfig {
    fn default() -> Self {
        Self {
            ext_proc_addr: DEFAULT_EXT_PROC_ADDR,
            ext_proc_threads: 0,
            health_addr: None,
            ingest_addr: DEFAULT_INGEST_ADDR,
            admin_addr: DEFAULT_ADMIN_ADDR,
            block_size: kvroute_common::DEFAULT_BLOCK_SIZE,
            body_limit_bytes: DEFAULT_BODY_LIMIT_BYTES,
            pod_grace_ttl_ms: DEFAULT_POD_GRACE_TTL_MS,
            max_blocks_per_pod: DEFAULT_MAX_BLOCKS_PER_POD,
            models: Vec::new(),
            scoring: ScoringConfig::default(),
            replicas: ReplicasConfig::default(),
            pool: None,
            pool_file: None,
            ready_coverage: DEFAULT_READY_COVERAGE,
            ready_timeout_ms: DEFAULT_READY_TIMEOUT_MS,
            ingest_tls: None,
            insecure_ingest: false,
            max_pods_per_stream: DEFAULT_MAX_PODS_PER_STREAM,
            max_pods: DEFAULT_MAX_PODS,
            ext_proc_tls: None,
            explain_token_file: None,
            agent_auth: None,
            agent_token: AgentTokenConfig::default(),
            shutdown_drain_ms: DEFAULT_SHUTDOWN_DRAIN_MS,
            limits: Limits::default(),
        }
    }
}

/// The `scoring:` section: `preset` (`chatbot`, `latency-api`, `batch`, `multi-lora`; default
/// `chatbot`) chooses the base, and every other key overrides that field of the base, with
/// [`ScoringConfig`]'s own rules (unknown keys rejected, `weights` given whole). An unknown preset
/// is a parse error naming it.
fn scoring_over_preset<'de, D: Deserializer<'de>>(d: D) -> Result<ScoringConfig, D::Error> {
    use serde_json::Value;
    let mut overlay = serde_json::Map::<String, Value>::deserialize(d)?;
    let base = match overlay.remove("preset") {
        None | Some(Value::Null) => ScoringConfig::default(),
        Some(Value::String(name)) => {
            ScoringConfig::preset(&name).ok_or_else(|| D::Error::custom(ScoringConfigError::UnknownPreset(name)))?
        }
        Some(other) => return Err(D::Error::custom(format!("scoring.preset must be a preset name, got {other}"))),
    };
    let mut merged = serde_json::to_value(base).map_err(D::Error::custom)?;
    if let Value::Object(fields) = &mut merged {
        fields.extend(overlay);
    }
    ScoringConfig::deserialize(merged).map_err(|e| D::Error::custom(format!("scoring: {e}")))
}

/// One InferenceModel: the name clients send → the base model served by the pods (+ adapter).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The `model` value clients send.
    pub name: String,
    /// The base model the pods serve (their `/v1/models` id); the block-hash root's model.
    /// Defaults to `name`.
    #[serde(default)]
    pub target_model: Option<String>,
    /// LoRA adapter name, if this InferenceModel is an adapter on `target_model`. Default none.
    #[serde(default)]
    pub adapter: Option<String>,
    /// HuggingFace tokenizer directory (`tokenizer.json`, `tokenizer_config.json`). Relative
    /// paths resolve against the config file's directory. Without one the model routes in
    /// approximate mode (unless `mode: precise`, then by load only). A directory without
    /// `tokenizer.json` (a volume not mounted or not filled yet) counts as none: approximate mode,
    /// logged once at start; with `mode: precise` it is a config error.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// `precise` (token blocks against the KV-event index) or `approximate` (text blocks against
    /// where earlier requests were routed, docs/design.md §6). Default: precise when `tokenizer` is set
    /// (and loads), approximate otherwise.
    #[serde(default)]
    pub mode: Option<RoutingMode>,
    /// Approximate-mode settings; defaults (GIE's prefix plugin): `block_chars` 64 characters,
    /// `capacity_blocks_per_pod` 31 250 blocks, `max_blocks` 256 blocks per request.
    #[serde(default)]
    pub approximate: ApproxConfig,
    /// Placeholder tokens each image of a chat request expands to on the engine (a fixed count:
    /// the model's processor gives every image the same number, e.g. images resized to one
    /// size), 1..=[`MAX_IMAGE_TOKENS`]. With it, images that carry a `uuid` are part of the
    /// request's block identity as the engine hashes them (docs/design.md §2); without it, and
    /// for images without a `uuid`, blocks are claimed only up to the first image. Default none.
    #[serde(default)]
    pub image_tokens: Option<usize>,
    /// The token the chat template renders once per image and the engine expands to
    /// `image_tokens` tokens. Default `<|image_pad|>` (Qwen2-VL and its successors).
    #[serde(default)]
    pub image_placeholder: Option<String>,
    /// Instead of a fixed `image_tokens`: the count follows each image's size as the Qwen2-VL
    /// family's processor resizes it (docs/design.md §2). The picker reads the size from the
    /// header of inline images (`data:` URLs, PNG, JPEG, WebP, GIF or BMP); images it cannot size
    /// (http(s) URLs, other formats) end the claimable prefix. Default none.
    #[serde(default)]
    pub vision: Option<VisionConfig>,
    /// The model id vLLM hashes into the identifier of an inline image without `uuid`: the
    /// `model` the engine was started with (`vllm serve <model>`: a hub id or a path), which is
    /// not its `--served-model-name`. Default `target_model`.
    #[serde(default)]
    pub image_hash_model: Option<String>,
}

/// The Qwen2-VL family's image processor settings (its `preprocessor_config.json`); each field
/// defaults to Qwen2-VL-*-Instruct's and Qwen2.5-VL-*-Instruct's value.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VisionConfig {
    /// Vision patch side in pixels, 1..=1024. Default 14.
    #[serde(default = "default_patch_size")]
    pub patch_size: u32,
    /// Patches merged per side into one token (`merge_size`), 1..=64. Default 2.
    #[serde(default = "default_merge_size")]
    pub merge_size: u32,
    /// Smallest resized area in pixels (`min_pixels`), >= 1. Default 3136.
    #[serde(default = "default_min_pixels")]
    pub min_pixels: u64,
    /// Largest resized area in pixels (`max_pixels`), min_pixels..=178956970. Default 12845056.
    #[serde(default = "default_max_pixels")]
    pub max_pixels: u64,
}

fn default_patch_size() -> u32 {
    SmartResize::QWEN2_VL.patch_size
}
fn default_merge_size() -> u32 {
    SmartResize::QWEN2_VL.merge_size
}
fn default_min_pixels() -> u64 {
    SmartResize::QWEN2_VL.min_pixels
}
fn default_max_pixels() -> u64 {
    SmartResize::QWEN2_VL.max_pixels
}

impl VisionConfig {
    /// The resizing these settings describe.
    pub fn smart_resize(&self) -> SmartResize {
        SmartResize {
            patch_size: self.patch_size,
            merge_size: self.merge_size,
            min_pixels: self.min_pixels,
            max_pixels: self.max_pixels,
        }
    }

    /// The first out-of-range field and why, if any.
    fn invalid_field(&self) -> Option<(&'static str, u64, &'static str)> {
        if !(1..=1024).contains(&self.patch_size) {
            return Some(("patch_size", self.patch_size.into(), "must be 1..=1024 pixels"));
        }
        if !(1..=64).contains(&self.merge_size) {
            return Some(("merge_size", self.merge_size.into(), "must be 1..=64"));
        }
        if self.min_pixels == 0 {
            return Some(("min_pixels", 0, "must be >= 1"));
        }
        if !(self.min_pixels..=MAX_IMAGE_PIXELS).contains(&self.max_pixels) {
            return Some(("max_pixels", self.max_pixels, "must be min_pixels..=178956970 (vLLM's largest image)"));
        }
        None
    }
}

/// Most placeholder tokens per image `image_tokens` accepts.
pub const MAX_IMAGE_TOKENS: usize = 65_536;

/// The image placeholder token when `image_placeholder` is not set.
pub const DEFAULT_IMAGE_PLACEHOLDER: &str = "<|image_pad|>";

impl ModelConfig {
    /// A model named `name` with every other field at its default (no tokenizer: approximate).
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            target_model: None,
            adapter: None,
            tokenizer: None,
            mode: None,
            approximate: ApproxConfig::default(),
            image_tokens: None,
            image_placeholder: None,
            vision: None,
            image_hash_model: None,
        }
    }

    /// The base model: `target_model`, or `name` when absent.
    pub fn target(&self) -> &str {
        self.target_model.as_deref().unwrap_or(&self.name)
    }

    /// The mode in effect given whether a tokenizer loaded: `mode` when set, otherwise precise
    /// with a tokenizer and approximate without one.
    pub fn effective_mode(&self, tokenizer_loaded: bool) -> RoutingMode {
        match self.mode {
            Some(m) => m,
            None if tokenizer_loaded => RoutingMode::Precise,
            None => RoutingMode::Approximate,
        }
    }
}

impl PickerConfig {
    /// Reads, parses and validates `path`; relative tokenizer paths are resolved against the
    /// file's directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let config: Self = load_yaml(CONFIG_FILE, path)?;
        config.resolved_and_valid(path)
    }

    /// As [`PickerConfig::load`], from the content `bytes` already read from `path`.
    ///
    /// # Errors
    /// [`ConfigError::File`] when `bytes` is not the schema; as [`PickerConfig::validate`].
    pub fn load_bytes(path: &Path, bytes: &[u8]) -> Result<Self, ConfigError> {
        let config: Self = parse_yaml(CONFIG_FILE, path, bytes)?;
        config.resolved_and_valid(path)
    }

    fn resolved_and_valid(mut self, path: &Path) -> Result<Self, ConfigError> {
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        self.resolve_paths(&base);
        self.validate()?;
        Ok(self)
    }

    /// Parses YAML text (no path resolution, no validation).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Ok(parse_yaml_str(CONFIG_FILE, Path::new(""), text)?)
    }

    /// The pool source, if any: `pool_file`, else `pool` (namespace per the GIE EPP's rule).
    pub fn pool_source(&self) -> Option<PoolSource> {
        if let Some(f) = &self.pool_file {
            return Some(PoolSource::File(f.clone()));
        }
        self.pool.as_ref().map(|p| {
            PoolSource::Kubernetes(kvroute_cluster::PoolRef {
                namespace: kvroute_cluster::pool_namespace(p.namespace.as_deref()),
                name: p.name.clone(),
            })
        })
    }

    /// How agents prove their node: `agent_auth` if set, else [`AgentAuth::Token`] with a
    /// Kubernetes pool source and [`AgentAuth::Certificate`] without. Only applies with
    /// `ingest_tls` (plaintext ingest takes the `Hello` on trust).
    pub fn agent_auth(&self) -> AgentAuth {
        match (self.agent_auth, self.pool_source()) {
            (Some(mode), _) => mode,
            (None, Some(PoolSource::Kubernetes(_))) => AgentAuth::Token,
            (None, _) => AgentAuth::Certificate,
        }
    }

    /// Fails unless a pool source is set: the picker binary routes only to the pool's pods.
    pub fn require_pool_source(&self) -> Result<(), ConfigError> {
        if self.pool_source().is_none() {
            return Err(ConfigError::invalid(
                "pool",
                "(none)",
                "set --pool-name (and --pool-namespace), pool: {name, namespace}, or pool_file: the pool's pods are the only candidates",
            ));
        }
        Ok(())
    }

    /// Applies the GIE EPP's `--pool-name` / `--pool-namespace` flags: a name selects the
    /// Kubernetes source (replacing `pool` and `pool_file`); a namespace alone sets `pool`'s.
    pub fn apply_pool_flags(&mut self, name: Option<&str>, namespace: Option<&str>) {
        let namespace = namespace.filter(|n| !n.is_empty()).map(str::to_string);
        match name.filter(|n| !n.is_empty()) {
            Some(name) => {
                self.pool = Some(PoolRefConfig { name: name.to_string(), namespace });
                self.pool_file = None;
            }
            None => {
                if let (Some(p), Some(ns)) = (&mut self.pool, namespace) {
                    p.namespace = Some(ns);
                }
            }
        }
    }

    /// Applies GIE's EPP port flags (`--grpc-port`, `--grpc-health-port`, `--metrics-port`): each
    /// sets its listener to that port on all interfaces (`0.0.0.0`), as GIE's EPP listens.
    pub fn apply_port_flags(&mut self, grpc: Option<u16>, grpc_health: Option<u16>, metrics: Option<u16>) {
        let any = |port| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port));
        if let Some(p) = grpc {
            self.ext_proc_addr = any(p);
        }
        if let Some(p) = grpc_health {
            self.health_addr = Some(any(p));
        }
        if let Some(p) = metrics {
            self.admin_addr = any(p);
        }
    }

    /// The configuration a picker started GIE's way (no kvroute config file: flags and an
    /// `EndpointPickerConfig` only) starts from: the defaults, with every listener on all
    /// interfaces as GIE's EPP (`:9002`, `:9003`, `:9090`, and the ingest on `:9004`).
    pub fn gie_defaults() -> Self {
        let mut c = Self::default();
        c.apply_port_flags(Some(c.ext_proc_addr.port()), Some(DEFAULT_HEALTH_ADDR.port()), Some(c.admin_addr.port()));
        c.ingest_addr.set_ip(Ipv4Addr::UNSPECIFIED.into());
        c
    }

    /// How many event loops serve ext_proc: `ext_proc_threads`, or when 0 the cores available to
    /// the process (1 when that cannot be read).
    pub fn ext_proc_loops(&self) -> usize {
        match self.ext_proc_threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            n => n,
        }
    }

    /// The gRPC health listener's address: `health_addr`, else `ext_proc_addr`'s IP on port 9003
    /// (port 0 when `ext_proc_addr`'s port is 0: tests and embedders that take free ports).
    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr.unwrap_or_else(|| {
            let port = if self.ext_proc_addr.port() == 0 { 0 } else { DEFAULT_HEALTH_ADDR.port() };
            SocketAddr::new(self.ext_proc_addr.ip(), port)
        })
    }

    /// Makes relative tokenizer directories, the pool file and TLS/token files relative to `base` (the config
    /// file's directory).
    pub fn resolve_paths(&mut self, base: &Path) {
        let rel = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        if let Some(t) = &mut self.ingest_tls {
            rel(&mut t.ca_file);
            rel(&mut t.cert_file);
            rel(&mut t.key_file);
        }
        if let Some(t) = &mut self.ext_proc_tls {
            rel(&mut t.cert_file);
            rel(&mut t.key_file);
        }
        if let Some(f) = &mut self.pool_file {
            rel(f);
        }
        if let Some(t) = &mut self.explain_token_file {
            rel(t);
        }
        for m in &mut self.models {
            if let Some(t) = &m.tokenizer
                && t.is_relative()
            {
                m.tokenizer = Some(base.join(t));
            }
        }
    }

    /// The pool's settings.
    pub fn pool(&self) -> PoolConfig {
        PoolConfig {
            block_size: self.block_size,
            grace_ttl_ms: self.pod_grace_ttl_ms,
            max_blocks_per_pod: self.max_blocks_per_pod,
            max_report_age_ms: self.limits.max_report_age_ms,
        }
    }

    /// Checks ranges and consistency; the error names the field, its value and the fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::invalid(
                "block_size",
                0,
                "must be > 0 (tokens per KV block, equal to vLLM's --block-size)",
            ));
        }
        if self.body_limit_bytes == 0 || self.body_limit_bytes > MAX_BODY_LIMIT_BYTES {
            return Err(ConfigError::invalid(
                "body_limit_bytes",
                self.body_limit_bytes,
                format!("must be in 1..={MAX_BODY_LIMIT_BYTES}"),
            ));
        }
        if self.ext_proc_threads > MAX_EXT_PROC_THREADS {
            return Err(ConfigError::invalid(
                "ext_proc_threads",
                self.ext_proc_threads,
                format!("must be at most {MAX_EXT_PROC_THREADS}; 0 for one per core"),
            ));
        }
        if let Some(field) = self.limits.zero_field() {
            return Err(ConfigError::invalid(field, 0, "must be > 0; omit it for the default"));
        }
        if self.max_blocks_per_pod == 0 {
            return Err(ConfigError::invalid(
                "max_blocks_per_pod",
                0,
                "must be >= 1 (blocks); omit it for the default",
            ));
        }
        if self.max_pods_per_stream == 0 || self.max_pods == 0 {
            return Err(ConfigError::invalid(
                "max_pods_per_stream/max_pods",
                format!("{}/{}", self.max_pods_per_stream, self.max_pods),
                "must be >= 1 (pods); omit them for the defaults",
            ));
        }
        if let Some(service) = &self.replicas.service {
            if !self.replicas.peers.is_empty() {
                return Err(ConfigError::invalid(
                    "replicas",
                    "peers + service",
                    "choose one: service (Kubernetes) or a static peers list",
                ));
            }
            if service.name.is_empty() || service.port.is_empty() {
                return Err(ConfigError::invalid(
                    "replicas.service",
                    format!("{{name: {:?}, port: {:?}}}", service.name, service.port),
                    "name the replicas' headless Service and its ingest port",
                ));
            }
            if self.pool_file.is_some() {
                return Err(ConfigError::invalid(
                    "replicas.service",
                    &service.name,
                    "needs a Kubernetes pool (pool / --pool-name); with pool_file list replicas.peers",
                ));
            }
        }
        if self.agent_auth == Some(AgentAuth::Token) && self.ingest_tls.is_none() {
            return Err(ConfigError::invalid(
                "agent_auth",
                "token",
                "needs ingest_tls: the agents' tokens travel only over TLS (ca_file, cert_file, key_file)",
            ));
        }
        if self.agent_token.audience.is_empty() || self.agent_token.service_account.is_empty() {
            return Err(ConfigError::invalid(
                "agent_token",
                format!(
                    "{{audience: {:?}, service_account: {:?}}}",
                    self.agent_token.audience, self.agent_token.service_account
                ),
                "name the audience of the agents' projected tokens and the agents' ServiceAccount",
            ));
        }
        if self.ingest_tls.is_some() && self.insecure_ingest {
            return Err(ConfigError::invalid(
                "insecure_ingest",
                true,
                "ingest_tls is set too; choose mTLS (ingest_tls) or plaintext (insecure_ingest), not both",
            ));
        }
        let addrs = [
            ("ext_proc_addr", self.ext_proc_addr),
            ("health_addr", self.health_addr()),
            ("ingest_addr", self.ingest_addr),
            ("admin_addr", self.admin_addr),
        ];
        for (i, (na, a)) in addrs.iter().enumerate() {
            for (nb, b) in &addrs[i + 1..] {
                if a.port() != 0 && a == b {
                    return Err(ConfigError::invalid(
                        *nb,
                        b,
                        format!("{na} is also {a}; give each listener its own port"),
                    ));
                }
            }
        }
        let mut names = HashSet::new();
        for m in &self.models {
            let field = |f: &str| format!("models[{:?}].{f}", m.name);
            if m.name.trim().is_empty() {
                return Err(ConfigError::invalid("models[].name", format!("{:?}", m.name), "must not be empty"));
            }
            if !names.insert(m.name.as_str()) {
                return Err(ConfigError::invalid(
                    field("name"),
                    &m.name,
                    "is listed twice under models; give each InferenceModel one entry",
                ));
            }
            if m.target().trim().is_empty() {
                return Err(ConfigError::invalid(
                    field("target_model"),
                    format!("{:?}", m.target()),
                    "must not be empty",
                ));
            }
            if let Some((f, v)) = m.approximate.invalid_field() {
                return Err(ConfigError::invalid(
                    field(&format!("approximate.{f}")),
                    v,
                    "must be >= 1 (omit it for the default)",
                ));
            }
            if let Some(n) = m.image_tokens
                && !(1..=MAX_IMAGE_TOKENS).contains(&n)
            {
                return Err(ConfigError::invalid(
                    field("image_tokens"),
                    n,
                    format!(
                        "must be 1..={MAX_IMAGE_TOKENS}, the placeholder tokens one image expands to; omit it when the count varies"
                    ),
                ));
            }
            if let Some(v) = &m.vision {
                if m.image_tokens.is_some() {
                    return Err(ConfigError::invalid(
                        field("vision"),
                        "set",
                        "set either image_tokens (a fixed count) or vision (the count from each image's size), not both",
                    ));
                }
                if let Some((f, value, why)) = v.invalid_field() {
                    return Err(ConfigError::invalid(field(&format!("vision.{f}")), value, why));
                }
            }
            if let Some(h) = &m.image_hash_model
                && h.trim().is_empty()
            {
                return Err(ConfigError::invalid(
                    field("image_hash_model"),
                    format!("{h:?}"),
                    "must name the engine's model (vllm serve <model>); omit it for target_model",
                ));
            }
            if let Some(p) = &m.image_placeholder
                && p.is_empty()
            {
                return Err(ConfigError::invalid(
                    field("image_placeholder"),
                    "\"\"",
                    "must name the token the chat template renders per image; omit it for <|image_pad|>",
                ));
            }
            if m.mode == Some(RoutingMode::Precise) && m.tokenizer.is_none() {
                return Err(ConfigError::invalid(
                    field("mode"),
                    "precise",
                    "mode precise needs a tokenizer directory; set tokenizer or use mode approximate",
                ));
            }
            if let Some(a) = &m.adapter
                && a.trim().is_empty()
            {
                return Err(ConfigError::invalid(
                    field("adapter"),
                    format!("{a:?}"),
                    "is empty; use null for the base model",
                ));
            }
            // Without `mode: precise` an absent tokenizer means approximate mode (logged at
            // start, `ModelRegistry::load`): the picker starts before the tokenizer is mounted.
            if let Some(dir) = &m.tokenizer
                && m.mode == Some(RoutingMode::Precise)
                && !dir.join("tokenizer.json").is_file()
            {
                return Err(ConfigError::invalid(
                    field("tokenizer"),
                    dir.display(),
                    "mode precise and this directory has no tokenizer.json; point it at a HuggingFace tokenizer \
                     directory, or drop mode for approximate mode until it is there",
                ));
            }
        }
        if self.pool.is_some() && self.pool_file.is_some() {
            return Err(ConfigError::invalid(
                "pool_file",
                self.pool_file.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                "pool and pool_file are both set; keep one pool source",
            ));
        }
        if let Some(p) = &self.pool
            && p.name.trim().is_empty()
        {
            return Err(ConfigError::invalid("pool.name", "\"\"", "must name the InferencePool"));
        }
        if self.shutdown_drain_ms > MAX_SHUTDOWN_DRAIN_MS {
            return Err(ConfigError::invalid(
                "shutdown_drain_ms",
                self.shutdown_drain_ms,
                format!("must be at most {MAX_SHUTDOWN_DRAIN_MS} (ms), below the pod's termination grace period"),
            ));
        }
        if !(self.ready_coverage > 0.0 && self.ready_coverage <= 1.0) {
            return Err(ConfigError::invalid(
                "ready_coverage",
                self.ready_coverage,
                "must be in (0, 1]: the share of Ready pods agents must cover",
            ));
        }
        self.scoring.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::score::CustomScorerConfig;

    const EXAMPLE: &str = r#"
ext_proc_addr: 127.0.0.1:9002
health_addr: 127.0.0.1:9003
ingest_addr: 127.0.0.1:9004
admin_addr: 127.0.0.1:9090
block_size: 16
body_limit_bytes: 8388608
pod_grace_ttl_ms: 10000
models:
  - name: Qwen/Qwen2.5-7B-Instruct
    target_model: Qwen/Qwen2.5-7B-Instruct
    adapter: null
    tokenizer: tests/fixtures/tokenizer-qwen2.5
scoring: { weights: {cache: 0.6, load: 0.2, queue: 0.1, health: 0.05, adapter: 0.05},
           max_queue: 20, max_utilization: 1.0, health_exclusion_threshold: 0.3, seed: 0 }
"#;

    fn crate_root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn example_parses_and_validates() {
        let mut c = PickerConfig::from_yaml(EXAMPLE).unwrap();
        c.resolve_paths(&crate_root());
        c.validate().unwrap();
        assert_eq!(c.models.len(), 1);
        assert_eq!(c.body_limit_bytes, 8 * 1024 * 1024);
        assert_eq!(c.scoring.max_queue, 20);
    }

    #[test]
    fn defaults_apply() {
        let c = PickerConfig::from_yaml("models: []").unwrap();
        assert_eq!(
            [c.ext_proc_addr.port(), c.health_addr().port(), c.ingest_addr.port(), c.admin_addr.port()],
            [9002, 9003, 9004, 9090],
            "GIE's ports (ext_proc, gRPC health, metrics) and the ingest beside them"
        );
        assert_eq!(c.block_size, 16);
        assert_eq!(c.pod_grace_ttl_ms, 10_000);
        c.validate().unwrap();
    }

    #[test]
    fn image_settings_are_validated() {
        let c =
            PickerConfig::from_yaml("models: [{name: a, image_tokens: 256, image_placeholder: '<image>'}]").unwrap();
        c.validate().unwrap();
        assert_eq!((c.models[0].image_tokens, c.models[0].image_placeholder.as_deref()), (Some(256), Some("<image>")));
        for (yaml, field) in [
            ("{name: a, image_tokens: 0}", "image_tokens"),
            ("{name: a, image_tokens: 65537}", "image_tokens"),
            ("{name: a, image_placeholder: ''}", "image_placeholder"),
            ("{name: a, image_tokens: 64, vision: {}}", "].vision"),
            ("{name: a, vision: {patch_size: 0}}", "vision.patch_size"),
            ("{name: a, vision: {merge_size: 65}}", "vision.merge_size"),
            ("{name: a, vision: {min_pixels: 0}}", "vision.min_pixels"),
            ("{name: a, vision: {min_pixels: 5000, max_pixels: 4000}}", "vision.max_pixels"),
            ("{name: a, vision: {max_pixels: 178956971}}", "vision.max_pixels"),
            ("{name: a, vision: {}, image_hash_model: ' '}", "image_hash_model"),
        ] {
            let err =
                PickerConfig::from_yaml(&format!("models: [{yaml}]")).unwrap().validate().unwrap_err().to_string();
            assert!(err.contains(field), "{yaml}: {err}");
        }
        assert!(PickerConfig::from_yaml("models: [{name: a, image_tokens: -1}]").is_err());
        assert!(PickerConfig::from_yaml("models: [{name: a, vision: {patch: 14}}]").is_err(), "unknown field");
        // `vision: {}` is Qwen2-VL's processor; fields override one by one.
        let c = PickerConfig::from_yaml("models: [{name: a, vision: {}}, {name: b, vision: {max_pixels: 1003520}}]")
            .unwrap();
        c.validate().unwrap();
        assert_eq!(c.models[0].vision.unwrap().smart_resize(), SmartResize::QWEN2_VL);
        assert_eq!(
            c.models[1].vision.unwrap().smart_resize(),
            SmartResize { max_pixels: 1_003_520, ..SmartResize::QWEN2_VL }
        );
    }

    #[test]
    fn approximate_mode_settings() {
        let c = PickerConfig::from_yaml(
            "models: [{name: a}, {name: b, mode: approximate, approximate: {block_chars: 32}}]",
        )
        .unwrap();
        c.validate().unwrap();
        let (a, b) = (&c.models[0], &c.models[1]);
        assert_eq!(a.effective_mode(false), RoutingMode::Approximate);
        assert_eq!(a.effective_mode(true), RoutingMode::Precise);
        assert_eq!(b.effective_mode(true), RoutingMode::Approximate);
        assert_eq!(a.approximate, ApproxConfig::default());
        assert_eq!(a.approximate.capacity_blocks_per_pod, 31_250);
        assert_eq!((b.approximate.block_chars, b.approximate.max_blocks), (32, 256));
        let err = PickerConfig::from_yaml("models: [{name: a, approximate: {block_chars: 0}}]")
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("approximate.block_chars"), "{err}");
        let err = PickerConfig::from_yaml("models: [{name: a, mode: precise}]").unwrap().validate().unwrap_err();
        assert!(err.to_string().contains("needs a tokenizer"), "{err}");
        assert!(PickerConfig::from_yaml("models: [{name: a, mode: fuzzy}]").is_err());
        assert!(PickerConfig::from_yaml("models: [{name: a, approximate: {bogus: 1}}]").is_err());
    }

    #[test]
    fn replica_service_parses_and_excludes_static_peers_and_pool_files() {
        let c = PickerConfig::from_yaml("pool: {name: p}\nreplicas: {service: {name: peers}}").unwrap();
        let s = c.replicas.service.clone().unwrap();
        assert_eq!((s.name.as_str(), s.port.as_str()), ("peers", DEFAULT_REPLICA_PORT_NAME));
        c.validate().unwrap();
        for (yaml, needle) in [
            ("pool: {name: p}\nreplicas: {service: {name: s}, peers: [10.0.0.1:9004]}", "choose one"),
            ("pool: {name: p}\nreplicas: {service: {name: \"\"}}", "replicas.service"),
            ("pool_file: pool.yaml\nreplicas: {service: {name: s}}", "needs a Kubernetes pool"),
        ] {
            let err = PickerConfig::from_yaml(yaml).unwrap().validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{yaml}: {err}");
        }
    }

    #[test]
    fn agent_auth_defaults_to_tokens_on_kubernetes() {
        use crate::ingest::token::AgentAuth;
        let tls = "ingest_tls: {ca_file: ca, cert_file: c, key_file: k}\n";
        let k8s = PickerConfig::from_yaml(&format!("{tls}pool: {{name: p}}\n")).unwrap();
        assert_eq!(k8s.agent_auth(), AgentAuth::Token);
        let file = PickerConfig::from_yaml(&format!("{tls}pool_file: pool.yaml\n")).unwrap();
        assert_eq!(file.agent_auth(), AgentAuth::Certificate);
        let pinned = PickerConfig::from_yaml(&format!("{tls}pool: {{name: p}}\nagent_auth: certificate\n")).unwrap();
        assert_eq!(pinned.agent_auth(), AgentAuth::Certificate);
        assert!(pinned.validate().is_ok());
        // Tokens travel only over TLS; the token settings must name something.
        assert!(PickerConfig::from_yaml("insecure_ingest: true\nagent_auth: token\n").unwrap().validate().is_err());
        let empty = PickerConfig::from_yaml(&format!("{tls}agent_token: {{audience: \"\"}}\n")).unwrap();
        assert!(empty.validate().is_err());
        assert!(PickerConfig::from_yaml("agent_auth: tokens\n").is_err());
    }

    #[test]
    fn pool_sources_and_flags() {
        let mut c = PickerConfig::from_yaml("pool_file: pool.yaml\nready_coverage: 0.5").unwrap();
        c.resolve_paths(Path::new("/etc/kvroute"));
        c.validate().unwrap();
        assert_eq!(c.pool_source(), Some(PoolSource::File("/etc/kvroute/pool.yaml".into())));
        assert_eq!((c.ready_coverage, c.ready_timeout_ms), (0.5, DEFAULT_READY_TIMEOUT_MS));
        c.apply_pool_flags(Some("vllm"), Some("inference"));
        let want = kvroute_cluster::PoolRef { namespace: "inference".into(), name: "vllm".into() };
        assert_eq!(c.pool_source(), Some(PoolSource::Kubernetes(want)));
        c.validate().unwrap();
        let c = PickerConfig::from_yaml("pool: {name: p}\npool_file: f.yaml").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("pool_file"));
        let c = PickerConfig::from_yaml("ready_coverage: 0").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("ready_coverage"));
        assert!(PickerConfig::from_yaml("pool: {name: p, bogus: 1}").is_err());
        assert_eq!(PickerConfig::default().pool_source(), None);
    }

    #[test]
    fn ext_proc_threads_default_to_the_cores_and_are_bounded() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        assert_eq!(PickerConfig::default().ext_proc_loops(), cores);
        let c = PickerConfig::from_yaml("ext_proc_threads: 3").unwrap();
        c.validate().unwrap();
        assert_eq!(c.ext_proc_loops(), 3);
        let c = PickerConfig::from_yaml("ext_proc_threads: 100000").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("ext_proc_threads"));
    }

    #[test]
    fn gie_port_flags_bind_all_interfaces_and_must_differ() {
        let mut c = PickerConfig::from_yaml("ext_proc_addr: 127.0.0.1:9100").unwrap();
        c.apply_port_flags(Some(9102), Some(9103), None);
        assert_eq!(c.ext_proc_addr, "0.0.0.0:9102".parse().unwrap());
        assert_eq!(c.health_addr(), "0.0.0.0:9103".parse().unwrap());
        assert_eq!(c.admin_addr, DEFAULT_ADMIN_ADDR, "no flag: unchanged");
        c.validate().unwrap();
        let g = PickerConfig::gie_defaults();
        assert!(
            [g.ext_proc_addr, g.health_addr(), g.ingest_addr, g.admin_addr].iter().all(|a| a.ip().is_unspecified())
        );
        assert_eq!((g.ext_proc_addr.port(), g.health_addr().port(), g.admin_addr.port()), (9002, 9003, 9090));
        // Without health_addr: the ext_proc interface, port 9003, or a free port beside port 0.
        let c = PickerConfig::from_yaml("ext_proc_addr: 0.0.0.0:9002").unwrap();
        assert_eq!(c.health_addr(), "0.0.0.0:9003".parse().unwrap());
        let c = PickerConfig::from_yaml("ext_proc_addr: 127.0.0.1:0").unwrap();
        assert_eq!(c.health_addr(), "127.0.0.1:0".parse().unwrap());
        let mut clash = PickerConfig::default();
        clash.apply_port_flags(None, Some(9004), None);
        clash.ingest_addr = "0.0.0.0:9004".parse().unwrap();
        let err = clash.validate().unwrap_err().to_string();
        assert!(err.contains("ingest_addr") && err.contains("health_addr"), "{err}");
    }

    #[test]
    fn unknown_field_rejected() {
        let err = PickerConfig::from_yaml("bogus: 1").unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
    }

    #[test]
    fn bad_weights_rejected_with_names() {
        let c = PickerConfig::from_yaml(
            "scoring: { weights: {cache: 0.9, load: 0.2, queue: 0.1, health: 0.05, adapter: 0.05} }",
        )
        .unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("scoring"), "{err}");
    }

    #[test]
    fn preset_custom_scorer_and_overrides() {
        let c = PickerConfig::from_yaml(
            "scoring: {preset: latency-api, seed: 7,\n  \
             weights: {cache: 0.40, load: 0.15, queue: 0.25, health: 0.05, adapter: 0.05},\n  \
             custom: [{scorer: cost, weight: 0.10}]}",
        )
        .unwrap();
        c.validate().unwrap();
        let s = &c.scoring;
        assert_eq!((s.max_queue, s.seed), (10, 7), "preset's maxQueue, own seed");
        assert_eq!(s.custom, vec![CustomScorerConfig::Cost { weight: 0.10, margin: 0.20 }]);
        // A custom weight on top of full built-in weights breaks the sum rule, naming it.
        let c = PickerConfig::from_yaml("scoring: {custom: [{scorer: cost, weight: 0.15, margin: 0.1}]}").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cost=0.15") && err.contains("sum 1.15"), "{err}");
        // An unknown preset is refused when the file is read, naming it (no silent fallback).
        let err = PickerConfig::from_yaml("scoring: {preset: fastest}").unwrap_err().to_string();
        assert!(err.contains("fastest") && err.contains("latency-api"), "{err}");
        assert!(PickerConfig::from_yaml("scoring: {custom: [{scorer: cost, weight: 0.1, bogus: 1}]}").is_err());
        assert!(PickerConfig::from_yaml("scoring: {custom: [{scorer: nope, weight: 0.1}]}").is_err());
    }

    #[test]
    fn missing_tokenizer_dir_is_approximate_mode_unless_precise_is_asked() {
        let c = PickerConfig::from_yaml("models: [{name: m, tokenizer: /nonexistent/dir}]").unwrap();
        c.validate().unwrap();
        assert_eq!(c.models[0].effective_mode(false), RoutingMode::Approximate);
        let c = PickerConfig::from_yaml("models: [{name: m, tokenizer: /nonexistent/dir, mode: precise}]").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("tokenizer.json"));
    }

    #[test]
    fn duplicate_model_and_port_rejected() {
        let c = PickerConfig::from_yaml("models: [{name: m}, {name: m}]").unwrap();
        assert!(c.validate().is_err());
        let c = PickerConfig::from_yaml("ext_proc_addr: 127.0.0.1:9100\nadmin_addr: 127.0.0.1:9100").unwrap();
        assert!(c.validate().is_err());
    }

    #[test]
    fn errors_name_the_field_the_value_and_the_fix() {
        let invalid = |yaml: &str| match PickerConfig::from_yaml(yaml).unwrap().validate() {
            Err(ConfigError::Invalid(InvalidField { field, value, fix })) => (field, value, fix),
            other => panic!("{yaml}: {other:?}"),
        };
        let (field, value, _) = invalid("block_size: 0");
        assert_eq!((field.as_str(), value.as_str()), ("block_size", "0"));
        let (field, value, fix) = invalid("max_blocks_per_pod: 0");
        assert_eq!((field.as_str(), value.as_str()), ("max_blocks_per_pod", "0"));
        assert!(fix.contains("default"), "{fix}");
        let (field, value, fix) = invalid("ext_proc_addr: 127.0.0.1:9100\nadmin_addr: 127.0.0.1:9100");
        assert_eq!((field.as_str(), value.as_str()), ("admin_addr", "127.0.0.1:9100"));
        assert!(fix.contains("ext_proc_addr"), "{fix}");
        let (field, value, _) = invalid("models: [{name: a, approximate: {max_blocks: 0}}]");
        assert_eq!((field.as_str(), value.as_str()), ("models[\"a\"].approximate.max_blocks", "0"));
        // Scoring errors keep their typed source.
        let err = PickerConfig::from_yaml("scoring: {max_queue: 0}").unwrap().validate().unwrap_err();
        assert!(matches!(err, ConfigError::Scoring { source: ScoringConfigError::MaxQueue }), "{err:?}");
        for margin in ["-0.1", "1.5"] {
            let err = PickerConfig::from_yaml(&format!("scoring:\n  cold_placement_margin: {margin}\n"))
                .unwrap()
                .validate()
                .unwrap_err();
            assert!(
                matches!(err, ConfigError::Scoring { source: ScoringConfigError::ColdPlacementMargin(_) }),
                "{margin}: {err:?}"
            );
        }
        let c = PickerConfig::from_yaml("scoring: {cold_placement_margin: 0}").unwrap();
        assert!(c.validate().is_ok() && c.scoring.cold_placement_margin == 0.0);
        assert_eq!(PickerConfig::from_yaml("").unwrap().scoring.full_fleet_kv, 0.8);
        let c = PickerConfig::from_yaml("scoring: {full_fleet_kv: 0}").unwrap();
        assert!(c.validate().is_ok() && c.scoring.full_fleet_kv == 0.0);
        for kv in ["-0.1", "1.5"] {
            let err =
                PickerConfig::from_yaml(&format!("scoring:\n  full_fleet_kv: {kv}\n")).unwrap().validate().unwrap_err();
            assert!(
                matches!(err, ConfigError::Scoring { source: ScoringConfigError::FullFleetKv(_) }),
                "{kv}: {err:?}"
            );
        }
        let c = PickerConfig::from_yaml("scoring: {popularity_placement_margin: 0}").unwrap();
        assert!(c.validate().is_ok() && c.scoring.popularity_placement_margin == 0.0);
        assert_eq!(PickerConfig::from_yaml("").unwrap().scoring.popularity_placement_margin, 0.05);
        let err =
            PickerConfig::from_yaml("scoring: {popularity_placement_margin: 1.5}").unwrap().validate().unwrap_err();
        assert!(
            matches!(err, ConfigError::Scoring { source: ScoringConfigError::PopularityPlacementMargin(_) }),
            "{err:?}"
        );
        // Overrides apply over the preset, with ScoringConfig's own field checks.
        let c = PickerConfig::from_yaml("scoring: {preset: batch, max_queue: 7}").unwrap();
        assert_eq!((c.scoring.max_queue, c.scoring.weights.queue), (7, 0.0));
        let err = PickerConfig::from_yaml("scoring: {preset: batch, max_qeue: 7}").unwrap_err().to_string();
        assert!(err.contains("max_qeue"), "{err}");
    }
}
