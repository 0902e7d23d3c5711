//! `RemoteStore`: the `Store` API over a connection to a `kvtide-owner`, so code written
//! against the embedded engine runs unchanged against a shared one.
//!
//! It owns a pool of connections (reused across calls, one per concurrent caller; holds keep a
//! connection of their own, `client/hold.rs`), the read-only mapping of the owner's arena (Unix
//! socket), and the client half of the protocol.
//! Gets over a Unix socket are one copy: the owner leases the object and names its offset in
//! the shared arena, the client copies it into the caller's buffer and releases the lease.
//! Elsewhere values stream in chunks straight into the caller's buffers. Every request has a
//! deadline; a connection that failed is never reused; a call that finds its pooled connection
//! dead (the owner restarted) retries once on a fresh one. It never reports a destination that
//! was only partly written as a success.

use std::io::IoSlice;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtide_transport::{Direction, Region, Transfer};

use crate::auth::Token;
use crate::protocol::{
    decode_error_frame, decode_exists, decode_key_page, decode_mac, decode_object, FrameHeader, GetItem, Grant,
    GrantsPart, Hello, HelloOk, LenCheck, Limits, NextPart, Op, ProtocolError, RangeItem, Request, HELLO_AUTH_REQUIRED,
    HELLO_SHM_ATTACHED, HELLO_WANT_SHM, NONCE_BYTES, WHOLE_REQUEST,
};
use crate::shm::{PutWindow, ShmMapping};
use crate::sock::{self, Stream};
use crate::wire::{FrameIo, WResult, WireError};
use kvtide::checks::{self, total_len};
use kvtide::{Error as StoreError, Fragment, PutOptions, Stats, Store, Ticket};

use crate::error::{Error, Result};

mod batch;
mod gpu;
mod hold;
pub use hold::HoldGranted;
mod on_stream;
mod stream;
use batch::PutSource;
pub use stream::RemotePutStream;

/// A lease is trusted only if the copy finished this long before its TTL.
const LEASE_MARGIN: Duration = Duration::from_millis(500);
/// First allocation for `get` over a stream (grown as bytes arrive, so a lying length cannot
/// make the client allocate more than it received).
const GET_INITIAL_ALLOC: u64 = 64 << 20;
/// A read of one key into a host buffer of at most this many bytes comes through the socket
/// even when the arena is mapped: leasing through the owner's shard and releasing afterwards
/// costs more than copying that few bytes twice (docs/benchmarks.md, "Small reads over the Unix
/// socket"). Batches keep the arena: streamed, only batches of values under about 1 KiB measured
/// faster, and the owner streams a batch's DRAM-resident keys one after another.
const STREAM_READ_BYTES: u64 = 8 << 10;

/// How a `RemoteStore` connects and behaves.
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
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout_ms: 30_000,
            connect_timeout_ms: 5_000,
            token: None,
            shared_memory: true,
            max_idle_connections: 16,
            max_tickets_in_flight: 64,
            max_stream_handles: 64,
            max_stream_host_bytes: 1 << 30,
            gpu: kvtide::GpuGroup::default(),
            spin_us: crate::wire::default_spin_us(),
        }
    }
}

impl ClientOptions {
    /// Defaults, overridden by `KVTIDE_TOKEN_FILE` (token for TCP owners),
    /// `KVTIDE_TIMEOUT_MS` and `KVTIDE_SHARED_MEMORY` (0/1).
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
        Ok(o)
    }

    /// Uses the token in `path`.
    pub fn token_file(mut self, path: impl AsRef<std::path::Path>) -> Result<ClientOptions> {
        self.token = Some(Token::from_file(path.as_ref()).map_err(StoreError::InvalidArgument)?);
        Ok(self)
    }
}

#[derive(Clone, Debug)]
enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

impl Endpoint {
    fn parse(address: &str) -> Result<Endpoint> {
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

/// A store served by a `kvtide-owner` process, over a Unix socket (with shared memory) or TCP.
/// Cheap to share; every method takes `&self` and may be called from many threads.
pub struct RemoteStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore").field("endpoint", &self.inner.endpoint.to_string()).finish()
    }
}

struct Inner {
    endpoint: Endpoint,
    options: ClientOptions,
    gpu: gpu::ClientGpu,
    /// Stream-bound reads in flight and their watch thread.
    watch: on_stream::Watch,
    pool: Mutex<Vec<Conn>>,
    mapping: Mutex<Option<Arc<ShmMapping>>>,
    next_request: AtomicU64,
    tickets_in_flight: Arc<AtomicU64>,
    /// Chunk handles whose threads still run.
    streams_open: Arc<AtomicU64>,
    /// Host bytes held by stream-bound reads in flight (`max_stream_host_bytes`).
    stream_host_bytes: Arc<AtomicU64>,
    last_limits: Mutex<Option<Limits>>,
    last_max_leases: AtomicU64,
    /// Lease releases sent and not yet known applied by the owner.
    releases: Arc<Releases>,
    /// Leases callers keep across calls (`RemoteStore::hold`), on a connection of their own.
    holds: hold::Holds,
}

/// Lease releases this client sent that the owner may not have applied yet. A release has no
/// reply; the owner applies a connection's frames in order, so the next reply read on that
/// connection (or its close) confirms it. `remove` waits on this before it retries a key found
/// leased, so a read's own lease never fails the remove that follows it.
#[derive(Default)]
struct Releases {
    /// (last sequence number given, those not yet confirmed).
    state: Mutex<(u64, std::collections::BTreeSet<u64>)>,
    confirmed: std::sync::Condvar,
}

impl Releases {
    fn sent(&self) -> u64 {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        let seq = g.0;
        g.1.insert(seq);
        seq
    }

    fn confirm(&self, seqs: &mut Vec<u64>) {
        if seqs.is_empty() {
            return;
        }
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        for seq in seqs.drain(..) {
            g.1.remove(&seq);
        }
        self.confirmed.notify_all();
    }

    /// The sequence number of the last release sent so far (0: none yet).
    fn last_sent(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    /// Waits until every release up to `seq` is confirmed, or `timeout` passed.
    fn wait_through(&self, seq: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while g.1.first().is_some_and(|&first| first <= seq) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            g = self.confirmed.wait_timeout(g, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

struct Conn {
    io: FrameIo,
    hello: HelloOk,
    limits: Limits,
    shm: Option<Arc<ShmMapping>>,
    window: WindowState,
    /// Failed midway through a batch whose earlier requests took effect: never reused.
    broken: bool,
    /// Releases sent on this connection since its last reply (`Releases`).
    unconfirmed: Vec<u64>,
    releases: Arc<Releases>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // A closed connection's leases are dropped by the owner.
        self.releases.confirm(&mut self.unconfirmed);
    }
}

/// A connection's put window.
enum WindowState {
    /// Not asked for yet (asked on the first put over a Unix socket with shared memory).
    Untried,
    /// Refused, failed or not applicable: values travel over the socket.
    Unavailable,
    Mapped(PutWindow),
}

/// One object read: its length, and its bytes when the target was `Owned`.
type ReadResult = Result<(usize, Option<Vec<u8>>)>;

/// A part of a `GetParts` answer whose leases this client holds: its GPU copies in flight (and
/// the result slot of each), its result slots, its lease ids, and when its grants arrived.
struct PartCopies {
    inflight: Option<kvtide_transport::InFlight>,
    slots: Vec<usize>,
    in_part: Vec<usize>,
    leases: Vec<u64>,
    arrived: Instant,
    ttl: Duration,
}

/// One result slot of a leased item (`Conn::get_in_parts`): its result, and the GPU copy that
/// still has to deliver it.
struct Placed<T> {
    slot: usize,
    result: Result<T>,
    device: Option<Transfer>,
}

impl<T> Placed<T> {
    fn of(slot: usize, placed: Result<(T, Option<Transfer>)>) -> Placed<T> {
        match placed {
            Ok((result, device)) => Placed { slot, result: Ok(result), device },
            Err(e) => Placed { slot, result: Err(e), device: None },
        }
    }
}

/// Where one object's bytes go.
enum Target<'a> {
    /// In order across these regions (their lengths were checked against the object's).
    Regions(Vec<Region<'a>>),
    /// A new vector (`get`).
    Owned(Vec<u8>),
}

impl RemoteStore {
    /// Connects to `address`: `"unix:/path/owner.sock"` (or an absolute path) or `"host:port"`.
    /// Options come from `ClientOptions::from_env` (`KVTIDE_TOKEN_FILE` for TCP owners).
    pub fn connect(address: &str) -> Result<RemoteStore> {
        RemoteStore::connect_with(address, ClientOptions::from_env()?)
    }

    /// Connects with explicit options. One connection is made now, so a wrong address, token or
    /// protocol version is reported here.
    pub fn connect_with(address: &str, options: ClientOptions) -> Result<RemoteStore> {
        let inner = Arc::new(Inner {
            endpoint: Endpoint::parse(address)?,
            gpu: gpu::ClientGpu::new(options.gpu.clone()),
            watch: on_stream::Watch::default(),
            options,
            pool: Mutex::new(Vec::new()),
            mapping: Mutex::new(None),
            next_request: AtomicU64::new(1),
            tickets_in_flight: Arc::new(AtomicU64::new(0)),
            streams_open: Arc::new(AtomicU64::new(0)),
            stream_host_bytes: Arc::new(AtomicU64::new(0)),
            last_limits: Mutex::new(None),
            last_max_leases: AtomicU64::new(u64::MAX),
            releases: Arc::default(),
            holds: hold::Holds::default(),
        });
        let conn = inner.open()?;
        inner.checkin(conn);
        Ok(RemoteStore { inner })
    }

    /// The largest value the owner stores (its engine's `max_value_bytes`).
    pub fn max_value_bytes(&self) -> Result<u64> {
        Ok(self.inner.limits()?.max_value_bytes)
    }

    /// Host bytes that stream-bound reads in flight hold (TCP: the objects wait in host memory
    /// until their stream passed the copies); zero when none is in flight.
    pub fn stream_host_bytes(&self) -> u64 {
        self.inner.stream_host_bytes.load(Ordering::Acquire)
    }

    /// True when gets copy straight from the owner's shared memory.
    pub fn uses_shared_memory(&self) -> bool {
        self.inner.mapping.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// The owner's statistics, or the error that prevented reading them (`Store::stats` returns
    /// empty statistics instead).
    pub fn try_stats(&self) -> Result<Stats> {
        let mut stats = self.inner.call("stats", |conn, rid| {
            conn.io.push_frame(Op::Stats, rid, &[]);
            conn.io.flush()?;
            let h = conn.read_reply_header(rid)?;
            let payload = conn.io.read_payload(h.payload_len)?;
            Ok(match h.op {
                Op::StatsReply => std::str::from_utf8(&payload)
                    .map_err(|_| Error::Protocol("stats are not UTF-8".into()))
                    .and_then(|text| toml::from_str::<Stats>(text).map_err(|e| Error::Protocol(format!("stats: {e}")))),
                Op::Error => Err(decode_error_frame(&payload)?.1),
                other => return Err(ProtocolError::Unexpected { expected: "stats", got: other }.into()),
            })
        })?;
        stats.tickets_in_flight += self.inner.tickets_in_flight.load(Ordering::Relaxed);
        Ok(stats)
    }
}

impl Inner {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.options.timeout_ms)
    }

    fn checkout(&self) -> Option<Conn> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    /// Makes sure the owner applied every lease release this client sent up to `through`
    /// (`Releases::last_sent` before a request): one round trip on each idle connection that
    /// carried one, and a wait for those other threads hold. A read's release travels without
    /// a reply, so a `remove` right after a `get`, sent on another pooled connection, could
    /// otherwise find the object still leased by this very client. False when no release was
    /// sent before `through`.
    fn confirm_releases(&self, through: u64) -> bool {
        if through == 0 {
            return false;
        }
        // The hold connection is never pooled: confirm its releases here.
        self.holds.confirm(self);
        let flagged: Vec<Conn> = {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let (flagged, rest): (Vec<Conn>, Vec<Conn>) = pool.drain(..).partition(|c| !c.unconfirmed.is_empty());
            *pool = rest;
            flagged
        };
        for mut conn in flagged {
            let rid = self.next_request.fetch_add(1, Ordering::Relaxed);
            if conn.round_trip(rid).is_ok() {
                self.checkin(conn);
            }
        }
        // Connections other threads hold now confirm with their next reply (a second at most:
        // one parked on a slow producer's stream need not hold this up).
        self.releases.wait_through(through, self.timeout().min(Duration::from_secs(1)));
        true
    }

    fn checkin(&self, conn: Conn) {
        if conn.broken {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < self.options.max_idle_connections {
            pool.push(conn);
        }
    }

    /// Runs one request. A pooled connection that turns out dead is dropped with the rest of
    /// the pool (the owner restarted) and the request is retried once on a new connection.
    fn call<T>(&self, op: &'static str, mut f: impl FnMut(&mut Conn, u64) -> WResult<Result<T>>) -> Result<T> {
        let mut pooled = self.checkout();
        loop {
            let reused = pooled.is_some();
            let mut conn = match pooled.take() {
                Some(c) => c,
                None => self.open()?,
            };
            let rid = self.next_request.fetch_add(1, Ordering::Relaxed);
            match f(&mut conn, rid) {
                Ok(result) => {
                    self.checkin(conn);
                    return result;
                }
                Err(WireError::Closed(_) | WireError::Io(_)) if reused => {
                    self.pool.lock().unwrap_or_else(|p| p.into_inner()).clear();
                    continue;
                }
                Err(e) => return Err(e.into_error(op, self.options.timeout_ms)),
            }
        }
    }

    fn open(&self) -> Result<Conn> {
        let connect_timeout = Duration::from_millis(self.options.connect_timeout_ms);
        let unreachable = |e: std::io::Error| Error::Disconnected(format!("cannot connect to {}: {e}", self.endpoint));
        let stream = match &self.endpoint {
            Endpoint::Unix(path) => Stream::Unix(UnixStream::connect(path).map_err(|e| {
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    Error::Disconnected(format!(
                        "cannot connect to {}: {e}: this user may not use the owner's socket (the owner's \
                         [owner] socket_mode and socket_group say who may: the socket's group, with mode 0660)",
                        self.endpoint
                    ))
                } else {
                    unreachable(e)
                }
            })?),
            Endpoint::Tcp(addr) => {
                let addrs: Vec<_> = addr.to_socket_addrs().map_err(unreachable)?.collect();
                let mut last = std::io::Error::other("no address");
                let mut connected = None;
                for a in addrs {
                    match TcpStream::connect_timeout(&a, connect_timeout) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                let s = connected.ok_or_else(|| unreachable(last))?;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        };
        stream.set_timeouts(Some(connect_timeout)).map_err(unreachable)?;
        let mut io = FrameIo::new(stream);
        let handshake = |e: WireError| e.into_error("handshake", self.options.connect_timeout_ms);
        let hello = self.handshake(&mut io).map_err(handshake)??;
        io.stream().set_timeouts(Some(self.timeout())).map_err(unreachable)?;
        io.set_spin(Duration::from_micros(self.options.spin_us));
        *self.last_limits.lock().unwrap_or_else(|p| p.into_inner()) = Some(hello.0.limits());
        self.last_max_leases.store(hello.0.max_leases.into(), Ordering::Relaxed);
        Ok(hello_conn(io, hello.0, hello.1, Arc::clone(&self.releases)))
    }

    fn handshake(&self, io: &mut FrameIo) -> WResult<Result<(HelloOk, Option<Arc<ShmMapping>>)>> {
        let unix = io.stream().is_unix();
        let mut client_nonce = [0u8; NONCE_BYTES];
        sock::random_bytes(&mut client_nonce)?;
        let flags = if unix && self.options.shared_memory { HELLO_WANT_SHM } else { 0 };
        let mut payload = Vec::new();
        Hello { client_nonce, flags }.encode(&mut payload);
        io.push_frame(Op::Hello, 0, &payload);
        io.flush()?;
        let limits = Limits { max_payload_bytes: 4096, ..Limits::default() };
        let mut fd: Option<OwnedFd> = None;
        let h = io.read_header_with_fd(&limits, if unix { Some(&mut fd) } else { None })?;
        let payload = io.read_payload(h.payload_len)?;
        let hello = match h.op {
            Op::HelloOk => HelloOk::decode(&payload)?,
            Op::Error => return Ok(Err(decode_error_frame(&payload)?.1)),
            other => return Err(ProtocolError::Unexpected { expected: "hello reply", got: other }.into()),
        };
        if hello.flags & HELLO_AUTH_REQUIRED != 0 {
            let Some(token) = &self.options.token else {
                return Ok(Err(Error::Unauthorized(format!(
                    "{} requires a token (ClientOptions::token or KVTIDE_TOKEN_FILE)",
                    self.endpoint
                ))));
            };
            let proof = token.client_proof(&hello.server_nonce, &client_nonce);
            io.push_frame(Op::Auth, 0, &proof);
            io.flush()?;
            let h = io.read_header(&limits)?;
            let payload = io.read_payload(h.payload_len)?;
            match h.op {
                Op::AuthOk => {
                    let owner_proof = decode_mac(&payload)?;
                    if !token.verify_owner(&client_nonce, &hello.server_nonce, &owner_proof) {
                        return Ok(Err(Error::Unauthorized("the owner could not prove it knows the token".into())));
                    }
                }
                Op::Error => return Ok(Err(decode_error_frame(&payload)?.1)),
                other => return Err(ProtocolError::Unexpected { expected: "auth reply", got: other }.into()),
            }
        }
        let mut mapping = None;
        if hello.flags & HELLO_SHM_ATTACHED != 0 {
            let Some(fd) = fd else {
                return Err(ProtocolError::Invalid { what: "shared memory announced without a descriptor" }.into());
            };
            let mut current = self.mapping.lock().unwrap_or_else(|p| p.into_inner());
            match current.as_ref() {
                Some(m) if m.instance_id() == hello.instance_id && m.len() == hello.arena_bytes => {
                    mapping = Some(Arc::clone(m));
                }
                _ => match ShmMapping::shared(fd, hello.arena_bytes, hello.instance_id) {
                    Ok(m) => {
                        *current = Some(Arc::clone(&m));
                        mapping = Some(m);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot map the owner's arena; streaming instead");
                        *current = None;
                    }
                },
            }
        }
        Ok(Ok((hello, mapping)))
    }

    fn validate_key(&self, conn_limits: &Limits, key: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(StoreError::EmptyKey.into());
        }
        if key.len() > conn_limits.max_key_bytes as usize {
            return Err(StoreError::TooLarge {
                what: "key",
                len: key.len() as u64,
                max: u64::from(conn_limits.max_key_bytes),
            }
            .into());
        }
        Ok(())
    }

    /// Checks a destination list: GPU memory through the GPU transport, host memory writable.
    fn check_destinations(&self, regions: &[Region<'_>]) -> Result<()> {
        self.check_destination_lists(&[regions]).pop().unwrap_or(Ok(()))
    }

    /// `check_destinations` for many lists; the GPU lists are checked together (one lookup per
    /// device allocation, not per list).
    fn check_destination_lists(&self, lists: &[&[Region<'_>]]) -> Vec<Result<()>> {
        let mut out: Vec<Result<()>> = Vec::with_capacity(lists.len());
        let mut device = Vec::new();
        for (i, regions) in lists.iter().enumerate() {
            if gpu::names_device(regions) {
                device.push(i);
                out.push(Ok(()));
            } else {
                out.push(regions.iter().try_for_each(check_destination));
            }
        }
        if !device.is_empty() {
            let device_lists: Vec<&[Region<'_>]> = device.iter().map(|&i| lists[i]).collect();
            for (&i, checked) in device.iter().zip(self.gpu.check_lists(&device_lists, true)) {
                out[i] = checked;
            }
        }
        out
    }

    /// Checks source lists: GPU memory through the GPU transport (all lists together).
    fn check_source_lists(&self, lists: &[&[Region<'_>]]) -> Vec<Result<()>> {
        let mut out: Vec<Result<()>> = Vec::with_capacity(lists.len());
        let mut device = Vec::new();
        for (i, regions) in lists.iter().enumerate() {
            if gpu::names_device(regions) {
                device.push(i);
                out.push(Ok(()));
            } else {
                out.push(regions.iter().try_for_each(check_source));
            }
        }
        if !device.is_empty() {
            let device_lists: Vec<&[Region<'_>]> = device.iter().map(|&i| lists[i]).collect();
            for (&i, checked) in device.iter().zip(self.gpu.check_lists(&device_lists, false)) {
                out[i] = checked;
            }
        }
        out
    }

    /// The limits of the owner as of the last handshake (connecting if there was none).
    fn limits(&self) -> Result<Limits> {
        if let Some(l) = *self.last_limits.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(l);
        }
        let conn = self.open()?;
        let limits = conn.limits;
        self.checkin(conn);
        Ok(limits)
    }

    /// Most keys per request: the owner's item limit, and its lease limit when leasing.
    fn max_batch(&self, limits: &Limits) -> usize {
        let leases = self.last_max_leases.load(Ordering::Relaxed).max(1) as usize;
        (limits.max_items as usize).min(leases).min(4096)
    }

    // ---- reads ---------------------------------------------------------------------------------

    /// A batch read of object i into `dsts[i]` (one list per key, checked by the caller), each
    /// object's length checked as `check` of its list says: one result per key, a bad key or
    /// destination failing only itself.
    fn read_batch(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        check: impl Fn(&[Region<'_>]) -> std::result::Result<LenCheck, StoreError>,
    ) -> Vec<Result<usize>> {
        let limits = match self.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<usize>> =
            (0..keys.len()).map(|_| Err(StoreError::Internal("unset").into())).collect();
        let mut valid = Vec::new();
        let mut items = Vec::new();
        let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
        let mut dst_checks = self.check_destination_lists(&lists).into_iter();
        for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
            let dst_check = dst_checks.next().unwrap_or(Ok(()));
            let checked = self.validate_key(&limits, key).and(dst_check).and_then(|()| Ok(check(regions)?));
            match checked {
                Ok(check) => {
                    valid.push(i);
                    items.push((*key, check, Target::Regions(regions.clone())));
                }
                Err(e) => results[i] = Err(e),
            }
        }
        for (i, r) in valid.into_iter().zip(self.read_objects(items)) {
            results[i] = r.map(|(n, _)| n);
        }
        results
    }

    /// Reads `items` (key, check, target); results in the same order.
    fn read_objects<'a>(&self, items: Vec<(&[u8], LenCheck, Target<'a>)>) -> Vec<ReadResult> {
        let mut results: Vec<Option<ReadResult>> = (0..items.len()).map(|_| None).collect();
        let limits = match self.limits() {
            Ok(l) => l,
            Err(e) => return items.iter().map(|_| Err(e.clone())).collect(),
        };
        let max_items = self.max_batch(&limits);
        let key_lens: Vec<usize> = items.iter().map(|i| i.0.len()).collect();
        let mut items: Vec<_> = items.into_iter().map(Some).collect();
        for (start, end) in batches(&key_lens, 11, max_items, &limits) {
            let mut batch: Vec<(&[u8], LenCheck, Target<'a>)> =
                items[start..end].iter_mut().filter_map(Option::take).collect();
            let outcome = self.call("get", |conn, rid| conn.get_batch(rid, &mut batch, self.timeout(), &self.gpu));
            match outcome {
                Ok(per_key) => {
                    for (slot, r) in results[start..end].iter_mut().zip(per_key) {
                        *slot = Some(r);
                    }
                }
                Err(e) => results[start..end].iter_mut().for_each(|slot| *slot = Some(Err(e.clone()))),
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(StoreError::Internal("key result never reported").into())))
            .collect()
    }
}

/// Whether a read goes through the socket although the arena is mapped: one key, into host
/// memory of a known size of at most `STREAM_READ_BYTES`. (A `get` of unknown size keeps the
/// one-copy path.)
fn streams_small_reads(batch: &[(&[u8], LenCheck, Target<'_>)]) -> bool {
    let [(_, check, target)] = batch else { return false };
    let most = match check {
        LenCheck::AtMost(n) | LenCheck::Exactly(n) => *n,
        LenCheck::Any => return false,
    };
    most <= STREAM_READ_BYTES && !matches!(target, Target::Regions(regions) if gpu::names_device(regions))
}

/// Splits items (by key length) into runs that fit one request: at most `max_items`, and a
/// payload of at most the owner's limit (`per_item` bytes of each item besides its key).
fn batches(key_lens: &[usize], per_item: usize, max_items: usize, limits: &Limits) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < key_lens.len() {
        let mut end = start;
        let mut bytes = 16usize;
        while end < key_lens.len() && end - start < max_items {
            let item = key_lens[end] + per_item;
            if end > start && bytes + item > limits.max_payload_bytes as usize {
                break;
            }
            bytes += item;
            end += 1;
        }
        out.push((start, end));
        start = end;
    }
    out
}

fn hello_conn(io: FrameIo, hello: HelloOk, shm: Option<Arc<ShmMapping>>, releases: Arc<Releases>) -> Conn {
    let limits = hello.limits();
    Conn { io, limits, hello, shm, window: WindowState::Untried, broken: false, unconfirmed: Vec::new(), releases }
}

fn check_destination(dst: &Region<'_>) -> Result<()> {
    Ok(checks::host_destination(dst, "device destinations are not supported by the remote client yet")?)
}

fn check_source(src: &Region<'_>) -> Result<()> {
    Ok(checks::host_source(src, "device sources are not supported by the remote client yet")?)
}

/// `[pos, pos + n)` of the concatenation of `sources`, as slices.
fn source_slices<'s>(sources: &'s [Region<'_>], mut pos: u64, mut n: u64) -> Vec<IoSlice<'s>> {
    let mut out = Vec::new();
    for src in sources {
        if n == 0 {
            break;
        }
        let len = src.len() as u64;
        if pos >= len {
            pos -= len;
            continue;
        }
        let take = (len - pos).min(n);
        // SAFETY: host regions are valid for reads for the duration of the call that lent them
        // (Region's contract); `[pos, pos + take)` lies inside this one.
        let bytes = unsafe { std::slice::from_raw_parts((src.addr() + pos) as *const u8, take as usize) };
        out.push(IoSlice::new(bytes));
        n -= take;
        pos = 0;
    }
    out
}

/// Calls `f(addr, len)` for the parts of `regions` covering `[pos, pos + n)` of their
/// concatenation (the caller checked that it lies inside).
fn for_region_parts(
    regions: &[Region<'_>],
    mut pos: u64,
    mut n: u64,
    mut f: impl FnMut(u64, u64) -> WResult<()>,
) -> WResult<()> {
    for r in regions {
        if n == 0 {
            break;
        }
        let len = r.len() as u64;
        if pos >= len {
            pos -= len;
            continue;
        }
        let take = (len - pos).min(n);
        f(r.addr() + pos, take)?;
        n -= take;
        pos = 0;
    }
    Ok(())
}

impl Conn {
    /// Reads a reply header for request `rid`.
    fn read_reply_header(&mut self, rid: u64) -> WResult<FrameHeader> {
        let h = self.io.read_header(&self.limits)?;
        self.releases.confirm(&mut self.unconfirmed);
        if h.request_id != rid {
            return Err(ProtocolError::Invalid { what: "reply to another request" }.into());
        }
        Ok(h)
    }

    /// Reads an `Ok` / `Error` reply.
    fn read_status(&mut self, rid: u64) -> WResult<Result<()>> {
        let h = self.read_reply_header(rid)?;
        let payload = self.io.read_payload(h.payload_len)?;
        match h.op {
            Op::Ok if payload.is_empty() => Ok(Ok(())),
            Op::Error => Ok(Err(decode_error_frame(&payload)?.1)),
            other => Err(ProtocolError::Unexpected { expected: "a status", got: other }.into()),
        }
    }

    /// One `Get` request: leases through shared memory when mapped (unless it is one small
    /// read: `streams_small_reads`), else a stream.
    fn get_batch(
        &mut self,
        rid: u64,
        batch: &mut [(&[u8], LenCheck, Target<'_>)],
        timeout: Duration,
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<Vec<ReadResult>>> {
        if self.shm.is_some() && !streams_small_reads(batch) {
            return self.read_grant_parts(rid, batch, gpu);
        }
        let items: Vec<GetItem<'_>> = batch.iter().map(|(key, check, _)| GetItem { key, check: *check }).collect();
        let start = self.io.begin(Op::Get, rid);
        Request::Get { lease: false, items }.encode(self.io.out());
        self.io.end(start);
        let sent = Instant::now();
        self.io.flush()?;
        let mut targets: Vec<&mut Target<'_>> = batch.iter_mut().map(|(_, _, t)| t).collect();
        let results = self.read_stream(rid, &mut targets, sent + timeout, gpu)?;
        Ok(results.map(|per_item| {
            per_item
                .into_iter()
                .zip(batch.iter_mut())
                .map(|(res, (_, _, target))| {
                    res.map(|len| match target {
                        Target::Owned(v) => (len, Some(std::mem::take(v))),
                        Target::Regions(_) => (len, None),
                    })
                })
                .collect()
        }))
    }

    /// Reads the `GrantsPart` frames of a `GetParts`: copies each part's objects out of the
    /// shared arena into their targets (GPU targets in one submission per part) and releases
    /// the part's leases before reading the next, so the owner can lease further parts.
    fn read_grant_parts(
        &mut self,
        rid: u64,
        batch: &mut [(&[u8], LenCheck, Target<'_>)],
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<Vec<ReadResult>>> {
        let items = batch.iter().map(|(key, check, _)| GetItem { key, check: *check }).collect();
        let slots = batch.len();
        self.get_in_parts(rid, items, slots, gpu, |i, grant, mapping| {
            let (_, check, target) = &mut batch[i];
            let placed = grant.and_then(|g| {
                check.check(g.len)?;
                match target {
                    Target::Regions(regions) if gpu::names_device(regions) => {
                        let host = mapping.addr_of(g.offset, g.len)?;
                        let transfer = Transfer::in_order(host, g.len, &gpu::covering(regions, g.len)?);
                        Ok(((g.len as usize, None), Some(transfer)))
                    }
                    _ => copy_grant(mapping, g.offset, g.len, target).map(|r| (r, None)),
                }
            });
            vec![Placed::of(i, placed)]
        })
    }

    /// Sends a `GetParts` for `items` and works through its parts. `place(item, grant, arena)`
    /// handles one granted (or refused) item: it copies host targets out of the arena itself
    /// and returns, per result slot of the item (`slots` in all), the result and the GPU copy
    /// it still needs. Each part's GPU copies run in one submission; then the part's results
    /// are checked against the lease TTL and its leases released, before the next part is read.
    fn get_in_parts<T>(
        &mut self,
        rid: u64,
        items: Vec<GetItem<'_>>,
        slots: usize,
        gpu: &gpu::ClientGpu,
        mut place: impl FnMut(usize, Result<Grant>, &ShmMapping) -> Vec<Placed<T>>,
    ) -> WResult<Result<Vec<Result<T>>>> {
        let Some(mapping) = self.shm.clone() else {
            return Err(ProtocolError::Invalid { what: "grants without shared memory" }.into());
        };
        let count = items.len();
        let start = self.io.begin(Op::GetParts, rid);
        Request::GetParts { items }.encode(self.io.out());
        self.io.end(start);
        self.io.flush()?;
        let mut results: Vec<Option<Result<T>>> = (0..slots).map(|_| None).collect();
        let mut answered = vec![false; count];
        // A part the owner let this client keep while it leases the next (`NextPart::WhileHeld`):
        // its GPU copies run while the owner leases (or loads) the next part.
        let mut kept: Option<PartCopies> = None;
        loop {
            let h = self.read_reply_header(rid)?;
            let payload = self.io.read_payload(h.payload_len)?;
            let arrived = Instant::now();
            let part = match h.op {
                Op::GrantsPart => GrantsPart::decode(&payload, self.limits.max_items, count, mapping.len())?,
                Op::Error => return Ok(Err(decode_error_frame(&payload)?.1)),
                other => return Err(ProtocolError::Unexpected { expected: "grants", got: other }.into()),
            };
            let mut leases = Vec::with_capacity(part.grants.len());
            let mut in_part = Vec::new();
            // GPU destinations: straight from the arena mapping, one submission per part.
            let mut device: Vec<(usize, Transfer)> = Vec::new();
            for (index, grant) in part.grants {
                let i = index as usize;
                if std::mem::replace(&mut answered[i], true) {
                    return Err(ProtocolError::Invalid { what: "item granted twice" }.into());
                }
                if let Ok(g) = &grant {
                    leases.push(g.lease);
                }
                for Placed { slot, result, device: copy } in place(i, grant, &mapping) {
                    if let Some(copy) = copy {
                        device.push((slot, copy));
                    }
                    in_part.push(slot);
                    results[slot] = Some(result);
                }
            }
            let mut copies = PartCopies {
                inflight: None,
                slots: Vec::new(),
                in_part,
                leases,
                arrived,
                ttl: Duration::from_millis(u64::from(part.ttl_ms)),
            };
            // The kept part goes back now: the owner leases the part after this one once every
            // earlier part is back. With staging, its copies complete before this part's are
            // submitted (a second staged submission would find the staging buffer busy and copy
            // directly); this part was placed meanwhile. Direct copies may overlap.
            let overlap = !device.is_empty() && !gpu.stages();
            if !overlap {
                if let Some(k) = kept.take() {
                    self.finish_part(rid, k, &mut results)?;
                }
            }
            if !device.is_empty() {
                gpu.pin(mapping.memory(), true);
                let (indices, transfers): (Vec<usize>, Vec<Transfer>) = device.into_iter().unzip();
                // SAFETY: the host bytes are leased to this connection until `finish_part`
                // releases them, after the copies completed (or the connection drops, which
                // waits for them first); the device pieces were checked by check_destinations.
                match unsafe { gpu.submit(Direction::HostToDevice, &transfers) } {
                    Ok(inflight) => {
                        copies.inflight = Some(inflight);
                        copies.slots = indices;
                    }
                    Err(e) => indices.into_iter().for_each(|slot| results[slot] = Some(Err(e.clone()))),
                }
            }
            if let Some(k) = kept.take() {
                self.finish_part(rid, k, &mut results)?;
            }
            match part.next {
                NextPart::WhileHeld => kept = Some(copies),
                NextPart::AfterRelease => self.finish_part(rid, copies, &mut results)?,
                NextPart::None => {
                    self.finish_part(rid, copies, &mut results)?;
                    break;
                }
            }
        }
        if answered.contains(&false) || results.iter().any(Option::is_none) {
            return Err(ProtocolError::Invalid { what: "the owner did not answer for every key" }.into());
        }
        Ok(Ok(results.into_iter().map(|r| r.unwrap_or(Err(StoreError::Internal("unanswered").into()))).collect()))
    }

    /// Waits for a part's GPU copies, checks its results against the lease TTL and releases
    /// its leases.
    fn finish_part<T>(&mut self, rid: u64, part: PartCopies, results: &mut [Option<Result<T>>]) -> WResult<()> {
        let PartCopies { inflight, slots, in_part, leases, arrived, ttl } = part;
        if let Some(inflight) = inflight {
            for (slot, outcome) in slots.into_iter().zip(inflight.wait()) {
                if let Err(e) = outcome {
                    results[slot] = Some(Err(StoreError::from(e).into()));
                }
            }
        }
        // The owner keeps leased bytes in place until the TTL; a copy that finished later
        // than that cannot be trusted.
        if arrived.elapsed() + LEASE_MARGIN >= ttl {
            for &slot in &in_part {
                if let Some(r @ Ok(_)) = &mut results[slot] {
                    *r = Err(StoreError::LeaseExpired.into());
                }
            }
        }
        self.send_release(rid, leases)
    }

    /// Sends a one-way `Release` of `leases` (none: nothing).
    pub(super) fn send_release(&mut self, rid: u64, leases: Vec<u64>) -> WResult<()> {
        if leases.is_empty() {
            return Ok(());
        }
        let start = self.io.begin(Op::Release, rid);
        Request::Release { leases }.encode(self.io.out());
        self.io.end(start);
        self.unconfirmed.push(self.releases.sent());
        self.io.flush()
    }

    /// One round trip that touches no shard (an `Exists` of no keys): when it returns, the
    /// owner has applied every frame sent before it on this connection.
    fn round_trip(&mut self, rid: u64) -> WResult<()> {
        let start = self.io.begin(Op::Exists, rid);
        Request::Exists { keys: Vec::new() }.encode(self.io.out());
        self.io.end(start);
        self.io.flush()?;
        let h = self.read_reply_header(rid)?;
        self.io.read_payload(h.payload_len)?;
        match h.op {
            Op::ExistsReply | Op::Error => Ok(()),
            other => Err(ProtocolError::Unexpected { expected: "exists results", got: other }.into()),
        }
    }

    /// Reads `Object`/`Data`/`Abort`/`Error` frames up to `End`, writing each object into its
    /// target. Returns the byte count per item.
    fn read_stream(
        &mut self,
        rid: u64,
        targets: &mut [&mut Target<'_>],
        deadline: Instant,
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<Vec<Result<usize>>>> {
        let mut results: Vec<Option<Result<usize>>> = (0..targets.len()).map(|_| None).collect();
        loop {
            if Instant::now() > deadline {
                return Err(WireError::Timeout);
            }
            let h = self.read_reply_header(rid)?;
            match h.op {
                Op::End => {
                    if h.payload_len != 0 {
                        return Err(ProtocolError::Invalid { what: "end frame" }.into());
                    }
                    break;
                }
                Op::Error => {
                    let payload = self.io.read_payload(h.payload_len)?;
                    let (index, error) = decode_error_frame(&payload)?;
                    if index == WHOLE_REQUEST {
                        return Ok(Err(error));
                    }
                    let slot = results.get_mut(index as usize).ok_or(ProtocolError::Invalid { what: "item index" })?;
                    if slot.is_some() {
                        return Err(ProtocolError::Invalid { what: "item answered twice" }.into());
                    }
                    *slot = Some(Err(error));
                }
                Op::Object => {
                    let payload = self.io.read_payload(h.payload_len)?;
                    let (index, len) = decode_object(&payload)?;
                    let i = index as usize;
                    if i >= targets.len() || results[i].is_some() {
                        return Err(ProtocolError::Invalid { what: "item index" }.into());
                    }
                    results[i] = Some(match &*targets[i] {
                        Target::Regions(regions) if gpu::names_device(regions) => {
                            self.read_object_to_gpu(rid, len, regions, deadline, gpu)?
                        }
                        _ => self.read_object(rid, len, targets[i], deadline)?,
                    });
                }
                other => {
                    return Err(
                        ProtocolError::Unexpected { expected: "an object, an error or the end", got: other }.into()
                    )
                }
            }
        }
        Ok(Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Err(Error::Protocol("the owner did not answer for every key".into()))))
            .collect()))
    }

    /// Reads one object's `Data` frames (or its `Abort`) into GPU `regions` through a
    /// `BouncePair`: each frame is copied on to the GPU while the next one arrives. A failed copy
    /// fails the object; its remaining frames are still read, so the connection stays usable.
    fn read_object_to_gpu(
        &mut self,
        rid: u64,
        len: u64,
        regions: &[Region<'_>],
        deadline: Instant,
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<usize>> {
        let room: u64 = regions.iter().map(|r| r.len() as u64).sum();
        if len > room {
            return Err(ProtocolError::Invalid { what: "object longer than its destination" }.into());
        }
        let mut pair = gpu::BouncePair::new(gpu, gpu::ordinal_of(regions), self.hello.chunk_bytes as usize);
        let mut failed: Option<Error> = None;
        let mut pos = 0u64;
        while pos < len {
            if Instant::now() > deadline {
                return Err(WireError::Timeout);
            }
            let h = self.read_reply_header(rid)?;
            match h.op {
                Op::Data => {
                    let n = u64::from(h.payload_len);
                    let (buffer, room, done) = pair.next_buffer();
                    if n == 0 || n > len - pos || n as usize > room {
                        return Err(ProtocolError::Invalid { what: "data frame length" }.into());
                    }
                    if let Some((Err(e), _)) = done {
                        failed.get_or_insert(e);
                    }
                    // SAFETY: the buffer is the pair's, at least `n` bytes, and its last copy
                    // completed in `next_buffer`.
                    unsafe { self.io.read_raw(buffer, n as usize)? };
                    if failed.is_none() {
                        // SAFETY: the buffer holds the frame; the device regions were checked by
                        // check_destinations and are the caller's for the call.
                        if let Err(e) = unsafe { pair.submit(n, gpu::pieces_of(regions, pos, n), pos + n) } {
                            failed = Some(e);
                        }
                    }
                    pos += n;
                }
                Op::Abort => {
                    let payload = self.io.read_payload(h.payload_len)?;
                    failed.get_or_insert(decode_error_frame(&payload)?.1);
                    break;
                }
                other => return Err(ProtocolError::Unexpected { expected: "data", got: other }.into()),
            }
        }
        for (outcome, _) in pair.drain() {
            if let Err(e) = outcome {
                failed.get_or_insert(e);
            }
        }
        Ok(match failed {
            Some(e) => Err(e),
            None => Ok(len as usize),
        })
    }

    /// Reads one object's `Data` frames (or its `Abort`) into `target`.
    fn read_object(
        &mut self,
        rid: u64,
        len: u64,
        target: &mut Target<'_>,
        deadline: Instant,
    ) -> WResult<Result<usize>> {
        match target {
            Target::Regions(regions) => {
                let room: u64 = regions.iter().map(|r| r.len() as u64).sum();
                if len > room {
                    return Err(ProtocolError::Invalid { what: "object longer than its destination" }.into());
                }
            }
            Target::Owned(v) => {
                v.clear();
                v.reserve(len.min(GET_INITIAL_ALLOC) as usize);
            }
        }
        let mut pos = 0u64;
        while pos < len {
            if Instant::now() > deadline {
                return Err(WireError::Timeout);
            }
            let h = self.read_reply_header(rid)?;
            match h.op {
                Op::Data => {
                    let n = u64::from(h.payload_len);
                    if n == 0 || n > len - pos {
                        return Err(ProtocolError::Invalid { what: "data frame length" }.into());
                    }
                    match target {
                        Target::Regions(regions) => {
                            let io = &mut self.io;
                            for_region_parts(regions, pos, n, |addr, part| {
                                // SAFETY: the region is caller memory lent writable for this
                                // call (checked by check_destination); the part lies inside it.
                                unsafe { io.read_raw(addr as *mut u8, part as usize) }
                            })?;
                        }
                        Target::Owned(v) => {
                            v.reserve(n as usize);
                            // SAFETY: reserve made room for n more bytes; read_raw writes exactly
                            // n bytes there (or fails, and then set_len is not reached).
                            unsafe {
                                self.io.read_raw(v.as_mut_ptr().add(v.len()), n as usize)?;
                                v.set_len(v.len() + n as usize);
                            }
                        }
                    }
                    pos += n;
                }
                Op::Abort => {
                    let payload = self.io.read_payload(h.payload_len)?;
                    let (_, error) = decode_error_frame(&payload)?;
                    return Ok(Err(error));
                }
                other => return Err(ProtocolError::Unexpected { expected: "data", got: other }.into()),
            }
        }
        Ok(Ok(len as usize))
    }
}

/// Copies a granted object out of the shared arena into `target`.
fn copy_grant(mapping: &ShmMapping, offset: u64, len: u64, target: &mut Target<'_>) -> ReadResult {
    match target {
        Target::Regions(regions) => {
            let room = total_len(regions)?;
            if len > room {
                return Err(StoreError::BufferTooSmall { object_bytes: len, buffer_bytes: room }.into());
            }
            let mut pos = 0;
            for r in regions.iter() {
                if pos == len {
                    break;
                }
                let take = (r.len() as u64).min(len - pos);
                // SAFETY: the destination is caller memory lent writable for this call; the
                // source is leased to this connection until we release it, after this copy.
                unsafe { mapping.copy_out(offset + pos, take, r.addr() as *mut u8)? };
                pos += take;
            }
            Ok((len as usize, None))
        }
        Target::Owned(_) => {
            let mut v = Vec::<u8>::with_capacity(len as usize);
            // SAFETY: v has capacity for len bytes; copy_out writes exactly len bytes (or fails
            // before writing, and then set_len is not reached).
            unsafe {
                mapping.copy_out(offset, len, v.as_mut_ptr())?;
                v.set_len(len as usize);
            }
            Ok((len as usize, Some(v)))
        }
    }
}

impl RemoteStore {
    /// Removes in batches of what one request carries; one result per key.
    fn remove_in_batches(&self, keys: &[&[u8]], force: bool) -> Vec<Result<()>> {
        let limits = match self.inner.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<()>> = (0..keys.len()).map(|_| Ok(())).collect();
        let mut valid = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            match self.inner.validate_key(&limits, key) {
                Ok(()) => valid.push(i),
                Err(e) => results[i] = Err(e),
            }
        }
        let key_lens: Vec<usize> = valid.iter().map(|&i| keys[i].len()).collect();
        let max_items = (limits.max_items as usize).min(8192);
        for (start, end) in batches(&key_lens, batch::REMOVE_ITEM_OVERHEAD, max_items, &limits) {
            let chunk = &valid[start..end];
            let batch: Vec<&[u8]> = chunk.iter().map(|&i| keys[i]).collect();
            match self.inner.call("remove", |conn, rid| conn.remove_batch(rid, &batch, force)) {
                Ok(statuses) => chunk.iter().zip(statuses).for_each(|(&i, r)| results[i] = r),
                Err(e) => chunk.iter().for_each(|&i| results[i] = Err(e.clone())),
            }
        }
        results
    }
}

impl Store for RemoteStore {
    type Error = Error;

    fn batch_put_from_multi_buffers(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
    ) -> Vec<Result<()>> {
        if let Err(e) = checks::one_list_per_key(keys.len(), sources.len(), "source") {
            return vec![Err(e.into()); keys.len()];
        }
        let limits = match self.inner.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<()>> = (0..keys.len()).map(|_| Ok(())).collect();
        let mut valid = Vec::with_capacity(keys.len());
        let mut items = Vec::with_capacity(keys.len());
        let lists: Vec<&[Region<'_>]> = sources.iter().map(Vec::as_slice).collect();
        let mut source_checks = self.inner.check_source_lists(&lists).into_iter();
        for (i, (key, srcs)) in keys.iter().zip(sources).enumerate() {
            let source_check = source_checks.next().unwrap_or(Ok(()));
            let checked = self.inner.validate_key(&limits, key).and_then(|()| {
                source_check?;
                let total = total_len(srcs)?;
                if total > limits.max_value_bytes {
                    return Err(StoreError::TooLarge { what: "value", len: total, max: limits.max_value_bytes }.into());
                }
                Ok(total)
            });
            match checked {
                Ok(len) => {
                    valid.push(i);
                    items.push(PutSource { key, sources: srcs, len });
                }
                Err(e) => results[i] = Err(e),
            }
        }
        if items.is_empty() {
            return results;
        }
        let inner = &self.inner;
        match inner.call("put", |conn, _| conn.put_batch(inner, &items, opts)) {
            Ok(statuses) => valid.into_iter().zip(statuses).for_each(|(i, r)| results[i] = r),
            Err(e) => valid.into_iter().for_each(|i| results[i] = Err(e.clone())),
        }
        results
    }

    fn batch_remove(&self, keys: &[&[u8]], force: bool) -> Vec<Result<()>> {
        let released_before = self.inner.releases.last_sent();
        let mut results = self.remove_in_batches(keys, force);
        // Keys leased perhaps only by this client's own reads whose releases are on their way.
        let leased: Vec<usize> =
            (0..keys.len()).filter(|&i| results[i].as_ref().is_err_and(|e| *e == StoreError::Leased)).collect();
        if !force && !leased.is_empty() && self.inner.confirm_releases(released_before) {
            let again: Vec<&[u8]> = leased.iter().map(|&i| keys[i]).collect();
            for (i, r) in leased.into_iter().zip(self.remove_in_batches(&again, force)) {
                results[i] = r;
            }
        }
        results
    }

    fn get(&self, key: &[u8]) -> Result<Vec<u8>> {
        let limits = self.inner.limits()?;
        self.inner.validate_key(&limits, key)?;
        let mut r = self.inner.read_objects(vec![(key, LenCheck::Any, Target::Owned(Vec::new()))]);
        let (_, owned) = r.pop().unwrap_or(Err(StoreError::Internal("no result").into()))?;
        owned.ok_or(StoreError::Internal("no value").into())
    }

    fn get_into(&self, key: &[u8], dst: Region<'_>) -> Result<usize> {
        let limits = self.inner.limits()?;
        self.inner.validate_key(&limits, key)?;
        self.inner.check_destinations(std::slice::from_ref(&dst))?;
        let check = LenCheck::AtMost(dst.len() as u64);
        let mut r = self.inner.read_objects(vec![(key, check, Target::Regions(vec![dst]))]);
        r.pop().unwrap_or(Err(StoreError::Internal("no result").into())).map(|(n, _)| n)
    }

    fn batch_get_into(&self, keys: &[&[u8]], dsts: &[Region<'_>]) -> Vec<Result<usize>> {
        if let Err(e) = checks::one_list_per_key(keys.len(), dsts.len(), "destination") {
            return vec![Err(e.into()); keys.len()];
        }
        let lists: Vec<Vec<Region<'_>>> = dsts.iter().map(|d| vec![*d]).collect();
        self.inner.read_batch(keys, &lists, |regions| Ok(LenCheck::AtMost(total_len(regions)?)))
    }

    fn batch_get_into_multi_buffers(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>]) -> Vec<Result<usize>> {
        if let Err(e) = checks::one_list_per_key(keys.len(), dsts.len(), "destination") {
            return vec![Err(e.into()); keys.len()];
        }
        self.inner.read_batch(keys, dsts, |regions| Ok(LenCheck::Exactly(total_len(regions)?)))
    }

    fn get_into_ranges(&self, buffers: &[Region<'_>], fragments: &[Vec<Fragment>]) -> Vec<Vec<Result<usize>>> {
        let mut results: Vec<Vec<Result<usize>>> = fragments
            .iter()
            .map(|f| (0..f.len()).map(|_| Err(StoreError::Internal("unset").into())).collect())
            .collect();
        let limits = match self.inner.limits() {
            Ok(l) => l,
            Err(e) => return fragments.iter().map(|f| vec![Err(e.clone()); f.len()]).collect(),
        };
        let todo = checks::checked_fragments(
            buffers,
            fragments,
            &mut results,
            |_, buffer| self.inner.check_destinations(std::slice::from_ref(buffer)),
            |key| self.inner.validate_key(&limits, key),
        );
        let shm = self.uses_shared_memory();
        let max_items = self.inner.max_batch(&limits);
        for chunk in todo.chunks(max_items) {
            let outcome = if shm {
                self.ranges_via_leases(buffers, fragments, chunk)
            } else {
                self.ranges_via_stream(buffers, fragments, chunk, &limits)
            };
            for (&(b, f), r) in chunk.iter().zip(outcome) {
                results[b][f] = r;
            }
        }
        results
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool>> {
        let limits = match self.inner.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<bool>> = vec![Ok(false); keys.len()];
        let mut valid = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            match self.inner.validate_key(&limits, key) {
                Ok(()) => valid.push(i),
                Err(e) => results[i] = Err(e),
            }
        }
        let key_lens: Vec<usize> = valid.iter().map(|&i| keys[i].len()).collect();
        for (start, end) in batches(&key_lens, 2, (limits.max_items as usize).min(8192), &limits) {
            let chunk = &valid[start..end];
            let batch: Vec<&[u8]> = chunk.iter().map(|&i| keys[i]).collect();
            let outcome = self.inner.call("exists", |conn, rid| {
                let start = conn.io.begin(Op::Exists, rid);
                Request::Exists { keys: batch.clone() }.encode(conn.io.out());
                conn.io.end(start);
                conn.io.flush()?;
                let h = conn.read_reply_header(rid)?;
                let payload = conn.io.read_payload(h.payload_len)?;
                match h.op {
                    Op::ExistsReply => {
                        let found = decode_exists(&payload, conn.limits.max_items)?;
                        if found.len() != batch.len() {
                            return Err(ProtocolError::Invalid { what: "exists result count" }.into());
                        }
                        Ok(Ok(found))
                    }
                    Op::Error => Ok(Err(decode_error_frame(&payload)?.1)),
                    other => Err(ProtocolError::Unexpected { expected: "exists results", got: other }.into()),
                }
            });
            match outcome {
                Ok(found) => chunk.iter().zip(found).for_each(|(&i, f)| results[i] = f),
                Err(e) => chunk.iter().for_each(|&i| results[i] = Err(e.clone())),
            }
        }
        results
    }

    fn remove(&self, key: &[u8], force: bool) -> Result<()> {
        self.simple("remove", Request::Remove { key, force })
    }

    fn scan_keys(&self, prefix: &[u8], cursor: u64, limit: usize) -> Result<kvtide::KeyPage> {
        let limits = self.inner.limits()?;
        if prefix.len() > limits.max_key_bytes as usize {
            let max = u64::from(limits.max_key_bytes);
            return Err(StoreError::TooLarge { what: "prefix", len: prefix.len() as u64, max }.into());
        }
        let limit = limit.clamp(1, kvtide::MAX_SCAN_KEYS.min(limits.max_items as usize)) as u32;
        self.inner.call("scan_keys", |conn, rid| {
            let start = conn.io.begin(Op::ScanKeys, rid);
            Request::ScanKeys { prefix, cursor, limit }.encode(conn.io.out());
            conn.io.end(start);
            conn.io.flush()?;
            let h = conn.read_reply_header(rid)?;
            let payload = conn.io.read_payload(h.payload_len)?;
            match h.op {
                Op::KeyPage => {
                    let page = decode_key_page(&payload, &conn.limits)?;
                    if page.keys.len() > limit as usize || page.keys.iter().any(|k| !k.starts_with(prefix)) {
                        return Err(ProtocolError::Invalid { what: "key page" }.into());
                    }
                    Ok(Ok(page))
                }
                Op::Error => Ok(Err(decode_error_frame(&payload)?.1)),
                other => Err(ProtocolError::Unexpected { expected: "a key page", got: other }.into()),
            }
        })
    }

    fn pin(&self, key: &[u8]) -> Result<()> {
        self.simple("pin", Request::Pin { key })
    }

    fn unpin(&self, key: &[u8]) -> Result<()> {
        self.simple("unpin", Request::Unpin { key })
    }

    fn stats(&self) -> Stats {
        self.try_stats().unwrap_or_default()
    }

    fn submit_batch_get(&self, keys: &[&[u8]], dsts: Vec<Vec<Region<'static>>>) -> Result<Ticket<Vec<Result<usize>>>> {
        checks::one_list_per_key(keys.len(), dsts.len(), "destination")?;
        let limit = self.inner.options.max_tickets_in_flight;
        let in_flight = Arc::clone(&self.inner.tickets_in_flight);
        if in_flight.fetch_add(1, Ordering::AcqRel) >= limit as u64 {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Busy { limit }.into());
        }
        let (ticket, completion) = Ticket::pending();
        let store = RemoteStore { inner: Arc::clone(&self.inner) };
        let owned_keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
        let worker_in_flight = Arc::clone(&in_flight);
        let spawned = std::thread::Builder::new().name("kvtide-remote-ticket".into()).spawn(move || {
            let results = if completion.is_cancelled() {
                (0..owned_keys.len()).map(|_| Err(StoreError::Cancelled.into())).collect()
            } else {
                let keys: Vec<&[u8]> = owned_keys.iter().map(Vec::as_slice).collect();
                store.batch_get_into_multi_buffers(&keys, &dsts)
            };
            worker_in_flight.fetch_sub(1, Ordering::AcqRel);
            completion.complete(results);
        });
        if let Err(e) = spawned {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Io(format!("cannot start a ticket thread: {e}")).into());
        }
        Ok(ticket)
    }
}

impl RemoteStore {
    fn simple(&self, op: &'static str, request: Request<'_>) -> Result<()> {
        let limits = self.inner.limits()?;
        let key = match &request {
            Request::Remove { key, .. } | Request::Pin { key } | Request::Unpin { key } => *key,
            _ => return Err(StoreError::Internal("not a single-key request").into()),
        };
        self.inner.validate_key(&limits, key)?;
        let send = || {
            self.inner.call(op, |conn, rid| {
                let start = conn.io.begin(request.op(), rid);
                request.encode(conn.io.out());
                conn.io.end(start);
                conn.io.flush()?;
                conn.read_status(rid)
            })
        };
        let released_before = self.inner.releases.last_sent();
        let result = send();
        // Leased perhaps only by this client's own read whose release is still on its way.
        if matches!(request, Request::Remove { force: false, .. })
            && result.as_ref().is_err_and(|e| *e == StoreError::Leased)
            && self.inner.confirm_releases(released_before)
        {
            return send();
        }
        result
    }

    /// Ranges over shared memory: lease each key once, copy each fragment out of the arena.
    fn ranges_via_leases(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        chunk: &[(usize, usize)],
    ) -> Vec<Result<usize>> {
        let mut keys: Vec<&[u8]> = Vec::new();
        let mut key_of = Vec::with_capacity(chunk.len());
        let mut index = std::collections::HashMap::new();
        for &(b, f) in chunk {
            let key = fragments[b][f].key.as_slice();
            let k = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                keys.len() - 1
            });
            key_of.push(k);
        }
        // The fragments of each key, by their place in `chunk`.
        let mut frags_of: Vec<Vec<usize>> = vec![Vec::new(); keys.len()];
        for (n, &k) in key_of.iter().enumerate() {
            frags_of[k].push(n);
        }
        let outcome = self.inner.call("get_into_ranges", |conn, rid| {
            // Leased in parts, as batch gets are, so SSD-heavy ranges stream through DRAM.
            let items = keys.iter().map(|key| GetItem { key, check: LenCheck::Any }).collect();
            conn.get_in_parts(rid, items, chunk.len(), &self.inner.gpu, |k, grant, mapping| {
                frags_of[k]
                    .iter()
                    .map(|&n| {
                        let (b, f) = chunk[n];
                        let frag = &fragments[b][f];
                        let placed = grant.clone().and_then(|g| {
                            kvtide_transport::region::check_range("object", frag.src_offset, frag.len, g.len)?;
                            let dst = buffers[b].slice(frag.dst_offset, frag.len)?;
                            if gpu::names_device(std::slice::from_ref(&dst)) {
                                let host = mapping.addr_of(g.offset + frag.src_offset, frag.len)?;
                                return Ok((frag.len as usize, Some(Transfer::in_order(host, frag.len, &[dst]))));
                            }
                            // SAFETY: dst is a checked slice of a caller buffer lent writable for
                            // this call; the source is leased to this connection until the part
                            // is released.
                            unsafe { mapping.copy_out(g.offset + frag.src_offset, frag.len, dst.addr() as *mut u8)? };
                            Ok((frag.len as usize, None))
                        });
                        Placed::of(n, placed)
                    })
                    .collect()
            })
        });
        match outcome {
            Ok(r) => r,
            Err(e) => vec![Err(e); chunk.len()],
        }
    }

    /// Ranges over a stream: the owner sends each fragment's bytes.
    fn ranges_via_stream(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        chunk: &[(usize, usize)],
        limits: &Limits,
    ) -> Vec<Result<usize>> {
        let mut keys: Vec<&[u8]> = Vec::new();
        let mut index = std::collections::HashMap::new();
        let mut items = Vec::with_capacity(chunk.len());
        let mut payload_bytes = 8usize;
        for &(b, f) in chunk {
            let frag = &fragments[b][f];
            let key = frag.key.as_slice();
            let k = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                payload_bytes += key.len() + 2;
                keys.len() - 1
            });
            payload_bytes += 20;
            items.push(RangeItem { key_index: k as u32, src_offset: frag.src_offset, len: frag.len });
        }
        if payload_bytes > limits.max_payload_bytes as usize {
            // Too big for one frame: split in halves.
            let (a, b) = chunk.split_at(chunk.len() / 2);
            if a.is_empty() {
                return vec![
                    Err(StoreError::TooLarge {
                        what: "fragment",
                        len: payload_bytes as u64,
                        max: limits.max_payload_bytes.into()
                    }
                    .into());
                    chunk.len()
                ];
            }
            let mut out = self.ranges_via_stream(buffers, fragments, a, limits);
            out.extend(self.ranges_via_stream(buffers, fragments, b, limits));
            return out;
        }
        let timeout = self.inner.timeout();
        let outcome = self.inner.call("get_into_ranges", |conn, rid| {
            let start = conn.io.begin(Op::GetRanges, rid);
            Request::GetRanges { keys: keys.clone(), fragments: items.clone() }.encode(conn.io.out());
            conn.io.end(start);
            let sent = Instant::now();
            conn.io.flush()?;
            let mut targets: Vec<Target<'_>> = Vec::with_capacity(chunk.len());
            for &(b, f) in chunk {
                let frag = &fragments[b][f];
                match buffers[b].slice(frag.dst_offset, frag.len) {
                    Ok(dst) => targets.push(Target::Regions(vec![dst])),
                    // Checked before; an empty target makes a mismatch a protocol error.
                    Err(_) => targets.push(Target::Regions(Vec::new())),
                }
            }
            let mut refs: Vec<&mut Target<'_>> = targets.iter_mut().collect();
            conn.read_stream(rid, &mut refs, sent + timeout, &self.inner.gpu)
        });
        match outcome {
            Ok(r) => r,
            Err(e) => vec![Err(e); chunk.len()],
        }
    }
}
