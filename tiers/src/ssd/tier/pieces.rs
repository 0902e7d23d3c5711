//! Progressive loads: a record read in pieces, several in flight, whose value is released block
//! by block as the front of the record arrives and passes its checks.
//!
//! Owns the pieces of each progressive load and the checking of their bytes in record order.
//! Never reports value bytes before the header, the key and the checksum table passed their
//! checks and the bytes' own block checksum matched, never reports a load good before every byte
//! did, and never ends a load (whose buffer the caller then reuses) while one of its reads is in
//! flight.

use std::collections::BTreeMap;
use std::ptr::NonNull;

use super::{Io, IoFailure, IoKind, LoadFailure, SsdTier, TierEvent};
use crate::ssd::disk::{DiskOp, DiskOpKind};
use crate::ssd::record::{self, RecordChecker, RecordKind, BLOCK_BYTES, HEADER_BYTES};
use crate::ssd::segments::SsdLocation;
use crate::ssd::tier::RecordIdentity;

/// Reads of one progressive load in flight at once.
pub const LOAD_PIECES_IN_FLIGHT: u32 = 8;

/// A record read in pieces (`SsdTier::load_progressive`).
pub(super) struct PieceLoad {
    tag: u64,
    location: SsdLocation,
    identity: RecordIdentity,
    buf: NonNull<u8>,
    piece_bytes: u64,
    /// Record offset of the next piece to read.
    next: u64,
    in_flight: u32,
    /// Pieces that arrived ahead of the checked front: start -> end (record offsets).
    landed: BTreeMap<u64, u64>,
    /// Record bytes passed to the checker, from the start.
    front: u64,
    checker: Option<RecordChecker>,
    /// The key in the record is the one asked for.
    key_matches: bool,
    /// Value bytes reported through `LoadProgress`.
    reported: u64,
    failure: Option<LoadFailure>,
}

impl SsdTier {
    /// Reads the record at `location` into `buf` in pieces of `piece_bytes` (rounded to 4 KiB),
    /// up to `LOAD_PIECES_IN_FLIGHT` at once. As the front of the record arrives and passes its
    /// checks (header, epoch, key, sequence number, the checksum table, then each value block),
    /// `LoadProgress { tag, value_bytes }` events say how much of the value is good;
    /// `Loaded { tag }` ends it like `load` does. A record without a checksum table (format
    /// version 1) reports nothing before `Loaded`. The segment is kept from reuse meanwhile.
    ///
    /// # Safety
    /// As for `load`: `buf` must be valid for `location.record_bytes` bytes of writes, and
    /// nothing else may write it, until `Loaded`. The caller may read the value bytes a
    /// `LoadProgress` reported (no read writes them again).
    pub unsafe fn load_progressive(
        &mut self,
        location: SsdLocation,
        buf: NonNull<u8>,
        identity: RecordIdentity,
        tag: u64,
        piece_bytes: u64,
    ) {
        self.add_reader(location.segment);
        let piece_bytes = (piece_bytes / BLOCK_BYTES).max(1) * BLOCK_BYTES;
        let load = self.piece_loads.insert(PieceLoad {
            tag,
            location,
            identity,
            buf,
            piece_bytes,
            next: 0,
            in_flight: 0,
            landed: BTreeMap::new(),
            front: 0,
            checker: None,
            key_matches: false,
            reported: 0,
            failure: None,
        });
        self.submit_pieces(load);
    }

    /// Progressive loads in flight.
    pub fn progressive_loads(&self) -> usize {
        self.piece_loads.len()
    }

    /// Queues reads of the load's next pieces, up to its window (none once it failed).
    fn submit_pieces(&mut self, load: usize) {
        let Some(l) = self.piece_loads.get_mut(load) else { return };
        while l.failure.is_none() && l.in_flight < LOAD_PIECES_IN_FLIGHT && l.next < l.location.record_bytes {
            let len = l.piece_bytes.min(l.location.record_bytes - l.next);
            // SAFETY: next < record_bytes, and the buffer holds record_bytes bytes (`load_progressive`).
            let ptr = unsafe { l.buf.add(l.next as usize) };
            let (file, offset) = (l.location.segment, l.location.offset + l.next);
            let io = Io { kind: IoKind::LoadPiece { load }, file, offset, ptr, total: len, done: 0 };
            let token = self.ios.insert(io) as u64;
            let kind = DiskOpKind::Read { buf: ptr.as_ptr(), len: len as u32, offset };
            self.outbox.push_back(DiskOp { token, file, kind });
            l.next += len;
            l.in_flight += 1;
        }
    }

    /// A piece's read ended (`io` is its finished operation).
    pub(super) fn on_piece(&mut self, load: usize, io: &Io, result: Result<(), IoFailure>) {
        let Some(l) = self.piece_loads.get_mut(load) else {
            tracing::warn!(load, "a piece of an unknown load finished");
            return;
        };
        l.in_flight -= 1;
        match result {
            Err(failure) => {
                l.failure.get_or_insert(LoadFailure::Io(failure));
            }
            Ok(()) => {
                let start = io.offset - l.location.offset;
                l.landed.insert(start, start + io.total);
                if let Some((value_offset, value_bytes)) = advance(l) {
                    self.events.push_back(TierEvent::LoadProgress { tag: l.tag, value_offset, value_bytes });
                }
            }
        }
        self.submit_pieces(load);
        let Some(l) = self.piece_loads.get(load) else { return };
        let over = l.in_flight == 0 && (l.failure.is_some() || l.front == l.location.record_bytes);
        if !over {
            return;
        }
        let l = self.piece_loads.remove(load);
        self.drop_reader(l.location.segment);
        let result = match (l.failure, &l.checker) {
            (Some(failure), _) => Err(failure),
            (None, Some(checker)) if l.key_matches => {
                checker.finish().map(drop).map_err(|e| LoadFailure::Corrupted(e.to_string()))
            }
            (None, _) => Err(LoadFailure::Corrupted("record does not belong to this key".into())),
        };
        self.events.push_back(TierEvent::Loaded { tag: l.tag, result });
    }
}

/// Checks the pieces that now join the checked front; returns where the value starts and the
/// value bytes good so far when that grew.
fn advance(l: &mut PieceLoad) -> Option<(u64, u64)> {
    while l.failure.is_none() {
        let Some(end) = l.landed.remove(&l.front) else { break };
        // SAFETY: the bytes [front, end) of the buffer were filled by reads that completed, and
        // no read writes them again; the buffer is valid for record_bytes bytes (`load_progressive`).
        let bytes =
            unsafe { std::slice::from_raw_parts(l.buf.as_ptr().add(l.front as usize), (end - l.front) as usize) };
        let first = l.checker.is_none();
        if first {
            match check_header(bytes, &l.location, &l.identity) {
                Ok(checker) => l.checker = Some(checker),
                Err(why) => {
                    l.failure = Some(LoadFailure::Corrupted(why));
                    break;
                }
            }
        }
        let Some(checker) = l.checker.as_mut() else { break };
        checker.feed(if first { &bytes[HEADER_BYTES..] } else { bytes });
        l.front = end;
        if checker.head_checked() && !l.key_matches {
            // SAFETY: the key lies in the checked front (head_checked: the checker passed it).
            let key = unsafe { std::slice::from_raw_parts(l.buf.as_ptr().add(HEADER_BYTES), l.identity.key.len()) };
            if key != &l.identity.key[..] {
                l.failure = Some(LoadFailure::Corrupted("record does not belong to this key".into()));
                break;
            }
            l.key_matches = true;
        }
        if let Some(e) = checker.error() {
            l.failure = Some(LoadFailure::Corrupted(e.to_string()));
            break;
        }
    }
    // Blocks checked before a failure (a later bad block, a failed read) stay good.
    let checker = l.checker.as_ref()?;
    let checked = checker.value_bytes_checked();
    (l.key_matches && checked > l.reported).then(|| {
        l.reported = checked;
        (checker.value_offset(), checked)
    })
}

/// Checks the first piece's header against what the load asked for; a checker for the rest.
fn check_header(first: &[u8], location: &SsdLocation, identity: &RecordIdentity) -> Result<RecordChecker, String> {
    let header = record::decode_header(first).map_err(|e| e.to_string())?;
    if header.epoch != location.epoch {
        return Err(record::RecordError::StaleEpoch { expected: location.epoch, found: header.epoch }.to_string());
    }
    let belongs = header.kind == RecordKind::Put
        && header.seq == identity.seq
        && header.value_len == identity.value_len
        && header.key_len as usize == identity.key.len()
        && header.record_bytes() == location.record_bytes;
    if !belongs {
        return Err("record does not belong to this key".into());
    }
    Ok(RecordChecker::new(header))
}
