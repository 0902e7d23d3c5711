//! The embedded engine: routes each key to its shard, batches one message per shard per call
//! phase, and moves bytes on the calling thread under the leases the shards grant.
//!
//! It owns the shard threads and the arena. It never touches a shard's index or allocator
//! directly, and it never reports a key as done before every one of its bytes was copied. It sits
//! above `shard/`: it imports the shards, never the other way round. The concerns live in
//! submodules: `open` (start-up, `StoreBuilder::open`), `router` (fan-out to shards, lease and
//! reservation guards), `transports` (which transport reaches which memory), `read` and `write`
//! (the one read and one write path), `parts` (how a gathered GPU write is cut into parts),
//! `parallel` (a large call's per-page host work spread over a few threads), `batch_get` (the
//! async batch read, a task the shards drive), `restore` (pipelined SSD restores), `stream`
//! (chunked reads behind a `ChunkHandle`), `progressive` (puts published after their chunks
//! landed), `on_stream` (reads on the caller's device stream), `store` (the `Store` API over
//! them) and `gpu` (GPU setup and counters).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtide_tiers::dram::Arena;

use crate::api::PutOptions;
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::shard::core::RecoveryReport;
use crate::shard::published::{FastLease, PublishedIndex};
use crate::shard::{ReadGrant, Request, ShardThread, WriteGrant};

mod batch_get;
pub(crate) mod gpu;
mod key_index;
mod on_stream;
mod open;
mod parallel;
mod parts;
mod progressive;
pub(crate) mod read;
mod restore;
mod router;
mod store;
mod stream;
pub(crate) mod transports;
mod write;

pub use on_stream::{StreamCompleter, StreamStatus, StreamTicket};
pub use progressive::{Following, PutStream};
pub use restore::{LeasePart, LeasePlan, RestoreMode, RestoreOptions, RestoreReport, SubBatchState, SubBatchTrace};
pub(crate) use router::{LeaseSet, PendingLeases, Reservation, Reservations};

/// Grace between an explicit lease's TTL (when the guard stops handing out bytes) and the moment
/// the shard reclaims it.
const LEASE_EXPIRY_GRACE: Duration = Duration::from_secs(1);
/// Allocation granularity inside a slice (cache-line aligned objects).
const OBJECT_ALIGN_BYTES: u64 = 64;

/// The embedded store. Cheap to share (`Arc<Engine>`); every method takes `&self`.
pub struct Engine {
    shards: Vec<ShardThread>,
    joins: Mutex<Vec<std::thread::JoinHandle<()>>>,
    arena: Arc<Arena>,
    /// Where DRAM-resident objects lie, for an owner's same-host clients (`StoreBuilder::read_index`).
    read_index: Option<Arc<kvtide_tiers::dram::read_index::ReadIndex>>,
    config: EngineConfig,
    max_value_bytes: u64,
    tickets_in_flight: Arc<AtomicU64>,
    shutting_down: AtomicBool,
    recovery: Vec<RecoveryReport>,
    credits: restore::CreditBroker,
    restore: restore::RestoreCounters,
    /// Non-zero while GPU transfers are in flight: shards then poll instead of parking.
    keep_awake: Arc<AtomicUsize>,
    /// When a shutdown must end its flush (`shutdown_by`); shards read it once they quiesce.
    stop_deadline: Arc<std::sync::OnceLock<Instant>>,
    gpu: gpu::GpuState,
    streams: Arc<crate::stats::StreamCounters>,
    unsealed: Arc<progressive::UnsealedPuts>,
    /// The shard that watches the next stream-bound read (round robin).
    next_watch_shard: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("shards", &self.shards.len()).field("arena", &self.arena).finish()
    }
}

/// A batch of leases asked for at once and handed out shard by shard as each shard answers
/// (`Engine::lease_batch_as_landed`). Dropping it waits for the shards still to answer and
/// releases what they granted.
pub struct LandingLeases<'e> {
    engine: &'e Engine,
    fanout: router::Fanout<Result<ReadGrant>>,
    invalid: Vec<(usize, Result<ObjectLease>)>,
    expires_at: Instant,
}

impl LandingLeases<'_> {
    /// The next shard's leases, as (index into the caller's keys, lease or error) pairs: the
    /// invalid keys first, then the shards in the order they answered. None once all came.
    pub fn next_landed(&mut self) -> Option<Vec<(usize, Result<ObjectLease>)>> {
        if !self.invalid.is_empty() {
            return Some(std::mem::take(&mut self.invalid));
        }
        let (shard, answers) = self.fanout.next_landed()?;
        let engine = self.engine;
        let holder = || LeaseHolder::Shard(Arc::clone(&engine.shards[shard].inbox));
        Some(
            answers
                .into_iter()
                .map(|(i, grant)| (i, grant.and_then(|g| g).map(|g| engine.object_lease(g, self.expires_at, holder()))))
                .collect(),
        )
    }
}

impl LandingLeases<'_> {
    /// True once every group was handed out (`next_landed` would give None).
    pub fn is_done(&self) -> bool {
        self.invalid.is_empty() && self.fanout.is_empty()
    }
}

impl Drop for LandingLeases<'_> {
    fn drop(&mut self) {
        // Leases granted after the caller stopped asking go back at once.
        while let Some(group) = self.next_landed() {
            drop(group);
        }
    }
}

/// The shard `key` lives on in an engine of `shards` shards (a read index's reader looks it up
/// in that shard's region).
pub fn shard_of_key(key: &[u8], shards: usize) -> usize {
    (crate::shard::key_hash(key) % shards.max(1) as u64) as usize
}

impl Engine {
    /// The store's restore settings as options for `restore_batch`.
    pub fn restore_options(&self) -> RestoreOptions {
        RestoreOptions {
            target_bytes: self.config.restore_sub_batch_bytes,
            max_keys: self.config.restore_sub_batch_keys,
            ahead_bytes: self.config.restore_ahead_bytes,
            ..RestoreOptions::default()
        }
    }

    /// What each shard's SSD recovery found at open (empty reports without an SSD tier).
    pub fn recovery_reports(&self) -> &[RecoveryReport] {
        &self.recovery
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Largest value this store accepts.
    pub fn max_value_bytes(&self) -> u64 {
        self.max_value_bytes
    }

    /// The SSD tier's configured capacity in bytes (`[ssd] bytes`), or None without an SSD tier.
    pub fn ssd_capacity_bytes(&self) -> Option<u64> {
        self.config.ssd.as_ref().map(|ssd| ssd.bytes)
    }

    /// The DRAM arena (for transports that register it).
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// The read index, when the engine keeps one (`StoreBuilder::read_index`).
    pub fn read_index(&self) -> Option<&Arc<kvtide_tiers::dram::read_index::ReadIndex>> {
        self.read_index.as_ref()
    }

    /// Reads other processes made through the read index, as `(shard, slot, generation)` of the
    /// entries they read: each is counted as a hit and fed to that shard's eviction policy, as
    /// the engine's own reads are. Entries of objects no longer there are skipped (the values
    /// come from outside: nothing is trusted but the match). Returns how many counted.
    pub fn note_index_reads(&self, reads: &[(u32, u32, u32)]) -> usize {
        reads
            .iter()
            .filter(|&&(shard, slot, generation)| {
                self.shards.get(shard as usize).is_some_and(|s| s.published.note_read(slot, generation))
            })
            .count()
    }

    /// The shard `key` lives on.
    pub fn shard_of(&self, key: &[u8]) -> usize {
        shard_of_key(key, self.shards.len())
    }

    /// Heap bytes the shards' published indexes hold (key tables and object slots; the objects'
    /// own metadata and keys are not counted here).
    pub fn published_index_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.published.heap_bytes()).sum()
    }

    /// Waits until every shard has handled everything this thread sent it before (releases are
    /// fire-and-forget, so tests call this before asserting counters).
    pub fn sync_shards(&self) -> Result<()> {
        let replies: Vec<_> = (0..self.shards.len())
            .map(|shard| self.send_with_reply(shard, |reply| Request::Barrier { reply }))
            .collect::<Result<_>>()?;
        replies.into_iter().try_for_each(|rx| self.recv_reply(&rx))
    }

    /// Takes an explicit lease on `key` for a caller that reads asynchronously. The bytes stay
    /// in place until the guard drops; `ttl_ms` is only a backstop for a caller that vanishes.
    /// An SSD-resident object is loaded into DRAM (and checked) before this returns.
    pub fn lease(&self, key: &[u8], ttl_ms: u64) -> Result<ObjectLease> {
        self.validate_key(key)?;
        self.lease_with(key, ttl_ms, false)
    }

    /// `lease` for a caller that sends the bytes on in order and drops the lease as soon as they
    /// are sent: an SSD-resident object is leased as soon as its load starts, and
    /// `ObjectLease::bytes_when_ready` hands out each range once the load's checked front passed
    /// it (a DRAM-resident object's ranges at once). A DRAM-resident object is leased through
    /// its shard's published index, without a message: the TTL still ends `bytes_when_ready`,
    /// but the shard cannot take such a lease back, so the object stays (unevictable) until the
    /// lease drops, and such leases do not count against the shard's `max_leases`.
    pub fn lease_progressive(&self, key: &[u8], ttl_ms: u64) -> Result<ObjectLease> {
        match self.lease_resident(key, ttl_ms) {
            Some(leased) => leased,
            None => self.lease_with(key, ttl_ms, true),
        }
    }

    /// The first half of `lease_progressive`: a DRAM-resident `key` leased through its shard's
    /// published index (a missing or invalid one answered), without a message; None when only
    /// the shard can answer (the object is on SSD only, loading or changing).
    pub fn lease_resident(&self, key: &[u8], ttl_ms: u64) -> Option<Result<ObjectLease>> {
        if let Err(e) = self.validate_key(key) {
            return Some(Err(e));
        }
        Some(self.lease_published(key)?.map(|(grant, lease)| {
            let (shard, lease) = lease.into_raw();
            let holder = LeaseHolder::Published(Arc::clone(&self.shards[shard].published), lease);
            self.object_lease(grant, Instant::now() + Duration::from_millis(ttl_ms), holder)
        }))
    }

    /// A shard lease of a valid `key` (`early`: granted as its load starts).
    fn lease_with(&self, key: &[u8], ttl_ms: u64, early: bool) -> Result<ObjectLease> {
        let ttl = Duration::from_millis(ttl_ms);
        let shard = self.shard_of(key);
        let rx = self.send_with_reply(shard, |reply| Request::LeaseRead {
            keys: vec![key.into()],
            ttl: Some(ttl + LEASE_EXPIRY_GRACE),
            early,
            reply,
        })?;
        let grant = self.recv_reply(&rx)?.pop().ok_or(Error::Internal("empty lease reply"))??;
        let holder = LeaseHolder::Shard(Arc::clone(&self.shards[shard].inbox));
        Ok(self.object_lease(grant, Instant::now() + ttl, holder))
    }

    fn object_lease(&self, grant: ReadGrant, expires_at: Instant, holder: LeaseHolder) -> ObjectLease {
        ObjectLease { grant, expires_at, holder, _arena: Arc::clone(&self.arena), held: true }
    }

    /// Longest key this store accepts.
    pub fn max_key_bytes(&self) -> usize {
        self.config.max_key_bytes
    }

    /// Reserves room for a `len`-byte value under `key` that the caller fills in place
    /// (`PendingPut::bytes_mut`) and then publishes with `PendingPut::commit`; dropping it
    /// uncommitted aborts. The owner process streams network bytes straight into it.
    pub fn reserve_put(&self, key: &[u8], len: u64, opts: PutOptions) -> Result<PendingPut<'_>> {
        self.validate_key(key)?;
        self.validate_value_len(len)?;
        let (grant, reservation) = self.reserve_one(key, len, opts.upsert)?;
        Ok(PendingPut { grant, reservation, opts })
    }

    /// `lease` for many keys at once: one request per shard, so the SSD-resident keys of every
    /// shard load at the same time (each shard within its restore budget) instead of one after
    /// another. One result per key, in order; a bad key fails only itself.
    pub fn lease_batch(&self, keys: &[&[u8]], ttl_ms: u64) -> Vec<Result<ObjectLease>> {
        self.lease_batch_with(keys, ttl_ms, false)
    }

    /// `lease_batch` for a caller that sends the bytes on in order (see `lease_progressive`):
    /// each SSD-resident object is leased as soon as its load starts, so the loads of a whole
    /// batch run side by side while the caller sends the first objects. Every lease is a shard
    /// lease (it counts against the shard's `max_leases`).
    pub fn lease_batch_progressive(&self, keys: &[&[u8]], ttl_ms: u64) -> Vec<Result<ObjectLease>> {
        self.lease_batch_with(keys, ttl_ms, true)
    }

    /// `lease_batch` whose leases come shard by shard as each shard answers
    /// (`LandingLeases::next_landed`): a caller that sends each object on as soon as it is
    /// leased (the owner serving a batch read) starts on the shard whose loads ended first
    /// instead of waiting for the slowest. Invalid keys come first, in a group of their own.
    pub fn lease_batch_as_landed(&self, keys: &[&[u8]], ttl_ms: u64) -> LandingLeases<'_> {
        let ttl = Duration::from_millis(ttl_ms);
        let mut invalid = Vec::new();
        let mut valid = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match self.validate_key(key) {
                Ok(()) => valid.push((i, *key, ())),
                Err(e) => invalid.push((i, Err(e))),
            }
        }
        let fanout = self.fan_out(valid, |items, reply| Request::LeaseRead {
            keys: items.into_iter().map(|(k, ())| k).collect(),
            ttl: Some(ttl + LEASE_EXPIRY_GRACE),
            early: false,
            reply,
        });
        LandingLeases { engine: self, fanout, invalid, expires_at: Instant::now() + ttl }
    }

    /// `lease_batch`; `early`: granted as their loads start.
    fn lease_batch_with(&self, keys: &[&[u8]], ttl_ms: u64, early: bool) -> Vec<Result<ObjectLease>> {
        let ttl = Duration::from_millis(ttl_ms);
        let mut out: Vec<Result<ObjectLease>> =
            keys.iter().map(|_| Err(Error::Internal("lease never answered"))).collect();
        let mut valid = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match self.validate_key(key) {
                Ok(()) => valid.push((i, *key, ())),
                Err(e) => out[i] = Err(e),
            }
        }
        let fanout = self.fan_out(valid, |items, reply| Request::LeaseRead {
            keys: items.into_iter().map(|(k, ())| k).collect(),
            ttl: Some(ttl + LEASE_EXPIRY_GRACE),
            early,
            reply,
        });
        let expires_at = Instant::now() + ttl;
        // DRAM-resident keys are granted within microseconds: poll briefly, then block (loads
        // take longer).
        fanout.gather(self, |index, shard, grant| {
            out[index] = grant.and_then(|g| g).map(|grant| {
                self.object_lease(grant, expires_at, LeaseHolder::Shard(Arc::clone(&self.shards[shard].inbox)))
            });
        });
        out
    }

    /// `reserve_put` for many values at once (one request per shard); `PendingPuts::commit`
    /// publishes the ones the caller filled, in one request per shard.
    pub fn reserve_puts(&self, items: &[(&[u8], u64)], opts: PutOptions) -> PendingPuts<'_> {
        let mut grants: Vec<Result<WriteGrant>> =
            items.iter().map(|_| Err(Error::Internal("reservation never answered"))).collect();
        let mut valid = Vec::with_capacity(items.len());
        for (i, (key, len)) in items.iter().enumerate() {
            match self.validate_key(key).and_then(|()| self.validate_value_len(*len)) {
                Ok(()) => valid.push((i, *key, *len)),
                Err(e) => grants[i] = Err(e),
            }
        }
        let (granted, reservations) = self.reserve_many(valid, opts.upsert, || {});
        for (i, grant) in granted {
            grants[i] = grant;
        }
        PendingPuts { grants, reservations, opts }
    }

    /// `shutdown`, with the flush of DRAM-only objects to SSD ending by `deadline` at the latest
    /// (and by `shutdown_flush_timeout_ms` as always): what it did not write by then is not
    /// kept, and is counted and logged (`shutdown_unflushed_objects` / `_bytes`). Queued
    /// tombstones are still written past it (they keep older values from returning), so the
    /// call can outlast `deadline` by their writes and syncs. A deadline given after the first
    /// call to either is ignored.
    pub fn shutdown_by(&self, deadline: Instant) {
        // A second deadline loses the race: the first one is what the shards read.
        let _ = self.stop_deadline.set(deadline);
        self.shutdown();
    }

    /// Stops accepting requests, lets in-flight work finish and joins the shard threads.
    /// Later calls fail with `ShuttingDown`. Idempotent; `drop` calls it.
    pub fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.unsealed.close();
        for shard in &self.shards {
            shard.inbox.close();
        }
        let joins = std::mem::take(&mut *self.joins.lock().unwrap_or_else(|p| p.into_inner()));
        if joins.is_empty() {
            return;
        }
        for join in joins {
            if join.join().is_err() {
                tracing::error!("a shard thread panicked");
            }
        }
        let total = crate::Store::stats(self).total;
        if total.shutdown_unflushed_objects > 0 && !self.config.demote_on_shutdown {
            tracing::info!(
                objects = total.shutdown_unflushed_objects,
                bytes = total.shutdown_unflushed_bytes,
                "clean shutdown: DRAM-only objects not written to SSD (demote_on_shutdown off)"
            );
        } else if total.shutdown_unflushed_objects > 0 {
            tracing::warn!(
                objects = total.shutdown_unflushed_objects,
                bytes = total.shutdown_unflushed_bytes,
                written = total.shutdown_demotions,
                "clean shutdown: DRAM-only objects not written to SSD (deadline or no room); they are absent after \
                 the restart"
            );
        } else if total.shutdown_demotions > 0 {
            tracing::info!(written = total.shutdown_demotions, "clean shutdown: every DRAM-only object written to SSD");
        }
    }

    /// True when puts are acknowledged only once durable on SSD.
    pub(crate) fn write_through(&self) -> bool {
        self.config.ssd.as_ref().is_some_and(|ssd| ssd.write_through)
    }

    fn validate_key(&self, key: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if key.len() > self.config.max_key_bytes {
            return Err(Error::TooLarge { what: "key", len: key.len() as u64, max: self.config.max_key_bytes as u64 });
        }
        Ok(())
    }

    fn validate_value_len(&self, len: u64) -> Result<()> {
        if len > self.max_value_bytes {
            return Err(Error::TooLarge { what: "value", len, max: self.max_value_bytes });
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A reserved, not yet visible object (`Engine::reserve_put`).
pub struct PendingPut<'e> {
    grant: WriteGrant,
    reservation: Reservation<'e>,
    opts: PutOptions,
}

impl std::fmt::Debug for PendingPut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingPut").field("len", &self.grant.len).finish()
    }
}

impl PendingPut<'_> {
    /// The value's length.
    pub fn len(&self) -> u64 {
        self.grant.len
    }

    /// True for an empty value.
    pub fn is_empty(&self) -> bool {
        self.grant.len == 0
    }

    /// The reserved bytes, to be filled before `commit`.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.grant.len == 0 {
            return &mut [];
        }
        // SAFETY: the reservation gives this guard exclusive use of `len` bytes at grant.ptr
        // until commit or abort (drop), and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.grant.ptr.as_ptr(), self.grant.len as usize) }
    }

    /// Publishes the object (readers see it from now on).
    pub fn commit(self) -> Result<()> {
        let PendingPut { reservation, opts, .. } = self;
        reservation.commit(opts)
    }
}

/// Reserved, not yet visible objects (`Engine::reserve_puts`); those not committed are aborted
/// when this drops.
pub struct PendingPuts<'e> {
    grants: Vec<Result<WriteGrant>>,
    reservations: Reservations<'e>,
    opts: PutOptions,
}

impl std::fmt::Debug for PendingPuts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingPuts").field("items", &self.grants.len()).finish()
    }
}

impl PendingPuts<'_> {
    /// Items reserved or refused.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }

    /// Item `i`'s reserved bytes, to be filled before `commit`, or why it has none.
    pub fn bytes_mut(&mut self, i: usize) -> Result<&mut [u8]> {
        let grant = match self.grants.get(i) {
            Some(Ok(g)) => g,
            Some(Err(e)) => return Err(e.clone()),
            None => return Err(Error::InvalidArgument(format!("no item {i} in this batch"))),
        };
        if grant.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the reservation gives this batch exclusive use of `len` bytes at grant.ptr
        // until commit or abort (drop); `&mut self` makes the borrow unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(grant.ptr.as_ptr(), grant.len as usize) })
    }

    /// Every item's reserved bytes at once (or why it has none), so that several threads can
    /// fill different items.
    pub fn all_bytes_mut(&mut self) -> Vec<Result<&mut [u8]>> {
        self.grants
            .iter()
            .map(|g| match g {
                Err(e) => Err(e.clone()),
                Ok(g) if g.len == 0 => Ok(&mut [][..]),
                // SAFETY: each reservation gives this batch exclusive use of its own `len` bytes
                // at its grant.ptr until commit or abort (drop); the reservations never overlap,
                // and `&mut self` keeps every other borrow out while these live.
                Ok(g) => Ok(unsafe { std::slice::from_raw_parts_mut(g.ptr.as_ptr(), g.len as usize) }),
            })
            .collect()
    }

    /// Publishes the items `filled` accepts (one request per shard) and aborts the rest. Per
    /// item: the commit's result, the reservation's error, or `Cancelled` for an item that was
    /// reserved but not filled.
    pub fn commit(self, filled: impl Fn(usize) -> bool) -> Vec<Result<()>> {
        let PendingPuts { grants, mut reservations, opts } = self;
        let mut results: Vec<Result<()>> = grants
            .into_iter()
            .enumerate()
            .map(|(i, g)| match g {
                Ok(_) if filled(i) => Err(Error::Internal("commit never answered")),
                Ok(_) => Err(Error::Cancelled),
                Err(e) => Err(e),
            })
            .collect();
        for (i, result) in reservations.commit(opts, filled) {
            results[i] = result;
        }
        results
    }
}

/// An explicit lease: the object's bytes stay in place until this drops.
pub struct ObjectLease {
    grant: ReadGrant,
    expires_at: Instant,
    holder: LeaseHolder,
    _arena: Arc<Arena>,
    /// False once `release_all` gave the lease back.
    held: bool,
}

/// Who gives an `ObjectLease` back, and how.
enum LeaseHolder {
    /// Granted by the shard: released with a message; the shard reclaims it
    /// `LEASE_EXPIRY_GRACE` after its TTL.
    Shard(Arc<crate::shard::Inbox>),
    /// Taken through the shard's published index: released with one atomic decrement; the
    /// shard never reclaims it.
    Published(Arc<PublishedIndex>, FastLease),
}

impl std::fmt::Debug for ObjectLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectLease").field("len", &self.grant.len).field("expires_at", &self.expires_at).finish()
    }
}

impl ObjectLease {
    /// The object's bytes, while the TTL has not passed (for a `lease_progressive` lease of an
    /// object still loading, once its load ended).
    pub fn bytes(&self) -> Result<&[u8]> {
        match self.bytes_when_ready(0..self.grant.len, self.expires_at)? {
            Some(bytes) => Ok(bytes),
            None => Err(Error::LeaseExpired),
        }
    }

    /// The object's bytes `range` once they are in DRAM and checked: at once for a DRAM-resident
    /// object; for one still loading from SSD (`Engine::lease_progressive`) as soon as the
    /// load's checked front passed `range.end`, waiting at most until `deadline` (then `None`).
    /// A load that fails before the range fails it (`Io`, `Corrupted`); `LeaseExpired` once
    /// the TTL passed.
    pub fn bytes_when_ready(&self, range: std::ops::Range<u64>, deadline: Instant) -> Result<Option<&[u8]>> {
        let len = range.end.saturating_sub(range.start);
        kvtide_transport::region::check_range("object", range.start, len, self.grant.len)?;
        if Instant::now() >= self.expires_at {
            return Err(Error::LeaseExpired);
        }
        let value_offset = match &self.grant.landing {
            None => 0,
            Some(landing) => {
                let deadline = deadline.min(self.expires_at);
                match landing.wait_ready(range.end, Duration::from_millis(20), || Instant::now() >= deadline) {
                    Ok(offset) => offset,
                    Err(Error::Cancelled) if Instant::now() >= self.expires_at => return Err(Error::LeaseExpired),
                    Err(Error::Cancelled) => return Ok(None),
                    Err(e) => return Err(e),
                }
            }
        };
        // SAFETY: the lease keeps these bytes in place and unchanged until it is released (drop)
        // or reclaimed by the shard, which happens only LEASE_EXPIRY_GRACE after `expires_at`
        // (a published lease is never reclaimed);
        // the arena stays mapped because we hold it. For a lease taken while its object loads,
        // the range lies in the load's checked front, which no read writes any more.
        Ok(Some(unsafe {
            std::slice::from_raw_parts(self.grant.ptr.as_ptr().add((value_offset + range.start) as usize), len as usize)
        }))
    }

    /// Object length.
    pub fn len(&self) -> u64 {
        self.grant.len
    }

    /// True for an empty object.
    pub fn is_empty(&self) -> bool {
        self.grant.len == 0
    }
}

impl ObjectLease {
    /// Gives `leases` back with one message per shard (dropping them one by one sends one each).
    pub fn release_all(leases: impl IntoIterator<Item = ObjectLease>) {
        let mut by_shard: Vec<(Arc<crate::shard::Inbox>, Vec<crate::shard::LeaseId>)> = Vec::new();
        for mut lease in leases {
            lease.held = false;
            match &lease.holder {
                LeaseHolder::Published(index, fast) => index.release(*fast),
                LeaseHolder::Shard(inbox) => match by_shard.iter_mut().find(|(i, _)| Arc::ptr_eq(i, inbox)) {
                    Some((_, ids)) => ids.push(lease.grant.lease),
                    None => by_shard.push((Arc::clone(inbox), vec![lease.grant.lease])),
                },
            }
        }
        for (inbox, leases) in by_shard {
            // A shard that is gone has dropped its leases with it.
            let _ = inbox.send(Request::Release { leases });
        }
    }
}

impl Drop for ObjectLease {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        match &self.holder {
            LeaseHolder::Shard(inbox) => {
                let _ = inbox.send(Request::Release { leases: vec![self.grant.lease] });
            }
            LeaseHolder::Published(index, fast) => index.release(*fast),
        }
    }
}
