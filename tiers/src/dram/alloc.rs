//! Offset allocator for one shard's slice of the DRAM arena: TLSF (two-level segregated fit).
//!
//! Owns: the bookkeeping of which byte ranges of a slice `[0, capacity)` are free. Offsets are
//! relative to the slice. It hands out offsets and lengths only. A live allocation is its own
//! record ([`Allocation`]: offset and length in 8 bytes, kept by the caller); the allocator keeps
//! nothing per live allocation, only a node per free block (hole).
//!
//! Must never: read, write, map or register the memory it describes; panic or unwrap on a
//! run-time path (misuse is caught by `debug_assert!` and ignored in release builds); do work
//! proportional to the number of blocks in `allocate` or `free` (beyond the amortised growth of
//! the boundary table, which grows with the number of holes).
//!
//! Why TLSF: KV objects range from 4 KiB to hundreds of MiB and come and go under load. TLSF gives
//! O(1) allocate and free (two bitmap scans, no list walks) for any mix of sizes, bounded
//! fragmentation (good fit within size classes 1/16 of a power of two wide, and free neighbours
//! are merged at once), and it works on offsets, so all metadata lives out of band on the
//! ordinary heap. The arena therefore stays pure data: it can be registered for DMA as a whole
//! and no device or peer write can corrupt allocator headers. The design follows Sebastian
//! Aaltonen's OffsetAllocator, widened to `u64` sizes, except that used blocks have no node: a
//! freed range finds its free neighbours through a hash table of the free blocks' boundaries
//! (where each starts and where each ends), so an index of millions of small objects pays
//! nothing here per object.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::num::NonZeroU32;

/// Second-level subdivisions per power of two: 16 linear classes, so a good-fit search skips at
/// most 1/16 of a power of two worth of candidates.
const SL_LOG2: u32 = 4;
const SL_COUNT: usize = 1 << SL_LOG2;
/// First level = floor(log2(units)) - SL_LOG2 + 1, at most 60 for `u64` sizes: one `u64` bitmap.
const FL_COUNT: usize = 64;
const BIN_COUNT: usize = FL_COUNT * SL_COUNT;
/// "No node" in the intrusive links. Node indices therefore stop at `u32::MAX - 1`.
const NIL: u32 = u32::MAX;
/// When the good-fit bin search fails, look at this many blocks of the request's own bin before
/// giving up. A constant bound, so `allocate` stays O(1); it lets e.g. an allocation of the
/// whole capacity succeed on an empty allocator, which pure good fit would refuse.
const FALLBACK_SCAN: usize = 8;

/// Capacities are below this.
const MAX_CAPACITY: u64 = 1 << 62;
/// Offsets and sizes count in units (the alignment, or coarser for a huge capacity) in 32 bits;
/// a node keeps its state in the top two bits of its offset: at most 2^30 units.
const UNITS_LOG2: u32 = 30;
const OFFSET_MASK: u32 = (1 << UNITS_LOG2) - 1;
/// Marks a boundary-table key as a block's end (offsets and ends are at most 2^30 units).
const END_KEY: u32 = 1 << 31;

/// Why an [`OffsetAllocator`] could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// `align_bytes` is not a power of two, or is below 8.
    #[error("align_bytes must be a power of two >= 8, got {0}")]
    BadAlign(u64),
    /// After rounding `capacity_bytes` down to `align_bytes`, nothing is left.
    #[error("capacity of {capacity_bytes} bytes holds no whole {align_bytes}-byte unit")]
    ZeroCapacity {
        /// Capacity as given.
        capacity_bytes: u64,
        /// Alignment as given.
        align_bytes: u64,
    },
    /// `capacity_bytes` is 2^62 or more.
    #[error("capacity of {0} bytes is too large (at most 2^62 - 1)")]
    CapacityTooLarge(u64),
    /// `max_allocations` is 0: the allocator could never hand anything out.
    #[error("max_allocations must be at least 1")]
    ZeroMaxAllocations,
    /// The node table (reserved up front so `allocate` never reallocates) did not fit in memory.
    #[error("could not reserve the allocator node table ({nodes} nodes)")]
    NodeTable {
        /// Nodes that were to be reserved.
        nodes: u64,
    },
}

/// One live allocation: its offset and length in the allocator's units (8 bytes, so an object
/// record can hold one cheaply); [`OffsetAllocator::offset_of`] and [`OffsetAllocator::len_of`]
/// say where it is in bytes. Not Clone/Copy: freeing it consumes it, so a double free cannot
/// compile.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "dropping an Allocation leaks its bytes; pass it to OffsetAllocator::free"]
pub struct Allocation {
    offset: u32,
    units: NonZeroU32,
}

/// A snapshot of an allocator's accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Bytes managed (the constructor's capacity rounded down to the alignment).
    pub capacity_bytes: u64,
    /// Bytes reserved by live allocations (rounded sizes).
    pub used_bytes: u64,
    /// `capacity_bytes - used_bytes`.
    pub free_bytes: u64,
    /// Exact size of the largest free block (0 when none). Note: `allocate` uses good fit, so a
    /// request of exactly this size is not guaranteed to succeed when several blocks share its
    /// size class; a request no larger than the lower bound of that class always does.
    pub largest_free_bytes: u64,
    /// Live allocations.
    pub allocations: u64,
    /// Free blocks. Neighbouring free blocks are always merged, so this is the number of holes.
    pub free_blocks: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeState {
    /// A free block, linked into its bin's free list.
    Free,
    /// Not a block: on the spare-node stack (linked through `next_free`).
    Spare,
}

impl NodeState {
    /// The state's bits in `Node::offset_state`.
    const fn bits(self) -> u32 {
        (match self {
            NodeState::Free => 0u32,
            NodeState::Spare => 1,
        }) << UNITS_LOG2
    }
}

/// One free block, or a spare node. 16 bytes; the table holds one per hole.
#[derive(Clone, Copy, Debug)]
struct Node {
    /// The block's offset in units (low 30 bits) and its [`NodeState`] (top two bits).
    offset_state: u32,
    /// The block's size in units.
    size: u32,
    prev_free: u32,
    next_free: u32,
}

impl Node {
    const SPARE: Node = Node { offset_state: NodeState::Spare.bits(), size: 0, prev_free: NIL, next_free: NIL };

    /// A free block's node outside any list (offset and size in units).
    fn free_block(offset: u32, size: u32) -> Node {
        debug_assert!(offset <= OFFSET_MASK);
        Node { offset_state: offset | NodeState::Free.bits(), size, ..Node::SPARE }
    }

    /// The block's offset in units.
    fn offset(&self) -> u32 {
        self.offset_state & OFFSET_MASK
    }

    /// Where the block ends, in units (at most 2^30).
    fn end(&self) -> u32 {
        self.offset() + self.size
    }

    fn state(&self) -> NodeState {
        match self.offset_state >> UNITS_LOG2 {
            0 => NodeState::Free,
            _ => NodeState::Spare,
        }
    }
}

/// The boundary table's key for a free block starting at `offset` units.
fn start_key(offset: u32) -> u32 {
    offset
}

/// The boundary table's key for a free block ending at `end` units.
fn end_key(end: u32) -> u32 {
    end | END_KEY
}

/// Hashes the boundary table's `u32` keys with one multiplication (Fibonacci hashing, the high
/// half folded into the low one, where the table takes its bucket index from).
#[derive(Default)]
struct BoundaryHasher(u64);

impl Hasher for BoundaryHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u32(u32::from(b) ^ (self.0 as u32).rotate_left(8));
        }
    }

    fn write_u32(&mut self, n: u32) {
        let x = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 32);
    }
}

/// Free blocks' starts and ends (see [`start_key`], [`end_key`]) to their nodes.
type Boundaries = HashMap<u32, u32, BuildHasherDefault<BoundaryHasher>>;

/// Bin holding free blocks of `units` (rounded down: every block in the bin is at least the
/// bin's lower bound). `units` must be > 0.
#[inline]
fn bin_floor(units: u64) -> (usize, usize) {
    debug_assert!(units > 0);
    if units < SL_COUNT as u64 {
        return (0, units as usize);
    }
    let log2 = 63 - units.leading_zeros();
    let shift = log2 - SL_LOG2;
    let fl = (shift + 1) as usize;
    let sl = ((units >> shift) as usize) & (SL_COUNT - 1);
    (fl, sl)
}

/// First bin whose every block holds `units`: `units` rounded up to the next bin boundary.
#[inline]
fn bin_ceil(units: u64) -> (usize, usize) {
    if units < SL_COUNT as u64 {
        return (0, units as usize);
    }
    let log2 = 63 - units.leading_zeros();
    let step = 1u64 << (log2 - SL_LOG2);
    bin_floor(units.saturating_add(step - 1))
}

/// O(1) offset allocator over `[0, capacity)`; see the module docs.
pub struct OffsetAllocator {
    capacity: u64,
    /// The unit of every offset and size: `align_bytes` as given, or coarser when the capacity
    /// holds more than 2^30 of those (offsets count in 30 bits).
    align: u64,
    align_log2: u32,
    max_allocations: u32,
    /// Nodes never exceed this: free blocks are never adjacent, so there are at most
    /// `max_allocations + 1` of them.
    node_limit: usize,
    /// Reserved to `node_limit` up front, so pushes never reallocate.
    nodes: Vec<Node>,
    /// Top of the spare-node stack, linked through `Node::next_free`.
    spare_head: u32,
    /// Where each free block starts and ends, to its node: how a freed range finds its free
    /// neighbours. Two entries per hole.
    boundaries: Boundaries,
    /// Bit `fl` set iff `sl_bitmaps[fl] != 0`.
    fl_bitmap: u64,
    /// Bit `sl` of `sl_bitmaps[fl]` set iff bin (fl, sl) has a free block.
    sl_bitmaps: [u16; FL_COUNT],
    /// Head of each bin's doubly linked free list.
    bin_heads: Box<[u32]>,
    used_bytes: u64,
    allocations: u32,
    free_blocks: u32,
    /// Live allocations (offset to units), in debug builds only: catches frees of allocations
    /// that are not live here, and lets `check_invariants` see that blocks tile the capacity.
    #[cfg(debug_assertions)]
    live: HashMap<u32, u32>,
}

impl fmt::Debug for OffsetAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OffsetAllocator")
            .field("align_bytes", &self.align)
            .field("max_allocations", &self.max_allocations)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl OffsetAllocator {
    /// Builds an allocator over `[0, capacity_bytes)`.
    ///
    /// `align_bytes` must be a power of two >= 8. A capacity of more than 2^30 such units
    /// coarsens the unit to the smallest power of two that fits (so a 64 GiB slice at 64-byte
    /// alignment keeps 64 bytes, a 1 TiB one gets 1 KiB): [`Self::align_bytes`] says which.
    /// `capacity_bytes` is rounded DOWN to the unit. `max_allocations` bounds live allocations
    /// (and so the node table, `max + 1` nodes of 16 bytes reserved up front, of which only as
    /// many as there are holes are ever touched). `allocate` returns `None` past it.
    pub fn new(capacity_bytes: u64, align_bytes: u64, max_allocations: u32) -> Result<Self, AllocError> {
        if !align_bytes.is_power_of_two() || align_bytes < 8 {
            return Err(AllocError::BadAlign(align_bytes));
        }
        if capacity_bytes >= MAX_CAPACITY {
            return Err(AllocError::CapacityTooLarge(capacity_bytes));
        }
        // The smallest unit, no finer than asked, in which the capacity is at most 2^30 units.
        let mut align_log2 = align_bytes.trailing_zeros();
        while capacity_bytes >> align_log2 > 1 << UNITS_LOG2 {
            align_log2 += 1;
        }
        let unit = 1u64 << align_log2;
        let capacity = capacity_bytes & !(unit - 1);
        if capacity == 0 {
            return Err(AllocError::ZeroCapacity { capacity_bytes, align_bytes });
        }
        let capacity_units =
            u32::try_from(capacity >> align_log2).map_err(|_| AllocError::CapacityTooLarge(capacity_bytes))?;
        debug_assert!(capacity_units <= 1 << UNITS_LOG2);
        if max_allocations == 0 {
            return Err(AllocError::ZeroMaxAllocations);
        }
        let node_limit = (u64::from(max_allocations) + 1).min(u64::from(NIL));
        let mut nodes = Vec::new();
        nodes.try_reserve_exact(node_limit as usize).map_err(|_| AllocError::NodeTable { nodes: node_limit })?;
        let mut this = Self {
            capacity,
            align: unit,
            align_log2,
            max_allocations,
            node_limit: node_limit as usize,
            nodes,
            spare_head: NIL,
            boundaries: Boundaries::default(),
            fl_bitmap: 0,
            sl_bitmaps: [0; FL_COUNT],
            bin_heads: vec![NIL; BIN_COUNT].into_boxed_slice(),
            used_bytes: 0,
            allocations: 0,
            free_blocks: 0,
            #[cfg(debug_assertions)]
            live: HashMap::new(),
        };
        this.nodes.push(Node::free_block(0, capacity_units));
        this.boundaries.insert(start_key(0), 0);
        this.boundaries.insert(end_key(capacity_units), 0);
        this.link_free(0);
        Ok(this)
    }

    /// Reserves `size_bytes` rounded up to `align_bytes`. O(1).
    ///
    /// Returns `None` when `size_bytes` is 0 (there is no empty allocation), when no free block
    /// is large enough, or when `max_allocations` allocations are live. Uses good fit: it takes
    /// the first block of the smallest size class whose every block is large enough (the
    /// request rounded up to a class boundary, at most 1/16 larger), then looks at a few
    /// blocks of the request's own class. So it always succeeds when some free block is at
    /// least that rounded size, but may refuse when the only blocks that fit share the
    /// request's class and are not among the few it looks at. The allocation is the front of
    /// the block found; the rest stays free in the block's node.
    #[must_use = "dropping an Allocation leaks its bytes; pass it to OffsetAllocator::free"]
    pub fn allocate(&mut self, size_bytes: u64) -> Option<Allocation> {
        if size_bytes == 0 || self.allocations >= self.max_allocations {
            return None;
        }
        let len = size_bytes.checked_add(self.align - 1)? & !(self.align - 1);
        if len > self.free_bytes() {
            return None;
        }
        // Below the capacity (checked above), so at most 2^30 units, and not zero.
        let units = NonZeroU32::new((len >> self.align_log2) as u32)?;
        let block = self.find_free_block(units.get())?;
        self.unlink_free(block);
        let b = block as usize;
        let (offset, size) = (self.nodes[b].offset(), self.nodes[b].size);
        self.boundaries.remove(&start_key(offset));
        if size > units.get() {
            let rest = offset + units.get();
            self.nodes[b] = Node::free_block(rest, size - units.get());
            self.boundaries.insert(start_key(rest), block);
            self.link_free(block);
        } else {
            self.boundaries.remove(&end_key(offset + size));
            self.release_node(block);
        }
        self.used_bytes += len;
        self.allocations += 1;
        #[cfg(debug_assertions)]
        self.live.insert(offset, units.get());
        Some(Allocation { offset, units })
    }

    /// Whether `allocation` is live here (debug builds; release builds cannot tell and say yes).
    fn is_live(&self, allocation: &Allocation) -> bool {
        #[cfg(debug_assertions)]
        return self.live.get(&allocation.offset) == Some(&allocation.units.get());
        #[cfg(not(debug_assertions))]
        {
            let _ = allocation;
            true
        }
    }

    /// Start of `allocation`, in bytes from the start of the slice; aligned to `align_bytes`.
    /// An allocation of another allocator is a caller bug (it panics in debug builds).
    pub fn offset_of(&self, allocation: &Allocation) -> u64 {
        debug_assert!(self.is_live(allocation), "OffsetAllocator::offset_of: {allocation:?} is not live here");
        u64::from(allocation.offset) << self.align_log2
    }

    /// Bytes reserved for `allocation`: the requested size rounded up to `align_bytes`. An
    /// allocation of another allocator is a caller bug (it panics in debug builds).
    pub fn len_of(&self, allocation: &Allocation) -> u64 {
        debug_assert!(self.is_live(allocation), "OffsetAllocator::len_of: {allocation:?} is not live here");
        u64::from(allocation.units.get()) << self.align_log2
    }

    /// Returns an allocation's bytes and merges them with free neighbours. O(1) (amortised: the
    /// boundary table grows with the number of holes).
    ///
    /// An allocation from another allocator (or otherwise not live here) is a caller bug: it
    /// panics in debug builds; release builds ignore what they can tell cheaply is not live (a
    /// range past the capacity, more bytes than are used).
    pub fn free(&mut self, allocation: Allocation) {
        let (offset, units) = (allocation.offset, allocation.units.get());
        let len = u64::from(units) << self.align_log2;
        let end = u64::from(offset) + u64::from(units);
        let foreign = !self.is_live(&allocation) || end > self.capacity >> self.align_log2 || len > self.used_bytes;
        if foreign {
            debug_assert!(false, "OffsetAllocator::free: {allocation:?} does not belong to this allocator");
            return;
        }
        // At most the capacity, 2^30 units (checked above).
        let end = end as u32;
        let prev = self.boundaries.get(&end_key(offset)).copied();
        let next = self.boundaries.get(&start_key(end)).copied();
        let node = match (prev, next) {
            (Some(p), Some(n)) => {
                // One block from p's start to n's end, kept in p's node.
                self.unlink_free(p);
                self.unlink_free(n);
                let n_end = self.nodes[n as usize].end();
                self.boundaries.remove(&end_key(offset));
                self.boundaries.remove(&start_key(end));
                self.boundaries.insert(end_key(n_end), p);
                self.nodes[p as usize].size = n_end - self.nodes[p as usize].offset();
                self.release_node(n);
                p
            }
            (Some(p), None) => {
                self.unlink_free(p);
                self.boundaries.remove(&end_key(offset));
                self.boundaries.insert(end_key(end), p);
                self.nodes[p as usize].size += units;
                p
            }
            (None, Some(n)) => {
                self.unlink_free(n);
                let n_end = self.nodes[n as usize].end();
                self.boundaries.remove(&start_key(end));
                self.boundaries.insert(start_key(offset), n);
                self.nodes[n as usize] = Node::free_block(offset, n_end - offset);
                n
            }
            (None, None) => {
                // Free blocks never touch, so with this one there are at most as many as live
                // allocations were before it: within the node limit.
                let Some(n) = self.take_spare_node() else {
                    debug_assert!(false, "OffsetAllocator::free: node table full");
                    return;
                };
                self.nodes[n as usize] = Node::free_block(offset, units);
                self.boundaries.insert(start_key(offset), n);
                self.boundaries.insert(end_key(end), n);
                n
            }
        };
        self.link_free(node);
        self.used_bytes -= len;
        self.allocations -= 1;
        #[cfg(debug_assertions)]
        self.live.remove(&offset);
    }

    /// Accounting snapshot. O(1) except `largest_free_bytes`; see [`Self::largest_free_bytes`].
    pub fn stats(&self) -> AllocStats {
        AllocStats {
            capacity_bytes: self.capacity,
            used_bytes: self.used_bytes,
            free_bytes: self.free_bytes(),
            largest_free_bytes: self.largest_free_bytes(),
            allocations: u64::from(self.allocations),
            free_blocks: u64::from(self.free_blocks),
        }
    }

    /// Exact size of the largest free block, 0 when there is none. Finds the highest non-empty
    /// bin with two bitmap scans (the largest block must be there), then walks that one bin's
    /// list, so the cost is the number of free blocks in the top size class. For stats, not for
    /// hot paths.
    pub fn largest_free_bytes(&self) -> u64 {
        if self.fl_bitmap == 0 {
            return 0;
        }
        let fl = (63 - self.fl_bitmap.leading_zeros()) as usize;
        let sl = (15 - self.sl_bitmaps[fl].leading_zeros()) as usize;
        let mut largest = 0;
        let mut n = self.bin_heads[fl * SL_COUNT + sl];
        while n != NIL {
            let node = &self.nodes[n as usize];
            largest = largest.max(node.size);
            n = node.next_free;
        }
        u64::from(largest) << self.align_log2
    }

    /// Bytes managed: the constructor's capacity rounded down to [`Self::align_bytes`].
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    /// Bytes reserved by live allocations (rounded sizes).
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// `capacity_bytes() - used_bytes()`; may be spread over several blocks.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.used_bytes
    }

    /// Alignment of every offset and granularity of every length: `align_bytes` as given to
    /// `new`, or coarser for a capacity of more than 2^30 of them.
    pub fn align_bytes(&self) -> u64 {
        self.align
    }

    /// Live allocations.
    pub fn allocations(&self) -> u32 {
        self.allocations
    }

    /// The bound on live allocations given to `new`.
    pub fn max_allocations(&self) -> u32 {
        self.max_allocations
    }

    /// Free blocks (holes); neighbouring free blocks are always merged.
    pub fn free_blocks(&self) -> u32 {
        self.free_blocks
    }

    /// Walks every free block, free list and boundary and checks all internal invariants: free
    /// blocks lie inside `[0, capacity)`, never overlap or touch, sit in the right bins, the
    /// bitmaps match the lists, the boundary table names exactly the free blocks' starts and ends,
    /// and the counters match (in debug builds also: live and free blocks tile the capacity).
    /// O(blocks log blocks); for tests and fuzzing.
    pub fn check_invariants(&self) -> Result<(), String> {
        let limit = self.nodes.len();
        if limit > self.node_limit {
            return Err(format!("{limit} nodes exceed the limit {}", self.node_limit));
        }
        let capacity_units = self.capacity >> self.align_log2;
        // Bins and bitmaps; every listed node is a free block with both boundaries.
        let mut blocks: Vec<(u64, u64)> = Vec::new();
        for fl in 0..FL_COUNT {
            if ((self.fl_bitmap >> fl) & 1 == 1) != (self.sl_bitmaps[fl] != 0) {
                return Err(format!("first-level bit {fl} disagrees with its second level"));
            }
            for sl in 0..SL_COUNT {
                let head = self.bin_heads[fl * SL_COUNT + sl];
                if ((self.sl_bitmaps[fl] >> sl) & 1 == 1) != (head != NIL) {
                    return Err(format!("bin ({fl},{sl}): bitmap disagrees with its list"));
                }
                let (mut n, mut prev) = (head, NIL);
                while n != NIL {
                    if blocks.len() >= limit {
                        return Err("free lists hold more nodes than the table".into());
                    }
                    let node = self.nodes.get(n as usize).ok_or_else(|| format!("free link to missing node {n}"))?;
                    if node.state() != NodeState::Free || node.prev_free != prev || node.size == 0 {
                        return Err(format!("bin ({fl},{sl}): bad node {n}: {node:?}"));
                    }
                    if bin_floor(u64::from(node.size)) != (fl, sl) {
                        return Err(format!("node {n} of {} units in wrong bin ({fl},{sl})", node.size));
                    }
                    if self.boundaries.get(&start_key(node.offset())) != Some(&n)
                        || self.boundaries.get(&end_key(node.end())) != Some(&n)
                    {
                        return Err(format!("node {n} {node:?}: its boundaries do not name it"));
                    }
                    blocks.push((u64::from(node.offset()), u64::from(node.size)));
                    prev = n;
                    n = node.next_free;
                }
            }
        }
        if blocks.len() != self.free_blocks as usize {
            return Err(format!("free lists hold {} nodes, counter says {}", blocks.len(), self.free_blocks));
        }
        if self.boundaries.len() != 2 * blocks.len() {
            return Err(format!("{} boundaries for {} free blocks", self.boundaries.len(), blocks.len()));
        }
        blocks.sort_unstable();
        let mut free_units = 0u64;
        for (i, &(offset, size)) in blocks.iter().enumerate() {
            if offset + size > capacity_units {
                return Err(format!("free block at {offset} of {size} units past the capacity {capacity_units}"));
            }
            if let Some(&(next, _)) = blocks.get(i + 1) {
                if offset + size >= next {
                    return Err(format!("free blocks at {offset} and {next} touch or overlap"));
                }
            }
            free_units += size;
        }
        if free_units << self.align_log2 != self.free_bytes() {
            return Err(format!("free blocks hold {free_units} units, counters say {} bytes free", self.free_bytes()));
        }
        #[cfg(debug_assertions)]
        {
            if self.live.len() != self.allocations as usize {
                return Err(format!("{} live allocations, counter says {}", self.live.len(), self.allocations));
            }
            let mut all: Vec<(u64, u64)> = self.live.iter().map(|(&o, &u)| (u64::from(o), u64::from(u))).collect();
            all.extend_from_slice(&blocks);
            all.sort_unstable();
            let mut expect = 0u64;
            for (offset, size) in all {
                if offset != expect {
                    return Err(format!("block at unit {offset}, expected one at {expect}"));
                }
                expect = offset + size;
            }
            if expect != capacity_units {
                return Err(format!("blocks end at unit {expect}, capacity {capacity_units} units"));
            }
        }
        // Spare stack: every other node.
        let (mut n, mut spare) = (self.spare_head, 0usize);
        while n != NIL {
            spare += 1;
            if spare > limit {
                return Err("spare stack has a cycle".into());
            }
            let node = self.nodes.get(n as usize).ok_or_else(|| format!("spare link to missing node {n}"))?;
            if node.state() != NodeState::Spare {
                return Err(format!("node {n} on the spare stack is {:?}", node.state()));
            }
            n = node.next_free;
        }
        if spare + blocks.len() != limit {
            return Err(format!("{spare} spare + {} free != {limit} nodes", blocks.len()));
        }
        Ok(())
    }

    /// First free block that holds `units`: good fit, then a bounded look in the request's own
    /// bin.
    #[inline]
    fn find_free_block(&self, units: u32) -> Option<u32> {
        let (fl, sl) = bin_ceil(u64::from(units));
        if let Some(bin) = self.first_bin_at_or_above(fl, sl) {
            return Some(self.bin_heads[bin]);
        }
        let (fl, sl) = bin_floor(u64::from(units));
        let mut n = self.bin_heads[fl * SL_COUNT + sl];
        for _ in 0..FALLBACK_SCAN {
            if n == NIL {
                break;
            }
            let node = &self.nodes[n as usize];
            if node.size >= units {
                return Some(n);
            }
            n = node.next_free;
        }
        None
    }

    /// Smallest non-empty bin >= (fl, sl), found with two bitmap scans.
    #[inline]
    fn first_bin_at_or_above(&self, fl: usize, sl: usize) -> Option<usize> {
        if fl >= FL_COUNT {
            return None;
        }
        let sl_map = self.sl_bitmaps[fl] & (u16::MAX << sl);
        if sl_map != 0 {
            return Some(fl * SL_COUNT + sl_map.trailing_zeros() as usize);
        }
        let fl_map = self.fl_bitmap & u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0);
        if fl_map == 0 {
            return None;
        }
        let fl = fl_map.trailing_zeros() as usize;
        Some(fl * SL_COUNT + self.sl_bitmaps[fl].trailing_zeros() as usize)
    }

    /// Pushes free node `n` onto the head of its bin's list.
    #[inline]
    fn link_free(&mut self, n: u32) {
        let (fl, sl) = bin_floor(u64::from(self.nodes[n as usize].size));
        let bin = fl * SL_COUNT + sl;
        let head = self.bin_heads[bin];
        {
            let node = &mut self.nodes[n as usize];
            debug_assert_eq!(node.state(), NodeState::Free);
            node.prev_free = NIL;
            node.next_free = head;
        }
        if head != NIL {
            self.nodes[head as usize].prev_free = n;
        }
        self.bin_heads[bin] = n;
        self.sl_bitmaps[fl] |= 1 << sl;
        self.fl_bitmap |= 1 << fl;
        self.free_blocks += 1;
    }

    /// Takes free node `n` out of its bin's list (its size must be unchanged since linking).
    #[inline]
    fn unlink_free(&mut self, n: u32) {
        let Node { size, prev_free, next_free, .. } = self.nodes[n as usize];
        if prev_free != NIL {
            self.nodes[prev_free as usize].next_free = next_free;
        } else {
            let (fl, sl) = bin_floor(u64::from(size));
            let bin = fl * SL_COUNT + sl;
            debug_assert_eq!(self.bin_heads[bin], n);
            self.bin_heads[bin] = next_free;
            if next_free == NIL {
                self.sl_bitmaps[fl] &= !(1 << sl);
                if self.sl_bitmaps[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        if next_free != NIL {
            self.nodes[next_free as usize].prev_free = prev_free;
        }
        let node = &mut self.nodes[n as usize];
        node.prev_free = NIL;
        node.next_free = NIL;
        self.free_blocks -= 1;
    }

    /// A node for a new free block: from the spare stack, else a fresh one within the
    /// reservation.
    #[inline]
    fn take_spare_node(&mut self) -> Option<u32> {
        if self.spare_head != NIL {
            let n = self.spare_head;
            self.spare_head = self.nodes[n as usize].next_free;
            return Some(n);
        }
        if self.nodes.len() < self.node_limit {
            // Within the capacity reserved in `new`: never reallocates.
            self.nodes.push(Node::SPARE);
            return Some((self.nodes.len() - 1) as u32);
        }
        None
    }

    #[inline]
    fn release_node(&mut self, n: u32) {
        self.nodes[n as usize] = Node { next_free: self.spare_head, ..Node::SPARE };
        self.spare_head = n;
    }

    /// Lower bound (bytes) of the class good fit searches first for `len`: when any free block
    /// is at least this large, `allocate(len)` must succeed. For tests.
    #[cfg(test)]
    fn good_fit_lower_bound(&self, len: u64) -> u128 {
        let (fl, sl) = bin_ceil(len >> self.align_log2);
        bin_lower_units(fl, sl) << self.align_log2
    }
}

/// Smallest size (in units) of bin (fl, sl). u128 because the top classes overflow u64.
#[cfg(test)]
fn bin_lower_units(fl: usize, sl: usize) -> u128 {
    if fl == 0 {
        sl as u128
    } else {
        ((SL_COUNT + sl) as u128) << (fl - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const GIB: u64 = 1024 * MIB;

    /// splitmix64: deterministic, dependency-free randomness for the churn test.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
        /// Log-uniform in [lo, hi].
        fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
            let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
            ((a + self.unit() * (b - a)).exp() as u64).clamp(lo, hi)
        }
    }

    fn check(a: &OffsetAllocator) {
        if let Err(e) = a.check_invariants() {
            panic!("invariant violated: {e}");
        }
    }

    fn end(a: &OffsetAllocator, x: &Allocation) -> u64 {
        a.offset_of(x) + a.len_of(x)
    }

    fn alloc(a: &mut OffsetAllocator, size: u64) -> Allocation {
        a.allocate(size).expect("allocation should succeed")
    }

    /// Frees the allocations at even positions; returns the others.
    fn free_every_other(a: &mut OffsetAllocator, live: Vec<Allocation>) -> Vec<Allocation> {
        let mut kept = Vec::new();
        for (i, x) in live.into_iter().enumerate() {
            if i % 2 == 0 {
                a.free(x);
            } else {
                kept.push(x);
            }
        }
        kept
    }

    fn assert_fully_coalesced(a: &OffsetAllocator) {
        let s = a.stats();
        assert_eq!(s.used_bytes, 0);
        assert_eq!(s.allocations, 0);
        assert_eq!(s.free_bytes, s.capacity_bytes);
        assert_eq!(s.free_blocks, 1);
        assert_eq!(s.largest_free_bytes, s.capacity_bytes);
        check(a);
    }

    #[test]
    fn bins_bracket_sizes() {
        let mut units = 1u64;
        while units < (1 << 40) {
            for u in [units, units + 1, units.saturating_mul(3) / 2] {
                let (fl, sl) = bin_floor(u);
                assert!(fl < FL_COUNT && sl < SL_COUNT);
                let lower = bin_lower_units(fl, sl);
                let next = if sl + 1 < SL_COUNT { bin_lower_units(fl, sl + 1) } else { bin_lower_units(fl + 1, 0) };
                assert!(lower <= u as u128 && (u as u128) < next, "u={u} bin=({fl},{sl})");
                let (cfl, csl) = bin_ceil(u);
                let clower = bin_lower_units(cfl, csl);
                assert!(clower >= u as u128, "ceil bin lower {clower} < {u}");
                assert!((cfl, csl) >= (fl, sl));
                // Ceil moves at most one class up.
                assert!(clower == u as u128 || (cfl, csl) == (fl, sl + 1) || (cfl, csl) == (fl + 1, 0));
            }
            units = units * 5 / 4 + 1;
        }
        let (fl, _) = bin_floor(u64::MAX);
        assert!(fl < FL_COUNT);
    }

    #[test]
    fn bad_align_is_an_error() {
        for align in [0, 1, 2, 4, 7, 12, 48, 100, u64::MAX] {
            assert_eq!(OffsetAllocator::new(GIB, align, 16).err(), Some(AllocError::BadAlign(align)));
        }
        assert!(OffsetAllocator::new(GIB, 8, 16).is_ok());
        assert!(OffsetAllocator::new(GIB, 1 << 63, 16).is_err()); // capacity rounds to 0
        assert_eq!(
            OffsetAllocator::new(63, 64, 16).err(),
            Some(AllocError::ZeroCapacity { capacity_bytes: 63, align_bytes: 64 })
        );
        assert_eq!(OffsetAllocator::new(GIB, 64, 0).err(), Some(AllocError::ZeroMaxAllocations));
        let msg = AllocError::BadAlign(48).to_string();
        assert!(msg.contains("power of two") && msg.contains("48"), "{msg}");
    }

    #[test]
    fn per_allocation_bookkeeping_stays_small() {
        // One handle in the caller's record, a node per hole, none per allocation.
        assert_eq!(std::mem::size_of::<Node>(), 16);
        assert_eq!(std::mem::size_of::<Option<Allocation>>(), 8);
        let mut a = OffsetAllocator::new(MIB, 64, 1 << 14).expect("new");
        let live: Vec<_> = (0..MIB / 64).map(|_| alloc(&mut a, 64)).collect();
        assert_eq!((a.nodes.len(), a.boundaries.len()), (1, 0), "no node for {} allocations", live.len());
        check(&a);
        // Every other one freed: a node and two boundaries per hole.
        let kept = free_every_other(&mut a, live);
        assert_eq!((a.free_blocks(), a.boundaries.len()), (8192, 2 * 8192));
        check(&a);
        for x in kept {
            a.free(x);
        }
        assert_fully_coalesced(&a);
        assert_eq!(a.boundaries.len(), 2);
        assert_eq!(OffsetAllocator::new(MAX_CAPACITY, 64, 1).err(), Some(AllocError::CapacityTooLarge(MAX_CAPACITY)));
        // Up to 2^30 units the unit is the alignment asked for; past that it coarsens.
        assert_eq!(OffsetAllocator::new(64 << 30, 64, 1).expect("64 GiB").align_bytes(), 64);
        assert_eq!(OffsetAllocator::new((64 << 30) + 63, 64, 1).expect("64 GiB + 63").align_bytes(), 64);
        assert_eq!(OffsetAllocator::new((64 << 30) + 64, 64, 1).expect("64 GiB + 64").align_bytes(), 128);
        assert_eq!(OffsetAllocator::new(1 << 40, 64, 1).expect("1 TiB").align_bytes(), 1024);
        assert_eq!(OffsetAllocator::new(1 << 40, 1 << 20, 1).expect("1 MiB units").align_bytes(), 1 << 20);
        let mut a = OffsetAllocator::new(MAX_CAPACITY - 1, 64, 2).expect("new");
        let unit = a.align_bytes();
        assert_eq!(unit, 1 << 32);
        assert_eq!(a.capacity_bytes(), (MAX_CAPACITY - 1) & !(unit - 1));
        let x = alloc(&mut a, MAX_CAPACITY / 2);
        let y = alloc(&mut a, 64);
        assert_eq!((a.offset_of(&y), a.len_of(&y)), (MAX_CAPACITY / 2, unit));
        check(&a);
        a.free(x);
        a.free(y);
        assert_fully_coalesced(&a);
    }

    #[test]
    fn capacity_rounds_down_and_sizes_round_up() {
        let mut a = OffsetAllocator::new(10_000, 64, 64).expect("new");
        assert_eq!(a.capacity_bytes(), 9_984);
        assert_eq!(a.align_bytes(), 64);
        let x = alloc(&mut a, 1);
        assert_eq!((a.offset_of(&x), a.len_of(&x)), (0, 64));
        let y = alloc(&mut a, 64);
        assert_eq!((a.offset_of(&y), a.len_of(&y)), (64, 64));
        let z = alloc(&mut a, 65);
        assert_eq!((a.offset_of(&z), a.len_of(&z), end(&a, &z)), (128, 128, 256));
        assert_eq!(a.used_bytes(), 256);
        assert_eq!(a.free_bytes(), 9_984 - 256);
        for al in [&x, &y, &z] {
            assert_eq!(a.offset_of(al) % 64, 0);
        }
        check(&a);
        a.free(y);
        a.free(x);
        a.free(z);
        assert_fully_coalesced(&a);
    }

    #[test]
    fn zero_size_returns_none() {
        let mut a = OffsetAllocator::new(MIB, 64, 8).expect("new");
        assert!(a.allocate(0).is_none());
        assert_fully_coalesced(&a);
    }

    #[test]
    fn oversize_returns_none() {
        let mut a = OffsetAllocator::new(MIB, 64, 8).expect("new");
        assert!(a.allocate(MIB + 1).is_none());
        assert!(a.allocate(u64::MAX).is_none());
        assert!(a.allocate(u64::MAX - 62).is_none());
        // The whole capacity fits (bounded fallback beyond good fit).
        let all = alloc(&mut a, MIB);
        assert_eq!((a.offset_of(&all), a.len_of(&all)), (0, MIB));
        assert!(a.allocate(1).is_none());
        let s = a.stats();
        assert_eq!((s.free_blocks, s.largest_free_bytes, s.free_bytes), (0, 0, 0));
        check(&a);
        a.free(all);
        assert_fully_coalesced(&a);
    }

    #[test]
    fn huge_capacity() {
        let cap = 700 * GIB;
        let mut a = OffsetAllocator::new(cap, 4096, 1024).expect("new");
        let big = alloc(&mut a, 300 * GIB);
        let small = alloc(&mut a, 4 * KIB);
        let rest = alloc(&mut a, cap - 300 * GIB - 4 * KIB);
        assert_eq!(end(&a, &rest), cap);
        check(&a);
        a.free(small);
        a.free(big);
        a.free(rest);
        assert_fully_coalesced(&a);
    }

    #[test]
    fn exhaust_and_free() {
        let mut a = OffsetAllocator::new(64 * KIB, 64, 4096).expect("new");
        let mut live = Vec::new();
        while let Some(x) = a.allocate(1000) {
            live.push(x);
        }
        // 1000 rounds to 1024: exactly 64 fit.
        assert_eq!(live.len(), 64);
        assert_eq!(a.free_bytes(), 0);
        assert_eq!(a.stats().free_blocks, 0);
        check(&a);
        // Free every other one: 32 holes of 1 KiB, none mergeable.
        let kept = free_every_other(&mut a, live);
        let s = a.stats();
        assert_eq!((s.free_blocks, s.largest_free_bytes), (32, 1024));
        assert!(a.allocate(1025).is_none(), "no hole holds 1025 bytes");
        check(&a);
        for x in kept {
            a.free(x);
        }
        assert_fully_coalesced(&a);
    }

    #[test]
    fn coalesces_after_random_order_free() {
        let mut rng = Rng(7);
        for round in 0..20 {
            let mut a = OffsetAllocator::new(256 * MIB, 64, 1 << 12).expect("new");
            let mut live = Vec::new();
            while let Some(x) = a.allocate(rng.log_uniform(64, 4 * MIB)) {
                live.push(x);
            }
            check(&a);
            // Fisher-Yates, then free in that order.
            for i in (1..live.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                live.swap(i, j);
            }
            for (k, x) in live.into_iter().enumerate() {
                a.free(x);
                if k % 64 == 0 || round == 0 {
                    check(&a);
                }
            }
            assert_fully_coalesced(&a);
        }
    }

    #[test]
    fn middle_free_merges_both_neighbours() {
        let mut a = OffsetAllocator::new(4 * KIB, 64, 16).expect("new");
        let x = alloc(&mut a, 1024);
        let y = alloc(&mut a, 1024);
        let z = alloc(&mut a, 1024);
        let w = alloc(&mut a, 1024);
        a.free(x);
        a.free(z);
        assert_eq!(a.stats().free_blocks, 2);
        a.free(y); // merges x, y, z into one 3 KiB block
        let s = a.stats();
        assert_eq!((s.free_blocks, s.largest_free_bytes), (1, 3 * KIB));
        check(&a);
        let big = alloc(&mut a, 3 * KIB);
        assert_eq!(a.offset_of(&big), 0);
        a.free(w);
        a.free(big);
        assert_fully_coalesced(&a);
    }

    #[test]
    fn node_table_bound() {
        let mut a = OffsetAllocator::new(MIB, 64, 3).expect("new");
        assert_eq!(a.max_allocations(), 3);
        let x = alloc(&mut a, 64);
        let y = alloc(&mut a, 64);
        let z = alloc(&mut a, 64);
        assert!(a.allocate(64).is_none(), "4th allocation past max_allocations");
        assert!(a.free_bytes() > 0);
        a.free(y);
        let y2 = alloc(&mut a, 64);
        assert_eq!(a.offset_of(&y2), 64, "reuses the hole");
        assert_eq!(a.allocations(), 3);
        check(&a);
        for v in [x, y2, z] {
            a.free(v);
        }
        assert_fully_coalesced(&a);
        // Worst case for nodes: max live allocations, each with a hole beside it.
        let mut a = OffsetAllocator::new(MIB, 64, 8).expect("new");
        let mut live: Vec<_> = (0..8).map(|_| alloc(&mut a, 64)).collect();
        for i in (0..8).step_by(2).rev() {
            a.free(live.remove(i));
        }
        let mut live2: Vec<_> = (0..4).map(|_| alloc(&mut a, 32)).collect();
        assert!(a.allocate(8).is_none());
        check(&a);
        live.append(&mut live2);
        for v in live {
            a.free(v);
        }
        assert_fully_coalesced(&a);
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "does not belong")]
    fn free_of_foreign_allocation_panics_in_debug() {
        let mut a = OffsetAllocator::new(MIB, 64, 8).expect("new");
        let mut b = OffsetAllocator::new(MIB, 64, 8).expect("new");
        let x = alloc(&mut a, 64);
        b.free(x);
    }

    #[test]
    fn good_fit_never_refuses_a_fitting_class() {
        // Holes of 33 units (2112 bytes) sit in class [32, 34) units; a request for 33 units
        // rounds up to class [34, 36), which is empty, so only the bounded fallback finds them.
        let mut a = OffsetAllocator::new(64 * KIB, 64, 64).expect("new");
        assert_eq!((bin_floor(33), bin_ceil(33)), ((2, 0), (2, 1)));
        let mut live: Vec<_> = (0..20).map(|_| alloc(&mut a, 2112)).collect();
        let rest = a.free_bytes();
        let tail = alloc(&mut a, rest);
        let mut holes = Vec::new();
        for i in (0..20).step_by(2).rev() {
            holes.push(live.remove(i));
        }
        for h in holes {
            a.free(h);
        }
        assert_eq!(a.free_blocks(), 10);
        let x = alloc(&mut a, 2112);
        check(&a);
        a.free(x);
        a.free(tail);
        for v in live {
            a.free(v);
        }
        assert_fully_coalesced(&a);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (0u64..256).prop_map(Op::Alloc),
            2 => (0u64..8192).prop_map(Op::Alloc),
            1 => (0u64..(1 << 20)).prop_map(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn matches_model(
            capacity in 1u64..(1 << 20),
            align_log2 in 3u32..13,
            max_allocations in 1u32..48,
            ops in vec(op(), 0..200),
        ) {
            let align = 1u64 << align_log2;
            let cap = capacity & !(align - 1);
            let mut a = match OffsetAllocator::new(capacity, align, max_allocations) {
                Ok(a) => a,
                Err(e) => {
                    prop_assert_eq!(cap, 0);
                    prop_assert_eq!(e, AllocError::ZeroCapacity { capacity_bytes: capacity, align_bytes: align });
                    return Ok(());
                }
            };
            prop_assert_eq!(a.capacity_bytes(), cap);
            // The model: live allocations; their (offset, len) are what we check.
            let mut live: Vec<Allocation> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(size) => {
                        let len = size.div_ceil(align) * align;
                        let free_before = a.free_bytes();
                        let largest_before = a.largest_free_bytes();
                        match a.allocate(size) {
                            Some(x) => {
                                prop_assert!(size > 0);
                                prop_assert!(live.len() < max_allocations as usize);
                                prop_assert_eq!(a.len_of(&x), len);
                                prop_assert_eq!(a.offset_of(&x) % align, 0);
                                prop_assert!(end(&a, &x) <= cap);
                                for y in &live {
                                    prop_assert!(
                                        end(&a, &x) <= a.offset_of(y) || end(&a, y) <= a.offset_of(&x),
                                        "{:?} overlaps {:?}", x, y
                                    );
                                }
                                live.push(x);
                            }
                            None => {
                                let justified = size == 0
                                    || live.len() >= max_allocations as usize
                                    || len > free_before
                                    || a.good_fit_lower_bound(len) > u128::from(largest_before);
                                prop_assert!(justified,
                                    "refused {} bytes: free {}, largest {}", size, free_before, largest_before);
                                if live.is_empty() && size > 0 && len <= cap {
                                    prop_assert!(false, "empty allocator refused {} of {}", size, cap);
                                }
                            }
                        }
                    }
                    Op::Free(i) => {
                        if !live.is_empty() {
                            let x = live.swap_remove(i % live.len());
                            a.free(x);
                        }
                    }
                }
                let s = a.stats();
                prop_assert_eq!(s.used_bytes, live.iter().map(|x| a.len_of(x)).sum::<u64>());
                prop_assert_eq!(s.used_bytes + s.free_bytes, cap);
                prop_assert_eq!(s.allocations, live.len() as u64);
                prop_assert!(s.largest_free_bytes <= s.free_bytes);
                prop_assert!(s.free_blocks <= s.allocations + 1);
                if let Err(e) = a.check_invariants() {
                    prop_assert!(false, "{}", e);
                }
            }
            for x in live.drain(..) {
                a.free(x);
            }
            let s = a.stats();
            prop_assert_eq!(s.free_blocks, 1);
            prop_assert_eq!(s.largest_free_bytes, cap);
            prop_assert_eq!(s.free_bytes, cap);
            prop_assert_eq!(s.used_bytes, 0);
        }
    }

    #[derive(Default)]
    struct Counters {
        attempts: u64,
        failed: u64,
        failed_with_room: u64,
    }

    impl Counters {
        fn try_alloc(&mut self, a: &mut OffsetAllocator, live: &mut Vec<Allocation>, rng: &mut Rng) {
            let size = rng.log_uniform(4 * KIB, 4 * MIB);
            self.attempts += 1;
            match a.allocate(size) {
                Some(x) => live.push(x),
                None => {
                    self.failed += 1;
                    if a.free_bytes() >= size {
                        self.failed_with_room += 1;
                    }
                }
            }
        }
    }

    /// Fragmentation under churn: fill to ~90% with log-uniform 4 KiB..4 MiB objects, then
    /// 100k rounds of free-random + refill. Reports, asserts invariants only.
    #[test]
    fn churn_fragmentation() {
        const CAP: u64 = 16 * GIB;
        const TARGET: u64 = CAP / 10 * 9;
        const ROUNDS: u32 = 100_000;
        let mut rng = Rng(0x6b76_7469_6465);
        let mut a = OffsetAllocator::new(CAP, 64, 1 << 17).expect("new");
        let mut live: Vec<Allocation> = Vec::new();
        let mut n = Counters::default();
        let mut min_ratio = 1.0f64;
        let mut ratio_sum = 0.0f64;
        let mut ratio_samples = 0u32;
        // Fill.
        let mut guard = 0;
        while a.used_bytes() < TARGET && guard < 1_000_000 {
            n.try_alloc(&mut a, &mut live, &mut rng);
            guard += 1;
        }
        assert!(a.used_bytes() >= TARGET);
        let fill_failed = n.failed;
        check(&a);
        for round in 0..ROUNDS {
            if !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                a.free(live.swap_remove(i));
            }
            // Refill to the target; a few tries so a refusal does not spin.
            for _ in 0..4 {
                if a.used_bytes() >= TARGET {
                    break;
                }
                n.try_alloc(&mut a, &mut live, &mut rng);
            }
            if round % 1000 == 999 {
                let s = a.stats();
                let ratio = s.largest_free_bytes as f64 / s.free_bytes.max(1) as f64;
                min_ratio = min_ratio.min(ratio);
                ratio_sum += ratio;
                ratio_samples += 1;
                assert_eq!(s.used_bytes + s.free_bytes, CAP);
                assert_eq!(s.allocations, live.len() as u64);
                assert!(s.free_blocks <= s.allocations + 1);
            }
            if round % 25_000 == 0 {
                check(&a);
            }
        }
        let s = a.stats();
        let used_sum: u64 = live.iter().map(|x| a.len_of(x)).sum();
        assert_eq!(s.used_bytes, used_sum);
        check(&a);
        println!(
            "churn: cap {} GiB, {} live, used {:.1}%, {} free blocks; largest_free/free end {:.3}, \
             min {:.3}, mean {:.3}; {} attempts, {} failed ({} during fill), {} failed with \
             free_bytes >= request",
            CAP / GIB,
            s.allocations,
            100.0 * s.used_bytes as f64 / CAP as f64,
            s.free_blocks,
            s.largest_free_bytes as f64 / s.free_bytes.max(1) as f64,
            min_ratio,
            ratio_sum / f64::from(ratio_samples.max(1)),
            n.attempts,
            n.failed,
            fill_failed,
            n.failed_with_room,
        );
        // How full can the fragmented allocator still get? Fill until 100 refusals in a row.
        let churn_failed = n.failed;
        let mut first_refusal_used = None;
        let mut streak = 0;
        while streak < 100 {
            let before = n.failed;
            n.try_alloc(&mut a, &mut live, &mut rng);
            if n.failed > before {
                streak += 1;
                first_refusal_used.get_or_insert(a.used_bytes());
            } else {
                streak = 0;
            }
        }
        let s = a.stats();
        let pct = |b: u64| 100.0 * b as f64 / CAP as f64;
        println!(
            "churn then fill to refusal: first refusal at {:.1}% used, stopped at {:.1}% used \
             ({} live, {} free blocks); {} refused, {} of them with free_bytes >= request",
            pct(first_refusal_used.unwrap_or(0)),
            pct(s.used_bytes),
            s.allocations,
            s.free_blocks,
            n.failed - churn_failed,
            n.failed_with_room,
        );
        check(&a);
        for x in live.drain(..) {
            a.free(x);
        }
        assert_fully_coalesced(&a);
    }
}
