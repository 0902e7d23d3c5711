//! The SSD tier's policy, sans I/O: segment placement, segment headers, the durable prefix of
//! each segment, group commit, tombstones, segment reclaim (copying live records forward),
//! zeroing freed segments' headers, short or failed transfers, and applying recovery scans.
//!
//! Owns every disk operation of a shard and the bookkeeping that says which bytes on disk are
//! durable. Never knows what a record belongs to: a caller's operation or durability wait is an
//! opaque `u64` tag, a record's owner an opaque `u64` token, and both come back in
//! [`TierEvent`]s. Never reports a record durable before the `fdatasync` covering it completed,
//! never writes a copy whose source failed its checks, never frees or reuses a segment that a
//! read, write or sync can still touch or whose live records are not durable elsewhere, never
//! drops a tombstone silently (one it gives up on after `WRITE_TRIES` is counted and logged).
//!
//! # Interface
//!
//! Sans-I/O. The caller (the shard core) asks for work and the tier describes it as [`DiskOp`]s:
//!
//! - [`SsdTier::place`] reserves room for a record (opening a segment queues its header write);
//!   [`SsdTier::abandon`] turns a placement that will not be written into a hole.
//! - [`SsdTier::write_record`] writes a whole record image to its placement; the completion is a
//!   [`TierEvent::Done`] with the caller's tag, after the segment's bookkeeping was updated (its
//!   live bytes count the record once written).
//! - [`SsdTier::load`] reads a record and verifies it (checksums, epoch, key, sequence number)
//!   before [`TierEvent::Loaded`] reports it: bytes that failed a check are never reported good.
//!   [`SsdTier::load_progressive`] reads it in pieces and reports the value's checked front as
//!   it grows ([`TierEvent::LoadProgress`]), block by block against the record's checksum table.
//! - [`SsdTier::begin_write`], [`SsdTier::write_chunk`] and [`SsdTier::end_write`] write a placed
//!   record in pieces (a relocation copy through a staging buffer); [`SsdTier::read`] reads any
//!   bytes, and [`SsdTier::add_reader`] / [`SsdTier::drop_reader`] keep a segment from reuse while
//!   a caller reads it.
//! - [`SsdTier::await_durable`] waits for a segment's durable prefix to pass an offset: a
//!   [`TierEvent::Durability`] lists the waits that are now durable and those whose segment broke
//!   before them (never durable).
//! - [`SsdTier::queue_tombstone`] queues a tombstone (bounded: `Busy` past
//!   `max_pending_tombstones`); [`TierEvent::Tombstones`] names, by sequence number, those that
//!   became durable and those given up on; [`SsdTier::pump_tombstones`] writes queued ones, a failed or
//!   un-durable one goes back to the queue (a bounded number of tries).
//! - [`SsdTier::queue_syncs`] is group commit; [`SsdTier::invalidate_stale_headers`] zeroes freed
//!   segments' headers.
//! - Reclaim: [`SsdTier::reclaim_step`] starts one when due and asks the caller to decide about
//!   the records resting in the segment ([`ReclaimStep::Decide`]); the caller rewrites the ones
//!   it holds in memory (a relocation `place` + `write_record`, announced with
//!   `relocation_write_started`, reported with `relocation_write_done` and `track_copy`), and
//!   hands the others to [`SsdTier::reclaim_decided`] as [`CopyRequest`]s, which the tier copies
//!   through its staging buffer, checking header, key and checksum as the chunks pass
//!   ([`TierEvent::CopyFinished`]). The segment is freed once every copy is durable
//!   ([`TierEvent::SegmentFreed`]); a copy its segment's break made undurable is undone
//!   ([`TierEvent::CopyLost`]). [`RecordOwners`] answers, during a completion, whether a queued
//!   copy may start and whether its owner still wants it.
//! - Clean shutdown: [`SsdTier::set_shutting_down`] (no eager reclaims), [`SsdTier::freeze`]
//!   (copies stop), [`SsdTier::tombstones_pending`] and the segment table's stale headers say
//!   what is left to make durable.
//! - [`SsdTier::take_disk_ops`] / [`SsdTier::on_completion`] connect it to a [`super::DiskIo`].
//! - [`SsdTier::apply_scans`] installs what a recovery scan found and says which records won.
//!
//! Caller tags must stay below `1 << 63` (the tier's own copy operations use that bit).
//!
//! Memory: the tier writes from and reads into caller memory (arena memory) named by raw
//! pointers. The methods that take one are `unsafe`: the memory must stay valid, and untouched by
//! anything else while a read fills it, until the operation's `Done` event.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::ptr::NonNull;

use slab::Slab;

use super::disk::{DiskCompletion, DiskOp, DiskOpKind};
use super::record::{self, RecordKind, BLOCK_BYTES};
use super::recovery::{FoundRecord, SegmentScan};
use super::segments::{AppendError, SegmentState, SegmentTable, SsdLocation};

/// Completed write-back writes per segment between syncs (nothing waits on them; syncing them
/// in groups bounds what a crash loses without an fdatasync per write).
pub const WRITE_BACK_SYNC_EVERY_WRITES: u32 = 64;
/// Scratch blocks for one-block tombstones (longer keys borrow caller memory for theirs).
pub const TOMBSTONE_SLOTS: usize = 32;
/// Attempts to write one tombstone or segment header before giving up (a disk failing every
/// write).
pub const WRITE_TRIES: u8 = 4;
/// Largest single transfer; longer ones continue like short transfers do.
pub const MAX_IO_BYTES: u64 = 1 << 30;

/// The tier's shape.
#[derive(Clone, Debug)]
pub struct TierConfig {
    pub segments: u32,
    pub segment_bytes: u64,
    /// Seeds the random segment epochs (fixed in simulations, random in production).
    pub epoch_seed: u64,
    /// Tombstones that may wait to be written; more get `Busy`.
    pub max_pending_tombstones: usize,
    /// Bytes of the staging buffer relocation copies pass through (a multiple of 4 KiB).
    pub staging_bytes: u64,
}

impl TierConfig {
    /// Bytes of scratch memory the tier needs: one header block per segment, a zero block, the
    /// tombstone slots and the staging buffer.
    pub fn scratch_bytes(&self) -> u64 {
        self.staging_offset() + self.staging_bytes
    }

    fn staging_offset(&self) -> u64 {
        (u64::from(self.segments) + 1 + TOMBSTONE_SLOTS as u64) * BLOCK_BYTES
    }
}

/// Where `place` put a record, or why it could not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    At(SsdLocation),
    /// Larger than a segment can hold.
    TooLarge,
    /// No room until a segment is freed (or the tier stopped taking writes).
    Full,
}

/// Why a transfer failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoFailure {
    /// The disk returned this errno.
    Errno(i32),
    /// A transfer of zero bytes (end of file): it would never progress.
    NoProgress,
}

impl fmt::Display for IoFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IoFailure::Errno(errno) => {
                write!(f, "disk operation failed: {}", std::io::Error::from_raw_os_error(*errno))
            }
            IoFailure::NoProgress => f.write_str("short transfer made no progress"),
        }
    }
}

/// Why a load failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadFailure {
    /// The read failed.
    Io(IoFailure),
    /// The bytes failed their checksums, or are not the record asked for.
    Corrupted(String),
}

/// What the caller must react to, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum TierEvent {
    /// The caller's operation `tag` finished: every byte transferred, or it failed.
    Done { tag: u64, result: Result<(), IoFailure> },
    /// The load `tag` finished: on `Ok` the buffer holds the record asked for, every checksum
    /// verified; on an error its bytes must not be used.
    Loaded { tag: u64, result: Result<(), LoadFailure> },
    /// The first `value_bytes` of the progressive load `tag`'s value arrived and passed their
    /// checks (header, key, checksum table, their blocks): the caller may use them now. Grows
    /// with each event; `Loaded` still ends the load (and may fail it for a later block).
    /// `value_offset` is where the value starts in the record (it depends on the record's
    /// format version).
    LoadProgress { tag: u64, value_offset: u64, value_bytes: u64 },
    /// Waits (`await_durable` tags) the durable prefix now covers, and those it never will (a
    /// write or sync before them failed).
    Durability { durable: Vec<u64>, lost: Vec<u64> },
    /// Tombstones (by the sequence number they were queued with) that are durable now, and
    /// those that will never be written (their keys may come back after a restart).
    Tombstones { durable: Vec<u64>, skipped: Vec<u64> },
    /// The caller memory lent for a tombstone (`pump_tombstones`) is free again.
    BufferReleased { handle: u64 },
    /// A copy through the staging buffer (`CopyRequest`) ended; the owner is no longer held.
    /// `written_bytes` were written to the destination.
    CopyFinished { owner: u64, src: SsdLocation, written_bytes: u64, outcome: CopyOutcome },
    /// A copy made by the reclaim (`track_copy`) will never be durable (its segment broke before
    /// it): if the owner still rests at `dst`, it rests at `src` again (still intact); the next
    /// pass copies it anew.
    CopyLost { owner: u64, src: SsdLocation, dst: SsdLocation },
    /// The reclaimed `segment` was freed after `copies` records were copied out of it; records
    /// still naming it are gone. `owners` are those registered for it (some may have moved).
    SegmentFreed { segment: u32, copies: usize, owners: Vec<u64> },
}

/// Why `queue_tombstone` queued nothing (the remove must then not happen).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TombstoneRefused {
    /// `limit` tombstones wait already.
    Full { limit: usize },
    /// The tier stopped taking writes (a segment header failed every try): no tombstone can be
    /// written any more.
    TierFailed,
}

/// Totals since the tier was made (the caller publishes them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierCounters {
    pub syncs: u64,
    pub io_errors: u64,
    pub short_io: u64,
    /// Tombstone writes started.
    pub tombstones: u64,
    /// Tombstones given up on (their key may come back after a restart).
    pub tombstones_skipped: u64,
}

/// What `apply_scans` found.
#[derive(Debug, Default)]
pub struct Recovered {
    pub segments_scanned: u32,
    pub records: u64,
    pub superseded: u64,
    pub removed_by_tombstone: u64,
    /// (segment, offset, reason) of records or tails that were not recovered.
    pub discarded: Vec<(u32, u64, String)>,
    /// The newest put of each key that no tombstone removed; their bytes count as live.
    pub live: Vec<FoundRecord>,
    /// The highest sequence number seen (records and segment headers).
    pub max_seq: u64,
}

/// A removed or superseded key whose tombstone is not written yet. Its sequence number was taken
/// when the remove happened, so a later put of the key still wins.
struct PendingTombstone {
    key: Box<[u8]>,
    seq: u64,
    tries: u8,
}

/// Where a tombstone's block lives while it is written.
enum TombstoneBuffer {
    Slot(usize),
    Borrowed(u64),
}

enum IoKind {
    Header {
        segment: u32,
    },
    Tombstone {
        buffer: TombstoneBuffer,
        location: SsdLocation,
        pending: PendingTombstone,
    },
    /// A whole record image (`write_record`): its segment's bookkeeping ends with it.
    Record {
        tag: u64,
        location: SsdLocation,
    },
    /// A caller's read or chunk write: only the caller's tag comes back.
    Raw {
        tag: u64,
        read: bool,
    },
    /// One piece of a progressive load (`pieces`).
    LoadPiece {
        load: usize,
    },
    /// A whole record read for the caller, verified before it is reported.
    Load {
        tag: u64,
        location: SsdLocation,
        identity: RecordIdentity,
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
}

struct Io {
    kind: IoKind,
    file: u32,
    offset: u64,
    ptr: NonNull<u8>,
    total: u64,
    done: u64,
}

/// Durability bookkeeping of one segment.
///
/// Recovery scans a segment front to back and stops at the first hole, so a record is durable
/// only when every write before it in the segment is durable too: the durable prefix ends at the
/// first write not yet covered by a completed sync. A failed write or sync breaks the segment at
/// that offset: nothing after it can ever be acknowledged durable.
#[derive(Default)]
struct SegmentLog {
    /// `await_durable` and `watch_durable` waits: (end offset, tag, urgent). Only urgent ones
    /// make a sync of an open segment due at once.
    waiters: Vec<(u64, u64, bool)>,
    /// Start offsets of writes placed here and not yet covered by a completed sync.
    uncovered: BTreeSet<u64>,
    /// Writes completed since the last sync was submitted.
    completed: Vec<u64>,
    broken_at: Option<u64>,
    /// The segment header's write completed (durable once a sync covers offset 0).
    header_written: bool,
    /// Times the header was written again after a failed write or sync (or zeroing it failed).
    header_tries: u8,
    /// Tombstones written here and not yet durable, by end offset. A break before one sends
    /// it back to the queue: a remove is done only when its tombstone is durable.
    tombstones: Vec<(u64, PendingTombstone)>,
}

impl SegmentLog {
    fn durable_prefix(&self) -> u64 {
        let first_gap = self.uncovered.first().copied().unwrap_or(u64::MAX);
        first_gap.min(self.broken_at.unwrap_or(u64::MAX))
    }
}

/// See the module comment.
pub struct SsdTier {
    config: TierConfig,
    segments: SegmentTable,
    logs: Vec<SegmentLog>,
    ios: Slab<Io>,
    /// Progressive loads in flight (their pieces are in `ios`).
    piece_loads: Slab<PieceLoad>,
    outbox: VecDeque<DiskOp>,
    events: VecDeque<TierEvent>,
    /// One header block per segment, a zero block, then the tombstone slots.
    scratch: NonNull<u8>,
    tombstone_free: Vec<usize>,
    tombstones: VecDeque<PendingTombstone>,
    /// Orders segment headers: recovery seals segments oldest first by it.
    next_order: u64,
    /// A segment header could not be written (or zeroed): the tier takes no more writes.
    failed: bool,
    /// Per segment: the owners whose records rest there (`add_resident`), as the caller named
    /// them; a reclaim hands them back to the caller to decide about.
    residents: Vec<Vec<u64>>,
    /// The reclaim in progress.
    reclaim: Option<Reclaim>,
    /// A clean shutdown is flushing: reclaims start only for writes that wait.
    shutting_down: bool,
    /// A clean shutdown ran out of time: copies stop.
    frozen: bool,
    /// Reclaims in a row that gained less than `FRUITLESS_GAIN_PERCENT` of a segment (their
    /// records were nearly all live). After a whole turn of the log of them, copying forward is
    /// not making room.
    fruitless_reclaims: u32,
    /// A write found no room since `clear_space_wanted`.
    space_wanted: bool,
    counters: TierCounters,
}

// SAFETY: the raw pointers the tier holds (its scratch blocks and the buffers of queued
// operations) are arena memory its owner keeps valid (see `SsdTier::new` and the unsafe
// methods); nothing in them is tied to a thread, and the tier is used by one owner at a time.
unsafe impl Send for SsdTier {}

impl SsdTier {
    /// A tier of `config.segments` free segments.
    ///
    /// # Safety
    /// `scratch` must point to `config.scratch_bytes()` bytes that stay valid for writes for the
    /// tier's whole life and that nothing else reads or writes meanwhile.
    pub unsafe fn new(config: TierConfig, scratch: NonNull<u8>) -> SsdTier {
        SsdTier {
            segments: SegmentTable::new(config.segments, config.segment_bytes, config.epoch_seed),
            logs: (0..config.segments).map(|_| SegmentLog::default()).collect(),
            ios: Slab::new(),
            piece_loads: Slab::new(),
            outbox: VecDeque::new(),
            events: VecDeque::new(),
            scratch,
            tombstone_free: (0..TOMBSTONE_SLOTS).collect(),
            tombstones: VecDeque::new(),
            next_order: 1,
            failed: false,
            residents: (0..config.segments).map(|_| Vec::new()).collect(),
            reclaim: None,
            shutting_down: false,
            frozen: false,
            fruitless_reclaims: 0,
            space_wanted: false,
            counters: TierCounters::default(),
            config,
        }
    }

    /// The staging buffer relocation copies pass through.
    fn staging(&self) -> NonNull<u8> {
        // SAFETY: the staging buffer is the tail of the scratch region (`new`'s contract), so
        // the offset stays inside one allocation.
        unsafe { self.scratch.add(self.config.staging_offset() as usize) }
    }

    pub fn config(&self) -> &TierConfig {
        &self.config
    }

    /// The segment table (space, epochs, who uses each segment).
    pub fn segments(&self) -> &SegmentTable {
        &self.segments
    }

    pub fn counters(&self) -> TierCounters {
        self.counters
    }

    /// Tombstones queued and not yet written.
    pub fn queued_tombstones(&self) -> usize {
        self.tombstones.len()
    }

    /// Tombstones queued or written and not yet durable, on a tier still taking writes.
    pub fn tombstones_pending(&self) -> bool {
        !self.failed && (!self.tombstones.is_empty() || self.logs.iter().any(|l| !l.tombstones.is_empty()))
    }

    /// A segment header could not be written or zeroed: the tier takes no more writes.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// A placement found no room since the last `clear_space_wanted`.
    pub fn space_wanted(&self) -> bool {
        self.space_wanted
    }

    pub fn clear_space_wanted(&mut self) {
        self.space_wanted = false;
    }

    /// A free segment exists that a placement cannot open yet (its old header is being zeroed).
    pub fn room_coming(&self) -> bool {
        self.segments.free_count() > self.segments.usable_free_count()
    }

    /// No operation queued or in flight.
    pub fn is_quiet(&self) -> bool {
        self.ios.is_empty() && self.outbox.is_empty()
    }

    /// Operations queued and not yet handed out by `take_disk_ops`.
    pub fn queued_ops(&self) -> usize {
        self.outbox.len()
    }

    /// Operations queued or submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.ios.len()
    }

    /// The next event to react to.
    pub fn next_event(&mut self) -> Option<TierEvent> {
        self.events.pop_front()
    }

    /// Disk operations ready to submit.
    pub fn take_disk_ops(&mut self, out: &mut Vec<DiskOp>) {
        out.extend(self.outbox.drain(..));
    }

    /// Gives back an operation the disk could not take yet; it goes first next time.
    pub fn requeue_disk_op(&mut self, op: DiskOp) {
        self.outbox.push_front(op);
    }

    /// Counts `bytes` of live records in `segment` (a record that now rests there).
    pub fn add_live(&mut self, segment: u32, bytes: u64) {
        if let Some(s) = self.segments.get_mut(segment) {
            s.live_bytes += bytes;
        }
    }

    /// A record in `segment` no longer counts as live.
    pub fn sub_live(&mut self, segment: u32, bytes: u64) {
        if let Some(s) = self.segments.get_mut(segment) {
            s.live_bytes = s.live_bytes.saturating_sub(bytes);
        }
    }

    /// `owner`'s record now rests in `segment` (written, copied or recovered there). The list
    /// is the tier's per-record owner map: never checked by the tier, handed back by a reclaim.
    pub fn add_resident(&mut self, segment: u32, owner: u64) {
        if let Some(residents) = self.residents.get_mut(segment as usize) {
            residents.push(owner);
        }
    }

    /// A caller reads `segment` (through `read` or otherwise): it is not reused until
    /// `drop_reader`.
    pub fn add_reader(&mut self, segment: u32) {
        if let Some(s) = self.segments.get_mut(segment) {
            s.readers += 1;
        }
    }

    pub fn drop_reader(&mut self, segment: u32) {
        if let Some(s) = self.segments.get_mut(segment) {
            s.readers = s.readers.saturating_sub(1);
        }
    }

    // ---- placement --------------------------------------------------------------------------

    /// Places a record of `record_bytes`. Only relocation copies may open the last free segment,
    /// so a reclaim always has room to finish; while a reclaim copies a segment's live records
    /// forward, other writes leave the open segment's room to them once the spare is taken. Queues the segment header write when the record opens a segment.
    pub fn place(&mut self, record_bytes: u64, relocation: bool) -> Placement {
        if self.failed {
            return Placement::Full;
        }
        if let Some(segment) = self.reclaiming().filter(|_| !relocation) {
            let still_to_copy = self.segments.get(segment).map_or(0, |s| s.live_bytes);
            let room = self.segments.open_room();
            if self.segments.usable_free_count() == 0 && room.saturating_sub(record_bytes) < still_to_copy {
                self.space_wanted = true;
                return Placement::Full;
            }
        }
        let append = match self.segments.append(record_bytes, relocation) {
            Ok(append) => append,
            Err(AppendError::TooLarge) => return Placement::TooLarge,
            Err(AppendError::Full) => {
                self.space_wanted = true;
                return Placement::Full;
            }
        };
        if append.opens_segment {
            let order = self.next_order;
            self.next_order += 1;
            self.write_segment_header(append.location.segment, append.location.epoch, order);
        }
        Placement::At(append.location)
    }

    /// A placed record that will never be written: a hole in its segment, handled as a failed
    /// write (recovery stops at a hole, so nothing after it may be acknowledged as durable).
    pub fn abandon(&mut self, location: SsdLocation) {
        if let Some(s) = self.segments.get_mut(location.segment) {
            s.writes_in_flight += 1;
        }
        self.end_write(location, false);
    }

    fn scratch_block(&self, block: u64) -> Option<NonNull<u8>> {
        let blocks = self.config.scratch_bytes() / BLOCK_BYTES;
        // SAFETY: `block` is inside the scratch region (`new`'s contract), so the offset stays
        // inside one allocation.
        (block < blocks).then(|| unsafe { self.scratch.add((block * BLOCK_BYTES) as usize) })
    }

    fn write_segment_header(&mut self, segment: u32, epoch: u64, order: u64) {
        self.residents[segment as usize].clear();
        let log = &mut self.logs[segment as usize];
        *log = SegmentLog::default();
        log.uncovered.insert(0);
        let Some(ptr) = self.scratch_block(u64::from(segment)) else {
            self.logs[segment as usize].broken_at = Some(0);
            return;
        };
        // SAFETY: this scratch block belongs to `segment` alone and no write of it is in flight
        // (the segment was free and quiescent until now).
        let block = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), BLOCK_BYTES as usize) };
        if record::encode(block, RecordKind::SegmentHeader, &[], &[], order, epoch).is_err() {
            self.logs[segment as usize].broken_at = Some(0);
            return;
        }
        self.queue_block0_write(IoKind::Header { segment }, segment, ptr);
    }

    /// Writes a segment's header again after its write or its sync failed: until a new header
    /// is durable, the old one (of the segment's previous life) may still be valid on disk. The
    /// segment stays broken (its records are never acknowledged), but its old records can no
    /// longer return, and later reclaims are not held up by its header.
    fn rewrite_segment_header(&mut self, segment: u32) {
        let log = &mut self.logs[segment as usize];
        log.header_written = false;
        log.header_tries += 1;
        if log.header_tries >= WRITE_TRIES {
            tracing::error!(segment, "a segment header could not be written; the SSD tier stops taking writes");
            self.fail();
            return;
        }
        log.uncovered.insert(0);
        if let Some(ptr) = self.scratch_block(u64::from(segment)) {
            self.queue_block0_write(IoKind::Header { segment }, segment, ptr);
        }
    }

    // ---- writes and reads -------------------------------------------------------------------

    /// Writes a record image to its placement. `Done { tag }` follows once the write completed
    /// (or failed); the record then counts as live in its segment.
    ///
    /// # Safety
    /// `image` must hold `location.record_bytes` readable bytes that stay valid and unchanged
    /// until the `Done` event for `tag`.
    pub unsafe fn write_record(&mut self, location: SsdLocation, image: NonNull<u8>, tag: u64) {
        self.begin_write(location);
        let (file, offset, len) = (location.segment, location.offset, location.record_bytes);
        let io = Io { kind: IoKind::Record { tag, location }, file, offset, ptr: image, total: len, done: 0 };
        let token = self.ios.insert(io) as u64;
        self.outbox.push_back(write_op(token, file, image, offset, len));
    }

    /// A placed record is about to be written (in chunks): it counts as in flight and as
    /// uncovered until a sync covers it. `end_write` ends it.
    pub fn begin_write(&mut self, location: SsdLocation) {
        if let Some(s) = self.segments.get_mut(location.segment) {
            s.writes_in_flight += 1;
        }
        self.logs[location.segment as usize].uncovered.insert(location.offset);
    }

    /// Bookkeeping for a completed (or failed) write begun at `location`: a failure breaks the
    /// segment there (and seals it if it is open).
    pub fn end_write(&mut self, location: SsdLocation, ok: bool) {
        let (segment, offset) = (location.segment, location.offset);
        let open = self.segments.get(segment).is_some_and(|s| s.state == SegmentState::Open);
        if let Some(s) = self.segments.get_mut(segment) {
            s.writes_in_flight = s.writes_in_flight.saturating_sub(1);
            if ok {
                s.unsynced_writes += 1;
            }
        }
        let log = &mut self.logs[segment as usize];
        if ok {
            log.completed.push(offset);
            return;
        }
        log.broken_at = Some(log.broken_at.map_or(offset, |b| b.min(offset)));
        if open {
            // Nothing appended after a hole could be recovered: move on to a new segment.
            self.segments.seal_open();
        }
        self.advance_durability(segment);
    }

    /// Writes `len` bytes at `offset` of `segment`, part of a record between `begin_write` and
    /// `end_write`. `Done { tag }` follows.
    ///
    /// # Safety
    /// `buf` must hold `len` readable bytes that stay valid and unchanged until `Done`.
    pub unsafe fn write_chunk(&mut self, segment: u32, offset: u64, buf: NonNull<u8>, len: u64, tag: u64) {
        let io = Io { kind: IoKind::Raw { tag, read: false }, file: segment, offset, ptr: buf, total: len, done: 0 };
        let token = self.ios.insert(io) as u64;
        self.outbox.push_back(write_op(token, segment, buf, offset, len));
    }

    /// Reads `len` bytes at `offset` of `segment` into `buf`. `Done { tag }` follows. The caller
    /// keeps the segment from reuse meanwhile (`add_reader`).
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes of writes, and nothing else may read or write it, until
    /// `Done`.
    pub unsafe fn read(&mut self, segment: u32, offset: u64, buf: NonNull<u8>, len: u64, tag: u64) {
        let io = Io { kind: IoKind::Raw { tag, read: true }, file: segment, offset, ptr: buf, total: len, done: 0 };
        let token = self.ios.insert(io) as u64;
        self.outbox.push_back(DiskOp {
            token,
            file: segment,
            kind: DiskOpKind::Read { buf: buf.as_ptr(), len: len.min(MAX_IO_BYTES) as u32, offset },
        });
    }

    /// Reads the record at `location` into `buf` and verifies it (checksums, epoch, and that it
    /// is `identity`'s version) before a `Loaded { tag }` event reports it. The segment is kept
    /// from reuse meanwhile.
    ///
    /// # Safety
    /// `buf` must be valid for `location.record_bytes` bytes of writes, and nothing else may read
    /// or write it, until `Loaded`.
    pub unsafe fn load(&mut self, location: SsdLocation, buf: NonNull<u8>, identity: RecordIdentity, tag: u64) {
        self.add_reader(location.segment);
        let (file, offset, len) = (location.segment, location.offset, location.record_bytes);
        let io = Io { kind: IoKind::Load { tag, location, identity }, file, offset, ptr: buf, total: len, done: 0 };
        let token = self.ios.insert(io) as u64;
        self.outbox.push_back(DiskOp {
            token,
            file,
            kind: DiskOpKind::Read { buf: buf.as_ptr(), len: len.min(MAX_IO_BYTES) as u32, offset },
        });
    }

    // ---- durability -------------------------------------------------------------------------

    /// Waits until `segment`'s durable prefix reaches `end`: a `Durability` event names `tag`
    /// as durable, or as lost if the segment broke before `end`. It may be decided at once.
    pub fn await_durable(&mut self, segment: u32, end: u64, tag: u64) {
        self.wait_durable(segment, end, tag, true);
    }

    /// `await_durable` for a record nobody waits on (a write-back): answered the same way, but
    /// it does not make a sync of its open segment due before group commit would (a sealed
    /// segment is synced at once either way).
    pub fn watch_durable(&mut self, segment: u32, end: u64, tag: u64) {
        self.wait_durable(segment, end, tag, false);
    }

    fn wait_durable(&mut self, segment: u32, end: u64, tag: u64, urgent: bool) {
        if let Some(log) = self.logs.get_mut(segment as usize) {
            log.waiters.push((end, tag, urgent));
            self.advance_durability(segment);
        }
    }

    /// Whether a record ending at `end` in `segment` is durable now.
    pub fn is_durable(&self, segment: u32, end: u64) -> bool {
        self.logs.get(segment as usize).is_some_and(|l| end <= l.durable_prefix())
    }

    /// Whether `segment` broke before `end` (a record ending there never becomes durable).
    pub fn broken_before(&self, segment: u32, end: u64) -> bool {
        self.logs.get(segment as usize).is_some_and(|l| l.broken_at.is_some_and(|b| b < end))
    }

    /// No durability wait and no tombstone is outstanding in `segment`.
    pub fn settled(&self, segment: u32) -> bool {
        self.logs.get(segment as usize).is_none_or(|l| l.waiters.is_empty() && l.tombstones.is_empty())
    }

    fn advance_durability(&mut self, segment: u32) {
        let log = &mut self.logs[segment as usize];
        let prefix = log.durable_prefix();
        let header_durable = log.header_written && !log.uncovered.contains(&0);
        let broken_at = log.broken_at;
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut log.waiters).into_iter().partition(|&(end, _, _)| end <= prefix);
        let (failed, waiting): (Vec<_>, Vec<_>) =
            waiting.into_iter().partition(|&(end, _, _)| broken_at.is_some_and(|b| end > b));
        log.waiters = waiting;
        // Durable tombstones are done; those behind a break go back to the queue.
        let (done_tombstones, left): (Vec<_>, Vec<_>) =
            std::mem::take(&mut log.tombstones).into_iter().partition(|(end, _)| *end <= prefix);
        let (lost_tombstones, undecided): (Vec<_>, Vec<_>) =
            left.into_iter().partition(|(end, _)| broken_at.is_some_and(|b| *end > b));
        log.tombstones = undecided;
        if !done_tombstones.is_empty() {
            let durable = done_tombstones.into_iter().map(|(_, t)| t.seq).collect();
            self.events.push_back(TierEvent::Tombstones { durable, skipped: Vec::new() });
        }
        if header_durable {
            if let Some(s) = self.segments.get_mut(segment) {
                s.header_durable = true;
            }
        }
        for (_, pending) in lost_tombstones {
            self.requeue_tombstone(pending);
        }
        if !ready.is_empty() || !failed.is_empty() {
            self.events.push_back(TierEvent::Durability {
                durable: ready.into_iter().map(|(_, tag, _)| tag).collect(),
                lost: failed.into_iter().map(|(_, tag, _)| tag).collect(),
            });
        }
    }

    /// Group commit: one `fdatasync` per segment with completed, unsynced writes that is due.
    /// Write-back records promise nothing, so they are synced in groups; a sync is due at once
    /// when `all` is set (clean shutdown), something waits on it (a durability wait, a tombstone,
    /// or a reclaim's copies), or its header is not durable yet. True if any was queued.
    pub fn queue_syncs(&mut self, all: bool) -> bool {
        let wanted = self.reclaim_waits();
        let due: Vec<u32> = self
            .segments
            .needing_sync()
            .filter(|&segment| {
                let log = &self.logs[segment as usize];
                let waiting = !log.tombstones.is_empty() || wanted.contains(&segment);
                self.segments.get(segment).is_some_and(|s| {
                    let open = s.state == SegmentState::Open;
                    let waited = log.waiters.iter().any(|&(_, _, urgent)| urgent || !open);
                    all || waiting || waited || !s.header_durable || s.unsynced_writes >= WRITE_BACK_SYNC_EVERY_WRITES
                })
            })
            .collect();
        for &segment in &due {
            let covers = std::mem::take(&mut self.logs[segment as usize].completed);
            if let Some(s) = self.segments.get_mut(segment) {
                s.unsynced_writes = 0;
            }
            self.queue_sync(IoKind::Sync { segment, covers }, segment);
        }
        !due.is_empty()
    }

    // ---- tombstones -------------------------------------------------------------------------

    /// Queues a tombstone for `key` with sequence number `seq` (taken when the remove happened).
    /// Past the bound nothing is queued: the remove must not happen.
    pub fn queue_tombstone(&mut self, key: &[u8], seq: u64) -> Result<(), TombstoneRefused> {
        self.tombstone_room()?;
        self.tombstones.push_back(PendingTombstone { key: key.into(), seq, tries: 0 });
        Ok(())
    }

    /// Queues a tombstone even past the bound: for a key already gone from the caller's index
    /// (a put that could not be made durable), whose tombstone must not be dropped. On a failed
    /// tier it cannot be written: it counts in `tombstones_skipped`.
    pub fn must_queue_tombstone(&mut self, key: &[u8], seq: u64) {
        if self.failed {
            self.skip_tombstones(vec![seq]);
            return;
        }
        self.tombstones.push_back(PendingTombstone { key: key.into(), seq, tries: 0 });
    }

    /// The reason `queue_tombstone` would refuse, if it would.
    pub fn tombstone_room(&self) -> Result<(), TombstoneRefused> {
        if self.failed {
            return Err(TombstoneRefused::TierFailed);
        }
        if self.tombstones.len() >= self.config.max_pending_tombstones {
            return Err(TombstoneRefused::Full { limit: self.config.max_pending_tombstones });
        }
        Ok(())
    }

    /// Tombstones that will never be written (by sequence number): their keys may come back
    /// after a restart.
    fn skip_tombstones(&mut self, seqs: Vec<u64>) {
        if !seqs.is_empty() {
            self.counters.tombstones_skipped += seqs.len() as u64;
            tracing::error!(
                count = seqs.len(),
                "tombstones could not be written; their keys may come back after a restart"
            );
            self.events.push_back(TierEvent::Tombstones { durable: Vec::new(), skipped: seqs });
        }
    }

    /// The tier takes no more writes: the tombstones still queued can never be written.
    fn fail(&mut self) {
        self.failed = true;
        let queued = self.tombstones.drain(..).map(|t| t.seq).collect();
        self.skip_tombstones(queued);
    }

    /// Writes queued tombstones while blocks and segment room are free. One-block tombstones use
    /// the tier's slots; longer ones borrow caller memory through `borrow(bytes)`, which returns
    /// its address and a handle that a `BufferReleased` event gives back. Returns true if any
    /// write was queued.
    ///
    /// # Safety
    /// Memory `borrow` returns must be valid for `bytes` of writes, used by nothing else, until
    /// its `BufferReleased` event.
    pub unsafe fn pump_tombstones(&mut self, borrow: &mut dyn FnMut(u64) -> Option<(NonNull<u8>, u64)>) -> bool {
        let mut queued = false;
        while let Some(front) = self.tombstones.front() {
            let record_bytes = record::record_bytes(front.key.len(), 0);
            let (buffer, ptr) = if record_bytes == BLOCK_BYTES {
                let Some(slot) = self.tombstone_free.pop() else { break };
                let ptr = self.scratch_block(u64::from(self.config.segments) + 1 + slot as u64);
                (TombstoneBuffer::Slot(slot), ptr)
            } else {
                let Some((ptr, handle)) = borrow(record_bytes) else { break };
                (TombstoneBuffer::Borrowed(handle), Some(ptr))
            };
            let location = match self.place(record_bytes, false) {
                Placement::At(location) => location,
                Placement::Full | Placement::TooLarge => {
                    self.release_tombstone_buffer(buffer);
                    break;
                }
            };
            let Some(pending) = self.tombstones.pop_front() else { break };
            let encoded = ptr.is_some_and(|ptr| {
                // SAFETY: the block was taken from the free slots (or borrowed) for this
                // tombstone alone; no other write uses it until its completion returns it.
                let block = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), record_bytes as usize) };
                record::encode(block, RecordKind::Tombstone, &pending.key, &[], pending.seq, location.epoch).is_ok()
            });
            let Some(ptr) = ptr.filter(|_| encoded) else {
                self.release_tombstone_buffer(buffer);
                self.abandon(location);
                self.skip_tombstones(vec![pending.seq]);
                continue;
            };
            self.begin_write(location);
            let (file, offset) = (location.segment, location.offset);
            let io = Io {
                kind: IoKind::Tombstone { buffer, location, pending },
                file,
                offset,
                ptr,
                total: record_bytes,
                done: 0,
            };
            let token = self.ios.insert(io) as u64;
            self.outbox.push_back(write_op(token, file, ptr, offset, record_bytes));
            self.counters.tombstones += 1;
            queued = true;
        }
        queued
    }

    /// A tombstone whose write failed, or whose segment broke before it was durable, is
    /// written again elsewhere (a bounded number of times: a disk failing every write loses it,
    /// counted and logged).
    fn requeue_tombstone(&mut self, mut pending: PendingTombstone) {
        pending.tries += 1;
        if pending.tries < WRITE_TRIES && !self.failed {
            self.tombstones.push_front(pending);
        } else {
            self.skip_tombstones(vec![pending.seq]);
        }
    }

    fn release_tombstone_buffer(&mut self, buffer: TombstoneBuffer) {
        match buffer {
            TombstoneBuffer::Slot(slot) => self.tombstone_free.push(slot),
            TombstoneBuffer::Borrowed(handle) => self.events.push_back(TierEvent::BufferReleased { handle }),
        }
    }

    // ---- freeing segments -------------------------------------------------------------------

    /// Frees `segment` if it is the reclaim candidate (the oldest sealed segment, quiescent,
    /// every header clean). The caller moved or dropped its live records first and made sure
    /// their copies are durable. True if it was freed.
    pub fn free_segment(&mut self, segment: u32) -> bool {
        if !self.segments.reclaim(segment) {
            return false;
        }
        self.logs[segment as usize] = SegmentLog::default();
        self.residents[segment as usize].clear();
        true
    }

    /// Zeroes the header of each freed segment whose old header may still be valid, so that
    /// recovery never brings its records back once newer segments are freed too.
    pub fn invalidate_stale_headers(&mut self) {
        let stale: Vec<u32> = self.segments.stale_free().collect();
        let Some(ptr) = self.scratch_block(u64::from(self.config.segments)) else { return };
        for segment in stale {
            self.queue_block0_write(IoKind::Invalidate { segment }, segment, ptr);
        }
    }

    /// Zeroing a freed segment's header failed: it is tried again later, a bounded number of
    /// times; after that the tier takes no more writes, since no other segment may be freed while
    /// this one's old records could still be recovered.
    fn invalidation_failed(&mut self, segment: u32) {
        let log = &mut self.logs[segment as usize];
        log.header_tries += 1;
        if log.header_tries >= WRITE_TRIES && !self.failed {
            tracing::error!(segment, "a freed segment's header could not be zeroed; the SSD tier stops taking writes");
            self.fail();
        }
    }

    // ---- operations -------------------------------------------------------------------------

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

    /// Advances the operation a completion belongs to (a short transfer continues). Unknown
    /// tokens are ignored. `owners` is asked about records a reclaim copies.
    pub fn on_completion(&mut self, completion: DiskCompletion, owners: &mut dyn RecordOwners) {
        let token = completion.token as usize;
        let Some(io) = self.ios.get_mut(token) else {
            tracing::warn!(token, "completion for an unknown disk operation");
            return;
        };
        let failed = completion.result < 0;
        let syncs = matches!(io.kind, IoKind::Sync { .. } | IoKind::InvalidateSync { .. });
        if !failed && !syncs {
            let n = completion.result as u64;
            if n == 0 {
                // EOF or a zero-length transfer: never progress, so treat as an I/O error.
                return self.finish_io(token, Err(IoFailure::NoProgress), owners);
            }
            io.done += n;
            if io.done < io.total {
                // Short read or write: submit the rest.
                self.counters.short_io += 1;
                let rest = (io.total - io.done).min(MAX_IO_BYTES);
                // SAFETY: done < total, so the pointer stays inside the operation's buffer.
                let ptr = unsafe { io.ptr.as_ptr().add(io.done as usize) };
                let offset = io.offset + io.done;
                let kind = match io.kind {
                    IoKind::Raw { read: true, .. } | IoKind::Load { .. } | IoKind::LoadPiece { .. } => {
                        DiskOpKind::Read { buf: ptr, len: rest as u32, offset }
                    }
                    _ => DiskOpKind::Write { buf: ptr.cast_const(), len: rest as u32, offset },
                };
                let file = io.file;
                self.outbox.push_back(DiskOp { token: token as u64, file, kind });
                return;
            }
        }
        let result = if failed {
            self.counters.io_errors += 1;
            Err(IoFailure::Errno(-completion.result as i32))
        } else {
            Ok(())
        };
        self.finish_io(token, result, owners);
    }

    fn finish_io(&mut self, token: usize, result: Result<(), IoFailure>, owners: &mut dyn RecordOwners) {
        let io = self.ios.remove(token);
        let ok = result.is_ok();
        match io.kind {
            IoKind::Header { segment } => {
                if ok {
                    self.logs[segment as usize].header_written = true;
                }
                self.end_write(SsdLocation { segment, offset: 0, record_bytes: BLOCK_BYTES, epoch: 0 }, ok);
                if !ok {
                    self.rewrite_segment_header(segment);
                }
            }
            IoKind::Tombstone { buffer, location, pending } => {
                self.release_tombstone_buffer(buffer);
                if ok {
                    let end = location.offset + location.record_bytes;
                    self.logs[location.segment as usize].tombstones.push((end, pending));
                    self.end_write(location, true);
                    self.advance_durability(location.segment);
                } else {
                    self.end_write(location, false);
                    self.requeue_tombstone(pending);
                }
            }
            IoKind::Record { tag, location } => {
                if ok {
                    self.add_live(location.segment, location.record_bytes);
                }
                self.end_write(location, ok);
                self.events.push_back(TierEvent::Done { tag, result });
            }
            IoKind::Raw { tag: COPY_TAG, read } => self.on_copy_io(read, io.total, ok, owners),
            IoKind::Load { tag, location, identity } => {
                self.drop_reader(location.segment);
                let result = match result {
                    Err(failure) => Err(LoadFailure::Io(failure)),
                    Ok(()) => {
                        // SAFETY: the read filled `record_bytes` bytes of the caller's buffer, which
                        // the operation owned until now (`load`'s contract).
                        let image = unsafe { std::slice::from_raw_parts(io.ptr.as_ptr(), io.total as usize) };
                        verify_loaded(image, &location, &identity)
                    }
                };
                self.events.push_back(TierEvent::Loaded { tag, result });
            }
            IoKind::LoadPiece { load } => self.on_piece(load, &io, result),
            IoKind::Raw { tag, .. } => self.events.push_back(TierEvent::Done { tag, result }),
            IoKind::Sync { segment, covers } => {
                if let Some(s) = self.segments.get_mut(segment) {
                    s.sync_in_flight = false;
                }
                self.counters.syncs += 1;
                let log = &mut self.logs[segment as usize];
                if ok {
                    for offset in &covers {
                        log.uncovered.remove(offset);
                    }
                } else if let Some(&first) = covers.iter().min() {
                    // After a failed fdatasync the kernel may have dropped those pages: treat
                    // the segment as broken from the first write the sync was meant to cover.
                    log.broken_at = Some(log.broken_at.map_or(first, |b| b.min(first)));
                }
                let header_lost = !ok && covers.contains(&0);
                let open = self.segments.get(segment).is_some_and(|s| s.state == SegmentState::Open);
                if !ok && open {
                    // Nothing appended after the break could become durable: use a new segment.
                    self.segments.seal_open();
                }
                self.advance_durability(segment);
                if header_lost {
                    self.rewrite_segment_header(segment);
                }
            }
            IoKind::Invalidate { segment } => {
                if !ok {
                    self.invalidation_failed(segment);
                }
                if let Some(s) = self.segments.get_mut(segment) {
                    s.writes_in_flight -= 1;
                }
                if ok {
                    self.queue_sync(IoKind::InvalidateSync { segment }, segment);
                }
            }
            IoKind::InvalidateSync { segment } => {
                self.counters.syncs += 1;
                if !ok {
                    self.invalidation_failed(segment);
                }
                if let Some(s) = self.segments.get_mut(segment) {
                    s.sync_in_flight = false;
                    if ok && s.state == SegmentState::Free {
                        s.stale_header = false;
                    }
                }
            }
        }
    }

    // ---- recovery ---------------------------------------------------------------------------

    /// Installs segment scans (scan `i` is segment `i`) into a fresh tier: the segments found
    /// are sealed oldest first, and the newest record of each key wins (a tombstone keeps it
    /// removed). The winners' bytes count as live.
    pub fn apply_scans(&mut self, scans: Vec<SegmentScan>) -> Recovered {
        let mut recovered = Recovered::default();
        let mut winners: HashMap<Vec<u8>, FoundRecord> = HashMap::new();
        let mut restored = Vec::new();
        for (segment, scan) in (0..self.segments.count()).zip(scans) {
            recovered.segments_scanned += 1;
            recovered.discarded.extend(scan.discarded.iter().map(|d| (d.segment, d.offset, d.reason.clone())));
            let Some(epoch) = scan.epoch else { continue };
            recovered.max_seq = recovered.max_seq.max(scan.header_seq);
            restored.push((segment, epoch, scan.header_seq, scan.valid_end));
            for found in scan.records {
                recovered.records += 1;
                recovered.max_seq = recovered.max_seq.max(found.seq);
                match winners.get(&found.key) {
                    Some(current) if current.seq >= found.seq => recovered.superseded += 1,
                    Some(_) => {
                        recovered.superseded += 1;
                        winners.insert(found.key.clone(), found);
                    }
                    None => {
                        winners.insert(found.key.clone(), found);
                    }
                }
            }
        }
        self.segments.restore(restored);
        self.next_order = self.next_order.max(recovered.max_seq + 1);
        // In disk order, so a recovery (and every simulator run) installs objects the same way
        // each time: a map's iteration order differs per process.
        let mut winners: Vec<FoundRecord> = winners.into_values().collect();
        winners.sort_unstable_by_key(|f| (f.location.segment, f.location.offset));
        for found in winners {
            if found.kind == RecordKind::Tombstone {
                recovered.removed_by_tombstone += 1;
                continue;
            }
            self.add_live(found.location.segment, found.location.record_bytes);
            recovered.live.push(found);
        }
        recovered
    }

    /// A one-line summary of the tier's moving parts (test failure messages).
    pub fn describe(&self) -> String {
        let segs: Vec<String> = (0..self.segments.count())
            .filter_map(|i| self.segments.get(i).map(|s| (i, s)))
            .map(|(i, s)| {
                let log = &self.logs[i as usize];
                format!(
                    "{i}:{:?} off {} live {} r{} w{} s{} hd{} stale{} waits{} tomb{} unsynced{} broken{:?}",
                    s.state,
                    s.write_offset,
                    s.live_bytes,
                    s.readers,
                    s.writes_in_flight,
                    s.sync_in_flight as u8,
                    s.header_durable as u8,
                    s.stale_header as u8,
                    log.waiters.len(),
                    log.tombstones.len(),
                    log.uncovered.len(),
                    log.broken_at,
                )
            })
            .collect();
        format!(
            "segments [{}]; reclaim {} (candidate {:?}); ios {}; tombstones {}",
            segs.join(", "),
            self.describe_reclaim(),
            self.segments.reclaim_candidate(),
            self.ios.len(),
            self.tombstones.len()
        )
    }
}

/// Checks a loaded record image: checksums, epoch, and that it is `identity`'s version.
fn verify_loaded(image: &[u8], location: &SsdLocation, identity: &RecordIdentity) -> Result<(), LoadFailure> {
    let header = record::verify(image, Some(location.epoch)).map_err(|e| LoadFailure::Corrupted(e.to_string()))?;
    let matches = header.kind == RecordKind::Put
        && header.seq == identity.seq
        && header.value_len == identity.value_len
        && record::key_of(image, &header) == &identity.key[..];
    if matches {
        Ok(())
    } else {
        Err(LoadFailure::Corrupted("record does not belong to this key".into()))
    }
}

fn write_op(token: u64, file: u32, ptr: NonNull<u8>, offset: u64, len: u64) -> DiskOp {
    let len = len.min(MAX_IO_BYTES) as u32;
    DiskOp { token, file, kind: DiskOpKind::Write { buf: ptr.as_ptr().cast_const(), len, offset } }
}

mod pieces;
mod reclaim;
#[cfg(test)]
mod tests;

use pieces::PieceLoad;
pub use pieces::LOAD_PIECES_IN_FLIGHT;

pub use reclaim::{
    CopyOutcome, CopyRequest, ReclaimStep, RecordIdentity, RecordOwners, COPY_FORWARD_UP_TO_LIVE_PERCENT,
    EAGER_RECLAIM_DEAD_PERCENT, FRUITLESS_GAIN_PERCENT, MAX_RELOCATION_FAILURES, RECLAIM_AT_FREE_SEGMENTS,
};
use reclaim::{Reclaim, COPY_TAG};
