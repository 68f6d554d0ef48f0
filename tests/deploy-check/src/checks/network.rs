//! The rendered NetworkPolicies against the connections the design needs (docs/operations.md
//! "NetworkPolicies"), evaluated with [`crate::netpol`]: each needed connection must be admitted,
//! and every other connection into a kvroute pod, from any of the modelled sources to any port its
//! containers declare (and Envoy's loopback admin port), must be refused.
//!
//! Modelled sources and destinations: the rendered picker, agent and Envoy pods (their template
//! labels and named ports, in the picker's namespace); a Prometheus pod in a namespace labelled
//! `kvroute.io/monitoring: "true"`; a Gateway API gateway pod labelled `kvroute.io/gateway: "true"`
//! in its own namespace; a model-server pod (the InferencePool's selector when rendered); the API
//! server outside the pod network; and strangers: an unlabelled pod in kvroute's namespace, one in
//! another namespace, and a client outside the cluster.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::{Problem, Sink, containers, declared_ports};
use crate::netpol::{Endpoint, Verdict, evaluate};
use crate::objects::{Object, Rendered, Workload};

/// The API server as pods dial it (an address outside the pod network; TEST-NET-1).
const API_SERVER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// Envoy's admin listener: loopback only, never admitted from outside the pod.
const ENVOY_ADMIN_PORT: i32 = 9901;

/// One connection: `from` dials `to` on its container port named `port` (or a number).
#[derive(Debug, Clone)]
pub struct Connection {
    /// What it is for, e.g. "picker ↔ picker ReplicaSync".
    pub purpose: &'static str,
    /// Source.
    pub from: Endpoint,
    /// Destination.
    pub to: Endpoint,
    /// Destination port number.
    pub port: i32,
    /// `TCP`.
    pub protocol: String,
}

fn pod_of(w: &Workload<'_>, namespace: &str) -> Endpoint {
    let labels = w.template.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default();
    let ports = containers(w.template)
        .iter()
        .flat_map(declared_ports)
        .map(|p| (p.name.clone(), p.container_port, p.protocol.clone().unwrap_or_else(|| "TCP".into())))
        .collect();
    Endpoint::pod(w.name, namespace, &[], labels, ports)
}

fn port_named(e: &Endpoint, name: &str) -> Option<i32> {
    e.pod.as_ref()?.ports.iter().find(|(n, _, _)| n.as_deref() == Some(name)).map(|(_, p, _)| *p)
}

/// The modelled endpoints of one rendered deployment.
#[derive(Debug, Clone)]
pub struct Cast {
    /// The picker replicas' pod.
    pub picker: Endpoint,
    /// The agents' pod.
    pub agent: Endpoint,
    /// The standalone Envoy's pod, when rendered.
    pub envoy: Option<Endpoint>,
    /// Prometheus, in the monitoring namespace.
    pub prometheus: Endpoint,
    /// A Gateway API gateway pod in its own namespace.
    pub gateway: Endpoint,
    /// A model-server pod of the pool.
    pub engine: Endpoint,
    /// The API server.
    pub api_server: Endpoint,
    /// Sources that need nothing from kvroute.
    pub strangers: Vec<Endpoint>,
}

impl Cast {
    /// The cast for `r`, or `None` when it has no picker StatefulSet or agent DaemonSet.
    pub fn of(r: &Rendered, picker: &str, agent: &str, envoy: &str) -> Option<Cast> {
        let pw = r.workload(picker)?;
        let aw = r.workload(agent)?;
        let ns = r
            .objects
            .iter()
            .find_map(|o| match o {
                Object::StatefulSet(s) if s.metadata.name.as_deref() == Some(picker) => s.metadata.namespace.clone(),
                _ => None,
            })
            .unwrap_or_else(|| "default".into());
        let engine_labels: BTreeMap<String, String> = r
            .objects
            .iter()
            .find_map(|o| match o {
                Object::InferencePool(p) => Some(p.spec.selector.match_labels.clone()),
                _ => None,
            })
            .unwrap_or_else(|| [("app".to_string(), "model-server".to_string())].into());
        let tcp = |name: &str, port: i32| (Some(name.to_string()), port, "TCP".to_string());
        Some(Cast {
            picker: pod_of(&pw, &ns),
            agent: pod_of(&aw, &ns),
            envoy: r.workload(envoy).map(|w| pod_of(&w, &ns)),
            prometheus: Endpoint::pod(
                "prometheus",
                "monitoring",
                &[("kvroute.io/monitoring", "true")],
                [("app.kubernetes.io/name".to_string(), "prometheus".to_string())].into(),
                vec![tcp("web", 9090)],
            ),
            gateway: Endpoint::pod(
                "gateway-api gateway",
                "gateway-system",
                &[],
                [("kvroute.io/gateway".to_string(), "true".to_string())].into(),
                vec![tcp("http", 8080)],
            ),
            engine: Endpoint::pod(
                "model server",
                &ns,
                &[],
                engine_labels,
                vec![tcp("http", 8000), tcp("kv-events", 5557), tcp("kv-replay", 5558)],
            ),
            api_server: Endpoint::outside("kube-apiserver", API_SERVER),
            strangers: vec![
                Endpoint::pod(
                    "an unlabelled pod in kvroute's namespace",
                    &ns,
                    &[],
                    [("app".to_string(), "other".to_string())].into(),
                    vec![],
                ),
                Endpoint::pod(
                    "a pod in another namespace",
                    "elsewhere",
                    &[],
                    [("app".to_string(), "other".to_string())].into(),
                    vec![],
                ),
                Endpoint::outside("a client outside the cluster", Ipv4Addr::new(198, 51, 100, 7)),
            ],
        })
    }

    /// The connections the design needs. A named port the destination does not declare makes the
    /// connection unrepresentable: it is returned in the second list (a problem of its own).
    pub fn needed(&self) -> (Vec<Connection>, Vec<String>) {
        let mut out = Vec::new();
        let mut missing = Vec::new();
        let mut need = |purpose: &'static str, from: &Endpoint, to: &Endpoint, port: &str| match port_named(to, port) {
            Some(n) => {
                out.push(Connection { purpose, from: from.clone(), to: to.clone(), port: n, protocol: "TCP".into() })
            }
            None => missing.push(format!("{purpose}: {} declares no port named {port}", to.name)),
        };
        if let Some(envoy) = &self.envoy {
            need("Envoy → picker ext_proc", envoy, &self.picker, "ext-proc");
            need("Prometheus → Envoy stats", &self.prometheus, envoy, "stats");
            need("Envoy → engines", envoy, &self.engine, "http");
            for s in &self.strangers {
                need("clients → Envoy", s, envoy, "http");
            }
        }
        // A Gateway API gateway's pods, labelled by the operator, in any overlay.
        need("Gateway API gateway → picker ext_proc", &self.gateway, &self.picker, "ext-proc");
        need("agent → picker ingest", &self.agent, &self.picker, "ingest");
        need("picker ↔ picker ReplicaSync", &self.picker, &self.picker, "ingest");
        need("Prometheus → picker metrics", &self.prometheus, &self.picker, "admin");
        need("Prometheus → agent metrics", &self.prometheus, &self.agent, "metrics");
        need("agent → engines (HTTP)", &self.agent, &self.engine, "http");
        need("agent → engines (KV events)", &self.agent, &self.engine, "kv-events");
        need("agent → engines (KV replay)", &self.agent, &self.engine, "kv-replay");
        for (purpose, from) in [("picker → kube-apiserver", &self.picker), ("agent → kube-apiserver", &self.agent)]
        {
            out.push(Connection {
                purpose,
                from: from.clone(),
                to: self.api_server.clone(),
                port: 443,
                protocol: "TCP".into(),
            });
        }
        (out, missing)
    }

    /// Every connection into a kvroute pod from a modelled source, on every port it declares
    /// (and Envoy's admin port).
    pub fn all_into_kvroute(&self) -> Vec<Connection> {
        let mut sources = vec![&self.picker, &self.agent, &self.prometheus, &self.gateway, &self.engine];
        sources.extend(self.envoy.iter());
        sources.extend(self.strangers.iter());
        let mut targets = vec![&self.picker, &self.agent];
        targets.extend(self.envoy.iter());
        let mut out = Vec::new();
        for to in targets {
            let mut ports: Vec<(i32, String)> =
                to.pod.iter().flat_map(|p| &p.ports).map(|(_, n, proto)| (*n, proto.clone())).collect();
            if Some(to) == self.envoy.as_ref() {
                ports.push((ENVOY_ADMIN_PORT, "TCP".into()));
            }
            for from in &sources {
                for (port, protocol) in &ports {
                    out.push(Connection {
                        purpose: "",
                        from: (*from).clone(),
                        to: to.clone(),
                        port: *port,
                        protocol: protocol.clone(),
                    });
                }
            }
        }
        out
    }
}

fn policies(r: &Rendered) -> Vec<NetworkPolicy> {
    r.objects
        .iter()
        .filter_map(|o| match o {
            Object::NetworkPolicy(p) => Some(p.clone()),
            _ => None,
        })
        .collect()
}

fn describe(c: &Connection) -> String {
    format!("{} → {} port {}/{}", c.from.name, c.to.name, c.port, c.protocol)
}

/// Checks the policies when the overlay renders any.
pub(super) fn check(r: &Rendered, picker: &str, agent: &str, envoy: &str, out: &mut Vec<Problem>) {
    let policies = policies(r);
    if policies.is_empty() {
        return;
    }
    let mut sink = Sink::new(out, "NetworkPolicy/*");
    let Some(cast) = Cast::of(r, picker, agent, envoy) else {
        return sink.push("cannot model the policies without the picker StatefulSet and the agent DaemonSet");
    };
    let (needed, missing) = cast.needed();
    for m in missing {
        sink.push(m);
    }
    for c in &needed {
        if let Verdict::Refused { side, covering } = evaluate(&policies, &c.from, &c.to, c.port, &c.protocol) {
            sink.push(format!(
                "{} ({}) is refused: the {side} policies {covering:?} cover it and no rule of theirs admits it",
                c.purpose,
                describe(c)
            ));
        }
    }
    let is_needed = |c: &Connection| {
        needed.iter().any(|n| n.from == c.from && n.to == c.to && n.port == c.port && n.protocol == c.protocol)
    };
    // Envoy's client port is public by design.
    let public =
        |c: &Connection| cast.envoy.as_ref().is_some_and(|e| c.to == *e && Some(c.port) == port_named(e, "http"));
    for c in cast.all_into_kvroute() {
        if is_needed(&c) || public(&c) {
            continue;
        }
        if let Verdict::Admitted { ingress_by, .. } = evaluate(&policies, &c.from, &c.to, c.port, &c.protocol) {
            let by = if ingress_by.is_empty() {
                "no policy covers the destination".to_string()
            } else {
                format!("admitted by {ingress_by:?}")
            };
            sink.push(format!("{} is not a connection kvroute needs, yet it is open ({by})", describe(&c)));
        }
    }
}
