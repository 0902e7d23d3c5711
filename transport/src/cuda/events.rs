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

/// A kind of driver handle a pool keeps, and how to make one.
pub(crate) trait HandleKind {
    type Raw: Copy;
    /// A new handle. The GPU's context must be current.
    fn create() -> Result<Self::Raw, TransportError>;
}

/// Events created without timing.
pub(crate) enum EventKind {}

impl HandleKind for EventKind {
    type Raw = sys::CUevent;

    fn create() -> Result<sys::CUevent, TransportError> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        check(
            // SAFETY: writes one event handle; the context is current.
            unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
            "cuEventCreate",
        )?;
        Ok(event)
    }
}

/// Non-blocking streams.
pub(crate) enum StreamKind {}

impl HandleKind for StreamKind {
    type Raw = sys::CUstream;

    fn create() -> Result<sys::CUstream, TransportError> {
        let mut stream: sys::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: writes one stream handle; the context is current (callers bind first).
            unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        Ok(stream)
    }
}

/// An idle handle in its pool.
struct Idle<K: HandleKind>(K::Raw);

// SAFETY: event and stream handles are driver handles usable from any thread with the context
// current; each is owned by one pool slot or one taker at a time.
unsafe impl<K: HandleKind> Send for Idle<K> {}

/// A GPU's idle handles of one kind.
pub(crate) struct Pool<K: HandleKind> {
    idle: Mutex<Vec<Idle<K>>>,
}

impl<K: HandleKind> Default for Pool<K> {
    fn default() -> Self {
        Pool { idle: Mutex::new(Vec::new()) }
    }
}

impl<K: HandleKind> Pool<K> {
    /// An idle handle, or a new one. The GPU's context must be current.
    pub(crate) fn take(self: &Arc<Self>) -> Result<Pooled<K>, TransportError> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let raw = match idle {
            Some(Idle(raw)) => raw,
            None => K::create()?,
        };
        Ok(Pooled { raw, pool: Arc::clone(self) })
    }
}

/// A handle of a GPU's pool; back to the pool when dropped. For an event, whatever a stream
/// captured of its latest record (a `cuStreamWaitEvent`) stays valid after it went back.
pub(crate) struct Pooled<K: HandleKind> {
    raw: K::Raw,
    pool: Arc<Pool<K>>,
}

// SAFETY: see `Idle`; the handle belongs to this value until it drops.
unsafe impl<K: HandleKind> Send for Pooled<K> {}

impl<K: HandleKind> Pooled<K> {
    /// The driver handle.
    pub(crate) fn raw(&self) -> K::Raw {
        self.raw
    }
}

impl<K: HandleKind> Drop for Pooled<K> {
    fn drop(&mut self) {
        self.pool.idle.lock().unwrap_or_else(|p| p.into_inner()).push(Idle(self.raw));
    }
}

/// A GPU's idle events.
pub(crate) type EventPool = Pool<EventKind>;
/// An event of a GPU's pool.
pub(crate) type Event = Pooled<EventKind>;
/// A GPU's idle streams.
pub(crate) type StreamPool = Pool<StreamKind>;
/// A stream of a GPU's pool.
pub(crate) type PooledStream = Pooled<StreamKind>;

/// Waits for streams (error and drop paths only).
pub(crate) fn drain(context: &Context, streams: &[sys::CUstream]) {
    if context.bind().is_ok() {
        for &stream in streams {
            // SAFETY: a stream this request used; it is still alive (pooled or staging-owned).
            let _ = unsafe { sys::cuStreamSynchronize(stream) };
        }
    }
}
