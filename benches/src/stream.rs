//! `stream`: chunk handles against whole-object reads, and a producer -> consumer pipeline
//! against put-then-get.
//!
//! Per object size and source (DRAM-resident, SSD-resident, DRAM-resident through an owner over
//! loopback TCP):
//! - whole: `get_into` of the object into a host buffer (the baseline);
//! - progressive: `progressive_get` of the same object into the same buffer, timing the first
//!   chunk's `wait_chunk` and `wait_all`;
//! - the first-chunk target's parts, measured in the same run: one chunk's transfer
//!   (`get_into_ranges` of a chunk-sized range of the object; from SSD, `get_into` of a
//!   chunk-sized SSD-resident object, a load of one chunk's bytes) and the call's fixed cost (a
//!   `progressive_get` of a 4 KiB object, to its last chunk).
//!
//! Pipeline (DRAM): a producer writes `--pipeline-bytes` in chunks at `--produce-gbps` (it sleeps
//! what generating a chunk would take) and a consumer spends `--consume-us` per chunk.
//! Pipelined: `progressive_put` + a reader that follows it with `progressive_get_unsealed` and
//! consumes each chunk as it lands. Baseline in the same run: put-then-get (produce every chunk
//! into a `progressive_put`, seal, then `get_into` and consume every chunk).
//!
//! Every delivered byte is checked against the value after each run. Peak chunks in flight and
//! peak bytes leased by the handles come from `Stats::stream`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::{Engine, Fragment, PutOptions, Region, Store, StoreBuilder};

use crate::util::{fmt_bytes, parse_size, stamped as value};

/// Filler object size (what pushes the measured objects out of DRAM).
const FILLER_BYTES: u64 = 64 << 20;

/// Arguments of `kvtide-bench stream`.
#[derive(clap::Args, Debug, Clone)]
pub struct StreamArgs {
    /// Object sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values = ["64MiB", "256MiB", "1GiB"], value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Chunk size of the progressive reads.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    pub chunk_bytes: u64,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Sources (comma-separated): dram, ssd, owner-tcp (DRAM-resident, through an owner in
    /// this process over loopback TCP).
    #[arg(long, value_delimiter = ',', default_values = ["dram", "ssd"])]
    pub sources: Vec<String>,
    /// SSD tier directory (removed at the end).
    #[arg(long, default_value = "/work/kvtide-stream-bench")]
    pub dir: PathBuf,
    /// Shards.
    #[arg(long, default_value_t = 2)]
    pub shards: usize,
    /// Pipeline object size (0 skips the pipeline).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub pipeline_bytes: u64,
    /// Pipeline chunk size.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    pub pipeline_chunk_bytes: u64,
    /// Producer rate (GB/s, 1e9 bytes/s).
    #[arg(long, default_value_t = 2.0)]
    pub produce_gbps: f64,
    /// Consumer time per chunk (microseconds).
    #[arg(long, default_value_t = 1500)]
    pub consume_us: u64,
    /// Only time host copies of each size (one memcpy, chunked memcpy, chunked non-temporal)
    /// and exit.
    #[arg(long)]
    pub copy_probe: bool,
    /// Also read into GPU memory (feature `cuda`), sweeping these `[stream] window_chunks`
    /// values (comma-separated; empty: no GPU run).
    #[arg(long, value_delimiter = ',')]
    pub gpu_windows: Vec<usize>,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn open(args: &StreamArgs, dram_bytes: u64, ssd: bool) -> Result<Engine, String> {
    let mut b = StoreBuilder::new()
        .dram_bytes(dram_bytes)
        .shards(args.shards)
        .pin_threads(false)
        .promote_on_hit(false)
        .eviction(kvtide::EvictionPolicy::Lru);
    if ssd {
        let _ = std::fs::remove_dir_all(&args.dir);
        let biggest = args.sizes.iter().copied().max().unwrap_or(0);
        b = b
            .ssd_dir(&args.dir)
            // Every shard's segments hold the biggest record, with room to spare.
            .ssd_bytes((4 * dram_bytes).max(args.shards as u64 * 8 * (biggest + (8 << 20))))
            .ssd_segment_bytes((biggest + (8 << 20)).max(64 << 20));
    }
    b.open().map_err(|e| e.to_string())
}

/// A buffer the store writes into through a `'static` region, reused across runs.
struct Dst {
    ptr: *mut u8,
    len: usize,
}

impl Dst {
    fn new(len: usize) -> Dst {
        let buf: &'static mut [u8] = Box::leak(vec![1u8; len].into_boxed_slice());
        Dst { ptr: buf.as_mut_ptr(), len }
    }

    fn region(&self) -> Region<'static> {
        // SAFETY: the buffer is leaked (lives for the process) and the benchmark never touches it
        // while a transfer into it runs (each run waits for all its chunks first).
        unsafe { Region::from_raw(self.ptr as u64, self.len, kvtide::MemoryKind::Host) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: as above; read only between runs.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// The reads the benchmark times, on the embedded engine and through the owner: the object API
/// they share, plus each one's `progressive_get`.
trait Reads: Store {
    /// (time to chunk 0, time to the last chunk).
    fn progressive(&self, key: &[u8], dst: Region<'static>, chunk_bytes: u64) -> Result<(Duration, Duration), String>;

    fn whole(&self, key: &[u8], dst: Region<'static>) -> Result<(), String> {
        self.get_into(key, dst).map(drop).map_err(|e| format!("get_into: {e}"))
    }

    fn one_range(&self, key: &[u8], dst: Region<'static>, len: u64) -> Result<(), String> {
        let r = self.get_into_ranges(&[dst], &[vec![Fragment::new(key.to_vec(), 0, 0, len)]]);
        r[0][0].as_ref().map(drop).map_err(|e| format!("one chunk: {e}"))
    }
}

fn time_handle<E: Clone + std::fmt::Display + From<kvtide::Error>>(
    started: Instant,
    h: Result<kvtide::ChunkHandle<E>, E>,
) -> Result<(Duration, Duration), String> {
    let h = h.map_err(|e| format!("progressive_get: {e}"))?;
    h.wait_chunk(0).map_err(|e| format!("chunk 0: {e}"))?;
    let first = started.elapsed();
    h.wait_all().map_err(|e| format!("progressive: {e}"))?;
    Ok((first, started.elapsed()))
}

impl Reads for Engine {
    fn progressive(&self, key: &[u8], dst: Region<'static>, chunk_bytes: u64) -> Result<(Duration, Duration), String> {
        time_handle(Instant::now(), self.progressive_get(key, dst, chunk_bytes))
    }
}

impl Reads for kvtide_remote::RemoteStore {
    fn progressive(&self, key: &[u8], dst: Region<'static>, chunk_bytes: u64) -> Result<(Duration, Duration), String> {
        time_handle(Instant::now(), self.progressive_get(key, dst, chunk_bytes))
    }
}

struct ReadResult {
    whole: Duration,
    first: Duration,
    last: Duration,
    chunk: Duration,
    fixed: Duration,
}

/// `chunk_key`: an object of one chunk's size resting where `key` does (SSD), whose whole read
/// is one chunk's transfer; without it, a range of one chunk of `key` is.
fn measure_reads<S: Reads>(
    args: &StreamArgs,
    store: &S,
    key: &[u8],
    chunk_key: Option<&[u8]>,
    len: u64,
    expect: &[u8],
    dst: &Dst,
) -> Result<ReadResult, String> {
    let chunk = args.chunk_bytes.min(len);
    let (mut whole, mut first, mut last, mut one, mut fixed) = (vec![], vec![], vec![], vec![], vec![]);
    let small = Dst::new(4096);
    for rep in 0..=args.reps {
        let t = Instant::now();
        store.whole(key, dst.region())?;
        let w = t.elapsed();
        if dst.bytes()[..len as usize] != *expect {
            return Err("get_into delivered wrong bytes".into());
        }
        let (f, l) = store.progressive(key, dst.region(), args.chunk_bytes)?;
        if dst.bytes()[..len as usize] != *expect {
            return Err("progressive_get delivered wrong bytes".into());
        }
        let t = Instant::now();
        match chunk_key {
            Some(chunk_key) => store.whole(chunk_key, dst.region())?,
            None => store.one_range(key, dst.region(), chunk)?,
        }
        let c = t.elapsed();
        let (_, x) = store.progressive(b"stream/fixed", small.region(), args.chunk_bytes)?;
        if rep > 0 {
            whole.push(w);
            first.push(f);
            last.push(l);
            one.push(c);
            fixed.push(x);
        }
    }
    Ok(ReadResult {
        whole: median(whole),
        first: median(first),
        last: median(last),
        chunk: median(one),
        fixed: median(fixed),
    })
}

fn wait_demoted(store: &Engine, keys: &[Vec<u8>]) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        store.sync_shards().map_err(|e| e.to_string())?;
        let s = store.stats().total;
        if s.ssd_objects as usize >= keys.len() && s.writes_in_flight == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("objects did not reach the SSD: {s:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn run(args: &StreamArgs) -> Result<(), String> {
    if args.reps == 0 || args.chunk_bytes == 0 {
        return Err("--reps and --chunk-bytes must be positive".into());
    }
    if args.copy_probe {
        copy_probe(args);
        return Ok(());
    }
    println!(
        "## stream: chunk {} , {} reps (median), {} shards, {} CPUs",
        fmt_bytes(args.chunk_bytes),
        args.reps,
        args.shards,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!("| source | object | whole get_into ms | first chunk ms | last chunk ms | one chunk's transfer ms | fixed cost ms | first / (chunk + fixed) | last / whole | peak chunks in flight | peak leased |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let bar = crate::util::steps((args.sources.len() * args.sizes.len()) as u64, "stream: sources x sizes");
    for source in &args.sources {
        let (ssd, owner_tcp) = match source.as_str() {
            "dram" => (false, false),
            "ssd" => (true, false),
            "owner-tcp" => (false, true),
            other => return Err(format!("unknown source {other:?} (dram, ssd, owner-tcp)")),
        };
        for &len in &args.sizes {
            bar.inc(1);
            bar.set_message(format!("{source} {}", fmt_bytes(len)));
            // Every shard can hold the object twice over.
            let dram_bytes = (2 * len * args.shards as u64).max(512 << 20);
            let mut store = open(args, dram_bytes, ssd)?;
            let key = format!("stream/{len}").into_bytes();
            let expect = value(len, len);
            store.put(&key, &expect, PutOptions::INSERT).map_err(|e| format!("put: {e}"))?;
            store.put(b"stream/fixed", &[7u8; 4096], PutOptions::INSERT.pinned()).map_err(|e| e.to_string())?;
            // From SSD, one chunk's transfer is the load of a chunk-sized object.
            let chunk_key = ssd.then(|| b"stream/one-chunk".to_vec());
            if let Some(k) = &chunk_key {
                let one = value(args.chunk_bytes.min(len), 5);
                store.put(k, &one, PutOptions::INSERT).map_err(|e| format!("put: {e}"))?;
            }
            if ssd {
                // Fill DRAM until the object is demoted, then drop the filler.
                let filler = value(FILLER_BYTES, 3);
                let n = (dram_bytes * 5 / 4 / FILLER_BYTES) as usize;
                let fillers: Vec<Vec<u8>> = (0..n).map(|i| format!("filler/{i}").into_bytes()).collect();
                for f in &fillers {
                    store.put(f, &filler, PutOptions::INSERT).map_err(|e| format!("filler: {e}"))?;
                }
                let measured: Vec<Vec<u8>> = std::iter::once(key.clone()).chain(chunk_key.clone()).collect();
                wait_demoted(&store, &measured)?;
                for f in &fillers {
                    let _ = store.remove(f, true);
                }
            }
            let dst = Dst::new(len as usize);
            let r = if owner_tcp {
                // An owner in this process on loopback TCP; the reads go through `RemoteStore`.
                let engine = Arc::new(store);
                let config = kvtide_remote::OwnerConfig {
                    tcp: Some("127.0.0.1:0".parse().map_err(|e| format!("{e}"))?),
                    allow_unauthenticated_loopback: true,
                    ..kvtide_remote::OwnerConfig::default()
                };
                let owner = kvtide_remote::Owner::start(Arc::clone(&engine), config).map_err(|e| e.to_string())?;
                let addr = owner.tcp_addr().ok_or("no tcp address")?;
                let client = kvtide_remote::RemoteStore::connect_with(
                    &addr.to_string(),
                    kvtide_remote::ClientOptions { timeout_ms: 60_000, ..kvtide_remote::ClientOptions::default() },
                )
                .map_err(|e| e.to_string())?;
                let r = measure_reads(args, &client, &key, None, len, &expect, &dst)?;
                drop(client);
                owner.shutdown();
                drop(owner);
                store = Arc::into_inner(engine).ok_or("the owner still holds the engine")?;
                r
            } else {
                measure_reads(args, &store, &key, chunk_key.as_deref(), len, &expect, &dst)?
            };
            let s = store.stats().stream;
            println!(
                "| {source} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.2} | {:.3} | {} | {} |",
                fmt_bytes(len),
                ms(r.whole),
                ms(r.first),
                ms(r.last),
                ms(r.chunk),
                ms(r.fixed),
                r.first.as_secs_f64() / (r.chunk + r.fixed).as_secs_f64(),
                r.last.as_secs_f64() / r.whole.as_secs_f64(),
                s.peak_chunks_in_flight,
                fmt_bytes(s.peak_leased_bytes),
            );
            if ssd && store.stats().total.loads == 0 {
                return Err("no read came from the SSD".into());
            }
            drop(store);
            if ssd {
                let _ = std::fs::remove_dir_all(&args.dir);
            }
        }
    }
    if !args.gpu_windows.is_empty() {
        gpu_windows(args)?;
    }
    if args.pipeline_bytes > 0 {
        pipeline(args)?;
    }
    Ok(())
}

/// DRAM-resident objects into GPU memory: `progressive_get` per window size against a whole
/// `get_into` and one raw pinned copy of a chunk (the transfer part of the first-chunk target).
#[cfg(feature = "cuda")]
fn gpu_windows(args: &StreamArgs) -> Result<(), String> {
    use kvtide::cuda::CudaTransport;
    let device = CudaTransport::get().and_then(|t| t.device(0)).map_err(|e| e.to_string())?;
    println!();
    println!("GPU (direct copies), chunk {}:", fmt_bytes(args.chunk_bytes));
    println!();
    println!("| object | window | whole get_into ms | first chunk ms | last chunk ms | last / whole | peak chunks in flight |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for &len in &args.sizes {
        let pool = device.alloc(len as usize).map_err(|e| e.to_string())?;
        // SAFETY: inside a live device allocation that outlives every call using it.
        let region =
            || unsafe { Region::from_raw(pool.addr(), len as usize, kvtide::MemoryKind::Device { ordinal: 0 }) };
        let expect = value(len, len ^ 5);
        for &window in &args.gpu_windows {
            let store = StoreBuilder::new()
                .dram_bytes((2 * len * args.shards as u64).max(512 << 20))
                .shards(args.shards)
                .pin_threads(false)
                .stream_window_chunks(window)
                .open()
                .map_err(|e| e.to_string())?;
            store.put(b"gpu", &expect, PutOptions::INSERT).map_err(|e| e.to_string())?;
            let (mut whole, mut first, mut last) = (vec![], vec![], vec![]);
            for rep in 0..=args.reps {
                let t = Instant::now();
                store.get_into(b"gpu", region()).map_err(|e| format!("get_into: {e}"))?;
                let w = t.elapsed();
                let t = Instant::now();
                let h = store.progressive_get(b"gpu", region(), args.chunk_bytes).map_err(|e| e.to_string())?;
                h.wait_chunk(0).map_err(|e| e.to_string())?;
                let f = t.elapsed();
                h.wait_all().map_err(|e| e.to_string())?;
                let l = t.elapsed();
                if rep > 0 {
                    whole.push(w);
                    first.push(f);
                    last.push(l);
                }
            }
            let mut back = vec![0u8; len as usize];
            pool.read(0, &mut back).map_err(|e| e.to_string())?;
            if back != expect {
                return Err("GPU progressive_get delivered wrong bytes".into());
            }
            let (w, f, l) = (median(whole), median(first), median(last));
            println!(
                "| {} | {window} | {:.2} | {:.3} | {:.2} | {:.3} | {} |",
                fmt_bytes(len),
                ms(w),
                ms(f),
                ms(l),
                l.as_secs_f64() / w.as_secs_f64(),
                store.stats().stream.peak_chunks_in_flight
            );
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn gpu_windows(_: &StreamArgs) -> Result<(), String> {
    Err("--gpu-windows needs a build with --features kvtide-benches/cuda".into())
}

fn pipeline(args: &StreamArgs) -> Result<(), String> {
    let len = args.pipeline_bytes;
    let chunk = args.pipeline_chunk_bytes.min(len).max(1);
    let b = StoreBuilder::new()
        .dram_bytes((2 * len * args.shards as u64).max(512 << 20))
        .shards(args.shards)
        .pin_threads(false)
        .unsealed_bytes_per_shard(2 * len);
    let store = Arc::new(b.open().map_err(|e| e.to_string())?);
    let expect = value(len, 77);
    let n = len.div_ceil(chunk) as usize;
    let produce_per_chunk = Duration::from_secs_f64(chunk as f64 / (args.produce_gbps * 1e9));
    let consume_per_chunk = Duration::from_micros(args.consume_us);
    let dst = Dst::new(len as usize);
    let produce = |put: &kvtide::PutStream<'_>| -> Result<(), String> {
        let mut next = Instant::now();
        for i in 0..n {
            next += produce_per_chunk;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            let r = put.chunk_range(i).ok_or("chunk range")?;
            put.put_chunk(i, Region::host_readonly(&expect[r.start as usize..r.end as usize]))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    let (mut baseline, mut pipelined, mut transfer) = (vec![], vec![], vec![]);
    for rep in 0..=args.reps {
        // Put then get.
        let key = format!("pipe/base/{rep}").into_bytes();
        let t = Instant::now();
        let mut put = store.progressive_put(&key, len, chunk, PutOptions::INSERT).map_err(|e| e.to_string())?;
        produce(&put)?;
        put.seal().map_err(|e| e.to_string())?;
        drop(put);
        let g = Instant::now();
        store.get_into(&key, dst.region()).map_err(|e| e.to_string())?;
        let tr = g.elapsed();
        for _ in 0..n {
            std::thread::sleep(consume_per_chunk);
        }
        let b = t.elapsed();
        if dst.bytes() != &expect[..] {
            return Err("put-then-get delivered wrong bytes".into());
        }
        let _ = store.remove(&key, true);
        // Pipelined.
        let key = format!("pipe/stream/{rep}").into_bytes();
        let t = Instant::now();
        let mut put = store.progressive_put(&key, len, chunk, PutOptions::INSERT).map_err(|e| e.to_string())?;
        let h = store.progressive_get_unsealed(&key, dst.region(), chunk).map_err(|e| e.to_string())?;
        let consumed = std::thread::scope(|s| -> Result<(), String> {
            let consumer = s.spawn(|| -> Result<(), String> {
                for i in 0..h.num_chunks() {
                    h.wait_chunk(i).map_err(|e| e.to_string())?;
                    std::thread::sleep(consume_per_chunk);
                }
                Ok(())
            });
            produce(&put)?;
            put.seal().map_err(|e| e.to_string())?;
            consumer.join().map_err(|_| "consumer panicked".to_string())?
        });
        consumed?;
        let p = t.elapsed();
        drop(h);
        drop(put);
        if dst.bytes() != &expect[..] {
            return Err("the pipeline delivered wrong bytes".into());
        }
        let _ = store.remove(&key, true);
        if rep > 0 {
            baseline.push(b);
            pipelined.push(p);
            transfer.push(tr);
        }
    }
    let (b, p, tr) = (median(baseline), median(pipelined), median(transfer));
    let produce_all = produce_per_chunk * n as u32;
    let consume_all = consume_per_chunk * n as u32;
    let bound = produce_all.max(consume_all).max(tr);
    let one_chunk = produce_per_chunk.max(consume_per_chunk) + tr / n as u32;
    println!();
    println!(
        "Pipeline: {} in {} chunks of {}, producer {:.2} GB/s ({:.2} ms), consumer {} us per chunk ({:.2} ms), transfer (get_into) {:.2} ms",
        fmt_bytes(len),
        n,
        fmt_bytes(chunk),
        args.produce_gbps,
        ms(produce_all),
        args.consume_us,
        ms(consume_all),
        ms(tr)
    );
    println!();
    println!("| mode | end to end ms | / (max(produce, transfer, consume) + one chunk) |");
    println!("|---|---:|---:|");
    println!("| put then get (baseline) | {:.2} | {:.2} |", ms(b), b.as_secs_f64() / (bound + one_chunk).as_secs_f64());
    println!(
        "| progressive put + follow | {:.2} | {:.2} |",
        ms(p),
        p.as_secs_f64() / (bound + one_chunk).as_secs_f64()
    );
    println!();
    println!("pipelined / put-then-get: {:.2}", p.as_secs_f64() / b.as_secs_f64());
    Ok(())
}

/// Host copy speeds: one memcpy of the whole size, the same bytes as chunk-sized memcpys, and as
/// chunk-sized non-temporal copies (GB/s, median of the reps).
fn copy_probe(args: &StreamArgs) {
    println!(
        "| bytes | one memcpy GB/s | {} memcpys GB/s | {} non-temporal GB/s |",
        fmt_bytes(args.chunk_bytes),
        fmt_bytes(args.chunk_bytes)
    );
    println!("|---|---:|---:|---:|");
    for &len in &args.sizes {
        let src = value(len, 1);
        let mut dst = vec![0u8; len as usize];
        let chunk = args.chunk_bytes as usize;
        let gbps = |d: Duration| len as f64 / d.as_secs_f64() / 1e9;
        let (mut one, mut plain, mut nt) = (vec![], vec![], vec![]);
        for _ in 0..=args.reps {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            one.push(t.elapsed());
            let t = Instant::now();
            for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                d.copy_from_slice(s);
            }
            plain.push(t.elapsed());
            let t = Instant::now();
            for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                // SAFETY: two distinct vectors' chunks of equal length.
                unsafe { kvtide::transport::memcpy::copy_nontemporal(d.as_mut_ptr(), s.as_ptr(), d.len()) };
            }
            nt.push(t.elapsed());
        }
        assert!(dst == src, "the probe copies are exact");
        println!(
            "| {} | {:.2} | {:.2} | {:.2} |",
            fmt_bytes(len),
            gbps(median(one)),
            gbps(median(plain)),
            gbps(median(nt))
        );
    }
}
