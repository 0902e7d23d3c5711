//! Shards: one pinned thread per core, each owning an io_uring ring, an arena slice and its part
//! of the index. This module owns the messages callers send and the inbox they go through; it
//! never lets a caller touch a shard's state except by a message, which a caller handles itself
//! (on the shard's core, under its lock) only when the shard is idle (`lend`).
//!
//! `shard/` is the floor below the engine: it never imports `crate::engine`. Work the engine
//! wants a shard to advance comes as a `ShardTask` (`task`), whose code lives with the engine.

pub mod core;
mod hash;
pub(crate) mod inbox;
pub mod landing;
mod lend;
pub(crate) mod published;
mod ring;
mod runtime;
mod serve;
pub(crate) mod task;

use std::time::Duration;

use crossbeam_channel::Sender;

pub(crate) use self::core::{largest_value_bytes, ScannedKeys};
pub use self::core::{
    LeaseId, Location, ObjectRef, ReadGrant, ShardConfig, ShardCore, WriteGrant, DEFAULT_MAX_PENDING_TOMBSTONES,
};
pub(crate) use hash::{index_hash, key_hash, key_index_hash};
pub(crate) use inbox::Inbox;
pub(crate) use lend::{lend, serve_on_caller};
pub(crate) use runtime::{allowed_cpus, spawn_shard, DiskBackend, RuntimeConfig, ShardThread, StartingShard};

/// CPUs this process may run on (the default shard count).
pub(crate) fn allowed_cpu_count() -> usize {
    allowed_cpus().len().max(1)
}
pub(crate) use task::ShardTask;

use crate::error::Result;

/// A request to one shard. Batched: one message per shard per call phase, not per key.
pub(crate) enum Request {
    /// Lease each key for reading; `ttl` makes them explicit leases with a backstop deadline.
    /// With `early`, an SSD-resident key is granted as soon as its load starts, with the
    /// `Landing` its reader waits on (progressive reads).
    LeaseRead {
        keys: Vec<Box<[u8]>>,
        ttl: Option<Duration>,
        early: bool,
        reply: Sender<Vec<Result<ReadGrant>>>,
    },
    /// Lease objects by reference: reservations that readers follow, or what they became.
    LeaseObjects {
        objects: Vec<ObjectRef>,
        reply: Sender<Vec<Result<ReadGrant>>>,
    },
    /// Give leases back (fire and forget; duplicates are harmless).
    Release {
        leases: Vec<LeaseId>,
    },
    /// Allocate room for new objects (not visible until committed).
    Reserve {
        items: Vec<(Box<[u8]>, u64)>,
        upsert: bool,
        reply: Sender<Vec<Result<WriteGrant>>>,
    },
    /// Publish reserved objects.
    Commit {
        objects: Vec<ObjectRef>,
        upsert: bool,
        /// Pin each object as it is published.
        pin: bool,
        reply: Sender<Vec<Result<()>>>,
    },
    /// Drop reservations whose writer failed (fire and forget).
    Abort {
        objects: Vec<ObjectRef>,
    },
    Exists {
        keys: Vec<Box<[u8]>>,
        reply: Sender<Vec<bool>>,
    },
    /// Where each key lives and how big it is, for restore planning (no hit/miss counted).
    Locate {
        keys: Vec<Box<[u8]>>,
        reply: Sender<Vec<Option<Location>>>,
    },
    Remove {
        key: Box<[u8]>,
        force: bool,
        reply: Sender<Result<()>>,
    },
    Pin {
        key: Box<[u8]>,
        reply: Sender<Result<()>>,
    },
    Unpin {
        key: Box<[u8]>,
        reply: Sender<Result<()>>,
    },
    /// Work the shard advances between other work (async batch reads through the transports).
    Task(Box<dyn ShardTask>),
    /// Live keys starting with `prefix`, from object slot `from` on (`ShardCore::scan_keys`).
    ScanKeys {
        prefix: Box<[u8]>,
        from: u32,
        limit: usize,
        reply: Sender<ScannedKeys>,
    },
    /// Replies once everything sent before it from the same thread has been handled.
    Barrier {
        reply: Sender<()>,
    },
}
