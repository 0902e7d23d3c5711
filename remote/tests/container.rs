//! The owner where a container's default seccomp profile refuses io_uring (Docker 25+,
//! containerd): `kvtide-owner` runs under a seccomp filter that refuses `io_uring_setup`. With
//! the SSD tier left to its default it runs DRAM only and its log says why; with the SSD tier
//! asked for it refuses to start and says what to allow.

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvtide::{PutOptions, Store};
use kvtide_remote::RemoteStore;

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvtide-container-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("temp dir");
    p
}

/// `kvtide-owner` on `dir` with `args`, under the filter; its log goes to `dir/owner.log`.
fn spawn_without_io_uring(dir: &std::path::Path, args: &[&str]) -> std::process::Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvtide-owner"));
    command
        .args(["--data-dir", &dir.join("data").display().to_string(), "--tcp", "off", "--dram-bytes", "64MiB"])
        .args(args)
        .env("KVTIDE_LOG", "info")
        .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("owner.log")).expect("log"));
    // SAFETY: the closure only makes prctl system calls on memory of its own frame.
    unsafe { command.pre_exec(common::seccomp::refuse_io_uring_setup) };
    command.spawn().expect("spawn kvtide-owner")
}

#[cfg(target_arch = "x86_64")]
#[test]
fn where_io_uring_is_refused_the_owner_runs_dram_only_and_says_so() {
    let dir = tmp("no-uring");
    let mut owner = spawn_without_io_uring(&dir, &[]);
    let socket = format!("unix:{}", dir.join("data/owner.sock").display());
    let deadline = Instant::now() + Duration::from_secs(60);
    let store = loop {
        match RemoteStore::connect(&socket) {
            Ok(store) => break store,
            Err(e) => {
                if let Ok(Some(status)) = owner.try_wait() {
                    let log = std::fs::read_to_string(dir.join("owner.log")).unwrap_or_default();
                    panic!("the owner exited with {status} although it may run DRAM only: {log}");
                }
                assert!(Instant::now() < deadline, "the owner never served: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    store.put(b"no-uring", &[9u8; 50_000], PutOptions::UPSERT).expect("put");
    assert_eq!(store.get(b"no-uring").expect("get"), vec![9u8; 50_000]);
    drop(store);
    // SAFETY: kill with the pid of our own child and a valid signal.
    unsafe { libc::kill(owner.id() as libc::pid_t, libc::SIGTERM) };
    assert!(owner.wait().expect("reap").success());
    let log = std::fs::read_to_string(dir.join("owner.log")).expect("log");
    assert!(log.contains("io_uring is off or refused here") && log.contains("runs DRAM only"), "{log}");
    assert!(!dir.join("data/ssd").exists(), "no SSD tier was made");

    // Asked for, the SSD tier is not dropped: the owner refuses to start and says what to allow.
    let mut owner = spawn_without_io_uring(&dir, &["--ssd-bytes", "64MiB", "--ssd-segment-bytes", "4MiB"]);
    let status = owner.wait().expect("wait");
    let log = std::fs::read_to_string(dir.join("owner.log")).expect("log");
    assert!(!status.success(), "{log}");
    assert!(log.contains("io_uring is refused") && log.contains("io_uring_setup"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
