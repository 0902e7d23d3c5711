//! Typed errors. One enum for per-key results (what users match on) and one for opening a store.
//! Owns the variants and their conversion from transport errors; never logs or retries.

use kvtide_transport::{RegionError, TransportError};

/// A per-key or per-call failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("key not found")]
    NotFound,
    #[error("key already exists (use PutOptions::upsert to replace it)")]
    AlreadyExists,
    #[error("no space: every evictable byte is gone and the rest is leased, pinned or being written")]
    NoSpace,
    #[error("{what} is {len} bytes, the limit is {max}")]
    TooLarge { what: &'static str, len: u64, max: u64 },
    #[error("keys must not be empty")]
    EmptyKey,
    #[error("invalid range: {0}")]
    InvalidRange(#[from] RegionError),
    #[error("destination sizes add up to {destination_bytes} bytes but the object is {object_bytes} bytes")]
    SizeMismatch { object_bytes: u64, destination_bytes: u64 },
    #[error("destination is {buffer_bytes} bytes but the object is {object_bytes} bytes")]
    BufferTooSmall { object_bytes: u64, buffer_bytes: u64 },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("corrupted on SSD: {0} (the object was dropped)")]
    Corrupted(String),
    #[error("I/O error: {0}")]
    Io(String),
    #[error("the explicit lease passed its TTL; its bytes may have been reused")]
    LeaseExpired,
    #[error("object is leased by an in-flight read (pass force to remove it anyway)")]
    Leased,
    #[error("object is pinned (unpin it, or pass force to remove it anyway)")]
    Pinned,
    #[error("object is not pinned")]
    NotPinned,
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(&'static str),
    #[error("GPU transfer failed: {0}")]
    Cuda(String),
    /// A bound was reached: requests or tickets in flight, connection slots, leases per
    /// connection, or buffered request bytes (`limit` is that bound's value).
    #[error(
        "busy: a limit of {limit} was reached (requests in flight, connections, leases or buffered request \
         bytes); retry later"
    )]
    Busy { limit: usize },
    #[error("the request was cancelled")]
    Cancelled,
    /// The progressive put a reader followed ended without a seal: its producer aborted,
    /// dropped its stream, disconnected, or let its unsealed TTL pass.
    #[error("the producer of this object stopped before sealing it: {0}")]
    ProducerAborted(String),
    #[error("the store is shutting down")]
    ShuttingDown,
    /// A stream-bound read was given a stream that is being captured into a CUDA graph (`active`
    /// or `invalidated`): enqueue the reads outside capture, record an event after each, and let
    /// the graph wait on those events.
    #[error(
        "the stream is being captured into a CUDA graph ({0}): enqueue kvtide reads outside capture and wait on \
         their events in the graph"
    )]
    StreamCapturing(&'static str),
    /// The stream of a stream-bound read cannot carry its copies (an unknown or destroyed
    /// stream, another GPU's stream or context).
    #[error("stream rejected: {0}")]
    Stream(String),
    /// The stream did not pass a stream-bound read's copies within `[gpu] stream_ttl_ms`: its
    /// leases were released, so the bytes it still copies may be wrong.
    #[error("the stream did not pass this read's copies within {ttl_ms} ms; its leases were released")]
    StreamExpired { ttl_ms: u64 },
    #[error("the engine broke an internal invariant: {0}")]
    Internal(&'static str),
}

impl From<TransportError> for Error {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::CudaUnavailable(why) => Error::CudaUnavailable(why),
            TransportError::Region(r) => Error::InvalidRange(r),
            TransportError::Cuda { .. } => Error::Cuda(e.to_string()),
            TransportError::Io(detail) => Error::Io(detail),
            TransportError::DevicePointer { .. } | TransportError::NoSuchDevice { .. } => {
                Error::InvalidArgument(e.to_string())
            }
            TransportError::StreamCapturing(how) => Error::StreamCapturing(how),
            TransportError::Stream { .. } => Error::Stream(e.to_string()),
            TransportError::Signal(_) => Error::InvalidArgument(e.to_string()),
        }
    }
}

/// Result of one key or one call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("could not read config file {path}: {source}")]
    ConfigFile { path: String, source: std::io::Error },
    #[error(transparent)]
    Arena(#[from] kvtide_tiers::dram::ArenaError),
    #[error(transparent)]
    Alloc(#[from] kvtide_tiers::dram::AllocError),
    #[error(transparent)]
    DataDir(#[from] kvtide_tiers::ssd::DataDirError),
    #[error("could not start shard {shard}: {source}")]
    Shard { shard: usize, source: std::io::Error },
}
