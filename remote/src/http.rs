//! The owner's HTTP listener (`[owner] http_addr`): `GET /metrics`, `GET /health`, `GET /ready`,
//! `GET /version` and `POST /drain` on one TCP address, for platforms to scrape and probe.
//!
//! Owns the listener and its accept thread, the short-lived threads that each answer one request
//! (at most `MAX_IN_FLIGHT` at once; past that the accept thread answers 503 itself), the
//! owner's readiness (`HttpState`: starting, serving, draining, drained, stopping) and the drain
//! it starts. It never serves the store's protocol and never keeps a connection past one answer;
//! a request head must arrive within `MAX_REQUEST_HEAD` bytes and `REQUEST_DEADLINE`, a body
//! within `MAX_BODY_BYTES`, so a slow or hostile client holds one of those threads for at most
//! that long and never the listener. `/health` reads nothing and `/ready` only atomics: both
//! answer while the owner is busy. `POST /drain` is accepted from loopback peers only (the
//! listener has no authentication).

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtide::Store;

use crate::metrics::{GIT_COMMIT, VERSION};
use crate::server::Owner;

/// A request head (request line and headers) larger than this is refused (431).
const MAX_REQUEST_HEAD: usize = 8 << 10;
/// A request body larger than this is refused (413); none of the routes reads one.
const MAX_BODY_BYTES: u64 = 4 << 10;
/// A client has this long to send its whole request, and again to take the answer.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Requests answered at once; the next one is answered 503 by the accept thread.
const MAX_IN_FLIGHT: usize = 16;
const REQUEST_THREAD_STACK_BYTES: usize = 256 << 10;
/// `POST /drain` waits for the drain this much longer than the owner's shutdown grace.
const DRAIN_ANSWER_SLACK: Duration = Duration::from_secs(5);

/// Where the owner is in its life, as `/ready` tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The store is being opened (SSD recovery) or the owner's sockets bound.
    Starting,
    Serving,
    /// `POST /drain`: no new connections, in-flight requests finishing.
    Draining,
    /// The drain ended: every connection is closed; the process keeps running.
    Drained,
    /// A stop signal arrived.
    Stopping,
}

/// The owner's readiness and what `/metrics` reads, shared by the listener's threads and the
/// owner's main thread (which moves it from starting to serving to stopping).
#[derive(Debug)]
pub struct HttpState {
    phase: Mutex<Phase>,
    phase_changed: Condvar,
    owner: OnceLock<Arc<Owner>>,
}

impl HttpState {
    /// A state that says "starting" until `serving`.
    pub fn new() -> Arc<HttpState> {
        Arc::new(HttpState {
            phase: Mutex::new(Phase::Starting),
            phase_changed: Condvar::new(),
            owner: OnceLock::new(),
        })
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_phase(&self, from: Option<Phase>, to: Phase) {
        let mut phase = self.phase();
        if from.is_none_or(|from| *phase == from) {
            *phase = to;
            self.phase_changed.notify_all();
        }
    }

    /// The owner recovered its store and listens: `/ready` turns 200 (unless its SSD tier
    /// stopped taking writes) and `/metrics` adds the engine's and the service's metrics.
    pub fn serving(&self, owner: Arc<Owner>) {
        if self.owner.set(owner).is_ok() {
            self.set_phase(Some(Phase::Starting), Phase::Serving);
        }
    }

    /// A stop began: `/ready` answers 503 "stopping" from now on (`/health` still 200).
    pub fn stopping(&self) {
        self.set_phase(None, Phase::Stopping);
    }

    /// Ok when the owner takes new work; else the reason, one line.
    fn readiness(&self) -> Result<(), &'static str> {
        let phase = *self.phase();
        match phase {
            Phase::Starting => Err("starting: the store is being opened\n"),
            Phase::Draining => Err("draining\n"),
            Phase::Drained => Err("draining: done, no connections (POST /drain)\n"),
            Phase::Stopping => Err("stopping\n"),
            Phase::Serving => match self.owner.get() {
                Some(owner) if owner.engine().stats().total.ssd_write_failed > 0 => {
                    Err("the SSD tier stopped taking writes after repeated disk failures\n")
                }
                _ => Ok(()),
            },
        }
    }

    /// Runs the drain: the owner stops accepting, in-flight requests finish, connections close.
    fn finish_drain(&self) {
        if let Some(owner) = self.owner.get() {
            owner.shutdown();
        }
        self.set_phase(Some(Phase::Draining), Phase::Drained);
        tracing::info!("drained: every connection ended; the process runs until it is stopped");
    }

    /// Starts the drain (once) and waits for it up to the owner's shutdown grace and a little
    /// more: Ok(true) drained, Ok(false) still draining, Err when there is nothing to drain (or
    /// a stop took over).
    fn drain(self: &Arc<Self>) -> Result<bool, &'static str> {
        let Some(owner) = self.owner.get() else { return Err("the owner is still starting\n") };
        let mut phase = self.phase();
        match *phase {
            Phase::Stopping => return Err("the owner is stopping\n"),
            Phase::Serving => {
                // Refused from the moment `/ready` says draining: new connections first.
                owner.stop_accepting();
                *phase = Phase::Draining;
                self.phase_changed.notify_all();
                drop(phase);
                tracing::info!("drain asked (POST /drain): not ready, no new connections, in-flight requests finish");
                let state = Arc::clone(self);
                let spawned =
                    std::thread::Builder::new().name("kvtide-drain".into()).spawn(move || state.finish_drain());
                if spawned.is_err() {
                    // No thread for it: this request's thread drains.
                    self.finish_drain();
                }
                phase = self.phase();
            }
            Phase::Starting | Phase::Draining | Phase::Drained => {}
        }
        let wait = owner.shutdown_grace() + DRAIN_ANSWER_SLACK;
        let phase = self.phase_changed.wait_timeout_while(phase, wait, |p| *p == Phase::Draining);
        match *phase.unwrap_or_else(|p| p.into_inner()).0 {
            Phase::Drained => Ok(true),
            Phase::Stopping => Err("the owner is stopping\n"),
            Phase::Starting | Phase::Serving | Phase::Draining => Ok(false),
        }
    }
}

/// The running HTTP listener; dropping it stops it (a request being answered finishes on its
/// own thread).
pub struct HttpServer {
    addr: SocketAddr,
    state: Arc<HttpState>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HttpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpServer").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl HttpServer {
    /// Listens on `addr` and answers with `state` (starting until `HttpState::serving`).
    pub fn start(addr: SocketAddr, state: Arc<HttpState>) -> std::io::Result<HttpServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, state) = (Arc::clone(&stop), Arc::clone(&state));
            std::thread::Builder::new()
                .name("kvtide-http".into())
                .spawn(move || accept_loop(&listener, &state, &stop))?
        };
        Ok(HttpServer { addr, state, stop, thread: Some(thread) })
    }

    /// The address it listens on (with the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The readiness it reports.
    pub fn state(&self) -> &Arc<HttpState> {
        &self.state
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept loop, which sees the flag (a wildcard address is reached on loopback).
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() {
                IpAddr::from([127, 0, 0, 1])
            } else {
                IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1])
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(500));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Gives each connection its own short-lived thread, up to `MAX_IN_FLIGHT`.
fn accept_loop(listener: &TcpListener, state: &Arc<HttpState>, stop: &AtomicBool) {
    let in_flight = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) => {
                // Out of descriptors, most likely: do not spin on it.
                tracing::debug!(error = %e, "HTTP accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            refuse_busy(&mut conn);
            continue;
        }
        let slot = RequestPermit(Arc::clone(&in_flight));
        let state = Arc::clone(state);
        let spawned = std::thread::Builder::new()
            .name("kvtide-http-req".into())
            .stack_size(REQUEST_THREAD_STACK_BYTES)
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = serve(conn, &state) {
                    tracing::debug!(error = %e, "HTTP answer not sent");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread for an HTTP request; connection closed");
        }
    }
}

/// Answers 503 on the accept thread without waiting for anything: what the request sent so far
/// is read first (without blocking), so that closing does not reset the connection before the
/// client read the answer.
fn refuse_busy(conn: &mut TcpStream) {
    if conn.set_nonblocking(true).is_ok() {
        let mut sink = [0u8; 2048];
        let _ = conn.read(&mut sink);
        let _ = conn.set_nonblocking(false);
    }
    let _ = conn.set_write_timeout(Some(Duration::from_millis(50)));
    let _ = write_answer(conn, &Answer::text("503 Service Unavailable", "busy: too many HTTP requests\n"));
    let _ = conn.shutdown(std::net::Shutdown::Write);
}

/// One request slot, given back when the thread that holds it ends.
struct RequestPermit(Arc<AtomicUsize>);

impl Drop for RequestPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What is sent back.
#[derive(Debug)]
struct Answer {
    status: &'static str,
    content_type: &'static str,
    allow: Option<&'static str>,
    body: Vec<u8>,
}

impl Answer {
    fn text(status: &'static str, body: &str) -> Answer {
        Answer { status, content_type: "text/plain; charset=utf-8", allow: None, body: body.as_bytes().to_vec() }
    }
}

/// A request line's method and path (the query dropped).
#[derive(Debug, PartialEq, Eq)]
struct Request {
    method: String,
    path: String,
}

/// Reads one request and answers it.
fn serve(mut conn: TcpStream, state: &Arc<HttpState>) -> std::io::Result<()> {
    conn.set_write_timeout(Some(REQUEST_DEADLINE))?;
    let answer = match read_request(&mut conn, Instant::now() + REQUEST_DEADLINE) {
        Ok(Some(request)) => {
            let loopback_peer = conn.peer_addr().is_ok_and(|a| is_loopback(a.ip()));
            route(&request, loopback_peer, state)
        }
        // Closed (or reset) before a whole request: nothing to answer.
        Ok(None) => return Ok(()),
        Err(refused) => refused,
    };
    write_answer(&mut conn, &answer)
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
    }
}

/// The request head, and its body read and dropped; None when the peer closed first; Err with
/// the answer for a request that is too large, too slow or malformed.
fn read_request(conn: &mut TcpStream, deadline: Instant) -> Result<Option<Request>, Answer> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let head_end = loop {
        if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if head.len() > MAX_REQUEST_HEAD {
            return Err(Answer::text("431 Request Header Fields Too Large", "request head too large\n"));
        }
        let n = read_before(conn, &mut buf, deadline)?;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
    };
    let (request, body_bytes) = parse_head(&head[..head_end])?;
    let mut left = body_bytes.saturating_sub((head.len() - head_end) as u64);
    while left > 0 {
        let n = read_before(conn, &mut buf, deadline)?;
        if n == 0 {
            return Ok(None);
        }
        left = left.saturating_sub(n as u64);
    }
    Ok(Some(request))
}

/// The request line and the body's length, from a whole head (up to its blank line).
fn parse_head(head: &[u8]) -> Result<(Request, u64), Answer> {
    let bad = |why: &str| Answer::text("400 Bad Request", why);
    let text = std::str::from_utf8(head).map_err(|_| bad("the request head is not UTF-8\n"))?;
    let mut lines = text.split("\r\n");
    let mut line = lines.next().unwrap_or_default().split(' ');
    let (method, target, version) = (line.next(), line.next(), line.next());
    let (Some(method), Some(target), Some(version), None) = (method, target, version, line.next()) else {
        return Err(bad("malformed request line\n"));
    };
    if method.is_empty() || !target.starts_with('/') || !version.starts_with("HTTP/1.") {
        return Err(bad("malformed request line\n"));
    }
    let mut body_bytes = 0;
    for header in lines.filter(|l| !l.is_empty()) {
        let Some((name, value)) = header.split_once(':') else { return Err(bad("malformed header\n")) };
        if name.eq_ignore_ascii_case("content-length") {
            body_bytes = value.trim().parse::<u64>().map_err(|_| bad("malformed Content-Length\n"))?;
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Answer::text("411 Length Required", "no request bodies of unknown length\n"));
        }
    }
    if body_bytes > MAX_BODY_BYTES {
        return Err(Answer::text("413 Content Too Large", "request body too large\n"));
    }
    let path = target.split('?').next().unwrap_or_default();
    Ok((Request { method: method.to_string(), path: path.to_string() }, body_bytes))
}

/// One read that ends by `deadline`: Ok(0) when the peer closed or reset the connection, Err
/// (408) when the deadline passed.
fn read_before(conn: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<usize, Answer> {
    let timeout = || Answer::text("408 Request Timeout", "the request did not arrive in time\n");
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(timeout());
    }
    conn.set_read_timeout(Some(left)).map_err(|_| timeout())?;
    match conn.read(buf) {
        Ok(n) => Ok(n),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Err(timeout()),
        Err(e) if e.kind() == ErrorKind::Interrupted => Ok(read_before(conn, buf, deadline)?),
        Err(_) => Ok(0),
    }
}

/// The answer to a whole request.
fn route(request: &Request, loopback_peer: bool, state: &Arc<HttpState>) -> Answer {
    let method = match request.path.as_str() {
        "/metrics" | "/health" | "/ready" | "/version" => "GET",
        "/drain" => "POST",
        _ => return Answer::text("404 Not Found", "not found: try /metrics, /health, /ready, /version, POST /drain\n"),
    };
    if request.method != method {
        let mut answer = Answer::text("405 Method Not Allowed", &format!("{} takes {method} only\n", request.path));
        answer.allow = Some(method);
        return answer;
    }
    match request.path.as_str() {
        "/health" => Answer::text("200 OK", "alive\n"),
        "/ready" => match state.readiness() {
            Ok(()) => Answer::text("200 OK", "ready\n"),
            Err(why) => Answer::text("503 Service Unavailable", why),
        },
        "/version" => version(),
        "/metrics" => metrics(state),
        _ if !loopback_peer => Answer::text("403 Forbidden", "POST /drain is accepted from loopback peers only\n"),
        _ => match state.drain() {
            Ok(true) => Answer::text("200 OK", "drained: in-flight requests ended, no new connections\n"),
            Ok(false) => Answer::text("202 Accepted", "draining: in-flight requests still running\n"),
            Err(why) => Answer::text("409 Conflict", why),
        },
    }
}

/// `{"version": ..., "git": ... or null, "protocol_version": ...}`.
fn version() -> Answer {
    let body = serde_json::json!({
        "version": VERSION,
        "git": GIT_COMMIT,
        "protocol_version": crate::protocol::PROTOCOL_VERSION,
    });
    Answer { status: "200 OK", content_type: "application/json", allow: None, body: format!("{body}\n").into_bytes() }
}

fn metrics(state: &HttpState) -> Answer {
    match crate::metrics::encode_text(state.owner.get().map(|owner| owner.metrics_sources())) {
        Ok(body) => Answer {
            status: "200 OK",
            content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
            allow: None,
            body: body.into_bytes(),
        },
        Err(_) => Answer::text("500 Internal Server Error", "encoding the metrics failed\n"),
    }
}

fn write_answer(conn: &mut TcpStream, answer: &Answer) -> std::io::Result<()> {
    let allow = answer.allow.map(|m| format!("Allow: {m}\r\n")).unwrap_or_default();
    let head = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
        answer.status,
        answer.content_type,
        answer.body.len()
    );
    conn.write_all(head.as_bytes())?;
    conn.write_all(&answer.body)?;
    conn.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_heads_are_parsed_strictly() {
        let (r, body) = parse_head(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n").expect("ok");
        assert_eq!((r, body), (Request { method: "GET".into(), path: "/metrics".into() }, 3));
        for (head, status) in [
            (&b"GET /metrics\r\n\r\n"[..], "400"),
            (b"GET metrics HTTP/1.1\r\n\r\n", "400"),
            (b"GET /a HTTP/1.1 extra\r\n\r\n", "400"),
            (b"GET /a HTTP/1.1\r\nno colon\r\n\r\n", "400"),
            (b"POST /drain HTTP/1.1\r\nContent-Length: x\r\n\r\n", "400"),
            (b"POST /drain HTTP/1.1\r\nContent-Length: 5000\r\n\r\n", "413"),
            (b"POST /drain HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", "411"),
            (b"GET /\xff HTTP/1.1\r\n\r\n", "400"),
        ] {
            let refused = parse_head(head).expect_err("refused");
            assert!(refused.status.starts_with(status), "{:?}: {}", String::from_utf8_lossy(head), refused.status);
        }
    }

    #[test]
    fn only_loopback_peers_count_as_loopback() {
        for (ip, loopback) in
            [("127.0.0.1", true), ("127.8.0.1", true), ("::1", true), ("::ffff:127.0.0.1", true), ("10.0.0.1", false)]
        {
            assert_eq!(is_loopback(ip.parse().expect("ip")), loopback, "{ip}");
        }
        assert!(!is_loopback("::ffff:10.0.0.1".parse().expect("ip")));
    }
}
