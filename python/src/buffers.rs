//! Python objects as memory regions. Owns turning a torch tensor, an object with the buffer
//! protocol (numpy arrays, bytearray, memoryview, bytes) or an `(address, size)` pair into a
//! `Region`, checked (contiguous, writable where it is a destination, non-null), and keeping the
//! object alive and its buffer exported for as long as the region is used. Never copies bytes.

use std::ffi::{c_char, c_int, c_void};

use kvtide::{MemoryKind, Region};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyString, PyTuple, PyType};

use crate::errors::invalid;

/// CPython's `Py_buffer`, declared here because the stable ABI headers of Python 3.10 (this
/// module's minimum) leave it out; its layout is the same in every CPython 3.x.
#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

unsafe extern "C" {
    // Exported by every CPython 3 (part of the stable ABI from 3.11, present long before).
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
}

/// `PyBUF_STRIDES | PyBUF_FORMAT`: shape and strides, so contiguity is checked here with a
/// clear message rather than by the exporter.
const PYBUF_RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

/// What keeps a region's memory valid.
enum Hold {
    /// An exported buffer, released on drop (the exporter may not resize or free it until then).
    View(Box<PyBufferView>),
    /// A reference to the object (a tensor's storage lives as long as the tensor).
    Object(#[allow(dead_code)] Py<PyAny>),
    /// A raw address: the caller promised it stays valid.
    Raw,
}

/// One Python buffer, checked, with its memory held.
pub struct Buf {
    addr: u64,
    len: usize,
    kind: MemoryKind,
    writable: bool,
    hold: Hold,
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Hold::View(view) = &mut self.hold {
            let view: *mut PyBufferView = &mut **view;
            // SAFETY: `view` was filled by a successful PyObject_GetBuffer and is released once,
            // here, with the interpreter attached.
            Python::attach(|_| unsafe { PyBuffer_Release(view) });
        }
    }
}

/// Whether a buffer is read from or written to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Source,
    Destination,
}

impl Buf {
    /// The region of this buffer, valid while `self` lives.
    pub fn region(&self) -> Region<'static> {
        if self.writable || self.kind != MemoryKind::Host {
            // SAFETY: the memory is held by `self.hold` (or promised by the caller for raw
            // addresses) for as long as `self` lives; callers keep `self` until the call, or the
            // handle of the call, that receives this region has completed.
            unsafe { Region::from_raw(self.addr, self.len, self.kind) }
        } else {
            // SAFETY: as above; a read-only buffer becomes a read-only region, which the engine
            // refuses as a destination.
            let bytes: &'static [u8] = unsafe { std::slice::from_raw_parts(self.addr as usize as *const u8, self.len) };
            Region::host_readonly(bytes)
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// This buffer's first `len` bytes (`len <= self.len()`), held by the same object.
    pub fn prefix(&self, len: usize) -> Region<'static> {
        let whole = self.region();
        whole.slice(0, len.min(self.len) as u64).unwrap_or(whole)
    }
}

/// `torch.Tensor`, once torch has been imported by the caller (never imported here).
static TORCH_TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn torch_tensor_type<'py>(py: Python<'py>) -> Option<&'py Bound<'py, PyType>> {
    if let Some(t) = TORCH_TENSOR.get(py) {
        return Some(t.bind(py));
    }
    let modules = py.import(intern!(py, "sys")).ok()?.getattr(intern!(py, "modules")).ok()?;
    let torch = modules.get_item(intern!(py, "torch")).ok()?;
    let tensor = torch.getattr(intern!(py, "Tensor")).ok()?.cast_into::<PyType>().ok()?;
    let _ = TORCH_TENSOR.set(py, tensor.unbind());
    TORCH_TENSOR.get(py).map(|t| t.bind(py))
}

/// Reads one buffer argument.
pub fn buffer(obj: &Bound<'_, PyAny>, usage: Use) -> PyResult<Buf> {
    if let Ok(pair) = obj.cast::<PyTuple>() {
        return raw_pair(pair);
    }
    if torch_tensor_type(obj.py()).is_some_and(|t| obj.is_instance(t).unwrap_or(false)) {
        return tensor(obj);
    }
    exported(obj, usage)
}

/// Reads a list of buffer arguments.
pub fn buffers(obj: &Bound<'_, PyAny>, usage: Use) -> PyResult<Vec<Buf>> {
    if obj.cast::<PyTuple>().is_ok_and(|t| t.len() == 2 && t.get_item(0).is_ok_and(|a| a.extract::<u64>().is_ok())) {
        // One (address, size) pair, not a list of buffers.
        return Ok(vec![buffer(obj, usage)?]);
    }
    let mut out = Vec::new();
    for item in obj.try_iter().map_err(|_| invalid("expected a list of buffers"))? {
        out.push(buffer(&item?, usage)?);
    }
    Ok(out)
}

/// An `(address, size)` pair: host memory, or GPU memory where CUDA says the address is one.
fn raw_pair(pair: &Bound<'_, PyTuple>) -> PyResult<Buf> {
    if pair.len() != 2 {
        return Err(invalid(format!("a raw buffer is an (address, size) pair, got {} items", pair.len())));
    }
    let addr: u64 =
        pair.get_item(0)?.extract().map_err(|_| invalid("a raw buffer's address must be a non-negative integer"))?;
    let len: u64 =
        pair.get_item(1)?.extract().map_err(|_| invalid("a raw buffer's size must be a non-negative integer"))?;
    let len = usize::try_from(len).map_err(|_| invalid(format!("size {len} does not fit this machine")))?;
    if addr == 0 && len > 0 {
        return Err(invalid("a raw buffer's address is null"));
    }
    if addr.checked_add(len as u64).is_none() {
        return Err(invalid(format!("raw buffer [{addr:#x}, +{len}) wraps around the address space")));
    }
    Ok(Buf { addr, len, kind: crate::gpu::kind_of_address(addr), writable: true, hold: Hold::Raw })
}

/// A torch tensor (CPU or CUDA), which must be contiguous. Four or five Python calls: a batch
/// of page views pays them per page.
fn tensor(t: &Bound<'_, PyAny>) -> PyResult<Buf> {
    let py = t.py();
    if !t.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()? {
        return Err(invalid("the tensor is not contiguous (call .contiguous() on it first)"));
    }
    let addr: u64 = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let len: u64 = t.getattr(intern!(py, "nbytes"))?.extract()?;
    let len = usize::try_from(len).map_err(|_| invalid("tensor too large"))?;
    let kind = if t.getattr(intern!(py, "is_cuda"))?.extract::<bool>()? {
        let index: i64 = t.call_method0(intern!(py, "get_device"))?.extract()?;
        let ordinal = u32::try_from(index).map_err(|_| invalid("tensor on an unknown CUDA device"))?;
        MemoryKind::Device { ordinal }
    } else if t.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
        MemoryKind::Host
    } else {
        let device = t.getattr(intern!(py, "device"))?.str()?.to_string();
        return Err(invalid(format!("tensors on {device:?} are not supported (cpu or cuda only)")));
    };
    if addr == 0 && len > 0 {
        return Err(invalid("the tensor has no storage"));
    }
    Ok(Buf { addr, len, kind, writable: true, hold: Hold::Object(t.clone().unbind()) })
}

/// An object with the buffer protocol, which must be C-contiguous (and writable for a
/// destination).
fn exported(obj: &Bound<'_, PyAny>, usage: Use) -> PyResult<Buf> {
    let mut view = Box::new(PyBufferView {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    });
    // SAFETY: `obj` is a live object (we hold the GIL through `obj`'s token) and `view` points
    // to storage of the layout CPython writes.
    let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, PYBUF_RECORDS_RO) };
    if rc != 0 {
        let why = PyErr::take(obj.py()).map(|e| e.to_string()).unwrap_or_default();
        let type_name = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        if obj.is_instance_of::<PyString>() {
            return Err(invalid("a str is not a buffer: encode it to bytes"));
        }
        return Err(invalid(format!(
            "{type_name} is not a buffer (expected a torch tensor, a numpy array, bytes, bytearray, memoryview or an \
             (address, size) pair): {why}"
        )));
    }
    let buf = Buf {
        addr: view.buf as usize as u64,
        len: usize::try_from(view.len).unwrap_or(0),
        kind: MemoryKind::Host,
        writable: view.readonly == 0,
        hold: Hold::View(view),
    };
    let Hold::View(v) = &buf.hold else { unreachable!("just built") };
    if !c_contiguous(v) {
        return Err(invalid("the buffer is not C-contiguous (use numpy.ascontiguousarray or .copy())"));
    }
    if usage == Use::Destination && !buf.writable {
        return Err(invalid("the destination buffer is read-only"));
    }
    Ok(buf)
}

/// C-contiguity from the exported shape and strides.
fn c_contiguous(v: &PyBufferView) -> bool {
    if v.strides.is_null() || v.shape.is_null() || v.ndim <= 0 {
        return true;
    }
    let ndim = v.ndim as usize;
    // SAFETY: an exporter that fills `strides` and `shape` gives `ndim` entries in each, valid
    // until the view is released.
    let (shape, strides) =
        unsafe { (std::slice::from_raw_parts(v.shape, ndim), std::slice::from_raw_parts(v.strides, ndim)) };
    if shape.contains(&0) {
        return true;
    }
    let mut expected = v.itemsize;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n > 1 && s != expected {
            return false;
        }
        expected *= n;
    }
    true
}

/// A key: `str` (UTF-8) or bytes-like.
pub fn key(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    match exported(obj, Use::Source) {
        // SAFETY: a host buffer of `len` bytes, exported and held by `b` while it is read.
        Ok(b) => Ok(unsafe { std::slice::from_raw_parts(b.addr as usize as *const u8, b.len) }.to_vec()),
        Err(_) => Err(invalid("keys must be str or bytes")),
    }
}

/// A list of keys.
pub fn keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(invalid("expected a list of keys, got one key"));
    }
    let mut out = Vec::new();
    for item in obj.try_iter().map_err(|_| invalid("expected a list of keys"))? {
        out.push(key(&item?)?);
    }
    Ok(out)
}
