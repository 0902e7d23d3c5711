//! `RemoteStore::hold` through a real owner on loopback: held objects survive a flood of other
//! writes that evicts everything else; per-key results (missing, bad and past-the-limit keys);
//! partial and whole releases; the TTL (the reaper gives the leases back); `close_holds`, a
//! dropped client and a restarted owner end every hold; holds over TCP and without the arena
//! mapping.
//! After each, the owner and its engine hold no lease.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::value_for;
use kvtide::{Engine, Error as StoreError, PutOptions, Store};
use kvtide_remote::{ClientOptions, Error, Owner, OwnerConfig, RemoteStore};
use support::{options, temp_dir, token, unix_client, wait_idle};

const VALUE: usize = 256 << 10;

fn engine(dram_bytes: u64) -> Arc<Engine> {
    support::engine(dram_bytes, 1)
}

fn owner_with(engine: &Arc<Engine>, dir: &Path, tune: impl FnOnce(&mut OwnerConfig)) -> Owner {
    let mut config = OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        tcp: Some("127.0.0.1:0".parse().expect("addr")),
        tcp_token: Some(token()),
        shutdown_grace_ms: 2_000,
        ..OwnerConfig::default()
    };
    tune(&mut config);
    Owner::start(Arc::clone(engine), config).expect("start owner")
}

fn outstanding(owner: &Owner) -> u64 {
    owner.counters().leases_outstanding.load(Ordering::SeqCst)
}

fn key(i: usize) -> Vec<u8> {
    format!("obj-{i}").into_bytes()
}

/// Writes `count` objects starting at `first` (another tenant's flood when past the others).
fn write(store: &RemoteStore, first: usize, count: usize) {
    for i in first..first + count {
        // A full pool (everything else held or pinned) is the flood's problem, not the test's.
        let _ = store.put(&key(i), &value_for(&key(i), i as u64, VALUE), PutOptions::INSERT);
    }
}

fn present(store: &RemoteStore, keys: &[Vec<u8>]) -> usize {
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    store.batch_exists(&refs).into_iter().filter(|r| matches!(r, Ok(true))).count()
}

#[test]
fn held_objects_survive_a_flood_that_evicts_the_rest() {
    let dir = temp_dir("flood");
    let engine = engine(8 << 20);
    let owner = owner_with(&engine, &dir, |_| {});
    let store = unix_client(&owner);
    write(&store, 0, 8);
    let held_keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    let free_keys: Vec<Vec<u8>> = (4..8).map(key).collect();
    let refs: Vec<&[u8]> = held_keys.iter().map(Vec::as_slice).collect();
    let hold = store.hold(&refs, 30_000).expect("hold");
    assert!(hold.results.iter().all(|r| matches!(r, Ok(n) if *n == VALUE as u64)), "{:?}", hold.results);
    assert_eq!(store.holds_held(), (1, 4));
    owner.engine().sync_shards().expect("sync");
    assert_eq!(outstanding(&owner), 4);

    // Another tenant writes four times the DRAM.
    let other = unix_client(&owner);
    write(&other, 100, 4 * (8 << 20) / VALUE);
    assert_eq!(present(&store, &free_keys), 0, "the flood evicted the objects nobody held");
    assert_eq!(present(&store, &held_keys), 4, "held objects stay");
    for (i, k) in held_keys.iter().enumerate() {
        assert_eq!(store.get(k).expect("held object reads"), value_for(k, i as u64, VALUE));
    }

    // A partial release, then the rest.
    assert_eq!(store.release_hold(hold.id, Some(&[0, 1, 1])), 2);
    assert_eq!(store.hold_status(hold.id), Some(vec![false, false, true, true]));
    assert_eq!(store.holds_held(), (1, 2));
    assert_eq!(store.release_hold(hold.id, None), 2);
    assert_eq!(store.release_hold(hold.id, None), 0, "releasing twice is harmless");
    assert_eq!(store.hold_status(hold.id), None);
    assert_eq!(store.holds_held(), (0, 0));
    store.confirm_hold_releases();
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn per_key_results_and_the_connection_limit() {
    let dir = temp_dir("per-key");
    let engine = engine(16 << 20);
    let owner = owner_with(&engine, &dir, |c| c.max_leases_per_connection = 3);
    let store = unix_client(&owner);
    write(&store, 0, 4);
    let owned: Vec<Vec<u8>> =
        vec![key(0), b"missing".to_vec(), Vec::new(), vec![b'k'; 100_000], key(1), key(2), key(3)];
    let keys: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
    let hold = store.hold(&keys, 30_000).expect("hold");
    let r = &hold.results;
    assert!(matches!(r[0], Ok(n) if n == VALUE as u64));
    assert_eq!(r[1], Err(Error::Store(StoreError::NotFound)));
    assert_eq!(r[2], Err(Error::Store(StoreError::EmptyKey)));
    assert!(matches!(r[3], Err(Error::Store(StoreError::TooLarge { .. }))), "{:?}", r[3]);
    // Three leases per connection, taken in key order by the keys the owner was sent (the
    // missing one included): obj-0 and obj-1 are held, obj-2 and obj-3 find no room.
    assert!(r[4].is_ok(), "{:?}", r[4]);
    assert!(matches!(r[5], Err(Error::Store(StoreError::Busy { .. }))), "{:?}", r[5]);
    assert!(matches!(r[6], Err(Error::Store(StoreError::Busy { .. }))), "{:?}", r[6]);
    assert_eq!(store.holds_held(), (1, 2));
    // The bound is per hold connection: a second hold finds one place left.
    let second = store.hold(&[&key(2), &key(3)], 30_000).expect("hold");
    assert!(second.results[0].is_ok());
    assert!(matches!(second.results[1], Err(Error::Store(StoreError::Busy { .. }))));
    assert_eq!(store.holds_held(), (2, 3));
    assert_eq!(store.release_hold(hold.id, None), 2);
    let third = store.hold(&[&key(3)], 30_000).expect("hold");
    assert!(third.results[0].is_ok(), "room again once the first hold let go");
    assert_eq!(store.release_hold(third.id, None), 1);
    assert_eq!(store.release_hold(second.id, None), 1);

    // Bad TTLs are refused as a whole.
    assert!(matches!(store.hold(&[&key(0)], 0), Err(Error::Store(StoreError::InvalidArgument(_)))));
    assert!(matches!(store.hold(&[&key(0)], 10_000_000), Err(Error::Store(StoreError::InvalidArgument(_)))));
    store.confirm_hold_releases();
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_ttl_ends_a_hold_and_the_reaper_releases_it() {
    let dir = temp_dir("ttl");
    let engine = engine(16 << 20);
    let owner = owner_with(&engine, &dir, |_| {});
    let store = unix_client(&owner);
    write(&store, 0, 2);
    let hold = store.hold(&[&key(0), &key(1)], 200).expect("hold");
    assert!(hold.expires_at <= Instant::now() + Duration::from_millis(200));
    assert_eq!(store.hold_status(hold.id), Some(vec![true, true]));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(store.hold_status(hold.id), None, "past its TTL a hold holds nothing");
    assert_eq!(store.holds_held(), (0, 0));
    assert_eq!(store.release_hold(hold.id, None), 0);
    store.confirm_hold_releases();
    wait_idle(&owner);

    // A TTL past the owner's lease TTL is cut to it (less the client's margin).
    let short_dir = temp_dir("ttl-owner");
    let short = owner_with(&engine, &short_dir, |c| {
        c.lease_ttl_ms = 1_000;
        c.io_timeout_ms = 500;
    });
    let client = unix_client(&short);
    let hold = client.hold(&[&key(0)], 60_000).expect("hold");
    assert!(hold.expires_at <= Instant::now() + Duration::from_millis(1_000));
    drop(client);
    wait_idle(&short);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(short_dir);
}

#[test]
fn close_a_dropped_client_and_a_restarted_owner_end_every_hold() {
    let dir = temp_dir("end");
    let engine = engine(16 << 20);
    let owner = owner_with(&engine, &dir, |_| {});
    let store = unix_client(&owner);
    write(&store, 0, 2);

    let hold = store.hold(&[&key(0)], 30_000).expect("hold");
    store.close_holds();
    assert_eq!(store.hold_status(hold.id), None);
    assert!(matches!(store.hold(&[&key(0)], 30_000), Err(Error::Store(StoreError::ShuttingDown))));
    wait_idle(&owner);

    let other = unix_client(&owner);
    let _hold = other.hold(&[&key(0), &key(1)], 30_000).expect("hold");
    owner.engine().sync_shards().expect("sync");
    assert_eq!(outstanding(&owner), 2);
    drop(other);
    wait_idle(&owner);

    // The owner restarts: holds on the old connection are lost, a new hold reconnects.
    let again = unix_client(&owner);
    let hold = again.hold(&[&key(0)], 30_000).expect("hold");
    owner.shutdown();
    engine.shutdown();
    drop(owner);
    let engine = self::engine(16 << 20);
    let owner = owner_with(&engine, &dir, |_| {});
    write(&unix_client(&owner), 0, 1);
    let fresh = again.hold(&[&key(0)], 30_000).expect("hold after the restart");
    assert!(fresh.results[0].is_ok());
    assert_eq!(again.hold_status(hold.id), None, "the old connection's hold is lost");
    assert_eq!(again.hold_status(fresh.id), Some(vec![true]));
    assert_eq!(again.release_hold(fresh.id, None), 1);
    again.confirm_hold_releases();
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn holds_work_without_the_arena_mapping_over_tcp_and_unix() {
    // A client that cannot map the arena (TCP, or a Unix client with shared memory off) holds
    // objects in place just the same; its grants carry lengths only.
    let dir = temp_dir("tcp");
    let engine = engine(8 << 20);
    let owner = owner_with(&engine, &dir, |_| {});
    let addr = owner.tcp_addr().expect("tcp");
    let tcp = RemoteStore::connect_with(&addr.to_string(), options()).expect("connect tcp");
    let unix_no_shm = RemoteStore::connect_with(
        &owner.unix_path().expect("unix").display().to_string(),
        ClientOptions { shared_memory: false, ..options() },
    )
    .expect("connect");
    assert!(!tcp.uses_shared_memory() && !unix_no_shm.uses_shared_memory());
    write(&tcp, 0, 8);
    let held_keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    let free_keys: Vec<Vec<u8>> = (4..8).map(key).collect();
    let tcp_refs: Vec<&[u8]> = held_keys[..2].iter().map(Vec::as_slice).collect();
    let unix_refs: Vec<&[u8]> = held_keys[2..].iter().map(Vec::as_slice).collect();
    let tcp_hold = tcp.hold(&tcp_refs, 30_000).expect("hold over tcp");
    let unix_hold = unix_no_shm.hold(&unix_refs, 30_000).expect("hold over unix without the mapping");
    for hold in [&tcp_hold, &unix_hold] {
        assert!(hold.results.iter().all(|r| matches!(r, Ok(n) if *n == VALUE as u64)), "{:?}", hold.results);
    }
    owner.engine().sync_shards().expect("sync");
    assert_eq!(outstanding(&owner), 4);

    let other = unix_client(&owner);
    write(&other, 100, 4 * (8 << 20) / VALUE);
    assert_eq!(present(&tcp, &free_keys), 0, "the flood evicted the objects nobody held");
    assert_eq!(present(&tcp, &held_keys), 4, "held objects stay");
    for (i, k) in held_keys.iter().enumerate() {
        assert_eq!(tcp.get(k).expect("held object reads"), value_for(k, i as u64, VALUE));
    }
    assert_eq!(tcp.release_hold(tcp_hold.id, None), 2);
    tcp.confirm_hold_releases();
    drop(unix_no_shm);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}
