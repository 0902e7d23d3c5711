//! The owner process and its remote clients.
//!
//! `Owner` serves one `Engine` over a Unix socket (the DRAM arena is shared read-only, so a get
//! costs one copy) and over TCP (token-authenticated); `RemoteStore` implements `Store` against
//! it, so code written for the embedded engine runs unchanged. `protocol` is the wire format and
//! its validation, pure so the fuzz targets can drive it. The binary is `kvtide-owner`.
//!
//! This module never reaches into the shards: the owner uses the engine's public API (leases,
//! reservations) like any embedded caller.

mod auth;
mod client;
pub mod protocol;
mod server;
mod settings;
mod shm;
mod sock;
mod wire;

pub use auth::Token;
pub use client::{ClientOptions, RemoteStore};
pub use server::{Owner, OwnerConfig, OwnerCounters, OwnerError};
pub use settings::{OwnerSettings, ResolvedOwner, USAGE as OWNER_USAGE};
