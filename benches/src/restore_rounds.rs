//! `restore-rounds`: the disk-bound side of `gpu-restore` without a GPU. One SSD-resident batch
//! (files, O_DIRECT, io_uring) restored into host buffers through a modeled link that copies
//! nothing and takes `bytes / --link-gbps` plus `--submit-us` per submission (a GPU link: about
//! 35 GB/s in bulk, 0.3 ms per staged submission), barrier against pipelined at each
//! `--ahead-bytes`. The modes run in rounds, one of each per round, each round starting one mode
//! later, and each pipelined variant is reported as the median over rounds of its time / the
//! barrier's in the same round, where the disk's drift between rounds cancels.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::transport::{Direction, EarlyStart, InFlight, Summary, Transfer, TransportError};
use kvtide::{PutOptions, Region, RestoreMode, RestoreOptions, Store, Transport};

use crate::restore::{demoting_store, push_to_ssd, wait_until};
use crate::util::{fmt_bytes, parse_size};

/// Arguments of `kvtide-bench restore-rounds`.
#[derive(clap::Args, Debug, Clone)]
pub struct RestoreRoundsArgs {
    /// Object sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values = ["384KiB", "4MiB"], value_parser = parse_size)]
    pub object_bytes: Vec<u64>,
    /// Value bytes per request (whole objects).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub batch_bytes: u64,
    /// Rounds after a warm-up round.
    #[arg(long, default_value_t = 21)]
    pub rounds: usize,
    /// Modeled link speed in GB/s (1e9 bytes/s).
    #[arg(long, default_value_t = 35.0)]
    pub link_gbps: f64,
    /// Modeled fixed cost per submission, in microseconds.
    #[arg(long, default_value_t = 300)]
    pub submit_us: u64,
    /// Pipelined variants: bytes per shard one request keeps requested ahead (comma-separated).
    #[arg(long, value_delimiter = ',', default_values = ["64MiB", "128MiB"], value_parser = parse_size)]
    pub ahead_bytes: Vec<u64>,
    /// Shards.
    #[arg(long, default_value_t = 4)]
    pub shards: usize,
    /// DRAM pool.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub dram_bytes: u64,
    /// Data directory (removed at the end).
    #[arg(long, default_value = "/var/tmp/kvtide-restore-rounds")]
    pub dir: PathBuf,
}

/// A link that moves nothing but takes the time the modeled one would: the caller's thread
/// spins (or sleeps, for long transfers) for `submit + bytes / rate`.
struct ModeledLink {
    bytes_per_sec: f64,
    submit: Duration,
}

impl Transport for ModeledLink {
    fn name(&self) -> &'static str {
        "modeled-link"
    }

    fn completes_inline(&self) -> bool {
        true
    }

    unsafe fn submit(
        &self,
        _direction: Direction,
        transfers: &[Transfer],
        _early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        let bytes: u64 = transfers.iter().map(Transfer::bytes).sum();
        wait_until(Instant::now() + self.submit + Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec));
        Ok(InFlight::completed(vec![Ok(()); transfers.len()], Summary::default()))
    }
}

/// Runs the benchmark.
pub fn run(args: &RestoreRoundsArgs) -> Result<(), String> {
    if args.rounds == 0 || args.link_gbps <= 0.0 || args.object_bytes.contains(&0) || args.ahead_bytes.contains(&0) {
        return Err("--rounds, --link-gbps, object sizes and --ahead-bytes must be positive".into());
    }
    println!(
        "## restore-rounds: {} per request, {} shards, link {} GB/s + {} us per submission (copies nothing), \
         {} rounds after a warm-up; SSD files in {}",
        fmt_bytes(args.batch_bytes),
        args.shards,
        args.link_gbps,
        args.submit_us,
        args.rounds,
        args.dir.display()
    );
    println!(
        "\n| object | barrier median | pipelined (ahead) median | pipelined / barrier, paired | pipelined <= barrier in rounds |"
    );
    println!("|---|---:|---:|---:|---:|");
    for &object_bytes in &args.object_bytes {
        run_size(args, object_bytes)?;
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}

fn run_size(args: &RestoreRoundsArgs, object_bytes: u64) -> Result<(), String> {
    let objects = (args.batch_bytes / object_bytes).max(1) as usize;
    let total = objects as u64 * object_bytes;
    let (builder, filler_keys) = demoting_store(args.dram_bytes, args.shards, object_bytes, total);
    let dir = args.dir.join(format!("store-{object_bytes}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let store = builder.ssd_dir(&dir).open().map_err(|e| format!("open: {e}"))?;
    let keys: Vec<Vec<u8>> = (0..objects).map(|o| format!("restore-rounds/{o}").into_bytes()).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let value = vec![0x5Au8; object_bytes as usize];
    for (o, key) in keys.iter().enumerate() {
        store.put(key, &value, PutOptions::INSERT).map_err(|e| format!("put {o}: {e}"))?;
    }
    push_to_ssd(&store, objects as u64, filler_keys)?;
    let mut sink: Vec<Vec<u8>> = (0..objects).map(|_| vec![0u8; object_bytes as usize]).collect();
    let dsts: Vec<Vec<Region<'_>>> = sink.iter_mut().map(|b| vec![Region::host(b.as_mut_slice())]).collect();
    let link: Arc<dyn Transport> =
        Arc::new(ModeledLink { bytes_per_sec: args.link_gbps * 1e9, submit: Duration::from_micros(args.submit_us) });
    // Mode 0 is the barrier; mode 1 + v the pipelined restore with ahead_bytes[v].
    let modes = 1 + args.ahead_bytes.len();
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(args.rounds); modes];
    for round in 0..=args.rounds {
        for m in (0..modes).map(|i| (i + round) % modes) {
            let mut opts = RestoreOptions { host_transport: Some(Arc::clone(&link)), ..store.restore_options() };
            if m == 0 {
                opts.mode = RestoreMode::Barrier;
            } else {
                opts.mode = RestoreMode::Pipelined;
                opts.ahead_bytes = args.ahead_bytes[m - 1];
            }
            let started = Instant::now();
            let report = store.restore_batch(&key_refs, &dsts, &opts);
            let took = started.elapsed().as_secs_f64() * 1e3;
            if let Some(Err(e)) = report.results.iter().find(|r| r.is_err()) {
                return Err(format!("[{}] restore: {e}", fmt_bytes(object_bytes)));
            }
            if round > 0 {
                samples[m].push(took);
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (v, &ahead) in args.ahead_bytes.iter().enumerate() {
        let pipelined = &samples[v + 1];
        let ratios: Vec<f64> = pipelined.iter().zip(&samples[0]).map(|(p, b)| p / b).collect();
        let wins = ratios.iter().filter(|&&r| r <= 1.0).count();
        println!(
            "| {} | {:.1} ms | {:.1} ms ({}) | {:.3} | {wins} of {} |",
            fmt_bytes(object_bytes),
            median(&samples[0]),
            median(pipelined),
            fmt_bytes(ahead),
            median(&ratios),
            ratios.len()
        );
    }
    drop(dsts);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
