//! The `Store` trait: the object API the embedded engine implements now and the remote client
//! implements later. Results are per key; one bad key never fails its neighbours.

use kvtide_transport::Region;

use crate::error::Result;
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

/// The object API. Blocking methods return when every byte is delivered (or failed); the
/// `submit_*` forms return a ticket at once.
pub trait Store: Send + Sync {
    /// Stores `value` under `key`.
    fn put(&self, key: &[u8], value: &[u8], opts: PutOptions) -> Result<()> {
        self.put_from(key, &[Region::host_readonly(value)], opts)
    }
    /// Stores the concatenation of `sources` under `key` (gather).
    fn put_from(&self, key: &[u8], sources: &[Region<'_>], opts: PutOptions) -> Result<()> {
        let mut results = self.batch_put_from_multi_buffers(&[key], &[sources.to_vec()], opts);
        results.pop().unwrap_or(Err(crate::error::Error::Internal("no result for a single put")))
    }
    /// Many `put_from`s in one call; one result per key.
    fn batch_put_from_multi_buffers(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
    ) -> Vec<Result<()>>;

    /// Reads a whole object.
    fn get(&self, key: &[u8]) -> Result<Vec<u8>>;
    /// Reads an object into `dst` (which must be at least as large); returns its length.
    fn get_into(&self, key: &[u8], dst: Region<'_>) -> Result<usize>;
    /// Object i is scattered in order across `dsts[i]`; the lengths must add up to its size
    /// exactly, else that key fails with `SizeMismatch`.
    fn batch_get_into_multi_buffers(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>]) -> Vec<Result<usize>>;
    /// Buffer-major ranges: for each buffer, fragments (key, src_offset, dst_offset, len). One
    /// result per fragment, in the same shape.
    fn get_into_ranges(&self, buffers: &[Region<'_>], fragments: &[Vec<Fragment>]) -> Vec<Vec<Result<usize>>>;

    fn exists(&self, key: &[u8]) -> Result<bool> {
        self.batch_exists(&[key]).pop().unwrap_or(Err(crate::error::Error::Internal("no result")))
    }
    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool>>;
    /// Number of leading keys that are present (prefix-cache lookups). A bad key in the prefix
    /// is an error rather than a miss.
    fn prefix_hits(&self, keys: &[&[u8]]) -> Result<usize> {
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
    fn remove(&self, key: &[u8], force: bool) -> Result<()>;
    /// Keeps `key` from eviction until a matching `unpin`.
    fn pin(&self, key: &[u8]) -> Result<()>;
    fn unpin(&self, key: &[u8]) -> Result<()>;
    fn stats(&self) -> Stats;

    /// Non-blocking `batch_get_into_multi_buffers`. The destinations are `'static` because
    /// they are written after this returns: owned buffers, or `Region::from_raw` memory.
    fn submit_batch_get(&self, keys: &[&[u8]], dsts: Vec<Vec<Region<'static>>>) -> Result<Ticket<Vec<Result<usize>>>>;
}
