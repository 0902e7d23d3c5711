//! Stream-bound reads (`*_on_stream`) on the embedded engine, driven through a simulated
//! stream: a transport whose "stream" is a queue of copies, gate waits and completion marks
//! that the test runs when it chooses, as a GPU would. Checks what the CUDA tests check on the
//! H200 without a GPU: the bytes arrive only when the stream runs, the objects stay leased until
//! the engine saw the stream pass the copies (so upserts, removes and eviction in between
//! change nothing), SSD-resident keys wait on their gate and a failed load skips their copies,
//! the TTL backstop, capture refusal, and every counter back at zero.

mod common;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{value_for, wait_idle};
use kvtide::transport::{Direction, EarlyStart, Gate, InFlight, Progress, StreamSubmit, Transfer, TransportError};
use kvtide::{
    Engine, Error, Fragment, MemoryKind, PutOptions, Region, StepLayer, StepReads, Store, StoreBuilder, StreamHandle,
    StreamSignal, StreamStatus, StreamTicket, Transport, MAX_STEP_LAYERS,
};

/// The stream handle the simulated transport reports as being captured.
const CAPTURING: StreamHandle = 0xCA97;
/// The "GPU" of the simulated device memory (host memory behind `MemoryKind::Device`).
const GPU: MemoryKind = MemoryKind::Device { ordinal: 3 };

#[derive(Default)]
struct SimGate(AtomicU8);

impl Gate for SimGate {
    fn open(&self, ok: bool) {
        let _ = self.0.compare_exchange(0, if ok { 1 } else { 2 }, Ordering::AcqRel, Ordering::Acquire);
    }
    fn state(&self) -> Option<bool> {
        match self.0.load(Ordering::Acquire) {
            0 => None,
            v => Some(v == 1),
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

enum Op {
    Wait(Arc<SimGate>),
    Copy { src: u64, dst: u64, len: usize, gate: Option<Arc<SimGate>> },
    Mark(Arc<AtomicBool>),
    Signal(StreamSignal),
}

/// What a simulated stream did, in order: a copy's destination, or a signal.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Did {
    Copied(u64),
    Signalled(StreamSignal),
}

/// Streams as queues of operations, run by the test.
#[derive(Default)]
struct SimStreams {
    queues: Mutex<HashMap<StreamHandle, VecDeque<Op>>>,
    gates_made: std::sync::atomic::AtomicUsize,
    /// Transfers handed to `submit_on_stream`, all submissions together.
    transfers: std::sync::atomic::AtomicUsize,
    did: Mutex<Vec<Did>>,
}

impl SimStreams {
    /// Runs `stream` until it is empty or waits on a closed gate; true when empty.
    fn run(&self, stream: StreamHandle) -> bool {
        let mut queues = self.queues.lock().expect("lock");
        let queue = queues.entry(stream).or_default();
        while let Some(op) = queue.front() {
            match op {
                Op::Wait(gate) if gate.state().is_none() => return false,
                Op::Wait(_) => {}
                Op::Copy { src, dst, len, gate } => {
                    if gate.as_ref().is_none_or(|g| g.state() == Some(true)) {
                        // SAFETY: the engine keeps the source leased and the test keeps the
                        // destination alive until the stream passed this copy.
                        unsafe { std::ptr::copy_nonoverlapping(*src as *const u8, *dst as *mut u8, *len) };
                    }
                }
                Op::Mark(done) => done.store(true, Ordering::Release),
                Op::Signal(StreamSignal::WriteValue { addr, value }) => {
                    // SAFETY: the test's flag word, a live aligned u32.
                    unsafe { (*addr as *mut u32).write_volatile(*value) };
                }
                Op::Signal(StreamSignal::RecordEvent(_)) => {}
            }
            match op {
                Op::Copy { dst, .. } => self.did.lock().expect("lock").push(Did::Copied(*dst)),
                Op::Signal(signal) => self.did.lock().expect("lock").push(Did::Signalled(*signal)),
                _ => {}
            }
            queue.pop_front();
        }
        true
    }

    /// Runs `stream` until empty, waiting for its gates to open.
    fn run_to_end(&self, stream: StreamHandle) {
        let started = Instant::now();
        while !self.run(stream) {
            assert!(started.elapsed() < Duration::from_secs(20), "a gate never opened");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

struct SimProgress {
    done: Arc<AtomicBool>,
    transfers: usize,
    streams: Arc<SimStreams>,
    stream: StreamHandle,
}

impl Progress for SimProgress {
    fn poll(&mut self) -> bool {
        self.done.load(Ordering::Acquire)
    }
    fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        vec![Ok(()); self.transfers]
    }
    /// A waiter that cannot leave (a store shutting down) lets the stream run, as a GPU would.
    fn block(&mut self) {
        while !self.poll() {
            self.streams.run(self.stream);
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A transport whose device memory is host memory and whose streams are `SimStreams`.
struct SimTransport(Arc<SimStreams>);

impl Transport for SimTransport {
    fn name(&self) -> &'static str {
        "sim-stream"
    }
    fn completes_inline(&self) -> bool {
        false
    }
    fn check(&self, lists: &[&[Region<'_>]], _writable: bool) -> Vec<Option<TransportError>> {
        lists.iter().map(|_| None).collect()
    }
    unsafe fn submit(
        &self,
        _direction: Direction,
        _transfers: &[Transfer],
        _early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        Err(TransportError::Io("the simulated stream transport only submits on streams".into()))
    }
    fn on_stream(&self) -> Option<&dyn StreamSubmit> {
        Some(self)
    }
}

impl StreamSubmit for SimTransport {
    fn check_stream(&self, stream: StreamHandle) -> Result<u32, TransportError> {
        if stream == CAPTURING {
            return Err(TransportError::StreamCapturing("active"));
        }
        Ok(3)
    }
    fn gate(&self, _ordinal: u32) -> Result<Arc<dyn Gate>, TransportError> {
        self.0.gates_made.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(SimGate::default()))
    }
    fn prepare(&self, _ordinal: u32) -> Result<(), TransportError> {
        Ok(())
    }
    unsafe fn submit_on_stream(
        &self,
        stream: StreamHandle,
        transfers: &[Transfer],
        gates: &[Option<Arc<dyn Gate>>],
    ) -> Result<InFlight, TransportError> {
        self.0.transfers.fetch_add(transfers.len(), Ordering::Relaxed);
        let mut queues = self.0.queues.lock().expect("lock");
        let queue = queues.entry(stream).or_default();
        // Objects in DRAM first, then each loading one behind its gate (as the CUDA transport).
        let mut order: Vec<usize> = (0..transfers.len()).collect();
        order.sort_by_key(|&i| gates[i].is_some());
        for (t, gate) in order.iter().map(|&i| (&transfers[i], &gates[i])) {
            let gate: Option<Arc<SimGate>> = gate.as_ref().map(|g| {
                let g = Arc::clone(g);
                assert!(g.as_any().is::<SimGate>());
                // SAFETY: checked above: the Arc holds a SimGate.
                unsafe { Arc::from_raw(Arc::into_raw(g).cast::<SimGate>()) }
            });
            if let Some(g) = &gate {
                queue.push_back(Op::Wait(Arc::clone(g)));
            }
            for p in &t.pieces {
                queue.push_back(Op::Copy {
                    src: t.host + p.host_offset,
                    dst: p.addr,
                    len: p.len as usize,
                    gate: gate.clone(),
                });
            }
        }
        let done = Arc::new(AtomicBool::new(false));
        queue.push_back(Op::Mark(Arc::clone(&done)));
        let streams = Arc::clone(&self.0);
        Ok(InFlight::new(Box::new(SimProgress { done, transfers: transfers.len(), streams, stream })))
    }
    unsafe fn signal(&self, stream: StreamHandle, signal: StreamSignal) -> Result<(), TransportError> {
        signal.check()?;
        self.0.queues.lock().expect("lock").entry(stream).or_default().push_back(Op::Signal(signal));
        Ok(())
    }
}

/// "Device" memory: a leaked host buffer the simulated stream writes into.
fn device_buffer(len: usize, fill: u8) -> &'static mut [u8] {
    Box::leak(vec![fill; len].into_boxed_slice())
}

fn device_region(buf: &[u8], offset: usize, len: usize) -> Region<'static> {
    assert!(offset + len <= buf.len());
    // SAFETY: leaked buffers live for the process; the simulated transport writes them.
    unsafe { Region::from_raw(buf.as_ptr() as u64 + offset as u64, len, GPU) }
}

fn store(configure: impl FnOnce(StoreBuilder) -> StoreBuilder) -> Engine {
    configure(StoreBuilder::new().dram_bytes(32 << 20).shards(2).pin_threads(false).idle_spin_us(20))
        .open()
        .expect("open")
}

fn wait_ended(ticket: &StreamTicket) -> Vec<kvtide::Result<usize>> {
    ticket.wait(Duration::from_secs(20)).expect("the engine saw the stream pass the copies")
}

#[test]
fn bytes_arrive_with_the_stream_and_the_objects_stay_leased_until_it_passed_them() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let s = store(|b| b);
    let key = |i: u64| format!("layer/{i}").into_bytes();
    let sizes = [4096usize, 1, 12_345, 64 << 10, 3 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        s.put(&key(i as u64), &value_for(&key(i as u64), 1, len), PutOptions::INSERT).expect("put");
    }
    // Odd sizes scattered over pages in reverse order, with guard bytes between them.
    let total: usize = sizes.iter().sum::<usize>() + 64 * 1024;
    let dev = device_buffer(total, 0xEE);
    let mut dsts = Vec::new();
    let mut layout = Vec::new();
    let mut cursor = total;
    for &len in &sizes {
        let (first, second) = (len / 2, len - len / 2);
        cursor -= second + 64;
        let b = cursor;
        cursor -= first + 64;
        let a = cursor;
        dsts.push(vec![device_region(dev, b, second), device_region(dev, a, first)]);
        layout.push((b, second, a, first));
    }
    let keys: Vec<Vec<u8>> = (0..sizes.len() as u64).map(key).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let stream: StreamHandle = 0x51;
    // SAFETY: the destinations are leaked; the simulated stream is run below.
    let ticket =
        unsafe { s.batch_get_on_stream_via(&key_refs, &dsts, stream, Some(Arc::clone(&transport))) }.expect("enqueued");
    assert_eq!(ticket.status(), StreamStatus::Pending);
    assert_eq!(ticket.keys_pinned(), sizes.len());
    assert!(dev.iter().all(|&b| b == 0xEE), "nothing is written before the stream runs");
    // The store changes underneath while the stream has not run: an upsert, a forced remove
    // and enough new objects to evict everything evictable.
    s.put(&key(0), &value_for(&key(0), 2, sizes[0]), PutOptions::UPSERT).expect("upsert");
    s.remove(&key(1), true).expect("force remove");
    for i in 0..40u64 {
        let _ = s.put(format!("filler/{i}").as_bytes(), &vec![i as u8; 1 << 20], PutOptions::INSERT);
    }
    let held = s.stats().total;
    assert!(held.leases_held + held.published_leases_held >= sizes.len() as u64);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(ticket.status(), StreamStatus::Pending, "the stream has not passed the copies");
    streams.run_to_end(stream);
    let results = wait_ended(&ticket);
    assert_eq!(results, sizes.iter().map(|&n| Ok(n)).collect::<Vec<_>>());
    assert_eq!(ticket.status(), StreamStatus::Done);
    assert_eq!(ticket.keys_pinned(), 0);
    for (i, &(b, second, a, first)) in layout.iter().enumerate() {
        let want = value_for(&key(i as u64), 1, sizes[i]);
        // The object fills its pages in list order: the page at `b` (higher in memory) gets
        // its first `second` bytes.
        let mut got = dev[b..b + second].to_vec();
        got.extend_from_slice(&dev[a..a + first]);
        assert_eq!(got, want, "key {i}: the old version's bytes, in page order");
        assert!(dev[b + second..b + second + 64].iter().all(|&x| x == 0xEE), "guard after page {i}");
        assert!(dev[a + first..a + first + 64].iter().all(|&x| x == 0xEE), "guard after page {i}");
    }
    let g = s.stats().gpu;
    assert_eq!((g.stream_bound_reads, g.stream_bound_failed_keys, g.stream_bound_gated_keys), (1, 0, 0));
    wait_idle(&s);
}

#[test]
fn per_key_failures_and_range_reads_on_a_stream() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let s = store(|b| b);
    s.put(b"a", &value_for(b"a", 0, 1000), PutOptions::INSERT).expect("put");
    s.put(b"b", &value_for(b"b", 0, 500), PutOptions::INSERT).expect("put");
    let dev = device_buffer(4096, 0);
    let dsts = vec![
        vec![device_region(dev, 0, 1000)],
        vec![device_region(dev, 1000, 999)], // one byte short
        vec![device_region(dev, 2000, 10)],
        vec![device_region(dev, 3000, 500)],
    ];
    let keys: [&[u8]; 4] = [b"a", b"a", b"missing", b"b"];
    // SAFETY: leaked destinations; the stream is run below.
    let ticket = unsafe { s.batch_get_on_stream_via(&keys, &dsts, 7, Some(Arc::clone(&transport))) }.expect("enqueued");
    streams.run_to_end(7);
    let r = wait_ended(&ticket);
    assert_eq!(r[0], Ok(1000));
    assert!(matches!(r[1], Err(Error::SizeMismatch { .. })), "{:?}", r[1]);
    assert_eq!(r[2], Err(Error::NotFound));
    assert_eq!(r[3], Ok(500));
    match ticket.status() {
        StreamStatus::Failed(failed) => assert_eq!(failed.iter().map(|f| f.0).collect::<Vec<_>>(), vec![1, 2]),
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(&dev[..1000], &value_for(b"a", 0, 1000)[..]);
    assert!(dev[1000..2000].iter().all(|&x| x == 0), "a failed key writes nothing");
    assert_eq!(&dev[3000..3500], &value_for(b"b", 0, 500)[..]);

    // Ranges: two keys into one buffer, one fragment out of its object's bounds.
    let out = device_buffer(256, 0x11);
    let frags = vec![vec![
        Fragment::new(b"a".to_vec(), 10, 0, 100),
        Fragment::new(b"b".to_vec(), 0, 100, 50),
        Fragment::new(b"b".to_vec(), 490, 150, 20),
        Fragment::new(b"a".to_vec(), 900, 200, 50),
    ]];
    let buffers = [device_region(out, 0, 256)];
    // SAFETY: as above.
    let ticket = unsafe { s.get_into_ranges_on_stream_via(&buffers, &frags, 9, Some(Arc::clone(&transport))) }
        .expect("enqueued");
    assert_eq!(ticket.len(), 4);
    streams.run_to_end(9);
    let r = wait_ended(&ticket);
    assert_eq!(r[0], Ok(100));
    assert_eq!(r[1], Ok(50));
    assert!(matches!(r[2], Err(Error::InvalidRange(_))), "{:?}", r[2]);
    assert_eq!(r[3], Ok(50));
    assert_eq!(&out[..100], &value_for(b"a", 0, 1000)[10..110]);
    assert_eq!(&out[100..150], &value_for(b"b", 0, 500)[..50]);
    assert!(out[150..200].iter().all(|&x| x == 0x11), "the bad fragment wrote nothing");
    assert_eq!(&out[200..250], &value_for(b"a", 0, 1000)[900..950]);

    // A page's K then V (the object's next bytes into the same buffer) share one transfer; the
    // same key's bytes from elsewhere in the object, or into another buffer, do not.
    let paged = device_buffer(2048, 0x22);
    let other = device_buffer(16, 0x33);
    let frags = vec![
        vec![
            Fragment::new(b"a".to_vec(), 0, 1024, 500),
            Fragment::new(b"a".to_vec(), 500, 0, 500),
            Fragment::new(b"a".to_vec(), 0, 1600, 10),
        ],
        vec![Fragment::new(b"a".to_vec(), 10, 0, 16)],
    ];
    let buffers = [device_region(paged, 0, 2048), device_region(other, 0, 16)];
    let before = streams.transfers.load(Ordering::Relaxed);
    // SAFETY: as above.
    let ticket = unsafe { s.get_into_ranges_on_stream_via(&buffers, &frags, 11, Some(Arc::clone(&transport))) }
        .expect("enqueued");
    assert_eq!(streams.transfers.load(Ordering::Relaxed) - before, 3, "K and V of one page: one transfer");
    streams.run_to_end(11);
    assert_eq!(wait_ended(&ticket), vec![Ok(500), Ok(500), Ok(10), Ok(16)]);
    let a = value_for(b"a", 0, 1000);
    assert_eq!(&paged[1024..1524], &a[..500]);
    assert_eq!(&paged[..500], &a[500..]);
    assert_eq!(&paged[1600..1610], &a[..10]);
    assert_eq!(&other[..], &a[10..26]);
    assert!(paged[500..1024].iter().all(|&x| x == 0x22), "nothing between the pages");
    // Call-level errors: fragments for a buffer that is not there; a list per key.
    // SAFETY: nothing is enqueued by failing calls.
    unsafe {
        assert!(matches!(
            s.get_into_ranges_on_stream_via(&[], &frags, 9, Some(Arc::clone(&transport))),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            s.batch_get_on_stream_via(&keys, &dsts[..1], 9, Some(Arc::clone(&transport))),
            Err(Error::InvalidArgument(_))
        ));
    }
    wait_idle(&s);
}

#[test]
fn a_capturing_stream_is_refused_and_stream_zero_is_the_blocking_read() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let s = store(|b| b);
    s.put(b"k", &[5u8; 300], PutOptions::INSERT).expect("put");
    let dev = device_buffer(300, 0);
    let dsts = vec![vec![device_region(dev, 0, 300)]];
    // SAFETY: refused calls enqueue nothing.
    let refused = unsafe { s.batch_get_on_stream_via(&[b"k"], &dsts, CAPTURING, Some(Arc::clone(&transport))) };
    assert_eq!(refused.err(), Some(Error::StreamCapturing("active")));
    assert_eq!(s.stats().gpu.stream_bound_reads, 0);
    wait_idle(&s);
    // Stream 0: today's blocking read, complete on return (host memory here).
    let mut host = vec![0u8; 300];
    let dsts = vec![vec![Region::host(&mut host)]];
    // SAFETY: a blocking read of a live local buffer.
    let ticket = unsafe { s.batch_get_into_multi_buffers_on_stream(&[b"k"], &dsts, 0) }.expect("blocking");
    assert_eq!(ticket.status(), StreamStatus::Done);
    drop(dsts);
    assert_eq!(host, vec![5u8; 300]);
    // Host destinations on a stream are written by the CPU before the call returns.
    let mut host = vec![0u8; 300];
    let dsts = vec![vec![Region::host(&mut host)]];
    // SAFETY: as above.
    let ticket = unsafe { s.batch_get_on_stream_via(&[b"k"], &dsts, 0x99, Some(Arc::clone(&transport))) }.expect("ok");
    assert_eq!(ticket.results(), Some(vec![Ok(300)]));
    drop(dsts);
    assert_eq!(host, vec![5u8; 300]);
    if !kvtide::transport::cuda::BUILT_WITH_CUDA {
        // Without the cuda feature the store's own transport has no streams.
        let dsts = vec![vec![device_region(dev, 0, 300)]];
        // SAFETY: refused calls enqueue nothing.
        let r = unsafe { s.batch_get_into_multi_buffers_on_stream(&[b"k"], &dsts, 0x1234) };
        assert!(matches!(r, Err(Error::CudaUnavailable(_))), "{r:?}");
        assert!(matches!(s.prepare_gpu(0), Err(Error::CudaUnavailable(_))));
    }
    wait_idle(&s);
}

#[test]
fn a_stream_that_never_passes_the_copies_expires_and_releases_its_leases() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let s = store(|b| b.gpu_stream_ttl_ms(100));
    s.put(b"k", &[9u8; 4096], PutOptions::INSERT).expect("put");
    let dev = device_buffer(4096, 0);
    let dsts = vec![vec![device_region(dev, 0, 4096)]];
    // SAFETY: leaked destination.
    let ticket = unsafe { s.batch_get_on_stream_via(&[b"k"], &dsts, 5, Some(Arc::clone(&transport))) }.expect("ok");
    drop(ticket); // dropping neither blocks nor cancels
                  // SAFETY: as above.
    let ticket = unsafe { s.batch_get_on_stream_via(&[b"k"], &dsts, 5, Some(Arc::clone(&transport))) }.expect("ok");
    let r = wait_ended(&ticket);
    assert_eq!(r, vec![Err(Error::StreamExpired { ttl_ms: 100 })]);
    assert_eq!(ticket.keys_pinned(), 0);
    // The dropped ticket's read expires on its own shard, maybe a little later.
    let started = Instant::now();
    while s.stats().gpu.stream_bound_expired < 2 {
        assert!(started.elapsed() < Duration::from_secs(10), "the first read never expired");
        std::thread::sleep(Duration::from_millis(2));
    }
    s.sync_shards().expect("sync");
    let held = s.stats().total;
    assert_eq!((held.leases_held, held.published_leases_held), (0, 0), "the backstop released the leases");
    assert_eq!(s.stats().gpu.stream_bound_expired, 2);
    assert_eq!(s.stats().gpu.stream_bound_in_flight, 2, "still watched until the stream passes");
    streams.run_to_end(5);
    wait_idle(&s);
}

fn ssd_store(seed: u64, faults: kvtide::SimFaults) -> Engine {
    StoreBuilder::new()
        .dram_bytes(8 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(8 << 20)
        .simulated_ssd(seed, faults)
        .open()
        .expect("open")
}

#[test]
fn ssd_resident_keys_wait_on_their_gate_and_a_failed_load_skips_their_copies() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    // A slow disk: the call returns while the loads still run.
    let s = ssd_store(11, kvtide::SimFaults { us_per_mib: 20_000, ..kvtide::SimFaults::default() });
    let key = |i: u64| format!("kv/{i}").into_bytes();
    let len = 512 << 10;
    for i in 0..40u64 {
        s.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    s.sync_shards().expect("sync");
    assert!(s.stats().total.demotions > 0);
    let loads = s.stats().total.loads;
    // Key 0 is on SSD only; key 39 is in DRAM.
    let dev = device_buffer(2 * len + 64, 0xEE);
    let dsts = vec![vec![device_region(dev, 0, len)], vec![device_region(dev, len + 64, len)]];
    let started = Instant::now();
    // SAFETY: leaked destinations; the stream is run below.
    let ticket = unsafe { s.batch_get_on_stream_via(&[&key(0), &key(39)], &dsts, 3, Some(Arc::clone(&transport))) }
        .expect("enqueued");
    let returned_after = started.elapsed();
    assert_eq!(s.stats().gpu.stream_bound_gated_keys, 1, "key 0 was leased while it loads");
    // The DRAM key's copies come first and do not wait on the gate.
    streams.run(3);
    assert_eq!(&dev[len + 64..], &value_for(&key(39), 39, len)[..], "the DRAM key is copied at once");
    streams.run_to_end(3);
    let r = wait_ended(&ticket);
    assert_eq!(r, vec![Ok(len), Ok(len)]);
    assert_eq!(&dev[..len], &value_for(&key(0), 0, len)[..]);
    assert!(dev[len..len + 64].iter().all(|&x| x == 0xEE));
    assert_eq!(s.stats().total.loads, loads + 1);
    assert!(returned_after < Duration::from_secs(5));
    wait_idle(&s);
    drop(s);

    // Every SSD read fails: the gate opens failed, the copy is skipped, the key fails.
    let s = ssd_store(12, kvtide::SimFaults { read_eio_ppm: 1_000_000, ..kvtide::SimFaults::default() });
    for i in 0..40u64 {
        s.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    s.sync_shards().expect("sync");
    let dev = device_buffer(2 * len, 0xEE);
    let dsts = vec![vec![device_region(dev, 0, len)], vec![device_region(dev, len, len)]];
    // SAFETY: as above.
    let ticket = unsafe { s.batch_get_on_stream_via(&[&key(0), &key(39)], &dsts, 4, Some(Arc::clone(&transport))) }
        .expect("enqueued");
    streams.run_to_end(4);
    let r = wait_ended(&ticket);
    assert!(matches!(r[0], Err(Error::Io(_))), "{:?}", r[0]);
    assert_eq!(r[1], Ok(len));
    assert!(dev[..len].iter().all(|&x| x == 0xEE), "the failed key's destination is untouched");
    assert_eq!(&dev[len..], &value_for(&key(39), 39, len)[..]);
    assert_eq!(s.stats().gpu.stream_bound_failed_keys, 1);
    wait_idle(&s);
}

#[test]
fn many_reads_on_many_streams_all_release_their_leases() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let s = store(|b| b);
    for i in 0..64u64 {
        s.put(format!("k{i}").as_bytes(), &value_for(format!("k{i}").as_bytes(), 0, 8192), PutOptions::INSERT)
            .expect("put");
    }
    let dev = device_buffer(64 * 8192, 0);
    let mut tickets = Vec::new();
    for i in 0..64u64 {
        let key = format!("k{i}");
        let dsts = vec![vec![device_region(dev, i as usize * 8192, 8192)]];
        // SAFETY: leaked destinations.
        let t =
            unsafe { s.batch_get_on_stream_via(&[key.as_bytes()], &dsts, 100 + i % 4, Some(Arc::clone(&transport))) }
                .expect("enqueued");
        tickets.push(t);
    }
    assert_eq!(s.stats().gpu.stream_bound_keys_pinned, 64);
    for stream in 100..104 {
        streams.run_to_end(stream);
    }
    for t in &tickets {
        assert_eq!(wait_ended(t), vec![Ok(8192)]);
    }
    for i in 0..64usize {
        assert_eq!(&dev[i * 8192..(i + 1) * 8192], &value_for(format!("k{i}").as_bytes(), 0, 8192)[..]);
    }
    wait_idle(&s);
    assert_eq!(streams.gates_made.load(Ordering::Relaxed), 0);
}

// ---- step calls: every layer of a step in one call --------------------------------------------

/// Three layers of two 64 KiB objects each into one "device" buffer, per layer its signal: the
/// first two record events, the last writes a flag word.
struct StepFixture {
    store: Engine,
    streams: Arc<SimStreams>,
    transport: Arc<dyn Transport>,
    keys: Vec<Vec<Vec<u8>>>,
    dev: &'static mut [u8],
    flag: &'static mut u32,
}

const STEP_LAYERS: usize = 3;
const STEP_KEYS: usize = 2;
const STEP_LEN: usize = 64 << 10;

fn step_fixture() -> StepFixture {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let store = store(|b| b);
    let keys: Vec<Vec<Vec<u8>>> =
        (0..STEP_LAYERS).map(|l| (0..STEP_KEYS).map(|k| format!("step/l{l}/k{k}").into_bytes()).collect()).collect();
    for layer in &keys {
        for key in layer {
            store.put(key, &value_for(key, 7, STEP_LEN), PutOptions::INSERT).expect("put");
        }
    }
    let dev = device_buffer(STEP_LAYERS * STEP_KEYS * STEP_LEN, 0xEE);
    let flag = Box::leak(Box::new(0u32));
    StepFixture { store, streams, transport, keys, dev, flag }
}

impl StepFixture {
    /// Key k of layer l goes to slot l * STEP_KEYS + k of the buffer.
    fn region(&self, l: usize, k: usize) -> Region<'static> {
        device_region(self.dev, (l * STEP_KEYS + k) * STEP_LEN, STEP_LEN)
    }

    fn signal(&self, l: usize) -> StreamSignal {
        if l + 1 < STEP_LAYERS {
            StreamSignal::RecordEvent(100 + l as u64)
        } else {
            StreamSignal::WriteValue { addr: &*self.flag as *const u32 as u64, value: 7 }
        }
    }
}

#[test]
fn a_step_enqueues_each_layer_then_its_signal_and_leases_every_key_once() {
    let f = step_fixture();
    let key_refs: Vec<Vec<&[u8]>> = f.keys.iter().map(|l| l.iter().map(Vec::as_slice).collect()).collect();
    let dsts: Vec<Vec<Vec<Region<'static>>>> =
        (0..STEP_LAYERS).map(|l| (0..STEP_KEYS).map(|k| vec![f.region(l, k)]).collect()).collect();
    let layers: Vec<StepLayer<'_, '_>> = (0..STEP_LAYERS)
        .map(|l| StepLayer {
            reads: StepReads::Objects { keys: &key_refs[l], dsts: &dsts[l] },
            done: Some(f.signal(l)),
        })
        .collect();
    let stream: StreamHandle = 0x57;
    // SAFETY: the destinations and the flag are leaked; the simulated stream is run below.
    let ticket = unsafe { f.store.step_on_stream_via(&layers, stream, Some(Arc::clone(&f.transport))) }.expect("step");
    assert_eq!(ticket.len(), STEP_LAYERS * STEP_KEYS);
    assert_eq!(ticket.keys_pinned(), STEP_LAYERS * STEP_KEYS, "every key leased until the stream passed");
    assert!(f.dev.iter().all(|&b| b == 0xEE) && *f.flag == 0, "nothing happens before the stream runs");
    f.streams.run_to_end(stream);
    assert_eq!(wait_ended(&ticket), vec![Ok(STEP_LEN); STEP_LAYERS * STEP_KEYS]);
    // The stream ran layer 0's copies, its signal, layer 1's copies, its signal, ...
    let did = f.streams.did.lock().expect("lock").clone();
    let base = f.dev.as_ptr() as u64;
    let mut expected_layer = 0;
    let mut copies_in_layer = 0;
    for d in &did {
        match d {
            Did::Copied(dst) => {
                let l = ((dst - base) as usize / STEP_LEN) / STEP_KEYS;
                assert_eq!(l, expected_layer, "a copy of layer {l} ran in layer {expected_layer}'s place: {did:?}");
                copies_in_layer += 1;
            }
            Did::Signalled(signal) => {
                assert_eq!(*signal, f.signal(expected_layer), "{did:?}");
                assert_eq!(copies_in_layer, STEP_KEYS, "layer {expected_layer} signalled after all its copies");
                expected_layer += 1;
                copies_in_layer = 0;
            }
        }
    }
    assert_eq!(expected_layer, STEP_LAYERS, "every layer signalled once: {did:?}");
    assert_eq!(*f.flag, 7);
    for (l, layer) in f.keys.iter().enumerate() {
        for (k, key) in layer.iter().enumerate() {
            let at = (l * STEP_KEYS + k) * STEP_LEN;
            assert!(f.dev[at..at + STEP_LEN] == value_for(key, 7, STEP_LEN)[..], "layer {l} key {k}");
        }
    }
    let g = f.store.stats().gpu;
    assert_eq!((g.stream_steps, g.stream_step_layers), (1, STEP_LAYERS as u64));
    assert_eq!(g.stream_bound_reads, 1, "one read: one lease round trip for the whole step");
    wait_idle(&f.store);
}

#[test]
fn a_step_layer_whose_reads_fail_is_still_signalled_and_ranges_work_too() {
    let f = step_fixture();
    // Layer 0: a missing key beside a good one; layer 1: only missing keys; layer 2: ranges.
    let l0_keys: Vec<&[u8]> = vec![b"step/missing", &f.keys[0][1]];
    let l1_keys: Vec<&[u8]> = vec![b"step/gone/a", b"step/gone/b"];
    let l0_dsts = vec![vec![f.region(0, 0)], vec![f.region(0, 1)]];
    let l1_dsts = vec![vec![f.region(1, 0)], vec![f.region(1, 1)]];
    let buffer = [device_region(f.dev, 2 * STEP_KEYS * STEP_LEN, STEP_KEYS * STEP_LEN)];
    let half = (STEP_LEN / 2) as u64;
    let frags = vec![vec![
        Fragment::new(f.keys[2][0].clone(), half, 0, half),
        Fragment::new(f.keys[2][1].clone(), 0, STEP_LEN as u64, half),
    ]];
    let layers = [
        StepLayer { reads: StepReads::Objects { keys: &l0_keys, dsts: &l0_dsts }, done: Some(f.signal(0)) },
        StepLayer { reads: StepReads::Objects { keys: &l1_keys, dsts: &l1_dsts }, done: Some(f.signal(1)) },
        StepLayer { reads: StepReads::Ranges { buffers: &buffer, fragments: &frags }, done: Some(f.signal(2)) },
    ];
    let stream: StreamHandle = 0x58;
    // SAFETY: as above.
    let ticket = unsafe { f.store.step_on_stream_via(&layers, stream, Some(Arc::clone(&f.transport))) }.expect("step");
    f.streams.run_to_end(stream);
    let results = wait_ended(&ticket);
    assert_eq!(results[0], Err(Error::NotFound));
    assert_eq!(results[1], Ok(STEP_LEN));
    assert_eq!(results[2..4], [Err(Error::NotFound), Err(Error::NotFound)]);
    assert_eq!(results[4..6], [Ok(STEP_LEN / 2), Ok(STEP_LEN / 2)]);
    let signals: Vec<StreamSignal> = f
        .streams
        .did
        .lock()
        .expect("lock")
        .iter()
        .filter_map(|d| match d {
            Did::Signalled(s) => Some(*s),
            Did::Copied(_) => None,
        })
        .collect();
    assert_eq!(signals, (0..STEP_LAYERS).map(|l| f.signal(l)).collect::<Vec<_>>(), "every layer signalled");
    let at = 2 * STEP_KEYS * STEP_LEN;
    assert!(f.dev[at..at + STEP_LEN / 2] == value_for(&f.keys[2][0], 7, STEP_LEN)[STEP_LEN / 2..]);
    assert!(
        f.dev[at + STEP_LEN..at + STEP_LEN + STEP_LEN / 2] == value_for(&f.keys[2][1], 7, STEP_LEN)[..STEP_LEN / 2]
    );
    assert!(f.dev[at + STEP_LEN / 2..at + STEP_LEN].iter().all(|&b| b == 0xEE), "nothing outside the ranges");
    wait_idle(&f.store);
}

#[test]
fn a_bad_step_is_refused_before_anything_is_leased_or_enqueued() {
    let f = step_fixture();
    let keys: Vec<&[u8]> = vec![&f.keys[0][0]];
    let at = |l: usize| vec![vec![f.region(l, 0)]];
    let (d0, d1) = (at(0), at(1));
    // Layer 1's destination overlaps layer 0's by one byte.
    let overlapping = vec![vec![device_region(f.dev, STEP_LEN - 1, STEP_LEN)]];
    let layer = |dsts, done| StepLayer { reads: StepReads::Objects { keys: &keys, dsts }, done };
    let stream: StreamHandle = 0x59;
    let refused = |layers: &[StepLayer<'_, '_>], stream: StreamHandle| {
        // SAFETY: the destinations are leaked; a refused step enqueues nothing.
        unsafe { f.store.step_on_stream_via(layers, stream, Some(Arc::clone(&f.transport))) }.expect_err("refused")
    };
    let e = refused(&[layer(&d0, None), layer(&overlapping, None)], stream);
    assert!(matches!(&e, Error::InvalidArgument(why) if why.contains("overlap")), "{e}");
    let e = refused(&[layer(&d0, Some(StreamSignal::RecordEvent(0)))], stream);
    assert!(matches!(&e, Error::InvalidArgument(why) if why.contains("event")), "{e}");
    let misaligned = StreamSignal::WriteValue { addr: &*f.flag as *const u32 as u64 + 1, value: 1 };
    assert!(matches!(refused(&[layer(&d0, Some(misaligned))], stream), Error::InvalidArgument(_)));
    let too_many: Vec<StepLayer<'_, '_>> = (0..=MAX_STEP_LAYERS).map(|_| layer(&d1, None)).collect();
    assert!(matches!(refused(&too_many, stream), Error::InvalidArgument(_)));
    assert!(matches!(refused(&[layer(&d0, Some(f.signal(0)))], 0), Error::InvalidArgument(_)));
    assert!(matches!(refused(&[layer(&d0, None), layer(&d1, None)], CAPTURING), Error::StreamCapturing(_)));
    assert!(f.streams.queues.lock().expect("lock").values().all(VecDeque::is_empty), "nothing enqueued");
    assert!(f.dev.iter().all(|&b| b == 0xEE));
    assert_eq!(f.store.stats().gpu.stream_bound_reads, 0, "nothing leased");
    // Stream 0 without signals is the blocking read of every layer (into host memory here: the
    // blocking path has no simulated GPU).
    let mut host = vec![0u8; STEP_LEN];
    let host_dst = vec![vec![Region::host(&mut host)]];
    // SAFETY: as above.
    let ticket = unsafe { f.store.step_on_stream_via(&[layer(&host_dst, None)], 0, Some(Arc::clone(&f.transport))) };
    assert_eq!(ticket.expect("blocking").results(), Some(vec![Ok(STEP_LEN)]));
    drop(host_dst);
    assert!(host == value_for(&f.keys[0][0], 7, STEP_LEN));
    wait_idle(&f.store);
}

/// A step whose SSD-resident keys add up to more than the shard's restore budget: every key is
/// leased before the call returns (no wait for earlier loads to end), the loads past the budget
/// are queued behind it and start as earlier ones end, and every byte lands once the stream ran.
#[test]
fn a_step_past_the_restore_budget_is_leased_at_once_and_its_loads_queue() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let s = StoreBuilder::new()
        .dram_bytes(16 << 20)
        .shards(1)
        .pin_threads(false)
        .ssd_bytes(64 << 20)
        .ssd_segment_bytes(8 << 20)
        .restore_budget_bytes(1 << 20)
        .simulated_ssd(21, kvtide::SimFaults { us_per_mib: 20_000, ..kvtide::SimFaults::default() })
        .open()
        .expect("open");
    let key = |i: u64| format!("deep/{i}").into_bytes();
    let len = 512 << 10;
    let (layers, per_layer) = (4usize, 2usize);
    for i in 0..(layers * per_layer) as u64 {
        s.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    for i in 0..40u64 {
        s.put(format!("filler/{i}").as_bytes(), &vec![1u8; len], PutOptions::INSERT).expect("filler");
    }
    s.sync_shards().expect("sync");
    let keys: Vec<Vec<u8>> = (0..(layers * per_layer) as u64).map(key).collect();
    let key_refs: Vec<Vec<&[u8]>> = keys.chunks(per_layer).map(|c| c.iter().map(Vec::as_slice).collect()).collect();
    let dev = device_buffer(layers * per_layer * len, 0xEE);
    let dsts: Vec<Vec<Vec<Region<'static>>>> = (0..layers)
        .map(|l| (0..per_layer).map(|k| vec![device_region(dev, (l * per_layer + k) * len, len)]).collect())
        .collect();
    let step: Vec<StepLayer<'_, '_>> = (0..layers)
        .map(|l| StepLayer {
            reads: StepReads::Objects { keys: &key_refs[l], dsts: &dsts[l] },
            done: Some(StreamSignal::RecordEvent(1 + l as u64)),
        })
        .collect();
    let waits = s.stats().total.restore_waits;
    // SAFETY: leaked destinations; the stream is run below.
    let ticket = unsafe { s.step_on_stream_via(&step, 9, Some(Arc::clone(&transport))) }.expect("step");
    let t = s.stats().total;
    assert_eq!(ticket.keys_pinned(), layers * per_layer, "every key leased before the call returned");
    assert_eq!(t.restore_waits, waits, "no lease waited for the budget");
    assert!(t.deferred_loads >= (layers * per_layer) as u64 - 2, "loads past the 1 MiB budget queued: {t:?}");
    // A key whose load ended before its layer was enqueued needs no gate (a slow machine can
    // let the first ones land); the last layer's loads queue behind three layers' and are gated.
    let gated = s.stats().gpu.stream_bound_gated_keys;
    assert!(gated >= per_layer as u64 && gated <= (layers * per_layer) as u64, "gated keys: {gated}");
    streams.run_to_end(9);
    assert_eq!(wait_ended(&ticket), vec![Ok(len); layers * per_layer]);
    for (i, k) in keys.iter().enumerate() {
        assert!(dev[i * len..(i + 1) * len] == value_for(k, i as u64, len)[..], "key {i}");
    }
    wait_idle(&s);
}

/// A failed load in a later layer of a step fails that layer's key (its copies skipped behind
/// the gate), not a key of an earlier layer: the gated keys' results are the step's slots.
#[test]
fn a_failed_load_in_a_later_layer_fails_its_own_key() {
    let streams = Arc::new(SimStreams::default());
    let transport: Arc<dyn Transport> = Arc::new(SimTransport(Arc::clone(&streams)));
    let s = ssd_store(13, kvtide::SimFaults { read_eio_ppm: 1_000_000, ..kvtide::SimFaults::default() });
    let key = |i: u64| format!("kv/{i}").into_bytes();
    let len = 512 << 10;
    for i in 0..40u64 {
        s.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    s.sync_shards().expect("sync");
    // Layer 0: key 39, in DRAM; layer 1: key 0, on SSD only, whose load fails.
    let dev = device_buffer(2 * len, 0xEE);
    let (k39, k0) = (key(39), key(0));
    let (l0, l1): ([&[u8]; 1], [&[u8]; 1]) = ([&k39], [&k0]);
    let (d0, d1) = (vec![vec![device_region(dev, 0, len)]], vec![vec![device_region(dev, len, len)]]);
    let step = [
        StepLayer { reads: StepReads::Objects { keys: &l0, dsts: &d0 }, done: Some(StreamSignal::RecordEvent(1)) },
        StepLayer { reads: StepReads::Objects { keys: &l1, dsts: &d1 }, done: Some(StreamSignal::RecordEvent(2)) },
    ];
    // SAFETY: leaked destinations; the stream is run below.
    let ticket = unsafe { s.step_on_stream_via(&step, 5, Some(Arc::clone(&transport))) }.expect("step");
    streams.run_to_end(5);
    let r = wait_ended(&ticket);
    assert_eq!(r[0], Ok(len), "the DRAM key of layer 0 keeps its result: {r:?}");
    assert!(matches!(r[1], Err(Error::Io(_))), "layer 1's failed load fails its own key: {r:?}");
    assert_eq!(&dev[..len], &value_for(&key(39), 39, len)[..]);
    assert!(dev[len..].iter().all(|&x| x == 0xEE), "the failed key's destination is untouched");
    wait_idle(&s);
}
