//! Stream-bound submissions: a read's copies enqueued on the caller's stream, completion seen
//! through an event recorded on that stream after them.
//!
//! Owns the stream check (which GPU, not being captured) and the enqueueing on a caller's
//! stream: objects already in DRAM first, then each object still loading behind a wait on its
//! gate word (`cuStreamWaitValue32`), staged through the unit bound to the stream when it can
//! (row tables written into the unit's ring, which the scatter kernel reads in place; the gated
//! scatter kernel skips its pages unless the gate says the load succeeded), else copied
//! directly. The units and gate words themselves are the GPU's `bound_state`. It never blocks
//! the host on the caller's stream except to drain it after a failed submission, or when an
//! unfinished submission is dropped.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::bound_state::{CudaGate, StreamStaging, GATE_OK};
use super::driver::check;
use super::events::drain;
use super::gpu::{CudaDevice, CudaTransport};
use super::kernel::{BLOCKS_PER_SM, KERNEL_THREADS, ROWS_PER_BLOCK};
use super::plan::{self, Direction, Fallback, PathChoice, StagingPolicy, Transfer};
use super::submission::{copy_host_pieces, CudaInFlight, Stage};
use crate::region::MemoryKind;
use crate::stream::{StreamHandle, StreamSignal};
use crate::TransportError;

/// `CU_STREAM_WAIT_VALUE_GEQ`.
const WAIT_VALUE_GEQ: u32 = 0;

/// Allocates and compiles now what stream-bound submissions to `device` need: every unit
/// `staging` allows, the kernels, a block of gates and some events.
pub(crate) fn prepare(device: &CudaDevice, staging: StreamStaging) -> Result<(), TransportError> {
    device.bind()?;
    device.kernels()?;
    device.bound.prepare_units(&device.context, staging)?;
    // One gate taken and dropped allocates the first block.
    drop(device.bound.gate(&device.context)?);
    // Sixteen events taken at once, then back to the pool together.
    let events: Vec<_> = (0..16).map(|_| device.take_event()).collect::<Result<_, _>>()?;
    drop(events);
    Ok(())
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
        if transport.device(o).is_ok_and(|d| d.context.ctx == ctx) {
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

/// Enqueues a step's signal on `stream`: the caller's event recorded, or its flag word written.
///
/// # Safety
/// As `StreamSubmit::signal`.
pub(crate) unsafe fn signal(
    transport: &CudaTransport,
    stream: StreamHandle,
    signal: StreamSignal,
) -> Result<(), TransportError> {
    signal.check()?;
    // The stream's GPU, current while the signal is enqueued (this also refuses stream 0 and a
    // capturing stream).
    let ordinal = check_stream(transport, stream)?;
    transport.device(ordinal)?.bind()?;
    let raw = stream as usize as sys::CUstream;
    let status = match signal {
        StreamSignal::RecordEvent(event) => {
            let event = event as usize as sys::CUevent;
            // SAFETY: the caller's live event and stream (this function's contract).
            unsafe { sys::cuEventRecord(event, raw) }
        }
        StreamSignal::WriteValue { addr, value } => {
            // SAFETY: the caller's live word and stream (this function's contract).
            unsafe { sys::cuStreamWriteValue32_v2(raw, addr as sys::CUdeviceptr, value, 0) }
        }
    };
    check(status, "cuEventRecord or cuStreamWriteValue32")
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
) -> Result<CudaInFlight, TransportError> {
    let device = transport.device(ordinal)?;
    device.bind()?;
    let raw = stream as usize as sys::CUstream;
    let mut inflight = CudaInFlight::new(transfers.len());
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
            unsafe { copy_host_pieces(t, Direction::HostToDevice) };
        }
    }
    let event = device.take_event().and_then(|event| {
        // SAFETY: our event; the caller's stream, alive per the contract.
        match check(unsafe { sys::cuEventRecord(event.raw(), raw) }, "cuEventRecord") {
            Ok(()) => Ok(event),
            Err(e) => {
                drop(event);
                Err(e)
            }
        }
    });
    let (event, done) = match event {
        Ok(event) => (Some(event), false),
        Err(e) => {
            inflight.fail(all.iter().copied(), &e);
            // Without an event the only way to know the stream passed the copies is to wait.
            drain(&device.context, &[raw]);
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
    inflight: &'a mut CudaInFlight,
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
            match self.device.bound.share_unit(&self.device.context, self.handle, self.staging) {
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
        let copies = plan::direct_copies(transfers, self.device.ordinal());
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
            && unsafe { self.device.context.batch_copy(&mut dsts, &mut srcs, &mut sizes, true, self.stream) }?;
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
        let grid_cap = self.device.context.multiprocessors * BLOCKS_PER_SM;
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
