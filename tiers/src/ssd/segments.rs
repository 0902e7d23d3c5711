//! A shard's segment table: which segment files are free, open for appends or sealed, their
//! epochs, write pointers and who still uses them.
//!
//! Owns space on the SSD: appends go to the one open segment, full segments are sealed in FIFO
//! order, and the oldest sealed segment is reclaimed when space runs out. It never hands out a
//! segment for reuse while a read, a write or a sync can still touch it.

use std::collections::VecDeque;

use super::record::BLOCK_BYTES;
use super::sim::SimRng;

/// Where a record lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdLocation {
    pub segment: u32,
    pub offset: u64,
    pub record_bytes: u64,
    pub epoch: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentState {
    Free,
    Open,
    Sealed,
}

#[derive(Clone, Debug)]
pub struct Segment {
    pub state: SegmentState,
    pub epoch: u64,
    pub write_offset: u64,
    pub live_bytes: u64,
    pub readers: u32,
    pub writes_in_flight: u32,
    /// Writes completed since the last sync was submitted.
    pub unsynced_writes: u32,
    pub sync_in_flight: bool,
    /// The segment header of the current epoch is durable.
    pub header_durable: bool,
    /// Free, but its previous life's header may still be valid on disk: recovery would scan its
    /// old records. Cleared once a zeroed header is durable or the segment is opened again.
    pub stale_header: bool,
}

impl Segment {
    fn free() -> Segment {
        Segment {
            state: SegmentState::Free,
            epoch: 0,
            write_offset: 0,
            live_bytes: 0,
            readers: 0,
            writes_in_flight: 0,
            unsynced_writes: 0,
            sync_in_flight: false,
            header_durable: false,
            stale_header: false,
        }
    }

    /// Nothing can touch the segment's bytes any more.
    pub fn quiescent(&self) -> bool {
        self.readers == 0 && self.writes_in_flight == 0 && !self.sync_in_flight
    }
}

/// Why an append could not be placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppendError {
    /// The record is larger than a segment can hold.
    TooLarge,
    /// Every segment is in use: reclaim the oldest sealed one first.
    Full,
}

/// A placed append. When `opens_segment` is set, the caller must also write the segment header
/// (epoch `location.epoch`) at offset 0 of `location.segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Append {
    pub location: SsdLocation,
    pub opens_segment: bool,
}

/// See the module comment.
#[derive(Debug)]
pub struct SegmentTable {
    segments: Vec<Segment>,
    segment_bytes: u64,
    open: Option<u32>,
    sealed: VecDeque<u32>,
    /// Epochs are random, never counted: a crash can lose the record of which epochs were used,
    /// and a reused epoch would let a reused segment's stale tail pass for new records.
    epochs: SimRng,
}

impl SegmentTable {
    /// `count` free segments of `segment_bytes` (a multiple of 4 KiB, at least two blocks).
    /// `epoch_seed` seeds the epoch generator (random in production, fixed in simulations).
    pub fn new(count: u32, segment_bytes: u64, epoch_seed: u64) -> SegmentTable {
        SegmentTable {
            segments: (0..count).map(|_| Segment::free()).collect(),
            segment_bytes,
            open: None,
            sealed: VecDeque::new(),
            epochs: SimRng::new(epoch_seed),
        }
    }

    /// Marks recovered segments sealed, oldest first by `order` (the sequence number their
    /// header was written with), with their valid lengths.
    /// `recovered` is (segment, epoch, order, valid_end_bytes).
    pub fn restore(&mut self, mut recovered: Vec<(u32, u64, u64, u64)>) {
        recovered.sort_by_key(|&(_, _, order, _)| order);
        for (segment, epoch, _, end) in recovered {
            if let Some(s) = self.segments.get_mut(segment as usize) {
                s.state = SegmentState::Sealed;
                s.epoch = epoch;
                s.write_offset = end;
                s.header_durable = true;
                self.sealed.push_back(segment);
            }
        }
    }

    fn fresh_epoch(&mut self, previous: u64) -> u64 {
        loop {
            let epoch = self.epochs.next_u64();
            if epoch != 0 && epoch != previous {
                return epoch;
            }
        }
    }

    /// Largest record that fits a segment (after its header block).
    pub fn max_record_bytes(&self) -> u64 {
        self.segment_bytes.saturating_sub(BLOCK_BYTES)
    }

    /// Places a record of `record_bytes`. A new segment is opened only when one is free and
    /// quiescent, and the last such one only with `take_last_free` (it is kept for relocation
    /// copies, so a reclaim always has room to finish). When that leaves nothing to reclaim, the
    /// open segment is sealed so it can be. Segments whose old header is stale are reused first:
    /// the new header invalidates their old records.
    pub fn append(&mut self, record_bytes: u64, take_last_free: bool) -> Result<Append, AppendError> {
        if record_bytes > self.max_record_bytes() || record_bytes == 0 {
            return Err(AppendError::TooLarge);
        }
        if let Some(open) = self.open {
            let s = &mut self.segments[open as usize];
            if s.write_offset + record_bytes <= self.segment_bytes {
                let location = SsdLocation { segment: open, offset: s.write_offset, record_bytes, epoch: s.epoch };
                s.write_offset += record_bytes;
                return Ok(Append { location, opens_segment: false });
            }
        }
        let usable = self.usable_free_count();
        if usable == 0 || (usable == 1 && !take_last_free) {
            if self.sealed.is_empty() {
                self.seal_open();
            }
            return Err(AppendError::Full);
        }
        let free = self
            .segments
            .iter()
            .position(|s| s.state == SegmentState::Free && s.quiescent() && s.stale_header)
            .or_else(|| self.segments.iter().position(|s| s.state == SegmentState::Free && s.quiescent()))
            .ok_or(AppendError::Full)?;
        if let Some(open) = self.open.take() {
            self.segments[open as usize].state = SegmentState::Sealed;
            self.sealed.push_back(open);
        }
        let epoch = self.fresh_epoch(self.segments[free].epoch);
        let s = &mut self.segments[free];
        *s = Segment { state: SegmentState::Open, epoch, write_offset: BLOCK_BYTES + record_bytes, ..Segment::free() };
        self.open = Some(free as u32);
        let location = SsdLocation { segment: free as u32, offset: BLOCK_BYTES, record_bytes, epoch };
        Ok(Append { location, opens_segment: true })
    }

    /// Seals the open segment (after a failed write: nothing appended after a hole is
    /// recoverable), so the next append opens a new one.
    pub fn seal_open(&mut self) {
        if let Some(open) = self.open.take() {
            self.segments[open as usize].state = SegmentState::Sealed;
            self.sealed.push_back(open);
        }
    }

    /// The oldest sealed segment, if nothing can still touch it, no newer segment's header is
    /// still unsynced, and no earlier freed segment still has a valid header on disk. Either
    /// would let a crash bring this one's old contents back while the newer records or
    /// tombstones that supersede them are lost, or bring back records of a segment freed before.
    pub fn reclaim_candidate(&self) -> Option<u32> {
        let oldest = *self.sealed.front()?;
        let headers_clean =
            self.segments
                .iter()
                .all(|s| if s.state == SegmentState::Free { !s.stale_header } else { s.header_durable });
        (self.segments[oldest as usize].quiescent() && headers_clean).then_some(oldest)
    }

    /// The oldest sealed segment, whether or not it can be reclaimed yet.
    pub fn oldest_sealed(&self) -> Option<u32> {
        self.sealed.front().copied()
    }

    /// Frees a segment returned by `reclaim_candidate` (the caller dropped its index entries).
    pub fn reclaim(&mut self, segment: u32) -> bool {
        if self.reclaim_candidate() != Some(segment) {
            return false;
        }
        self.sealed.pop_front();
        self.segments[segment as usize] = Segment { stale_header: true, ..Segment::free() };
        true
    }

    /// Free segments whose old header must be zeroed (durably) before another segment is freed.
    pub fn stale_free(&self) -> impl Iterator<Item = u32> + '_ {
        self.segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == SegmentState::Free && s.stale_header && s.quiescent())
            .map(|(i, _)| i as u32)
    }

    /// True while some free segment's old header may still be valid on disk.
    pub fn has_stale_free(&self) -> bool {
        self.segments.iter().any(|s| s.state == SegmentState::Free && s.stale_header)
    }

    pub fn get(&self, segment: u32) -> Option<&Segment> {
        self.segments.get(segment as usize)
    }

    pub fn get_mut(&mut self, segment: u32) -> Option<&mut Segment> {
        self.segments.get_mut(segment as usize)
    }

    /// Whether `location` still names a record of the segment's current life.
    pub fn is_current(&self, location: &SsdLocation) -> bool {
        self.get(location.segment).is_some_and(|s| s.state != SegmentState::Free && s.epoch == location.epoch)
    }

    /// Bytes still free at the end of the open segment (0 without one).
    pub fn open_room(&self) -> u64 {
        self.open.map_or(0, |open| self.segment_bytes.saturating_sub(self.segments[open as usize].write_offset))
    }

    /// Segments neither open nor sealed.
    pub fn free_count(&self) -> usize {
        self.segments.iter().filter(|s| s.state == SegmentState::Free).count()
    }

    /// Free segments that an append could open now (nothing in flight on them).
    pub fn usable_free_count(&self) -> usize {
        self.segments.iter().filter(|s| s.state == SegmentState::Free && s.quiescent()).count()
    }

    /// Bytes of live records in all segments.
    pub fn live_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.live_bytes).sum()
    }

    /// Bytes of all segments.
    pub fn capacity_bytes(&self) -> u64 {
        self.segment_bytes * self.segments.len() as u64
    }

    pub fn count(&self) -> u32 {
        self.segments.len() as u32
    }

    pub fn segment_bytes(&self) -> u64 {
        self.segment_bytes
    }

    /// Segments with completed writes waiting for a sync and none in flight.
    pub fn needing_sync(&self) -> impl Iterator<Item = u32> + '_ {
        self.segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.unsynced_writes > 0 && !s.sync_in_flight)
            .map(|(i, _)| i as u32)
    }

    /// Bytes written into non-free segments.
    pub fn used_bytes(&self) -> u64 {
        self.segments.iter().filter(|s| s.state != SegmentState::Free).map(|s| s.write_offset).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_fill_segments_in_order_and_reclaim_oldest_first() {
        let mut t = SegmentTable::new(2, 4 * BLOCK_BYTES, 1);
        let a = t.append(BLOCK_BYTES, true).expect("a");
        assert!(a.opens_segment);
        assert_eq!((a.location.segment, a.location.offset), (0, BLOCK_BYTES));
        let b = t.append(2 * BLOCK_BYTES, true).expect("b");
        assert!(!b.opens_segment);
        let c = t.append(2 * BLOCK_BYTES, true).expect("c opens segment 1");
        assert_eq!(c.location.segment, 1);
        assert_ne!(c.location.epoch, a.location.epoch);
        assert_eq!(t.append(3 * BLOCK_BYTES, true), Err(AppendError::Full));
        assert_eq!(t.append(4 * BLOCK_BYTES, true), Err(AppendError::TooLarge));
        // Headers not yet durable: no reclaim.
        assert_eq!(t.reclaim_candidate(), None);
        for s in 0..2 {
            t.get_mut(s).expect("seg").header_durable = true;
        }
        // A reader pins segment 0.
        t.get_mut(0).expect("seg").readers = 1;
        assert_eq!(t.reclaim_candidate(), None);
        t.get_mut(0).expect("seg").readers = 0;
        assert_eq!(t.reclaim_candidate(), Some(0));
        assert!(t.reclaim(0));
        assert!(!t.is_current(&a.location));
        let d = t.append(3 * BLOCK_BYTES, true).expect("d reuses segment 0");
        assert_eq!((d.location.segment, d.opens_segment), (0, true));
        assert_ne!(d.location.epoch, a.location.epoch, "a reused segment gets a new epoch");
    }

    #[test]
    fn restore_orders_by_header_sequence() {
        let mut t = SegmentTable::new(3, 8 * BLOCK_BYTES, 1);
        t.restore(vec![(0, 77, 9, 2 * BLOCK_BYTES), (2, 12, 5, 3 * BLOCK_BYTES)]);
        assert_eq!(t.oldest_sealed(), Some(2));
        let a = t.append(BLOCK_BYTES, true).expect("append");
        assert_eq!(a.location.segment, 1);
    }

    #[test]
    fn the_last_free_segment_is_kept_for_relocation_copies() {
        let mut t = SegmentTable::new(3, 4 * BLOCK_BYTES, 1);
        t.append(3 * BLOCK_BYTES, false).expect("opens segment 0");
        t.append(3 * BLOCK_BYTES, false).expect("opens segment 1 (two were free)");
        assert_eq!(t.append(3 * BLOCK_BYTES, false), Err(AppendError::Full), "the spare is not for writes");
        let copy = t.append(3 * BLOCK_BYTES, true).expect("a relocation copy takes the spare");
        assert_eq!(copy.location.segment, 2);
        assert_eq!(t.open_room(), 0, "header and copy fill segment 2");
    }

    #[test]
    fn a_freed_segment_with_a_stale_header_blocks_the_next_reclaim_until_zeroed_or_reused() {
        let mut t = SegmentTable::new(4, 2 * BLOCK_BYTES, 1);
        for _ in 0..4 {
            t.append(BLOCK_BYTES, true).expect("one record per segment");
        }
        for s in 0..4 {
            t.get_mut(s).expect("seg").header_durable = true;
        }
        assert_eq!(t.reclaim_candidate(), Some(0));
        assert!(t.reclaim(0));
        assert!(t.has_stale_free());
        assert_eq!(t.stale_free().collect::<Vec<_>>(), vec![0]);
        assert_eq!(t.reclaim_candidate(), None, "segment 0's old records could still be recovered");
        // Zeroing it (durably) clears the way.
        t.get_mut(0).expect("seg").stale_header = false;
        assert_eq!(t.reclaim_candidate(), Some(1));
        assert!(t.reclaim(1));
        // Reusing a stale segment invalidates it too: it is opened first.
        let a = t.append(2 * BLOCK_BYTES - BLOCK_BYTES, true).expect("append");
        assert_eq!((a.location.segment, a.opens_segment), (1, true));
        assert!(!t.has_stale_free());
    }
}
