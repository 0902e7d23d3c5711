//! `ssd`: restore throughput of SSD-resident objects into host buffers, and demotion (write-back)
//! throughput, measured in the same run against `fio` (O_DIRECT, io_uring, registered buffers)
//! on the same file system with the same block size and queue depth.
//!
//! Per configuration (value size x shard count x queue depth) the run:
//! 1. opens a fresh store in `<dir>/kvtide-*` with a small DRAM pool, the SSD tier on, loads
//!    that leave DRAM once read (`promote_on_hit = false`) and a restore budget of `qd` records
//!    per shard (the shard's queue depth);
//! 2. puts the dataset (`--dataset-bytes`, several times the DRAM pool) from `--threads`
//!    threads, then a DRAM pool's worth of filler objects so every dataset object is evicted,
//!    and times first put -> every dataset object on SSD (demotion throughput);
//! 3. per key order (sequential = put order, random = a seeded shuffle), after an untimed
//!    warm-up, reads batches of `--batch` keys with `batch_get_into_multi_buffers` from
//!    `--threads` threads for `--duration-secs`;
//! 4. removes the store's directory, then runs fio with `--bs` = the record size (value + key +
//!    64-byte header, rounded up to 4 KiB; `--fio-bs` overrides), `--iodepth` = qd and
//!    `--numjobs` = shards (each shard has its own files and its own queue of qd loads), over a
//!    file of the same bytes in the same directory: one sequential write pass, then `read` and
//!    `randread` for the same duration.
//!
//! kvtide/fio ratios compare device bytes/s (the records kvtide read or wrote, the same bytes
//! fio moved) and value bytes/s (what the caller got) with fio's bytes/s.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvtide::{Engine, EvictionPolicy, PutOptions, Region, Stats, Store, StoreBuilder};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::hist::Histogram;
use crate::restore::settle;
use crate::util::{fmt_bytes, json_str, parse_size};

/// Bytes of a record header (kvtide's SSD format).
const RECORD_HEADER_BYTES: u64 = 64;
/// Records are padded to this.
const RECORD_ALIGN_BYTES: u64 = 4096;
/// Longest wait for demotions to land on SSD.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Arguments of `kvtide-bench ssd`.
#[derive(clap::Args, Debug, Clone)]
pub struct SsdArgs {
    /// Value sizes (comma-separated; 1MiB, 64KiB, ...).
    #[arg(long, value_delimiter = ',', default_values = ["1MiB", "64KiB"], value_parser = parse_size)]
    pub value_bytes: Vec<u64>,
    /// Queue depths: SSD loads in flight per shard (the restore budget is qd records), fio's
    /// --iodepth (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [32])]
    pub qd: Vec<usize>,
    /// Shard counts (comma-separated); fio runs as many jobs.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2])]
    pub shards: Vec<usize>,
    /// Key orders of the restore runs: seq (put order), rand (seeded shuffle).
    #[arg(long, value_delimiter = ',', default_values = ["seq", "rand"], value_parser = parse_order)]
    pub order: Vec<KeyOrder>,
    /// Caller threads (puts and batch reads).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Keys per batch read (default: the queue depth).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Dataset size (value bytes); keys = dataset / value size.
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    pub dataset_bytes: u64,
    /// kvtide's DRAM pool.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub dram_bytes: u64,
    /// SSD tier capacity (preallocated). Default: dataset + filler records, +10%, + 2 segments
    /// per shard.
    #[arg(long, value_parser = parse_size)]
    pub ssd_bytes: Option<u64>,
    /// SSD segment file size.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    pub segment_bytes: u64,
    /// Measured duration of each restore round (and of each fio read job).
    #[arg(long, default_value_t = 4.0)]
    pub duration_secs: f64,
    /// Timed rounds per key order; kvtide and fio alternate round by round, so slow drift of the
    /// device hits both alike.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Untimed reads before each key order's rounds (fio: --ramp_time, at most 1 s, per round).
    #[arg(long, default_value_t = 1.0)]
    pub warmup_secs: f64,
    /// Data directory (kvtide's segments and fio's file); created if missing.
    #[arg(long, default_value = "/work/kvtide-bench-data")]
    pub dir: PathBuf,
    /// Keep the store directories and fio files (default: removed after each configuration).
    #[arg(long)]
    pub keep: bool,
    /// Only measure kvtide.
    #[arg(long)]
    pub skip_fio: bool,
    /// fio executable.
    #[arg(long, default_value = "fio")]
    pub fio: String,
    /// fio block size (default: kvtide's record size for the value size).
    #[arg(long, value_parser = parse_size)]
    pub fio_bs: Option<u64>,
    /// Engine restore pipeline for batched reads (on/off; default: the engine's).
    #[arg(long, value_parser = parse_on_off)]
    pub restore_pipeline: Option<bool>,
    /// Restore pipeline: target bytes per sub-batch (default: the engine's).
    #[arg(long, value_parser = parse_size)]
    pub sub_batch_bytes: Option<u64>,
    /// Restore pipeline: keys per sub-batch at most (default: the engine's).
    #[arg(long)]
    pub sub_batch_keys: Option<usize>,
    /// Restore pipeline: bytes per shard one request keeps loading ahead (default: the engine's).
    #[arg(long, value_parser = parse_size)]
    pub ahead_bytes: Option<u64>,
    /// Restore pipeline: staging bytes all restores may hold (default: the engine's).
    #[arg(long, value_parser = parse_size)]
    pub staging_bytes: Option<u64>,
    /// Do not pin kvtide's shard threads to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// Also print one JSON line per result.
    #[arg(long)]
    pub json: bool,
    /// RNG seed (random key order; fio's random offsets).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// Order in which a restore run reads the keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyOrder {
    /// Put order (on SSD: each shard's records front to back).
    Seq,
    /// A seeded shuffle.
    Rand,
}

impl KeyOrder {
    fn name(self) -> &'static str {
        match self {
            KeyOrder::Seq => "seq",
            KeyOrder::Rand => "rand",
        }
    }

    fn fio_rw(self) -> &'static str {
        match self {
            KeyOrder::Seq => "read",
            KeyOrder::Rand => "randread",
        }
    }
}

fn parse_on_off(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(format!("{text:?}: expected on or off")),
    }
}

fn parse_order(text: &str) -> Result<KeyOrder, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "seq" | "sequential" => Ok(KeyOrder::Seq),
        "rand" | "random" => Ok(KeyOrder::Rand),
        _ => Err(format!("{text:?}: expected seq or rand")),
    }
}

/// One (value size, shards, queue depth) configuration.
#[derive(Clone, Copy, Debug, Default)]
struct Config {
    value_bytes: u64,
    shards: usize,
    qd: usize,
    batch: usize,
    record_bytes: u64,
    keys: u64,
    fio_bs: u64,
}

impl Config {
    fn label(&self) -> String {
        format!("{} s{} qd{}", fmt_bytes(self.value_bytes), self.shards, self.qd)
    }

    fn file_stem(&self) -> String {
        format!("v{}-s{}-q{}", self.value_bytes, self.shards, self.qd)
    }
}

/// CPU use of a group of threads over a run.
#[derive(Clone, Copy, Debug, Default)]
struct CpuUse {
    threads: usize,
    /// On-CPU time, summed over the group.
    run_ns: u64,
    /// Time runnable but waiting for a CPU, summed.
    wait_ns: u64,
    /// utime and stime in clock ticks (for the user/system split).
    user_ticks: u64,
    sys_ticks: u64,
}

impl CpuUse {
    fn add(&mut self, other: &CpuUse) {
        self.threads += other.threads;
        self.run_ns += other.run_ns;
        self.wait_ns += other.wait_ns;
        self.user_ticks += other.user_ticks;
        self.sys_ticks += other.sys_ticks;
    }

    fn delta(&self, before: &CpuUse) -> CpuUse {
        CpuUse {
            threads: self.threads,
            run_ns: self.run_ns.saturating_sub(before.run_ns),
            wait_ns: self.wait_ns.saturating_sub(before.wait_ns),
            user_ticks: self.user_ticks.saturating_sub(before.user_ticks),
            sys_ticks: self.sys_ticks.saturating_sub(before.sys_ticks),
        }
    }

    /// "83% cpu (61% sys), 4% runqueue" over `elapsed`, in CPUs (100% = one CPU busy).
    fn describe(&self, elapsed: Duration) -> String {
        let wall = elapsed.as_nanos().max(1) as f64;
        let ticks = (self.user_ticks + self.sys_ticks).max(1) as f64;
        format!(
            "{} thr {:.0}% cpu ({:.0}% sys), {:.0}% waiting for a cpu",
            self.threads,
            100.0 * self.run_ns as f64 / wall,
            100.0 * self.sys_ticks as f64 / ticks,
            100.0 * self.wait_ns as f64 / wall
        )
    }
}

/// CPU use of this process's threads whose name starts with `prefix` (from /proc).
fn cpu_of_threads(prefix: &str) -> CpuUse {
    let mut total = CpuUse::default();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return total };
    for task in tasks.flatten() {
        let path = task.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim_end().starts_with(prefix) {
            total.add(&cpu_of_task(&path));
        }
    }
    total
}

/// CPU use of one thread so far (`/proc/self/task/<tid>` or `/proc/thread-self`).
fn cpu_of_task(path: &Path) -> CpuUse {
    let mut cpu = CpuUse { threads: 1, ..CpuUse::default() };
    if let Ok(text) = std::fs::read_to_string(path.join("schedstat")) {
        let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().unwrap_or(0));
        cpu.run_ns = fields.next().unwrap_or(0);
        cpu.wait_ns = fields.next().unwrap_or(0);
    }
    if let Ok(text) = std::fs::read_to_string(path.join("stat")) {
        // After the parenthesised command name: utime and stime are the 12th and 13th fields.
        if let Some(rest) = text.rfind(')').map(|i| &text[i + 1..]) {
            let fields: Vec<&str> = rest.split_whitespace().collect();
            cpu.user_ticks = fields.get(11).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
            cpu.sys_ticks = fields.get(12).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    cpu
}

/// Machine-wide CPU ticks (`/proc/stat`) and this process's (`/proc/self/stat`), to see how
/// much CPU other processes took during a phase (the box may be shared).
#[derive(Clone, Copy, Debug, Default)]
struct HostCpu {
    busy: u64,
    total: u64,
    ours: u64,
}

impl HostCpu {
    fn now() -> HostCpu {
        let mut host = HostCpu::default();
        if let Some(line) = std::fs::read_to_string("/proc/stat").ok().and_then(|t| t.lines().next().map(String::from))
        {
            let f: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0)).collect();
            // user nice system idle iowait irq softirq steal (guest time is inside user).
            host.total = f.iter().take(8).sum();
            host.busy = host.total - f.get(3).copied().unwrap_or(0) - f.get(4).copied().unwrap_or(0);
        }
        if let Ok(text) = std::fs::read_to_string("/proc/self/stat") {
            if let Some(rest) = text.rfind(')').map(|i| &text[i + 1..]) {
                let f: Vec<&str> = rest.split_whitespace().collect();
                host.ours = [11, 12].iter().filter_map(|&i| f.get(i).and_then(|x| x.parse::<u64>().ok())).sum();
            }
        }
        host
    }

    fn delta(&self, before: &HostCpu) -> HostCpu {
        HostCpu {
            busy: self.busy.saturating_sub(before.busy),
            total: self.total.saturating_sub(before.total),
            ours: self.ours.saturating_sub(before.ours),
        }
    }

    fn add(&mut self, other: &HostCpu) {
        self.busy += other.busy;
        self.total += other.total;
        self.ours += other.ours;
    }

    /// "machine 71% busy (other processes 20%)", as shares of all CPUs.
    fn describe(&self) -> String {
        let total = self.total.max(1) as f64;
        format!(
            "machine {:.0}% busy (other processes {:.0}%)",
            100.0 * self.busy as f64 / total,
            100.0 * self.busy.saturating_sub(self.ours) as f64 / total
        )
    }
}

/// The block device's I/O counters (`/sys/dev/block/M:m/stat`), for queue depth, request size
/// and latency over a phase as the kernel saw them (after request splitting).
#[derive(Clone, Copy, Debug, Default)]
struct DiskStat {
    reads: u64,
    read_sectors: u64,
    read_ms: u64,
    writes: u64,
    write_sectors: u64,
    write_ms: u64,
    busy_ms: u64,
}

impl DiskStat {
    fn read(file: Option<&Path>) -> Option<DiskStat> {
        let text = std::fs::read_to_string(file?).ok()?;
        let f: Vec<u64> = text.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
        Some(DiskStat {
            reads: *f.first()?,
            read_sectors: *f.get(2)?,
            read_ms: *f.get(3)?,
            writes: *f.get(4)?,
            write_sectors: *f.get(6)?,
            write_ms: *f.get(7)?,
            busy_ms: *f.get(9)?,
        })
    }

    fn delta(&self, before: &DiskStat) -> DiskStat {
        DiskStat {
            reads: self.reads.saturating_sub(before.reads),
            read_sectors: self.read_sectors.saturating_sub(before.read_sectors),
            read_ms: self.read_ms.saturating_sub(before.read_ms),
            writes: self.writes.saturating_sub(before.writes),
            write_sectors: self.write_sectors.saturating_sub(before.write_sectors),
            write_ms: self.write_ms.saturating_sub(before.write_ms),
            busy_ms: self.busy_ms.saturating_sub(before.busy_ms),
        }
    }

    fn add(&mut self, other: &DiskStat) {
        self.reads += other.reads;
        self.read_sectors += other.read_sectors;
        self.read_ms += other.read_ms;
        self.writes += other.writes;
        self.write_sectors += other.write_sectors;
        self.write_ms += other.write_ms;
        self.busy_ms += other.busy_ms;
    }
}

/// A phase's device view: counters over a wall time.
#[derive(Clone, Copy, Debug, Default)]
struct DeviceView {
    stat: DiskStat,
    wall: Duration,
}

impl DeviceView {
    fn add(&mut self, other: &DeviceView) {
        self.stat.add(&other.stat);
        self.wall += other.wall;
    }

    /// Average requests queued or in service (Little's law over the kernel's request times).
    fn queue(&self, write: bool) -> f64 {
        let ms = if write { self.stat.write_ms } else { self.stat.read_ms };
        ms as f64 / (self.wall.as_secs_f64() * 1000.0).max(1e-9)
    }

    fn request_kib(&self, write: bool) -> f64 {
        let (n, sectors) =
            if write { (self.stat.writes, self.stat.write_sectors) } else { (self.stat.reads, self.stat.read_sectors) };
        if n == 0 {
            0.0
        } else {
            sectors as f64 * 512.0 / 1024.0 / n as f64
        }
    }

    fn latency_ms(&self, write: bool) -> f64 {
        let (n, ms) = if write { (self.stat.writes, self.stat.write_ms) } else { (self.stat.reads, self.stat.read_ms) };
        if n == 0 {
            0.0
        } else {
            ms as f64 / n as f64
        }
    }

    /// "QD 31.2, 516 KiB requests, 15.1 ms, 100% busy".
    fn describe(&self, write: bool) -> String {
        format!(
            "dev QD {:.1}, {:.0} KiB requests, {:.2} ms each, {:.0}% busy",
            self.queue(write),
            self.request_kib(write),
            self.latency_ms(write),
            100.0 * self.stat.busy_ms as f64 / (self.wall.as_secs_f64() * 1000.0).max(1e-9)
        )
    }
}

/// Measures the device over a phase.
struct DeviceProbe {
    file: Option<PathBuf>,
    before: Option<DiskStat>,
    started: Instant,
}

impl DeviceProbe {
    fn start(file: Option<&Path>) -> DeviceProbe {
        DeviceProbe { file: file.map(Path::to_path_buf), before: DiskStat::read(file), started: Instant::now() }
    }

    fn finish(self) -> Option<DeviceView> {
        let after = DiskStat::read(self.file.as_deref())?;
        Some(DeviceView { stat: after.delta(&self.before?), wall: self.started.elapsed() })
    }
}

/// The `stat` file of the block device holding `dir`, if sysfs has one.
fn disk_stat_file(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir).ok()?.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let path = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
    path.exists().then_some(path)
}

fn fmt_qd(view: Option<DeviceView>, write: bool) -> String {
    view.map_or("-".into(), |v| format!("{:.1}", v.queue(write)))
}

/// Demotion (write-back) result of one configuration.
struct Demotion {
    config: Config,
    put_secs: f64,
    demote_secs: f64,
    /// Record bytes written by the time every dataset object was on SSD.
    device_bytes: u64,
    filler_keys: u64,
    ssd_bytes: u64,
    device: Option<DeviceView>,
    fio: Option<FioResult>,
    notes: String,
}

impl Demotion {
    fn value_gbps(&self) -> f64 {
        (self.config.keys * self.config.value_bytes) as f64 / 1e9 / self.demote_secs
    }

    fn device_gbps(&self) -> f64 {
        self.device_bytes as f64 / 1e9 / self.demote_secs
    }
}

/// Restore result of one configuration and key order, summed over its rounds.
#[derive(Default)]
struct Restore {
    config: Option<Config>,
    order: Option<KeyOrder>,
    elapsed: Duration,
    reads: u64,
    value_bytes: u64,
    failures: u64,
    wrong_bytes: u64,
    batch_hist: Histogram,
    loads: u64,
    device_bytes: u64,
    ssd_write_bytes: u64,
    restore_waits: u64,
    sub_batches: u64,
    credit_waits: u64,
    shard_cpu: CpuUse,
    caller_cpu: CpuUse,
    host: HostCpu,
    device: Option<DeviceView>,
    /// Per round: kvtide device GB/s, fio GB/s.
    rounds: Vec<(f64, Option<f64>)>,
    fio: Option<FioResult>,
    first_error: Option<String>,
}

impl Restore {
    fn config(&self) -> Config {
        self.config.unwrap_or_default()
    }

    fn order(&self) -> KeyOrder {
        self.order.unwrap_or(KeyOrder::Seq)
    }

    fn value_gbps(&self) -> f64 {
        self.value_bytes as f64 / 1e9 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn device_gbps(&self) -> f64 {
        self.device_bytes as f64 / 1e9 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn objects_per_sec(&self) -> f64 {
        self.reads as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Share of the reads that went to SSD (the rest were DRAM hits).
    fn ssd_share(&self) -> f64 {
        if self.reads == 0 {
            0.0
        } else {
            self.loads as f64 / self.reads as f64
        }
    }
}

/// What fio reported (averaged over rounds).
#[derive(Clone, Copy, Debug)]
struct FioResult {
    bytes_per_sec: f64,
    iops: f64,
    mean_lat_us: f64,
    device: Option<DeviceView>,
}

impl FioResult {
    fn gbps(&self) -> f64 {
        self.bytes_per_sec / 1e9
    }

    /// The mean of equally long runs.
    fn mean(runs: &[FioResult]) -> Option<FioResult> {
        let n = runs.len() as f64;
        let first = runs.first()?;
        let mut device = first.device;
        for r in &runs[1..] {
            match (&mut device, r.device) {
                (Some(d), Some(v)) => d.add(&v),
                _ => device = None,
            }
        }
        Some(FioResult {
            bytes_per_sec: runs.iter().map(|r| r.bytes_per_sec).sum::<f64>() / n,
            iops: runs.iter().map(|r| r.iops).sum::<f64>() / n,
            mean_lat_us: runs.iter().map(|r| r.mean_lat_us).sum::<f64>() / n,
            device,
        })
    }
}

fn ratio(a: f64, b: Option<f64>) -> String {
    match b {
        Some(b) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

fn key_of(prefix: &str, index: u64) -> Vec<u8> {
    format!("kvtide-bench/{prefix}/{index:010}").into_bytes()
}

fn record_bytes(key_len: usize, value_bytes: u64) -> u64 {
    (RECORD_HEADER_BYTES + key_len as u64 + value_bytes).div_ceil(RECORD_ALIGN_BYTES) * RECORD_ALIGN_BYTES
}

/// Runs `kvtide-bench ssd`.
pub fn run(args: &SsdArgs) -> Result<(), String> {
    if args.value_bytes.is_empty() || args.qd.is_empty() || args.shards.is_empty() || args.order.is_empty() {
        return Err("--value-bytes, --qd, --shards and --order need at least one value each".into());
    }
    if args.value_bytes.iter().any(|&v| v < 8) || args.qd.contains(&0) || args.shards.contains(&0) {
        return Err("value sizes must be at least 8 bytes; queue depths and shard counts positive".into());
    }
    if args.threads == 0 || args.batch == Some(0) || args.duration_secs <= 0.0 || args.rounds == 0 {
        return Err("--threads, --batch, --rounds and --duration-secs must be positive".into());
    }
    if !args.skip_fio {
        let version = Command::new(&args.fio)
            .arg("--version")
            .output()
            .map_err(|e| format!("{}: {e} (install it: apt-get install -y fio, or pass --skip-fio)", args.fio))?;
        eprintln!("using {}", String::from_utf8_lossy(&version.stdout).trim());
    }
    std::fs::create_dir_all(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;

    let key_len = key_of("data", 0).len();
    let mut configs = Vec::new();
    for &value_bytes in &args.value_bytes {
        for &shards in &args.shards {
            for &qd in &args.qd {
                let record = record_bytes(key_len, value_bytes);
                configs.push(Config {
                    value_bytes,
                    shards,
                    qd,
                    batch: args.batch.unwrap_or(qd),
                    record_bytes: record,
                    keys: (args.dataset_bytes / value_bytes).max(1),
                    fio_bs: args.fio_bs.unwrap_or(record),
                });
            }
        }
    }
    let example = builder(args, &configs[0], &args.dir, 1 << 30)?;
    println!(
        "## ssd: dataset {} per configuration, DRAM pool {}, {} caller threads, {} x {} s per order and system \
         (interleaved kvtide, fio; +{} s warm-up), dir {}",
        fmt_bytes(args.dataset_bytes),
        fmt_bytes(args.dram_bytes),
        args.threads,
        args.rounds,
        args.duration_secs,
        args.warmup_secs,
        args.dir.display()
    );
    println!(
        "kvtide: io_uring O_DIRECT ReadFixed/WriteFixed, restore budget = qd records per shard, promote_on_hit=false, \
         write-back demotion, eviction lru, {}; restore pipeline {} (sub-batch {} / {} keys, ahead {}, staging {}); \
         fio: io_uring, direct=1, fixedbufs, bs = record size, iodepth = qd, numjobs = shards",
        if args.no_pin { "unpinned" } else { "pinned shards" },
        if example.restore.pipeline { "on" } else { "off" },
        fmt_bytes(example.restore.sub_batch_bytes),
        example.restore.sub_batch_keys,
        example.restore.ahead_bytes.map_or_else(|| "budget".to_string(), fmt_bytes),
        example.restore.staging_bytes.map_or_else(|| format!("{} (dram/4)", fmt_bytes(args.dram_bytes / 4)), fmt_bytes),
    );

    let mut demotions = Vec::new();
    let mut restores = Vec::new();
    let bar = crate::util::steps(configs.len() as u64, "ssd: configurations");
    for config in &configs {
        bar.set_message(config.label());
        let (demotion, runs) = run_config(args, config)?;
        demotions.push(demotion);
        restores.extend(runs);
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_tables(args, &demotions, &restores);
    Ok(())
}

/// The store's settings for `config` (flags win over `KVTIDE_*` variables).
fn builder(args: &SsdArgs, config: &Config, dir: &Path, ssd_bytes: u64) -> Result<StoreBuilder, String> {
    let mut b = StoreBuilder::new()
        .with_env()
        .map_err(|e| format!("KVTIDE_* variables: {e}"))?
        .dram_bytes(args.dram_bytes)
        .shards(config.shards)
        .pin_threads(!args.no_pin)
        .eviction(EvictionPolicy::Lru)
        .ssd_dir(dir)
        .ssd_bytes(ssd_bytes)
        .ssd_segment_bytes(args.segment_bytes)
        .restore_budget_bytes(config.qd as u64 * config.record_bytes)
        .promote_on_hit(false)
        .write_through(false);
    if let Some(on) = args.restore_pipeline {
        b = b.restore_pipeline(on);
    }
    if let Some(bytes) = args.sub_batch_bytes {
        b = b.restore_sub_batch_bytes(bytes);
    }
    if let Some(keys) = args.sub_batch_keys {
        b = b.restore_sub_batch_keys(keys);
    }
    if let Some(bytes) = args.ahead_bytes {
        b = b.restore_ahead_bytes(bytes);
    }
    if let Some(bytes) = args.staging_bytes {
        b = b.restore_staging_bytes(bytes);
    }
    Ok(b)
}

/// Puts `keys` (indices from a shared cursor) from `threads` threads; the value's first and last
/// 8 bytes hold the key index. Returns the first error.
fn put_all(store: &Engine, prefix: &str, keys: u64, value_bytes: u64, threads: usize) -> Result<(), String> {
    let cursor = AtomicU64::new(0);
    let first_error: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (cursor, first_error) = (&cursor, &first_error);
            let spawned = std::thread::Builder::new().name(format!("ssd-put-{t}")).spawn_scoped(scope, move || {
                let mut value = vec![0x5Au8 ^ t as u8; value_bytes as usize];
                loop {
                    let i = cursor.fetch_add(1, Ordering::Relaxed);
                    if i >= keys {
                        break;
                    }
                    stamp(&mut value, i);
                    if let Err(e) = store.put(&key_of(prefix, i), &value, PutOptions::INSERT) {
                        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert_with(|| format!("put {prefix} {i}: {e}"));
                        cursor.store(keys, Ordering::Relaxed);
                        break;
                    }
                }
            });
            if let Err(e) = spawned {
                let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                slot.get_or_insert_with(|| format!("spawn: {e}"));
            }
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn stamp(value: &mut [u8], index: u64) {
    let tag = index.to_le_bytes();
    let n = value.len();
    value[..8].copy_from_slice(&tag);
    value[n - 8..].copy_from_slice(&tag);
}

fn stamped(value: &[u8], index: u64) -> bool {
    let tag = index.to_le_bytes();
    value.len() >= 8 && value[..8] == tag && value[value.len() - 8..] == tag
}

/// Polls `stats()` (every 0.5 ms) until `done` holds; returns that snapshot and the moment.
fn poll_until(store: &Engine, what: &str, done: impl Fn(&Stats) -> bool) -> Result<(Stats, Instant), String> {
    let start = Instant::now();
    loop {
        let stats = store.stats();
        if done(&stats) {
            return Ok((stats, Instant::now()));
        }
        if start.elapsed() > SETTLE_TIMEOUT {
            let s = stats.total;
            return Err(format!(
                "{what}: not done after {SETTLE_TIMEOUT:?} (ssd_objects {}, demotions {}, dram_objects {}, \
                 ssd_evictions {})",
                s.ssd_objects, s.demotions, s.dram_objects, s.ssd_evictions
            ));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

fn default_ssd_bytes(args: &SsdArgs, config: &Config, filler_keys: u64) -> u64 {
    let records = (config.keys + filler_keys) * config.record_bytes;
    let per_shard = (records as f64 * 1.1 / config.shards as f64) as u64 + 2 * args.segment_bytes;
    let per_shard = per_shard.div_ceil(args.segment_bytes) * args.segment_bytes;
    per_shard * config.shards as u64
}

/// One configuration: a fresh store (populate, demotion, restores) and, interleaved with it, fio
/// on a file next to it.
fn run_config(args: &SsdArgs, config: &Config) -> Result<(Demotion, Vec<Restore>), String> {
    let dir = args.dir.join(format!("kvtide-{}", config.file_stem()));
    let fio_file = args.dir.join(format!("fio-{}.dat", config.file_stem()));
    remove_path(&dir)?;
    remove_path(&fio_file)?;
    let disk = disk_stat_file(&args.dir);
    // A DRAM pool's worth of filler pushes the last dataset objects out (LRU order).
    let filler_keys = args.dram_bytes.div_ceil(config.value_bytes) + config.shards as u64;
    let ssd_bytes = args.ssd_bytes.unwrap_or_else(|| default_ssd_bytes(args, config, filler_keys));
    eprintln!(
        "[{}] kvtide: {} keys of {} (records {} B), SSD tier {} in {}",
        config.label(),
        config.keys,
        fmt_bytes(config.value_bytes),
        config.record_bytes,
        fmt_bytes(ssd_bytes),
        dir.display()
    );
    let store =
        builder(args, config, &dir, ssd_bytes)?.open().map_err(|e| format!("open kvtide in {}: {e}", dir.display()))?;

    // Demotion: first put -> every dataset object on SSD.
    let probe = DeviceProbe::start(disk.as_deref());
    let host_before = HostCpu::now();
    let start = Instant::now();
    put_all(&store, "data", config.keys, config.value_bytes, args.threads)?;
    let put_secs = start.elapsed().as_secs_f64();
    put_all(&store, "fill", filler_keys, config.value_bytes, args.threads)?;
    let keys = config.keys;
    let (at_done, done_at) = poll_until(&store, "demotion", |s| s.total.ssd_objects >= keys)?;
    let demote_secs = (done_at - start).as_secs_f64();
    let device = probe.finish();
    let host = HostCpu::now().delta(&host_before);
    settle(&store)?;
    let settled = store.stats().total;
    let notes = format!(
        "puts {:.2} s, filler {} keys; settled: {} demotions, {} on SSD ({}), {} in DRAM, {} syncs, \
         {} SSD evictions, {} io errors, fixed buffers {}; kvtide {}; {}",
        put_secs,
        filler_keys,
        settled.demotions,
        settled.ssd_objects,
        fmt_bytes(settled.ssd_bytes),
        settled.dram_objects,
        settled.syncs,
        settled.ssd_evictions,
        settled.io_errors,
        if settled.fixed_buffers_registered { "registered" } else { "NOT registered" },
        device.map_or("-".into(), |d| d.describe(true)),
        host.describe(),
    );
    if settled.ssd_evictions > 0 {
        eprintln!(
            "[{}] warning: {} objects left the SSD tier (it is too small; pass a larger --ssd-bytes)",
            config.label(),
            settled.ssd_evictions
        );
    }
    let mut demotion = Demotion {
        config: *config,
        put_secs,
        demote_secs,
        device_bytes: at_done.total.ssd_write_bytes,
        filler_keys,
        ssd_bytes,
        device,
        fio: None,
        notes,
    };
    eprintln!("[{}] demotion: {:.2} GB/s of values in {:.2} s", config.label(), demotion.value_gbps(), demote_secs);

    let fio = (!args.skip_fio).then(|| Fio::new(args, config, fio_file.clone(), disk.clone()));
    if let Some(fio) = &fio {
        let write = fio.write()?;
        eprintln!("[{}] fio write: {:.2} GB/s", config.label(), write.gbps());
        demotion.fio = Some(write);
    }

    let mut runs = Vec::new();
    for &order in &args.order {
        let mut indices: Vec<u64> = (0..config.keys).collect();
        if order == KeyOrder::Rand {
            indices.shuffle(&mut SmallRng::seed_from_u64(args.seed));
        }
        if args.warmup_secs > 0.0 {
            read_for(&store, config, &indices, args.threads, Duration::from_secs_f64(args.warmup_secs));
            settle(&store)?;
        }
        let mut run = Restore { config: Some(*config), order: Some(order), ..Restore::default() };
        let mut fio_runs = Vec::new();
        for _ in 0..args.rounds {
            let round = restore_round(&store, config, &indices, args, disk.as_deref());
            merge_round(&mut run, &round);
            let fio_round = fio.as_ref().map(|f| f.read(order)).transpose()?;
            run.rounds.push((round.device_gbps(), fio_round.map(|f| f.gbps())));
            fio_runs.extend(fio_round);
            settle(&store)?;
        }
        run.fio = FioResult::mean(&fio_runs);
        if let Some(e) = &run.first_error {
            eprintln!("[{}] {}: first read error: {e}", config.label(), order.name());
        }
        eprintln!(
            "[{}] restore {}: kvtide {:.2} GB/s of values, {:.2} GB/s from the device; fio {}",
            config.label(),
            order.name(),
            run.value_gbps(),
            run.device_gbps(),
            run.fio.map_or("-".into(), |f| format!("{:.2} GB/s", f.gbps()))
        );
        runs.push(run);
    }
    drop(store);
    if !args.keep {
        remove_path(&dir)?;
        remove_path(&fio_file)?;
    }
    Ok((demotion, runs))
}

/// One timed restore round (the stats, CPU and device deltas around `read_for`).
fn restore_round(store: &Engine, config: &Config, indices: &[u64], args: &SsdArgs, disk: Option<&Path>) -> Restore {
    let before = store.stats();
    let shard_before = cpu_of_threads("kvtide-shard");
    let host_before = HostCpu::now();
    let probe = DeviceProbe::start(disk);
    let tally = read_for(store, config, indices, args.threads, Duration::from_secs_f64(args.duration_secs));
    let device = probe.finish();
    let host = HostCpu::now().delta(&host_before);
    let shard_cpu = cpu_of_threads("kvtide-shard").delta(&shard_before);
    let after = store.stats();
    let (b, a) = (&before.total, &after.total);
    Restore {
        config: Some(*config),
        order: None,
        elapsed: tally.elapsed,
        reads: tally.reads,
        value_bytes: tally.bytes,
        failures: tally.failures,
        wrong_bytes: tally.wrong,
        batch_hist: tally.hist,
        loads: a.loads - b.loads,
        device_bytes: a.ssd_read_bytes - b.ssd_read_bytes,
        ssd_write_bytes: a.ssd_write_bytes - b.ssd_write_bytes,
        restore_waits: a.restore_waits - b.restore_waits,
        sub_batches: after.restore.sub_batches - before.restore.sub_batches,
        credit_waits: after.restore.credit_waits - before.restore.credit_waits,
        shard_cpu,
        caller_cpu: tally.cpu,
        host,
        device,
        rounds: Vec::new(),
        fio: None,
        first_error: tally.first_error,
    }
}

fn merge_round(run: &mut Restore, round: &Restore) {
    run.elapsed += round.elapsed;
    run.reads += round.reads;
    run.value_bytes += round.value_bytes;
    run.failures += round.failures;
    run.wrong_bytes += round.wrong_bytes;
    run.batch_hist.merge(&round.batch_hist);
    run.loads += round.loads;
    run.device_bytes += round.device_bytes;
    run.ssd_write_bytes += round.ssd_write_bytes;
    run.restore_waits += round.restore_waits;
    run.sub_batches += round.sub_batches;
    run.credit_waits += round.credit_waits;
    run.shard_cpu.add(&round.shard_cpu);
    run.shard_cpu.threads = round.shard_cpu.threads;
    run.caller_cpu.add(&round.caller_cpu);
    run.caller_cpu.threads = round.caller_cpu.threads;
    run.host.add(&round.host);
    match (&mut run.device, round.device) {
        (Some(d), Some(v)) => d.add(&v),
        (None, Some(v)) if run.rounds.is_empty() => run.device = Some(v),
        _ => {}
    }
    if run.first_error.is_none() {
        run.first_error.clone_from(&round.first_error);
    }
}

/// What the reader threads counted.
struct ReadTally {
    elapsed: Duration,
    reads: u64,
    bytes: u64,
    failures: u64,
    wrong: u64,
    hist: Histogram,
    first_error: Option<String>,
    /// CPU use of the reader threads.
    cpu: CpuUse,
}

impl ReadTally {
    fn new() -> ReadTally {
        ReadTally {
            elapsed: Duration::ZERO,
            reads: 0,
            bytes: 0,
            failures: 0,
            wrong: 0,
            hist: Histogram::default(),
            first_error: None,
            cpu: CpuUse::default(),
        }
    }
}

/// Reads batches of `config.batch` keys, in `indices` order (a shared cursor, wrapping), from
/// `threads` threads until `duration` has passed; each thread's destinations are one buffer of
/// `batch` values, faulted in before the clock starts.
fn read_for(store: &Engine, config: &Config, indices: &[u64], threads: usize, duration: Duration) -> ReadTally {
    let keys: Vec<Vec<u8>> = indices.iter().map(|&i| key_of("data", i)).collect();
    let cursor = AtomicU64::new(0);
    let value_bytes = config.value_bytes as usize;
    let batch = config.batch;
    let buffers: Vec<Vec<u8>> = (0..threads).map(|_| vec![1u8; batch * value_bytes]).collect();
    let start = Instant::now();
    let deadline = start + duration;
    let tallies: Vec<ReadTally> = std::thread::scope(|scope| {
        let workers: Vec<_> = buffers
            .into_iter()
            .enumerate()
            .map(|(t, mut buf)| {
                let (keys, cursor) = (&keys, &cursor);
                std::thread::Builder::new()
                    .name(format!("ssd-read-{t}"))
                    .spawn_scoped(scope, move || {
                        let mut tally = ReadTally::new();
                        let cpu_start = cpu_of_task(Path::new("/proc/thread-self"));
                        let n = keys.len() as u64;
                        while Instant::now() < deadline {
                            let first = cursor.fetch_add(batch as u64, Ordering::Relaxed);
                            let slots: Vec<usize> = (0..batch as u64).map(|j| ((first + j) % n) as usize).collect();
                            let batch_keys: Vec<&[u8]> = slots.iter().map(|&s| keys[s].as_slice()).collect();
                            let dsts: Vec<Vec<Region<'_>>> =
                                buf.chunks_mut(value_bytes).map(|chunk| vec![Region::host(chunk)]).collect();
                            let t0 = Instant::now();
                            let results = store.batch_get_into_multi_buffers(&batch_keys, &dsts);
                            tally.hist.record(t0.elapsed().as_nanos() as u64);
                            drop(dsts);
                            for ((result, &slot), chunk) in results.iter().zip(&slots).zip(buf.chunks(value_bytes)) {
                                tally.reads += 1;
                                match result {
                                    Ok(got) => {
                                        tally.bytes += *got as u64;
                                        if !stamped(chunk, indices[slot]) {
                                            tally.wrong += 1;
                                        }
                                    }
                                    Err(e) => {
                                        tally.failures += 1;
                                        tally.first_error.get_or_insert_with(|| e.to_string());
                                    }
                                }
                            }
                        }
                        tally.cpu = cpu_of_task(Path::new("/proc/thread-self")).delta(&cpu_start);
                        tally
                    })
                    .expect("spawn reader thread")
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("reader thread panicked")).collect()
    });
    let mut total = ReadTally { elapsed: start.elapsed(), ..ReadTally::new() };
    for t in tallies {
        total.cpu.add(&t.cpu);
        total.reads += t.reads;
        total.bytes += t.bytes;
        total.failures += t.failures;
        total.wrong += t.wrong;
        total.hist.merge(&t.hist);
        if total.first_error.is_none() {
            total.first_error = t.first_error;
        }
    }
    total
}

fn remove_path(path: &Path) -> Result<(), String> {
    let result = if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
    match result {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("remove {}: {e}", path.display())),
    }
}

/// fio over one file in the data directory: `numjobs` = shards, each on its own region of
/// `per_job` bytes (like each shard's own segment files), `iodepth` = qd, `bs` = record size.
struct Fio<'a> {
    args: &'a SsdArgs,
    config: Config,
    file: PathBuf,
    disk: Option<PathBuf>,
    per_job: u64,
}

impl<'a> Fio<'a> {
    fn new(args: &'a SsdArgs, config: &Config, file: PathBuf, disk: Option<PathBuf>) -> Fio<'a> {
        let bs = config.fio_bs;
        let per_job = ((config.keys * config.record_bytes / config.shards as u64) / bs).max(1) * bs;
        Fio { args, config: *config, file, disk, per_job }
    }

    fn common(&self, name: &str, rw: &str) -> Vec<String> {
        let c = &self.config;
        vec![
            format!("--name={name}"),
            format!("--filename={}", self.file.display()),
            "--ioengine=io_uring".into(),
            "--direct=1".into(),
            "--fixedbufs=1".into(),
            format!("--rw={rw}"),
            format!("--bs={}", c.fio_bs),
            format!("--iodepth={}", c.qd),
            format!("--numjobs={}", c.shards),
            format!("--size={}", self.per_job),
            format!("--offset_increment={}", self.per_job),
            format!("--randseed={}", self.args.seed),
            "--group_reporting".into(),
            "--output-format=json".into(),
        ]
    }

    /// One sequential pass over a fresh file (which the reads then use).
    fn write(&self) -> Result<FioResult, String> {
        remove_path(&self.file)?;
        eprintln!(
            "[{}] fio: bs {} B, iodepth {}, {} job(s) of {} on {}",
            self.config.label(),
            self.config.fio_bs,
            self.config.qd,
            self.config.shards,
            fmt_bytes(self.per_job),
            self.file.display()
        );
        fio_job(&self.args.fio, self.common("kvtide-write", "write"), "write", self.disk.as_deref())
    }

    /// `read` or `randread` for `--duration-secs` (after `--warmup-secs` of ramp).
    fn read(&self, order: KeyOrder) -> Result<FioResult, String> {
        let mut job = self.common(&format!("kvtide-{}", order.fio_rw()), order.fio_rw());
        job.push("--time_based".into());
        job.push(format!("--runtime={}ms", (self.args.duration_secs * 1000.0) as u64));
        if self.args.warmup_secs > 0.0 {
            job.push(format!("--ramp_time={}ms", (self.args.warmup_secs.min(1.0) * 1000.0) as u64));
        }
        fio_job(&self.args.fio, job, "read", self.disk.as_deref())
    }
}

/// Runs one fio job and reads `direction` ("read" or "write") from its JSON report.
fn fio_job(fio: &str, job: Vec<String>, direction: &str, disk: Option<&Path>) -> Result<FioResult, String> {
    let probe = DeviceProbe::start(disk);
    let output = Command::new(fio).args(&job).output().map_err(|e| format!("{fio}: {e}"))?;
    let device = probe.finish();
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "fio {} failed ({}): {}{}",
            job.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            text.trim()
        ));
    }
    let json = text.find('{').map(|i| &text[i..]).ok_or_else(|| format!("fio printed no JSON: {text}"))?;
    let section = json_section(json, direction).ok_or_else(|| format!("fio JSON has no \"{direction}\" section"))?;
    let number = |name: &str| json_number(section, name).ok_or_else(|| format!("fio JSON: no {direction}.{name}"));
    let bytes_per_sec = number("bw_bytes")?;
    let iops = number("iops")?;
    let mean_lat_us = json_section(section, "lat_ns").and_then(|lat| json_number(lat, "mean")).unwrap_or(0.0) / 1000.0;
    Ok(FioResult { bytes_per_sec, iops, mean_lat_us, device })
}

/// The text after the first `"name" :` whose value is an object (enough for fio's report,
/// where each job's "read" and "write" objects come in that order).
fn json_section<'a>(json: &'a str, name: &str) -> Option<&'a str> {
    let quoted = format!("\"{name}\"");
    let mut from = 0;
    while let Some(i) = json[from..].find(&quoted) {
        let rest = json[from + i + quoted.len()..].trim_start();
        if let Some(value) = rest.strip_prefix(':') {
            let value = value.trim_start();
            if value.starts_with('{') {
                return Some(value);
            }
        }
        from += i + quoted.len();
    }
    None
}

/// The first number-valued `"name" : N` in `json`.
fn json_number(json: &str, name: &str) -> Option<f64> {
    let quoted = format!("\"{name}\"");
    let mut from = 0;
    while let Some(i) = json[from..].find(&quoted) {
        let rest = json[from + i + quoted.len()..].trim_start();
        if let Some(value) = rest.strip_prefix(':') {
            let value = value.trim_start();
            let end = value.find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')));
            if let Ok(n) = value[..end.unwrap_or(value.len())].parse::<f64>() {
                return Some(n);
            }
        }
        from += i + quoted.len();
    }
    None
}

fn print_tables(args: &SsdArgs, demotions: &[Demotion], restores: &[Restore]) {
    println!();
    println!("### restore (SSD -> host buffers)");
    println!();
    println!(
        "| value | order | shards | QD | batch | kvtide GB/s (values) | kvtide GB/s (device) | objects/s | \
         batch p50 ms | batch p99 ms | SSD share | dev QD | fio bs | fio GB/s | fio IOPS | fio dev QD | \
         kvtide/fio (device) | kvtide/fio (values) |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in restores {
        let c = r.config();
        let fio = r.fio.map(|f| f.gbps());
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {:.3} | {} | {} | {} | {} | {} | {} | {} |",
            fmt_bytes(c.value_bytes),
            r.order().name(),
            c.shards,
            c.qd,
            c.batch,
            r.value_gbps(),
            r.device_gbps(),
            r.objects_per_sec(),
            r.batch_hist.quantile_us(0.5) / 1000.0,
            r.batch_hist.quantile_us(0.99) / 1000.0,
            r.ssd_share(),
            fmt_qd(r.device, false),
            c.fio_bs,
            fio.map_or("-".into(), |g| format!("{g:.2}")),
            r.fio.map_or("-".into(), |f| format!("{:.0}", f.iops)),
            fmt_qd(r.fio.and_then(|f| f.device), false),
            ratio(r.device_gbps(), fio),
            ratio(r.value_gbps(), fio),
        );
    }
    println!();
    println!("### demotion (write-back on eviction: first put -> every dataset object on SSD) vs fio sequential write");
    println!();
    println!(
        "| value | shards | objects | dataset | time s | kvtide GB/s (values) | kvtide GB/s (device) | dev QD | \
         fio bs | fio iodepth x jobs | fio write GB/s | fio dev QD | kvtide/fio (device) | kvtide/fio (values) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for d in demotions {
        let c = &d.config;
        let fio = d.fio.map(|f| f.gbps());
        println!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} x {} | {} | {} | {} | {} |",
            fmt_bytes(c.value_bytes),
            c.shards,
            c.keys,
            fmt_bytes(c.keys * c.value_bytes),
            d.demote_secs,
            d.value_gbps(),
            d.device_gbps(),
            fmt_qd(d.device, true),
            c.fio_bs,
            c.qd,
            c.shards,
            fio.map_or("-".into(), |g| format!("{g:.2}")),
            fmt_qd(d.fio.and_then(|f| f.device), true),
            ratio(d.device_gbps(), fio),
            ratio(d.value_gbps(), fio),
        );
    }
    println!();
    for d in demotions {
        println!(
            "- {} demotion (SSD tier {}): {}{}",
            d.config.label(),
            fmt_bytes(d.ssd_bytes),
            d.notes,
            d.fio.and_then(|f| f.device).map_or(String::new(), |v| format!("; fio {}", v.describe(true)))
        );
    }
    for r in restores {
        let rounds: Vec<String> = r
            .rounds
            .iter()
            .map(|&(k, f)| match f {
                Some(f) if f > 0.0 => format!("{k:.2}/{f:.2}={:.2}", k / f),
                _ => format!("{k:.2}"),
            })
            .collect();
        println!(
            "- {} {}: {} reads, {} loads, {} failed, {} wrong, {} restore waits, {} sub-batches, {} credit waits, \
             {} written to SSD meanwhile; kvtide {}; shard threads {}; callers {}; {}{}; rounds (kvtide/fio device \
             GB/s) {}",
            r.config().label(),
            r.order().name(),
            r.reads,
            r.loads,
            r.failures,
            r.wrong_bytes,
            r.restore_waits,
            r.sub_batches,
            r.credit_waits,
            fmt_bytes(r.ssd_write_bytes),
            r.device.map_or("-".into(), |v| v.describe(false)),
            r.shard_cpu.describe(r.elapsed),
            r.caller_cpu.describe(r.elapsed),
            r.host.describe(),
            r.fio.map_or(String::new(), |f| format!(
                "; fio {}, mean latency {:.1} ms",
                f.device.map_or("-".into(), |v| v.describe(false)),
                f.mean_lat_us / 1000.0
            )),
            rounds.join(" "),
        );
    }
    if args.json {
        for r in restores {
            let c = r.config();
            println!(
                "{{\"bench\":\"ssd\",\"kind\":\"restore\",\"value_bytes\":{},\"record_bytes\":{},\"order\":{},\
                 \"shards\":{},\"qd\":{},\"batch\":{},\"threads\":{},\"keys\":{},\"rounds\":{},\"duration_secs\":{:.3},\
                 \"reads\":{},\"loads\":{},\"failures\":{},\"wrong\":{},\"value_gb_per_sec\":{:.4},\
                 \"device_gb_per_sec\":{:.4},\"objects_per_sec\":{:.1},\"batch_p50_us\":{:.1},\
                 \"batch_p99_us\":{:.1},\"ssd_share\":{:.4},\"restore_waits\":{},\"sub_batches\":{},\
                 \"credit_waits\":{},\"device_qd\":{},\"fio_device_qd\":{},\"fio_bs\":{},\"fio_gb_per_sec\":{},\
                 \"fio_iops\":{},\"ratio_device\":{},\"ratio_values\":{},\"seed\":{}}}",
                c.value_bytes,
                c.record_bytes,
                json_str(r.order().name()),
                c.shards,
                c.qd,
                c.batch,
                args.threads,
                c.keys,
                r.rounds.len(),
                r.elapsed.as_secs_f64(),
                r.reads,
                r.loads,
                r.failures,
                r.wrong_bytes,
                r.value_gbps(),
                r.device_gbps(),
                r.objects_per_sec(),
                r.batch_hist.quantile_us(0.5),
                r.batch_hist.quantile_us(0.99),
                r.ssd_share(),
                r.restore_waits,
                r.sub_batches,
                r.credit_waits,
                json_opt(r.device.map(|v| v.queue(false))),
                json_opt(r.fio.and_then(|f| f.device).map(|v| v.queue(false))),
                c.fio_bs,
                json_opt(r.fio.map(|f| f.gbps())),
                json_opt(r.fio.map(|f| f.iops)),
                json_opt(r.fio.map(|f| r.device_gbps() / f.gbps())),
                json_opt(r.fio.map(|f| r.value_gbps() / f.gbps())),
                args.seed,
            );
        }
        for d in demotions {
            let c = &d.config;
            println!(
                "{{\"bench\":\"ssd\",\"kind\":\"demotion\",\"value_bytes\":{},\"record_bytes\":{},\"shards\":{},\
                 \"qd\":{},\"threads\":{},\"keys\":{},\"filler_keys\":{},\"ssd_bytes\":{},\"put_secs\":{:.3},\
                 \"demote_secs\":{:.3},\"value_gb_per_sec\":{:.4},\"device_gb_per_sec\":{:.4},\"device_qd\":{},\
                 \"fio_device_qd\":{},\"fio_bs\":{},\"fio_write_gb_per_sec\":{},\"ratio_device\":{},\
                 \"ratio_values\":{}}}",
                c.value_bytes,
                c.record_bytes,
                c.shards,
                c.qd,
                args.threads,
                c.keys,
                d.filler_keys,
                d.ssd_bytes,
                d.put_secs,
                d.demote_secs,
                d.value_gbps(),
                d.device_gbps(),
                json_opt(d.device.map(|v| v.queue(true))),
                json_opt(d.fio.and_then(|f| f.device).map(|v| v.queue(true))),
                c.fio_bs,
                json_opt(d.fio.map(|f| f.gbps())),
                json_opt(d.fio.map(|f| d.device_gbps() / f.gbps())),
                json_opt(d.fio.map(|f| d.value_gbps() / f.gbps())),
            );
        }
    }
}

fn json_opt(value: Option<f64>) -> String {
    match value {
        Some(v) if v.is_finite() => format!("{v:.4}"),
        _ => "null".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_sizes() {
        let key = key_of("data", 0).len();
        assert_eq!(record_bytes(key, 1 << 20), (1 << 20) + 4096);
        assert_eq!(record_bytes(key, 64 << 10), 68 << 10);
    }

    #[test]
    fn fio_json() {
        let text = r#"{ "jobs" : [ { "jobname" : "x", "read" : { "io_bytes" : 10, "bw_bytes" : 1500, "iops" : 2.5,
            "lat_ns" : { "min" : 1, "mean" : 4000.0 } }, "write" : { "bw_bytes" : 7, "iops" : 0.000000 } } ],
            "disk_util" : [ { "read_ios" : 3 } ] }"#;
        let read = json_section(text, "read").expect("read");
        assert_eq!(json_number(read, "bw_bytes"), Some(1500.0));
        assert_eq!(json_number(read, "iops"), Some(2.5));
        assert_eq!(json_section(read, "lat_ns").and_then(|l| json_number(l, "mean")), Some(4000.0));
        let write = json_section(text, "write").expect("write");
        assert_eq!(json_number(write, "bw_bytes"), Some(7.0));
        assert!(stamped(
            &{
                let mut v = vec![0u8; 64];
                stamp(&mut v, 9);
                v
            },
            9
        ));
        assert_eq!(parse_order("random"), Ok(KeyOrder::Rand));
    }
}
