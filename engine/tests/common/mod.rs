//! Helpers shared by the integration tests: self-verifying values and a small engine.
#![allow(dead_code)]

pub mod churn;
pub mod seccomp;

use kvtide::{Engine, Store, StoreBuilder};

/// A store small enough for tests: 2 shards, no CPU pinning, short idle spin.
pub fn small_store(dram_bytes: u64) -> Engine {
    StoreBuilder::new().dram_bytes(dram_bytes).shards(2).pin_threads(false).idle_spin_us(20).open().expect("open store")
}

/// Deterministic bytes for (key, version): any mix-up of keys, versions or offsets shows.
pub fn value_for(key: &[u8], version: u64, len: usize) -> Vec<u8> {
    let mut state = xxhash(key) ^ version.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ len as u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub fn xxhash(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Waits until work that gives its resources back on other threads (stream drivers, stream-bound
/// read watches) has finished and the shards caught up, then asserts nothing is held.
pub fn wait_idle(store: &Engine) {
    let started = std::time::Instant::now();
    loop {
        store.sync_shards().expect("sync");
        let held = store.stats().held_resources();
        if held.is_zero() {
            return;
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(10), "resources still held: {held:?}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Asserts nothing is held once the shards have caught up.
pub fn assert_idle(store: &Engine) {
    store.sync_shards().expect("sync");
    let held = store.stats().held_resources();
    assert!(held.is_zero(), "resources still held: {held:?}");
}
