//! kvtide-tiers: where kvtide's bytes rest.
//!
//! Owns the DRAM arena (one mmap, split into per-shard slices), the O(1) offset allocator
//! that carves a slice, the eviction policies that choose what leaves DRAM, and the SSD tier
//! (`ssd`): the sans-I/O `SsdTier` (placement, durability, group commit, reclaim, tombstones),
//! record format, segment table, data directory, recovery scan and the seeded simulated disk.
//! It never reaches up into the engine: it knows offsets, sizes, entry ids and opaque owner
//! tokens, not keys' meaning, leases or requests.

// One phase per function: clippy.toml sets the limit (100 lines).
#![warn(clippy::too_many_lines)]

pub mod dram;
pub mod eviction;
pub mod ssd;
