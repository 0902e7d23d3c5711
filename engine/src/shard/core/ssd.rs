//! The shard's SSD tier: demotion on eviction, write-through, loads on read, group commit,
//! tombstones, segment reclaim (records copied forward) and recovery.
//!
//! Sans-I/O like the rest of the core: it queues `DiskOp`s whose buffers are arena memory held
//! by the operation (an object's record image, a segment header, tombstone or zero block, or the
//! relocation staging buffer) and advances on completions. It never reports a record durable
//! before the `fdatasync` that covers it completed, never hands out bytes whose checksum failed,
//! never reuses a segment that a read, write or sync can still touch, never frees a segment
//! whose live records are not durable elsewhere, and never drops a tombstone silently.

use std::collections::{BTreeSet, VecDeque};
use std::ptr::NonNull;

use kvtide_tiers::dram::{Allocation, OffsetAllocator};
use kvtide_tiers::eviction::EntryId;
use kvtide_tiers::ssd::record::{self, RecordHeader, RecordKind, BLOCK_BYTES, HEADER_BYTES};
use kvtide_tiers::ssd::segments::SegmentState;
use kvtide_tiers::ssd::{
    scan_segment, AppendError, DiskCompletion, DiskIo, DiskOp, DiskOpKind, SegmentTable, SsdLocation,
};
use slab::Slab;

use super::{Object, ObjectState, ShardCore, RELAXED};
use crate::error::{Error, Result};

/// A reclaim starts ahead of demand when this many free segments (or fewer) are left and the
/// oldest segment is at least `EAGER_RECLAIM_DEAD_PERCENT` dead space; it starts on demand when
/// a write found no room. The last free segment is kept for relocation copies.
const RECLAIM_AT_FREE_SEGMENTS: usize = 2;
const EAGER_RECLAIM_DEAD_PERCENT: u64 = 25;
/// A reclaim that frees less than this share of a segment (net of its copies) gained nothing.
const FRUITLESS_GAIN_PERCENT: u64 = 10;
/// While the tier holds at most this share of live bytes, a reclaimed segment's live records are
/// all copied forward (a mostly dead tier never evicts); above it, its cold records (SSD only,
/// not pinned) leave the cache, oldest first.
const COPY_FORWARD_UP_TO_LIVE_PERCENT: u64 = 80;
/// Completed write-back writes per segment between syncs (nothing waits on them; syncing them
/// in groups bounds what a crash loses without an fdatasync per write).
const WRITE_BACK_SYNC_EVERY_WRITES: u32 = 64;
/// Scratch blocks for one-block tombstones (longer keys borrow DRAM for theirs).
const TOMBSTONE_SLOTS: usize = 32;
/// Tombstones queued and not yet written, by default; a remove past this gets `Busy` (nothing
/// is dropped).
pub const DEFAULT_MAX_PENDING_TOMBSTONES: usize = 1 << 16;
/// Attempts to write one tombstone or segment header before giving up (a disk failing every
/// write).
const WRITE_TRIES: u8 = 4;
/// Relocation failures in one reclaim after which the rest of its records leave the cache
/// instead (a failing disk must not keep a reclaim going forever).
const MAX_RELOCATION_FAILURES: u32 = 8;
/// Largest single transfer; longer records continue like short transfers do.
const MAX_IO_BYTES: u64 = 1 << 30;
/// Bounds of the relocation staging buffer (records are copied segment to segment through it,
/// in chunks, so a full DRAM never stops a reclaim).
const MIN_STAGING_BYTES: u64 = 16 * BLOCK_BYTES;
const MAX_STAGING_BYTES: u64 = 1 << 20;

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

/// Where a tombstone's block lives while it is written.
enum TombstoneBuffer {
    Slot(usize),
    Borrowed(Allocation),
}

enum IoKind {
    Header {
        segment: u32,
    },
    Write {
        id: u32,
        location: SsdLocation,
        purpose: WritePurpose,
    },
    Tombstone {
        buffer: TombstoneBuffer,
        location: SsdLocation,
        pending: PendingTombstone,
    },
    Load {
        id: u32,
        location: SsdLocation,
        allocation: Option<Allocation>,
        waiters: Vec<(usize, usize)>,
    },
    Sync {
        segment: u32,
        covers: Vec<u64>,
    },
    /// Zeroes a freed segment's header block, so recovery never scans its old records.
    Invalidate {
        segment: u32,
    },
    InvalidateSync {
        segment: u32,
    },
    /// One chunk of an SSD-only record being copied forward through the staging buffer.
    CopyRead {
        len: u64,
    },
    CopyWrite {
        len: u64,
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

/// A write-through commit waiting for SSD space (a reclaim is freeing a segment). The object is
/// held (`io_refs`) meanwhile so nothing evicts or frees it.
struct SpaceWaiter {
    object: u32,
    generation: u32,
    pending: usize,
    slot: usize,
}

/// A removed or superseded key whose tombstone is not written yet. Its sequence number was taken
/// when the remove happened, so a later put of the key still wins.
struct PendingTombstone {
    key: Box<[u8]>,
    seq: u64,
    tries: u8,
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
    /// The segment header's write completed (durable once a sync covers offset 0).
    header_written: bool,
    /// Times the header was written again after a failed write or sync.
    header_tries: u8,
    /// Tombstones written here and not yet durable, by end offset. A break before one sends
    /// it back to the queue: a remove is done only when its tombstone is durable.
    tombstones: Vec<(u64, PendingTombstone)>,
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
    /// One 4 KiB header block per segment, a zero block, the tombstone slots, then the
    /// relocation staging buffer.
    scratch: Allocation,
    staging_bytes: u64,
    tombstone_free: Vec<usize>,
    tombstones: VecDeque<PendingTombstone>,
    /// DRAM borrowed from the allocator for tombstones of keys longer than one block.
    borrowed_bytes: u64,
    space_waiters: VecDeque<SpaceWaiter>,
    loading_bytes: u64,
    reclaim: Option<Reclaim>,
    /// Dirty objects a clean shutdown still has to write.
    flush_queue: Option<VecDeque<(u32, u32)>>,
    /// A clean shutdown ran out of time: nothing new starts.
    frozen: bool,
    /// A segment header could not be written: the tier takes no more writes.
    failed: bool,
    /// A write found no room since the last reclaim started.
    space_wanted: bool,
    /// A clean shutdown is flushing: reclaims start only for writes that wait.
    shutting_down: bool,
    /// Reclaims in a row that gained less than `FRUITLESS_GAIN_PERCENT` of a segment (their
    /// records were nearly all live). After a whole turn of the log of them, copying forward is
    /// not making room.
    fruitless_reclaims: u32,
}

/// Freeing the oldest segment: its live records are copied forward (or, in a tier that is
/// mostly live, its cold ones leave the cache), and it is freed once the copies are durable.
struct Reclaim {
    segment: u32,
    /// Copy SSD-only records forward too (else they leave the cache).
    copy_cold: bool,
    /// DRAM-resident record rewrites in flight.
    writes: u32,
    /// SSD-only records waiting for the staging buffer, and the one being copied.
    queue: VecDeque<(u32, u32)>,
    copy: Option<CopyJob>,
    /// The copies made. The old segment is freed only once all of them are durable, so a crash
    /// never loses an object that was durable before; a copy its segment's break made
    /// undurable is undone (the object points at its old record again) and made anew.
    copies: Vec<Copied>,
    failures: u32,
}

/// A record copied forward by a reclaim.
#[derive(Clone, Copy, Debug)]
struct Copied {
    id: u32,
    generation: u32,
    src: SsdLocation,
    dst: SsdLocation,
}

impl Copied {
    fn end(&self) -> u64 {
        self.dst.offset + self.dst.record_bytes
    }
}

/// An SSD-only record moving from `src` to `dst` through the staging buffer, chunk by chunk.
/// The destination is placed only after the first chunk's header checked out, so a rotten
/// source never writes a bad header into a segment (which would end its scan there).
struct CopyJob {
    id: u32,
    generation: u32,
    src: SsdLocation,
    dst: Option<SsdLocation>,
    header: Option<RecordHeader>,
    /// Bytes of the record written to `dst` so far.
    copied: u64,
    body_crc: crc32fast::Hasher,
    key_matches: bool,
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
    record.saturating_sub((HEADER_BYTES + max_key_bytes) as u64).max(1)
}

impl SsdState {
    /// None when the slice cannot even hold the scratch blocks.
    pub(crate) fn new(config: SsdConfig, allocator: &mut OffsetAllocator) -> Option<SsdState> {
        let staging_bytes = staging_bytes_for(allocator.capacity_bytes());
        let scratch = allocator.allocate(scratch_bytes_for(config.segments, allocator.capacity_bytes()))?;
        Some(SsdState {
            segments: SegmentTable::new(config.segments, config.segment_bytes, config.epoch_seed),
            extra: (0..config.segments).map(|_| SegmentExtra::default()).collect(),
            ios: Slab::new(),
            outbox: VecDeque::new(),
            scratch,
            staging_bytes,
            tombstone_free: (0..TOMBSTONE_SLOTS).collect(),
            tombstones: VecDeque::new(),
            borrowed_bytes: 0,
            space_waiters: VecDeque::new(),
            loading_bytes: 0,
            reclaim: None,
            flush_queue: None,
            frozen: false,
            failed: false,
            space_wanted: false,
            shutting_down: false,
            fruitless_reclaims: 0,
            config,
        })
    }

    /// The segment table (tests and debugging).
    #[cfg(test)]
    pub(crate) fn segments(&self) -> &SegmentTable {
        &self.segments
    }

    /// A one-line summary of the tier's moving parts (test failure messages).
    #[cfg(test)]
    pub(crate) fn describe(&self) -> String {
        let segs: Vec<String> = (0..self.segments.count())
            .filter_map(|i| self.segments.get(i).map(|s| (i, s)))
            .map(|(i, s)| {
                format!(
                    "{i}:{:?} off {} live {} r{} w{} s{} hd{} stale{}",
                    s.state,
                    s.write_offset,
                    s.live_bytes,
                    s.readers,
                    s.writes_in_flight,
                    s.sync_in_flight as u8,
                    s.header_durable as u8,
                    s.stale_header as u8
                )
            })
            .collect();
        let reclaim = self.reclaim.as_ref().map(|r| {
            format!(
                "seg {} cold {} writes {} queue {} copy {} copies {} failures {}",
                r.segment,
                r.copy_cold,
                r.writes,
                r.queue.len(),
                r.copy.is_some(),
                r.copies.len(),
                r.failures
            )
        });
        format!(
            "segments [{}]; reclaim {reclaim:?}; ios {}; tombstones {}; space waiters {}",
            segs.join(", "),
            self.ios.len(),
            self.tombstones.len(),
            self.space_waiters.len()
        )
    }

    /// Bytes the tier keeps allocated for itself (scratch blocks, staging, borrowed tombstones).
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.scratch.len() + self.borrowed_bytes
    }

    pub(crate) fn is_quiet(&self) -> bool {
        self.ios.is_empty() && self.outbox.is_empty()
    }

    /// Queues the write of a placed record (its whole image at `ptr`) and counts it against its
    /// segment: in flight, and uncovered until a sync covers it.
    fn queue_placed_write(&mut self, kind: IoKind, location: SsdLocation, ptr: NonNull<u8>) {
        if let Some(s) = self.segments.get_mut(location.segment) {
            s.writes_in_flight += 1;
        }
        self.extra[location.segment as usize].uncovered.insert(location.offset);
        let (file, offset, len) = (location.segment, location.offset, location.record_bytes);
        let io = Io { kind, file, offset, ptr, total: len, done: 0 };
        let token = self.ios.insert(io) as u64;
        self.outbox.push_back(write_op(token, file, ptr, offset, len));
    }

    /// Queues the write of one block at offset 0 of `segment` (its header, or zeroes).
    fn queue_block0_write(&mut self, kind: IoKind, segment: u32, ptr: NonNull<u8>) {
        if let Some(s) = self.segments.get_mut(segment) {
            s.writes_in_flight += 1;
        }
        let io = Io { kind, file: segment, offset: 0, ptr, total: BLOCK_BYTES, done: 0 };
        let token = self.ios.insert(io) as u64;
        self.outbox.push_back(write_op(token, segment, ptr, 0, BLOCK_BYTES));
    }

    /// Queues an `fdatasync` of `segment`; nothing reuses the segment until it completes.
    fn queue_sync(&mut self, kind: IoKind, segment: u32) {
        if let Some(s) = self.segments.get_mut(segment) {
            s.sync_in_flight = true;
        }
        let io = Io { kind, file: segment, offset: 0, ptr: NonNull::dangling(), total: 0, done: 0 };
        let token = self.ios.insert(io) as u64;
        self.outbox.push_back(DiskOp { token, file: segment, kind: DiskOpKind::Sync });
    }

    fn scratch_offset(&self, block: u64) -> Option<u64> {
        let offset = self.scratch.offset() + block * BLOCK_BYTES;
        (offset + BLOCK_BYTES <= self.scratch.offset() + self.scratch.len()).then_some(offset)
    }

    fn zero_block_offset(&self) -> Option<u64> {
        self.scratch_offset(u64::from(self.config.segments))
    }

    fn tombstone_slot_offset(&self, slot: usize) -> Option<u64> {
        self.scratch_offset(u64::from(self.config.segments) + 1 + slot as u64)
    }

    fn staging_offset(&self) -> u64 {
        self.scratch.offset() + (u64::from(self.config.segments) + 1 + TOMBSTONE_SLOTS as u64) * BLOCK_BYTES
    }

    /// A free segment exists that an append cannot open yet (its old header is being zeroed).
    fn room_coming(&self) -> bool {
        self.segments.free_count() > self.segments.usable_free_count()
    }

    /// A reclaim is running or can start, so a write that found no room can wait for one.
    fn space_coming(&self) -> bool {
        !self.failed && (self.reclaim.is_some() || self.segments.oldest_sealed().is_some())
    }
}

/// Where `place_record` put a record, or why it could not.
enum Placement {
    At(SsdLocation),
    /// Larger than a segment can hold.
    TooLarge,
    /// No room until a reclaim frees a segment.
    Full,
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

    /// SSD housekeeping between other work: segment reclaim, queued tombstones, writes waiting
    /// for space, zeroing freed segments' headers and group commit (one `fdatasync` per segment
    /// with completed, unsynced writes). Returns true if it queued any I/O.
    pub fn schedule_syncs(&mut self) -> bool {
        let Some(ssd) = self.ssd.as_ref() else { return false };
        if ssd.frozen {
            return self.queue_syncs(false);
        }
        let before = self.ssd.as_ref().map_or(0, |s| s.outbox.len());
        self.advance_reclaim();
        self.retry_space_waiters();
        self.pump_tombstones();
        self.invalidate_stale_headers();
        let synced = self.queue_syncs(false);
        synced || self.ssd.as_ref().map_or(0, |s| s.outbox.len()) > before
    }

    /// Syncs every segment with completed writes (clean shutdown: a restart finds everything).
    pub fn sync_everything(&mut self) -> bool {
        self.queue_syncs(true)
    }

    fn queue_syncs(&mut self, all: bool) -> bool {
        let Some(ssd) = self.ssd.as_mut() else { return false };
        // Write-back demotions promise nothing, so they are synced in groups; a sync is due at
        // once when a write-through put waits on it, a segment header is not durable yet
        // (reclaim waits for headers) or a reclaim waits for its copies.
        let reclaim_waits: Vec<u32> = ssd
            .reclaim
            .as_ref()
            .filter(|r| r.writes == 0 && r.copy.is_none() && r.queue.is_empty())
            .map(|r| r.copies.iter().map(|c| c.dst.segment).collect())
            .unwrap_or_default();
        let due: Vec<u32> = ssd
            .segments
            .needing_sync()
            .filter(|&segment| {
                let extra = &ssd.extra[segment as usize];
                let waiting =
                    !extra.waiters.is_empty() || !extra.tombstones.is_empty() || reclaim_waits.contains(&segment);
                ssd.segments.get(segment).is_some_and(|s| {
                    all || waiting || !s.header_durable || s.unsynced_writes >= WRITE_BACK_SYNC_EVERY_WRITES
                })
            })
            .collect();
        for &segment in &due {
            let covers = std::mem::take(&mut ssd.extra[segment as usize].completed);
            if let Some(s) = ssd.segments.get_mut(segment) {
                s.unsynced_writes = 0;
            }
            ssd.queue_sync(IoKind::Sync { segment, covers }, segment);
        }
        !due.is_empty()
    }

    /// Places a record of `record_bytes`. Only relocation copies may open the last free
    /// segment, so a reclaim always has room to finish. Queues the segment header write when
    /// the record opens a segment.
    fn place_record(&mut self, record_bytes: u64, relocation: bool) -> Placement {
        let Some(ssd) = self.ssd.as_mut() else { return Placement::TooLarge };
        if ssd.failed {
            return Placement::Full;
        }
        if let Some(r) = ssd.reclaim.as_ref().filter(|_| !relocation) {
            // Once the spare segment is taken, the open segment's room belongs to the reclaim's
            // copies first: a write may take only what they will not need.
            let still_to_copy = ssd.segments.get(r.segment).map_or(0, |s| s.live_bytes);
            let room = ssd.segments.open_room();
            if ssd.segments.usable_free_count() == 0 && room.saturating_sub(record_bytes) < still_to_copy {
                ssd.space_wanted = true;
                return Placement::Full;
            }
        }
        let append = match ssd.segments.append(record_bytes, relocation) {
            Ok(append) => append,
            Err(AppendError::TooLarge) => return Placement::TooLarge,
            Err(AppendError::Full) => {
                ssd.space_wanted = true;
                return Placement::Full;
            }
        };
        if append.opens_segment {
            let order = self.bump_seq();
            self.write_segment_header(append.location.segment, append.location.epoch, order);
        }
        Placement::At(append.location)
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
        // (the segment was free and quiescent until now).
        let block = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), BLOCK_BYTES as usize) };
        if record::encode(block, RecordKind::SegmentHeader, &[], &[], order, epoch).is_err() {
            ssd.extra[segment as usize].broken_at = Some(0);
            return;
        }
        ssd.queue_block0_write(IoKind::Header { segment }, segment, ptr);
    }

    // ---- reclaim --------------------------------------------------------------------------

    /// Starts or advances the reclaim of the oldest segment. Every live record in it is copied
    /// forward first: DRAM-resident ones are rewritten from their DRAM image, SSD-only ones are
    /// copied through the staging buffer. Only when the tier is mostly live do its cold records
    /// leave the cache instead (and then a write-through object leaves DRAM too: an object that
    /// is served must be durable). The segment is freed once nothing is left in it and the
    /// copies are durable.
    fn advance_reclaim(&mut self) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        if ssd.reclaim.is_none() {
            let free = ssd.segments.usable_free_count();
            if free > RECLAIM_AT_FREE_SEGMENTS {
                return;
            }
            let Some(segment) = ssd.segments.oldest_sealed() else { return };
            let dead =
                ssd.segments.get(segment).map_or(0, |s| s.write_offset.saturating_sub(BLOCK_BYTES + s.live_bytes));
            let worth_it = dead * 100 >= ssd.segments.segment_bytes() * EAGER_RECLAIM_DEAD_PERCENT;
            // Ahead of demand only when it gains a good share of a segment: relocating a mostly
            // live segment just to keep a spare would copy the same records round and round.
            if !(free == 0 || ssd.space_wanted || (worth_it && !ssd.shutting_down)) {
                return;
            }
            // Live records may fill the tier up to a share of it, and never beyond what leaves an
            // open and a spare segment; past that (or when reclaims keep freeing nothing for the
            // writers that wait), the oldest cold records leave instead of being copied again.
            let capacity = ssd.segments.capacity_bytes();
            let room = (capacity * COPY_FORWARD_UP_TO_LIVE_PERCENT / 100)
                .min(capacity.saturating_sub(2 * ssd.segments.segment_bytes()));
            // A whole turn of the log that gained nothing means copying is not making room.
            let copy_cold = ssd.segments.live_bytes() <= room && ssd.fruitless_reclaims < ssd.segments.count();
            ssd.space_wanted = false;
            ssd.reclaim = Some(Reclaim {
                segment,
                copy_cold,
                writes: 0,
                queue: VecDeque::new(),
                copy: None,
                copies: Vec::new(),
                failures: 0,
            });
        }
        let Some(r) = ssd.reclaim.as_ref() else { return };
        if r.writes > 0 || r.copy.is_some() {
            return;
        }
        if !r.queue.is_empty() {
            self.start_next_copy();
            return;
        }
        let (segment, copy_cold) = (r.segment, r.copy_cold && r.failures < MAX_RELOCATION_FAILURES);
        let residents = ssd.extra[segment as usize].objects.clone();
        let mut busy = false;
        let mut queue = VecDeque::new();
        for (id, generation) in residents {
            let Some(object) = self.objects.get(id as usize) else { continue };
            if object.generation != generation || object.ssd.is_none_or(|l| l.segment != segment) {
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
                if let Some(location) = self.objects[id as usize].ssd.take() {
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
                        if let Some(r) = self.ssd.as_mut().and_then(|s| s.reclaim.as_mut()) {
                            r.writes += 1;
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
                queue.push_back((id, generation));
            } else {
                self.evict_from_ssd(id);
            }
        }
        let Some(r) = self.ssd.as_mut().and_then(|s| s.reclaim.as_mut()) else { return };
        if !queue.is_empty() {
            r.queue = queue;
            self.start_next_copy();
            return;
        }
        if r.writes > 0 || busy {
            return;
        }
        self.finish_reclaim();
    }

    /// Frees the reclaimed segment once its copies are durable and nothing can touch it.
    fn finish_reclaim(&mut self) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let Some(r) = ssd.reclaim.as_mut() else { return };
        let segment = r.segment;
        // A copy behind its segment's break will never be durable: undo it, so the object
        // points at its intact old record again and the next pass copies it anew.
        let (lost, copies): (Vec<Copied>, Vec<Copied>) = std::mem::take(&mut r.copies)
            .into_iter()
            .partition(|c| ssd.extra[c.dst.segment as usize].broken_at.is_some_and(|b| b < c.end()));
        r.copies = copies;
        let durable = r.copies.iter().all(|c| c.end() <= ssd.extra[c.dst.segment as usize].durable_prefix());
        for c in &lost {
            let Some(object) = self.objects.get_mut(c.id as usize) else { continue };
            if object.generation == c.generation && object.ssd == Some(c.dst) {
                object.ssd = Some(c.src);
                if let Some(ssd) = self.ssd.as_mut() {
                    if let Some(s) = ssd.segments.get_mut(c.dst.segment) {
                        s.live_bytes = s.live_bytes.saturating_sub(c.dst.record_bytes);
                    }
                    if let Some(s) = ssd.segments.get_mut(c.src.segment) {
                        s.live_bytes += c.src.record_bytes;
                    }
                }
            }
        }
        let Some(ssd) = self.ssd.as_mut() else { return };
        // Commits and tombstones waiting on this segment's sync are answered first.
        let settled =
            ssd.extra[segment as usize].waiters.is_empty() && ssd.extra[segment as usize].tombstones.is_empty();
        if !lost.is_empty() || !durable || !settled || ssd.segments.reclaim_candidate() != Some(segment) {
            return;
        }
        let Some(r) = ssd.reclaim.take() else { return };
        // Anything still naming this segment (a retired object kept by a reader) lets go now.
        let residents = std::mem::take(&mut ssd.extra[segment as usize].objects);
        for (id, generation) in residents {
            let Some(object) = self.objects.get_mut(id as usize) else { continue };
            if object.generation == generation && object.ssd.is_some_and(|l| l.segment == segment) {
                if let Some(location) = object.ssd.take() {
                    self.forget_ssd_copy(&location);
                }
                if object_has_no_copy(&self.objects[id as usize]) {
                    self.drop_object(id);
                }
            }
        }
        let Some(ssd) = self.ssd.as_mut() else { return };
        let used = ssd.segments.get(segment).map_or(0, |s| s.write_offset);
        if ssd.segments.reclaim(segment) {
            let copied: u64 = r.copies.iter().map(|c| c.dst.record_bytes).sum();
            let gain = used.saturating_sub(copied);
            if gain * 100 < ssd.segments.segment_bytes() * FRUITLESS_GAIN_PERCENT {
                ssd.fruitless_reclaims += 1;
            } else {
                ssd.fruitless_reclaims = 0;
            }
            ssd.extra[segment as usize] = SegmentExtra::default();
            self.counters.segments_reclaimed.fetch_add(1, RELAXED);
            if !r.copies.is_empty() {
                self.counters.compactions.fetch_add(1, RELAXED);
                self.counters.compacted_records.fetch_add(r.copies.len() as u64, RELAXED);
            }
        }
        self.retry_waiters();
    }

    /// A DRAM-resident object loses its SSD copy (its segment is being reclaimed in a mostly
    /// live tier). Write-through: it leaves the cache, since everything served must be durable.
    /// Write-back: it stays, dirty again, and is demoted when next evicted.
    fn drop_ssd_copy(&mut self, id: u32) {
        let Some(location) = self.objects[id as usize].ssd.take() else { return };
        self.forget_ssd_copy(&location);
        // Its record stays readable on disk until the segment is freed and zeroed: a remove or
        // an upsert must still write a tombstone for it.
        self.objects[id as usize].shadowed = true;
        if self.write_through() {
            self.counters.ssd_evictions.fetch_add(1, RELAXED);
            self.unlink(id);
            return;
        }
        // Dirty again: a clean shutdown under way writes it out too.
        let generation = self.objects[id as usize].generation;
        if let Some(queue) = self.ssd.as_mut().and_then(|s| s.flush_queue.as_mut()) {
            queue.push_back((id, generation));
        }
    }

    /// An SSD-only object leaves the cache with its segment.
    fn evict_from_ssd(&mut self, id: u32) {
        let Some(location) = self.objects[id as usize].ssd.take() else { return };
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

    /// Starts copying the next queued SSD-only record: its first chunk is read into staging.
    fn start_next_copy(&mut self) {
        loop {
            let Some(ssd) = self.ssd.as_mut() else { return };
            let (staging, staging_bytes) = (ssd.staging_offset(), ssd.staging_bytes);
            if ssd.frozen {
                return;
            }
            let Some(r) = ssd.reclaim.as_mut() else { return };
            if r.copy.is_some() {
                return;
            }
            let Some((id, generation)) = r.queue.pop_front() else {
                return;
            };
            let segment = r.segment;
            let Some(object) = self.objects.get(id as usize) else { continue };
            let eligible = object.generation == generation
                && object.state == ObjectState::Live
                && object.io_refs == 0
                && object.dram.is_none()
                && object.ssd.is_some_and(|l| l.segment == segment);
            let Some(src) = object.ssd.filter(|_| eligible) else { continue };
            let Some(ptr) = self.slice.ptr_at(staging, staging_bytes) else { return };
            let first = src.record_bytes.min(staging_bytes);
            if let Some(s) = ssd.segments.get_mut(src.segment) {
                s.readers += 1;
            }
            r.copy = Some(CopyJob {
                id,
                generation,
                src,
                dst: None,
                header: None,
                copied: 0,
                body_crc: crc32fast::Hasher::new(),
                key_matches: true,
            });
            let io = Io {
                kind: IoKind::CopyRead { len: first },
                file: src.segment,
                offset: src.offset,
                ptr,
                total: first,
                done: 0,
            };
            let token = ssd.ios.insert(io) as u64;
            ssd.outbox.push_back(DiskOp {
                token,
                file: src.segment,
                kind: DiskOpKind::Read { buf: ptr.as_ptr(), len: first as u32, offset: src.offset },
            });
            self.objects[id as usize].io_refs += 1;
            return;
        }
    }

    /// A chunk of the record being copied arrived in staging: check it, then write it forward.
    fn on_copy_read(&mut self, len: u64, ptr: NonNull<u8>, result: Result<()>) {
        let Some(mut job) = self.ssd.as_mut().and_then(|s| s.reclaim.as_mut()).and_then(|r| r.copy.take()) else {
            return;
        };
        if let Err(e) = result {
            return self.end_copy(job, Some(e));
        }
        // SAFETY: the read filled `len` bytes of the staging buffer, which only this copy uses.
        let chunk = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len as usize) };
        let at = job.copied;
        if job.header.is_none() {
            let object = &self.objects[job.id as usize];
            if object.generation != job.generation || object.state != ObjectState::Live {
                // Removed or replaced meanwhile: nothing to copy.
                return self.end_copy(job, None);
            }
            let header = match record::decode_header(chunk) {
                Ok(h) => h,
                Err(e) => return self.end_copy(job, Some(Error::Corrupted(e.to_string()))),
            };
            let belongs = header.kind == RecordKind::Put
                && header.epoch == job.src.epoch
                && header.seq == object.seq
                && header.value_len == object.len
                && header.key_len as usize == object.key.len()
                && header.record_bytes() == job.src.record_bytes;
            if !belongs {
                return self.end_copy(job, Some(Error::Corrupted("record does not belong to this key".into())));
            }
            let dst = match self.place_record(job.src.record_bytes, true) {
                Placement::At(dst) => dst,
                Placement::Full if self.ssd.as_ref().is_some_and(SsdState::room_coming) => {
                    return self.retry_copy_later(job);
                }
                Placement::Full | Placement::TooLarge => return self.end_copy(job, None),
            };
            if record::restamp_epoch(chunk, dst.epoch).is_err() {
                self.abandon_placement(dst);
                return self.end_copy(job, Some(Error::Internal("re-stamping a checked header failed")));
            }
            let Some(ssd) = self.ssd.as_mut() else { return };
            if let Some(s) = ssd.segments.get_mut(dst.segment) {
                s.writes_in_flight += 1;
            }
            ssd.extra[dst.segment as usize].uncovered.insert(dst.offset);
            job.header = Some(header);
            job.dst = Some(dst);
        }
        let (Some(header), Some(dst)) = (job.header, job.dst) else { return };
        // The body (key then value) checksum and the key are checked as the chunks pass.
        let key_end = (HEADER_BYTES + header.key_len as usize) as u64;
        let body_end = key_end + header.value_len;
        let (lo, hi) = (at.max(HEADER_BYTES as u64), (at + len).min(body_end));
        if lo < hi {
            job.body_crc.update(&chunk[(lo - at) as usize..(hi - at) as usize]);
        }
        let (klo, khi) = (at.max(HEADER_BYTES as u64), (at + len).min(key_end));
        if klo < khi {
            let key = &self.objects[job.id as usize].key;
            let want = &key[(klo - HEADER_BYTES as u64) as usize..(khi - HEADER_BYTES as u64) as usize];
            job.key_matches &= &chunk[(klo - at) as usize..(khi - at) as usize] == want;
        }
        let Some(ssd) = self.ssd.as_mut() else { return };
        let io = Io {
            kind: IoKind::CopyWrite { len },
            file: dst.segment,
            offset: dst.offset + at,
            ptr,
            total: len,
            done: 0,
        };
        let token = ssd.ios.insert(io) as u64;
        ssd.outbox.push_back(write_op(token, dst.segment, ptr, dst.offset + at, len));
        if let Some(r) = ssd.reclaim.as_mut() {
            r.copy = Some(job);
        }
    }

    /// A copy that found no room yet (the spare segment is still being zeroed): it goes back to
    /// the front of the queue; a later pass reads it again.
    fn retry_copy_later(&mut self, job: CopyJob) {
        if let Some(s) = self.ssd.as_mut().and_then(|s| s.segments.get_mut(job.src.segment)) {
            s.readers -= 1;
        }
        self.objects[job.id as usize].io_refs -= 1;
        if let Some(r) = self.ssd.as_mut().and_then(|s| s.reclaim.as_mut()) {
            r.queue.push_front((job.id, job.generation));
        }
        self.after_last_use(job.id);
    }

    /// A chunk reached its new place: read the next one or finish the copy.
    fn on_copy_write(&mut self, len: u64, result: Result<()>) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let Some(mut job) = ssd.reclaim.as_mut().and_then(|r| r.copy.take()) else { return };
        if let Err(e) = result {
            return self.end_copy(job, Some(e));
        }
        job.copied += len;
        if job.copied < job.src.record_bytes && ssd.frozen {
            // Out of shutdown time: stop here (the destination breaks at this record).
            return self.end_copy(job, Some(Error::ShuttingDown));
        }
        if job.copied < job.src.record_bytes {
            let next = (job.src.record_bytes - job.copied).min(ssd.staging_bytes);
            let staging = ssd.staging_offset();
            let Some(ptr) = self.slice.ptr_at(staging, next) else {
                return self.end_copy(job, Some(Error::Internal("staging outside slice")));
            };
            let offset = job.src.offset + job.copied;
            let io =
                Io { kind: IoKind::CopyRead { len: next }, file: job.src.segment, offset, ptr, total: next, done: 0 };
            let token = ssd.ios.insert(io) as u64;
            ssd.outbox.push_back(DiskOp {
                token,
                file: job.src.segment,
                kind: DiskOpKind::Read { buf: ptr.as_ptr(), len: next as u32, offset },
            });
            if let Some(r) = ssd.reclaim.as_mut() {
                r.copy = Some(job);
            }
            return;
        }
        self.end_copy(job, None);
    }

    /// Ends a copy: installs the new location when every chunk arrived intact, otherwise the
    /// object leaves the cache (a rotten or unreadable source, or no room: counted).
    fn end_copy(&mut self, job: CopyJob, error: Option<Error>) {
        let complete = error.is_none() && job.dst.is_some() && job.copied == job.src.record_bytes;
        let intact = job.header.is_some_and(|h| h.body_crc() == job.body_crc.clone().finalize()) && job.key_matches;
        if let Some(dst) = job.dst {
            if complete {
                self.counters.ssd_write_bytes.fetch_add(dst.record_bytes, RELAXED);
            }
            // A copy that stopped part-way leaves a hole: the destination segment breaks there.
            self.finish_segment_write(dst.segment, dst.offset, complete);
        }
        if let Some(s) = self.ssd.as_mut().and_then(|s| s.segments.get_mut(job.src.segment)) {
            s.readers -= 1;
        }
        let object = &mut self.objects[job.id as usize];
        object.io_refs -= 1;
        let live =
            object.generation == job.generation && object.ssd == Some(job.src) && object.state == ObjectState::Live;
        match job.dst {
            Some(dst) if live && complete && intact => {
                object.ssd = Some(dst);
                if let Some(ssd) = self.ssd.as_mut() {
                    if let Some(s) = ssd.segments.get_mut(job.src.segment) {
                        s.live_bytes = s.live_bytes.saturating_sub(job.src.record_bytes);
                    }
                    if let Some(s) = ssd.segments.get_mut(dst.segment) {
                        s.live_bytes += dst.record_bytes;
                    }
                    ssd.extra[dst.segment as usize].objects.push((job.id, job.generation));
                    if let Some(r) = ssd.reclaim.as_mut() {
                        r.copies.push(Copied { id: job.id, generation: job.generation, src: job.src, dst });
                    }
                }
            }
            _ if live => {
                let corrupted = matches!(error, Some(Error::Corrupted(_))) || (complete && !intact);
                if corrupted {
                    self.counters.corrupted.fetch_add(1, RELAXED);
                } else if error.is_some() {
                    if let Some(r) = self.ssd.as_mut().and_then(|s| s.reclaim.as_mut()) {
                        r.failures += 1;
                    }
                }
                self.evict_from_ssd(job.id);
            }
            _ => self.after_last_use(job.id),
        }
        self.start_next_copy();
        self.retry_waiters();
    }

    /// Zeroes the header of each freed segment whose old header may still be valid, so that
    /// recovery never brings its records back once newer segments are freed too.
    fn invalidate_stale_headers(&mut self) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let stale: Vec<u32> = ssd.segments.stale_free().collect();
        let Some(ptr) = ssd.zero_block_offset().and_then(|o| self.slice.ptr_at(o, BLOCK_BYTES)) else { return };
        for segment in stale {
            ssd.queue_block0_write(IoKind::Invalidate { segment }, segment, ptr);
        }
    }

    // ---- writes ---------------------------------------------------------------------------

    /// Starts writing a dirty victim's record from its DRAM image.
    pub(super) fn start_demotion(&mut self, id: u32) -> Demotion {
        match self.start_record_write(id, WritePurpose::Demotion) {
            Placement::At(_) => {
                let bytes = self.objects[id as usize].dram.as_ref().map_or(0, Allocation::len);
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

    /// Write-through: the commit's result waits for the record to be durable (and, when the tier
    /// has no room yet, for a reclaim to make some).
    pub(super) fn write_through_record(&mut self, id: u32, pending: usize, slot: usize) {
        self.policy.remove(id as EntryId);
        match self.start_record_write(id, WritePurpose::WriteThrough { pending, slot }) {
            Placement::At(_) => {}
            Placement::Full if self.ssd_space_coming() => {
                self.counters.ssd_space_waits.fetch_add(1, RELAXED);
                let generation = self.objects[id as usize].generation;
                self.objects[id as usize].io_refs += 1;
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
            if object.generation != w.generation || object.state != ObjectState::Live {
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
            if object.generation == w.generation && object.state == ObjectState::Live {
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
        let (key_len, len, seq, offset) = (object.key.len(), object.len, object.seq, allocation.offset());
        let record_bytes = record::record_bytes(key_len, len);
        let Some(ptr) = self.slice.ptr_at(offset, record_bytes) else { return Placement::TooLarge };
        let location = match self.place_record(record_bytes, purpose == WritePurpose::Relocation) {
            Placement::At(location) => location,
            other => return other,
        };
        // SAFETY: the record image is this object's own DRAM allocation; its value is immutable
        // once committed, and no other write of it is in flight (callers check io_refs), so
        // nothing else writes the header block. io_refs (below) keeps the allocation alive
        // until the write completes. Readers only read the value bytes.
        let image = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), record_bytes as usize) };
        if record::seal_in_place(image, RecordKind::Put, key_len, len, seq, location.epoch).is_err() {
            self.abandon_placement(location);
            return Placement::TooLarge;
        }
        let Some(ssd) = self.ssd.as_mut() else { return Placement::TooLarge };
        self.objects[id as usize].io_refs += 1;
        ssd.queue_placed_write(IoKind::Write { id, location, purpose }, location, ptr);
        Placement::At(location)
    }

    /// `Busy` when the tombstone queue is at its bound (a remove or upsert that needs one must
    /// then not happen: nothing is dropped).
    pub(super) fn tombstone_room(&self) -> Result<()> {
        match self.ssd.as_ref() {
            Some(ssd) if ssd.tombstones.len() >= ssd.config.max_pending_tombstones => {
                Err(Error::Busy { limit: ssd.config.max_pending_tombstones })
            }
            _ => Ok(()),
        }
    }

    /// Records that the SSD copy of `key` (if any) no longer counts: recovery keeps the key
    /// removed, or lets a newer put win. The tombstone takes its sequence number now, is queued
    /// and written as soon as a block and a place are free; it is never dropped.
    pub(super) fn queue_tombstone(&mut self, key: &[u8]) {
        let seq = self.bump_seq();
        let Some(ssd) = self.ssd.as_mut() else { return };
        ssd.tombstones.push_back(PendingTombstone { key: key.into(), seq, tries: 0 });
        self.counters.tombstones_pending.store(ssd.tombstones.len() as u64, RELAXED);
    }

    /// A write-through put that cannot be made durable is not kept, and the version it
    /// replaced is gone already: a tombstone makes a restart agree that the key is absent.
    fn unlink_unacknowledged(&mut self, id: u32) {
        let key = self.objects[id as usize].key.clone();
        self.unlink(id);
        self.queue_tombstone(&key);
    }

    /// Writes queued tombstones while blocks and segment room are free.
    fn pump_tombstones(&mut self) {
        loop {
            let Some(ssd) = self.ssd.as_mut() else { return };
            let Some(front) = ssd.tombstones.front() else { break };
            let record_bytes = record::record_bytes(front.key.len(), 0);
            let buffer = if record_bytes == BLOCK_BYTES {
                match ssd.tombstone_free.pop() {
                    Some(slot) => TombstoneBuffer::Slot(slot),
                    None => break,
                }
            } else {
                match self.allocator.allocate(record_bytes) {
                    Some(allocation) => {
                        ssd.borrowed_bytes += allocation.len();
                        self.counters.bytes_used.fetch_add(allocation.len(), RELAXED);
                        TombstoneBuffer::Borrowed(allocation)
                    }
                    None => break,
                }
            };
            let location = match self.place_record(record_bytes, false) {
                Placement::At(location) => location,
                Placement::Full | Placement::TooLarge => {
                    self.release_tombstone_buffer(buffer);
                    break;
                }
            };
            let Some(ssd) = self.ssd.as_mut() else { return };
            let Some(pending) = ssd.tombstones.pop_front() else { break };
            let offset = match &buffer {
                TombstoneBuffer::Slot(slot) => ssd.tombstone_slot_offset(*slot),
                TombstoneBuffer::Borrowed(a) => Some(a.offset()),
            };
            let ptr = offset.and_then(|o| self.slice.ptr_at(o, record_bytes));
            let encoded = ptr.is_some_and(|ptr| {
                // SAFETY: the block was taken from the free slots (or allocated) for this
                // tombstone alone; no other write uses it until its completion returns it.
                let block = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), record_bytes as usize) };
                record::encode(block, RecordKind::Tombstone, &pending.key, &[], pending.seq, location.epoch).is_ok()
            });
            let Some(ptr) = ptr.filter(|_| encoded) else {
                self.release_tombstone_buffer(buffer);
                self.abandon_placement(location);
                self.counters.tombstones_skipped.fetch_add(1, RELAXED);
                tracing::error!("a tombstone could not be encoded; its key may come back after a restart");
                continue;
            };
            let Some(ssd) = self.ssd.as_mut() else { return };
            ssd.queue_placed_write(IoKind::Tombstone { buffer, location, pending }, location, ptr);
            self.counters.tombstones.fetch_add(1, RELAXED);
        }
        if let Some(ssd) = self.ssd.as_ref() {
            self.counters.tombstones_pending.store(ssd.tombstones.len() as u64, RELAXED);
        }
    }

    /// A tombstone whose write failed, or whose segment broke before it was durable, is
    /// written again elsewhere (a bounded number of times: a disk failing every write loses it,
    /// counted and logged).
    fn requeue_tombstone(&mut self, mut pending: PendingTombstone) {
        pending.tries += 1;
        if pending.tries < WRITE_TRIES {
            if let Some(ssd) = self.ssd.as_mut() {
                ssd.tombstones.push_front(pending);
            }
        } else {
            self.counters.tombstones_skipped.fetch_add(1, RELAXED);
            tracing::error!("a tombstone could not be written; its key may come back after a restart");
        }
    }

    fn release_tombstone_buffer(&mut self, buffer: TombstoneBuffer) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        match buffer {
            TombstoneBuffer::Slot(slot) => ssd.tombstone_free.push(slot),
            TombstoneBuffer::Borrowed(allocation) => {
                ssd.borrowed_bytes -= allocation.len();
                self.counters.bytes_used.fetch_sub(allocation.len(), RELAXED);
                self.allocator.free(allocation);
            }
        }
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
            kind: IoKind::Load { id, location, allocation: Some(allocation), waiters },
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
        if self.objects[id as usize].io_refs > 0 {
            // A reclaim is copying its record forward: read it once the copy is done.
            return false;
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
        if !self.submit_load(id, location, allocation, vec![(pending, slot)]) {
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
        let syncs = matches!(io.kind, IoKind::Sync { .. } | IoKind::InvalidateSync { .. });
        if !failed && !syncs {
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
                    IoKind::Load { .. } | IoKind::CopyRead { .. } => {
                        DiskOpKind::Read { buf: ptr, len: rest as u32, offset }
                    }
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
            IoKind::Header { segment } => {
                if result.is_ok() {
                    ssd.extra[segment as usize].header_written = true;
                }
                self.finish_segment_write(segment, 0, result.is_ok());
                if result.is_err() {
                    self.rewrite_segment_header(segment, io.ptr);
                }
            }
            IoKind::Tombstone { buffer, location, pending } => {
                self.release_tombstone_buffer(buffer);
                let ok = result.is_ok();
                if ok {
                    if let Some(ssd) = self.ssd.as_mut() {
                        let end = location.offset + location.record_bytes;
                        ssd.extra[location.segment as usize].tombstones.push((end, pending));
                    }
                    self.finish_segment_write(location.segment, location.offset, true);
                    self.advance_durability(location.segment);
                } else {
                    self.finish_segment_write(location.segment, location.offset, false);
                    self.requeue_tombstone(pending);
                }
            }
            IoKind::Write { id, location, purpose } => {
                if let Some(s) = ssd.segments.get_mut(location.segment) {
                    if result.is_ok() {
                        s.live_bytes += location.record_bytes;
                    }
                }
                self.finish_segment_write(location.segment, location.offset, result.is_ok());
                self.counters
                    .ssd_write_bytes
                    .fetch_add(if result.is_ok() { location.record_bytes } else { 0 }, RELAXED);
                self.finish_record_write(id, location, purpose, result);
            }
            IoKind::Load { id, location, allocation, waiters } => {
                if let Some(s) = ssd.segments.get_mut(location.segment) {
                    s.readers -= 1;
                }
                ssd.loading_bytes -= location.record_bytes;
                let checked = self.verify_loaded(id, &location, io.ptr, result);
                self.finish_load(id, location, allocation, waiters, checked);
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
                let header_lost = result.is_err() && covers.contains(&0);
                let open = ssd.segments.get(segment).is_some_and(|s| s.state == SegmentState::Open);
                if result.is_err() && open {
                    // Nothing appended after the break could become durable: use a new segment.
                    ssd.segments.seal_open();
                }
                self.advance_durability(segment);
                if header_lost {
                    let header = self.ssd.as_ref().and_then(|s| s.scratch_offset(u64::from(segment)));
                    if let Some(ptr) = header.and_then(|o| self.slice.ptr_at(o, BLOCK_BYTES)) {
                        self.rewrite_segment_header(segment, ptr);
                    }
                }
            }
            IoKind::Invalidate { segment } => {
                if result.is_err() {
                    self.invalidation_failed(segment);
                }
                let Some(ssd) = self.ssd.as_mut() else { return };
                if let Some(s) = ssd.segments.get_mut(segment) {
                    s.writes_in_flight -= 1;
                }
                if result.is_ok() {
                    ssd.queue_sync(IoKind::InvalidateSync { segment }, segment);
                }
            }
            IoKind::InvalidateSync { segment } => {
                self.counters.syncs.fetch_add(1, RELAXED);
                if result.is_err() {
                    self.invalidation_failed(segment);
                }
                let Some(ssd) = self.ssd.as_mut() else { return };
                if let Some(s) = ssd.segments.get_mut(segment) {
                    s.sync_in_flight = false;
                    if result.is_ok() && s.state == SegmentState::Free {
                        s.stale_header = false;
                    }
                }
            }
            IoKind::CopyRead { len } => self.on_copy_read(len, io.ptr, result),
            IoKind::CopyWrite { len } => self.on_copy_write(len, result),
        }
    }

    /// Zeroing a freed segment's header failed: it is tried again next turn, a bounded number of
    /// times; after that the tier takes no more writes (waiting writers get `NoSpace`), since no
    /// other segment may be freed while this one's old records could still be recovered.
    fn invalidation_failed(&mut self, segment: u32) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let extra = &mut ssd.extra[segment as usize];
        extra.header_tries += 1;
        if extra.header_tries >= WRITE_TRIES && !ssd.failed {
            tracing::error!(segment, "a freed segment's header could not be zeroed; the SSD tier stops taking writes");
            ssd.failed = true;
        }
    }

    /// Writes a segment's header again after its write or its sync failed: until a new header
    /// is durable, the old one (of the segment's previous life) may still be valid on disk. The
    /// segment stays broken (its records are never acknowledged), but its old records can no
    /// longer return, and later reclaims are not held up by its header.
    fn rewrite_segment_header(&mut self, segment: u32, ptr: NonNull<u8>) {
        let Some(ssd) = self.ssd.as_mut() else { return };
        let extra = &mut ssd.extra[segment as usize];
        extra.header_written = false;
        extra.header_tries += 1;
        if extra.header_tries >= WRITE_TRIES {
            tracing::error!(segment, "a segment header could not be written; the SSD tier stops taking writes");
            ssd.failed = true;
            return;
        }
        extra.uncovered.insert(0);
        ssd.queue_block0_write(IoKind::Header { segment }, segment, ptr);
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
        let open = ssd.segments.get(segment).is_some_and(|s| s.state == SegmentState::Open);
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
        let header_durable = extra.header_written && !extra.uncovered.contains(&0);
        let broken_at = extra.broken_at;
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut extra.waiters).into_iter().partition(|w| w.end <= prefix);
        let (failed, waiting): (Vec<_>, Vec<_>) =
            waiting.into_iter().partition(|w| broken_at.is_some_and(|b| w.end > b));
        extra.waiters = waiting;
        // Durable tombstones are done; those behind a break go back to the queue.
        extra.tombstones.retain(|(end, _)| *end > prefix);
        let (lost_tombstones, undecided): (Vec<_>, Vec<_>) =
            std::mem::take(&mut extra.tombstones).into_iter().partition(|(end, _)| broken_at.is_some_and(|b| *end > b));
        extra.tombstones = undecided;
        if header_durable {
            if let Some(s) = ssd.segments.get_mut(segment) {
                s.header_durable = true;
            }
        }
        for (_, pending) in lost_tombstones {
            self.requeue_tombstone(pending);
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
                self.unlink_unacknowledged(w.object);
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

    fn finish_record_write(&mut self, id: u32, location: SsdLocation, purpose: WritePurpose, result: Result<()>) {
        let dram_bytes = self.objects[id as usize].dram.as_ref().map_or(0, Allocation::len);
        if purpose == WritePurpose::Demotion {
            self.demoting_bytes -= dram_bytes;
        }
        if purpose == WritePurpose::Relocation {
            if let Some(r) = self.ssd.as_mut().and_then(|s| s.reclaim.as_mut()) {
                r.writes = r.writes.saturating_sub(1);
                if result.is_err() {
                    r.failures += 1;
                }
            }
        }
        let object = &mut self.objects[id as usize];
        object.io_refs -= 1;
        match result {
            Ok(()) => {
                let previous = object.ssd.replace(location);
                let generation = object.generation;
                if let Some(previous) = previous {
                    // A relocation copy replaces the record in the segment being freed.
                    self.forget_ssd_copy(&previous);
                }
                self.counters.ssd_objects.fetch_add(1, RELAXED);
                self.counters.ssd_bytes.fetch_add(location.record_bytes, RELAXED);
                if let Some(ssd) = self.ssd.as_mut() {
                    let extra = &mut ssd.extra[location.segment as usize];
                    extra.objects.push((id, generation));
                    if let WritePurpose::WriteThrough { pending, slot } = purpose {
                        let end = location.offset + location.record_bytes;
                        extra.waiters.push(DurableWaiter { end, pending, slot, object: id, generation });
                    }
                    if let (WritePurpose::Relocation, Some(src)) = (purpose, previous) {
                        if let Some(r) = ssd.reclaim.as_mut() {
                            r.copies.push(Copied { id, generation, src, dst: location });
                        }
                    }
                }
                if matches!(purpose, WritePurpose::WriteThrough { .. }) {
                    // Usually not yet durable; a sync that already covers it will say so.
                    self.advance_durability(location.segment);
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
        } else if purpose == WritePurpose::Demotion && object.ssd.is_some() && object.leases == 0 && object.pins == 0 {
            // A finished demotion: the DRAM copy goes (the policy no longer tracks it).
            let object = &mut self.objects[id as usize];
            object.transient = false;
            if let Some(allocation) = object.dram.take() {
                self.counters.bytes_used.fetch_sub(allocation.len(), RELAXED);
                self.counters.dram_objects.fetch_sub(1, RELAXED);
                self.counters.evictions.fetch_add(1, RELAXED);
                self.allocator.free(allocation);
            }
        } else if purpose == WritePurpose::Demotion && object.ssd.is_none() && object.leases == 0 && object.pins == 0 {
            // The demotion failed: drop the object rather than keep memory others wait for.
            let key = object.key.clone();
            self.index.remove(&key);
            self.counters.objects.fetch_sub(1, RELAXED);
            self.counters.evictions.fetch_add(1, RELAXED);
            self.free_object(id);
        } else if object.transient {
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
            let dirty = self
                .objects
                .iter()
                .filter(|(_, o)| o.state == ObjectState::Live && o.dram.is_some() && o.ssd.is_none())
                .map(|(id, o)| (id as u32, o.generation))
                .collect();
            ssd.flush_queue = Some(dirty);
        }
        let rounds = ssd.flush_queue.as_ref().map_or(0, VecDeque::len);
        for _ in 0..rounds {
            let Some((id, generation)) =
                self.ssd.as_mut().and_then(|s| s.flush_queue.as_mut()).and_then(VecDeque::pop_front)
            else {
                break;
            };
            let Some(o) = self.objects.get(id as usize) else { continue };
            if o.generation != generation || o.state != ObjectState::Live || o.dram.is_none() || o.ssd.is_some() {
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
            match self.start_record_write(id, WritePurpose::Flush) {
                Placement::At(_) => {
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
        self.ssd.as_ref().and_then(|s| s.flush_queue.as_ref()).map_or(0, VecDeque::len)
    }

    /// A clean shutdown began: reclaims now start only for writes that wait for room.
    pub(super) fn ssd_shutting_down(&mut self) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.shutting_down = true;
        }
    }

    /// Past the shutdown deadline: start no new SSD work (in-flight operations still finish).
    pub(super) fn freeze_ssd(&mut self) {
        if let Some(ssd) = self.ssd.as_mut() {
            ssd.frozen = true;
        }
    }

    /// Work a clean shutdown still waits for: queued tombstones and freed segments whose old
    /// header is not yet zeroed.
    pub(super) fn ssd_shutdown_pending(&self) -> bool {
        self.ssd_tombstones_pending() || self.ssd.as_ref().is_some_and(|s| s.segments.has_stale_free())
    }

    /// Tombstones queued or not yet durable, on a tier still taking writes.
    pub(super) fn ssd_tombstones_pending(&self) -> bool {
        self.ssd.as_ref().is_some_and(|s| {
            !s.failed && (!s.tombstones.is_empty() || s.extra.iter().any(|e| !e.tombstones.is_empty()))
        })
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
    ) -> bool {
        let object = &mut self.objects[id as usize];
        object.loading = None;
        object.io_refs -= 1;
        match (checked, allocation) {
            (Ok(()), Some(allocation)) => {
                self.counters.ssd_read_bytes.fetch_add(location.record_bytes, RELAXED);
                let promote = self.ssd.as_ref().is_some_and(|s| s.config.promote_on_hit);
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
                self.after_last_use(id);
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
                committed_turn: 0,
                shadowed: false,
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

/// A live or retired object with neither a DRAM nor an SSD copy.
fn object_has_no_copy(object: &Object) -> bool {
    object.dram.is_none() && object.ssd.is_none()
}

fn write_op(token: u64, file: u32, ptr: NonNull<u8>, offset: u64, len: u64) -> DiskOp {
    let len = len.min(MAX_IO_BYTES) as u32;
    DiskOp { token, file, kind: DiskOpKind::Write { buf: ptr.as_ptr().cast_const(), len, offset } }
}
