//! Test PKI for the agent ⇄ picker mTLS (docs/design.md §14, "Trust"), made with rcgen at start:
//! a CA, the picker's certificate (DNS SAN `picker.kvroute`) and one certificate per node (DNS SAN
//! `<node>.agent.kvroute`), the names a cert-manager Issuer gives them in `deploy/k8s`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// The DNS SAN every picker certificate carries (the agents' default `picker_tls.server_name`).
pub const PICKER_SERVER_NAME: &str = "picker.kvroute";

/// The DNS SAN naming an agent's node.
pub fn agent_san(node: &str) -> String {
    format!("{node}.agent.kvroute")
}

/// A certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct Pem {
    /// Certificate (PEM).
    pub cert: String,
    /// Private key (PKCS#8 PEM).
    pub key: String,
}

/// A certificate authority that issues test certificates.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A fresh self-signed CA named `name`.
    pub fn new(name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    /// The CA certificate (PEM).
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf certificate for `dns_names`, usable as TLS server and client.
    pub fn issue(&self, dns_names: &[String]) -> Result<Pem> {
        let mut params = CertificateParams::new(dns_names.to_vec())?;
        params.distinguished_name.push(DnType::CommonName, dns_names.first().cloned().unwrap_or_default());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
    }

    /// The picker's certificate.
    pub fn picker(&self) -> Result<Pem> {
        self.issue(&[PICKER_SERVER_NAME.to_string(), "localhost".to_string()])
    }

    /// The agent certificate of `node`.
    pub fn agent(&self, node: &str) -> Result<Pem> {
        self.issue(&[agent_san(node)])
    }
}

/// A self-signed certificate for `dns_names` (chained to no CA a picker trusts).
pub fn self_signed(dns_names: &[String]) -> Result<Pem> {
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(dns_names.to_vec())?.self_signed(&key)?;
    Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
}

/// Files of one TLS identity: `<dir>/<name>.crt`, `<dir>/<name>.key`.
#[derive(Debug, Clone)]
pub struct PemFiles {
    /// Certificate file.
    pub cert: PathBuf,
    /// Key file.
    pub key: PathBuf,
}

/// Writes `pem` as `<dir>/<name>.crt` and `.key`.
pub fn write(dir: &Path, name: &str, pem: &Pem) -> Result<PemFiles> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let files = PemFiles { cert: dir.join(format!("{name}.crt")), key: dir.join(format!("{name}.key")) };
    std::fs::write(&files.cert, &pem.cert).with_context(|| format!("writing {}", files.cert.display()))?;
    std::fs::write(&files.key, &pem.key).with_context(|| format!("writing {}", files.key.display()))?;
    Ok(files)
}
