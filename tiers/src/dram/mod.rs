//! The DRAM tier: the arena (memory), its per-shard slices and the allocator that carves them.

pub mod alloc;
pub mod arena;
pub mod read_index;

pub use alloc::{AllocError, AllocStats, Allocation, OffsetAllocator};
pub use arena::{Arena, ArenaError, ArenaSlice, MemoryRegistrar, PageBacking, RegistrationHandle};
