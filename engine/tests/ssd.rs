//! The SSD tier on the real disk through io_uring: demotion, every read path on SSD-resident
//! objects, recovery after reopening, corruption, bad data directories.

mod common;

use std::path::PathBuf;

use common::{assert_idle, value_for};
use kvtide::{Engine, Error, Fragment, PutOptions, Region, Store, StoreBuilder};

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvtide-ssd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn open(dir: &PathBuf, write_through: bool) -> Engine {
    StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(2)
        .pin_threads(false)
        .idle_spin_us(10)
        .ssd_dir(dir)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(4 << 20)
        .write_through(write_through)
        .open()
        .expect("open with SSD tier")
}

fn key(i: u64) -> Vec<u8> {
    format!("ssd/{i}").into_bytes()
}

#[test]
fn eviction_demotes_and_every_read_path_restores() {
    let dir = tmp("demote");
    let store = open(&dir, false);
    let n = 120u64; // 120 x 96 KiB = 11 MiB through an 8 MiB pool
    for i in 0..n {
        store.put(&key(i), &value_for(&key(i), i, 96 << 10), PutOptions::INSERT).expect("put");
    }
    store.sync_shards().expect("sync");
    let stats = store.stats();
    assert!(stats.total.demotions > 0, "{stats:?}");
    // get
    for i in 0..n {
        assert_eq!(store.get(&key(i)).expect("get"), value_for(&key(i), i, 96 << 10), "key {i}");
    }
    let stats = store.stats();
    assert!(stats.total.loads > 0 && stats.total.ssd_read_bytes > 0, "{stats:?}");
    // batch scatter over a mix of DRAM and SSD objects, with a missing key in the middle
    let keys: Vec<Vec<u8>> = (0..n).map(key).chain([b"missing".to_vec()]).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let mut bufs: Vec<Vec<u8>> = (0..=n).map(|_| vec![0u8; 96 << 10]).collect();
    let results = {
        let dsts: Vec<Vec<Region<'_>>> =
            bufs.iter_mut().map(|b| b.chunks_mut(32 << 10).map(Region::host).collect()).collect();
        store.batch_get_into_multi_buffers(&refs, &dsts)
    };
    for i in 0..n as usize {
        assert_eq!(results[i], Ok(96 << 10), "key {i}");
        assert_eq!(bufs[i], value_for(&keys[i], i as u64, 96 << 10));
    }
    assert_eq!(results[n as usize], Err(Error::NotFound));
    // ranges
    let mut buf = vec![0u8; 200];
    let frags = vec![vec![Fragment::new(key(3), 1000, 0, 100), Fragment::new(key(77), 5, 100, 100)]];
    let r = store.get_into_ranges(&[Region::host(&mut buf)], &frags);
    assert_eq!(r[0], vec![Ok(100), Ok(100)]);
    assert_eq!(&buf[..100], &value_for(&key(3), 3, 96 << 10)[1000..1100]);
    assert_eq!(&buf[100..], &value_for(&key(77), 77, 96 << 10)[5..105]);
    assert_idle(&store);
    let t = store.stats().total;
    assert!(t.ssd_objects > 0 && t.dram_objects > 0, "objects in both tiers: {t:?}");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn reopen_recovers_objects_and_removals() {
    let dir = tmp("reopen");
    {
        let store = open(&dir, true);
        for i in 0..40 {
            store.put(&key(i), &value_for(&key(i), i, 64 << 10), PutOptions::INSERT).expect("durable put");
        }
        store.remove(&key(5), false).expect("remove");
        store.put(&key(6), &value_for(&key(6), 1006, 1000), PutOptions::UPSERT).expect("upsert");
        store.sync_shards().expect("sync");
        assert!(store.stats().total.syncs > 0);
    }
    let store = open(&dir, true);
    let recovered: u64 = store.recovery_reports().iter().map(|r| r.objects).sum();
    assert_eq!(recovered, 39, "{:?}", store.recovery_reports());
    assert_eq!(store.get(&key(5)), Err(Error::NotFound), "removed keys stay removed");
    assert_eq!(store.get(&key(6)).expect("upserted"), value_for(&key(6), 1006, 1000));
    for i in (0..40).filter(|&i| i != 5 && i != 6) {
        assert_eq!(store.get(&key(i)).expect("recovered"), value_for(&key(i), i, 64 << 10), "key {i}");
    }
    assert_idle(&store);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flipped_bits_on_disk_fail_only_that_record() {
    let dir = tmp("rot");
    {
        let store = StoreBuilder::new()
            .dram_bytes(8 << 20)
            .shards(1)
            .pin_threads(false)
            .ssd_dir(&dir)
            .ssd_bytes(32 << 20)
            .ssd_segment_bytes(4 << 20)
            .write_through(true)
            .open()
            .expect("open");
        store.put(b"first", &[1u8; 10_000], PutOptions::INSERT).expect("first");
        store.put(b"second", &[2u8; 10_000], PutOptions::INSERT).expect("second");
    }
    // Segment 0: header block, then "first" (3 blocks), then "second". Rot one byte of each:
    // the scan skips "first"; "second" rots after recovery and is caught at read time.
    let seg = dir.join("shard-000/seg-000000.kvt");
    let mut bytes = std::fs::read(&seg).expect("read segment");
    bytes[4096 + 64 + 5 + 700] ^= 0x20;
    std::fs::write(&seg, &bytes).expect("write segment");
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_dir(&dir)
        .ssd_bytes(32 << 20)
        .ssd_segment_bytes(4 << 20)
        .open()
        .expect("reopen");
    let report = &store.recovery_reports()[0];
    assert_eq!(report.objects, 1, "{report:?}");
    assert!(report.discarded.iter().any(|(_, _, why)| why.contains("checksum")), "{report:?}");
    assert_eq!(store.get(b"first"), Err(Error::NotFound));
    bytes[4096 + 3 * 4096 + 64 + 6 + 10] ^= 0x01;
    std::fs::write(&seg, &bytes).expect("rot second");
    match store.get(b"second") {
        Err(Error::Corrupted(_)) => {}
        other => panic!("expected Corrupted, got {other:?}"),
    }
    assert_eq!(store.get(b"second"), Err(Error::NotFound), "a corrupted record is dropped");
    store.put(b"third", b"still serving", PutOptions::INSERT).expect("DRAM keeps serving");
    assert_eq!(store.get(b"third").expect("third"), b"still serving");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_data_directories_are_clear_errors() {
    let dir = tmp("layout");
    drop(open(&dir, false));
    // Other shard count.
    let err = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_dir(&dir)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(4 << 20)
        .open()
        .expect_err("layout mismatch");
    assert!(err.to_string().contains("was created with"), "{err}");
    // Other format version.
    std::fs::write(dir.join("FORMAT"), "kvtide-ssd-format=7\nshards=2\n").expect("write");
    let err = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(2)
        .pin_threads(false)
        .ssd_dir(&dir)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(4 << 20)
        .open()
        .expect_err("version");
    assert!(err.to_string().contains("format version 7"), "{err}");
    // A directory we cannot create.
    let err = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_dir("/proc/kvtide/nope")
        .open()
        .expect_err("unwritable");
    assert!(err.to_string().contains("/proc/kvtide/nope"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn async_tickets_restore_from_ssd() {
    let dir = tmp("ticket");
    let store = open(&dir, false);
    for i in 0..100 {
        store.put(&key(i), &value_for(&key(i), i, 128 << 10), PutOptions::INSERT).expect("put");
    }
    let keys: Vec<Vec<u8>> = (0..100).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let bufs: Vec<&'static mut [u8]> = (0..100).map(|_| Box::leak(vec![0u8; 128 << 10].into_boxed_slice())).collect();
    let addrs: Vec<u64> = bufs.iter().map(|b| b.as_ptr() as u64).collect();
    let dsts = bufs.into_iter().map(|b| vec![Region::host(b)]).collect();
    let results = store.submit_batch_get(&refs, dsts).expect("submit").wait();
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r, &Ok(128 << 10), "key {i}");
        // SAFETY: the ticket completed; nothing writes these leaked buffers any more.
        let got = unsafe { std::slice::from_raw_parts(addrs[i] as *const u8, 128 << 10) };
        assert_eq!(got, &value_for(&keys[i], i as u64, 128 << 10)[..]);
    }
    assert_idle(&store);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Measures open (recovery scan) time on a full tier. Run by hand:
/// `KVTIDE_RECOVERY_GIB=4 cargo test --release -p kvtide --test ssd recovery_open_time -- --ignored --nocapture`
#[test]
#[ignore = "measurement, not a check: fills GiBs of disk"]
fn recovery_open_time() {
    let gib: u64 = std::env::var("KVTIDE_RECOVERY_GIB").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let dir = std::env::temp_dir().join(format!("kvtide-recovery-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let build = || {
        StoreBuilder::new()
            .dram_bytes(256 << 20)
            .shards(2)
            .ssd_dir(&dir)
            .ssd_bytes(gib << 30)
            .ssd_segment_bytes(64 << 20)
            .write_through(true)
    };
    let value = vec![0x5Au8; 1 << 20];
    // Three quarters full: above 80% live the tier makes room by letting cold records go.
    let objects = (gib << 30) / (1 << 20) * 3 / 4;
    {
        let store = build().open().expect("open");
        let keys: Vec<Vec<u8>> = (0..objects).map(key).collect();
        for chunk in keys.chunks(64) {
            let refs: Vec<&[u8]> = chunk.iter().map(|k| k.as_slice()).collect();
            let srcs: Vec<Vec<Region<'_>>> = chunk.iter().map(|_| vec![Region::host_readonly(&value)]).collect();
            for r in store.batch_put_from_multi_buffers(&refs, &srcs, PutOptions::UPSERT) {
                r.expect("durable put");
            }
        }
    }
    let started = std::time::Instant::now();
    let store = build().open().expect("reopen");
    let elapsed = started.elapsed();
    let recovered: u64 = store.recovery_reports().iter().map(|r| r.objects).sum();
    let bytes: u64 = store.recovery_reports().iter().map(|r| r.bytes).sum();
    println!(
        "recovery: {recovered} objects, {:.2} GiB scanned in {:.2?} ({:.2} GB/s)",
        bytes as f64 / (1u64 << 30) as f64,
        elapsed,
        bytes as f64 / elapsed.as_secs_f64() / 1e9
    );
    assert_eq!(recovered, objects);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A store opened without a shard count adopts the SSD directory's (part of its layout), so a
/// restart under another CPU mask opens the same directory; an explicit other count is refused
/// with an error that says how to proceed.
#[test]
fn an_unset_shard_count_adopts_the_directorys() {
    let dir = tmp("adopt-shards");
    let builder = || {
        StoreBuilder::new()
            .dram_bytes(16 << 20)
            .pin_threads(false)
            .ssd_dir(&dir)
            .ssd_bytes(48 << 20)
            .ssd_segment_bytes(1 << 20)
    };
    let store = builder().shards(3).open().expect("first open, 3 shards");
    store.put(b"kept", &value_for(b"kept", 1, 10_000), PutOptions::INSERT).expect("put");
    // The slices are registered as fixed buffers in the background after the store opened.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !store.stats().total.fixed_buffers_registered && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(store.stats().total.fixed_buffers_registered, "registration finishes (RLIMIT_MEMLOCK permitting)");
    drop(store);
    let store = builder().open().expect("reopen without a shard count");
    assert_eq!(store.shard_count(), 3);
    assert_eq!(store.get(b"kept").expect("kept"), value_for(b"kept", 1, 10_000));
    drop(store);
    let e = builder().shards(2).open().expect_err("an explicit other count");
    assert!(e.to_string().contains("unset to adopt"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A load still running when a read finds no room waits for it: the loaded object (leased by
/// nobody once a progressive reader dropped its lease early) is freed when its load ends, and
/// the read then gets its room, where it used to get `NoSpace` at once.
#[test]
fn a_read_that_finds_no_room_waits_for_loads_in_flight() {
    let store = StoreBuilder::new()
        .dram_bytes(4 << 20)
        .shards(1)
        .pin_threads(false)
        .idle_spin_us(10)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(16 << 20)
        .simulated_ssd(3, kvtide::SimFaults { us_per_mib: 100_000, ..kvtide::SimFaults::default() })
        .promote_on_hit(false)
        .open()
        .expect("open");
    let len = 3 << 20;
    for i in 0..3u64 {
        store.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    store.sync_shards().expect("sync");
    // key 0 is on SSD only; its load takes about 0.3 s. A reader that only wanted its start
    // gives the lease back at once, while the load goes on.
    let early = store.lease_progressive(&key(0), 60_000).expect("progressive lease");
    drop(early);
    // key 1 (on SSD too) cannot fit beside the running load.
    assert_eq!(store.get(&key(1)).expect("read once the load ended"), value_for(&key(1), 1, len));
    assert_idle(&store);
}
