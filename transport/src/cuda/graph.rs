//! Streams, events and graphs owned by callers that drive kvtide's stream-bound reads the way an
//! inference worker does: the tests, the `layerwise` benchmark and the examples. A worker
//! running PyTorch has all of these already; kvtide only ever receives a stream handle.
//!
//! Owns their lifetimes (destroyed on drop) and the launches of the workload stand-in kernel
//! (`workload.cu`: a kernel that runs for a set time, as a layer's compute would; compiled by
//! `kernel`, kept by the device). The store itself never uses this module.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::check;
use super::gpu::CudaDevice;
use crate::stream::StreamHandle;
use crate::TransportError;

/// `CU_EVENT_WAIT_EXTERNAL`: inside capture, the wait becomes an external event wait node that
/// waits on whatever record of the event precedes each launch.
const CU_EVENT_WAIT_EXTERNAL: u32 = 1;
/// `CU_STREAM_WAIT_VALUE_EQ`.
const CU_STREAM_WAIT_VALUE_EQ: u32 = 1;

/// A non-blocking stream of one GPU.
pub struct CudaStream {
    device: Arc<CudaDevice>,
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread with its context current (bound first).
unsafe impl Send for CudaStream {}
// SAFETY: as above; the driver serialises work submitted to one stream.
unsafe impl Sync for CudaStream {}

impl std::fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStream").field("gpu", &self.device.ordinal()).field("handle", &self.handle()).finish()
    }
}

impl CudaStream {
    /// A new non-blocking stream on `device`.
    pub fn new(device: &Arc<CudaDevice>) -> Result<CudaStream, TransportError> {
        device.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        check(
            // SAFETY: writes one stream handle; the context is current.
            unsafe { sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        Ok(CudaStream { device: Arc::clone(device), raw })
    }

    /// The handle kvtide's `*_on_stream` reads take.
    pub fn handle(&self) -> StreamHandle {
        self.raw as usize as u64
    }

    /// Blocks until everything enqueued so far has run.
    pub fn synchronize(&self) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: our live stream.
        check(unsafe { sys::cuStreamSynchronize(self.raw) }, "cuStreamSynchronize")
    }

    /// Makes later work on this stream wait for `event`'s latest record. `external` (inside
    /// capture) records an external wait node: each launch of the graph then waits on the record
    /// that precedes it, which is how a graph captured once waits on fresh reads every step.
    pub fn wait_event(&self, event: &CudaEvent, external: bool) -> Result<(), TransportError> {
        self.device.bind()?;
        let flags = if external { CU_EVENT_WAIT_EXTERNAL } else { 0 };
        // SAFETY: live stream and event of this context.
        check(unsafe { sys::cuStreamWaitEvent(self.raw, event.raw, flags) }, "cuStreamWaitEvent")
    }

    /// Enqueues a kernel that runs for `ns` nanoseconds (a layer's compute, or a delay).
    pub fn spin(&self, ns: u64) -> Result<(), TransportError> {
        self.device.bind()?;
        let spin = self.device.workload()?.spin;
        let mut ns_arg = ns;
        let mut params: [*mut c_void; 1] = [(&mut ns_arg as *mut u64).cast()];
        // SAFETY: the kernel takes one unsigned long long; the driver copies it during the call.
        let result = unsafe {
            sys::cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, self.raw, params.as_mut_ptr(), std::ptr::null_mut())
        };
        check(result, "cuLaunchKernel")
    }

    /// Enqueues a device-to-device copy of `len` bytes (a consumer of the KV a read delivered).
    ///
    /// # Safety
    /// Both ranges must be device memory of this GPU that stays valid until the copy ran.
    pub unsafe fn copy_device(&self, dst: u64, src: u64, len: usize) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: the caller vouches for both ranges.
        check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw) }, "cuMemcpyDtoDAsync")
    }

    /// Enqueues a wait until the 32-bit word at `addr` (device memory of this GPU) equals
    /// `value` (`cuStreamWaitValue32`; inside capture, a memory-operation node).
    ///
    /// # Safety
    /// `addr` must be a live, 4-byte aligned word of device memory for as long as the wait can run.
    pub unsafe fn wait_value(&self, addr: u64, value: u32) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: the caller vouches for the word.
        check(
            unsafe { sys::cuStreamWaitValue32_v2(self.raw, addr, value, CU_STREAM_WAIT_VALUE_EQ) },
            "cuStreamWaitValue32",
        )
    }

    /// Enqueues a write of `value` to the 32-bit word at `addr` (`cuStreamWriteValue32`).
    ///
    /// # Safety
    /// As `wait_value`.
    pub unsafe fn write_value(&self, addr: u64, value: u32) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: the caller vouches for the word.
        check(unsafe { sys::cuStreamWriteValue32_v2(self.raw, addr, value, 0) }, "cuStreamWriteValue32")
    }

    /// Starts capturing this stream into a graph (relaxed mode: other threads' CUDA calls are
    /// not affected).
    pub fn begin_capture(&self) -> Result<(), TransportError> {
        self.device.bind()?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: our live stream.
        check(unsafe { sys::cuStreamBeginCapture_v2(self.raw, mode) }, "cuStreamBeginCapture")
    }

    /// Ends the capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<CudaGraph, TransportError> {
        self.device.bind()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: writes one graph handle.
        check(unsafe { sys::cuStreamEndCapture(self.raw, &mut graph) }, "cuStreamEndCapture")?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a graph the capture just made; writes one executable handle.
        let made = check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "cuGraphInstantiate");
        if let Err(e) = made {
            // SAFETY: ours, not instantiated.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        Ok(CudaGraph { device: Arc::clone(&self.device), graph, exec })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: our stream; the driver finishes its work before releasing it.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// An event of one GPU (timing events for measurements, else without timing).
pub struct CudaEvent {
    device: Arc<CudaDevice>,
    raw: sys::CUevent,
}

// SAFETY: as `CudaStream`.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEvent").field("gpu", &self.device.ordinal()).finish()
    }
}

impl CudaEvent {
    /// A new event; `timing` for `elapsed_ms`.
    pub fn new(device: &Arc<CudaDevice>, timing: bool) -> Result<CudaEvent, TransportError> {
        device.bind()?;
        let flags = if timing { 0 } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32 };
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle.
        check(unsafe { sys::cuEventCreate(&mut raw, flags) }, "cuEventCreate")?;
        Ok(CudaEvent { device: Arc::clone(device), raw })
    }

    /// The event's handle (`CUevent`), for `StreamSignal::RecordEvent`.
    pub fn handle(&self) -> u64 {
        self.raw as usize as u64
    }

    /// Records the event on `stream` (any stream of this GPU, by handle).
    pub fn record(&self, stream: StreamHandle) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: our event; the caller vouches for the stream handle.
        check(unsafe { sys::cuEventRecord(self.raw, stream as usize as sys::CUstream) }, "cuEventRecord")
    }

    /// True once the work before the latest record has run.
    pub fn query(&self) -> Result<bool, TransportError> {
        self.device.bind()?;
        // SAFETY: our event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery").map(|()| false),
        }
    }

    /// Blocks until the work before the latest record has run.
    pub fn synchronize(&self) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: our event.
        check(unsafe { sys::cuEventSynchronize(self.raw) }, "cuEventSynchronize")
    }

    /// Milliseconds between two completed records of timing events.
    pub fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32, TransportError> {
        let mut ms = 0f32;
        // SAFETY: two of our events; writes one float.
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.raw, end.raw) }, "cuEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: our event.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

/// An instantiated graph (`CudaStream::end_capture`).
pub struct CudaGraph {
    device: Arc<CudaDevice>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: as `CudaStream`; launches of one executable graph are serialised by the caller.
unsafe impl Send for CudaGraph {}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraph").field("gpu", &self.device.ordinal()).finish()
    }
}

impl CudaGraph {
    /// Launches the whole graph on `stream`.
    pub fn launch(&self, stream: &CudaStream) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: our executable graph and a live stream of its GPU.
        check(unsafe { sys::cuGraphLaunch(self.exec, stream.raw) }, "cuGraphLaunch")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: ours; no launch of it is waited on after drop by contract of the owner.
            unsafe {
                let _ = sys::cuGraphExecDestroy(self.exec);
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}
