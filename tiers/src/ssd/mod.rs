//! The SSD tier: record format, segment space, the tier's policy (`tier`: placement, durability,
//! group commit, tombstones, reclaim), recovery scan, the disk I/O trait and its simulator, and
//! the data directory on a real file system.
//!
//! Owns everything about a shard's bytes on SSD except which object they belong to. Never
//! performs I/O on its own (sans-I/O): it describes reads and writes; the shard loop executes
//! them on io_uring or on the simulator.

pub mod disk;
pub mod files;
pub mod record;
pub mod recovery;
pub mod segments;
pub mod sim;
pub mod tier;

pub use disk::{DiskCompletion, DiskIo, DiskOp, DiskOpKind, FileId};
pub use files::{DataDir, DataDirError, RecordedLayout, ShardFiles};
pub use record::{RecordError, RecordKind, BLOCK_BYTES};
pub use recovery::{scan_segment, Discarded, FoundRecord, SegmentScan};
pub use segments::{Append, AppendError, SegmentTable, SsdLocation};
pub use sim::{SimDisk, SimFaults, SimRng};
pub use tier::{
    IoFailure, LoadFailure, Placement, Recovered, SsdTier, TierConfig, TierCounters, TierEvent, TombstoneRefused,
};
