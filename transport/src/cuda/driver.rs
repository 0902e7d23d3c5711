//! The CUDA driver, loaded at run time: the process-wide handle, per-GPU primary contexts, the
//! arena registrar (`cuMemHostRegister`) and device-pointer checks.
//!
//! It owns every call into libcuda. It never lets cudarc panic: libcuda's presence is checked
//! before the first call, optional symbols (`cuMemcpyBatchAsync`) are looked up without cudarc's
//! panicking loader, and every failure becomes a `TransportError`.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use kvtide_tiers::dram::{MemoryRegistrar, RegistrationHandle};

use crate::TransportError;

/// A driver call's result as a `TransportError` naming the call.
pub(crate) fn check(result: sys::CUresult, op: &'static str) -> Result<(), TransportError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(TransportError::Cuda { op, detail: error_name(result) })
    }
}

/// The driver's name for an error code ("CUDA_ERROR_ILLEGAL_ADDRESS").
pub(crate) fn error_name(result: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null).
    let found = unsafe { sys::cuGetErrorName(result, &mut name) };
    if found == sys::CUresult::CUDA_SUCCESS && !name.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
    } else {
        format!("{result:?}")
    }
}

/// `cuMemcpyBatchAsync` as CUDA 12.8 declared it (with `failIdx`).
type BatchV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut MemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;
/// `cuMemcpyBatchAsync_v2` (CUDA 13: no `failIdx`).
type BatchV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut MemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// `CUmemcpyAttributes` (the same layout in CUDA 12.8 and 13).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct MemcpyAttributes {
    src_access_order: i32,
    src_loc_type: i32,
    src_loc_id: i32,
    dst_loc_type: i32,
    dst_loc_id: i32,
    flags: u32,
}

const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: i32 = 1;
const CU_MEM_LOCATION_TYPE_DEVICE: i32 = 1;
const CU_MEM_LOCATION_TYPE_HOST: i32 = 2;
const CU_MEMHOSTREGISTER_PORTABLE: u32 = 1;
const CU_MEMHOSTREGISTER_READ_ONLY: u32 = 8;

/// Whichever batched-copy entry point the driver has.
#[derive(Clone, Copy)]
enum BatchCopy {
    V1(BatchV1),
    V2(BatchV2),
}

/// The loaded driver. One per process (`CudaTransport::get`).
pub struct CudaTransport {
    devices: Vec<OnceLock<Result<Arc<CudaDevice>, TransportError>>>,
    batch_copy: Option<BatchCopy>,
}

impl std::fmt::Debug for CudaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTransport")
            .field("devices", &self.devices.len())
            .field("batch_copy", &self.batch_copy.is_some())
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
        // SAFETY: only tries to dlopen the library names; nothing from it is called.
        if !unsafe { sys::is_culib_present() } {
            return Err(TransportError::CudaUnavailable("libcuda was not found (no NVIDIA driver)"));
        }
        // SAFETY: libcuda is present (checked above), so cudarc's loader finds it; cuInit has no
        // pointer arguments.
        let init = unsafe { sys::cuInit(0) };
        if init != sys::CUresult::CUDA_SUCCESS {
            tracing::info!(error = %error_name(init), "cuInit failed: no usable CUDA device");
            return Err(TransportError::CudaUnavailable("cuInit failed: no usable CUDA device"));
        }
        let mut count = 0i32;
        // SAFETY: writes one int.
        check(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount")
            .map_err(|_| TransportError::CudaUnavailable("cuDeviceGetCount failed"))?;
        if count <= 0 {
            return Err(TransportError::CudaUnavailable("no CUDA device"));
        }
        let batch_copy = load_batch_copy();
        tracing::info!(devices = count, batch_copy = batch_copy.is_some(), "CUDA driver loaded");
        Ok(Arc::new(CudaTransport { devices: (0..count).map(|_| OnceLock::new()).collect(), batch_copy }))
    }

    /// Number of GPUs.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// True when the driver has `cuMemcpyBatchAsync` (CUDA 12.8+).
    pub fn has_batch_copy(&self) -> bool {
        self.batch_copy.is_some()
    }

    /// GPU `ordinal`, its primary context retained on first use.
    pub fn device(&self, ordinal: u32) -> Result<Arc<CudaDevice>, TransportError> {
        let slot = self.devices.get(ordinal as usize).ok_or(TransportError::NoSuchDevice { ordinal })?;
        slot.get_or_init(|| CudaDevice::open(ordinal, self.batch_copy).map(Arc::new)).clone()
    }

    /// The GPU whose memory `addr` is, or None for host memory (pageable, pinned or unknown to
    /// CUDA): how raw addresses from other languages are classified.
    pub fn device_of(&self, addr: u64) -> Result<Option<u32>, TransportError> {
        let device = self.device(0)?;
        device.bind()?;
        let info = device.lookup(addr)?;
        let is_device = info.memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        Ok(if is_device { u32::try_from(info.ordinal).ok() } else { None })
    }

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

fn load_batch_copy() -> Option<BatchCopy> {
    // SAFETY: libcuda is loaded (the caller checked); `get` only looks a symbol up, and each
    // symbol is read as the signature its CUDA version declares.
    unsafe {
        let lib = sys::culib();
        if let Ok(f) = lib.get::<BatchV2>(b"cuMemcpyBatchAsync_v2\0") {
            return Some(BatchCopy::V2(*f));
        }
        if let Ok(f) = lib.get::<BatchV1>(b"cuMemcpyBatchAsync\0") {
            return Some(BatchCopy::V1(*f));
        }
    }
    None
}

/// One GPU: its primary context and attributes. Executors (`cuda::device`) hang off it.
pub struct CudaDevice {
    pub(crate) ordinal: u32,
    pub(crate) ctx: sys::CUcontext,
    pub(crate) multiprocessors: u32,
    pub(crate) compute_capability: (i32, i32),
    batch_copy: Option<BatchCopy>,
    pub(crate) exec: super::device::Executor,
}

// SAFETY: a CUcontext handle may be used from any thread (each thread makes it current first);
// the executor's mutable state is behind its own locks.
unsafe impl Send for CudaDevice {}
// SAFETY: as above.
unsafe impl Sync for CudaDevice {}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("multiprocessors", &self.multiprocessors)
            .field("compute_capability", &self.compute_capability)
            .finish()
    }
}

impl CudaDevice {
    fn open(ordinal: u32, batch_copy: Option<BatchCopy>) -> Result<CudaDevice, TransportError> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one device handle; the ordinal is below the device count.
        check(unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) }, "cuDeviceGet")?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle. The primary context is retained for the life of the
        // process (never released), so handles derived from it stay valid.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain")?;
        let attribute = |attr: sys::CUdevice_attribute| -> Result<i32, TransportError> {
            let mut value = 0i32;
            // SAFETY: writes one int for a valid device.
            check(unsafe { sys::cuDeviceGetAttribute(&mut value, attr, dev) }, "cuDeviceGetAttribute")?;
            Ok(value)
        };
        let multiprocessors = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let major = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok(CudaDevice {
            ordinal,
            ctx,
            multiprocessors: multiprocessors.max(1) as u32,
            compute_capability: (major, minor),
            batch_copy,
            exec: super::device::Executor::default(),
        })
    }

    /// GPU ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Makes this GPU's context current on the calling thread (cheap; every entry point does it).
    pub(crate) fn bind(&self) -> Result<(), TransportError> {
        // SAFETY: the context is retained for the life of the process.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// True when the driver has `cuMemcpyBatchAsync`.
    pub fn has_batch_copy(&self) -> bool {
        self.batch_copy.is_some()
    }

    /// Submits `copies` (`dsts[i] <- srcs[i]`, `sizes[i]` bytes) as one `cuMemcpyBatchAsync` on
    /// `stream`. `to_device` picks the location hints. Returns false without submitting anything
    /// when the driver lacks the call.
    ///
    /// # Safety
    /// Every range must be valid memory of its side for as long as the stream may run the copies.
    pub(crate) unsafe fn batch_copy(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        to_device: bool,
        stream: sys::CUstream,
    ) -> Result<bool, TransportError> {
        let Some(batch) = self.batch_copy else { return Ok(false) };
        let (host, device) = ((CU_MEM_LOCATION_TYPE_HOST, 0), (CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal as i32));
        let (src, dst) = if to_device { (host, device) } else { (device, host) };
        let mut attrs = MemcpyAttributes {
            src_access_order: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            src_loc_type: src.0,
            src_loc_id: src.1,
            dst_loc_type: dst.0,
            dst_loc_id: dst.1,
            flags: 0,
        };
        let mut attr_index = 0usize;
        let count = dsts.len().min(srcs.len()).min(sizes.len());
        if count == 0 {
            return Ok(true);
        }
        // SAFETY: the arrays hold `count` entries each and outlive the call (the driver copies
        // them during it); the caller vouches for the memory they name.
        let result = unsafe {
            match batch {
                BatchCopy::V2(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    count,
                    &mut attrs,
                    &mut attr_index,
                    1,
                    stream,
                ),
                BatchCopy::V1(f) => {
                    let mut fail_index = usize::MAX;
                    f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        count,
                        &mut attrs,
                        &mut attr_index,
                        1,
                        &mut fail_index,
                        stream,
                    )
                }
            }
        };
        check(result, "cuMemcpyBatchAsync").map(|()| true)
    }

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

    fn judge(&self, addr: u64, len: u64, end: u64, info: &PointerInfo) -> Result<(), TransportError> {
        let bad = |why: String| Err(TransportError::DevicePointer { addr, len, why });
        if info.memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return bad(format!("not device memory (memory type {})", info.memory_type));
        }
        if info.ordinal != self.ordinal as i32 {
            return bad(format!("memory of GPU {}, not GPU {}", info.ordinal, self.ordinal));
        }
        match info.range {
            Some((start, stop)) if start <= addr && end <= stop => Ok(()),
            Some((start, stop)) => bad(format!("runs past its allocation [{start:#x}, {stop:#x})")),
            None => {
                // No range attribute: check the last byte's device too.
                let last = self.lookup(end - 1)?;
                if last.memory_type == info.memory_type && last.ordinal == info.ordinal {
                    Ok(())
                } else {
                    bad("its last byte is not memory of the same GPU".into())
                }
            }
        }
    }

    fn lookup(&self, addr: u64) -> Result<PointerInfo, TransportError> {
        let mut memory_type: u32 = 0;
        let mut ordinal: i32 = -1;
        let mut start: u64 = 0;
        let mut size: usize = 0;
        let mut attrs = [
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data: [*mut c_void; 4] = [
            (&mut memory_type as *mut u32).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut start as *mut u64).cast(),
            (&mut size as *mut usize).cast(),
        ];
        // SAFETY: four attributes, each with a pointer to storage of the type the driver writes
        // for it; an unknown pointer leaves them at their defaults and still succeeds.
        let result =
            unsafe { sys::cuPointerGetAttributes(attrs.len() as u32, attrs.as_mut_ptr(), data.as_mut_ptr(), addr) };
        check(result, "cuPointerGetAttributes")?;
        let range = (start != 0 && size != 0).then(|| (start, start + size as u64));
        Ok(PointerInfo { memory_type, ordinal, range })
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

    /// Blocks until all work in this GPU's context is done (tests and benchmarks only; the
    /// engine observes completion through events).
    pub fn synchronize(&self) -> Result<(), TransportError> {
        self.bind()?;
        // SAFETY: no arguments; the context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
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
        f.debug_struct("RangeChecker").field("gpu", &self.device.ordinal).field("known", &self.known.len()).finish()
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
        let info = self.device.lookup(addr).map_err(pointer)?;
        self.device.judge(addr, len, end, &info).map_err(pointer)?;
        if let Some(range) = info.range {
            if self.known.len() >= 64 {
                self.known.remove(0);
            }
            self.known.push(range);
        }
        Ok(())
    }
}

struct PointerInfo {
    memory_type: u32,
    ordinal: i32,
    range: Option<(u64, u64)>,
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

/// Serialises first-use work that must happen once per process (kernel compilation).
pub(crate) static COMPILE_LOCK: Mutex<()> = Mutex::new(());
