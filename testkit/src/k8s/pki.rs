//! The test control plane's PKI, made fresh for every test binary: a CA, the API server's
//! serving certificate (for `127.0.0.1`, `localhost` and the in-cluster names), and the key pair
//! that signs ServiceAccount tokens. ECDSA P-256 throughout (rcgen with ring).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// Files written under the control plane's directory.
#[derive(Clone, Debug)]
pub struct Pki {
    pub ca_cert: PathBuf,
    /// The CA certificate in PEM, for clients.
    pub ca_pem: String,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    /// Signs ServiceAccount tokens (private key, PKCS#8 PEM).
    pub sa_key: PathBuf,
    /// Verifies them (public key, PEM).
    pub sa_pub: PathBuf,
}

fn rc(e: rcgen::Error) -> String {
    format!("test PKI: {e}")
}

fn dn(cn: &str) -> DistinguishedName {
    let mut d = DistinguishedName::new();
    d.push(DnType::CommonName, cn);
    d
}

/// Generate the PKI into `dir`.
pub fn generate(dir: &Path) -> Result<Pki, String> {
    generate_named(dir, "spotguard-test-ca")
}

/// [`generate`] with a CA of this common name (two PKIs whose CAs share a name are told apart by
/// their keys alone: a client holding one refuses the other's certificates as badly signed, not
/// as issued by an unknown CA).
pub fn generate_named(dir: &Path, ca_name: &str) -> Result<Pki, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let write = |name: &str, text: &str| -> Result<PathBuf, String> {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(p)
    };

    let ca_key = KeyPair::generate().map_err(rc)?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = dn(ca_name);
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(rc)?;
    let ca_pem = ca_cert.pem();
    let issuer = Issuer::new(ca_params, ca_key);

    let serving_key = KeyPair::generate().map_err(rc)?;
    let mut params = CertificateParams::new(vec![
        "127.0.0.1".to_string(),
        "localhost".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
        "kubernetes.default.svc.cluster.local".to_string(),
        "10.0.0.1".to_string(),
    ])
    .map_err(rc)?;
    params.distinguished_name = dn("kube-apiserver");
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let serving = params.signed_by(&serving_key, &issuer).map_err(rc)?;

    let sa = KeyPair::generate().map_err(rc)?;
    Ok(Pki {
        ca_cert: write("ca.crt", &ca_pem)?,
        serving_cert: write("apiserver.crt", &format!("{}{}", serving.pem(), ca_pem))?,
        serving_key: write("apiserver.key", &serving_key.serialize_pem())?,
        sa_key: write("sa.key", &sa.serialize_pem())?,
        sa_pub: write("sa.pub", &sa.public_key_pem())?,
        ca_pem,
    })
}
