//! kvtide: a storage engine for LLM KV cache.
//!
//! Inference workers save KV blocks into it and load them back (into host buffers, or GPU pages
//! through the CUDA transport, feature `cuda`) when a prompt prefix is reused. Shard-per-core
//! executors each own an io_uring ring, a slice of one DRAM arena and their part of the index;
//! callers batch one message per shard and move bytes themselves, through the transports, under
//! leases the shards grant. The owner process and remote clients live in crate `kvtide-remote`.
//!
//! ```no_run
//! use kvtide::{PutOptions, Region, Store, StoreBuilder};
//! let store = StoreBuilder::new().dram_bytes(256 << 20).open()?;
//! store.put(b"layer0/block7", &[1u8; 4096], PutOptions::INSERT)?;
//! let mut page = vec![0u8; 4096];
//! store.get_into(b"layer0/block7", Region::host(&mut page))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(clippy::too_many_lines)]

mod api;
pub mod checks;
mod chunks;
mod completion;
mod config;
mod engine;
mod error;
pub mod settings;
mod shard;
mod stats;
mod step;
mod ticket;

pub use api::{BatchTicket, Fragment, KeyPage, PutOptions, Store, MAX_SCAN_KEYS};
pub use chunks::{
    check_chunk_count, chunk_count, chunk_pair, cut as cut_chunks, ChunkHandle, ChunkPlace, ChunkSink, ChunkState,
    HandleStatus, MAX_CHUNKS,
};
pub use completion::Completion;
pub use config::{parse_bytes, DramGroup, GpuGroup, RestoreGroup, RuntimeGroup, SsdGroup, StoreBuilder, StreamGroup};
pub use engine::{
    shard_of_key, Engine, Following, LandingLeases, LeasePart, LeasePlan, ObjectLease, PendingPut, PendingPuts,
    PutStream, RestoreMode, RestoreOptions, RestoreReport, StreamCompleter, StreamStatus, StreamTicket, SubBatchState,
    SubBatchTrace,
};
pub use error::{Error, OpenError, Result};
pub use kvtide_tiers::eviction::EvictionPolicy;
pub use kvtide_tiers::ssd::SimFaults;
/// The transports (the `Transport` trait, transfer descriptors, CPU copies, pacing).
pub use kvtide_transport as transport;
/// The CUDA transport (device buffers for tests and benchmarks, fault hooks), feature `cuda`.
#[cfg(feature = "cuda")]
pub use kvtide_transport::cuda;
pub use kvtide_transport::{
    MemcpyTransport, MemoryKind, Region, RegionError, StreamHandle, StreamSignal, Throttled, Transport,
};
pub use shard::core::RecoveryReport;
pub use stats::{GpuStats, HeldResources, RestoreStats, ShardStats, Stats, StreamStats};
pub use step::{check as check_step, StepLayer, StepReads, MAX_STEP_LAYERS};
pub use ticket::Ticket;
