//! Criterion micro-benchmarks of the object API on a small embedded store (256 MiB, 2 shards):
//! `put` (upsert over a fixed key set, so every write replaces a version and frees the old one)
//! and `get_into` (hits into a reused host buffer), for 4 KiB, 64 KiB and 1 MiB values, with
//! `Throughput::Bytes`. Baselines: a plain `memcpy` of the same size into the same buffer, the
//! floor any copy-based store pays per operation (`memcpy`: one hot source; `memcpy_working_set`:
//! the sources rotate over as many bytes as the store's keys hold, as the gets' do). Batches:
//! `batch_get_into` of 128 x 64 KiB against `memcpy_batch`, the same 128 copies from the same
//! thread, and of 1536 x 64 B (as many keys as the GPU benchmark's 4 KiB-page layout leases per
//! call), where the per-key fixed cost of a batch shows. `get_into_page_plus_16` reads into a
//! buffer 16 bytes past a 4 KiB boundary (where `malloc` puts large buffers; arena objects start
//! on one), the case glibc's `memcpy` copies slowly.
//!
//! Run: `cargo bench -p kvtide-benches --bench object_api` (2 s, 10 samples per benchmark).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtide::{Engine, PutOptions, Region, Store, StoreBuilder};

const SIZES: [usize; 3] = [4 << 10, 64 << 10, 1 << 20];
const STORE_BYTES: u64 = 256 << 20;
/// Bytes of live values per size: well under the pool, so nothing is evicted.
const WORKING_SET_BYTES: usize = 64 << 20;
const MAX_KEYS: usize = 256;

fn open_store() -> Engine {
    StoreBuilder::new().dram_bytes(STORE_BYTES).shards(2).open().expect("open a 256 MiB store")
}

fn keys_for(size: usize) -> Vec<Vec<u8>> {
    let n = (WORKING_SET_BYTES / size).clamp(1, MAX_KEYS);
    (0..n).map(|i| format!("bench/{size}/{i:05}").into_bytes()).collect()
}

fn object_api(c: &mut Criterion) {
    let store = open_store();
    let mut group = c.benchmark_group("object_api");
    group.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500)).sample_size(10);
    for size in SIZES {
        let keys = keys_for(size);
        let value = vec![0x5Au8; size];
        for key in &keys {
            store.put(key, &value, PutOptions::UPSERT).expect("prefill put");
        }
        let mut buf = vec![0u8; size];
        group.throughput(Throughput::Bytes(size as u64));

        group.bench_with_input(BenchmarkId::new("memcpy", size), &size, |b, _| {
            b.iter(|| {
                buf.copy_from_slice(black_box(&value));
                black_box(&mut buf);
            })
        });

        let sources: Vec<Vec<u8>> = keys.iter().map(|_| vec![0x5Au8; size]).collect();
        let mut i = 0usize;
        group.bench_with_input(BenchmarkId::new("memcpy_working_set", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % sources.len();
                buf.copy_from_slice(black_box(&sources[i]));
                black_box(&mut buf);
            })
        });
        drop(sources);

        let mut i = 0usize;
        group.bench_with_input(BenchmarkId::new("put_upsert", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                store.put(black_box(&keys[i]), black_box(&value), PutOptions::UPSERT).expect("put");
            })
        });

        let mut i = 0usize;
        group.bench_with_input(BenchmarkId::new("get_into", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                let n = store.get_into(black_box(&keys[i]), Region::host(&mut buf)).expect("get_into hit");
                black_box(n);
            })
        });

        // A destination 16 bytes past a 4 KiB boundary, where `malloc` puts large buffers.
        let mut page = vec![0u8; size + 8192];
        let start = (page.as_ptr() as usize).wrapping_neg() % 4096 + 16;
        let past_page = &mut page[start..start + size];
        let mut i = 0usize;
        group.bench_with_input(BenchmarkId::new("get_into_page_plus_16", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                let n = store.get_into(black_box(&keys[i]), Region::host(past_page)).expect("get_into hit");
                black_box(n);
            })
        });
    }
    batch(&store, &mut group, 128, 64 << 10);
    batch(&store, &mut group, 1536, 64);
    batch_cold(&mut group);
    group.finish();
    let stats = store.stats();
    eprintln!(
        "store after the benchmarks: {} objects, {} evictions, {} no_space, arena {}",
        stats.total.objects, stats.total.evictions, stats.total.no_space, stats.arena_backing
    );
}

/// `count` values of `size` bytes read in one call, against the same copies done by hand.
fn batch(
    store: &Engine,
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    count: usize,
    size: usize,
) {
    let name = format!("{count}x{size}");
    let keys: Vec<Vec<u8>> = (0..count).map(|i| format!("bench/batch/{size}/{i:05}").into_bytes()).collect();
    let value = vec![0xA5u8; size];
    for key in &keys {
        store.put(key, &value, PutOptions::UPSERT).expect("prefill put");
    }
    let sources: Vec<Vec<u8>> = keys.iter().map(|_| value.clone()).collect();
    let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; size]).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    group.throughput(Throughput::Bytes((count * size) as u64));
    group.bench_function(BenchmarkId::new("memcpy_batch", &name), |b| {
        b.iter(|| {
            for (dst, src) in out.iter_mut().zip(&sources) {
                dst.copy_from_slice(black_box(src));
            }
            black_box(&mut out);
        })
    });
    group.bench_function(BenchmarkId::new("batch_get_into", &name), |b| {
        b.iter(|| {
            let dsts: Vec<Vec<Region<'_>>> = out.iter_mut().map(|o| vec![Region::host(o)]).collect();
            let results = store.batch_get_into_multi_buffers(black_box(&key_refs), &dsts);
            assert!(results.iter().all(|r| *r == Ok(size)), "batch hit");
        })
    });
}

/// `batch_get_into` of 1536 x 64 B drawn from 500,000 keys of a store of its own (a shard
/// holds one object per 4 KiB of its slice at most), another 1536 each call: the index is far
/// larger than the caches, so a batch's leases miss them as a GPU read's leases do between
/// steps.
fn batch_cold(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    const OBJECTS: usize = 500_000;
    const BATCH: usize = 1536;
    let store = StoreBuilder::new().dram_bytes(2 << 30).shards(2).open().expect("open a 2 GiB store");
    let keys: Vec<Vec<u8>> = (0..OBJECTS).map(|i| format!("bench/cold/{i:08}").into_bytes()).collect();
    let value = [0x3Cu8; 64];
    for key in &keys {
        store.put(key, &value, PutOptions::UPSERT).expect("prefill put");
    }
    let stats = store.stats();
    eprintln!(
        "cold store: {} objects, {} evictions, {} no_space",
        stats.total.objects, stats.total.evictions, stats.total.no_space
    );
    // A fixed shuffle (multiplicative stepping by an odd constant) of every key.
    let order: Vec<usize> = (0..OBJECTS).map(|i| i.wrapping_mul(2_654_435_761) % OBJECTS).collect();
    let mut out: Vec<Vec<u8>> = (0..BATCH).map(|_| vec![0u8; 64]).collect();
    let mut at = 0usize;
    group.throughput(Throughput::Bytes((BATCH * 64) as u64));
    group.bench_function(BenchmarkId::new("batch_get_into_cold", format!("{BATCH}x64")), |b| {
        b.iter(|| {
            at = (at + BATCH) % (OBJECTS - BATCH);
            let key_refs: Vec<&[u8]> = order[at..at + BATCH].iter().map(|&k| keys[k].as_slice()).collect();
            let dsts: Vec<Vec<Region<'_>>> = out.iter_mut().map(|o| vec![Region::host(o)]).collect();
            let results = store.batch_get_into_multi_buffers(black_box(&key_refs), &dsts);
            assert!(results.iter().all(|r| *r == Ok(64)), "batch hit: {:?}", results.iter().find(|r| **r != Ok(64)));
        })
    });
}

criterion_group!(benches, object_api);
criterion_main!(benches);
