//! Watchers over the Kubernetes API (kube-rs `watcher`): the InferencePool and its pods (picker
//! side, or the pods on one node for the agent), and the model CRDs. Each runs as a tokio task
//! that publishes immutable snapshots (see [`crate::watch::Watched`]) and stops when the last
//! receiver is dropped. docs/design.md §14.
//!
//! Recovery is kube-runtime's: a dropped watch resumes from the last resourceVersion; `410 Gone`
//! (an expired resourceVersion) relists, and the relist replaces the local copy whole; other
//! errors are retried with [`crate::watch::WatchBackoff`] (slowly, every
//! [`crate::watch::SLOW_RETRY`] at most, for a resource the API answers 404 or 403 for) and
//! logged once per run of identical errors, naming the resource. The pod watch is restarted with
//! the new label selector whenever the pool's selector changes.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{StreamExt, future};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::{Api, Client};

use crate::crd::{InferenceModelRewrite, InferenceObjective, InferencePool};
use crate::engine::{NodeView, build_node_view};
use crate::error::ClusterError;
use crate::models::ModelTable;
use crate::pool::{PoolPod, PoolSpecView, PoolView, Source};
use crate::watch::{
    Cache, Publisher, SLOW_RETRY, Snapshot, WatchStats, Watched, refused, resource_name, slim, watch_stream,
};

/// The pool namespace as the GIE EPP chooses it: `--pool-namespace`, else `$NAMESPACE`, else
/// `default`.
pub fn pool_namespace(flag: Option<&str>) -> String {
    flag.filter(|s| !s.is_empty())
        .map(str::to_string)
        .or_else(|| std::env::var("NAMESPACE").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "default".into())
}

/// A client from the environment: in-cluster service account, else `$KUBECONFIG` / `~/.kube/config`.
///
/// # Errors
/// Neither is available or usable.
pub async fn client_from_env() -> Result<Client, ClusterError> {
    Client::try_default().await.map_err(|e| ClusterError::KubeConfig(e.to_string()))
}

/// An InferencePool by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    /// Namespace (the pool, its pods and the model CRDs all live here).
    pub namespace: String,
    /// Pool name.
    pub name: String,
}

impl PoolRef {
    fn source(&self) -> Source {
        Source::Kubernetes { namespace: self.namespace.clone(), name: self.name.clone() }
    }
}

/// Watches the pool `pool` and every pod it selects: the picker's candidate endpoints.
pub fn watch_pool(client: Client, pool: PoolRef) -> Watched<PoolView> {
    let source = pool.source();
    let (publisher, watched) = Publisher::new(PoolView::empty(source.clone()));
    tokio::spawn(run_pool(client, pool, None, publisher, move |spec, pods, synced| {
        let members = spec
            .map(|s| {
                pods.values()
                    .filter_map(|p| PoolPod::from_pod(p, s))
                    .filter(|p| s.selects(&p.labels))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        PoolView::build(source.clone(), spec.cloned(), members, synced)
    }));
    watched
}

/// Watches the pool's pods scheduled on `node` (field selector `spec.nodeName=<node>`): the
/// agent's engines.
pub fn watch_node(client: Client, pool: PoolRef, node: String) -> Watched<NodeView> {
    let source = pool.source();
    let (publisher, watched) = Publisher::new(NodeView::empty(source.clone(), &node));
    let n = node.clone();
    tokio::spawn(run_pool(client, pool, Some(node), publisher, move |spec, pods, synced| {
        build_node_view(source.clone(), &n, spec, pods.values(), synced)
    }));
    watched
}

type PodStream = BoxStream<'static, watcher::Result<watcher::Event<Pod>>>;

fn pod_stream(client: &Client, namespace: &str, spec: &PoolSpecView, node: Option<&str>) -> PodStream {
    let mut config = watcher::Config::default().labels(&spec.label_selector());
    if let Some(node) = node {
        config = config.fields(&format!("spec.nodeName={node}"));
    }
    watch_stream(Api::<Pod>::namespaced(client.clone(), namespace), config).boxed()
}

async fn next_pod_event(s: &mut Option<PodStream>) -> Option<watcher::Result<watcher::Event<Pod>>> {
    match s {
        Some(s) => s.next().await,
        None => future::pending().await,
    }
}

async fn run_pool<T: Snapshot>(
    client: Client,
    pool: PoolRef,
    node: Option<String>,
    publisher: Publisher<T>,
    project: impl Fn(Option<&PoolSpecView>, &BTreeMap<String, Pod>, bool) -> T + Send + 'static,
) {
    let stats: Arc<WatchStats> = publisher.stats().clone();
    let (pool_what, pod_what) =
        (resource_name::<InferencePool>(&pool.namespace), resource_name::<Pod>(&pool.namespace));
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &pool.namespace);
    let mut pool_events =
        watch_stream(pools, watcher::Config::default().fields(&format!("metadata.name={}", pool.name))).boxed();
    let mut pool_cache: Cache<InferencePool> = Cache::of(pool_what.clone());
    let mut spec: Option<PoolSpecView> = None;
    let mut pods: Cache<Pod> = Cache::of(pod_what.clone());
    let mut pod_events: Option<PodStream> = None;
    let mut was_synced = false;
    loop {
        let changed = tokio::select! {
            () = publisher.closed() => return,
            ev = pool_events.next() => match ev {
                Some(Ok(ev)) => {
                    if pool_cache.apply(ev, &stats) {
                        let next = pool_cache.live.get(&pool.name).map(|p| PoolSpecView::from_spec(&p.spec));
                        let selector_changed = next.as_ref().map(|s| &s.selector) != spec.as_ref().map(|s| &s.selector);
                        if selector_changed {
                            pods = Cache::of(pod_what.clone());
                            pod_events = next.as_ref().map(|s| pod_stream(&client, &pool.namespace, s, node.as_deref()));
                        }
                        spec = next;
                        true
                    } else {
                        false
                    }
                }
                Some(Err(e)) => {
                    stats.error(&pool_what, &e);
                    false
                }
                None => return,
            },
            ev = next_pod_event(&mut pod_events) => match ev {
                Some(Ok(ev)) => pods.apply(ev.modify(slim), &stats),
                Some(Err(e)) => {
                    stats.error(&pod_what, &e);
                    false
                }
                None => false,
            },
        };
        if changed {
            let synced = pool_cache.listed && (spec.is_none() || pods.listed);
            // After a selector change the pod watch lists again from empty: keep the last synced
            // view until that list completes rather than publish a partial one.
            if synced || !was_synced {
                publisher.publish(project(spec.as_ref(), &pods.live, synced));
                was_synced |= synced;
            }
        }
    }
}

/// Watches the pool's InferenceObjective and InferenceModelRewrite objects (`llm-d.ai/v1alpha2`,
/// in the pool's namespace). Where a CRD is not installed (the list answers 404) or may not be
/// read (403) it counts as synced and empty: one WARN says so, and the list is tried again on
/// the slow timer ([`SLOW_RETRY`]) until it succeeds.
pub fn watch_models(client: Client, pool: PoolRef) -> Watched<ModelTable> {
    let source = pool.source();
    let (publisher, watched) = Publisher::new(ModelTable::empty(source.clone()));
    tokio::spawn(async move {
        let stats = publisher.stats().clone();
        let objectives_what = resource_name::<InferenceObjective>(&pool.namespace);
        let rewrites_what = resource_name::<InferenceModelRewrite>(&pool.namespace);
        let mut objectives_events = watch_stream(
            Api::<InferenceObjective>::namespaced(client.clone(), &pool.namespace),
            watcher::Config::default(),
        )
        .boxed();
        let mut rewrites_events = watch_stream(
            Api::<InferenceModelRewrite>::namespaced(client.clone(), &pool.namespace),
            watcher::Config::default(),
        )
        .boxed();
        let mut objectives: Cache<InferenceObjective> = Cache::of(objectives_what.clone());
        let mut rewrites: Cache<InferenceModelRewrite> = Cache::of(rewrites_what.clone());
        loop {
            let changed = tokio::select! {
                () = publisher.closed() => return,
                ev = objectives_events.next() => match ev {
                    Some(Ok(ev)) => objectives.apply(ev.modify(slim), &stats),
                    Some(Err(e)) => not_installed(&e, &mut objectives, &stats, &objectives_what),
                    None => return,
                },
                ev = rewrites_events.next() => match ev {
                    Some(Ok(ev)) => rewrites.apply(ev.modify(slim), &stats),
                    Some(Err(e)) => not_installed(&e, &mut rewrites, &stats, &rewrites_what),
                    None => return,
                },
            };
            if changed {
                let rw: Vec<InferenceModelRewrite> = rewrites.live.values().cloned().collect();
                let ob: Vec<InferenceObjective> = objectives.live.values().cloned().collect();
                let synced = objectives.listed && rewrites.listed;
                publisher.publish(ModelTable::from_objects(source.clone(), &pool.name, &rw, &ob, synced));
            }
        }
    });
    watched
}

/// Records a watch error; a 404 or 403 (the CRD is not installed, or not readable) makes the
/// cache listed and empty. Returns whether the cache changed.
fn not_installed<K: kube::Resource>(e: &watcher::Error, cache: &mut Cache<K>, stats: &WatchStats, what: &str) -> bool {
    match refused(e) {
        Some(code) => {
            let why = if code == 404 { "not installed (404)" } else { "not readable by this service account (403)" };
            let note = format!("{what} is {why}: routing without it; checking again every {} s", SLOW_RETRY.as_secs());
            stats.error_noted(what, e, &note);
        }
        None => stats.error(what, e),
    }
    if refused(e).is_some() && (!cache.listed || !cache.live.is_empty()) {
        cache.live.clear();
        cache.listed = true;
        return true;
    }
    false
}
