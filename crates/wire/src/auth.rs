//! Mutual authentication of inter-node connections with a shared cluster secret.
//!
//! Each side sends a fresh random nonce, then proves knowledge of the secret with
//! `HMAC-SHA256(secret, "pgmr-auth-v1" | role | own nonce | peer nonce)`. The role (dialer or
//! acceptor) is part of the MAC so a proof cannot be reflected back at its sender, and both
//! nonces are, so it cannot be replayed on another connection. The secret never crosses the
//! wire. Confidentiality (TLS) is layered on later; see docs/ARCHITECTURE.md.

use hmac::{Hmac, Mac};
use sha2::Sha256;

const LABEL: &[u8] = b"pgmr-auth-v1";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Dialer,
    Acceptor,
}

impl Role {
    fn tag(self) -> &'static [u8] {
        match self {
            Role::Dialer => b"dialer",
            Role::Acceptor => b"acceptor",
        }
    }
}

fn mac(secret: &[u8], role: Role, own: &[u8], peer: &[u8]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    for part in [LABEL, role.tag(), own, peer] {
        m.update(&(part.len() as u32).to_be_bytes());
        m.update(part);
    }
    m
}

/// The proof this side (`role`) sends.
pub fn prove(secret: &[u8], role: Role, own_nonce: &[u8], peer_nonce: &[u8]) -> String {
    to_hex(
        &mac(secret, role, own_nonce, peer_nonce)
            .finalize()
            .into_bytes(),
    )
}

/// Checks the proof sent by the peer, whose role is `peer_role`, in constant time.
pub fn verify(
    secret: &[u8],
    peer_role: Role,
    peer_nonce: &[u8],
    own_nonce: &[u8],
    proof_hex: &str,
) -> bool {
    match from_hex(proof_hex) {
        Some(bytes) => mac(secret, peer_role, peer_nonce, own_nonce)
            .verify_slice(&bytes)
            .is_ok(),
        None => false,
    }
}

pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_role_and_nonces() {
        let (a, b) = (b"nonce-a".as_slice(), b"nonce-b".as_slice());
        let p = prove(b"s3cret", Role::Dialer, a, b);
        assert!(verify(b"s3cret", Role::Dialer, a, b, &p));
        assert!(!verify(b"other", Role::Dialer, a, b, &p), "wrong secret");
        assert!(
            !verify(b"s3cret", Role::Acceptor, a, b, &p),
            "reflected proof"
        );
        assert!(
            !verify(b"s3cret", Role::Dialer, a, b"nonce-c", &p),
            "replayed proof"
        );
        assert!(!verify(b"s3cret", Role::Dialer, a, b, "zz"), "garbage");
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(
            from_hex(&to_hex(&[0, 1, 254, 255])),
            Some(vec![0, 1, 254, 255])
        );
        assert_eq!(from_hex("abc"), None);
    }
}
