use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64};

use super::*;

const SLICE: usize = crate::dram::arena::HUGE_PAGE_BYTES;

fn arena(slices: usize) -> Arc<Arena> {
    Arena::new(SLICE * slices, slices).expect("arena")
}

fn view_of(index: &ReadIndex) -> ReadIndexView {
    index.serve(true);
    // SAFETY: the index's own mapping, kept alive by the caller's Arc for the test's length.
    unsafe { ReadIndexView::new(index.base, index.geometry.len_bytes(), index.geometry.arena_bytes) }.expect("view")
}

fn at(arena: &Arena, offset: usize) -> NonNull<u8> {
    // SAFETY: tests pass offsets inside the arena.
    unsafe { NonNull::new_unchecked(arena.base().as_ptr().add(offset)) }
}

#[test]
fn a_published_object_is_found_until_it_is_taken_out() {
    let arena = arena(2);
    let index = ReadIndex::new(&arena, 64).expect("index");
    index.serve(true);
    let mut writer = index.writer(1).expect("writer");
    assert!(index.writer(1).is_none(), "one writer per region");
    let view = view_of(&index);
    let digest = KeyDigest::of(b"key");
    assert_eq!(view.find(1, &digest), None);
    writer.publish(7, 3, b"key", at(&arena, SLICE + 4096), 100);
    let found = view.find(1, &digest).expect("found");
    assert_eq!((found.offset, found.len, found.slot, found.generation), ((SLICE + 4096) as u64, 100, 7, 3));
    assert!(view.unchanged(&found));
    assert_eq!(view.find(0, &digest), None, "another shard's region");
    assert_eq!(view.find(1, &KeyDigest::of(b"other")), None);
    writer.unpublish(7);
    assert!(!view.unchanged(&found), "taken out after the lookup");
    writer.publish(7, 4, b"key", at(&arena, SLICE + 4096), 100);
    let found = view.find(1, &digest).expect("found again");
    index.serve(false);
    assert!(!view.unchanged(&found) && view.find(1, &digest).is_none(), "an index no longer served");
    index.serve(true);
    writer.unpublish(7);
    assert_eq!(view.find(1, &digest), None);
    assert_eq!(writer.published(), 0);
}

#[test]
fn a_new_object_of_a_key_replaces_the_old_one_and_a_full_bucket_gives_up_its_oldest() {
    let arena = arena(1);
    // One bucket: every key shares it.
    let index = ReadIndex::new(&arena, 1).expect("index");
    assert_eq!(index.geometry().buckets(), 1);
    let mut writer = index.writer(0).expect("writer");
    let view = view_of(&index);
    writer.publish(1, 1, b"a", at(&arena, 0), 10);
    writer.publish(2, 2, b"a", at(&arena, 64), 10);
    assert!(!writer.is_published(1), "the key's older object is out");
    assert_eq!(view.find(0, &KeyDigest::of(b"a")).map(|f| f.slot), Some(2));
    for (slot, key) in [(3u32, b"b"), (4, b"c"), (5, b"d")] {
        writer.publish(slot, 1, key, at(&arena, 128 * slot as usize), 10);
    }
    assert_eq!(writer.published(), WAYS);
    writer.publish(6, 1, b"e", at(&arena, 1024), 10);
    assert_eq!(writer.published(), WAYS, "a full bucket stays full");
    assert!(!writer.is_published(2), "the first way went");
    assert_eq!(view.find(0, &KeyDigest::of(b"a")), None);
    assert_eq!(view.find(0, &KeyDigest::of(b"e")).map(|f| f.slot), Some(6));
    writer.unpublish(2);
    assert_eq!(writer.published(), WAYS, "taking out an object already gone changes nothing");
}

#[test]
fn a_value_outside_the_arena_is_not_published() {
    let arena = arena(1);
    let index = ReadIndex::new(&arena, 8).expect("index");
    let mut writer = index.writer(0).expect("writer");
    writer.publish(1, 1, b"k", at(&arena, SLICE - 8), 16);
    let outside = [0u8; 16];
    writer.publish(2, 1, b"j", NonNull::from(&outside).cast(), 16);
    assert_eq!(writer.published(), 0);
}

#[test]
fn a_closed_region_is_dead_to_readers() {
    let arena = arena(1);
    let index = ReadIndex::new(&arena, 8).expect("index");
    let view = view_of(&index);
    {
        let mut writer = index.writer(0).expect("writer");
        writer.publish(1, 1, b"k", at(&arena, 0), 16);
        assert!(view.alive(0));
    }
    assert!(!view.alive(0));
    assert_eq!(view.find(0, &KeyDigest::of(b"k")), None);
}

#[test]
fn the_memfd_is_sealed_read_only() {
    let arena = arena(1);
    let index = ReadIndex::new(&arena, 8).expect("index");
    // SAFETY: fcntl reads the seals of a descriptor the index holds.
    let seals = unsafe { libc::fcntl(index.memfd().as_raw_fd(), libc::F_GET_SEALS) };
    assert_eq!(seals & crate::dram::arena::SHARING_SEALS, crate::dram::arena::SHARING_SEALS);
    // SAFETY: asks for a new shared writable mapping, which the seals must refuse.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            index.memfd().as_raw_fd(),
            0,
        )
    };
    assert_eq!(ptr, libc::MAP_FAILED, "a writable mapping of the sealed index");
}

/// A page-aligned buffer standing in for a hostile mapping.
struct Page(Vec<u64>);

impl Page {
    fn new(len: usize) -> Page {
        Page(vec![0; len / 8 + 512])
    }
    fn base(&mut self) -> NonNull<u8> {
        let p = self.0.as_mut_ptr() as usize;
        NonNull::new(((p + 4095) & !4095) as *mut u8).expect("non-null")
    }
}

#[test]
fn a_view_refuses_headers_it_cannot_trust() {
    let arena = arena(1);
    let index = ReadIndex::new(&arena, 8).expect("index");
    let len = index.geometry().len_bytes();
    let mut page = Page::new(len + 4096);
    let base = page.base();
    let copy = |page: NonNull<u8>| {
        // SAFETY: both are at least `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(index.base.as_ptr(), page.as_ptr(), len) }
    };
    let view = |len: usize, arena_bytes: u64| {
        // SAFETY: `page` holds len + 4096 bytes from `base`, alive for the test.
        unsafe { ReadIndexView::new(base, len, arena_bytes).map(|_| ()) }
    };
    copy(base);
    assert_eq!(view(len, SLICE as u64), Ok(()));
    assert_eq!(view(len - 1, SLICE as u64), Err(ViewError::Geometry { what: "length" }));
    assert_eq!(view(100, SLICE as u64), Err(ViewError::Short { len: 100 }));
    assert_eq!(view(len, 1), Err(ViewError::Geometry { what: "arena length" }));
    let words = base.as_ptr().cast::<u32>();
    // SAFETY: writes within the header of the copy.
    unsafe { words.add(2).write(2) };
    assert_eq!(view(len, SLICE as u64), Err(ViewError::Version { version: 2 }));
    copy(base);
    // SAFETY: as above.
    unsafe { words.add(3).write(0) };
    assert_eq!(view(len, SLICE as u64), Err(ViewError::Geometry { what: "shards" }));
    copy(base);
    // SAFETY: as above.
    unsafe { words.add(4).write(40) };
    assert_eq!(view(len, SLICE as u64), Err(ViewError::Geometry { what: "buckets" }));
    copy(base);
    // SAFETY: as above.
    unsafe { base.as_ptr().write(0) };
    assert!(matches!(view(len, SLICE as u64), Err(ViewError::Magic { .. })));
}

#[test]
fn hostile_entries_never_name_a_range_outside_the_arena() {
    let arena = arena(1);
    let index = ReadIndex::new(&arena, 4).expect("index");
    let len = index.geometry().len_bytes();
    let mut page = Page::new(len + 4096);
    let base = page.base();
    // SAFETY: the page holds at least len bytes.
    unsafe { std::ptr::copy_nonoverlapping(index.base.as_ptr(), base.as_ptr(), len) };
    // SAFETY: as above, alive for the test.
    let view = unsafe { ReadIndexView::new(base, len, SLICE as u64) }.expect("view");
    // SAFETY: as above: the header's serving word and shard 0's alive word.
    unsafe {
        base.as_ptr().add(32).cast::<u64>().write(1);
        base.as_ptr().add(64).cast::<u64>().write(1);
    }
    let digest = KeyDigest::of(b"k");
    let entry = |field: usize, value: u64| {
        // SAFETY: the first entry's words, within the page.
        unsafe { base.as_ptr().add(HEADER_BYTES + field * 8).cast::<u64>().write(value) }
    };
    entry(0, 2);
    entry(1, digest.0[0]);
    entry(2, digest.0[1]);
    for (offset, len) in [(SLICE as u64 - 1, 2), (u64::MAX - 1, 4), (0, u64::MAX), (EMPTY, 0)] {
        entry(3, offset);
        entry(4, len);
        assert_eq!(view.find(0, &digest), None, "offset {offset} len {len}");
    }
    entry(3, 8);
    entry(4, 8);
    entry(0, 1);
    assert_eq!(view.find(0, &digest), None, "odd sequence");
    entry(0, 2);
    assert_eq!(view.find(0, &digest).map(|f| (f.offset, f.len)), Some((8, 8)));
}

/// A reader racing a writer that rewrites, moves and takes out objects: every copy the view
/// calls unchanged holds one object's bytes, whole.
#[test]
fn a_copy_that_raced_with_a_change_is_never_called_unchanged() {
    const LEN: usize = 4096;
    let arena = arena(1);
    let index = ReadIndex::new(&arena, 16).expect("index");
    let mut writer = index.writer(0).expect("writer");
    let view = view_of(&index);
    let stop = Arc::new(AtomicBool::new(false));
    let goods = AtomicU64::new(0);
    let base = arena.base().as_ptr() as usize;
    let (good, torn) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let digest = KeyDigest::of(b"k");
            let mut buf = vec![0u8; LEN];
            let (mut good, mut stale) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let Some(found) = view.find(0, &digest) else { continue };
                // SAFETY: found ranges lie within the arena (checked by find); the bytes may be
                // changing, which `unchanged` detects.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (base + found.offset as usize) as *const u8,
                        buf.as_mut_ptr(),
                        found.len as usize,
                    )
                };
                if !view.unchanged(&found) {
                    stale += 1;
                    continue;
                }
                let first = buf[0];
                if buf.iter().all(|&b| b == first) && u32::from(first) == found.generation % 256 {
                    good += 1;
                    goods.fetch_add(1, Ordering::Relaxed);
                } else {
                    return (good, true);
                }
            }
            let _ = stale;
            (good, false)
        });
        for generation in 1..20_000u32 {
            // Two places, alternating: the object moves, and the old place is rewritten.
            let offset = (generation as usize % 2) * LEN;
            let place = (base + offset) as *mut u8;
            writer.unpublish(generation - 1);
            // SAFETY: inside the arena; no reader may call a copy of this place good, since the
            // entry naming it was taken out above.
            unsafe { std::ptr::write_bytes(place, (generation % 256) as u8, LEN) };
            writer.publish(generation, generation, b"k", at(&arena, offset), LEN as u64);
        }
        // The last object stays put until the reader copied it once (a loaded machine may not
        // have run the reader during the race at all).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while goods.load(Ordering::Relaxed) == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().expect("reader")
    });
    assert!(!torn, "a torn or stale copy was called unchanged");
    assert!(good > 0, "the reader never read");
}
