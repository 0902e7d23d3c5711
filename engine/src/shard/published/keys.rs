//! The key bytes of one shard's objects, packed by size class.
//!
//! Owns every key from `IndexWriter::adopt` to `disown`. A key of up to `MAX_CLASS_BYTES` takes
//! a slot of its length rounded up to 8 bytes in a 64 KiB block; freed slots are reused by keys
//! of the same class. A longer key gets an allocation of its own. Against one heap allocation
//! per key this saves the allocator's header and its 16-byte rounding (a 76-byte key: 80 bytes
//! here, 96 from `malloc`).
//!
//! Never moves a key, hands a slot out twice or gives a block back before the arena goes: a
//! reader compares a key only under a lease on its slot, and the slot is closed and drained
//! before its key is freed, so a freed slot is unread; blocks are kept so no address a slot ever
//! published becomes unmapped while the index lives. Only the index's writer calls it.

use std::ptr::NonNull;

/// Keys up to this long share blocks; longer ones are allocated alone.
const MAX_CLASS_BYTES: usize = 512;
/// Slot sizes step by this much (and slots are this aligned).
const CLASS_STEP: usize = 8;
const CLASSES: usize = MAX_CLASS_BYTES / CLASS_STEP;
/// Bytes of one block.
const BLOCK_BYTES: usize = 64 << 10;

pub(super) struct KeyArena {
    /// Freed slots of each class (class `c` holds keys of `(c * 8, c * 8 + 8]` bytes; empty keys
    /// take a class 0 slot of 8 bytes).
    free: Vec<Vec<NonNull<u8>>>,
    /// Every block, from `Box::into_raw`; freed when the arena goes.
    blocks: Vec<NonNull<u8>>,
    /// Where the current block's unused bytes start, and how many there are.
    next: Option<NonNull<u8>>,
    left: usize,
    /// Bytes of blocks plus those of keys allocated alone.
    held_bytes: usize,
}

/// The size class of a key of `len` bytes that shares blocks, and its slot's size.
fn class_of(len: usize) -> Option<(usize, usize)> {
    let slot = len.max(1).div_ceil(CLASS_STEP) * CLASS_STEP;
    (slot <= MAX_CLASS_BYTES).then_some((slot / CLASS_STEP - 1, slot))
}

/// Whether a key of `len` bytes gets an allocation of its own (not a slot in a block).
pub(super) fn allocated_alone(len: usize) -> bool {
    class_of(len).is_none()
}

impl KeyArena {
    pub(super) fn new() -> KeyArena {
        KeyArena { free: vec![Vec::new(); CLASSES], blocks: Vec::new(), next: None, left: 0, held_bytes: 0 }
    }

    /// Copies `key` in; the address stays valid and unchanged until `free`.
    pub(super) fn alloc(&mut self, key: &[u8]) -> NonNull<u8> {
        let ptr = match class_of(key.len()) {
            Some((class, slot)) => match self.free[class].pop() {
                Some(ptr) => ptr,
                None => self.bump(slot),
            },
            None => {
                let own: Box<[u8]> = key.into();
                self.held_bytes += key.len();
                // SAFETY: Box::into_raw never returns null; `free` rebuilds the Box from this
                // address and the key's length.
                return unsafe { NonNull::new_unchecked(Box::into_raw(own).cast::<u8>()) };
            }
        };
        // SAFETY: `ptr` is a slot of at least `key.len()` bytes inside a live block that nothing
        // else uses (fresh, or freed by its last owner); `key` is the caller's, not in the arena.
        unsafe { std::ptr::copy_nonoverlapping(key.as_ptr(), ptr.as_ptr(), key.len()) };
        ptr
    }

    /// Takes a slot of `slot` bytes from the current block, starting a new block when it is full.
    fn bump(&mut self, slot: usize) -> NonNull<u8> {
        let next = match self.next {
            Some(next) if self.left >= slot => next,
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
        // SAFETY: `slot <= left`, so the slot and the address after it are inside the block (or
        // one past its end).
        self.next = Some(unsafe { next.add(slot) });
        self.left -= slot;
        next
    }

    /// Gives back the key `alloc` returned at `ptr`, `len` bytes long.
    ///
    /// # Safety
    /// `ptr` came from `alloc` with a key of `len` bytes, is freed once, and nothing reads it
    /// afterwards.
    pub(super) unsafe fn free(&mut self, ptr: NonNull<u8>, len: usize) {
        match class_of(len) {
            Some((class, _)) => self.free[class].push(ptr),
            None => {
                self.held_bytes -= len;
                // SAFETY: a key this long was allocated alone, as a Box<[u8]> of `len` bytes.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len)) });
            }
        }
    }

    /// Bytes the arena holds (blocks, whole, and keys allocated alone).
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

    /// Keys come back byte for byte, slots of a class are reused and never overlap, long keys
    /// are allocated alone, and the bytes held follow.
    #[test]
    fn keys_stay_put_and_slots_are_reused_by_class() {
        let mut arena = KeyArena::new();
        let keys: Vec<Vec<u8>> = (0..3000usize).map(|i| vec![(i % 251) as u8; i % 600]).collect();
        let mut held: Vec<(NonNull<u8>, usize)> = keys.iter().map(|k| (arena.alloc(k), k.len())).collect();
        let check = |held: &[(NonNull<u8>, usize)], keys: &[Vec<u8>]| {
            for (i, &(ptr, len)) in held.iter().enumerate() {
                // SAFETY: every held key is live and `len` bytes long.
                assert_eq!(unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) }, &keys[i][..], "key {i}");
            }
        };
        check(&held, &keys);
        let long: usize = keys.iter().map(Vec::len).filter(|&l| l > MAX_CLASS_BYTES).sum();
        assert_eq!(arena.held_bytes(), arena.blocks.len() * BLOCK_BYTES + long);
        // Free every other key; their slots go to the next keys of the same class.
        for (ptr, len) in held.iter().step_by(2) {
            // SAFETY: allocated above, freed once, not read again.
            unsafe { arena.free(*ptr, *len) };
        }
        let blocks = arena.blocks.len();
        let freed: Vec<usize> = (0..held.len()).step_by(2).collect();
        for &i in &freed {
            held[i] = (arena.alloc(&keys[i]), keys[i].len());
        }
        assert_eq!(arena.blocks.len(), blocks, "freed slots were reused, no block added");
        check(&held, &keys);
        let mut starts: Vec<(usize, usize)> = held.iter().map(|&(p, l)| (p.as_ptr() as usize, l.max(1))).collect();
        starts.sort_unstable();
        assert!(starts.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "no two keys overlap");
        for (ptr, len) in held {
            // SAFETY: as above.
            unsafe { arena.free(ptr, len) };
        }
        assert_eq!(arena.held_bytes(), arena.blocks.len() * BLOCK_BYTES, "long keys given back");
    }

    #[test]
    fn size_classes_step_by_eight_bytes() {
        assert_eq!(class_of(0), Some((0, 8)));
        assert_eq!(class_of(1), Some((0, 8)));
        assert_eq!(class_of(8), Some((0, 8)));
        assert_eq!(class_of(9), Some((1, 16)));
        assert_eq!(class_of(76), Some((9, 80)));
        assert_eq!(class_of(MAX_CLASS_BYTES), Some((CLASSES - 1, MAX_CLASS_BYTES)));
        assert_eq!(class_of(MAX_CLASS_BYTES + 1), None);
    }
}
