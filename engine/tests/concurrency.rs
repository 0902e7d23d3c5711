//! Eight caller threads mixing every operation on a small, evicting pool. Every byte read is
//! checked against the version that was written; counters return to zero at the end.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_idle, value_for};
use kvtide::{Error, Fragment, PutOptions, Region, Store, StoreBuilder};
use rand::{rngs::StdRng, Rng, SeedableRng};

const KEYS: u64 = 96;
const THREADS: u64 = 8;

/// Values embed their version in the first 8 bytes so a reader can check any version it sees.
fn versioned(key: &[u8], version: u64, len: usize) -> Vec<u8> {
    let mut v = value_for(key, version, len.max(8));
    v[..8].copy_from_slice(&version.to_le_bytes());
    v
}

fn check(key: &[u8], bytes: &[u8]) {
    assert!(bytes.len() >= 8, "short object for {key:?}");
    let version = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let len = bytes.len();
    assert_eq!(
        bytes,
        &versioned(key, version, len)[..],
        "wrong bytes for {:?} v{version}",
        String::from_utf8_lossy(key)
    );
}

fn len_for(key_index: u64, version: u64) -> usize {
    // Sizes vary per version so a torn mix of two versions cannot pass the check.
    (1024 + (key_index * 977 + version * 131) % (48 << 10)) as usize
}

#[test]
fn eight_threads_mixing_every_operation() {
    let store = Arc::new(
        StoreBuilder::new().dram_bytes(4 << 20).shards(2).pin_threads(false).idle_spin_us(10).open().expect("open"),
    );
    let versions = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = Arc::clone(&store);
            let versions = Arc::clone(&versions);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(t);
                let mut ops = 0u64;
                let deadline = Instant::now() + Duration::from_secs(3);
                while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                    ops += 1;
                    let k = rng.random_range(0..KEYS);
                    let key = format!("c/{k}").into_bytes();
                    match rng.random_range(0..12) {
                        0 | 1 => {
                            let version = versions[k as usize].fetch_add(1, Ordering::Relaxed) + 1;
                            let value = versioned(&key, version, len_for(k, version));
                            match store.put(&key, &value, PutOptions::UPSERT) {
                                Ok(()) | Err(Error::NoSpace) => {}
                                Err(e) => panic!("put: {e}"),
                            }
                        }
                        2 => {
                            let version = versions[k as usize].fetch_add(1, Ordering::Relaxed) + 1;
                            let value = versioned(&key, version, len_for(k, version));
                            let parts: Vec<Region<'_>> = value.chunks(4000).map(Region::host_readonly).collect();
                            match store.put_from(&key, &parts, PutOptions::INSERT) {
                                Ok(()) | Err(Error::AlreadyExists) | Err(Error::NoSpace) => {}
                                Err(e) => panic!("put_from: {e}"),
                            }
                        }
                        3 | 4 => match store.get(&key) {
                            Ok(bytes) => check(&key, &bytes),
                            Err(Error::NotFound) => {}
                            Err(e) => panic!("get: {e}"),
                        },
                        5 => {
                            let mut buf = vec![0u8; 64 << 10];
                            match store.get_into(&key, Region::host(&mut buf)) {
                                Ok(n) => check(&key, &buf[..n]),
                                Err(Error::NotFound) => {}
                                Err(e) => panic!("get_into: {e}"),
                            }
                        }
                        6 => {
                            // Scatter into two halves sized from a fresh lease of the object.
                            let Ok(lease) = store.lease(&key, 10_000) else { continue };
                            let len = lease.len() as usize;
                            let mut first = vec![0u8; len / 2];
                            let mut second = vec![0u8; len - len / 2];
                            let r = store.batch_get_into_multi_buffers(
                                &[&key],
                                &[vec![Region::host(&mut first), Region::host(&mut second)]],
                            );
                            check(&key, lease.bytes().expect("lease"));
                            match &r[0] {
                                Ok(_) => {
                                    first.extend_from_slice(&second);
                                    check(&key, &first);
                                }
                                // Replaced meanwhile by a version of another size, or evicted.
                                Err(Error::SizeMismatch { .. }) | Err(Error::NotFound) => {}
                                Err(e) => panic!("batch get: {e}"),
                            }
                        }
                        7 => {
                            let mut buf = vec![0u8; 16];
                            let frags =
                                vec![vec![Fragment::new(key.clone(), 0, 0, 8), Fragment::new(key.clone(), 0, 8, 8)]];
                            let r = store.get_into_ranges(&[Region::host(&mut buf)], &frags);
                            for x in &r[0] {
                                assert!(matches!(x, Ok(8) | Err(Error::NotFound)), "{x:?}");
                            }
                            if r[0].iter().all(|x| x.is_ok()) {
                                assert_eq!(buf[..8], buf[8..], "one lease per key per call");
                            }
                        }
                        8 => {
                            let keys: Vec<Vec<u8>> = (k..k + 4).map(|i| format!("c/{i}").into_bytes()).collect();
                            let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
                            let hits = store.prefix_hits(&refs).expect("prefix");
                            assert!(hits <= 4);
                            assert_eq!(store.batch_exists(&refs).len(), 4);
                        }
                        9 => match store.remove(&key, rng.random_bool(0.5)) {
                            Ok(()) | Err(Error::NotFound) | Err(Error::Leased) | Err(Error::Pinned) => {}
                            Err(e) => panic!("remove: {e}"),
                        },
                        10 => {
                            if store.pin(&key).is_ok() {
                                if let Ok(bytes) = store.get(&key) {
                                    check(&key, &bytes);
                                }
                                // A forced remove by another thread may have dropped the pin.
                                let _ = store.unpin(&key);
                            }
                        }
                        _ => {
                            let _ = store.exists(&key).expect("exists");
                            let _ = store.stats();
                        }
                    }
                }
                ops
            })
        })
        .collect();
    let mut total_ops = 0;
    for t in threads {
        match t.join() {
            Ok(ops) => total_ops += ops,
            Err(panic) => {
                stop.store(true, Ordering::Relaxed);
                std::panic::resume_unwind(panic);
            }
        }
    }
    assert!(total_ops > 1000, "only {total_ops} operations ran");
    assert_idle(&store);
    let stats = store.stats();
    assert!(stats.total.published_reads > 0, "reads went through the published index");
    assert!(stats.total.bytes_used <= stats.total.capacity_bytes);
    assert_eq!(stats.total.pinned_objects, 0, "every pin was undone or dropped by a forced remove");
}

/// Readers on other threads hammer one key through the published index while it is upserted and
/// removed: once a put returns, no read sees an older version; once a remove returns, no read
/// finds the key; the versions readers see never go back; nothing stays held.
#[test]
fn no_read_sees_a_version_older_than_the_last_acknowledged_call() {
    let store = Arc::new(
        StoreBuilder::new().dram_bytes(8 << 20).shards(2).pin_threads(false).idle_spin_us(10).open().expect("open"),
    );
    let key = b"race/0".to_vec();
    // The newest acknowledged state: version (0 = removed).
    let acknowledged = Arc::new(AtomicU64::new(0));
    // Odd while a remove runs (a seqlock): a NotFound is wrong unless one overlapped the read.
    let removals = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (store, key, acknowledged, stop, removals) =
                (Arc::clone(&store), key.clone(), Arc::clone(&acknowledged), Arc::clone(&stop), Arc::clone(&removals));
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let removals_before = removals.load(Ordering::SeqCst);
                    let floor = acknowledged.load(Ordering::SeqCst);
                    let got = store.get_into(&key, Region::host(&mut buf));
                    let no_remove_overlapped =
                        removals_before % 2 == 0 && removals.load(Ordering::SeqCst) == removals_before;
                    match got {
                        Ok(n) => {
                            check(&key, &buf[..n]);
                            let version = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                            // Removes publish 0, so only a floor from a put binds.
                            assert!(
                                floor == 0 || version >= floor,
                                "read version {version} after {floor} was acknowledged"
                            );
                        }
                        Err(Error::NotFound) => assert!(
                            floor == 0 || !no_remove_overlapped,
                            "version {floor} was acknowledged and not removed, yet the key was not found"
                        ),
                        Err(e) => panic!("get_into: {e}"),
                    }
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    for version in 1..=1000u64 {
        let value = versioned(&key, version, len_for(0, version));
        store.put(&key, &value, PutOptions::UPSERT).expect("upsert");
        acknowledged.store(version, Ordering::SeqCst);
        let mut buf = vec![0u8; 64 << 10];
        let n = store.get_into(&key, Region::host(&mut buf)).expect("read my write");
        assert_eq!(&buf[..n], &value[..], "version {version}");
        if version % 7 == 0 {
            removals.fetch_add(1, Ordering::SeqCst);
            store.remove(&key, true).expect("remove");
            acknowledged.store(0, Ordering::SeqCst);
            removals.fetch_add(1, Ordering::SeqCst);
            assert_eq!(store.get_into(&key, Region::host(&mut buf)), Err(Error::NotFound), "removed at {version}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|r| r.join().expect("reader")).sum();
    assert!(reads > 0);
    assert!(store.stats().total.published_reads > 0);
    assert_idle(&store);
}
