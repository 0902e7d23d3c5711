//! Stream-bound reads through the owner: `RemoteStore::*_on_stream`, as the embedded engine's.
//!
//! Owns the client side of reads whose copies are enqueued on the caller's CUDA stream: the leases
//! (over the Unix socket, the owner leases every key at once and the client keeps the connection
//! that holds them, out of the pool, until the stream passed the copies), the copies from the arena
//! mapping onto the stream (elsewhere, from host buffers each piece was read into first, which the
//! read keeps until then, within `max_stream_host_bytes`), and the watch thread that sees the
//! stream pass the copies, releases the leases and ends the ticket. It never releases a lease
//! before the stream passed the copies that read it, except once the owner's lease TTL is near:
//! then the read is reported `StreamExpired`, as the embedded engine does.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use kvtide::{
    checks, Error as StoreError, Fragment, StepLayer, StepReads, Store, StreamCompleter, StreamHandle, StreamSignal,
    StreamTicket,
};
use kvtide_transport::{InFlight, Region, Transfer, Transport};

use super::conn::{Conn, LEASE_MARGIN};
use super::Inner;
use super::RemoteStore;
use crate::error::{Error, Result};
use crate::protocol::{decode_grants, GetItem, LenCheck, Op, ProtocolError, Request};
use crate::shm::ShmMapping;
use crate::wire::WResult;

/// How often the watch thread looks at the reads in flight.
const WATCH_INTERVAL: Duration = Duration::from_micros(200);

/// A stream-bound read in flight.
struct Bound {
    /// Each submission (one per layer of a step) and the result slot of each of its transfers.
    parts: Vec<(InFlight, Vec<usize>)>,
    results: Vec<std::result::Result<usize, StoreError>>,
    completer: Option<StreamCompleter>,
    /// The connection holding the leases, and their ids (None: the bytes are in `buffers`).
    held: Option<Held>,
    /// Host copies of the pieces the copies read from (TCP, or no shared arena).
    buffers: Option<HostBytes>,
    /// When the owner may start reclaiming the leases.
    expires_at: Instant,
    lease_ttl_ms: u64,
}

/// The reads a `RemoteStore` has in flight, and the thread that watches them.
#[derive(Default)]
pub(super) struct Watch {
    reads: Mutex<Vec<Bound>>,
    added: Condvar,
    started: Mutex<bool>,
}

impl Watch {
    fn add(inner: &Arc<Inner>, read: Bound) -> Result<()> {
        let watch = &inner.watch;
        watch.reads.lock().unwrap_or_else(|p| p.into_inner()).push(read);
        watch.added.notify_all();
        let mut started = watch.started.lock().unwrap_or_else(|p| p.into_inner());
        if !*started {
            let weak = Arc::downgrade(inner);
            std::thread::Builder::new()
                .name("kvtide-remote-watch".into())
                .spawn(move || watch_loop(weak))
                .map_err(|e| StoreError::Io(format!("cannot start the stream watch thread: {e}")))?;
            *started = true;
        }
        Ok(())
    }
}

/// Polls the reads in flight until the store is gone; ends each as its stream passes it.
fn watch_loop(inner: Weak<Inner>) {
    loop {
        let Some(store) = inner.upgrade() else { return };
        let mut reads = store.watch.reads.lock().unwrap_or_else(|p| p.into_inner());
        if reads.is_empty() {
            // Wakes up now and then to notice that the store was dropped.
            let _ = store.watch.added.wait_timeout(reads, Duration::from_millis(100));
            continue;
        }
        let mut still = Vec::with_capacity(reads.len());
        for mut read in reads.drain(..) {
            if read.parts.iter_mut().all(|(inflight, _)| inflight.poll()) {
                finish(&store, read);
                continue;
            }
            if Instant::now() >= read.expires_at {
                // The owner may reclaim the bytes from now on: the read cannot be trusted.
                if let Some(completer) = read.completer.take() {
                    let ttl_ms = read.lease_ttl_ms;
                    completer.end(read.results.iter().map(|_| Err(StoreError::StreamExpired { ttl_ms })).collect());
                }
            }
            still.push(read);
        }
        *reads = still;
        drop(reads);
        drop(store);
        std::thread::sleep(WATCH_INTERVAL);
    }
}

/// The stream passed a read's copies: its leases go back, then its ticket ends.
fn finish(inner: &Inner, mut read: Bound) {
    for (inflight, slot_of) in &mut read.parts {
        for (slot, outcome) in slot_of.iter().zip(inflight.take_results()) {
            if let Err(e) = outcome {
                read.results[*slot] = Err(e.into());
            }
        }
    }
    if let Some((mut conn, rid, leases)) = read.held.take() {
        // A connection that cannot send the release is dropped, which releases everything.
        if conn.send_release(rid, leases).is_ok() {
            inner.pool.checkin(conn);
        }
    }
    // The host copies go back before the ticket ends, so a caller that saw it end sees them
    // uncounted.
    drop(read.buffers.take());
    inner.tickets_in_flight.fetch_sub(1, Ordering::AcqRel);
    if let Some(completer) = read.completer.take() {
        completer.end(read.results);
    }
}

/// Host buffers of a stream-bound read without the shared arena, one per piece, counted in
/// `stream_host_bytes` until dropped (when the stream passed the copies that read them).
pub(super) struct HostBytes {
    buffers: Vec<Box<[u8]>>,
    total: u64,
    counter: Arc<std::sync::atomic::AtomicU64>,
}

impl HostBytes {
    /// A buffer for every piece of `todo`, or `Busy` when they would take the client past
    /// `max_stream_host_bytes`.
    fn take(inner: &Inner, todo: &[Wanted<'_, '_>]) -> Result<HostBytes> {
        let lens: Vec<u64> = todo
            .iter()
            .flat_map(|w| &w.pieces)
            .map(|p| p.regions.iter().map(|r| r.len() as u64).sum::<u64>())
            .collect();
        let total: u64 = lens.iter().sum();
        let limit = inner.pool.options.max_stream_host_bytes;
        let counter = Arc::clone(&inner.stream_host_bytes);
        let before = counter.fetch_add(total, Ordering::AcqRel);
        if before.saturating_add(total) > limit {
            counter.fetch_sub(total, Ordering::AcqRel);
            return Err(StoreError::Busy { limit: usize::try_from(limit).unwrap_or(usize::MAX) }.into());
        }
        let mut held = HostBytes { buffers: Vec::with_capacity(lens.len()), total, counter };
        held.buffers.extend(lens.iter().map(|&n| vec![0u8; n as usize].into_boxed_slice()));
        Ok(held)
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.total, Ordering::AcqRel);
    }
}

/// One object of a stream-bound read: its key, length check and, per piece, where it goes.
struct Wanted<'a, 'r> {
    key: &'a [u8],
    check: LenCheck,
    pieces: Vec<Piece<'r>>,
}

/// A piece of an object that goes to one result slot: `[offset, +len of regions)` of the object
/// into `regions`, which lie in destination list `list`.
struct Piece<'r> {
    slot: usize,
    offset: u64,
    list: usize,
    regions: Vec<Region<'r>>,
}

impl RemoteStore {
    /// Makes later stream-bound reads to GPU `ordinal` allocate and compile nothing in the
    /// client: allocates the stream-bound staging and compiles the kernels (the arena mapping is
    /// registered with CUDA at the first read).
    pub fn prepare_gpu(&self, ordinal: u32) -> Result<()> {
        let transport = self.inner.gpu.transport();
        let submit = transport.on_stream().ok_or(StoreError::CudaUnavailable("no stream-bound transport"))?;
        submit.prepare(ordinal).map_err(|e| Error::from(StoreError::from(e)))
    }

    /// `Engine::batch_get_into_multi_buffers_on_stream` through the owner: when this returns,
    /// the copies of object i into `dsts[i]` are ordered on `stream`, and an event the caller
    /// records on it afterwards is a valid "KV ready" signal. Over the Unix socket the copies
    /// read the owner's arena, which stays leased until the client sees the stream pass them;
    /// over TCP each object is read into a host buffer first, which the read holds until the
    /// stream passed its copy (at most `ClientOptions::max_stream_host_bytes` in all, else
    /// `Busy`). Stream 0 is the blocking read.
    /// Per-key failures are in the ticket. A batch is leased whole, so it must fit the owner's
    /// DRAM.
    ///
    /// # Safety
    /// `stream` must be a live stream handle (or 0), and every destination must stay valid
    /// until the stream has passed the copies (the ticket no longer `Pending`).
    pub unsafe fn batch_get_into_multi_buffers_on_stream(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        stream: StreamHandle,
    ) -> Result<StreamTicket> {
        checks::one_list_per_key(keys.len(), dsts.len(), "destination")?;
        if stream == 0 {
            let results = self.batch_get_into_multi_buffers(keys, dsts);
            return Ok(StreamTicket::ended(results.into_iter().map(|r| r.map_err(into_store)).collect()));
        }
        let mut wanted = Vec::new();
        let mut results = Vec::new();
        objects_wanted(keys, dsts, 0, &mut wanted, &mut results);
        let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
        let one = [LayerEnd { slot_end: results.len(), signal: None }];
        // SAFETY: forwarded contract.
        unsafe { self.read_on_stream(wanted, results, &lists, &one, stream) }
    }

    /// `Engine::get_into_ranges_on_stream` through the owner, as
    /// `batch_get_into_multi_buffers_on_stream` does. The ticket has one result per fragment,
    /// buffer after buffer.
    ///
    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`.
    pub unsafe fn get_into_ranges_on_stream(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        stream: StreamHandle,
    ) -> Result<StreamTicket> {
        checks::fragment_lists(buffers.len(), fragments.len())?;
        if stream == 0 {
            let results = self.get_into_ranges(buffers, fragments).into_iter().flatten();
            return Ok(StreamTicket::ended(results.map(|r| r.map_err(into_store)).collect()));
        }
        let mut wanted = Vec::new();
        let mut index = std::collections::HashMap::new();
        let mut results = Vec::new();
        ranges_wanted(buffers, fragments, 0, &mut wanted, &mut index, &mut results);
        let lists: Vec<&[Region<'_>]> = buffers.iter().map(std::slice::from_ref).collect();
        let one = [LayerEnd { slot_end: results.len(), signal: None }];
        // SAFETY: forwarded contract.
        unsafe { self.read_on_stream(wanted, results, &lists, &one, stream) }
    }

    /// `Engine::step_on_stream` through the owner: every layer's keys leased in one request
    /// (over the Unix socket; over TCP read into host buffers in one pass), then per layer its
    /// copies and its signal on `stream`. Refused whole, before anything is leased, as the
    /// engine refuses a step (`kvtide::check_step`). The ticket has one result per key (or
    /// fragment), layer after layer. Stream 0 (no signals) reads the layers one after another,
    /// blocking.
    ///
    /// # Safety
    /// As `Engine::step_on_stream`.
    pub unsafe fn step_on_stream(&self, layers: &[StepLayer<'_, '_>], stream: StreamHandle) -> Result<StreamTicket> {
        kvtide::check_step(layers, stream)?;
        if stream == 0 {
            let mut results = Vec::new();
            for layer in layers {
                match layer.reads {
                    StepReads::Objects { keys, dsts } => results.extend(self.batch_get_into_multi_buffers(keys, dsts)),
                    StepReads::Ranges { buffers, fragments } => {
                        results.extend(self.get_into_ranges(buffers, fragments).into_iter().flatten())
                    }
                }
            }
            return Ok(StreamTicket::ended(results.into_iter().map(|r| r.map_err(into_store)).collect()));
        }
        let mut wanted = Vec::new();
        let mut index = std::collections::HashMap::new();
        let mut results = Vec::new();
        let mut lists: Vec<&[Region<'_>]> = Vec::new();
        let mut ends = Vec::with_capacity(layers.len());
        for layer in layers {
            match layer.reads {
                StepReads::Objects { keys, dsts } => {
                    checks::one_list_per_key(keys.len(), dsts.len(), "destination")?;
                    objects_wanted(keys, dsts, lists.len(), &mut wanted, &mut results);
                    lists.extend(dsts.iter().map(Vec::as_slice));
                }
                StepReads::Ranges { buffers, fragments } => {
                    checks::fragment_lists(buffers.len(), fragments.len())?;
                    ranges_wanted(buffers, fragments, lists.len(), &mut wanted, &mut index, &mut results);
                    lists.extend(buffers.iter().map(std::slice::from_ref));
                }
            }
            ends.push(LayerEnd { slot_end: results.len(), signal: layer.done });
        }
        // SAFETY: forwarded contract.
        unsafe { self.read_on_stream(wanted, results, &lists, &ends, stream) }
    }

    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`; `lists` are the destinations the pieces
    /// slice.
    unsafe fn read_on_stream(
        &self,
        wanted: Vec<Wanted<'_, '_>>,
        mut results: Vec<std::result::Result<usize, StoreError>>,
        lists: &[&[Region<'_>]],
        layers: &[LayerEnd],
        stream: StreamHandle,
    ) -> Result<StreamTicket> {
        let slots = results.len();
        let transport = self.inner.gpu.transport();
        let submit = transport.on_stream().ok_or(StoreError::CudaUnavailable(
            "stream-bound reads through RemoteStore need the cuda feature of kvtide-remote",
        ))?;
        submit.check_stream(stream).map_err(|e| Error::from(StoreError::from(e)))?;
        let limits = self.inner.pool.limits()?;
        // Every destination list, checked once; each piece's failure lands in its slot.
        let checked = self.inner.check_destination_lists(lists);
        let mut todo: Vec<Wanted<'_, '_>> = Vec::with_capacity(wanted.len());
        for mut w in wanted {
            let key_ok = self.inner.validate_key(&limits, w.key);
            w.pieces.retain(|piece| match key_ok.clone().and(checked[piece.list].clone()) {
                Err(e) => {
                    results[piece.slot] = Err(into_store(e));
                    false
                }
                Ok(()) => true,
            });
            if !w.pieces.is_empty() {
                todo.push(w);
            }
        }
        let signals = layers.iter().any(|l| l.signal.is_some());
        if todo.is_empty() && !signals {
            return Ok(StreamTicket::ended(results));
        }
        let limit = self.inner.pool.options.max_tickets_in_flight;
        if self.inner.tickets_in_flight.fetch_add(1, Ordering::AcqRel) >= limit as u64 {
            self.inner.tickets_in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Busy { limit }.into());
        }
        // SAFETY: forwarded contract.
        match unsafe { self.lease_and_submit(&todo, &mut results, &*transport, layers, stream) } {
            Ok(Submitted { parts, held, buffers, .. }) if parts.is_empty() => {
                // Nothing enqueued (or only signals): the leases and buffers go back now.
                if let Some((mut conn, rid, leases)) = held {
                    if conn.send_release(rid, leases).is_ok() {
                        self.inner.pool.checkin(conn);
                    }
                }
                drop(buffers);
                self.inner.tickets_in_flight.fetch_sub(1, Ordering::AcqRel);
                Ok(StreamTicket::ended(results))
            }
            Ok(Submitted { parts, held, buffers, ttl_ms }) => {
                let (ticket, completer) = StreamTicket::pending(slots);
                completer.set_pinned(held.as_ref().map_or(0, |(_, _, l)| l.len()));
                let read = Bound {
                    parts,
                    results,
                    completer: Some(completer),
                    held,
                    buffers,
                    expires_at: Instant::now() + Duration::from_millis(ttl_ms).saturating_sub(LEASE_MARGIN),
                    lease_ttl_ms: ttl_ms,
                };
                Watch::add(&self.inner, read)?;
                Ok(ticket)
            }
            Err(e) => {
                self.inner.tickets_in_flight.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// Leases (or reads) the objects and enqueues their copies on `stream`.
    ///
    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`.
    unsafe fn lease_and_submit(
        &self,
        todo: &[Wanted<'_, '_>],
        results: &mut [std::result::Result<usize, StoreError>],
        transport: &dyn Transport,
        layers: &[LayerEnd],
        stream: StreamHandle,
    ) -> Result<Submitted> {
        let submit = transport.on_stream().ok_or(StoreError::CudaUnavailable("no stream-bound transport"))?;
        let conn = match self.inner.pool.checkout() {
            Some(c) => c,
            None => self.inner.pool.open()?,
        };
        let mut copies = Copies::default();
        let (held, buffers, ttl_ms) = match conn.shm.clone() {
            Some(mapping) => {
                let (held, ttl_ms) = self.lease_in_arena(conn, &mapping, todo, results, &mut copies)?;
                (Some(held), None, ttl_ms)
            }
            None => {
                let ttl_ms = u64::from(conn.hello.lease_ttl_ms);
                self.inner.pool.checkin(conn);
                (None, Some(self.read_into_host(todo, results, &mut copies)?), ttl_ms)
            }
        };
        let planned = !copies.transfers.is_empty();
        // SAFETY: the host bytes are leased to `held`'s connection (or are `buffers`), both kept
        // until the stream passed the copies; the destinations were checked and are the
        // caller's until then (this call's contract), the signals' events and words too.
        let parts = unsafe { submit_layers(submit, stream, layers, copies, results) };
        if planned && parts.is_empty() && layers.len() == 1 && layers[0].signal.is_none() {
            // A plain read whose one submission failed: nothing was enqueued, and the call
            // fails as a whole (its keys' errors are the submission's).
            if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                if results.iter().all(|r| r.is_err()) {
                    return Err(e.clone().into());
                }
            }
        }
        Ok(Submitted { parts, held, buffers, ttl_ms })
    }

    /// Leases every object of `todo` in the owner's arena on `conn` and plans a copy of each
    /// piece straight out of the arena mapping. Returns the connection holding the leases (kept
    /// until the stream passed the copies) and the leases' TTL.
    fn lease_in_arena(
        &self,
        mut conn: Conn,
        mapping: &ShmMapping,
        todo: &[Wanted<'_, '_>],
        results: &mut [std::result::Result<usize, StoreError>],
        copies: &mut Copies,
    ) -> Result<(Held, u64)> {
        let rid = self.inner.pool.next_request.fetch_add(1, Ordering::Relaxed);
        let items: Vec<GetItem<'_>> = todo.iter().map(|w| GetItem { key: w.key, check: w.check }).collect();
        let (ttl_ms, grants) = conn
            .lease_all(rid, items, mapping.len())
            .map_err(|e| e.into_error("get", self.inner.pool.options.timeout_ms))??;
        let mut leases = Vec::new();
        for (w, grant) in todo.iter().zip(grants) {
            let grant = match grant {
                Ok(g) => g,
                Err(e) => {
                    w.pieces.iter().for_each(|p| results[p.slot] = Err(into_store(e.clone())));
                    continue;
                }
            };
            leases.push(grant.lease);
            if let Err(e) = w.check.check(grant.len) {
                w.pieces.iter().for_each(|p| results[p.slot] = Err(e.clone()));
                continue;
            }
            for piece in &w.pieces {
                let len: u64 = piece.regions.iter().map(|r| r.len() as u64).sum();
                let placed = kvtide_transport::region::check_range("object", piece.offset, len, grant.len)
                    .map_err(StoreError::from)
                    .and_then(|()| mapping.addr_of(grant.offset + piece.offset, len).map_err(into_store));
                match placed {
                    Ok(host) => copies.add(Transfer::in_order(host, len, &piece.regions), piece.slot, len, results),
                    Err(e) => results[piece.slot] = Err(e),
                }
            }
        }
        self.inner.gpu.pin(mapping.memory(), true);
        Ok(((conn, rid, leases), u64::from(ttl_ms)))
    }

    /// Without the shared arena: reads each piece of `todo` over the socket into a host buffer
    /// of its own (within `max_stream_host_bytes`) and plans its copy from there. Returns the
    /// buffers, kept until the stream passed the copies.
    fn read_into_host(
        &self,
        todo: &[Wanted<'_, '_>],
        results: &mut [std::result::Result<usize, StoreError>],
        copies: &mut Copies,
    ) -> Result<HostBytes> {
        let mut held_bytes = HostBytes::take(&self.inner, todo)?;
        let lens: Vec<u64> = held_bytes.buffers.iter().map(|b| b.len() as u64).collect();
        let regions: Vec<Region<'_>> = held_bytes.buffers.iter_mut().map(|b| Region::host(&mut b[..])).collect();
        // Whole objects (their length checked) and ranges of objects, one call each.
        let (mut whole_keys, mut whole_dsts, mut whole_at) = (Vec::new(), Vec::new(), Vec::new());
        let (mut range_dsts, mut ranges, mut range_at) = (Vec::new(), Vec::new(), Vec::new());
        let mut b = 0usize;
        for w in todo {
            for piece in &w.pieces {
                if let LenCheck::Exactly(_) = w.check {
                    whole_keys.push(w.key);
                    whole_dsts.push(vec![regions[b]]);
                    whole_at.push((b, piece));
                } else {
                    range_dsts.push(regions[b]);
                    ranges.push(vec![Fragment::new(w.key.to_vec(), piece.offset, 0, lens[b])]);
                    range_at.push((b, piece));
                }
                b += 1;
            }
        }
        let whole = self.batch_get_into_multi_buffers(&whole_keys, &whole_dsts);
        let ranged = self.get_into_ranges(&range_dsts, &ranges).into_iter().map(|mut r| {
            if r.is_empty() {
                Err(StoreError::Internal("a range result was missing").into())
            } else {
                r.remove(0)
            }
        });
        let outcomes: Vec<_> = whole.into_iter().chain(ranged).collect();
        drop((regions, whole_dsts, range_dsts));
        for ((b, piece), outcome) in whole_at.into_iter().chain(range_at).zip(outcomes) {
            match outcome {
                Ok(_) => {
                    let host = held_bytes.buffers[b].as_ptr() as u64;
                    copies.add(Transfer::in_order(host, lens[b], &piece.regions), piece.slot, lens[b], results);
                }
                Err(e) => results[piece.slot] = Err(into_store(e)),
            }
        }
        Ok(held_bytes)
    }
}

/// The connection holding a read's leases, the request they were granted to, and their ids.
type Held = (Conn, u64, Vec<u64>);

/// What `lease_and_submit` enqueued: the copies in flight, the result slot of each, and what
/// must stay until the stream passed them (the leases or the host buffers), with the TTL.
struct Submitted {
    /// One submission per layer that enqueued copies, with the result slot of each transfer.
    parts: Vec<(InFlight, Vec<usize>)>,
    held: Option<Held>,
    buffers: Option<HostBytes>,
    ttl_ms: u64,
}

/// The copies a stream-bound read plans, and the result slot of each.
#[derive(Default)]
struct Copies {
    transfers: Vec<Transfer>,
    slot_of: Vec<usize>,
}

impl Copies {
    /// Plans `transfer` of `len` bytes for result slot `slot`, which it will fill.
    fn add(
        &mut self,
        transfer: Transfer,
        slot: usize,
        len: u64,
        results: &mut [std::result::Result<usize, StoreError>],
    ) {
        self.transfers.push(transfer);
        self.slot_of.push(slot);
        results[slot] = Ok(len as usize);
    }
}

/// Where a step's layer ends among its result slots, and its signal.
#[derive(Clone, Copy)]
struct LayerEnd {
    slot_end: usize,
    signal: Option<StreamSignal>,
}

/// Objects read whole: object i of `keys` into `dsts[i]` (list `first_list + i`), result slots
/// appended to `results`.
fn objects_wanted<'a, 'r>(
    keys: &[&'a [u8]],
    dsts: &[Vec<Region<'r>>],
    first_list: usize,
    wanted: &mut Vec<Wanted<'a, 'r>>,
    results: &mut Vec<std::result::Result<usize, StoreError>>,
) {
    for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
        let total = regions.iter().map(|r| r.len() as u64).sum();
        let piece = Piece { slot: results.len(), offset: 0, list: first_list + i, regions: regions.clone() };
        wanted.push(Wanted { key, check: LenCheck::Exactly(total), pieces: vec![piece] });
        results.push(Err(StoreError::Internal("slot never read")));
    }
}

/// Fragments of objects into buffers (buffer b is list `first_list + b`): one wanted object per
/// key across the call (`index`), a piece per fragment. A fragment whose destination range is
/// bad gets its error and never reaches the owner.
fn ranges_wanted<'a, 'r>(
    buffers: &[Region<'r>],
    fragments: &'a [Vec<Fragment>],
    first_list: usize,
    wanted: &mut Vec<Wanted<'a, 'r>>,
    index: &mut std::collections::HashMap<&'a [u8], usize>,
    results: &mut Vec<std::result::Result<usize, StoreError>>,
) {
    for (b, frags) in fragments.iter().enumerate() {
        for frag in frags {
            let slot = results.len();
            match buffers[b].slice(frag.dst_offset, frag.len) {
                Ok(dst) => {
                    let w = *index.entry(frag.key.as_slice()).or_insert_with(|| {
                        wanted.push(Wanted { key: &frag.key, check: LenCheck::Any, pieces: Vec::new() });
                        wanted.len() - 1
                    });
                    let piece = Piece { slot, offset: frag.src_offset, list: first_list + b, regions: vec![dst] };
                    wanted[w].pieces.push(piece);
                    results.push(Err(StoreError::Internal("slot never read")));
                }
                Err(e) => results.push(Err(e.into())),
            }
        }
    }
}

/// Enqueues each layer's copies (those of its result slots) and then its signal. A layer whose
/// copies cannot be enqueued fails its slots and is still signalled; a signal that fails fails
/// its layer's slots.
///
/// # Safety
/// As `StreamSubmit::submit_on_stream` and `StreamSubmit::signal`.
unsafe fn submit_layers(
    submit: &dyn kvtide_transport::StreamSubmit,
    stream: StreamHandle,
    layers: &[LayerEnd],
    copies: Copies,
    results: &mut [std::result::Result<usize, StoreError>],
) -> Vec<(InFlight, Vec<usize>)> {
    // Copies are planned per object; a layer's are those of its slots.
    let mut order: Vec<usize> = (0..copies.transfers.len()).collect();
    order.sort_by_key(|&i| copies.slot_of[i]);
    let mut parts = Vec::with_capacity(layers.len());
    let (mut next, mut first_slot) = (0, 0);
    for layer in layers {
        let start = next;
        while next < order.len() && copies.slot_of[order[next]] < layer.slot_end {
            next += 1;
        }
        if start < next {
            let transfers: Vec<Transfer> = order[start..next].iter().map(|&i| copies.transfers[i].clone()).collect();
            let slot_of: Vec<usize> = order[start..next].iter().map(|&i| copies.slot_of[i]).collect();
            let gates = vec![None; transfers.len()];
            // SAFETY: forwarded contract.
            match unsafe { submit.submit_on_stream(stream, &transfers, &gates) } {
                Ok(inflight) => parts.push((inflight, slot_of)),
                Err(e) => {
                    let e = StoreError::from(e);
                    slot_of.iter().for_each(|&s| results[s] = Err(e.clone()));
                }
            }
        }
        if let Some(signal) = layer.signal {
            // SAFETY: forwarded contract.
            if let Err(e) = unsafe { submit.signal(stream, signal) } {
                let e = StoreError::from(e);
                results[first_slot..layer.slot_end].iter_mut().filter(|r| r.is_ok()).for_each(|r| *r = Err(e.clone()));
            }
        }
        first_slot = layer.slot_end;
    }
    parts
}

impl Conn {
    /// One `Get` in lease mode for every item, answered by one `Grants` frame.
    #[allow(clippy::type_complexity)]
    pub(super) fn lease_all(
        &mut self,
        rid: u64,
        items: Vec<GetItem<'_>>,
        arena_bytes: u64,
    ) -> WResult<Result<(u32, Vec<std::result::Result<crate::protocol::Grant, Error>>)>> {
        let count = items.len();
        self.request(rid, &Request::Get { lease: true, items }, Op::Grants, "grants", |conn, payload| {
            let (ttl_ms, grants) = decode_grants(payload, conn.limits.max_items, arena_bytes)?;
            if grants.len() != count {
                return Err(ProtocolError::Invalid { what: "grant count" }.into());
            }
            Ok((ttl_ms, grants))
        })
    }
}

/// A client error as the engine's error type (the ticket's): remote-only errors become `Io`.
fn into_store(e: Error) -> StoreError {
    match e {
        Error::Store(e) => e,
        other => StoreError::Io(other.to_string()),
    }
}
