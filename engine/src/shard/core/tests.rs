//! Property tests of the shard state machine against a model: index, leases, pins, eviction and
//! the allocator together, with real bytes written through grants and read back through leases.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide_tiers::dram::Arena;
use kvtide_tiers::eviction::EvictionPolicy;
use proptest::prelude::*;

use super::*;
use std::cell::RefCell;
use std::rc::Rc;

/// Runs a batch call whose callback must fire before it returns (DRAM-only cores never wait).
fn now<T: 'static>(call: impl FnOnce(Done<Vec<T>>)) -> T {
    let cell = Rc::new(RefCell::new(None));
    let sink = Rc::clone(&cell);
    call(Box::new(move |mut v: Vec<T>| *sink.borrow_mut() = v.pop()));
    let out = cell.borrow_mut().take();
    out.expect("a DRAM-only core answers at once")
}

impl ShardCore {
    fn reserve(&mut self, key: &[u8], len: u64, upsert: bool) -> Result<WriteGrant> {
        now(|done| self.reserve_batch(vec![(key.into(), len)], upsert, done))
    }
    fn commit(&mut self, object: ObjectRef, upsert: bool) -> Result<()> {
        now(|done| self.commit_batch(vec![object], upsert, false, done))
    }
    fn lease_read(&mut self, key: &[u8], deadline: Option<Instant>) -> Result<ReadGrant> {
        now(|done| self.lease_read_batch(vec![key.into()], deadline, false, done))
    }
}

/// A DRAM-only shard core of `capacity_bytes` (also lent to callers in `lend`'s tests).
pub(crate) fn core(capacity_bytes: usize, policy: EvictionPolicy) -> ShardCore {
    let arena = Arena::new(capacity_bytes, 1).expect("arena");
    let slice = arena.slice(0).expect("slice");
    let config = ShardConfig {
        high_watermark_bytes: capacity_bytes as u64,
        low_watermark_bytes: capacity_bytes as u64 * 9 / 10,
        policy,
        align_bytes: 64,
        max_objects: 10_000,
        max_leases: 10_000,
    };
    ShardCore::new(config, slice, Arc::new(ShardCounters::default())).expect("core")
}

fn fill(key: u8, version: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| key.wrapping_mul(31) ^ (version as u8).wrapping_mul(7) ^ (i as u8)).collect()
}

#[derive(Debug, Clone)]
enum Op {
    Put { key: u8, len_kib: u16, upsert: bool },
    Read { key: u8 },
    Hold { key: u8 },
    Release { which: usize },
    Remove { key: u8, force: bool },
    Pin { key: u8 },
    Unpin { key: u8 },
    Evict,
    AbortedPut { key: u8, len_kib: u16 },
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0u8..24;
    prop_oneof![
        4 => (key.clone(), 0u16..600, any::<bool>()).prop_map(|(key, len_kib, upsert)| Op::Put { key, len_kib, upsert }),
        3 => key.clone().prop_map(|key| Op::Read { key }),
        2 => key.clone().prop_map(|key| Op::Hold { key }),
        2 => (0usize..8).prop_map(|which| Op::Release { which }),
        1 => (key.clone(), any::<bool>()).prop_map(|(key, force)| Op::Remove { key, force }),
        1 => key.clone().prop_map(|key| Op::Pin { key }),
        1 => key.clone().prop_map(|key| Op::Unpin { key }),
        1 => Just(Op::Evict),
        1 => (key, 0u16..600).prop_map(|(key, len_kib)| Op::AbortedPut { key, len_kib }),
    ]
}

/// What the model knows of a key: its current version and length, and its pin count.
#[derive(Debug, Clone)]
struct Known {
    version: u32,
    len: usize,
    pins: u32,
}

/// `Op::Put` of `(key, len_kib, upsert)` as write `version`, checked against the model.
fn put(
    shard: &mut ShardCore,
    model: &mut HashMap<u8, Known>,
    (key, len_kib, upsert): (u8, u16, bool),
    version: u32,
) -> Result<(), TestCaseError> {
    let len = usize::from(len_kib) * 1024 + usize::from(key);
    match shard.reserve(&[key], len as u64, upsert) {
        Ok(grant) => {
            let bytes = fill(key, version, len);
            // SAFETY: the reservation gives us `len` exclusive bytes at grant.ptr.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), grant.ptr.as_ptr(), len) };
            let had = model.contains_key(&key) && shard.find(&[key][..]).is_some();
            match shard.commit(grant.object, upsert) {
                Ok(()) => {
                    prop_assert!(upsert || !had);
                    let pins = if had { model.get(&key).map_or(0, |k| k.pins) } else { 0 };
                    model.insert(key, Known { version, len, pins });
                }
                Err(Error::AlreadyExists) => prop_assert!(!upsert),
                Err(e) => return Err(TestCaseError::fail(format!("commit: {e}"))),
            }
        }
        Err(Error::AlreadyExists) => prop_assert!(!upsert && shard.find(&[key][..]).is_some()),
        Err(Error::NoSpace) => {
            // Only when pinned + leased + reserved bytes leave no room.
            prop_assert!(shard.policy.len() <= shard.len());
        }
        Err(e) => return Err(TestCaseError::fail(format!("reserve: {e}"))),
    }
    Ok(())
}

/// `Op::Read` (or `Op::Hold`, which keeps the lease in `held`) of `key`, checked against the model.
fn read(
    shard: &mut ShardCore,
    model: &mut HashMap<u8, Known>,
    held: &mut Vec<(u8, u32, ReadGrant)>,
    key: u8,
    hold: bool,
) -> Result<(), TestCaseError> {
    match shard.lease_read(&[key], None) {
        Ok(grant) => {
            let known = model.get(&key).cloned();
            let Some(known) = known else {
                return Err(TestCaseError::fail("read a key the model never stored"));
            };
            prop_assert_eq!(grant.len as usize, known.len);
            // SAFETY: the lease keeps `len` bytes at grant.ptr in place.
            let got = unsafe { std::slice::from_raw_parts(grant.ptr.as_ptr(), known.len) };
            prop_assert!(got == &fill(key, known.version, known.len)[..], "wrong bytes for key {}", key);
            if hold {
                held.push((key, known.version, grant));
            } else {
                shard.release(grant.lease);
            }
        }
        Err(Error::NotFound) => {
            // Evicted or never stored; never while pinned.
            prop_assert!(model.get(&key).is_none_or(|k| k.pins == 0), "pinned key {} vanished", key);
            model.remove(&key);
        }
        Err(e) => return Err(TestCaseError::fail(format!("lease: {e}"))),
    }
    Ok(())
}

fn run(ops: Vec<Op>, policy: EvictionPolicy) -> Result<(), TestCaseError> {
    let mut shard = core(4 << 20, policy);
    let mut model: HashMap<u8, Known> = HashMap::new();
    let mut held: Vec<(u8, u32, ReadGrant)> = Vec::new();
    let mut version = 0u32;
    for op in ops {
        match op {
            Op::Put { key, len_kib, upsert } => {
                version += 1;
                put(&mut shard, &mut model, (key, len_kib, upsert), version)?;
            }
            Op::AbortedPut { key, len_kib } => {
                if let Ok(grant) = shard.reserve(&[key], u64::from(len_kib) * 1024, true) {
                    shard.abort(grant.object);
                    shard.abort(grant.object); // duplicate is harmless
                }
            }
            Op::Read { key } | Op::Hold { key } => {
                let hold = matches!(op, Op::Hold { .. });
                read(&mut shard, &mut model, &mut held, key, hold)?;
            }
            Op::Release { which } => {
                if !held.is_empty() {
                    let (key, version, grant) = held.remove(which % held.len());
                    // Held bytes stay intact through upserts, removes and eviction pressure.
                    // SAFETY: still leased until the release below.
                    let got = unsafe { std::slice::from_raw_parts(grant.ptr.as_ptr(), grant.len as usize) };
                    prop_assert!(got == &fill(key, version, grant.len as usize)[..], "held bytes changed");
                    shard.release(grant.lease);
                    shard.release(grant.lease); // duplicate is harmless
                }
            }
            Op::Remove { key, force } => {
                let leased = held.iter().any(|(k, v, _)| *k == key && model.get(&key).is_some_and(|m| m.version == *v));
                let pinned = model.get(&key).is_some_and(|m| m.pins > 0);
                match shard.remove(&[key], force) {
                    Ok(()) => {
                        prop_assert!(force || (!leased && !pinned));
                        model.remove(&key);
                    }
                    Err(Error::Leased) => prop_assert!(!force && leased),
                    Err(Error::Pinned) => prop_assert!(!force && pinned),
                    Err(Error::NotFound) => {
                        prop_assert!(!pinned);
                        model.remove(&key);
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("remove: {e}"))),
                }
            }
            Op::Pin { key } => match shard.pin(&[key]) {
                Ok(()) => {
                    let known = model.get_mut(&key).ok_or_else(|| TestCaseError::fail("pinned an unknown key"))?;
                    known.pins += 1;
                }
                Err(Error::NotFound) => {
                    prop_assert!(model.get(&key).is_none_or(|k| k.pins == 0));
                    model.remove(&key);
                }
                Err(e) => return Err(TestCaseError::fail(format!("pin: {e}"))),
            },
            Op::Unpin { key } => match shard.unpin(&[key]) {
                Ok(()) => {
                    let known = model.get_mut(&key).ok_or_else(|| TestCaseError::fail("unpinned an unknown key"))?;
                    prop_assert!(known.pins > 0);
                    known.pins -= 1;
                }
                Err(Error::NotPinned) => prop_assert!(model.get(&key).is_none_or(|k| k.pins == 0)),
                Err(Error::NotFound) => prop_assert!(model.get(&key).is_none_or(|k| k.pins == 0)),
                Err(e) => return Err(TestCaseError::fail(format!("unpin: {e}"))),
            },
            Op::Evict => {
                shard.evict_to_low_watermark(8);
            }
        }
        shard.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(shard.leases_held(), held.len());
        prop_assert!(shard.used_bytes() <= shard.capacity_bytes());
    }
    for (_, _, grant) in held.drain(..) {
        shard.release(grant.lease);
    }
    shard.check_invariants().map_err(TestCaseError::fail)?;
    prop_assert_eq!(shard.leases_held(), 0);
    prop_assert_eq!(shard.counters.retired_objects.load(RELAXED), 0);
    prop_assert_eq!(shard.counters.writes_in_flight.load(RELAXED), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn shard_matches_model_lru(ops in prop::collection::vec(op(), 1..160)) {
        run(ops, EvictionPolicy::Lru)?;
    }

    #[test]
    fn shard_matches_model_s3fifo(ops in prop::collection::vec(op(), 1..160)) {
        run(ops, EvictionPolicy::S3Fifo)?;
    }
}

#[test]
fn ttl_leases_expire_and_stale_releases_are_counted() {
    let mut shard = core(4 << 20, EvictionPolicy::Lru);
    let grant = shard.reserve(b"k", 10, false).expect("reserve");
    shard.commit(grant.object, false).expect("commit");
    let now = Instant::now();
    let lease = shard.lease_read(b"k", Some(now + Duration::from_millis(5))).expect("lease");
    assert_eq!(shard.expire_leases(now), 0);
    assert_eq!(shard.remove(b"k", false), Err(Error::Leased));
    assert_eq!(shard.expire_leases(now + Duration::from_millis(10)), 1);
    shard.release(lease.lease);
    assert_eq!(shard.counters.stale_releases.load(RELAXED), 1);
    shard.remove(b"k", false).expect("removable");
    shard.check_invariants().expect("invariants");
}

#[test]
fn everything_pinned_fails_fast() {
    let mut shard = core(4 << 20, EvictionPolicy::S3Fifo);
    let mut n = 0u32;
    loop {
        let key = n.to_le_bytes();
        match shard.reserve(&key, 256 << 10, false) {
            Ok(grant) => {
                shard.commit(grant.object, false).expect("commit");
                shard.pin(&key).expect("pin");
                n += 1;
            }
            Err(Error::NoSpace) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(n < 100, "a 4 MiB shard cannot hold 100 x 256 KiB");
    }
    assert_eq!(shard.len(), n as usize);
    shard.check_invariants().expect("invariants");
}

/// A 2 MiB S3-FIFO shard holding four pinned 400 KiB objects: a fifth takes it above its low
/// watermark and is the only object eviction could take.
fn four_pinned() -> ShardCore {
    let mut shard = core(2 << 20, EvictionPolicy::S3Fifo);
    for key in 0..4u8 {
        let grant = shard.reserve(&[key], 400 << 10, false).expect("reserve");
        shard.commit(grant.object, false).expect("commit");
        shard.pin(&[key]).expect("pin");
    }
    shard
}

#[test]
fn the_eviction_pass_spares_an_object_in_the_turn_that_acknowledged_it() {
    let mut shard = four_pinned();
    shard.next_turn();
    let grant = shard.reserve(b"new", 400 << 10, false).expect("reserve");
    shard.commit(grant.object, false).expect("commit");
    // Above the low watermark, and the new object is the only one that could go.
    assert_eq!(shard.evict_to_low_watermark(64), 0, "evicted in the turn that acknowledged it");
    assert!(shard.exists(b"new"));
    shard.next_turn();
    assert_eq!(shard.evict_to_low_watermark(64), 1, "a later turn may evict it");
    assert!(!shard.exists(b"new"));
    shard.check_invariants().expect("invariants");
}

#[test]
fn the_eviction_pass_spares_an_object_a_caller_committed_between_turns() {
    let mut shard = four_pinned();
    shard.next_turn();
    // The loop let go of its core after that turn; a caller writes on it.
    shard.begin_lent_request();
    let grant = shard.reserve(b"new", 400 << 10, false).expect("reserve");
    shard.begin_lent_request();
    shard.commit(grant.object, false).expect("commit");
    // The turn the caller's poke starts does not take what the caller was just told is stored.
    shard.next_turn();
    assert_eq!(shard.evict_to_low_watermark(64), 0, "evicted in the turn after its lent commit");
    assert!(shard.exists(b"new"));
    shard.next_turn();
    assert_eq!(shard.evict_to_low_watermark(64), 1, "a later turn may evict it");
    shard.check_invariants().expect("invariants");
}

#[test]
fn a_pin_count_past_its_bound_is_refused_and_changes_nothing() {
    let mut shard = core(2 << 20, EvictionPolicy::S3Fifo);
    let grant = shard.reserve(b"k", 64, false).expect("reserve");
    shard.commit(grant.object, false).expect("commit");
    for _ in 0..u16::MAX {
        shard.pin(b"k").expect("pin");
    }
    assert_eq!(shard.pin(b"k"), Err(Error::TooLarge { what: "pin count", len: 65_536, max: 65_535 }));
    // A pinned upsert would add one more: refused, and the version pinned stays.
    let grant = shard.reserve(b"k", 128, true).expect("reserve the upsert");
    assert_eq!(
        shard.commit_now_unless_durable(grant.object, true, true),
        Some(Err(Error::TooLarge { what: "pin count", len: 65_536, max: 65_535 }))
    );
    assert_eq!(shard.locate(b"k").map(|l| l.len), Some(64));
    for _ in 0..u16::MAX {
        shard.unpin(b"k").expect("unpin");
    }
    assert_eq!(shard.unpin(b"k"), Err(Error::NotPinned));
    shard.check_invariants().expect("invariants");
}

/// One object holds at most `u16::MAX` leases from the shard: the next is refused `Busy` while
/// other objects still lease, and giving leases back brings the count to zero.
#[test]
fn an_object_lease_count_past_its_bound_is_refused() {
    let mut shard = core(2 << 20, EvictionPolicy::S3Fifo);
    shard.config.max_leases = 1 << 20;
    for key in [&b"a"[..], b"b"] {
        let grant = shard.reserve(key, 64, false).expect("reserve");
        shard.commit(grant.object, false).expect("commit");
    }
    let held: Vec<LeaseId> = (0..u16::MAX).map(|_| shard.lease_read(b"a", None).expect("lease").lease).collect();
    assert_eq!(shard.lease_read(b"a", None).map(|g| g.len), Err(Error::Busy { limit: 65_535 }));
    let other = shard.lease_read(b"b", None).expect("another object still leases");
    shard.release(other.lease);
    for lease in held {
        shard.release(lease);
    }
    assert_eq!(shard.leases_held(), 0);
    let again = shard.lease_read(b"a", None).expect("leases again");
    shard.release(again.lease);
    shard.check_invariants().expect("invariants");
}

/// What every object costs the shard beyond its key and value bytes (the index memory figure of
/// `kvtide-bench index` is mostly this record, the published slot, the key table entry and the
/// policy entry; the allocator keeps nothing per live object).
#[test]
fn an_object_record_stays_small() {
    assert!(std::mem::size_of::<Object>() <= 16, "Object is {} bytes", std::mem::size_of::<Object>());
    // Only a shard with an SSD tier keeps these, beside the record.
    assert!(
        std::mem::size_of::<super::SsdFacts>() <= 32,
        "SsdFacts is {} bytes",
        std::mem::size_of::<super::SsdFacts>()
    );
}

/// An object's SSD location is kept packed: every location a tier can hand out round-trips,
/// and one that cannot be packed is refused rather than kept wrong.
#[test]
fn ssd_locations_pack_exactly_or_not_at_all() {
    let block = record::BLOCK_BYTES;
    let fits = [
        SsdLocation { segment: 0, offset: block, record_bytes: block, epoch: 1 },
        SsdLocation { segment: 7, offset: block * 123_456, record_bytes: block * 3, epoch: 0xDEAD_BEEF_0123_4567 },
        SsdLocation {
            segment: u32::MAX - 1,
            offset: u64::from(u32::MAX) * block,
            record_bytes: u64::from(u32::MAX) * block,
            epoch: u64::MAX,
        },
    ];
    for l in fits {
        assert_eq!(PackedLocation::new(l).map(PackedLocation::get), Some(l));
    }
    let good = fits[1];
    for bad in [
        SsdLocation { offset: block + 1, ..good },
        SsdLocation { offset: (u64::from(u32::MAX) + 1) * block, ..good },
        SsdLocation { record_bytes: 100, ..good },
        SsdLocation { segment: u32::MAX, ..good },
    ] {
        assert_eq!(PackedLocation::new(bad), None, "{bad:?}");
    }
}
