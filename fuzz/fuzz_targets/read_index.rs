//! Fuzzes a same-host client's read path over a hostile read index: any header (geometry, arena
//! length, liveness) and any entries (sequences, digests planted for the key, offsets and
//! lengths), mapped as a client maps them. The read must never crash, and whatever it returns
//! must be bytes of the arena, the same through a vector and through a region list.
#![no_main]

use arbitrary::Arbitrary;
use kvtide_tiers::dram::read_index::{KeyDigest, ENTRY_BYTES, HEADER_BYTES, MAGIC, VERSION, WAYS};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Entry {
    seq: u64,
    plant_digest: bool,
    digest: [u64; 2],
    offset: u64,
    len: u64,
}

#[derive(Arbitrary, Debug)]
struct Input {
    shards: u8,
    buckets_log2: u8,
    version_off: bool,
    ways: u8,
    arena_len: u16,
    announced_arena_len: Option<u32>,
    alive: u64,
    key: Vec<u8>,
    entries: Vec<Entry>,
    cut: u16,
}

fn put(buf: &mut [u8], at: usize, bytes: &[u8]) {
    if let Some(dst) = buf.get_mut(at..at + bytes.len()) {
        dst.copy_from_slice(bytes);
    }
}

fuzz_target!(|input: Input| {
    let arena: Vec<u8> = (0..usize::from(input.arena_len).max(1)).map(|i| (i * 31 % 251) as u8).collect();
    let shards = usize::from(input.shards % 5);
    let buckets_log2 = u32::from(input.buckets_log2 % 6);
    let regions = shards * (1 << buckets_log2) * WAYS;
    let len = (HEADER_BYTES + regions * ENTRY_BYTES).saturating_sub(usize::from(input.cut % 256));
    let mut index = vec![0u8; len];
    put(&mut index, 0, &MAGIC.to_le_bytes());
    put(&mut index, 8, &(VERSION + u32::from(input.version_off)).to_le_bytes());
    put(&mut index, 12, &(shards as u32).to_le_bytes());
    put(&mut index, 16, &buckets_log2.to_le_bytes());
    let ways = if input.ways % 8 == 0 { 3 } else { WAYS as u32 };
    put(&mut index, 20, &ways.to_le_bytes());
    let announced = input.announced_arena_len.map_or(arena.len() as u64, u64::from);
    put(&mut index, 24, &announced.to_le_bytes());
    put(&mut index, 32, &(input.alive >> 63).to_le_bytes());
    for shard in 0..shards {
        put(&mut index, 64 + 8 * shard, &u64::from(input.alive >> shard & 1).to_le_bytes());
    }
    let digest = KeyDigest::of(&input.key);
    for (i, e) in input.entries.iter().enumerate().take(regions) {
        let at = HEADER_BYTES + i * ENTRY_BYTES;
        let d = if e.plant_digest { digest.0 } else { e.digest };
        put(&mut index, at, &e.seq.to_le_bytes());
        put(&mut index, at + 8, &d[0].to_le_bytes());
        put(&mut index, at + 16, &d[1].to_le_bytes());
        put(&mut index, at + 24, &e.offset.to_le_bytes());
        put(&mut index, at + 32, &e.len.to_le_bytes());
    }
    match kvtide_remote::fuzzing::read_through(&index, &arena, &input.key) {
        Ok(Some(value)) => {
            assert!(value.len() <= arena.len(), "a read longer than the arena");
            assert!(
                value.is_empty() || arena.windows(value.len()).any(|w| w == value.as_slice()),
                "bytes that are not the arena's"
            );
        }
        Ok(None) => {}
        // The machine refused a memfd: nothing to check.
        Err(_) => {}
    }
});
