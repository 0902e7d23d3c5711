//! A small log-bucketed latency histogram (HDR-style: 32 linear sub-buckets per power of two,
//! so any recorded value is reported within ~3%). Fixed memory, O(1) record, mergeable across
//! threads. Values are nanoseconds.

/// Sub-buckets per power of two, as a power of two.
const SUB_BITS: u32 = 5;
const SUB: usize = 1 << SUB_BITS;
/// Enough buckets for any `u64`.
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) * SUB;

/// Latency histogram in nanoseconds.
#[derive(Clone)]
pub struct Histogram {
    counts: Box<[u64]>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: vec![0; BUCKETS].into_boxed_slice(), total: 0, max: 0 }
    }
}

fn index_of(value: u64) -> usize {
    if value < SUB as u64 {
        return value as usize;
    }
    let exponent = 63 - value.leading_zeros();
    let shift = exponent - SUB_BITS;
    let sub = (value >> shift) as usize - SUB;
    (shift as usize + 1) * SUB + sub
}

/// Midpoint of bucket `index`.
fn value_of(index: usize) -> u64 {
    if index < SUB {
        return index as u64;
    }
    let shift = (index / SUB - 1) as u32;
    let sub = (index % SUB) as u64;
    let low = (SUB as u64 + sub) << shift;
    low + ((1u64 << shift) >> 1)
}

impl Histogram {
    /// Records one value.
    pub fn record(&mut self, nanos: u64) {
        self.counts[index_of(nanos)] += 1;
        self.total += 1;
        self.max = self.max.max(nanos);
    }

    /// The cumulative distribution: (value in µs, fraction of values at or below it), one point
    /// per non-empty bucket.
    pub fn cdf_us(&self) -> Vec<(f64, f64)> {
        let mut seen = 0u64;
        let mut out = Vec::new();
        for (i, &n) in self.counts.iter().enumerate() {
            if n == 0 {
                continue;
            }
            seen += n;
            out.push((value_of(i) as f64 / 1e3, seen as f64 / self.total.max(1) as f64));
        }
        out
    }

    /// Adds `other`'s counts to this one.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += *b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Largest recorded value.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The value at quantile `q` in [0, 1] (0 when empty).
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (index, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return value_of(index).min(self.max);
            }
        }
        self.max
    }

    /// `quantile(q)` in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        self.quantile(q) as f64 / 1000.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in (0..1_000_000u64).step_by(7).chain([u64::MAX / 2, u64::MAX]) {
            let i = index_of(v);
            assert!(i >= last, "index not monotonic at {v}");
            assert!(i < BUCKETS);
            last = i;
            let mid = value_of(i) as f64;
            assert!((mid - v as f64).abs() <= v as f64 / 32.0 + 1.0, "{v} -> {mid}");
        }
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::default();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.04, "{p50}");
        assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.04, "{p99}");
        assert_eq!(h.count(), 1000);
        let mut g = Histogram::default();
        g.record(5);
        g.merge(&h);
        assert_eq!(g.count(), 1001);
        assert_eq!(g.max(), 1_000_000);
    }
}
