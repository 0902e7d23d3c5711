//! GPU destinations and sources (feature `cuda`). The tests marked `needs a CUDA device` run on
//! the lent H200 (`device-pack`); the others run in CI, where there is no GPU.
#![allow(clippy::needless_range_loop)]

mod common;

/// The CUDA-feature tests (GPU tests and the no-GPU checks of the transport).
#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use super::common::{assert_idle, value_for};
    use kvtide::cuda::plan::Fallback;
    use kvtide::cuda::{inject_fault, CudaDevice, CudaTransport, DeviceBuffer, InjectedFault};
    use kvtide::{
        Engine, Error, Fragment, MemoryKind, PutOptions, Region, RestoreMode, RestoreOptions, SimFaults, Store,
        StoreBuilder,
    };

    const GUARD: u8 = 0xA5;
    const GPU0: MemoryKind = MemoryKind::Device { ordinal: 0 };

    fn store(staging: bool, staging_bytes: u64) -> Engine {
        store_with_tail(staging, staging_bytes, 4 << 20)
    }

    fn store_with_tail(staging: bool, staging_bytes: u64, tail_bytes: u64) -> Engine {
        StoreBuilder::new()
            .dram_bytes(128 << 20)
            .shards(2)
            .pin_threads(false)
            .idle_spin_us(20)
            .gpu_staging(staging)
            .gpu_staging_bytes(staging_bytes)
            .gpu_staging_tail_bytes(tail_bytes.min(staging_bytes))
            .open()
            .expect("open store")
    }

    fn gpu() -> Arc<CudaDevice> {
        CudaTransport::get().and_then(|t| t.device(0)).expect("a CUDA device")
    }

    /// A device pool filled with guard bytes.
    fn pool(device: &Arc<CudaDevice>, bytes: usize) -> DeviceBuffer {
        let buf = device.alloc(bytes).expect("cuMemAlloc");
        buf.fill(GUARD).expect("fill");
        buf
    }

    fn dev(buf: &DeviceBuffer, offset: u64, len: u64) -> Region<'static> {
        assert!(offset + len <= buf.len() as u64);
        // SAFETY: inside a live device allocation that outlives every call using the region.
        unsafe { Region::from_raw(buf.addr() + offset, len as usize, GPU0) }
    }

    /// One list of device regions per key, from (pool offset, len) lists.
    fn dev_lists(buf: &DeviceBuffer, dsts: &[Vec<(u64, u64)>]) -> Vec<Vec<Region<'static>>> {
        dsts.iter().map(|d| d.iter().map(|&(at, len)| dev(buf, at, len)).collect()).collect()
    }

    fn read_back(buf: &DeviceBuffer) -> Vec<u8> {
        let mut out = vec![0u8; buf.len()];
        buf.read(0, &mut out).expect("read back");
        out
    }

    /// Where each fragment of each key lands: (key index, offset in object, offset in pool, len).
    type Layout = Vec<(usize, u64, u64, u64)>;
    /// (key names, values, per-key destination (pool offset, len) lists, layout).
    type Scattered = (Vec<Vec<u8>>, Vec<Vec<u8>>, Vec<Vec<(u64, u64)>>, Layout);

    /// Keys of odd sizes, each cut into odd fragments (and some whole 8 KiB pages), placed at odd,
    /// reordered pool offsets with guard gaps. Returns (keys, values, destinations, layout).
    fn scattered(keys: usize, pool_bytes: u64, seed: u64) -> Scattered {
        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let names: Vec<Vec<u8>> = (0..keys).map(|k| format!("gpu/{seed}/{k}").into_bytes()).collect();
        let mut values = Vec::new();
        let mut fragments: Vec<(usize, u64, u64)> = Vec::new(); // (key, offset in object, len)
        for (k, name) in names.iter().enumerate() {
            let len = if k % 3 == 0 { 8192 * 4 } else { 1000 + (next() % 40_000) };
            values.push(value_for(name, 1, len as usize));
            let mut offset = 0;
            while offset < len {
                let piece = if k % 3 == 0 { 8192 } else { (1 + next() % 9000).min(len - offset) };
                fragments.push((k, offset, piece));
                offset += piece;
            }
        }
        // Shuffle placement order, then lay fragments out with odd guard gaps.
        let mut order: Vec<usize> = (0..fragments.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        let mut cursor = 0u64;
        let mut at = vec![0u64; fragments.len()];
        for &f in &order {
            let (k, _, len) = fragments[f];
            // 8 KiB pages stay 16-byte aligned (the vector path); the rest get odd addresses.
            cursor += if k % 3 == 0 { (16 - cursor % 16) % 16 + 16 } else { 1 + next() % 31 };
            at[f] = cursor;
            cursor += len;
        }
        assert!(cursor + 64 <= pool_bytes, "pool too small: {cursor}");
        let mut dsts = vec![Vec::new(); keys];
        let mut layout = Vec::new();
        for (f, &(k, offset, len)) in fragments.iter().enumerate() {
            dsts[k].push((at[f], len));
            layout.push((k, offset, at[f], len));
        }
        (names, values, dsts, layout)
    }

    /// Checks every fragment's bytes and that every other byte of the pool is still a guard byte.
    fn check_pool(pool_bytes: &[u8], values: &[Vec<u8>], layout: &Layout, skip_keys: &[usize]) {
        let mut covered = vec![false; pool_bytes.len()];
        for &(k, offset, at, len) in layout {
            let (at, offset, len) = (at as usize, offset as usize, len as usize);
            covered[at..at + len].iter_mut().for_each(|c| *c = true);
            if skip_keys.contains(&k) {
                assert!(pool_bytes[at..at + len].iter().all(|&b| b == GUARD), "key {k} must be untouched");
            } else {
                assert_eq!(&pool_bytes[at..at + len], &values[k][offset..offset + len], "key {k} at {at}");
            }
        }
        let stray = pool_bytes.iter().zip(&covered).position(|(&b, &c)| !c && b != GUARD);
        assert_eq!(stray, None, "a guard byte was overwritten");
    }

    fn put_all(store: &Engine, names: &[Vec<u8>], values: &[Vec<u8>]) {
        put_except(store, names, values, &[], PutOptions::UPSERT);
    }

    /// Puts every key but those at the indices in `missing`.
    fn put_except(store: &Engine, names: &[Vec<u8>], values: &[Vec<u8>], missing: &[usize], opts: PutOptions) {
        for (k, (name, value)) in names.iter().zip(values).enumerate() {
            if !missing.contains(&k) {
                store.put(name, value, opts).expect("put");
            }
        }
    }

    fn read_scattered(store: &Engine, staging: bool) {
        let device = gpu();
        let pool_bytes = 4 << 20;
        let buf = pool(&device, pool_bytes);
        let (names, values, dsts, layout) = scattered(24, pool_bytes as u64, if staging { 7 } else { 8 });
        put_all(store, &names, &values);
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let regions = dev_lists(&buf, &dsts);
        let before = store.stats().gpu;
        let results = store.batch_get_into_multi_buffers(&keys, &regions);
        for (k, r) in results.iter().enumerate() {
            assert_eq!(r.as_ref().ok(), Some(&values[k].len()), "key {k}: {r:?}");
        }
        check_pool(&read_back(&buf), &values, &layout, &[]);
        let after = store.stats().gpu;
        assert!(after.arena_registered, "the arena is registered at first GPU use");
        if staging {
            assert_eq!(after.staged_requests, before.staged_requests + 1, "{after:?}");
            assert_eq!(after.kernel_launches, before.kernel_launches + 1, "one scatter launch for one fill");
        } else {
            assert_eq!(after.direct_requests, before.direct_requests + 1, "{after:?}");
            assert_eq!(after.kernel_launches, before.kernel_launches);
        }
        assert_idle(store);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn staged_reads_reordered_unaligned_odd_fragments_keep_guards() {
        read_scattered(&store(true, 4 << 20), true);
    }

    /// A staged read of enough keys to be leased in parts (its first copies start after the
    /// first part's leases, later parts join them), through a staging buffer it wraps around
    /// several times: byte-exact, keys missing from the first and the last part fail alone and
    /// leave their pages untouched, every lease goes back.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_staged_read_leased_in_parts_is_byte_exact_through_a_reused_buffer() {
        let store = store_with_tail(true, 2 << 20, 256 << 10);
        let device = gpu();
        let pool_bytes = 16 << 20;
        let buf = pool(&device, pool_bytes);
        let (names, values, dsts, layout) = scattered(300, pool_bytes as u64, 31);
        let missing = [3usize, 290];
        put_except(&store, &names, &values, &missing, PutOptions::UPSERT);
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let regions = dev_lists(&buf, &dsts);
        for round in 0..2 {
            buf.fill(GUARD).expect("fill");
            let before = store.stats().gpu;
            let results = store.batch_get_into_multi_buffers(&keys, &regions);
            for (k, r) in results.iter().enumerate() {
                if missing.contains(&k) {
                    assert!(matches!(r, Err(Error::NotFound)), "round {round} key {k}: {r:?}");
                } else {
                    assert_eq!(r.as_ref().ok(), Some(&values[k].len()), "round {round} key {k}: {r:?}");
                }
            }
            check_pool(&read_back(&buf), &values, &layout, &missing);
            let after = store.stats().gpu;
            assert_eq!(after.staged_requests, before.staged_requests + 1, "{after:?}");
            assert!(after.staged_fills >= before.staged_fills + 4, "the buffer is reused: {after:?}");
            assert_idle(&store);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn direct_reads_reordered_unaligned_odd_fragments_keep_guards() {
        read_scattered(&store(false, 2 << 20), false);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn get_into_a_device_buffer() {
        let store = store(true, 1 << 20);
        let device = gpu();
        let buf = pool(&device, 1 << 20);
        let value = value_for(b"single", 3, 100_001);
        store.put(b"single", &value, PutOptions::INSERT).expect("put");
        assert_eq!(store.get_into(b"single", dev(&buf, 3, 200_000)), Ok(100_001));
        let back = read_back(&buf);
        assert_eq!(&back[3..100_004], &value[..]);
        assert!(back[..3].iter().chain(&back[100_004..]).all(|&b| b == GUARD));
        assert!(matches!(store.get_into(b"single", dev(&buf, 0, 100)), Err(Error::BufferTooSmall { .. })));
        assert_eq!(store.get_into(b"absent", dev(&buf, 0, 100)), Err(Error::NotFound));
        assert_idle(&store);
    }

    /// Waits until the stream drivers finished and released everything.
    fn wait_streams_idle(store: &Engine) {
        let started = std::time::Instant::now();
        while !store.stats().held_resources().is_zero() {
            assert!(started.elapsed() < std::time::Duration::from_secs(10), "{:?}", store.stats().held_resources());
            std::thread::sleep(std::time::Duration::from_millis(2));
            store.sync_shards().expect("sync");
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn progressive_and_streaming_reads_into_device_memory() {
        for staging in [false, true] {
            let store = store(staging, 4 << 20);
            let device = gpu();
            let buf = pool(&device, 8 << 20);
            let len = (5 << 20) + 777;
            let value = value_for(b"prog", 1, len);
            store.put(b"prog", &value, PutOptions::INSERT).expect("put");
            let h = store.progressive_get(b"prog", dev(&buf, 5, len as u64 + 10), 512 << 10).expect("progressive_get");
            assert_eq!(h.num_chunks(), 11);
            h.wait_chunk(0).expect("chunk 0");
            let mut first = vec![0u8; 512 << 10];
            buf.read(5, &mut first).expect("read chunk 0");
            assert_eq!(first, &value[..512 << 10], "chunk 0 is usable once it is ready");
            h.wait_all().expect("every chunk");
            drop(h);
            let back = read_back(&buf);
            assert_eq!(&back[5..5 + len], &value[..], "staging {staging}");
            assert!(back[..5].iter().chain(&back[5 + len..]).all(|&b| b == GUARD));
            let s = store.stats().stream;
            assert!(s.peak_chunks_in_flight <= 4, "the window bounds chunks in flight: {s:?}");
            // Streaming ranges into a device buffer and a host buffer, with a missing key.
            buf.fill(GUARD).expect("fill");
            let host: &'static mut [u8] = Box::leak(vec![0u8; 4096].into_boxed_slice());
            let host_addr = host.as_ptr() as usize;
            let frags = vec![
                vec![Fragment::new(b"prog".to_vec(), 100, 1000, 3 << 20), Fragment::new(b"nope".to_vec(), 0, 0, 10)],
                vec![Fragment::new(b"prog".to_vec(), 7, 0, 4096)],
            ];
            let h = store
                .streaming_batch_get_buffer_ranges(&[dev(&buf, 0, 8 << 20), Region::host(host)], &frags, 1 << 20)
                .expect("streaming");
            assert_eq!(h.num_chunks(), 5);
            assert!(matches!(h.wait_all(), Err(Error::NotFound)));
            assert!((0..3).chain([4]).all(|i| h.is_chunk_ready(i)));
            drop(h);
            let back = read_back(&buf);
            assert_eq!(&back[1000..1000 + (3 << 20)], &value[100..100 + (3 << 20)]);
            assert!(back[..1000].iter().chain(&back[1000 + (3 << 20)..]).all(|&b| b == GUARD));
            // SAFETY: every chunk settled.
            assert_eq!(unsafe { std::slice::from_raw_parts(host_addr as *const u8, 4096) }, &value[7..4103]);
            wait_streams_idle(&store);
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_progressive_put_from_device_memory_is_followed_into_device_memory() {
        let store = store(true, 4 << 20);
        let device = gpu();
        let src = pool(&device, 4 << 20);
        let value = value_for(b"from-gpu", 2, 4 << 20);
        src.write(0, &value).expect("upload");
        let dst = pool(&device, 4 << 20);
        let mut put = store.progressive_put(b"from-gpu", 4 << 20, 1 << 20, PutOptions::INSERT).expect("put");
        let h = store.progressive_get_unsealed(b"from-gpu", dev(&dst, 0, 4 << 20), 1 << 20).expect("follow");
        for i in [2usize, 0, 3, 1] {
            put.put_chunk(i, dev(&src, (i as u64) << 20, 1 << 20)).expect("chunk from device memory");
        }
        h.wait_chunk(0).expect("chunk 0");
        put.seal().expect("seal");
        drop(put);
        h.wait_all().expect("all");
        drop(h);
        assert_eq!(read_back(&dst), value);
        assert_eq!(store.get(b"from-gpu").expect("sealed"), value);
        wait_streams_idle(&store);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn one_object_fans_out_to_several_destinations() {
        let store = store(true, 1 << 20);
        let device = gpu();
        let buf = pool(&device, 1 << 20);
        let value = value_for(b"fan", 1, 64 << 10);
        store.put(b"fan", &value, PutOptions::INSERT).expect("put");
        // The same object to three places by ranges (one transfer, three copies of each range) ...
        let buffers = [dev(&buf, 0, 512 << 10)];
        let frags = vec![vec![
            Fragment::new(b"fan".to_vec(), 0, 1, 32 << 10),
            Fragment::new(b"fan".to_vec(), 0, 100_003, 32 << 10),
            Fragment::new(b"fan".to_vec(), 32 << 10, 200_000, 32 << 10),
            Fragment::new(b"fan".to_vec(), 1000, 300_017, 7),
        ]];
        let results = store.get_into_ranges(&buffers, &frags);
        assert!(results[0].iter().all(|r| r.is_ok()), "{results:?}");
        // ... and twice in one batch under the same key.
        let twice = store.batch_get_into_multi_buffers(
            &[b"fan", b"fan"],
            &[vec![dev(&buf, 600_000, 64 << 10)], vec![dev(&buf, 700_000, 16 << 10), dev(&buf, 800_000, 48 << 10)]],
        );
        assert_eq!(twice, vec![Ok(64 << 10), Ok(64 << 10)]);
        let back = read_back(&buf);
        assert_eq!(&back[1..1 + (32 << 10)], &value[..32 << 10]);
        assert_eq!(&back[100_003..100_003 + (32 << 10)], &value[..32 << 10]);
        assert_eq!(&back[200_000..200_000 + (32 << 10)], &value[32 << 10..]);
        assert_eq!(&back[300_017..300_024], &value[1000..1007]);
        assert_eq!(&back[600_000..600_000 + (64 << 10)], &value[..]);
        assert_eq!(&back[700_000..700_000 + (16 << 10)], &value[..16 << 10]);
        assert_eq!(&back[800_000..800_000 + (48 << 10)], &value[16 << 10..]);
        assert_eq!(back[0], GUARD);
        assert_eq!(back[300_024], GUARD);
        assert_idle(&store);
    }

    /// The GPU twin of `object_api::ranges_are_checked_against_objects_and_buffers`: the same
    /// fragments get the same per-fragment results, and failed fragments write nothing.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn ranges_are_checked_per_fragment_as_on_the_host() {
        use kvtide::RegionError;
        let store = store(true, 1 << 20);
        let device = gpu();
        let a = value_for(b"a", 0, 1000);
        let b = value_for(b"b", 0, 500);
        store.put(b"a", &a, PutOptions::INSERT).expect("a");
        store.put(b"b", &b, PutOptions::INSERT).expect("b");
        let buf0 = pool(&device, 600);
        let buf1 = pool(&device, 100);
        let fragments = vec![
            vec![
                Fragment::new(b"a".to_vec(), 100, 0, 200),
                Fragment::new(b"b".to_vec(), 0, 200, 300),
                Fragment::new(b"a".to_vec(), 990, 500, 20), // past the object
                Fragment::new(b"b".to_vec(), 0, 590, 20),   // past the buffer
                Fragment::new(b"zz".to_vec(), 0, 0, 1),     // missing key
                Fragment::new(b"a".to_vec(), u64::MAX, 0, 2), // overflow
            ],
            vec![Fragment::new(b"b".to_vec(), 400, 0, 100)],
            vec![Fragment::new(b"a".to_vec(), 0, 0, 1)], // no such buffer
        ];
        let buffers = [dev(&buf0, 0, 600), dev(&buf1, 0, 100)];
        let results = store.get_into_ranges(&buffers, &fragments);
        assert_eq!(results[0][0], Ok(200));
        assert_eq!(results[0][1], Ok(300));
        assert!(matches!(results[0][2], Err(Error::InvalidRange(RegionError::OutOfBounds { what: "object", .. }))));
        assert!(matches!(results[0][3], Err(Error::InvalidRange(RegionError::OutOfBounds { what: "buffer", .. }))));
        assert_eq!(results[0][4], Err(Error::NotFound));
        assert!(matches!(results[0][5], Err(Error::InvalidRange(_))));
        assert_eq!(results[1][0], Ok(100));
        assert!(matches!(results[2][0], Err(Error::InvalidArgument(_))));
        let back0 = read_back(&buf0);
        assert_eq!(&back0[..200], &a[100..300]);
        assert_eq!(&back0[200..500], &b[..300]);
        assert!(back0[500..].iter().all(|&x| x == GUARD), "failed fragments wrote nothing");
        assert_eq!(&read_back(&buf1)[..], &b[400..500]);
        assert_idle(&store);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn missing_keys_fail_alone_and_their_pages_stay_untouched() {
        let store = store(true, 2 << 20);
        let device = gpu();
        let pool_bytes = 4 << 20;
        let buf = pool(&device, pool_bytes);
        let (names, values, dsts, layout) = scattered(12, pool_bytes as u64, 11);
        let missing = [2usize, 5, 11];
        put_except(&store, &names, &values, &missing, PutOptions::INSERT);
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let regions = dev_lists(&buf, &dsts);
        let results = store.batch_get_into_multi_buffers(&keys, &regions);
        for (k, r) in results.iter().enumerate() {
            if missing.contains(&k) {
                assert_eq!(r, &Err(Error::NotFound));
            } else {
                assert_eq!(r.as_ref().ok(), Some(&values[k].len()));
            }
        }
        check_pool(&read_back(&buf), &values, &layout, &missing);
        assert_idle(&store);
    }

    /// Seven 1 MiB keys in 256 KiB pages (reversed across the batch) through an 8 MiB buffer with
    /// fixed fills (no tail shaping): fills hold a quarter of it, two keys each: 2 + 2 + 2 + 1 =
    /// 4 fills, one scatter launch each. With a 1 MiB tail the fills shrink instead (at most half
    /// of what is left each: 3 + 2 + 1 + 1 keys, or more fills where alignment padding spills).
    #[test]
    #[ignore = "needs a CUDA device"]
    fn seven_keys_over_four_fills() {
        seven_keys(0, 4..=4);
        seven_keys(1 << 20, 4..=7);
    }

    fn seven_keys(tail_bytes: u64, fills: std::ops::RangeInclusive<u64>) {
        let store = store_with_tail(true, 8 << 20, tail_bytes);
        let device = gpu();
        let page = 256u64 << 10;
        let buf = pool(&device, 8 << 20);
        let names: Vec<Vec<u8>> = (0..7).map(|k| format!("fill/{k}").into_bytes()).collect();
        let values: Vec<Vec<u8>> = names.iter().map(|n| value_for(n, 1, 1 << 20)).collect();
        put_all(&store, &names, &values);
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        // Page j of key k goes to slot (27 - (4k + j)): reversed across the whole batch.
        let mut layout = Layout::new();
        let regions: Vec<Vec<Region<'_>>> = (0..7u64)
            .map(|k| {
                (0..4u64)
                    .map(|j| {
                        let at = (27 - (4 * k + j)) * page + 64;
                        layout.push((k as usize, j * page, at, page));
                        dev(&buf, at, page)
                    })
                    .collect()
            })
            .collect();
        let before = store.stats().gpu;
        let results = store.batch_get_into_multi_buffers(&keys, &regions);
        assert!(results.iter().all(|r| r == &Ok(1 << 20)), "{results:?}");
        let after = store.stats().gpu;
        let staged_fills = after.staged_fills - before.staged_fills;
        assert!(fills.contains(&staged_fills), "{staged_fills} fills, expected {fills:?}: {after:?}");
        assert_eq!(after.kernel_launches - before.kernel_launches, staged_fills, "one launch per fill");
        check_pool(&read_back(&buf), &values, &layout, &[]);
        assert_idle(&store);
    }

    /// SSD-resident keys restored into scattered device pages through the pipeline (each
    /// sub-batch's device keys in one GPU submission), a DRAM-resident one through the GPU read
    /// path, host keys in the same call by memcpy: every mode, and the default batched read, give
    /// the same bytes with guard bytes intact, the SSD is read every time, nothing stays held.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn ssd_restores_into_device_pages_in_every_mode() {
        let store = StoreBuilder::new()
            .dram_bytes(32 << 20)
            .shards(2)
            .pin_threads(false)
            .idle_spin_us(20)
            .ssd_bytes(256 << 20)
            .ssd_segment_bytes(16 << 20)
            .simulated_ssd(11, SimFaults { latency_us: 100, us_per_mib: 500, ..SimFaults::default() })
            .promote_on_hit(false)
            .restore_sub_batch_bytes(2 << 20)
            .gpu_staging(true)
            .gpu_staging_bytes(8 << 20)
            .open()
            .expect("open store");
        let device = gpu();
        let (names, values, dst_offsets, layout) = scattered(40, 2 << 20, 21);
        // Big enough that the keys need several sub-batches: every key gets 96 KiB more in one
        // trailing page.
        let tail = 96u64 << 10;
        let pool_bytes = (4u64 << 20) + names.len() as u64 * (tail + 64);
        let buf = pool(&device, pool_bytes as usize);
        let mut values = values;
        let mut layout = layout;
        let mut dst_offsets = dst_offsets;
        for (k, name) in names.iter().enumerate() {
            let head = values[k].len() as u64;
            values[k] = value_for(name, 1, (head + tail) as usize);
            let at = (2u64 << 20) + 64 + k as u64 * (tail + 64);
            dst_offsets[k].push((at, tail));
            layout.push((k, head, at, tail));
        }
        put_all(&store, &names, &values);
        // Filler pushes every key out to the SSD; then one key is rewritten so it is in DRAM.
        for f in 0..48 {
            store.put(format!("filler/{f}").as_bytes(), &vec![1u8; 1 << 20], PutOptions::INSERT).expect("filler");
        }
        store.put(&names[5], &values[5], PutOptions::UPSERT).expect("hot key");
        store.sync_shards().expect("sync");
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let regions = dev_lists(&buf, &dst_offsets);
        let runs: [Option<RestoreMode>; 4] =
            [Some(RestoreMode::Pipelined), Some(RestoreMode::Serialized), Some(RestoreMode::Barrier), None];
        for mode in runs {
            buf.fill(GUARD).expect("fill");
            let loads_before = store.stats().total.loads;
            let results = match mode {
                Some(mode) => {
                    let opts = RestoreOptions { mode, trace: true, ..store.restore_options() };
                    let report = store.restore_batch(&keys, &regions, &opts);
                    if mode == RestoreMode::Pipelined {
                        assert!(report.sub_batches.len() > 2, "several sub-batches: {}", report.sub_batches.len());
                    }
                    report.results
                }
                None => store.batch_get_into_multi_buffers(&keys, &regions),
            };
            for (k, r) in results.iter().enumerate() {
                assert_eq!(r.as_ref().ok(), Some(&values[k].len()), "{mode:?} key {k}: {r:?}");
            }
            check_pool(&read_back(&buf), &values, &layout, &[]);
            assert!(store.stats().total.loads - loads_before >= 30, "{mode:?}: the keys came from the SSD");
            assert_idle(&store);
        }
        assert!(store.stats().gpu.staged_requests > 0, "{:?}", store.stats().gpu);
    }

    fn fallbacks(store: &Engine, reason: Fallback) -> u64 {
        store.stats().gpu.fallbacks.iter().find(|(name, _)| name == reason.name()).map_or(0, |(_, n)| *n)
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn every_fallback_is_taken_before_submission_and_is_correct() {
        let store = store(true, 1 << 20);
        let device = gpu();
        let buf = pool(&device, 8 << 20);
        let value = value_for(b"fb", 1, 96 << 10);
        store.put(b"fb", &value, PutOptions::INSERT).expect("put");
        let big = value_for(b"big", 1, 3 << 20);
        store.put(b"big", &big, PutOptions::INSERT).expect("put");
        let three = |base: u64| {
            vec![
                dev(&buf, base + (64 << 10), 32 << 10),
                dev(&buf, base, 32 << 10),
                dev(&buf, base + (32 << 10), 32 << 10),
            ]
        };
        let expect = |base: usize, back: &[u8]| {
            assert_eq!(&back[base + (64 << 10)..base + (96 << 10)], &value[..32 << 10]);
            assert_eq!(&back[base..base + (32 << 10)], &value[32 << 10..64 << 10]);
            assert_eq!(&back[base + (32 << 10)..base + (64 << 10)], &value[64 << 10..]);
        };

        // Qualifies: staged.
        let staged_before = store.stats().gpu.staged_requests;
        assert_eq!(store.batch_get_into_multi_buffers(&[b"fb"], &[three(0)]), vec![Ok(96 << 10)]);
        assert_eq!(store.stats().gpu.staged_requests, staged_before + 1);

        // Busy buffer.
        let hold = device.hold_staging().expect("buffer free");
        assert_eq!(store.batch_get_into_multi_buffers(&[b"fb"], &[three(1 << 20)]), vec![Ok(96 << 10)]);
        drop(hold);
        assert_eq!(fallbacks(&store, Fallback::Busy), 1);

        // A host destination among device ones.
        let mut host = vec![0u8; 32 << 10];
        let mixed =
            vec![dev(&buf, 2 << 20, 32 << 10), Region::host(&mut host), dev(&buf, (2 << 20) + 40_000, 32 << 10)];
        assert_eq!(store.batch_get_into_multi_buffers(&[b"fb"], &[mixed]), vec![Ok(96 << 10)]);
        assert_eq!(fallbacks(&store, Fallback::NotDevice), 1);
        assert_eq!(&host[..], &value[32 << 10..64 << 10]);

        // Overlapping destinations.
        let overlap = vec![dev(&buf, 3 << 20, 48 << 10), dev(&buf, (3 << 20) + 1000, 48 << 10)];
        assert_eq!(store.batch_get_into_multi_buffers(&[b"fb"], &[overlap]), vec![Ok(96 << 10)]);
        assert_eq!(fallbacks(&store, Fallback::Overlap), 1);

        // An object larger than the buffer.
        let pages: Vec<Region<'_>> = (0..3u64).map(|i| dev(&buf, (4 << 20) + (2 - i) * (1 << 20), 1 << 20)).collect();
        assert_eq!(store.batch_get_into_multi_buffers(&[b"big"], &[pages]), vec![Ok(3 << 20)]);
        assert_eq!(fallbacks(&store, Fallback::TooLarge), 1);

        // One contiguous destination per object.
        assert_eq!(store.get_into(b"fb", dev(&buf, 7 << 20, 96 << 10)), Ok(96 << 10));
        assert_eq!(fallbacks(&store, Fallback::NotFragmented), 1);

        let back = read_back(&buf);
        expect(0, &back);
        expect(1 << 20, &back);
        assert_eq!(&back[2 << 20..(2 << 20) + (32 << 10)], &value[..32 << 10]);
        assert_eq!(&back[(2 << 20) + 40_000..(2 << 20) + 40_000 + (32 << 10)], &value[64 << 10..]);
        for i in 0..3usize {
            let at = (4 << 20) + (2 - i) * (1 << 20);
            assert_eq!(&back[at..at + (1 << 20)], &big[i << 20..(i + 1) << 20]);
        }
        assert_eq!(&back[7 << 20..(7 << 20) + (96 << 10)], &value[..]);

        // Disabled staging never counts as a fallback and never launches a kernel.
        let off = self::store(false, 1 << 20);
        off.put(b"fb", &value, PutOptions::INSERT).expect("put");
        assert_eq!(off.batch_get_into_multi_buffers(&[b"fb"], &[three(0)]), vec![Ok(96 << 10)]);
        let stats = off.stats().gpu;
        assert_eq!((stats.direct_requests, stats.kernel_launches), (1, 0));
        assert_idle(&store);
        assert_idle(&off);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn bad_device_pointers_fail_their_key_before_submission() {
        let store = store(true, 1 << 20);
        let device = gpu();
        let buf = pool(&device, 1 << 20);
        store.put(b"ok", &value_for(b"ok", 1, 4096), PutOptions::INSERT).expect("put");
        store.put(b"bad", &value_for(b"bad", 1, 4096), PutOptions::INSERT).expect("put");
        let host = vec![0u8; 4096];
        // SAFETY: never dereferenced: host memory labelled as device memory must be refused.
        let lie = unsafe { Region::from_raw(host.as_ptr() as u64, 4096, GPU0) };
        // SAFETY: as above: past the end of the allocation, refused before any copy.
        let past_end = unsafe { Region::from_raw(buf.addr() + (1 << 20) - 100, 4096, GPU0) };
        let results = store.batch_get_into_multi_buffers(
            &[b"ok", b"bad", b"bad"],
            &[vec![dev(&buf, 0, 2048), dev(&buf, 8192, 2048)], vec![lie], vec![past_end]],
        );
        assert_eq!(results[0], Ok(4096));
        assert!(matches!(results[1], Err(Error::InvalidArgument(_))), "{:?}", results[1]);
        assert!(matches!(results[2], Err(Error::InvalidArgument(_))), "{:?}", results[2]);
        assert!(host.iter().all(|&b| b == 0));
        assert_idle(&store);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn concurrent_callers_all_get_their_bytes() {
        let store = Arc::new(store(true, 2 << 20));
        let device = gpu();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let store = Arc::clone(&store);
                let device = Arc::clone(&device);
                std::thread::spawn(move || {
                    let pool_bytes = 2 << 20;
                    let buf = pool(&device, pool_bytes);
                    let (names, values, dsts, layout) = scattered(10, pool_bytes as u64, 100 + t);
                    put_all(&store, &names, &values);
                    let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
                    for _ in 0..20 {
                        buf.fill(GUARD).expect("reset");
                        let regions = dev_lists(&buf, &dsts);
                        let results = store.batch_get_into_multi_buffers(&keys, &regions);
                        assert!(results.iter().zip(&values).all(|(r, v)| r == &Ok(v.len())), "{results:?}");
                        check_pool(&read_back(&buf), &values, &layout, &[]);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("caller thread");
        }
        let stats = store.stats().gpu;
        assert_eq!(stats.staged_requests + stats.direct_requests, 80, "{stats:?}");
        assert_eq!(stats.failed_keys, 0);
        assert_idle(&store);
    }

    fn gathered_writes(staging: bool) {
        let store = store(staging, 2 << 20);
        let device = gpu();
        let pool_bytes = 4 << 20;
        let buf = device.alloc(pool_bytes).expect("alloc");
        let (names, values, dsts, layout) = scattered(20, pool_bytes as u64, if staging { 21 } else { 22 });
        // Lay the values out in device memory as the scattered pages.
        let mut image = vec![GUARD; pool_bytes];
        for &(k, offset, at, len) in &layout {
            image[at as usize..(at + len) as usize]
                .copy_from_slice(&values[k][offset as usize..(offset + len) as usize]);
        }
        buf.write(0, &image).expect("upload");
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let sources = dev_lists(&buf, &dsts);
        let before = store.stats().gpu;
        let results = store.batch_put_from_multi_buffers(&keys, &sources, PutOptions::INSERT);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        let after = store.stats().gpu;
        if staging {
            assert_eq!(after.staged_requests, before.staged_requests + 1, "{after:?}");
            assert!(after.kernel_launches > before.kernel_launches, "one gather launch per fill");
        }
        for (name, value) in names.iter().zip(&values) {
            assert_eq!(&store.get(name).expect("read back"), value, "gathered bytes differ");
        }
        // put_from: one key from several device pages.
        store.put_from(b"one", &sources[1], PutOptions::INSERT).expect("put_from");
        assert_eq!(store.get(b"one").expect("get"), values[1]);
        assert_idle(&store);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn staged_gathered_writes_read_back_byte_exact() {
        gathered_writes(true);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_large_gathered_write_goes_in_parts_through_one_staging_buffer_byte_exact() {
        // 24 objects of 2 MiB in 64 KiB pages laid out in reverse: 48 MiB goes in several parts,
        // whose fills wrap a 16 MiB staging buffer many times over. A reader runs alongside: a
        // key is published as soon as its copies landed, never before.
        let store = store(true, 16 << 20);
        let device = gpu();
        let (objects, object_bytes, page) = (24usize, 2usize << 20, 64usize << 10);
        let pages = object_bytes / page;
        let buf = pool(&device, objects * object_bytes);
        let names: Vec<Vec<u8>> = (0..objects).map(|k| format!("parts/{k}").into_bytes()).collect();
        let versions: Vec<Vec<Vec<u8>>> =
            (1..=2).map(|v| names.iter().map(|n| value_for(n, v, object_bytes)).collect()).collect();
        let slot = |k: usize, p: usize| (objects * pages - 1 - (k * pages + p)) * page;
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let sources: Vec<Vec<Region<'_>>> =
            (0..objects).map(|k| (0..pages).map(|p| dev(&buf, slot(k, p) as u64, page as u64)).collect()).collect();
        for (round, opts) in [PutOptions::INSERT, PutOptions::UPSERT].into_iter().enumerate() {
            let values = &versions[round];
            let mut image = vec![GUARD; objects * object_bytes];
            for (k, value) in values.iter().enumerate() {
                for p in 0..pages {
                    image[slot(k, p)..slot(k, p) + page].copy_from_slice(&value[p * page..(p + 1) * page]);
                }
            }
            buf.write(0, &image).expect("upload");
            let before = store.stats().gpu;
            let writing = std::sync::atomic::AtomicBool::new(true);
            let results = std::thread::scope(|scope| {
                let reader = scope.spawn(|| {
                    let mut reads = 0u64;
                    while writing.load(std::sync::atomic::Ordering::SeqCst) {
                        for (k, name) in names.iter().enumerate() {
                            match store.get(name) {
                                Ok(got) => {
                                    let whole = got == values[k] || (round > 0 && got == versions[round - 1][k]);
                                    assert!(whole, "key {k} was readable before its bytes landed");
                                    reads += 1;
                                }
                                Err(Error::NotFound) if round == 0 => {}
                                Err(e) => panic!("key {k}: {e:?}"),
                            }
                        }
                    }
                    reads
                });
                let results = store.batch_put_from_multi_buffers(&keys, &sources, opts);
                writing.store(false, std::sync::atomic::Ordering::SeqCst);
                reader.join().expect("reader");
                results
            });
            assert!(results.iter().all(Result::is_ok), "{results:?}");
            let after = store.stats().gpu;
            assert_eq!(after.staged_requests, before.staged_requests + 1, "{after:?}");
            assert_eq!(after.direct_requests, before.direct_requests, "no part went direct: {after:?}");
            assert!(after.staged_fills - before.staged_fills >= 6, "{after:?}");
            assert!(after.write_first_part_us > before.write_first_part_us);
            for (name, value) in names.iter().zip(values) {
                assert_eq!(&store.get(name).expect("read back"), value, "gathered bytes differ");
            }
        }
        assert_idle(&store);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn direct_writes_from_device_read_back_byte_exact() {
        gathered_writes(false);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn failures_fail_their_keys_release_leases_and_are_not_replayed() {
        // Fixed quarter-buffer fills: two 1 MiB keys each.
        let store = store_with_tail(true, 8 << 20, 0);
        let device = gpu();
        let page = 256u64 << 10;
        let buf = pool(&device, 8 << 20);
        let names: Vec<Vec<u8>> = (0..7).map(|k| format!("fail/{k}").into_bytes()).collect();
        let values: Vec<Vec<u8>> = names.iter().map(|n| value_for(n, 1, 1 << 20)).collect();
        put_all(&store, &names, &values);
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let regions: Vec<Vec<Region<'_>>> =
            (0..7u64).map(|k| (0..4u64).map(|j| dev(&buf, (27 - (4 * k + j)) * page, page)).collect()).collect();

        // The scatter of the second fill fails: the two keys of the first fill (reads stage
        // objects in arena order, so which two depends on where they live) arrive, the other
        // five fail, and nothing is replayed through the direct path.
        let before = store.stats().gpu;
        inject_fault(InjectedFault::StagedLaunch, Some(1));
        let results = store.batch_get_into_multi_buffers(&keys, &regions);
        inject_fault(InjectedFault::StagedLaunch, None);
        let after = store.stats().gpu;
        let arrived: Vec<usize> = (0..7).filter(|&k| results[k] == Ok(1 << 20)).collect();
        assert_eq!(arrived.len(), 2, "the first fill completed: {results:?}");
        assert!(
            (0..7).filter(|k| !arrived.contains(k)).all(|k| matches!(results[k], Err(Error::Cuda(_)))),
            "{results:?}"
        );
        assert_eq!(after.direct_requests, before.direct_requests, "a failed staged read is never replayed");
        assert_eq!(after.failed_keys - before.failed_keys, 5);
        let back = read_back(&buf);
        for &k in &arrived {
            for j in 0..4usize {
                let at = (27 - (4 * k + j)) * page as usize;
                assert_eq!(&back[at..at + page as usize], &values[k][j * page as usize..(j + 1) * page as usize]);
            }
        }
        assert_idle(&store);

        // The same batch works afterwards (the buffer was released).
        let results = store.batch_get_into_multi_buffers(&keys, &regions);
        assert!(results.iter().all(|r| r == &Ok(1 << 20)), "{results:?}");

        // Direct path failure.
        let direct = self::store(false, 1 << 20);
        put_all(&direct, &names, &values);
        inject_fault(InjectedFault::DirectCopy, Some(0));
        let results = direct.batch_get_into_multi_buffers(&keys, &regions);
        inject_fault(InjectedFault::DirectCopy, None);
        assert!(results.iter().all(|r| matches!(r, Err(Error::Cuda(_)))), "{results:?}");
        assert_idle(&direct);

        // A gathered write whose second fill fails stores the first fill's keys only.
        inject_fault(InjectedFault::StagedLaunch, Some(1));
        let fresh: Vec<Vec<u8>> = (0..7).map(|k| format!("fail-write/{k}").into_bytes()).collect();
        let fresh_keys: Vec<&[u8]> = fresh.iter().map(Vec::as_slice).collect();
        let results = store.batch_put_from_multi_buffers(&fresh_keys, &regions, PutOptions::INSERT);
        inject_fault(InjectedFault::StagedLaunch, None);
        // Arena order decides which two keys share the first fill.
        let stored: Vec<usize> = (0..7).filter(|&k| results[k].is_ok()).collect();
        assert_eq!(stored.len(), 2, "{results:?}");
        assert!(
            (0..7).filter(|k| !stored.contains(k)).all(|k| matches!(results[k], Err(Error::Cuda(_)))),
            "{results:?}"
        );
        for (k, key) in fresh_keys.iter().enumerate() {
            if stored.contains(&k) {
                assert_eq!(store.get(key).expect("stored").len(), 1 << 20);
            } else {
                assert_eq!(store.get(key), Err(Error::NotFound));
            }
        }
        assert_idle(&store);
    }

    /// Runs in CI (no GPU): device regions get `CudaUnavailable`, never a panic, and host keys in
    /// the same call still work.
    #[test]
    fn without_a_gpu_device_regions_are_cuda_unavailable() {
        if CudaTransport::get().is_ok() {
            eprintln!("skipped: a CUDA device is present (the GPU tests cover this machine)");
            return;
        }
        let store = store(true, 1 << 20);
        store.put(b"k", &[7u8; 4096], PutOptions::INSERT).expect("put");
        // SAFETY: never dereferenced: there is no CUDA, so the engine refuses it first.
        let gpu_page = unsafe { Region::from_raw(0x7f00_0000_0000, 4096, GPU0) };
        assert!(matches!(store.get_into(b"k", gpu_page), Err(Error::CudaUnavailable(_))));
        let mut host = vec![0u8; 4096];
        let results =
            store.batch_get_into_multi_buffers(&[b"k", b"k"], &[vec![gpu_page], vec![Region::host(&mut host)]]);
        assert!(matches!(results[0], Err(Error::CudaUnavailable(_))), "{results:?}");
        assert_eq!(results[1], Ok(4096));
        assert_eq!(host, vec![7u8; 4096]);
        let ranges = store.get_into_ranges(&[gpu_page], &[vec![Fragment::new(b"k".to_vec(), 0, 0, 16)]]);
        assert!(matches!(ranges[0][0], Err(Error::CudaUnavailable(_))));
        assert!(matches!(store.put_from(b"g", &[gpu_page], PutOptions::INSERT), Err(Error::CudaUnavailable(_))));
        assert_eq!(store.get(b"g"), Err(Error::NotFound));
        assert!(matches!(store.progressive_get(b"k", gpu_page, 1024), Err(Error::CudaUnavailable(_))));
        let h = store
            .streaming_batch_get_buffer_ranges(&[gpu_page], &[vec![Fragment::new(b"k".to_vec(), 0, 0, 16)]], 8)
            .expect("streaming: the fragment fails, not the call");
        assert!(matches!(h.wait_all(), Err(Error::CudaUnavailable(_))));
        drop(h);
        let put = store.progressive_put(b"p", 4096, 4096, PutOptions::INSERT).expect("progressive put");
        assert!(matches!(put.put_chunk(0, gpu_page), Err(Error::CudaUnavailable(_))));
        put.abort();
        let started = std::time::Instant::now();
        while store.stats().stream.handles_open > 0 {
            assert!(started.elapsed() < std::time::Duration::from_secs(10));
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(!store.stats().gpu.arena_registered);
        assert_idle(&store);
    }

    /// Async tickets to GPU pages: byte-exact with guard bytes, over both shards, with a missing key;
    /// leases and tickets back to zero. Then a ticket cancelled before its shards ran reports every
    /// key as delivered or Cancelled, and releases everything.
    fn ticket_to_device_pages(staging: bool) {
        let store = store(staging, 4 << 20);
        let device = gpu();
        let pool_bytes = 4 << 20;
        let buf = pool(&device, pool_bytes);
        let (names, values, dsts, layout) = scattered(24, pool_bytes as u64, if staging { 11 } else { 12 });
        // Key 5 is never stored: it fails alone and its pages keep their guard bytes.
        for (k, (name, value)) in names.iter().zip(&values).enumerate() {
            if k != 5 {
                store.put(name, value, PutOptions::UPSERT).expect("put");
            }
        }
        let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
        let regions = |dsts: &[Vec<(u64, u64)>]| dev_lists(&buf, dsts);
        let before = store.stats().gpu;
        let results = store.submit_batch_get(&keys, regions(&dsts)).expect("submit").wait();
        for (k, r) in results.iter().enumerate() {
            if k == 5 {
                assert_eq!(r, &Err(Error::NotFound));
            } else {
                assert_eq!(r.as_ref().ok(), Some(&values[k].len()), "key {k}: {r:?}");
            }
        }
        check_pool(&read_back(&buf), &values, &layout, &[5]);
        let after = store.stats().gpu;
        let requests = |s: &kvtide::GpuStats| s.staged_requests + s.direct_requests;
        assert!(requests(&after) > requests(&before), "the ticket went through the CUDA transport: {after:?}");
        assert_eq!(after.failed_keys, before.failed_keys);
        assert_idle(&store);

        // Cancelled at once: each key is either fully delivered or Cancelled, and nothing stays held.
        let buf2 = pool(&device, pool_bytes);
        let regions2: Vec<Vec<Region<'static>>> =
            dsts.iter().map(|d| d.iter().map(|&(at, len)| dev(&buf2, at, len)).collect()).collect();
        let ticket = store.submit_batch_get(&keys, regions2).expect("submit");
        ticket.cancel();
        let results = ticket.wait();
        let back = read_back(&buf2);
        for (k, r) in results.iter().enumerate() {
            match r {
                Ok(n) => {
                    assert_eq!(*n, values[k].len());
                    for &(key, offset, at, len) in layout.iter().filter(|l| l.0 == k) {
                        let (offset, at, len) = (offset as usize, at as usize, len as usize);
                        assert_eq!(&back[at..at + len], &values[key][offset..offset + len]);
                    }
                }
                Err(e) => assert!(matches!(e, Error::Cancelled | Error::NotFound), "key {k}: {e:?}"),
            }
        }
        assert_idle(&store);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn staged_ticket_to_device_pages_is_byte_exact() {
        ticket_to_device_pages(true);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn direct_ticket_to_device_pages_is_byte_exact() {
        ticket_to_device_pages(false);
    }
}

/// Runs in CI (no GPU): an async ticket's device keys get `CudaUnavailable`, never a panic; its
/// host keys still arrive and nothing stays held.
#[test]
fn without_a_gpu_ticket_device_keys_are_cuda_unavailable() {
    use common::assert_idle;
    use kvtide::{Error, MemoryKind, PutOptions, Region, Store, StoreBuilder};
    const GPU0: MemoryKind = MemoryKind::Device { ordinal: 0 };
    #[cfg(feature = "cuda")]
    if kvtide::cuda::CudaTransport::get().is_ok() {
        eprintln!("skipped: a CUDA device is present (the GPU tests cover this machine)");
        return;
    }
    let store = StoreBuilder::new()
        .dram_bytes(16 << 20)
        .shards(2)
        .pin_threads(false)
        .idle_spin_us(20)
        .gpu_staging(true)
        .open()
        .expect("open store");
    store.put(b"k", &[7u8; 4096], PutOptions::INSERT).expect("put");
    store.put(b"j", &[9u8; 4096], PutOptions::INSERT).expect("put");
    // SAFETY: never dereferenced: there is no CUDA, so the engine refuses it first.
    let gpu_page = unsafe { Region::from_raw(0x7f00_0000_0000, 4096, GPU0) };
    let host: &'static mut [u8] = Box::leak(vec![0u8; 4096].into_boxed_slice());
    let host_addr = host.as_ptr() as u64;
    let ticket = store.submit_batch_get(&[b"k", b"j"], vec![vec![gpu_page], vec![Region::host(host)]]).expect("submit");
    let results = ticket.wait();
    assert!(matches!(results[0], Err(Error::CudaUnavailable(_))), "{results:?}");
    assert_eq!(results[1], Ok(4096));
    // SAFETY: the ticket completed, so nothing writes the leaked buffer any more.
    let got = unsafe { std::slice::from_raw_parts(host_addr as *const u8, 4096) };
    assert_eq!(got, &[9u8; 4096][..]);
    #[cfg(feature = "cuda")]
    assert!(!store.stats().gpu.arena_registered);
    assert_idle(&store);
}
