//! Custom resources deploy/k8s uses, as serde structs holding the fields kvroute relies on.
//! Unknown fields are rejected (`deny_unknown_fields`), so a typo fails the parse.
//!
//! Shapes: InferencePool from the Gateway API Inference Extension API reference
//! (`inference.networking.k8s.io/v1`: `selector.matchLabels`, `targetPorts[].number`,
//! `endpointPickerRef{group,kind,name,port.number,failureMode}`); Gateway and HTTPRoute from
//! `gateway.networking.k8s.io/v1` (only the subset used here).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// `inference.networking.k8s.io/v1` InferencePool.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InferencePool {
    /// Always `inference.networking.k8s.io/v1`.
    pub api_version: String,
    /// Always `InferencePool`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// The pool.
    pub spec: InferencePoolSpec,
}

/// The pool's pods, ports and Endpoint Picker.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Label selector of the model-server pods (same namespace).
    pub selector: PoolSelector,
    /// Model-server ports (1–8, unique); each pod ip:port is one endpoint.
    pub target_ports: Vec<PortNumber>,
    /// `http` (default) or `kubernetes.io/h2c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    /// The Endpoint Picker Service. Optional in the GIE v1 CRD (`required: [selector,
    /// targetPorts]`); a pool a Gateway routes to needs one (checked in `checks::gateway`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// `selector` of an InferencePool (labels only).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PoolSelector {
    /// Labels the pods must carry.
    pub match_labels: BTreeMap<String, String>,
}

/// `{number: N}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortNumber {
    /// TCP port.
    pub number: i32,
}

/// Reference to the Endpoint Picker (kvroute-picker's ext_proc Service port).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group; empty/absent = core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind; absent = `Service`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Service name (same namespace).
    pub name: String,
    /// Service port (required for a Service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortNumber>,
    /// `FailOpen` or `FailClose` (default `FailClose`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

/// `gateway.networking.k8s.io/v1` Gateway (subset).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Gateway {
    /// Always `gateway.networking.k8s.io/v1`.
    pub api_version: String,
    /// Always `Gateway`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// Class and listeners.
    pub spec: GatewaySpec,
}

/// Gateway spec (subset).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GatewaySpec {
    /// The implementation's GatewayClass.
    pub gateway_class_name: String,
    /// Listeners.
    pub listeners: Vec<GatewayListener>,
}

/// One Gateway listener.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayListener {
    /// Listener name, unique in the Gateway.
    pub name: String,
    /// `HTTP`, `HTTPS`, ….
    pub protocol: String,
    /// Port.
    pub port: i32,
}

/// `gateway.networking.k8s.io/v1` HTTPRoute (subset).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpRoute {
    /// Always `gateway.networking.k8s.io/v1`.
    pub api_version: String,
    /// Always `HTTPRoute`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// Parents and rules.
    pub spec: HttpRouteSpec,
}

/// HTTPRoute spec (subset).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpRouteSpec {
    /// Gateways this route attaches to.
    pub parent_refs: Vec<ObjectRef>,
    /// Rules.
    pub rules: Vec<HttpRouteRule>,
}

/// A reference by group/kind/name (parentRefs, backendRefs).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectRef {
    /// API group (absent = the default for the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind (absent = the default for the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name (same namespace).
    pub name: String,
    /// Port, for Service backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
    /// Weight, for backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<i32>,
}

/// One HTTPRoute rule (subset).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpRouteRule {
    /// Matches (kept as JSON: only their presence matters here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matches: Option<serde_json::Value>,
    /// Backends.
    pub backend_refs: Vec<ObjectRef>,
    /// Timeouts (kept as JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<serde_json::Value>,
}

/// `cert-manager.io/v1` Issuer (the subset the cert-manager component uses: self-signed or CA).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Issuer {
    /// Always `cert-manager.io/v1`.
    pub api_version: String,
    /// Always `Issuer`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// How it signs.
    pub spec: IssuerSpec,
}

/// Exactly one of `selfSigned` and `ca`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IssuerSpec {
    /// Self-signed (`{}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub self_signed: Option<BTreeMap<String, serde_json::Value>>,
    /// A CA whose key pair is in `secretName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<CaIssuer>,
}

/// A CA Issuer's Secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CaIssuer {
    /// Secret holding `tls.crt` and `tls.key` of the CA.
    pub secret_name: String,
}

/// `cert-manager.io/v1` Certificate (the subset the cert-manager component uses).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Certificate {
    /// Always `cert-manager.io/v1`.
    pub api_version: String,
    /// Always `Certificate`.
    pub kind: String,
    /// Name, namespace, labels.
    pub metadata: ObjectMeta,
    /// What to issue.
    pub spec: CertificateSpec,
}

/// A Certificate's request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CertificateSpec {
    /// Secret the key pair (and `ca.crt`) is written to.
    pub secret_name: String,
    /// Who signs.
    pub issuer_ref: ObjectRef,
    /// A CA certificate.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "isCA")]
    pub is_ca: Option<bool>,
    /// Subject CN.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub common_name: Option<String>,
    /// Lifetime (Go duration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
    /// Key algorithm, size, rotation (kept as JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key: Option<serde_json::Value>,
    /// Key usages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usages: Option<Vec<String>>,
    /// DNS SANs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_names: Option<Vec<String>>,
}
