//! `kvtide.Store`: one Python class over the embedded engine and over `RemoteStore`. Owns
//! argument conversion (keys, buffers, fragments, settings), releasing the GIL around every
//! call that moves bytes or waits, and per-key results as Python lists (a value, or the
//! exception instance in its place). Never implements store semantics itself: every call is one
//! `kvtide::Store` (or engine / client) call.

use std::sync::{Arc, RwLock};

use kvtide::{Engine, Fragment, PutOptions, StepLayer, StepReads, Store as _, StoreBuilder};
use kvtide_remote::{ClientOptions, ClusterOptions, ClusterStore, Error as R, RemoteStore, Token};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::backend::{lift, lift_all, not_on_cluster, Backend};
use crate::buffers::{self, Buf, Use};
use crate::errors::{self, invalid, to_py};
use crate::handles::{ChunkHandle, Handle, PutStream, PutStreamInner, StreamTicket, Ticket};
use crate::hold::{EmbeddedHolds, Hold};

/// Runs `$body` with `$s` bound to the store, whichever it is (the body's errors convert into
/// the remote error, which wraps the engine's).
macro_rules! with_store {
    ($backend:expr, |$s:ident| $body:expr) => {
        match &*$backend {
            Backend::Embedded(engine) => {
                let $s: &Engine = engine;
                $body
            }
            Backend::Remote($s) => $body,
            Backend::Cluster(cluster) => {
                let $s: &ClusterStore = cluster;
                $body
            }
        }
    };
}

/// A kvtide store: embedded (`kvtide.Store(...)`) or served by an owner (`kvtide.connect(...)`).
#[pyclass(module = "kvtide", name = "Store", frozen)]
pub struct PyStore {
    backend: RwLock<Option<Arc<Backend>>>,
    remote: bool,
    /// The embedded store's holds (`hold`): their bound and count.
    holds: Arc<EmbeddedHolds>,
}

impl PyStore {
    fn with(backend: Backend, remote: bool) -> PyStore {
        PyStore { backend: RwLock::new(Some(Arc::new(backend))), remote, holds: Arc::default() }
    }

    /// The store, or `ShuttingDown` once closed.
    pub fn backend(&self) -> PyResult<Arc<Backend>> {
        let guard = self.backend.read().unwrap_or_else(|p| p.into_inner());
        guard.clone().ok_or_else(|| to_py(&R::Store(kvtide::Error::ShuttingDown)))
    }
}

fn options(upsert: bool, pin: bool) -> PutOptions {
    PutOptions { upsert, pin }
}

fn none(py: Python<'_>, _: ()) -> PyResult<Py<PyAny>> {
    Ok(py.None())
}

fn int(py: Python<'_>, n: usize) -> PyResult<Py<PyAny>> {
    Ok(n.into_pyobject(py)?.into_any().unbind())
}

fn boolean(py: Python<'_>, b: bool) -> PyResult<Py<PyAny>> {
    Ok(pyo3::types::PyBool::new(py, b).to_owned().into_any().unbind())
}

/// Fragments: per buffer, a list of `(key, src_offset, dst_offset, length)`.
pub fn fragments(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<Fragment>>> {
    let mut out = Vec::new();
    for list in obj.try_iter().map_err(|_| invalid("fragments: expected one list per buffer"))? {
        let list = list?;
        let mut frags = Vec::new();
        // Lists (the common case) without the iterator protocol: a page list may hold thousands.
        if let Ok(l) = list.cast::<PyList>() {
            frags.reserve(l.len());
            for item in l.iter() {
                frags.push(fragment(&item)?);
            }
        } else {
            for item in list.try_iter().map_err(|_| invalid("fragments: expected lists of tuples"))? {
                frags.push(fragment(&item?)?);
            }
        }
        out.push(frags);
    }
    Ok(out)
}

fn fragment(item: &Bound<'_, PyAny>) -> PyResult<Fragment> {
    let shape = || invalid("a fragment is a (key, src_offset, dst_offset, length) tuple");
    let tuple = item.cast::<pyo3::types::PyTuple>().map_err(|_| shape())?;
    if tuple.len() != 4 {
        return Err(shape());
    }
    let key = buffers::key(&*tuple.get_borrowed_item(0)?)?;
    let num = |i: usize| -> PyResult<u64> {
        tuple
            .get_borrowed_item(i)?
            .extract::<u64>()
            .map_err(|_| invalid("fragment offsets and lengths are non-negative integers"))
    };
    Ok(Fragment::new(key, num(1)?, num(2)?, num(3)?))
}

/// A setting's value as the text `StoreBuilder` reads.
fn setting_text(value: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(b) = value.cast::<pyo3::types::PyBool>() {
        return Ok(if b.is_true() { "true" } else { "false" }.into());
    }
    if value.hasattr("__fspath__")? {
        return Ok(value.call_method0("__fspath__")?.str()?.to_string());
    }
    Ok(value.str()?.to_string())
}

/// `(group, field)` of a keyword: `<group>_<field>` (`dram_bytes`, `ssd_dir`), or a field name
/// that only one group has (`shards`, `write_through`, `eviction`).
fn setting_name(name: &str) -> PyResult<(&'static str, &'static str)> {
    let fields = StoreBuilder::fields();
    for (group, field) in &fields {
        if name.strip_prefix(group).and_then(|r| r.strip_prefix('_')) == Some(field.name) {
            return Ok((group, field.name));
        }
    }
    let matches: Vec<_> = fields.iter().filter(|(_, f)| f.name == name).collect();
    match matches.as_slice() {
        [(group, field)] => Ok((group, field.name)),
        [] => {
            let all = fields.iter().map(|(g, f)| format!("{g}_{}", f.name)).collect::<Vec<_>>().join(", ");
            Err(invalid(format!("unknown setting {name:?}; the settings are: {all}")))
        }
        many => Err(invalid(format!(
            "setting {name:?} is ambiguous: say {}",
            many.iter().map(|(g, f)| format!("{g}_{}", f.name)).collect::<Vec<_>>().join(" or ")
        ))),
    }
}

/// Opens the embedded engine: `config` (a TOML file), then `KVTIDE_*` variables when `env`,
/// then the keywords.
fn open_embedded(config: Option<String>, env: bool, settings: Option<&Bound<'_, PyDict>>) -> PyResult<Engine> {
    let open_err = |e: kvtide::OpenError| invalid(format!("could not open the store: {e}"));
    let mut builder = match config {
        Some(path) => StoreBuilder::from_toml_file(path).map_err(open_err)?,
        None => StoreBuilder::new(),
    };
    if env {
        builder = builder.with_env().map_err(open_err)?;
    }
    let mut vars = Vec::new();
    if let Some(settings) = settings {
        for (name, value) in settings.iter() {
            let name: String = name.extract()?;
            if value.is_none() {
                continue;
            }
            let (group, field) = setting_name(&name)?;
            vars.push((kvtide::settings::variable_name(group, field), setting_text(&value)?));
        }
    }
    builder = builder.with_vars(vars).map_err(open_err)?;
    let py_builder = builder;
    Python::attach(|py| py.detach(move || py_builder.open())).map_err(open_err)
}

#[pymethods]
impl PyStore {
    /// `Store(config=None, *, env=False, **settings)`: an embedded store. `config` is a TOML
    /// file of `[dram]`, `[ssd]`, ... sections; `env` applies `KVTIDE_<GROUP>_<FIELD>`
    /// variables; every keyword is one setting, `<group>_<field>` (`dram_bytes=1 << 30`,
    /// `ssd_dir="/nvme/kvtide"`, `restore_ahead_bytes="32MiB"`) or a field only one group has
    /// (`shards=4`, `write_through=True`). Sizes may be ints or strings ("8GiB").
    #[new]
    #[pyo3(signature = (config=None, *, env=false, **settings))]
    fn new(config: Option<String>, env: bool, settings: Option<&Bound<'_, PyDict>>) -> PyResult<PyStore> {
        let engine = open_embedded(config, env, settings)?;
        Ok(PyStore::with(Backend::Embedded(Box::new(engine)), false))
    }

    /// True when this store is served by an owner process.
    #[getter]
    fn is_remote(&self) -> bool {
        self.remote
    }

    /// True when gets map the owner's arena (same host, Unix socket); false for TCP, socket
    /// copies and the embedded store.
    #[getter]
    fn uses_shared_memory(&self) -> PyResult<bool> {
        Ok(match &*self.backend()? {
            Backend::Embedded(_) => false,
            Backend::Remote(r) => r.uses_shared_memory(),
            Backend::Cluster(_) => false,
        })
    }

    /// How reads reach the bytes: "embedded" (this process), "shared-memory" (the owner's arena
    /// mapped here), "ucx" (one-sided UCX gets from the owner's arena), "socket" (sent by the
    /// owner), or "cluster" (per owner, one of the remote ones).
    #[getter]
    fn data_plane(&self) -> PyResult<&'static str> {
        Ok(match &*self.backend()? {
            Backend::Embedded(_) => "embedded",
            Backend::Remote(r) => r.data_plane().name(),
            Backend::Cluster(_) => "cluster",
        })
    }

    /// Why this client reads over the socket though it asked for the UCX plane (the owner
    /// serves none, or said why its plane is not serving, or UCX could not connect here); None
    /// when it reads over the plane, did not ask for it, or is embedded or a cluster client.
    #[getter]
    fn ucx_refusal(&self) -> PyResult<Option<String>> {
        Ok(match &*self.backend()? {
            Backend::Remote(r) => r.ucx_refusal(),
            Backend::Embedded(_) | Backend::Cluster(_) => None,
        })
    }

    /// How this client used the same-host paths of its owner: `{"index_reads": n,
    /// "index_misses": n, "direct_put_bytes": n}` (reads served by the owner's read index
    /// without a request, reads looked up there and then leased, put bytes the owner read
    /// straight from this process). All zero for embedded and cluster stores.
    fn same_host_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (reads, misses, direct) = match &*self.backend()? {
            Backend::Remote(r) => {
                let c = r.read_index_counts();
                (c.read, c.leased, r.direct_put_bytes())
            }
            Backend::Embedded(_) | Backend::Cluster(_) => (0, 0, 0),
        };
        let out = PyDict::new(py);
        out.set_item("index_reads", reads)?;
        out.set_item("index_misses", misses)?;
        out.set_item("direct_put_bytes", direct)?;
        Ok(out)
    }

    /// A cluster store's view: `{"members": [...], "invalid": [[key, why], ...], "routing":
    /// {...}}` (members with their address, capacity and use; routing counters). Raises
    /// `InvalidArgument` on other stores.
    fn cluster_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let Backend::Cluster(c) = &*self.backend()? else {
            return Err(invalid("cluster_info: not a cluster store (kvtide.connect_cluster)"));
        };
        let info = serde_json::json!({
            "members": c.members(),
            "invalid": c.invalid_members(),
            "routing": c.routing(),
        });
        py.import("json")?.call_method1("loads", (info.to_string(),))
    }

    /// Largest value this store accepts, in bytes.
    fn max_value_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        let b = self.backend()?;
        py.detach(move || match &*b {
            Backend::Embedded(e) => Ok(e.max_value_bytes()),
            Backend::Remote(r) => r.max_value_bytes(),
            Backend::Cluster(c) => c.max_value_bytes(),
        })
        .map_err(|e| to_py(&e))
    }

    /// Stores `value` (a buffer) under `key`. Raises `AlreadyExists` unless `upsert`.
    #[pyo3(signature = (key, value, *, upsert=false, pin=false))]
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        upsert: bool,
        pin: bool,
    ) -> PyResult<()> {
        self.put_from(py, key, value, upsert, pin)
    }

    /// Stores the concatenation of `sources` (a buffer or a list of buffers) under `key`.
    #[pyo3(signature = (key, sources, *, upsert=false, pin=false))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        sources: &Bound<'_, PyAny>,
        upsert: bool,
        pin: bool,
    ) -> PyResult<()> {
        let key = buffers::key(key)?;
        let bufs = source_list(sources)?;
        let regions: Vec<_> = bufs.iter().map(Buf::region).collect();
        let b = self.backend()?;
        let r = py.detach(move || with_store!(b, |s| lift(s.put_from(&key, &regions, options(upsert, pin)))));
        drop(bufs);
        r.map_err(|e| to_py(&e))
    }

    /// `put_from` for many keys, one buffer each: one result per key (None or the exception).
    #[pyo3(signature = (keys, sources, *, upsert=false, pin=false))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        sources: &Bound<'_, PyAny>,
        upsert: bool,
        pin: bool,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let keys = buffers::keys(keys)?;
        let bufs = per_key_buffers(sources, Use::Source, false)?;
        self.batch_put(py, keys, bufs, options(upsert, pin))
    }

    /// `put_from` for many keys: object i is the concatenation of `sources[i]`.
    #[pyo3(signature = (keys, sources, *, upsert=false, pin=false))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        sources: &Bound<'_, PyAny>,
        upsert: bool,
        pin: bool,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let keys = buffers::keys(keys)?;
        let bufs = per_key_buffers(sources, Use::Source, true)?;
        self.batch_put(py, keys, bufs, options(upsert, pin))
    }

    /// Reads a whole object as bytes.
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let key = buffers::key(key)?;
        let b = self.backend()?;
        let value = py.detach(move || with_store!(b, |s| lift(s.get(&key)))).map_err(|e| to_py(&e))?;
        Ok(PyBytes::new(py, &value))
    }

    /// Reads an object into the start of `dst` (at least as large); returns its length.
    fn get_into(&self, py: Python<'_>, key: &Bound<'_, PyAny>, dst: &Bound<'_, PyAny>) -> PyResult<usize> {
        let key = buffers::key(key)?;
        let buf = buffers::buffer(dst, Use::Destination)?;
        let region = buf.region();
        let b = self.backend()?;
        let r = py.detach(move || with_store!(b, |s| lift(s.get_into(&key, region))));
        drop(buf);
        r.map_err(|e| to_py(&e))
    }

    /// Reads object i into the start of `dsts[i]` (each at least as large as its object): one
    /// result per key, the length read or the exception.
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        dsts: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let keys = buffers::keys(keys)?;
        let bufs = per_key_buffers(dsts, Use::Destination, false)?;
        let b = self.backend()?;
        let results = partial(py, keys, bufs, move |keys, lists| {
            let regions: Vec<_> = lists.iter().map(|l| l[0]).collect();
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            with_store!(b, |s| lift_all(s.batch_get_into(&keys, &regions)))
        })?;
        errors::per_key_py(py, results, int)
    }

    /// Object i scattered in order across `dsts[i]` (a list of buffers whose sizes add up to
    /// the object's exactly): one result per key.
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        dsts: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let keys = buffers::keys(keys)?;
        let bufs = per_key_buffers(dsts, Use::Destination, true)?;
        let b = self.backend()?;
        let results = partial(py, keys, bufs, move |keys, lists| {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            with_store!(b, |s| lift_all(s.batch_get_into_multi_buffers(&keys, &lists)))
        })?;
        errors::per_key_py(py, results, int)
    }

    /// Buffer-major ranges: `fragments[b]` lists `(key, src_offset, dst_offset, length)` into
    /// `buffers[b]`. One result per fragment, in the same shape.
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffers: &Bound<'_, PyAny>,
        fragments: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Vec<Py<PyAny>>>> {
        // A bad buffer fails its own fragments; the other buffers are read.
        let bufs = per_key_buffers(buffers, Use::Destination, false)?;
        let frags = self::fragments(fragments)?;
        if frags.len() > bufs.len() {
            return Err(invalid(format!("fragments for {} buffers but only {} buffers", frags.len(), bufs.len())));
        }
        let counts: Vec<usize> = frags.iter().map(Vec::len).collect();
        let (regions, good_frags): (Vec<_>, Vec<Vec<Fragment>>) =
            frags.into_iter().zip(&bufs).filter_map(|(f, b)| b.as_ref().ok().map(|l| (l[0].region(), f))).unzip();
        let b = self.backend()?;
        let mut read = py
            .detach(move || {
                with_store!(b, |s| s
                    .get_into_ranges(&regions, &good_frags)
                    .into_iter()
                    .map(lift_all)
                    .collect::<Vec<_>>())
            })
            .into_iter();
        let mut out = Vec::with_capacity(counts.len());
        for (buffer, n) in bufs.iter().zip(counts) {
            let results: Vec<PyResult<usize>> = match buffer {
                Ok(_) => read.next().unwrap_or_default().into_iter().map(|r| r.map_err(|e| to_py(&e))).collect(),
                Err(e) => (0..n).map(|_| Err(e.clone_ref(py))).collect(),
            };
            out.push(errors::per_key_py(py, results, int)?);
        }
        drop(bufs);
        Ok(out)
    }

    /// Size in bytes of `key`'s object.
    fn get_size(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<u64> {
        let key = buffers::key(key)?;
        let b = self.backend()?;
        let mut r = py.detach(move || with_store!(b, |s| lift_all(crate::ops::sizes(s, &[key]))));
        r.pop().unwrap_or(Err(R::Store(kvtide::Error::Internal("no result")))).map_err(|e| to_py(&e))
    }

    /// Sizes of many keys: one result per key.
    fn batch_get_size(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Py<PyAny>>> {
        let keys = buffers::keys(keys)?;
        let b = self.backend()?;
        let results = py.detach(move || with_store!(b, |s| lift_all(crate::ops::sizes(s, &keys))));
        errors::per_key(py, results, |py, n: u64| Ok(n.into_pyobject(py)?.into_any().unbind()))
    }

    fn exists(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = buffers::key(key)?;
        let b = self.backend()?;
        py.detach(move || with_store!(b, |s| lift(s.exists(&key)))).map_err(|e| to_py(&e))
    }

    /// One result per key: True, False or the exception.
    fn batch_exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Py<PyAny>>> {
        let keys = buffers::keys(keys)?;
        let b = self.backend()?;
        let results = py.detach(move || {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            with_store!(b, |s| lift_all(s.batch_exists(&keys)))
        });
        errors::per_key(py, results, boolean)
    }

    /// Number of leading keys that are present (prefix-cache lookups).
    fn prefix_hits(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = buffers::keys(keys)?;
        let b = self.backend()?;
        py.detach(move || {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            with_store!(b, |s| lift(s.prefix_hits(&keys)))
        })
        .map_err(|e| to_py(&e))
    }

    /// Removes `key`; a leased or pinned object is refused unless `force`.
    #[pyo3(signature = (key, *, force=false))]
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>, force: bool) -> PyResult<()> {
        let key = buffers::key(key)?;
        let b = self.backend()?;
        py.detach(move || with_store!(b, |s| lift(s.remove(&key, force)))).map_err(|e| to_py(&e))
    }

    /// `remove` for many keys: one result per key.
    #[pyo3(signature = (keys, *, force=false))]
    fn batch_remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, force: bool) -> PyResult<Vec<Py<PyAny>>> {
        let keys = buffers::keys(keys)?;
        let b = self.backend()?;
        let results = py.detach(move || {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            with_store!(b, |s| lift_all(s.batch_remove(&keys, force)))
        });
        errors::per_key(py, results, none)
    }

    /// One page of the keys that start with `prefix`: `(keys, next_cursor)`, next_cursor None
    /// at the end. Start with cursor 0; pages may be empty before the end.
    #[pyo3(signature = (prefix=None, cursor=0, limit=1024))]
    fn scan_keys(
        &self,
        py: Python<'_>,
        prefix: Option<&Bound<'_, PyAny>>,
        cursor: u64,
        limit: usize,
    ) -> PyResult<(Vec<Py<PyBytes>>, Option<u64>)> {
        let prefix = match prefix {
            Some(p) => buffers::key(p)?,
            None => Vec::new(),
        };
        let b = self.backend()?;
        let page =
            py.detach(move || with_store!(b, |s| lift(s.scan_keys(&prefix, cursor, limit)))).map_err(|e| to_py(&e))?;
        let keys = page.keys.iter().map(|k| PyBytes::new(py, k).unbind()).collect();
        Ok((keys, page.cursor))
    }

    /// Every key that starts with `prefix` (all pages of `scan_keys`). Keys written or removed
    /// meanwhile may or may not be listed.
    #[pyo3(signature = (prefix=None))]
    fn keys(&self, py: Python<'_>, prefix: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Py<PyBytes>>> {
        let prefix = match prefix {
            Some(p) => buffers::key(p)?,
            None => Vec::new(),
        };
        let b = self.backend()?;
        let all = py
            .detach(move || {
                let mut all = Vec::new();
                let mut cursor = Some(0);
                while let Some(at) = cursor {
                    let page = with_store!(b, |s| lift(s.scan_keys(&prefix, at, kvtide::MAX_SCAN_KEYS)))?;
                    all.extend(page.keys);
                    cursor = page.cursor;
                }
                Ok::<_, R>(all)
            })
            .map_err(|e| to_py(&e))?;
        Ok(all.iter().map(|k| PyBytes::new(py, k).unbind()).collect())
    }

    /// Keeps `key` from eviction until a matching `unpin`.
    fn pin(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = buffers::key(key)?;
        let b = self.backend()?;
        py.detach(move || with_store!(b, |s| lift(s.pin(&key)))).map_err(|e| to_py(&e))
    }

    fn unpin(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = buffers::key(key)?;
        let b = self.backend()?;
        py.detach(move || with_store!(b, |s| lift(s.unpin(&key)))).map_err(|e| to_py(&e))
    }

    /// Counters and gauges as a dict (`total`, `shards`, `gpu`, `restore`, `stream`, ...).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let b = self.backend()?;
        let stats = py.detach(move || with_store!(b, |s| s.stats()));
        let json = serde_json::to_string(&stats).map_err(|e| invalid(format!("stats: {e}")))?;
        py.import("json")?.call_method1("loads", (json,))
    }

    /// The resources that must be back at zero when nothing runs (leases, writes, tickets,
    /// credits, chunk handles, stream-bound reads), as a dict.
    fn held_resources<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let b = self.backend()?;
        let registry = Arc::clone(&self.holds);
        let (held, (holds, held_keys)) = py.detach(move || {
            // Leases given back through the shards, and hold releases on the owner's hold
            // connection, are one-way messages: read the gauges once they were handled (a
            // remote owner syncs its shards before it answers).
            let holds = match &*b {
                Backend::Embedded(e) => {
                    let _ = e.sync_shards();
                    registry.count()
                }
                Backend::Remote(r) => {
                    r.confirm_hold_releases();
                    r.holds_held()
                }
                Backend::Cluster(_) => (0, 0),
            };
            (with_store!(b, |s| s.stats()).held_resources(), holds)
        });
        // Every gauge of `HeldResources`, by its field name, and this store's holds.
        let mut json = serde_json::to_value(held).map_err(|e| invalid(format!("held resources: {e}")))?;
        if let Some(map) = json.as_object_mut() {
            map.insert("holds".into(), holds.into());
            map.insert("held_keys".into(), held_keys.into());
        }
        py.import("json")?.call_method1("loads", (json.to_string(),))
    }

    /// Takes read leases on the present keys of `keys` and keeps them until `Hold.release()`,
    /// `ttl_ms`, `close()` or (through an owner) the loss of the connection holding them:
    /// while held, an object stays in place and cannot be evicted. Returns a `Hold` with one
    /// result per key (the object's size, or the exception: `NotFound`, `Busy` past the bound).
    /// Embedded: at most 65,536 keys held per store. Through an owner: needs its Unix socket
    /// with shared memory (else `InvalidArgument`), at most its `max_leases_per_connection`
    /// keys, and the TTL is capped by its `lease_ttl_ms`. A cluster store raises
    /// `InvalidArgument`. `hold([])` only checks that holds are possible.
    #[pyo3(signature = (keys, ttl_ms=30_000))]
    fn hold(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, ttl_ms: u64) -> PyResult<Hold> {
        let keys = buffers::keys(keys)?;
        let b = self.backend()?;
        let registry = Arc::clone(&self.holds);
        py.detach(move || Hold::take(b, &registry, keys, ttl_ms)).map_err(|e| to_py(&e))
    }

    /// Non-blocking `batch_get_into_multi_buffers`: returns a `Ticket` at once. The
    /// destinations are held (and must not be used) until the ticket completes.
    fn submit_batch_get(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, dsts: &Bound<'_, PyAny>) -> PyResult<Ticket> {
        let keys = buffers::keys(keys)?;
        let bufs = nested(dsts, Use::Destination)?;
        let regions: Vec<Vec<_>> = bufs.iter().map(|l| l.iter().map(Buf::region).collect()).collect();
        let b = self.backend()?;
        let inner = py
            .detach(move || {
                let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                match &*b {
                    Backend::Embedded(e) => {
                        lift(e.submit_batch_get(&keys, regions)).map(crate::handles::TicketInner::Embedded)
                    }
                    Backend::Remote(r) => r.submit_batch_get(&keys, regions).map(crate::handles::TicketInner::Remote),
                    Backend::Cluster(c) => c.submit_batch_get(&keys, regions).map(crate::handles::TicketInner::Remote),
                }
            })
            .map_err(|e| to_py(&e))?;
        Ok(Ticket::new(inner, bufs.into_iter().flatten().collect()))
    }

    /// Reads `key` into the start of `dst` in chunks of `chunk_bytes`, each usable once it
    /// landed: a `ChunkHandle`.
    fn progressive_get(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        chunk_bytes: u64,
    ) -> PyResult<ChunkHandle> {
        self.progressive(py, key, dst, chunk_bytes, false)
    }

    /// `progressive_get` that follows an unsealed progressive put of `key` (chunks complete
    /// as the producer writes them; `ProducerAborted` if it goes away), or reads the sealed
    /// object when no put of it is open.
    fn progressive_get_unsealed(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        chunk_bytes: u64,
    ) -> PyResult<ChunkHandle> {
        self.progressive(py, key, dst, chunk_bytes, true)
    }

    /// `get_into_ranges` delivered in chunks of `chunk_bytes`: a `ChunkHandle` whose chunk
    /// places say which buffer range each covers.
    fn streaming_batch_get_buffer_ranges(
        &self,
        py: Python<'_>,
        buffers: &Bound<'_, PyAny>,
        fragments: &Bound<'_, PyAny>,
        chunk_bytes: u64,
    ) -> PyResult<ChunkHandle> {
        let bufs = buffers::buffers(buffers, Use::Destination)?;
        let frags = self::fragments(fragments)?;
        let regions: Vec<_> = bufs.iter().map(Buf::region).collect();
        let b = self.backend()?;
        let handle = py
            .detach(move || match &*b {
                Backend::Embedded(e) => {
                    lift(e.streaming_batch_get_buffer_ranges(&regions, &frags, chunk_bytes)).map(Handle::Embedded)
                }
                Backend::Remote(r) => {
                    r.streaming_batch_get_buffer_ranges(&regions, &frags, chunk_bytes).map(Handle::Remote)
                }
                Backend::Cluster(_) => Err(not_on_cluster("streaming_batch_get_buffer_ranges")),
            })
            .map_err(|e| to_py(&e))?;
        Ok(ChunkHandle::new(handle, bufs))
    }

    /// Starts a progressive put of `total_bytes` in chunks of `chunk_bytes`: a `PutStream`
    /// (`put_chunk`, `seal`, `abort`). The object is invisible until sealed.
    #[pyo3(signature = (key, total_bytes, chunk_bytes, *, upsert=false, pin=false))]
    fn progressive_put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        total_bytes: u64,
        chunk_bytes: u64,
        upsert: bool,
        pin: bool,
    ) -> PyResult<PutStream> {
        let key = buffers::key(key)?;
        let b = self.backend()?;
        let inner = py
            .detach(move || PutStreamInner::open(b, &key, total_bytes, chunk_bytes, options(upsert, pin)))
            .map_err(|e| to_py(&e))?;
        Ok(PutStream::new(inner))
    }

    /// Makes later stream-bound reads to GPU `ordinal` allocate and compile nothing.
    #[pyo3(signature = (ordinal=0))]
    fn prepare_gpu(&self, py: Python<'_>, ordinal: u32) -> PyResult<()> {
        let b = self.backend()?;
        py.detach(move || match &*b {
            Backend::Embedded(e) => lift(e.prepare_gpu(ordinal)),
            Backend::Remote(r) => r.prepare_gpu(ordinal),
            Backend::Cluster(_) => Err(not_on_cluster("prepare_gpu")),
        })
        .map_err(|e| to_py(&e))
    }

    /// Stream-bound `batch_get_into_multi_buffers`: when this returns, the copies are ordered
    /// on `stream` (a `torch.cuda.Stream`, a stream-like object or an int `CUstream`); an event
    /// recorded on it afterwards is a valid "KV ready" signal. Returns a `StreamTicket`; the
    /// destinations are held until the stream passed the copies.
    fn batch_get_into_multi_buffers_on_stream(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        dsts: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<StreamTicket> {
        let keys = buffers::keys(keys)?;
        let bufs = nested(dsts, Use::Destination)?;
        let stream = crate::gpu::stream_handle(stream)?;
        let regions: Vec<Vec<_>> = bufs.iter().map(|l| l.iter().map(Buf::region).collect()).collect();
        let b = self.backend()?;
        let ticket = py
            .detach(move || {
                let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                match &*b {
                    Backend::Embedded(e) => {
                        // SAFETY: the stream is the caller's (CUDA checks the handle before use)
                        // and the destinations are held by the returned ticket until the stream
                        // passed the copies.
                        lift(unsafe { e.batch_get_into_multi_buffers_on_stream(&keys, &regions, stream) })
                    }
                    // SAFETY: as above.
                    Backend::Remote(r) => unsafe { r.batch_get_into_multi_buffers_on_stream(&keys, &regions, stream) },
                    Backend::Cluster(_) => Err(not_on_cluster("batch_get_into_multi_buffers_on_stream")),
                }
            })
            .map_err(|e| to_py(&e))?;
        Ok(StreamTicket::new(ticket, bufs.into_iter().flatten().collect()))
    }

    /// Stream-bound `get_into_ranges`: one result per fragment, buffer after buffer.
    fn get_into_ranges_on_stream(
        &self,
        py: Python<'_>,
        buffers: &Bound<'_, PyAny>,
        fragments: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<StreamTicket> {
        let bufs = buffers::buffers(buffers, Use::Destination)?;
        let frags = self::fragments(fragments)?;
        let stream = crate::gpu::stream_handle(stream)?;
        let regions: Vec<_> = bufs.iter().map(Buf::region).collect();
        let b = self.backend()?;
        let ticket = py
            .detach(move || match &*b {
                // SAFETY: as in `batch_get_into_multi_buffers_on_stream`.
                Backend::Embedded(e) => lift(unsafe { e.get_into_ranges_on_stream(&regions, &frags, stream) }),
                // SAFETY: as above.
                Backend::Remote(r) => unsafe { r.get_into_ranges_on_stream(&regions, &frags, stream) },
                Backend::Cluster(_) => Err(not_on_cluster("get_into_ranges_on_stream")),
            })
            .map_err(|e| to_py(&e))?;
        Ok(StreamTicket::new(ticket, bufs))
    }

    /// One inference step's reads in one call: `layers` is a list of `(keys, dsts)` (object i
    /// of a layer scattered across its `dsts[i]`, as `batch_get_into_multi_buffers`). Every
    /// layer's keys are leased at once; then, layer after layer, its copies are enqueued on
    /// `stream` followed by its signal: `events[l]` recorded (a `torch.cuda.Event`, e.g. with
    /// `external=True` for a graph's external wait) or `flags[l] = (word, value)` written
    /// (`cuStreamWriteValue32`; `word` an address or a tensor). A graph whose layer l waits on
    /// signal l then runs as each layer's KV lands. Returns a `StreamTicket` with one result per
    /// key, layer after layer. A bad step (overlapping destinations, a bad signal, a capturing
    /// stream) raises before anything is enqueued.
    #[pyo3(signature = (layers, stream, events=None, flags=None))]
    fn step_on_stream(
        &self,
        py: Python<'_>,
        layers: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
        events: Option<&Bound<'_, PyAny>>,
        flags: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StreamTicket> {
        let stream = crate::gpu::stream_handle(stream)?;
        let mut keys: Vec<Vec<Vec<u8>>> = Vec::new();
        let mut bufs: Vec<Vec<Vec<Buf>>> = Vec::new();
        for layer in layers.try_iter().map_err(|_| invalid("layers: expected a list of (keys, dsts)"))? {
            let (k, d): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                layer?.extract().map_err(|_| invalid("layers: each one (keys, dsts)"))?;
            keys.push(buffers::keys(&k)?);
            bufs.push(nested(&d, Use::Destination)?);
        }
        let signals = crate::gpu::step_signals(keys.len(), events, flags)?;
        let regions: Vec<Vec<Vec<_>>> =
            bufs.iter().map(|layer| layer.iter().map(|l| l.iter().map(Buf::region).collect()).collect()).collect();
        let b = self.backend()?;
        let ticket = py
            .detach(move || {
                let key_refs: Vec<Vec<&[u8]>> = keys.iter().map(|l| l.iter().map(Vec::as_slice).collect()).collect();
                let step: Vec<StepLayer<'_, '_>> = key_refs
                    .iter()
                    .zip(&regions)
                    .zip(&signals)
                    .map(|((keys, dsts), done)| StepLayer { reads: StepReads::Objects { keys, dsts }, done: *done })
                    .collect();
                run_step(&b, &step, stream)
            })
            .map_err(|e| to_py(&e))?;
        Ok(StreamTicket::new(ticket, bufs.into_iter().flatten().flatten().collect()))
    }

    /// `step_on_stream` of byte ranges: `layers` is a list of `(buffers, fragments)`, each as
    /// `get_into_ranges` takes them. One result per fragment, layer after layer.
    #[pyo3(signature = (layers, stream, events=None, flags=None))]
    fn step_ranges_on_stream(
        &self,
        py: Python<'_>,
        layers: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
        events: Option<&Bound<'_, PyAny>>,
        flags: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StreamTicket> {
        let stream = crate::gpu::stream_handle(stream)?;
        let mut bufs: Vec<Vec<Buf>> = Vec::new();
        let mut frags: Vec<Vec<Vec<Fragment>>> = Vec::new();
        for layer in layers.try_iter().map_err(|_| invalid("layers: expected a list of (buffers, fragments)"))? {
            let (b, f): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                layer?.extract().map_err(|_| invalid("layers: each one (buffers, fragments)"))?;
            bufs.push(buffers::buffers(&b, Use::Destination)?);
            frags.push(self::fragments(&f)?);
        }
        let signals = crate::gpu::step_signals(bufs.len(), events, flags)?;
        let regions: Vec<Vec<_>> = bufs.iter().map(|l| l.iter().map(Buf::region).collect()).collect();
        let b = self.backend()?;
        let ticket = py
            .detach(move || {
                let step: Vec<StepLayer<'_, '_>> = regions
                    .iter()
                    .zip(&frags)
                    .zip(&signals)
                    .map(|((buffers, fragments), done)| StepLayer {
                        reads: StepReads::Ranges { buffers, fragments },
                        done: *done,
                    })
                    .collect();
                run_step(&b, &step, stream)
            })
            .map_err(|e| to_py(&e))?;
        Ok(StreamTicket::new(ticket, bufs.into_iter().flatten().collect()))
    }

    /// Closes the store: the embedded engine shuts down (a clean shutdown writes DRAM-only
    /// objects to the SSD tier when it has one); a remote store drops its connections. Later
    /// calls raise `ShuttingDown`. Closing twice is harmless.
    fn close(&self, py: Python<'_>) {
        let taken = self.backend.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(b) = taken {
            let registry = Arc::clone(&self.holds);
            py.detach(move || {
                // Holds end with the store (a `Hold` may outlive it).
                match &*b {
                    Backend::Embedded(e) => {
                        registry.close();
                        e.shutdown();
                    }
                    Backend::Remote(r) => r.close_holds(),
                    Backend::Cluster(_) => {}
                }
                drop(b);
            });
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let open = self.backend.read().map(|b| b.is_some()).unwrap_or(false);
        format!("kvtide.Store(remote={}, open={open})", self.remote)
    }
}

impl PyStore {
    fn progressive(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        chunk_bytes: u64,
        unsealed: bool,
    ) -> PyResult<ChunkHandle> {
        let key = buffers::key(key)?;
        let buf = buffers::buffer(dst, Use::Destination)?;
        let region = buf.region();
        let b = self.backend()?;
        let handle = py
            .detach(move || match (&*b, unsealed) {
                (Backend::Embedded(e), false) => {
                    lift(e.progressive_get(&key, region, chunk_bytes)).map(Handle::Embedded)
                }
                (Backend::Embedded(e), true) => {
                    lift(e.progressive_get_unsealed(&key, region, chunk_bytes)).map(Handle::Embedded)
                }
                (Backend::Remote(r), false) => r.progressive_get(&key, region, chunk_bytes).map(Handle::Remote),
                (Backend::Remote(r), true) => r.progressive_get_unsealed(&key, region, chunk_bytes).map(Handle::Remote),
                // One key: the first reachable member it is placed on serves it.
                (Backend::Cluster(c), false) => {
                    c.owner_of(&key)?.progressive_get(&key, region, chunk_bytes).map(Handle::Remote)
                }
                (Backend::Cluster(c), true) => {
                    c.owner_of(&key)?.progressive_get_unsealed(&key, region, chunk_bytes).map(Handle::Remote)
                }
            })
            .map_err(|e| to_py(&e))?;
        Ok(ChunkHandle::new(handle, vec![buf]))
    }

    fn batch_put(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        bufs: KeyBuffers,
        opts: PutOptions,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let b = self.backend()?;
        let results = partial(py, keys, bufs, move |keys, lists| {
            let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            with_store!(b, |s| lift_all(s.batch_put_from_multi_buffers(&keys, &lists, opts)))
        })?;
        errors::per_key_py(py, results, none)
    }
}

/// Per key: its buffers, or the argument error of that key's buffers alone.
type KeyBuffers = Vec<PyResult<Vec<Buf>>>;

/// One entry per key: a buffer (`nested` false) or a list of buffers (`nested` true). A bad
/// buffer is that key's error; only a malformed outer list fails the call.
/// A step on the store behind `backend`.
fn run_step(backend: &Backend, step: &[StepLayer<'_, '_>], stream: u64) -> Result<kvtide::StreamTicket, R> {
    match backend {
        // SAFETY: the stream is the caller's (CUDA checks the handle before use), the
        // destinations are held by the returned ticket until the stream passed the copies, and
        // the events and flag words are the caller's, which it keeps while the step runs.
        Backend::Embedded(e) => lift(unsafe { e.step_on_stream(step, stream) }),
        // SAFETY: as above.
        Backend::Remote(r) => unsafe { r.step_on_stream(step, stream) },
        Backend::Cluster(_) => Err(not_on_cluster("step_on_stream")),
    }
}

fn per_key_buffers(obj: &Bound<'_, PyAny>, usage: Use, nested: bool) -> PyResult<KeyBuffers> {
    let mut out = Vec::new();
    for item in obj.try_iter().map_err(|_| invalid("expected one buffer (or buffer list) per key"))? {
        let item = item?;
        out.push(if nested { buffers::buffers(&item, usage) } else { buffers::buffer(&item, usage).map(|b| vec![b]) });
    }
    Ok(out)
}

/// Runs `call` (without the GIL) on the keys whose buffers are good, and answers every key:
/// the call's result, or its buffer error.
fn partial<T: Send>(
    py: Python<'_>,
    keys: Vec<Vec<u8>>,
    bufs: KeyBuffers,
    call: impl FnOnce(&[Vec<u8>], Vec<Vec<kvtide::Region<'static>>>) -> Vec<Result<T, R>> + Send,
) -> PyResult<Vec<PyResult<T>>> {
    if keys.len() != bufs.len() {
        return Err(invalid(format!("{} keys but {} buffer entries", keys.len(), bufs.len())));
    }
    let good: Vec<usize> = (0..keys.len()).filter(|&i| bufs[i].is_ok()).collect();
    let good_keys: Vec<Vec<u8>> = good.iter().map(|&i| keys[i].clone()).collect();
    let lists: Vec<Vec<_>> =
        good.iter().filter_map(|&i| bufs[i].as_ref().ok().map(|l| l.iter().map(Buf::region).collect())).collect();
    let mut called = py.detach(move || call(&good_keys, lists)).into_iter();
    let out = bufs
        .iter()
        .map(|b| match b {
            Ok(_) => {
                called.next().unwrap_or(Err(R::Store(kvtide::Error::Internal("no result")))).map_err(|e| to_py(&e))
            }
            Err(e) => Err(e.clone_ref(py)),
        })
        .collect();
    drop(bufs);
    Ok(out)
}

/// A source argument: one buffer or a list of buffers.
fn source_list(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Buf>> {
    if obj.is_instance_of::<PyList>() {
        buffers::buffers(obj, Use::Source)
    } else {
        Ok(vec![buffers::buffer(obj, Use::Source)?])
    }
}

/// A list of lists of buffers.
fn nested(obj: &Bound<'_, PyAny>, usage: Use) -> PyResult<Vec<Vec<Buf>>> {
    let mut out = Vec::new();
    for list in obj.try_iter().map_err(|_| invalid("expected a list of buffer lists"))? {
        out.push(buffers::buffers(&list?, usage)?);
    }
    Ok(out)
}

/// The `ucx` and `ucx_allow_tcp` keywords: "off" (or "") clears the transports, "rdma" names
/// the RDMA ones, anything else is a UCX transport list (checked at connect).
fn set_ucx(o: &mut ClientOptions, ucx: Option<String>, allow_tcp: Option<bool>) {
    if let Some(value) = ucx {
        o.ucx_transports = kvtide_remote::UcxTransports::from_setting(&value);
    }
    if let Some(v) = allow_tcp {
        o.ucx_allow_tcp = v;
    }
}

/// `connect_cluster(etcd, cluster_name, *, replication=1, token=None, token_file=None, ...)`: a
/// store over every owner registered in the kvtide cluster `cluster_name` on the etcd endpoints
/// `etcd` ("etcd://HOST:PORT[,HOST:PORT...]"). Owners on this host are reached by their Unix
/// socket (shared memory) unless `shared_memory=False`, others by TCP with the token.
#[pyfunction]
#[pyo3(signature = (etcd, cluster_name, *, replication=1, token=None, token_file=None, timeout_ms=None,
    connect_timeout_ms=None, shared_memory=None, refresh_ms=None, retry_ms=None, wait_for_members_ms=None,
    etcd_user=None, etcd_password=None, etcd_ca_file=None, etcd_timeout_ms=None, ucx=None, ucx_allow_tcp=None))]
#[allow(clippy::too_many_arguments)]
pub fn connect_cluster(
    py: Python<'_>,
    etcd: String,
    cluster_name: String,
    replication: usize,
    token: Option<&Bound<'_, PyAny>>,
    token_file: Option<String>,
    timeout_ms: Option<u64>,
    connect_timeout_ms: Option<u64>,
    shared_memory: Option<bool>,
    refresh_ms: Option<u64>,
    retry_ms: Option<u64>,
    wait_for_members_ms: Option<u64>,
    etcd_user: Option<String>,
    etcd_password: Option<String>,
    etcd_ca_file: Option<String>,
    etcd_timeout_ms: Option<u64>,
    ucx: Option<String>,
    ucx_allow_tcp: Option<bool>,
) -> PyResult<PyStore> {
    let cluster_error = |e: kvtide_remote::cluster::ClusterError| match e {
        kvtide_remote::cluster::ClusterError::Etcd(kvtide_remote::cluster::EtcdError::Unreachable { .. }) => {
            to_py(&R::Disconnected(e.to_string()))
        }
        other => invalid(other.to_string()),
    };
    let mut o = ClusterOptions::new(&etcd, &cluster_name).map_err(cluster_error)?;
    o.replication = replication;
    o.client = ClientOptions::from_env().map_err(|e| to_py(&e))?;
    set_ucx(&mut o.client, ucx, ucx_allow_tcp);
    if let Some(token) = token {
        let bytes = if let Ok(s) = token.extract::<String>() { s.into_bytes() } else { buffers::key(token)? };
        o.client.token = Some(Token::new(&bytes).map_err(|e| invalid(format!("token: {e}")))?);
    }
    if let Some(path) = token_file {
        o.client = o.client.token_file(path).map_err(|e| to_py(&e))?;
    }
    if let Some(v) = timeout_ms {
        o.client.timeout_ms = v;
    }
    if let Some(v) = connect_timeout_ms {
        o.client.connect_timeout_ms = v;
    }
    if let Some(v) = shared_memory {
        o.unix_on_same_host = v;
        o.client.shared_memory = v;
    }
    if let Some(v) = refresh_ms {
        o.refresh_ms = v;
    }
    if let Some(v) = retry_ms {
        o.retry_ms = v;
    }
    if let Some(v) = wait_for_members_ms {
        o.wait_for_members_ms = v;
    }
    match (etcd_user, etcd_password) {
        (Some(user), Some(password)) => o.etcd.user = Some((user, password)),
        (None, None) => {}
        _ => return Err(invalid("etcd_user and etcd_password go together")),
    }
    o.etcd.ca_file = etcd_ca_file.map(Into::into);
    if let Some(v) = etcd_timeout_ms {
        o.etcd.timeout_ms = v;
    }
    let store = py.detach(move || ClusterStore::connect(o)).map_err(cluster_error)?;
    Ok(PyStore::with(Backend::Cluster(Box::new(store)), true))
}

/// `connect(address, *, token=None, token_file=None, timeout_ms=30000, ...)`: a store served by
/// `kvtide-owner` at `address` ("unix:/path/owner.sock", a socket path, or "host:port").
/// `KVTIDE_TOKEN_FILE`, `KVTIDE_TIMEOUT_MS`, `KVTIDE_SHARED_MEMORY`, `KVTIDE_READ_INDEX`,
/// `KVTIDE_DIRECT_PUTS`, `KVTIDE_UCX_TRANSPORTS` and `KVTIDE_UCX_ALLOW_TCP` apply first. `ucx`:
/// read over the owner's UCX plane with these transports ("rdma", a UCX list, or "off").
#[pyfunction]
#[pyo3(signature = (address, *, token=None, token_file=None, timeout_ms=None, connect_timeout_ms=None,
    shared_memory=None, read_index=None, direct_puts=None, max_idle_connections=None, max_tickets_in_flight=None, max_stream_handles=None,
    max_stream_host_bytes=None, spin_us=None, gpu_staging=None, ucx=None, ucx_allow_tcp=None))]
#[allow(clippy::too_many_arguments)]
pub fn connect(
    py: Python<'_>,
    address: String,
    token: Option<&Bound<'_, PyAny>>,
    token_file: Option<String>,
    timeout_ms: Option<u64>,
    connect_timeout_ms: Option<u64>,
    shared_memory: Option<bool>,
    read_index: Option<bool>,
    direct_puts: Option<bool>,
    max_idle_connections: Option<usize>,
    max_tickets_in_flight: Option<usize>,
    max_stream_handles: Option<usize>,
    max_stream_host_bytes: Option<u64>,
    spin_us: Option<u64>,
    gpu_staging: Option<bool>,
    ucx: Option<String>,
    ucx_allow_tcp: Option<bool>,
) -> PyResult<PyStore> {
    // The variables first (ClientOptions::from_env), then the keywords.
    let mut o = ClientOptions::from_env().map_err(|e| to_py(&e))?;
    set_ucx(&mut o, ucx, ucx_allow_tcp);
    if let Some(token) = token {
        let bytes = if let Ok(s) = token.extract::<String>() { s.into_bytes() } else { buffers::key(token)? };
        o.token = Some(Token::new(&bytes).map_err(|e| invalid(format!("token: {e}")))?);
    }
    if let Some(path) = token_file {
        o = o.token_file(path).map_err(|e| to_py(&e))?;
    }
    if let Some(v) = timeout_ms {
        o.timeout_ms = v;
    }
    if let Some(v) = connect_timeout_ms {
        o.connect_timeout_ms = v;
    }
    if let Some(v) = shared_memory {
        o.shared_memory = v;
    }
    if let Some(v) = read_index {
        o.read_index = v;
    }
    if let Some(v) = direct_puts {
        o.direct_puts = v;
    }
    if let Some(v) = max_idle_connections {
        o.max_idle_connections = v;
    }
    if let Some(v) = max_tickets_in_flight {
        o.max_tickets_in_flight = v;
    }
    if let Some(v) = max_stream_handles {
        o.max_stream_handles = v;
    }
    if let Some(v) = max_stream_host_bytes {
        o.max_stream_host_bytes = v;
    }
    if let Some(v) = spin_us {
        o.spin_us = v;
    }
    if let Some(v) = gpu_staging {
        o.gpu.staging = v;
    }
    let store = py.detach(move || RemoteStore::connect_with(&address, o)).map_err(|e| to_py(&e))?;
    Ok(PyStore::with(Backend::Remote(store), true))
}
