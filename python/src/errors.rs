//! The Python exception hierarchy. Owns the mapping of every `kvtide::Error` and
//! `kvtide_remote::Error` variant onto one exception class; never decides what failed (the
//! engine and the client do). Every class derives from `kvtide.KvtideError`, and the argument
//! checks of this module's callers raise `InvalidArgument` (also a `ValueError`).

use kvtide::Error as E;
use kvtide_remote::Error as R;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(kvtide, KvtideError, PyException, "Base class of every kvtide error.");
create_exception!(kvtide, NotFound, KvtideError, "The key is not in the store.");
create_exception!(kvtide, AlreadyExists, KvtideError, "The key exists (pass upsert=True to replace it).");
create_exception!(kvtide, NoSpace, KvtideError, "No space: the rest of the pool is leased, pinned or being written.");
create_exception!(kvtide, TooLarge, KvtideError, "A key or value is larger than the store accepts.");
create_exception!(kvtide, InvalidArgument, KvtideError, "An argument was rejected (empty key, bad buffer, bad range).");
create_exception!(kvtide, SizeMismatch, InvalidArgument, "Destination sizes do not add up to the object's size.");
create_exception!(kvtide, BufferTooSmall, InvalidArgument, "The destination is smaller than the object.");
create_exception!(kvtide, Corrupted, KvtideError, "The object was corrupted on SSD and was dropped.");
create_exception!(kvtide, IoError, KvtideError, "An I/O error of the SSD tier.");
create_exception!(kvtide, Leased, KvtideError, "The object is being read (pass force=True to remove it anyway).");
create_exception!(kvtide, Pinned, KvtideError, "The object is pinned (unpin it, or pass force=True).");
create_exception!(kvtide, NotPinned, KvtideError, "unpin of an object that is not pinned.");
create_exception!(kvtide, LeaseExpired, KvtideError, "An explicit lease passed its TTL.");
create_exception!(kvtide, CudaUnavailable, KvtideError, "CUDA is not available to this build or machine.");
create_exception!(kvtide, CudaError, KvtideError, "A GPU transfer failed.");
create_exception!(kvtide, Busy, KvtideError, "A limit was reached (requests, connections, leases); retry later.");
create_exception!(kvtide, Cancelled, KvtideError, "The request was cancelled.");
create_exception!(kvtide, ProducerAborted, KvtideError, "The producer of a progressive put stopped before sealing.");
create_exception!(kvtide, ShuttingDown, KvtideError, "The store is shutting down or was closed.");
create_exception!(kvtide, StreamError, KvtideError, "A stream-bound read could not use its stream.");
create_exception!(kvtide, StreamCapturing, StreamError, "The stream is being captured into a CUDA graph.");
create_exception!(kvtide, StreamExpired, StreamError, "The stream did not pass the read's copies in time.");
create_exception!(kvtide, Disconnected, KvtideError, "The connection to the owner was lost.");
create_exception!(kvtide, Timeout, KvtideError, "A request to the owner timed out.");
create_exception!(kvtide, Unauthorized, KvtideError, "The owner refused the token.");
create_exception!(kvtide, ProtocolError, KvtideError, "The owner spoke a protocol this client does not.");
create_exception!(kvtide, InternalError, KvtideError, "kvtide broke an internal invariant (a bug).");

/// Every exception class, by its Python name (the module registers them all).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    macro_rules! add {
        ($($name:ident),* $(,)?) => {$( m.add(stringify!($name), py.get_type::<$name>())?; )*};
    }
    add!(
        KvtideError,
        NotFound,
        AlreadyExists,
        NoSpace,
        TooLarge,
        InvalidArgument,
        SizeMismatch,
        BufferTooSmall,
        Corrupted,
        IoError,
        Leased,
        Pinned,
        NotPinned,
        LeaseExpired,
        CudaUnavailable,
        CudaError,
        Busy,
        Cancelled,
        ProducerAborted,
        ShuttingDown,
        StreamError,
        StreamCapturing,
        StreamExpired,
        Disconnected,
        Timeout,
        Unauthorized,
        ProtocolError,
        InternalError,
    );
    Ok(())
}

/// The exception for one failure of the engine or of the remote client.
pub fn to_py(e: &R) -> PyErr {
    let msg = e.to_string();
    match e {
        R::Store(s) => engine_error(s, msg),
        R::Disconnected(_) => Disconnected::new_err(msg),
        R::Timeout { .. } => Timeout::new_err(msg),
        R::Unauthorized(_) => Unauthorized::new_err(msg),
        R::ProtocolVersion { .. } | R::Protocol(_) => ProtocolError::new_err(msg),
        // The owner reported a failure this client has no variant for.
        R::Remote(_) => KvtideError::new_err(msg),
    }
}

fn engine_error(e: &E, msg: String) -> PyErr {
    match e {
        E::NotFound => NotFound::new_err(msg),
        E::AlreadyExists => AlreadyExists::new_err(msg),
        E::NoSpace => NoSpace::new_err(msg),
        E::TooLarge { .. } => TooLarge::new_err(msg),
        E::EmptyKey | E::InvalidRange(_) | E::InvalidArgument(_) => InvalidArgument::new_err(msg),
        E::SizeMismatch { .. } => SizeMismatch::new_err(msg),
        E::BufferTooSmall { .. } => BufferTooSmall::new_err(msg),
        E::Corrupted(_) => Corrupted::new_err(msg),
        E::Io(_) => IoError::new_err(msg),
        E::LeaseExpired => LeaseExpired::new_err(msg),
        E::Leased => Leased::new_err(msg),
        E::Pinned => Pinned::new_err(msg),
        E::NotPinned => NotPinned::new_err(msg),
        E::CudaUnavailable(_) => CudaUnavailable::new_err(msg),
        E::Cuda(_) => CudaError::new_err(msg),
        E::Busy { .. } => Busy::new_err(msg),
        E::Cancelled => Cancelled::new_err(msg),
        E::ProducerAborted(_) => ProducerAborted::new_err(msg),
        E::ShuttingDown => ShuttingDown::new_err(msg),
        E::StreamCapturing(_) => StreamCapturing::new_err(msg),
        E::Stream(_) => StreamError::new_err(msg),
        E::StreamExpired { .. } => StreamExpired::new_err(msg),
        E::Internal(_) => InternalError::new_err(msg),
    }
}

/// An argument this module rejects before any call.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidArgument::new_err(msg.into())
}

/// Per-key results as Python values, where a key may also have failed its argument checks.
pub fn per_key_py<T>(
    py: Python<'_>,
    results: Vec<PyResult<T>>,
    ok: impl Fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) -> PyResult<Vec<Py<PyAny>>> {
    results
        .into_iter()
        .map(|r| match r {
            Ok(v) => ok(py, v),
            Err(e) => Ok(e.into_value(py).into_any()),
        })
        .collect()
}

/// Per-key results as Python values: the value, or the exception instance in its place (batch
/// calls never raise for one bad key).
pub fn per_key<T>(
    py: Python<'_>,
    results: Vec<Result<T, R>>,
    ok: impl Fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) -> PyResult<Vec<Py<PyAny>>> {
    per_key_py(py, results.into_iter().map(|r| r.map_err(|e| to_py(&e))).collect(), ok)
}
