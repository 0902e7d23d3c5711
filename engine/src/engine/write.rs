//! The write path: reserve -> check -> deliver -> commit, for every memory kind.
//!
//! Owns gathered writes (`put_from`, `batch_put_from_multi_buffers`): each key's sources are
//! laid end to end into a reservation of exactly their total length, through the transport of
//! their route. Only keys whose every byte arrived are published; the others' reservations are
//! aborted once no transfer can touch them any more. It never publishes a partly written
//! object.

use std::time::Instant;

use kvtide_transport::{Direction, Region, Transfer};

use super::transports::{KeepAwake, Route};
use super::Engine;
use crate::api::PutOptions;
use crate::checks::total_len;
use crate::error::{Error, Result};

impl Engine {
    /// Writes each key's value from its sources (`sources[i]` for `keys[i]`); one result per key.
    pub(crate) fn write(&self, keys: &[&[u8]], sources: &[Vec<Region<'_>>], opts: PutOptions) -> Vec<Result<()>> {
        let lists: Vec<&[Region<'_>]> = sources.iter().map(Vec::as_slice).collect();
        let routes: Vec<Route> = lists.iter().map(|l| Route::of(l)).collect();
        // Phase clocks for writes from GPU memory only (`stats().gpu.write_phase_us`).
        let timed = routes.contains(&Route::Gpu);
        let clock = || timed.then(Instant::now);
        let started = clock();
        let transports = self.transports(&routes, None);
        let _awake = KeepAwake::new(self, &routes);
        let mut results: Vec<Result<()>> = vec![Ok(()); keys.len()];
        let mut items = Vec::with_capacity(keys.len());
        for (i, (key, srcs)) in keys.iter().zip(sources).enumerate() {
            let checked = self
                .validate_key(key)
                .and_then(|()| total_len(srcs))
                .and_then(|len| self.validate_value_len(len).map(|()| len));
            match checked {
                Ok(len) => items.push((i, *key, len)),
                Err(e) => results[i] = Err(e),
            }
        }
        // The sources are checked while the shards reserve; a key that fails its check is never
        // copied, so its reservation is aborted below.
        let mut checks = Vec::new();
        let (grants, reservations) = self.reserve_many(items, opts.upsert, || {
            checks = self.check_lists(&transports, &lists, &routes, false);
        });
        let reserved_at = clock();
        for (i, check) in checks.into_iter().enumerate() {
            if let (Some(e), Ok(())) = (check, &results[i]) {
                results[i] = Err(e);
            }
        }
        // Per route, in arena order (a staging transport's fills then hold neighbours).
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
        let routed_at = clock();
        let mut inflight = Vec::new();
        for route in Route::ALL {
            let mut batch = std::mem::take(&mut by_route[route as usize]);
            if batch.is_empty() {
                continue;
            }
            batch.sort_unstable_by_key(|(host, _, _)| *host);
            let (owners, transfers): (Vec<usize>, Vec<Transfer>) = batch.into_iter().map(|(_, i, t)| (i, t)).unzip();
            // SAFETY: every transfer's host bytes are our reservations (exclusive until commit or
            // abort, both after the submission completed: `wait` below, and `reservations` drops
            // after it). Every source list passed its transport's check and the caller lends it
            // for the call.
            let submitted = unsafe { transports.get(route).submit(Direction::DeviceToHost, &transfers, None) };
            inflight.push((route, owners, submitted));
        }
        let submitted_at = clock();
        let mut copied = vec![false; keys.len()];
        for (route, owners, submitted) in inflight {
            let (outcomes, summary) = match submitted {
                Ok(inflight) => {
                    let summary = inflight.summary();
                    (inflight.wait().into_iter().map(|r| r.map_err(Error::from)).collect::<Vec<_>>(), Some(summary))
                }
                Err(e) => (vec![Err(Error::from(e)); owners.len()], None),
            };
            if route == Route::Gpu {
                let failed = outcomes.iter().filter(|r| r.is_err()).count() as u64;
                self.gpu.counters().record(summary.as_ref(), Direction::DeviceToHost, failed);
            }
            for (i, outcome) in owners.into_iter().zip(outcomes) {
                match outcome {
                    Ok(()) => copied[i] = true,
                    Err(e) => results[i] = Err(e),
                }
            }
        }
        let copied_at = clock();
        // Only keys whose bytes all arrived are published; the rest are aborted when the
        // reservations drop.
        for (i, result) in reservations.commit(opts, |i| copied[i]) {
            results[i] = result;
        }
        if let (Some(a), Some(b), Some(c), Some(d), Some(e)) =
            (started, reserved_at, routed_at, submitted_at, copied_at)
        {
            self.gpu.counters().record_write([a, b, c, d, e, Instant::now()]);
        }
        results
    }
}
