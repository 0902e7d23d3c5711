//! The connections of one `RemoteStore` and what they share.
//!
//! Owns `Pool`: the idle connections (checked out one per concurrent call, checked back in
//! unless broken), connecting and the handshake (token proof, the arena mapping shared by every
//! connection to the same owner instance), the retry of a call once on a fresh connection when
//! its pooled one turns out dead, the owner's limits as of the last handshake, and the
//! confirmation of the lease releases sent on idle connections. Never decides what a call
//! sends (the facade and the connection do), never holds a hold's or a stream-bound read's
//! connection (those stay out of the pool while they hold leases), and never reuses a
//! connection that failed.

use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvtide::Error as StoreError;

use super::conn::{hello_conn, reply_of, Conn, Releases};
use super::index_reads::IndexReadLog;
use super::options::{ClientOptions, Endpoint};
use crate::error::{Error, Result};
use crate::protocol::{
    decode_mac, Hello, HelloOk, Limits, Op, ProtocolError, Request, UcxReady, HELLO_AUTH_REQUIRED, HELLO_SHM_ATTACHED,
    HELLO_WANT_SHM, NONCE_BYTES,
};
use crate::shm::ShmMapping;
use crate::sock::{self, Stream};
use crate::wire::{FrameIo, WResult, WireError};

/// How long a client that was refused the UCX plane (or could not reach it) reads over TCP
/// before a new connection asks again.
const UCX_RETRY_AFTER: Duration = Duration::from_secs(2);

/// True for a connection that asked for the UCX plane, was left on TCP and has been for the
/// retry interval: it is not reused, so a new connection asks again.
fn off_plane_too_long(conn: &Conn) -> bool {
    conn.off_plane_since.is_some_and(|at| at.elapsed() >= UCX_RETRY_AFTER)
}

/// The connections to one owner: the idle ones, how to make more, and what they share.
pub(super) struct Pool {
    pub(super) endpoint: Endpoint,
    pub(super) options: ClientOptions,
    /// Idle connections, at most `max_idle_connections`.
    idle: Mutex<Vec<Conn>>,
    /// The owner's arena, mapped once per owner instance and shared by its connections.
    /// Read-locked by every read that tries the read index.
    pub(super) mapping: RwLock<Option<Arc<ShmMapping>>>,
    pub(super) next_request: AtomicU64,
    last_limits: Mutex<Option<Limits>>,
    last_max_leases: AtomicU64,
    /// Lease releases sent and not yet known applied by the owner.
    pub(super) releases: Arc<Releases>,
    /// Reads through the read index not yet reported to the owner.
    index_reads: IndexReadLog,
    /// The UCX plane this client uses, when `ucx_transports` is set.
    pub(super) ucx: Mutex<UcxState>,
    /// The last connection opened reads over the UCX plane.
    pub(super) ucx_ready: AtomicBool,
}

/// The client's UCX context (made at the first attach) and the owner instance whose plane was
/// refused or failed here (not asked again for `UCX_RETRY_AFTER`).
#[derive(Default)]
pub(super) struct UcxState {
    context: Option<Arc<crate::ucx::Context>>,
    /// The owner instance whose plane was refused or failed here, and when: not asked again
    /// for `UCX_RETRY_AFTER` (the plane's process may be restarting).
    refused: Option<(u64, Instant)>,
    /// Why the last attach left a connection on TCP.
    pub(super) last_refusal: Option<String>,
}

impl Pool {
    /// A pool for the owner at `address`, with one connection made (so a wrong address, token
    /// or protocol version is reported here) and idle.
    pub(super) fn connect(address: &str, options: ClientOptions) -> Result<Pool> {
        let pool = Pool {
            endpoint: Endpoint::parse(address)?,
            options,
            idle: Mutex::new(Vec::new()),
            mapping: RwLock::new(None),
            next_request: AtomicU64::new(1),
            last_limits: Mutex::new(None),
            last_max_leases: AtomicU64::new(u64::MAX),
            releases: Arc::default(),
            index_reads: IndexReadLog::default(),
            ucx: Mutex::default(),
            ucx_ready: AtomicBool::new(false),
        };
        if let Some(list) = &pool.options.ucx_transports {
            crate::ucx::Transports::parse(list, pool.options.ucx_allow_tcp)
                .map_err(|e| StoreError::InvalidArgument(e.to_string()))?;
        }
        let conn = pool.open()?;
        pool.checkin(conn);
        Ok(pool)
    }

    /// The arena mapping, when the owner's read index is mapped with it and reads may use it.
    pub(super) fn read_index(&self) -> Option<Arc<ShmMapping>> {
        if !self.options.read_index {
            return None;
        }
        let current = self.mapping.read().unwrap_or_else(|p| p.into_inner());
        current.as_ref().filter(|m| m.read_index().is_some()).map(Arc::clone)
    }

    pub(super) fn timeout(&self) -> Duration {
        Duration::from_millis(self.options.timeout_ms)
    }

    /// Notes reads made through the read index, and reports them on an idle connection when
    /// a report is due.
    pub(super) fn note_index_reads(&self, entries: &[(u32, u32, u32)]) {
        if self.index_reads.note(entries) {
            self.report_index_reads();
        }
    }

    /// Sends the unreported index reads on an idle connection (kept for later when none is
    /// idle; lost with a connection that fails to send them).
    pub(super) fn report_index_reads(&self) {
        let Some(mut conn) = self.checkout() else { return };
        let rid = self.next_request.fetch_add(1, Ordering::Relaxed);
        if !self.index_reads.push_to(&mut conn, rid) || conn.io.flush().is_ok() {
            self.checkin(conn);
        }
    }

    pub(super) fn checkout(&self) -> Option<Conn> {
        loop {
            let conn = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
            // A UCX endpoint that failed while the connection sat idle (its peer process
            // restarted or stalled): the connection goes, and the next one attaches again.
            // One left off the plane for longer than the retry interval goes too: the next
            // connection asks for the plane again.
            if !off_plane_too_long(&conn) && conn.ucx.as_ref().is_none_or(|u| u.is_usable()) {
                return Some(conn);
            }
        }
    }

    /// Confirms the releases sent up to `through` (`Releases::last_sent` before a request):
    /// one round trip on each idle connection that carried one, and a wait for those other
    /// threads hold (a second at most: one parked on a slow producer's stream need not hold
    /// this up).
    pub(super) fn confirm_idle_releases(&self, through: u64) {
        let flagged: Vec<Conn> = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let (flagged, rest): (Vec<Conn>, Vec<Conn>) = idle.drain(..).partition(|c| !c.unconfirmed.is_empty());
            *idle = rest;
            flagged
        };
        for mut conn in flagged {
            let rid = self.next_request.fetch_add(1, Ordering::Relaxed);
            if conn.round_trip(rid).is_ok() {
                self.checkin(conn);
            }
        }
        self.releases.wait_through(through, self.timeout().min(Duration::from_secs(1)));
    }

    pub(super) fn checkin(&self, conn: Conn) {
        // A UCX endpoint that failed once is closed: the connection goes, and the next one
        // attaches again (to the owner's restarted plane, say).
        if conn.broken || conn.ucx.as_ref().is_some_and(|u| u.is_closed()) {
            return;
        }
        // A TCP connection left off the plane while the plane is in use again (see `open`), or
        // for longer than the retry interval (a new connection asks for the plane again).
        let plane_in_use = self.options.ucx_transports.is_some() && self.ucx_ready.load(Ordering::Relaxed);
        if (conn.ucx.is_none() && plane_in_use) || off_plane_too_long(&conn) {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < self.options.max_idle_connections {
            idle.push(conn);
        }
    }

    /// Runs one request on a pooled (or new) connection, which goes back to the pool after.
    /// A pooled connection that turns out dead is dropped with the rest of the pool (the owner
    /// restarted) and the request is retried once on a new connection.
    pub(super) fn call<T>(&self, op: &'static str, f: impl FnMut(&mut Conn, u64) -> WResult<Result<T>>) -> Result<T> {
        let (conn, _, answer) = self.call_keeping(op, f)?;
        self.checkin(conn);
        Ok(answer)
    }

    /// `call` for a request whose connection the caller goes on using (a stream that follows
    /// the answer): returns the connection with the request id and the answer. An answer that
    /// is the owner's refusal checks the connection back in.
    pub(super) fn call_keeping<T>(
        &self,
        op: &'static str,
        mut f: impl FnMut(&mut Conn, u64) -> WResult<Result<T>>,
    ) -> Result<(Conn, u64, T)> {
        let mut pooled = self.checkout();
        let mut ucx_retried = false;
        loop {
            let reused = pooled.is_some();
            let mut conn = match pooled.take() {
                Some(c) => c,
                None => self.open()?,
            };
            let rid = self.next_request.fetch_add(1, Ordering::Relaxed);
            // Reads through the index reach the owner ahead of this request, in its write.
            self.index_reads.push_to(&mut conn, rid);
            match f(&mut conn, rid) {
                // The UCX endpoint failed during the call (the plane's process died or stalled):
                // its reads failed without a byte reported, so the call runs once more on a new
                // connection, which attaches anew (or reads over TCP while the plane restarts).
                Ok(Ok(_)) if !ucx_retried && conn.ucx.as_ref().is_some_and(|u| u.is_closed()) => {
                    ucx_retried = true;
                    // Not asked again for a while: the retry, and the calls after it, read over
                    // TCP (a plane that stopped answering would fail every one of them).
                    let mut state = self.ucx.lock().unwrap_or_else(|p| p.into_inner());
                    state.refused = Some((conn.hello.instance_id, Instant::now()));
                    state.last_refusal = Some(format!(
                        "a read over the UCX plane failed; reads go over TCP for {} s before it is tried again",
                        UCX_RETRY_AFTER.as_secs()
                    ));
                }
                Ok(Ok(answer)) => return Ok((conn, rid, answer)),
                Ok(Err(refused)) => {
                    self.checkin(conn);
                    return Err(refused);
                }
                Err(WireError::Closed(_) | WireError::Io(_)) if reused => {
                    self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
                }
                Err(e) => return Err(e.into_error(op, self.options.timeout_ms)),
            }
        }
    }

    /// Connects to the owner and does the handshake (`handshake`); the connection is not pooled yet.
    pub(super) fn open(&self) -> Result<Conn> {
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
        let mut conn = hello_conn(io, hello.0, hello.1, Arc::clone(&self.releases));
        if self.options.read_index {
            conn.ask_read_index().map_err(|e| e.into_error("read index", self.options.connect_timeout_ms))?;
        }
        if matches!(self.endpoint, Endpoint::Tcp(_)) && self.options.ucx_transports.is_some() {
            conn.ucx =
                self.attach_ucx(&mut conn).map_err(|e| e.into_error("UCX attach", self.options.connect_timeout_ms))?;
            if conn.ucx.is_some() {
                // Calls that choose the leased path from `ucx_ready` (ranges) must find only
                // attached connections: those opened while the plane was refused go first.
                self.idle.lock().unwrap_or_else(|p| p.into_inner()).retain(|c| c.ucx.is_some());
            }
            self.ucx_ready.store(conn.ucx.is_some(), Ordering::Relaxed);
            if conn.ucx.is_none() {
                conn.off_plane_since = Some(Instant::now());
            }
        }
        *self.last_limits.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn.hello.limits());
        self.last_max_leases.store(conn.hello.max_leases.into(), Ordering::Relaxed);
        Ok(conn)
    }

    pub(super) fn handshake(&self, io: &mut FrameIo) -> WResult<Result<(HelloOk, Option<Arc<ShmMapping>>)>> {
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
        let hello = match reply_of(h.op, &payload, Op::HelloOk, "hello reply", |p| Ok(HelloOk::decode(p)?))? {
            Ok(hello) => hello,
            Err(e) => return Ok(Err(e)),
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
            let owner_proof = match reply_of(h.op, &payload, Op::AuthOk, "auth reply", |p| Ok(decode_mac(p)?))? {
                Ok(proof) => proof,
                Err(e) => return Ok(Err(e)),
            };
            if !token.verify_owner(&client_nonce, &hello.server_nonce, &owner_proof) {
                return Ok(Err(Error::Unauthorized("the owner could not prove it knows the token".into())));
            }
        }
        let mut mapping = None;
        if hello.flags & HELLO_SHM_ATTACHED != 0 {
            let Some(fd) = fd else {
                return Err(ProtocolError::Invalid { what: "shared memory announced without a descriptor" }.into());
            };
            let mut current = self.mapping.write().unwrap_or_else(|p| p.into_inner());
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

    /// Attaches `conn` to the owner's UCX plane: its reader, or None (warned) when the owner
    /// refuses, its answer does not check out or UCX cannot connect; the connection then reads
    /// over TCP. Only a failure of the connection itself is an error.
    fn attach_ucx(&self, conn: &mut Conn) -> WResult<Option<Arc<crate::ucx::UcxArena>>> {
        let instance = conn.hello.instance_id;
        let lock = || self.ucx.lock().unwrap_or_else(|p| p.into_inner());
        let mut state = lock();
        // UCX unpacks the worker address and remote key as it finds them: they are taken only
        // from an owner that proved it knows the token, or one on this host's loopback.
        if conn.hello.flags & HELLO_AUTH_REQUIRED == 0 && !conn.io.stream().is_loopback() {
            state.last_refusal =
                Some("the owner did not prove a token (the UCX plane is taken only from one that does)".into());
            return Ok(None);
        }
        if state.refused.is_some_and(|(i, at)| i == instance && at.elapsed() < UCX_RETRY_AFTER) {
            return Ok(None);
        }
        // Not held over the round trip and the first read of the plane (seconds, when it does
        // not answer): other connections open meanwhile.
        drop(state);
        let request = Request::UcxAttach { version: crate::ucx::UCX_PLANE_VERSION };
        // Decoded below, so a damaged answer leaves the connection in step and on TCP.
        let answer = conn.request(0, &request, Op::UcxReady, "the UCX plane", |_, p| Ok(p.to_vec()))?;
        let attached = answer
            .map_err(|e| e.to_string())
            .and_then(|payload| UcxReady::decode(&payload).map_err(|e| format!("its answer: {e}")))
            .and_then(|ready| {
                let context = {
                    let mut state = lock();
                    match &state.context {
                        Some(c) => Arc::clone(c),
                        None => {
                            let list = self.options.ucx_transports.as_deref().unwrap_or_default();
                            let context = crate::ucx::Transports::parse(list, self.options.ucx_allow_tcp)
                                .and_then(|t| crate::ucx::client_context(&t, conn.io.stream().is_loopback()))
                                .map_err(|e| e.to_string())?;
                            state.context = Some(Arc::clone(&context));
                            context
                        }
                    }
                };
                crate::ucx::UcxArena::connect(&context, &ready, self.timeout()).map_err(|e| e.to_string())
            });
        let mut state = lock();
        match attached {
            Ok(arena) => {
                state.refused = None;
                state.last_refusal = None;
                Ok(Some(Arc::new(arena)))
            }
            Err(why) => {
                tracing::warn!(owner = %self.endpoint, reason = %why, "not reading over the UCX plane; reads stay on TCP");
                state.refused = Some((instance, Instant::now()));
                state.last_refusal = Some(why);
                Ok(None)
            }
        }
    }

    /// The limits of the owner as of the last handshake (connecting if there was none).
    pub(super) fn limits(&self) -> Result<Limits> {
        if let Some(l) = *self.last_limits.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(l);
        }
        let conn = self.open()?;
        let limits = conn.limits;
        self.checkin(conn);
        Ok(limits)
    }

    /// Most keys per request: the owner's item limit, and its lease limit when leasing.
    pub(super) fn max_batch(&self, limits: &Limits) -> usize {
        let leases = self.last_max_leases.load(Ordering::Relaxed).max(1) as usize;
        (limits.max_items as usize).min(leases).min(4096)
    }
}
