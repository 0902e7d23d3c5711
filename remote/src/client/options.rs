//! How a `RemoteStore` connects and behaves: `ClientOptions` (defaults, the environment, the
//! token file) and the owner's address (`Endpoint`: a Unix socket path or TCP `host:port`).
//!
//! Owns the parsing and defaults of the client's settings. Never connects.

use std::path::PathBuf;

use kvtide::Error as StoreError;

use crate::auth::Token;
use crate::error::Result;

#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Deadline of each request, and of each socket operation within it. Default 30 s.
    pub timeout_ms: u64,
    /// Deadline of connecting and the handshake. Default 5 s.
    pub connect_timeout_ms: u64,
    /// Token for TCP owners that require one.
    pub token: Option<Token>,
    /// Map the owner's arena for one-copy gets (Unix socket only). Default true.
    pub shared_memory: bool,
    /// Read DRAM-resident objects through the owner's read index, without a round trip, where
    /// the owner shares one (Unix socket, arena shared). Default true; off, every read leases.
    pub read_index: bool,
    /// Let a same-user owner read put values straight from this process's memory (one copy,
    /// no bytes on the socket); where it may not, values go through the put window. Unix
    /// socket only. Default true.
    pub direct_puts: bool,
    /// Idle connections kept for reuse. Default 16.
    pub max_idle_connections: usize,
    /// `submit_batch_get` tickets in flight at once. Default 64.
    pub max_tickets_in_flight: usize,
    /// Chunk handles (`progressive_get`, `streaming_batch_get_buffer_ranges`) running at once;
    /// more are refused with `Busy`. Default 64.
    pub max_stream_handles: usize,
    /// Host bytes that stream-bound reads without the owner's shared arena (TCP) hold until
    /// their stream passes the copies; a read that would go past it is refused with `Busy`.
    /// Default 1 GiB.
    pub max_stream_host_bytes: u64,
    /// How this client copies between the owner's memory and GPU memory (feature `cuda`):
    /// staged or direct, as the embedded engine's `[gpu]` settings.
    pub gpu: kvtide::GpuGroup,
    /// How long a call polls for the owner's reply before it blocks, so a quick reply costs no
    /// thread wake-up. Default 50 µs on hosts with 8 or more CPUs, else 0.
    pub spin_us: u64,
    /// Read over the owner's UCX data plane with these transports ("rdma" or a list, `UcxTransports::parse`), on
    /// TCP connections: the owner grants leases on the connection and this client reads the
    /// granted ranges with one-sided UCX gets. When the owner serves no plane, speaks another
    /// version or UCX cannot start here, reads stay on the TCP path (warned once per owner
    /// instance; `RemoteStore::data_plane` says which). None (default): the TCP path.
    pub ucx_transports: Option<String>,
    /// Allow `tcp` among `ucx_transports` (UCX's tcp transport lets any host that reaches this
    /// process's UCX port read and write its memory: loopback and trusted networks only).
    pub ucx_allow_tcp: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout_ms: 30_000,
            connect_timeout_ms: 5_000,
            token: None,
            shared_memory: true,
            read_index: true,
            direct_puts: true,
            max_idle_connections: 16,
            max_tickets_in_flight: 64,
            max_stream_handles: 64,
            max_stream_host_bytes: 1 << 30,
            gpu: kvtide::GpuGroup::default(),
            spin_us: crate::wire::default_spin_us(),
            ucx_transports: None,
            ucx_allow_tcp: false,
        }
    }
}

impl ClientOptions {
    /// Defaults, overridden by `KVTIDE_TOKEN_FILE` (token for TCP owners),
    /// `KVTIDE_TIMEOUT_MS`, `KVTIDE_SHARED_MEMORY`, `KVTIDE_READ_INDEX`, `KVTIDE_DIRECT_PUTS`
    /// (0/1), `KVTIDE_UCX_TRANSPORTS` ("rdma", a transport list, or "off") and `KVTIDE_UCX_ALLOW_TCP` (0/1).
    pub fn from_env() -> Result<ClientOptions> {
        let mut o = ClientOptions::default();
        if let Ok(path) = std::env::var("KVTIDE_TOKEN_FILE") {
            o.token = Some(Token::from_file(path.as_ref()).map_err(StoreError::InvalidArgument)?);
        }
        if let Ok(ms) = std::env::var("KVTIDE_TIMEOUT_MS") {
            o.timeout_ms =
                ms.trim().parse().map_err(|_| StoreError::InvalidArgument(format!("KVTIDE_TIMEOUT_MS={ms:?}")))?;
        }
        if let Ok(v) = std::env::var("KVTIDE_SHARED_MEMORY") {
            o.shared_memory = !matches!(v.trim(), "0" | "false" | "no" | "off");
        }
        if let Ok(v) = std::env::var("KVTIDE_READ_INDEX") {
            o.read_index = !matches!(v.trim(), "0" | "false" | "no" | "off");
        }
        if let Ok(v) = std::env::var("KVTIDE_DIRECT_PUTS") {
            o.direct_puts = !matches!(v.trim(), "0" | "false" | "no" | "off");
        }
        if let Ok(v) = std::env::var("KVTIDE_UCX_TRANSPORTS") {
            o.ucx_transports = crate::ucx::Transports::from_setting(&v);
        }
        if let Ok(v) = std::env::var("KVTIDE_UCX_ALLOW_TCP") {
            o.ucx_allow_tcp = matches!(v.trim(), "1" | "true" | "yes" | "on");
        }
        Ok(o)
    }

    /// Uses the token in `path`.
    pub fn token_file(mut self, path: impl AsRef<std::path::Path>) -> Result<ClientOptions> {
        self.token = Some(Token::from_file(path.as_ref()).map_err(StoreError::InvalidArgument)?);
        Ok(self)
    }
}

/// Where the owner listens.
#[derive(Clone, Debug)]
pub(super) enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

impl Endpoint {
    pub(super) fn parse(address: &str) -> Result<Endpoint> {
        let a = address.trim();
        if let Some(path) = a.strip_prefix("unix:") {
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if a.starts_with('/') || a.starts_with("./") {
            return Ok(Endpoint::Unix(PathBuf::from(a)));
        }
        let hostport = a.strip_prefix("tcp:").unwrap_or(a);
        if hostport.rsplit_once(':').is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err()) {
            return Err(StoreError::InvalidArgument(format!(
                "{address:?}: expected \"unix:/path/to/owner.sock\" or \"host:port\""
            ))
            .into());
        }
        Ok(Endpoint::Tcp(hostport.to_string()))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}
