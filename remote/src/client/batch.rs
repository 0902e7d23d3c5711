//! Batched puts and removes through the owner: one request and one reply per group of keys,
//! never one per key.
//!
//! Owns the grouping of a batch into requests (by item count, request payload and put-window
//! room) and where each value comes from: the caller's own memory, which a same-user owner reads
//! itself (asked for once per Unix connection: one copy, no bytes on the socket); else the put
//! window (asked for once per Unix connection, used as a ring: the client fills one range while
//! the owner copies another out); else `Data` frames. Also the matching of `Statuses` replies
//! back to the caller's keys. It never writes a window range the owner has not answered for,
//! never returns while the owner may still read the caller's memory (a connection that fails
//! with such a request unanswered is shut first), and never lets a connection that failed midway
//! go back to the pool.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use kvtide::{Error as StoreError, PutOptions};
use kvtide_transport::{Direction, InFlight, Region, Transfer};

use super::conn::{source_slices, Conn, DirectState, WindowState};
use super::gpu;
use super::Inner;
use crate::error::Result;
use crate::protocol::{
    decode_statuses, decode_window, ClientSegments, Limits, Op, ProtocolError, PutItem, Request, ValueSource,
    MAX_CLIENT_SEGMENTS, MIN_CHUNK_BYTES, PROBE_BYTES,
};
use crate::shm::PutWindow;
use crate::wire::{WResult, WireError};

/// Largest put window a client maps.
const MAX_WINDOW_BYTES: u64 = 1 << 34;
/// A group of windowed values aims at this share of the window, so the owner copies one group
/// out while the client fills the next, and the call's tail (the last group, which nothing
/// overlaps) stays short.
const GROUPS_PER_WINDOW: u64 = 8;
/// Values up to this share of the window go through it; larger ones are streamed.
const LARGEST_WINDOWED_SHARE: u64 = 2;
/// Requests of one streamed or client-memory batch in flight on a connection.
const STREAMED_IN_FLIGHT: usize = 2;
/// Request payload bytes per put item besides its key (key length, value length, offset).
const PUT_ITEM_OVERHEAD: usize = 2 + 8 + 8;
/// Request payload bytes per segment of a value read from the client's memory.
const SEGMENT_OVERHEAD: usize = 16;
/// Request payload bytes of a put batch besides its items.
const PUT_BATCH_OVERHEAD: usize = 6;

/// One value to put: its key, its sources (host memory, checked) and their total length.
pub(super) struct PutSource<'a, 'r> {
    pub key: &'a [u8],
    pub sources: &'a [Region<'r>],
    pub len: u64,
}

/// A request of a batch: items `[start, end)` of the caller's list, whose values come from
/// `source`; windowed values take `bytes` of the window.
struct Group {
    start: usize,
    end: usize,
    source: ValueSource,
    bytes: u64,
}

/// What a connection can take values from besides `Data` frames.
#[derive(Clone, Copy, Default)]
struct Sources {
    /// The owner reads host values from this process's memory.
    client: bool,
    /// The put window's size.
    window: Option<u64>,
}

/// Where item `item`'s value comes from: the client's memory for host values of few enough
/// regions where the owner reads it; else the window for values up to half of it; else frames.
fn source_of(item: &PutSource<'_, '_>, sources: Sources) -> ValueSource {
    if sources.client && item.sources.len() <= MAX_CLIENT_SEGMENTS && !gpu::names_device(item.sources) {
        ValueSource::Client
    } else if sources.window.is_some_and(|w| item.len <= w / LARGEST_WINDOWED_SHARE) {
        ValueSource::Window
    } else {
        ValueSource::Stream
    }
}

/// Splits `items` (in order) into groups that fit one request each: runs of one source, at
/// most `max_items` and the owner's payload limit each; windowed runs take about an eighth of
/// the window.
fn plan_groups(items: &[PutSource<'_, '_>], limits: &Limits, max_items: usize, sources: Sources) -> Vec<Group> {
    let target = sources.window.map_or(0, |w| w / GROUPS_PER_WINDOW);
    let mut groups = Vec::new();
    let mut start = 0;
    while start < items.len() {
        let source = source_of(&items[start], sources);
        let mut end = start;
        let mut payload = PUT_BATCH_OVERHEAD;
        let mut bytes = 0u64;
        while end < items.len() && end - start < max_items && source_of(&items[end], sources) == source {
            let segments = if source == ValueSource::Client { items[end].sources.len() * SEGMENT_OVERHEAD } else { 0 };
            let item_payload = items[end].key.len() + PUT_ITEM_OVERHEAD + segments;
            let fits_payload = payload + item_payload <= limits.max_payload_bytes as usize;
            let fits_window = source != ValueSource::Window || bytes + items[end].len <= target;
            if end > start && !(fits_payload && fits_window) {
                break;
            }
            payload += item_payload;
            bytes += items[end].len;
            end += 1;
        }
        let bytes = if source == ValueSource::Window { bytes } else { 0 };
        groups.push(Group { start, end, source, bytes });
        start = end;
    }
    groups
}

/// Where a windowed group's values go: the next `bytes` of the window taken as a ring, where
/// `busy` holds the ranges of the requests not answered yet (oldest first). None while the range
/// would overlap one of them.
fn ring_offset(window: u64, head: u64, bytes: u64, busy: &VecDeque<(u64, u64)>) -> Option<u64> {
    let at = if head + bytes <= window { head } else { 0 };
    let free = busy.iter().all(|&(start, len)| len == 0 || bytes == 0 || at + bytes <= start || start + len <= at);
    free.then_some(at)
}

impl Conn {
    /// Asks for this connection's put window once (Unix socket with shared memory only); a
    /// refusal or a failed mapping leaves the connection putting over the socket.
    fn ensure_window(&mut self, rid: u64) -> WResult<()> {
        if !matches!(self.window, WindowState::Untried) {
            return Ok(());
        }
        self.window = WindowState::Unavailable;
        let decode = |p: &[u8]| Ok(decode_window(p, 2 * u64::from(MIN_CHUNK_BYTES), MAX_WINDOW_BYTES)?);
        match self.request_descriptor(rid, Op::PutWindow, Op::Window, "a put window", decode)? {
            Ok((bytes, fd)) => match PutWindow::map_writable(fd, bytes) {
                Ok(w) => self.window = WindowState::Mapped(w),
                Err(e) => tracing::warn!(error = %e, "cannot map the put window; putting over the socket"),
            },
            Err(e) => tracing::debug!(error = %e, "no put window; putting over the socket"),
        }
        Ok(())
    }

    /// Asks once per connection (Unix socket, option on) that the owner read put values from
    /// this process's memory: the owner must find a fresh random nonce at the probe's address.
    /// A refusal (another user or group, a Yama ptrace scope, a kernel without `SO_PEERPIDFD`,
    /// an owner with direct puts off) leaves the connection putting through its window.
    fn ensure_direct(&mut self, rid: u64) -> WResult<()> {
        if !matches!(self.direct, DirectState::Untried) {
            return Ok(());
        }
        self.direct = DirectState::Unavailable;
        let mut nonce = Box::new([0u8; PROBE_BYTES]);
        if let Err(e) = crate::sock::random_bytes(&mut nonce[..]) {
            tracing::debug!(error = %e, "no nonce for the direct put probe; putting through the window");
            return Ok(());
        }
        let probe = nonce.as_ptr() as u64;
        // The owner reads the nonce while this call waits for its answer: the box lives until then.
        match self.request_status(rid, &Request::PutDirect { probe, nonce: *nonce })? {
            Ok(()) => self.direct = DirectState::Granted(std::process::id() as libc::pid_t),
            Err(e) => tracing::debug!(error = %e, "no direct puts; putting through the window"),
        }
        drop(nonce);
        Ok(())
    }

    /// Puts `items` in as few requests as fit, several in flight, and reads one `Statuses`
    /// reply per request. Results in item order.
    pub(super) fn put_batch(
        &mut self,
        inner: &Inner,
        items: &[PutSource<'_, '_>],
        opts: PutOptions,
    ) -> WResult<Result<Vec<Result<()>>>> {
        if self.io.stream().is_unix() && inner.pool.options.direct_puts {
            self.ensure_direct(inner.pool.next_request.fetch_add(1, Ordering::Relaxed))?;
        }
        let client = matches!(self.direct, DirectState::Granted(pid) if pid == std::process::id() as libc::pid_t);
        let needs_window = !client || items.iter().any(|i| gpu::names_device(i.sources));
        if needs_window && self.io.stream().is_unix() && self.shm.is_some() {
            self.ensure_window(inner.pool.next_request.fetch_add(1, Ordering::Relaxed))?;
        }
        let window = match &self.window {
            WindowState::Mapped(w) => Some(w.len()),
            _ => None,
        };
        // GPU values that do not go through the window are streamed through two bounce buffers
        // of one frame each (`send_device_value`), never staged whole.
        let groups = plan_groups(items, &self.limits, inner.pool.max_batch(&self.limits), Sources { client, window });
        let mut results: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        let mut answered = 0usize;
        let outcome = self.put_groups(inner, items, opts, &groups, &mut results, &mut answered);
        if outcome.is_err() && groups.iter().any(|g| g.source == ValueSource::Client) {
            // The owner reads the caller's memory only before it sees the connection shut:
            // once this returns, it reads nothing of buffers the caller may reuse.
            self.broken = true;
            self.io.stream().shutdown();
        }
        match outcome {
            Ok(()) => {}
            // Nothing took effect that the caller was told of: the call may retry it.
            Err(e) if answered == 0 => return Err(e),
            // Earlier groups took effect: report them, fail the rest, and retire the connection.
            Err(e) => {
                self.broken = true;
                let why = e.into_error("put", inner.pool.options.timeout_ms);
                results.iter_mut().filter(|r| r.is_none()).for_each(|r| *r = Some(Err(why.clone())));
            }
        }
        let direct: u64 = groups
            .iter()
            .filter(|g| g.source == ValueSource::Client)
            .flat_map(|g| g.start..g.end)
            .filter(|&i| matches!(results[i], Some(Ok(()))))
            .map(|i| items[i].len)
            .sum();
        inner.direct_put_bytes.fetch_add(direct, Ordering::Relaxed);
        Ok(Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Err(StoreError::Internal("put never answered").into())))
            .collect()))
    }

    fn put_groups(
        &mut self,
        inner: &Inner,
        items: &[PutSource<'_, '_>],
        opts: PutOptions,
        groups: &[Group],
        results: &mut [Option<Result<()>>],
        answered: &mut usize,
    ) -> WResult<()> {
        let window = match &self.window {
            WindowState::Mapped(w) => w.len(),
            _ => 0,
        };
        // Requests not answered yet: (request id, the items it carries, window range).
        let mut in_flight: VecDeque<(u64, Vec<usize>, (u64, u64))> = VecDeque::new();
        let mut head = 0u64;
        for group in groups {
            // Window bytes are written only once the owner answered the request that used them.
            let offset = loop {
                let busy: VecDeque<(u64, u64)> = in_flight.iter().map(|f| f.2).collect();
                let windowed = group.source == ValueSource::Window;
                let streamed_room = in_flight.len() < STREAMED_IN_FLIGHT;
                let offset = if windowed { ring_offset(window, head, group.bytes, &busy) } else { None };
                if (windowed && offset.is_some()) || (!windowed && streamed_room) {
                    break offset.unwrap_or(0);
                }
                let Some((rid, members, _)) = in_flight.pop_front() else {
                    return Err(ProtocolError::Invalid { what: "put group larger than the window" }.into());
                };
                self.settle(rid, &members, results)?;
                *answered += 1;
            };
            let rid = inner.pool.next_request.fetch_add(1, Ordering::Relaxed);
            let members = self.send_group(inner, rid, items, group, opts, offset, results)?;
            let windowed = group.source == ValueSource::Window;
            let range = if windowed { (offset, group.bytes) } else { (0, 0) };
            if windowed {
                head = offset + group.bytes;
            }
            if !members.is_empty() {
                in_flight.push_back((rid, members, range));
            }
        }
        while let Some((rid, members, _)) = in_flight.pop_front() {
            self.settle(rid, &members, results)?;
            *answered += 1;
        }
        Ok(())
    }

    /// Sends one group: its values named by their place in this process's memory, put into the
    /// window at `base`, or as `Data` frames after the request. Returns the items the request
    /// carries (a GPU value whose copy into the window failed is left out, with its error in
    /// `results`).
    #[allow(clippy::too_many_arguments)]
    fn send_group(
        &mut self,
        inner: &Inner,
        rid: u64,
        items: &[PutSource<'_, '_>],
        group: &Group,
        opts: PutOptions,
        base: u64,
        results: &mut [Option<Result<()>>],
    ) -> WResult<Vec<usize>> {
        let mut members: Vec<usize> = (group.start..group.end).collect();
        if group.source == ValueSource::Client {
            self.send_client_group(rid, items, &members, opts)?;
            return Ok(members);
        }
        let mut put_items = Vec::with_capacity(members.len());
        let window = match &self.window {
            WindowState::Mapped(w) if group.source == ValueSource::Window => Some(w),
            _ => None,
        };
        if let Some(w) = window {
            let mut offsets = Vec::with_capacity(members.len());
            let mut device = Vec::new();
            let mut offset = base;
            for &i in &members {
                let item = &items[i];
                offsets.push(offset);
                if gpu::names_device(item.sources) {
                    let host =
                        w.addr_of(offset, item.len).map_err(|_| ProtocolError::Invalid { what: "put window" })?;
                    device.push((i, Transfer::in_order(host, item.len, item.sources)));
                } else {
                    let mut pos = offset;
                    for src in item.sources {
                        // SAFETY: host sources are valid for reads for the call (Region's
                        // contract, checked by check_sources); no unanswered request uses this range.
                        unsafe { w.write(pos, src.addr() as *const u8, src.len() as u64) }
                            .map_err(|_| ProtocolError::Invalid { what: "value outside the put window" })?;
                        pos += src.len() as u64;
                    }
                }
                offset += item.len;
            }
            if !device.is_empty() {
                inner.gpu.pin(w.memory(), false);
                let transfers: Vec<Transfer> = device.iter().map(|(_, t)| t.clone()).collect();
                // SAFETY: no unanswered request uses these window ranges; the device sources
                // were checked by check_sources.
                let copied = unsafe { inner.gpu.copy(Direction::DeviceToHost, &transfers) };
                for ((i, _), outcome) in device.iter().zip(copied) {
                    if let Err(e) = outcome {
                        results[*i] = Some(Err(e));
                    }
                }
            }
            let mut kept = Vec::with_capacity(members.len());
            for (&i, offset) in members.iter().zip(offsets) {
                if results[i].is_none() {
                    put_items.push(PutItem {
                        key: items[i].key,
                        len: items[i].len,
                        window_offset: offset,
                        segments: ClientSegments::default(),
                    });
                    kept.push(i);
                }
            }
            members = kept;
            if members.is_empty() {
                return Ok(members);
            }
        } else {
            put_items.extend(members.iter().map(|&i| PutItem {
                key: items[i].key,
                len: items[i].len,
                window_offset: 0,
                segments: ClientSegments::default(),
            }));
        }
        let source = if window.is_some() { ValueSource::Window } else { ValueSource::Stream };
        let start = self.io.begin(Op::PutBatch, rid);
        Request::PutBatch { upsert: opts.upsert, pin: opts.pin, source, items: put_items }.encode(self.io.out());
        self.io.end(start);
        if window.is_none() {
            // The request goes out with the first value frame; small values are gathered into
            // the write buffer, flushed below.
            let chunk = u64::from(self.hello.chunk_bytes);
            for &i in &members {
                let item = &items[i];
                if gpu::names_device(item.sources) {
                    self.send_device_value(inner, rid, item, chunk)?;
                    continue;
                }
                let mut pos = 0;
                while pos < item.len {
                    let n = chunk.min(item.len - pos);
                    self.io.push_data(Op::Data, rid, &source_slices(item.sources, pos, n))?;
                    pos += n;
                }
            }
        }
        self.io.flush()?;
        Ok(members)
    }

    /// Sends a group whose values the owner reads from this process's memory: each item names
    /// its host regions (checked by check_sources, valid until this call returns).
    fn send_client_group(
        &mut self,
        rid: u64,
        items: &[PutSource<'_, '_>],
        members: &[usize],
        opts: PutOptions,
    ) -> WResult<()> {
        let mut wire = Vec::with_capacity(members.iter().map(|&i| items[i].sources.len() * SEGMENT_OVERHEAD).sum());
        let mut ends = Vec::with_capacity(members.len());
        for &i in members {
            ClientSegments::encode(items[i].sources.iter().map(|r| (r.addr(), r.len() as u64)), &mut wire);
            ends.push(wire.len());
        }
        let mut put_items = Vec::with_capacity(members.len());
        let mut from = 0;
        for (&i, &to) in members.iter().zip(&ends) {
            let segments =
                ClientSegments::from_wire(&wire[from..to]).ok_or(ProtocolError::Invalid { what: "client segments" })?;
            put_items.push(PutItem { key: items[i].key, len: items[i].len, window_offset: 0, segments });
            from = to;
        }
        self.send(
            rid,
            &Request::PutBatch { upsert: opts.upsert, pin: opts.pin, source: ValueSource::Client, items: put_items },
        )
    }

    /// Sends a value from GPU memory as `Data` frames of `chunk` bytes: each frame is copied
    /// into one of two bounce buffers (pinned where CUDA can pin them) while the other one goes
    /// out. A copy that fails midway leaves a value the owner cannot complete: the connection is
    /// retired (the owner then publishes nothing of the request).
    fn send_device_value(&mut self, inner: &Inner, rid: u64, item: &PutSource<'_, '_>, chunk: u64) -> WResult<()> {
        let ordinal = gpu::ordinal_of(item.sources);
        let gpu = &inner.gpu;
        let bounces = [gpu.take_bounce(ordinal, chunk as usize), gpu.take_bounce(ordinal, chunk as usize)];
        let outcome = (|| {
            // Declared after the buffers, so dropped (waiting for the copies) before them.
            let mut copies: [Option<InFlight>; 2] = [None, None];
            let submit = |k: usize, pos: u64, copies: &mut [Option<InFlight>; 2]| -> WResult<()> {
                let n = chunk.min(item.len - pos);
                let transfer = Transfer {
                    host: bounces[k].ptr() as u64,
                    host_len: n,
                    pieces: gpu::pieces_of(item.sources, pos, n),
                };
                // SAFETY: the bounce buffer is ours and untouched until this copy completed
                // (waited for before the frame goes out); the device sources were checked by
                // check_sources.
                let copy = unsafe { gpu.submit(Direction::DeviceToHost, &[transfer]) }
                    .map_err(|e| WireError::Closed(format!("a copy from GPU memory failed: {e}")))?;
                copies[k] = Some(copy);
                Ok(())
            };
            let mut pos = 0u64;
            let mut frame = 0usize;
            if item.len > 0 {
                submit(0, 0, &mut copies)?;
            }
            while pos < item.len {
                let k = frame % 2;
                let n = chunk.min(item.len - pos);
                let copy = copies[k].take().ok_or(ProtocolError::Invalid { what: "a frame never copied" })?;
                if let Some(Err(e)) = copy.wait().into_iter().find(|r| r.is_err()) {
                    return Err(WireError::Closed(format!("a copy from GPU memory failed: {e}")));
                }
                if pos + n < item.len {
                    submit(1 - k, pos + n, &mut copies)?;
                }
                // SAFETY: the bounce buffer holds the frame's `n` bytes (its copy completed
                // above) and nothing writes it until the frame went out.
                let bytes = unsafe { std::slice::from_raw_parts(bounces[k].ptr(), n as usize) };
                self.io.send_data(Op::Data, rid, &[std::io::IoSlice::new(bytes)])?;
                pos += n;
                frame += 1;
            }
            Ok(())
        })();
        if outcome.is_err() {
            self.broken = true;
        }
        for bounce in bounces {
            gpu.give_bounce(bounce);
        }
        outcome
    }

    /// Reads the `Statuses` reply of a request that carried `members` into `results`.
    fn settle(&mut self, rid: u64, members: &[usize], results: &mut [Option<Result<()>>]) -> WResult<()> {
        let statuses = match self.read_statuses(rid, members.len())? {
            Ok(statuses) => statuses,
            Err(e) => vec![Err(e); members.len()],
        };
        for (&i, status) in members.iter().zip(statuses) {
            results[i] = Some(status);
        }
        Ok(())
    }

    /// One `RemoveBatch` request and its `Statuses` reply.
    pub(super) fn remove_batch(&mut self, rid: u64, keys: &[&[u8]], force: bool) -> WResult<Result<Vec<Result<()>>>> {
        self.send(rid, &Request::RemoveBatch { keys: keys.to_vec(), force })?;
        self.read_statuses(rid, keys.len())
    }

    /// Reads the `Statuses` reply of a request that carried `count` items (or the owner's
    /// refusal of the whole request).
    fn read_statuses(&mut self, rid: u64, count: usize) -> WResult<Result<Vec<Result<()>>>> {
        self.read_reply(rid, Op::Statuses, "statuses", |conn, payload| {
            let statuses = decode_statuses(payload, conn.limits.max_items)?;
            if statuses.len() != count {
                return Err(ProtocolError::Invalid { what: "status count" }.into());
            }
            Ok(statuses)
        })
    }
}

/// Request payload bytes of a remove batch besides its keys.
pub(super) const REMOVE_ITEM_OVERHEAD: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(lens: &[u64]) -> Vec<PutSource<'static, 'static>> {
        lens.iter().map(|&len| PutSource { key: b"key", sources: &[], len }).collect()
    }

    #[test]
    fn groups_fit_an_eighth_of_the_window_and_large_values_stream() {
        let limits = Limits::default();
        let items = sources(&[400, 400, 400, 5000, 3000, 100, 0]);
        let window = Sources { client: false, window: Some(8000) };
        let groups = plan_groups(&items, &limits, 64, window);
        let shape: Vec<(usize, usize, ValueSource, u64)> =
            groups.iter().map(|g| (g.start, g.end, g.source, g.bytes)).collect();
        // Two 400s fill a 1000-byte eighth; 5000 passes half the window and streams; 3000 is a
        // group of its own.
        use ValueSource::{Stream, Window};
        assert_eq!(
            shape,
            vec![
                (0, 2, Window, 800),
                (2, 3, Window, 400),
                (3, 4, Stream, 0),
                (4, 5, Window, 3000),
                (5, 7, Window, 100)
            ]
        );
        assert!(plan_groups(&items, &limits, 64, Sources::default()).iter().all(|g| g.source == Stream));
    }

    #[test]
    fn the_ring_never_hands_out_a_range_still_in_flight() {
        let mut busy = VecDeque::new();
        assert_eq!(ring_offset(100, 0, 40, &busy), Some(0));
        busy.push_back((0, 40));
        assert_eq!(ring_offset(100, 40, 40, &busy), Some(40));
        busy.push_back((40, 40));
        // 80 + 40 passes the end: wraps to 0, which is busy.
        assert_eq!(ring_offset(100, 80, 40, &busy), None);
        busy.pop_front();
        assert_eq!(ring_offset(100, 80, 40, &busy), Some(0));
        assert_eq!(ring_offset(100, 80, 20, &busy), Some(80), "fits before the end");
        assert_eq!(ring_offset(100, 40, 0, &busy), Some(40), "an empty group takes nothing");
    }

    #[test]
    fn groups_respect_item_and_payload_limits() {
        let limits = Limits { max_payload_bytes: 100, ..Limits::default() };
        let items = sources(&[1; 10]);
        // 6 + 4 * (3 + 18) = 90 bytes; a fifth item would pass 100.
        let groups = plan_groups(&items, &limits, 64, Sources::default());
        assert!(groups.iter().all(|g| g.end - g.start == 4 || g.end == 10));
        assert!(groups.iter().all(|g| g.source == ValueSource::Stream));
        assert_eq!(groups.iter().map(|g| g.end - g.start).sum::<usize>(), 10);
        let groups = plan_groups(&items, &Limits::default(), 4, Sources::default());
        assert_eq!(groups.len(), 3);
    }

    #[test]
    fn host_values_come_from_client_memory_in_one_request_whatever_their_size() {
        let limits = Limits::default();
        let mut buf = vec![0u8; 64];
        let one = [Region::host(&mut buf)];
        let items: Vec<PutSource<'_, '_>> =
            [1u64 << 30, 1 << 20, 5].iter().map(|&len| PutSource { key: b"key", sources: &one, len }).collect();
        let sources = Sources { client: true, window: Some(8000) };
        let groups = plan_groups(&items, &limits, 64, sources);
        assert_eq!(groups.len(), 1, "no window room bounds a group read from the client");
        assert_eq!((groups[0].start, groups[0].end, groups[0].source, groups[0].bytes), (0, 3, ValueSource::Client, 0));
        // Each segment costs request payload: a payload limit still splits the group.
        let tight =
            Limits { max_payload_bytes: (PUT_BATCH_OVERHEAD + 2 * (3 + PUT_ITEM_OVERHEAD + 16)) as u32, ..limits };
        assert_eq!(plan_groups(&items, &tight, 64, sources).len(), 2);
        // Too many regions for one value: that value goes through the window.
        let many: Vec<Region<'_>> = (0..=MAX_CLIENT_SEGMENTS).map(|_| Region::host_readonly(&[])).collect();
        let item = PutSource { key: b"k", sources: &many, len: 0 };
        assert_eq!(source_of(&item, sources), ValueSource::Window);
    }
}
