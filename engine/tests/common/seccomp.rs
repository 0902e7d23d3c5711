//! A seccomp filter that refuses `io_uring_setup` with EPERM, as the default profiles of Docker
//! 25+ and containerd do: for tests of the engine and the owner where io_uring is refused.

/// Installs the filter on the calling thread (inherited by its children and kept across exec).
/// Only system calls, on memory of this frame: safe between fork and exec (`pre_exec`).
#[cfg(target_arch = "x86_64")]
pub fn refuse_io_uring_setup() -> std::io::Result<()> {
    const IO_URING_SETUP: u32 = 425;
    // BPF: load the syscall number; io_uring_setup returns EPERM, everything else is allowed.
    let filter = [
        libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 }, // ld [nr]
        libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: IO_URING_SETUP }, // jeq io_uring_setup
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x0005_0000 | libc::EPERM as u32 }, // ret ERRNO
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 }, // ret ALLOW
    ];
    let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut libc::sock_filter };
    // SAFETY: prctl with constant arguments, then with a filter program that outlives the call.
    let installed = unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            && libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog) == 0
    };
    if installed {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
