//! Fuzzes the TLSF offset allocator (`kvtide_tiers::dram::OffsetAllocator`) against a model.
//!
//! The input picks a capacity (bytes up to 2^55), an alignment (8 B..4 KiB), a bound on live
//! allocations and a sequence of alloc/free ops. The model keeps the live allocations and a map
//! of their ranges; after every op the target checks: allocations are aligned, inside capacity
//! and disjoint; accounting matches the model; refusals are justified (good fit may refuse only
//! when no free block is at least ~1/16 larger than the request); and at the end, after freeing
//! everything, the allocator is one free block spanning the capacity.

#![no_main]

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use kvtide_tiers::dram::{Allocation, OffsetAllocator};
use libfuzzer_sys::fuzz_target;

/// Ops per input; bounds the work per run.
const MAX_OPS: usize = 2048;
/// Full internal consistency walk (O(blocks + bins)) every this many ops, and at the end.
const CHECK_EVERY: usize = 16;

#[derive(Arbitrary, Debug)]
struct Input {
    capacity: u32,
    capacity_shift: u8,
    align_log2: u8,
    max_allocations: u16,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Requests `size << (shift % 40)` bytes: sizes from 0 to far past the capacity.
    Alloc { size: u16, shift: u8 },
    /// Frees the live allocation at `index % live.len()` (no-op when none is live).
    Free { index: u16 },
    /// Frees the newest live allocation.
    FreeLast,
}

fn check(a: &OffsetAllocator) {
    if let Err(e) = a.check_invariants() {
        panic!("allocator invariant violated: {e}");
    }
}

fuzz_target!(|input: Input| {
    let capacity = (u64::from(input.capacity) + 1) << (input.capacity_shift % 24);
    let align = 1u64 << (3 + input.align_log2 % 10);
    let max_allocations = u32::from(input.max_allocations % 1024) + 1;
    let mut a = match OffsetAllocator::new(capacity, align, max_allocations) {
        Ok(a) => a,
        Err(e) => {
            assert!(capacity < align, "only a capacity below one unit may be refused: {e}");
            return;
        }
    };
    // The unit is the alignment asked for, or the smallest power of two above it that cuts the
    // capacity into at most 2^30 units.
    let unit = a.align_bytes();
    assert!(unit.is_power_of_two() && unit >= align, "unit {unit} for align {align}");
    assert!(capacity / unit <= 1 << 30, "{capacity} bytes in units of {unit}");
    assert!(unit == align || capacity / (unit / 2) > 1 << 30, "unit {unit} coarser than needed for {capacity}");
    let cap = capacity & !(unit - 1);
    assert_eq!(a.capacity_bytes(), cap);
    assert_eq!(a.stats().largest_free_bytes, cap);

    let mut live: Vec<Allocation> = Vec::new();
    // offset -> end of every live allocation, to find overlaps in O(log n).
    let mut ranges: BTreeMap<u64, u64> = BTreeMap::new();

    for (step, op) in input.ops.into_iter().take(MAX_OPS).enumerate() {
        match op {
            Op::Alloc { size, shift } => {
                let size = u64::from(size) << (shift % 40);
                let len = size.div_ceil(unit) * unit;
                let before = a.stats();
                match a.allocate(size) {
                    Some(x) => {
                        assert!(size > 0, "size 0 must be refused");
                        assert!(live.len() < max_allocations as usize, "past max_allocations");
                        let (offset, end) = (a.offset_of(&x), a.offset_of(&x) + a.len_of(&x));
                        assert_eq!(a.len_of(&x), len, "len is the size rounded up to unit");
                        assert_eq!(offset % unit, 0, "misaligned {x:?} at {offset}");
                        assert!(end <= cap, "[{offset}, {end}) past capacity {cap}");
                        if let Some((&o, &e)) = ranges.range(..=offset).next_back() {
                            assert!(e <= offset, "[{offset}, {end}) overlaps [{o}, {e})");
                        }
                        if let Some((&o, &e)) = ranges.range(offset..).next() {
                            assert!(end <= o, "[{offset}, {end}) overlaps [{o}, {e})");
                        }
                        ranges.insert(offset, end);
                        live.push(x);
                    }
                    None => {
                        // Good fit searches the class that starts at or above the request,
                        // at most len/16 above it (rounded to unit); a block that large must
                        // be found.
                        let guaranteed = len.saturating_add(len / 16).saturating_add(unit);
                        let justified = size == 0
                            || live.len() >= max_allocations as usize
                            || len > before.free_bytes
                            || before.largest_free_bytes < guaranteed;
                        assert!(
                            justified,
                            "refused {size} B (len {len}) with {} free, largest free {}",
                            before.free_bytes, before.largest_free_bytes
                        );
                        if live.is_empty() && size > 0 && len <= cap {
                            panic!("empty allocator of {cap} B refused {size} B");
                        }
                        assert_eq!(a.stats(), before, "a refusal must change nothing");
                    }
                }
            }
            Op::Free { index } => {
                if !live.is_empty() {
                    let x = live.swap_remove(usize::from(index) % live.len());
                    assert!(ranges.remove(&a.offset_of(&x)).is_some());
                    a.free(x);
                }
            }
            Op::FreeLast => {
                if let Some(x) = live.pop() {
                    assert!(ranges.remove(&a.offset_of(&x)).is_some());
                    a.free(x);
                }
            }
        }
        let s = a.stats();
        assert_eq!(s.capacity_bytes, cap);
        assert_eq!(s.used_bytes, live.iter().map(|x| a.len_of(x)).sum::<u64>());
        assert_eq!(s.used_bytes + s.free_bytes, cap);
        assert_eq!(s.allocations, live.len() as u64);
        assert!(s.largest_free_bytes <= s.free_bytes);
        assert_eq!(s.largest_free_bytes == 0, s.free_bytes == 0);
        assert!(s.free_blocks <= s.allocations + 1, "free neighbours must merge");
        if step % CHECK_EVERY == 0 {
            check(&a);
        }
    }
    check(&a);

    // Free everything: must coalesce back into one block spanning the capacity.
    for x in live.drain(..) {
        a.free(x);
    }
    let s = a.stats();
    assert_eq!(s.used_bytes, 0);
    assert_eq!(s.allocations, 0);
    assert_eq!(s.free_bytes, cap);
    assert_eq!(s.free_blocks, 1);
    assert_eq!(s.largest_free_bytes, cap);
    check(&a);
    // And the whole capacity is allocatable again.
    let all = a.allocate(cap).expect("an empty allocator holds its whole capacity");
    assert_eq!((a.offset_of(&all), a.len_of(&all)), (0, cap));
    a.free(all);
    check(&a);
});
