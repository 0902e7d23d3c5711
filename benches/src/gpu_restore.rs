//! `gpu-restore` (feature `cuda`): an SSD-resident batch restored into fragmented GPU pages
//! three ways (on a GPU machine): barrier (load everything, then transfer everything),
//! serialized sub-batches and pipelined sub-batches (the shard loads sub-batch i+1 while
//! sub-batch i goes to the GPU). Baselines in the same run and process:
//! - load-only: the same SSD-resident restore into host buffers through a transfer stage that
//!   copies nothing (the disk side alone);
//! - transfer-only: the same batch restored while it is still DRAM-resident, into the same
//!   device pages (the GPU side alone: kvtide's staged read);
//! - raw: ONE pinned `cuMemcpyHtoDAsync` of the same bytes (the PCIe limit).
//!
//! Per object size: a fresh store (LRU, `promote_on_hit = false`, so every restore reads the
//! SSD, staging on) gets one batch of stamped objects; transfer-only runs; filler pushes the batch
//! to the SSD and is removed; then each mode and load-only run `--iters` times after a warm-up.
//! The device pool is checked byte for byte after each mode, and `stats().loads` shows that every
//! key came from the SSD. The same batch is also read through an owner serving the same engine
//! by a same-host `RemoteStore` (row `owner`, against the embedded pipelined restore). Bound: pipelined at most 1.15 x max(load-only,
//! transfer-only) plus one sub-batch's transfer, where the barrier pays their sum.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::cuda::plan::BulkCopy;
use kvtide::cuda::{BaselineMode, CudaTransport, DeviceBuffer};
use kvtide::{PutOptions, Region, RestoreMode, RestoreOptions, SimFaults, Store, Transport};

use kvtide_remote::{ClientOptions, Owner, OwnerConfig, RemoteStore};

use crate::gpu::{expected_pool, page_regions};
use crate::restore::{demoting_store, push_to_ssd, NullTransfer};
use crate::util::shuffled_slots;
use crate::util::{fmt_bytes, parse_size};

/// Arguments of `kvtide-bench gpu-restore`.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuRestoreArgs {
    /// Object sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values = ["384KiB", "1MiB", "4MiB", "12MiB"], value_parser = parse_size)]
    pub object_bytes: Vec<u64>,
    /// Value bytes per request (whole objects).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub batch_bytes: u64,
    /// Device page size the objects are cut into (pages shuffled over one pool).
    #[arg(long, default_value = "16KiB", value_parser = parse_size)]
    pub page_bytes: u64,
    /// Timed restores per mode (after one warm-up).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Sub-batch target bytes of the serialized and pipelined modes.
    #[arg(long, default_value = "2MiB", value_parser = parse_size)]
    pub target_bytes: u64,
    /// Pipelined: bytes per shard one request keeps requested ahead of its transfers (the
    /// store's default: twice the 64 MiB of loads in flight per shard).
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    pub ahead_bytes: u64,
    /// DRAM pool.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub dram_bytes: u64,
    /// Shards.
    #[arg(long, default_value_t = 4)]
    pub shards: usize,
    /// Data directory (removed at the end).
    #[arg(long, default_value = "/var/tmp/kvtide-gpu-restore")]
    pub dir: PathBuf,
    /// Use the in-memory simulated disk instead of files.
    #[arg(long)]
    pub simulated: bool,
    /// Simulated disk: time per MiB per shard.
    #[arg(long, default_value_t = 1000)]
    pub sim_us_per_mib: u64,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// Draw one pipelined restore's sub-batch timeline (the first object size) into this SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write every sub-batch of every timed restore (the SSD-resident modes through the engine)
    /// to this file as JSON lines, each with its object size, mode, call and elapsed time.
    #[arg(long)]
    pub trace_file: Option<PathBuf>,
}

/// One timed restore of a mode.
type TimedRun<'a> = Box<dyn FnMut() -> Result<Duration, String> + 'a>;

/// One measured way of restoring.
struct Row {
    name: &'static str,
    median: Duration,
    p_max: Duration,
}

/// Medians of the per-round ratios pipelined / barrier and pipelined / serialized.
#[derive(Clone, Copy)]
struct Paired {
    barrier: f64,
    serialized: f64,
}

fn summarize(name: &'static str, mut samples: Vec<Duration>) -> Row {
    samples.sort();
    Row { name, median: samples[samples.len() / 2], p_max: samples[samples.len() - 1] }
}

/// Runs the benchmark.
pub fn run(args: &GpuRestoreArgs) -> Result<(), String> {
    if args.object_bytes.iter().any(|&b| b == 0 || b % args.page_bytes != 0) || args.iters == 0 {
        return Err("object sizes must be positive multiples of --page-bytes; --iters positive".into());
    }
    let transport = CudaTransport::get().map_err(|e| e.to_string())?;
    let device = transport.device(args.gpu).map_err(|e| e.to_string())?;
    println!(
        "## gpu-restore: batch {} per request into {} GPU pages, {} shards, sub-batch target {}, ahead {}, \
         median of {} after a warm-up; {}",
        fmt_bytes(args.batch_bytes),
        fmt_bytes(args.page_bytes),
        args.shards,
        fmt_bytes(args.target_bytes),
        fmt_bytes(args.ahead_bytes),
        args.iters,
        if args.simulated {
            format!("simulated disk ({} us/MiB per shard)", args.sim_us_per_mib)
        } else {
            format!("SSD files in {} (O_DIRECT, io_uring)", args.dir.display())
        }
    );
    let mut table = Vec::new();
    let mut trace_out = match &args.trace_file {
        Some(path) => {
            Some(std::io::BufWriter::new(std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?))
        }
        None => None,
    };
    let bar = crate::util::steps(args.object_bytes.len() as u64, "gpu-restore: object sizes");
    for &object_bytes in &args.object_bytes {
        let (rows, sub_batches, paired) = run_size(args, &device, object_bytes, trace_out.as_mut())?;
        table.push((object_bytes, rows, sub_batches, paired));
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "\n{:<10} {:>9} {:>10} {:>10} {:>10} {:>11} {:>10} {:>9} {:>9} {:>8} {:>10} {:>10} {:>10} {:>11}",
        "object",
        "raw",
        "xfer-only",
        "load-only",
        "barrier",
        "serialized",
        "pipelined",
        "pipe max",
        "bound",
        "target",
        "p/b paired",
        "p/s paired",
        "owner",
        "x pipelined"
    );
    for (object_bytes, rows, sub_batches, paired) in &table {
        let get = |n: &str| rows.iter().find(|r| r.name == n).map_or(0.0, |r| r.median.as_secs_f64() * 1e3);
        let max_of = |n: &str| rows.iter().find(|r| r.name == n).map_or(0.0, |r| r.p_max.as_secs_f64() * 1e3);
        // The target's bound: 1.15 x max(load-only, transfer-only) + one sub-batch (its load and
        // its transfer, at the measured rates; as many sub-batches as the engine planned).
        let one_sub_batch = (get("load-only") + get("transfer-only")) / (*sub_batches).max(1) as f64;
        let bound = 1.15 * get("load-only").max(get("transfer-only")) + one_sub_batch;
        let met = get("pipelined") <= bound && get("pipelined") <= get("barrier").min(get("serialized"));
        println!(
            "{:<10} {:>6.2} ms {:>7.2} ms {:>7.2} ms {:>7.2} ms {:>8.2} ms {:>7.2} ms {:>6.2} ms {:>6.2} ms {:>8} \
             {:>10.3} {:>10.3} {:>7.2} ms {:>11.2}",
            fmt_bytes(*object_bytes),
            get("raw"),
            get("transfer-only"),
            get("load-only"),
            get("barrier"),
            get("serialized"),
            get("pipelined"),
            max_of("pipelined"),
            bound,
            if met { "met" } else { "missed" },
            paired.barrier,
            paired.serialized,
            get("owner"),
            get("pipelined") / get("owner"),
        );
    }
    println!(
        "(bound: 1.15 x max(load-only, transfer-only) + one sub-batch; target: the pipelined median within it and \
         at most min(barrier, serialized); p/b and p/s paired: the median over rounds of pipelined / barrier and \
         pipelined / serialized in the same round, each round starting one mode later)"
    );
    println!(
        "(owner: the same SSD-resident batch read by a same-host RemoteStore through an owner on the same engine; \
         x pipelined = embedded pipelined time / owner time, target >= 0.9)"
    );
    if !args.simulated {
        let _ = std::fs::remove_dir_all(&args.dir);
    }
    Ok(())
}

fn run_size(
    args: &GpuRestoreArgs,
    device: &Arc<kvtide::cuda::CudaDevice>,
    object_bytes: u64,
    trace_out: Option<&mut std::io::BufWriter<std::fs::File>>,
) -> Result<(Vec<Row>, usize, Paired), String> {
    let objects = (args.batch_bytes / object_bytes).max(1) as usize;
    let total = objects as u64 * object_bytes;
    let pages_per_object = object_bytes / args.page_bytes;
    let pages = objects as u64 * pages_per_object;
    let label = fmt_bytes(object_bytes);
    let (builder, filler_keys) = demoting_store(args.dram_bytes, args.shards, object_bytes, total);
    let mut builder =
        builder.restore_sub_batch_bytes(args.target_bytes).restore_ahead_bytes(args.ahead_bytes).gpu_staging(true);
    let dir = args.dir.join(format!("store-{object_bytes}"));
    if args.simulated {
        let faults = SimFaults { latency_us: 50, us_per_mib: args.sim_us_per_mib, ..SimFaults::default() };
        builder = builder.simulated_ssd(7, faults);
    } else {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        builder = builder.ssd_dir(&dir);
    }
    let store = Arc::new(builder.with_env().map_err(|e| e.to_string())?.open().map_err(|e| format!("open: {e}"))?);
    // The same engine served by an owner, read by a same-host client (GPU staging on, as the
    // embedded engine's): the SSD-resident batch through the owner's restore pipeline.
    let socket = std::env::temp_dir().join(format!("kvtide-gpu-restore-{}-{object_bytes}.sock", std::process::id()));
    let owner = Owner::start(
        Arc::clone(&store),
        OwnerConfig { unix_socket: Some(socket.clone()), tcp: None, ..OwnerConfig::default() },
    )
    .map_err(|e| format!("owner: {e}"))?;
    let mut client_options = ClientOptions::default();
    client_options.gpu.staging = true;
    let client = RemoteStore::connect_with(&format!("unix:{}", socket.display()), client_options)
        .map_err(|e| format!("connect: {e}"))?;

    // The batch: object o's word w names (o, w), so any misplaced byte shows.
    let keys: Vec<Vec<u8>> = (0..objects).map(|o| format!("gpu-restore/{o}").into_bytes()).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut host = device.alloc_pinned(total as usize).map_err(|e| e.to_string())?;
    for (o, object) in host.as_mut_slice().chunks_mut(object_bytes as usize).enumerate() {
        for (w, word) in object.chunks_mut(8).enumerate() {
            let v = ((o as u64) << 40 | (w as u64 * 8)) ^ 0x9e37_79b9_0000_0000;
            word.copy_from_slice(&v.to_le_bytes()[..word.len()]);
        }
    }
    for (o, key) in keys.iter().enumerate() {
        let value = &host.as_slice()[o * object_bytes as usize..(o + 1) * object_bytes as usize];
        store.put(key, value, PutOptions::INSERT).map_err(|e| format!("put {o}: {e}"))?;
    }
    let pool: DeviceBuffer = device.alloc(total as usize).map_err(|e| e.to_string())?;
    let contiguous: DeviceBuffer = device.alloc(total as usize).map_err(|e| e.to_string())?;
    let page = args.page_bytes;
    let slots = shuffled_slots(pages, 0x2545_f491_4f6c_dd1d);
    // SAFETY: `pool` outlives every call that uses these regions.
    let regions = unsafe { page_regions(&pool, &slots, objects, pages_per_object, page) };
    let expected = expected_pool(host.as_slice(), &slots, page);
    let verify = |what: &str| -> Result<(), String> {
        let mut back = vec![0u8; total as usize];
        pool.read(0, &mut back).map_err(|e| e.to_string())?;
        if back != expected {
            return Err(format!("[{label}] {what}: the device pages differ from the stored objects"));
        }
        Ok(())
    };
    let base =
        RestoreOptions { target_bytes: args.target_bytes, ahead_bytes: args.ahead_bytes, ..store.restore_options() };
    // (mode, load-only, elapsed, sub-batches) of each traced restore.
    let traced = std::cell::RefCell::new(Vec::new());
    let restore = |mode: RestoreMode, dsts: &[Vec<Region<'_>>], transport: Option<Arc<dyn Transport>>| {
        let mut opts = RestoreOptions { mode, trace: args.trace_file.is_some(), ..base.clone() };
        let load_only = transport.is_some();
        if let Some(t) = transport {
            opts.host_transport = Some(t);
        }
        let started = Instant::now();
        let mut report = store.restore_batch(&key_refs, dsts, &opts);
        let elapsed = started.elapsed();
        if opts.trace {
            traced.borrow_mut().push((mode, load_only, elapsed, std::mem::take(&mut report.sub_batches)));
        }
        match report.results.iter().find(|r| r.is_err()) {
            Some(Err(e)) => Err(format!("[{label}] {mode:?} restore: {e}")),
            _ => Ok(elapsed),
        }
    };
    let timed = |name: &'static str, mut run: TimedRun<'_>| {
        run()?; // warm-up
        let samples = (0..args.iters).map(|_| run()).collect::<Result<Vec<_>, _>>()?;
        Ok::<Row, String>(summarize(name, samples))
    };

    let mut rows = Vec::new();
    let one_copy = [BulkCopy { host: host.as_slice().as_ptr() as u64, device: contiguous.addr(), len: total }];
    rows.push(timed(
        "raw",
        // SAFETY: the pinned buffer and the device buffer are alive for the whole function.
        Box::new(|| unsafe { device.timed_copies(&one_copy, true, BaselineMode::PerCopy) }.map_err(|e| e.to_string())),
    )?);
    pool.fill(0).map_err(|e| e.to_string())?;
    rows.push(timed("transfer-only", Box::new(|| restore(RestoreMode::Pipelined, &regions, None)))?);
    verify("transfer-only")?;
    traced.borrow_mut().clear(); // DRAM-resident restores: not the pipeline's loads
    let dram_loads = store.stats().total.loads;

    // Demote the batch: filler pushes it out (LRU) and goes away.
    push_to_ssd(&store, objects as u64, filler_keys).map_err(|e| format!("[{label}] {e}"))?;
    let before = store.stats().total;
    eprintln!(
        "[{label}] {objects} objects ({}), {pages} pages of {}; on SSD: {} objects; DRAM used {}",
        fmt_bytes(total),
        fmt_bytes(page),
        before.ssd_objects,
        fmt_bytes(before.bytes_used)
    );
    // One traced pipelined restore: how many sub-batches the engine plans (the bound's "one
    // sub-batch"), and the timeline when asked.
    let opts = RestoreOptions { mode: RestoreMode::Pipelined, trace: true, ..base.clone() };
    let report = store.restore_batch(&key_refs, &regions, &opts);
    let sub_batches = report.sub_batches.iter().filter(|t| t.staging_bytes > 0).count();
    let plotted = args.plot.is_some() && object_bytes == args.object_bytes[0];
    if let (Some(path), true) = (&args.plot, plotted) {
        let title = format!(
            "pipelined restore of {} SSD-resident {} objects into {} GPU pages: sub-batches",
            fmt_bytes(total),
            label,
            fmt_bytes(page)
        );
        crate::plot::sub_batch_timeline(path, &title, &report.sub_batches)?;
        eprintln!("[{label}] sub-batch timeline: {}", path.display());
    }
    let through_owner = || {
        let started = Instant::now();
        let results = client.batch_get_into_multi_buffers(&key_refs, &regions);
        let elapsed = started.elapsed();
        match results.iter().find(|r| r.is_err()) {
            Some(Err(e)) => Err(format!("[{label}] through the owner: {e}")),
            _ => Ok(elapsed),
        }
    };
    let mut sink: Vec<Vec<u8>> = (0..objects).map(|_| vec![0u8; object_bytes as usize]).collect();
    let host_dsts: Vec<Vec<Region<'_>>> = sink.iter_mut().map(|b| vec![Region::host(b.as_mut_slice())]).collect();
    let null: Arc<dyn Transport> = Arc::new(NullTransfer);
    // The SSD-resident modes run in rounds, one of each per round, so the disk's drift over
    // the run (this virtio disk swings by 10-20%) weighs on every mode alike. The first round
    // warms up and checks every GPU mode's bytes.
    let mut modes: Vec<(&'static str, bool, TimedRun<'_>)> = vec![
        ("barrier", true, Box::new(|| restore(RestoreMode::Barrier, &regions, None))),
        ("serialized", true, Box::new(|| restore(RestoreMode::Serialized, &regions, None))),
        ("pipelined", true, Box::new(|| restore(RestoreMode::Pipelined, &regions, None))),
        ("owner", true, Box::new(through_owner)),
        ("load-only", false, Box::new(|| restore(RestoreMode::Pipelined, &host_dsts, Some(Arc::clone(&null))))),
    ];
    let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(args.iters); modes.len()];
    let count = modes.len();
    for round in 0..=args.iters {
        // Each round starts one mode later, so no mode always follows the same one.
        for m in (0..count).map(|i| (i + round) % count) {
            let (name, on_gpu, run) = &mut modes[m];
            if round == 0 && *on_gpu {
                pool.fill(0).map_err(|e| e.to_string())?;
            }
            let took = run()?;
            if round == 0 && *on_gpu {
                verify(name)?;
            } else if round > 0 {
                samples[m].push(took);
            }
        }
    }
    // Pipelined against barrier and serialized round by round: the disk's drift cancels in
    // each pair, which the medians of separate modes do not give.
    let paired = |other: usize| {
        let mut ratios: Vec<f64> =
            samples[2].iter().zip(&samples[other]).map(|(p, o)| p.as_secs_f64() / o.as_secs_f64()).collect();
        ratios.sort_by(f64::total_cmp);
        ratios[ratios.len() / 2]
    };
    let paired = Paired { barrier: paired(0), serialized: paired(1) };
    for ((name, _, _), taken) in modes.iter().zip(samples) {
        rows.push(summarize(name, taken));
    }
    drop(modes);
    if let Some(out) = trace_out {
        use std::io::Write;
        for (call, (mode, load_only, elapsed, sub_batches)) in traced.take().into_iter().enumerate() {
            let mode = if load_only { "load-only".to_string() } else { format!("{mode:?}").to_lowercase() };
            for t in sub_batches {
                let line = t.to_json_line();
                writeln!(
                    out,
                    "{{\"object_bytes\":{object_bytes},\"mode\":\"{mode}\",\"call\":{call},\"elapsed_us\":{},{}",
                    elapsed.as_micros(),
                    &line[1..]
                )
                .map_err(|e| e.to_string())?;
            }
        }
        out.flush().map_err(|e| e.to_string())?;
    }
    // Releases are fire-and-forget: let the shards handle them before reading the gauges.
    store.sync_shards().map_err(|e| e.to_string())?;
    let after = store.stats();
    let ssd_runs = 5 * (args.iters as u64 + 1) + 1;
    let loads = after.total.loads - before.loads;
    eprintln!(
        "[{label}] SSD loads per key per SSD run {:.2} (transfer-only runs loaded {}); staged GPU requests {}, \
         direct {}, fallbacks {:?}; leases held {}, staging credits held {}",
        loads as f64 / (ssd_runs * objects as u64) as f64,
        dram_loads,
        after.gpu.staged_requests,
        after.gpu.direct_requests,
        after.gpu.fallbacks,
        after.total.leases_held,
        after.restore.credits_held_bytes,
    );
    for row in &rows {
        eprintln!(
            "[{label}] {:<14} median {:>8.2} ms  max {:>8.2} ms  {:>6.1} GB/s",
            row.name,
            row.median.as_secs_f64() * 1e3,
            row.p_max.as_secs_f64() * 1e3,
            total as f64 / row.median.as_secs_f64() / 1e9
        );
    }
    drop(host_dsts);
    drop(client);
    drop(owner);
    let _ = std::fs::remove_file(&socket);
    drop(store);
    if !args.simulated {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok((rows, sub_batches, paired))
}
