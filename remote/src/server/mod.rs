//! The owner service: serves one `Engine` to other processes over a Unix socket (with the DRAM
//! arena shared read-only for one-copy gets) and over TCP (token-authenticated).
//!
//! This module owns the owner's lifecycle: `Owner::start` (the shared state, the parking poller,
//! the listeners and their accept threads), its public API and `shutdown`; it never serves a
//! request itself. The rooms below each own one concern: `config` (settings and their checks),
//! `socket_file` (the Unix socket's file, its mode, group and directory),
//! `shared` (the state the threads share, the registry of connections and their slots), `accept`
//! (admission and the handshake), `connection` (the connection loop and dispatch), `get` and `put`
//! (the request families), `budget` (what a connection holds against the owner's limits),
//! `stop` (how a stop spends its budget), `live` (the settings SIGHUP may change) and
//! `reply` (the one place reply frames are written). A slow or broken client only ever stalls its
//! own thread and holds its own share: deadlines bound every read and socket timeouts every write,
//! and refusing a connection never blocks the accept loop. A malformed frame costs that client an
//! error reply or its connection, never the owner. It never hands a client an address: only offsets
//! of objects it has leased to that connection, released when the client says so or when the
//! connection closes.

mod accept;
mod budget;
mod client_memory;
mod config;
mod connection;
mod get;
mod live;
mod put;
mod reply;
mod shared;
mod socket_file;
mod stop;

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtide::{Engine, Store};

use self::accept::{accept_loop, bind_listeners, Bound};
use self::budget::Budget;
pub(crate) use self::config::check_mode_with_group;
use self::config::validate;
pub use self::config::{OwnerConfig, OwnerError};
use self::connection::run_job;
use self::live::LiveSettings;
pub use self::live::RunTimeSettings;
use self::shared::{ConnTable, Job, Shared};
pub(crate) use self::socket_file::{group_id, parse_socket_mode};
pub use self::stop::{StopPlan, StopReport};
use crate::metrics::OwnerCounters;
use crate::park::{Parker, Workers};
use crate::protocol::Limits;
use crate::sock::{self, Stream, WakeFlag};

/// A running owner service. Dropping it shuts it down (not the engine).
pub struct Owner {
    shared: Arc<Shared>,
    acceptors: Mutex<Vec<JoinHandle<()>>>,
    poller: Mutex<Option<JoinHandle<()>>>,
    unix_path: Option<PathBuf>,
    tcp_addr: Option<SocketAddr>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owner").field("unix", &self.unix_path).field("tcp", &self.tcp_addr).finish()
    }
}

impl Owner {
    /// Binds the configured sockets and starts serving `engine`.
    pub fn start(engine: Arc<Engine>, config: OwnerConfig) -> std::result::Result<Owner, OwnerError> {
        validate(&config)?;
        let shared = Shared::new(engine, config)?;
        let poller = spawn_poller(&shared)?;
        let Bound { listeners, unix_path, tcp_addr } = bind_listeners(&shared.config)?;
        if let Some(index) = shared.engine.read_index().filter(|_| shared.index_fd.is_some()) {
            index.serve(true);
        }
        let mut acceptors = Vec::new();
        for listener in listeners {
            let shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name("kvtide-accept".into())
                .spawn(move || accept_loop(&shared, listener))
                .map_err(|e| OwnerError::Io(format!("spawn acceptor: {e}")))?;
            acceptors.push(handle);
        }
        tracing::info!(
            unix = ?unix_path,
            tcp = ?tcp_addr,
            tcp_auth = shared.config.tcp_token.is_some(),
            share_arena = shared.shm_fd.is_some(),
            read_index = shared.index_fd.is_some(),
            arena_bytes = shared.arena_bytes,
            max_connections = shared.config.max_connections,
            "kvtide owner serving"
        );
        Ok(Owner { shared, acceptors: Mutex::new(acceptors), poller: Mutex::new(Some(poller)), unix_path, tcp_addr })
    }

    /// The Unix socket path, when serving one.
    pub fn unix_path(&self) -> Option<&Path> {
        self.unix_path.as_deref()
    }

    /// The bound TCP address (with the real port when 0 was asked for).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    /// The served engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.shared.engine
    }

    /// Service counters.
    pub fn counters(&self) -> &OwnerCounters {
        &self.shared.counters
    }

    /// The UCX plane's process (None when this owner serves no plane).
    pub fn ucx_plane(&self) -> Option<crate::ucx::UcxPlaneState> {
        self.shared.ucx.as_ref().map(|u| u.state())
    }

    /// The engine and the counters `/metrics` reads.
    pub(crate) fn metrics_sources(&self) -> (Arc<Engine>, Arc<OwnerCounters>) {
        (Arc::clone(&self.shared.engine), Arc::clone(&self.shared.counters))
    }

    /// How long `shutdown` waits for in-flight requests before it closes what is left.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shared.config.shutdown_grace_ms)
    }

    /// Stops accepting, lets in-flight requests finish (new ones get `ShuttingDown`), closes
    /// idle connections, and after `shutdown_grace_ms` closes whatever is left. Idempotent; the
    /// engine keeps running (shut it down afterwards, or use `stop_within_budget`). `POST /drain`
    /// runs it while the process keeps running.
    pub fn shutdown(&self) {
        self.shutdown_with_grace(Duration::from_millis(self.run_time_settings().shutdown_grace_ms));
    }

    /// The first step of `shutdown`, on its own: when it returns, no new connection is accepted
    /// (the Unix socket's file is gone) and no read goes through the read index; requests in
    /// flight go on. Returns true for the first call. Idempotent.
    pub fn stop_accepting(&self) -> bool {
        let shared = &self.shared;
        let first = !shared.shutting_down.swap(true, Ordering::SeqCst);
        // Reads through the read index end with the connections' service.
        if let Some(index) = shared.engine.read_index().filter(|_| shared.index_fd.is_some()) {
            index.serve(false);
        }
        shared.wake.signal();
        let acceptors = std::mem::take(&mut *self.acceptors.lock().unwrap_or_else(|p| p.into_inner()));
        for a in acceptors {
            let _ = a.join();
        }
        if first {
            if let Some(path) = &self.unix_path {
                let _ = std::fs::remove_file(path);
            }
        }
        first
    }

    /// `shutdown`, with in-flight requests given `grace`.
    fn shutdown_with_grace(&self, grace: Duration) {
        let first = self.stop_accepting();
        self.wait_for_connections(grace);
        self.shared.parker.stop();
        if let Some(poller) = self.poller.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = poller.join();
        }
        if first {
            tracing::info!("kvtide owner stopped serving");
        }
    }

    /// Waits until every connection ended, closing what is left after `grace`.
    fn wait_for_connections(&self, grace: Duration) {
        let shared = &self.shared;
        let mut conns = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + grace;
        while !conns.streams.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    connections = conns.streams.len(),
                    "shutdown grace passed; closing remaining connections"
                );
                conns.streams.values().flatten().for_each(Stream::shutdown);
                let _ = shared
                    .conns_changed
                    .wait_timeout_while(conns, Duration::from_secs(5), |c| !c.streams.is_empty())
                    .unwrap_or_else(|p| p.into_inner());
                break;
            }
            conns = shared.conns_changed.wait_timeout(conns, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    /// Everything the connections share: the engine and its arena, the limits, the counters,
    /// the connection threads and the parking poller's state.
    fn new(engine: Arc<Engine>, config: OwnerConfig) -> std::result::Result<Arc<Shared>, OwnerError> {
        let arena = engine.arena();
        let arena_base = arena.slice(0).map_err(|e| OwnerError::Io(format!("arena: {e}")))?.base().as_ptr() as usize;
        let arena_bytes = arena.len_bytes() as u64;
        let shm_fd = if config.share_arena && config.unix_socket.is_some() { shared_arena_fd(&engine) } else { None };
        let index_fd = if shm_fd.is_some() { shared_index_fd(&engine) } else { None };
        let (ucx, ucx_not_serving) = match start_ucx(&config, &engine)? {
            Ok(export) => (export, None),
            Err(why) => (None, Some(why)),
        };
        let mut id = [0u8; 8];
        sock::random_bytes(&mut id).map_err(|e| OwnerError::Io(format!("getrandom: {e}")))?;
        let limits = Limits {
            max_payload_bytes: config.max_payload_bytes,
            max_items: config.max_items,
            max_key_bytes: engine.max_key_bytes().min(crate::protocol::MAX_WIRE_KEY_BYTES) as u32,
            max_value_bytes: engine.max_value_bytes(),
        };
        let wake = WakeFlag::new().map_err(|e| OwnerError::Io(format!("eventfd: {e}")))?;
        let counters = Arc::new(OwnerCounters::default());
        let parker = Parker::new(wake.fd(), Arc::clone(&counters.connections_parked))
            .map_err(|e| OwnerError::Io(format!("epoll: {e}")))?;
        let workers = Workers::new("kvtide-conn", 512 << 10, run_job, Arc::clone(&counters.connection_threads));
        Ok(Arc::new(Shared {
            wake,
            workers,
            parker,
            budget: Budget::new(&config),
            live: LiveSettings::new(&config),
            engine,
            limits,
            shutting_down: AtomicBool::new(false),
            conns: Mutex::new(ConnTable::default()),
            conns_changed: Condvar::new(),
            next_conn: AtomicU64::new(1),
            instance_id: u64::from_le_bytes(id),
            arena_base,
            arena_bytes,
            shm_fd,
            index_fd,
            ucx,
            ucx_not_serving,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            counters,
            config,
        }))
    }
}

/// The UCX plane over the configured transports (checked by `validate`), served by its own
/// process; None when not configured; why not when it cannot start here (warned: clients keep
/// the TCP path, and are told why when they ask for the plane).
type UcxStart = std::result::Result<Option<crate::ucx::UcxExport>, String>;
fn start_ucx(config: &OwnerConfig, engine: &Engine) -> std::result::Result<UcxStart, OwnerError> {
    let Some(list) = &config.ucx_transports else { return Ok(Ok(None)) };
    let transports =
        crate::ucx::Transports::parse(list, config.ucx_allow_tcp).map_err(|e| OwnerError::Config(e.to_string()))?;
    let on_loopback = config.tcp.is_some_and(|a| a.ip().is_loopback());
    if transports.loopback_devices(on_loopback).is_some() {
        tracing::info!("the UCX plane runs over tcp on the loopback interface only (UCX_NET_DEVICES=lo)");
    } else if transports.has_tcp() {
        tracing::warn!(
            "the UCX plane runs over tcp: any host that reaches its port can read and write the plane process's \
             memory (the arena, read-only, and UCX's state; ucx_allow_tcp): loopback or a trusted network only"
        );
    }
    let arena = engine.arena();
    let started = ucx_program(config).and_then(|program| {
        let fd = crate::shm::check_sealed(arena.memfd(), arena.len_bytes() as u64)
            .and_then(|()| crate::shm::reopen_read_only(arena.memfd()))
            .map_err(|e| format!("the arena cannot be shared read-only: {e}"))?;
        let workers = crate::ucx::plane_workers(config.ucx_workers);
        crate::ucx::UcxExport::start(program, transports, fd, arena.len_bytes() as u64, on_loopback, workers)
            .map_err(|e| e.to_string())
    });
    match started {
        Ok(export) => Ok(Ok(Some(export))),
        Err(e) => {
            tracing::warn!(error = %e, "NOT serving the UCX data plane; TCP clients read over the socket");
            Ok(Err(e))
        }
    }
}

/// The program that runs the UCX plane's process.
fn ucx_program(config: &OwnerConfig) -> std::result::Result<std::path::PathBuf, String> {
    if let Some(p) = &config.ucx_program {
        return Ok(p.clone());
    }
    let me = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    if me.file_name().is_some_and(|n| n == "kvtide-owner") {
        return Ok(me);
    }
    let beside = me.with_file_name("kvtide-owner");
    if beside.is_file() {
        return Ok(beside);
    }
    Err("the UCX plane runs in a kvtide-owner process: set ucx_program to the kvtide-owner binary".into())
}

/// A read-only descriptor of the engine's arena to hand Unix clients, or None (with a warning)
/// when the arena's memfd is not sealed: a descriptor of an unsealed memfd could be reopened
/// for writing, so none is ever shared.
fn shared_arena_fd(engine: &Engine) -> Option<OwnedFd> {
    let arena = engine.arena();
    match crate::shm::check_sealed(arena.memfd(), arena.len_bytes() as u64)
        .and_then(|()| crate::shm::reopen_read_only(arena.memfd()))
    {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::warn!(error = %e, "NOT sharing the DRAM arena with Unix clients (they get socket copies instead)");
            None
        }
    }
}

/// A read-only descriptor of the engine's read index (and its length), or None: the engine keeps
/// none, or its memfd is not sealed (warned: clients then lease every read).
fn shared_index_fd(engine: &Engine) -> Option<(OwnedFd, u64)> {
    let index = engine.read_index()?;
    let bytes = index.geometry().len_bytes() as u64;
    match crate::shm::check_sealed(index.memfd(), bytes).and_then(|()| crate::shm::reopen_read_only(index.memfd())) {
        Ok(fd) => Some((fd, bytes)),
        Err(e) => {
            tracing::warn!(error = %e, "NOT sharing the read index with Unix clients (they lease every read)");
            None
        }
    }
}

/// Starts the thread that watches parked connections: one whose next request arrives goes back
/// to a connection thread, one past its deadline is closed.
fn spawn_poller(shared: &Arc<Shared>) -> std::result::Result<JoinHandle<()>, OwnerError> {
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name("kvtide-park".into())
        .spawn(move || {
            shared.parker.run(
                |parked| {
                    if let Err(e) = shared.workers.submit(Job::Resume(Box::new(parked))) {
                        tracing::warn!(error = %e, "cannot start a connection thread; connection closed");
                    }
                },
                |_| {
                    shared.counters.idle_closed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("closing an idle connection");
                },
            )
        })
        .map_err(|e| OwnerError::Io(format!("spawn poller: {e}")))
}

impl Owner {
    /// The settings this owner applies at run time, as they are now.
    pub fn run_time_settings(&self) -> RunTimeSettings {
        self.shared.live.get()
    }

    /// Applies new run-time settings (checked first; nothing changes when they are invalid).
    pub fn apply_run_time_settings(&self, settings: RunTimeSettings) -> Result<(), OwnerError> {
        settings.check()?;
        self.shared.live.set(&settings);
        Ok(())
    }

    /// Stops serving and then the engine within `stop_budget_ms` of `signalled`: in-flight
    /// requests get the plan's grace, then the engine flushes DRAM-only objects to SSD until the
    /// plan's `flush_by` (what it did not write is counted; queued tombstones are still written
    /// after it). Idempotent with `shutdown`.
    pub fn stop_within_budget(&self, signalled: Instant) -> StopReport {
        let live = self.shared.live.get();
        let plan = StopPlan::new(live.stop_budget_ms, live.shutdown_grace_ms);
        self.shutdown_with_grace(plan.grace);
        let drained = signalled.elapsed();
        tracing::info!(
            drained_ms = drained.as_millis() as u64,
            flush_until_ms = plan.flush_by.as_millis() as u64,
            "stop: connections closed; flushing DRAM-only objects to SSD"
        );
        let engine = &self.shared.engine;
        engine.shutdown_by(signalled + plan.flush_by);
        let total = engine.stats().total;
        StopReport {
            plan,
            drained,
            stopped: signalled.elapsed(),
            flushed_objects: total.shutdown_demotions,
            unflushed_objects: total.shutdown_unflushed_objects,
            unflushed_bytes: total.shutdown_unflushed_bytes,
        }
    }
}
