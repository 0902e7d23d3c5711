//! GPU transfer planning: which path a request takes and how its bytes are laid out.
//!
//! Pure code, compiled in every build so CI tests it without a GPU. It decides between the
//! staged path (one contiguous staging buffer on the GPU, ONE scatter or gather kernel launch per
//! buffer fill) and the direct path (one copy per piece, contiguous neighbours merged), splits a
//! staged batch into fills at object boundaries, places objects in the buffer and builds the
//! kernel's descriptor table and the bulk copies. It never touches memory or the driver: the
//! paths in `cuda::device` and `cuda::bound` submit what this module describes.

use std::ops::Range;

use crate::region::MemoryKind;

pub use crate::transfer::{Direction, Fallback, Piece, Transfer};

/// A store's staging settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingPolicy {
    /// Opt-in: false sends every request down the direct path.
    pub enabled: bool,
    /// Payload budget of the device staging buffer.
    pub buffer_bytes: u64,
    /// Fills shrink towards the end of a request, down to about this many bytes (or the largest
    /// object), so little kernel work is left once the last copy lands. 0 keeps every fill at
    /// the quarter/half/whole-buffer fill size.
    pub tail_fill_bytes: u64,
}

/// The outcome of qualification (before the busy check, which `cuda::device` makes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathChoice {
    /// Staged through the buffer of this GPU.
    Staged { ordinal: u32 },
    /// Direct copies, for this reason.
    Direct(Fallback),
}

/// What one pass over a request's pieces finds: the path it qualifies for and, for a staged
/// request, what planning its fills needs of each transfer, so no later step walks every piece
/// again to find it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Survey {
    pub choice: PathChoice,
    /// Each transfer's host span (`Transfer::span`); empty unless staged.
    pub spans: Vec<Range<u64>>,
    /// An upper bound of the request's table rows (one per started `DESCRIPTOR_CHUNK_BYTES` of
    /// each piece, before neighbours merge), to size tables; 0 unless staged.
    pub rows: usize,
}

/// Decides whether a request qualifies for staging. Reads need non-overlapping destinations;
/// writes only read their pages, so overlapping sources are allowed.
pub fn qualify(policy: StagingPolicy, direction: Direction, transfers: &[Transfer]) -> PathChoice {
    survey(policy, direction, transfers).choice
}

impl Survey {
    /// Each transfer's host address and span, what `split_fills` lays a staged request out by.
    pub fn host_spans(&self, transfers: &[Transfer]) -> Vec<(u64, Range<u64>)> {
        transfers.iter().zip(&self.spans).map(|(t, span)| (t.host, span.clone())).collect()
    }
}

/// `qualify`, with the spans and the row bound a staged request is planned with.
pub fn survey(policy: StagingPolicy, direction: Direction, transfers: &[Transfer]) -> Survey {
    let direct = |reason| Survey { choice: PathChoice::Direct(reason), spans: Vec::new(), rows: 0 };
    if !policy.enabled {
        return direct(Fallback::Disabled);
    }
    let mut ordinal = None;
    let (mut pieces, mut objects, mut rows) = (0usize, 0usize, 0usize);
    let mut too_large = false;
    // Only reads check their destinations for overlap.
    let check_overlap = direction == Direction::HostToDevice;
    let mut bounds = Bounds::default();
    let mut spans = Vec::with_capacity(transfers.len());
    for transfer in transfers {
        let (mut low, mut high) = (u64::MAX, 0u64);
        for piece in &transfer.pieces {
            let MemoryKind::Device { ordinal: o } = piece.kind else {
                return direct(Fallback::NotDevice);
            };
            if *ordinal.get_or_insert(o) != o {
                return direct(Fallback::SeveralDevices);
            }
            low = low.min(piece.host_offset);
            high = high.max(piece.host_offset + piece.len);
            rows += piece.len.div_ceil(DESCRIPTOR_CHUNK_BYTES) as usize;
            if check_overlap {
                bounds.add(piece.addr, piece.len);
            }
        }
        if transfer.pieces.is_empty() {
            spans.push(0..0);
            continue;
        }
        spans.push(low..high.max(low));
        too_large |= high.saturating_sub(low) > policy.buffer_bytes;
        pieces += transfer.pieces.len();
        objects += 1;
    }
    let Some(ordinal) = ordinal else { return direct(Fallback::Empty) };
    if too_large {
        return direct(Fallback::TooLarge);
    }
    if check_overlap && overlapping_within(transfers, &bounds) {
        return direct(Fallback::Overlap);
    }
    if pieces <= objects {
        return direct(Fallback::NotFragmented);
    }
    Survey { choice: PathChoice::Staged { ordinal }, spans, rows }
}

/// The extent of a request's non-empty pieces, for `overlapping`.
#[derive(Clone, Copy, Debug)]
struct Bounds {
    low: u64,
    high: u64,
    total: u64,
    width: u64,
    count: u64,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds { low: u64::MAX, high: 0, total: 0, width: u64::MAX, count: 0 }
    }
}

impl Bounds {
    fn add(&mut self, addr: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.low = self.low.min(addr);
        self.high = self.high.max(addr + len);
        self.total += len;
        self.width = self.width.min(len);
        self.count += 1;
    }
}

/// True when two pieces' page ranges overlap. Linear time for page-sized pieces: starts are
/// marked in a bitmap of buckets as wide as the smallest piece (two non-overlapping pieces never
/// start in one bucket), so a piece only needs a look at the buckets it covers, and none when
/// every piece lies inside one bucket; an ambiguous or sparse layout falls back to a sort.
pub fn overlapping(transfers: &[Transfer]) -> bool {
    let mut bounds = Bounds::default();
    for t in transfers {
        for p in &t.pieces {
            bounds.add(p.addr, p.len);
        }
    }
    overlapping_within(transfers, &bounds)
}

/// `overlapping`, with the pieces' extent measured already.
fn overlapping_within(transfers: &[Transfer], bounds: &Bounds) -> bool {
    let Bounds { low, high, total, width, count } = *bounds;
    if count < 2 {
        return false;
    }
    if total > high - low {
        return true; // more bytes than room: some two must share one
    }
    // A shift where the width is a power of two (page sizes are): a division per piece costs
    // more than the rest of the check.
    let (pow2, shift) = (width.is_power_of_two(), width.ilog2());
    let bucket = |offset: u64| if pow2 { offset >> shift } else { offset / width };
    let buckets = bucket(high - 1 - low) + 1;
    if buckets <= 8 * count + 65_536 {
        let mut marks = vec![0u64; buckets.div_ceil(64) as usize];
        let mut wide = false;
        for t in transfers {
            for p in t.pieces.iter().filter(|p| p.len > 0) {
                let k = bucket(p.addr - low);
                let (word, bit) = ((k / 64) as usize, 1u64 << (k % 64));
                if marks[word] & bit != 0 {
                    return true;
                }
                marks[word] |= bit;
                wide |= bucket(p.addr + p.len - 1 - low) > k;
            }
        }
        // Every piece inside one bucket: two that overlap would have started in the same one.
        if !wide {
            return false;
        }
        let marked = |k: u64| marks[(k / 64) as usize] & (1u64 << (k % 64)) != 0;
        let mut ambiguous = false;
        for t in transfers {
            for p in t.pieces.iter().filter(|p| p.len > 0) {
                let first = bucket(p.addr - low);
                let last = bucket(p.addr + p.len - 1 - low);
                // A start in a bucket wholly inside this piece overlaps it; one in the last bucket
                // may begin at or after its end: the exact check below decides.
                if (first + 1..last).any(marked) {
                    return true;
                }
                ambiguous |= last > first && marked(last);
            }
        }
        if !ambiguous {
            return false;
        }
    }
    let mut ranges: Vec<(u64, u64)> =
        transfers.iter().flat_map(|t| &t.pieces).filter(|p| p.len > 0).map(|p| (p.addr, p.addr + p.len)).collect();
    ranges.sort_unstable_by_key(|r| r.0);
    ranges.windows(2).any(|w| w[1].0 < w[0].1)
}

/// Where one object sits in the staging buffer during its fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Index into the request's transfers.
    pub transfer: usize,
    /// Offset of the staged span in the buffer.
    pub staging_offset: u64,
    /// The object's host byte range that is staged.
    pub span: (u64, u64),
}

/// One buffer fill: whole objects, ONE kernel launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fill {
    /// The objects of this fill (consecutive transfers: split at key boundaries).
    pub transfers: Range<usize>,
    pub placements: Vec<Placement>,
    /// Buffer bytes used: `[region.start, region.end)` of the buffer.
    pub region: Range<u64>,
}

impl Fill {
    /// This fill of a part of a request, placed in the whole request: its transfer indices
    /// (the part's own) moved on by `by`, the part's first index.
    pub fn shifted(mut self, by: usize) -> Fill {
        self.transfers = self.transfers.start + by..self.transfers.end + by;
        for placement in &mut self.placements {
            placement.transfer += by;
        }
        self
    }
}

/// Staged byte offsets keep the host address's alignment modulo this, so a page whose address
/// agrees with its object bytes gets 16-byte vector copies.
pub const STAGING_ALIGN_BYTES: u64 = 16;

/// Largest fill of a request whose largest object has `largest` bytes: a quarter of the buffer
/// when every object fits a quarter, else half, else the whole buffer. Fills take turns over
/// the buffer, so the copy of one fill overlaps the kernel of the previous one.
fn fill_capacity(buffer_bytes: u64, largest: u64) -> u64 {
    if largest <= buffer_bytes / 4 {
        buffer_bytes / 4
    } else if largest <= buffer_bytes / 2 {
        buffer_bytes / 2
    } else {
        buffer_bytes
    }
}

/// The capacity of the next fill once `placed` of the request's `total` bytes were placed.
/// Reads shrink their fills geometrically towards the end (each at most half of what is left)
/// down to the tail size or the largest object: each fill's scatter runs while the next,
/// smaller fill copies, and what is left after the last copy is one small scatter. Writes are
/// the mirror image: they start small (the first device-to-host copy waits for only a small
/// gather) and grow, each fill as large as everything before it.
fn next_fill_capacity(policy: &StagingPolicy, direction: Direction, total: u64, largest: u64, placed: u64) -> u64 {
    let base = fill_capacity(policy.buffer_bytes, largest);
    if policy.tail_fill_bytes == 0 {
        return base;
    }
    // A request that fits the buffer never wraps, so a fill may take up to half of it.
    let base = if total <= policy.buffer_bytes { policy.buffer_bytes } else { base };
    let floor = policy.tail_fill_bytes.max(largest).min(base);
    let shaped = match direction {
        Direction::HostToDevice => (total - placed) / 2,
        Direction::DeviceToHost => placed,
    };
    base.min(shaped.max(floor))
}

/// What laying out fills needs of a transfer: where its host bytes start and the range of them
/// it moves. A prestage lays out whole objects, `(host address, length)`, before their transfers
/// exist.
pub trait HostSpan {
    fn host(&self) -> u64;
    fn span(&self) -> Range<u64>;
}

impl HostSpan for Transfer {
    fn host(&self) -> u64 {
        self.host
    }
    fn span(&self) -> Range<u64> {
        Transfer::span(self)
    }
}

impl HostSpan for (u64, Range<u64>) {
    fn host(&self) -> u64 {
        self.0
    }
    fn span(&self) -> Range<u64> {
        self.1.clone()
    }
}

impl HostSpan for (u64, u64) {
    fn host(&self) -> u64 {
        self.0
    }
    fn span(&self) -> Range<u64> {
        0..self.1
    }
}

/// Splits a qualified request into fills at object boundaries, in order, and places each object
/// in the buffer. Fills take turns over the buffer like a ring; `cuda::device` makes a fill wait
/// for the earlier fills whose regions it reuses. Objects larger than the buffer must have been
/// sent down the direct path by `qualify`; here they get a fill of their own and are clamped.
pub fn split_fills<T: HostSpan>(policy: &StagingPolicy, direction: Direction, transfers: &[T]) -> Vec<Fill> {
    split_fills_from(policy, direction, transfers, &mut FillCursor::default())
}

/// Where the fills of a request submitted in parts stand between its parts: the next fill
/// continues the ring where the last one ended, and fills keep the size the whole request's
/// shape gives them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FillCursor {
    /// Buffer offset where the last fill ended.
    pub ring: u64,
    /// Bytes placed by earlier parts.
    pub placed: u64,
    /// Bytes of the whole request (0: only what is being split is known).
    pub total: u64,
    /// Largest object seen so far.
    pub largest: u64,
}

/// `split_fills` for one part of a request: fills start where `cursor` says and size themselves
/// for the whole request; `cursor` moves past them. Transfer indices are the part's own.
pub fn split_fills_from<T: HostSpan>(
    policy: &StagingPolicy,
    direction: Direction,
    transfers: &[T],
    cursor: &mut FillCursor,
) -> Vec<Fill> {
    let buffer_bytes = policy.buffer_bytes;
    let spans: Vec<Range<u64>> = transfers.iter().map(HostSpan::span).collect();
    let part: u64 = spans.iter().map(|s| s.end - s.start).sum();
    let total = cursor.total.max(cursor.placed + part);
    let largest = spans.iter().map(|s| s.end - s.start).max().unwrap_or(0).max(cursor.largest);
    let capacity_at = |placed: u64| next_fill_capacity(policy, direction, total, largest, placed).max(1);
    let mut fills: Vec<Fill> = Vec::new();
    let mut ring_cursor = cursor.ring;
    let mut placed = cursor.placed;
    // The open fill and its capacity.
    let mut current: Option<(Fill, u64)> = None;
    for (index, transfer) in transfers.iter().enumerate() {
        let span = spans[index].clone();
        let len = span.end - span.start;
        let congruence = (transfer.host() + span.start) % STAGING_ALIGN_BYTES;
        let place_at = |cursor: u64| {
            let misalign = (congruence + STAGING_ALIGN_BYTES - cursor % STAGING_ALIGN_BYTES) % STAGING_ALIGN_BYTES;
            cursor + misalign
        };
        if let Some((fill, capacity)) = current.as_mut() {
            let at = place_at(fill.region.end);
            if at + len - fill.region.start <= *capacity && at + len <= buffer_bytes {
                fill.placements.push(Placement { transfer: index, staging_offset: at, span: (span.start, span.end) });
                fill.region.end = at + len;
                fill.transfers.end = index + 1;
                placed += len;
                continue;
            }
            if let Some((mut closed, capacity)) = current.take() {
                place_by_address(&mut closed, capacity, buffer_bytes, transfers);
                ring_cursor = closed.region.end;
                fills.push(closed);
            }
        }
        let capacity = capacity_at(placed);
        // A new fill continues the ring where the last one ended, or wraps to the start when a
        // full fill would not fit before the end.
        let start = if ring_cursor + capacity > buffer_bytes { 0 } else { ring_cursor };
        // Clamped only when padding would push an object of nearly the buffer's size past its
        // end (it then loses the alignment congruence, not correctness).
        let at = place_at(start).min(buffer_bytes.saturating_sub(len));
        current = Some((
            Fill {
                transfers: index..index + 1,
                placements: vec![Placement { transfer: index, staging_offset: at, span: (span.start, span.end) }],
                region: start.min(at)..at + len,
            },
            capacity,
        ));
        placed += len;
    }
    if let Some((mut closed, capacity)) = current {
        place_by_address(&mut closed, capacity, buffer_bytes, transfers);
        ring_cursor = closed.region.end;
        fills.push(closed);
    }
    *cursor = FillCursor { ring: ring_cursor, placed, total, largest };
    fills
}

/// Re-places a fill's objects in host-address order: objects that sit next to each other in the
/// arena (written one after another) then sit next to each other in the buffer too, and their
/// host copies merge. Kept only when it still fits (alignment padding can differ).
fn place_by_address<T: HostSpan>(fill: &mut Fill, capacity: u64, buffer_bytes: u64, transfers: &[T]) {
    let mut order = fill.placements.clone();
    order.sort_by_key(|p| transfers[p.transfer].host() + p.span.0);
    let mut cursor = fill.region.start;
    for p in &mut order {
        let congruence = (transfers[p.transfer].host() + p.span.0) % STAGING_ALIGN_BYTES;
        cursor += (congruence + STAGING_ALIGN_BYTES - cursor % STAGING_ALIGN_BYTES) % STAGING_ALIGN_BYTES;
        p.staging_offset = cursor;
        cursor += p.span.1 - p.span.0;
    }
    if cursor - fill.region.start <= capacity && cursor <= buffer_bytes {
        fill.placements = order;
        fill.region.end = cursor;
    }
}

/// True when two buffer regions overlap (a later fill must wait for the earlier one's kernel).
pub fn regions_overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

/// One row of the scatter/gather kernel's table: `len` bytes between the page at `page` and the
/// buffer at `staging_offset`. Same layout as `struct Desc` in `scatter.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub page: u64,
    pub staging_offset: u32,
    pub len: u32,
}

/// Rows longer than this are split, so one thread block never gets a whole 12 MiB page.
pub const DESCRIPTOR_CHUNK_BYTES: u64 = 64 << 10;

/// The kernel table of a fill: one row per piece (contiguous neighbours merged), long rows cut
/// into `DESCRIPTOR_CHUNK_BYTES`.
pub fn descriptors(fill: &Fill, transfers: &[Transfer]) -> Vec<Descriptor> {
    let mut out = Vec::new();
    each_descriptor(fill, transfers, |row| {
        out.push(row);
        true
    });
    out
}

/// `descriptors` written into `out` (the pinned table the kernel reads, say) without a list in
/// between: the number of rows, or None when they do not fit (`out` then holds a prefix).
pub fn descriptors_into(fill: &Fill, transfers: &[Transfer], out: &mut [Descriptor]) -> Option<usize> {
    let mut written = 0;
    let fits = each_descriptor(fill, transfers, |row| match out.get_mut(written) {
        Some(slot) => {
            *slot = row;
            written += 1;
            true
        }
        None => false,
    });
    fits.then_some(written)
}

/// Hands `emit` each row of a fill's table in order; false as soon as `emit` refuses one.
fn each_descriptor(fill: &Fill, transfers: &[Transfer], mut emit: impl FnMut(Descriptor) -> bool) -> bool {
    // The open row, (page, staging offset, len), grown while pieces continue it.
    let mut open: Option<(u64, u64, u64)> = None;
    let flush = |(page, staging, len): (u64, u64, u64), emit: &mut dyn FnMut(Descriptor) -> bool| {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(DESCRIPTOR_CHUNK_BYTES);
            if !emit(Descriptor { page: page + done, staging_offset: (staging + done) as u32, len: n as u32 }) {
                return false;
            }
            done += n;
        }
        true
    };
    for placement in &fill.placements {
        for piece in transfers[placement.transfer].pieces.iter().filter(|p| p.len > 0) {
            let staging = placement.staging_offset + (piece.host_offset - placement.span.0);
            match open.as_mut() {
                Some(last) if last.0 + last.2 == piece.addr && last.1 + last.2 == staging => last.2 += piece.len,
                _ => {
                    if let Some(row) = open.replace((piece.addr, staging, piece.len)) {
                        if !flush(row, &mut emit) {
                            return false;
                        }
                    }
                }
            }
        }
    }
    match open {
        Some(row) => flush(row, &mut emit),
        None => true,
    }
}

/// One bulk copy between host memory and device memory (`device_offset` is inside the staging
/// buffer for staged plans, an absolute device address for direct ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BulkCopy {
    pub host: u64,
    pub device: u64,
    pub len: u64,
}

/// The host <-> buffer copies of a fill: one per object, merged where both the host bytes and the
/// buffer offsets are contiguous (objects written one after another sit next to each other in the
/// arena).
pub fn staging_copies<T: HostSpan>(fill: &Fill, transfers: &[T]) -> Vec<BulkCopy> {
    let mut copies: Vec<BulkCopy> = Vec::new();
    let mut placements = fill.placements.clone();
    placements.sort_unstable_by_key(|p| p.staging_offset);
    for p in placements {
        let host = transfers[p.transfer].host() + p.span.0;
        let len = p.span.1 - p.span.0;
        if len == 0 {
            continue;
        }
        match copies.last_mut() {
            Some(last) if last.host + last.len == host && last.device + last.len == p.staging_offset => last.len += len,
            _ => copies.push(BulkCopy { host, device: p.staging_offset, len }),
        }
    }
    copies
}

/// The direct path's copies for one GPU: one per device piece, contiguous neighbours (in request
/// order) merged. Host pieces are left to the CPU.
pub fn direct_copies(transfers: &[Transfer], ordinal: u32) -> Vec<BulkCopy> {
    let mut copies: Vec<BulkCopy> = Vec::new();
    for transfer in transfers {
        for piece in &transfer.pieces {
            if piece.kind != (MemoryKind::Device { ordinal }) || piece.len == 0 {
                continue;
            }
            let host = transfer.host + piece.host_offset;
            match copies.last_mut() {
                Some(last) if last.host + last.len == host && last.device + last.len == piece.addr => {
                    last.len += piece.len
                }
                _ => copies.push(BulkCopy { host, device: piece.addr, len: piece.len }),
            }
        }
    }
    copies
}

/// The GPUs a request touches, in first-seen order.
pub fn ordinals(transfers: &[Transfer]) -> Vec<u32> {
    let mut out = Vec::new();
    for piece in transfers.iter().flat_map(|t| &t.pieces) {
        if let MemoryKind::Device { ordinal } = piece.kind {
            if !out.contains(&ordinal) {
                out.push(ordinal);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU0: MemoryKind = MemoryKind::Device { ordinal: 0 };

    /// The row bound `survey` gives, computed on its own.
    fn max_rows(transfers: &[Transfer]) -> usize {
        transfers.iter().flat_map(|t| &t.pieces).map(|p| p.len.div_ceil(DESCRIPTOR_CHUNK_BYTES) as usize).sum()
    }

    /// A seeded xorshift: `next(m)` is a pseudo-random number below `m`.
    fn xorshift(mut state: u64) -> impl FnMut(u64) -> u64 {
        move |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        }
    }

    /// An object of `pages * page` bytes at `host`, scattered to `dst(i)`.
    fn object(host: u64, page: u64, pages: u64, dst: impl Fn(u64) -> u64) -> Transfer {
        Transfer {
            host,
            host_len: page * pages,
            pieces: (0..pages).map(|i| Piece { host_offset: i * page, addr: dst(i), len: page, kind: GPU0 }).collect(),
        }
    }

    /// Fills of a quarter buffer (no tail shaping).
    fn quarters(buffer_bytes: u64) -> StagingPolicy {
        StagingPolicy { enabled: true, buffer_bytes, tail_fill_bytes: 0 }
    }

    fn on() -> StagingPolicy {
        StagingPolicy { enabled: true, buffer_bytes: 1 << 20, tail_fill_bytes: 0 }
    }

    #[test]
    fn whole_objects_get_the_layout_of_their_transfers() {
        // Objects of four shards' slices interleaved in request order, of mixed sizes, some not
        // on a 4 KiB boundary; their transfers scatter them to shuffled pages.
        let mut objects: Vec<(u64, u64)> = (0..300u64)
            .map(|i| ((i % 4) * (1 << 34) + (i / 4) * (400 << 10) + (i % 3) * 256, (1 + i % 5) * (64 << 10)))
            .collect();
        for sorted in [false, true] {
            if sorted {
                objects.sort_unstable();
            }
            let transfers: Vec<Transfer> = objects
                .iter()
                .enumerate()
                .map(|(k, &(host, len))| {
                    object(host, 4096, len / 4096, |i| (1 << 40) + ((i * 7919 + k as u64) % 4096) * 4096)
                })
                .collect();
            for policy in
                [quarters(4 << 20), StagingPolicy { enabled: true, buffer_bytes: 16 << 20, tail_fill_bytes: 1 << 20 }]
            {
                for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
                    let fills = split_fills(&policy, direction, &objects);
                    assert!(fills.len() > 1);
                    assert_eq!(fills, split_fills(&policy, direction, &transfers));
                    for fill in &fills {
                        assert_eq!(staging_copies(fill, &objects), staging_copies(fill, &transfers));
                    }
                }
            }
        }
    }

    #[test]
    fn qualification_and_every_fallback() {
        let base = 0x7000_0000_0000;
        let good = vec![object(0x1000, 4096, 4, |i| base + (3 - i) * 8192)];
        assert_eq!(qualify(on(), Direction::HostToDevice, &good), PathChoice::Staged { ordinal: 0 });
        let off = StagingPolicy { enabled: false, ..on() };
        assert_eq!(qualify(off, Direction::HostToDevice, &good), PathChoice::Direct(Fallback::Disabled));
        assert_eq!(qualify(on(), Direction::HostToDevice, &[]), PathChoice::Direct(Fallback::Empty));

        let mut host_page = good.clone();
        host_page[0].pieces[1].kind = MemoryKind::Host;
        assert_eq!(qualify(on(), Direction::HostToDevice, &host_page), PathChoice::Direct(Fallback::NotDevice));

        let mut two_gpus = good.clone();
        two_gpus[0].pieces[2].kind = MemoryKind::Device { ordinal: 1 };
        assert_eq!(qualify(on(), Direction::HostToDevice, &two_gpus), PathChoice::Direct(Fallback::SeveralDevices));

        let overlap = vec![object(0x1000, 4096, 2, |i| base + i * 2048)];
        assert_eq!(qualify(on(), Direction::HostToDevice, &overlap), PathChoice::Direct(Fallback::Overlap));
        // Gathers only read their pages: overlapping sources are fine.
        assert_eq!(qualify(on(), Direction::DeviceToHost, &overlap), PathChoice::Staged { ordinal: 0 });

        let big = vec![object(0x1000, 1 << 20, 2, |i| base + i * (2 << 20))];
        assert_eq!(qualify(on(), Direction::HostToDevice, &big), PathChoice::Direct(Fallback::TooLarge));

        let whole = vec![object(0x1000, 4096, 1, |_| base), object(0x9000, 4096, 1, |_| base + 8192)];
        assert_eq!(qualify(on(), Direction::HostToDevice, &whole), PathChoice::Direct(Fallback::NotFragmented));
    }

    #[test]
    fn seven_keys_over_four_fills_split_at_key_boundaries() {
        // An 8 MiB buffer and seven 1 MiB objects (four 256 KiB pages each): fills hold a quarter
        // of the buffer, so two objects each -> 2 + 2 + 2 + 1.
        let page = 256 << 10;
        let transfers: Vec<Transfer> = (0..7u64)
            .map(|k| object(0x10_0000 + k * (1 << 20), page, 4, move |i| 0x7000_0000_0000 + (k * 4 + i) * page))
            .collect();
        let fills = split_fills(&quarters(8 << 20), Direction::HostToDevice, &transfers);
        let shape: Vec<Range<usize>> = fills.iter().map(|f| f.transfers.clone()).collect();
        assert_eq!(shape, vec![0..2, 2..4, 4..6, 6..7]);
        assert!(max_rows(&transfers) >= fills.iter().map(|f| descriptors(f, &transfers).len()).sum::<usize>());
        for fill in &fills {
            assert!(fill.region.end <= 8 << 20);
            assert!(fill.region.end - fill.region.start <= 2 << 20);
            // Objects contiguous in the arena are staged contiguously: one copy per fill.
            assert_eq!(staging_copies(fill, &transfers).len(), 1);
        }
        // The ring alternates halves, so fill i+1 never overwrites fill i.
        for pair in fills.windows(2) {
            assert!(!regions_overlap(&pair[0].region, &pair[1].region));
        }
    }

    #[test]
    fn fills_shrink_towards_the_tail() {
        // 128 objects of 2 MiB (256 MiB) in a 256 MiB buffer, tail 4 MiB: fills of about
        // 128, 64, 32, 16, 8, 4 and 4 MiB, none reusing another's region.
        let policy = StagingPolicy { enabled: true, buffer_bytes: 256 << 20, tail_fill_bytes: 4 << 20 };
        let transfers: Vec<Transfer> =
            (0..128u64).map(|k| object(k << 21, 8192, 256, move |i| 0x7_0000_0000 + (k * 256 + i) * 8192)).collect();
        let fills = split_fills(&policy, Direction::HostToDevice, &transfers);
        let sizes: Vec<u64> = fills.iter().map(|f| (f.region.end - f.region.start) >> 20).collect();
        assert_eq!(sizes, vec![128, 64, 32, 16, 8, 4, 4]);
        for (i, a) in fills.iter().enumerate() {
            assert!(fills[i + 1..].iter().all(|b| !regions_overlap(&a.region, &b.region)));
            assert_eq!(staging_copies(a, &transfers).len(), 1, "arena-contiguous objects merge");
        }
        assert_eq!(fills.iter().map(|f| f.transfers.len()).sum::<usize>(), 128);
        // Larger than the buffer: quarter fills, then shrinking ones; the last is one object.
        let big: Vec<Transfer> = (0..96u64)
            .map(|k| object(k * (12 << 20), 128 << 10, 96, move |i| 0x9_0000_0000 + (k * 96 + i) * (128 << 10)))
            .collect();
        let fills = split_fills(&policy, Direction::HostToDevice, &big);
        assert!(fills.iter().all(|f| f.region.end - f.region.start <= 64 << 20 && f.region.end <= 256 << 20));
        assert_eq!(fills.last().map(|f| f.transfers.len()), Some(1));
        assert_eq!(fills.iter().map(|f| f.transfers.len()).sum::<usize>(), 96);
        // Writes grow instead: 4, 4, 8, 16, 32, 64 and 128 MiB.
        let writes = split_fills(&policy, Direction::DeviceToHost, &transfers);
        let sizes: Vec<u64> = writes.iter().map(|f| (f.region.end - f.region.start) >> 20).collect();
        assert_eq!(sizes, vec![4, 4, 8, 16, 32, 64, 128]);
        // Tail shaping off: fixed quarter fills.
        let fixed = split_fills(&StagingPolicy { tail_fill_bytes: 0, ..policy }, Direction::HostToDevice, &transfers);
        assert_eq!(fixed.len(), 4);
    }

    #[test]
    fn a_request_in_parts_continues_the_ring_and_keeps_the_whole_requests_shape() {
        // The 256 MiB gathered write above, handed over in parts of 4, 4, 8, 16, 32 and 4 x 48
        // objects of 2 MiB: its fills still grow from 4 MiB, every fill starts where the last
        // one ended (or at the start of the buffer), and no fill overlaps the one before it.
        let policy = StagingPolicy { enabled: true, buffer_bytes: 256 << 20, tail_fill_bytes: 4 << 20 };
        let transfers: Vec<Transfer> =
            (0..128u64).map(|k| object(k << 21, 8192, 256, move |i| 0x7_0000_0000 + (k * 256 + i) * 8192)).collect();
        let mut cursor = FillCursor { total: 256 << 20, ..FillCursor::default() };
        let mut fills: Vec<(usize, Fill)> = Vec::new();
        let mut start = 0;
        for len in [2usize, 2, 4, 8, 16, 24, 24, 24, 24] {
            let part = &transfers[start..start + len];
            for fill in split_fills_from(&policy, Direction::DeviceToHost, part, &mut cursor) {
                assert!(fill.transfers.end <= len, "indices are the part's own");
                fills.push((start, fill));
            }
            start += len;
        }
        assert_eq!(start, 128);
        assert_eq!(cursor.placed, 256 << 20);
        let sizes: Vec<u64> = fills.iter().map(|(_, f)| (f.region.end - f.region.start) >> 20).collect();
        assert_eq!(&sizes[..4], &[4, 4, 8, 16], "{sizes:?}");
        let mut covered = 0;
        for (i, (base, fill)) in fills.iter().enumerate() {
            assert_eq!(base + fill.transfers.start, covered, "every object once, in order");
            covered = base + fill.transfers.end;
            assert!(fill.region.end <= 256 << 20);
            if let Some((_, before)) = i.checked_sub(1).map(|j| &fills[j]) {
                assert!(fill.region.start == before.region.end || fill.region.start == 0, "{:?}", fill.region);
                assert!(!regions_overlap(&before.region, &fill.region));
            }
        }
        assert_eq!(covered, 128);
    }

    #[test]
    fn a_read_laid_out_part_by_part_indexes_the_whole_request() {
        // A staged read's early start lays out each leasing part as it is granted (32, 128 and
        // 40 objects of 384 KiB over two arena slices) and shifts the part's fills into the
        // whole request: every object once and in order, each placement inside its fill and the
        // buffer, its copies moving exactly its bytes, and no fill reusing the one before it.
        let policy = StagingPolicy { enabled: true, buffer_bytes: 32 << 20, tail_fill_bytes: 1 << 20 };
        let object_bytes = 384u64 << 10;
        let mut objects: Vec<(u64, u64)> =
            (0..200u64).map(|k| ((k % 2) * (1 << 36) + (k / 2) * object_bytes, object_bytes)).collect();
        let mut cursor = FillCursor { total: 200 * object_bytes, ..FillCursor::default() };
        let mut fills: Vec<Fill> = Vec::new();
        let mut from = 0;
        for len in [32usize, 128, 40] {
            let part = &mut objects[from..from + len];
            part.sort_unstable();
            let part: &[(u64, u64)] = part;
            fills.extend(
                split_fills_from(&policy, Direction::HostToDevice, part, &mut cursor)
                    .into_iter()
                    .map(|f| f.shifted(from)),
            );
            from += len;
        }
        let mut covered = 0;
        for (i, fill) in fills.iter().enumerate() {
            assert_eq!(fill.transfers.start, covered, "every object once, in order");
            covered = fill.transfers.end;
            assert!(fill.region.end <= policy.buffer_bytes);
            for p in &fill.placements {
                assert!(fill.transfers.contains(&p.transfer));
                assert_eq!(p.span, (0, object_bytes));
                assert!(p.staging_offset >= fill.region.start && p.staging_offset + object_bytes <= fill.region.end);
            }
            let copied: u64 = staging_copies(fill, &objects).iter().map(|c| c.len).sum();
            assert_eq!(copied, fill.transfers.len() as u64 * object_bytes);
            if i > 0 {
                assert!(!regions_overlap(&fills[i - 1].region, &fill.region));
            }
        }
        assert_eq!(covered, 200);
        assert_eq!(cursor.placed, 200 * object_bytes);
    }

    #[test]
    fn objects_interleaved_by_shard_are_staged_in_arena_order_and_merge() {
        // Keys alternate between two arena slices (shards); each slice holds its keys back to back.
        let transfers: Vec<Transfer> = (0..8u64)
            .map(|k| {
                object((k % 2) * (1 << 30) + (k / 2) * 65536, 8192, 8, move |i| 0x9_0000_0000 + (k * 8 + i) * 8192)
            })
            .collect();
        let fills = split_fills(&quarters(16 << 20), Direction::HostToDevice, &transfers);
        assert_eq!(fills.len(), 1);
        let copies = staging_copies(&fills[0], &transfers);
        assert_eq!(copies.len(), 2, "one copy per slice: {copies:?}");
        let rows = descriptors(&fills[0], &transfers);
        assert_eq!(rows.iter().map(|r| r.len as u64).sum::<u64>(), 8 * 65536);
    }

    #[test]
    fn a_batch_that_fits_a_quarter_of_the_buffer_is_one_fill() {
        let transfers = vec![object(0x1000, 4096, 8, |i| 0x9000_0000 + (7 - i) * 4096)];
        let fills = split_fills(&quarters(1 << 20), Direction::HostToDevice, &transfers);
        assert_eq!(fills.len(), 1);
        let rows = descriptors(&fills[0], &transfers);
        assert_eq!(rows.len(), 8, "reversed pages cannot merge");
        assert!(rows.iter().all(|r| r.len == 4096));
    }

    #[test]
    fn objects_larger_than_half_get_whole_buffer_fills() {
        // Between a quarter and a half: half-buffer fills, alternating halves.
        let mid: Vec<Transfer> =
            (0..3u64).map(|k| object(k << 24, 64 << 10, 5, move |i| (k << 28) + i * (128 << 10))).collect();
        let regions: Vec<Range<u64>> =
            split_fills(&quarters(1 << 20), Direction::HostToDevice, &mid).into_iter().map(|f| f.region).collect();
        assert_eq!(regions, vec![0..320 << 10, 320 << 10..640 << 10, 0..320 << 10]);
        let transfers: Vec<Transfer> =
            (0..3u64).map(|k| object(k << 24, 64 << 10, 10, move |i| (k << 28) + i * (128 << 10))).collect();
        let fills = split_fills(&quarters(1 << 20), Direction::HostToDevice, &transfers);
        assert_eq!(fills.len(), 3);
        assert!(fills.iter().all(|f| f.region == (0..640 << 10)));
    }

    #[test]
    fn staging_keeps_host_alignment_modulo_16() {
        let t = Transfer {
            host: 0x1003,
            host_len: 100,
            pieces: vec![
                Piece { host_offset: 5, addr: 0x5000_0008, len: 40, kind: GPU0 },
                Piece { host_offset: 45, addr: 0x5000_1001, len: 55, kind: GPU0 },
            ],
        };
        let fills = split_fills(&quarters(4096), Direction::HostToDevice, std::slice::from_ref(&t));
        let p = fills[0].placements[0];
        assert_eq!(p.span, (5, 100));
        assert_eq!(p.staging_offset % 16, (0x1003 + 5) % 16);
        let rows = descriptors(&fills[0], std::slice::from_ref(&t));
        assert_eq!(rows[1].staging_offset as u64, p.staging_offset + 40);
        assert_eq!(
            staging_copies(&fills[0], std::slice::from_ref(&t)),
            vec![BulkCopy { host: 0x1008, device: p.staging_offset, len: 95 }]
        );
    }

    #[test]
    fn overlap_detection_matches_a_sort() {
        let mut next = xorshift(12345);
        for round in 0..400 {
            let n = 1 + next(40);
            let pieces: Vec<Piece> = (0..n)
                .map(|_| {
                    let len = if round % 2 == 0 { 4096 } else { 1 + next(5000) };
                    let addr = if round % 3 == 0 { next(64) * 4096 } else { next(1 << 20) };
                    Piece { host_offset: 0, addr, len, kind: GPU0 }
                })
                .collect();
            let t = vec![Transfer { host: 0, host_len: 0, pieces: pieces.clone() }];
            let mut r: Vec<(u64, u64)> = pieces.iter().map(|p| (p.addr, p.addr + p.len)).collect();
            r.sort_unstable();
            let expected = r.windows(2).any(|w| w[1].0 < w[0].1);
            assert_eq!(overlapping(&t), expected, "round {round}: {r:?}");
        }
        // Touching pages do not overlap; a sparse layout takes the sort path.
        let touching = vec![object(0, 4096, 3, |i| 0x1000 + (2 - i) * 4096)];
        assert!(!overlapping(&touching));
        let sparse = vec![object(0, 16, 3, |i| i << 40)];
        assert!(!overlapping(&sparse));
    }

    #[test]
    fn the_survey_agrees_with_the_passes_it_replaces() {
        // Objects of up to 4 x 70,000 bytes: some do not fit the buffer.
        let policy = StagingPolicy { enabled: true, buffer_bytes: 256 << 10, tail_fill_bytes: 0 };
        // The qualification rules, each checked on its own pass.
        let expected_choice = |direction: Direction, transfers: &[Transfer]| -> PathChoice {
            let mut ordinal = None;
            for p in transfers.iter().flat_map(|t| &t.pieces) {
                match p.kind {
                    MemoryKind::Device { ordinal: o } if *ordinal.get_or_insert(o) == o => {}
                    MemoryKind::Device { .. } => return PathChoice::Direct(Fallback::SeveralDevices),
                    MemoryKind::Host | MemoryKind::Pinned => return PathChoice::Direct(Fallback::NotDevice),
                }
            }
            let Some(ordinal) = ordinal else { return PathChoice::Direct(Fallback::Empty) };
            if transfers.iter().any(|t| t.span().end - t.span().start > policy.buffer_bytes) {
                return PathChoice::Direct(Fallback::TooLarge);
            }
            if direction == Direction::HostToDevice && overlapping(transfers) {
                return PathChoice::Direct(Fallback::Overlap);
            }
            let objects = transfers.iter().filter(|t| !t.pieces.is_empty()).count();
            if transfers.iter().map(|t| t.pieces.len()).sum::<usize>() <= objects {
                return PathChoice::Direct(Fallback::NotFragmented);
            }
            PathChoice::Staged { ordinal }
        };
        let mut next = xorshift(99);
        let mut seen: Vec<PathChoice> = Vec::new();
        for round in 0..600 {
            let transfers: Vec<Transfer> = (0..1 + next(6))
                .map(|o| {
                    let pages = next(5); // an empty transfer now and then
                    let len = [4096, 6144, 70_000][next(3) as usize];
                    let slots: Vec<u64> = (0..pages).map(|_| next(64)).collect();
                    let mut t = object(o << 24, len, pages, |i| (o << 28) + slots[i as usize] * 8192 + i);
                    if round % 7 == 0 && pages > 0 {
                        t.pieces[0].kind = MemoryKind::Host;
                    }
                    if round % 11 == 0 && pages > 1 {
                        t.pieces[1].kind = MemoryKind::Device { ordinal: 1 };
                    }
                    t
                })
                .collect();
            for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
                let survey = survey(policy, direction, &transfers);
                assert_eq!(survey.choice, expected_choice(direction, &transfers), "round {round} {direction:?}");
                if !seen.contains(&survey.choice) {
                    seen.push(survey.choice);
                }
                if let PathChoice::Staged { .. } = survey.choice {
                    let spans: Vec<Range<u64>> = transfers.iter().map(Transfer::span).collect();
                    assert_eq!(survey.spans, spans, "round {round}");
                    assert_eq!(survey.rows, max_rows(&transfers), "round {round}");
                }
            }
        }
        // Every rule decided some request.
        for choice in [
            PathChoice::Staged { ordinal: 0 },
            PathChoice::Direct(Fallback::NotDevice),
            PathChoice::Direct(Fallback::SeveralDevices),
            PathChoice::Direct(Fallback::TooLarge),
            PathChoice::Direct(Fallback::Overlap),
            PathChoice::Direct(Fallback::NotFragmented),
        ] {
            assert!(seen.contains(&choice), "{choice:?} never seen: {seen:?}");
        }
    }

    #[test]
    fn descriptors_into_writes_the_rows_of_descriptors_or_refuses() {
        let policy = quarters(4 << 20);
        let transfers: Vec<Transfer> = (0..5u64)
            .map(|o| object(o * (200 << 10), 100 << 10, 2, |i| 0x9000_0000 + (o * 2 + i) * (100 << 10)))
            .collect();
        for fill in split_fills(&policy, Direction::HostToDevice, &transfers) {
            let rows = descriptors(&fill, &transfers);
            assert!(rows.len() > 1);
            let mut table = vec![Descriptor::default(); rows.len() + 3];
            assert_eq!(descriptors_into(&fill, &transfers, &mut table), Some(rows.len()));
            assert_eq!(&table[..rows.len()], &rows[..]);
            let mut short = vec![Descriptor::default(); rows.len() - 1];
            assert_eq!(descriptors_into(&fill, &transfers, &mut short), None);
        }
    }

    #[test]
    fn long_pieces_are_chunked_and_neighbours_merge() {
        let t = object(0x4000, 96 << 10, 2, |i| 0x8000_0000 + i * (96 << 10)); // contiguous pages
        let fills = split_fills(&quarters(1 << 20), Direction::HostToDevice, std::slice::from_ref(&t));
        let rows = descriptors(&fills[0], std::slice::from_ref(&t));
        assert_eq!(rows.iter().map(|r| r.len as u64).sum::<u64>(), 192 << 10);
        assert_eq!(rows.len(), 3, "merged to 192 KiB, cut at 64 KiB");
        let direct = direct_copies(std::slice::from_ref(&t), 0);
        assert_eq!(direct, vec![BulkCopy { host: 0x4000, device: 0x8000_0000, len: 192 << 10 }]);
        let reversed = object(0x4000, 4096, 3, |i| 0x8000_0000 + (2 - i) * 4096);
        assert_eq!(direct_copies(std::slice::from_ref(&reversed), 0).len(), 3);
        assert_eq!(direct_copies(std::slice::from_ref(&reversed), 1).len(), 0);
        assert_eq!(ordinals(std::slice::from_ref(&reversed)), vec![0]);
    }

    #[test]
    fn fills_cover_every_byte_exactly_once() {
        // Odd sizes and odd host addresses: every piece appears in exactly one descriptor range.
        let transfers: Vec<Transfer> = (0..9u64)
            .map(|k| {
                let len = 1000 + k * 777;
                Transfer {
                    host: 0x10_0001 + k * 10_000,
                    host_len: len,
                    pieces: vec![
                        Piece { host_offset: 0, addr: 0x9_0000_0000 + k * 20_000, len: len / 3, kind: GPU0 },
                        Piece {
                            host_offset: len / 3,
                            addr: 0x9_0000_0000 + k * 20_000 + 9_001,
                            len: len - len / 3,
                            kind: GPU0,
                        },
                    ],
                }
            })
            .collect();
        let fills = split_fills(&quarters(8192), Direction::HostToDevice, &transfers);
        let covered: usize = fills.iter().map(|f| f.transfers.len()).sum();
        assert_eq!(covered, transfers.len());
        for fill in &fills {
            let rows = descriptors(fill, &transfers);
            let bytes: u64 = rows.iter().map(|r| r.len as u64).sum();
            assert_eq!(bytes, transfers[fill.transfers.clone()].iter().map(Transfer::bytes).sum::<u64>());
            assert!(rows.iter().all(|r| r.staging_offset as u64 + r.len as u64 <= 8192));
        }
    }
}
