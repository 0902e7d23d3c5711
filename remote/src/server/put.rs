//! The put family: streamed puts (`Put` and its `Data` frames), progressive puts (`PutOpen`,
//! `PutChunk`, `PutSeal`, `PutAbort`), batches (`PutBatch`, from `Data` frames, the put window
//! or the client's memory), the put window itself (`PutWindow`) and the leave to read the
//! client's memory (`PutDirect`).
//!
//! Owns reading a value's bytes from the socket, the window or the client straight into its
//! reservation,
//! and keeping the stream in step when a value is refused (its bytes are read and dropped).
//! Never buffers a whole value and never publishes one it has not read whole.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvtide::{Engine, Error as StoreError, PutOptions, Store};

use super::budget::OwnedWindow;
use super::client_memory::ClientMemory;
use super::connection::{Connection, Flow};
use super::reply::Reply;
use super::shared::Shared;
use crate::error::{Error, Result};
use crate::protocol::{
    FrameHeader, Op, PutChunkHead, PutHead, PutItem, ValueSource, PROBE_BYTES, PUT_CHUNK_HEAD_BYTES, PUT_HEAD_BYTES,
};
use crate::shm::PutWindow;
use crate::wire::{WResult, WireError};

/// Progressive puts one connection may hold open at once.
pub(super) const MAX_OPEN_PUTS_PER_CONNECTION: usize = 16;

impl Connection<'_> {
    /// `Put`: reserve, then read the value straight into the reservation, then commit.
    pub(super) fn put(&mut self, header: FrameHeader, shutting: bool) -> WResult<Flow> {
        let rid = header.request_id;
        if (header.payload_len as usize) < PUT_HEAD_BYTES {
            self.fatal(rid, &Error::Protocol("truncated put".into()));
            return Ok(Flow::Close);
        }
        let mut head = [0u8; PUT_HEAD_BYTES];
        self.io.read_exact(&mut head)?;
        let head = match PutHead::decode(&head, header.payload_len, &self.shared.limits) {
            Ok(h) => h,
            Err(e) => {
                // The data frames that follow cannot be told apart from requests: close.
                self.fatal(rid, &e.into());
                return Ok(Flow::Close);
            }
        };
        let mut key = vec![0u8; usize::from(head.key_len)];
        self.io.read_exact(&mut key)?;
        if shutting {
            self.reply_error(rid, &StoreError::ShuttingDown.into());
            return Ok(Flow::Close);
        }
        let engine = Arc::clone(&self.shared.engine);
        let opts = PutOptions { upsert: head.upsert, pin: head.pin };
        let reserved = engine.reserve_put(&key, head.total_len, opts);
        // The reservation's time is the owner's, not the client's.
        self.arm_read_deadline();
        match reserved {
            Ok(mut pending) => {
                let dst = pending.bytes_mut();
                self.io.read_exact(&mut dst[..head.inline_len as usize])?;
                let mut filled = head.inline_len;
                while filled < head.total_len {
                    let len = match self.next_data(rid, head.total_len - filled)? {
                        Some(len) => len,
                        None => return Ok(Flow::Close),
                    };
                    self.io.read_exact(&mut dst[filled as usize..(filled + len) as usize])?;
                    filled += len;
                }
                self.reply_result(rid, pending.commit().map_err(Error::from));
            }
            Err(e) => {
                // Consume the value so the stream stays in sync, then answer.
                self.io.skip(head.inline_len)?;
                let mut left = head.total_len - head.inline_len;
                while left > 0 {
                    let len = match self.next_data(rid, left)? {
                        Some(len) => len,
                        None => return Ok(Flow::Close),
                    };
                    self.io.skip(len)?;
                    left -= len;
                }
                self.reply_result(rid, Err(e.into()));
            }
        }
        Ok(Flow::Continue)
    }

    /// `PutChunk`: the chunk's bytes go from the socket straight into the put's reservation;
    /// when the chunk is refused they are read and dropped, so the stream stays in sync.
    pub(super) fn put_chunk(&mut self, header: FrameHeader) -> WResult<Flow> {
        let rid = header.request_id;
        if header.payload_len as usize != PUT_CHUNK_HEAD_BYTES {
            self.fatal(rid, &Error::Protocol("a put chunk head of the wrong length".into()));
            return Ok(Flow::Close);
        }
        let mut head = [0u8; PUT_CHUNK_HEAD_BYTES];
        self.io.read_exact(&mut head)?;
        let head = match PutChunkHead::decode(&head, &self.shared.limits) {
            Ok(h) => h,
            Err(e) => {
                self.fatal(rid, &e.into());
                return Ok(Flow::Close);
            }
        };
        self.arm_read_deadline();
        let Some(put) = self.puts.remove(&head.stream) else {
            return self.refuse_chunk(rid, head.len, unknown_put(head.stream));
        };
        let index = head.index as usize;
        let expected = put.chunk_range(index).map(|r| r.end - r.start);
        if expected != Some(head.len) {
            self.puts.insert(head.stream, put);
            let error = match expected {
                Some(len) => StoreError::SizeMismatch { object_bytes: len, destination_bytes: head.len },
                None => StoreError::InvalidArgument(format!("chunk {index} does not exist")),
            };
            return self.refuse_chunk(rid, head.len, error.into());
        }
        let mut called = false;
        let mut wire: Option<WireError> = None;
        let mut violated = false;
        let result = put.fill_chunk(index, |dst| {
            called = true;
            let mut filled = 0usize;
            while filled < dst.len() {
                let n = match self.next_data(rid, (dst.len() - filled) as u64) {
                    Ok(Some(n)) => n as usize,
                    Ok(None) => {
                        violated = true;
                        return Err(StoreError::Io("the chunk's data frames broke the protocol".into()));
                    }
                    Err(e) => {
                        wire = Some(e);
                        return Err(StoreError::Io("the connection failed in the middle of a chunk".into()));
                    }
                };
                if let Err(e) = self.io.read_exact(&mut dst[filled..filled + n]) {
                    wire = Some(e);
                    return Err(StoreError::Io("the connection failed in the middle of a chunk".into()));
                }
                filled += n;
            }
            Ok(())
        });
        // A connection that failed mid-chunk ends here; its puts (this one dropped) abort.
        if let Some(e) = wire {
            return Err(e);
        }
        if violated {
            return Ok(Flow::Close);
        }
        self.puts.insert(head.stream, put);
        if !called && head.len > 0 {
            // Refused before any byte was read (written already, expired, aborted).
            return self.refuse_chunk(
                rid,
                head.len,
                result.map_err(Error::from).err().unwrap_or(unknown_put(head.stream)),
            );
        }
        self.reply_result(rid, result.map_err(Error::from));
        Ok(Flow::Continue)
    }

    /// Reads and drops a refused chunk's `len` bytes of data frames, then answers `error`.
    pub(super) fn refuse_chunk(&mut self, rid: u64, len: u64, error: Error) -> WResult<Flow> {
        let mut left = len;
        while left > 0 {
            let Some(n) = self.next_data(rid, left)? else { return Ok(Flow::Close) };
            self.io.skip(n)?;
            left -= n;
        }
        self.reply_result(rid, Err(error));
        Ok(Flow::Continue)
    }

    /// Reads the header of the next `Data` frame of request `rid` (at most `left` bytes).
    /// None after a protocol violation (already answered).
    pub(super) fn next_data(&mut self, rid: u64, left: u64) -> WResult<Option<u64>> {
        self.arm_read_deadline();
        let Some(h) = self.read_header_or_close(rid)? else { return Ok(None) };
        if h.op != Op::Data || h.request_id != rid || h.payload_len == 0 || u64::from(h.payload_len) > left {
            self.fatal(rid, &Error::Protocol("put value frames out of order or too long".into()));
            return Ok(None);
        }
        Ok(Some(h.payload_len.into()))
    }

    /// `PutWindow`: a sealed memfd for this connection, within the owners' total.
    pub(super) fn open_window(&mut self, rid: u64) -> WResult<()> {
        let bytes = self.config().put_window_bytes;
        if !self.unix || bytes == 0 {
            let e = StoreError::InvalidArgument("this owner gives no put window here".into());
            self.reply_error(rid, &e.into());
            return Ok(());
        }
        if self.window.is_some() {
            let e = StoreError::InvalidArgument("this connection already has a put window".into());
            self.reply_error(rid, &e.into());
            return Ok(());
        }
        let max = self.config().max_put_window_bytes;
        let gauge = &self.shared.counters.put_window_bytes;
        if gauge.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes) > max {
            gauge.fetch_sub(bytes, Ordering::Relaxed);
            self.shared.counters.put_windows_refused.fetch_add(1, Ordering::Relaxed);
            let limit = usize::try_from(max).unwrap_or(usize::MAX);
            self.reply_error(rid, &StoreError::Busy { limit }.into());
            return Ok(());
        }
        match PutWindow::create(bytes) {
            Ok((window, fd)) => {
                // Counted from here on; the connection's drop gives the bytes back.
                self.window = Some(OwnedWindow { window, counters: Arc::clone(&self.shared.counters) });
                self.reply(rid, Reply::Window { bytes });
                self.io.flush_with_fd(Some(fd.as_fd()))?;
            }
            Err(e) => {
                gauge.fetch_sub(bytes, Ordering::Relaxed);
                let e = StoreError::Io(format!("cannot create a put window: {e}"));
                self.reply_error(rid, &e.into());
            }
        }
        Ok(())
    }

    /// `PutDirect`: lets this connection's batches name values in the client's memory, once
    /// the owner read the probe's nonce there (see `client_memory`).
    pub(super) fn grant_direct(&mut self, rid: u64, probe: u64, nonce: &[u8; PROBE_BYTES]) {
        if !self.config().direct_puts {
            let e = StoreError::InvalidArgument("this owner reads no client memory (direct puts are off)".into());
            self.reply_error(rid, &e.into());
            return;
        }
        match ClientMemory::grant(self.io.stream(), probe, nonce) {
            Ok(memory) => {
                self.client_memory = Some(memory);
                self.reply_result(rid, Ok(()));
            }
            Err(refusal) => {
                self.shared.counters.direct_puts_refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%refusal, "no direct puts for this connection");
                self.reply_error(rid, &StoreError::InvalidArgument(refusal.to_string()).into());
            }
        }
    }

    /// `PutBatch`: every value reserved at once (one request per shard), filled from the put
    /// window, the client's memory or the `Data` frames that follow, and published at once; one
    /// `Statuses` reply. A value that cannot be read fails only its own item.
    pub(super) fn put_batch(
        &mut self,
        rid: u64,
        opts: PutOptions,
        source: ValueSource,
        items: &[PutItem<'_>],
    ) -> WResult<Flow> {
        self.count_batch(items.len());
        let missing = match source {
            ValueSource::Window if self.window.is_none() => Some("no put window on this connection"),
            ValueSource::Client if self.client_memory.is_none() => {
                Some("this connection may not put from its memory (no PutDirect accepted)")
            }
            _ => None,
        };
        if let Some(why) = missing {
            // Nothing follows such a batch, so the stream is in sync: answer and go on.
            self.reply_error(rid, &StoreError::InvalidArgument(why.into()).into());
            return Ok(Flow::Continue);
        }
        let engine = Arc::clone(&self.shared.engine);
        let sizes: Vec<(&[u8], u64)> = items.iter().map(|i| (i.key, i.len)).collect();
        let mut pending = engine.reserve_puts(&sizes, opts);
        let mut failed: Vec<Option<Error>> = vec![None; items.len()];
        for (i, item) in items.iter().enumerate() {
            if let Some(w) = self.window.as_ref().filter(|_| source == ValueSource::Window) {
                if let Ok(dst) = pending.bytes_mut(i) {
                    if let Err(e) = w.read(item.window_offset, dst) {
                        failed[i] = Some(e.into());
                    }
                }
                continue;
            }
            if source == ValueSource::Client {
                continue; // read below, all at once
            }
            // The value's frames follow: into the reservation, or read and dropped.
            let mut filled = 0u64;
            while filled < item.len {
                let Some(n) = self.next_data(rid, item.len - filled)? else { return Ok(Flow::Close) };
                match pending.bytes_mut(i) {
                    Ok(dst) => self.io.read_exact(&mut dst[filled as usize..(filled + n) as usize])?,
                    Err(_) => self.io.skip(n)?,
                }
                filled += n;
            }
        }
        if let Some(memory) = self.client_memory.as_ref().filter(|_| source == ValueSource::Client) {
            // A second reading thread helps only where a core is free for it.
            let busy = self.shared.counters.connection_threads.load(Ordering::Relaxed) as usize;
            let split = busy < self.shared.cores;
            let read = memory.read_all(items, pending.all_bytes_mut(), split);
            self.shared.counters.direct_put_bytes.fetch_add(read.bytes, Ordering::Relaxed);
            for (i, e) in read.failed {
                failed[i] = Some(StoreError::InvalidArgument(e.to_string()).into());
            }
        }
        if source == ValueSource::Client && self.io.stream().peer_closed() {
            // The client gave up on this request and may reuse its buffers: what was read may
            // not be the values it asked for. Nothing is published; the connection ends.
            drop(pending);
            return Ok(Flow::Close);
        }
        let statuses: Vec<Result<()>> = pending
            .commit(|i| failed[i].is_none())
            .into_iter()
            .zip(failed)
            .map(|(committed, failed)| match failed {
                Some(e) => Err(e),
                None => committed.map_err(Error::from),
            })
            .collect();
        self.reply(rid, Reply::Statuses(&statuses));
        Ok(Flow::Continue)
    }
}

impl<'s> Connection<'s> {
    /// `PutOpen`: a progressive put on the owner's engine, held by this connection.
    pub(super) fn put_open(&mut self, rid: u64, key: &[u8], total_len: u64, chunk_bytes: u64, opts: PutOptions) {
        if self.puts.len() >= MAX_OPEN_PUTS_PER_CONNECTION {
            self.reply_result(rid, Err(StoreError::Busy { limit: MAX_OPEN_PUTS_PER_CONNECTION }.into()));
            return;
        }
        let shared: &'s Arc<Shared> = self.shared;
        let engine: &'s Engine = &shared.engine;
        match engine.progressive_put(key, total_len, chunk_bytes, opts) {
            Ok(put) => {
                self.puts.insert(rid, put);
                self.reply_result(rid, Ok(()));
            }
            Err(e) => self.reply_result(rid, Err(e.into())),
        }
    }
}

impl Connection<'_> {
    /// `PutSeal`: publishes an open progressive put.
    pub(super) fn put_seal(&mut self, rid: u64, stream: u64) {
        let result = match self.puts.get_mut(&stream) {
            None => Err(unknown_put(stream)),
            Some(put) => put.seal().map_err(Error::from),
        };
        // A seal refused for missing chunks leaves the put open; otherwise it is over.
        if !matches!(result, Err(Error::Store(StoreError::InvalidArgument(_)))) {
            self.puts.remove(&stream);
        }
        self.reply_result(rid, result);
    }

    /// `PutAbort`: gives up an open progressive put (an unknown one is already gone).
    pub(super) fn put_abort(&mut self, rid: u64, stream: u64) {
        if let Some(put) = self.puts.remove(&stream) {
            put.abort();
        }
        self.reply_result(rid, Ok(()));
    }

    /// `RemoveBatch`: one status per key.
    pub(super) fn remove_batch(&mut self, rid: u64, keys: &[&[u8]], force: bool) {
        self.count_batch(keys.len());
        let statuses: Vec<Result<()>> =
            self.shared.engine.batch_remove(keys, force).into_iter().map(|r| r.map_err(Error::from)).collect();
        self.reply(rid, Reply::Statuses(&statuses));
    }
}

fn unknown_put(stream: u64) -> Error {
    StoreError::InvalidArgument(format!("no open progressive put {stream} on this connection")).into()
}
