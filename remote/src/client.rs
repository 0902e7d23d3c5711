//! `RemoteStore`: the `Store` API over connections to a `kvtide-owner`, so code written
//! against the embedded engine runs unchanged against a shared one.
//!
//! This file is the store facade: it owns the `Store` calls (checking their arguments, cutting
//! batches into requests the owner accepts, putting each key's result in its place) and the
//! state a `RemoteStore` handle shares (`Inner`), and nothing below them. One room per concern
//! below it:
//! - `options.rs`: `ClientOptions` and the owner's address;
//! - `pool.rs`: the connection pool, connecting, the handshake, the retry on a fresh
//!   connection, and confirming the lease releases sent on idle connections;
//! - `conn.rs`: one connection: the request/reply exchange, the data-frame reader, streamed
//!   and leased reads;
//! - `arguments.rs`: key and region-list checks (shared with `ClusterStore`);
//! - `ticket.rs`: the ticket thread of `submit_batch_get` (shared with `ClusterStore`);
//! - `batch.rs` puts and removes, `stream.rs` chunked reads and progressive puts,
//!   `on_stream.rs` stream-bound reads, `hold.rs` holds, `gpu.rs` GPU copies.
//!
//! Gets over a Unix socket are one copy: the owner leases the object and names its offset in
//! the shared arena, the client copies it into the caller's buffer and releases the lease.
//! Elsewhere values stream in chunks straight into the caller's buffers. Every request has a
//! deadline; a connection that failed is never reused; a call that finds its pooled connection
//! dead (the owner restarted) retries once on a fresh one. It never reports a destination that
//! was only partly written as a success, and never reads or writes a frame itself (`conn.rs`
//! does).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvtide::checks::{self, total_len};
use kvtide::{Error as StoreError, Fragment, PutOptions, Stats, Store, Ticket};
use kvtide_transport::Region;

use crate::error::{Error, Result};
use crate::fast_read::{self, FastRead, FastTarget};
use crate::protocol::{
    decode_exists, decode_key_page, GetItem, LenCheck, Limits, Op, ProtocolError, RangeItem, Request,
};

mod arena;
mod arguments;
mod batch;
mod conn;
mod gpu;
mod hold;
mod index_reads;
mod on_stream;
mod options;
mod pool;
mod stream;
mod ticket;

pub(crate) use arguments::lists_per_key;
use arguments::valid_keys;
use batch::PutSource;
use conn::{Placed, ReadResult, Target};
pub use hold::HoldGranted;
pub use options::ClientOptions;
use pool::Pool;
pub use stream::RemotePutStream;
pub(crate) use ticket::{submit_batch_get, CancellableRead};

/// `RemoteStore::read_index_counts`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadIndexCounts {
    /// Reads served by the read index.
    pub read: u64,
    /// Reads looked up there and then leased.
    pub leased: u64,
}

/// How a `RemoteStore` reads the owner's bytes (`RemoteStore::data_plane`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataPlane {
    /// Copied out of the owner's arena, mapped read-only (Unix socket).
    SharedMemory,
    /// Read out of the owner's arena with one-sided UCX gets (`ClientOptions::ucx_transports`).
    Ucx,
    /// Sent by the owner over the socket.
    Socket,
}

impl DataPlane {
    pub fn name(self) -> &'static str {
        match self {
            DataPlane::SharedMemory => "shared-memory",
            DataPlane::Ucx => "ucx",
            DataPlane::Socket => "socket",
        }
    }
}

/// A store served by a `kvtide-owner` process, over a Unix socket (with shared memory) or TCP.
/// Cheap to share; every method takes `&self` and may be called from many threads.
pub struct RemoteStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore").field("endpoint", &self.inner.pool.endpoint.to_string()).finish()
    }
}

/// The state behind a `RemoteStore` handle, shared by its clones, tickets and threads.
struct Inner {
    /// The connections to the owner.
    pool: Pool,
    gpu: gpu::ClientGpu,
    /// Stream-bound reads in flight and their watch thread.
    watch: on_stream::Watch,
    tickets_in_flight: Arc<AtomicU64>,
    /// Chunk handles whose threads still run.
    streams_open: Arc<AtomicU64>,
    /// Host bytes held by stream-bound reads in flight (`max_stream_host_bytes`).
    stream_host_bytes: Arc<AtomicU64>,
    /// Leases callers keep across calls (`RemoteStore::hold`), on a connection of their own.
    holds: hold::Holds,
    /// Reads the read index served, and those it sent to the leased path.
    indexed_reads: AtomicU64,
    indexed_misses: AtomicU64,
    /// Value bytes of puts the owner read from this process's memory and accepted.
    direct_put_bytes: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.pool.report_index_reads();
    }
}

impl RemoteStore {
    /// Connects to `address`: `"unix:/path/owner.sock"` (or an absolute path) or `"host:port"`.
    /// Options come from `ClientOptions::from_env` (`KVTIDE_TOKEN_FILE` for TCP owners).
    pub fn connect(address: &str) -> Result<RemoteStore> {
        RemoteStore::connect_with(address, ClientOptions::from_env()?)
    }

    /// Connects with explicit options. One connection is made now, so a wrong address, token or
    /// protocol version is reported here.
    pub fn connect_with(address: &str, options: ClientOptions) -> Result<RemoteStore> {
        let inner = Arc::new(Inner {
            gpu: gpu::ClientGpu::new(options.gpu.clone()),
            pool: Pool::connect(address, options)?,
            watch: on_stream::Watch::default(),
            tickets_in_flight: Arc::new(AtomicU64::new(0)),
            streams_open: Arc::new(AtomicU64::new(0)),
            stream_host_bytes: Arc::new(AtomicU64::new(0)),
            holds: hold::Holds::default(),
            indexed_reads: AtomicU64::new(0),
            indexed_misses: AtomicU64::new(0),
            direct_put_bytes: AtomicU64::new(0),
        });
        Ok(RemoteStore { inner })
    }

    /// The largest value the owner stores (its engine's `max_value_bytes`).
    pub fn max_value_bytes(&self) -> Result<u64> {
        Ok(self.inner.pool.limits()?.max_value_bytes)
    }

    /// Host bytes that stream-bound reads in flight hold (TCP: the objects wait in host memory
    /// until their stream passed the copies); zero when none is in flight.
    pub fn stream_host_bytes(&self) -> u64 {
        self.inner.stream_host_bytes.load(Ordering::Acquire)
    }

    /// Reads of host memory this handle served through the owner's read index without a
    /// request, and reads it looked up there but leased (not indexed, a length the leased path
    /// must judge, or a copy that raced with a change).
    pub fn read_index_counts(&self) -> ReadIndexCounts {
        ReadIndexCounts {
            read: self.inner.indexed_reads.load(Ordering::Relaxed),
            leased: self.inner.indexed_misses.load(Ordering::Relaxed),
        }
    }

    /// Value bytes of puts the owner read straight from this process's memory (one copy) and
    /// accepted; the rest went through the put window or over the socket.
    pub fn direct_put_bytes(&self) -> u64 {
        self.inner.direct_put_bytes.load(Ordering::Relaxed)
    }

    /// True when reads may use the owner's read index (mapped, the owner alive).
    pub fn uses_read_index(&self) -> bool {
        self.inner.pool.read_index().is_some()
    }

    /// How this client's reads reach the owner's bytes, as of the last connection it opened.
    pub fn data_plane(&self) -> DataPlane {
        if self.uses_shared_memory() {
            DataPlane::SharedMemory
        } else if self.inner.pool.ucx_ready.load(Ordering::Relaxed) {
            DataPlane::Ucx
        } else {
            DataPlane::Socket
        }
    }

    /// Why this client's last connection was left on TCP though it asked for the UCX plane (the
    /// owner serves none or refused it, its answer did not check out, or UCX could not connect).
    pub fn ucx_refusal(&self) -> Option<String> {
        self.inner.pool.ucx.lock().unwrap_or_else(|p| p.into_inner()).last_refusal.clone()
    }

    /// True when gets copy straight from the owner's shared memory.
    pub fn uses_shared_memory(&self) -> bool {
        self.inner.pool.mapping.read().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// The owner's statistics, or the error that prevented reading them (`Store::stats` returns
    /// empty statistics instead).
    pub fn try_stats(&self) -> Result<Stats> {
        // Statistics that do not parse fail the call, not the connection.
        let parse = |payload: &[u8]| {
            std::str::from_utf8(payload)
                .map_err(|_| Error::Protocol("stats are not UTF-8".into()))
                .and_then(|text| toml::from_str::<Stats>(text).map_err(|e| Error::Protocol(format!("stats: {e}"))))
        };
        let mut stats = self.inner.pool.call("stats", |conn, rid| {
            let reply = conn.request(rid, &Request::Stats, Op::StatsReply, "stats", |_, payload| Ok(parse(payload)))?;
            Ok(reply.and_then(|parsed| parsed))
        })?;
        stats.tickets_in_flight += self.inner.tickets_in_flight.load(Ordering::Relaxed);
        Ok(stats)
    }
}

impl Inner {
    /// Makes sure the owner applied every lease release this client sent up to `through`
    /// (`Releases::last_sent` before a request): the hold connection's, and those of the
    /// pooled connections (`Pool::confirm_idle_releases`). A read's release travels without a
    /// reply, so a `remove` right after a `get`, sent on another pooled connection, could
    /// otherwise find the object still leased by this very client. False when no release was
    /// sent before `through`.
    fn confirm_releases(&self, through: u64) -> bool {
        if through == 0 {
            return false;
        }
        // The hold connection is never pooled: confirm its releases here.
        self.holds.confirm(self);
        self.pool.confirm_idle_releases(through);
        true
    }

    // ---- reads ---------------------------------------------------------------------------------

    /// A batch read of object i into `dsts[i]` (one list per key, checked by the caller), each
    /// object's length checked as `check` of its list says: one result per key, a bad key or
    /// destination failing only itself.
    fn read_batch(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        check: impl Fn(&[Region<'_>]) -> std::result::Result<LenCheck, StoreError>,
        cancel: Option<&Arc<AtomicBool>>,
    ) -> Vec<Result<usize>> {
        let limits = match self.pool.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<usize>> =
            (0..keys.len()).map(|_| Err(StoreError::Internal("unset").into())).collect();
        let mut valid = Vec::new();
        let mut items = Vec::new();
        let lists: Vec<&[Region<'_>]> = dsts.iter().map(Vec::as_slice).collect();
        let mut dst_checks = self.check_destination_lists(&lists).into_iter();
        for (i, (key, regions)) in keys.iter().zip(dsts).enumerate() {
            let dst_check = dst_checks.next().unwrap_or(Ok(()));
            let checked = self.validate_key(&limits, key).and(dst_check).and_then(|()| Ok(check(regions)?));
            match checked {
                Ok(check) => {
                    valid.push(i);
                    items.push((*key, check, Target::Regions(regions.clone())));
                }
                Err(e) => results[i] = Err(e),
            }
        }
        for (i, r) in valid.into_iter().zip(self.read_objects(items, cancel)) {
            results[i] = r.map(|(n, _)| n);
        }
        results
    }

    /// Reads `items` (key, check, target); results in the same order. Those the owner's read
    /// index has are copied without a request; the rest are asked for in batches.
    fn read_objects<'a>(
        &self,
        items: Vec<(&[u8], LenCheck, Target<'a>)>,
        cancel: Option<&Arc<AtomicBool>>,
    ) -> Vec<ReadResult> {
        let mut results: Vec<Option<ReadResult>> = (0..items.len()).map(|_| None).collect();
        let mut items: Vec<_> = items.into_iter().map(Some).collect();
        self.read_indexed(&mut items, &mut results);
        let left: Vec<usize> = (0..items.len()).filter(|&i| items[i].is_some()).collect();
        if !left.is_empty() {
            let limits = match self.pool.limits() {
                Ok(l) => l,
                Err(e) => return results.into_iter().map(|r| r.unwrap_or_else(|| Err(e.clone()))).collect(),
            };
            let max_items = self.pool.max_batch(&limits);
            let key_lens: Vec<usize> = left.iter().map(|&i| items[i].as_ref().map_or(0, |item| item.0.len())).collect();
            for (start, end) in batches(&key_lens, 11, max_items, &limits) {
                let slots = &left[start..end];
                if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
                    slots.iter().for_each(|&i| results[i] = Some(Err(StoreError::Cancelled.into())));
                    continue;
                }
                let mut batch: Vec<(&[u8], LenCheck, Target<'a>)> =
                    slots.iter().filter_map(|&i| items[i].take()).collect();
                let outcome = self.pool.call("get", |conn, rid| {
                    conn.cancel = cancel.cloned();
                    let read = conn.get_batch(rid, &mut batch, self.pool.timeout(), &self.gpu);
                    conn.cancel = None;
                    read
                });
                match outcome {
                    Ok(per_key) => slots.iter().zip(per_key).for_each(|(&i, r)| results[i] = Some(r)),
                    Err(e) => slots.iter().for_each(|&i| results[i] = Some(Err(e.clone()))),
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(StoreError::Internal("key result never reported").into())))
            .collect()
    }

    /// Reads what it can of `items` through the owner's read index into host targets, taking
    /// those items out and filling their results; the others stay for the leased path.
    fn read_indexed<'a>(
        &self,
        items: &mut [Option<(&[u8], LenCheck, Target<'a>)>],
        results: &mut [Option<ReadResult>],
    ) {
        let Some(arena) = self.pool.read_index() else { return };
        let Some(index) = arena.read_index() else { return };
        let mut read_entries = Vec::new();
        for (item, result) in items.iter_mut().zip(results.iter_mut()) {
            let Some((key, check, target)) = item else { continue };
            let target = match target {
                Target::Regions(regions) if !gpu::names_device(regions) => FastTarget::Regions(regions),
                Target::Regions(_) => continue,
                Target::Owned(_) => FastTarget::Owned,
            };
            match fast_read::read(&arena, index, key, *check, target) {
                FastRead::Read { len, owned, entry } => {
                    self.indexed_reads.fetch_add(1, Ordering::Relaxed);
                    read_entries.push(entry);
                    *result = Some(Ok((len, owned)));
                    *item = None;
                }
                FastRead::Lease => {
                    self.indexed_misses.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.pool.note_index_reads(&read_entries);
    }
}

/// Splits items (by key length) into runs that fit one request: at most `max_items`, and a
/// payload of at most the owner's limit (`per_item` bytes of each item besides its key).
fn batches(key_lens: &[usize], per_item: usize, max_items: usize, limits: &Limits) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < key_lens.len() {
        let mut end = start;
        let mut bytes = 16usize;
        while end < key_lens.len() && end - start < max_items {
            let item = key_lens[end] + per_item;
            if end > start && bytes + item > limits.max_payload_bytes as usize {
                break;
            }
            bytes += item;
            end += 1;
        }
        out.push((start, end));
        start = end;
    }
    out
}

impl RemoteStore {
    /// Removes in batches of what one request carries; one result per key.
    fn remove_in_batches(&self, keys: &[&[u8]], force: bool) -> Vec<Result<()>> {
        let limits = match self.inner.pool.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<()>> = (0..keys.len()).map(|_| Ok(())).collect();
        let valid = valid_keys(&limits, keys, &mut results);
        let key_lens: Vec<usize> = valid.iter().map(|&i| keys[i].len()).collect();
        let max_items = (limits.max_items as usize).min(8192);
        for (start, end) in batches(&key_lens, batch::REMOVE_ITEM_OVERHEAD, max_items, &limits) {
            let chunk = &valid[start..end];
            let batch: Vec<&[u8]> = chunk.iter().map(|&i| keys[i]).collect();
            match self.inner.pool.call("remove", |conn, rid| conn.remove_batch(rid, &batch, force)) {
                Ok(statuses) => chunk.iter().zip(statuses).for_each(|(&i, r)| results[i] = r),
                Err(e) => chunk.iter().for_each(|&i| results[i] = Err(e.clone())),
            }
        }
        results
    }
}

impl Store for RemoteStore {
    type Error = Error;

    fn batch_put_from_multi_buffers(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
    ) -> Vec<Result<()>> {
        if let Err(refused) = lists_per_key(keys.len(), sources.len(), "source") {
            return refused;
        }
        let limits = match self.inner.pool.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<()>> = (0..keys.len()).map(|_| Ok(())).collect();
        let mut valid = Vec::with_capacity(keys.len());
        let mut items = Vec::with_capacity(keys.len());
        let lists: Vec<&[Region<'_>]> = sources.iter().map(Vec::as_slice).collect();
        let mut source_checks = self.inner.check_source_lists(&lists).into_iter();
        for (i, (key, srcs)) in keys.iter().zip(sources).enumerate() {
            let source_check = source_checks.next().unwrap_or(Ok(()));
            let checked = self.inner.validate_key(&limits, key).and_then(|()| {
                source_check?;
                let total = total_len(srcs)?;
                if total > limits.max_value_bytes {
                    return Err(StoreError::TooLarge { what: "value", len: total, max: limits.max_value_bytes }.into());
                }
                Ok(total)
            });
            match checked {
                Ok(len) => {
                    valid.push(i);
                    items.push(PutSource { key, sources: srcs, len });
                }
                Err(e) => results[i] = Err(e),
            }
        }
        if items.is_empty() {
            return results;
        }
        let inner = &self.inner;
        match inner.pool.call("put", |conn, _| conn.put_batch(inner, &items, opts)) {
            Ok(statuses) => valid.into_iter().zip(statuses).for_each(|(i, r)| results[i] = r),
            Err(e) => valid.into_iter().for_each(|i| results[i] = Err(e.clone())),
        }
        results
    }

    fn batch_remove(&self, keys: &[&[u8]], force: bool) -> Vec<Result<()>> {
        let released_before = self.inner.pool.releases.last_sent();
        let mut results = self.remove_in_batches(keys, force);
        // Keys leased perhaps only by this client's own reads whose releases are on their way.
        let leased: Vec<usize> =
            (0..keys.len()).filter(|&i| results[i].as_ref().is_err_and(|e| *e == StoreError::Leased)).collect();
        if !force && !leased.is_empty() && self.inner.confirm_releases(released_before) {
            let again: Vec<&[u8]> = leased.iter().map(|&i| keys[i]).collect();
            for (i, r) in leased.into_iter().zip(self.remove_in_batches(&again, force)) {
                results[i] = r;
            }
        }
        results
    }

    fn get(&self, key: &[u8]) -> Result<Vec<u8>> {
        let limits = self.inner.pool.limits()?;
        self.inner.validate_key(&limits, key)?;
        let mut r = self.inner.read_objects(vec![(key, LenCheck::Any, Target::Owned(Vec::new()))], None);
        let (_, owned) = r.pop().unwrap_or(Err(StoreError::Internal("no result").into()))?;
        owned.ok_or(StoreError::Internal("no value").into())
    }

    fn get_into(&self, key: &[u8], dst: Region<'_>) -> Result<usize> {
        let limits = self.inner.pool.limits()?;
        self.inner.validate_key(&limits, key)?;
        self.inner.check_destinations(std::slice::from_ref(&dst))?;
        let check = LenCheck::AtMost(dst.len() as u64);
        let mut r = self.inner.read_objects(vec![(key, check, Target::Regions(vec![dst]))], None);
        r.pop().unwrap_or(Err(StoreError::Internal("no result").into())).map(|(n, _)| n)
    }

    fn batch_get_into(&self, keys: &[&[u8]], dsts: &[Region<'_>]) -> Vec<Result<usize>> {
        if let Err(refused) = lists_per_key(keys.len(), dsts.len(), "destination") {
            return refused;
        }
        let lists: Vec<Vec<Region<'_>>> = dsts.iter().map(|d| vec![*d]).collect();
        self.inner.read_batch(keys, &lists, |regions| Ok(LenCheck::AtMost(total_len(regions)?)), None)
    }

    fn batch_get_into_multi_buffers(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>]) -> Vec<Result<usize>> {
        self.batch_get_cancellable(keys, dsts, None)
    }

    fn get_into_ranges(&self, buffers: &[Region<'_>], fragments: &[Vec<Fragment>]) -> Vec<Vec<Result<usize>>> {
        let mut results: Vec<Vec<Result<usize>>> = fragments
            .iter()
            .map(|f| (0..f.len()).map(|_| Err(StoreError::Internal("unset").into())).collect())
            .collect();
        let limits = match self.inner.pool.limits() {
            Ok(l) => l,
            Err(e) => return fragments.iter().map(|f| vec![Err(e.clone()); f.len()]).collect(),
        };
        let todo = checks::checked_fragments(
            buffers,
            fragments,
            &mut results,
            |_, buffer| self.inner.check_destinations(std::slice::from_ref(buffer)),
            |key| self.inner.validate_key(&limits, key),
        );
        let shm = self.uses_shared_memory();
        let todo = if shm { self.ranges_indexed(buffers, fragments, todo, &mut results) } else { todo };
        let leased = shm || self.data_plane() == DataPlane::Ucx;
        let max_items = self.inner.pool.max_batch(&limits);
        for chunk in todo.chunks(max_items) {
            let outcome = if leased {
                // None: the call's connection reads neither the arena nor the plane (its attach
                // was refused meanwhile): the bytes come over the stream.
                self.ranges_via_leases(buffers, fragments, chunk)
                    .unwrap_or_else(|| self.ranges_via_stream(buffers, fragments, chunk, &limits))
            } else {
                self.ranges_via_stream(buffers, fragments, chunk, &limits)
            };
            for (&(b, f), r) in chunk.iter().zip(outcome) {
                results[b][f] = r;
            }
        }
        results
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool>> {
        let limits = match self.inner.pool.limits() {
            Ok(l) => l,
            Err(e) => return vec![Err(e); keys.len()],
        };
        let mut results: Vec<Result<bool>> = vec![Ok(false); keys.len()];
        let valid = valid_keys(&limits, keys, &mut results);
        let key_lens: Vec<usize> = valid.iter().map(|&i| keys[i].len()).collect();
        for (start, end) in batches(&key_lens, 2, (limits.max_items as usize).min(8192), &limits) {
            let chunk = &valid[start..end];
            let batch: Vec<&[u8]> = chunk.iter().map(|&i| keys[i]).collect();
            let request = Request::Exists { keys: batch };
            let outcome = self.inner.pool.call("exists", |conn, rid| {
                conn.request(rid, &request, Op::ExistsReply, "exists results", |conn, payload| {
                    let found = decode_exists(payload, conn.limits.max_items)?;
                    if found.len() != chunk.len() {
                        return Err(ProtocolError::Invalid { what: "exists result count" }.into());
                    }
                    Ok(found)
                })
            });
            match outcome {
                Ok(found) => chunk.iter().zip(found).for_each(|(&i, f)| results[i] = f),
                Err(e) => chunk.iter().for_each(|&i| results[i] = Err(e.clone())),
            }
        }
        results
    }

    fn remove(&self, key: &[u8], force: bool) -> Result<()> {
        self.simple("remove", Request::Remove { key, force })
    }

    fn scan_keys(&self, prefix: &[u8], cursor: u64, limit: usize) -> Result<kvtide::KeyPage> {
        let limits = self.inner.pool.limits()?;
        if prefix.len() > limits.max_key_bytes as usize {
            let max = u64::from(limits.max_key_bytes);
            return Err(StoreError::TooLarge { what: "prefix", len: prefix.len() as u64, max }.into());
        }
        let limit = limit.clamp(1, kvtide::MAX_SCAN_KEYS.min(limits.max_items as usize)) as u32;
        let request = Request::ScanKeys { prefix, cursor, limit };
        self.inner.pool.call("scan_keys", |conn, rid| {
            conn.request(rid, &request, Op::KeyPage, "a key page", |conn, payload| {
                let page = decode_key_page(payload, &conn.limits)?;
                if page.keys.len() > limit as usize || page.keys.iter().any(|k| !k.starts_with(prefix)) {
                    return Err(ProtocolError::Invalid { what: "key page" }.into());
                }
                Ok(page)
            })
        })
    }

    fn pin(&self, key: &[u8]) -> Result<()> {
        self.simple("pin", Request::Pin { key })
    }

    fn unpin(&self, key: &[u8]) -> Result<()> {
        self.simple("unpin", Request::Unpin { key })
    }

    fn stats(&self) -> Stats {
        self.try_stats().unwrap_or_default()
    }

    fn submit_batch_get(&self, keys: &[&[u8]], dsts: Vec<Vec<Region<'static>>>) -> Result<Ticket<Vec<Result<usize>>>> {
        let store = RemoteStore { inner: Arc::clone(&self.inner) };
        let limit = self.inner.pool.options.max_tickets_in_flight;
        submit_batch_get(store, &self.inner.tickets_in_flight, limit, "kvtide-remote-ticket", keys, dsts)
    }
}

impl CancellableRead for RemoteStore {
    fn batch_get_cancellable(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        cancel: Option<&Arc<AtomicBool>>,
    ) -> Vec<Result<usize>> {
        if let Err(refused) = lists_per_key(keys.len(), dsts.len(), "destination") {
            return refused;
        }
        self.inner.read_batch(keys, dsts, |regions| Ok(LenCheck::Exactly(total_len(regions)?)), cancel)
    }
}

impl RemoteStore {
    fn simple(&self, op: &'static str, request: Request<'_>) -> Result<()> {
        let limits = self.inner.pool.limits()?;
        let key = match &request {
            Request::Remove { key, .. } | Request::Pin { key } | Request::Unpin { key } => *key,
            _ => return Err(StoreError::Internal("not a single-key request").into()),
        };
        self.inner.validate_key(&limits, key)?;
        let send = || self.inner.pool.call(op, |conn, rid| conn.request_status(rid, &request));
        let released_before = self.inner.pool.releases.last_sent();
        let result = send();
        // Leased perhaps only by this client's own read whose release is still on its way.
        if matches!(request, Request::Remove { force: false, .. })
            && result.as_ref().is_err_and(|e| *e == StoreError::Leased)
            && self.inner.confirm_releases(released_before)
        {
            return send();
        }
        result
    }

    /// Ranges through the owner's read index: each key's host fragments copied together, proven
    /// the object's by one check after them. Returns the fragments left to lease.
    fn ranges_indexed(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        todo: Vec<(usize, usize)>,
        results: &mut [Vec<Result<usize>>],
    ) -> Vec<(usize, usize)> {
        let Some(arena) = self.inner.pool.read_index() else { return todo };
        let Some(index) = arena.read_index() else { return todo };
        let mut order: Vec<&[u8]> = Vec::new();
        let mut of_key: std::collections::HashMap<&[u8], Vec<(usize, usize)>> = std::collections::HashMap::new();
        for &(b, f) in &todo {
            let key = fragments[b][f].key.as_slice();
            of_key
                .entry(key)
                .or_insert_with(|| {
                    order.push(key);
                    Vec::new()
                })
                .push((b, f));
        }
        let mut left = Vec::new();
        let mut read_entries = Vec::new();
        for key in order {
            let frags = of_key.remove(key).unwrap_or_default();
            let copies: Option<Vec<(u64, u64, Region<'_>)>> = frags
                .iter()
                .map(|&(b, f)| {
                    let frag = &fragments[b][f];
                    let dst = buffers[b].slice(frag.dst_offset, frag.len).ok()?;
                    (!gpu::names_device(std::slice::from_ref(&dst))).then_some((frag.src_offset, frag.len, dst))
                })
                .collect();
            let read = copies.and_then(|copies| {
                match fast_read::read(&arena, index, key, LenCheck::Any, FastTarget::Fragments(&copies)) {
                    FastRead::Read { entry, .. } => Some(entry),
                    FastRead::Lease => None,
                }
            });
            if let Some(entry) = read {
                read_entries.push(entry);
                self.inner.indexed_reads.fetch_add(1, Ordering::Relaxed);
                frags.iter().for_each(|&(b, f)| results[b][f] = Ok(fragments[b][f].len as usize));
            } else {
                self.inner.indexed_misses.fetch_add(1, Ordering::Relaxed);
                left.extend(frags);
            }
        }
        self.inner.pool.note_index_reads(&read_entries);
        left
    }

    /// Ranges over shared memory: lease each key once, copy each fragment out of the arena.
    fn ranges_via_leases(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        chunk: &[(usize, usize)],
    ) -> Option<Vec<Result<usize>>> {
        let mut keys: Vec<&[u8]> = Vec::new();
        let mut key_of = Vec::with_capacity(chunk.len());
        let mut index = std::collections::HashMap::new();
        for &(b, f) in chunk {
            let key = fragments[b][f].key.as_slice();
            let k = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                keys.len() - 1
            });
            key_of.push(k);
        }
        // The fragments of each key, by their place in `chunk`.
        let mut frags_of: Vec<Vec<usize>> = vec![Vec::new(); keys.len()];
        for (n, &k) in key_of.iter().enumerate() {
            frags_of[k].push(n);
        }
        let outcome = self.inner.pool.call("get_into_ranges", |conn, rid| {
            if conn.arena().is_none() {
                return Ok(Ok(None));
            }
            // Leased in parts, as batch gets are, so SSD-heavy ranges stream through DRAM.
            let items = keys.iter().map(|key| GetItem { key, check: LenCheck::Any }).collect();
            let parts = conn.get_in_parts(rid, items, chunk.len(), &self.inner.gpu, |k, grant, arena| {
                frags_of[k]
                    .iter()
                    .map(|&n| {
                        let (b, f) = chunk[n];
                        let frag = &fragments[b][f];
                        let placed = grant.clone().and_then(|g| {
                            kvtide_transport::region::check_range("object", frag.src_offset, frag.len, g.len)?;
                            let dst = buffers[b].slice(frag.dst_offset, frag.len)?;
                            let src = g.offset + frag.src_offset;
                            if gpu::names_device(std::slice::from_ref(&dst)) {
                                // SAFETY: leased until the part is released; the device buffer
                                // was checked by check_destinations.
                                let copy = unsafe { arena.to_device(&self.inner.gpu, src, frag.len, &[dst]) }?;
                                return Ok((frag.len as usize, copy));
                            }
                            // SAFETY: dst is a checked slice of a caller buffer lent writable for
                            // this call; the source is leased to this connection until the part
                            // is released.
                            unsafe { arena.copy_out(src, frag.len, dst.addr() as *mut u8)? };
                            Ok((frag.len as usize, None))
                        });
                        Placed::of(n, placed)
                    })
                    .collect()
            });
            parts.map(|answer| answer.map(Some))
        });
        match outcome {
            Ok(r) => r,
            Err(e) => Some(vec![Err(e); chunk.len()]),
        }
    }

    /// Ranges over a stream: the owner sends each fragment's bytes.
    fn ranges_via_stream(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
        chunk: &[(usize, usize)],
        limits: &Limits,
    ) -> Vec<Result<usize>> {
        let mut keys: Vec<&[u8]> = Vec::new();
        let mut index = std::collections::HashMap::new();
        let mut items = Vec::with_capacity(chunk.len());
        let mut payload_bytes = 8usize;
        for &(b, f) in chunk {
            let frag = &fragments[b][f];
            let key = frag.key.as_slice();
            let k = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                payload_bytes += key.len() + 2;
                keys.len() - 1
            });
            payload_bytes += 20;
            items.push(RangeItem { key_index: k as u32, src_offset: frag.src_offset, len: frag.len });
        }
        if payload_bytes > limits.max_payload_bytes as usize {
            // Too big for one frame: split in halves.
            let (a, b) = chunk.split_at(chunk.len() / 2);
            if a.is_empty() {
                return vec![
                    Err(StoreError::TooLarge {
                        what: "fragment",
                        len: payload_bytes as u64,
                        max: limits.max_payload_bytes.into()
                    }
                    .into());
                    chunk.len()
                ];
            }
            let mut out = self.ranges_via_stream(buffers, fragments, a, limits);
            out.extend(self.ranges_via_stream(buffers, fragments, b, limits));
            return out;
        }
        let timeout = self.inner.pool.timeout();
        let outcome = self.inner.pool.call("get_into_ranges", |conn, rid| {
            conn.push(rid, &Request::GetRanges { keys: keys.clone(), fragments: items.clone() });
            let sent = Instant::now();
            conn.io.flush()?;
            let mut targets: Vec<Target<'_>> = Vec::with_capacity(chunk.len());
            for &(b, f) in chunk {
                let frag = &fragments[b][f];
                match buffers[b].slice(frag.dst_offset, frag.len) {
                    Ok(dst) => targets.push(Target::Regions(vec![dst])),
                    // Checked before; an empty target makes a mismatch a protocol error.
                    Err(_) => targets.push(Target::Regions(Vec::new())),
                }
            }
            let mut refs: Vec<&mut Target<'_>> = targets.iter_mut().collect();
            conn.read_stream(rid, &mut refs, sent + timeout, &self.inner.gpu)
        });
        match outcome {
            Ok(r) => r,
            Err(e) => vec![Err(e); chunk.len()],
        }
    }
}
