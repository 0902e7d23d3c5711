//! Pipelined SSD restore on the simulated disk: overlap of loads and transfers (from the
//! sub-batch trace), identical results in every mode, failures mapped to their keys,
//! cancellation, oversized objects, concurrent requests; staging credits and leases return to
//! zero after each.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::value_for;
use kvtide::transport::{Direction, EarlyStart, InFlight, Summary, Transfer, TransportError};
use kvtide::{
    Engine, Error, MemcpyTransport, PutOptions, Region, RestoreMode, RestoreOptions, SimFaults, Store, StoreBuilder,
    SubBatchState, Throttled, Transport,
};

const MIB: usize = 1 << 20;

fn slow_disk() -> SimFaults {
    // ~1 GB/s with 200 us per operation.
    SimFaults { latency_us: 200, us_per_mib: 1000, ..SimFaults::default() }
}

fn store(faults: SimFaults, staging_bytes: u64) -> Engine {
    StoreBuilder::new()
        .dram_bytes(32 << 20)
        .shards(2)
        .pin_threads(false)
        .idle_spin_us(10)
        .ssd_bytes(256 << 20)
        .ssd_segment_bytes(16 << 20)
        .simulated_ssd(7, faults)
        .promote_on_hit(false)
        .restore_staging_bytes(staging_bytes)
        .restore_sub_batch_bytes(2 << 20)
        .open()
        .expect("open")
}

fn key(i: usize) -> Vec<u8> {
    format!("restore/{i}").into_bytes()
}

/// Puts `n` objects of `len` bytes, then enough filler that they are all demoted to SSD.
fn fill(store: &Engine, n: usize, len: usize) {
    for i in 0..n {
        store.put(&key(i), &value_for(&key(i), 0, len), PutOptions::INSERT).expect("put");
    }
    for f in 0..48 {
        let k = format!("filler/{f}").into_bytes();
        store.put(&k, &vec![1u8; MIB], PutOptions::INSERT).expect("filler");
    }
    store.sync_shards().expect("sync");
}

fn buffers(n: usize, len: usize) -> Vec<Vec<u8>> {
    (0..n).map(|_| vec![0u8; len]).collect()
}

fn restore(store: &Engine, keys: &[Vec<u8>], bufs: &mut [Vec<u8>], opts: &RestoreOptions) -> kvtide::RestoreReport {
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let dsts: Vec<Vec<Region<'_>>> =
        bufs.iter_mut().map(|b| b.chunks_mut(256 << 10).map(Region::host).collect()).collect();
    store.restore_batch(&refs, &dsts, opts)
}

fn assert_idle(store: &Engine) {
    store.sync_shards().expect("sync");
    let held = store.stats().held_resources();
    assert!(held.is_zero(), "resources still held: {held:?}");
}

#[test]
fn loads_overlap_transfers_and_every_mode_agrees() {
    let store = store(slow_disk(), 16 << 20);
    let n = 16;
    fill(&store, n, MIB);
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    let loads_before = store.stats().total.loads;
    let transfer: Arc<dyn Transport> = Arc::new(Throttled { inner: MemcpyTransport, bytes_per_sec: 1 << 30 });
    let mut reports = Vec::new();
    for mode in [RestoreMode::Barrier, RestoreMode::Serialized, RestoreMode::Pipelined] {
        let opts =
            RestoreOptions { mode, trace: true, host_transport: Some(transfer.clone()), ..store.restore_options() };
        let mut bufs = buffers(n, MIB);
        let report = restore(&store, &keys, &mut bufs, &opts);
        for i in 0..n {
            assert_eq!(report.results[i], Ok(MIB), "{mode:?} key {i}");
            assert_eq!(bufs[i], value_for(&keys[i], 0, MIB), "{mode:?} key {i} bytes");
        }
        assert_idle(&store);
        reports.push((mode, report));
    }
    assert!(store.stats().total.loads >= loads_before + 3 * n as u64 - 4, "objects were read from SSD");
    let (_, pipelined) = &reports[2];
    let trace = &pipelined.sub_batches;
    assert!(trace.len() >= 4, "several sub-batches: {trace:?}");
    assert!(trace.iter().all(|t| t.state == SubBatchState::Released));
    // Every sub-batch went Loading -> Ready -> Transferring -> Verifying -> Released, its time
    // in Ready inside its timeline.
    use SubBatchState::*;
    for t in trace {
        let states: Vec<SubBatchState> = t.path.iter().map(|&(s, _)| s).collect();
        assert_eq!(states, [Loading, Ready, Transferring, Verifying, Released], "{}", t.to_json_line());
        assert!(t.path.windows(2).all(|w| w[0].1 <= w[1].1), "{}", t.to_json_line());
        assert!(t.load_start_us <= t.ready_us && t.ready_us <= t.transfer_start_us, "{}", t.to_json_line());
        assert_eq!(t.failed_keys, 0);
    }
    assert!(!pipelined.cancelled);
    let stats = store.stats().restore;
    assert_eq!((stats.failed_sub_batches, stats.drained_sub_batches, stats.cancelled_requests), (0, 0, 0));
    // The point of the pipeline: a sub-batch's load starts before the previous transfer ends.
    let overlapped = trace.windows(2).filter(|w| w[1].load_start_us < w[0].transfer_end_us).count();
    assert!(overlapped >= trace.len() / 2, "loads must overlap transfers: {}", lines(trace));
    // Serialized never overlaps.
    let (_, serialized) = &reports[1];
    assert!(serialized.sub_batches.windows(2).all(|w| w[1].load_start_us >= w[0].release_us));
    // JSON lines export.
    assert!(trace[0].to_json_line().starts_with("{\"index\":0,"));
    println!(
        "barrier {} us, serialized {} us, pipelined {} us",
        reports[0].1.elapsed_us, reports[1].1.elapsed_us, reports[2].1.elapsed_us
    );
}

/// A store on a simulated disk of `us_per_mib` per MiB, `n` SSD-resident 1 MiB objects restored
/// through `link` (None: CPU copies) in 1 MiB sub-batches (one object and its record header
/// each), four of which fit in the 5 MiB each shard may keep ahead; every key checked.
fn restore_mib_objects(us_per_mib: u64, n: usize, link: Option<Arc<dyn Transport>>) -> (Engine, kvtide::RestoreReport) {
    let store = store(SimFaults { latency_us: 200, us_per_mib, ..SimFaults::default() }, 16 << 20);
    fill(&store, n, MIB);
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    let opts = RestoreOptions {
        target_bytes: MIB as u64,
        ahead_bytes: 5 << 20,
        trace: true,
        host_transport: link,
        ..store.restore_options()
    };
    let mut bufs = buffers(n, MIB);
    let report = restore(&store, &keys, &mut bufs, &opts);
    for i in 0..n {
        assert_eq!(report.results[i], Ok(MIB), "key {i}");
        assert_eq!(bufs[i], value_for(&keys[i], 0, MIB), "key {i} bytes");
    }
    (store, report)
}

#[test]
fn a_disk_bound_restore_deepens_its_loads_up_to_ahead_bytes() {
    // Loads (4 ms per MiB) far slower than transfers (CPU copies): the transfer stage keeps
    // finding its next sub-batch still loading, so the request deepens its queue, up to the
    // bytes it may keep ahead per shard.
    let n = 24;
    let (store, report) = restore_mib_objects(4000, n, None);
    let trace = &report.sub_batches;
    assert_eq!(trace.len(), n, "one object per sub-batch: {}", lines(trace));
    // It starts two deep (the first transfer starts as early as it can) ...
    assert!(trace.iter().take(4).all(|t| depth_at(trace, t) <= 2), "{}", lines(trace));
    // ... and ends four deep: as deep as 5 MiB allows, never deeper.
    let deepest = trace.iter().map(|t| depth_at(trace, t)).max().unwrap_or(0);
    assert_eq!(deepest, 4, "four 1 MiB loads ahead per shard at most: {}", lines(trace));
    assert_idle(&store);
}

#[test]
fn a_disk_far_behind_its_link_gets_the_whole_window_after_the_first_transfer() {
    // Loads of 50 ms per MiB against CPU copies of a fraction of a millisecond (a GPU restore
    // from a slow disk): the first sub-batch's wait alone shows it, so the sub-batches requested
    // right after its transfer already fill the 5 MiB window (four per shard), instead of
    // deepening two at a time over later waits.
    let (store, report) = restore_mib_objects(50_000, 16, None);
    let trace = &report.sub_batches;
    let loaded: Vec<&kvtide::SubBatchTrace> = trace.iter().filter(|t| t.staging_bytes > 0).collect();
    assert!(loaded.len() >= 2, "{}", lines(trace));
    // Two deep at first ...
    assert!(loaded.iter().take(4).all(|t| depth_at(trace, t) <= 2), "{}", lines(trace));
    // ... and four deep among those requested before the second transfer ended.
    let mut ends: Vec<u64> = loaded.iter().map(|t| t.transfer_end_us).collect();
    ends.sort_unstable();
    let second_done = ends[1];
    let early = loaded.iter().filter(|t| t.load_start_us < second_done).map(|t| depth_at(trace, t)).max();
    assert_eq!(early, Some(4), "the whole window after the first transfer: {}", lines(trace));
    assert_idle(&store);
}

/// CPU copies, but the second submission stalls for `stall`: the loads requested meanwhile land.
struct StallSecond {
    submissions: std::sync::atomic::AtomicUsize,
    stall: Duration,
}

impl Transport for StallSecond {
    fn name(&self) -> &'static str {
        "stall-second"
    }

    fn completes_inline(&self) -> bool {
        true
    }

    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        _early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        if self.submissions.fetch_add(1, Ordering::SeqCst) == 1 {
            std::thread::sleep(self.stall);
        }
        // SAFETY: forwarded contract.
        unsafe { MemcpyTransport.submit(direction, transfers, None) }
    }
}

#[test]
fn a_request_at_full_depth_transfers_the_sub_batches_that_landed_in_one_submission() {
    // The disk far behind the link (50 ms per MiB against CPU copies): full depth after the
    // first transfer. The second transfer stalls while the loads in flight land; the transfer
    // stage then takes those that landed behind the oldest in one submission, not one each.
    let n = 16;
    let link = Arc::new(StallSecond { submissions: Default::default(), stall: Duration::from_millis(600) });
    let (store, report) = restore_mib_objects(50_000, n, Some(link.clone()));
    let trace = &report.sub_batches;
    assert_eq!(trace.len(), n, "one object per sub-batch: {}", lines(trace));
    let mut starts: Vec<u64> = trace.iter().map(|t| t.transfer_start_us).collect();
    starts.dedup();
    let most = starts.iter().map(|s| trace.iter().filter(|t| t.transfer_start_us == *s).count()).max();
    assert!(most >= Some(3), "landed sub-batches share a submission: {}", lines(trace));
    // Fewer submissions than sub-batches, every key delivered once, nothing held after.
    assert!(link.submissions.load(Ordering::SeqCst) < n, "{}", lines(trace));
    assert_idle(&store);
}

#[test]
fn a_sub_batch_that_lands_before_the_oldest_is_transferred_first() {
    // Shard 0's disk is busy with another request's loads (320 ms of them), shard 1's is idle.
    // The restore's oldest sub-batch is shard 0's; shard 1's lands long before it, and the
    // transfer stage takes it first instead of idling the link behind the oldest.
    let store = store(SimFaults { latency_us: 200, us_per_mib: 40_000, ..SimFaults::default() }, 16 << 20);
    let on_shard = |shard: usize, skip: usize| (0..).map(key).filter(|k| store.shard_of(k) == shard).nth(skip);
    let busy: Vec<Vec<u8>> = (0..8).filter_map(|i| on_shard(0, i)).collect();
    let keys: Vec<Vec<u8>> = [on_shard(0, 8), on_shard(1, 0)].into_iter().flatten().collect();
    assert_eq!((busy.len(), keys.len()), (8, 2));
    for k in busy.iter().chain(&keys) {
        store.put(k, &value_for(k, 0, MIB), PutOptions::INSERT).expect("put");
    }
    for f in 0..48 {
        store.put(format!("filler/{f}").as_bytes(), &vec![1u8; MIB], PutOptions::INSERT).expect("filler");
    }
    store.sync_shards().expect("sync");
    let loads_before = store.stats().shards[0].loads;
    std::thread::scope(|scope| {
        let busy_restore = scope.spawn(|| {
            let mut bufs = buffers(busy.len(), MIB);
            let opts = RestoreOptions { mode: RestoreMode::Barrier, ..store.restore_options() };
            restore(&store, &busy, &mut bufs, &opts).results
        });
        // Shard 0 has the other request's loads queued before this request's.
        let queued = std::time::Instant::now();
        while store.stats().shards[0].loads < loads_before + busy.len() as u64 {
            assert!(queued.elapsed() < Duration::from_secs(10), "the other request's loads never started");
            std::thread::sleep(Duration::from_millis(1));
        }
        let opts = RestoreOptions { target_bytes: MIB as u64, trace: true, ..store.restore_options() };
        let mut bufs = buffers(keys.len(), MIB);
        let report = restore(&store, &keys, &mut bufs, &opts);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(report.results[i], Ok(MIB), "key {i}");
            assert_eq!(bufs[i], value_for(k, 0, MIB), "key {i} bytes");
        }
        let trace = &report.sub_batches;
        // The trace is in plan order: shard 0's sub-batch is the oldest.
        assert_eq!(trace.iter().map(|t| (t.index, t.shard)).collect::<Vec<_>>(), [(0, 0), (1, 1)]);
        let start_of = |shard: usize| trace.iter().find(|t| t.shard == shard).map(|t| t.transfer_start_us);
        assert!(start_of(1) < start_of(0), "shard 1's sub-batch went first: {}", lines(trace));
        let busy_results = busy_restore.join().expect("the other request");
        assert!(busy_results.iter().all(|r| *r == Ok(MIB)), "{busy_results:?}");
    });
    assert_idle(&store);
}

/// Sub-batches of `t`'s shard requested and not yet transferred when `t` was requested.
fn depth_at(trace: &[kvtide::SubBatchTrace], t: &kvtide::SubBatchTrace) -> usize {
    trace
        .iter()
        .filter(|o| o.shard == t.shard && o.load_start_us <= t.load_start_us && t.load_start_us < o.release_us)
        .count()
}

fn lines(trace: &[kvtide::SubBatchTrace]) -> String {
    trace.iter().map(|t| t.to_json_line()).collect::<Vec<_>>().join("\n")
}

#[test]
fn ordering_duplicates_missing_keys_and_wrong_sizes() {
    let store = store(SimFaults::default(), 8 << 20);
    fill(&store, 12, 300 << 10);
    let mut keys: Vec<Vec<u8>> = (0..12).map(key).collect();
    keys.insert(3, key(7)); // duplicate
    keys.insert(5, b"restore/missing".to_vec());
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let mut bufs = buffers(keys.len(), 300 << 10);
    let mut short = vec![0u8; 1000];
    let baseline =
        store.batch_get_into_multi_buffers(&refs, &bufs.iter_mut().map(|b| vec![Region::host(b)]).collect::<Vec<_>>());
    for mode in [RestoreMode::Pipelined, RestoreMode::Serialized, RestoreMode::Barrier] {
        let mut bufs = buffers(keys.len(), 300 << 10);
        let mut dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b)]).collect();
        dsts[8] = vec![Region::host(&mut short)];
        let opts = RestoreOptions { mode, ..store.restore_options() };
        let report = store.restore_batch(&refs, &dsts, &opts);
        drop(dsts);
        assert_eq!(report.results[5], Err(Error::NotFound), "{mode:?}");
        assert!(matches!(report.results[8], Err(Error::SizeMismatch { .. })), "{mode:?}");
        for (i, r) in report.results.iter().enumerate() {
            if i != 5 && i != 8 {
                assert_eq!(r, &baseline[i], "{mode:?} key {i} same as unpipelined");
                assert_eq!(bufs[i], value_for(&keys[i], 0, 300 << 10), "{mode:?} key {i}");
            }
        }
        assert!(short.iter().all(|&b| b == 0), "a failed key's destination is untouched");
        assert_idle(&store);
    }
}

/// `batch_get_into` (each object into the start of a buffer that may be larger) restores
/// SSD-resident objects through the pipeline too: one call, every object loaded once, larger
/// buffers filled at their start only, a too-small buffer failing its key alone.
#[test]
fn batch_get_into_larger_buffers_restores_through_the_pipeline() {
    let store = store(SimFaults::default(), 8 << 20);
    let len = 300 << 10;
    fill(&store, 12, len);
    let mut keys: Vec<Vec<u8>> = (0..12).map(key).collect();
    keys.insert(4, b"restore/missing".to_vec());
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let room = |i: usize| if i == 9 { len - 1 } else { len + 4096 * (i % 3) };
    let mut bufs: Vec<Vec<u8>> = (0..keys.len()).map(|i| vec![0xAB; room(i)]).collect();
    let (loads, requests) = (store.stats().total.loads, store.stats().restore.requests);
    let dsts: Vec<Region<'_>> = bufs.iter_mut().map(|b| Region::host(b)).collect();
    let results = store.batch_get_into(&refs, &dsts);
    drop(dsts);
    assert_eq!(store.stats().restore.requests, requests + 1, "restored in one pipelined request");
    assert_eq!(store.stats().total.loads, loads + 11, "each key that fits loaded once, the one too large not at all");
    for (i, r) in results.iter().enumerate() {
        match i {
            4 => assert_eq!(r, &Err(Error::NotFound)),
            9 => {
                assert_eq!(r, &Err(Error::BufferTooSmall { object_bytes: len as u64, buffer_bytes: (len - 1) as u64 }));
                assert!(bufs[i].iter().all(|&b| b == 0xAB), "a failed key's buffer is untouched");
            }
            _ => {
                assert_eq!(r, &Ok(len), "key {i}");
                assert!(bufs[i][..len] == value_for(&keys[i], 0, len), "bytes of key {i}");
                assert!(bufs[i][len..].iter().all(|&b| b == 0xAB), "past the object, key {i}'s buffer is untouched");
            }
        }
    }
    assert_idle(&store);
    // Destinations that cannot hold their objects (here none at all: how the Python layer asks
    // for sizes) fail with the object's size, and nothing is loaded for them.
    let loads = store.stats().total.loads;
    let none: Vec<Vec<Region<'_>>> = refs.iter().map(|_| Vec::new()).collect();
    let sizes = store.batch_get_into_multi_buffers(&refs, &none);
    for (i, r) in sizes.iter().enumerate() {
        match i {
            4 => assert_eq!(r, &Err(Error::NotFound)),
            _ => assert_eq!(r, &Err(Error::SizeMismatch { object_bytes: len as u64, destination_bytes: 0 }), "key {i}"),
        }
    }
    // One key at a time too.
    for i in 0..refs.len() {
        let one = store.batch_get_into_multi_buffers(&refs[i..=i], &none[i..=i]);
        let want = if i == 4 {
            Error::NotFound
        } else {
            Error::SizeMismatch { object_bytes: len as u64, destination_bytes: 0 }
        };
        assert_eq!(one, vec![Err(want)], "key {i} alone");
    }
    assert_eq!(store.stats().total.loads, loads, "no load for a key that cannot fit");
    assert_idle(&store);
}

#[test]
fn read_errors_fail_only_their_keys() {
    let faults = SimFaults { read_eio_ppm: 250_000, ..SimFaults::default() };
    let store = store(faults, 8 << 20);
    fill(&store, 24, 256 << 10);
    let keys: Vec<Vec<u8>> = (0..24).map(key).collect();
    let mut bufs = buffers(24, 256 << 10);
    let report = restore(&store, &keys, &mut bufs, &RestoreOptions { trace: true, ..store.restore_options() });
    let mut failed = 0;
    for (i, r) in report.results.iter().enumerate() {
        match r {
            Ok(n) => {
                assert_eq!(*n, 256 << 10);
                assert_eq!(bufs[i], value_for(&keys[i], 0, 256 << 10), "key {i}");
            }
            Err(Error::Io(_)) => failed += 1,
            Err(e) => panic!("key {i}: {e}"),
        }
    }
    assert!(failed > 0 && failed < 24, "EIO hits some keys only ({failed})");
    // The sub-batches with a failed load ended Failed (then Released), the others Verifying.
    let failing: Vec<_> = report.sub_batches.iter().filter(|t| t.failed_keys > 0).collect();
    assert_eq!(failing.iter().map(|t| t.failed_keys).sum::<usize>(), failed, "{}", lines(&report.sub_batches));
    for t in &report.sub_batches {
        let states: Vec<SubBatchState> = t.path.iter().map(|&(s, _)| s).collect();
        let end = if t.failed_keys > 0 { SubBatchState::Failed } else { SubBatchState::Verifying };
        assert_eq!(states[states.len() - 2..], [end, SubBatchState::Released], "{}", t.to_json_line());
    }
    assert_eq!(store.stats().restore.failed_sub_batches, failing.len() as u64);
    assert_idle(&store);
}

#[test]
fn cancellation_drains_and_releases() {
    let store = store(slow_disk(), 8 << 20);
    fill(&store, 16, MIB);
    let keys: Vec<Vec<u8>> = (0..16).map(key).collect();
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = RestoreOptions {
        cancel: Some(Arc::clone(&cancel)),
        trace: true,
        host_transport: Some(Arc::new(Throttled { inner: MemcpyTransport, bytes_per_sec: 256 << 20 })),
        ..store.restore_options()
    };
    let mut bufs = buffers(16, MIB);
    let report = std::thread::scope(|scope| {
        // Cancelled once a sub-batch holds staging credits (it is loading), however slow the
        // machine: a fixed delay could land before the first load or after the last.
        scope.spawn(|| {
            let started = std::time::Instant::now();
            while store.stats().restore.credits_held_bytes == 0 && started.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_micros(100));
            }
            cancel.store(true, Ordering::Release);
        });
        restore(&store, &keys, &mut bufs, &opts)
    });
    let delivered = report.results.iter().filter(|r| r.is_ok()).count();
    assert!(delivered < 16, "cancel stops the restore early");
    for (i, r) in report.results.iter().enumerate() {
        match r {
            Ok(_) => assert_eq!(bufs[i], value_for(&keys[i], 0, MIB)),
            Err(Error::Cancelled) => {}
            Err(e) => panic!("key {i}: {e}"),
        }
    }
    // The sub-batches in flight when it was cancelled drained: their loads ended, nothing was
    // copied, then they were released. Nothing else was loaded after that.
    assert!(report.cancelled);
    let drained: Vec<_> =
        report.sub_batches.iter().filter(|t| t.path.iter().any(|&(s, _)| s == SubBatchState::Draining)).collect();
    assert!(!drained.is_empty(), "{}", lines(&report.sub_batches));
    for t in &drained {
        let states: Vec<SubBatchState> = t.path.iter().map(|&(s, _)| s).collect();
        assert_eq!(states.last(), Some(&SubBatchState::Released));
        assert!(!states.contains(&SubBatchState::Transferring), "{}", t.to_json_line());
    }
    let stats = store.stats().restore;
    assert_eq!(stats.cancelled_requests, 1);
    assert_eq!(stats.drained_sub_batches, drained.len() as u64);
    assert_idle(&store);
}

#[test]
fn single_and_oversized_objects() {
    // Staging budget 4 MiB; one object of 6 MiB exceeds it and runs alone.
    let store = store(SimFaults::default(), 4 << 20);
    store.put(b"big", &value_for(b"big", 0, 6 * MIB), PutOptions::INSERT).expect("big");
    fill(&store, 3, MIB);
    let keys = [b"big".to_vec(), key(0), key(1), key(2)];
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let mut big = vec![0u8; 6 * MIB];
    let mut small = buffers(3, MIB);
    let mut dsts: Vec<Vec<Region<'_>>> = vec![vec![Region::host(&mut big)]];
    dsts.extend(small.iter_mut().map(|b| vec![Region::host(b)]));
    let report = store.restore_batch(&refs, &dsts, &store.restore_options());
    drop(dsts);
    assert_eq!(report.results[0], Ok(6 * MIB));
    assert_eq!(big, value_for(b"big", 0, 6 * MIB));
    for (i, buf) in small.iter().enumerate() {
        assert_eq!(report.results[i + 1], Ok(MIB));
        assert_eq!(buf, &value_for(&key(i), 0, MIB));
    }
    assert!(store.stats().restore.peak_credits_bytes <= 4 << 20, "credits never exceed the budget");
    // Single-object request.
    let mut one = vec![0u8; MIB];
    let r = store.restore_batch(&[&key(1)], &[vec![Region::host(&mut one)]], &store.restore_options());
    assert_eq!(r.results, vec![Ok(MIB)]);
    assert_eq!(one, value_for(&key(1), 0, MIB));
    assert_idle(&store);
}

#[test]
fn concurrent_requests_share_bounded_staging() {
    let store = Arc::new(store(slow_disk(), 6 << 20));
    fill(&store, 32, 512 << 10);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let keys: Vec<Vec<u8>> = (0..32).map(|i| key((i * 7 + t * 5) % 32)).collect();
                let mut bufs = buffers(32, 512 << 10);
                let report = restore(&store, &keys, &mut bufs, &store.restore_options());
                for (i, r) in report.results.iter().enumerate() {
                    assert_eq!(r, &Ok(512 << 10), "thread {t} key {i}");
                    assert_eq!(bufs[i], value_for(&keys[i], 0, 512 << 10));
                }
                report.credit_waits
            })
        })
        .collect();
    let waits: u64 = threads.into_iter().map(|t| t.join().expect("thread")).sum();
    let stats = store.stats();
    assert!(stats.restore.peak_credits_bytes <= 6 << 20, "{:?}", stats.restore);
    assert!(waits > 0, "four requests over a 6 MiB budget must wait for credits");
    assert_idle(&store);
}

/// Fails every transfer of exactly `fail_len` bytes (a link that drops them); copies the rest.
struct FlakyTransfer {
    fail_len: u64,
}

impl Transport for FlakyTransfer {
    fn name(&self) -> &'static str {
        "flaky"
    }

    fn completes_inline(&self) -> bool {
        true
    }

    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        _early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        let mut results = Vec::new();
        for t in transfers {
            if t.bytes() == self.fail_len {
                results.push(Err(TransportError::Io("link down".into())));
                continue;
            }
            // SAFETY: forwarded contract.
            let copied = unsafe { MemcpyTransport.submit(direction, std::slice::from_ref(t), None) }?.wait();
            results.extend(copied);
        }
        Ok(InFlight::completed(results, Summary::default()))
    }
}

#[test]
fn transfer_failures_fail_only_their_keys() {
    let store = store(SimFaults::default(), 8 << 20);
    fill(&store, 6, 512 << 10);
    store.put(b"odd", &value_for(b"odd", 0, 100_000), PutOptions::INSERT).expect("odd");
    let keys = [key(0), b"odd".to_vec(), key(1), key(2)];
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let mut bufs: Vec<Vec<u8>> =
        vec![vec![0u8; 512 << 10], vec![0u8; 100_000], vec![0u8; 512 << 10], vec![0u8; 512 << 10]];
    let dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b)]).collect();
    let opts = RestoreOptions {
        host_transport: Some(Arc::new(FlakyTransfer { fail_len: 100_000 })),
        ..store.restore_options()
    };
    let report = store.restore_batch(&refs, &dsts, &opts);
    drop(dsts);
    assert!(matches!(report.results[1], Err(Error::Io(_))), "{:?}", report.results[1]);
    for i in [0, 2, 3] {
        assert_eq!(report.results[i], Ok(512 << 10));
        assert_eq!(bufs[i], value_for(&keys[i], 0, 512 << 10));
    }
    // A failed copy fails its sub-batch (one), not the request.
    assert_eq!(store.stats().restore.failed_sub_batches, 1);
    assert_idle(&store);
}

/// Without a GPU (CI), a device destination fails its own key with `CudaUnavailable` (in every
/// build), SSD- and DRAM-resident host keys of the same restore still arrive, and nothing stays
/// held. The GPU tests cover device destinations on a real device.
#[test]
fn device_destinations_without_a_gpu_fail_only_their_keys() {
    let store = store(slow_disk(), 16 << 20);
    let n = 6;
    fill(&store, n, MIB);
    let hot = b"restore/hot".to_vec();
    store.put(&hot, &value_for(&hot, 0, MIB), PutOptions::INSERT).expect("put hot");
    let mut keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    keys.push(hot);
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let mut bufs = buffers(keys.len(), MIB);
    let mut dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b.as_mut_slice())]).collect();
    // Keys 2 (on SSD) and 6 (in DRAM) go to "GPU memory".
    for i in [2, 6] {
        // SAFETY: never dereferenced: the call must refuse it before any copy.
        dsts[i] = vec![unsafe { Region::from_raw(0x7f00_0000_0000, MIB, kvtide::MemoryKind::Device { ordinal: 0 }) }];
    }
    let report = store.restore_batch(&refs, &dsts, &RestoreOptions::default());
    drop(dsts);
    for (i, result) in report.results.iter().enumerate() {
        if i == 2 || i == 6 {
            #[cfg(feature = "cuda")]
            if kvtide::cuda::CudaTransport::get().is_ok() {
                continue; // a GPU machine: the GPU tests cover this
            }
            assert!(matches!(result, Err(Error::CudaUnavailable(_))), "key {i}: {result:?}");
        } else {
            assert_eq!(result.as_ref().ok(), Some(&MIB), "key {i}: {result:?}");
            assert_eq!(bufs[i], value_for(&keys[i], 0, MIB), "key {i}");
        }
    }
    assert_idle(&store);
}
