//! The on-disk record format of the SSD tier.
//!
//! Owns encoding and checking of records; never does I/O. A record is 4 KiB-aligned: a 64-byte
//! header, the key, a checksum table, the value, zero padding. The header has its own CRC (so a
//! scan can skip a record whose body rotted and keep going). The table holds one CRC32 per
//! `CHECK_BLOCK_BYTES` of the value, and the header's body CRC covers the key and the table: so
//! a reader that has the front of a record can check each block of the value as it arrives and
//! use it before the rest is read (a progressive load), and a whole-record check still covers
//! every byte. Every record carries its segment's epoch: records left over from a segment's
//! previous life are told apart from new ones.
//!
//! Version 1 records (no table; the body CRC covers key and value) are still read: they are
//! checked whole, so none of their value is usable before all of it arrived.

/// O_DIRECT granularity and record alignment.
pub const BLOCK_BYTES: u64 = 4096;
/// Header length.
pub const HEADER_BYTES: usize = 64;
/// "KVTR".
pub const RECORD_MAGIC: u32 = 0x5254_564B;
/// The version this build writes; bumped whenever the layout changes.
pub const FORMAT_VERSION: u16 = 2;
/// The oldest version this build still reads.
pub const OLDEST_READABLE_VERSION: u16 = 1;
/// Longest key the format accepts.
pub const MAX_KEY_BYTES: u32 = 1 << 20;
/// log2 of the value bytes each checksum table entry covers (written into every header, so a
/// later build may choose another size and still read these records).
pub const CHECK_BLOCK_LOG2: u8 = 16;
/// Value bytes each checksum table entry covers.
pub const CHECK_BLOCK_BYTES: u64 = 1 << CHECK_BLOCK_LOG2;
/// Block sizes a header may name.
const CHECK_BLOCK_LOG2_RANGE: std::ops::RangeInclusive<u8> = 12..=30;

/// What a record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    /// The first record of a segment: its epoch.
    SegmentHeader = 1,
    /// A key and its value.
    Put = 2,
    /// A key was removed (recovery keeps it removed).
    Tombstone = 3,
}

impl RecordKind {
    fn from_u8(v: u8) -> Option<RecordKind> {
        match v {
            1 => Some(RecordKind::SegmentHeader),
            2 => Some(RecordKind::Put),
            3 => Some(RecordKind::Tombstone),
            _ => None,
        }
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub key_len: u32,
    pub value_len: u64,
    pub seq: u64,
    pub epoch: u64,
    /// The layout version this record was written in.
    pub version: u16,
    /// log2 of the value bytes per checksum table entry (0 in version 1: no table).
    check_block_log2: u8,
    body_crc: u32,
}

impl RecordHeader {
    /// Bytes the whole record occupies on disk (4 KiB multiple).
    pub fn record_bytes(&self) -> u64 {
        (self.value_offset() as u64 + self.value_len).div_ceil(BLOCK_BYTES) * BLOCK_BYTES
    }

    /// Offset of the value within the record.
    pub fn value_offset(&self) -> usize {
        HEADER_BYTES + self.key_len as usize + self.table_bytes() as usize
    }

    /// Value bytes each checksum table entry covers; None for a version 1 record (no table).
    pub fn check_block_bytes(&self) -> Option<u64> {
        (self.check_block_log2 > 0).then(|| 1u64 << self.check_block_log2)
    }

    /// Bytes of the checksum table between the key and the value.
    pub fn table_bytes(&self) -> u64 {
        self.check_block_bytes().map_or(0, |block| self.value_len.div_ceil(block) * 4)
    }

    /// CRC32 of the key and the checksum table (version 1: of key and value), as recorded.
    pub fn body_crc(&self) -> u32 {
        self.body_crc
    }
}

/// Why a record was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("not a record (bad magic)")]
    BadMagic,
    #[error("record of format version {0}, this build reads versions {OLDEST_READABLE_VERSION} to {FORMAT_VERSION}")]
    BadVersion(u16),
    #[error("record header checksum mismatch")]
    HeaderChecksum,
    #[error("record header is inconsistent (kind, lengths)")]
    BadHeader,
    #[error("record body checksum mismatch")]
    BodyChecksum,
    #[error("record value block {block} checksum mismatch")]
    BlockChecksum { block: u64 },
    #[error("record belongs to epoch {found}, segment is at epoch {expected}")]
    StaleEpoch { expected: u64, found: u64 },
    #[error("buffer of {have} bytes is shorter than the record ({need})")]
    Short { have: usize, need: usize },
}

/// Bytes of the checksum table of a value of `value_len` bytes (as this build writes it).
pub fn table_bytes(value_len: u64) -> u64 {
    value_len.div_ceil(CHECK_BLOCK_BYTES) * 4
}

/// Where the value starts in a record this build writes.
pub fn value_offset(key_len: usize, value_len: u64) -> u64 {
    HEADER_BYTES as u64 + key_len as u64 + table_bytes(value_len)
}

/// On-disk size of a record with this key and value, as this build writes it.
pub fn record_bytes(key_len: usize, value_len: u64) -> u64 {
    (value_offset(key_len, value_len) + value_len).div_ceil(BLOCK_BYTES) * BLOCK_BYTES
}

/// The largest value whose record (with a key of `key_len` bytes) fits in `record_bytes`.
pub fn largest_value(record_bytes: u64, key_len: usize) -> u64 {
    let room = record_bytes.saturating_sub(HEADER_BYTES as u64 + key_len as u64);
    // With n table entries the value may take room - 4n bytes, and n entries cover n blocks.
    let entries = room.div_ceil(CHECK_BLOCK_BYTES + 4);
    room.saturating_sub(4 * entries).min(entries * CHECK_BLOCK_BYTES)
}

/// Writes a complete record (header, key, checksum table, value, zero padding) into `out`, which
/// must be exactly `record_bytes(key.len(), value.len())` long.
pub fn encode(
    out: &mut [u8],
    kind: RecordKind,
    key: &[u8],
    value: &[u8],
    seq: u64,
    epoch: u64,
) -> Result<(), RecordError> {
    let need = record_bytes(key.len(), value.len() as u64) as usize;
    if out.len() != need {
        return Err(RecordError::Short { have: out.len(), need });
    }
    if key.len() > MAX_KEY_BYTES as usize {
        return Err(RecordError::BadHeader);
    }
    let start = value_offset(key.len(), value.len() as u64) as usize;
    out[HEADER_BYTES..HEADER_BYTES + key.len()].copy_from_slice(key);
    out[start..start + value.len()].copy_from_slice(value);
    seal_in_place(out, kind, key.len(), value.len() as u64, seq, epoch)
}

/// Writes the checksum table, the padding and the header of a record whose key and value are
/// already in place (the key right after the header, the value at `value_offset`): the
/// zero-copy path, where the caller copied the value into the record buffer.
pub fn seal_in_place(
    record: &mut [u8],
    kind: RecordKind,
    key_len: usize,
    value_len: u64,
    seq: u64,
    epoch: u64,
) -> Result<(), RecordError> {
    let need = record_bytes(key_len, value_len) as usize;
    if record.len() != need || key_len > MAX_KEY_BYTES as usize {
        return Err(RecordError::Short { have: record.len(), need });
    }
    let key_end = HEADER_BYTES + key_len;
    let start = value_offset(key_len, value_len) as usize;
    let end = start + value_len as usize;
    let (head, rest) = record.split_at_mut(start);
    for (entry, block) in
        head[key_end..].chunks_exact_mut(4).zip(rest[..value_len as usize].chunks(CHECK_BLOCK_BYTES as usize))
    {
        entry.copy_from_slice(&crc32fast::hash(block).to_le_bytes());
    }
    record[end..].fill(0);
    let body_crc = crc32fast::hash(&record[HEADER_BYTES..start]);
    let header = RecordHeader {
        kind,
        key_len: key_len as u32,
        value_len,
        seq,
        epoch,
        version: FORMAT_VERSION,
        check_block_log2: CHECK_BLOCK_LOG2,
        body_crc,
    };
    write_header(&mut record[..HEADER_BYTES], &header);
    Ok(())
}

/// Re-stamps the header at the start of `record` with another segment's epoch (a record copied
/// forward into a new segment), keeping everything else (version, lengths, sequence number,
/// checksums).
pub fn restamp_epoch(record: &mut [u8], epoch: u64) -> Result<RecordHeader, RecordError> {
    let mut header = decode_header(record)?;
    header.epoch = epoch;
    write_header(&mut record[..HEADER_BYTES], &header);
    Ok(header)
}

fn write_header(out: &mut [u8], h: &RecordHeader) {
    out.fill(0);
    out[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    out[4..6].copy_from_slice(&h.version.to_le_bytes());
    out[6] = h.kind as u8;
    out[7] = h.check_block_log2;
    out[8..12].copy_from_slice(&h.key_len.to_le_bytes());
    out[16..24].copy_from_slice(&h.value_len.to_le_bytes());
    out[24..32].copy_from_slice(&h.seq.to_le_bytes());
    out[32..40].copy_from_slice(&h.epoch.to_le_bytes());
    out[40..44].copy_from_slice(&h.body_crc.to_le_bytes());
    let header_crc = crc32fast::hash(&out[..60]);
    out[60..64].copy_from_slice(&header_crc.to_le_bytes());
}

/// Decodes and checks a header (not the body).
pub fn decode_header(buf: &[u8]) -> Result<RecordHeader, RecordError> {
    if buf.len() < HEADER_BYTES {
        return Err(RecordError::Short { have: buf.len(), need: HEADER_BYTES });
    }
    let u32_at = |o: usize| u32::from_le_bytes([buf[o], buf[o + 1], buf[o + 2], buf[o + 3]]);
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&buf[o..o + 8]);
        u64::from_le_bytes(b)
    };
    if u32_at(0) != RECORD_MAGIC {
        return Err(RecordError::BadMagic);
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if crc32fast::hash(&buf[..60]) != u32_at(60) {
        return Err(RecordError::HeaderChecksum);
    }
    if !(OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(RecordError::BadVersion(version));
    }
    let kind = RecordKind::from_u8(buf[6]).ok_or(RecordError::BadHeader)?;
    let check_block_log2 = buf[7];
    let table_ok =
        if version == 1 { check_block_log2 == 0 } else { CHECK_BLOCK_LOG2_RANGE.contains(&check_block_log2) };
    let key_len = u32_at(8);
    let value_len = u64_at(16);
    let consistent = table_ok
        && match kind {
            RecordKind::SegmentHeader => key_len == 0 && value_len == 0,
            RecordKind::Put => key_len > 0 && key_len <= MAX_KEY_BYTES && value_len < (1 << 48),
            RecordKind::Tombstone => key_len > 0 && key_len <= MAX_KEY_BYTES && value_len == 0,
        };
    if !consistent {
        return Err(RecordError::BadHeader);
    }
    Ok(RecordHeader {
        kind,
        key_len,
        value_len,
        seq: u64_at(24),
        epoch: u64_at(32),
        version,
        check_block_log2,
        body_crc: u32_at(40),
    })
}

/// Checks a record's bytes as they arrive in order, after its header was decoded: the key and
/// the checksum table against the body CRC, then each block of the value against its table
/// entry, so the value's front can be used before its end arrived. A version 1 record has no
/// table: none of its value counts as checked before all of it passed.
pub struct RecordChecker {
    header: RecordHeader,
    /// Record offset of the next byte to feed.
    at: u64,
    body: crc32fast::Hasher,
    table: Vec<u8>,
    block: crc32fast::Hasher,
    body_ok: bool,
    /// Value bytes that passed their checks.
    checked: u64,
    failed: Option<RecordError>,
}

impl RecordChecker {
    /// A checker for the record `header` describes; feed it from the byte after the header.
    pub fn new(header: RecordHeader) -> RecordChecker {
        let mut checker = RecordChecker {
            header,
            at: HEADER_BYTES as u64,
            body: crc32fast::Hasher::new(),
            table: Vec::with_capacity(header.table_bytes() as usize),
            block: crc32fast::Hasher::new(),
            body_ok: false,
            checked: 0,
            failed: None,
        };
        checker.check_body_if_due();
        checker
    }

    /// Where the body CRC's bytes end: after the table (version 2) or the value (version 1).
    fn body_end(&self) -> u64 {
        let value_start = self.header.value_offset() as u64;
        if self.header.check_block_bytes().is_some() {
            value_start
        } else {
            value_start + self.header.value_len
        }
    }

    fn check_body_if_due(&mut self) {
        if self.body_ok || self.failed.is_some() || self.at != self.body_end() {
            return;
        }
        if self.body.clone().finalize() != self.header.body_crc {
            self.failed = Some(RecordError::BodyChecksum);
            return;
        }
        self.body_ok = true;
        if self.header.check_block_bytes().is_none() {
            self.checked = self.header.value_len;
        }
    }

    /// Feeds the next bytes of the record, in order, starting right after the header. Bytes past
    /// the value (padding) are ignored.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        let value_start = self.header.value_offset() as u64;
        let value_end = value_start + self.header.value_len;
        let key_end = (HEADER_BYTES + self.header.key_len as usize) as u64;
        while !bytes.is_empty() && self.failed.is_none() && self.at < value_end.max(self.body_end()) {
            if self.at < self.body_end() {
                let n = (bytes.len() as u64).min(self.body_end() - self.at) as usize;
                let (part, rest) = bytes.split_at(n);
                self.body.update(part);
                if self.header.check_block_bytes().is_some() && self.at + n as u64 > key_end {
                    let from = key_end.saturating_sub(self.at) as usize;
                    self.table.extend_from_slice(&part[from..]);
                }
                self.at += n as u64;
                bytes = rest;
                self.check_body_if_due();
                continue;
            }
            let Some(block_bytes) = self.header.check_block_bytes() else { return };
            let pos = self.at - value_start;
            let block = pos / block_bytes;
            let block_end = ((block + 1) * block_bytes).min(self.header.value_len);
            let n = (bytes.len() as u64).min(block_end - pos) as usize;
            let (part, rest) = bytes.split_at(n);
            self.block.update(part);
            self.at += n as u64;
            bytes = rest;
            if pos + n as u64 == block_end {
                let hasher = std::mem::replace(&mut self.block, crc32fast::Hasher::new());
                let entry = block as usize * 4;
                let want = self.table.get(entry..entry + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                if want == Some(hasher.finalize()) {
                    self.checked = block_end;
                } else {
                    self.failed = Some(RecordError::BlockChecksum { block });
                }
            }
        }
    }

    /// Bytes from the front of the value that passed their checks (and the key and table
    /// before them did). A block that fails stops the front before it; the blocks before it
    /// stay good.
    pub fn value_bytes_checked(&self) -> u64 {
        if self.body_ok {
            self.checked
        } else {
            0
        }
    }

    /// Where the value starts in the record.
    pub fn value_offset(&self) -> u64 {
        self.header.value_offset() as u64
    }

    /// The key (and table) passed the body CRC: the key bytes fed so far are the record's
    /// (whatever a later block does).
    pub fn head_checked(&self) -> bool {
        self.body_ok
    }

    /// The first check that failed, if one did.
    pub fn error(&self) -> Option<RecordError> {
        self.failed
    }

    /// The header, once every byte of the body and value passed; else why not.
    pub fn finish(&self) -> Result<RecordHeader, RecordError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let need = (self.header.value_offset() as u64 + self.header.value_len) as usize;
        if !self.body_ok || self.checked < self.header.value_len || (self.at as usize) < need {
            return Err(RecordError::Short { have: self.at as usize, need });
        }
        Ok(self.header)
    }
}

/// Checks a whole record read back from disk (header, epoch, checksums) and returns its header.
pub fn verify(record: &[u8], expected_epoch: Option<u64>) -> Result<RecordHeader, RecordError> {
    let header = decode_header(record)?;
    if let Some(expected) = expected_epoch {
        if header.epoch != expected {
            return Err(RecordError::StaleEpoch { expected, found: header.epoch });
        }
    }
    let value_end = header.value_offset() + header.value_len as usize;
    if record.len() < value_end {
        return Err(RecordError::Short { have: record.len(), need: value_end });
    }
    let mut checker = RecordChecker::new(header);
    checker.feed(&record[HEADER_BYTES..value_end]);
    checker.finish()
}

/// The key of a verified record.
pub fn key_of<'a>(record: &'a [u8], header: &RecordHeader) -> &'a [u8] {
    &record[HEADER_BYTES..HEADER_BYTES + header.key_len as usize]
}

/// The value of a verified record.
pub fn value_of<'a>(record: &'a [u8], header: &RecordHeader) -> &'a [u8] {
    let start = header.value_offset();
    &record[start..start + header.value_len as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &[u8], value: &[u8], seq: u64, epoch: u64) -> Vec<u8> {
        let mut buf = vec![0xFFu8; record_bytes(key.len(), value.len() as u64) as usize];
        encode(&mut buf, RecordKind::Put, key, value, seq, epoch).expect("encode");
        buf
    }

    #[test]
    fn roundtrip_and_alignment() {
        let value: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let buf = record(b"key-1", &value, 42, 7);
        assert_eq!(buf.len() % BLOCK_BYTES as usize, 0);
        let h = verify(&buf, Some(7)).expect("valid");
        assert_eq!((h.kind, h.seq, h.epoch, h.value_len), (RecordKind::Put, 42, 7, 10_000));
        assert_eq!(key_of(&buf, &h), b"key-1");
        assert_eq!(value_of(&buf, &h), &value[..]);
        assert!(buf[value_offset(5, 10_000) as usize + 10_000..].iter().all(|&b| b == 0), "padding is zeroed");
    }

    #[test]
    fn seal_in_place_matches_encode() {
        let value = vec![3u8; 5000];
        let a = record(b"k", &value, 1, 2);
        let mut b = vec![0u8; a.len()];
        b[HEADER_BYTES] = b'k';
        let start = value_offset(1, 5000) as usize;
        b[start..start + 5000].copy_from_slice(&value);
        seal_in_place(&mut b, RecordKind::Put, 1, 5000, 1, 2).expect("seal");
        assert_eq!(a, b);
    }

    #[test]
    fn every_flipped_bit_in_header_or_body_is_caught() {
        let buf = record(b"abc", &[9u8; 300], 5, 1);
        let body_end = value_offset(3, 300) as usize + 300;
        for byte in (0..body_end).step_by(7) {
            for bit in [0u8, 3, 7] {
                let mut bad = buf.clone();
                bad[byte] ^= 1 << bit;
                assert!(verify(&bad, Some(1)).is_err(), "flip at byte {byte} bit {bit} went unnoticed");
            }
        }
        let mut body_rot = buf.clone();
        body_rot[HEADER_BYTES + 1] ^= 0x10;
        assert_eq!(verify(&body_rot, Some(1)), Err(RecordError::BodyChecksum));
        assert!(decode_header(&body_rot).is_ok(), "header stays readable so a scan can skip the record");
        let mut value_rot = buf.clone();
        value_rot[value_offset(3, 300) as usize + 10] ^= 0x10;
        assert_eq!(verify(&value_rot, Some(1)), Err(RecordError::BlockChecksum { block: 0 }));
    }

    #[test]
    fn stale_epoch_torn_and_foreign_records_are_refused() {
        let buf = record(b"abc", &[1u8; 10], 5, 3);
        assert_eq!(verify(&buf, Some(4)), Err(RecordError::StaleEpoch { expected: 4, found: 3 }));
        assert_eq!(verify(&[0u8; 4096], None), Err(RecordError::BadMagic));
        assert!(matches!(verify(&buf[..32], None), Err(RecordError::Short { .. })));
        let mut other_version = buf.clone();
        other_version[4] = 9;
        let crc = crc32fast::hash(&other_version[..60]);
        other_version[60..64].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(verify(&other_version, None), Err(RecordError::BadVersion(9)));
    }

    /// A record as version 1 wrote it: no table, the body CRC over key and value.
    fn version_1_record(key: &[u8], value: &[u8], seq: u64, epoch: u64) -> Vec<u8> {
        let len = (HEADER_BYTES + key.len() + value.len()).div_ceil(BLOCK_BYTES as usize) * BLOCK_BYTES as usize;
        let mut buf = vec![0u8; len];
        buf[HEADER_BYTES..HEADER_BYTES + key.len()].copy_from_slice(key);
        buf[HEADER_BYTES + key.len()..HEADER_BYTES + key.len() + value.len()].copy_from_slice(value);
        let body_crc = crc32fast::hash(&buf[HEADER_BYTES..HEADER_BYTES + key.len() + value.len()]);
        let header = RecordHeader {
            kind: RecordKind::Put,
            key_len: key.len() as u32,
            value_len: value.len() as u64,
            seq,
            epoch,
            version: 1,
            check_block_log2: 0,
            body_crc,
        };
        write_header(&mut buf[..HEADER_BYTES], &header);
        buf
    }

    #[test]
    fn version_1_records_are_still_read_and_checked_whole() {
        let value: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
        let buf = version_1_record(b"old", &value, 3, 9);
        let h = verify(&buf, Some(9)).expect("a version 1 record verifies");
        assert_eq!((h.version, h.value_offset(), h.record_bytes()), (1, HEADER_BYTES + 3, buf.len() as u64));
        assert_eq!(value_of(&buf, &h), &value[..]);
        let mut checker = RecordChecker::new(h);
        checker.feed(&buf[HEADER_BYTES..HEADER_BYTES + 100_000]);
        assert_eq!(checker.value_bytes_checked(), 0, "nothing of a version 1 value is usable before its end");
        checker.feed(&buf[HEADER_BYTES + 100_000..]);
        assert_eq!(checker.value_bytes_checked(), value.len() as u64);
        let mut rot = buf.clone();
        rot[HEADER_BYTES + 50] ^= 1;
        assert_eq!(verify(&rot, Some(9)), Err(RecordError::BodyChecksum));
        let mut restamped = buf.clone();
        let h2 = restamp_epoch(&mut restamped, 11).expect("restamp");
        assert_eq!((h2.version, h2.epoch), (1, 11));
        assert!(verify(&restamped, Some(11)).is_ok(), "a copied version 1 record stays version 1 and valid");
    }

    #[test]
    fn the_checker_releases_the_value_block_by_block_and_stops_at_the_first_bad_one() {
        let value: Vec<u8> = (0..(5 * CHECK_BLOCK_BYTES + 123)).map(|i| (i % 251) as u8).collect();
        let buf = record(b"key", &value, 1, 1);
        let h = decode_header(&buf).expect("header");
        let start = h.value_offset();
        assert_eq!(h.table_bytes(), 6 * 4);
        // Fed in uneven pieces: the checked front grows one whole block at a time.
        let mut checker = RecordChecker::new(h);
        checker.feed(&buf[HEADER_BYTES..start - 1]);
        assert!(!checker.head_checked());
        checker.feed(&buf[start - 1..start + 10]);
        assert!(checker.head_checked());
        assert_eq!(checker.value_bytes_checked(), 0);
        checker.feed(&buf[start + 10..start + CHECK_BLOCK_BYTES as usize + 5]);
        assert_eq!(checker.value_bytes_checked(), CHECK_BLOCK_BYTES);
        checker.feed(&buf[start + CHECK_BLOCK_BYTES as usize + 5..]);
        assert_eq!(checker.value_bytes_checked(), value.len() as u64);
        assert_eq!(checker.finish(), Ok(h));
        // A flipped bit in block 3: blocks 0 to 2 pass, then the error sticks.
        let mut rot = buf.clone();
        rot[start + 3 * CHECK_BLOCK_BYTES as usize + 17] ^= 0x40;
        let mut checker = RecordChecker::new(h);
        checker.feed(&rot[HEADER_BYTES..start + 3 * CHECK_BLOCK_BYTES as usize]);
        assert_eq!(checker.value_bytes_checked(), 3 * CHECK_BLOCK_BYTES);
        checker.feed(&rot[start + 3 * CHECK_BLOCK_BYTES as usize..]);
        assert_eq!(checker.error(), Some(RecordError::BlockChecksum { block: 3 }));
        assert_eq!(checker.value_bytes_checked(), 3 * CHECK_BLOCK_BYTES, "the blocks before the bad one stay good");
        assert!(checker.finish().is_err());
        // A bad table entry is caught before any value byte counts.
        let mut table_rot = buf.clone();
        table_rot[HEADER_BYTES + 3 + 2] ^= 1;
        let mut checker = RecordChecker::new(h);
        checker.feed(&table_rot[HEADER_BYTES..]);
        assert_eq!(checker.error(), Some(RecordError::BodyChecksum));
        // A short feed never finishes.
        let mut checker = RecordChecker::new(h);
        checker.feed(&buf[HEADER_BYTES..start + 100]);
        assert!(matches!(checker.finish(), Err(RecordError::Short { .. })));
    }

    #[test]
    fn largest_value_is_the_largest_that_fits() {
        for record in [BLOCK_BYTES, 16 * BLOCK_BYTES, 1 << 20, (1 << 30) + 8 * BLOCK_BYTES] {
            for key_len in [1usize, 100, 5000] {
                let v = largest_value(record, key_len);
                if v == 0 {
                    continue;
                }
                assert!(record_bytes(key_len, v) <= record, "{v} does not fit {record} with key {key_len}");
                let slack = record - (value_offset(key_len, v) + v);
                assert!(slack < CHECK_BLOCK_BYTES + 8, "{v} leaves {slack} bytes of {record} unused");
            }
        }
    }
}
