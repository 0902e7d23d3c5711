//! One shard's state machine: its index, objects, arena slice allocator, eviction policy, lease
//! table and (when configured) its SSD tier.
//!
//! Sans-I/O: no threads, no syscalls, no clocks of its own (callers pass `now`). Disk work leaves
//! as `DiskOp`s through `take_disk_ops` and comes back through `on_disk_completion`, so the shard
//! loop runs it on io_uring and the tests run it on the simulator, with the same code. Requests
//! that must wait (an SSD load, room freed by a demotion, a durable write) finish later through
//! their `Done` callback. It never copies object bytes for callers (they copy under the leases it
//! grants) and never frees memory that a lease, a pin, an unfinished write or an in-flight I/O can
//! still reach.

#[cfg(test)]
mod sim_tests;
mod ssd;
#[cfg(test)]
pub(crate) mod tests;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use kvtide_tiers::dram::{Allocation, ArenaSlice, OffsetAllocator};
use kvtide_tiers::eviction::{EntryId, Eviction, EvictionPolicy};
use kvtide_tiers::ssd::record::{self, HEADER_BYTES};

use super::landing::Landing;
use super::published::{IndexWriter, MAX_VALUE_BYTES};
use kvtide_tiers::ssd::SsdLocation;
use slab::Slab;

use crate::error::{Error, OpenError, Result};
use crate::stats::ShardCounters;

pub(crate) use ssd::largest_value_bytes;
use ssd::SsdState;
pub use ssd::{RecoveryReport, SsdConfig, DEFAULT_LOAD_PIECE_BYTES, DEFAULT_MAX_PENDING_TOMBSTONES};

/// Called once with a request's results, possibly after disk I/O.
pub type Done<T> = Box<dyn FnOnce(T)>;

/// Where an object lives and what reading it from SSD costs in DRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub in_dram: bool,
    pub len: u64,
    /// DRAM a load of it occupies (its record size).
    pub staging_bytes: u64,
}

/// Identifies one object version in a shard; the generation makes stale references harmless.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ObjectRef {
    pub id: u32,
    pub generation: u32,
}

/// Identifies one lease; releasing a stale or duplicate id is a counted no-op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId {
    pub slot: u32,
    pub generation: u32,
}

impl LeaseId {
    /// Stands in the grant of a lease taken through the published index: given back there,
    /// never to the shard (generation 0 is never issued, so the shard would ignore it).
    pub const PUBLISHED: LeaseId = LeaseId { slot: u32::MAX, generation: 0 };
}

/// Where a leased object's bytes are, for as long as the lease is held.
#[derive(Clone, Debug)]
pub struct ReadGrant {
    pub lease: LeaseId,
    /// The value's first byte; with `landing`, the start of the record image being loaded (the
    /// value starts at the offset `Landing::wait_ready` returns).
    pub ptr: NonNull<u8>,
    pub len: u64,
    /// An early grant (`LeaseRead { early }`) of an object still loading from SSD: its bytes are
    /// usable only as far as this says.
    pub landing: Option<Arc<Landing>>,
}

// SAFETY: a grant is an address plus a lease id; the lease keeps the bytes in place and unchanged
// until it is released, so any thread may read them meanwhile.
unsafe impl Send for ReadGrant {}

/// Where a reserved (not yet visible) object's bytes go.
#[derive(Clone, Copy, Debug)]
pub struct WriteGrant {
    pub object: ObjectRef,
    pub ptr: NonNull<u8>,
    pub len: u64,
}

// SAFETY: the reservation gives the holder exclusive use of these bytes until commit or abort;
// nothing else can read or reuse them meanwhile.
unsafe impl Send for WriteGrant {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjectState {
    /// Allocated for a writer, not visible to readers.
    Reserved,
    /// Visible through the index.
    Live,
    /// Unlinked (replaced or removed); freed when its last lease and I/O are gone.
    Retired,
    /// A reservation given up while readers that follow its writer still lease it; freed when
    /// their last lease is gone. Never visible.
    Abandoned,
}

/// The shard's record of one object, 16 bytes. Its key and its value's length are kept once, in
/// the object's published slot (`IndexWriter::adopt`), which readers compare keys through, and
/// so is its generation (the slot's lease word); what only a shard with an SSD tier needs is in
/// its `SsdFacts`.
struct Object {
    /// DRAM copy. With an SSD tier it holds a whole record image (header, key, value).
    dram: Option<Allocation>,
    /// Leases the shard granted, at most `u16::MAX` (`lease_room` refuses more).
    leases: u16,
    /// At most `u16::MAX` (`pin` refuses more).
    pins: u16,
    /// In-flight writes reading `dram`, or a load filling it: at most one load and two writes.
    io_refs: u8,
    /// `TRANSIENT` and `SHADOWED`.
    flags: u8,
    /// The shard loop turn that committed it, its low 8 bits: only compared with this turn's,
    /// so an object committed 256 turns earlier is only spared from background eviction once
    /// more.
    committed_turn: u8,
    state: ObjectState,
}

/// Loaded without promotion: the DRAM copy goes when the last reader does.
const TRANSIENT: u8 = 1;
/// An older SSD record of this version may still be readable on disk (its SSD copy was dropped
/// by a reclaim that has not freed the segment yet): removes and upserts tombstone it.
const SHADOWED: u8 = 2;

/// What an object of a shard with an SSD tier has beside its record, 32 bytes (a DRAM-only shard
/// keeps none: its objects have no record image, sequence number or SSD copy).
#[derive(Clone, Copy, Debug, Default)]
struct SsdFacts {
    /// Order of versions on disk: recovery keeps the highest.
    seq: u64,
    /// Where the value starts inside `dram` (a record header, key and checksum table before it).
    value_offset: u32,
    /// SSD copy, once its write completed.
    copy: Option<PackedLocation>,
}

/// An object's SSD location in 20 bytes (an `Option<SsdLocation>` takes 40): offset and length
/// in blocks (records start and end on block boundaries; a segment holds at most `u32::MAX`
/// blocks, which opening checks), the epoch as two halves so the record packs it without padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PackedLocation {
    segment_plus_one: std::num::NonZeroU32,
    offset_blocks: u32,
    record_blocks: u32,
    epoch: [u32; 2],
}

impl PackedLocation {
    /// None for a location that does not pack (not on block boundaries, or beyond `u32::MAX`
    /// blocks or segments): a tier opened with segments that large is refused.
    fn new(l: SsdLocation) -> Option<PackedLocation> {
        let blocks = |bytes: u64| {
            bytes.is_multiple_of(record::BLOCK_BYTES).then(|| u32::try_from(bytes / record::BLOCK_BYTES).ok()).flatten()
        };
        Some(PackedLocation {
            segment_plus_one: std::num::NonZeroU32::new(l.segment.checked_add(1)?)?,
            offset_blocks: blocks(l.offset)?,
            record_blocks: blocks(l.record_bytes)?,
            epoch: [l.epoch as u32, (l.epoch >> 32) as u32],
        })
    }

    fn get(self) -> SsdLocation {
        SsdLocation {
            segment: self.segment_plus_one.get() - 1,
            offset: u64::from(self.offset_blocks) * record::BLOCK_BYTES,
            record_bytes: u64::from(self.record_blocks) * record::BLOCK_BYTES,
            epoch: u64::from(self.epoch[1]) << 32 | u64::from(self.epoch[0]),
        }
    }
}

impl Object {
    /// A record with no leases, pins, I/O or flags.
    fn new(dram: Option<Allocation>, state: ObjectState) -> Object {
        Object { dram, leases: 0, pins: 0, io_refs: 0, flags: 0, committed_turn: 0, state }
    }

    fn transient(&self) -> bool {
        self.flags & TRANSIENT != 0
    }

    fn set_transient(&mut self, on: bool) {
        self.flags = if on { self.flags | TRANSIENT } else { self.flags & !TRANSIENT };
    }

    fn shadowed(&self) -> bool {
        self.flags & SHADOWED != 0
    }

    fn mark_shadowed(&mut self) {
        self.flags |= SHADOWED;
    }

    fn evictable(&self) -> bool {
        self.leases == 0
            && self.io_refs == 0
            && self.pins == 0
            && self.dram.is_some()
            && self.state == ObjectState::Live
    }
}

struct Lease {
    object: u32,
    generation: u32,
}

/// Limits a shard enforces, derived from the builder.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    pub high_watermark_bytes: u64,
    pub low_watermark_bytes: u64,
    pub policy: EvictionPolicy,
    pub align_bytes: u64,
    pub max_objects: u32,
    pub max_leases: u32,
}

/// Per-slot results of one batch request, answered through `done` once every slot resolved.
struct Batch<T> {
    results: Vec<Option<Result<T>>>,
    remaining: usize,
    done: Option<Done<Vec<Result<T>>>>,
}

impl<T> Batch<T> {
    fn new(n: usize, done: Done<Vec<Result<T>>>) -> Batch<T> {
        Batch { results: (0..n).map(|_| None).collect(), remaining: n, done: Some(done) }
    }

    /// Records slot `slot`'s result; the first one wins (duplicate notifications are harmless).
    fn resolve(&mut self, slot: usize, result: Result<T>) {
        if let Some(r) = self.results.get_mut(slot) {
            if r.is_none() {
                *r = Some(result);
                self.remaining -= 1;
            }
        }
    }

    fn finish(mut self) {
        let results =
            self.results.into_iter().map(|r| r.unwrap_or(Err(Error::Internal("batch slot unresolved")))).collect();
        if let Some(done) = self.done.take() {
            done(results);
        }
    }
}

/// A batch read, waiting for SSD loads when some keys are on SSD only.
struct PendingRead {
    batch: Batch<ReadGrant>,
    keys: Vec<Box<[u8]>>,
    deadline: Option<Instant>,
    /// Grant SSD-resident keys when their load starts (with a `Landing`), not when it ends.
    early: bool,
}

/// Work parked until memory frees up, retried in arrival order.
enum Waiter {
    Reserve { pending: usize, slot: usize, key: Box<[u8]>, len: u64, upsert: bool },
    Load { pending: usize, slot: usize },
}

/// Object `id`'s SSD copy in a shard's facts (none on a DRAM-only shard, whose table is empty).
fn ssd_copy_in(facts: &[SsdFacts], id: u32) -> Option<PackedLocation> {
    facts.get(id as usize).and_then(|f| f.copy)
}

/// The index hash of object `id`'s key (what the index and the policy were given for it).
/// A shard's page of a key scan: the keys and the next object slot (None: the shard is done).
pub(crate) type ScannedKeys = (Vec<Box<[u8]>>, Option<u32>);

fn index_key_hash(index: &IndexWriter, id: u32) -> u64 {
    super::hash::key_index_hash(index.key(id))
}

/// What `pin` and a pinned upsert answer for an object that holds `u16::MAX` pins already.
fn pin_count_too_large() -> Error {
    Error::TooLarge { what: "pin count", len: u64::from(u16::MAX) + 1, max: u64::from(u16::MAX) }
}

/// Object slots one `scan_keys` call looks at, at most: a scan never holds a shard for long.
pub const SCAN_SLOTS: usize = 1 << 16;

/// The shard's state. See the module comment.
pub struct ShardCore {
    /// Keys to object slots, published for reads without a message (see `published`).
    index: IndexWriter,
    /// Objects whose last use waits for published readers to give their leases back (slot,
    /// generation); looked at every turn.
    draining: Vec<(u32, u32)>,
    config: ShardConfig,
    slice: ArenaSlice,
    allocator: OffsetAllocator,
    objects: Slab<Object>,
    /// Beside `objects`, by object id, when the shard has an SSD tier (empty otherwise).
    ssd_facts: Vec<SsdFacts>,
    policy: Box<dyn Eviction>,
    leases: Slab<Lease>,
    lease_deadlines: BinaryHeap<Reverse<(Instant, LeaseId)>>,
    next_generation: u32,
    next_seq: u64,
    counters: Arc<ShardCounters>,
    ssd: Option<SsdState>,
    pending_reads: Slab<PendingRead>,
    pending_reserves: Slab<Batch<WriteGrant>>,
    pending_commits: Slab<Batch<()>>,
    waiters: VecDeque<Waiter>,
    /// DRAM bytes that in-flight demotions will free.
    demoting_bytes: u64,
    /// DRAM bytes of a clean shutdown's flush writes in flight (bounded: `FLUSH_BYTES_IN_FLIGHT`).
    flushing_bytes: u64,
    /// The last eviction found a dirty victim that must wait for SSD room.
    demotion_waiting: bool,
    /// Counts the shard loop's turns; the background eviction never takes an object committed
    /// in the current turn (its put has just been acknowledged).
    turn: u64,
    /// A caller handled a request on the lent core since the loop's last turn began: those
    /// requests count as the next turn's (`begin_lent_request`).
    lent_since_turn: bool,
    retrying: bool,
}

impl ShardCore {
    /// A DRAM-only shard over `slice`, publishing counters to `counters`.
    #[cfg(test)]
    pub fn new(config: ShardConfig, slice: ArenaSlice, counters: Arc<ShardCounters>) -> Result<Self, OpenError> {
        let index = IndexWriter::new(Arc::clone(&counters), config.max_objects, super::hash::key_index_hash);
        Self::with_ssd(config, slice, counters, None, index)
    }

    /// A shard with an SSD tier when `ssd` is given (call `recover` before serving).
    pub fn with_ssd(
        mut config: ShardConfig,
        slice: ArenaSlice,
        counters: Arc<ShardCounters>,
        ssd: Option<SsdConfig>,
        index: IndexWriter,
    ) -> Result<Self, OpenError> {
        let capacity = slice.len_bytes() as u64;
        if ssd.is_some() {
            // Objects are record images written and read with O_DIRECT straight from DRAM.
            config.align_bytes = config.align_bytes.max(record::BLOCK_BYTES);
        }
        let mut allocator = OffsetAllocator::new(capacity, config.align_bytes, config.max_objects)?;
        let ssd = match ssd {
            Some(c) => Some(SsdState::new(c, &mut allocator, &slice).ok_or_else(|| {
                OpenError::Config(format!(
                    "a {capacity}-byte arena slice cannot hold the SSD tier's scratch blocks; raise dram_bytes"
                ))
            })?),
            None => None,
        };
        counters.capacity_bytes.store(allocator.capacity_bytes(), RELAXED);
        counters.bytes_used.store(allocator.used_bytes(), RELAXED);
        Ok(ShardCore {
            index,
            draining: Vec::new(),
            policy: config.policy.build(capacity),
            config,
            slice,
            allocator,
            objects: Slab::new(),
            ssd_facts: Vec::new(),
            leases: Slab::new(),
            lease_deadlines: BinaryHeap::new(),
            next_generation: 1,
            next_seq: 1,
            counters,
            ssd,
            pending_reads: Slab::new(),
            pending_reserves: Slab::new(),
            pending_commits: Slab::new(),
            waiters: VecDeque::new(),
            demoting_bytes: 0,
            flushing_bytes: 0,
            demotion_waiting: false,
            turn: 0,
            lent_since_turn: false,
            retrying: false,
        })
    }

    /// Counters this shard publishes.
    pub fn counters(&self) -> &Arc<ShardCounters> {
        &self.counters
    }

    /// Bytes this shard's objects can use.
    #[cfg(test)]
    pub fn capacity_bytes(&self) -> u64 {
        self.allocator.capacity_bytes()
    }

    // ---- reads ------------------------------------------------------------------------------

    /// Leases each key for reading; SSD-resident keys are loaded first. `deadline` is the TTL
    /// backstop for explicit leases (None for the RAII leases of a running copy).
    /// With `early`, an SSD-resident key is granted as soon as its load starts (see `ReadGrant`).
    pub fn lease_read_batch(
        &mut self,
        keys: Vec<Box<[u8]>>,
        deadline: Option<Instant>,
        early: bool,
        done: Done<Vec<Result<ReadGrant>>>,
    ) {
        let n = keys.len();
        let pending = self.pending_reads.insert(PendingRead { batch: Batch::new(n, done), keys, deadline, early });
        for slot in 0..n {
            if !self.start_read(pending, slot) {
                self.waiters.push_back(Waiter::Load { pending, slot });
            }
        }
        self.finish_read_if_done(pending);
    }

    /// Tries slot `slot` of a pending read: a DRAM hit resolves it now, an SSD object starts or
    /// joins a load, a miss resolves it as NotFound. False when it must wait for memory.
    fn start_read(&mut self, pending: usize, slot: usize) -> bool {
        let Some(p) = self.pending_reads.get(pending) else { return true };
        let deadline = p.deadline;
        // Looked up in place (disjoint fields): no copy of the key per read.
        let Some(id) = self.find(&p.keys[slot]) else {
            self.counters.misses.fetch_add(1, RELAXED);
            self.resolve_read(pending, slot, Err(Error::NotFound));
            return true;
        };
        if self.objects[id as usize].dram.is_some() {
            let result = self.grant_lease(id, deadline);
            self.resolve_read(pending, slot, result);
            return true;
        }
        self.load_for_read(id, pending, slot)
    }

    fn resolve_read(&mut self, pending: usize, slot: usize, result: Result<ReadGrant>) {
        if let Some(p) = self.pending_reads.get_mut(pending) {
            p.batch.resolve(slot, result);
        }
    }

    fn finish_read_if_done(&mut self, pending: usize) {
        if self.pending_reads.get(pending).is_some_and(|p| p.batch.remaining == 0) {
            self.pending_reads.remove(pending).batch.finish();
        }
    }

    /// Leases a DRAM-resident live object.
    fn grant_lease(&mut self, id: u32, deadline: Option<Instant>) -> Result<ReadGrant> {
        self.lease_room(id)?;
        let ptr = self.value_ptr(id)?;
        let len = self.index.value_len(id);
        let lease = self.add_lease(id);
        if let Some(deadline) = deadline {
            self.lease_deadlines.push(Reverse((deadline, lease)));
        }
        self.policy.access(id);
        self.counters.hits.fetch_add(1, RELAXED);
        self.counters.bytes_read.fetch_add(len, RELAXED);
        Ok(ReadGrant { lease, ptr, len, landing: None })
    }

    /// Releases a lease. Stale and duplicate ids are ignored (and counted).
    pub fn release(&mut self, lease: LeaseId) {
        let live = self.leases.get(lease.slot as usize).is_some_and(|l| l.generation == lease.generation);
        if !live {
            self.counters.stale_releases.fetch_add(1, RELAXED);
            return;
        }
        let entry = self.leases.remove(lease.slot as usize);
        self.counters.leases_held.fetch_sub(1, RELAXED);
        let id = entry.object;
        let object = &mut self.objects[id as usize];
        debug_assert!(object.leases > 0, "lease count underflow");
        object.leases -= 1;
        if object.leases == 0 {
            self.after_last_use(id);
        }
    }

    /// An object nobody reads or writes any more: free it if retired, drop its DRAM copy if it
    /// was only loaded for this read.
    fn after_last_use(&mut self, id: u32) {
        self.publish(id);
        let object = &self.objects[id as usize];
        if object.leases > 0 || object.io_refs > 0 {
            return;
        }
        let done_with = matches!(object.state, ObjectState::Retired | ObjectState::Abandoned)
            || (object.transient() && self.has_ssd_copy(id));
        if done_with && self.index.readers(id) > 0 {
            // Published readers give their leases back without a message: look again next turn.
            self.draining.push((id, self.index.generation(id)));
            return;
        }
        if matches!(object.state, ObjectState::Retired | ObjectState::Abandoned) {
            self.free_object(id);
        } else if object.transient() && self.has_ssd_copy(id) {
            self.drop_dram(id);
        }
    }

    /// Releases explicit leases whose TTL passed. Returns how many expired.
    pub fn expire_leases(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        while let Some(Reverse((deadline, lease))) = self.lease_deadlines.peek().copied() {
            if deadline > now {
                break;
            }
            self.lease_deadlines.pop();
            if self.leases.get(lease.slot as usize).is_some_and(|l| l.generation == lease.generation) {
                self.release(lease);
                self.counters.leases_expired.fetch_add(1, RELAXED);
                expired += 1;
            }
        }
        expired
    }

    /// The earliest TTL deadline still pending, for the shard's timer.
    pub fn next_lease_deadline(&self) -> Option<Instant> {
        self.lease_deadlines.peek().map(|Reverse((deadline, _))| *deadline)
    }

    /// Where `key` lives, for restore planning.
    pub fn locate(&self, key: &[u8]) -> Option<Location> {
        let id = self.find(key)?;
        let o = &self.objects[id as usize];
        let len = self.index.value_len(id);
        let staging_bytes =
            self.ssd_copy(id).map_or_else(|| self.layout(self.index.key(id).len(), len).0, |l| l.record_bytes);
        Some(Location { in_dram: o.dram.is_some(), len, staging_bytes })
    }

    /// Live keys (any tier) that start with `prefix`, looking at object slots from `from` on:
    /// at most `limit` keys and `SCAN_SLOTS` slots. The next slot to look at, None once every
    /// slot was seen. A key present and not replaced for a whole scan is
    /// returned exactly once: its slot does not move while it is live.
    pub fn scan_keys(&self, prefix: &[u8], from: u32, limit: usize) -> ScannedKeys {
        let end = self.objects.capacity();
        let mut keys = Vec::new();
        let mut slot = from as usize;
        let stop = slot.saturating_add(SCAN_SLOTS).min(end);
        while slot < stop && keys.len() < limit {
            if let Some(o) = self.objects.get(slot) {
                let key = self.index.key(slot as u32);
                if o.state == ObjectState::Live && key.starts_with(prefix) {
                    keys.push(key.into());
                }
            }
            slot += 1;
        }
        let next = (slot < end).then(|| u32::try_from(slot).ok()).flatten();
        (keys, next)
    }

    /// True if `key` is present in any tier (and counts a hit or miss).
    pub fn exists(&mut self, key: &[u8]) -> bool {
        let found = self.find(key).is_some();
        let counter = if found { &self.counters.hits } else { &self.counters.misses };
        counter.fetch_add(1, RELAXED);
        found
    }

    // ---- writes -----------------------------------------------------------------------------

    /// Allocates room for new versions of keys, evicting (and demoting) as needed. Objects stay
    /// invisible until committed. Items that must wait for demotions finish later.
    pub fn reserve_batch(&mut self, items: Vec<(Box<[u8]>, u64)>, upsert: bool, done: Done<Vec<Result<WriteGrant>>>) {
        let pending = self.pending_reserves.insert(Batch::new(items.len(), done));
        for (slot, (key, len)) in items.into_iter().enumerate() {
            match self.try_reserve(&key, len, upsert) {
                Ok(Some(grant)) => self.resolve_reserve(pending, slot, Ok(grant)),
                Ok(None) => self.waiters.push_back(Waiter::Reserve { pending, slot, key, len, upsert }),
                Err(e) => self.resolve_reserve(pending, slot, Err(e)),
            }
        }
        self.finish_reserve_if_done(pending);
    }

    /// Reserves room for one key now: the grant or the failure, or None when the key would
    /// have to wait for demotions (then nothing was reserved; ask with `reserve_batch`).
    pub fn reserve_now(&mut self, key: &[u8], len: u64, upsert: bool) -> Option<Result<WriteGrant>> {
        self.try_reserve(key, len, upsert).transpose()
    }

    fn resolve_reserve(&mut self, pending: usize, slot: usize, result: Result<WriteGrant>) {
        if let Some(p) = self.pending_reserves.get_mut(pending) {
            p.resolve(slot, result);
        }
    }

    fn finish_reserve_if_done(&mut self, pending: usize) {
        if self.pending_reserves.get(pending).is_some_and(|p| p.remaining == 0) {
            self.pending_reserves.remove(pending).finish();
        }
    }

    /// Reserves now (`Some`), must wait for demotions (`None`), or fails.
    fn try_reserve(&mut self, key: &[u8], len: u64, upsert: bool) -> Result<Option<WriteGrant>> {
        if !upsert && self.find(key).is_some() {
            return Err(Error::AlreadyExists);
        }
        let (bytes, value_offset) = self.layout(key.len(), len);
        let value_offset = u32::try_from(value_offset).map_err(|_| Error::TooLarge {
            what: "value",
            len,
            max: self.allocator.capacity_bytes(),
        })?;
        if bytes > self.allocator.capacity_bytes() {
            return Err(Error::TooLarge { what: "value", len, max: self.allocator.capacity_bytes() });
        }
        if len > MAX_VALUE_BYTES {
            return Err(Error::TooLarge { what: "value", len, max: MAX_VALUE_BYTES });
        }
        if self.objects.len() >= self.config.max_objects as usize && !self.evict_one_now() {
            self.counters.no_space.fetch_add(1, RELAXED);
            return Err(Error::NoSpace);
        }
        let Some(allocation) = self.allocate_or_wait(bytes)? else { return Ok(None) };
        let generation = self.bump_generation();
        let offset = self.allocator.offset_of(&allocation);
        let reserved = self.allocator.len_of(&allocation);
        let object = Object::new(Some(allocation), ObjectState::Reserved);
        let facts = SsdFacts { value_offset, ..SsdFacts::default() };
        let id = match self.insert_object(object, generation, facts, key, len) {
            Ok(id) => id,
            Err(object) => {
                if let Some(allocation) = object.dram {
                    self.allocator.free(allocation);
                }
                return Err(Error::Internal("no published slot for a new object"));
            }
        };
        self.counters.bytes_used.fetch_add(reserved, RELAXED);
        self.counters.writes_in_flight.fetch_add(1, RELAXED);
        if value_offset > 0 {
            // The record image carries its key right after the header.
            let key_ptr = self
                .slice
                .ptr_at(offset + HEADER_BYTES as u64, key.len() as u64)
                .ok_or(Error::Internal("key outside slice"))?;
            // SAFETY: the allocation is ours alone (reserved, unpublished) and holds the key range.
            unsafe { std::ptr::copy_nonoverlapping(key.as_ptr(), key_ptr.as_ptr(), key.len()) };
        }
        let ptr = self
            .slice
            .ptr_at(offset + u64::from(value_offset), len)
            .ok_or(Error::Internal("allocation outside slice"))?;
        Ok(Some(WriteGrant { object: ObjectRef { id, generation }, ptr, len }))
    }

    /// Bytes to allocate for an object and where its value starts in them.
    fn layout(&self, key_len: usize, len: u64) -> (u64, u64) {
        if self.ssd.is_some() {
            (record::record_bytes(key_len, len), record::value_offset(key_len, len))
        } else {
            // A zero-length object still takes one aligned unit, so every object has an address.
            (len.max(1), 0)
        }
    }

    /// Makes reserved objects visible. With `upsert`, an existing version is unlinked and freed
    /// once its readers finish; without, an existing key fails the commit (and frees the
    /// reservation). With write-through, each result waits until its record is durable.
    /// With `pin`, each object is pinned as it is published (never evictable in between).
    pub fn commit_batch(&mut self, objects: Vec<ObjectRef>, upsert: bool, pin: bool, done: Done<Vec<Result<()>>>) {
        let pending = self.pending_commits.insert(Batch::new(objects.len(), done));
        for (slot, object) in objects.into_iter().enumerate() {
            match self.commit_now(object, upsert, pin) {
                Ok(id) if self.write_through() => self.write_through_record(id, pending, slot),
                Ok(id) => {
                    self.publish(id);
                    self.resolve_commit(pending, slot, Ok(()))
                }
                Err(e) => self.resolve_commit(pending, slot, Err(e)),
            }
        }
        self.finish_commit_if_done(pending);
    }

    /// Commits one reservation now, as `commit_batch` does; None with write-through (whose
    /// result waits for its record: ask with `commit_batch`), and then nothing was done.
    pub fn commit_now_unless_durable(&mut self, object: ObjectRef, upsert: bool, pin: bool) -> Option<Result<()>> {
        if self.write_through() {
            return None;
        }
        Some(self.commit_now(object, upsert, pin).map(|id| self.publish(id)))
    }

    fn resolve_commit(&mut self, pending: usize, slot: usize, result: Result<()>) {
        if let Some(p) = self.pending_commits.get_mut(pending) {
            p.resolve(slot, result);
        }
    }

    fn finish_commit_if_done(&mut self, pending: usize) {
        if self.pending_commits.get(pending).is_some_and(|p| p.remaining == 0) {
            self.pending_commits.remove(pending).finish();
        }
    }

    fn commit_now(&mut self, object: ObjectRef, upsert: bool, pin: bool) -> Result<u32> {
        if !self.is_reserved(object) {
            return Err(Error::Internal("commit of an unknown reservation"));
        }
        self.counters.writes_in_flight.fetch_sub(1, RELAXED);
        let id = object.id;
        // Hashed once: the lookup, the index entry and the policy's entry share it.
        let hash = self.key_hash(id);
        let mut inherited_pins = 0;
        let mut indexed = false;
        if let Some(old) = self.find_hashed(self.index.key(id), hash) {
            if !upsert {
                self.drop_reservation(id);
                return Err(Error::AlreadyExists);
            }
            if pin && self.objects[old as usize].pins == u16::MAX {
                // The new version would inherit one pin more than an object holds.
                self.drop_reservation(id);
                return Err(pin_count_too_large());
            }
            let previous = &self.objects[old as usize];
            // Write-back: the new version may never reach SSD, so the old record must not win
            // after a restart. (Write-through writes the new record durably before it answers.)
            let supersedes_ssd = !self.write_through() && self.may_have_ssd_record(old) && self.ssd.is_some();
            if supersedes_ssd {
                if let Err(e) = self.tombstone_room() {
                    self.drop_reservation(id);
                    return Err(e);
                }
            }
            inherited_pins = previous.pins;
            // The new entry goes in before the old one leaves, so a published lookup meanwhile
            // finds one of them (both closed: it asks the shard) and never misses the key.
            self.index_insert(id, hash);
            indexed = true;
            self.unlink_hashed(old, hash);
            if supersedes_ssd {
                let key: Box<[u8]> = self.index.key(id).into();
                self.queue_tombstone(&key);
            }
        }
        let seq = self.bump_seq();
        let entry = &mut self.objects[id as usize];
        entry.state = ObjectState::Live;
        // Checked above: an object at the bound refuses a pinned upsert.
        entry.pins = inherited_pins.saturating_add(u16::from(pin));
        entry.committed_turn = self.turn as u8;
        if let Some(facts) = self.ssd_facts.get_mut(id as usize) {
            facts.seq = seq;
        }
        let len = self.index.value_len(id);
        if !indexed {
            self.index_insert(id, hash);
        }
        if inherited_pins == 0 && !pin {
            self.policy.insert(id as EntryId, hash, len.max(1));
        } else {
            // Pinned now, or the old version's pins moved here (`unlink` counted it out).
            self.counters.pinned_objects.fetch_add(1, RELAXED);
        }
        self.counters.objects.fetch_add(1, RELAXED);
        self.counters.dram_objects.fetch_add(1, RELAXED);
        self.counters.puts.fetch_add(1, RELAXED);
        self.counters.bytes_written.fetch_add(len, RELAXED);
        Ok(id)
    }

    /// Drops a reservation (the writer failed or gave up). Stale ids are ignored.
    pub fn abort(&mut self, object: ObjectRef) {
        if self.is_reserved(object) {
            self.counters.writes_in_flight.fetch_sub(1, RELAXED);
            self.drop_reservation(object.id);
        }
    }

    /// Frees a reservation that will not be published, or leaves it to its followers' last
    /// lease (`writes_in_flight` already counted it out).
    fn drop_reservation(&mut self, id: u32) {
        let object = &mut self.objects[id as usize];
        if object.leases > 0 {
            object.state = ObjectState::Abandoned;
        } else {
            self.free_object(id);
        }
    }

    /// Leases an object by reference while it is reserved (readers that follow a progressive
    /// put) or live in DRAM; NotFound once it was aborted, replaced or left DRAM.
    pub fn lease_object(&mut self, object: ObjectRef) -> Result<ReadGrant> {
        let Some(o) = self.objects.get(object.id as usize) else { return Err(Error::NotFound) };
        let usable = self.index.generation(object.id) == object.generation
            && matches!(o.state, ObjectState::Reserved | ObjectState::Live)
            && o.dram.is_some();
        // A load fills an object without a DRAM copy and installs the copy as it ends.
        debug_assert!(!usable || self.load_token(object.id).is_none(), "object {} loading with a DRAM copy", object.id);
        if !usable {
            return Err(Error::NotFound);
        }
        self.lease_room(object.id)?;
        let ptr = self.value_ptr(object.id)?;
        let len = self.index.value_len(object.id);
        let lease = self.add_lease(object.id);
        Ok(ReadGrant { lease, ptr, len, landing: None })
    }

    /// Removes `key` and answers through `done`: at once, or with write-through once the
    /// tombstone that keeps it removed across a crash is durable (`Error::Io` if it never will
    /// be: the key is gone here but may come back after a restart).
    pub fn remove_then(&mut self, key: &[u8], force: bool, done: Done<Result<()>>) {
        match self.remove_object(key, force) {
            Ok(Some(tombstone)) if self.write_through() => self.await_tombstone(tombstone, done),
            Ok(_) => done(Ok(())),
            Err(e) => done(Err(e)),
        }
    }

    /// Removes `key` without waiting for its tombstone (see `remove_object`).
    #[cfg(test)]
    pub fn remove(&mut self, key: &[u8], force: bool) -> Result<()> {
        self.remove_object(key, force).map(|_| ())
    }

    /// Removes `key`. A leased or pinned object is refused unless `force`; forced, its readers
    /// keep their bytes until they release them. With an SSD tier, a tombstone keeps it removed
    /// across restarts: returns its sequence number when one was queued.
    fn remove_object(&mut self, key: &[u8], force: bool) -> Result<Option<u64>> {
        let Some(id) = self.find(key) else {
            return Err(Error::NotFound);
        };
        let object = &self.objects[id as usize];
        if !force && (object.leases > 0 || self.index.readers(id) > 0) {
            return Err(Error::Leased);
        }
        if !force && object.pins > 0 {
            return Err(Error::Pinned);
        }
        let on_ssd = self.may_have_ssd_record(id);
        if on_ssd {
            // Every acknowledged remove gets its tombstone: past the queue's bound, refuse.
            self.tombstone_room()?;
        }
        self.unlink(id);
        let tombstone = on_ssd.then(|| self.queue_tombstone(key));
        self.counters.removes.fetch_add(1, RELAXED);
        Ok(tombstone)
    }

    /// Pins `key`: it is not evicted until unpinned as often as pinned.
    pub fn pin(&mut self, key: &[u8]) -> Result<()> {
        let id = self.find(key).ok_or(Error::NotFound)?;
        let object = &mut self.objects[id as usize];
        object.pins = object.pins.checked_add(1).ok_or_else(pin_count_too_large)?;
        if object.pins == 1 {
            self.policy.remove(id as EntryId);
            self.counters.pinned_objects.fetch_add(1, RELAXED);
        }
        Ok(())
    }

    /// Undoes one `pin`.
    pub fn unpin(&mut self, key: &[u8]) -> Result<()> {
        let id = self.find(key).ok_or(Error::NotFound)?;
        let object = &mut self.objects[id as usize];
        if object.pins == 0 {
            return Err(Error::NotPinned);
        }
        object.pins -= 1;
        if object.pins == 0 {
            self.counters.pinned_objects.fetch_sub(1, RELAXED);
            self.track_if_resident(id);
        }
        Ok(())
    }

    // ---- eviction ---------------------------------------------------------------------------

    /// True when used bytes are above the high watermark.
    pub fn above_high_watermark(&self) -> bool {
        self.allocator.used_bytes().saturating_sub(self.demoting_bytes) > self.config.high_watermark_bytes
    }

    /// Evicts (or starts demoting) towards the low watermark, at most `max_victims` objects.
    /// Returns how many objects it evicted or started demoting.
    pub fn evict_to_low_watermark(&mut self, max_victims: usize) -> usize {
        let mut n = 0;
        while n < max_victims
            && self.allocator.used_bytes().saturating_sub(self.demoting_bytes) > self.config.low_watermark_bytes
        {
            if !self.evict_one_of(true) {
                break;
            }
            n += 1;
        }
        n
    }

    /// Starts the shard loop's next turn (see `turn`).
    pub fn next_turn(&mut self) {
        // Requests lent since the last turn already opened this one.
        if !std::mem::take(&mut self.lent_since_turn) {
            self.turn += 1;
        }
        self.take_published_news();
    }

    /// A caller is about to handle a request on the lent core, between the loop's turns: what
    /// it commits belongs to the loop's next turn (the one its poke starts), whose eviction pass
    /// spares it as it spares that turn's own commits.
    pub fn begin_lent_request(&mut self) {
        if !self.lent_since_turn {
            self.lent_since_turn = true;
            self.turn += 1;
        }
    }

    /// Feeds reads served through the published index to the eviction policy, and finishes the
    /// objects whose published readers have all gone.
    pub fn take_published_news(&mut self) {
        let (objects, policy, index) = (&self.objects, &mut self.policy, &self.index);
        index.drain_accesses(|id, generation| {
            let tracked = objects.get(id as usize).is_some_and(|o| {
                index.generation(id) == generation && o.state == ObjectState::Live && o.pins == 0 && o.dram.is_some()
            });
            if tracked {
                policy.access(id as EntryId);
            }
        });
        if self.draining.is_empty() {
            return;
        }
        let draining = std::mem::take(&mut self.draining);
        for (id, generation) in draining {
            let same = self.object_of(id, generation).is_some();
            if same {
                // Back on the list if readers are still there.
                self.after_last_use(id);
            }
        }
    }

    /// True when, after a request a caller handled on the lent core, the shard's loop has work
    /// of its own: SSD housekeeping (queued I/O, tombstones, syncs), waiters, eviction towards
    /// the low watermark, objects draining.
    pub fn wants_turn(&self) -> bool {
        self.ssd.is_some() || !self.waiters.is_empty() || self.above_high_watermark() || self.has_draining()
    }

    /// Objects waiting for published readers to leave: the shard should look again soon.
    pub fn has_draining(&self) -> bool {
        !self.draining.is_empty()
    }

    /// Allocates `bytes`, evicting clean victims and starting demotions of dirty ones. `None`
    /// means: wait, in-flight demotions will free enough, or in-flight loads may (each load's
    /// end retries the waiters; once none is in flight, a request that still finds no room
    /// gets `NoSpace`).
    fn allocate_or_wait(&mut self, bytes: u64) -> Result<Option<Allocation>> {
        self.demotion_waiting = false;
        loop {
            if let Some(allocation) = self.allocator.allocate(bytes) {
                return Ok(Some(allocation));
            }
            if self.demoting_bytes >= bytes {
                return Ok(None);
            }
            if !self.evict_one() {
                let coming = self.demoting_bytes > 0 || (self.demotion_waiting && self.ssd_space_coming());
                if coming || self.loads_in_flight() {
                    return Ok(None);
                }
                self.counters.no_space.fetch_add(1, RELAXED);
                return Err(Error::NoSpace);
            }
        }
    }

    /// Evicts one victim now, without starting I/O. False when none can go now.
    fn evict_one_now(&mut self) -> bool {
        let (objects, index) = (&self.objects, &self.index);
        // A victim's published slot is closed as it is chosen, atomically with seeing no readers.
        let victim = self.policy.pop_victim(
            &mut |id| objects.get(id as usize).is_some_and(Object::evictable) && index.close_if_unused(id),
            &|id| index_key_hash(index, id),
        );
        let Some(id) = victim else { return false };
        self.drop_or_evict(id);
        true
    }

    /// Evicts one victim: a clean one (already on SSD) loses its DRAM copy, a dirty one is
    /// demoted (its DRAM is freed when the write completes) or, without room on SSD, dropped.
    /// False when nothing is evictable.
    fn evict_one(&mut self) -> bool {
        self.evict_one_of(false)
    }

    /// `evict_one`; with `spare_this_turn`, objects committed in this turn are skipped.
    fn evict_one_of(&mut self, spare_this_turn: bool) -> bool {
        let (objects, index) = (&self.objects, &self.index);
        let turn = self.turn as u8;
        let victim = self.policy.pop_victim(
            &mut |id| {
                objects
                    .get(id as usize)
                    .is_some_and(|o| o.evictable() && !(spare_this_turn && o.committed_turn == turn))
                    && index.close_if_unused(id)
            },
            &|id| index_key_hash(index, id),
        );
        let Some(id) = victim else { return false };
        debug_assert_eq!(self.objects[id as usize].state, ObjectState::Live);
        if self.has_ssd_copy(id) {
            self.drop_dram(id);
            return true;
        }
        match self.start_demotion(id) {
            ssd::Demotion::Started => true,
            ssd::Demotion::Wait => {
                // No SSD room until a reclaim frees a segment: keep it, and let allocations wait.
                self.demotion_waiting = true;
                self.track_if_resident(id);
                false
            }
            ssd::Demotion::Refused => {
                self.drop_or_evict(id);
                true
            }
        }
    }

    /// Removes a victim's DRAM copy: SSD-only if it has one, else gone from the shard.
    fn drop_or_evict(&mut self, id: u32) {
        if self.has_ssd_copy(id) {
            self.drop_dram(id);
            return;
        }
        self.index_remove(id);
        self.counters.objects.fetch_sub(1, RELAXED);
        self.counters.evictions.fetch_add(1, RELAXED);
        self.free_object(id);
    }

    /// Frees the DRAM copy of an object that has an SSD copy.
    fn drop_dram(&mut self, id: u32) {
        debug_assert!(self.has_ssd_copy(id));
        let object = &mut self.objects[id as usize];
        debug_assert!(object.leases == 0 && object.io_refs == 0);
        debug_assert_eq!(self.index.readers(id), 0, "dropping DRAM under published readers");
        let Some(allocation) = object.dram.take() else { return };
        object.set_transient(false);
        self.policy.remove(id as EntryId);
        self.counters.bytes_used.fetch_sub(self.allocator.len_of(&allocation), RELAXED);
        self.counters.dram_objects.fetch_sub(1, RELAXED);
        self.counters.evictions.fetch_add(1, RELAXED);
        self.allocator.free(allocation);
        self.retry_waiters();
    }

    /// Starts tracking an object in the eviction policy if it is live, unpinned and in DRAM.
    fn track_if_resident(&mut self, id: u32) {
        self.publish(id);
        let o = &self.objects[id as usize];
        if o.state == ObjectState::Live && o.pins == 0 && o.dram.is_some() && o.io_refs == 0 && !o.transient() {
            let (hash, len) = (self.key_hash(id), self.index.value_len(id));
            self.policy.insert(id as EntryId, hash, len.max(1));
        }
    }

    /// Retries parked reservations and loads, oldest first, until one still has to wait.
    /// Not reentrant: memory freed while retrying goes to the waiter being retried.
    fn retry_waiters(&mut self) {
        if self.retrying {
            return;
        }
        self.retrying = true;
        self.retry_waiters_inner();
        self.retrying = false;
    }

    fn retry_waiters_inner(&mut self) {
        while let Some(waiter) = self.waiters.pop_front() {
            match waiter {
                Waiter::Reserve { pending, slot, key, len, upsert } => match self.try_reserve(&key, len, upsert) {
                    Ok(Some(grant)) => {
                        self.resolve_reserve(pending, slot, Ok(grant));
                        self.finish_reserve_if_done(pending);
                    }
                    Ok(None) => {
                        self.waiters.push_front(Waiter::Reserve { pending, slot, key, len, upsert });
                        return;
                    }
                    Err(e) => {
                        self.resolve_reserve(pending, slot, Err(e));
                        self.finish_reserve_if_done(pending);
                    }
                },
                Waiter::Load { pending, slot } => {
                    if !self.start_read(pending, slot) {
                        self.waiters.push_front(Waiter::Load { pending, slot });
                        return;
                    }
                    self.finish_read_if_done(pending);
                }
            }
        }
    }

    /// One step of a clean shutdown, called until it returns true: parked work fails, dirty
    /// objects are written to SSD (with `demote`, while `in_time`), freed segments' headers are
    /// zeroed (while `in_time`), queued tombstones are written and durable (past the deadline
    /// too: without them an older value could return; only a disk failing them stops that), and
    /// nothing is left in flight. Then the SSD tier starts nothing new.
    pub fn flush_for_shutdown(&mut self, demote: bool, in_time: bool) -> bool {
        self.fail_waiters(Error::ShuttingDown);
        self.ssd_shutting_down();
        if !in_time {
            if self.ssd_tombstones_pending() {
                self.schedule_syncs();
                return false;
            }
            self.freeze_ssd();
            return self.disk_ops_in_flight() == 0;
        }
        let dirty = if demote { self.flush_dirty() } else { 0 };
        self.schedule_syncs();
        dirty == 0 && !self.ssd_shutdown_pending() && self.disk_ops_in_flight() == 0
    }

    /// Fails every parked reservation and load with `error` (shutdown).
    pub fn fail_waiters(&mut self, error: Error) {
        self.fail_space_waiters(&error);
        while let Some(waiter) = self.waiters.pop_front() {
            match waiter {
                Waiter::Reserve { pending, slot, .. } => {
                    self.resolve_reserve(pending, slot, Err(error.clone()));
                    self.finish_reserve_if_done(pending);
                }
                Waiter::Load { pending, slot } => {
                    self.resolve_read(pending, slot, Err(error.clone()));
                    self.finish_read_if_done(pending);
                }
            }
        }
    }

    // ---- internals --------------------------------------------------------------------------

    /// Object `id`'s record if it is still the object of `generation`.
    fn object_of(&self, id: u32, generation: u32) -> Option<&Object> {
        self.objects.get(id as usize).filter(|_| self.index.generation(id) == generation)
    }

    fn is_reserved(&self, object: ObjectRef) -> bool {
        self.object_of(object.id, object.generation).is_some_and(|o| o.state == ObjectState::Reserved)
    }

    /// Takes a live object out of the index and the policy; frees it now or when its last lease
    /// and I/O are gone.
    fn unlink(&mut self, id: u32) {
        let hash = self.key_hash(id);
        self.unlink_hashed(id, hash);
    }

    /// `unlink` with the index hash of the object's key at hand (an upsert has its new
    /// version's, which is the same key's).
    fn unlink_hashed(&mut self, id: u32, hash: u64) {
        // Readers still in keep their bytes; no new one gets in.
        let readers = self.index.close(id);
        self.index_remove_hashed(id, hash);
        let object = &mut self.objects[id as usize];
        debug_assert_eq!(object.state, ObjectState::Live);
        if object.pins > 0 {
            self.counters.pinned_objects.fetch_sub(1, RELAXED);
        }
        object.pins = 0;
        let busy = object.leases > 0 || object.io_refs > 0 || readers > 0;
        // Only published readers hold it: nothing will call back when they are gone.
        let drain = busy && object.leases == 0 && object.io_refs == 0;
        if busy {
            object.state = ObjectState::Retired;
            self.counters.retired_objects.fetch_add(1, RELAXED);
        }
        let generation = self.index.generation(id);
        self.policy.remove(id as EntryId);
        self.counters.objects.fetch_sub(1, RELAXED);
        if !busy {
            self.free_object(id);
        } else if drain {
            self.draining.push((id, generation));
        }
    }

    /// Returns an object's memory and SSD space. Only for objects nothing can reach any more.
    fn free_object(&mut self, id: u32) {
        debug_assert_eq!(self.index.readers(id), 0, "freeing an object under published readers");
        let object = self.objects.remove(id as usize);
        self.index.disown(id);
        debug_assert_eq!(object.leases, 0, "freeing a leased object");
        debug_assert_eq!(object.io_refs, 0, "freeing an object under I/O");
        if object.state == ObjectState::Retired {
            self.counters.retired_objects.fetch_sub(1, RELAXED);
        }
        // The slot's facts go back to zero for the id's next object.
        let facts = self.ssd_facts.get_mut(id as usize).map(std::mem::take).unwrap_or_default();
        if let Some(location) = facts.copy.map(PackedLocation::get) {
            self.forget_ssd_copy(&location);
        }
        if let Some(allocation) = object.dram {
            if matches!(object.state, ObjectState::Live | ObjectState::Retired) {
                self.counters.dram_objects.fetch_sub(1, RELAXED);
            }
            self.counters.bytes_used.fetch_sub(self.allocator.len_of(&allocation), RELAXED);
            self.allocator.free(allocation);
            self.retry_waiters();
        }
    }

    /// Whether object `id` may take one more lease: the shard's table and the object's count
    /// both have room (`Busy` names the bound that is full).
    fn lease_room(&self, id: u32) -> Result<()> {
        if self.leases.len() >= self.config.max_leases as usize {
            return Err(Error::Busy { limit: self.config.max_leases as usize });
        }
        if self.objects.get(id as usize).is_some_and(|o| o.leases == u16::MAX) {
            return Err(Error::Busy { limit: usize::from(u16::MAX) });
        }
        Ok(())
    }

    fn add_lease(&mut self, id: u32) -> LeaseId {
        let generation = self.bump_generation();
        let slot = self.leases.insert(Lease { object: id, generation }) as u32;
        self.objects[id as usize].leases += 1;
        self.counters.leases_held.fetch_add(1, RELAXED);
        LeaseId { slot, generation }
    }

    /// Address of a DRAM-resident object's value.
    fn value_ptr(&self, id: u32) -> Result<NonNull<u8>> {
        let object = &self.objects[id as usize];
        let allocation = object.dram.as_ref().ok_or(Error::Internal("object not in DRAM"))?;
        self.slice
            .ptr_at(
                self.allocator.offset_of(allocation) + u64::from(self.facts(id).value_offset),
                self.index.value_len(id),
            )
            .ok_or(Error::Internal("object outside slice"))
    }

    /// The object slot `key` is indexed at.
    fn find(&self, key: &[u8]) -> Option<u32> {
        self.find_hashed(key, super::hash::key_index_hash(key))
    }

    /// `find` with the key's index hash at hand.
    fn find_hashed(&self, key: &[u8], hash: u64) -> Option<u32> {
        let index = &self.index;
        index.find(hash, |id| index.key(id) == key)
    }

    /// Indexes object `id`, whose key's index hash is `hash`.
    fn index_insert(&mut self, id: u32, hash: u64) {
        self.index.insert(hash, id);
    }

    /// The index hash of object `id`'s key, computed when needed rather than kept: 8 bytes per
    /// object against one hash of the key when it leaves the index (entries move without their
    /// keys).
    fn key_hash(&self, id: u32) -> u64 {
        index_key_hash(&self.index, id)
    }

    /// Adds an object record, giving its published slot the key and the value's length. The
    /// record back (nothing added) when the slot cannot take them.
    fn insert_object(
        &mut self,
        object: Object,
        generation: u32,
        facts: SsdFacts,
        key: &[u8],
        len: u64,
    ) -> std::result::Result<u32, Object> {
        let entry = self.objects.vacant_entry();
        let Ok(id) = u32::try_from(entry.key()) else { return Err(object) };
        if !self.index.adopt(id, generation, key, len) {
            return Err(object);
        }
        if self.ssd.is_some() {
            // Ids are dense (the slab reuses freed ones), so this grows with the objects held.
            let at = id as usize;
            if at >= self.ssd_facts.len() {
                self.ssd_facts.resize(at + 1, SsdFacts::default());
            }
            self.ssd_facts[at] = facts;
        } else {
            debug_assert!(facts.copy.is_none() && facts.value_offset == 0, "SSD facts on a DRAM-only shard");
        }
        entry.insert(object);
        Ok(id)
    }

    /// Object `id`'s SSD facts (all zero on a DRAM-only shard).
    fn facts(&self, id: u32) -> SsdFacts {
        self.ssd_facts.get(id as usize).copied().unwrap_or_default()
    }

    /// The SSD copy's location.
    fn ssd_copy(&self, id: u32) -> Option<SsdLocation> {
        ssd_copy_in(&self.ssd_facts, id).map(PackedLocation::get)
    }

    fn has_ssd_copy(&self, id: u32) -> bool {
        ssd_copy_in(&self.ssd_facts, id).is_some()
    }

    fn take_ssd_copy(&mut self, id: u32) -> Option<SsdLocation> {
        self.ssd_facts.get_mut(id as usize).and_then(|f| f.copy.take()).map(PackedLocation::get)
    }

    fn set_ssd_copy(&mut self, id: u32, location: SsdLocation) {
        let packed = PackedLocation::new(location);
        debug_assert!(packed.is_some(), "{location:?} does not pack");
        if let Some(f) = self.ssd_facts.get_mut(id as usize) {
            f.copy = packed;
        }
    }

    /// A live or retired object with neither a DRAM nor an SSD copy.
    fn has_no_copy(&self, id: u32) -> bool {
        self.objects.get(id as usize).is_some_and(|o| o.dram.is_none()) && !self.has_ssd_copy(id)
    }

    /// A record of object `id`'s version is (or may soon be, or may still be) readable on SSD,
    /// so removing or replacing it needs a tombstone.
    fn may_have_ssd_record(&self, id: u32) -> bool {
        self.has_ssd_copy(id) || self.objects.get(id as usize).is_some_and(|o| o.io_refs > 0 || o.shadowed())
    }

    /// Takes object `id` out of the index.
    fn index_remove(&mut self, id: u32) {
        let hash = self.key_hash(id);
        self.index_remove_hashed(id, hash);
    }

    /// `index_remove` with the index hash of the object's key at hand.
    fn index_remove_hashed(&mut self, id: u32, hash: u64) {
        let removed = self.index.remove(hash, id);
        debug_assert!(removed, "object {id} was not indexed");
    }

    /// Lets published readers lease the object if it is live, whole in DRAM and not being
    /// written (its bytes stay put until the shard closes it again).
    fn publish(&mut self, id: u32) {
        let Some(o) = self.objects.get(id as usize) else { return };
        // A load in flight holds an I/O reference, so no loading object is readable here.
        let readable = o.state == ObjectState::Live && o.dram.is_some() && !o.transient() && o.io_refs == 0;
        debug_assert!(!readable || self.load_token(id).is_none(), "object {id} loading without an I/O reference");
        let generation = self.index.generation(id);
        if !readable || self.index.is_open(id, generation) {
            return;
        }
        let Ok(ptr) = self.value_ptr(id) else { return };
        self.index.open(id, generation, ptr);
    }

    /// Keeps published readers out of an object about to be written to SSD (readers in keep
    /// their bytes: the object's DRAM stays until they left).
    pub(super) fn unpublish(&mut self, id: u32) {
        self.index.close(id);
    }

    fn bump_generation(&mut self) -> u32 {
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1).max(1);
        generation
    }

    fn bump_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Checks the cross-structure invariants (tests and debug builds).
    #[cfg(test)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut live = 0usize;
        let mut used = 0u64;
        let mut leases = 0u64;
        let mut tracked = 0usize;
        if self.ssd.is_none() && !self.ssd_facts.is_empty() {
            return Err("a DRAM-only shard keeps SSD facts".into());
        }
        for (id, object) in self.objects.iter() {
            used += object.dram.as_ref().map_or(0, |a| self.allocator.len_of(a));
            leases += u64::from(object.leases);
            match object.state {
                ObjectState::Live => {
                    live += 1;
                    if self.find(self.index.key(id as u32)) != Some(id as u32) {
                        return Err(format!("live object {id} not indexed"));
                    }
                    if object.dram.is_none() && !self.has_ssd_copy(id as u32) && object.io_refs == 0 {
                        return Err(format!("live object {id} has no copy anywhere"));
                    }
                    if object.pins == 0 && object.dram.is_some() && object.io_refs == 0 && !object.transient() {
                        tracked += 1;
                    }
                }
                ObjectState::Retired
                    if object.leases == 0 && object.io_refs == 0 && self.index.readers(id as u32) == 0 =>
                {
                    return Err(format!("retired object {id} without users still allocated"));
                }
                ObjectState::Abandoned if object.leases == 0 => {
                    return Err(format!("abandoned reservation {id} without readers still allocated"));
                }
                _ => {}
            }
        }
        if live != self.index.len() {
            return Err(format!("index has {} keys, {live} live objects", self.index.len()));
        }
        if let Some(ssd) = self.ssd.as_ref() {
            if let Some((id, token)) = ssd.loads_by_object.iter().find(|(&id, &token)| !ssd.is_load_of(token, id)) {
                return Err(format!("object {id} names load {token}, which is not its load in flight"));
            }
        }
        let reserved_internal = self.ssd.as_ref().map_or(0, |s| s.reserved_bytes(&self.allocator));
        if used + reserved_internal != self.allocator.used_bytes() {
            return Err(format!(
                "objects hold {used} + {reserved_internal} internal bytes, allocator says {}",
                self.allocator.used_bytes()
            ));
        }
        if leases != self.leases.len() as u64 {
            return Err(format!("objects count {leases} leases, table has {}", self.leases.len()));
        }
        if self.policy.len() != tracked {
            return Err(format!("policy tracks {}, expected {tracked}", self.policy.len()));
        }
        let pinned = self.objects.iter().filter(|(_, o)| o.state == ObjectState::Live && o.pins > 0).count();
        let c = self.counters.snapshot();
        let retired = self.objects.iter().filter(|(_, o)| o.state == ObjectState::Retired).count() as u64;
        let reserved = self.objects.iter().filter(|(_, o)| o.state == ObjectState::Reserved).count() as u64;
        let expected =
            (live as u64, pinned as u64, retired, reserved, used + reserved_internal, self.leases.len() as u64);
        let counted = (c.objects, c.pinned_objects, c.retired_objects, c.writes_in_flight, c.bytes_used, c.leases_held);
        if expected != counted {
            return Err(format!(
                "counters (objects, pinned, retired, writes, bytes, leases) = {counted:?}, state says {expected:?}"
            ));
        }
        Ok(())
    }

    /// Number of keys in the index.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Leases currently held.
    #[cfg(test)]
    pub fn leases_held(&self) -> usize {
        self.leases.len()
    }

    /// Bytes allocated (live, reserved, retired objects and SSD scratch buffers).
    #[cfg(test)]
    pub fn used_bytes(&self) -> u64 {
        self.allocator.used_bytes()
    }

    /// True when nothing waits and no I/O is in flight.
    #[cfg(test)]
    pub fn is_quiet(&self) -> bool {
        self.waiters.is_empty()
            && self.pending_reads.is_empty()
            && self.pending_reserves.is_empty()
            && self.pending_commits.is_empty()
            && self.ssd.as_ref().is_none_or(SsdState::is_quiet)
    }
}

impl Drop for ShardCore {
    fn drop(&mut self) {
        // Removes still waiting for their tombstones are dropped with the tier (their callers
        // see the shard gone), so none waits any more.
        self.counters.removes_awaiting_tombstone.store(0, RELAXED);
        // Readers on other threads may still be comparing keys under published leases: the
        // objects (their keys) must outlive those leases. Past the wait they are leaked instead.
        if !self.index.shut(SHUT_WAIT) {
            tracing::warn!("published readers still hold leases as the shard stops; keeping its objects' memory");
            std::mem::forget(std::mem::take(&mut self.objects));
        }
    }
}

/// How long a stopping shard waits for published readers to give their leases back.
const SHUT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

const RELAXED: std::sync::atomic::Ordering = std::sync::atomic::Ordering::Relaxed;
