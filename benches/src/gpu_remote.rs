//! `gpu-remote`: reads into fragmented GPU pages by reader processes through one owner on the
//! same host, against the embedded engine and raw PCIe copies in the same run (feature `cuda`).
//!
//! For each layout (objects x object size, cut into pages shuffled over a device pool) and each
//! path (direct, staged), with 1, 2 and 4 reader processes: the owner (this process) holds every
//! object in DRAM; each reader (a child process, `gpu-remote-reader`) connects a `RemoteStore`
//! over the Unix socket, reads every object into its own pool once (checked byte for byte), then
//! waits for the start signal and times `--iters` reads. The figure is the bytes all readers
//! moved over the wall time from the first start to the last end. Baselines in the same run: one
//! raw pinned `cuMemcpyHtoDAsync` of the same bytes (the link) and the embedded engine's staged
//! and direct reads of the same layout.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvtide::cuda::plan::BulkCopy;
use kvtide::cuda::{BaselineMode, CudaTransport};
use kvtide::{PutOptions, Store, StoreBuilder};
use kvtide_remote::{ClientOptions, Owner, OwnerConfig, RemoteStore};

use crate::gpu::{expected_pool, page_regions, Layout};
use crate::util::shuffled_slots;
use crate::util::{fmt_bytes, parse_size};

/// Arguments of `kvtide-bench gpu-remote`.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuRemoteArgs {
    /// Layouts: comma-separated OBJECTSxOBJECT_BYTES/PAGE_BYTES.
    #[arg(long, default_value = "96x12MiB/128KiB,1536x384KiB/4KiB")]
    pub layouts: String,
    /// Reader process counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub readers: Vec<usize>,
    /// Timed reads per reader.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Staging buffer of the staged path (each reader's, and the embedded engine's).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub staging_bytes: u64,
    /// Owner shards.
    #[arg(long, default_value_t = 4)]
    pub shards: usize,
}

/// Arguments of the hidden reader process.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuRemoteReaderArgs {
    #[arg(long)]
    pub socket: PathBuf,
    #[arg(long)]
    pub layout: String,
    #[arg(long)]
    pub staged: bool,
    #[arg(long, value_parser = parse_size)]
    pub staging_bytes: u64,
    #[arg(long)]
    pub iters: usize,
    /// Shuffle seed of this reader's pool.
    #[arg(long)]
    pub seed: u64,
}

fn key(o: usize) -> Vec<u8> {
    format!("gpu-remote/{o}").into_bytes()
}

/// Object `o`'s bytes: every 8-byte word names its object and offset.
fn object(o: usize, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    for (w, chunk) in out.chunks_mut(8).enumerate() {
        let word = (((o as u64) << 40) | (w as u64 * 8)) ^ 0x5bd1_e995_0000_0000;
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
    out
}

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// A reader process: checks once, says READY, waits for GO, times its reads, prints
/// `TIMES start_ns end_ns` (wall clock, comparable across processes).
pub fn run_reader(args: &GpuRemoteReaderArgs) -> Result<(), String> {
    let layout = Layout::parse(&args.layout)?;
    let device = CudaTransport::get().and_then(|t| t.device(0)).map_err(|e| e.to_string())?;
    let mut options = ClientOptions::default();
    options.gpu.staging = args.staged;
    options.gpu.staging_bytes = args.staging_bytes;
    let store = RemoteStore::connect_with(&format!("unix:{}", args.socket.display()), options)
        .map_err(|e| format!("connect: {e}"))?;
    if !store.uses_shared_memory() {
        return Err("the reader got no shared memory".into());
    }
    let total = layout.total_bytes();
    let ppo = layout.pages_per_object();
    let slots = shuffled_slots(layout.objects as u64 * ppo, args.seed);
    let pool = device.alloc(total as usize).map_err(|e| e.to_string())?;
    // SAFETY: `pool` outlives every read below.
    let regions = unsafe { page_regions(&pool, &slots, layout.objects, ppo, layout.page_bytes) };
    let keys: Vec<Vec<u8>> = (0..layout.objects).map(key).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let read = || -> Result<(), String> {
        let results = store.batch_get_into_multi_buffers(&key_refs, &regions);
        match results.iter().find(|r| r.is_err()) {
            Some(Err(e)) => Err(format!("read: {e}")),
            _ => Ok(()),
        }
    };
    read()?;
    let host: Vec<u8> = (0..layout.objects).flat_map(|o| object(o, layout.object_bytes)).collect();
    let mut back = vec![0u8; total as usize];
    pool.read(0, &mut back).map_err(|e| e.to_string())?;
    if back != expected_pool(&host, &slots, layout.page_bytes) {
        return Err("the device pages differ from the stored objects".into());
    }
    drop((host, back));
    read()?;
    println!("READY");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| e.to_string())?;
    let start = now_ns();
    for _ in 0..args.iters {
        read()?;
    }
    let end = now_ns();
    println!("TIMES {start} {end}");
    Ok(())
}

fn spawn_reader(
    socket: &std::path::Path,
    layout: &str,
    staged: bool,
    args: &GpuRemoteArgs,
    seed: u64,
) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args(["gpu-remote-reader", "--socket"])
        .arg(socket)
        .args(["--layout", layout, "--iters", &args.iters.to_string(), "--seed", &seed.to_string()])
        .args(["--staging-bytes", &args.staging_bytes.to_string()]);
    if staged {
        cmd.arg("--staged");
    }
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| e.to_string())
}

/// Runs `readers` reader processes at once; returns the aggregate GB/s.
fn remote_run(
    socket: &std::path::Path,
    text: &str,
    layout: &Layout,
    staged: bool,
    readers: usize,
    args: &GpuRemoteArgs,
) -> Result<f64, String> {
    let mut children = Vec::new();
    for r in 0..readers {
        children.push(spawn_reader(socket, text, staged, args, 0x9e37_79b9 + r as u64)?);
    }
    let mut outs = Vec::new();
    for child in children.iter_mut() {
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        match lines.next() {
            Some(Ok(l)) if l == "READY" => outs.push(lines),
            other => return Err(format!("reader did not get ready: {other:?}")),
        }
    }
    for child in children.iter_mut() {
        let stdin = child.stdin.as_mut().ok_or("no stdin")?;
        stdin.write_all(b"GO\n").map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
    }
    let (mut first, mut last) = (u128::MAX, 0u128);
    for lines in outs.iter_mut() {
        let line = lines.next().ok_or("reader ended early")?.map_err(|e| e.to_string())?;
        let mut parts = line.split_whitespace();
        if parts.next() != Some("TIMES") {
            return Err(format!("reader said {line:?}"));
        }
        let start: u128 = parts.next().and_then(|v| v.parse().ok()).ok_or("bad start")?;
        let end: u128 = parts.next().and_then(|v| v.parse().ok()).ok_or("bad end")?;
        first = first.min(start);
        last = last.max(end);
    }
    for mut child in children {
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("a reader failed: {status}"));
        }
    }
    let bytes = readers as f64 * args.iters as f64 * layout.objects as f64 * layout.object_bytes as f64;
    Ok(bytes / ((last - first) as f64 / 1e9) / 1e9)
}

/// The embedded engine's read of the same layout, median GB/s of `iters`.
fn embedded_run(layout: &Layout, staged: bool, args: &GpuRemoteArgs) -> Result<f64, String> {
    let device = CudaTransport::get().and_then(|t| t.device(0)).map_err(|e| e.to_string())?;
    let total = layout.total_bytes();
    let store = StoreBuilder::new()
        .dram_bytes((total + total / 2 + (512 << 20)).next_multiple_of(2 << 20))
        .shards(args.shards)
        .max_value_bytes(layout.object_bytes)
        .gpu_staging(staged)
        .gpu_staging_bytes(args.staging_bytes)
        .open()
        .map_err(|e| e.to_string())?;
    for o in 0..layout.objects {
        store.put(&key(o), &object(o, layout.object_bytes), PutOptions::UPSERT).map_err(|e| e.to_string())?;
    }
    let ppo = layout.pages_per_object();
    let slots = shuffled_slots(layout.objects as u64 * ppo, 7);
    let pool = device.alloc(total as usize).map_err(|e| e.to_string())?;
    // SAFETY: `pool` outlives every read below.
    let regions = unsafe { page_regions(&pool, &slots, layout.objects, ppo, layout.page_bytes) };
    let keys: Vec<Vec<u8>> = (0..layout.objects).map(key).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut samples = Vec::new();
    for i in 0..args.iters + 2 {
        let t0 = Instant::now();
        let results = store.batch_get_into_multi_buffers(&key_refs, &regions);
        if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
            return Err(format!("embedded read: {e}"));
        }
        if i >= 2 {
            samples.push(t0.elapsed());
        }
    }
    samples.sort();
    Ok(total as f64 / samples[samples.len() / 2].as_secs_f64() / 1e9)
}

/// One raw pinned copy of the layout's bytes, median GB/s.
fn raw_run(layout: &Layout, iters: usize) -> Result<f64, String> {
    let device = CudaTransport::get().and_then(|t| t.device(0)).map_err(|e| e.to_string())?;
    let total = layout.total_bytes();
    let host = device.alloc_pinned(total as usize).map_err(|e| e.to_string())?;
    let dst = device.alloc(total as usize).map_err(|e| e.to_string())?;
    let copy = [BulkCopy { host: host.as_slice().as_ptr() as u64, device: dst.addr(), len: total }];
    let mut samples: Vec<Duration> = Vec::new();
    for _ in 0..iters + 2 {
        // SAFETY: the pinned and device buffers above live for the whole function.
        samples.push(unsafe { device.timed_copies(&copy, true, BaselineMode::PerCopy) }.map_err(|e| e.to_string())?);
    }
    samples.sort();
    Ok(total as f64 / samples[samples.len() / 2].as_secs_f64() / 1e9)
}

/// Runs the benchmark.
pub fn run(args: &GpuRemoteArgs) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("kvtide-bench-gpu-remote-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    println!(
        "## gpu-remote: reader processes through one owner (Unix socket + shared memory), {} timed reads each",
        args.iters
    );
    println!("| layout | path | raw H2D GB/s | embedded GB/s | 1 reader GB/s | x embedded | 2 readers GB/s | 4 readers GB/s | max readers x raw |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let bar = crate::util::steps(2 * args.layouts.split(',').count() as u64, "gpu-remote: layouts x paths");
    for text in args.layouts.split(',') {
        let layout = Layout::parse(text)?;
        let total = layout.total_bytes();
        let engine = Arc::new(
            StoreBuilder::new()
                .dram_bytes((total + total / 2 + (512 << 20)).next_multiple_of(2 << 20))
                .shards(args.shards)
                .max_value_bytes(layout.object_bytes)
                .open()
                .map_err(|e| e.to_string())?,
        );
        for o in 0..layout.objects {
            engine.put(&key(o), &object(o, layout.object_bytes), PutOptions::UPSERT).map_err(|e| e.to_string())?;
        }
        let socket = dir.join("owner.sock");
        let owner = Owner::start(
            Arc::clone(&engine),
            OwnerConfig { unix_socket: Some(socket.clone()), ..OwnerConfig::default() },
        )
        .map_err(|e| e.to_string())?;
        let raw = raw_run(&layout, args.iters)?;
        for staged in [false, true] {
            bar.inc(1);
            eprintln!("  {text} {} ...", if staged { "staged" } else { "direct" });
            let embedded = embedded_run(&layout, staged, args)?;
            let mut by_readers = Vec::new();
            for &readers in &args.readers {
                by_readers.push((readers, remote_run(&socket, text, &layout, staged, readers, args)?));
            }
            let at = |n: usize| by_readers.iter().find(|(r, _)| *r == n).map(|(_, g)| *g);
            let cell = |v: Option<f64>| v.map_or("–".to_string(), |g| format!("{g:.1}"));
            let max = by_readers.iter().max_by_key(|(r, _)| *r).map(|(_, g)| *g);
            println!(
                "| {} ({}) | {} | {raw:.1} | {embedded:.1} | {} | {} | {} | {} | {} |",
                text,
                fmt_bytes(total),
                if staged { "staged" } else { "direct" },
                cell(at(1)),
                at(1).map_or("–".into(), |g| format!("{:.2}", g / embedded)),
                cell(at(2)),
                cell(at(4)),
                max.map_or("–".into(), |g| format!("{:.2}", g / raw)),
            );
        }
        drop(owner);
        drop(engine);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
