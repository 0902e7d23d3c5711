//! Socket plumbing for the owner and the client: one stream type over Unix and TCP, gathered
//! sends with `MSG_NOSIGNAL` (a closed peer is an error, never a `SIGPIPE`), receives straight
//! into caller memory, `SCM_RIGHTS` descriptor passing, and an eventfd used as a broadcast
//! "shutting down" signal. It never interprets the bytes it moves.

use std::io::{self, IoSlice};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A connected stream socket.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub(crate) fn fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }

    pub(crate) fn is_unix(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }

    /// True for a TCP connection to a loopback address.
    pub(crate) fn is_loopback(&self) -> bool {
        matches!(self, Stream::Tcp(s) if s.peer_addr().is_ok_and(|a| a.ip().is_loopback()))
    }

    /// The process id of a Unix peer as the kernel recorded it at connect (`SO_PEERCRED`); None
    /// over TCP, or when the peer's process is not visible in this pid namespace.
    pub(crate) fn peer_pid(&self) -> Option<libc::pid_t> {
        self.peer_cred().map(|c| c.pid)
    }

    /// The credentials of a Unix peer as the kernel recorded them at connect (`SO_PEERCRED`);
    /// None over TCP, or when the peer's process is not visible in this pid namespace.
    pub(crate) fn peer_cred(&self) -> Option<libc::ucred> {
        let Stream::Unix(s) = self else { return None };
        let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt fills at most `len` bytes of `cred`, a plain struct we own.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        (rc == 0 && cred.pid > 0).then_some(cred)
    }

    /// A process descriptor of the Unix peer that connected (`SO_PEERPIDFD`, Linux 6.5 and
    /// later): it names that very process, never one that reused its pid. None over TCP, on older
    /// kernels, or when the peer is gone.
    pub(crate) fn peer_pidfd(&self) -> Option<Pidfd> {
        /// `SO_PEERPIDFD` (asm-generic; the libc crate may not name it yet).
        const SO_PEERPIDFD: libc::c_int = 77;
        let Stream::Unix(s) = self else { return None };
        let pid = self.peer_cred()?.pid;
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `fd`, an int we own.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&mut fd as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 || fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor the kernel just gave us, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Some(Pidfd { fd, pid })
    }

    /// Whether the peer shut the connection (or it failed): a zero-timeout `poll` for
    /// `POLLRDHUP`. Bytes still unread do not hide it.
    pub(crate) fn peer_closed(&self) -> bool {
        let mut pfd = libc::pollfd { fd: self.fd(), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one pollfd of a descriptor we own; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
        ready < 0 || pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// Read and write timeouts (`SO_RCVTIMEO`/`SO_SNDTIMEO`); they also bound the raw calls below.
    pub(crate) fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        let timeout = timeout.map(|t| t.max(Duration::from_millis(1)));
        match self {
            Stream::Unix(s) => {
                s.set_read_timeout(timeout)?;
                s.set_write_timeout(timeout)
            }
            Stream::Tcp(s) => {
                s.set_read_timeout(timeout)?;
                s.set_write_timeout(timeout)
            }
        }
    }

    pub(crate) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tcp(s) => s.set_nonblocking(on),
        }
    }

    pub(crate) fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Shuts the write side: the peer reads what was sent, then end of stream.
    pub(crate) fn shutdown_write(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Write),
            Stream::Tcp(s) => s.shutdown(Shutdown::Write),
        };
    }

    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }
}

/// Sends every byte of `bufs`, in order; the first `sendmsg` carries `fd` when given.
pub(crate) fn send_all(sock: RawFd, bufs: &[IoSlice<'_>], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    send_all_until(sock, bufs, fd, None)
}

/// `send_all`, giving up (`TimedOut`, part of the bytes sent) once `deadline` passed with bytes
/// left. With a deadline the sends do not block: between them the wait for room is a `poll`
/// that ends at the deadline, so a peer that reads a little at a time cannot stretch the send
/// past it (one blocking `sendmsg` keeps going as long as each piece finds room in time).
pub(crate) fn send_all_until(
    sock: RawFd,
    bufs: &[IoSlice<'_>],
    mut fd: Option<BorrowedFd<'_>>,
    deadline: Option<Instant>,
) -> io::Result<()> {
    let mut storage: Vec<IoSlice<'_>> = bufs.iter().filter(|b| !b.is_empty()).copied().collect();
    let mut slices: &mut [IoSlice<'_>] = &mut storage;
    let flags = if deadline.is_some() { libc::MSG_DONTWAIT } else { 0 };
    while !slices.is_empty() || fd.is_some() {
        // At most IOV_MAX (1024) slices per call.
        let count = slices.len().min(1024);
        let sent = match sendmsg(sock, &slices[..count], fd, flags) {
            Ok(sent) => sent,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => match deadline {
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() || !wait_writable_for(sock, left)? {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "the send outlasted its deadline"));
                    }
                    continue;
                }
                None => return Err(e),
            },
            Err(e) => return Err(e),
        };
        fd = None;
        if sent == 0 && count > 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes"));
        }
        IoSlice::advance_slices(&mut slices, sent);
    }
    Ok(())
}

/// Waits until `sock` can take bytes (or failed), at most `timeout`; false when it timed out.
fn wait_writable_for(sock: RawFd, timeout: Duration) -> io::Result<bool> {
    wait_for(sock, libc::POLLOUT, timeout)
}

#[repr(C, align(8))]
struct CmsgSpace([u8; 64]);

fn sendmsg(sock: RawFd, bufs: &[IoSlice<'_>], fd: Option<BorrowedFd<'_>>, flags: libc::c_int) -> io::Result<usize> {
    let mut cmsg = CmsgSpace([0; 64]);
    // SAFETY: msghdr is plain data; an all-zero value is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec (documented); sendmsg only reads through the pointer.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len();
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        msg.msg_control = cmsg.0.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at `space` (<= 64) aligned bytes we own, so CMSG_FIRSTHDR
        // returns a header inside them, and CMSG_DATA has room for one descriptor.
        unsafe {
            let hdr = libc::CMSG_FIRSTHDR(&msg);
            (*hdr).cmsg_level = libc::SOL_SOCKET;
            (*hdr).cmsg_type = libc::SCM_RIGHTS;
            (*hdr).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(hdr).cast::<RawFd>(), fd.as_raw_fd());
        }
    }
    loop {
        // SAFETY: msg describes live buffers (bufs, cmsg) for the duration of the call.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Receives up to `len` bytes into `ptr`; 0 means the peer closed. Collects a descriptor passed
/// with `SCM_RIGHTS` into `fd_out` when given (extra descriptors are closed). `dont_wait`:
/// `WouldBlock` instead of blocking when nothing is there.
///
/// # Safety
/// `[ptr, ptr + len)` must be valid for writes for the duration of the call.
pub(crate) unsafe fn recv_into(
    sock: RawFd,
    ptr: *mut u8,
    len: usize,
    fd_out: Option<&mut Option<OwnedFd>>,
    dont_wait: bool,
) -> io::Result<usize> {
    let flags = libc::MSG_CMSG_CLOEXEC | if dont_wait { libc::MSG_DONTWAIT } else { 0 };
    let mut cmsg = CmsgSpace([0; 64]);
    let mut iov = libc::iovec { iov_base: ptr.cast(), iov_len: len };
    // SAFETY: msghdr is plain data; an all-zero value is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let want_fd = fd_out.is_some();
    if want_fd {
        msg.msg_control = cmsg.0.as_mut_ptr().cast();
        msg.msg_controllen = cmsg.0.len();
    }
    let n = loop {
        // SAFETY: iov points at caller memory valid for `len` bytes (this function's contract);
        // the control buffer is ours.
        let n = unsafe { libc::recvmsg(sock, &mut msg, flags) };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    if want_fd && msg.msg_controllen > 0 {
        let mut received: Vec<OwnedFd> = Vec::new();
        // SAFETY: the kernel filled msg_control/msg_controllen; the CMSG_* macros walk only
        // within them, and each SCM_RIGHTS payload holds whole descriptors that are now ours.
        unsafe {
            let mut hdr = libc::CMSG_FIRSTHDR(&msg);
            while !hdr.is_null() {
                if (*hdr).cmsg_level == libc::SOL_SOCKET && (*hdr).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(hdr);
                    let bytes = (*hdr).cmsg_len as usize - (data as usize - hdr as usize);
                    for i in 0..bytes / std::mem::size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        received.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                hdr = libc::CMSG_NXTHDR(&msg, hdr);
            }
        }
        if let Some(out) = fd_out {
            if !received.is_empty() {
                *out = Some(received.remove(0));
            }
        }
        // Any further descriptors are dropped (closed) here.
    }
    Ok(n)
}

/// Waits until `sock` is readable or `wake` is signalled; returns (sock readable, woken).
pub(crate) fn wait_readable(sock: RawFd, wake: RawFd, timeout_ms: i32) -> io::Result<(bool, bool)> {
    let mut fds = [
        libc::pollfd { fd: sock, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: wake, events: libc::POLLIN, revents: 0 },
    ];
    loop {
        // SAFETY: fds is a valid array of two pollfd structs for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if n >= 0 {
            let ready = |p: &libc::pollfd| p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
            return Ok((ready(&fds[0]), ready(&fds[1])));
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// `poll` over `fds` (retried when interrupted).
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<()> {
    loop {
        // SAFETY: fds is a valid array of pollfd structs for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if n >= 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Reads and discards what a (non-blocking) socket holds; true once the peer is gone (end of
/// stream or an error) or keeps sending past a small bound.
pub(crate) fn drain(sock: RawFd) -> bool {
    let mut buf = [0u8; 4096];
    for _ in 0..16 {
        // SAFETY: receives into a live stack buffer of the given length.
        let n = unsafe { libc::recv(sock, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n > 0 {
            continue;
        }
        if n == 0 {
            return true;
        }
        match io::Error::last_os_error().kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return false,
            _ => return true,
        }
    }
    true
}

/// Waits until `sock` is readable (or closed) for at most `timeout`; false when it passed.
pub(crate) fn wait_readable_for(sock: RawFd, timeout: Duration) -> io::Result<bool> {
    wait_for(sock, libc::POLLIN, timeout)
}

/// Waits until `sock` reports `events` (or an error or hang-up) for at most `timeout`; false
/// when it passed.
fn wait_for(sock: RawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut fds = [libc::pollfd { fd: sock, events, revents: 0 }];
    // Rounded up, so a wait never ends before the deadline it serves.
    poll(&mut fds, poll_timeout_ms(Some(timeout)))?;
    Ok(fds[0].revents != 0)
}

/// Milliseconds for `poll`, rounded up (-1, wait forever, for None).
pub(crate) fn poll_timeout_ms(timeout: Option<Duration>) -> i32 {
    timeout.map_or(-1, |t| t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32)
}

/// An eventfd that, once signalled, stays readable: a broadcast flag that `poll` can wait on.
#[derive(Debug)]
pub(crate) struct WakeFlag(OwnedFd);

impl WakeFlag {
    pub(crate) fn new() -> io::Result<WakeFlag> {
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        Ok(WakeFlag(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd. Nobody reads it, so it stays
        // readable; a full counter (EAGAIN) is already signalled.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A process descriptor (`pidfd_open`): it names one process for its whole life, so a pid
/// reused after that process exited is never mistaken for it.
#[derive(Debug)]
pub(crate) struct Pidfd {
    fd: OwnedFd,
    pid: libc::pid_t,
}

impl Pidfd {
    pub(crate) fn open(pid: libc::pid_t) -> io::Result<Pidfd> {
        if pid <= 0 {
            return Err(io::Error::other("the process id is not visible here"));
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Pidfd { fd: unsafe { OwnedFd::from_raw_fd(fd as i32) }, pid })
    }

    /// The pid this descriptor was opened for (it names this process while `!self.exited()`).
    pub(crate) fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// Whether the process has exited (a descriptor that cannot be polled counts as exited).
    pub(crate) fn exited(&self) -> bool {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd of a descriptor we own; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
        ready != 0
    }
}

/// Fills `buf` with random bytes from the kernel.
pub(crate) fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: writes at most the remaining length into our buffer.
        let n = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(())
}

/// This process's soft limit on open descriptors (None when it cannot be read).
pub(crate) fn descriptor_limit() -> Option<u64> {
    // SAFETY: an all-zero rlimit is a valid value; getrlimit fills it.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: getrlimit writes into the live struct above.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit.rlim_cur)
}

/// Raises this process's soft limit on open descriptors to its hard limit; returns the limit.
pub fn raise_descriptor_limit() -> io::Result<u64> {
    // SAFETY: an all-zero rlimit is a valid value; getrlimit fills it.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: getrlimit writes into the live struct above.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: setrlimit reads the live struct above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_closed_peer_is_seen_behind_unread_bytes() {
        use std::io::Write;
        let (a, mut b) = UnixStream::pair().expect("pair");
        let owner_side = Stream::Unix(a);
        assert!(!owner_side.peer_closed());
        b.write_all(b"a request not read yet").expect("write");
        assert!(!owner_side.peer_closed(), "bytes waiting are not a close");
        b.shutdown(Shutdown::Write).expect("shutdown");
        assert!(owner_side.peer_closed(), "a shut peer shows behind the unread bytes");
        let (c, d) = UnixStream::pair().expect("pair");
        drop(d);
        assert!(Stream::Unix(c).peer_closed());
    }

    #[test]
    fn a_process_descriptor_sees_its_process_exit() {
        let me = Pidfd::open(std::process::id() as libc::pid_t).expect("own pidfd");
        assert!(!me.exited());
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pidfd = Pidfd::open(child.id() as libc::pid_t).expect("child pidfd");
        child.wait().expect("wait");
        assert!(pidfd.exited(), "an exited (and reaped) process reads as exited");
        assert!(Pidfd::open(0).is_err() && Pidfd::open(-1).is_err());
    }

    #[test]
    fn a_send_to_a_peer_that_trickles_stops_at_its_deadline() {
        let (a, mut b) = UnixStream::pair().expect("pair");
        let writer = Stream::Unix(a);
        writer.set_timeouts(Some(Duration::from_millis(20))).expect("timeouts");
        // The peer reads a little every few milliseconds: each sendmsg makes progress within
        // the socket timeout, so only the deadline ends the send.
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                let mut total = 0usize;
                b.set_read_timeout(Some(Duration::from_millis(50))).expect("read timeout");
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(n) = b.read(&mut buf) {
                        total += n;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                total
            })
        };
        let data = vec![7u8; 64 << 20];
        let started = Instant::now();
        let deadline = started + Duration::from_millis(200);
        let err = send_all_until(writer.fd(), &[IoSlice::new(&data)], None, Some(deadline)).expect_err("deadline");
        let took = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        let read = reader.join().expect("reader");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(read > 0 && read < data.len(), "the peer got part of the bytes: {read}");
        assert!(took < Duration::from_secs(5), "gave up {took:?} after starting");
        // Without a deadline and with a reading peer, everything arrives.
        let (c, mut d) = UnixStream::pair().expect("pair");
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            d.read_to_end(&mut all).expect("read");
            all.len()
        });
        send_all_until(c.as_raw_fd(), &[IoSlice::new(&data[..1 << 20])], None, None).expect("send");
        drop(c);
        assert_eq!(reader.join().expect("reader"), 1 << 20);
    }
}
