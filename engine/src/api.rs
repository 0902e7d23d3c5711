//! The `Store` trait: the object API the embedded engine implements and the remote client
//! (crate `kvtide-remote`) implements too. Owns the method set and write options; never holds
//! data. Results are per key; one bad key never fails its neighbours.

use kvtide_transport::Region;

use crate::error::Error;
use crate::stats::Stats;
use crate::ticket::Ticket;

/// Options for writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Replace an existing object instead of failing with `AlreadyExists`. Readers of the old
    /// version keep their bytes until they finish.
    pub upsert: bool,
    /// Pin the object as it is published (one pin, undone by `unpin`): it is never evicted in
    /// between, as a `put` followed by `pin` could be when the rest of the pool is pinned.
    pub pin: bool,
}

impl PutOptions {
    /// Insert-only (the default).
    pub const INSERT: PutOptions = PutOptions { upsert: false, pin: false };
    /// Insert or replace.
    pub const UPSERT: PutOptions = PutOptions { upsert: true, pin: false };

    /// The same options, pinning the object as it is published.
    pub const fn pinned(self) -> PutOptions {
        PutOptions { pin: true, ..self }
    }
}

/// One byte range of an object into a destination buffer (`get_into_ranges`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fragment {
    pub key: Vec<u8>,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

impl Fragment {
    /// A fragment of `key`: `len` bytes from `src_offset` to `dst_offset` of its buffer.
    pub fn new(key: impl Into<Vec<u8>>, src_offset: u64, dst_offset: u64, len: u64) -> Fragment {
        Fragment { key: key.into(), src_offset, dst_offset, len }
    }
}

/// One page of `Store::scan_keys`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyPage {
    /// Keys of this page (possibly none, even before the end).
    pub keys: Vec<Vec<u8>>,
    /// Where the next page starts; None once the scan has seen everything.
    pub cursor: Option<u64>,
}

/// Keys one `scan_keys` page holds at most.
pub const MAX_SCAN_KEYS: usize = 4096;

/// The ticket of `Store::submit_batch_get`: one result per key, `E` being the store's error.
pub type BatchTicket<E> = Ticket<Vec<Result<usize, E>>>;

/// The object API. Blocking methods return when every byte is delivered (or failed); the
/// `submit_*` forms return a ticket at once.
///
/// `Error` is the implementation's per-key error: `kvtide::Error` for the embedded engine; a
/// remote store's error wraps it and adds the failures only a connection has.
pub trait Store: Send + Sync {
    /// Per-key and per-call failure. Every `kvtide::Error` converts into it.
    type Error: std::error::Error + From<Error> + Send + Sync + 'static;

    /// Stores `value` under `key`.
    fn put(&self, key: &[u8], value: &[u8], opts: PutOptions) -> Result<(), Self::Error> {
        self.put_from(key, &[Region::host_readonly(value)], opts)
    }
    /// Stores the concatenation of `sources` under `key` (gather).
    fn put_from(&self, key: &[u8], sources: &[Region<'_>], opts: PutOptions) -> Result<(), Self::Error> {
        let mut results = self.batch_put_from_multi_buffers(&[key], &[sources.to_vec()], opts);
        results.pop().unwrap_or_else(|| Err(Error::Internal("no result for a single put").into()))
    }
    /// Many `put_from`s in one call; one result per key.
    fn batch_put_from_multi_buffers(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
    ) -> Vec<Result<(), Self::Error>>;

    /// Reads a whole object.
    fn get(&self, key: &[u8]) -> Result<Vec<u8>, Self::Error>;
    /// Reads an object into `dst` (which must be at least as large); returns its length.
    fn get_into(&self, key: &[u8], dst: Region<'_>) -> Result<usize, Self::Error>;
    /// Object i into the start of `dsts[i]`, which may be longer (else that key fails with
    /// `BufferTooSmall`): one read of the whole batch, one result per key, the object's length.
    fn batch_get_into(&self, keys: &[&[u8]], dsts: &[Region<'_>]) -> Vec<Result<usize, Self::Error>>;
    /// Object i is scattered in order across `dsts[i]`; the lengths must add up to its size
    /// exactly, else that key fails with `SizeMismatch`.
    fn batch_get_into_multi_buffers(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>])
        -> Vec<Result<usize, Self::Error>>;
    /// Buffer-major ranges: for each buffer, fragments (key, src_offset, dst_offset, len). One
    /// result per fragment, in the same shape.
    fn get_into_ranges(
        &self,
        buffers: &[Region<'_>],
        fragments: &[Vec<Fragment>],
    ) -> Vec<Vec<Result<usize, Self::Error>>>;

    fn exists(&self, key: &[u8]) -> Result<bool, Self::Error> {
        self.batch_exists(&[key]).pop().unwrap_or_else(|| Err(Error::Internal("no result").into()))
    }
    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, Self::Error>>;
    /// Number of leading keys that are present (prefix-cache lookups). A bad key in the prefix
    /// is an error rather than a miss.
    fn prefix_hits(&self, keys: &[&[u8]]) -> Result<usize, Self::Error> {
        let mut hits = 0;
        for found in self.batch_exists(keys) {
            if !found? {
                break;
            }
            hits += 1;
        }
        Ok(hits)
    }
    /// Removes `key`; a leased or pinned object is refused unless `force`.
    fn remove(&self, key: &[u8], force: bool) -> Result<(), Self::Error>;
    /// `remove` for many keys; one result per key, in order.
    fn batch_remove(&self, keys: &[&[u8]], force: bool) -> Vec<Result<(), Self::Error>> {
        keys.iter().map(|key| self.remove(key, force)).collect()
    }
    /// One page of the keys that start with `prefix` (all keys: empty), from `cursor` (0 to
    /// start) with at most `limit` (and `MAX_SCAN_KEYS`) keys. Call again with the returned
    /// cursor until it is None. A key present and not replaced for the whole scan is returned
    /// exactly once; keys written or removed meanwhile may or may not be. Pages may be empty
    /// before the end: each looks at a bounded part of the store.
    fn scan_keys(&self, prefix: &[u8], cursor: u64, limit: usize) -> Result<KeyPage, Self::Error>;
    /// Keeps `key` from eviction until a matching `unpin`.
    fn pin(&self, key: &[u8]) -> Result<(), Self::Error>;
    fn unpin(&self, key: &[u8]) -> Result<(), Self::Error>;
    fn stats(&self) -> Stats;

    /// Non-blocking `batch_get_into_multi_buffers`. The destinations are `'static` because
    /// they are written after this returns: owned buffers, or `Region::from_raw` memory.
    fn submit_batch_get(
        &self,
        keys: &[&[u8]],
        dsts: Vec<Vec<Region<'static>>>,
    ) -> Result<BatchTicket<Self::Error>, Self::Error>;
}
