//! The certificates and keys of one test cluster, written as PEM files into its directory: a CA, the API server's
//! serving certificate (127.0.0.1, localhost), an admin client certificate in `system:masters`, and the
//! ServiceAccount token signing key.

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

/// Paths of the PEM files, plus the CA and admin credentials in memory for the kubeconfigs.
pub struct Pki {
    pub ca_cert: PathBuf,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
    pub ca_pem: String,
    pub admin_cert_pem: String,
    pub admin_key_pem: String,
}

impl Pki {
    /// Generates everything (ECDSA P-256: quick to make, accepted by every piece) into `dir`.
    pub fn generate(dir: &Path) -> Result<Pki> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kube-testenv CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

        let mut serving = CertificateParams::new(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
            "kubernetes.default.svc".to_string(),
        ])?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_key = KeyPair::generate()?;
        let serving_cert = serving.signed_by(&serving_key, &ca)?;

        // The API server maps the certificate's O to groups: system:masters is cluster-admin without RBAC objects.
        let mut admin = CertificateParams::new(Vec::<String>::new())?;
        admin
            .distinguished_name
            .push(DnType::CommonName, "kube-testenv-admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin_key = KeyPair::generate()?;
        let admin_cert = admin.signed_by(&admin_key, &ca)?;

        let sa_key = KeyPair::generate()?;

        let write = |name: &str, pem: &str| -> Result<PathBuf> {
            let path = dir.join(name);
            std::fs::write(&path, pem).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        };
        Ok(Pki {
            ca_cert: write("ca.crt", &ca.pem())?,
            serving_cert: write("serving.crt", &serving_cert.pem())?,
            serving_key: write("serving.key", &serving_key.serialize_pem())?,
            sa_key: write("sa.key", &sa_key.serialize_pem())?,
            // The API server reads only public keys (or PKCS#1/SEC1 private keys) from its verification file.
            sa_pub: write("sa.pub", &sa_key.public_key_pem())?,
            ca_pem: ca.pem(),
            admin_cert_pem: admin_cert.pem(),
            admin_key_pem: admin_key.serialize_pem(),
        })
    }
}
