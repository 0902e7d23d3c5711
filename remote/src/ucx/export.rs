//! The owner's side of the UCX plane: its arena registered for remote reads, and the thread that
//! progresses its worker.
//!
//! Owns the owner's UCX context, its one worker (on its progress thread, which sleeps on the
//! worker's event descriptor when idle), the arena's registration (read-only for peers) and the
//! `UcxReady` it hands to authenticated clients. Never grants anything: which ranges a client
//! may read is decided by leases on the control connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::{Context, MemRegion, Transports, UResult, UcxError, Worker, UCX_PLANE_VERSION};
use crate::protocol::UcxReady;

/// How long the progress thread sleeps between checks of its stop flag when idle.
const IDLE_POLL_MS: i32 = 100;

/// The owner's UCX plane (dropped: the progress thread stops, then the registration goes).
pub(crate) struct UcxExport {
    ready: UcxReady,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    // Dropped after the thread is joined (the worker lives on it).
    _region: MemRegion,
    _ctx: Arc<Context>,
}

impl UcxExport {
    /// Registers `[base, base + len)` for remote reads over `transports` and starts serving.
    ///
    /// # Safety
    /// The range must stay mapped until the export is dropped.
    pub(crate) unsafe fn start(transports: Transports, base: *mut u8, len: usize) -> UResult<UcxExport> {
        let ctx = Context::new(&transports, true)?;
        // SAFETY: the caller keeps the range mapped for the export's life; the region is
        // dropped with it.
        let region = unsafe { MemRegion::read_only(&ctx, base, len) }?;
        let rkey = region.packed_rkey()?;
        let worker = Worker::new(&ctx)?;
        let worker_address = worker.address()?;
        let fd = worker.event_fd()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kvtide-ucx".into())
            .spawn(move || serve(&worker, fd, &stopping))
            .map_err(|e| UcxError::Call { call: "spawn", status: e.to_string() })?;
        let ready = UcxReady { version: UCX_PLANE_VERSION, base: base as u64, len: len as u64, worker_address, rkey };
        tracing::info!(transports = transports.as_str(), arena_bytes = len, "UCX data plane serving the arena");
        Ok(UcxExport { ready, stop, thread: Some(thread), _region: region, _ctx: ctx })
    }

    /// What an authenticated client is given.
    pub(crate) fn ready(&self) -> &UcxReady {
        &self.ready
    }
}

impl Drop for UcxExport {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Progresses `worker` until `stop`: software transports (tcp) serve peers' reads here, and
/// every transport's connection set-up does.
fn serve(worker: &Worker, fd: i32, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        while worker.progress() > 0 {}
        match worker.arm() {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                tracing::error!(error = %e, "the UCX plane stopped serving");
                return;
            }
        }
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd; the descriptor is the worker's, open while it lives.
        unsafe { libc::poll(&mut pfd, 1, IDLE_POLL_MS) };
    }
}
