//! The same-host fast path's memory: the owner hands out a read-only descriptor of its DRAM
//! arena; the client maps it read-only and copies leased objects straight out of it. For puts,
//! each connection may get a put window: shared memory the client writes values into and the
//! owner copies them out of.
//!
//! It owns the owner's check that the arena memfd is sealed before it is shared, the client's
//! mapping and the bounds check of every copy against it, the client's mapping of the owner's
//! read index and its watch on the owner's life (`IndexMapping`, `OwnerWatch`), and the put windows (sealed size,
//! read-only on the owner's side). It never shares a descriptor whose
//! seals it could not confirm, never maps anything writable, and never reads outside a range the
//! caller validated against a lease the owner granted (the grant check happens in
//! `protocol::Grant::check` and again here).

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use kvtide_tiers::dram::read_index::ReadIndexView;

use crate::sock::Pidfd;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Mutex;

/// Maps `len` bytes (not zero) of `fd` read-only and shared, after checking the descriptor is
/// that long; `what` names it in errors. The mapping is the caller's to unmap.
fn map_read_only(fd: &OwnedFd, len: u64, what: &str) -> io::Result<(NonNull<u8>, usize)> {
    let len = usize::try_from(len).map_err(|_| io::Error::other(format!("{what} larger than the address space")))?;
    if len == 0 {
        return Err(io::Error::other(format!("empty {what}")));
    }
    // SAFETY: stat is plain data; fstat fills it for a descriptor we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if (st.st_size as u64) < len as u64 {
        return Err(io::Error::other(format!("{what} descriptor is {} bytes, the owner announced {len}", st.st_size)));
    }
    // SAFETY: a new read-only shared mapping of a descriptor we own, at an address the kernel
    // picks, so no existing mapping is replaced.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
    Ok((base, len))
}

/// What must go before a mapping is unmapped (its CUDA registration), attached once.
#[derive(Default)]
pub(crate) struct Attachment(Mutex<Option<Box<dyn Any + Send + Sync>>>);

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Attachment")
    }
}

impl Attachment {
    /// Runs `make` unless something is attached already, and keeps what it returns.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn attach_once(&self, make: impl FnOnce() -> Option<Box<dyn Any + Send + Sync>>) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = make();
        }
    }

    fn detach(&self) {
        drop(self.0.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

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
    attachment: Attachment,
    /// The owner's read index over this arena, once asked for (None: refused or unusable).
    read_index: std::sync::OnceLock<Option<IndexMapping>>,
}

// SAFETY: the mapping is read-only shared memory; the pointer is only used for bounds-checked
// copies out of ranges the owner leased (nothing writes them while the lease holds).
unsafe impl Send for ShmMapping {}
// SAFETY: as above; all access is reads.
unsafe impl Sync for ShmMapping {}

/// The arena mappings this process holds, by the memfd's identity: every `RemoteStore` of the
/// process shares one, so its pages fault in (and get registered with CUDA) once.
static MAPPINGS: Mutex<Vec<(MemfdKey, std::sync::Weak<ShmMapping>)>> = Mutex::new(Vec::new());

/// A memfd's device, inode and mapped length.
type MemfdKey = (u64, u64, u64);

impl ShmMapping {
    /// The process's mapping of the arena `fd` names (the same memfd, by device and inode, and
    /// length), mapping it now if there is none.
    pub(crate) fn shared(fd: OwnedFd, len: u64, instance_id: u64) -> io::Result<std::sync::Arc<ShmMapping>> {
        // SAFETY: stat is plain data; fstat fills it for a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let key = (st.st_dev, st.st_ino, len);
        let mut cache = MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
        cache.retain(|(_, m)| m.strong_count() > 0);
        if let Some(m) = cache.iter().find(|(k, _)| *k == key).and_then(|(_, m)| m.upgrade()) {
            return Ok(m);
        }
        let m = std::sync::Arc::new(ShmMapping::map(fd, len, instance_id)?);
        cache.push((key, std::sync::Arc::downgrade(&m)));
        Ok(m)
    }

    /// Maps `len` bytes of `fd` read-only (the descriptor is closed afterwards; the mapping keeps
    /// the memory alive).
    pub(crate) fn map(fd: OwnedFd, len: u64, instance_id: u64) -> io::Result<ShmMapping> {
        let (base, len) = map_read_only(&fd, len, "arena")?;
        Ok(ShmMapping {
            base,
            len,
            instance_id,
            attachment: Attachment::default(),
            read_index: std::sync::OnceLock::new(),
        })
    }

    /// The owner's read index over this arena, if it was asked for and mapped.
    pub(crate) fn read_index(&self) -> Option<&IndexMapping> {
        self.read_index.get().and_then(Option::as_ref)
    }

    /// Whether the read index was asked for already (mapped or not).
    pub(crate) fn read_index_asked(&self) -> bool {
        self.read_index.get().is_some()
    }

    /// Keeps what asking for the read index gave (the first answer wins).
    pub(crate) fn set_read_index(&self, index: Option<IndexMapping>) {
        let _ = self.read_index.set(index);
    }

    pub(crate) fn instance_id(&self) -> u64 {
        self.instance_id
    }

    /// The mapping's first byte and its registration slot (for CUDA).
    pub(crate) fn memory(&self) -> (NonNull<u8>, usize, &Attachment) {
        (self.base, self.len, &self.attachment)
    }

    /// The address of `[offset, offset + len)` of the arena, after checking the range.
    pub(crate) fn addr_of(&self, offset: u64, len: u64) -> Result<u64, crate::Error> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(self.base.as_ptr() as u64 + offset),
            _ => Err(crate::Error::Protocol(format!(
                "grant [{offset}, +{len}) lies outside the {}-byte arena mapping",
                self.len
            ))),
        }
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
        unsafe { kvtide_transport::memcpy::copy_bytes(dst, self.base.as_ptr().add(offset as usize), len as usize) };
        Ok(())
    }
    /// Copies `len` bytes at `offset` of the arena, in order, across `regions` (host memory),
    /// after checking the range; regions past the last byte are left alone. Fails with
    /// `BufferTooSmall` (nothing promised written) when the regions hold fewer than `len` bytes.
    ///
    /// # Safety
    /// Each region must be valid for writes for the call; the source bytes are `copy_out`'s.
    pub(crate) unsafe fn copy_out_across(
        &self,
        offset: u64,
        len: u64,
        regions: &[kvtide_transport::Region<'_>],
    ) -> Result<(), crate::Error> {
        let mut pos = 0;
        for r in regions {
            if pos == len {
                break;
            }
            let take = (r.len() as u64).min(len - pos);
            // SAFETY: the region is writable (contract); copy_out checks the source range.
            unsafe { self.copy_out(offset + pos, take, r.addr() as *mut u8)? };
            pos += take;
        }
        if pos != len {
            return Err(kvtide::Error::BufferTooSmall { object_bytes: len, buffer_bytes: pos }.into());
        }
        Ok(())
    }

    /// `len` bytes at `offset` of the arena in a new vector, after checking the range.
    ///
    /// # Safety
    /// The source bytes are `copy_out`'s.
    pub(crate) unsafe fn copy_out_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>, crate::Error> {
        let n = usize::try_from(len).map_err(|_| crate::Error::Protocol(format!("{len} bytes do not fit memory")))?;
        let mut v = Vec::<u8>::with_capacity(n);
        // SAFETY: v has room for len bytes; copy_out writes exactly those or fails before writing
        // (then set_len is not reached).
        unsafe {
            self.copy_out(offset, len, v.as_mut_ptr())?;
            v.set_len(n);
        }
        Ok(v)
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        // A registration of the range goes before the range.
        self.attachment.detach();
        // SAFETY: base/len describe the mapping created in `map`; every user holds an Arc to
        // this value, so none is left when it drops.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// Seals of a put window: its size is fixed for good, so neither side can shrink it under the
/// other's mapping (a read past the end would kill the reader with `SIGBUS`); writes stay allowed.
const WINDOW_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A put window: shared memory of one connection, which the client writes values into and the
/// owner copies out of into its reservations. The owner creates it (so it counts and bounds it)
/// and maps it read-only; only the client maps it writable. The arena is never part of it.
#[derive(Debug)]
pub(crate) struct PutWindow {
    base: NonNull<u8>,
    len: usize,
    attachment: Attachment,
}

// SAFETY: shared memory whose every access is a bounds-checked raw copy (never a reference);
// the client writes only ranges it has not handed to the owner, the owner only reads.
unsafe impl Send for PutWindow {}
// SAFETY: as above.
unsafe impl Sync for PutWindow {}

impl PutWindow {
    /// The owner's side: a new sealed memfd of `len` bytes, mapped read-only here, and the
    /// descriptor to send to the client.
    pub(crate) fn create(len: u64) -> io::Result<(PutWindow, OwnedFd)> {
        let len_usize = usize::try_from(len).map_err(|_| io::Error::other("window larger than the address space"))?;
        if len_usize == 0 {
            return Err(io::Error::other("empty put window"));
        }
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let fd =
            unsafe { libc::memfd_create(c"kvtide-put-window".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscalls on the descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, WINDOW_SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let window = PutWindow::map(&fd, len_usize, libc::PROT_READ)?;
        Ok((window, fd))
    }

    /// The client's side: maps a window the owner sent, writable, after checking that its size
    /// is sealed and covers `len`.
    pub(crate) fn map_writable(fd: OwnedFd, len: u64) -> io::Result<PutWindow> {
        let len = usize::try_from(len).map_err(|_| io::Error::other("window larger than the address space"))?;
        // SAFETY: fcntl reads the seals of a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & WINDOW_SEALS != WINDOW_SEALS {
            return Err(io::Error::other("the put window's size is not sealed"));
        }
        // SAFETY: stat is plain data; fstat fills it for a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as u64) < len as u64 || len == 0 {
            return Err(io::Error::other(format!("put window is {} bytes, the owner announced {len}", st.st_size)));
        }
        PutWindow::map(&fd, len, libc::PROT_READ | libc::PROT_WRITE)
    }

    fn map(fd: &OwnedFd, len: usize, prot: libc::c_int) -> io::Result<PutWindow> {
        // SAFETY: a new shared mapping of a descriptor we hold, at an address the kernel picks,
        // so no existing mapping is replaced.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(PutWindow { base, len, attachment: Attachment::default() })
    }

    pub(crate) fn len(&self) -> u64 {
        self.len as u64
    }

    /// The window's first byte and its registration slot (for CUDA).
    pub(crate) fn memory(&self) -> (NonNull<u8>, usize, &Attachment) {
        (self.base, self.len, &self.attachment)
    }

    /// The address of `[offset, offset + len)` of the window, after checking the range.
    pub(crate) fn addr_of(&self, offset: u64, len: u64) -> Result<u64, kvtide::Error> {
        Ok(self.base.as_ptr() as u64 + self.check(offset, len)? as u64)
    }

    fn check(&self, offset: u64, len: u64) -> Result<usize, kvtide::Error> {
        kvtide_transport::region::check_range("put window", offset, len, self.len as u64)?;
        Ok(offset as usize)
    }

    /// The owner's copy of `[offset, offset + dst.len())` into `dst`, after checking the range.
    /// The client may scribble on the range meanwhile; that changes only its own value, which
    /// is what it asked to store.
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), kvtide::Error> {
        let start = self.check(offset, dst.len() as u64)?;
        if !dst.is_empty() {
            // SAFETY: the range was checked against the mapping; a raw copy (no reference to the
            // shared bytes is ever formed); `dst` is ours and cannot overlap a mapping we only read.
            unsafe { kvtide_transport::memcpy::copy_bytes(dst.as_mut_ptr(), self.base.as_ptr().add(start), dst.len()) };
        }
        Ok(())
    }

    /// The client's copy of `len` bytes at `src` into the window at `offset`.
    ///
    /// # Safety
    /// `[src, src + len)` must be valid for reads, and the client must not have handed this
    /// range to the owner in a request it has not answered yet.
    pub(crate) unsafe fn write(&self, offset: u64, src: *const u8, len: u64) -> Result<(), kvtide::Error> {
        let start = self.check(offset, len)?;
        if len > 0 {
            // SAFETY: the destination range was checked against the (writable) mapping; the
            // source is the caller's (contract) and lies outside a mapping the client just made.
            unsafe { kvtide_transport::memcpy::copy_bytes(self.base.as_ptr().add(start), src, len as usize) };
        }
        Ok(())
    }
}

impl Drop for PutWindow {
    fn drop(&mut self) {
        self.attachment.detach();
        // SAFETY: base/len describe the mapping made in `map`; the owner drops it with its
        // connection, the client with its connection, after the last copy.
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

    #[test]
    fn a_put_window_cannot_be_resized_and_checks_every_range() {
        let (owner_side, fd) = PutWindow::create(64 << 10).expect("window");
        // A hostile client cannot shrink it under the owner's mapping.
        // SAFETY: a plain syscall on our descriptor; it must fail.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        let client_side = PutWindow::map_writable(fd, 64 << 10).expect("client mapping");
        let value: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        // SAFETY: value is a live buffer; nothing was handed to the owner.
        unsafe { client_side.write(100, value.as_ptr(), value.len() as u64) }.expect("write");
        let mut out = vec![0u8; 1000];
        owner_side.read(100, &mut out).expect("read");
        assert_eq!(out, value);
        assert!(owner_side.read((64 << 10) - 10, &mut out).is_err(), "past the end");
        assert!(owner_side.read(u64::MAX - 5, &mut out).is_err(), "overflow");
        // SAFETY: as above; the range is refused before anything is copied.
        assert!(unsafe { client_side.write(64 << 10, value.as_ptr(), 1) }.is_err());
    }

    #[test]
    fn an_unsealed_window_is_refused_by_the_client() {
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kvtide-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a plain syscall on our descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 20) }, 0);
        assert!(PutWindow::map_writable(fd, 1 << 20).is_err());
    }
}

/// How long a check that the owner lives is trusted. An owner that died is replaced by a new
/// process that must start, open its store and take a write before any key can hold something
/// newer than the dead owner's index says: far longer than this.
const OWNER_CHECK_NS: u64 = 1_000_000;

/// Seals the read index must carry before it is mapped: its size is fixed, so the owner cannot
/// shrink it under the mapping (a read past the end would kill the client with `SIGBUS`).
pub(crate) const INDEX_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Whether the owner process that shares an index still lives, checked at most every
/// `OWNER_CHECK_NS` (a `poll` of its pidfd: readable once it exited).
#[derive(Debug)]
pub(crate) struct OwnerWatch {
    pidfd: Pidfd,
    epoch: Instant,
    /// Until when (ns since `epoch`) the last check is trusted; 0: never checked.
    trusted_until_ns: AtomicU64,
    dead: AtomicBool,
}

impl OwnerWatch {
    /// A watch on process `pid` (the peer of the connection the index came on; the caller then
    /// proves with a reply on that connection that the pid was still the owner's).
    pub(crate) fn of_pid(pid: libc::pid_t) -> io::Result<OwnerWatch> {
        Ok(OwnerWatch {
            pidfd: Pidfd::open(pid)?,
            epoch: Instant::now(),
            trusted_until_ns: AtomicU64::new(0),
            dead: AtomicBool::new(false),
        })
    }

    pub(crate) fn alive(&self) -> bool {
        if self.dead.load(Ordering::Relaxed) {
            return false;
        }
        let now = self.epoch.elapsed().as_nanos() as u64;
        if now < self.trusted_until_ns.load(Ordering::Relaxed) {
            return true;
        }
        if self.pidfd.exited() {
            // Exited (readable), or the descriptor failed: either way, stop trusting the index.
            self.dead.store(true, Ordering::Relaxed);
            return false;
        }
        self.trusted_until_ns.store(now + OWNER_CHECK_NS, Ordering::Relaxed);
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
        // SAFETY: fcntl reads the seals of a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & INDEX_SEALS != INDEX_SEALS {
            return Err(io::Error::other("the read index is not sealed against resizing"));
        }
        let (base, len) = map_read_only(&fd, len, "read index")?;
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

    /// Shards of the owner's engine (the index's regions).
    pub(crate) fn shards(&self) -> usize {
        self.shards
    }

    /// The view, while the owner lives.
    pub(crate) fn view(&self) -> Option<&ReadIndexView> {
        self.owner.alive().then_some(&self.view)
    }
}

impl Drop for IndexMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`; the view is dropped with it and nothing else holds it.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
