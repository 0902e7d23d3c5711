//! How a gathered write from GPU memory is cut into parts that copy while the next one is
//! prepared (`Transport::submit_parts`).
//!
//! Owns the part sizes: a small first part so the copies start early, later parts as large as
//! everything before them so each one's host work (reservations, checks, planning) hides behind
//! the copies of the parts before it. It never looks at keys or memory, only at byte counts.
//! (Reads keep one submission: they lease in parts and their early start queues the first
//! copies after the first part's leases; submitting them in parts measured no faster.)

/// The first part carries at least this share of a request's bytes (as a divisor).
const FIRST_PART_SHARE: u64 = 128;
/// The largest part's share of a request's bytes (as a divisor): the last part's host work then
/// hides behind the copies of the parts before it.
const LARGEST_PART_SHARE: u64 = 8;
/// A part carries at least this many bytes: below it, one more round trip to the shards costs
/// more than the copies it would overlap.
const MIN_PART_BYTES: u64 = 4 << 20;

/// Decides where parts end, object by object: the first part carries at least a
/// `FIRST_PART_SHARE`th of the request's bytes, each later one as much as all before it, at most
/// a `LARGEST_PART_SHARE`th, every one at least `MIN_PART_BYTES` (a part that would leave less
/// than that takes the rest too). Without `split`, the request is one part.
pub(crate) struct PartCutter {
    split: bool,
    first: u64,
    /// Bytes of the parts cut so far.
    before: u64,
}

impl PartCutter {
    /// For a request of about `total` bytes.
    pub(crate) fn new(split: bool, total: u64) -> PartCutter {
        PartCutter { split, first: total / FIRST_PART_SHARE, before: 0 }
    }

    /// True when a part of `bytes`, with about `left` bytes of the request after it, ends here.
    /// The largest part is a share of the request's size as it is known now (`left` may be an
    /// estimate that improves as objects are seen).
    pub(crate) fn cut(&mut self, bytes: u64, left: u64) -> bool {
        let largest = ((self.before + bytes + left) / LARGEST_PART_SHARE).max(self.first);
        let target = self.before.clamp(self.first, largest).max(MIN_PART_BYTES);
        let end = self.split && bytes >= target && left >= MIN_PART_BYTES;
        if end {
            self.before += bytes;
        }
        end
    }
}

/// The parts of a request of objects of `lens` bytes, in order (one part without `split`).
#[cfg(test)]
fn part_ranges(lens: &[u64], split: bool) -> Vec<std::ops::Range<usize>> {
    let total: u64 = lens.iter().sum();
    let mut cutter = PartCutter::new(split, total);
    let (mut parts, mut start, mut done, mut bytes) = (Vec::new(), 0, 0u64, 0u64);
    for (i, len) in lens.iter().enumerate() {
        bytes += len;
        done += len;
        if cutter.cut(bytes, total - done) {
            parts.push(start..i + 1);
            start = i + 1;
            bytes = 0;
        }
    }
    if start < lens.len() || lens.is_empty() {
        parts.push(start..lens.len());
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(lens: &[u64], parts: &[std::ops::Range<usize>]) -> Vec<u64> {
        parts.iter().map(|r| lens[r.clone()].iter().sum()).collect()
    }

    #[test]
    fn a_large_request_starts_with_a_small_part_and_grows_to_an_eighth() {
        const MIB: u64 = 1 << 20;
        let lens = vec![2 * MIB; 128];
        let parts = part_ranges(&lens, true);
        // Every object once, in order.
        assert_eq!(parts.first().map(|r| r.start), Some(0));
        assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(parts.last().map(|r| r.end), Some(128));
        assert_eq!(sizes(&lens, &parts), [vec![4 * MIB, 4 * MIB, 8 * MIB, 16 * MIB], vec![32 * MIB; 7]].concat());
        // 1536 KV blocks of 384 KiB: the first part is a 128th (12 blocks), then as much as all
        // before it, up to an eighth (192 blocks).
        let lens = vec![384 << 10; 1536];
        let counts: Vec<usize> = part_ranges(&lens, true).iter().map(|r| r.len()).collect();
        assert_eq!(counts, vec![12, 12, 24, 48, 96, 192, 192, 192, 192, 192, 192, 192]);
    }

    #[test]
    fn a_low_first_estimate_still_grows_the_parts_to_an_eighth() {
        // A write estimates its size from its first object: here 4 KiB, then 127 objects of
        // 2 MiB. The running average corrects the estimate, so parts still grow.
        const MIB: u64 = 1 << 20;
        let lens: Vec<u64> = std::iter::once(4096).chain(std::iter::repeat_n(2 * MIB, 127)).collect();
        let mut cutter = PartCutter::new(true, lens[0] * lens.len() as u64);
        let (mut parts, mut bytes, mut seen) = (Vec::new(), 0u64, 0u64);
        for (i, len) in lens.iter().enumerate() {
            bytes += len;
            seen += len;
            let left = (lens.len() - i - 1) as u64 * (seen / (i as u64 + 1));
            if cutter.cut(bytes, left) {
                parts.push(bytes);
                bytes = 0;
            }
        }
        parts.push(bytes);
        assert_eq!(parts.iter().sum::<u64>(), seen);
        assert!(parts.len() <= 12, "{parts:?}");
        assert!(parts.iter().all(|&p| p <= seen / 8 + 2 * MIB), "{parts:?}");
    }

    #[test]
    fn small_requests_and_unsplit_ones_are_one_part() {
        const MIB: u64 = 1 << 20;
        assert_eq!(part_ranges(&[MIB; 6], true), vec![0..6]);
        assert_eq!(part_ranges(&[64 * MIB; 16], false), vec![0..16]);
        assert_eq!(part_ranges(&[], true), vec![0..0]);
        // One object larger than everything else still makes a part of its own.
        assert_eq!(part_ranges(&[64 * MIB, MIB, MIB], true), vec![0..3]);
        let parts = part_ranges(&[64 * MIB, 8 * MIB, 8 * MIB], true);
        assert_eq!(parts, vec![0..1, 1..3]);
    }
}
