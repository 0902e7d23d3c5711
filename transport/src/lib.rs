//! kvtide-transport: how kvtide's bytes move.
//!
//! Owns the typed memory regions that say where bytes come from or go to, and the transfer
//! descriptors a transport executes. Today that is the same-process memcpy transport; CUDA, TCP,
//! shared memory and RDMA join it behind features. It never looks up objects or takes leases: the
//! engine hands it regions it has already validated and protected.

pub mod memcpy;
pub mod region;

pub use memcpy::{copy_regions, MemcpyTransport};
pub use region::{MemoryKind, Region, RegionError};

/// Errors a transport reports for one descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The region is GPU memory and this build or machine has no CUDA.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(&'static str),
    /// A descriptor named bytes outside its regions.
    #[error(transparent)]
    Region(#[from] RegionError),
}
