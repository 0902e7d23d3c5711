//! Shards without io_uring (`[runtime] io_uring = false`, or refused by a container's seccomp
//! profile): a DRAM-only store parks its shards with poll(2) on their eventfds and serves as
//! usual, timers included; an SSD tier refuses to start and says why.

mod common;

use std::time::{Duration, Instant};

use common::{assert_idle, value_for};
use kvtide::{PutOptions, Region, Store, StoreBuilder};

fn store() -> kvtide::Engine {
    StoreBuilder::new()
        .dram_bytes(32 << 20)
        .shards(2)
        .pin_threads(false)
        .idle_spin_us(10)
        .io_uring(false)
        .open()
        .expect("a DRAM-only store opens without io_uring")
}

#[test]
fn a_dram_only_store_parks_with_poll_and_serves() {
    let store = store();
    let keys: Vec<Vec<u8>> = (0..64u32).map(|i| format!("no-uring/{i}").into_bytes()).collect();
    for key in &keys {
        store.put(key, &value_for(key, 1, 20_000), PutOptions::INSERT).expect("put");
    }
    // Let the shards park, then wake them with requests.
    std::thread::sleep(Duration::from_millis(200));
    let parks_before = store.stats().total.parks;
    assert!(parks_before > 0, "idle shards park");
    for round in 0..3 {
        std::thread::sleep(Duration::from_millis(50));
        // Reads of DRAM-resident objects need no shard, and puts to a parked shard run on this
        // thread (`lend`); a message wakes it.
        for key in &keys {
            store.put(key, &value_for(key, 1, 20_000), PutOptions::UPSERT).expect("upsert");
        }
        store.sync_shards().expect("a barrier wakes the parked shards");
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; 20_000]).collect();
        let dsts: Vec<Vec<Region<'_>>> = out.iter_mut().map(|b| vec![Region::host(b)]).collect();
        for r in store.batch_get_into_multi_buffers(&refs, &dsts) {
            assert_eq!(r, Ok(20_000), "round {round}");
        }
        drop(dsts);
        for (key, got) in keys.iter().zip(&out) {
            assert_eq!(*got, value_for(key, 1, 20_000));
        }
    }
    assert!(store.stats().total.parks > parks_before, "parked again between rounds, and was woken");
    // A lease deadline wakes a parked shard by itself (the poll timeout).
    let lease = store.lease(&keys[0], 10).expect("lease");
    std::thread::sleep(Duration::from_millis(1500));
    let s = store.stats().total;
    assert_eq!((s.leases_expired, s.leases_held), (1, 0), "expired while the shard was parked");
    drop(lease);
    assert_eq!(store.remove(&keys[0], false), Ok(()));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !store.stats().held_resources().is_zero() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_idle(&store);
}

#[test]
fn an_ssd_tier_without_io_uring_is_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("kvtide-no-uring-{}", std::process::id()));
    let e = StoreBuilder::new()
        .dram_bytes(16 << 20)
        .shards(1)
        .pin_threads(false)
        .io_uring(false)
        .ssd_dir(&dir)
        .ssd_bytes(16 << 20)
        .ssd_segment_bytes(1 << 20)
        .open()
        .expect_err("an SSD tier needs io_uring");
    assert!(e.to_string().contains("needs io_uring"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Blocks io_uring_setup with EPERM for this process, as container seccomp profiles do.
#[cfg(target_arch = "x86_64")]
fn refuse_io_uring() {
    common::seccomp::refuse_io_uring_setup().expect("install the seccomp filter");
}

/// In a child process whose seccomp filter refuses io_uring (the Docker/containerd case): a
/// DRAM-only store opens by itself and serves; one with an SSD tier refuses with the reason.
#[cfg(target_arch = "x86_64")]
#[test]
fn where_io_uring_is_refused_a_dram_only_store_still_works() {
    if std::env::var_os("NO_IO_URING_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().expect("exe"))
            .args([
                "--exact",
                "where_io_uring_is_refused_a_dram_only_store_still_works",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("NO_IO_URING_CHILD", "1")
            .output()
            .expect("run the child");
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("child: ok"), "{text}");
        return;
    }
    refuse_io_uring();
    let store =
        StoreBuilder::new().dram_bytes(16 << 20).shards(2).pin_threads(false).open().expect("DRAM-only opens anyway");
    store.put(b"k", &value_for(b"k", 1, 5000), PutOptions::INSERT).expect("put");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(store.get(b"k"), Ok(value_for(b"k", 1, 5000)));
    drop(store);
    let dir = std::env::temp_dir().join(format!("kvtide-refused-uring-{}", std::process::id()));
    let e = StoreBuilder::new()
        .dram_bytes(16 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_dir(&dir)
        .ssd_bytes(16 << 20)
        .ssd_segment_bytes(1 << 20)
        .open()
        .expect_err("an SSD tier needs io_uring");
    assert!(e.to_string().contains("seccomp") && e.to_string().contains("io_uring"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    println!("child: ok");
}
