//! One shard's state machine: its index, objects, arena slice allocator, eviction policy and
//! lease table.
//!
//! Pure and synchronous: no threads, no I/O, no clocks of its own (callers pass `now`), so the
//! property tests drive it directly and the shard loop is only plumbing around it. It never copies
//! object bytes (callers copy under the leases it grants) and it never frees memory a lease,
//! a pin or an unfinished write can still reach.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use kvtide_tiers::dram::{Allocation, ArenaSlice, OffsetAllocator};
use kvtide_tiers::eviction::{EntryId, Eviction, EvictionPolicy};
use slab::Slab;
use xxhash_rust::xxh3::Xxh3Builder;

use crate::error::{Error, Result};
use crate::stats::ShardCounters;

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

/// Where a leased object's bytes are, for as long as the lease is held.
#[derive(Clone, Copy, Debug)]
pub struct ReadGrant {
    pub lease: LeaseId,
    pub ptr: NonNull<u8>,
    pub len: u64,
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
    /// Unlinked (replaced or force-removed); freed when its last lease goes.
    Retired,
}

struct Object {
    key: Box<[u8]>,
    key_hash: u64,
    generation: u32,
    allocation: Option<Allocation>,
    len: u64,
    leases: u32,
    pins: u32,
    state: ObjectState,
}

struct Lease {
    object: u32,
    generation: u32,
}

/// Limits a shard enforces, derived from the builder.
#[derive(Clone, Debug)]
pub struct ShardConfig {
    pub shard: usize,
    pub high_watermark_bytes: u64,
    pub low_watermark_bytes: u64,
    pub policy: EvictionPolicy,
    pub align_bytes: u64,
    pub max_objects: u32,
    pub max_leases: u32,
}

/// The shard's state. See the module comment.
pub struct ShardCore {
    config: ShardConfig,
    slice: ArenaSlice,
    allocator: OffsetAllocator,
    objects: Slab<Object>,
    index: HashMap<Box<[u8]>, u32, Xxh3Builder>,
    policy: Box<dyn Eviction>,
    leases: Slab<Lease>,
    lease_deadlines: BinaryHeap<Reverse<(Instant, LeaseId)>>,
    next_generation: u32,
    counters: Arc<ShardCounters>,
}

impl ShardCore {
    /// A shard over `slice`, publishing counters to `counters`.
    pub fn new(
        config: ShardConfig,
        slice: ArenaSlice,
        counters: Arc<ShardCounters>,
    ) -> Result<Self, kvtide_tiers::dram::AllocError> {
        let capacity = slice.len_bytes() as u64;
        let allocator = OffsetAllocator::new(capacity, config.align_bytes, config.max_objects)?;
        counters.capacity_bytes.store(allocator.capacity_bytes(), std::sync::atomic::Ordering::Relaxed);
        Ok(ShardCore {
            policy: config.policy.build(capacity),
            config,
            slice,
            allocator,
            objects: Slab::new(),
            index: HashMap::with_hasher(Xxh3Builder::new()),
            leases: Slab::new(),
            lease_deadlines: BinaryHeap::new(),
            next_generation: 1,
            counters,
        })
    }

    /// Counters this shard publishes.
    pub fn counters(&self) -> &Arc<ShardCounters> {
        &self.counters
    }

    /// Bytes this shard's objects can use.
    pub fn capacity_bytes(&self) -> u64 {
        self.allocator.capacity_bytes()
    }

    // ---- reads ------------------------------------------------------------------------------

    /// Leases `key` for reading. `deadline` is the TTL backstop for explicit leases (None for the
    /// RAII leases of a running copy).
    pub fn lease_read(&mut self, key: &[u8], deadline: Option<Instant>) -> Result<ReadGrant> {
        let Some(&id) = self.index.get(key) else {
            self.counters.misses.fetch_add(1, RELAXED);
            return Err(Error::NotFound);
        };
        if self.leases.len() >= self.config.max_leases as usize {
            return Err(Error::Busy { limit: self.config.max_leases as usize });
        }
        let (ptr, len) = {
            let object = &self.objects[id as usize];
            (self.object_ptr(object)?, object.len)
        };
        let lease = self.add_lease(id);
        if let Some(deadline) = deadline {
            self.lease_deadlines.push(Reverse((deadline, lease)));
        }
        self.policy.access(id);
        self.counters.hits.fetch_add(1, RELAXED);
        self.counters.bytes_read.fetch_add(len, RELAXED);
        Ok(ReadGrant { lease, ptr, len })
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
        let object = &mut self.objects[entry.object as usize];
        debug_assert!(object.leases > 0, "lease count underflow");
        object.leases -= 1;
        if object.leases == 0 && object.state == ObjectState::Retired {
            self.free_object(entry.object);
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

    /// True if `key` is present (and counts a hit or miss).
    pub fn exists(&mut self, key: &[u8]) -> bool {
        let found = self.index.contains_key(key);
        let counter = if found { &self.counters.hits } else { &self.counters.misses };
        counter.fetch_add(1, RELAXED);
        found
    }

    // ---- writes -----------------------------------------------------------------------------

    /// Allocates `len` bytes for a new version of `key`, evicting as needed. The object stays
    /// invisible until `commit`.
    pub fn reserve(&mut self, key: &[u8], len: u64, upsert: bool) -> Result<WriteGrant> {
        if !upsert && self.index.contains_key(key) {
            return Err(Error::AlreadyExists);
        }
        if len > self.allocator.capacity_bytes() {
            return Err(Error::TooLarge { what: "value", len, max: self.allocator.capacity_bytes() });
        }
        if self.objects.len() >= self.config.max_objects as usize {
            // Room for the object record itself: evict one, else refuse.
            if !self.evict_one() {
                self.counters.no_space.fetch_add(1, RELAXED);
                return Err(Error::NoSpace);
            }
        }
        // A zero-length object still takes one aligned unit, so every object has an address.
        let allocation = self.allocate_evicting(len.max(1))?;
        let generation = self.bump_generation();
        let offset = allocation.offset();
        let reserved = allocation.len();
        let id = self.objects.insert(Object {
            key: key.into(),
            key_hash: xxhash_rust::xxh3::xxh3_64(key),
            generation,
            allocation: Some(allocation),
            len,
            leases: 0,
            pins: 0,
            state: ObjectState::Reserved,
        }) as u32;
        self.counters.bytes_used.fetch_add(reserved, RELAXED);
        self.counters.writes_in_flight.fetch_add(1, RELAXED);
        let ptr = self.slice.ptr_at(offset, len).ok_or(Error::Internal("allocation outside slice"))?;
        Ok(WriteGrant { object: ObjectRef { id, generation }, ptr, len })
    }

    /// Makes a reserved object visible. With `upsert`, an existing version is unlinked and freed
    /// once its readers finish; without, an existing key fails the commit (and frees the
    /// reservation).
    pub fn commit(&mut self, object: ObjectRef, upsert: bool) -> Result<()> {
        if !self.is_reserved(object) {
            return Err(Error::Internal("commit of an unknown reservation"));
        }
        self.counters.writes_in_flight.fetch_sub(1, RELAXED);
        let id = object.id;
        let key = self.objects[id as usize].key.clone();
        let mut inherited_pins = 0;
        if let Some(&old) = self.index.get(&key) {
            if !upsert {
                self.free_object(id);
                return Err(Error::AlreadyExists);
            }
            inherited_pins = self.objects[old as usize].pins;
            self.unlink(old);
        }
        let entry = &mut self.objects[id as usize];
        entry.state = ObjectState::Live;
        entry.pins = inherited_pins;
        let (hash, len) = (entry.key_hash, entry.len);
        self.index.insert(key, id);
        if inherited_pins == 0 {
            self.policy.insert(id as EntryId, hash, len.max(1));
        } else {
            // The old version's pins moved here; `unlink` counted it out.
            self.counters.pinned_objects.fetch_add(1, RELAXED);
        }
        self.counters.objects.fetch_add(1, RELAXED);
        self.counters.puts.fetch_add(1, RELAXED);
        self.counters.bytes_written.fetch_add(len, RELAXED);
        Ok(())
    }

    /// Drops a reservation (the writer failed or gave up). Stale ids are ignored.
    pub fn abort(&mut self, object: ObjectRef) {
        if self.is_reserved(object) {
            self.counters.writes_in_flight.fetch_sub(1, RELAXED);
            self.free_object(object.id);
        }
    }

    /// Removes `key`. A leased or pinned object is refused unless `force`; forced, its readers
    /// keep their bytes until they release them.
    pub fn remove(&mut self, key: &[u8], force: bool) -> Result<()> {
        let Some(&id) = self.index.get(key) else {
            return Err(Error::NotFound);
        };
        let object = &self.objects[id as usize];
        if !force && object.leases > 0 {
            return Err(Error::Leased);
        }
        if !force && object.pins > 0 {
            return Err(Error::Pinned);
        }
        self.unlink(id);
        self.counters.removes.fetch_add(1, RELAXED);
        Ok(())
    }

    /// Pins `key`: it is not evicted until unpinned as often as pinned.
    pub fn pin(&mut self, key: &[u8]) -> Result<()> {
        let &id = self.index.get(key).ok_or(Error::NotFound)?;
        let object = &mut self.objects[id as usize];
        object.pins = object.pins.checked_add(1).ok_or(Error::TooLarge {
            what: "pin count",
            len: u64::from(u32::MAX) + 1,
            max: u64::from(u32::MAX),
        })?;
        if object.pins == 1 {
            self.policy.remove(id as EntryId);
            self.counters.pinned_objects.fetch_add(1, RELAXED);
        }
        Ok(())
    }

    /// Undoes one `pin`.
    pub fn unpin(&mut self, key: &[u8]) -> Result<()> {
        let &id = self.index.get(key).ok_or(Error::NotFound)?;
        let object = &mut self.objects[id as usize];
        if object.pins == 0 {
            return Err(Error::NotPinned);
        }
        object.pins -= 1;
        if object.pins == 0 {
            let (hash, len) = (object.key_hash, object.len);
            self.policy.insert(id as EntryId, hash, len.max(1));
            self.counters.pinned_objects.fetch_sub(1, RELAXED);
        }
        Ok(())
    }

    // ---- eviction ---------------------------------------------------------------------------

    /// True when used bytes are above the high watermark.
    pub fn above_high_watermark(&self) -> bool {
        self.allocator.used_bytes() > self.config.high_watermark_bytes
    }

    /// Evicts towards the low watermark, at most `max_victims` objects (the loop calls this
    /// between other work). Returns true when the low watermark is reached or nothing can go.
    pub fn evict_to_low_watermark(&mut self, max_victims: usize) -> bool {
        for _ in 0..max_victims {
            if self.allocator.used_bytes() <= self.config.low_watermark_bytes {
                return true;
            }
            if !self.evict_one() {
                return true;
            }
        }
        self.allocator.used_bytes() <= self.config.low_watermark_bytes
    }

    fn allocate_evicting(&mut self, len: u64) -> Result<Allocation> {
        loop {
            if let Some(allocation) = self.allocator.allocate(len) {
                return Ok(allocation);
            }
            if !self.evict_one() {
                self.counters.no_space.fetch_add(1, RELAXED);
                return Err(Error::NoSpace);
            }
        }
    }

    /// Evicts one unleased, unpinned live object. False when there is none.
    fn evict_one(&mut self) -> bool {
        let objects = &self.objects;
        let victim = self.policy.pop_victim(&mut |id| objects.get(id as usize).is_some_and(|o| o.leases == 0));
        let Some(id) = victim else { return false };
        debug_assert_eq!(self.objects[id as usize].state, ObjectState::Live);
        debug_assert_eq!(self.objects[id as usize].pins, 0);
        let key = self.objects[id as usize].key.clone();
        self.index.remove(&key);
        self.counters.objects.fetch_sub(1, RELAXED);
        self.counters.evictions.fetch_add(1, RELAXED);
        self.free_object(id);
        true
    }

    // ---- internals --------------------------------------------------------------------------

    fn is_reserved(&self, object: ObjectRef) -> bool {
        self.objects
            .get(object.id as usize)
            .is_some_and(|o| o.generation == object.generation && o.state == ObjectState::Reserved)
    }

    /// Takes a live object out of the index and the policy; frees it now or on its last release.
    fn unlink(&mut self, id: u32) {
        let object = &mut self.objects[id as usize];
        debug_assert_eq!(object.state, ObjectState::Live);
        let key = object.key.clone();
        if object.pins > 0 {
            self.counters.pinned_objects.fetch_sub(1, RELAXED);
        }
        object.pins = 0;
        let leased = object.leases > 0;
        if leased {
            object.state = ObjectState::Retired;
            self.counters.retired_objects.fetch_add(1, RELAXED);
        }
        self.index.remove(&key);
        self.policy.remove(id as EntryId);
        self.counters.objects.fetch_sub(1, RELAXED);
        if !leased {
            self.free_object(id);
        }
    }

    /// Returns an object's memory. Only for objects nothing can reach any more.
    fn free_object(&mut self, id: u32) {
        let object = self.objects.remove(id as usize);
        debug_assert_eq!(object.leases, 0, "freeing a leased object");
        if object.state == ObjectState::Retired {
            // Retired objects were counted when they had readers left; they are gone now.
            self.counters.retired_objects.fetch_sub(1, RELAXED);
        }
        if let Some(allocation) = object.allocation {
            self.counters.bytes_used.fetch_sub(allocation.len(), RELAXED);
            self.allocator.free(allocation);
        }
    }

    fn add_lease(&mut self, id: u32) -> LeaseId {
        let generation = self.bump_generation();
        let slot = self.leases.insert(Lease { object: id, generation }) as u32;
        self.objects[id as usize].leases += 1;
        self.counters.leases_held.fetch_add(1, RELAXED);
        LeaseId { slot, generation }
    }

    fn object_ptr(&self, object: &Object) -> Result<NonNull<u8>> {
        let allocation = object.allocation.as_ref().ok_or(Error::Internal("live object without memory"))?;
        self.slice.ptr_at(allocation.offset(), object.len).ok_or(Error::Internal("object outside slice"))
    }

    fn bump_generation(&mut self) -> u32 {
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1).max(1);
        generation
    }

    /// Checks the cross-structure invariants (tests and debug builds).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut live = 0usize;
        let mut used = 0u64;
        let mut leases = 0u64;
        for (id, object) in self.objects.iter() {
            used += object.allocation.as_ref().map_or(0, |a| a.len());
            leases += u64::from(object.leases);
            match object.state {
                ObjectState::Live => {
                    live += 1;
                    if self.index.get(&object.key) != Some(&(id as u32)) {
                        return Err(format!("live object {id} not indexed"));
                    }
                }
                ObjectState::Retired if object.leases == 0 => {
                    return Err(format!("retired object {id} without leases still allocated"));
                }
                _ => {}
            }
        }
        if live != self.index.len() {
            return Err(format!("index has {} keys, {live} live objects", self.index.len()));
        }
        if used != self.allocator.used_bytes() {
            return Err(format!("objects hold {used} bytes, allocator says {}", self.allocator.used_bytes()));
        }
        if leases != self.leases.len() as u64 {
            return Err(format!("objects count {leases} leases, table has {}", self.leases.len()));
        }
        let pinned = self.objects.iter().filter(|(_, o)| o.state == ObjectState::Live && o.pins > 0).count();
        if self.policy.len() != live - pinned {
            return Err(format!("policy tracks {}, expected {}", self.policy.len(), live - pinned));
        }
        let c = self.counters.snapshot();
        let retired = self.objects.iter().filter(|(_, o)| o.state == ObjectState::Retired).count() as u64;
        let reserved = self.objects.iter().filter(|(_, o)| o.state == ObjectState::Reserved).count() as u64;
        let expected = (live as u64, pinned as u64, retired, reserved, used, self.leases.len() as u64);
        let counted = (c.objects, c.pinned_objects, c.retired_objects, c.writes_in_flight, c.bytes_used, c.leases_held);
        if expected != counted {
            return Err(format!(
                "counters (objects, pinned, retired, writes, bytes, leases) = {counted:?}, state says {expected:?}"
            ));
        }
        Ok(())
    }

    /// Number of keys in the index.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when the index is empty.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Leases currently held.
    pub fn leases_held(&self) -> usize {
        self.leases.len()
    }

    /// Bytes allocated (live, reserved and retired objects).
    pub fn used_bytes(&self) -> u64 {
        self.allocator.used_bytes()
    }
}

const RELAXED: std::sync::atomic::Ordering = std::sync::atomic::Ordering::Relaxed;

#[cfg(test)]
mod tests;
