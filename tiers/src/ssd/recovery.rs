//! Recovery: scan a shard's segments at open and report every record that is intact.
//!
//! Owns the scan only: reading each segment front to back, checking its header's epoch, every
//! record's checksums and epoch, and stopping at the first torn or foreign block (the torn tail).
//! A record whose header is intact but whose body rotted is skipped and reported. It never
//! decides which version of a key wins: the engine applies "highest sequence number wins".

use super::disk::{DiskIo, FileId};
use super::record::{self, RecordError, RecordKind, BLOCK_BYTES};
use super::segments::SsdLocation;

/// Largest read issued while scanning.
const SCAN_READ_BYTES: usize = 8 << 20;

/// An intact record found by the scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundRecord {
    pub kind: RecordKind,
    pub key: Vec<u8>,
    pub value_len: u64,
    pub seq: u64,
    pub location: SsdLocation,
}

/// Why some bytes were not recovered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discarded {
    pub segment: u32,
    pub offset: u64,
    pub reason: String,
}

/// The result of scanning one segment.
#[derive(Clone, Debug, Default)]
pub struct SegmentScan {
    /// None when the segment has no valid header (never used, or its header was torn).
    pub epoch: Option<u64>,
    /// The sequence number the header was written with (orders segments oldest first).
    pub header_seq: u64,
    pub records: Vec<FoundRecord>,
    /// End of the valid prefix: appends would continue here.
    pub valid_end: u64,
    /// Records skipped (rotted body) and the torn tail, if any.
    pub discarded: Vec<Discarded>,
}

/// Synchronous reads of segment files, for the scan.
pub trait ReadAt {
    fn read_at(&mut self, file: FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<usize>;
    fn file_bytes(&self) -> u64;
}

impl<T: DiskIo + ?Sized> ReadAt for T {
    fn read_at(&mut self, file: FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        DiskIo::read_at(self, file, offset, buf)
    }
    fn file_bytes(&self) -> u64 {
        DiskIo::file_bytes(self)
    }
}

/// Scans segment `file` of `disk`.
pub fn scan_segment<R: ReadAt + ?Sized>(disk: &mut R, file: FileId) -> std::io::Result<SegmentScan> {
    let file_bytes = disk.file_bytes();
    let mut reader = ScanReader { disk, file, file_bytes, window: AlignedBuf::default(), start: 0 };
    let mut block = reader.get(0, BLOCK_BYTES)?.to_vec();
    let header = match record::verify(&block, None) {
        Ok(h) if h.kind == RecordKind::SegmentHeader => h,
        // All zeroes is a never-used segment; anything else at offset 0 is a torn header.
        Ok(_) | Err(_) => {
            let mut scan = SegmentScan::default();
            if block.iter().any(|&b| b != 0) {
                scan.discarded.push(Discarded { segment: file, offset: 0, reason: "segment header unreadable".into() });
            }
            return Ok(scan);
        }
    };
    let epoch = header.epoch;
    let mut scan =
        SegmentScan { epoch: Some(epoch), header_seq: header.seq, valid_end: BLOCK_BYTES, ..SegmentScan::default() };
    let mut offset = BLOCK_BYTES;
    while offset + BLOCK_BYTES <= file_bytes {
        block.copy_from_slice(reader.get(offset, BLOCK_BYTES)?);
        let head = match record::decode_header(&block) {
            Ok(h) if h.epoch == epoch && h.kind != RecordKind::SegmentHeader => h,
            Ok(h) if h.epoch != epoch => {
                tail(&mut scan, file, offset, RecordError::StaleEpoch { expected: epoch, found: h.epoch }, &block);
                break;
            }
            Ok(_) => {
                tail(&mut scan, file, offset, RecordError::BadHeader, &block);
                break;
            }
            Err(e) => {
                tail(&mut scan, file, offset, e, &block);
                break;
            }
        };
        let len = head.record_bytes();
        if offset + len > file_bytes {
            tail(&mut scan, file, offset, RecordError::BadHeader, &block);
            break;
        }
        let record = reader.get(offset, len)?;
        let location = SsdLocation { segment: file, offset, record_bytes: len, epoch };
        match record::verify(record, Some(epoch)) {
            Ok(h) => scan.records.push(FoundRecord {
                kind: h.kind,
                key: record::key_of(record, &h).to_vec(),
                value_len: h.value_len,
                seq: h.seq,
                location,
            }),
            // The header is sound (we know the length), so skip just this record.
            Err(e) => scan.discarded.push(Discarded { segment: file, offset, reason: e.to_string() }),
        }
        offset += len;
        scan.valid_end = offset;
    }
    Ok(scan)
}

/// Sequential reads through a window of at least `SCAN_READ_BYTES`: one large read serves many
/// small records, and a record is read once, header and body together.
struct ScanReader<'d, R: ReadAt + ?Sized> {
    disk: &'d mut R,
    file: FileId,
    file_bytes: u64,
    window: AlignedBuf,
    start: u64,
}

/// A 4 KiB-aligned buffer, so scans can read with O_DIRECT (offsets and lengths are 4 KiB
/// multiples: records and segments are).
#[derive(Default)]
struct AlignedBuf {
    ptr: Option<std::ptr::NonNull<u8>>,
    len: usize,
    capacity: usize,
}

impl AlignedBuf {
    fn layout(capacity: usize) -> Option<std::alloc::Layout> {
        std::alloc::Layout::from_size_align(capacity.max(1), BLOCK_BYTES as usize).ok()
    }

    /// Resizes to `len` bytes (contents unspecified).
    fn set_len(&mut self, len: usize) -> std::io::Result<()> {
        if len > self.capacity {
            self.release();
            let layout = Self::layout(len).ok_or_else(|| std::io::Error::other("scan buffer too large"))?;
            // SAFETY: the layout has a non-zero size.
            let raw = unsafe { std::alloc::alloc(layout) };
            self.ptr = Some(std::ptr::NonNull::new(raw).ok_or_else(|| std::io::Error::other("out of memory"))?);
            self.capacity = len;
        }
        self.len = len;
        Ok(())
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self.ptr {
            // SAFETY: ptr owns `capacity >= len` bytes, and &mut self gives exclusive access.
            // Bytes a read has not written yet are only ever overwritten, never read as values.
            Some(p) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), self.len) },
            None => &mut [],
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self.ptr {
            // SAFETY: as above, shared access.
            Some(p) => unsafe { std::slice::from_raw_parts(p.as_ptr(), self.len) },
            None => &[],
        }
    }

    fn release(&mut self) {
        if let (Some(p), Some(layout)) = (self.ptr.take(), Self::layout(self.capacity)) {
            // SAFETY: p was allocated with exactly this layout in `set_len`.
            unsafe { std::alloc::dealloc(p.as_ptr(), layout) };
        }
        self.capacity = 0;
        self.len = 0;
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.release();
    }
}

impl<R: ReadAt + ?Sized> ScanReader<'_, R> {
    /// The bytes `[offset, offset + len)` of the file (the caller checked they are inside it).
    fn get(&mut self, offset: u64, len: u64) -> std::io::Result<&[u8]> {
        let inside = offset >= self.start && offset + len <= self.start + self.window.len as u64;
        if !inside {
            let want = len.max(SCAN_READ_BYTES as u64).min(self.file_bytes - offset);
            self.window.set_len(want as usize)?;
            read_full(self.disk, self.file, offset, self.window.as_mut_slice())?;
            self.start = offset;
        }
        let from = (offset - self.start) as usize;
        Ok(&self.window.as_slice()[from..from + len as usize])
    }
}

fn tail(scan: &mut SegmentScan, segment: u32, offset: u64, e: RecordError, block: &[u8]) {
    // A zero block is simply the end of what was written, not damage.
    if block.iter().any(|&b| b != 0) {
        scan.discarded.push(Discarded { segment, offset, reason: format!("torn tail: {e}") });
    }
}

fn read_full<R: ReadAt + ?Sized>(disk: &mut R, file: FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = disk.read_at(file, offset + done as u64, &mut buf[done..])?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "segment shorter than expected"));
        }
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ssd::disk::{DiskOp, DiskOpKind};
    use crate::ssd::sim::{SimDisk, SimFaults};

    fn write(disk: &mut SimDisk, offset: u64, bytes: &[u8]) {
        // SAFETY: `bytes` outlives the reap loop below, which completes the write.
        unsafe {
            disk.submit(DiskOp {
                token: 0,
                file: 0,
                kind: DiskOpKind::Write { buf: bytes.as_ptr(), len: bytes.len() as u32, offset },
            })
            .expect("submit");
        }
        let mut out = Vec::new();
        while disk.in_flight() > 0 {
            disk.reap(&mut out);
        }
    }

    fn rec(kind: RecordKind, key: &[u8], value: &[u8], seq: u64, epoch: u64) -> Vec<u8> {
        let mut buf = vec![0u8; record::record_bytes(key.len(), value.len() as u64) as usize];
        record::encode(&mut buf, kind, key, value, seq, epoch).expect("encode");
        buf
    }

    #[test]
    fn scan_finds_records_skips_rot_and_stops_at_torn_tail() {
        let mut disk = SimDisk::new(1, 64 * BLOCK_BYTES, 1, SimFaults::default());
        write(&mut disk, 0, &rec(RecordKind::SegmentHeader, &[], &[], 0, 4));
        let a = rec(RecordKind::Put, b"a", &[1u8; 5000], 10, 4);
        let b = rec(RecordKind::Put, b"b", &[2u8; 100], 11, 4);
        let c = rec(RecordKind::Tombstone, b"a", &[], 12, 4);
        let stale = rec(RecordKind::Put, b"old", &[3u8; 10], 3, 2);
        let mut at = BLOCK_BYTES;
        for r in [&a, &b, &c, &stale] {
            write(&mut disk, at, r);
            at += r.len() as u64;
        }
        disk.flip_bit(0, BLOCK_BYTES + a.len() as u64 + 70, 2); // rot inside b's body
        let scan = scan_segment(&mut disk, 0).expect("scan");
        assert_eq!(scan.epoch, Some(4));
        let keys: Vec<(&[u8], u64)> = scan.records.iter().map(|r| (r.key.as_slice(), r.seq)).collect();
        assert_eq!(keys, vec![(&b"a"[..], 10), (&b"a"[..], 12)]);
        assert_eq!(scan.records[1].kind, RecordKind::Tombstone);
        assert_eq!(scan.discarded.len(), 2, "{:?}", scan.discarded);
        assert!(scan.discarded[0].reason.contains("checksum"));
        assert!(scan.discarded[1].reason.contains("torn tail"));
        assert_eq!(scan.valid_end, BLOCK_BYTES + (a.len() + b.len() + c.len()) as u64);
    }

    #[test]
    fn empty_and_torn_header_segments_have_no_epoch() {
        let mut disk = SimDisk::new(1, 8 * BLOCK_BYTES, 1, SimFaults::default());
        let scan = scan_segment(&mut disk, 0).expect("scan");
        assert_eq!((scan.epoch, scan.discarded.len()), (None, 0));
        let mut h = rec(RecordKind::SegmentHeader, &[], &[], 0, 1);
        h[10] ^= 1;
        write(&mut disk, 0, &h);
        let scan = scan_segment(&mut disk, 0).expect("scan");
        assert_eq!((scan.epoch, scan.discarded.len()), (None, 1));
    }
}
