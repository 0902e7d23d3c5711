//! `alloc-churn`: external fragmentation and speed of the DRAM tier's offset allocator (TLSF,
//! `kvtide_tiers::dram::OffsetAllocator`) under churn at high utilisation.
//!
//! Fill to the target utilisation with random sizes, then each round frees one random live
//! allocation and allocates random sizes until the target is reached again (or one fails). A
//! failure while the free bytes would have covered the request is an external fragmentation
//! failure. Workloads: log-uniform sizes (4 KiB..4 MiB by default, mixed-size objects) and the
//! baseline of fixed 64 KiB pages (KV blocks), where every hole fits every request, so
//! fragmentation failures must be zero.

use std::time::Instant;

use kvtide_tiers::dram::{Allocation, OffsetAllocator};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::util::{fmt_bytes, json_str, parse_size, SizeDist};

/// Arguments of `kvtide-bench alloc-churn`.
#[derive(clap::Args, Debug, Clone)]
pub struct AllocChurnArgs {
    /// Bytes managed by the allocator.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub capacity: u64,
    /// Utilisation held during the churn (fraction of capacity).
    #[arg(long, default_value_t = 0.9)]
    pub utilisation: f64,
    /// Smallest size of the log-uniform workload.
    #[arg(long, default_value = "4KiB", value_parser = parse_size)]
    pub min_bytes: u64,
    /// Largest size of the log-uniform workload.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    pub max_bytes: u64,
    /// Size of the fixed-size workload.
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    pub page_bytes: u64,
    /// Churn rounds (one free, then allocations back to the target).
    #[arg(long, default_value_t = 200_000)]
    pub rounds: u64,
    /// Allocation alignment (the engine uses 64).
    #[arg(long, default_value_t = 64)]
    pub align_bytes: u64,
    /// RNG seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Also print one JSON line per workload.
    #[arg(long)]
    pub json: bool,
}

/// One workload's outcome.
#[derive(Default)]
struct Churn {
    label: String,
    fill_allocations: u64,
    attempts: u64,
    failures: u64,
    frag_failures: u64,
    peak_utilisation: f64,
    util_sum: f64,
    util_samples: u64,
    final_utilisation: f64,
    final_free: u64,
    final_largest_free: u64,
    final_free_blocks: u64,
    /// Mean over samples taken every 1000 rounds.
    largest_over_free_sum: f64,
    largest_over_free_samples: u64,
    alloc_ns: f64,
    free_ns: f64,
    allocs_timed: u64,
    frees_timed: u64,
    /// `check_invariants` after the churn; None before it ran.
    invariants: Option<Result<(), String>>,
}

/// Runs `kvtide-bench alloc-churn`.
pub fn run(args: &AllocChurnArgs) -> Result<(), String> {
    if !(args.utilisation > 0.0 && args.utilisation <= 1.0) {
        return Err("--utilisation must be in (0, 1]".into());
    }
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes || args.page_bytes == 0 {
        return Err("sizes must be positive and --min-bytes <= --max-bytes".into());
    }
    let timer_ns = timer_overhead_ns();
    println!(
        "## alloc-churn: capacity {}, target utilisation {:.0}%, {} rounds, align {} B, seed {} \
         (timer overhead {:.0} ns per call, subtracted)",
        fmt_bytes(args.capacity),
        args.utilisation * 100.0,
        args.rounds,
        args.align_bytes,
        args.seed,
        timer_ns
    );
    let workloads =
        [SizeDist::LogUniform { min: args.min_bytes, max: args.max_bytes }, SizeDist::Fixed(args.page_bytes)];
    let mut results = Vec::new();
    let bar = crate::util::steps(workloads.len() as u64, "alloc-churn: workloads");
    for dist in workloads {
        results.push(churn(args, dist, timer_ns)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!();
    println!(
        "| sizes | fill allocs | churn allocs | failed | frag failures (free >= request) | peak util | mean util \
         | final util | final largest/free | mean largest/free | free blocks | alloc ns | free ns | invariants |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in &results {
        println!(
            "| {} | {} | {} | {} | {} | {:.2}% | {:.2}% | {:.2}% | {:.3} ({} / {}) | {:.3} | {} | {:.0} | {:.0} | {} |",
            r.label,
            r.fill_allocations,
            r.attempts,
            r.failures,
            r.frag_failures,
            r.peak_utilisation * 100.0,
            mean(r.util_sum, r.util_samples) * 100.0,
            r.final_utilisation * 100.0,
            ratio(r.final_largest_free, r.final_free),
            fmt_bytes(r.final_largest_free),
            fmt_bytes(r.final_free),
            mean(r.largest_over_free_sum, r.largest_over_free_samples),
            r.final_free_blocks,
            r.alloc_ns,
            r.free_ns,
            match &r.invariants {
                Some(Ok(())) => "ok".to_string(),
                Some(Err(e)) => format!("BROKEN: {e}"),
                None => "not checked".to_string(),
            }
        );
    }
    if args.json {
        for r in &results {
            println!(
                "{{\"bench\":\"alloc-churn\",\"sizes\":{},\"capacity_bytes\":{},\"target_utilisation\":{},\
                 \"rounds\":{},\"attempts\":{},\"failures\":{},\"frag_failures\":{},\"peak_utilisation\":{:.6},\
                 \"mean_utilisation\":{:.6},\"final_largest_over_free\":{:.6},\"alloc_ns\":{:.1},\"free_ns\":{:.1},\
                 \"seed\":{}}}",
                json_str(&r.label),
                args.capacity,
                args.utilisation,
                args.rounds,
                r.attempts,
                r.failures,
                r.frag_failures,
                r.peak_utilisation,
                mean(r.util_sum, r.util_samples),
                ratio(r.final_largest_free, r.final_free),
                r.alloc_ns,
                r.free_ns,
                args.seed
            );
        }
    }
    Ok(())
}

fn mean(sum: f64, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Cost of the `Instant::now()` pair that brackets each timed call.
fn timer_overhead_ns() -> f64 {
    let n = 200_000u32;
    let mut total = 0u128;
    for _ in 0..n {
        let t0 = Instant::now();
        total += t0.elapsed().as_nanos();
    }
    total as f64 / f64::from(n)
}

fn churn(args: &AllocChurnArgs, dist: SizeDist, timer_ns: f64) -> Result<Churn, String> {
    let max_allocations = u32::try_from(args.capacity / dist.min().max(args.align_bytes) + 16).unwrap_or(u32::MAX);
    let mut alloc = OffsetAllocator::new(args.capacity, args.align_bytes, max_allocations)
        .map_err(|e| format!("allocator: {e}"))?;
    let capacity = alloc.capacity_bytes();
    let target = (capacity as f64 * args.utilisation) as u64;
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let mut live: Vec<Allocation> = Vec::with_capacity(max_allocations as usize);
    let mut out = Churn { label: dist.label(), ..Churn::default() };
    let (mut alloc_total, mut free_total) = (0u128, 0u128);

    // Fill.
    while alloc.used_bytes() < target {
        let size = dist.sample(&mut rng);
        match alloc.allocate(size) {
            Some(a) => {
                live.push(a);
                out.fill_allocations += 1;
            }
            None => break,
        }
    }
    out.peak_utilisation = alloc.used_bytes() as f64 / capacity as f64;

    // Churn.
    for round in 0..args.rounds {
        if !live.is_empty() {
            let victim = live.swap_remove(rng.random_range(0..live.len()));
            let t0 = Instant::now();
            alloc.free(victim);
            free_total += t0.elapsed().as_nanos();
            out.frees_timed += 1;
        }
        while alloc.used_bytes() < target {
            let size = dist.sample(&mut rng);
            let free_before = alloc.free_bytes();
            let t0 = Instant::now();
            let got = alloc.allocate(size);
            alloc_total += t0.elapsed().as_nanos();
            out.allocs_timed += 1;
            out.attempts += 1;
            match got {
                Some(a) => live.push(a),
                None => {
                    out.failures += 1;
                    if free_before >= size.next_multiple_of(args.align_bytes) {
                        out.frag_failures += 1;
                    }
                    break;
                }
            }
        }
        let util = alloc.used_bytes() as f64 / capacity as f64;
        out.peak_utilisation = out.peak_utilisation.max(util);
        out.util_sum += util;
        out.util_samples += 1;
        if round % 1000 == 0 {
            out.largest_over_free_sum += ratio(alloc.largest_free_bytes(), alloc.free_bytes());
            out.largest_over_free_samples += 1;
        }
    }
    let stats = alloc.stats();
    out.final_utilisation = stats.used_bytes as f64 / capacity as f64;
    out.final_free = stats.free_bytes;
    out.final_largest_free = stats.largest_free_bytes;
    out.final_free_blocks = stats.free_blocks;
    out.alloc_ns = (alloc_total as f64 / out.allocs_timed.max(1) as f64 - timer_ns).max(0.0);
    out.free_ns = (free_total as f64 / out.frees_timed.max(1) as f64 - timer_ns).max(0.0);
    out.invariants = Some(alloc.check_invariants());
    for a in live {
        alloc.free(a);
    }
    if alloc.used_bytes() != 0 {
        return Err(format!("{}: {} bytes still used after freeing everything", out.label, alloc.used_bytes()));
    }
    Ok(out)
}
