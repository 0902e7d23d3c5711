//! The owner service: serves one `Engine` to other processes over a Unix socket (with the DRAM
//! arena shared read-only for one-copy gets) and over TCP (token-authenticated).
//!
//! It owns the listeners, one bounded thread per connection, each connection's lease table,
//! and the limits: connection slots (TCP peers that have not authenticated yet get their own
//! few), the handshake, payload and idle deadlines, leases per connection, frame size, items per
//! request and the budget of buffered request bytes (a guaranteed share per connection plus a
//! shared pool). A slow or broken client only ever stalls its own thread and holds its own share:
//! deadlines bound every read and socket timeouts every write, and refusing a connection never
//! blocks the accept loop. A malformed frame costs that client an error reply or its connection,
//! never the owner. It never hands a client an address: only offsets of objects it has leased to
//! that connection, released when the client says so or when the connection closes.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::auth::Token;
use crate::metrics::OwnerCounters;
use crate::park::{Parkable, Parker, Workers};
use crate::protocol::{
    begin_frame, encode_error_frame, encode_exists, encode_grants, encode_key_page, encode_object, encode_statuses,
    end_frame, FrameHeader, GetItem, Grant, GrantsPart, Hello, HelloOk, LenCheck, Limits, NextPart, Op, ProtocolError,
    PutChunkHead, PutHead, PutItem, RangeItem, Request, HELLO_AUTH_REQUIRED, HELLO_SHM_ATTACHED, HELLO_WANT_SHM,
    MAC_BYTES, NONCE_BYTES, PUT_CHUNK_HEAD_BYTES, PUT_HEAD_BYTES, WHOLE_REQUEST,
};
use crate::shm::PutWindow;
use crate::sock::{self, Stream, WakeFlag};
use crate::wire::{FrameIo, WResult, WireError, FLUSH_BYTES};
use kvtide::{Engine, Error as StoreError, ObjectLease, PutOptions, PutStream, Store};

use crate::error::{Error, Result};

/// How long a follower's wait for a producer's chunk lasts before it looks again.
const FOLLOW_WAIT_MS: u64 = 100;
/// Progressive puts one connection may hold open at once.
pub const MAX_OPEN_PUTS_PER_CONNECTION: usize = 16;
/// A refused connection is kept this long (at most `MAX_LINGERING` of them per listener), so
/// that closing it does not reset it before the client read why.
const REFUSAL_LINGER: Duration = Duration::from_millis(500);
const MAX_LINGERING: usize = 64;
/// Parts of a `GetParts` answer a client may hold at once: one it copies while the owner
/// leases (loads) the next, since the owner leases one part at a time.
const PARTS_HELD: usize = 2;

/// What the owner serves and its limits.
#[derive(Clone, Debug)]
pub struct OwnerConfig {
    /// Unix socket path (created 0600; a stale socket file is replaced). None: no Unix socket.
    pub unix_socket: Option<PathBuf>,
    /// TCP address. None: no TCP.
    pub tcp: Option<SocketAddr>,
    /// Token TCP clients must prove they know. Required for TCP unless
    /// `allow_unauthenticated_loopback` is set and `tcp` is a loopback address.
    pub tcp_token: Option<Token>,
    /// Serve TCP without authentication; refused unless `tcp` is a loopback address.
    pub allow_unauthenticated_loopback: bool,
    /// Map the DRAM arena into Unix-socket clients (one-copy gets). Every such client can then
    /// read every object in DRAM; off, they get socket copies and see only what they ask for.
    pub share_arena: bool,
    /// Connections served at once; more are refused with `Busy`. A Unix-socket peer takes a
    /// slot when it connects (the socket's permissions authenticate it); a TCP peer once it has
    /// authenticated (or, without a token, said hello).
    pub max_connections: usize,
    /// TCP connections still in their handshake; more are refused with `Busy`. They never take
    /// the slots above, so unauthenticated peers cannot lock authenticated clients out.
    pub max_unauthenticated_connections: usize,
    /// Shared-memory leases one connection may hold; past it, keys get `Busy`.
    pub max_leases_per_connection: u32,
    /// Each Unix connection's put window: shared memory the client writes values into and the
    /// owner copies into its reservations, so a batch of puts is one request and one reply with
    /// no value bytes on the socket. Only the client maps it writable; the arena stays
    /// read-only. 0: no windows (puts travel over the socket).
    pub put_window_bytes: u64,
    /// Put windows of all connections together; a connection that would pass it is refused one
    /// (`Busy`) and its client puts over the socket.
    pub max_put_window_bytes: u64,
    /// Largest frame payload accepted or sent.
    pub max_payload_bytes: u32,
    /// Bulk data travels in chunks of this size.
    pub chunk_bytes: u32,
    /// Most keys or fragments in one request.
    pub max_items: u32,
    /// Request bytes all connections may hold in memory at once (requests are read whole
    /// before they are served; put values go straight into their reservation and do not count).
    pub max_buffered_bytes: u64,
    /// Each connection's guaranteed share of `max_buffered_bytes`: a request up to this size never
    /// waits for other connections. A larger one also takes the rest from the pool left over
    /// (`max_buffered_bytes - max_connections * share`); past it, it waits up to
    /// `payload_timeout_ms` and then gets `Busy`. None: `max_buffered_bytes / (2 * max_connections)`.
    pub connection_buffered_bytes: Option<u64>,
    /// Bound on every socket write, and on each socket read while no deadline below applies.
    pub io_timeout_ms: u64,
    /// The whole handshake (hello, authentication) must be done this long after the connection
    /// was accepted, however the peer spaces its bytes.
    pub handshake_timeout_ms: u64,
    /// Once the first byte of a frame arrived, the frame's header and payload must have arrived
    /// within this long (each frame of a put's value likewise); else the connection is closed.
    pub payload_timeout_ms: u64,
    /// A connection with no request for this long is closed (one holding leases is kept at least
    /// `lease_ttl_ms`, so its leases cannot end before the client stops trusting them).
    pub idle_timeout_ms: u64,
    /// Backstop TTL of leases (a live client that never releases loses them after this).
    pub lease_ttl_ms: u32,
    /// How long shutdown waits for in-flight requests before closing their connections.
    pub shutdown_grace_ms: u64,
    /// How long a connection polls for its client's next request before it sleeps, so a
    /// client that asks again at once costs no thread wake-up. Default 50 µs on hosts with 8
    /// or more CPUs, else 0.
    pub spin_us: u64,
}

impl OwnerConfig {
    /// Each connection's guaranteed share of the request budget.
    pub fn connection_share_bytes(&self) -> u64 {
        self.connection_buffered_bytes
            .unwrap_or_else(|| self.max_buffered_bytes / (2 * self.max_connections.max(1) as u64))
    }
}

impl Default for OwnerConfig {
    fn default() -> Self {
        OwnerConfig {
            unix_socket: None,
            tcp: None,
            tcp_token: None,
            allow_unauthenticated_loopback: false,
            share_arena: true,
            max_connections: 256,
            max_unauthenticated_connections: 32,
            max_leases_per_connection: 4096,
            put_window_bytes: 32 << 20,
            max_put_window_bytes: 1 << 30,
            max_payload_bytes: 4 << 20,
            chunk_bytes: 1 << 20,
            max_items: 65_536,
            max_buffered_bytes: 256 << 20,
            connection_buffered_bytes: None,
            io_timeout_ms: 30_000,
            handshake_timeout_ms: 5_000,
            payload_timeout_ms: 10_000,
            idle_timeout_ms: 600_000,
            lease_ttl_ms: 120_000,
            shutdown_grace_ms: 10_000,
            spin_us: crate::wire::default_spin_us(),
        }
    }
}

/// Why the owner could not start.
#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    #[error("invalid owner configuration: {0}")]
    Config(String),
    #[error("another owner is already serving {0}")]
    AlreadyRunning(PathBuf),
    #[error("cannot bind {what}: {source}")]
    Bind { what: String, source: std::io::Error },
    #[error("{0}")]
    Io(String),
}

struct Shared {
    engine: Arc<Engine>,
    config: OwnerConfig,
    limits: Limits,
    wake: WakeFlag,
    shutting_down: AtomicBool,
    conns: Mutex<ConnTable>,
    conns_changed: Condvar,
    next_conn: AtomicU64,
    budget: Budget,
    instance_id: u64,
    arena_base: usize,
    arena_bytes: u64,
    shm_fd: Option<OwnedFd>,
    counters: Arc<OwnerCounters>,
    /// Threads that serve connections while they are active.
    workers: Workers<Job>,
    /// Idle connections, without a thread, until their next request.
    parker: Parker<Parked>,
}

/// Work for a connection thread.
enum Job {
    /// A connection just accepted: handshake, then requests.
    New { slot: Slot, stream: Stream, accepted_at: Instant },
    /// A parked connection whose next request arrived.
    Resume(Box<Parked>),
}

/// A connection parked between requests: everything it holds, without a thread.
struct Parked {
    // In drop order: leases and window back first, then the socket, then the slot.
    leases: HeldLeases,
    window: Option<OwnedWindow>,
    io: FrameIo,
    next_lease: u64,
    unix: bool,
    /// Closed if no request arrives by then.
    deadline: Instant,
    slot: Slot,
}

impl Parkable for Parked {
    fn fd(&self) -> std::os::fd::RawFd {
        self.io.stream().fd()
    }

    fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// A connection that waited this long for its next request gives its thread back (parks).
const PARK_AFTER: Duration = Duration::from_millis(50);

/// The leases a connection holds, by id; given back (and uncounted) when dropped.
struct HeldLeases {
    map: HashMap<u64, ObjectLease>,
    counters: Arc<OwnerCounters>,
}

impl std::ops::Deref for HeldLeases {
    type Target = HashMap<u64, ObjectLease>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::DerefMut for HeldLeases {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

impl Drop for HeldLeases {
    fn drop(&mut self) {
        let n = self.map.len() as u64;
        if n > 0 {
            self.counters.leases_outstanding.fetch_sub(n, Ordering::Relaxed);
        }
        ObjectLease::release_all(std::mem::take(&mut self.map).into_values());
    }
}

/// A connection's put window, counted in `put_window_bytes` until dropped.
struct OwnedWindow {
    window: PutWindow,
    counters: Arc<OwnerCounters>,
}

impl std::ops::Deref for OwnedWindow {
    type Target = PutWindow;
    fn deref(&self) -> &PutWindow {
        &self.window
    }
}

impl Drop for OwnedWindow {
    fn drop(&mut self) {
        self.counters.put_window_bytes.fetch_sub(self.window.len(), Ordering::Relaxed);
    }
}

/// Every open connection (so shutdown can close them) and the slots they hold.
#[derive(Default)]
struct ConnTable {
    /// A duplicate of each connection's socket, to shut it when the grace runs out (None while
    /// it is parked: the poller closes parked connections itself, and an idle connection then
    /// costs one descriptor, not two).
    streams: HashMap<u64, Option<Stream>>,
    authenticated: usize,
    unauthenticated: usize,
}

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

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Owner {
    /// Binds the configured sockets and starts serving `engine`.
    pub fn start(engine: Arc<Engine>, config: OwnerConfig) -> std::result::Result<Owner, OwnerError> {
        validate(&config)?;
        let arena = engine.arena();
        let arena_base = arena.slice(0).map_err(|e| OwnerError::Io(format!("arena: {e}")))?.base().as_ptr() as usize;
        let arena_bytes = arena.len_bytes() as u64;
        let shm_fd = if config.share_arena && config.unix_socket.is_some() {
            // A descriptor of an unsealed memfd could be reopened for writing: never share one.
            match crate::shm::check_sealed(arena.memfd(), arena_bytes)
                .and_then(|()| crate::shm::reopen_read_only(arena.memfd()))
            {
                Ok(fd) => Some(fd),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "NOT sharing the DRAM arena with Unix clients (they get socket copies instead)"
                    );
                    None
                }
            }
        } else {
            None
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
        let shared = Arc::new(Shared {
            wake,
            workers,
            parker,
            budget: Budget::new(&config),
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
            counters,
            config,
        });
        let poller = {
            let shared = Arc::clone(&shared);
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
                        },
                    )
                })
                .map_err(|e| OwnerError::Io(format!("spawn poller: {e}")))?
        };
        let mut listeners = Vec::new();
        let mut unix_path = None;
        if let Some(path) = &shared.config.unix_socket {
            listeners.push(Listener::Unix(bind_unix(path)?));
            unix_path = Some(path.clone());
        }
        let mut tcp_addr = None;
        if let Some(addr) = shared.config.tcp {
            let listener =
                TcpListener::bind(addr).map_err(|source| OwnerError::Bind { what: format!("tcp {addr}"), source })?;
            tcp_addr = Some(listener.local_addr().map_err(|e| OwnerError::Io(e.to_string()))?);
            listeners.push(Listener::Tcp(listener));
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
            arena_bytes,
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

    /// Serves this owner's and its engine's metrics in Prometheus text on `addr` (loopback).
    pub fn serve_metrics(&self, addr: SocketAddr) -> std::io::Result<crate::metrics::MetricsServer> {
        crate::metrics::MetricsServer::start(addr, Arc::clone(&self.shared.engine), Arc::clone(&self.shared.counters))
    }

    /// Stops accepting, lets in-flight requests finish (new ones get `ShuttingDown`), closes
    /// idle connections, and after `shutdown_grace_ms` closes whatever is left. Idempotent; the
    /// engine keeps running (shut it down afterwards).
    pub fn shutdown(&self) {
        let shared = &self.shared;
        let first = !shared.shutting_down.swap(true, Ordering::SeqCst);
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
        self.wait_for_connections();
        self.shared.parker.stop();
        if let Some(poller) = self.poller.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = poller.join();
        }
        if first {
            tracing::info!("kvtide owner stopped serving");
        }
    }

    /// Waits until every connection ended, closing what is left after `shutdown_grace_ms`.
    fn wait_for_connections(&self) {
        let shared = &self.shared;
        let grace = Duration::from_millis(shared.config.shutdown_grace_ms);
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

fn validate(c: &OwnerConfig) -> std::result::Result<(), OwnerError> {
    let bad = |m: String| Err(OwnerError::Config(m));
    if c.unix_socket.is_none() && c.tcp.is_none() {
        return bad("neither a Unix socket nor a TCP address to serve".into());
    }
    if let Some(addr) = c.tcp {
        if c.tcp_token.is_none() {
            if !c.allow_unauthenticated_loopback {
                return bad(format!(
                    "TCP {addr} needs a token (or allow_unauthenticated_loopback on a loopback address)"
                ));
            }
            if !addr.ip().is_loopback() {
                return bad(format!("TCP without a token is only allowed on loopback, not {addr}"));
            }
        }
    }
    if c.max_connections == 0 || c.max_leases_per_connection == 0 || c.max_items == 0 {
        return bad("max_connections, max_leases_per_connection and max_items must be positive".into());
    }
    if c.chunk_bytes < crate::protocol::MIN_CHUNK_BYTES || c.chunk_bytes > c.max_payload_bytes {
        return bad(format!("chunk_bytes = {} must be in 4096..=max_payload_bytes", c.chunk_bytes));
    }
    if c.max_payload_bytes < 64 << 10 || u64::from(c.max_payload_bytes) > c.max_buffered_bytes {
        return bad("max_payload_bytes must be at least 64 KiB and at most max_buffered_bytes".into());
    }
    if c.io_timeout_ms == 0 || c.handshake_timeout_ms == 0 || c.payload_timeout_ms == 0 || c.idle_timeout_ms == 0 {
        return bad("timeouts must be positive".into());
    }
    if c.put_window_bytes != 0 && (c.put_window_bytes < 64 << 10 || c.put_window_bytes > 1 << 34) {
        return bad(format!("put_window_bytes = {} must be 0 or in 64 KiB..=16 GiB", c.put_window_bytes));
    }
    if c.tcp.is_some() && c.max_unauthenticated_connections == 0 {
        return bad("max_unauthenticated_connections must be positive when serving TCP".into());
    }
    let share = c.connection_share_bytes();
    let reserved = share.saturating_mul(c.max_connections as u64);
    if share == 0 || reserved > c.max_buffered_bytes {
        return bad(format!(
            "connection_buffered_bytes = {share} times max_connections = {} must be positive and fit in \
             max_buffered_bytes = {}",
            c.max_connections, c.max_buffered_bytes
        ));
    }
    if c.max_buffered_bytes - reserved < u64::from(c.max_payload_bytes).saturating_sub(share) {
        return bad(format!(
            "max_buffered_bytes = {} leaves too little beyond the connections' shares for one frame of \
             max_payload_bytes = {}",
            c.max_buffered_bytes, c.max_payload_bytes
        ));
    }
    if u64::from(c.lease_ttl_ms) < 2 * c.io_timeout_ms {
        return bad(format!(
            "lease_ttl_ms = {} must be at least twice io_timeout_ms = {} (a chunk send may take that long)",
            c.lease_ttl_ms, c.io_timeout_ms
        ));
    }
    Ok(())
}

fn bind_unix(path: &Path) -> std::result::Result<UnixListener, OwnerError> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(OwnerError::AlreadyRunning(path.to_path_buf()));
        }
        std::fs::remove_file(path)
            .map_err(|source| OwnerError::Bind { what: format!("remove stale socket {}", path.display()), source })?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|source| OwnerError::Bind { what: format!("unix {}", path.display()), source })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|source| OwnerError::Bind { what: format!("chmod 0600 {}", path.display()), source })?;
    Ok(listener)
}

fn accept_loop(shared: &Arc<Shared>, listener: Listener) {
    let fd = match &listener {
        Listener::Unix(l) => l.set_nonblocking(true).map(|()| l.as_raw_fd()),
        Listener::Tcp(l) => l.set_nonblocking(true).map(|()| l.as_raw_fd()),
    };
    let fd = match fd {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(error = %e, "listener setup failed");
            return;
        }
    };
    // Refused connections, oldest first, each kept until its client closed or its time is up.
    let mut lingering: VecDeque<(Stream, Instant)> = VecDeque::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        if shared.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        while lingering.front().is_some_and(|(_, until)| *until <= now) {
            lingering.pop_front();
        }
        fds.clear();
        fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        fds.push(libc::pollfd { fd: shared.wake.fd(), events: libc::POLLIN, revents: 0 });
        fds.extend(lingering.iter().map(|(s, _)| libc::pollfd { fd: s.fd(), events: libc::POLLIN, revents: 0 }));
        let timeout = lingering.front().map(|(_, until)| until.saturating_duration_since(now));
        if let Err(e) = sock::poll(&mut fds, sock::poll_timeout_ms(timeout)) {
            tracing::error!(error = %e, "poll on listener failed");
            return;
        }
        let ready = |p: &libc::pollfd| p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        if ready(&fds[1]) {
            return;
        }
        // A refused client that sent something or closed: read it, and close once it is gone.
        let mut index = 0;
        lingering.retain(|(s, _)| {
            index += 1;
            !(ready(&fds[1 + index]) && sock::drain(s.fd()))
        });
        if !ready(&fds[0]) {
            continue;
        }
        loop {
            let accepted = match &listener {
                Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
                Listener::Tcp(l) => l.accept().map(|(s, _)| {
                    let _ = s.set_nodelay(true);
                    Stream::Tcp(s)
                }),
            };
            match accepted {
                Ok(stream) => {
                    if let Some(refused) = admit(shared, stream) {
                        if lingering.len() >= MAX_LINGERING {
                            lingering.pop_front();
                        }
                        lingering.push_back((refused, Instant::now() + REFUSAL_LINGER));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
    }
}

/// Gives a new connection a slot and a thread, or refuses it with `Busy` (returning the socket
/// to keep for a moment). Never blocks on the peer.
fn admit(shared: &Arc<Shared>, stream: Stream) -> Option<Stream> {
    let accepted_at = Instant::now();
    if stream.set_nonblocking(false).is_err() {
        return None;
    }
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    // The Unix socket's permissions authenticate its peers; TCP peers prove it in the handshake.
    let authenticated = stream.is_unix();
    {
        let mut conns = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        let (open, limit) = if authenticated {
            (conns.authenticated, shared.config.max_connections)
        } else {
            (conns.unauthenticated, shared.config.max_unauthenticated_connections)
        };
        if open >= limit {
            drop(conns);
            shared.counters.connections_refused.fetch_add(1, Ordering::Relaxed);
            return refuse(stream, &StoreError::Busy { limit }.into());
        }
        let Ok(clone) = stream.try_clone() else { return None };
        conns.streams.insert(id, Some(clone));
        if authenticated {
            conns.authenticated += 1;
            shared.counters.connections_open.fetch_add(1, Ordering::Relaxed);
        } else {
            conns.unauthenticated += 1;
            shared.counters.handshakes_open.fetch_add(1, Ordering::Relaxed);
        }
    }
    shared.counters.connections_accepted.fetch_add(1, Ordering::Relaxed);
    let slot = Slot { shared: Arc::clone(shared), id, authenticated };
    if let Err(e) = shared.workers.submit(Job::New { slot, stream, accepted_at }) {
        // The job, and with it the slot, was dropped: the connection is unregistered.
        tracing::warn!(error = %e, "cannot start a connection thread");
    }
    None
}

/// A connection's place in the registry and the slot it holds, given back however its thread
/// ends.
struct Slot {
    shared: Arc<Shared>,
    id: u64,
    /// Holds a connection slot (else an unauthenticated one).
    authenticated: bool,
}

impl Slot {
    /// Trades the unauthenticated slot of a peer that just authenticated for a connection slot;
    /// false (keeping the old one) when none is free.
    fn promote(&mut self) -> bool {
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
    fn park_handle(&self) {
        let mut conns = self.shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(handle) = conns.streams.get_mut(&self.id) {
            *handle = None;
        }
    }

    /// Gives the registry a duplicate of a resumed connection's socket again.
    fn unpark_handle(&self, stream: &Stream) {
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

/// Tells a connection it cannot be served, without blocking: the error goes out with a
/// non-blocking send (a fresh socket has room for it) and the write side is shut. Returns the
/// socket unless the client is already gone: closing it while the client's bytes are unread would
/// reset the connection before the client read the error, so the caller keeps it a moment.
fn refuse(stream: Stream, error: &Error) -> Option<Stream> {
    if stream.set_nonblocking(true).is_err() {
        return None;
    }
    let mut frame = Vec::new();
    let start = begin_frame(&mut frame, Op::Error, 0);
    encode_error_frame(&mut frame, WHOLE_REQUEST, error);
    end_frame(&mut frame, start);
    let _ = sock::send_all(stream.fd(), &[IoSlice::new(&frame)], None);
    stream.shutdown_write();
    (!sock::drain(stream.fd())).then_some(stream)
}

/// Serves a connection on a worker thread until it ends or goes idle (then it is parked).
fn run_job(job: Job) {
    let shared = match &job {
        Job::New { slot, .. } => Arc::clone(&slot.shared),
        Job::Resume(parked) => Arc::clone(&parked.slot.shared),
    };
    let mut conn = match job {
        Job::New { slot, stream, accepted_at } => {
            let unix = stream.is_unix();
            let mut conn = Connection {
                leases: HeldLeases { map: HashMap::new(), counters: Arc::clone(&shared.counters) },
                window: None,
                shared: &shared,
                io: FrameIo::new(stream),
                next_lease: 1,
                puts: HashMap::new(),
                unix,
                slot,
            };
            let handshake = match conn.handshake(accepted_at) {
                Err(WireError::Deadline) => {
                    shared.counters.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                    Err(WireError::Deadline)
                }
                other => other,
            };
            if let Err(e) = handshake {
                end(conn, Err(e));
                return;
            }
            conn
        }
        Job::Resume(p) => {
            p.slot.unpark_handle(p.io.stream());
            Connection {
                leases: p.leases,
                window: p.window,
                shared: &shared,
                io: p.io,
                next_lease: p.next_lease,
                puts: HashMap::new(),
                unix: p.unix,
                slot: p.slot,
            }
        }
    };
    match conn.run() {
        Ok(Outcome::Idle { since }) if conn.puts.is_empty() => {
            let Connection { leases, window, io, next_lease, unix, slot, .. } = conn;
            let idle = Duration::from_millis(shared.config.idle_timeout_ms);
            // Closing releases the leases; the client trusts them until their TTL.
            let idle = if leases.is_empty() {
                idle
            } else {
                idle.max(Duration::from_millis(u64::from(shared.config.lease_ttl_ms)))
            };
            slot.park_handle();
            let parked = Parked { leases, window, io, next_lease, unix, deadline: since + idle, slot };
            shared.parker.park(parked);
        }
        Ok(_) => end(conn, Ok(())),
        Err(WireError::Deadline) => {
            shared.counters.payload_timeouts.fetch_add(1, Ordering::Relaxed);
            end(conn, Err(WireError::Deadline));
        }
        Err(e) => end(conn, Err(e)),
    }
}

/// Ends a connection: its socket is shut, then everything it holds is given back.
fn end(conn: Connection<'_>, result: WResult<()>) {
    match result {
        Ok(()) | Err(WireError::Closed(_)) => {}
        Err(e) => tracing::debug!(error = ?e, "connection ended"),
    }
    conn.io.stream().shutdown();
}

struct Connection<'s> {
    // In drop order: leases and window back first, then the socket, open puts, the slot.
    leases: HeldLeases,
    /// The put window, once the client asked for one (its bytes count in the gauge).
    window: Option<OwnedWindow>,
    shared: &'s Arc<Shared>,
    io: FrameIo,
    next_lease: u64,
    /// Open progressive puts by stream id (the `PutOpen` request id); dropped (aborted) with
    /// the connection, so a client that disconnects makes their readers fail. A connection
    /// with open puts keeps its thread (it is never parked).
    puts: HashMap<u64, PutStream<'s>>,
    unix: bool,
    slot: Slot,
}

/// How a connection's run ended without an error.
enum Outcome {
    /// Closed (by the peer, a `Close` flow, the idle timeout or shutdown).
    Done,
    /// No request for `PARK_AFTER`: it may be parked; `since` is when it went idle.
    Idle { since: Instant },
}

/// Whether a connection goes on after a request.
#[derive(PartialEq, Eq)]
enum Flow {
    Continue,
    Close,
}

impl Connection<'_> {
    fn config(&self) -> &OwnerConfig {
        &self.shared.config
    }

    fn ttl(&self) -> Duration {
        Duration::from_millis(u64::from(self.config().lease_ttl_ms))
    }

    /// Queues an error for `index` (or the whole request).
    fn push_error(&mut self, op: Op, request_id: u64, index: u32, error: &Error) {
        let start = self.io.begin(op, request_id);
        encode_error_frame(self.io.out(), index, error);
        self.io.end(start);
    }

    fn reply(&mut self, request_id: u64, result: Result<()>) {
        match result {
            Ok(()) => self.io.push_frame(Op::Ok, request_id, &[]),
            Err(e) => self.push_error(Op::Error, request_id, WHOLE_REQUEST, &e),
        }
    }

    /// Sends an error about the connection itself, best effort, before closing it.
    fn fatal(&mut self, request_id: u64, error: &Error) {
        self.shared.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%error, "closing a connection after a protocol error");
        self.push_error(Op::Error, request_id, WHOLE_REQUEST, error);
        let _ = self.io.flush();
    }

    /// Re-arms the read deadline: what is read next must arrive within `payload_timeout_ms`.
    fn arm_read_deadline(&mut self) {
        let timeout = Duration::from_millis(self.config().payload_timeout_ms);
        self.io.set_read_deadline(Some(Instant::now() + timeout));
    }

    /// How long this connection may wait for its next request.
    fn idle_timeout(&self) -> Duration {
        let idle = Duration::from_millis(self.config().idle_timeout_ms);
        // Closing releases the leases; the client trusts them until their TTL.
        if self.leases.is_empty() {
            idle
        } else {
            idle.max(self.ttl())
        }
    }

    /// Answers `Busy` when an authenticated TCP peer finds no free connection slot.
    fn refuse_slot(&mut self, request_id: u64) -> WResult<()> {
        self.shared.counters.connections_refused.fetch_add(1, Ordering::Relaxed);
        let limit = self.config().max_connections;
        self.push_error(Op::Error, request_id, WHOLE_REQUEST, &StoreError::Busy { limit }.into());
        self.io.flush()?;
        Err(WireError::Closed("no free connection slot".into()))
    }

    /// Hello (and for TCP with a token, authentication), all within `handshake_timeout_ms` of
    /// the accept, however the peer spaces its bytes.
    fn handshake(&mut self, accepted_at: Instant) -> WResult<()> {
        let timeout = Duration::from_millis(self.config().handshake_timeout_ms);
        self.io.set_read_deadline(Some(accepted_at + timeout));
        self.io.stream().set_timeouts(Some(timeout))?;
        let hello_limits = Limits { max_payload_bytes: 4096, ..self.shared.limits };
        let header = match self.io.read_header(&hello_limits) {
            Ok(h) => h,
            Err(WireError::Protocol(p)) => {
                self.fatal(0, &p.clone().into());
                return Err(WireError::Protocol(p));
            }
            Err(e) => return Err(e),
        };
        if header.op != Op::Hello {
            let e = ProtocolError::Unexpected { expected: "hello", got: header.op };
            self.fatal(header.request_id, &e.clone().into());
            return Err(e.into());
        }
        let payload = self.io.read_payload(header.payload_len)?;
        let hello = match Hello::decode(&payload) {
            Ok(h) => h,
            Err(e) => {
                self.fatal(header.request_id, &e.clone().into());
                return Err(e.into());
            }
        };
        let mut server_nonce = [0u8; NONCE_BYTES];
        sock::random_bytes(&mut server_nonce)?;
        let auth = if self.unix { None } else { self.config().tcp_token.clone() };
        if auth.is_none() && !self.slot.promote() {
            return self.refuse_slot(header.request_id);
        }
        let shm = self.unix && hello.flags & HELLO_WANT_SHM != 0 && self.shared.shm_fd.is_some();
        let mut flags = 0;
        if auth.is_some() {
            flags |= HELLO_AUTH_REQUIRED;
        }
        if shm {
            flags |= HELLO_SHM_ATTACHED;
        }
        let reply = HelloOk {
            flags,
            max_payload_bytes: self.config().max_payload_bytes,
            chunk_bytes: self.config().chunk_bytes,
            max_items: self.config().max_items,
            max_leases: self.config().max_leases_per_connection,
            lease_ttl_ms: self.config().lease_ttl_ms,
            max_key_bytes: self.shared.limits.max_key_bytes,
            max_value_bytes: self.shared.limits.max_value_bytes,
            server_nonce,
            instance_id: self.shared.instance_id,
            arena_bytes: if shm { self.shared.arena_bytes } else { 0 },
        };
        let start = self.io.begin(Op::HelloOk, header.request_id);
        reply.encode(self.io.out());
        self.io.end(start);
        match auth {
            None => {
                let fd = if shm { self.shared.shm_fd.as_ref().map(|fd| fd.as_fd()) } else { None };
                self.io.flush_with_fd(fd)?;
            }
            Some(token) => {
                self.io.flush()?;
                let h = self.io.read_header(&hello_limits)?;
                if h.op != Op::Auth || h.payload_len as usize != MAC_BYTES {
                    self.shared.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
                    self.fatal(h.request_id, &Error::Unauthorized("expected an authentication proof".into()));
                    return Err(WireError::Closed("no authentication".into()));
                }
                let mut proof = [0u8; MAC_BYTES];
                self.io.read_exact(&mut proof)?;
                if !token.verify_client(&server_nonce, &hello.client_nonce, &proof) {
                    self.shared.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("TCP client failed authentication (wrong token)");
                    self.fatal(h.request_id, &Error::Unauthorized("wrong token".into()));
                    return Err(WireError::Closed("wrong token".into()));
                }
                if !self.slot.promote() {
                    return self.refuse_slot(h.request_id);
                }
                let owner_proof = token.owner_proof(&hello.client_nonce, &server_nonce);
                self.io.push_frame(Op::AuthOk, h.request_id, &owner_proof);
                self.io.flush()?;
            }
        }
        self.io.set_read_deadline(None);
        let io_timeout = Duration::from_millis(self.config().io_timeout_ms);
        self.io.stream().set_timeouts(Some(io_timeout))?;
        self.io.set_spin(Duration::from_micros(self.config().spin_us));
        Ok(())
    }

    fn run(&mut self) -> WResult<Outcome> {
        loop {
            self.io.set_read_deadline(None);
            if !self.io.spin_for_input()? {
                // Without open puts, a connection that stays idle gives its thread back.
                let since = Instant::now();
                let parkable = self.puts.is_empty();
                let wait = if parkable { PARK_AFTER.min(self.idle_timeout()) } else { self.idle_timeout() };
                let (readable, woken) = sock::wait_readable(
                    self.io.stream().fd(),
                    self.shared.wake.fd(),
                    sock::poll_timeout_ms(Some(wait)),
                )?;
                if woken && !readable {
                    return Ok(Outcome::Done);
                }
                if !readable && parkable && wait < self.idle_timeout() {
                    return Ok(Outcome::Idle { since });
                }
                if !readable {
                    self.shared.counters.idle_closed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("closing an idle connection");
                    return Ok(Outcome::Done);
                }
            }
            // From a frame's first byte, the whole frame must arrive in time.
            self.arm_read_deadline();
            let header = match self.io.read_header(&self.shared.limits) {
                Ok(h) => h,
                Err(WireError::Protocol(p)) => {
                    self.fatal(0, &p.clone().into());
                    return Err(WireError::Protocol(p));
                }
                Err(e) => return Err(e),
            };
            self.shared.counters.requests.fetch_add(1, Ordering::Relaxed);
            let shutting = self.shared.shutting_down.load(Ordering::SeqCst);
            let started = Instant::now();
            let op = header.op;
            let flow = self.handle(header, shutting)?;
            if self.io.pending_out() > 0 {
                self.io.flush()?;
            }
            self.shared.counters.latency.record(op, started.elapsed());
            if flow == Flow::Close || (shutting && self.io.buffered() == 0) {
                return Ok(Outcome::Done);
            }
        }
    }

    fn handle(&mut self, header: FrameHeader, shutting: bool) -> WResult<Flow> {
        let rid = header.request_id;
        match header.op {
            Op::Put => return self.put(header, shutting),
            Op::PutChunk => return self.put_chunk(header),
            Op::Data => {
                self.fatal(rid, &Error::Protocol("data frame outside a put".into()));
                return Ok(Flow::Close);
            }
            _ => {}
        }
        // Small requests are read whole, within the connection's share of the buffer budget
        // (and the shared pool beyond it). Pool bytes come back within a payload deadline (or
        // when a request is done), so waiting longer than that would not help.
        let wait = Duration::from_millis(self.config().payload_timeout_ms);
        let permit =
            self.shared.budget.acquire(u64::from(header.payload_len), wait, &self.shared.counters.buffered_bytes);
        self.arm_read_deadline();
        let Some(_permit) = permit else {
            self.io.skip(header.payload_len.into())?;
            self.shared.counters.busy_replies.fetch_add(1, Ordering::Relaxed);
            let limit = self.config().max_buffered_bytes as usize;
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &StoreError::Busy { limit }.into());
            return Ok(Flow::Continue);
        };
        let payload = self.io.read_payload(header.payload_len)?;
        let request = match Request::decode(header.op, &payload, &self.shared.limits) {
            Ok(r) => r,
            Err(e) => {
                // The frame was read whole, so the stream is still in sync: answer and go on.
                self.shared.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                self.push_error(Op::Error, rid, WHOLE_REQUEST, &e.into());
                return Ok(Flow::Continue);
            }
        };
        if shutting && !matches!(request, Request::Release { .. }) {
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &StoreError::ShuttingDown.into());
            return Ok(Flow::Close);
        }
        let engine = Arc::clone(&self.shared.engine);
        match request {
            Request::Hello(_) | Request::Auth { .. } => {
                self.push_error(Op::Error, rid, WHOLE_REQUEST, &Error::Protocol("handshake already done".into()));
            }
            Request::Get { lease: false, items } => self.stream_get(rid, &items)?,
            Request::Get { lease: true, items } => self.grant(rid, &items),
            Request::GetParts { items } => return self.grant_parts(rid, &items),
            Request::GetRanges { keys, fragments } => self.stream_ranges(rid, &keys, &fragments)?,
            Request::Exists { keys } => {
                let found: Vec<Result<bool>> =
                    engine.batch_exists(&keys).into_iter().map(|r| r.map_err(Error::from)).collect();
                let start = self.io.begin(Op::ExistsReply, rid);
                encode_exists(self.io.out(), &found);
                self.io.end(start);
            }
            Request::Remove { key, force } => self.reply(rid, engine.remove(key, force).map_err(Error::from)),
            Request::RemoveBatch { keys, force } => {
                self.count_batch(keys.len());
                let statuses: Vec<Result<()>> =
                    engine.batch_remove(&keys, force).into_iter().map(|r| r.map_err(Error::from)).collect();
                let start = self.io.begin(Op::Statuses, rid);
                encode_statuses(self.io.out(), &statuses);
                self.io.end(start);
            }
            Request::PutBatch { upsert, pin, window, items } => {
                return self.put_batch(rid, PutOptions { upsert, pin }, window, &items);
            }
            Request::PutWindow => self.open_window(rid)?,
            Request::Pin { key } => self.reply(rid, engine.pin(key).map_err(Error::from)),
            Request::Unpin { key } => self.reply(rid, engine.unpin(key).map_err(Error::from)),
            Request::Stats => match toml::to_string(&{
                // Releases are one-way messages: once the shards handled what was sent before
                // this request, the gauges count every call answered before it. A shard that
                // is gone has nothing left to handle.
                let _ = engine.sync_shards();
                engine.stats()
            }) {
                Ok(text) => self.io.push_frame(Op::StatsReply, rid, text.as_bytes()),
                Err(e) => self.push_error(Op::Error, rid, WHOLE_REQUEST, &Error::Remote(format!("stats: {e}"))),
            },
            Request::PutOpen { key, total_len, chunk_bytes, upsert, pin } => {
                self.put_open(rid, key, total_len, chunk_bytes, PutOptions { upsert, pin })
            }
            Request::PutSeal { stream } => {
                let result = match self.puts.get_mut(&stream) {
                    None => Err(unknown_put(stream)),
                    Some(put) => put.seal().map_err(Error::from),
                };
                // A seal refused for missing chunks leaves the put open; otherwise it is over.
                if !matches!(result, Err(Error::Store(StoreError::InvalidArgument(_)))) {
                    self.puts.remove(&stream);
                }
                self.reply(rid, result);
            }
            Request::GetFollow { key } => self.follow_get(rid, key)?,
            Request::PutAbort { stream } => {
                if let Some(put) = self.puts.remove(&stream) {
                    put.abort();
                }
                self.reply(rid, Ok(()));
            }
            Request::Release { leases } => self.release(leases),
            Request::ScanKeys { prefix, cursor, limit } => {
                // A page must fit one reply frame.
                let limits = &self.shared.limits;
                let per_key = 2 + limits.max_key_bytes as usize;
                let fit = ((limits.max_payload_bytes as usize).saturating_sub(16) / per_key).max(1);
                match engine.scan_keys(prefix, cursor, (limit as usize).min(fit)) {
                    Ok(page) => {
                        let start = self.io.begin(Op::KeyPage, rid);
                        encode_key_page(self.io.out(), &page);
                        self.io.end(start);
                    }
                    Err(e) => self.push_error(Op::Error, rid, WHOLE_REQUEST, &e.into()),
                }
            }
        }
        Ok(Flow::Continue)
    }

    /// A lease-mode `Get`: the items leased to this connection until released. On a connection
    /// with the arena mapped, the client copies from the granted ranges; elsewhere (TCP, or a
    /// Unix client without the mapping) a lease only holds the object in place (a client's hold,
    /// bounded like every lease) and its grant carries the length with offset 0: a connection
    /// that cannot map the arena learns nothing of where objects lie in it.
    fn grant(&mut self, rid: u64, items: &[GetItem<'_>]) {
        let mapped = self.check_shared().is_ok();
        let all: Vec<usize> = (0..items.len()).collect();
        let grants: Vec<Result<Grant>> = self
            .lease_items(items, &all)
            .into_iter()
            .map(|(_, g)| g.map(|g| if mapped { g } else { Grant { offset: 0, ..g } }))
            .collect();
        let ttl_ms = self.config().lease_ttl_ms;
        let start = self.io.begin(Op::Grants, rid);
        encode_grants(self.io.out(), ttl_ms, &grants);
        self.io.end(start);
    }

    fn check_shared(&self) -> std::result::Result<(), StoreError> {
        if !self.unix || self.shared.shm_fd.is_none() {
            return Err(StoreError::InvalidArgument("no shared memory here".into()));
        }
        Ok(())
    }

    /// Leases `items[i]` for each `i` in `indices`, together (one request per shard, so
    /// SSD-resident keys load side by side), within the connection's lease limit (past it:
    /// `Busy`), and records the leases. Per index, its grant or error.
    fn lease_items(&mut self, items: &[GetItem<'_>], indices: &[usize]) -> Vec<(u32, Result<Grant>)> {
        let engine = Arc::clone(&self.shared.engine);
        let max = self.config().max_leases_per_connection as usize;
        let room = max.saturating_sub(self.leases.len()).min(indices.len());
        let keys: Vec<&[u8]> = indices[..room].iter().map(|&i| items[i].key).collect();
        let mut leased = engine.lease_batch(&keys, u64::from(self.config().lease_ttl_ms)).into_iter();
        let mut grants = Vec::with_capacity(indices.len());
        for &i in indices {
            let item = &items[i];
            let Some(lease) = leased.next() else {
                self.shared.counters.busy_replies.fetch_add(1, Ordering::Relaxed);
                grants.push((i as u32, Err(StoreError::Busy { limit: max }.into())));
                continue;
            };
            let granted = lease.and_then(|lease| {
                item.check.check(lease.len())?;
                let offset = self.offset_of(&lease)?;
                Ok((lease, offset))
            });
            match granted {
                Ok((lease, offset)) => {
                    let id = self.next_lease;
                    self.next_lease += 1;
                    let len = lease.len();
                    self.leases.insert(id, lease);
                    self.shared.counters.leases_granted.fetch_add(1, Ordering::Relaxed);
                    self.shared.counters.leases_outstanding.fetch_add(1, Ordering::Relaxed);
                    grants.push((i as u32, Ok(Grant { lease: id, offset, len })));
                }
                Err(e) => grants.push((i as u32, Err(e.into()))),
            }
        }
        grants
    }

    /// `GetParts`: the items leased part by part as the engine's restore pipeline splits them
    /// (DRAM-resident first, then SSD-resident sub-batches, shards interleaved), one
    /// `GrantsPart` each. Before leasing a part the owner waits until the client released all
    /// but `PARTS_HELD - 1` of the parts it holds, so a batch larger than DRAM streams through
    /// it while the next part loads as the client copies the last one.
    fn grant_parts(&mut self, rid: u64, items: &[GetItem<'_>]) -> WResult<Flow> {
        if let Err(e) = self.check_shared() {
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &e.into());
            return Ok(Flow::Continue);
        }
        self.count_batch(items.len());
        let engine = Arc::clone(&self.shared.engine);
        let keys: Vec<&[u8]> = items.iter().map(|i| i.key).collect();
        // One key is planned (asked where it lives) only when it is a size query: an item with
        // no room, answered without a load.
        let misfit = |i: usize, len: u64| items[i].check.check(len).err();
        let probe = matches!(items, [item] if matches!(item.check, LenCheck::Exactly(0) | LenCheck::AtMost(0)));
        let plan = engine.lease_parts(
            &keys,
            (items.len() > 1 || probe).then_some(&misfit as &dyn Fn(usize, u64) -> Option<StoreError>),
        );
        // A key that finds no room beside the parts held is leased again at the end, in a part
        // of its own (`alone`) once the client holds nothing.
        let mut parts = shape_parts(plan.parts, engine.shard_count());
        if parts.is_empty() {
            parts.push(Part { keys: Vec::new(), in_dram: true, alone: false });
        }
        // Keys whose objects cannot fit their destinations: answered in the first part, unloaded.
        let mut refused: Vec<(u32, Result<Grant>)> =
            plan.refused.into_iter().map(|(i, e)| (i as u32, Err(e.into()))).collect();
        let ttl_ms = self.config().lease_ttl_ms;
        // Lease ids of the parts the client holds, oldest first, and whether each is
        // DRAM-resident: those may pin most of DRAM, so no SSD-resident part is leased (loaded)
        // while the client holds one.
        let mut held: VecDeque<(Vec<u64>, bool)> = VecDeque::new();
        let must_wait = |held: &VecDeque<(Vec<u64>, bool)>, next: &Part| {
            held.len() >= PARTS_HELD
                || (!next.in_dram && held.iter().any(|(_, dram)| *dram))
                || (next.alone && !held.is_empty())
        };
        let mut p = 0;
        while p < parts.len() {
            while must_wait(&held, &parts[p]) {
                if !self.await_release(rid, &mut held)? {
                    return Ok(Flow::Close);
                }
            }
            let (in_dram, alone) = (parts[p].in_dram, parts[p].alone);
            let mut grants = self.lease_items(items, &parts[p].keys);
            if !alone {
                let no_room = |g: &Result<Grant>| matches!(g, Err(e) if e.as_store() == Some(&StoreError::NoSpace));
                for &(i, _) in grants.iter().filter(|(_, g)| no_room(g)) {
                    parts.push(Part { keys: vec![i as usize], in_dram: false, alone: true });
                }
                grants.retain(|(_, g)| !no_room(g));
            }
            grants.append(&mut refused);
            let ids: Vec<u64> = grants.iter().filter_map(|(_, g)| g.as_ref().ok().map(|g| g.lease)).collect();
            // The client may keep this part while it waits for the next when this part alone
            // would not hold the next one up.
            let next = match parts.get(p + 1) {
                None => NextPart::None,
                Some(following) if must_wait(&VecDeque::from([(ids.clone(), in_dram)]), following) => {
                    NextPart::AfterRelease
                }
                Some(_) => NextPart::WhileHeld,
            };
            let start = self.io.begin(Op::GrantsPart, rid);
            GrantsPart { ttl_ms, next, grants }.encode(self.io.out());
            self.io.end(start);
            self.io.flush()?;
            if !ids.is_empty() {
                held.push_back((ids, in_dram));
            }
            p += 1;
        }
        Ok(Flow::Continue)
    }

    /// Reads the client's next frame, which must release leases of the parts it holds (the
    /// client sends nothing else before the last part), and forgets the parts it released.
    /// False after a protocol violation (answered; the connection closes).
    fn await_release(&mut self, rid: u64, held: &mut VecDeque<(Vec<u64>, bool)>) -> WResult<bool> {
        // A client that neither copies nor goes away keeps its parts at most a lease TTL.
        self.io.set_read_deadline(Some(Instant::now() + self.ttl()));
        let h = match self.io.read_header(&self.shared.limits) {
            Ok(h) => h,
            Err(WireError::Protocol(p)) => {
                self.fatal(rid, &p.into());
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        if h.op != Op::Release {
            self.fatal(rid, &Error::Protocol("a request arrived before the parts of a get were released".into()));
            return Ok(false);
        }
        self.arm_read_deadline();
        let payload = self.io.read_payload(h.payload_len)?;
        let leases = match Request::decode(Op::Release, &payload, &self.shared.limits) {
            Ok(Request::Release { leases }) => leases,
            _ => {
                self.fatal(rid, &Error::Protocol("malformed release".into()));
                return Ok(false);
            }
        };
        self.release(leases);
        for (part, _) in held.iter_mut() {
            part.retain(|id| self.leases.contains_key(id));
        }
        held.retain(|(part, _)| !part.is_empty());
        Ok(true)
    }

    /// Gives back the leases `ids` names (unknown ids are counted, not trusted).
    fn release(&mut self, ids: Vec<u64>) {
        let mut released = Vec::with_capacity(ids.len());
        for id in ids {
            match self.leases.remove(&id) {
                Some(lease) => released.push(lease),
                None => {
                    self.shared.counters.unknown_releases.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.shared.counters.leases_outstanding.fetch_sub(released.len() as u64, Ordering::Relaxed);
        ObjectLease::release_all(released);
    }

    fn count_batch(&self, items: usize) {
        self.shared.counters.batch_requests.fetch_add(1, Ordering::Relaxed);
        self.shared.counters.batch_items.fetch_add(items as u64, Ordering::Relaxed);
    }

    /// `PutWindow`: a sealed memfd for this connection, within the owners' total.
    fn open_window(&mut self, rid: u64) -> WResult<()> {
        let bytes = self.config().put_window_bytes;
        if !self.unix || bytes == 0 {
            let e = StoreError::InvalidArgument("this owner gives no put window here".into());
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &e.into());
            return Ok(());
        }
        if self.window.is_some() {
            let e = StoreError::InvalidArgument("this connection already has a put window".into());
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &e.into());
            return Ok(());
        }
        let max = self.config().max_put_window_bytes;
        let gauge = &self.shared.counters.put_window_bytes;
        if gauge.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes) > max {
            gauge.fetch_sub(bytes, Ordering::Relaxed);
            self.shared.counters.put_windows_refused.fetch_add(1, Ordering::Relaxed);
            let limit = usize::try_from(max).unwrap_or(usize::MAX);
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &StoreError::Busy { limit }.into());
            return Ok(());
        }
        match PutWindow::create(bytes) {
            Ok((window, fd)) => {
                // Counted from here on; the connection's drop gives the bytes back.
                self.window = Some(OwnedWindow { window, counters: Arc::clone(&self.shared.counters) });
                self.io.push_frame(Op::Window, rid, &bytes.to_le_bytes());
                self.io.flush_with_fd(Some(fd.as_fd()))?;
            }
            Err(e) => {
                gauge.fetch_sub(bytes, Ordering::Relaxed);
                let e = StoreError::Io(format!("cannot create a put window: {e}"));
                self.push_error(Op::Error, rid, WHOLE_REQUEST, &e.into());
            }
        }
        Ok(())
    }

    /// `PutBatch`: every value reserved at once (one request per shard), filled from the put
    /// window or from the `Data` frames that follow, and published at once; one `Statuses`
    /// reply. A value that cannot be read fails only its own item.
    fn put_batch(&mut self, rid: u64, opts: PutOptions, window: bool, items: &[PutItem<'_>]) -> WResult<Flow> {
        self.count_batch(items.len());
        if window && self.window.is_none() {
            // Nothing follows a window batch, so the stream is in sync: answer and go on.
            let e = StoreError::InvalidArgument("no put window on this connection".into());
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &e.into());
            return Ok(Flow::Continue);
        }
        let engine = Arc::clone(&self.shared.engine);
        let sizes: Vec<(&[u8], u64)> = items.iter().map(|i| (i.key, i.len)).collect();
        let mut pending = engine.reserve_puts(&sizes, opts);
        let mut failed: Vec<Option<Error>> = vec![None; items.len()];
        for (i, item) in items.iter().enumerate() {
            if let Some(w) = self.window.as_ref().filter(|_| window) {
                if let Ok(dst) = pending.bytes_mut(i) {
                    if let Err(e) = w.read(item.window_offset, dst) {
                        failed[i] = Some(e.into());
                    }
                }
                continue;
            }
            // The value's frames follow: into the reservation, or read and dropped.
            let mut filled = 0u64;
            while filled < item.len {
                let Some(n) = self.next_data(rid, item.len - filled)? else { return Ok(Flow::Close) };
                match pending.bytes_mut(i) {
                    Ok(dst) => self.io.read_exact(&mut dst[filled as usize..(filled + n) as usize])?,
                    Err(_) => self.io.skip(n)?,
                }
                filled += n;
            }
        }
        let statuses: Vec<Result<()>> = pending
            .commit(|i| failed[i].is_none())
            .into_iter()
            .zip(failed)
            .map(|(committed, failed)| match failed {
                Some(e) => Err(e),
                None => committed.map_err(Error::from),
            })
            .collect();
        let start = self.io.begin(Op::Statuses, rid);
        encode_statuses(self.io.out(), &statuses);
        self.io.end(start);
        Ok(Flow::Continue)
    }

    /// Where a leased object starts within the shared arena.
    fn offset_of(&self, lease: &ObjectLease) -> Result<u64, StoreError> {
        if lease.is_empty() {
            return Ok(0);
        }
        let ptr = lease.bytes()?.as_ptr() as usize;
        let offset =
            ptr.checked_sub(self.shared.arena_base).ok_or(StoreError::Internal("lease outside the arena"))? as u64;
        match offset.checked_add(lease.len()) {
            Some(end) if end <= self.shared.arena_bytes => Ok(offset),
            _ => Err(StoreError::Internal("lease outside the arena")),
        }
    }

    /// `Get` in stream mode: per key an `Object` and its bytes in `Data` frames, or an `Error`,
    /// in the order `lease_each_streamed` leases them.
    fn stream_get(&mut self, rid: u64, items: &[GetItem<'_>]) -> WResult<()> {
        let keys: Vec<&[u8]> = items.iter().map(|i| i.key).collect();
        let misfit = |i: usize, len: u64| items[i].check.check(len).err();
        self.lease_each_streamed(&keys, Some(&misfit), |this, i, leased, leased_at| {
            this.send_leased(rid, i as u32, &items[i], leased, leased_at)
        })?;
        self.io.push_frame(Op::End, rid, &[]);
        Ok(())
    }

    /// Leases each of `keys` for a streamed answer and hands it to `send` (its index, its lease
    /// or error, when the lease was taken), which sends it and drops the lease. DRAM-resident
    /// keys go first, in order, each leased without a message as it is sent; the others are
    /// leased in the engine's restore parts (`lease_parts`), each part in one request per shard
    /// so its loads run side by side, and the next part's loads start while this part is sent
    /// (two parts held at most, as `GetParts` holds them).
    fn lease_each_streamed(
        &mut self,
        keys: &[&[u8]],
        misfit: Option<&dyn Fn(usize, u64) -> Option<StoreError>>,
        mut send: impl FnMut(&mut Self, usize, &Result<ObjectLease, StoreError>, Instant) -> WResult<()>,
    ) -> WResult<()> {
        let engine = Arc::clone(&self.shared.engine);
        let ttl_ms = u64::from(self.config().lease_ttl_ms);
        // The keys to load, each once (a key asked for twice is leased once): the first index
        // of each, and every index that asked for it.
        let mut loading: Vec<usize> = Vec::new();
        let mut asked: Vec<Vec<usize>> = Vec::new();
        let mut seen: HashMap<&[u8], usize> = HashMap::new();
        for (index, key) in keys.iter().enumerate() {
            let leased_at = Instant::now();
            let leased = match engine.lease_resident(key, ttl_ms) {
                Some(leased) => leased,
                // One key with nothing to refuse is leased at once; others are planned.
                None if keys.len() == 1 && misfit.is_none() => engine.lease_progressive(key, ttl_ms),
                None => {
                    match seen.entry(*key) {
                        std::collections::hash_map::Entry::Occupied(at) => asked[*at.get()].push(index),
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(loading.len());
                            loading.push(index);
                            asked.push(vec![index]);
                        }
                    }
                    continue;
                }
            };
            send(self, index, &leased, leased_at)?;
        }
        if loading.is_empty() {
            return Ok(());
        }
        // Every index that asked for the key planned at `k`, answered with one lease.
        let mut answer = |this: &mut Self, k: usize, leased: Result<ObjectLease, StoreError>, leased_at: Instant| {
            asked[k].iter().try_for_each(|&index| send(this, index, &leased, leased_at))
        };
        // Chunk sends must start before the TTL less the I/O timeout (`stream_chunks`).
        let window_ms = ttl_ms.saturating_sub(self.config().io_timeout_ms);
        let stale_after = Duration::from_millis(window_ms / 4);
        let part_keys: Vec<&[u8]> = loading.iter().map(|&i| keys[i]).collect();
        let refuse = misfit.map(|m| move |k: usize, len: u64| m(loading[k], len));
        let plan =
            engine.lease_parts(&part_keys, refuse.as_ref().map(|r| r as &dyn Fn(usize, u64) -> Option<StoreError>));
        // Keys whose objects cannot fit their destinations: answered without a load.
        for (k, e) in plan.refused {
            answer(self, k, Err(e), Instant::now())?;
        }
        let parts = shape_parts(plan.parts, engine.shard_count());
        // A part's leases, each with the key it answers (its place in `loading`), when it was
        // asked for (the lease's TTL counts from there) and when it was granted (its wait for
        // its turn counts from there). DRAM-resident (or missing) parts are not leased ahead:
        // their keys are leased as they are sent.
        let lease_part = |part: &Part| -> Option<Vec<LeasedItem>> {
            if part.in_dram {
                return None;
            }
            let these: Vec<&[u8]> = part.keys.iter().map(|&k| part_keys[k]).collect();
            let leased_at = Instant::now();
            let leased = engine.lease_batch_progressive(&these, ttl_ms);
            let granted_at = Instant::now();
            Some(part.keys.iter().zip(leased).map(|(&k, l)| (k, l, leased_at, granted_at)).collect())
        };
        // A key leased now, on its own.
        let lease_now = |k: usize| (engine.lease_progressive(part_keys[k], ttl_ms), Instant::now());
        // Keys that found no room (or no lease slot) beside the parts held: leased alone at the
        // end.
        let mut alone = Vec::new();
        let mut parts = parts.iter();
        let mut next = parts.next().map(|p| (p, lease_part(p)));
        while let Some((part, leased)) = next.take() {
            // The next part loads while this one is sent.
            next = parts.next().map(|p| (p, lease_part(p)));
            let leased: Vec<LeasedItem> = match leased {
                Some(leased) => leased,
                None => part
                    .keys
                    .iter()
                    .map(|&k| {
                        let (leased, at) = lease_now(k);
                        (k, leased, at, at)
                    })
                    .collect(),
            };
            for (k, leased, leased_at, granted_at) in leased {
                // A lease granted so long ago (a slow reader) that a quarter of its sending
                // window is gone: this key is leased again.
                let stale = granted_at.elapsed() > stale_after;
                let (leased, leased_at) = match leased {
                    Ok(lease) if stale => {
                        drop(lease);
                        lease_now(k)
                    }
                    other => (other, leased_at),
                };
                // No room, or a shard out of lease slots, beside what this request holds.
                if matches!(leased, Err(StoreError::NoSpace | StoreError::Busy { .. })) {
                    alone.push(k);
                    continue;
                }
                answer(self, k, leased, leased_at)?;
            }
        }
        for k in alone {
            let (leased, leased_at) = lease_now(k);
            answer(self, k, leased, leased_at)?;
        }
        Ok(())
    }

    /// One item of a streamed `Get`: its `Object` frame and bytes, or its `Error`. Every byte is
    /// in the write buffer or on the socket when it returns (the caller then drops the lease).
    fn send_leased(
        &mut self,
        rid: u64,
        index: u32,
        item: &GetItem<'_>,
        leased: &Result<ObjectLease, StoreError>,
        leased_at: Instant,
    ) -> WResult<()> {
        let lease =
            match leased.as_ref().map_err(Clone::clone).and_then(|lease| item.check.check(lease.len()).map(|()| lease))
            {
                Ok(lease) => lease,
                Err(e) => {
                    self.push_error(Op::Error, rid, index, &e.into());
                    return Ok(());
                }
            };
        let start = self.io.begin(Op::Object, rid);
        encode_object(self.io.out(), index, lease.len());
        self.io.end(start);
        // Sent in order: an SSD-resident object's frames go out as its load's checked front
        // passes them.
        self.stream_bytes(rid, index, lease, leased_at, 0, lease.len())?;
        if self.io.pending_out() >= FLUSH_BYTES {
            self.io.flush()?;
        }
        Ok(())
    }

    /// `GetFollow`: a key's unsealed progressive put streamed as its chunks land (`Object`,
    /// `Data` frames, `End`; an `Abort` with `ProducerAborted` when the producer goes away), or
    /// a plain streamed get when no put of the key is open.
    fn follow_get(&mut self, rid: u64, key: &[u8]) -> WResult<()> {
        let engine = Arc::clone(&self.shared.engine);
        let following = match engine.follow_unsealed(key) {
            Ok(Some(f)) => f,
            Ok(None) => return self.stream_get(rid, &[GetItem { key, check: LenCheck::Any }]),
            Err(e) => {
                self.push_error(Op::Error, rid, 0, &e.into());
                self.io.push_frame(Op::End, rid, &[]);
                return Ok(());
            }
        };
        let start = self.io.begin(Op::Object, rid);
        encode_object(self.io.out(), 0, following.len());
        self.io.end(start);
        self.io.flush()?;
        // Frames never span two of the producer's chunks, so each goes out as soon as its chunk
        // landed.
        let frame = u64::from(self.config().chunk_bytes).min(following.chunk_bytes()).max(1);
        let produced = following.chunk_bytes().max(1);
        let mut pos = 0;
        while pos < following.len() {
            let chunk_end = (pos / produced + 1).saturating_mul(produced);
            let n = frame.min(following.len() - pos).min(chunk_end - pos);
            // The wait is bounded by the put's TTL (an expired put ends) and the owner's shutdown
            // (which ends every open put).
            let landed = loop {
                match following.wait_landed(pos..pos + n, FOLLOW_WAIT_MS) {
                    Ok(true) => break Ok(()),
                    Ok(false) if self.shared.shutting_down.load(Ordering::SeqCst) => {
                        break Err(StoreError::ShuttingDown)
                    }
                    Ok(false) => continue,
                    Err(e) => break Err(e),
                }
            };
            let bytes = landed.and_then(|()| following.bytes(pos..pos + n));
            match bytes {
                Ok(piece) => self.io.send_data(Op::Data, rid, &[IoSlice::new(piece)])?,
                Err(e) => {
                    self.push_error(Op::Abort, rid, 0, &e.into());
                    break;
                }
            }
            pos += n;
        }
        self.io.push_frame(Op::End, rid, &[]);
        Ok(())
    }

    /// `GetRanges`: each key leased once (in the order `lease_each_streamed` leases them); per
    /// fragment an `Object` and its bytes, or an `Error`.
    fn stream_ranges(&mut self, rid: u64, keys: &[&[u8]], fragments: &[RangeItem]) -> WResult<()> {
        let mut by_key: Vec<Vec<usize>> = vec![Vec::new(); keys.len()];
        for (i, f) in fragments.iter().enumerate() {
            by_key[f.key_index as usize].push(i);
        }
        let read: Vec<usize> = (0..keys.len()).filter(|&k| !by_key[k].is_empty()).collect();
        let read_keys: Vec<&[u8]> = read.iter().map(|&k| keys[k]).collect();
        self.lease_each_streamed(&read_keys, None, |this, r, leased, leased_at| {
            let frags = &by_key[read[r]];
            let lease = match leased {
                Ok(l) => l,
                Err(e) => {
                    let e = Error::from(e.clone());
                    frags.iter().for_each(|&fi| this.push_error(Op::Error, rid, fi as u32, &e));
                    return Ok(());
                }
            };
            for &fi in frags {
                let f = fragments[fi];
                if let Err(e) = kvtide_transport::region::check_range("object", f.src_offset, f.len, lease.len()) {
                    this.push_error(Op::Error, rid, fi as u32, &e.into());
                    continue;
                }
                let start = this.io.begin(Op::Object, rid);
                encode_object(this.io.out(), fi as u32, f.len);
                this.io.end(start);
                this.stream_bytes(rid, fi as u32, lease, leased_at, f.src_offset, f.len)?;
                if this.io.pending_out() >= FLUSH_BYTES {
                    this.io.flush()?;
                }
            }
            Ok(())
        })?;
        self.io.push_frame(Op::End, rid, &[]);
        Ok(())
    }

    /// Sends `[offset, offset + len)` of a leased object in chunks, or an `Abort` when the
    /// lease could run out before a chunk is surely sent.
    fn stream_bytes(
        &mut self,
        rid: u64,
        index: u32,
        lease: &ObjectLease,
        leased_at: Instant,
        offset: u64,
        len: u64,
    ) -> WResult<()> {
        let lease_end = leased_at + self.ttl();
        let sent = self.stream_chunks(rid, index, lease, lease_end, offset, len);
        self.io.set_write_deadline(None);
        sent
    }

    /// `stream_bytes`' frames, each started only while the lease surely outlives its send, and
    /// each send given up (closing the connection) when it has not ended within the I/O timeout:
    /// a client that reads just fast enough to keep a send going never keeps an object leased
    /// past its TTL.
    fn stream_chunks(
        &mut self,
        rid: u64,
        index: u32,
        lease: &ObjectLease,
        lease_end: Instant,
        offset: u64,
        len: u64,
    ) -> WResult<()> {
        let chunk = u64::from(self.config().chunk_bytes);
        let io_timeout = Duration::from_millis(self.config().io_timeout_ms);
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = chunk.min(end - pos);
            // A chunk send may block for up to the I/O timeout; start it only if the lease
            // surely outlives it (a lease of an object still loading waits for the chunk's
            // bytes until then).
            let send_by = lease_end.checked_sub(io_timeout).unwrap_or(lease_end);
            let ready = if Instant::now() >= send_by {
                Err(StoreError::LeaseExpired)
            } else {
                lease.bytes_when_ready(pos..pos + n, send_by).and_then(|b| b.ok_or(StoreError::LeaseExpired))
            };
            let piece = match ready {
                Ok(piece) => piece,
                Err(e) => {
                    self.push_error(Op::Abort, rid, index, &e.into());
                    return Ok(());
                }
            };
            self.io.set_write_deadline(Some(lease_end.min(Instant::now() + io_timeout)));
            self.io.push_data(Op::Data, rid, &[IoSlice::new(piece)])?;
            pos += n;
        }
        Ok(())
    }

    /// `Put`: reserve, then read the value straight into the reservation, then commit.
    fn put(&mut self, header: FrameHeader, shutting: bool) -> WResult<Flow> {
        let rid = header.request_id;
        if (header.payload_len as usize) < PUT_HEAD_BYTES {
            self.fatal(rid, &Error::Protocol("truncated put".into()));
            return Ok(Flow::Close);
        }
        let mut head = [0u8; PUT_HEAD_BYTES];
        self.io.read_exact(&mut head)?;
        let head = match PutHead::decode(&head, header.payload_len, &self.shared.limits) {
            Ok(h) => h,
            Err(e) => {
                // The data frames that follow cannot be told apart from requests: close.
                self.fatal(rid, &e.into());
                return Ok(Flow::Close);
            }
        };
        let mut key = vec![0u8; usize::from(head.key_len)];
        self.io.read_exact(&mut key)?;
        if shutting {
            self.push_error(Op::Error, rid, WHOLE_REQUEST, &StoreError::ShuttingDown.into());
            return Ok(Flow::Close);
        }
        let engine = Arc::clone(&self.shared.engine);
        let opts = PutOptions { upsert: head.upsert, pin: head.pin };
        let reserved = engine.reserve_put(&key, head.total_len, opts);
        // The reservation's time is the owner's, not the client's.
        self.arm_read_deadline();
        match reserved {
            Ok(mut pending) => {
                let dst = pending.bytes_mut();
                self.io.read_exact(&mut dst[..head.inline_len as usize])?;
                let mut filled = head.inline_len;
                while filled < head.total_len {
                    let len = match self.next_data(rid, head.total_len - filled)? {
                        Some(len) => len,
                        None => return Ok(Flow::Close),
                    };
                    self.io.read_exact(&mut dst[filled as usize..(filled + len) as usize])?;
                    filled += len;
                }
                self.reply(rid, pending.commit().map_err(Error::from));
            }
            Err(e) => {
                // Consume the value so the stream stays in sync, then answer.
                self.io.skip(head.inline_len)?;
                let mut left = head.total_len - head.inline_len;
                while left > 0 {
                    let len = match self.next_data(rid, left)? {
                        Some(len) => len,
                        None => return Ok(Flow::Close),
                    };
                    self.io.skip(len)?;
                    left -= len;
                }
                self.reply(rid, Err(e.into()));
            }
        }
        Ok(Flow::Continue)
    }

    /// `PutChunk`: the chunk's bytes go from the socket straight into the put's reservation;
    /// when the chunk is refused they are read and dropped, so the stream stays in sync.
    fn put_chunk(&mut self, header: FrameHeader) -> WResult<Flow> {
        let rid = header.request_id;
        if header.payload_len as usize != PUT_CHUNK_HEAD_BYTES {
            self.fatal(rid, &Error::Protocol("a put chunk head of the wrong length".into()));
            return Ok(Flow::Close);
        }
        let mut head = [0u8; PUT_CHUNK_HEAD_BYTES];
        self.io.read_exact(&mut head)?;
        let head = match PutChunkHead::decode(&head, &self.shared.limits) {
            Ok(h) => h,
            Err(e) => {
                self.fatal(rid, &e.into());
                return Ok(Flow::Close);
            }
        };
        self.arm_read_deadline();
        let Some(put) = self.puts.remove(&head.stream) else {
            return self.refuse_chunk(rid, head.len, unknown_put(head.stream));
        };
        let index = head.index as usize;
        let expected = put.chunk_range(index).map(|r| r.end - r.start);
        if expected != Some(head.len) {
            self.puts.insert(head.stream, put);
            let error = match expected {
                Some(len) => StoreError::SizeMismatch { object_bytes: len, destination_bytes: head.len },
                None => StoreError::InvalidArgument(format!("chunk {index} does not exist")),
            };
            return self.refuse_chunk(rid, head.len, error.into());
        }
        let mut called = false;
        let mut wire: Option<WireError> = None;
        let mut violated = false;
        let result = put.fill_chunk(index, |dst| {
            called = true;
            let mut filled = 0usize;
            while filled < dst.len() {
                let n = match self.next_data(rid, (dst.len() - filled) as u64) {
                    Ok(Some(n)) => n as usize,
                    Ok(None) => {
                        violated = true;
                        return Err(StoreError::Io("the chunk's data frames broke the protocol".into()));
                    }
                    Err(e) => {
                        wire = Some(e);
                        return Err(StoreError::Io("the connection failed in the middle of a chunk".into()));
                    }
                };
                if let Err(e) = self.io.read_exact(&mut dst[filled..filled + n]) {
                    wire = Some(e);
                    return Err(StoreError::Io("the connection failed in the middle of a chunk".into()));
                }
                filled += n;
            }
            Ok(())
        });
        // A connection that failed mid-chunk ends here; its puts (this one dropped) abort.
        if let Some(e) = wire {
            return Err(e);
        }
        if violated {
            return Ok(Flow::Close);
        }
        self.puts.insert(head.stream, put);
        if !called && head.len > 0 {
            // Refused before any byte was read (written already, expired, aborted).
            return self.refuse_chunk(
                rid,
                head.len,
                result.map_err(Error::from).err().unwrap_or(unknown_put(head.stream)),
            );
        }
        self.reply(rid, result.map_err(Error::from));
        Ok(Flow::Continue)
    }

    /// Reads and drops a refused chunk's `len` bytes of data frames, then answers `error`.
    fn refuse_chunk(&mut self, rid: u64, len: u64, error: Error) -> WResult<Flow> {
        let mut left = len;
        while left > 0 {
            let Some(n) = self.next_data(rid, left)? else { return Ok(Flow::Close) };
            self.io.skip(n)?;
            left -= n;
        }
        self.reply(rid, Err(error));
        Ok(Flow::Continue)
    }

    /// Reads the header of the next `Data` frame of request `rid` (at most `left` bytes).
    /// None after a protocol violation (already answered).
    fn next_data(&mut self, rid: u64, left: u64) -> WResult<Option<u64>> {
        self.arm_read_deadline();
        let h = match self.io.read_header(&self.shared.limits) {
            Ok(h) => h,
            Err(WireError::Protocol(p)) => {
                self.fatal(rid, &p.into());
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        if h.op != Op::Data || h.request_id != rid || h.payload_len == 0 || u64::from(h.payload_len) > left {
            self.fatal(rid, &Error::Protocol("put value frames out of order or too long".into()));
            return Ok(None);
        }
        Ok(Some(h.payload_len.into()))
    }
}

impl<'s> Connection<'s> {
    /// `PutOpen`: a progressive put on the owner's engine, held by this connection.
    fn put_open(&mut self, rid: u64, key: &[u8], total_len: u64, chunk_bytes: u64, opts: PutOptions) {
        if self.puts.len() >= MAX_OPEN_PUTS_PER_CONNECTION {
            self.reply(rid, Err(StoreError::Busy { limit: MAX_OPEN_PUTS_PER_CONNECTION }.into()));
            return;
        }
        let shared: &'s Arc<Shared> = self.shared;
        let engine: &'s Engine = &shared.engine;
        match engine.progressive_put(key, total_len, chunk_bytes, opts) {
            Ok(put) => {
                self.puts.insert(rid, put);
                self.reply(rid, Ok(()));
            }
            Err(e) => self.reply(rid, Err(e.into())),
        }
    }
}

fn unknown_put(stream: u64) -> Error {
    StoreError::InvalidArgument(format!("no open progressive put {stream} on this connection")).into()
}

/// The budget of request bytes held in memory: each connection's guaranteed share, and a pool
/// for the part of larger requests beyond a share. A connection serves its requests in order and
/// holds at most one permit, so shares are never oversubscribed and the total stays within
/// `max_buffered_bytes` (`validate` checks that the shares fit).
struct Budget {
    pool_used_bytes: Mutex<u64>,
    freed: Condvar,
    pool_bytes: u64,
    share_bytes: u64,
}

struct Permit<'a> {
    budget: &'a Budget,
    gauge: &'a AtomicU64,
    bytes: u64,
    pooled_bytes: u64,
}

impl Budget {
    fn new(config: &OwnerConfig) -> Budget {
        let share_bytes = config.connection_share_bytes();
        let reserved = share_bytes.saturating_mul(config.max_connections as u64);
        Budget {
            pool_used_bytes: Mutex::new(0),
            freed: Condvar::new(),
            pool_bytes: config.max_buffered_bytes.saturating_sub(reserved),
            share_bytes,
        }
    }

    /// Takes `bytes` for one request: up to the connection's share at once, the rest from the
    /// pool, waiting up to `wait` for room there; None when there was none. `gauge` counts the
    /// bytes held.
    fn acquire<'a>(&'a self, bytes: u64, wait: Duration, gauge: &'a AtomicU64) -> Option<Permit<'a>> {
        let pooled_bytes = bytes.saturating_sub(self.share_bytes);
        if pooled_bytes > 0 {
            let used = self.pool_used_bytes.lock().unwrap_or_else(|p| p.into_inner());
            let (mut used, _) = self
                .freed
                .wait_timeout_while(used, wait, |used| *used + pooled_bytes > self.pool_bytes)
                .unwrap_or_else(|p| p.into_inner());
            if *used + pooled_bytes > self.pool_bytes {
                return None;
            }
            *used += pooled_bytes;
        }
        gauge.fetch_add(bytes, Ordering::Relaxed);
        Some(Permit { budget: self, gauge, bytes, pooled_bytes })
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.pooled_bytes > 0 {
            let mut used = self.budget.pool_used_bytes.lock().unwrap_or_else(|p| p.into_inner());
            *used -= self.pooled_bytes;
            self.budget.freed.notify_all();
        }
        self.gauge.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A streamed answer's key (its place among the keys planned), its lease or error, when the
/// lease was asked for and when it was granted.
type LeasedItem = (usize, Result<ObjectLease, StoreError>, Instant, Instant);

/// DRAM-resident keys of a `GetParts` leased per part at most: the first grants reach the
/// client (which starts copying) while the owner leases the rest.
const DRAM_PART_KEYS: usize = 256;

/// A part a batch is answered in (`shape_parts`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Part {
    /// Indices into the keys given to `lease_parts`.
    keys: Vec<usize>,
    /// DRAM-resident (or missing) keys: nothing to load.
    in_dram: bool,
    /// A key that found no room beside the parts held, leased again once nothing is held.
    alone: bool,
}

/// The parts a batch is answered in, from the engine's restore plan (`lease_parts`): each
/// DRAM-resident part cut into parts of at most `DRAM_PART_KEYS` keys, and the SSD-resident
/// sub-batches (one shard's each, shards interleaved) joined up to `shards` at a time, never two
/// of one shard, so one part's lease loads on every shard side by side while the part before is
/// sent or copied, and no shard holds more than one sub-batch per part.
fn shape_parts(parts: Vec<kvtide::LeasePart>, shards: usize) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::with_capacity(parts.len());
    // The shards of the SSD-resident part being joined (empty: none is).
    let mut joined: Vec<usize> = Vec::new();
    for part in parts {
        if part.in_dram {
            out.extend(part.keys.chunks(DRAM_PART_KEYS).map(|keys| Part {
                keys: keys.to_vec(),
                in_dram: true,
                alone: false,
            }));
            joined.clear();
            continue;
        }
        match out.last_mut() {
            Some(last) if !joined.is_empty() && joined.len() < shards.max(1) && !joined.contains(&part.shard) => {
                last.keys.extend(part.keys);
                joined.push(part.shard);
            }
            _ => {
                out.push(Part { keys: part.keys, in_dram: false, alone: false });
                joined = vec![part.shard];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(keys: std::ops::Range<usize>, in_dram: bool, shard: usize) -> kvtide::LeasePart {
        kvtide::LeasePart { keys: keys.collect(), in_dram, shard }
    }

    #[test]
    fn parts_cut_dram_and_join_ssd_sub_batches_per_shard_count() {
        let shaped = shape_parts(
            vec![part(0..600, true, 0), part(600..602, false, 0), part(602..604, false, 1), part(604..605, false, 0)],
            2,
        );
        let sizes: Vec<(usize, bool)> = shaped.iter().map(|p| (p.keys.len(), p.in_dram)).collect();
        assert_eq!(sizes, vec![(256, true), (256, true), (88, true), (4, false), (1, false)]);
        let all: Vec<usize> = shaped.iter().flat_map(|p| p.keys.iter().copied()).collect();
        assert_eq!(all, (0..605).collect::<Vec<_>>(), "every key once, in order");
        assert!(shape_parts(vec![part(0..0, true, 0)], 4).is_empty());
        // Uneven shards: the tail of one shard's sub-batches is never joined two to a part.
        let tail = shape_parts(
            vec![part(0..1, false, 0), part(1..2, false, 1), part(2..3, false, 0), part(3..4, false, 0)],
            2,
        );
        let keys: Vec<Vec<usize>> = tail.iter().map(|p| p.keys.clone()).collect();
        assert_eq!(keys, vec![vec![0, 1], vec![2], vec![3]]);
    }
}
