//! GPU destinations and sources for the blocking object API (feature `cuda`).
//!
//! Owns the store's staging policy, the lazy `cuMemHostRegister` of the DRAM arena and the GPU
//! counters. For a call that names device memory it validates every region (device pointers with
//! `cuPointerGetAttributes`) before anything is submitted, takes the leases (or reservations) as
//! the host paths do, hands the transfers to the CUDA transport, and then polls the transfer's
//! CUDA events on the calling thread (spin, then yield; never `cuStreamSynchronize`) while the
//! `LeaseSet` stays alive: leases are released only once the event fired (or the failure was
//! drained). It never reports a key whose bytes did not all arrive as a success, and a failed
//! staged transfer is never replayed through the direct path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvtide_transport::cuda::plan::{Direction, Fallback, Piece, StagingPolicy, Transfer};
use kvtide_transport::cuda::{
    copy_host_pieces, prestage, submit_with, CudaTransport, Prestaged, RangeChecker, Summary,
};
use kvtide_transport::{MemoryKind, Region};

use super::{total_len, Engine};
use crate::api::{Fragment, PutOptions};
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::shard::ReadGrant;
use crate::stats::GpuStats;
use crate::ticket::pending;

/// True when any region is GPU memory (the call then takes this module's path).
pub(super) fn any_device<'r>(mut regions: impl Iterator<Item = &'r Region<'r>>) -> bool {
    regions.any(|r| matches!(r.kind(), MemoryKind::Device { .. }))
}

/// Keeps every shard polling instead of parking while a GPU transfer is in flight
/// (`gpu_keep_shards_awake`): the transfer's release and the caller's next request then cost
/// no wake-up. Declared before the call's leases, so it is dropped after they were released.
struct KeepAwake<'e>(Option<&'e AtomicUsize>);

impl<'e> KeepAwake<'e> {
    fn new(engine: &'e Engine) -> KeepAwake<'e> {
        let counter = engine.config.gpu_keep_shards_awake.then_some(&*engine.keep_awake);
        if let Some(counter) = counter {
            counter.fetch_add(1, Relaxed);
        }
        KeepAwake(counter)
    }
}

impl Drop for KeepAwake<'_> {
    fn drop(&mut self) {
        if let Some(counter) = self.0 {
            counter.fetch_sub(1, Relaxed);
        }
    }
}

/// The store's GPU state.
pub(super) struct GpuState {
    policy: StagingPolicy,
    /// Whether the arena registration was attempted (once per engine).
    registration: Mutex<bool>,
    /// Shared with async tickets' shard tasks, which report their submissions here.
    counters: Arc<GpuCounters>,
}

/// When a batch read's phases ended (for the timing counters; `execute` adds the last three:
/// checks and transfers until it is called, planning and submission, waiting).
#[derive(Clone, Copy)]
struct Timing {
    started: Instant,
    sent_at: Instant,
    granted_at: Instant,
    prestaged_at: Instant,
}

#[derive(Default)]
struct GpuCounters {
    send_us: AtomicU64,
    grant_us: AtomicU64,
    prestage_us: AtomicU64,
    plan_us: AtomicU64,
    submit_us: AtomicU64,
    wait_us: AtomicU64,
    registered: AtomicU64,
    registration_us: AtomicU64,
    staged_requests: AtomicU64,
    direct_requests: AtomicU64,
    fills: AtomicU64,
    kernel_launches: AtomicU64,
    copy_calls: AtomicU64,
    batch_calls: AtomicU64,
    bytes_to_device: AtomicU64,
    bytes_to_host: AtomicU64,
    failed_keys: AtomicU64,
    fallbacks: Mutex<HashMap<&'static str, u64>>,
}

impl GpuCounters {
    fn record(&self, summary: &Summary, direction: Direction) {
        let c = self;
        if summary.staged {
            c.staged_requests.fetch_add(1, Relaxed);
        } else {
            c.direct_requests.fetch_add(1, Relaxed);
        }
        if let Some(reason) = summary.fallback {
            if reason != Fallback::Disabled {
                *c.fallbacks.lock().unwrap_or_else(|p| p.into_inner()).entry(reason.name()).or_default() += 1;
            }
        }
        c.fills.fetch_add(summary.fills, Relaxed);
        c.kernel_launches.fetch_add(summary.kernel_launches, Relaxed);
        c.copy_calls.fetch_add(summary.copy_calls, Relaxed);
        c.batch_calls.fetch_add(summary.batch_calls, Relaxed);
        let bytes = match direction {
            Direction::HostToDevice => &c.bytes_to_device,
            Direction::DeviceToHost => &c.bytes_to_host,
        };
        bytes.fetch_add(summary.bytes, Relaxed);
    }
}

impl GpuState {
    pub(super) fn new(config: &EngineConfig) -> GpuState {
        GpuState {
            policy: StagingPolicy {
                enabled: config.gpu_staging,
                buffer_bytes: config.gpu_staging_bytes,
                tail_fill_bytes: config.gpu_staging_tail_bytes,
            },
            registration: Mutex::new(false),
            counters: Arc::new(GpuCounters::default()),
        }
    }

    pub(super) fn stats(&self) -> GpuStats {
        let c = &self.counters;
        let mut fallbacks: Vec<(String, u64)> =
            c.fallbacks.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.to_string(), *v)).collect();
        fallbacks.sort();
        GpuStats {
            arena_registered: c.registered.load(Relaxed) > 0,
            registration_us: c.registration_us.load(Relaxed),
            staged_requests: c.staged_requests.load(Relaxed),
            direct_requests: c.direct_requests.load(Relaxed),
            staged_fills: c.fills.load(Relaxed),
            kernel_launches: c.kernel_launches.load(Relaxed),
            copy_calls: c.copy_calls.load(Relaxed),
            batch_copy_calls: c.batch_calls.load(Relaxed),
            bytes_to_device: c.bytes_to_device.load(Relaxed),
            bytes_to_host: c.bytes_to_host.load(Relaxed),
            failed_keys: c.failed_keys.load(Relaxed),
            fallbacks,
            read_phase_us: [
                c.send_us.load(Relaxed),
                c.grant_us.load(Relaxed),
                c.prestage_us.load(Relaxed),
                c.plan_us.load(Relaxed),
                c.submit_us.load(Relaxed),
                c.wait_us.load(Relaxed),
            ],
        }
    }

    /// The driver, with the arena registered (lazily, at first GPU use; timed and logged).
    fn transport(&self, engine: &Engine) -> Result<Arc<CudaTransport>> {
        let transport = CudaTransport::get()?;
        let mut attempted = self.registration.lock().unwrap_or_else(|p| p.into_inner());
        if !*attempted {
            *attempted = true;
            let registered = transport
                .registrar()
                .map_err(|e| e.to_string())
                .and_then(|registrar| engine.arena.register_with(&registrar).map_err(|e| e.to_string()));
            match registered {
                Ok(elapsed) => {
                    self.counters.registered.store(1, Relaxed);
                    self.counters.registration_us.store(elapsed.as_micros() as u64, Relaxed);
                    tracing::info!(
                        dram_bytes = engine.arena.len_bytes(),
                        slices = engine.arena.slice_count(),
                        elapsed_ms = elapsed.as_millis() as u64,
                        "DRAM arena registered with CUDA (cuMemHostRegister per slice)"
                    );
                }
                // Copies still work from unregistered memory (the driver stages them), slower.
                Err(e) => tracing::warn!(error = %e, "could not register the DRAM arena with CUDA"),
            }
        }
        Ok(transport)
    }

    fn record(&self, summary: &Summary, direction: Direction) {
        self.counters.record(summary, direction);
    }

    /// Runs `transfers` and waits for them by polling their events. The caller keeps the host
    /// bytes leased (or reserved) until this returns. One result per transfer. The transfers
    /// are freed once submitted, while the GPU works, rather than after it finished.
    fn execute(
        &self,
        transport: &Result<Arc<CudaTransport>>,
        direction: Direction,
        transfers: Vec<Transfer>,
        timing: Option<Timing>,
        prestaged: Option<Prestaged>,
    ) -> Vec<Result<()>> {
        let planned_at = Instant::now();
        if transfers.is_empty() {
            return Vec::new();
        }
        let results = match transport {
            Err(e) => transfers.iter().map(|t| cpu_only(t, direction).ok_or_else(|| e.clone())).collect(),
            Ok(transport) => {
                // SAFETY: every transfer's host bytes are leased or reserved by our caller until
                // we return, and we return only after `wait` saw every event fire (or drained the
                // streams after a failure). Every device page was checked with
                // cuPointerGetAttributes, and the caller's `Region::from_raw` contract keeps it
                // valid for the call.
                // A prestage, if any, copied these transfers' objects (still leased) into the
                // staging buffer only.
                let submitted = unsafe { submit_with(transport, direction, &transfers, self.policy, prestaged) };
                let count = transfers.len();
                drop(transfers);
                match submitted {
                    Ok(inflight) => {
                        let submitted_at = Instant::now();
                        let summary = inflight.summary().clone();
                        let results: Vec<Result<()>> =
                            inflight.wait().into_iter().map(|r| r.map_err(Error::from)).collect();
                        self.record(&summary, direction);
                        if let Some(t) = timing {
                            let us = |a: Instant, b: Instant| b.saturating_duration_since(a).as_micros() as u64;
                            let c = &self.counters;
                            c.send_us.fetch_add(us(t.started, t.sent_at), Relaxed);
                            c.grant_us.fetch_add(us(t.sent_at, t.granted_at), Relaxed);
                            c.prestage_us.fetch_add(us(t.granted_at, t.prestaged_at), Relaxed);
                            c.plan_us.fetch_add(us(t.prestaged_at, planned_at), Relaxed);
                            c.submit_us.fetch_add(us(planned_at, submitted_at), Relaxed);
                            c.wait_us.fetch_add(us(submitted_at, Instant::now()), Relaxed);
                        }
                        results
                    }
                    Err(e) => vec![Err(Error::from(e)); count],
                }
            }
        };
        let failed = results.iter().filter(|r| r.is_err()).count() as u64;
        self.counters.failed_keys.fetch_add(failed, Relaxed);
        results
    }
}

/// Copies a transfer with no device piece on the CPU (when CUDA is unavailable); None if it has
/// device pieces.
fn cpu_only(transfer: &Transfer, direction: Direction) -> Option<()> {
    if transfer.pieces.iter().any(|p| !p.kind.is_host()) {
        return None;
    }
    // SAFETY: the host bytes are leased or reserved by the caller and every piece is caller
    // host memory lent for the call; they do not overlap.
    unsafe { copy_host_pieces(transfer, direction) };
    Some(())
}

/// Checks regions before anything is submitted: host ones as the host paths do, device ones
/// against their GPU (one `cuPointerGetAttributes` per allocation, in a single pass). `lists[i]`
/// are the regions of owner i (a key, or a buffer); `writable` for destinations. Returns the
/// first error of each owner (None: all good).
fn check_regions(
    transport: &Result<Arc<CudaTransport>>,
    lists: &[&[Region<'_>]],
    writable: bool,
) -> Vec<Option<Error>> {
    let mut checkers: Vec<(u32, Result<RangeChecker>)> = Vec::new();
    let checker_of = |checkers: &mut Vec<(u32, Result<RangeChecker>)>, ordinal: u32| -> usize {
        match checkers.iter().position(|(o, _)| *o == ordinal) {
            Some(i) => i,
            None => {
                let checker = transport
                    .as_ref()
                    .map_err(Clone::clone)
                    .and_then(|t| t.device(ordinal).map(|d| d.range_checker()).map_err(Error::from));
                checkers.push((ordinal, checker));
                checkers.len() - 1
            }
        }
    };
    let mut out: Vec<Option<Error>> = vec![None; lists.len()];
    let mut ordinals: Vec<u32> = Vec::new();
    for (owner, regions) in lists.iter().enumerate() {
        if writable {
            if let Some(e) = regions.iter().find_map(|r| r.check_writable().err()) {
                out[owner] = Some(e.into());
                continue;
            }
        }
        // The GPUs this list names (one, nearly always).
        ordinals.clear();
        for r in regions.iter() {
            if let MemoryKind::Device { ordinal } = r.kind() {
                if !ordinals.contains(&ordinal) {
                    ordinals.push(ordinal);
                }
            }
        }
        for &ordinal in &ordinals {
            let slot = checker_of(&mut checkers, ordinal);
            let failed = match &mut checkers[slot].1 {
                Ok(checker) => checker.check_list(regions).map(Error::from),
                Err(e) => Some(e.clone()),
            };
            if let Some(e) = failed {
                out[owner].get_or_insert(e);
                break;
            }
        }
    }
    out
}

/// The pieces of `regions` laid end to end over an object.
fn pieces_in_order(regions: &[Region<'_>]) -> Vec<Piece> {
    let mut offset = 0;
    regions
        .iter()
        .map(|r| {
            let piece = Piece { host_offset: offset, addr: r.addr(), len: r.len() as u64, kind: r.kind() };
            offset += r.len() as u64;
            piece
        })
        .collect()
}

/// `get_into` to a device region.
pub(super) fn get_into(engine: &Engine, key: &[u8], dst: Region<'_>) -> Result<usize> {
    engine.validate_key(key)?;
    let _awake = KeepAwake::new(engine);
    let transport = engine.gpu.transport(engine);
    if let Some(e) = check_regions(&transport, &[std::slice::from_ref(&dst)], true).pop().flatten() {
        return Err(e);
    }
    let (mut grants, _leases) = engine.lease_many(std::iter::once((0, key)));
    let grant = grants.remove(&0).ok_or(Error::Internal("no grant"))??;
    if (dst.len() as u64) < grant.len {
        return Err(Error::BufferTooSmall { object_bytes: grant.len, buffer_bytes: dst.len() as u64 });
    }
    let transfer = Transfer {
        host: grant.ptr.as_ptr() as u64,
        host_len: grant.len,
        pieces: vec![Piece { host_offset: 0, addr: dst.addr(), len: grant.len, kind: dst.kind() }],
    };
    let result = engine.gpu.execute(&transport, Direction::HostToDevice, vec![transfer], None, None).pop();
    result.unwrap_or(Err(Error::Internal("no transfer result"))).map(|()| grant.len as usize)
}

/// `batch_get_into_multi_buffers` with device destinations.
///
/// Ordered so the bytes start moving early: only the keys are validated before the lease
/// requests go out, and as soon as the grants are in, the objects' bulk copies into the engine's
/// private staging buffer start (`prestage`), in arena order so neighbours merge into few large
/// copies. Only then, while those copies move, is every destination page checked (lengths,
/// `cuPointerGetAttributes`) and the request qualified and planned: work that grows with the
/// page count never delays the first byte. Nothing is submitted to a destination before every
/// check passed; a request that does not qualify (or a key that fails its check) discards the
/// staged bytes and is planned afresh.
pub(super) fn batch_get(engine: &Engine, keys: &[&[u8]], dsts: &[Vec<Region<'_>>]) -> Vec<Result<usize>> {
    read_to_device(engine, keys, dsts, false)
}

/// `batch_get`; `regions_checked` when the caller already checked every region
/// (`check_destinations`), so they are not checked again.
fn read_to_device(
    engine: &Engine,
    keys: &[&[u8]],
    dsts: &[Vec<Region<'_>>],
    regions_checked: bool,
) -> Vec<Result<usize>> {
    let started = Instant::now();
    let _awake = KeepAwake::new(engine);
    let mut results: Vec<Result<usize>> = (0..keys.len()).map(|_| pending()).collect();
    let transport = engine.gpu.transport(engine);
    let mut valid = Vec::with_capacity(keys.len());
    for (i, key) in keys.iter().enumerate() {
        match engine.validate_key(key) {
            Ok(()) => valid.push((i, *key)),
            Err(e) => results[i] = Err(e),
        }
    }
    let pending_leases = engine.send_leases(valid.iter().copied());
    let sent_at = Instant::now();
    // While the shards lease, per key (not per page): the GPU of its first region, to guess the
    // one GPU a staged request needs (the checks below confirm it), and its page count.
    let mut gpu_guess: Option<Option<u32>> = None;
    let mut pieces_total = 0usize;
    for &(i, _) in &valid {
        let gpu = match dsts[i].first().map(Region::kind) {
            Some(MemoryKind::Device { ordinal }) => Some(ordinal),
            _ => None,
        };
        if *gpu_guess.get_or_insert(gpu) != gpu {
            gpu_guess = Some(None);
        }
        pieces_total += dsts[i].len();
    }
    let (grants, _leases) = pending_leases.wait();
    let granted_at = Instant::now();
    // Granted objects in arena order: the transfers keep this order, so a fill's objects are
    // neighbours in host memory and its bulk copies merge.
    let mut owners: Vec<(usize, ReadGrant)> = Vec::with_capacity(grants.len());
    let mut by_key: Vec<Option<Result<ReadGrant>>> = (0..keys.len()).map(|_| None).collect();
    for (i, grant) in grants {
        if let Ok(grant) = &grant {
            owners.push((i, *grant));
        }
        by_key[i] = Some(grant);
    }
    owners.sort_unstable_by_key(|(_, g)| g.ptr.as_ptr() as u64);
    let prestaged = match (&transport, gpu_guess.flatten()) {
        (Ok(transport), Some(ordinal)) if engine.gpu.policy.enabled && owners.len() < pieces_total => {
            let objects: Vec<(u64, u64)> = owners.iter().map(|(_, g)| (g.ptr.as_ptr() as u64, g.len)).collect();
            // SAFETY: the objects stay leased (`_leases`) until `execute` returned, which is
            // after the prestage was continued and completed, or dropped (which waits for its
            // copies). The copies write only the engine's staging buffer, no destination.
            unsafe { prestage(transport, ordinal, &objects, engine.gpu.policy) }
        }
        _ => None,
    };
    let prestaged_at = Instant::now();
    // The destinations are checked and the pieces laid out while the first bytes move into
    // the staging buffer.
    let checks = if regions_checked {
        vec![None; keys.len()]
    } else {
        let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
        check_regions(&transport, &lists, true)
    };
    let mut passed = vec![false; keys.len()];
    for (i, grant) in by_key.into_iter().enumerate() {
        match grant {
            None => {}
            Some(Err(e)) => results[i] = Err(e),
            Some(Ok(grant)) => {
                let checked = match &checks[i] {
                    Some(e) => Err(e.clone()),
                    None => total_len(&dsts[i]),
                };
                match checked {
                    Ok(bytes) if bytes == grant.len => passed[i] = true,
                    Ok(bytes) => {
                        results[i] = Err(Error::SizeMismatch { object_bytes: grant.len, destination_bytes: bytes })
                    }
                    Err(e) => results[i] = Err(e),
                }
            }
        }
    }
    // The transfers of the keys that passed every check, in arena order.
    let mut transfers = Vec::with_capacity(owners.len());
    let mut delivered = Vec::with_capacity(owners.len());
    for (i, grant) in owners {
        if !passed[i] {
            continue;
        }
        transfers.push(Transfer {
            host: grant.ptr.as_ptr() as u64,
            host_len: grant.len,
            pieces: pieces_in_order(&dsts[i]),
        });
        delivered.push((i, grant.len as usize));
    }
    // Freed now, while the copies run, not after the GPU finished.
    drop(checks);
    let timing = Timing { started, sent_at, granted_at, prestaged_at };
    for ((i, len), result) in delivered.into_iter().zip(engine.gpu.execute(
        &transport,
        Direction::HostToDevice,
        transfers,
        Some(timing),
        prestaged,
    )) {
        results[i] = result.map(|()| len);
    }
    results
}

/// `batch_get` for the keys at `which` (indices into `keys` and `dsts`), whose regions
/// `check_destinations` already checked; results by index.
pub(super) fn batch_get_some(
    engine: &Engine,
    keys: &[&[u8]],
    dsts: &[Vec<Region<'_>>],
    which: &[usize],
) -> Vec<(usize, Result<usize>)> {
    let some_keys: Vec<&[u8]> = which.iter().map(|&i| keys[i]).collect();
    let some_dsts: Vec<Vec<Region<'_>>> = which.iter().map(|&i| dsts[i].clone()).collect();
    which.iter().copied().zip(read_to_device(engine, &some_keys, &some_dsts, true)).collect()
}

/// Checks the destinations of the keys marked in `which` on their GPUs (host regions in those
/// lists as the host paths do); None for the others and for keys that passed.
pub(super) fn check_destinations(engine: &Engine, dsts: &[Vec<Region<'_>>], which: &[bool]) -> Vec<Option<Error>> {
    let transport = engine.gpu.transport(engine);
    let lists: Vec<&[Region<'_>]> = dsts.iter().zip(which).map(|(d, &w)| if w { d.as_slice() } else { &[] }).collect();
    check_regions(&transport, &lists, true)
}

/// Copies leased objects to their destinations (already checked by `check_destinations`) in
/// one GPU submission, staged when the request qualifies, and waits for it: the caller's leases
/// may go once this returns. Results by index.
pub(super) fn deliver_leased(
    engine: &Engine,
    items: &[(usize, ReadGrant)],
    dsts: &[Vec<Region<'_>>],
) -> Vec<(usize, Result<usize>)> {
    if items.is_empty() {
        return Vec::new();
    }
    let _awake = KeepAwake::new(engine);
    let transport = engine.gpu.transport(engine);
    let mut sorted: Vec<(usize, ReadGrant)> = items.to_vec();
    sorted.sort_unstable_by_key(|(_, g)| g.ptr.as_ptr() as u64);
    let mut out = Vec::with_capacity(items.len());
    let mut transfers = Vec::with_capacity(items.len());
    let mut delivered = Vec::with_capacity(items.len());
    for (i, grant) in sorted {
        match total_len(&dsts[i]) {
            Ok(bytes) if bytes == grant.len => {
                transfers.push(Transfer {
                    host: grant.ptr.as_ptr() as u64,
                    host_len: grant.len,
                    pieces: pieces_in_order(&dsts[i]),
                });
                delivered.push((i, grant.len as usize));
            }
            Ok(bytes) => out.push((i, Err(Error::SizeMismatch { object_bytes: grant.len, destination_bytes: bytes }))),
            Err(e) => out.push((i, Err(e))),
        }
    }
    let outcomes = engine.gpu.execute(&transport, Direction::HostToDevice, transfers, None, None);
    out.extend(delivered.into_iter().zip(outcomes).map(|((i, len), r)| (i, r.map(|()| len))));
    out
}

/// `get_into_ranges` when some buffer is device memory: fragments are grouped per key into one
/// transfer, so a key's failure fails all of its fragments.
pub(super) fn get_into_ranges(
    engine: &Engine,
    buffers: &[Region<'_>],
    fragments: &[Vec<Fragment>],
) -> Vec<Vec<Result<usize>>> {
    let _awake = KeepAwake::new(engine);
    let mut results: Vec<Vec<Result<usize>>> =
        fragments.iter().map(|f| (0..f.len()).map(|_| pending()).collect()).collect();
    let transport = engine.gpu.transport(engine);
    let buffer_lists: Vec<&[Region<'_>]> = buffers.iter().map(std::slice::from_ref).collect();
    let buffer_checks = check_regions(&transport, &buffer_lists, true);
    let (keys, todo) =
        engine.group_fragments(buffers, fragments, &mut results, |b, _| buffer_checks[b].clone().map_or(Ok(()), Err));
    let (grants, _leases) = engine.lease_many(keys.iter().copied().enumerate());
    // One transfer per leased key, holding the fragments whose source range fits the object.
    let mut transfer_of: HashMap<usize, usize> = HashMap::new();
    let mut transfers: Vec<Transfer> = Vec::new();
    let mut members: Vec<Vec<(usize, usize)>> = Vec::new();
    for (b, f, k) in todo {
        let frag = &fragments[b][f];
        let grant = match grants.get(&k) {
            Some(Ok(grant)) => grant,
            Some(Err(e)) => {
                results[b][f] = Err(e.clone());
                continue;
            }
            None => {
                results[b][f] = Err(Error::Internal("fragment key was not leased"));
                continue;
            }
        };
        if let Err(e) = kvtide_transport::region::check_range("object", frag.src_offset, frag.len, grant.len) {
            results[b][f] = Err(e.into());
            continue;
        }
        let t = *transfer_of.entry(k).or_insert_with(|| {
            transfers.push(Transfer { host: grant.ptr.as_ptr() as u64, host_len: grant.len, pieces: Vec::new() });
            members.push(Vec::new());
            transfers.len() - 1
        });
        let buffer = &buffers[b];
        transfers[t].pieces.push(Piece {
            host_offset: frag.src_offset,
            addr: buffer.addr() + frag.dst_offset,
            len: frag.len,
            kind: buffer.kind(),
        });
        members[t].push((b, f));
    }
    let outcomes = engine.gpu.execute(&transport, Direction::HostToDevice, transfers, None, None);
    for (owners, outcome) in members.into_iter().zip(outcomes) {
        for (b, f) in owners {
            results[b][f] = outcome.clone().map(|()| fragments[b][f].len as usize);
        }
    }
    results
}

/// `batch_put_from_multi_buffers` with device sources (gathered writes).
pub(super) fn batch_put(
    engine: &Engine,
    keys: &[&[u8]],
    sources: &[Vec<Region<'_>>],
    opts: PutOptions,
) -> Vec<Result<()>> {
    let _awake = KeepAwake::new(engine);
    let mut results: Vec<Result<()>> = vec![Ok(()); keys.len()];
    let transport = engine.gpu.transport(engine);
    let mut items = Vec::with_capacity(keys.len());
    for (i, (key, srcs)) in keys.iter().zip(sources).enumerate() {
        let checked = engine
            .validate_key(key)
            .and_then(|()| total_len(srcs))
            .and_then(|len| engine.validate_value_len(len).map(|()| len));
        match checked {
            Ok(len) => items.push((i, *key, len)),
            Err(e) => results[i] = Err(e),
        }
    }
    // The source pages are checked while the shards reserve; a key that fails its check is
    // never copied, so its reservation is aborted below.
    let lists: Vec<&[Region<'_>]> = sources.iter().map(Vec::as_slice).collect();
    let mut checks = Vec::new();
    let (grants, reservations) = engine.reserve_many_overlapped(items.into_iter(), opts.upsert, || {
        checks = check_regions(&transport, &lists, false);
    });
    for (i, check) in checks.into_iter().enumerate() {
        if let Some(e) = check {
            if results[i].is_ok() {
                results[i] = Err(e);
            }
        }
    }
    // In arena order, so a fill's objects are neighbours in host memory and its copies merge.
    let mut granted = Vec::with_capacity(grants.len());
    for (i, grant) in grants {
        match grant {
            // A key that failed its source check is never copied: aborted with the reservations.
            Ok(_) if results[i].is_err() => {}
            Ok(grant) => granted.push((i, grant)),
            Err(e) => results[i] = Err(e),
        }
    }
    granted.sort_unstable_by_key(|(_, g)| g.ptr.as_ptr() as u64);
    let mut transfers = Vec::with_capacity(granted.len());
    let mut owners = Vec::with_capacity(granted.len());
    for (i, grant) in granted {
        transfers.push(Transfer {
            host: grant.ptr.as_ptr() as u64,
            host_len: grant.len,
            pieces: pieces_in_order(&sources[i]),
        });
        owners.push(i);
    }
    let mut copied = vec![false; keys.len()];
    for (i, outcome) in
        owners.into_iter().zip(engine.gpu.execute(&transport, Direction::DeviceToHost, transfers, None, None))
    {
        match outcome {
            Ok(()) => copied[i] = true,
            Err(e) => results[i] = Err(e),
        }
    }
    // Only keys whose bytes all arrived are published; the rest are aborted when the
    // reservations drop (after the copies completed or were drained).
    for (i, result) in reservations.commit(opts, |i| copied[i]) {
        results[i] = result;
    }
    results
}

/// Async `submit_batch_get` with device destinations: checks every key's regions now, on the
/// calling thread, before anything is submitted (device pointers against their GPU, host ones
/// as the host paths do). Returns each key's first error (None: good) and, when the transport is
/// available, the copier the shard tasks submit with (copies on engine-owned streams, completion
/// polled through CUDA events by the shard loop). Without CUDA the device keys get
/// `CudaUnavailable`.
pub(super) fn ticket_checks(
    engine: &Engine,
    dsts: &[Vec<Region<'static>>],
) -> (Vec<Option<Error>>, Option<crate::shard::task::GpuCopier>) {
    let transport = engine.gpu.transport(engine);
    let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
    let checks = check_regions(&transport, &lists, true);
    let copier = transport.ok().map(|transport| {
        let counters = Arc::clone(&engine.gpu.counters);
        crate::shard::task::GpuCopier {
            transport,
            policy: engine.gpu.policy,
            report: Arc::new(move |summary: Option<&Summary>, failed: u64| {
                if let Some(summary) = summary {
                    counters.record(summary, Direction::HostToDevice);
                }
                counters.failed_keys.fetch_add(failed, Relaxed);
            }),
        }
    });
    (checks, copier)
}
