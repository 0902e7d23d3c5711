//! The disk I/O trait: the SSD tier describes I/O as `DiskOp`s and consumes `DiskCompletion`s;
//! an implementation executes them. Two exist: the shard's io_uring ring (in the engine) and the
//! deterministic fault-injecting simulator (`sim`), so the same engine code runs on both.

/// A segment file of one shard.
pub type FileId = u32;

/// What to do.
#[derive(Clone, Copy, Debug)]
pub enum DiskOpKind {
    /// Read `len` bytes at `offset` into `buf`.
    Read { buf: *mut u8, len: u32, offset: u64 },
    /// Write `len` bytes from `buf` at `offset`.
    Write { buf: *const u8, len: u32, offset: u64 },
    /// `fdatasync` the file: every write completed before this was submitted becomes durable.
    Sync,
}

/// One operation. `token` comes back in its completion.
#[derive(Clone, Copy, Debug)]
pub struct DiskOp {
    pub token: u64,
    pub file: FileId,
    pub kind: DiskOpKind,
}

/// The outcome: bytes transferred (may be short) or a negative errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskCompletion {
    pub token: u64,
    pub result: i64,
}

/// Executes disk operations.
pub trait DiskIo {
    /// Queues `op`. Gives it back when the queue is full (submit again after reaping).
    ///
    /// # Safety
    /// The memory `op` names must stay valid (and, for reads, untouched by anything else) until
    /// its completion has been returned by `reap`.
    unsafe fn submit(&mut self, op: DiskOp) -> Result<(), DiskOp>;
    /// Pushes finished operations to `out`. Never blocks.
    fn reap(&mut self, out: &mut Vec<DiskCompletion>);
    /// Operations submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Synchronous read, for recovery at open only.
    fn read_at(&mut self, file: FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<usize>;
    /// Number of segment files.
    fn file_count(&self) -> u32;
    /// Size of each segment file.
    fn file_bytes(&self) -> u64;
}
