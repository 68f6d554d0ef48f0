//! The picker's one configuration file (YAML, `--config picker.yaml`).
//!
//! Parsed with `serde_norway`, every struct `deny_unknown_fields`, every field defaulted as
//! documented below. [`PickerConfig::validate`] checks everything that can be checked before start
//! (including the scoring weights through `ScoringConfig::validate`); the binary refuses to start
//! with the error's message otherwise.
//!
//! ```yaml
//! ext_proc_addr: 127.0.0.1:9002     # Envoy ext_proc gRPC (+ grpc.health.v1)
//! ingest_addr: 127.0.0.1:9003       # agents' AgentIngest gRPC
//! admin_addr: 127.0.0.1:9090        # /metrics, /healthz, /explain
//! block_size: 16
//! body_limit_bytes: 8388608         # 8 MiB → 413 above it
//! pod_grace_ttl_ms: 10000
//! models:                           # InferenceModel-style: client model name → base model (+ LoRA)
//!   - name: Qwen/Qwen2.5-7B-Instruct
//!     target_model: Qwen/Qwen2.5-7B-Instruct
//!     adapter: null
//!     tokenizer: tests/fixtures/tokenizer-qwen2.5   # dir; relative to the config file's dir
//!     # mode: precise                 # default: precise with a tokenizer, approximate without
//!   - name: other-model               # no tokenizer: approximate mode (docs/design.md §6)
//!     approximate: { block_chars: 64, capacity_blocks_per_pod: 31250, max_blocks: 256 }
//! scoring: { weights: {cache: 0.6, load: 0.2, queue: 0.1, health: 0.05, adapter: 0.05},
//!            max_queue: 20, max_utilization: 1.0, health_exclusion_threshold: 0.3, seed: 0 }
//! # or a preset (README "Tuning guide") with overrides and custom scorers:
//! # scoring:
//! #   preset: latency-api
//! #   weights: {cache: 0.40, load: 0.15, queue: 0.25, health: 0.05, adapter: 0.05}
//! #   custom: [{scorer: cost, weight: 0.10, margin: 0.20}]
//! ```
//!
//! Concurrency: built once at start-up, then shared read-only.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::approx::{ApproxConfig, RoutingMode};
use crate::score::{CustomScorerConfig, ScoringConfig, ScoringConfigError, Weights};

/// Errors from reading or validating the configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    /// The YAML did not parse or had unknown/mistyped fields.
    #[error("invalid config file {path}: {source}")]
    Parse { path: PathBuf, source: serde_norway::Error },
    /// A value is out of range or inconsistent; the message says which and what to do.
    #[error("invalid config: {0}")]
    Invalid(String),
}

fn default_ext_proc_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9002))
}
fn default_ingest_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9003))
}
fn default_admin_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}
fn default_block_size() -> usize {
    kvroute_common::DEFAULT_BLOCK_SIZE
}
fn default_body_limit_bytes() -> usize {
    8 * 1024 * 1024
}
fn default_pod_grace_ttl_ms() -> u64 {
    10_000
}

/// Largest body limit accepted: the ext_proc gRPC server's receive limit is sized from it.
pub const MAX_BODY_LIMIT_BYTES: usize = 256 * 1024 * 1024;

/// The picker's configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PickerConfig {
    /// Envoy ext_proc gRPC listen address (also serves `grpc.health.v1`). Default `127.0.0.1:9002`.
    #[serde(default = "default_ext_proc_addr")]
    pub ext_proc_addr: SocketAddr,
    /// Agents' `AgentIngest` gRPC listen address. Default `127.0.0.1:9003`.
    #[serde(default = "default_ingest_addr")]
    pub ingest_addr: SocketAddr,
    /// Admin HTTP listen address (`/metrics`, `/healthz`, `/explain`). Default `127.0.0.1:9090`.
    #[serde(default = "default_admin_addr")]
    pub admin_addr: SocketAddr,
    /// Tokens per KV block; must equal vLLM's `--block-size`. Default 16.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// Largest request body, in bytes, the picker parses; above it the request gets a 413.
    /// Default 8 MiB (8388608). Envoy's own buffer limit should be set higher (docs/design.md §5).
    #[serde(default = "default_body_limit_bytes")]
    pub body_limit_bytes: usize,
    /// How long, in ms, a disconnected pod's blocks are kept before removal. Default 10000.
    #[serde(default = "default_pod_grace_ttl_ms")]
    pub pod_grace_ttl_ms: u64,
    /// Client-facing model names and what they resolve to (InferenceModel-style). A request
    /// whose `model` is not listed gets a 404.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Scoring weights and thresholds (docs/design.md §4). Every field defaults to the `chatbot` preset.
    #[serde(default)]
    pub scoring: ScoringSection,
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
    /// approximate mode (unless `mode: precise`, then by load only).
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
}

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

/// The `scoring:` section: an optional preset, then per-field overrides. Each absent field takes
/// the preset's value, or `ScoringConfig::default()`'s (the `chatbot` preset) without one. Mirrors
/// [`ScoringConfig`] field for field (plus `preset`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoringSection {
    /// Named preset (docs/design.md §4): `chatbot`, `latency-api`, `batch`, `multi-lora`.
    /// Default none (= `chatbot`).
    #[serde(default)]
    pub preset: Option<String>,
    /// Factor weights, each in [0,1], summing to 1 (default 0.60/0.20/0.10/0.05/0.05).
    #[serde(default)]
    pub weights: Option<Weights>,
    /// Queue depth (requests) at which a pod is full. Default 20.
    #[serde(default)]
    pub max_queue: Option<u32>,
    /// GPU utilization, in [0,1], that counts as fully loaded. Default 1.0.
    #[serde(default)]
    pub max_utilization: Option<f64>,
    /// Pods with a health score below this are not candidates. Default 0.3.
    #[serde(default)]
    pub health_exclusion_threshold: Option<f64>,
    /// Answer 429 when every pod is at `max_queue` instead of degrading. Default false.
    #[serde(default)]
    pub shed_when_saturated: Option<bool>,
    /// Seed of the tie-break random choice. Default 0.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Custom scorers with their weights, e.g. `[{scorer: cost, weight: 0.15, margin: 0.20}]`;
    /// the built-in weights must leave room for them (sum 1.0). Default none.
    #[serde(default)]
    pub custom: Option<Vec<CustomScorerConfig>>,
}

impl ScoringSection {
    /// The section applied over its preset (or the defaults); fails on an unknown preset.
    pub fn resolve(&self) -> Result<ScoringConfig, ScoringConfigError> {
        let base = match &self.preset {
            None => ScoringConfig::default(),
            Some(name) => ScoringConfig::preset(name).ok_or_else(|| ScoringConfigError::UnknownPreset(name.clone()))?,
        };
        Ok(self.apply(base))
    }

    /// The section applied over its preset or the defaults. An unknown preset (which
    /// [`PickerConfig::validate`] refuses) falls back to the defaults here.
    pub fn to_scoring_config(&self) -> ScoringConfig {
        self.resolve().unwrap_or_else(|_| self.apply(ScoringConfig::default()))
    }

    fn apply(&self, base: ScoringConfig) -> ScoringConfig {
        let mut c = base;
        if let Some(v) = &self.custom {
            c.custom.clone_from(v);
        }
        if let Some(w) = &self.weights {
            c.weights = *w;
        }
        if let Some(v) = self.max_queue {
            c.max_queue = v;
        }
        if let Some(v) = self.max_utilization {
            c.max_utilization = v;
        }
        if let Some(v) = self.health_exclusion_threshold {
            c.health_exclusion_threshold = v;
        }
        if let Some(v) = self.shed_when_saturated {
            c.shed_when_saturated = v;
        }
        if let Some(v) = self.seed {
            c.seed = v;
        }
        c
    }
}

impl PickerConfig {
    /// Reads, parses and validates `path`; relative tokenizer paths are resolved against the
    /// file's directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let mut config = Self::from_yaml(&text).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse { path: path.to_path_buf(), source },
            other => other,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        config.resolve_paths(&base);
        config.validate()?;
        Ok(config)
    }

    /// Parses YAML text (no path resolution, no validation).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        serde_norway::from_str(text).map_err(|source| ConfigError::Parse { path: PathBuf::new(), source })
    }

    /// Makes relative tokenizer directories relative to `base` (the config file's directory).
    pub fn resolve_paths(&mut self, base: &Path) {
        for m in &mut self.models {
            if let Some(t) = &m.tokenizer
                && t.is_relative()
            {
                m.tokenizer = Some(base.join(t));
            }
        }
    }

    /// Checks ranges and consistency; the error names the field and the fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Invalid(
                "block_size must be > 0 (tokens per KV block, equal to vLLM's --block-size)".into(),
            ));
        }
        if self.body_limit_bytes == 0 || self.body_limit_bytes > MAX_BODY_LIMIT_BYTES {
            return Err(ConfigError::Invalid(format!(
                "body_limit_bytes = {} must be in 1..={MAX_BODY_LIMIT_BYTES}",
                self.body_limit_bytes
            )));
        }
        let addrs =
            [("ext_proc_addr", self.ext_proc_addr), ("ingest_addr", self.ingest_addr), ("admin_addr", self.admin_addr)];
        for (i, (na, a)) in addrs.iter().enumerate() {
            for (nb, b) in &addrs[i + 1..] {
                if a.port() != 0 && a == b {
                    return Err(ConfigError::Invalid(format!(
                        "{na} and {nb} are both {a}; give each listener its own port"
                    )));
                }
            }
        }
        let mut names = HashSet::new();
        for m in &self.models {
            if m.name.trim().is_empty() {
                return Err(ConfigError::Invalid("models[].name must not be empty".into()));
            }
            if !names.insert(m.name.as_str()) {
                return Err(ConfigError::Invalid(format!("model {:?} is listed twice under models", m.name)));
            }
            if m.target().trim().is_empty() {
                return Err(ConfigError::Invalid(format!("model {:?}: target_model must not be empty", m.name)));
            }
            if let Some(field) = m.approximate.invalid_field() {
                return Err(ConfigError::Invalid(format!(
                    "model {:?}: approximate.{field} must be >= 1 (omit it for the default)",
                    m.name
                )));
            }
            if m.mode == Some(RoutingMode::Precise) && m.tokenizer.is_none() {
                return Err(ConfigError::Invalid(format!(
                    "model {:?}: mode precise needs a tokenizer directory; set tokenizer or use mode approximate",
                    m.name
                )));
            }
            if let Some(a) = &m.adapter
                && a.trim().is_empty()
            {
                return Err(ConfigError::Invalid(format!(
                    "model {:?}: adapter is empty; use null for the base model",
                    m.name
                )));
            }
            if let Some(dir) = &m.tokenizer
                && !dir.join("tokenizer.json").is_file()
            {
                return Err(ConfigError::Invalid(format!(
                    "model {:?}: tokenizer directory {} has no tokenizer.json",
                    m.name,
                    dir.display()
                )));
            }
        }
        self.scoring.resolve().and_then(|c| c.validate()).map_err(|e| ConfigError::Invalid(format!("scoring: {e}")))?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
ext_proc_addr: 127.0.0.1:9002
ingest_addr: 127.0.0.1:9003
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
        assert_eq!(c.scoring.to_scoring_config().max_queue, 20);
    }

    #[test]
    fn defaults_apply() {
        let c = PickerConfig::from_yaml("models: []").unwrap();
        assert_eq!(c.ext_proc_addr.port(), 9002);
        assert_eq!(c.block_size, 16);
        assert_eq!(c.pod_grace_ttl_ms, 10_000);
        c.validate().unwrap();
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
        let s = c.scoring.to_scoring_config();
        assert_eq!((s.max_queue, s.seed), (10, 7), "preset's maxQueue, own seed");
        assert_eq!(s.custom, vec![CustomScorerConfig::Cost { weight: 0.10, margin: 0.20 }]);
        // A custom weight on top of full built-in weights breaks the sum rule, naming it.
        let c = PickerConfig::from_yaml("scoring: {custom: [{scorer: cost, weight: 0.15, margin: 0.1}]}").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cost=0.15") && err.contains("sum 1.15"), "{err}");
        let c = PickerConfig::from_yaml("scoring: {preset: fastest}").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("fastest"));
        assert!(PickerConfig::from_yaml("scoring: {custom: [{scorer: cost, weight: 0.1, bogus: 1}]}").is_err());
        assert!(PickerConfig::from_yaml("scoring: {custom: [{scorer: nope, weight: 0.1}]}").is_err());
    }

    #[test]
    fn missing_tokenizer_dir_rejected() {
        let c = PickerConfig::from_yaml("models: [{name: m, tokenizer: /nonexistent/dir}]").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("tokenizer.json"));
    }

    #[test]
    fn duplicate_model_and_port_rejected() {
        let c = PickerConfig::from_yaml("models: [{name: m}, {name: m}]").unwrap();
        assert!(c.validate().is_err());
        let c = PickerConfig::from_yaml("ext_proc_addr: 127.0.0.1:9100\nadmin_addr: 127.0.0.1:9100").unwrap();
        assert!(c.validate().is_err());
    }
}
