//! The shard's side of the SSD tier: which objects rest on SSD and what happens to them there
//! (demotion on eviction, write-through, loads on read, deciding what a segment reclaim does
//! with each object, clean-shutdown flushes, recovery into the index).
//!
//! Owns the objects' SSD locations, loads, write-through waits and the
//! shutdown flush queue. The policy on disk (placement, segment headers, durable prefixes, group
//! commit, tombstones, reclaim and its copies, header zeroing, short or failed transfers) is
//! `kvtide_tiers::ssd::SsdTier`'s: this module asks it for operations by tag, names objects to
//! it by an owner token (id and generation) and reacts to its `TierEvent`s. It never reports a
//! record durable before the tier said the `fdatasync` covering it completed, never hands out
//! bytes whose checksum failed, never lets a segment be reused while its own reads can still
//! touch it, never lets go of a record a reclaim has not copied durably elsewhere, and never
//! drops a tombstone silently.

use std::collections::VecDeque;

use kvtide_tiers::dram::{Allocation, ArenaSlice, OffsetAllocator};
use kvtide_tiers::eviction::EntryId;
use kvtide_tiers::ssd::record::{self, RecordKind, BLOCK_BYTES, HEADER_BYTES};
use kvtide_tiers::ssd::tier::{CopyOutcome, CopyRequest, ReclaimStep, RecordIdentity, RecordOwners, TOMBSTONE_SLOTS};
use kvtide_tiers::ssd::{
    scan_segment, DiskCompletion, DiskIo, DiskOp, LoadFailure, Placement, SsdLocation, SsdTier, TierConfig,
    TierCounters, TierEvent, TombstoneRefused,
};
use slab::Slab;

use std::cmp::Reverse;
use std::sync::Arc;

use super::{ssd_copy_in, Done, LeaseId, Object, ObjectState, PackedLocation, ReadGrant, ShardCore, SsdFacts, RELAXED};
use crate::error::{Error, Result};
use crate::shard::landing::Landing;
use crate::shard::published::IndexWriter;

/// Tombstones queued and not yet written, by default; a remove past this gets `Busy` (nothing
/// is dropped).
pub const DEFAULT_MAX_PENDING_TOMBSTONES: usize = 1 << 16;
/// Bounds of the relocation staging buffer (records are copied segment to segment through it,
/// in chunks, so a full DRAM never stops a reclaim).
const MIN_STAGING_BYTES: u64 = 16 * BLOCK_BYTES;
const MAX_STAGING_BYTES: u64 = 1 << 20;
/// Bytes of flush writes in flight per shard past which a clean shutdown's flush starts no more
/// (the rest wait for the next turn): writes started before the deadline all finish, so this
/// bounds how far past it the flush runs (one larger object still goes alone).
const FLUSH_BYTES_IN_FLIGHT: u64 = 16 << 20;

/// What the builder decided for this shard's SSD tier.
#[derive(Clone, Debug)]
pub struct SsdConfig {
    pub segments: u32,
    pub segment_bytes: u64,
    /// Acknowledge puts only once their record is durable on SSD.
    pub write_through: bool,
    /// Bytes of loads in flight at once; more wait.
    pub restore_budget_bytes: u64,
    /// Keep loaded objects in DRAM (else their DRAM copy goes with the last reader).
    pub promote_on_hit: bool,
    /// Seeds the random segment epochs (fixed in simulations, random in production).
    pub epoch_seed: u64,
    /// Tombstones that may wait to be written; a remove past this gets `Busy`.
    pub max_pending_tombstones: usize,
    /// Bytes per read of a progressive load (an early-granted read of an SSD-resident key).
    pub load_piece_bytes: u64,
}

/// Default bytes per read of a progressive load: small enough that the first chunk of a large
/// object arrives after a few reads, large enough to keep the disk's queue efficient.
pub const DEFAULT_LOAD_PIECE_BYTES: u64 = 1 << 20;

/// What recovery found, per shard.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub segments_scanned: u32,
    pub records: u64,
    pub objects: u64,
    pub bytes: u64,
    pub removed_by_tombstone: u64,
    pub superseded: u64,
    /// (segment, offset, reason) of records or tails that were not recovered.
    pub discarded: Vec<(u32, u64, String)>,
}

/// Why a record image is written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WritePurpose {
    /// A dirty victim leaves DRAM once its record is written.
    Demotion,
    /// A write-through put: its commit waits for the record to be durable.
    WriteThrough { pending: usize, slot: usize },
    /// A DRAM-resident record copied forward out of a segment being reclaimed.
    Relocation,
    /// A dirty object written by a clean shutdown (it keeps its DRAM copy).
    Flush,
}

/// An operation of the core that the tier carries; its tag is the key in `SsdState::ops`.
enum CoreOp {
    /// A record image written from an object's DRAM copy.
    Write { id: u32, location: SsdLocation, purpose: WritePurpose },
    /// A record read into a fresh allocation for object `id` (readers join it). Early readers
    /// hold leases on it before it ends (`early`) and follow its `landing`.
    Load {
        id: u32,
        location: SsdLocation,
        allocation: Option<Allocation>,
        waiters: Vec<(usize, usize)>,
        landing: Option<Arc<Landing>>,
        early: Vec<LeaseId>,
    },
}

/// A load that ended, taken out of `SsdState::ops`.
struct FinishedLoad {
    id: u32,
    location: SsdLocation,
    allocation: Option<Allocation>,
    waiters: Vec<(usize, usize)>,
    landing: Option<Arc<Landing>>,
    early: Vec<LeaseId>,
}

/// A record waiting to become durable: a write-through commit's (`commit` names its batch
/// slot), or a written-back one's, whose object must not keep resting on a record that a break
/// earlier in its segment keeps recovery from ever reaching.
#[derive(Clone, Copy)]
struct DurableWaiter {
    commit: Option<(usize, usize)>,
    object: u32,
    generation: u32,
    location: SsdLocation,
}

/// A write-through commit waiting for SSD space (a reclaim is freeing a segment). The object is
/// held (`io_refs`) meanwhile so nothing evicts or frees it.
struct SpaceWaiter {
    object: u32,
    generation: u32,
    pending: usize,
    slot: usize,
}

pub(crate) struct SsdState {
    config: SsdConfig,
    /// The disk side: placement, durability, syncs, tombstones, header zeroing.
    tier: SsdTier,
    /// The core's operations in flight through the tier, by tag.
    ops: Slab<CoreOp>,
    /// Write-through commits waiting for durability, by the tier's wait tag.
    durable_waiters: Slab<DurableWaiter>,
    /// Write-through removes waiting for their tombstones to be durable, by the tombstone's
    /// sequence number (bounded by the tier's queue of tombstones: a remove past it is refused).
    tombstone_waiters: std::collections::HashMap<u64, Done<Result<()>>>,
    /// DRAM lent to the tier for tombstones of keys longer than one block, by handle.
    borrowed: Slab<Allocation>,
    /// The tier's scratch blocks (one header block per segment, a zero block, the tombstone
    /// slots and the relocation staging buffer); held for the tier's lifetime.
    #[cfg_attr(not(test), allow(dead_code))]
    scratch: Allocation,
    /// Bytes of `borrowed`.
    borrowed_bytes: u64,
    space_waiters: VecDeque<SpaceWaiter>,
    loading_bytes: u64,
    /// Loads of early leases made while `loading_bytes` was at the restore budget: their
    /// memory is allocated and their readers hold leases on it, and their disk reads start in
    /// order as earlier loads end (`start_deferred_loads`). At most `deferred_limit` bytes.
    deferred_loads: VecDeque<usize>,
    deferred_bytes: u64,
    /// The load filling each object's DRAM copy (readers join it), by object slot: kept here
    /// rather than in every object record, as only objects in flight have one.
    pub(super) loads_by_object: std::collections::HashMap<u32, usize>,
    /// Dirty objects a clean shutdown still has to write.
    flush_queue: Option<VecDeque<(u32, u32)>>,
    /// The shortest the flush queue has been, and `segments_reclaimed` then: a flush that
    /// stays no shorter while reclaims turn the log over twice gives up (see `flush_dirty`).
    flush_best: Option<(usize, u64)>,
    /// A clean shutdown ran out of time: nothing new starts.
    frozen: bool,
    /// The tier's counters as last added to the shard's.
    published: TierCounters,
}

/// Bytes of relocation staging for a slice of `capacity_bytes`.
fn staging_bytes_for(capacity_bytes: u64) -> u64 {
    (capacity_bytes / 64 / BLOCK_BYTES * BLOCK_BYTES).clamp(MIN_STAGING_BYTES, MAX_STAGING_BYTES)
}

/// Bytes the tier keeps for itself in a slice: header blocks, zero block, tombstone slots, staging.
fn scratch_bytes_for(segments: u32, capacity_bytes: u64) -> u64 {
    (u64::from(segments) + 1 + TOMBSTONE_SLOTS as u64) * BLOCK_BYTES + staging_bytes_for(capacity_bytes)
}

/// The largest value a shard with an SSD tier can store and keep: its record (with the longest
/// key) fits one segment, and fits the slice beside the tier's scratch without crossing the
/// high watermark (which would evict it at once).
pub(crate) fn largest_value_bytes(
    slice_bytes: u64,
    high_watermark_bytes: u64,
    segments: u32,
    segment_bytes: u64,
    max_key_bytes: usize,
) -> u64 {
    let in_dram = high_watermark_bytes.saturating_sub(scratch_bytes_for(segments, slice_bytes));
    let in_segment = segment_bytes.saturating_sub(BLOCK_BYTES);
    let record = in_dram.min(in_segment) / BLOCK_BYTES * BLOCK_BYTES;
    record::largest_value(record, max_key_bytes).max(1)
}

impl SsdState {
    /// Most bytes of deferred loads at once: four restore budgets.
    fn deferred_limit(&self) -> u64 {
        self.config.restore_budget_bytes.saturating_mul(4)
    }

    /// None when the slice cannot even hold the scratch blocks.
    pub(crate) fn new(config: SsdConfig, allocator: &mut OffsetAllocator, slice: &ArenaSlice) -> Option<SsdState> {
        let staging_bytes = staging_bytes_for(allocator.capacity_bytes());
        let scratch = allocator.allocate(scratch_bytes_for(config.segments, allocator.capacity_bytes()))?;
        let tier_config = TierConfig {
            segments: config.segments,
            segment_bytes: config.segment_bytes,
            epoch_seed: config.epoch_seed,
            max_pending_tombstones: config.max_pending_tombstones,
            staging_bytes,
        };
        debug_assert_eq!(tier_config.scratch_bytes(), allocator.len_of(&scratch));
        let Some(ptr) = slice.ptr_at(allocator.offset_of(&scratch), tier_config.scratch_bytes()) else {
            allocator.free(scratch);
            return None;
        };
        // SAFETY: the scratch allocation is inside the slice (checked by `ptr_at`), is never freed
        // while the shard lives (it is held here, beside the tier, for the core's whole life),
        // and nothing but the tier touches its first `scratch_bytes()` bytes.
        let tier = unsafe { SsdTier::new(tier_config, ptr) };
        Some(SsdState {
            tier,
            ops: Slab::new(),
            durable_waiters: Slab::new(),
            tombstone_waiters: std::collections::HashMap::new(),
            borrowed: Slab::new(),
            scratch,
            borrowed_bytes: 0,
            space_waiters: VecDeque::new(),
            loading_bytes: 0,
            deferred_loads: VecDeque::new(),
            deferred_bytes: 0,
            loads_by_object: std::collections::HashMap::new(),
            flush_queue: None,
            flush_best: None,
            frozen: false,
            published: TierCounters::default(),
            config,
        })
    }

    /// Whether operation `token` is a load of object `id`.
    #[cfg(test)]
    pub(super) fn is_load_of(&self, token: usize, id: u32) -> bool {
        matches!(self.ops.get(token), Some(CoreOp::Load { id: of, .. }) if *of == id)
    }

    /// The segment table (tests and debugging).
    #[cfg(test)]
    pub(crate) fn segments(&self) -> &kvtide_tiers::ssd::SegmentTable {
        self.tier.segments()
    }

    /// A one-line summary of the tier's moving parts (test failure messages).
    #[cfg(test)]
    pub(crate) fn describe(&self) -> String {
        format!("{}; core ops {}; space waiters {}", self.tier.describe(), self.ops.len(), self.space_waiters.len())
    }

    /// Bytes the tier keeps allocated for itself (scratch blocks, staging, borrowed tombstones).
    #[cfg(test)]
    pub(crate) fn reserved_bytes(&self, allocator: &OffsetAllocator) -> u64 {
        allocator.len_of(&self.scratch) + self.borrowed_bytes
    }

    #[cfg(test)]
    pub(crate) fn is_quiet(&self) -> bool {
        self.tier.is_quiet() && self.ops.is_empty() && self.tombstone_waiters.is_empty()
    }

    /// A free segment exists that an append cannot open yet (its old header is being zeroed).
    fn room_coming(&self) -> bool {
        self.tier.room_coming()
    }

    /// A reclaim is running or can start, so a write that found no room can wait for one.
    fn space_coming(&self) -> bool {
        self.tier.space_coming()
    }
}

/// The shard's objects as the owners of SSD records: an owner token is an object id and its
/// generation.
struct Owners<'a> {
    objects: &'a mut Slab<Object>,
    facts: &'a [SsdFacts],
    index: &'a IndexWriter,
}

fn owner_token(id: u32, generation: u32) -> u64 {
    (u64::from(id) << 32) | u64::from(generation)
}

fn owner_parts(owner: u64) -> (u32, u32) {
    ((owner >> 32) as u32, owner as u32)
}

impl RecordOwners for Owners<'_> {
    /// A live SSD-only object still at `src` and not in use is copied; its `io_refs` hold it
    /// until the copy's `CopyFinished`.
    fn claim_copy(&mut self, owner: u64, src: SsdLocation) -> bool {
        let (id, generation) = owner_parts(owner);
        let Some(object) = self.objects.get_mut(id as usize) else { return false };
        let eligible = self.index.generation(id) == generation
            && object.state == ObjectState::Live
            && object.io_refs == 0
            && object.dram.is_none()
            && ssd_copy_in(self.facts, id).map(PackedLocation::get) == Some(src);
        if eligible {
            object.io_refs += 1;
        }
        eligible
    }

    fn still_wanted(&self, owner: u64) -> bool {
        let (id, generation) = owner_parts(owner);
        self.objects
            .get(id as usize)
            .is_some_and(|o| self.index.generation(id) == generation && o.state == ObjectState::Live)
    }
}

/// What became of a demotion request.
pub(super) enum Demotion {
    Started,
    /// No SSD room until a reclaim frees a segment: keep the object for now.
    Wait,
    /// The tier cannot take it (absent, or the record is too large).
    Refused,
}

impl ShardCore {
    pub(super) fn write_through(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| s.config.write_through)
    }

    /// Disk operations ready to submit.
    pub fn take_disk_ops(&mut self, out: &mut Vec<DiskOp>) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.tier.take_disk_ops(out);
        }
    }

    /// Gives back an operation the disk could not take yet (queue full); it goes first next time.
    pub fn requeue_disk_op(&mut self, op: DiskOp) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.tier.requeue_disk_op(op);
        }
    }

    /// Disk operations submitted or queued and not yet completed.
    pub fn disk_ops_in_flight(&self) -> usize {
        self.ssd.as_ref().map_or(0, |s| s.tier.in_flight())
    }

    /// SSD housekeeping between other work: segment reclaim, queued tombstones, writes waiting
    /// for space, zeroing freed segments' headers and group commit (one `fdatasync` per segment
    /// with completed, unsynced writes). Returns true if it queued any I/O.
    pub fn schedule_syncs(&mut self) -> bool {
        let Some(ssd) = self.ssd.as_ref() else { return false };
        if ssd.frozen {
            return self.queue_syncs(false);
        }
        let before = ssd.tier.queued_ops();
        self.advance_reclaim();
        self.retry_space_waiters();
        self.pump_tombstones();
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.tier.invalidate_stale_headers();
        }
        let synced = self.queue_syncs(false);
        synced || self.ssd.as_ref().map_or(0, |s| s.tier.queued_ops()) > before
    }

    /// Syncs every segment with completed writes (clean shutdown: a restart finds everything).
    pub fn sync_everything(&mut self) -> bool {
        self.queue_syncs(true)
    }

    fn queue_syncs(&mut self, all: bool) -> bool {
        let Some(ssd) = self.ssd.as_mut() else { return false };
        ssd.tier.queue_syncs(all)
    }

    /// Places a record of `record_bytes`. Only relocation copies may open the last free
    /// segment, so a reclaim always has room to finish.
    fn place_record(&mut self, record_bytes: u64, relocation: bool) -> Placement {
        let Some(ssd) = self.ssd.as_mut() else { return Placement::TooLarge };
        ssd.tier.place(record_bytes, relocation)
    }

    /// Reacts to what the tier reports, in order, until it has nothing more to say; then
    /// publishes its counters.
    fn drain_tier_events(&mut self) {
        while let Some(event) = self.ssd.as_mut().and_then(|s| s.tier.next_event()) {
            match event {
                TierEvent::Done { tag, result } => {
                    self.finish_op(tag as usize, result.map_err(|failure| Error::Io(failure.to_string())));
                }
                TierEvent::Durability { durable, lost } => self.on_durability(&durable, &lost),
                TierEvent::Loaded { tag, result } => self.finish_loaded(tag as usize, result),
                TierEvent::LoadProgress { tag, value_offset, value_bytes } => {
                    if let Some(CoreOp::Load { landing: Some(landing), .. }) =
                        self.ssd.as_ref().and_then(|s| s.ops.get(tag as usize))
                    {
                        landing.advance(value_offset, value_bytes);
                    }
                }
                TierEvent::Tombstones { durable, skipped } => self.on_tombstones(&durable, &skipped),
                TierEvent::BufferReleased { handle } => self.release_borrowed(handle as usize),
                TierEvent::CopyFinished { owner, src, written_bytes, outcome } => {
                    self.on_copy_finished(owner, src, written_bytes, outcome);
                }
                TierEvent::CopyLost { owner, src, dst } => self.on_copy_lost(owner, src, dst),
                TierEvent::SegmentFreed { segment, copies, owners } => self.on_segment_freed(segment, copies, owners),
            }
        }
        self.publish_tier_counters();
    }

    /// Adds what the tier counted since the last call to the shard's counters.
    fn publish_tier_counters(&mut self) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let now = ssd.tier.counters();
        let was = std::mem::replace(&mut ssd.published, now);
        let c = &self.counters;
        c.syncs.fetch_add(now.syncs - was.syncs, RELAXED);
        c.io_errors.fetch_add(now.io_errors - was.io_errors, RELAXED);
        c.short_io.fetch_add(now.short_io - was.short_io, RELAXED);
        c.tombstones.fetch_add(now.tombstones - was.tombstones, RELAXED);
        c.tombstones_skipped.fetch_add(now.tombstones_skipped - was.tombstones_skipped, RELAXED);
        c.tombstones_pending.store(ssd.tier.queued_tombstones() as u64, RELAXED);
        c.ssd_write_failed.store(u64::from(ssd.tier.failed()), RELAXED);
    }

    /// DRAM lent to the tier for a long tombstone came back.
    fn release_borrowed(&mut self, handle: usize) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let Some(allocation) = ssd.borrowed.try_remove(handle) else { return };
        let bytes = self.allocator.len_of(&allocation);
        ssd.borrowed_bytes -= bytes;
        self.counters.bytes_used.fetch_sub(bytes, RELAXED);
        self.allocator.free(allocation);
    }

    // ---- reclaim --------------------------------------------------------------------------

    /// Starts or advances the reclaim of the oldest segment (the tier decides when one is due
    /// and frees the segment). Every live record in it is copied forward first: DRAM-resident
    /// ones are rewritten from their DRAM image, SSD-only ones are copied by the tier through its
    /// staging buffer. Only when the tier is mostly live do its cold records leave the cache
    /// instead (and then a write-through object leaves DRAM too: an object that is served must
    /// be durable).
    fn advance_reclaim(&mut self) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let step = ssd.tier.reclaim_step(&mut Owners {
            objects: &mut self.objects,
            facts: &self.ssd_facts,
            index: &self.index,
        });
        self.drain_tier_events();
        let ReclaimStep::Decide { segment, copy_cold, owners } = step else { return };
        let mut busy = false;
        let mut queue = Vec::new();
        for (id, generation) in owners.into_iter().map(owner_parts) {
            let Some(object) = self.objects.get(id as usize) else { continue };
            if self.index.generation(id) != generation || self.ssd_copy(id).is_none_or(|l| l.segment != segment) {
                continue;
            }
            if object.io_refs > 0 {
                // A load or a write: look again when it is done.
                busy = true;
                continue;
            }
            if object.state != ObjectState::Live {
                // Replaced or removed, kept only for its readers (of its DRAM copy): its record
                // is dead, and a tombstone or a newer record already covers it.
                if let Some(location) = self.take_ssd_copy(id) {
                    self.forget_ssd_copy(&location);
                }
                continue;
            }
            let pinned = object.pins > 0;
            if object.dram.is_some() {
                if !copy_cold && !pinned && object.leases == 0 {
                    self.drop_ssd_copy(id);
                    continue;
                }
                self.policy.remove(id as EntryId);
                match self.start_record_write(id, WritePurpose::Relocation) {
                    Placement::At(_) => {
                        if let Some(ssd) = self.ssd.as_mut() {
                            ssd.tier.relocation_write_started();
                        }
                    }
                    Placement::Full if self.ssd.as_ref().is_some_and(SsdState::room_coming) => {
                        // The spare segment is still being zeroed: copy it on a later pass.
                        self.track_if_resident(id);
                        busy = true;
                    }
                    Placement::Full | Placement::TooLarge => {
                        self.track_if_resident(id);
                        self.drop_ssd_copy(id);
                    }
                }
            } else if copy_cold || pinned {
                if let Some(src) = self.ssd_copy(id) {
                    let identity = self.record_identity(id);
                    queue.push(CopyRequest { owner: owner_token(id, generation), src, identity });
                }
            } else {
                self.evict_from_ssd(id);
            }
        }
        let Some(ssd) = self.ssd.as_mut() else { return };
        ssd.tier.reclaim_decided(
            queue,
            busy,
            &mut Owners { objects: &mut self.objects, facts: &self.ssd_facts, index: &self.index },
        );
        self.drain_tier_events();
    }

    /// A copy the reclaim made will never be durable: the object rests at its old record again.
    fn on_copy_lost(&mut self, owner: u64, src: SsdLocation, dst: SsdLocation) {
        let (id, generation) = owner_parts(owner);
        if self.object_of(id, generation).is_some() && self.ssd_copy(id) == Some(dst) {
            self.set_ssd_copy(id, src);
            if let Some(ssd) = self.ssd.as_mut() {
                ssd.tier.sub_live(dst.segment, dst.record_bytes);
                ssd.tier.add_live(src.segment, src.record_bytes);
            }
        }
    }

    /// The reclaimed segment was freed: anything still naming it (a retired object kept by a
    /// reader) lets go now.
    fn on_segment_freed(&mut self, segment: u32, copies: usize, owners: Vec<u64>) {
        for (id, generation) in owners.into_iter().map(owner_parts) {
            if self.object_of(id, generation).is_some() && self.ssd_copy(id).is_some_and(|l| l.segment == segment) {
                if let Some(location) = self.take_ssd_copy(id) {
                    self.forget_ssd_copy(&location);
                }
                if self.has_no_copy(id) {
                    self.drop_object(id);
                }
            }
        }
        self.counters.segments_reclaimed.fetch_add(1, RELAXED);
        if copies > 0 {
            self.counters.compactions.fetch_add(1, RELAXED);
            self.counters.compacted_records.fetch_add(copies as u64, RELAXED);
        }
        self.retry_waiters();
    }

    /// A copy through the tier's staging buffer ended: the object moves to its new record, or
    /// (a rotten or unreadable source, or no room) leaves the cache, counted.
    fn on_copy_finished(&mut self, owner: u64, src: SsdLocation, written_bytes: u64, outcome: CopyOutcome) {
        let (id, generation) = owner_parts(owner);
        self.counters.ssd_write_bytes.fetch_add(written_bytes, RELAXED);
        let Some(object) = self.objects.get_mut(id as usize) else { return };
        // The copy held the object (`claim_copy`).
        object.io_refs -= 1;
        let live = self.index.generation(id) == generation
            && object.state == ObjectState::Live
            && self.ssd_copy(id) == Some(src);
        match outcome {
            CopyOutcome::Copied { dst } if live => {
                self.set_ssd_copy(id, dst);
                if let Some(ssd) = self.ssd.as_mut() {
                    ssd.tier.sub_live(src.segment, src.record_bytes);
                    ssd.tier.add_live(dst.segment, dst.record_bytes);
                    ssd.tier.add_resident(dst.segment, owner);
                    ssd.tier.track_copy(owner, src, dst);
                }
            }
            CopyOutcome::RetryLater => {
                // Read again on a later pass.
                self.after_last_use(id);
                return;
            }
            _ if live => {
                match outcome {
                    CopyOutcome::Corrupted(_) => {
                        self.counters.corrupted.fetch_add(1, RELAXED);
                    }
                    CopyOutcome::Failed(_) => {
                        if let Some(ssd) = self.ssd.as_mut() {
                            ssd.tier.relocation_failed();
                        }
                    }
                    _ => {}
                }
                self.evict_from_ssd(id);
            }
            _ => self.after_last_use(id),
        }
        self.retry_waiters();
    }

    /// A DRAM-resident object loses its SSD copy (its segment is being reclaimed in a mostly
    /// live tier). Write-through: it leaves the cache, since everything served must be durable.
    /// Write-back: it stays, dirty again, and is demoted when next evicted.
    fn drop_ssd_copy(&mut self, id: u32) {
        let Some(location) = self.take_ssd_copy(id) else { return };
        self.forget_ssd_copy(&location);
        // Its record stays readable on disk until the segment is freed and zeroed: a remove or
        // an upsert must still write a tombstone for it.
        self.objects[id as usize].mark_shadowed();
        if self.write_through() {
            self.counters.ssd_evictions.fetch_add(1, RELAXED);
            self.unlink(id);
            return;
        }
        // Dirty again: a clean shutdown under way writes it out too.
        let generation = self.index.generation(id);
        if let Some(queue) = self.ssd.as_mut().and_then(|s| s.flush_queue.as_mut()) {
            queue.push_back((id, generation));
        }
    }

    /// An SSD-only object leaves the cache with its segment.
    fn evict_from_ssd(&mut self, id: u32) {
        let Some(location) = self.take_ssd_copy(id) else { return };
        self.forget_ssd_copy(&location);
        self.counters.ssd_evictions.fetch_add(1, RELAXED);
        self.drop_object(id);
    }

    /// Takes a live object with no copy left out of the index (or frees a retired one).
    fn drop_object(&mut self, id: u32) {
        let object = &self.objects[id as usize];
        if object.state == ObjectState::Live {
            self.unlink(id);
        } else {
            self.after_last_use(id);
        }
    }

    // ---- writes ---------------------------------------------------------------------------

    /// Starts writing a dirty victim's record from its DRAM image.
    pub(super) fn start_demotion(&mut self, id: u32) -> Demotion {
        match self.start_record_write(id, WritePurpose::Demotion) {
            Placement::At(_) => {
                let bytes = self.objects[id as usize].dram.as_ref().map_or(0, |a| self.allocator.len_of(a));
                self.demoting_bytes += bytes;
                self.counters.demotions.fetch_add(1, RELAXED);
                Demotion::Started
            }
            Placement::Full if self.ssd.as_ref().is_some_and(SsdState::space_coming) => {
                self.counters.ssd_space_waits.fetch_add(1, RELAXED);
                Demotion::Wait
            }
            Placement::Full | Placement::TooLarge => Demotion::Refused,
        }
    }

    /// True while SSD writes wait for a reclaim (an allocation that needs a demotion waits too).
    pub(super) fn ssd_space_coming(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| s.space_coming())
    }

    /// Loads are reading into DRAM now: when each ends, its object becomes evictable (or its
    /// buffer is freed) unless a reader still holds it.
    pub(super) fn loads_in_flight(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| !s.loads_by_object.is_empty())
    }

    /// Write-through: the commit's result waits for the record to be durable (and, when the tier
    /// has no room yet, for a reclaim to make some).
    pub(super) fn write_through_record(&mut self, id: u32, pending: usize, slot: usize) {
        self.policy.remove(id as EntryId);
        match self.start_record_write(id, WritePurpose::WriteThrough { pending, slot }) {
            Placement::At(_) => {}
            Placement::Full if self.ssd_space_coming() => {
                self.counters.ssd_space_waits.fetch_add(1, RELAXED);
                let generation = self.index.generation(id);
                self.objects[id as usize].io_refs += 1;
                self.unpublish(id);
                if let Some(ssd) = self.ssd.as_mut() {
                    ssd.space_waiters.push_back(SpaceWaiter { object: id, generation, pending, slot });
                }
            }
            Placement::Full | Placement::TooLarge => {
                // All or nothing: a put that cannot be made durable is not kept.
                self.unlink_unacknowledged(id);
                self.resolve_commit(pending, slot, Err(Error::NoSpace));
            }
        }
    }

    /// Retries write-through commits that waited for space, oldest first.
    fn retry_space_waiters(&mut self) {
        loop {
            let Some(ssd) = self.ssd.as_mut() else { return };
            let Some(w) = ssd.space_waiters.pop_front() else { return };
            let object = &mut self.objects[w.object as usize];
            object.io_refs -= 1;
            if self.index.generation(w.object) != w.generation || object.state != ObjectState::Live {
                // Replaced or removed while it waited: it was never made durable, so it is not
                // acknowledged.
                self.after_last_use(w.object);
                self.resolve_commit(w.pending, w.slot, Err(Error::Cancelled));
                self.finish_commit_if_done(w.pending);
                continue;
            }
            match self.start_record_write(w.object, WritePurpose::WriteThrough { pending: w.pending, slot: w.slot }) {
                Placement::At(_) => {}
                Placement::Full if self.ssd_space_coming() => {
                    self.objects[w.object as usize].io_refs += 1;
                    self.unpublish(w.object);
                    if let Some(ssd) = self.ssd.as_mut() {
                        ssd.space_waiters.push_front(w);
                    }
                    return;
                }
                Placement::Full | Placement::TooLarge => {
                    self.unlink_unacknowledged(w.object);
                    self.resolve_commit(w.pending, w.slot, Err(Error::NoSpace));
                    self.finish_commit_if_done(w.pending);
                }
            }
        }
    }

    /// Fails the write-through commits waiting for space (shutdown): they are not kept.
    pub(super) fn fail_space_waiters(&mut self, error: &Error) {
        while let Some(w) = self.ssd.as_mut().and_then(|s| s.space_waiters.pop_front()) {
            let object = &mut self.objects[w.object as usize];
            object.io_refs -= 1;
            if self.index.generation(w.object) == w.generation && object.state == ObjectState::Live {
                self.unlink_unacknowledged(w.object);
            } else {
                self.after_last_use(w.object);
            }
            self.resolve_commit(w.pending, w.slot, Err(error.clone()));
            self.finish_commit_if_done(w.pending);
        }
    }

    /// Seals the record image in the object's DRAM and queues its write.
    fn start_record_write(&mut self, id: u32, purpose: WritePurpose) -> Placement {
        let object = &self.objects[id as usize];
        let Some(allocation) = object.dram.as_ref() else { return Placement::TooLarge };
        let facts = self.facts(id);
        let (key_len, len, seq, offset) =
            (self.index.key(id).len(), self.index.value_len(id), facts.seq, self.allocator.offset_of(allocation));
        // An image loaded from an older record keeps its layout: it is re-stamped, not re-sealed.
        let current_layout = u64::from(facts.value_offset) == record::value_offset(key_len, len);
        let record_bytes = if current_layout {
            record::record_bytes(key_len, len)
        } else {
            let Some(head) = self.slice.ptr_at(offset, HEADER_BYTES as u64) else { return Placement::TooLarge };
            // SAFETY: the header block of this object's own DRAM image (checked when it was
            // loaded); nothing writes it while no write of the object is in flight.
            let head = unsafe { std::slice::from_raw_parts(head.as_ptr(), HEADER_BYTES) };
            match record::decode_header(head) {
                Ok(header) => header.record_bytes(),
                Err(_) => return Placement::TooLarge,
            }
        };
        let Some(ptr) = self.slice.ptr_at(offset, record_bytes) else { return Placement::TooLarge };
        let location = match self.place_record(record_bytes, purpose == WritePurpose::Relocation) {
            Placement::At(location) => location,
            other => return other,
        };
        // SAFETY: the record image is this object's own DRAM allocation; its value is immutable
        // once committed, and no other write of it is in flight (callers check io_refs), so
        // nothing else writes the header block or the checksum table. io_refs (below) keeps the
        // allocation alive until the write completes. Readers only read the value bytes.
        let image = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), record_bytes as usize) };
        let sealed = if current_layout {
            record::seal_in_place(image, RecordKind::Put, key_len, len, seq, location.epoch)
        } else {
            record::restamp_epoch(image, location.epoch).map(drop)
        };
        if sealed.is_err() {
            self.abandon_placement(location);
            return Placement::TooLarge;
        }
        let Some(ssd) = self.ssd.as_mut() else { return Placement::TooLarge };
        self.objects[id as usize].io_refs += 1;
        // Published readers stay out while the record is written (those in keep the object's DRAM).
        self.index.close(id);
        let tag = ssd.ops.insert(CoreOp::Write { id, location, purpose }) as u64;
        // SAFETY: the image is the object's own DRAM allocation, sealed above and unchanged until
        // the write completes (its value is immutable once committed, and no other write of it
        // is in flight); io_refs keeps the allocation alive until `finish_op` sees the write.
        unsafe { ssd.tier.write_record(location, ptr, tag) };
        Placement::At(location)
    }

    /// The SSD tier stopped taking writes (a segment header failed every try).
    #[cfg(test)]
    pub(super) fn ssd_failed(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| s.tier.failed())
    }

    /// `Busy` when the tombstone queue is at its bound, `Io` when the tier can no longer write
    /// one: a remove or upsert that needs one must then not happen (nothing is dropped).
    pub(super) fn tombstone_room(&self) -> Result<()> {
        match self.ssd.as_ref().map(|s| s.tier.tombstone_room()) {
            Some(Err(TombstoneRefused::Full { limit })) => Err(Error::Busy { limit }),
            Some(Err(TombstoneRefused::TierFailed)) => {
                self.counters.ssd_write_failed.store(1, RELAXED);
                Err(Error::Io(
                    "the SSD tier stopped taking writes after repeated disk failures: removing or replacing an object stored on SSD cannot be made durable".into(),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Records that the SSD copy of `key` (if any) no longer counts: recovery keeps the key
    /// removed, or lets a newer put win. The tombstone takes its sequence number now (returned:
    /// `TierEvent::Tombstones` names it once durable or given up on), is queued and written as
    /// soon as a block and a place are free; only a disk failing every write drops it.
    pub(super) fn queue_tombstone(&mut self, key: &[u8]) -> u64 {
        let seq = self.bump_seq();
        let Some(ssd) = self.ssd.as_mut() else { return seq };
        // Callers checked `tombstone_room` before removing anything; an unacknowledged put is
        // gone already, so its tombstone is queued even past the bound.
        ssd.tier.must_queue_tombstone(key, seq);
        self.publish_tier_counters();
        seq
    }

    /// What a record of object `id` must say of itself for a read of it to be accepted.
    fn record_identity(&self, id: u32) -> RecordIdentity {
        let seq = self.facts(id).seq;
        RecordIdentity { seq, value_len: self.index.value_len(id), key: self.index.key(id).into() }
    }

    /// A write-through put that cannot be made durable is not kept, and the version it
    /// replaced is gone already: a tombstone makes a restart agree that the key is absent.
    fn unlink_unacknowledged(&mut self, id: u32) {
        let key: Box<[u8]> = self.index.key(id).into();
        self.unlink(id);
        self.queue_tombstone(&key);
    }

    /// Writes queued tombstones while blocks and segment room are free (longer keys borrow DRAM
    /// for theirs).
    fn pump_tombstones(&mut self) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let SsdState { tier, borrowed, borrowed_bytes, .. } = ssd;
        let (allocator, slice, counters) = (&mut self.allocator, &self.slice, &self.counters);
        let mut borrow = |bytes: u64| {
            let allocation = allocator.allocate(bytes)?;
            let Some(ptr) = slice.ptr_at(allocator.offset_of(&allocation), bytes) else {
                allocator.free(allocation);
                return None;
            };
            let reserved = allocator.len_of(&allocation);
            *borrowed_bytes += reserved;
            counters.bytes_used.fetch_add(reserved, RELAXED);
            Some((ptr, borrowed.insert(allocation) as u64))
        };
        // SAFETY: each block lent is a fresh allocation of `bytes` inside the slice, held in
        // `borrowed` (used by nothing else) until the tier's `BufferReleased` event frees it.
        unsafe { tier.pump_tombstones(&mut borrow) };
        self.drain_tier_events();
    }

    /// An object's SSD copy is gone (object freed).
    pub(super) fn forget_ssd_copy(&mut self, location: &SsdLocation) {
        self.counters.ssd_objects.fetch_sub(1, RELAXED);
        self.counters.ssd_bytes.fetch_sub(location.record_bytes, RELAXED);
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.tier.sub_live(location.segment, location.record_bytes);
        }
    }

    /// Starts the load of `location` into `allocation` (already taken from the allocator) for
    /// object `id`: in pieces, with a `Landing` early readers follow, when `progressive`; its
    /// disk read now, or, `deferred`, once earlier loads left room in the restore budget. None
    /// (and the allocation returned) if the buffer is outside the slice; else the load's tag.
    fn submit_load(
        &mut self,
        id: u32,
        location: SsdLocation,
        allocation: Allocation,
        waiters: Vec<(usize, usize)>,
        progressive: bool,
        deferred: bool,
    ) -> Option<usize> {
        if self.slice.ptr_at(self.allocator.offset_of(&allocation), location.record_bytes).is_none() {
            self.allocator.free(allocation);
            return None;
        }
        let Some(ssd) = self.ssd.as_mut() else {
            self.allocator.free(allocation);
            return None;
        };
        self.counters.bytes_used.fetch_add(self.allocator.len_of(&allocation), RELAXED);
        let landing = progressive.then(|| Arc::new(Landing::default()));
        let op = CoreOp::Load { id, location, allocation: Some(allocation), waiters, landing, early: Vec::new() };
        let token = ssd.ops.insert(op);
        ssd.loads_by_object.insert(id, token);
        self.objects[id as usize].io_refs += 1;
        self.counters.loads.fetch_add(1, RELAXED);
        if deferred {
            ssd.deferred_loads.push_back(token);
            ssd.deferred_bytes += location.record_bytes;
            self.counters.deferred_loads.fetch_add(1, RELAXED);
        } else {
            self.start_load_io(token);
        }
        Some(token)
    }

    /// Hands load `token`'s disk read to the tier.
    fn start_load_io(&mut self, token: usize) {
        let Some(CoreOp::Load { id, location, allocation: Some(allocation), landing, .. }) =
            self.ssd.as_ref().and_then(|s| s.ops.get(token))
        else {
            return;
        };
        let (id, location, progressive) = (*id, *location, landing.is_some());
        let Some(ptr) = self.slice.ptr_at(self.allocator.offset_of(allocation), location.record_bytes) else { return };
        let identity = self.record_identity(id);
        let Some(ssd) = self.ssd.as_mut() else { return };
        ssd.loading_bytes += location.record_bytes;
        if progressive {
            let piece_bytes = ssd.config.load_piece_bytes;
            // SAFETY: as below; the value bytes a `LoadProgress` reports are only read (by early
            // readers), never written again.
            unsafe { ssd.tier.load_progressive(location, ptr, identity, token as u64, piece_bytes) };
        } else {
            // SAFETY: the buffer is a fresh allocation of the record's size, held by the
            // operation (nothing else references it) until the tier's `Loaded` event for it.
            unsafe { ssd.tier.load(location, ptr, identity, token as u64) };
        }
    }

    /// Starts deferred loads, oldest first, while the restore budget has room (at least one
    /// when nothing loads).
    fn start_deferred_loads(&mut self) {
        loop {
            let Some(ssd) = self.ssd.as_mut() else { return };
            let Some(&token) = ssd.deferred_loads.front() else { return };
            let bytes = match ssd.ops.get(token) {
                Some(CoreOp::Load { location, .. }) => location.record_bytes,
                _ => 0,
            };
            if ssd.loading_bytes > 0 && ssd.loading_bytes + bytes > ssd.config.restore_budget_bytes {
                return;
            }
            ssd.deferred_loads.pop_front();
            ssd.deferred_bytes -= bytes;
            self.start_load_io(token);
        }
    }

    /// The in-flight load filling object `id`'s DRAM copy, by its operation tag.
    pub(super) fn load_token(&self, id: u32) -> Option<usize> {
        self.ssd.as_ref().and_then(|s| s.loads_by_object.get(&id).copied())
    }

    /// Starts or joins the load of an SSD-only object for slot `slot` of a pending read (an
    /// early read is granted at once, see `early_lease`). False when it must wait for memory or
    /// restore budget.
    pub(super) fn load_for_read(&mut self, id: u32, pending: usize, slot: usize) -> bool {
        let early = self.pending_reads.get(pending).is_some_and(|p| p.early);
        if let Some(token) = self.load_token(id) {
            if let Some(CoreOp::Load { waiters, .. }) = self.ssd.as_mut().and_then(|s| s.ops.get_mut(token)) {
                if early {
                    let grant = self.early_lease(id, token, pending);
                    self.resolve_read(pending, slot, grant);
                } else {
                    waiters.push((pending, slot));
                }
                return true;
            }
        }
        if self.objects[id as usize].io_refs > 0 {
            // A reclaim is copying its record forward: read it once the copy is done.
            return false;
        }
        let Some(location) = self.ssd_copy(id) else {
            self.resolve_read(pending, slot, Err(Error::Internal("object in no tier")));
            return true;
        };
        let Some(ssd) = self.ssd.as_ref() else {
            self.resolve_read(pending, slot, Err(Error::Internal("SSD object without an SSD tier")));
            return true;
        };
        // Queued loads go first: while any waits, a new load counts as over the budget.
        let over_budget = !ssd.deferred_loads.is_empty()
            || (ssd.loading_bytes > 0 && ssd.loading_bytes + location.record_bytes > ssd.config.restore_budget_bytes);
        // An early lease does not wait for the budget: its load is queued (within a bound) and
        // its reader waits on the load's gate instead of for its grant.
        let defer = over_budget && early && ssd.deferred_bytes + location.record_bytes <= ssd.deferred_limit();
        if over_budget && !defer {
            self.counters.restore_waits.fetch_add(1, RELAXED);
            return false;
        }
        let allocation = match self.allocate_or_wait(location.record_bytes) {
            Ok(Some(a)) => a,
            Ok(None) => return false,
            Err(e) => {
                self.resolve_read(pending, slot, Err(e));
                return true;
            }
        };
        // The eviction above may have reclaimed memory but never this object (it has no DRAM).
        let waiters = if early { Vec::new() } else { vec![(pending, slot)] };
        let Some(token) = self.submit_load(id, location, allocation, waiters, early, defer) else {
            self.resolve_read(pending, slot, Err(Error::Internal("load buffer outside slice")));
            return true;
        };
        if early {
            let grant = self.early_lease(id, token, pending);
            self.resolve_read(pending, slot, grant);
        }
        true
    }

    /// Leases object `id` while its load `token` runs: the grant names the record buffer and the
    /// load's `Landing` (made now if the load had none: it then moves only when the load ends).
    fn early_lease(&mut self, id: u32, token: usize, pending: usize) -> Result<ReadGrant> {
        self.lease_room(id)?;
        let deadline = self.pending_reads.get(pending).and_then(|p| p.deadline);
        let Some(CoreOp::Load { location, allocation: Some(allocation), landing, .. }) =
            self.ssd.as_mut().and_then(|s| s.ops.get_mut(token))
        else {
            return Err(Error::Internal("an early read joined no load"));
        };
        let landing = Arc::clone(landing.get_or_insert_with(Default::default));
        let ptr = self
            .slice
            .ptr_at(self.allocator.offset_of(allocation), location.record_bytes)
            .ok_or(Error::Internal("load buffer outside slice"))?;
        let lease = self.add_lease(id);
        if let Some(CoreOp::Load { early, .. }) = self.ssd.as_mut().and_then(|s| s.ops.get_mut(token)) {
            early.push(lease);
        }
        if let Some(deadline) = deadline {
            self.lease_deadlines.push(Reverse((deadline, lease)));
        }
        let len = self.index.value_len(id);
        self.counters.hits.fetch_add(1, RELAXED);
        self.counters.bytes_read.fetch_add(len, RELAXED);
        Ok(ReadGrant { lease, ptr, len, landing: Some(landing) })
    }

    /// Advances the operation a completion belongs to. Unknown tokens are ignored.
    pub fn on_disk_completion(&mut self, completion: DiskCompletion) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        ssd.tier.on_completion(
            completion,
            &mut Owners { objects: &mut self.objects, facts: &self.ssd_facts, index: &self.index },
        );
        self.drain_tier_events();
    }

    /// One of the core's operations finished (every byte transferred, or it failed).
    fn finish_op(&mut self, tag: usize, result: Result<()>) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let Some(op) = ssd.ops.try_remove(tag) else {
            tracing::warn!(tag, "the SSD tier finished an unknown operation");
            return;
        };
        match op {
            CoreOp::Write { id, location, purpose } => {
                // The tier counted the record live and ended the write in its segment.
                self.counters
                    .ssd_write_bytes
                    .fetch_add(if result.is_ok() { location.record_bytes } else { 0 }, RELAXED);
                self.finish_record_write(id, location, purpose, result);
            }
            CoreOp::Load { id, location, allocation, waiters, landing, early } => {
                // Loads end with `Loaded`; a plain `Done` for one is a tier bug: fail it.
                ssd.loading_bytes -= location.record_bytes;
                // Queued loads take the freed budget before the reads that wait for it.
                self.start_deferred_loads();
                let checked = result.and(Err(Error::Internal("a load ended without verification")));
                self.finish_load(FinishedLoad { id, location, allocation, waiters, landing, early }, checked);
            }
        }
    }

    /// A load finished: the tier verified the record (or says why it is not good).
    fn finish_loaded(&mut self, tag: usize, result: std::result::Result<(), LoadFailure>) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let Some(CoreOp::Load { id, location, allocation, waiters, landing, early }) = ssd.ops.try_remove(tag) else {
            tracing::warn!(tag, "the SSD tier finished an unknown load");
            return;
        };
        ssd.loading_bytes -= location.record_bytes;
        // Queued loads take the freed budget before the reads that wait for it.
        self.start_deferred_loads();
        let checked = result.map_err(|failure| match failure {
            LoadFailure::Io(failure) => Error::Io(failure.to_string()),
            LoadFailure::Corrupted(why) => Error::Corrupted(why),
        });
        self.finish_load(FinishedLoad { id, location, allocation, waiters, landing, early }, checked);
    }

    /// A placed record that will never be written: a hole in its segment (see
    /// `SsdTier::abandon`).
    fn abandon_placement(&mut self, location: SsdLocation) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        ssd.tier.abandon(location);
        self.drain_tier_events();
    }

    /// Answers a write-through remove once its tombstone is durable (`remove_then`).
    pub(super) fn await_tombstone(&mut self, seq: u64, done: Done<Result<()>>) {
        match self.ssd.as_mut() {
            Some(ssd) => {
                ssd.tombstone_waiters.insert(seq, done);
                self.counters.removes_awaiting_tombstone.store(ssd.tombstone_waiters.len() as u64, RELAXED);
            }
            None => done(Ok(())),
        }
    }

    /// Answers the removes whose tombstones are durable now, and fails those whose tombstones
    /// will never be written (the key is gone here, but may come back after a restart).
    fn on_tombstones(&mut self, durable: &[u64], skipped: &[u64]) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        for seq in durable {
            if let Some(done) = ssd.tombstone_waiters.remove(seq) {
                done(Ok(()));
            }
        }
        for seq in skipped {
            if let Some(done) = ssd.tombstone_waiters.remove(seq) {
                done(Err(Error::Io(
                    "the remove's tombstone could not be made durable: the key may come back after a restart".into(),
                )));
            }
        }
        self.counters.removes_awaiting_tombstone.store(ssd.tombstone_waiters.len() as u64, RELAXED);
    }

    /// Acknowledges the write-through commits the durable prefix now covers, and fails those
    /// that a broken segment can never cover.
    fn on_durability(&mut self, durable: &[u64], lost: &[u64]) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let ready: Vec<DurableWaiter> =
            durable.iter().filter_map(|&tag| ssd.durable_waiters.try_remove(tag as usize)).collect();
        let failed: Vec<DurableWaiter> =
            lost.iter().filter_map(|&tag| ssd.durable_waiters.try_remove(tag as usize)).collect();
        let mut touched = Vec::new();
        for w in ready {
            if let Some((pending, slot)) = w.commit {
                self.resolve_commit(pending, slot, Ok(()));
                touched.push(pending);
            }
        }
        for w in failed {
            let Some((pending, slot)) = w.commit else {
                self.forget_undurable_record(w);
                continue;
            };
            // All or nothing: a put that cannot be made durable is not kept.
            let live = self.object_of(w.object, w.generation).is_some_and(|o| o.state == ObjectState::Live);
            if live {
                self.unlink_unacknowledged(w.object);
            }
            self.resolve_commit(
                pending,
                slot,
                Err(Error::Io("the SSD write or sync before this record failed".into())),
            );
            touched.push(pending);
        }
        touched.sort_unstable();
        touched.dedup();
        for pending in touched {
            self.finish_commit_if_done(pending);
        }
    }

    /// A written-back record will never be durable (a write or sync before it in its segment
    /// failed): recovery stops at the break, so after a restart the object would be gone without
    /// a trace. If the object still rests there, it stops doing so: a DRAM copy becomes dirty
    /// again (a later demotion or shutdown flush writes it anew); an object on SSD only leaves
    /// the cache now, counted as an eviction (its older versions were tombstoned when it
    /// replaced them).
    fn forget_undurable_record(&mut self, w: DurableWaiter) {
        let rests_there = self.object_of(w.object, w.generation).is_some_and(|o| o.state != ObjectState::Abandoned)
            && self.ssd_copy(w.object) == Some(w.location);
        if !rests_there {
            return;
        }
        self.counters.ssd_records_lost.fetch_add(1, RELAXED);
        self.take_ssd_copy(w.object);
        let object = &mut self.objects[w.object as usize];
        let (in_dram, live) = (object.dram.is_some(), object.state == ObjectState::Live);
        // A copy loaded for one read only would go with its reader: it is the only copy now.
        let untracked = object.transient();
        object.set_transient(false);
        self.forget_ssd_copy(&w.location);
        if in_dram || !live {
            // Dirty again (or retired: freed with its last user).
            if live && untracked {
                self.track_if_resident(w.object);
            }
            return;
        }
        self.counters.evictions.fetch_add(1, RELAXED);
        self.unlink(w.object);
    }

    fn finish_record_write(&mut self, id: u32, location: SsdLocation, purpose: WritePurpose, result: Result<()>) {
        let dram_bytes = self.objects[id as usize].dram.as_ref().map_or(0, |a| self.allocator.len_of(a));
        if purpose == WritePurpose::Demotion {
            self.demoting_bytes -= dram_bytes;
        }
        if purpose == WritePurpose::Flush {
            self.flushing_bytes = self.flushing_bytes.saturating_sub(dram_bytes);
        }
        if purpose == WritePurpose::Relocation {
            if let Some(ssd) = self.ssd.as_mut() {
                ssd.tier.relocation_write_done(result.is_ok());
            }
        }
        self.objects[id as usize].io_refs -= 1;
        match result {
            Ok(()) => {
                let previous = self.take_ssd_copy(id);
                self.set_ssd_copy(id, location);
                let generation = self.index.generation(id);
                if let Some(previous) = previous {
                    // A relocation copy replaces the record in the segment being freed.
                    self.forget_ssd_copy(&previous);
                }
                self.counters.ssd_objects.fetch_add(1, RELAXED);
                self.counters.ssd_bytes.fetch_add(location.record_bytes, RELAXED);
                if let Some(ssd) = self.ssd.as_mut() {
                    ssd.tier.add_resident(location.segment, owner_token(id, generation));
                    // A write-through commit waits for durability; a demotion or flush watches
                    // for a break before it, without hurrying group commit (relocation copies
                    // have the tier's `CopyLost`).
                    let commit = match purpose {
                        WritePurpose::WriteThrough { pending, slot } => Some(Some((pending, slot))),
                        WritePurpose::Demotion | WritePurpose::Flush => Some(None),
                        WritePurpose::Relocation => None,
                    };
                    if let Some(commit) = commit {
                        let end = location.offset + location.record_bytes;
                        let waiter = DurableWaiter { commit, object: id, generation, location };
                        let tag = ssd.durable_waiters.insert(waiter) as u64;
                        if commit.is_some() {
                            ssd.tier.await_durable(location.segment, end, tag);
                        } else {
                            ssd.tier.watch_durable(location.segment, end, tag);
                        }
                    }
                    if let (WritePurpose::Relocation, Some(src)) = (purpose, previous) {
                        ssd.tier.track_copy(owner_token(id, generation), src, location);
                    }
                }
                if purpose != WritePurpose::Relocation {
                    // Usually not yet durable; a sync that already covers it (or a break before
                    // it) says so now.
                    self.drain_tier_events();
                }
            }
            Err(e) => {
                if let WritePurpose::WriteThrough { pending, slot } = purpose {
                    if self.objects[id as usize].state == ObjectState::Live {
                        self.unlink_unacknowledged(id);
                    }
                    self.resolve_commit(pending, slot, Err(e));
                    self.finish_commit_if_done(pending);
                    if self.objects.contains(id as usize) {
                        self.after_last_use(id);
                    }
                    self.retry_waiters();
                    return;
                }
            }
        }
        // A write-through object whose segment broke was unlinked (and freed) above.
        let Some(object) = self.objects.get(id as usize) else {
            self.retry_waiters();
            return;
        };
        if object.state == ObjectState::Retired {
            self.after_last_use(id);
        } else if purpose == WritePurpose::Demotion
            && self.has_ssd_copy(id)
            && object.leases == 0
            && object.pins == 0
            && self.index.readers(id) == 0
        {
            // A finished demotion: the DRAM copy goes (the policy no longer tracks it).
            let object = &mut self.objects[id as usize];
            object.set_transient(false);
            if let Some(allocation) = object.dram.take() {
                self.counters.bytes_used.fetch_sub(self.allocator.len_of(&allocation), RELAXED);
                self.counters.dram_objects.fetch_sub(1, RELAXED);
                self.counters.evictions.fetch_add(1, RELAXED);
                self.allocator.free(allocation);
            }
        } else if purpose == WritePurpose::Demotion
            && !self.has_ssd_copy(id)
            && object.leases == 0
            && object.pins == 0
            && self.index.readers(id) == 0
        {
            // The demotion failed: drop the object rather than keep memory others wait for.
            self.index_remove(id);
            self.counters.objects.fetch_sub(1, RELAXED);
            self.counters.evictions.fetch_add(1, RELAXED);
            self.free_object(id);
        } else if object.transient() {
            // Loaded for a read only: its DRAM copy goes once nothing uses it.
            self.after_last_use(id);
        } else {
            self.track_if_resident(id);
        }
        self.retry_waiters();
    }

    // ---- clean shutdown -------------------------------------------------------------------

    /// Writes dirty DRAM objects (no SSD copy) to SSD, so a clean restart finds them; they keep
    /// their DRAM copy. Returns how many are still to start (waiting for room or for their own
    /// I/O); writes in flight count as disk operations.
    pub(super) fn flush_dirty(&mut self) -> usize {
        let Some(ssd) = self.ssd.as_mut() else { return 0 };
        if ssd.flush_queue.is_none() {
            let facts = &self.ssd_facts;
            let dirty = self
                .objects
                .iter()
                .filter(|(id, o)| {
                    o.state == ObjectState::Live && o.dram.is_some() && ssd_copy_in(facts, *id as u32).is_none()
                })
                .map(|(id, _)| (id as u32, self.index.generation(id as u32)))
                .collect();
            ssd.flush_queue = Some(dirty);
        }
        let rounds = ssd.flush_queue.as_ref().map_or(0, VecDeque::len);
        for _ in 0..rounds {
            // Writes already started finish even past the deadline: start only a few at a time,
            // so the deadline bounds what the flush still does after it.
            if self.flushing_bytes >= FLUSH_BYTES_IN_FLIGHT {
                break;
            }
            let Some((id, generation)) =
                self.ssd.as_mut().and_then(|s| s.flush_queue.as_mut()).and_then(VecDeque::pop_front)
            else {
                break;
            };
            let Some(o) = self.objects.get(id as usize) else { continue };
            if self.index.generation(id) != generation
                || o.state != ObjectState::Live
                || o.dram.is_none()
                || self.has_ssd_copy(id)
            {
                continue;
            }
            let queue = |core: &mut ShardCore, front: bool| {
                if let Some(q) = core.ssd.as_mut().and_then(|s| s.flush_queue.as_mut()) {
                    if front {
                        q.push_front((id, generation));
                    } else {
                        q.push_back((id, generation));
                    }
                }
            };
            if o.io_refs > 0 {
                queue(self, false);
                continue;
            }
            let dram_bytes = o.dram.as_ref().map_or(0, |a| self.allocator.len_of(a));
            match self.start_record_write(id, WritePurpose::Flush) {
                Placement::At(_) => {
                    self.flushing_bytes += dram_bytes;
                    self.policy.remove(id as EntryId);
                    self.counters.shutdown_demotions.fetch_add(1, RELAXED);
                }
                Placement::Full if self.ssd_space_coming() => {
                    queue(self, true);
                    break;
                }
                Placement::Full | Placement::TooLarge => {}
            }
        }
        self.give_up_stalled_flush()
    }

    /// At the end of a clean shutdown: counts the DRAM-only objects it did not write (its
    /// deadline passed, the flush gave up, or `demote_on_shutdown` is off) and their DRAM bytes
    /// in `shutdown_unflushed_objects` / `_bytes`, and returns them. They are absent after
    /// the restart. 0 without an SSD tier (nothing is kept across restarts then).
    pub fn count_unflushed(&mut self) -> (u64, u64) {
        if self.ssd.is_none() {
            return (0, 0);
        }
        let facts = &self.ssd_facts;
        let (mut objects, mut bytes) = (0u64, 0u64);
        for (id, o) in self.objects.iter() {
            if o.state != ObjectState::Live || ssd_copy_in(facts, id as u32).is_some() {
                continue;
            }
            if let Some(a) = o.dram.as_ref() {
                objects += 1;
                bytes += self.allocator.len_of(a);
            }
        }
        self.counters.shutdown_unflushed_objects.store(objects, RELAXED);
        self.counters.shutdown_unflushed_bytes.store(bytes, RELAXED);
        (objects, bytes)
    }

    /// Dirty objects left to flush. When the queue has not got shorter while reclaims turned
    /// the log over twice, room is not coming: a tier too small for the dirty data, whose
    /// reclaims free space only by making other DRAM objects dirty again, would otherwise go
    /// round until the shutdown deadline. The rest are not written (counted and logged): they
    /// are absent after the restart, never an older version (an upsert tombstoned those).
    fn give_up_stalled_flush(&mut self) -> usize {
        let reclaimed = self.counters.segments_reclaimed.load(RELAXED);
        let Some(ssd) = self.ssd.as_mut() else { return 0 };
        let left = ssd.flush_queue.as_ref().map_or(0, VecDeque::len);
        match ssd.flush_best {
            Some((best, _)) if left >= best => {}
            _ => {
                ssd.flush_best = Some((left, reclaimed));
                return left;
            }
        }
        let since = ssd.flush_best.map_or(0, |(_, at)| reclaimed.saturating_sub(at));
        if left == 0 || since < 2 * u64::from(ssd.config.segments) {
            return left;
        }
        let skipped = ssd.flush_queue.as_mut().map_or(0, |q| std::mem::take(q).len());
        tracing::warn!(skipped, "clean shutdown: no SSD room for the remaining dirty objects; they are not kept");
        self.counters.shutdown_flush_skipped.fetch_add(skipped as u64, RELAXED);
        0
    }

    /// A clean shutdown began: reclaims now start only for writes that wait for room.
    pub(super) fn ssd_shutting_down(&mut self) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.tier.set_shutting_down();
        }
    }

    /// Past the shutdown deadline: start no new SSD work (in-flight operations still finish).
    pub(super) fn freeze_ssd(&mut self) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.frozen = true;
            ssd.tier.freeze();
        }
    }

    /// Work a clean shutdown still waits for: queued tombstones and freed segments whose old
    /// header is not yet zeroed.
    pub(super) fn ssd_shutdown_pending(&self) -> bool {
        self.ssd_tombstones_pending() || self.ssd.as_ref().is_some_and(|s| s.tier.segments().has_stale_free())
    }

    /// Tombstones queued or not yet durable, on a tier still taking writes.
    pub(super) fn ssd_tombstones_pending(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| s.tier.tombstones_pending())
    }

    /// Installs a verified load (granting its waiting readers) or reports its failure to them.
    /// True when the object now has its DRAM copy.
    fn finish_load(&mut self, load: FinishedLoad, checked: Result<()>) -> bool {
        let FinishedLoad { id, location, allocation, waiters, landing, early } = load;
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.loads_by_object.remove(&id);
        }
        let object = &mut self.objects[id as usize];
        object.io_refs -= 1;
        // The record was checked: its header says where the value starts (version 1 records
        // have no checksum table).
        let checked = checked.and_then(|()| {
            let allocation = allocation.as_ref().ok_or(Error::Internal("load without a buffer"))?;
            let head = self
                .slice
                .ptr_at(self.allocator.offset_of(allocation), HEADER_BYTES as u64)
                .ok_or(Error::Internal("load buffer outside slice"))?;
            // SAFETY: the header block of the record buffer, filled and checked by the load that
            // just ended; nothing writes it now.
            let head = unsafe { std::slice::from_raw_parts(head.as_ptr(), HEADER_BYTES) };
            let header = record::decode_header(head).map_err(|e| Error::Corrupted(e.to_string()))?;
            u32::try_from(header.value_offset()).map_err(|_| Error::Corrupted("record value offset past 4 GiB".into()))
        });
        match (checked, allocation) {
            (Ok(value_offset), Some(allocation)) => {
                self.counters.ssd_read_bytes.fetch_add(location.record_bytes, RELAXED);
                let promote = self.ssd.as_ref().is_some_and(|s| s.config.promote_on_hit);
                let len = self.index.value_len(id);
                let object = &mut self.objects[id as usize];
                object.dram = Some(allocation);
                object.set_transient(!promote);
                if let Some(facts) = self.ssd_facts.get_mut(id as usize) {
                    facts.value_offset = value_offset;
                }
                self.counters.dram_objects.fetch_add(1, RELAXED);
                if promote {
                    self.counters.promotions.fetch_add(1, RELAXED);
                    self.track_if_resident(id);
                }
                // Early leases are ordinary leases of the object from now on.
                if let Some(landing) = landing {
                    landing.finish(Ok((u64::from(value_offset), len)));
                }
                for (pending, slot) in waiters {
                    let deadline = self.pending_reads.get(pending).and_then(|p| p.deadline);
                    let grant = self.grant_lease(id, deadline);
                    self.resolve_read(pending, slot, grant);
                    self.finish_read_if_done(pending);
                }
                self.after_last_use(id);
                self.retry_waiters();
                true
            }
            (outcome, allocation) => {
                let error = match outcome {
                    Err(e) => e,
                    Ok(_) => Error::Internal("load without a buffer"),
                };
                if let Some(landing) = landing {
                    landing.finish(Err(error.clone()));
                }
                if let Some(allocation) = allocation {
                    self.park_or_free_load_buffer(id, allocation, &early);
                }
                if matches!(error, Error::Corrupted(_)) {
                    self.counters.corrupted.fetch_add(1, RELAXED);
                    // A record that fails its checksum is dropped; its neighbours are unaffected.
                    if self.objects[id as usize].state == ObjectState::Live {
                        self.unlink(id);
                    } else {
                        self.after_last_use(id);
                    }
                } else {
                    self.after_last_use(id);
                }
                for (pending, slot) in waiters {
                    self.resolve_read(pending, slot, Err(error.clone()));
                    self.finish_read_if_done(pending);
                }
                self.retry_waiters();
                false
            }
        }
    }

    /// The buffer of a failed load: freed now, or, while early readers still hold leases on
    /// it (they may be copying bytes that passed their checks), handed to a hidden abandoned
    /// object that their leases move to and whose last release frees it.
    fn park_or_free_load_buffer(&mut self, id: u32, allocation: Allocation, early: &[LeaseId]) {
        let held: Vec<LeaseId> = early
            .iter()
            .copied()
            .filter(|l| self.leases.get(l.slot as usize).is_some_and(|e| e.generation == l.generation))
            .collect();
        if held.is_empty() {
            self.counters.bytes_used.fetch_sub(self.allocator.len_of(&allocation), RELAXED);
            self.allocator.free(allocation);
            return;
        }
        let generation = self.bump_generation();
        let facts = SsdFacts { seq: self.facts(id).seq, ..SsdFacts::default() };
        let mut parked = Object::new(Some(allocation), ObjectState::Abandoned);
        parked.leases = held.len() as u16;
        let (key, len): (Box<[u8]>, u64) = (self.index.key(id).into(), self.index.value_len(id));
        let parked = match self.insert_object(parked, generation, facts, &key, len) {
            Ok(parked) => parked,
            Err(parked) => {
                // Not reachable (the slot of a free record has no readers); the buffer is leaked
                // rather than freed under the early readers.
                debug_assert!(false, "no published slot for a parked load buffer");
                let _leaked = parked.dram;
                return;
            }
        };
        for lease in &held {
            self.leases[lease.slot as usize].object = parked;
        }
        self.objects[id as usize].leases -= held.len() as u16;
    }

    /// Rebuilds the index from the segments on `disk` (highest sequence number per key wins;
    /// tombstones keep keys removed). Call once, before serving.
    pub fn recover(&mut self, disk: &mut dyn DiskIo) -> std::io::Result<RecoveryReport> {
        let Some(ssd) = self.ssd.as_ref() else { return Ok(RecoveryReport::default()) };
        let scans = (0..ssd.tier.segments().count().min(disk.file_count()))
            .map(|segment| scan_segment(disk, segment))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(self.apply_recovery(scans))
    }

    /// Rebuilds the index from segment scans (scan `i` is segment `i`), made by `recover` or by
    /// the caller (the shard loop scans real segment files in parallel).
    pub fn apply_recovery(&mut self, scans: Vec<kvtide_tiers::ssd::SegmentScan>) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        let Some(ssd) = self.ssd.as_mut() else { return report };
        let recovered = ssd.tier.apply_scans(scans);
        report.segments_scanned = recovered.segments_scanned;
        report.records = recovered.records;
        report.superseded = recovered.superseded;
        report.removed_by_tombstone = recovered.removed_by_tombstone;
        report.discarded = recovered.discarded;
        self.next_seq = self.next_seq.max(recovered.max_seq + 1);
        for found in recovered.live {
            let key = found.key;
            let generation = self.bump_generation();
            let location = found.location;
            // Opening refuses segments too large for a packed location, so this always packs. A
            // record discarded here stays counted live in its segment: it must keep shadowing
            // the older versions of its key on disk, which a reclaim of the segment would not.
            let Some(ssd_copy) = PackedLocation::new(location) else {
                report.discarded.push((location.segment, location.offset, "record beyond 2^32 blocks".into()));
                continue;
            };
            let facts = SsdFacts { seq: found.seq, value_offset: 0, copy: Some(ssd_copy) };
            let object = Object::new(None, ObjectState::Live);
            let Ok(id) = self.insert_object(object, generation, facts, &key, found.value_len) else {
                report.discarded.push((location.segment, location.offset, "value of 8 TiB or more".into()));
                continue;
            };
            let hash = self.key_hash(id);
            self.index_insert(id, hash);
            if let Some(ssd) = self.ssd.as_mut() {
                // The tier counted its bytes live already.
                ssd.tier.add_resident(location.segment, owner_token(id, generation));
            }
            report.objects += 1;
            report.bytes += found.value_len;
            self.counters.objects.fetch_add(1, RELAXED);
            self.counters.ssd_objects.fetch_add(1, RELAXED);
            self.counters.ssd_bytes.fetch_add(location.record_bytes, RELAXED);
        }
        self.counters.recovered_objects.store(report.objects, RELAXED);
        self.counters.recovery_discarded.store(report.discarded.len() as u64, RELAXED);
        report
    }
}
