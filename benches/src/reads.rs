//! `reads`: one thread's reads of DRAM-resident values from the embedded engine against the same
//! copies done by hand, paired.
//!
//! Each round times the baseline and kvtide back to back (which goes first alternates), so a
//! change in the machine's load falls on both alike; the figure is the median of the per-round
//! ratios (baseline time / kvtide time: 1.0 is as fast as the copies alone), with its quartiles.
//! Cases:
//! - `get_into` of 4 KiB, 64 KiB and 1 MiB values, keys in rotation, into one reused buffer;
//!   baseline: `copy_from_slice` from as many distinct sources as there are keys (one hot source
//!   would stay in cache, which a get's cannot);
//! - `batch_get_into_multi_buffers` of 128 x 64 KiB and 1536 x 64 B (the key count of the GPU
//!   benchmark's 4 KiB layout) into a buffer per key; baseline: the same copies, source by source.

use std::hint::black_box;
use std::time::Instant;

use kvtide::{Engine, PutOptions, Region, Store, StoreBuilder};

use crate::util::{fmt_bytes, parse_size};

/// Arguments of `kvtide-bench reads`.
#[derive(clap::Args, Debug, Clone)]
pub struct ReadsArgs {
    /// Rounds per case (each one baseline sample and one kvtide sample).
    #[arg(long, default_value_t = 400)]
    pub rounds: usize,
    /// DRAM pool of the engine.
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    pub dram_bytes: u64,
    /// Engine shards.
    #[arg(long, default_value_t = 2)]
    pub shards: usize,
    /// Run only the cases whose name contains this (e.g. "1536", "get_into 64").
    #[arg(long)]
    pub only: Option<String>,
}

/// Bytes of live values per single-get case: well under the pool, so nothing is evicted.
const WORKING_SET_BYTES: usize = 64 << 20;
/// A single-get sample copies at least this much (a 4 KiB get alone is too short to time).
const SAMPLE_BYTES: usize = 256 << 10;

/// One case's paired samples, in nanoseconds.
struct Pairs {
    name: String,
    baseline_ns: Vec<f64>,
    kvtide_ns: Vec<f64>,
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

impl Pairs {
    fn print(&self) {
        let ratios = sorted(self.baseline_ns.iter().zip(&self.kvtide_ns).map(|(b, k)| b / k).collect());
        let base = sorted(self.baseline_ns.clone());
        let kv = sorted(self.kvtide_ns.clone());
        println!(
            "| {} | {:.2} | {:.2} | {:.3}x | {:.3}x - {:.3}x |",
            self.name,
            quantile(&base, 0.5) / 1e3,
            quantile(&kv, 0.5) / 1e3,
            quantile(&ratios, 0.5),
            quantile(&ratios, 0.25),
            quantile(&ratios, 0.75),
        );
    }
}

/// Which side of a pair to run.
#[derive(Clone, Copy)]
enum Side {
    Baseline,
    Kvtide,
}

/// Times `op(Baseline)` and `op(Kvtide)` once each per round, in alternating order.
fn paired(name: String, rounds: usize, mut op: impl FnMut(Side)) -> Pairs {
    // Warm both up: first touches, the engine's lazily built state.
    for _ in 0..rounds.min(20) {
        op(Side::Baseline);
        op(Side::Kvtide);
    }
    let mut pairs = Pairs { name, baseline_ns: Vec::with_capacity(rounds), kvtide_ns: Vec::with_capacity(rounds) };
    let mut time = |side| {
        let t = Instant::now();
        op(side);
        t.elapsed().as_nanos() as f64
    };
    for round in 0..rounds {
        if round % 2 == 0 {
            pairs.baseline_ns.push(time(Side::Baseline));
            pairs.kvtide_ns.push(time(Side::Kvtide));
        } else {
            pairs.kvtide_ns.push(time(Side::Kvtide));
            pairs.baseline_ns.push(time(Side::Baseline));
        }
    }
    pairs
}

fn single_gets(store: &Engine, size: usize, rounds: usize) -> Result<Pairs, String> {
    let count = (WORKING_SET_BYTES / size).clamp(1, 256);
    let keys: Vec<Vec<u8>> = (0..count).map(|i| format!("reads/{size}/{i:05}").into_bytes()).collect();
    let value = vec![0x5Au8; size];
    for key in &keys {
        store.put(key, &value, PutOptions::UPSERT).map_err(|e| format!("prefill put: {e}"))?;
    }
    let sources: Vec<Vec<u8>> = keys.iter().map(|_| value.clone()).collect();
    let ops = (SAMPLE_BYTES / size).max(1);
    let mut buf = vec![0u8; size];
    let (mut i, mut j, mut failed) = (0usize, 0usize, false);
    let pairs = paired(format!("get_into {} (x{ops} per sample)", fmt_bytes(size as u64)), rounds, |side| {
        for _ in 0..ops {
            match side {
                Side::Baseline => {
                    i = (i + 1) % sources.len();
                    buf.copy_from_slice(black_box(&sources[i]));
                    black_box(&mut buf);
                }
                Side::Kvtide => {
                    j = (j + 1) % keys.len();
                    failed |= store.get_into(black_box(&keys[j]), Region::host(&mut buf)) != Ok(size);
                }
            }
        }
    });
    if failed {
        return Err(format!("a get_into of a {size}-byte value missed"));
    }
    Ok(pairs)
}

fn batch_gets(store: &Engine, count: usize, size: usize, rounds: usize) -> Result<Pairs, String> {
    let keys: Vec<Vec<u8>> = (0..count).map(|i| format!("reads/batch/{size}/{i:05}").into_bytes()).collect();
    let value = vec![0xA5u8; size];
    for key in &keys {
        store.put(key, &value, PutOptions::UPSERT).map_err(|e| format!("prefill put: {e}"))?;
    }
    let sources: Vec<Vec<u8>> = keys.iter().map(|_| value.clone()).collect();
    let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; size]).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut failed = false;
    let pairs = paired(format!("batch_get_into {count} x {}", fmt_bytes(size as u64)), rounds, |side| match side {
        Side::Baseline => {
            for (dst, src) in out.iter_mut().zip(&sources) {
                dst.copy_from_slice(black_box(src));
            }
            black_box(&mut out);
        }
        Side::Kvtide => {
            let dsts: Vec<Vec<Region<'_>>> = out.iter_mut().map(|o| vec![Region::host(o)]).collect();
            let results = store.batch_get_into_multi_buffers(black_box(&key_refs), &dsts);
            failed |= !results.iter().all(|r| *r == Ok(size));
        }
    });
    if failed {
        return Err(format!("a batch_get_into of {count} x {size} bytes missed"));
    }
    Ok(pairs)
}

/// Runs `kvtide-bench reads`.
pub fn run(args: &ReadsArgs) -> Result<(), String> {
    let store = StoreBuilder::new()
        .dram_bytes(args.dram_bytes)
        .shards(args.shards)
        .open()
        .map_err(|e| format!("open the engine: {e}"))?;
    println!(
        "reads: {} rounds per case, {} DRAM, {} shards; ratio = baseline time / kvtide time",
        args.rounds,
        fmt_bytes(args.dram_bytes),
        args.shards
    );
    println!();
    println!("| case | baseline us (median) | kvtide us (median) | ratio (median) | ratio (quartiles) |");
    println!("|---|---:|---:|---:|---:|");
    let wanted = |name: &str| args.only.as_deref().is_none_or(|only| name.contains(only));
    for size in [4 << 10, 64 << 10, 1 << 20] {
        if wanted(&format!("get_into {}", fmt_bytes(size as u64))) {
            single_gets(&store, size, args.rounds)?.print();
        }
    }
    for (count, size) in [(128, 64 << 10), (1536, 64)] {
        if wanted(&format!("batch_get_into {count} x {}", fmt_bytes(size as u64))) {
            batch_gets(&store, count, size, args.rounds)?.print();
        }
    }
    let stats = store.stats();
    if stats.total.evictions != 0 {
        return Err(format!("{} evictions: the pool is too small for the cases", stats.total.evictions));
    }
    Ok(())
}
