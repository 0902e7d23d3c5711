//! Stream-bound reads on a real GPU (feature `cuda`; the tests run on the lent H200 through the
//! device pack): the bytes on the caller's stream with guard bytes, odd sizes and reordered
//! pages, staged and direct; a second stream and a graph waiting on the caller's event; the
//! store changing underneath while a long kernel delays the stream; SSD-resident keys, with
//! injected EIO reported through the status; a graph captured once and replayed for several
//! steps with different keys; calls during capture refused; leases back to zero.

mod common;

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;
    use std::time::Duration;

    use super::common::{value_for, wait_idle};
    use kvtide::cuda::{CudaDevice, CudaEvent, CudaStream, CudaTransport, DeviceBuffer};
    use kvtide::{
        Engine, Error, Fragment, MemoryKind, PutOptions, Region, SimFaults, StepLayer, StepReads, Store, StoreBuilder,
        StreamSignal, StreamStatus,
    };

    const GUARD: u8 = 0xA5;
    const GPU0: MemoryKind = MemoryKind::Device { ordinal: 0 };
    /// Long enough for the test to change the store while the copies wait behind it.
    const DELAY_NS: u64 = 300_000_000;

    fn gpu() -> Arc<CudaDevice> {
        CudaTransport::get().and_then(|t| t.device(0)).expect("a CUDA device")
    }

    fn store(staging: bool) -> Engine {
        StoreBuilder::new()
            .dram_bytes(128 << 20)
            .shards(2)
            .pin_threads(false)
            .idle_spin_us(20)
            .gpu_staging(staging)
            .gpu_staging_bytes(16 << 20)
            .gpu_stream_unit_bytes(8 << 20)
            .open()
            .expect("open store")
    }

    fn pool(device: &Arc<CudaDevice>, bytes: usize) -> DeviceBuffer {
        let buf = device.alloc(bytes).expect("cuMemAlloc");
        buf.fill(GUARD).expect("fill");
        buf
    }

    fn dev(buf: &DeviceBuffer, offset: usize, len: usize) -> Region<'static> {
        assert!(offset + len <= buf.len());
        // SAFETY: inside a live device allocation that outlives every read using the region.
        unsafe { Region::from_raw(buf.addr() + offset as u64, len, GPU0) }
    }

    fn read_back(buf: &DeviceBuffer) -> Vec<u8> {
        let mut out = vec![0u8; buf.len()];
        buf.read(0, &mut out).expect("read back");
        out
    }

    /// Page size p of object i: odd sizes, some below a row, some of several rows.
    fn sizes() -> Vec<usize> {
        vec![1, 4095, 4096, 12_345, 65_537, 300_001, 2 << 20]
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn bytes_land_on_the_callers_stream_and_a_second_stream_waiting_on_its_event_sees_them() {
        let device = gpu();
        for staging in [true, false] {
            let s = store(staging);
            s.prepare_gpu(0).expect("prepare");
            let sizes = sizes();
            let keys: Vec<Vec<u8>> = (0..sizes.len()).map(|i| format!("odd/{i}").into_bytes()).collect();
            for (k, &n) in keys.iter().zip(&sizes) {
                s.put(k, &value_for(k, 1, n), PutOptions::INSERT).expect("put");
            }
            // Each object in two pages, the second page below the first, 64 guard bytes apart.
            let total: usize = sizes.iter().sum::<usize>() + 128 * sizes.len();
            let pages = pool(&device, total);
            let mut dsts = Vec::new();
            let mut layout = Vec::new();
            let mut cursor = total;
            for &n in &sizes {
                let (first, second) = (n / 2, n - n / 2);
                cursor -= first + 64;
                let a = cursor;
                cursor -= second + 64;
                let b = cursor;
                dsts.push(vec![dev(&pages, a, first), dev(&pages, b, second)]);
                layout.push((a, first, b, second));
            }
            let stream = CudaStream::new(&device).expect("stream");
            let other = CudaStream::new(&device).expect("stream");
            let ready = CudaEvent::new(&device, false).expect("event");
            let check = pool(&device, total);
            // The stream is busy for a while: the copies queue behind this kernel.
            stream.spin(DELAY_NS).expect("spin");
            let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            // SAFETY: the pages outlive the stream's copies (synchronised below).
            let ticket = unsafe { s.batch_get_into_multi_buffers_on_stream(&key_refs, &dsts, stream.handle()) }
                .expect("enqueued");
            ready.record(stream.handle()).expect("record");
            other.wait_event(&ready, false).expect("wait");
            // SAFETY: both live allocations of `total` bytes.
            unsafe { other.copy_device(check.addr(), pages.addr(), total) }.expect("copy");
            // While the stream waits: upsert, force-remove and churn the objects.
            assert_eq!(ticket.status(), StreamStatus::Pending);
            assert_eq!(ticket.keys_pinned(), sizes.len());
            s.put(&keys[0], &value_for(&keys[0], 2, sizes[0]), PutOptions::UPSERT).expect("upsert");
            s.remove(&keys[6], true).expect("force remove");
            for i in 0..100u64 {
                let _ = s.put(format!("churn/{i}").as_bytes(), &vec![i as u8; 1 << 20], PutOptions::INSERT);
            }
            other.synchronize().expect("sync");
            let results = ticket.wait(Duration::from_secs(10)).expect("ended");
            assert_eq!(results, sizes.iter().map(|&n| Ok(n)).collect::<Vec<_>>(), "staging {staging}");
            for (name, buf) in [("destination", &pages), ("second stream's copy", &check)] {
                let got = read_back(buf);
                let mut guards = vec![true; total];
                for (i, &(a, first, b, second)) in layout.iter().enumerate() {
                    let want = value_for(&keys[i], 1, sizes[i]);
                    assert_eq!(&got[a..a + first], &want[..first], "{name}: key {i}, first page, staging {staging}");
                    assert_eq!(&got[b..b + second], &want[first..], "{name}: key {i}, second page");
                    guards[a..a + first].iter_mut().for_each(|g| *g = false);
                    guards[b..b + second].iter_mut().for_each(|g| *g = false);
                }
                assert!(got.iter().zip(&guards).all(|(&x, &g)| !g || x == GUARD), "{name}: a guard byte changed");
            }
            let g = s.stats().gpu;
            assert_eq!(g.stream_bound_reads, 1);
            wait_idle(&s);
            assert_eq!(ticket.keys_pinned(), 0);
        }
    }

    /// One step call of four layers behind a long kernel: even layers record the caller's
    /// event, odd ones write the caller's flag word. A second stream waits on each layer's
    /// signal in turn and copies that layer's region right then: every copy holds the layer's
    /// whole KV, so each signal came after its layer's copies.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_step_signals_each_layer_after_its_copies_with_events_and_flags() {
        let device = gpu();
        for staging in [true, false] {
            let s = store(staging);
            s.prepare_gpu(0).expect("prepare");
            let (layers, per_layer, len) = (4usize, 3usize, 300_001usize);
            let keys: Vec<Vec<Vec<u8>>> =
                (0..layers).map(|l| (0..per_layer).map(|k| format!("step/{l}/{k}").into_bytes()).collect()).collect();
            for key in keys.iter().flatten() {
                s.put(key, &value_for(key, 3, len), PutOptions::INSERT).expect("put");
            }
            let layer_bytes = per_layer * len;
            let out = pool(&device, layers * layer_bytes);
            let check = pool(&device, layers * layer_bytes);
            let flags = device.alloc(4 * layers).expect("flags");
            flags.fill(0).expect("zero flags");
            let events: Vec<CudaEvent> = (0..layers).map(|_| CudaEvent::new(&device, false).expect("event")).collect();
            let key_refs: Vec<Vec<&[u8]>> = keys.iter().map(|l| l.iter().map(Vec::as_slice).collect()).collect();
            // Each layer's objects in reverse order within its region.
            let dsts: Vec<Vec<Vec<Region<'static>>>> = (0..layers)
                .map(|l| {
                    (0..per_layer).map(|k| vec![dev(&out, l * layer_bytes + (per_layer - 1 - k) * len, len)]).collect()
                })
                .collect();
            let signal = |l: usize| {
                if l.is_multiple_of(2) {
                    StreamSignal::RecordEvent(events[l].handle())
                } else {
                    StreamSignal::WriteValue { addr: flags.addr() + 4 * l as u64, value: l as u32 + 1 }
                }
            };
            let step: Vec<StepLayer<'_, '_>> = (0..layers)
                .map(|l| StepLayer {
                    reads: StepReads::Objects { keys: &key_refs[l], dsts: &dsts[l] },
                    done: Some(signal(l)),
                })
                .collect();
            let stream = CudaStream::new(&device).expect("stream");
            let other = CudaStream::new(&device).expect("stream");
            stream.spin(DELAY_NS).expect("spin");
            // SAFETY: the pages, events and flags outlive the stream's work (synchronised below).
            let ticket = unsafe { s.step_on_stream(&step, stream.handle()) }.expect("step");
            assert_eq!(ticket.keys_pinned(), layers * per_layer);
            for (l, event) in events.iter().enumerate() {
                if l.is_multiple_of(2) {
                    other.wait_event(event, false).expect("wait event");
                } else {
                    // SAFETY: a word of the live flags buffer.
                    unsafe { other.wait_value(flags.addr() + 4 * l as u64, l as u32 + 1) }.expect("wait flag");
                }
                let at = (l * layer_bytes) as u64;
                // SAFETY: both live allocations; the range lies inside them.
                unsafe { other.copy_device(check.addr() + at, out.addr() + at, layer_bytes) }.expect("copy");
            }
            other.synchronize().expect("sync");
            let results = ticket.wait(Duration::from_secs(10)).expect("ended");
            assert_eq!(results, vec![Ok(len); layers * per_layer], "staging {staging}");
            let got = read_back(&check);
            for (l, layer) in keys.iter().enumerate() {
                for (k, key) in layer.iter().enumerate() {
                    let at = l * layer_bytes + (per_layer - 1 - k) * len;
                    assert!(got[at..at + len] == value_for(key, 3, len)[..], "layer {l} key {k}, staging {staging}");
                }
            }
            let g = s.stats().gpu;
            assert_eq!((g.stream_steps, g.stream_step_layers, g.stream_bound_reads), (1, layers as u64, 1));
            wait_idle(&s);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn ranges_on_a_stream_and_calls_during_capture() {
        let device = gpu();
        let s = store(true);
        s.put(b"a", &value_for(b"a", 0, 100_000), PutOptions::INSERT).expect("put");
        s.put(b"b", &value_for(b"b", 0, 777), PutOptions::INSERT).expect("put");
        let out = pool(&device, 4096);
        let frags = vec![vec![
            Fragment::new(b"a".to_vec(), 99_000, 0, 1000),
            Fragment::new(b"b".to_vec(), 7, 1000, 770),
            Fragment::new(b"b".to_vec(), 700, 2000, 100), // past the end of b
            Fragment::new(b"missing".to_vec(), 0, 3000, 10),
        ]];
        let stream = CudaStream::new(&device).expect("stream");
        let buffers = [dev(&out, 0, 4096)];
        // SAFETY: `out` outlives the copies (synchronised below).
        let ticket = unsafe { s.get_into_ranges_on_stream(&buffers, &frags, stream.handle()) }.expect("enqueued");
        stream.synchronize().expect("sync");
        let r = ticket.wait(Duration::from_secs(10)).expect("ended");
        assert_eq!(r[0], Ok(1000));
        assert_eq!(r[1], Ok(770));
        assert!(matches!(r[2], Err(Error::InvalidRange(_))), "{:?}", r[2]);
        assert_eq!(r[3], Err(Error::NotFound));
        let got = read_back(&out);
        assert_eq!(&got[..1000], &value_for(b"a", 0, 100_000)[99_000..]);
        assert_eq!(&got[1000..1770], &value_for(b"b", 0, 777)[7..]);
        assert!(got[1770..].iter().all(|&x| x == GUARD));

        // A stream being captured is refused; nothing is leased or enqueued.
        let captured = CudaStream::new(&device).expect("stream");
        captured.begin_capture().expect("capture");
        let dsts = vec![vec![dev(&out, 0, 777)]];
        // SAFETY: a refused call enqueues nothing.
        let refused = unsafe { s.batch_get_into_multi_buffers_on_stream(&[b"b"], &dsts, captured.handle()) };
        assert_eq!(refused.err(), Some(Error::StreamCapturing("active")));
        drop(captured.end_capture().expect("end capture"));
        wait_idle(&s);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn ssd_resident_keys_arrive_or_fail_through_the_status() {
        let device = gpu();
        for (seed, eio) in [(21u64, false), (22, true)] {
            let faults = if eio {
                SimFaults { read_eio_ppm: 1_000_000, ..SimFaults::default() }
            } else {
                SimFaults { us_per_mib: 20_000, ..SimFaults::default() }
            };
            let s = StoreBuilder::new()
                .dram_bytes(8 << 20)
                .shards(1)
                .pin_threads(false)
                .ssd_bytes(64 << 20)
                .ssd_segment_bytes(8 << 20)
                .simulated_ssd(seed, faults)
                .gpu_stream_unit_bytes(4 << 20)
                .open()
                .expect("open");
            let key = |i: u64| format!("ssd/{i}").into_bytes();
            let len = 300_001;
            for i in 0..40u64 {
                s.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
            }
            s.sync_shards().expect("sync");
            let pages = pool(&device, 2 * len + 128);
            // Key 0 is on SSD only, in two reordered pages; key 39 in DRAM.
            let half = len / 2;
            let dsts = vec![
                vec![dev(&pages, len + 64 - half, half), dev(&pages, 0, len - half)],
                vec![dev(&pages, len + 64, len)],
            ];
            let stream = CudaStream::new(&device).expect("stream");
            // SAFETY: the pool outlives the copies.
            let ticket =
                unsafe { s.batch_get_into_multi_buffers_on_stream(&[&key(0), &key(39)], &dsts, stream.handle()) }
                    .expect("enqueued");
            assert_eq!(s.stats().gpu.stream_bound_gated_keys, 1);
            stream.synchronize().expect("the stream passes the gate once the load ended");
            let r = ticket.wait(Duration::from_secs(10)).expect("ended");
            let got = read_back(&pages);
            assert_eq!(&got[len + 64..2 * len + 64], &value_for(&key(39), 39, len)[..], "the DRAM key");
            if eio {
                assert!(matches!(r[0], Err(Error::Io(_))), "{:?}", r[0]);
                assert!(matches!(ticket.status(), StreamStatus::Failed(ref f) if f.len() == 1 && f[0].0 == 0));
                assert!(got[..len + 64].iter().all(|&x| x == GUARD), "a failed load writes no page");
            } else {
                assert_eq!(r, vec![Ok(len), Ok(len)]);
                let want = value_for(&key(0), 0, len);
                assert_eq!(&got[len + 64 - half..len + 64], &want[..half]);
                assert_eq!(&got[..len - half], &want[half..]);
            }
            wait_idle(&s);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_graph_captured_once_waits_on_fresh_reads_every_step() {
        let device = gpu();
        let s = store(true);
        s.prepare_gpu(0).expect("prepare");
        const LAYERS: usize = 4;
        const STEPS: u64 = 3;
        let layer_bytes = 256 << 10;
        let key = |step: u64, layer: usize| format!("step{step}/layer{layer}").into_bytes();
        for step in 0..STEPS {
            for layer in 0..LAYERS {
                let k = key(step, layer);
                s.put(&k, &value_for(&k, step, layer_bytes), PutOptions::INSERT).expect("put");
            }
        }
        let kv = pool(&device, LAYERS * layer_bytes);
        let out = pool(&device, LAYERS * layer_bytes);
        let load = CudaStream::new(&device).expect("stream");
        let compute = CudaStream::new(&device).expect("stream");
        let events: Vec<CudaEvent> = (0..LAYERS).map(|_| CudaEvent::new(&device, false).expect("event")).collect();
        // Captured once: per layer, an external wait on that layer's event, some compute, and a
        // copy of the layer's KV into the output (what attention would read).
        compute.begin_capture().expect("capture");
        for (layer, event) in events.iter().enumerate() {
            compute.wait_event(event, true).expect("external wait");
            compute.spin(200_000).expect("compute");
            let at = (layer * layer_bytes) as u64;
            // SAFETY: both live allocations; the graph runs while they live.
            unsafe { compute.copy_device(out.addr() + at, kv.addr() + at, layer_bytes) }.expect("consume");
        }
        let graph = compute.end_capture().expect("graph");
        for step in 0..STEPS {
            let mut tickets = Vec::new();
            for (layer, event) in events.iter().enumerate() {
                let k = key(step, layer);
                let dsts = vec![vec![dev(&kv, layer * layer_bytes, layer_bytes)]];
                // SAFETY: `kv` outlives the copies (the step is synchronised below).
                let t = unsafe { s.batch_get_into_multi_buffers_on_stream(&[&k], &dsts, load.handle()) }.expect("read");
                event.record(load.handle()).expect("record");
                tickets.push(t);
            }
            graph.launch(&compute).expect("launch");
            compute.synchronize().expect("step");
            let got = read_back(&out);
            for layer in 0..LAYERS {
                let k = key(step, layer);
                let want = value_for(&k, step, layer_bytes);
                assert_eq!(
                    &got[layer * layer_bytes..(layer + 1) * layer_bytes],
                    &want[..],
                    "step {step} layer {layer}"
                );
            }
            for t in &tickets {
                assert_eq!(t.wait(Duration::from_secs(10)).expect("ended"), vec![Ok(layer_bytes)]);
            }
        }
        wait_idle(&s);
    }
}
