//! `kvtide-bench`: end-to-end benchmarks of kvtide, each against a baseline.
//!
//! - `dram`: a zipf read/write mix on the embedded engine (get_into / put, cache-aside refill on
//!   a miss), measured in the same run against foyer's in-memory cache (0.20) under the identical
//!   workload and byte capacity. Baseline: foyer.
//! - `eviction`: hit ratios of kvtide's LRU and S3-FIFO policies on zipf traces through the
//!   offline simulator. Baseline: LRU.
//! - `alloc-churn`: external fragmentation and speed of the DRAM offset allocator (TLSF) under
//!   free/allocate churn at high utilisation. Baseline: the fixed-size (64 KiB page) workload,
//!   where fragmentation cannot happen.
//!
//! Every subcommand uses a fixed RNG seed (`--seed`) so runs are repeatable.

mod alloc_churn;
mod dram;
mod eviction;
mod hist;
mod util;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "kvtide-bench", about = "kvtide benchmarks (each against a baseline)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Zipf get/put mix on the DRAM engine vs foyer's in-memory cache.
    Dram(dram::DramArgs),
    /// LRU vs S3-FIFO hit ratios on zipf traces (offline simulator).
    Eviction(eviction::EvictionArgs),
    /// Allocator fragmentation and speed under churn.
    AllocChurn(alloc_churn::AllocChurnArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Dram(args) => dram::run(&args),
        Command::Eviction(args) => eviction::run(&args),
        Command::AllocChurn(args) => alloc_churn::run(&args),
    };
    if let Err(e) = result {
        eprintln!("kvtide-bench: {e}");
        std::process::exit(1);
    }
}
