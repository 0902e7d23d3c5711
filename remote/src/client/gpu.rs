//! GPU memory in `RemoteStore`: device destinations and sources, moved by the client itself.
//!
//! Owns the client's GPU transport (the engine's CUDA transport with the client's staging
//! policy, made at first use; without the `cuda` feature or a driver, one that refuses GPU memory
//! with `CudaUnavailable`), the CUDA registration of the owner's arena mapping (read-only) and of
//! put windows, and the copies between them and GPU memory. Over the Unix socket a leased object
//! goes from the arena mapping straight to the GPU, and a put's value from the GPU straight into
//! the put window; elsewhere the bytes take a host buffer in between. It never submits a copy
//! whose device regions the transport has not checked, and never reports a copy before the
//! transport says it completed.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use kvtide::{Error as StoreError, GpuGroup};
use kvtide_transport::{Direction, MemoryKind, Region, Transfer, Transport, TransportError, Unreachable};

use crate::error::{Error, Result};
use crate::shm::Attachment;

/// True when `regions` name GPU memory (the list then goes through the GPU transport, which
/// also copies its host pieces).
pub(super) fn names_device(regions: &[Region<'_>]) -> bool {
    regions.iter().any(|r| matches!(r.kind(), MemoryKind::Device { .. }))
}

/// `regions` cut to their first `len` bytes (a destination larger than the object).
pub(super) fn covering<'a>(regions: &[Region<'a>], len: u64) -> Result<Vec<Region<'a>>> {
    let mut out = Vec::with_capacity(regions.len());
    let mut left = len;
    for r in regions {
        if left == 0 {
            break;
        }
        let take = left.min(r.len() as u64);
        out.push(r.slice(0, take)?);
        left -= take;
    }
    Ok(out)
}

/// The client's GPU transport.
pub(super) struct ClientGpu {
    policy: GpuGroup,
    transport: Mutex<Option<Arc<dyn Transport>>>,
}

impl ClientGpu {
    pub(super) fn new(policy: GpuGroup) -> ClientGpu {
        ClientGpu { policy, transport: Mutex::new(None) }
    }

    pub(super) fn transport(&self) -> Arc<dyn Transport> {
        let mut slot = self.transport.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = slot.as_ref() {
            return Arc::clone(t);
        }
        let made = match self.open() {
            Ok(t) => t,
            Err(error) => Arc::new(Unreachable { error }) as Arc<dyn Transport>,
        };
        *slot = Some(Arc::clone(&made));
        made
    }

    #[cfg(feature = "cuda")]
    fn open(&self) -> std::result::Result<Arc<dyn Transport>, TransportError> {
        use kvtide_transport::cuda::plan::StagingPolicy;
        use kvtide_transport::cuda::{CudaCopier, CudaTransport, StreamStaging};
        let p = &self.policy;
        Ok(Arc::new(CudaCopier {
            transport: CudaTransport::get()?,
            policy: StagingPolicy {
                enabled: p.staging,
                buffer_bytes: p.staging_bytes,
                tail_fill_bytes: p.staging_tail_bytes,
            },
            stream_staging: StreamStaging { units: p.stream_units, unit_bytes: p.stream_unit_bytes },
        }))
    }

    #[cfg(not(feature = "cuda"))]
    fn open(&self) -> std::result::Result<Arc<dyn Transport>, TransportError> {
        let _ = &self.policy;
        Err(TransportError::CudaUnavailable("GPU memory through RemoteStore needs the cuda feature of kvtide-remote"))
    }

    /// Checks region lists that name GPU memory (`writable` for destinations), all at once
    /// (one lookup per device allocation). Each list's result.
    pub(super) fn check_lists(&self, lists: &[&[Region<'_>]], writable: bool) -> Vec<Result<()>> {
        self.transport()
            .check(lists, writable)
            .into_iter()
            .map(|e| match e {
                Some(e) => Err(StoreError::from(e).into()),
                None => Ok(()),
            })
            .collect()
    }

    /// Pins `memory` (the arena mapping, read-only, or a put window) with CUDA once, so copies
    /// from and to it run at DMA speed. Where that fails the copies still work (the driver
    /// stages them), slower.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn pin(&self, memory: (NonNull<u8>, usize, &Attachment), read_only: bool) {
        let (base, len, attachment) = memory;
        #[cfg(feature = "cuda")]
        attachment.attach_once(|| {
            let cuda = kvtide_transport::cuda::CudaTransport::get().ok()?;
            // SAFETY: the registration is kept in the mapping's attachment, which the mapping
            // drops before it unmaps the range.
            match unsafe { cuda.register_host(base, len, read_only) } {
                Ok(registration) => {
                    tracing::info!(bytes = len, read_only, "shared memory registered with CUDA");
                    Some(Box::new(registration))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot register shared memory with CUDA; copies go slower");
                    Some(Box::new(()))
                }
            }
        });
    }

    /// Runs `transfers` in `direction` and waits for them; one result per transfer.
    ///
    /// # Safety
    /// Every transfer's host bytes and pieces must be valid (device pieces checked with `check`)
    /// and untouched by anyone else until this returns.
    pub(super) unsafe fn copy(&self, direction: Direction, transfers: &[Transfer]) -> Vec<Result<()>> {
        if transfers.is_empty() {
            return Vec::new();
        }
        // SAFETY: forwarded contract.
        match unsafe { self.transport().submit(direction, transfers, None) } {
            Ok(inflight) => {
                inflight.wait().into_iter().map(|r| r.map_err(|e| Error::from(StoreError::from(e)))).collect()
            }
            Err(e) => vec![Err(StoreError::from(e).into()); transfers.len()],
        }
    }
}
