//! CUDA for Python callers. Owns classifying raw addresses (host or which GPU) and reading a
//! stream argument (`torch.cuda.Stream`, an object with `cuda_stream`, `handle` or
//! `__cuda_stream__`, or an integer `CUstream`), and a step's per-layer signals (events or flag
//! words). Never moves bytes: the engine and the remote client do. Without the `cuda` feature every address is host memory and streams are refused
//! with `CudaUnavailable`.

use kvtide::{MemoryKind, StreamSignal};
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

/// A `CUevent` from an event argument: an integer, or an object with `cuda_event` (a
/// `torch.cuda.Event`; torch makes the driver event at its first record, so one that has none
/// yet is recorded once first, which the step's own record then supersedes).
fn event_handle(event: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(handle) = event.extract::<u64>() {
        return Ok(handle);
    }
    let raw = |e: &Bound<'_, PyAny>| -> PyResult<u64> {
        let v = e.getattr("cuda_event")?;
        v.extract::<u64>().or_else(|_| v.call_method0("__int__")?.extract::<u64>())
    };
    let handle = raw(event).map_err(|_| invalid("expected a CUDA event: a torch.cuda.Event or an integer CUevent"))?;
    if handle != 0 {
        return Ok(handle);
    }
    event.call_method0("record")?;
    raw(event)
}

/// A flag word's address: an integer, or an object with `data_ptr()` (a torch tensor).
fn word_address(word: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(addr) = word.extract::<u64>() {
        return Ok(addr);
    }
    word.call_method0("data_ptr")
        .and_then(|v| v.extract::<u64>())
        .map_err(|_| invalid("expected a flag word: an integer address or a tensor (data_ptr())"))
}

/// Each layer's signal from `events` (None, or one event or None per layer) and `flags` (None,
/// or one `(word, value)` or None per layer); a layer may have one of the two, not both.
pub fn step_signals<'py>(
    layers: usize,
    events: Option<&Bound<'py, PyAny>>,
    flags: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Option<StreamSignal>>> {
    let mut signals: Vec<Option<StreamSignal>> = vec![None; layers];
    for (l, event) in per_layer(layers, events, "events")?.into_iter().enumerate() {
        if let Some(event) = event {
            signals[l] = Some(StreamSignal::RecordEvent(event_handle(&event)?));
        }
    }
    for (l, flag) in per_layer(layers, flags, "flags")?.into_iter().enumerate() {
        if let Some(flag) = flag {
            if signals[l].is_some() {
                return Err(invalid(format!("layer {l} has an event and a flag: one signal per layer")));
            }
            let (word, value): (Bound<'_, PyAny>, u32) =
                flag.extract().map_err(|_| invalid("flags: each one (word, value), value a 32-bit unsigned int"))?;
            signals[l] = Some(StreamSignal::WriteValue { addr: word_address(&word)?, value });
        }
    }
    Ok(signals)
}

/// One item (or None) per layer of a per-layer list argument (None: none for every layer).
fn per_layer<'py>(
    layers: usize,
    obj: Option<&Bound<'py, PyAny>>,
    what: &str,
) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(vec![None; layers]) };
    let items: Vec<Bound<'py, PyAny>> = obj.try_iter()?.collect::<PyResult<_>>()?;
    if items.len() != layers {
        return Err(invalid(format!("{what}: {} for {layers} layers (one per layer, or None)", items.len())));
    }
    Ok(items.into_iter().map(|i| (!i.is_none()).then_some(i)).collect())
}
