//! mTLS on the AgentIngest listener (docs/design.md §14, "Trust"): rustls through tonic.
//!
//! The picker presents `cert_file`/`key_file` and requires every agent to present a client
//! certificate chained to `ca_file` (rustls' WebPKI client verifier: no certificate, or one that
//! does not chain to the CA, fails the handshake; nothing reaches the gRPC service). With token
//! identity ([`ReloadingTls::optional_client`]) a client certificate is optional, and checked
//! against `ca_file` when presented (picker replicas present theirs for ReplicaSync). The files are
//! the ones a Kubernetes Secret mounts (`tls.crt`, `tls.key`, `ca.crt`); they are re-read at most
//! every [`RELOAD_CHECK`] when a connection arrives, and when their bytes changed the next
//! connections use the new material (open streams keep theirs). A rotation that leaves the files
//! unreadable or inconsistent (a key that does not match its certificate, mid-rotation) keeps the
//! previous material and logs a warning.
//!
//! Handshakes run one task each, at most [`MAX_HANDSHAKES`] at a time, each bounded by
//! [`HANDSHAKE_TIMEOUT`]; failed handshakes are counted by reason
//! (`epp_ingest_refusals_total{reason="no_client_certificate"|"untrusted_certificate"|"tls_handshake"}`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use parking_lot::Mutex;
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info, warn};

use super::guard::{Refusal, Refusals};

/// Longest a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once; further connections wait in the listen backlog.
pub const MAX_HANDSHAKES: usize = 256;
/// How often, at most, the certificate files are re-read (when a connection arrives).
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// Where the ingest listener's TLS material lives (PEM files).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// CA bundle agents' client certificates must chain to (`ca.crt`).
    pub ca_file: PathBuf,
    /// The picker's certificate chain (`tls.crt`).
    pub cert_file: PathBuf,
    /// The picker's private key (`tls.key`; PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// Errors loading the TLS material.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// I/O error.
        source: std::io::Error,
    },
    /// A file holds no usable PEM object of the expected kind.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// rustls rejected the material (key does not match, unsupported algorithm, empty CA).
    #[error("TLS configuration rejected: {0}")]
    Config(String),
}

/// The file contents a configuration was built from (CA empty: no client authentication).
type Material = [Vec<u8>; 3];

/// The files of one listener: with a CA, clients must present a certificate chained to it
/// (or may, when `optional_client`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Files {
    ca_file: Option<PathBuf>,
    optional_client: bool,
    cert_file: PathBuf,
    key_file: PathBuf,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

fn read_material(files: &Files) -> Result<Material, TlsError> {
    let ca = match &files.ca_file {
        Some(p) => read(p)?,
        None => Vec::new(),
    };
    Ok([ca, read(&files.cert_file)?, read(&files.key_file)?])
}

fn pem_err(path: &Path, what: impl Into<String>) -> TlsError {
    TlsError::Pem { path: path.to_path_buf(), what: what.into() }
}

/// The rustls server configuration for `material` (CA, chain, key), ALPN h2.
fn build(files: &Files, material: &Material) -> Result<Arc<ServerConfig>, TlsError> {
    let [ca, chain, key] = material;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &files.ca_file {
        Some(ca_file) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(ca) {
                let cert = cert.map_err(|e| pem_err(ca_file, format!("bad certificate PEM: {e}")))?;
                roots.add(cert).map_err(|e| pem_err(ca_file, format!("unusable CA certificate: {e}")))?;
            }
            if roots.is_empty() {
                return Err(pem_err(ca_file, "no CA certificate"));
            }
            let mut verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            if files.optional_client {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier.build().map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let certs = CertificateDer::pem_slice_iter(chain)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(&files.cert_file, format!("bad certificate PEM: {e}")))?;
    if certs.is_empty() {
        return Err(pem_err(&files.cert_file, "no certificate"));
    }
    let key =
        PrivateKeyDer::from_pem_slice(key).map_err(|e| pem_err(&files.key_file, format!("no private key: {e}")))?;
    let mut config = builder.with_single_cert(certs, key).map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

struct Loaded {
    material: Material,
    config: Arc<ServerConfig>,
    checked: Instant,
}

/// A listener's TLS configuration, rebuilt when its files change (see the module doc).
pub struct ReloadingTls {
    files: Files,
    loaded: Mutex<Loaded>,
}

impl std::fmt::Debug for ReloadingTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingTls").field("files", &self.files).finish_non_exhaustive()
    }
}

impl ReloadingTls {
    /// mTLS: clients must present a certificate chained to `files.ca_file`. Loads the files once;
    /// an error here refuses the start.
    pub fn mutual(files: &TlsFiles) -> Result<Self, TlsError> {
        Self::load(Files {
            ca_file: Some(files.ca_file.clone()),
            optional_client: false,
            cert_file: files.cert_file.clone(),
            key_file: files.key_file.clone(),
        })
    }

    /// TLS where a client certificate is optional but, when presented, must chain to
    /// `files.ca_file` (token identity: agents authenticate with a token, picker replicas with
    /// their certificate). Loads the files once; an error here refuses the start.
    pub fn optional_client(files: &TlsFiles) -> Result<Self, TlsError> {
        Self::load(Files {
            ca_file: Some(files.ca_file.clone()),
            optional_client: true,
            cert_file: files.cert_file.clone(),
            key_file: files.key_file.clone(),
        })
    }

    /// Server-only TLS (no client certificate asked), e.g. ext_proc's `--secure-serving`.
    pub fn server_only(cert_file: &Path, key_file: &Path) -> Result<Self, TlsError> {
        Self::load(Files {
            ca_file: None,
            optional_client: false,
            cert_file: cert_file.to_path_buf(),
            key_file: key_file.to_path_buf(),
        })
    }

    fn load(files: Files) -> Result<Self, TlsError> {
        let material = read_material(&files)?;
        let config = build(&files, &material)?;
        Ok(Self { files, loaded: Mutex::new(Loaded { material, config, checked: Instant::now() }) })
    }

    /// The configuration for a new connection: re-reads the files when [`RELOAD_CHECK`] has
    /// passed since the last look, and rebuilds when their bytes changed.
    pub fn current(&self) -> Arc<ServerConfig> {
        let mut l = self.loaded.lock();
        if l.checked.elapsed() < RELOAD_CHECK {
            return l.config.clone();
        }
        l.checked = Instant::now();
        match read_material(&self.files) {
            Ok(m) if m == l.material => {}
            Ok(m) => match build(&self.files, &m) {
                Ok(config) => {
                    info!(cert = %self.files.cert_file.display(), "TLS material changed: new connections use it");
                    l.config = config;
                    l.material = m;
                }
                Err(e) => warn!(error = %e, "TLS files changed but do not load; keeping the previous material"),
            },
            Err(e) => warn!(error = %e, "TLS files unreadable; keeping the previous material"),
        }
        l.config.clone()
    }
}

/// Why a handshake failed, as a refusal reason.
fn handshake_refusal(e: &std::io::Error) -> Refusal {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::NoCertificatesPresented) => Refusal::NoClientCertificate,
        Some(rustls::Error::InvalidCertificate(_)) => Refusal::UntrustedCertificate,
        _ => Refusal::TlsHandshake,
    }
}

/// Accepts TCP connections on `listener` and yields those whose TLS handshake succeeded
/// (TCP_NODELAY set), for `Server::serve_with_incoming`; failed handshakes are counted in
/// `refusals` when given. Ends when the server drops the stream.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<ReloadingTls>,
    refusals: Option<Refusals>,
) -> impl Stream<Item = Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        loop {
            let Ok(permit) = permits.clone().acquire_owned().await else { break };
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => break,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "ingest accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = TlsAcceptor::from(tls.current());
            let (tx, refusals) = (tx.clone(), refusals.clone());
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => {
                        if let Some(r) = refusals {
                            r.refuse(handshake_refusal(&e), &peer.ip().to_string(), "", &e);
                        }
                    }
                    Err(_) => {
                        if let Some(r) = refusals {
                            r.refuse(Refusal::TlsHandshake, &peer.ip().to_string(), "", &"handshake timed out");
                        }
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
