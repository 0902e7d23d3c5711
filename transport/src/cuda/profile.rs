//! Opt-in GPU timelines of staged transfers (`KVTIDE_CUDA_PROFILE=1`), for benchmarks: where
//! the time between the first staged copy and the caller seeing completion goes.
//!
//! A probe records three timing events around a staged request: `start` on the copy stream
//! before its first bulk copy, then `copies_end` on the copy stream and `kernels_end` on the
//! kernel stream after everything the request queued there. When the request completes, the
//! GPU-side offsets of the two ends (from `cuEventElapsedTime`) and the host-side moment the
//! completion was noticed are appended to a bounded process-wide list that `take_timelines`
//! drains. Off (the default), nothing is created or recorded.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::sys;

/// One staged request's timeline, in microseconds from its `start` event (recorded, on an idle
/// copy engine, when the first bulk copy was queued).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timeline {
    /// The request's host-side work before `start` (from the probe's creation).
    pub queued_us: f64,
    /// The last bulk copy finished (GPU clock).
    pub copies_end_us: f64,
    /// The last kernel finished (GPU clock).
    pub kernels_end_us: f64,
    /// The caller's poll saw every event complete (host clock).
    pub noticed_us: f64,
    /// Fills of the request.
    pub fills: u64,
}

/// Timelines kept at most (older ones are dropped first).
const MAX_TIMELINES: usize = 4096;

static TIMELINES: Mutex<Vec<Timeline>> = Mutex::new(Vec::new());

type ElapsedFn = unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> sys::CUresult;

/// `cuEventElapsedTime` under whichever name the driver exports, when profiling is on.
fn elapsed_fn() -> Option<ElapsedFn> {
    static ELAPSED: OnceLock<Option<ElapsedFn>> = OnceLock::new();
    *ELAPSED.get_or_init(|| {
        let on = std::env::var("KVTIDE_CUDA_PROFILE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        if !on {
            return None;
        }
        // SAFETY: the driver library is loaded (a device exists before any probe); `get` only
        // looks a symbol up, read with the signature both names share.
        unsafe {
            let lib = sys::culib();
            for name in [&b"cuEventElapsedTime_v2\0"[..], &b"cuEventElapsedTime\0"[..]] {
                if let Ok(f) = lib.get::<ElapsedFn>(name) {
                    return Some(*f);
                }
            }
        }
        tracing::warn!("KVTIDE_CUDA_PROFILE: the driver has no cuEventElapsedTime; no timelines");
        None
    })
}

/// Drains the timelines recorded so far.
pub fn take_timelines() -> Vec<Timeline> {
    std::mem::take(&mut *TIMELINES.lock().unwrap_or_else(|p| p.into_inner()))
}

/// The timing events of one request.
pub(crate) struct Probe {
    created: Instant,
    started: Option<Instant>,
    start: sys::CUevent,
    copies_end: sys::CUevent,
    kernels_end: sys::CUevent,
    elapsed: ElapsedFn,
    pub(crate) fills: u64,
}

// SAFETY: driver event handles, usable from any thread with the context current; owned by one
// request.
unsafe impl Send for Probe {}

impl Probe {
    /// A probe when profiling is on (and its events could be created; the context is current).
    pub(crate) fn new() -> Option<Probe> {
        let elapsed = elapsed_fn()?;
        let mut events = [std::ptr::null_mut(); 3];
        for (i, event) in events.iter_mut().enumerate() {
            // SAFETY: writes one event handle; timing stays enabled (flags 0).
            if unsafe { sys::cuEventCreate(event, 0) } != sys::CUresult::CUDA_SUCCESS {
                for made in &events[..i] {
                    // SAFETY: created just above, never recorded.
                    unsafe { sys::cuEventDestroy_v2(*made) };
                }
                return None;
            }
        }
        Some(Probe {
            created: Instant::now(),
            started: None,
            start: events[0],
            copies_end: events[1],
            kernels_end: events[2],
            elapsed,
            fills: 0,
        })
    }

    /// Records `start` on `stream` (before the first bulk copy).
    pub(crate) fn record_start(&mut self, stream: sys::CUstream) {
        self.started = Some(Instant::now());
        // SAFETY: our event, a live stream of the current context.
        unsafe { sys::cuEventRecord(self.start, stream) };
    }

    /// Records both ends after everything the request queued.
    pub(crate) fn record_ends(&mut self, copy_stream: sys::CUstream, kernel_stream: sys::CUstream) {
        // SAFETY: our events, live streams of the current context.
        unsafe {
            sys::cuEventRecord(self.copies_end, copy_stream);
            sys::cuEventRecord(self.kernels_end, kernel_stream);
        }
    }

    /// Called when the request was seen complete: reads the offsets and keeps the timeline.
    pub(crate) fn finish(self, noticed: Instant) {
        let Some(started) = self.started else { return };
        let read = |end: sys::CUevent| {
            let mut ms = 0f32;
            // SAFETY: our events; both ends were recorded after every stage event that just
            // fired, so they complete at once (the synchronize only covers the gap).
            unsafe {
                sys::cuEventSynchronize(end);
                ((self.elapsed)(&mut ms, self.start, end) == sys::CUresult::CUDA_SUCCESS).then_some(ms as f64 * 1e3)
            }
        };
        let (Some(copies_end_us), Some(kernels_end_us)) = (read(self.copies_end), read(self.kernels_end)) else {
            return;
        };
        let timeline = Timeline {
            queued_us: started.duration_since(self.created).as_secs_f64() * 1e6,
            copies_end_us,
            kernels_end_us,
            noticed_us: noticed.duration_since(started).as_secs_f64() * 1e6,
            fills: self.fills,
        };
        let mut all = TIMELINES.lock().unwrap_or_else(|p| p.into_inner());
        if all.len() >= MAX_TIMELINES {
            all.remove(0);
        }
        all.push(timeline);
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        for event in [self.start, self.copies_end, self.kernels_end] {
            // SAFETY: our events; destroying a recorded, pending event is allowed (the driver
            // releases it once complete).
            unsafe { sys::cuEventDestroy_v2(event) };
        }
    }
}
