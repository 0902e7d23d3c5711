//! Embedded quickstart: an inference worker's view of kvtide.
//!
//! Saves a few hundred simulated KV blocks (each block holds every layer's K/V pages, gathered
//! from per-layer buffers), asks how much of a prompt prefix is cached, loads the blocks back
//! scattered into per-layer buffers, verifies every byte and prints the store's stats.
//!
//! Run: `cargo run --release --example quickstart` (KVTIDE_* variables override the defaults).

use std::time::Instant;

use kvtide::{PutOptions, Region, Store, StoreBuilder};

const LAYERS: usize = 32;
const BLOCKS: usize = 384;
/// K and V for 16 tokens of one layer: 16 tokens x 2 KV heads x 128 dims x 2 bytes x (K,V).
const PAGE_BYTES: usize = 16 * 2 * 128 * 2 * 2;

fn page_byte(block: usize, layer: usize, i: usize) -> u8 {
    ((block * 131 + layer * 31 + i * 7) % 251) as u8
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = StoreBuilder::new().with_env()?.open()?;
    println!(
        "kvtide: {} shards, {} MiB DRAM, {} KV blocks of {} layers x {} KiB",
        store.shard_count(),
        store.stats().total.capacity_bytes >> 20,
        BLOCKS,
        LAYERS,
        PAGE_BYTES >> 10
    );

    // The worker's paged KV cache: one buffer per layer, one page per block.
    let layer_buffers: Vec<Vec<u8>> = (0..LAYERS)
        .map(|layer| (0..BLOCKS * PAGE_BYTES).map(|i| page_byte(i / PAGE_BYTES, layer, i % PAGE_BYTES)).collect())
        .collect();
    let keys: Vec<Vec<u8>> = (0..BLOCKS).map(|b| format!("model-a/prefix-hash-{b:08x}").into_bytes()).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();

    // Save: each block gathers its page from every layer buffer.
    let started = Instant::now();
    let sources: Vec<Vec<Region<'_>>> = (0..BLOCKS)
        .map(|b| {
            layer_buffers
                .iter()
                .map(|layer| Region::host_readonly(&layer[b * PAGE_BYTES..(b + 1) * PAGE_BYTES]))
                .collect()
        })
        .collect();
    let saved = store.batch_put_from_multi_buffers(&key_refs, &sources, PutOptions::UPSERT);
    let failed = saved.iter().filter(|r| r.is_err()).count();
    let bytes = (BLOCKS * LAYERS * PAGE_BYTES) as f64;
    println!(
        "saved {} blocks ({:.1} MiB) in {:.1?}, {failed} failed",
        BLOCKS,
        bytes / (1 << 20) as f64,
        started.elapsed()
    );
    if let Some(Err(e)) = saved.iter().find(|r| r.is_err()) {
        return Err(format!("save failed: {e}").into());
    }

    // A new request shares the first 300 blocks of the prompt: how many are cached?
    let mut prompt: Vec<&[u8]> = key_refs[..300].to_vec();
    let unseen = b"model-a/prefix-hash-unseen".to_vec();
    prompt.push(&unseen);
    println!("prefix hits for a 301-block prompt: {}", store.prefix_hits(&prompt)?);

    // Load: scatter each block back into fresh per-layer buffers.
    // Filled (not zeroed) so the pages are faulted in, like a worker's long-lived KV buffers.
    let mut restored: Vec<Vec<u8>> = (0..LAYERS).map(|_| vec![0xA5u8; BLOCKS * PAGE_BYTES]).collect();
    let started = Instant::now();
    let results = {
        let mut per_block: Vec<Vec<Region<'_>>> = (0..BLOCKS).map(|_| Vec::with_capacity(LAYERS)).collect();
        for layer in restored.iter_mut() {
            for (b, page) in layer.chunks_mut(PAGE_BYTES).enumerate() {
                per_block[b].push(Region::host(page));
            }
        }
        store.batch_get_into_multi_buffers(&key_refs, &per_block)
    };
    let elapsed = started.elapsed();
    let loaded = results.iter().filter(|r| r.is_ok()).count();
    println!("loaded {loaded}/{BLOCKS} blocks in {elapsed:.1?} ({:.2} GB/s)", bytes / elapsed.as_secs_f64() / 1e9);
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        return Err(format!("load failed: {e}").into());
    }
    if restored != layer_buffers {
        return Err("restored KV pages differ from what was saved".into());
    }
    println!("verified {} bytes: every page byte-exact", BLOCKS * LAYERS * PAGE_BYTES);

    store.sync_shards()?;
    let stats = store.stats();
    let t = &stats.total;
    println!(
        "stats: objects {} | used {:.1} MiB of {:.1} MiB | puts {} hits {} misses {} evictions {} | leases held {} | arena {} | io_uring fixed buffers {} (SSD I/O only)",
        t.objects,
        t.bytes_used as f64 / (1 << 20) as f64,
        t.capacity_bytes as f64 / (1 << 20) as f64,
        t.puts,
        t.hits,
        t.misses,
        t.evictions,
        t.leases_held,
        stats.arena_backing,
        if t.fixed_buffers_registered { "registered" } else { "not registered" },
    );
    Ok(())
}
