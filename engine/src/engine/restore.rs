//! Pipelined restore of SSD-resident batches.
//!
//! Owns planning (whole-object sub-batches per shard, by bytes and count), the two stages (the
//! shards load the next sub-batches from SSD into DRAM while the calling thread transfers the
//! oldest loaded one, or else the first to land, to its destinations), admission (two
//! sub-batches per shard ahead of the transfers, deepened whenever the transfer stage waits for
//! loads longer than a transfer takes, up to `ahead_bytes` per shard: room for the disk queue one
//! whole-batch request gets), the credit broker that bounds staging per shard and process-wide,
//! and the per-sub-batch lifecycle trace. It never reports a key whose bytes were not all
//! delivered, and never returns credits or leases before nothing can touch them.
//!
//! Every destination is checked up front by the transport of its route; a sub-batch is then
//! delivered by the read path (one submission per route, waited for before its leases go).
//! DRAM-resident GPU keys skip the pipeline and take the plain read path with its early start,
//! while the SSD sub-batches load.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtide_transport::{Region, Transport};

use super::read::{check_fits, KeyRead, ReadTargets, Want};
use super::router::ByIndex;
use super::transports::Route;
use super::{Engine, LeaseSet, PendingLeases};
use crate::checks::total_len;
use crate::error::{Error, Result};
use crate::shard::{Location, ReadGrant, Request};
use crate::stats::RestoreStats;

/// One part of a batch that a caller leases itself (`Engine::lease_parts`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeasePart {
    /// Indices into the caller's keys.
    pub keys: Vec<usize>,
    /// The part of DRAM-resident (and missing) keys: nothing to load, but leasing it pins
    /// DRAM that the loads of later parts may need.
    pub in_dram: bool,
    /// The shard whose SSD-resident keys these are (0 for the DRAM-resident part).
    pub shard: usize,
}

/// `Engine::lease_parts`' answer: the parts, and the keys refused without a load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeasePlan {
    pub parts: Vec<LeasePart>,
    /// (index, error) of each SSD-resident key the caller's `misfit` refused.
    pub refused: Vec<(usize, Error)>,
}

/// How a batch that touches the SSD is restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreMode {
    /// Load the next sub-batches (up to `RestoreOptions::ahead_bytes` per shard) while
    /// transferring loaded ones: the oldest whose loads are done, else the first to land.
    Pipelined,
    /// Sub-batches one after another: load, transfer, load, transfer.
    Serialized,
    /// Load everything, then transfer everything (the unpipelined baseline).
    Barrier,
}

/// What a restore does and how it reports.
#[derive(Clone)]
pub struct RestoreOptions {
    pub mode: RestoreMode,
    /// Smallest target bytes per sub-batch (whole objects; a larger object is a sub-batch of its
    /// own). A shard with more than `MAX_SUB_BATCHES_PER_SHARD` of these gets larger ones.
    pub target_bytes: u64,
    /// Smallest keys-per-sub-batch limit (grown like the bytes, see `target_bytes`).
    pub max_keys: usize,
    /// Pipelined: bytes of sub-batches per shard this request may keep requested ahead of its
    /// transfers (loading or loaded, not yet transferred); at least one sub-batch. The request
    /// starts two sub-batches deep and deepens while its loads lag its transfers. Staging
    /// credits bound it further. Default 128 MiB: twice the shard's loads in flight
    /// (`restore_budget_bytes`), so loaded sub-batches waiting for their turn at the transfer
    /// stage never shrink a disk-bound request's queue below the barrier's.
    pub ahead_bytes: u64,
    /// Set to stop: no new loads; in-flight ones drain; undelivered keys report `Cancelled`.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Record per-sub-batch timestamps in the report.
    pub trace: bool,
    /// The transport for host destinations (None: CPU copies). Benchmarks pace it
    /// (`kvtide_transport::Throttled`) to model a link.
    pub host_transport: Option<Arc<dyn Transport>>,
}

impl std::fmt::Debug for RestoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreOptions")
            .field("mode", &self.mode)
            .field("target_bytes", &self.target_bytes)
            .field("max_keys", &self.max_keys)
            .field("ahead_bytes", &self.ahead_bytes)
            .finish()
    }
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            mode: RestoreMode::Pipelined,
            target_bytes: 2 << 20,
            max_keys: 64,
            ahead_bytes: 128 << 20,
            cancel: None,
            trace: false,
            host_transport: None,
        }
    }
}

/// Where a sub-batch is in its life: `Loading -> Ready -> Transferring -> Verifying ->
/// Released`, or, when a key's load or copy failed, `... -> Failed -> Released`, or, when the
/// request was cancelled, `... -> Draining -> Released` (its loads end and nothing is copied
/// before its leases and credits go back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubBatchState {
    Loading,
    /// Loaded, waiting for the transfer stage.
    Ready,
    Transferring,
    Verifying,
    /// Some key's load or copy failed (its error is in the key's result).
    Failed,
    /// Cancelled: waits for its loads, copies nothing, then releases.
    Draining,
    Released,
}

/// One sub-batch's timeline, in microseconds since the request started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubBatchTrace {
    pub index: usize,
    pub shard: usize,
    pub keys: usize,
    pub staging_bytes: u64,
    pub load_start_us: u64,
    /// When the pipeline saw its loads done (checked at each step of the pipeline, so at most
    /// one transfer late); `transfer_start_us - ready_us` is its time in `Ready`.
    pub ready_us: u64,
    pub transfer_start_us: u64,
    pub transfer_end_us: u64,
    pub release_us: u64,
    /// The state it is in (`Released` in a report).
    pub state: SubBatchState,
    /// Every state it entered, with when.
    pub path: Vec<(SubBatchState, u64)>,
    /// Keys whose load or copy failed.
    pub failed_keys: usize,
}

impl SubBatchTrace {
    fn enter(&mut self, state: SubBatchState, at_us: u64) {
        self.state = state;
        self.path.push((state, at_us));
    }

    /// Microseconds it spent loaded before its transfer (or drain) began.
    pub fn ready_wait_us(&self) -> u64 {
        self.transfer_start_us.saturating_sub(self.ready_us)
    }

    /// One JSON object on one line.
    pub fn to_json_line(&self) -> String {
        let path: Vec<String> = self.path.iter().map(|(s, t)| format!("[\"{s:?}\",{t}]")).collect();
        format!(
            "{{\"index\":{},\"shard\":{},\"keys\":{},\"staging_bytes\":{},\"load_start_us\":{},\"ready_us\":{},\"transfer_start_us\":{},\"transfer_end_us\":{},\"release_us\":{},\"state\":\"{:?}\",\"failed_keys\":{},\"path\":[{}]}}",
            self.index,
            self.shard,
            self.keys,
            self.staging_bytes,
            self.load_start_us,
            self.ready_us,
            self.transfer_start_us,
            self.transfer_end_us,
            self.release_us,
            self.state,
            self.failed_keys,
            path.join(",")
        )
    }
}

/// What a restore did.
#[derive(Debug, Default)]
pub struct RestoreReport {
    /// One result per key, in request order.
    pub results: Vec<Result<usize>>,
    pub sub_batches: Vec<SubBatchTrace>,
    /// Most staging bytes this request held at once.
    pub peak_staging_bytes: u64,
    /// Times this request waited for credits.
    pub credit_waits: u64,
    pub elapsed_us: u64,
    /// The request was cancelled before every sub-batch was transferred.
    pub cancelled: bool,
}

/// Engine-wide restore counters (stats).
#[derive(Debug, Default)]
pub(crate) struct RestoreCounters {
    pub(crate) requests: AtomicU64,
    pub(crate) sub_batches: AtomicU64,
    pub(crate) credit_waits: AtomicU64,
    pub(crate) peak_staging_bytes: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) failed_sub_batches: AtomicU64,
    pub(crate) drained_sub_batches: AtomicU64,
    pub(crate) ready_wait_us: AtomicU64,
}

/// Staging credits: process-wide and per shard, granted in arrival order (FIFO tickets), so a
/// small restore is never starved behind a large one: each request asks for one sub-batch at a
/// time and queues behind at most the sub-batches already waiting.
pub(crate) struct CreditBroker {
    state: Mutex<BrokerState>,
    changed: Condvar,
    global_limit: u64,
    shard_limit: u64,
}

struct BrokerState {
    global_used: u64,
    shard_used: Vec<u64>,
    next_ticket: u64,
    serving: u64,
    abandoned: HashSet<u64>,
    peak_used: u64,
}

/// Credits held by one sub-batch; returned on drop.
pub(crate) struct Credits<'b> {
    broker: &'b CreditBroker,
    shard: usize,
    bytes: u64,
}

impl Drop for Credits<'_> {
    fn drop(&mut self) {
        self.broker.release(self.shard, self.bytes);
    }
}

impl CreditBroker {
    pub(crate) fn new(shards: usize, global_limit: u64, shard_limit: u64) -> CreditBroker {
        CreditBroker {
            state: Mutex::new(BrokerState {
                global_used: 0,
                shard_used: vec![0; shards],
                next_ticket: 0,
                serving: 0,
                abandoned: HashSet::new(),
                peak_used: 0,
            }),
            changed: Condvar::new(),
            global_limit: global_limit.max(1),
            shard_limit: shard_limit.max(1),
        }
    }

    /// Bytes a request of `bytes` is charged: at most the whole budget, so an object larger than
    /// the budget still runs, alone, once everything else drained.
    fn charge(&self, bytes: u64) -> u64 {
        bytes.min(self.global_limit).min(self.shard_limit)
    }

    /// Takes credits only if nobody is queued and they are free now.
    fn try_acquire(&self, shard: usize, bytes: u64) -> Option<Credits<'_>> {
        let bytes = self.charge(bytes);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let fits = st.global_used + bytes <= self.global_limit && st.shard_used[shard] + bytes <= self.shard_limit;
        if st.next_ticket != st.serving || !fits {
            return None;
        }
        st.take(shard, bytes);
        Some(Credits { broker: self, shard, bytes })
    }

    /// Waits in line for credits. None when `cancel` was set while waiting.
    fn acquire(&self, shard: usize, bytes: u64, cancel: Option<&AtomicBool>) -> Option<Credits<'_>> {
        let bytes = self.charge(bytes);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        loop {
            st.skip_abandoned();
            let fits = st.global_used + bytes <= self.global_limit && st.shard_used[shard] + bytes <= self.shard_limit;
            if st.serving == ticket && fits {
                st.take(shard, bytes);
                st.serving += 1;
                st.skip_abandoned();
                self.changed.notify_all();
                return Some(Credits { broker: self, shard, bytes });
            }
            if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
                st.abandoned.insert(ticket);
                st.skip_abandoned();
                self.changed.notify_all();
                return None;
            }
            st = self.changed.wait_timeout(st, Duration::from_millis(5)).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn release(&self, shard: usize, bytes: u64) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.global_used -= bytes;
        st.shard_used[shard] -= bytes;
        self.changed.notify_all();
    }

    /// Bytes held now (stats; zero when no restore runs).
    pub(crate) fn held_bytes(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).global_used
    }

    pub(crate) fn peak_bytes(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).peak_used
    }
}

impl BrokerState {
    fn take(&mut self, shard: usize, bytes: u64) {
        self.global_used += bytes;
        self.shard_used[shard] += bytes;
        self.peak_used = self.peak_used.max(self.global_used);
    }

    fn skip_abandoned(&mut self) {
        while self.abandoned.remove(&self.serving) {
            self.serving += 1;
        }
    }
}

/// A planned sub-batch: whole objects of one shard (or the DRAM-resident keys of the batch).
struct SubBatchPlan {
    shard: usize,
    keys: Vec<usize>,
    staging_bytes: u64,
    /// The DRAM-resident keys (and missing ones): nothing to load.
    dram: bool,
}

/// A sub-batch whose loads were requested.
struct LoadingSubBatch<'e> {
    trace: SubBatchTrace,
    keys: Vec<usize>,
    pending: PendingLeases<'e>,
    credits: Option<Credits<'e>>,
}

/// A sub-batch whose loads are done: its grants, the leases they hold and its credits.
struct Landed<'e> {
    trace: SubBatchTrace,
    keys: Vec<usize>,
    grants: ByIndex<Result<ReadGrant>>,
    leases: LeaseSet<'e>,
    credits: Option<Credits<'e>>,
}

impl<'e> LoadingSubBatch<'e> {
    /// Waits for its loads.
    fn land(self) -> Landed<'e> {
        let (grants, leases) = self.pending.wait();
        Landed { trace: self.trace, keys: self.keys, grants, leases, credits: self.credits }
    }
}

/// One restore's pipeline between its load and transfer stages.
struct RestorePipeline<'e> {
    started: Instant,
    queue: VecDeque<SubBatchPlan>,
    inflight: VecDeque<LoadingSubBatch<'e>>,
    /// Keys that did not fit in DRAM beside their sub-batch: read alone after the pipeline.
    retry_alone: Vec<usize>,
    /// This request's sub-batches requested and not yet transferred, per shard: bytes and
    /// count. The count may reach `depth`: two at first (one loading, one being transferred:
    /// the first transfer starts as early as it can), deepened after each transfer that had
    /// to wait for its loads (`deepen`), so a disk-bound restore soon keeps `ahead_bytes`
    /// requested while a transfer-bound one stays shallow.
    ahead: Vec<(u64, usize)>,
    depth: usize,
    transferred_any: bool,
    next_index: usize,
}

impl<'e> RestorePipeline<'e> {
    fn new(started: Instant, shards: usize, plan: Vec<SubBatchPlan>) -> Self {
        RestorePipeline {
            started,
            queue: plan.into(),
            inflight: VecDeque::new(),
            retry_alone: Vec::new(),
            ahead: vec![(0u64, 0usize); shards],
            depth: 2,
            transferred_any: false,
            next_index: 0,
        }
    }

    /// Microseconds since the restore started.
    fn us(&self, t: Instant) -> u64 {
        t.duration_since(self.started).as_micros() as u64
    }

    /// Marks the sub-batches whose loads are done `Ready` (the time in `Ready` is then measured
    /// from here to their transfer).
    fn note_ready(&mut self) {
        let mut now_us = None;
        for sub in self.inflight.iter_mut() {
            if sub.trace.state == SubBatchState::Loading && sub.pending.answered() {
                let at = *now_us.get_or_insert_with(|| self.started.elapsed().as_micros() as u64);
                sub.trace.ready_us = at;
                sub.trace.enter(SubBatchState::Ready, at);
            }
        }
    }

    /// Load stage: requests sub-batches in plan order while admission allows, without
    /// blocking while a loaded one waits to be transferred.
    fn request_loads(
        &mut self,
        engine: &'e Engine,
        keys: &[&[u8]],
        opts: &RestoreOptions,
        report: &mut RestoreReport,
        cancelled: &dyn Fn() -> bool,
    ) {
        while !cancelled() {
            let Some(planned) = self.queue.front() else { break };
            let admitted = match opts.mode {
                // Always one sub-batch ahead; then the depth and the bytes decide.
                RestoreMode::Pipelined => {
                    let (bytes, count) = self.ahead.get(planned.shard).copied().unwrap_or((0, 0));
                    count == 0 || (count < self.depth && bytes + planned.staging_bytes <= opts.ahead_bytes)
                }
                RestoreMode::Serialized | RestoreMode::Barrier => self.inflight.is_empty(),
            };
            if !admitted {
                break;
            }
            let credits = if planned.staging_bytes == 0 {
                None
            } else if let Some(c) = engine.credits.try_acquire(planned.shard, planned.staging_bytes) {
                Some(c)
            } else if self.inflight.is_empty() {
                report.credit_waits += 1;
                engine.restore.credit_waits.fetch_add(1, Ordering::Relaxed);
                match engine.credits.acquire(planned.shard, planned.staging_bytes, opts.cancel.as_deref()) {
                    Some(c) => Some(c),
                    None => break,
                }
            } else {
                report.credit_waits += 1;
                engine.restore.credit_waits.fetch_add(1, Ordering::Relaxed);
                break;
            };
            let Some(planned) = self.queue.pop_front() else { break };
            let pending = engine.send_leases(planned.keys.iter().map(|&i| (i, keys[i])));
            if let Some((bytes, count)) = self.ahead.get_mut(planned.shard) {
                *bytes += planned.staging_bytes;
                *count += 1;
            }
            let staging_now = self.ahead.iter().map(|&(bytes, _)| bytes).sum::<u64>();
            report.peak_staging_bytes = report.peak_staging_bytes.max(staging_now);
            engine.restore.sub_batches.fetch_add(1, Ordering::Relaxed);
            let load_start_us = self.us(Instant::now());
            let mut trace = SubBatchTrace {
                index: self.next_index,
                shard: planned.shard,
                keys: planned.keys.len(),
                staging_bytes: planned.staging_bytes,
                load_start_us,
                ready_us: 0,
                transfer_start_us: 0,
                transfer_end_us: 0,
                release_us: 0,
                state: SubBatchState::Loading,
                path: Vec::with_capacity(5),
                failed_keys: 0,
            };
            trace.enter(SubBatchState::Loading, load_start_us);
            self.inflight.push_back(LoadingSubBatch { trace, keys: planned.keys, pending, credits });
            self.next_index += 1;
        }
    }

    /// Transfer stage: the oldest sub-batch whose loads are done, or else the first to land.
    /// The shards share one disk and each serves its own queue, so another shard's sub-batch
    /// often lands well before the oldest: taking it keeps the link busy instead of idling
    /// behind the oldest (a transfer-bound restore's whole first wait). At full depth (the disk
    /// far behind the link) it takes every sub-batch whose loads are done, up to `MAX_MERGED`,
    /// into the same submission: a deep queue lands its loads in bursts, and a submission per
    /// sub-batch paid its fixed cost for each (0.3 ms for a GPU one), so the burst at the end
    /// took longer than the barrier's one transfer. False when there was none to take.
    fn transfer_next(
        &mut self,
        engine: &Engine,
        targets: &mut ReadTargets<'_, '_>,
        slots: &[KeyRead<'_>],
        opts: &RestoreOptions,
        report: &mut RestoreReport,
        cancelled: &dyn Fn() -> bool,
    ) -> bool {
        // The sub-batches requested and not yet transferred.
        let in_flight = self.inflight.len();
        self.note_ready();
        let done = self.inflight.iter().position(|f| f.pending.answered());
        let waiting_since = done.is_none().then(Instant::now);
        let next = done.unwrap_or_else(|| {
            let pending: Vec<&PendingLeases<'_>> = self.inflight.iter().map(|f| &f.pending).collect();
            PendingLeases::first_answered(&pending)
        });
        self.note_ready();
        let Some(first) = self.inflight.remove(next) else { return false };
        let mut landed = vec![first.land()];
        let waited = waiting_since.map(|since| since.elapsed());
        if self.depth >= MAX_DEPTH {
            while landed.len() < MAX_MERGED {
                let Some(more) = self.inflight.iter().position(|f| f.pending.answered()) else { break };
                let Some(more) = self.inflight.remove(more) else { break };
                landed.push(more.land());
            }
        }
        let stop = cancelled();
        let transfer_started = Instant::now();
        let start_us = self.us(transfer_started);
        for sub in &mut landed {
            if sub.trace.state == SubBatchState::Loading {
                sub.trace.ready_us = start_us;
                sub.trace.enter(SubBatchState::Ready, start_us);
            }
            sub.trace.transfer_start_us = start_us;
            sub.trace.enter(if stop { SubBatchState::Draining } else { SubBatchState::Transferring }, start_us);
            if !stop {
                engine.restore.ready_wait_us.fetch_add(sub.trace.ready_wait_us(), Ordering::Relaxed);
            }
        }
        for sub in landed.iter_mut().filter(|_| !stop) {
            let grants = &sub.grants;
            sub.trace.failed_keys =
                sub.keys.iter().filter(|&i| matches!(grants.get(i), Some(Err(e)) if load_failed(e))).count();
        }
        let mut grant_of: Vec<Option<&Result<ReadGrant>>> = vec![None; slots.len()];
        for sub in &landed {
            for &i in &sub.keys {
                match sub.grants.get(&i) {
                    Some(Err(Error::NoSpace)) => self.retry_alone.push(i),
                    Some(Ok(_)) if stop => report.results[i] = Err(Error::Cancelled),
                    Some(grant) => grant_of[i] = Some(grant),
                    None => report.results[i] = Err(Error::Internal("sub-batch key without a grant")),
                }
            }
        }
        // One submission per route, waited for before the release.
        engine.deliver(targets, slots, &grant_of, (None, &[]), &mut report.results, None);
        let transfer_ended = Instant::now();
        if !stop {
            // Copies that failed (the loads' failures are counted above).
            for sub in &mut landed {
                let copy_failed = sub
                    .keys
                    .iter()
                    .filter(|&&i| matches!(sub.grants.get(&i), Some(Ok(_))) && report.results[i].is_err())
                    .count();
                sub.trace.failed_keys += copy_failed;
            }
        }
        if landed[0].trace.staging_bytes > 0 {
            // The first one's wait against one sub-batch's share of the submission.
            let took = (transfer_ended - transfer_started) / u32::try_from(landed.len()).unwrap_or(u32::MAX);
            self.depth = deepen(self.depth, Pace { waited, took, in_flight, first: !self.transferred_any });
            self.transferred_any = true;
        }
        for sub in landed {
            self.release_landed(engine, sub, stop, transfer_ended, opts, report);
        }
        true
    }

    /// Gives a transferred sub-batch's leases and credits back and records its trace.
    fn release_landed(
        &mut self,
        engine: &Engine,
        mut sub: Landed<'_>,
        stop: bool,
        transfer_ended: Instant,
        opts: &RestoreOptions,
        report: &mut RestoreReport,
    ) {
        let ended_us = self.us(transfer_ended);
        sub.trace.transfer_end_us = ended_us;
        // Copies are synchronous here (GPU ones waited for their events), so every byte
        // of a key reported Ok has landed.
        if stop {
            engine.restore.drained_sub_batches.fetch_add(1, Ordering::Relaxed);
        } else if sub.trace.failed_keys > 0 {
            sub.trace.enter(SubBatchState::Failed, ended_us);
            engine.restore.failed_sub_batches.fetch_add(1, Ordering::Relaxed);
        } else {
            sub.trace.enter(SubBatchState::Verifying, ended_us);
        }
        release(sub.leases);
        if let Some((bytes, count)) = self.ahead.get_mut(sub.trace.shard) {
            *bytes -= sub.trace.staging_bytes;
            *count -= 1;
        }
        drop(sub.credits);
        let release_us = self.us(Instant::now());
        sub.trace.release_us = release_us;
        sub.trace.enter(SubBatchState::Released, release_us);
        if opts.trace {
            report.sub_batches.push(sub.trace);
        }
    }
}

impl Engine {
    /// Restores a batch (each object scattered across its destinations, sizes must add up, as
    /// in `batch_get_into_multi_buffers`), pipelining SSD loads against transfers. Results are in
    /// request order; duplicate keys are served like the unpipelined path (each occurrence on
    /// its own).
    pub fn restore_batch(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>], opts: &RestoreOptions) -> RestoreReport {
        self.restore_batch_wanting(keys, dsts, opts, Want::Whole)
    }

    /// `restore_batch` reading what `want` says of each object (`Whole`, or `Prefix` into each
    /// list's one region).
    pub(crate) fn restore_batch_wanting(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        opts: &RestoreOptions,
        want: Want,
    ) -> RestoreReport {
        let started = Instant::now();
        let mut report =
            RestoreReport { results: (0..keys.len()).map(|_| Err(Error::Cancelled)).collect(), ..Default::default() };
        if let Err(e) = crate::checks::one_list_per_key(keys.len(), dsts.len(), "destination") {
            report.results = vec![Err(e); keys.len()];
            return report;
        }
        self.restore.requests.fetch_add(1, Ordering::Relaxed);
        let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
        let mut targets = ReadTargets::new(self, &lists, opts.host_transport.clone());
        let slots: Vec<KeyRead<'_>> = keys.iter().enumerate().map(|(i, key)| KeyRead { key, list: i, want }).collect();
        let (plan, mut dram_gpu) = self.plan_checked(keys, dsts, opts, want, &mut targets, &mut report.results);
        let cancelled = || opts.cancel.as_ref().is_some_and(|c| c.load(Ordering::Acquire));
        let mut pipeline = RestorePipeline::new(started, self.shards.len(), plan);
        loop {
            pipeline.request_loads(self, keys, opts, &mut report, &cancelled);
            if !dram_gpu.is_empty() && !cancelled() {
                // While the first SSD sub-batches load.
                let some: Vec<KeyRead<'_>> = std::mem::take(&mut dram_gpu).into_iter().map(|i| slots[i]).collect();
                for (slot, result) in some.iter().zip(self.read(&mut targets, &some)) {
                    report.results[slot.list] = result;
                }
            }
            if pipeline.inflight.is_empty()
                || !pipeline.transfer_next(self, &mut targets, &slots, opts, &mut report, &cancelled)
            {
                break;
            }
        }
        // Keys that did not fit in DRAM beside their sub-batch run alone, after the pipeline.
        if !pipeline.retry_alone.is_empty() && !cancelled() {
            let some: Vec<KeyRead<'_>> = pipeline.retry_alone.iter().map(|&i| slots[i]).collect();
            for (slot, result) in some.iter().zip(self.read(&mut targets, &some)) {
                report.results[slot.list] = result;
            }
        }
        report.cancelled = cancelled() && (!pipeline.queue.is_empty() || report.results.iter().any(is_cancelled));
        if report.cancelled {
            self.restore.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        self.restore.peak_staging_bytes.fetch_max(report.peak_staging_bytes, Ordering::Relaxed);
        // In plan order: sub-batches are transferred in the order they landed.
        report.sub_batches.sort_by_key(|t| t.index);
        report.elapsed_us = pipeline.us(Instant::now());
        report
    }

    /// Checks every key and destination (each by its route's transport) before anything loads,
    /// then plans the sub-batches. Returns the plan and the DRAM-resident GPU keys, which the
    /// plain read path serves after the first loads went out. A key that fails gets its error
    /// in `results`.
    fn plan_checked(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        opts: &RestoreOptions,
        want: Want,
        targets: &mut ReadTargets<'_, '_>,
        results: &mut [Result<usize>],
    ) -> (Vec<SubBatchPlan>, Vec<usize>) {
        let checks = targets.check_now(self).to_vec();
        let mut valid = Vec::with_capacity(keys.len());
        for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
            let checked = self
                .validate_key(key)
                .and_then(|()| checks[i].clone().map_or(Ok(()), Err))
                .and_then(|()| total_len(regions));
            match checked {
                Ok(_) => valid.push(i),
                Err(e) => results[i] = Err(e),
            }
        }
        // A key whose object cannot fit its destination fails now, before its load.
        let misfit = |i: usize, object_len: u64| check_fits(object_len, &dsts[i], want).err();
        let (mut plan, refused) = self.plan_restore(keys, &valid, opts, &misfit);
        for (i, e) in refused {
            results[i] = Err(e);
        }
        let mut dram_gpu: Vec<usize> = Vec::new();
        if opts.mode != RestoreMode::Barrier {
            if let Some(first) = plan.first_mut().filter(|p| p.dram) {
                first.keys.retain(|&i| {
                    let gpu = targets.routes[i] == Route::Gpu;
                    if gpu {
                        dram_gpu.push(i);
                    }
                    !gpu
                });
            }
            plan.retain(|p| !p.keys.is_empty());
        }
        (plan, dram_gpu)
    }

    /// The restore counters for `stats`.
    pub(crate) fn restore_stats(&self) -> RestoreStats {
        RestoreStats {
            requests: self.restore.requests.load(Ordering::Relaxed),
            sub_batches: self.restore.sub_batches.load(Ordering::Relaxed),
            credit_waits: self.restore.credit_waits.load(Ordering::Relaxed),
            credits_held_bytes: self.credits.held_bytes(),
            peak_credits_bytes: self.credits.peak_bytes(),
            peak_request_staging_bytes: self.restore.peak_staging_bytes.load(Ordering::Relaxed),
            cancelled_requests: self.restore.cancelled.load(Ordering::Relaxed),
            failed_sub_batches: self.restore.failed_sub_batches.load(Ordering::Relaxed),
            drained_sub_batches: self.restore.drained_sub_batches.load(Ordering::Relaxed),
            ready_wait_us: self.restore.ready_wait_us.load(Ordering::Relaxed),
        }
    }

    /// How a caller that leases `keys` itself (the owner serving a remote batch) should split
    /// them: the restore pipeline's sub-batches under this store's restore options, as key
    /// indices. The DRAM-resident and missing keys come first, as one part (`in_dram`); then
    /// each shard's SSD-resident keys in parts of about `target_bytes`, shards interleaved so
    /// their loads run side by side, each shard's share of a part at most a quarter of its DRAM
    /// slice (or about `restore_sub_batch_bytes` where that is more, and one object over, since
    /// a sub-batch closes once it passed its target). Invalid keys go with the first part (their
    /// lease fails alone). An SSD-resident key whose object `misfit` (index, object length)
    /// refuses is not planned: it is answered with that error, without a load. A key whose lease
    /// still finds no room beside the parts held (`NoSpace`) is worth one more try once the
    /// caller holds nothing, as the restore pipeline retries such keys after its sub-batches.
    /// With no `misfit`, a single key is one part without asking where it lives.
    pub fn lease_parts(&self, keys: &[&[u8]], misfit: Option<&dyn Fn(usize, u64) -> Option<Error>>) -> LeasePlan {
        let mut invalid = Vec::new();
        let mut valid = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match self.validate_key(key) {
                Ok(()) => valid.push(i),
                Err(_) => invalid.push(i),
            }
        }
        let mut opts = self.restore_options();
        opts.mode = RestoreMode::Pipelined;
        // Such a caller holds two parts at most and takes no staging credits: a shard's
        // sub-batch stays within a quarter of its slice (`sub_batch_size` caps at an eighth of
        // `ahead_bytes`), so the two leave half of it to make room in.
        opts.ahead_bytes = opts.ahead_bytes.min(2 * self.arena.slice_bytes() as u64);
        // One key is one part: nothing to look up unless it may be refused.
        let (mut parts, refused) = if valid.len() <= 1 && misfit.is_none() {
            let shard = valid.first().map_or(0, |&i| self.shard_of(keys[i]));
            (vec![LeasePart { keys: valid, in_dram: false, shard }], Vec::new())
        } else {
            let (planned, refused) = self.plan_restore_with(keys, &valid, &opts, true, misfit.unwrap_or(&|_, _| None));
            let parts =
                planned.into_iter().map(|p| LeasePart { keys: p.keys, in_dram: p.dram, shard: p.shard }).collect();
            (parts, refused)
        };
        parts.retain(|p| !p.keys.is_empty());
        if !invalid.is_empty() {
            match parts.first_mut() {
                Some(first) => first.keys.extend(invalid),
                None => parts.push(LeasePart { keys: invalid, in_dram: true, shard: 0 }),
            }
        }
        LeasePlan { parts, refused }
    }

    /// Splits the valid keys into sub-batches: DRAM-resident keys first (one sub-batch, no
    /// staging), then each shard's SSD-resident keys in request order, interleaved across shards.
    /// An SSD-resident key whose object `misfit` (index, object length) refuses is not planned:
    /// it fails with that error without a load.
    fn plan_restore(
        &self,
        keys: &[&[u8]],
        valid: &[usize],
        opts: &RestoreOptions,
        misfit: &dyn Fn(usize, u64) -> Option<Error>,
    ) -> (Vec<SubBatchPlan>, Vec<(usize, Error)>) {
        self.plan_restore_with(keys, valid, opts, false, misfit)
    }

    /// `plan_restore`; `spin` polls for the shards' answers before blocking (a caller serving
    /// a latency-bound request).
    fn plan_restore_with(
        &self,
        keys: &[&[u8]],
        valid: &[usize],
        opts: &RestoreOptions,
        spin: bool,
        misfit: &dyn Fn(usize, u64) -> Option<Error>,
    ) -> (Vec<SubBatchPlan>, Vec<(usize, Error)>) {
        let locations = self.locate(keys, valid, spin);
        let mut dram = Vec::new();
        let mut refused = Vec::new();
        let mut per_shard: Vec<Vec<(usize, u64)>> = vec![Vec::new(); self.shards.len()];
        for &i in valid {
            match locations.get(&i).copied().flatten() {
                // Missing keys ride with the DRAM sub-batch and come back NotFound.
                None => dram.push(i),
                Some(l) if l.in_dram => dram.push(i),
                Some(l) => match misfit(i, l.len) {
                    Some(e) => refused.push((i, e)),
                    None => per_shard[self.shard_of(keys[i])].push((i, l.staging_bytes)),
                },
            }
        }
        (cut_sub_batches(dram, per_shard, opts), refused)
    }

    /// Where each valid key lives (one message per shard).
    fn locate(&self, keys: &[&[u8]], valid: &[usize], spin: bool) -> HashMap<usize, Option<Location>> {
        let mut out = HashMap::new();
        self.fan_out(valid.iter().map(|&i| (i, keys[i], ())), |items, reply| Request::Locate {
            keys: items.into_iter().map(|(k, ())| k).collect(),
            reply,
        })
        // Blocking unless asked, as before the pipeline starts: a polling caller would take CPU
        // time the shards need on a small machine.
        .gather_waiting(self, spin, |i, _, found| {
            out.insert(i, found.ok().flatten());
        });
        out
    }
}

/// `Engine::plan_restore`'s sub-batches of the DRAM-resident keys and of each shard's
/// SSD-resident ones (index, staging bytes).
fn cut_sub_batches(dram: Vec<usize>, per_shard: Vec<Vec<(usize, u64)>>, opts: &RestoreOptions) -> Vec<SubBatchPlan> {
    if opts.mode == RestoreMode::Barrier {
        let mut all = dram;
        let mut bytes = 0;
        for &(i, b) in per_shard.iter().flatten() {
            all.push(i);
            bytes += b;
        }
        all.sort_unstable();
        return vec![SubBatchPlan { shard: 0, keys: all, staging_bytes: bytes, dram: false }];
    }
    let mut chunks: Vec<VecDeque<SubBatchPlan>> = per_shard
        .into_iter()
        .enumerate()
        .map(|(shard, objects)| {
            let (target_bytes, max_keys) = sub_batch_size(&objects, opts);
            let mut out = VecDeque::new();
            let mut current = SubBatchPlan { shard, keys: Vec::new(), staging_bytes: 0, dram: false };
            for (i, bytes) in objects {
                // Close a sub-batch once it reaches the target (so 4 MiB of 1 MiB values is 4
                // objects despite their 4 KiB record headers).
                let full = current.staging_bytes >= target_bytes || current.keys.len() >= max_keys;
                if full {
                    out.push_back(std::mem::replace(
                        &mut current,
                        SubBatchPlan { shard, keys: Vec::new(), staging_bytes: 0, dram: false },
                    ));
                }
                current.keys.push(i);
                current.staging_bytes += bytes;
            }
            if !current.keys.is_empty() {
                out.push_back(current);
            }
            out
        })
        .collect();
    let mut plan = Vec::new();
    if !dram.is_empty() {
        plan.push(SubBatchPlan { shard: 0, keys: dram, staging_bytes: 0, dram: true });
    }
    // Round-robin across shards so every shard's loads run in parallel.
    loop {
        let mut any = false;
        for shard in chunks.iter_mut() {
            if let Some(p) = shard.pop_front() {
                plan.push(p);
                any = true;
            }
        }
        if !any {
            break;
        }
    }
    plan
}

/// Sub-batches of one shard a pipelined request may keep requested ahead of its transfers
/// (`ahead_bytes` bounds them first for all but tiny objects).
const MAX_DEPTH: usize = 64;

/// Sub-batches whose loads are done that one submission of a request at full depth takes at
/// most: their leases and credits go back only once it ends.
const MAX_MERGED: usize = 16;

/// A wait for loads this many times the sub-batch's transfer (or more, see `deepen`) means the
/// disk is far behind the link.
const FAR_BEHIND: usize = 8;

/// How one sub-batch went through the transfer stage.
#[derive(Clone, Copy, Debug)]
struct Pace {
    /// How long the transfer stage waited for its loads (None: they had landed).
    waited: Option<Duration>,
    /// How long its transfer took: the submission's time over the sub-batches it carried.
    took: Duration,
    /// Sub-batches of the request requested and not transferred when the stage took it up
    /// (itself included).
    in_flight: usize,
    /// The request's first sub-batch with bytes to load: its wait is a whole load's latency,
    /// whatever the disk's pace.
    first: bool,
}

/// The depth (sub-batches per shard requested ahead) after a sub-batch went as `pace` says.
/// - A wait longer than transferring every sub-batch in flight would take (and at least
///   `FAR_BEHIND` transfers): even served side by side, the disk delivers slower than the link,
///   so the request gets the whole window at once, as the barrier gives the disk its whole
///   queue. Ramping up by doubling cost a disk-bound restore several percent of its time.
/// - A wait longer than the transfer (not the first's): loads lag, the depth doubles.
/// - Otherwise it stays: a deeper queue serves the sub-batches side by side, so the oldest one,
///   which the transfer stage needs next, lands later, and a restore limited by its transfers
///   would wait more, not less.
fn deepen(depth: usize, pace: Pace) -> usize {
    let Some(waited) = pace.waited else { return depth };
    let far = pace.took.saturating_mul(u32::try_from(FAR_BEHIND.max(pace.in_flight)).unwrap_or(u32::MAX));
    if waited > far {
        MAX_DEPTH
    } else if waited > pace.took && !pace.first {
        depth.saturating_mul(2).min(MAX_DEPTH)
    } else {
        depth
    }
}

/// Sub-batches one shard's part of a request is cut into at most, unless `ahead_bytes` caps
/// their size: enough to overlap loads with transfers at a fine grain, few enough that the
/// per-sub-batch costs (a lease message, a reply, a transport submission) stay small.
pub const MAX_SUB_BATCHES_PER_SHARD: u64 = 16;

/// Sub-batch target bytes and keys for one shard's SSD-resident `objects` (key, staging bytes):
/// the configured minimums, grown so the shard's part is at most `MAX_SUB_BATCHES_PER_SHARD`
/// sub-batches, the bytes never past an eighth of `ahead_bytes` (a quarter of the loads in
/// flight that the default window leaves room for), so at least four sub-batches of a shard
/// load at once. Many small objects get more keys per sub-batch (fewer messages); a few large
/// ones stay one object each.
fn sub_batch_size(objects: &[(usize, u64)], opts: &RestoreOptions) -> (u64, usize) {
    let min_bytes = opts.target_bytes.max(1);
    let min_keys = opts.max_keys.max(1);
    let total: u64 = objects.iter().map(|&(_, b)| b).sum();
    let cap = (opts.ahead_bytes / 8).max(min_bytes);
    let bytes = total.div_ceil(MAX_SUB_BATCHES_PER_SHARD).clamp(min_bytes, cap);
    let keys = objects.len().div_ceil(MAX_SUB_BATCHES_PER_SHARD as usize).max(min_keys);
    (bytes, keys)
}

/// A lease refused because the object's load failed (not because the key is missing or
/// there was no room: those are not the sub-batch's failure).
fn load_failed(e: &Error) -> bool {
    !matches!(
        e,
        Error::NotFound
            | Error::NoSpace
            | Error::Cancelled
            | Error::InvalidArgument(_)
            | Error::Busy { .. }
            | Error::ShuttingDown
    )
}

fn is_cancelled(r: &Result<usize>) -> bool {
    matches!(r, Err(Error::Cancelled))
}

fn release(leases: LeaseSet<'_>) {
    drop(leases);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objects(n: usize, bytes: u64) -> Vec<(usize, u64)> {
        (0..n).map(|i| (i, bytes)).collect()
    }

    #[test]
    fn sub_batches_grow_with_the_shards_part_up_to_an_eighth_of_ahead() {
        let opts = RestoreOptions { target_bytes: 2 << 20, max_keys: 64, ahead_bytes: 128 << 20, ..Default::default() };
        // A small part keeps the configured minimums.
        assert_eq!(sub_batch_size(&objects(8, 1 << 20), &opts), (2 << 20, 64));
        // 64 MiB on one shard: 16 sub-batches of 4 MiB.
        assert_eq!(sub_batch_size(&objects(64, 1 << 20), &opts), (4 << 20, 64));
        // 576 MiB of 384 KiB objects: capped at an eighth of ahead_bytes, so four load at once
        // within the shard's 64 MiB of loads in flight.
        assert_eq!(sub_batch_size(&objects(1536, 384 << 10), &opts), (16 << 20, 96));
        // Many tiny objects: more keys per sub-batch, not more sub-batches.
        assert_eq!(sub_batch_size(&objects(16_000, 4 << 10), &opts).1, 1000);
        // ahead_bytes below the target never shrinks a sub-batch under the target.
        let tight = RestoreOptions { ahead_bytes: 1 << 20, ..opts.clone() };
        assert_eq!(sub_batch_size(&objects(64, 1 << 20), &tight), (2 << 20, 64));
        assert_eq!(sub_batch_size(&[], &opts), (2 << 20, 64));
    }

    fn pace(waited_us: Option<u64>, took_us: u64, in_flight: usize, first: bool) -> Pace {
        Pace { waited: waited_us.map(Duration::from_micros), took: Duration::from_micros(took_us), in_flight, first }
    }

    #[test]
    fn depth_jumps_when_the_disk_is_far_behind_doubles_when_it_lags_and_stays_otherwise() {
        // No wait: the loads are ahead.
        assert_eq!(deepen(2, pace(None, 200, 8, false)), 2);
        // A GPU link: the first sub-batch waited 5 ms for loads it transfers in 0.2 ms, with 8
        // in flight (1.6 ms of transfers): the whole window at once, even for the first.
        assert_eq!(deepen(2, pace(Some(5_000), 200, 8, true)), MAX_DEPTH);
        // A link about as fast as the disk: the first wait is a load's latency, not a lag.
        assert_eq!(deepen(2, pace(Some(9_000), 4_000, 4, true)), 2);
        // Later, a wait longer than the transfer doubles the depth, up to the most.
        assert_eq!(deepen(2, pace(Some(9_000), 4_000, 4, false)), 4);
        assert_eq!(deepen(MAX_DEPTH, pace(Some(9_000), 4_000, 4, false)), MAX_DEPTH);
        // Far behind is judged against every transfer in flight: 8 ms is more than eight 0.5 ms
        // transfers but fewer than twenty.
        assert_eq!(deepen(4, pace(Some(8_000), 500, 8, false)), MAX_DEPTH);
        assert_eq!(deepen(4, pace(Some(8_000), 500, 20, false)), 8);
        // A wait shorter than the transfer leaves it.
        assert_eq!(deepen(4, pace(Some(300), 400, 8, false)), 4);
    }
}
