//! The staging unit of one GPU's submissions on engine-owned streams (`cuda::device`).
//!
//! Owns the unit (the device staging buffer, its pinned row tables and its two streams), its
//! growth, and the busy flag that gives it to one request at a time. It never enqueues work:
//! the path that claimed the unit does, and releases the flag once its request completed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::sys;

use super::driver::{alloc_mapped_host, check};
use super::plan::Descriptor;
use crate::TransportError;

/// A GPU's staging unit (allocated at first use) and who holds it.
#[derive(Default)]
pub(crate) struct Staging {
    pub(crate) unit: Mutex<Option<StagingUnit>>,
    busy: AtomicBool,
}

impl Staging {
    /// Takes the busy flag; false when another request holds it.
    pub(crate) fn claim(&self) -> bool {
        self.busy.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Gives the busy flag back.
    pub(crate) fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }
}

/// The staging buffer and what it needs; held by one request at a time (`Staging::claim`).
pub(crate) struct StagingUnit {
    pub(crate) buffer: sys::CUdeviceptr,
    buffer_bytes: u64,
    /// The row tables: pinned host memory the kernels read in place (through `rows_device`,
    /// its device-side address), so no table copy queues behind the bulk copies.
    pub(crate) rows_host: *mut Descriptor,
    pub(crate) rows_device: sys::CUdeviceptr,
    pub(crate) rows_capacity: usize,
    pub(crate) copy_stream: sys::CUstream,
    pub(crate) kernel_stream: sys::CUstream,
}

// SAFETY: raw handles and a pinned host pointer owned by this unit; guarded by `Staging`'s mutex
// and busy flag.
unsafe impl Send for StagingUnit {}

/// Allocates (or grows) the staging unit: a buffer of at least `buffer_bytes` and row tables
/// for `rows` descriptors. Called only while holding the busy flag, so nothing uses the old
/// allocations.
pub(crate) fn ensure_unit(
    slot: &mut Option<StagingUnit>,
    buffer_bytes: u64,
    rows: usize,
) -> Result<(), TransportError> {
    if slot.is_none() {
        let mut copy_stream: sys::CUstream = std::ptr::null_mut();
        let mut kernel_stream: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: each call writes one stream handle; the context is current.
        check(unsafe { sys::cuStreamCreate(&mut copy_stream, flags) }, "cuStreamCreate")?;
        // SAFETY: as above.
        check(unsafe { sys::cuStreamCreate(&mut kernel_stream, flags) }, "cuStreamCreate")?;
        *slot = Some(StagingUnit {
            buffer: 0,
            buffer_bytes: 0,
            rows_device: 0,
            rows_host: std::ptr::null_mut(),
            rows_capacity: 0,
            copy_stream,
            kernel_stream,
        });
    }
    let Some(unit) = slot.as_mut() else { return Err(TransportError::CudaUnavailable("no staging unit")) };
    if unit.buffer_bytes < buffer_bytes {
        if unit.buffer != 0 {
            // SAFETY: the old buffer is idle (we hold the busy flag and every earlier request
            // completed before releasing it).
            let _ = unsafe { sys::cuMemFree_v2(unit.buffer) };
            unit.buffer = 0;
            unit.buffer_bytes = 0;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        let started = Instant::now();
        // SAFETY: writes one device pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, buffer_bytes as usize) }, "cuMemAlloc")?;
        unit.buffer = ptr;
        unit.buffer_bytes = buffer_bytes;
        tracing::info!(buffer_bytes, elapsed_us = started.elapsed().as_micros() as u64, "GPU staging buffer allocated");
    }
    if unit.rows_capacity < rows {
        let capacity = rows.next_power_of_two().max(4096);
        let bytes = capacity * std::mem::size_of::<Descriptor>();
        if !unit.rows_host.is_null() {
            // SAFETY: idle pinned allocation of ours.
            let _ = unsafe { sys::cuMemFreeHost(unit.rows_host.cast()) };
            unit.rows_host = std::ptr::null_mut();
        }
        unit.rows_capacity = 0;
        unit.rows_device = 0;
        // DEVICEMAP maps the pinned pages into the GPU's address space so the kernels read the
        // rows in place.
        let (host_rows, device_rows) = alloc_mapped_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP)?;
        unit.rows_host = host_rows.cast();
        unit.rows_device = device_rows;
        unit.rows_capacity = capacity;
    }
    Ok(())
}
