//! Progressive and streaming reads: objects delivered chunk by chunk behind a `ChunkHandle`.
//!
//! Owns the read driver: one thread per handle that leases the keys as the window reaches them,
//! moves each chunk through the transport of its destination (CPU copies inline; asynchronous
//! transports with at most `[stream] window_chunks` chunks in flight), settles each chunk as it
//! lands, and gives every lease back once the chunks that read it settled. It follows unsealed
//! progressive puts chunk by chunk. It never settles a chunk before its bytes arrived, never
//! starts a chunk after the handle was dropped, and never releases a lease while a transfer
//! that reads it is in flight.
//!
//! Where the bytes come from: DRAM-resident objects are leased in place. An SSD-resident object
//! is leased as soon as its load into DRAM starts (an early lease): the load reads the record
//! in pieces and checks the value block by block against the record's checksum table, and a
//! chunk starts once the checked front passed it (`Landing`), so the first chunk follows the
//! first pieces' reads, not the whole object's. A block that fails its checksum fails the
//! chunks that need it; the chunks before it were checked and stay good.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvtide_tiers::dram::Arena;
use kvtide_transport::{Direction, InFlight, MemoryKind, Piece, Region, Transfer};

use super::gpu::GpuCounters;
use super::key_index::KeyIndex;
use super::progressive::Unsealed;
use super::transports::{Route, Transports};
use super::Engine;
use crate::api::Fragment;
use crate::chunks::{check_chunk_count, chunk_count, chunk_pair, cut, ChunkHandle, ChunkPlace, ChunkSink};
use crate::error::{Error, Result};
use crate::shard::{Inbox, ReadGrant, Request};
use crate::stats::StreamCounters;

/// Distinct keys leased ahead of the chunk being started (one lease message per shard for
/// them), at least the window.
const LEASE_AHEAD_KEYS: usize = 16;
/// How often a reader that follows a producer checks for cancellation while it waits.
const FOLLOW_POLL: Duration = Duration::from_millis(20);

/// Where a key's bytes come from.
enum Source {
    /// Leased by key when the window reaches it.
    ByKey,
    /// Leased before the driver started (the caller needed its length).
    Granted,
    /// The reservation of an unsealed progressive put (leased before the driver started),
    /// followed chunk by chunk.
    Follow(Arc<Unsealed>),
}

struct KeyState {
    key: Box<[u8]>,
    shard: usize,
    source: Source,
    grant: Option<ReadGrant>,
    /// The shard's answer to the lease asked for ahead of use.
    asked: Option<GrantReply>,
    error: Option<Error>,
    /// Chunks of this key not yet settled; the lease goes back at zero.
    chunks_left: usize,
}

/// One chunk: which key, where in it, and where to.
struct ChunkPlan {
    key: usize,
    src_offset: u64,
    dst_addr: u64,
    kind: MemoryKind,
    route: Route,
    /// A fragment that failed its checks before anything started.
    error: Option<Error>,
}

/// A shard's answer to a lease request.
type GrantReply = crossbeam_channel::Receiver<Vec<Result<ReadGrant>>>;

/// Moves the chunks of one handle; runs on its own thread.
struct ReadDriver {
    sink: ChunkSink<Error>,
    keys: Vec<KeyState>,
    chunks: Vec<ChunkPlan>,
    inboxes: Vec<Arc<Inbox>>,
    transports: Transports,
    window: usize,
    counters: Arc<StreamCounters>,
    gpu: Arc<GpuCounters>,
    /// Keeps the leased bytes mapped.
    _arena: Arc<Arena>,
}

impl ReadDriver {
    fn run(mut self) {
        let mut in_flight: VecDeque<(usize, InFlight)> = VecDeque::new();
        let mut next = 0;
        while next < self.chunks.len() || !in_flight.is_empty() {
            // Settle what landed, oldest first.
            while in_flight.front_mut().is_some_and(|(_, f)| f.poll()) {
                if let Some((c, f)) = in_flight.pop_front() {
                    self.settle_async(c, f);
                }
            }
            let cancelled = self.sink.cancelled();
            if next < self.chunks.len() && !cancelled && in_flight.len() < self.window {
                if let Some(f) = self.start(next) {
                    in_flight.push_back((next, f));
                }
                next += 1;
                continue;
            }
            if cancelled && next < self.chunks.len() {
                // Start nothing new; what is in flight finishes below.
                next = self.chunks.len();
            }
            // The window is full (or nothing is left to start): block on the oldest.
            if let Some((c, f)) = in_flight.pop_front() {
                self.settle_async(c, f);
            }
        }
    }

    /// Starts chunk `c`: settles it now when it fails or completes inline, else returns its
    /// submission.
    fn start(&mut self, c: usize) -> Option<InFlight> {
        if let Some(e) = self.chunks[c].error.clone() {
            self.settle(c, Err(e));
            return None;
        }
        let k = self.chunks[c].key;
        if self.keys[k].grant.is_none() && self.keys[k].error.is_none() {
            self.lease_ahead(c);
        }
        let range = self.sink.place(c).range.clone();
        let len = range.end - range.start;
        let plan = &self.chunks[c];
        let key = &self.keys[k];
        let grant = match (&key.grant, &key.error) {
            (Some(grant), _) => grant,
            (None, Some(e)) => {
                let e = e.clone();
                self.settle(c, Err(e));
                return None;
            }
            (None, None) => {
                self.settle(c, Err(Error::Internal("a streamed key was neither leased nor failed")));
                return None;
            }
        };
        if let Err(e) = kvtide_transport::region::check_range("object", plan.src_offset, len, grant.len) {
            self.settle(c, Err(e.into()));
            return None;
        }
        let (grant_ptr, grant_len) = (grant.ptr.as_ptr() as u64, grant.len);
        // An object still loading from SSD: wait for the checked front to pass this chunk.
        let value_offset = match &grant.landing {
            None => 0,
            Some(landing) => {
                let sink = &self.sink;
                match landing.wait_ready(plan.src_offset + len, FOLLOW_POLL, || sink.cancelled()) {
                    Ok(offset) => {
                        if !landing.ended() {
                            self.counters.chunks_ahead_of_load.fetch_add(1, Ordering::Relaxed);
                        }
                        offset
                    }
                    Err(e) => {
                        self.settle(c, Err(e));
                        return None;
                    }
                }
            }
        };
        if let Source::Follow(unsealed) = &key.source {
            let sink = &self.sink;
            if let Err(e) =
                unsealed.wait_landed(plan.src_offset..plan.src_offset + len, FOLLOW_POLL, || sink.cancelled())
            {
                self.settle(c, Err(e));
                return None;
            }
        }
        if len == 0 {
            self.settle(c, Ok(()));
            return None;
        }
        let transfer = Transfer {
            host: grant_ptr + value_offset,
            host_len: grant_len,
            pieces: vec![Piece { host_offset: plan.src_offset, addr: plan.dst_addr, len, kind: plan.kind }],
        };
        let route = plan.route;
        let transport = self.transports.get(route);
        self.counters.add(&self.counters.chunks_in_flight, &self.counters.peak_chunks_in_flight, 1);
        // SAFETY: the host bytes are leased by this driver until the chunks of the key settled
        // (released only after this submission completed: `settle_async` runs after `poll` or
        // `wait`, and an `InFlight` dropped early waits for it). The destination passed the
        // transport's check when the handle was made, and the caller's `'static` regions stay
        // valid while the handle's transfers run.
        let submitted = unsafe { transport.submit(Direction::HostToDevice, &[transfer], None) };
        match submitted {
            Ok(inflight) if transport.completes_inline() => {
                self.settle_async(c, inflight);
                None
            }
            Ok(inflight) => Some(inflight),
            Err(e) => {
                self.counters.chunks_in_flight.fetch_sub(1, Ordering::Relaxed);
                self.settle(c, Err(e.into()));
                None
            }
        }
    }

    /// Settles a chunk whose submission completed (or waits for it first).
    fn settle_async(&mut self, c: usize, inflight: InFlight) {
        let summary = inflight.summary();
        let result = match inflight.wait().pop() {
            Some(result) => result.map_err(Error::from),
            None => Err(Error::Internal("a transfer gave no result")),
        };
        self.counters.chunks_in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.chunks[c].route == Route::Gpu {
            self.gpu.record(Some(&summary), Direction::HostToDevice, u64::from(result.is_err()));
        }
        self.settle(c, result);
    }

    /// Settles chunk `c`; the key's lease goes back with its last chunk, before that chunk is
    /// reported, so a caller that saw every chunk of a key settle finds it leased by this
    /// handle no more (the release is ahead of the caller's next request in the shard's inbox).
    fn settle(&mut self, c: usize, result: Result<()>) {
        let k = self.chunks[c].key;
        let key = &mut self.keys[k];
        key.chunks_left = key.chunks_left.saturating_sub(1);
        if key.chunks_left == 0 {
            self.release(k);
        }
        match result {
            Ok(()) => {
                self.counters.chunks_delivered.fetch_add(1, Ordering::Relaxed);
                self.sink.done(c);
            }
            Err(e) => {
                self.counters.chunks_failed.fetch_add(1, Ordering::Relaxed);
                self.sink.fail(c, e);
            }
        }
    }

    fn release(&mut self, k: usize) {
        let key = &mut self.keys[k];
        if let Some(grant) = key.grant.take() {
            self.counters.leased_bytes.fetch_sub(grant.len, Ordering::Relaxed);
            // A shard that is gone dropped its leases with it.
            let _ = self.inboxes[key.shard].send(Request::Release { leases: vec![grant.lease] });
        }
    }

    /// Asks for the leases of chunk `c`'s key and of the keys of the chunks after it (up to
    /// `LEASE_AHEAD_KEYS`, or the window's) that were not asked for yet, one request per key (an
    /// SSD-resident key that must wait for memory never holds back another key's grant), then
    /// waits for chunk `c`'s.
    fn lease_ahead(&mut self, c: usize) {
        let ahead = LEASE_AHEAD_KEYS.max(self.window);
        let mut seen: Vec<usize> = Vec::new();
        for plan in &self.chunks[c..] {
            if seen.len() >= ahead {
                break;
            }
            let k = plan.key;
            let key = &mut self.keys[k];
            if key.grant.is_some() || key.error.is_some() || key.chunks_left == 0 || seen.contains(&k) {
                continue;
            }
            seen.push(k);
            if key.asked.is_some() {
                continue;
            }
            let (reply, rx) = crossbeam_channel::bounded(1);
            let keys = vec![key.key.clone()];
            match self.inboxes[key.shard].send(Request::LeaseRead { keys, ttl: None, early: true, reply }) {
                Ok(()) => key.asked = Some(rx),
                Err(_) => key.error = Some(Error::ShuttingDown),
            }
        }
        self.collect(self.chunks[c].key);
    }

    /// Waits for key `k`'s lease, if it was asked for.
    fn collect(&mut self, k: usize) {
        let Some(rx) = self.keys[k].asked.take() else { return };
        match rx.recv().ok().and_then(|mut grants| grants.pop()) {
            Some(Ok(grant)) => {
                self.counters.add(&self.counters.leased_bytes, &self.counters.peak_leased_bytes, grant.len);
                self.keys[k].grant = Some(grant);
            }
            Some(Err(e)) => self.keys[k].error = Some(e),
            None => self.keys[k].error = Some(Error::ShuttingDown),
        }
    }
}

impl Drop for ReadDriver {
    fn drop(&mut self) {
        // Runs after `run`'s submissions completed (they are dropped, and waited for, first).
        // Leases asked for ahead and never used are collected (the shard answers every request)
        // and given back with the rest.
        for k in 0..self.keys.len() {
            self.collect(k);
            self.release(k);
        }
        self.counters.handles_open.fetch_sub(1, Ordering::Relaxed);
        // The sink, dropped after this, fails every chunk that did not settle (Cancelled).
    }
}

/// Bytes of one key that go to one destination buffer (a fragment, or a whole object).
struct ChunkSpan {
    /// The key's index in the plan.
    key: usize,
    /// The destination buffer's index.
    buffer: usize,
    route: Route,
    src_offset: u64,
    dst_offset: u64,
    len: u64,
}

impl ChunkSpan {
    /// A whole object of `len` bytes, the plan's only key, at the start of buffer 0.
    fn whole(route: Route, len: u64) -> ChunkSpan {
        ChunkSpan { key: 0, buffer: 0, route, src_offset: 0, dst_offset: 0, len }
    }
}

/// What a streaming read wants: keys (with how each is sourced) and chunks over them.
struct ReadPlan {
    keys: Vec<KeyState>,
    chunks: Vec<ChunkPlan>,
    places: Vec<ChunkPlace>,
}

impl ReadPlan {
    fn new() -> ReadPlan {
        ReadPlan { keys: Vec::new(), chunks: Vec::new(), places: Vec::new() }
    }

    /// Adds chunks for `span.len` bytes at `span.src_offset` of key `span.key` into `region` at
    /// `span.dst_offset`.
    fn add_chunks(&mut self, region: &Region<'_>, span: ChunkSpan, chunk_bytes: u64, error: Option<Error>) {
        let ChunkSpan { key: k, buffer, route, src_offset, dst_offset, len } = span;
        // A fragment that failed its checks is one chunk that reports the error.
        let len = if error.is_some() { 0 } else { len };
        for place in cut(buffer, dst_offset, len, chunk_bytes) {
            let within = place.range.start - dst_offset;
            self.chunks.push(ChunkPlan {
                key: k,
                src_offset: src_offset + within,
                dst_addr: region.addr().wrapping_add(place.range.start),
                kind: region.kind(),
                route,
                error: error.clone(),
            });
            self.keys[k].chunks_left += 1;
            self.places.push(place);
        }
    }
}

impl Engine {
    /// Reads `key` into the start of `dst` chunk by chunk (`chunk_bytes` each, the last one
    /// shorter): chunk `i` is usable as soon as it landed (`ChunkHandle::wait_chunk`). `dst`
    /// must hold the object (`BufferTooSmall` otherwise); the handle's chunks cover the object's
    /// bytes. Errors found before anything moves (a bad key, a missing object, a bad
    /// destination) are returned here; later ones fail chunks.
    pub fn progressive_get(&self, key: &[u8], dst: Region<'static>, chunk_bytes: u64) -> Result<ChunkHandle> {
        self.validate_key(key)?;
        let (slot, route, transports) = self.open_single(&dst, chunk_bytes)?;
        let shard = self.shard_of(key);
        let grant = self.lease_for_stream(shard, key)?;
        let refused = if grant.len > dst.len() as u64 {
            Err(Error::BufferTooSmall { object_bytes: grant.len, buffer_bytes: dst.len() as u64 })
        } else {
            check_chunk_count(chunk_count(grant.len, chunk_bytes))
        };
        if let Err(e) = refused {
            let _ = self.shards[shard].inbox.send(Request::Release { leases: vec![grant.lease] });
            return Err(e);
        }
        self.counters_stream().add(
            &self.counters_stream().leased_bytes,
            &self.counters_stream().peak_leased_bytes,
            grant.len,
        );
        let len = grant.len;
        let mut plan = ReadPlan::new();
        plan.keys.push(KeyState {
            key: key.into(),
            shard,
            source: Source::Granted,
            grant: Some(grant),
            asked: None,
            error: None,
            chunks_left: 0,
        });
        plan.add_chunks(&dst, ChunkSpan::whole(route, len), chunk_bytes, None);
        Ok(self.start_driver(plan, transports, slot))
    }

    /// `progressive_get` that follows an unsealed progressive put of `key`: chunk `i` completes
    /// once the producer's chunks under it landed, and fails with `ProducerAborted` if the
    /// producer aborts, drops its stream or lets its TTL pass. Without an unsealed put of the
    /// key it is `progressive_get` (a sealed object, or NotFound).
    pub fn progressive_get_unsealed(&self, key: &[u8], dst: Region<'static>, chunk_bytes: u64) -> Result<ChunkHandle> {
        self.validate_key(key)?;
        let Some(unsealed) = self.unsealed.open_put(key) else {
            return self.progressive_get(key, dst, chunk_bytes);
        };
        let (slot, route, transports) = self.open_single(&dst, chunk_bytes)?;
        let len = unsealed.len();
        if len > dst.len() as u64 {
            return Err(Error::BufferTooSmall { object_bytes: len, buffer_bytes: dst.len() as u64 });
        }
        check_chunk_count(chunk_count(len, chunk_bytes))?;
        // Leased now: the producer's bytes stay in place for this reader from the call on,
        // whatever happens to the key after the seal.
        let shard = unsealed.shard();
        let Some(grant) = self.lease_unsealed(&unsealed)? else {
            drop(slot);
            return self.progressive_get(key, dst, chunk_bytes);
        };
        self.streams.add(&self.streams.leased_bytes, &self.streams.peak_leased_bytes, grant.len);
        let mut plan = ReadPlan::new();
        plan.keys.push(KeyState {
            key: key.into(),
            shard,
            source: Source::Follow(unsealed),
            grant: Some(grant),
            asked: None,
            error: None,
            chunks_left: 0,
        });
        plan.add_chunks(&dst, ChunkSpan::whole(route, len), chunk_bytes, None);
        Ok(self.start_driver(plan, transports, slot))
    }

    /// The streaming form of `get_into_ranges`: the fragments (buffer-major, as there) are
    /// delivered in the caller's order, each cut into chunks of at most `chunk_bytes`; a
    /// fragment of zero bytes is one empty chunk. A bad fragment (range, key, missing object)
    /// fails its own chunks only. `ChunkHandle::chunk_place` names each chunk's buffer.
    pub fn streaming_batch_get_buffer_ranges(
        &self,
        buffers: &[Region<'static>],
        fragments: &[Vec<Fragment>],
        chunk_bytes: u64,
    ) -> Result<ChunkHandle> {
        crate::checks::one_list_per_key(buffers.len(), fragments.len(), "fragment list")?;
        self.check_chunk_bytes(chunk_bytes)?;
        let slot = self.open_handle_slot()?;
        let lists: Vec<&[Region<'static>]> = buffers.iter().map(std::slice::from_ref).collect();
        let routes: Vec<Route> = lists.iter().map(|l| Route::of(l)).collect();
        let transports = self.transports(&routes, None);
        let checks = self.check_lists(&transports, &lists, &routes, true);
        // Bounded before anything is allocated per chunk (a fragment past its buffer is one).
        let chunks: u64 = buffers
            .iter()
            .zip(fragments)
            .flat_map(|(region, frags)| {
                frags.iter().map(move |f| {
                    if region.check_range(f.dst_offset, f.len).is_ok() {
                        chunk_count(f.len, chunk_bytes)
                    } else {
                        1
                    }
                })
            })
            .sum();
        check_chunk_count(chunks)?;
        let mut plan = ReadPlan::new();
        let mut key_index = KeyIndex::with_capacity(fragments.iter().map(Vec::len).sum());
        for (b, (region, frags)) in buffers.iter().zip(fragments).enumerate() {
            for f in frags {
                let (k, added) = key_index.index_of(f.key.as_slice());
                if added {
                    plan.keys.push(KeyState {
                        key: f.key.as_slice().into(),
                        shard: if f.key.is_empty() { 0 } else { self.shard_of(&f.key) },
                        source: Source::ByKey,
                        grant: None,
                        asked: None,
                        error: None,
                        chunks_left: 0,
                    });
                }
                let error = self
                    .validate_key(&f.key)
                    .and_then(|()| checks[b].clone().map_or(Ok(()), Err))
                    .and_then(|()| region.check_range(f.dst_offset, f.len).map_err(Error::from))
                    .and_then(|()| {
                        f.src_offset.checked_add(f.len).map(|_| ()).ok_or_else(|| {
                            Error::InvalidArgument(format!("fragment of {} bytes at {} overflows", f.len, f.src_offset))
                        })
                    })
                    .err();
                let span = ChunkSpan {
                    key: k,
                    buffer: b,
                    route: routes[b],
                    src_offset: f.src_offset,
                    dst_offset: f.dst_offset,
                    len: f.len,
                };
                plan.add_chunks(region, span, chunk_bytes, error);
            }
        }
        // Keys whose every chunk failed its checks are never leased.
        for (k, key) in plan.keys.iter_mut().enumerate() {
            if plan.chunks.iter().filter(|c| c.key == k).all(|c| c.error.is_some()) {
                key.error = Some(Error::Cancelled);
            }
        }
        Ok(self.start_driver(plan, transports, slot))
    }

    /// The checks and the handle slot of a read into one destination.
    fn open_single(&self, dst: &Region<'static>, chunk_bytes: u64) -> Result<(HandleSlot, Route, Transports)> {
        self.check_chunk_bytes(chunk_bytes)?;
        let slot = self.open_handle_slot()?;
        let route = Route::of(std::slice::from_ref(dst));
        let transports = self.transports(&[route], None);
        if let Some(e) = self.check_lists(&transports, &[std::slice::from_ref(dst)], &[route], true).pop().flatten() {
            return Err(e);
        }
        Ok((slot, route, transports))
    }

    fn check_chunk_bytes(&self, chunk_bytes: u64) -> Result<()> {
        if chunk_bytes == 0 {
            return Err(Error::InvalidArgument("chunk_bytes must be at least 1".into()));
        }
        Ok(())
    }

    fn counters_stream(&self) -> &StreamCounters {
        &self.streams
    }

    /// Takes one of the `[stream] max_handles` slots; the driver gives it back.
    fn open_handle_slot(&self) -> Result<HandleSlot> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        let limit = self.config.stream_max_handles;
        let open = self.streams.handles_open.fetch_add(1, Ordering::Relaxed);
        if open >= limit as u64 {
            self.streams.handles_open.fetch_sub(1, Ordering::Relaxed);
            return Err(Error::Busy { limit });
        }
        self.streams.handles.fetch_add(1, Ordering::Relaxed);
        Ok(HandleSlot(Some(Arc::clone(&self.streams))))
    }

    /// Leases one key for a driver that releases it itself.
    fn lease_for_stream(&self, shard: usize, key: &[u8]) -> Result<ReadGrant> {
        let rx = self.send_with_reply(shard, |reply| Request::LeaseRead {
            keys: vec![key.into()],
            ttl: None,
            early: true,
            reply,
        })?;
        self.recv_reply(&rx)?.pop().ok_or(Error::Internal("empty lease reply"))?
    }

    /// Starts the driver of `plan` on its own thread and returns its handle.
    fn start_driver(&self, plan: ReadPlan, transports: Transports, mut slot: HandleSlot) -> ChunkHandle {
        let ReadPlan { keys, chunks, places } = plan;
        let (handle, sink) = chunk_pair(places);
        // The driver owns the handle slot from here: its drop gives the slot back.
        slot.0 = None;
        let driver = ReadDriver {
            sink,
            keys,
            chunks,
            inboxes: self.shards.iter().map(|s| Arc::clone(&s.inbox)).collect(),
            transports,
            window: self.config.stream_window_chunks,
            counters: Arc::clone(&self.streams),
            gpu: Arc::clone(self.gpu.counters()),
            _arena: Arc::clone(&self.arena),
        };
        // A driver that cannot start is dropped: its leases go back and its chunks fail.
        if let Err(e) = std::thread::Builder::new().name("kvtide-stream".into()).spawn(move || driver.run()) {
            tracing::error!(error = %e, "could not start a stream driver thread");
        }
        handle
    }
}

/// A handle slot taken but not yet handed to a driver (given back if the call fails first).
struct HandleSlot(Option<Arc<StreamCounters>>);

impl Drop for HandleSlot {
    fn drop(&mut self) {
        if let Some(counters) = self.0.take() {
            counters.handles_open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
