//! The same-host fast path's memory: the owner hands out a read-only descriptor of its DRAM
//! arena; the client maps it read-only and copies leased objects straight out of it.
//!
//! It owns the client's mapping and the bounds check of every copy against it. It never maps
//! anything writable, and it never reads outside a range the caller validated against a lease
//! the owner granted (the grant check happens in `protocol::Grant::check` and again here).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

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
    pub(crate) unsafe fn copy_out(&self, offset: u64, len: u64, dst: *mut u8) -> Result<(), crate::error::Error> {
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > self.len as u64) {
            return Err(crate::error::Error::Protocol(format!(
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
