//! One GPU as the transport uses it, and the process-wide set of them.
//!
//! Owns `CudaTransport` (the loaded driver and its GPUs, each opened at first use) and
//! `CudaDevice`, which composes a GPU's per-GPU state from the layers that own it: the primary
//! context (`driver`), the compiled kernels (`kernel`), the event and stream pools (`events`),
//! the staging unit of engine-owned streams (`staging`) and the stream-bound units and gate
//! words (`bound_state`). It never enqueues work on a GPU: the modules above (`device`, `bound`,
//! `graph`) do, through a `CudaDevice`.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use super::bound_state::BoundState;
use super::driver::{Context, Driver};
use super::events::{Event, EventPool, PooledStream, StreamPool};
use super::kernel::{self, Kernels, Workload};
use super::staging::Staging;
use crate::TransportError;

/// The loaded driver. One per process (`CudaTransport::get`).
pub struct CudaTransport {
    devices: Vec<OnceLock<Result<Arc<CudaDevice>, TransportError>>>,
    driver: Driver,
}

impl std::fmt::Debug for CudaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTransport")
            .field("devices", &self.devices.len())
            .field("batch_copy", &self.driver.has_batch_copy())
            .finish()
    }
}

static TRANSPORT: OnceLock<Result<Arc<CudaTransport>, TransportError>> = OnceLock::new();

impl CudaTransport {
    /// Loads libcuda and initialises the driver once per process. Without libcuda, a driver or a
    /// GPU, this (and so every CUDA entry point) returns `CudaUnavailable`, never panics.
    pub fn get() -> Result<Arc<CudaTransport>, TransportError> {
        TRANSPORT.get_or_init(Self::load).clone()
    }

    fn load() -> Result<Arc<CudaTransport>, TransportError> {
        let driver = Driver::load()?;
        Ok(Arc::new(CudaTransport { devices: (0..driver.device_count).map(|_| OnceLock::new()).collect(), driver }))
    }

    /// Number of GPUs.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// True when the driver has `cuMemcpyBatchAsync` (CUDA 12.8+).
    pub fn has_batch_copy(&self) -> bool {
        self.driver.has_batch_copy()
    }

    /// GPU `ordinal`, its primary context retained on first use.
    pub fn device(&self, ordinal: u32) -> Result<Arc<CudaDevice>, TransportError> {
        let slot = self.devices.get(ordinal as usize).ok_or(TransportError::NoSuchDevice { ordinal })?;
        slot.get_or_init(|| CudaDevice::open(ordinal, &self.driver).map(Arc::new)).clone()
    }

    /// The GPU whose memory `addr` is, or None for host memory (pageable, pinned or unknown to
    /// CUDA): how raw addresses from other languages are classified.
    pub fn device_of(&self, addr: u64) -> Result<Option<u32>, TransportError> {
        let device = self.device(0)?;
        device.bind()?;
        let info = device.context.lookup(addr)?;
        let is_device = info.memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        Ok(if is_device { u32::try_from(info.ordinal).ok() } else { None })
    }
}

/// One GPU: its primary context and the per-GPU state of every path.
pub struct CudaDevice {
    pub(crate) context: Context,
    kernels: OnceLock<Result<Kernels, TransportError>>,
    /// The workload kernels of tests and benchmarks (`graph`).
    workload: OnceLock<Result<Workload, TransportError>>,
    events: Arc<EventPool>,
    streams: Arc<StreamPool>,
    /// The staging unit of submissions on engine-owned streams (`device`).
    pub(crate) staging: Staging,
    /// Staging units and gate words of stream-bound reads (`bound`).
    pub(crate) bound: BoundState,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.context.ordinal)
            .field("multiprocessors", &self.context.multiprocessors)
            .field("compute_capability", &self.context.compute_capability)
            .finish()
    }
}

impl CudaDevice {
    fn open(ordinal: u32, driver: &Driver) -> Result<CudaDevice, TransportError> {
        Ok(CudaDevice {
            context: Context::open(ordinal, driver)?,
            kernels: OnceLock::new(),
            workload: OnceLock::new(),
            events: Arc::default(),
            streams: Arc::default(),
            staging: Staging::default(),
            bound: BoundState::default(),
        })
    }

    /// GPU ordinal.
    pub fn ordinal(&self) -> u32 {
        self.context.ordinal
    }

    /// Makes this GPU's context current on the calling thread (cheap; every entry point does it).
    pub(crate) fn bind(&self) -> Result<(), TransportError> {
        self.context.bind()
    }

    /// True when the driver has `cuMemcpyBatchAsync`.
    pub fn has_batch_copy(&self) -> bool {
        self.context.has_batch_copy()
    }

    /// Blocks until all work in this GPU's context is done (tests and benchmarks only; the
    /// engine observes completion through events).
    pub fn synchronize(&self) -> Result<(), TransportError> {
        self.context.synchronize()
    }

    /// The staged-copy kernels, compiled at first use.
    pub(crate) fn kernels(&self) -> Result<&Kernels, TransportError> {
        self.kernels.get_or_init(|| kernel::load(&self.context)).as_ref().map_err(Clone::clone)
    }

    /// Compiles the staged kernels now (otherwise at first staged use). For warm-up and tests.
    pub fn prepare_kernels(&self) -> Result<(), TransportError> {
        self.kernels().map(|_| ())
    }

    /// The workload kernels, compiled at first use.
    pub(crate) fn workload(&self) -> Result<&Workload, TransportError> {
        self.workload.get_or_init(|| kernel::load_workload(&self.context)).as_ref().map_err(Clone::clone)
    }

    /// An event of this GPU's pool (the context must be current).
    pub(crate) fn take_event(&self) -> Result<Event, TransportError> {
        self.events.take()
    }

    /// A stream of this GPU's pool (the context must be current).
    pub(crate) fn take_stream(&self) -> Result<PooledStream, TransportError> {
        self.streams.take()
    }
}
