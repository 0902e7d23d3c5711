//! `kvtide-bench py-call`: the time of one batch read through the Rust API, the baseline of the
//! Python layer's overhead (`python/bench/overhead.py` runs the same call through `kvtide` in
//! the same run). Owns building that workload; never measures Python itself.

use std::time::Instant;

use clap::Args;
use kvtide::{Fragment, MemoryKind, PutOptions, Region, Store, StoreBuilder};

#[derive(Args, Debug)]
pub struct PyCallArgs {
    /// Keys per batch.
    #[arg(long, default_value_t = 128)]
    pub keys: usize,
    /// Bytes per value.
    #[arg(long, default_value = "64KiB", value_parser = crate::util::parse_size)]
    pub value_bytes: u64,
    /// Timed calls (after 20 warm-up calls).
    #[arg(long, default_value_t = 2000)]
    pub iters: usize,
    /// "host" (one host buffer) or "cuda" (one device buffer on GPU 0; feature `cuda`).
    #[arg(long, default_value = "host")]
    pub target: String,
    /// "ranges": `get_into_ranges` of every key into one buffer; "multi":
    /// `batch_get_into_multi_buffers` with one page of that buffer per key.
    #[arg(long, default_value = "ranges")]
    pub form: String,
    /// Shards of the embedded engine.
    #[arg(long, default_value_t = 4)]
    pub shards: usize,
    /// Stage GPU reads (`[gpu] staging`).
    #[arg(long)]
    pub staged: bool,
}

pub fn run(args: &PyCallArgs) -> Result<(), String> {
    let n = args.keys;
    let len = args.value_bytes as usize;
    let total = n * len;
    let store = StoreBuilder::new()
        .dram_bytes((total as u64 * 4).max(256 << 20))
        .shards(args.shards)
        .gpu_staging(args.staged)
        .open()
        .map_err(|e| e.to_string())?;
    let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("py-call/{i}").into_bytes()).collect();
    for (i, key) in keys.iter().enumerate() {
        store.put(key, &crate::util::stamped(len as u64, i as u64), PutOptions::INSERT).map_err(|e| e.to_string())?;
    }
    let mut host = vec![0u8; total];
    let (addr, kind, _device) = target(args, &mut host)?;
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    // SAFETY: `addr` is `total` bytes of host memory owned by `host`, or of the device buffer
    // `_device`; both live until the end of this function and nothing else uses them.
    let buffer = unsafe { Region::from_raw(addr, total, kind) };
    let pages: Vec<Vec<Region<'_>>> = (0..n)
        .map(|i| buffer.slice((i * len) as u64, len as u64).map(|p| vec![p]))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let fragments = vec![keys
        .iter()
        .enumerate()
        .map(|(i, k)| Fragment::new(k.clone(), 0, (i * len) as u64, len as u64))
        .collect::<Vec<_>>()];
    let call = || -> Result<(), String> {
        let ok = match args.form.as_str() {
            "ranges" => store.get_into_ranges(&[buffer], &fragments).iter().flatten().all(|r| r.is_ok()),
            "multi" => store.batch_get_into_multi_buffers(&key_refs, &pages).iter().all(|r| r.is_ok()),
            other => return Err(format!("--form {other:?}: ranges or multi")),
        };
        if ok {
            Ok(())
        } else {
            Err("a key failed".into())
        }
    };
    for _ in 0..20 {
        call()?;
    }
    let mut times = Vec::with_capacity(args.iters);
    for _ in 0..args.iters {
        let start = Instant::now();
        call()?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "{{\"bench\":\"py-call\",\"api\":\"rust\",\"target\":\"{}\",\"form\":\"{}\",\"keys\":{n},\"value_bytes\":{len},\"us_median\":{median:.2},\"us_mean\":{mean:.2}}}",
        args.target, args.form
    );
    store.shutdown();
    Ok(())
}

#[cfg(feature = "cuda")]
type Device = Option<kvtide::cuda::DeviceBuffer>;
#[cfg(not(feature = "cuda"))]
type Device = Option<()>;

/// The buffer of the reads: `host`, or a device buffer of the same size.
fn target(args: &PyCallArgs, host: &mut [u8]) -> Result<(u64, MemoryKind, Device), String> {
    match args.target.as_str() {
        "host" => Ok((host.as_mut_ptr() as u64, MemoryKind::Host, None)),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let device = kvtide::cuda::CudaTransport::get().and_then(|t| t.device(0)).map_err(|e| e.to_string())?;
            let buffer = device.alloc(host.len()).map_err(|e| e.to_string())?;
            Ok((buffer.addr(), MemoryKind::Device { ordinal: 0 }, Some(buffer)))
        }
        other => Err(format!("--target {other:?}: host (or cuda with feature cuda)")),
    }
}
