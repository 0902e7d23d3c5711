//! The CUDA transport behind the `Transport` trait.
//!
//! Owns the glue between the traits (`Transport`, `StreamSubmit`) and the paths below: region
//! checks against each GPU (one `cuPointerGetAttributes` per allocation), the early start into
//! the staging buffer, submissions on engine-owned streams (`device`) and on callers' streams
//! (`bound`), all completing on CUDA events. The staged-or-direct decision stays in `plan`. It
//! never blocks in `poll` (except to drain streams after a failure) and never returns an
//! unfinished submission's resources.

use std::sync::Arc;

use super::bound;
use super::bound_state::{CudaGate, StreamStaging};
use super::device::{self, PartsSubmission, Prestaged};
use super::gpu::CudaTransport;
use super::memory::RangeChecker;
use super::plan::StagingPolicy;
use super::submission;
use crate::inflight::{InFlight, Progress};
use crate::region::{MemoryKind, Region};
use crate::stream::{Gate, StreamHandle, StreamSignal, StreamSubmit};
use crate::transfer::{Direction, Summary, Transfer};
use crate::transport::{EarlyStart, Parts, PartsHint, Transport};
use crate::TransportError;

/// GPU memory through the CUDA driver, with one store's staging policy.
#[derive(Clone)]
pub struct CudaCopier {
    pub transport: Arc<CudaTransport>,
    pub policy: StagingPolicy,
    /// The stream-bound staging pool (`on_stream`).
    pub stream_staging: StreamStaging,
}

impl std::fmt::Debug for CudaCopier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopier")
            .field("policy", &self.policy)
            .field("stream_staging", &self.stream_staging)
            .finish()
    }
}

impl Transport for CudaCopier {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn completes_inline(&self) -> bool {
        false
    }

    fn check(&self, lists: &[&[Region<'_>]], writable: bool) -> Vec<Option<TransportError>> {
        let mut checkers: Vec<(u32, Result<RangeChecker, TransportError>)> = Vec::new();
        let mut out: Vec<Option<TransportError>> = vec![None; lists.len()];
        // One pass over each list (a large read's lists are megabytes): every region's first
        // failure, in region order. Host regions of a mixed list are copied by the CPU: they
        // only need to be writable.
        let mut slot = usize::MAX; // the checker of the last device region seen
        for (owner, regions) in lists.iter().enumerate() {
            for r in regions.iter() {
                if writable {
                    if let Err(e) = r.check_writable() {
                        out[owner] = Some(e.into());
                        break;
                    }
                }
                let MemoryKind::Device { ordinal } = r.kind() else { continue };
                if r.is_empty() {
                    continue;
                }
                if checkers.get(slot).is_none_or(|(o, _)| *o != ordinal) {
                    slot = match checkers.iter().position(|(o, _)| *o == ordinal) {
                        Some(slot) => slot,
                        None => {
                            let checker = self.transport.device(ordinal).map(|d| d.range_checker());
                            checkers.push((ordinal, checker));
                            checkers.len() - 1
                        }
                    };
                }
                let failed = match &mut checkers[slot].1 {
                    Ok(checker) => checker.check(r.addr(), r.len() as u64).err(),
                    Err(e) => Some(e.clone()),
                };
                if let Some(e) = failed {
                    out[owner] = Some(e);
                    break;
                }
            }
        }
        out
    }

    unsafe fn start_early(&self, objects: &[(u64, u64)], target: MemoryKind, total_bytes: u64) -> Option<EarlyStart> {
        let MemoryKind::Device { ordinal } = target else { return None };
        // SAFETY: forwarded contract: the objects stay valid until the prestage is continued
        // and completed, or dropped.
        let prestaged = unsafe { device::prestage(&self.transport, ordinal, objects, self.policy, total_bytes) }?;
        Some(EarlyStart::new(Box::new(prestaged)))
    }

    unsafe fn extend_early(&self, early: &mut EarlyStart, objects: &[(u64, u64)]) -> bool {
        let Some(prestaged) = early.get_mut::<Prestaged>() else { return false };
        // SAFETY: forwarded contract, for the added objects.
        unsafe { prestaged.extend(objects) }
    }

    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        let prestaged = early.and_then(EarlyStart::take::<Prestaged>).map(|p| *p);
        // SAFETY: forwarded contract.
        let inflight = unsafe { device::submit_with(&self.transport, direction, transfers, self.policy, prestaged)? };
        Ok(InFlight::new(Box::new(inflight)))
    }

    fn on_stream(&self) -> Option<&dyn StreamSubmit> {
        Some(self)
    }

    fn submit_parts<'t>(&'t self, direction: Direction, hint: PartsHint) -> Box<dyn Parts + 't> {
        Box::new(PartsSubmission::new(Arc::clone(&self.transport), direction, self.policy, hint.bytes, hint.pieces))
    }
}

impl Parts for PartsSubmission {
    unsafe fn push(&mut self, transfers: &[Transfer]) {
        // SAFETY: forwarded contract.
        unsafe { PartsSubmission::push(self, transfers) }
    }

    fn take_settled(&mut self) -> Vec<Result<(), TransportError>> {
        PartsSubmission::take_settled(self)
    }

    fn finish(self: Box<Self>) -> InFlight {
        InFlight::new(Box::new((*self).finish()))
    }
}

impl StreamSubmit for CudaCopier {
    fn check_stream(&self, stream: StreamHandle) -> Result<u32, TransportError> {
        bound::check_stream(&self.transport, stream)
    }

    fn gate(&self, ordinal: u32) -> Result<Arc<dyn Gate>, TransportError> {
        let device = self.transport.device(ordinal)?;
        Ok(Arc::new(device.bound.gate(&device.context)?))
    }

    fn prepare(&self, ordinal: u32) -> Result<(), TransportError> {
        bound::prepare(&*self.transport.device(ordinal)?, self.stream_staging)
    }

    unsafe fn submit_on_stream(
        &self,
        stream: StreamHandle,
        transfers: &[Transfer],
        gates: &[Option<Arc<dyn Gate>>],
    ) -> Result<InFlight, TransportError> {
        let ordinal = self.check_stream(stream)?;
        // Gates of this transport only: anything else cannot be waited on by a CUDA stream.
        let mut ours: Vec<Option<&CudaGate>> = Vec::with_capacity(transfers.len());
        for i in 0..transfers.len() {
            match gates.get(i).and_then(Option::as_ref) {
                None => ours.push(None),
                Some(gate) => match gate.as_any().downcast_ref::<CudaGate>() {
                    Some(g) => ours.push(Some(g)),
                    None => {
                        return Err(TransportError::Stream { stream, why: "a gate made by another transport".into() })
                    }
                },
            }
        }
        // SAFETY: forwarded contract.
        let inflight = unsafe {
            bound::submit_bound(&self.transport, ordinal, stream, transfers, &ours, self.policy, self.stream_staging)?
        };
        Ok(InFlight::new(Box::new(inflight)))
    }

    unsafe fn signal(&self, stream: StreamHandle, signal: StreamSignal) -> Result<(), TransportError> {
        // SAFETY: forwarded contract.
        unsafe { bound::signal(&self.transport, stream, signal) }
    }
}

impl Progress for submission::CudaInFlight {
    fn poll(&mut self) -> bool {
        submission::CudaInFlight::poll(self)
    }

    fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        submission::CudaInFlight::take_results(self)
    }

    fn summary(&self) -> Summary {
        submission::CudaInFlight::summary(self).clone()
    }

    fn block(&mut self) {
        submission::CudaInFlight::block(self)
    }
}
