//! Cross-reference checks over one rendered overlay. Each check appends [`Problem`]s and never
//! stops early, so one run lists everything that is wrong.

mod configs;
mod envoy;
mod gateway;
pub mod network;
pub mod nodes;
mod ports;
mod refs;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{ConfigMapVolumeSource, Container, ContainerPort, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub use envoy::envoy_failure_mode_allow;

use crate::objects::{Rendered, Workload};

/// One finding: which object, what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `Kind/name` of the object at fault.
    pub object: String,
    /// What is wrong and what it should be.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.message)
    }
}

/// What the checks need besides the objects.
#[derive(Debug, Clone)]
pub struct CheckContext {
    /// Repository root (for `deploy/envoy/envoy.yaml`).
    pub repo_root: PathBuf,
    /// A real tokenizer directory stood in for every tokenizer path under a picker volume
    /// (the volume's contents are not in the repository).
    pub tokenizer_fixture: PathBuf,
    /// The picker StatefulSet's name. Default `kvroute-picker`.
    pub picker: String,
    /// The agent DaemonSet's name. Default `kvroute-agent`.
    pub agent: String,
    /// The standalone Envoy Deployment's name (checked when present). Default `kvroute-envoy`.
    pub envoy: String,
}

impl CheckContext {
    /// Defaults for this repository rooted at `repo_root`.
    pub fn new(repo_root: PathBuf) -> Self {
        let tokenizer_fixture = repo_root.join("tests/fixtures/tokenizer-qwen2.5");
        CheckContext {
            repo_root,
            tokenizer_fixture,
            picker: "kvroute-picker".into(),
            agent: "kvroute-agent".into(),
            envoy: "kvroute-envoy".into(),
        }
    }
}

/// Runs every check; an empty list means the overlay is consistent.
pub fn check_all(r: &Rendered, ctx: &CheckContext) -> Vec<Problem> {
    let mut out = Vec::new();
    ports::services(r, &mut out);
    ports::probes(r, &mut out);
    ports::disruption_budgets(r, &mut out);
    refs::references(r, &mut out);
    refs::security(r, &mut out);
    configs::picker(r, ctx, &mut out);
    configs::agent(r, ctx, &mut out);
    gateway::check(r, ctx, &mut out);
    gateway::namespaces(r, ctx, &mut out);
    envoy::check(r, ctx, &mut out);
    network::check(r, &ctx.picker, &ctx.agent, &ctx.envoy, &mut out);
    nodes::agent_pods_on(r, &ctx.agent, &fleet(FLEET_NODES), &mut out);
    out
}

/// How many nodes [`check_all`] places the agent DaemonSet on (the largest fleet deploy-check
/// models; [`nodes::agent_pods_on`] takes any list).
pub const FLEET_NODES: usize = 50;

/// `n` node names that no manifest could list in advance (`gpu-7f3a-1`, …).
pub fn fleet(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("gpu-7f3a-{i}")).collect()
}

pub(crate) struct Sink<'a> {
    out: &'a mut Vec<Problem>,
    object: String,
}

impl<'a> Sink<'a> {
    pub(crate) fn new(out: &'a mut Vec<Problem>, object: impl Into<String>) -> Self {
        Sink { out, object: object.into() }
    }
    pub(crate) fn push(&mut self, message: impl Into<String>) {
        self.out.push(Problem { object: self.object.clone(), message: message.into() });
    }
}

pub(crate) fn workload_id(w: &Workload<'_>) -> String {
    format!("{}/{}", w.kind, w.name)
}

pub(crate) fn containers(t: &PodTemplateSpec) -> &[Container] {
    t.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or(&[])
}

pub(crate) fn declared_ports(c: &Container) -> &[ContainerPort] {
    c.ports.as_deref().unwrap_or(&[])
}

/// The containerPort a probe/Service `port` (name or number) means in `c`, if declared.
pub(crate) fn resolve_port(c: &Container, port: &IntOrString) -> Option<i32> {
    declared_ports(c).iter().find_map(|p| match port {
        IntOrString::Int(n) if p.container_port == *n => Some(p.container_port),
        IntOrString::String(s) if p.name.as_deref() == Some(s.as_str()) => Some(p.container_port),
        _ => None,
    })
}

/// The port named `name` in `c`.
pub(crate) fn named_port(c: &Container, name: &str) -> Option<i32> {
    resolve_port(c, &IntOrString::String(name.to_string()))
}

/// Whether `labels` carry every pair of `selector` (an empty selector selects nothing here).
pub(crate) fn selects(selector: &BTreeMap<String, String>, labels: Option<&BTreeMap<String, String>>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// The ConfigMap volume that `path` inside `c` lies on, and `path` relative to the mount.
pub(crate) fn config_volume<'t>(
    t: &'t PodTemplateSpec,
    c: &Container,
    path: &str,
) -> Result<(&'t ConfigMapVolumeSource, String), String> {
    let mount = c
        .volume_mounts
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .filter(|m| path.starts_with(&format!("{}/", m.mount_path.trim_end_matches('/'))))
        .max_by_key(|m| m.mount_path.len())
        .ok_or_else(|| format!("{path} is not under any volumeMount of container {}", c.name))?;
    let rel = path[mount.mount_path.trim_end_matches('/').len() + 1..].to_string();
    let volumes = t.spec.as_ref().and_then(|s| s.volumes.as_deref()).unwrap_or(&[]);
    let vol = volumes
        .iter()
        .find(|v| v.name == mount.name)
        .ok_or_else(|| format!("volumeMount {} has no volume", mount.name))?;
    let cmv = vol.config_map.as_ref().ok_or_else(|| format!("volume {} is not a ConfigMap volume", vol.name))?;
    Ok((cmv, rel))
}

/// Reads the file at `path` inside `c` when it comes from a ConfigMap volume: returns
/// (ConfigMap name, key, text), or why it cannot.
pub(crate) fn config_file<'r>(
    r: &'r Rendered,
    t: &PodTemplateSpec,
    c: &Container,
    path: &str,
) -> Result<(String, String, &'r str), String> {
    let (cmv, rel) = config_volume(t, c, path)?;
    let key = match &cmv.items {
        Some(items) => items
            .iter()
            .find(|i| i.path == rel)
            .map(|i| i.key.clone())
            .ok_or_else(|| format!("ConfigMap volume {} projects no item at path {rel}", cmv.name))?,
        None => rel,
    };
    let cm = r.config_map(&cmv.name).ok_or_else(|| format!("ConfigMap {} does not exist", cmv.name))?;
    let text =
        cm.data.as_ref().and_then(|d| d.get(&key)).ok_or_else(|| format!("ConfigMap {} has no key {key}", cmv.name))?;
    Ok((cmv.name.clone(), key, text.as_str()))
}

/// The value following `--config` in the container's args.
pub(crate) fn config_arg(c: &Container) -> Option<&str> {
    let args = c.args.as_deref().unwrap_or(&[]);
    args.iter().position(|a| a == "--config").and_then(|i| args.get(i + 1)).map(String::as_str)
}
