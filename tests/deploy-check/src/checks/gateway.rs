//! Gateway API objects: the InferencePool's Endpoint Picker reference reaches the picker's ext_proc
//! port through a real Service port; HTTPRoutes attach to existing Gateways and send to existing pools.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{CheckContext, Problem, Sink, configs, containers, named_port, resolve_port, selects};
use crate::objects::{Object, Rendered};

const POOL_GROUP: &str = "inference.networking.k8s.io";

pub(super) fn check(r: &Rendered, ctx: &CheckContext, out: &mut Vec<Problem>) {
    let followed_pool = configs::picker_pool_name(r, ctx);
    for o in &r.objects {
        match o {
            Object::InferencePool(pool) => {
                let mut sink = Sink::new(out, o.id());
                let spec = &pool.spec;
                let n = spec.target_ports.len();
                let mut numbers: Vec<_> = spec.target_ports.iter().map(|p| p.number).collect();
                numbers.sort_unstable();
                numbers.dedup();
                if n == 0 || n > 8 || numbers.len() != n {
                    sink.push("targetPorts must hold 1 to 8 unique ports");
                }
                if spec.selector.match_labels.is_empty() {
                    sink.push("selector.matchLabels is empty");
                }
                let pool_name = pool.metadata.name.as_deref().unwrap_or_default();
                let Some(epp) = &spec.endpoint_picker_ref else {
                    if routed_to(r, pool_name) {
                        sink.push("an HTTPRoute sends traffic here but endpointPickerRef is missing: the gateway cannot reach the picker");
                    }
                    continue;
                };
                if !matches!(epp.failure_mode.as_deref(), None | Some("FailOpen") | Some("FailClose")) {
                    sink.push(format!("endpointPickerRef.failureMode {:?}: FailOpen or FailClose", epp.failure_mode));
                }
                if epp.kind.as_deref().unwrap_or("Service") != "Service"
                    || !epp.group.as_deref().unwrap_or("").is_empty()
                {
                    sink.push("endpointPickerRef must name a core Service");
                    continue;
                }
                let Some(port) = &epp.port else {
                    sink.push("endpointPickerRef.port is required for a Service");
                    continue;
                };
                let Some(svc) = r.service(&epp.name) else {
                    sink.push(format!("endpointPickerRef names Service {}, which does not exist", epp.name));
                    continue;
                };
                let svc_spec = svc.spec.clone().unwrap_or_default();
                let Some(sp) = svc_spec.ports.as_deref().unwrap_or(&[]).iter().find(|p| p.port == port.number) else {
                    sink.push(format!("Service {} has no port {}", epp.name, port.number));
                    continue;
                };
                // The port must land on the picker's ext_proc listener, not on ingest or admin.
                let target = sp.target_port.clone().unwrap_or(IntOrString::Int(sp.port));
                let selector = svc_spec.selector.unwrap_or_default();
                let lands_on_ext_proc = r.workloads().iter().any(|w| {
                    selects(&selector, w.template.metadata.as_ref().and_then(|m| m.labels.as_ref()))
                        && containers(w.template).iter().any(|c| {
                            named_port(c, "ext-proc").is_some() && resolve_port(c, &target) == named_port(c, "ext-proc")
                        })
                });
                if !lands_on_ext_proc {
                    sink.push(format!(
                        "Service {} port {} does not reach a container port named ext-proc (the picker's ext_proc gRPC)",
                        epp.name, port.number
                    ));
                }
            }
            Object::HttpRoute(route) => {
                let mut sink = Sink::new(out, o.id());
                for p in &route.spec.parent_refs {
                    if p.kind.as_deref().unwrap_or("Gateway") == "Gateway" && !r.has("Gateway", &p.name) {
                        sink.push(format!("parentRef Gateway {} does not exist", p.name));
                    }
                }
                for rule in &route.spec.rules {
                    if rule.backend_refs.is_empty() {
                        sink.push("a rule has no backendRefs");
                    }
                    for b in &rule.backend_refs {
                        match (b.group.as_deref().unwrap_or(""), b.kind.as_deref().unwrap_or("Service")) {
                            // The operator's pool (not rendered) is the one the picker follows.
                            (POOL_GROUP, "InferencePool")
                                if !r.has("InferencePool", &b.name)
                                    && followed_pool.as_deref() != Some(b.name.as_str()) =>
                            {
                                sink.push(format!(
                                    "backendRef InferencePool {} is neither rendered nor the pool the picker follows ({:?})",
                                    b.name, followed_pool
                                ));
                            }
                            ("", "Service") if !r.has("Service", &b.name) => {
                                sink.push(format!("backendRef Service {} does not exist", b.name));
                            }
                            (POOL_GROUP, "InferencePool") | ("", "Service") => {}
                            (g, k) => {
                                sink.push(format!("backendRef {g}/{k} {} is not a kind this deployment uses", b.name))
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// Whether an HTTPRoute has the InferencePool `pool` as a backend.
fn routed_to(r: &Rendered, pool: &str) -> bool {
    r.objects.iter().any(|o| match o {
        Object::HttpRoute(route) => route.spec.rules.iter().flat_map(|rule| &rule.backend_refs).any(|b| {
            b.group.as_deref() == Some(POOL_GROUP) && b.kind.as_deref() == Some("InferencePool") && b.name == pool
        }),
        _ => false,
    })
}

/// Every namespaced object in one namespace, the pool's, which is the picker's (docs/design.md
/// §14): the pool's `endpointPickerRef` and HTTPRoute `backendRefs` resolve in their own namespace,
/// the picker and agents watch their own namespace (`--pool-namespace` from the downward API), and
/// their Roles grant only that one. The namespace is the InferencePool's when rendered, else the
/// picker StatefulSet's.
pub(super) fn namespaces(r: &Rendered, ctx: &CheckContext, out: &mut Vec<Problem>) {
    let (source, ns) = match r.objects.iter().find_map(|o| match o {
        Object::InferencePool(p) => Some(("InferencePool", p.metadata.namespace.clone())),
        _ => None,
    }) {
        Some(found) => found,
        None => match r.objects.iter().find_map(|o| match o {
            Object::StatefulSet(s) if s.metadata.name.as_deref() == Some(ctx.picker.as_str()) => {
                Some(("picker", s.metadata.namespace.clone()))
            }
            _ => None,
        }) {
            Some(found) => found,
            None => return,
        },
    };
    let Some(pool_ns) = ns else {
        return Sink::new(out, format!("{source}/*"))
            .push("has no namespace; set `namespace:` in the install's kustomization");
    };
    for o in &r.objects {
        let (kind, meta) = o.kind_meta();
        if matches!(kind, "Namespace" | "ClusterRole" | "ClusterRoleBinding") {
            continue;
        }
        match meta.namespace.as_deref() {
            None => Sink::new(out, o.id()).push(format!(
                "has no namespace: it would land in the client's current one, not the pool's ({pool_ns}); \
                 set `namespace: {pool_ns}` in the install's kustomization"
            )),
            Some(ns) if ns != pool_ns => Sink::new(out, o.id())
                .push(format!("namespace {ns} ≠ the {source}'s {pool_ns}: every object lives in the pool's")),
            Some(_) => {}
        }
    }
    // The cluster-scoped grant binds the picker's ServiceAccount in that namespace.
    for o in &r.objects {
        if let Object::ClusterRoleBinding(b) = o {
            for s in b.subjects.as_deref().unwrap_or(&[]) {
                if s.kind == "ServiceAccount" && s.namespace.as_deref() != Some(pool_ns.as_str()) {
                    Sink::new(out, o.id()).push(format!(
                        "binds ServiceAccount {} in namespace {:?}, not the pool's {pool_ns}",
                        s.name, s.namespace
                    ));
                }
            }
        }
    }
}
