//! S3-FIFO eviction (Yang et al., SOSP'23, "FIFO queues are all you need for cache eviction").
//!
//! Owns the small (probationary) and main FIFO orders, a 2-bit frequency per entry, per-queue
//! byte totals and a bounded ghost FIFO of key hashes evicted from small. It must never free
//! memory, never return an id `evictable` refused, never call `evictable` more than `len()`
//! times in one `pop_victim`, and never let the ghost grow without bound.

use std::collections::{HashMap, VecDeque};

use super::list::Lists;
use super::{EntryId, Eviction};

/// Probationary FIFO: new keys land here and one-hit wonders leave from here.
const SMALL: usize = 0;
/// Main FIFO with second chances driven by `freq`.
const MAIN: usize = 1;
/// Entries refused during the current `pop_victim`, parked so the walk never meets them twice;
/// spliced back to the head of main before `pop_victim` returns (empty otherwise).
const HELD: usize = 2;

/// Frequency saturates here (two bits in the paper).
const MAX_FREQ: u8 = 3;
/// Small's share of tracked bytes, as a divisor: 10%.
const SMALL_SHARE_DIVISOR: u64 = 10;
/// Ghost entries allowed even when few entries are tracked, so a cold cache still learns.
const GHOST_MIN_ENTRIES: usize = 64;

/// 4 bytes per tracked entry (the key hash the ghost keeps is asked of the caller when an entry
/// leaves small).
#[derive(Clone, Copy, Debug, Default)]
struct Meta {
    /// The frequency (top two bits) and the entry's size (the 30 below).
    freq_size: u32,
}

/// Sizes below 512 MiB are kept exactly; larger ones in 2 KiB units, rounded up, to just under
/// 1 TiB; an entry larger than that counts as `MAX_META_SIZE`. What an entry counts as is the
/// same in the byte total it joins and the one it leaves, so the totals stay exact sums of what
/// is kept.
const EXACT_SIZE_LOG2: u32 = 29;
const COARSE_UNIT_LOG2: u32 = 11;
const SIZE_MASK: u32 = (1 << EXACT_SIZE_LOG2) - 1;
/// The largest size kept.
#[cfg(test)]
const MAX_META_SIZE: u64 = (SIZE_MASK as u64) << COARSE_UNIT_LOG2;
const FREQ_SHIFT: u32 = 30;

impl Meta {
    fn new(size_bytes: u64) -> Meta {
        let code = if size_bytes < 1 << EXACT_SIZE_LOG2 {
            size_bytes as u32
        } else {
            let units = size_bytes.div_ceil(1 << COARSE_UNIT_LOG2).min(u64::from(SIZE_MASK)) as u32;
            1 << EXACT_SIZE_LOG2 | units
        };
        Meta { freq_size: code }
    }

    /// The size kept (`size_bytes` as given to `new`, exact below 512 MiB).
    fn size(&self) -> u64 {
        let code = self.freq_size & ((1 << FREQ_SHIFT) - 1);
        if code >> EXACT_SIZE_LOG2 == 0 {
            u64::from(code)
        } else {
            u64::from(code & SIZE_MASK) << COARSE_UNIT_LOG2
        }
    }

    fn freq(&self) -> u8 {
        (self.freq_size >> FREQ_SHIFT) as u8
    }

    fn set_freq(&mut self, freq: u8) {
        let freq = u32::from(freq.min(MAX_FREQ));
        self.freq_size = self.freq_size & ((1 << FREQ_SHIFT) - 1) | freq << FREQ_SHIFT;
    }
}

/// A key hash folded to the 32 bits the ghost compares (a collision only makes a ghost hit of a
/// key never evicted, a placement hint, never a correctness matter).
fn ghost_key(key_hash: u64) -> u32 {
    (key_hash ^ (key_hash >> 32)) as u32
}

/// FIFO of hashes of keys recently evicted from small, with lazy deletion.
///
/// `live` maps a hash to the sequence number of its newest FIFO slot; older slots of the same
/// hash (or slots whose hash was taken by a ghost hit) are stale and just age out. The FIFO is
/// trimmed to a byte budget and an entry budget on every record, so both it and `live` stay
/// bounded by the larger budget seen.
#[derive(Debug, Default)]
struct Ghost {
    fifo: VecDeque<GhostSlot>,
    live: HashMap<u32, u64>,
    bytes: u64,
    next_seq: u64,
}

#[derive(Clone, Copy, Debug)]
struct GhostSlot {
    hash: u32,
    size: u64,
    seq: u64,
}

impl Ghost {
    /// Consumes a ghost hit: true if `hash` was evicted from small recently.
    fn take(&mut self, hash: u32) -> bool {
        self.live.remove(&hash).is_some()
    }

    fn record(&mut self, hash: u32, size: u64, max_bytes: u64, max_entries: usize) {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.live.insert(hash, seq);
        self.fifo.push_back(GhostSlot { hash, size, seq });
        self.bytes = self.bytes.saturating_add(size);
        while self.fifo.len() > max_entries || (self.bytes > max_bytes && !self.fifo.is_empty()) {
            let Some(old) = self.fifo.pop_front() else {
                break;
            };
            self.bytes = self.bytes.saturating_sub(old.size);
            if self.live.get(&old.hash) == Some(&old.seq) {
                self.live.remove(&old.hash);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.fifo.len()
    }
}

/// S3-FIFO policy. insert/access/remove are O(1); `pop_victim` is O(len) in the worst case
/// (bounded by about `5 * len` steps) and O(1) amortised.
///
/// Decisions, where the paper leaves room:
/// - small's target is 10% of the bytes tracked when `pop_victim` starts;
/// - a small entry with `freq >= 1` moves to main with `freq` reset to 0;
/// - only evictions from small enter the ghost; the ghost holds at most 90% of
///   `capacity_bytes` worth of evicted sizes (main's share, as in libCacheSim) and at most
///   `max(len(), 64)` hashes;
/// - a refused entry (leased or in flight) goes to the head of main with its `freq` unchanged.
#[derive(Debug)]
pub struct S3Fifo {
    queues: Lists<3>,
    meta: Vec<Meta>,
    small_bytes: u64,
    /// Bytes in main, including entries parked in `HELD` during a pop.
    main_bytes: u64,
    ghost: Ghost,
    capacity_bytes: u64,
}

impl S3Fifo {
    /// An empty policy for a tier of `capacity_bytes` (used to size the ghost history).
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            queues: Lists::new(),
            meta: Vec::new(),
            small_bytes: 0,
            main_bytes: 0,
            ghost: Ghost::default(),
            capacity_bytes,
        }
    }

    /// True when `id` is tracked.
    pub fn contains(&self, id: EntryId) -> bool {
        self.queues.contains(id)
    }

    /// Bytes of all tracked entries.
    pub fn tracked_bytes(&self) -> u64 {
        self.small_bytes.saturating_add(self.main_bytes)
    }

    fn meta(&self, id: EntryId) -> Meta {
        self.meta.get(id as usize).copied().unwrap_or_default()
    }

    fn meta_mut(&mut self, id: EntryId) -> Option<&mut Meta> {
        self.meta.get_mut(id as usize)
    }

    /// Byte budget of the ghost: main's share of capacity, or of tracked bytes if unknown.
    fn ghost_max_bytes(&self) -> u64 {
        let base = if self.capacity_bytes > 0 { self.capacity_bytes } else { self.tracked_bytes() };
        base - base / SMALL_SHARE_DIVISOR
    }

    /// Moves `id` (currently in small) to main's head.
    fn promote(&mut self, id: EntryId, size: u64) {
        self.queues.push_front(MAIN, id);
        self.small_bytes = self.small_bytes.saturating_sub(size);
        self.main_bytes = self.main_bytes.saturating_add(size);
    }

    /// Untracks `id`, keeping the byte totals right; returns the queue it was in.
    fn untrack(&mut self, id: EntryId) -> Option<usize> {
        let q = self.queues.remove(id)?;
        let size = self.meta(id).size();
        if q == SMALL {
            self.small_bytes = self.small_bytes.saturating_sub(size);
        } else {
            self.main_bytes = self.main_bytes.saturating_sub(size);
        }
        Some(q)
    }

    #[cfg(test)]
    fn queue_of(&self, id: EntryId) -> Option<usize> {
        self.queues.queue_of(id)
    }
}

impl Eviction for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn insert(&mut self, id: EntryId, key_hash: u64, size_bytes: u64) {
        debug_assert!(!self.contains(id), "insert of tracked id {id}");
        // Release builds treat a double insert as a replacement.
        self.untrack(id);
        let ghost_key = ghost_key(key_hash);
        let q = if self.ghost.take(ghost_key) { MAIN } else { SMALL };
        if !self.queues.push_front(q, id) {
            return; // reserved id: never tracked
        }
        let idx = id as usize;
        if idx >= self.meta.len() {
            self.meta.resize(idx + 1, Meta::default());
        }
        let meta = Meta::new(size_bytes);
        let size_bytes = meta.size();
        if let Some(m) = self.meta_mut(id) {
            *m = meta;
        }
        if q == SMALL {
            self.small_bytes = self.small_bytes.saturating_add(size_bytes);
        } else {
            self.main_bytes = self.main_bytes.saturating_add(size_bytes);
        }
    }

    fn access(&mut self, id: EntryId) {
        if !self.contains(id) {
            return;
        }
        if let Some(m) = self.meta_mut(id) {
            m.set_freq(m.freq() + 1);
        }
    }

    fn remove(&mut self, id: EntryId) {
        self.untrack(id);
    }

    fn pop_victim(
        &mut self,
        evictable: &mut dyn FnMut(EntryId) -> bool,
        key_hash: &dyn Fn(EntryId) -> u64,
    ) -> Option<EntryId> {
        let tracked = self.len();
        let small_target = self.tracked_bytes() / SMALL_SHARE_DIVISOR;
        // Every step moves an entry small->main (once each), lowers a freq (<= 3 each) or asks
        // `evictable` (once each: refused ones are parked), so 5 * len + 1 steps always suffice.
        let max_steps = tracked.saturating_mul(5).saturating_add(1);
        let mut calls = 0usize;
        let mut victim = None;
        let mut steps = 0usize;
        while steps < max_steps {
            steps += 1;
            let from_small =
                !self.queues.is_empty(SMALL) && (self.small_bytes > small_target || self.queues.is_empty(MAIN));
            let q = if from_small { SMALL } else { MAIN };
            let Some(id) = self.queues.back(q) else {
                break; // small and main empty: everything left was refused
            };
            let meta = self.meta(id);
            if from_small && meta.freq() >= 1 {
                // Hit while on probation: earns a place in main, starting over.
                self.promote(id, meta.size());
                if let Some(m) = self.meta_mut(id) {
                    m.set_freq(0);
                }
                continue;
            }
            if !from_small && meta.freq() > 0 {
                // Second chance: one fewer for each trip round main.
                if let Some(m) = self.meta_mut(id) {
                    m.set_freq(meta.freq() - 1);
                }
                self.queues.push_front(MAIN, id);
                continue;
            }
            if calls >= tracked {
                break;
            }
            calls += 1;
            if evictable(id) {
                self.untrack(id);
                if from_small {
                    let max_entries = self.len().max(GHOST_MIN_ENTRIES);
                    let max_bytes = self.ghost_max_bytes();
                    self.ghost.record(ghost_key(key_hash(id)), meta.size(), max_bytes, max_entries);
                }
                victim = Some(id);
                break;
            }
            // In use right now: it belongs in main, but not within reach of this walk.
            if from_small {
                self.promote(id, meta.size());
            }
            self.queues.push_front(HELD, id);
        }
        debug_assert!(victim.is_some() || steps < max_steps || tracked == 0, "step cap hit");
        // Refused entries go to main's head in the order they were refused.
        while let Some(id) = self.queues.pop_back(HELD) {
            self.queues.push_front(MAIN, id);
        }
        victim
    }

    fn len(&self) -> usize {
        self.queues.len(SMALL) + self.queues.len(MAIN) + self.queues.len(HELD)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pop_all(s: &mut S3Fifo) -> Vec<EntryId> {
        std::iter::from_fn(|| s.pop_victim(&mut |_| true, &u64::from)).collect()
    }

    #[test]
    fn s3fifo_evicts_one_hit_wonders_before_hit_entries() {
        let mut s = S3Fifo::new(1000);
        for id in 0..10 {
            s.insert(id, u64::from(id), 10);
        }
        for id in [0, 1, 2] {
            s.access(id);
        }
        // Main is empty, so small is scanned: 0..2 were hit and move to main, 3 goes first.
        assert_eq!(s.pop_victim(&mut |_| true, &u64::from), Some(3));
        assert_eq!(s.queue_of(0), Some(MAIN));
        assert_eq!(s.queue_of(4), Some(SMALL));
        // Small (60 of 90 bytes) stays above its 10% target until drained, then main's FIFO.
        assert_eq!(pop_all(&mut s), vec![4, 5, 6, 7, 8, 9, 0, 1, 2]);
    }

    #[test]
    fn s3fifo_keeps_sizes_in_4_bytes_and_its_totals_exact() {
        assert_eq!(std::mem::size_of::<Meta>(), 4);
        for size in [0, 1, 4096, (1 << 29) - 1, 1 << 29, u64::from(u32::MAX) + 1, 5 << 32, MAX_META_SIZE] {
            let mut m = Meta::new(size);
            assert_eq!(m.size(), size);
            m.set_freq(MAX_FREQ);
            assert_eq!((m.size(), m.freq()), (size, MAX_FREQ));
            m.set_freq(0);
            assert_eq!((m.size(), m.freq()), (size, 0));
        }
        // Past 512 MiB sizes round up to 2 KiB; past the largest kept they count as it.
        assert_eq!(Meta::new((1 << 29) + 1).size(), (1 << 29) + 2048);
        assert_eq!(Meta::new(5 << 32 | 7).size(), (5 << 32) + 2048);
        assert_eq!(Meta::new(MAX_META_SIZE + 1).size(), MAX_META_SIZE);
        assert_eq!(Meta::new(1 << 40).size(), MAX_META_SIZE);
        assert_eq!(Meta::new(u64::MAX).size(), MAX_META_SIZE);
        // Entries past the kept size count as that size coming and going alike.
        let mut s = S3Fifo::new(u64::MAX);
        s.insert(0, 0, 3 << 40);
        s.insert(1, 1, 6 << 30);
        assert_eq!(s.tracked_bytes(), MAX_META_SIZE + (6 << 30));
        s.remove(0);
        assert_eq!(s.tracked_bytes(), 6 << 30);
        s.remove(1);
        assert_eq!(s.tracked_bytes(), 0);
    }

    #[test]
    fn s3fifo_main_gives_second_chances_by_frequency() {
        let mut s = S3Fifo::new(1000);
        for id in 0..3 {
            s.insert(id, u64::from(id), 10);
            s.access(id);
        }
        // Promote all three to main (freq reset to 0), evicting the one-hit wonder 3.
        s.insert(3, 3, 10);
        assert_eq!(s.pop_victim(&mut |_| true, &u64::from), Some(3));
        assert_eq!((0..3).map(|id| s.queue_of(id)).collect::<Vec<_>>(), vec![Some(MAIN); 3]);
        // 0 is hit twice, 1 once: 2 goes first, then 1 (one chance), then 0.
        s.access(0);
        s.access(0);
        s.access(1);
        assert_eq!(pop_all(&mut s), vec![2, 1, 0]);
    }

    #[test]
    fn s3fifo_frequency_saturates_at_three() {
        let mut s = S3Fifo::new(100);
        s.insert(0, 0, 1);
        for _ in 0..10 {
            s.access(0);
        }
        assert_eq!(s.meta(0).freq(), MAX_FREQ);
    }

    #[test]
    fn s3fifo_ghost_hit_goes_to_main() {
        let mut s = S3Fifo::new(1000);
        s.insert(0, 0xAA, 10);
        s.insert(1, 0xBB, 10);
        assert_eq!(s.pop_victim(&mut |_| true, &|id| [0xAA, 0xBB][id as usize]), Some(0));
        // Key 0xAA comes back under a reused id: the ghost sends it straight to main.
        s.insert(0, 0xAA, 10);
        assert_eq!(s.queue_of(0), Some(MAIN));
        // A fresh key goes to small; the ghost hit was consumed.
        s.insert(2, 0xCC, 10);
        assert_eq!(s.queue_of(2), Some(SMALL));
        assert!(!s.ghost.take(0xAA));
        // Small (1, 2) is above its target, so its one-hit wonders go before the main entry.
        assert_eq!(pop_all(&mut s), vec![1, 2, 0]);
    }

    #[test]
    fn s3fifo_main_evictions_do_not_enter_ghost() {
        let mut s = S3Fifo::new(1000);
        s.insert(0, 0xAA, 10);
        s.access(0);
        s.insert(1, 0xBB, 10);
        let hashes = |id: EntryId| [0xAA, 0xBB][id as usize];
        assert_eq!(s.pop_victim(&mut |_| true, &hashes), Some(1)); // 0 promoted, 1 evicted to ghost
        assert_eq!(s.pop_victim(&mut |_| true, &hashes), Some(0)); // from main
        s.insert(5, 0xAA, 10);
        assert_eq!(s.queue_of(5), Some(SMALL));
        s.insert(6, 0xBB, 10);
        assert_eq!(s.queue_of(6), Some(MAIN));
    }

    #[test]
    fn s3fifo_refused_entries_stay_tracked_and_go_to_main_head() {
        let mut s = S3Fifo::new(1000);
        for id in 0..4 {
            s.insert(id, u64::from(id), 10);
        }
        let mut asked = Vec::new();
        let got = s.pop_victim(
            &mut |id| {
                asked.push(id);
                id != 0 && id != 1
            },
            &u64::from,
        );
        assert_eq!(got, Some(2));
        assert_eq!(asked, vec![0, 1, 2]);
        assert_eq!(s.len(), 3);
        assert!(s.contains(0) && s.contains(1) && !s.contains(2));
        assert_eq!(s.queue_of(0), Some(MAIN));
        assert_eq!(s.queue_of(1), Some(MAIN));
        assert_eq!(s.queues.iter(MAIN).collect::<Vec<_>>(), vec![1, 0]);
        assert_eq!(s.queues.len(HELD), 0);
        assert_eq!(pop_all(&mut s), vec![3, 0, 1]);
    }

    #[test]
    fn s3fifo_all_refused_returns_none_within_len_calls() {
        let mut s = S3Fifo::new(1000);
        for id in 0..12 {
            s.insert(id, u64::from(id), 10);
            if id % 3 == 0 {
                s.access(id);
                s.access(id);
            }
        }
        // Put some in main too.
        assert!(s.pop_victim(&mut |_| true, &u64::from).is_some());
        for id in 0..12 {
            s.access(id);
        }
        let len = s.len();
        let mut calls = 0;
        let got = s.pop_victim(
            &mut |_| {
                calls += 1;
                false
            },
            &u64::from,
        );
        assert_eq!(got, None);
        assert_eq!(calls, len);
        assert_eq!(s.len(), len);
        assert_eq!(s.queues.len(HELD), 0);
        assert_eq!(s.tracked_bytes(), 10 * len as u64);
        assert_eq!(pop_all(&mut s).len(), len);
        assert_eq!(s.tracked_bytes(), 0);
    }

    #[test]
    fn s3fifo_untracked_remove_and_access_are_noops() {
        let mut s = S3Fifo::new(100);
        s.access(3);
        s.remove(3);
        assert!(s.is_empty());
        s.insert(1, 1, 5);
        s.access(40);
        s.remove(40);
        s.remove(1);
        s.remove(1);
        s.access(1);
        assert!(s.is_empty());
        assert_eq!(s.tracked_bytes(), 0);
        assert_eq!(s.pop_victim(&mut |_| true, &u64::from), None);
    }

    #[test]
    fn s3fifo_ghost_stays_bounded() {
        // 100 bytes of capacity: ghost keeps at most 90 bytes and max(len, 64) hashes.
        let mut s = S3Fifo::new(100);
        let mut hashes = [0u64; 4];
        for round in 0..10_000u64 {
            let id = (round % 4) as EntryId;
            s.remove(id);
            s.insert(id, round, 1);
            hashes[id as usize] = round;
            if s.len() == 4 {
                assert!(s.pop_victim(&mut |_| true, &|id| hashes[id as usize]).is_some());
            }
        }
        assert!(s.ghost.len() <= 64, "ghost has {}", s.ghost.len());
        assert!(s.ghost.live.len() <= s.ghost.len());
        let mut big = S3Fifo::new(100);
        for round in 0..1000u64 {
            big.insert(0, round, 30);
            assert_eq!(big.pop_victim(&mut |_| true, &|_| round), Some(0));
        }
        assert!(big.ghost.bytes <= 90 && big.ghost.len() <= 3);
    }

    // ---- Property test against a naive reference model of the same algorithm. ----

    const MAX_ID: u32 = 48;
    const CAPACITY: u64 = 600;

    #[derive(Clone, Debug)]
    enum Op {
        /// Insert the `n`-th (mod count) untracked id with a hash from a small set and a size.
        Insert(usize, u64, u64),
        Access(u32),
        Remove(u32),
        /// Pop with a refuse-set given as a bit mask over ids.
        Pop(u64),
        PopRefuseAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<usize>(), 0..12u64, 1..60u64).prop_map(|(n, h, s)| Op::Insert(n, h, s)),
            3 => (0..MAX_ID + 2).prop_map(Op::Access),
            1 => (0..MAX_ID + 2).prop_map(Op::Remove),
            3 => any::<u64>().prop_map(Op::Pop),
            1 => Just(Op::PopRefuseAll),
        ]
    }

    fn refused(mask: u64, id: EntryId) -> bool {
        mask & (1u64 << (id % 64)) != 0
    }

    #[derive(Clone, Copy, Debug)]
    struct MEntry {
        id: EntryId,
        size: u64,
        hash: u64,
        freq: u8,
    }

    /// Vec-based S3-FIFO: index 0 of each queue is the head (newest), the last is the tail.
    #[derive(Default)]
    struct Model {
        small: Vec<MEntry>,
        main: Vec<MEntry>,
        /// (hash, size, alive), oldest first.
        ghost: Vec<(u64, u64, bool)>,
    }

    impl Model {
        fn ids(&self) -> Vec<EntryId> {
            self.small.iter().chain(&self.main).map(|e| e.id).collect()
        }
        fn len(&self) -> usize {
            self.small.len() + self.main.len()
        }
        fn find(&mut self, id: EntryId) -> Option<&mut MEntry> {
            self.small.iter_mut().chain(self.main.iter_mut()).find(|e| e.id == id)
        }
        fn insert(&mut self, id: EntryId, hash: u64, size: u64) {
            let e = MEntry { id, size, hash, freq: 0 };
            let ghost_hit = self.ghost.iter_mut().find(|g| g.0 == hash && g.2);
            if let Some(g) = ghost_hit {
                g.2 = false;
                self.main.insert(0, e);
            } else {
                self.small.insert(0, e);
            }
        }
        fn access(&mut self, id: EntryId) {
            if let Some(e) = self.find(id) {
                e.freq = (e.freq + 1).min(3);
            }
        }
        fn remove(&mut self, id: EntryId) {
            self.small.retain(|e| e.id != id);
            self.main.retain(|e| e.id != id);
        }
        fn pop(&mut self, mask: u64) -> Option<EntryId> {
            let bytes = |q: &Vec<MEntry>| q.iter().map(|e| e.size).sum::<u64>();
            let target = (bytes(&self.small) + bytes(&self.main)) / 10;
            let mut held: Vec<MEntry> = Vec::new(); // in refusal order
            let mut victim = None;
            loop {
                let from_small = !self.small.is_empty() && (bytes(&self.small) > target || self.main.is_empty());
                let Some(mut e) = (if from_small { self.small.pop() } else { self.main.pop() }) else {
                    break;
                };
                if from_small && e.freq >= 1 {
                    e.freq = 0;
                    self.main.insert(0, e);
                    continue;
                }
                if !from_small && e.freq > 0 {
                    e.freq -= 1;
                    self.main.insert(0, e);
                    continue;
                }
                if !refused(mask, e.id) {
                    if from_small {
                        for g in self.ghost.iter_mut().filter(|g| g.0 == e.hash) {
                            g.2 = false;
                        }
                        self.ghost.push((e.hash, e.size, true));
                        let max_entries = self.len().max(64);
                        let max_bytes = CAPACITY - CAPACITY / 10;
                        while self.ghost.len() > max_entries || self.ghost.iter().map(|g| g.1).sum::<u64>() > max_bytes
                        {
                            self.ghost.remove(0);
                        }
                    }
                    victim = Some(e.id);
                    break;
                }
                held.push(e);
            }
            for e in held {
                self.main.insert(0, e);
            }
            victim
        }
    }

    proptest! {
        #[test]
        fn s3fifo_matches_reference_model(ops in prop::collection::vec(op(), 1..250)) {
            let mut s = S3Fifo::new(CAPACITY);
            let mut model = Model::default();
            for op in ops {
                match op {
                    Op::Insert(n, hash, size) => {
                        let tracked = model.ids();
                        let free: Vec<EntryId> =
                            (0..MAX_ID).filter(|id| !tracked.contains(id)).collect();
                        if free.is_empty() {
                            continue;
                        }
                        let id = free[n % free.len()];
                        s.insert(id, hash, size);
                        model.insert(id, hash, size);
                    }
                    Op::Access(id) => {
                        s.access(id);
                        model.access(id);
                    }
                    Op::Remove(id) => {
                        s.remove(id);
                        model.remove(id);
                    }
                    Op::Pop(_) | Op::PopRefuseAll => {
                        let mask = match op {
                            Op::Pop(m) => m,
                            _ => u64::MAX,
                        };
                        let tracked = model.ids();
                        let hashes: HashMap<EntryId, u64> =
                            model.small.iter().chain(&model.main).map(|e| (e.id, e.hash)).collect();
                        let len_before = s.len();
                        let mut calls = 0usize;
                        let got = s.pop_victim(&mut |id| {
                            calls += 1;
                            !refused(mask, id)
                        }, &|id| hashes.get(&id).copied().unwrap_or(u64::MAX));
                        prop_assert!(calls <= len_before);
                        let want = model.pop(mask);
                        prop_assert_eq!(got, want);
                        match got {
                            Some(v) => {
                                prop_assert!(tracked.contains(&v));
                                prop_assert!(!refused(mask, v));
                                prop_assert!(!s.contains(v));
                            }
                            None => {
                                // None only when every tracked id is refused.
                                prop_assert!(tracked.iter().all(|&id| refused(mask, id)));
                                prop_assert_eq!(calls, len_before);
                            }
                        }
                    }
                }
                prop_assert_eq!(s.len(), model.len());
                prop_assert_eq!(s.queues.len(HELD), 0);
                let small_ids: Vec<EntryId> = model.small.iter().map(|e| e.id).collect();
                let main_ids: Vec<EntryId> = model.main.iter().map(|e| e.id).collect();
                prop_assert_eq!(s.queues.iter(SMALL).collect::<Vec<_>>(), small_ids);
                prop_assert_eq!(s.queues.iter(MAIN).collect::<Vec<_>>(), main_ids);
                let bytes = |q: &Vec<MEntry>| q.iter().map(|e| e.size).sum::<u64>();
                prop_assert_eq!(s.small_bytes, bytes(&model.small));
                prop_assert_eq!(s.main_bytes, bytes(&model.main));
                // len() never exceeds MAX_ID here, so the entry budget is the 64 floor.
                prop_assert!(s.ghost.len() <= GHOST_MIN_ENTRIES);
                prop_assert!(s.ghost.live.len() <= s.ghost.len());
                prop_assert!(s.ghost.bytes <= CAPACITY - CAPACITY / 10);
            }
        }
    }
}
