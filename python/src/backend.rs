//! The store behind a Python object: the embedded engine, one owner (`RemoteStore`) or a cluster.
//! Owns that choice and lifting each store's errors into the remote error type. Never converts
//! Python arguments or holds the GIL.

use kvtide::Engine;
use kvtide_remote::{ClusterStore, Error as R, RemoteStore};

/// The store behind a `kvtide.Store`.
pub enum Backend {
    Embedded(Box<Engine>),
    Remote(RemoteStore),
    Cluster(Box<ClusterStore>),
}

/// The error of an operation a cluster store does not route (it spans owners).
pub fn not_on_cluster(what: &str) -> R {
    R::Store(kvtide::Error::InvalidArgument(format!(
        "{what} is not available through a cluster store (kvtide.connect_cluster); connect to one owner with \
         kvtide.connect for it"
    )))
}

/// Lifts one result into the remote error type.
pub fn lift<T, E: Into<R>>(r: Result<T, E>) -> Result<T, R> {
    r.map_err(Into::into)
}

/// Lifts per-key results.
pub fn lift_all<T, E: Into<R>>(rs: Vec<Result<T, E>>) -> Vec<Result<T, R>> {
    rs.into_iter().map(lift).collect()
}
