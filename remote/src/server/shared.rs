//! The state the owner's threads share: `Shared` (the engine, the limits, the counters, the
//! connection threads and the parking poller), the registry of open connections and the slots
//! they hold (`ConnTable`, `Slot`), and the work handed to a connection thread (`Job`, `Parked`).
//!
//! Owns the slot accounting: a slot is taken when a connection is admitted and given back when
//! its `Slot` drops, however its thread ends. Never reads or writes a connection's socket (a
//! duplicate is kept only so shutdown can shut it).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use kvtide::Engine;

use super::budget::{Budget, HeldLeases, OwnedWindow};
use super::client_memory::ClientMemory;
use super::config::OwnerConfig;
use crate::metrics::OwnerCounters;
use crate::park::{Parkable, Parker, Workers};
use crate::protocol::Limits;
use crate::sock::{Stream, WakeFlag};
use crate::wire::FrameIo;

pub(super) struct Shared {
    pub(super) engine: Arc<Engine>,
    pub(super) config: OwnerConfig,
    /// The settings SIGHUP may change (`live::RunTimeSettings`): read from here, not `config`.
    pub(super) live: super::live::LiveSettings,
    pub(super) limits: Limits,
    pub(super) wake: WakeFlag,
    pub(super) shutting_down: AtomicBool,
    pub(super) conns: Mutex<ConnTable>,
    pub(super) conns_changed: Condvar,
    pub(super) next_conn: AtomicU64,
    pub(super) budget: Budget,
    pub(super) instance_id: u64,
    pub(super) arena_base: usize,
    pub(super) arena_bytes: u64,
    pub(super) shm_fd: Option<OwnedFd>,
    /// A read-only descriptor of the engine's read index and its length, handed out only with
    /// the arena (`ReadIndex`).
    pub(super) index_fd: Option<(OwnedFd, u64)>,
    /// The UCX data plane, when configured and UCX is present.
    pub(super) ucx: Option<crate::ucx::UcxExport>,
    /// Why the configured UCX plane is not serving (it could not start here), told to clients
    /// that ask for it.
    pub(super) ucx_not_serving: Option<String>,
    /// CPUs this process may run on.
    pub(super) cores: usize,
    pub(super) counters: Arc<OwnerCounters>,
    /// Threads that serve connections while they are active.
    pub(super) workers: Workers<Job>,
    /// Idle connections, without a thread, until their next request.
    pub(super) parker: Parker<Parked>,
}

/// Every open connection (so shutdown can close them) and the slots they hold.
#[derive(Default)]
pub(super) struct ConnTable {
    /// A duplicate of each connection's socket, to shut it when the grace runs out (None while
    /// it is parked: the poller closes parked connections itself, and an idle connection then
    /// costs one descriptor, not two).
    pub(super) streams: HashMap<u64, Option<Stream>>,
    pub(super) authenticated: usize,
    pub(super) unauthenticated: usize,
}

/// A connection's place in the registry and the slot it holds, given back however its thread
/// ends.
pub(super) struct Slot {
    pub(super) shared: Arc<Shared>,
    pub(super) id: u64,
    /// Holds a connection slot (else an unauthenticated one).
    pub(super) authenticated: bool,
}

impl Slot {
    /// Trades the unauthenticated slot of a peer that just authenticated for a connection slot;
    /// false (keeping the old one) when none is free.
    pub(super) fn promote(&mut self) -> bool {
        if self.authenticated {
            return true;
        }
        let mut conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        if conns.authenticated >= self.shared.config.max_connections {
            return false;
        }
        conns.unauthenticated -= 1;
        conns.authenticated += 1;
        self.shared.counters.handshakes_open.fetch_sub(1, Ordering::Relaxed);
        self.shared.counters.connections_open.fetch_add(1, Ordering::Relaxed);
        self.authenticated = true;
        true
    }
}

impl Slot {
    /// Closes the registry's duplicate of a connection's socket while it is parked.
    pub(super) fn park_handle(&self) {
        let mut conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(handle) = conns.streams.get_mut(&self.id) {
            *handle = None;
        }
    }

    /// Gives the registry a duplicate of a resumed connection's socket again.
    pub(super) fn unpark_handle(&self, stream: &Stream) {
        let clone = stream.try_clone().ok();
        let mut conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(handle) = conns.streams.get_mut(&self.id) {
            *handle = clone;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.streams.remove(&self.id);
        if self.authenticated {
            conns.authenticated -= 1;
            self.shared.counters.connections_open.fetch_sub(1, Ordering::Relaxed);
        } else {
            conns.unauthenticated -= 1;
            self.shared.counters.handshakes_open.fetch_sub(1, Ordering::Relaxed);
        }
        self.shared.conns_changed.notify_all();
    }
}

/// Work for a connection thread.
pub(super) enum Job {
    /// A connection just accepted: handshake, then requests.
    New { slot: Slot, stream: Stream, accepted_at: Instant },
    /// A parked connection whose next request arrived.
    Resume(Box<Parked>),
}

/// A connection parked between requests: everything it holds, without a thread.
pub(super) struct Parked {
    // In drop order: leases and window back first, then the socket, then the slot.
    pub(super) leases: HeldLeases,
    pub(super) window: Option<OwnedWindow>,
    pub(super) client_memory: Option<ClientMemory>,
    pub(super) io: FrameIo,
    pub(super) next_lease: u64,
    pub(super) unix: bool,
    pub(super) ucx: bool,
    /// Closed if no request arrives by then.
    pub(super) deadline: Instant,
    pub(super) slot: Slot,
}

impl Parkable for Parked {
    fn fd(&self) -> std::os::fd::RawFd {
        self.io.stream().fd()
    }

    fn deadline(&self) -> Instant {
        self.deadline
    }
}
