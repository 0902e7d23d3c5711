//! `kvtide._kvtide`, the extension module of the `kvtide` Python package: the embedded engine
//! (`Store(...)`) and the owner's client (`connect(...)`) for Python callers, with torch tensors,
//! buffer-protocol objects and `(address, size)` pairs as buffers. The pure-Python modules beside
//! it (`kvtide/`) hold the Mooncake-compatible class and the inference-engine adapters.

// One phase per function: clippy.toml sets the limit (100 lines).
#![warn(clippy::too_many_lines)]

mod backend;
mod buffers;
mod errors;
mod gpu;
mod handles;
mod hold;
mod ops;
mod store;

use pyo3::prelude::*;

/// True when this build has the CUDA transport (feature `cuda`; the driver is loaded at run
/// time, so a GPU is still needed for device buffers).
#[pyfunction]
fn cuda_built() -> bool {
    cfg!(feature = "cuda")
}

/// The UCX library this process can load for the UCX data plane, as "major.minor", or None
/// (then `connect(..., ucx=...)` reads over TCP, with a warning).
#[pyfunction]
fn ucx_version() -> Option<String> {
    kvtide_remote::ucx_available().ok().map(|(major, minor)| format!("{major}.{minor}"))
}

#[pymodule]
fn _kvtide(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::PyStore>()?;
    m.add_class::<handles::Ticket>()?;
    m.add_class::<handles::ChunkHandle>()?;
    m.add_class::<handles::PutStream>()?;
    m.add_class::<handles::StreamTicket>()?;
    m.add_class::<hold::Hold>()?;
    m.add_function(wrap_pyfunction!(store::connect, m)?)?;
    m.add_function(wrap_pyfunction!(store::connect_cluster, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_built, m)?)?;
    m.add_function(wrap_pyfunction!(ucx_version, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    Ok(())
}
