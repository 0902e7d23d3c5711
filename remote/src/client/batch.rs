//! Batched puts and removes through the owner: one request and one reply per group of keys,
//! never one per key.
//!
//! Owns the grouping of a batch into requests (by item count, request payload and put-window
//! room), the put window on a Unix connection (asked for once per connection, used as two halves:
//! the client fills one while the owner copies the other out), the `Data` frames of streamed
//! values elsewhere, and the matching of `Statuses` replies back to the caller's keys. It never
//! writes a window half the owner has not answered for, and never lets a connection that failed
//! midway go back to the pool.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use kvtide::{Error as StoreError, PutOptions};
use kvtide_transport::{Direction, InFlight, Region, Transfer};

use super::conn::{source_slices, Conn, WindowState};
use super::gpu;
use super::Inner;
use crate::error::Result;
use crate::protocol::{decode_statuses, decode_window, Limits, Op, ProtocolError, PutItem, Request, MIN_CHUNK_BYTES};
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
/// Requests of one streamed batch in flight on a connection.
const STREAMED_IN_FLIGHT: usize = 2;
/// Request payload bytes per put item besides its key (key length, value length, offset).
const PUT_ITEM_OVERHEAD: usize = 2 + 8 + 8;
/// Request payload bytes of a put batch besides its items.
const PUT_BATCH_OVERHEAD: usize = 6;

/// One value to put: its key, its sources (host memory, checked) and their total length.
pub(super) struct PutSource<'a, 'r> {
    pub key: &'a [u8],
    pub sources: &'a [Region<'r>],
    pub len: u64,
}

/// A request of a batch: items `[start, end)` of the caller's list, whose values take `bytes`
/// of the window when `windowed` (else they travel in `Data` frames).
struct Group {
    start: usize,
    end: usize,
    windowed: bool,
    bytes: u64,
}

/// Splits `items` (in order) into groups that fit one request each. With a window of
/// `window` bytes, values up to half of it go through it, in groups of about an eighth.
fn plan_groups(items: &[PutSource<'_, '_>], limits: &Limits, max_items: usize, window: Option<u64>) -> Vec<Group> {
    let target = window.map_or(0, |w| w / GROUPS_PER_WINDOW);
    let windowed = |i: usize| window.is_some_and(|w| items[i].len <= w / LARGEST_WINDOWED_SHARE);
    let mut groups = Vec::new();
    let mut start = 0;
    while start < items.len() {
        let via_window = windowed(start);
        let mut end = start;
        let mut payload = PUT_BATCH_OVERHEAD;
        let mut bytes = 0u64;
        while end < items.len() && end - start < max_items && windowed(end) == via_window {
            let item_payload = items[end].key.len() + PUT_ITEM_OVERHEAD;
            let fits_payload = payload + item_payload <= limits.max_payload_bytes as usize;
            let fits_window = !via_window || bytes + items[end].len <= target;
            if end > start && !(fits_payload && fits_window) {
                break;
            }
            payload += item_payload;
            bytes += items[end].len;
            end += 1;
        }
        groups.push(Group { start, end, windowed: via_window, bytes: if via_window { bytes } else { 0 } });
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

    /// Puts `items` in as few requests as fit, several in flight, and reads one `Statuses`
    /// reply per request. Results in item order.
    pub(super) fn put_batch(
        &mut self,
        inner: &Inner,
        items: &[PutSource<'_, '_>],
        opts: PutOptions,
    ) -> WResult<Result<Vec<Result<()>>>> {
        if self.io.stream().is_unix() && self.shm.is_some() {
            self.ensure_window(inner.pool.next_request.fetch_add(1, Ordering::Relaxed))?;
        }
        let window = match &self.window {
            WindowState::Mapped(w) => Some(w.len()),
            _ => None,
        };
        // GPU values that do not go through the window are streamed through two bounce buffers
        // of one frame each (`send_device_value`), never staged whole.
        let groups = plan_groups(items, &self.limits, inner.pool.max_batch(&self.limits), window);
        let mut results: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        let mut answered = 0usize;
        match self.put_groups(inner, items, opts, &groups, &mut results, &mut answered) {
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
                let streamed_room = in_flight.len() < STREAMED_IN_FLIGHT;
                let offset = if group.windowed { ring_offset(window, head, group.bytes, &busy) } else { None };
                if (group.windowed && offset.is_some()) || (!group.windowed && streamed_room) {
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
            let range = if group.windowed { (offset, group.bytes) } else { (0, 0) };
            if group.windowed {
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

    /// Sends one group: its values into the window at `base`, or as `Data` frames after the
    /// request. Returns the items the request carries (a GPU value whose copy into the window
    /// failed is left out, with its error in `results`).
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
        let mut put_items = Vec::with_capacity(members.len());
        let window = match &self.window {
            WindowState::Mapped(w) if group.windowed => Some(w),
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
                    put_items.push(PutItem { key: items[i].key, len: items[i].len, window_offset: offset });
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
            }));
        }
        let start = self.io.begin(Op::PutBatch, rid);
        Request::PutBatch { upsert: opts.upsert, pin: opts.pin, window: window.is_some(), items: put_items }
            .encode(self.io.out());
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
        let groups = plan_groups(&items, &limits, 64, Some(8000));
        let shape: Vec<(usize, usize, bool, u64)> =
            groups.iter().map(|g| (g.start, g.end, g.windowed, g.bytes)).collect();
        // Two 400s fill a 1000-byte eighth; 5000 passes half the window and streams; 3000 is a
        // group of its own.
        assert_eq!(
            shape,
            vec![(0, 2, true, 800), (2, 3, true, 400), (3, 4, false, 0), (4, 5, true, 3000), (5, 7, true, 100)]
        );
        assert!(plan_groups(&items, &limits, 64, None).iter().all(|g| !g.windowed));
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
        let groups = plan_groups(&items, &limits, 64, None);
        assert!(groups.iter().all(|g| g.end - g.start == 4 || g.end == 10));
        assert!(groups.iter().all(|g| !g.windowed));
        assert_eq!(groups.iter().map(|g| g.end - g.start).sum::<usize>(), 10);
        let groups = plan_groups(&items, &Limits::default(), 4, None);
        assert_eq!(groups.len(), 3);
    }
}
