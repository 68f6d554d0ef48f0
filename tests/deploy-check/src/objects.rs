//! Rendered documents as typed objects.
//!
//! Built-in kinds parse into `k8s-openapi` structs, which silently ignore unknown fields; so each
//! object is serialized back and compared with the document: anything the struct dropped (a typo
//! such as `readOnlyRootFileSystem`, a field nested one level too deep) is an
//! [`DeployCheckError::UnknownFields`]. Custom resources use [`crate::crd`] (`deny_unknown_fields`).

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolumeClaim, PodTemplateSpec, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::DeployCheckError;
use crate::crd::{Certificate, Gateway, HttpRoute, InferencePool, Issuer};

/// One rendered object.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum Object {
    /// core/v1 Namespace.
    Namespace(Namespace),
    /// core/v1 ServiceAccount.
    ServiceAccount(ServiceAccount),
    /// core/v1 ConfigMap.
    ConfigMap(ConfigMap),
    /// core/v1 Service.
    Service(Service),
    /// core/v1 PersistentVolumeClaim.
    PersistentVolumeClaim(PersistentVolumeClaim),
    /// apps/v1 StatefulSet.
    StatefulSet(StatefulSet),
    /// apps/v1 Deployment.
    Deployment(Deployment),
    /// apps/v1 DaemonSet.
    DaemonSet(DaemonSet),
    /// policy/v1 PodDisruptionBudget.
    PodDisruptionBudget(PodDisruptionBudget),
    /// rbac/v1 Role.
    Role(Role),
    /// rbac/v1 RoleBinding.
    RoleBinding(RoleBinding),
    /// rbac/v1 ClusterRole.
    ClusterRole(ClusterRole),
    /// rbac/v1 ClusterRoleBinding.
    ClusterRoleBinding(ClusterRoleBinding),
    /// inference.networking.k8s.io/v1 InferencePool.
    InferencePool(InferencePool),
    /// gateway.networking.k8s.io/v1 Gateway.
    Gateway(Gateway),
    /// gateway.networking.k8s.io/v1 HTTPRoute.
    HttpRoute(HttpRoute),
    /// networking.k8s.io/v1 NetworkPolicy.
    NetworkPolicy(NetworkPolicy),
    /// cert-manager.io/v1 Issuer.
    Issuer(Issuer),
    /// cert-manager.io/v1 Certificate.
    Certificate(Certificate),
}

/// A workload's pod template, seen the same way for every workload kind.
#[derive(Debug, Clone, Copy)]
pub struct Workload<'a> {
    /// `StatefulSet`, `Deployment` or `DaemonSet`.
    pub kind: &'static str,
    /// Object name.
    pub name: &'a str,
    /// Desired replicas (`None` for a DaemonSet).
    pub replicas: Option<i32>,
    /// The pod template.
    pub template: &'a PodTemplateSpec,
}

/// Every object of one rendered overlay.
#[derive(Debug, Clone, Default)]
pub struct Rendered {
    /// In rendering order.
    pub objects: Vec<Object>,
}

fn name_of(meta: &ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("")
}

impl Object {
    /// `Kind/name`, for messages.
    pub fn id(&self) -> String {
        let (kind, meta) = self.kind_meta();
        format!("{kind}/{}", name_of(meta))
    }

    /// The kind and metadata.
    pub fn kind_meta(&self) -> (&'static str, &ObjectMeta) {
        match self {
            Object::Namespace(o) => ("Namespace", &o.metadata),
            Object::ServiceAccount(o) => ("ServiceAccount", &o.metadata),
            Object::ConfigMap(o) => ("ConfigMap", &o.metadata),
            Object::Service(o) => ("Service", &o.metadata),
            Object::PersistentVolumeClaim(o) => ("PersistentVolumeClaim", &o.metadata),
            Object::StatefulSet(o) => ("StatefulSet", &o.metadata),
            Object::Deployment(o) => ("Deployment", &o.metadata),
            Object::DaemonSet(o) => ("DaemonSet", &o.metadata),
            Object::PodDisruptionBudget(o) => ("PodDisruptionBudget", &o.metadata),
            Object::Role(o) => ("Role", &o.metadata),
            Object::RoleBinding(o) => ("RoleBinding", &o.metadata),
            Object::ClusterRole(o) => ("ClusterRole", &o.metadata),
            Object::ClusterRoleBinding(o) => ("ClusterRoleBinding", &o.metadata),
            Object::InferencePool(o) => ("InferencePool", &o.metadata),
            Object::Gateway(o) => ("Gateway", &o.metadata),
            Object::HttpRoute(o) => ("HTTPRoute", &o.metadata),
            Object::NetworkPolicy(o) => ("NetworkPolicy", &o.metadata),
            Object::Issuer(o) => ("Issuer", &o.metadata),
            Object::Certificate(o) => ("Certificate", &o.metadata),
        }
    }
}

impl Rendered {
    /// The ConfigMap named `name`.
    pub fn config_map(&self, name: &str) -> Option<&ConfigMap> {
        self.objects.iter().find_map(|o| match o {
            Object::ConfigMap(c) if name_of(&c.metadata) == name => Some(c),
            _ => None,
        })
    }

    /// The Service named `name`.
    pub fn service(&self, name: &str) -> Option<&Service> {
        self.services().find(|s| name_of(&s.metadata) == name)
    }

    /// Every Service.
    pub fn services(&self) -> impl Iterator<Item = &Service> {
        self.objects.iter().filter_map(|o| match o {
            Object::Service(s) => Some(s),
            _ => None,
        })
    }

    /// Whether an object of `kind` (as in [`Object::kind_meta`]) named `name` exists.
    pub fn has(&self, kind: &str, name: &str) -> bool {
        self.objects.iter().any(|o| {
            let (k, m) = o.kind_meta();
            k == kind && name_of(m) == name
        })
    }

    /// Every StatefulSet, Deployment and DaemonSet.
    pub fn workloads(&self) -> Vec<Workload<'_>> {
        self.objects
            .iter()
            .filter_map(|o| match o {
                Object::StatefulSet(s) => s.spec.as_ref().map(|sp| Workload {
                    kind: "StatefulSet",
                    name: name_of(&s.metadata),
                    replicas: Some(sp.replicas.unwrap_or(1)),
                    template: &sp.template,
                }),
                Object::Deployment(d) => d.spec.as_ref().map(|sp| Workload {
                    kind: "Deployment",
                    name: name_of(&d.metadata),
                    replicas: Some(sp.replicas.unwrap_or(1)),
                    template: &sp.template,
                }),
                Object::DaemonSet(d) => d.spec.as_ref().map(|sp| Workload {
                    kind: "DaemonSet",
                    name: name_of(&d.metadata),
                    replicas: None,
                    template: &sp.template,
                }),
                _ => None,
            })
            .collect()
    }

    /// The workload named `name`.
    pub fn workload(&self, name: &str) -> Option<Workload<'_>> {
        self.workloads().into_iter().find(|w| w.name == name)
    }
}

/// Parses every document; the first error stops.
pub fn parse_all(docs: &[serde_json::Value]) -> Result<Rendered, DeployCheckError> {
    let mut objects = Vec::with_capacity(docs.len());
    for (index, doc) in docs.iter().enumerate() {
        objects.push(parse_one(index, doc)?);
    }
    Ok(Rendered { objects })
}

fn parse_one(index: usize, doc: &serde_json::Value) -> Result<Object, DeployCheckError> {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    Ok(match (api_version, kind) {
        ("v1", "Namespace") => Object::Namespace(typed(doc)?),
        ("v1", "ServiceAccount") => Object::ServiceAccount(typed(doc)?),
        ("v1", "ConfigMap") => Object::ConfigMap(typed(doc)?),
        ("v1", "Service") => Object::Service(typed(doc)?),
        ("v1", "PersistentVolumeClaim") => Object::PersistentVolumeClaim(typed(doc)?),
        ("apps/v1", "StatefulSet") => Object::StatefulSet(typed(doc)?),
        ("apps/v1", "Deployment") => Object::Deployment(typed(doc)?),
        ("apps/v1", "DaemonSet") => Object::DaemonSet(typed(doc)?),
        ("policy/v1", "PodDisruptionBudget") => Object::PodDisruptionBudget(typed(doc)?),
        ("rbac.authorization.k8s.io/v1", "Role") => Object::Role(typed(doc)?),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => Object::RoleBinding(typed(doc)?),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => Object::ClusterRole(typed(doc)?),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => Object::ClusterRoleBinding(typed(doc)?),
        ("inference.networking.k8s.io/v1", "InferencePool") => Object::InferencePool(typed(doc)?),
        ("gateway.networking.k8s.io/v1", "Gateway") => Object::Gateway(typed(doc)?),
        ("gateway.networking.k8s.io/v1", "HTTPRoute") => Object::HttpRoute(typed(doc)?),
        ("networking.k8s.io/v1", "NetworkPolicy") => Object::NetworkPolicy(typed(doc)?),
        ("cert-manager.io/v1", "Issuer") => Object::Issuer(typed(doc)?),
        ("cert-manager.io/v1", "Certificate") => Object::Certificate(typed(doc)?),
        _ => {
            return Err(DeployCheckError::UnknownKind {
                index,
                api_version: api_version.to_string(),
                kind: kind.to_string(),
            });
        }
    })
}

/// Deserializes `doc` into `T` and checks that serializing it back gives `doc` again.
pub fn typed<T: DeserializeOwned + Serialize>(doc: &serde_json::Value) -> Result<T, DeployCheckError> {
    let kind = doc["kind"].as_str().unwrap_or_default().to_string();
    let name = doc["metadata"]["name"].as_str().unwrap_or_default().to_string();
    let value: T = serde_json::from_value(doc.clone()).map_err(|source| DeployCheckError::Schema {
        kind: kind.clone(),
        name: name.clone(),
        source,
    })?;
    let back = serde_json::to_value(&value).map_err(|source| DeployCheckError::Schema {
        kind: kind.clone(),
        name: name.clone(),
        source,
    })?;
    let mut paths = Vec::new();
    diff("", doc, &back, &mut paths);
    if paths.is_empty() { Ok(value) } else { Err(DeployCheckError::UnknownFields { kind, name, paths }) }
}

/// Paths where `want` has something `got` lacks or differs. Numbers compare by value (a YAML `1`
/// and a typed `1.0` are the same document).
pub(crate) fn diff(path: &str, want: &serde_json::Value, got: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (k, wv) in w {
                let p = format!("{path}/{k}");
                match g.get(k) {
                    Some(gv) => diff(&p, wv, gv, out),
                    None => out.push(p),
                }
            }
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => {
            for (i, (wv, gv)) in w.iter().zip(g).enumerate() {
                diff(&format!("{path}/{i}"), wv, gv, out);
            }
        }
        (Value::Number(w), Value::Number(g)) if w.as_f64() == g.as_f64() => {}
        _ if want == got => {}
        _ => out.push(path.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn misspelled_field_is_rejected() {
        let doc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
            "spec": {"ports": [{"port": 80, "targetprot": 8080}]}});
        match parse_all(&[doc]).unwrap_err() {
            DeployCheckError::UnknownFields { paths, .. } => assert_eq!(paths, vec!["/spec/ports/0/targetprot"]),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn wrong_type_and_unknown_kind_are_rejected() {
        let doc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
            "spec": {"ports": [{"port": "eighty"}]}});
        assert!(matches!(parse_all(&[doc]).unwrap_err(), DeployCheckError::Schema { .. }));
        let doc = json!({"apiVersion": "v9", "kind": "Widget", "metadata": {"name": "w"}});
        assert!(matches!(parse_all(&[doc]).unwrap_err(), DeployCheckError::UnknownKind { .. }));
    }

    #[test]
    fn crd_typo_is_rejected() {
        let doc = json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"}, "spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "x", "prot": {"number": 1}}}});
        assert!(matches!(parse_all(&[doc]).unwrap_err(), DeployCheckError::Schema { .. }));
    }
}
