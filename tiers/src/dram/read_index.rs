//! The read index: where DRAM-resident objects lie in the arena, published in shared memory so
//! that a same-host client copies an object out of the arena without a message to the owner.
//!
//! Owns the index's memory (a memfd sealed like the arena: read-only to every process but the
//! owner), its layout (a header page, then one region per shard of buckets of `WAYS` entries),
//! the one writer of each region (`RegionWriter`, its shard's) and the reader (`ReadIndexView`),
//! which trusts nothing it reads. Never lets a reader call a copy good unless the entry it used
//! was unchanged from its lookup to the end of its copy: each entry is a sequence lock, and the
//! writer moves the sequence (`unpublish`) before the object's bytes may be freed, moved or
//! changed, so a copy that raced with an eviction, remove or upsert sees the move and is
//! discarded.
//!
//! The index is lossy: a bucket whose ways are taken loses its oldest entry to a new one, and a
//! key not found may still be in DRAM (the reader then asks the owner). Keys are named by a
//! 128-bit SHA-256 digest (`KeyDigest`), so another client cannot craft a key that is found in
//! place of someone else's.

use std::ffi::CStr;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use super::arena::{map_memfd_named, seal_read_only, Arena, ArenaError};

/// "kvtidRIX": the header's first word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"kvtidRIX");
/// The layout's version; a reader refuses others.
pub const VERSION: u32 = 1;
/// Entries per bucket.
pub const WAYS: usize = 4;
/// Bytes of one entry (one cache line).
pub const ENTRY_BYTES: usize = 64;
/// Bytes before the first region: the header and one word per shard.
pub const HEADER_BYTES: usize = 4096;
/// Shards the header has room for.
pub const MAX_SHARDS: usize = (HEADER_BYTES - 64) / 8;
/// Buckets per region at most (2^24: 4 GiB of entries per shard).
const MAX_BUCKETS_LOG2: u32 = 24;
/// An entry's offset while it names no object.
const EMPTY: u64 = u64::MAX;

/// A key's name in the index: the first 128 bits of SHA-256 of a domain tag and the key. A
/// client cannot find another key's entry under a key of its own without a second preimage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyDigest(pub [u64; 2]);

impl KeyDigest {
    pub fn of(key: &[u8]) -> KeyDigest {
        let mut hasher = Sha256::new();
        hasher.update(b"kvtide-read-index-v1\0");
        hasher.update(key);
        let out = hasher.finalize();
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&out[at..at + 8]);
            u64::from_le_bytes(w)
        };
        KeyDigest([word(0), word(8)])
    }
}

/// The header at offset 0. Readers load every field as an atomic: the owner may be writing
/// `alive` words, and a reader must not assume anything about memory it does not write.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    shards: AtomicU32,
    buckets_log2: AtomicU32,
    ways: AtomicU32,
    arena_bytes: AtomicU64,
    /// 1 while an owner serves reads through the index (`ReadIndex::serve`).
    serving: AtomicU64,
    _reserved: [AtomicU64; 3],
    /// One word per shard: 1 while that shard's region is kept up to date.
    alive: [AtomicU64; MAX_SHARDS],
}

/// One entry: a sequence lock over where one object lies. The sequence is odd while the writer
/// changes the entry and moves by two with each change; an entry never written (sequence 0, so
/// its page need not be touched) or whose `offset` is `EMPTY` names no object.
#[repr(C, align(64))]
struct Entry {
    seq: AtomicU64,
    digest: [AtomicU64; 2],
    offset: AtomicU64,
    len: AtomicU64,
    slot: AtomicU32,
    generation: AtomicU32,
    _pad: [AtomicU64; 2],
}

const _: () = assert!(std::mem::size_of::<Entry>() == ENTRY_BYTES);
const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// The geometry both sides agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub shards: usize,
    pub buckets_log2: u32,
    pub arena_bytes: u64,
}

impl Geometry {
    fn buckets(&self) -> usize {
        1 << self.buckets_log2
    }

    fn region_entries(&self) -> usize {
        self.buckets() * WAYS
    }

    /// Bytes of the whole index.
    pub fn len_bytes(&self) -> usize {
        HEADER_BYTES + self.shards * self.region_entries() * ENTRY_BYTES
    }

    fn bucket(&self, digest: &KeyDigest) -> usize {
        (digest.0[0] as usize) & (self.buckets() - 1)
    }
}

/// The owner's side: the memfd, its writable mapping, and which regions have a writer.
pub struct ReadIndex {
    base: NonNull<u8>,
    geometry: Geometry,
    memfd: OwnedFd,
    arena_base: usize,
    writers_given: Mutex<Vec<bool>>,
}

// SAFETY: the mapping is only reached through atomics (header words and entries); each region has
// one writer (`RegionWriter`, handed out once), and the mapping lives until drop.
unsafe impl Send for ReadIndex {}
// SAFETY: as above.
unsafe impl Sync for ReadIndex {}

impl std::fmt::Debug for ReadIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadIndex").field("geometry", &self.geometry).finish()
    }
}

impl ReadIndex {
    /// An index for `arena` (one region per slice) with room for about `entries_per_shard`
    /// objects per shard (rounded up to whole buckets of a power of two), sealed read-only for
    /// every other process.
    pub fn new(arena: &Arena, entries_per_shard: usize) -> Result<Arc<ReadIndex>, ArenaError> {
        let shards = arena.slice_count();
        if shards > MAX_SHARDS {
            return Err(ArenaError::TooManySlicesForIndex { slices: shards, max: MAX_SHARDS });
        }
        let buckets = entries_per_shard.div_ceil(WAYS).max(1).next_power_of_two();
        let buckets_log2 = buckets.trailing_zeros().min(MAX_BUCKETS_LOG2);
        let geometry = Geometry { shards, buckets_log2, arena_bytes: arena.len_bytes() as u64 };
        let (memfd, base) = map_memfd_named(c_name(), geometry.len_bytes(), false)?;
        let index = ReadIndex {
            base,
            geometry,
            memfd,
            arena_base: arena.base().as_ptr() as usize,
            writers_given: Mutex::new(vec![false; shards]),
        };
        let header = index.header();
        header.version.store(VERSION, Ordering::Relaxed);
        header.shards.store(shards as u32, Ordering::Relaxed);
        header.buckets_log2.store(buckets_log2, Ordering::Relaxed);
        header.ways.store(WAYS as u32, Ordering::Relaxed);
        header.arena_bytes.store(geometry.arena_bytes, Ordering::Relaxed);
        header.magic.store(MAGIC, Ordering::Release);
        if let Err(e) = seal_read_only(&index.memfd) {
            tracing::warn!(error = %e, "cannot seal the read index memfd; it must not be shared with other processes");
        }
        tracing::info!(shards, buckets_per_shard = buckets, bytes = geometry.len_bytes(), "read index mapped");
        Ok(Arc::new(index))
    }

    /// The memfd behind the index (shared with other processes by the owner).
    pub fn memfd(&self) -> &OwnedFd {
        &self.memfd
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Whether readers may use the index at all: an owner serves it while it serves clients, and
    /// stops (before it closes its connections) when it drains or stops.
    pub fn serve(&self, on: bool) {
        self.header().serving.store(u64::from(on), Ordering::SeqCst);
    }

    /// The writer of shard `shard`'s region; None when it was handed out already.
    pub fn writer(self: &Arc<Self>, shard: usize) -> Option<RegionWriter> {
        let mut given = self.writers_given.lock().unwrap_or_else(|p| p.into_inner());
        let taken = given.get_mut(shard)?;
        if *taken {
            return None;
        }
        *taken = true;
        self.header().alive[shard].store(1, Ordering::Release);
        Some(RegionWriter {
            index: Arc::clone(self),
            shard,
            location_of: Vec::new(),
            slot_at: vec![0; self.geometry.region_entries()],
            next_victim: vec![0; self.geometry.buckets()],
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_BYTES long, page-aligned, and lives with self;
        // the header is all atomics, for which zeroed memory is valid.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }

    /// Entry `i` of all regions (shard `s`'s region starts at `s * region_entries`).
    fn entry(&self, i: usize) -> &Entry {
        debug_assert!(i < self.geometry.shards * self.geometry.region_entries());
        // SAFETY: i is within the entries the mapping was sized for (callers index within their
        // region), entries are 64-byte aligned after the page-aligned header, and all atomics.
        unsafe { &*self.base.as_ptr().add(HEADER_BYTES).cast::<Entry>().add(i) }
    }
}

impl Drop for ReadIndex {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new` with this length; nothing borrows it past drop (the
        // writers hold an Arc).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.geometry.len_bytes()) };
    }
}

fn c_name() -> &'static CStr {
    c"kvtide-read-index"
}

/// One shard's writer of its region. Publishes an object when it opens to readers and takes it
/// out (`unpublish`) before anything may change or free its bytes.
pub struct RegionWriter {
    index: Arc<ReadIndex>,
    shard: usize,
    /// The entry (plus one) that names each object slot, 0 for none.
    location_of: Vec<u32>,
    /// The object slot (plus one) each entry of the region names, 0 for none.
    slot_at: Vec<u32>,
    /// Per bucket, the way a full bucket gives up next.
    next_victim: Vec<u8>,
}

impl std::fmt::Debug for RegionWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionWriter").field("shard", &self.shard).finish()
    }
}

impl RegionWriter {
    fn entry(&self, at: usize) -> &Entry {
        self.index.entry(self.shard * self.index.geometry.region_entries() + at)
    }

    /// Names object `slot` (of `generation`, key `key`) as lying at `value`, `len` bytes. A value
    /// outside the arena is not published.
    pub fn publish(&mut self, slot: u32, generation: u32, key: &[u8], value: NonNull<u8>, len: u64) {
        self.unpublish(slot);
        let geometry = self.index.geometry;
        let Some(offset) = (value.as_ptr() as usize).checked_sub(self.index.arena_base) else { return };
        let offset = offset as u64;
        if offset.checked_add(len).is_none_or(|end| end > geometry.arena_bytes) {
            return;
        }
        let digest = KeyDigest::of(key);
        let bucket = geometry.bucket(&digest);
        let first = bucket * WAYS;
        // An entry of the same key (another object of it not yet taken out) is replaced, else an
        // empty way is taken, else the bucket's next victim.
        let way = (0..WAYS)
            .find(|&w| self.slot_at[first + w] != 0 && self.names(first + w, &digest))
            .or_else(|| (0..WAYS).find(|&w| self.slot_at[first + w] == 0))
            .unwrap_or_else(|| {
                let w = self.next_victim[bucket] as usize % WAYS;
                self.next_victim[bucket] = ((w + 1) % WAYS) as u8;
                w
            });
        let at = first + way;
        if let Some(occupant) = self.slot_at[at].checked_sub(1) {
            self.unpublish(occupant);
        }
        let entry = self.entry(at);
        let seq = entry.seq.load(Ordering::Relaxed);
        entry.seq.store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        entry.digest[0].store(digest.0[0], Ordering::Relaxed);
        entry.digest[1].store(digest.0[1], Ordering::Relaxed);
        entry.offset.store(offset, Ordering::Relaxed);
        entry.len.store(len, Ordering::Relaxed);
        entry.slot.store(slot, Ordering::Relaxed);
        entry.generation.store(generation, Ordering::Relaxed);
        entry.seq.store(seq + 2, Ordering::Release);
        let s = slot as usize;
        if s >= self.location_of.len() {
            self.location_of.resize(s + 1, 0);
        }
        self.location_of[s] = at as u32 + 1;
        self.slot_at[at] = slot + 1;
    }

    fn names(&self, at: usize, digest: &KeyDigest) -> bool {
        let entry = self.entry(at);
        entry.digest[0].load(Ordering::Relaxed) == digest.0[0] && entry.digest[1].load(Ordering::Relaxed) == digest.0[1]
    }

    /// Takes object `slot` out: from when this returns, a reader that copied its bytes under
    /// the entry finds the entry moved. Call it before the bytes may change.
    pub fn unpublish(&mut self, slot: u32) {
        let Some(at) = self.location_of.get(slot as usize).and_then(|&l| l.checked_sub(1)) else { return };
        let at = at as usize;
        self.location_of[slot as usize] = 0;
        self.slot_at[at] = 0;
        let entry = self.entry(at);
        let seq = entry.seq.load(Ordering::Relaxed);
        entry.seq.store(seq + 1, Ordering::Relaxed);
        // Orders the odd sequence before every later store of this thread, the arena's included.
        fence(Ordering::Release);
        entry.offset.store(EMPTY, Ordering::Relaxed);
        entry.len.store(0, Ordering::Relaxed);
        entry.seq.store(seq + 2, Ordering::Release);
    }

    /// Whether object `slot` is published now.
    #[cfg(test)]
    fn is_published(&self, slot: u32) -> bool {
        self.location_of.get(slot as usize).is_some_and(|&l| l != 0)
    }

    /// Objects published now.
    #[cfg(test)]
    fn published(&self) -> usize {
        self.slot_at.iter().filter(|&&s| s != 0).count()
    }

    /// Takes every object out and marks the region dead: readers stop using it.
    pub fn close(&mut self) {
        self.index.header().alive[self.shard].store(0, Ordering::Release);
        let slots: Vec<u32> = self.slot_at.iter().filter_map(|s| s.checked_sub(1)).collect();
        for slot in slots {
            self.unpublish(slot);
        }
    }
}

impl Drop for RegionWriter {
    fn drop(&mut self) {
        self.close();
    }
}

/// Why a mapping is not a read index this reader can use.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ViewError {
    #[error("the read index is {len} bytes, shorter than its header")]
    Short { len: usize },
    #[error("not a read index (magic {magic:#x})")]
    Magic { magic: u64 },
    #[error("read index version {version}, this client reads {VERSION}")]
    Version { version: u32 },
    #[error("read index geometry out of range: {what}")]
    Geometry { what: &'static str },
}

/// A reader's view of a read index mapped read-only, checked once against the mapping's length
/// and the arena's. Every lookup is bounded by that geometry whatever the entries hold.
#[derive(Debug)]
pub struct ReadIndexView {
    base: NonNull<u8>,
    geometry: Geometry,
}

// SAFETY: the view only loads atomics from a mapping its owner keeps alive (see `new`).
unsafe impl Send for ReadIndexView {}
// SAFETY: as above.
unsafe impl Sync for ReadIndexView {}

/// An entry found for a key: where the object lay when looked up, and the sequence that proves
/// (`ReadIndexView::unchanged`) it still lay there after a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub offset: u64,
    pub len: u64,
    pub slot: u32,
    pub generation: u32,
    at: usize,
    seq: u64,
}

impl ReadIndexView {
    /// A view of `len` bytes at `base`, checked: the header's magic and version, a geometry that
    /// fits `len`, and the arena length `arena_bytes` the reader mapped.
    ///
    /// # Safety
    /// `[base, base + len)` must be a mapping, aligned to a page, that stays mapped as long as
    /// the view (it may be read-only, and its contents may be anything).
    pub unsafe fn new(base: NonNull<u8>, len: usize, arena_bytes: u64) -> Result<ReadIndexView, ViewError> {
        if len < HEADER_BYTES || !(base.as_ptr() as usize).is_multiple_of(64) {
            return Err(ViewError::Short { len });
        }
        // SAFETY: the caller guarantees HEADER_BYTES (checked above) mapped bytes at base; the
        // header is all atomics, valid for any bytes.
        let header = unsafe { &*base.as_ptr().cast::<Header>() };
        let magic = header.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(ViewError::Magic { magic });
        }
        let version = header.version.load(Ordering::Relaxed);
        if version != VERSION {
            return Err(ViewError::Version { version });
        }
        let shards = header.shards.load(Ordering::Relaxed) as usize;
        if shards == 0 || shards > MAX_SHARDS {
            return Err(ViewError::Geometry { what: "shards" });
        }
        let buckets_log2 = header.buckets_log2.load(Ordering::Relaxed);
        if buckets_log2 > MAX_BUCKETS_LOG2 {
            return Err(ViewError::Geometry { what: "buckets" });
        }
        if header.ways.load(Ordering::Relaxed) as usize != WAYS {
            return Err(ViewError::Geometry { what: "ways" });
        }
        if header.arena_bytes.load(Ordering::Relaxed) != arena_bytes {
            return Err(ViewError::Geometry { what: "arena length" });
        }
        let geometry = Geometry { shards, buckets_log2, arena_bytes };
        if geometry.len_bytes() > len {
            return Err(ViewError::Geometry { what: "length" });
        }
        Ok(ReadIndexView { base, geometry })
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn header(&self) -> &Header {
        // SAFETY: checked in `new`: HEADER_BYTES mapped at base for the view's life.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }

    fn entry(&self, shard: usize, at: usize) -> &Entry {
        let i = shard * self.geometry.region_entries() + at;
        debug_assert!(i < self.geometry.shards * self.geometry.region_entries());
        // SAFETY: `new` checked that the mapping holds every region's entries; callers pass a
        // shard below `shards` and an entry within a region.
        unsafe { &*self.base.as_ptr().add(HEADER_BYTES).cast::<Entry>().add(i) }
    }

    /// Whether shard `shard`'s region is kept up to date by a live writer and served.
    pub fn alive(&self, shard: usize) -> bool {
        let header = self.header();
        shard < self.geometry.shards
            && header.alive[shard].load(Ordering::Acquire) == 1
            && header.serving.load(Ordering::Acquire) == 1
    }

    /// The entry naming `digest` in shard `shard`'s region, if one does now and its range lies
    /// within the arena. What it says holds only if `unchanged` says so after the copy.
    pub fn find(&self, shard: usize, digest: &KeyDigest) -> Option<Found> {
        if !self.alive(shard) {
            return None;
        }
        let first = self.geometry.bucket(digest) * WAYS;
        for at in first..first + WAYS {
            let entry = self.entry(shard, at);
            let seq = entry.seq.load(Ordering::Acquire);
            if seq == 0 || seq & 1 == 1 {
                continue;
            }
            if entry.digest[0].load(Ordering::Relaxed) != digest.0[0]
                || entry.digest[1].load(Ordering::Relaxed) != digest.0[1]
            {
                continue;
            }
            let offset = entry.offset.load(Ordering::Relaxed);
            let len = entry.len.load(Ordering::Relaxed);
            let slot = entry.slot.load(Ordering::Relaxed);
            let generation = entry.generation.load(Ordering::Relaxed);
            if offset == EMPTY || offset.checked_add(len).is_none_or(|end| end > self.geometry.arena_bytes) {
                continue;
            }
            // The fields belong together only if the sequence did not move while they were read.
            fence(Ordering::Acquire);
            if entry.seq.load(Ordering::Relaxed) != seq {
                continue;
            }
            return Some(Found { offset, len, slot, generation, at: shard * self.geometry.region_entries() + at, seq });
        }
        None
    }

    /// Whether the entry `found` came from still names the same object, unchanged, now: call it
    /// after the copy; true proves the bytes copied were that object's.
    pub fn unchanged(&self, found: &Found) -> bool {
        // The copy's loads happen before the sequence is read again.
        fence(Ordering::Acquire);
        let regions = self.geometry.region_entries();
        let entry = self.entry(found.at / regions, found.at % regions);
        entry.seq.load(Ordering::Relaxed) == found.seq && self.alive(found.at / regions)
    }
}

#[cfg(test)]
mod tests;
