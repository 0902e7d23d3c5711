//! The shard loop: one pinned thread that drains its inbox, advances its tasks, evicts towards
//! the low watermark, reaps io_uring completions and fires timers, then spins briefly and parks
//! in `submit_and_wait` with an eventfd read outstanding. It never blocks while it has work.
//! It holds its core through each turn and lets go of it while it yields or parks, when
//! callers may run requests that touch only the core on it themselves (`lend`). Owns the
//! thread, its start-up and shutdown and the order of a turn; what each request does on the
//! core is `serve`'s.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtide_tiers::dram::ArenaSlice;
use kvtide_tiers::ssd::{DiskCompletion, DiskIo, DiskOp, ShardFiles, SimDisk};

use super::core::{RecoveryReport, ShardCore};
use super::inbox::Inbox;
use super::lend::{CoreCell, LoopCore};
use super::published::PublishedIndex;
use super::ring::{Ring, RingEvent};
use super::serve::serve;
use super::task::TaskPoll;
use super::{Request, ShardTask};
use crate::error::OpenError;
use crate::stats::ShardCounters;

/// Requests handled per loop turn before the loop looks at its other work.
const INBOX_BATCH: usize = 256;
/// Bytes of task copying per loop turn, so a large async read cannot starve the inbox.
const TASK_BUDGET_BYTES: u64 = 1 << 20;
/// Threads per shard reading segment files at open.
const RECOVERY_SCAN_THREADS: usize = 4;
/// Objects evicted per loop turn when above the high watermark.
const EVICTIONS_PER_TURN: usize = 64;

/// How a shard thread runs (derived from the builder).
#[derive(Clone, Debug)]
pub(crate) struct RuntimeConfig {
    pub(crate) ring_entries: u32,
    pub(crate) idle_spin: Duration,
    /// A clean shutdown writes DRAM-only objects to SSD first.
    pub(crate) demote_on_shutdown: bool,
    /// ... for at most this long (queued tombstones are written past it too).
    pub(crate) shutdown_flush_timeout: Duration,
    /// While non-zero (GPU transfers in flight, engine-wide) an idle shard keeps polling
    /// instead of parking.
    pub(crate) keep_awake: Arc<AtomicUsize>,
    /// Set once by `Engine::shutdown_by`: the flush ends by then even when
    /// `shutdown_flush_timeout` would allow more.
    pub(crate) stop_deadline: Arc<OnceLock<Instant>>,
    pub(crate) pin_to_cpu: Option<usize>,
    pub(crate) register_fixed_buffers: bool,
    /// Use io_uring; without it (off, or refused) only a DRAM-only shard can run.
    pub(crate) io_uring: bool,
}

/// Where a shard's SSD I/O goes.
pub(crate) enum DiskBackend {
    /// No SSD tier.
    None,
    /// Segment files through the shard's io_uring ring.
    Files(ShardFiles),
    /// The in-memory fault-injecting simulator (tests and benchmarks).
    Simulated(Box<SimDisk>),
}

/// How often a parked shard looks at objects waiting for published readers to leave.
const DRAIN_POLL: Duration = Duration::from_millis(1);

/// The engine's handle on a running shard.
pub(crate) struct ShardThread {
    pub(crate) inbox: Arc<Inbox>,
    /// The shard's core, for callers it lends it to between its turns.
    pub(crate) core: CoreCell,
    /// The shard's index as readers on any thread see it.
    pub(crate) published: Arc<PublishedIndex>,
    pub(crate) counters: Arc<ShardCounters>,
    pub(crate) join: Option<JoinHandle<()>>,
}

struct ShardLoop {
    index: usize,
    // Dropped first: the ring unregisters the fixed buffers before the slice (in `core`) can go.
    ring: Ring,
    core: LoopCore,
    inbox: Arc<Inbox>,
    tasks: Vec<Box<dyn ShardTask>>,
    config: RuntimeConfig,
    disk_ops: Vec<DiskOp>,
    disk_done: Vec<DiskCompletion>,
    /// Set when the SSD tier runs on the simulator instead of the ring.
    sim: Option<Box<SimDisk>>,
    /// Some task polls something that cannot wake a parked shard (CUDA events).
    polling_tasks: bool,
    /// Pieces of the slice are still being registered as fixed buffers, one per turn.
    fixed_pending: bool,
}

/// Starts a shard thread. Its ring is created on the thread so it is owned there from birth.
pub(crate) fn spawn_shard(
    index: usize,
    make_core: impl FnOnce() -> Result<ShardCore, OpenError> + Send + 'static,
    counters: Arc<ShardCounters>,
    published: Arc<PublishedIndex>,
    slice: ArenaSlice,
    disk: DiskBackend,
    config: RuntimeConfig,
) -> Result<StartingShard, OpenError> {
    let shard_error = move |source| OpenError::Shard { shard: index, source };
    let inbox = Arc::new(Inbox::new().map_err(shard_error)?);
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<RecoveryReport, OpenError>>(1);
    let thread_inbox = Arc::clone(&inbox);
    let cell = super::lend::new_cell();
    let thread_cell = Arc::clone(&cell);
    let join = std::thread::Builder::new()
        .name(format!("kvtide-shard-{index}"))
        .spawn(move || {
            if let Some(cpu) = config.pin_to_cpu {
                pin_current_thread(cpu);
            }
            // The core is built and dropped here; between turns, callers may run requests on it
            // under its lock (`lend`), and tasks stay on this thread.
            let mut core = match make_core() {
                Ok(core) => LoopCore::hold(&thread_cell, core),
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let mut ring = match make_ring(index, &config, &disk) {
                Ok(ring) => ring,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            // Only segment-file I/O uses fixed buffers, and registering pins (faults in) the
            // whole slice: a DRAM-only shard skips it and starts at once.
            let mut fixed_pending = false;
            if config.register_fixed_buffers && matches!(disk, DiskBackend::Files(_)) {
                let pieces: Vec<(usize, usize)> = slice
                    .pieces(Ring::fixed_buffer_piece_bytes())
                    .into_iter()
                    .map(|(offset, len)| (slice.base().as_ptr() as usize + offset as usize, len))
                    .collect();
                match ring.begin_fixed_buffers(&pieces) {
                    Ok(pending) => {
                        fixed_pending = pending;
                        core.counters().fixed_buffers_registered.store(!pending, Relaxed);
                    }
                    Err(e) => tracing::warn!(
                        shard = index,
                        error = %e,
                        "io_uring refused to register the arena slice as fixed buffers (raise RLIMIT_MEMLOCK, \
                         e.g. `ulimit -l unlimited`); SSD I/O will use plain reads and writes"
                    ),
                }
            }
            let started = Instant::now();
            let mut sim = None;
            let scanned = match disk {
                DiskBackend::None => Ok(None),
                // Real segment files are scanned by a few threads at once.
                DiskBackend::Files(files) => {
                    let scans = files.scan_all(RECOVERY_SCAN_THREADS);
                    ring.attach_files(files);
                    scans.map(|scans| Some(core.apply_recovery(scans)))
                }
                DiskBackend::Simulated(disk) => core.recover(&mut **sim.insert(disk)).map(Some),
            };
            let report = match scanned {
                Ok(Some(report)) => {
                    tracing::info!(
                        shard = index,
                        objects = report.objects,
                        bytes = report.bytes,
                        discarded = report.discarded.len(),
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "SSD tier recovered"
                    );
                    report
                }
                Ok(None) => RecoveryReport::default(),
                Err(e) => {
                    let _ = ready_tx.send(Err(shard_error(e)));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(report));
            let mut shard = ShardLoop {
                index,
                ring,
                core,
                inbox: thread_inbox,
                tasks: Vec::new(),
                config,
                disk_ops: Vec::new(),
                disk_done: Vec::new(),
                sim,
                polling_tasks: false,
                fixed_pending,
            };
            shard.run();
        })
        .map_err(shard_error)?;
    Ok(StartingShard {
        index,
        thread: ShardThread { inbox, core: cell, published, counters, join: Some(join) },
        ready: ready_rx,
    })
}

/// The shard's ring: io_uring, or for a DRAM-only shard where io_uring is off or refused, a
/// ring that parks with poll(2). An SSD tier without io_uring is an error that says why.
fn make_ring(index: usize, config: &RuntimeConfig, disk: &DiskBackend) -> Result<Ring, OpenError> {
    let needs_io_uring = matches!(disk, DiskBackend::Files(_));
    let refused = |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOSYS | libc::EACCES));
    if !config.io_uring {
        if needs_io_uring {
            return Err(OpenError::Config(
                "[runtime] io_uring = false: the SSD tier needs io_uring (turn it on, or run DRAM only)".into(),
            ));
        }
        return Ok(Ring::without_io_uring());
    }
    match Ring::new(config.ring_entries) {
        Ok(ring) => Ok(ring),
        Err(e) if refused(&e) && !needs_io_uring => {
            if index == 0 {
                tracing::warn!(
                    error = %e,
                    "io_uring is refused here (container seccomp profiles block it); the DRAM-only shards park with \
                     poll(2) instead"
                );
            }
            Ok(Ring::without_io_uring())
        }
        Err(e) if refused(&e) => Err(OpenError::Shard {
            shard: index,
            source: std::io::Error::new(
                e.kind(),
                format!(
                    "io_uring is refused ({e}), and the SSD tier needs it. The default seccomp profiles of Docker 25+ \
                     and containerd block io_uring_setup, io_uring_enter and io_uring_register: allow them (e.g. \
                     `docker run --security-opt seccomp=unconfined`, or a profile that permits them), or run DRAM only"
                ),
            ),
        }),
        Err(source) => Err(OpenError::Shard { shard: index, source }),
    }
}

/// A shard thread that is starting (recovering its SSD tier); shards start in parallel.
pub(crate) struct StartingShard {
    index: usize,
    thread: ShardThread,
    ready: crossbeam_channel::Receiver<Result<RecoveryReport, OpenError>>,
}

impl StartingShard {
    /// Waits until the shard serves (or failed to start; its thread is then joined).
    pub(crate) fn wait(self) -> Result<(ShardThread, RecoveryReport), OpenError> {
        let StartingShard { index, mut thread, ready } = self;
        let error = match ready.recv() {
            Ok(Ok(report)) => return Ok((thread, report)),
            Ok(Err(e)) => e,
            Err(_) => {
                OpenError::Shard { shard: index, source: std::io::Error::other("shard thread exited during start-up") }
            }
        };
        thread.stop();
        Err(error)
    }
}

impl ShardThread {
    /// Closes the inbox and joins the thread (a shard that started while another failed).
    pub(crate) fn stop(&mut self) {
        self.inbox.close();
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

impl ShardLoop {
    /// Registers one more piece of the slice as a fixed buffer while any remain (true then).
    fn register_fixed_piece(&mut self) -> bool {
        if self.core.counters().fixed_buffers_registered.load(Relaxed) || !self.fixed_pending {
            return false;
        }
        match self.ring.register_next_fixed() {
            Ok(true) => true,
            Ok(false) => {
                self.fixed_pending = false;
                self.core.counters().fixed_buffers_registered.store(true, Relaxed);
                true
            }
            Err(e) => {
                tracing::warn!(
                    shard = self.index,
                    error = %e,
                    "io_uring refused to register part of the arena slice as fixed buffers (raise RLIMIT_MEMLOCK, \
                     e.g. `ulimit -l unlimited`); SSD I/O into the rest uses plain reads and writes"
                );
                self.ring.abandon_fixed();
                self.fixed_pending = false;
                false
            }
        }
    }

    fn run(&mut self) {
        let span = tracing::debug_span!("shard", shard = self.index);
        let _enter = span.enter();
        let mut idle_since: Option<Instant> = None;
        let mut flush_deadline: Option<Instant> = None;
        loop {
            if self.inbox.is_poisoned() {
                // A caller panicked on this core: stop as a panic on this thread would have.
                break;
            }
            self.core.next_turn();
            let mut worked = self.inbox.take_poke();
            worked |= self.drain_inbox();
            worked |= self.advance_tasks();
            if self.core.above_high_watermark() {
                worked |= self.core.evict_to_low_watermark(EVICTIONS_PER_TURN) > 0;
            }
            let now = Instant::now();
            if self.core.next_lease_deadline().is_some_and(|d| d <= now) {
                self.core.expire_leases(now);
                worked = true;
            }
            worked |= self.core.schedule_syncs();
            worked |= self.pump_disk();
            self.reap();
            worked |= self.complete_disk();
            // Fixed-buffer registration only fills turns with nothing else to do.
            if !worked {
                worked = self.register_fixed_piece();
            }
            if self.inbox.quiesced() {
                if self.inbox_is_drained() && !self.tasks.is_empty() {
                    // Nothing new can arrive: tasks that may go now go (their drops finish them).
                    let before = self.tasks.len();
                    self.tasks.retain(|t| !t.dropped_at_shutdown());
                    let dropped = (before - self.tasks.len()) as u64;
                    self.core.counters().tasks_in_flight.fetch_sub(dropped, Relaxed);
                }
                if self.inbox_is_drained() && self.tasks.is_empty() {
                    let deadline = *flush_deadline.get_or_insert_with(|| {
                        let own = now + self.config.shutdown_flush_timeout;
                        self.config.stop_deadline.get().map_or(own, |stop| own.min(*stop))
                    });
                    let in_time = now < deadline;
                    // DRAM-only objects and queued tombstones go to SSD (bounded in time), then
                    // every completed write is made durable: a restart finds what was acknowledged.
                    if self.core.flush_for_shutdown(self.config.demote_on_shutdown && in_time, in_time) {
                        self.core.sync_everything();
                        if self.core.disk_ops_in_flight() == 0 {
                            break;
                        }
                    }
                }
                continue;
            }
            if worked {
                idle_since = None;
                continue;
            }
            let idle_start = *idle_since.get_or_insert(now);
            if now.duration_since(idle_start) < self.config.idle_spin || self.config.keep_awake.load(Relaxed) > 0 {
                // Yield rather than spin: a caller may be waiting for this CPU (or for the core).
                LoopCore::unlocked(&mut self.core, std::thread::yield_now);
                continue;
            }
            self.park(now);
            idle_since = None;
        }
        if self.inbox.is_poisoned() {
            // Queued requests are dropped unanswered: their callers get `ShuttingDown` rather
            // than wait for a reply that will not come.
            while !self.inbox.quiesced() {
                std::thread::yield_now();
            }
            while let Some(request) = self.inbox.pop() {
                drop(request);
            }
        } else {
            self.core.count_unflushed();
        }
        self.ring.drain();
    }

    /// Hands queued disk operations to the ring. True if any went.
    fn pump_disk(&mut self) -> bool {
        self.core.take_disk_ops(&mut self.disk_ops);
        if self.disk_ops.is_empty() {
            return false;
        }
        let mut ops = std::mem::take(&mut self.disk_ops).into_iter();
        let mut sent = false;
        while let Some(op) = ops.next() {
            let disk: &mut dyn DiskIo = match self.sim.as_deref_mut() {
                Some(sim) => sim,
                None => &mut self.ring,
            };
            // SAFETY: every op's buffer is arena memory that the core's operation holds until
            // `on_disk_completion` for its token (the core never frees it earlier).
            match unsafe { disk.submit(op) } {
                Ok(()) => sent = true,
                Err(op) => {
                    // The ring is full: give this and the rest back, in order, for next turn.
                    let rest: Vec<DiskOp> = std::iter::once(op).chain(ops).collect();
                    for op in rest.into_iter().rev() {
                        self.core.requeue_disk_op(op);
                    }
                    break;
                }
            }
        }
        if sent && self.sim.is_none() {
            if let Err(e) = self.ring.submit() {
                tracing::error!(error = %e, "io_uring submit failed");
            }
        }
        sent
    }

    /// Feeds disk completions to the core. True if any arrived.
    fn complete_disk(&mut self) -> bool {
        match self.sim.as_deref_mut() {
            Some(sim) => sim.reap(&mut self.disk_done),
            None => DiskIo::reap(&mut self.ring, &mut self.disk_done),
        }
        if self.disk_done.is_empty() {
            return false;
        }
        for completion in std::mem::take(&mut self.disk_done) {
            self.core.on_disk_completion(completion);
            // A burst of completions (each load piece is checked against its checksums here)
            // must not hold up requests: a caller's lease waits behind at most one completion.
            self.drain_inbox();
        }
        true
    }

    /// Blocks until a sender wakes us, a completion arrives or the next timer is due.
    fn park(&mut self, now: Instant) {
        if self.polling_tasks || self.sim.as_ref().is_some_and(|sim| sim.in_flight() > 0) {
            // Simulated completions and CUDA events do not wake the ring: keep polling them.
            LoopCore::unlocked(&mut self.core, std::thread::yield_now);
            return;
        }
        if let Err(e) = self.ring.arm_wake(self.inbox.eventfd()) {
            tracing::error!(error = %e, "could not arm the wake-up read; spinning instead");
            return;
        }
        // Objects waiting for published readers: their leases come back without a wake-up.
        let draining = self.core.has_draining().then(|| now + DRAIN_POLL);
        if let Some(deadline) = self.core.next_lease_deadline().into_iter().chain(draining).min() {
            let after = deadline.saturating_duration_since(now).max(Duration::from_micros(100));
            if let Err(e) = self.ring.arm_timer(after) {
                tracing::error!(error = %e, "could not arm the timer; spinning instead");
                return;
            }
        }
        let counters = Arc::clone(self.core.counters());
        let (inbox, ring) = (&self.inbox, &mut self.ring);
        // Parked without the core: callers are served meanwhile, and one that leaves work pokes.
        LoopCore::unlocked(&mut self.core, || {
            if !inbox.prepare_park() {
                // Work arrived between the last drain and now; the armed ops stay for next time.
                let _ = ring.submit();
                return;
            }
            counters.parks.fetch_add(1, Relaxed);
            let waited = ring.submit_and_wait();
            inbox.unpark();
            if let Err(e) = waited {
                tracing::error!(error = %e, "io_uring wait failed");
            }
        });
    }

    fn reap(&mut self) {
        let counters = Arc::clone(self.core.counters());
        self.ring.reap_cq(|completion, result| match completion {
            RingEvent::Wake => {
                counters.wakeups.fetch_add(1, Relaxed);
                if result < 0 && result != -libc::EAGAIN {
                    tracing::warn!(result, "eventfd read failed");
                }
            }
            // The loop checks timers itself; a timeout only ends a park.
            RingEvent::Timer => {}
        });
    }

    fn inbox_is_drained(&mut self) -> bool {
        // After close, handle what is left rather than dropping it.
        match self.inbox.pop() {
            Some(request) => {
                self.handle(request);
                false
            }
            None => true,
        }
    }

    fn drain_inbox(&mut self) -> bool {
        let mut handled = 0;
        while handled < INBOX_BATCH {
            let Some(request) = self.inbox.pop() else { break };
            self.handle(request);
            handled += 1;
        }
        if handled > 0 {
            self.core.counters().requests.fetch_add(handled as u64, Relaxed);
        }
        handled > 0
    }

    fn advance_tasks(&mut self) -> bool {
        if self.tasks.is_empty() {
            return false;
        }
        let mut budget = TASK_BUDGET_BYTES;
        let mut progressed = false;
        let mut polling = false;
        let core = &mut *self.core;
        self.tasks.retain_mut(|task| match task.poll(core, &mut budget) {
            TaskPoll::Finished => {
                core.counters().tasks_in_flight.fetch_sub(1, Relaxed);
                progressed = true;
                false
            }
            TaskPoll::Progressed => {
                progressed = true;
                true
            }
            TaskPoll::Waiting => true,
            TaskPoll::Polling => {
                polling = true;
                true
            }
        });
        self.polling_tasks = polling;
        progressed
    }

    fn handle(&mut self, request: Request) {
        if let Some(task) = serve(&mut self.core, request) {
            self.tasks.push(task);
        }
    }
}

fn pin_current_thread(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write inside it; sched_setaffinity reads
    // it. A refusal (e.g. a cgroup without that CPU) only costs locality, so it is logged.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::warn!(cpu, error = %std::io::Error::last_os_error(), "could not pin shard thread");
        }
    }
}

/// CPUs this process may run on, in order.
pub(crate) fn allowed_cpus() -> Vec<usize> {
    // SAFETY: as in pin_current_thread; sched_getaffinity fills the zeroed set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&cpu| libc::CPU_ISSET(cpu, &set)).collect()
    }
}
