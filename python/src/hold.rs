//! `kvtide.Hold`: read leases a caller keeps across calls (`Store.hold(keys, ttl_ms)`), so the
//! objects it found stay in place (not evictable) until it has read them.
//!
//! Owns the Python object of a hold and the embedded store's hold bookkeeping: the engine's
//! `ObjectLease`s (embedded) or the owner's leases on the client's hold connection (remote),
//! given back on `release()`, at the TTL, on `Store.close()` or when the hold is dropped, and
//! the per-store bound and count of held keys (`held_resources()["holds"]`, `["held_keys"]`).
//! Never reads the held bytes itself, and never reports a key held after its TTL, its release
//! or the loss of the connection that held it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvtide::ObjectLease;
use kvtide_remote::Error as R;
use pyo3::prelude::*;

use crate::backend::{not_on_cluster, Backend};
use crate::errors;

/// Longest TTL a hold may ask for.
pub const MAX_HOLD_TTL_MS: u64 = 3_600_000;
/// Keys one embedded store holds at once; keys past it are answered `Busy`. (Through an owner
/// the bound is its `max_leases_per_connection` on the client's hold connection.)
pub const MAX_EMBEDDED_HELD_KEYS: usize = 1 << 16;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The holds of one embedded store: per live hold, its deadline and the keys it still holds.
#[derive(Default)]
pub struct EmbeddedHolds {
    state: Mutex<Registry>,
    next_id: AtomicU64,
}

#[derive(Default)]
struct Registry {
    live: HashMap<u64, (Instant, usize)>,
    closed: bool,
}

impl Registry {
    /// Forgets holds whose TTL passed (the shards reclaim their leases).
    fn prune(&mut self, now: Instant) {
        self.live.retain(|_, (expires_at, held)| now < *expires_at && *held > 0);
    }

    fn held_keys(&self) -> usize {
        self.live.values().map(|(_, n)| n).sum()
    }
}

impl EmbeddedHolds {
    /// `(holds, keys)` held now.
    pub fn count(&self) -> (u64, u64) {
        let mut st = lock(&self.state);
        st.prune(Instant::now());
        (st.live.len() as u64, st.held_keys() as u64)
    }

    /// The store closed: no hold counts any more (the engine is gone with their leases).
    pub fn close(&self) {
        let mut st = lock(&self.state);
        st.live.clear();
        st.closed = true;
    }

    fn alive(&self, id: u64) -> bool {
        let st = lock(&self.state);
        st.live.get(&id).is_some_and(|(expires_at, held)| Instant::now() < *expires_at && *held > 0)
    }

    fn set_held(&self, id: u64, held: usize) {
        let mut st = lock(&self.state);
        if held == 0 {
            st.live.remove(&id);
        } else if let Some(entry) = st.live.get_mut(&id) {
            entry.1 = held;
        }
    }
}

/// What a hold holds.
enum Held {
    /// Per key: the engine's lease while held.
    Embedded { leases: Mutex<Vec<Option<ObjectLease>>>, registry: Arc<EmbeddedHolds>, id: u64 },
    /// The owner's leases on the client's hold connection, by hold id. Weak: a hold does not
    /// keep a closed store's connections open (closing it ended the hold).
    Remote { backend: Weak<Backend>, id: u64 },
}

/// Read leases on the present keys of `Store.hold(keys, ttl_ms)`, kept until `release()`, the
/// TTL, `Store.close()` or (through an owner) the loss of the connection holding them.
#[pyclass(module = "kvtide", name = "Hold", frozen)]
pub struct Hold {
    held: Held,
    keys: Vec<Vec<u8>>,
    results: Vec<Result<u64, R>>,
    expires_at: Instant,
}

impl Hold {
    /// Takes a hold on `keys` (`backend`'s own store; `registry` bounds and counts embedded
    /// holds).
    pub fn take(
        backend: Arc<Backend>,
        registry: &Arc<EmbeddedHolds>,
        keys: Vec<Vec<u8>>,
        ttl_ms: u64,
    ) -> Result<Hold, R> {
        if ttl_ms == 0 || ttl_ms > MAX_HOLD_TTL_MS {
            return Err(R::Store(kvtide::Error::InvalidArgument(format!(
                "hold ttl_ms = {ttl_ms}: expected 1 to {MAX_HOLD_TTL_MS}"
            ))));
        }
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        match &*backend {
            Backend::Embedded(engine) => {
                // Room is reserved under the lock and the leases taken outside it, so a hold
                // that loads SSD-resident objects does not hold up releases.
                let now = Instant::now();
                let expires_at = now + Duration::from_millis(ttl_ms);
                let id = registry.next_id.fetch_add(1, Ordering::Relaxed);
                let room = {
                    let mut st = lock(&registry.state);
                    if st.closed {
                        return Err(R::Store(kvtide::Error::ShuttingDown));
                    }
                    st.prune(now);
                    let room = MAX_EMBEDDED_HELD_KEYS.saturating_sub(st.held_keys()).min(refs.len());
                    if room > 0 {
                        st.live.insert(id, (expires_at, room));
                    }
                    room
                };
                let mut leased = engine.lease_batch(&refs[..room], ttl_ms).into_iter();
                let mut leases = Vec::with_capacity(refs.len());
                let mut results = Vec::with_capacity(refs.len());
                for _ in 0..refs.len() {
                    match leased.next() {
                        Some(Ok(lease)) => {
                            results.push(Ok(lease.len()));
                            leases.push(Some(lease));
                        }
                        Some(Err(e)) => {
                            results.push(Err(R::Store(e)));
                            leases.push(None);
                        }
                        None => {
                            results.push(Err(R::Store(kvtide::Error::Busy { limit: MAX_EMBEDDED_HELD_KEYS })));
                            leases.push(None);
                        }
                    }
                }
                registry.set_held(id, leases.iter().flatten().count());
                Ok(Hold {
                    held: Held::Embedded { leases: Mutex::new(leases), registry: Arc::clone(registry), id },
                    keys,
                    results,
                    expires_at,
                })
            }
            Backend::Remote(r) => {
                let granted = r.hold(&refs, ttl_ms)?;
                let (id, results, expires_at) = (granted.id, granted.results, granted.expires_at);
                Ok(Hold { held: Held::Remote { backend: Arc::downgrade(&backend), id }, keys, results, expires_at })
            }
            Backend::Cluster(_) => Err(not_on_cluster("hold")),
        }
    }

    /// Releases the keys at `positions` (all when None); returns how many were held.
    fn release_positions(&self, positions: Option<&[usize]>) -> usize {
        match &self.held {
            Held::Embedded { leases, registry, id } => {
                let mut leases = lock(leases);
                let alive = registry.alive(*id);
                let taken: Vec<ObjectLease> = match positions {
                    None => leases.iter_mut().filter_map(Option::take).collect(),
                    Some(ps) => ps.iter().filter_map(|&i| leases.get_mut(i).and_then(Option::take)).collect(),
                };
                let n = taken.len();
                ObjectLease::release_all(taken);
                registry.set_held(*id, leases.iter().flatten().count());
                if alive {
                    n
                } else {
                    0
                }
            }
            Held::Remote { backend, id } => match backend.upgrade().as_deref() {
                Some(Backend::Remote(r)) => r.release_hold(*id, positions),
                _ => 0,
            },
        }
    }

    /// Per key: held now.
    fn status(&self) -> Vec<bool> {
        match &self.held {
            Held::Embedded { leases, registry, id } => {
                if !registry.alive(*id) {
                    return vec![false; self.keys.len()];
                }
                lock(leases).iter().map(Option::is_some).collect()
            }
            Held::Remote { backend, id } => match backend.upgrade().as_deref() {
                Some(Backend::Remote(r)) => r.hold_status(*id).unwrap_or_else(|| vec![false; self.keys.len()]),
                _ => vec![false; self.keys.len()],
            },
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release_positions(None);
    }
}

#[pymethods]
impl Hold {
    /// One result per key, as taken: the object's size in bytes when it was held, or the
    /// exception saying why not (`NotFound`, `Busy` past the bound, ...).
    #[getter]
    fn results(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let results: Vec<Result<u64, R>> = self.results.clone();
        errors::per_key(py, results, |py, n: u64| Ok(n.into_pyobject(py)?.into_any().unbind()))
    }

    /// Per key: True while it is held (False once released, expired, lost, or never held).
    fn held(&self, py: Python<'_>) -> Vec<bool> {
        py.detach(|| self.status())
    }

    /// True while any key is held.
    #[getter]
    fn active(&self, py: Python<'_>) -> bool {
        py.detach(|| self.status().contains(&true))
    }

    /// Milliseconds until the hold ends by its TTL (0 once passed).
    #[getter]
    fn expires_in_ms(&self) -> u64 {
        self.expires_at.saturating_duration_since(Instant::now()).as_millis() as u64
    }

    /// Releases the hold: every key (`keys` None) or the given ones (keys of this hold; others
    /// are ignored). Returns how many keys were held and are now released; releasing twice is
    /// harmless.
    #[pyo3(signature = (keys=None))]
    fn release(&self, py: Python<'_>, keys: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
        let positions: Option<Vec<usize>> = match keys {
            None => None,
            Some(k) => {
                let wanted = crate::buffers::keys(k)?;
                let mut at: HashMap<&[u8], Vec<usize>> = HashMap::new();
                for (i, key) in self.keys.iter().enumerate() {
                    at.entry(key.as_slice()).or_default().push(i);
                }
                Some(wanted.iter().flat_map(|k| at.get(k.as_slice()).cloned().unwrap_or_default()).collect())
            }
        };
        Ok(py.detach(|| self.release_positions(positions.as_deref())))
    }

    fn __len__(&self) -> usize {
        self.keys.len()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.release(py, None)?;
        Ok(false)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let held = py.detach(|| self.status().iter().filter(|h| **h).count());
        format!("kvtide.Hold({} keys, {held} held, expires in {} ms)", self.keys.len(), self.expires_in_ms())
    }
}
