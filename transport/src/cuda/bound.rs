//! Stream-bound submissions: a read's copies enqueued on the caller's stream, completion seen
//! through an event recorded on that stream after them.
//!
//! Owns, per GPU, the stream-bound staging units and the gate words. A unit is bound to one
//! stream while reads on it are in flight and shared by all of them: the stream runs their
//! copies and kernels in order, so a later read may reuse the buffer and the row table at once.
//! Row tables are copied into the unit's device memory on the stream (a pageable copy the driver
//! stages before returning), never read in place from host memory a later read rewrites. A gate
//! is a word of mapped pinned host memory the stream waits on (`cuStreamWaitValue32`) before the
//! copies of an object still loading; the gated scatter kernel skips its pages unless the gate
//! says the load succeeded. It never blocks the host on the caller's stream except to drain it
//! after a failed submission, or when an unfinished submission is dropped.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;

use super::device::{self, Event, InFlight, Stage, BLOCKS_PER_SM, KERNEL_THREADS, ROWS_PER_BLOCK};
use super::driver::{check, CudaDevice, CudaTransport};
use super::plan::{self, Descriptor, Direction, Fallback, PathChoice, StagingPolicy, Transfer};
use crate::region::MemoryKind;
use crate::stream::{Gate, StreamHandle};
use crate::TransportError;

/// Gate word values: closed, the load landed, the load failed.
const GATE_CLOSED: u32 = 0;
const GATE_OK: u32 = 1;
const GATE_FAILED: u32 = 2;
/// Gate words per pinned block.
const GATES_PER_BLOCK: usize = 1024;
/// Gate blocks per GPU at most (gates are held only while a read waits on a load).
const MAX_GATE_BLOCKS: usize = 64;
/// `CU_STREAM_WAIT_VALUE_GEQ`.
const WAIT_VALUE_GEQ: u32 = 0;

/// The stream-bound staging pool of a store: how many units per GPU and how large.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamStaging {
    /// Units per GPU (0: stream-bound reads always copy directly).
    pub units: u32,
    /// Device buffer of each unit.
    pub unit_bytes: u64,
}

impl StreamStaging {
    /// Row-table entries of a unit: enough for 512-byte pages filling its buffer.
    fn rows_capacity(self) -> usize {
        (self.unit_bytes / 512).clamp(4096, 1 << 20) as usize
    }
}

/// One stream-bound staging unit: its device buffer and its row ring (mapped pinned host
/// memory the scatter kernels read in place). Each fill takes a contiguous run of the ring,
/// given back once the submission that enqueued it completed.
struct StreamUnit {
    buffer: sys::CUdeviceptr,
    bytes: u64,
    rows_host: *mut Descriptor,
    rows_device: sys::CUdeviceptr,
    rows_capacity: usize,
    /// Runs in use, oldest first: (owner submission, start, len, released).
    runs: std::collections::VecDeque<(u64, usize, usize, bool)>,
    next_row: usize,
}

// SAFETY: raw addresses owned by the pool; every use is ordered on the bound stream or behind
// the executor's mutex.
unsafe impl Send for StreamUnit {}

impl StreamUnit {
    /// A run of `n` rows for submission `owner`, or None when the ring has no room now.
    fn take_rows(&mut self, owner: u64, n: usize) -> Option<usize> {
        if n == 0 || n > self.rows_capacity {
            return None;
        }
        let start = match self.runs.front() {
            None => 0,
            Some(&(_, oldest, _, _)) => {
                let head = self.next_row;
                if head > oldest {
                    if head + n <= self.rows_capacity {
                        head
                    } else if n <= oldest {
                        0
                    } else {
                        return None;
                    }
                } else if head + n <= oldest {
                    head
                } else {
                    return None;
                }
            }
        };
        self.runs.push_back((owner, start, n, false));
        self.next_row = start + n;
        Some(start)
    }

    /// Gives back the runs of submission `owner` (reclaimed once the older runs are back too).
    fn release(&mut self, owner: u64) {
        for run in self.runs.iter_mut().filter(|r| r.0 == owner) {
            run.3 = true;
        }
        while self.runs.front().is_some_and(|r| r.3) {
            self.runs.pop_front();
        }
        if self.runs.is_empty() {
            self.next_row = 0;
        }
    }
}

/// A unit bound to a stream, and the submissions on that stream that share it.
struct BoundUnit {
    stream: StreamHandle,
    unit: StreamUnit,
    users: usize,
}

/// A GPU's stream-bound staging units.
#[derive(Default)]
pub(crate) struct StreamUnits {
    idle: Vec<StreamUnit>,
    bound: Vec<BoundUnit>,
    made: u32,
    next_owner: u64,
}

/// A submission's share of the unit bound to its stream; the last share gives the unit back.
pub(crate) struct UnitShare {
    device: Arc<CudaDevice>,
    stream: StreamHandle,
    owner: u64,
    buffer: sys::CUdeviceptr,
    bytes: u64,
}

// SAFETY: a device address and ids; the pool is behind the executor's mutex.
unsafe impl Send for UnitShare {}

impl UnitShare {
    /// A run of `n` rows of the unit's ring: (host address, device address) of its first row.
    fn take_rows(&self, n: usize) -> Option<(*mut Descriptor, sys::CUdeviceptr)> {
        let mut units = self.device.exec.stream_units.lock().unwrap_or_else(|p| p.into_inner());
        let bound = units.bound.iter_mut().find(|b| b.stream == self.stream)?;
        let start = bound.unit.take_rows(self.owner, n)?;
        let host = bound.unit.rows_host.wrapping_add(start);
        let device = bound.unit.rows_device + (start * std::mem::size_of::<Descriptor>()) as u64;
        Some((host, device))
    }
}

impl Drop for UnitShare {
    fn drop(&mut self) {
        let mut units = self.device.exec.stream_units.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = units.bound.iter().position(|b| b.stream == self.stream) {
            units.bound[at].unit.release(self.owner);
            units.bound[at].users -= 1;
            if units.bound[at].users == 0 {
                let bound = units.bound.swap_remove(at);
                units.idle.push(bound.unit);
            }
        }
    }
}

impl CudaDevice {
    /// Shares the unit bound to `stream`, binding an idle (or new) one when none is; None when
    /// every unit is bound to other streams.
    fn share_unit(
        self: &Arc<Self>,
        stream: StreamHandle,
        staging: StreamStaging,
    ) -> Result<Option<UnitShare>, TransportError> {
        let mut units = self.exec.stream_units.lock().unwrap_or_else(|p| p.into_inner());
        units.next_owner += 1;
        let owner = units.next_owner;
        if let Some(bound) = units.bound.iter_mut().find(|b| b.stream == stream) {
            bound.users += 1;
            let (buffer, bytes) = (bound.unit.buffer, bound.unit.bytes);
            return Ok(Some(UnitShare { device: Arc::clone(self), stream, owner, buffer, bytes }));
        }
        let unit = match units.idle.iter().position(|u| u.bytes >= staging.unit_bytes) {
            Some(at) => units.idle.swap_remove(at),
            None if units.made < staging.units => {
                let unit = self.make_unit(staging)?;
                units.made += 1;
                unit
            }
            None => return Ok(None),
        };
        let (buffer, bytes) = (unit.buffer, unit.bytes);
        units.bound.push(BoundUnit { stream, unit, users: 1 });
        Ok(Some(UnitShare { device: Arc::clone(self), stream, owner, buffer, bytes }))
    }

    fn make_unit(&self, staging: StreamStaging) -> Result<StreamUnit, TransportError> {
        self.bind()?;
        let rows_capacity = staging.rows_capacity();
        let mut buffer: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut buffer, staging.unit_bytes as usize) }, "cuMemAlloc")?;
        let free_buffer = || {
            // SAFETY: allocated above, never used.
            let _ = unsafe { sys::cuMemFree_v2(buffer) };
        };
        let mut rows_host: *mut c_void = std::ptr::null_mut();
        let row_bytes = rows_capacity * std::mem::size_of::<Descriptor>();
        let allocated = check(
            // SAFETY: writes one host pointer; DEVICEMAP lets the kernels read the rows in place.
            unsafe { sys::cuMemHostAlloc(&mut rows_host, row_bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) },
            "cuMemHostAlloc",
        );
        if let Err(e) = allocated {
            free_buffer();
            return Err(e);
        }
        let mut rows_device: sys::CUdeviceptr = 0;
        let mapped = check(
            // SAFETY: a live mapped pinned allocation; writes one device pointer.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut rows_device, rows_host, 0) },
            "cuMemHostGetDevicePointer",
        );
        if let Err(e) = mapped {
            free_buffer();
            // SAFETY: allocated above, never used.
            let _ = unsafe { sys::cuMemFreeHost(rows_host) };
            return Err(e);
        }
        tracing::info!(gpu = self.ordinal, unit_bytes = staging.unit_bytes, "stream-bound staging unit allocated");
        Ok(StreamUnit {
            buffer,
            bytes: staging.unit_bytes,
            rows_host: rows_host.cast(),
            rows_device,
            rows_capacity,
            runs: Default::default(),
            next_row: 0,
        })
    }

    /// Allocates every stream-bound unit, the kernels, a block of gates and some events now.
    pub(crate) fn prepare_stream_bound(self: &Arc<Self>, staging: StreamStaging) -> Result<(), TransportError> {
        self.bind()?;
        self.kernels()?;
        {
            let mut units = self.exec.stream_units.lock().unwrap_or_else(|p| p.into_inner());
            while units.made < staging.units {
                let unit = self.make_unit(staging)?;
                units.idle.push(unit);
                units.made += 1;
            }
        }
        // One gate taken and dropped allocates the first block.
        drop(self.gate()?);
        let events: Vec<Event> = (0..16).map(|_| self.take_event()).collect::<Result<_, _>>()?;
        events.into_iter().for_each(|e| self.give_event(e));
        Ok(())
    }
}

/// Gate words of one GPU: blocks of mapped pinned host memory and the free slots.
#[derive(Default)]
pub(crate) struct GateSlab {
    /// (host address, device address) of each block.
    blocks: Vec<(usize, sys::CUdeviceptr)>,
    free: Vec<(usize, usize)>,
}

// SAFETY: addresses of pinned allocations owned by the slab for the life of the process.
unsafe impl Send for GateSlab {}

/// A gate word of `GateSlab`.
pub(crate) struct CudaGate {
    device: Arc<CudaDevice>,
    slot: (usize, usize),
    host: *mut u32,
    device_addr: sys::CUdeviceptr,
    /// 0 closed, 1 opened ok, 2 opened failed.
    state: AtomicU8,
}

// SAFETY: the word is written with volatile stores by whoever opens the gate (once); the slot
// belongs to this gate until it drops.
unsafe impl Send for CudaGate {}
// SAFETY: as above; `state` is atomic.
unsafe impl Sync for CudaGate {}

impl Gate for CudaGate {
    fn open(&self, ok: bool) {
        let value = if ok { GATE_OK } else { GATE_FAILED };
        if self.state.compare_exchange(0, value as u8, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            // SAFETY: our slot of a live pinned block; the device only reads it.
            unsafe { std::ptr::write_volatile(self.host, value) };
            std::sync::atomic::fence(Ordering::SeqCst);
        }
    }

    fn state(&self) -> Option<bool> {
        match self.state.load(Ordering::Acquire) {
            0 => None,
            v => Some(v == GATE_OK as u8),
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for CudaGate {
    fn drop(&mut self) {
        // Nothing waits on a gate once every holder let go (the submission that waited on it
        // completed, so the stream passed the wait), but one that was never opened is opened
        // failed first in case a stream still does.
        self.open(false);
        self.device.exec.gates.lock().unwrap_or_else(|p| p.into_inner()).free.push(self.slot);
    }
}

impl CudaDevice {
    /// A closed gate word of this GPU.
    pub(crate) fn gate(self: &Arc<Self>) -> Result<CudaGate, TransportError> {
        let mut slab = self.exec.gates.lock().unwrap_or_else(|p| p.into_inner());
        if slab.free.is_empty() {
            if slab.blocks.len() >= MAX_GATE_BLOCKS {
                return Err(TransportError::Cuda { op: "gate", detail: "every gate word is in use".into() });
            }
            self.bind()?;
            let bytes = GATES_PER_BLOCK * std::mem::size_of::<u32>();
            let mut host: *mut c_void = std::ptr::null_mut();
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            // SAFETY: writes one host pointer.
            check(unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) }, "cuMemHostAlloc")?;
            let mut device_addr: sys::CUdeviceptr = 0;
            // SAFETY: a live mapped pinned allocation; writes one device pointer.
            let mapped = check(
                unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_addr, host, 0) },
                "cuMemHostGetDevicePointer",
            );
            if let Err(e) = mapped {
                // SAFETY: allocated above, never used.
                let _ = unsafe { sys::cuMemFreeHost(host) };
                return Err(e);
            }
            let block = slab.blocks.len();
            slab.blocks.push((host as usize, device_addr));
            slab.free.extend((0..GATES_PER_BLOCK).rev().map(|i| (block, i)));
        }
        let Some(slot) = slab.free.pop() else {
            return Err(TransportError::Cuda { op: "gate", detail: "no free gate word".into() });
        };
        let (host, device_addr) = slab.blocks[slot.0];
        let host = (host as *mut u32).wrapping_add(slot.1);
        // SAFETY: a slot of a live block, no longer waited on (see `CudaGate::drop`).
        unsafe { std::ptr::write_volatile(host, GATE_CLOSED) };
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(CudaGate {
            device: Arc::clone(self),
            slot,
            host,
            device_addr: device_addr + (slot.1 * std::mem::size_of::<u32>()) as u64,
            state: AtomicU8::new(0),
        })
    }
}

/// Checks a caller's stream: the GPU whose primary context it belongs to, and that it is not
/// being captured.
pub(crate) fn check_stream(transport: &CudaTransport, stream: StreamHandle) -> Result<u32, TransportError> {
    let bad = |why: String| TransportError::Stream { stream, why };
    if stream == 0 {
        return Err(bad("0 is not a stream (it keeps the blocking path)".into()));
    }
    let raw = stream as usize as sys::CUstream;
    // Some context must be current for the legacy and per-thread handles.
    transport.device(0)?.bind()?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context handle; a bad handle is an error, not a fault, for handles the
    // driver made (the caller vouches that `stream` is one).
    check(unsafe { sys::cuStreamGetCtx(raw, &mut ctx) }, "cuStreamGetCtx").map_err(|e| bad(e.to_string()))?;
    let mut ordinal = None;
    for o in 0..transport.device_count() as u32 {
        if transport.device(o).is_ok_and(|d| d.ctx == ctx) {
            ordinal = Some(o);
            break;
        }
    }
    let ordinal = ordinal.ok_or_else(|| bad("it belongs to a context that is not a GPU's primary context".into()))?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one status for a stream handle the driver just accepted.
    check(unsafe { sys::cuStreamIsCapturing(raw, &mut status) }, "cuStreamIsCapturing")
        .map_err(|e| bad(e.to_string()))?;
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(ordinal),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Err(TransportError::StreamCapturing("active")),
        _ => Err(TransportError::StreamCapturing("invalidated")),
    }
}

/// Enqueues a stream-bound read on `stream` (of GPU `ordinal`). See `StreamSubmit`.
///
/// # Safety
/// As `StreamSubmit::submit_on_stream`.
pub(crate) unsafe fn submit_bound(
    transport: &CudaTransport,
    ordinal: u32,
    stream: StreamHandle,
    transfers: &[Transfer],
    gates: &[Option<&CudaGate>],
    policy: StagingPolicy,
    staging: StreamStaging,
) -> Result<InFlight, TransportError> {
    let device = transport.device(ordinal)?;
    device.bind()?;
    let raw = stream as usize as sys::CUstream;
    let mut inflight = InFlight::new(transfers.len());
    // Pieces on another GPU: that transfer fails, nothing of it is enqueued.
    let mut usable = vec![true; transfers.len()];
    for (i, t) in transfers.iter().enumerate() {
        let foreign = t.pieces.iter().find_map(|p| match p.kind {
            MemoryKind::Device { ordinal: o } if o != ordinal => Some(o),
            _ => None,
        });
        if let Some(o) = foreign {
            usable[i] = false;
            let why = format!("a destination is memory of GPU {o}, the stream is GPU {ordinal}'s");
            inflight.fail([i], &TransportError::Stream { stream, why });
        }
    }
    let enqueued = {
        let mut run =
            BoundRun { device: &device, stream: raw, handle: stream, staging, share: None, inflight: &mut inflight };
        // SAFETY: forwarded contract.
        unsafe { run.enqueue(transfers, gates, &usable, policy) }
    };
    let all: Vec<usize> = (0..transfers.len()).collect();
    if let Err(e) = &enqueued {
        // Some copies may be queued: every transfer fails, and the stage below still waits for
        // the stream so nothing is released while they can run.
        inflight.fail(all.iter().copied(), e);
    }
    inflight.summary.staged = !inflight.unit_shares.is_empty();
    // Host pieces of mixed transfers: the CPU copies them now.
    for (i, t) in transfers.iter().enumerate() {
        if usable[i] && gates[i].is_none() {
            // SAFETY: forwarded contract.
            unsafe { device::copy_host_pieces(t, Direction::HostToDevice) };
        }
    }
    let event = device.take_event().and_then(|event| {
        // SAFETY: our event; the caller's stream, alive per the contract.
        match check(unsafe { sys::cuEventRecord(event.0, raw) }, "cuEventRecord") {
            Ok(()) => Ok(event),
            Err(e) => {
                device.give_event(event);
                Err(e)
            }
        }
    });
    let (event, done) = match event {
        Ok(event) => (Some(event), false),
        Err(e) => {
            inflight.fail(all.iter().copied(), &e);
            // Without an event the only way to know the stream passed the copies is to wait.
            device::drain(&device, &[raw]);
            (None, true)
        }
    };
    inflight.stages.push(Stage { device: Arc::clone(&device), event, transfers: all, streams: vec![raw], done });
    Ok(inflight)
}

/// One submission being enqueued on a caller's stream.
struct BoundRun<'a> {
    device: &'a Arc<CudaDevice>,
    stream: sys::CUstream,
    handle: StreamHandle,
    staging: StreamStaging,
    /// The unit of the stream, once this submission took its share.
    share: Option<(sys::CUdeviceptr, u64)>,
    inflight: &'a mut InFlight,
}

impl BoundRun<'_> {
    /// # Safety
    /// As `submit_bound`.
    unsafe fn enqueue(
        &mut self,
        transfers: &[Transfer],
        gates: &[Option<&CudaGate>],
        usable: &[bool],
        policy: StagingPolicy,
    ) -> Result<(), TransportError> {
        let kernels = self.device.kernels().ok();
        // Objects already in DRAM first: the stream does not wait on a load to copy them.
        let ready: Vec<Transfer> =
            (0..transfers.len()).filter(|&i| usable[i] && gates[i].is_none()).map(|i| transfers[i].clone()).collect();
        if !ready.is_empty() {
            let staged = match (plan::qualify(policy, Direction::HostToDevice, &ready), kernels) {
                (PathChoice::Staged { .. }, Some(k)) => Some(k.scatter),
                (PathChoice::Staged { .. }, None) => {
                    self.inflight.summary.fallback = Some(Fallback::KernelUnavailable);
                    None
                }
                (PathChoice::Direct(reason), _) => {
                    self.inflight.summary.fallback = Some(reason);
                    None
                }
            };
            match staged {
                // SAFETY: forwarded contract.
                Some(scatter) => unsafe { self.staged(scatter, None, &ready)? },
                // SAFETY: forwarded contract.
                None => unsafe { self.direct(&ready)? },
            }
        }
        // Objects still loading: wait for the gate, then copy, staged whenever possible so that
        // a failed load touches no page.
        for i in (0..transfers.len()).filter(|&i| usable[i]) {
            let Some(gate) = gates[i] else { continue };
            // SAFETY: the gate word is mapped pinned memory that outlives the submission (the
            // engine holds the gate until it completed).
            let waited = unsafe { sys::cuStreamWaitValue32_v2(self.stream, gate.device_addr, GATE_OK, WAIT_VALUE_GEQ) };
            check(waited, "cuStreamWaitValue32")?;
            let one = std::slice::from_ref(&transfers[i]);
            let all_device = transfers[i].pieces.iter().all(|p| !p.kind.is_host());
            match kernels {
                // SAFETY: forwarded contract.
                Some(k) if all_device => unsafe { self.staged(k.scatter_gated, Some(gate.device_addr), one)? },
                // SAFETY: forwarded contract.
                _ => unsafe { self.direct(one)? },
            }
        }
        Ok(())
    }

    /// The stream's unit, shared by this submission from its first staged fill on.
    fn unit(&mut self) -> Option<(sys::CUdeviceptr, u64)> {
        if self.share.is_none() && self.staging.units > 0 {
            match self.device.share_unit(self.handle, self.staging) {
                Ok(Some(share)) => {
                    self.share = Some((share.buffer, share.bytes));
                    self.inflight.unit_shares.push(share);
                }
                Ok(None) => self.inflight.summary.fallback = Some(Fallback::Busy),
                Err(e) => {
                    tracing::warn!(error = %e, "stream-bound staging unit unavailable; direct copies");
                    self.inflight.summary.fallback = Some(Fallback::NoBuffer);
                }
            }
        }
        self.share
    }

    /// Copies `transfers` straight to their pages (one `cuMemcpyBatchAsync`, or a copy loop).
    ///
    /// # Safety
    /// As `submit_bound`.
    unsafe fn direct(&mut self, transfers: &[Transfer]) -> Result<(), TransportError> {
        let copies = plan::direct_copies(transfers, self.device.ordinal);
        // SAFETY: forwarded contract; the planner's copies name the transfers' own bytes.
        unsafe { self.host_to_device(&copies, 0) }
    }

    /// Enqueues `copies` (host -> `base + copy.device`) on the stream: one `cuMemcpyBatchAsync`
    /// where the driver has it (the host's cost per read is what limits a layer-by-layer
    /// caller), else a copy loop.
    ///
    /// # Safety
    /// As `submit_bound`; every `[base + device, +len)` is device memory the read may write.
    unsafe fn host_to_device(&mut self, copies: &[plan::BulkCopy], base: u64) -> Result<(), TransportError> {
        let summary = &mut self.inflight.summary;
        summary.bytes += copies.iter().map(|c| c.len).sum::<u64>();
        let (mut dsts, mut srcs): (Vec<u64>, Vec<u64>) = copies.iter().map(|c| (base + c.device, c.host)).unzip();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.len as usize).collect();
        let batched = copies.len() > 1
            // SAFETY: forwarded contract; the arrays describe exactly `copies`.
            && unsafe { self.device.batch_copy(&mut dsts, &mut srcs, &mut sizes, true, self.stream) }?;
        if batched {
            summary.batch_calls += 1;
            return Ok(());
        }
        for c in copies {
            let result =
                // SAFETY: forwarded contract.
                unsafe { sys::cuMemcpyHtoDAsync_v2(base + c.device, c.host as *const c_void, c.len as usize, self.stream) };
            summary.copy_calls += 1;
            check(result, "cuMemcpyHtoDAsync")?;
        }
        Ok(())
    }

    /// Stages `transfers` through the stream's unit: per fill, the bulk copies into the buffer
    /// and one scatter kernel (`function`, gated by `gate`) reading its rows from the ring. A
    /// fill that finds no unit, no room in the ring or an object larger than the buffer is
    /// copied directly instead.
    ///
    /// # Safety
    /// As `submit_bound`.
    unsafe fn staged(
        &mut self,
        function: sys::CUfunction,
        gate: Option<sys::CUdeviceptr>,
        transfers: &[Transfer],
    ) -> Result<(), TransportError> {
        let Some((buffer, bytes)) = self.unit() else {
            // SAFETY: forwarded contract.
            return unsafe { self.direct(transfers) };
        };
        if transfers.iter().any(|t| t.span().end - t.span().start > bytes) {
            self.inflight.summary.fallback = Some(Fallback::TooLarge);
            // SAFETY: forwarded contract.
            return unsafe { self.direct(transfers) };
        }
        let policy = StagingPolicy { enabled: true, buffer_bytes: bytes, tail_fill_bytes: 0 };
        let grid_cap = self.device.multiprocessors * BLOCKS_PER_SM;
        for fill in plan::split_fills(&policy, Direction::HostToDevice, transfers) {
            let rows = plan::descriptors(&fill, transfers);
            let Some((rows_host, rows_device)) =
                self.inflight.unit_shares.last().and_then(|share| share.take_rows(rows.len()))
            else {
                self.inflight.summary.fallback = Some(Fallback::Busy);
                // SAFETY: forwarded contract.
                unsafe { self.direct(&transfers[fill.transfers.clone()])? };
                continue;
            };
            // SAFETY: the run holds `rows.len()` rows and no queued kernel reads it (runs are
            // given back only once the submission that used them completed).
            unsafe { std::ptr::copy_nonoverlapping(rows.as_ptr(), rows_host, rows.len()) };
            // SAFETY: host bytes per the contract; [buffer + device, +len) lies inside the unit
            // (the planner keeps fills inside `bytes`).
            unsafe { self.host_to_device(&plan::staging_copies(&fill, transfers), buffer)? };
            let mut staging_arg = buffer;
            let mut rows_arg = rows_device;
            let mut count_arg = rows.len() as u32;
            let mut gate_arg = gate.unwrap_or(0);
            let mut params: [*mut c_void; 4] = [
                (&mut staging_arg as *mut u64).cast(),
                (&mut rows_arg as *mut u64).cast(),
                (&mut count_arg as *mut u32).cast(),
                (&mut gate_arg as *mut u64).cast(),
            ];
            let grid = (rows.len() as u32).div_ceil(ROWS_PER_BLOCK).min(grid_cap).max(1);
            // SAFETY: the kernel takes (pointer, pointer, unsigned int[, pointer]); the driver
            // reads as many parameters as it declares and copies them during the call.
            let result = unsafe {
                sys::cuLaunchKernel(
                    function,
                    grid,
                    1,
                    1,
                    KERNEL_THREADS,
                    1,
                    1,
                    0,
                    self.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            self.inflight.summary.kernel_launches += 1;
            check(result, "cuLaunchKernel")?;
            self.inflight.summary.fills += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(capacity: usize) -> StreamUnit {
        StreamUnit {
            buffer: 0,
            bytes: 0,
            rows_host: std::ptr::null_mut(),
            rows_device: 0,
            rows_capacity: capacity,
            runs: Default::default(),
            next_row: 0,
        }
    }

    #[test]
    fn the_row_ring_never_hands_out_rows_a_queued_kernel_may_still_read() {
        let mut u = unit(100);
        assert_eq!(u.take_rows(1, 40), Some(0));
        assert_eq!(u.take_rows(2, 40), Some(40));
        assert_eq!(u.take_rows(3, 30), None, "20 left at the end, 0 free at the start");
        u.release(2);
        assert_eq!(u.take_rows(3, 30), None, "run 2 is back, but behind run 1");
        u.release(1);
        assert_eq!(u.take_rows(3, 30), Some(0), "all back: the ring starts over");
        assert_eq!(u.take_rows(4, 60), Some(30));
        assert_eq!(u.take_rows(5, 11), None);
        u.release(3);
        assert_eq!(u.take_rows(5, 30), Some(0), "wraps into the space run 3 gave back");
        assert_eq!(u.take_rows(6, 1), None, "head meets the oldest live run");
        assert_eq!(u.take_rows(7, 101), None, "more than the ring");
        u.release(4);
        u.release(5);
        assert!(u.runs.is_empty());
    }
}
