//! kvtide-tiers: where kvtide's bytes rest.
//!
//! Owns the DRAM arena (one mmap, split into per-shard slices), the O(1) offset allocator
//! that carves a slice, and the eviction policies that choose what leaves DRAM. It never
//! reaches up into the engine: it knows offsets, sizes and entry ids, not keys' meaning,
//! leases or requests. The SSD tier (`ssd`) keeps what leaves DRAM: record format, segment space, durability, recovery.

pub mod dram;
pub mod eviction;
pub mod ssd;
