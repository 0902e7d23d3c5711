//! Shared-token authentication for TCP clients: a challenge-response in both directions with
//! HMAC-SHA256, so the token itself never crosses the wire and each side proves it knows it.
//!
//! client -> Hello(client_nonce); owner -> HelloOk(server_nonce);
//! client -> Auth(HMAC(token, "kvtide-v1 client" | server_nonce | client_nonce));
//! owner verifies in constant time -> AuthOk(HMAC(token, "kvtide-v1 owner" | client_nonce | server_nonce));
//! the client verifies that in constant time too.
//!
//! It owns token files (reading, creating with mode 0600). It never logs or prints a token.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::protocol::{MAC_BYTES, NONCE_BYTES};

type HmacSha256 = Hmac<Sha256>;

/// Shortest token accepted.
pub const MIN_TOKEN_BYTES: usize = 16;

/// A shared secret. Its `Debug` output is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<{} bytes, redacted>)", self.0.len())
    }
}

impl Token {
    /// A token from bytes (surrounding whitespace is ignored); at least 16 bytes.
    pub fn new(bytes: &[u8]) -> Result<Token, String> {
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < MIN_TOKEN_BYTES {
            return Err(format!("a token needs at least {MIN_TOKEN_BYTES} bytes, got {}", trimmed.len()));
        }
        Ok(Token(trimmed.to_vec()))
    }

    /// Reads a token file.
    pub fn from_file(path: &Path) -> Result<Token, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
        Token::new(&bytes).map_err(|e| format!("token file {}: {e}", path.display()))
    }

    /// Reads `path`, or creates it (mode 0600) with 32 random bytes in hex when it is missing.
    /// Returns the token and whether it was created.
    pub fn load_or_create(path: &Path) -> Result<(Token, bool), String> {
        if path.exists() {
            return Token::from_file(path).map(|t| (t, false));
        }
        let mut raw = [0u8; 32];
        super::sock::random_bytes(&mut raw).map_err(|e| format!("getrandom: {e}"))?;
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| format!("cannot create token file {}: {e}", path.display()))?;
        writeln!(file, "{hex}").map_err(|e| format!("cannot write token file {}: {e}", path.display()))?;
        Ok((Token(hex.into_bytes()), true))
    }

    fn mac(&self, label: &[u8], first: &[u8; NONCE_BYTES], second: &[u8; NONCE_BYTES]) -> HmacSha256 {
        // HMAC takes keys of any length, so this cannot fail.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!());
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }

    /// The client's proof.
    pub(crate) fn client_proof(
        &self,
        server_nonce: &[u8; NONCE_BYTES],
        client_nonce: &[u8; NONCE_BYTES],
    ) -> [u8; MAC_BYTES] {
        self.mac(b"kvtide-v1 client", server_nonce, client_nonce).finalize().into_bytes().into()
    }

    /// Checks the client's proof in constant time.
    pub(crate) fn verify_client(
        &self,
        server_nonce: &[u8; NONCE_BYTES],
        client_nonce: &[u8; NONCE_BYTES],
        proof: &[u8; MAC_BYTES],
    ) -> bool {
        self.mac(b"kvtide-v1 client", server_nonce, client_nonce).verify_slice(proof).is_ok()
    }

    /// The owner's proof.
    pub(crate) fn owner_proof(
        &self,
        client_nonce: &[u8; NONCE_BYTES],
        server_nonce: &[u8; NONCE_BYTES],
    ) -> [u8; MAC_BYTES] {
        self.mac(b"kvtide-v1 owner", client_nonce, server_nonce).finalize().into_bytes().into()
    }

    /// Checks the owner's proof in constant time.
    pub(crate) fn verify_owner(
        &self,
        client_nonce: &[u8; NONCE_BYTES],
        server_nonce: &[u8; NONCE_BYTES],
        proof: &[u8; MAC_BYTES],
    ) -> bool {
        self.mac(b"kvtide-v1 owner", client_nonce, server_nonce).verify_slice(proof).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_token() {
        let a = Token::new(b"0123456789abcdef0123").expect("token");
        let b = Token::new(b"0123456789abcdef0124").expect("token");
        let (sn, cn) = ([1u8; 32], [2u8; 32]);
        let proof = a.client_proof(&sn, &cn);
        assert!(a.verify_client(&sn, &cn, &proof));
        assert!(!b.verify_client(&sn, &cn, &proof));
        assert!(!a.verify_client(&cn, &sn, &proof));
        let owner = a.owner_proof(&cn, &sn);
        assert!(a.verify_owner(&cn, &sn, &owner));
        assert!(!a.verify_client(&sn, &cn, &owner), "client and owner proofs differ");
        assert!(Token::new(b"short").is_err());
        assert!(!format!("{a:?}").contains("0123"));
    }
}
