//! Memory the caller holds through the driver: device and pinned buffers (tests, benchmarks,
//! examples), host ranges registered with CUDA (the arena, shared-memory mappings), and the
//! device-pointer checks of the regions a request names.
//!
//! Owns those allocations and registrations (freed or unregistered on drop) and the range
//! checks (`cuPointerGetAttributes`, one per allocation). It never moves a transfer's bytes:
//! the paths do.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys;
use kvtide_tiers::dram::{MemoryRegistrar, RegistrationHandle};

use super::driver::{check, CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_READ_ONLY};
use super::gpu::{CudaDevice, CudaTransport};
use crate::TransportError;

impl CudaTransport {
    /// A registrar that pins host memory for every context (`CU_MEMHOSTREGISTER_PORTABLE`).
    pub fn registrar(&self) -> Result<Arc<dyn MemoryRegistrar>, TransportError> {
        let device = self.device(0)?;
        Ok(Arc::new(CudaRegistrar { device }))
    }

    /// Pins `[base, base + len)` for every context until the returned guard drops, so copies
    /// from (and, unless `read_only`, to) it run at DMA speed. `read_only` registers a mapping
    /// this process may only read (`CU_MEMHOSTREGISTER_READ_ONLY`): another process's shared
    /// arena, mapped read-only.
    ///
    /// # Safety
    /// The range must stay mapped until the guard drops.
    pub unsafe fn register_host(
        &self,
        base: NonNull<u8>,
        len: usize,
        read_only: bool,
    ) -> Result<HostRegistration, TransportError> {
        let device = self.device(0)?;
        device.bind()?;
        let flags = CU_MEMHOSTREGISTER_PORTABLE | if read_only { CU_MEMHOSTREGISTER_READ_ONLY } else { 0 };
        // SAFETY: the caller keeps the range mapped until the guard drops (contract).
        check(unsafe { sys::cuMemHostRegister_v2(base.as_ptr().cast(), len, flags) }, "cuMemHostRegister")?;
        Ok(HostRegistration { device, base })
    }
}

/// Host memory pinned by `CudaTransport::register_host`; unpinned when dropped.
pub struct HostRegistration {
    device: Arc<CudaDevice>,
    base: NonNull<u8>,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration").field("base", &self.base).finish()
    }
}

// SAFETY: the guard only names the registered range (never dereferenced); unregistering works
// from any thread once the context is bound.
unsafe impl Send for HostRegistration {}
// SAFETY: as above; no method reads through the pointer.
unsafe impl Sync for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the base of a registration made by `register_host`, still mapped (its
            // caller's contract).
            let _ = unsafe { sys::cuMemHostUnregister(self.base.as_ptr().cast()) };
        }
    }
}

impl CudaDevice {
    /// Checks that every `(addr, len)` lies inside device memory of this GPU (see
    /// `RangeChecker`). Returns the failures as (index, error); empty when all are good.
    pub fn check_device_ranges(
        self: &Arc<Self>,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<(usize, TransportError)>, TransportError> {
        let mut checker = self.range_checker();
        Ok(ranges
            .iter()
            .enumerate()
            .filter_map(|(i, &(addr, len))| checker.check(addr, len).err().map(|e| (i, e)))
            .collect())
    }

    /// A checker for many device ranges of one call: one `cuPointerGetAttributes` per
    /// allocation, the allocations already confirmed remembered for the rest of the call.
    pub fn range_checker(self: &Arc<Self>) -> RangeChecker {
        RangeChecker { device: Arc::clone(self), known: Vec::new(), bound: false }
    }

    /// Allocates `bytes` of device memory (`cuMemAlloc`).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer, TransportError> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) }, "cuMemAlloc")?;
        Ok(DeviceBuffer { device: Arc::clone(self), ptr, len: bytes })
    }

    /// Allocates `bytes` of pinned host memory (`cuMemAllocHost`).
    pub fn alloc_pinned(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuffer, TransportError> {
        self.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one host pointer.
        check(unsafe { sys::cuMemAllocHost_v2(&mut ptr, bytes.max(1)) }, "cuMemAllocHost")?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or(TransportError::Cuda { op: "cuMemAllocHost", detail: "returned null".into() })?;
        Ok(PinnedBuffer { device: Arc::clone(self), ptr, len: bytes })
    }
}

/// Checks device ranges against their GPU (`CudaDevice::range_checker`).
pub struct RangeChecker {
    device: Arc<CudaDevice>,
    /// Allocations confirmed during this call, most recent last.
    known: Vec<(u64, u64)>,
    bound: bool,
}

impl std::fmt::Debug for RangeChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeChecker").field("gpu", &self.device.ordinal()).field("known", &self.known.len()).finish()
    }
}

impl RangeChecker {
    /// Ok when `[addr, addr+len)` lies inside one device allocation of this GPU; a
    /// `DevicePointer` error otherwise. The common case, a page inside the allocation confirmed
    /// last, costs a compare.
    pub fn check(&mut self, addr: u64, len: u64) -> Result<(), TransportError> {
        let end = match addr.checked_add(len) {
            Some(end) if addr != 0 => end,
            _ => return Err(TransportError::DevicePointer { addr, len, why: "null or overflowing range".into() }),
        };
        if let Some(&(s, e)) = self.known.last() {
            if s <= addr && end <= e {
                return Ok(());
            }
        }
        if self.known.iter().any(|&(s, e)| s <= addr && end <= e) {
            return Ok(());
        }
        let pointer = |e: TransportError| match e {
            e @ TransportError::DevicePointer { .. } => e,
            other => TransportError::DevicePointer { addr, len, why: other.to_string() },
        };
        if !self.bound {
            self.device.bind().map_err(pointer)?;
            self.bound = true;
        }
        let info = self.device.context.lookup(addr).map_err(pointer)?;
        self.device.context.judge(addr, len, end, &info).map_err(pointer)?;
        if let Some(range) = info.range {
            if self.known.len() >= 64 {
                self.known.remove(0);
            }
            self.known.push(range);
        }
        Ok(())
    }
}

/// Device memory owned by the caller (tests, benchmarks, examples).
pub struct DeviceBuffer {
    device: Arc<CudaDevice>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

impl DeviceBuffer {
    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU it lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Copies `src` into the buffer at `offset` and waits (synchronous; setup code only).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        crate::region::check_range("device buffer", offset as u64, src.len() as u64, self.len as u64)?;
        self.device.bind()?;
        check(
            // SAFETY: the range was checked against this allocation; src is a live slice.
            unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.as_ptr().cast(), src.len()) },
            "cuMemcpyHtoD",
        )
    }

    /// Copies `dst.len()` bytes from `offset` into `dst` and waits.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        crate::region::check_range("device buffer", offset as u64, dst.len() as u64, self.len as u64)?;
        self.device.bind()?;
        check(
            // SAFETY: the range was checked against this allocation; dst is a live, exclusive slice.
            unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len()) },
            "cuMemcpyDtoH",
        )
    }

    /// Sets every byte to `value` and waits.
    pub fn fill(&self, value: u8) -> Result<(), TransportError> {
        self.device.bind()?;
        // SAFETY: the whole allocation; the default stream, then a context-wide wait.
        check(unsafe { sys::cuMemsetD8Async(self.ptr, value, self.len, std::ptr::null_mut()) }, "cuMemsetD8Async")?;
        self.device.synchronize()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: our own allocation; the owner guarantees nothing still uses it.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Pinned host memory owned by the caller (benchmark baselines).
pub struct PinnedBuffer {
    device: Arc<CudaDevice>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain host memory; access goes through &self / &mut self.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer").field("len", &self.len).finish()
    }
}

impl PinnedBuffer {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated by cuMemAllocHost, alive until drop.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: our own allocation, no longer borrowed.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast()) };
        }
    }
}

/// Registers DRAM arena slices with `cuMemHostRegister` so copies from and to them run at full
/// DMA speed.
struct CudaRegistrar {
    device: Arc<CudaDevice>,
}

impl MemoryRegistrar for CudaRegistrar {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn register(&self, _slice: usize, base: NonNull<u8>, len: usize) -> Result<RegistrationHandle, String> {
        self.device.bind().map_err(|e| e.to_string())?;
        check(
            // SAFETY: [base, base+len) is a live arena slice that stays mapped until `unregister`.
            unsafe { sys::cuMemHostRegister_v2(base.as_ptr().cast(), len, CU_MEMHOSTREGISTER_PORTABLE) },
            "cuMemHostRegister",
        )
        .map_err(|e| e.to_string())?;
        Ok(RegistrationHandle { token: base.as_ptr() as u64 })
    }

    fn unregister(&self, handle: RegistrationHandle) {
        if self.device.bind().is_ok() {
            // SAFETY: the token is the base of a registration made by `register`.
            let _ = unsafe { sys::cuMemHostUnregister(handle.token as *mut c_void) };
        }
    }
}
