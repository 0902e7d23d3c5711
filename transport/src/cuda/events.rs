//! Pooled CUDA events and streams of one GPU, for the transport's own submissions.
//!
//! Owns the handles: an `Event` or a `PooledStream` taken from its pool goes back to that pool
//! when dropped (RAII), so every path gives back what it took, on success and failure alike. A
//! handle is never destroyed: the pools live as long as their GPU (the process). It never
//! decides what is enqueued on a stream; `drain` only waits for streams on error and drop paths.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::driver::{check, Context};
use crate::TransportError;

struct RawEvent(sys::CUevent);
struct RawStream(sys::CUstream);
// SAFETY: event and stream handles are driver handles usable from any thread with the context
// current; each is owned by one pool slot or one taker at a time.
unsafe impl Send for RawEvent {}
// SAFETY: as above.
unsafe impl Send for RawStream {}

/// A GPU's idle events (created without timing).
#[derive(Default)]
pub(crate) struct EventPool {
    idle: Mutex<Vec<RawEvent>>,
}

impl EventPool {
    /// An idle event, or a new one. The GPU's context must be current.
    pub(crate) fn take(self: &Arc<Self>) -> Result<Event, TransportError> {
        if let Some(event) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(Event { raw: event.0, pool: Arc::clone(self) });
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: writes one event handle; the context is current.
            unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
            "cuEventCreate",
        )?;
        Ok(Event { raw: event, pool: Arc::clone(self) })
    }
}

/// An event of a GPU's pool; back to the pool when dropped. Whatever a stream captured of its
/// latest record (a `cuStreamWaitEvent`) stays valid after it went back.
pub(crate) struct Event {
    raw: sys::CUevent,
    pool: Arc<EventPool>,
}

// SAFETY: see `RawEvent`; the handle belongs to this value until it drops.
unsafe impl Send for Event {}

impl Event {
    /// The driver handle.
    pub(crate) fn raw(&self) -> sys::CUevent {
        self.raw
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        self.pool.idle.lock().unwrap_or_else(|p| p.into_inner()).push(RawEvent(self.raw));
    }
}

/// A GPU's idle non-blocking streams.
#[derive(Default)]
pub(crate) struct StreamPool {
    idle: Mutex<Vec<RawStream>>,
}

impl StreamPool {
    /// An idle stream, or a new one. The GPU's context must be current.
    pub(crate) fn take(self: &Arc<Self>) -> Result<PooledStream, TransportError> {
        if let Some(stream) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(PooledStream { raw: stream.0, pool: Arc::clone(self) });
        }
        let mut stream: sys::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: writes one stream handle; the context is current (callers bind first).
            unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        Ok(PooledStream { raw: stream, pool: Arc::clone(self) })
    }
}

/// A stream of a GPU's pool; back to the pool when dropped.
pub(crate) struct PooledStream {
    raw: sys::CUstream,
    pool: Arc<StreamPool>,
}

// SAFETY: see `RawStream`; the handle belongs to this value until it drops.
unsafe impl Send for PooledStream {}

impl PooledStream {
    /// The driver handle.
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }
}

impl Drop for PooledStream {
    fn drop(&mut self) {
        self.pool.idle.lock().unwrap_or_else(|p| p.into_inner()).push(RawStream(self.raw));
    }
}

/// Waits for streams (error and drop paths only).
pub(crate) fn drain(context: &Context, streams: &[sys::CUstream]) {
    if context.bind().is_ok() {
        for &stream in streams {
            // SAFETY: a stream this request used; it is still alive (pooled or staging-owned).
            let _ = unsafe { sys::cuStreamSynchronize(stream) };
        }
    }
}
