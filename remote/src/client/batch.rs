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
use kvtide_transport::Region;

use super::{source_slices, Conn, Inner, WindowState};
use crate::error::Result;
use crate::protocol::{
    decode_error_frame, decode_statuses, decode_window, Limits, Op, ProtocolError, PutItem, Request, MIN_CHUNK_BYTES,
    WHOLE_REQUEST,
};
use crate::shm::PutWindow;
use crate::wire::WResult;

/// Largest put window a client maps.
const MAX_WINDOW_BYTES: u64 = 1 << 34;
/// Requests of one batch in flight on a connection (one per window half).
const IN_FLIGHT: usize = 2;
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

/// A request of a batch: items `[start, end)` of the caller's list, and the window half it
/// uses (None: its values travel in `Data` frames).
struct Group {
    start: usize,
    end: usize,
    half: Option<usize>,
}

/// Splits `items` (in order) into groups that fit one request each. With a window of `half`
/// bytes per half, every value up to `half` bytes goes through it.
fn plan_groups(items: &[PutSource<'_, '_>], limits: &Limits, max_items: usize, half: Option<u64>) -> Vec<Group> {
    let mut groups = Vec::new();
    let mut start = 0;
    let mut next_half = 0;
    while start < items.len() {
        let windowed = |i: usize| half.is_some_and(|h| items[i].len <= h);
        let via_window = windowed(start);
        let mut end = start;
        let mut payload = PUT_BATCH_OVERHEAD;
        let mut bytes = 0u64;
        while end < items.len() && end - start < max_items && windowed(end) == via_window {
            let item_payload = items[end].key.len() + PUT_ITEM_OVERHEAD;
            let fits_payload = payload + item_payload <= limits.max_payload_bytes as usize;
            let fits_window = !via_window || half.is_some_and(|h| bytes + items[end].len <= h);
            if end > start && !(fits_payload && fits_window) {
                break;
            }
            payload += item_payload;
            bytes += items[end].len;
            end += 1;
        }
        let half = via_window.then(|| {
            next_half = (next_half + 1) % IN_FLIGHT;
            next_half
        });
        groups.push(Group { start, end, half });
        start = end;
    }
    groups
}

impl Conn {
    /// Asks for this connection's put window once (Unix socket with shared memory only); a
    /// refusal or a failed mapping leaves the connection putting over the socket.
    fn ensure_window(&mut self, rid: u64) -> WResult<()> {
        if !matches!(self.window, WindowState::Untried) {
            return Ok(());
        }
        self.window = WindowState::Unavailable;
        self.io.push_frame(Op::PutWindow, rid, &[]);
        self.io.flush()?;
        let mut fd = None;
        let h = self.io.read_header_with_fd(&self.limits, Some(&mut fd))?;
        if h.request_id != rid {
            return Err(ProtocolError::Invalid { what: "reply to another request" }.into());
        }
        let payload = self.io.read_payload(h.payload_len)?;
        match h.op {
            Op::Window => {
                let bytes = decode_window(&payload, 2 * u64::from(MIN_CHUNK_BYTES), MAX_WINDOW_BYTES)?;
                let Some(fd) = fd else {
                    return Err(ProtocolError::Invalid { what: "put window without a descriptor" }.into());
                };
                match PutWindow::map_writable(fd, bytes) {
                    Ok(w) => self.window = WindowState::Mapped(w),
                    Err(e) => tracing::warn!(error = %e, "cannot map the put window; putting over the socket"),
                }
            }
            Op::Error => {
                let (_, e) = decode_error_frame(&payload)?;
                tracing::debug!(error = %e, "no put window; putting over the socket");
            }
            other => return Err(ProtocolError::Unexpected { expected: "a put window", got: other }.into()),
        }
        Ok(())
    }

    /// Puts `items` in as few requests as fit, two in flight, and reads one `Statuses` reply
    /// per request. Results in item order.
    pub(super) fn put_batch(
        &mut self,
        inner: &Inner,
        items: &[PutSource<'_, '_>],
        opts: PutOptions,
    ) -> WResult<Result<Vec<Result<()>>>> {
        if self.io.stream().is_unix() && self.shm.is_some() {
            self.ensure_window(inner.next_request.fetch_add(1, Ordering::Relaxed))?;
        }
        let half = match &self.window {
            WindowState::Mapped(w) => Some(w.len() / IN_FLIGHT as u64),
            _ => None,
        };
        let groups = plan_groups(items, &self.limits, inner.max_batch(&self.limits), half);
        let mut results: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        let mut answered = 0usize;
        match self.put_groups(inner, items, opts, &groups, &mut results, &mut answered) {
            Ok(()) => {}
            // Nothing took effect that the caller was told of: the call may retry it.
            Err(e) if answered == 0 => return Err(e),
            // Earlier groups took effect: report them, fail the rest, and retire the connection.
            Err(e) => {
                self.broken = true;
                let why = e.into_error("put", inner.options.timeout_ms);
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
        let mut in_flight: VecDeque<(u64, usize)> = VecDeque::new();
        for (g, group) in groups.iter().enumerate() {
            // A window half is written only once the owner answered the request that used it.
            while in_flight.len() >= IN_FLIGHT {
                if let Some((rid, done)) = in_flight.pop_front() {
                    self.settle(rid, &groups[done], results)?;
                    *answered += 1;
                }
            }
            let rid = inner.next_request.fetch_add(1, Ordering::Relaxed);
            self.send_group(rid, items, group, opts)?;
            in_flight.push_back((rid, g));
        }
        while let Some((rid, done)) = in_flight.pop_front() {
            self.settle(rid, &groups[done], results)?;
            *answered += 1;
        }
        Ok(())
    }

    /// Sends one group: its values into its window half, or as `Data` frames after the request.
    fn send_group(&mut self, rid: u64, items: &[PutSource<'_, '_>], group: &Group, opts: PutOptions) -> WResult<()> {
        let members = &items[group.start..group.end];
        let mut put_items = Vec::with_capacity(members.len());
        let mut offset = 0u64;
        if let (Some(half), WindowState::Mapped(w)) = (group.half, &self.window) {
            let base = half as u64 * (w.len() / IN_FLIGHT as u64);
            for item in members {
                let mut pos = base + offset;
                for src in item.sources {
                    // SAFETY: host sources are valid for reads for the call (Region's
                    // contract, checked by check_source); this half's last request was answered.
                    unsafe { w.write(pos, src.addr() as *const u8, src.len() as u64) }
                        .map_err(|_| ProtocolError::Invalid { what: "value outside the put window" })?;
                    pos += src.len() as u64;
                }
                put_items.push(PutItem { key: item.key, len: item.len, window_offset: base + offset });
                offset += item.len;
            }
        } else {
            put_items.extend(members.iter().map(|i| PutItem { key: i.key, len: i.len, window_offset: 0 }));
        }
        let window = group.half.is_some();
        let start = self.io.begin(Op::PutBatch, rid);
        Request::PutBatch { upsert: opts.upsert, pin: opts.pin, window, items: put_items }.encode(self.io.out());
        self.io.end(start);
        if !window {
            // The request goes out with the first value frame.
            let chunk = u64::from(self.hello.chunk_bytes);
            for item in members {
                let mut pos = 0;
                while pos < item.len {
                    let n = chunk.min(item.len - pos);
                    self.io.send_data(Op::Data, rid, &source_slices(item.sources, pos, n))?;
                    pos += n;
                }
            }
        }
        self.io.flush()
    }

    /// Reads the `Statuses` reply of `group`'s request into `results`.
    fn settle(&mut self, rid: u64, group: &Group, results: &mut [Option<Result<()>>]) -> WResult<()> {
        let members = group.end - group.start;
        let statuses: Vec<Result<()>> = {
            let h = self.read_reply_header(rid)?;
            let payload = self.io.read_payload(h.payload_len)?;
            match h.op {
                Op::Statuses => {
                    let statuses = decode_statuses(&payload, self.limits.max_items)?;
                    if statuses.len() != members {
                        return Err(ProtocolError::Invalid { what: "status count" }.into());
                    }
                    statuses
                }
                Op::Error => {
                    let (index, e) = decode_error_frame(&payload)?;
                    if index != WHOLE_REQUEST {
                        return Err(ProtocolError::Invalid { what: "item error outside a status list" }.into());
                    }
                    vec![Err(e); members]
                }
                other => return Err(ProtocolError::Unexpected { expected: "statuses", got: other }.into()),
            }
        };
        for (slot, status) in results[group.start..group.end].iter_mut().zip(statuses) {
            *slot = Some(status);
        }
        Ok(())
    }

    /// One `RemoveBatch` request and its `Statuses` reply.
    pub(super) fn remove_batch(&mut self, rid: u64, keys: &[&[u8]], force: bool) -> WResult<Result<Vec<Result<()>>>> {
        let start = self.io.begin(Op::RemoveBatch, rid);
        Request::RemoveBatch { keys: keys.to_vec(), force }.encode(self.io.out());
        self.io.end(start);
        self.io.flush()?;
        let h = self.read_reply_header(rid)?;
        let payload = self.io.read_payload(h.payload_len)?;
        match h.op {
            Op::Statuses => {
                let statuses = decode_statuses(&payload, self.limits.max_items)?;
                if statuses.len() != keys.len() {
                    return Err(ProtocolError::Invalid { what: "status count" }.into());
                }
                Ok(Ok(statuses))
            }
            Op::Error => Ok(Err(decode_error_frame(&payload)?.1)),
            other => Err(ProtocolError::Unexpected { expected: "statuses", got: other }.into()),
        }
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
    fn groups_fit_the_window_halves_and_alternate() {
        let limits = Limits::default();
        let items = sources(&[400, 400, 400, 2000, 100, 0]);
        let groups = plan_groups(&items, &limits, 64, Some(1000));
        let shape: Vec<(usize, usize, Option<usize>)> = groups.iter().map(|g| (g.start, g.end, g.half)).collect();
        // Two 400s fill a 1000-byte half; the 2000-byte value streams; halves alternate.
        assert_eq!(shape, vec![(0, 2, Some(1)), (2, 3, Some(0)), (3, 4, None), (4, 6, Some(1))]);
    }

    #[test]
    fn groups_respect_item_and_payload_limits() {
        let limits = Limits { max_payload_bytes: 100, ..Limits::default() };
        let items = sources(&[1; 10]);
        // 6 + 4 * (3 + 18) = 90 bytes; a fifth item would pass 100.
        let groups = plan_groups(&items, &limits, 64, None);
        assert!(groups.iter().all(|g| g.end - g.start == 4 || g.end == 10));
        assert!(groups.iter().all(|g| g.half.is_none()));
        assert_eq!(groups.iter().map(|g| g.end - g.start).sum::<usize>(), 10);
        let groups = plan_groups(&items, &Limits::default(), 4, None);
        assert_eq!(groups.len(), 3);
    }
}
