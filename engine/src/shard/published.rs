//! A shard's index, published so that any thread can lease a DRAM-resident object without a
//! message to the shard.
//!
//! Owns the key table (open addressing over the key hashes: one 4-byte entry per key, the
//! object slot beside its distance from home and a tag of the hash, see `EntryLayout`), one
//! lease word per object slot (the object's generation, an open bit and a reader count), every
//! object's key entry (its key and value length, the only copy: the shard reads them here too),
//! where an open object's value is, and the queue of reads the shard's eviction policy has not
//! seen yet.
//! The owning shard thread is its only writer. Readers look a key up, take a lease with one
//! compare-and-swap on an open object, check the key, copy, and give the lease back with one
//! atomic decrement. Never lets a reader lease an object the shard has closed, and the shard
//! never frees or moves an object's bytes while its reader count is not zero: it closes the slot
//! first (atomically with seeing no readers, for eviction) and waits for the count to drain.
//!
//! A key found in the table but not leasable (on SSD only, loading, being written or replaced)
//! and a miss that raced with an entry moving are answered `Fallback`: the caller asks the shard.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_queue::ArrayQueue;

use crate::stats::ShardCounters;
use keys::KeyArena;
use kvtide_tiers::dram::read_index::RegionWriter;

/// The lease word's open bit: readers may take leases.
const OPEN: u64 = 1 << 31;
/// The lease word's reader count (below the open bit).
const COUNT: u64 = OPEN - 1;

/// What the lease protocol needs of an atomic word (the std atomic, and loom's in the model test).
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
    fn compare_exchange_weak(&self, current: u64, new: u64, ok: Ordering, err: Ordering) -> Result<u64, u64>;
    fn fetch_sub(&self, value: u64, order: Ordering) -> u64;
    fn fetch_and(&self, value: u64, order: Ordering) -> u64;
    fn fetch_or(&self, value: u64, order: Ordering) -> u64;
}

impl Word for AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }
    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, value, order)
    }
    fn compare_exchange_weak(&self, current: u64, new: u64, ok: Ordering, err: Ordering) -> Result<u64, u64> {
        AtomicU64::compare_exchange_weak(self, current, new, ok, err)
    }
    fn fetch_sub(&self, value: u64, order: Ordering) -> u64 {
        AtomicU64::fetch_sub(self, value, order)
    }
    fn fetch_and(&self, value: u64, order: Ordering) -> u64 {
        AtomicU64::fetch_and(self, value, order)
    }
    fn fetch_or(&self, value: u64, order: Ordering) -> u64 {
        AtomicU64::fetch_or(self, value, order)
    }
}

/// One object slot's lease word: `generation << 32 | OPEN? | readers`.
///
/// Readers: `acquire` succeeds only while the slot is open, and pins the generation it saw
/// (a slot reused for another object has another generation, so a stale compare fails);
/// `release` gives it back. The shard: `reset` gives a slot with no readers to a new object
/// (closed), `open` lets readers in after the fields they read were written, `close` and
/// `close_if_unused` keep new readers out; the count then only goes down.
pub(crate) struct LeaseWord<W: Word>(pub(crate) W);

impl<W: Word> LeaseWord<W> {
    /// Takes a lease: the generation leased, or None when the slot is closed (or its count is
    /// full). What the shard wrote before opening the slot is visible after this returns.
    pub(crate) fn acquire(&self) -> Option<u32> {
        let mut current = self.0.load(Ordering::Relaxed);
        loop {
            if current & OPEN == 0 || current & COUNT == COUNT {
                return None;
            }
            match self.0.compare_exchange_weak(current, current + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Some((current >> 32) as u32),
                Err(seen) => current = seen,
            }
        }
    }

    /// Gives a lease back. Everything the reader did under it happens before the shard sees the
    /// count drop.
    pub(crate) fn release(&self) {
        let before = self.0.fetch_sub(1, Ordering::Release);
        debug_assert!(before & COUNT > 0, "lease word released below zero");
    }

    /// Readers holding leases now.
    pub(crate) fn readers(&self) -> u32 {
        (self.0.load(Ordering::Acquire) & COUNT) as u32
    }

    /// The generation the slot belongs to and whether it is open.
    pub(crate) fn state(&self) -> (u32, bool) {
        let v = self.0.load(Ordering::Acquire);
        ((v >> 32) as u32, v & OPEN != 0)
    }

    /// Gives a slot without readers to a new object, closed (shard only).
    pub(crate) fn reset(&self, generation: u32) {
        debug_assert_eq!(self.readers(), 0, "slot reused under readers");
        self.0.store(u64::from(generation) << 32, Ordering::Relaxed);
    }

    /// Lets readers in; what the shard wrote before is visible to them (shard only).
    pub(crate) fn open(&self) {
        self.0.fetch_or(OPEN, Ordering::Release);
    }

    /// Keeps new readers out; returns the readers still holding leases (shard only).
    pub(crate) fn close(&self) -> u32 {
        (self.0.fetch_and(!OPEN, Ordering::AcqRel) & COUNT) as u32
    }

    /// Closes the slot if nobody holds a lease, atomically with seeing that (shard only).
    pub(crate) fn close_if_unused(&self) -> bool {
        let mut current = self.0.load(Ordering::Acquire);
        loop {
            if current & COUNT != 0 {
                return false;
            }
            if current & OPEN == 0 {
                return true;
            }
            match self.0.compare_exchange_weak(current, current & !OPEN, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(seen) => current = seen,
            }
        }
    }
}

/// One object slot, 24 bytes: what a reader needs. The object's key and both lengths are in its
/// key entry (see `keys`), which the shard reads too.
#[derive(Default)]
struct ObjectSlot {
    word: LeaseWord<AtomicU64>,
    value: AtomicUsize,
    /// The object's key entry (null while the slot holds no object).
    key: AtomicPtr<u8>,
}

/// The largest value an object can have (the shard refuses larger ones).
pub(crate) const MAX_VALUE_BYTES: u64 = (1 << 43) - 1;
/// The longest key a slot takes (the engine's own bound is lower).
const MAX_SLOT_KEY_BYTES: usize = (1 << 21) - 1;

impl Default for LeaseWord<AtomicU64> {
    fn default() -> Self {
        LeaseWord(AtomicU64::new(0))
    }
}

/// Object slots per chunk (chunks are allocated as slot ids reach them).
const CHUNK_SLOTS_LOG2: u32 = 14;
const CHUNK_SLOTS: usize = 1 << CHUNK_SLOTS_LOG2;
/// Chunks at most: 2^32 slot ids.
const CHUNKS: usize = 1 << (32 - CHUNK_SLOTS_LOG2);
/// Smallest key table.
const MIN_TABLE: usize = 1 << 10;
/// Reads queued for the eviction policy at most; more are not recorded (the policy's view of
/// recency is approximate under read storms, like a sampled LRU).
const ACCESS_QUEUE: usize = 1 << 12;
/// An entry's slot field holds the slot plus one, so an empty entry is zero.
const EMPTY: u32 = 0;

/// Largest key table reserved up front (2^28 entries, 1 GiB of address space): a shard admitted
/// more keys than that grows into new tables.
const MAX_ROOM: usize = 1 << 28;
/// The table grows when more than this share of its entries (in quarters) is taken.
const MAX_LOAD_QUARTERS: usize = 3;
/// Bits of an entry for its displacement from its home, at most. Linear probing at 3/4 load
/// leaves about 0.4% of entries 31 or more places from home (measured), so saturating there
/// costs a key's hash now and then.
const DISP_BITS: u32 = 5;
/// Slot bits of an entry at least (room for 65,535 slots before a table must be rebuilt).
const MIN_SLOT_BITS: u32 = 16;

/// How a table's 32-bit entries split: the slot plus one in the low `slot_bits`, above it the
/// entry's distance from its home (saturating: `disp_max` means that far or farther, the home
/// then found by hashing the key again), and a tag of the key's hash in the bits left. The
/// displacement keeps only entries of the home probed as candidates (fewer than one other a
/// probe at the table's loads) and lets entries move without their keys; the tag thins those
/// out by 2^tag_bits (6 bits at 1 Mi objects a shard, 3 at 10 Mi, none past 2^26). A false
/// candidate costs a lease taken and given back, or, closed, a lookup answered `Fallback`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct EntryLayout {
    slot_bits: u32,
    disp_bits: u32,
    tag_bits: u32,
}

impl EntryLayout {
    /// The layout of a table holding slots below `slots`.
    fn for_slots(slots: u64) -> EntryLayout {
        let slot_bits = (64 - slots.leading_zeros()).clamp(MIN_SLOT_BITS, 32);
        let disp_bits = DISP_BITS.min(32 - slot_bits);
        EntryLayout { slot_bits, disp_bits, tag_bits: 32 - slot_bits - disp_bits }
    }

    /// Whether `slot` has room in the slot field.
    fn fits(&self, slot: u32) -> bool {
        u64::from(slot) + 1 < 1u64 << self.slot_bits
    }

    fn disp_max(&self) -> usize {
        (1usize << self.disp_bits) - 1
    }

    fn tag(&self, hash: u64) -> u64 {
        hash & ((1u64 << self.tag_bits) - 1)
    }

    /// The entry of `slot`, whose key hashes to `hash`, `disp` places past its home.
    fn entry(&self, hash: u64, disp: usize, slot: u32) -> u32 {
        let disp = disp.min(self.disp_max()) as u64;
        (self.tag(hash) << (self.slot_bits + self.disp_bits) | disp << self.slot_bits | (u64::from(slot) + 1)) as u32
    }

    /// `e` moved to `disp` places past its home.
    fn moved(&self, e: u32, disp: usize) -> u32 {
        let disp = disp.min(self.disp_max()) as u64;
        let field = ((1u64 << self.disp_bits) - 1) << self.slot_bits;
        ((u64::from(e) & !field) | disp << self.slot_bits) as u32
    }

    fn slot(&self, e: u32) -> u32 {
        ((u64::from(e) & ((1u64 << self.slot_bits) - 1)) - 1) as u32
    }

    fn disp(&self, e: u32) -> usize {
        ((u64::from(e) >> self.slot_bits) & ((1u64 << self.disp_bits) - 1)) as usize
    }

    /// Whether entry `e`, `i` places past the home of `hash`, may be that key's.
    fn may_be(&self, e: u32, hash: u64, i: usize) -> bool {
        u64::from(e) >> (self.slot_bits + self.disp_bits) == self.tag(hash) && self.disp(e) == i.min(self.disp_max())
    }
}

/// One key table: `room` entries reserved (untouched pages cost nothing), of which the first
/// `mask + 1`, a power of two, are in use. It grows in place, doubling `mask`, until `room`.
struct Table {
    entries: ZeroedSlice<AtomicU32>,
    mask: AtomicUsize,
    layout: EntryLayout,
}

/// One reader's (or the writer's) consistent view of a table: the mask it probes under.
struct View<'t> {
    entries: &'t [AtomicU32],
    mask: usize,
    shift: u32,
    layout: EntryLayout,
}

impl Table {
    fn new(capacity: usize, room: usize, layout: EntryLayout) -> Table {
        let capacity = capacity.next_power_of_two().max(MIN_TABLE);
        let room = room.next_power_of_two().max(capacity);
        Table { entries: ZeroedSlice::reserved(room), mask: AtomicUsize::new(capacity - 1), layout }
    }

    fn view(&self) -> View<'_> {
        // Never above the entries reserved: the writer only raises it within `room`.
        let mask = self.mask.load(Ordering::Acquire).min(self.entries.len() - 1);
        View { entries: &self.entries, mask, shift: 64 - (mask + 1).trailing_zeros(), layout: self.layout }
    }
}

impl View<'_> {
    /// Where a hash's probe starts: Fibonacci hashing (the top bits of the hash times 2^64 / phi).
    fn home(&self, hash: u64) -> usize {
        (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize & self.mask
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    fn entry(&self, at: usize) -> &AtomicU32 {
        &self.entries[at & self.mask]
    }

    /// Puts `slot`, whose key hashes to `hash`, in the first empty place from its home (writer
    /// only; the table has room and the slot fits the layout).
    fn place(&self, hash: u64, slot: u32) {
        let mut at = self.home(hash);
        let mut disp = 0;
        while self.entry(at).load(Ordering::Relaxed) != EMPTY {
            at = (at + 1) & self.mask;
            disp += 1;
        }
        self.entry(at).store(self.layout.entry(hash, disp, slot), Ordering::Release);
    }
}

/// Asks the CPU to start fetching what `PublishedIndex::lease(key, hash)` will read, one step
/// of its chain of dependent loads at a time (`Prefetch`). A hint only: the table it looked at
/// may have been replaced since (replaced tables live as long as the index), a pointer it reads
/// may be stale, and a prefetch never faults. A batch of leases issues each step some keys
/// ahead, so the cache misses of neighbouring keys overlap instead of following one another.
pub(crate) struct Prefetcher<'i> {
    index: &'i PublishedIndex,
    table: View<'i>,
}

impl Prefetcher<'_> {
    pub(crate) fn prefetch(&self, hash: u64, what: Prefetch) {
        let at = self.table.home(hash);
        let entry = self.table.entry(at);
        if matches!(what, Prefetch::Entry) {
            prefetch_line(entry as *const AtomicU32 as *const u8);
            return;
        }
        let e = entry.load(Ordering::Relaxed);
        if e == EMPTY || !self.table.layout.may_be(e, hash, 0) {
            return;
        }
        let Some(object) = self.index.slot(self.table.layout.slot(e)) else { return };
        if matches!(what, Prefetch::Slot) {
            prefetch_line(object as *const ObjectSlot as *const u8);
        } else {
            // The key the lease compares and the value's first line.
            prefetch_line(object.key.load(Ordering::Relaxed));
            prefetch_line(object.value.load(Ordering::Relaxed) as *const u8);
        }
    }
}

/// What `Prefetcher::prefetch` fetches.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Prefetch {
    /// The key's home entry in the table.
    Entry,
    /// The slot the home entry names (the entry cached).
    Slot,
    /// The key's bytes and the value's first line that slot points at (the slot cached).
    Bytes,
}

/// A prefetch of the cache line at `at` (no effect off x86-64). Never faults.
fn prefetch_line(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults or reads architecturally; SSE is part of
    // x86-64.
    unsafe {
        std::arch::x86_64::_mm_prefetch(at.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// A lease taken without the shard: give it back with `PublishedIndex::release`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FastLease {
    pub(crate) slot: u32,
}

/// What a lock-free lookup found.
pub(crate) enum FastRead {
    /// Leased: the value's bytes stay in place and unchanged until the lease is given back.
    Hit { lease: FastLease, ptr: NonNull<u8>, len: u64 },
    /// Not in the shard.
    Miss,
    /// Ask the shard (see the module comment).
    Fallback,
}

/// The published index of one shard, as readers see it. See the module comment.
pub(crate) struct PublishedIndex {
    table: AtomicPtr<Table>,
    /// Tables replaced by larger or wider ones, kept until the index goes (readers may still probe
    /// them): those outgrown are together smaller than the current one; a table widened for
    /// larger slot ids (only recovery of a larger SSD tier brings those) is as large as it.
    /// Locked only to add one, and for `heap_bytes`.
    // Boxed: readers hold the address of the table they probe.
    #[allow(clippy::vec_box)]
    old_tables: Mutex<Vec<Box<Table>>>,
    /// False once the shard is gone: lookups fall back (and the shard path says why).
    alive: AtomicBool,
    /// Odd while entries move (a removal shifting its neighbours back, or a resize): a miss seen
    /// across a change is not trusted.
    seq: AtomicU64,
    chunks: ZeroedSlice<AtomicPtr<ObjectSlot>>,
    accesses: ArrayQueue<u64>,
    /// The shard's counters: readers count their hits, misses, bytes and leases there.
    counters: Arc<ShardCounters>,
    /// Every object's key bytes (see `keys`). Only the writer touches the arena itself; readers
    /// read keys through their slots, under leases.
    keys: std::cell::UnsafeCell<KeyArena>,
    /// The arena's bytes, for `heap_bytes` on any thread.
    key_bytes: AtomicUsize,
}

// SAFETY: the shard's `IndexWriter` is the only writer of the table and the chunk pointers,
// through atomics; readers only load atomics and read memory those atomics publish (see the
// module comment). The raw table and chunk pointers are owned by this value.
unsafe impl Sync for PublishedIndex {}
// SAFETY: as above.
unsafe impl Send for PublishedIndex {}

/// The shard's handle on its published index: the only writer. Not `Clone`.
pub(crate) struct IndexWriter {
    index: Arc<PublishedIndex>,
    /// The shard's region of the engine's read index (other processes' readers), kept in step:
    /// an object is published there when it opens and taken out before it closes. A cell because
    /// eviction closes slots through `&self`; never borrowed across a call out.
    mirror: Option<std::cell::RefCell<RegionWriter>>,
    /// Entries in the table.
    len: usize,
    /// The hash the keys were inserted under (`insert`'s), for placing entries anew when the
    /// table grows or an entry's home is not in it.
    hash: fn(&[u8]) -> u64,
}

impl IndexWriter {
    /// A new index and its writer, its key table reserved for `max_keys` (it grows past that
    /// into new tables, which cost the old ones' memory until the index goes) and laid out for
    /// slots below `max_keys`. `hash` is the hash every key is inserted under.
    pub(crate) fn new(counters: Arc<ShardCounters>, max_keys: u32, hash: fn(&[u8]) -> u64) -> IndexWriter {
        let room = (max_keys as usize).saturating_mul(4).div_ceil(MAX_LOAD_QUARTERS).min(MAX_ROOM);
        let layout = EntryLayout::for_slots(u64::from(max_keys));
        let index = PublishedIndex {
            table: AtomicPtr::new(Box::into_raw(Box::new(Table::new(MIN_TABLE, room, layout)))),
            old_tables: Mutex::new(Vec::new()),
            alive: AtomicBool::new(true),
            seq: AtomicU64::new(0),
            chunks: ZeroedSlice::new(CHUNKS),
            accesses: ArrayQueue::new(ACCESS_QUEUE),
            counters,
            keys: std::cell::UnsafeCell::new(KeyArena::new()),
            key_bytes: AtomicUsize::new(0),
        };
        IndexWriter { index: Arc::new(index), mirror: None, len: 0, hash }
    }

    /// Keeps `mirror` (this shard's region of the read index) in step with the open objects.
    pub(crate) fn with_mirror(mut self, mirror: RegionWriter) -> IndexWriter {
        self.mirror = Some(std::cell::RefCell::new(mirror));
        self
    }

    /// Takes object `slot` out of the read index (before its bytes may change).
    fn unmirror(&self, slot: u32) {
        if let Some(mirror) = &self.mirror {
            mirror.borrow_mut().unpublish(slot);
        }
    }
}

impl PublishedIndex {
    fn table(&self) -> &Table {
        // SAFETY: the pointer always holds a live table: replaced tables are kept in
        // `old_tables` and the current one is freed only with the index.
        unsafe { &*self.table.load(Ordering::Acquire) }
    }

    fn slot(&self, slot: u32) -> Option<&ObjectSlot> {
        let chunk = self.chunks.get(slot as usize >> CHUNK_SLOTS_LOG2)?.load(Ordering::Acquire);
        if chunk.is_null() {
            return None;
        }
        // SAFETY: a non-null chunk pointer is a zero-initialised array of CHUNK_SLOTS slots that
        // lives as long as the index; the index is masked into it.
        Some(unsafe { &*chunk.add(slot as usize & (CHUNK_SLOTS - 1)) })
    }

    // ---- readers ------------------------------------------------------------------------------

    /// Prefetches for a batch of leases through this index (see `Prefetcher`).
    pub(crate) fn prefetcher(&self) -> Prefetcher<'_> {
        Prefetcher { index: self, table: self.table().view() }
    }

    /// Looks `key` (whose `hash` is `shard::index_hash` of its key hash) up and leases its
    /// object if it is open.
    pub(crate) fn lease(&self, key: &[u8], hash: u64) -> FastRead {
        if !self.alive.load(Ordering::Acquire) {
            return FastRead::Fallback;
        }
        let before = self.seq.load(Ordering::Acquire);
        if before & 1 == 1 {
            return FastRead::Fallback;
        }
        let table = self.table().view();
        let mut at = table.home(hash);
        // A candidate closed to readers (on SSD only, loading, being written) may be this key, or
        // another whose entry shares the tag and distance: probing goes on, and ends in
        // `Fallback` rather than a miss.
        let mut closed_candidate = false;
        for i in 0..table.capacity() {
            let e = table.entry(at).load(Ordering::Acquire);
            if e == EMPTY {
                break;
            }
            if table.layout.may_be(e, hash, i) {
                let slot = table.layout.slot(e);
                let Some(object) = self.slot(slot) else { return FastRead::Fallback };
                let Some(generation) = object.word.acquire() else {
                    closed_candidate = true;
                    at = (at + 1) & table.mask;
                    continue;
                };
                let Some(entry) = NonNull::new(object.key.load(Ordering::Relaxed)) else {
                    object.word.release();
                    return FastRead::Fallback;
                };
                // SAFETY: the lease keeps the object, and so its key entry, alive and unchanged;
                // the acquire made the shard's writes of the slot and the entry visible.
                let (len, slot_key) = unsafe { keys::read(entry) };
                if slot_key == key {
                    let ptr = object.value.load(Ordering::Relaxed) as *mut u8;
                    let Some(ptr) = NonNull::new(ptr) else {
                        object.word.release();
                        return FastRead::Fallback;
                    };
                    let counters = self.counters.readers.mine();
                    counters.leases_held.fetch_add(1, Ordering::Relaxed);
                    counters.reads.fetch_add(1, Ordering::Relaxed);
                    counters.hits.fetch_add(1, Ordering::Relaxed);
                    counters.bytes_read.fetch_add(len, Ordering::Relaxed);
                    // A full queue drops the record: recency is approximate under read storms.
                    let _ = self.accesses.push(u64::from(slot) << 32 | u64::from(generation));
                    return FastRead::Hit { lease: FastLease { slot }, ptr, len };
                }
                object.word.release();
            }
            at = (at + 1) & table.mask;
        }
        // A miss counts only if no entry moved meanwhile and no candidate was closed.
        fence(Ordering::Acquire);
        if closed_candidate || self.seq.load(Ordering::Relaxed) != before {
            return FastRead::Fallback;
        }
        self.counters.readers.mine().misses.fetch_add(1, Ordering::Relaxed);
        FastRead::Miss
    }

    /// Counts a read another process made of slot `slot` at `generation` (through the read
    /// index, without the shard) as a hit, and queues it for the eviction policy. False when
    /// that object is not open there (nothing counted). It takes no lease, so a report never
    /// holds an object back from a remove or eviction; its bytes are not counted (the reader's
    /// own length is not trusted, and reading the object's needs a lease).
    pub(crate) fn note_read(&self, slot: u32, generation: u32) -> bool {
        let Some(object) = self.slot(slot) else { return false };
        if object.word.state() != (generation, true) {
            return false;
        }
        let counters = self.counters.readers.mine();
        counters.reads.fetch_add(1, Ordering::Relaxed);
        counters.hits.fetch_add(1, Ordering::Relaxed);
        // A full queue drops the record, as for the index's own reads; the shard checks the
        // generation again before the policy sees it.
        let _ = self.accesses.push(u64::from(slot) << 32 | u64::from(generation));
        true
    }

    /// Gives back a lease `lease` returned.
    pub(crate) fn release(&self, lease: FastLease) {
        if let Some(object) = self.slot(lease.slot) {
            self.counters.readers.mine().leases_held.fetch_sub(1, Ordering::Relaxed);
            object.word.release();
        }
    }

    /// Heap bytes the index holds (tables, slot chunks, the access queue).
    pub(crate) fn heap_bytes(&self) -> u64 {
        let old: usize = self.old_tables.lock().map_or(0, |t| t.iter().map(|t| t.view().capacity()).sum());
        let tables = old + self.table().view().capacity();
        let chunks = self.chunks.iter().filter(|c| !c.load(Ordering::Relaxed).is_null()).count();
        let bytes = tables * std::mem::size_of::<AtomicU32>()
            + chunks * CHUNK_SLOTS * std::mem::size_of::<ObjectSlot>()
            + self.chunks.len() * 8
            + ACCESS_QUEUE * 8
            + self.key_bytes.load(Ordering::Relaxed);
        bytes as u64
    }
}

impl IndexWriter {
    /// The index readers use.
    pub(crate) fn shared(&self) -> &Arc<PublishedIndex> {
        &self.index
    }

    /// Keys in the table.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The slot holding the key whose hash is `hash`, `is_key(slot)` telling whether a
    /// candidate's key is the one wanted.
    pub(crate) fn find(&self, hash: u64, mut is_key: impl FnMut(u32) -> bool) -> Option<u32> {
        let table = self.index.table().view();
        let mut at = table.home(hash);
        for i in 0..table.capacity() {
            let e = table.entry(at).load(Ordering::Relaxed);
            if e == EMPTY {
                return None;
            }
            if table.layout.may_be(e, hash, i) && is_key(table.layout.slot(e)) {
                return Some(table.layout.slot(e));
            }
            at = (at + 1) & table.mask;
        }
        None
    }

    /// Adds a key that is not in the table; its slot must hold the key (`adopt`).
    pub(crate) fn insert(&mut self, hash: u64, slot: u32) {
        debug_assert!(slot < u32::MAX);
        debug_assert_eq!((self.hash)(self.key(slot)), hash, "slot {slot} inserted under another hash");
        let table = self.index.table().view();
        if !table.layout.fits(slot) {
            // A slot id beyond the table's layout (more objects than the index was made for):
            // a table whose entries have room for twice as many.
            self.rebuild(table.capacity(), table.entries.len(), EntryLayout::for_slots((u64::from(slot) + 1) * 2));
        }
        if (self.len + 1) * 4 > self.index.table().view().capacity() * MAX_LOAD_QUARTERS {
            self.grow();
        }
        self.index.table().view().place(hash, slot);
        self.len += 1;
    }

    /// The home of entry `e`, found at `at`: from its displacement, or from its key's hash
    /// when the displacement saturated.
    fn home_of(&self, table: &View<'_>, at: usize, e: u32) -> usize {
        let disp = table.layout.disp(e);
        if disp < table.layout.disp_max() {
            return at.wrapping_sub(disp) & table.mask;
        }
        table.home((self.hash)(self.key(table.layout.slot(e))))
    }

    /// Removes a key's entry, shifting the entries after it back so probes stay short. False
    /// when it was not found.
    pub(crate) fn remove(&mut self, hash: u64, slot: u32) -> bool {
        let index = Arc::clone(&self.index);
        let table = index.table().view();
        let mut hole = table.home(hash);
        let mut found = false;
        for i in 0..table.capacity() {
            let e = table.entry(hole).load(Ordering::Relaxed);
            if e == EMPTY {
                break;
            }
            if table.layout.may_be(e, hash, i) && table.layout.slot(e) == slot {
                found = true;
                break;
            }
            hole = (hole + 1) & table.mask;
        }
        if !found {
            return false;
        }
        index.seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        let mut at = hole;
        loop {
            at = (at + 1) & table.mask;
            let e = table.entry(at).load(Ordering::Relaxed);
            if e == EMPTY {
                break;
            }
            let home = self.home_of(&table, at, e);
            // The entry may move into the hole if its home is not between the hole and it.
            if (at.wrapping_sub(home) & table.mask) >= (at.wrapping_sub(hole) & table.mask) {
                table.entry(hole).store(table.layout.moved(e, hole.wrapping_sub(home) & table.mask), Ordering::Relaxed);
                hole = at;
            }
        }
        table.entry(hole).store(EMPTY, Ordering::Relaxed);
        index.seq.fetch_add(1, Ordering::Release);
        self.len -= 1;
        true
    }

    /// The slots in `table` and the hashes of their keys, in table order. The keys are read
    /// some slots ahead of hashing (an entry's slot and key are two dependent cache misses).
    fn entries_hashed(&self, table: &View<'_>) -> (Vec<u32>, Vec<u64>) {
        const AHEAD: usize = 8;
        let slots: Vec<u32> = table.entries[..table.capacity()]
            .iter()
            .map(|e| e.load(Ordering::Relaxed))
            .filter(|&e| e != EMPTY)
            .map(|e| table.layout.slot(e))
            .collect();
        let mut hashes = Vec::with_capacity(slots.len());
        for (i, &slot) in slots.iter().enumerate() {
            if let Some(ahead) = slots.get(i + 2 * AHEAD).and_then(|&s| self.index.slot(s)) {
                prefetch_line(ahead as *const ObjectSlot as *const u8);
            }
            if let Some(ahead) = slots.get(i + AHEAD).and_then(|&s| self.index.slot(s)) {
                prefetch_line(ahead.key.load(Ordering::Relaxed));
            }
            hashes.push((self.hash)(self.key(slot)));
        }
        (slots, hashes)
    }

    /// Doubles the table: in place while its reserved room allows, else into a new table. Keys
    /// are hashed again before any entry moves (an entry holds too few bits of its hash to find
    /// its home in a larger table); a reader probing while entries move may miss one, and does
    /// not trust that miss (the sequence changed); what it finds is checked against the key
    /// under a lease anyway.
    fn grow(&mut self) {
        let index = Arc::clone(&self.index);
        let old = index.table().view();
        let capacity = old.capacity() * 2;
        if capacity > old.entries.len() {
            self.rebuild(capacity, capacity, old.layout);
            return;
        }
        let (slots, hashes) = self.entries_hashed(&old);
        // Odd while entries move.
        index.seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        old.entries[..old.capacity()].iter().for_each(|e| e.store(EMPTY, Ordering::Relaxed));
        let table = index.table();
        table.mask.store(capacity - 1, Ordering::Release);
        let view = table.view();
        for (slot, hash) in slots.into_iter().zip(hashes) {
            view.place(hash, slot);
        }
        index.seq.fetch_add(1, Ordering::Release);
    }

    /// Moves every entry into a new table of `capacity` entries (`room` reserved) and `layout`;
    /// the old one is kept until the index goes (readers may still be probing it).
    fn rebuild(&mut self, capacity: usize, room: usize, layout: EntryLayout) {
        let index = Arc::clone(&self.index);
        let (slots, hashes) = self.entries_hashed(&index.table().view());
        let bigger = Table::new(capacity, room, layout);
        let view = bigger.view();
        for (slot, hash) in slots.into_iter().zip(hashes) {
            view.place(hash, slot);
        }
        index.seq.fetch_add(1, Ordering::Relaxed);
        let old = index.table.swap(Box::into_raw(Box::new(bigger)), Ordering::AcqRel);
        index.seq.fetch_add(1, Ordering::Release);
        // SAFETY: `old` came from Box::into_raw and is no longer the current table; it is kept
        // (not freed) because readers may still be probing it.
        let old = unsafe { Box::from_raw(old) };
        match index.old_tables.lock() {
            Ok(mut tables) => tables.push(old),
            // Leaked rather than freed under readers.
            Err(_) => std::mem::forget(old),
        };
    }

    /// The key arena, for the writer.
    fn keys(&mut self) -> &mut KeyArena {
        // SAFETY: the writer is the only one to touch the arena and `&mut self` makes this the
        // only reference to it (readers read key bytes through slots, never the arena).
        unsafe { &mut *self.index.keys.get() }
    }

    /// Gives slot `slot` to a new object (closed to readers): a copy of its key, which the slot
    /// keeps until `disown`, and its value's length. The slot must have no readers. False when
    /// the slot id is beyond what the index holds, the value is 8 TiB or more, the key is 2 MiB
    /// or more (the engine's own key bound is far lower), or readers still hold the slot.
    pub(crate) fn adopt(&mut self, slot: u32, generation: u32, key: &[u8], len: u64) -> bool {
        if len > MAX_VALUE_BYTES || key.len() > MAX_SLOT_KEY_BYTES {
            return false;
        }
        let Some(object) = self.slot_or_alloc(slot) else { return false };
        if object.word.readers() != 0 {
            debug_assert!(false, "slot {slot} reused under readers");
            return false;
        }
        debug_assert!(object.key.load(Ordering::Relaxed).is_null(), "slot {slot} adopted twice");
        self.unmirror(slot);
        let entry = self.keys().alloc(key, len);
        let held = self.keys().held_bytes();
        self.index.key_bytes.store(held, Ordering::Relaxed);
        let Some(object) = self.index.slot(slot) else { return false };
        object.word.reset(generation);
        object.value.store(0, Ordering::Relaxed);
        object.key.store(entry.as_ptr(), Ordering::Relaxed);
        true
    }

    /// Frees the key of a slot whose object is gone (closed, no readers left).
    pub(crate) fn disown(&mut self, slot: u32) {
        self.unmirror(slot);
        let Some(object) = self.index.slot(slot) else { return };
        debug_assert_eq!(object.word.readers(), 0, "slot {slot} disowned under readers");
        object.value.store(0, Ordering::Relaxed);
        let entry = object.key.swap(std::ptr::null_mut(), Ordering::Relaxed);
        if let Some(entry) = NonNull::new(entry) {
            // SAFETY: a non-null entry address was stored by `adopt` from the arena and is taken
            // back once (swapped out); no reader holds the slot, and readers read an entry only
            // under a lease.
            unsafe { self.keys().free(entry) };
            let held = self.keys().held_bytes();
            self.index.key_bytes.store(held, Ordering::Relaxed);
        }
    }

    /// The value's length and the key of an adopted slot ((0, empty) for a slot never adopted).
    fn entry(&self, slot: u32) -> (u64, &[u8]) {
        let Some(object) = self.index.slot(slot) else { return (0, &[]) };
        let Some(entry) = NonNull::new(object.key.load(Ordering::Relaxed)) else { return (0, &[]) };
        // SAFETY: this writer stored the entry (in the arena) in `adopt`, and frees it only in
        // `disown`, which takes `&mut self`: the borrow returned cannot outlive it.
        unsafe { keys::read(entry) }
    }

    /// The key of an adopted slot (empty for a slot never adopted).
    pub(crate) fn key(&self, slot: u32) -> &[u8] {
        self.entry(slot).1
    }

    /// The value's length of an adopted slot (0 for a slot never adopted).
    pub(crate) fn value_len(&self, slot: u32) -> u64 {
        self.entry(slot).0
    }

    /// Lets readers lease the object that adopted `slot` as `generation`, its value at `value`.
    /// False when the slot belongs to another generation.
    pub(crate) fn open(&mut self, slot: u32, generation: u32, value: NonNull<u8>) -> bool {
        let Some(object) = self.index.slot(slot) else { return false };
        let (current, open) = object.word.state();
        if current != generation {
            debug_assert!(false, "slot {slot} opened for generation {generation}, adopted by {current}");
            return false;
        }
        if !open {
            object.value.store(value.as_ptr() as usize, Ordering::Relaxed);
            object.word.open();
            if let Some(mirror) = &self.mirror {
                let (len, key) = self.entry(slot);
                mirror.borrow_mut().publish(slot, generation, key, value, len);
            }
        }
        true
    }

    /// Keeps new readers out of a slot; the readers still holding leases.
    pub(crate) fn close(&self, slot: u32) -> u32 {
        self.unmirror(slot);
        self.index.slot(slot).map_or(0, |o| o.word.close())
    }

    /// Closes a slot if nobody holds a lease on it (eviction).
    pub(crate) fn close_if_unused(&self, slot: u32) -> bool {
        let closed = self.index.slot(slot).is_none_or(|o| o.word.close_if_unused());
        if closed {
            self.unmirror(slot);
        }
        closed
    }

    /// The generation of the object that last adopted a slot (0 for a slot never adopted): the
    /// one place the shard keeps an object's generation.
    pub(crate) fn generation(&self, slot: u32) -> u32 {
        self.index.slot(slot).map_or(0, |o| o.word.state().0)
    }

    /// Readers holding leases on a slot now.
    pub(crate) fn readers(&self, slot: u32) -> u32 {
        self.index.slot(slot).map_or(0, |o| o.word.readers())
    }

    /// Whether a slot is open for `generation`.
    pub(crate) fn is_open(&self, slot: u32, generation: u32) -> bool {
        self.index.slot(slot).is_some_and(|o| o.word.state() == (generation, true))
    }

    /// Hands the reads recorded since the last call to `each(slot, generation)`.
    pub(crate) fn drain_accesses(&self, mut each: impl FnMut(u32, u32)) {
        for _ in 0..ACCESS_QUEUE {
            let Some(access) = self.index.accesses.pop() else { break };
            each((access >> 32) as u32, access as u32);
        }
    }

    fn slot_or_alloc(&mut self, slot: u32) -> Option<&ObjectSlot> {
        let chunk = self.index.chunks.get(slot as usize >> CHUNK_SLOTS_LOG2)?;
        if chunk.load(Ordering::Acquire).is_null() {
            let slots: ZeroedSlice<ObjectSlot> = ZeroedSlice::new(CHUNK_SLOTS);
            chunk.store(slots.into_raw(), Ordering::Release);
        }
        self.index.slot(slot)
    }
}

impl IndexWriter {
    /// The shard is stopping: no new lease is granted, and this waits up to `timeout` for the
    /// readers holding leases to give them back. False when some still hold one (the caller
    /// must then keep the objects' memory).
    pub(crate) fn shut(&mut self, timeout: std::time::Duration) -> bool {
        self.index.alive.store(false, Ordering::Release);
        if let Some(mirror) = &self.mirror {
            mirror.borrow_mut().close();
        }
        let chunks: Vec<&ObjectSlot> = self
            .index
            .chunks
            .iter()
            .map(|c| c.load(Ordering::Acquire))
            .filter(|c| !c.is_null())
            // SAFETY: non-null chunk pointers are live arrays of CHUNK_SLOTS slots (see `slot`).
            .flat_map(|c| (0..CHUNK_SLOTS).map(move |i| unsafe { &*c.add(i) }))
            .collect();
        chunks.iter().for_each(|o| {
            o.word.close();
        });
        let started = std::time::Instant::now();
        loop {
            if chunks.iter().all(|o| o.word.readers() == 0) {
                return true;
            }
            if started.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for IndexWriter {
    fn drop(&mut self) {
        // The shard is gone: nothing may lease its objects any more.
        self.index.alive.store(false, Ordering::Release);
    }
}

impl Drop for PublishedIndex {
    fn drop(&mut self) {
        // SAFETY: the current table came from Box::into_raw and nothing can read it any more
        // (dropping needs the last reference).
        drop(unsafe { Box::from_raw(*self.table.get_mut()) });
        for chunk in self.chunks.iter() {
            let ptr = chunk.load(Ordering::Relaxed);
            if !ptr.is_null() {
                // SAFETY: made by ZeroedSlice::into_raw with CHUNK_SLOTS elements, freed once.
                let slots = unsafe { ZeroedSlice::<ObjectSlot>::from_raw(ptr, CHUNK_SLOTS) };
                // Entries in blocks go with the arena; those allocated alone are freed here.
                let keys = self.keys.get_mut();
                for slot in slots.iter() {
                    let Some(entry) = NonNull::new(slot.key.swap(std::ptr::null_mut(), Ordering::Relaxed)) else {
                        continue;
                    };
                    // SAFETY: as in `disown`; nothing can read the index any more.
                    unsafe {
                        if KeyArena::allocated_alone(entry) {
                            keys.free(entry);
                        }
                    }
                }
            }
        }
    }
}

/// A heap array of a type whose all-zero bytes are a valid value (atomics), allocated zeroed so
/// the pages it never touches cost no memory (`mapped`: an anonymous mapping of its own, for
/// reservations mostly never touched; an allocator's zeroed block may be recycled memory it
/// clears, touching every page).
struct ZeroedSlice<T> {
    ptr: NonNull<T>,
    len: usize,
    mapped: bool,
}

/// Reservations of at least this many bytes are mapped rather than allocated.
const MAPPED_BYTES: usize = 256 << 10;

impl<T> ZeroedSlice<T> {
    fn new(len: usize) -> ZeroedSlice<T> {
        Self::allocate(len, false)
    }

    /// A reservation: mapped when large (see the type's comment).
    fn reserved(len: usize) -> ZeroedSlice<T> {
        Self::allocate(len, true)
    }

    fn allocate(len: usize, reservation: bool) -> ZeroedSlice<T> {
        let Ok(layout) = Layout::array::<T>(len) else { panic!("zeroed slice of {len} elements overflows") };
        if layout.size() == 0 {
            return ZeroedSlice { ptr: NonNull::dangling(), len, mapped: false };
        }
        let mapped = reservation && layout.size() >= MAPPED_BYTES && layout.align() <= 4096;
        let raw = if mapped {
            // SAFETY: a fresh private anonymous mapping: no file, no address hint; the result is
            // checked below. Its pages read as zero until written.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    layout.size(),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if raw == libc::MAP_FAILED {
                std::alloc::handle_alloc_error(layout)
            }
            raw.cast::<u8>()
        } else {
            // SAFETY: the layout has a non-zero size.
            unsafe { std::alloc::alloc_zeroed(layout) }
        };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { std::alloc::handle_alloc_error(layout) };
        ZeroedSlice { ptr, len, mapped }
    }

    fn into_raw(self) -> *mut T {
        let ptr = self.ptr.as_ptr();
        std::mem::forget(self);
        ptr
    }

    /// # Safety
    /// `ptr` must come from `into_raw` of a slice of `len` elements made by `new`, and be used
    /// once.
    unsafe fn from_raw(ptr: *mut T, len: usize) -> ZeroedSlice<T> {
        // SAFETY: the caller passes a pointer from into_raw, which is never null.
        ZeroedSlice { ptr: unsafe { NonNull::new_unchecked(ptr) }, len, mapped: false }
    }
}

impl<T> std::ops::Deref for ZeroedSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` zeroed elements were allocated, and zero is a valid T for the types used
        // here (atomics and structs of atomics).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for ZeroedSlice<T> {
    fn drop(&mut self) {
        let Ok(layout) = Layout::array::<T>(self.len) else { return };
        if self.mapped {
            // SAFETY: mapped in `allocate` with this size, unmapped once; atomics need no drop.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), layout.size()) };
        } else if layout.size() != 0 {
            // SAFETY: allocated in `new` with this layout; atomics need no drop.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
        }
    }
}

// SAFETY: the elements are atomics, shared between threads by design.
unsafe impl<T: Sync> Sync for ZeroedSlice<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for ZeroedSlice<T> {}

mod keys;
#[cfg(test)]
mod tests;
