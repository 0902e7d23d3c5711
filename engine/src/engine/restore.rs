//! Pipelined restore of SSD-resident batches (seed 003).
//!
//! Owns planning (whole-object sub-batches per shard, by bytes and count), the two stages (the
//! shard loads sub-batch i+1 from SSD into DRAM while the calling thread transfers sub-batch i to
//! its destinations), the credit broker that bounds staging per request (the window), per shard
//! and process-wide, and the per-sub-batch lifecycle trace. It never reports a key whose bytes
//! were not all delivered, and never returns credits or leases before nothing can touch them.
//!
//! Device destinations (feature `cuda`) are checked on their GPU up front; a sub-batch's device
//! keys then go to the GPU in one submission (staged or direct, as the store's policy says) and
//! their leases are released only once its events fired. DRAM-resident device keys skip the
//! pipeline and take the GPU read path with its early start, while the SSD sub-batches load.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtide_transport::{copy_regions, MemoryKind, Region};

use super::{check_destination, grant_region, total_len, Engine, LeaseSet, PendingLeases};
use crate::error::{Error, Result};
use crate::shard::{Location, ReadGrant, Request};

/// How a batch that touches the SSD is restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreMode {
    /// Load sub-batch i+1 while transferring sub-batch i (window of `RestoreOptions::window`).
    Pipelined,
    /// Sub-batches one after another: load, transfer, load, transfer.
    Serialized,
    /// Load everything, then transfer everything (the unpipelined baseline).
    Barrier,
}

/// Moves a leased object's bytes to its destinations. The default is a CPU memcpy; benchmarks
/// throttle it to model a link; the CUDA transport plugs in here for device destinations.
pub trait TransferStage: Send + Sync {
    /// Copies `src` across `dsts` in order (their lengths add up to `src.len()`).
    fn transfer(&self, src: &Region<'_>, dsts: &[Region<'_>]) -> Result<()>;
}

/// CPU copies.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemcpyTransfer;

impl TransferStage for MemcpyTransfer {
    fn transfer(&self, src: &Region<'_>, dsts: &[Region<'_>]) -> Result<()> {
        let mut offset = 0u64;
        for dst in dsts {
            // SAFETY: `src` is leased for the duration of the transfer; `dst` is caller memory
            // lent for the call.
            unsafe { copy_regions(src, offset, dst, 0, dst.len() as u64)? };
            offset += dst.len() as u64;
        }
        Ok(())
    }
}

/// A memcpy paced to `bytes_per_sec`: models a PCIe link (or any slower transfer) in tests and
/// benchmarks on machines without one.
#[derive(Clone, Copy, Debug)]
pub struct ThrottledTransfer {
    pub bytes_per_sec: u64,
}

impl TransferStage for ThrottledTransfer {
    fn transfer(&self, src: &Region<'_>, dsts: &[Region<'_>]) -> Result<()> {
        let started = Instant::now();
        MemcpyTransfer.transfer(src, dsts)?;
        let due = Duration::from_secs_f64(src.len() as f64 / self.bytes_per_sec.max(1) as f64);
        while started.elapsed() < due {
            let left = due.saturating_sub(started.elapsed());
            if left > Duration::from_micros(200) {
                std::thread::sleep(left - Duration::from_micros(100));
            } else {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }
}

/// What a restore does and how it reports.
#[derive(Clone)]
pub struct RestoreOptions {
    pub mode: RestoreMode,
    /// Target bytes per sub-batch (whole objects; a larger object is a sub-batch of its own).
    pub target_bytes: u64,
    /// Keys per sub-batch at most.
    pub max_keys: usize,
    /// Sub-batches in flight per request (1..=8; 2 = one loading, one transferring).
    pub window: usize,
    /// Set to stop: no new loads; in-flight ones drain; undelivered keys report `Cancelled`.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Record per-sub-batch timestamps in the report.
    pub trace: bool,
    /// The transfer stage (default: memcpy).
    pub transfer: Arc<dyn TransferStage>,
}

impl std::fmt::Debug for RestoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreOptions")
            .field("mode", &self.mode)
            .field("target_bytes", &self.target_bytes)
            .field("max_keys", &self.max_keys)
            .field("window", &self.window)
            .finish()
    }
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            mode: RestoreMode::Pipelined,
            target_bytes: 2 << 20,
            max_keys: 64,
            window: 2,
            cancel: None,
            trace: false,
            transfer: Arc::new(MemcpyTransfer),
        }
    }
}

/// Where a sub-batch is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubBatchState {
    Loading,
    Ready,
    Transferring,
    Verifying,
    Released,
    /// Cancelled or failed: drained (its loads completed, its leases released) before release.
    Drained,
}

/// One sub-batch's timeline, in microseconds since the request started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubBatchTrace {
    pub index: usize,
    pub shard: usize,
    pub keys: usize,
    pub staging_bytes: u64,
    pub load_start_us: u64,
    pub ready_us: u64,
    pub transfer_start_us: u64,
    pub transfer_end_us: u64,
    pub release_us: u64,
    pub state: SubBatchState,
}

impl SubBatchTrace {
    /// One JSON object on one line.
    pub fn to_json_line(&self) -> String {
        format!(
            "{{\"index\":{},\"shard\":{},\"keys\":{},\"staging_bytes\":{},\"load_start_us\":{},\"ready_us\":{},\"transfer_start_us\":{},\"transfer_end_us\":{},\"release_us\":{},\"state\":\"{:?}\"}}",
            self.index,
            self.shard,
            self.keys,
            self.staging_bytes,
            self.load_start_us,
            self.ready_us,
            self.transfer_start_us,
            self.transfer_end_us,
            self.release_us,
            self.state
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
}

/// Engine-wide restore counters (stats).
#[derive(Debug, Default)]
pub(crate) struct RestoreCounters {
    pub(crate) requests: AtomicU64,
    pub(crate) sub_batches: AtomicU64,
    pub(crate) credit_waits: AtomicU64,
    pub(crate) peak_staging_bytes: AtomicU64,
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
struct Planned {
    shard: usize,
    keys: Vec<usize>,
    staging_bytes: u64,
    /// The DRAM-resident keys (and missing ones): nothing to load.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dram: bool,
}

/// A sub-batch whose loads were requested.
struct InFlight<'e> {
    trace: SubBatchTrace,
    keys: Vec<usize>,
    pending: PendingLeases<'e>,
    _credits: Option<Credits<'e>>,
}

impl Engine {
    /// Restores a batch (each object scattered across its destinations, sizes must add up, as
    /// in `batch_get_into_multi_buffers`), pipelining SSD loads against transfers. Results are in
    /// request order; duplicate keys are served like the unpipelined path (each occurrence on
    /// its own).
    pub fn restore_batch(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>], opts: &RestoreOptions) -> RestoreReport {
        let started = Instant::now();
        let us = |t: Instant| t.duration_since(started).as_micros() as u64;
        let mut report =
            RestoreReport { results: (0..keys.len()).map(|_| Err(Error::Cancelled)).collect(), ..Default::default() };
        if let Err(e) = crate::checks::one_list_per_key(keys.len(), dsts.len(), "destination") {
            report.results = vec![Err(e); keys.len()];
            return report;
        }
        self.restore.requests.fetch_add(1, Ordering::Relaxed);
        // Keys with a device destination; their regions are checked on the GPU now (without the
        // feature `check_destination` refuses them).
        let device: Vec<bool> =
            dsts.iter().map(|d| d.iter().any(|r| matches!(r.kind(), MemoryKind::Device { .. }))).collect();
        #[cfg(feature = "cuda")]
        let device_checks = if device.contains(&true) {
            super::gpu::check_destinations(self, dsts, &device)
        } else {
            vec![None; keys.len()]
        };
        let mut valid = Vec::with_capacity(keys.len());
        for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
            #[cfg(feature = "cuda")]
            let regions_ok = match &device_checks[i] {
                Some(e) => Err(e.clone()),
                None if device[i] => Ok(()),
                None => regions.iter().try_for_each(check_destination),
            };
            #[cfg(not(feature = "cuda"))]
            let regions_ok = regions.iter().try_for_each(check_destination);
            let checked = self.validate_key(key).and(regions_ok).and_then(|()| total_len(regions));
            match checked {
                Ok(_) => valid.push(i),
                Err(e) => report.results[i] = Err(e),
            }
        }
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut plan = self.plan_restore(keys, &valid, opts);
        // DRAM-resident device keys: served by the GPU read path (after the first loads went out).
        #[cfg(feature = "cuda")]
        let mut dram_device: Vec<usize> = Vec::new();
        #[cfg(feature = "cuda")]
        if opts.mode != RestoreMode::Barrier {
            if let Some(first) = plan.first_mut().filter(|p| p.dram) {
                first.keys.retain(|&i| {
                    if device[i] {
                        dram_device.push(i);
                    }
                    !device[i]
                });
            }
            plan.retain(|p| !p.keys.is_empty());
        }
        // The window is per shard: each shard involved keeps `window` sub-batches of this
        // request in flight, so shards load in parallel.
        let shards_involved = plan.iter().map(|p| p.shard).collect::<HashSet<_>>().len().max(1);
        let window = match opts.mode {
            RestoreMode::Pipelined => opts.window.clamp(1, 8) * shards_involved,
            RestoreMode::Serialized | RestoreMode::Barrier => 1,
        };
        let cancelled = || opts.cancel.as_ref().is_some_and(|c| c.load(Ordering::Acquire));
        let mut queue: VecDeque<Planned> = plan.into();
        let mut inflight: VecDeque<InFlight<'_>> = VecDeque::new();
        let mut retry_alone: Vec<usize> = Vec::new();
        let mut staging_now = 0u64;
        let mut next_index = 0;
        loop {
            // Load stage: keep up to `window` sub-batches requested, without blocking while a
            // loaded one waits to be transferred.
            while inflight.len() < window && !cancelled() {
                let Some(planned) = queue.front() else { break };
                let credits = if planned.staging_bytes == 0 {
                    None
                } else if let Some(c) = self.credits.try_acquire(planned.shard, planned.staging_bytes) {
                    Some(c)
                } else if inflight.is_empty() {
                    report.credit_waits += 1;
                    self.restore.credit_waits.fetch_add(1, Ordering::Relaxed);
                    match self.credits.acquire(planned.shard, planned.staging_bytes, opts.cancel.as_deref()) {
                        Some(c) => Some(c),
                        None => break,
                    }
                } else {
                    report.credit_waits += 1;
                    self.restore.credit_waits.fetch_add(1, Ordering::Relaxed);
                    break;
                };
                let Some(planned) = queue.pop_front() else { break };
                let pending = self.send_leases(planned.keys.iter().map(|&i| (i, keys[i])));
                staging_now += planned.staging_bytes;
                report.peak_staging_bytes = report.peak_staging_bytes.max(staging_now);
                self.restore.sub_batches.fetch_add(1, Ordering::Relaxed);
                inflight.push_back(InFlight {
                    trace: SubBatchTrace {
                        index: next_index,
                        shard: planned.shard,
                        keys: planned.keys.len(),
                        staging_bytes: planned.staging_bytes,
                        load_start_us: us(Instant::now()),
                        ready_us: 0,
                        transfer_start_us: 0,
                        transfer_end_us: 0,
                        release_us: 0,
                        state: SubBatchState::Loading,
                    },
                    keys: planned.keys,
                    pending,
                    _credits: credits,
                });
                next_index += 1;
            }
            #[cfg(feature = "cuda")]
            if !dram_device.is_empty() && !cancelled() {
                // While the first SSD sub-batches load.
                for (i, result) in super::gpu::batch_get_some(self, keys, dsts, &std::mem::take(&mut dram_device)) {
                    report.results[i] = result;
                }
            }
            // Transfer stage: the oldest sub-batch, once its loads are done.
            let Some(mut sub) = inflight.pop_front() else { break };
            let (grants, leases) = sub.pending.wait();
            sub.trace.ready_us = us(Instant::now());
            sub.trace.state = SubBatchState::Ready;
            let stop = cancelled();
            sub.trace.transfer_start_us = us(Instant::now());
            if !stop {
                sub.trace.state = SubBatchState::Transferring;
            }
            let mut to_gpu: Vec<(usize, ReadGrant)> = Vec::new();
            for &i in &sub.keys {
                match grants.get(&i) {
                    Some(Err(Error::NoSpace)) => retry_alone.push(i),
                    Some(Ok(grant)) if !stop && device[i] => to_gpu.push((i, *grant)),
                    Some(Ok(grant)) if !stop => report.results[i] = deliver(grant, &dsts[i], opts.transfer.as_ref()),
                    Some(Ok(_)) => report.results[i] = Err(Error::Cancelled),
                    Some(Err(e)) => report.results[i] = Err(e.clone()),
                    None => report.results[i] = Err(Error::Internal("sub-batch key without a grant")),
                }
            }
            // The sub-batch's device keys in one GPU submission, waited for before the release.
            for (i, result) in self.deliver_to_gpu(&to_gpu, dsts) {
                report.results[i] = result;
            }
            sub.trace.transfer_end_us = us(Instant::now());
            // Copies are synchronous here (GPU ones waited for their events), so every byte of a
            // key reported Ok has landed.
            sub.trace.state = if stop { SubBatchState::Drained } else { SubBatchState::Verifying };
            release(leases);
            staging_now -= sub.trace.staging_bytes;
            sub.trace.release_us = us(Instant::now());
            if sub.trace.state == SubBatchState::Verifying {
                sub.trace.state = SubBatchState::Released;
            }
            if opts.trace {
                report.sub_batches.push(sub.trace);
            }
        }
        // Keys that did not fit in DRAM beside their sub-batch run alone, after the pipeline.
        if !retry_alone.is_empty() && !cancelled() {
            let transfer = opts.transfer.clone();
            self.lease_in_rounds(retry_alone.iter().map(|&i| (i, keys[i])).collect(), |i, grant| {
                report.results[i] = grant.and_then(|g| {
                    if !device[i] {
                        return deliver(&g, &dsts[i], transfer.as_ref());
                    }
                    let delivered = self.deliver_to_gpu(&[(i, g)], dsts).pop();
                    delivered.map_or(Err(Error::Internal("no GPU transfer result")), |(_, r)| r)
                });
            });
        }
        self.restore.peak_staging_bytes.fetch_max(report.peak_staging_bytes, Ordering::Relaxed);
        report.elapsed_us = us(Instant::now());
        report
    }

    /// Copies leased objects to their device destinations (checked when the restore began), one
    /// GPU submission for all of them, and waits; results by key index.
    fn deliver_to_gpu(&self, items: &[(usize, ReadGrant)], dsts: &[Vec<Region<'_>>]) -> Vec<(usize, Result<usize>)> {
        #[cfg(feature = "cuda")]
        return super::gpu::deliver_leased(self, items, dsts);
        // Unreachable in practice: validation refuses device destinations without the feature.
        #[cfg(not(feature = "cuda"))]
        {
            let _ = dsts;
            items
                .iter()
                .map(|&(i, _)| (i, Err(Error::CudaUnavailable("device destinations need the cuda feature"))))
                .collect()
        }
    }

    /// Splits the valid keys into sub-batches: DRAM-resident keys first (one sub-batch, no
    /// staging), then each shard's SSD-resident keys in request order, interleaved across shards.
    fn plan_restore(&self, keys: &[&[u8]], valid: &[usize], opts: &RestoreOptions) -> Vec<Planned> {
        let locations = self.locate(keys, valid);
        let mut dram = Vec::new();
        let mut per_shard: Vec<Vec<(usize, u64)>> = vec![Vec::new(); self.shards.len()];
        for &i in valid {
            match locations.get(&i).copied().flatten() {
                // Missing keys ride with the DRAM sub-batch and come back NotFound.
                None => dram.push(i),
                Some(l) if l.in_dram => dram.push(i),
                Some(l) => per_shard[self.shard_of(keys[i])].push((i, l.staging_bytes)),
            }
        }
        if opts.mode == RestoreMode::Barrier {
            let mut all = dram;
            let mut bytes = 0;
            for &(i, b) in per_shard.iter().flatten() {
                all.push(i);
                bytes += b;
            }
            all.sort_unstable();
            return vec![Planned { shard: 0, keys: all, staging_bytes: bytes, dram: false }];
        }
        let mut chunks: Vec<VecDeque<Planned>> = per_shard
            .into_iter()
            .enumerate()
            .map(|(shard, objects)| {
                let mut out = VecDeque::new();
                let mut current = Planned { shard, keys: Vec::new(), staging_bytes: 0, dram: false };
                for (i, bytes) in objects {
                    // Close a sub-batch once it reaches the target (so 4 MiB of 1 MiB values is 4
                    // objects despite their 4 KiB record headers).
                    let full = current.staging_bytes >= opts.target_bytes || current.keys.len() >= opts.max_keys;
                    if full {
                        out.push_back(std::mem::replace(
                            &mut current,
                            Planned { shard, keys: Vec::new(), staging_bytes: 0, dram: false },
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
            plan.push(Planned { shard: 0, keys: dram, staging_bytes: 0, dram: true });
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

    /// Where each valid key lives (one message per shard).
    fn locate(&self, keys: &[&[u8]], valid: &[usize]) -> HashMap<usize, Option<Location>> {
        let mut per_shard: Vec<Vec<usize>> = vec![Vec::new(); self.shards.len()];
        for &i in valid {
            per_shard[self.shard_of(keys[i])].push(i);
        }
        let replies: Vec<_> = per_shard
            .iter()
            .enumerate()
            .filter(|(_, idx)| !idx.is_empty())
            .map(|(shard, idx)| {
                let owned = idx.iter().map(|&i| Box::<[u8]>::from(keys[i])).collect();
                (shard, self.send_with_reply(shard, |reply| Request::Locate { keys: owned, reply }))
            })
            .collect();
        let mut out = HashMap::new();
        for (shard, rx) in replies {
            let found = rx.ok().and_then(|rx| rx.recv().ok()).unwrap_or_default();
            for (k, &i) in per_shard[shard].iter().enumerate() {
                out.insert(i, found.get(k).copied().flatten());
            }
        }
        out
    }
}

fn release(leases: LeaseSet<'_>) {
    drop(leases);
}

/// Transfers one leased object, checking sizes first; a failed transfer is that key's error.
fn deliver(grant: &ReadGrant, dsts: &[Region<'_>], transfer: &dyn TransferStage) -> Result<usize> {
    let dst_bytes = total_len(dsts)?;
    if dst_bytes != grant.len {
        return Err(Error::SizeMismatch { object_bytes: grant.len, destination_bytes: dst_bytes });
    }
    let src = grant_region(grant.ptr, grant.len);
    transfer.transfer(&src, dsts)?;
    Ok(grant.len as usize)
}
