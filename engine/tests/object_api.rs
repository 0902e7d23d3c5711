//! The object API end to end on the embedded engine: every operation, every error path, and
//! held-resource counters back at zero after success, failure and cancellation.

mod common;

use std::time::{Duration, Instant};

use common::{assert_idle, small_store, value_for};
use kvtide::{Error, Fragment, MemoryKind, PutOptions, Region, RegionError, Store, StoreBuilder};

#[test]
fn put_get_roundtrip_and_insert_only_semantics() {
    let store = small_store(16 << 20);
    let v1 = value_for(b"k", 1, 5000);
    store.put(b"k", &v1, PutOptions::INSERT).expect("put");
    assert_eq!(store.get(b"k").expect("get"), v1);
    assert_eq!(store.put(b"k", &value_for(b"k", 2, 10), PutOptions::INSERT), Err(Error::AlreadyExists));
    assert_eq!(store.get(b"k").expect("still v1"), v1);
    let v2 = value_for(b"k", 2, 123);
    store.put(b"k", &v2, PutOptions::UPSERT).expect("upsert");
    assert_eq!(store.get(b"k").expect("v2"), v2);
    store.put(b"empty", &[], PutOptions::INSERT).expect("empty value");
    assert_eq!(store.get(b"empty").expect("empty"), Vec::<u8>::new());
    assert_eq!(store.get(b"missing"), Err(Error::NotFound));
    let stats = store.stats();
    assert_eq!(stats.total.objects, 2);
    assert!(stats.total.hits >= 3 && stats.total.misses >= 1, "{stats:?}");
    assert_idle(&store);
}

#[test]
fn put_from_gathers_and_get_into_checks_the_buffer() {
    let store = small_store(16 << 20);
    let value = value_for(b"g", 0, 3000);
    let parts: Vec<Region<'_>> = value.chunks(700).map(Region::host_readonly).collect();
    store.put_from(b"g", &parts, PutOptions::INSERT).expect("gather");
    let mut big = vec![0xEEu8; 4000];
    assert_eq!(store.get_into(b"g", Region::host(&mut big)).expect("get_into"), 3000);
    assert_eq!(&big[..3000], &value[..]);
    assert!(big[3000..].iter().all(|&b| b == 0xEE), "bytes past the object untouched");
    let mut small = vec![0u8; 100];
    assert_eq!(
        store.get_into(b"g", Region::host(&mut small)),
        Err(Error::BufferTooSmall { object_bytes: 3000, buffer_bytes: 100 })
    );
    let readonly = [0u8; 4000];
    assert_eq!(store.get_into(b"g", Region::host_readonly(&readonly)), Err(Error::InvalidRange(RegionError::ReadOnly)));
    assert_idle(&store);
}

/// A read-only destination among writable ones fails its own key only, in a batch whose lists
/// all take the host route and in one that mixes in a list for another route; nothing is
/// written through it.
#[test]
fn a_read_only_destination_fails_only_its_key_in_a_batch() {
    let store = small_store(16 << 20);
    let keys: Vec<Vec<u8>> = (0..4).map(|i| format!("ro/{i}").into_bytes()).collect();
    for key in &keys {
        store.put(key, &value_for(key, 0, 2000), PutOptions::INSERT).expect("put");
    }
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut bufs = vec![vec![0u8; 2000]; 4];
    let readonly = vec![0xEEu8; 2000];
    let dsts: Vec<Vec<Region<'_>>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| vec![if i == 2 { Region::host_readonly(&readonly) } else { Region::host(b) }])
        .collect();
    let results = store.batch_get_into_multi_buffers(&refs, &dsts);
    drop(dsts);
    for (i, r) in results.iter().enumerate() {
        if i == 2 {
            assert_eq!(r, &Err(Error::InvalidRange(RegionError::ReadOnly)));
        } else {
            assert_eq!(r, &Ok(2000), "key {i}");
            assert_eq!(bufs[i], value_for(&keys[i], 0, 2000), "bytes of key {i}");
        }
    }
    assert!(readonly.iter().all(|&b| b == 0xEE), "nothing written through the read-only region");

    // The same with key 3's destination in device memory (another route).
    // SAFETY: the device region is never dereferenced: the engine refuses device memory first
    // (no CUDA: CudaUnavailable; with the `cuda` feature on a GPU: the pointer check refuses it).
    let dev = unsafe { Region::from_raw(0xdead_0000, 2000, MemoryKind::Device { ordinal: 0 }) };
    bufs.iter_mut().for_each(|b| b.fill(0));
    let mut dsts: Vec<Vec<Region<'_>>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| vec![if i == 2 { Region::host_readonly(&readonly) } else { Region::host(b) }])
        .collect();
    dsts[3] = vec![dev];
    let results = store.batch_get_into_multi_buffers(&refs, &dsts);
    drop(dsts);
    assert_eq!(results[2], Err(Error::InvalidRange(RegionError::ReadOnly)));
    assert!(
        matches!(results[3], Err(Error::CudaUnavailable(_)))
            || (cfg!(feature = "cuda") && matches!(results[3], Err(Error::InvalidArgument(_)))),
        "{:?}",
        results[3]
    );
    for i in [0, 1] {
        assert_eq!(results[i], Ok(2000), "key {i}");
        assert_eq!(bufs[i], value_for(&keys[i], 0, 2000), "bytes of key {i}");
    }
    assert!(readonly.iter().all(|&b| b == 0xEE), "nothing written through the read-only region");
    assert_idle(&store);
}

#[test]
fn a_batch_large_enough_to_be_checked_on_several_threads_keeps_each_keys_result_its_own() {
    // 1100 keys of 64 fragments of 64 bytes: 70,400 destination regions, enough for the store
    // to split their checks over threads on a machine with several cores.
    let (keys_n, fragments, fragment) = (1100usize, 64usize, 64usize);
    let store = small_store(64 << 20);
    let keys: Vec<Vec<u8>> = (0..keys_n).map(|i| format!("many/{i}").into_bytes()).collect();
    // Keys never written, near the start, the middle and the end of the batch.
    let missing = [0usize, keys_n / 2 + 1, keys_n - 2];
    for (i, key) in keys.iter().enumerate() {
        if !missing.contains(&i) {
            store.put(key, &value_for(key, 0, fragments * fragment), PutOptions::INSERT).expect("put");
        }
    }
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut bufs = vec![vec![0u8; fragments * fragment]; keys_n];
    let readonly = vec![0xEEu8; fragment];
    // Lists with one read-only fragment, near the start, the middle and the end.
    let bad = [1usize, keys_n / 2, keys_n - 1];
    let dsts: Vec<Vec<Region<'_>>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| {
            b.chunks_mut(fragment)
                .enumerate()
                .map(
                    |(f, c)| {
                        if bad.contains(&i) && f == 40 {
                            Region::host_readonly(&readonly)
                        } else {
                            Region::host(c)
                        }
                    },
                )
                .collect()
        })
        .collect();
    let results = store.batch_get_into_multi_buffers(&refs, &dsts);
    drop(dsts);
    for (i, r) in results.iter().enumerate() {
        if bad.contains(&i) {
            assert_eq!(r, &Err(Error::InvalidRange(RegionError::ReadOnly)), "key {i}");
        } else if missing.contains(&i) {
            assert_eq!(r, &Err(Error::NotFound), "key {i}");
            assert!(bufs[i].iter().all(|&b| b == 0), "a missing key's buffer stays untouched");
        } else {
            assert_eq!(r, &Ok(fragments * fragment), "key {i}");
            assert_eq!(bufs[i], value_for(&keys[i], 0, fragments * fragment), "bytes of key {i}");
        }
    }
    assert!(readonly.iter().all(|&b| b == 0xEE), "nothing written through the read-only region");
    assert_idle(&store);
}

#[test]
fn batch_get_into_fills_the_start_of_each_buffer_and_answers_per_key() {
    let store = small_store(16 << 20);
    let (a, b) = (value_for(b"a", 1, 5000), value_for(b"b", 1, 300));
    store.put(b"a", &a, PutOptions::INSERT).expect("put a");
    store.put(b"b", &b, PutOptions::INSERT).expect("put b");
    store.put(b"e", &[], PutOptions::INSERT).expect("put e");
    let keys: [&[u8]; 7] = [b"a", b"b", b"b", b"missing", b"", b"e", b"a"];
    let mut bufs: Vec<Vec<u8>> = [5000 + 77, 300, 299, 10, 10, 4, 6000].iter().map(|&n| vec![7u8; n]).collect();
    let readonly = vec![0u8; 6000];
    let mut dsts: Vec<Region<'_>> = bufs.iter_mut().map(|v| Region::host(v)).collect();
    dsts[6] = Region::host_readonly(&readonly);
    let results = store.batch_get_into(&keys, &dsts);
    assert_eq!(
        results,
        vec![
            Ok(5000),
            Ok(300),
            Err(Error::BufferTooSmall { object_bytes: 300, buffer_bytes: 299 }),
            Err(Error::NotFound),
            Err(Error::EmptyKey),
            Ok(0),
            Err(Error::InvalidRange(RegionError::ReadOnly)),
        ]
    );
    // The one-key form agrees with `get_into`.
    assert_eq!(store.batch_get_into(&[b"a"], &dsts[..1]), vec![store.get_into(b"a", dsts[0])]);
    drop(dsts);
    assert!(bufs[0][..5000] == a[..] && bufs[0][5000..].iter().all(|&x| x == 7), "a, then untouched");
    assert_eq!(bufs[1], b);
    assert!(bufs[2].iter().chain(&bufs[3]).chain(&bufs[4]).chain(&bufs[5]).all(|&x| x == 7), "failed keys untouched");
    // One buffer per key.
    let dsts: Vec<Region<'_>> = bufs.iter_mut().take(2).map(|v| Region::host(v)).collect();
    let mismatched = store.batch_get_into(&keys, &dsts);
    assert!(mismatched.iter().all(|r| matches!(r, Err(Error::InvalidArgument(_)))), "{mismatched:?}");
    drop(dsts);
    assert_idle(&store);
}

#[test]
fn batch_scatter_gives_per_key_results() {
    let store = small_store(32 << 20);
    let keys: Vec<Vec<u8>> = (0..20).map(|i| format!("layer/{i}").into_bytes()).collect();
    for key in &keys {
        store.put(key, &value_for(key, 0, 4 * 1024), PutOptions::INSERT).expect("put");
    }
    // Each object scattered across 4 pages of 1 KiB; key 3 missing, key 5 wrong sizes, key 7 twice.
    let mut query: Vec<Vec<u8>> = keys.clone();
    query[3] = b"layer/missing".to_vec();
    query.push(keys[7].clone());
    let mut pages = vec![vec![0u8; 1024]; query.len() * 4];
    let mut wrong = vec![0u8; 1000];
    let key_refs: Vec<&[u8]> = query.iter().map(|k| k.as_slice()).collect();
    let mut dsts: Vec<Vec<Region<'_>>> = Vec::new();
    let mut wrong_slot = Some(&mut wrong);
    for (i, chunk) in pages.chunks_mut(4).enumerate() {
        match (i, wrong_slot.take()) {
            (5, Some(w)) => dsts.push(vec![Region::host(w)]),
            (_, slot) => {
                wrong_slot = wrong_slot.or(slot);
                dsts.push(chunk.iter_mut().map(|p| Region::host(p)).collect());
            }
        }
    }
    let results = store.batch_get_into_multi_buffers(&key_refs, &dsts);
    drop(dsts);
    for (i, result) in results.iter().enumerate() {
        match i {
            3 => assert_eq!(result, &Err(Error::NotFound)),
            5 => assert_eq!(result, &Err(Error::SizeMismatch { object_bytes: 4096, destination_bytes: 1000 })),
            _ => {
                assert_eq!(result, &Ok(4096), "key {i}");
                let got: Vec<u8> = pages[i * 4..i * 4 + 4].concat();
                assert_eq!(got, value_for(&query[i], 0, 4096), "key {i} bytes");
            }
        }
    }
    assert!(wrong.iter().all(|&b| b == 0), "a failed key's destination is untouched");
    // Argument shape errors are per call, not a panic.
    let r = store.batch_get_into_multi_buffers(&key_refs[..2], &[]);
    assert!(r.iter().all(|r| matches!(r, Err(Error::InvalidArgument(_)))));
    assert_idle(&store);
}

#[test]
fn ranges_are_checked_against_objects_and_buffers() {
    let store = small_store(16 << 20);
    let a = value_for(b"a", 0, 1000);
    let b = value_for(b"b", 0, 500);
    store.put(b"a", &a, PutOptions::INSERT).expect("a");
    store.put(b"b", &b, PutOptions::INSERT).expect("b");
    let mut buf0 = vec![0u8; 600];
    let mut buf1 = vec![0u8; 100];
    let fragments = vec![
        vec![
            Fragment::new(b"a".to_vec(), 100, 0, 200),
            Fragment::new(b"b".to_vec(), 0, 200, 300),
            Fragment::new(b"a".to_vec(), 990, 500, 20),   // past the object
            Fragment::new(b"b".to_vec(), 0, 590, 20),     // past the buffer
            Fragment::new(b"zz".to_vec(), 0, 0, 1),       // missing key
            Fragment::new(b"a".to_vec(), u64::MAX, 0, 2), // overflow
        ],
        vec![Fragment::new(b"b".to_vec(), 400, 0, 100)],
        vec![Fragment::new(b"a".to_vec(), 0, 0, 1)], // no such buffer
    ];
    let buffers = [Region::host(&mut buf0), Region::host(&mut buf1)];
    let results = store.get_into_ranges(&buffers, &fragments);
    assert_eq!(results[0][0], Ok(200));
    assert_eq!(results[0][1], Ok(300));
    assert!(matches!(results[0][2], Err(Error::InvalidRange(RegionError::OutOfBounds { what: "object", .. }))));
    assert!(matches!(results[0][3], Err(Error::InvalidRange(RegionError::OutOfBounds { what: "buffer", .. }))));
    assert_eq!(results[0][4], Err(Error::NotFound));
    assert!(matches!(results[0][5], Err(Error::InvalidRange(_))));
    assert_eq!(results[1][0], Ok(100));
    assert!(matches!(results[2][0], Err(Error::InvalidArgument(_))));
    assert_eq!(&buf0[..200], &a[100..300]);
    assert_eq!(&buf0[200..500], &b[..300]);
    assert!(buf0[500..].iter().all(|&x| x == 0), "failed fragments wrote nothing");
    assert_eq!(&buf1[..], &b[400..500]);
    assert_idle(&store);
}

#[test]
fn exists_and_prefix_hits() {
    let store = small_store(16 << 20);
    let keys: Vec<Vec<u8>> = (0..10).map(|i| format!("p/{i}").into_bytes()).collect();
    for key in &keys[..6] {
        store.put(key, b"x", PutOptions::INSERT).expect("put");
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    assert_eq!(store.prefix_hits(&refs), Ok(6));
    assert_eq!(store.prefix_hits(&refs[6..]), Ok(0));
    assert_eq!(store.prefix_hits(&[]), Ok(0));
    let found = store.batch_exists(&refs);
    assert_eq!(found.iter().filter(|r| **r == Ok(true)).count(), 6);
    assert_eq!(store.exists(b"p/0"), Ok(true));
    assert_eq!(store.exists(b"p/9"), Ok(false));
    assert_eq!(store.exists(b""), Err(Error::EmptyKey));
}

#[test]
fn remove_respects_leases_and_readers_keep_their_bytes() {
    let store = small_store(16 << 20);
    let v1 = value_for(b"r", 1, 8192);
    store.put(b"r", &v1, PutOptions::INSERT).expect("put");
    let lease = store.lease(b"r", 60_000).expect("lease");
    assert_eq!(store.remove(b"r", false), Err(Error::Leased));
    // Upsert while leased: the reader still sees v1, new readers see v2.
    let v2 = value_for(b"r", 2, 100);
    store.put(b"r", &v2, PutOptions::UPSERT).expect("upsert");
    assert_eq!(store.get(b"r").expect("v2"), v2);
    assert_eq!(lease.bytes().expect("lease bytes"), &v1[..]);
    store.sync_shards().expect("sync");
    assert_eq!(store.stats().total.retired_objects, 1);
    drop(lease);
    store.remove(b"r", false).expect("remove");
    assert_eq!(store.get(b"r"), Err(Error::NotFound));
    assert_eq!(store.remove(b"r", false), Err(Error::NotFound));

    // Forced removal of a leased object.
    store.put(b"f", &v1, PutOptions::INSERT).expect("put f");
    let lease = store.lease(b"f", 60_000).expect("lease f");
    store.remove(b"f", true).expect("forced");
    assert_eq!(store.exists(b"f"), Ok(false));
    assert_eq!(lease.bytes().expect("bytes"), &v1[..]);
    drop(lease);
    assert_idle(&store);
    assert_eq!(store.stats().total.bytes_used, 0);
}

#[test]
fn batch_remove_answers_per_key() {
    let store = small_store(16 << 20);
    for key in [&b"a"[..], b"b", b"pinned"] {
        store.put(key, b"v", PutOptions::INSERT).expect("put");
    }
    store.pin(b"pinned").expect("pin");
    let keys: [&[u8]; 6] = [b"a", b"pinned", b"missing", b"", b"b", b"b"];
    assert_eq!(
        store.batch_remove(&keys, false),
        vec![Ok(()), Err(Error::Pinned), Err(Error::NotFound), Err(Error::EmptyKey), Ok(()), Err(Error::NotFound)]
    );
    assert_eq!(store.batch_remove(&[b"pinned"], true), vec![Ok(())]);
    assert!(store.batch_exists(&keys).iter().all(|r| *r != Ok(true)));
    assert_idle(&store);
}

#[test]
fn pin_and_unpin() {
    let store = small_store(16 << 20);
    assert_eq!(store.pin(b"nope"), Err(Error::NotFound));
    store.put(b"p", b"v", PutOptions::INSERT).expect("put");
    assert_eq!(store.unpin(b"p"), Err(Error::NotPinned));
    store.pin(b"p").expect("pin");
    store.pin(b"p").expect("pin twice");
    assert_eq!(store.remove(b"p", false), Err(Error::Pinned));
    store.unpin(b"p").expect("unpin");
    assert_eq!(store.remove(b"p", false), Err(Error::Pinned));
    store.unpin(b"p").expect("unpin 2");
    store.remove(b"p", false).expect("remove");
    assert_eq!(store.stats().total.pinned_objects, 0);
}

#[test]
fn everything_pinned_gives_prompt_no_space() {
    // Two 4 MiB shards; no background eviction, so a put is never evicted before its pin.
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(2)
        .pin_threads(false)
        .high_watermark(1.0)
        .low_watermark(0.99)
        .open()
        .expect("open");
    let value = vec![7u8; 256 << 10];
    let mut stored = Vec::new();
    let started = Instant::now();
    let mut no_space = 0;
    for i in 0..64 {
        let key = format!("pinned/{i}").into_bytes();
        match store.put(&key, &value, PutOptions::INSERT) {
            Ok(()) => {
                store.pin(&key).expect("pin");
                stored.push(key);
            }
            Err(Error::NoSpace) => no_space += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(no_space > 0, "the pool must fill up");
    assert!(started.elapsed() < Duration::from_secs(30), "NoSpace must not hang");
    for key in &stored {
        assert_eq!(store.get(key).expect("pinned objects survive").len(), value.len());
    }
    let stats = store.stats();
    assert_eq!(stats.total.evictions, 0);
    assert!(stats.total.no_space >= no_space);
    // Unpinned, they become evictable again and puts succeed.
    for key in &stored {
        store.unpin(key).expect("unpin");
    }
    store.put(b"after", &value, PutOptions::INSERT).expect("put after unpin");
    assert_idle(&store);
}

#[test]
fn eviction_keeps_the_pool_bounded_and_never_returns_wrong_bytes() {
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(2)
        .pin_threads(false)
        .eviction(kvtide::EvictionPolicy::S3Fifo)
        .open()
        .expect("open");
    for i in 0..400u64 {
        let key = format!("e/{i}").into_bytes();
        store.put(&key, &value_for(&key, i, 64 << 10), PutOptions::INSERT).expect("put under eviction");
    }
    store.sync_shards().expect("sync");
    let stats = store.stats();
    assert!(stats.total.evictions > 0);
    assert!(stats.total.bytes_used <= stats.total.capacity_bytes);
    let mut present = 0;
    for i in 0..400u64 {
        let key = format!("e/{i}").into_bytes();
        match store.get(&key) {
            Ok(bytes) => {
                assert_eq!(bytes, value_for(&key, i, 64 << 10), "key {i}");
                present += 1;
            }
            Err(Error::NotFound) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert!(present > 0 && present < 400, "present {present}");
    assert_idle(&store);
}

#[test]
fn limits_and_bad_arguments_are_typed_errors() {
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(1)
        .pin_threads(false)
        .max_key_bytes(16)
        .max_value_bytes(1 << 20)
        .open()
        .expect("open");
    assert!(matches!(store.put(&[b'k'; 17], b"v", PutOptions::INSERT), Err(Error::TooLarge { what: "key", .. })));
    assert_eq!(store.put(b"", b"v", PutOptions::INSERT), Err(Error::EmptyKey));
    let big = vec![0u8; (1 << 20) + 1];
    assert!(matches!(store.put(b"big", &big, PutOptions::INSERT), Err(Error::TooLarge { what: "value", .. })));
    store.put(b"ok", &[1u8; 64], PutOptions::INSERT).expect("ok");
    // SAFETY: the device region is never dereferenced: the engine refuses device memory first
    // (no CUDA: CudaUnavailable; with the `cuda` feature on a GPU: the pointer check refuses it).
    let dev = unsafe { Region::from_raw(0xdead_0000, 64, MemoryKind::Device { ordinal: 0 }) };
    let refused = |r: &Result<(), Error>| {
        matches!(r, Err(Error::CudaUnavailable(_)))
            || (cfg!(feature = "cuda") && matches!(r, Err(Error::InvalidArgument(_))))
    };
    assert!(refused(&store.get_into(b"ok", dev).map(|_| ())));
    assert!(refused(&store.put_from(b"dev", &[dev], PutOptions::INSERT)));
    // Batch puts: one bad key never fails its neighbours.
    let good = [2u8; 32];
    let keys: [&[u8]; 3] = [b"b1", &[b'x'; 40], b"b3"];
    let srcs = vec![vec![Region::host_readonly(&good)], vec![Region::host_readonly(&good)], vec![dev]];
    let results = store.batch_put_from_multi_buffers(&keys, &srcs, PutOptions::INSERT);
    assert_eq!(results[0], Ok(()));
    assert!(matches!(results[1], Err(Error::TooLarge { what: "key", .. })));
    assert!(refused(&results[2]), "{:?}", results[2]);
    assert_eq!(store.get(b"b1").expect("b1"), good.to_vec());
    assert_eq!(store.exists(b"b3"), Ok(false));
    assert_idle(&store);
}

#[test]
fn async_batch_get_completes_and_cancels_cleanly() {
    let store = small_store(64 << 20);
    let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("async/{i}").into_bytes()).collect();
    for key in &keys {
        store.put(key, &value_for(key, 0, 3 << 20), PutOptions::INSERT).expect("put");
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let buffers: Vec<&'static mut [u8]> = (0..8).map(|_| Box::leak(vec![0u8; 3 << 20].into_boxed_slice())).collect();
    let addrs: Vec<(u64, usize)> = buffers.iter().map(|b| (b.as_ptr() as u64, b.len())).collect();
    let dsts: Vec<Vec<Region<'static>>> = buffers.into_iter().map(|b| vec![Region::host(b)]).collect();
    let ticket = store.submit_batch_get(&refs, dsts).expect("submit");
    let results = ticket.wait();
    for (i, result) in results.iter().enumerate() {
        assert_eq!(result, &Ok(3 << 20));
        // SAFETY: the ticket completed, so nothing writes these leaked buffers any more.
        let got = unsafe { std::slice::from_raw_parts(addrs[i].0 as *const u8, addrs[i].1) };
        assert_eq!(got, &value_for(&keys[i], 0, 3 << 20)[..]);
    }
    assert_idle(&store);

    // Cancel right away: every key is either fully delivered or Cancelled, never half-reported.
    let dsts: Vec<Vec<Region<'static>>> =
        addrs.iter().map(|&(_, len)| vec![Region::host(Box::leak(vec![0u8; len].into_boxed_slice()))]).collect();
    let _ = addrs;
    let ticket = store.submit_batch_get(&refs, dsts).expect("submit");
    ticket.cancel();
    let results = ticket.wait();
    assert!(results.iter().all(|r| matches!(r, Ok(n) if *n == 3 << 20) || *r == Err(Error::Cancelled)), "{results:?}");
    assert_idle(&store);
}

#[test]
fn explicit_lease_ttl_is_a_backstop() {
    let store = small_store(16 << 20);
    store.put(b"ttl", &[9u8; 100], PutOptions::INSERT).expect("put");
    let lease = store.lease(b"ttl", 10).expect("lease");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(lease.bytes(), Err(Error::LeaseExpired));
    // The shard reclaims it after the grace period even though the guard still exists.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.stats().total.leases_held > 0 {
        assert!(Instant::now() < deadline, "expired lease never reclaimed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(store.stats().total.leases_expired, 1);
    drop(lease); // a late release is a harmless no-op
    store.sync_shards().expect("sync");
    assert_eq!(store.stats().total.stale_releases, 1);
    store.remove(b"ttl", false).expect("removable once the lease expired");
}

#[test]
fn progressive_leases_of_dram_objects_hold_them_until_dropped() {
    let store = small_store(16 << 20);
    let v1 = value_for(b"p", 1, 8192);
    store.put(b"p", &v1, PutOptions::INSERT).expect("put");
    // A DRAM-resident object is leased through the published index: no shard lease.
    let lease = store.lease_progressive(b"p", 60_000).expect("lease");
    let held = store.stats().total;
    assert_eq!((held.leases_held, held.published_leases_held), (0, 1));
    assert_eq!(store.remove(b"p", false), Err(Error::Leased));
    // Replaced while leased: the holder keeps v1's bytes, new readers see v2.
    let v2 = value_for(b"p", 2, 100);
    store.put(b"p", &v2, PutOptions::UPSERT).expect("upsert");
    assert_eq!(store.get(b"p").expect("v2"), v2);
    let far = Instant::now() + Duration::from_secs(10);
    assert_eq!(lease.bytes_when_ready(100..4196, far).expect("range"), Some(&v1[100..4196]));
    assert!(lease.bytes_when_ready(8000..8200, far).is_err(), "a range past the object's end");
    drop(lease);
    assert_idle(&store);

    // Given back together with a lease the shard granted.
    let a = store.lease_progressive(b"p", 60_000).expect("published lease");
    let b = store.lease(b"p", 60_000).expect("shard lease");
    assert_eq!((store.stats().total.leases_held, store.stats().total.published_leases_held), (1, 1));
    kvtide::ObjectLease::release_all([a, b]);
    assert_idle(&store);

    // The TTL still ends its bytes; the lease itself holds the object until it drops.
    let short = store.lease_progressive(b"p", 10).expect("short lease");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(short.bytes(), Err(Error::LeaseExpired));
    assert_eq!(store.stats().total.published_leases_held, 1);
    assert_eq!(store.remove(b"p", false), Err(Error::Leased));
    drop(short);
    store.remove(b"p", false).expect("removable once dropped");

    assert_eq!(store.lease_progressive(b"p", 60_000).map(|l| l.len()), Err(Error::NotFound));
    assert_eq!(store.lease_progressive(b"", 60_000).map(|l| l.len()), Err(Error::EmptyKey));
    assert_idle(&store);
    assert_eq!(store.stats().total.bytes_used, 0);
}

#[test]
fn shutdown_fails_new_calls_and_joins() {
    let store = small_store(16 << 20);
    store.put(b"s", b"v", PutOptions::INSERT).expect("put");
    store.shutdown();
    assert_eq!(store.get(b"s"), Err(Error::ShuttingDown));
    assert_eq!(store.put(b"t", b"v", PutOptions::INSERT), Err(Error::ShuttingDown));
    assert!(matches!(store.submit_batch_get(&[b"s"], vec![vec![]]), Err(Error::ShuttingDown)));
    store.shutdown(); // idempotent
}

#[test]
fn config_errors_are_clear() {
    let err = StoreBuilder::new().dram_bytes(1 << 20).shards(2).open().expect_err("too small");
    assert!(err.to_string().contains("too small"), "{err}");
    let err = StoreBuilder::new().high_watermark(1.5).open().expect_err("watermark");
    assert!(err.to_string().contains("watermark"), "{err}");
}

#[test]
fn shutdown_lets_an_in_flight_ticket_finish() {
    let store = small_store(64 << 20);
    let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("sd/{i}").into_bytes()).collect();
    for key in &keys {
        store.put(key, &value_for(key, 0, 4 << 20), PutOptions::INSERT).expect("put");
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let dsts: Vec<Vec<Region<'static>>> =
        (0..6).map(|_| vec![Region::host(Box::leak(vec![0u8; 4 << 20].into_boxed_slice()))]).collect();
    let ticket = store.submit_batch_get(&refs, dsts).expect("submit");
    store.shutdown();
    let results = ticket.wait();
    assert!(results.iter().all(|r| *r == Ok(4 << 20)), "in-flight work finishes: {results:?}");
    assert_eq!(store.stats().held_resources().tickets_in_flight, 0);
    assert_eq!(store.stats().total.leases_held, 0);
}

/// All pages of a scan.
fn scan_all(store: &impl Store<Error = Error>, prefix: &[u8], limit: usize) -> (Vec<Vec<u8>>, usize) {
    let (mut keys, mut pages, mut cursor) = (Vec::new(), 0, 0);
    loop {
        let page = store.scan_keys(prefix, cursor, limit).expect("scan page");
        assert!(page.keys.len() <= limit.clamp(1, kvtide::MAX_SCAN_KEYS));
        keys.extend(page.keys);
        pages += 1;
        match page.cursor {
            Some(next) => cursor = next,
            None => return (keys, pages),
        }
    }
}

#[test]
fn scan_keys_returns_every_live_key_once_in_bounded_pages() {
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(3)
        .pin_threads(false)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(1 << 20)
        .simulated_ssd(7, kvtide::SimFaults::default())
        .open()
        .expect("open");
    // 600 x 64 KiB is far more than DRAM: most keys are on the SSD tier only.
    let mut expected = Vec::new();
    for i in 0..600u32 {
        let key = format!("{}/{i}", if i % 3 == 0 { "a" } else { "b" }).into_bytes();
        store.put(&key, &value_for(&key, 0, 64 << 10), PutOptions::INSERT).expect("put");
        expected.push(key);
    }
    for i in (0..600u32).step_by(10) {
        let key = format!("{}/{i}", if i % 3 == 0 { "a" } else { "b" }).into_bytes();
        store.remove(&key, false).expect("remove");
        expected.retain(|k| *k != key);
    }
    expected.sort();
    let (mut all, pages) = scan_all(&store, b"", 7);
    all.sort();
    assert_eq!(all, expected, "every live key once, removed keys never");
    assert!(pages >= 540 / 7, "pages hold at most the limit: {pages}");
    let (mut a, _) = scan_all(&store, b"a/", 1000);
    a.sort();
    let want: Vec<_> = expected.iter().filter(|k| k.starts_with(b"a/")).cloned().collect();
    assert_eq!(a, want);
    assert_eq!(scan_all(&store, b"zzz", 1000).0, Vec::<Vec<u8>>::new());
    assert!(matches!(store.scan_keys(b"", 99 << 32, 10), Err(Error::InvalidArgument(_))), "a cursor of no shard");
    assert!(matches!(store.scan_keys(&[b'x'; 2000], 0, 10), Err(Error::TooLarge { .. })));
    assert_idle(&store);
}
