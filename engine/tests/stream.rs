//! Progressive and streaming transfers on the embedded engine: chunk handles over DRAM and SSD
//! objects, streaming range reads, progressive puts with readers that follow them, abort,
//! drop, TTL expiry, limits, and every counter back at zero afterwards.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{small_store, value_for, wait_idle};
use kvtide::{ChunkState, Engine, Error, Fragment, HandleStatus, PutOptions, Region, RegionError, Store, StoreBuilder};

/// A leaked buffer: chunk handles write after the call returns, into `'static` memory.
fn buffer(len: usize, fill: u8) -> &'static mut [u8] {
    Box::leak(vec![fill; len].into_boxed_slice())
}

fn stream_store(configure: impl FnOnce(StoreBuilder) -> StoreBuilder) -> Engine {
    configure(StoreBuilder::new().dram_bytes(64 << 20).shards(2).pin_threads(false).idle_spin_us(20))
        .open()
        .expect("open")
}

#[test]
fn progressive_get_delivers_every_chunk_in_place() {
    let store = small_store(32 << 20);
    let len = (3 << 20) + 123;
    let value = value_for(b"big", 1, len);
    store.put(b"big", &value, PutOptions::INSERT).expect("put");
    let dst = buffer(len + 100, 0xEE);
    let addr = dst.as_ptr() as usize;
    let handle = store.progressive_get(b"big", Region::host(dst), 256 << 10).expect("progressive_get");
    assert_eq!(handle.num_chunks(), 13);
    assert_eq!(handle.chunk_range(12), Some((12 << 18)..len as u64));
    for i in 0..handle.num_chunks() {
        handle.wait_chunk(i).expect("chunk");
        let range = handle.chunk_range(i).expect("range");
        // SAFETY: chunk i landed and nothing writes its range any more.
        let got = unsafe {
            std::slice::from_raw_parts((addr + range.start as usize) as *const u8, (range.end - range.start) as usize)
        };
        assert_eq!(got, &value[range.start as usize..range.end as usize], "chunk {i}");
    }
    handle.wait_all().expect("all");
    assert_eq!(handle.status(), HandleStatus::Done);
    let mut polled = handle.poll();
    polled.sort_unstable();
    assert_eq!(polled, (0..13).collect::<Vec<_>>());
    // SAFETY: every chunk settled; the driver is done with the buffer.
    let tail = unsafe { std::slice::from_raw_parts((addr + len) as *const u8, 100) };
    assert!(tail.iter().all(|&b| b == 0xEE), "bytes past the object untouched");
    drop(handle);
    wait_idle(&store);
    let s = store.stats().stream;
    assert_eq!((s.handles, s.chunks_delivered, s.chunks_failed), (1, 13, 0), "{s:?}");
    assert!(s.peak_leased_bytes >= len as u64, "{s:?}");
}

#[test]
fn progressive_get_edge_cases_and_call_errors() {
    let store = small_store(16 << 20);
    store.put(b"empty", &[], PutOptions::INSERT).expect("empty");
    store.put(b"small", b"0123456789", PutOptions::INSERT).expect("small");
    let h = store.progressive_get(b"empty", Region::host(buffer(4, 0)), 1024).expect("empty object");
    assert_eq!((h.num_chunks(), h.chunk_range(0)), (1, Some(0..0)));
    h.wait_all().expect("an empty object is one empty chunk");
    let h = store.progressive_get(b"small", Region::host(buffer(10, 0)), 1 << 20).expect("one chunk");
    assert_eq!(h.num_chunks(), 1);
    assert_eq!(h.wait_chunk_timeout(0, 10_000), Ok(true));
    let h = store.progressive_get(b"small", Region::host(buffer(10, 0)), 3).expect("chunks of 3");
    assert_eq!(h.num_chunks(), 4);
    assert_eq!(h.chunk_range(3), Some(9..10));
    h.wait_all().expect("all");
    assert!(matches!(h.wait_chunk(4), Err(Error::InvalidArgument(_))));
    assert!(!h.is_chunk_ready(4));
    assert_eq!(store.progressive_get(b"missing", Region::host(buffer(10, 0)), 4).err(), Some(Error::NotFound));
    assert_eq!(store.progressive_get(b"", Region::host(buffer(10, 0)), 4).err(), Some(Error::EmptyKey));
    assert_eq!(
        store.progressive_get(b"small", Region::host(buffer(9, 0)), 4).err(),
        Some(Error::BufferTooSmall { object_bytes: 10, buffer_bytes: 9 })
    );
    assert!(matches!(store.progressive_get(b"small", Region::host(buffer(10, 0)), 0), Err(Error::InvalidArgument(_))));
    // Chunk counts are bounded before anything is allocated per chunk.
    store.put(b"two-mib", &vec![1u8; 2 << 20], PutOptions::INSERT).expect("put");
    assert!(matches!(
        store.progressive_get(b"two-mib", Region::host(buffer(2 << 20, 0)), 1),
        Err(Error::InvalidArgument(m)) if m.contains("chunks exceed")
    ));
    assert!(matches!(
        store.progressive_put(b"many", 2 << 20, 1, PutOptions::INSERT),
        Err(Error::InvalidArgument(m)) if m.contains("chunks exceed")
    ));
    let huge = vec![vec![
        Fragment::new(b"small".to_vec(), 0, 0, 2 << 20),
        Fragment::new(b"small".to_vec(), 0, u64::MAX, u64::MAX),
    ]];
    assert!(matches!(
        store.streaming_batch_get_buffer_ranges(&[Region::host(buffer(2 << 20, 0))], &huge, 1),
        Err(Error::InvalidArgument(_))
    ));
    let hostile = vec![vec![Fragment::new(b"small".to_vec(), u64::MAX, u64::MAX - 1, u64::MAX)]];
    let h = store.streaming_batch_get_buffer_ranges(&[Region::host(buffer(16, 0))], &hostile, 1).expect("one chunk");
    assert_eq!(h.num_chunks(), 1);
    assert!(matches!(h.wait_all(), Err(Error::InvalidRange(_))));
    let readonly: &'static [u8] = buffer(10, 0);
    assert_eq!(
        store.progressive_get(b"small", Region::host_readonly(readonly), 4).err(),
        Some(Error::InvalidRange(RegionError::ReadOnly))
    );
    wait_idle(&store);
}

#[test]
fn streaming_ranges_follow_the_fragment_order_and_fail_only_bad_fragments() {
    let store = small_store(32 << 20);
    let a = value_for(b"a", 0, 100_000);
    let b = value_for(b"b", 0, 5_000);
    store.put(b"a", &a, PutOptions::INSERT).expect("a");
    store.put(b"b", &b, PutOptions::INSERT).expect("b");
    let (buf0, buf1) = (buffer(150_000, 0), buffer(1_000, 0));
    let (addr0, addr1) = (buf0.as_ptr() as usize, buf1.as_ptr() as usize);
    let fragments = vec![
        vec![
            Fragment::new(b"a".to_vec(), 0, 0, 100_000),
            Fragment::new(b"b".to_vec(), 1000, 100_000, 4000),
            Fragment::new(b"missing".to_vec(), 0, 104_000, 10),
            Fragment::new(b"b".to_vec(), 4990, 104_010, 20), // past the end of b
            Fragment::new(b"a".to_vec(), 5, 149_990, 20),    // past the end of the buffer
            Fragment::new(b"a".to_vec(), 7, 120_000, 0),     // empty
        ],
        vec![Fragment::new(b"".to_vec(), 0, 0, 1), Fragment::new(b"a".to_vec(), 99_000, 0, 1000)],
    ];
    let h = store
        .streaming_batch_get_buffer_ranges(&[Region::host(buf0), Region::host(buf1)], &fragments, 32 << 10)
        .expect("streaming");
    // a: 4 chunks, b: 1, missing: 1, b-past-end: 1, past-buffer: 1, empty: 1 | empty key: 1, a: 1
    assert_eq!(h.num_chunks(), 11);
    let places: Vec<(usize, std::ops::Range<u64>)> =
        (0..11).map(|i| h.chunk_place(i).map(|p| (p.buffer, p.range.clone())).expect("place")).collect();
    assert_eq!(places[0], (0, 0..32768));
    assert_eq!(places[4], (0, 100_000..104_000));
    assert_eq!(places[10], (1, 0..1000));
    assert!(h.wait_all().is_err());
    let states: Vec<ChunkState<Error>> = (0..11).map(|i| h.chunk_state(i).expect("state")).collect();
    for i in [0, 1, 2, 3, 4, 8, 10] {
        assert_eq!(states[i], ChunkState::Done, "chunk {i}");
    }
    assert_eq!(states[5], ChunkState::Failed(Error::NotFound));
    assert!(matches!(states[6], ChunkState::Failed(Error::InvalidRange(_))), "{:?}", states[6]);
    assert!(matches!(states[7], ChunkState::Failed(Error::InvalidRange(_))), "{:?}", states[7]);
    assert_eq!(states[9], ChunkState::Failed(Error::EmptyKey));
    // SAFETY: every chunk settled; the driver is done with the buffers.
    let (got0, got1) = unsafe {
        (std::slice::from_raw_parts(addr0 as *const u8, 150_000), std::slice::from_raw_parts(addr1 as *const u8, 1000))
    };
    assert_eq!(&got0[..100_000], &a[..]);
    assert_eq!(&got0[100_000..104_000], &b[1000..5000]);
    assert_eq!(got1, &a[99_000..]);
    assert!(matches!(h.status(), HandleStatus::Failed { chunk: 5, error: Error::NotFound }));
    drop(h);
    wait_idle(&store);
}

#[test]
fn a_dropped_handle_cancels_what_has_not_started() {
    let store = stream_store(|b| b);
    // A reader that follows a producer who never writes: its chunks cannot start.
    let put = store.progressive_put(b"slow", 1 << 20, 64 << 10, PutOptions::INSERT).expect("put");
    let h = store.progressive_get_unsealed(b"slow", Region::host(buffer(1 << 20, 0)), 64 << 10).expect("follow");
    assert_eq!(h.wait_chunk_timeout(0, 20), Ok(false));
    assert!(matches!(h.status(), HandleStatus::Pending { done: 0, failed: 0, total: 16 }));
    drop(h);
    put.abort();
    wait_idle(&store);
    let s = store.stats().stream;
    assert_eq!((s.handles_open, s.unsealed_objects, s.unsealed_bytes), (0, 0, 0), "{s:?}");
    assert_eq!(store.stats().total.writes_in_flight, 0);
}

#[test]
fn progressive_put_is_invisible_until_sealed() {
    let store = small_store(32 << 20);
    let value = value_for(b"p", 3, 1_000_000);
    let mut put = store.progressive_put(b"p", value.len() as u64, 300_000, PutOptions::INSERT).expect("put");
    assert_eq!(put.num_chunks(), 4);
    assert_eq!(put.chunk_range(3), Some(900_000..1_000_000));
    for i in [3, 1] {
        let r = put.chunk_range(i).expect("range");
        put.put_chunk(i, Region::host_readonly(&value[r.start as usize..r.end as usize])).expect("chunk");
    }
    assert_eq!(store.exists(b"p"), Ok(false));
    assert_eq!(store.get(b"p"), Err(Error::NotFound));
    let err = put.seal().expect_err("chunks 0 and 2 are missing");
    assert!(err.to_string().contains("first missing: [0, 2]"), "{err}");
    assert_eq!(put.put_chunk(1, Region::host_readonly(&value[300_000..600_000])), Err(Error::AlreadyExists));
    assert_eq!(
        put.put_chunk(0, Region::host_readonly(&value[..10])),
        Err(Error::SizeMismatch { object_bytes: 300_000, destination_bytes: 10 })
    );
    assert!(matches!(put.put_chunk(4, Region::host_readonly(&value[..10])), Err(Error::InvalidArgument(_))));
    assert_eq!(
        store.progressive_put(b"p", 10, 10, PutOptions::INSERT).err(),
        Some(Error::AlreadyExists),
        "one unsealed put per key"
    );
    for i in [0, 2] {
        let r = put.chunk_range(i).expect("range");
        put.put_chunk(i, Region::host_readonly(&value[r.start as usize..r.end as usize])).expect("chunk");
    }
    assert_eq!(store.stats().stream.unsealed_bytes, 1_000_000);
    put.seal().expect("seal");
    assert!(matches!(put.seal(), Err(Error::InvalidArgument(_))), "sealed once");
    drop(put);
    assert_eq!(store.get(b"p").expect("sealed object"), value);
    // An insert-only put of an existing key is refused at once; one whose key appeared while it
    // was unsealed fails at the seal; an upsert replaces it.
    assert_eq!(store.progressive_put(b"p", 4, 4, PutOptions::INSERT).err(), Some(Error::AlreadyExists));
    let mut late = store.progressive_put(b"q", 4, 4, PutOptions::INSERT).expect("q");
    late.put_chunk(0, Region::host_readonly(b"late")).expect("chunk");
    store.put(b"q", b"first", PutOptions::INSERT).expect("q appears meanwhile");
    assert_eq!(late.seal(), Err(Error::AlreadyExists));
    drop(late);
    assert_eq!(store.get(b"q").expect("q"), b"first");
    let mut up = store.progressive_put(b"p", 4, 4, PutOptions::UPSERT).expect("upsert");
    up.put_chunk(0, Region::host_readonly(b"new!")).expect("chunk");
    up.seal().expect("seal upsert");
    drop(up);
    assert_eq!(store.get(b"p").expect("upserted"), b"new!");
    // An empty progressive put is one empty chunk.
    let mut empty = store.progressive_put(b"e", 0, 16, PutOptions::INSERT).expect("empty");
    empty.put_chunk(0, Region::host_readonly(&[])).expect("empty chunk");
    empty.seal().expect("seal empty");
    drop(empty);
    assert_eq!(store.get(b"e").expect("empty"), Vec::<u8>::new());
    wait_idle(&store);
    let s = store.stats().stream;
    assert_eq!((s.sealed, s.producer_aborts, s.unsealed_objects), (3, 1, 0), "{s:?}");
}

#[test]
fn a_reader_follows_the_producer_chunk_by_chunk() {
    let store = Arc::new(stream_store(|b| b));
    let chunk = 64 << 10;
    let value = value_for(b"follow", 9, 16 * chunk);
    let put = store.progressive_put(b"follow", value.len() as u64, chunk as u64, PutOptions::INSERT).expect("put");
    let dst = buffer(value.len(), 0);
    let addr = dst.as_ptr() as usize;
    // The reader's chunks are twice the producer's: each waits for two of them.
    let h = store.progressive_get_unsealed(b"follow", Region::host(dst), 2 * chunk as u64).expect("follow");
    assert_eq!(h.num_chunks(), 8);
    let produced = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        let producer = s.spawn(|| {
            let mut put = put;
            for i in 0..16 {
                put.put_chunk(i, Region::host_readonly(&value[i * chunk..(i + 1) * chunk])).expect("chunk");
                produced.store(i + 1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(15));
            }
            put.seal().expect("seal");
        });
        h.wait_chunk(0).expect("first chunk");
        let when_first = produced.load(Ordering::SeqCst);
        assert!(when_first < 16, "chunk 0 was usable before the producer wrote its last chunk ({when_first})");
        // SAFETY: chunk 0 landed.
        let first = unsafe { std::slice::from_raw_parts(addr as *const u8, 2 * chunk) };
        assert_eq!(first, &value[..2 * chunk]);
        h.wait_all().expect("every chunk");
        producer.join().expect("producer");
    });
    // SAFETY: every chunk settled.
    let got = unsafe { std::slice::from_raw_parts(addr as *const u8, value.len()) };
    assert_eq!(got, &value[..]);
    assert_eq!(store.get(b"follow").expect("sealed"), value);
    drop(h);
    wait_idle(&store);
}

#[test]
fn readers_of_an_aborted_or_dropped_producer_fail_and_nothing_hangs() {
    let store = stream_store(|b| b);
    for drop_it in [false, true] {
        let put = store.progressive_put(b"gone", 4096, 1024, PutOptions::INSERT).expect("put");
        put.put_chunk(0, Region::host_readonly(&[7u8; 1024])).expect("chunk 0");
        let readers: Vec<_> = (0..3)
            .map(|_| store.progressive_get_unsealed(b"gone", Region::host(buffer(4096, 0)), 1024).expect("follow"))
            .collect();
        readers[0].wait_chunk(0).expect("chunk 0 landed before the abort");
        let waiter = {
            let h = &readers[1];
            std::thread::scope(|s| {
                let t = s.spawn(|| h.wait_chunk(3));
                std::thread::sleep(Duration::from_millis(20));
                if drop_it {
                    drop(put);
                } else {
                    put.abort();
                }
                t.join().expect("waiter")
            })
        };
        let why = if drop_it { "dropped its stream" } else { "it aborted" };
        match waiter {
            Err(Error::ProducerAborted(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("expected ProducerAborted, got {other:?}"),
        }
        for h in &readers {
            assert!(matches!(h.wait_all(), Err(Error::ProducerAborted(_))));
        }
        assert_eq!(store.exists(b"gone"), Ok(false));
        // A new reader finds nothing to follow.
        assert_eq!(
            store.progressive_get_unsealed(b"gone", Region::host(buffer(4096, 0)), 1024).err(),
            Some(Error::NotFound)
        );
        drop(readers);
        wait_idle(&store);
    }
    let s = store.stats().stream;
    assert_eq!((s.producer_aborts, s.unsealed_objects, s.unsealed_bytes), (2, 0, 0), "{s:?}");
    assert_eq!(store.stats().total.bytes_used, 0, "the reservations went back");
}

#[test]
fn an_unsealed_put_expires_after_its_ttl() {
    let store = stream_store(|b| b.unsealed_ttl_ms(300));
    let mut put = store.progressive_put(b"ttl", 2048, 1024, PutOptions::INSERT).expect("put");
    put.put_chunk(0, Region::host_readonly(&[1u8; 1024])).expect("chunk 0");
    let h = store.progressive_get_unsealed(b"ttl", Region::host(buffer(2048, 0)), 1024).expect("follow");
    h.wait_chunk(0).expect("chunk 0");
    let started = Instant::now();
    assert!(matches!(h.wait_chunk(1), Err(Error::ProducerAborted(m)) if m.contains("unsealed_ttl_ms")));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(put.put_chunk(1, Region::host_readonly(&[1u8; 1024])), Err(Error::ProducerAborted(_))));
    assert!(matches!(put.seal(), Err(Error::ProducerAborted(_))));
    drop(put);
    // Nobody touches it at all: the reaper ends it.
    let idle = store.progressive_put(b"idle", 1024, 1024, PutOptions::INSERT).expect("idle put");
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.stats().stream.unsealed_objects > 0 {
        assert!(Instant::now() < deadline, "the reaper did not end the idle put");
        std::thread::sleep(Duration::from_millis(10));
    }
    store.sync_shards().expect("sync");
    assert_eq!(store.stats().total.writes_in_flight, 0, "the expired reservation went back while its stream lives");
    drop(idle);
    drop(h);
    wait_idle(&store);
    assert_eq!(store.stats().stream.unsealed_expired, 2);
}

#[test]
fn unsealed_bytes_and_open_handles_are_bounded() {
    let store = stream_store(|b| b.shards(1).unsealed_bytes_per_shard(1 << 20).stream_max_handles(2));
    let first = store.progressive_put(b"one", 768 << 10, 64 << 10, PutOptions::INSERT).expect("first");
    match store.progressive_put(b"two", 512 << 10, 64 << 10, PutOptions::INSERT) {
        Err(Error::TooLarge { len, max, .. }) => assert_eq!((len, max), (1280 << 10, 1 << 20)),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let h1 = store.progressive_get_unsealed(b"one", Region::host(buffer(768 << 10, 0)), 64 << 10).expect("h1");
    let h2 = store.progressive_get_unsealed(b"one", Region::host(buffer(768 << 10, 0)), 64 << 10).expect("h2");
    assert_eq!(
        store.progressive_get_unsealed(b"one", Region::host(buffer(768 << 10, 0)), 64 << 10).err(),
        Some(Error::Busy { limit: 2 })
    );
    drop((h1, h2));
    first.abort();
    wait_idle(&store);
    let second = store.progressive_put(b"two", 512 << 10, 64 << 10, PutOptions::INSERT).expect("room again");
    drop(second);
    wait_idle(&store);
}

#[test]
fn the_bytes_a_reader_follows_are_kept_until_it_is_done() {
    // A producer that seals while a reader still reads, and an upsert that replaces the object
    // right after: the reader still gets the producer's bytes.
    let store = stream_store(|b| b);
    let value = value_for(b"kept", 1, 512 << 10);
    let mut put = store.progressive_put(b"kept", value.len() as u64, 64 << 10, PutOptions::INSERT).expect("put");
    let dst = buffer(value.len(), 0);
    let addr = dst.as_ptr() as usize;
    let h = store.progressive_get_unsealed(b"kept", Region::host(dst), 64 << 10).expect("follow");
    for i in 0..8 {
        put.put_chunk(i, Region::host_readonly(&value[i * (64 << 10)..(i + 1) * (64 << 10)])).expect("chunk");
    }
    put.seal().expect("seal");
    drop(put);
    store.put(b"kept", &[0u8; 100], PutOptions::UPSERT).expect("replace");
    store.remove(b"kept", true).expect("remove");
    h.wait_all().expect("the reader finished on the producer's bytes");
    // SAFETY: every chunk settled.
    let got = unsafe { std::slice::from_raw_parts(addr as *const u8, value.len()) };
    assert_eq!(got, &value[..]);
    drop(h);
    wait_idle(&store);
    assert_eq!(store.stats().total.bytes_used, 0);
}

fn ssd_tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvtide-stream-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

#[test]
fn progressive_get_reads_ssd_resident_objects() {
    let dir = ssd_tmp("ssd");
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(2)
        .pin_threads(false)
        .idle_spin_us(10)
        .ssd_dir(&dir)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(4 << 20)
        .open()
        .expect("open");
    let key = |i: u64| format!("ssd/{i}").into_bytes();
    for i in 0..100u64 {
        store.put(&key(i), &value_for(&key(i), i, 256 << 10), PutOptions::INSERT).expect("put");
    }
    store.sync_shards().expect("sync");
    assert!(store.stats().total.demotions > 0);
    let loads = store.stats().total.loads;
    for i in [0u64, 1, 2, 50, 99] {
        let dst = buffer(256 << 10, 0);
        let addr = dst.as_ptr() as usize;
        let h = store.progressive_get(&key(i), Region::host(dst), 64 << 10).expect("progressive_get");
        h.wait_all().expect("all");
        // SAFETY: every chunk settled.
        let got = unsafe { std::slice::from_raw_parts(addr as *const u8, 256 << 10) };
        assert_eq!(got, &value_for(&key(i), i, 256 << 10)[..], "key {i}");
    }
    assert!(store.stats().total.loads > loads, "some reads came from SSD");
    // Streaming ranges over SSD-resident keys.
    let dst = buffer(3000, 0);
    let addr = dst.as_ptr() as usize;
    let frags = vec![vec![Fragment::new(key(3), 1000, 0, 1000), Fragment::new(key(4), 0, 1000, 2000)]];
    let h = store.streaming_batch_get_buffer_ranges(&[Region::host(dst)], &frags, 512).expect("streaming");
    h.wait_all().expect("all");
    // SAFETY: every chunk settled.
    let got = unsafe { std::slice::from_raw_parts(addr as *const u8, 3000) };
    assert_eq!(&got[..1000], &value_for(&key(3), 3, 256 << 10)[1000..2000]);
    assert_eq!(&got[1000..], &value_for(&key(4), 4, 256 << 10)[..2000]);
    drop(h);
    wait_idle(&store);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn shutting_down_ends_unsealed_puts_and_their_readers() {
    let store = stream_store(|b| b);
    let put = store.progressive_put(b"s", 4096, 1024, PutOptions::INSERT).expect("put");
    let h = store.progressive_get_unsealed(b"s", Region::host(buffer(4096, 0)), 1024).expect("follow");
    store.shutdown();
    assert!(matches!(h.wait_all(), Err(Error::ProducerAborted(m)) if m.contains("shut down")));
    assert!(matches!(put.put_chunk(0, Region::host_readonly(&[0u8; 1024])), Err(Error::ProducerAborted(_))));
    assert_eq!(store.progressive_put(b"t", 1, 1, PutOptions::INSERT).err(), Some(Error::ShuttingDown));
    assert_eq!(store.progressive_get(b"s", Region::host(buffer(1, 0)), 1).err(), Some(Error::ShuttingDown));
}

#[test]
fn disk_errors_and_rotten_records_fail_the_call_or_their_chunks_only() {
    // Every SSD read fails on the simulated disk: the object cannot be loaded.
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(4 << 20)
        .simulated_ssd(5, kvtide::SimFaults { read_eio_ppm: 1_000_000, ..kvtide::SimFaults::default() })
        .open()
        .expect("open");
    let key = |i: u64| format!("eio/{i}").into_bytes();
    for i in 0..60u64 {
        store.put(&key(i), &value_for(&key(i), i, 256 << 10), PutOptions::INSERT).expect("put");
    }
    store.sync_shards().expect("sync");
    assert!(store.stats().total.demotions > 0);
    // The object is leased as its load starts: the read errors fail its chunks.
    let h = store.progressive_get(&key(0), Region::host(buffer(256 << 10, 0)), 64 << 10).expect("leased early");
    assert!(matches!(h.wait_all(), Err(Error::Io(_))));
    assert!(matches!(h.chunk_state(0), Some(ChunkState::Failed(Error::Io(_)))), "{:?}", h.chunk_state(0));
    drop(h);
    let dst = buffer(2048, 0);
    let frags = vec![vec![Fragment::new(key(1), 0, 0, 1024), Fragment::new(key(59), 0, 1024, 1024)]];
    let h = store.streaming_batch_get_buffer_ranges(&[Region::host(dst)], &frags, 512).expect("streaming");
    assert!(h.wait_all().is_err());
    assert!(matches!(h.chunk_state(0), Some(ChunkState::Failed(Error::Io(_)))), "{:?}", h.chunk_state(0));
    assert_eq!(h.chunk_state(2), Some(ChunkState::Done), "a DRAM-resident neighbour is delivered");
    drop(h);
    wait_idle(&store);
    drop(store);

    // A record that rots on disk after recovery fails with Corrupted, and only that key.
    let dir = ssd_tmp("rot");
    let open = || {
        StoreBuilder::new()
            .dram_bytes(8 << 20)
            .shards(1)
            .pin_threads(false)
            .ssd_dir(&dir)
            .ssd_bytes(32 << 20)
            .ssd_segment_bytes(4 << 20)
            .write_through(true)
            .open()
            .expect("open")
    };
    {
        let store = open();
        store.put(b"rot", &[3u8; 10_000], PutOptions::INSERT).expect("rot");
        store.put(b"ok", &[4u8; 100], PutOptions::INSERT).expect("ok");
    }
    let store = open();
    // Segment 0: header block, then "rot" (header, key, checksum table, value).
    let seg = dir.join("shard-000/seg-000000.kvt");
    let mut bytes = std::fs::read(&seg).expect("read segment");
    bytes[4096 + 64 + 3 + 4 + 700] ^= 0x20;
    std::fs::write(&seg, &bytes).expect("rot the record");
    let h = store.progressive_get(b"rot", Region::host(buffer(10_000, 0)), 4096).expect("leased early");
    assert!(matches!(h.wait_all(), Err(Error::Corrupted(_))));
    assert!((0..h.num_chunks()).all(|i| matches!(h.chunk_state(i), Some(ChunkState::Failed(Error::Corrupted(_))))));
    drop(h);
    assert_eq!(store.get(b"rot").err(), Some(Error::NotFound), "a rotten record is dropped");
    let dst = buffer(100, 0);
    let addr = dst.as_ptr() as usize;
    let h = store.progressive_get(b"ok", Region::host(dst), 64).expect("the other key");
    h.wait_all().expect("ok");
    // SAFETY: every chunk settled.
    assert_eq!(unsafe { std::slice::from_raw_parts(addr as *const u8, 100) }, &[4u8; 100][..]);
    drop(h);
    wait_idle(&store);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_reader_of_an_empty_put_waits_for_its_one_chunk_and_sees_an_abort() {
    // Found by the chunk_handles fuzz target: an empty object's one chunk used to count as
    // landed at once, so a reader of an aborted empty put reported success.
    let store = stream_store(|b| b);
    let put = store.progressive_put(b"empty", 0, 16, PutOptions::INSERT).expect("put");
    let h = store.progressive_get_unsealed(b"empty", Region::host(buffer(0, 0)), 97).expect("follow");
    assert_eq!(h.wait_chunk_timeout(0, 50), Ok(false), "not before the producer wrote it");
    drop(put);
    assert!(matches!(h.wait_all(), Err(Error::ProducerAborted(_))));
    let mut put = store.progressive_put(b"empty", 0, 16, PutOptions::INSERT).expect("put again");
    let h = store.progressive_get_unsealed(b"empty", Region::host(buffer(0, 0)), 97).expect("follow");
    put.put_chunk(0, Region::host_readonly(&[])).expect("the empty chunk");
    h.wait_all().expect("landed");
    put.seal().expect("seal");
    drop((h, put));
    wait_idle(&store);
}

/// Value bytes each checksum table entry of an SSD record covers.
const CHECK_BLOCK_BYTES: usize = 64 << 10;

/// An SSD-resident object is delivered block by block as its checked front grows: a block that
/// rotted on disk fails the chunks that need it and those after it, while the chunks before it
/// (checked against their own checksums) are delivered intact. The rotten record is dropped and
/// nothing stays held.
#[test]
fn a_rotten_block_fails_only_the_chunks_from_it_on() {
    let dir = ssd_tmp("blocks");
    let open = || {
        StoreBuilder::new()
            .dram_bytes(16 << 20)
            .shards(1)
            .pin_threads(false)
            .ssd_dir(&dir)
            .ssd_bytes(32 << 20)
            .ssd_segment_bytes(4 << 20)
            .write_through(true)
            .open()
            .expect("open")
    };
    let len = 16 * CHECK_BLOCK_BYTES + 5000;
    let value = value_for(b"blocks", 1, len);
    {
        let store = open();
        store.put(b"blocks", &value, PutOptions::INSERT).expect("put");
    }
    // Rotted after recovery (a scan would skip the record), found as the read reaches it.
    let store = open();
    // Segment 0: header block, then the record: header, key, checksum table, value.
    let table = 4 * len.div_ceil(CHECK_BLOCK_BYTES);
    let value_at = 4096 + 64 + b"blocks".len() + table;
    let seg = dir.join("shard-000/seg-000000.kvt");
    let mut bytes = std::fs::read(&seg).expect("read segment");
    bytes[value_at + 10 * CHECK_BLOCK_BYTES + 123] ^= 0x08;
    std::fs::write(&seg, &bytes).expect("rot block 10");
    let scratch_bytes = store.stats().total.bytes_used;
    let dst = buffer(len, 0);
    let addr = dst.as_ptr() as usize;
    let h = store.progressive_get(b"blocks", Region::host(dst), CHECK_BLOCK_BYTES as u64).expect("leased early");
    assert!(matches!(h.wait_all(), Err(Error::Corrupted(_))));
    for i in 0..h.num_chunks() {
        match h.chunk_state(i) {
            Some(ChunkState::Done) => {
                assert!(i < 10, "chunk {i} past the rotten block was delivered");
                let range = h.chunk_range(i).expect("range");
                // SAFETY: the chunk settled; its bytes are in the destination.
                let got = unsafe {
                    std::slice::from_raw_parts((addr + range.start as usize) as *const u8, CHECK_BLOCK_BYTES)
                };
                assert_eq!(got, &value[range.start as usize..range.end as usize], "chunk {i}");
            }
            Some(ChunkState::Failed(Error::Corrupted(why))) => {
                assert!(i >= 10, "chunk {i} before the rotten block failed: {why}")
            }
            other => panic!("chunk {i}: {other:?}"),
        }
    }
    assert_eq!((0..10).filter(|&i| h.chunk_state(i) == Some(ChunkState::Done)).count(), 10);
    drop(h);
    assert_eq!(store.get(b"blocks").err(), Some(Error::NotFound), "the rotten record is dropped");
    wait_idle(&store);
    assert_eq!(store.stats().total.bytes_used, scratch_bytes, "the load buffer went back");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// On a slow disk the chunks of an SSD-resident object start while its load is still running:
/// the first chunk waits for the first pieces' reads, not for the whole object.
#[test]
fn ssd_chunks_start_before_their_object_finished_loading() {
    let store = StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(8 << 20)
        .simulated_ssd(9, kvtide::SimFaults { us_per_mib: 40_000, ..kvtide::SimFaults::default() })
        .open()
        .expect("open");
    let key = |i: u64| format!("slow/{i}").into_bytes();
    let len = 4 << 20;
    for i in 0..4u64 {
        store.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    store.sync_shards().expect("sync");
    let loads = store.stats().total.loads;
    let dst = buffer(len, 0);
    let addr = dst.as_ptr() as usize;
    let h = store.progressive_get(&key(0), Region::host(dst), 256 << 10).expect("progressive_get");
    h.wait_all().expect("all");
    // SAFETY: every chunk settled.
    assert_eq!(unsafe { std::slice::from_raw_parts(addr as *const u8, len) }, &value_for(&key(0), 0, len)[..]);
    assert_eq!(store.stats().total.loads, loads + 1, "the object came from SSD");
    let s = store.stats().stream;
    assert!(s.chunks_ahead_of_load > 0, "no chunk started before the load ended: {s:?}");
    drop(h);
    wait_idle(&store);
}

#[test]
fn a_key_whose_chunks_all_settled_is_no_longer_leased_by_its_handle() {
    // A caller that saw every chunk settle removes the key at once: the handle's lease went back
    // before the last chunk was reported, so the remove never finds it `Leased`.
    let store = stream_store(|b| b);
    let value = value_for(b"settled", 1, 10_000);
    for round in 0..2000 {
        store.put(b"settled", &value, PutOptions::UPSERT).expect("put");
        let h = store.progressive_get(b"settled", Region::host(buffer(10_000, 0)), 4096).expect("progressive_get");
        h.wait_all().expect("every chunk");
        if let Err(e) = store.remove(b"settled", false) {
            panic!("round {round}: the remove right after the chunks settled failed: {e:?}");
        }
    }
    wait_idle(&store);
}
