//! The shard router: one message per shard per call phase, replies back in caller order.
//!
//! Owns the fan-out every call uses (bucket items by the shard of their key, send one request
//! per shard, gather each shard's replies back to the callers' indices), the reply wait, and the
//! RAII sets that give leases and reservations back on every path. It never interprets a reply
//! beyond matching it to its item, and never lets a lease or reservation outlive its guard.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, Sender};

use super::Engine;
use crate::api::PutOptions;
use crate::error::{Error, Result};
use crate::shard::inbox::Inbox;
use crate::shard::published::{FastLease, FastRead, Prefetch, Prefetcher, PublishedIndex};
use crate::shard::{LeaseId, ObjectRef, ReadGrant, Request, WriteGrant};

/// Requests sent to the shards and not yet answered.
pub(crate) struct Fanout<R> {
    parts: Vec<FanoutPart<R>>,
}

/// One shard's request.
struct FanoutPart<R> {
    shard: usize,
    /// The caller indices of its items, in the order the shard answers them.
    indices: Vec<usize>,
    reply: Result<Receiver<Vec<R>>>,
}

/// Keys between the steps of a batch lease's prefetches (entry, slot, key and value).
const PREFETCH_STRIDE: usize = 4;
/// Leases of a batch that run before it decides whether to prefetch.
const PROBE_KEYS: usize = 32;
/// A probe lease slower than this on average means the index is not cached: prefetch.
const COLD_LEASE: Duration = Duration::from_nanos(250);

/// Per-item results by caller index. A call's indices are distinct positions in the caller's
/// batch, usually dense (a whole batch read), so they index a vector from the first one seen
/// with no hashing; indices spread wider than a few times the expected count (one sub-batch of
/// a large restore) go to a map, so memory stays proportional to the items.
#[derive(Debug)]
pub(crate) enum ByIndex<V> {
    /// `items[i - base]`; the expected count bounds how wide the span may grow.
    Dense {
        base: usize,
        items: Vec<Option<V>>,
        expected: usize,
    },
    Sparse(HashMap<usize, V, BuildHasherDefault<IndexHasher>>),
}

/// An empty `ByIndex` expecting about `n` items.
pub(crate) fn by_index<V>(n: usize) -> ByIndex<V> {
    ByIndex::Dense { base: 0, items: Vec::with_capacity(n), expected: n }
}

impl<V> Default for ByIndex<V> {
    fn default() -> Self {
        by_index(0)
    }
}

/// Widest span a dense `ByIndex` keeps for `expected` items.
fn dense_span(expected: usize) -> usize {
    expected.saturating_mul(4).max(64)
}

impl<V> ByIndex<V> {
    /// Sets index `i`'s item, returning the one it replaces.
    pub(crate) fn insert(&mut self, i: usize, value: V) -> Option<V> {
        if let ByIndex::Dense { base, items, expected } = self {
            if items.is_empty() {
                *base = i;
            }
            let low = i.min(*base);
            let high = i.max(*base + items.len().max(1) - 1);
            if high - low < dense_span(*expected) {
                if i < *base {
                    // Room in front at least doubles, so descending indices stay linear.
                    let grow = (*base - i).max(items.len()).min(*base);
                    items.splice(0..0, std::iter::repeat_with(|| None).take(grow));
                    *base -= grow;
                }
                let at = i - *base;
                if at >= items.len() {
                    items.resize_with(at + 1, || None);
                }
                return items[at].replace(value);
            }
            let map = std::mem::take(items).into_iter().enumerate().filter_map(|(k, v)| v.map(|v| (*base + k, v)));
            let mut sparse = HashMap::with_capacity_and_hasher((*expected).max(1), BuildHasherDefault::default());
            sparse.extend(map);
            *self = ByIndex::Sparse(sparse);
        }
        match self {
            ByIndex::Sparse(map) => map.insert(i, value),
            ByIndex::Dense { .. } => None,
        }
    }

    pub(crate) fn get(&self, i: &usize) -> Option<&V> {
        match self {
            ByIndex::Dense { base, items, .. } => i.checked_sub(*base).and_then(|at| items.get(at)?.as_ref()),
            ByIndex::Sparse(map) => map.get(i),
        }
    }

    pub(crate) fn remove(&mut self, i: &usize) -> Option<V> {
        match self {
            ByIndex::Dense { base, items, .. } => i.checked_sub(*base).and_then(|at| items.get_mut(at)?.take()),
            ByIndex::Sparse(map) => map.remove(i),
        }
    }
}

impl<V> IntoIterator for ByIndex<V> {
    type Item = (usize, V);
    type IntoIter = ByIndexItems<V>;

    /// (index, item): ascending while dense, in no particular order once sparse.
    fn into_iter(self) -> ByIndexItems<V> {
        match self {
            ByIndex::Dense { base, items, .. } => ByIndexItems::Dense { base, items: items.into_iter().enumerate() },
            ByIndex::Sparse(map) => ByIndexItems::Sparse(map.into_iter()),
        }
    }
}

/// The items of a `ByIndex`.
pub(crate) enum ByIndexItems<V> {
    Dense { base: usize, items: std::iter::Enumerate<std::vec::IntoIter<Option<V>>> },
    Sparse(std::collections::hash_map::IntoIter<usize, V>),
}

impl<V> Iterator for ByIndexItems<V> {
    type Item = (usize, V);

    fn next(&mut self) -> Option<(usize, V)> {
        match self {
            ByIndexItems::Dense { base, items } => items.find_map(|(k, v)| v.map(|v| (*base + k, v))),
            ByIndexItems::Sparse(map) => map.next(),
        }
    }
}

/// The hasher of a sparse `ByIndex`: one multiply (Fibonacci hashing) of the index.
#[derive(Default)]
pub(crate) struct IndexHasher(u64);

impl Hasher for IndexHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `usize` keys are hashed here; other input still hashes, just more slowly.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, i: usize) {
        self.0 = (self.0 ^ i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// One shard's answer taken on its own: the shard, and (caller index, result) per item.
pub(crate) type Landed<R> = (usize, Vec<(usize, Result<R>)>);

/// One shard's bucket: the caller indices and the items with their keys.
type Bucket<P> = (Vec<usize>, Vec<(Box<[u8]>, P)>);

impl<R> Fanout<R> {
    /// Items sent.
    pub(crate) fn items(&self) -> usize {
        self.parts.iter().map(|p| p.indices.len()).sum()
    }

    /// True when no shard's answer is left to take (`next_landed` gives None).
    pub(crate) fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// True when every shard has answered (or can no longer): `gather` would not block.
    pub(crate) fn answered(&self) -> bool {
        self.parts.iter().all(|p| p.reply.as_ref().map_or(true, |rx| !rx.is_empty()))
    }

    /// Waits for the first shard still to answer and gives its (caller index, result) pairs
    /// and its shard (None once every shard answered). A shard that is gone gives its items
    /// the error.
    pub(crate) fn next_landed(&mut self) -> Option<Landed<R>> {
        if self.parts.is_empty() {
            return None;
        }
        let at = {
            let mut select = Select::new();
            let mut owners = Vec::with_capacity(self.parts.len());
            for (p, part) in self.parts.iter().enumerate() {
                match &part.reply {
                    Ok(rx) => {
                        select.recv(rx);
                        owners.push(p);
                    }
                    // Could not be sent: answered now, with its error.
                    Err(_) => return self.take_part(p),
                }
            }
            owners.get(select.ready()).copied().unwrap_or(0)
        };
        self.take_part(at)
    }

    /// Part `p`'s answer (it has one, or failed to be sent), removed from the fanout.
    fn take_part(&mut self, p: usize) -> Option<Landed<R>> {
        let FanoutPart { shard, indices, reply } = self.parts.swap_remove(p);
        let reply = reply.and_then(|rx| rx.recv().map_err(|_| Error::ShuttingDown));
        let answers = match reply {
            Ok(replies) => {
                let mut replies = replies.into_iter();
                indices
                    .into_iter()
                    .map(|i| (i, replies.next().ok_or(Error::Internal("a shard answered fewer items"))))
                    .collect()
            }
            Err(e) => indices.into_iter().map(|i| (i, Err(e.clone()))).collect(),
        };
        Some((shard, answers))
    }

    /// Waits for every shard; calls `each(caller index, shard, result)` once per item. A shard
    /// that is gone gives its items the error.
    pub(crate) fn gather(self, engine: &Engine, each: impl FnMut(usize, usize, Result<R>)) {
        self.gather_waiting(engine, true, each)
    }

    /// `gather`; `spin` false blocks on each reply at once instead of polling first (for
    /// replies that take a while, so the caller leaves the CPU to the shards).
    pub(crate) fn gather_waiting(self, engine: &Engine, spin: bool, mut each: impl FnMut(usize, usize, Result<R>)) {
        for FanoutPart { shard, indices, reply } in self.parts {
            let reply =
                reply.and_then(
                    |rx| {
                        if spin {
                            engine.recv_reply(&rx)
                        } else {
                            rx.recv().map_err(|_| Error::ShuttingDown)
                        }
                    },
                );
            match reply {
                Ok(replies) => {
                    let mut replies = replies.into_iter();
                    for index in indices {
                        match replies.next() {
                            Some(reply) => each(index, shard, Ok(reply)),
                            None => each(index, shard, Err(Error::Internal("a shard answered fewer items"))),
                        }
                    }
                }
                Err(e) => indices.into_iter().for_each(|index| each(index, shard, Err(e.clone()))),
            }
        }
    }
}

impl Engine {
    pub(super) fn send(&self, shard: usize, request: Request) -> Result<()> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        let shard = &self.shards[shard];
        // An idle shard lends its core: a write request is then handled on this thread.
        let request = match crate::shard::serve_on_caller(&shard.core, &shard.inbox, request) {
            Ok(()) => return Ok(()),
            Err(request) => request,
        };
        shard.inbox.send(request).map_err(|_| Error::ShuttingDown)
    }

    pub(super) fn send_with_reply<T>(
        &self,
        shard: usize,
        make: impl FnOnce(Sender<T>) -> Request,
    ) -> Result<Receiver<T>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(shard, make(tx))?;
        Ok(rx)
    }

    pub(super) fn call<T>(&self, shard: usize, make: impl FnOnce(Sender<T>) -> Request) -> Result<T> {
        self.recv_reply(&self.send_with_reply(shard, make)?)
    }

    /// Waits for a shard's reply: polls for `reply_spin` first (the shard usually answers within
    /// microseconds, and a blocked caller pays a wake-up), then blocks.
    pub(super) fn recv_reply<T>(&self, rx: &Receiver<T>) -> Result<T> {
        // Already there when a caller handled the request itself (`lend`): no clock read.
        if let Ok(reply) = rx.try_recv() {
            return Ok(reply);
        }
        let started = Instant::now();
        let mut polls = 0u32;
        loop {
            match rx.try_recv() {
                Ok(reply) => return Ok(reply),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(Error::ShuttingDown),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
            }
            if started.elapsed() >= self.config.reply_spin {
                return rx.recv().map_err(|_| Error::ShuttingDown);
            }
            polls += 1;
            if polls < 64 {
                std::hint::spin_loop();
            } else {
                // The shard may need this CPU (fewer CPUs than threads).
                std::thread::yield_now();
            }
        }
    }

    /// Buckets `items` ((caller index, key, payload)) by shard and sends one request per shard,
    /// built by `make(payloads with their keys, reply)`.
    pub(crate) fn fan_out<'k, P, R>(
        &self,
        items: impl IntoIterator<Item = (usize, &'k [u8], P)>,
        make: impl Fn(Vec<(Box<[u8]>, P)>, Sender<Vec<R>>) -> Request,
    ) -> Fanout<R> {
        let mut items = items.into_iter().peekable();
        if items.peek().is_none() {
            // Everything was answered without a message (reads through the published indexes).
            return Fanout { parts: Vec::new() };
        }
        let mut buckets: Vec<Bucket<P>> = (0..self.shards.len()).map(|_| (Vec::new(), Vec::new())).collect();
        for (index, key, payload) in items {
            let bucket = &mut buckets[self.shard_of(key)];
            bucket.0.push(index);
            bucket.1.push((Box::from(key), payload));
        }
        let parts = buckets
            .into_iter()
            .enumerate()
            .filter(|(_, (indices, _))| !indices.is_empty())
            .map(|(shard, (indices, payloads))| FanoutPart {
                shard,
                indices,
                reply: self.send_with_reply(shard, |reply| make(payloads, reply)),
            })
            .collect();
        Fanout { parts }
    }

    /// Sends the lease requests for `keys` ((caller index, key)) without waiting for them.
    pub(super) fn send_leases<'k>(&self, keys: impl IntoIterator<Item = (usize, &'k [u8])>) -> PendingLeases<'_> {
        self.send_leases_with(keys, false)
    }

    /// `send_leases`; `early` grants objects still loading from SSD as their load starts, with
    /// the `Landing` that tells how far it got.
    pub(super) fn send_leases_with<'k>(
        &self,
        keys: impl IntoIterator<Item = (usize, &'k [u8])>,
        early: bool,
    ) -> PendingLeases<'_> {
        // DRAM-resident objects are leased through the shards' published indexes; the rest
        // (on SSD, loading, being written, or a lookup that raced with the shard) by message.
        let keys: Vec<(usize, &[u8])> = keys.into_iter().collect();
        // Each key's shard and index hash, computed once for its prefetches and its lease.
        let hashes: Vec<(usize, u64)> = keys.iter().map(|(_, key)| self.shard_and_index_hash(key)).collect();
        let mut fast = Vec::with_capacity(keys.len());
        let mut answered = by_index(keys.len());
        // Each key's home entry is fetched three strides ahead, its slot two, its key and value
        // one, so a batch's cache misses overlap.
        let steps = [(3, Prefetch::Entry), (2, Prefetch::Slot), (1, Prefetch::Bytes)];
        let prefetchers: Vec<Prefetcher<'_>> = self.shards.iter().map(|s| s.published.prefetcher()).collect();
        let prefetch = |(shard, hash): (usize, u64), what: Prefetch| prefetchers[shard].prefetch(hash, what);
        // Prefetching pays where the batch's index lines are not cached (each lease then waits
        // on a chain of misses) and only adds work where they are: the first `PROBE_KEYS` leases
        // go without it and time themselves, and the rest prefetch when those were slow.
        let probe_started = Instant::now();
        let mut prefetching = false;
        let by_message = keys.into_iter().enumerate().filter_map(|(k, (index, key))| {
            if k == PROBE_KEYS && probe_started.elapsed() >= COLD_LEASE * PROBE_KEYS as u32 {
                prefetching = true;
                // The steps the keys just ahead would have had already.
                for (ahead, what) in steps {
                    for &hash in hashes.iter().skip(k).take(ahead * PREFETCH_STRIDE) {
                        prefetch(hash, what);
                    }
                }
            }
            if prefetching {
                for (ahead, what) in steps {
                    if let Some(&hash) = hashes.get(k + ahead * PREFETCH_STRIDE) {
                        prefetch(hash, what);
                    }
                }
            }
            match self.lease_published_at(key, hashes[k]) {
                Some(Ok((grant, lease))) => {
                    fast.push(lease.into_raw());
                    answered.insert(index, Ok(grant));
                    None
                }
                Some(Err(e)) => {
                    answered.insert(index, Err(e));
                    None
                }
                None => Some((index, key)),
            }
        });
        let fanout = self.fan_out(by_message.map(|(i, k)| (i, k, ())), |items, reply| Request::LeaseRead {
            keys: items.into_iter().map(|(k, ())| k).collect(),
            ttl: None,
            early,
            reply,
        });
        PendingLeases { engine: self, fanout, fast, answered }
    }

    /// Leases one key through its shard's published index: the grant and its guard, the key's
    /// absence, or None when the shard must be asked (see `send_leases_with`).
    pub(super) fn lease_published(&self, key: &[u8]) -> Option<Result<(ReadGrant, PublishedLease<'_>)>> {
        self.lease_published_at(key, self.shard_and_index_hash(key))
    }

    /// A key's shard and its hash in that shard's index.
    fn shard_and_index_hash(&self, key: &[u8]) -> (usize, u64) {
        let hash = crate::shard::key_hash(key);
        ((hash % self.shards.len() as u64) as usize, crate::shard::index_hash(hash))
    }

    /// `lease_published` of a key `shard_and_index_hash` placed at (shard, index hash).
    fn lease_published_at(
        &self,
        key: &[u8],
        (shard, hash): (usize, u64),
    ) -> Option<Result<(ReadGrant, PublishedLease<'_>)>> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return None;
        }
        match self.shards[shard].published.lease(key, hash) {
            FastRead::Hit { lease, ptr, len } => Some(Ok((
                ReadGrant { lease: LeaseId::PUBLISHED, ptr, len, landing: None },
                PublishedLease { engine: self, shard, lease },
            ))),
            FastRead::Miss => Some(Err(Error::NotFound)),
            FastRead::Fallback => None,
        }
    }

    /// Leases `keys` and waits for the grants.
    pub(super) fn lease_many<'k>(
        &self,
        keys: impl IntoIterator<Item = (usize, &'k [u8])>,
    ) -> (ByIndex<Result<ReadGrant>>, LeaseSet<'_>) {
        self.send_leases(keys).wait()
    }

    /// Reserves room for `items` ((caller index, key, len)), one message per shard, running
    /// `while_waiting` after the requests went out and before the replies are awaited.
    pub(super) fn reserve_many<'k>(
        &self,
        items: impl IntoIterator<Item = (usize, &'k [u8], u64)>,
        upsert: bool,
        while_waiting: impl FnOnce(),
    ) -> (ByIndex<Result<WriteGrant>>, Reservations<'_>) {
        let fanout = self.fan_out(items, |items, reply| Request::Reserve { items, upsert, reply });
        while_waiting();
        let mut reservations = Reservations { engine: self, by_shard: vec![Vec::new(); self.shards.len()] };
        let mut out = by_index(fanout.items());
        fanout.gather(self, |index, shard, grant| {
            let grant = grant.and_then(|g| g);
            if let Ok(g) = &grant {
                reservations.by_shard[shard].push((index, g.object));
            }
            out.insert(index, grant);
        });
        (out, reservations)
    }
}

/// Read leases taken by one call; released (one message per shard, and one atomic decrement per
/// published lease) when dropped, on every path.
pub(crate) struct LeaseSet<'e> {
    engine: &'e Engine,
    by_shard: Vec<Vec<LeaseId>>,
    /// Leases taken through the published indexes: (shard, lease).
    fast: Vec<(usize, FastLease)>,
}

impl Drop for LeaseSet<'_> {
    fn drop(&mut self) {
        for (shard, lease) in self.fast.drain(..) {
            self.engine.shards[shard].published.release(lease);
        }
        for (shard, leases) in self.by_shard.iter_mut().enumerate() {
            if !leases.is_empty() {
                // A shard that is gone has dropped its leases with it.
                let _ = self.engine.shards[shard].inbox.send(Request::Release { leases: std::mem::take(leases) });
            }
        }
    }
}

impl LeaseSet<'_> {
    /// The leases as a set that owns its way to the shards, for work that outlives the call
    /// (stream-bound reads release them once the stream passed their copies).
    pub(crate) fn into_held(mut self) -> HeldLeases {
        let by_shard = std::mem::take(&mut self.by_shard)
            .into_iter()
            .enumerate()
            .filter(|(_, leases)| !leases.is_empty())
            .map(|(shard, leases)| (Arc::clone(&self.engine.shards[shard].inbox), leases))
            .collect();
        let fast = std::mem::take(&mut self.fast)
            .into_iter()
            .map(|(shard, lease)| (Arc::clone(&self.engine.shards[shard].published), lease))
            .collect();
        HeldLeases { by_shard, fast }
    }

    /// Leases held.
    pub(crate) fn len(&self) -> usize {
        self.by_shard.iter().map(Vec::len).sum::<usize>() + self.fast.len()
    }
}

/// One lease taken through a published index; given back when dropped.
pub(crate) struct PublishedLease<'e> {
    engine: &'e Engine,
    shard: usize,
    lease: FastLease,
}

impl PublishedLease<'_> {
    /// The shard and lease, for a holder that gives them back itself (`LeaseSet`, `HeldLeases`,
    /// `ObjectLease`).
    pub(super) fn into_raw(self) -> (usize, FastLease) {
        let this = std::mem::ManuallyDrop::new(self);
        (this.shard, this.lease)
    }
}

impl Drop for PublishedLease<'_> {
    fn drop(&mut self) {
        self.engine.shards[self.shard].published.release(self.lease);
    }
}

/// Read leases that outlive the call that took them; released when dropped.
pub(crate) struct HeldLeases {
    by_shard: Vec<(Arc<Inbox>, Vec<LeaseId>)>,
    fast: Vec<(Arc<PublishedIndex>, FastLease)>,
}

impl Drop for HeldLeases {
    fn drop(&mut self) {
        for (index, lease) in self.fast.drain(..) {
            index.release(lease);
        }
        for (inbox, leases) in self.by_shard.drain(..) {
            // A shard that is gone has dropped its leases with it.
            let _ = inbox.send(Request::Release { leases });
        }
    }
}

/// Lease requests sent and not yet answered.
pub(crate) struct PendingLeases<'e> {
    engine: &'e Engine,
    fanout: Fanout<Result<ReadGrant>>,
    /// Published leases taken already, and the results they gave.
    fast: Vec<(usize, FastLease)>,
    answered: ByIndex<Result<ReadGrant>>,
}

impl Drop for PendingLeases<'_> {
    fn drop(&mut self) {
        // Not waited for (a panic on the way): the published leases go back all the same.
        for (shard, lease) in self.fast.drain(..) {
            self.engine.shards[shard].published.release(lease);
        }
    }
}

impl<'e> PendingLeases<'e> {
    /// True when every grant is in: `wait` would not block.
    pub(crate) fn answered(&self) -> bool {
        self.fanout.answered()
    }

    /// For callers that found none of `pending` answered: blocks until a reply of one comes (its
    /// shard answered, or went away) and gives that one's position.
    pub(crate) fn first_answered(pending: &[&PendingLeases<'_>]) -> usize {
        let mut select = Select::new();
        let mut owners = Vec::new();
        for (p, leases) in pending.iter().enumerate() {
            for rx in leases.fanout.parts.iter().filter_map(|part| part.reply.as_ref().ok()) {
                select.recv(rx);
                owners.push(p);
            }
        }
        if owners.is_empty() {
            return 0;
        }
        owners.get(select.ready()).copied().unwrap_or(0)
    }

    /// True when some keys went to their shards by message (not readable through the
    /// published indexes): `wait` is a round trip.
    pub(crate) fn by_message(&self) -> bool {
        !self.fanout.parts.is_empty()
    }

    /// Waits for every shard's grants. The returned set releases them when dropped.
    pub(crate) fn wait(mut self) -> (ByIndex<Result<ReadGrant>>, LeaseSet<'e>) {
        let fanout = std::mem::replace(&mut self.fanout, Fanout { parts: Vec::new() });
        let by_shard = if fanout.parts.is_empty() { Vec::new() } else { vec![Vec::new(); self.engine.shards.len()] };
        let mut leases = LeaseSet { engine: self.engine, by_shard, fast: std::mem::take(&mut self.fast) };
        let mut out = std::mem::take(&mut self.answered);
        fanout.gather(self.engine, |index, shard, grant| {
            let grant = grant.and_then(|g| g);
            if let Ok(g) = &grant {
                leases.by_shard[shard].push(g.lease);
            }
            out.insert(index, grant);
        });
        (out, leases)
    }
}

/// Reservations taken by one call; those not committed are aborted when dropped.
pub(crate) struct Reservations<'e> {
    engine: &'e Engine,
    by_shard: Vec<Vec<(usize, ObjectRef)>>,
}

impl Reservations<'_> {
    /// Hands every reservation over to the caller, who commits or aborts it by message.
    pub(crate) fn forget(mut self) {
        self.by_shard.iter_mut().for_each(Vec::clear);
    }

    /// Takes over `other`'s reservations (taken by the same call for more of its keys).
    pub(crate) fn absorb(&mut self, mut other: Reservations<'_>) {
        for (mine, theirs) in self.by_shard.iter_mut().zip(other.by_shard.iter_mut()) {
            mine.append(theirs);
        }
    }

    /// Commits the reservations whose index `keep` accepts; the rest stay, to be committed by
    /// a later call or aborted on drop.
    pub(crate) fn commit(&mut self, opts: PutOptions, keep: impl Fn(usize) -> bool) -> ByIndex<Result<()>> {
        let (upsert, pin) = (opts.upsert, opts.pin);
        let mut out = by_index(self.by_shard.iter().map(Vec::len).sum());
        let mut pending = Vec::new();
        for shard in 0..self.by_shard.len() {
            let (commit, abort): (Vec<_>, Vec<_>) = self.by_shard[shard].drain(..).partition(|(index, _)| keep(*index));
            self.by_shard[shard] = abort;
            if commit.is_empty() {
                continue;
            }
            let objects = commit.iter().map(|(_, o)| *o).collect();
            pending.push((
                commit,
                self.engine.send_with_reply(shard, |reply| Request::Commit { objects, upsert, pin, reply }),
            ));
        }
        for (commit, rx) in pending {
            match rx.and_then(|rx| self.engine.recv_reply(&rx)) {
                Ok(results) => {
                    for ((index, _), result) in commit.into_iter().zip(results) {
                        out.insert(index, result);
                    }
                }
                Err(e) => commit.into_iter().for_each(|(index, _)| {
                    out.insert(index, Err(e.clone()));
                }),
            }
        }
        out
    }
}

/// One reservation of a single-key write (`Engine::reserve_one`), taken on the lent core or by
/// message; aborted when dropped uncommitted.
pub(crate) struct Reservation<'e> {
    engine: &'e Engine,
    shard: usize,
    object: Option<ObjectRef>,
}

impl<'e> Reservation<'e> {
    pub(crate) fn new(engine: &'e Engine, shard: usize, object: ObjectRef) -> Reservation<'e> {
        Reservation { engine, shard, object: Some(object) }
    }

    /// Commits it: on the lent core when the shard is idle (and the commit waits for no
    /// record), else by message.
    pub(crate) fn commit(mut self, opts: PutOptions) -> Result<()> {
        let object = self.object.take().ok_or(Error::Internal("a reservation committed twice"))?;
        let (upsert, pin) = (opts.upsert, opts.pin);
        let shard = &self.engine.shards[self.shard];
        if !self.engine.write_through() {
            let lent = crate::shard::lend(&shard.core, &shard.inbox)
                .and_then(|lent| lent.run(|core| core.commit_now_unless_durable(object, upsert, pin)));
            if let Some(done) = lent {
                return done;
            }
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        if let Err(e) = self.engine.send(self.shard, Request::Commit { objects: vec![object], upsert, pin, reply: tx })
        {
            // Never delivered: the drop aborts it (a shard that is gone took it along).
            self.object = Some(object);
            return Err(e);
        }
        let results = self.engine.recv_reply(&rx)?;
        results.into_iter().next().unwrap_or(Err(Error::Internal("a shard answered no commit")))
    }
}

impl Engine {
    /// Reserves room for one value: on its shard's lent core when the shard is idle, else by
    /// message (which also waits for demotions to make room). The reservation is aborted when
    /// its guard drops uncommitted.
    pub(crate) fn reserve_one(&self, key: &[u8], len: u64, upsert: bool) -> Result<(WriteGrant, Reservation<'_>)> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        let shard = self.shard_of(key);
        let (core, inbox) = (&self.shards[shard].core, &self.shards[shard].inbox);
        let lent = crate::shard::lend(core, inbox).and_then(|lent| lent.run(|core| core.reserve_now(key, len, upsert)));
        let grant = match lent {
            Some(grant) => grant?,
            None => {
                let items = vec![(Box::from(key), len)];
                let grants = self.call(shard, |reply| Request::Reserve { items, upsert, reply })?;
                grants.into_iter().next().unwrap_or(Err(Error::Internal("a shard answered no reservation")))?
            }
        };
        let reservation = Reservation::new(self, shard, grant.object);
        Ok((grant, reservation))
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            let _ = self.engine.shards[self.shard].inbox.send(Request::Abort { objects: vec![object] });
        }
    }
}

impl Drop for Reservations<'_> {
    fn drop(&mut self) {
        for (shard, items) in self.by_shard.iter_mut().enumerate() {
            if !items.is_empty() {
                let objects = items.drain(..).map(|(_, o)| o).collect();
                let _ = self.engine.shards[shard].inbox.send(Request::Abort { objects });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::{by_index, ByIndex};

    proptest! {
        /// `ByIndex` answers as a map would for any order and spread of indices, dense or
        /// sparse, and its items come back exactly once each.
        #[test]
        fn by_index_behaves_as_a_map(
            expected in 0usize..40,
            ops in proptest::collection::vec((0usize..3, 0usize..400), 0..200),
        ) {
            let mut dense: ByIndex<usize> = by_index(expected);
            let mut model: HashMap<usize, usize> = HashMap::new();
            for (n, (op, i)) in ops.into_iter().enumerate() {
                match op {
                    0 | 1 => prop_assert_eq!(dense.insert(i, n), model.insert(i, n)),
                    _ => prop_assert_eq!(dense.remove(&i), model.remove(&i)),
                }
                prop_assert_eq!(dense.get(&i), model.get(&i));
            }
            let mut items: Vec<(usize, usize)> = dense.into_iter().collect();
            let mut want: Vec<(usize, usize)> = model.into_iter().collect();
            items.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(items, want);
        }
    }

    #[test]
    fn by_index_stays_dense_for_a_batch_and_bounded_for_a_spread() {
        let mut batch: ByIndex<u8> = by_index(1000);
        for i in (0..1000).rev() {
            batch.insert(i, 1);
        }
        assert!(matches!(&batch, ByIndex::Dense { items, .. } if items.len() <= 2000));
        let mut spread: ByIndex<u8> = by_index(10);
        for i in 0..10 {
            spread.insert(i * 100_000, 1);
        }
        assert!(matches!(spread, ByIndex::Sparse(_)));
    }
}
