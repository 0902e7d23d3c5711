//! `dram`: a zipf get/put mix against the embedded engine's DRAM tier, and in the same run
//! against foyer's in-memory cache (baseline) with the identical workload.
//!
//! Each worker thread loops until the deadline: draw a key from Zipf(1..=keys, s), then with
//! probability `read_ratio` read it into a reused thread-local buffer (a miss is counted, then
//! the value is written back as a cache-aside reader would), else write it (upsert). Both
//! systems move the value's bytes on every hit and every write: kvtide copies arena -> buffer
//! and buffer -> arena; foyer copies the cached `Vec` -> buffer and fills a fresh `Vec` to insert.
//! Both get the same byte capacity (foyer weighs an entry as key + value bytes).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use foyer::{Cache, CacheBuilder, LruConfig, S3FifoConfig};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtide::{Engine, EvictionPolicy, PutOptions, Region, Store, StoreBuilder};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

use crate::hist::Histogram;
use crate::util::{fmt_bytes, json_str, parse_size};

/// Arguments of `kvtide-bench dram`.
#[derive(clap::Args, Debug, Clone)]
pub struct DramArgs {
    /// Value size (accepts 4096, 64KiB, 1MiB, ...).
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    pub value_bytes: u64,
    /// Key space: keys are drawn from 1..=keys.
    #[arg(long, default_value_t = 20_000)]
    pub keys: u64,
    /// Zipf exponent.
    #[arg(long, default_value_t = 0.99)]
    pub zipf: f64,
    /// Fraction of operations that are reads.
    #[arg(long, default_value_t = 0.9)]
    pub read_ratio: f64,
    /// Client threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Measured duration per system.
    #[arg(long, default_value_t = 5.0)]
    pub duration_secs: f64,
    /// Capacity: kvtide's DRAM pool, and foyer's capacity in bytes.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub dram_bytes: u64,
    /// kvtide shards (default: one per allowed CPU).
    #[arg(long)]
    pub shards: Option<usize>,
    /// Eviction policy of both systems: lru or s3fifo.
    #[arg(long, default_value = "lru", value_parser = parse_policy)]
    pub eviction: EvictionPolicy,
    /// Do not pin kvtide's shard threads to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// Lock shards of foyer's cache.
    #[arg(long, default_value_t = 8)]
    pub foyer_shards: usize,
    /// Only measure kvtide.
    #[arg(long)]
    pub skip_foyer: bool,
    /// Also print one JSON line per result.
    #[arg(long)]
    pub json: bool,
    /// Draw the get latency CDF of each system into this SVG file.
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
    /// RNG seed (each thread derives its own from it).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

fn parse_policy(text: &str) -> Result<EvictionPolicy, String> {
    EvictionPolicy::parse(text).ok_or_else(|| format!("{text:?}: expected lru or s3fifo"))
}

/// Outcome of a read.
enum Got {
    Hit(usize),
    Miss,
    Failed,
}

/// What the workload drives: the engine or the baseline.
trait Target: Sync {
    fn name(&self) -> &'static str;
    /// Reads `key` into `buf` (which is value-sized).
    fn get(&self, key: &[u8], buf: &mut [u8]) -> Got;
    /// Writes `value` under `key` (insert or replace). False when the write was refused.
    fn put(&self, key: &[u8], value: &[u8]) -> bool;
    /// Extra facts for the report (evictions, refusals).
    fn notes(&self) -> String;
}

struct Kvtide {
    store: Engine,
}

impl Target for Kvtide {
    fn name(&self) -> &'static str {
        "kvtide"
    }

    fn get(&self, key: &[u8], buf: &mut [u8]) -> Got {
        match self.store.get_into(key, Region::host(buf)) {
            Ok(n) => Got::Hit(n),
            Err(kvtide::Error::NotFound) => Got::Miss,
            Err(_) => Got::Failed,
        }
    }

    fn put(&self, key: &[u8], value: &[u8]) -> bool {
        self.store.put(key, value, PutOptions::UPSERT).is_ok()
    }

    fn notes(&self) -> String {
        let s = self.store.stats();
        format!(
            "engine: {} objects, {} used of {}, {} evictions, {} no_space, {} requests ({} served by callers), {} parks, \
             arena {}",
            s.total.objects,
            fmt_bytes(s.total.bytes_used),
            fmt_bytes(s.total.capacity_bytes),
            s.total.evictions,
            s.total.no_space,
            s.total.requests,
            s.total.served_by_callers,
            s.total.parks,
            s.arena_backing
        )
    }
}

struct Foyer {
    cache: Cache<Vec<u8>, Vec<u8>>,
}

impl Target for Foyer {
    fn name(&self) -> &'static str {
        "foyer"
    }

    fn get(&self, key: &[u8], buf: &mut [u8]) -> Got {
        match self.cache.get(key) {
            Some(entry) => {
                let value = entry.value();
                match buf.get_mut(..value.len()) {
                    Some(dst) => {
                        dst.copy_from_slice(value);
                        Got::Hit(value.len())
                    }
                    None => Got::Failed,
                }
            }
            None => Got::Miss,
        }
    }

    fn put(&self, key: &[u8], value: &[u8]) -> bool {
        // A freshly filled Vec per write: the copy kvtide makes into its arena happens here as
        // the fill (plus the allocation).
        drop(self.cache.insert(key.to_vec(), value.to_vec()));
        true
    }

    fn notes(&self) -> String {
        format!("foyer: usage {} of {}", fmt_bytes(self.cache.usage() as u64), fmt_bytes(self.cache.capacity() as u64))
    }
}

/// One thread's (and, merged, one run's) counts.
#[derive(Default)]
struct Tally {
    gets: u64,
    hits: u64,
    misses: u64,
    get_failures: u64,
    puts: u64,
    fills: u64,
    put_failures: u64,
    bytes: u64,
    get_hist: Histogram,
    put_hist: Histogram,
}

impl Tally {
    fn merge(&mut self, other: &Tally) {
        self.gets += other.gets;
        self.hits += other.hits;
        self.misses += other.misses;
        self.get_failures += other.get_failures;
        self.puts += other.puts;
        self.fills += other.fills;
        self.put_failures += other.put_failures;
        self.bytes += other.bytes;
        self.get_hist.merge(&other.get_hist);
        self.put_hist.merge(&other.put_hist);
    }

    fn ops(&self) -> u64 {
        self.gets + self.puts
    }
}

/// One system's result.
struct RunResult {
    system: &'static str,
    tally: Tally,
    elapsed: Duration,
    prefill_keys: u64,
    prefill_secs: f64,
    notes: String,
}

impl RunResult {
    fn ops_per_sec(&self) -> f64 {
        self.tally.ops() as f64 / self.elapsed.as_secs_f64()
    }

    fn gb_per_sec(&self) -> f64 {
        self.tally.bytes as f64 / 1e9 / self.elapsed.as_secs_f64()
    }

    fn hit_ratio(&self) -> f64 {
        let reads = self.tally.hits + self.tally.misses;
        if reads == 0 {
            0.0
        } else {
            self.tally.hits as f64 / reads as f64
        }
    }

    fn all_hist(&self) -> Histogram {
        let mut h = self.tally.get_hist.clone();
        h.merge(&self.tally.put_hist);
        h
    }
}

fn key_of(index: u64) -> Vec<u8> {
    format!("kvtide-bench/key/{index:010}").into_bytes()
}

/// Runs `kvtide-bench dram`.
pub fn run(args: &DramArgs) -> Result<(), String> {
    if args.keys == 0 || args.value_bytes == 0 || args.threads == 0 {
        return Err("--keys, --value-bytes and --threads must be positive".into());
    }
    if !(0.0..=1.0).contains(&args.read_ratio) {
        return Err("--read-ratio must be in [0, 1]".into());
    }
    Zipf::new(args.keys as f64, args.zipf).map_err(|e| format!("zipf: {e}"))?;
    let keys: Vec<Vec<u8>> = (0..args.keys).map(key_of).collect();
    // Fill as much of the key space as fits below the engine's low watermark (85%), so the
    // prefill itself does not evict; both systems get the same keys.
    let fits = ((args.dram_bytes as f64 * 0.85) / args.value_bytes as f64) as u64;
    let prefill = args.keys.min(fits);

    // KVTIDE_* variables tune the engine settings that have no flag here (KVTIDE_RUNTIME_IDLE_SPIN_US,
    // KVTIDE_RUNTIME_RING_ENTRIES, ...); the flags win over them.
    let mut store = StoreBuilder::new()
        .with_env()
        .map_err(|e| format!("KVTIDE_* variables: {e}"))?
        .dram_bytes(args.dram_bytes)
        .pin_threads(!args.no_pin)
        .eviction(args.eviction);
    store.runtime.shards = args.shards;
    let store = store.open().map_err(|e| format!("open kvtide: {e}"))?;
    let shards = store.shard_count();
    println!(
        "## dram: value {}, {} keys (zipf {}), read ratio {}, {} threads, {} s per system, capacity {}, \
         eviction {}, kvtide {} shards{}, foyer {} shards",
        fmt_bytes(args.value_bytes),
        args.keys,
        args.zipf,
        args.read_ratio,
        args.threads,
        args.duration_secs,
        fmt_bytes(args.dram_bytes),
        args.eviction.name(),
        shards,
        if args.no_pin { " (unpinned)" } else { " (pinned)" },
        args.foyer_shards,
    );
    println!(
        "key space {} ({:.2}x capacity); prefilled {} keys",
        fmt_bytes(args.keys * args.value_bytes),
        (args.keys * args.value_bytes) as f64 / args.dram_bytes as f64,
        prefill
    );
    let kvtide = Kvtide { store };
    let mut results = vec![drive(&kvtide, args, &keys, prefill)?];
    drop(kvtide); // shuts the shard threads down before the baseline runs

    if !args.skip_foyer {
        let builder = CacheBuilder::new(args.dram_bytes as usize)
            .with_shards(args.foyer_shards.max(1))
            .with_weighter(|k: &Vec<u8>, v: &Vec<u8>| k.len() + v.len());
        let builder = match args.eviction {
            EvictionPolicy::Lru => builder.with_eviction_config(LruConfig::default()),
            EvictionPolicy::S3Fifo => builder.with_eviction_config(S3FifoConfig::default()),
        };
        let foyer = Foyer { cache: builder.build() };
        results.push(drive(&foyer, args, &keys, prefill)?);
    }

    print_table(args, &results);
    if let Some(path) = &args.plot {
        let series: Vec<(String, &Histogram)> =
            results.iter().map(|r| (format!("{} get", r.system), &r.tally.get_hist)).collect();
        let title = format!("get latency, {} values, {} threads", fmt_bytes(args.value_bytes), args.threads);
        crate::plot::latency_cdfs(path, &title, &series)?;
        println!("latency CDFs: {}", path.display());
    }
    Ok(())
}

/// Prefills, then runs the workload on `args.threads` threads for `args.duration_secs`.
fn drive<T: Target>(target: &T, args: &DramArgs, keys: &[Vec<u8>], prefill: u64) -> Result<RunResult, String> {
    let value = vec![0xA5u8; args.value_bytes as usize];
    let started = Instant::now();
    for key in keys.iter().take(prefill as usize) {
        if !target.put(key, &value) {
            return Err(format!("{}: prefill put refused", target.name()));
        }
    }
    let prefill_secs = started.elapsed().as_secs_f64();

    let duration = Duration::from_secs_f64(args.duration_secs.max(0.001));
    let progress_ops = Arc::new(AtomicU64::new(0));
    let bar = ProgressBar::with_draw_target(Some(duration.as_millis() as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{prefix:>7} [{bar:30}] {elapsed:>3}/{duration:3} {msg}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    bar.set_prefix(target.name());

    let start = Instant::now();
    let deadline = start + duration;
    let tallies: Vec<Tally> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..args.threads)
            .map(|t| {
                let progress_ops = Arc::clone(&progress_ops);
                scope.spawn(move || worker(target, args, keys, t, deadline, &progress_ops))
            })
            .collect();
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            let elapsed = start.elapsed();
            let ops = progress_ops.load(Ordering::Relaxed);
            bar.set_position(elapsed.as_millis().min(duration.as_millis()) as u64);
            bar.set_message(format!("{:.0} ops/s", ops as f64 / elapsed.as_secs_f64()));
        }
        workers.into_iter().map(|w| w.join().expect("worker thread panicked")).collect()
    });
    let elapsed = start.elapsed();
    bar.finish_and_clear();
    let mut tally = Tally::default();
    for t in &tallies {
        tally.merge(t);
    }
    Ok(RunResult { system: target.name(), tally, elapsed, prefill_keys: prefill, prefill_secs, notes: target.notes() })
}

fn worker<T: Target>(
    target: &T,
    args: &DramArgs,
    keys: &[Vec<u8>],
    thread: usize,
    deadline: Instant,
    progress_ops: &AtomicU64,
) -> Tally {
    let mut rng = SmallRng::seed_from_u64(args.seed ^ (thread as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let zipf = Zipf::new(args.keys as f64, args.zipf).expect("zipf parameters were checked");
    let mut buf = vec![0u8; args.value_bytes as usize];
    let value = vec![thread as u8; args.value_bytes as usize];
    let mut tally = Tally::default();
    let mut unpublished = 0u64;
    loop {
        let index = (zipf.sample(&mut rng) as u64).clamp(1, args.keys) - 1;
        let key = &keys[index as usize];
        let read = rng.random::<f64>() < args.read_ratio;
        let t0 = Instant::now();
        let mut now;
        if read {
            let got = target.get(key, &mut buf);
            now = Instant::now();
            tally.gets += 1;
            tally.get_hist.record((now - t0).as_nanos() as u64);
            match got {
                Got::Hit(n) => {
                    tally.hits += 1;
                    tally.bytes += n as u64;
                }
                Got::Miss => {
                    tally.misses += 1;
                    // Cache-aside: the reader fetched the value elsewhere and stores it.
                    let ok = target.put(key, &value);
                    let t2 = Instant::now();
                    tally.put_hist.record((t2 - now).as_nanos() as u64);
                    tally.puts += 1;
                    tally.fills += 1;
                    if ok {
                        tally.bytes += value.len() as u64;
                    } else {
                        tally.put_failures += 1;
                    }
                    now = t2;
                }
                Got::Failed => tally.get_failures += 1,
            }
        } else {
            let ok = target.put(key, &value);
            now = Instant::now();
            tally.put_hist.record((now - t0).as_nanos() as u64);
            tally.puts += 1;
            if ok {
                tally.bytes += value.len() as u64;
            } else {
                tally.put_failures += 1;
            }
        }
        unpublished += 1;
        if unpublished == 64 {
            progress_ops.fetch_add(unpublished, Ordering::Relaxed);
            unpublished = 0;
        }
        if now >= deadline {
            break;
        }
    }
    tally
}

fn print_table(args: &DramArgs, results: &[RunResult]) {
    println!();
    println!(
        "| system | ops/s | GB/s | hit ratio | p50 µs | p99 µs | get p50 µs | get p99 µs | put p50 µs | put p99 µs \
         | gets | puts (fills) | failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in results {
        let all = r.all_hist();
        let t = &r.tally;
        println!(
            "| {} | {:.0} | {:.2} | {:.4} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} ({}) | {} |",
            r.system,
            r.ops_per_sec(),
            r.gb_per_sec(),
            r.hit_ratio(),
            all.quantile_us(0.5),
            all.quantile_us(0.99),
            t.get_hist.quantile_us(0.5),
            t.get_hist.quantile_us(0.99),
            t.put_hist.quantile_us(0.5),
            t.put_hist.quantile_us(0.99),
            t.gets,
            t.puts,
            t.fills,
            t.get_failures + t.put_failures,
        );
    }
    if let [k, f, ..] = results {
        let (ka, fa) = (k.all_hist(), f.all_hist());
        let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}x", a / b) } else { "-".into() };
        println!(
            "| kvtide/foyer | {} | {} | {} | {} | {} | {} | {} | {} | {} | | | |",
            ratio(k.ops_per_sec(), f.ops_per_sec()),
            ratio(k.gb_per_sec(), f.gb_per_sec()),
            ratio(k.hit_ratio(), f.hit_ratio()),
            ratio(ka.quantile_us(0.5), fa.quantile_us(0.5)),
            ratio(ka.quantile_us(0.99), fa.quantile_us(0.99)),
            ratio(k.tally.get_hist.quantile_us(0.5), f.tally.get_hist.quantile_us(0.5)),
            ratio(k.tally.get_hist.quantile_us(0.99), f.tally.get_hist.quantile_us(0.99)),
            ratio(k.tally.put_hist.quantile_us(0.5), f.tally.put_hist.quantile_us(0.5)),
            ratio(k.tally.put_hist.quantile_us(0.99), f.tally.put_hist.quantile_us(0.99)),
        );
    }
    println!();
    for r in results {
        println!("{}: prefill {} keys in {:.2} s; {}", r.system, r.prefill_keys, r.prefill_secs, r.notes);
    }
    if args.json {
        for r in results {
            let all = r.all_hist();
            let t = &r.tally;
            println!(
                "{{\"bench\":\"dram\",\"system\":{},\"value_bytes\":{},\"keys\":{},\"zipf\":{},\"read_ratio\":{},\
                 \"threads\":{},\"duration_secs\":{:.3},\"capacity_bytes\":{},\"eviction\":{},\"ops\":{},\
                 \"ops_per_sec\":{:.1},\"gb_per_sec\":{:.4},\"hit_ratio\":{:.6},\"p50_us\":{:.2},\"p99_us\":{:.2},\
                 \"get_p50_us\":{:.2},\"get_p99_us\":{:.2},\"put_p50_us\":{:.2},\"put_p99_us\":{:.2},\"gets\":{},\
                 \"puts\":{},\"fills\":{},\"failures\":{},\"seed\":{}}}",
                json_str(r.system),
                args.value_bytes,
                args.keys,
                args.zipf,
                args.read_ratio,
                args.threads,
                r.elapsed.as_secs_f64(),
                args.dram_bytes,
                json_str(args.eviction.name()),
                t.ops(),
                r.ops_per_sec(),
                r.gb_per_sec(),
                r.hit_ratio(),
                all.quantile_us(0.5),
                all.quantile_us(0.99),
                t.get_hist.quantile_us(0.5),
                t.get_hist.quantile_us(0.99),
                t.put_hist.quantile_us(0.5),
                t.put_hist.quantile_us(0.99),
                t.gets,
                t.puts,
                t.fills,
                t.get_failures + t.put_failures,
                args.seed,
            );
        }
    }
}
