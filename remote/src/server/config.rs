//! The owner's configuration: `OwnerConfig` (what it serves and its limits), its defaults, the
//! checks a configuration must pass before anything is bound, and `OwnerError`.
//!
//! Owns the meaning of each limit and the rules that tie them together (shares that fit the
//! budget, a lease TTL that outlives a send, a socket mode that never lets every user in). Never
//! binds, reads or serves anything.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::auth::Token;

/// The smallest stop budget accepted.
pub(super) const MIN_STOP_BUDGET_MS: u64 = 1_000;

/// What the owner serves and its limits.
#[derive(Clone, Debug)]
pub struct OwnerConfig {
    /// Unix socket path (created with `unix_socket_mode`; a stale socket file is replaced).
    /// None: no Unix socket.
    pub unix_socket: Option<PathBuf>,
    /// The Unix socket's permission bits (default 0600: the owner's user only). Connecting takes
    /// write permission, so 0660 lets `unix_socket_group` in; others may never write.
    pub unix_socket_mode: u32,
    /// The Unix socket's group (a gid; None: the owner's group). With a group, the socket's
    /// directory must let the group through: a missing one is created 0710 for it, an existing
    /// one is checked, never changed.
    pub unix_socket_group: Option<u32>,
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
    /// authenticated (or, without a token, said hello). Default 256 here; `kvtide-owner` derives
    /// its default from the descriptor limit (`connections_for_descriptors`).
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
    /// Lets a Unix client of the owner's own user have its put values read straight from its
    /// memory (`process_vm_readv`, one copy) instead of through its window; the client writes
    /// nothing of the owner's memory either way.
    pub direct_puts: bool,
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
    /// The whole stop, from the signal to the exit (`Owner::stop_within_budget`): in-flight
    /// requests get at most `min(shutdown_grace_ms, 2/5 of it)`, the flush of DRAM-only objects
    /// to SSD ends by the budget less a reserve (a tenth of it, at most 2 s) for the last
    /// syncs and the exit. At least 1000.
    pub stop_budget_ms: u64,
    /// How long a connection polls for its client's next request before it sleeps, so a
    /// client that asks again at once costs no thread wake-up. Default 50 µs on hosts with 8
    /// or more CPUs, else 0.
    pub spin_us: u64,
    /// Serve the UCX data plane over these transports (`UcxTransports::parse`: "rdma" or RDMA transports,
    /// and `tcp` only with `ucx_allow_tcp`): authenticated TCP clients then read granted ranges
    /// of the arena with one-sided UCX gets. None (default): no UCX plane.
    pub ucx_transports: Option<String>,
    /// Allow `tcp` among `ucx_transports`. UCX's tcp transport serves one-sided reads and writes
    /// in software at whatever address a peer names, unchecked: any host that reaches the
    /// owner's UCX port can then read and write the owner's memory. Only for tests on loopback
    /// and trusted networks. Default false.
    pub ucx_allow_tcp: bool,
    /// UCX workers of the plane's process, each on its own thread; attaching clients are handed
    /// one each, in turn (over tcp a worker's thread sends every byte its clients read). 0
    /// (default): one per CPU, at most 16. At most `MAX_UCX_WORKERS`.
    pub ucx_workers: usize,
    /// The `kvtide-owner` program that runs the UCX plane's process (`kvtide-owner __ucx-plane`:
    /// UCX never runs in the owner's own process). None: this program when it is
    /// `kvtide-owner`, else a `kvtide-owner` beside it.
    pub ucx_program: Option<PathBuf>,
}

impl OwnerConfig {
    /// Each connection's guaranteed share of the request budget.
    pub fn connection_share_bytes(&self) -> u64 {
        self.connection_buffered_bytes
            .unwrap_or_else(|| self.max_buffered_bytes / (2 * self.max_connections.max(1) as u64))
    }
}

/// Descriptors a connection may hold at once: its socket and the registry's duplicate of it
/// (a parked connection holds one).
const DESCRIPTORS_PER_CONNECTION: u64 = 2;
/// Descriptors kept for everything but connections besides the SSD tier's segment files:
/// listeners, io_uring rings, eventfds, the poller, logs, metrics and cluster clients.
const RESERVED_DESCRIPTORS: u64 = 512;
/// The most connections a derived default allows (about 150 MiB of parked connections).
const MAX_DERIVED_CONNECTIONS: usize = 16_384;
/// The fewest a derived default allows, however low the descriptor limit.
const MIN_DERIVED_CONNECTIONS: usize = 64;

impl OwnerConfig {
    /// The default connection limit for a process allowed `descriptor_limit` open descriptors
    /// whose engine holds `engine_files` (the SSD tier's segment files): what is left after a
    /// reserve, two descriptors per connection, within 64..=16384.
    pub fn connections_for_descriptors(descriptor_limit: u64, engine_files: u64) -> usize {
        let left = descriptor_limit.saturating_sub(RESERVED_DESCRIPTORS).saturating_sub(engine_files);
        let connections = usize::try_from(left / DESCRIPTORS_PER_CONNECTION).unwrap_or(usize::MAX);
        connections.clamp(MIN_DERIVED_CONNECTIONS, MAX_DERIVED_CONNECTIONS)
    }
}

impl Default for OwnerConfig {
    fn default() -> Self {
        OwnerConfig {
            unix_socket: None,
            unix_socket_mode: DEFAULT_SOCKET_MODE,
            unix_socket_group: None,
            tcp: None,
            tcp_token: None,
            allow_unauthenticated_loopback: false,
            share_arena: true,
            max_connections: 256,
            max_unauthenticated_connections: 32,
            max_leases_per_connection: 4096,
            put_window_bytes: 32 << 20,
            max_put_window_bytes: 1 << 30,
            direct_puts: true,
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
            stop_budget_ms: 25_000,
            spin_us: crate::wire::default_spin_us(),
            ucx_transports: None,
            ucx_workers: 0,
            ucx_allow_tcp: false,
            ucx_program: None,
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

/// Checks a configuration before anything is bound.
pub(super) fn validate(c: &OwnerConfig) -> std::result::Result<(), OwnerError> {
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
    if c.unix_socket.is_some() {
        check_mode_with_group(c.unix_socket_mode, c.unix_socket_group)
            .map_err(|e| OwnerError::Config(format!("unix_socket_mode: {e}")))?;
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
    if let Some(list) = &c.ucx_transports {
        if c.tcp.is_none() {
            return bad("the UCX plane (ucx_transports) needs a TCP address: clients attach over TCP".into());
        }
        crate::ucx::Transports::parse(list, c.ucx_allow_tcp).map_err(|e| OwnerError::Config(e.to_string()))?;
    }
    if c.ucx_workers > crate::ucx::MAX_UCX_WORKERS {
        return bad(format!("ucx_workers = {} is more than {}", c.ucx_workers, crate::ucx::MAX_UCX_WORKERS));
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
    if c.stop_budget_ms < MIN_STOP_BUDGET_MS {
        return bad(format!(
            "stop_budget_ms = {} must be at least {} (a stop needs time to close connections and sync)",
            c.stop_budget_ms, MIN_STOP_BUDGET_MS
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

/// The socket's mode unless `[owner] socket_mode` says otherwise: the owner's user only.
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

/// A socket mode the owner accepts: permission bits only (no setuid, setgid or sticky bit), read
/// and write for the owner's user (`kvtide-owner status` connects as that user), and never
/// writable by others (connecting takes write permission, so that would let every user of the
/// host in; give the clients a group instead).
pub fn check_socket_mode(mode: u32) -> Result<(), String> {
    if mode & !0o777 != 0 {
        return Err(format!("{mode:04o} has bits beyond the permission bits 0777 (setuid, setgid or sticky)"));
    }
    if mode & 0o600 != 0o600 {
        return Err(format!("{mode:04o} must let the owner's user read and write (0600 at least)"));
    }
    if mode & 0o002 != 0 {
        return Err(format!(
            "{mode:04o} lets every user of the host connect (others may write); give the clients a group \
             instead: socket_mode = \"0660\" and socket_group = \"<their group>\""
        ));
    }
    Ok(())
}

/// The checks a mode and group must pass together: a group is given for its members to
/// connect, so the mode must let the group write.
pub fn check_mode_with_group(mode: u32, group: Option<u32>) -> Result<(), String> {
    check_socket_mode(mode)?;
    if let Some(gid) = group {
        if mode & 0o020 == 0 {
            return Err(format!(
                "socket_group {gid} is given but socket_mode {mode:04o} does not let the group connect \
                 (connecting takes write permission): use socket_mode = \"0660\""
            ));
        }
    }
    Ok(())
}
