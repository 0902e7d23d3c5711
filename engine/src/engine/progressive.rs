//! Progressive puts: an object published after its chunks were written in any order.
//!
//! Owns the unsealed objects: their reservations, which chunks landed, their lifetime
//! (`[stream] unsealed_ttl_ms`, enforced by a reaper thread) and the per-shard bound on their
//! bytes (`[stream] unsealed_bytes_per_shard`). Readers that follow a producer
//! (`Engine::progressive_get_unsealed`) wait here for the chunks they need. It never publishes
//! an object with a chunk missing, never gives a reservation back while a chunk is being
//! written into it, and never lets a follower wait on a producer that is gone.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use kvtide_transport::{Direction, Piece, Region, Transfer};

use super::transports::Route;
use super::Engine;
use crate::api::PutOptions;
use crate::chunks::{check_chunk_count, chunk_count, cut, ChunkPlace};
use crate::error::{Error, Result};
use crate::shard::{Inbox, ObjectRef, Request};
use crate::stats::StreamCounters;

/// The longest the reaper sleeps between looks (so it notices a closed registry).
const REAPER_NAP: Duration = Duration::from_millis(200);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Open,
    /// The commit was sent; nothing may end the reservation meanwhile.
    Sealing,
    Sealed,
    /// Aborted, dropped, expired, failed to seal or shut down: why.
    Gone(String),
}

impl Phase {
    /// Ok while chunks may be written and the put sealed.
    fn check_open(&self) -> Result<()> {
        match self {
            Phase::Open => Ok(()),
            Phase::Gone(why) => Err(Error::ProducerAborted(why.clone())),
            Phase::Sealing | Phase::Sealed => {
                Err(Error::InvalidArgument("the progressive put is already sealed".into()))
            }
        }
    }
}

struct State {
    landed: Vec<bool>,
    landed_count: usize,
    writing: Vec<bool>,
    writers: usize,
    phase: Phase,
    /// The reservation was given back to its shard (an abort was sent).
    released: bool,
}

/// One unsealed progressive put.
pub(crate) struct Unsealed {
    shard: usize,
    object: ObjectRef,
    host: u64,
    len: u64,
    chunk_bytes: u64,
    deadline: Instant,
    inbox: Arc<Inbox>,
    counters: Arc<StreamCounters>,
    shard_bytes: Arc<Vec<AtomicU64>>,
    state: Mutex<State>,
    changed: Condvar,
}

impl Unsealed {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    pub(crate) fn shard(&self) -> usize {
        self.shard
    }

    pub(crate) fn object(&self) -> ObjectRef {
        self.object
    }

    fn is_open(&self) -> bool {
        self.lock().phase == Phase::Open
    }

    /// True once it ended without a seal.
    pub(crate) fn ended(&self) -> bool {
        matches!(self.lock().phase, Phase::Gone(_))
    }

    /// The error a follower gets once the producer is gone.
    pub(crate) fn gone_error(&self) -> Error {
        match &self.lock().phase {
            Phase::Gone(why) => Error::ProducerAborted(why.clone()),
            // Sealed, then replaced or evicted before the follower leased it.
            _ => Error::NotFound,
        }
    }

    /// Chunks of the producer that cover `range` of the object.
    /// An empty range is under the chunk at its position (the last one at the end), so a reader
    /// of an empty object still waits for the producer's one empty chunk (and sees an abort).
    fn chunks_under(&self, range: &Range<u64>) -> Range<usize> {
        let chunks = chunk_count(self.len, self.chunk_bytes) as usize;
        let first = ((range.start / self.chunk_bytes) as usize).min(chunks - 1);
        let end = if range.end > range.start { range.end.div_ceil(self.chunk_bytes) as usize } else { first + 1 };
        first..end.min(chunks)
    }

    /// True when the producer's chunks under `range` landed (or the put was sealed).
    fn has_landed(&self, range: &Range<u64>) -> bool {
        let under = self.chunks_under(range);
        let state = self.lock();
        matches!(state.phase, Phase::Sealed | Phase::Sealing) || state.landed[under].iter().all(|&l| l)
    }

    /// Blocks until the producer's chunks under `range` landed (Ok), the producer is gone
    /// (ProducerAborted), or `cancelled()` says to stop (Cancelled), checking every `nap`.
    pub(crate) fn wait_landed(&self, range: Range<u64>, nap: Duration, cancelled: impl Fn() -> bool) -> Result<()> {
        let under = self.chunks_under(&range);
        let mut state = self.lock();
        loop {
            // Bytes that landed stay valid under the reader's hold, even once the producer is
            // gone: only what never landed fails.
            if state.landed[under.clone()].iter().all(|&l| l) {
                return Ok(());
            }
            match &state.phase {
                Phase::Gone(why) => return Err(Error::ProducerAborted(why.clone())),
                Phase::Sealed | Phase::Sealing => return Ok(()),
                Phase::Open => {}
            }
            if cancelled() {
                return Err(Error::Cancelled);
            }
            let now = Instant::now();
            if now >= self.deadline {
                drop(state);
                self.end(EndReason::Expired);
                state = self.lock();
                continue;
            }
            let nap = nap.min(self.deadline - now);
            state = self.changed.wait_timeout(state, nap).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Ends an open put: followers fail with ProducerAborted, the reservation goes back once no
    /// chunk is being written into it. No effect once sealing started or it already ended.
    fn end(&self, reason: EndReason) {
        let mut state = self.lock();
        if state.phase != Phase::Open {
            return;
        }
        state.phase = Phase::Gone(reason.why().into());
        match reason {
            EndReason::Expired => self.counters.unsealed_expired.fetch_add(1, Ordering::Relaxed),
            _ => self.counters.producer_aborts.fetch_add(1, Ordering::Relaxed),
        };
        self.uncount();
        if state.writers == 0 {
            self.release(&mut state);
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Gives the reservation back (once; only when nothing writes into it).
    fn release(&self, state: &mut State) {
        if !state.released {
            state.released = true;
            // A shard that is gone dropped the reservation with it.
            let _ = self.inbox.send(Request::Abort { objects: vec![self.object] });
        }
    }

    /// Takes the put out of the unsealed counters (when it is sealed or ends).
    fn uncount(&self) {
        self.counters.unsealed_objects.fetch_sub(1, Ordering::Relaxed);
        self.counters.unsealed_bytes.fetch_sub(self.len, Ordering::Relaxed);
        self.shard_bytes[self.shard].fetch_sub(self.len, Ordering::Relaxed);
    }
}

#[derive(Clone, Copy, Debug)]
enum EndReason {
    Aborted,
    Dropped,
    Expired,
    ShutDown,
}

impl EndReason {
    fn why(self) -> &'static str {
        match self {
            EndReason::Aborted => "it aborted",
            EndReason::Dropped => "it dropped its stream without sealing",
            EndReason::Expired => "it stayed unsealed past [stream] unsealed_ttl_ms",
            EndReason::ShutDown => "the store shut down",
        }
    }
}

/// The unsealed puts of one engine, by key.
pub(crate) struct UnsealedPuts {
    by_key: Mutex<HashMap<Box<[u8]>, Arc<Unsealed>>>,
    wake: Condvar,
    shard_bytes: Arc<Vec<AtomicU64>>,
    limit_per_shard: u64,
    ttl: Duration,
    reaper_started: AtomicBool,
    closed: AtomicBool,
}

impl UnsealedPuts {
    pub(crate) fn new(shards: usize, limit_per_shard: u64, ttl: Duration) -> UnsealedPuts {
        UnsealedPuts {
            by_key: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
            shard_bytes: Arc::new((0..shards).map(|_| AtomicU64::new(0)).collect()),
            limit_per_shard,
            ttl,
            reaper_started: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Box<[u8]>, Arc<Unsealed>>> {
        self.by_key.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The open put of `key`, if any.
    pub(crate) fn open_put(&self, key: &[u8]) -> Option<Arc<Unsealed>> {
        self.lock().get(key).filter(|u| u.is_open()).cloned()
    }

    /// Ends every open put (the store is shutting down) and stops the reaper.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let puts: Vec<Arc<Unsealed>> = self.lock().drain().map(|(_, u)| u).collect();
        for put in puts {
            put.end(EndReason::ShutDown);
        }
        self.wake.notify_all();
    }

    fn forget(&self, key: &[u8], put: &Arc<Unsealed>) {
        let mut map = self.lock();
        if map.get(key).is_some_and(|u| Arc::ptr_eq(u, put)) {
            map.remove(key);
        }
    }

    /// Ends the puts whose TTL passed; returns when the next one is due.
    fn expire(&self, now: Instant) -> Option<Instant> {
        let due: Vec<(Box<[u8]>, Arc<Unsealed>)> = {
            let mut map = self.lock();
            // Puts that ended otherwise leave the map here too.
            map.retain(|_, u| u.is_open());
            map.iter().filter(|(_, u)| u.deadline <= now).map(|(k, u)| (k.clone(), Arc::clone(u))).collect()
        };
        for (key, put) in due {
            put.end(EndReason::Expired);
            self.forget(&key, &put);
        }
        self.lock().values().map(|u| u.deadline).min()
    }

    /// Starts the reaper thread once (it holds only a weak reference and stops with the store).
    fn start_reaper(self: &Arc<Self>) {
        if self.reaper_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<UnsealedPuts> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("kvtide-unsealed".into()).spawn(move || loop {
            let Some(puts) = weak.upgrade() else { return };
            if puts.closed.load(Ordering::SeqCst) {
                return;
            }
            let now = Instant::now();
            let next = puts.expire(now);
            let nap = next.map_or(REAPER_NAP, |at| at.saturating_duration_since(now).min(REAPER_NAP));
            let map = puts.lock();
            let _ = puts.wake.wait_timeout(map, nap);
        });
        if let Err(e) = spawned {
            // Without the reaper, followers and the producer's own calls still end expired puts.
            self.reaper_started.store(false, Ordering::Release);
            tracing::error!(error = %e, "could not start the unsealed-put reaper");
        }
    }
}

/// The producer's side of a progressive put (`Engine::progressive_put`): write chunks in any
/// order (from any thread: `put_chunk` takes `&self`), then `seal` to publish. Until then the
/// object is invisible to the object API; `Engine::progressive_get_unsealed` follows it.
/// Dropping it unsealed aborts it.
pub struct PutStream<'e> {
    engine: &'e Engine,
    key: Box<[u8]>,
    put: Arc<Unsealed>,
    places: Vec<ChunkPlace>,
    opts: PutOptions,
    finished: bool,
}

impl std::fmt::Debug for PutStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PutStream").field("len", &self.put.len).field("chunks", &self.places.len()).finish()
    }
}

impl PutStream<'_> {
    /// Number of chunks.
    pub fn num_chunks(&self) -> usize {
        self.places.len()
    }

    /// Byte range of chunk `i` in the object.
    pub fn chunk_range(&self, i: usize) -> Option<Range<u64>> {
        self.places.get(i).map(|p| p.range.clone())
    }

    /// The object's length.
    pub fn total_bytes(&self) -> u64 {
        self.put.len
    }

    /// Chunks written so far.
    pub fn chunks_written(&self) -> usize {
        self.put.lock().landed_count
    }

    fn range_of(&self, i: usize) -> Result<Range<u64>> {
        self.chunk_range(i).ok_or_else(|| {
            Error::InvalidArgument(format!("chunk {i} does not exist (the put has {} chunks)", self.places.len()))
        })
    }

    /// Writes chunk `i` from `src` (exactly `chunk_range(i)`'s length; host or GPU memory). A
    /// chunk is written once; followers see it as soon as this returns.
    pub fn put_chunk(&self, i: usize, src: Region<'_>) -> Result<()> {
        let range = self.range_of(i)?;
        let len = range.end - range.start;
        if src.len() as u64 != len {
            return Err(Error::SizeMismatch { object_bytes: len, destination_bytes: src.len() as u64 });
        }
        let route = Route::of(std::slice::from_ref(&src));
        let transports = self.engine.transports(&[route], None);
        if let Some(e) =
            self.engine.check_lists(&transports, &[std::slice::from_ref(&src)], &[route], false).pop().flatten()
        {
            return Err(e);
        }
        self.write_chunk(i, |range| {
            let transfer = Transfer {
                host: self.put.host,
                host_len: self.put.len,
                pieces: vec![Piece { host_offset: range.start, addr: src.addr(), len, kind: src.kind() }],
            };
            // SAFETY: `write_chunk` gives this call chunk `i` of the reservation alone until it
            // returns (see there); the source passed its transport's check and is borrowed for
            // the call.
            match unsafe { transports.get(route).submit(Direction::DeviceToHost, &[transfer], None) } {
                Ok(inflight) => inflight
                    .wait()
                    .pop()
                    .unwrap_or(Err(kvtide_transport::TransportError::Io("a transfer gave no result".into()))),
                Err(e) => Err(e),
            }
            .map_err(Error::from)
        })
    }

    /// Writes chunk `i` in place: `fill` gets the chunk's bytes of the reservation (host memory)
    /// and must fill all of them, or fail (the chunk then stays unwritten and may be written
    /// again). The owner process reads a socket straight into it. Same rules as `put_chunk`.
    pub fn fill_chunk(&self, i: usize, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        self.write_chunk(i, |range| {
            // SAFETY: `write_chunk` gives this call chunk `i` of the reservation alone until it
            // returns; the range lies inside the reservation (a chunk range of the object).
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(
                    (self.put.host + range.start) as *mut u8,
                    (range.end - range.start) as usize,
                )
            };
            fill(bytes)
        })
    }

    /// Runs `write(range of chunk i)` with chunk `i` of the reservation given to it alone: the
    /// reservation stays ours while `writers` counts the write (`end` and `seal` wait for
    /// writers to reach zero) and `writing[i]` keeps every other writer of the chunk out. The
    /// chunk lands when `write` succeeds.
    fn write_chunk(&self, i: usize, write: impl FnOnce(Range<u64>) -> Result<()>) -> Result<()> {
        let range = self.range_of(i)?;
        {
            let mut state = self.put.lock();
            state.phase.check_open()?;
            if Instant::now() >= self.put.deadline {
                drop(state);
                self.put.end(EndReason::Expired);
                return Err(Error::ProducerAborted(EndReason::Expired.why().into()));
            }
            if state.landed[i] || state.writing[i] {
                return Err(Error::AlreadyExists);
            }
            state.writing[i] = true;
            state.writers += 1;
        }
        let outcome = if range.is_empty() { Ok(()) } else { write(range) };
        let mut state = self.put.lock();
        state.writing[i] = false;
        state.writers -= 1;
        if outcome.is_ok() {
            state.landed[i] = true;
            state.landed_count += 1;
        }
        if state.writers == 0 && matches!(state.phase, Phase::Gone(_)) {
            // Ended while this chunk was written: the reservation goes back now.
            self.put.release(&mut state);
        }
        drop(state);
        self.put.changed.notify_all();
        outcome
    }

    /// Publishes the object once every chunk was written (an error names the missing ones and
    /// leaves the put open). After it, readers see the object like any other.
    pub fn seal(&mut self) -> Result<()> {
        {
            let mut state = self.put.lock();
            state.phase.check_open()?;
            if state.landed_count < state.landed.len() || state.writers > 0 {
                let missing: Vec<usize> = (0..state.landed.len()).filter(|&i| !state.landed[i]).take(8).collect();
                return Err(Error::InvalidArgument(format!(
                    "{} of {} chunks are not written yet (first missing: {missing:?})",
                    state.landed.len() - state.landed_count,
                    state.landed.len()
                )));
            }
            state.phase = Phase::Sealing;
        }
        let shard = self.put.shard;
        let (upsert, pin) = (self.opts.upsert, self.opts.pin);
        let result = self
            .engine
            .call(shard, |reply| Request::Commit { objects: vec![self.put.object], upsert, pin, reply })
            .and_then(|mut r| r.pop().unwrap_or(Err(Error::Internal("no commit result"))));
        {
            let mut state = self.put.lock();
            // The shard has either published the object or dropped the reservation.
            state.released = true;
            state.phase = match &result {
                Ok(()) => Phase::Sealed,
                Err(e) => Phase::Gone(format!("its seal failed: {e}")),
            };
        }
        self.put.uncount();
        match &result {
            Ok(()) => self.engine.streams.sealed.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.engine.streams.producer_aborts.fetch_add(1, Ordering::Relaxed),
        };
        self.put.changed.notify_all();
        self.engine.unsealed.forget(&self.key, &self.put);
        self.finished = true;
        result
    }

    /// Gives up: followers fail with ProducerAborted, the reservation goes back.
    pub fn abort(mut self) {
        self.finish(EndReason::Aborted);
    }

    fn finish(&mut self, reason: EndReason) {
        if !self.finished {
            self.finished = true;
            self.put.end(reason);
            self.engine.unsealed.forget(&self.key, &self.put);
        }
    }
}

impl Drop for PutStream<'_> {
    fn drop(&mut self) {
        self.finish(EndReason::Dropped);
    }
}

/// A reader's hold on an unsealed progressive put (`Engine::follow_unsealed`): the producer's
/// bytes stay in place while it lives, whatever happens to the key after the seal. The owner
/// process streams them to remote readers as they land.
pub struct Following {
    put: Arc<Unsealed>,
    grant: crate::shard::ReadGrant,
    inbox: Arc<Inbox>,
    _arena: Arc<kvtide_tiers::dram::Arena>,
}

impl std::fmt::Debug for Following {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Following").field("len", &self.grant.len).finish()
    }
}

impl Following {
    /// The object's length.
    pub fn len(&self) -> u64 {
        self.grant.len
    }

    /// True for an empty object.
    pub fn is_empty(&self) -> bool {
        self.grant.len == 0
    }

    /// The producer's chunk size (its chunks land one by one).
    pub fn chunk_bytes(&self) -> u64 {
        self.put.chunk_bytes
    }

    /// Waits at most `timeout_ms` for the producer's bytes of `range`: Ok(true) once they
    /// landed (then `bytes` gives them), Ok(false) when the time ran out, `ProducerAborted` when
    /// the producer is gone.
    pub fn wait_landed(&self, range: Range<u64>, timeout_ms: u64) -> Result<bool> {
        kvtide_transport::region::check_range(
            "object",
            range.start,
            range.end.saturating_sub(range.start),
            self.len(),
        )?;
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        match self.put.wait_landed(range, Duration::from_millis(timeout_ms.clamp(1, 20)), || Instant::now() >= deadline)
        {
            Ok(()) => Ok(true),
            Err(Error::Cancelled) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The producer's bytes of `range`, once they landed (`InvalidArgument` before).
    pub fn bytes(&self, range: Range<u64>) -> Result<&[u8]> {
        let len = range.end.saturating_sub(range.start);
        kvtide_transport::region::check_range("object", range.start, len, self.len())?;
        if !self.put.has_landed(&range) {
            return Err(Error::InvalidArgument("those bytes have not landed yet".into()));
        }
        // SAFETY: the lease keeps the reservation (or the object it became) in place until this
        // drops; the range lies inside it and its chunks landed, so no producer writes it any
        // more (each chunk is written once, before it lands).
        Ok(unsafe { std::slice::from_raw_parts(self.grant.ptr.as_ptr().add(range.start as usize), len as usize) })
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        // A shard that is gone dropped its leases with it.
        let _ = self.inbox.send(Request::Release { leases: vec![self.grant.lease] });
    }
}

impl Engine {
    /// Follows the unsealed progressive put of `key`, if one is open (None otherwise: read the
    /// key as usual). The hold is taken now.
    pub fn follow_unsealed(&self, key: &[u8]) -> Result<Option<Following>> {
        self.validate_key(key)?;
        let Some(put) = self.unsealed.open_put(key) else { return Ok(None) };
        let Some(grant) = self.lease_unsealed(&put)? else { return Ok(None) };
        let inbox = Arc::clone(&self.shards[put.shard()].inbox);
        Ok(Some(Following { put, grant, inbox, _arena: Arc::clone(&self.arena) }))
    }

    /// Leases the reservation of `put` (or the object it became): None when it was sealed and
    /// then replaced or evicted already (read the key as usual), `ProducerAborted` when it ended
    /// unsealed.
    pub(crate) fn lease_unsealed(&self, put: &Unsealed) -> Result<Option<crate::shard::ReadGrant>> {
        let object = put.object();
        let rx = self.send_with_reply(put.shard(), |reply| Request::LeaseObjects { objects: vec![object], reply })?;
        match self.recv_reply(&rx)?.pop().ok_or(Error::Internal("empty lease reply"))? {
            Ok(grant) => Ok(Some(grant)),
            Err(Error::NotFound) if !put.ended() => Ok(None),
            Err(Error::NotFound) => Err(put.gone_error()),
            Err(e) => Err(e),
        }
    }

    /// Starts a progressive put of `total_bytes` under `key`, written as chunks of `chunk_bytes`
    /// (the last one shorter) in any order, published by `PutStream::seal`. One unsealed put per
    /// key at a time (`AlreadyExists`); unsealed bytes per shard are bounded
    /// (`[stream] unsealed_bytes_per_shard`, `TooLarge`) and live at most
    /// `[stream] unsealed_ttl_ms`. An insert of an existing key is refused here, and fails at
    /// the seal if the key appeared meanwhile (`AlreadyExists`); an upsert replaces it there.
    pub fn progressive_put(
        &self,
        key: &[u8],
        total_bytes: u64,
        chunk_bytes: u64,
        opts: PutOptions,
    ) -> Result<PutStream<'_>> {
        self.validate_key(key)?;
        self.validate_value_len(total_bytes)?;
        if chunk_bytes == 0 {
            return Err(Error::InvalidArgument("chunk_bytes must be at least 1".into()));
        }
        check_chunk_count(chunk_count(total_bytes, chunk_bytes))?;
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        let puts = &self.unsealed;
        let shard = self.shard_of(key);
        puts.expire(Instant::now());
        let held = puts.shard_bytes[shard].fetch_add(total_bytes, Ordering::AcqRel);
        let undo = || puts.shard_bytes[shard].fetch_sub(total_bytes, Ordering::AcqRel);
        if held + total_bytes > puts.limit_per_shard {
            undo();
            return Err(Error::TooLarge {
                what: "unsealed bytes of the key's shard ([stream] unsealed_bytes_per_shard)",
                len: held + total_bytes,
                max: puts.limit_per_shard,
            });
        }
        if puts.open_put(key).is_some() {
            undo();
            return Err(Error::AlreadyExists);
        }
        let (mut grants, reservations) = self.reserve_many(std::iter::once((0, key, total_bytes)), opts.upsert, || {});
        let grant = match grants.remove(&0).unwrap_or(Err(Error::Internal("no reservation"))) {
            Ok(grant) => grant,
            Err(e) => {
                undo();
                return Err(e);
            }
        };
        // The unsealed put owns the reservation from here (commit or abort by message).
        reservations.forget();
        let places: Vec<ChunkPlace> = cut(0, 0, total_bytes, chunk_bytes).collect();
        let put = Arc::new(Unsealed {
            shard,
            object: grant.object,
            host: grant.ptr.as_ptr() as u64,
            len: total_bytes,
            chunk_bytes,
            deadline: Instant::now() + puts.ttl,
            inbox: Arc::clone(&self.shards[shard].inbox),
            counters: Arc::clone(&self.streams),
            shard_bytes: Arc::clone(&puts.shard_bytes),
            state: Mutex::new(State {
                landed: vec![false; places.len()],
                landed_count: 0,
                writing: vec![false; places.len()],
                writers: 0,
                phase: Phase::Open,
                released: false,
            }),
            changed: Condvar::new(),
        });
        self.streams.unsealed_objects.fetch_add(1, Ordering::Relaxed);
        self.streams.unsealed_bytes.fetch_add(total_bytes, Ordering::Relaxed);
        {
            let mut map = puts.lock();
            if map.get(key).is_some_and(|u| u.is_open()) {
                // Another producer of the key got in first.
                drop(map);
                put.end(EndReason::Aborted);
                return Err(Error::AlreadyExists);
            }
            map.insert(key.into(), Arc::clone(&put));
        }
        puts.start_reaper();
        Ok(PutStream { engine: self, key: key.into(), put, places, opts, finished: false })
    }
}
