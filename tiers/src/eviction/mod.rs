//! Eviction policies for the DRAM tier: which tracked entry leaves first.
//!
//! A policy only orders entry ids; it never frees memory and never decides on its own that an
//! entry may go: the caller passes `evictable`, which says no for leased or in-flight entries.
//! Pinned entries are not tracked at all (the engine removes them while pinned), so a pool full
//! of pinned objects yields `None` at once instead of a long scan.

mod list;
pub mod lru;
pub mod s3fifo;

pub use list::MAX_ENTRY_ID;
pub use lru::Lru;
pub use s3fifo::S3Fifo;

/// Index of an entry in the caller's object table. Dense, reused after removal.
/// Ids above [`MAX_ENTRY_ID`] (2^29 - 2) are never tracked: the caller's table must stay below.
pub type EntryId = u32;

/// An eviction policy over entries the caller owns.
///
/// Contract (the property tests check it against a model):
/// - `insert` of an id already tracked is a caller bug; policies may debug-assert on it.
/// - `remove` and `access` of an untracked id are no-ops.
/// - `pop_victim` returns a tracked id for which `evictable(id)` returned true and stops tracking
///   it; entries for which `evictable` said false stay tracked. It calls `evictable` at most
///   `len()` times, so it is bounded even when nothing can go. `key_hash(id)` answers the hash
///   `insert` was given for a tracked id (a policy with a ghost history asks it of the victim
///   rather than keep every entry's hash).
pub trait Eviction: Send {
    /// Short stable name ("lru", "s3fifo") for stats and benchmark tables.
    fn name(&self) -> &'static str;
    /// Starts tracking `id`. `key_hash` lets policies with a ghost history recognise a key
    /// that was evicted recently; `size_bytes` lets them balance queues by bytes.
    fn insert(&mut self, id: EntryId, key_hash: u64, size_bytes: u64);
    /// Records a hit on `id`.
    fn access(&mut self, id: EntryId);
    /// Stops tracking `id` (removed, replaced or pinned).
    fn remove(&mut self, id: EntryId);
    /// Chooses and untracks the next victim, skipping entries `evictable` refuses.
    fn pop_victim(
        &mut self,
        evictable: &mut dyn FnMut(EntryId) -> bool,
        key_hash: &dyn Fn(EntryId) -> u64,
    ) -> Option<EntryId>;
    /// Number of tracked entries.
    fn len(&self) -> usize;
    /// True when nothing is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The policies a user can choose in the builder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// Least recently used.
    Lru,
    /// S3-FIFO (Yang et al., SOSP'23): small probationary FIFO, main FIFO, ghost history.
    #[default]
    S3Fifo,
}

impl EvictionPolicy {
    /// Builds a policy for a tier of `capacity_bytes`.
    pub fn build(self, capacity_bytes: u64) -> Box<dyn Eviction> {
        match self {
            EvictionPolicy::Lru => Box::new(Lru::new()),
            EvictionPolicy::S3Fifo => Box::new(S3Fifo::new(capacity_bytes)),
        }
    }

    /// Parses "lru" or "s3fifo" (case-insensitive; "s3-fifo" accepted).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "lru" => Some(EvictionPolicy::Lru),
            "s3fifo" | "s3-fifo" | "s3_fifo" => Some(EvictionPolicy::S3Fifo),
            _ => None,
        }
    }

    /// The policy's stable name.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::S3Fifo => "s3fifo",
        }
    }
}

/// Outcome of [`simulate_hit_ratio`]: request and byte counts, and how many of them hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HitRatio {
    /// Requests in the trace.
    pub requests: u64,
    /// Requests whose key was cached.
    pub hits: u64,
    /// Sum of the requested sizes.
    pub byte_requests: u64,
    /// Sum of the requested sizes that hit.
    pub byte_hits: u64,
}

impl HitRatio {
    /// `hits / requests`, 0 for an empty trace.
    pub fn ratio(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.hits as f64 / self.requests as f64
        }
    }

    /// `byte_hits / byte_requests`, 0 when nothing was requested.
    pub fn byte_ratio(&self) -> f64 {
        if self.byte_requests == 0 {
            0.0
        } else {
            self.byte_hits as f64 / self.byte_requests as f64
        }
    }
}

/// Replays `trace` of `(key, size_bytes)` requests against a cache of `capacity_bytes` run by
/// `policy` and counts hits. For comparing policies offline; it never touches real memory.
///
/// A hit calls `access`. A miss evicts with `pop_victim` (every entry evictable) until the new
/// bytes fit, then inserts (the key itself serves as `key_hash`). A request larger than the
/// whole cache is a miss that is not admitted and evicts nothing. A key's cached size is the one
/// of the request that admitted it; later requests count their own size in the byte totals.
pub fn simulate_hit_ratio(
    policy: EvictionPolicy,
    capacity_bytes: u64,
    trace: impl IntoIterator<Item = (u64 /* key */, u64 /* size_bytes */)>,
) -> HitRatio {
    use std::collections::HashMap;

    let mut eviction = policy.build(capacity_bytes);
    let mut ids: HashMap<u64, EntryId> = HashMap::new();
    // Indexed by EntryId: the (key, size) cached there; ids are recycled through `free`.
    let mut slots: Vec<Option<(u64, u64)>> = Vec::new();
    let mut free: Vec<EntryId> = Vec::new();
    let mut used: u64 = 0;
    let mut out = HitRatio::default();

    for (key, size) in trace {
        out.requests += 1;
        out.byte_requests = out.byte_requests.saturating_add(size);
        if let Some(&id) = ids.get(&key) {
            out.hits += 1;
            out.byte_hits = out.byte_hits.saturating_add(size);
            eviction.access(id);
            continue;
        }
        if size > capacity_bytes {
            continue;
        }
        while used.saturating_add(size) > capacity_bytes {
            let key_of = |id: EntryId| slots.get(id as usize).copied().flatten().map_or(0, |(key, _)| key);
            let Some(victim) = eviction.pop_victim(&mut |_| true, &key_of) else {
                break;
            };
            if let Some((old_key, old_size)) = slots.get_mut(victim as usize).and_then(Option::take) {
                ids.remove(&old_key);
                used = used.saturating_sub(old_size);
                free.push(victim);
            }
        }
        if used.saturating_add(size) > capacity_bytes {
            debug_assert!(false, "policy ran dry with {used} bytes cached");
            continue;
        }
        let id = match free.pop() {
            Some(id) => id,
            None => match EntryId::try_from(slots.len()) {
                Ok(id) if id != EntryId::MAX => {
                    slots.push(None);
                    id
                }
                // More distinct cached keys than ids: treat as not admitted.
                _ => continue,
            },
        };
        if let Some(slot) = slots.get_mut(id as usize) {
            *slot = Some((key, size));
        }
        ids.insert(key, id);
        used += size;
        eviction.insert(id, key, size);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_parse_and_build() {
        for p in [EvictionPolicy::Lru, EvictionPolicy::S3Fifo] {
            assert_eq!(EvictionPolicy::parse(p.name()), Some(p));
            assert_eq!(p.build(1024).name(), p.name());
        }
        assert_eq!(EvictionPolicy::parse("S3-FIFO"), Some(EvictionPolicy::S3Fifo));
        assert_eq!(EvictionPolicy::parse("arc"), None);
        assert_eq!(EvictionPolicy::default(), EvictionPolicy::S3Fifo);
    }

    #[test]
    fn simulate_lru_unit_sizes_by_hand() {
        // Capacity 2: 1 miss, 2 miss, 1 hit, 3 miss (evicts 2), 1 hit, 2 miss (evicts 3).
        let trace = [1, 2, 1, 3, 1, 2].map(|k| (k, 1));
        let r = simulate_hit_ratio(EvictionPolicy::Lru, 2, trace);
        assert_eq!(r, HitRatio { requests: 6, hits: 2, byte_requests: 6, byte_hits: 2 });
        assert!((r.ratio() - 2.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn simulate_lru_variable_sizes_by_hand() {
        // Capacity 10.
        let trace = [
            (1, 4),  // miss            cached: 1
            (2, 4),  // miss            cached: 1 2
            (3, 6),  // miss, evict 1   cached: 2 3
            (2, 4),  // hit             recency: 3 2
            (1, 4),  // miss, evict 3   cached: 2 1
            (9, 11), // miss, too big: not admitted, evicts nothing
            (2, 4),  // hit
        ];
        let r = simulate_hit_ratio(EvictionPolicy::Lru, 10, trace);
        assert_eq!(r, HitRatio { requests: 7, hits: 2, byte_requests: 37, byte_hits: 8 });
        assert!((r.byte_ratio() - 8.0 / 37.0).abs() < 1e-12);
    }

    #[test]
    fn simulate_working_set_that_fits_only_misses_cold() {
        let trace: Vec<(u64, u64)> = (0..100).map(|i| (i % 5, 10)).collect();
        for p in [EvictionPolicy::Lru, EvictionPolicy::S3Fifo] {
            let r = simulate_hit_ratio(p, 50, trace.iter().copied());
            assert_eq!(r.hits, 95, "{}", p.name());
        }
        assert_eq!(simulate_hit_ratio(EvictionPolicy::Lru, 0, []).ratio(), 0.0);
    }

    #[test]
    fn simulate_s3fifo_resists_a_scan_better_than_lru() {
        // Capacity 10. A hot set of 8 keys is requested twice each, then revisited round-robin
        // between runs of 3 one-hit cold keys: the scan flushes LRU but passes through small.
        let mut trace: Vec<(u64, u64)> = (0..8u64).flat_map(|k| [(k, 1), (k, 1)]).collect();
        let mut cold = 1_000u64;
        for round in 0..2_000u64 {
            trace.push((round % 8, 1));
            for _ in 0..3 {
                trace.push((cold, 1));
                cold += 1;
            }
        }
        let lru = simulate_hit_ratio(EvictionPolicy::Lru, 10, trace.iter().copied());
        let s3 = simulate_hit_ratio(EvictionPolicy::S3Fifo, 10, trace.iter().copied());
        assert!(s3.hits > lru.hits, "s3fifo {s3:?} vs lru {lru:?}");
    }
}
