//! Intrusive doubly linked lists over dense `EntryId`s: one shared link table, `N` queues.
//!
//! Owns only order: each id's prev/next neighbours and which of the `N` queues holds it. It
//! knows nothing about sizes, hits or policy. It must never panic on a caller's id (untracked
//! or out-of-range ids are no-ops), never allocate except to grow the table for a new highest
//! id, and never let one id sit in two queues at once: pushing a linked id moves it.
//!
//! "Front" is the head (newest / most recently used), "back" is the tail (oldest). Every
//! operation is O(1) except the amortised growth of the table.

use super::EntryId;

/// Sentinel for "no neighbour"; `EntryId::MAX` is therefore never stored.
pub(crate) const NIL: EntryId = EntryId::MAX;
/// Queue tag of an id that is in no queue.
const NO_QUEUE: u8 = u8::MAX;

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: EntryId,
    next: EntryId,
    queue: u8,
}

impl Link {
    const UNLINKED: Link = Link { prev: NIL, next: NIL, queue: NO_QUEUE };
}

#[derive(Clone, Copy, Debug)]
struct Ends {
    head: EntryId,
    tail: EntryId,
    len: usize,
}

impl Ends {
    const EMPTY: Ends = Ends { head: NIL, tail: NIL, len: 0 };
}

/// `N` intrusive lists sharing one link table indexed by `EntryId`.
///
/// Queue arguments are small constants chosen by the policy (`q < N`); an out-of-range queue
/// is a policy bug and is treated as an empty queue rather than a panic.
#[derive(Debug)]
pub(crate) struct Lists<const N: usize> {
    links: Vec<Link>,
    ends: [Ends; N],
}

impl<const N: usize> Default for Lists<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> Lists<N> {
    /// Queue tags are stored in a `u8` with `u8::MAX` meaning "none".
    const QUEUES_FIT_IN_TAG: () = assert!(N > 0 && N < NO_QUEUE as usize);

    pub(crate) fn new() -> Self {
        #[allow(clippy::let_unit_value)]
        let () = Self::QUEUES_FIT_IN_TAG;
        Self { links: Vec::new(), ends: [Ends::EMPTY; N] }
    }

    /// The queue holding `id`, if any.
    pub(crate) fn queue_of(&self, id: EntryId) -> Option<usize> {
        let link = self.links.get(id as usize)?;
        (link.queue != NO_QUEUE).then_some(link.queue as usize)
    }

    /// True when `id` is in one of the queues.
    pub(crate) fn contains(&self, id: EntryId) -> bool {
        self.queue_of(id).is_some()
    }

    /// Number of ids in queue `q`.
    pub(crate) fn len(&self, q: usize) -> usize {
        self.ends.get(q).map_or(0, |e| e.len)
    }

    /// True when queue `q` holds nothing.
    pub(crate) fn is_empty(&self, q: usize) -> bool {
        self.len(q) == 0
    }

    /// Newest id of queue `q`.
    #[allow(dead_code)] // Part of the list's API; the policies only need the back today.
    pub(crate) fn front(&self, q: usize) -> Option<EntryId> {
        self.ends.get(q).and_then(|e| (e.head != NIL).then_some(e.head))
    }

    /// Oldest id of queue `q`.
    pub(crate) fn back(&self, q: usize) -> Option<EntryId> {
        self.ends.get(q).and_then(|e| (e.tail != NIL).then_some(e.tail))
    }

    /// Puts `id` at the front of `q`, first unlinking it from wherever it was.
    /// Returns false (and does nothing) for the reserved id `NIL` or a bad queue.
    pub(crate) fn push_front(&mut self, q: usize, id: EntryId) -> bool {
        if !self.prepare(q, id) {
            return false;
        }
        let idx = id as usize;
        let old_head = self.ends[q].head;
        self.links[idx] = Link { prev: NIL, next: old_head, queue: q as u8 };
        if old_head == NIL {
            self.ends[q].tail = id;
        } else {
            self.links[old_head as usize].prev = id;
        }
        self.ends[q].head = id;
        self.ends[q].len += 1;
        true
    }

    /// Puts `id` at the back of `q`, first unlinking it from wherever it was.
    /// Returns false (and does nothing) for the reserved id `NIL` or a bad queue.
    #[allow(dead_code)] // Part of the list's API; exercised by the tests.
    pub(crate) fn push_back(&mut self, q: usize, id: EntryId) -> bool {
        if !self.prepare(q, id) {
            return false;
        }
        let idx = id as usize;
        let old_tail = self.ends[q].tail;
        self.links[idx] = Link { prev: old_tail, next: NIL, queue: q as u8 };
        if old_tail == NIL {
            self.ends[q].head = id;
        } else {
            self.links[old_tail as usize].next = id;
        }
        self.ends[q].tail = id;
        self.ends[q].len += 1;
        true
    }

    /// Unlinks `id`; returns the queue it was in, or `None` (a no-op) if it was in none.
    pub(crate) fn remove(&mut self, id: EntryId) -> Option<usize> {
        let link = *self.links.get(id as usize)?;
        if link.queue == NO_QUEUE {
            return None;
        }
        let q = link.queue as usize;
        // Neighbours of a linked id are linked ids of the same queue, hence in bounds.
        if link.prev == NIL {
            self.ends[q].head = link.next;
        } else {
            self.links[link.prev as usize].next = link.next;
        }
        if link.next == NIL {
            self.ends[q].tail = link.prev;
        } else {
            self.links[link.next as usize].prev = link.prev;
        }
        debug_assert!(self.ends[q].len > 0);
        self.ends[q].len = self.ends[q].len.saturating_sub(1);
        self.links[id as usize] = Link::UNLINKED;
        Some(q)
    }

    /// Removes and returns the newest id of `q`.
    #[allow(dead_code)] // Part of the list's API; exercised by the tests.
    pub(crate) fn pop_front(&mut self, q: usize) -> Option<EntryId> {
        let id = self.front(q)?;
        self.remove(id);
        Some(id)
    }

    /// Removes and returns the oldest id of `q`.
    pub(crate) fn pop_back(&mut self, q: usize) -> Option<EntryId> {
        let id = self.back(q)?;
        self.remove(id);
        Some(id)
    }

    /// Ids of `q` from front (newest) to back (oldest). For tests and debugging: O(len).
    #[cfg(test)]
    pub(crate) fn iter(&self, q: usize) -> impl Iterator<Item = EntryId> + '_ {
        let mut cur = self.ends.get(q).map_or(NIL, |e| e.head);
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = cur;
            cur = self.links.get(id as usize).map_or(NIL, |l| l.next);
            Some(id)
        })
    }

    /// Validates `q` and `id`, grows the table to cover `id` and unlinks `id` if linked.
    fn prepare(&mut self, q: usize, id: EntryId) -> bool {
        debug_assert!(q < N, "queue {q} out of range");
        debug_assert!(id != NIL, "EntryId::MAX is reserved");
        if q >= N || id == NIL {
            return false;
        }
        let idx = id as usize;
        if idx >= self.links.len() {
            // Ids are dense, so growing to the highest id seen stays proportional to the table.
            self.links.resize(idx + 1, Link::UNLINKED);
        } else {
            self.remove(id);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order<const N: usize>(l: &Lists<N>, q: usize) -> Vec<EntryId> {
        l.iter(q).collect()
    }

    #[test]
    fn push_pop_both_ends() {
        let mut l = Lists::<1>::new();
        assert!(l.push_front(0, 1));
        assert!(l.push_front(0, 2));
        assert!(l.push_back(0, 3));
        assert_eq!(order(&l, 0), vec![2, 1, 3]);
        assert_eq!(l.len(0), 3);
        assert_eq!(l.pop_back(0), Some(3));
        assert_eq!(l.pop_front(0), Some(2));
        assert_eq!(l.pop_front(0), Some(1));
        assert_eq!(l.pop_front(0), None);
        assert_eq!(l.pop_back(0), None);
        assert!(l.is_empty(0));
        assert!(!l.contains(1));
    }

    #[test]
    fn remove_middle_head_tail_and_untracked() {
        let mut l = Lists::<1>::new();
        for id in [5, 4, 3, 2, 1] {
            l.push_front(0, id);
        }
        assert_eq!(l.remove(3), Some(0));
        assert_eq!(order(&l, 0), vec![1, 2, 4, 5]);
        assert_eq!(l.remove(1), Some(0));
        assert_eq!(l.remove(5), Some(0));
        assert_eq!(order(&l, 0), vec![2, 4]);
        assert_eq!(l.front(0), Some(2));
        assert_eq!(l.back(0), Some(4));
        // Untracked, never-seen and far out-of-range ids are no-ops.
        assert_eq!(l.remove(3), None);
        assert_eq!(l.remove(1_000_000), None);
        assert_eq!(l.len(0), 2);
    }

    #[test]
    fn grows_on_demand_and_reserves_nil() {
        let mut l = Lists::<1>::new();
        assert!(l.push_back(0, 1000));
        assert!(l.contains(1000));
        assert!(!l.contains(999));
        assert_eq!(l.len(0), 1);
        if !cfg!(debug_assertions) {
            assert!(!l.push_back(0, NIL));
            assert_eq!(l.len(0), 1);
        }
    }

    #[test]
    fn pushing_a_linked_id_moves_it_between_queues() {
        let mut l = Lists::<2>::new();
        l.push_back(0, 1);
        l.push_back(0, 2);
        l.push_back(0, 3);
        l.push_front(1, 2);
        assert_eq!(order(&l, 0), vec![1, 3]);
        assert_eq!(order(&l, 1), vec![2]);
        assert_eq!(l.queue_of(2), Some(1));
        assert_eq!(l.queue_of(1), Some(0));
        // Moving within a queue.
        l.push_front(0, 3);
        assert_eq!(order(&l, 0), vec![3, 1]);
        assert_eq!(l.len(0) + l.len(1), 3);
    }
}
