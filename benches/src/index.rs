//! `index`: what the embedded engine's index costs per object and how fast it answers, against
//! `std::collections::HashMap<Vec<u8>, Vec<u8>>` holding the same keys and values, in the same run.
//!
//! DRAM only, small values (16 bytes by default), keys of 76 bytes. For each object count:
//! - bytes per object: the process's resident memory growth while the objects go in, less the
//!   values' own bytes (the engine: its arena's used bytes, unless the arena was resident from
//!   the start; the map: one value's bytes per object), reported with and without the key bytes;
//! - lookups per second: one thread reading uniformly drawn present keys into a reused buffer
//!   (`get_into` against `HashMap::get` and a copy).
//!
//! Each system runs in a process of its own (this binary again), so neither inherits the other's
//! freed heap.

use std::time::{Duration, Instant};

use kvtide::{PutOptions, Region, Store, StoreBuilder};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::util::fmt_bytes;

/// Arguments of `kvtide-bench index`.
#[derive(clap::Args, Debug, Clone)]
pub struct IndexArgs {
    /// Object counts, comma-separated.
    #[arg(long, default_value = "1000000", value_delimiter = ',')]
    pub objects: Vec<u64>,
    /// Key length in bytes.
    #[arg(long, default_value_t = 76)]
    pub key_bytes: usize,
    /// Value length in bytes.
    #[arg(long, default_value_t = 16)]
    pub value_bytes: usize,
    /// Measured lookup time per system and count.
    #[arg(long, default_value_t = 2.0)]
    pub duration_secs: f64,
    /// Engine shards.
    #[arg(long, default_value_t = 2)]
    pub shards: usize,
    /// Measure one system in this process (internal: the parent runs one child per system).
    #[arg(long, hide = true)]
    pub system: Option<String>,
}

/// Resident set size of this process in bytes.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        })
        .map_or(0, |kib| kib * 1024)
}

/// The `i`th key: a readable prefix and the number, padded to `len` bytes.
fn key(i: u64, len: usize) -> Vec<u8> {
    let mut k = format!("model-7b/tp0/layer-all/block-{i:016x}/").into_bytes();
    k.resize(len.max(24), b'k');
    k
}

/// One system's figures at one count.
struct Figures {
    bytes_per_object: f64,
    lookups_per_sec: f64,
    fill_secs: f64,
}

pub fn run(args: &IndexArgs) -> Result<(), String> {
    if let Some(system) = &args.system {
        let n = *args.objects.first().ok_or("no object count")?;
        let f = match system.as_str() {
            "kvtide" => measure_engine(args, n)?,
            "hashmap" => measure_map(args, n),
            other => return Err(format!("unknown system {other:?}")),
        };
        println!("FIGURES {} {} {}", f.bytes_per_object, f.lookups_per_sec, f.fill_secs);
        return Ok(());
    }
    println!(
        "| objects | system | bytes/object beyond values | beyond values and keys | lookups/s | fill s |\n|---:|---|---:|---:|---:|---:|"
    );
    for &n in &args.objects {
        let engine = in_child(args, n, "kvtide")?;
        let map = in_child(args, n, "hashmap")?;
        for (name, f) in [("kvtide", &engine), ("HashMap", &map)] {
            println!(
                "| {n} | {name} | {:.0} | {:.0} | {:.0} | {:.1} |",
                f.bytes_per_object,
                f.bytes_per_object - args.key_bytes as f64,
                f.lookups_per_sec,
                f.fill_secs
            );
        }
        println!(
            "| {n} | kvtide/HashMap | {:.2}x | | {:.2}x | |",
            engine.bytes_per_object / map.bytes_per_object,
            engine.lookups_per_sec / map.lookups_per_sec
        );
    }
    Ok(())
}

/// Runs one system's measurement in a child process of this binary.
fn in_child(args: &IndexArgs, n: u64, system: &str) -> Result<Figures, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let out = std::process::Command::new(exe)
        .args(["index", "--system", system, "--objects", &n.to_string()])
        .args(["--key-bytes", &args.key_bytes.to_string(), "--value-bytes", &args.value_bytes.to_string()])
        .args(["--duration-secs", &args.duration_secs.to_string(), "--shards", &args.shards.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("start the {system} child: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("FIGURES "))
        .ok_or_else(|| format!("the {system} child ({}) printed no figures: {text}", out.status))?;
    let v: Vec<f64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    match v[..] {
        [bytes_per_object, lookups_per_sec, fill_secs] => Ok(Figures { bytes_per_object, lookups_per_sec, fill_secs }),
        _ => Err(format!("the {system} child printed {line:?}")),
    }
}

fn measure_engine(args: &IndexArgs, n: u64) -> Result<Figures, String> {
    // The engine admits one object per 4 KiB of pool (its allocator's node table is sized so):
    // a pool that admits them all, of which only the pages the values touch become resident.
    let per_object = ((args.value_bytes as u64).div_ceil(64).max(1) * 64).max(4096);
    let dram_bytes = (n * per_object * 11 / 10).max(64 << 20);
    let per_shard = n.div_ceil(args.shards as u64) * 5 / 4 + 1024;
    let before_open = rss_bytes();
    let store = StoreBuilder::new()
        .dram_bytes(dram_bytes)
        .shards(args.shards)
        .max_objects_per_shard(u32::try_from(per_shard).map_err(|_| "too many objects per shard")?)
        .open()
        .map_err(|e| format!("open: {e}"))?;
    let opened = rss_bytes();
    // An arena made resident at open is not part of the growth below.
    let arena_resident = opened.saturating_sub(before_open) >= dram_bytes * 9 / 10;
    let value = vec![0x5Au8; args.value_bytes];
    let started = Instant::now();
    const BATCH: u64 = 1024;
    let mut i = 0;
    while i < n {
        let end = (i + BATCH).min(n);
        let keys: Vec<Vec<u8>> = (i..end).map(|k| key(k, args.key_bytes)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let sources: Vec<Vec<Region<'_>>> = keys.iter().map(|_| vec![Region::host_readonly(&value)]).collect();
        for (k, r) in store.batch_put_from_multi_buffers(&refs, &sources, PutOptions::UPSERT).into_iter().enumerate() {
            r.map_err(|e| format!("put of object {}: {e}", i + k as u64))?;
        }
        i = end;
    }
    let fill_secs = started.elapsed().as_secs_f64();
    let stats = store.stats();
    if stats.total.objects != n || stats.total.evictions != 0 {
        return Err(format!("{} objects, {} evictions after {n} puts", stats.total.objects, stats.total.evictions));
    }
    let filled = rss_bytes();
    let values = if arena_resident { 0 } else { stats.total.bytes_used };
    let bytes_per_object = filled.saturating_sub(opened).saturating_sub(values) as f64 / n as f64;
    eprintln!(
        "kvtide {n}: rss +{} at open (arena {}), +{} filling, arena used {}, published index {}",
        fmt_bytes(opened.saturating_sub(before_open)),
        if arena_resident { "resident" } else { "faulted in as used" },
        fmt_bytes(filled.saturating_sub(opened)),
        fmt_bytes(stats.total.bytes_used),
        fmt_bytes(store.published_index_bytes())
    );
    let mut buf = vec![0u8; args.value_bytes];
    let lookups_per_sec = lookups_per_sec(args, n, |k| {
        store.get_into(k, Region::host(&mut buf)).map(drop).map_err(|e| format!("get_into: {e}"))
    })?;
    drop(store);
    Ok(Figures { bytes_per_object, lookups_per_sec, fill_secs })
}

fn measure_map(args: &IndexArgs, n: u64) -> Figures {
    let before = rss_bytes();
    let started = Instant::now();
    let mut map: std::collections::HashMap<Vec<u8>, Vec<u8>> = std::collections::HashMap::new();
    for i in 0..n {
        map.insert(key(i, args.key_bytes), vec![0x5Au8; args.value_bytes]);
    }
    let fill_secs = started.elapsed().as_secs_f64();
    let grown = rss_bytes().saturating_sub(before);
    let bytes_per_object = grown.saturating_sub(n * args.value_bytes as u64) as f64 / n as f64;
    let mut buf = vec![0u8; args.value_bytes];
    let lookups_per_sec = lookups_per_sec(args, n, |k| {
        if let Some(v) = map.get(k) {
            buf.copy_from_slice(std::hint::black_box(v));
        }
        Ok(())
    })
    .unwrap_or(0.0);
    std::hint::black_box(&buf);
    Figures { bytes_per_object, lookups_per_sec, fill_secs }
}

/// Lookups per second of `lookup` over 4096 present keys drawn uniformly (the same keys for
/// both systems), for the measured duration.
fn lookups_per_sec(
    args: &IndexArgs,
    n: u64,
    mut lookup: impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<f64, String> {
    let mut rng = SmallRng::seed_from_u64(7);
    let keys: Vec<Vec<u8>> = (0..4096).map(|_| key(rng.random_range(0..n), args.key_bytes)).collect();
    let deadline = Duration::from_secs_f64(args.duration_secs);
    let started = Instant::now();
    let mut lookups = 0u64;
    while started.elapsed() < deadline {
        for k in &keys {
            lookup(k)?;
        }
        lookups += keys.len() as u64;
    }
    Ok(lookups as f64 / started.elapsed().as_secs_f64())
}
