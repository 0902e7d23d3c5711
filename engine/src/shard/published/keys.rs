//! The key bytes of one shard's objects, each behind a short header of its object's lengths,
//! packed by size.
//!
//! Owns every object's entry from `IndexWriter::adopt` to `disown`: the value's length and the
//! key's (two LEB128 varints: a 16-byte value and a 76-byte key take 2 bytes) and the key's
//! bytes. An entry of up to `MAX_CLASS_BYTES` takes exactly its length in a 64 KiB block;
//! freed entries are reused by entries of the same length (the key's and the value length's
//! varint: values of 128 B, 16 KiB and 2 MiB and more take one byte more each). A longer entry
//! gets an allocation of its own. Against one heap allocation per key this saves the
//! allocator's header and its 16-byte rounding (a 76-byte key: 78 bytes here, 96 from
//! `malloc`), and the slot keeps one address instead of an address and a word of lengths.
//!
//! Never moves an entry, hands one out twice or gives a block back before the arena goes: a
//! reader reads an entry only under a lease on its slot, and the slot is closed and drained
//! before its entry is freed, so a freed entry is unread; blocks are kept so no address a slot
//! ever published becomes unmapped while the index lives. Only the index's writer allocates and
//! frees.

use std::ptr::NonNull;

/// Entries up to this long share blocks; longer ones are allocated alone.
const MAX_CLASS_BYTES: usize = 512;
/// Bytes of one block.
const BLOCK_BYTES: usize = 64 << 10;
/// The longest header: a 64-bit value length and a key length, as LEB128 varints.
const MAX_HEADER_BYTES: usize = 20;

pub(super) struct KeyArena {
    /// Freed entries by length (`free[n - 1]` holds entries of `n` bytes).
    free: Vec<Vec<NonNull<u8>>>,
    /// Every block, from `Box::into_raw`; freed when the arena goes.
    blocks: Vec<NonNull<u8>>,
    /// Where the current block's unused bytes start, and how many there are.
    next: Option<NonNull<u8>>,
    left: usize,
    /// Bytes of blocks plus those of entries allocated alone.
    held_bytes: usize,
}

/// Appends `value` as a LEB128 varint.
fn put_varint(out: &mut [u8; MAX_HEADER_BYTES], at: &mut usize, mut value: u64) {
    loop {
        let byte = (value & 0x7F) as u8;
        value >>= 7;
        out[*at] = if value == 0 { byte } else { byte | 0x80 };
        *at += 1;
        if value == 0 {
            return;
        }
    }
}

/// Reads a LEB128 varint that `put_varint` wrote at `*at`, advancing it.
///
/// # Safety
/// `entry` points at an entry `KeyArena::alloc` returned that is still allocated.
unsafe fn get_varint(entry: *const u8, at: &mut usize) -> u64 {
    let mut value = 0u64;
    let mut shift = 0;
    loop {
        // SAFETY: the caller's entry holds a whole varint from `*at` (its writer wrote it).
        let byte = unsafe { *entry.add(*at) };
        *at += 1;
        value |= u64::from(byte & 0x7F) << shift;
        if byte & 0x80 == 0 || shift >= 63 {
            return value;
        }
        shift += 7;
    }
}

/// The header of an entry for a value of `value_len` bytes and a key of `key_len`, and its
/// length.
fn header(value_len: u64, key_len: usize) -> ([u8; MAX_HEADER_BYTES], usize) {
    let mut out = [0u8; MAX_HEADER_BYTES];
    let mut at = 0;
    put_varint(&mut out, &mut at, value_len);
    put_varint(&mut out, &mut at, key_len as u64);
    (out, at)
}

/// What an entry holds: the value's length and the key.
///
/// # Safety
/// `entry` came from `KeyArena::alloc` and stays allocated and unchanged for `'a`.
pub(super) unsafe fn read<'a>(entry: NonNull<u8>) -> (u64, &'a [u8]) {
    let entry = entry.as_ptr().cast_const();
    let mut at = 0;
    // SAFETY: the caller's entry is live; its header is two varints.
    let (value_len, key_len) = unsafe { (get_varint(entry, &mut at), get_varint(entry, &mut at) as usize) };
    // SAFETY: the key's `key_len` bytes follow the header inside the entry.
    (value_len, unsafe { std::slice::from_raw_parts(entry.add(at), key_len) })
}

/// The entry's length in bytes (header and key).
///
/// # Safety
/// As for `read`.
unsafe fn entry_len(entry: NonNull<u8>) -> usize {
    // SAFETY: the caller's contract is `read`'s.
    let (_, key) = unsafe { read(entry) };
    key.as_ptr() as usize - entry.as_ptr() as usize + key.len()
}

impl KeyArena {
    pub(super) fn new() -> KeyArena {
        KeyArena { free: vec![Vec::new(); MAX_CLASS_BYTES], blocks: Vec::new(), next: None, left: 0, held_bytes: 0 }
    }

    /// Copies `key` in behind a header of its length and `value_len`; the address stays valid
    /// and the entry unchanged until `free`.
    pub(super) fn alloc(&mut self, key: &[u8], value_len: u64) -> NonNull<u8> {
        let (head, head_len) = header(value_len, key.len());
        let len = head_len + key.len();
        let ptr = if len <= MAX_CLASS_BYTES {
            match self.free[len - 1].pop() {
                Some(ptr) => ptr,
                None => self.bump(len),
            }
        } else {
            let own: Box<[u8]> = vec![0u8; len].into_boxed_slice();
            self.held_bytes += len;
            // SAFETY: Box::into_raw never returns null; `free` rebuilds the Box from this
            // address and the entry's length.
            unsafe { NonNull::new_unchecked(Box::into_raw(own).cast::<u8>()) }
        };
        // SAFETY: `ptr` is `len` bytes inside a live block or allocation that nothing else uses
        // (fresh, or freed by its last owner); neither source is in the arena.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), ptr.as_ptr(), head_len);
            std::ptr::copy_nonoverlapping(key.as_ptr(), ptr.as_ptr().add(head_len), key.len());
        }
        ptr
    }

    /// Takes `len` bytes from the current block, starting a new block when it is full.
    fn bump(&mut self, len: usize) -> NonNull<u8> {
        let next = match self.next {
            Some(next) if self.left >= len => next,
            _ => {
                let block: Box<[u8]> = vec![0u8; BLOCK_BYTES].into_boxed_slice();
                // SAFETY: Box::into_raw never returns null; Drop rebuilds the Box.
                let start = unsafe { NonNull::new_unchecked(Box::into_raw(block).cast::<u8>()) };
                self.blocks.push(start);
                self.held_bytes += BLOCK_BYTES;
                self.left = BLOCK_BYTES;
                start
            }
        };
        // SAFETY: `len <= left`, so the entry and the address after it are inside the block (or
        // one past its end).
        self.next = Some(unsafe { next.add(len) });
        self.left -= len;
        next
    }

    /// Gives back the entry `alloc` returned at `ptr`.
    ///
    /// # Safety
    /// `ptr` came from `alloc`, is freed once, and nothing reads it afterwards.
    pub(super) unsafe fn free(&mut self, ptr: NonNull<u8>) {
        // SAFETY: the caller's entry is still allocated.
        let len = unsafe { entry_len(ptr) };
        if len <= MAX_CLASS_BYTES {
            self.free[len - 1].push(ptr);
        } else {
            self.held_bytes -= len;
            // SAFETY: an entry this long was allocated alone, as a Box<[u8]> of `len` bytes.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len)) });
        }
    }

    /// Whether the entry at `ptr` was allocated alone (not in a block).
    ///
    /// # Safety
    /// As for `read`.
    pub(super) unsafe fn allocated_alone(ptr: NonNull<u8>) -> bool {
        // SAFETY: the caller's contract is `read`'s.
        unsafe { entry_len(ptr) > MAX_CLASS_BYTES }
    }

    /// Bytes the arena holds (blocks, whole, and entries allocated alone).
    pub(super) fn held_bytes(&self) -> usize {
        self.held_bytes
    }
}

impl Drop for KeyArena {
    fn drop(&mut self) {
        for block in self.blocks.drain(..) {
            // SAFETY: each block came from Box::into_raw of a BLOCK_BYTES slice, freed once.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(block.as_ptr(), BLOCK_BYTES)) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries come back byte for byte with their value lengths, freed entries are reused by
    /// entries of the same length and never overlap, long ones are allocated alone, and the
    /// bytes held follow.
    #[test]
    fn entries_stay_put_and_are_reused_by_length() {
        let mut arena = KeyArena::new();
        let keys: Vec<(Vec<u8>, u64)> = (0..3000usize)
            .map(|i| (vec![(i % 251) as u8; i % 600], (i as u64).wrapping_mul(0x9E37_79B9) >> (i % 64)))
            .collect();
        let mut held: Vec<NonNull<u8>> = keys.iter().map(|(k, v)| arena.alloc(k, *v)).collect();
        let check = |held: &[NonNull<u8>], keys: &[(Vec<u8>, u64)]| {
            for (i, &ptr) in held.iter().enumerate() {
                // SAFETY: every held entry is live.
                let (value_len, key) = unsafe { read(ptr) };
                assert_eq!((value_len, key), (keys[i].1, &keys[i].0[..]), "entry {i}");
            }
        };
        check(&held, &keys);
        // SAFETY: every held entry is live.
        let long: usize = held.iter().map(|&p| unsafe { entry_len(p) }).filter(|&l| l > MAX_CLASS_BYTES).sum();
        assert!(long > 0);
        assert_eq!(arena.held_bytes(), arena.blocks.len() * BLOCK_BYTES + long);
        // Free every other entry; their bytes go to the next entries of the same length.
        for ptr in held.iter().step_by(2) {
            // SAFETY: allocated above, freed once, not read again.
            unsafe { arena.free(*ptr) };
        }
        let blocks = arena.blocks.len();
        for i in (0..held.len()).step_by(2) {
            held[i] = arena.alloc(&keys[i].0, keys[i].1);
        }
        assert_eq!(arena.blocks.len(), blocks, "freed entries were reused, no block added");
        check(&held, &keys);
        // SAFETY: every held entry is live.
        let mut spans: Vec<(usize, usize)> =
            held.iter().map(|&p| (p.as_ptr() as usize, unsafe { entry_len(p) })).collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "no two entries overlap");
        for ptr in held {
            // SAFETY: as above.
            unsafe { arena.free(ptr) };
        }
        assert_eq!(arena.held_bytes(), arena.blocks.len() * BLOCK_BYTES, "long entries given back");
    }

    /// A 76-byte key of a small value takes 78 bytes; the largest lengths round-trip.
    #[test]
    fn headers_are_varints_of_both_lengths() {
        assert_eq!(header(16, 76).1, 2);
        assert_eq!(header(64 << 10, 76).1, 4);
        assert_eq!(header(u64::MAX, 1 << 20).1, 13);
        let mut arena = KeyArena::new();
        for (value_len, key_len) in [(0, 0), (u64::MAX, 3), ((1 << 43) - 1, (1 << 20) + 1), (127, 128)] {
            let key = vec![7u8; key_len];
            let ptr = arena.alloc(&key, value_len);
            // SAFETY: live until freed below.
            let (v, k) = unsafe { read(ptr) };
            assert_eq!((v, k), (value_len, &key[..]));
            // SAFETY: allocated above, freed once.
            unsafe { arena.free(ptr) };
        }
    }
}
