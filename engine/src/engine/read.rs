//! The read path: lease -> plan -> deliver -> release, for every read and every memory kind.
//!
//! Owns what a read wants of each object (`Want`: the whole object across regions, the whole
//! object into the start of a buffer, or a byte range of it), the planning of those wants into
//! transfers (sizes checked, pieces laid out, GPU transfers in arena order), their delivery
//! through the transports of their routes (host slots of the store's own memcpy are copied as
//! they are planned), and the rounds that let a batch larger than DRAM through. Every
//! blocking read, the restore pipeline's sub-batches and the async tickets plan with the same
//! function. It never reports a slot as done before every one of its bytes arrived, and never
//! releases a lease before the transfers that read it completed.
//!
//! `get_into_ranges` semantics, the same for host and GPU buffers: each fragment is checked on
//! its own (a bad range fails that fragment only); the fragments of one key into buffers of one
//! kind of memory are delivered as one transfer under one lease, so a transport failure fails
//! that key's fragments together.

use std::collections::HashMap;
use std::time::Instant;

use kvtide_transport::{Direction, EarlyStart, MemoryKind, Piece, Region, Transfer};
use xxhash_rust::xxh3::Xxh3Builder;

use super::gpu::Timing;
use super::transports::{KeepAwake, Route, Transports};
use super::{fanout, Engine};
use crate::checks::total_len;
use crate::error::{Error, Result};
use crate::shard::ReadGrant;
use crate::ticket::pending;

/// What a result slot wants of its object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    /// The whole object across the list's regions in order; their lengths must add up to it.
    Whole,
    /// The whole object into the start of the list's one region, which may be longer.
    Prefix,
    /// `len` bytes at `src_offset` of the object into the list's one region at `dst_offset`.
    Range { src_offset: u64, dst_offset: u64, len: u64 },
}

/// One result of a read: a key, the destination list it reads into, and what it wants.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot<'k> {
    pub(crate) key: &'k [u8],
    pub(crate) list: usize,
    pub(crate) want: Want,
}

/// The pieces that deliver `want` of an object of `object_len` bytes into `regions`, and the
/// bytes the slot reports; the slot's error when the sizes do not fit.
pub(crate) fn plan_pieces(object_len: u64, regions: &[Region<'_>], want: Want) -> Result<(Vec<Piece>, usize)> {
    let mut pieces = Vec::new();
    plan_pieces_into(object_len, regions, want, &mut pieces).map(|reported| (pieces, reported))
}

/// Whether `want` of an object of `object_len` bytes fits `regions` (`plan_pieces`' size checks,
/// which a range read makes against the object in hand).
pub(crate) fn check_fits(object_len: u64, regions: &[Region<'_>], want: Want) -> Result<()> {
    match want {
        Want::Whole => {
            let bytes = total_len(regions)?;
            if bytes != object_len {
                return Err(Error::SizeMismatch { object_bytes: object_len, destination_bytes: bytes });
            }
        }
        Want::Prefix => {
            let region = regions.first().ok_or(Error::Internal("a prefix read without a region"))?;
            if (region.len() as u64) < object_len {
                return Err(Error::BufferTooSmall { object_bytes: object_len, buffer_bytes: region.len() as u64 });
            }
        }
        Want::Range { .. } => {}
    }
    Ok(())
}

/// `plan_pieces` into `pieces` (cleared first), for callers that reuse one list.
pub(crate) fn plan_pieces_into(
    object_len: u64,
    regions: &[Region<'_>],
    want: Want,
    pieces: &mut Vec<Piece>,
) -> Result<usize> {
    pieces.clear();
    check_fits(object_len, regions, want)?;
    match want {
        Want::Whole => {
            pieces.extend(Transfer::pieces_in_order(regions));
            Ok(object_len as usize)
        }
        Want::Prefix => {
            let region = regions.first().ok_or(Error::Internal("a prefix read without a region"))?;
            pieces.push(Piece { host_offset: 0, addr: region.addr(), len: object_len, kind: region.kind() });
            Ok(object_len as usize)
        }
        Want::Range { src_offset, dst_offset, len } => {
            let region = regions.first().ok_or(Error::Internal("a range read without a region"))?;
            kvtide_transport::region::check_range("object", src_offset, len, object_len)?;
            region.check_range(dst_offset, len)?;
            pieces.push(Piece { host_offset: src_offset, addr: region.addr() + dst_offset, len, kind: region.kind() });
            Ok(len as usize)
        }
    }
}

/// Plans `want` of a leased object into host `regions` (reusing `pieces`) and copies it on this
/// thread: the bytes the slot reports, or its error.
///
/// # Safety
/// The object must stay leased until this returns; `regions` must have passed the host check
/// and stay valid for the call (`Region::from_raw`'s contract for raw ones).
unsafe fn copy_planned(
    grant: &ReadGrant,
    regions: &[Region<'_>],
    want: Want,
    pieces: &mut Vec<Piece>,
) -> Result<usize> {
    let reported = plan_pieces_into(grant.len, regions, want, pieces)?;
    // SAFETY: the caller's contract; a CPU copy is done when it returns.
    unsafe {
        kvtide_transport::memcpy::copy_pieces(grant.ptr.as_ptr() as u64, grant.len, pieces, Direction::HostToDevice)
    }?;
    Ok(reported)
}

/// A read's destinations, their routes and transports, and the result of checking them.
pub(crate) struct ReadTargets<'a, 'r> {
    pub(crate) lists: &'a [&'a [Region<'r>]],
    pub(crate) routes: Vec<Route>,
    pub(crate) transports: Transports,
    /// Each list's first error (None: passed). Checked once, before the first transfer.
    checks: Option<Vec<Option<Error>>>,
}

impl<'a, 'r> ReadTargets<'a, 'r> {
    pub(crate) fn new(
        engine: &Engine,
        lists: &'a [&'a [Region<'r>]],
        host: Option<std::sync::Arc<dyn kvtide_transport::Transport>>,
    ) -> Self {
        let routes: Vec<Route> = lists.iter().map(|l| Route::of(l)).collect();
        let transports = engine.transports(&routes, host);
        ReadTargets { lists, routes, transports, checks: None }
    }

    /// Checks every list now (the restore checks before it loads anything).
    pub(crate) fn check_now(&mut self, engine: &Engine) -> &[Option<Error>] {
        if self.checks.is_none() {
            self.checks = Some(engine.check_lists(&self.transports, self.lists, &self.routes, true));
        }
        self.checks.as_deref().unwrap_or(&[])
    }
}

/// One route's transfers and the slots they deliver: (transfer, slot, bytes reported), one
/// per slot (range slots of one key share a transfer).
#[derive(Default)]
struct Planned {
    transfers: Vec<Transfer>,
    owners: Vec<(usize, usize, usize)>,
}

impl Planned {
    /// Puts the transfers in arena order, their owners following.
    fn sort_by_host(&mut self) {
        if self.transfers.is_sorted_by_key(|t| t.host) {
            return;
        }
        let mut order: Vec<usize> = (0..self.transfers.len()).collect();
        order.sort_unstable_by_key(|&t| self.transfers[t].host);
        let mut rank = vec![0; order.len()];
        let mut unsorted: Vec<Option<Transfer>> = self.transfers.drain(..).map(Some).collect();
        for (r, &t) in order.iter().enumerate() {
            rank[t] = r;
            self.transfers.extend(unsorted[t].take());
        }
        for owner in &mut self.owners {
            owner.0 = rank[owner.0];
        }
    }
}

impl Engine {
    /// Reads one key into one host region when its object is readable through the shard's
    /// published index: the checks, plan and copy of `read` (same order of errors: key,
    /// destination, object), without a batch's bookkeeping. None: go through `read`.
    pub(crate) fn read_one_published(&self, key: &[u8], dst: &Region<'_>, want: Want) -> Option<Result<usize>> {
        let regions = std::slice::from_ref(dst);
        if Route::of(regions) != Route::Host {
            return None;
        }
        if let Err(e) = self.validate_key(key) {
            return Some(Err(e));
        }
        if let Some(e) = kvtide_transport::memcpy::check_host_list(regions, true) {
            return Some(Err(e.into()));
        }
        let (grant, _lease) = match self.lease_published(key)? {
            Ok(leased) => leased,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the lease keeps the object's bytes in place until `_lease` drops, after the
        // copy; the destination passed the host check above.
        Some(unsafe { copy_planned(&grant, regions, want, &mut Vec::new()) })
    }

    /// Reads `slots` into `targets` (lease, plan, deliver, release), in rounds while a batch
    /// does not fit in DRAM at once. One result per slot.
    pub(crate) fn read(&self, targets: &mut ReadTargets<'_, '_>, slots: &[Slot<'_>]) -> Vec<Result<usize>> {
        // Phase times are kept for GPU reads only (the clock costs a host read of 4 KiB a tenth).
        let gpu = targets.routes.contains(&Route::Gpu);
        let now = || gpu.then(Instant::now);
        let started = now();
        let _awake = KeepAwake::new(self, &targets.routes);
        let mut results: Vec<Result<usize>> = (0..slots.len()).map(|_| pending()).collect();
        // Range slots of one key share its lease (and its transfer); other slots lease on their
        // own, which costs no hashing on the batch reads' hot path.
        let share = slots.iter().any(|slot| matches!(slot.want, Want::Range { .. }));
        let mut key_index: HashMap<&[u8], usize, Xxh3Builder> =
            HashMap::with_capacity_and_hasher(if share { slots.len() } else { 0 }, Xxh3Builder::new());
        let mut keys: Vec<&[u8]> = Vec::with_capacity(slots.len());
        let mut key_of_slot: Vec<usize> = vec![usize::MAX; slots.len()];
        for (s, slot) in slots.iter().enumerate() {
            if let Err(e) = self.validate_key(slot.key) {
                results[s] = Err(e);
                continue;
            }
            key_of_slot[s] = if share {
                *key_index.entry(slot.key).or_insert_with(|| {
                    keys.push(slot.key);
                    keys.len() - 1
                })
            } else {
                keys.push(slot.key);
                keys.len() - 1
            };
        }
        let mut remaining: Vec<usize> = (0..keys.len()).collect();
        let mut first_round = true;
        while !remaining.is_empty() {
            let pending_leases = self.send_leases(remaining.iter().map(|&k| (k, keys[k])));
            let sent_at = now();
            let (grants, leases) = pending_leases.wait();
            let granted_at = now();
            let mut grant_of: Vec<Option<&Result<ReadGrant>>> = vec![None; slots.len()];
            let mut in_round = vec![false; keys.len()];
            let mut retry = Vec::new();
            for &k in &remaining {
                in_round[k] = true;
                if let Some(Err(Error::NoSpace)) = grants.get(&k) {
                    retry.push(k);
                }
            }
            for (s, &k) in key_of_slot.iter().enumerate() {
                if k == usize::MAX || !in_round[k] {
                    continue;
                }
                match grants.get(&k) {
                    Some(Err(Error::NoSpace)) => {}
                    Some(grant) => grant_of[s] = Some(grant),
                    None => results[s] = Err(Error::Internal("key was not leased")),
                }
            }
            // The first bytes may start moving before the destinations are checked.
            let early = if first_round { self.start_early(targets, slots, &grant_of) } else { None };
            let mut timing = match (started, sent_at, granted_at, now()) {
                (Some(started), Some(sent_at), Some(granted_at), Some(early_at)) => Some(Timing {
                    started,
                    sent_at,
                    granted_at,
                    early_at,
                    planned_at: early_at,
                    submitted_at: early_at,
                }),
                _ => None,
            };
            let delivered = self.deliver(targets, slots, &grant_of, early, &mut results, timing.as_mut());
            drop(leases);
            if let Some(timing) = timing.filter(|_| delivered > 0 && first_round) {
                self.gpu.counters().record_timing(&timing);
            }
            first_round = false;
            if retry.is_empty() {
                break;
            }
            // Keys that did not fit beside the rest get another round once this round's leases
            // are gone, as long as rounds make progress.
            if retry.len() == remaining.len() {
                for (s, &k) in key_of_slot.iter().enumerate() {
                    if k != usize::MAX && in_round[k] && grant_of[s].is_none() {
                        results[s] = Err(Error::NoSpace);
                    }
                }
                break;
            }
            remaining = retry;
        }
        results
    }

    /// Starts moving granted whole objects towards GPU memory before the destinations are
    /// checked, when every GPU slot wants a whole object, they all name one GPU, and their
    /// destinations are fragmented (the reads a staging transport stages).
    fn start_early(
        &self,
        targets: &ReadTargets<'_, '_>,
        slots: &[Slot<'_>],
        grant_of: &[Option<&Result<ReadGrant>>],
    ) -> Option<EarlyStart> {
        let mut target: Option<MemoryKind> = None;
        let mut objects: Vec<(u64, u64)> = Vec::new();
        let mut pieces = 0usize;
        for (s, slot) in slots.iter().enumerate() {
            if targets.routes[slot.list] != Route::Gpu {
                continue;
            }
            if slot.want != Want::Whole {
                return None;
            }
            let Some(Ok(grant)) = grant_of[s] else { continue };
            let regions = targets.lists[slot.list];
            let kind = regions.first()?.kind();
            if *target.get_or_insert(kind) != kind {
                return None;
            }
            objects.push((grant.ptr.as_ptr() as u64, grant.len));
            pieces += regions.len();
        }
        if objects.is_empty() || pieces <= objects.len() {
            return None;
        }
        objects.sort_unstable();
        // SAFETY: the objects stay leased until `deliver` returned, which is after the early
        // start was continued and completed, or dropped (which waits for its copies). An early
        // start writes only the transport's own staging memory, never a destination.
        unsafe { targets.transports.get(Route::Gpu).start_early(&objects, target?) }
    }

    /// The pieces of every GPU slot that is planned on its own (granted, its destination
    /// checked, not a range), by slot, planned over a few threads when the read is large: the
    /// per-page work a staged read's first scatter waits for. Empty without GPU slots.
    #[allow(clippy::type_complexity)]
    fn plan_gpu_slots(
        targets: &ReadTargets<'_, '_>,
        slots: &[Slot<'_>],
        grant_of: &[Option<&Result<ReadGrant>>],
        checks: &[Option<Error>],
    ) -> Vec<Option<Result<(Vec<Piece>, usize)>>> {
        if !targets.routes.contains(&Route::Gpu) {
            return Vec::new();
        }
        // (slot, object length) of each such slot: plain values the threads can share.
        let jobs: Vec<(usize, u64)> = slots
            .iter()
            .enumerate()
            .filter_map(|(s, slot)| match grant_of[s] {
                Some(Ok(grant))
                    if targets.routes[slot.list] == Route::Gpu
                        && !matches!(slot.want, Want::Range { .. })
                        && !matches!(checks.get(slot.list), Some(Some(_))) =>
                {
                    Some((s, grant.len))
                }
                _ => None,
            })
            .collect();
        let lists = targets.lists;
        let planned = fanout::map_chunks(
            &jobs,
            |&(s, _)| lists[slots[s].list].len(),
            |chunk, _| chunk.iter().map(|&(s, len)| plan_pieces(len, lists[slots[s].list], slots[s].want)).collect(),
        );
        let mut by_slot: Vec<Option<Result<(Vec<Piece>, usize)>>> = (0..slots.len()).map(|_| None).collect();
        for (&(s, _), planned) in jobs.iter().zip(planned) {
            by_slot[s] = Some(planned);
        }
        by_slot
    }

    /// Plans the slots whose grant is in `grant_of` and delivers them through their routes'
    /// transports, waiting for every submission; fills their results and returns how many slots
    /// were delivered. The caller keeps the grants leased until this returns.
    pub(crate) fn deliver(
        &self,
        targets: &mut ReadTargets<'_, '_>,
        slots: &[Slot<'_>],
        grant_of: &[Option<&Result<ReadGrant>>],
        mut early: Option<EarlyStart>,
        results: &mut [Result<usize>],
        timing: Option<&mut Timing>,
    ) -> usize {
        targets.check_now(self);
        let checks = targets.checks.as_deref().unwrap_or(&[]);
        let mut planned: Vec<Planned> = Route::ALL.iter().map(|_| Planned::default()).collect();
        // Host slots copied by the store's own memcpy are copied here, as they are planned, with
        // one reused piece list: no transfer, owner list or submission per key. Not when GPU
        // slots come too: their submission goes first, so the GPU works while the CPU copies.
        let copy_here = targets.transports.host_is_memcpy() && !targets.routes.contains(&Route::Gpu);
        let mut scratch: Vec<Piece> = Vec::new();
        let mut prepared = Self::plan_gpu_slots(targets, slots, grant_of, checks);
        let mut delivered = 0;
        // Range slots of one key on one route share a transfer.
        let mut merged: HashMap<(&[u8], Route), usize> = HashMap::new();
        for (s, slot) in slots.iter().enumerate() {
            let Some(grant) = grant_of[s] else { continue };
            // A slot's error is the first of: its key, its destination, its object.
            if let Some(Some(e)) = checks.get(slot.list) {
                results[s] = Err(e.clone());
                continue;
            }
            let grant = match grant {
                Ok(grant) => grant,
                Err(e) => {
                    results[s] = Err(e.clone());
                    continue;
                }
            };
            let route = targets.routes[slot.list];
            let host = grant.ptr.as_ptr() as u64;
            let shared = matches!(slot.want, Want::Range { .. }).then(|| (slot.key, route));
            if copy_here && route == Route::Host && shared.is_none() {
                // SAFETY: our caller keeps the object leased until we return; the destination
                // passed the host check (`targets.check_now`).
                let copied = unsafe { copy_planned(grant, targets.lists[slot.list], slot.want, &mut scratch) };
                delivered += usize::from(copied.is_ok());
                results[s] = copied;
                continue;
            }
            let prepared = match prepared.get_mut(s).and_then(Option::take) {
                Some(prepared) => prepared,
                None => plan_pieces(grant.len, targets.lists[slot.list], slot.want),
            };
            let (pieces, reported) = match prepared {
                Ok(planned) => planned,
                Err(e) => {
                    results[s] = Err(e);
                    continue;
                }
            };
            let into = &mut planned[route as usize];
            match shared.and_then(|k| merged.get(&k).copied()) {
                Some(t) => {
                    into.transfers[t].pieces.extend(pieces);
                    into.owners.push((t, s, reported));
                }
                None => {
                    if let Some(k) = shared {
                        merged.insert(k, into.transfers.len());
                    }
                    into.owners.push((into.transfers.len(), s, reported));
                    into.transfers.push(Transfer { host, host_len: grant.len, pieces });
                }
            }
        }
        // Arena order for GPU memory: a staging transport's fills then hold neighbours and its
        // copies merge. Host copies go in any order.
        planned[Route::Gpu as usize].sort_by_host();
        let clock = timing.is_some();
        let planned_at = clock.then(Instant::now);
        // Submit every route first (the GPU works while the CPU copies), then wait.
        let mut inflight = Vec::new();
        for route in Route::ALL {
            let Planned { transfers, owners } = std::mem::take(&mut planned[route as usize]);
            if transfers.is_empty() {
                continue;
            }
            let transport = targets.transports.get(route);
            let early = if route == Route::Gpu { early.take() } else { None };
            // SAFETY: every transfer's host bytes are leased by our caller until we return, and
            // we return only after each submission completed (`wait`). Every destination list
            // passed its transport's check, and the caller's regions stay valid for the call
            // (`Region::from_raw`'s contract for raw ones).
            let submitted = unsafe { transport.submit(Direction::HostToDevice, &transfers, early) };
            let count = transfers.len();
            // Freed now, while the copies run.
            drop(transfers);
            inflight.push((route, count, owners, submitted));
        }
        drop(early);
        if let (Some(t), Some(planned_at)) = (timing, planned_at) {
            t.planned_at = planned_at;
            t.submitted_at = Instant::now();
        }
        for (route, count, owners, submitted) in inflight {
            let (outcomes, summary) = match submitted {
                Ok(inflight) => {
                    let summary = inflight.summary();
                    (inflight.wait().into_iter().map(|r| r.map_err(Error::from)).collect::<Vec<_>>(), Some(summary))
                }
                Err(e) => (vec![Err(Error::from(e)); count], None),
            };
            let failed = outcomes.iter().filter(|r| r.is_err()).count() as u64;
            if route == Route::Gpu {
                self.gpu.counters().record(summary.as_ref(), Direction::HostToDevice, failed);
            }
            for (t, s, reported) in owners {
                let outcome = outcomes.get(t).cloned().unwrap_or(Err(Error::Internal("a transfer without a result")));
                delivered += usize::from(outcome.is_ok());
                results[s] = outcome.map(|()| reported);
            }
        }
        delivered
    }
}
