//! A submission to the GPU in progress: its stages (transfers done when an event fired), the
//! per-transfer results and every resource it holds until it completed.
//!
//! Owns completion: `poll` queries the stages' events (`cuEventQuery`), never blocking except
//! to drain the streams of a stage that failed; resources (pooled events and streams, the
//! staging unit's busy flag, stream-bound unit shares) go back once every stage completed, and
//! an `CudaInFlight` dropped unfinished first waits for its streams, so no DMA can still touch
//! leased or reserved host bytes once it reports. It never enqueues work: the paths build the
//! stages. `copy_host_pieces` is the CPU's share of a transfer (its host-memory pieces).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::bound_state::UnitShare;
use super::driver::error_name;
use super::events::{drain, Event, PooledStream};
use super::gpu::CudaDevice;
use super::plan::{Direction, Transfer};
use super::profile::Probe;
use crate::inflight::poll_until_done;
use crate::transfer::Summary;
use crate::TransportError;

/// How long a waiter spins on an event before it starts yielding its CPU.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(200);

/// A stage of a submission: transfers whose bytes are done when `event` has fired.
pub(crate) struct Stage {
    pub(crate) device: Arc<CudaDevice>,
    pub(crate) event: Option<Event>,
    pub(crate) transfers: Vec<usize>,
    /// Streams to wait on if the event cannot tell us (error paths).
    pub(crate) streams: Vec<sys::CUstream>,
    pub(crate) done: bool,
}

// SAFETY: the event is `Send`; the stream handles are only used to wait on error paths.
unsafe impl Send for Stage {}

impl Stage {
    /// Queries the stage's event; true once it completed or failed (a failure is recorded for
    /// each of its transfers in `errors`, after its streams were drained).
    fn poll(&mut self, errors: &mut [Option<TransportError>]) -> bool {
        if self.done {
            return true;
        }
        let Some(event) = &self.event else {
            self.done = true;
            return true;
        };
        if self.device.bind().is_err() {
            return false;
        }
        // SAFETY: the event is ours until the stage is finished.
        let status = unsafe { sys::cuEventQuery(event.raw()) };
        if status == sys::CUresult::CUDA_ERROR_NOT_READY {
            return false;
        }
        if status != sys::CUresult::CUDA_SUCCESS {
            let error = TransportError::Cuda { op: "cuEventQuery", detail: error_name(status) };
            for &t in &self.transfers {
                if let Some(slot) = errors.get_mut(t) {
                    slot.get_or_insert_with(|| error.clone());
                }
            }
            drain(&self.device.context, &self.streams);
        }
        self.done = true;
        true
    }
}

/// Work submitted to the GPU. Poll it (or `wait`) until complete; the host memory and the pages
/// it names must stay valid until then (the engine keeps its leases alive with it).
pub struct CudaInFlight {
    pub(crate) stages: Vec<Stage>,
    pub(crate) errors: Vec<Option<TransportError>>,
    /// Stream-bound staging units this submission shares until it completed.
    pub(crate) unit_shares: Vec<UnitShare>,
    /// Streams borrowed from device pools, returned at completion.
    pub(crate) pooled_streams: Vec<PooledStream>,
    /// The device whose staging unit this request holds.
    pub(crate) staging_of: Option<Arc<CudaDevice>>,
    pub(crate) summary: Summary,
    finished: bool,
    /// Timing events (`KVTIDE_CUDA_PROFILE`), staged requests only.
    pub(crate) probe: Option<Probe>,
}

impl std::fmt::Debug for CudaInFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaInFlight").field("stages", &self.stages.len()).field("summary", &self.summary).finish()
    }
}

impl CudaInFlight {
    pub(crate) fn new(transfers: usize) -> CudaInFlight {
        CudaInFlight {
            stages: Vec::new(),
            errors: vec![None; transfers],
            unit_shares: Vec::new(),
            pooled_streams: Vec::new(),
            staging_of: None,
            summary: Summary::default(),
            finished: false,
            probe: None,
        }
    }

    /// What was submitted.
    pub fn summary(&self) -> &Summary {
        &self.summary
    }

    /// Checks the events; true once every stage has completed (or failed) and every resource
    /// went back. Never blocks, except to drain streams after a failure.
    pub fn poll(&mut self) -> bool {
        if self.finished {
            return true;
        }
        for stage in self.stages.iter_mut().filter(|s| !s.done) {
            if !stage.poll(&mut self.errors) {
                return false;
            }
        }
        if let Some(probe) = self.probe.take() {
            probe.finish(Instant::now());
        }
        self.finish();
        true
    }

    /// The results of the transfers from `from` on whose every stage completed, up to the first
    /// transfer that still has a stage in flight. Never blocks (except to drain streams after a
    /// failure); the results stay for `take_results`.
    pub fn settled_from(&mut self, from: usize) -> Vec<Result<(), TransportError>> {
        let mut first_pending = self.errors.len();
        // Stages mostly complete in the order they were queued: querying stops at the first one
        // still running, and every stage not known complete holds its transfers back.
        let mut querying = true;
        for stage in self.stages.iter_mut().filter(|s| !s.done) {
            if querying && stage.poll(&mut self.errors) {
                continue;
            }
            querying = false;
            if let Some(&t) = stage.transfers.iter().min() {
                first_pending = first_pending.min(t);
            }
            if first_pending <= from {
                // Nothing from `from` on has settled.
                break;
            }
        }
        let settled = self.errors.get(from..first_pending).unwrap_or_default();
        settled.iter().map(|e| e.clone().map_or(Ok(()), Err)).collect()
    }

    /// Polls until complete (spinning briefly, then yielding the CPU) and returns one result per
    /// transfer, in submission order.
    pub fn wait(mut self) -> Vec<Result<(), TransportError>> {
        self.block();
        self.take_results()
    }

    /// Polls until complete, spinning briefly, then yielding the CPU.
    pub fn block(&mut self) {
        poll_until_done(SPIN_BEFORE_YIELD, || self.poll());
    }

    /// The per-transfer results (after `poll` returned true).
    pub fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        std::mem::take(&mut self.errors).into_iter().map(|e| e.map_or(Ok(()), Err)).collect()
    }

    /// Takes over `part`, a submission of the transfers from `base` on: its stages, results
    /// and resources become this one's.
    pub(crate) fn absorb(&mut self, mut part: CudaInFlight, base: usize) {
        for mut stage in part.stages.drain(..) {
            stage.transfers.iter_mut().for_each(|t| *t += base);
            self.stages.push(stage);
        }
        for (i, error) in part.errors.drain(..).enumerate() {
            if let (Some(slot), Some(e)) = (self.errors.get_mut(base + i), error) {
                slot.get_or_insert(e);
            }
        }
        self.unit_shares.append(&mut part.unit_shares);
        self.pooled_streams.append(&mut part.pooled_streams);
        if let Some(device) = part.staging_of.take() {
            if self.staging_of.is_none() {
                self.staging_of = Some(device);
            } else {
                device.staging.release();
            }
        }
        self.summary.absorb(&part.summary);
        // Everything it held is ours now: its drop has nothing left to wait for or give back.
        part.finished = true;
    }

    pub(crate) fn fail(&mut self, transfers: impl IntoIterator<Item = usize>, error: &TransportError) {
        for t in transfers {
            if let Some(slot) = self.errors.get_mut(t) {
                slot.get_or_insert_with(|| error.clone());
            }
        }
    }

    fn finish(&mut self) {
        if self.finished {
            return;
        }
        for stage in &mut self.stages {
            // Back to its pool.
            drop(stage.event.take());
        }
        self.pooled_streams.clear();
        if let Some(device) = self.staging_of.take() {
            device.staging.release();
        }
        self.unit_shares.clear();
        self.finished = true;
    }
}

impl Drop for CudaInFlight {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Dropped before completion (a panic, say): the GPU may still use the memory the caller
        // is about to release, so wait for every stream before giving anything back.
        for stage in &self.stages {
            drain(&stage.device.context, &stage.streams);
        }
        self.finish();
    }
}

/// Copies the host-memory pieces of `transfer` on the CPU; device pieces are left alone.
///
/// # Safety
/// The transfer's host bytes and its host pieces must be valid for the copy and must not
/// overlap (leased or reserved arena bytes and caller memory).
pub unsafe fn copy_host_pieces(transfer: &Transfer, direction: Direction) {
    for piece in transfer.pieces.iter().filter(|p| p.kind.is_host() && p.len > 0) {
        let host = (transfer.host + piece.host_offset) as *mut u8;
        let page = piece.addr as *mut u8;
        let (src, dst) = match direction {
            Direction::HostToDevice => (host.cast_const(), page),
            Direction::DeviceToHost => (page.cast_const(), host),
        };
        // SAFETY: the caller vouches for both ranges; they never overlap.
        unsafe { crate::memcpy::copy_bytes(dst, src, piece.len as usize) };
    }
}
