//! The get family: streamed gets (`Get`, `GetRanges`, `GetFollow`: `Object` and `Data`
//! frames), lease-mode gets (`Get` with leases, `GetParts`: grants of arena offsets) and the
//! parts a batch larger than DRAM is answered in.
//!
//! Owns the leases a get takes and how long they may live while their bytes are sent: a chunk
//! send starts only while its lease surely outlives it. Never hands a client an address, only
//! offsets of objects leased to that connection, and never tells a connection that cannot map
//! the arena where an object lies (its grants carry offset 0).

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::{Error as StoreError, ObjectLease, Store};

use super::connection::{Connection, Flow};
use super::reply::Reply;
use crate::error::{Error, Result};
use crate::protocol::{GetItem, Grant, GrantsPart, LenCheck, NextPart, Op, RangeItem, Request};
use crate::wire::{WResult, FLUSH_BYTES};

/// How long a follower's wait for a producer's chunk lasts before it looks again.
const FOLLOW_WAIT_MS: u64 = 100;

/// Parts of a `GetParts` answer a client may hold at once: one it copies while the owner
/// leases (loads) the next, since the owner leases one part at a time.
const PARTS_HELD: usize = 2;

impl Connection<'_> {
    /// A lease-mode `Get`: the items leased to this connection until released. On a connection
    /// with the arena mapped, the client copies from the granted ranges; elsewhere (TCP, or a
    /// Unix client without the mapping) a lease only holds the object in place (a client's hold,
    /// bounded like every lease) and its grant carries the length with offset 0: a connection
    /// that cannot map the arena learns nothing of where objects lie in it.
    pub(super) fn grant(&mut self, rid: u64, items: &[GetItem<'_>]) {
        let mapped = self.check_arena_reads().is_ok();
        let all: Vec<usize> = (0..items.len()).collect();
        let grants: Vec<Result<Grant>> = self
            .lease_items(items, &all)
            .into_iter()
            .map(|(_, g)| g.map(|g| if mapped { g } else { Grant { offset: 0, ..g } }))
            .collect();
        let ttl_ms = self.config().lease_ttl_ms;
        self.reply(rid, Reply::Grants { ttl_ms, grants: &grants });
    }

    /// `Exists`: per key, whether it exists.
    pub(super) fn exists(&mut self, rid: u64, keys: &[&[u8]]) {
        let found: Vec<Result<bool>> =
            self.shared.engine.batch_exists(keys).into_iter().map(|r| r.map_err(Error::from)).collect();
        self.reply(rid, Reply::Exists(&found));
    }

    /// `ScanKeys`: one page of the keys that start with `prefix`, cut to fit one reply frame.
    pub(super) fn scan_keys(&mut self, rid: u64, prefix: &[u8], cursor: u64, limit: u32) {
        let limits = &self.shared.limits;
        let per_key = 2 + limits.max_key_bytes as usize;
        let fit = ((limits.max_payload_bytes as usize).saturating_sub(16) / per_key).max(1);
        match self.shared.engine.scan_keys(prefix, cursor, (limit as usize).min(fit)) {
            Ok(page) => self.reply(rid, Reply::KeyPage(&page)),
            Err(e) => self.reply_error(rid, &e.into()),
        }
    }

    /// `ReadIndex`: the read index's descriptor, to a Unix client that may map the arena.
    pub(super) fn send_read_index(&mut self, rid: u64) -> WResult<()> {
        let index = self.check_shared().and_then(|()| {
            self.shared.index_fd.as_ref().ok_or(StoreError::InvalidArgument("this owner shares no read index".into()))
        });
        match index {
            Ok((fd, bytes)) => {
                self.reply(rid, Reply::IndexMap { bytes: *bytes });
                self.io.flush_with_fd(Some(fd.as_fd()))?;
            }
            Err(e) => self.reply_error(rid, &e.into()),
        }
        Ok(())
    }

    pub(super) fn check_shared(&self) -> std::result::Result<(), StoreError> {
        if !self.unix || self.shared.shm_fd.is_none() {
            return Err(StoreError::InvalidArgument("no shared memory here".into()));
        }
        Ok(())
    }

    /// Whether this connection's client reads granted ranges of the arena itself: a Unix client
    /// with the arena mapped, or one attached to the UCX plane.
    pub(super) fn check_arena_reads(&self) -> std::result::Result<(), StoreError> {
        if self.ucx {
            return Ok(());
        }
        self.check_shared()
    }

    /// `UcxAttach`: the UCX plane's address and the arena's remote key, to a TCP client past
    /// the handshake (so authenticated wherever a token is required) that speaks this version.
    pub(super) fn attach_ucx(&mut self, rid: u64, version: u32) {
        let refused = |why: String| StoreError::InvalidArgument(why);
        let outcome = match &self.shared.ucx {
            _ if self.unix => Err(refused("a Unix client reads the shared arena, not the UCX plane".into())),
            None => Err(refused(match &self.shared.ucx_not_serving {
                Some(why) => format!("this owner's UCX data plane is not serving: {why}"),
                None => "this owner serves no UCX data plane".into(),
            })),
            Some(_) if version != crate::ucx::UCX_PLANE_VERSION => Err(refused(format!(
                "UCX plane version {version} is not spoken here (this owner speaks {})",
                crate::ucx::UCX_PLANE_VERSION
            ))),
            Some(export) => export
                .ready()
                .ok_or_else(|| refused("the UCX plane process is restarting; reads stay on TCP for now".into())),
        };
        match outcome {
            Ok(ready) => {
                self.ucx = true;
                self.shared.counters.ucx_attached.fetch_add(1, Ordering::Relaxed);
                self.reply(rid, Reply::UcxReady(&ready));
            }
            Err(e) => self.reply_error(rid, &e.into()),
        }
    }

    /// Leases `items[i]` for each `i` in `indices`, together (one request per shard, so
    /// SSD-resident keys load side by side), within the connection's lease limit (past it:
    /// `Busy`), and records the leases. Per index, its grant or error.
    pub(super) fn lease_items(&mut self, items: &[GetItem<'_>], indices: &[usize]) -> Vec<(u32, Result<Grant>)> {
        let engine = Arc::clone(&self.shared.engine);
        let (room, mut grants) = self.lease_room(indices);
        let keys: Vec<&[u8]> = indices[..room].iter().map(|&i| items[i].key).collect();
        let leased = engine.lease_batch(&keys, u64::from(self.config().lease_ttl_ms));
        let granted: Vec<(u32, Result<Grant>)> =
            indices.iter().zip(leased).map(|(&i, lease)| (i as u32, self.grant_lease(&items[i], lease))).collect();
        grants.splice(0..0, granted);
        grants
    }

    /// The indices within the connection's lease limit (how many, from the front), and `Busy`
    /// for the rest.
    fn lease_room(&self, indices: &[usize]) -> (usize, Vec<(u32, Result<Grant>)>) {
        let max = self.config().max_leases_per_connection as usize;
        let room = max.saturating_sub(self.leases.len()).min(indices.len());
        let busy: Vec<(u32, Result<Grant>)> = indices[room..]
            .iter()
            .map(|&i| {
                self.shared.counters.busy_replies.fetch_add(1, Ordering::Relaxed);
                (i as u32, Err(StoreError::Busy { limit: max }.into()))
            })
            .collect();
        (room, busy)
    }

    /// `item`'s grant from its lease: its length checked, its place in the arena, the lease
    /// recorded under a new id.
    fn grant_lease(
        &mut self,
        item: &GetItem<'_>,
        lease: std::result::Result<ObjectLease, StoreError>,
    ) -> Result<Grant> {
        let granted = lease.and_then(|lease| {
            item.check.check(lease.len())?;
            let offset = self.offset_of(&lease)?;
            Ok((lease, offset))
        });
        match granted {
            Ok((lease, offset)) => {
                let id = self.next_lease;
                self.next_lease += 1;
                let len = lease.len();
                self.leases.insert(id, lease);
                self.shared.counters.leases_granted.fetch_add(1, Ordering::Relaxed);
                self.shared.counters.leases_outstanding.fetch_add(1, Ordering::Relaxed);
                Ok(Grant { lease: id, offset, len })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// `GetParts`: the items leased part by part as the engine's restore pipeline splits them
    /// (DRAM-resident first, then SSD-resident sub-batches, shards interleaved), one
    /// `GrantsPart` each. Before leasing a part the owner waits until the client released all
    /// but `PARTS_HELD - 1` of the parts it holds, so a batch larger than DRAM streams through
    /// it while the next part loads as the client copies the last one.
    pub(super) fn grant_parts(&mut self, rid: u64, items: &[GetItem<'_>]) -> WResult<Flow> {
        if let Err(e) = self.check_arena_reads() {
            self.reply_error(rid, &e.into());
            return Ok(Flow::Continue);
        }
        self.count_batch(items.len());
        let engine = Arc::clone(&self.shared.engine);
        let keys: Vec<&[u8]> = items.iter().map(|i| i.key).collect();
        // One key is planned (asked where it lives) only when it is a size query: an item with
        // no room, answered without a load.
        let misfit = |i: usize, len: u64| items[i].check.check(len).err();
        let probe = matches!(items, [item] if matches!(item.check, LenCheck::Exactly(0) | LenCheck::AtMost(0)));
        let plan = engine.lease_parts(
            &keys,
            (items.len() > 1 || probe).then_some(&misfit as &dyn Fn(usize, u64) -> Option<StoreError>),
        );
        // A key that finds no room beside the parts held is leased again at the end, in a part
        // of its own (`alone`) once the client holds nothing.
        let mut parts = shape_parts(plan.parts, engine.shard_count());
        if parts.is_empty() {
            parts.push(Part { keys: Vec::new(), in_dram: true, alone: false });
        }
        // Keys whose objects cannot fit their destinations: answered in the first part, unloaded.
        let mut refused: Vec<(u32, Result<Grant>)> =
            plan.refused.into_iter().map(|(i, e)| (i as u32, Err(e.into()))).collect();
        let ttl_ms = self.config().lease_ttl_ms;
        // Lease ids of the parts the client holds, oldest first, and whether each is
        // DRAM-resident: those may pin most of DRAM, so no SSD-resident part is leased (loaded)
        // while the client holds one.
        let mut held: VecDeque<(Vec<u64>, bool)> = VecDeque::new();
        let must_wait = |held: &VecDeque<(Vec<u64>, bool)>, next: &Part| {
            held.len() >= PARTS_HELD
                || (!next.in_dram && held.iter().any(|(_, dram)| *dram))
                || (next.alone && !held.is_empty())
        };
        let mut p = 0;
        while p < parts.len() {
            while must_wait(&held, &parts[p]) {
                if !self.await_release(rid, &mut held)? {
                    return Ok(Flow::Close);
                }
            }
            let (in_dram, alone) = (parts[p].in_dram, parts[p].alone);
            // An SSD-resident part spans up to one sub-batch per shard: each shard's grants go
            // out in a frame of their own as soon as that shard's loads ended, so the client
            // copies the first to land while the others still load.
            let indices = parts[p].keys.clone();
            let (room, mut busy) = if in_dram || alone { (0, Vec::new()) } else { self.lease_room(&indices) };
            let keys: Vec<&[u8]> = indices[..room].iter().map(|&i| items[i].key).collect();
            let mut landing = (!in_dram && !alone)
                .then(|| engine.lease_batch_as_landed(&keys, u64::from(self.config().lease_ttl_ms)));
            loop {
                let (mut grants, more) = match landing.as_mut() {
                    None => (self.lease_items(items, &indices), false),
                    Some(landing) => match landing.next_landed() {
                        Some(group) => {
                            let grants = group
                                .into_iter()
                                .map(|(j, lease)| (indices[j] as u32, self.grant_lease(&items[indices[j]], lease)))
                                .collect();
                            (grants, !landing.is_done())
                        }
                        None => (Vec::new(), false),
                    },
                };
                if !more {
                    grants.append(&mut busy);
                }
                if !alone {
                    let no_room = |g: &Result<Grant>| matches!(g, Err(e) if e.as_store() == Some(&StoreError::NoSpace));
                    for &(i, _) in grants.iter().filter(|(_, g)| no_room(g)) {
                        parts.push(Part { keys: vec![i as usize], in_dram: false, alone: true });
                    }
                    grants.retain(|(_, g)| !no_room(g));
                }
                grants.append(&mut refused);
                let ids: Vec<u64> = grants.iter().filter_map(|(_, g)| g.as_ref().ok().map(|g| g.lease)).collect();
                // The client may keep this part while it waits for the next when this part alone
                // would not hold the next one up (more of the same part always follows at once).
                let next = match parts.get(p + 1) {
                    _ if more => NextPart::WhileHeld,
                    None => NextPart::None,
                    Some(following) if must_wait(&VecDeque::from([(ids.clone(), in_dram)]), following) => {
                        NextPart::AfterRelease
                    }
                    Some(_) => NextPart::WhileHeld,
                };
                self.reply(rid, Reply::GrantsPart(&GrantsPart { ttl_ms, next, grants }));
                self.io.flush()?;
                if !ids.is_empty() {
                    held.push_back((ids, in_dram));
                }
                if !more {
                    break;
                }
            }
            p += 1;
        }
        Ok(Flow::Continue)
    }

    /// Reads the client's next frame, which must release leases of the parts it holds (the
    /// client sends nothing else before the last part), and forgets the parts it released.
    /// False after a protocol violation (answered; the connection closes).
    pub(super) fn await_release(&mut self, rid: u64, held: &mut VecDeque<(Vec<u64>, bool)>) -> WResult<bool> {
        // A client that neither copies nor goes away keeps its parts at most a lease TTL.
        self.io.set_read_deadline(Some(Instant::now() + self.ttl()));
        let Some(h) = self.read_header_or_close(rid)? else { return Ok(false) };
        if h.op != Op::Release {
            self.fatal(rid, &Error::Protocol("a request arrived before the parts of a get were released".into()));
            return Ok(false);
        }
        self.arm_read_deadline();
        let payload = self.io.read_payload(h.payload_len)?;
        let leases = match Request::decode(Op::Release, &payload, &self.shared.limits) {
            Ok(Request::Release { leases }) => leases,
            _ => {
                self.fatal(rid, &Error::Protocol("malformed release".into()));
                return Ok(false);
            }
        };
        self.release(leases);
        for (part, _) in held.iter_mut() {
            part.retain(|id| self.leases.contains_key(id));
        }
        held.retain(|(part, _)| !part.is_empty());
        Ok(true)
    }

    /// Where a leased object starts within the shared arena.
    pub(super) fn offset_of(&self, lease: &ObjectLease) -> Result<u64, StoreError> {
        if lease.is_empty() {
            return Ok(0);
        }
        let ptr = lease.bytes()?.as_ptr() as usize;
        let offset =
            ptr.checked_sub(self.shared.arena_base).ok_or(StoreError::Internal("lease outside the arena"))? as u64;
        match offset.checked_add(lease.len()) {
            Some(end) if end <= self.shared.arena_bytes => Ok(offset),
            _ => Err(StoreError::Internal("lease outside the arena")),
        }
    }

    /// `Get` in stream mode: per key an `Object` and its bytes in `Data` frames, or an `Error`,
    /// in the order `lease_each_streamed` leases them.
    pub(super) fn stream_get(&mut self, rid: u64, items: &[GetItem<'_>]) -> WResult<()> {
        let keys: Vec<&[u8]> = items.iter().map(|i| i.key).collect();
        let misfit = |i: usize, len: u64| items[i].check.check(len).err();
        self.lease_each_streamed(&keys, Some(&misfit), |this, i, leased, leased_at| {
            this.send_leased(rid, i as u32, &items[i], leased, leased_at)
        })?;
        self.reply(rid, Reply::End);
        Ok(())
    }

    /// Leases each of `keys` for a streamed answer and hands it to `send` (its index, its lease
    /// or error, when the lease was taken), which sends it and drops the lease. DRAM-resident
    /// keys go first, in order, each leased without a message as it is sent; the others are
    /// leased in the engine's restore parts (`lease_parts`), each part in one request per shard
    /// so its loads run side by side, and the next part's loads start while this part is sent
    /// (two parts held at most, as `GetParts` holds them).
    pub(super) fn lease_each_streamed(
        &mut self,
        keys: &[&[u8]],
        misfit: Option<&dyn Fn(usize, u64) -> Option<StoreError>>,
        mut send: impl FnMut(&mut Self, usize, &Result<ObjectLease, StoreError>, Instant) -> WResult<()>,
    ) -> WResult<()> {
        let engine = Arc::clone(&self.shared.engine);
        let ttl_ms = u64::from(self.config().lease_ttl_ms);
        // The keys to load, each once (a key asked for twice is leased once): the first index
        // of each, and every index that asked for it.
        let mut loading: Vec<usize> = Vec::new();
        let mut asked: Vec<Vec<usize>> = Vec::new();
        let mut seen: HashMap<&[u8], usize> = HashMap::new();
        for (index, key) in keys.iter().enumerate() {
            let leased_at = Instant::now();
            let leased = match engine.lease_resident(key, ttl_ms) {
                Some(leased) => leased,
                // One key with nothing to refuse is leased at once; others are planned.
                None if keys.len() == 1 && misfit.is_none() => engine.lease_progressive(key, ttl_ms),
                None => {
                    match seen.entry(*key) {
                        std::collections::hash_map::Entry::Occupied(at) => asked[*at.get()].push(index),
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(loading.len());
                            loading.push(index);
                            asked.push(vec![index]);
                        }
                    }
                    continue;
                }
            };
            send(self, index, &leased, leased_at)?;
        }
        if loading.is_empty() {
            return Ok(());
        }
        // Every index that asked for the key planned at `k`, answered with one lease.
        let mut answer = |this: &mut Self, k: usize, leased: Result<ObjectLease, StoreError>, leased_at: Instant| {
            asked[k].iter().try_for_each(|&index| send(this, index, &leased, leased_at))
        };
        // Chunk sends must start before the TTL less the I/O timeout (`stream_chunks`).
        let window_ms = ttl_ms.saturating_sub(self.config().io_timeout_ms);
        let stale_after = Duration::from_millis(window_ms / 4);
        let part_keys: Vec<&[u8]> = loading.iter().map(|&i| keys[i]).collect();
        let refuse = misfit.map(|m| move |k: usize, len: u64| m(loading[k], len));
        let plan =
            engine.lease_parts(&part_keys, refuse.as_ref().map(|r| r as &dyn Fn(usize, u64) -> Option<StoreError>));
        // Keys whose objects cannot fit their destinations: answered without a load.
        for (k, e) in plan.refused {
            answer(self, k, Err(e), Instant::now())?;
        }
        let parts = shape_parts(plan.parts, engine.shard_count());
        // A part's leases, each with the key it answers (its place in `loading`), when it was
        // asked for (the lease's TTL counts from there) and when it was granted (its wait for
        // its turn counts from there). DRAM-resident (or missing) parts are not leased ahead:
        // their keys are leased as they are sent.
        let lease_part = |part: &Part| -> Option<Vec<LeasedItem>> {
            if part.in_dram {
                return None;
            }
            let these: Vec<&[u8]> = part.keys.iter().map(|&k| part_keys[k]).collect();
            let leased_at = Instant::now();
            let leased = engine.lease_batch_progressive(&these, ttl_ms);
            let granted_at = Instant::now();
            Some(part.keys.iter().zip(leased).map(|(&k, l)| (k, l, leased_at, granted_at)).collect())
        };
        // A key leased now, on its own.
        let lease_now = |k: usize| (engine.lease_progressive(part_keys[k], ttl_ms), Instant::now());
        // Keys that found no room (or no lease slot) beside the parts held: leased alone at the
        // end.
        let mut alone = Vec::new();
        let mut parts = parts.iter();
        let mut next = parts.next().map(|p| (p, lease_part(p)));
        while let Some((part, leased)) = next.take() {
            // The next part loads while this one is sent.
            next = parts.next().map(|p| (p, lease_part(p)));
            let leased: Vec<LeasedItem> = match leased {
                Some(leased) => leased,
                None => part
                    .keys
                    .iter()
                    .map(|&k| {
                        let (leased, at) = lease_now(k);
                        (k, leased, at, at)
                    })
                    .collect(),
            };
            for (k, leased, leased_at, granted_at) in leased {
                // A lease granted so long ago (a slow reader) that a quarter of its sending
                // window is gone: this key is leased again.
                let stale = granted_at.elapsed() > stale_after;
                let (leased, leased_at) = match leased {
                    Ok(lease) if stale => {
                        drop(lease);
                        lease_now(k)
                    }
                    other => (other, leased_at),
                };
                // No room, or a shard out of lease slots, beside what this request holds.
                if matches!(leased, Err(StoreError::NoSpace | StoreError::Busy { .. })) {
                    alone.push(k);
                    continue;
                }
                answer(self, k, leased, leased_at)?;
            }
        }
        for k in alone {
            let (leased, leased_at) = lease_now(k);
            answer(self, k, leased, leased_at)?;
        }
        Ok(())
    }

    /// One item of a streamed `Get`: its `Object` frame and bytes, or its `Error`. Every byte is
    /// in the write buffer or on the socket when it returns (the caller then drops the lease).
    pub(super) fn send_leased(
        &mut self,
        rid: u64,
        index: u32,
        item: &GetItem<'_>,
        leased: &Result<ObjectLease, StoreError>,
        leased_at: Instant,
    ) -> WResult<()> {
        let lease =
            match leased.as_ref().map_err(Clone::clone).and_then(|lease| item.check.check(lease.len()).map(|()| lease))
            {
                Ok(lease) => lease,
                Err(e) => {
                    self.reply(rid, Reply::Error { index, error: &e.into() });
                    return Ok(());
                }
            };
        self.reply(rid, Reply::Object { index, len: lease.len() });
        // Sent in order: an SSD-resident object's frames go out as its load's checked front
        // passes them.
        self.stream_bytes(rid, index, lease, leased_at, 0, lease.len())?;
        if self.io.pending_out() >= FLUSH_BYTES {
            self.io.flush()?;
        }
        Ok(())
    }

    /// `GetFollow`: a key's unsealed progressive put streamed as its chunks land (`Object`,
    /// `Data` frames, `End`; an `Abort` with `ProducerAborted` when the producer goes away), or
    /// a plain streamed get when no put of the key is open.
    pub(super) fn follow_get(&mut self, rid: u64, key: &[u8]) -> WResult<()> {
        let engine = Arc::clone(&self.shared.engine);
        let following = match engine.follow_unsealed(key) {
            Ok(Some(f)) => f,
            Ok(None) => return self.stream_get(rid, &[GetItem { key, check: LenCheck::Any }]),
            Err(e) => {
                self.reply(rid, Reply::Error { index: 0, error: &e.into() });
                self.reply(rid, Reply::End);
                return Ok(());
            }
        };
        self.reply(rid, Reply::Object { index: 0, len: following.len() });
        self.io.flush()?;
        // Frames never span two of the producer's chunks, so each goes out as soon as its chunk
        // landed.
        let frame = u64::from(self.config().chunk_bytes).min(following.chunk_bytes()).max(1);
        let produced = following.chunk_bytes().max(1);
        let mut pos = 0;
        while pos < following.len() {
            let chunk_end = (pos / produced + 1).saturating_mul(produced);
            let n = frame.min(following.len() - pos).min(chunk_end - pos);
            // The wait is bounded by the put's TTL (an expired put ends) and the owner's shutdown
            // (which ends every open put).
            let landed = loop {
                match following.wait_landed(pos..pos + n, FOLLOW_WAIT_MS) {
                    Ok(true) => break Ok(()),
                    Ok(false) if self.shared.shutting_down.load(Ordering::SeqCst) => {
                        break Err(StoreError::ShuttingDown)
                    }
                    Ok(false) => continue,
                    Err(e) => break Err(e),
                }
            };
            let bytes = landed.and_then(|()| following.bytes(pos..pos + n));
            match bytes {
                Ok(piece) => self.io.send_data(Op::Data, rid, &[IoSlice::new(piece)])?,
                Err(e) => {
                    self.reply(rid, Reply::Abort { index: 0, error: &e.into() });
                    break;
                }
            }
            pos += n;
        }
        self.reply(rid, Reply::End);
        Ok(())
    }

    /// `GetRanges`: each key leased once (in the order `lease_each_streamed` leases them); per
    /// fragment an `Object` and its bytes, or an `Error`.
    pub(super) fn stream_ranges(&mut self, rid: u64, keys: &[&[u8]], fragments: &[RangeItem]) -> WResult<()> {
        let mut by_key: Vec<Vec<usize>> = vec![Vec::new(); keys.len()];
        for (i, f) in fragments.iter().enumerate() {
            by_key[f.key_index as usize].push(i);
        }
        let read: Vec<usize> = (0..keys.len()).filter(|&k| !by_key[k].is_empty()).collect();
        let read_keys: Vec<&[u8]> = read.iter().map(|&k| keys[k]).collect();
        self.lease_each_streamed(&read_keys, None, |this, r, leased, leased_at| {
            let frags = &by_key[read[r]];
            let lease = match leased {
                Ok(l) => l,
                Err(e) => {
                    let e = Error::from(e.clone());
                    frags.iter().for_each(|&fi| this.reply(rid, Reply::Error { index: fi as u32, error: &e }));
                    return Ok(());
                }
            };
            for &fi in frags {
                let f = fragments[fi];
                if let Err(e) = kvtide_transport::region::check_range("object", f.src_offset, f.len, lease.len()) {
                    this.reply(rid, Reply::Error { index: fi as u32, error: &e.into() });
                    continue;
                }
                this.reply(rid, Reply::Object { index: fi as u32, len: f.len });
                this.stream_bytes(rid, fi as u32, lease, leased_at, f.src_offset, f.len)?;
                if this.io.pending_out() >= FLUSH_BYTES {
                    this.io.flush()?;
                }
            }
            Ok(())
        })?;
        self.reply(rid, Reply::End);
        Ok(())
    }

    /// Sends `[offset, offset + len)` of a leased object in chunks, or an `Abort` when the
    /// lease could run out before a chunk is surely sent.
    pub(super) fn stream_bytes(
        &mut self,
        rid: u64,
        index: u32,
        lease: &ObjectLease,
        leased_at: Instant,
        offset: u64,
        len: u64,
    ) -> WResult<()> {
        let lease_end = leased_at + self.ttl();
        let sent = self.stream_chunks(rid, index, lease, lease_end, offset, len);
        self.io.set_write_deadline(None);
        sent
    }

    /// `stream_bytes`' frames, each started only while the lease surely outlives its send, and
    /// each send given up (closing the connection) when it has not ended within the I/O timeout:
    /// a client that reads just fast enough to keep a send going never keeps an object leased
    /// past its TTL.
    pub(super) fn stream_chunks(
        &mut self,
        rid: u64,
        index: u32,
        lease: &ObjectLease,
        lease_end: Instant,
        offset: u64,
        len: u64,
    ) -> WResult<()> {
        let chunk = u64::from(self.config().chunk_bytes);
        let io_timeout = Duration::from_millis(self.config().io_timeout_ms);
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = chunk.min(end - pos);
            // A chunk send may block for up to the I/O timeout; start it only if the lease
            // surely outlives it (a lease of an object still loading waits for the chunk's
            // bytes until then).
            let send_by = lease_end.checked_sub(io_timeout).unwrap_or(lease_end);
            let ready = if Instant::now() >= send_by {
                Err(StoreError::LeaseExpired)
            } else {
                lease.bytes_when_ready(pos..pos + n, send_by).and_then(|b| b.ok_or(StoreError::LeaseExpired))
            };
            let piece = match ready {
                Ok(piece) => piece,
                Err(e) => {
                    self.reply(rid, Reply::Abort { index, error: &e.into() });
                    return Ok(());
                }
            };
            self.io.set_write_deadline(Some(lease_end.min(Instant::now() + io_timeout)));
            self.io.push_data(Op::Data, rid, &[IoSlice::new(piece)])?;
            pos += n;
        }
        Ok(())
    }
}

/// A streamed answer's key (its place among the keys planned), its lease or error, when the
/// lease was asked for and when it was granted.
type LeasedItem = (usize, Result<ObjectLease, StoreError>, Instant, Instant);

/// DRAM-resident keys of a `GetParts` leased per part at most: the first grants reach the
/// client (which starts copying) while the owner leases the rest.
const DRAM_PART_KEYS: usize = 256;

/// A part a batch is answered in (`shape_parts`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Part {
    /// Indices into the keys given to `lease_parts`.
    keys: Vec<usize>,
    /// DRAM-resident (or missing) keys: nothing to load.
    in_dram: bool,
    /// A key that found no room beside the parts held, leased again once nothing is held.
    alone: bool,
}

/// The parts a batch is answered in, from the engine's restore plan (`lease_parts`): each
/// DRAM-resident part cut into parts of at most `DRAM_PART_KEYS` keys, and the SSD-resident
/// sub-batches (one shard's each, shards interleaved) joined up to `shards` at a time, never two
/// of one shard, so one part's lease loads on every shard side by side while the part before is
/// sent or copied, and no shard holds more than one sub-batch per part.
fn shape_parts(parts: Vec<kvtide::LeasePart>, shards: usize) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::with_capacity(parts.len());
    // The shards of the SSD-resident part being joined (empty: none is).
    let mut joined: Vec<usize> = Vec::new();
    for part in parts {
        if part.in_dram {
            out.extend(part.keys.chunks(DRAM_PART_KEYS).map(|keys| Part {
                keys: keys.to_vec(),
                in_dram: true,
                alone: false,
            }));
            joined.clear();
            continue;
        }
        match out.last_mut() {
            Some(last) if !joined.is_empty() && joined.len() < shards.max(1) && !joined.contains(&part.shard) => {
                last.keys.extend(part.keys);
                joined.push(part.shard);
            }
            _ => {
                out.push(Part { keys: part.keys, in_dram: false, alone: false });
                joined = vec![part.shard];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(keys: std::ops::Range<usize>, in_dram: bool, shard: usize) -> kvtide::LeasePart {
        kvtide::LeasePart { keys: keys.collect(), in_dram, shard }
    }

    #[test]
    fn parts_cut_dram_and_join_ssd_sub_batches_per_shard_count() {
        let shaped = shape_parts(
            vec![part(0..600, true, 0), part(600..602, false, 0), part(602..604, false, 1), part(604..605, false, 0)],
            2,
        );
        let sizes: Vec<(usize, bool)> = shaped.iter().map(|p| (p.keys.len(), p.in_dram)).collect();
        assert_eq!(sizes, vec![(256, true), (256, true), (88, true), (4, false), (1, false)]);
        let all: Vec<usize> = shaped.iter().flat_map(|p| p.keys.iter().copied()).collect();
        assert_eq!(all, (0..605).collect::<Vec<_>>(), "every key once, in order");
        assert!(shape_parts(vec![part(0..0, true, 0)], 4).is_empty());
        // Uneven shards: the tail of one shard's sub-batches is never joined two to a part.
        let tail = shape_parts(
            vec![part(0..1, false, 0), part(1..2, false, 1), part(2..3, false, 0), part(3..4, false, 0)],
            2,
        );
        let keys: Vec<Vec<usize>> = tail.iter().map(|p| p.keys.clone()).collect();
        assert_eq!(keys, vec![vec![0, 1], vec![2], vec![3]]);
    }
}
