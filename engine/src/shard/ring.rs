//! A shard's io_uring ring and its table of in-flight operations.
//!
//! Owns the ring and the memory of every operation in flight. Every SQE's `user_data` is a key into `ops`; the entry owns whatever memory the kernel may
//! write until the CQE arrives (the eventfd read buffer, the timeout's timespec, SSD
//! buffers), so nothing the kernel can touch is freed early. The ring never
//! decides what an operation means: `reap` hands each completion back to the loop.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use kvtide_tiers::ssd::{files::pread, DiskCompletion, DiskIo, DiskOp, DiskOpKind, FileId, ShardFiles};
use slab::Slab;

/// `user_data` of cancellation requests, whose own completions carry nothing.
const CANCEL_TAG: u64 = u64::MAX;

/// io_uring caps one registered buffer at 1 GiB.
const FIXED_BUFFER_MAX_BYTES: usize = 1 << 30;

/// The slice is registered in pieces of this size, one per shard loop turn, so registering
/// (which pins, and so faults in, every page) never holds a shard for long nor delays start-up.
const FIXED_BUFFER_PIECE_BYTES: usize = 8 << 20;

/// An operation the kernel holds. Its fields live until the completion arrives.
// The boxed fields are never read by us: they exist so the kernel has somewhere to write.
#[allow(dead_code)]
pub(crate) enum RingOp {
    /// An 8-byte read of the inbox eventfd: completes when a sender wakes the shard.
    Wake { buf: Box<u64> },
    /// A wake-up at the next timer deadline.
    Timer { spec: Box<types::Timespec> },
    /// An SSD operation; its buffer belongs to the shard core's operation `token`.
    Disk { token: u64 },
}

/// What a completion was for.
pub(crate) enum RingEvent {
    Wake,
    Timer,
}

/// The shard's segment files as the ring sees them.
struct Files {
    files: ShardFiles,
}

pub(crate) struct Ring {
    /// None when io_uring is off or refused: a DRAM-only shard then parks with poll(2) on its
    /// eventfd (`park_without_io_uring`), and there is no disk I/O.
    ring: Option<IoUring>,
    /// Without io_uring: the eventfd and timeout the next park polls, and what it saw.
    poll_fd: Option<i32>,
    poll_after: Option<Duration>,
    polled: Vec<(RingEvent, i32)>,
    ops: Slab<RingOp>,
    wake_armed: bool,
    timer_armed: bool,
    /// Fixed buffers by index: (address, length, registered yet).
    fixed: Vec<(usize, usize, bool)>,
    /// The next buffer index to register, while the table is filled piece by piece.
    fixed_next: usize,
    files: Option<Files>,
    disk_in_flight: usize,
    disk_done: Vec<DiskCompletion>,
}

impl Ring {
    pub(crate) fn new(entries: u32) -> std::io::Result<Ring> {
        let mut ring = Ring::without_io_uring();
        ring.ring = Some(IoUring::new(entries)?);
        Ok(ring)
    }

    /// A ring for a DRAM-only shard where io_uring is off or refused: it parks with poll(2).
    pub(crate) fn without_io_uring() -> Ring {
        Ring {
            ring: None,
            poll_fd: None,
            poll_after: None,
            polled: Vec::new(),
            ops: Slab::new(),
            wake_armed: false,
            timer_armed: false,
            fixed: Vec::new(),
            fixed_next: 0,
            files: None,
            disk_in_flight: 0,
            disk_done: Vec::new(),
        }
    }

    fn uring(&mut self) -> std::io::Result<&mut IoUring> {
        self.ring.as_mut().ok_or_else(|| std::io::Error::other("io_uring is off"))
    }

    /// Starts registering `pieces` (address, length) of the shard's arena slice as fixed
    /// buffers, so SSD I/O can use ReadFixed/WriteFixed into them. With a sparse table (Linux
    /// 5.19+) nothing is pinned yet: `register_next_fixed` fills it piece by piece, and I/O into
    /// a piece not yet registered uses plain reads and writes. Older kernels register all at
    /// once here. True when pieces remain to register. The caller keeps the memory mapped for
    /// as long as the ring lives.
    pub(crate) fn begin_fixed_buffers(&mut self, pieces: &[(usize, usize)]) -> std::io::Result<bool> {
        debug_assert!(pieces.iter().all(|&(_, len)| len <= FIXED_BUFFER_MAX_BYTES));
        let count = u32::try_from(pieces.len()).map_err(|_| std::io::Error::other("too many fixed buffers"))?;
        if self.uring()?.submitter().register_buffers_sparse(count).is_ok() {
            self.fixed = pieces.iter().map(|&(addr, len)| (addr, len, false)).collect();
            self.fixed_next = 0;
            return Ok(!pieces.is_empty());
        }
        let iovecs: Vec<libc::iovec> = pieces.iter().map(|&(addr, len)| iovec(addr, len)).collect();
        // SAFETY: every iovec describes memory of the arena slice, which the shard keeps mapped
        // longer than the ring (the ring is dropped first); the kernel pins those pages.
        unsafe { self.uring()?.submitter().register_buffers(&iovecs) }?;
        self.fixed = pieces.iter().map(|&(addr, len)| (addr, len, true)).collect();
        self.fixed_next = pieces.len();
        Ok(false)
    }

    /// Registers the next piece of a sparse table. True when pieces remain.
    pub(crate) fn register_next_fixed(&mut self) -> std::io::Result<bool> {
        let Some(&(addr, len, _)) = self.fixed.get(self.fixed_next) else { return Ok(false) };
        let index = self.fixed_next as u32;
        // SAFETY: as in `begin_fixed_buffers`: arena memory that outlives the ring.
        unsafe { self.uring()?.submitter().register_buffers_update(index, &[iovec(addr, len)], None) }?;
        self.fixed[self.fixed_next].2 = true;
        self.fixed_next += 1;
        Ok(self.fixed_next < self.fixed.len())
    }

    /// Stops registering further pieces (a registration failed); those registered stay.
    pub(crate) fn abandon_fixed(&mut self) {
        self.fixed_next = self.fixed.len();
    }

    /// Gives the ring the shard's segment files.
    pub(crate) fn attach_files(&mut self, files: ShardFiles) {
        self.files = Some(Files { files });
    }

    /// The registered buffer holding `[addr, addr+len)`, if any.
    fn fixed_index(&self, addr: usize, len: usize) -> Option<u16> {
        self.fixed
            .iter()
            .position(|&(base, blen, registered)| registered && addr >= base && addr + len <= base + blen)
            .and_then(|i| u16::try_from(i).ok())
    }

    fn fd(&self, file: FileId) -> Option<i32> {
        self.files.as_ref().and_then(|f| f.files.io_fds.get(file as usize)).map(|fd| fd.as_raw_fd())
    }

    pub(crate) fn fixed_buffer_piece_bytes() -> usize {
        FIXED_BUFFER_PIECE_BYTES
    }

    /// Makes sure an eventfd read is outstanding, so a sender's write completes a CQE.
    pub(crate) fn arm_wake(&mut self, eventfd: i32) -> std::io::Result<()> {
        if self.wake_armed {
            return Ok(());
        }
        if self.ring.is_none() {
            self.poll_fd = Some(eventfd);
            self.wake_armed = true;
            return Ok(());
        }
        let mut buf = Box::new(0u64);
        let ptr: *mut u64 = &mut *buf;
        let key = self.ops.insert(RingOp::Wake { buf });
        let sqe = opcode::Read::new(types::Fd(eventfd), ptr.cast(), 8).build().user_data(key as u64);
        // SAFETY: the buffer lives in `ops[key]` until its completion is reaped, and the eventfd
        // stays open for the shard's lifetime.
        if unsafe { self.uring()?.submission().push(&sqe) }.is_err() {
            self.ops.remove(key);
            return Err(std::io::Error::other("submission queue full"));
        }
        self.wake_armed = true;
        Ok(())
    }

    /// Makes sure a timeout fires within `after` (only one is kept; an early one is harmless).
    pub(crate) fn arm_timer(&mut self, after: Duration) -> std::io::Result<()> {
        if self.timer_armed {
            return Ok(());
        }
        if self.ring.is_none() {
            self.poll_after = Some(after);
            self.timer_armed = true;
            return Ok(());
        }
        let spec = Box::new(types::Timespec::from(after));
        let ptr: *const types::Timespec = &*spec;
        let key = self.ops.insert(RingOp::Timer { spec });
        let sqe = opcode::Timeout::new(ptr).build().user_data(key as u64);
        // SAFETY: the timespec lives in `ops[key]` until the timeout's completion is reaped.
        if unsafe { self.uring()?.submission().push(&sqe) }.is_err() {
            self.ops.remove(key);
            return Err(std::io::Error::other("submission queue full"));
        }
        self.timer_armed = true;
        Ok(())
    }

    /// Submits pending SQEs and blocks until at least one completion.
    pub(crate) fn submit_and_wait(&mut self) -> std::io::Result<()> {
        let Some(ring) = self.ring.as_mut() else {
            self.park_without_io_uring();
            return Ok(());
        };
        match ring.submit_and_wait(1) {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Submits pending SQEs without waiting.
    pub(crate) fn submit(&mut self) -> std::io::Result<()> {
        let Some(ring) = self.ring.as_mut() else { return Ok(()) };
        match ring.submit() {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Takes every available completion, frees its op entry and reports what it was.
    pub(crate) fn reap_cq(&mut self, mut on_completion: impl FnMut(RingEvent, i32)) -> usize {
        let mut reaped = 0;
        let Some(ring) = self.ring.as_mut() else {
            let polled = std::mem::take(&mut self.polled);
            let count = polled.len();
            polled.into_iter().for_each(|(completion, result)| on_completion(completion, result));
            return count;
        };
        let cq: Vec<(u64, i32)> = ring.completion().map(|cqe| (cqe.user_data(), cqe.result())).collect();
        for (user_data, result) in cq {
            if user_data == CANCEL_TAG {
                continue;
            }
            let Some(op) = self.ops.try_remove(user_data as usize) else {
                tracing::warn!(user_data, "completion for an unknown operation");
                continue;
            };
            reaped += 1;
            match op {
                RingOp::Wake { .. } => {
                    self.wake_armed = false;
                    on_completion(RingEvent::Wake, result);
                }
                RingOp::Timer { .. } => {
                    self.timer_armed = false;
                    on_completion(RingEvent::Timer, result);
                }
                RingOp::Disk { token } => {
                    self.disk_in_flight -= 1;
                    self.disk_done.push(DiskCompletion { token, result: i64::from(result) });
                }
            }
        }
        reaped
    }

    /// Cancels every outstanding operation and waits for the kernel to let go of their memory.
    /// Called at shutdown, before the ring is dropped.
    pub(crate) fn drain(&mut self) {
        let Some(ring) = self.ring.as_mut() else { return };
        let keys: Vec<u64> = self.ops.iter().map(|(key, _)| key as u64).collect();
        for key in keys {
            let sqe = opcode::AsyncCancel::new(key).build().user_data(CANCEL_TAG);
            // SAFETY: a cancel SQE carries no pointers.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                break;
            }
        }
        for _ in 0..1000 {
            if self.ops.is_empty() {
                return;
            }
            if self.submit_and_wait().is_err() {
                break;
            }
            self.reap_cq(|_, _| {});
        }
        // The kernel would not give them back: leak the buffers rather than free memory it may
        // still write (a few bytes per shard, only on a broken kernel).
        let stuck = std::mem::take(&mut self.ops);
        tracing::error!(ops = stuck.len(), "io_uring operations did not drain at shutdown");
        std::mem::forget(stuck);
    }
}

impl DiskIo for Ring {
    unsafe fn submit(&mut self, op: DiskOp) -> Result<(), DiskOp> {
        let Some(fd) = self.fd(op.file) else {
            self.disk_done.push(DiskCompletion { token: op.token, result: -i64::from(libc::EBADF) });
            return Ok(());
        };
        let key = self.ops.vacant_key();
        let sqe = match op.kind {
            DiskOpKind::Read { buf, len, offset } => match self.fixed_index(buf as usize, len as usize) {
                Some(index) => opcode::ReadFixed::new(types::Fd(fd), buf, len, index).offset(offset).build(),
                None => opcode::Read::new(types::Fd(fd), buf, len).offset(offset).build(),
            },
            DiskOpKind::Write { buf, len, offset } => match self.fixed_index(buf as usize, len as usize) {
                Some(index) => opcode::WriteFixed::new(types::Fd(fd), buf, len, index).offset(offset).build(),
                None => opcode::Write::new(types::Fd(fd), buf, len).offset(offset).build(),
            },
            DiskOpKind::Sync => opcode::Fsync::new(types::Fd(fd)).flags(types::FsyncFlags::DATASYNC).build(),
        }
        .user_data(key as u64);
        let Some(ring) = self.ring.as_mut() else {
            // Files without io_uring never happen (start-up refuses an SSD tier then).
            self.disk_done.push(DiskCompletion { token: op.token, result: -i64::from(libc::ENOSYS) });
            return Ok(());
        };
        // SAFETY: the caller keeps the buffer valid until this op's completion is reaped (the
        // DiskIo contract); the descriptor stays open while the ring lives.
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            // Make room by handing the queued entries to the kernel, then try once more.
            let _ = self.submit();
            let Ok(ring) = self.uring() else { return Err(op) };
            // SAFETY: as above.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                return Err(op);
            }
        }
        self.ops.insert(RingOp::Disk { token: op.token });
        self.disk_in_flight += 1;
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<DiskCompletion>) {
        out.append(&mut self.disk_done);
    }

    fn in_flight(&self) -> usize {
        self.disk_in_flight
    }

    fn read_at(&mut self, file: FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let fd: &OwnedFd = self
            .files
            .as_ref()
            .and_then(|f| f.files.scan_fds.get(file as usize))
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EBADF))?;
        pread(fd, offset, buf)
    }

    fn file_count(&self) -> u32 {
        self.files.as_ref().map_or(0, |f| f.files.scan_fds.len() as u32)
    }

    fn file_bytes(&self) -> u64 {
        self.files.as_ref().map_or(0, |f| f.files.segment_bytes)
    }
}

fn iovec(addr: usize, len: usize) -> libc::iovec {
    libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len }
}

impl Ring {
    /// A park without io_uring: poll(2) the armed eventfd until it is readable or the armed
    /// timeout passes, then report a Wake (the eventfd read, which resets it) or a Timer.
    fn park_without_io_uring(&mut self) {
        let timeout_ms = self.poll_after.map_or(-1, |d| i32::try_from(d.as_millis().max(1)).unwrap_or(i32::MAX));
        let fd = self.poll_fd.unwrap_or(-1);
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd (a negative fd is ignored by poll, which then only waits).
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc > 0 && fd >= 0 {
            let mut value = 0u64;
            // SAFETY: reads 8 bytes into `value` from the shard's non-blocking eventfd.
            let n = unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
            self.polled.push((RingEvent::Wake, n as i32));
            self.wake_armed = false;
        } else if rc == 0 {
            self.polled.push((RingEvent::Timer, -libc::ETIME));
        }
        // A timeout is armed per park here (io_uring keeps one until it fires).
        self.timer_armed = false;
        self.poll_after = None;
    }
}
