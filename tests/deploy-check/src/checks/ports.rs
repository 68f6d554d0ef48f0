//! Ports: every Service port lands on a declared container port of the pods it selects, every
//! probe probes a declared port, every PodDisruptionBudget selects pods and leaves room to drain.
//! A Service that selects exactly the InferencePool's pods (the model servers, which the operator
//! deploys, not these manifests) is left to the check of its user (`envoy.rs`, failing open).

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Problem, Sink, containers, resolve_port, selects, workload_id};
use crate::objects::{Object, Rendered};

pub(super) fn services(r: &Rendered, out: &mut Vec<Problem>) {
    for svc in r.services() {
        let name = svc.metadata.name.clone().unwrap_or_default();
        let mut sink = Sink::new(out, format!("Service/{name}"));
        let Some(spec) = &svc.spec else {
            sink.push("has no spec");
            continue;
        };
        let Some(selector) = &spec.selector else {
            sink.push("has no selector (this deployment has no hand-made Endpoints)");
            continue;
        };
        let pool_pods = r
            .objects
            .iter()
            .any(|o| matches!(o, Object::InferencePool(p) if &p.spec.selector.match_labels == selector));
        if pool_pods {
            continue;
        }
        let targets: Vec<_> = r
            .workloads()
            .into_iter()
            .filter(|w| selects(selector, w.template.metadata.as_ref().and_then(|m| m.labels.as_ref())))
            .collect();
        if targets.is_empty() {
            sink.push(format!("selector {selector:?} matches no workload's pod labels"));
        }
        for port in spec.ports.as_deref().unwrap_or(&[]) {
            let target = port.target_port.clone().unwrap_or(IntOrString::Int(port.port));
            for w in &targets {
                if !containers(w.template).iter().any(|c| resolve_port(c, &target).is_some()) {
                    sink.push(format!(
                        "port {} ({}) targets {target:?}, which no container of {} declares",
                        port.port,
                        port.name.as_deref().unwrap_or("unnamed"),
                        workload_id(w)
                    ));
                }
            }
        }
    }
}

pub(super) fn probes(r: &Rendered, out: &mut Vec<Problem>) {
    for w in r.workloads() {
        let mut sink = Sink::new(out, workload_id(&w));
        for c in containers(w.template) {
            for (kind, probe) in [
                ("readinessProbe", &c.readiness_probe),
                ("livenessProbe", &c.liveness_probe),
                ("startupProbe", &c.startup_probe),
            ] {
                let Some(p) = probe else { continue };
                let port = if let Some(h) = &p.http_get {
                    h.port.clone()
                } else if let Some(t) = &p.tcp_socket {
                    t.port.clone()
                } else if let Some(g) = &p.grpc {
                    IntOrString::Int(g.port)
                } else {
                    continue;
                };
                if resolve_port(c, &port).is_none() {
                    sink.push(format!("container {} {kind} probes {port:?}, not a declared containerPort", c.name));
                }
            }
        }
    }
}

pub(super) fn disruption_budgets(r: &Rendered, out: &mut Vec<Problem>) {
    for o in &r.objects {
        let Object::PodDisruptionBudget(pdb) = o else { continue };
        let mut sink = Sink::new(out, o.id());
        let Some(spec) = &pdb.spec else {
            sink.push("has no spec");
            continue;
        };
        let labels = spec.selector.as_ref().and_then(|s| s.match_labels.clone()).unwrap_or_default();
        let targets: Vec<_> = r
            .workloads()
            .into_iter()
            .filter(|w| selects(&labels, w.template.metadata.as_ref().and_then(|m| m.labels.as_ref())))
            .collect();
        if targets.is_empty() {
            sink.push(format!("selector {labels:?} matches no workload"));
        }
        for w in targets {
            let replicas = w.replicas.unwrap_or(1);
            if let Some(IntOrString::Int(min)) = &spec.min_available
                && *min >= replicas
            {
                sink.push(format!("minAvailable {min} ≥ {} replicas: no voluntary eviction can proceed", replicas));
            }
            if let Some(IntOrString::Int(0)) = &spec.max_unavailable {
                sink.push("maxUnavailable 0: no voluntary eviction can proceed");
            }
        }
    }
}
