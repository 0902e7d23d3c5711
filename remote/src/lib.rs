//! kvtide-remote: the owner process and its remote clients. Owns the wire protocol, token
//! authentication, the shared-memory mapping of the arena, sockets and the owner's settings;
//! never reaches into the engine's shards: the owner uses kvtide's public API (leases,
//! reservations) like any embedded caller.
//!
//! `Owner` serves one `kvtide::Engine` over a Unix socket (the DRAM arena is shared read-only,
//! so a get costs one copy) and over TCP (token-authenticated); `RemoteStore` implements
//! `kvtide::Store` against it, so code written for the embedded engine runs unchanged (its
//! `Error` is this crate's, which wraps `kvtide::Error`). `protocol` is the wire format and its
//! validation, pure so the fuzz targets can drive it. The binary is `kvtide-owner`.

#![warn(clippy::too_many_lines)]

mod auth;
mod client;
pub mod cluster;
mod error;
mod fast_read;
mod http;
mod metrics;
mod park;
pub mod protocol;
mod server;
mod settings;
mod shm;
mod sock;
mod ucx;
mod wire;

pub use auth::Token;
pub use client::{ClientOptions, DataPlane, HoldGranted, ReadIndexCounts, RemotePutStream, RemoteStore};
pub use cluster::{ClusterOptions, ClusterStore};
pub use error::{Error, Result};
pub use http::{HttpServer, HttpState};
pub use metrics::{OwnerCounters, RequestLatency};
pub use server::{Owner, OwnerConfig, OwnerError, RunTimeSettings, StopPlan, StopReport};
pub use settings::{
    configuration_reference, default_socket, flag_name, usage as owner_usage, ClusterGroup, Flags, HttpListen,
    Invocation, OwnerGroup, OwnerSettings, ResolvedOwner, Source,
};
pub use sock::raise_descriptor_limit;
pub use ucx::{
    ucx_available, ucx_plane_confinement_check, ucx_plane_main, Transports as UcxTransports, UcxError, UcxPlaneState,
    MAX_UCX_WORKERS, UCX_PLANE_ARG, UCX_PLANE_CONFINED_ARG, UCX_PLANE_VERSION,
};

/// The same-host read path, for the fuzz target.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::fast_read::read_through;
}
