//! Fuzzes the range validator every read path uses before touching memory: for any
//! (offset, len, bound), `check_range` accepts exactly the ranges inside the bound, never
//! overflows, and a copy it accepts stays inside both buffers.
#![no_main]

use arbitrary::Arbitrary;
use kvtide_transport::region::check_range;
use kvtide_transport::{copy_regions, Region};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    offset: u64,
    len: u64,
    bound: u64,
    src_len: u16,
    dst_len: u16,
    src_offset: u32,
    dst_offset: u32,
    copy_len: u32,
}

fuzz_target!(|input: Input| {
    let accepted = check_range("buffer", input.offset, input.len, input.bound).is_ok();
    let expected = u128::from(input.offset) + u128::from(input.len) <= u128::from(input.bound);
    assert_eq!(accepted, expected, "{input:?}");

    // Guard bytes around the destination must never change, whatever the request.
    let src: Vec<u8> = (0..input.src_len).map(|i| i as u8).collect();
    let mut dst = vec![0xEEu8; usize::from(input.dst_len) + 64];
    let (guard_lo, rest) = dst.split_at_mut(32);
    let (body, guard_hi) = rest.split_at_mut(usize::from(input.dst_len));
    let src_region = Region::host_readonly(&src);
    let dst_region = Region::host(body);
    // SAFETY: both regions borrow live local buffers that nothing else touches.
    let copied = unsafe {
        copy_regions(&src_region, input.src_offset.into(), &dst_region, input.dst_offset.into(), input.copy_len.into())
    };
    let fits = u64::from(input.src_offset) + u64::from(input.copy_len) <= u64::from(input.src_len)
        && u64::from(input.dst_offset) + u64::from(input.copy_len) <= u64::from(input.dst_len);
    assert_eq!(copied.is_ok(), fits, "{input:?}");
    assert!(guard_lo.iter().all(|&b| b == 0xEE) && guard_hi[..32].iter().all(|&b| b == 0xEE));
});
