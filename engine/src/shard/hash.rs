//! Key hashes: which shard a key routes to and where that shard's index files it.
//!
//! Owns the routing seed and the two hashes; never looks at a shard's state, so the shard's core
//! and the engine's router both build on it.

/// Seed of a key's hash (`key_hash`), which routes it to a shard.
const ROUTING_SEED: u64 = 0x6b76_7469_6465_0001;

/// A key's hash: `key_hash % shards` is the shard that holds it. Hashed once per key and call;
/// the shard's index takes `index_hash` of it.
pub(crate) fn key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, ROUTING_SEED)
}

/// Where a shard's index files a key of hash `key_hash`: a bijective mix (murmur3's finaliser),
/// so the keys of one shard, which share `key_hash % shards`, share no bits in its table.
pub(crate) fn index_hash(key_hash: u64) -> u64 {
    let mut h = key_hash;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The hash a shard's index files `key` under (`index_hash` of its `key_hash`).
pub(crate) fn key_index_hash(key: &[u8]) -> u64 {
    index_hash(key_hash(key))
}
