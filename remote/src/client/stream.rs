//! Progressive and streaming reads through the owner, behind the engine's `ChunkHandle`.
//!
//! Owns the client side of chunked reads: `progressive_get` sends one `Get` on a connection of
//! its own, learns the object's length from the first reply, and hands the rest to a thread
//! that settles each chunk as its bytes land (copied out of the shared arena under the lease on
//! a Unix socket; read from `Data` frames otherwise); `streaming_batch_get_buffer_ranges` runs
//! the chunks as range requests, a few chunks per request, in the caller's order;
//! `progressive_put` holds a put open on the owner over a connection of its own. It never
//! settles a chunk before its bytes are in the destination, and never reports a chunk copied
//! from the arena after its lease could have run out.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtide::{check_chunk_count, chunk_count, chunk_pair, cut_chunks, ChunkHandle, ChunkPlace, ChunkSink};
use kvtide::{Error as StoreError, Fragment, Store};
use kvtide_transport::Region;

use super::arena::Arena;
use super::arguments::{check_destination, check_source};
use super::conn::{source_slices, Conn, Pace, LEASE_MARGIN};
use super::gpu::{BouncePair, ClientGpu};
use super::Inner;
use super::RemoteStore;
use crate::error::{Error, Result};
use crate::protocol::{
    decode_error_frame, decode_grants, decode_object, GetItem, LenCheck, Op, ProtocolError, PutChunkHead, Request,
    WHOLE_REQUEST,
};
use crate::wire::{WResult, WireError};

/// Chunks per range request of a streaming read: the window of chunks in flight.
const STREAM_GROUP_CHUNKS: usize = 4;

/// What the first reply to a progressive get said.
enum First {
    /// Leased in the shared arena.
    Grant { offset: u64, len: u64, lease: u64, ttl: Duration, sent: Instant, arena: Arena },
    /// Streamed: `len` bytes of `Data` frames follow.
    Object { len: u64 },
}

impl First {
    fn len(&self) -> u64 {
        match self {
            First::Grant { len, .. } | First::Object { len } => *len,
        }
    }
}

impl Conn {
    /// Sends a one-key `Get` for a destination of `room` bytes and reads up to the object's
    /// length.
    /// With `follow`, the owner streams an unsealed progressive put of the key as it lands.
    fn start_progressive(&mut self, rid: u64, key: &[u8], room: u64, follow: bool) -> WResult<Result<First>> {
        let lease = self.arena().is_some() && !follow;
        let request = if follow {
            Request::GetFollow { key }
        } else {
            Request::Get { lease, items: vec![GetItem { key, check: LenCheck::AtMost(room) }] }
        };
        self.push(rid, &request);
        let sent = Instant::now();
        self.io.flush()?;
        if let (true, Some(arena)) = (lease, self.arena()) {
            let granted = self.read_reply(rid, Op::Grants, "grants", |conn, payload| {
                Ok(decode_grants(payload, conn.limits.max_items, arena.len())?)
            })?;
            let (ttl_ms, grants) = match granted {
                Ok(granted) => granted,
                Err(e) => return Ok(Err(e)),
            };
            let mut grants = grants.into_iter();
            let (Some(grant), None) = (grants.next(), grants.next()) else {
                return Err(ProtocolError::Invalid { what: "grant count" }.into());
            };
            let grant = match grant {
                Ok(g) => g,
                Err(e) => return Ok(Err(e)),
            };
            if let Err(e) = LenCheck::AtMost(room).check(grant.len) {
                self.send_release(rid, vec![grant.lease])?;
                return Ok(Err(e.into()));
            }
            let ttl = Duration::from_millis(u64::from(ttl_ms));
            return Ok(Ok(First::Grant { offset: grant.offset, len: grant.len, lease: grant.lease, ttl, sent, arena }));
        }
        let h = self.read_reply_header(rid)?;
        let payload = self.io.read_payload(h.payload_len)?;
        match h.op {
            Op::Object => {
                let (index, len) = decode_object(&payload)?;
                if index != 0 {
                    return Err(ProtocolError::Invalid { what: "object of a progressive get" }.into());
                }
                if len > room {
                    // Only a followed put is not checked by the owner: refuse it here, and drop
                    // the connection rather than read the stream.
                    return Err(WireError::Closed(format!("the object ({len} bytes) exceeds the destination")));
                }
                Ok(Ok(First::Object { len }))
            }
            Op::Error => {
                let (index, error) = decode_error_frame(&payload)?;
                if index != WHOLE_REQUEST {
                    // The key's own error: the stream still ends with `End`.
                    self.read_end(rid)?;
                }
                Ok(Err(error))
            }
            other => Err(ProtocolError::Unexpected { expected: "an object or an error", got: other }.into()),
        }
    }

    fn read_end(&mut self, rid: u64) -> WResult<()> {
        let h = self.read_reply_header(rid)?;
        if h.op != Op::End || h.payload_len != 0 {
            return Err(ProtocolError::Invalid { what: "end frame" }.into());
        }
        Ok(())
    }

    /// Copies a leased object out of the shared arena chunk by chunk, then releases the lease.
    /// A chunk whose copy ended too close to the lease's TTL fails with `LeaseExpired`.
    fn deliver_grant(
        &mut self,
        rid: u64,
        first: &First,
        dst: &Region<'static>,
        sink: &ChunkSink<Error>,
        gpu: Option<&ClientGpu>,
    ) -> WResult<()> {
        let First::Grant { offset, lease, ttl, sent, arena, .. } = first else {
            return Err(ProtocolError::Invalid { what: "a grant" }.into());
        };
        if let (Some(gpu), Some(mapping)) = (gpu, arena.mapping()) {
            gpu.pin(mapping.memory(), true);
        }
        for i in 0..sink.len() {
            if sink.cancelled() {
                break;
            }
            let range = sink.place(i).range.clone();
            let n = range.end - range.start;
            let copied = if n == 0 {
                Ok(())
            } else if let Some(gpu) = gpu {
                // Straight from the (registered, read-only) arena mapping to the GPU, or
                // through a bounce over UCX.
                match dst.slice(range.start, n) {
                    // SAFETY: the source lies in the arena leased to this connection until the
                    // release below; the device destination was checked by the transport and is
                    // lent writable while the handle runs.
                    Ok(piece) => unsafe { arena.to_device_now(gpu, offset + range.start, n, &[piece]) },
                    Err(e) => Err(e.into()),
                }
            } else {
                // SAFETY: the destination is caller memory lent writable for as long as the
                // handle runs (a `'static` region, checked by check_destination); the range lies
                // inside it (the object fits, checked against the grant); the source is leased to
                // this connection until the release below.
                unsafe { arena.copy_out(offset + range.start, n, (dst.addr() + range.start) as *mut u8) }
            };
            match copied {
                Ok(()) if sent.elapsed() + LEASE_MARGIN < *ttl => sink.done(i),
                Ok(()) => {
                    fail_from(sink, i, StoreError::LeaseExpired.into());
                    break;
                }
                Err(e) => {
                    fail_from(sink, i, e);
                    break;
                }
            }
        }
        self.send_release(rid, vec![*lease])
    }

    /// Reads an object's `Data` frames into `dst`, settling each chunk once its last byte
    /// arrived, then the stream's `End`. Each frame must arrive within `timeout` of the one
    /// before (a followed producer may take longer than that in all).
    fn deliver_stream(
        &mut self,
        rid: u64,
        len: u64,
        dst: &Region<'static>,
        sink: &ChunkSink<Error>,
        timeout: Duration,
    ) -> WResult<()> {
        let mut next = 0usize;
        let settle_up_to = |pos: u64, next: &mut usize| {
            while *next < sink.len() && sink.place(*next).range.end <= pos {
                sink.done(*next);
                *next += 1;
            }
        };
        settle_up_to(0, &mut next);
        let aborted = self.read_data_frames(
            rid,
            len,
            Pace::EachWithin(timeout),
            || still_wanted(sink),
            |io, pos, n| {
                // SAFETY: `[pos, pos + n)` lies inside the object, which fits the destination
                // (checked against `room`); the destination is caller memory lent writable while
                // the handle runs.
                unsafe { io.read_raw((dst.addr() + pos) as *mut u8, n as usize)? };
                settle_up_to(pos + n, &mut next);
                Ok(())
            },
        )?;
        if let Some(error) = aborted {
            fail_from(sink, next, error);
        }
        self.read_end(rid)
    }

    /// `deliver_stream` into GPU memory through a `BouncePair`: each frame is copied on to the
    /// GPU while the next one arrives, and a chunk settles once the copies covering it
    /// completed. A failed copy fails the chunks from there on and drops the connection.
    fn deliver_stream_to_gpu(
        &mut self,
        rid: u64,
        len: u64,
        dst: &Region<'static>,
        sink: &ChunkSink<Error>,
        timeout: Duration,
        gpu: &ClientGpu,
    ) -> WResult<()> {
        let mut pair =
            BouncePair::new(gpu, super::gpu::ordinal_of(std::slice::from_ref(dst)), self.hello.chunk_bytes as usize);
        let mut next = 0usize;
        // Settles the chunks up to `end` once the copy reaching it completed; false after a
        // failed copy (its chunk and the later ones failed).
        let mut settle = |done: Option<(Result<()>, u64)>| match done {
            None => true,
            Some((Ok(()), end)) => {
                while next < sink.len() && sink.place(next).range.end <= end {
                    sink.done(next);
                    next += 1;
                }
                true
            }
            Some((Err(e), _)) => {
                fail_from(sink, next, e);
                false
            }
        };
        settle(Some((Ok(()), 0)));
        let copy_failed = || WireError::Closed("a copy to the GPU failed".into());
        let pace = Pace::EachWithin(timeout);
        let aborted = self.read_data_frames(
            rid,
            len,
            pace,
            || still_wanted(sink),
            |io, pos, n| {
                let (buffer, room, done) = pair.next_buffer();
                if n as usize > room {
                    return Err(ProtocolError::Invalid { what: "data frame length" }.into());
                }
                if !settle(done) {
                    return Err(copy_failed());
                }
                // SAFETY: the buffer is the pair's, at least `n` bytes, and its last copy completed
                // in `next_buffer`.
                unsafe { io.read_raw(buffer, n as usize)? };
                let pieces = super::gpu::pieces_of(std::slice::from_ref(dst), pos, n);
                // SAFETY: the buffer holds the frame; the device destination was checked by the
                // transport and is lent writable while the handle runs.
                if let Err(e) = unsafe { pair.submit(n, pieces, pos + n) } {
                    settle(Some((Err(e), pos)));
                    return Err(copy_failed());
                }
                Ok(())
            },
        )?;
        // The chunks whose bytes arrived settle (before an abort's reason fails the rest).
        for done in pair.drain() {
            settle(Some(done));
        }
        if let Some(error) = aborted {
            fail_from(sink, next, error);
        }
        self.read_end(rid)
    }
}

/// Stops a delivery whose handle was dropped: the connection is dropped with the rest of the
/// stream.
fn still_wanted(sink: &ChunkSink<Error>) -> WResult<()> {
    if sink.cancelled() {
        return Err(WireError::Closed("the handle was dropped".into()));
    }
    Ok(())
}

/// One of `ClientOptions::max_stream_handles`, held by a handle's thread until it ends.
struct StreamSlot(Arc<std::sync::atomic::AtomicU64>);

impl StreamSlot {
    fn take(inner: &Inner) -> Result<StreamSlot> {
        let limit = inner.pool.options.max_stream_handles;
        if inner.streams_open.fetch_add(1, Ordering::AcqRel) >= limit as u64 {
            inner.streams_open.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Busy { limit }.into());
        }
        Ok(StreamSlot(Arc::clone(&inner.streams_open)))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Fails chunk `from` and every later chunk still pending.
fn fail_from(sink: &ChunkSink<Error>, from: usize, error: Error) {
    for i in from..sink.len() {
        sink.fail(i, error.clone());
    }
}

impl RemoteStore {
    /// `Engine::progressive_get` through the owner: `key` into the start of `dst` (host memory,
    /// at least the object's length), chunk `i` usable once it landed. Over a Unix socket with
    /// shared memory the chunks are copied out of the owner's arena under one lease; otherwise
    /// they complete as the owner's data frames arrive. Errors found before the first byte (bad
    /// key, missing object, too small a destination) are returned here.
    pub fn progressive_get(&self, key: &[u8], dst: Region<'static>, chunk_bytes: u64) -> Result<ChunkHandle<Error>> {
        self.progressive_read(key, dst, chunk_bytes, false)
    }

    /// `Engine::progressive_get_unsealed` through the owner: follows the owner's unsealed
    /// progressive put of `key` (chunks complete as the producer's bytes land on the owner and
    /// travel here in data frames; `ProducerAborted` if the producer goes away), or reads the
    /// key like `progressive_get` (streamed) when no put of it is open.
    pub fn progressive_get_unsealed(
        &self,
        key: &[u8],
        dst: Region<'static>,
        chunk_bytes: u64,
    ) -> Result<ChunkHandle<Error>> {
        self.progressive_read(key, dst, chunk_bytes, true)
    }

    fn progressive_read(
        &self,
        key: &[u8],
        dst: Region<'static>,
        chunk_bytes: u64,
        follow: bool,
    ) -> Result<ChunkHandle<Error>> {
        if chunk_bytes == 0 {
            return Err(StoreError::InvalidArgument("chunk_bytes must be at least 1".into()).into());
        }
        let device = super::gpu::names_device(std::slice::from_ref(&dst));
        if device {
            self.inner.check_destinations(std::slice::from_ref(&dst))?;
        } else {
            check_destination(&dst)?;
            dst.check_writable().map_err(StoreError::from)?;
        }
        let limits = self.inner.pool.limits()?;
        self.inner.validate_key(&limits, key)?;
        let slot = StreamSlot::take(&self.inner)?;
        let inner = &self.inner;
        let room = dst.len() as u64;
        let (conn, rid, first) =
            inner.pool.call_keeping("progressive_get", |conn, rid| conn.start_progressive(rid, key, room, follow))?;
        let len = first.len();
        if let Err(e) = check_chunk_count(chunk_count(len, chunk_bytes)) {
            // Too many chunks. A leased object is released; a stream is left unread, so its
            // connection is dropped.
            let mut conn = conn;
            if let First::Grant { lease, .. } = &first {
                if conn.send_release(rid, vec![*lease]).is_ok() {
                    inner.pool.checkin(conn);
                }
            }
            return Err(e.into());
        }
        let places: Vec<ChunkPlace> = cut_chunks(0, 0, len, chunk_bytes).collect();
        let (handle, sink) = chunk_pair(places);
        let inner = Arc::clone(&self.inner);
        let timeout = inner.pool.timeout();
        let spawned = std::thread::Builder::new().name("kvtide-remote-stream".into()).spawn(move || {
            let _slot = slot;
            let mut conn = conn;
            let gpu = device.then_some(&inner.gpu);
            let outcome = match (&first, gpu) {
                (First::Grant { .. }, _) => conn.deliver_grant(rid, &first, &dst, &sink, gpu),
                (First::Object { len }, None) => conn.deliver_stream(rid, *len, &dst, &sink, timeout),
                (First::Object { len }, Some(gpu)) => conn.deliver_stream_to_gpu(rid, *len, &dst, &sink, timeout, gpu),
            };
            match outcome {
                Ok(()) => inner.pool.checkin(conn),
                // The connection is dropped; the chunks not delivered fail with the reason.
                Err(e) => fail_from(&sink, 0, e.into_error("progressive_get", inner.pool.options.timeout_ms)),
            }
        });
        if let Err(e) = spawned {
            return Err(StoreError::Io(format!("could not start a stream thread: {e}")).into());
        }
        Ok(handle)
    }

    /// `Engine::streaming_batch_get_buffer_ranges` through the owner: the fragments (buffer-major)
    /// in the caller's order, cut into chunks of at most `chunk_bytes`, fetched a few chunks per
    /// range request; each chunk settles with its own result, so a bad fragment fails only its
    /// own chunks.
    pub fn streaming_batch_get_buffer_ranges(
        &self,
        buffers: &[Region<'static>],
        fragments: &[Vec<Fragment>],
        chunk_bytes: u64,
    ) -> Result<ChunkHandle<Error>> {
        if chunk_bytes == 0 {
            return Err(StoreError::InvalidArgument("chunk_bytes must be at least 1".into()).into());
        }
        kvtide::checks::one_list_per_key(buffers.len(), fragments.len(), "fragment list")?;
        // A fragment past its buffer is one chunk (that reports the error); the count is bounded
        // before anything is allocated per chunk.
        let cut_len =
            |region: &Region<'_>, f: &Fragment| if region.check_range(f.dst_offset, f.len).is_ok() { f.len } else { 0 };
        let chunks: u64 = buffers
            .iter()
            .zip(fragments)
            .flat_map(|(region, frags)| frags.iter().map(move |f| chunk_count(cut_len(region, f), chunk_bytes)))
            .sum();
        check_chunk_count(chunks)?;
        let slot = StreamSlot::take(&self.inner)?;
        let mut places = Vec::with_capacity(chunks as usize);
        let mut parts: Vec<Fragment> = Vec::with_capacity(chunks as usize);
        for (b, (region, frags)) in buffers.iter().zip(fragments).enumerate() {
            for f in frags {
                let len = cut_len(region, f);
                for place in cut_chunks(b, f.dst_offset, len, chunk_bytes) {
                    let within = place.range.start - f.dst_offset;
                    let n = if len == 0 { f.len } else { place.range.end - place.range.start };
                    parts.push(Fragment::new(f.key.clone(), f.src_offset.saturating_add(within), place.range.start, n));
                    places.push(place);
                }
            }
        }
        let (handle, sink) = chunk_pair(places);
        let store = RemoteStore { inner: Arc::clone(&self.inner) };
        let buffers = buffers.to_vec();
        let spawned = std::thread::Builder::new().name("kvtide-remote-stream".into()).spawn(move || {
            let _slot = slot;
            let indices: Vec<usize> = (0..parts.len()).collect();
            for group in indices.chunks(STREAM_GROUP_CHUNKS) {
                if sink.cancelled() {
                    break;
                }
                let mut lists: Vec<Vec<Fragment>> = vec![Vec::new(); buffers.len()];
                let mut order: Vec<(usize, usize)> = Vec::with_capacity(group.len());
                for &c in group {
                    let b = sink.place(c).buffer;
                    order.push((b, lists[b].len()));
                    lists[b].push(parts[c].clone());
                }
                let results = store.get_into_ranges(&buffers, &lists);
                for (&c, (b, k)) in group.iter().zip(order) {
                    match results.get(b).and_then(|r| r.get(k)) {
                        Some(Ok(_)) => sink.done(c),
                        Some(Err(e)) => sink.fail(c, e.clone()),
                        None => sink.fail(c, StoreError::Internal("a range result was missing").into()),
                    }
                }
            }
        });
        if let Err(e) = spawned {
            return Err(StoreError::Io(format!("could not start a stream thread: {e}")).into());
        }
        Ok(handle)
    }
}

/// A progressive put through the owner (`RemoteStore::progressive_put`): chunks written in any
/// order (`put_chunk` takes `&self`; calls are serialized on the put's connection), then `seal`.
/// The owner holds the put on this connection: dropping the stream unsealed, or losing the
/// connection, aborts it, and readers that follow it on the owner fail with `ProducerAborted`.
pub struct RemotePutStream {
    inner: Arc<Inner>,
    conn: Mutex<Option<Conn>>,
    stream: u64,
    places: Vec<ChunkPlace>,
    total_bytes: u64,
    finished: bool,
}

impl std::fmt::Debug for RemotePutStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemotePutStream").field("len", &self.total_bytes).field("chunks", &self.places.len()).finish()
    }
}

impl RemotePutStream {
    /// Number of chunks.
    pub fn num_chunks(&self) -> usize {
        self.places.len()
    }

    /// Byte range of chunk `i` in the object.
    pub fn chunk_range(&self, i: usize) -> Option<std::ops::Range<u64>> {
        self.places.get(i).map(|p| p.range.clone())
    }

    /// The object's length.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Runs one request on the put's connection; a connection that failed is dropped (the owner
    /// then aborts the put) and later calls get `Disconnected`.
    fn on_conn<T>(&self, op: &'static str, f: impl FnOnce(&mut Conn, u64) -> WResult<Result<T>>) -> Result<T> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(conn) = slot.as_mut() else {
            return Err(Error::Disconnected("the progressive put's connection failed earlier".into()));
        };
        let rid = self.inner.pool.next_request.fetch_add(1, Ordering::Relaxed);
        match f(conn, rid) {
            Ok(result) => result,
            Err(e) => {
                *slot = None;
                Err(e.into_error(op, self.inner.pool.options.timeout_ms))
            }
        }
    }

    /// Writes chunk `i` from `src` (host memory, exactly the chunk's length).
    pub fn put_chunk(&self, i: usize, src: Region<'_>) -> Result<()> {
        let range = self.chunk_range(i).ok_or_else(|| {
            Error::from(StoreError::InvalidArgument(format!(
                "chunk {i} does not exist (the put has {} chunks)",
                self.places.len()
            )))
        })?;
        let len = range.end - range.start;
        if src.len() as u64 != len {
            return Err(StoreError::SizeMismatch { object_bytes: len, destination_bytes: src.len() as u64 }.into());
        }
        check_source(&src)?;
        let stream = self.stream;
        self.on_conn("put_chunk", |conn, rid| {
            let start = conn.io.begin(Op::PutChunk, rid);
            PutChunkHead { stream, index: i as u32, len }.encode(conn.io.out());
            conn.io.end(start);
            conn.io.flush()?;
            let frame = u64::from(conn.hello.chunk_bytes);
            let mut pos = 0;
            while pos < len {
                let n = frame.min(len - pos);
                conn.io.send_data(Op::Data, rid, &source_slices(std::slice::from_ref(&src), pos, n))?;
                pos += n;
            }
            conn.read_status(rid)
        })
    }

    /// Publishes the object once every chunk was written (otherwise an error names the missing
    /// ones and the put stays open).
    pub fn seal(&mut self) -> Result<()> {
        let stream = self.stream;
        let result = self.on_conn("seal", |conn, rid| conn.request_status(rid, &Request::PutSeal { stream }));
        if !matches!(result, Err(Error::Store(StoreError::InvalidArgument(_)))) {
            self.finish();
        }
        result
    }

    /// Gives up: readers that follow it on the owner fail with `ProducerAborted`.
    pub fn abort(mut self) {
        self.abort_now();
    }

    fn abort_now(&mut self) {
        if self.finished {
            return;
        }
        let stream = self.stream;
        // Best effort: a connection that fails here is dropped, which aborts the put too.
        let _ = self.on_conn("abort", |conn, rid| conn.request_status(rid, &Request::PutAbort { stream }));
        self.finish();
    }

    /// The put is over: its connection goes back to the pool.
    fn finish(&mut self) {
        self.finished = true;
        if let Some(conn) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.inner.pool.checkin(conn);
        }
    }
}

impl Drop for RemotePutStream {
    fn drop(&mut self) {
        self.abort_now();
    }
}

impl RemoteStore {
    /// `Engine::progressive_put` through the owner: the owner reserves `total_bytes` under `key`
    /// now and holds the put on a connection of its own; chunks travel as they are written and
    /// land straight in the reservation. Readers on the owner's engine can follow it
    /// (`Engine::progressive_get_unsealed`).
    pub fn progressive_put(
        &self,
        key: &[u8],
        total_bytes: u64,
        chunk_bytes: u64,
        opts: kvtide::PutOptions,
    ) -> Result<RemotePutStream> {
        if chunk_bytes == 0 {
            return Err(StoreError::InvalidArgument("chunk_bytes must be at least 1".into()).into());
        }
        check_chunk_count(chunk_count(total_bytes, chunk_bytes))?;
        let limits = self.inner.pool.limits()?;
        self.inner.validate_key(&limits, key)?;
        if total_bytes > limits.max_value_bytes {
            return Err(StoreError::TooLarge { what: "value", len: total_bytes, max: limits.max_value_bytes }.into());
        }
        let mut conn = match self.inner.pool.checkout() {
            Some(c) => c,
            None => self.inner.pool.open()?,
        };
        let rid = self.inner.pool.next_request.fetch_add(1, Ordering::Relaxed);
        let open = Request::PutOpen { key, total_len: total_bytes, chunk_bytes, upsert: opts.upsert, pin: opts.pin };
        let opened = conn.request_status(rid, &open);
        match opened {
            Ok(Ok(())) => Ok(RemotePutStream {
                inner: Arc::clone(&self.inner),
                conn: Mutex::new(Some(conn)),
                stream: rid,
                places: cut_chunks(0, 0, total_bytes, chunk_bytes).collect(),
                total_bytes,
                finished: false,
            }),
            Ok(Err(e)) => {
                self.inner.pool.checkin(conn);
                Err(e)
            }
            Err(e) => Err(e.into_error("progressive_put", self.inner.pool.options.timeout_ms)),
        }
    }
}
