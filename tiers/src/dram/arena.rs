//! The DRAM arena: one shared mapping that every object in DRAM lives in.
//!
//! Owns the mapping (a memfd, so an owner process can hand it to clients with `SCM_RIGHTS`),
//! its split into per-shard slices, and the registrations transports made of it (CUDA
//! `cuMemHostRegister`, RDMA `ibv_reg_mr`). It never decides what lives where in a slice (the
//! allocator and the shard do) and it never unmaps while anything can still reach it: every
//! holder of a pointer into it keeps an `Arc<Arena>`.
//!
//! Once its own writable mapping exists, the memfd is sealed (`F_SEAL_SHRINK`, `F_SEAL_GROW`,
//! `F_SEAL_FUTURE_WRITE`, `F_SEAL_SEAL`) and made mode 0400: whoever gets hold of the
//! descriptor can map it read-only and nothing more, while the existing mapping (and the io_uring
//! and CUDA registrations of it) stays writable.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Huge pages are 2 MiB on x86-64; slices are aligned to this so each can use them.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Errors from creating or registering the arena.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error(
        "arena size {requested_bytes} bytes is too small for {shards} shard slices of at least {min_slice_bytes} bytes"
    )]
    TooSmall { requested_bytes: usize, shards: usize, min_slice_bytes: usize },
    #[error("arena needs at least one slice")]
    NoSlices,
    #[error("a read index has room for {max} shards, the arena has {slices} slices")]
    TooManySlicesForIndex { slices: usize, max: usize },
    #[error("memfd_create failed: {0}")]
    Memfd(std::io::Error),
    #[error("could not size the arena to {bytes} bytes (ftruncate): {source}")]
    Resize { bytes: usize, source: std::io::Error },
    #[error("mmap of {bytes} bytes failed: {source}")]
    Map { bytes: usize, source: std::io::Error },
    #[error("slice {index} does not exist (arena has {count})")]
    NoSuchSlice { index: usize, count: usize },
    #[error("{registrar} could not register slice {slice} ({bytes} bytes): {reason}")]
    Registration { registrar: &'static str, slice: usize, bytes: usize, reason: String },
}

/// How the arena's pages are backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageBacking {
    /// Explicit huge pages (`MFD_HUGETLB`).
    HugeTlb,
    /// Normal pages with `MADV_HUGEPAGE` advice (transparent huge pages where the kernel allows).
    TransparentHugeAdvised,
}

/// What a transport keeps to undo a registration.
#[derive(Debug)]
pub struct RegistrationHandle {
    /// Registrar-defined token (a CUDA base pointer, an RDMA MR handle index, ...).
    pub token: u64,
}

/// A transport that registers arena memory once (CUDA pinning, RDMA memory regions).
///
/// The arena calls `register` at most once per (registrar name, slice) and `unregister` for each
/// successful registration before it unmaps.
pub trait MemoryRegistrar: Send + Sync {
    /// Stable name, used to make registration idempotent and in logs ("cuda", "rdma").
    fn name(&self) -> &'static str;
    /// Registers `[base, base + len)`.
    fn register(&self, slice: usize, base: NonNull<u8>, len: usize) -> Result<RegistrationHandle, String>;
    /// Undoes a registration made by `register`.
    fn unregister(&self, handle: RegistrationHandle);
}

struct Registration {
    registrar: Arc<dyn MemoryRegistrar>,
    slice: usize,
    handle: RegistrationHandle,
}

/// One memfd-backed mapping, split into equal per-shard slices.
pub struct Arena {
    base: NonNull<u8>,
    len_bytes: usize,
    memfd: OwnedFd,
    backing: PageBacking,
    slice_bytes: usize,
    slice_count: usize,
    registrations: Mutex<Vec<Registration>>,
}

// SAFETY: the arena is a plain memory mapping; the pointer is only an address. Who may write
// which bytes is decided by leases in the engine, not by the arena, and the mapping stays valid
// until drop, which needs exclusive ownership.
unsafe impl Send for Arena {}
// SAFETY: as above; shared access only hands out addresses and takes the registration mutex.
unsafe impl Sync for Arena {}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("len_bytes", &self.len_bytes)
            .field("backing", &self.backing)
            .field("slice_bytes", &self.slice_bytes)
            .field("slice_count", &self.slice_count)
            .finish()
    }
}

impl Arena {
    /// Maps `total_bytes` (rounded down to whole 2 MiB slices) split into `slices` slices.
    /// Tries explicit huge pages first, then normal pages with THP advice.
    pub fn new(total_bytes: usize, slices: usize) -> Result<Arc<Arena>, ArenaError> {
        if slices == 0 {
            return Err(ArenaError::NoSlices);
        }
        let slice_bytes = (total_bytes / slices) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
        if slice_bytes == 0 {
            return Err(ArenaError::TooSmall {
                requested_bytes: total_bytes,
                shards: slices,
                min_slice_bytes: HUGE_PAGE_BYTES,
            });
        }
        let len_bytes = slice_bytes * slices;
        let (memfd, base, backing) = match map_memfd_named(c"kvtide-arena", len_bytes, true) {
            Ok((fd, base)) => (fd, base, PageBacking::HugeTlb),
            Err(huge_err) => {
                tracing::debug!(error = %huge_err, "explicit huge pages unavailable; using THP advice");
                let (fd, base) = map_memfd_named(c"kvtide-arena", len_bytes, false)?;
                // SAFETY: [base, base+len_bytes) is the mapping we just created; madvise only
                // changes paging advice, and a refusal is harmless (we ignore its result).
                unsafe {
                    libc::madvise(base.as_ptr().cast(), len_bytes, libc::MADV_HUGEPAGE);
                }
                (fd, base, PageBacking::TransparentHugeAdvised)
            }
        };
        if let Err(e) = seal_read_only(&memfd) {
            // Nothing breaks here; an owner checks the seals before it shares the descriptor.
            tracing::warn!(error = %e, "cannot seal the DRAM arena memfd; it must not be shared with other processes");
        }
        tracing::info!(len_bytes, slices, slice_bytes, ?backing, "DRAM arena mapped");
        Ok(Arc::new(Arena {
            base,
            len_bytes,
            memfd,
            backing,
            slice_bytes,
            slice_count: slices,
            registrations: Mutex::new(Vec::new()),
        }))
    }

    /// Where the mapping starts in this process.
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// Total mapped bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Bytes per slice.
    pub fn slice_bytes(&self) -> usize {
        self.slice_bytes
    }

    /// Number of slices.
    pub fn slice_count(&self) -> usize {
        self.slice_count
    }

    /// How the pages are backed.
    pub fn backing(&self) -> PageBacking {
        self.backing
    }

    /// The memfd behind the mapping (shared with other processes by the owner).
    pub fn memfd(&self) -> &OwnedFd {
        &self.memfd
    }

    /// Slice `index` as a handle that keeps the arena alive.
    pub fn slice(self: &Arc<Self>, index: usize) -> Result<ArenaSlice, ArenaError> {
        if index >= self.slice_count {
            return Err(ArenaError::NoSuchSlice { index, count: self.slice_count });
        }
        Ok(ArenaSlice { arena: Arc::clone(self), index })
    }

    /// Registers every slice with `registrar`, once; later calls are no-ops. Returns the time
    /// spent registering in this call (zero when already registered).
    pub fn register_with(&self, registrar: &Arc<dyn MemoryRegistrar>) -> Result<Duration, ArenaError> {
        let started = Instant::now();
        let mut regs = self.registrations.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let done: HashSet<usize> =
            regs.iter().filter(|r| r.registrar.name() == registrar.name()).map(|r| r.slice).collect();
        for slice in 0..self.slice_count {
            if done.contains(&slice) {
                continue;
            }
            let base = self.slice_base(slice);
            let handle = registrar.register(slice, base, self.slice_bytes).map_err(|reason| {
                ArenaError::Registration { registrar: registrar.name(), slice, bytes: self.slice_bytes, reason }
            })?;
            regs.push(Registration { registrar: Arc::clone(registrar), slice, handle });
        }
        let elapsed = if done.len() == self.slice_count { Duration::ZERO } else { started.elapsed() };
        if !elapsed.is_zero() {
            tracing::info!(registrar = registrar.name(), elapsed_ms = elapsed.as_millis() as u64, "arena registered");
        }
        Ok(elapsed)
    }

    /// Names of registrars that registered at least one slice.
    pub fn registered_with(&self) -> Vec<&'static str> {
        let regs = self.registrations.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut names: Vec<&'static str> = regs.iter().map(|r| r.registrar.name()).collect();
        names.dedup();
        names
    }

    fn slice_base(&self, index: usize) -> NonNull<u8> {
        debug_assert!(index < self.slice_count);
        // SAFETY: index < slice_count, so the offset stays inside the mapping, which is non-null.
        unsafe { NonNull::new_unchecked(self.base.as_ptr().add(index * self.slice_bytes)) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let regs = std::mem::take(self.registrations.get_mut().unwrap_or_else(|p| p.into_inner()));
        for reg in regs {
            reg.registrar.unregister(reg.handle);
        }
        // SAFETY: base/len_bytes describe the mapping created in `new`; drop has exclusive access
        // and every holder of a pointer into it holds an Arc, so none is left.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len_bytes);
        }
    }
}

/// Every seal `seal_read_only` adds.
pub const SHARING_SEALS: libc::c_int =
    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;

/// Makes `memfd` safe to hand to other processes: mode 0400 (reopening it for writing through
/// `/proc/<pid>/fd` fails for other users), then seals that forbid resizing it, any new writable
/// mapping or `write` (existing writable mappings keep working), and further seal changes.
pub(crate) fn seal_read_only(memfd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::fchmod(memfd.as_raw_fd(), 0o400) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, SHARING_SEALS) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A new memfd named `name` of `len_bytes`, mapped shared and writable (huge pages with `huge`).
pub(crate) fn map_memfd_named(
    name: &std::ffi::CStr,
    len_bytes: usize,
    huge: bool,
) -> Result<(OwnedFd, NonNull<u8>), ArenaError> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if huge {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: the name is a valid NUL-terminated C string; memfd_create has no other inputs.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(ArenaError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a freshly created descriptor that nothing else owns.
    let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::ftruncate(memfd.as_raw_fd(), len_bytes as libc::off_t) } != 0 {
        return Err(ArenaError::Resize { bytes: len_bytes, source: std::io::Error::last_os_error() });
    }
    // SAFETY: mapping a descriptor we own with a length it was sized to; the kernel picks the
    // address, so no existing mapping is replaced.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            memfd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(ArenaError::Map { bytes: len_bytes, source: std::io::Error::last_os_error() });
    }
    let base = NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| ArenaError::Map { bytes: len_bytes, source: std::io::Error::other("mmap returned null") })?;
    // With MFD_HUGETLB and no MAP_NORESERVE the kernel reserves the huge pages at mmap time, so an
    // empty pool fails above (ENOMEM) instead of with SIGBUS on first touch.
    Ok((memfd, base))
}

/// One shard's slice of the arena. Holding it keeps the arena mapped.
#[derive(Clone)]
pub struct ArenaSlice {
    arena: Arc<Arena>,
    index: usize,
}

impl std::fmt::Debug for ArenaSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaSlice").field("index", &self.index).field("len_bytes", &self.len_bytes()).finish()
    }
}

impl ArenaSlice {
    /// Which slice this is (the shard index).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Slice length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.arena.slice_bytes()
    }

    /// First byte of the slice.
    pub fn base(&self) -> NonNull<u8> {
        self.arena.slice_base(self.index)
    }

    /// The arena this slice belongs to.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// Address of `offset` within the slice, or None if `[offset, offset+len)` leaves it.
    pub fn ptr_at(&self, offset: u64, len: u64) -> Option<NonNull<u8>> {
        let end = offset.checked_add(len)?;
        if end > self.len_bytes() as u64 {
            return None;
        }
        // SAFETY: offset + len <= slice length, so the result stays inside the slice's mapping.
        Some(unsafe { NonNull::new_unchecked(self.base().as_ptr().add(offset as usize)) })
    }

    /// The slice cut into pieces of at most `max_piece_bytes` (io_uring fixed buffers are limited
    /// to 1 GiB each). Returns (offset, len) pairs in order.
    pub fn pieces(&self, max_piece_bytes: usize) -> Vec<(u64, usize)> {
        let max = max_piece_bytes.max(1);
        let len = self.len_bytes();
        (0..len).step_by(max).map(|start| (start as u64, max.min(len - start))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn slices_are_disjoint_and_writable() {
        let arena = Arena::new(8 << 20, 2).expect("arena");
        assert_eq!(arena.slice_count(), 2);
        assert_eq!(arena.slice_bytes(), 4 << 20);
        let a = arena.slice(0).expect("slice 0");
        let b = arena.slice(1).expect("slice 1");
        assert_eq!(a.base().as_ptr() as usize + a.len_bytes(), b.base().as_ptr() as usize);
        let p = a.ptr_at(0, 4096).expect("in bounds");
        // SAFETY: p points at 4096 bytes inside the mapping owned by `arena`, which is alive.
        unsafe { std::ptr::write_bytes(p.as_ptr(), 0xAB, 4096) };
        assert!(a.ptr_at(a.len_bytes() as u64 - 1, 2).is_none());
        assert!(a.ptr_at(u64::MAX, 2).is_none());
        assert!(matches!(arena.slice(2), Err(ArenaError::NoSuchSlice { .. })));
    }

    /// What a holder of the descriptor may do: map it read-only. What it may not: map it
    /// writable, write, resize, punch holes, or change the seals. The owner's mapping stays
    /// writable.
    fn assert_sealed(memfd: &OwnedFd, base: NonNull<u8>, len: usize) {
        let fd = memfd.as_raw_fd();
        // SAFETY: base..base+len is the owner's live writable mapping.
        unsafe { std::ptr::write_bytes(base.as_ptr(), 0x5A, len) };
        // SAFETY: fcntl reads the seals of a descriptor we own.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_GET_SEALS) } & SHARING_SEALS, SHARING_SEALS);
        // SAFETY: stat is plain data that fstat fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
        assert_eq!(st.st_mode & 0o777, 0o400);
        let eperm = |rc: bool| rc && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        // SAFETY: a new mapping at a kernel-chosen address; it must fail.
        let rw = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        assert!(eperm(rw == libc::MAP_FAILED), "a new writable shared mapping is refused");
        // SAFETY: a read-only mapping, checked and unmapped below.
        let ro = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
        assert_ne!(ro, libc::MAP_FAILED, "read-only mappings still work");
        // SAFETY: the read-only mapping made above; made writable must fail; then unmapped.
        unsafe {
            assert_eq!(*ro.cast::<u8>(), 0x5A);
            assert_ne!(libc::mprotect(ro, len, libc::PROT_READ | libc::PROT_WRITE), 0);
            libc::munmap(ro, len);
        }
        // SAFETY: plain syscalls on a descriptor we own; each must fail.
        unsafe {
            assert!(eperm(libc::ftruncate(fd, 0) != 0), "no shrinking");
            assert!(eperm(libc::ftruncate(fd, (len * 2) as libc::off_t) != 0), "no growing");
            assert!(eperm(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_WRITE) != 0), "seals are final");
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            assert_ne!(libc::fallocate(fd, punch, 0, HUGE_PAGE_BYTES as libc::off_t), 0, "no holes");
            assert_ne!(libc::pwrite(fd, b"x".as_ptr().cast(), 1, 0), 1, "no writes");
        }
        // SAFETY: the owner's mapping is still writable and still holds what was written.
        unsafe {
            assert_eq!(*base.as_ptr().add(len - 1), 0x5A);
            *base.as_ptr() = 0xA5;
        }
    }

    #[test]
    fn the_memfd_is_sealed_and_the_mapping_stays_writable() {
        let arena = Arena::new(4 << 20, 2).expect("arena");
        assert_sealed(arena.memfd(), arena.slice_base(0), arena.len_bytes());
        // Both backings explicitly: normal pages always, explicit huge pages where the host has some.
        for huge in [false, true] {
            match map_memfd_named(c"kvtide-test", HUGE_PAGE_BYTES, huge) {
                Ok((fd, base)) => {
                    seal_read_only(&fd).expect("seal");
                    assert_sealed(&fd, base, HUGE_PAGE_BYTES);
                    // SAFETY: the mapping made by map_memfd_named above, no longer used.
                    unsafe { libc::munmap(base.as_ptr().cast(), HUGE_PAGE_BYTES) };
                }
                Err(e) => {
                    assert!(huge, "normal pages must map: {e}");
                    println!("skipping the MFD_HUGETLB variant: {e} (no huge pages reserved here)");
                }
            }
        }
    }

    #[test]
    fn too_small_and_zero_slices_are_errors() {
        assert!(matches!(Arena::new(1 << 20, 1), Err(ArenaError::TooSmall { .. })));
        assert!(matches!(Arena::new(8 << 20, 0), Err(ArenaError::NoSlices)));
    }

    #[test]
    fn pieces_cover_the_slice() {
        let arena = Arena::new(6 << 20, 1).expect("arena");
        let s = arena.slice(0).expect("slice");
        let pieces = s.pieces(4 << 20);
        assert_eq!(pieces, vec![(0, 4 << 20), (4 << 20, 2 << 20)]);
    }

    struct CountingRegistrar {
        registered: AtomicUsize,
        unregistered: Arc<AtomicUsize>,
        fail_slice: Option<usize>,
    }

    impl MemoryRegistrar for CountingRegistrar {
        fn name(&self) -> &'static str {
            "counting"
        }
        fn register(&self, slice: usize, _base: NonNull<u8>, _len: usize) -> Result<RegistrationHandle, String> {
            if Some(slice) == self.fail_slice {
                return Err("refused".into());
            }
            self.registered.fetch_add(1, Ordering::SeqCst);
            Ok(RegistrationHandle { token: slice as u64 })
        }
        fn unregister(&self, _handle: RegistrationHandle) {
            self.unregistered.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn registration_is_once_per_slice_and_undone_on_drop() {
        let unregistered = Arc::new(AtomicUsize::new(0));
        let reg = Arc::new(CountingRegistrar {
            registered: AtomicUsize::new(0),
            unregistered: Arc::clone(&unregistered),
            fail_slice: None,
        });
        let dyn_reg: Arc<dyn MemoryRegistrar> = reg.clone();
        let arena = Arena::new(8 << 20, 2).expect("arena");
        arena.register_with(&dyn_reg).expect("register");
        arena.register_with(&dyn_reg).expect("again");
        assert_eq!(reg.registered.load(Ordering::SeqCst), 2);
        assert_eq!(arena.registered_with(), vec!["counting"]);
        drop(arena);
        assert_eq!(unregistered.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn refused_registration_is_a_typed_error_and_retry_resumes() {
        let reg = Arc::new(CountingRegistrar {
            registered: AtomicUsize::new(0),
            unregistered: Arc::new(AtomicUsize::new(0)),
            fail_slice: Some(1),
        });
        let dyn_reg: Arc<dyn MemoryRegistrar> = reg.clone();
        let arena = Arena::new(8 << 20, 2).expect("arena");
        let err = arena.register_with(&dyn_reg).expect_err("slice 1 refused");
        assert!(matches!(err, ArenaError::Registration { slice: 1, .. }), "{err}");
        assert_eq!(reg.registered.load(Ordering::SeqCst), 1);
    }
}
