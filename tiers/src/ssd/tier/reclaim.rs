//! Freeing the oldest segment: when one is due, which records it copies forward, the copies of
//! records that rest only on SSD (segment to segment through the staging buffer, checked chunk
//! by chunk), and freeing the segment once every copy is durable.
//!
//! Owns the reclaim in progress and its copies. Never frees a segment whose copies are not
//! durable, never writes a copy whose source header does not belong to the record asked for
//! (a rotten source must not end the destination segment's scan), and never decides about a
//! record itself: the caller (which knows the records' owners) says what each one becomes.

use std::collections::VecDeque;

use super::{Placement, SsdTier, TierEvent};
use crate::ssd::record::{self, RecordChecker, RecordHeader, RecordKind, BLOCK_BYTES, HEADER_BYTES};
use crate::ssd::segments::SsdLocation;

/// A reclaim starts ahead of demand when this many free segments (or fewer) are left and the
/// oldest segment is at least `EAGER_RECLAIM_DEAD_PERCENT` dead space; it starts on demand when
/// a write found no room. The last free segment is kept for relocation copies.
pub const RECLAIM_AT_FREE_SEGMENTS: usize = 2;
pub const EAGER_RECLAIM_DEAD_PERCENT: u64 = 25;
/// A reclaim that frees less than this share of a segment (net of its copies) gained nothing.
pub const FRUITLESS_GAIN_PERCENT: u64 = 10;
/// While the tier holds at most this share of live bytes, a reclaimed segment's live records are
/// all copied forward (a mostly dead tier never evicts); above it, its cold records (SSD only,
/// not pinned) leave the cache, oldest first.
pub const COPY_FORWARD_UP_TO_LIVE_PERCENT: u64 = 80;
/// Relocation failures in one reclaim after which the rest of its records leave the cache
/// instead (a failing disk must not keep a reclaim going forever).
pub const MAX_RELOCATION_FAILURES: u32 = 8;

/// What a record on SSD must be for a copy of it to go ahead: its header and key are checked
/// against this as the first chunks arrive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordIdentity {
    pub seq: u64,
    pub value_len: u64,
    pub key: Box<[u8]>,
}

/// A record to copy forward through the staging buffer.
#[derive(Clone, Debug)]
pub struct CopyRequest {
    pub owner: u64,
    pub src: SsdLocation,
    pub identity: RecordIdentity,
}

/// The owners of records, as the tier sees them: asked just before a copy starts and when its
/// first chunk arrived.
pub trait RecordOwners {
    /// Whether `owner`'s record at `src` should be copied now. If so, the owner is held (not
    /// freed, not loaded) until the copy's `CopyFinished`.
    fn claim_copy(&mut self, owner: u64, src: SsdLocation) -> bool;
    /// Whether `owner` (held by its copy) still rests at a record that matters (it was not
    /// removed or replaced meanwhile).
    fn still_wanted(&self, owner: u64) -> bool;
}

/// How a copy through the staging buffer ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyOutcome {
    /// Every chunk arrived intact at `dst` (written, not yet durable). If the owner still rests
    /// at `src`, the caller moves it (`track_copy`); the reclaim frees the segment only once
    /// the copy is durable.
    Copied { dst: SsdLocation },
    /// The source failed its checks (or a chunk its checksum): the record is lost.
    Corrupted(String),
    /// A read or write failed (or the shutdown deadline passed): counts towards giving up.
    Failed(String),
    /// No room for the copy, and none coming.
    NoRoom,
    /// No room yet (the spare segment is being zeroed): the request went back to the queue.
    RetryLater,
    /// The owner no longer wanted it (removed or replaced): nothing was written.
    NotWanted,
}

/// The reclaim in progress. See the module comment.
pub(super) struct Reclaim {
    pub(super) segment: u32,
    /// Copy SSD-only records forward too (else they leave the cache).
    copy_cold: bool,
    /// Rewrites from the caller's memory in flight.
    writes: u32,
    /// SSD-only records waiting for the staging buffer.
    queue: VecDeque<CopyRequest>,
    copy: Option<CopyJob>,
    /// The copies made. The old segment is freed only once all of them are durable, so a crash
    /// never loses a record that was durable before; a copy its segment's break made undurable
    /// is undone (`CopyLost`) and made anew.
    copies: Vec<Copied>,
    failures: u32,
}

/// A record copied forward by a reclaim.
#[derive(Clone, Copy, Debug)]
struct Copied {
    owner: u64,
    src: SsdLocation,
    dst: SsdLocation,
}

impl Copied {
    fn end(&self) -> u64 {
        self.dst.offset + self.dst.record_bytes
    }
}

/// An SSD-only record moving from `src` to `dst` through the staging buffer, chunk by chunk.
/// The destination is placed only after the first chunk's header checked out.
struct CopyJob {
    request: CopyRequest,
    dst: Option<SsdLocation>,
    header: Option<RecordHeader>,
    /// Bytes of the record written to `dst` so far.
    copied: u64,
    /// Checks the record's checksums as its chunks pass (made once the header is read).
    checker: Option<RecordChecker>,
    key_matches: bool,
}

/// What the caller does next for a running reclaim (`SsdTier::reclaim_step`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReclaimStep {
    /// No reclaim runs, and none is due.
    Idle,
    /// Writes or copies are in flight: nothing to decide now.
    Busy,
    /// Decide about every record still resting in `segment`: rewrite a record the caller holds
    /// in memory (`place` as a relocation, `write_record`, `relocation_write_started`), queue a
    /// copy of one that rests only on SSD (when `copy_cold`, or for a record that must stay),
    /// or let it leave; then call `reclaim_decided`. `owners` are those registered with
    /// `add_resident` for the segment (some may have moved or gone since: the caller checks).
    Decide { segment: u32, copy_cold: bool, owners: Vec<u64> },
}

/// Tags of the tier's own copy operations have this bit set (callers' tags never do).
pub(super) const COPY_TAG: u64 = 1 << 63;

impl SsdTier {
    /// A clean shutdown began: reclaims start only for writes that wait for room.
    pub fn set_shutting_down(&mut self) {
        self.shutting_down = true;
    }

    /// Past the shutdown deadline: copies stop, nothing new starts.
    pub fn freeze(&mut self) {
        self.frozen = true;
    }

    /// A reclaim is running or can start, so a write that found no room can wait for one.
    pub fn space_coming(&self) -> bool {
        !self.failed && (self.reclaim.is_some() || self.segments.oldest_sealed().is_some())
    }

    /// The segment being reclaimed, if any.
    pub fn reclaiming(&self) -> Option<u32> {
        self.reclaim.as_ref().map(|r| r.segment)
    }

    /// Starts a reclaim when one is due (few free segments and a good share of dead space, or a
    /// write found no room), and says what the caller must do for the running one.
    pub fn reclaim_step(&mut self, owners: &mut dyn RecordOwners) -> ReclaimStep {
        if self.reclaim.is_none() && !self.start_reclaim() {
            return ReclaimStep::Idle;
        }
        let Some(r) = self.reclaim.as_ref() else { return ReclaimStep::Idle };
        if r.writes > 0 || r.copy.is_some() {
            return ReclaimStep::Busy;
        }
        if !r.queue.is_empty() {
            self.start_next_copy(owners);
            return ReclaimStep::Busy;
        }
        ReclaimStep::Decide {
            segment: r.segment,
            copy_cold: r.copy_cold && r.failures < MAX_RELOCATION_FAILURES,
            owners: self.residents[r.segment as usize].clone(),
        }
    }

    fn start_reclaim(&mut self) -> bool {
        let segments = &self.segments;
        let free = segments.usable_free_count();
        if free > RECLAIM_AT_FREE_SEGMENTS {
            return false;
        }
        let Some(segment) = segments.oldest_sealed() else { return false };
        let dead = segments.get(segment).map_or(0, |s| s.write_offset.saturating_sub(BLOCK_BYTES + s.live_bytes));
        let worth_it = dead * 100 >= segments.segment_bytes() * EAGER_RECLAIM_DEAD_PERCENT;
        // Ahead of demand only when it gains a good share of a segment: relocating a mostly
        // live segment just to keep a spare would copy the same records round and round.
        if !(free == 0 || self.space_wanted || (worth_it && !self.shutting_down)) {
            return false;
        }
        // Live records may fill the tier up to a share of it, and never beyond what leaves an
        // open and a spare segment; past that (or when reclaims keep freeing nothing for the
        // writers that wait), the oldest cold records leave instead of being copied again.
        let capacity = segments.capacity_bytes();
        let room = (capacity * COPY_FORWARD_UP_TO_LIVE_PERCENT / 100)
            .min(capacity.saturating_sub(2 * segments.segment_bytes()));
        // A whole turn of the log that gained nothing means copying is not making room.
        let copy_cold = segments.live_bytes() <= room && self.fruitless_reclaims < segments.count();
        self.space_wanted = false;
        self.reclaim = Some(Reclaim {
            segment,
            copy_cold,
            writes: 0,
            queue: VecDeque::new(),
            copy: None,
            copies: Vec::new(),
            failures: 0,
        });
        true
    }

    /// The caller started rewriting one of the reclaimed segment's records from its memory
    /// (`write_record` of a relocation placement); `relocation_write_done` ends it.
    pub fn relocation_write_started(&mut self) {
        if let Some(r) = self.reclaim.as_mut() {
            r.writes += 1;
        }
    }

    /// A relocation rewrite completed (or failed: counted towards giving up on copies).
    pub fn relocation_write_done(&mut self, ok: bool) {
        if let Some(r) = self.reclaim.as_mut() {
            r.writes = r.writes.saturating_sub(1);
            if !ok {
                r.failures += 1;
            }
        }
    }

    /// A copy or relocation failed in a way that counts towards giving up on copies.
    pub fn relocation_failed(&mut self) {
        if let Some(r) = self.reclaim.as_mut() {
            r.failures += 1;
        }
    }

    /// `owner`'s record moved from `src` (in the reclaimed segment) to `dst`: the segment is
    /// freed only once `dst` is durable.
    pub fn track_copy(&mut self, owner: u64, src: SsdLocation, dst: SsdLocation) {
        if let Some(r) = self.reclaim.as_mut() {
            r.copies.push(Copied { owner, src, dst });
        }
    }

    /// The caller decided about every record (`ReclaimStep::Decide`): `queue` holds the copies
    /// to make through the staging buffer, `busy` says some records could not be decided yet
    /// (in use: look again later). With nothing left, the segment is freed once the copies are
    /// durable.
    pub fn reclaim_decided(&mut self, queue: Vec<CopyRequest>, busy: bool, owners: &mut dyn RecordOwners) {
        let Some(r) = self.reclaim.as_mut() else { return };
        if !queue.is_empty() {
            r.queue = queue.into();
            self.start_next_copy(owners);
            return;
        }
        if r.writes > 0 || busy {
            return;
        }
        self.finish_reclaim();
    }

    /// Segments whose sync a reclaim waits for (its copies, once all are written).
    pub(super) fn reclaim_waits(&self) -> Vec<u32> {
        self.reclaim
            .as_ref()
            .filter(|r| r.writes == 0 && r.copy.is_none() && r.queue.is_empty())
            .map(|r| r.copies.iter().map(|c| c.dst.segment).collect())
            .unwrap_or_default()
    }

    /// Frees the reclaimed segment once its copies are durable and nothing can touch it. A copy
    /// behind its segment's break will never be durable: it is undone (`CopyLost`), so the owner
    /// rests at its intact old record again and the next pass copies it anew.
    fn finish_reclaim(&mut self) {
        let Some(r) = self.reclaim.as_mut() else { return };
        let segment = r.segment;
        let logs = &self.logs;
        let broken = |c: &Copied| logs[c.dst.segment as usize].broken_at.is_some_and(|b| b < c.end());
        let (lost, copies): (Vec<Copied>, Vec<Copied>) = std::mem::take(&mut r.copies).into_iter().partition(broken);
        r.copies = copies;
        let durable = r.copies.iter().all(|c| c.end() <= logs[c.dst.segment as usize].durable_prefix());
        for c in &lost {
            self.events.push_back(TierEvent::CopyLost { owner: c.owner, src: c.src, dst: c.dst });
        }
        // Commits and tombstones waiting on this segment's sync are answered first.
        if !lost.is_empty() || !durable || !self.settled(segment) || self.segments.reclaim_candidate() != Some(segment)
        {
            return;
        }
        let Some(r) = self.reclaim.take() else { return };
        let used = self.segments.get(segment).map_or(0, |s| s.write_offset);
        let owners = std::mem::take(&mut self.residents[segment as usize]);
        if self.free_segment(segment) {
            let copied: u64 = r.copies.iter().map(|c| c.dst.record_bytes).sum();
            let gain = used.saturating_sub(copied);
            if gain * 100 < self.segments.segment_bytes() * FRUITLESS_GAIN_PERCENT {
                self.fruitless_reclaims += 1;
            } else {
                self.fruitless_reclaims = 0;
            }
            self.events.push_back(TierEvent::SegmentFreed { segment, copies: r.copies.len(), owners });
        }
    }

    /// Starts copying the next queued record the owners still want: its first chunk is read
    /// into staging.
    fn start_next_copy(&mut self, owners: &mut dyn RecordOwners) {
        loop {
            if self.frozen {
                return;
            }
            let (staging, staging_bytes) = (self.staging(), self.config.staging_bytes);
            let Some(r) = self.reclaim.as_mut() else { return };
            if r.copy.is_some() {
                return;
            }
            let Some(request) = r.queue.pop_front() else { return };
            if request.src.segment != r.segment || !owners.claim_copy(request.owner, request.src) {
                continue;
            }
            let src = request.src;
            let first = src.record_bytes.min(staging_bytes);
            r.copy = Some(CopyJob { request, dst: None, header: None, copied: 0, checker: None, key_matches: true });
            self.add_reader(src.segment);
            // SAFETY: the staging buffer is the tier's own (see `new`) and only the one copy in
            // progress uses it; nothing touches it until this read completes.
            unsafe { self.read(src.segment, src.offset, staging, first, COPY_TAG) };
            return;
        }
    }

    /// A copy read or write completed.
    pub(super) fn on_copy_io(&mut self, read: bool, len: u64, ok: bool, owners: &mut dyn RecordOwners) {
        let Some(job) = self.reclaim.as_mut().and_then(|r| r.copy.take()) else { return };
        if !ok {
            let what = if read { "reading" } else { "writing" };
            return self.end_copy(job, Some(CopyOutcome::Failed(format!("{what} a relocation copy failed"))), owners);
        }
        if read {
            self.on_copy_read(job, len, owners);
        } else {
            self.on_copy_write(job, len, owners);
        }
    }

    /// A chunk of the record being copied arrived in staging: check it, then write it forward.
    fn on_copy_read(&mut self, mut job: CopyJob, len: u64, owners: &mut dyn RecordOwners) {
        let ptr = self.staging();
        // SAFETY: the read filled `len` bytes of the staging buffer, which only this copy uses.
        let chunk = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len as usize) };
        let at = job.copied;
        if job.header.is_none() {
            if !owners.still_wanted(job.request.owner) {
                // Removed or replaced meanwhile: nothing to copy.
                return self.end_copy(job, Some(CopyOutcome::NotWanted), owners);
            }
            let header = match record::decode_header(chunk) {
                Ok(h) => h,
                Err(e) => return self.end_copy(job, Some(CopyOutcome::Corrupted(e.to_string())), owners),
            };
            let (src, identity) = (job.request.src, &job.request.identity);
            let belongs = header.kind == RecordKind::Put
                && header.epoch == src.epoch
                && header.seq == identity.seq
                && header.value_len == identity.value_len
                && header.key_len as usize == identity.key.len()
                && header.record_bytes() == src.record_bytes;
            if !belongs {
                let outcome = CopyOutcome::Corrupted("record does not belong to this key".into());
                return self.end_copy(job, Some(outcome), owners);
            }
            let dst = match self.place(src.record_bytes, true) {
                Placement::At(dst) => dst,
                Placement::Full if self.room_coming() => {
                    return self.end_copy(job, Some(CopyOutcome::RetryLater), owners);
                }
                Placement::Full | Placement::TooLarge => return self.end_copy(job, Some(CopyOutcome::NoRoom), owners),
            };
            if record::restamp_epoch(chunk, dst.epoch).is_err() {
                self.abandon(dst);
                let outcome = CopyOutcome::Failed("re-stamping a checked header failed".into());
                return self.end_copy(job, Some(outcome), owners);
            }
            self.begin_write(dst);
            job.checker = Some(RecordChecker::new(header));
            job.header = Some(header);
            job.dst = Some(dst);
        }
        let (Some(header), Some(dst)) = (job.header, job.dst) else { return };
        // The checksums and the key are checked as the chunks pass.
        let key_end = (HEADER_BYTES + header.key_len as usize) as u64;
        let lo = at.max(HEADER_BYTES as u64);
        if let (Some(checker), true) = (job.checker.as_mut(), lo < at + len) {
            checker.feed(&chunk[(lo - at) as usize..]);
        }
        let (klo, khi) = (at.max(HEADER_BYTES as u64), (at + len).min(key_end));
        if klo < khi {
            let key = &job.request.identity.key;
            let want = &key[(klo - HEADER_BYTES as u64) as usize..(khi - HEADER_BYTES as u64) as usize];
            job.key_matches &= &chunk[(klo - at) as usize..(khi - at) as usize] == want;
        }
        if let Some(r) = self.reclaim.as_mut() {
            r.copy = Some(job);
        }
        // SAFETY: the chunk sits in the staging buffer, which only this copy uses; the next read
        // into it starts only after this write completed.
        unsafe { self.write_chunk(dst.segment, dst.offset + at, ptr, len, COPY_TAG) };
    }

    /// A chunk reached its new place: read the next one or finish the copy.
    fn on_copy_write(&mut self, mut job: CopyJob, len: u64, owners: &mut dyn RecordOwners) {
        job.copied += len;
        let src = job.request.src;
        if job.copied < src.record_bytes && self.frozen {
            // Out of shutdown time: stop here (the destination breaks at this record).
            return self.end_copy(job, Some(CopyOutcome::Failed("shutting down".into())), owners);
        }
        if job.copied < src.record_bytes {
            let next = (src.record_bytes - job.copied).min(self.config.staging_bytes);
            let ptr = self.staging();
            let offset = src.offset + job.copied;
            if let Some(r) = self.reclaim.as_mut() {
                r.copy = Some(job);
            }
            // SAFETY: as for the first chunk: the staging buffer is this copy's alone, and the
            // previous chunk's write from it has completed.
            unsafe { self.read(src.segment, offset, ptr, next, COPY_TAG) };
            return;
        }
        self.end_copy(job, None, owners);
    }

    /// Ends a copy (`outcome` is None when every chunk was written): the destination's write
    /// ends (a copy that stopped part-way breaks its segment there), the source is let go, and
    /// `CopyFinished` tells the caller.
    fn end_copy(&mut self, job: CopyJob, outcome: Option<CopyOutcome>, owners: &mut dyn RecordOwners) {
        let complete = outcome.is_none() && job.dst.is_some() && job.copied == job.request.src.record_bytes;
        let intact = job.checker.as_ref().is_some_and(|c| c.finish().is_ok()) && job.key_matches;
        if let Some(dst) = job.dst {
            self.end_write(dst, complete);
        }
        self.drop_reader(job.request.src.segment);
        let outcome = match (outcome, job.dst) {
            (Some(CopyOutcome::RetryLater), _) => {
                if let Some(r) = self.reclaim.as_mut() {
                    r.queue.push_front(job.request.clone());
                }
                CopyOutcome::RetryLater
            }
            (Some(outcome), _) => outcome,
            (None, Some(dst)) if complete && intact => CopyOutcome::Copied { dst },
            (None, Some(_)) if complete => CopyOutcome::Corrupted("a relocated record failed its checksum".into()),
            (None, _) => CopyOutcome::Failed("a relocation copy stopped part-way".into()),
        };
        let written_bytes = if complete { job.dst.map_or(0, |d| d.record_bytes) } else { 0 };
        // A copy that must wait for room is read again on a later pass; otherwise the next one
        // starts now.
        let next = outcome != CopyOutcome::RetryLater;
        self.events.push_back(TierEvent::CopyFinished {
            owner: job.request.owner,
            src: job.request.src,
            written_bytes,
            outcome,
        });
        if next {
            self.start_next_copy(owners);
        }
    }

    pub(super) fn describe_reclaim(&self) -> String {
        match self.reclaim.as_ref() {
            Some(r) => format!(
                "seg {} cold {} writes {} queue {} copy {} copies {} failures {}",
                r.segment,
                r.copy_cold,
                r.writes,
                r.queue.len(),
                r.copy.is_some(),
                r.copies.len(),
                r.failures
            ),
            None => "none".into(),
        }
    }
}
