//! CUDA for Python callers. Owns classifying raw addresses (host or which GPU) and reading a
//! stream argument (`torch.cuda.Stream`, an object with `cuda_stream`, `handle` or
//! `__cuda_stream__`, or an integer `CUstream`). Never moves bytes: the engine and the remote
//! client do. Without the `cuda` feature every address is host memory and streams are refused
//! with `CudaUnavailable`.

use kvtide::MemoryKind;
use pyo3::prelude::*;

use crate::errors::invalid;

/// Host memory, or the GPU CUDA says `addr` belongs to.
#[cfg(feature = "cuda")]
pub fn kind_of_address(addr: u64) -> MemoryKind {
    match kvtide::cuda::CudaTransport::get().and_then(|t| t.device_of(addr)) {
        Ok(Some(ordinal)) => MemoryKind::Device { ordinal },
        _ => MemoryKind::Host,
    }
}

/// Host memory: this build has no CUDA.
#[cfg(not(feature = "cuda"))]
pub fn kind_of_address(_addr: u64) -> MemoryKind {
    MemoryKind::Host
}

/// A `CUstream` from a stream argument.
pub fn stream_handle(stream: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(handle) = stream.extract::<u64>() {
        return Ok(handle);
    }
    if let Ok(protocol) = stream.call_method0("__cuda_stream__") {
        // (version, handle), the CUDA stream protocol of cuda.core.
        if let Ok((_, handle)) = protocol.extract::<(i64, u64)>() {
            return Ok(handle);
        }
    }
    // cuda-python's CUstream and similar handle objects convert with int().
    if let Ok(handle) = stream.call_method0("__int__").and_then(|v| v.extract::<u64>()) {
        return Ok(handle);
    }
    for attr in ["cuda_stream", "handle", "ptr"] {
        if let Ok(value) = stream.getattr(attr) {
            if let Ok(handle) = value.extract::<u64>() {
                return Ok(handle);
            }
            if let Ok(handle) = value.call_method0("__int__").and_then(|v| v.extract::<u64>()) {
                return Ok(handle);
            }
        }
    }
    Err(invalid(
        "expected a CUDA stream: a torch.cuda.Stream, an object with cuda_stream, handle or __cuda_stream__, or an \
         integer CUstream",
    ))
}
