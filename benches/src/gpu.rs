//! `gpu`: reads into fragmented GPU pages and gathered writes from them, kvtide's direct and
//! staged paths against the CUDA baselines, all measured in the same run (feature `cuda`).
//!
//! For each layout (objects x object size, each object cut into pages, the pages of all objects
//! shuffled over one device pool) and in the same process:
//! - raw: ONE `cuMemcpyHtoDAsync` of all the bytes from pinned host memory into contiguous device
//!   memory (the PCIe limit);
//! - per-page loop: one `cuMemcpyHtoDAsync` per page from pinned host memory;
//! - `cuMemcpyBatchAsync` of the same pages (one call);
//! - kvtide direct: `batch_get_into_multi_buffers` on a store without staging;
//! - kvtide staged: the same call on a store with `gpu_staging`.
//!
//! Writes do the same device -> host: raw one `cuMemcpyDtoHAsync`, the per-page loop, the batch
//! call, and kvtide's `batch_put_from_multi_buffers` direct and gathered (staged). Every figure is
//! the median of `--iters` timed runs after `--warmup` runs, host wall-clock from the call to the
//! data being usable (the call returned / the event was seen complete). kvtide's results are
//! checked byte for byte once per layout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::cuda::plan::BulkCopy;
use kvtide::cuda::{BaselineMode, CudaDevice, CudaTransport, DeviceBuffer, PinnedBuffer};
use kvtide::{Engine, MemoryKind, PutOptions, Region, Store, StoreBuilder};

use crate::util::{fmt_bytes, json_str, parse_size, shuffled_slots};

/// Arguments of `kvtide-bench gpu`.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuArgs {
    /// Layouts to run: comma-separated OBJECTSxOBJECT_BYTES/PAGE_BYTES (default: the four).
    #[arg(long, default_value = "128x2MiB/8KiB,128x2MiB/256KiB,96x12MiB/128KiB,1536x384KiB/4KiB")]
    pub layouts: String,
    /// Timed runs per method.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Untimed runs per method first (registration, NVRTC and the staging buffer happen here).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Staging buffer of the staged store.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub staging_bytes: u64,
    /// kvtide shards.
    #[arg(long, default_value_t = 4)]
    pub shards: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// Also print one JSON line per result.
    #[arg(long)]
    pub json: bool,
}

pub(crate) struct Layout {
    pub(crate) objects: usize,
    pub(crate) object_bytes: u64,
    pub(crate) page_bytes: u64,
}

impl Layout {
    pub(crate) fn parse(text: &str) -> Result<Layout, String> {
        let bad = || format!("layout {text:?}: expected OBJECTSxOBJECT_BYTES/PAGE_BYTES, e.g. 128x2MiB/8KiB");
        let (objects, rest) = text.split_once('x').ok_or_else(bad)?;
        let (object, page) = rest.split_once('/').ok_or_else(bad)?;
        let layout = Layout {
            objects: objects.trim().parse().map_err(|_| bad())?,
            object_bytes: parse_size(object)?,
            page_bytes: parse_size(page)?,
        };
        if layout.objects == 0 || layout.page_bytes == 0 || !layout.object_bytes.is_multiple_of(layout.page_bytes) {
            return Err(bad());
        }
        Ok(layout)
    }

    pub(crate) fn total_bytes(&self) -> u64 {
        self.objects as u64 * self.object_bytes
    }

    pub(crate) fn pages_per_object(&self) -> u64 {
        self.object_bytes / self.page_bytes
    }

    fn label(&self) -> String {
        format!("{} x {} in {} pages", self.objects, fmt_bytes(self.object_bytes), fmt_bytes(self.page_bytes))
    }
}

/// One measured method.
struct Row {
    method: &'static str,
    median: Duration,
    min: Duration,
}

fn median(mut samples: Vec<Duration>) -> Row {
    samples.sort();
    Row { method: "", median: samples[samples.len() / 2], min: samples[0] }
}

fn measure(
    method: &'static str,
    warmup: usize,
    iters: usize,
    mut run: impl FnMut() -> Result<Duration, String>,
) -> Result<Row, String> {
    for _ in 0..warmup {
        run()?;
    }
    let samples = (0..iters).map(|_| run()).collect::<Result<Vec<_>, _>>()?;
    Ok(Row { method, ..median(samples) })
}

fn timed(f: impl FnOnce() -> Result<(), String>) -> Result<Duration, String> {
    let started = Instant::now();
    f()?;
    Ok(started.elapsed())
}

/// Runs the benchmark.
pub fn run(args: &GpuArgs) -> Result<(), String> {
    let transport = CudaTransport::get().map_err(|e| e.to_string())?;
    let device = transport.device(args.gpu).map_err(|e| e.to_string())?;
    println!(
        "kvtide-bench gpu: GPU {} ({:?}), cuMemcpyBatchAsync {}, staging buffer {}, {} shards, median of {} runs after {} warm-up",
        args.gpu,
        device,
        if transport.has_batch_copy() { "available" } else { "absent" },
        fmt_bytes(args.staging_bytes),
        args.shards,
        args.iters,
        args.warmup
    );
    let layouts = args.layouts.split(',').map(Layout::parse).collect::<Result<Vec<_>, _>>()?;
    let mut tables = Vec::new();
    for layout in &layouts {
        tables.push(run_layout(args, &device, layout)?);
    }
    for (direction, index) in [("READS (host DRAM -> GPU pages)", 0usize), ("WRITES (GPU pages -> host DRAM)", 1)] {
        println!("\n{direction}");
        println!(
            "{:<34} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "layout", "raw", "per-page", "batch", "direct", "staged", "raw/stg", "stg x bt"
        );
        for (layout, rows) in layouts.iter().zip(&tables) {
            let rows = &rows[index];
            let get = |m: &str| rows.iter().find(|r| r.method == m).map(|r| r.median.as_secs_f64() * 1e3);
            let cell = |m: &str| get(m).map_or("n/a".to_string(), |ms| format!("{ms:.2} ms"));
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
                _ => "n/a".into(),
            };
            println!(
                "{:<34} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
                layout.label(),
                cell("raw"),
                cell("per-page"),
                cell("batch"),
                cell("kvtide-direct"),
                cell("kvtide-staged"),
                ratio(get("raw"), get("kvtide-staged")),
                ratio(get("batch"), get("kvtide-staged")),
            );
        }
    }
    println!(
        "\n(raw/stg: staged as a fraction of the raw copy's speed; stg x bt: staged speed-up over cuMemcpyBatchAsync)"
    );
    Ok(())
}

fn engine(args: &GpuArgs, layout: &Layout, staging: bool) -> Result<Engine, String> {
    let total = layout.total_bytes();
    let dram = (total + total / 2 + (512 << 20)).next_multiple_of(2 << 20);
    StoreBuilder::new()
        .dram_bytes(dram)
        .shards(args.shards)
        .max_value_bytes(layout.object_bytes)
        .gpu_staging(staging)
        .gpu_staging_bytes(args.staging_bytes)
        // KVTIDE_* variables (e.g. KVTIDE_RUNTIME_IDLE_SPIN_US) tune the store under test.
        .with_env()
        .map_err(|e| e.to_string())?
        .open()
        .map_err(|e| e.to_string())
}

/// Medians of the staged reads' GPU timelines (`KVTIDE_CUDA_PROFILE=1`; none otherwise).
fn print_timelines(method: &str, timelines: Vec<kvtide::cuda::profile::Timeline>) {
    if timelines.is_empty() {
        return;
    }
    let med = |f: fn(&kvtide::cuda::profile::Timeline) -> f64| {
        let mut v: Vec<f64> = timelines.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!(
        "  {method} timeline (us, median of {}; from the first staged copy): host work before it {:.0}, copies end {:.0}, kernels end {:.0}, caller notices {:.0}; {} fills",
        timelines.len(),
        med(|t| t.queued_us),
        med(|t| t.copies_end_us),
        med(|t| t.kernels_end_us),
        med(|t| t.noticed_us),
        med(|t| t.fills as f64),
    );
}

/// The destination pages of `objects` objects of `pages_per_object` pages each: page j of
/// object o is pool slot `slots[o * pages_per_object + j]`.
///
/// # Safety
/// `pool` must outlive every use of the returned regions.
pub(crate) unsafe fn page_regions(
    pool: &DeviceBuffer,
    slots: &[u64],
    objects: usize,
    pages_per_object: u64,
    page: u64,
) -> Vec<Vec<Region<'static>>> {
    let kind = MemoryKind::Device { ordinal: pool.device().ordinal() };
    (0..objects as u64)
        .map(|o| {
            (0..pages_per_object)
                .map(|j| {
                    let slot = slots[(o * pages_per_object + j) as usize];
                    // SAFETY: a page inside `pool`, which the caller keeps alive.
                    unsafe { Region::from_raw(pool.addr() + slot * page, page as usize, kind) }
                })
                .collect()
        })
        .collect()
}

/// The pool's bytes once every page of `host` (object-major) landed in its slot.
pub(crate) fn expected_pool(host: &[u8], slots: &[u64], page: u64) -> Vec<u8> {
    let page = page as usize;
    let mut expected = vec![0u8; host.len()];
    for (p, &slot) in slots.iter().enumerate() {
        let (src, dst) = (p * page, slot as usize * page);
        expected[dst..dst + page].copy_from_slice(&host[src..src + page]);
    }
    expected
}

/// Deterministic content: every 8-byte word names its object and offset.
fn fill_object(object: usize, out: &mut [u8]) {
    for (w, chunk) in out.chunks_mut(8).enumerate() {
        let word = (((object as u64) << 40) | (w as u64 * 8)) ^ 0x5bd1_e995_0000_0000;
        let bytes = word.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

fn run_layout(args: &GpuArgs, device: &Arc<CudaDevice>, layout: &Layout) -> Result<[Vec<Row>; 2], String> {
    let total = layout.total_bytes() as usize;
    let page = layout.page_bytes;
    let pages = layout.objects as u64 * layout.pages_per_object();
    eprintln!("layout {}: {} total, {pages} pages", layout.label(), fmt_bytes(total as u64));
    // Host side (pinned, object-major like the arena) and the device pool.
    let mut host: PinnedBuffer = device.alloc_pinned(total).map_err(|e| e.to_string())?;
    for (o, object) in host.as_mut_slice().chunks_mut(layout.object_bytes as usize).enumerate() {
        fill_object(o, object);
    }
    let pool: DeviceBuffer = device.alloc(total).map_err(|e| e.to_string())?;
    let contiguous: DeviceBuffer = device.alloc(total).map_err(|e| e.to_string())?;
    let slots = shuffled_slots(pages, 0x9e37_79b9_7f4a_7c15);
    let host_base = host.as_slice().as_ptr() as u64;
    let page_copies: Vec<BulkCopy> = (0..pages)
        .map(|p| BulkCopy { host: host_base + p * page, device: pool.addr() + slots[p as usize] * page, len: page })
        .collect();
    let one_copy = [BulkCopy { host: host_base, device: contiguous.addr(), len: total as u64 }];
    let raw = |copies: &[BulkCopy], to_device: bool, mode: BaselineMode| {
        // SAFETY: every copy names the pinned host buffer and device buffers allocated above,
        // alive for the whole function.
        unsafe { device.timed_copies(copies, to_device, mode) }.map_err(|e| e.to_string())
    };
    let (warmup, iters) = (args.warmup, args.iters);
    let mut reads = vec![
        measure("raw", warmup, iters, || raw(&one_copy, true, BaselineMode::PerCopy))?,
        measure("per-page", warmup.min(1), iters, || raw(&page_copies, true, BaselineMode::PerCopy))?,
    ];
    if device.has_batch_copy() {
        reads.push(measure("batch", warmup, iters, || raw(&page_copies, true, BaselineMode::Batch))?);
    }
    let mut writes = vec![
        measure("raw", warmup, iters, || raw(&one_copy, false, BaselineMode::PerCopy))?,
        measure("per-page", warmup.min(1), iters, || raw(&page_copies, false, BaselineMode::PerCopy))?,
    ];
    if device.has_batch_copy() {
        writes.push(measure("batch", warmup, iters, || raw(&page_copies, false, BaselineMode::Batch))?);
    }

    let keys: Vec<Vec<u8>> = (0..layout.objects).map(|o| format!("gpu-bench/{o}").into_bytes()).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let ppo = layout.pages_per_object();
    // SAFETY: `pool` outlives every call that uses these regions.
    let regions = unsafe { page_regions(&pool, &slots, layout.objects, ppo, page) };
    let expected = expected_pool(host.as_slice(), &slots, page);
    for (staging, method_read, method_write) in
        [(false, "kvtide-direct", "kvtide-direct"), (true, "kvtide-staged", "kvtide-staged")]
    {
        let store = engine(args, layout, staging)?;
        for (o, key) in keys.iter().enumerate() {
            let object = &host.as_slice()[o * layout.object_bytes as usize..(o + 1) * layout.object_bytes as usize];
            store.put(key, object, PutOptions::UPSERT).map_err(|e| format!("put: {e}"))?;
        }
        pool.fill(0).map_err(|e| e.to_string())?;
        let read = || {
            timed(|| {
                let results = store.batch_get_into_multi_buffers(&key_refs, &regions);
                match results.iter().find(|r| r.is_err()) {
                    Some(Err(e)) => Err(format!("read: {e}")),
                    _ => Ok(()),
                }
            })
        };
        for _ in 0..warmup {
            read()?;
        }
        let warm = store.stats().gpu.read_phase_us;
        drop(kvtide::cuda::profile::take_timelines());
        reads.push(measure(method_read, 0, iters, read)?);
        let after = store.stats().gpu.read_phase_us;
        print_timelines(method_read, kvtide::cuda::profile::take_timelines());
        let phases: Vec<u64> = after.iter().zip(warm).map(|(a, w)| (a - w) / iters.max(1) as u64).collect();
        eprintln!(
            "  {method_read} read phases per call (us): send leases {}, grants {}, prestage {}, checks+transfers {}, plan+submit {}, wait {}",
            phases[0], phases[1], phases[2], phases[3], phases[4], phases[5]
        );
        let mut back = vec![0u8; total];
        pool.read(0, &mut back).map_err(|e| e.to_string())?;
        if back != expected {
            return Err(format!("{method_read}: the device pages differ from the stored objects"));
        }
        // Writes: the pool holds every object's pages; store them again (removed untimed first).
        let write = || {
            for key in &keys {
                let _ = store.remove(key, true);
            }
            timed(|| {
                let results = store.batch_put_from_multi_buffers(&key_refs, &regions, PutOptions::INSERT);
                match results.iter().find(|r| r.is_err()) {
                    Some(Err(e)) => Err(format!("write: {e}")),
                    _ => Ok(()),
                }
            })
        };
        for _ in 0..warmup {
            write()?;
        }
        drop(kvtide::cuda::profile::take_timelines());
        let warm = store.stats().gpu;
        writes.push(measure(method_write, 0, iters, write)?);
        let after = store.stats().gpu;
        print_timelines(&format!("{method_write} write"), kvtide::cuda::profile::take_timelines());
        let phases: Vec<u64> =
            after.write_phase_us.iter().zip(warm.write_phase_us).map(|(a, w)| (a - w) / iters.max(1) as u64).collect();
        eprintln!(
            "  {method_write} write phases per call (us): reserve+checks {}, route {}, plan+submit {}, wait {}, commit {}; until the first part was submitted {}",
            phases[0],
            phases[1],
            phases[2],
            phases[3],
            phases[4],
            (after.write_first_part_us - warm.write_first_part_us) / iters.max(1) as u64
        );
        for (o, key) in keys.iter().enumerate().step_by((layout.objects / 8).max(1)) {
            let got = store.get(key).map_err(|e| format!("read back: {e}"))?;
            let object = &host.as_slice()[o * layout.object_bytes as usize..(o + 1) * layout.object_bytes as usize];
            if got != object {
                return Err(format!("{method_write}: object {o} differs after the gathered write"));
            }
        }
        let stats = store.stats();
        eprintln!(
            "  {method_read}: gpu stats {:?}; arena registration {:.1} ms",
            stats.gpu,
            stats.gpu.registration_us as f64 / 1e3
        );
        if !stats.held_resources().is_zero() {
            store.sync_shards().map_err(|e| e.to_string())?;
        }
    }
    for (name, rows) in [("read", &reads), ("write", &writes)] {
        for row in rows.iter() {
            let gbps = total as f64 / row.median.as_secs_f64() / 1e9;
            eprintln!(
                "  {name:<5} {:<14} median {:>9.3} ms  min {:>9.3} ms  {gbps:>6.1} GB/s",
                row.method,
                row.median.as_secs_f64() * 1e3,
                row.min.as_secs_f64() * 1e3
            );
            if args.json {
                println!(
                    "{{\"bench\":\"gpu\",\"layout\":{},\"direction\":\"{name}\",\"method\":\"{}\",\"bytes\":{total},\"pages\":{pages},\"median_ms\":{:.4},\"min_ms\":{:.4},\"gb_per_s\":{gbps:.2}}}",
                    json_str(&layout.label()),
                    row.method,
                    row.median.as_secs_f64() * 1e3,
                    row.min.as_secs_f64() * 1e3
                );
            }
        }
    }
    Ok([reads, writes])
}
