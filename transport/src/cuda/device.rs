//! Submissions on engine-owned streams: the staged path (whole objects through the GPU's
//! staging unit, one scatter or gather kernel per fill) and the direct path (one copy per
//! piece, contiguous neighbours merged), whole or in parts, and the early start of a read's
//! bulk copies into the staging buffer (`prestage`).
//!
//! Owns the queueing of a planned request on the GPU's pooled streams and its staging unit.
//! It never decides the path or the layout (`plan` does), never blocks in
//! `cuStreamSynchronize` on the normal path (completion is the `CudaInFlight`'s events), and
//! never touches a caller's stream (`bound` does).

use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::driver::check;
use super::events::{drain, Event};
use super::gpu::{CudaDevice, CudaTransport};
use super::kernel::{Kernels, BLOCKS_PER_SM, KERNEL_THREADS, ROWS_PER_BLOCK};
use super::plan::{self, Descriptor, Direction, Fallback, PathChoice, StagingPolicy, Transfer};
use super::profile::Probe;
use super::staging::ensure_unit;
use super::submission::{copy_host_pieces, CudaInFlight, Stage};
use crate::region::MemoryKind;
use crate::transfer::Summary;
use crate::TransportError;

/// Test hooks: make the next staged fills or direct submissions fail at submission, as a
/// failed copy or kernel launch would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InjectedFault {
    /// The scatter/gather launch of the next fill fails (after its copies were enqueued).
    StagedLaunch,
    /// The next direct submission fails after its first copy was enqueued.
    DirectCopy,
}

/// 0: disarmed; n > 0: the n-th operation from now fails.
static FAIL_STAGED: AtomicU32 = AtomicU32::new(0);
static FAIL_DIRECT: AtomicU32 = AtomicU32::new(0);

/// Makes the operation of kind `fault` that follows `after` successful ones fail (`None`
/// disarms). Process-wide; GPU tests only.
#[doc(hidden)]
pub fn inject_fault(fault: InjectedFault, after: Option<u32>) {
    let armed = after.map_or(0, |n| n.saturating_add(1));
    match fault {
        InjectedFault::StagedLaunch => FAIL_STAGED.store(armed, Ordering::SeqCst),
        InjectedFault::DirectCopy => FAIL_DIRECT.store(armed, Ordering::SeqCst),
    }
}

/// Counts one operation down; true when it is the one that must fail.
fn take_fault(counter: &AtomicU32) -> bool {
    counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) == Ok(1)
}

fn injected(op: &'static str) -> TransportError {
    TransportError::Cuda { op, detail: "injected failure (test hook)".into() }
}

/// Keeps a GPU's staging buffer marked busy (see `CudaDevice::hold_staging`).
#[doc(hidden)]
pub struct StagingHold(Arc<CudaDevice>);

impl std::fmt::Debug for StagingHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingHold").field("gpu", &self.0.ordinal()).finish()
    }
}

impl Drop for StagingHold {
    fn drop(&mut self) {
        self.0.staging.release();
    }
}

/// Submits `transfers` (already validated: device pages checked with `check_device_ranges`).
/// Staged when `policy` allows and the request qualifies and the buffer is free; otherwise
/// direct. Host pieces are copied by the calling thread before this returns.
///
/// # Safety
/// Every transfer's host bytes and every piece's memory must stay valid, and not be touched by
/// anyone else, until the returned `CudaInFlight` has completed (`poll` true, `wait` returned, or
/// dropped).
pub unsafe fn submit(
    transport: &CudaTransport,
    direction: Direction,
    transfers: &[Transfer],
    policy: StagingPolicy,
) -> Result<CudaInFlight, TransportError> {
    // SAFETY: forwarded contract.
    unsafe { submit_with(transport, direction, transfers, policy, None) }
}

/// `submit`, continuing a `prestage` of the same objects when the request qualifies for staging
/// with the prestaged layout (the copies already running into the staging buffer are then not
/// issued again). Otherwise the prestage is discarded first (its copies, which only touched the
/// private staging buffer, are waited for) and the request takes its path as `submit` would.
///
/// # Safety
/// As `submit`; the prestaged host bytes are the transfers' own.
pub unsafe fn submit_with(
    transport: &CudaTransport,
    direction: Direction,
    transfers: &[Transfer],
    policy: StagingPolicy,
    prestaged: Option<Prestaged>,
) -> Result<CudaInFlight, TransportError> {
    let survey = plan::survey(policy, direction, transfers);
    let prestaged = match (survey.choice, prestaged) {
        (PathChoice::Staged { ordinal }, Some(p)) if p.matches(ordinal, direction, transfers, &survey.spans) => Some(p),
        (_, other) => {
            drop(other); // discarded: waits for its copies, frees the buffer
            None
        }
    };
    let fallback = match survey.choice {
        PathChoice::Staged { ordinal } => {
            let device = transport.device(ordinal)?;
            // SAFETY: forwarded contract.
            match unsafe { submit_staged(&device, direction, transfers, &survey, policy, prestaged) } {
                Ok(inflight) => return Ok(inflight),
                Err(reason) => reason,
            }
        }
        PathChoice::Direct(reason) => reason,
    };
    // SAFETY: forwarded contract.
    Ok(unsafe { submit_direct_all(transport, direction, transfers, fallback) })
}

/// The direct path for every GPU `transfers` name, taken for `fallback`; host pieces are copied
/// by the calling thread while the DMA engines run.
///
/// # Safety
/// As `submit`.
unsafe fn submit_direct_all(
    transport: &CudaTransport,
    direction: Direction,
    transfers: &[Transfer],
    fallback: Fallback,
) -> CudaInFlight {
    let mut inflight = CudaInFlight::new(transfers.len());
    inflight.summary.fallback = Some(fallback);
    for ordinal in plan::ordinals(transfers) {
        let device = match transport.device(ordinal) {
            Ok(device) => device,
            Err(e) => {
                let touched = transfers_on(transfers, ordinal);
                inflight.fail(touched, &e);
                continue;
            }
        };
        // SAFETY: forwarded contract.
        unsafe { submit_direct(&device, direction, transfers, &mut inflight) };
    }
    for transfer in transfers {
        // SAFETY: forwarded contract.
        unsafe { copy_host_pieces(transfer, direction) };
    }
    inflight
}

/// A read's bulk copies into the staging buffer, started as soon as its objects are leased,
/// while the caller still checks the destinations and plans: they touch only the engine's
/// private staging buffer, never a destination, so a request that then does not qualify simply
/// discards them (dropping this waits for the copies' events, then frees the buffer) and takes
/// the direct path with nothing submitted to its destinations. A caller that leases its objects
/// in parts adds each part as it is leased (`extend`), so the first copies start after the first
/// part's leases rather than all of them. Holds the staging buffer (its busy flag) until dropped
/// or continued by `submit_with`.
pub struct Prestaged {
    device: Arc<CudaDevice>,
    policy: StagingPolicy,
    buffer: sys::CUdeviceptr,
    /// (host address, length) of each object, in the order the transfers will have.
    objects: Vec<(u64, u64)>,
    /// The fills of the request (taken by the submission that continues this prestage).
    fills: Vec<plan::Fill>,
    /// Where the fills stand after the objects laid out so far.
    cursor: plan::FillCursor,
    /// One event per prestaged fill (the first `copied.len()` fills), recorded on the copy
    /// stream after that fill's bulk copies.
    copied: Vec<Event>,
    /// Every fill so far is prestaged: none reuses an earlier fill's region yet.
    queueing: bool,
    /// An extension failed: the objects and fills are not the request's, so no submission
    /// continues this prestage.
    broken: bool,
    copy_stream: sys::CUstream,
    copy_calls: u64,
    bytes: u64,
    /// Continued by a submission (which took the events and the busy flag).
    consumed: bool,
    probe: Option<Probe>,
}

// SAFETY: driver handles usable from any thread with the context current (bound before use);
// the staging unit they belong to is held through the busy flag.
unsafe impl Send for Prestaged {}

impl std::fmt::Debug for Prestaged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prestaged")
            .field("gpu", &self.device.ordinal())
            .field("objects", &self.objects.len())
            .field("fills", &self.fills.len())
            .field("prestaged_fills", &self.copied.len())
            .finish()
    }
}

impl Prestaged {
    /// Fills whose bulk copies are already queued.
    pub fn prestaged_fills(&self) -> usize {
        self.copied.len()
    }

    /// True when `transfers` (whose host spans are `spans`) are the prestaged objects, whole, in
    /// the same order (their staged layout is then the one planned here).
    fn matches(&self, ordinal: u32, direction: Direction, transfers: &[Transfer], spans: &[Range<u64>]) -> bool {
        !self.broken
            && self.device.ordinal() == ordinal
            && direction == Direction::HostToDevice
            && transfers.len() == self.objects.len()
            && spans.len() == transfers.len()
            && transfers
                .iter()
                .zip(spans)
                .zip(&self.objects)
                .all(|((t, span), &(host, len))| t.host == host && span.start == 0 && span.end == len)
    }

    /// Adds `objects` after the ones laid out so far: their fills continue the ring, and those
    /// whose buffer region no earlier fill of the request reuses are copied now. False (and the
    /// prestage matches no submission any more) when an object does not fit the buffer or a copy
    /// could not be queued.
    ///
    /// # Safety
    /// As `prestage`, for the added objects.
    pub unsafe fn extend(&mut self, objects: &[(u64, u64)]) -> bool {
        if self.broken {
            return false;
        }
        if objects.iter().any(|&(_, len)| len > self.policy.buffer_bytes) || self.device.bind().is_err() {
            self.broken = true;
            return false;
        }
        // SAFETY: forwarded contract.
        let queued = unsafe { self.lay_out(objects) };
        self.broken |= !queued;
        queued
    }

    /// Lays out `objects` after those laid out so far and queues the copies of each new fill
    /// while no fill reuses an earlier one's region (a reused region must wait for the earlier
    /// fill's scatter, which needs the checked destinations). The kernels read their row tables
    /// from pinned host memory, so nothing but these copies is queued on the copy stream and
    /// each fill's scatter can start as soon as its copies land. False when a copy could not be
    /// queued (the copy stream is drained).
    ///
    /// # Safety
    /// As `prestage`, for `objects`; the device's context is current.
    unsafe fn lay_out(&mut self, objects: &[(u64, u64)]) -> bool {
        let from = self.objects.len();
        let first_new = self.fills.len();
        self.objects.extend_from_slice(objects);
        let fills = plan::split_fills_from(&self.policy, Direction::HostToDevice, objects, &mut self.cursor);
        self.fills.extend(fills.into_iter().map(|fill| fill.shifted(from)));
        for f in first_new..self.fills.len() {
            let fill = &self.fills[f];
            self.queueing &= !self.fills[..f].iter().any(|e| plan::regions_overlap(&e.region, &fill.region));
            if !self.queueing {
                break;
            }
            for copy in plan::staging_copies(fill, &self.objects) {
                // SAFETY: host bytes per the caller's contract; [buffer + device, +len) lies
                // inside the staging buffer this prestage holds.
                let result = unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        self.buffer + copy.device,
                        copy.host as *const c_void,
                        copy.len as usize,
                        self.copy_stream,
                    )
                };
                if check(result, "cuMemcpyHtoDAsync").is_err() {
                    drain(&self.device.context, &[self.copy_stream]);
                    return false;
                }
                self.copy_calls += 1;
                self.bytes += copy.len;
            }
            let Ok(event) = self.device.take_event() else {
                drain(&self.device.context, &[self.copy_stream]);
                return false;
            };
            // SAFETY: our event, the unit's live stream.
            if check(unsafe { sys::cuEventRecord(event.raw(), self.copy_stream) }, "cuEventRecord").is_err() {
                drop(event);
                drain(&self.device.context, &[self.copy_stream]);
                return false;
            }
            self.copied.push(event);
        }
        true
    }
}

impl Drop for Prestaged {
    fn drop(&mut self) {
        if self.consumed {
            return;
        }
        // Discarded: wait until the copies into the staging buffer completed (their events; a
        // failure drains the stream), then give the buffer back.
        if self.device.bind().is_ok() {
            let mut failed = false;
            for event in &self.copied {
                loop {
                    // SAFETY: our recorded event.
                    let status = unsafe { sys::cuEventQuery(event.raw()) };
                    if status != sys::CUresult::CUDA_ERROR_NOT_READY {
                        failed |= status != sys::CUresult::CUDA_SUCCESS;
                        break;
                    }
                    std::thread::yield_now();
                }
            }
            if failed {
                drain(&self.device.context, &[self.copy_stream]);
            }
        }
        // Back to their pool.
        self.copied.clear();
        self.device.staging.release();
    }
}

/// Starts a read's bulk copies into GPU `ordinal`'s staging buffer for `objects` ((host address,
/// length) of each whole object, in request order) before the request is checked and planned:
/// every fill whose buffer region no earlier fill of the request reuses is copied now, each
/// followed by an event. `total_bytes` sizes the fills for a request whose later objects come
/// through `Prestaged::extend` (0: `objects` are all). None (nothing submitted) when staging is
/// off, the kernels, the buffer or the GPU are unavailable, an object does not fit, or another
/// request holds the buffer. Continue it with `submit_with`, or drop it.
///
/// # Safety
/// The objects' host bytes must stay valid and unchanged until the returned value is dropped or
/// the `CudaInFlight` of the submission that continued it completed.
pub unsafe fn prestage(
    transport: &CudaTransport,
    ordinal: u32,
    objects: &[(u64, u64)],
    policy: StagingPolicy,
    total_bytes: u64,
) -> Option<Prestaged> {
    if !policy.enabled || objects.is_empty() || objects.iter().any(|&(_, len)| len > policy.buffer_bytes) {
        return None;
    }
    let device = transport.device(ordinal).ok()?;
    device.bind().ok()?;
    device.kernels().ok()?;
    device.staging.claim().then_some(())?;
    // From here the flag belongs to `prestaged` (its drop frees it).
    let mut prestaged = Prestaged {
        device: Arc::clone(&device),
        policy,
        buffer: 0,
        objects: Vec::with_capacity(objects.len()),
        fills: Vec::new(),
        cursor: plan::FillCursor { total: total_bytes, ..plan::FillCursor::default() },
        copied: Vec::new(),
        queueing: true,
        broken: false,
        copy_stream: std::ptr::null_mut(),
        copy_calls: 0,
        bytes: 0,
        consumed: false,
        probe: None,
    };
    let (buffer, copy_stream) = {
        let mut guard = device.staging.unit.lock().unwrap_or_else(|p| p.into_inner());
        ensure_unit(&mut guard, policy.buffer_bytes, 0).ok()?;
        let unit = guard.as_ref()?;
        (unit.buffer, unit.copy_stream)
    };
    prestaged.buffer = buffer;
    prestaged.copy_stream = copy_stream;
    prestaged.probe = Probe::new();
    if let Some(probe) = prestaged.probe.as_mut() {
        probe.record_start(copy_stream);
    }
    // Laid out as whole objects: the layout `split_fills` gives the real transfers (it only
    // looks at each transfer's host address and span).
    // SAFETY: forwarded contract; the context was bound above.
    unsafe { prestaged.lay_out(objects) }.then_some(prestaged)
}

fn transfers_on(transfers: &[Transfer], ordinal: u32) -> Vec<usize> {
    transfers
        .iter()
        .enumerate()
        .filter(|(_, t)| t.pieces.iter().any(|p| p.kind == MemoryKind::Device { ordinal }))
        .map(|(i, _)| i)
        .collect()
}

impl CudaDevice {
    /// Holds the staging buffer as an in-flight request would, until the guard drops (tests of
    /// the busy fallback). None when it is already held.
    #[doc(hidden)]
    pub fn hold_staging(self: &Arc<Self>) -> Option<StagingHold> {
        self.staging.claim().then(|| StagingHold(Arc::clone(self)))
    }
}

/// How a benchmark baseline submits its copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaselineMode {
    /// One `cuMemcpy{HtoD,DtoH}Async` per copy.
    PerCopy,
    /// One `cuMemcpyBatchAsync` for all of them.
    Batch,
}

impl CudaDevice {
    /// Benchmark baselines (no engine): submits `copies` on an engine-style stream and polls an
    /// event until done. Returns the time from the first call to completion, as a caller sees it
    /// (building the batch arrays included). `Batch` without driver support is `CudaUnavailable`.
    ///
    /// # Safety
    /// Every copy's host and device ranges must be valid for the duration of the call.
    pub unsafe fn timed_copies(
        self: &Arc<Self>,
        copies: &[plan::BulkCopy],
        to_device: bool,
        mode: BaselineMode,
    ) -> Result<Duration, TransportError> {
        self.bind()?;
        let stream = self.take_stream()?;
        // On failure the stream goes back to its pool.
        let event = self.take_event()?;
        let started = Instant::now();
        let submitted = (|| {
            match mode {
                BaselineMode::Batch => {
                    let (mut dsts, mut srcs): (Vec<u64>, Vec<u64>) =
                        copies.iter().map(|c| if to_device { (c.device, c.host) } else { (c.host, c.device) }).unzip();
                    let mut sizes: Vec<usize> = copies.iter().map(|c| c.len as usize).collect();
                    // SAFETY: forwarded contract.
                    if !unsafe { self.context.batch_copy(&mut dsts, &mut srcs, &mut sizes, to_device, stream.raw()) }? {
                        return Err(TransportError::CudaUnavailable("the driver has no cuMemcpyBatchAsync"));
                    }
                }
                BaselineMode::PerCopy => {
                    for c in copies {
                        // SAFETY: forwarded contract.
                        let result = unsafe {
                            if to_device {
                                sys::cuMemcpyHtoDAsync_v2(
                                    c.device,
                                    c.host as *const c_void,
                                    c.len as usize,
                                    stream.raw(),
                                )
                            } else {
                                sys::cuMemcpyDtoHAsync_v2(c.host as *mut c_void, c.device, c.len as usize, stream.raw())
                            }
                        };
                        check(result, "cuMemcpyAsync")?;
                    }
                }
            }
            // SAFETY: our event and stream.
            check(unsafe { sys::cuEventRecord(event.raw(), stream.raw()) }, "cuEventRecord")
        })();
        let result = submitted.and_then(|()| loop {
            // SAFETY: our recorded event.
            let status = unsafe { sys::cuEventQuery(event.raw()) };
            if status != sys::CUresult::CUDA_ERROR_NOT_READY {
                break check(status, "cuEventQuery").map(|()| started.elapsed());
            }
            std::hint::spin_loop();
        });
        if result.is_err() {
            drain(&self.context, &[stream.raw()]);
        }
        // Both back to their pools.
        drop(event);
        drop(stream);
        result
    }
}

/// Direct path on one GPU: one copy per device piece, contiguous neighbours merged, as one
/// `cuMemcpyBatchAsync` where the driver has it, else a `cuMemcpy*Async` loop.
///
/// # Safety
/// As `submit`.
unsafe fn submit_direct(
    device: &Arc<CudaDevice>,
    direction: Direction,
    transfers: &[Transfer],
    inflight: &mut CudaInFlight,
) {
    let ordinal = device.ordinal();
    let touched = transfers_on(transfers, ordinal);
    let prepared = device.bind().and_then(|()| device.take_stream());
    let stream = match prepared {
        Ok(stream) => stream,
        Err(e) => {
            inflight.fail(touched, &e);
            return;
        }
    };
    let raw_stream = stream.raw();
    inflight.pooled_streams.push(stream);
    let copies = plan::direct_copies(transfers, ordinal);
    let to_device = direction == Direction::HostToDevice;
    let mut submitted = Ok(());
    let inject = take_fault(&FAIL_DIRECT);
    if device.has_batch_copy() && !inject {
        let (mut dsts, mut srcs): (Vec<u64>, Vec<u64>) =
            copies.iter().map(|c| if to_device { (c.device, c.host) } else { (c.host, c.device) }).unzip();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.len as usize).collect();
        // SAFETY: forwarded contract; the arrays describe exactly the planned copies.
        submitted =
            unsafe { device.context.batch_copy(&mut dsts, &mut srcs, &mut sizes, to_device, raw_stream) }.map(|_| ());
        inflight.summary.batch_calls += 1;
    } else {
        for (i, copy) in copies.iter().enumerate() {
            if inject && i == 1 {
                submitted = Err(injected("cuMemcpyHtoDAsync"));
                break;
            }
            // SAFETY: forwarded contract: both ranges are valid for the life of the request.
            let result = unsafe {
                if to_device {
                    sys::cuMemcpyHtoDAsync_v2(copy.device, copy.host as *const c_void, copy.len as usize, raw_stream)
                } else {
                    sys::cuMemcpyDtoHAsync_v2(copy.host as *mut c_void, copy.device, copy.len as usize, raw_stream)
                }
            };
            inflight.summary.copy_calls += 1;
            if let Err(e) = check(result, if to_device { "cuMemcpyHtoDAsync" } else { "cuMemcpyDtoHAsync" }) {
                submitted = Err(e);
                break;
            }
        }
        if inject && copies.len() <= 1 {
            submitted = Err(injected("cuMemcpyHtoDAsync"));
        }
    }
    inflight.summary.bytes += copies.iter().map(|c| c.len).sum::<u64>();
    if let Err(e) = &submitted {
        // Some copies may be queued: these keys fail, and the stream is drained before the
        // caller releases anything (the stage below waits for it).
        inflight.fail(touched.iter().copied(), e);
    }
    let event = device.take_event().and_then(|event| {
        // SAFETY: our event and stream; the context is current.
        check(unsafe { sys::cuEventRecord(event.raw(), raw_stream) }, "cuEventRecord").map(|()| event)
    });
    match event {
        Ok(event) => inflight.stages.push(Stage {
            device: Arc::clone(device),
            event: Some(event),
            transfers: touched,
            streams: vec![raw_stream],
            done: false,
        }),
        Err(e) => {
            inflight.fail(touched.iter().copied(), &e);
            drain(&device.context, &[raw_stream]);
        }
    }
}

/// Staged path: whole objects copied contiguously into the device buffer, then ONE kernel per
/// fill scatters them to their pages (or, for writes, one kernel gathers the pages and large
/// copies move them to the host). Returns the fallback reason, having submitted nothing, when the
/// kernels, the buffer or its memory are not available.
///
/// # Safety
/// As `submit`.
unsafe fn submit_staged(
    device: &Arc<CudaDevice>,
    direction: Direction,
    transfers: &[Transfer],
    survey: &plan::Survey,
    policy: StagingPolicy,
    mut prestaged: Option<Prestaged>,
) -> Result<CudaInFlight, Fallback> {
    // A prestage already holds the busy flag; on failure, dropping it waits for its copies and
    // frees the flag.
    let mut run = StagedRun::start(device, policy, survey.rows, prestaged.is_some())?;
    let fills = match prestaged.as_mut() {
        Some(p) => std::mem::take(&mut p.fills),
        None => plan::split_fills(&policy, direction, &survey.host_spans(transfers)),
    };
    let mut inflight = CudaInFlight::new(transfers.len());
    inflight.staging_of = Some(Arc::clone(device));
    inflight.summary.staged = true;
    // The prestaged fills: their bulk copies are queued on the copy stream already, each
    // followed by its event. From here the request owns the busy flag.
    let mut copied: Vec<Option<Event>> = Vec::new();
    let mut probe = None;
    if let Some(mut p) = prestaged.take() {
        inflight.summary.copy_calls += p.copy_calls;
        inflight.summary.bytes += p.bytes;
        copied = std::mem::take(&mut p.copied).into_iter().map(Some).collect();
        probe = p.probe.take();
        p.consumed = true;
    } else if let Some(mut p) = Probe::new() {
        p.record_start(run.copy_stream);
        probe = Some(p);
    }
    // SAFETY: forwarded contract.
    unsafe { run.enqueue(&mut inflight, 0, direction, transfers, &fills, copied) };
    if let Some(mut p) = probe {
        p.fills = inflight.summary.fills;
        p.record_ends(run.copy_stream, run.kernel_stream);
        inflight.probe = Some(p);
    }
    Ok(inflight)
}

/// One GPU's staging unit taken by a request, and where that request's fills stand in it. The
/// request's `CudaInFlight` holds the busy flag (`staging_of`) and the events `reusable` names
/// (its stages'), so they outlive every fill queued here.
struct StagedRun {
    device: Arc<CudaDevice>,
    buffer: sys::CUdeviceptr,
    rows_device: sys::CUdeviceptr,
    rows_host: *mut Descriptor,
    rows_total: usize,
    row_base: usize,
    copy_stream: sys::CUstream,
    kernel_stream: sys::CUstream,
    /// Per fill queued so far: its buffer region and the event after which it may be reused.
    reusable: Vec<(std::ops::Range<u64>, sys::CUevent)>,
    cursor: plan::FillCursor,
}

// SAFETY: driver handles and the pinned row table of the staging unit the request holds through
// the busy flag; one request (one thread at a time) uses them.
unsafe impl Send for StagedRun {}

impl StagedRun {
    /// Takes `device`'s staging unit for a request of at most `rows` table rows. `held`: the
    /// caller holds the busy flag already (a prestage, which frees it when dropped). Otherwise
    /// the flag is taken here and, on failure, given back.
    fn start(device: &Arc<CudaDevice>, policy: StagingPolicy, rows: usize, held: bool) -> Result<StagedRun, Fallback> {
        if device.bind().is_err() {
            return Err(Fallback::KernelUnavailable);
        }
        if let Err(e) = device.kernels() {
            tracing::debug!(error = %e, "staged kernels unavailable; direct path");
            return Err(Fallback::KernelUnavailable);
        }
        if !held && !device.staging.claim() {
            return Err(Fallback::Busy);
        }
        let mut guard = device.staging.unit.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = ensure_unit(&mut guard, policy.buffer_bytes, rows) {
            drop(guard);
            if !held {
                device.staging.release();
            }
            tracing::warn!(error = %e, "staging buffer unavailable; direct path");
            return Err(Fallback::NoBuffer);
        }
        let Some(unit) = guard.as_ref() else {
            if !held {
                device.staging.release();
            }
            return Err(Fallback::NoBuffer);
        };
        Ok(StagedRun {
            device: Arc::clone(device),
            buffer: unit.buffer,
            rows_device: unit.rows_device,
            rows_host: unit.rows_host,
            rows_total: unit.rows_capacity,
            row_base: 0,
            copy_stream: unit.copy_stream,
            kernel_stream: unit.kernel_stream,
            reusable: Vec::new(),
            cursor: plan::FillCursor::default(),
        })
    }

    /// Table rows left for later fills.
    fn rows_left(&self) -> usize {
        self.rows_total - self.row_base
    }

    /// Queues `fills` of `transfers`, whose first transfer is `base` in `inflight`; `copied[f]`
    /// is the event after fill `f`'s prestaged copies. A fill that fails to queue fails with
    /// every later one (never replayed through the direct path); what was queued before it
    /// still completes and is reported by its own stage, and the streams are drained so nothing
    /// of the failed fill can still run once the caller reports.
    ///
    /// # Safety
    /// As `submit`, for `transfers`.
    unsafe fn enqueue(
        &mut self,
        inflight: &mut CudaInFlight,
        base: usize,
        direction: Direction,
        transfers: &[Transfer],
        fills: &[plan::Fill],
        mut copied: Vec<Option<Event>>,
    ) {
        let device = Arc::clone(&self.device);
        let streams = vec![self.copy_stream, self.kernel_stream];
        let grid_cap = device.context.multiprocessors * BLOCKS_PER_SM;
        let to_device = direction == Direction::HostToDevice;
        let mut failure: Option<(usize, TransportError)> = None;
        let kernels = match device.kernels() {
            Ok(kernels) => Some(kernels),
            Err(e) => {
                failure = Some((0, e.clone()));
                None
            }
        };
        for (f, fill) in fills.iter().enumerate() {
            let (Some(kernels), None) = (kernels, &failure) else { break };
            let fill_transfers: Vec<usize> = fill.transfers.clone().map(|t| base + t).collect();
            let already = copied.get_mut(f).and_then(Option::take);
            // A prestaged fill's copies are queued already.
            let copies = if already.is_some() { Vec::new() } else { plan::staging_copies(fill, transfers) };
            let rows_ptr = self.rows_device + (self.row_base * std::mem::size_of::<Descriptor>()) as u64;
            let waits: Vec<sys::CUevent> = self
                .reusable
                .iter()
                .filter(|(region, _)| plan::regions_overlap(region, &fill.region))
                .map(|(_, e)| *e)
                .collect();
            let job = FillJob {
                kernels,
                to_device,
                buffer: self.buffer,
                rows_device: rows_ptr,
                // SAFETY: `row_base` never passes `rows_total`, the rows of the pinned table.
                rows_host: unsafe { self.rows_host.add(self.row_base) },
                rows_left: self.rows_left(),
                write_rows: &|rows: &mut [Descriptor]| plan::descriptors_into(fill, transfers, rows),
                copies: &copies,
                waits: &waits,
                copy_stream: self.copy_stream,
                kernel_stream: self.kernel_stream,
                grid_cap,
            };
            // SAFETY: forwarded contract for host bytes and pages; the buffer and row tables belong
            // to the staging unit this request holds, and rows from `row_base` on are unused.
            let result = unsafe { enqueue_fill(&device, &job, &mut inflight.summary, already) };
            match result {
                Ok((done, rows)) => {
                    self.row_base += rows;
                    // The fill's completion event is also the moment its region may be reused.
                    self.reusable.push((fill.region.clone(), done.raw()));
                    inflight.stages.push(Stage {
                        device: Arc::clone(&device),
                        event: Some(done),
                        transfers: fill_transfers,
                        streams: streams.clone(),
                        done: false,
                    });
                    inflight.summary.fills += 1;
                }
                Err(e) => failure = Some((f, e)),
            }
        }
        if let Some((f, error)) = failure {
            let failed: Vec<usize> =
                fills[f..].iter().flat_map(|fill| fill.transfers.clone()).map(|t| base + t).collect();
            inflight.fail(failed.iter().copied(), &error);
            drain(&device.context, &streams);
            // Prestaged fills never reached: their copies are drained with the copy stream, and
            // their events go back to the pool.
            drop(copied);
            inflight.stages.push(Stage { device, event: None, transfers: failed, streams, done: true });
        }
    }
}

/// A request submitted in parts (`Transport::submit_parts` of the CUDA transport). Each part
/// is queued as it is pushed: staged through one GPU's staging unit, taken at the first part
/// that qualifies and held until the request completed, each part's fills continuing the ring
/// where the last part's ended; a part that does not qualify (or finds the unit taken) goes
/// direct. One `CudaInFlight` reports every part's transfers in push order.
pub struct PartsSubmission {
    transport: Arc<CudaTransport>,
    direction: Direction,
    policy: StagingPolicy,
    /// The whole request's bounds (bytes, table rows).
    hint: (u64, usize),
    inflight: CudaInFlight,
    run: Option<StagedRun>,
    /// Why staging could not be had; later parts go direct.
    no_staging: Option<Fallback>,
    probe: Option<Probe>,
    /// Leading transfers whose results `take_settled` reported.
    settled: usize,
}

impl std::fmt::Debug for PartsSubmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartsSubmission").field("inflight", &self.inflight).finish()
    }
}

impl PartsSubmission {
    /// A request of at most `bytes` in `pieces` pieces, in `direction`.
    pub fn new(
        transport: Arc<CudaTransport>,
        direction: Direction,
        policy: StagingPolicy,
        bytes: u64,
        pieces: usize,
    ) -> PartsSubmission {
        // Each piece is one row per started descriptor chunk.
        let rows = pieces.saturating_add((bytes / plan::DESCRIPTOR_CHUNK_BYTES) as usize);
        PartsSubmission {
            transport,
            direction,
            policy,
            hint: (bytes, rows),
            inflight: CudaInFlight::new(0),
            run: None,
            no_staging: None,
            probe: None,
            settled: 0,
        }
    }

    /// Queues `transfers` behind the parts pushed before.
    ///
    /// # Safety
    /// As `submit`, until the `CudaInFlight` that `finish` returns has completed (or this was
    /// dropped).
    pub unsafe fn push(&mut self, transfers: &[Transfer]) {
        let base = self.inflight.errors.len();
        self.inflight.errors.resize(base + transfers.len(), None);
        let survey = plan::survey(self.policy, self.direction, transfers);
        let fallback = match survey.choice {
            PathChoice::Staged { ordinal } => match self.take_staging(ordinal, survey.rows) {
                Ok(()) => {
                    if let Some(run) = self.run.as_mut() {
                        let spans = survey.host_spans(transfers);
                        let fills = plan::split_fills_from(&self.policy, self.direction, &spans, &mut run.cursor);
                        // SAFETY: forwarded contract.
                        unsafe { run.enqueue(&mut self.inflight, base, self.direction, transfers, &fills, Vec::new()) };
                        return;
                    }
                    Fallback::NoBuffer
                }
                Err(reason) => reason,
            },
            PathChoice::Direct(reason) => reason,
        };
        // SAFETY: forwarded contract.
        let part = unsafe { submit_direct_all(&self.transport, self.direction, transfers, fallback) };
        self.inflight.absorb(part, base);
    }

    /// Makes sure `run` can stage a part of at most `rows` table rows on GPU `ordinal`: the unit
    /// is taken at the first such part.
    fn take_staging(&mut self, ordinal: u32, rows: usize) -> Result<(), Fallback> {
        if let Some(reason) = self.no_staging {
            return Err(reason);
        }
        if self.run.is_none() {
            let device = self.transport.device(ordinal).map_err(|_| Fallback::NoBuffer)?;
            let mut run = match StagedRun::start(&device, self.policy, self.hint.1.max(rows), false) {
                Ok(run) => run,
                Err(reason) => {
                    self.no_staging = Some(reason);
                    return Err(reason);
                }
            };
            run.cursor.total = self.hint.0;
            self.inflight.staging_of = Some(device);
            self.inflight.summary.staged = true;
            if let Some(mut p) = Probe::new() {
                p.record_start(run.copy_stream);
                self.probe = Some(p);
            }
            self.run = Some(run);
        }
        let Some(run) = self.run.as_mut() else { return Err(Fallback::NoBuffer) };
        // The unit is this request's already: a part on another GPU, or with more rows than
        // the request said it would have, goes direct.
        if run.device.ordinal() != ordinal {
            return Err(Fallback::Busy);
        }
        if rows > run.rows_left() {
            return Err(Fallback::NoBuffer);
        }
        Ok(())
    }

    /// The results of pushed transfers that completed since the last call (a leading run).
    pub fn take_settled(&mut self) -> Vec<Result<(), TransportError>> {
        let settled = self.inflight.settled_from(self.settled);
        self.settled += settled.len();
        settled
    }

    /// Every pushed transfer's result, in push order, once the returned `CudaInFlight` completed.
    pub fn finish(mut self) -> CudaInFlight {
        let mut inflight = std::mem::replace(&mut self.inflight, CudaInFlight::new(0));
        if let (Some(mut p), Some(run)) = (self.probe.take(), self.run.as_ref()) {
            p.fills = inflight.summary.fills;
            p.record_ends(run.copy_stream, run.kernel_stream);
            inflight.probe = Some(p);
        }
        inflight
    }
}

/// One fill of a staged request, ready to enqueue (`enqueue_fill`), in the staging unit the
/// request holds.
struct FillJob<'a> {
    kernels: &'a Kernels,
    to_device: bool,
    /// The unit's staging buffer.
    buffer: sys::CUdeviceptr,
    /// Device address of this fill's rows in the unit's pinned table.
    rows_device: sys::CUdeviceptr,
    /// Host address of this fill's rows, and the rows left in the table from there.
    rows_host: *mut Descriptor,
    rows_left: usize,
    /// Writes the fill's rows; None when they do not fit.
    write_rows: &'a dyn Fn(&mut [Descriptor]) -> Option<usize>,
    /// Bulk copies between the host and the buffer (none for a prestaged fill: queued already).
    copies: &'a [plan::BulkCopy],
    /// Events after which earlier fills of the request left this fill's buffer region.
    waits: &'a [sys::CUevent],
    copy_stream: sys::CUstream,
    kernel_stream: sys::CUstream,
    /// Blocks per kernel launch at most.
    grid_cap: u32,
}

/// Enqueues one fill and returns the event after which its buffer region is free again, and the
/// number of table rows it used. The fill's rows are written into its own slice of the pinned
/// host table, which the kernel reads in place.
///
/// # Safety
/// As `submit`; the job's buffer and rows are the held unit's, and no queued kernel reads those
/// rows.
unsafe fn enqueue_fill(
    device: &CudaDevice,
    job: &FillJob<'_>,
    summary: &mut Summary,
    prestaged: Option<Event>,
) -> Result<(Event, usize), TransportError> {
    // SAFETY: rows_host has room for rows_left rows (the caller's contract) and no kernel reads
    // them until the launch `enqueue_ordered` issues after these writes.
    let table = unsafe { std::slice::from_raw_parts_mut(job.rows_host, job.rows_left) };
    let Some(row_count) = (job.write_rows)(table) else {
        drop(prestaged);
        return Err(TransportError::Cuda { op: "scatter table", detail: "more rows than planned".into() });
    };
    // On failure `prestaged` goes back to its pool.
    let done = device.take_event()?;
    // SAFETY: forwarded contract; the rows are written.
    let result = unsafe { job.enqueue_ordered(device, row_count, &done, prestaged.as_ref(), summary) };
    // The waits captured `prestaged`'s record: the handle may go back to the pool now.
    drop(prestaged);
    match result {
        Ok(()) => Ok((done, row_count)),
        Err(e) => {
            drop(done);
            Err(e)
        }
    }
}

impl FillJob<'_> {
    /// Enqueues the fill's operations in stream order, `done` recorded after the last one.
    ///
    /// # Safety
    /// As `enqueue_fill`, with the fill's `row_count` rows written.
    unsafe fn enqueue_ordered(
        &self,
        device: &CudaDevice,
        row_count: usize,
        done: &Event,
        prestaged: Option<&Event>,
        summary: &mut Summary,
    ) -> Result<(), TransportError> {
        let (copy_stream, kernel_stream) = (self.copy_stream, self.kernel_stream);
        if let Some(copied) = prestaged {
            // Reads whose bulk copies `prestage` queued (on the copy stream, before `copied`
            // was recorded): the kernel stream waits for them and scatters.
            for &w in self.waits {
                wait(kernel_stream, w)?;
            }
            wait(kernel_stream, copied.raw())?;
            // SAFETY: forwarded contract.
            unsafe { self.launch(self.kernels.scatter, kernel_stream, row_count, summary)? };
            return record(done, kernel_stream);
        }
        let handoff = device.take_event()?;
        let queued = if self.to_device {
            // copy stream: wait until earlier fills of this region were scattered, then fill it.
            // kernel stream: scatter once the fill is in.
            (|| {
                for &w in self.waits {
                    wait(copy_stream, w)?;
                }
                // SAFETY: forwarded contract.
                unsafe { self.bulk(summary)? };
                record(&handoff, copy_stream)?;
                wait(kernel_stream, handoff.raw())?;
                // SAFETY: forwarded contract.
                unsafe { self.launch(self.kernels.scatter, kernel_stream, row_count, summary)? };
                record(done, kernel_stream)
            })()
        } else {
            // kernel stream: gather once earlier fills of the region drained to the host.
            // copy stream: drain this fill once gathered.
            (|| {
                for &w in self.waits {
                    wait(kernel_stream, w)?;
                }
                // SAFETY: forwarded contract.
                unsafe { self.launch(self.kernels.gather, kernel_stream, row_count, summary)? };
                record(&handoff, kernel_stream)?;
                wait(copy_stream, handoff.raw())?;
                // SAFETY: forwarded contract.
                unsafe { self.bulk(summary)? };
                record(done, copy_stream)
            })()
        };
        // The waits captured the handoff's record: the handle may go back to the pool now.
        drop(handoff);
        queued
    }

    /// Enqueues the bulk copies between the host and the buffer on the copy stream.
    ///
    /// # Safety
    /// As `enqueue_fill`.
    unsafe fn bulk(&self, summary: &mut Summary) -> Result<(), TransportError> {
        let (buffer, copy_stream) = (self.buffer, self.copy_stream);
        for copy in self.copies {
            // SAFETY: host bytes per the caller's contract; [buffer + device, +len) lies inside
            // the staging buffer (the planner keeps fills inside it).
            let result = unsafe {
                if self.to_device {
                    sys::cuMemcpyHtoDAsync_v2(
                        buffer + copy.device,
                        copy.host as *const c_void,
                        copy.len as usize,
                        copy_stream,
                    )
                } else {
                    sys::cuMemcpyDtoHAsync_v2(
                        copy.host as *mut c_void,
                        buffer + copy.device,
                        copy.len as usize,
                        copy_stream,
                    )
                }
            };
            summary.copy_calls += 1;
            summary.bytes += copy.len;
            check(result, if self.to_device { "cuMemcpyHtoDAsync" } else { "cuMemcpyDtoHAsync" })?;
        }
        Ok(())
    }

    /// Launches `function` (scatter or gather) over the fill's `row_count` rows on `stream`.
    ///
    /// # Safety
    /// As `enqueue_ordered`.
    unsafe fn launch(
        &self,
        function: sys::CUfunction,
        stream: sys::CUstream,
        row_count: usize,
        summary: &mut Summary,
    ) -> Result<(), TransportError> {
        if take_fault(&FAIL_STAGED) {
            return Err(injected("cuLaunchKernel"));
        }
        if row_count == 0 {
            return Ok(());
        }
        let mut staging_arg = self.buffer;
        let mut rows_arg = self.rows_device;
        let mut count_arg = row_count as u32;
        let mut params: [*mut c_void; 3] = [
            (&mut staging_arg as *mut u64).cast(),
            (&mut rows_arg as *mut u64).cast(),
            (&mut count_arg as *mut u32).cast(),
        ];
        let grid = (row_count as u32).div_ceil(ROWS_PER_BLOCK).min(self.grid_cap).max(1);
        // SAFETY: the kernel takes (pointer, pointer, unsigned int), matching `params`; the
        // driver copies the arguments during the call.
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
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        summary.kernel_launches += 1;
        check(result, "cuLaunchKernel")
    }
}

/// Records `event` on `stream`.
fn record(event: &Event, stream: sys::CUstream) -> Result<(), TransportError> {
    // SAFETY: our event, a live stream of the current context.
    check(unsafe { sys::cuEventRecord(event.raw(), stream) }, "cuEventRecord")
}

/// Makes `stream` wait for `event`'s latest record.
fn wait(stream: sys::CUstream, event: sys::CUevent) -> Result<(), TransportError> {
    // SAFETY: both handles are alive; the wait is enqueued device-side (the host does not block).
    check(unsafe { sys::cuStreamWaitEvent(stream, event, 0) }, "cuStreamWaitEvent")
}
