//! The read path: lease -> plan -> deliver -> release, for every read and every memory kind.
//!
//! Owns what a read wants of each object (`Want`: the whole object across regions, the whole
//! object into the start of a buffer, or a byte range of it), the planning of those wants into
//! transfers (sizes checked, pieces laid out, GPU transfers in arena order), their delivery
//! through the transports of their routes (host slots of the store's own memcpy are copied as
//! they are planned), the leasing in parts of a read whose first bytes move before its
//! destinations are checked (the early start begins after the first part), and the rounds that
//! let a batch larger than DRAM through. Every blocking read, the restore pipeline's
//! sub-batches and the async tickets plan with the same function. It never reports a slot as
//! done before every one of its bytes arrived, and never releases a lease before the transfers
//! that read it completed.
//!
//! `get_into_ranges` semantics, the same for host and GPU buffers: each fragment is checked on
//! its own (a bad range fails that fragment only); the fragments of one key into buffers of one
//! kind of memory are delivered as one transfer under one lease, so a transport failure fails
//! that key's fragments together.

use std::collections::HashMap;
use std::time::Instant;

use kvtide_transport::{Direction, EarlyStart, MemoryKind, Piece, Region, Transfer};

use super::gpu::Timing;
use super::key_index::KeyIndex;
use super::router::{by_index, ByIndex};
use super::transports::{KeepAwake, Route, Transports};
use super::{parallel, Engine, LeaseSet};
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
pub(crate) struct KeyRead<'k> {
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
struct RouteTransfers {
    transfers: Vec<Transfer>,
    owners: Vec<(usize, usize, usize)>,
}

impl RouteTransfers {
    /// Puts the transfers in arena order within each leasing part (`part_of_slot`, the part of
    /// each slot; empty: one part), their owners following.
    fn sort_for_staging(&mut self, part_of_slot: &[u32]) {
        // Without parts every transfer is in part 0 (no table).
        let mut part_of = Vec::new();
        if !part_of_slot.is_empty() {
            part_of.resize(self.transfers.len(), 0u32);
            for &(t, s, _) in &self.owners {
                part_of[t] = part_of_slot.get(s).copied().unwrap_or(0);
            }
        }
        let transfers = &self.transfers;
        let key = |t: usize| (part_of.get(t).copied().unwrap_or(0), transfers[t].host);
        if (1..transfers.len()).all(|t| key(t - 1) <= key(t)) {
            return;
        }
        let mut order: Vec<usize> = (0..transfers.len()).collect();
        order.sort_unstable_by_key(|&t| key(t));
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

/// Keys a read leased in parts leases before its first copies start; each later part is
/// `LEASE_PART_GROWTH` times the one before, so it is leased while the parts before it copy.
const FIRST_LEASE_PART_KEYS: usize = 32;
const LEASE_PART_GROWTH: usize = 4;

/// Where the parts of a round of `keys` leases end: one part below two first parts' worth.
fn lease_part_ends(keys: usize) -> Vec<usize> {
    if keys < 2 * FIRST_LEASE_PART_KEYS {
        return vec![keys];
    }
    let mut ends = Vec::new();
    let (mut end, mut size) = (0usize, FIRST_LEASE_PART_KEYS);
    while end < keys {
        end = end.saturating_add(size).min(keys);
        ends.push(end);
        size = size.saturating_mul(LEASE_PART_GROWTH);
    }
    ends
}

/// The GPU memory a read may start moving bytes towards before its destinations are checked:
/// every GPU slot wants a whole object, they all name one GPU, and their destinations are
/// fragmented (the reads a staging transport stages). None otherwise.
fn early_target(targets: &ReadTargets<'_, '_>, slots: &[KeyRead<'_>]) -> Option<MemoryKind> {
    let mut target: Option<MemoryKind> = None;
    let (mut objects, mut pieces) = (0usize, 0usize);
    for slot in slots {
        if targets.routes[slot.list] != Route::Gpu {
            continue;
        }
        if slot.want != Want::Whole {
            return None;
        }
        let regions = targets.lists[slot.list];
        let kind = regions.first()?.kind();
        if *target.get_or_insert(kind) != kind {
            return None;
        }
        objects += 1;
        pieces += regions.len();
    }
    target.filter(|_| pieces > objects)
}

/// What `Engine::lease_early` needs of a read: its destinations and slots, its keys and the
/// slot of each (one per key: reads that start early share no leases), and the GPU it reads to.
struct PartedRead<'p, 'a, 'r, 'k> {
    targets: &'p ReadTargets<'a, 'r>,
    slots: &'p [KeyRead<'k>],
    keys: &'p [&'k [u8]],
    slot_of_key: &'p [usize],
    target: MemoryKind,
}

/// One round's leases: the grants by key index, the leases that hold them, the early start of
/// a read leased in parts, and when the (first part's) leases were sent and granted.
struct LeaseRound<'e> {
    grants: ByIndex<Result<ReadGrant>>,
    leases: Vec<LeaseSet<'e>>,
    early: Option<EarlyStart>,
    sent_at: Option<Instant>,
    granted_at: Option<Instant>,
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
    pub(crate) fn read(&self, targets: &mut ReadTargets<'_, '_>, slots: &[KeyRead<'_>]) -> Vec<Result<usize>> {
        // Phase times are kept for GPU reads only (the clock costs a host read of 4 KiB a tenth).
        let gpu = targets.routes.contains(&Route::Gpu);
        let now = || gpu.then(Instant::now);
        let started = now();
        let _awake = KeepAwake::new(self, &targets.routes);
        let mut results: Vec<Result<usize>> = (0..slots.len()).map(|_| pending()).collect();
        // Range slots of one key share its lease (and its transfer); other slots lease on their
        // own, which costs no hashing on the batch reads' hot path.
        let share = slots.iter().any(|slot| matches!(slot.want, Want::Range { .. }));
        let mut key_index = KeyIndex::with_capacity(if share { slots.len() } else { 0 });
        let mut keys: Vec<&[u8]> = Vec::with_capacity(if share { 0 } else { slots.len() });
        let mut key_of_slot: Vec<usize> = vec![usize::MAX; slots.len()];
        // Without sharing, each key has one slot.
        let mut slot_of_key: Vec<usize> = Vec::with_capacity(if share { 0 } else { slots.len() });
        for (s, slot) in slots.iter().enumerate() {
            if let Err(e) = self.validate_key(slot.key) {
                results[s] = Err(e);
                continue;
            }
            key_of_slot[s] = if share {
                key_index.index_of(slot.key).0
            } else {
                keys.push(slot.key);
                slot_of_key.push(s);
                keys.len() - 1
            };
        }
        if share {
            keys = key_index.into_keys();
        }
        // A read whose first bytes may start moving before its destinations are checked leases
        // its first round in parts, each added to the early start as it is granted.
        let early_target = if share { None } else { early_target(targets, slots) };
        let mut part_of_slot: Vec<u32> = Vec::new();
        let mut remaining: Vec<usize> = (0..keys.len()).collect();
        let mut first_round = true;
        while !remaining.is_empty() {
            let round = match early_target.filter(|_| first_round) {
                Some(target) => {
                    let parted = PartedRead { targets, slots, keys: &keys, slot_of_key: &slot_of_key, target };
                    self.lease_early(&parted, &remaining, &mut part_of_slot, gpu)
                }
                None => {
                    let pending_leases = self.send_leases(remaining.iter().map(|&k| (k, keys[k])));
                    let sent_at = now();
                    let (grants, leases) = pending_leases.wait();
                    LeaseRound { grants, leases: vec![leases], early: None, sent_at, granted_at: now() }
                }
            };
            let LeaseRound { grants, leases, early, sent_at, granted_at } = round;
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
            let order = if early.is_some() { part_of_slot.as_slice() } else { &[] };
            let delivered = self.deliver(targets, slots, &grant_of, (early, order), &mut results, timing.as_mut());
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

    /// Leases the keys `remaining` names in parts (`lease_part_ends`) and starts moving the
    /// first part's objects towards the GPU before the next part is leased; each later part is
    /// added to that early start, its objects after the earlier parts' (each part's in arena
    /// order). `part_of_slot` gets each slot's part, the order `deliver` then submits in. The
    /// rest goes in one part once there is no early start (refused, or nothing of the first
    /// part for the GPU) or once a part needed messages to its shards (each part would be a
    /// round trip).
    fn lease_early<'e>(
        &'e self,
        read: &PartedRead<'_, '_, '_, '_>,
        remaining: &[usize],
        part_of_slot: &mut Vec<u32>,
        clock: bool,
    ) -> LeaseRound<'e> {
        let now = || clock.then(Instant::now);
        let transport = read.targets.transports.get(Route::Gpu);
        let mut round = LeaseRound {
            grants: by_index(remaining.len()),
            leases: Vec::new(),
            early: None,
            sent_at: None,
            granted_at: None,
        };
        part_of_slot.clear();
        part_of_slot.resize(read.slots.len(), 0);
        let mut objects: Vec<(u64, u64)> = Vec::new();
        let mut from = 0;
        let mut by_message = false;
        for (part, end) in lease_part_ends(remaining.len()).into_iter().enumerate() {
            let end = if part > 0 && (round.early.is_none() || by_message) { remaining.len() } else { end };
            if end <= from {
                break;
            }
            let pending = self.send_leases(remaining[from..end].iter().map(|&k| (k, read.keys[k])));
            by_message |= pending.by_message();
            if part == 0 {
                round.sent_at = now();
            }
            let (grants, leases) = pending.wait();
            round.leases.push(leases);
            objects.clear();
            for (k, grant) in grants {
                let s = read.slot_of_key[k];
                part_of_slot[s] = part as u32;
                if let (Route::Gpu, Ok(grant)) = (read.targets.routes[read.slots[s].list], &grant) {
                    objects.push((grant.ptr.as_ptr() as u64, grant.len));
                }
                round.grants.insert(k, grant);
            }
            objects.sort_unstable();
            if part == 0 {
                round.granted_at = now();
                if !objects.is_empty() {
                    // The fills are shaped for the whole read: its bytes, estimated from the
                    // first part's.
                    let first: u64 = objects.iter().map(|&(_, len)| len).sum();
                    let total = u128::from(first) * remaining.len() as u128 / end as u128;
                    let total = u64::try_from(total).unwrap_or(u64::MAX);
                    // SAFETY: the objects stay leased (`round.leases`) until `deliver` returned,
                    // which is after the early start was continued and completed, or dropped
                    // (which waits for its copies). An early start writes only the transport's
                    // own staging memory, never a destination.
                    round.early = unsafe { transport.start_early(&objects, read.target, total) };
                }
            } else if let Some(early) = round.early.as_mut() {
                // SAFETY: as for the first part; these objects are leased by `round.leases` too.
                if !objects.is_empty() && !unsafe { transport.extend_early(early, &objects) } {
                    // It matches no submission any more: discarded now (its copies waited for).
                    round.early = None;
                }
            }
            from = end;
        }
        round
    }

    /// The pieces of every GPU slot that is planned on its own (granted, its destination
    /// checked, not a range), by slot, planned over a few threads when the read is large: the
    /// per-page work a staged read's first scatter waits for. Empty without GPU slots.
    #[allow(clippy::type_complexity)]
    fn plan_gpu_slots(
        targets: &ReadTargets<'_, '_>,
        slots: &[KeyRead<'_>],
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
        let planned = parallel::map_chunks(
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
        slots: &[KeyRead<'_>],
        grant_of: &[Option<&Result<ReadGrant>>],
        (mut early, part_of_slot): (Option<EarlyStart>, &[u32]),
        results: &mut [Result<usize>],
        timing: Option<&mut Timing>,
    ) -> usize {
        targets.check_now(self);
        let checks = targets.checks.as_deref().unwrap_or(&[]);
        let mut planned: Vec<RouteTransfers> = Route::ALL.iter().map(|_| RouteTransfers::default()).collect();
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
        // Arena order for GPU memory, by leasing part when the read was leased in parts (the
        // order its early start has): a staging transport's fills then hold neighbours and its
        // copies merge. Host copies go in any order.
        planned[Route::Gpu as usize].sort_for_staging(part_of_slot);
        let clock = timing.is_some();
        let planned_at = clock.then(Instant::now);
        // Submit every route first (the GPU works while the CPU copies), then wait.
        let mut inflight = Vec::new();
        for route in Route::ALL {
            let RouteTransfers { transfers, owners } = std::mem::take(&mut planned[route as usize]);
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use kvtide_transport::{InFlight, Summary, Transport, TransportError};

    use super::*;
    use crate::api::{PutOptions, Store};
    use crate::config::StoreBuilder;

    #[test]
    fn reads_lease_in_growing_parts_only_when_there_are_enough_keys() {
        assert_eq!(lease_part_ends(0), vec![0]);
        assert_eq!(lease_part_ends(1), vec![1]);
        assert_eq!(lease_part_ends(63), vec![63]);
        assert_eq!(lease_part_ends(64), vec![32, 64]);
        assert_eq!(lease_part_ends(200), vec![32, 160, 200]);
        assert_eq!(lease_part_ends(1536), vec![32, 160, 672, 1536]);
        let ends = lease_part_ends(1_000_000);
        assert_eq!(ends.last(), Some(&1_000_000));
        assert!(ends.windows(2).all(|w| w[0] < w[1]));
    }

    /// The objects an early start was given, part by part.
    struct EarlyLog(Vec<(u64, u64)>);

    /// A GPU transport for host memory labelled as a GPU's: it keeps its early starts as a log,
    /// counts how a submission relates to its early start, and copies on the CPU.
    #[derive(Default)]
    struct Recording {
        /// The objects of each `start_early` or `extend_early` call.
        parts: Mutex<Vec<Vec<(u64, u64)>>>,
        /// Submissions whose transfers were their early start's objects, in order; and those
        /// that came with an early start they did not match.
        matched: Mutex<(usize, usize)>,
    }

    impl Transport for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }

        fn completes_inline(&self) -> bool {
            true
        }

        fn check(&self, lists: &[&[Region<'_>]], _writable: bool) -> Vec<Option<TransportError>> {
            vec![None; lists.len()]
        }

        unsafe fn start_early(&self, objects: &[(u64, u64)], _: MemoryKind, total_bytes: u64) -> Option<EarlyStart> {
            assert!(total_bytes >= objects.iter().map(|o| o.1).sum::<u64>());
            self.parts.lock().expect("parts").push(objects.to_vec());
            Some(EarlyStart::new(Box::new(EarlyLog(objects.to_vec()))))
        }

        unsafe fn extend_early(&self, early: &mut EarlyStart, objects: &[(u64, u64)]) -> bool {
            self.parts.lock().expect("parts").push(objects.to_vec());
            early.get_mut::<EarlyLog>().expect("our early start").0.extend_from_slice(objects);
            true
        }

        unsafe fn submit(
            &self,
            _: Direction,
            transfers: &[Transfer],
            early: Option<EarlyStart>,
        ) -> std::result::Result<InFlight, TransportError> {
            if let Some(log) = early.and_then(EarlyStart::take::<EarlyLog>) {
                let named: Vec<(u64, u64)> = transfers.iter().map(|t| (t.host, t.span().end)).collect();
                let mut matched = self.matched.lock().expect("matched");
                if named == log.0 {
                    matched.0 += 1;
                } else {
                    matched.1 += 1;
                }
            }
            for transfer in transfers {
                for piece in &transfer.pieces {
                    // SAFETY: the "GPU" pages are the test's host buffers; the object is leased.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (transfer.host + piece.host_offset) as *const u8,
                            piece.addr as *mut u8,
                            piece.len as usize,
                        )
                    };
                }
            }
            Ok(InFlight::completed(vec![Ok(()); transfers.len()], Summary::default()))
        }
    }

    /// A staged GPU read of 200 keys leases them in three parts, starts early with the first and
    /// adds the others, and submits its transfers in the early start's order; the bytes land in
    /// their pages, missing keys fail alone, and every lease goes back.
    #[test]
    fn a_read_leased_in_parts_submits_in_its_early_starts_order() {
        let store = StoreBuilder::new().dram_bytes(64 << 20).shards(2).pin_threads(false).open().expect("open store");
        const KEYS: usize = 200;
        const PAGE: usize = 2048;
        let names: Vec<Vec<u8>> = (0..KEYS).map(|i| format!("parted-{i}").into_bytes()).collect();
        let value = |i: usize| -> Vec<u8> { (0..2 * PAGE).map(|b| (i * 7 + b * 13) as u8).collect() };
        // Missing: one key of the first part and one of the last.
        let missing = [5, 190];
        for (i, name) in names.iter().enumerate().filter(|(i, _)| !missing.contains(i)) {
            store.put(name, &value(i), PutOptions::default()).expect("put");
        }
        // Two pages per object, the pages of all objects interleaved backwards over one pool.
        let mut pool = vec![0u8; KEYS * 2 * PAGE];
        let base = pool.as_mut_ptr() as u64;
        let page = |i: usize, half: usize| base + (((KEYS - 1 - i) * 2 + (1 - half)) * PAGE) as u64;
        let gpu = MemoryKind::Device { ordinal: 0 };
        let lists: Vec<Vec<Region<'static>>> = (0..KEYS)
            // SAFETY: each page lies inside `pool`, which outlives the read.
            .map(|i| (0..2).map(|h| unsafe { Region::from_raw(page(i, h), PAGE, gpu) }).collect())
            .collect();
        let list_refs: Vec<&[Region<'_>]> = lists.iter().map(Vec::as_slice).collect();
        let slots: Vec<KeyRead<'_>> =
            names.iter().enumerate().map(|(i, key)| KeyRead { key, list: i, want: Want::Whole }).collect();
        let recording = Arc::new(Recording::default());
        let routes = vec![Route::Gpu; KEYS];
        let transports = store.transports_via(&routes, None, Some(Arc::clone(&recording) as Arc<dyn Transport>));
        let mut targets = ReadTargets { lists: &list_refs, routes, transports, checks: None };
        let results = store.read(&mut targets, &slots);
        drop(targets);
        for (i, result) in results.iter().enumerate() {
            if missing.contains(&i) {
                assert!(matches!(result, Err(Error::NotFound)), "key {i}: {result:?}");
                continue;
            }
            assert_eq!(result.as_ref().ok(), Some(&(2 * PAGE)), "key {i}");
            let want = value(i);
            for h in 0..2 {
                let at = (page(i, h) - base) as usize;
                assert_eq!(&pool[at..at + PAGE], &want[h * PAGE..(h + 1) * PAGE], "key {i} page {h}");
            }
        }
        let parts = recording.parts.lock().expect("parts").clone();
        assert_eq!(parts.iter().map(Vec::len).collect::<Vec<_>>(), vec![31, 128, 39]);
        assert!(parts.iter().all(|part| part.is_sorted()));
        assert_eq!(*recording.matched.lock().expect("matched"), (1, 0));
        store.sync_shards().expect("sync");
        assert!(store.stats().held_resources().is_zero());
    }
}
