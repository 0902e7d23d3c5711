//! Stream-bound reads (`*_on_stream`): the copies run on the caller's device stream, so an
//! event the caller records on it after the call is a "KV ready" signal another stream or a
//! captured graph can wait on, and the host never waits for the transfer.
//!
//! Owns the call (lease, plan, submit on the stream, before returning), the `StreamTicket` the
//! caller polls, and the shard task that keeps the objects leased until the shard sees the
//! stream pass the copies (an event recorded after them, polled by the shard loop; no host
//! callback), with `[gpu] stream_ttl_ms` as a backstop. Objects still loading from SSD are
//! leased early: the stream waits on a gate the load's end opens, and a failed load opens it
//! failed, which makes the staged copy skip its pages and the ticket report the key. It never
//! reports a key done before the stream passed its copies, and never releases a lease before
//! that (or the backstop).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvtide_transport::{Gate, InFlight, Region, StreamHandle, StreamSignal, Transfer, Transport};

use super::gpu::GpuCounters;
use super::key_index::KeyIndex;
use super::read::{plan_pieces, KeyRead, ReadTargets, Want};
use super::router::{ByIndex, HeldLeases};
use super::transports::{KeepAwake, Route};
use super::Engine;
use crate::api::Fragment;
use crate::checks;
use crate::error::{Error, Result};
use crate::shard::core::ShardCore;
use crate::shard::landing::Landing;
use crate::shard::task::{ShardTask, TaskPoll};
use crate::shard::{ReadGrant, Request};
use crate::step::{StepLayer, StepReads};
use crate::ticket::pending;

/// Where a stream-bound read stands (`StreamTicket::status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamStatus {
    /// The stream has not yet passed the copies (the objects stay leased).
    Pending,
    /// Every key's bytes were delivered; the leases are back.
    Done,
    /// Some keys failed: (result index, error) of each. The others were delivered.
    Failed(Vec<(usize, Error)>),
}

struct Shared {
    results: Mutex<Option<Vec<Result<usize>>>>,
    ended: Condvar,
    pinned: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Option<Vec<Result<usize>>>> {
        self.results.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn end(&self, results: Vec<Result<usize>>) {
        let mut slot = self.lock();
        if slot.is_none() {
            *slot = Some(results);
        }
        drop(slot);
        self.ended.notify_all();
    }
}

/// A stream-bound read in flight. The copies are already ordered on the caller's stream when
/// the call returns; the ticket only says how they went, once the engine has seen the stream
/// pass them. Dropping it neither blocks nor cancels anything.
pub struct StreamTicket {
    shared: Arc<Shared>,
    slots: usize,
}

impl std::fmt::Debug for StreamTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamTicket").field("slots", &self.slots).field("status", &self.status()).finish()
    }
}

impl StreamTicket {
    fn new(slots: usize) -> StreamTicket {
        let shared = Shared { results: Mutex::new(None), ended: Condvar::new(), pinned: AtomicUsize::new(0) };
        StreamTicket { shared: Arc::new(shared), slots }
    }

    /// A ticket that ended already with `results` (a read that needed no stream).
    pub fn ended(results: Vec<Result<usize>>) -> StreamTicket {
        let ticket = StreamTicket::new(results.len());
        ticket.shared.end(results);
        ticket
    }

    /// A pending ticket of `slots` results for another implementation of stream-bound reads
    /// (the remote client), and the handle that ends it.
    pub fn pending(slots: usize) -> (StreamTicket, StreamCompleter) {
        let ticket = StreamTicket::new(slots);
        let completer = StreamCompleter { shared: Arc::clone(&ticket.shared), slots, ended: false };
        (ticket, completer)
    }

    /// Pending, done, or failed with the failed keys' errors.
    pub fn status(&self) -> StreamStatus {
        match self.shared.lock().as_ref() {
            None => StreamStatus::Pending,
            Some(results) => {
                let failed: Vec<(usize, Error)> =
                    results.iter().enumerate().filter_map(|(i, r)| r.as_ref().err().map(|e| (i, e.clone()))).collect();
                if failed.is_empty() {
                    StreamStatus::Done
                } else {
                    StreamStatus::Failed(failed)
                }
            }
        }
    }

    /// One result per key (or fragment) once the read ended: bytes delivered, or the error.
    pub fn results(&self) -> Option<Vec<Result<usize>>> {
        self.shared.lock().clone()
    }

    /// Blocks the host until the read ended or `timeout` passed (host-side callers and tests;
    /// device-side callers wait on an event recorded on the stream instead).
    pub fn wait(&self, timeout: Duration) -> Option<Vec<Result<usize>>> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.shared.lock();
        loop {
            if let Some(results) = slot.as_ref() {
                return Some(results.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            slot = self.shared.ended.wait_timeout(slot, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Keys this read still holds leases on (0 once the stream passed the copies).
    pub fn keys_pinned(&self) -> usize {
        self.shared.pinned.load(Relaxed)
    }

    /// Number of results (keys, or fragments for `get_into_ranges_on_stream`).
    pub fn len(&self) -> usize {
        self.slots
    }

    /// True for a read of nothing.
    pub fn is_empty(&self) -> bool {
        self.slots == 0
    }
}

/// Ends a ticket made by `StreamTicket::pending`. Dropping it without `end` ends the ticket
/// with `ShuttingDown` for every slot, so no reader waits forever.
pub struct StreamCompleter {
    shared: Arc<Shared>,
    slots: usize,
    ended: bool,
}

impl std::fmt::Debug for StreamCompleter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamCompleter").field("ended", &self.ended).finish()
    }
}

impl StreamCompleter {
    /// Keys the read holds leases on now (`StreamTicket::keys_pinned`).
    pub fn set_pinned(&self, keys: usize) {
        self.shared.pinned.store(keys, Relaxed);
    }

    /// Ends the ticket with `results` (its leases must be back by now: `keys_pinned` reads 0).
    pub fn end(mut self, results: Vec<Result<usize>>) {
        self.ended = true;
        self.shared.pinned.store(0, Relaxed);
        self.shared.end(results);
    }
}

impl Drop for StreamCompleter {
    fn drop(&mut self) {
        if !self.ended {
            self.shared.pinned.store(0, Relaxed);
            self.shared.end((0..self.slots).map(|_| Err(Error::ShuttingDown)).collect());
        }
    }
}

/// A key whose object was still loading when it was leased: the gate its load opens.
struct Loading {
    landing: Arc<Landing>,
    /// The gate its copies wait on: opened failed, they were skipped.
    gate: Arc<dyn Gate>,
    /// Where the value starts in the record image, as the copies assume.
    value_offset: u64,
    slots: Vec<usize>,
}

/// Appends a layer's destination lists and slots to a step's.
fn flatten<'k, 'r>(
    reads: &StepReads<'k, 'r>,
    lists: &mut Vec<&'k [Region<'r>]>,
    slots: &mut Vec<KeyRead<'k>>,
) -> Result<()> {
    let base = lists.len();
    match *reads {
        StepReads::Objects { keys, dsts } => {
            checks::one_list_per_key(keys.len(), dsts.len(), "destination")?;
            lists.extend(dsts.iter().map(Vec::as_slice));
            slots.extend(keys.iter().enumerate().map(|(i, key)| KeyRead { key, list: base + i, want: Want::Whole }));
        }
        StepReads::Ranges { buffers, fragments } => {
            checks::fragment_lists(buffers.len(), fragments.len())?;
            lists.extend(buffers.iter().map(std::slice::from_ref));
            for (b, frags) in fragments.iter().enumerate() {
                for frag in frags {
                    let want = Want::Range { src_offset: frag.src_offset, dst_offset: frag.dst_offset, len: frag.len };
                    slots.push(KeyRead { key: &frag.key, list: base + b, want });
                }
            }
        }
    }
    Ok(())
}

/// Where a step's layer ends among its slots, and its signal.
#[derive(Clone, Copy, Debug)]
struct LayerEnd {
    slot_end: usize,
    signal: Option<StreamSignal>,
}

/// A result slot a transfer delivers, and the bytes the slot reports when it lands. Range slots
/// of one key into one buffer, one after the other (a page's K and V), share a transfer.
#[derive(Clone, Copy, Debug)]
struct Owner {
    transfer: usize,
    slot: usize,
    bytes: usize,
}

/// One submission of a step (a layer's copies) and the slots of its transfers.
struct WatchPart {
    inflight: InFlight,
    owners: Vec<Owner>,
}

/// A layer's planned copies: the transfers, the gate each waits on, and the slots they deliver.
struct LayerCopies<'a> {
    transfers: &'a [Transfer],
    gates: &'a [Option<Arc<dyn Gate>>],
    owners: &'a [Owner],
}

/// Enqueues a layer's copies and then its signal. A layer whose copies could not be enqueued
/// fails its slots and is still signalled (a device waiting on it must not wait forever); a
/// signal that fails fails the layer's slots (`slots`).
///
/// # Safety
/// As `StreamSubmit::submit_on_stream` and `StreamSubmit::signal`.
unsafe fn submit_layer(
    submitter: &dyn kvtide_transport::StreamSubmit,
    stream: StreamHandle,
    slots: std::ops::Range<usize>,
    signal: Option<StreamSignal>,
    copies: LayerCopies<'_>,
    results: &mut [Result<usize>],
) -> Option<WatchPart> {
    let LayerCopies { transfers, gates, owners } = copies;
    let mut part = None;
    if !transfers.is_empty() {
        // SAFETY: forwarded contract.
        match unsafe { submitter.submit_on_stream(stream, transfers, gates) } {
            Ok(inflight) => part = Some(WatchPart { inflight, owners: owners.to_vec() }),
            Err(e) => {
                let e = Error::from(e);
                owners.iter().for_each(|o| results[o.slot] = Err(e.clone()));
                // Its gates would be waited on by nothing: open them failed.
                gates.iter().flatten().for_each(|g| g.open(false));
            }
        }
    }
    if let Some(signal) = signal {
        // SAFETY: forwarded contract.
        if let Err(e) = unsafe { submitter.signal(stream, signal) } {
            let e = Error::from(e);
            for r in &mut results[slots] {
                if r.is_ok() || matches!(r, Err(Error::Internal(_))) {
                    *r = Err(e.clone());
                }
            }
        }
    }
    part
}

impl Engine {
    /// Reads object `i` into `dsts[i]` (scattered in order, sizes adding up to the object) with
    /// the copies enqueued on `stream` (a `CUstream` of the GPU the destinations are on). When
    /// this returns, everything the caller enqueues on `stream` afterwards sees the bytes: an
    /// event recorded on it right after is a valid "KV ready" signal. The host does not wait
    /// for the transfer. Objects stay leased until the engine sees the stream pass the copies.
    ///
    /// `stream` 0 is today's blocking read (the ticket is complete on return). Host
    /// destinations are written by the CPU before the call returns. A stream being captured
    /// into a graph is refused (`StreamCapturing`). Per-key failures are in the ticket.
    ///
    /// # Safety
    /// `stream` must be a live stream handle (or 0), and every destination must stay valid
    /// until the stream has passed the copies (`StreamTicket::status` no longer `Pending`, or
    /// any later point in the stream's order).
    pub unsafe fn batch_get_into_multi_buffers_on_stream(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        stream: StreamHandle,
    ) -> Result<StreamTicket> {
        // SAFETY: forwarded contract.
        unsafe { self.batch_get_on_stream_via(keys, dsts, stream, None) }
    }

    /// `batch_get_into_multi_buffers_on_stream` through `transport` instead of the store's GPU
    /// transport (tests drive the stream-bound path with a simulated stream).
    ///
    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`, for `transport`'s streams.
    #[doc(hidden)]
    pub unsafe fn batch_get_on_stream_via(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        stream: StreamHandle,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<StreamTicket> {
        checks::one_list_per_key(keys.len(), dsts.len(), "destination")?;
        let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
        let slots: Vec<KeyRead<'_>> =
            keys.iter().enumerate().map(|(i, key)| KeyRead { key, list: i, want: Want::Whole }).collect();
        // SAFETY: forwarded contract.
        unsafe { self.read_on_stream(&lists, &slots, stream, transport) }
    }

    /// `get_into_ranges` with the copies on `stream`, as `batch_get_into_multi_buffers_on_stream`
    /// does. The ticket has one result per fragment, buffer after buffer.
    ///
    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`.
    pub unsafe fn get_into_ranges_on_stream(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        stream: StreamHandle,
    ) -> Result<StreamTicket> {
        // SAFETY: forwarded contract.
        unsafe { self.get_into_ranges_on_stream_via(buffers, fragments, stream, None) }
    }

    /// `get_into_ranges_on_stream` through `transport` (tests).
    ///
    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`, for `transport`'s streams.
    #[doc(hidden)]
    pub unsafe fn get_into_ranges_on_stream_via(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        stream: StreamHandle,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<StreamTicket> {
        checks::fragment_lists(buffers.len(), fragments.len())?;
        let lists: Vec<&[Region<'_>]> = buffers.iter().map(std::slice::from_ref).collect();
        let mut slots = Vec::new();
        for (b, frags) in fragments.iter().enumerate() {
            for frag in frags {
                let want = Want::Range { src_offset: frag.src_offset, dst_offset: frag.dst_offset, len: frag.len };
                slots.push(KeyRead { key: &frag.key, list: b, want });
            }
        }
        // SAFETY: forwarded contract.
        unsafe { self.read_on_stream(&lists, &slots, stream, transport) }
    }

    /// One step's reads in one call: the first layer's lease requests, then, once its copies
    /// are enqueued, every later layer's at once; in layer order, as each layer's grants come
    /// in, its copies enqueued on `stream` followed by its `done` signal (the caller's event
    /// recorded, or its flag word written), so a graph whose layer i waits on signal i runs each
    /// layer as soon as its KV landed while the host is gone. The ticket has one result per key
    /// (or fragment), layer after layer; it ends once the engine saw the stream pass the last
    /// copies. A layer whose reads all fail is still
    /// signalled, so nothing waits on the device forever; its keys report their errors.
    ///
    /// Refused before anything is leased or enqueued (`InvalidArgument`, `StreamCapturing`,
    /// `Stream`): more than `MAX_STEP_LAYERS` layers, a null event or an unaligned flag word,
    /// device destinations of two reads that overlap (within a layer or across layers), a
    /// stream being captured or not of a GPU's primary context, and stream 0 with signals.
    ///
    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`; each signal's event or word must also stay
    /// valid until the stream passed it.
    pub unsafe fn step_on_stream(&self, layers: &[StepLayer<'_, '_>], stream: StreamHandle) -> Result<StreamTicket> {
        // SAFETY: forwarded contract.
        unsafe { self.step_on_stream_via(layers, stream, None) }
    }

    /// `step_on_stream` through `transport` (tests drive it with a simulated stream).
    ///
    /// # Safety
    /// As `step_on_stream`, for `transport`'s streams.
    #[doc(hidden)]
    pub unsafe fn step_on_stream_via(
        &self,
        layers: &[StepLayer<'_, '_>],
        stream: StreamHandle,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<StreamTicket> {
        crate::step::check(layers, stream)?;
        let mut lists: Vec<&[Region<'_>]> = Vec::new();
        let mut slots: Vec<KeyRead<'_>> = Vec::new();
        let mut bounds: Vec<LayerEnd> = Vec::with_capacity(layers.len());
        for layer in layers {
            flatten(&layer.reads, &mut lists, &mut slots)?;
            bounds.push(LayerEnd { slot_end: slots.len(), signal: layer.done });
        }
        self.gpu.counters().bound_steps.fetch_add(1, Relaxed);
        self.gpu.counters().bound_step_layers.fetch_add(layers.len() as u64, Relaxed);
        // SAFETY: forwarded contract.
        unsafe { self.read_layers_on_stream(&lists, &slots, &bounds, stream, transport) }
    }

    /// Makes later stream-bound reads to GPU `ordinal` allocate and compile nothing: registers
    /// the DRAM arena with CUDA, allocates the stream-bound staging units (`[gpu] stream_units`
    /// of `stream_unit_bytes`) and a block of gates, and compiles the kernels.
    pub fn prepare_gpu(&self, ordinal: u32) -> Result<()> {
        let transport = self.gpu.transport(&self.arena);
        let submitter = transport
            .on_stream()
            .ok_or(Error::CudaUnavailable("stream-bound reads need the cuda feature and a GPU"))?;
        submitter.prepare(ordinal)?;
        Ok(())
    }

    /// The stream-bound read of `slots` into `lists`: one layer, no signal.
    ///
    /// # Safety
    /// As `batch_get_into_multi_buffers_on_stream`.
    unsafe fn read_on_stream(
        &self,
        lists: &[&[Region<'_>]],
        slots: &[KeyRead<'_>],
        stream: StreamHandle,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<StreamTicket> {
        let one = [LayerEnd { slot_end: slots.len(), signal: None }];
        // SAFETY: forwarded contract.
        unsafe { self.read_layers_on_stream(lists, slots, &one, stream, transport) }
    }

    /// The stream-bound read of `slots` into `lists` in layers (`layers[i].slot_end` ends layer
    /// i's slots): the first layer's lease requests go out alone and its copies are enqueued as
    /// soon as it is leased and planned; then every later layer's requests go out at once, and,
    /// layer after layer, the call waits for that layer's grants, plans and enqueues its copies
    /// and its signal. The device starts on the first layer while this thread leases the rest.
    ///
    /// # Safety
    /// As `step_on_stream`.
    unsafe fn read_layers_on_stream(
        &self,
        lists: &[&[Region<'_>]],
        slots: &[KeyRead<'_>],
        layers: &[LayerEnd],
        stream: StreamHandle,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<StreamTicket> {
        if stream == 0 {
            let mut targets = ReadTargets::new(self, lists, None);
            return Ok(StreamTicket::ended(self.read(&mut targets, slots)));
        }
        let transport = transport.unwrap_or_else(|| self.gpu.transport(&self.arena));
        let submitter = transport
            .on_stream()
            .ok_or(Error::CudaUnavailable("stream-bound reads need the cuda feature and a GPU"))?;
        let started = Instant::now();
        let ordinal = submitter.check_stream(stream)?;
        let _awake = KeepAwake::new(self, &[Route::Gpu]);
        let counters = Arc::clone(self.gpu.counters());
        let mut results: Vec<Result<usize>> = (0..slots.len()).map(|_| pending()).collect();
        let routes: Vec<Route> = lists.iter().map(|l| Route::of(l)).collect();
        self.read_host_slots(lists, slots, &routes, &mut results);
        // Device destinations: one lease per key of each layer, granted early for objects still
        // loading. The first layer's requests go out alone, so its copies are enqueued as soon
        // as it is leased and planned (DRAM-resident keys are leased on this thread, through the
        // shards' published indexes); every later layer's go out together once the first
        // layer's copies are enqueued.
        let starts: Vec<usize> = std::iter::once(0).chain(layers.iter().map(|l| l.slot_end)).collect();
        let send = |l: usize, results: &mut [Result<usize>]| {
            let range = starts[l]..layers[l].slot_end;
            let (keys, key_of) = self.gpu_keys(&slots[range.clone()], &routes, &mut results[range.clone()]);
            let leases = self.send_leases_with(keys.iter().enumerate().map(|(k, key)| (k, *key)), true);
            (range, key_of, leases)
        };
        let mut sent = std::collections::VecDeque::with_capacity(layers.len());
        if !layers.is_empty() {
            sent.push_back(send(0, &mut results));
        }
        let checked_at = Instant::now();
        counters.bound_reads.fetch_add(1, Relaxed);
        let mut step = StepState::default();
        let mut leased_at = None;
        for (l, layer) in layers.iter().enumerate() {
            if l == 1 {
                for later in 1..layers.len() {
                    sent.push_back(send(later, &mut results));
                }
            }
            let Some((range, key_of, leases)) = sent.pop_front() else { break };
            let (grants, leases) = leases.wait();
            leased_at.get_or_insert_with(Instant::now);
            let layer_slots = &slots[range.clone()];
            let list_error = check_gpu_lists(transport.as_ref(), lists, layer_slots, &key_of);
            let GatedTransfers { transfers, gates, owners, key_gate, loading } = plan_gated(
                || Ok(submitter.gate(ordinal)?),
                lists,
                layer_slots,
                &key_of,
                &grants,
                &list_error,
                &mut results[range.clone()],
            );
            counters.bound_gated_keys.fetch_add(loading.len() as u64, Relaxed);
            // The loads' ends open the gates (on the shard that finishes each load).
            for (k, l) in &loading {
                if let Some(gate) = key_gate.get(k) {
                    let gate = Arc::clone(gate);
                    let expected = l.value_offset;
                    l.landing.on_end(Box::new(move |outcome| gate.open(outcome == Ok(expected))));
                }
            }
            let owners: Vec<Owner> = owners.into_iter().map(|o| Owner { slot: range.start + o.slot, ..o }).collect();
            let copies = LayerCopies { transfers: &transfers, gates: &gates, owners: &owners };
            // SAFETY: every transfer's host bytes are leased until the watch below saw the stream
            // pass the copies (or, when nothing of the layer was enqueued, need no lease); the
            // destinations passed the transport's check and the caller keeps them, and the
            // signals' events and words, valid for as long (this function's contract).
            let part = unsafe { submit_layer(submitter, stream, range.clone(), layer.signal, copies, &mut results) };
            step.pinned += leases.len();
            step.leases.push(leases.into_held());
            step.parts.extend(part);
            step.gates.extend(key_gate.into_values());
            // The layer's slots were counted from its first: shifted to the step's.
            step.loading.extend(loading.into_values().map(|mut l| {
                l.slots.iter_mut().for_each(|s| *s += range.start);
                l
            }));
        }
        // Phases: checking the stream and sending every layer's leases; waiting for the first
        // layer's grants; the rest (planning and enqueueing, layer by layer, with the later
        // layers' waits) counted as enqueueing.
        let leased_at = leased_at.unwrap_or(checked_at);
        counters.record_bound_call([started, checked_at, leased_at, leased_at, Instant::now()]);
        if step.parts.is_empty() {
            // Nothing was enqueued (or only signals): the leases can go now.
            step.gates.iter().for_each(|g| g.open(false));
            drop(step.leases);
            return Ok(finish_now(results, &counters));
        }
        let StepState { parts, gates, loading, leases, pinned } = step;
        let ticket = StreamTicket::new(slots.len());
        ticket.shared.pinned.store(pinned, Relaxed);
        counters.bound_in_flight.fetch_add(1, Relaxed);
        counters.bound_keys_pinned.fetch_add(pinned as u64, Relaxed);
        let watch = StreamWatch {
            parts,
            finished: false,
            results: Some(results),
            loading,
            gates,
            leases: Some(leases),
            pinned,
            shared: Arc::clone(&ticket.shared),
            counters,
            deadline: Instant::now() + self.config.gpu_stream_ttl,
            ttl_ms: self.config.gpu_stream_ttl.as_millis() as u64,
            awake: Some(KeepAwake::new(self, &[Route::Gpu])),
        };
        // Round robin over the shards: each watch is polled by one shard loop. A shard that is
        // gone (shutting down) drops the watch, which waits for the stream here.
        let shard = self.next_watch_shard.fetch_add(1, Relaxed) as usize % self.shards.len();
        drop(self.shards[shard].inbox.send(Request::Task(Box::new(watch))));
        Ok(ticket)
    }
}

/// What a layered read gathers over its layers for its watch.
#[derive(Default)]
struct StepState {
    parts: Vec<WatchPart>,
    gates: Vec<Arc<dyn Gate>>,
    loading: Vec<Loading>,
    leases: Vec<HeldLeases>,
    pinned: usize,
}

impl Engine {
    /// Reads the slots whose destinations are host memory, on the CPU, before the call returns.
    fn read_host_slots(
        &self,
        lists: &[&[Region<'_>]],
        slots: &[KeyRead<'_>],
        routes: &[Route],
        results: &mut [Result<usize>],
    ) {
        let host: Vec<usize> = (0..slots.len()).filter(|&s| routes[slots[s].list] == Route::Host).collect();
        if !host.is_empty() {
            let sub: Vec<KeyRead<'_>> = host.iter().map(|&s| slots[s]).collect();
            let mut targets = ReadTargets::new(self, lists, None);
            for (&s, r) in host.iter().zip(self.read(&mut targets, &sub)) {
                results[s] = r;
            }
        }
    }

    /// The distinct keys of the slots bound for GPU memory, and each slot's index among them
    /// (`usize::MAX`: not a GPU slot, or its key failed its check, in `results`).
    fn gpu_keys<'k>(
        &self,
        slots: &[KeyRead<'k>],
        routes: &[Route],
        results: &mut [Result<usize>],
    ) -> (Vec<&'k [u8]>, Vec<usize>) {
        let mut key_index = KeyIndex::with_capacity(slots.len());
        let mut key_of: Vec<usize> = vec![usize::MAX; slots.len()];
        for (s, slot) in slots.iter().enumerate() {
            if routes[slot.list] != Route::Gpu {
                continue;
            }
            if let Err(e) = self.validate_key(slot.key) {
                results[s] = Err(e);
                continue;
            }
            key_of[s] = key_index.index_of(slot.key).0;
        }
        (key_index.into_keys(), key_of)
    }
}

/// Checks each GPU destination list once, before anything is submitted: the error of each list
/// that failed.
fn check_gpu_lists(
    transport: &dyn Transport,
    lists: &[&[Region<'_>]],
    slots: &[KeyRead<'_>],
    key_of: &[usize],
) -> HashMap<usize, Error> {
    let mut used: Vec<usize> = (0..slots.len()).filter(|&s| key_of[s] != usize::MAX).map(|s| slots[s].list).collect();
    used.sort_unstable();
    used.dedup();
    let checked: Vec<&[Region<'_>]> = used.iter().map(|&l| lists[l]).collect();
    let mut list_error: HashMap<usize, Error> = HashMap::new();
    for (&l, e) in used.iter().zip(transport.check(&checked, true)) {
        if let Some(e) = e {
            list_error.insert(l, e.into());
        }
    }
    list_error
}

/// A stream-bound read's transfers, each with the gate it waits on (objects still loading) and
/// its owner; the gate of each loading key and its load.
struct GatedTransfers {
    transfers: Vec<Transfer>,
    gates: Vec<Option<Arc<dyn Gate>>>,
    /// The slots the transfers deliver.
    owners: Vec<Owner>,
    key_gate: HashMap<usize, Arc<dyn Gate>>,
    loading: HashMap<usize, Loading>,
}

/// Plans one transfer per (key, slot), except that a slot of the same key and buffer as the
/// slot just planned joins its transfer (a page's K and V halves: one transfer, half the
/// transfers to plan and free); range slots of one key share its gate. A slot that cannot be
/// planned gets its error in `results`, and joins nothing.
fn plan_gated(
    new_gate: impl Fn() -> Result<Arc<dyn Gate>>,
    lists: &[&[Region<'_>]],
    slots: &[KeyRead<'_>],
    key_of: &[usize],
    grants: &ByIndex<Result<ReadGrant>>,
    list_error: &HashMap<usize, Error>,
    results: &mut [Result<usize>],
) -> GatedTransfers {
    let mut plan = GatedTransfers {
        transfers: Vec::new(),
        gates: Vec::new(),
        owners: Vec::new(),
        key_gate: HashMap::new(),
        loading: HashMap::new(),
    };
    // (key, destination list, transfer) of the transfer planned last.
    let mut joins: Option<(usize, usize, usize)> = None;
    for (s, slot) in slots.iter().enumerate() {
        let k = key_of[s];
        if k == usize::MAX {
            continue;
        }
        if let Some(e) = list_error.get(&slot.list) {
            results[s] = Err(e.clone());
            continue;
        }
        let grant = match grants.get(&k) {
            Some(Ok(grant)) => grant,
            Some(Err(e)) => {
                results[s] = Err(e.clone());
                continue;
            }
            None => {
                results[s] = Err(Error::Internal("key was not leased"));
                continue;
            }
        };
        let (mut pieces, reported) = match plan_pieces(grant.len, lists[slot.list], slot.want) {
            Ok(planned) => planned,
            Err(e) => {
                results[s] = Err(e);
                continue;
            }
        };
        let mut host = grant.ptr.as_ptr() as u64;
        let mut gate = None;
        if let Some(landing) = &grant.landing {
            // The value's place in the record image being loaded (this build's format; a
            // record of an older format fails the key: read it again once it is in DRAM).
            let value_offset = kvtide_tiers::ssd::record::value_offset(slot.key.len(), grant.len);
            host += value_offset;
            let made = match plan.key_gate.get(&k) {
                Some(g) => Ok(Arc::clone(g)),
                None => new_gate(),
            };
            match made {
                Ok(g) => {
                    plan.key_gate.entry(k).or_insert_with(|| Arc::clone(&g));
                    plan.loading
                        .entry(k)
                        .or_insert_with(|| Loading {
                            landing: Arc::clone(landing),
                            gate: Arc::clone(&g),
                            value_offset,
                            slots: Vec::new(),
                        })
                        .slots
                        .push(s);
                    gate = Some(g);
                }
                Err(e) => {
                    results[s] = Err(e);
                    continue;
                }
            }
        }
        pieces.retain(|p| p.len > 0);
        let transfer = match joins {
            // The key's next bytes into the same buffer: one transfer, one staged span.
            Some((key, list, t))
                if key == k && list == slot.list && starts_at(&pieces, plan.transfers[t].span().end) =>
            {
                plan.transfers[t].pieces.extend(pieces);
                t
            }
            _ => {
                plan.transfers.push(Transfer { host, host_len: grant.len, pieces });
                plan.gates.push(gate);
                plan.transfers.len() - 1
            }
        };
        joins = Some((k, slot.list, transfer));
        plan.owners.push(Owner { transfer, slot: s, bytes: reported });
    }
    plan
}

/// Whether `pieces` begin at host offset `end` (and so continue a transfer's span).
fn starts_at(pieces: &[kvtide_transport::Piece], end: u64) -> bool {
    pieces.iter().map(|p| p.host_offset).min() == Some(end)
}

/// A ticket for a read that submitted nothing to a stream.
fn finish_now(results: Vec<Result<usize>>, counters: &GpuCounters) -> StreamTicket {
    let failed = results.iter().filter(|r| r.is_err()).count() as u64;
    counters.bound_failed_keys.fetch_add(failed, Relaxed);
    StreamTicket::ended(results)
}

/// Keeps a stream-bound read's objects leased until its shard sees the stream pass the copies.
struct StreamWatch {
    /// The submissions (one per layer of a step), each with its transfers' owners.
    parts: Vec<WatchPart>,
    finished: bool,
    /// The results known at submission (set into the ticket at the end).
    results: Option<Vec<Result<usize>>>,
    loading: Vec<Loading>,
    gates: Vec<Arc<dyn Gate>>,
    /// Each layer's leases.
    leases: Option<Vec<HeldLeases>>,
    pinned: usize,
    shared: Arc<Shared>,
    counters: Arc<GpuCounters>,
    deadline: Instant,
    ttl_ms: u64,
    /// Keeps the shards polling while the read is in flight (`[gpu] keep_shards_awake`), so the
    /// next layer's call and this release cost no wake-up.
    awake: Option<KeepAwake>,
}

impl StreamWatch {
    /// The stream passed the copies (or the watch is dropped): results, leases back. Once.
    fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let outcomes: Vec<Vec<std::result::Result<(), kvtide_transport::TransportError>>> =
            self.parts.iter_mut().map(|p| p.inflight.take_results()).collect();
        if let Some(mut results) = self.results.take() {
            for (part, outcomes) in self.parts.iter().zip(outcomes) {
                for o in &part.owners {
                    let outcome = match outcomes.get(o.transfer) {
                        Some(outcome) => outcome.clone().map(|()| o.bytes).map_err(Error::from),
                        None => Err(Error::Internal("a transfer's result was missing")),
                    };
                    // A slot failed at the call (its layer's signal) keeps that error.
                    if results[o.slot].is_ok() || matches!(results[o.slot], Err(Error::Internal(_))) {
                        results[o.slot] = outcome;
                    }
                }
            }
            for l in &self.loading {
                // A failed load (or a record of another layout) fails its slots: its gate told
                // the device to skip their pages.
                let error = match l.landing.outcome_now() {
                    // The gate was forced failed (a watch dropped at shutdown) before the load
                    // ended well: the copies were skipped all the same.
                    Some(Ok(_)) if l.gate.state() == Some(false) => Some(Error::ShuttingDown),
                    Some(Ok(offset)) if offset == l.value_offset => None,
                    Some(Ok(_)) => Some(Error::Io(
                        "the record on SSD has an older layout than stream-bound reads copy from; read it again \
                         once it is in DRAM"
                            .into(),
                    )),
                    Some(Err(e)) => Some(e),
                    // Only a watch dropped at shutdown opens a gate before its load ended.
                    None => Some(Error::ShuttingDown),
                };
                if let Some(e) = error {
                    for &s in &l.slots {
                        results[s] = Err(e.clone());
                    }
                }
            }
            let failed = results.iter().filter(|r| r.is_err()).count() as u64;
            self.counters.bound_failed_keys.fetch_add(failed, Relaxed);
            // Leases first: a caller that sees the read ended sees no key pinned.
            self.release();
            self.shared.end(results);
        }
        self.release();
        self.counters.bound_in_flight.fetch_sub(1, Relaxed);
        self.awake.take();
    }

    /// Releases the leases (once).
    fn release(&mut self) {
        if self.leases.take().is_some() {
            self.shared.pinned.store(0, Relaxed);
            self.counters.bound_keys_pinned.fetch_sub(self.pinned as u64, Relaxed);
        }
    }

    /// The backstop: the stream has not passed the copies within the TTL. The read is reported
    /// failed and its leases released; the watch keeps polling so the transport's resources go
    /// back once the stream does pass.
    fn expire(&mut self) {
        let Some(mut results) = self.results.take() else { return };
        tracing::warn!(
            ttl_ms = self.ttl_ms,
            "a stream-bound read's stream did not pass its copies in time; leases released"
        );
        for part in &self.parts {
            for o in &part.owners {
                results[o.slot] = Err(Error::StreamExpired { ttl_ms: self.ttl_ms });
            }
        }
        // A stream waiting on a load that never ends is let through (the copies then skip).
        self.gates.iter().for_each(|g| g.open(false));
        let failed = results.iter().filter(|r| r.is_err()).count() as u64;
        self.counters.bound_failed_keys.fetch_add(failed, Relaxed);
        self.counters.bound_expired.fetch_add(1, Relaxed);
        self.release();
        self.shared.end(results);
    }

    /// One look at the stream; true once the watch is finished.
    fn poll_once(&mut self) -> bool {
        let done = self.finished || self.parts.iter_mut().all(|p| p.inflight.poll());
        if done {
            self.finish();
            return true;
        }
        if self.results.is_some() && Instant::now() >= self.deadline {
            self.expire();
        }
        false
    }
}

impl ShardTask for StreamWatch {
    fn start(&mut self, _core: &mut ShardCore) {}

    fn poll(&mut self, _core: &mut ShardCore, _budget_bytes: &mut u64) -> TaskPoll {
        if self.poll_once() {
            TaskPoll::Finished
        } else {
            TaskPoll::Polling
        }
    }

    /// A stopping store does not wait for a stream that may never pass: the watch's drop
    /// waits for it on its own (after opening the gates) and then reports and releases.
    fn dropped_at_shutdown(&self) -> bool {
        true
    }
}

impl Drop for StreamWatch {
    fn drop(&mut self) {
        if !self.finished {
            // Dropped unfinished (its shard stopped, or never took it): open the gates first so
            // the stream cannot wait on a load that will never end, wait for it to pass the
            // copies, then report and release as usual.
            self.gates.iter().for_each(|g| g.open(false));
            self.parts.iter_mut().for_each(|p| p.inflight.block());
            self.finish();
        }
    }
}
