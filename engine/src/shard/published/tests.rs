//! The lease protocol under loom (every interleaving of a few threads, with data races on the
//! object's bytes detected), and the key table against a model.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use loom::cell::UnsafeCell;

use super::{FastRead, IndexWriter, LeaseWord, Word};
use crate::stats::ShardCounters;

impl Word for loom::sync::atomic::AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        loom::sync::atomic::AtomicU64::load(self, order)
    }
    fn store(&self, value: u64, order: Ordering) {
        loom::sync::atomic::AtomicU64::store(self, value, order)
    }
    fn compare_exchange_weak(&self, current: u64, new: u64, ok: Ordering, err: Ordering) -> Result<u64, u64> {
        loom::sync::atomic::AtomicU64::compare_exchange_weak(self, current, new, ok, err)
    }
    fn fetch_sub(&self, value: u64, order: Ordering) -> u64 {
        loom::sync::atomic::AtomicU64::fetch_sub(self, value, order)
    }
    fn fetch_and(&self, value: u64, order: Ordering) -> u64 {
        loom::sync::atomic::AtomicU64::fetch_and(self, value, order)
    }
    fn fetch_or(&self, value: u64, order: Ordering) -> u64 {
        loom::sync::atomic::AtomicU64::fetch_or(self, value, order)
    }
}

/// One object slot as the protocol sees it: the lease word, and the bytes it guards (the
/// object's value, holding its generation so a reader can tell whose bytes it read).
struct ModelSlot {
    word: LeaseWord<loom::sync::atomic::AtomicU64>,
    bytes: UnsafeCell<u64>,
}

// SAFETY: the UnsafeCell is only touched under the protocol being checked; loom reports any
// access that the protocol fails to order.
unsafe impl Sync for ModelSlot {}

fn open_slot(generation: u32) -> Arc<ModelSlot> {
    let slot = ModelSlot {
        word: LeaseWord(loom::sync::atomic::AtomicU64::new(0)),
        bytes: UnsafeCell::new(u64::from(generation)),
    };
    slot.word.reset(generation);
    slot.word.open();
    Arc::new(slot)
}

/// A reader: lease, read the bytes, check they are the leased generation's, give back.
fn read(slot: &ModelSlot) -> Option<u32> {
    let generation = slot.word.acquire()?;
    // SAFETY: read under a lease; loom checks that no write can race with it.
    let seen = slot.bytes.with(|p| unsafe { *p });
    assert_eq!(seen, u64::from(generation), "a reader saw another generation's bytes");
    slot.word.release();
    Some(generation)
}

/// `n` reader threads, each taking one lease (see `read`).
fn spawn_readers(slot: &Arc<ModelSlot>, n: usize) -> Vec<loom::thread::JoinHandle<Option<u32>>> {
    (0..n)
        .map(|_| {
            let slot = Arc::clone(slot);
            loom::thread::spawn(move || read(&slot))
        })
        .collect()
}

/// Eviction: the shard closes the slot only if it sees no reader, atomically, then reuses the
/// bytes for another object and opens the slot for it. Readers never see a torn or foreign value.
#[test]
fn eviction_never_reuses_bytes_under_a_reader() {
    loom::model(|| {
        let slot = open_slot(1);
        let readers = spawn_readers(&slot, 2);
        if slot.word.close_if_unused() {
            // SAFETY: closed with no reader: nobody can read these bytes until the slot opens.
            slot.bytes.with_mut(|p| unsafe { *p = 2 });
            slot.word.reset(2);
            slot.word.open();
        }
        for r in readers {
            let got = r.join().expect("reader");
            assert!(matches!(got, None | Some(1) | Some(2)));
        }
        assert_eq!(slot.word.readers(), 0, "every lease came back");
    });
}

/// Remove and upsert: the shard closes the slot whatever the readers, waits for the count to
/// drain, then frees (here: rewrites) the bytes. A reader either got in before the close and
/// read the old bytes, or was refused.
#[test]
fn retire_waits_for_readers_to_drain() {
    loom::model(|| {
        let slot = open_slot(1);
        let readers = spawn_readers(&slot, 2);
        slot.word.close();
        while slot.word.readers() > 0 {
            loom::thread::yield_now();
        }
        // SAFETY: closed and drained: no reader holds or can take a lease.
        slot.bytes.with_mut(|p| unsafe { *p = 7 });
        for r in readers {
            assert!(matches!(r.join().expect("reader"), None | Some(1)));
        }
        assert_eq!(slot.word.acquire(), None, "a closed slot stays closed");
    });
}

/// A slot closed while a reader holds it (a record write starting) and opened again for the same
/// generation: the reader's lease stays counted, and the shard does not see the slot unused.
#[test]
fn close_and_reopen_keeps_a_held_lease_counted() {
    loom::model(|| {
        let slot = open_slot(3);
        let reader = {
            let slot = Arc::clone(&slot);
            loom::thread::spawn(move || {
                let got = slot.word.acquire();
                if got.is_some() {
                    slot.word.release();
                }
                got
            })
        };
        let held = slot.word.close();
        let unused = slot.word.close_if_unused();
        assert!(!(held > 0 && unused && slot.word.readers() > 0));
        slot.word.open();
        let got = reader.join().expect("reader");
        assert!(matches!(got, None | Some(3)));
        assert_eq!(slot.word.readers(), 0);
    });
}

fn hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

/// The key table and the slots against a model: inserts, removes (with their backward shifts),
/// growth, and lookups of present and absent keys; every lease comes back.
#[test]
fn table_matches_a_model_through_growth_and_removal() {
    // Growth into new tables (room for 1024 keys, 5000 used) and in place (room for all).
    for max_keys in [1024, 8192] {
        table_matches_a_model(max_keys, 5000, 0, 40_000, hash);
    }
}

/// A hash with 8 values: every key lands on one of 8 homes, so runs grow far past what an
/// entry's displacement field holds and entries' homes are found by hashing their keys.
fn clumped(key: &[u8]) -> u64 {
    (xxhash_rust::xxh3::xxh3_64(key) % 8).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The same through entries saturated at the largest displacement, and through a rebuild for
/// slot ids beyond the table's layout (made for 1024 slots, which has room for 65,535).
#[test]
fn table_matches_a_model_through_long_runs_and_large_slot_ids() {
    table_matches_a_model(1024, 400, 0, 4000, clumped);
    table_matches_a_model(1024, 3000, 64_000, 6000, hash);
}

/// Every key hashes alike: each key's entry is a candidate for the others' probes.
fn alike(_: &[u8]) -> u64 {
    0x1234_5678_9abc_def0
}

/// A candidate closed to readers (another key sharing the home and tag, on SSD only say) neither
/// hides a key behind it nor lets an absent key be answered as missing: the probe goes on past
/// it, and what it cannot rule out goes to the shard.
#[test]
fn a_closed_candidate_neither_hides_a_key_nor_fakes_a_miss() {
    let counters = Arc::new(ShardCounters::default());
    let mut writer = IndexWriter::new(Arc::clone(&counters), 64, alike);
    let values = [1u64, 2];
    for (slot, key) in [(0u32, &b"closed"[..]), (1, b"open")] {
        assert!(writer.adopt(slot, 1, key, 8));
        writer.insert(alike(key), slot);
    }
    assert!(writer.open(1, 1, std::ptr::NonNull::from(&values[1]).cast()));
    match writer.shared().lease(b"open", alike(b"open")) {
        FastRead::Hit { lease, ptr, .. } => {
            // SAFETY: the lease keeps values[1] (which outlives the index) in place.
            assert_eq!(unsafe { ptr.cast::<u64>().as_ptr().read() }, 2);
            writer.shared().release(lease);
        }
        _ => panic!("the key behind a closed candidate was not found"),
    }
    assert!(matches!(writer.shared().lease(b"absent", alike(b"absent")), FastRead::Fallback), "closed: not a miss");
    assert!(writer.open(0, 1, std::ptr::NonNull::from(&values[0]).cast()));
    assert!(matches!(writer.shared().lease(b"absent", alike(b"absent")), FastRead::Miss), "all open: a miss");
    assert_eq!(counters.snapshot().published_leases_held, 0);
}

/// `steps` random inserts and removes of `n` keys, in slots from `first_slot`, under `hash`,
/// checked against a model every 97 steps.
fn table_matches_a_model(max_keys: u32, n: u32, first_slot: u32, steps: u32, hash: fn(&[u8]) -> u64) {
    let counters = Arc::new(ShardCounters::default());
    let mut writer = IndexWriter::new(Arc::clone(&counters), max_keys, hash);
    let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("key-{i}").into_bytes()).collect();
    let values: Vec<u64> = (0..u64::from(n)).collect();
    let hashes: Vec<u64> = keys.iter().map(|k| hash(k)).collect();
    let mut present = vec![false; keys.len()];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for step in 0..steps {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let i = (rng % keys.len() as u64) as usize;
        let slot = first_slot + i as u32;
        if present[i] {
            writer.close(slot);
            assert!(writer.remove(hashes[i], slot), "step {step}: removes key {i}");
            writer.disown(slot);
            assert!(writer.key(slot).is_empty());
            present[i] = false;
        } else {
            let value = std::ptr::NonNull::from(&values[i]).cast::<u8>();
            assert!(writer.adopt(slot, step + 1, &keys[i], 8));
            assert_eq!((writer.key(slot), writer.value_len(slot)), (&keys[i][..], 8));
            assert!(writer.open(slot, step + 1, value));
            writer.insert(hashes[i], slot);
            present[i] = true;
        }
        if step % 97 == 0 {
            for (j, key) in keys.iter().enumerate() {
                let found = writer.find(hashes[j], |s| writer.key(s) == &key[..]);
                assert_eq!(found.is_some(), present[j], "step {step}: key {j}");
                match writer.shared().lease(key, hashes[j]) {
                    FastRead::Hit { lease, ptr, len } => {
                        assert!(present[j]);
                        assert_eq!(len, 8);
                        // SAFETY: the lease keeps values[j] (which outlives the index) in place.
                        assert_eq!(unsafe { ptr.cast::<u64>().as_ptr().read() }, values[j]);
                        writer.shared().release(lease);
                    }
                    FastRead::Miss => assert!(!present[j], "step {step}: key {j} missed"),
                    FastRead::Fallback => panic!("step {step}: no writer ran meanwhile, yet a fallback"),
                }
            }
        }
    }
    assert_eq!(writer.len(), present.iter().filter(|&&p| p).count());
    let replaced = writer.shared().old_tables.lock().map_or(0, |t| t.len());
    let rebuilt = first_slot + n >= 1 << 16;
    if n == 5000 {
        assert_eq!(replaced == 0, max_keys == 8192, "grew in place only within the room reserved");
    }
    assert!(!rebuilt || replaced > 0 && writer.shared().table().view().layout.slot_bits > 16, "rebuilt for larger ids");
    assert_eq!(counters.snapshot().published_leases_held, 0);
    assert!(writer.shut(std::time::Duration::from_millis(10)));
    assert!(matches!(writer.shared().lease(&keys[0], hashes[0]), FastRead::Fallback), "a shut index leases nothing");
}

/// Readers looking up keys that stay present while the writer grows the table in place (and
/// removes other keys, shifting entries back) see hits or fallbacks, never a miss or wrong bytes.
#[test]
fn readers_never_miss_a_present_key_while_the_table_grows_in_place() {
    let counters = Arc::new(ShardCounters::default());
    let mut writer = IndexWriter::new(Arc::clone(&counters), 1 << 16, hash);
    let n = 40_000u32;
    let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("grow-{i}").into_bytes()).collect();
    let values: Vec<u64> = (0..u64::from(n)).collect();
    let hashes: Vec<u64> = keys.iter().map(|k| hash(k)).collect();
    let stable = 64u32;
    let publish = |writer: &mut IndexWriter, i: u32| {
        let value = std::ptr::NonNull::from(&values[i as usize]).cast::<u8>();
        assert!(writer.adopt(i, 1, &keys[i as usize], 8));
        assert!(writer.open(i, 1, value));
        writer.insert(hashes[i as usize], i);
    };
    for i in 0..stable {
        publish(&mut writer, i);
    }
    let index = Arc::clone(writer.shared());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (hits, fallbacks) = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (index, keys, hashes, values, stop) = (&index, &keys, &hashes, &values, &stop);
                scope.spawn(move || {
                    let (mut hits, mut fallbacks) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        for i in 0..stable as usize {
                            match index.lease(&keys[i], hashes[i]) {
                                FastRead::Hit { lease, ptr, .. } => {
                                    // SAFETY: the lease keeps values[i] (which outlives the index) in place.
                                    assert_eq!(unsafe { ptr.cast::<u64>().as_ptr().read() }, values[i]);
                                    index.release(lease);
                                    hits += 1;
                                }
                                FastRead::Miss => panic!("key {i} is present throughout, yet missed"),
                                FastRead::Fallback => fallbacks += 1,
                            }
                        }
                    }
                    (hits, fallbacks)
                })
            })
            .collect();
        for i in stable..n {
            publish(&mut writer, i);
            if i % 3 == 0 {
                writer.close(i - 1);
                assert!(writer.remove(hashes[i as usize - 1], i - 1));
            }
        }
        stop.store(true, Ordering::Relaxed);
        readers.into_iter().map(|r| r.join().expect("reader")).fold((0, 0), |(h, f), (a, b)| (h + a, f + b))
    });
    assert!(hits > 0, "{hits} hits, {fallbacks} fallbacks");
    assert!(writer.shared().old_tables.lock().is_ok_and(|t| t.is_empty()), "grew in place");
    assert!(writer.shared().table().view().capacity() >= 32_768);
    assert_eq!(counters.snapshot().published_leases_held, 0);
}

#[test]
fn a_published_slot_is_24_bytes() {
    assert_eq!(std::mem::size_of::<super::ObjectSlot>(), 24);
}

/// A slot keeps its object's key and value length from `adopt` to `disown`, and refuses a value
/// of 8 TiB or more (the shard refuses such values first).
#[test]
fn slots_keep_keys_and_lengths_between_adopt_and_disown() {
    let counters = Arc::new(ShardCounters::default());
    let mut writer = IndexWriter::new(Arc::clone(&counters), 64, hash);
    assert!(writer.key(3).is_empty());
    assert_eq!(writer.value_len(3), 0);
    assert!(writer.adopt(3, 7, b"some key", super::MAX_VALUE_BYTES));
    assert_eq!((writer.key(3), writer.value_len(3)), (&b"some key"[..], super::MAX_VALUE_BYTES));
    assert_eq!(writer.shared().slot(3).map(|s| s.word.state()), Some((7, false)), "adopted closed");
    assert!(!writer.adopt(4, 1, b"k", super::MAX_VALUE_BYTES + 1));
    assert!(writer.key(4).is_empty());
    let value = 5u64;
    assert!(writer.open(3, 7, std::ptr::NonNull::from(&value).cast()));
    assert_eq!(writer.readers(3), 0);
    writer.close(3);
    writer.disown(3);
    assert!(writer.key(3).is_empty());
    assert_eq!(writer.value_len(3), 0);
    // Keys still held when the index goes are freed with it (a long one, allocated alone, too).
    assert!(writer.adopt(5, 2, &[b'x'; 600], 1));
}
