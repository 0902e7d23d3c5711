//! `eviction`: hit ratios of kvtide's eviction policies, LRU (baseline) vs S3-FIFO, replayed
//! through `kvtide_tiers::eviction::simulate_hit_ratio` on synthetic zipf traces.
//!
//! Grid: zipf exponents x cache sizes (a percentage of the key space's bytes), once with a fixed
//! value size and once with per-key sizes drawn log-uniform (16 KiB..1 MiB by default). Keys are
//! zipf ranks scrambled by a bijective hash, so popularity is unrelated to key order. Every
//! request of the trace counts (the cache starts cold for both policies).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use kvtide_tiers::eviction::{simulate_hit_ratio, EvictionPolicy, HitRatio};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Zipf};

use crate::util::{fmt_bytes, json_str, parse_size, SizeDist};

/// Arguments of `kvtide-bench eviction`.
#[derive(clap::Args, Debug, Clone)]
pub struct EvictionArgs {
    /// Key space.
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    /// Zipf exponents (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [0.8, 0.99, 1.2])]
    pub zipf: Vec<f64>,
    /// Cache sizes in percent of the key space's bytes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1.0, 5.0, 10.0, 25.0])]
    pub cache_percent: Vec<f64>,
    /// Value size of the fixed-size run.
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    pub value_bytes: u64,
    /// Smallest size of the variable-size run.
    #[arg(long, default_value = "16KiB", value_parser = parse_size)]
    pub min_bytes: u64,
    /// Largest size of the variable-size run.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub max_bytes: u64,
    /// Requests per cell.
    #[arg(long, default_value_t = 2_000_000)]
    pub requests: u64,
    /// Simulations run in parallel.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// RNG seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Also print one JSON line per cell.
    #[arg(long)]
    pub json: bool,
}

/// splitmix64's finaliser: a bijection on u64, so distinct ranks stay distinct keys.
fn scramble(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

const POLICIES: [EvictionPolicy; 2] = [EvictionPolicy::Lru, EvictionPolicy::S3Fifo];

/// One row of a table: both policies on one (zipf, cache size).
struct Row {
    zipf: f64,
    percent: f64,
    capacity: u64,
    results: [HitRatio; 2],
}

/// Runs `kvtide-bench eviction`.
pub fn run(args: &EvictionArgs) -> Result<(), String> {
    if args.keys == 0 || args.requests == 0 || args.value_bytes == 0 || args.min_bytes == 0 {
        return Err("--keys, --requests and sizes must be positive".into());
    }
    if args.min_bytes > args.max_bytes {
        return Err("--min-bytes must not exceed --max-bytes".into());
    }
    println!(
        "## eviction: {} keys, {} requests per cell, zipf {:?}, cache {:?}% of the key space's bytes, seed {}",
        args.keys, args.requests, args.zipf, args.cache_percent, args.seed
    );
    let dists = [SizeDist::Fixed(args.value_bytes), SizeDist::LogUniform { min: args.min_bytes, max: args.max_bytes }];
    let (mut wins, mut cells) = ([0usize; 2], 0usize);
    let mut ties = 0usize;
    let started = Instant::now();
    let bar = crate::util::steps((dists.len() * args.zipf.len()) as u64, "eviction: traces");
    for dist in dists {
        let mut size_rng = SmallRng::seed_from_u64(args.seed ^ 0x5153_4553);
        let sizes: Vec<u64> = (0..args.keys).map(|_| dist.sample(&mut size_rng)).collect();
        let total_bytes: u64 = sizes.iter().sum();
        let mut rows = Vec::new();
        for &s in &args.zipf {
            bar.inc(1);
            let zipf = Zipf::new(args.keys as f64, s).map_err(|e| format!("zipf {s}: {e}"))?;
            let mut rng = SmallRng::seed_from_u64(args.seed);
            let trace: Vec<(u64, u64)> = (0..args.requests)
                .map(|_| {
                    let rank = (zipf.sample(&mut rng) as u64).clamp(1, args.keys) - 1;
                    (scramble(rank), sizes[rank as usize])
                })
                .collect();
            rows.extend(simulate_grid(args, s, total_bytes, &trace));
        }
        print_table(args, &dist, total_bytes, &rows);
        for row in &rows {
            cells += 1;
            let (lru, s3) = (row.results[0].ratio(), row.results[1].ratio());
            if (lru - s3).abs() < 0.0005 {
                ties += 1;
            } else if s3 > lru {
                wins[1] += 1;
            } else {
                wins[0] += 1;
            }
        }
    }
    println!(
        "request hit ratio over {cells} cells: s3fifo wins {}, lru wins {}, ties (|diff| < 0.0005) {}; {:.1} s",
        wins[1],
        wins[0],
        ties,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Simulates every (cache size, policy) of one trace, `args.threads` at a time.
fn simulate_grid(args: &EvictionArgs, zipf: f64, total_bytes: u64, trace: &[(u64, u64)]) -> Vec<Row> {
    let jobs: Vec<(usize, usize)> =
        (0..args.cache_percent.len()).flat_map(|c| (0..POLICIES.len()).map(move |p| (c, p))).collect();
    let capacity_of = |c: usize| (total_bytes as f64 * args.cache_percent[c] / 100.0) as u64;
    let results = Mutex::new(vec![[HitRatio::default(); 2]; args.cache_percent.len()]);
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..args.threads.max(1) {
            scope.spawn(|| {
                while let Some(&(c, p)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let hr = simulate_hit_ratio(POLICIES[p], capacity_of(c), trace.iter().copied());
                    results.lock().expect("results lock")[c][p] = hr;
                }
            });
        }
    });
    let results = results.into_inner().expect("results lock");
    results
        .into_iter()
        .enumerate()
        .map(|(c, results)| Row { zipf, percent: args.cache_percent[c], capacity: capacity_of(c), results })
        .collect()
}

fn print_table(args: &EvictionArgs, dist: &SizeDist, total_bytes: u64, rows: &[Row]) {
    let variable = matches!(dist, SizeDist::LogUniform { .. });
    println!();
    println!("### sizes: {} (key space {})", dist.label(), fmt_bytes(total_bytes));
    println!();
    if variable {
        println!("| zipf | cache | lru | s3fifo | s3fifo - lru | lru bytes | s3fifo bytes |");
        println!("|---:|---:|---:|---:|---:|---:|---:|");
    } else {
        println!("| zipf | cache | lru | s3fifo | s3fifo - lru |");
        println!("|---:|---:|---:|---:|---:|");
    }
    for row in rows {
        let [lru, s3] = row.results;
        let cache = format!("{}% ({})", row.percent, fmt_bytes(row.capacity));
        let diff = s3.ratio() - lru.ratio();
        if variable {
            println!(
                "| {} | {} | {:.4} | {:.4} | {:+.4} | {:.4} | {:.4} |",
                row.zipf,
                cache,
                lru.ratio(),
                s3.ratio(),
                diff,
                lru.byte_ratio(),
                s3.byte_ratio()
            );
        } else {
            println!("| {} | {} | {:.4} | {:.4} | {:+.4} |", row.zipf, cache, lru.ratio(), s3.ratio(), diff);
        }
    }
    if args.json {
        for row in rows {
            for (p, hr) in POLICIES.iter().zip(row.results) {
                println!(
                    "{{\"bench\":\"eviction\",\"policy\":{},\"sizes\":{},\"zipf\":{},\"cache_percent\":{},\
                     \"capacity_bytes\":{},\"requests\":{},\"hits\":{},\"hit_ratio\":{:.6},\"byte_hit_ratio\":{:.6},\
                     \"seed\":{}}}",
                    json_str(p.name()),
                    json_str(&dist.label()),
                    row.zipf,
                    row.percent,
                    row.capacity,
                    hr.requests,
                    hr.hits,
                    hr.ratio(),
                    hr.byte_ratio(),
                    args.seed
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::scramble;

    #[test]
    fn scramble_is_injective_on_small_ranges() {
        let mut seen: Vec<u64> = (0..10_000).map(scramble).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 10_000);
    }
}
