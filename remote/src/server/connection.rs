//! The connection loop: a connection's state (`Connection`), its thread's work (`run_job`),
//! waiting for the next request (parking an idle connection without a thread), reading each
//! request within the budget and decoding it, and the dispatch of each request to its handler.
//!
//! Owns the order of a connection's requests, its deadlines between them and where it waits
//! (its thread, or parked). Never writes a reply frame itself (`reply` does) and never reads a
//! value's bytes (the put handlers read them into their reservations).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::{Error as StoreError, ObjectLease, PutOptions, PutStream, Store};

use super::budget::{HeldLeases, OwnedWindow, Permit};
use super::client_memory::ClientMemory;
use super::config::OwnerConfig;
use super::reply::Reply;
use super::shared::{Job, Parked, Shared, Slot};
use crate::error::{Error, Result};
use crate::protocol::{FrameHeader, Op, Request, WHOLE_REQUEST};
use crate::sock;
use crate::wire::{FrameIo, WResult, WireError};

/// A connection that waited this long for its next request gives its thread back (parks).
const PARK_AFTER: Duration = Duration::from_millis(50);

/// Serves a connection on a worker thread until it ends or goes idle (then it is parked).
pub(super) fn run_job(job: Job) {
    let shared = match &job {
        Job::New { slot, .. } => Arc::clone(&slot.shared),
        Job::Resume(parked) => Arc::clone(&parked.slot.shared),
    };
    let Some(mut conn) = Connection::open(job, &shared) else { return };
    let outcome = conn.run();
    conn.park_or_end(outcome);
}

impl<'s> Connection<'s> {
    /// The connection a job serves: a new one once its handshake is done (None when it failed
    /// and the connection ended), or a parked one resumed.
    fn open(job: Job, shared: &'s Arc<Shared>) -> Option<Connection<'s>> {
        match job {
            Job::New { slot, stream, accepted_at } => {
                let unix = stream.is_unix();
                let mut conn = Connection {
                    leases: HeldLeases { map: HashMap::new(), counters: Arc::clone(&shared.counters) },
                    window: None,
                    client_memory: None,
                    shared,
                    io: FrameIo::new(stream),
                    next_lease: 1,
                    puts: HashMap::new(),
                    unix,
                    ucx: false,
                    slot,
                };
                match conn.handshake(accepted_at) {
                    Ok(()) => Some(conn),
                    Err(e) => {
                        if matches!(e, WireError::Deadline) {
                            shared.counters.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                        }
                        end(conn, Err(e));
                        None
                    }
                }
            }
            Job::Resume(p) => {
                p.slot.unpark_handle(p.io.stream());
                Some(Connection {
                    leases: p.leases,
                    window: p.window,
                    client_memory: p.client_memory,
                    shared,
                    io: p.io,
                    next_lease: p.next_lease,
                    puts: HashMap::new(),
                    unix: p.unix,
                    ucx: p.ucx,
                    slot: p.slot,
                })
            }
        }
    }

    /// After `run`: a connection that went idle without open puts is parked (until its next
    /// request or its idle deadline); any other ends.
    fn park_or_end(self, outcome: WResult<Outcome>) {
        match outcome {
            Ok(Outcome::Idle { since }) if self.puts.is_empty() => {
                let deadline = since + self.idle_timeout();
                let shared = self.shared;
                let Connection { leases, window, client_memory, io, next_lease, unix, ucx, slot, .. } = self;
                slot.park_handle();
                shared.parker.park(Parked { leases, window, client_memory, io, next_lease, unix, ucx, deadline, slot });
            }
            Ok(_) => end(self, Ok(())),
            Err(WireError::Deadline) => {
                self.shared.counters.payload_timeouts.fetch_add(1, Ordering::Relaxed);
                end(self, Err(WireError::Deadline));
            }
            Err(e) => end(self, Err(e)),
        }
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

pub(super) struct Connection<'s> {
    // In drop order: leases and window back first, then the socket, open puts, the slot.
    pub(super) leases: HeldLeases,
    /// The put window, once the client asked for one (its bytes count in the gauge).
    pub(super) window: Option<OwnedWindow>,
    /// The client's process, once it let the owner read its put values (`PutDirect`).
    pub(super) client_memory: Option<ClientMemory>,
    pub(super) shared: &'s Arc<Shared>,
    pub(super) io: FrameIo,
    pub(super) next_lease: u64,
    /// Open progressive puts by stream id (the `PutOpen` request id); dropped (aborted) with
    /// the connection, so a client that disconnects makes their readers fail. A connection
    /// with open puts keeps its thread (it is never parked).
    pub(super) puts: HashMap<u64, PutStream<'s>>,
    pub(super) unix: bool,
    /// The client attached to the UCX plane (`UcxAttach`): it reads granted ranges itself.
    pub(super) ucx: bool,
    pub(super) slot: Slot,
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
pub(super) enum Flow {
    Continue,
    Close,
}

impl<'s> Connection<'s> {
    /// Reads a small request's payload whole, within the connection's share of the buffer
    /// budget (and the shared pool beyond it); None when the budget had no room (the payload
    /// was skipped and `Busy` answered).
    fn read_whole(&mut self, header: &FrameHeader) -> WResult<Option<(Permit<'s>, Vec<u8>)>> {
        let shared: &'s Arc<Shared> = self.shared;
        // Pool bytes come back within a payload deadline (or when a request is done), so
        // waiting longer than that would not help.
        let wait = Duration::from_millis(shared.config.payload_timeout_ms);
        let permit = shared.budget.acquire(u64::from(header.payload_len), wait, &shared.counters.buffered_bytes);
        self.arm_read_deadline();
        let Some(permit) = permit else {
            self.io.skip(header.payload_len.into())?;
            if header.op == Op::IndexReads {
                // A report has no reply (the client reads none): it is dropped.
                return Ok(None);
            }
            shared.counters.busy_replies.fetch_add(1, Ordering::Relaxed);
            let limit = shared.config.max_buffered_bytes as usize;
            self.reply_error(header.request_id, &StoreError::Busy { limit }.into());
            return Ok(None);
        };
        Ok(Some((permit, self.io.read_payload(header.payload_len)?)))
    }
}

impl Connection<'_> {
    /// Queues `reply` to request `request_id`: every reply frame goes through here.
    pub(super) fn reply(&mut self, request_id: u64, reply: Reply<'_>) {
        reply.push(&mut self.io, request_id);
    }

    /// `Ok`, or the `Error` of the whole request.
    pub(super) fn reply_result(&mut self, request_id: u64, result: Result<()>) {
        match result {
            Ok(()) => self.reply(request_id, Reply::Ok),
            Err(error) => self.reply_error(request_id, &error),
        }
    }

    /// The `Error` of the whole request.
    pub(super) fn reply_error(&mut self, request_id: u64, error: &Error) {
        self.reply(request_id, Reply::Error { index: WHOLE_REQUEST, error });
    }

    pub(super) fn config(&self) -> &OwnerConfig {
        &self.shared.config
    }

    pub(super) fn ttl(&self) -> Duration {
        Duration::from_millis(u64::from(self.config().lease_ttl_ms))
    }

    /// Sends an error about the connection itself, best effort, before closing it.
    pub(super) fn fatal(&mut self, request_id: u64, error: &Error) {
        self.shared.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%error, "closing a connection after a protocol error");
        self.reply_error(request_id, error);
        let _ = self.io.flush();
    }

    /// Reads the next frame's header in the middle of request `rid`; None after a protocol
    /// violation, answered with a fatal error (the connection then closes).
    pub(super) fn read_header_or_close(&mut self, rid: u64) -> WResult<Option<FrameHeader>> {
        match self.io.read_header(&self.shared.limits) {
            Ok(h) => Ok(Some(h)),
            Err(WireError::Protocol(p)) => {
                self.fatal(rid, &p.into());
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Re-arms the read deadline: what is read next must arrive within `payload_timeout_ms`.
    pub(super) fn arm_read_deadline(&mut self) {
        let timeout = Duration::from_millis(self.config().payload_timeout_ms);
        self.io.set_read_deadline(Some(Instant::now() + timeout));
    }

    /// How long this connection may wait for its next request.
    fn idle_timeout(&self) -> Duration {
        let idle = self.shared.live.idle_timeout();
        // Closing releases the leases; the client trusts them until their TTL.
        if self.leases.is_empty() {
            idle
        } else {
            idle.max(self.ttl())
        }
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

    pub(super) fn handle(&mut self, header: FrameHeader, shutting: bool) -> WResult<Flow> {
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
        let Some((_permit, payload)) = self.read_whole(&header)? else {
            return Ok(Flow::Continue);
        };
        let request = match Request::decode(header.op, &payload, &self.shared.limits) {
            Ok(r) => r,
            Err(e) => {
                // The frame was read whole, so the stream is still in sync: answer and go on.
                self.shared.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                self.reply_error(rid, &e.into());
                return Ok(Flow::Continue);
            }
        };
        // Frames without a reply are applied, never answered (the client reads no answer).
        if shutting && !matches!(request, Request::Release { .. } | Request::IndexReads { .. }) {
            self.reply_error(rid, &StoreError::ShuttingDown.into());
            return Ok(Flow::Close);
        }
        self.dispatch(rid, request)
    }

    /// Hands a decoded request to its handler.
    fn dispatch(&mut self, rid: u64, request: Request<'_>) -> WResult<Flow> {
        let engine = Arc::clone(&self.shared.engine);
        match request {
            Request::Hello(_) | Request::Auth { .. } => {
                self.reply_error(rid, &Error::Protocol("handshake already done".into()));
            }
            Request::Get { lease: false, items } => self.stream_get(rid, &items)?,
            Request::Get { lease: true, items } => self.grant(rid, &items),
            Request::GetParts { items } => return self.grant_parts(rid, &items),
            Request::GetRanges { keys, fragments } => self.stream_ranges(rid, &keys, &fragments)?,
            Request::GetFollow { key } => self.follow_get(rid, key)?,
            Request::Exists { keys } => self.exists(rid, &keys),
            Request::ScanKeys { prefix, cursor, limit } => self.scan_keys(rid, prefix, cursor, limit),
            Request::Release { leases } => self.release(leases),
            Request::Remove { key, force } => self.reply_result(rid, engine.remove(key, force).map_err(Error::from)),
            Request::RemoveBatch { keys, force } => self.remove_batch(rid, &keys, force),
            Request::Pin { key } => self.reply_result(rid, engine.pin(key).map_err(Error::from)),
            Request::Unpin { key } => self.reply_result(rid, engine.unpin(key).map_err(Error::from)),
            Request::PutBatch { upsert, pin, source, items } => {
                return self.put_batch(rid, PutOptions { upsert, pin }, source, &items);
            }
            Request::PutDirect { probe, nonce } => self.grant_direct(rid, probe, &nonce),
            // Only a same-host client that may map the arena can have read through the index.
            Request::IndexReads { reads } if self.unix && self.shared.index_fd.is_some() => {
                let counted = engine.note_index_reads(&reads);
                self.shared.counters.index_reads.fetch_add(counted as u64, Ordering::Relaxed);
                self.shared.counters.index_read_reports.fetch_add(1, Ordering::Relaxed);
            }
            Request::IndexReads { .. } => {}
            Request::PutWindow => self.open_window(rid)?,
            Request::ReadIndex => self.send_read_index(rid)?,
            Request::UcxAttach { version } => self.attach_ucx(rid, version),
            Request::PutOpen { key, total_len, chunk_bytes, upsert, pin } => {
                self.put_open(rid, key, total_len, chunk_bytes, PutOptions { upsert, pin })
            }
            Request::PutSeal { stream } => self.put_seal(rid, stream),
            Request::PutAbort { stream } => self.put_abort(rid, stream),
            Request::Stats => self.stats(rid),
        }
        Ok(Flow::Continue)
    }

    /// `Stats`: the engine's statistics as TOML.
    fn stats(&mut self, rid: u64) {
        let engine = &self.shared.engine;
        // Releases are one-way messages: once the shards handled what was sent before this
        // request, the gauges count every call answered before it. A shard that is gone has
        // nothing left to handle.
        let _ = engine.sync_shards();
        match toml::to_string(&engine.stats()) {
            Ok(text) => self.reply(rid, Reply::Stats(&text)),
            Err(e) => self.reply_error(rid, &Error::Remote(format!("stats: {e}"))),
        }
    }

    /// Gives back the leases `ids` names (unknown ids are counted, not trusted).
    pub(super) fn release(&mut self, ids: Vec<u64>) {
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

    pub(super) fn count_batch(&self, items: usize) {
        self.shared.counters.batch_requests.fetch_add(1, Ordering::Relaxed);
        self.shared.counters.batch_items.fetch_add(items as u64, Ordering::Relaxed);
    }
}
