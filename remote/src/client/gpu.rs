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
use kvtide_transport::{
    Direction, InFlight, MemoryKind, Piece, Region, Transfer, Transport, TransportError, Unreachable,
};

use crate::error::{Error, Result};
use crate::shm::Attachment;

/// True when `regions` name GPU memory (the list then goes through the GPU transport, which
/// also copies its host pieces).
pub(super) fn names_device(regions: &[Region<'_>]) -> bool {
    regions.iter().any(|r| matches!(r.kind(), MemoryKind::Device { .. }))
}

/// The GPU the first device region of `regions` is on (0 when none is).
pub(super) fn ordinal_of(regions: &[Region<'_>]) -> u32 {
    regions
        .iter()
        .find_map(|r| match r.kind() {
            MemoryKind::Device { ordinal } => Some(ordinal),
            _ => None,
        })
        .unwrap_or(0)
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

/// The parts of `regions` (laid end to end) that cover `[pos, pos + n)`, as pieces whose host
/// offsets count from `pos`.
pub(super) fn pieces_of(regions: &[Region<'_>], mut pos: u64, n: u64) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut done = 0;
    for r in regions {
        if done == n {
            break;
        }
        let len = r.len() as u64;
        if pos >= len {
            pos -= len;
            continue;
        }
        let take = (len - pos).min(n - done);
        pieces.push(Piece { host_offset: done, addr: r.addr() + pos, len: take, kind: r.kind() });
        done += take;
        pos = 0;
    }
    pieces
}

/// Bounce buffers kept for reuse at most.
const BOUNCE_POOL: usize = 8;

/// A host buffer that bytes from the socket land in on their way to a GPU (pinned where CUDA
/// can pin it, so the copy out of it is DMA), reused across reads.
pub(super) struct Bounce {
    ptr: NonNull<u8>,
    len: usize,
    ordinal: u32,
    _memory: Box<dyn std::any::Any + Send>,
}

// SAFETY: the buffer is owned through `_memory`; the pointer is only used by whoever holds the
// `Bounce` (one reader at a time).
unsafe impl Send for Bounce {}

impl Bounce {
    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// Two bounce buffers of one frame each between the socket and a GPU: a frame is read into one
/// while the copy of the frame before runs from the other, and a buffer is refilled only once
/// the copy that read it completed. At most two frames of an object are in host memory.
pub(super) struct BouncePair<'g> {
    gpu: &'g ClientGpu,
    /// The copy running from each buffer, and the object position its frame ends at.
    copies: [Option<(InFlight, u64)>; 2],
    bounces: Vec<Bounce>,
    /// The buffer the next frame goes into.
    next: usize,
}

impl<'g> BouncePair<'g> {
    /// Two buffers of `frame_bytes` for GPU `ordinal` (kept ones where the pool has them).
    pub(super) fn new(gpu: &'g ClientGpu, ordinal: u32, frame_bytes: usize) -> BouncePair<'g> {
        let bounces = vec![gpu.take_bounce(ordinal, frame_bytes), gpu.take_bounce(ordinal, frame_bytes)];
        BouncePair { gpu, copies: [None, None], bounces, next: 0 }
    }

    /// The buffer the next frame is read into and its length, once the copy that last read
    /// it completed; that copy's outcome and end position, if there was one.
    pub(super) fn next_buffer(&mut self) -> (*mut u8, usize, Option<(Result<()>, u64)>) {
        let k = self.next;
        let done = self.copies[k].take().map(|(copy, end)| (first_failure(copy), end));
        (self.bounces[k].ptr(), self.bounces[k].len(), done)
    }

    /// Starts the copy of the frame just read into the buffer `next_buffer` gave (`n` bytes)
    /// to `pieces`; `end` is the object position the frame ends at.
    ///
    /// # Safety
    /// The buffer must hold the frame's `n` bytes; the device pieces must have been checked by
    /// the transport and stay valid until the copy completed.
    pub(super) unsafe fn submit(&mut self, n: u64, pieces: Vec<Piece>, end: u64) -> Result<()> {
        let k = self.next;
        let transfer = Transfer { host: self.bounces[k].ptr() as u64, host_len: n, pieces };
        // SAFETY: the buffer stays untouched until this copy completed (waited for in
        // `next_buffer` before its reuse, or in `drain` / the drop); the rest is the caller's.
        let copy = unsafe { self.gpu.submit(Direction::HostToDevice, &[transfer]) }?;
        self.copies[k] = Some((copy, end));
        self.next = 1 - k;
        Ok(())
    }

    /// Waits for the copies still running, oldest first: each one's outcome and end position.
    pub(super) fn drain(&mut self) -> Vec<(Result<()>, u64)> {
        let oldest = self.next;
        [oldest, 1 - oldest]
            .into_iter()
            .filter_map(|k| self.copies[k].take())
            .map(|(copy, end)| (first_failure(copy), end))
            .collect()
    }
}

impl Drop for BouncePair<'_> {
    fn drop(&mut self) {
        // The copies first (an `InFlight` dropped early waits for its streams), then the buffers.
        self.copies = [None, None];
        for bounce in self.bounces.drain(..) {
            self.gpu.give_bounce(bounce);
        }
    }
}

/// Waits for `copy`: Ok, or the first transfer's error.
fn first_failure(copy: InFlight) -> Result<()> {
    match copy.wait().into_iter().find(|r| r.is_err()) {
        Some(Err(e)) => Err(StoreError::from(e).into()),
        _ => Ok(()),
    }
}

/// The client's GPU transport.
pub(super) struct ClientGpu {
    policy: GpuGroup,
    transport: Mutex<Option<Arc<dyn Transport>>>,
    bounces: Mutex<Vec<Bounce>>,
}

impl ClientGpu {
    pub(super) fn new(policy: GpuGroup) -> ClientGpu {
        ClientGpu { policy, transport: Mutex::new(None), bounces: Mutex::new(Vec::new()) }
    }

    /// True when GPU copies go through the staging buffer (the `[gpu] staging` policy).
    pub(super) fn stages(&self) -> bool {
        self.policy.staging
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

    /// A bounce buffer of at least `bytes` for GPU `ordinal`: a kept one, or a new one.
    pub(super) fn take_bounce(&self, ordinal: u32, bytes: usize) -> Bounce {
        let mut pool = self.bounces.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = pool.iter().position(|b| b.ordinal == ordinal && b.len >= bytes) {
            return pool.swap_remove(i);
        }
        drop(pool);
        #[cfg(feature = "cuda")]
        {
            let pinned = kvtide_transport::cuda::CudaTransport::get()
                .and_then(|t| t.device(ordinal))
                .and_then(|d| d.alloc_pinned(bytes));
            if let Ok(mut buffer) = pinned {
                let ptr = NonNull::new(buffer.as_mut_slice().as_mut_ptr());
                if let Some(ptr) = ptr {
                    return Bounce { ptr, len: bytes, ordinal, _memory: Box::new(buffer) };
                }
            }
        }
        let mut buffer = vec![0u8; bytes.max(1)].into_boxed_slice();
        let ptr = NonNull::new(buffer.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Bounce { ptr, len: bytes, ordinal, _memory: Box::new(buffer) }
    }

    /// Keeps `bounce` for the next read (a few at most).
    pub(super) fn give_bounce(&self, bounce: Bounce) {
        let mut pool = self.bounces.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < BOUNCE_POOL {
            pool.push(bounce);
        }
    }

    /// Submits `transfers` in `direction` without waiting for them.
    ///
    /// # Safety
    /// As `copy`, until the returned `InFlight` completed or dropped.
    pub(super) unsafe fn submit(&self, direction: Direction, transfers: &[Transfer]) -> Result<InFlight> {
        // SAFETY: forwarded contract.
        unsafe { self.transport().submit(direction, transfers, None) }.map_err(|e| StoreError::from(e).into())
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
