//! The custom resources kvroute reads, as kube-rs types. Field names and optionality follow the
//! upstream Go types; unknown fields are ignored (newer servers may add some) and every field the
//! upstream marks optional is optional here, so an object written by a newer or older controller
//! still reads.
//!
//! - `InferencePool`, `inference.networking.k8s.io/v1` (Gateway API Inference Extension,
//!   `api/v1/inferencepool_types.go`, `api/v1/shared_types.go`): `spec.selector.matchLabels`,
//!   `spec.targetPorts[].number` (1–8 unique ports, each pod ip:port one endpoint),
//!   `spec.appProtocol` (`http` default, `kubernetes.io/h2c`), `spec.endpointPickerRef`
//!   (optional since GIE v1.5; `group` default `""`, `kind` default `Service`, `name`, `port.number`
//!   required for a Service, `failureMode` `FailOpen`/`FailClose`, default `FailClose`).
//! - `InferenceObjective` and `InferenceModelRewrite`, `llm-d.ai/v1alpha2` (llm-d router,
//!   `apix/v1alpha2/*.go`; the older group `inference.networking.x-k8s.io` is deprecated upstream):
//!   an objective is selected by name with the request header `x-llm-d-inference-objective`
//!   (alias `x-gateway-inference-objective`) and carries `spec.priority` (unset = 0, higher first,
//!   negative allowed); a rewrite maps a client model (`rules[].matches[].model.value`, type
//!   `Exact`; no matches = every model) to weighted `targets[].modelRewrite` names (weight
//!   1–1 000 000, all or none weighted). Both reference their pool with `spec.poolRef`
//!   (`group` default `inference.networking.k8s.io`, `kind` default `InferencePool`, `name`).
//!
//! See docs/design.md §14.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// API group of the InferencePool.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
/// Kind of the InferencePool.
pub const POOL_KIND: &str = "InferencePool";

/// `spec` of an `inference.networking.k8s.io/v1` InferencePool.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    plural = "inferencepools",
    namespaced,
    schema = "disabled",
    status = "InferencePoolStatus",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The model-server pods: labels they must carry, in the pool's namespace.
    #[serde(default)]
    pub selector: PoolSelector,
    /// Model-server ports; each pod ip:port is one endpoint (a data-parallel rank when several).
    #[serde(default)]
    pub target_ports: Vec<PoolPort>,
    /// `http` (HTTP/1.1, the default) or `kubernetes.io/h2c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    /// The Endpoint Picker (kvroute's picker Service) the gateway calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// `spec.selector`: labels only (a Service-compatible selector).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    /// Labels the pods must carry. Empty selects every pod of the namespace (as upstream).
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// `{number: N}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolPort {
    /// TCP port, 1–65535.
    #[serde(default)]
    pub number: i32,
}

/// `spec.endpointPickerRef`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group; absent or `""` = core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind; absent = `Service`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name (same namespace).
    #[serde(default)]
    pub name: String,
    /// Service port (required when the kind is Service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PoolPort>,
    /// `FailOpen` or `FailClose` (absent = `FailClose`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

/// `status` of an InferencePool: per parent (Gateway), conditions `Accepted`, `ResolvedRefs`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolStatus {
    /// One entry per parent that considers the pool (at most 32).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<PoolParentStatus>,
}

/// One parent's view of the pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolParentStatus {
    /// Conditions (`Accepted`, `ResolvedRefs`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The parent (group default `gateway.networking.k8s.io`, kind default `Gateway`).
    #[serde(default)]
    pub parent_ref: serde_json::Value,
    /// The controller that wrote this entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller_name: Option<String>,
}

/// `spec.poolRef` of the llm-d model CRDs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolObjectReference {
    /// Group; absent or empty means the default, `inference.networking.k8s.io`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind; absent means `InferencePool`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Pool name (same namespace).
    #[serde(default)]
    pub name: String,
}

impl PoolObjectReference {
    /// Whether this reference names the InferencePool `name` (defaults applied as the API
    /// server's defaulting would).
    pub fn refers_to(&self, name: &str) -> bool {
        let group = self.group.as_deref().filter(|g| !g.is_empty()).unwrap_or(POOL_GROUP);
        let kind = self.kind.as_deref().filter(|k| !k.is_empty()).unwrap_or(POOL_KIND);
        group == POOL_GROUP && kind == POOL_KIND && self.name == name
    }
}

/// `spec` of an `llm-d.ai/v1alpha2` InferenceObjective.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[kube(
    group = "llm-d.ai",
    version = "v1alpha2",
    kind = "InferenceObjective",
    plural = "inferenceobjectives",
    namespaced,
    schema = "disabled",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveSpec {
    /// Importance relative to other requests of the pool: higher first, negative allowed; unset
    /// reads as 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// The pool (same namespace).
    #[serde(default)]
    pub pool_ref: PoolObjectReference,
}

/// `spec` of an `llm-d.ai/v1alpha2` InferenceModelRewrite.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[kube(
    group = "llm-d.ai",
    version = "v1alpha2",
    kind = "InferenceModelRewrite",
    plural = "inferencemodelrewrites",
    namespaced,
    schema = "disabled",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceModelRewriteSpec {
    /// The pool (required upstream; a rewrite without one applies to no pool here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_ref: Option<PoolObjectReference>,
    /// Ordered rules; the first that matches a request is used.
    #[serde(default)]
    pub rules: Vec<InferenceModelRewriteRule>,
}

/// One rewrite rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InferenceModelRewriteRule {
    /// Any of these matches (OR). Empty: the rule matches every request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<RewriteMatch>,
    /// Weighted destinations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<RewriteTarget>,
}

/// One match criterion.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RewriteMatch {
    /// Match on the request body's `model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelMatch>,
}

/// How to match the request's `model`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelMatch {
    /// `Exact` (the only type upstream; absent = `Exact`).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub match_type: Option<String>,
    /// The model name.
    #[serde(default)]
    pub value: String,
}

/// A weighted destination.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RewriteTarget {
    /// Share of traffic: weight / sum of the rule's weights (1–1 000 000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<i32>,
    /// The model name sent to the engine (a base model, or a LoRA adapter's name as vLLM serves it).
    #[serde(default)]
    pub model_rewrite: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;

    #[test]
    fn resources_are_the_upstream_ones() {
        assert_eq!(InferencePool::api_version(&()), "inference.networking.k8s.io/v1");
        assert_eq!(InferencePool::plural(&()), "inferencepools");
        assert_eq!(InferenceObjective::api_version(&()), "llm-d.ai/v1alpha2");
        assert_eq!(InferenceObjective::plural(&()), "inferenceobjectives");
        assert_eq!(InferenceModelRewrite::api_version(&()), "llm-d.ai/v1alpha2");
        assert_eq!(InferenceModelRewrite::plural(&()), "inferencemodelrewrites");
    }

    /// An InferencePool as a v1.5 GIE install writes it, with status and a field this code does
    /// not know.
    #[test]
    fn pool_reads_upstream_yaml_and_ignores_unknown_fields() {
        let yaml = r#"
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: vllm-llama3-8b-instruct, namespace: default}
spec:
  selector:
    matchLabels: {app: vllm-llama3-8b-instruct}
  targetPorts: [{number: 8000}, {number: 8001}]
  appProtocol: http
  endpointPickerRef:
    name: vllm-llama3-8b-instruct-epp
    port: {number: 9002}
    failureMode: FailClose
  futureField: {x: 1}
status:
  parents:
    - parentRef: {group: gateway.networking.k8s.io, kind: Gateway, name: inference-gateway}
      conditions:
        - {type: Accepted, status: "True", reason: Accepted, message: "", lastTransitionTime: "2026-01-01T00:00:00Z", observedGeneration: 1}
"#;
        let pool: InferencePool = serde_norway::from_str(yaml).unwrap();
        assert_eq!(pool.spec.selector.match_labels["app"], "vllm-llama3-8b-instruct");
        assert_eq!(pool.spec.target_ports.iter().map(|p| p.number).collect::<Vec<_>>(), [8000, 8001]);
        let epp = pool.spec.endpoint_picker_ref.unwrap();
        assert_eq!((epp.name.as_str(), epp.port.map(|p| p.number)), ("vllm-llama3-8b-instruct-epp", Some(9002)));
        assert_eq!(pool.status.unwrap().parents[0].conditions[0].type_, "Accepted");
        // endpointPickerRef is optional since GIE v1.5.
        let bare: InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"}, "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}
        }))
        .unwrap();
        assert!(bare.spec.endpoint_picker_ref.is_none());
    }

    #[test]
    fn model_crds_read_upstream_yaml() {
        let rewrite: InferenceModelRewrite = serde_norway::from_str(
            r#"
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata: {name: canary}
spec:
  poolRef: {group: inference.networking.k8s.io, kind: InferencePool, name: pool-a}
  rules:
    - matches: [{model: {type: Exact, value: chat}}]
      targets: [{modelRewrite: llama-v1, weight: 90}, {modelRewrite: llama-v2-lora, weight: 10}]
    - targets: [{modelRewrite: llama-v1}]
status:
  conditions: [{type: Accepted, status: Unknown, reason: Pending, message: Waiting for controller, lastTransitionTime: "1970-01-01T00:00:00Z"}]
"#,
        )
        .unwrap();
        assert!(rewrite.spec.pool_ref.as_ref().unwrap().refers_to("pool-a"));
        assert_eq!(rewrite.spec.rules[0].matches[0].model.as_ref().unwrap().value, "chat");
        assert_eq!(rewrite.spec.rules[0].targets[1].weight, Some(10));
        assert!(rewrite.spec.rules[1].matches.is_empty());

        let objective: InferenceObjective = serde_norway::from_str(
            "apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: premium}\nspec: {priority: -5, poolRef: {name: pool-a}}\n",
        )
        .unwrap();
        assert_eq!(objective.spec.priority, Some(-5));
        assert!(objective.spec.pool_ref.refers_to("pool-a"), "group and kind default");
        assert!(!objective.spec.pool_ref.refers_to("pool-b"));
        let other_group = PoolObjectReference {
            group: Some("inference.networking.x-k8s.io".into()),
            kind: None,
            name: "pool-a".into(),
        };
        assert!(!other_group.refers_to("pool-a"));
    }
}
