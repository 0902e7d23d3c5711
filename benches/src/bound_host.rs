//! `bound-host`: the host time of stream-bound reads, with the GPU taken out. The store's
//! stream-bound calls run against a stream transport that enqueues nothing (every submission is
//! complete at once), so what is timed is the engine's own work per call: checking, leasing,
//! waiting for the grants, planning the copies, and handing the watch to a shard.
//!
//! The shape is a paged KV step: `--layers` layers of `--pages` objects, each object read as two
//! fragments (K and V halves) into a shuffled page of its layer's buffer, as
//! `python/bench/paged_reads.py` reads it on a GPU. Forms, in the same run:
//! - `layerwise`: one `get_into_ranges_on_stream` per layer;
//! - `step`: one `step_on_stream` of every layer (ranges);
//! - baseline `exists`: one `batch_exists` of the same keys per layer, the least a call that
//!   reaches every key's shard can cost (one round trip, no lease, no plan).
//!
//! Reported per layer call (median of `--reps`), and per key. No GPU is needed; the figures
//! are the host's share of a stream-bound read on this CPU.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::transport::{Direction, EarlyStart, Gate, InFlight, StreamSubmit, Transfer, TransportError};
use kvtide::{
    Engine, Fragment, MemoryKind, PutOptions, Region, StepLayer, StepReads, Store, StoreBuilder, StreamHandle,
    StreamSignal, Transport,
};

use crate::restore::NullTransfer;
use crate::util::{fmt_bytes, parse_size, shuffled_slots};

/// The "GPU" the null transport claims the destinations are on.
const ORDINAL: u32 = 0;
/// Any nonzero handle: the null transport accepts every stream.
const STREAM: StreamHandle = 0x5EED;

/// Arguments of `kvtide-bench bound-host`.
#[derive(clap::Args, Debug, Clone)]
pub struct BoundHostArgs {
    /// Layers of the step.
    #[arg(long, default_value_t = 16)]
    pub layers: usize,
    /// Objects (pages) per layer.
    #[arg(long, default_value_t = 512)]
    pub pages: usize,
    /// Bytes of one object (two fragments of half each).
    #[arg(long, default_value = "128KiB", value_parser = parse_size)]
    pub object_bytes: u64,
    /// Shards of the store.
    #[arg(long, value_delimiter = ',', default_values_t = [4usize, 1])]
    pub shards: Vec<usize>,
    /// Measured repetitions (after one warm-up).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
}

struct NullGate;

impl Gate for NullGate {
    fn open(&self, _ok: bool) {}
    fn state(&self) -> Option<bool> {
        Some(true)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A stream transport that enqueues nothing: each submission is complete when made. It notes
/// when the first submission of a call came (how long the GPU would have waited for work).
#[derive(Default)]
struct NullStream {
    first_submit: std::sync::Mutex<Option<Instant>>,
}

impl NullStream {
    fn take_first_submit(&self) -> Option<Instant> {
        self.first_submit.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl Transport for NullStream {
    fn name(&self) -> &'static str {
        "null-stream"
    }
    fn completes_inline(&self) -> bool {
        true
    }
    /// Every destination passes (the CUDA transport's check is a range lookup per region).
    fn check(&self, lists: &[&[Region<'_>]], _writable: bool) -> Vec<Option<TransportError>> {
        vec![None; lists.len()]
    }
    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        // SAFETY: it moves nothing.
        unsafe { NullTransfer.submit(direction, transfers, early) }
    }
    fn on_stream(&self) -> Option<&dyn StreamSubmit> {
        Some(self)
    }
}

impl StreamSubmit for NullStream {
    fn check_stream(&self, _stream: StreamHandle) -> Result<u32, TransportError> {
        Ok(ORDINAL)
    }
    fn gate(&self, _ordinal: u32) -> Result<Arc<dyn Gate>, TransportError> {
        Ok(Arc::new(NullGate))
    }
    fn prepare(&self, _ordinal: u32) -> Result<(), TransportError> {
        Ok(())
    }
    unsafe fn submit_on_stream(
        &self,
        _stream: StreamHandle,
        transfers: &[Transfer],
        _gates: &[Option<Arc<dyn Gate>>],
    ) -> Result<InFlight, TransportError> {
        self.first_submit.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(Instant::now);
        // SAFETY: it moves nothing.
        unsafe { NullTransfer.submit(Direction::HostToDevice, transfers, None) }
    }
    unsafe fn signal(&self, _stream: StreamHandle, _signal: StreamSignal) -> Result<(), TransportError> {
        Ok(())
    }
}

pub fn run(args: &BoundHostArgs) -> Result<(), String> {
    if args.layers == 0 || args.pages == 0 || args.object_bytes < 2 {
        return Err("layers, pages and object bytes (at least 2) must not be empty".into());
    }
    let half = args.object_bytes / 2;
    let (layers, pages) = (args.layers, args.pages);
    let total = layers as u64 * pages as u64 * args.object_bytes;
    println!(
        "bound-host: {layers} layers x {pages} objects of {} as 2 fragments ({} in all), null stream",
        fmt_bytes(args.object_bytes),
        fmt_bytes(total)
    );
    // One "device" buffer per layer (never written: the null stream copies nothing).
    let buffers: Vec<Vec<u8>> = (0..layers).map(|_| vec![0u8; 2 * pages * half as usize]).collect();
    let regions: Vec<Region<'static>> = buffers
        .iter()
        .map(|b| {
            // SAFETY: the buffers outlive every call below, and the null stream writes nothing.
            unsafe { Region::from_raw(b.as_ptr() as u64, b.len(), MemoryKind::Device { ordinal: ORDINAL }) }
        })
        .collect();
    let block_of: Vec<u64> = shuffled_slots(pages as u64, 1);
    let keys: Vec<Vec<Vec<u8>>> =
        (0..layers).map(|l| (0..pages).map(|p| format!("paged/L{l}/p{p}").into_bytes()).collect()).collect();
    let fragments: Vec<Vec<Fragment>> = (0..layers)
        .map(|l| {
            (0..pages)
                .flat_map(|p| {
                    let key = &keys[l][p];
                    let b = block_of[p];
                    [
                        Fragment::new(key.clone(), 0, b * half, half),
                        Fragment::new(key.clone(), half, (pages as u64 + b) * half, half),
                    ]
                })
                .collect()
        })
        .collect();
    let null = Arc::new(NullStream::default());
    let transport: Arc<dyn Transport> = Arc::clone(&null) as Arc<dyn Transport>;
    let value = vec![0x5Au8; args.object_bytes as usize];
    println!(
        "{:>6} {:>10} {:>12} {:>10} {:>12} {:>10} {:>10}",
        "shards", "form", "us/layer", "ns/object", "ratio", "p10", "p90"
    );
    for &shards in &args.shards {
        let engine: Engine = StoreBuilder::new()
            .dram_bytes(total + (total / 4).max(64 << 20))
            .shards(shards)
            .pin_threads(false)
            .open()
            .map_err(|e| format!("open the store: {e}"))?;
        for layer in &keys {
            for key in layer {
                engine.put(key, &value, PutOptions::UPSERT).map_err(|e| format!("put: {e}"))?;
            }
        }
        let exists = time_reps(args.reps, || {
            let t0 = Instant::now();
            for layer in &keys {
                let refs: Vec<&[u8]> = layer.iter().map(Vec::as_slice).collect();
                let found = engine.batch_exists(&refs);
                assert!(found.iter().all(|r| matches!(r, Ok(true))), "a key is missing");
            }
            t0.elapsed()
        });
        let layerwise = time_reps(args.reps, || {
            let mut tickets = Vec::with_capacity(layers);
            let t0 = Instant::now();
            for l in 0..layers {
                // SAFETY: the buffers outlive the tickets (each is waited for below).
                let ticket = unsafe {
                    engine.get_into_ranges_on_stream_via(
                        std::slice::from_ref(&regions[l]),
                        std::slice::from_ref(&fragments[l]),
                        STREAM,
                        Some(Arc::clone(&transport)),
                    )
                }
                .expect("layer read");
                tickets.push(ticket);
            }
            let took = t0.elapsed();
            for t in tickets {
                let results = t.wait(Duration::from_secs(10)).expect("the watch ended");
                assert!(results.iter().all(|r| r.as_ref().is_ok_and(|&n| n as u64 == half)), "a fragment failed");
            }
            took
        });
        let mut first_us: Vec<f64> = Vec::new();
        null.take_first_submit();
        let step = time_reps(args.reps, || {
            let step_layers: Vec<StepLayer<'_, '_>> = (0..layers)
                .map(|l| StepLayer {
                    reads: StepReads::Ranges {
                        buffers: std::slice::from_ref(&regions[l]),
                        fragments: std::slice::from_ref(&fragments[l]),
                    },
                    done: None,
                })
                .collect();
            let t0 = Instant::now();
            // SAFETY: as above.
            let ticket = unsafe { engine.step_on_stream_via(&step_layers, STREAM, Some(Arc::clone(&transport))) }
                .expect("step read");
            let took = t0.elapsed();
            if let Some(first) = null.take_first_submit() {
                first_us.push(first.duration_since(t0).as_secs_f64() * 1e6);
            }
            let results = ticket.wait(Duration::from_secs(10)).expect("the watch ended");
            assert!(results.iter().all(|r| r.as_ref().is_ok_and(|&n| n as u64 == half)), "a fragment failed");
            took
        });
        first_us.remove(0); // the warm-up's
        let base = median(&exists);
        for (name, times) in [("exists", &exists), ("layerwise", &layerwise), ("step", &step)] {
            let per_layer = median(times) / layers as f64;
            println!(
                "{:>6} {:>10} {:>12.1} {:>10.0} {:>12.2} {:>10.1} {:>10.1}",
                shards,
                name,
                per_layer,
                per_layer * 1000.0 / pages as f64,
                median(times) / base,
                quantile(times, 0.1) / layers as f64,
                quantile(times, 0.9) / layers as f64,
            );
        }
        println!(
            "{:>6} {:>10} first layer enqueued after {:.1} us of the step call's {:.1} (medians)",
            shards,
            "step",
            median(&first_us),
            median(&step)
        );
    }
    println!("us/layer: host time of the form's calls for the whole step, per layer (median); ratio: against exists");
    Ok(())
}

/// Microseconds of each of `reps` runs of `f` (the time it reports), after one warm-up run.
fn time_reps(reps: usize, mut f: impl FnMut() -> Duration) -> Vec<f64> {
    f();
    (0..reps.max(1)).map(|_| f().as_secs_f64() * 1e6).collect()
}

fn median(v: &[f64]) -> f64 {
    quantile(v, 0.5)
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}
