//! The agent's view of its node: one engine per pool pod on the node and target port, with what
//! the agent needs to reach it (HTTP address, KV-event PUB and replay ROUTER endpoints) read from
//! the Pod object. docs/design.md §7, §14.
//!
//! KV-event endpoints come from the vLLM container's `--kv-events-config` JSON (vLLM
//! `vllm/config/kv_events.py`: `enable_kv_cache_events` default false, `publisher` `zmq`/`null`
//! (default `zmq` when enabled), `endpoint` default `tcp://*:5557`, `replay_endpoint` default none,
//! `topic` default `""`). vLLM's publisher (`vllm/distributed/kv_events.py`) binds the PUB socket
//! only when the endpoint contains `*` or `::` (otherwise it *connects* out, and there is nothing
//! to subscribe to), always binds the ROUTER replay socket, and adds the data-parallel rank to both
//! ports. So a wildcard host means "this pod's IP", and rank `r` of a container listens on
//! `port + r`. The pod annotations `kvroute.io/kv-events-port` / `kvroute.io/kv-replay-port`
//! override the ports (one number = rank 0's port, or a comma list, one per served target port;
//! `none` turns the endpoint off).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::Value;

use crate::pool::{PoolPod, PoolSpecView, Source, endpoint_name};

/// Pod annotation overriding the KV-event PUB port.
pub const KV_EVENTS_PORT_ANNOTATION: &str = "kvroute.io/kv-events-port";
/// Pod annotation overriding the KV-event replay (ROUTER) port.
pub const KV_REPLAY_PORT_ANNOTATION: &str = "kvroute.io/kv-replay-port";
/// Longest `--kv-events-config` value read.
pub const MAX_KV_EVENTS_CONFIG: usize = 64 * 1024;
/// vLLM's default HTTP port.
pub const VLLM_DEFAULT_PORT: u16 = 8000;
/// Most pods one node view holds.
pub const MAX_NODE_PODS: usize = 1024;

/// A GPU an engine uses: a UUID (`GPU-…`, `MIG-…`, as NVML and the NVIDIA device plugin name
/// them) or, in engine files, an NVML index.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize, serde::Serialize)]
#[serde(untagged)]
pub enum GpuRef {
    /// NVML index.
    Index(u32),
    /// NVML / device-plugin UUID.
    Uuid(String),
}

/// One engine: a pod × target port on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSpec {
    /// `<pod>-rank-<rank>`: the picker's endpoint name.
    pub endpoint: String,
    /// Pod name.
    pub pod: String,
    /// Namespace.
    pub namespace: String,
    /// `metadata.uid`.
    pub uid: Option<String>,
    /// Index of the port in the pool's target ports.
    pub rank: u32,
    /// `podIP:port` of the engine's HTTP server.
    pub http: SocketAddr,
    /// Pod Ready and not terminating.
    pub ready: bool,
    /// The container serving the port, when the Pod says.
    pub container: Option<String>,
    /// ZeroMQ PUB endpoint (`tcp://ip:port`), if KV events are published and reachable.
    pub kv_events: Option<String>,
    /// ZeroMQ ROUTER replay endpoint, if configured and reachable.
    pub kv_replay: Option<String>,
    /// The publisher's topic (vLLM default `""`).
    pub kv_topic: String,
    /// `--model` / `vllm serve MODEL`.
    pub model: Option<String>,
    /// `--served-model-name` values.
    pub served_model_names: Vec<String>,
    /// `--block-size`.
    pub block_size: Option<u32>,
    /// `--max-num-seqs`.
    pub max_num_seqs: Option<u32>,
    /// GPUs, when the source says (engine files; from Kubernetes they come from PodResources).
    pub gpus: Vec<GpuRef>,
    /// Pod labels.
    pub labels: Arc<BTreeMap<String, String>>,
    /// Pod annotations.
    pub annotations: Arc<BTreeMap<String, String>>,
    /// Why something the agent would want is missing (e.g. an unreachable KV endpoint).
    pub problems: Vec<String>,
}

/// An immutable snapshot of the engines on one node, published whole on every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// Where it comes from.
    pub source: Source,
    /// The node.
    pub node: String,
    /// The pool's spec (`None` while absent; engine files have none).
    pub pool: Option<PoolSpecView>,
    /// Engines sorted by endpoint name.
    pub engines: Vec<EngineSpec>,
    /// The first complete list (or file read) has been applied.
    pub synced: bool,
    /// Pods left out because the view is full ([`MAX_NODE_PODS`]).
    pub dropped_pods: usize,
    /// Bumped on every published change.
    pub generation: u64,
}

crate::watch::snapshot_impl!(NodeView);

impl NodeView {
    /// An empty, unsynced view.
    pub fn empty(source: Source, node: &str) -> Self {
        Self {
            source,
            node: node.into(),
            pool: None,
            engines: Vec::new(),
            synced: false,
            dropped_pods: 0,
            generation: 0,
        }
    }

    /// The engine named `endpoint`.
    pub fn engine(&self, endpoint: &str) -> Option<&EngineSpec> {
        self.engines.iter().find(|e| e.endpoint == endpoint)
    }

    /// Content equality, generation aside.
    pub fn same_content(&self, other: &Self) -> bool {
        self.synced == other.synced
            && self.dropped_pods == other.dropped_pods
            && self.node == other.node
            && self.source == other.source
            && self.pool == other.pool
            && self.engines == other.engines
    }
}

/// What kvroute reads of a vLLM command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VllmArgs {
    /// `--model M` or `vllm serve M`.
    pub model: Option<String>,
    /// `--served-model-name A [B …]`.
    pub served_model_names: Vec<String>,
    /// `--port`.
    pub port: Option<u16>,
    /// `--kv-events-config` (JSON, or dotted `--kv-events-config.key value`), as given.
    pub kv_events_config: Option<serde_json::Map<String, Value>>,
    /// `--block-size`.
    pub block_size: Option<u32>,
    /// `--max-num-seqs`.
    pub max_num_seqs: Option<u32>,
    /// `--data-parallel-rank` (one rank per process).
    pub data_parallel_rank: Option<u32>,
    /// `--data-parallel-start-rank`.
    pub data_parallel_start_rank: Option<u32>,
    /// Whether the command line mentions vLLM at all.
    pub is_vllm: bool,
}

/// The effective `--kv-events-config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// Events are published over ZeroMQ.
    pub zmq: bool,
    /// PUB endpoint (default `tcp://*:5557`).
    pub endpoint: String,
    /// ROUTER replay endpoint (default none).
    pub replay_endpoint: Option<String>,
    /// Topic (default empty).
    pub topic: String,
}

impl VllmArgs {
    /// Parses a container's `command` + `args` (a `sh -c "…"` script is split as the shell
    /// would). Unknown flags are skipped.
    ///
    /// # Errors
    /// A malformed value of a flag kvroute reads (named in the message).
    pub fn parse(argv: &[String]) -> Result<Self, String> {
        let tokens = expand_shell(argv);
        let mut out = Self { is_vllm: tokens.iter().any(|t| t.contains("vllm")), ..Self::default() };
        let mut dotted = serde_json::Map::new();
        let mut i = 0;
        while i < tokens.len() {
            let tok = &tokens[i];
            if tok == "serve"
                && out.model.is_none()
                && let Some(next) = tokens.get(i + 1).filter(|n| !n.starts_with('-'))
            {
                out.model = Some(next.clone());
                i += 2;
                continue;
            }
            let Some(flag) = tok.strip_prefix("--") else {
                i += 1;
                continue;
            };
            let (name, inline) = match flag.split_once('=') {
                Some((n, v)) => (n.replace('_', "-"), Some(v.to_string())),
                None => (flag.replace('_', "-"), None),
            };
            let takes_value = matches!(
                name.as_str(),
                "model"
                    | "port"
                    | "kv-events-config"
                    | "block-size"
                    | "max-num-seqs"
                    | "data-parallel-rank"
                    | "data-parallel-start-rank"
            ) || name.starts_with("kv-events-config.");
            if name == "served-model-name" {
                let mut values: Vec<String> = inline.into_iter().collect();
                let mut j = i + 1;
                if values.is_empty() {
                    while let Some(v) = tokens.get(j).filter(|v| !v.starts_with("--")) {
                        values.push(v.clone());
                        j += 1;
                    }
                }
                out.served_model_names = values;
                i = j;
                continue;
            }
            if !takes_value {
                i += 1;
                continue;
            }
            let (value, next) = match inline {
                Some(v) => (Some(v), i + 1),
                None => (tokens.get(i + 1).cloned(), i + 2),
            };
            let Some(value) = value else {
                return Err(format!("--{name} has no value"));
            };
            match name.as_str() {
                "model" => out.model = Some(value),
                "port" => out.port = Some(parse_num(&name, &value)?),
                "block-size" => out.block_size = Some(parse_num(&name, &value)?),
                "max-num-seqs" => out.max_num_seqs = Some(parse_num(&name, &value)?),
                "data-parallel-rank" => out.data_parallel_rank = Some(parse_num(&name, &value)?),
                "data-parallel-start-rank" => out.data_parallel_start_rank = Some(parse_num(&name, &value)?),
                "kv-events-config" => {
                    if value.len() > MAX_KV_EVENTS_CONFIG {
                        return Err(format!("--kv-events-config is longer than {MAX_KV_EVENTS_CONFIG} bytes"));
                    }
                    match serde_json::from_str::<Value>(&value) {
                        Ok(Value::Object(m)) => out.kv_events_config = Some(normalize_keys(m)),
                        _ => return Err(format!("--kv-events-config is not a JSON object: {value:?}")),
                    }
                }
                dotted_name => {
                    let key = dotted_name.trim_start_matches("kv-events-config.").replace('-', "_");
                    dotted.insert(key, scalar(&value));
                }
            }
            i = next;
        }
        if !dotted.is_empty() {
            let mut base = out.kv_events_config.take().unwrap_or_default();
            base.extend(dotted);
            out.kv_events_config = Some(base);
        }
        Ok(out)
    }

    /// The effective KV-events configuration with vLLM's defaults, `None` when events are off.
    pub fn kv_events(&self) -> Option<KvEventsConfig> {
        let m = self.kv_events_config.as_ref()?;
        let enabled = m.get("enable_kv_cache_events").is_some_and(truthy);
        let publisher = m.get("publisher").and_then(Value::as_str).map(str::to_string);
        let zmq = match publisher.as_deref() {
            Some("zmq") => true,
            Some(_) => false,
            None => enabled,
        };
        if !enabled || !zmq {
            return None;
        }
        Some(KvEventsConfig {
            zmq,
            endpoint: m.get("endpoint").and_then(Value::as_str).unwrap_or("tcp://*:5557").to_string(),
            replay_endpoint: m
                .get("replay_endpoint")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string),
            topic: m.get("topic").and_then(Value::as_str).unwrap_or("").to_string(),
        })
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        Value::String(s) => matches!(s.to_ascii_lowercase().as_str(), "true" | "1" | "yes"),
        Value::Number(n) => n.as_i64() == Some(1),
        _ => false,
    }
}

fn scalar(s: &str) -> Value {
    match s {
        "true" | "True" => Value::Bool(true),
        "false" | "False" => Value::Bool(false),
        _ => s.parse::<i64>().map(Value::from).unwrap_or_else(|_| Value::String(s.to_string())),
    }
}

fn normalize_keys(m: serde_json::Map<String, Value>) -> serde_json::Map<String, Value> {
    m.into_iter().map(|(k, v)| (k.replace('-', "_"), v)).collect()
}

fn parse_num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
    v.trim().parse().map_err(|_| format!("--{name} {v:?} is not a valid number"))
}

/// `command` + `args`, with a `sh -c SCRIPT` (or bash, dash, ash) split into shell words.
fn expand_shell(argv: &[String]) -> Vec<String> {
    let is_shell = argv.first().is_some_and(|a| {
        let base = a.rsplit('/').next().unwrap_or(a);
        matches!(base, "sh" | "bash" | "dash" | "ash" | "zsh")
    });
    if is_shell
        && let Some(pos) = argv.iter().position(|a| a == "-c" || a == "-ec" || a == "-xc" || a == "-exc")
        && let Some(script) = argv.get(pos + 1)
    {
        let mut out: Vec<String> =
            shlex::split(script).unwrap_or_else(|| script.split_whitespace().map(str::to_string).collect());
        out.extend(argv[pos + 2..].iter().cloned());
        return out;
    }
    argv.to_vec()
}

/// Replaces Kubernetes `$(VAR)` references (expanded by the kubelet at container start, so still
/// literal in the Pod object) with the container's env value, or the pod IP for a variable bound
/// to `status.podIP`. Unknown variables are left as they are.
pub fn expand_env(s: &str, container: &Container, pod_ip: Option<IpAddr>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find(')') else {
            out.push_str(&rest[start..]);
            return out;
        };
        let var = &after[..end];
        let value = container.env.as_ref().and_then(|env| env.iter().find(|e| e.name == var)).and_then(|e| {
            if let Some(v) = &e.value {
                return Some(v.clone());
            }
            let field = e.value_from.as_ref()?.field_ref.as_ref()?.field_path.as_str();
            matches!(field, "status.podIP" | "status.podIPs").then(|| pod_ip.map(|ip| ip.to_string())).flatten()
        });
        match value {
            Some(v) => out.push_str(&v),
            None => out.push_str(&rest[start..start + 2 + end + 1]),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

/// Which socket of vLLM's publisher an endpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSocket {
    /// The PUB socket (`endpoint`): bound only for a wildcard host.
    Pub,
    /// The ROUTER replay socket (`replay_endpoint`): always bound.
    Replay,
}

/// Resolves a vLLM ZeroMQ endpoint to one the agent can dial, for `pod_ip` and data-parallel
/// offset `offset`.
///
/// # Errors
/// Not `tcp://host:port`; a PUB socket vLLM connects out from instead of binding; a replay socket
/// bound to an address other pods cannot reach; a port overflow.
pub fn resolve_endpoint(endpoint: &str, socket: KvSocket, pod_ip: IpAddr, offset: u32) -> Result<String, String> {
    let Some(hostport) = endpoint.strip_prefix("tcp://") else {
        return Err(format!("{endpoint:?}: only tcp:// endpoints can be reached from another pod"));
    };
    let Some((host, port)) = hostport.rsplit_once(':') else {
        return Err(format!("{endpoint:?}: no port"));
    };
    let port: u16 = port.parse().map_err(|_| format!("{endpoint:?}: bad port"))?;
    let port =
        u16::try_from(u32::from(port) + offset).map_err(|_| format!("{endpoint:?}: port + rank {offset} overflows"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let wildcard = host == "*" || host == "::";
    let ip = match socket {
        KvSocket::Pub if !wildcard => {
            return Err(format!(
                "{endpoint:?}: vLLM connects its PUB socket out to this address instead of binding it (only `*` or `::` make it bind); use tcp://*:PORT"
            ));
        }
        _ if wildcard || host == "0.0.0.0" => pod_ip,
        _ => match host.parse::<IpAddr>() {
            Ok(ip) if ip == pod_ip => ip,
            Ok(ip) => return Err(format!("{endpoint:?}: bound to {ip}, which is not the pod's address {pod_ip}")),
            Err(_) => return Err(format!("{endpoint:?}: host {host:?} is not an address of the pod")),
        },
    };
    Ok(format!("tcp://{}", SocketAddr::new(ip, port)))
}

/// Parses an override annotation: `none` → `Ok(None)`; one port → rank-0 port plus `offset`;
/// a comma list → the `position`-th entry.
fn override_port(value: &str, position: usize, offset: u32) -> Result<Option<u16>, String> {
    let v = value.trim();
    if v.eq_ignore_ascii_case("none") || v.is_empty() {
        return Ok(None);
    }
    let parts: Vec<&str> = v.split(',').map(str::trim).collect();
    let bad = || format!("{value:?} is not a port, a comma-separated list of ports, or \"none\"");
    if parts.len() == 1 {
        let base: u16 = parts[0].parse().map_err(|_| bad())?;
        let port = u32::from(base) + offset;
        return u16::try_from(port).map(Some).map_err(|_| bad());
    }
    let p = parts.get(position).ok_or_else(|| format!("{value:?} lists no port for engine {position}"))?;
    p.parse().map(Some).map_err(|_| bad())
}

fn container_argv(c: &Container) -> Vec<String> {
    c.command.iter().flatten().chain(c.args.iter().flatten()).cloned().collect()
}

/// The container serving `port`: the one declaring it, else the one whose vLLM listens on it,
/// else the only one publishing KV events, else the first.
fn port_owner(containers: &[Container], parsed: &[Result<VllmArgs, String>], port: u16) -> Option<usize> {
    let by_port = containers.iter().position(|c| c.ports.iter().flatten().any(|p| p.container_port == i32::from(port)));
    by_port
        .or_else(|| {
            parsed
                .iter()
                .position(|a| a.as_ref().is_ok_and(|a| a.port.or(a.is_vllm.then_some(VLLM_DEFAULT_PORT)) == Some(port)))
        })
        .or_else(|| {
            let with_kv: Vec<usize> =
                (0..parsed.len()).filter(|&i| parsed[i].as_ref().is_ok_and(|a| a.kv_events_config.is_some())).collect();
            (with_kv.len() == 1).then(|| with_kv[0])
        })
        .or_else(|| (!containers.is_empty()).then_some(0))
}

/// The KV-event PUB and replay endpoints of the engine at `position` among the pod's ports (data
/// parallel rank offset `offset`): from its `--kv-events-config` (`expand` fills the container's
/// environment), then overridden by the pod's port annotations. What cannot be resolved is left
/// out and said in `problems`.
fn kv_endpoints(
    kv: Option<&KvEventsConfig>,
    pool_pod: &PoolPod,
    ip: IpAddr,
    position: usize,
    offset: u32,
    expand: impl Fn(&str) -> String,
    problems: &mut Vec<String>,
) -> (Option<String>, Option<String>) {
    let mut kv_events = None;
    let mut kv_replay = None;
    if let Some(kv) = kv {
        match resolve_endpoint(&expand(&kv.endpoint), KvSocket::Pub, ip, offset) {
            Ok(e) => kv_events = Some(e),
            Err(e) => problems.push(format!("kv events: {e}")),
        }
        if let Some(r) = &kv.replay_endpoint {
            match resolve_endpoint(&expand(r), KvSocket::Replay, ip, offset) {
                Ok(e) => kv_replay = Some(e),
                Err(e) => problems.push(format!("kv replay: {e}")),
            }
        }
    }
    for (annotation, slot) in [(KV_EVENTS_PORT_ANNOTATION, &mut kv_events), (KV_REPLAY_PORT_ANNOTATION, &mut kv_replay)]
    {
        if let Some(v) = pool_pod.annotations.get(annotation) {
            match override_port(v, position, offset) {
                Ok(p) => *slot = p.map(|p| format!("tcp://{}", SocketAddr::new(ip, p))),
                Err(e) => problems.push(format!("{annotation}: {e}")),
            }
        }
    }
    (kv_events, kv_replay)
}

/// The engines of one pod: one per served target port (`pool_pod.ports`), with the container
/// that serves it and its vLLM settings. Pods without an IP have no engines yet.
pub fn engines_of(pod: &Pod, pool_pod: &PoolPod) -> Vec<EngineSpec> {
    let Some(ip) = pool_pod.ip else { return Vec::new() };
    let containers: &[Container] = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or(&[]);
    let parsed: Vec<Result<VllmArgs, String>> =
        containers.iter().map(|c| VllmArgs::parse(&container_argv(c))).collect();
    let owners: Vec<Option<usize>> =
        pool_pod.ports.iter().map(|&(_, port)| port_owner(containers, &parsed, port)).collect();
    let mut out = Vec::new();
    for (position, &(rank, port)) in pool_pod.ports.iter().enumerate() {
        let mut problems = Vec::new();
        let ci = owners[position];
        // Index of this port among the ports the same container serves.
        let local = owners[..position].iter().filter(|o| **o == ci).count() as u32;
        let args = match ci.map(|i| &parsed[i]) {
            Some(Ok(a)) => a.clone(),
            Some(Err(e)) => {
                problems.push(e.clone());
                VllmArgs::default()
            }
            None => VllmArgs::default(),
        };
        let offset = args.data_parallel_rank.unwrap_or(args.data_parallel_start_rank.unwrap_or(0) + local);
        let container = ci.map(|i| &containers[i]);
        let expand = |s: &str| container.map_or_else(|| s.to_string(), |c| expand_env(s, c, Some(ip)));
        let kv = args.kv_events();
        let (kv_events, kv_replay) = kv_endpoints(kv.as_ref(), pool_pod, ip, position, offset, expand, &mut problems);
        out.push(EngineSpec {
            endpoint: endpoint_name(&pool_pod.name, rank),
            pod: pool_pod.name.clone(),
            namespace: pool_pod.namespace.clone(),
            uid: pool_pod.uid.clone(),
            rank,
            http: SocketAddr::new(ip, port),
            ready: pool_pod.ready && !pool_pod.terminating,
            container: container.map(|c| c.name.clone()),
            kv_events,
            kv_replay,
            kv_topic: kv.map(|k| k.topic).unwrap_or_default(),
            model: args.model,
            served_model_names: args.served_model_names,
            block_size: args.block_size,
            max_num_seqs: args.max_num_seqs,
            gpus: Vec::new(),
            labels: pool_pod.labels.clone(),
            annotations: pool_pod.annotations.clone(),
            problems,
        });
    }
    out
}

/// Builds a node view from the pool spec and the node's pool pods.
pub fn build_node_view<'a>(
    source: Source,
    node: &str,
    pool: Option<&PoolSpecView>,
    pods: impl IntoIterator<Item = &'a Pod>,
    synced: bool,
) -> NodeView {
    let mut engines = Vec::new();
    let mut count = 0;
    let mut dropped_pods = 0;
    if let Some(spec) = pool {
        for pod in pods {
            let Some(pp) = PoolPod::from_pod(pod, spec) else { continue };
            if !spec.selects(&pp.labels) || pp.node.as_deref() != Some(node) {
                continue;
            }
            count += 1;
            if count > MAX_NODE_PODS {
                dropped_pods += 1;
                continue;
            }
            engines.extend(engines_of(pod, &pp));
        }
    }
    engines.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
    NodeView { source, node: node.into(), pool: pool.cloned(), engines, synced, dropped_pods, generation: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerPort, EnvVar, EnvVarSource, ObjectFieldSelector, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn argv(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| (*x).to_string()).collect()
    }

    #[test]
    fn parses_vllm_serve_command_lines() {
        let a = VllmArgs::parse(&argv(&[
            "vllm", "serve", "Qwen/Qwen2.5-7B", "--port=8001", "--served-model-name", "qwen", "qwen-alias", "--block-size", "16",
            "--kv-events-config", r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}"#,
            "--max_num_seqs=128",
        ]))
        .unwrap();
        assert_eq!(a.model.as_deref(), Some("Qwen/Qwen2.5-7B"));
        assert_eq!(a.port, Some(8001));
        assert_eq!(a.served_model_names, ["qwen", "qwen-alias"]);
        assert_eq!((a.block_size, a.max_num_seqs), (Some(16), Some(128)));
        let kv = a.kv_events().unwrap();
        assert_eq!(
            (kv.endpoint.as_str(), kv.replay_endpoint.as_deref(), kv.topic.as_str()),
            ("tcp://*:5557", Some("tcp://*:5558"), "kv")
        );
    }

    #[test]
    fn kv_events_defaults_and_off_switches_follow_vllm() {
        let on = |json: &str| {
            VllmArgs::parse(&argv(&["vllm", "serve", "m", "--kv-events-config", json])).unwrap().kv_events()
        };
        let d = on(r#"{"enable_kv_cache_events": true}"#).unwrap();
        assert_eq!((d.endpoint.as_str(), d.replay_endpoint, d.topic.as_str()), ("tcp://*:5557", None, ""));
        assert!(on(r#"{"endpoint": "tcp://*:5557"}"#).is_none(), "enable_kv_cache_events defaults to false");
        assert!(on(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#).is_none());
        assert!(on(r#"{"enable-kv-cache-events": true}"#).is_some(), "dashed keys read too");
        let dotted = VllmArgs::parse(&argv(&[
            "vllm",
            "serve",
            "m",
            "--kv-events-config.enable_kv_cache_events",
            "true",
            "--kv-events-config.replay_endpoint=tcp://*:6000",
        ]))
        .unwrap();
        assert_eq!(dotted.kv_events().unwrap().replay_endpoint.as_deref(), Some("tcp://*:6000"));
        assert!(VllmArgs::parse(&argv(&["vllm", "--kv-events-config", "[1]"])).is_err());
        assert!(VllmArgs::parse(&argv(&["vllm", "--port", "eighty"])).is_err());
    }

    #[test]
    fn shell_scripts_are_split_like_a_shell() {
        let a = VllmArgs::parse(&argv(&[
            "/bin/sh", "-c",
            r#"pip list >/dev/null && exec vllm serve m --kv-events-config '{"enable_kv_cache_events":true,"endpoint":"tcp://*:7000"}'"#,
        ]))
        .unwrap();
        assert_eq!(a.model.as_deref(), Some("m"));
        assert_eq!(a.kv_events().unwrap().endpoint, "tcp://*:7000");
    }

    #[test]
    fn endpoints_resolve_as_vllm_binds_them() {
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(resolve_endpoint("tcp://*:5557", KvSocket::Pub, ip, 0).unwrap(), "tcp://10.1.2.3:5557");
        assert_eq!(resolve_endpoint("tcp://*:5557", KvSocket::Pub, ip, 2).unwrap(), "tcp://10.1.2.3:5559");
        assert_eq!(resolve_endpoint("tcp://[::]:5557", KvSocket::Pub, ip, 0).unwrap(), "tcp://10.1.2.3:5557");
        assert!(resolve_endpoint("tcp://0.0.0.0:5557", KvSocket::Pub, ip, 0).unwrap_err().contains("connects"));
        assert!(resolve_endpoint("tcp://10.1.2.3:5557", KvSocket::Pub, ip, 0).is_err());
        assert_eq!(resolve_endpoint("tcp://0.0.0.0:5558", KvSocket::Replay, ip, 1).unwrap(), "tcp://10.1.2.3:5559");
        assert_eq!(resolve_endpoint("tcp://10.1.2.3:5558", KvSocket::Replay, ip, 0).unwrap(), "tcp://10.1.2.3:5558");
        assert!(resolve_endpoint("tcp://127.0.0.1:5558", KvSocket::Replay, ip, 0).is_err());
        assert!(resolve_endpoint("ipc:///tmp/kv", KvSocket::Replay, ip, 0).is_err());
        assert!(resolve_endpoint("tcp://*:65535", KvSocket::Pub, ip, 1).is_err());
        let v6: IpAddr = "fd00::5".parse().unwrap();
        assert_eq!(resolve_endpoint("tcp://*:5557", KvSocket::Pub, v6, 0).unwrap(), "tcp://[fd00::5]:5557");
    }

    fn vllm_pod(args: &[&str], ports: &[i32], annotations: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("vllm-0".into()),
                namespace: Some("ns".into()),
                labels: Some([("app".to_string(), "vllm".to_string())].into()),
                annotations: Some(annotations.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("n1".into()),
                containers: vec![
                    Container { name: "sidecar".into(), image: Some("busybox".into()), ..Default::default() },
                    Container {
                        name: "vllm".into(),
                        command: Some(argv(&["vllm", "serve"])),
                        args: Some(argv(args)),
                        ports: Some(
                            ports.iter().map(|p| ContainerPort { container_port: *p, ..Default::default() }).collect(),
                        ),
                        env: Some(vec![EnvVar {
                            name: "POD_IP".into(),
                            value_from: Some(EnvVarSource {
                                field_ref: Some(ObjectFieldSelector {
                                    field_path: "status.podIP".into(),
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            status: Some(PodStatus { pod_ip: Some("10.0.0.9".into()), ..Default::default() }),
        }
    }

    fn spec(ports: &[u16]) -> PoolSpecView {
        PoolSpecView {
            selector: [("app".into(), "vllm".into())].into(),
            target_ports: ports.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn engines_per_rank_with_offset_kv_ports() {
        let kv =
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://$(POD_IP):5600"}"#;
        let pod = vllm_pod(&["m", "--kv-events-config", kv], &[8000, 8001], &[]);
        let view = build_node_view(Source::File("f".into()), "n1", Some(&spec(&[8000, 8001])), [&pod], true);
        let e: Vec<_> = view
            .engines
            .iter()
            .map(|e| (e.endpoint.as_str(), e.http.to_string(), e.kv_events.as_deref(), e.kv_replay.as_deref()))
            .collect();
        assert_eq!(
            e,
            [
                ("vllm-0-rank-0", "10.0.0.9:8000".into(), Some("tcp://10.0.0.9:5557"), Some("tcp://10.0.0.9:5600")),
                ("vllm-0-rank-1", "10.0.0.9:8001".into(), Some("tcp://10.0.0.9:5558"), Some("tcp://10.0.0.9:5601")),
            ]
        );
        assert_eq!(view.engines[0].container.as_deref(), Some("vllm"));
        assert_eq!(view.engines[0].model.as_deref(), Some("m"));
        assert!(view.engines.iter().all(|e| e.problems.is_empty()), "{:?}", view.engines);
        // Another node's view has none of them.
        assert!(
            build_node_view(Source::File("f".into()), "n2", Some(&spec(&[8000, 8001])), [&pod], true)
                .engines
                .is_empty()
        );
    }

    #[test]
    fn annotations_override_and_problems_are_reported() {
        let pod = vllm_pod(
            &["m", "--kv-events-config", r#"{"enable_kv_cache_events":true,"endpoint":"tcp://0.0.0.0:5557"}"#],
            &[8000, 8001],
            &[(KV_REPLAY_PORT_ANNOTATION, "7000,7100"), (KV_EVENTS_PORT_ANNOTATION, "6000")],
        );
        let view = build_node_view(Source::File("f".into()), "n1", Some(&spec(&[8000, 8001])), [&pod], true);
        let r1 = &view.engines[1];
        assert_eq!(r1.kv_events.as_deref(), Some("tcp://10.0.0.9:6001"), "one port = rank 0's, offset by rank");
        assert_eq!(r1.kv_replay.as_deref(), Some("tcp://10.0.0.9:7100"), "a list gives one per engine");
        assert!(
            r1.problems.iter().any(|p| p.contains("connects")),
            "the unusable config is still reported: {:?}",
            r1.problems
        );

        let off = vllm_pod(&["m"], &[8000], &[(KV_EVENTS_PORT_ANNOTATION, "none"), (KV_REPLAY_PORT_ANNOTATION, "x")]);
        let view = build_node_view(Source::File("f".into()), "n1", Some(&spec(&[8000])), [&off], true);
        assert_eq!((view.engines[0].kv_events.as_deref(), view.engines[0].kv_replay.as_deref()), (None, None));
        assert_eq!(view.engines[0].problems.len(), 1);
    }
}
