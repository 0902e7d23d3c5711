//! `start-to-listen`: how long `kvtide-owner` takes from its start to serving, per arena size.
//!
//! For each arena size the run starts the real owner binary on a fresh data directory (DRAM
//! only, or with an SSD tier of `--ssd-bytes`), polls its Unix socket until a client completes
//! the handshake, stops it (SIGTERM), and starts it once more on the same directory (a restart:
//! SSD recovery included). The baseline in the same run is the time to start the same binary
//! with `--version` and see it exit (the cost of starting a process at all).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvtide_remote::RemoteStore;

use crate::util::{fmt_bytes, parse_size};

/// Arguments of `kvtide-bench start-to-listen`.
#[derive(clap::Args, Debug, Clone)]
pub struct StartArgs {
    /// DRAM arena sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values = ["1GiB", "6GiB", "16GiB"], value_parser = parse_size)]
    pub arenas: Vec<u64>,
    /// The owner binary (default: kvtide-owner beside this one).
    #[arg(long)]
    pub owner_bin: Option<PathBuf>,
    /// SSD tier size; 0: DRAM only.
    #[arg(long, default_value = "0", value_parser = parse_size)]
    pub ssd_bytes: u64,
    /// Starts per arena (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Data directories go under this one (removed at the end).
    #[arg(long, default_value = "/var/tmp/kvtide-start-bench")]
    pub dir: PathBuf,
}

fn owner_bin(args: &StartArgs) -> Result<PathBuf, String> {
    let bin = match &args.owner_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("kvtide-owner"),
    };
    if !bin.exists() {
        return Err(format!("no owner binary at {} (build it, or pass --owner-bin)", bin.display()));
    }
    Ok(bin)
}

/// Starts the owner and returns the time until a client's handshake succeeded; stops it.
fn start_once(bin: &PathBuf, dir: &std::path::Path, arena: u64, ssd_bytes: u64) -> Result<Duration, String> {
    let mut cmd = Command::new(bin);
    cmd.args(["--data-dir", &dir.display().to_string(), "--tcp", "off", "--dram-bytes", &arena.to_string()]);
    if ssd_bytes == 0 {
        cmd.arg("--no-ssd");
    } else {
        cmd.args(["--ssd-bytes", &ssd_bytes.to_string()]);
    }
    let socket = format!("unix:{}", dir.join("owner.sock").display());
    let started = Instant::now();
    let mut child = cmd.env("KVTIDE_LOG", "warn").stdout(Stdio::null()).spawn().map_err(|e| format!("spawn: {e}"))?;
    let deadline = started + Duration::from_secs(300);
    let elapsed = loop {
        if RemoteStore::connect(&socket).is_ok() {
            break started.elapsed();
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("the owner exited ({status}) before it served"));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("the owner did not serve within 300 s".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // SAFETY: kill with a valid pid of our own child and a valid signal.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("the owner stopped with {status}"));
    }
    Ok(elapsed)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

pub fn run(args: &StartArgs) -> Result<(), String> {
    if args.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    let bin = owner_bin(args)?;
    let mut spawn = Vec::new();
    for _ in 0..args.runs {
        let started = Instant::now();
        let out = Command::new(&bin).arg("--version").output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err("kvtide-owner --version failed".into());
        }
        spawn.push(started.elapsed());
    }
    let spawn = median(spawn);
    println!(
        "## start-to-listen: {} from its start to a client's completed handshake on its Unix socket; {}; \
         median of {}",
        bin.display(),
        if args.ssd_bytes == 0 { "DRAM only".to_string() } else { format!("SSD tier {}", fmt_bytes(args.ssd_bytes)) },
        args.runs
    );
    println!("baseline: starting the binary with --version until it exits: {:.1} ms\n", spawn.as_secs_f64() * 1e3);
    println!("| arena | first start | restart (same directory) |\n|---|---:|---:|");
    let bar = crate::util::steps((args.arenas.len() * args.runs) as u64, "start-to-listen: starts");
    for &arena in &args.arenas {
        let mut first = Vec::new();
        let mut again = Vec::new();
        for run in 0..args.runs {
            let dir = args.dir.join(format!("arena-{arena}-{run}"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            first.push(start_once(&bin, &dir, arena, args.ssd_bytes)?);
            again.push(start_once(&bin, &dir, arena, args.ssd_bytes)?);
            bar.inc(1);
            let _ = std::fs::remove_dir_all(&dir);
        }
        println!(
            "| {} | {:.1} ms | {:.1} ms |",
            fmt_bytes(arena),
            median(first).as_secs_f64() * 1e3,
            median(again).as_secs_f64() * 1e3
        );
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}
