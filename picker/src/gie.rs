//! GIE's `EndpointPickerConfig` (`--config-file`), read onto kvroute's scoring
//! (docs/operations.md "From GIE's inferencepool chart").
//!
//! The file is the one GIE's EPP reads: `apiVersion: inference.networking.x-k8s.io/v1alpha1`,
//! `kind: EndpointPickerConfig`, `plugins` (`type`, optional `name` defaulting to the type,
//! optional `parameters`) and `schedulingProfiles` (`name`, `plugins` of `pluginRef` and an
//! optional scorer `weight`, default 1), as GIE's `apix/config/v1alpha1` defines it. Its other
//! top-level fields (`featureGates`, `saturationDetector`, `data`, `flowControl`, `parser`) are
//! accepted and logged as not applied.
//!
//! Mapping (the one scheduling profile's scorers, by plugin type):
//!
//! | GIE / llm-d plugin type | kvroute |
//! |---|---|
//! | `prefix-cache-scorer`, `precise-prefix-cache-scorer` | `cache` weight |
//! | `kv-cache-utilization-scorer`, `running-requests-size-scorer`, `load-aware-scorer`, `active-request-scorer` | `load` weight |
//! | `queue-scorer` | `queue` weight |
//! | `lora-affinity-scorer` | `adapter` weight |
//! | `max-score-picker`, `single-profile-handler` | what kvroute does (highest score, one profile) |
//! | `random-picker`, `weighted-random-picker` | warning: kvroute picks the highest score (ties at random) |
//! | filters (`decode-filter`, `by-label`, ...) | warning: not applied, every pool pod stays a candidate |
//! | data-layer, tokenizer, flow-control and latency-predictor plugins | warning: not applied (kvroute's agents report engine state) |
//! | `kvroute-picker` | its `parameters` are a kvroute picker config (the `--config` file's fields) |
//! | any other type | error naming it |
//!
//! Weights: GIE's weights are relative; those of the scorers mapped to one kvroute factor add up,
//! and the sums are scaled so that they and the base config's `health` weight and custom scorer
//! weights add up to 1 (GIE has no health term; kvroute keeps its own). A profile with no mapped
//! scorer leaves the base weights as they are. More than one scheduling profile (prefill/decode,
//! SLO profiles) is an error: kvroute runs one.
//!
//! Bounds: the file is read up to [`MAX_GIE_CONFIG_BYTES`]; at most [`MAX_PLUGINS`] plugins and
//! profile entries.

use std::collections::BTreeMap;
use std::path::Path;

use kvroute_common::config::{InvalidField, parse_yaml, read_bounded};
use serde::Deserialize;

use crate::config::{ConfigError, PickerConfig};
use crate::score::Weights;

/// Largest `EndpointPickerConfig` file read, in bytes (1 MiB).
pub const MAX_GIE_CONFIG_BYTES: u64 = 1024 * 1024;
/// Most plugins, and most plugin references in a profile, accepted.
pub const MAX_PLUGINS: usize = 256;
/// The `apiVersion` GIE's loader accepts.
pub const GIE_API_VERSION: &str = "inference.networking.x-k8s.io/v1alpha1";
/// The `kind` of GIE's config.
pub const GIE_KIND: &str = "EndpointPickerConfig";
/// The plugin type whose `parameters` are a kvroute picker config.
pub const KVROUTE_PLUGIN: &str = "kvroute-picker";

/// What the config file is called in its errors.
const WHAT: &str = "EndpointPickerConfig file";

/// GIE's `EndpointPickerConfig`, as its `apix/config/v1alpha1` types define it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointPickerConfig {
    /// `inference.networking.x-k8s.io/v1alpha1` (llm-d's `llm-d.ai/v1alpha1` is accepted too).
    pub api_version: String,
    /// `EndpointPickerConfig`.
    pub kind: String,
    /// Experimental EPP features; none applies to kvroute.
    #[serde(default)]
    pub feature_gates: Vec<String>,
    /// Plugin instances.
    #[serde(default)]
    pub plugins: Vec<PluginSpec>,
    /// Named profiles; kvroute runs one.
    #[serde(default)]
    pub scheduling_profiles: Vec<SchedulingProfile>,
    /// GIE's saturation detector (not applied: kvroute spills at `scoring.max_queue`).
    #[serde(default)]
    pub saturation_detector: Option<serde_json::Value>,
    /// GIE's data layer (not applied).
    #[serde(default)]
    pub data: Option<serde_json::Value>,
    /// GIE's flow control (not applied).
    #[serde(default)]
    pub flow_control: Option<serde_json::Value>,
    /// GIE's request parser (not applied: kvroute parses OpenAI bodies itself).
    #[serde(default)]
    pub parser: Option<serde_json::Value>,
}

/// One plugin instance.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    /// Name profiles refer to it by; default its type.
    #[serde(default)]
    pub name: Option<String>,
    /// Plugin type.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// Plugin parameters.
    #[serde(default)]
    pub parameters: Option<serde_json::Value>,
}

impl PluginSpec {
    /// The name profiles use: `name`, else the type.
    pub fn name(&self) -> &str {
        self.name.as_deref().filter(|n| !n.is_empty()).unwrap_or(&self.plugin_type)
    }
}

/// A scheduling profile.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulingProfile {
    /// Profile name.
    pub name: String,
    /// Plugins in it.
    #[serde(default)]
    pub plugins: Vec<ProfilePlugin>,
}

/// A plugin of a profile.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProfilePlugin {
    /// The plugin's name.
    pub plugin_ref: String,
    /// Scorer weight; default 1 (GIE's default scorer weight).
    #[serde(default)]
    pub weight: Option<f64>,
}

/// A kvroute scoring factor a GIE scorer maps onto.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Factor {
    /// Prefix cache match.
    Cache,
    /// Load (KV-cache utilization, running requests).
    Load,
    /// Queue depth.
    Queue,
    /// LoRA adapter affinity.
    Adapter,
}

/// What kvroute does with a plugin type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Scorer(Factor),
    /// What kvroute does anyway (max-score picking, a single profile).
    Native,
    /// Not applied; the reason goes into a warning.
    NotApplied(&'static str),
    /// Its parameters are a kvroute picker config.
    Kvroute,
}

const NOT_AGENT: &str = "kvroute's agents report engine state; this data-layer plugin is not applied";
const NOT_FILTER: &str = "filters are not applied: every Ready pod of the pool stays a candidate";
const NOT_PICKER: &str = "kvroute picks the highest composite score (ties at random)";
const NOT_FLOW: &str = "flow control is not applied: kvroute spills at scoring.max_queue";
const NOT_PREDICTOR: &str = "latency prediction is not available in kvroute; its weight is dropped";
const NOT_PD: &str = "prefill/decode disaggregation is not available in kvroute";

fn role(plugin_type: &str) -> Option<Role> {
    use Factor::*;
    use Role::*;
    Some(match plugin_type {
        "prefix-cache-scorer" | "precise-prefix-cache-scorer" => Scorer(Cache),
        "kv-cache-utilization-scorer"
        | "running-requests-size-scorer"
        | "load-aware-scorer"
        | "active-request-scorer" => Scorer(Load),
        "queue-scorer" => Scorer(Queue),
        "lora-affinity-scorer" => Scorer(Adapter),
        "max-score-picker" | "single-profile-handler" => Native,
        "random-picker" | "weighted-random-picker" => NotApplied(NOT_PICKER),
        "decode-filter"
        | "prefill-filter"
        | "by-label"
        | "by-label-selector"
        | "lora-affinity-filter"
        | "least-queue-filter"
        | "least-kv-cache-filter"
        | "low-queue-filter"
        | "header-based-testing-filter" => NotApplied(NOT_FILTER),
        "metrics-data-source"
        | "core-metrics-extractor"
        | "endpoint-notification-source"
        | "request-attribute-reporter"
        | "tokenizer"
        | "token-producer"
        | "destination-endpoint-served-verifier"
        | "precise-prefix-cache-producer" => NotApplied(NOT_AGENT),
        "global-strict-fairness-policy"
        | "round-robin-fairness-policy"
        | "fcfs-ordering-policy"
        | "edf-ordering-policy" => NotApplied(NOT_FLOW),
        "predicted-latency-scorer" | "slo-aware-routing" => NotApplied(NOT_PREDICTOR),
        "prefill-header-handler" | "prefix-based-pd-decider" | "pd-profile-handler" | "slo-aware-profile-handler" => {
            NotApplied(NOT_PD)
        }
        KVROUTE_PLUGIN => Kvroute,
        _ => return None,
    })
}

/// Plugin types [`read`] knows, for the error naming an unknown one.
pub const KNOWN_SCORERS: &str = "prefix-cache-scorer, precise-prefix-cache-scorer, kv-cache-utilization-scorer, \
    running-requests-size-scorer, load-aware-scorer, active-request-scorer, queue-scorer, lora-affinity-scorer";

/// What an `EndpointPickerConfig` says, in kvroute's terms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GieSettings {
    /// Relative weight per factor from the profile's scorers (empty: keep the base weights).
    pub weights: BTreeMap<Factor, f64>,
    /// The `kvroute-picker` plugin's parameters (a kvroute picker config), if any.
    pub kvroute: Option<serde_json::Value>,
    /// What is not applied, one line each (logged at start as warnings).
    pub warnings: Vec<String>,
}

fn invalid(field: impl Into<String>, value: impl std::fmt::Display, fix: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(InvalidField::new(field, value, fix))
}

/// Reads an `EndpointPickerConfig` file (see the module doc).
///
/// # Errors
/// [`ConfigError::File`] when unreadable, over [`MAX_GIE_CONFIG_BYTES`] or not the schema;
/// [`ConfigError::Invalid`] for a wrong `apiVersion`/`kind`, an unknown plugin type, a profile
/// reference to no plugin, a negative weight, or more than one scheduling profile.
pub fn read(path: &Path) -> Result<GieSettings, ConfigError> {
    let bytes = read_bounded(WHAT, path, MAX_GIE_CONFIG_BYTES)?;
    let config: EndpointPickerConfig = parse_yaml(WHAT, path, &bytes)?;
    settings(&config)
}

/// Parses `text` as an `EndpointPickerConfig` and maps it (see [`read`]).
///
/// # Errors
/// As [`read`].
pub fn from_str(text: &str) -> Result<GieSettings, ConfigError> {
    let config: EndpointPickerConfig = parse_yaml(WHAT, Path::new(""), text.as_bytes())?;
    settings(&config)
}

/// Whether `text` (a config file's content) is a GIE `EndpointPickerConfig` (its `kind`).
pub fn is_endpoint_picker_config(text: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Kind {
        #[serde(default)]
        kind: Option<String>,
    }
    serde_norway::from_slice::<Kind>(text).ok().and_then(|k| k.kind).is_some_and(|k| k == GIE_KIND)
}

/// Maps a parsed config (see the module doc).
///
/// # Errors
/// As [`read`].
pub fn settings(config: &EndpointPickerConfig) -> Result<GieSettings, ConfigError> {
    if config.api_version != GIE_API_VERSION && config.api_version != "llm-d.ai/v1alpha1" {
        return Err(invalid("apiVersion", &config.api_version, format!("must be {GIE_API_VERSION}")));
    }
    if config.kind != GIE_KIND {
        return Err(invalid("kind", &config.kind, format!("must be {GIE_KIND}")));
    }
    if config.plugins.len() > MAX_PLUGINS {
        return Err(invalid("plugins", config.plugins.len(), format!("at most {MAX_PLUGINS} plugins")));
    }
    let mut out = GieSettings::default();
    let mut by_name: BTreeMap<&str, (&PluginSpec, Role)> = BTreeMap::new();
    for p in &config.plugins {
        let Some(role) = role(&p.plugin_type) else {
            return Err(invalid(
                format!("plugins[{:?}].type", p.name()),
                &p.plugin_type,
                format!(
                    "is not a plugin kvroute knows; scorers it maps: {KNOWN_SCORERS}; or {KVROUTE_PLUGIN} for kvroute's own settings"
                ),
            ));
        };
        if by_name.insert(p.name(), (p, role)).is_some() {
            return Err(invalid("plugins[].name", p.name(), "is used twice; give each plugin instance its own name"));
        }
        match role {
            Role::NotApplied(why) => out.warnings.push(format!("plugin {} ({}): {why}", p.name(), p.plugin_type)),
            Role::Kvroute => {
                if out.kvroute.is_some() {
                    return Err(invalid("plugins[].type", KVROUTE_PLUGIN, "appears twice; keep one"));
                }
                out.kvroute = Some(p.parameters.clone().unwrap_or(serde_json::Value::Object(Default::default())));
            }
            Role::Scorer(Factor::Cache) => {
                if let Some(serde_json::Value::Object(params)) = &p.parameters
                    && !params.is_empty()
                {
                    let keys: Vec<&str> = params.keys().map(String::as_str).collect();
                    out.warnings.push(format!(
                        "plugin {} ({}): parameters {keys:?} are not applied; kvroute's prefix index follows the \
                         engines' KV events (approximate mode: models[].approximate)",
                        p.name(),
                        p.plugin_type
                    ));
                }
            }
            Role::Scorer(_) | Role::Native => {}
        }
    }
    for (what, set) in [
        ("featureGates", !config.feature_gates.is_empty()),
        ("saturationDetector", config.saturation_detector.is_some()),
        ("data", config.data.is_some()),
        ("flowControl", config.flow_control.is_some()),
        ("parser", config.parser.is_some()),
    ] {
        if set {
            out.warnings.push(format!("{what}: not applied by kvroute"));
        }
    }
    let profile = match config.scheduling_profiles.as_slice() {
        [] => None,
        [one] => Some(one),
        many => {
            let names: Vec<&str> = many.iter().map(|p| p.name.as_str()).collect();
            return Err(invalid(
                "schedulingProfiles",
                format!("{names:?}"),
                "kvroute runs one scheduling profile (no prefill/decode or SLO profiles); keep one",
            ));
        }
    };
    let Some(profile) = profile else {
        if by_name.values().any(|(_, r)| matches!(r, Role::Scorer(_))) {
            out.warnings.push("no schedulingProfiles: the scorers listed are not used; kvroute's weights apply".into());
        }
        return Ok(out);
    };
    if profile.plugins.len() > MAX_PLUGINS {
        return Err(invalid(
            format!("schedulingProfiles[{:?}].plugins", profile.name),
            profile.plugins.len(),
            format!("at most {MAX_PLUGINS} entries"),
        ));
    }
    for r in &profile.plugins {
        let field = || format!("schedulingProfiles[{:?}].plugins[{:?}]", profile.name, r.plugin_ref);
        let Some((plugin, role)) = by_name.get(r.plugin_ref.as_str()) else {
            return Err(invalid(field(), &r.plugin_ref, "names no plugin of plugins[]"));
        };
        let weight = r.weight.unwrap_or(1.0);
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(invalid(format!("{}.weight", field()), weight, "must be a finite number >= 0"));
        }
        match role {
            Role::Scorer(f) => *out.weights.entry(*f).or_default() += weight,
            _ if r.weight.is_some() && weight > 0.0 => out.warnings.push(format!(
                "plugin {} ({}): weight {weight} ignored, it is no scorer kvroute maps",
                plugin.name(),
                plugin.plugin_type
            )),
            _ => {}
        }
    }
    Ok(out)
}

impl GieSettings {
    /// Applies the scorer weights onto `config.scoring.weights` (see the module doc); the
    /// `kvroute-picker` parameters are read by the caller before this, as the base.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] when the mapped weights are all 0, or the base config's health
    /// and custom weights leave no share for them.
    pub fn apply_weights(&self, config: &mut PickerConfig) -> Result<(), ConfigError> {
        if self.weights.is_empty() {
            return Ok(());
        }
        let total: f64 = self.weights.values().sum();
        if total <= 0.0 {
            return Err(invalid("schedulingProfiles[].plugins[].weight", 0, "the scorers' weights sum to 0"));
        }
        let scoring = &mut config.scoring;
        let custom: f64 = scoring.custom.iter().map(|c| c.weight()).sum();
        let share = 1.0 - scoring.weights.health - custom;
        if share <= 0.0 {
            return Err(invalid(
                "scoring.weights.health",
                scoring.weights.health,
                "with the custom scorers' weights it leaves nothing for the EndpointPickerConfig's scorers",
            ));
        }
        let w = |f: Factor| self.weights.get(&f).copied().unwrap_or(0.0) / total * share;
        scoring.weights = Weights {
            cache: w(Factor::Cache),
            load: w(Factor::Load),
            queue: w(Factor::Queue),
            adapter: w(Factor::Adapter),
            health: scoring.weights.health,
        };
        Ok(())
    }
}

/// Reads the `--config-file` (a GIE `EndpointPickerConfig`, or a kvroute picker config when its
/// `kind` is not `EndpointPickerConfig`) and, optionally, kvroute's own `--config` file, and
/// builds the picker config: `--config` (or the `kvroute-picker` plugin's parameters; not both),
/// else [`PickerConfig::gie_defaults`], with the profile's scorer weights over it. Returns the
/// config, unvalidated for its pool source, and the warnings to log.
///
/// # Errors
/// As [`read`] and [`PickerConfig::load`]; [`ConfigError::Invalid`] when both `--config` and a
/// `kvroute-picker` plugin give kvroute's settings.
pub fn load_with(
    config_file: Option<&Path>,
    gie_file: Option<&Path>,
) -> Result<(PickerConfig, Vec<String>), ConfigError> {
    let gie = match gie_file {
        Some(path) => Some((path, read_bounded(WHAT, path, MAX_GIE_CONFIG_BYTES)?)),
        None => None,
    };
    load_from(config_file, gie.as_ref().map(|(path, bytes)| (*path, bytes.as_slice())))
}

/// As [`load_with`], with the `--config-file`'s content already read: `gie` is its path (what
/// relative paths in it resolve against) and its bytes.
///
/// # Errors
/// As [`load_with`].
pub fn load_from(
    config_file: Option<&Path>,
    gie: Option<(&Path, &[u8])>,
) -> Result<(PickerConfig, Vec<String>), ConfigError> {
    let gie = match gie {
        Some((path, bytes)) => {
            if is_endpoint_picker_config(bytes) {
                let config: EndpointPickerConfig = parse_yaml(WHAT, path, bytes)?;
                Some((settings(&config)?, path))
            } else {
                // A kvroute picker config passed the GIE way.
                if config_file.is_some() {
                    return Err(invalid(
                        "--config-file",
                        path.display(),
                        "is a kvroute picker config and --config is set too; pass kvroute's settings once",
                    ));
                }
                return Ok((PickerConfig::load_bytes(path, bytes)?, Vec::new()));
            }
        }
        None => None,
    };
    let mut config = match (config_file, gie.as_ref().and_then(|(g, _)| g.kvroute.clone())) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                format!("plugins[type={KVROUTE_PLUGIN}]"),
                "set",
                "--config is set too; give kvroute's settings in one place",
            ));
        }
        (Some(path), None) => PickerConfig::load(path)?,
        (None, Some(params)) => {
            let mut c = kvroute_params(params)?;
            if let Some((_, path)) = &gie {
                c.resolve_paths(path.parent().unwrap_or(Path::new("")));
            }
            c
        }
        (None, None) => PickerConfig::gie_defaults(),
    };
    let warnings = match gie {
        Some((g, _)) => {
            g.apply_weights(&mut config)?;
            g.warnings
        }
        None => Vec::new(),
    };
    Ok((config, warnings))
}

/// The `kvroute-picker` plugin's parameters as a picker config: the fields of kvroute's config
/// file, each listener not named there at its [`PickerConfig::gie_defaults`] address.
fn kvroute_params(params: serde_json::Value) -> Result<PickerConfig, ConfigError> {
    let field = format!("plugins[type={KVROUTE_PLUGIN}].parameters");
    let named = |k: &str| params.get(k).is_some();
    let (ext, health, ingest, admin) =
        (named("ext_proc_addr"), named("health_addr"), named("ingest_addr"), named("admin_addr"));
    if !params.is_object() {
        return Err(invalid(field, params, "must be a mapping of kvroute picker config fields"));
    }
    let mut c: PickerConfig =
        serde_json::from_value(params).map_err(|e| invalid(field, "(see the reason)", e.to_string()))?;
    let g = PickerConfig::gie_defaults();
    if !ext {
        c.ext_proc_addr = g.ext_proc_addr;
    }
    if !health {
        c.health_addr = g.health_addr;
    }
    if !ingest {
        c.ingest_addr = g.ingest_addr;
    }
    if !admin {
        c.admin_addr = g.admin_addr;
    }
    Ok(c)
}

/// The server TLS GIE's EPP serves ext_proc with by default (`--secure-serving`, on unless
/// turned off): a self-signed certificate for `localhost` and the pod's name, made at start and
/// written (the key mode 0600) to `$TMPDIR/kvroute-picker-<pid>/`. Gateways set up for GIE's EPP
/// skip verification of it (Istio's `insecureSkipVerify`), as they do for GIE's.
///
/// # Errors
/// [`ConfigError::Invalid`] naming `--secure-serving` when the certificate cannot be made or
/// written.
pub fn self_signed_ext_proc_tls() -> Result<crate::config::ServerTlsFiles, ConfigError> {
    let fail = |e: &dyn std::fmt::Display| {
        invalid("--secure-serving", true, format!("cannot make the self-signed ext_proc certificate: {e}"))
    };
    let mut names = vec!["localhost".to_string()];
    if let Ok(host) = std::env::var("HOSTNAME")
        && !host.is_empty()
    {
        names.push(host);
    }
    let cert = rcgen::generate_simple_self_signed(names).map_err(|e| fail(&e))?;
    let dir = std::env::temp_dir().join(format!("kvroute-picker-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fail(&e))?;
    let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&cert_file, cert.cert.pem()).map_err(|e| fail(&e))?;
    let mut key = std::fs::OpenOptions::new();
    key.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut key, 0o600);
    let mut f = key.open(&key_file).map_err(|e| fail(&e))?;
    std::io::Write::write_all(&mut f, cert.signing_key.serialize_pem().as_bytes()).map_err(|e| fail(&e))?;
    Ok(crate::config::ServerTlsFiles { cert_file, key_file })
}
