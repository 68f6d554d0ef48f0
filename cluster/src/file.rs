//! File mode, for hosts without Kubernetes and the local demo: a static pool file (pods and
//! models, for the picker) and a static engine file (for the agent), each re-read when its
//! content changes and published as the same snapshots the Kubernetes watchers publish.
//! docs/design.md §7, §14.
//!
//! Change detection polls the file's content (every `interval`, default 500 ms; files are small)
//! and compares a hash, so in-place writes, editors' atomic renames and Kubernetes ConfigMap
//! symlink swaps are all seen. A file that fails to read or parse after a good read is reported
//! (stats and a warning) and the last good snapshot stays; the first read must succeed.
//!
//! Pool file (`deny_unknown_fields`):
//! ```yaml
//! target_ports: [8000]            # default ports of pods that list none
//! pods:
//!   - name: vllm-0                # unique
//!     ip: 127.0.0.1
//!     ports: [8000, 8001]         # one engine per port, rank = position (default target_ports)
//!     node: node-1                # optional
//!     ready: true                 # default true
//!     labels: {}                  # optional
//!     annotations: {kvroute.io/cost-per-hour: "3.67"}
//! models:                         # client model → weighted targets (InferenceModelRewrite-like)
//!   - name: chat
//!     targets: [{model: base-model, adapter: my-lora, weight: 90}, {model: base-model, weight: 10}]
//!   - name: base-model            # no targets: served as itself
//! objectives: [{name: premium, priority: 10}]
//! ```
//!
//! Engine file:
//! ```yaml
//! engines:
//!   - pod: vllm-0
//!     endpoint: 127.0.0.1:8000    # HTTP ip:port
//!     rank: 0                     # default: position among the pod's entries
//!     kv_events: tcp://127.0.0.1:5557
//!     kv_replay: tcp://127.0.0.1:5558
//!     gpus: [0, GPU-0b2d…]        # NVML indices or UUIDs
//!     model: Qwen/Qwen2.5-7B-Instruct
//!     max_num_seqs: 256
//!     block_size: 16
//!     annotations: {}
//! ```

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use kvroute_common::config::{YamlFileError, parse_yaml};

use crate::engine::{EngineSpec, GpuRef, NodeView};
use crate::error::ClusterError;
use crate::models::{MAX_TARGETS, MAX_WEIGHT, ModelRule, ModelTable, ModelTarget};
use crate::pool::{MAX_TARGET_PORTS, PoolPod, PoolSpecView, PoolView, Source, endpoint_name};
use crate::watch::{Publisher, WatchStats, Watched};

/// Largest file read.
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Default poll period.
pub const DEFAULT_POLL: Duration = Duration::from_millis(500);

/// The pool file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFile {
    /// Ports of pods that list none.
    #[serde(default)]
    pub target_ports: Vec<u16>,
    /// The pool's pods.
    #[serde(default)]
    pub pods: Vec<PoolFilePod>,
    /// Client models.
    #[serde(default)]
    pub models: Vec<PoolFileModel>,
    /// Objectives (priorities).
    #[serde(default)]
    pub objectives: Vec<PoolFileObjective>,
}

/// One pod of the pool file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFilePod {
    /// Pod name, unique in the file.
    pub name: String,
    /// Pod IP.
    pub ip: IpAddr,
    /// Engine ports, rank = position. Default: `target_ports`.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// Node name.
    #[serde(default)]
    pub node: Option<String>,
    /// Routable. Default true.
    #[serde(default = "yes")]
    pub ready: bool,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Annotations (reported to custom scorers, kv-port overrides, …).
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// One client model of the pool file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFileModel {
    /// The `model` clients send.
    pub name: String,
    /// Destinations; none = the model itself.
    #[serde(default)]
    pub targets: Vec<PoolFileTarget>,
}

/// One destination.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFileTarget {
    /// The base model id.
    pub model: String,
    /// LoRA adapter on it.
    #[serde(default)]
    pub adapter: Option<String>,
    /// Weight 1–1 000 000.
    #[serde(default)]
    pub weight: Option<u32>,
}

/// One objective.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolFileObjective {
    /// Name (the `x-llm-d-inference-objective` header value).
    pub name: String,
    /// Priority (default 0).
    #[serde(default)]
    pub priority: i32,
}

fn yes() -> bool {
    true
}

fn invalid(path: &Path, message: impl Into<String>) -> ClusterError {
    ClusterError::Invalid { path: path.display().to_string(), message: message.into() }
}

impl PoolFile {
    /// Parses and checks a pool file.
    ///
    /// # Errors
    /// YAML that does not match the schema; duplicate pod or model names; a pod without ports;
    /// port 0; more than 8 ports; weights out of range.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self, ClusterError> {
        let f: Self = parse_yaml("", path, bytes)?;
        let mut names = HashSet::new();
        for p in &f.pods {
            if p.name.is_empty() || !names.insert(p.name.as_str()) {
                return Err(invalid(path, format!("pod name {:?} is empty or listed twice", p.name)));
            }
            let ports = if p.ports.is_empty() { &f.target_ports } else { &p.ports };
            if ports.is_empty() || ports.len() > MAX_TARGET_PORTS || ports.contains(&0) {
                return Err(invalid(path, format!("pod {:?} needs 1-{MAX_TARGET_PORTS} non-zero ports", p.name)));
            }
            if ports.iter().collect::<HashSet<_>>().len() != ports.len() {
                return Err(invalid(path, format!("pod {:?} lists a port twice", p.name)));
            }
        }
        let mut models = HashSet::new();
        for m in &f.models {
            if m.name.is_empty() || !models.insert(m.name.as_str()) {
                return Err(invalid(path, format!("model name {:?} is empty or listed twice", m.name)));
            }
            if m.targets.len() > MAX_TARGETS {
                return Err(invalid(path, format!("model {:?} has more than {MAX_TARGETS} targets", m.name)));
            }
            if m.targets.iter().any(|t| t.model.is_empty() || t.weight.is_some_and(|w| w == 0 || w > MAX_WEIGHT)) {
                return Err(invalid(
                    path,
                    format!("model {:?}: targets need a model and weights 1-{MAX_WEIGHT}", m.name),
                ));
            }
        }
        Ok(f)
    }

    /// The pool view this file describes.
    pub fn pool_view(&self, path: &Path) -> PoolView {
        let spec =
            PoolSpecView { target_ports: self.target_ports.clone(), app_protocol: "http".into(), ..Default::default() };
        let pods = self.pods.iter().map(|p| {
            let ports = if p.ports.is_empty() { &self.target_ports } else { &p.ports };
            PoolPod {
                name: p.name.clone(),
                namespace: String::new(),
                uid: None,
                node: p.node.clone(),
                ip: Some(p.ip),
                ready: p.ready,
                terminating: false,
                ports: ports.iter().enumerate().map(|(i, port)| (i as u32, *port)).collect(),
                labels: Arc::new(p.labels.clone()),
                annotations: Arc::new(p.annotations.clone()),
            }
        });
        PoolView::build(Source::File(path.into()), Some(spec), pods, true)
    }

    /// The model table this file describes (one exact-match rule per model, in file order).
    pub fn model_table(&self, path: &Path) -> ModelTable {
        let rules = self
            .models
            .iter()
            .map(|m| ModelRule {
                source: "file".into(),
                matches: vec![m.name.clone()],
                targets: if m.targets.is_empty() {
                    vec![ModelTarget { model: m.name.clone(), adapter: None, weight: None }]
                } else {
                    m.targets
                        .iter()
                        .map(|t| ModelTarget { model: t.model.clone(), adapter: t.adapter.clone(), weight: t.weight })
                        .collect()
                },
            })
            .collect();
        let objectives = self.objectives.iter().map(|o| (o.name.clone(), o.priority)).collect();
        ModelTable::build(Source::File(path.into()), rules, objectives, 0, true)
    }
}

/// The engine file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineFile {
    /// The engines on this host.
    #[serde(default)]
    pub engines: Vec<EngineFileEntry>,
}

/// One engine of the engine file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineFileEntry {
    /// Pod name.
    pub pod: String,
    /// HTTP `ip:port`.
    pub endpoint: SocketAddr,
    /// Rank; default: position among the pod's entries.
    #[serde(default)]
    pub rank: Option<u32>,
    /// Base model id.
    #[serde(default)]
    pub model: Option<String>,
    /// ZeroMQ PUB endpoint.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// ZeroMQ ROUTER replay endpoint.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// Publisher topic.
    #[serde(default)]
    pub kv_topic: String,
    /// GPUs (NVML indices or UUIDs).
    #[serde(default)]
    pub gpus: Vec<GpuRef>,
    /// `--max-num-seqs`.
    #[serde(default)]
    pub max_num_seqs: Option<u32>,
    /// `--block-size`.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Ready (default true).
    #[serde(default = "yes")]
    pub ready: bool,
    /// Pod annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

impl EngineFile {
    /// Parses and checks an engine file.
    ///
    /// # Errors
    /// YAML that does not match the schema; two entries with the same pod and rank; a KV
    /// endpoint that is not `tcp://host:port`.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self, ClusterError> {
        let f: Self = parse_yaml("", path, bytes)?;
        let mut seen = HashSet::new();
        for (pod, rank) in Self::ranks(&f.engines) {
            if !seen.insert((pod, rank)) {
                return Err(invalid(path, format!("engine {} is listed twice", endpoint_name(pod, rank))));
            }
        }
        for e in &f.engines {
            for ep in [&e.kv_events, &e.kv_replay].into_iter().flatten() {
                let ok = ep
                    .strip_prefix("tcp://")
                    .and_then(|hp| hp.rsplit_once(':'))
                    .is_some_and(|(_, p)| p.parse::<u16>().is_ok());
                if !ok {
                    return Err(invalid(path, format!("pod {:?}: {ep:?} is not tcp://host:port", e.pod)));
                }
            }
        }
        Ok(f)
    }

    fn ranks(engines: &[EngineFileEntry]) -> Vec<(&str, u32)> {
        let mut next: BTreeMap<&str, u32> = BTreeMap::new();
        engines
            .iter()
            .map(|e| {
                let n = next.entry(e.pod.as_str()).or_default();
                let rank = e.rank.unwrap_or(*n);
                *n += 1;
                (e.pod.as_str(), rank)
            })
            .collect()
    }

    /// The node view this file describes.
    pub fn node_view(&self, path: &Path, node: &str) -> NodeView {
        let mut engines: Vec<EngineSpec> = Self::ranks(&self.engines)
            .into_iter()
            .zip(&self.engines)
            .map(|((pod, rank), e)| EngineSpec {
                endpoint: endpoint_name(pod, rank),
                pod: pod.into(),
                namespace: String::new(),
                uid: None,
                rank,
                http: e.endpoint,
                ready: e.ready,
                container: None,
                kv_events: e.kv_events.clone(),
                kv_replay: e.kv_replay.clone(),
                kv_topic: e.kv_topic.clone(),
                model: e.model.clone(),
                served_model_names: Vec::new(),
                block_size: e.block_size,
                max_num_seqs: e.max_num_seqs,
                gpus: e.gpus.clone(),
                labels: Arc::default(),
                annotations: Arc::new(e.annotations.clone()),
                problems: Vec::new(),
            })
            .collect();
        engines.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        NodeView {
            source: Source::File(path.into()),
            node: node.into(),
            pool: None,
            engines,
            synced: true,
            dropped_pods: 0,
            generation: 0,
        }
    }
}

/// Reads a file of at most [`MAX_FILE_BYTES`] on the blocking pool, as `tokio::fs` does.
async fn read_bounded(path: &Path) -> Result<Vec<u8>, ClusterError> {
    let p = path.to_path_buf();
    let joined =
        tokio::task::spawn_blocking(move || kvroute_common::config::read_bounded("", &p, MAX_FILE_BYTES)).await;
    match joined {
        Ok(read) => Ok(read?),
        Err(e) => Err(YamlFileError::Read { what: "", path: path.into(), source: std::io::Error::other(e) }.into()),
    }
}

/// Polls `path`; calls `apply` with each new content; stops when `closed` resolves.
async fn poll_file<F, C>(
    path: PathBuf,
    interval: Duration,
    first_hash: u64,
    stats: Arc<WatchStats>,
    closed: C,
    mut apply: F,
) where
    F: FnMut(&[u8]) -> Result<(), ClusterError> + Send,
    C: std::future::Future<Output = ()> + Send,
{
    let mut last = first_hash;
    let mut failing = false;
    tokio::pin!(closed);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut closed => return,
            _ = tick.tick() => {}
        }
        let result = match read_bounded(&path).await {
            Ok(bytes) => {
                let h = xxhash_rust::xxh3::xxh3_64(&bytes);
                if h == last && !failing {
                    continue;
                }
                last = h;
                apply(&bytes)
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => {
                failing = false;
                stats.events.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                stats.lists.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => {
                // Report a failure once per distinct content, not every poll.
                if !failing {
                    stats.error(&path.display().to_string(), &e);
                }
                failing = true;
            }
        }
    }
}

/// Watches a pool file: the pool view and the model table it describes. The first read must
/// succeed; later bad contents keep the last good snapshots.
///
/// # Errors
/// The first read or parse failed.
pub async fn watch_pool_file(
    path: &Path,
    interval: Duration,
) -> Result<(Watched<PoolView>, Watched<ModelTable>), ClusterError> {
    let bytes = read_bounded(path).await?;
    let file = PoolFile::parse(path, &bytes)?;
    let (pool_pub, pool_rx) = Publisher::new(PoolView::empty(Source::File(path.into())));
    let (model_pub, model_rx) = Publisher::new(ModelTable::empty(Source::File(path.into())));
    pool_pub.publish(file.pool_view(path));
    model_pub.publish(file.model_table(path));
    pool_pub.stats().lists.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stats = pool_pub.stats().clone();
    let p = path.to_path_buf();
    tokio::spawn(async move {
        let closed = async {
            pool_pub.closed().await;
            model_pub.closed().await;
        };
        let apply = |bytes: &[u8]| {
            let f = PoolFile::parse(&p, bytes)?;
            pool_pub.publish(f.pool_view(&p));
            model_pub.publish(f.model_table(&p));
            Ok(())
        };
        poll_file(p.clone(), interval, xxhash_rust::xxh3::xxh3_64(&bytes), stats, closed, apply).await;
    });
    Ok((pool_rx, model_rx))
}

/// Watches an engine file for `node`. The first read must succeed; later bad contents keep the
/// last good snapshot.
///
/// # Errors
/// The first read or parse failed.
pub async fn watch_engine_file(path: &Path, node: &str, interval: Duration) -> Result<Watched<NodeView>, ClusterError> {
    let bytes = read_bounded(path).await?;
    let file = EngineFile::parse(path, &bytes)?;
    let (publisher, watched) = Publisher::new(NodeView::empty(Source::File(path.into()), node));
    publisher.publish(file.node_view(path, node));
    publisher.stats().lists.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stats = publisher.stats().clone();
    let (p, node) = (path.to_path_buf(), node.to_string());
    tokio::spawn(async move {
        let apply = |bytes: &[u8]| {
            let f = EngineFile::parse(&p, bytes)?;
            publisher.publish(f.node_view(&p, &node));
            Ok(())
        };
        poll_file(p.clone(), interval, xxhash_rust::xxh3::xxh3_64(&bytes), stats, publisher.closed(), apply).await;
    });
    Ok(watched)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_file_gives_views_and_rejects_mistakes() {
        let p = Path::new("pool.yaml");
        let f = PoolFile::parse(
            p,
            br#"
target_ports: [8000]
pods:
  - {name: a, ip: 127.0.0.1, ports: [8100, 8101], node: n1, annotations: {kvroute.io/cost-per-hour: "3"}}
  - {name: b, ip: 127.0.0.2, ready: false}
models:
  - name: chat
    targets: [{model: base, adapter: lora, weight: 3}, {model: base, weight: 1}]
  - name: base
objectives: [{name: premium, priority: 7}]
"#,
        )
        .unwrap();
        let v = f.pool_view(p);
        let eps: Vec<_> = v.endpoints.iter().map(|e| (e.name.as_str(), e.addr.to_string(), e.ready)).collect();
        assert_eq!(
            eps,
            [
                ("a-rank-0", "127.0.0.1:8100".into(), true),
                ("a-rank-1", "127.0.0.1:8101".into(), true),
                ("b-rank-0", "127.0.0.2:8000".into(), false)
            ]
        );
        assert!(v.synced);
        let t = f.model_table(p);
        assert_eq!(t.rule_for("chat").unwrap().pick(0).unwrap().adapter.as_deref(), Some("lora"));
        assert_eq!(t.rule_for("base").unwrap().targets[0].model, "base");
        assert!(t.rule_for("other").is_none(), "a file has no catch-all");
        assert_eq!(t.priority(Some("premium")), 7);

        for bad in [
            "pods: [{name: a, ip: 127.0.0.1}]", // no ports anywhere
            "pods: [{name: a, ip: 127.0.0.1, ports: [1]}, {name: a, ip: 127.0.0.2, ports: [1]}]",
            "pods: [{name: a, ip: not-an-ip, ports: [1]}]",
            "pods: [{name: a, ip: 127.0.0.1, ports: [1, 1]}]",
            "pods: [{name: a, ip: 127.0.0.1, ports: [1], typo: 1}]",
            "models: [{name: m, targets: [{model: x, weight: 0}]}]",
        ] {
            assert!(PoolFile::parse(p, bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn engine_file_gives_ranks_and_rejects_mistakes() {
        let p = Path::new("engines.yaml");
        let f = EngineFile::parse(
            p,
            br#"
engines:
  - {pod: a, endpoint: "127.0.0.1:8000", kv_events: "tcp://127.0.0.1:5557", gpus: [0, GPU-abc]}
  - {pod: a, endpoint: "127.0.0.1:8001"}
  - {pod: b, endpoint: "127.0.0.1:8002", rank: 3}
"#,
        )
        .unwrap();
        let v = f.node_view(p, "n1");
        let names: Vec<_> = v.engines.iter().map(|e| e.endpoint.as_str()).collect();
        assert_eq!(names, ["a-rank-0", "a-rank-1", "b-rank-3"]);
        assert_eq!(v.engines[0].gpus, [GpuRef::Index(0), GpuRef::Uuid("GPU-abc".into())]);
        assert!(
            EngineFile::parse(
                p,
                b"engines: [{pod: a, endpoint: '127.0.0.1:1'}, {pod: a, endpoint: '127.0.0.1:2', rank: 0}]"
            )
            .is_err()
        );
        assert!(EngineFile::parse(p, b"engines: [{pod: a, endpoint: '127.0.0.1:1', kv_events: 'ipc:///x'}]").is_err());
    }
}
