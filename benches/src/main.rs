//! `kvtide-bench`: end-to-end benchmarks of kvtide, each against a baseline.
//!
//! - `dram`: a zipf read/write mix on the embedded engine (get_into / put, cache-aside refill on
//!   a miss), measured in the same run against foyer's in-memory cache (0.20) under the identical
//!   workload and byte capacity. Baseline: foyer.
//! - `reads`: DRAM-resident `get_into` and batch gets from one thread, paired round by round
//!   with the same copies done by hand (the median of the per-round ratios). Baseline: memcpy.
//! - `eviction`: hit ratios of kvtide's LRU and S3-FIFO policies on zipf traces through the
//!   offline simulator. Baseline: LRU.
//! - `alloc-churn`: external fragmentation and speed of the DRAM offset allocator (TLSF) under
//!   free/allocate churn at high utilisation. Baseline: the fixed-size (64 KiB page) workload,
//!   where fragmentation cannot happen.
//! - `ssd`: restore throughput of SSD-resident objects into host buffers (sequential and random
//!   key order) and demotion throughput, measured in the same run against `fio` (O_DIRECT,
//!   io_uring) on the same file system with the same block size and queue depth. Baseline: fio.
//! - `restore`: the same SSD-resident batch restored three ways (barrier, serialized sub-batches,
//!   pipelined sub-batches) into host buffers through a throttled transfer stage. Baselines in the
//!   same run: load-only (a transfer stage that copies nothing) and transfer-only (DRAM-resident).
//! - `gpu` (feature `cuda`): reads into and gathered writes from fragmented GPU pages, kvtide's
//!   direct and staged paths. Baselines in the same run: one raw pinned `cuMemcpyHtoDAsync` of
//!   the same bytes, a per-page copy loop and `cuMemcpyBatchAsync` (and the same device -> host).
//! - `gpu-restore` (feature `cuda`): an SSD-resident batch restored into fragmented GPU pages
//!   (barrier, serialized, pipelined). Baselines in the same run: load-only, transfer-only
//!   (DRAM-resident) and one raw pinned `cuMemcpyHtoDAsync` of the same bytes.
//! - `gpu-remote` (feature `cuda`): reader processes reading fragmented GPU pages through one
//!   owner on the same host (1, 2 and 4 readers, direct and staged). Baselines in the same run:
//!   one raw pinned `cuMemcpyHtoDAsync` of the same bytes and the embedded engine's reads.
//! - `py-call`: one batch read (`get_into_ranges` into one buffer, or
//!   `batch_get_into_multi_buffers` with a page per key) into host or GPU memory through the
//!   Rust API: the baseline `python/bench/overhead.py` compares the Python layer against.
//! - `remote`: a `kvtide-owner` process through `RemoteStore` over Unix socket + shared memory
//!   and over TCP: put/get throughput and p50/p99 for 64 KiB, 1 MiB and 16 MiB values with 1 and
//!   8 clients. Baselines in the same run: Redis (SET/GET over TCP and its Unix socket) and a
//!   plain memcpy of the same bytes (the limit of the shared-memory path).
//!
//! - `cluster`: 1, 2 and 3 `kvtide-owner` processes registered in an etcd on this host, 8 client
//!   threads through `ClusterStore`: put/get throughput and p50/p99 of 64 KiB and 1 MiB values;
//!   the time from an owner's SIGKILL to puts routed around it and to the membership dropping it;
//!   the miss rate right after a join. Baseline in the same run: a direct `RemoteStore` to one
//!   owner.
//!
//! - `stream`: time to the first and last chunk of `progressive_get` (DRAM- and SSD-resident
//!   objects of 64 MiB to 1 GiB) against a whole-object `get_into`, and a producer -> consumer
//!   pipeline (progressive put + a reader that follows it) against put-then-get, in the same run.
//!
//! - `layerwise` (feature `cuda`): one step of 32 layers, each layer's compute waiting for its
//!   KV: serial (blocking get, then compute), host-overlapped (a ticket per layer) and
//!   stream-bound + one CUDA graph, from DRAM and from SSD. Baselines in the same run: ideal =
//!   first load + sum of max(load, compute) per layer, and load-only.
//!
//! - `bound-host`: the host time of stream-bound reads of a paged step (per layer call and per
//!   key) against a stream transport that enqueues nothing, so no GPU is needed. Baseline in the
//!   same run: a `batch_exists` of the same keys.
//!
//! Every subcommand uses a fixed RNG seed (`--seed`) so runs are repeatable.

mod alloc_churn;
mod bound_host;
mod cluster;
mod dram;
mod eviction;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod gpu_remote;
#[cfg(feature = "cuda")]
mod gpu_restore;
mod hist;
mod idle;
mod index;
#[cfg(feature = "cuda")]
mod layerwise;
mod plot;
mod pycall;
mod reads;
mod remote;
mod restore;
mod restore_rounds;
mod ssd;
mod start;
mod stream;
mod ucx_perftest;
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
    /// Index bytes per object and lookups per second at 1 M / 10 M objects vs std's HashMap.
    Index(index::IndexArgs),
    /// DRAM-resident gets and batch gets vs the same copies by hand, paired round by round.
    Reads(reads::ReadsArgs),
    /// LRU vs S3-FIFO hit ratios on zipf traces (offline simulator).
    Eviction(eviction::EvictionArgs),
    /// Allocator fragmentation and speed under churn.
    AllocChurn(alloc_churn::AllocChurnArgs),
    /// SSD restore and demotion throughput vs fio (O_DIRECT, io_uring).
    Ssd(ssd::SsdArgs),
    /// SSD-resident batch restored barrier / serialized / pipelined vs load-only and transfer-only.
    Restore(restore::RestoreArgs),
    /// The same SSD-resident batch restored barrier vs pipelined through a modeled GPU-like
    /// link, in rotating rounds with paired ratios (no GPU needed).
    RestoreRounds(restore_rounds::RestoreRoundsArgs),
    /// GPU reads and gathered writes vs raw CUDA copies (build with `--features kvtide-benches/cuda`).
    #[cfg(feature = "cuda")]
    Gpu(gpu::GpuArgs),
    /// SSD-resident batch restored into GPU pages, barrier / serialized / pipelined (feature `cuda`).
    #[cfg(feature = "cuda")]
    GpuRestore(gpu_restore::GpuRestoreArgs),
    /// Reader processes reading GPU pages through one owner, vs embedded and raw PCIe (feature `cuda`).
    #[cfg(feature = "cuda")]
    GpuRemote(gpu_remote::GpuRemoteArgs),
    /// A reader process of `gpu-remote` (internal).
    #[cfg(feature = "cuda")]
    #[command(hide = true)]
    GpuRemoteReader(gpu_remote::GpuRemoteReaderArgs),
    /// One step of N layers each waiting for its KV: serial, host-overlapped and stream-bound +
    /// one CUDA graph, against ideal (feature `cuda`).
    #[cfg(feature = "cuda")]
    Layerwise(layerwise::LayerwiseArgs),
    /// kvtide-owner over Unix+shm, Unix without the shared arena and TCP vs Redis (TCP and Unix) and memcpy: put/get throughput, p50/p99.
    Remote(remote::RemoteArgs),
    /// 1, 2 and 3 owners in an etcd cluster vs one owner direct: throughput, p50/p99, failover
    /// time after SIGKILL, misses after a join.
    Cluster(cluster::ClusterArgs),
    /// Chunk handles vs whole-object reads; progressive put + follow vs put-then-get.
    Stream(stream::StreamArgs),
    /// Thousands of idle connections to one owner: threads, memory, a busy client's latency.
    IdleConnections(idle::IdleArgs),
    /// kvtide-owner's time from start to serving, per arena size, vs starting the binary at all.
    StartToListen(start::StartArgs),
    /// One batch read through the Rust API: the baseline of python/bench/overhead.py.
    PyCall(pycall::PyCallArgs),
    /// The host time of stream-bound reads per layer call, with a stream that enqueues
    /// nothing (no GPU), vs a batch_exists of the same keys.
    BoundHost(bound_host::BoundHostArgs),
    /// The owner process `remote` starts (internal).
    #[command(hide = true)]
    RemoteOwner(remote::RemoteOwnerArgs),
}

fn main() {
    // `remote --transport ucx` starts its owner's UCX plane process from this binary.
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(kvtide_remote::UCX_PLANE_ARG) {
        std::process::exit(kvtide_remote::ucx_plane_main(&argv[2..]));
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Dram(args) => dram::run(&args),
        Command::Index(args) => index::run(&args),
        Command::Reads(args) => reads::run(&args),
        Command::Eviction(args) => eviction::run(&args),
        Command::AllocChurn(args) => alloc_churn::run(&args),
        Command::Ssd(args) => ssd::run(&args),
        Command::Restore(args) => restore::run(&args),
        Command::RestoreRounds(args) => restore_rounds::run(&args),
        Command::Remote(args) => remote::run(&args),
        Command::Cluster(args) => cluster::run(&args),
        Command::Stream(args) => stream::run(&args),
        Command::IdleConnections(args) => idle::run(&args),
        Command::StartToListen(args) => start::run(&args),
        Command::RemoteOwner(args) => remote::run_owner(&args),
        Command::PyCall(args) => pycall::run(&args),
        Command::BoundHost(args) => bound_host::run(&args),
        #[cfg(feature = "cuda")]
        Command::Gpu(args) => gpu::run(&args),
        #[cfg(feature = "cuda")]
        Command::GpuRestore(args) => gpu_restore::run(&args),
        #[cfg(feature = "cuda")]
        Command::GpuRemote(args) => gpu_remote::run(&args),
        #[cfg(feature = "cuda")]
        Command::GpuRemoteReader(args) => gpu_remote::run_reader(&args),
        #[cfg(feature = "cuda")]
        Command::Layerwise(args) => layerwise::run(&args),
    };
    if let Err(e) = result {
        eprintln!("kvtide-bench: {e}");
        std::process::exit(1);
    }
}
