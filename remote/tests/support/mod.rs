//! Helpers shared by the owner's integration tests (`remote.rs`, `holds.rs`, `owner_durability.rs`,
//! `stop.rs`): the test token, a small engine, a per-test directory, clients of an owner, the wait
//! until the owner and its engine hold nothing, and the `kvtide-owner` binary and the wait until
//! it serves.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::{Engine, Store, StoreBuilder};
use kvtide_remote::{ClientOptions, Owner, RemoteStore, Token};

pub const TOKEN: &[u8] = b"test-token-0123456789abcdef";

/// An engine of `dram_bytes` over `shards` shards, no CPU pinning, short idle spin.
pub fn engine(dram_bytes: u64, shards: usize) -> Arc<Engine> {
    Arc::new(
        StoreBuilder::new()
            .dram_bytes(dram_bytes)
            .shards(shards)
            .pin_threads(false)
            .idle_spin_us(20)
            .register_fixed_buffers(false)
            .open()
            .expect("open store"),
    )
}

/// A fresh directory for one test of this process.
pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvtide-remote-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

pub fn token() -> Token {
    Token::new(TOKEN).expect("token")
}

pub fn options() -> ClientOptions {
    ClientOptions { token: Some(token()), timeout_ms: 10_000, ..ClientOptions::default() }
}

/// A client on the owner's Unix socket, with the arena mapped.
pub fn unix_client(owner: &Owner) -> RemoteStore {
    let path = owner.unix_path().expect("unix").display().to_string();
    let store = RemoteStore::connect_with(&format!("unix:{path}"), options()).expect("connect unix");
    assert!(store.uses_shared_memory(), "Unix clients map the arena");
    store
}

/// A client on the owner's Unix socket whose puts go through the put window (no direct puts).
pub fn window_client(owner: &Owner) -> RemoteStore {
    let path = owner.unix_path().expect("unix").display().to_string();
    let options = ClientOptions { direct_puts: false, ..options() };
    RemoteStore::connect_with(&format!("unix:{path}"), options).expect("connect unix")
}

/// Waits until the engine holds no lease and the owner no outstanding lease.
pub fn wait_idle(owner: &Owner) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        owner.engine().sync_shards().expect("sync");
        let held = owner.engine().stats().held_resources();
        let outstanding = owner.counters().leases_outstanding.load(Ordering::SeqCst);
        if held.is_zero() && outstanding == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "still held: {held:?}, owner leases {outstanding}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The owner binary cargo built for this test; a test binary copied to another machine (the
/// GPU machine's pack) finds it on `PATH` instead.
pub fn owner_binary() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvtide-owner"));
    if built.exists() {
        built
    } else {
        "kvtide-owner".into()
    }
}

/// Waits (`timeout_s` at most) until a client connects to the owner `child` started at
/// `socket`; fails if the owner exits first.
pub fn wait_served(child: &mut std::process::Child, socket: &str, timeout_s: u64) -> RemoteStore {
    let deadline = Instant::now() + Duration::from_secs(timeout_s);
    loop {
        match RemoteStore::connect(socket) {
            Ok(store) => return store,
            Err(e) => {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("kvtide-owner exited with {status} before serving at {socket}");
                }
                assert!(Instant::now() < deadline, "the owner never served at {socket}: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// One `recvmsg`, collecting a descriptor passed with the bytes.
pub fn recv_with_fd(s: &std::os::unix::net::UnixStream, buf: &mut [u8]) -> (usize, Option<std::os::fd::OwnedFd>) {
    #[repr(C, align(8))]
    struct Cmsg([u8; 64]);
    let mut cmsg = Cmsg([0; 64]);
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.0.as_mut_ptr().cast();
    msg.msg_controllen = cmsg.0.len();
    // SAFETY: iov and the control buffer are live and sized as described for the call.
    let n = unsafe { libc::recvmsg(std::os::fd::AsRawFd::as_raw_fd(s), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(n >= 0, "recvmsg: {}", std::io::Error::last_os_error());
    let mut fd = None;
    // SAFETY: the kernel filled the control buffer; CMSG_* walk only inside it, and an
    // SCM_RIGHTS payload holds descriptors that are now ours.
    unsafe {
        let mut hdr = libc::CMSG_FIRSTHDR(&msg);
        while !hdr.is_null() {
            if (*hdr).cmsg_level == libc::SOL_SOCKET && (*hdr).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(hdr).cast::<std::os::fd::RawFd>());
                fd = Some(std::os::fd::FromRawFd::from_raw_fd(raw));
            }
            hdr = libc::CMSG_NXTHDR(&msg, hdr);
        }
    }
    (n as usize, fd)
}
