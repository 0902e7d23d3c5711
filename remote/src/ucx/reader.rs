//! A client's reader of an owner's arena over UCX: one worker, one endpoint to the owner's
//! worker and the arena's unpacked remote key, per connection.
//!
//! Owns the gets: each read posts one get per piece and waits for all of them, progressing its
//! own worker; a read past its deadline closes the endpoint (so nothing lands later) and every
//! later read fails. Never reads outside the arena range the owner gave (checked before a get is
//! posted), and never reports a read whose gets did not all complete.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ffi::{self, Handle};
use super::{Context, UResult, UcxError, Worker};
use crate::protocol::UcxReady;

/// How long closing an endpoint may wait for UCX to finish with it.
const CLOSE_WAIT: Duration = Duration::from_secs(2);
/// The most the first read of a new endpoint may take (within the client's timeout).
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// A read progresses its worker in a loop this long, then sleeps on its event descriptor (so
/// many waiting readers do not take the CPUs the gets need).
const SPIN: Duration = Duration::from_micros(50);
/// Longest sleep between looks at the deadline.
const SLEEP_MS: i32 = 5;

/// An owner's arena, read over UCX.
pub(crate) struct UcxArena {
    base: u64,
    len: u64,
    timeout: Duration,
    link: Mutex<Link>,
}

struct Link {
    /// None once the endpoint was closed (a read timed out or failed).
    ep: Option<(Handle, Handle)>,
    /// Set by UCX's error callback when the endpoint's peer is lost.
    peer_lost: Box<std::sync::atomic::AtomicBool>,
    worker: Worker,
}

// SAFETY: the endpoint and remote key are used only under the mutex, with their worker
// (serialized mode: one thread at a time).
unsafe impl Send for Link {}

impl UcxArena {
    /// Connects a new worker of `ctx` to the owner's plane that `ready` describes.
    pub(crate) fn connect(ctx: &Arc<Context>, ready: &UcxReady, timeout: Duration) -> UResult<UcxArena> {
        let worker = Worker::new(ctx)?;
        let ucp = ctx.ucp;
        let peer_lost = Box::new(std::sync::atomic::AtomicBool::new(false));
        let address = padded(&ready.worker_address);
        let params = ffi::EpParams {
            field_mask: ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: ffi::UCP_ERR_HANDLING_MODE_PEER,
            err_handler_cb: peer_failed as *const _,
            // The flag is boxed in the link, which outlives the endpoint (closed in its drop).
            err_handler_arg: (&*peer_lost as *const std::sync::atomic::AtomicBool).cast_mut().cast(),
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: ffi::SockAddr { addr: std::ptr::null(), addrlen: 0 },
            conn_request: std::ptr::null_mut(),
            name: std::ptr::null(),
            local_sockaddr: ffi::SockAddr { addr: std::ptr::null(), addrlen: 0 },
        };
        let mut ep: Handle = std::ptr::null_mut();
        // SAFETY: a live worker; the address bytes came from the owner's ucp_worker_get_address
        // (the UcxReady digest checked they arrived whole, from an owner that proved the token or
        // on loopback) and outlive the call; UCX takes no length, so they are followed by zeros.
        super::check(ucp, "ucp_ep_create", unsafe { (ucp.ucp_ep_create)(worker.raw, &params, &mut ep) })?;
        let mut rkey: Handle = std::ptr::null_mut();
        let key = padded(&ready.rkey);
        // SAFETY: a live endpoint; the key bytes came from the owner's ucp_rkey_pack (checked as
        // above, and followed by zeros).
        let unpacked = unsafe { (ucp.ucp_ep_rkey_unpack)(ep, key.as_ptr().cast(), &mut rkey) };
        let mut link = Link { ep: Some((ep, std::ptr::null_mut())), peer_lost, worker };
        if let Err(e) = super::check(ucp, "ucp_ep_rkey_unpack", unpacked) {
            link.close();
            return Err(e);
        }
        link.ep = Some((ep, rkey));
        let arena = UcxArena { base: ready.base, len: ready.len, timeout, link: Mutex::new(link) };
        // Creating the endpoint sent nothing: one byte read now shows the plane answers from
        // here (a port that a firewall drops, an interface this host cannot route to), so an
        // unreachable plane leaves the connection on TCP instead of failing its reads later.
        // The byte is arena bytes, which an attached client may read (docs/owner.md).
        if arena.len > 0 {
            let byte = Box::new(0u8);
            let within = timeout.min(PROBE_TIMEOUT);
            let at = Box::into_raw(byte);
            // SAFETY: one writable heap byte, lent for the call.
            match unsafe { arena.read_within(&[(0, at as u64, 1)], within) } {
                // SAFETY: the byte from Box::into_raw above, the get done.
                Ok(()) => drop(unsafe { Box::from_raw(at) }),
                // Left allocated: a get UCX did not purge could still land in it.
                Err(e) => {
                    return Err(UcxError::Unreachable(format!(
                        "a first read did not complete within {} ms: {e}",
                        within.as_millis()
                    )))
                }
            }
        }
        Ok(arena)
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// True once a read failed and the endpoint was closed: every later read fails.
    pub(crate) fn is_closed(&self) -> bool {
        self.link.lock().unwrap_or_else(|p| p.into_inner()).ep.is_none()
    }

    /// False when the endpoint was closed or UCX reported its peer lost (after one round of
    /// the worker's pending work, which delivers that report).
    pub(crate) fn is_usable(&self) -> bool {
        let mut link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        link.worker.progress();
        if link.peer_lost.load(std::sync::atomic::Ordering::Acquire) {
            link.close();
        }
        link.ep.is_some()
    }

    /// `len` bytes at `offset` lie inside the exported arena.
    pub(crate) fn check(&self, offset: u64, len: u64) -> UResult<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(UcxError::OutOfBounds),
        }
    }

    /// Reads each `(arena offset, destination address, length)` piece; all of them, or an error.
    ///
    /// # Safety
    /// Each destination must be writable host memory of its length, lent for this call.
    pub(crate) unsafe fn read(&self, pieces: &[(u64, u64, u64)]) -> UResult<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.read_within(pieces, self.timeout) }
    }

    /// `read` with its own time limit.
    ///
    /// # Safety
    /// As `read`.
    unsafe fn read_within(&self, pieces: &[(u64, u64, u64)], timeout: Duration) -> UResult<()> {
        for &(offset, _, n) in pieces {
            self.check(offset, n)?;
        }
        let mut link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        let Some((ep, rkey)) = link.ep else {
            return Err(UcxError::Call { call: "ucp_get_nbx", status: "the endpoint was closed".into() });
        };
        let ucp = link.worker.ctx.ucp;
        let param = ffi::RequestParam::with_flags(0);
        let mut pending = Vec::new();
        let mut failed = None;
        for &(offset, dst, n) in pieces {
            if n == 0 {
                continue;
            }
            // SAFETY: live endpoint and key; the remote range lies in the registered arena
            // (checked above); the destination is writable for `n` bytes (the caller's contract)
            // and is not reported read before the get completed.
            let request = unsafe { (ucp.ucp_get_nbx)(ep, dst as *mut _, n as usize, self.base + offset, rkey, &param) };
            match ffi::status_of_ptr(request) {
                Ok(None) => {}
                Ok(Some(req)) => pending.push(req),
                Err(status) => {
                    failed = Some(UcxError::Call { call: "ucp_get_nbx", status: ucp.describe(status) });
                    break;
                }
            }
        }
        let outcome = link.wait_all(pending, Instant::now() + timeout, timeout);
        match (failed, outcome) {
            (None, Ok(())) => Ok(()),
            (Some(e), _) | (None, Err(e)) => {
                // An endpoint that failed once is not trusted with later reads.
                link.close();
                Err(e)
            }
        }
    }
}

/// `blob` followed by zeros: UCX parses a worker address or a packed key without a length, so
/// a blob shorter than its contents claim runs into zeros of this buffer, not past it.
fn padded(blob: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(blob.len() + BLOB_PADDING);
    v.extend_from_slice(blob);
    v.resize(blob.len() + BLOB_PADDING, 0);
    v
}

/// Zeros after a blob handed to UCX.
const BLOB_PADDING: usize = 4096;

/// A lost peer: flags it (its requests fail, and the read that sees them, or the pool's check
/// of an idle connection, closes the endpoint); also keeps UCX from logging the loss as an
/// unhandled error.
extern "C" fn peer_failed(arg: *mut std::ffi::c_void, _ep: Handle, _status: ffi::Status) {
    if !arg.is_null() {
        // SAFETY: `arg` is the link's boxed flag, alive until the endpoint is closed (UCX calls
        // this only for a live endpoint).
        unsafe { &*(arg as *const std::sync::atomic::AtomicBool) }.store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Link {
    /// Progresses until every request completed; past `deadline` the endpoint is closed (its
    /// requests then complete with an error). The first failure, if any.
    fn wait_all(&mut self, mut pending: Vec<Handle>, deadline: Instant, timeout: Duration) -> UResult<()> {
        let ucp = self.worker.ctx.ucp;
        let mut first: Option<UcxError> = None;
        let spin_until = Instant::now() + SPIN;
        while !pending.is_empty() {
            if self.worker.progress() == 0 && Instant::now() > spin_until {
                self.sleep();
            }
            pending.retain(|&req| {
                // SAFETY: a live request of this worker, freed once when complete.
                let status = unsafe { (ucp.ucp_request_check_status)(req) };
                if status == ffi::UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: completed; freed once.
                unsafe { (ucp.ucp_request_free)(req) };
                if status != ffi::UCS_OK && first.is_none() {
                    first = Some(UcxError::Call { call: "ucp_get_nbx", status: ucp.describe(status) });
                }
                false
            });
            if !pending.is_empty() && Instant::now() > deadline && self.ep.is_some() {
                first.get_or_insert(UcxError::Timeout { timeout_ms: timeout.as_millis() as u64 });
                // Closing fails the requests still in flight; they complete in the next rounds.
                self.close();
            }
            if !pending.is_empty() && Instant::now() > deadline + 2 * CLOSE_WAIT {
                // The forced close purges every request of its endpoint; should UCX not, the
                // requests are left to the worker (never freed here) rather than waited on.
                tracing::error!(requests = pending.len(), "UCX gets still pending after their endpoint was closed");
                return Err(first.unwrap_or(UcxError::Timeout { timeout_ms: timeout.as_millis() as u64 }));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Sleeps until the worker has events (or a few milliseconds passed).
    fn sleep(&self) {
        let Ok(fd) = self.worker.event_fd() else { return };
        if let Ok(true) = self.worker.arm() {
            let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one live pollfd; the descriptor is the worker's, open while it lives.
            unsafe { libc::poll(&mut pfd, 1, SLEEP_MS) };
        }
    }

    /// Destroys the remote key and force-closes the endpoint (idempotent).
    fn close(&mut self) {
        let Some((ep, rkey)) = self.ep.take() else { return };
        let ucp = self.worker.ctx.ucp;
        let param = ffi::RequestParam::with_flags(ffi::UCP_EP_CLOSE_FLAG_FORCE);
        // SAFETY: a live endpoint (error mode PEER, so a forced close is allowed), closed once.
        let request = unsafe { (ucp.ucp_ep_close_nbx)(ep, &param) };
        let mut closed = true;
        if let Ok(Some(req)) = ffi::status_of_ptr(request) {
            let deadline = Instant::now() + CLOSE_WAIT;
            loop {
                self.worker.progress();
                // SAFETY: a live request of this worker.
                if unsafe { (ucp.ucp_request_check_status)(req) } != ffi::UCS_INPROGRESS {
                    // SAFETY: completed; freed once.
                    unsafe { (ucp.ucp_request_free)(req) };
                    break;
                }
                if Instant::now() > deadline {
                    tracing::warn!("a UCX endpoint did not close in time; its request is left to the worker");
                    closed = false;
                    break;
                }
            }
        }
        // The key goes after its endpoint: the forced close purged the gets that used it. A
        // close that did not finish may leave gets that use it: then it is left (leaked).
        if closed && !rkey.is_null() {
            // SAFETY: the key unpacked on this endpoint, destroyed once; no get of it is posted
            // any more (the endpoint is closed) and the purged ones completed with an error.
            unsafe { (ucp.ucp_rkey_destroy)(rkey) };
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.close();
    }
}
