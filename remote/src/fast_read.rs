//! Same-host reads without a round trip, through the owner's read index (mapped by `shm.rs`).
//!
//! Owns `read`: look a key up, copy its bytes out of the arena mapping, and keep the copy only if
//! the index entry did not move meanwhile. Never
//! sends anything to the owner, never trusts a range it did not check against the arena mapping,
//! and never reports a copy that raced with a change: that read returns `None` and the caller
//! leases the key as it would without the index.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use kvtide_tiers::dram::read_index::KeyDigest;
use kvtide_transport::Region;

use crate::protocol::LenCheck;
use crate::shm::{IndexMapping, OwnerWatch, ShmMapping, INDEX_SEALS};

/// What a fast read did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FastRead {
    /// The object's `len` bytes are in the target, proven the object's; `entry` is the index
    /// entry read, `(shard, slot, generation)`, for the owner's hit counts and eviction policy.
    Read { len: usize, owned: Option<Vec<u8>>, entry: (u32, u32, u32) },
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
    let shard = kvtide::shard_of_key(key, index.shards());
    let Some(found) = view.find(shard, &KeyDigest::of(key)) else { return FastRead::Lease };
    let len = found.len;
    // A mismatch is answered by the leased path, which says why.
    if check.check(len).is_err() {
        return FastRead::Lease;
    }
    // Every copy below writes caller memory lent writable for this call, from a source range the
    // mapping checks. The bytes may change under a copy; the check after it then discards them.
    let copied = match target {
        FastTarget::Regions(regions) => {
            // SAFETY: as above.
            unsafe { arena.copy_out_across(found.offset, len, regions) }.map(|()| None)
        }
        // SAFETY: as above.
        FastTarget::Owned => unsafe { arena.copy_out_vec(found.offset, len) }.map(Some),
        FastTarget::Fragments(fragments) => fragments
            .iter()
            .try_for_each(|(src, n, dst)| {
                if src.checked_add(*n).is_none_or(|end| end > len) || dst.len() as u64 != *n {
                    return Err(crate::Error::Protocol("a fragment outside the object".into()));
                }
                // SAFETY: as above; `dst` holds `n` bytes (checked).
                unsafe { arena.copy_out(found.offset + src, *n, dst.addr() as *mut u8) }
            })
            .map(|()| None),
    };
    let Ok(owned) = copied else { return FastRead::Lease };
    if !view.unchanged(&found) {
        return FastRead::Lease;
    }
    FastRead::Read { len: len as usize, owned, entry: (shard as u32, found.slot, found.generation) }
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
