//! Shared-token authentication for TCP clients: a challenge-response in both directions with
//! HMAC-SHA256, so the token itself never crosses the wire and each side proves it knows it.
//!
//! client -> Hello(client_nonce); owner -> HelloOk(server_nonce);
//! client -> Auth(HMAC(token, "kvtide-v1 client" | server_nonce | client_nonce));
//! owner verifies in constant time -> AuthOk(HMAC(token, "kvtide-v1 owner" | client_nonce | server_nonce));
//! the client verifies that in constant time too.
//!
//! It owns token files (reading, warning when others can read one, creating with mode 0600). It
//! never logs or prints a token.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::protocol::{MAC_BYTES, NONCE_BYTES};

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

    /// Reads a token file, with a warning when users other than its owner may read or change it.
    pub fn from_file(path: &Path) -> Result<Token, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
        let token = Token::new(&bytes).map_err(|e| format!("token file {}: {e}", path.display()))?;
        if let Some(mode) = loose_mode(path) {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{mode:04o}"),
                "the token file is open to other users (they can read the token); chmod 600 it"
            );
        }
        Ok(token)
    }

    /// Reads `path`, or creates it (mode 0600) with 32 random bytes in hex when it is missing.
    /// Returns the token and whether it was created.
    pub fn load_or_create(path: &Path) -> Result<(Token, bool), String> {
        if path.exists() {
            return Token::from_file(path).map(|t| (t, false));
        }
        let mut raw = [0u8; 32];
        crate::sock::random_bytes(&mut raw).map_err(|e| format!("getrandom: {e}"))?;
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

/// The permission bits of `path` when its group or others have any access to it.
fn loose_mode(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o7777;
    (mode & 0o077 != 0).then_some(mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Log lines written while `f` runs.
    fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
        #[derive(Clone, Default)]
        struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Sink {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || writer.clone()).finish();
        let out = tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8_lossy(&sink.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
        (out, text)
    }

    #[test]
    fn a_token_file_open_to_others_is_used_with_a_warning() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kvtide-token-mode-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("token");
        std::fs::write(&path, "0123456789abcdef0123\n").expect("write");
        for (mode, warned) in [(0o644, true), (0o640, true), (0o600, false), (0o400, false)] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            let (token, log) = logged(|| Token::from_file(&path));
            assert!(token.is_ok());
            assert_eq!(log.contains("open to other users"), warned, "mode {mode:o}: {log:?}");
            assert!(!log.contains("0123456789abcdef"), "the token is never logged");
        }
        // The owner's path (an existing file) warns too.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let (loaded, log) = logged(|| Token::load_or_create(&path));
        assert!(loaded.is_ok_and(|(_, created)| !created));
        assert!(log.contains("open to other users") && log.contains("0644"), "{log:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

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
