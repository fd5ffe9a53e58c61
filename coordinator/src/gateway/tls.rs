//! TLS offered to SQL clients. The certificate is the operator's (`--sql-tls-cert` and
//! `--sql-tls-key`) or, without one, a self-signed certificate pgmr makes once and keeps in
//! DATA_DIR/sql-tls, so `sslmode=require` works out of the box and a client can pin it.

use anyhow::{Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;

pub fn server_config(
    dir: &Path,
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>> {
    let (cert_path, key_path) = match (cert, key) {
        (Some(c), Some(k)) => (c.to_path_buf(), k.to_path_buf()),
        (None, None) => self_signed(dir)?,
        _ => anyhow::bail!("--sql-tls-cert and --sql-tls-key go together"),
    };
    let certs = CertificateDer::pem_file_iter(&cert_path)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("cannot read certificates from {}", cert_path.display()))?;
    let key = PrivateKeyDer::from_pem_file(&key_path)
        .with_context(|| format!("cannot read a private key from {}", key_path.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the SQL TLS certificate and key do not match")?;
    Ok(Arc::new(config))
}

fn self_signed(dir: &Path) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    let cert = dir.join("cert.pem");
    let key = dir.join("key.pem");
    if cert.exists() && key.exists() {
        return Ok((cert, key));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let made = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
        .context("cannot generate the SQL TLS certificate")?;
    crate::identity::write_private(&key, made.key_pair.serialize_pem().as_bytes())?;
    std::fs::write(&cert, made.cert.pem())
        .with_context(|| format!("cannot write {}", cert.display()))?;
    Ok((cert, key))
}
