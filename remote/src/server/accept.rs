//! Accepting connections and their handshake: the listeners, the accept loop, admission (a
//! slot, or a refusal with `Busy`), and the hello and token authentication every connection
//! starts with.
//!
//! Owns connection admission: which slots a peer may take (TCP peers that have not
//! authenticated yet get their own few), the handshake deadline, and what the arena mapping is
//! offered to. Never blocks the accept loop on a peer (refusals are non-blocking sends) and never
//! serves a request.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::Error as StoreError;

use super::config::{OwnerConfig, OwnerError};
use super::connection::Connection;
use super::reply::Reply;
use super::shared::{Job, Shared, Slot};
use crate::auth::Token;
use crate::error::Error;
use crate::protocol::{
    Hello, HelloOk, Limits, Op, ProtocolError, HELLO_AUTH_REQUIRED, HELLO_SHM_ATTACHED, HELLO_WANT_SHM, MAC_BYTES,
    NONCE_BYTES, WHOLE_REQUEST,
};
use crate::sock::{self, Stream};
use crate::wire::{WResult, WireError};

/// A refused connection is kept this long (at most `MAX_LINGERING` of them per listener), so
/// that closing it does not reset it before the client read why.
const REFUSAL_LINGER: Duration = Duration::from_millis(500);

const MAX_LINGERING: usize = 64;

pub(super) enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// The configured listeners, bound.
pub(super) struct Bound {
    pub(super) listeners: Vec<Listener>,
    /// The Unix socket's path, when serving one.
    pub(super) unix_path: Option<PathBuf>,
    /// The TCP address actually bound (the real port when 0 was asked for).
    pub(super) tcp_addr: Option<SocketAddr>,
}

/// Binds the configured listeners: the Unix socket (its mode and group, a stale file replaced)
/// and the TCP address.
pub(super) fn bind_listeners(config: &OwnerConfig) -> std::result::Result<Bound, OwnerError> {
    let mut listeners = Vec::new();
    let mut unix_path = None;
    if let Some(path) = &config.unix_socket {
        listeners.push(Listener::Unix(super::socket_file::bind(
            path,
            config.unix_socket_mode,
            config.unix_socket_group,
        )?));
        unix_path = Some(path.clone());
    }
    let mut tcp_addr = None;
    if let Some(addr) = config.tcp {
        let listener =
            TcpListener::bind(addr).map_err(|source| OwnerError::Bind { what: format!("tcp {addr}"), source })?;
        tcp_addr = Some(listener.local_addr().map_err(|e| OwnerError::Io(e.to_string()))?);
        listeners.push(Listener::Tcp(listener));
    }
    Ok(Bound { listeners, unix_path, tcp_addr })
}

pub(super) fn accept_loop(shared: &Arc<Shared>, listener: Listener) {
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

/// Tells a connection it cannot be served, without blocking: the error goes out with a
/// non-blocking send (a fresh socket has room for it) and the write side is shut. Returns the
/// socket unless the client is already gone: closing it while the client's bytes are unread would
/// reset the connection before the client read the error, so the caller keeps it a moment.
fn refuse(stream: Stream, error: &Error) -> Option<Stream> {
    if stream.set_nonblocking(true).is_err() {
        return None;
    }
    let frame = Reply::Error { index: WHOLE_REQUEST, error }.frame(0);
    let _ = sock::send_all(stream.fd(), &[IoSlice::new(&frame)], None);
    stream.shutdown_write();
    (!sock::drain(stream.fd())).then_some(stream)
}

impl Connection<'_> {
    /// Answers `Busy` when an authenticated TCP peer finds no free connection slot.
    fn refuse_slot(&mut self, request_id: u64) -> WResult<()> {
        self.shared.counters.connections_refused.fetch_add(1, Ordering::Relaxed);
        let limit = self.config().max_connections;
        self.reply_error(request_id, &StoreError::Busy { limit }.into());
        self.io.flush()?;
        Err(WireError::Closed("no free connection slot".into()))
    }

    /// Hello (and for TCP with a token, authentication), all within `handshake_timeout_ms` of
    /// the accept, however the peer spaces its bytes.
    pub(super) fn handshake(&mut self, accepted_at: Instant) -> WResult<()> {
        let timeout = Duration::from_millis(self.config().handshake_timeout_ms);
        self.io.set_read_deadline(Some(accepted_at + timeout));
        self.io.stream().set_timeouts(Some(timeout))?;
        let hello_limits = Limits { max_payload_bytes: 4096, ..self.shared.limits };
        let (request_id, hello) = self.read_hello(&hello_limits)?;
        let mut server_nonce = [0u8; NONCE_BYTES];
        sock::random_bytes(&mut server_nonce)?;
        let auth = if self.unix { None } else { self.config().tcp_token.clone() };
        if auth.is_none() && !self.slot.promote() {
            return self.refuse_slot(request_id);
        }
        let shm = self.unix && hello.flags & HELLO_WANT_SHM != 0 && self.shared.shm_fd.is_some();
        let reply = self.hello_ok(auth.is_some(), shm, server_nonce);
        self.reply(request_id, Reply::HelloOk(&reply));
        match auth {
            None => {
                let fd = if shm { self.shared.shm_fd.as_ref().map(|fd| fd.as_fd()) } else { None };
                self.io.flush_with_fd(fd)?;
            }
            Some(token) => {
                self.io.flush()?;
                self.authenticate(&token, &hello_limits, &server_nonce, &hello.client_nonce)?;
            }
        }
        self.io.set_read_deadline(None);
        let io_timeout = Duration::from_millis(self.config().io_timeout_ms);
        self.io.stream().set_timeouts(Some(io_timeout))?;
        self.io.set_spin(Duration::from_micros(self.config().spin_us));
        Ok(())
    }

    /// The client's `Hello` and its request id; anything else is answered and ends the
    /// connection.
    fn read_hello(&mut self, hello_limits: &Limits) -> WResult<(u64, Hello)> {
        let header = match self.io.read_header(hello_limits) {
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
        match Hello::decode(&payload) {
            Ok(hello) => Ok((header.request_id, hello)),
            Err(e) => {
                self.fatal(header.request_id, &e.clone().into());
                Err(e.into())
            }
        }
    }

    /// The owner's answer to a hello: its limits, its challenge, and the arena when it rides
    /// along (`shm`).
    fn hello_ok(&self, auth_required: bool, shm: bool, server_nonce: [u8; NONCE_BYTES]) -> HelloOk {
        let mut flags = 0;
        if auth_required {
            flags |= HELLO_AUTH_REQUIRED;
        }
        if shm {
            flags |= HELLO_SHM_ATTACHED;
        }
        let config = self.config();
        HelloOk {
            flags,
            max_payload_bytes: config.max_payload_bytes,
            chunk_bytes: config.chunk_bytes,
            max_items: config.max_items,
            max_leases: config.max_leases_per_connection,
            lease_ttl_ms: config.lease_ttl_ms,
            max_key_bytes: self.shared.limits.max_key_bytes,
            max_value_bytes: self.shared.limits.max_value_bytes,
            server_nonce,
            instance_id: self.shared.instance_id,
            arena_bytes: if shm { self.shared.arena_bytes } else { 0 },
        }
    }

    /// A TCP client's proof that it knows `token`, then a connection slot and the owner's own
    /// proof; a missing or wrong proof is answered and ends the connection.
    fn authenticate(
        &mut self,
        token: &Token,
        hello_limits: &Limits,
        server_nonce: &[u8; NONCE_BYTES],
        client_nonce: &[u8; NONCE_BYTES],
    ) -> WResult<()> {
        let h = self.io.read_header(hello_limits)?;
        if h.op != Op::Auth || h.payload_len as usize != MAC_BYTES {
            self.shared.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            self.fatal(h.request_id, &Error::Unauthorized("expected an authentication proof".into()));
            return Err(WireError::Closed("no authentication".into()));
        }
        let mut proof = [0u8; MAC_BYTES];
        self.io.read_exact(&mut proof)?;
        if !token.verify_client(server_nonce, client_nonce, &proof) {
            self.shared.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("TCP client failed authentication (wrong token)");
            self.fatal(h.request_id, &Error::Unauthorized("wrong token".into()));
            return Err(WireError::Closed("wrong token".into()));
        }
        if !self.slot.promote() {
            return self.refuse_slot(h.request_id);
        }
        let owner_proof = token.owner_proof(client_nonce, server_nonce);
        self.reply(h.request_id, Reply::AuthOk(&owner_proof));
        self.io.flush()
    }
}
