//! Frame I/O over one stream: a small read buffer for headers and small payloads, reads of
//! large payloads straight into their destination, and a write buffer for small frames that is
//! sent together with bulk data in one gathered `sendmsg`.
//!
//! It owns the stream and its buffers. It never allocates a payload buffer whose size was not
//! first checked by `FrameHeader::decode` against the caller's limit.

use std::io::{self, IoSlice};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::protocol::{begin_frame, end_frame, FrameHeader, Limits, Op, ProtocolError, HEADER_BYTES};
use crate::sock::{self, Stream};
use crate::Error;

/// Bytes read per refill when waiting for a header: enough for a whole small reply, small
/// enough that little of a following bulk payload is copied through the buffer.
const FILL_BYTES: usize = 8 << 10;
/// Data frames with payloads up to this are copied into the write buffer (`push_data`) rather
/// than sent on their own: a send per small frame costs more than the copy.
const SMALL_FRAME_BYTES: usize = 16 << 10;
/// `push_data` sends the write buffer once it holds this much.
pub(crate) const FLUSH_BYTES: usize = 64 << 10;

/// Why a frame could not be read or written.
#[derive(Debug)]
pub(crate) enum WireError {
    /// The peer closed the connection (or reset it).
    Closed(String),
    /// A socket timeout passed.
    Timeout,
    /// The read deadline (`FrameIo::set_read_deadline`) passed before the bytes arrived.
    Deadline,
    /// Any other socket error.
    Io(io::Error),
    /// The peer sent something the protocol does not allow.
    Protocol(ProtocolError),
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> WireError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::Timeout,
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected => WireError::Closed(e.to_string()),
            _ => WireError::Io(e),
        }
    }
}

impl From<ProtocolError> for WireError {
    fn from(e: ProtocolError) -> WireError {
        WireError::Protocol(e)
    }
}

impl WireError {
    /// The typed error a caller sees; `op` and `timeout_ms` describe a timeout.
    pub(crate) fn into_error(self, op: &'static str, timeout_ms: u64) -> Error {
        match self {
            WireError::Closed(why) => Error::Disconnected(why),
            WireError::Timeout | WireError::Deadline => Error::Timeout { op, timeout_ms },
            WireError::Io(e) => Error::Disconnected(e.to_string()),
            WireError::Protocol(p) => p.into(),
        }
    }
}

pub(crate) type WResult<T> = std::result::Result<T, WireError>;

/// One stream with its read and write buffers.
#[derive(Debug)]
pub(crate) struct FrameIo {
    stream: Stream,
    rbuf: Box<[u8]>,
    start: usize,
    end: usize,
    wbuf: Vec<u8>,
    read_deadline: Option<Instant>,
    write_deadline: Option<Instant>,
    /// How long a read polls for bytes before it blocks (0: blocks at once).
    spin: Duration,
}

/// The default of `spin_us` (owner and client): a short poll before blocking saves the
/// peer's reply a thread wake-up, but only pays where there are CPUs to spare.
pub(crate) fn default_spin_us() -> u64 {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) >= 8 {
        50
    } else {
        0
    }
}

impl FrameIo {
    pub(crate) fn new(stream: Stream) -> FrameIo {
        FrameIo {
            stream,
            rbuf: vec![0u8; FILL_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            wbuf: Vec::new(),
            read_deadline: None,
            write_deadline: None,
            spin: Duration::ZERO,
        }
    }

    /// Reads poll for bytes this long before they block.
    pub(crate) fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Polls (without blocking) for up to the spin time until some bytes are buffered; true
    /// when they are. A closed peer reads as `Closed`.
    pub(crate) fn spin_for_input(&mut self) -> WResult<bool> {
        if self.buffered() > 0 {
            return Ok(true);
        }
        if self.spin.is_zero() {
            return Ok(false);
        }
        self.start = 0;
        self.end = 0;
        let started = Instant::now();
        loop {
            let dst = self.rbuf.as_mut_ptr();
            // SAFETY: rbuf is ours and empty; nothing else touches it during the call.
            match unsafe { sock::recv_into(self.stream.fd(), dst, self.rbuf.len(), None, true) } {
                Ok(0) => return Err(WireError::Closed("the peer closed the connection".into())),
                Ok(n) => {
                    self.end = n;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
            if started.elapsed() >= self.spin {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
    }

    /// Every read from now on must complete by `deadline` (`WireError::Deadline` otherwise),
    /// however the peer spaces its bytes; None: only the socket timeouts apply.
    pub(crate) fn set_read_deadline(&mut self, deadline: Option<Instant>) {
        self.read_deadline = deadline;
    }

    /// Every send from now on gives up (an error: the connection is then out of step) once
    /// `deadline` passed with bytes left; None: only the socket timeouts apply.
    pub(crate) fn set_write_deadline(&mut self, deadline: Option<Instant>) {
        self.write_deadline = deadline;
    }

    /// One receive into `[ptr, ptr + len)`, within the read deadline when one is set.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid for writes for the duration of the call.
    unsafe fn recv(&mut self, ptr: *mut u8, len: usize, mut fd_out: Option<&mut Option<OwnedFd>>) -> WResult<usize> {
        let fd = self.stream.fd();
        if !self.spin.is_zero() && fd_out.is_none() {
            let started = Instant::now();
            loop {
                // SAFETY: the caller's contract.
                match unsafe { sock::recv_into(fd, ptr, len, None, true) } {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    result => return Ok(result?),
                }
                if started.elapsed() >= self.spin {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        let Some(deadline) = self.read_deadline else {
            // SAFETY: the caller's contract.
            return Ok(unsafe { sock::recv_into(fd, ptr, len, fd_out, false) }?);
        };
        loop {
            // SAFETY: the caller's contract.
            match unsafe { sock::recv_into(fd, ptr, len, fd_out.as_deref_mut(), true) } {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Checked on every wait, so a peer that trickles bytes still meets the deadline.
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() || !sock::wait_readable_for(fd, left)? {
                        return Err(WireError::Deadline);
                    }
                }
                result => return Ok(result?),
            }
        }
    }

    pub(crate) fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Bytes received but not consumed yet.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Receives until at least `min` bytes are buffered (`min <= FILL_BYTES`).
    fn fill(&mut self, min: usize, mut fd_out: Option<&mut Option<OwnedFd>>) -> WResult<()> {
        debug_assert!(min <= self.rbuf.len());
        if self.start > 0 && self.rbuf.len() - self.start < min {
            self.rbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        while self.end - self.start < min {
            let room = self.rbuf.len() - self.end;
            let dst = self.rbuf[self.end..].as_mut_ptr();
            // SAFETY: [end, end + room) lies inside rbuf, which we own; nothing else touches it
            // during the call.
            let n = unsafe { self.recv(dst, room, fd_out.as_deref_mut()) }?;
            if n == 0 {
                return Err(WireError::Closed("the peer closed the connection".into()));
            }
            self.end += n;
        }
        Ok(())
    }

    /// Reads and validates the next frame header.
    pub(crate) fn read_header(&mut self, limits: &Limits) -> WResult<FrameHeader> {
        self.read_header_with_fd(limits, None)
    }

    /// `read_header`, also collecting a descriptor passed with the frame's first bytes.
    pub(crate) fn read_header_with_fd(
        &mut self,
        limits: &Limits,
        fd_out: Option<&mut Option<OwnedFd>>,
    ) -> WResult<FrameHeader> {
        self.fill(HEADER_BYTES, fd_out)?;
        let header = FrameHeader::decode(&self.rbuf[self.start..self.start + HEADER_BYTES], limits.max_payload_bytes)?;
        self.start += HEADER_BYTES;
        Ok(header)
    }

    /// Reads exactly `len` bytes into `ptr`: buffered bytes first, the rest straight from the
    /// socket.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid for writes and not aliased during the call.
    pub(crate) unsafe fn read_raw(&mut self, ptr: *mut u8, len: usize) -> WResult<()> {
        let from_buf = len.min(self.buffered());
        // SAFETY: the source lies in rbuf[start..end]; the destination is the caller's, valid
        // for `len >= from_buf` bytes, and cannot overlap our private buffer.
        unsafe { kvtide_transport::memcpy::copy_bytes(ptr, self.rbuf.as_ptr().add(self.start), from_buf) };
        self.start += from_buf;
        let mut done = from_buf;
        while done < len {
            // SAFETY: [ptr + done, ptr + len) is inside the caller's valid range.
            let n = unsafe { self.recv(ptr.add(done), len - done, None) }?;
            if n == 0 {
                return Err(WireError::Closed("the peer closed the connection mid-frame".into()));
            }
            done += n;
        }
        Ok(())
    }

    /// Reads exactly `dst.len()` bytes into `dst`.
    pub(crate) fn read_exact(&mut self, dst: &mut [u8]) -> WResult<()> {
        // SAFETY: dst is a unique borrow valid for its length.
        unsafe { self.read_raw(dst.as_mut_ptr(), dst.len()) }
    }

    /// Reads a `len`-byte payload into a new vector (`len` was checked by the header decoder).
    pub(crate) fn read_payload(&mut self, len: u32) -> WResult<Vec<u8>> {
        let mut payload = vec![0u8; len as usize];
        self.read_exact(&mut payload)?;
        Ok(payload)
    }

    /// Reads and discards `len` bytes.
    pub(crate) fn skip(&mut self, mut len: u64) -> WResult<()> {
        while len > 0 {
            if self.buffered() == 0 {
                self.fill(1, None)?;
            }
            let n = (self.buffered() as u64).min(len) as usize;
            self.start += n;
            len -= n as u64;
        }
        Ok(())
    }

    // ---- writing -------------------------------------------------------------------------------

    /// Starts a frame in the write buffer; finish it with `end_frame`.
    pub(crate) fn begin(&mut self, op: Op, request_id: u64) -> usize {
        begin_frame(&mut self.wbuf, op, request_id)
    }

    /// The write buffer, to append a payload to.
    pub(crate) fn out(&mut self) -> &mut Vec<u8> {
        &mut self.wbuf
    }

    /// Finishes the frame begun at `start`.
    pub(crate) fn end(&mut self, start: usize) {
        end_frame(&mut self.wbuf, start);
    }

    /// Appends a whole frame.
    pub(crate) fn push_frame(&mut self, op: Op, request_id: u64, payload: &[u8]) {
        let start = self.begin(op, request_id);
        self.wbuf.extend_from_slice(payload);
        self.end(start);
    }

    /// Bytes waiting in the write buffer.
    pub(crate) fn pending_out(&self) -> usize {
        self.wbuf.len()
    }

    /// Sends the write buffer.
    pub(crate) fn flush(&mut self) -> WResult<()> {
        self.flush_with_fd(None)
    }

    /// Sends the write buffer with `fd` attached to its first byte.
    pub(crate) fn flush_with_fd(&mut self, fd: Option<BorrowedFd<'_>>) -> WResult<()> {
        if self.wbuf.is_empty() {
            return Ok(());
        }
        let result = sock::send_all_until(self.stream.fd(), &[IoSlice::new(&self.wbuf)], fd, self.write_deadline);
        self.wbuf.clear();
        Ok(result?)
    }

    /// Queues a data frame: a payload of at most `SMALL_FRAME_BYTES` is copied into the write
    /// buffer (sent once the buffer holds `FLUSH_BYTES`, or by the next `flush`), a larger one
    /// is sent now, after what the buffer holds. Flush before waiting for an answer.
    pub(crate) fn push_data(&mut self, op: Op, request_id: u64, data: &[IoSlice<'_>]) -> WResult<()> {
        let len: usize = data.iter().map(|d| d.len()).sum();
        if len > SMALL_FRAME_BYTES {
            return self.send_data(op, request_id, data);
        }
        let start = self.begin(op, request_id);
        for d in data {
            self.wbuf.extend_from_slice(d);
        }
        self.end(start);
        if self.wbuf.len() >= FLUSH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Sends the write buffer, then a frame header and `data` (gathered, no copy of `data`).
    pub(crate) fn send_data(&mut self, op: Op, request_id: u64, data: &[IoSlice<'_>]) -> WResult<()> {
        let len: usize = data.iter().map(|d| d.len()).sum();
        let header = FrameHeader::new(op, request_id, len as u32).encode();
        let mut bufs = Vec::with_capacity(data.len() + 2);
        bufs.push(IoSlice::new(&self.wbuf));
        bufs.push(IoSlice::new(&header));
        bufs.extend_from_slice(data);
        let result = sock::send_all_until(self.stream.fd(), &bufs, None, self.write_deadline);
        self.wbuf.clear();
        Ok(result?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// Frames `(op, payload)` the peer receives, until it has seen `n` of them or nothing is
    /// pending for a moment.
    fn received(peer: &mut FrameIo, n: usize) -> Vec<(Op, Vec<u8>)> {
        let limits = Limits::default();
        let mut out = Vec::new();
        peer.set_read_deadline(Some(Instant::now() + Duration::from_millis(200)));
        while out.len() < n {
            let Ok(h) = peer.read_header(&limits) else { break };
            out.push((h.op, peer.read_payload(h.payload_len).expect("payload")));
        }
        out
    }

    #[test]
    fn small_data_frames_wait_for_a_flush_and_large_ones_go_out_in_order() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mut io = FrameIo::new(Stream::Unix(a));
        let mut peer = FrameIo::new(Stream::Unix(b));
        let small = [7u8; 100];
        io.push_data(Op::Data, 1, &[IoSlice::new(&small[..60]), IoSlice::new(&small[60..])]).expect("push");
        io.push_data(Op::Data, 1, &[IoSlice::new(&small[..5])]).expect("push");
        assert!(received(&mut peer, 1).is_empty(), "small frames stay buffered");
        // A large payload sends what is buffered, then itself.
        let large = vec![9u8; SMALL_FRAME_BYTES + 1];
        io.push_data(Op::Data, 2, &[IoSlice::new(&large)]).expect("push large");
        assert_eq!(
            received(&mut peer, 3),
            vec![(Op::Data, small.to_vec()), (Op::Data, small[..5].to_vec()), (Op::Data, large.clone())]
        );
        assert_eq!(io.pending_out(), 0);
        // The buffer goes out by itself once it holds FLUSH_BYTES; the rest waits for a flush.
        let frame_bytes = small.len() + HEADER_BYTES;
        let frames = FLUSH_BYTES / frame_bytes + 10;
        for _ in 0..frames {
            io.push_data(Op::Data, 3, &[IoSlice::new(&small)]).expect("push");
        }
        let sent = FLUSH_BYTES.div_ceil(frame_bytes);
        assert_eq!(io.pending_out(), (frames - sent) * frame_bytes);
        let got = received(&mut peer, frames);
        assert_eq!(got.len(), sent);
        assert!(got.iter().all(|f| *f == (Op::Data, small.to_vec())));
        io.flush().expect("flush");
        assert_eq!(received(&mut peer, frames).len(), frames - sent);
    }
}
