//! The write path: reserve -> check -> deliver -> commit, for every memory kind.
//!
//! Owns gathered writes (`put_from`, `batch_put_from_multi_buffers`): each key's sources are
//! laid end to end into a reservation of exactly their total length, through the transport of
//! their route. A write from GPU memory goes in parts (`parts`): the next part's keys
//! are reserved, their sources checked and their transfers built while the last part's copies
//! run, and keys are committed as their copies land while later ones still copy. Only keys
//! whose every byte arrived are published; the others' reservations are aborted once no
//! transfer can touch them any more. It never publishes a partly written object.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide_transport::{Direction, Parts, PartsHint, Region, Transfer, Transport};

use super::parts::PartCutter;
use super::router::ByIndex;
use super::transports::{KeepAwake, Route, Transports};
use super::{Engine, Reservations};
use crate::api::PutOptions;
use crate::checks::total_len;
use crate::error::{Error, Result};
use crate::shard::WriteGrant;

impl Engine {
    /// `batch_put_from_multi_buffers` with `gpu` in place of the store's GPU transport (tests
    /// drive GPU writes with a simulated device).
    #[doc(hidden)]
    pub fn batch_put_from_via(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
        gpu: Arc<dyn Transport>,
    ) -> Vec<Result<()>> {
        if let Err(e) = crate::checks::one_list_per_key(keys.len(), sources.len(), "source") {
            return vec![Err(e); keys.len()];
        }
        self.write_via(keys, sources, opts, Some(gpu))
    }

    /// Writes one key from host memory: reserve, copy on this thread, commit, with none of a
    /// batch's bookkeeping, and on the shard's lent core (`shard::lend`, no message or reply
    /// channel) while the shard is idle. None for GPU sources (the general path's).
    pub(crate) fn write_one_host(&self, key: &[u8], sources: &[Region<'_>], opts: PutOptions) -> Option<Result<()>> {
        if Route::of(sources) != Route::Host {
            return None;
        }
        Some(self.write_one_checked(key, sources, opts))
    }

    fn write_one_checked(&self, key: &[u8], sources: &[Region<'_>], opts: PutOptions) -> Result<()> {
        // The general path's checks, in its order.
        self.validate_key(key)?;
        let len = total_len(sources)?;
        self.validate_value_len(len)?;
        if let Some(e) = kvtide_transport::memcpy::check_host_list(sources, false) {
            return Err(e.into());
        }
        // Aborted if the copy fails (or unwinds).
        let (grant, reservation) = self.reserve_one(key, len, opts.upsert)?;
        let transfer = Transfer::in_order(grant.ptr.as_ptr() as u64, grant.len, sources);
        // SAFETY: the host bytes are the reservation's (exclusive until its commit or abort,
        // both after this copy, which is done when it returns); the sources passed the host
        // check and the caller lends them for the call.
        unsafe { kvtide_transport::memcpy::copy_transfer(&transfer, Direction::DeviceToHost) }?;
        reservation.commit(opts)
    }

    /// Writes each key's value from its sources (`sources[i]` for `keys[i]`); one result per key.
    pub(crate) fn write(&self, keys: &[&[u8]], sources: &[Vec<Region<'_>>], opts: PutOptions) -> Vec<Result<()>> {
        self.write_via(keys, sources, opts, None)
    }

    fn write_via(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
        gpu: Option<Arc<dyn Transport>>,
    ) -> Vec<Result<()>> {
        let lists: Vec<&[Region<'_>]> = sources.iter().map(Vec::as_slice).collect();
        let routes: Vec<Route> = lists.iter().map(|l| Route::of(l)).collect();
        // Phase clocks for writes from GPU memory only (`stats().gpu.write_phase_us`).
        let timed = routes.contains(&Route::Gpu);
        let mut phases = PhaseClock::new(timed);
        let transports = self.transports_via(&routes, None, gpu);
        let _awake = KeepAwake::new(self, &routes);
        let mut results: Vec<Result<()>> = vec![Ok(()); keys.len()];
        // Parts only help when every copy is asynchronous: CPU copies finish as they are
        // submitted, and one part then costs the fewest round trips to the shards.
        let all_gpu = !keys.is_empty() && routes.iter().all(|r| *r == Route::Gpu);
        let mut cursor = PartCursor::new(all_gpu && !transports.get(Route::Gpu).completes_inline());
        // Declared before the submissions, so they drop after them: a submission dropped
        // unfinished (a panic) waits for its copies before the reservations are aborted.
        let mut reservations = None;
        // One submission per route, opened at its first part; the keys of its transfers, in order.
        let mut submissions: Vec<Option<RouteSubmission<'_>>> = Route::ALL.iter().map(|_| None).collect();
        while cursor.next < keys.len() {
            let part = self.cut_part(keys, &lists, &mut cursor, &mut results);
            if part.is_empty() {
                continue;
            }
            // The sources are checked while the shards reserve; a key that fails its check is
            // never copied, so its reservation is aborted with the others that did not land.
            let part_lists: Vec<&[Region<'_>]> = part.iter().map(|(i, _, _)| lists[*i]).collect();
            let part_routes: Vec<Route> = part.iter().map(|(i, _, _)| routes[*i]).collect();
            let mut checks = Vec::new();
            let (grants, reserved) = self.reserve_many(part.iter().copied(), opts.upsert, || {
                checks = self.check_lists(&transports, &part_lists, &part_routes, false);
            });
            match reservations.as_mut() {
                None => reservations = Some(reserved),
                Some(all) => all.absorb(reserved),
            }
            for ((i, _, _), check) in part.iter().zip(checks) {
                if let (Some(e), Ok(())) = (check, &results[*i]) {
                    results[*i] = Err(e);
                }
            }
            phases.lap(0);
            let by_route = transfers_by_route(grants, &lists, &routes, &mut results);
            phases.lap(1);
            // The write's size is estimated from its first object (KV blocks are all alike); a
            // wrong estimate only shapes the parts differently.
            let hint = |route: Route| PartsHint {
                bytes: cursor.estimate(keys.len()),
                pieces: (0..keys.len()).filter(|&i| routes[i] == route).map(|i| lists[i].len()).sum(),
            };
            submit_by_route(&transports, by_route, &mut submissions, hint);
            phases.lap(2);
            phases.submitted();
        }
        let settled = commit_as_landed(&mut submissions, reservations.as_mut(), opts, &mut results, &mut phases);
        self.finish_submissions(&mut submissions, &settled);
        // Keys whose copies failed are aborted when the reservations drop.
        drop(reservations);
        phases.lap(4);
        if let Some((spent, first_part)) = phases.spent() {
            self.gpu.counters().record_write(spent, first_part);
        }
        results
    }

    /// Checks keys from `cursor` on until the cutter ends the part; the checked ones are the
    /// part, the others get their error in `results`. Keys are checked part by part, as their
    /// part is cut: one pass over a large write's region lists costs as long as its first
    /// copies, so none is made up front.
    fn cut_part<'k>(
        &self,
        keys: &[&'k [u8]],
        lists: &[&[Region<'_>]],
        cursor: &mut PartCursor,
        results: &mut [Result<()>],
    ) -> Vec<PartItem<'k>> {
        let mut part: Vec<PartItem<'k>> = Vec::new();
        let mut bytes = 0u64;
        while cursor.next < keys.len() {
            let i = cursor.next;
            cursor.next += 1;
            let checked = self
                .validate_key(keys[i])
                .and_then(|()| total_len(lists[i]))
                .and_then(|len| self.validate_value_len(len).map(|()| len));
            let len = match checked {
                Ok(len) => len,
                Err(e) => {
                    results[i] = Err(e);
                    continue;
                }
            };
            part.push((i, keys[i], len));
            bytes += len;
            if cursor.cut(len, bytes, keys.len()) {
                break;
            }
        }
        part
    }

    /// Waits for every route's submission to finish and counts the GPU's copies.
    fn finish_submissions(&self, submissions: &mut [Option<RouteSubmission<'_>>], settled: &[usize; Route::ALL.len()]) {
        for route in Route::ALL {
            let Some((submission, keys_of)) = submissions[route as usize].take() else { continue };
            let inflight = submission.finish();
            let summary = inflight.summary();
            let outcomes = inflight.wait();
            if route == Route::Gpu {
                let failed = outcomes.iter().filter(|r| r.is_err()).count() as u64;
                self.gpu.counters().record(Some(&summary), Direction::DeviceToHost, failed);
            }
            // Every transfer settled before, with the result `finish` reports.
            debug_assert_eq!(settled[route as usize], keys_of.len());
        }
    }
}

/// One checked key of a part: its index in the call, the key and its value's length.
type PartItem<'k> = (usize, &'k [u8], u64);

/// Where a gathered write is in cutting its keys into parts.
struct PartCursor {
    /// The next key to check.
    next: usize,
    checked_bytes: u64,
    checked_keys: u64,
    /// The first checked object's length, from which the write's size is estimated.
    first_len: u64,
    split: bool,
    cutter: Option<PartCutter>,
}

impl PartCursor {
    fn new(split: bool) -> PartCursor {
        PartCursor { next: 0, checked_bytes: 0, checked_keys: 0, first_len: 0, split, cutter: None }
    }

    /// The write's estimated size: its first object's length times its keys.
    fn estimate(&self, keys: usize) -> u64 {
        self.first_len.saturating_mul(keys as u64)
    }

    /// Counts a checked key of `len` bytes (the part now holds `part_bytes`); true when the
    /// part ends with it.
    fn cut(&mut self, len: u64, part_bytes: u64, keys: usize) -> bool {
        self.checked_bytes += len;
        self.checked_keys += 1;
        if self.cutter.is_none() {
            self.first_len = len;
        }
        let estimate = self.estimate(keys);
        let split = self.split;
        let left = (keys - self.next) as u64 * (self.checked_bytes / self.checked_keys);
        self.cutter.get_or_insert_with(|| PartCutter::new(split, estimate)).cut(part_bytes, left)
    }
}

/// A part's transfers per route, in arena order (a staging transport's fills then hold
/// neighbours): (host address, key index, transfer). A key whose grant failed gets its error.
fn transfers_by_route(
    grants: ByIndex<Result<WriteGrant>>,
    lists: &[&[Region<'_>]],
    routes: &[Route],
    results: &mut [Result<()>],
) -> Vec<Vec<(u64, usize, Transfer)>> {
    let mut by_route: Vec<Vec<(u64, usize, Transfer)>> = Route::ALL.iter().map(|_| Vec::new()).collect();
    for (i, grant) in grants {
        match grant {
            // A key that failed its source check is never copied: aborted with the reservations.
            Ok(_) if results[i].is_err() => {}
            Ok(grant) => {
                let host = grant.ptr.as_ptr() as u64;
                by_route[routes[i] as usize].push((host, i, Transfer::in_order(host, grant.len, lists[i])));
            }
            Err(e) => results[i] = Err(e),
        }
    }
    for batch in &mut by_route {
        batch.sort_unstable_by_key(|(host, _, _)| *host);
    }
    by_route
}

/// Pushes a part's transfers into each route's submission, opening it at its first part.
fn submit_by_route<'t>(
    transports: &'t Transports,
    by_route: Vec<Vec<(u64, usize, Transfer)>>,
    submissions: &mut [Option<RouteSubmission<'t>>],
    hint: impl Fn(Route) -> PartsHint,
) {
    for (route, batch) in Route::ALL.into_iter().zip(by_route) {
        if batch.is_empty() {
            continue;
        }
        let (owners, transfers): (Vec<usize>, Vec<Transfer>) = batch.into_iter().map(|(_, i, t)| (i, t)).unzip();
        let (submission, keys_of) = submissions[route as usize].get_or_insert_with(|| {
            (transports.get(route).submit_parts(Direction::DeviceToHost, hint(route)), Vec::new())
        });
        // SAFETY: every transfer's host bytes are the write's reservations (exclusive until
        // commit or abort, both after the submission completed: `finish_submissions`, and the
        // reservations drop after the submissions). Every source list passed its transport's
        // check and the caller lends it for the call.
        unsafe { submission.push(&transfers) };
        keys_of.extend(owners);
    }
}

/// Commits keys whose every byte landed while later copies still run, so only the last
/// copies' keys are committed after the last copy. Returns how many transfers of each route
/// settled (all of them).
fn commit_as_landed(
    submissions: &mut [Option<RouteSubmission<'_>>],
    mut reservations: Option<&mut Reservations<'_>>,
    opts: PutOptions,
    results: &mut [Result<()>],
    phases: &mut PhaseClock,
) -> [usize; Route::ALL.len()] {
    let mut settled = [0usize; Route::ALL.len()];
    let mut waiting_since = Instant::now();
    loop {
        let mut landed: Vec<usize> = Vec::new();
        let mut in_flight = false;
        for route in Route::ALL {
            let Some((submission, keys_of)) = submissions[route as usize].as_mut() else { continue };
            let done = &mut settled[route as usize];
            for outcome in submission.take_settled() {
                let Some(&i) = keys_of.get(*done) else { break };
                *done += 1;
                match outcome {
                    Ok(()) => landed.push(i),
                    Err(e) => results[i] = Err(Error::from(e)),
                }
            }
            in_flight |= *done < keys_of.len();
        }
        if !in_flight {
            phases.lap(3);
        }
        if let (false, Some(reservations)) = (landed.is_empty(), reservations.as_deref_mut()) {
            landed.sort_unstable();
            for (i, result) in reservations.commit(opts, |i| landed.binary_search(&i).is_ok()) {
                results[i] = result;
            }
            waiting_since = Instant::now();
        }
        if !in_flight {
            return settled;
        }
        if waiting_since.elapsed() < SPIN_BEFORE_YIELD {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// How long a write waiting for its copies spins after its last commit before it yields.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(50);

/// A route's submission in parts, and the keys of its transfers in push order.
type RouteSubmission<'t> = (Box<dyn Parts + 't>, Vec<usize>);

/// Time a write spent in each phase, over all its parts, and until its first part was
/// submitted (GPU writes only).
struct PhaseClock {
    started: Option<Instant>,
    last: Option<Instant>,
    spent: [Duration; 5],
    first_part: Option<Duration>,
}

impl PhaseClock {
    fn new(timed: bool) -> PhaseClock {
        let now = timed.then(Instant::now);
        PhaseClock { started: now, last: now, spent: [Duration::ZERO; 5], first_part: None }
    }

    /// Marks the first part's submission (later calls change nothing).
    fn submitted(&mut self) {
        if let (Some(started), None) = (self.started, self.first_part) {
            self.first_part = Some(started.elapsed());
        }
    }

    /// Charges the time since the last lap to `phase`.
    fn lap(&mut self, phase: usize) {
        if let Some(last) = self.last {
            let now = Instant::now();
            self.spent[phase] += now - last;
            self.last = Some(now);
        }
    }

    fn spent(&self) -> Option<([Duration; 5], Duration)> {
        self.last.map(|_| (self.spent, self.first_part.unwrap_or_default()))
    }
}
