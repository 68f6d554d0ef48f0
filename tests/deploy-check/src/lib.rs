//! Validation of `deploy/k8s` without a cluster.
//!
//! [`render::render`] runs `kubectl kustomize` on an overlay; [`objects::parse_all`] turns every
//! rendered document into a typed Kubernetes object (`k8s-openapi` 0.29 for built-in kinds, the
//! structs in [`crd`] for InferencePool, Gateway and HTTPRoute) and rejects fields the types do not
//! know (a round trip through the typed struct must give back the same document); [`checks::check_all`]
//! then checks the cross-references a cluster would only reveal at run time: Service ports against
//! container ports, ConfigMap/PVC/ServiceAccount references, probe ports, the picker and agent configs
//! inside their ConfigMaps (through the binaries' own `validate()`), the agents' picker lists against
//! the picker StatefulSet, the InferencePool's Endpoint Picker reference, and the Envoy config against
//! `deploy/envoy/envoy.yaml`; the NetworkPolicies against the connections the design needs (a model
//! of their semantics in [`netpol`]); and agent pods on a fleet of nodes that no manifest lists.
//!
//! Everything is synchronous and single-threaded; the only outside process is `kubectl`.

pub mod checks;
pub mod crd;
pub mod netpol;
pub mod objects;
pub mod render;

use std::path::PathBuf;

pub use checks::{CheckContext, Problem, check_all};
pub use objects::{Object, Rendered, parse_all};
pub use render::render;

/// Errors from rendering and parsing (check findings are [`Problem`]s, not errors).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeployCheckError {
    /// `kubectl` could not be started (not installed, not on `PATH`).
    #[error("cannot run `kubectl kustomize {dir}`: {source}; install kubectl (>= 1.32, it embeds kustomize 5.5)")]
    KubectlMissing {
        /// The overlay directory.
        dir: PathBuf,
        /// The spawn error.
        source: std::io::Error,
    },
    /// `kubectl kustomize` exited non-zero.
    #[error("`kubectl kustomize {dir}` failed: {stderr}")]
    Kustomize {
        /// The overlay directory.
        dir: PathBuf,
        /// What kustomize printed.
        stderr: String,
    },
    /// A rendered document is not YAML.
    #[error("rendered document {index} is not valid YAML: {source}")]
    Yaml {
        /// 0-based position in the rendered stream.
        index: usize,
        /// Parser error.
        source: serde_norway::Error,
    },
    /// A document has an apiVersion/kind this crate has no type for.
    #[error("document {index}: no typed struct for {api_version} {kind}; add it to objects.rs")]
    UnknownKind {
        /// 0-based position in the rendered stream.
        index: usize,
        /// The document's apiVersion.
        api_version: String,
        /// The document's kind.
        kind: String,
    },
    /// A document does not fit its kind's typed struct.
    #[error("{kind} {name}: does not match the typed schema: {source}")]
    Schema {
        /// Object kind.
        kind: String,
        /// Object name.
        name: String,
        /// Deserializer error (names the field).
        source: serde_json::Error,
    },
    /// A document has fields its typed struct does not know (typo or wrong nesting).
    #[error("{kind} {name}: fields unknown to the schema (typo or wrong nesting?): {paths:?}")]
    UnknownFields {
        /// Object kind.
        kind: String,
        /// Object name.
        name: String,
        /// JSON-pointer-like paths of what the typed struct dropped or changed.
        paths: Vec<String>,
    },
    /// A file the checks read (deploy/envoy/envoy.yaml) could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// I/O error.
        source: std::io::Error,
    },
}
