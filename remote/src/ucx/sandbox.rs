//! The confinement of the UCX plane's process, applied before UCX starts in it.
//!
//! Owns what that process may still do once a peer can write its memory (UCX's software RMA
//! handlers write and read wherever a peer's message says, on every transport that carries
//! messages): read system files (libraries, `/sys`, its own `/proc/self`, the RDMA device
//! nodes), and nothing else on the file system (Landlock: no data directory, no token file, no
//! home, no writes, no execution); no Unix-domain sockets (so not the owner's socket), no
//! `execve`, `ptrace` or cross-process memory calls (seccomp); no signals to processes outside
//! it (Landlock's scope, where the kernel has it). Never grants anything: on a kernel without
//! Landlock or seccomp the process runs unconfined and says so.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// What the confinement achieved (reported by the plane process on stderr).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Confinement {
    /// The Landlock ABI applied, or why none.
    pub landlock: Result<i64, String>,
    /// The seccomp filter installed, or why not.
    pub seccomp: Result<(), String>,
}

// Landlock's file-system rights (ABI 1: bits 0-12; 2: REFER; 3: TRUNCATE).
const FS_EXECUTE: u64 = 1 << 0;
const FS_WRITE_FILE: u64 = 1 << 1;
const FS_READ_FILE: u64 = 1 << 2;
const FS_READ_DIR: u64 = 1 << 3;
const FS_ABI1: u64 = (1 << 13) - 1;
const FS_REFER: u64 = 1 << 13;
const FS_TRUNCATE: u64 = 1 << 14;
const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
const SCOPE_SIGNAL: u64 = 1 << 1;
const CREATE_RULESET_VERSION: u32 = 1 << 0;
const RULE_PATH_BENEATH: u32 = 1;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// Directories and files the process may read: what the dynamic loader, UCX, libnuma and
/// rdma-core read while they start and while they make endpoints.
fn readable_paths() -> Vec<String> {
    let mut paths: Vec<String> = [
        "/usr",
        "/lib",
        "/lib64",
        "/etc/ld.so.cache",
        "/etc/ucx",
        "/etc/libibverbs.d",
        "/etc/rdma",
        "/sys",
        "/proc/self",
        "/proc/cpuinfo",
        "/proc/meminfo",
        "/proc/stat",
        "/proc/sys",
        "/dev/urandom",
    ]
    .iter()
    .map(|p| p.to_string())
    .collect();
    for var in ["LD_LIBRARY_PATH", "UCX_MODULE_DIR"] {
        if let Ok(v) = std::env::var(var) {
            paths.extend(v.split(':').filter(|p| p.starts_with('/')).map(str::to_string));
        }
    }
    // Wherever the libraries already loaded came from (libucp and libucs found through
    // ld.so.conf in another tree, say), and UCX's module directory beside them.
    for dir in loaded_library_dirs() {
        paths.push(format!("{dir}/ucx"));
        paths.push(dir);
    }
    paths
}

/// Device nodes opened for reading and writing: rdma-core opens `uverbs` devices read-write.
const WRITABLE_DEVICES: &[&str] = &["/dev/infiniband", "/dev/null"];

/// The directories of the shared objects mapped into this process.
fn loaded_library_dirs() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut dirs: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.starts_with('/') && p.contains(".so"))
        .filter_map(|p| std::path::Path::new(p).parent()?.to_str().map(str::to_string))
        .collect();
    dirs.sort_unstable();
    dirs.dedup();
    dirs
}

/// Confines this process (every thread: call it before any other thread starts).
pub(super) fn confine() -> Confinement {
    // SAFETY: prctl with integer arguments only. Needed by both, and keeps setuid binaries from
    // gaining privileges.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        let why = format!("no_new_privs: {}", std::io::Error::last_os_error());
        return Confinement { landlock: Err(why.clone()), seccomp: Err(why) };
    }
    Confinement { landlock: landlock(&readable_paths()), seccomp: seccomp() }
}

fn landlock(readable: &[String]) -> Result<i64, String> {
    // SAFETY: the version query takes no attribute.
    let abi =
        unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0, CREATE_RULESET_VERSION) };
    if abi < 1 {
        return Err(format!("Landlock is not available: {}", std::io::Error::last_os_error()));
    }
    let mut fs = FS_ABI1;
    if abi >= 2 {
        fs |= FS_REFER;
    }
    if abi >= 3 {
        fs |= FS_TRUNCATE;
    }
    let attr = RulesetAttr {
        handled_access_fs: fs,
        handled_access_net: 0,
        scoped: if abi >= 6 { SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL } else { 0 },
    };
    // SAFETY: a live attribute of the size given; the kernel takes the fields it knows (the
    // others are zero where it is older).
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0,
        )
    };
    if fd < 0 {
        return Err(format!("landlock_create_ruleset: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a descriptor the kernel just returned, owned here only.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let writable = WRITABLE_DEVICES.iter().map(|&p| (p, FS_WRITE_FILE));
    for (path, extra) in readable.iter().map(|p| (p.as_str(), 0)).chain(writable) {
        let Ok(c) = CString::new(path) else { continue };
        // SAFETY: a NUL-terminated path; O_PATH opens nothing for reading.
        let raw = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if raw < 0 {
            continue; // absent on this host
        }
        // SAFETY: as above.
        let parent = unsafe { OwnedFd::from_raw_fd(raw) };
        let is_dir = std::fs::metadata(path).is_ok_and(|m| m.is_dir());
        let rule = PathBeneathAttr {
            allowed_access: extra | if is_dir { FS_READ_FILE | FS_READ_DIR } else { FS_READ_FILE },
            parent_fd: parent.as_raw_fd(),
        };
        // SAFETY: a live rule for a live ruleset.
        let added = unsafe {
            libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset.as_raw_fd(),
                RULE_PATH_BENEATH,
                &rule as *const PathBeneathAttr,
                0,
            )
        };
        if added != 0 {
            return Err(format!("landlock_add_rule {path}: {}", std::io::Error::last_os_error()));
        }
    }
    debug_assert_eq!(fs & FS_EXECUTE, FS_EXECUTE, "execution is handled, so denied everywhere");
    // SAFETY: a live ruleset; restricts this thread and the ones it starts from now on.
    if unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0) } != 0 {
        return Err(format!("landlock_restrict_self: {}", std::io::Error::last_os_error()));
    }
    Ok(abi)
}

/// A classic BPF instruction (`struct sock_filter`).
#[repr(C)]
#[derive(Clone, Copy)]
struct SockFilter {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

#[repr(C)]
struct SockFprog {
    len: u16,
    filter: *const SockFilter,
}

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_EPERM: u32 = 0x0005_0000 | libc::EPERM as u32;
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;
/// `struct seccomp_data`: nr at 0, arch at 4, args from 16 (the low half of args[0] at 16 on a
/// little-endian machine).
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARG0_LOW: u32 = 16;

/// The filter: `socket(AF_UNIX, ...)`, `execve`, `execveat`, `ptrace`, `process_vm_readv`,
/// `process_vm_writev`, `pidfd_getfd` and `io_uring_setup` fail with EPERM; another
/// architecture's (and x32's) calls fail too; the rest pass.
fn filter() -> Vec<SockFilter> {
    let ins = |code, jt, jf, k| SockFilter { code, jt, jf, k };
    let denied = [
        libc::SYS_execve,
        libc::SYS_execveat,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_pidfd_getfd,
        // Its socket and connect operations would pass this filter unseen.
        libc::SYS_io_uring_setup,
    ];
    let mut f = vec![
        ins(BPF_LD_W_ABS, 0, 0, DATA_ARCH),
        ins(BPF_JEQ_K, 1, 0, AUDIT_ARCH),
        ins(BPF_RET_K, 0, 0, RET_EPERM),
        ins(BPF_LD_W_ABS, 0, 0, DATA_NR),
        // x32 calls carry this bit under the x86-64 arch value: all refused.
        ins(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT),
        ins(BPF_RET_K, 0, 0, RET_EPERM),
    ];
    for nr in denied {
        // Equal: skip the next instruction (the jump on) to the EPERM after the list.
        f.push(ins(BPF_JEQ_K, 0, 1, nr as u32));
        f.push(ins(BPF_RET_K, 0, 0, RET_EPERM));
    }
    f.extend([
        ins(BPF_JEQ_K, 0, 3, libc::SYS_socket as u32),
        ins(BPF_LD_W_ABS, 0, 0, DATA_ARG0_LOW),
        ins(BPF_JEQ_K, 0, 1, libc::AF_UNIX as u32),
        ins(BPF_RET_K, 0, 0, RET_EPERM),
        ins(BPF_RET_K, 0, 0, RET_ALLOW),
    ]);
    f
}

fn seccomp() -> Result<(), String> {
    let f = filter();
    let prog = SockFprog { len: f.len() as u16, filter: f.as_ptr() };
    // SAFETY: a live program of `len` instructions; the kernel copies it. TSYNC: every thread.
    let done = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &prog as *const SockFprog,
        )
    };
    if done != 0 {
        return Err(format!("seccomp: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// `kvtide-owner __ucx-plane-confined <path>`: confines itself as the plane does, then tries
/// what a peer that took over the plane would: read `path`, write a file beside it, open a Unix
/// socket, run a program. Prints one line per attempt (`denied` or `ALLOWED`) for the tests.
pub fn self_check(args: &[String]) -> i32 {
    let Some(path) = args.first() else {
        eprintln!("usage: __ucx-plane-confined <file to try>");
        return 2;
    };
    let confinement = confine();
    println!("landlock {:?}", confinement.landlock);
    println!("seccomp {:?}", confinement.seccomp);
    let verdict = |ok: bool| if ok { "ALLOWED" } else { "denied" };
    println!("read {}", verdict(std::fs::read(path).is_ok()));
    println!("write {}", verdict(std::fs::write(format!("{path}.written"), b"x").is_ok()));
    // SAFETY: socket with integer arguments; closed right away if made.
    let unix = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
    println!("unix-socket {}", verdict(unix >= 0));
    if unix >= 0 {
        // SAFETY: a descriptor made above.
        unsafe { libc::close(unix) };
    }
    // SAFETY: as above.
    let inet = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    println!("inet-socket {}", verdict(inet >= 0));
    if inet >= 0 {
        // SAFETY: a descriptor made above.
        unsafe { libc::close(inet) };
    }
    println!("exec {}", verdict(std::process::Command::new("/bin/true").status().is_ok()));
    let mut params = [0u8; 120];
    // SAFETY: a zeroed io_uring_params of the kernel's size; the ring is closed if made.
    let ring = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    println!("io-uring {}", verdict(ring >= 0));
    if ring >= 0 {
        // SAFETY: a descriptor made above.
        unsafe { libc::close(ring as i32) };
    }
    println!("system-read {}", verdict(std::fs::read("/proc/self/status").is_ok()));
    0
}
