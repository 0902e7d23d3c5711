//! Owns the de-duplication of a call's keys: the distinct keys in first-seen order and each
//! key's index among them. Never validates or leases a key; the callers do.
//!
//! A paged read names each object once per fragment (K then V, one after the other), so a key
//! equal to the one just seen is answered without hashing, and the rest hash with xxh3 into a
//! table sized for the call up front (no rehash while it fills).

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3Builder;

/// The distinct keys of a call, in the order they were first seen.
pub(crate) struct KeyIndex<'k> {
    table: HashMap<&'k [u8], usize, Xxh3Builder>,
    keys: Vec<&'k [u8]>,
    /// The last key looked up and its index.
    last: Option<(&'k [u8], usize)>,
}

impl<'k> KeyIndex<'k> {
    /// A table for up to `capacity` lookups without growing.
    pub(crate) fn with_capacity(capacity: usize) -> KeyIndex<'k> {
        KeyIndex {
            table: HashMap::with_capacity_and_hasher(capacity, Xxh3Builder::new()),
            keys: Vec::with_capacity(capacity),
            last: None,
        }
    }

    /// The index of `key`, added when new; true when it was.
    pub(crate) fn index_of(&mut self, key: &'k [u8]) -> (usize, bool) {
        if let Some((last, index)) = self.last {
            if last == key {
                return (index, false);
            }
        }
        let mut added = false;
        let index = *self.table.entry(key).or_insert_with(|| {
            added = true;
            self.keys.push(key);
            self.keys.len() - 1
        });
        self.last = Some((key, index));
        (index, added)
    }

    /// The distinct keys, by index.
    pub(crate) fn into_keys(self) -> Vec<&'k [u8]> {
        self.keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_keys_share_their_first_index_in_any_order() {
        let names: [&[u8]; 7] = [b"a", b"a", b"b", b"a", b"c", b"b", b"b"];
        let mut index = KeyIndex::with_capacity(2);
        let got: Vec<(usize, bool)> = names.iter().map(|k| index.index_of(k)).collect();
        assert_eq!(got, [(0, true), (0, false), (1, true), (0, false), (2, true), (1, false), (1, false)]);
        assert_eq!(index.into_keys(), [b"a" as &[u8], b"b", b"c"]);
    }

    #[test]
    fn the_empty_key_is_a_key() {
        let mut index = KeyIndex::with_capacity(0);
        assert_eq!(index.index_of(b""), (0, true));
        assert_eq!(index.index_of(b"x"), (1, true));
        assert_eq!(index.index_of(b""), (0, false));
    }
}
