//! The agent's engine set (docs/design.md §14): which engines the agent serves follows the node
//! view of its engine source (the InferencePool's pods on this node, the static engine file, or
//! the config's static list), without restarting anything else.
//!
//! An engine that appears gets a pod in the [`Hub`] (the picker streams send a `Hello` and its
//! snapshot), a KV-event subscription on the one reader thread, and its scrape task. One that
//! goes away has its subscription closed, its scrape task stopped and its pod removed from the
//! hub with a farewell delta (blocks cleared, not ready), so the pickers see it go; its metric
//! series are dropped once its task ended. An engine whose address, KV endpoints, model or pod
//! (UID) changed is restarted the same way; a change of its annotations is only re-reported.
//! No engine at all is a normal state: the agent idles, healthy.
//!
//! GPUs (docs/design.md §14): from a static source, the indices or UUIDs it names; from
//! Kubernetes, the kubelet's PodResources `List` (the `nvidia.com/gpu` device ids, GPU UUIDs),
//! polled every `pod_resources_poll_ms` and at once when a pod appears without GPUs. Each
//! engine's scrape task reads its [`GpuBinding`] from a watch channel; a pod whose GPUs are not
//! known says so in its health reason.
//!
//! Concurrency: one task owns the set (a `BTreeMap` of running engines); it talks to the scrape
//! tasks through watch channels, to the reader thread through its [`ReaderHandle`], and to the
//! streams through the hub. On agent shutdown it stops every engine without farewells: the
//! streams end and the pickers hold the pods for their grace period (an agent restart).

use crate::config::{AgentConfig, DEFAULT_MAX_NUM_SEQS, EngineConfig};
use crate::engine::subscriber::{ReaderHandle, SubscriberConfig};
use crate::gpu::GpuRef;
use crate::node::NodeSources;
use crate::report::hub::Hub;
use crate::report::sink::PodSink;
use crate::scrape_loop::{GpuBinding, scrape_task};
use crate::telemetry::AgentMetrics;
use kvroute_cluster::podresources::PodGpu;
use kvroute_cluster::{EngineSpec, NodeGpus, NodeView, PodResourcesClient, Source};
use kvroute_proto::agent::v1::PodInfo;
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long a stopped engine's scrape task may take to end before it is aborted.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Where engines' GPUs come from.
pub(crate) enum GpuAssignment {
    /// The engine source names them (`EngineSpec::gpus`).
    FromSource,
    /// The kubelet's PodResources API.
    PodResources {
        /// Client on the kubelet socket.
        client: PodResourcesClient,
        /// Poll period.
        poll: Duration,
    },
}

/// What the engine set needs from the agent.
pub(crate) struct EngineSetDeps {
    pub(crate) hub: Arc<Hub>,
    pub(crate) config: AgentConfig,
    pub(crate) node: Arc<NodeSources>,
    pub(crate) metrics: Arc<AgentMetrics>,
    pub(crate) reader: ReaderHandle<PodSink>,
    /// The sinks' liveness (the reader thread ends when the agent's strong copy is gone).
    pub(crate) alive: Weak<()>,
}

/// What forces a restart of a running engine when it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RestartKey {
    http: std::net::SocketAddr,
    kv_events: Option<String>,
    kv_replay: Option<String>,
    uid: Option<String>,
    model: Option<String>,
    block_size: Option<u32>,
    max_num_seqs: Option<u32>,
    container: Option<String>,
}

impl RestartKey {
    fn of(spec: &EngineSpec) -> Self {
        Self {
            http: spec.http,
            kv_events: spec.kv_events.clone(),
            kv_replay: spec.kv_replay.clone(),
            uid: spec.uid.clone(),
            model: hash_root_model(spec),
            block_size: spec.block_size,
            max_num_seqs: spec.max_num_seqs,
            container: spec.container.clone(),
        }
    }
}

/// The model whose name roots the engine's block hashes: the first `--served-model-name` (what
/// clients and the picker call it), else `--model`; `None` = ask `/v1/models`.
fn hash_root_model(spec: &EngineSpec) -> Option<String> {
    spec.served_model_names.first().cloned().or_else(|| spec.model.clone())
}

struct RunningEngine {
    key: RestartKey,
    annotations: Arc<BTreeMap<String, String>>,
    stop: watch::Sender<bool>,
    gpus: watch::Sender<Arc<GpuBinding>>,
    task: JoinHandle<()>,
}

/// The set of running engines and what keeps it in line with the node view.
struct EngineSet {
    deps: EngineSetDeps,
    running: BTreeMap<String, RunningEngine>,
    /// GPUs come from PodResources (else from the engine source).
    pod_resources: bool,
    node_gpus: Option<Arc<NodeGpus>>,
    gpu_error: Option<String>,
}

/// Starts the engine set on `view`'s current engines (they are in the hub when this returns)
/// and returns the task that keeps following `view` (and, for Kubernetes, the kubelet's GPU
/// assignment) until `stop` turns true.
pub(crate) async fn start_engine_set(
    mut view: watch::Receiver<Arc<NodeView>>,
    mut assignment: GpuAssignment,
    deps: EngineSetDeps,
    mut stop: watch::Receiver<bool>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let pod_resources = matches!(assignment, GpuAssignment::PodResources { .. });
    let mut set = EngineSet { deps, running: BTreeMap::new(), pod_resources, node_gpus: None, gpu_error: None };
    set.step(&mut view, &mut assignment, true, false).await;
    async move {
        let poll = match &assignment {
            GpuAssignment::PodResources { poll, .. } => *poll,
            // Never fires in practice: no GPU assignment to poll.
            GpuAssignment::FromSource => Duration::from_secs(3600),
        };
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + poll, poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut view_open = true;
        loop {
            let (mut view_changed, mut poll_due) = (false, false);
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                changed = view.changed(), if view_open => {
                    view_changed = true;
                    if changed.is_err() {
                        // The source ended (it only does when its task is gone): keep what runs.
                        tracing::warn!("engine source stopped publishing; keeping the current engines");
                        view_open = false;
                    }
                }
                _ = tick.tick() => poll_due = true,
            }
            set.step(&mut view, &mut assignment, view_changed, poll_due).await;
        }
        set.stop_all().await;
    }
}

impl EngineSet {
    /// Lists GPUs when due (a poll, or a new pod without GPUs), then reconciles with the view.
    async fn step(
        &mut self,
        view: &mut watch::Receiver<Arc<NodeView>>,
        assignment: &mut GpuAssignment,
        view_changed: bool,
        poll_due: bool,
    ) {
        let current = view.borrow_and_update().clone();
        if let GpuAssignment::PodResources { client, .. } = assignment
            && (poll_due || (view_changed && self.needs_gpu_list(&current)))
        {
            self.list_gpus(client).await;
        }
        self.reconcile(&current);
    }

    /// Whether a pod of `view` has no GPUs in the last PodResources answer (a new pod): list
    /// now rather than report it unknown until the next poll.
    fn needs_gpu_list(&self, view: &NodeView) -> bool {
        let Some(gpus) = &self.node_gpus else { return true };
        view.engines.iter().any(|e| !self.running.contains_key(&e.endpoint) && pod_gpus(gpus, e).is_empty())
    }

    async fn list_gpus(&mut self, client: &mut PodResourcesClient) {
        match client.list().await {
            Ok(g) => {
                self.node_gpus = Some(Arc::new(g));
                self.gpu_error = None;
            }
            Err(e) => {
                if self.gpu_error.is_none() {
                    tracing::warn!(error = %e, "kubelet PodResources List failed; keeping the last answer");
                }
                self.gpu_error = Some(e.to_string());
            }
        }
    }

    /// The GPUs of `spec` now.
    fn binding(&self, spec: &EngineSpec) -> GpuBinding {
        if !self.pod_resources {
            return GpuBinding { gpus: spec.gpus.clone(), unknown: None };
        }
        let Some(node) = &self.node_gpus else {
            let why = self.gpu_error.clone().unwrap_or_else(|| "not listed yet".into());
            return GpuBinding { gpus: Vec::new(), unknown: Some(format!("kubelet PodResources: {why}")) };
        };
        let gpus: Vec<GpuRef> = pod_gpus(node, spec).into_iter().map(gpu_ref).collect();
        if gpus.is_empty() {
            return GpuBinding {
                gpus,
                unknown: Some("the kubelet's PodResources lists no nvidia.com/gpu for this pod".into()),
            };
        }
        GpuBinding { gpus, unknown: None }
    }

    /// Starts, stops, restarts and updates engines so the running set is `view`'s.
    fn reconcile(&mut self, view: &NodeView) {
        let desired: BTreeMap<&str, &EngineSpec> = view.engines.iter().map(|e| (e.endpoint.as_str(), e)).collect();
        let gone: Vec<String> =
            self.running.keys().filter(|name| !desired.contains_key(name.as_str())).cloned().collect();
        let reason = match &view.source {
            Source::Kubernetes { .. } => "pod left this node's pool view",
            Source::File(_) => "engine removed from the engine file",
        };
        for name in gone {
            self.stop_engine(&name, Some(reason), "removed");
        }
        for (name, spec) in desired {
            let binding = self.binding(spec);
            let key = RestartKey::of(spec);
            match self.running.get(name) {
                None => self.start_engine(spec, key, binding),
                Some(r) if r.key != key => {
                    tracing::info!(
                        engine = name,
                        "engine changed (pod re-created, re-addressed or re-configured): restarting it"
                    );
                    self.stop_engine(name, Some("engine restarted: pod re-created or re-addressed"), "restarted");
                    self.start_engine(spec, key, binding);
                }
                Some(r) => {
                    if r.annotations != spec.annotations {
                        self.deps.hub.set_annotations(name, to_hash_map(&spec.annotations));
                    }
                    if **r.gpus.borrow() != binding {
                        tracing::info!(engine = name, gpus = ?binding.gpus, unknown = ?binding.unknown, "engine GPUs changed");
                        r.gpus.send_replace(Arc::new(binding));
                    }
                    if let Some(r) = self.running.get_mut(name) {
                        r.annotations = spec.annotations.clone();
                    }
                }
            }
        }
        self.deps.metrics.engines.set(self.running.len() as i64);
    }

    fn start_engine(&mut self, spec: &EngineSpec, key: RestartKey, binding: GpuBinding) {
        let d = &self.deps;
        let name = spec.endpoint.clone();
        let model = key.model.clone();
        let block_size = spec.block_size.unwrap_or(kvroute_common::DEFAULT_BLOCK_SIZE as u32);
        let pod = d.hub.add(PodInfo {
            pod: name.clone(),
            endpoint: spec.http.to_string(),
            model: model.clone().unwrap_or_default(),
            block_size,
            annotations: to_hash_map(&spec.annotations),
            index_block_size: d.config.index_block_size,
        });
        // Bounded per-engine state (docs/decisions/0024-bounded-outside-input.md): blocks past
        // the cap are dropped and counted.
        pod.set_block_capacity(d.config.max_blocks_per_engine);
        if let Some(kv_events) = &spec.kv_events {
            let cfg = SubscriberConfig {
                pod: name.clone(),
                kv_events: kv_events.clone(),
                kv_replay: spec.kv_replay.clone(),
                replay_timeout: Duration::from_millis(d.config.kv_replay_timeout_ms),
            };
            if !d.reader.add(cfg, PodSink::new(pod.clone(), d.alive.clone(), &d.metrics)) {
                tracing::error!(engine = %name, "KV-event reader thread is gone: no block reports for this engine");
            }
        }
        for problem in &spec.problems {
            tracing::warn!(engine = %name, %problem, "engine discovered with a problem");
        }
        // The scrape loop's view of the engine; `pod` carries the engine's name (the hub's key).
        let engine = EngineConfig {
            pod: name.clone(),
            rank: spec.rank,
            endpoint: spec.http.to_string(),
            model,
            kv_events: spec.kv_events.clone(),
            kv_replay: spec.kv_replay.clone(),
            gpus: binding.gpus.clone(),
            max_num_seqs: spec.max_num_seqs.filter(|n| *n > 0).unwrap_or(DEFAULT_MAX_NUM_SEQS),
            block_size,
            annotations: (*spec.annotations).clone(),
        };
        let (stop, stop_rx) = watch::channel(false);
        let (gpus, gpus_rx) = watch::channel(Arc::new(binding));
        let task = tokio::spawn(scrape_task(
            engine,
            d.config.clone(),
            pod,
            gpus_rx,
            d.node.clone(),
            d.metrics.clone(),
            stop_rx,
        ));
        tracing::info!(engine = %name, http = %spec.http, kv_events = spec.kv_events.as_deref().unwrap_or(""), "engine started");
        d.metrics.engine_changes.get_or_create(&vec![("change".into(), "added".into())]).inc();
        let annotations = spec.annotations.clone();
        self.running.insert(name, RunningEngine { key, annotations, stop, gpus, task });
    }

    /// Stops an engine; with `farewell`, removes its pod from the hub with that reason.
    fn stop_engine(&mut self, name: &str, farewell: Option<&str>, change: &str) {
        let Some(r) = self.running.remove(name) else { return };
        let d = &self.deps;
        d.reader.remove(name);
        let _ = r.stop.send(true);
        if let Some(reason) = farewell {
            d.hub.remove(name, reason);
        }
        tracing::info!(engine = name, reason = farewell.unwrap_or("agent stopping"), "engine stopped");
        if change != "shutdown" {
            d.metrics.engine_changes.get_or_create(&vec![("change".into(), change.into())]).inc();
        }
        // Its metric series go once its task can no longer write them.
        let (metrics, name, task) = (d.metrics.clone(), name.to_string(), r.task);
        tokio::spawn(async move {
            let abort = task.abort_handle();
            if tokio::time::timeout(STOP_GRACE, task).await.is_err() {
                abort.abort();
            }
            metrics.forget_pod(&name);
        });
    }

    /// Agent shutdown: every engine stops, no farewell (the pickers keep the pods for their
    /// grace period while this agent restarts).
    async fn stop_all(&mut self) {
        let names: Vec<String> = self.running.keys().cloned().collect();
        let mut tasks = Vec::new();
        for name in names {
            if let Some(r) = self.running.remove(&name) {
                let _ = r.stop.send(true);
                tasks.push(r.task);
            }
        }
        for t in tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout(STOP_GRACE, t).await.is_err() {
                abort.abort();
            }
        }
    }
}

/// The pod's GPUs in a PodResources answer: those of the engine's container, else (the
/// container unknown or holding none) every container's.
fn pod_gpus<'a>(node: &'a NodeGpus, spec: &EngineSpec) -> Vec<&'a PodGpu> {
    let of_container = node.of_pod(&spec.namespace, &spec.pod, spec.container.as_deref());
    if of_container.is_empty() { node.of_pod(&spec.namespace, &spec.pod, None) } else { of_container }
}

/// A device id as NVML names it: the UUID, else the index (device plugin
/// `--device-id-strategy=index`), else the id as given (matched as a UUID).
fn gpu_ref(g: &PodGpu) -> GpuRef {
    match (&g.uuid, g.index) {
        (Some(u), _) => GpuRef::Uuid(u.clone()),
        (None, Some(i)) => GpuRef::Index(i),
        (None, None) => GpuRef::Uuid(g.device_id.clone()),
    }
}

fn to_hash_map(m: &BTreeMap<String, String>) -> std::collections::HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}
