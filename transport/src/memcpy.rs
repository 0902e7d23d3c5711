//! The same-process transport: CPU copies between host regions.
//!
//! Owns every host copy of object bytes (`copy_bytes`) and the transport that makes them: it
//! copies exactly the bytes a validated descriptor names and nothing else. It never dereferences
//! device memory: it refuses it with `CudaUnavailable` (the CUDA transport handles that).

use crate::inflight::InFlight;
pub use crate::region::check_host_list;
use crate::region::{MemoryKind, Region, RegionError};
use crate::transfer::{Direction, Piece, Summary, Transfer};
use crate::transport::{EarlyStart, Transport};
use crate::TransportError;

/// Objects at least this large are copied with non-temporal stores (pieces of at least
/// `NONTEMPORAL_PIECE_BYTES`): they do not fit the caches anyway, and a progressive read that
/// copies one in chunks then keeps the speed of one large copy (`kvtide-bench stream
/// --copy-probe`: 4 MiB chunks of a 256 MiB copy at 7.8 GB/s plain, 11.0 non-temporal, 11.2 as
/// one memcpy, on the 2-core VM).
pub const NONTEMPORAL_OBJECT_BYTES: u64 = 32 << 20;
/// Smallest piece copied with non-temporal stores.
pub const NONTEMPORAL_PIECE_BYTES: u64 = 256 << 10;

/// Copies of this many bytes and more, up to `NEAR_ALIAS_MAX_BYTES`, whose destination lies 1 to 63
/// bytes past its source modulo 4 KiB go through `copy_vectors` rather than `memcpy`: glibc's
/// `memcpy` moves them with `rep movsb`, which runs about 7-10x slower in that case on the AMD
/// EPYC machines measured here (64 KiB: 0.4 -> 3.0 us; 4 KiB alike). Arena objects start on 4
/// KiB boundaries and `malloc` gives large buffers addresses 16 bytes past one, so a read into
/// such a buffer hits it every time. Smaller copies `memcpy` does with vector loops anyway.
pub const NEAR_ALIAS_MIN_BYTES: usize = 2 << 10;
/// Past about the L2's size (512 KiB on the 2-core VM) `memcpy` leaves `rep movsb` and the
/// slow case ends; other CPUs have larger L2s. Up to here the AVX2 loop measured as fast as
/// `memcpy` without the slow case (4 KiB to 4 MiB: 12.8-17.4 against 12.3-17.1 GB/s); above it
/// `memcpy` keeps its non-temporal stores for large copies.
pub const NEAR_ALIAS_MAX_BYTES: usize = 4 << 20;

/// Copies `len` bytes from `src` to `dst` like `std::ptr::copy_nonoverlapping`, avoiding
/// `memcpy`'s slow case for destinations just past their source modulo 4 KiB (see
/// `NEAR_ALIAS_MIN_BYTES`). Every host copy of object bytes goes through here.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: both ranges valid for `len` bytes, not overlapping.
#[inline]
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize) {
    let past = (dst as usize).wrapping_sub(src as usize) % 4096;
    if (NEAR_ALIAS_MIN_BYTES..NEAR_ALIAS_MAX_BYTES).contains(&len) && (1..64).contains(&past) {
        // SAFETY: the caller's contract.
        unsafe { copy_vectors(dst, src, len) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// A forward copy in vector steps (no `rep movsb`): 32-byte AVX2 stores on 64-byte boundaries
/// where the CPU has AVX2 (as fast as `memcpy` without the slow case, 4 KiB to 4 MiB, on the
/// machines measured), else 16-byte SSE2 loads and stores (about 0.85x).
///
/// # Safety
/// As `copy_bytes`.
#[inline(never)]
unsafe fn copy_vectors(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above); the caller's contract.
        return unsafe { copy_vectors_avx2(dst, src, len) };
    }
    // SAFETY: the caller's contract.
    unsafe { copy_vectors_sse2(dst, src, len) }
}

/// `copy_vectors` with 128-byte steps of unaligned 32-byte loads and aligned 32-byte stores: the
/// head up to the destination's next 64-byte boundary goes first, so no store splits a line.
///
/// # Safety
/// As `copy_bytes`, on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_vectors_avx2(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_store_si256};
    let head = ((dst as usize).wrapping_neg() & 63).min(len);
    // SAFETY: head <= len: inside both ranges (under 64 bytes: no `rep movsb`).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut done = head;
    while done + 128 <= len {
        // SAFETY: done + 128 <= len, inside both ranges; dst + done is 64-byte aligned (the
        // head brought it there and the steps keep it), as the aligned stores need; the loads
        // are unaligned.
        unsafe {
            let s = src.add(done).cast::<__m256i>();
            let d = dst.add(done).cast::<__m256i>();
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_store_si256(d, a);
            _mm256_store_si256(d.add(1), b);
            _mm256_store_si256(d.add(2), c);
            _mm256_store_si256(d.add(3), e);
        }
        done += 128;
    }
    // SAFETY: the rest (under 128 bytes) lies inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) }
}

/// `copy_vectors` in 64-byte steps of unaligned 16-byte loads and stores (any x86-64 CPU).
///
/// # Safety
/// As `copy_bytes`.
unsafe fn copy_vectors_sse2(dst: *mut u8, src: *const u8, len: usize) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
        while done + 64 <= len {
            // SAFETY: done + 64 <= len, inside both ranges; SSE2 is part of x86-64 and these
            // are unaligned loads and stores.
            unsafe {
                let s = src.add(done).cast::<__m128i>();
                let d = dst.add(done).cast::<__m128i>();
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_storeu_si128(d, a);
                _mm_storeu_si128(d.add(1), b);
                _mm_storeu_si128(d.add(2), c);
                _mm_storeu_si128(d.add(3), e);
            }
            done += 64;
        }
    }
    // SAFETY: the rest lies inside both ranges (under 64 bytes on x86-64).
    unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) }
}

/// CPU memcpy between host regions.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemcpyTransport;

impl MemcpyTransport {
    /// True when this transport can reach both kinds.
    pub fn supports(src: MemoryKind, dst: MemoryKind) -> bool {
        src.is_host() && dst.is_host()
    }
}

impl Transport for MemcpyTransport {
    fn name(&self) -> &'static str {
        "memcpy"
    }

    fn completes_inline(&self) -> bool {
        true
    }

    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        _early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        let mut bytes = 0;
        let results = transfers
            .iter()
            .map(|t| {
                // SAFETY: forwarded contract (checked regions, host bytes valid until we return).
                let copied = unsafe { copy_transfer(t, direction) };
                bytes += if copied.is_ok() { t.bytes() } else { 0 };
                copied
            })
            .collect();
        Ok(InFlight::completed(results, Summary { bytes, copy_calls: transfers.len() as u64, ..Summary::default() }))
    }
}

/// Copies one transfer's pieces on the CPU after checking every piece lies inside the object
/// and is host memory; nothing is copied when a check fails. `submit` of one transfer without
/// its result list and summary (single-key calls).
///
/// # Safety
/// As `Transport::submit`.
pub unsafe fn copy_transfer(t: &Transfer, direction: Direction) -> Result<(), TransportError> {
    // SAFETY: forwarded contract.
    unsafe { copy_pieces(t.host, t.host_len, &t.pieces, direction) }
}

/// `copy_transfer` of the transfer (`host`, `host_len`, `pieces`) without owning its pieces:
/// callers that plan one object at a time reuse one piece list.
///
/// # Safety
/// As `Transport::submit`.
pub unsafe fn copy_pieces(
    host: u64,
    host_len: u64,
    pieces: &[Piece],
    direction: Direction,
) -> Result<(), TransportError> {
    for p in pieces {
        if !p.kind.is_host() {
            return Err(TransportError::CudaUnavailable("device regions need the cuda transport"));
        }
        crate::region::check_range("object", p.host_offset, p.len, host_len)?;
    }
    for p in pieces.iter().filter(|p| p.len > 0) {
        let object = (host + p.host_offset) as *mut u8;
        let page = p.addr as *mut u8;
        let (src, dst) = match direction {
            Direction::HostToDevice => (object.cast_const(), page),
            Direction::DeviceToHost => (page.cast_const(), object),
        };
        // SAFETY: the piece lies inside the object (checked above) and the caller vouches for
        // the page side; leased or reserved arena bytes never overlap caller memory.
        unsafe {
            if host_len >= NONTEMPORAL_OBJECT_BYTES && p.len >= NONTEMPORAL_PIECE_BYTES {
                copy_nontemporal(dst, src, p.len as usize)
            } else {
                copy_bytes(dst, src, p.len as usize)
            }
        };
    }
    Ok(())
}

/// Copies `len` bytes from `src[src_offset..]` to `dst[dst_offset..]`, both host regions.
///
/// # Safety
/// The regions must honour `Region::from_raw`'s contract for the duration of the call, and no
/// other thread may write the source range or touch the destination range meanwhile (the engine
/// guarantees the source with a lease; the caller owns the destination).
pub unsafe fn copy_regions(
    src: &Region<'_>,
    src_offset: u64,
    dst: &Region<'_>,
    dst_offset: u64,
    len: u64,
) -> Result<(), TransportError> {
    if !MemcpyTransport::supports(src.kind(), dst.kind()) {
        return Err(TransportError::CudaUnavailable("device regions need the cuda transport"));
    }
    dst.check_writable()?;
    src.check_range(src_offset, len).map_err(|e| relabel(e, "source"))?;
    dst.check_range(dst_offset, len)?;
    if len == 0 {
        return Ok(());
    }
    // SAFETY: both ranges were checked against their regions above, the regions are valid host
    // memory by this function's contract, and a source range (leased arena bytes) never overlaps
    // a caller's destination buffer.
    unsafe { copy_bytes((dst.addr() + dst_offset) as *mut u8, (src.addr() + src_offset) as *const u8, len as usize) };
    Ok(())
}

fn relabel(e: RegionError, what: &'static str) -> RegionError {
    match e {
        RegionError::OutOfBounds { offset, len, bound, .. } => RegionError::OutOfBounds { what, offset, len, bound },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_exact_bytes_and_checks_bounds() {
        let src_buf: Vec<u8> = (0..64u8).collect();
        let mut dst_buf = vec![0u8; 64];
        let src = Region::host_readonly(&src_buf);
        let dst = Region::host(&mut dst_buf);
        // SAFETY: both regions borrow live local buffers that nothing else touches.
        unsafe {
            copy_regions(&src, 8, &dst, 16, 8).expect("copy");
            assert!(copy_regions(&src, 60, &dst, 0, 8).is_err());
            assert!(copy_regions(&src, 0, &dst, 60, 8).is_err());
        }
        assert_eq!(&dst_buf[16..24], &src_buf[8..16]);
        assert!(dst_buf[..16].iter().all(|&b| b == 0));
        assert!(dst_buf[24..].iter().all(|&b| b == 0));
    }

    #[test]
    fn the_transport_reports_per_transfer_and_copies_nothing_of_a_bad_one() {
        let object: Vec<u8> = (0..32u8).collect();
        let mut a = vec![0u8; 16];
        let mut b = vec![0u8; 16];
        let piece = |host_offset, buf: &mut Vec<u8>, len| crate::Piece {
            host_offset,
            addr: buf.as_mut_ptr() as u64,
            len,
            kind: MemoryKind::Host,
        };
        let good = Transfer { host: object.as_ptr() as u64, host_len: 32, pieces: vec![piece(8, &mut a, 16)] };
        // The second piece reaches past the object: the whole transfer fails, nothing lands.
        let bad = Transfer {
            host: object.as_ptr() as u64,
            host_len: 32,
            pieces: vec![piece(0, &mut b, 8), piece(30, &mut b, 4)],
        };
        // SAFETY: every buffer is a live local untouched until `wait` returned.
        let results =
            unsafe { MemcpyTransport.submit(Direction::HostToDevice, &[good, bad], None) }.expect("submit").wait();
        assert_eq!(results[0], Ok(()));
        assert!(matches!(results[1], Err(TransportError::Region(_))));
        assert_eq!(&a[..], &object[8..24]);
        assert!(b.iter().all(|&x| x == 0));
        // Gathering back into an object.
        let mut into = vec![0u8; 16];
        let gather = Transfer { host: into.as_mut_ptr() as u64, host_len: 16, pieces: vec![piece(0, &mut a, 16)] };
        // SAFETY: as above.
        let results =
            unsafe { MemcpyTransport.submit(Direction::DeviceToHost, &[gather], None) }.expect("submit").wait();
        assert_eq!(results, vec![Ok(())]);
        assert_eq!(&into[..], &object[8..24]);
    }

    #[test]
    fn device_regions_are_refused_without_cuda() {
        let src_buf = [1u8; 8];
        let src = Region::host_readonly(&src_buf);
        // SAFETY: the region is never dereferenced: the transport refuses device memory first.
        let dev = unsafe { Region::from_raw(0x1000, 8, MemoryKind::Device { ordinal: 0 }) };
        // SAFETY: as above.
        let err = unsafe { copy_regions(&src, 0, &dev, 0, 8) };
        assert!(matches!(err, Err(TransportError::CudaUnavailable(_))));
    }
}

/// Copies `len` bytes from `src` to `dst` with non-temporal (streaming) stores: the destination
/// bypasses the caches, so a large copy moves each byte over the memory bus twice (read, write)
/// instead of three times (read, read-for-ownership, write). It is what the C library's memcpy
/// does past its own size threshold; a copy cut into chunks below that threshold needs it
/// explicitly to keep the whole copy's speed. Not x86-64: a plain copy.
///
/// # Safety
/// `src` must be valid for `len` reads and `dst` for `len` writes, and the ranges must not
/// overlap.
pub unsafe fn copy_nontemporal(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LANE: usize = 16;
        // The head up to a 16-byte aligned destination, with a plain copy.
        let head = (dst as usize).wrapping_neg() % LANE;
        let head = head.min(len);
        // SAFETY: within the caller's ranges (head <= len).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let body = (len - head) / LANE;
        // Four lanes a step: the loads of a step are issued before its stores (one lane a step
        // ran at 0.75x: direct puts of 64 KiB to 1 MiB values, docs/benchmarks.md).
        let mut i = 0;
        while i + 4 <= body {
            let offset = head + i * LANE;
            // SAFETY: offset + 64 <= len; the destination is 16-byte aligned here (head made it
            // so, and steps are multiples of 16) as `_mm_stream_si128` requires; SSE2 is part of
            // x86-64; the loads are unaligned loads.
            unsafe {
                let s = src.add(offset).cast::<__m128i>();
                let d = dst.add(offset).cast::<__m128i>();
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            i += 4;
        }
        while i < body {
            let offset = head + i * LANE;
            // SAFETY: offset + 16 <= len; aligned as above.
            unsafe {
                let v = _mm_loadu_si128(src.add(offset).cast::<__m128i>());
                _mm_stream_si128(dst.add(offset).cast::<__m128i>(), v);
            }
            i += 1;
        }
        let done = head + body * LANE;
        // SAFETY: the tail is within the caller's ranges; the fence orders the streaming stores
        // before any later store or load of whoever is told the copy finished.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}

#[cfg(test)]
mod nontemporal_tests {
    #[test]
    fn streaming_copies_are_exact_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for src_off in [0usize, 1, 7, 16] {
            for dst_off in [0usize, 1, 5, 15, 16] {
                for len in [0usize, 1, 15, 16, 17, 63, 64, 65, 80, 100, 1000, 4000 - 32] {
                    let mut dst = vec![0xEEu8; 4096];
                    // SAFETY: both ranges lie inside their vectors, which do not overlap.
                    unsafe { super::copy_nontemporal(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len], "{src_off} {dst_off} {len}");
                    assert!(dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&b| b == 0xEE));
                }
            }
        }
    }
}

#[cfg(test)]
mod copy_bytes_tests {
    /// Every placement `copy_bytes` may send to `copy_vectors` (1 to 63 bytes past the source
    /// modulo 4 KiB) and the ones it leaves to `memcpy`, at lengths around its bounds and its
    /// 64-byte steps: exact bytes, nothing outside the destination touched.
    #[test]
    fn copies_are_exact_near_and_away_from_4k_aliasing() {
        let src: Vec<u8> = (0..(80u32 << 10)).map(|i| (i * 131 + 7) as u8).collect();
        let mut page = vec![0u8; 96 << 10];
        type Copy = unsafe fn(*mut u8, *const u8, usize);
        let copies: [(&str, Copy); 3] = [
            ("copy_bytes", super::copy_bytes),
            ("copy_vectors", super::copy_vectors),
            ("sse2", super::copy_vectors_sse2),
        ];
        for (name, copy) in copies {
            // The source on a 4 KiB boundary or past one (unaligned loads); the destination
            // past it by `past` (each head length before the aligned stores).
            for shift in [0usize, 5, 40] {
                let src_at = (src.as_ptr() as usize).wrapping_neg() % 4096 + shift;
                let base = (page.as_ptr() as usize).wrapping_neg() % 4096 + shift;
                for past in [0usize, 1, 8, 16, 31, 32, 63, 64, 100] {
                    for len in [0usize, 63, 127, 128, 2047, 2048, 2049, 2048 + 63, 2048 + 191, 4096, 4096 + 1, 65 << 10]
                    {
                        page.fill(0xEE);
                        let dst_at = base + past;
                        // SAFETY: both ranges lie inside their vectors, which do not overlap.
                        unsafe { copy(page.as_mut_ptr().add(dst_at), src.as_ptr().add(src_at), len) };
                        let at = format!("{name}: shift {shift} past {past} len {len}");
                        assert_eq!(&page[dst_at..dst_at + len], &src[src_at..src_at + len], "{at}");
                        assert!(page[..dst_at].iter().chain(&page[dst_at + len..]).all(|&b| b == 0xEE), "{at}");
                    }
                }
            }
        }
    }
}
