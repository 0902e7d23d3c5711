//! A shard lends its core to callers while it is idle: their writes (reserve, commit, abort)
//! run on the caller's thread without waking the shard, give the same results, and leave the
//! shard's own work (eviction towards the low watermark) to the shard, which they poke.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_idle, value_for};
use kvtide::{Error, PutOptions, Store, StoreBuilder};

fn store(dram_bytes: u64) -> kvtide::Engine {
    StoreBuilder::new()
        .dram_bytes(dram_bytes)
        .shards(1)
        .pin_threads(false)
        .idle_spin_us(10)
        .high_watermark(0.9)
        .low_watermark(0.5)
        .open()
        .expect("open")
}

/// Waits until `done` holds (or five seconds passed) and says whether it did.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    done()
}

#[test]
fn writes_to_an_idle_shard_are_served_on_the_callers_thread() {
    let store = store(32 << 20);
    let keys: Vec<Vec<u8>> = (0..100u32).map(|i| format!("lend/{i}").into_bytes()).collect();
    // Parked: nothing else runs its core.
    std::thread::sleep(Duration::from_millis(50));
    let before = store.stats().total;
    for key in &keys {
        store.put(key, &value_for(key, 1, 3000), PutOptions::INSERT).expect("insert");
    }
    // Same results as the shard gives: an existing key is refused, an upsert replaces it.
    assert_eq!(store.put(&keys[0], b"again", PutOptions::INSERT), Err(Error::AlreadyExists));
    store.put(&keys[1], &value_for(&keys[1], 2, 5000), PutOptions::UPSERT).expect("upsert");
    let after = store.stats().total;
    let served = after.served_by_callers - before.served_by_callers;
    assert!(served >= 100, "most reserve and commit requests were served by the caller: {served}");
    assert!(after.requests - before.requests >= served, "served requests are counted as requests");
    for (i, key) in keys.iter().enumerate() {
        let want = if i == 1 { value_for(key, 2, 5000) } else { value_for(key, 1, 3000) };
        assert_eq!(store.get(key).expect("get"), want);
    }
    assert_eq!(store.stats().total.objects, 100);
    assert_idle(&store);
}

#[test]
fn a_caller_that_leaves_eviction_to_the_shard_pokes_it() {
    let capacity: u64 = 8 << 20;
    let store = store(capacity);
    std::thread::sleep(Duration::from_millis(50));
    // Fill past the high watermark (90 %) with writes served on this thread; the write that
    // crosses it pokes the parked shard.
    let mut i = 0u32;
    while store.stats().total.bytes_used < capacity * 9 / 10 && store.stats().total.evictions == 0 {
        let key = format!("fill/{i}").into_bytes();
        store.put(&key, &value_for(&key, 1, 64 << 10), PutOptions::INSERT).expect("fill");
        i += 1;
        assert!(i < 1000, "the pool never passed its high watermark");
    }
    assert!(store.stats().total.served_by_callers > 0);
    // No further request comes: the poke alone brings the shard down to its low watermark.
    let low = capacity / 2;
    assert!(eventually(|| store.stats().total.bytes_used <= low), "evicted towards the low watermark");
    assert!(store.stats().total.evictions > 0);
    assert_idle(&store);
}

/// A value that names its version in its first 8 bytes; its length varies with the version.
fn stamped(key: &[u8], version: u64) -> Vec<u8> {
    let mut value = version.to_le_bytes().to_vec();
    value.extend(value_for(key, version, 2000 + (version as usize % 7) * 100));
    value
}

#[test]
fn writers_on_many_threads_and_the_shard_never_run_the_core_at_once() {
    // Callers race each other and the shard (which serves whoever finds its core busy); every
    // read returns some writer's whole value, and the counters end at zero.
    let store = Arc::new(store(16 << 20));
    let keys: Vec<Vec<u8>> = (0..16u32).map(|i| format!("race/{i}").into_bytes()).collect();
    // Whether a caller finds the core busy depends on scheduling: on a loaded machine the threads
    // can run one after another for a whole round, so rounds repeat (at most 20) until both the
    // callers and the shard have served.
    for _ in 0..20 {
        race(&store, &keys);
        let s = store.stats().total;
        if s.served_by_callers > 0 && s.served_by_callers < s.requests {
            break;
        }
    }
    let s = store.stats().total;
    assert!(s.served_by_callers > 0 && s.served_by_callers < s.requests, "{s:?}");
    assert_idle(&store);
}

/// Four threads of removes, reads and upserts over `keys`; every read is some writer's whole value.
fn race(store: &Arc<kvtide::Engine>, keys: &[Vec<u8>]) {
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let (store, keys) = (Arc::clone(store), keys);
            scope.spawn(move || {
                for round in 0..300u64 {
                    let key = &keys[((round * 7 + thread) % keys.len() as u64) as usize];
                    let version = thread * 1000 + round;
                    match round % 5 {
                        0 => {
                            let _ = store.remove(key, false);
                        }
                        1 => match store.get(key) {
                            Ok(got) => {
                                let (stamp, _) = got.split_at(8);
                                let version = u64::from_le_bytes(stamp.try_into().expect("8 bytes"));
                                assert_eq!(got, stamped(key, version), "a read returned a value no writer wrote whole");
                            }
                            Err(Error::NotFound) => {}
                            Err(e) => panic!("get: {e}"),
                        },
                        _ => store.put(key, &stamped(key, version), PutOptions::UPSERT).expect("upsert"),
                    }
                }
            });
        }
    });
}

#[test]
fn a_reservation_taken_on_the_callers_thread_is_aborted_when_dropped() {
    let store = store(32 << 20);
    std::thread::sleep(Duration::from_millis(50));
    let before = store.stats().total;
    let mut pending = store.reserve_put(b"dropped", 4096, PutOptions::INSERT).expect("reserve");
    pending.bytes_mut().fill(7);
    assert_eq!(store.stats().total.writes_in_flight, 1);
    assert!(store.stats().total.served_by_callers > before.served_by_callers, "reserved on this thread");
    drop(pending);
    // The abort goes to the inbox (a drop never takes the core); the shard frees the room.
    assert!(eventually(|| store.stats().total.writes_in_flight == 0), "the reservation was aborted");
    assert_eq!(store.get(b"dropped"), Err(Error::NotFound));
    assert!(eventually(|| store.stats().total.bytes_used == before.bytes_used), "its room came back");
    // A committed one is there, with the caller's bytes.
    let mut pending = store.reserve_put(b"kept", 4096, PutOptions::INSERT).expect("reserve");
    pending.bytes_mut().fill(9);
    pending.commit().expect("commit");
    assert_eq!(store.get(b"kept").expect("get"), vec![9u8; 4096]);
    // Insert of an existing key is refused at the reservation, nothing left reserved.
    assert_eq!(store.reserve_put(b"kept", 10, PutOptions::INSERT).map(|_| ()), Err(Error::AlreadyExists));
    assert_idle(&store);
}

#[test]
fn single_puts_report_bad_input_like_batches_and_leave_nothing_reserved() {
    let store = store(8 << 20);
    std::thread::sleep(Duration::from_millis(50));
    let too_large = vec![0u8; 16 << 20];
    let single = store.put(b"big", &too_large, PutOptions::UPSERT);
    let batch = store.batch_put_from_multi_buffers(
        &[b"big".as_slice()],
        &[vec![kvtide::Region::host_readonly(&too_large)]],
        PutOptions::UPSERT,
    );
    assert!(matches!(single, Err(Error::TooLarge { .. })), "{single:?}");
    assert_eq!(batch, vec![single]);
    assert_eq!(store.put(b"", b"v", PutOptions::UPSERT), Err(Error::EmptyKey));
    // An empty value and a gathered one land whole.
    store.put(b"empty", b"", PutOptions::UPSERT).expect("empty value");
    assert_eq!(store.get(b"empty").expect("get"), Vec::<u8>::new());
    let (a, b) = (vec![1u8; 3000], vec![2u8; 5000]);
    let sources = [kvtide::Region::host_readonly(&a), kvtide::Region::host_readonly(&b)];
    store.put_from(b"gathered", &sources, PutOptions::UPSERT).expect("gathered put");
    assert_eq!(store.get(b"gathered").expect("get"), [a, b].concat());
    assert_idle(&store);
}
