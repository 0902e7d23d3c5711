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

/// Sentinel for "no neighbour" in the API; `EntryId::MAX` is never stored.
pub(crate) const NIL: EntryId = EntryId::MAX;
/// A link keeps its previous id in 29 bits beside a 3-bit queue tag (8 bytes a link, not 12):
/// ids above this are refused (untracked).
pub const MAX_ENTRY_ID: EntryId = (1 << ID_BITS) - 2;
const ID_BITS: u32 = 29;
const ID_MASK: u32 = (1 << ID_BITS) - 1;
/// "No neighbour" in a link's 29-bit previous id.
const NO_PREV: u32 = ID_MASK;
/// Queue tag of an id that is in no queue.
const NO_QUEUE: u32 = 7;

#[derive(Clone, Copy, Debug)]
struct Link {
    /// The queue's tag (top 3 bits) and the previous id (low 29 bits, `NO_PREV` for none).
    queue_prev: u32,
    next: EntryId,
}

impl Link {
    const UNLINKED: Link = Link { queue_prev: NO_QUEUE << ID_BITS | NO_PREV, next: NIL };

    fn new(queue: usize, prev: EntryId, next: EntryId) -> Link {
        let mut link = Link { queue_prev: (queue as u32) << ID_BITS, next };
        link.set_prev(prev);
        link
    }

    fn prev(&self) -> EntryId {
        match self.queue_prev & ID_MASK {
            NO_PREV => NIL,
            id => id,
        }
    }

    fn set_prev(&mut self, prev: EntryId) {
        debug_assert!(prev == NIL || prev <= MAX_ENTRY_ID);
        let bits = if prev == NIL { NO_PREV } else { prev & ID_MASK };
        self.queue_prev = (self.queue_prev & !ID_MASK) | bits;
    }

    fn queue(&self) -> Option<usize> {
        match self.queue_prev >> ID_BITS {
            NO_QUEUE => None,
            q => Some(q as usize),
        }
    }
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
    /// Queue tags are stored in 3 bits, 7 meaning "none".
    const QUEUES_FIT_IN_TAG: () = assert!(N > 0 && N < NO_QUEUE as usize);

    pub(crate) fn new() -> Self {
        #[allow(clippy::let_unit_value)]
        let () = Self::QUEUES_FIT_IN_TAG;
        Self { links: Vec::new(), ends: [Ends::EMPTY; N] }
    }

    /// The queue holding `id`, if any.
    pub(crate) fn queue_of(&self, id: EntryId) -> Option<usize> {
        self.links.get(id as usize)?.queue()
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
        self.links[idx] = Link::new(q, NIL, old_head);
        if old_head == NIL {
            self.ends[q].tail = id;
        } else {
            self.links[old_head as usize].set_prev(id);
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
        self.links[idx] = Link::new(q, old_tail, NIL);
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
        let q = link.queue()?;
        let (prev, next) = (link.prev(), link.next);
        // Neighbours of a linked id are linked ids of the same queue, hence in bounds.
        if prev == NIL {
            self.ends[q].head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            self.ends[q].tail = prev;
        } else {
            self.links[next as usize].set_prev(prev);
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
        debug_assert!(id <= MAX_ENTRY_ID, "id {id} above MAX_ENTRY_ID");
        if q >= N || id > MAX_ENTRY_ID {
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
    fn grows_on_demand_and_refuses_ids_above_the_limit() {
        let mut l = Lists::<1>::new();
        assert!(l.push_back(0, 1000));
        assert!(l.contains(1000));
        assert!(!l.contains(999));
        assert_eq!(l.len(0), 1);
        if !cfg!(debug_assertions) {
            for id in [NIL, MAX_ENTRY_ID + 1] {
                assert!(!l.push_back(0, id));
                assert!(!l.contains(id));
            }
            assert_eq!(l.len(0), 1);
        }
    }

    #[test]
    fn a_link_is_eight_bytes_and_keeps_the_largest_id_and_every_queue() {
        assert_eq!(std::mem::size_of::<Link>(), 8);
        // (A table reaching the largest id would take 4 GiB: the link is checked alone.)
        for q in 0..NO_QUEUE as usize {
            for (prev, next) in [(MAX_ENTRY_ID, MAX_ENTRY_ID), (NIL, 0), (0, NIL), (MAX_ENTRY_ID - 1, 7)] {
                let mut link = Link::new(q, prev, next);
                assert_eq!((link.queue(), link.prev(), link.next), (Some(q), prev, next));
                link.set_prev(NIL);
                assert_eq!((link.queue(), link.prev()), (Some(q), NIL));
                link.set_prev(MAX_ENTRY_ID);
                assert_eq!((link.queue(), link.prev()), (Some(q), MAX_ENTRY_ID));
            }
        }
        assert_eq!((Link::UNLINKED.queue(), Link::UNLINKED.prev(), Link::UNLINKED.next), (None, NIL, NIL));
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
