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
const SCAN_READ_BYTES: usize = 4 << 20;

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

/// Scans segment `file` of `disk`.
pub fn scan_segment(disk: &mut dyn DiskIo, file: FileId) -> std::io::Result<SegmentScan> {
    let file_bytes = disk.file_bytes();
    let mut block = vec![0u8; BLOCK_BYTES as usize];
    read_full(disk, file, 0, &mut block)?;
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
    let mut buf = Vec::new();
    while offset + BLOCK_BYTES <= file_bytes {
        read_full(disk, file, offset, &mut block)?;
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
        buf.resize(len as usize, 0);
        let mut done = 0usize;
        while done < buf.len() {
            let n = (buf.len() - done).min(SCAN_READ_BYTES);
            read_full(disk, file, offset + done as u64, &mut buf[done..done + n])?;
            done += n;
        }
        let location = SsdLocation { segment: file, offset, record_bytes: len, epoch };
        match record::verify(&buf, Some(epoch)) {
            Ok(h) => scan.records.push(FoundRecord {
                kind: h.kind,
                key: record::key_of(&buf, &h).to_vec(),
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

fn tail(scan: &mut SegmentScan, segment: u32, offset: u64, e: RecordError, block: &[u8]) {
    // A zero block is simply the end of what was written, not damage.
    if block.iter().any(|&b| b != 0) {
        scan.discarded.push(Discarded { segment, offset, reason: format!("torn tail: {e}") });
    }
}

fn read_full(disk: &mut dyn DiskIo, file: FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
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
