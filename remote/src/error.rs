//! The remote store's error. Owns the failures only a connection has (the owner went away, a
//! deadline passed, the token or protocol did not match, the owner reported something this side
//! has no variant for); never duplicates a `kvtide::Error` variant: those travel as `Store`.

/// A per-key or per-call failure of `RemoteStore` (and of the owner's wire checks).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// What the embedded engine would have answered (or the client's own argument checks).
    #[error(transparent)]
    Store(#[from] kvtide::Error),
    #[error("disconnected from the owner: {0}")]
    Disconnected(String),
    #[error("{op} timed out after {timeout_ms} ms")]
    Timeout { op: &'static str, timeout_ms: u64 },
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    #[error("protocol version mismatch: this side speaks version {ours}, the peer speaks {theirs}")]
    ProtocolVersion { ours: u16, theirs: u16 },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("the owner reported: {0}")]
    Remote(String),
}

impl Error {
    /// The engine's error, when this is one.
    pub fn as_store(&self) -> Option<&kvtide::Error> {
        match self {
            Error::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl PartialEq<kvtide::Error> for Error {
    fn eq(&self, other: &kvtide::Error) -> bool {
        self.as_store() == Some(other)
    }
}

impl From<kvtide_transport::RegionError> for Error {
    fn from(e: kvtide_transport::RegionError) -> Self {
        Error::Store(e.into())
    }
}

/// Result of one key or one call.
pub type Result<T, E = Error> = std::result::Result<T, E>;
