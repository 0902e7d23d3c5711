//! A shard's inbox: a lock-free MPSC queue plus an eventfd that wakes the shard only when it
//! parked. Owns the close protocol, so no request can slip in after the shard's final drain,
//! and the poke a caller that served itself (`lend`) leaves for the shard's housekeeping.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering::SeqCst};

use crossbeam_queue::SegQueue;

use super::Request;

pub(crate) struct Inbox {
    queue: SegQueue<Request>,
    /// Set by the shard just before it blocks; a sender that clears it owes a wake-up.
    parked: AtomicBool,
    /// Set by a caller that handled a request on the shard's core itself and left work for the
    /// shard's loop (I/O to submit, eviction, draining): the shard must not park before a turn.
    poked: AtomicBool,
    closed: AtomicBool,
    /// Set when a caller's thread panicked while it ran the shard's core (`lend`).
    poisoned: AtomicBool,
    /// Senders between their `closed` check and their push; the shard waits for zero before its
    /// final drain.
    senders_active: AtomicUsize,
    eventfd: OwnedFd,
}

impl Inbox {
    pub(crate) fn new() -> std::io::Result<Inbox> {
        // SAFETY: eventfd takes no pointers; a negative result is handled below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Inbox {
            queue: SegQueue::new(),
            parked: AtomicBool::new(false),
            poked: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            senders_active: AtomicUsize::new(0),
            eventfd,
        })
    }

    /// Queues `request`, waking the shard if it parked. Gives the request back once closed.
    pub(crate) fn send(&self, request: Request) -> Result<(), Request> {
        self.senders_active.fetch_add(1, SeqCst);
        if self.closed.load(SeqCst) {
            self.senders_active.fetch_sub(1, SeqCst);
            return Err(request);
        }
        self.queue.push(request);
        self.senders_active.fetch_sub(1, SeqCst);
        fence(SeqCst);
        if self.parked.swap(false, SeqCst) {
            self.wake();
        }
        Ok(())
    }

    pub(crate) fn pop(&self) -> Option<Request> {
        self.queue.pop()
    }

    /// True when nothing is queued and the inbox is open: everything sent before (from this
    /// thread) has been handled, so a request may be handled now without overtaking one.
    pub(crate) fn is_idle(&self) -> bool {
        self.queue.is_empty() && !self.closed.load(SeqCst)
    }

    /// Asks the shard for a turn without a request, waking it if it parked.
    pub(crate) fn poke(&self) {
        self.poked.store(true, SeqCst);
        fence(SeqCst);
        if self.parked.swap(false, SeqCst) {
            self.wake();
        }
    }

    /// Shard side: takes a pending poke (true: a turn was asked for).
    pub(crate) fn take_poke(&self) -> bool {
        self.poked.swap(false, SeqCst)
    }

    /// Shard side: announce parking. Returns false (and un-parks) when work arrived meanwhile.
    pub(crate) fn prepare_park(&self) -> bool {
        self.parked.store(true, SeqCst);
        fence(SeqCst);
        if !self.queue.is_empty() || self.closed.load(SeqCst) || self.poked.load(SeqCst) {
            self.parked.store(false, SeqCst);
            return false;
        }
        true
    }

    pub(crate) fn unpark(&self) {
        self.parked.store(false, SeqCst);
    }

    /// Refuses new requests and wakes the shard so it notices.
    pub(crate) fn close(&self) {
        self.closed.store(true, SeqCst);
        self.wake();
    }

    /// Closes the inbox for good because a caller panicked in the middle of a request on the
    /// shard's core: the core may be half way through a change, so the shard stops at its next
    /// turn without the shutdown's flush, as it did when only its own thread ran the core.
    pub(crate) fn poison(&self) {
        self.poisoned.store(true, SeqCst);
        self.close();
    }

    /// True once a caller panicked on the shard's core.
    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(SeqCst)
    }

    /// True once closed and no sender can still push.
    pub(crate) fn quiesced(&self) -> bool {
        self.closed.load(SeqCst) && self.senders_active.load(SeqCst) == 0
    }

    pub(crate) fn eventfd(&self) -> i32 {
        self.eventfd.as_raw_fd()
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd. A full counter (EAGAIN) still
        // leaves the eventfd readable, which is all a wake-up needs, so the result is ignored.
        unsafe {
            libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }
}
