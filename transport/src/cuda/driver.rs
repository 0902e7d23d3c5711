//! The CUDA driver, loaded at run time: libcuda itself, each GPU's primary context and the calls
//! every layer above shares (batched copies, pointer attributes).
//!
//! Owns every call that loads libcuda or asks it about a GPU or a pointer. It never lets cudarc
//! panic: libcuda's presence is checked before the first call, optional symbols
//! (`cuMemcpyBatchAsync`) are looked up without cudarc's panicking loader, and every failure
//! becomes a `TransportError`. It never knows devices, pools, kernels or paths: those are built
//! on a `Context` by the layers above.

use std::ffi::c_void;

use cudarc::driver::sys;

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
pub(crate) const CU_MEMHOSTREGISTER_PORTABLE: u32 = 1;
pub(crate) const CU_MEMHOSTREGISTER_READ_ONLY: u32 = 8;

/// Whichever batched-copy entry point the driver has.
#[derive(Clone, Copy)]
enum BatchCopy {
    V1(BatchV1),
    V2(BatchV2),
}

/// libcuda, loaded and initialised (`Driver::load`, once per process by `CudaTransport::get`).
#[derive(Clone, Copy)]
pub(crate) struct Driver {
    pub(crate) device_count: usize,
    batch_copy: Option<BatchCopy>,
}

impl Driver {
    /// Loads libcuda and initialises the driver. Without libcuda, a driver or a GPU this returns
    /// `CudaUnavailable`, never panics.
    pub(crate) fn load() -> Result<Driver, TransportError> {
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
        Ok(Driver { device_count: count as usize, batch_copy })
    }

    /// True when the driver has `cuMemcpyBatchAsync` (CUDA 12.8+).
    pub(crate) fn has_batch_copy(&self) -> bool {
        self.batch_copy.is_some()
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

/// One GPU's primary context and attributes, retained for the life of the process.
pub(crate) struct Context {
    pub(crate) ordinal: u32,
    pub(crate) ctx: sys::CUcontext,
    pub(crate) multiprocessors: u32,
    pub(crate) compute_capability: (i32, i32),
    batch_copy: Option<BatchCopy>,
}

// SAFETY: a CUcontext handle may be used from any thread (each thread makes it current first);
// the other fields are plain values.
unsafe impl Send for Context {}
// SAFETY: as above; nothing here is mutated after `open`.
unsafe impl Sync for Context {}

impl Context {
    /// Retains GPU `ordinal`'s primary context and reads its attributes.
    pub(crate) fn open(ordinal: u32, driver: &Driver) -> Result<Context, TransportError> {
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
        Ok(Context {
            ordinal,
            ctx,
            multiprocessors: multiprocessors.max(1) as u32,
            compute_capability: (major, minor),
            batch_copy: driver.batch_copy,
        })
    }

    /// Makes this GPU's context current on the calling thread (cheap; every entry point does it).
    pub(crate) fn bind(&self) -> Result<(), TransportError> {
        // SAFETY: the context is retained for the life of the process.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// True when the driver has `cuMemcpyBatchAsync`.
    pub(crate) fn has_batch_copy(&self) -> bool {
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

    pub(crate) fn judge(&self, addr: u64, len: u64, end: u64, info: &PointerInfo) -> Result<(), TransportError> {
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

    pub(crate) fn lookup(&self, addr: u64) -> Result<PointerInfo, TransportError> {
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

    /// Blocks until all work in this GPU's context is done (tests and benchmarks only; the
    /// engine observes completion through events).
    pub(crate) fn synchronize(&self) -> Result<(), TransportError> {
        self.bind()?;
        // SAFETY: no arguments; the context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

/// Allocates `bytes` of pinned host memory mapped into the GPU's address space (`flags`
/// include `CU_MEMHOSTALLOC_DEVICEMAP`), so kernels read it in place: (host address, device
/// address). Nothing stays allocated on failure. The context must be current.
pub(crate) fn alloc_mapped_host(bytes: usize, flags: u32) -> Result<(*mut c_void, sys::CUdeviceptr), TransportError> {
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one host pointer.
    check(unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) }, "cuMemHostAlloc")?;
    let mut device: sys::CUdeviceptr = 0;
    // SAFETY: a live mapped pinned allocation; writes one device pointer.
    let mapped = check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }, "cuMemHostGetDevicePointer");
    if let Err(e) = mapped {
        // SAFETY: allocated above, never used.
        let _ = unsafe { sys::cuMemFreeHost(host) };
        return Err(e);
    }
    Ok((host, device))
}

/// What `Context::lookup` learned about an address.
pub(crate) struct PointerInfo {
    pub(crate) memory_type: u32,
    pub(crate) ordinal: i32,
    pub(crate) range: Option<(u64, u64)>,
}
