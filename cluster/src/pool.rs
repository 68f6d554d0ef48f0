//! The picker's view of its InferencePool: the pool's spec and, per selected pod and target
//! port, one endpoint, with the address taken from the Pod object (or the pool file), never from
//! an agent's report. docs/design.md §14.
//!
//! Naming and membership follow the GIE / llm-d Endpoint Picker (`pkg/epp/datastore`):
//! - endpoint name `<pod>-rank-<i>` where `i` is the index of the port in `spec.targetPorts`;
//! - address `status.podIP:port`;
//! - ready = no `metadata.deletionTimestamp` and condition `Ready` is `True`;
//! - the pod annotation `llm-d.ai/active-ports` (legacy `inference.networking.k8s.io/active-ports`),
//!   a comma-separated list of port numbers, limits the pod to those target ports.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;

use crate::crd::InferencePoolSpec;

/// The annotation that limits a pod to some target ports (llm-d router).
pub const ACTIVE_PORTS_ANNOTATION: &str = "llm-d.ai/active-ports";
/// Its deprecated GIE spelling, still honoured by the llm-d router.
pub const LEGACY_ACTIVE_PORTS_ANNOTATION: &str = "inference.networking.k8s.io/active-ports";
/// Most target ports a pool may have (the CRD's `maxItems`).
pub const MAX_TARGET_PORTS: usize = 8;
/// Most pods one view holds; further pods are left out and counted in `PoolView::dropped_pods`.
pub const MAX_POOL_PODS: usize = 16_384;

/// Where a view comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The InferencePool `namespace/name` through the Kubernetes API.
    Kubernetes {
        /// Pool namespace.
        namespace: String,
        /// Pool name.
        name: String,
    },
    /// A static file, re-read when it changes.
    File(std::path::PathBuf),
}

/// What kvroute uses of the InferencePool spec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolSpecView {
    /// Labels a pod must carry.
    pub selector: BTreeMap<String, String>,
    /// Target ports in spec order (index = rank). Invalid numbers (outside 1–65535) are dropped.
    pub target_ports: Vec<u16>,
    /// `http` or `kubernetes.io/h2c`.
    pub app_protocol: String,
    /// `endpointPickerRef.name`, if set.
    pub endpoint_picker: Option<String>,
}

impl PoolSpecView {
    /// From an InferencePool spec (at most [`MAX_TARGET_PORTS`] ports, first occurrence kept).
    pub fn from_spec(spec: &InferencePoolSpec) -> Self {
        let mut target_ports: Vec<u16> = Vec::new();
        for p in &spec.target_ports {
            if let Ok(n) = u16::try_from(p.number)
                && n != 0
                && !target_ports.contains(&n)
                && target_ports.len() < MAX_TARGET_PORTS
            {
                target_ports.push(n);
            }
        }
        Self {
            selector: spec.selector.match_labels.clone(),
            target_ports,
            app_protocol: spec.app_protocol.clone().unwrap_or_else(|| "http".into()),
            endpoint_picker: spec.endpoint_picker_ref.as_ref().map(|r| r.name.clone()),
        }
    }

    /// The `labelSelector` query value of the pool's pods (`k=v,k2=v2`, empty = all).
    pub fn label_selector(&self) -> String {
        self.selector.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }

    /// Whether `labels` carry every selector label.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// One pod of the pool, in any state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPod {
    /// Pod name (unique in the namespace).
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// `metadata.uid` (tells a re-created pod of the same name apart).
    pub uid: Option<String>,
    /// `spec.nodeName` (absent until scheduled).
    pub node: Option<String>,
    /// `status.podIP` (absent until the sandbox is up).
    pub ip: Option<IpAddr>,
    /// Ready (see the module doc).
    pub ready: bool,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
    /// The target ports this pod serves, after the active-ports annotation, with their rank.
    pub ports: Vec<(u32, u16)>,
    /// Labels.
    pub labels: Arc<BTreeMap<String, String>>,
    /// Annotations.
    pub annotations: Arc<BTreeMap<String, String>>,
}

impl PoolPod {
    /// The pod's facts as the pool sees them; `None` for a pod without a name.
    pub fn from_pod(pod: &Pod, spec: &PoolSpecView) -> Option<Self> {
        let name = pod.metadata.name.clone()?;
        let annotations: BTreeMap<String, String> = pod.metadata.annotations.clone().unwrap_or_default();
        let ports = active_ports(&annotations, &spec.target_ports);
        Some(Self {
            name,
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone(),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()).filter(|n| !n.is_empty()),
            ip: pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()).and_then(|ip| ip.parse().ok()),
            ready: is_ready(pod),
            terminating: pod.metadata.deletion_timestamp.is_some(),
            ports,
            labels: Arc::new(pod.metadata.labels.clone().unwrap_or_default()),
            annotations: Arc::new(annotations),
        })
    }
}

/// The GIE EPP's readiness test: not being deleted, and condition `Ready` is `True`.
pub fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .is_some_and(|c| c.status == "True")
}

/// `(rank, port)` for each target port the pod serves: all of them, or those listed in the
/// active-ports annotation (unknown or malformed entries ignored, as upstream).
pub fn active_ports(annotations: &BTreeMap<String, String>, target_ports: &[u16]) -> Vec<(u32, u16)> {
    let listed = annotations.get(ACTIVE_PORTS_ANNOTATION).or_else(|| annotations.get(LEGACY_ACTIVE_PORTS_ANNOTATION));
    let allowed: Option<Vec<u16>> = listed.map(|v| v.split(',').filter_map(|p| p.trim().parse::<u16>().ok()).collect());
    target_ports
        .iter()
        .enumerate()
        .filter(|(_, p)| allowed.as_ref().is_none_or(|a| a.contains(p)))
        .map(|(i, p)| (i as u32, *p))
        .collect()
}

/// The endpoint name the GIE / llm-d EPP gives pod × port `rank`.
pub fn endpoint_name(pod: &str, rank: u32) -> String {
    format!("{pod}-rank-{rank}")
}

/// One routable endpoint: pod × target port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolEndpoint {
    /// `<pod>-rank-<rank>`.
    pub name: String,
    /// Pod name.
    pub pod: String,
    /// Namespace.
    pub namespace: String,
    /// Index of the port in `spec.targetPorts`.
    pub rank: u32,
    /// `podIP:port`: what the gateway dials.
    pub addr: SocketAddr,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// A candidate for routing (pod Ready and not terminating).
    pub ready: bool,
    /// Pod labels.
    pub labels: Arc<BTreeMap<String, String>>,
    /// Pod annotations.
    pub annotations: Arc<BTreeMap<String, String>>,
}

/// An immutable snapshot of the pool, published whole on every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolView {
    /// Where it comes from.
    pub source: Source,
    /// The pool's spec; `None` while the pool does not exist (or the file has none).
    pub pool: Option<PoolSpecView>,
    /// Every selected pod by name, whatever its state (agents' reports are checked against it).
    pub pods: BTreeMap<String, PoolPod>,
    /// Pods with an IP × their active target ports, sorted by name.
    pub endpoints: Vec<PoolEndpoint>,
    /// The first complete list (or file read) has been applied; before that the view is partial.
    pub synced: bool,
    /// Pods left out because the view is full ([`MAX_POOL_PODS`]).
    pub dropped_pods: usize,
    /// Bumped on every published change (starts at 1 for the first).
    pub generation: u64,
}

crate::watch::snapshot_impl!(PoolView);

impl PoolView {
    /// An empty, unsynced view.
    pub fn empty(source: Source) -> Self {
        Self {
            source,
            pool: None,
            pods: BTreeMap::new(),
            endpoints: Vec::new(),
            synced: false,
            dropped_pods: 0,
            generation: 0,
        }
    }

    /// Builds the view from the pool spec and its pods (any order; pods without a name skipped).
    pub fn build(
        source: Source,
        pool: Option<PoolSpecView>,
        pods: impl IntoIterator<Item = PoolPod>,
        synced: bool,
    ) -> Self {
        let mut by_name = BTreeMap::new();
        let mut dropped_pods = 0;
        for p in pods {
            if by_name.len() >= MAX_POOL_PODS && !by_name.contains_key(&p.name) {
                dropped_pods += 1;
                continue;
            }
            by_name.insert(p.name.clone(), p);
        }
        let mut endpoints = Vec::new();
        for p in by_name.values() {
            let Some(ip) = p.ip else { continue };
            for &(rank, port) in &p.ports {
                endpoints.push(PoolEndpoint {
                    name: endpoint_name(&p.name, rank),
                    pod: p.name.clone(),
                    namespace: p.namespace.clone(),
                    rank,
                    addr: SocketAddr::new(ip, port),
                    node: p.node.clone(),
                    ready: p.ready && !p.terminating,
                    labels: p.labels.clone(),
                    annotations: p.annotations.clone(),
                });
            }
        }
        endpoints.sort_by(|a, b| a.name.cmp(&b.name));
        Self { source, pool, pods: by_name, endpoints, synced, dropped_pods, generation: 0 }
    }

    /// The routing candidates: endpoints of Ready pods.
    pub fn candidates(&self) -> impl Iterator<Item = &PoolEndpoint> {
        self.endpoints.iter().filter(|e| e.ready)
    }

    /// The endpoint at `addr`, if any.
    pub fn endpoint_at(&self, addr: SocketAddr) -> Option<&PoolEndpoint> {
        self.endpoints.iter().find(|e| e.addr == addr)
    }

    /// The endpoint named `name` (`<pod>-rank-<i>`), if any.
    pub fn endpoint(&self, name: &str) -> Option<&PoolEndpoint> {
        self.endpoints.binary_search_by(|e| e.name.as_str().cmp(name)).ok().map(|i| &self.endpoints[i])
    }

    /// Whether a report about pod `pod` from the agent on `node` may be accepted: the pod is in
    /// the pool and scheduled on that node (docs/design.md §14, "Trust").
    pub fn admits_report(&self, pod: &str, node: &str) -> bool {
        self.pods.get(pod).is_some_and(|p| p.node.as_deref() == Some(node))
    }

    /// Content equality, generation aside.
    pub fn same_content(&self, other: &Self) -> bool {
        self.synced == other.synced
            && self.dropped_pods == other.dropped_pods
            && self.source == other.source
            && self.pool == other.pool
            && self.endpoints == other.endpoints
            && self.pods == other.pods
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn spec(ports: &[u16]) -> PoolSpecView {
        PoolSpecView {
            selector: [("app".into(), "vllm".into())].into(),
            target_ports: ports.to_vec(),
            app_protocol: "http".into(),
            endpoint_picker: None,
        }
    }

    fn pod(name: &str, ip: Option<&str>, ready: bool) -> Pod {
        Pod {
            metadata: ObjectMeta { name: Some(name.into()), namespace: Some("ns".into()), ..Default::default() },
            spec: Some(PodSpec { node_name: Some("node-1".into()), ..Default::default() }),
            status: Some(PodStatus {
                pod_ip: ip.map(str::to_string),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn endpoints_are_pod_times_port_named_by_rank() {
        let s = spec(&[8000, 8001]);
        let pods = [pod("b", Some("10.0.0.2"), true), pod("a", Some("10.0.0.1"), false), pod("c", None, true)]
            .iter()
            .filter_map(|p| PoolPod::from_pod(p, &s))
            .collect::<Vec<_>>();
        let v = PoolView::build(Source::File("x".into()), Some(s), pods, true);
        let names: Vec<_> = v.endpoints.iter().map(|e| (e.name.as_str(), e.addr.to_string(), e.ready)).collect();
        assert_eq!(
            names,
            [
                ("a-rank-0", "10.0.0.1:8000".to_string(), false),
                ("a-rank-1", "10.0.0.1:8001".to_string(), false),
                ("b-rank-0", "10.0.0.2:8000".to_string(), true),
                ("b-rank-1", "10.0.0.2:8001".to_string(), true),
            ]
        );
        assert_eq!(v.candidates().count(), 2);
        assert_eq!(v.pods.len(), 3, "the pod without an IP is still a pool member");
        assert!(v.admits_report("c", "node-1") && !v.admits_report("c", "node-2") && !v.admits_report("zz", "node-1"));
        assert_eq!(v.endpoint("b-rank-1").map(|e| e.rank), Some(1));
        assert!(v.endpoint_at("10.0.0.2:8000".parse().unwrap()).is_some());
    }

    #[test]
    fn terminating_pods_are_not_ready_and_active_ports_limit_ranks() {
        let s = spec(&[8000, 8001, 8002]);
        let mut p = pod("a", Some("10.0.0.1"), true);
        p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert!(!is_ready(&p));
        p.metadata.deletion_timestamp = None;
        p.metadata.annotations =
            Some([(ACTIVE_PORTS_ANNOTATION.to_string(), "8002, 8000,bogus,9999".to_string())].into());
        let pp = PoolPod::from_pod(&p, &s).unwrap();
        assert_eq!(pp.ports, [(0, 8000), (2, 8002)]);
        let legacy: BTreeMap<String, String> =
            [(LEGACY_ACTIVE_PORTS_ANNOTATION.to_string(), "8001".to_string())].into();
        assert_eq!(active_ports(&legacy, &s.target_ports), [(1, 8001)]);
    }

    #[test]
    fn spec_view_drops_invalid_and_duplicate_ports() {
        let spec = InferencePoolSpec {
            target_ports: [0, 8000, 70000, 8000, 8001].iter().map(|n| crate::crd::PoolPort { number: *n }).collect(),
            ..Default::default()
        };
        let v = PoolSpecView::from_spec(&spec);
        assert_eq!(v.target_ports, [8000, 8001]);
        assert_eq!(v.app_protocol, "http");
        assert_eq!(spec_with_labels().label_selector(), "app=vllm,tier=gpu");
    }

    fn spec_with_labels() -> PoolSpecView {
        PoolSpecView {
            selector: [("tier".into(), "gpu".into()), ("app".into(), "vllm".into())].into(),
            ..Default::default()
        }
    }
}
