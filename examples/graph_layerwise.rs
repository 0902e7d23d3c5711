//! One CUDA graph per decode step, waiting layer by layer for KV that kvtide delivers on a load
//! stream: the pattern stream-bound reads support (feature `cuda`, needs a GPU).
//!
//! 1. Once: capture the step's compute into ONE graph. Before each layer's compute, the graph
//!    waits on that layer's event with an external event wait (`cuStreamWaitEvent` with
//!    `CU_EVENT_WAIT_EXTERNAL`; in PyTorch, `cudaStreamWaitEvent` + `cudaEventWaitExternal`).
//!    No kvtide call happens during capture: kvtide refuses a capturing stream.
//! 2. Every step, OUTSIDE the graph: for each layer, `batch_get_into_multi_buffers_on_stream` on
//!    the load stream, then record that layer's event on the load stream. The host does not
//!    wait for any transfer.
//! 3. Launch the graph. Layer i's compute starts as soon as layer i's KV has landed, while later
//!    layers are still loading; the host is absent between layers.
//!
//! Run: `cargo run --release -p kvtide-examples --features cuda --example graph_layerwise`.

use std::time::{Duration, Instant};

use kvtide::cuda::{CudaEvent, CudaStream, CudaTransport};
use kvtide::{MemoryKind, PutOptions, Region, Store, StoreBuilder, StreamStatus};

const LAYERS: usize = 8;
const STEPS: usize = 3;
/// KV bytes per layer per step (one object per layer here; real workers read many pages).
const LAYER_BYTES: usize = 2 << 20;
/// The stand-in for a layer's attention.
const COMPUTE_NS: u64 = 100_000;

fn layer_key(step: usize, layer: usize) -> Vec<u8> {
    format!("req-42/step{step}/layer{layer}").into_bytes()
}

fn layer_value(step: usize, layer: usize) -> Vec<u8> {
    (0..LAYER_BYTES).map(|i| ((step * 31 + layer * 7 + i) % 251) as u8).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = StoreBuilder::new().with_env()?.open()?;
    let gpu = CudaTransport::get()?.device(0)?;
    // Registration, staging units, gates and kernels now, so the steps allocate nothing.
    store.prepare_gpu(0)?;
    for step in 0..STEPS {
        for layer in 0..LAYERS {
            store.put(&layer_key(step, layer), &layer_value(step, layer), PutOptions::UPSERT)?;
        }
    }
    // The worker's KV buffer (one region per layer) and a buffer the "attention" writes.
    let kv = gpu.alloc(LAYERS * LAYER_BYTES)?;
    let out = gpu.alloc(LAYERS * LAYER_BYTES)?;
    let load = CudaStream::new(&gpu)?;
    let compute = CudaStream::new(&gpu)?;
    let ready: Vec<CudaEvent> = (0..LAYERS).map(|_| CudaEvent::new(&gpu, false)).collect::<Result<_, _>>()?;

    // 1. Capture once: per layer, wait for its KV, compute, consume the KV.
    compute.begin_capture()?;
    for (layer, event) in ready.iter().enumerate() {
        compute.wait_event(event, true)?;
        compute.spin(COMPUTE_NS)?;
        let at = (layer * LAYER_BYTES) as u64;
        // SAFETY: both allocations outlive every launch of the graph.
        unsafe { compute.copy_device(out.addr() + at, kv.addr() + at, LAYER_BYTES)? };
    }
    let graph = compute.end_capture()?;

    for step in 0..STEPS {
        let started = Instant::now();
        // 2. Enqueue this step's reads and record the per-layer events, outside the graph.
        let mut tickets = Vec::new();
        for (layer, event) in ready.iter().enumerate() {
            let key = layer_key(step, layer);
            // SAFETY: inside `kv`, which outlives the copies (each step is synchronised below).
            let dst = unsafe {
                Region::from_raw(
                    kv.addr() + (layer * LAYER_BYTES) as u64,
                    LAYER_BYTES,
                    MemoryKind::Device { ordinal: 0 },
                )
            };
            // SAFETY: the load stream is live and `dst` stays valid until the stream passed it.
            let ticket = unsafe { store.batch_get_into_multi_buffers_on_stream(&[&key], &[vec![dst]], load.handle())? };
            event.record(load.handle())?;
            tickets.push(ticket);
        }
        let enqueued = started.elapsed();
        // 3. One launch runs every layer.
        graph.launch(&compute)?;
        compute.synchronize()?;
        let took = started.elapsed();
        // The tickets say how each read went (a failed key never reports success).
        for (layer, t) in tickets.iter().enumerate() {
            t.wait(Duration::from_secs(10)).ok_or("a read did not end")?;
            if let StreamStatus::Failed(failed) = t.status() {
                return Err(format!("step {step} layer {layer}: {failed:?}").into());
            }
        }
        let mut got = vec![0u8; LAYERS * LAYER_BYTES];
        out.read(0, &mut got)?;
        for layer in 0..LAYERS {
            if got[layer * LAYER_BYTES..(layer + 1) * LAYER_BYTES] != layer_value(step, layer)[..] {
                return Err(format!("step {step} layer {layer}: wrong KV").into());
            }
        }
        println!(
            "step {step}: {LAYERS} layers enqueued in {:.3} ms, graph done after {:.3} ms, every layer's KV verified",
            enqueued.as_secs_f64() * 1e3,
            took.as_secs_f64() * 1e3
        );
    }
    let g = store.stats().gpu;
    println!("stream-bound reads: {}, failed keys: {}", g.stream_bound_reads, g.stream_bound_failed_keys);
    Ok(())
}
