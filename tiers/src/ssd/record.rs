//! The on-disk record format of the SSD tier.
//!
//! Owns encoding and checking of records; never does I/O. A record is 4 KiB-aligned:
//! a 64-byte header, the key, the value, zero padding. The header has its own CRC (so a scan can
//! skip a record whose body rotted and keep going) and a CRC over header + key + value (so a read
//! never reports bytes good that differ from what was written). Every record carries its
//! segment's epoch: records left over from a segment's previous life are told apart from new ones.

/// O_DIRECT granularity and record alignment.
pub const BLOCK_BYTES: u64 = 4096;
/// Header length.
pub const HEADER_BYTES: usize = 64;
/// "KVTR".
pub const RECORD_MAGIC: u32 = 0x5254_564B;
/// Bumped whenever the layout changes; a data directory of another version is refused.
pub const FORMAT_VERSION: u16 = 1;
/// Longest key the format accepts.
pub const MAX_KEY_BYTES: u32 = 1 << 20;

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
    body_crc: u32,
}

impl RecordHeader {
    /// Bytes the whole record occupies on disk (4 KiB multiple).
    pub fn record_bytes(&self) -> u64 {
        record_bytes(self.key_len as usize, self.value_len)
    }

    /// Offset of the value within the record.
    pub fn value_offset(&self) -> usize {
        HEADER_BYTES + self.key_len as usize
    }

    /// CRC32 of key and value, as recorded.
    pub fn body_crc(&self) -> u32 {
        self.body_crc
    }
}

/// Why a record was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("not a record (bad magic)")]
    BadMagic,
    #[error("record of format version {0}, this build reads version {FORMAT_VERSION}")]
    BadVersion(u16),
    #[error("record header checksum mismatch")]
    HeaderChecksum,
    #[error("record header is inconsistent (kind, lengths)")]
    BadHeader,
    #[error("record body checksum mismatch")]
    BodyChecksum,
    #[error("record belongs to epoch {found}, segment is at epoch {expected}")]
    StaleEpoch { expected: u64, found: u64 },
    #[error("buffer of {have} bytes is shorter than the record ({need})")]
    Short { have: usize, need: usize },
}

/// On-disk size of a record with this key and value.
pub fn record_bytes(key_len: usize, value_len: u64) -> u64 {
    let raw = HEADER_BYTES as u64 + key_len as u64 + value_len;
    raw.div_ceil(BLOCK_BYTES) * BLOCK_BYTES
}

/// Writes a complete record (header, key, value, zero padding) into `out`, which must be
/// exactly `record_bytes(key.len(), value.len())` long.
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
    let body_end = HEADER_BYTES + key.len() + value.len();
    out[HEADER_BYTES..HEADER_BYTES + key.len()].copy_from_slice(key);
    out[HEADER_BYTES + key.len()..body_end].copy_from_slice(value);
    out[body_end..].fill(0);
    let mut body = crc32fast::Hasher::new();
    body.update(key);
    body.update(value);
    let header = RecordHeader {
        kind,
        key_len: key.len() as u32,
        value_len: value.len() as u64,
        seq,
        epoch,
        body_crc: body.finalize(),
    };
    write_header(&mut out[..HEADER_BYTES], &header);
    Ok(())
}

/// Writes the header into the first 64 bytes of a record whose key and value are already in
/// place behind it (the zero-copy path: the caller copied the value into the record buffer).
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
    let body_end = HEADER_BYTES + key_len + value_len as usize;
    record[body_end..].fill(0);
    let body_crc = crc32fast::hash(&record[HEADER_BYTES..body_end]);
    let header = RecordHeader { kind, key_len: key_len as u32, value_len, seq, epoch, body_crc };
    write_header(&mut record[..HEADER_BYTES], &header);
    Ok(())
}

/// Re-stamps the header at the start of `record` with another segment's epoch (a record copied
/// forward into a new segment), keeping kind, lengths, sequence number and body checksum.
pub fn restamp_epoch(record: &mut [u8], epoch: u64) -> Result<RecordHeader, RecordError> {
    let mut header = decode_header(record)?;
    header.epoch = epoch;
    write_header(&mut record[..HEADER_BYTES], &header);
    Ok(header)
}

fn write_header(out: &mut [u8], h: &RecordHeader) {
    out.fill(0);
    out[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    out[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    out[6] = h.kind as u8;
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
    if version != FORMAT_VERSION {
        return Err(RecordError::BadVersion(version));
    }
    let kind = RecordKind::from_u8(buf[6]).ok_or(RecordError::BadHeader)?;
    let key_len = u32_at(8);
    let value_len = u64_at(16);
    let consistent = match kind {
        RecordKind::SegmentHeader => key_len == 0 && value_len == 0,
        RecordKind::Put => key_len > 0 && key_len <= MAX_KEY_BYTES && value_len < (1 << 48),
        RecordKind::Tombstone => key_len > 0 && key_len <= MAX_KEY_BYTES && value_len == 0,
    };
    if !consistent {
        return Err(RecordError::BadHeader);
    }
    Ok(RecordHeader { kind, key_len, value_len, seq: u64_at(24), epoch: u64_at(32), body_crc: u32_at(40) })
}

/// Checks a whole record read back from disk (header, epoch, body CRC) and returns its header.
pub fn verify(record: &[u8], expected_epoch: Option<u64>) -> Result<RecordHeader, RecordError> {
    let header = decode_header(record)?;
    if let Some(expected) = expected_epoch {
        if header.epoch != expected {
            return Err(RecordError::StaleEpoch { expected, found: header.epoch });
        }
    }
    let body_end = HEADER_BYTES + header.key_len as usize + header.value_len as usize;
    if record.len() < body_end {
        return Err(RecordError::Short { have: record.len(), need: body_end });
    }
    if crc32fast::hash(&record[HEADER_BYTES..body_end]) != header.body_crc {
        return Err(RecordError::BodyChecksum);
    }
    Ok(header)
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
        assert!(buf[HEADER_BYTES + 5 + 10_000..].iter().all(|&b| b == 0), "padding is zeroed");
    }

    #[test]
    fn seal_in_place_matches_encode() {
        let value = vec![3u8; 5000];
        let a = record(b"k", &value, 1, 2);
        let mut b = vec![0u8; a.len()];
        b[HEADER_BYTES] = b'k';
        b[HEADER_BYTES + 1..HEADER_BYTES + 1 + 5000].copy_from_slice(&value);
        seal_in_place(&mut b, RecordKind::Put, 1, 5000, 1, 2).expect("seal");
        assert_eq!(a, b);
    }

    #[test]
    fn every_flipped_bit_in_header_or_body_is_caught() {
        let buf = record(b"abc", &[9u8; 300], 5, 1);
        let body_end = HEADER_BYTES + 3 + 300;
        for byte in (0..body_end).step_by(7) {
            for bit in [0u8, 3, 7] {
                let mut bad = buf.clone();
                bad[byte] ^= 1 << bit;
                assert!(verify(&bad, Some(1)).is_err(), "flip at byte {byte} bit {bit} went unnoticed");
            }
        }
        let mut body_rot = buf.clone();
        body_rot[HEADER_BYTES + 10] ^= 0x10;
        assert_eq!(verify(&body_rot, Some(1)), Err(RecordError::BodyChecksum));
        assert!(decode_header(&body_rot).is_ok(), "header stays readable so a scan can skip the record");
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
}
