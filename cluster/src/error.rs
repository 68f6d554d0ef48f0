//! The cluster subsystem's one error type.

use std::path::PathBuf;

use kvroute_common::config::YamlFileError;

/// What went wrong reading the cluster (API, kubelet, or files).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// The Kubernetes client could not be built or a request failed.
    #[error("kubernetes: {0}")]
    Kube(#[from] kube::Error),
    /// No kubeconfig or in-cluster configuration was found.
    #[error("kubernetes configuration: {0}")]
    KubeConfig(String),
    /// The kubelet PodResources socket could not be reached.
    #[error("kubelet PodResources socket {path}: {source}")]
    PodResourcesConnect {
        /// Socket path.
        path: PathBuf,
        /// Transport error.
        source: tonic::transport::Error,
    },
    /// A PodResources call failed.
    #[error("kubelet PodResources List: {0}")]
    PodResources(#[from] tonic::Status),
    /// A PodResources call took longer than its deadline.
    #[error("kubelet PodResources List: no answer within {0:?}")]
    PodResourcesTimeout(std::time::Duration),
    /// A file could not be read, is larger than allowed, or did not match its schema.
    #[error(transparent)]
    File(#[from] YamlFileError),
    /// A value is out of range or inconsistent.
    #[error("invalid {path}: {message}")]
    Invalid {
        /// Path (or object) it came from.
        path: String,
        /// What is wrong.
        message: String,
    },
}
