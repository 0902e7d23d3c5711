//! Same-host reads without a round trip: the client's mapping of its owner's read index, its
//! watch on the owner's life, and the read itself.
//!
//! Owns `IndexMapping` (the read index mapped read-only, checked once by `ReadIndexView`),
//! `OwnerWatch` (a pidfd of the owner process: an index whose owner died is never used, since
//! a new owner may have changed what its keys hold), and `read`: look a key up, copy its bytes out
//! of the arena mapping, and keep the copy only if the index entry did not move meanwhile. Never
//! sends anything to the owner, never trusts a range it did not check against the arena mapping,
//! and never reports a copy that raced with a change: that read returns `None` and the caller
//! leases the key as it would without the index.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use kvtide_tiers::dram::read_index::{KeyDigest, ReadIndexView};
use kvtide_transport::Region;

use crate::protocol::LenCheck;
use crate::shm::ShmMapping;

/// How long a check that the owner lives is trusted. An owner that died is replaced by a new
/// process that must start, open its store and take a write before any key can hold something
/// newer than the dead owner's index says: far longer than this.
const OWNER_CHECK_NS: u64 = 1_000_000;

/// Seals the read index must carry before it is mapped: its size is fixed, so the owner cannot
/// shrink it under the mapping (a read past the end would kill the client with `SIGBUS`).
const INDEX_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Whether the owner process that shares an index still lives, checked at most every
/// `OWNER_CHECK_NS` (a `poll` of its pidfd: readable once it exited).
#[derive(Debug)]
pub(crate) struct OwnerWatch {
    pidfd: OwnedFd,
    epoch: Instant,
    checked_ns: AtomicU64,
    dead: AtomicBool,
}

impl OwnerWatch {
    /// A watch on process `pid` (the peer of the connection the index came on; the caller then
    /// proves with a reply on that connection that the pid was still the owner's).
    pub(crate) fn of_pid(pid: libc::pid_t) -> io::Result<OwnerWatch> {
        if pid <= 0 {
            return Err(io::Error::other("the owner's process id is not visible here"));
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(OwnerWatch { pidfd, epoch: Instant::now(), checked_ns: AtomicU64::new(0), dead: AtomicBool::new(false) })
    }

    pub(crate) fn alive(&self) -> bool {
        if self.dead.load(Ordering::Relaxed) {
            return false;
        }
        let now = self.epoch.elapsed().as_nanos() as u64 + OWNER_CHECK_NS;
        if now.saturating_sub(self.checked_ns.load(Ordering::Relaxed)) < OWNER_CHECK_NS {
            return true;
        }
        let mut pfd = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd of a descriptor we own; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
        if ready != 0 {
            // Exited (readable), or the descriptor failed: either way, stop trusting the index.
            self.dead.store(true, Ordering::Relaxed);
            return false;
        }
        self.checked_ns.store(now, Ordering::Relaxed);
        true
    }
}

/// The owner's read index mapped read-only in this process.
#[derive(Debug)]
pub(crate) struct IndexMapping {
    base: NonNull<u8>,
    len: usize,
    view: ReadIndexView,
    owner: OwnerWatch,
    /// Shards of the owner's engine (the index's regions).
    shards: usize,
}

// SAFETY: a read-only mapping only read through the view's atomics; it lives until drop.
unsafe impl Send for IndexMapping {}
// SAFETY: as above.
unsafe impl Sync for IndexMapping {}

impl IndexMapping {
    /// Maps `len` bytes of `fd` (sealed against shrinking) read-only and checks them as a read
    /// index over an arena of `arena_bytes`.
    pub(crate) fn map(fd: OwnedFd, len: u64, arena_bytes: u64, owner: OwnerWatch) -> io::Result<IndexMapping> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("read index larger than the address space"))?;
        // SAFETY: fcntl reads the seals of a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & INDEX_SEALS != INDEX_SEALS {
            return Err(io::Error::other("the read index is not sealed against resizing"));
        }
        // SAFETY: stat is plain data; fstat fills it for a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as u64) < len as u64 {
            return Err(io::Error::other("the read index descriptor is shorter than announced"));
        }
        // SAFETY: a new read-only shared mapping of a descriptor we own, at an address the kernel
        // picks.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        // SAFETY: the mapping made above, page-aligned, kept until this value drops.
        match unsafe { ReadIndexView::new(base, len, arena_bytes) } {
            Ok(view) => {
                let shards = view.geometry().shards;
                Ok(IndexMapping { base, len, view, owner, shards })
            }
            Err(e) => {
                // SAFETY: the mapping made above, never used.
                unsafe { libc::munmap(base.as_ptr().cast(), len) };
                Err(io::Error::other(e.to_string()))
            }
        }
    }

    /// The view, while the owner lives.
    fn view(&self) -> Option<&ReadIndexView> {
        self.owner.alive().then_some(&self.view)
    }
}

impl Drop for IndexMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`; the view is dropped with it and nothing else holds it.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// What a fast read did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FastRead {
    /// The object's `len` bytes are in the target, proven the object's.
    Read { len: usize, owned: Option<Vec<u8>> },
    /// Not done (not indexed, the length check failed, the copy raced with a change, or the
    /// owner is gone): lease it. Nothing the target holds may be trusted.
    Lease,
}

/// Where a fast read puts the object.
pub(crate) enum FastTarget<'t, 'a> {
    /// In order across these host regions.
    Regions(&'t [Region<'a>]),
    /// A new vector.
    Owned,
    /// These `(object offset, length, destination)` fragments.
    Fragments(&'t [(u64, u64, Region<'a>)]),
}

/// Reads `key` through the read index into `target` if the object is indexed, passes `check`,
/// and the index entry is unchanged after the copy.
pub(crate) fn read(
    arena: &ShmMapping,
    index: &IndexMapping,
    key: &[u8],
    check: LenCheck,
    target: FastTarget<'_, '_>,
) -> FastRead {
    let Some(view) = index.view() else { return FastRead::Lease };
    let shard = kvtide::shard_of_key(key, index.shards);
    let Some(found) = view.find(shard, &KeyDigest::of(key)) else { return FastRead::Lease };
    let len = found.len;
    let fits = match check {
        LenCheck::Any => true,
        LenCheck::AtMost(n) => len <= n,
        LenCheck::Exactly(n) => len == n,
    };
    // A mismatch is answered by the leased path, which says why.
    if !fits || found.offset.checked_add(len).is_none_or(|end| end > arena.len()) {
        return FastRead::Lease;
    }
    let owned = match target {
        FastTarget::Regions(regions) => {
            let mut pos = 0;
            for r in regions {
                if pos == len {
                    break;
                }
                let take = (r.len() as u64).min(len - pos);
                // SAFETY: the range lies in the mapping (checked above); the destination is caller
                // memory lent writable for this call. The bytes may change under the copy; the
                // check below then discards them.
                if unsafe { arena.copy_out(found.offset + pos, take, r.addr() as *mut u8) }.is_err() {
                    return FastRead::Lease;
                }
                pos += take;
            }
            if pos != len {
                return FastRead::Lease;
            }
            None
        }
        FastTarget::Owned => {
            let Ok(n) = usize::try_from(len) else { return FastRead::Lease };
            let mut v = Vec::<u8>::with_capacity(n);
            // SAFETY: v has room for len bytes; copy_out writes exactly those or fails before
            // writing (then set_len is not reached). A raced copy is discarded below.
            unsafe {
                if arena.copy_out(found.offset, len, v.as_mut_ptr()).is_err() {
                    return FastRead::Lease;
                }
                v.set_len(n);
            }
            Some(v)
        }
        FastTarget::Fragments(fragments) => {
            for (src, n, dst) in fragments {
                if src.checked_add(*n).is_none_or(|end| end > len) || dst.len() as u64 != *n {
                    return FastRead::Lease;
                }
                // SAFETY: within the object, so within the checked range; the destination is
                // caller memory of `n` bytes lent writable. A raced copy is discarded below.
                if unsafe { arena.copy_out(found.offset + src, *n, dst.addr() as *mut u8) }.is_err() {
                    return FastRead::Lease;
                }
            }
            None
        }
    };
    if !view.unchanged(&found) {
        return FastRead::Lease;
    }
    FastRead::Read { len: len as usize, owned }
}

/// The client's read path over index and arena bytes given whole, for the fuzz target: both are
/// put in sealed memfds and mapped as a client maps them, and `key` read (into a vector, and into
/// two regions). What a read returns, or None when it went to the leased path.
#[doc(hidden)]
pub fn read_through(index: &[u8], arena: &[u8], key: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let arena_fd = sealed_memfd(arena)?;
    let arena_map = ShmMapping::map(arena_fd, arena.len() as u64, 1)?;
    let index_fd = sealed_memfd(index)?;
    // SAFETY: getpid has no inputs; this process watches itself, alive throughout.
    let watch = OwnerWatch::of_pid(unsafe { libc::getpid() })?;
    let mapping = match IndexMapping::map(index_fd, index.len() as u64, arena.len() as u64, watch) {
        Ok(m) => m,
        Err(_) => return Ok(None),
    };
    let owned = match read(&arena_map, &mapping, key, LenCheck::Any, FastTarget::Owned) {
        FastRead::Read { owned, .. } => owned,
        FastRead::Lease => None,
    };
    let mut a = vec![0u8; arena.len() / 2 + 1];
    let mut b = vec![0u8; arena.len()];
    let regions = [Region::host(&mut a), Region::host(&mut b)];
    if let (FastRead::Read { len, .. }, Some(v)) =
        (read(&arena_map, &mapping, key, LenCheck::AtMost(arena.len() as u64), FastTarget::Regions(&regions)), &owned)
    {
        // Nothing changes the bytes here: both reads see the same object.
        let mut both = a;
        both.extend_from_slice(&b);
        assert_eq!(&both[..len], &v[..], "two reads of one unchanged entry differ");
    }
    Ok(owned)
}

/// A sealed memfd holding `bytes` (at least one page).
fn sealed_memfd(bytes: &[u8]) -> io::Result<OwnedFd> {
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"kvtide-fuzz".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = bytes.len().max(4096);
    // SAFETY: plain syscalls on a descriptor we own, writing from a live slice.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0
            || libc::pwrite(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) != bytes.len() as isize
            || libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, INDEX_SEALS) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}
