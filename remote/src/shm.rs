//! The same-host fast path's memory: the owner hands out a read-only descriptor of its DRAM
//! arena; the client maps it read-only and copies leased objects straight out of it.
//!
//! It owns the owner's check that the arena memfd is sealed before it is shared, the client's
//! mapping and the bounds check of every copy against it. It never shares a descriptor whose
//! seals it could not confirm, never maps anything writable, and never reads outside a range the
//! caller validated against a lease the owner granted (the grant check happens in
//! `protocol::Grant::check` and again here).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// Confirms that `memfd` (the arena, `len` bytes) is sealed so that a process holding any
/// descriptor of it can neither resize it nor write it: the seals are present, and the kernel
/// really refuses a new writable shared mapping (`EPERM`).
pub(crate) fn check_sealed(memfd: &OwnedFd, len: u64) -> io::Result<()> {
    let want = kvtide_tiers::dram::arena::SHARING_SEALS;
    // SAFETY: fcntl reads the seals of a descriptor we hold.
    let seals = unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::other(format!("cannot read the arena's seals: {}", io::Error::last_os_error())));
    }
    if seals & want != want {
        return Err(io::Error::other(format!("the arena memfd lacks seals (has {seals:#x}, needs {want:#x})")));
    }
    let len = usize::try_from(len).map_err(|_| io::Error::other("arena larger than the address space"))?;
    // SAFETY: asks for a new mapping at a kernel-chosen address (replacing nothing); if the
    // kernel grants it despite the seals, it is unmapped at once and never used.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            memfd.as_raw_fd(),
            0,
        )
    };
    if ptr != libc::MAP_FAILED {
        // SAFETY: the mapping made just above.
        unsafe { libc::munmap(ptr, len) };
        return Err(io::Error::other("the kernel ignores F_SEAL_FUTURE_WRITE on the arena memfd"));
    }
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::EPERM) => Ok(()),
        e => Err(io::Error::other(format!("cannot confirm the arena's write seal: {e}"))),
    }
}

/// Opens a new, read-only descriptor for the same memfd (through `/proc/self/fd`), so a client
/// that receives it can only ever map the arena read-only.
pub(crate) fn reopen_read_only(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| io::Error::other("descriptor path contains NUL"))?;
    // SAFETY: path is a valid NUL-terminated string; open has no other inputs.
    let ro = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if ro < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ro is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ro) })
}

/// A read-only mapping of an owner's arena.
#[derive(Debug)]
pub(crate) struct ShmMapping {
    base: NonNull<u8>,
    len: usize,
    instance_id: u64,
}

// SAFETY: the mapping is read-only shared memory; the pointer is only used for bounds-checked
// copies out of ranges the owner leased (nothing writes them while the lease holds).
unsafe impl Send for ShmMapping {}
// SAFETY: as above; all access is reads.
unsafe impl Sync for ShmMapping {}

impl ShmMapping {
    /// Maps `len` bytes of `fd` read-only (the descriptor is closed afterwards; the mapping keeps
    /// the memory alive).
    pub(crate) fn map(fd: OwnedFd, len: u64, instance_id: u64) -> io::Result<ShmMapping> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("arena larger than the address space"))?;
        if len == 0 {
            return Err(io::Error::other("empty arena"));
        }
        // SAFETY: stat is plain data; fstat fills it for a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as u64) < len as u64 {
            return Err(io::Error::other(format!(
                "arena descriptor is {} bytes, the owner announced {len}",
                st.st_size
            )));
        }
        // SAFETY: a new read-only shared mapping of a descriptor we own, at an address the kernel
        // picks, so no existing mapping is replaced.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(ShmMapping { base, len, instance_id })
    }

    pub(crate) fn instance_id(&self) -> u64 {
        self.instance_id
    }

    pub(crate) fn len(&self) -> u64 {
        self.len as u64
    }

    /// Copies `len` bytes at `offset` of the arena to `dst`, after checking the range.
    ///
    /// # Safety
    /// `[dst, dst + len)` must be valid for writes, and `[offset, offset + len)` must be covered
    /// by a lease the owner granted and has not released (so nothing writes it meanwhile).
    pub(crate) unsafe fn copy_out(&self, offset: u64, len: u64, dst: *mut u8) -> Result<(), crate::Error> {
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > self.len as u64) {
            return Err(crate::Error::Protocol(format!(
                "grant [{offset}, +{len}) lies outside the {}-byte arena mapping",
                self.len
            )));
        }
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the source range was checked against the mapping above; the destination is
        // the caller's (contract), and a read-only mapping cannot overlap a writable buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.base.as_ptr().add(offset as usize), dst, len as usize) };
        Ok(())
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        // SAFETY: base/len describe the mapping created in `map`; every user holds an Arc to
        // this value, so none is left when it drops.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsealed_memfd_is_never_confirmed() {
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kvtide-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscalls on our descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 20) }, 0);
        assert!(check_sealed(&fd, 1 << 20).is_err(), "no seals");
        // Size seals alone are not enough: a new writable mapping is still possible.
        let some = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, some) }, 0);
        assert!(check_sealed(&fd, 1 << 20).is_err(), "no write seal");
        let arena = kvtide_tiers::dram::Arena::new(4 << 20, 1).expect("arena");
        check_sealed(arena.memfd(), arena.len_bytes() as u64).expect("the arena is sealed");
    }
}
