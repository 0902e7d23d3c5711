//! kvtide-transport: how kvtide's bytes move.
//!
//! Owns the typed memory regions that say where bytes come from or go to, the transfer
//! descriptors, and the `Transport` trait with its implementations: CPU copies (`memcpy`), the
//! CUDA transport (feature `cuda`; GPU memory), and `Throttled`, a paced decorator for
//! benchmarks. It never looks up objects or takes leases: the engine hands it regions it has
//! already validated and keeps the host bytes valid until each submission completed.

#![warn(clippy::too_many_lines)]

pub mod cuda;
pub mod inflight;
pub mod memcpy;
pub mod region;
pub mod stream;
pub mod transfer;
pub mod transport;

pub use inflight::{InFlight, Progress};
pub use memcpy::{copy_regions, MemcpyTransport};
pub use region::{MemoryKind, Region, RegionError};
pub use stream::{Gate, StreamHandle, StreamSignal, StreamSubmit};
pub use transfer::{Direction, Piece, Summary, Transfer};
pub use transport::{EarlyStart, Parts, PartsHint, Throttled, Transport, Unreachable};

/// Errors a transport reports for one descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The region is GPU memory and this build or machine has no CUDA.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(&'static str),
    /// A descriptor named bytes outside its regions.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// A CUDA call failed (the driver's error name in `detail`).
    #[error("{op} failed: {detail}")]
    Cuda { op: &'static str, detail: String },
    /// A device region is not memory of the GPU it claims (checked with cuPointerGetAttributes).
    #[error("device range [{addr:#x}, +{len}) rejected: {why}")]
    DevicePointer { addr: u64, len: u64, why: String },
    /// No GPU with this ordinal.
    #[error("no CUDA device with ordinal {ordinal}")]
    NoSuchDevice { ordinal: u32 },
    /// The link or device a transport moves bytes over failed (a socket, a NIC, a test's
    /// injected fault).
    #[error("transfer failed: {0}")]
    Io(String),
    /// The caller's stream is being captured into a graph: stream-bound reads are enqueued
    /// outside capture (the graph waits on events recorded after them).
    #[error("the stream is being captured into a CUDA graph ({0}): enqueue kvtide reads outside capture and wait on their events in the graph")]
    StreamCapturing(&'static str),
    /// The caller's stream cannot carry this transfer (another GPU's memory, an unknown
    /// context, a stream the driver rejects).
    #[error("stream {stream:#x} cannot carry the copies: {why}")]
    Stream { stream: u64, why: String },
    /// A step's completion signal that cannot be enqueued (`StreamSignal`).
    #[error("bad stream signal: {0}")]
    Signal(String),
}
