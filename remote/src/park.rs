//! Connections without a thread each: an elastic worker pool and an epoll set of parked items.
//!
//! Owns the worker threads that run jobs (a thread starts when a job finds no idle worker and
//! retires after `RETIRE_AFTER` without work, so threads follow the connections active now, not
//! the connections open) and the poller thread's epoll set, which holds parked items (idle
//! connections, with everything they hold) until their socket is readable, their deadline
//! passes or the owner stops. Never runs a job on the poller thread, never blocks the poller on
//! a worker, and never drops an item without taking it out of the epoll set first (a duplicate
//! of its descriptor may keep the socket open).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A worker without a job for this long ends its thread.
const RETIRE_AFTER: Duration = Duration::from_secs(1);
/// Events taken from the epoll set per wait.
const EVENTS_PER_WAIT: usize = 256;
/// The poller looks at deadlines at least this often.
const POLL_TICK: Duration = Duration::from_millis(250);
/// Epoll tokens that are not parked items.
const TOKEN_INCOMING: u64 = u64::MAX;
const TOKEN_CLOSING: u64 = u64::MAX - 1;

struct Queue<J> {
    jobs: VecDeque<J>,
    /// Workers waiting for a job.
    idle: usize,
    /// Worker threads alive.
    threads: usize,
}

/// Runs jobs on worker threads: a job never waits for a busy worker (a new thread starts when
/// none is idle), and a worker without work retires.
pub(crate) struct Workers<J: Send + 'static> {
    inner: Arc<WorkersInner<J>>,
}

struct WorkersInner<J> {
    queue: Mutex<Queue<J>>,
    ready: Condvar,
    run: fn(J),
    name: &'static str,
    stack_bytes: usize,
    /// Worker threads alive (a gauge for the owner's counters).
    gauge: Arc<AtomicU64>,
}

impl<J: Send + 'static> Workers<J> {
    pub(crate) fn new(name: &'static str, stack_bytes: usize, run: fn(J), gauge: Arc<AtomicU64>) -> Workers<J> {
        Workers {
            inner: Arc::new(WorkersInner {
                queue: Mutex::new(Queue { jobs: VecDeque::new(), idle: 0, threads: 0 }),
                ready: Condvar::new(),
                run,
                name,
                stack_bytes,
                gauge,
            }),
        }
    }

    /// Hands `job` to an idle worker, or to a new one. When no thread can be started and none
    /// is idle, the job is dropped (its drop must clean up) and the error returned.
    pub(crate) fn submit(&self, job: J) -> std::io::Result<()> {
        let mut q = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.jobs.push_back(job);
        if q.jobs.len() <= q.idle {
            drop(q);
            self.inner.ready.notify_one();
            return Ok(());
        }
        q.threads += 1;
        drop(q);
        self.inner.gauge.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::clone(&self.inner);
        let spawned = std::thread::Builder::new()
            .name(self.inner.name.into())
            .stack_size(self.inner.stack_bytes)
            .spawn(move || work(&inner));
        if let Err(e) = spawned {
            self.inner.gauge.fetch_sub(1, Ordering::Relaxed);
            let mut q = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.threads -= 1;
            // A running worker takes it once it is done with its job; with none, nobody will.
            if q.threads == 0 {
                let stranded = q.jobs.pop_back();
                drop(q);
                drop(stranded);
            }
            return Err(e);
        }
        Ok(())
    }
}

fn work<J>(inner: &WorkersInner<J>) {
    loop {
        let job = {
            let mut q = inner.queue.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(job) = q.jobs.pop_front() {
                    break Some(job);
                }
                q.idle += 1;
                let (guard, waited) = inner.ready.wait_timeout(q, RETIRE_AFTER).unwrap_or_else(|p| p.into_inner());
                q = guard;
                q.idle -= 1;
                if waited.timed_out() && q.jobs.is_empty() {
                    q.threads -= 1;
                    break None;
                }
            }
        };
        match job {
            Some(job) => (inner.run)(job),
            None => {
                inner.gauge.fetch_sub(1, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// Something parked: its socket and until when it may stay.
pub(crate) trait Parkable: Send + 'static {
    fn fd(&self) -> RawFd;
    fn deadline(&self) -> Instant;
}

/// The epoll set of parked items and the queue of items on their way into it.
pub(crate) struct Parker<P: Parkable> {
    epoll: OwnedFd,
    incoming_fd: OwnedFd,
    incoming: Mutex<Vec<P>>,
    /// Readable once the owner stops (not ours: the owner's wake flag).
    closing_fd: RawFd,
    /// Set once the owner stops: everything parked, and everything parked later, is dropped.
    closing: AtomicBool,
    /// Set when the poller thread must end.
    stop: AtomicBool,
    /// Items parked now (a gauge for the owner's counters).
    gauge: Arc<AtomicU64>,
}

fn epoll_ctl(epoll: RawFd, op: libc::c_int, fd: RawFd, token: u64) -> std::io::Result<()> {
    let mut event = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, u64: token };
    // SAFETY: valid descriptors and a live event struct (ignored for EPOLL_CTL_DEL).
    if unsafe { libc::epoll_ctl(epoll, op, fd, &mut event) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl<P: Parkable> Parker<P> {
    /// An empty set that also watches `closing_fd` (readable once the owner stops).
    pub(crate) fn new(closing_fd: RawFd, gauge: Arc<AtomicU64>) -> std::io::Result<Parker<P>> {
        // SAFETY: plain syscalls; results checked before use.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        // SAFETY: as above.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        let incoming_fd = unsafe { OwnedFd::from_raw_fd(wake) };
        epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, incoming_fd.as_raw_fd(), TOKEN_INCOMING)?;
        epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, closing_fd, TOKEN_CLOSING)?;
        Ok(Parker {
            epoll,
            incoming_fd,
            incoming: Mutex::new(Vec::new()),
            closing_fd,
            closing: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            gauge,
        })
    }

    /// Parks `item` until its socket is readable or its deadline passes (dropped at once once
    /// the owner stops).
    pub(crate) fn park(&self, item: P) {
        if self.closing.load(Ordering::Acquire) {
            drop(item);
            return;
        }
        self.incoming.lock().unwrap_or_else(|p| p.into_inner()).push(item);
        self.signal();
    }

    fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd (a full counter is signalled).
        unsafe { libc::write(self.incoming_fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Ends `run` (after the owner's connections are gone).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.signal();
    }

    /// The poller: hands each parked item whose socket turned readable to `ready`, and drops
    /// those whose deadline passed (after `expired` counted them), until `stop`.
    pub(crate) fn run(&self, mut ready: impl FnMut(P), mut expired: impl FnMut(&P)) {
        let mut parked: HashMap<u64, P> = HashMap::new();
        let mut next_token = 0u64;
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
        let epoll = self.epoll.as_raw_fd();
        loop {
            let now = Instant::now();
            let wait = parked
                .values()
                .map(|p| p.deadline().saturating_duration_since(now))
                .min()
                .map_or(POLL_TICK, |d| d.min(POLL_TICK));
            let timeout_ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX).max(1);
            // SAFETY: `events` is a live buffer of EVENTS_PER_WAIT entries.
            let n = unsafe { libc::epoll_wait(epoll, events.as_mut_ptr(), EVENTS_PER_WAIT as i32, timeout_ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(error = %e, "epoll_wait failed; dropping parked connections");
                self.closing.store(true, Ordering::Release);
            }
            for event in &events[..n.max(0) as usize] {
                match event.u64 {
                    TOKEN_INCOMING => {
                        let mut count = [0u8; 8];
                        // SAFETY: reads 8 bytes into a live buffer from our eventfd.
                        unsafe { libc::read(self.incoming_fd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
                    }
                    TOKEN_CLOSING => {
                        self.closing.store(true, Ordering::Release);
                        // Level-triggered and never read: stop watching it.
                        let _ = epoll_ctl(epoll, libc::EPOLL_CTL_DEL, self.closing_fd, TOKEN_CLOSING);
                    }
                    token => {
                        if let Some(item) = parked.remove(&token) {
                            let _ = epoll_ctl(epoll, libc::EPOLL_CTL_DEL, item.fd(), token);
                            self.gauge.fetch_sub(1, Ordering::Relaxed);
                            ready(item);
                        }
                    }
                }
            }
            let arrived = std::mem::take(&mut *self.incoming.lock().unwrap_or_else(|p| p.into_inner()));
            for item in arrived {
                next_token += 1;
                if self.closing.load(Ordering::Acquire)
                    || epoll_ctl(epoll, libc::EPOLL_CTL_ADD, item.fd(), next_token).is_err()
                {
                    drop(item);
                    continue;
                }
                self.gauge.fetch_add(1, Ordering::Relaxed);
                parked.insert(next_token, item);
            }
            let now = Instant::now();
            let closing = self.closing.load(Ordering::Acquire);
            let gone: Vec<u64> =
                parked.iter().filter(|(_, p)| closing || p.deadline() <= now).map(|(t, _)| *t).collect();
            for token in gone {
                if let Some(item) = parked.remove(&token) {
                    let _ = epoll_ctl(epoll, libc::EPOLL_CTL_DEL, item.fd(), token);
                    self.gauge.fetch_sub(1, Ordering::Relaxed);
                    if !closing {
                        expired(&item);
                    }
                    drop(item);
                }
            }
            if self.stop.load(Ordering::Acquire) {
                for (token, item) in parked.drain() {
                    let _ = epoll_ctl(epoll, libc::EPOLL_CTL_DEL, item.fd(), token);
                    self.gauge.fetch_sub(1, Ordering::Relaxed);
                }
                let late = std::mem::take(&mut *self.incoming.lock().unwrap_or_else(|p| p.into_inner()));
                drop(late);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;

    /// Blocks until the test releases it.
    fn blocking_job(job: (mpsc::Sender<()>, Arc<(Mutex<bool>, Condvar)>)) {
        let (started, gate) = job;
        let _ = started.send(());
        let (lock, cv) = &*gate;
        let mut open = lock.lock().unwrap_or_else(|p| p.into_inner());
        while !*open {
            open = cv.wait(open).unwrap_or_else(|p| p.into_inner());
        }
    }

    #[test]
    fn a_job_never_waits_for_a_busy_worker_and_idle_workers_retire() {
        let gauge = Arc::new(AtomicU64::new(0));
        let workers = Workers::new("park-test", 256 << 10, blocking_job, Arc::clone(&gauge));
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (tx, rx) = mpsc::channel();
        for _ in 0..4 {
            workers.submit((tx.clone(), Arc::clone(&gate))).expect("submit");
        }
        // All four run at once although each blocks: none waited for another.
        for _ in 0..4 {
            rx.recv_timeout(Duration::from_secs(10)).expect("every job started");
        }
        assert_eq!(gauge.load(Ordering::SeqCst), 4);
        *gate.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
        gate.1.notify_all();
        let deadline = Instant::now() + Duration::from_secs(10);
        while gauge.load(Ordering::SeqCst) != 0 {
            assert!(Instant::now() < deadline, "workers never retired");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    struct Item {
        stream: UnixStream,
        deadline: Instant,
        name: &'static str,
    }

    impl Parkable for Item {
        fn fd(&self) -> RawFd {
            self.stream.as_raw_fd()
        }
        fn deadline(&self) -> Instant {
            self.deadline
        }
    }

    #[test]
    fn parked_items_come_back_when_readable_expire_at_their_deadline_and_go_when_closing() {
        // SAFETY: plain syscall; checked before use.
        let closing = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(closing >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let closing = unsafe { OwnedFd::from_raw_fd(closing) };
        let gauge = Arc::new(AtomicU64::new(0));
        let parker = Arc::new(Parker::<Item>::new(closing.as_raw_fd(), Arc::clone(&gauge)).expect("parker"));
        let (ready_tx, ready_rx) = mpsc::channel();
        let (expired_tx, expired_rx) = mpsc::channel();
        let poller = {
            let parker = Arc::clone(&parker);
            std::thread::spawn(move || {
                parker.run(
                    |item| {
                        let _ = ready_tx.send(item.name);
                    },
                    |item| {
                        let _ = expired_tx.send(item.name);
                    },
                )
            })
        };
        let far = Instant::now() + Duration::from_secs(60);
        let (woken, mut woken_peer) = UnixStream::pair().expect("pair");
        let (soon, _soon_peer) = UnixStream::pair().expect("pair");
        let (kept, kept_peer) = UnixStream::pair().expect("pair");
        parker.park(Item { stream: woken, deadline: far, name: "woken" });
        parker.park(Item { stream: soon, deadline: Instant::now() + Duration::from_millis(100), name: "soon" });
        parker.park(Item { stream: kept, deadline: far, name: "kept" });
        std::io::Write::write_all(&mut woken_peer, b"x").expect("write");
        assert_eq!(ready_rx.recv_timeout(Duration::from_secs(10)), Ok("woken"));
        assert_eq!(expired_rx.recv_timeout(Duration::from_secs(10)), Ok("soon"));
        assert_eq!(gauge.load(Ordering::SeqCst), 1, "only the kept one is parked");
        // Closing drops what is parked (its socket closes) and whatever is parked later.
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(closing.as_raw_fd(), (&one as *const u64).cast(), 8) };
        let mut buf = [0u8; 1];
        kept_peer.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        assert_eq!(std::io::Read::read(&mut &kept_peer, &mut buf).expect("EOF"), 0, "the parked socket closed");
        let (late, late_peer) = UnixStream::pair().expect("pair");
        parker.park(Item { stream: late, deadline: far, name: "late" });
        late_peer.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        assert_eq!(std::io::Read::read(&mut &late_peer, &mut buf).expect("EOF"), 0, "parked after closing: dropped");
        assert_eq!(gauge.load(Ordering::SeqCst), 0);
        parker.stop();
        poller.join().expect("poller");
        assert!(ready_rx.try_recv().is_err() && expired_rx.try_recv().is_err(), "closing is neither ready nor expired");
    }
}
