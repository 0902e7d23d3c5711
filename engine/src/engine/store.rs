//! The `Store` API of the embedded engine, over the one read and one write path.
//!
//! Owns the translation of each call's arguments into read slots or write items (and their
//! per-call checks: one list per key, fragments naming real buffers), the async ticket
//! submission, and the calls that need no bytes moved (exists, remove, pin, stats). It never
//! moves bytes itself except `get`'s copy into the vector it returns.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvtide_tiers::dram::PageBacking;
use kvtide_transport::Region;

use super::batch_get::{BatchGetItem, BatchGetTask};
use super::read::{KeyRead, ReadTargets, Want};
use super::transports::Route;
use super::Engine;
use crate::api::{Fragment, KeyPage, PutOptions, Store, MAX_SCAN_KEYS};
use crate::checks::{self, total_len};
use crate::error::{Error, Result};
use crate::shard::Request;
use crate::stats::Stats;
use crate::ticket::{pending, BatchCollector, Ticket};

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
        self.write(keys, sources, opts)
    }

    fn put_from(&self, key: &[u8], sources: &[Region<'_>], opts: PutOptions) -> Result<()> {
        let _span = tracing::trace_span!("put").entered();
        if let Some(done) = self.write_one_host(key, sources, opts) {
            return done;
        }
        self.write(&[key], &[sources.to_vec()], opts)
            .pop()
            .unwrap_or(Err(Error::Internal("no result for a single put")))
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
            kvtide_transport::memcpy::copy_bytes(out.as_mut_ptr(), grant.ptr.as_ptr(), len);
            out.set_len(len);
        }
        Ok(out)
    }

    fn get_into(&self, key: &[u8], dst: Region<'_>) -> Result<usize> {
        let _span = tracing::trace_span!("get_into").entered();
        if let Some(done) = self.read_one_published(key, &dst, Want::Prefix) {
            return done;
        }
        let lists = [std::slice::from_ref(&dst)];
        let mut targets = ReadTargets::new(self, &lists, None);
        let slots = [KeyRead { key, list: 0, want: Want::Prefix }];
        self.read(&mut targets, &slots).pop().unwrap_or(Err(Error::Internal("no read result")))
    }

    fn batch_get_into(&self, keys: &[&[u8]], dsts: &[Region<'_>]) -> Vec<Result<usize>> {
        let _span = tracing::trace_span!("batch_get_into", keys = keys.len()).entered();
        if let Err(e) = checks::one_list_per_key(keys.len(), dsts.len(), "destination") {
            return vec![Err(e); keys.len()];
        }
        let lists: Vec<Vec<Region<'_>>> = dsts.iter().map(|d| vec![*d]).collect();
        self.batch_read(keys, &lists, Want::Prefix)
    }

    fn batch_get_into_multi_buffers(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>]) -> Vec<Result<usize>> {
        let _span = tracing::trace_span!("batch_get", keys = keys.len()).entered();
        if let Err(e) = checks::one_list_per_key(keys.len(), dsts.len(), "destination") {
            return vec![Err(e); keys.len()];
        }
        self.batch_read(keys, dsts, Want::Whole)
    }

    fn get_into_ranges(&self, buffers: &[Region<'_>], fragments: &[Vec<Fragment>]) -> Vec<Vec<Result<usize>>> {
        let _span = tracing::trace_span!("get_into_ranges", buffers = buffers.len()).entered();
        let mut results: Vec<Vec<Result<usize>>> =
            fragments.iter().map(|f| (0..f.len()).map(|_| pending()).collect()).collect();
        let lists: Vec<&[Region<'_>]> = buffers.iter().map(std::slice::from_ref).collect();
        let mut slots = Vec::new();
        let mut placed = Vec::new();
        for (b, frags) in fragments.iter().enumerate() {
            for (f, frag) in frags.iter().enumerate() {
                if b >= buffers.len() {
                    results[b][f] = Err(Error::InvalidArgument(format!(
                        "fragments for buffer {b} but only {} buffers",
                        buffers.len()
                    )));
                    continue;
                }
                let want = Want::Range { src_offset: frag.src_offset, dst_offset: frag.dst_offset, len: frag.len };
                slots.push(KeyRead { key: &frag.key, list: b, want });
                placed.push((b, f));
            }
        }
        let mut targets = ReadTargets::new(self, &lists, None);
        for ((b, f), result) in placed.into_iter().zip(self.read(&mut targets, &slots)) {
            results[b][f] = result;
        }
        results
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool>> {
        let _span = tracing::trace_span!("batch_exists", keys = keys.len()).entered();
        let mut results: Vec<Result<bool>> = vec![Ok(false); keys.len()];
        let mut valid = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match self.validate_key(key) {
                Ok(()) => valid.push((i, *key, ())),
                Err(e) => results[i] = Err(e),
            }
        }
        self.fan_out(valid, |items, reply| Request::Exists {
            keys: items.into_iter().map(|(k, ())| k).collect(),
            reply,
        })
        .gather(self, |i, _, found| results[i] = found);
        results
    }

    fn scan_keys(&self, prefix: &[u8], cursor: u64, limit: usize) -> Result<KeyPage> {
        if prefix.len() > self.config.max_key_bytes {
            return Err(Error::TooLarge {
                what: "prefix",
                len: prefix.len() as u64,
                max: self.config.max_key_bytes as u64,
            });
        }
        // The cursor is (shard, object slot); one shard request per page bounds the call.
        let (mut shard, from) = ((cursor >> 32) as usize, cursor as u32);
        if shard >= self.shard_count() {
            return Err(Error::InvalidArgument(format!("scan cursor {cursor:#x} names no shard")));
        }
        let limit = limit.clamp(1, MAX_SCAN_KEYS);
        let (keys, next) = self.call(shard, |reply| Request::ScanKeys { prefix: prefix.into(), from, limit, reply })?;
        let cursor = match next {
            Some(slot) => Some(((shard as u64) << 32) | u64::from(slot)),
            None => {
                shard += 1;
                (shard < self.shard_count()).then_some((shard as u64) << 32)
            }
        };
        Ok(KeyPage { keys: keys.into_iter().map(Vec::from).collect(), cursor })
    }

    fn remove(&self, key: &[u8], force: bool) -> Result<()> {
        self.validate_key(key)?;
        self.call(self.shard_of(key), |reply| Request::Remove { key: key.into(), force, reply })?
    }

    fn batch_remove(&self, keys: &[&[u8]], force: bool) -> Vec<Result<()>> {
        // Every request goes out before the first reply is awaited, so the shards work on them
        // together.
        let sent: Vec<Result<_>> = keys
            .iter()
            .map(|key| {
                self.validate_key(key)?;
                self.send_with_reply(self.shard_of(key), |reply| Request::Remove { key: (*key).into(), force, reply })
            })
            .collect();
        sent.into_iter().map(|rx| rx.and_then(|rx| self.recv_reply(&rx)).and_then(|r| r)).collect()
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
        stats.restore = self.restore_stats();
        stats.gpu = self.gpu.stats();
        stats.stream = self.streams.snapshot();
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
        // Every destination is checked now, before anything is submitted; the shard tasks then
        // deliver through the same transports.
        let lists: Vec<&[Region<'static>]> = dsts.iter().map(Vec::as_slice).collect();
        let routes: Vec<Route> = lists.iter().map(|l| Route::of(l)).collect();
        let transports = self.transports(&routes, None);
        let region_checks = self.check_lists(&transports, &lists, &routes, true);
        let mut results: Vec<Result<usize>> = (0..keys.len()).map(|_| pending()).collect();
        let mut per_shard: Vec<Vec<BatchGetItem>> = (0..self.shards.len()).map(|_| Vec::new()).collect();
        for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
            let checked = self
                .validate_key(key)
                .and_then(|()| region_checks[i].clone().map_or(Ok(()), Err))
                .and_then(|()| total_len(&regions));
            match checked {
                Ok(_) => per_shard[self.shard_of(key)].push(BatchGetItem {
                    result_index: i,
                    key: (*key).into(),
                    dsts: regions,
                    route: routes[i],
                }),
                Err(e) => results[i] = Err(e),
            }
        }
        let parts = per_shard.iter().filter(|items| !items.is_empty()).count();
        let (ticket, cell, cancel) = Ticket::new();
        let collector = BatchCollector::new(results, parts, cell, Arc::clone(&self.tickets_in_flight));
        for (shard, items) in per_shard.into_iter().enumerate().filter(|(_, items)| !items.is_empty()) {
            let indices: Vec<usize> = items.iter().map(|item| item.result_index).collect();
            let task = BatchGetTask::new(
                items,
                Arc::clone(&cancel),
                Arc::clone(&collector),
                transports.clone(),
                Arc::clone(self.gpu.counters()),
            );
            if self.send(shard, Request::Task(Box::new(task))).is_err() {
                collector.complete_part(indices.into_iter().map(|i| (i, Err(Error::ShuttingDown))).collect());
            }
        }
        Ok(ticket)
    }
}

impl Engine {
    /// A batch read of `want` of each object into its list (one list per key, checked by the
    /// caller): batches that may touch the SSD are restored in pipelined sub-batches.
    fn batch_read(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>], want: Want) -> Vec<Result<usize>> {
        // A key with no destination asks for its size: the pipeline answers that from where the
        // key lives, without loading it from SSD.
        let probe = dsts.iter().any(Vec::is_empty);
        if self.config.ssd.is_some() && self.config.restore_pipeline && (keys.len() > 1 || probe) {
            return self.restore_batch_wanting(keys, dsts, &self.restore_options(), want).results;
        }
        let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
        let mut targets = ReadTargets::new(self, &lists, None);
        let slots: Vec<KeyRead<'_>> = keys.iter().enumerate().map(|(i, key)| KeyRead { key, list: i, want }).collect();
        self.read(&mut targets, &slots)
    }
}
