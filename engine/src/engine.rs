//! The embedded engine: routes each key to its shard, batches one message per shard per call
//! phase, and copies bytes on the calling thread under the leases the shards grant.
//!
//! It owns the shard threads and the arena. It never touches a shard's index or allocator
//! directly, and it never reports a key as done before every one of its bytes was copied.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use kvtide_tiers::dram::{Arena, PageBacking};
use kvtide_tiers::ssd::{DataDir, SimDisk};
use kvtide_transport::{copy_regions, MemoryKind, Region};

use crate::api::{Fragment, PutOptions, Store};
use crate::checks::{self, total_len};
use crate::config::EngineConfig;
use crate::error::{Error, OpenError, Result};
use crate::shard::core::{RecoveryReport, SsdConfig};
use crate::shard::{
    spawn_shard, DiskBackend, LeaseId, ObjectRef, ReadGrant, Request, RuntimeConfig, ShardConfig, ShardCore,
    ShardThread, WriteGrant,
};
use crate::stats::{ShardCounters, Stats};
use crate::ticket::{pending, BatchCollector, Ticket};

#[cfg(feature = "cuda")]
mod gpu;
mod restore;

pub use restore::{
    MemcpyTransfer, RestoreMode, RestoreOptions, RestoreReport, SubBatchState, SubBatchTrace, ThrottledTransfer,
    TransferStage,
};

/// Seed for routing keys to shards; differs from the index hash so a shard's keys do not all
/// share low hash bits in its own table.
const ROUTING_SEED: u64 = 0x6b76_7469_6465_0001;
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
    config: EngineConfig,
    max_value_bytes: u64,
    tickets_in_flight: Arc<AtomicU64>,
    shutting_down: AtomicBool,
    recovery: Vec<RecoveryReport>,
    credits: restore::CreditBroker,
    restore: restore::RestoreCounters,
    /// Non-zero while GPU transfers are in flight: shards then poll instead of parking.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    keep_awake: Arc<std::sync::atomic::AtomicUsize>,
    #[cfg(feature = "cuda")]
    gpu: gpu::GpuState,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("shards", &self.shards.len()).field("arena", &self.arena).finish()
    }
}

impl Engine {
    pub(crate) fn open(config: EngineConfig) -> Result<Engine, OpenError> {
        let arena = Arena::new(config.dram_bytes as usize, config.shards)?;
        let slice_bytes = arena.slice_bytes() as u64;
        let mut max_value_bytes = config.max_value_bytes.unwrap_or(slice_bytes).min(slice_bytes);
        let cpus = crate::shard::allowed_cpus();
        let keep_awake = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let data_dir = match &config.ssd {
            Some(ssd) if ssd.simulated.is_none() => {
                Some(DataDir::open(&ssd.dir, ssd.bytes, config.shards, ssd.segment_bytes)?)
            }
            _ => None,
        };
        let mut recovery = Vec::with_capacity(config.shards);
        let mut starting = Vec::with_capacity(config.shards);
        let mut shards = Vec::with_capacity(config.shards);
        let mut joins = Vec::with_capacity(config.shards);
        for index in 0..config.shards {
            let slice = arena.slice(index)?;
            let shard_config = ShardConfig {
                shard: index,
                high_watermark_bytes: (slice_bytes as f64 * config.high_watermark) as u64,
                low_watermark_bytes: (slice_bytes as f64 * config.low_watermark) as u64,
                policy: config.policy,
                align_bytes: OBJECT_ALIGN_BYTES,
                // The allocator reserves its node table up front: size it for an average object
                // of 4 KiB at most, so a small pool does not pay for a million-entry table.
                max_objects: config.max_objects_per_shard.min((slice_bytes / 4096).max(1024) as u32),
                max_leases: config.max_leases_per_shard,
            };
            let counters = Arc::new(ShardCounters::default());
            let (ssd_config, disk) = match &config.ssd {
                Some(ssd) => {
                    let segments = match &data_dir {
                        Some(dir) => dir.segments_per_shard,
                        None => (ssd.bytes / config.shards as u64 / ssd.segment_bytes).max(2) as u32,
                    };
                    let disk = match (&data_dir, &ssd.simulated) {
                        (Some(dir), _) => DiskBackend::Files(dir.open_shard(index)?),
                        (None, Some((seed, faults))) => DiskBackend::Simulated(Box::new(SimDisk::new(
                            segments,
                            ssd.segment_bytes,
                            seed.wrapping_add(index as u64),
                            faults.clone(),
                        ))),
                        (None, None) => DiskBackend::None,
                    };
                    // The advertised maximum must be storable: a record fits a segment, and it
                    // fits the slice beside the tier's scratch without crossing the watermark.
                    max_value_bytes = max_value_bytes.min(crate::shard::largest_value_bytes(
                        slice_bytes,
                        shard_config.high_watermark_bytes,
                        segments,
                        ssd.segment_bytes,
                        config.max_key_bytes,
                    ));
                    let ssd_config = SsdConfig {
                        segments,
                        segment_bytes: ssd.segment_bytes,
                        write_through: ssd.write_through,
                        restore_budget_bytes: ssd.restore_budget_bytes,
                        promote_on_hit: ssd.promote_on_hit,
                        epoch_seed: random_seed(index),
                        max_pending_tombstones: crate::shard::DEFAULT_MAX_PENDING_TOMBSTONES,
                    };
                    (Some(ssd_config), disk)
                }
                None => {
                    // DRAM only: an object alone above the high watermark would be evicted at once.
                    // (Allocations round up to the object alignment.)
                    let fits = shard_config.high_watermark_bytes / OBJECT_ALIGN_BYTES * OBJECT_ALIGN_BYTES;
                    max_value_bytes = max_value_bytes.min(fits.max(1));
                    (None, DiskBackend::None)
                }
            };
            let core_slice = slice.clone();
            let core_counters = Arc::clone(&counters);
            let make_core = move || ShardCore::with_ssd(shard_config, core_slice, core_counters, ssd_config);
            let runtime = RuntimeConfig {
                ring_entries: config.ring_entries,
                idle_spin: config.idle_spin,
                demote_on_shutdown: config.demote_on_shutdown,
                shutdown_flush_timeout: config.shutdown_flush_timeout,
                keep_awake: Arc::clone(&keep_awake),
                pin_to_cpu: (config.pin_threads && !cpus.is_empty()).then(|| cpus[index % cpus.len()]),
                register_fixed_buffers: config.register_fixed_buffers,
            };
            match spawn_shard(index, make_core, counters, slice, disk, runtime) {
                Ok(started) => starting.push(started),
                Err(e) => {
                    stop_all(starting.into_iter().filter_map(|s| s.wait().ok()).map(|(t, _)| t));
                    return Err(e);
                }
            }
        }
        // Shards recover their SSD segments in parallel; wait for all of them.
        let mut failure = None;
        for started in starting {
            match started.wait() {
                Ok((mut thread, report)) => {
                    recovery.push(report);
                    if let Some(join) = thread.join.take() {
                        joins.push(join);
                    }
                    shards.push(thread);
                }
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        if let Some(e) = failure {
            for shard in &shards {
                shard.inbox.close();
            }
            for join in joins {
                let _ = join.join();
            }
            return Err(e);
        }
        tracing::info!(
            shards = config.shards,
            dram_bytes = arena.len_bytes(),
            policy = config.policy.name(),
            "kvtide engine open"
        );
        let credits = restore::CreditBroker::new(
            config.shards,
            config.restore_staging_bytes,
            config.restore_staging_bytes.min(slice_bytes / 2),
        );
        Ok(Engine {
            #[cfg(feature = "cuda")]
            gpu: gpu::GpuState::new(&config),
            shards,
            joins: Mutex::new(joins),
            arena,
            config,
            max_value_bytes,
            tickets_in_flight: Arc::new(AtomicU64::new(0)),
            shutting_down: AtomicBool::new(false),
            recovery,
            credits,
            restore: restore::RestoreCounters::default(),
            keep_awake,
        })
    }

    /// The store's restore settings as options for `restore_batch`.
    pub fn restore_options(&self) -> RestoreOptions {
        RestoreOptions {
            target_bytes: self.config.restore_sub_batch_bytes,
            max_keys: self.config.restore_sub_batch_keys,
            window: self.config.restore_window,
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

    /// The DRAM arena (for transports that register it).
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// The shard `key` lives on.
    pub fn shard_of(&self, key: &[u8]) -> usize {
        (xxhash_rust::xxh3::xxh3_64_with_seed(key, ROUTING_SEED) % self.shards.len() as u64) as usize
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
    pub fn lease(&self, key: &[u8], ttl_ms: u64) -> Result<ObjectLease> {
        self.validate_key(key)?;
        let ttl = Duration::from_millis(ttl_ms);
        let shard = self.shard_of(key);
        let rx = self.send_with_reply(shard, |reply| Request::LeaseRead {
            keys: vec![key.into()],
            ttl: Some(ttl + LEASE_EXPIRY_GRACE),
            reply,
        })?;
        let grant = self.recv_reply(&rx)?.pop().ok_or(Error::Internal("empty lease reply"))??;
        Ok(ObjectLease {
            grant,
            expires_at: Instant::now() + ttl,
            inbox: Arc::clone(&self.shards[shard].inbox),
            _arena: Arc::clone(&self.arena),
        })
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
        let (mut grants, reservations) = self.reserve_many(std::iter::once((0, key, len)), opts.upsert);
        let grant = grants.remove(&0).ok_or(Error::Internal("no reservation"))??;
        Ok(PendingPut { grant, reservations, opts })
    }

    /// Stops accepting requests, lets in-flight work finish and joins the shard threads.
    /// Later calls fail with `ShuttingDown`. Idempotent; `drop` calls it.
    pub fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        for shard in &self.shards {
            shard.inbox.close();
        }
        let joins = std::mem::take(&mut *self.joins.lock().unwrap_or_else(|p| p.into_inner()));
        for join in joins {
            if join.join().is_err() {
                tracing::error!("a shard thread panicked");
            }
        }
    }

    // ---- plumbing ---------------------------------------------------------------------------

    fn send(&self, shard: usize, request: Request) -> Result<()> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        self.shards[shard].inbox.send(request).map_err(|_| Error::ShuttingDown)
    }

    fn send_with_reply<T>(
        &self,
        shard: usize,
        make: impl FnOnce(Sender<T>) -> Request,
    ) -> Result<crossbeam_channel::Receiver<T>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(shard, make(tx))?;
        Ok(rx)
    }

    fn call<T>(&self, shard: usize, make: impl FnOnce(Sender<T>) -> Request) -> Result<T> {
        self.recv_reply(&self.send_with_reply(shard, make)?)
    }

    /// Waits for a shard's reply: polls for `reply_spin` first (the shard usually answers within
    /// microseconds, and a blocked caller pays a wake-up), then blocks.
    fn recv_reply<T>(&self, rx: &crossbeam_channel::Receiver<T>) -> Result<T> {
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

    /// The fragments of a `get_into_ranges` call that pass their checks (`check_buffer(b,
    /// buffer)`, the destination range, the key), as (buffer, fragment, key index) with the
    /// unique keys they name; the others get their error in `results`.
    fn group_fragments<'f>(
        &self,
        buffers: &[Region<'_>],
        fragments: &'f [Vec<Fragment>],
        results: &mut [Vec<Result<usize>>],
        check_buffer: impl Fn(usize, &Region<'_>) -> Result<()>,
    ) -> (Vec<&'f [u8]>, Vec<FragmentRef>) {
        let passed = checks::checked_fragments(buffers, fragments, results, check_buffer, |key| self.validate_key(key));
        let mut key_index: HashMap<&[u8], usize> = HashMap::new();
        let mut keys: Vec<&[u8]> = Vec::new();
        let mut todo = Vec::with_capacity(passed.len());
        for (b, f) in passed {
            let key = fragments[b][f].key.as_slice();
            let k = *key_index.entry(key).or_insert_with(|| {
                keys.push(key);
                keys.len() - 1
            });
            todo.push((b, f, k));
        }
        (keys, todo)
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

    /// Leases `keys` (already validated; indices into the caller's arrays), one message per shard.
    fn lease_many<'k>(
        &self,
        keys: impl Iterator<Item = (usize, &'k [u8])>,
    ) -> (HashMap<usize, Result<ReadGrant>>, LeaseSet<'_>) {
        self.send_leases(keys).wait()
    }

    /// Sends the lease requests for `keys` (one message per shard) without waiting for them.
    fn send_leases<'k>(&self, keys: impl Iterator<Item = (usize, &'k [u8])>) -> PendingLeases<'_> {
        let mut per_shard: Vec<Vec<usize>> = vec![Vec::new(); self.shards.len()];
        let mut owned: Vec<Vec<Box<[u8]>>> = vec![Vec::new(); self.shards.len()];
        for (index, key) in keys {
            let shard = self.shard_of(key);
            per_shard[shard].push(index);
            owned[shard].push(Box::from(key));
        }
        let replies = owned
            .into_iter()
            .enumerate()
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(shard, keys)| {
                (shard, self.send_with_reply(shard, |reply| Request::LeaseRead { keys, ttl: None, reply }))
            })
            .collect();
        PendingLeases { engine: self, per_shard, replies }
    }

    /// Leases `keys` and hands each grant (or error) to `deliver`, which copies while the lease
    /// is held. A batch larger than DRAM can hold at once (its SSD-resident keys are loaded into
    /// DRAM to be read) gets `NoSpace` for some keys; those are retried in another round once the
    /// previous round's leases are released, as long as every round delivers at least one key.
    fn lease_in_rounds(&self, keys: Vec<(usize, &[u8])>, mut deliver: impl FnMut(usize, Result<ReadGrant>)) {
        let mut remaining = keys;
        while !remaining.is_empty() {
            let (grants, leases) = self.lease_many(remaining.iter().copied());
            let mut retry = Vec::new();
            let mut delivered = 0;
            for &(index, key) in &remaining {
                match grants.get(&index) {
                    Some(Err(Error::NoSpace)) => retry.push((index, key)),
                    Some(grant) => {
                        deliver(index, grant.clone());
                        delivered += 1;
                    }
                    None => deliver(index, Err(Error::Internal("key was not leased"))),
                }
            }
            drop(leases);
            if delivered == 0 {
                retry.into_iter().for_each(|(index, _)| deliver(index, Err(Error::NoSpace)));
                return;
            }
            remaining = retry;
        }
    }

    /// Reserves room for `items` (index, key, len), one message per shard.
    fn reserve_many<'k>(
        &self,
        items: impl Iterator<Item = (usize, &'k [u8], u64)>,
        upsert: bool,
    ) -> (HashMap<usize, Result<WriteGrant>>, Reservations<'_>) {
        self.reserve_many_overlapped(items, upsert, || {})
    }

    /// `reserve_many`, running `while_waiting` after the requests went out and before the
    /// replies are awaited.
    fn reserve_many_overlapped<'k>(
        &self,
        items: impl Iterator<Item = (usize, &'k [u8], u64)>,
        upsert: bool,
        while_waiting: impl FnOnce(),
    ) -> (HashMap<usize, Result<WriteGrant>>, Reservations<'_>) {
        let mut per_shard: Vec<Vec<(usize, &[u8], u64)>> = vec![Vec::new(); self.shards.len()];
        for (index, key, len) in items {
            per_shard[self.shard_of(key)].push((index, key, len));
        }
        let mut reservations = Reservations { engine: self, by_shard: vec![Vec::new(); self.shards.len()] };
        let mut out = HashMap::new();
        let pending: Vec<_> = per_shard
            .iter()
            .enumerate()
            .filter(|(_, items)| !items.is_empty())
            .map(|(shard, items)| {
                let owned = items.iter().map(|(_, k, len)| (Box::<[u8]>::from(*k), *len)).collect();
                (shard, self.send_with_reply(shard, |reply| Request::Reserve { items: owned, upsert, reply }))
            })
            .collect();
        while_waiting();
        for (shard, rx) in pending {
            match rx.and_then(|rx| self.recv_reply(&rx)) {
                Ok(grants) => {
                    for (&(index, _, _), grant) in per_shard[shard].iter().zip(grants) {
                        if let Ok(g) = &grant {
                            reservations.by_shard[shard].push((index, g.object));
                        }
                        out.insert(index, grant);
                    }
                }
                Err(e) => per_shard[shard].iter().for_each(|&(index, _, _)| {
                    out.insert(index, Err(e.clone()));
                }),
            }
        }
        (out, reservations)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Read leases taken by one call; released (one message per shard) when dropped, on every path.
struct LeaseSet<'e> {
    engine: &'e Engine,
    by_shard: Vec<Vec<LeaseId>>,
}

impl Drop for LeaseSet<'_> {
    fn drop(&mut self) {
        for (shard, leases) in self.by_shard.iter_mut().enumerate() {
            if !leases.is_empty() {
                // A shard that is gone has dropped its leases with it.
                let _ = self.engine.shards[shard].inbox.send(Request::Release { leases: std::mem::take(leases) });
            }
        }
    }
}

/// A checked fragment of `get_into_ranges`: (buffer, fragment, index of its key).
type FragmentRef = (usize, usize, usize);

/// Where one shard's answer to a lease request arrives.
type GrantReceiver = crossbeam_channel::Receiver<Vec<Result<ReadGrant>>>;

/// Lease requests sent and not yet answered.
struct PendingLeases<'e> {
    engine: &'e Engine,
    /// Caller indices of the keys sent to each shard, in order.
    per_shard: Vec<Vec<usize>>,
    replies: Vec<(usize, Result<GrantReceiver>)>,
}

impl<'e> PendingLeases<'e> {
    /// Waits for every shard's grants. The returned set releases them when dropped.
    fn wait(self) -> (HashMap<usize, Result<ReadGrant>>, LeaseSet<'e>) {
        let mut leases = LeaseSet { engine: self.engine, by_shard: vec![Vec::new(); self.engine.shards.len()] };
        let mut out = HashMap::new();
        for (shard, rx) in self.replies {
            match rx.and_then(|rx| self.engine.recv_reply(&rx)) {
                Ok(grants) => {
                    for (&index, grant) in self.per_shard[shard].iter().zip(grants) {
                        if let Ok(g) = &grant {
                            leases.by_shard[shard].push(g.lease);
                        }
                        out.insert(index, grant);
                    }
                }
                Err(e) => self.per_shard[shard].iter().for_each(|&index| {
                    out.insert(index, Err(e.clone()));
                }),
            }
        }
        (out, leases)
    }
}

/// Reservations taken by one call; those not committed are aborted when dropped.
struct Reservations<'e> {
    engine: &'e Engine,
    by_shard: Vec<Vec<(usize, ObjectRef)>>,
}

impl Reservations<'_> {
    /// Commits the reservations whose index `keep` accepts; the rest are aborted on drop.
    fn commit(mut self, opts: PutOptions, keep: impl Fn(usize) -> bool) -> HashMap<usize, Result<()>> {
        let (upsert, pin) = (opts.upsert, opts.pin);
        let mut out = HashMap::new();
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

/// A reserved, not yet visible object (`Engine::reserve_put`).
pub struct PendingPut<'e> {
    grant: WriteGrant,
    reservations: Reservations<'e>,
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
        let PendingPut { reservations, opts, .. } = self;
        reservations.commit(opts, |_| true).remove(&0).unwrap_or(Err(Error::Internal("no commit result")))
    }
}

/// An explicit lease: the object's bytes stay in place until this drops.
pub struct ObjectLease {
    grant: ReadGrant,
    expires_at: Instant,
    inbox: Arc<crate::shard::Inbox>,
    _arena: Arc<Arena>,
}

impl std::fmt::Debug for ObjectLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectLease").field("len", &self.grant.len).field("expires_at", &self.expires_at).finish()
    }
}

impl ObjectLease {
    /// The object's bytes, while the TTL has not passed.
    pub fn bytes(&self) -> Result<&[u8]> {
        if Instant::now() >= self.expires_at {
            return Err(Error::LeaseExpired);
        }
        // SAFETY: the lease keeps these bytes in place and unchanged until it is released (drop)
        // or reclaimed by the shard, which happens only LEASE_EXPIRY_GRACE after `expires_at`;
        // the arena stays mapped because we hold it.
        Ok(unsafe { std::slice::from_raw_parts(self.grant.ptr.as_ptr(), self.grant.len as usize) })
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

impl Drop for ObjectLease {
    fn drop(&mut self) {
        let _ = self.inbox.send(Request::Release { leases: vec![self.grant.lease] });
    }
}

/// Stops shards that started while another failed to.
fn stop_all(shards: impl Iterator<Item = ShardThread>) {
    for mut shard in shards {
        shard.stop();
    }
}

/// A seed that differs per shard and per process start (segment epochs must never repeat).
fn random_seed(shard: usize) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into the buffer we pass; failure leaves zeroes,
    // and the time and pid below still make the seed unique per start.
    unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    u64::from_le_bytes(bytes) ^ nanos ^ (u64::from(std::process::id()) << 32) ^ (shard as u64).wrapping_mul(0x9E37_79B9)
}

/// Checks that a destination can receive bytes on this path (host memory, writable).
// With the feature, the blocking calls and async tickets check device regions on the GPU path
// before reaching these.
fn check_destination(dst: &Region<'_>) -> Result<()> {
    checks::host_destination(dst, "device destinations need the cuda feature")
}

fn check_source(src: &Region<'_>) -> Result<()> {
    checks::host_source(src, "device sources need the cuda feature")
}

fn grant_region(ptr: std::ptr::NonNull<u8>, len: u64) -> Region<'static> {
    // SAFETY: callers only build this from a live grant, whose lease or reservation keeps the
    // bytes valid for as long as the region is used (within the same call).
    unsafe { Region::from_raw(ptr.as_ptr() as u64, len as usize, MemoryKind::Host) }
}

/// Copies a leased object across `dsts` in order (their lengths add up to `grant.len`).
fn scatter(grant: &ReadGrant, dsts: &[Region<'_>]) -> Result<()> {
    let src = grant_region(grant.ptr, grant.len);
    let mut offset = 0u64;
    for dst in dsts {
        // SAFETY: `src` is leased for this call; `dst` is caller memory borrowed for the call.
        unsafe { copy_regions(&src, offset, dst, 0, dst.len() as u64)? };
        offset += dst.len() as u64;
    }
    Ok(())
}

impl Store for Engine {
    type Error = Error;
    fn batch_put_from_multi_buffers(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
    ) -> Vec<Result<()>> {
        let _span = tracing::trace_span!("batch_put", keys = keys.len()).entered();
        if let Err(e) = checks::one_list_per_key(keys.len(), sources.len(), "source") {
            return vec![Err(e); keys.len()];
        }
        #[cfg(feature = "cuda")]
        if gpu::any_device(sources.iter().flatten()) {
            return gpu::batch_put(self, keys, sources, opts);
        }
        let mut results: Vec<Result<()>> = vec![Ok(()); keys.len()];
        let mut items = Vec::with_capacity(keys.len());
        for (i, (key, srcs)) in keys.iter().zip(sources).enumerate() {
            let checked = self
                .validate_key(key)
                .and_then(|()| srcs.iter().try_for_each(check_source))
                .and_then(|()| total_len(srcs))
                .and_then(|len| self.validate_value_len(len).map(|()| len));
            match checked {
                Ok(len) => items.push((i, *key, len)),
                Err(e) => results[i] = Err(e),
            }
        }
        let (grants, reservations) = self.reserve_many(items.into_iter(), opts.upsert);
        let mut copied = vec![false; keys.len()];
        for (&i, grant) in &grants {
            match grant {
                Ok(grant) => {
                    let dst = grant_region(grant.ptr, grant.len);
                    let mut offset = 0u64;
                    let copy = sources[i].iter().try_for_each(|src| {
                        // SAFETY: `dst` is our reservation (exclusive until commit); `src` is
                        // caller memory borrowed for this call. Lengths add up to grant.len.
                        unsafe { copy_regions(src, 0, &dst, offset, src.len() as u64)? };
                        offset += src.len() as u64;
                        Ok::<(), Error>(())
                    });
                    match copy {
                        Ok(()) => copied[i] = true,
                        Err(e) => results[i] = Err(e),
                    }
                }
                Err(e) => results[i] = Err(e.clone()),
            }
        }
        for (i, result) in reservations.commit(opts, |i| copied[i]) {
            results[i] = result;
        }
        results
    }

    fn get(&self, key: &[u8]) -> Result<Vec<u8>> {
        let _span = tracing::trace_span!("get").entered();
        self.validate_key(key)?;
        let (mut grants, _leases) = self.lease_many(std::iter::once((0, key)));
        let grant = grants.remove(&0).ok_or(Error::Internal("no grant"))??;
        let len = grant.len as usize;
        let mut out = Vec::with_capacity(len);
        // SAFETY: the lease keeps `len` bytes at grant.ptr valid; `out` has capacity `len` and
        // they do not overlap; set_len follows a copy of exactly `len` initialised bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(grant.ptr.as_ptr(), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        Ok(out)
    }

    fn get_into(&self, key: &[u8], dst: Region<'_>) -> Result<usize> {
        let _span = tracing::trace_span!("get_into").entered();
        #[cfg(feature = "cuda")]
        if gpu::any_device(std::iter::once(&dst)) {
            return gpu::get_into(self, key, dst);
        }
        self.validate_key(key)?;
        check_destination(&dst)?;
        let (mut grants, _leases) = self.lease_many(std::iter::once((0, key)));
        let grant = grants.remove(&0).ok_or(Error::Internal("no grant"))??;
        if (dst.len() as u64) < grant.len {
            return Err(Error::BufferTooSmall { object_bytes: grant.len, buffer_bytes: dst.len() as u64 });
        }
        scatter(&grant, &[dst.slice(0, grant.len)?])?;
        Ok(grant.len as usize)
    }

    fn batch_get_into_multi_buffers(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>]) -> Vec<Result<usize>> {
        let _span = tracing::trace_span!("batch_get", keys = keys.len()).entered();
        if let Err(e) = checks::one_list_per_key(keys.len(), dsts.len(), "destination") {
            return vec![Err(e); keys.len()];
        }
        let pipelined = self.config.ssd.is_some() && self.config.restore_pipeline && keys.len() > 1;
        #[cfg(feature = "cuda")]
        if !pipelined && gpu::any_device(dsts.iter().flatten()) {
            return gpu::batch_get(self, keys, dsts);
        }
        if pipelined {
            // Batches that may touch the SSD are restored in pipelined sub-batches.
            return self.restore_batch(keys, dsts, &self.restore_options()).results;
        }
        let mut results: Vec<Result<usize>> = (0..keys.len()).map(|_| pending()).collect();
        let mut valid = Vec::with_capacity(keys.len());
        for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
            let checked = self.validate_key(key).and_then(|()| regions.iter().try_for_each(check_destination));
            match checked.and_then(|()| total_len(regions)) {
                Ok(_) => valid.push((i, *key)),
                Err(e) => results[i] = Err(e),
            }
        }
        self.lease_in_rounds(valid, |i, grant| {
            results[i] = grant.and_then(|grant| {
                let dst_bytes = total_len(&dsts[i])?;
                if dst_bytes != grant.len {
                    return Err(Error::SizeMismatch { object_bytes: grant.len, destination_bytes: dst_bytes });
                }
                scatter(&grant, &dsts[i]).map(|()| grant.len as usize)
            });
        });
        results
    }

    fn get_into_ranges(&self, buffers: &[Region<'_>], fragments: &[Vec<Fragment>]) -> Vec<Vec<Result<usize>>> {
        let _span = tracing::trace_span!("get_into_ranges", buffers = buffers.len()).entered();
        #[cfg(feature = "cuda")]
        if gpu::any_device(buffers.iter()) {
            return gpu::get_into_ranges(self, buffers, fragments);
        }
        let mut results: Vec<Vec<Result<usize>>> =
            fragments.iter().map(|f| (0..f.len()).map(|_| pending()).collect()).collect();
        // Unique keys of the valid fragments, leased once each.
        let (keys, todo) =
            self.group_fragments(buffers, fragments, &mut results, |_, buffer| check_destination(buffer));
        let mut by_key: Vec<Vec<(usize, usize)>> = vec![Vec::new(); keys.len()];
        for (b, f, k) in todo {
            by_key[k].push((b, f));
        }
        self.lease_in_rounds(keys.iter().copied().enumerate().collect(), |k, grant| {
            for &(b, f) in &by_key[k] {
                let frag = &fragments[b][f];
                results[b][f] = match &grant {
                    Ok(grant) => {
                        let src = grant_region(grant.ptr, grant.len);
                        let copy = || -> Result<usize> {
                            kvtide_transport::region::check_range("object", frag.src_offset, frag.len, grant.len)?;
                            // SAFETY: the object is leased for this call; the destination range
                            // was checked against its buffer, which the caller lends for the call.
                            unsafe { copy_regions(&src, frag.src_offset, &buffers[b], frag.dst_offset, frag.len)? };
                            Ok(frag.len as usize)
                        };
                        copy()
                    }
                    Err(e) => Err(e.clone()),
                };
            }
        });
        results
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool>> {
        let _span = tracing::trace_span!("batch_exists", keys = keys.len()).entered();
        let mut results: Vec<Result<bool>> = vec![Ok(false); keys.len()];
        let mut per_shard: Vec<Vec<usize>> = vec![Vec::new(); self.shards.len()];
        for (i, key) in keys.iter().enumerate() {
            match self.validate_key(key) {
                Ok(()) => per_shard[self.shard_of(key)].push(i),
                Err(e) => results[i] = Err(e),
            }
        }
        let pending: Vec<_> = per_shard
            .iter()
            .enumerate()
            .filter(|(_, idx)| !idx.is_empty())
            .map(|(shard, idx)| {
                let owned = idx.iter().map(|&i| Box::<[u8]>::from(keys[i])).collect();
                (shard, self.send_with_reply(shard, |reply| Request::Exists { keys: owned, reply }))
            })
            .collect();
        for (shard, rx) in pending {
            match rx.and_then(|rx| self.recv_reply(&rx)) {
                Ok(found) => per_shard[shard].iter().zip(found).for_each(|(&i, f)| results[i] = Ok(f)),
                Err(e) => per_shard[shard].iter().for_each(|&i| results[i] = Err(e.clone())),
            }
        }
        results
    }

    fn remove(&self, key: &[u8], force: bool) -> Result<()> {
        self.validate_key(key)?;
        self.call(self.shard_of(key), |reply| Request::Remove { key: key.into(), force, reply })?
    }

    fn pin(&self, key: &[u8]) -> Result<()> {
        self.validate_key(key)?;
        self.call(self.shard_of(key), |reply| Request::Pin { key: key.into(), reply })?
    }

    fn unpin(&self, key: &[u8]) -> Result<()> {
        self.validate_key(key)?;
        self.call(self.shard_of(key), |reply| Request::Unpin { key: key.into(), reply })?
    }

    fn stats(&self) -> Stats {
        let mut stats = Stats::from_shards(self.shards.iter().map(|s| s.counters.snapshot()).collect());
        stats.arena_backing = match self.arena.backing() {
            PageBacking::HugeTlb => "hugetlb".into(),
            PageBacking::TransparentHugeAdvised => "thp-advised".into(),
        };
        stats.arena_registered_with = self.arena.registered_with().into_iter().map(String::from).collect();
        stats.tickets_in_flight = self.tickets_in_flight.load(Ordering::Relaxed);
        stats.restore = crate::stats::RestoreStats {
            requests: self.restore.requests.load(Ordering::Relaxed),
            sub_batches: self.restore.sub_batches.load(Ordering::Relaxed),
            credit_waits: self.restore.credit_waits.load(Ordering::Relaxed),
            credits_held_bytes: self.credits.held_bytes(),
            peak_credits_bytes: self.credits.peak_bytes(),
            peak_request_staging_bytes: self.restore.peak_staging_bytes.load(Ordering::Relaxed),
        };
        #[cfg(feature = "cuda")]
        {
            stats.gpu = self.gpu.stats();
        }
        stats
    }

    fn submit_batch_get(&self, keys: &[&[u8]], dsts: Vec<Vec<Region<'static>>>) -> Result<Ticket<Vec<Result<usize>>>> {
        checks::one_list_per_key(keys.len(), dsts.len(), "destination")?;
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        let limit = self.config.max_tickets_in_flight;
        if self.tickets_in_flight.load(Ordering::Relaxed) >= limit as u64 {
            return Err(Error::Busy { limit });
        }
        let mut results: Vec<Result<usize>> = (0..keys.len()).map(|_| pending()).collect();
        let mut per_shard: Vec<Vec<crate::shard::task::BatchGetItem>> =
            (0..self.shards.len()).map(|_| Vec::new()).collect();
        // Device destinations: every region is checked now, before anything is submitted; the
        // shard tasks then copy through the CUDA transport (see `gpu::ticket_checks`).
        #[cfg(feature = "cuda")]
        let (mut device_checks, gpu_copier) =
            if gpu::any_device(dsts.iter().flatten()) { gpu::ticket_checks(self, &dsts) } else { (Vec::new(), None) };
        for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
            #[cfg(feature = "cuda")]
            let device_check = device_checks.get_mut(i).map(Option::take);
            #[cfg(not(feature = "cuda"))]
            let device_check: Option<Option<Error>> = None;
            let checked = self
                .validate_key(key)
                .and_then(|()| match device_check {
                    Some(checked) => checked.map_or(Ok(()), Err),
                    None => regions.iter().try_for_each(check_destination),
                })
                .and_then(|()| total_len(&regions));
            match checked {
                Ok(_) => per_shard[self.shard_of(key)].push(crate::shard::task::BatchGetItem {
                    result_index: i,
                    key: (*key).into(),
                    dsts: regions,
                }),
                Err(e) => results[i] = Err(e),
            }
        }
        let parts = per_shard.iter().filter(|items| !items.is_empty()).count();
        let (ticket, cell, cancel) = Ticket::new();
        let collector = BatchCollector::new(results, parts, cell, Arc::clone(&self.tickets_in_flight));
        for (shard, items) in per_shard.into_iter().enumerate().filter(|(_, items)| !items.is_empty()) {
            let indices: Vec<usize> = items.iter().map(|item| item.result_index).collect();
            let task = crate::shard::task::BatchGetTask::new(items, Arc::clone(&cancel), Arc::clone(&collector));
            #[cfg(feature = "cuda")]
            let task = task.with_gpu(gpu_copier.clone());
            if self.send(shard, Request::Task(Box::new(task))).is_err() {
                collector.complete_part(indices.into_iter().map(|i| (i, Err(Error::ShuttingDown))).collect());
            }
        }
        Ok(ticket)
    }
}
