//! Kernels compiled with NVRTC at first use and loaded into a GPU's context: the staged-copy
//! kernels (`scatter.cu`) and the workload stand-ins of tests and benchmarks (`workload.cu`).
//!
//! Owns the kernel sources, their compilation (one at a time per process), the loaded entry
//! points and the launch geometry the staged paths share. Without NVRTC (or when compilation
//! fails) the staged path is unavailable and requests take the direct path; nothing panics. It
//! never launches a kernel or keeps per-GPU state: the device keeps what `load` returns.

use std::ffi::{c_void, CStr};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::driver::{check, Context};
use crate::TransportError;

/// Threads per block of the scatter/gather kernels.
pub(crate) const KERNEL_THREADS: u32 = 256;
/// Blocks per multiprocessor at most (a grid-stride loop over warps covers any table).
pub(crate) const BLOCKS_PER_SM: u32 = 8;
/// Rows per block at one row per warp.
pub(crate) const ROWS_PER_BLOCK: u32 = KERNEL_THREADS / 32;

/// Serialises kernel compilation: it happens once per GPU and source, at first use.
static COMPILE_LOCK: Mutex<()> = Mutex::new(());

/// The staged-copy kernel source, committed next to this file.
pub const SCATTER_SOURCE: &str = include_str!("scatter.cu");
/// The workload kernels of tests and benchmarks (a kernel that runs for a set time).
pub const WORKLOAD_SOURCE: &str = include_str!("workload.cu");

/// The staged-copy entry points.
pub(crate) struct Kernels {
    _module: sys::CUmodule,
    pub(crate) scatter: sys::CUfunction,
    pub(crate) scatter_gated: sys::CUfunction,
    pub(crate) gather: sys::CUfunction,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread that
// makes their context current; the module is never unloaded (it lives as long as the process).
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// Compiles `scatter.cu` for `device` and loads it.
pub(crate) fn load(device: &Context) -> Result<Kernels, TransportError> {
    let (module, mut functions) = compile(
        device,
        SCATTER_SOURCE,
        "kvtide_scatter.cu",
        &[c"kvtide_scatter", c"kvtide_scatter_gated", c"kvtide_gather"],
    )?;
    let gather = functions.pop().unwrap_or(std::ptr::null_mut());
    let scatter_gated = functions.pop().unwrap_or(std::ptr::null_mut());
    let scatter = functions.pop().unwrap_or(std::ptr::null_mut());
    Ok(Kernels { _module: module, scatter, scatter_gated, gather })
}

/// The workload kernels, loaded once per GPU.
pub(crate) struct Workload {
    _module: sys::CUmodule,
    pub(crate) spin: sys::CUfunction,
}

// SAFETY: driver handles usable from any thread with the context current; never unloaded.
unsafe impl Send for Workload {}
// SAFETY: as above.
unsafe impl Sync for Workload {}

/// Compiles `workload.cu` for `device` and loads it.
pub(crate) fn load_workload(device: &Context) -> Result<Workload, TransportError> {
    let (module, functions) = compile(device, WORKLOAD_SOURCE, "kvtide_workload.cu", &[c"kvtide_spin"])?;
    let spin = functions.first().copied().ok_or(TransportError::CudaUnavailable("no spin kernel"))?;
    Ok(Workload { _module: module, spin })
}

/// Compiles `source` with NVRTC for `device`, loads it into its context and looks up `entries`
/// (in order). The module stays loaded for the life of the process.
fn compile(
    device: &Context,
    source: &str,
    name: &str,
    entries: &[&CStr],
) -> Result<(sys::CUmodule, Vec<sys::CUfunction>), TransportError> {
    // SAFETY: only tries to dlopen NVRTC's library names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(TransportError::CudaUnavailable("NVRTC (libnvrtc) was not found: no kernels"));
    }
    let _serial = COMPILE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let (major, minor) = device.compute_capability;
    let started = std::time::Instant::now();
    let options = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}"), "-default-device".into()],
        name: Some(name.into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, options)
        .map_err(|e| TransportError::Cuda { op: "nvrtcCompileProgram", detail: e.to_string() })?;
    let image = ptx.as_bytes().ok_or(TransportError::Cuda { op: "nvrtcGetPTX", detail: "no PTX image".into() })?;
    let mut text = image.to_vec();
    if text.last() != Some(&0) {
        text.push(0);
    }
    device.bind()?;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `text` is a NUL-terminated PTX image that outlives the call.
    check(unsafe { sys::cuModuleLoadData(&mut module, text.as_ptr().cast::<c_void>()) }, "cuModuleLoadData")?;
    let mut functions = Vec::with_capacity(entries.len());
    for entry in entries {
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: the module was just loaded; the name is NUL-terminated.
        check(unsafe { sys::cuModuleGetFunction(&mut f, module, entry.as_ptr()) }, "cuModuleGetFunction")?;
        functions.push(f);
    }
    tracing::info!(
        gpu = device.ordinal,
        source = name,
        arch = format!("compute_{major}{minor}"),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "kernels compiled with NVRTC"
    );
    Ok((module, functions))
}
