//! `layerwise`: one inference step of `--layers` layers, each waiting for its KV, as a layerwise
//! pipeline runs it (feature `cuda`). Each layer's KV is `--keys-per-layer` objects scattered
//! over shuffled `--page-bytes` pages of that layer's device region; each layer's compute is one
//! kernel that runs for a set time (`--compute-ratio` x the measured per-layer load time).
//!
//! Modes, in the same run, for DRAM- and SSD-resident KV:
//! - serial: a blocking `batch_get_into_multi_buffers` per layer, then its compute, waited for;
//! - host-overlapped: one async ticket per layer submitted up front; the host waits for layer
//!   i's ticket before launching layer i's compute;
//! - stream-bound + graph: `batch_get_into_multi_buffers_on_stream` per layer on a load stream,
//!   an event recorded after each, then ONE launch of a graph captured once whose layers wait on
//!   those events (external event waits) before their compute;
//! - stream-bound + graph, flags: the graph (captured once; each layer waits for a flag word to
//!   be 1, computes, and sets it back to 0) is launched first, then each layer's read is
//!   enqueued with a `cuStreamWriteValue32` of its flag behind it, so the host's enqueueing
//!   overlaps the GPU's work;
//! - step + graph (`step`, `step_flg`): the same two, with every layer's read and its event
//!   record (or flag write) in ONE `step_on_stream` call (every lease request sent at once);
//!   `step_us` is that call's host time per layer.
//!
//! Each is reported against ideal = first load + sum over layers of max(load, compute), with
//! load the per-layer share of all layers' stream-bound loads back to back (load-only) and
//! compute the measured kernel time; and against load-only + one compute (the floor when the
//! loads are the limit). Every figure is the median of `--reps` runs, host wall clock from the
//! first call to the last compute done. The KV bytes are checked once per configuration.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::cuda::{CudaDevice, CudaEvent, CudaStream, CudaTransport, DeviceBuffer};
use kvtide::{Engine, MemoryKind, PutOptions, Region, StepLayer, StepReads, Store, StoreBuilder, StreamSignal};

use crate::util::{fmt_bytes, json_str, parse_size, stamped};

/// Arguments of `kvtide-bench layerwise`.
#[derive(clap::Args, Debug, Clone)]
pub struct LayerwiseArgs {
    /// Layers per step.
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// KV bytes per layer (comma-separated sizes).
    #[arg(long, value_delimiter = ',', default_values = ["1MiB", "4MiB", "16MiB"], value_parser = parse_size)]
    pub layer_bytes: Vec<u64>,
    /// Objects per layer.
    #[arg(long, default_value_t = 4)]
    pub keys_per_layer: usize,
    /// Page size the objects are scattered over.
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    pub page_bytes: u64,
    /// Compute per layer as a multiple of the measured per-layer load time (comma-separated).
    #[arg(long, value_delimiter = ',', default_values = ["1.0"])]
    pub compute_ratio: Vec<f64>,
    /// Where the KV lives: dram, ssd (comma-separated).
    #[arg(long, value_delimiter = ',', default_values = ["dram", "ssd"])]
    pub sources: Vec<String>,
    /// Timed runs per mode (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// kvtide shards.
    #[arg(long, default_value_t = 4)]
    pub shards: usize,
    /// Stage fragmented reads (`gpu_staging`; stream-bound reads use their own units).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub staging: bool,
    /// SSD directory (removed first).
    #[arg(long, default_value = "/tmp/kvtide-layerwise")]
    pub dir: std::path::PathBuf,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// Also print one JSON line per result.
    #[arg(long)]
    pub json: bool,
}

/// A device region by address, for `'static` regions over the pool.
fn dev(addr: u64, len: u64, gpu: u32) -> Region<'static> {
    // SAFETY: inside the benchmark's device pool, which outlives every read into it (each run
    // synchronises before the next starts and before the pool is freed).
    unsafe { Region::from_raw(addr, len as usize, MemoryKind::Device { ordinal: gpu }) }
}

struct Step {
    /// Per layer: its keys, and each key's pages (addresses in the pool).
    keys: Vec<Vec<Vec<u8>>>,
    pages: Vec<Vec<Vec<(u64, u64)>>>,
}

impl Step {
    fn dsts(&self, layer: usize, gpu: u32) -> Vec<Vec<Region<'static>>> {
        self.pages[layer].iter().map(|pages| pages.iter().map(|&(a, n)| dev(a, n, gpu)).collect()).collect()
    }

    fn key_refs(&self, layer: usize) -> Vec<&[u8]> {
        self.keys[layer].iter().map(Vec::as_slice).collect()
    }
}

/// The stamped value of `key`.
fn value(key: &[u8], len: usize) -> Vec<u8> {
    stamped(
        len as u64,
        key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)),
    )
}

fn layout(args: &LayerwiseArgs, layer_bytes: u64, pool: &DeviceBuffer) -> Step {
    let object = layer_bytes / args.keys_per_layer as u64;
    let page = args.page_bytes.min(object).max(1);
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut keys = Vec::new();
    let mut pages = Vec::new();
    for layer in 0..args.layers {
        let base = pool.addr() + layer as u64 * layer_bytes;
        // The layer's pages, shuffled over its region.
        let count = (object.div_ceil(page) as usize) * args.keys_per_layer;
        let mut slots: Vec<u64> = (0..count as u64).collect();
        for i in (1..slots.len()).rev() {
            let j = (next() % (i as u64 + 1)) as usize;
            slots.swap(i, j);
        }
        let mut slot = slots.into_iter();
        let mut layer_keys = Vec::new();
        let mut layer_pages = Vec::new();
        for k in 0..args.keys_per_layer {
            layer_keys.push(format!("layer{layer}/kv{k}/{layer_bytes}").into_bytes());
            let mut left = object;
            let mut list = Vec::new();
            while left > 0 {
                let n = left.min(page);
                list.push((base + slot.next().unwrap_or(0) * page, n));
                left -= n;
            }
            layer_pages.push(list);
        }
        keys.push(layer_keys);
        pages.push(layer_pages);
    }
    Step { keys, pages }
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs.get(xs.len() / 2).copied().unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Rig<'a> {
    store: &'a Engine,
    step: &'a Step,
    gpu: u32,
    load: CudaStream,
    compute: CudaStream,
    events: Vec<CudaEvent>,
    layers: usize,
}

impl Rig<'_> {
    /// Stream-bound reads of `layers` layers back to back; returns when the stream passed them.
    fn load_only(&self, layers: usize) -> Result<Duration, String> {
        let started = Instant::now();
        let mut tickets = Vec::new();
        for layer in 0..layers {
            let dsts = self.step.dsts(layer, self.gpu);
            // SAFETY: the pool outlives the copies (synchronised below).
            let t = unsafe {
                self.store.batch_get_into_multi_buffers_on_stream(&self.step.key_refs(layer), &dsts, self.load.handle())
            }
            .map_err(|e| format!("on_stream: {e}"))?;
            tickets.push(t);
        }
        self.events[0].record(self.load.handle()).map_err(|e| e.to_string())?;
        self.events[0].synchronize().map_err(|e| e.to_string())?;
        let took = started.elapsed();
        check_tickets(&tickets)?;
        Ok(took)
    }

    fn compute_only(&self, ns: u64) -> Result<Duration, String> {
        let started = Instant::now();
        for _ in 0..self.layers {
            self.compute.spin(ns).map_err(|e| e.to_string())?;
        }
        self.compute.synchronize().map_err(|e| e.to_string())?;
        Ok(started.elapsed())
    }

    fn serial(&self, ns: u64) -> Result<Duration, String> {
        let started = Instant::now();
        for layer in 0..self.layers {
            let dsts = self.step.dsts(layer, self.gpu);
            for r in self.store.batch_get_into_multi_buffers(&self.step.key_refs(layer), &dsts) {
                r.map_err(|e| format!("get: {e}"))?;
            }
            self.compute.spin(ns).map_err(|e| e.to_string())?;
            self.compute.synchronize().map_err(|e| e.to_string())?;
        }
        Ok(started.elapsed())
    }

    fn host_overlapped(&self, ns: u64) -> Result<Duration, String> {
        let started = Instant::now();
        let mut tickets = Vec::new();
        for layer in 0..self.layers {
            let t = self
                .store
                .submit_batch_get(&self.step.key_refs(layer), self.step.dsts(layer, self.gpu))
                .map_err(|e| format!("submit: {e}"))?;
            tickets.push(t);
        }
        for t in tickets {
            for r in t.wait() {
                r.map_err(|e| format!("ticket: {e}"))?;
            }
            self.compute.spin(ns).map_err(|e| e.to_string())?;
        }
        self.compute.synchronize().map_err(|e| e.to_string())?;
        Ok(started.elapsed())
    }

    /// (step time, host time to enqueue every layer's read).
    fn graph(&self, graph: &kvtide::cuda::CudaGraph) -> Result<(Duration, Duration), String> {
        let started = Instant::now();
        let mut tickets = Vec::new();
        for (layer, event) in self.events.iter().enumerate() {
            let dsts = self.step.dsts(layer, self.gpu);
            // SAFETY: the pool outlives the copies (the step is synchronised below).
            let t = unsafe {
                self.store.batch_get_into_multi_buffers_on_stream(&self.step.key_refs(layer), &dsts, self.load.handle())
            }
            .map_err(|e| format!("on_stream: {e}"))?;
            event.record(self.load.handle()).map_err(|e| e.to_string())?;
            tickets.push(t);
        }
        let enqueued = started.elapsed();
        graph.launch(&self.compute).map_err(|e| e.to_string())?;
        self.compute.synchronize().map_err(|e| e.to_string())?;
        let took = started.elapsed();
        check_tickets(&tickets)?;
        Ok((took, enqueued))
    }

    /// The seed's pattern with the step call: every layer's read and its event record in ONE
    /// `step_on_stream` (every lease request sent at once), then one launch of the graph waiting on the
    /// events. (step time, host time of the step call.)
    fn graph_step(&self, graph: &kvtide::cuda::CudaGraph) -> Result<(Duration, Duration), String> {
        let started = Instant::now();
        let keys: Vec<Vec<&[u8]>> = (0..self.layers).map(|l| self.step.key_refs(l)).collect();
        let dsts: Vec<Vec<Vec<Region<'static>>>> = (0..self.layers).map(|l| self.step.dsts(l, self.gpu)).collect();
        let layers: Vec<StepLayer<'_, '_>> = (0..self.layers)
            .map(|l| StepLayer {
                reads: StepReads::Objects { keys: &keys[l], dsts: &dsts[l] },
                done: Some(StreamSignal::RecordEvent(self.events[l].handle())),
            })
            .collect();
        // SAFETY: the pool and the events outlive the copies (the step is synchronised below).
        let ticket =
            unsafe { self.store.step_on_stream(&layers, self.load.handle()) }.map_err(|e| format!("step: {e}"))?;
        let enqueued = started.elapsed();
        graph.launch(&self.compute).map_err(|e| e.to_string())?;
        self.compute.synchronize().map_err(|e| e.to_string())?;
        let took = started.elapsed();
        check_tickets(&[ticket])?;
        Ok((took, enqueued))
    }

    /// The flags variant with the step call: the graph is launched first, then one step call
    /// enqueues every layer's read with its flag write behind it.
    fn graph_flags_step(&self, graph: &kvtide::cuda::CudaGraph, flags: &DeviceBuffer) -> Result<Duration, String> {
        let started = Instant::now();
        graph.launch(&self.compute).map_err(|e| e.to_string())?;
        let keys: Vec<Vec<&[u8]>> = (0..self.layers).map(|l| self.step.key_refs(l)).collect();
        let dsts: Vec<Vec<Vec<Region<'static>>>> = (0..self.layers).map(|l| self.step.dsts(l, self.gpu)).collect();
        let layers: Vec<StepLayer<'_, '_>> = (0..self.layers)
            .map(|l| StepLayer {
                reads: StepReads::Objects { keys: &keys[l], dsts: &dsts[l] },
                done: Some(StreamSignal::WriteValue { addr: flags.addr() + 4 * l as u64, value: 1 }),
            })
            .collect();
        // SAFETY: the pool and the flags outlive the copies (the step is synchronised below).
        let ticket =
            unsafe { self.store.step_on_stream(&layers, self.load.handle()) }.map_err(|e| format!("step: {e}"))?;
        self.compute.synchronize().map_err(|e| e.to_string())?;
        let took = started.elapsed();
        check_tickets(&[ticket])?;
        Ok(took)
    }

    /// The flags variant: the graph (captured once: per layer, wait for its flag to be 1,
    /// compute, set it back to 0) is launched FIRST, then each layer's read is enqueued with a
    /// write of its flag behind it, so the host's enqueueing overlaps the GPU's work.
    fn graph_flags(&self, graph: &kvtide::cuda::CudaGraph, flags: &DeviceBuffer) -> Result<Duration, String> {
        let started = Instant::now();
        graph.launch(&self.compute).map_err(|e| e.to_string())?;
        let mut tickets = Vec::new();
        for layer in 0..self.layers {
            let dsts = self.step.dsts(layer, self.gpu);
            // SAFETY: the pool outlives the copies (the step is synchronised below).
            let t = unsafe {
                self.store.batch_get_into_multi_buffers_on_stream(&self.step.key_refs(layer), &dsts, self.load.handle())
            }
            .map_err(|e| format!("on_stream: {e}"))?;
            // SAFETY: a word of the live flags buffer.
            unsafe { self.load.write_value(flags.addr() + 4 * layer as u64, 1) }.map_err(|e| e.to_string())?;
            tickets.push(t);
        }
        self.compute.synchronize().map_err(|e| e.to_string())?;
        let took = started.elapsed();
        check_tickets(&tickets)?;
        Ok(took)
    }

    fn capture_flags(&self, ns: u64, flags: &DeviceBuffer) -> Result<kvtide::cuda::CudaGraph, String> {
        self.compute.begin_capture().map_err(|e| e.to_string())?;
        for layer in 0..self.layers {
            let flag = flags.addr() + 4 * layer as u64;
            // SAFETY: words of the live flags buffer, which outlives the graph.
            unsafe {
                self.compute.wait_value(flag, 1).map_err(|e| e.to_string())?;
                self.compute.spin(ns).map_err(|e| e.to_string())?;
                self.compute.write_value(flag, 0).map_err(|e| e.to_string())?;
            }
        }
        self.compute.end_capture().map_err(|e| e.to_string())
    }

    /// The step's graph, captured once: per layer an external wait on its event, then compute.
    fn capture(&self, ns: u64) -> Result<kvtide::cuda::CudaGraph, String> {
        self.compute.begin_capture().map_err(|e| e.to_string())?;
        for event in &self.events {
            self.compute.wait_event(event, true).map_err(|e| e.to_string())?;
            self.compute.spin(ns).map_err(|e| e.to_string())?;
        }
        self.compute.end_capture().map_err(|e| e.to_string())
    }
}

fn check_tickets(tickets: &[kvtide::StreamTicket]) -> Result<(), String> {
    for t in tickets {
        let results = t.wait(Duration::from_secs(30)).ok_or("a ticket did not end")?;
        for r in results {
            r.map_err(|e| format!("stream-bound read: {e}"))?;
        }
    }
    Ok(())
}

fn open(args: &LayerwiseArgs, layer_bytes: u64, ssd: bool) -> Result<Engine, String> {
    let step_bytes = layer_bytes * args.layers as u64;
    let dram_bytes = (3 * step_bytes).max(512 << 20);
    let mut b = StoreBuilder::new()
        .dram_bytes(dram_bytes)
        .shards(args.shards)
        .pin_threads(false)
        .gpu_staging(args.staging)
        .gpu_stream_unit_bytes((layer_bytes * 2).clamp(8 << 20, 64 << 20))
        .promote_on_hit(false)
        .restore_budget_bytes(step_bytes.max(64 << 20))
        .eviction(kvtide::EvictionPolicy::Lru);
    if ssd {
        let _ = std::fs::remove_dir_all(&args.dir);
        b = b.ssd_dir(&args.dir).ssd_bytes(4 * dram_bytes).ssd_segment_bytes(64 << 20);
    }
    b.open().map_err(|e| e.to_string())
}

pub fn run(args: &LayerwiseArgs) -> Result<(), String> {
    if args.layers == 0 || args.keys_per_layer == 0 || args.reps == 0 {
        return Err("--layers, --keys-per-layer and --reps must be positive".into());
    }
    let device: Arc<CudaDevice> =
        CudaTransport::get().and_then(|t| t.device(args.gpu)).map_err(|e| format!("GPU {}: {e}", args.gpu))?;
    println!(
        "# layerwise: {} layers, {} objects per layer over {} pages, {} reps (median)",
        args.layers,
        args.keys_per_layer,
        fmt_bytes(args.page_bytes),
        args.reps
    );
    println!(
        "# {:<5} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} | {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} | {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>8} {:>10} {:>10}",
        "src",
        "layer",
        "ratio",
        "load1_ms",
        "load_ms",
        "comp_ms",
        "ideal_ms",
        "serial",
        "host_ovl",
        "graph",
        "graph_flg",
        "step",
        "step_flg",
        "ser/id",
        "ovl/id",
        "gr/id",
        "gf/id",
        "st/id",
        "sf/id",
        "gr/load",
        "enqueue_us",
        "step_us"
    );
    for source in &args.sources {
        let ssd = match source.as_str() {
            "dram" => false,
            "ssd" => true,
            other => return Err(format!("unknown source {other:?} (dram, ssd)")),
        };
        for &layer_bytes in &args.layer_bytes {
            let store = open(args, layer_bytes, ssd)?;
            store.prepare_gpu(args.gpu).map_err(|e| format!("prepare_gpu: {e}"))?;
            let pool = device.alloc((layer_bytes * args.layers as u64) as usize).map_err(|e| e.to_string())?;
            let step = layout(args, layer_bytes, &pool);
            let object = (layer_bytes / args.keys_per_layer as u64) as usize;
            for keys in &step.keys {
                for k in keys {
                    store.put(k, &value(k, object), PutOptions::INSERT).map_err(|e| format!("put: {e}"))?;
                }
            }
            if ssd {
                // Fill DRAM until the KV is demoted, then drop the filler.
                let filler = vec![7u8; 32 << 20];
                let n = store.stats().total.capacity_bytes / (32 << 20) * 5 / 4 + 1;
                for i in 0..n {
                    let _ = store.put(format!("filler/{i}").as_bytes(), &filler, PutOptions::INSERT);
                }
                store.sync_shards().map_err(|e| e.to_string())?;
                for i in 0..n {
                    let _ = store.remove(format!("filler/{i}").as_bytes(), true);
                }
                store.sync_shards().map_err(|e| e.to_string())?;
                let t = store.stats().total;
                println!(
                    "#   ssd setup: DRAM {} of {} used, {} objects in DRAM, {} on SSD",
                    fmt_bytes(t.bytes_used),
                    fmt_bytes(t.capacity_bytes),
                    t.dram_objects,
                    t.ssd_objects
                );
            }
            let events: Vec<CudaEvent> = (0..args.layers)
                .map(|_| CudaEvent::new(&device, false))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?;
            let rig = Rig {
                store: &store,
                step: &step,
                gpu: args.gpu,
                load: CudaStream::new(&device).map_err(|e| e.to_string())?,
                compute: CudaStream::new(&device).map_err(|e| e.to_string())?,
                events,
                layers: args.layers,
            };
            // Warm-up (registration, units, kernels; SSD: first loads).
            rig.load_only(args.layers)?;
            let loads_before = store.stats().total.loads;
            let load1 = median((0..args.reps).map(|_| rig.load_only(1)).collect::<Result<_, _>>()?);
            let load_all = median((0..args.reps).map(|_| rig.load_only(args.layers)).collect::<Result<_, _>>()?);
            if ssd && store.stats().total.loads == loads_before {
                return Err("the SSD source read nothing from SSD".into());
            }
            let load = load_all / args.layers as u32;
            for &ratio in &args.compute_ratio {
                let ns = (load.as_nanos() as f64 * ratio) as u64;
                let comp_all = median((0..args.reps).map(|_| rig.compute_only(ns)).collect::<Result<_, _>>()?);
                let comp = comp_all / args.layers as u32;
                let ideal = load1 + load.max(comp) * args.layers as u32;
                let serial = median((0..args.reps).map(|_| rig.serial(ns)).collect::<Result<_, _>>()?);
                let overlapped = median((0..args.reps).map(|_| rig.host_overlapped(ns)).collect::<Result<_, _>>()?);
                let graph = rig.capture(ns)?;
                let runs: Vec<(Duration, Duration)> =
                    (0..args.reps).map(|_| rig.graph(&graph)).collect::<Result<_, _>>()?;
                let bound = median(runs.iter().map(|r| r.0).collect());
                let enqueue = median(runs.iter().map(|r| r.1).collect()) / args.layers as u32;
                let flags = device.alloc(4 * args.layers).map_err(|e| e.to_string())?;
                flags.fill(0).map_err(|e| e.to_string())?;
                let flag_graph = rig.capture_flags(ns, &flags)?;
                let flagged =
                    median((0..args.reps).map(|_| rig.graph_flags(&flag_graph, &flags)).collect::<Result<_, _>>()?);
                let step_flagged = median(
                    (0..args.reps).map(|_| rig.graph_flags_step(&flag_graph, &flags)).collect::<Result<_, _>>()?,
                );
                drop(flag_graph);
                let step_runs: Vec<(Duration, Duration)> =
                    (0..args.reps).map(|_| rig.graph_step(&graph)).collect::<Result<_, _>>()?;
                let stepped = median(step_runs.iter().map(|r| r.0).collect());
                let step_host = median(step_runs.iter().map(|r| r.1).collect()) / args.layers as u32;
                // The bytes of the last graph step.
                let mut got = vec![0u8; pool.len()];
                pool.read(0, &mut got).map_err(|e| e.to_string())?;
                for (layer, keys) in step.keys.iter().enumerate() {
                    for (k, key) in keys.iter().enumerate() {
                        let want = value(key, object);
                        let mut at = 0usize;
                        for &(addr, n) in &step.pages[layer][k] {
                            let off = (addr - pool.addr()) as usize;
                            if got[off..off + n as usize] != want[at..at + n as usize] {
                                return Err(format!("layer {layer} object {k}: wrong bytes at {at}"));
                            }
                            at += n as usize;
                        }
                    }
                }
                let floor = load_all + comp;
                let r = |d: Duration| ms(d) / ms(ideal);
                println!(
                    "  {:<5} {:>9} {:>7.2} {:>9.3} {:>9.3} {:>9.3} {:>9.2} | {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2} | {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>7.3} | {:>8.3} {:>10.1} {:>10.1}",
                    source,
                    fmt_bytes(layer_bytes),
                    ratio,
                    ms(load1),
                    ms(load),
                    ms(comp),
                    ms(ideal),
                    ms(serial),
                    ms(overlapped),
                    ms(bound),
                    ms(flagged),
                    ms(stepped),
                    ms(step_flagged),
                    r(serial),
                    r(overlapped),
                    r(bound),
                    r(flagged),
                    r(stepped),
                    r(step_flagged),
                    ms(bound.min(flagged).min(stepped).min(step_flagged)) / ms(floor),
                    enqueue.as_secs_f64() * 1e6,
                    step_host.as_secs_f64() * 1e6,
                );
                if args.json {
                    println!(
                        "{{\"bench\":\"layerwise\",\"source\":{},\"layer_bytes\":{},\"layers\":{},\"compute_ratio\":{},\"load1_ms\":{:.4},\"load_ms\":{:.4},\"compute_ms\":{:.4},\"ideal_ms\":{:.4},\"load_only_ms\":{:.4},\"serial_ms\":{:.4},\"host_overlapped_ms\":{:.4},\"graph_ms\":{:.4},\"graph_flags_ms\":{:.4},\"step_ms\":{:.4},\"step_flags_ms\":{:.4},\"step_host_us_per_layer\":{:.2}}}",
                        json_str(source),
                        layer_bytes,
                        args.layers,
                        ratio,
                        ms(load1),
                        ms(load),
                        ms(comp),
                        ms(ideal),
                        ms(load_all),
                        ms(serial),
                        ms(overlapped),
                        ms(bound),
                        ms(flagged),
                        ms(stepped),
                        ms(step_flagged),
                        step_host.as_secs_f64() * 1e6
                    );
                }
            }
            let t = store.stats().total;
            if ssd {
                println!(
                    "#   ssd: loads {}, restore waits {}, DRAM {} used",
                    t.loads,
                    t.restore_waits,
                    fmt_bytes(t.bytes_used)
                );
            }
            let g = store.stats().gpu;
            let per_call = |us: u64| us as f64 / g.stream_bound_reads.max(1) as f64;
            println!(
                "#   stream-bound reads {}, gated keys {}, failed keys {}; per call: check {:.1} us, lease {:.1} us, plan {:.1} us, enqueue {:.1} us; blocking-path fallbacks {:?}",
                g.stream_bound_reads,
                g.stream_bound_gated_keys,
                g.stream_bound_failed_keys,
                per_call(g.stream_bound_call_us[0]),
                per_call(g.stream_bound_call_us[1]),
                per_call(g.stream_bound_call_us[2]),
                per_call(g.stream_bound_call_us[3]),
                g.fallbacks
            );
            drop(rig);
            drop(store);
            drop(pool);
        }
    }
    if args.sources.iter().any(|s| s == "ssd") {
        let _ = std::fs::remove_dir_all(&args.dir);
    }
    Ok(())
}
