//! The shard's SSD tier: demotion on eviction, write-through, loads on read, group commit,
//! tombstones, segment reclaim and recovery.
//!
//! Sans-I/O like the rest of the core: it queues `DiskOp`s whose buffers are arena memory held
//! by the operation (an object's record image, a segment header or tombstone scratch block) and
//! advances on completions. It never reports a record durable before the `fdatasync` that covers
//! it completed, never hands out bytes whose checksum failed, and never reuses a segment that a
//! read, write or sync can still touch.

use std::collections::{BTreeSet, VecDeque};
use std::ptr::NonNull;

use kvtide_tiers::dram::{Allocation, OffsetAllocator};
use kvtide_tiers::eviction::EntryId;
use kvtide_tiers::ssd::record::{self, RecordKind, BLOCK_BYTES, HEADER_BYTES};
use kvtide_tiers::ssd::{
    scan_segment, AppendError, DiskCompletion, DiskIo, DiskOp, DiskOpKind, SegmentTable, SsdLocation,
};
use slab::Slab;

use super::{Object, ObjectState, ShardCore, RELAXED};
use crate::error::{Error, Result};

/// The oldest segment is compacted (live records copied forward) rather than evicted when less
/// than this share of it is live; fuller segments are evicted whole (their objects leave).
const COMPACT_BELOW_LIVE_PERCENT: u64 = 50;
/// Completed write-back writes per segment between syncs (nothing waits on them; syncing them
/// in groups bounds what a crash loses without an fdatasync per write).
const WRITE_BACK_SYNC_EVERY_WRITES: u32 = 64;
/// Scratch blocks for tombstones (a tombstone with none free is skipped and counted).
const TOMBSTONE_SLOTS: usize = 16;
/// Largest single transfer; longer records continue like short transfers do.
const MAX_IO_BYTES: u64 = 1 << 30;

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
}

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

enum IoKind {
    Header {
        segment: u32,
    },
    Write {
        id: u32,
        location: SsdLocation,
        durable_for: Option<(usize, usize)>,
        compaction: bool,
    },
    Tombstone {
        slot: usize,
        location: SsdLocation,
    },
    Load {
        id: u32,
        location: SsdLocation,
        allocation: Option<Allocation>,
        waiters: Vec<(usize, usize)>,
        compaction: bool,
    },
    Sync {
        segment: u32,
        covers: Vec<u64>,
    },
}

struct Io {
    kind: IoKind,
    file: u32,
    offset: u64,
    ptr: NonNull<u8>,
    total: u64,
    done: u64,
}

/// A write-through commit waiting for its record to become durable.
#[derive(Clone, Copy)]
struct DurableWaiter {
    end: u64,
    pending: usize,
    slot: usize,
    object: u32,
    generation: u32,
}

/// Durability bookkeeping of one segment.
///
/// Recovery scans a segment front to back and stops at the first hole, so a record is durable
/// only when every write before it in the segment is durable too: the durable prefix ends at the
/// first write not yet covered by a completed sync. A failed write or sync breaks the segment at
/// that offset: nothing after it can ever be acknowledged durable.
#[derive(Default)]
struct SegmentExtra {
    /// Objects whose SSD copy is in this segment: (id, generation).
    objects: Vec<(u32, u32)>,
    /// Write-through commits waiting for the durable prefix to pass `end`.
    waiters: Vec<DurableWaiter>,
    /// Start offsets of writes placed here and not yet covered by a completed sync.
    uncovered: BTreeSet<u64>,
    /// Writes completed since the last sync was submitted.
    completed: Vec<u64>,
    broken_at: Option<u64>,
}

impl SegmentExtra {
    fn durable_prefix(&self) -> u64 {
        let first_gap = self.uncovered.first().copied().unwrap_or(u64::MAX);
        first_gap.min(self.broken_at.unwrap_or(u64::MAX))
    }
}

pub(crate) struct SsdState {
    config: SsdConfig,
    segments: SegmentTable,
    extra: Vec<SegmentExtra>,
    ios: Slab<Io>,
    outbox: VecDeque<DiskOp>,
    /// One 4 KiB header block per segment, then the tombstone slots.
    scratch: Allocation,
    tombstone_free: Vec<usize>,
    loading_bytes: u64,
    compaction: Option<Compaction>,
}

/// Compaction of the oldest segment: its live records are copied forward, then it is freed.
struct Compaction {
    segment: u32,
    /// Loads and rewrites still in flight.
    outstanding: u32,
    /// Where the copies went: (segment, end offset). The old segment is freed only once all of
    /// them are durable, so a crash never loses an object that was durable before.
    copies: Vec<(u32, u64)>,
}

impl SsdState {
    /// None when the slice cannot even hold the scratch blocks.
    pub(crate) fn new(config: SsdConfig, allocator: &mut OffsetAllocator) -> Option<SsdState> {
        let blocks = config.segments as u64 + TOMBSTONE_SLOTS as u64;
        let scratch = allocator.allocate(blocks * BLOCK_BYTES)?;
        Some(SsdState {
            segments: SegmentTable::new(config.segments, config.segment_bytes, config.epoch_seed),
            extra: (0..config.segments).map(|_| SegmentExtra::default()).collect(),
            ios: Slab::new(),
            outbox: VecDeque::new(),
            scratch,
            tombstone_free: (0..TOMBSTONE_SLOTS).collect(),
            loading_bytes: 0,
            compaction: None,
            config,
        })
    }

    /// The segment table (tests and debugging).
    #[cfg(test)]
    pub(crate) fn segments(&self) -> &SegmentTable {
        &self.segments
    }

    /// Bytes the tier keeps allocated for itself (scratch blocks).
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.scratch.len()
    }

    pub(crate) fn is_quiet(&self) -> bool {
        self.ios.is_empty() && self.outbox.is_empty()
    }

    fn scratch_offset(&self, block: u64) -> Option<u64> {
        let offset = self.scratch.offset() + block * BLOCK_BYTES;
        (offset + BLOCK_BYTES <= self.scratch.offset() + self.scratch.len()).then_some(offset)
    }
}

impl ShardCore {
    pub(super) fn write_through(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| s.config.write_through)
    }

    /// Disk operations ready to submit.
    pub fn take_disk_ops(&mut self, out: &mut Vec<DiskOp>) {
        if let Some(ssd) = self.ssd.as_mut() {
            out.extend(ssd.outbox.drain(..));
        }
    }

    /// Gives back an operation the disk could not take yet (queue full); it goes first next time.
    pub fn requeue_disk_op(&mut self, op: DiskOp) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.outbox.push_front(op);
        }
    }

    /// Disk operations submitted or queued and not yet completed.
    pub fn disk_ops_in_flight(&self) -> usize {
        self.ssd.as_ref().map_or(0, |s| s.ios.len())
    }

    /// SSD housekeeping between other work: group commit (one `fdatasync` per segment with
    /// completed, unsynced writes) and compaction. Returns true if it queued any I/O.
    pub fn schedule_syncs(&mut self) -> bool {
        let compacted = self.advance_compaction();
        self.queue_syncs(false) || compacted
    }

    /// Syncs every segment with completed writes (clean shutdown: a restart finds everything).
    pub fn sync_everything(&mut self) -> bool {
        self.queue_syncs(true)
    }

    fn queue_syncs(&mut self, all: bool) -> bool {
        let Some(ssd) = self.ssd.as_mut() else { return false };
        // Write-back demotions promise nothing, so they are synced in groups; a sync is due at
        // once when a write-through put waits on it or a segment header is not durable yet
        // (reclaim waits for headers).
        let due: Vec<u32> = ssd
            .segments
            .needing_sync()
            .filter(|&segment| {
                let waiting = !ssd.extra[segment as usize].waiters.is_empty();
                ssd.segments.get(segment).is_some_and(|s| {
                    all || waiting || !s.header_durable || s.unsynced_writes >= WRITE_BACK_SYNC_EVERY_WRITES
                })
            })
            .collect();
        for &segment in &due {
            let covers = std::mem::take(&mut ssd.extra[segment as usize].completed);
            if let Some(s) = ssd.segments.get_mut(segment) {
                s.unsynced_writes = 0;
                s.sync_in_flight = true;
            }
            let io = Io {
                kind: IoKind::Sync { segment, covers },
                file: segment,
                offset: 0,
                ptr: NonNull::dangling(),
                total: 0,
                done: 0,
            };
            let token = ssd.ios.insert(io) as u64;
            ssd.outbox.push_back(DiskOp { token, file: segment, kind: DiskOpKind::Sync });
        }
        !due.is_empty()
    }

    /// Places a record of `record_bytes`, reclaiming the oldest segment if needed. Queues the
    /// segment header write when the record opens a segment.
    fn place_record(&mut self, record_bytes: u64) -> Option<SsdLocation> {
        let append = loop {
            let ssd = self.ssd.as_mut()?;
            match ssd.segments.append(record_bytes) {
                Ok(append) => break append,
                Err(AppendError::TooLarge) => return None,
                Err(AppendError::Full) => {
                    // Evict the oldest segment whole, unless it is being compacted (then this
                    // write has to do without: the caller drops or refuses it).
                    if ssd.compaction.is_some() || !self.reclaim_oldest_segment() {
                        return None;
                    }
                }
            }
        };
        if append.opens_segment {
            let order = self.bump_seq();
            self.write_segment_header(append.location.segment, append.location.epoch, order);
        }
        Some(append.location)
    }

    fn write_segment_header(&mut self, segment: u32, epoch: u64, order: u64) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        ssd.extra[segment as usize] = SegmentExtra::default();
        ssd.extra[segment as usize].uncovered.insert(0);
        let Some(offset) = ssd.scratch_offset(u64::from(segment)) else {
            ssd.extra[segment as usize].broken_at = Some(0);
            return;
        };
        let Some(ptr) = self.slice.ptr_at(offset, BLOCK_BYTES) else {
            ssd.extra[segment as usize].broken_at = Some(0);
            return;
        };
        // SAFETY: this scratch block belongs to `segment` alone and no write of it is in flight
        // (the segment was free until now).
        let block = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), BLOCK_BYTES as usize) };
        if record::encode(block, RecordKind::SegmentHeader, &[], &[], order, epoch).is_err() {
            ssd.extra[segment as usize].broken_at = Some(0);
            return;
        }
        if let Some(s) = ssd.segments.get_mut(segment) {
            s.writes_in_flight += 1;
        }
        let io = Io { kind: IoKind::Header { segment }, file: segment, offset: 0, ptr, total: BLOCK_BYTES, done: 0 };
        let token = ssd.ios.insert(io) as u64;
        ssd.outbox.push_back(write_op(token, segment, ptr, 0, BLOCK_BYTES));
    }

    /// Frees the oldest sealed segment: objects only there leave the shard, objects also in
    /// DRAM lose their SSD copy. False when it cannot be reclaimed yet.
    fn reclaim_oldest_segment(&mut self) -> bool {
        let Some(ssd) = self.ssd.as_mut() else { return false };
        let Some(segment) = ssd.segments.reclaim_candidate() else { return false };
        let residents = std::mem::take(&mut ssd.extra[segment as usize].objects);
        for (id, generation) in residents {
            let Some(object) = self.objects.get_mut(id as usize) else { continue };
            if object.generation != generation || object.ssd.is_none_or(|l| l.segment != segment) {
                continue;
            }
            let location = object.ssd.take();
            self.counters.ssd_objects.fetch_sub(1, RELAXED);
            if let Some(l) = location {
                self.counters.ssd_bytes.fetch_sub(l.record_bytes, RELAXED);
            }
            if object.dram.is_none() && object.state == ObjectState::Live {
                let key = object.key.clone();
                self.index.remove(&key);
                self.counters.objects.fetch_sub(1, RELAXED);
                self.counters.ssd_evictions.fetch_add(1, RELAXED);
                self.free_object(id);
            }
        }
        let Some(ssd) = self.ssd.as_mut() else { return false };
        let reclaimed = ssd.segments.reclaim(segment);
        if reclaimed {
            self.counters.segments_reclaimed.fetch_add(1, RELAXED);
        }
        reclaimed
    }

    /// Starts compacting the oldest segment when at most one segment is free and it is mostly dead, and
    /// frees it once its live records are copied forward and durable. True if it queued I/O.
    fn advance_compaction(&mut self) -> bool {
        let Some(ssd) = self.ssd.as_mut() else { return false };
        if let Some(c) = &ssd.compaction {
            if c.outstanding > 0 {
                return false;
            }
            let durable = c.copies.iter().all(|&(segment, end)| {
                let extra = &ssd.extra[segment as usize];
                // A broken segment will never be durable past its break: stop waiting for it.
                end <= extra.durable_prefix() || extra.broken_at.is_some()
            });
            if !durable || ssd.segments.reclaim_candidate() != Some(c.segment) {
                return false;
            }
            let copied = c.copies.len() as u64;
            ssd.compaction = None;
            if self.reclaim_oldest_segment() {
                self.counters.compactions.fetch_add(1, RELAXED);
                self.counters.compacted_records.fetch_add(copied, RELAXED);
            }
            return false;
        }
        // Start while one segment is still free, so the copies have somewhere to go.
        if ssd.segments.free_count() > 1 {
            return false;
        }
        let Some(segment) = ssd.segments.oldest_sealed() else { return false };
        let Some(seg) = ssd.segments.get(segment) else { return false };
        if seg.live_bytes * 100 >= ssd.segments.segment_bytes() * COMPACT_BELOW_LIVE_PERCENT {
            // Mostly live: evicting it whole (when space is needed) beats rewriting it.
            return false;
        }
        let residents = ssd.extra[segment as usize].objects.clone();
        ssd.compaction = Some(Compaction { segment, outstanding: 0, copies: Vec::new() });
        let mut queued = false;
        for (id, generation) in residents {
            let Some(object) = self.objects.get(id as usize) else { continue };
            let only_here = object.generation == generation
                && object.state == ObjectState::Live
                && object.dram.is_none()
                && object.io_refs == 0
                && object.ssd.is_some_and(|l| l.segment == segment);
            if !only_here {
                // In DRAM too (it just loses its SSD copy) or already gone.
                continue;
            }
            let Some(location) = object.ssd else { continue };
            // No eviction for compaction: what does not fit is evicted with the segment.
            let Some(allocation) = self.allocator.allocate(location.record_bytes) else { continue };
            if !self.submit_load(id, location, allocation, Vec::new(), true) {
                continue;
            }
            if let Some(c) = self.ssd.as_mut().and_then(|s| s.compaction.as_mut()) {
                c.outstanding += 1;
            }
            queued = true;
        }
        queued
    }

    /// One compaction load or rewrite finished; `copy` is where the record went, if it did.
    fn compaction_step_done(&mut self, copy: Option<SsdLocation>) {
        if let Some(c) = self.ssd.as_mut().and_then(|s| s.compaction.as_mut()) {
            c.outstanding = c.outstanding.saturating_sub(1);
            if let Some(l) = copy {
                c.copies.push((l.segment, l.offset + l.record_bytes));
            }
        }
    }

    /// Starts writing a dirty victim's record from its DRAM image. False when the SSD tier is
    /// absent or full; the caller then drops the object.
    pub(super) fn start_demotion(&mut self, id: u32) -> bool {
        let Some(location) = self.start_record_write(id, None, false) else { return false };
        let bytes = self.objects[id as usize].dram.as_ref().map_or(0, Allocation::len);
        self.demoting_bytes += bytes;
        self.counters.demotions.fetch_add(1, RELAXED);
        let _ = location;
        true
    }

    /// Write-through: the commit's result waits for the record to be durable.
    pub(super) fn write_through_record(&mut self, id: u32, pending: usize, slot: usize) {
        if self.start_record_write(id, Some((pending, slot)), false).is_some() {
            self.policy.remove(id as EntryId);
            return;
        }
        // All or nothing: a put that cannot be made durable is not kept.
        self.unlink(id);
        self.resolve_commit(pending, slot, Err(Error::NoSpace));
    }

    /// Seals the record image in the object's DRAM and queues its write.
    fn start_record_write(
        &mut self,
        id: u32,
        durable_for: Option<(usize, usize)>,
        compaction: bool,
    ) -> Option<SsdLocation> {
        let object = &self.objects[id as usize];
        let allocation = object.dram.as_ref()?;
        let (key_len, len, seq, offset) = (object.key.len(), object.len, object.seq, allocation.offset());
        let record_bytes = record::record_bytes(key_len, len);
        let ptr = self.slice.ptr_at(offset, record_bytes)?;
        let location = self.place_record(record_bytes)?;
        // SAFETY: the record image is this object's own DRAM allocation; its value is immutable
        // once committed and nothing else writes the header block. io_refs (below) keeps the
        // allocation alive until the write completes.
        let image = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), record_bytes as usize) };
        if record::seal_in_place(image, RecordKind::Put, key_len, len, seq, location.epoch).is_err() {
            self.abandon_placement(location);
            return None;
        }
        let ssd = self.ssd.as_mut()?;
        if let Some(s) = ssd.segments.get_mut(location.segment) {
            s.writes_in_flight += 1;
        }
        ssd.extra[location.segment as usize].uncovered.insert(location.offset);
        self.objects[id as usize].io_refs += 1;
        let io = Io {
            kind: IoKind::Write { id, location, durable_for, compaction },
            file: location.segment,
            offset: location.offset,
            ptr,
            total: record_bytes,
            done: 0,
        };
        let token = ssd.ios.insert(io) as u64;
        ssd.outbox.push_back(write_op(token, location.segment, ptr, location.offset, record_bytes));
        Some(location)
    }

    /// Records that `key` was removed, so recovery does not bring an older version back.
    pub(super) fn write_tombstone(&mut self, key: &[u8]) {
        let seq = self.bump_seq();
        let record_bytes = record::record_bytes(key.len(), 0);
        let Some(ssd) = self.ssd.as_mut() else { return };
        if record_bytes != BLOCK_BYTES {
            self.counters.tombstones_skipped.fetch_add(1, RELAXED);
            return;
        }
        let Some(slot) = ssd.tombstone_free.pop() else {
            self.counters.tombstones_skipped.fetch_add(1, RELAXED);
            return;
        };
        let block_offset = ssd.scratch_offset(u64::from(ssd.config.segments) + slot as u64);
        let Some(ptr) = block_offset.and_then(|o| self.slice.ptr_at(o, BLOCK_BYTES)) else {
            self.skip_tombstone(slot);
            return;
        };
        let Some(location) = self.place_record(record_bytes) else {
            self.skip_tombstone(slot);
            return;
        };
        // SAFETY: the slot was taken from the free list, so no other write uses this block.
        let block = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), BLOCK_BYTES as usize) };
        if record::encode(block, RecordKind::Tombstone, key, &[], seq, location.epoch).is_err() {
            self.skip_tombstone(slot);
            self.abandon_placement(location);
            return;
        }
        let Some(ssd) = self.ssd.as_mut() else { return };
        if let Some(s) = ssd.segments.get_mut(location.segment) {
            s.writes_in_flight += 1;
        }
        ssd.extra[location.segment as usize].uncovered.insert(location.offset);
        let io = Io {
            kind: IoKind::Tombstone { slot, location },
            file: location.segment,
            offset: location.offset,
            ptr,
            total: BLOCK_BYTES,
            done: 0,
        };
        let token = ssd.ios.insert(io) as u64;
        ssd.outbox.push_back(write_op(token, location.segment, ptr, location.offset, BLOCK_BYTES));
        self.counters.tombstones.fetch_add(1, RELAXED);
    }

    /// An object's SSD copy is gone (object freed).
    pub(super) fn forget_ssd_copy(&mut self, location: &SsdLocation) {
        self.counters.ssd_objects.fetch_sub(1, RELAXED);
        self.counters.ssd_bytes.fetch_sub(location.record_bytes, RELAXED);
        if let Some(s) = self.ssd.as_mut().and_then(|ssd| ssd.segments.get_mut(location.segment)) {
            s.live_bytes = s.live_bytes.saturating_sub(location.record_bytes);
        }
    }

    /// Queues the read of `location` into `allocation` (already taken from the allocator) for
    /// object `id`. False (and the allocation returned) if the buffer is outside the slice.
    fn submit_load(
        &mut self,
        id: u32,
        location: SsdLocation,
        allocation: Allocation,
        waiters: Vec<(usize, usize)>,
        compaction: bool,
    ) -> bool {
        let Some(ptr) = self.slice.ptr_at(allocation.offset(), location.record_bytes) else {
            self.allocator.free(allocation);
            return false;
        };
        let Some(ssd) = self.ssd.as_mut() else {
            self.allocator.free(allocation);
            return false;
        };
        self.counters.bytes_used.fetch_add(allocation.len(), RELAXED);
        if let Some(s) = ssd.segments.get_mut(location.segment) {
            s.readers += 1;
        }
        ssd.loading_bytes += location.record_bytes;
        let io = Io {
            kind: IoKind::Load { id, location, allocation: Some(allocation), waiters, compaction },
            file: location.segment,
            offset: location.offset,
            ptr,
            total: location.record_bytes,
            done: 0,
        };
        let token = ssd.ios.insert(io);
        ssd.outbox.push_back(DiskOp {
            token: token as u64,
            file: location.segment,
            kind: DiskOpKind::Read {
                buf: ptr.as_ptr(),
                len: location.record_bytes.min(MAX_IO_BYTES) as u32,
                offset: location.offset,
            },
        });
        let object = &mut self.objects[id as usize];
        object.loading = Some(token);
        object.io_refs += 1;
        object.transient |= compaction;
        self.counters.loads.fetch_add(1, RELAXED);
        true
    }

    /// Starts or joins the load of an SSD-only object for slot `slot` of a pending read. False
    /// when it must wait for memory or restore budget.
    pub(super) fn load_for_read(&mut self, id: u32, pending: usize, slot: usize) -> bool {
        if let Some(token) = self.objects[id as usize].loading {
            if let Some(Io { kind: IoKind::Load { waiters, .. }, .. }) =
                self.ssd.as_mut().and_then(|s| s.ios.get_mut(token))
            {
                waiters.push((pending, slot));
                return true;
            }
        }
        let Some(location) = self.objects[id as usize].ssd else {
            self.resolve_read(pending, slot, Err(Error::Internal("object in no tier")));
            return true;
        };
        let Some(ssd) = self.ssd.as_ref() else {
            self.resolve_read(pending, slot, Err(Error::Internal("SSD object without an SSD tier")));
            return true;
        };
        if ssd.loading_bytes > 0 && ssd.loading_bytes + location.record_bytes > ssd.config.restore_budget_bytes {
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
        if !self.submit_load(id, location, allocation, vec![(pending, slot)], false) {
            self.resolve_read(pending, slot, Err(Error::Internal("load buffer outside slice")));
            return true;
        }
        true
    }

    /// Advances the operation a completion belongs to. Unknown tokens are ignored.
    pub fn on_disk_completion(&mut self, completion: DiskCompletion) {
        let token = completion.token as usize;
        let Some(ssd) = self.ssd.as_mut() else { return };
        let Some(io) = ssd.ios.get_mut(token) else {
            tracing::warn!(token, "completion for an unknown disk operation");
            return;
        };
        let failed = completion.result < 0;
        if !failed && !matches!(io.kind, IoKind::Sync { .. }) {
            let n = completion.result as u64;
            if n == 0 {
                // EOF or a zero-length transfer: never progress, so treat as an I/O error.
                return self.finish_io(token, Err(Error::Io("short transfer made no progress".into())));
            }
            io.done += n;
            if io.done < io.total {
                // Short read or write: submit the rest.
                self.counters.short_io.fetch_add(1, RELAXED);
                let rest = (io.total - io.done).min(MAX_IO_BYTES);
                // SAFETY: done < total, so the pointer stays inside the operation's buffer.
                let ptr = unsafe { io.ptr.as_ptr().add(io.done as usize) };
                let offset = io.offset + io.done;
                let kind = match io.kind {
                    IoKind::Load { .. } => DiskOpKind::Read { buf: ptr, len: rest as u32, offset },
                    _ => DiskOpKind::Write { buf: ptr.cast_const(), len: rest as u32, offset },
                };
                let file = io.file;
                ssd.outbox.push_back(DiskOp { token: token as u64, file, kind });
                return;
            }
        }
        let result = if failed {
            self.counters.io_errors.fetch_add(1, RELAXED);
            Err(Error::Io(format!(
                "disk operation failed: {}",
                std::io::Error::from_raw_os_error(-completion.result as i32)
            )))
        } else {
            Ok(())
        };
        self.finish_io(token, result);
    }

    fn finish_io(&mut self, token: usize, result: Result<()>) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let io = ssd.ios.remove(token);
        match io.kind {
            IoKind::Header { segment } => self.finish_segment_write(segment, 0, result.is_ok()),
            IoKind::Tombstone { slot, location } => {
                ssd.tombstone_free.push(slot);
                self.finish_segment_write(location.segment, location.offset, result.is_ok());
            }
            IoKind::Write { id, location, durable_for, compaction } => {
                if let Some(s) = ssd.segments.get_mut(location.segment) {
                    if result.is_ok() {
                        s.live_bytes += location.record_bytes;
                    }
                }
                self.finish_segment_write(location.segment, location.offset, result.is_ok());
                self.counters
                    .ssd_write_bytes
                    .fetch_add(if result.is_ok() { location.record_bytes } else { 0 }, RELAXED);
                if compaction {
                    self.compaction_step_done(result.is_ok().then_some(location));
                }
                self.finish_record_write(id, location, durable_for, result);
            }
            IoKind::Load { id, location, allocation, waiters, compaction } => {
                if let Some(s) = ssd.segments.get_mut(location.segment) {
                    s.readers -= 1;
                }
                ssd.loading_bytes -= location.record_bytes;
                let checked = self.verify_loaded(id, &location, io.ptr, result);
                let loaded = self.finish_load(id, location, allocation, waiters, checked, compaction);
                if compaction {
                    // Copy forward what was loaded; its DRAM copy goes when the write completes.
                    let copied = loaded && self.start_record_write(id, None, true).is_some();
                    if copied {
                        let bytes = self.objects[id as usize].dram.as_ref().map_or(0, Allocation::len);
                        self.demoting_bytes += bytes;
                    } else {
                        if loaded {
                            self.after_last_use(id);
                        }
                        self.compaction_step_done(None);
                    }
                }
            }
            IoKind::Sync { segment, covers } => {
                if let Some(s) = ssd.segments.get_mut(segment) {
                    s.sync_in_flight = false;
                }
                self.counters.syncs.fetch_add(1, RELAXED);
                let extra = &mut ssd.extra[segment as usize];
                if result.is_ok() {
                    for offset in &covers {
                        extra.uncovered.remove(offset);
                    }
                } else if let Some(&first) = covers.iter().min() {
                    // After a failed fdatasync the kernel may have dropped those pages: treat
                    // the segment as broken from the first write the sync was meant to cover.
                    extra.broken_at = Some(extra.broken_at.map_or(first, |b| b.min(first)));
                }
                self.advance_durability(segment);
            }
        }
    }

    /// A tombstone that is not written after all: its scratch slot goes back, and it is counted.
    fn skip_tombstone(&mut self, slot: usize) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.tombstone_free.push(slot);
        }
        self.counters.tombstones_skipped.fetch_add(1, RELAXED);
    }

    /// A placed record that will never be written: a hole in its segment, handled as a failed
    /// write (recovery stops at a hole, so nothing after it may be acknowledged as durable).
    fn abandon_placement(&mut self, location: SsdLocation) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        if let Some(s) = ssd.segments.get_mut(location.segment) {
            s.writes_in_flight += 1;
        }
        self.finish_segment_write(location.segment, location.offset, false);
    }

    /// Bookkeeping for a completed (or failed) write at `offset` of `segment`.
    fn finish_segment_write(&mut self, segment: u32, offset: u64, ok: bool) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let open =
            ssd.segments.get(segment).is_some_and(|s| s.state == kvtide_tiers::ssd::segments::SegmentState::Open);
        if let Some(s) = ssd.segments.get_mut(segment) {
            s.writes_in_flight -= 1;
            if ok {
                s.unsynced_writes += 1;
            }
        }
        let extra = &mut ssd.extra[segment as usize];
        if ok {
            extra.completed.push(offset);
            return;
        }
        extra.broken_at = Some(extra.broken_at.map_or(offset, |b| b.min(offset)));
        if open {
            // Nothing appended after a hole could be recovered: move on to a new segment.
            ssd.segments.seal_open();
        }
        self.advance_durability(segment);
    }

    /// Acknowledges the write-through commits the durable prefix now covers, and fails those
    /// that a broken segment can never cover.
    fn advance_durability(&mut self, segment: u32) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let extra = &mut ssd.extra[segment as usize];
        let prefix = extra.durable_prefix();
        let header_durable = !extra.uncovered.contains(&0) && extra.broken_at != Some(0);
        let broken_at = extra.broken_at;
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut extra.waiters).into_iter().partition(|w| w.end <= prefix);
        let (failed, waiting): (Vec<_>, Vec<_>) =
            waiting.into_iter().partition(|w| broken_at.is_some_and(|b| w.end > b));
        extra.waiters = waiting;
        if header_durable {
            if let Some(s) = ssd.segments.get_mut(segment) {
                s.header_durable = true;
            }
        }
        let mut touched = Vec::new();
        for w in ready {
            self.resolve_commit(w.pending, w.slot, Ok(()));
            touched.push(w.pending);
        }
        for w in failed {
            // All or nothing: a put that cannot be made durable is not kept.
            let live = self
                .objects
                .get(w.object as usize)
                .is_some_and(|o| o.generation == w.generation && o.state == ObjectState::Live);
            if live {
                self.unlink(w.object);
            }
            self.resolve_commit(
                w.pending,
                w.slot,
                Err(Error::Io("the SSD write or sync before this record failed".into())),
            );
            touched.push(w.pending);
        }
        touched.sort_unstable();
        touched.dedup();
        for pending in touched {
            self.finish_commit_if_done(pending);
        }
    }

    fn finish_record_write(
        &mut self,
        id: u32,
        location: SsdLocation,
        durable_for: Option<(usize, usize)>,
        result: Result<()>,
    ) {
        let dram_bytes = self.objects[id as usize].dram.as_ref().map_or(0, Allocation::len);
        if durable_for.is_none() {
            self.demoting_bytes -= dram_bytes;
        }
        let object = &mut self.objects[id as usize];
        object.io_refs -= 1;
        match result {
            Ok(()) => {
                let previous = object.ssd.replace(location);
                let generation = object.generation;
                if let Some(previous) = previous {
                    // A compaction copy replaces the record in the segment being freed.
                    self.forget_ssd_copy(&previous);
                }
                self.counters.ssd_objects.fetch_add(1, RELAXED);
                self.counters.ssd_bytes.fetch_add(location.record_bytes, RELAXED);
                if let Some(ssd) = self.ssd.as_mut() {
                    let extra = &mut ssd.extra[location.segment as usize];
                    extra.objects.push((id, generation));
                    if let Some((pending, slot)) = durable_for {
                        let end = location.offset + location.record_bytes;
                        extra.waiters.push(DurableWaiter { end, pending, slot, object: id, generation });
                    }
                }
                if durable_for.is_some() {
                    // Usually not yet durable; a sync that already covers it will say so.
                    self.advance_durability(location.segment);
                }
            }
            Err(e) => {
                if let Some((pending, slot)) = durable_for {
                    if self.objects[id as usize].state == ObjectState::Live {
                        self.unlink(id);
                    }
                    self.resolve_commit(pending, slot, Err(e));
                    self.finish_commit_if_done(pending);
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
        } else if durable_for.is_none() && object.ssd.is_some() && object.leases == 0 && object.pins == 0 {
            // A finished demotion: the DRAM copy goes (the policy no longer tracks it).
            let object = &mut self.objects[id as usize];
            object.transient = false;
            if let Some(allocation) = object.dram.take() {
                self.counters.bytes_used.fetch_sub(allocation.len(), RELAXED);
                self.counters.dram_objects.fetch_sub(1, RELAXED);
                self.counters.evictions.fetch_add(1, RELAXED);
                self.allocator.free(allocation);
            }
        } else if durable_for.is_none() && object.ssd.is_none() && object.leases == 0 && object.pins == 0 {
            // The demotion failed: drop the object rather than keep memory others wait for.
            let key = object.key.clone();
            self.index.remove(&key);
            self.counters.objects.fetch_sub(1, RELAXED);
            self.counters.evictions.fetch_add(1, RELAXED);
            self.free_object(id);
        } else {
            self.track_if_resident(id);
        }
        self.retry_waiters();
    }

    /// Checks a loaded record image: checksums, epoch, and that it is this object's version.
    fn verify_loaded(&self, id: u32, location: &SsdLocation, ptr: NonNull<u8>, result: Result<()>) -> Result<()> {
        result?;
        // SAFETY: the load wrote `record_bytes` bytes into this buffer, which the operation
        // owned until now and which nothing else references.
        let image = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), location.record_bytes as usize) };
        let header = record::verify(image, Some(location.epoch)).map_err(|e| Error::Corrupted(e.to_string()))?;
        let object = &self.objects[id as usize];
        let matches = header.kind == RecordKind::Put
            && header.seq == object.seq
            && header.value_len == object.len
            && record::key_of(image, &header) == &object.key[..];
        if matches {
            Ok(())
        } else {
            Err(Error::Corrupted("record does not belong to this key".into()))
        }
    }

    /// Installs a verified load (granting its waiting readers) or reports its failure to them.
    /// True when the object now has its DRAM copy.
    fn finish_load(
        &mut self,
        id: u32,
        location: SsdLocation,
        allocation: Option<Allocation>,
        waiters: Vec<(usize, usize)>,
        checked: Result<()>,
        compaction: bool,
    ) -> bool {
        let object = &mut self.objects[id as usize];
        object.loading = None;
        object.io_refs -= 1;
        match (checked, allocation) {
            (Ok(()), Some(allocation)) => {
                self.counters.ssd_read_bytes.fetch_add(location.record_bytes, RELAXED);
                // A compaction load is not a hit: its DRAM copy only lives until it is rewritten.
                let promote = !compaction && self.ssd.as_ref().is_some_and(|s| s.config.promote_on_hit);
                let object = &mut self.objects[id as usize];
                object.dram = Some(allocation);
                object.value_offset = (HEADER_BYTES + object.key.len()) as u64;
                object.transient = !promote;
                self.counters.dram_objects.fetch_add(1, RELAXED);
                if promote {
                    self.counters.promotions.fetch_add(1, RELAXED);
                    self.track_if_resident(id);
                }
                for (pending, slot) in waiters {
                    let deadline = self.pending_reads.get(pending).and_then(|p| p.deadline);
                    let grant = self.grant_lease(id, deadline);
                    self.resolve_read(pending, slot, grant);
                    self.finish_read_if_done(pending);
                }
                if !compaction {
                    self.after_last_use(id);
                }
                self.retry_waiters();
                true
            }
            (outcome, allocation) => {
                if let Some(allocation) = allocation {
                    self.counters.bytes_used.fetch_sub(allocation.len(), RELAXED);
                    self.allocator.free(allocation);
                }
                let error = match outcome {
                    Err(e) => e,
                    Ok(()) => Error::Internal("load without a buffer"),
                };
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

    /// Rebuilds the index from the segments on `disk` (highest sequence number per key wins;
    /// tombstones keep keys removed). Call once, before serving.
    pub fn recover(&mut self, disk: &mut dyn DiskIo) -> std::io::Result<RecoveryReport> {
        let Some(ssd) = self.ssd.as_ref() else { return Ok(RecoveryReport::default()) };
        let scans = (0..ssd.segments.count().min(disk.file_count()))
            .map(|segment| scan_segment(disk, segment))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(self.apply_recovery(scans))
    }

    /// Rebuilds the index from segment scans (scan `i` is segment `i`), made by `recover` or by
    /// the caller (the shard loop scans real segment files in parallel).
    pub fn apply_recovery(&mut self, scans: Vec<kvtide_tiers::ssd::SegmentScan>) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        let Some(ssd) = self.ssd.as_mut() else { return report };
        let mut winners: std::collections::HashMap<Vec<u8>, kvtide_tiers::ssd::FoundRecord> =
            std::collections::HashMap::new();
        let mut restored = Vec::new();
        let mut max_seq = 0;
        for (segment, scan) in (0..ssd.segments.count()).zip(scans) {
            report.segments_scanned += 1;
            report.discarded.extend(scan.discarded.iter().map(|d| (d.segment, d.offset, d.reason.clone())));
            let Some(epoch) = scan.epoch else { continue };
            max_seq = max_seq.max(scan.header_seq);
            restored.push((segment, epoch, scan.header_seq, scan.valid_end));
            for found in scan.records {
                report.records += 1;
                max_seq = max_seq.max(found.seq);
                match winners.get(&found.key) {
                    Some(current) if current.seq >= found.seq => report.superseded += 1,
                    Some(_) => {
                        report.superseded += 1;
                        winners.insert(found.key.clone(), found);
                    }
                    None => {
                        winners.insert(found.key.clone(), found);
                    }
                }
            }
        }
        ssd.segments.restore(restored);
        self.next_seq = self.next_seq.max(max_seq + 1);
        for (key, found) in winners {
            if found.kind == RecordKind::Tombstone {
                report.removed_by_tombstone += 1;
                continue;
            }
            let generation = self.bump_generation();
            let location = found.location;
            let id = self.objects.insert(Object {
                key_hash: xxhash_rust::xxh3::xxh3_64(&key),
                key: key.clone().into_boxed_slice(),
                generation,
                seq: found.seq,
                dram: None,
                value_offset: 0,
                ssd: Some(location),
                len: found.value_len,
                leases: 0,
                pins: 0,
                io_refs: 0,
                transient: false,
                loading: None,
                state: ObjectState::Live,
            }) as u32;
            self.index.insert(key.into_boxed_slice(), id);
            if let Some(ssd) = self.ssd.as_mut() {
                ssd.extra[location.segment as usize].objects.push((id, generation));
                if let Some(s) = ssd.segments.get_mut(location.segment) {
                    s.live_bytes += location.record_bytes;
                }
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

fn write_op(token: u64, file: u32, ptr: NonNull<u8>, offset: u64, len: u64) -> DiskOp {
    let len = len.min(MAX_IO_BYTES) as u32;
    DiskOp { token, file, kind: DiskOpKind::Write { buf: ptr.as_ptr().cast_const(), len, offset } }
}
