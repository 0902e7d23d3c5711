//! Rendezvous (highest-random-weight) placement: each key ranks every member by a hash of
//! (key, member id) and lives on the first `replication` of them. Pure and deterministic: every
//! client computes the same answer from the same membership, and a join or leave moves only
//! the keys whose first members changed (about 1/N of them). Never knows about connections.

use xxhash_rust::xxh3::xxh3_64;

/// A member's hash seed, from its id.
pub fn member_seed(id: &str) -> u64 {
    xxh3_64(id.as_bytes())
}

/// A key's hash.
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64(key)
}

/// The weight of a (key, member) pair: a full-avalanche mix of both hashes.
fn weight(key_hash: u64, seed: u64) -> u64 {
    // The murmur3 finaliser over the combination: any bit of either input flips about half of
    // the output bits, which rendezvous hashing needs for an even spread.
    let mut x = key_hash ^ seed.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Indices of `seeds` in the key's preference order (highest weight first; ties by seed).
pub fn ranked(key_hash: u64, seeds: &[u64]) -> Vec<usize> {
    let mut order: Vec<(u64, u64, usize)> =
        seeds.iter().enumerate().map(|(i, &s)| (weight(key_hash, s), s, i)).collect();
    order.sort_unstable_by_key(|&(w, s, _)| std::cmp::Reverse((w, s)));
    order.into_iter().map(|(_, _, i)| i).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn seeds(n: usize) -> Vec<u64> {
        (0..n).map(|i| member_seed(&format!("owner-{i}"))).collect()
    }

    #[test]
    fn keys_spread_evenly() {
        let s = seeds(4);
        let mut counts = [0usize; 4];
        for k in 0..40_000u32 {
            counts[ranked(key_hash(&k.to_le_bytes()), &s)[0]] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn a_join_moves_about_one_in_n_keys_and_only_to_the_new_member() {
        let before = seeds(3);
        let after = seeds(4);
        let mut moved = 0;
        for k in 0..30_000u32 {
            let h = key_hash(&k.to_le_bytes());
            let (old, new) = (ranked(h, &before)[0], ranked(h, &after)[0]);
            if old != new {
                assert_eq!(new, 3, "a key moved between existing members");
                moved += 1;
            }
        }
        // Expected 1/4 of the keys.
        assert!((6_750..8_250).contains(&moved), "{moved}");
    }

    #[test]
    fn replicas_are_distinct_and_a_leave_promotes_the_next() {
        let s = seeds(5);
        for k in 0..1000u32 {
            let h = key_hash(&k.to_le_bytes());
            let order = ranked(h, &s);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, [0, 1, 2, 3, 4]);
            // Without the first member, the rest keep their order.
            let rest: Vec<u64> = order[1..].iter().map(|&i| s[i]).collect();
            let reranked: Vec<u64> = ranked(h, &rest).into_iter().map(|i| rest[i]).collect();
            assert_eq!(reranked, rest);
        }
    }
}
