//! The handles a Python call returns: `Ticket` (submitted batch reads), `ChunkHandle`
//! (progressive and streaming reads), `PutStream` (progressive puts) and `StreamTicket`
//! (stream-bound reads). Owns keeping their Python buffers exported until no byte can still be
//! written into them: a handle dropped early cancels what has not started and waits for what is
//! in flight before it lets the buffers go. Never moves bytes itself.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvtide::{HandleStatus, PutOptions, StreamStatus};
use kvtide_remote::{Error as R, RemotePutStream};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::backend::{lift, lift_all, Backend};
use crate::buffers::{self, Buf, Use};
use crate::errors::{self, invalid, to_py};

// SAFETY: a `Buf`'s Python references and exported view are only touched with the interpreter
// attached (its drop attaches); the address and length it carries are plain numbers.
unsafe impl Send for Buf {}
// SAFETY: as above; `Buf` has no interior mutability.
unsafe impl Sync for Buf {}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn int(py: Python<'_>, n: usize) -> PyResult<Py<PyAny>> {
    Ok(n.into_pyobject(py)?.into_any().unbind())
}

pub enum TicketInner {
    Embedded(kvtide::BatchTicket<kvtide::Error>),
    Remote(kvtide::BatchTicket<R>),
}

impl TicketInner {
    fn is_ready(&self) -> bool {
        match self {
            TicketInner::Embedded(t) => t.is_ready(),
            TicketInner::Remote(t) => t.is_ready(),
        }
    }

    fn wait_timeout_ms(&self, ms: u64) -> bool {
        match self {
            TicketInner::Embedded(t) => t.wait_timeout_ms(ms),
            TicketInner::Remote(t) => t.wait_timeout_ms(ms),
        }
    }

    fn cancel(&self) {
        match self {
            TicketInner::Embedded(t) => t.cancel(),
            TicketInner::Remote(t) => t.cancel(),
        }
    }

    fn wait(self) -> Vec<Result<usize, R>> {
        match self {
            TicketInner::Embedded(t) => lift_all(t.wait()),
            TicketInner::Remote(t) => t.wait(),
        }
    }
}

/// A submitted batch read (`Store.submit_batch_get`): `wait`, `is_ready`, `cancel`. Its
/// destinations stay held until it completed; dropping a pending ticket cancels it and waits.
#[pyclass(module = "kvtide", frozen)]
pub struct Ticket {
    inner: Mutex<Option<TicketInner>>,
    results: Mutex<Option<Vec<Result<usize, R>>>>,
    bufs: Mutex<Vec<Buf>>,
}

impl Ticket {
    pub fn new(inner: TicketInner, bufs: Vec<Buf>) -> Ticket {
        Ticket { inner: Mutex::new(Some(inner)), results: Mutex::new(None), bufs: Mutex::new(bufs) }
    }

    /// Waits for the result (without the GIL) and keeps it.
    fn settle(&self, py: Python<'_>, timeout_ms: Option<u64>) -> bool {
        let mut inner = lock(&self.inner);
        let Some(t) = inner.take() else { return true };
        let ready = match timeout_ms {
            None => true,
            Some(ms) => py.detach(|| t.wait_timeout_ms(ms)),
        };
        if !ready {
            *inner = Some(t);
            return false;
        }
        let results = py.detach(move || t.wait());
        *lock(&self.results) = Some(results);
        lock(&self.bufs).clear();
        true
    }
}

#[pymethods]
impl Ticket {
    /// True once the result is available.
    fn is_ready(&self) -> bool {
        lock(&self.inner).as_ref().is_none_or(TicketInner::is_ready)
    }

    /// The per-key results (bytes read, or the exception), waiting at most `timeout_ms`
    /// (None: until done). Returns None if the time passed first.
    #[pyo3(signature = (timeout_ms=None))]
    fn wait(&self, py: Python<'_>, timeout_ms: Option<u64>) -> PyResult<Option<Vec<Py<PyAny>>>> {
        if !self.settle(py, timeout_ms) {
            return Ok(None);
        }
        let results = lock(&self.results).clone().unwrap_or_default();
        errors::per_key(py, results, int).map(Some)
    }

    /// Stops the keys whose transfer has not started (they fail with `Cancelled`).
    fn cancel(&self) {
        if let Some(t) = lock(&self.inner).as_ref() {
            t.cancel();
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(t) = lock(&self.inner).take() {
            // The destinations may be written until the ticket completes.
            t.cancel();
            let _ = Python::attach(|py| py.detach(move || t.wait()));
        }
    }
}

pub enum Handle {
    Embedded(kvtide::ChunkHandle<kvtide::Error>),
    Remote(kvtide::ChunkHandle<R>),
}

macro_rules! with_handle {
    ($h:expr, |$x:ident| $body:expr) => {
        match $h {
            Handle::Embedded($x) => $body,
            Handle::Remote($x) => $body,
        }
    };
}

/// A progressive or streaming read: chunk `i` covers `chunk_range(i)` of its buffer and is
/// usable once `is_chunk_ready(i)` or `wait_chunk(i)` says so. Closing (or dropping) it cancels
/// the chunks that have not started and waits for those in flight.
#[pyclass(module = "kvtide", frozen)]
pub struct ChunkHandle {
    handle: Handle,
    bufs: Mutex<Vec<Buf>>,
}

impl ChunkHandle {
    pub fn new(handle: Handle, bufs: Vec<Buf>) -> ChunkHandle {
        ChunkHandle { handle, bufs: Mutex::new(bufs) }
    }

    fn check(&self, i: usize) -> PyResult<()> {
        let n = with_handle!(&self.handle, |h| h.num_chunks());
        if i >= n {
            return Err(invalid(format!("chunk {i} of a handle of {n} chunks")));
        }
        Ok(())
    }
}

#[pymethods]
impl ChunkHandle {
    fn num_chunks(&self) -> usize {
        with_handle!(&self.handle, |h| h.num_chunks())
    }

    /// `(start, end)` byte range of chunk `i` in its buffer.
    fn chunk_range(&self, i: usize) -> PyResult<(u64, u64)> {
        self.check(i)?;
        let r = with_handle!(&self.handle, |h| h.chunk_range(i)).unwrap_or(0..0);
        Ok((r.start, r.end))
    }

    /// `(buffer index, start, end)` of chunk `i`.
    fn chunk_place(&self, i: usize) -> PyResult<(usize, u64, u64)> {
        self.check(i)?;
        let p = with_handle!(&self.handle, |h| h.chunk_place(i).cloned());
        let p = p.ok_or_else(|| invalid("no such chunk"))?;
        Ok((p.buffer, p.range.start, p.range.end))
    }

    fn is_chunk_ready(&self, i: usize) -> PyResult<bool> {
        self.check(i)?;
        Ok(with_handle!(&self.handle, |h| h.is_chunk_ready(i)))
    }

    /// Waits for chunk `i`: True once it landed, False if `timeout_ms` passed first; raises
    /// the chunk's error if it failed.
    #[pyo3(signature = (i, timeout_ms=None))]
    fn wait_chunk(&self, py: Python<'_>, i: usize, timeout_ms: Option<u64>) -> PyResult<bool> {
        self.check(i)?;
        let h = &self.handle;
        let r: Result<bool, R> = py.detach(|| match timeout_ms {
            None => with_handle!(h, |h| lift(h.wait_chunk(i)).map(|()| true)),
            Some(ms) => with_handle!(h, |h| lift(h.wait_chunk_timeout(i, ms))),
        });
        r.map_err(|e| to_py(&e))
    }

    /// Chunks completed since the last poll.
    fn poll(&self) -> Vec<usize> {
        with_handle!(&self.handle, |h| h.poll())
    }

    /// Waits for every chunk; raises the first failed chunk's error.
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        let h = &self.handle;
        let r: Result<(), R> = py.detach(|| with_handle!(h, |h| lift(h.wait_all())));
        r.map_err(|e| to_py(&e))
    }

    /// `{"state": "pending", "done": n, "failed": n, "total": n}`, `{"state": "done"}` or
    /// `{"state": "failed", "chunk": i, "error": exception}`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let status: HandleStatus<R> = match &self.handle {
            Handle::Embedded(h) => match h.status() {
                HandleStatus::Pending { done, failed, total } => HandleStatus::Pending { done, failed, total },
                HandleStatus::Done => HandleStatus::Done,
                HandleStatus::Failed { chunk, error } => HandleStatus::Failed { chunk, error: error.into() },
            },
            Handle::Remote(h) => h.status(),
        };
        let d = PyDict::new(py);
        match status {
            HandleStatus::Pending { done, failed, total } => {
                d.set_item("state", "pending")?;
                d.set_item("done", done)?;
                d.set_item("failed", failed)?;
                d.set_item("total", total)?;
            }
            HandleStatus::Done => d.set_item("state", "done")?,
            HandleStatus::Failed { chunk, error } => {
                d.set_item("state", "failed")?;
                d.set_item("chunk", chunk)?;
                d.set_item("error", to_py(&error).into_value(py))?;
            }
        }
        Ok(d)
    }

    /// Cancels the chunks that have not started, waits for those in flight and lets the
    /// buffers go.
    fn close(&self, py: Python<'_>) {
        let h = &self.handle;
        py.detach(|| {
            with_handle!(h, |h| {
                h.cancel();
                let _ = h.wait_all();
            })
        });
        lock(&self.bufs).clear();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }
}

impl Drop for ChunkHandle {
    fn drop(&mut self) {
        if !lock(&self.bufs).is_empty() {
            let h = &self.handle;
            with_handle!(h, |h| h.cancel());
            Python::attach(|py| py.detach(|| with_handle!(h, |h| drop(h.wait_all()))));
        }
    }
}

/// The embedded engine's put stream with the engine it borrows, or the remote one.
pub enum PutStreamInner {
    Embedded {
        // Fields drop in declaration order: the stream before the engine it borrows.
        stream: kvtide::PutStream<'static>,
        backend: Arc<Backend>,
    },
    Remote(Box<RemotePutStream>),
}

impl PutStreamInner {
    pub fn open(b: Arc<Backend>, key: &[u8], total: u64, chunk: u64, opts: PutOptions) -> Result<PutStreamInner, R> {
        match &*b {
            Backend::Embedded(e) => {
                let stream = lift(e.progressive_put(key, total, chunk, opts))?;
                // SAFETY: the stream borrows the engine inside `b`'s allocation, which never
                // moves and lives as long as the `Arc` kept beside the stream; the stream is
                // dropped (or aborted) before that `Arc` (field order, and `abort` below).
                let stream: kvtide::PutStream<'static> = unsafe { std::mem::transmute(stream) };
                Ok(PutStreamInner::Embedded { stream, backend: Arc::clone(&b) })
            }
            Backend::Remote(r) => {
                r.progressive_put(key, total, chunk, opts).map(|p| PutStreamInner::Remote(Box::new(p)))
            }
            // One member holds a progressive put, so only without replication.
            Backend::Cluster(c) if c.replication() == 1 => {
                c.owner_of(key)?.progressive_put(key, total, chunk, opts).map(|p| PutStreamInner::Remote(Box::new(p)))
            }
            Backend::Cluster(_) => Err(R::Store(kvtide::Error::InvalidArgument(
                "progressive_put through a cluster store with replication > 1 would store one copy; use put".into(),
            ))),
        }
    }
}

/// A progressive put: `put_chunk(i, src)` in any order, then `seal()` (the object becomes
/// visible) or `abort()`. Readers that follow it see chunks as they land.
#[pyclass(module = "kvtide", frozen)]
pub struct PutStream {
    inner: Mutex<Option<PutStreamInner>>,
}

impl PutStream {
    pub fn new(inner: PutStreamInner) -> PutStream {
        PutStream { inner: Mutex::new(Some(inner)) }
    }
}

fn finished() -> PyErr {
    invalid("the put stream was sealed or aborted")
}

#[pymethods]
impl PutStream {
    fn num_chunks(&self) -> PyResult<usize> {
        match lock(&self.inner).as_ref().ok_or_else(finished)? {
            PutStreamInner::Embedded { stream, .. } => Ok(stream.num_chunks()),
            PutStreamInner::Remote(s) => Ok(s.num_chunks()),
        }
    }

    /// `(start, end)` of chunk `i` in the object.
    fn chunk_range(&self, i: usize) -> PyResult<(u64, u64)> {
        let guard = lock(&self.inner);
        let r = match guard.as_ref().ok_or_else(finished)? {
            PutStreamInner::Embedded { stream, .. } => stream.chunk_range(i),
            PutStreamInner::Remote(s) => s.chunk_range(i),
        };
        let r = r.ok_or_else(|| invalid(format!("no chunk {i}")))?;
        Ok((r.start, r.end))
    }

    fn total_bytes(&self) -> PyResult<u64> {
        match lock(&self.inner).as_ref().ok_or_else(finished)? {
            PutStreamInner::Embedded { stream, .. } => Ok(stream.total_bytes()),
            PutStreamInner::Remote(s) => Ok(s.total_bytes()),
        }
    }

    /// Writes chunk `i` from `src` (exactly the chunk's length).
    fn put_chunk(&self, py: Python<'_>, i: usize, src: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = buffers::buffer(src, Use::Source)?;
        let region = buf.region();
        let guard = lock(&self.inner);
        let inner = guard.as_ref().ok_or_else(finished)?;
        let r = py.detach(|| match inner {
            PutStreamInner::Embedded { stream, .. } => lift(stream.put_chunk(i, region)),
            PutStreamInner::Remote(s) => s.put_chunk(i, region),
        });
        drop(buf);
        r.map_err(|e| to_py(&e))
    }

    /// Publishes the object (every chunk must have been written).
    fn seal(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = lock(&self.inner);
        let inner = guard.as_mut().ok_or_else(finished)?;
        let r = py.detach(|| match inner {
            PutStreamInner::Embedded { stream, .. } => lift(stream.seal()),
            PutStreamInner::Remote(s) => s.seal(),
        });
        if r.is_ok() {
            *guard = None;
        }
        r.map_err(|e| to_py(&e))
    }

    /// Drops the unsealed object; followers fail with `ProducerAborted`.
    fn abort(&self, py: Python<'_>) {
        if let Some(inner) = lock(&self.inner).take() {
            py.detach(move || match inner {
                PutStreamInner::Embedded { stream, backend } => {
                    stream.abort();
                    drop(backend);
                }
                PutStreamInner::Remote(s) => s.abort(),
            });
        }
    }
}

/// A stream-bound read (`*_on_stream`): `status()`, `results()`, `wait(timeout_ms)`. The
/// destinations stay held until the stream passed the copies, even if the ticket is dropped.
#[pyclass(module = "kvtide", frozen)]
pub struct StreamTicket {
    ticket: Mutex<Option<kvtide::StreamTicket>>,
    bufs: Mutex<Vec<Buf>>,
}

impl StreamTicket {
    pub fn new(ticket: kvtide::StreamTicket, bufs: Vec<Buf>) -> StreamTicket {
        StreamTicket { ticket: Mutex::new(Some(ticket)), bufs: Mutex::new(bufs) }
    }

    fn results_py(&self, py: Python<'_>, results: Vec<kvtide::Result<usize>>) -> PyResult<Vec<Py<PyAny>>> {
        lock(&self.bufs).clear();
        errors::per_key(py, results.into_iter().map(|r| r.map_err(R::Store)).collect(), int)
    }
}

#[pymethods]
impl StreamTicket {
    /// "pending", "done" or "failed".
    fn status(&self) -> &'static str {
        match lock(&self.ticket).as_ref().map(|t| t.status()) {
            Some(StreamStatus::Pending) => "pending",
            Some(StreamStatus::Done) | None => "done",
            Some(StreamStatus::Failed(_)) => "failed",
        }
    }

    /// One result per key (or fragment) once the read ended, else None.
    fn results(&self, py: Python<'_>) -> PyResult<Option<Vec<Py<PyAny>>>> {
        let results = lock(&self.ticket).as_ref().and_then(|t| t.results());
        results.map(|r| self.results_py(py, r)).transpose()
    }

    /// Blocks the host until the read ended (at most `timeout_ms`, default 60 s); the results,
    /// or None if the time passed first.
    #[pyo3(signature = (timeout_ms=60_000))]
    fn wait(&self, py: Python<'_>, timeout_ms: u64) -> PyResult<Option<Vec<Py<PyAny>>>> {
        let guard = lock(&self.ticket);
        let Some(t) = guard.as_ref() else { return Ok(None) };
        let results = py.detach(|| t.wait(Duration::from_millis(timeout_ms)));
        drop(guard);
        results.map(|r| self.results_py(py, r)).transpose()
    }

    /// Keys this read holds leased now.
    fn keys_pinned(&self) -> usize {
        lock(&self.ticket).as_ref().map_or(0, |t| t.keys_pinned())
    }

    fn __len__(&self) -> usize {
        lock(&self.ticket).as_ref().map_or(0, |t| t.len())
    }
}

impl Drop for StreamTicket {
    fn drop(&mut self) {
        let bufs = std::mem::take(&mut *lock(&self.bufs));
        let ticket = lock(&self.ticket).take();
        if let (Some(t), false) = (ticket, bufs.is_empty()) {
            if t.results().is_none() {
                // The stream may still copy into the buffers: hold them until the read ends
                // (the engine ends every read by its stream TTL at the latest).
                std::thread::spawn(move || {
                    while t.wait(Duration::from_secs(1)).is_none() {}
                    drop(bufs);
                });
            }
        }
    }
}
