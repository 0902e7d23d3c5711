//! One connection to an owner and the client half of the protocol on it.
//!
//! Owns `Conn` (the framed socket, the owner's hello and limits, the arena mapping and put window
//! it uses, the lease releases it has not had confirmed; `Releases`, the store-wide ledger of
//! those), the one request/reply exchange every single-reply request goes through (`Conn::request`:
//! an unexpected reply is a protocol error, decided here only), the one reader of an object's
//! `Data` frames (`Conn::read_data_frames`), and the reads of a `Get`: streamed into their targets,
//! or leased in parts and copied out of the shared arena. Never pools, retries or reconnects (that
//! is `pool.rs`), and never checks a caller's arguments (`arguments.rs`): the lists it writes were
//! checked before they reach it.

use std::io::IoSlice;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtide::checks::total_len;
use kvtide::Error as StoreError;
use kvtide_transport::{Direction, Region, Transfer};

use super::arena::Arena;
use super::gpu;
use crate::error::{Error, Result};
use crate::protocol::{
    decode_error_frame, decode_index_map, decode_object, FrameHeader, GetItem, Grant, GrantsPart, HelloOk, LenCheck,
    Limits, NextPart, Op, ProtocolError, Request, WHOLE_REQUEST,
};
use crate::shm::{IndexMapping, OwnerWatch, PutWindow, ShmMapping};
use crate::wire::{FrameIo, WResult, WireError};

/// A lease is trusted only if the copy finished this long before its TTL.
pub(super) const LEASE_MARGIN: Duration = Duration::from_millis(500);
/// First allocation for `get` over a stream (grown as bytes arrive, so a lying length cannot
/// make the client allocate more than it received).
pub(super) const GET_INITIAL_ALLOC: u64 = 64 << 20;
/// A read of one key into a host buffer of at most this many bytes comes through the socket
/// even when the arena is mapped: leasing through the owner's shard and releasing afterwards
/// costs more than copying that few bytes twice (docs/benchmarks.md, "Small reads over the Unix
/// socket"). Batches keep the arena: streamed, only batches of values under about 1 KiB measured
/// faster, and the owner streams a batch's DRAM-resident keys one after another.
pub(super) const STREAM_READ_BYTES: u64 = 8 << 10;

/// Lease releases this client sent that the owner may not have applied yet. A release has no
/// reply; the owner applies a connection's frames in order, so the next reply read on that
/// connection (or its close) confirms it. `remove` waits on this before it retries a key found
/// leased, so a read's own lease never fails the remove that follows it.
#[derive(Default)]
pub(super) struct Releases {
    /// (last sequence number given, those not yet confirmed).
    state: Mutex<(u64, std::collections::BTreeSet<u64>)>,
    confirmed: Condvar,
}

impl Releases {
    pub(super) fn sent(&self) -> u64 {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += 1;
        let seq = g.0;
        g.1.insert(seq);
        seq
    }

    pub(super) fn confirm(&self, seqs: &mut Vec<u64>) {
        if seqs.is_empty() {
            return;
        }
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        for seq in seqs.drain(..) {
            g.1.remove(&seq);
        }
        self.confirmed.notify_all();
    }

    /// The sequence number of the last release sent so far (0: none yet).
    pub(super) fn last_sent(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    /// Waits until every release up to `seq` is confirmed, or `timeout` passed.
    pub(super) fn wait_through(&self, seq: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while g.1.first().is_some_and(|&first| first <= seq) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            g = self.confirmed.wait_timeout(g, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

pub(super) struct Conn {
    pub(super) io: FrameIo,
    pub(super) hello: HelloOk,
    pub(super) limits: Limits,
    pub(super) shm: Option<Arc<ShmMapping>>,
    /// The owner's arena over the UCX plane (a TCP connection that attached to it).
    pub(super) ucx: Option<Arc<crate::ucx::UcxArena>>,
    /// When this connection asked for the UCX plane and was left on TCP: it is not kept past
    /// the pool's retry interval, so a later connection asks again.
    pub(super) off_plane_since: Option<std::time::Instant>,
    pub(super) window: WindowState,
    pub(super) direct: DirectState,
    /// Failed midway through a batch whose earlier requests took effect: never reused.
    pub(super) broken: bool,
    /// Releases sent on this connection since its last reply (`Releases`).
    pub(super) unconfirmed: Vec<u64>,
    pub(super) releases: Arc<Releases>,
    /// The cancel flag of the ticket whose batch read runs on this connection now: set, the read
    /// stops between parts (or objects), reports the keys it has not delivered `Cancelled` and
    /// leaves the connection broken, so the owner drops what it still holds for it.
    pub(super) cancel: Option<Arc<AtomicBool>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // A closed connection's leases are dropped by the owner.
        self.releases.confirm(&mut self.unconfirmed);
    }
}

/// A connection's put window.
pub(super) enum WindowState {
    /// Not asked for yet (asked on the first put over a Unix socket with shared memory).
    Untried,
    /// Refused, failed or not applicable: values travel over the socket.
    Unavailable,
    Mapped(PutWindow),
}

/// Whether the owner reads this connection's put values from the client's memory.
pub(super) enum DirectState {
    /// Not asked yet (asked on the first put over a Unix socket).
    Untried,
    /// Refused or not applicable: values go through the window or over the socket.
    Unavailable,
    /// Granted to process `pid`: a child forked since holds the connection too, but the owner
    /// reads its parent's memory, so the child must not name its own addresses.
    Granted(libc::pid_t),
}

/// The largest read index a client maps (2^24 buckets of 4 entries for each of 448 shards would
/// be more; an owner's index is 1/64 of its DRAM).
const MAX_READ_INDEX_BYTES: u64 = 1 << 40;

/// One object read: its length, and its bytes when the target was `Owned`.
pub(super) type ReadResult = Result<(usize, Option<Vec<u8>>)>;

/// A part of a `GetParts` answer whose leases this client holds: its GPU copies in flight (and
/// the result slot of each), its result slots, its lease ids, and when its grants arrived.
struct PartCopies {
    inflight: Option<kvtide_transport::InFlight>,
    slots: Vec<usize>,
    in_part: Vec<usize>,
    leases: Vec<u64>,
    arrived: Instant,
    /// When its host targets were copied (it was placed): with no GPU copies, when the part
    /// was done with its leased bytes, however long it is then kept.
    placed: Instant,
    ttl: Duration,
}

/// One result slot of a leased item (`Conn::get_in_parts`): its result, and the GPU copy that
/// still has to deliver it.
pub(super) struct Placed<T> {
    slot: usize,
    result: Result<T>,
    device: Option<Transfer>,
}

impl<T> Placed<T> {
    pub(super) fn of(slot: usize, placed: Result<(T, Option<Transfer>)>) -> Placed<T> {
        match placed {
            Ok((result, device)) => Placed { slot, result: Ok(result), device },
            Err(e) => Placed { slot, result: Err(e), device: None },
        }
    }
}

/// Where one object's bytes go.
pub(super) enum Target<'a> {
    /// In order across these regions (their lengths were checked against the object's).
    Regions(Vec<Region<'a>>),
    /// A new vector (`get`).
    Owned(Vec<u8>),
}

/// Whether a read goes through the socket although the arena is mapped: one key, into host
/// memory of a known size of at most `STREAM_READ_BYTES`. (A `get` of unknown size keeps the
/// one-copy path.)
pub(super) fn streams_small_reads(batch: &[(&[u8], LenCheck, Target<'_>)]) -> bool {
    let [(_, check, target)] = batch else { return false };
    let most = match check {
        LenCheck::AtMost(n) | LenCheck::Exactly(n) => *n,
        LenCheck::Any => return false,
    };
    most <= STREAM_READ_BYTES && !matches!(target, Target::Regions(regions) if gpu::names_device(regions))
}

pub(super) fn hello_conn(io: FrameIo, hello: HelloOk, shm: Option<Arc<ShmMapping>>, releases: Arc<Releases>) -> Conn {
    let limits = hello.limits();
    Conn {
        io,
        limits,
        hello,
        shm,
        ucx: None,
        off_plane_since: None,
        window: WindowState::Untried,
        direct: DirectState::Untried,
        broken: false,
        unconfirmed: Vec::new(),
        releases,
        cancel: None,
    }
}

/// `[pos, pos + n)` of the concatenation of `sources`, as slices.
pub(super) fn source_slices<'s>(sources: &'s [Region<'_>], pos: u64, n: u64) -> Vec<IoSlice<'s>> {
    RegionParts::new(sources, pos, n)
        .map(|(addr, len)| {
            // SAFETY: host regions are valid for reads for the duration of the call that lent
            // them (Region's contract); the part lies inside one of `sources`.
            IoSlice::new(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) })
        })
        .collect()
}

/// The parts of `regions` covering `[pos, pos + n)` of their concatenation, as (address,
/// length), in order (the caller checked that the range lies inside).
pub(super) struct RegionParts<'r, 'a> {
    regions: std::slice::Iter<'r, Region<'a>>,
    pos: u64,
    left: u64,
}

impl<'r, 'a> RegionParts<'r, 'a> {
    pub(super) fn new(regions: &'r [Region<'a>], pos: u64, n: u64) -> RegionParts<'r, 'a> {
        RegionParts { regions: regions.iter(), pos, left: n }
    }
}

impl Iterator for RegionParts<'_, '_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        while self.left > 0 {
            let region = self.regions.next()?;
            let len = region.len() as u64;
            if self.pos >= len {
                self.pos -= len;
                continue;
            }
            let take = (len - self.pos).min(self.left);
            let part = (region.addr() + self.pos, take);
            self.left -= take;
            self.pos = 0;
            return Some(part);
        }
        None
    }
}

impl Conn {
    /// Where this connection reads granted ranges from: the arena mapping, the UCX plane, or
    /// neither (the owner then streams every byte).
    pub(super) fn arena(&self) -> Option<Arena> {
        match (&self.shm, &self.ucx) {
            (Some(m), _) => Some(Arena::Mapped(Arc::clone(m))),
            (None, Some(u)) => Some(Arena::Ucx(Arc::clone(u))),
            (None, None) => None,
        }
    }

    /// Reads a reply header for request `rid`.
    pub(super) fn read_reply_header(&mut self, rid: u64) -> WResult<FrameHeader> {
        let h = self.io.read_header(&self.limits)?;
        self.releases.confirm(&mut self.unconfirmed);
        if h.request_id != rid {
            return Err(ProtocolError::Invalid { what: "reply to another request" }.into());
        }
        Ok(h)
    }

    /// Appends `request` as request `rid` to the write buffer (sent with the next flush).
    pub(super) fn push(&mut self, rid: u64, request: &Request<'_>) {
        let start = self.io.begin(request.op(), rid);
        request.encode(self.io.out());
        self.io.end(start);
    }

    /// Sends `request` as request `rid`.
    pub(super) fn send(&mut self, rid: u64, request: &Request<'_>) -> WResult<()> {
        self.push(rid, request);
        self.io.flush()
    }

    /// One request and its one reply: sends `request`, then `read_reply`.
    pub(super) fn request<T>(
        &mut self,
        rid: u64,
        request: &Request<'_>,
        reply: Op,
        expected: &'static str,
        decode: impl FnOnce(&Conn, &[u8]) -> WResult<T>,
    ) -> WResult<Result<T>> {
        self.send(rid, request)?;
        self.read_reply(rid, reply, expected, decode)
    }

    /// Reads the one reply frame to request `rid`: a `reply` frame is `decode(conn, payload)`,
    /// an `Error` frame the owner's error (`Ok(Err)`, the connection still in step), anything
    /// else a protocol error naming `expected` (`reply_of`).
    pub(super) fn read_reply<T>(
        &mut self,
        rid: u64,
        reply: Op,
        expected: &'static str,
        decode: impl FnOnce(&Conn, &[u8]) -> WResult<T>,
    ) -> WResult<Result<T>> {
        let h = self.read_reply_header(rid)?;
        let payload = self.io.read_payload(h.payload_len)?;
        reply_of(h.op, &payload, reply, expected, |payload| decode(self, payload))
    }

    /// Reads an `Ok` / `Error` reply.
    pub(super) fn read_status(&mut self, rid: u64) -> WResult<Result<()>> {
        self.read_reply(rid, Op::Ok, "a status", |_, payload| {
            if !payload.is_empty() {
                return Err(ProtocolError::Unexpected { expected: "a status", got: Op::Ok }.into());
            }
            Ok(())
        })
    }

    /// Sends a request answered by `Ok` or `Error`, and reads that answer.
    pub(super) fn request_status(&mut self, rid: u64, request: &Request<'_>) -> WResult<Result<()>> {
        self.send(rid, request)?;
        self.read_status(rid)
    }

    /// Reads the `Data` frames of one object of `len` bytes (or its `Abort`): the one reader of
    /// data frames. Before each frame `go_on()` may stop the read (its error fails the
    /// connection); each frame must arrive as `pace` says; `land(io, pos, n)` reads the frame's
    /// `n` bytes, bytes `[pos, pos + n)` of the object, out of `io` into place. Returns the
    /// owner's reason when it aborted the object (the frames before it landed).
    pub(super) fn read_data_frames(
        &mut self,
        rid: u64,
        len: u64,
        pace: Pace,
        mut go_on: impl FnMut() -> WResult<()>,
        mut land: impl FnMut(&mut FrameIo, u64, u64) -> WResult<()>,
    ) -> WResult<Option<Error>> {
        let mut deadline = pace.first_deadline();
        let mut pos = 0u64;
        while pos < len {
            go_on()?;
            if Instant::now() > deadline {
                return Err(WireError::Timeout);
            }
            let h = self.read_reply_header(rid)?;
            match h.op {
                Op::Data => {
                    let n = u64::from(h.payload_len);
                    if n == 0 || n > len - pos {
                        return Err(ProtocolError::Invalid { what: "data frame length" }.into());
                    }
                    land(&mut self.io, pos, n)?;
                    pos += n;
                    if let Pace::EachWithin(each) = pace {
                        deadline = Instant::now() + each;
                    }
                }
                Op::Abort => {
                    let payload = self.io.read_payload(h.payload_len)?;
                    return Ok(Some(decode_error_frame(&payload)?.1));
                }
                other => return Err(ProtocolError::Unexpected { expected: "data", got: other }.into()),
            }
        }
        Ok(None)
    }

    /// One `Get` request: leases through shared memory when mapped (unless it is one small
    /// read: `streams_small_reads`), else a stream.
    pub(super) fn get_batch(
        &mut self,
        rid: u64,
        batch: &mut [(&[u8], LenCheck, Target<'_>)],
        timeout: Duration,
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<Vec<ReadResult>>> {
        if self.arena().is_some() && !streams_small_reads(batch) {
            return self.read_grant_parts(rid, batch, gpu);
        }
        let items: Vec<GetItem<'_>> = batch.iter().map(|(key, check, _)| GetItem { key, check: *check }).collect();
        self.push(rid, &Request::Get { lease: false, items });
        let sent = Instant::now();
        self.io.flush()?;
        let mut targets: Vec<&mut Target<'_>> = batch.iter_mut().map(|(_, _, t)| t).collect();
        let results = self.read_stream(rid, &mut targets, sent + timeout, gpu)?;
        Ok(results.map(|per_item| {
            per_item
                .into_iter()
                .zip(batch.iter_mut())
                .map(|(res, (_, _, target))| {
                    res.map(|len| match target {
                        Target::Owned(v) => (len, Some(std::mem::take(v))),
                        Target::Regions(_) => (len, None),
                    })
                })
                .collect()
        }))
    }

    /// Reads the `GrantsPart` frames of a `GetParts`: copies each part's objects out of the
    /// shared arena into their targets (GPU targets in one submission per part) and releases
    /// the part's leases before reading the next, so the owner can lease further parts.
    pub(super) fn read_grant_parts(
        &mut self,
        rid: u64,
        batch: &mut [(&[u8], LenCheck, Target<'_>)],
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<Vec<ReadResult>>> {
        let items = batch.iter().map(|(key, check, _)| GetItem { key, check: *check }).collect();
        let slots = batch.len();
        self.get_in_parts(rid, items, slots, gpu, |i, grant, arena| {
            let (_, check, target) = &mut batch[i];
            let placed = grant.and_then(|g| {
                check.check(g.len)?;
                match target {
                    Target::Regions(regions) if gpu::names_device(regions) => {
                        // SAFETY: leased to this connection until the part is released; the
                        // device pieces were checked by check_destinations.
                        let transfer = unsafe { arena.to_device(gpu, g.offset, g.len, regions) }?;
                        Ok(((g.len as usize, None), transfer))
                    }
                    _ => copy_grant(arena, g.offset, g.len, target).map(|r| (r, None)),
                }
            });
            vec![Placed::of(i, placed)]
        })
    }

    /// Sends a `GetParts` for `items` and works through its parts. `place(item, grant, arena)`
    /// handles one granted (or refused) item: it copies host targets out of the arena itself
    /// and returns, per result slot of the item (`slots` in all), the result and the GPU copy
    /// it still needs. Each part's GPU copies run in one submission; then the part's results
    /// are checked against the lease TTL and its leases released, before the next part is read.
    pub(super) fn get_in_parts<T>(
        &mut self,
        rid: u64,
        items: Vec<GetItem<'_>>,
        slots: usize,
        gpu: &gpu::ClientGpu,
        mut place: impl FnMut(usize, Result<Grant>, &Arena) -> Vec<Placed<T>>,
    ) -> WResult<Result<Vec<Result<T>>>> {
        let Some(arena) = self.arena().map(Arena::batched) else {
            return Err(ProtocolError::Invalid { what: "grants without shared memory or the UCX plane" }.into());
        };
        let count = items.len();
        self.send(rid, &Request::GetParts { items })?;
        let mut results: Vec<Option<Result<T>>> = (0..slots).map(|_| None).collect();
        let mut answered = vec![false; count];
        // A part the owner let this client keep while it leases the next (`NextPart::WhileHeld`):
        // its GPU copies run while the owner leases (or loads) the next part.
        let mut kept: Option<PartCopies> = None;
        loop {
            if self.cancelled() {
                if let Some(k) = kept.take() {
                    self.finish_part(rid, k, &mut results)?;
                }
                return Ok(Ok(self.stop_cancelled(results)));
            }
            let part = self.read_reply(rid, Op::GrantsPart, "grants", |conn, payload| {
                Ok(GrantsPart::decode(payload, conn.limits.max_items, count, arena.len())?)
            })?;
            let arrived = Instant::now();
            let part = match part {
                Ok(part) => part,
                Err(e) => return Ok(Err(e)),
            };
            let mut leases = Vec::with_capacity(part.grants.len());
            let mut in_part = Vec::new();
            // GPU destinations: straight from the arena mapping, one submission per part.
            let mut device: Vec<(usize, Transfer)> = Vec::new();
            for (index, grant) in part.grants {
                let i = index as usize;
                if std::mem::replace(&mut answered[i], true) {
                    return Err(ProtocolError::Invalid { what: "item granted twice" }.into());
                }
                if let Ok(g) = &grant {
                    leases.push(g.lease);
                }
                for Placed { slot, result, device: copy } in place(i, grant, &arena) {
                    if let Some(copy) = copy {
                        device.push((slot, copy));
                    }
                    in_part.push(slot);
                    results[slot] = Some(result);
                }
            }
            // The part's UCX gets, in flight together; a failure fails every copy of the part
            // (none of its destinations is reported written).
            if let Err(e) = arena.flush() {
                for &slot in &in_part {
                    if let Some(r @ Ok(_)) = &mut results[slot] {
                        *r = Err(e.clone());
                    }
                }
            }
            let mut copies = PartCopies {
                inflight: None,
                slots: Vec::new(),
                in_part,
                leases,
                arrived,
                placed: Instant::now(),
                ttl: Duration::from_millis(u64::from(part.ttl_ms)),
            };
            // The kept part goes back now: the owner leases the part after this one once every
            // earlier part is back. With staging, its copies complete before this part's are
            // submitted (a second staged submission would find the staging buffer busy and copy
            // directly); this part was placed meanwhile. Direct copies may overlap.
            let overlap = !device.is_empty() && !gpu.stages();
            if !overlap {
                if let Some(k) = kept.take() {
                    self.finish_part(rid, k, &mut results)?;
                }
            }
            if !device.is_empty() {
                if let Some(mapping) = arena.mapping() {
                    gpu.pin(mapping.memory(), true);
                }
                let (indices, transfers): (Vec<usize>, Vec<Transfer>) = device.into_iter().unzip();
                // SAFETY: the host bytes are leased to this connection until `finish_part`
                // releases them, after the copies completed (or the connection drops, which
                // waits for them first); the device pieces were checked by check_destinations.
                match unsafe { gpu.submit(Direction::HostToDevice, &transfers) } {
                    Ok(inflight) => {
                        copies.inflight = Some(inflight);
                        copies.slots = indices;
                    }
                    Err(e) => indices.into_iter().for_each(|slot| results[slot] = Some(Err(e.clone()))),
                }
            }
            if let Some(k) = kept.take() {
                self.finish_part(rid, k, &mut results)?;
            }
            match part.next {
                NextPart::WhileHeld => kept = Some(copies),
                NextPart::AfterRelease => self.finish_part(rid, copies, &mut results)?,
                NextPart::None => {
                    self.finish_part(rid, copies, &mut results)?;
                    break;
                }
            }
        }
        if answered.contains(&false) || results.iter().any(Option::is_none) {
            return Err(ProtocolError::Invalid { what: "the owner did not answer for every key" }.into());
        }
        Ok(Ok(results.into_iter().map(|r| r.unwrap_or(Err(StoreError::Internal("unanswered").into()))).collect()))
    }

    /// Waits for a part's GPU copies, checks its results against the lease TTL and releases
    /// its leases.
    fn finish_part<T>(&mut self, rid: u64, part: PartCopies, results: &mut [Option<Result<T>>]) -> WResult<()> {
        let PartCopies { inflight, slots, in_part, leases, arrived, placed, ttl } = part;
        // When the part's copies were done: its GPU copies once waited for; without any, once
        // it was placed (a part kept while a slower shard lands may be released much later).
        let mut done = placed;
        if let Some(inflight) = inflight {
            for (slot, outcome) in slots.into_iter().zip(inflight.wait()) {
                if let Err(e) = outcome {
                    results[slot] = Some(Err(StoreError::from(e).into()));
                }
            }
            done = Instant::now();
        }
        // The owner keeps leased bytes in place until the TTL; a copy that finished later
        // than that cannot be trusted.
        if done.saturating_duration_since(arrived) + LEASE_MARGIN >= ttl {
            for &slot in &in_part {
                if let Some(r @ Ok(_)) = &mut results[slot] {
                    *r = Err(StoreError::LeaseExpired.into());
                }
            }
        }
        self.send_release(rid, leases)
    }

    /// Sends a one-way `Release` of `leases` (none: nothing).
    /// Sends `op` (no payload) and reads its `reply` and the descriptor passed with it: the
    /// decoded reply and the descriptor, or the owner's refusal. A granted reply without a
    /// descriptor is a protocol error.
    pub(super) fn request_descriptor<T>(
        &mut self,
        rid: u64,
        op: Op,
        reply: Op,
        expected: &'static str,
        decode: impl FnOnce(&[u8]) -> WResult<T>,
    ) -> WResult<Result<(T, OwnedFd)>> {
        self.io.push_frame(op, rid, &[]);
        self.io.flush()?;
        let mut fd = None;
        let h = self.io.read_header_with_fd(&self.limits, Some(&mut fd))?;
        if h.request_id != rid {
            return Err(ProtocolError::Invalid { what: "reply to another request" }.into());
        }
        let payload = self.io.read_payload(h.payload_len)?;
        match reply_of(h.op, &payload, reply, expected, decode)? {
            Ok(granted) => match fd {
                Some(fd) => Ok(Ok((granted, fd))),
                None => Err(ProtocolError::Invalid { what: "a descriptor reply without its descriptor" }.into()),
            },
            Err(e) => Ok(Err(e)),
        }
    }

    /// Asks the owner once for its read index (Unix socket with the arena mapped, first
    /// connection to this owner instance in the process) and keeps what it gives with the arena
    /// mapping. A refusal, or an index that cannot be mapped or checked, leaves reads leased.
    pub(super) fn ask_read_index(&mut self) -> WResult<()> {
        let Some(arena) = self.shm.clone() else { return Ok(()) };
        if arena.read_index_asked() {
            return Ok(());
        }
        // The pid the kernel recorded at connect; the reply below proves it was still the owner's.
        let watch = match self.io.stream().peer_pid().map(OwnerWatch::of_pid) {
            Some(Ok(watch)) => watch,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "cannot watch the owner process; reads lease");
                arena.set_read_index(None);
                return Ok(());
            }
            None => {
                tracing::debug!("the owner's pid is not visible here; reads lease");
                arena.set_read_index(None);
                return Ok(());
            }
        };
        let decode = |p: &[u8]| Ok(decode_index_map(p, MAX_READ_INDEX_BYTES)?);
        let mapped = match self.request_descriptor(0, Op::ReadIndex, Op::IndexMap, "a read index", decode)? {
            Ok((bytes, fd)) => match IndexMapping::map(fd, bytes, arena.len(), watch) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot use the owner's read index; reads lease");
                    None
                }
            },
            Err(e) => {
                tracing::debug!(error = %e, "no read index; reads lease");
                None
            }
        };
        arena.set_read_index(mapped);
        Ok(())
    }

    pub(super) fn send_release(&mut self, rid: u64, leases: Vec<u64>) -> WResult<()> {
        if leases.is_empty() {
            return Ok(());
        }
        self.push(rid, &Request::Release { leases });
        self.unconfirmed.push(self.releases.sent());
        self.io.flush()
    }

    /// One round trip that touches no shard (an `Exists` of no keys): when it returns, the
    /// owner has applied every frame sent before it on this connection.
    pub(super) fn round_trip(&mut self, rid: u64) -> WResult<()> {
        // The owner's error is an answer too: it applied the frames before it.
        self.request(rid, &Request::Exists { keys: Vec::new() }, Op::ExistsReply, "exists results", |_, _| Ok(()))
            .map(drop)
    }

    /// Reads `Object`/`Data`/`Abort`/`Error` frames up to `End`, writing each object into its
    /// target. Returns the byte count per item.
    pub(super) fn read_stream(
        &mut self,
        rid: u64,
        targets: &mut [&mut Target<'_>],
        deadline: Instant,
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<Vec<Result<usize>>>> {
        let mut results: Vec<Option<Result<usize>>> = (0..targets.len()).map(|_| None).collect();
        loop {
            if self.cancelled() {
                return Ok(Ok(self.stop_cancelled(results)));
            }
            if Instant::now() > deadline {
                return Err(WireError::Timeout);
            }
            let h = self.read_reply_header(rid)?;
            match h.op {
                Op::End => {
                    if h.payload_len != 0 {
                        return Err(ProtocolError::Invalid { what: "end frame" }.into());
                    }
                    break;
                }
                Op::Error => {
                    let payload = self.io.read_payload(h.payload_len)?;
                    let (index, error) = decode_error_frame(&payload)?;
                    if index == WHOLE_REQUEST {
                        return Ok(Err(error));
                    }
                    let slot = results.get_mut(index as usize).ok_or(ProtocolError::Invalid { what: "item index" })?;
                    if slot.is_some() {
                        return Err(ProtocolError::Invalid { what: "item answered twice" }.into());
                    }
                    *slot = Some(Err(error));
                }
                Op::Object => {
                    let payload = self.io.read_payload(h.payload_len)?;
                    let (index, len) = decode_object(&payload)?;
                    let i = index as usize;
                    if i >= targets.len() || results[i].is_some() {
                        return Err(ProtocolError::Invalid { what: "item index" }.into());
                    }
                    let read = match &*targets[i] {
                        Target::Regions(regions) if gpu::names_device(regions) => {
                            self.read_object_to_gpu(rid, len, regions, deadline, gpu)
                        }
                        _ => self.read_object(rid, len, targets[i], deadline),
                    };
                    match read {
                        Ok(result) => results[i] = Some(result),
                        // Cancelled in the middle of the object: it was not delivered.
                        Err(_) if self.cancelled() => return Ok(Ok(self.stop_cancelled(results))),
                        Err(e) => return Err(e),
                    }
                }
                other => {
                    return Err(
                        ProtocolError::Unexpected { expected: "an object, an error or the end", got: other }.into()
                    )
                }
            }
        }
        Ok(Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Err(Error::Protocol("the owner did not answer for every key".into()))))
            .collect()))
    }

    /// Reads one object's `Data` frames (or its `Abort`) into GPU `regions` through a
    /// `BouncePair`: each frame is copied on to the GPU while the next one arrives. A failed copy
    /// fails the object; its remaining frames are still read, so the connection stays usable.
    fn read_object_to_gpu(
        &mut self,
        rid: u64,
        len: u64,
        regions: &[Region<'_>],
        deadline: Instant,
        gpu: &gpu::ClientGpu,
    ) -> WResult<Result<usize>> {
        let room: u64 = regions.iter().map(|r| r.len() as u64).sum();
        if len > room {
            return Err(ProtocolError::Invalid { what: "object longer than its destination" }.into());
        }
        let mut pair = gpu::BouncePair::new(gpu, gpu::ordinal_of(regions), self.hello.chunk_bytes as usize);
        let cancel = self.cancel.clone();
        let mut failed: Option<Error> = None;
        let aborted = self.read_data_frames(
            rid,
            len,
            Pace::AllBy(deadline),
            || cancel_point(&cancel),
            |io, pos, n| {
                let (buffer, room, done) = pair.next_buffer();
                if n as usize > room {
                    return Err(ProtocolError::Invalid { what: "data frame length" }.into());
                }
                if let Some((Err(e), _)) = done {
                    failed.get_or_insert(e);
                }
                // SAFETY: the buffer is the pair's, at least `n` bytes, and its last copy completed
                // in `next_buffer`.
                unsafe { io.read_raw(buffer, n as usize)? };
                if failed.is_none() {
                    // SAFETY: the buffer holds the frame; the device regions were checked by
                    // check_destinations and are the caller's for the call.
                    if let Err(e) = unsafe { pair.submit(n, gpu::pieces_of(regions, pos, n), pos + n) } {
                        failed = Some(e);
                    }
                }
                Ok(())
            },
        )?;
        if let Some(e) = aborted {
            failed.get_or_insert(e);
        }
        for (outcome, _) in pair.drain() {
            if let Err(e) = outcome {
                failed.get_or_insert(e);
            }
        }
        Ok(match failed {
            Some(e) => Err(e),
            None => Ok(len as usize),
        })
    }

    /// Reads one object's `Data` frames (or its `Abort`) into `target`.
    fn read_object(
        &mut self,
        rid: u64,
        len: u64,
        target: &mut Target<'_>,
        deadline: Instant,
    ) -> WResult<Result<usize>> {
        match target {
            Target::Regions(regions) => {
                let room: u64 = regions.iter().map(|r| r.len() as u64).sum();
                if len > room {
                    return Err(ProtocolError::Invalid { what: "object longer than its destination" }.into());
                }
            }
            Target::Owned(v) => {
                v.clear();
                v.reserve(len.min(GET_INITIAL_ALLOC) as usize);
            }
        }
        let cancel = self.cancel.clone();
        let aborted = self.read_data_frames(
            rid,
            len,
            Pace::AllBy(deadline),
            || cancel_point(&cancel),
            |io, pos, n| match target {
                Target::Regions(regions) => RegionParts::new(regions, pos, n).try_for_each(|(addr, part)| {
                    // SAFETY: the region is caller memory lent writable for this call (checked by
                    // check_destination); the part lies inside it.
                    unsafe { io.read_raw(addr as *mut u8, part as usize) }
                }),
                Target::Owned(v) => {
                    v.reserve(n as usize);
                    // SAFETY: reserve made room for n more bytes; read_raw writes exactly n bytes
                    // there (or fails, and then set_len is not reached).
                    unsafe {
                        io.read_raw(v.as_mut_ptr().add(v.len()), n as usize)?;
                        v.set_len(v.len() + n as usize);
                    }
                    Ok(())
                }
            },
        )?;
        Ok(match aborted {
            Some(error) => Err(error),
            None => Ok(len as usize),
        })
    }
}

impl Conn {
    /// Whether the ticket whose read runs here was cancelled.
    pub(super) fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.load(Ordering::Acquire))
    }

    /// Ends a cancelled read: the keys not answered yet report `Cancelled`, and the connection
    /// is never reused (closing it makes the owner stop and drop its leases).
    fn stop_cancelled<T>(&mut self, results: Vec<Option<Result<T>>>) -> Vec<Result<T>> {
        self.broken = true;
        results.into_iter().map(|r| r.unwrap_or(Err(StoreError::Cancelled.into()))).collect()
    }
}

/// A data frame's stop point: a cancelled read ends in the middle of an object.
fn cancel_point(cancel: &Option<Arc<AtomicBool>>) -> WResult<()> {
    match cancel {
        Some(c) if c.load(Ordering::Acquire) => Err(WireError::Closed("the read was cancelled".into())),
        _ => Ok(()),
    }
}

/// How long the `Data` frames of one object may take (`Conn::read_data_frames`).
#[derive(Clone, Copy)]
pub(super) enum Pace {
    /// All of them by this instant (the request's deadline).
    AllBy(Instant),
    /// Each within this long of the one before (a followed producer may take longer in all).
    EachWithin(Duration),
}

impl Pace {
    fn first_deadline(self) -> Instant {
        match self {
            Pace::AllBy(deadline) => deadline,
            Pace::EachWithin(each) => Instant::now() + each,
        }
    }
}

/// The one decision on a single reply frame: `op` is the expected `reply` (its payload decoded
/// by `decode`), the owner's `Error` (returned as `Ok(Err)`: the connection stays in step), or
/// anything else: a protocol error naming `expected`, which fails the connection.
pub(super) fn reply_of<T>(
    op: Op,
    payload: &[u8],
    reply: Op,
    expected: &'static str,
    decode: impl FnOnce(&[u8]) -> WResult<T>,
) -> WResult<Result<T>> {
    if op == reply {
        return decode(payload).map(Ok);
    }
    match op {
        Op::Error => Ok(Err(decode_error_frame(payload)?.1)),
        got => Err(ProtocolError::Unexpected { expected, got }.into()),
    }
}

/// Copies a granted object out of the shared arena into `target`.
pub(super) fn copy_grant(arena: &Arena, offset: u64, len: u64, target: &mut Target<'_>) -> ReadResult {
    match target {
        Target::Regions(regions) => {
            let room = total_len(regions)?;
            if len > room {
                return Err(StoreError::BufferTooSmall { object_bytes: len, buffer_bytes: room }.into());
            }
            // SAFETY: the destinations are caller memory lent writable for this call; the source
            // is leased to this connection until we release it, after this copy.
            unsafe { arena.copy_out_across(offset, len, regions)? };
            Ok((len as usize, None))
        }
        // SAFETY: as above.
        Target::Owned(_) => Ok((len as usize, Some(unsafe { arena.copy_out_vec(offset, len)? }))),
    }
}
