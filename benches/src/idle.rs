//! `idle-connections`: what idle connections cost an owner, and whether they delay a busy client.
//!
//! An owner process (`remote-owner`, Unix socket, DRAM only) serves one busy client in this
//! process that reads a small value in a loop. The run measures that client's latency with no
//! other connection (the baseline), then opens `--idle` more clients that connect (handshake
//! included) and then do nothing, and measures the busy client again with them all open. It
//! reports the owner process's threads and resident memory before and after (from
//! /proc/PID/status), and the latency of an idle connection's first request after it woke.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvtide::{PutOptions, Region, Store};
use kvtide_remote::{ClientOptions, RemoteStore};

use crate::hist::Histogram;
use crate::util::{fmt_bytes, parse_size};

/// Arguments of `kvtide-bench idle-connections`.
#[derive(clap::Args, Debug, Clone)]
pub struct IdleArgs {
    /// Idle connections to open.
    #[arg(long, default_value_t = 10_000)]
    pub idle: usize,
    /// Timed reads of the busy client per phase.
    #[arg(long, default_value_t = 20_000)]
    pub requests: usize,
    /// Value size the busy client reads.
    #[arg(long, default_value = "4KiB", value_parser = parse_size)]
    pub value_bytes: u64,
    /// Owner shards.
    #[arg(long, default_value_t = 2)]
    pub shards: usize,
}

/// A field of /proc/PID/status (`Threads`, `VmRSS` in KiB).
fn status_field(pid: u32, name: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim_start_matches(':').split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        })
        .unwrap_or(0)
}

fn busy_reads(client: &RemoteStore, key: &[u8], len: usize, requests: usize) -> Result<Histogram, String> {
    let mut buf = vec![0u8; len];
    let mut hist = Histogram::default();
    for i in 0..requests + requests / 10 {
        let started = Instant::now();
        client.get_into(key, Region::host(&mut buf)).map_err(|e| format!("busy get: {e}"))?;
        // The first tenth warms up.
        if i >= requests / 10 {
            hist.record(started.elapsed().as_nanos() as u64);
        }
    }
    Ok(hist)
}

pub fn run(args: &IdleArgs) -> Result<(), String> {
    let fds = kvtide_remote::raise_descriptor_limit().map_err(|e| format!("descriptor limit: {e}"))?;
    if (fds as usize) < args.idle + 256 {
        return Err(format!("{} idle connections need {} descriptors; the limit is {fds}", args.idle, args.idle + 256));
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("kvtide-bench-idle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("owner.sock");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = std::process::Command::new(exe)
        .args(["remote-owner", "--dram-bytes", "256MiB", "--unix"])
        .arg(&socket)
        .args(["--shards", &args.shards.to_string(), "--max-connections", &(args.idle + 16).to_string()])
        .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("owner process: {e}"))?;
    let mut ready = String::new();
    let stdout = child.stdout.take().ok_or("owner stdout")?;
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut ready).map_err(|e| e.to_string())?;
    if !ready.starts_with("READY") {
        return Err(format!("the owner process did not start: {ready:?}"));
    }
    let pid = child.id();
    let path = format!("unix:{}", socket.display());
    let key = b"idle-bench/value";
    let busy = RemoteStore::connect(&path).map_err(|e| format!("connect: {e}"))?;
    busy.put(key, &vec![5u8; args.value_bytes as usize], PutOptions::UPSERT).map_err(|e| e.to_string())?;
    let len = args.value_bytes as usize;
    let baseline = busy_reads(&busy, key, len, args.requests)?;
    // Connection threads retire a second after their last request.
    std::thread::sleep(Duration::from_millis(1500));
    let (threads_before, rss_before) = (status_field(pid, "Threads"), status_field(pid, "VmRSS"));
    let opening = Instant::now();
    let options = ClientOptions { shared_memory: false, ..ClientOptions::default() };
    let mut idle = Vec::with_capacity(args.idle);
    let bar = crate::util::steps(args.idle as u64, "idle connections");
    for i in 0..args.idle {
        bar.inc(1);
        idle.push(RemoteStore::connect_with(&path, options.clone()).map_err(|e| format!("idle client {i}: {e}"))?);
    }
    bar.finish_and_clear();
    let opened_in = opening.elapsed();
    // Idle connections park after 50 ms; their threads retire a second later.
    std::thread::sleep(Duration::from_millis(2000));
    let (threads_after, rss_after) = (status_field(pid, "Threads"), status_field(pid, "VmRSS"));
    let loaded = busy_reads(&busy, key, len, args.requests)?;
    // Waking parked connections: one request each on a sample of them.
    let mut wake = Histogram::default();
    let mut buf = vec![0u8; len];
    for client in idle.iter().step_by((args.idle / 500).max(1)) {
        let started = Instant::now();
        client.get_into(key, Region::host(&mut buf)).map_err(|e| format!("wake get: {e}"))?;
        wake.record(started.elapsed().as_nanos() as u64);
    }
    println!(
        "## idle-connections: {} idle Unix connections (handshake done, then nothing) against one owner; \
         busy client get_into of {} x {}",
        args.idle,
        fmt_bytes(args.value_bytes),
        args.requests
    );
    println!("opened in {:.2} s", opened_in.as_secs_f64());
    println!(
        "owner process: threads {threads_before} -> {threads_after}; resident memory {} -> {} ({} per idle connection)",
        fmt_bytes(rss_before << 10),
        fmt_bytes(rss_after << 10),
        fmt_bytes(((rss_after.saturating_sub(rss_before)) << 10) / args.idle.max(1) as u64)
    );
    println!("\n| busy client | p50 us | p99 us | max us |\n|---|---:|---:|---:|");
    for (name, h) in [("no idle connections (baseline)", &baseline), ("with the idle connections", &loaded)] {
        println!("| {name} | {:.1} | {:.1} | {:.1} |", h.quantile_us(0.5), h.quantile_us(0.99), h.max() as f64 / 1e3);
    }
    println!(
        "| a parked connection's first request ({} sampled) | {:.1} | {:.1} | {:.1} |",
        wake.count(),
        wake.quantile_us(0.5),
        wake.quantile_us(0.99),
        wake.max() as f64 / 1e3
    );
    drop(idle);
    drop(busy);
    drop(child.stdin.take());
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
