//! Least-recently-used eviction over one intrusive list.
//!
//! Owns only the recency order of tracked ids. It must never free memory, never return an id
//! `evictable` refused, and never call `evictable` more than `len()` times in one `pop_victim`.

use super::list::Lists;
use super::{EntryId, Eviction};

/// The single queue: front = most recently used, back = least recently used.
const RECENCY: usize = 0;

/// Least-recently-used policy. All operations are O(1); `pop_victim` is O(refused + 1).
#[derive(Debug, Default)]
pub struct Lru {
    list: Lists<1>,
}

impl Lru {
    /// An empty policy.
    pub fn new() -> Self {
        Self { list: Lists::new() }
    }

    /// True when `id` is tracked.
    pub fn contains(&self, id: EntryId) -> bool {
        self.list.contains(id)
    }
}

impl Eviction for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn insert(&mut self, id: EntryId, _key_hash: u64, _size_bytes: u64) {
        debug_assert!(!self.list.contains(id), "insert of tracked id {id}");
        // push_front moves an already-linked id, so a double insert degrades to an access.
        self.list.push_front(RECENCY, id);
    }

    fn access(&mut self, id: EntryId) {
        if self.list.contains(id) {
            self.list.push_front(RECENCY, id);
        }
    }

    fn remove(&mut self, id: EntryId) {
        self.list.remove(id);
    }

    fn pop_victim(
        &mut self,
        evictable: &mut dyn FnMut(EntryId) -> bool,
        _key_hash: &dyn Fn(EntryId) -> u64,
    ) -> Option<EntryId> {
        // Each refused id rotates to the front, so `len` steps visit every id exactly once.
        for _ in 0..self.list.len(RECENCY) {
            let id = self.list.back(RECENCY)?;
            if evictable(id) {
                self.list.remove(id);
                return Some(id);
            }
            // Refused means leased or in flight: it is in use right now, i.e. recently used.
            self.list.push_front(RECENCY, id);
        }
        None
    }

    fn len(&self) -> usize {
        self.list.len(RECENCY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pop_all(lru: &mut Lru) -> Vec<EntryId> {
        std::iter::from_fn(|| lru.pop_victim(&mut |_| true, &u64::from)).collect()
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        let mut lru = Lru::new();
        for id in [1, 2, 3, 4] {
            lru.insert(id, u64::from(id), 10);
        }
        lru.access(1);
        lru.access(3);
        assert_eq!(pop_all(&mut lru), vec![2, 4, 1, 3]);
        assert!(lru.is_empty());
        assert_eq!(lru.pop_victim(&mut |_| true, &u64::from), None);
    }

    #[test]
    fn lru_refused_entries_stay_tracked_and_move_to_mru() {
        let mut lru = Lru::new();
        for id in [1, 2, 3] {
            lru.insert(id, 0, 1);
        }
        assert_eq!(lru.pop_victim(&mut |id| id != 1, &u64::from), Some(2));
        assert!(lru.contains(1));
        assert!(!lru.contains(2));
        assert_eq!(lru.len(), 2);
        // 1 was refused, so it is now more recent than 3.
        assert_eq!(pop_all(&mut lru), vec![3, 1]);
    }

    #[test]
    fn lru_all_refused_returns_none_within_len_calls() {
        let mut lru = Lru::new();
        for id in 0..10 {
            lru.insert(id, 0, 1);
        }
        let mut calls = 0;
        assert_eq!(
            lru.pop_victim(
                &mut |_| {
                    calls += 1;
                    false
                },
                &u64::from
            ),
            None
        );
        assert_eq!(calls, 10);
        assert_eq!(lru.len(), 10);
        // A full rotation keeps the original order.
        assert_eq!(pop_all(&mut lru), (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn lru_untracked_remove_and_access_are_noops() {
        let mut lru = Lru::new();
        lru.access(7);
        lru.remove(7);
        assert!(lru.is_empty());
        lru.insert(1, 0, 1);
        lru.insert(2, 0, 1);
        lru.access(99);
        lru.remove(99);
        lru.remove(1);
        lru.remove(1);
        lru.access(1);
        assert_eq!(lru.len(), 1);
        assert_eq!(pop_all(&mut lru), vec![2]);
    }

    #[test]
    fn lru_reuses_ids_and_grows_for_large_ids() {
        let mut lru = Lru::new();
        lru.insert(5000, 0, 1);
        lru.insert(0, 0, 1);
        assert_eq!(lru.pop_victim(&mut |_| true, &u64::from), Some(5000));
        lru.insert(5000, 0, 1);
        assert_eq!(pop_all(&mut lru), vec![0, 5000]);
    }

    const MAX_ID: u32 = 48;

    #[derive(Clone, Debug)]
    enum Op {
        /// Insert the `n`-th (mod count) untracked id.
        Insert(usize),
        Access(u32),
        Remove(u32),
        /// Pop with a refuse-set given as a bit mask over ids.
        Pop(u64),
        PopRefuseAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => any::<usize>().prop_map(Op::Insert),
            2 => (0..MAX_ID + 2).prop_map(Op::Access),
            1 => (0..MAX_ID + 2).prop_map(Op::Remove),
            3 => any::<u64>().prop_map(Op::Pop),
            1 => Just(Op::PopRefuseAll),
        ]
    }

    fn refused(mask: u64, id: EntryId) -> bool {
        mask & (1u64 << (id % 64)) != 0
    }

    proptest! {
        #[test]
        fn lru_matches_recency_model(ops in prop::collection::vec(op(), 1..200)) {
            let mut lru = Lru::new();
            // Model: index 0 is least recently used.
            let mut model: Vec<EntryId> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(n) => {
                        let free: Vec<EntryId> =
                            (0..MAX_ID).filter(|id| !model.contains(id)).collect();
                        if free.is_empty() {
                            continue;
                        }
                        let id = free[n % free.len()];
                        lru.insert(id, u64::from(id), 1);
                        model.push(id);
                    }
                    Op::Access(id) => {
                        lru.access(id);
                        if let Some(pos) = model.iter().position(|&x| x == id) {
                            model.remove(pos);
                            model.push(id);
                        }
                    }
                    Op::Remove(id) => {
                        lru.remove(id);
                        model.retain(|&x| x != id);
                    }
                    Op::Pop(_) | Op::PopRefuseAll => {
                        let mask = match op {
                            Op::Pop(m) => m,
                            _ => u64::MAX,
                        };
                        let len_before = lru.len();
                        let mut calls = 0usize;
                        let got = lru.pop_victim(&mut |id| {
                            calls += 1;
                            !refused(mask, id)
                        }, &u64::from);
                        prop_assert!(calls <= len_before);
                        // Model: walk from LRU, refused ones rotate to MRU.
                        let mut want = None;
                        for _ in 0..model.len() {
                            let id = model.remove(0);
                            if refused(mask, id) {
                                model.push(id);
                            } else {
                                want = Some(id);
                                break;
                            }
                        }
                        prop_assert_eq!(got, want);
                        if let Some(v) = got {
                            prop_assert!(!refused(mask, v));
                            prop_assert!(!lru.contains(v));
                        }
                        let all_refused = model.iter().all(|&id| refused(mask, id));
                        if all_refused && got.is_none() {
                            prop_assert_eq!(calls, len_before);
                        }
                    }
                }
                prop_assert_eq!(lru.len(), model.len());
                for &id in &model {
                    prop_assert!(lru.contains(id));
                }
            }
            // Final drain follows the model's order exactly.
            prop_assert_eq!(pop_all(&mut lru), model);
        }
    }
}
