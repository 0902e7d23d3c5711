//! GPU destinations and sources through the owner (feature `cuda`): a same-host client copies
//! leased objects from the owner's arena straight into its GPU and puts from its GPU through
//! the put window; a TCP client takes a host buffer in between (over the socket, or one-sided
//! gets from the owner's UCX plane where libucp loads); a second process does the same.
//! The tests marked `needs a CUDA device` run on the lent H200; the others run in CI.

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use kvtide::{Engine, Error as StoreError, MemoryKind, PutOptions, Region, Store, StoreBuilder};
use kvtide_remote::{ClientOptions, Error, Owner, OwnerConfig, RemoteStore};

fn engine() -> Arc<Engine> {
    Arc::new(
        StoreBuilder::new()
            .dram_bytes(256 << 20)
            .shards(2)
            .pin_threads(false)
            .idle_spin_us(20)
            .register_fixed_buffers(false)
            .open()
            .expect("open store"),
    )
}

fn owner(engine: &Arc<Engine>, tag: &str) -> (Owner, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvtide-gpu-remote-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let config = OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        tcp: Some("127.0.0.1:0".parse().expect("addr")),
        allow_unauthenticated_loopback: true,
        put_window_bytes: 16 << 20,
        ..OwnerConfig::default()
    };
    // The UCX plane over UCX's tcp transport on loopback, wherever libucp loads.
    let config = match kvtide_remote::ucx_available() {
        Ok(_) => OwnerConfig {
            ucx_transports: Some("tcp".into()),
            ucx_allow_tcp: true,
            ucx_program: Some(owner_binary()),
            ..config
        },
        Err(why) => {
            eprintln!("no UCX plane: {why}");
            config
        }
    };
    (Owner::start(Arc::clone(engine), config).expect("owner"), dir)
}

/// The `kvtide-owner` binary that hosts the UCX plane's process: the one cargo built, else the
/// one on PATH (the GPU machine runs a copied test binary).
fn owner_binary() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvtide-owner"));
    if built.exists() {
        built
    } else {
        "kvtide-owner".into()
    }
}

/// A TCP client of `owner` reading over its UCX plane (made again until it attaches, 10 s at
/// most); None where the owner has no plane (libucp missing here).
#[cfg(feature = "cuda")]
fn ucx_client(owner: &Owner) -> Option<RemoteStore> {
    use kvtide_remote::DataPlane;
    owner.ucx_plane()?;
    let addr = owner.tcp_addr().expect("tcp").to_string();
    let options = ClientOptions { ucx_transports: Some("tcp".into()), ucx_allow_tcp: true, ..ClientOptions::default() };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let store = RemoteStore::connect_with(&addr, options.clone()).expect("connect with UCX");
        if store.data_plane() == DataPlane::Ucx {
            return Some(store);
        }
        assert!(std::time::Instant::now() < deadline, "not attached: {:?}", store.ucx_refusal());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A region that claims to be GPU memory at an address no GPU allocated.
fn bogus_device_region() -> Region<'static> {
    // SAFETY: never dereferenced by the CPU: the GPU transport checks it (and refuses it) first.
    unsafe { Region::from_raw(0x7000_0000_0000, 4096, MemoryKind::Device { ordinal: 0 }) }
}

#[test]
fn device_regions_fail_alone_when_the_gpu_cannot_take_them() {
    let e = engine();
    let (owner, dir) = owner(&e, "refused");
    let path = owner.unix_path().expect("unix").display().to_string();
    let unix = RemoteStore::connect_with(&path, ClientOptions::default()).expect("unix");
    let tcp =
        RemoteStore::connect_with(&owner.tcp_addr().expect("tcp").to_string(), ClientOptions::default()).expect("tcp");
    for store in [&unix, &tcp] {
        store.put(b"k", &[1u8; 4096], PutOptions::UPSERT).expect("put");
        store.put(b"j", &[2u8; 4096], PutOptions::UPSERT).expect("put");
        let mut host = vec![0u8; 4096];
        let got = store
            .batch_get_into_multi_buffers(&[b"k", b"j"], &[vec![bogus_device_region()], vec![Region::host(&mut host)]]);
        // No GPU (CI): CudaUnavailable; a GPU: the address is not its memory.
        assert!(matches!(got[0], Err(Error::Store(_))), "{:?}", got[0]);
        assert_eq!(got[1], Ok(4096), "the neighbour is read");
        assert_eq!(host, vec![2u8; 4096]);
        let put = store.batch_put_from_multi_buffers(
            &[b"from-gpu", b"from-host"],
            &[vec![bogus_device_region()], vec![Region::host_readonly(&[3u8; 100])]],
            PutOptions::UPSERT,
        );
        assert!(matches!(put[0], Err(Error::Store(_))), "{:?}", put[0]);
        assert_eq!(put[1], Ok(()));
        assert_eq!(store.exists(b"from-gpu"), Ok(false), "a refused source stores nothing");
        // Chunk handles: a refused device destination is the call's error, or its chunks'.
        let progressive = store.progressive_get(b"k", bogus_device_region(), 1024);
        assert!(matches!(progressive, Err(Error::Store(_))), "{progressive:?}");
        let streamed = store
            .streaming_batch_get_buffer_ranges(
                &[bogus_device_region()],
                &[vec![kvtide::Fragment::new(b"k".to_vec(), 0, 0, 2048)]],
                1024,
            )
            .map(|h| h.wait_all());
        assert!(matches!(streamed, Ok(Err(Error::Store(_))) | Err(Error::Store(_))), "{streamed:?}");
    }
    if !cfg!(feature = "cuda") {
        let got = unix.get_into(b"k", bogus_device_region());
        assert!(matches!(got, Err(Error::Store(StoreError::CudaUnavailable(_)))), "{got:?}");
    }
    drop((unix, tcp));
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn stream_bound_reads_through_the_owner_without_a_gpu() {
    let e = engine();
    let (owner, dir) = owner(&e, "on-stream");
    let path = owner.unix_path().expect("unix").display().to_string();
    let unix = RemoteStore::connect_with(&path, ClientOptions::default()).expect("unix");
    let tcp =
        RemoteStore::connect_with(&owner.tcp_addr().expect("tcp").to_string(), ClientOptions::default()).expect("tcp");
    unix.put(b"s", &[5u8; 1000], PutOptions::UPSERT).expect("put");
    for store in [&unix, &tcp] {
        // Stream 0 is the blocking read, ended on return.
        let mut buf = vec![0u8; 1000];
        let mut small = vec![0u8; 10];
        // SAFETY: stream 0 reads before returning; the buffers outlive the call.
        let ticket = unsafe {
            store.batch_get_into_multi_buffers_on_stream(
                &[b"s", b"missing"],
                &[vec![Region::host(&mut buf)], vec![Region::host(&mut small)]],
                0,
            )
        }
        .expect("stream 0");
        assert_eq!(ticket.status(), kvtide::StreamStatus::Failed(vec![(1, StoreError::NotFound)]));
        assert_eq!(ticket.results().expect("ended")[0], Ok(1000));
        assert_eq!(buf, vec![5u8; 1000]);
        let mut out = vec![0u8; 64];
        let frags = vec![vec![
            kvtide::Fragment::new(b"s".to_vec(), 10, 0, 32),
            kvtide::Fragment::new(b"s".to_vec(), 999, 40, 2),
        ]];
        // SAFETY: as above.
        let ticket = unsafe { store.get_into_ranges_on_stream(&[Region::host(&mut out)], &frags, 0) }.expect("ranges");
        let results = ticket.results().expect("ended");
        assert_eq!(results[0], Ok(32));
        assert!(matches!(results[1], Err(StoreError::InvalidRange(_))), "{results:?}");
        // A stream needs the GPU transport: without one the call says so.
        if !cfg!(feature = "cuda") {
            // SAFETY: refused before anything is enqueued.
            let refused = unsafe {
                store.batch_get_into_multi_buffers_on_stream(&[b"s"], &[vec![Region::host(&mut buf)]], 0x1234)
            };
            assert!(matches!(refused, Err(Error::Store(StoreError::CudaUnavailable(_)))), "{refused:?}");
        }
    }
    drop((unix, tcp));
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// A step through the owner without a GPU: stream 0 reads every layer, blocking, results layer
/// after layer; a bad step (overlapping device destinations, a signal on stream 0, too many
/// layers) is refused whole before anything is asked of the owner.
#[test]
fn steps_through_the_owner_without_a_gpu() {
    use kvtide::{StepLayer, StepReads, StreamSignal, MAX_STEP_LAYERS};
    let e = engine();
    let (owner, dir) = owner(&e, "step");
    let path = owner.unix_path().expect("unix").display().to_string();
    let unix = RemoteStore::connect_with(&path, ClientOptions::default()).expect("unix");
    let tcp =
        RemoteStore::connect_with(&owner.tcp_addr().expect("tcp").to_string(), ClientOptions::default()).expect("tcp");
    unix.put(b"l0", &[1u8; 100], PutOptions::UPSERT).expect("put");
    unix.put(b"l1", &[2u8; 200], PutOptions::UPSERT).expect("put");
    for store in [&unix, &tcp] {
        let (mut a, mut b, mut c) = (vec![0u8; 100], vec![0u8; 50], vec![0u8; 8]);
        let l0_keys: [&[u8]; 2] = [b"l0", b"missing"];
        let l0_dsts = vec![vec![Region::host(&mut a)], vec![Region::host(&mut c)]];
        let l1_bufs = [Region::host(&mut b)];
        let l1_frags = vec![vec![kvtide::Fragment::new(b"l1".to_vec(), 150, 0, 50)]];
        let layers = [
            StepLayer { reads: StepReads::Objects { keys: &l0_keys, dsts: &l0_dsts }, done: None },
            StepLayer { reads: StepReads::Ranges { buffers: &l1_bufs, fragments: &l1_frags }, done: None },
        ];
        // SAFETY: stream 0 reads before returning; the buffers outlive the call.
        let ticket = unsafe { store.step_on_stream(&layers, 0) }.expect("stream 0");
        assert_eq!(ticket.results().expect("ended"), vec![Ok(100), Err(StoreError::NotFound), Ok(50)]);
        drop((l0_dsts, l1_bufs));
        assert_eq!((a, b), (vec![1u8; 100], vec![2u8; 50]));
        // Refused whole: a signal on stream 0, overlapping device destinations, too many layers.
        let dst = [vec![bogus_device_region()]];
        let keys: [&[u8]; 1] = [b"l0"];
        let signalled = [StepLayer {
            reads: StepReads::Objects { keys: &keys, dsts: &dst },
            done: Some(StreamSignal::RecordEvent(1)),
        }];
        let plain = StepLayer { reads: StepReads::Objects { keys: &keys, dsts: &dst }, done: None };
        let too_many = vec![plain; MAX_STEP_LAYERS + 1];
        for (what, layers, stream) in [
            ("signal on stream 0", &signalled[..], 0),
            ("overlap", &[plain, plain][..], 0x1234),
            ("too many", &too_many[..], 0x1234),
        ] {
            // SAFETY: refused before anything is enqueued.
            let refused = unsafe { store.step_on_stream(layers, stream) };
            assert!(matches!(refused, Err(Error::Store(StoreError::InvalidArgument(_)))), "{what}: {refused:?}");
        }
    }
    drop((unix, tcp));
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::process::Command;
    use std::sync::Arc;

    use super::common::value_for;
    use super::{engine, owner, ucx_client};
    use kvtide::cuda::{CudaDevice, CudaTransport, DeviceBuffer};
    use kvtide::{Error as StoreError, Fragment, MemoryKind, PutOptions, Region, Store};
    use kvtide_remote::{ClientOptions, Error, RemoteStore};

    const GUARD: u8 = 0xA5;
    const GPU0: MemoryKind = MemoryKind::Device { ordinal: 0 };

    fn gpu() -> Arc<CudaDevice> {
        CudaTransport::get().and_then(|t| t.device(0)).expect("a CUDA device")
    }

    fn dev(buf: &DeviceBuffer, offset: u64, len: u64) -> Region<'static> {
        assert!(offset + len <= buf.len() as u64);
        // SAFETY: inside a live device allocation that outlives every call using the region.
        unsafe { Region::from_raw(buf.addr() + offset, len as usize, GPU0) }
    }

    fn read_back(buf: &DeviceBuffer) -> Vec<u8> {
        let mut out = vec![0u8; buf.len()];
        buf.read(0, &mut out).expect("read back");
        out
    }

    /// Sizes that cover small pages, odd lengths, and values larger than half the put window
    /// (those take a host buffer on the way to the owner).
    const LENS: [u64; 6] = [4096, 1000, 128 << 10, 12 << 20, 333_333, 1];

    /// Reads, range reads and puts between `store` and GPU memory, checked byte for byte.
    fn round_trip(store: &RemoteStore, name: &str) {
        let device = gpu();
        let keys: Vec<Vec<u8>> = (0..LENS.len()).map(|i| format!("{name}/gpu/{i}").into_bytes()).collect();
        let values: Vec<Vec<u8>> = keys.iter().zip(LENS).map(|(k, len)| value_for(k, 7, len as usize)).collect();
        for (k, v) in keys.iter().zip(&values) {
            store.put(k, v, PutOptions::UPSERT).expect("put");
        }
        // Every key into the pool: each value split over two device regions in reverse order,
        // with guard bytes between.
        let total: u64 = LENS.iter().map(|l| l + 64).sum::<u64>() + 4096;
        let pool = device.alloc(total as usize).expect("alloc");
        pool.fill(GUARD).expect("fill");
        let mut at = total;
        let mut dsts = Vec::new();
        let mut places = Vec::new();
        for len in LENS {
            at -= len + 64;
            let half = len / 2;
            dsts.push(vec![dev(&pool, at, half), dev(&pool, at + half, len - half)]);
            places.push(at);
        }
        let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut with_bad = key_refs.clone();
        with_bad.push(b"missing");
        let mut bad_dsts = dsts.clone();
        bad_dsts.push(vec![dev(&pool, 0, 16)]);
        let got = store.batch_get_into_multi_buffers(&with_bad, &bad_dsts);
        for (i, r) in got[..LENS.len()].iter().enumerate() {
            assert_eq!(r, &Ok(LENS[i] as usize), "{name}: key {i}");
        }
        assert_eq!(got[LENS.len()], Err(StoreError::NotFound.into()), "{name}");
        let bytes = read_back(&pool);
        for (i, &at) in places.iter().enumerate() {
            let at = at as usize;
            assert!(bytes[at..at + LENS[i] as usize] == values[i][..], "{name}: bytes of key {i}");
            assert!(bytes[at + LENS[i] as usize..at + LENS[i] as usize + 64].iter().all(|&b| b == GUARD));
        }
        // A size mismatch fails alone; get_into a larger region reads the object's length.
        let short = store.batch_get_into_multi_buffers(&[key_refs[0]], &[vec![dev(&pool, 0, 100)]]);
        assert!(matches!(short[0], Err(Error::Store(StoreError::SizeMismatch { .. }))), "{short:?}");
        let single = device.alloc(1 << 20).expect("alloc");
        single.fill(GUARD).expect("fill");
        assert_eq!(store.get_into(key_refs[1], dev(&single, 0, 1 << 20)), Ok(1000), "{name}");
        let back = read_back(&single);
        assert!(back[..1000] == values[1][..] && back[1000..].iter().all(|&b| b == GUARD), "{name}: get_into");

        // Ranges: pieces of two keys into one device buffer.
        let buffer = device.alloc(64 << 10).expect("alloc");
        buffer.fill(GUARD).expect("fill");
        let fragments = vec![vec![
            Fragment::new(keys[2].clone(), 5, 0, 4000),
            Fragment::new(keys[0].clone(), 96, 8192, 4000),
            Fragment::new(keys[1].clone(), 990, 20_000, 20),
        ]];
        let r = store.get_into_ranges(&[dev(&buffer, 0, 64 << 10)], &fragments);
        assert_eq!(r[0][0], Ok(4000), "{name}");
        assert_eq!(r[0][1], Ok(4000), "{name}");
        assert!(matches!(r[0][2], Err(Error::Store(StoreError::InvalidRange(_)))), "{name}: {:?}", r[0][2]);
        let back = read_back(&buffer);
        assert!(back[..4000] == values[2][5..4005], "{name}: range 0");
        assert!(back[8192..12_192] == values[0][96..4096], "{name}: range 1");
        assert!(back[20_000..20_020].iter().all(|&b| b == GUARD), "{name}: a failed range writes nothing");

        // Chunk handles into GPU memory: a progressive get of the 12 MiB value in 1 MiB chunks
        // (every chunk checked once it settles), and a streaming range read.
        let big = device.alloc(13 << 20).expect("alloc");
        big.fill(GUARD).expect("fill");
        let h = store.progressive_get(&keys[3], dev(&big, 0, 13 << 20), 1 << 20).expect("progressive_get");
        assert_eq!(h.num_chunks(), 12, "{name}");
        for i in 0..h.num_chunks() {
            h.wait_chunk(i).unwrap_or_else(|e| panic!("{name}: chunk {i}: {e}"));
            let range = h.chunk_range(i).expect("range");
            let mut got = vec![0u8; (range.end - range.start) as usize];
            big.read(range.start as usize, &mut got).expect("read back");
            assert!(got[..] == values[3][range.start as usize..range.end as usize], "{name}: chunk {i}");
        }
        let back = read_back(&big);
        assert!(back[12 << 20..].iter().all(|&b| b == GUARD), "{name}: past the object");
        let small = store.progressive_get(&keys[3], dev(&big, 0, 1 << 20), 1 << 20);
        assert!(small.is_err(), "{name}: a destination smaller than the object");
        big.fill(GUARD).expect("fill");
        let frags = vec![vec![
            Fragment::new(keys[3].clone(), 0, 0, 5 << 20),
            Fragment::new(keys[4].clone(), 7, 6 << 20, 300_000),
            Fragment::new(b"missing".to_vec(), 0, 7 << 20, 10),
        ]];
        let h = store
            .streaming_batch_get_buffer_ranges(&[dev(&big, 0, 13 << 20)], &frags, 1 << 20)
            .expect("streaming ranges");
        assert!(h.wait_all().is_err(), "{name}: the missing key fails its chunk");
        for i in 0..h.num_chunks() {
            let missing = h.chunk_range(i).is_some_and(|r| r.start >= 7 << 20);
            assert_eq!(h.wait_chunk(i).is_err(), missing, "{name}: chunk {i}");
        }
        let back = read_back(&big);
        assert!(back[..5 << 20] == values[3][..5 << 20], "{name}: streamed range 0");
        assert!(back[6 << 20..(6 << 20) + 300_000] == values[4][7..300_007], "{name}: streamed range 1");
        assert!(back[7 << 20..(7 << 20) + 10].iter().all(|&b| b == GUARD), "{name}: the missing key");

        // A batch the owner answers in several parts (more than 256 DRAM-resident keys): each
        // part's copies are placed while the part before is on the GPU.
        let many: Vec<Vec<u8>> = (0..600).map(|i| format!("{name}/many/{i}").into_bytes()).collect();
        let many_lens: Vec<u64> = (0..600u64).map(|i| 4096 + 17 * i).collect();
        for (k, &len) in many.iter().zip(&many_lens) {
            store.put(k, &value_for(k, 11, len as usize), PutOptions::UPSERT).expect("put");
        }
        let many_total: u64 = many_lens.iter().sum();
        let many_pool = device.alloc(many_total as usize).expect("alloc");
        let mut at = 0u64;
        let many_dsts: Vec<Vec<Region<'_>>> = many_lens
            .iter()
            .map(|&len| {
                let r = vec![dev(&many_pool, at, len)];
                at += len;
                r
            })
            .collect();
        let many_refs: Vec<&[u8]> = many.iter().map(Vec::as_slice).collect();
        let got = store.batch_get_into_multi_buffers(&many_refs, &many_dsts);
        assert!(got.iter().zip(&many_lens).all(|(r, &len)| *r == Ok(len as usize)), "{name}: {got:?}");
        let back = read_back(&many_pool);
        let mut at = 0usize;
        for (k, &len) in many.iter().zip(&many_lens) {
            assert!(back[at..at + len as usize] == value_for(k, 11, len as usize)[..], "{name}: {k:?}");
            at += len as usize;
        }

        // Puts from GPU memory: the pool's copies go back under new keys.
        let new_keys: Vec<Vec<u8>> = keys.iter().map(|k| [k.as_slice(), b"/from-gpu"].concat()).collect();
        let new_refs: Vec<&[u8]> = new_keys.iter().map(Vec::as_slice).collect();
        let put = store.batch_put_from_multi_buffers(&new_refs, &dsts, PutOptions::UPSERT);
        assert!(put.iter().all(|r| r.is_ok()), "{name}: {put:?}");
        for (k, v) in new_keys.iter().zip(&values) {
            assert!(store.get(k).expect("get") == *v, "{name}: {}", String::from_utf8_lossy(k));
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn same_host_and_tcp_clients_read_into_and_put_from_their_gpu() {
        let e = engine();
        let (owner, dir) = owner(&e, "round-trip");
        let path = owner.unix_path().expect("unix").display().to_string();
        let direct = RemoteStore::connect_with(&path, ClientOptions::default()).expect("unix");
        assert!(direct.uses_shared_memory());
        let mut staged_options = ClientOptions::default();
        staged_options.gpu.staging = true;
        staged_options.gpu.staging_bytes = 8 << 20;
        let staged = RemoteStore::connect_with(&path, staged_options).expect("unix staged");
        let tcp = RemoteStore::connect_with(&owner.tcp_addr().expect("tcp").to_string(), ClientOptions::default())
            .expect("tcp");
        round_trip(&direct, "direct");
        round_trip(&staged, "staged");
        round_trip(&tcp, "tcp");
        let ucx = ucx_client(&owner);
        if let Some(ucx) = &ucx {
            round_trip(ucx, "ucx");
        }
        drop((direct, staged, tcp, ucx));
        e.sync_shards().expect("sync");
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(e.stats().held_resources().is_zero(), "{:?}", e.stats().held_resources());
        assert_eq!(owner.counters().leases_outstanding.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(owner);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn stream_bound_reads_through_the_owner_land_in_stream_order() {
        use kvtide::cuda::{CudaEvent, CudaStream};
        use kvtide::StreamStatus;
        use std::time::Duration;
        let e = engine();
        let (owner, dir) = owner(&e, "stream-gpu");
        let path = owner.unix_path().expect("unix").display().to_string();
        let unix = RemoteStore::connect_with(&path, ClientOptions::default()).expect("unix");
        let tcp = RemoteStore::connect_with(&owner.tcp_addr().expect("tcp").to_string(), ClientOptions::default())
            .expect("tcp");
        let device = gpu();
        let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("bound/{i}").into_bytes()).collect();
        let len = 256 << 10;
        for k in &keys {
            e.put(k, &value_for(k, 3, len), PutOptions::UPSERT).expect("put");
        }
        let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let ucx = ucx_client(&owner);
        let mut stores = vec![("unix", &unix), ("tcp", &tcp)];
        stores.extend(ucx.as_ref().map(|u| ("ucx", u)));
        for (name, store) in stores {
            store.prepare_gpu(0).expect("prepare");
            let pages = device.alloc(keys.len() * len).expect("alloc");
            pages.fill(GUARD).expect("fill");
            let check = device.alloc(keys.len() * len).expect("alloc");
            let dsts: Vec<Vec<Region<'_>>> =
                (0..keys.len()).map(|i| vec![dev(&pages, (i * len) as u64, len as u64)]).collect();
            let stream = CudaStream::new(&device).expect("stream");
            let other = CudaStream::new(&device).expect("stream");
            let ready = CudaEvent::new(&device, false).expect("event");
            // The stream is busy for a while: the copies queue behind this kernel.
            stream.spin(20_000_000).expect("spin");
            // SAFETY: the pages outlive the stream's copies (synchronised below).
            let ticket = unsafe { store.batch_get_into_multi_buffers_on_stream(&key_refs, &dsts, stream.handle()) }
                .expect("enqueued");
            ready.record(stream.handle()).expect("record");
            other.wait_event(&ready, false).expect("wait");
            // SAFETY: both live allocations of the same size.
            unsafe { other.copy_device(check.addr(), pages.addr(), keys.len() * len) }.expect("copy");
            if name != "unix" {
                assert_eq!(
                    store.stream_host_bytes(),
                    (keys.len() * len) as u64,
                    "{name}: held until the stream passes"
                );
            }
            if name == "unix" {
                assert_eq!(ticket.status(), StreamStatus::Pending, "{name}");
                assert_eq!(ticket.keys_pinned(), keys.len(), "{name}: leased until the stream passes");
                // The objects change under the pending read: the leased bytes stay.
                e.put(&keys[0], &value_for(&keys[0], 9, len), PutOptions::UPSERT).expect("upsert");
                e.remove(&keys[1], true).expect("force remove");
            }
            other.synchronize().expect("sync");
            let results = ticket.wait(Duration::from_secs(10)).expect("ended");
            assert!(results.iter().all(|r| *r == Ok(len)), "{name}: {results:?}");
            let got = read_back(&check);
            // The leased (or already read) bytes: the versions as of the call.
            for (i, k) in keys.iter().enumerate() {
                assert!(got[i * len..(i + 1) * len] == value_for(k, 3, len)[..], "{name}: key {i}");
            }
            assert_eq!(ticket.keys_pinned(), 0);
            e.put(&keys[0], &value_for(&keys[0], 3, len), PutOptions::UPSERT).expect("restore");
            e.put(&keys[1], &value_for(&keys[1], 3, len), PutOptions::UPSERT).expect("restore");
            // Ranges on the stream, one bad fragment failing alone.
            let frags = vec![vec![
                kvtide::Fragment::new(keys[2].clone(), 100, 0, 4096),
                kvtide::Fragment::new(keys[3].clone(), (len - 10) as u64, 8192, 20),
            ]];
            // SAFETY: as above.
            let ticket = unsafe { store.get_into_ranges_on_stream(&[dev(&pages, 0, 65536)], &frags, stream.handle()) }
                .expect("ranges");
            stream.synchronize().expect("sync");
            let results = ticket.wait(Duration::from_secs(10)).expect("ended");
            assert_eq!(results[0], Ok(4096), "{name}");
            assert!(matches!(results[1], Err(StoreError::InvalidRange(_))), "{name}: {results:?}");
            assert!(read_back(&pages)[..4096] == value_for(&keys[2], 3, len)[100..4196], "{name}: range");
            // A capturing stream is refused.
            let captured = CudaStream::new(&device).expect("stream");
            captured.begin_capture().expect("capture");
            // SAFETY: refused before anything is enqueued.
            let refused =
                unsafe { store.batch_get_into_multi_buffers_on_stream(&key_refs[..1], &dsts[..1], captured.handle()) };
            assert!(matches!(refused, Err(Error::Store(StoreError::StreamCapturing(_)))), "{name}: {refused:?}");
            drop(captured.end_capture().expect("end capture"));
        }
        assert_eq!(tcp.stream_host_bytes(), 0, "host buffers go back once the stream passed");
        assert_eq!(ucx.as_ref().map_or(0, |u| u.stream_host_bytes()), 0, "ucx: host buffers go back");
        // A TCP client holds at most max_stream_host_bytes of objects waiting for its stream.
        let options = ClientOptions { max_stream_host_bytes: len as u64, ..ClientOptions::default() };
        let bounded = RemoteStore::connect_with(&owner.tcp_addr().expect("tcp").to_string(), options).expect("tcp");
        let pages = device.alloc(2 * len).expect("alloc");
        let stream = CudaStream::new(&device).expect("stream");
        let two: Vec<Vec<Region<'_>>> = (0..2).map(|i| vec![dev(&pages, (i * len) as u64, len as u64)]).collect();
        // SAFETY: refused before anything is enqueued.
        let refused = unsafe { bounded.batch_get_into_multi_buffers_on_stream(&key_refs[..2], &two, stream.handle()) };
        assert!(matches!(refused, Err(Error::Store(StoreError::Busy { .. }))), "{refused:?}");
        // SAFETY: the pages outlive the stream's copies (synchronised below).
        let ticket =
            unsafe { bounded.batch_get_into_multi_buffers_on_stream(&key_refs[..1], &two[..1], stream.handle()) }
                .expect("within the bound");
        stream.synchronize().expect("sync");
        assert_eq!(ticket.wait(Duration::from_secs(10)).expect("ended"), vec![Ok(len)]);
        assert_eq!(bounded.stream_host_bytes(), 0);
        drop(bounded);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while owner.counters().leases_outstanding.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            assert!(std::time::Instant::now() < deadline, "leases still held");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop((unix, tcp, ucx));
        drop(owner);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A step through the owner, same host and TCP: four layers behind a long kernel, each
    /// layer's event recorded after its copies; a second stream waits on each event in turn and
    /// copies the layer right then, so every copy shows the layer's whole KV.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn steps_through_the_owner_signal_each_layer_after_its_copies() {
        use kvtide::cuda::{CudaEvent, CudaStream};
        use kvtide::{StepLayer, StepReads, StreamSignal};
        use std::time::Duration;
        let e = engine();
        let (owner, dir) = owner(&e, "step-gpu");
        let path = owner.unix_path().expect("unix").display().to_string();
        let unix = RemoteStore::connect_with(&path, ClientOptions::default()).expect("unix");
        let tcp = RemoteStore::connect_with(&owner.tcp_addr().expect("tcp").to_string(), ClientOptions::default())
            .expect("tcp");
        let device = gpu();
        let (layers, per_layer, len) = (4usize, 2usize, 128usize << 10);
        let keys: Vec<Vec<Vec<u8>>> =
            (0..layers).map(|l| (0..per_layer).map(|k| format!("step/{l}/{k}").into_bytes()).collect()).collect();
        for key in keys.iter().flatten() {
            e.put(key, &value_for(key, 5, len), PutOptions::UPSERT).expect("put");
        }
        let key_refs: Vec<Vec<&[u8]>> = keys.iter().map(|l| l.iter().map(Vec::as_slice).collect()).collect();
        let layer_bytes = per_layer * len;
        let ucx = ucx_client(&owner);
        let mut stores = vec![("unix", &unix), ("tcp", &tcp)];
        stores.extend(ucx.as_ref().map(|u| ("ucx", u)));
        for (name, store) in stores {
            store.prepare_gpu(0).expect("prepare");
            let pages = device.alloc(layers * layer_bytes).expect("alloc");
            pages.fill(GUARD).expect("fill");
            let check = device.alloc(layers * layer_bytes).expect("alloc");
            let dsts: Vec<Vec<Vec<Region<'_>>>> = (0..layers)
                .map(|l| {
                    (0..per_layer).map(|k| vec![dev(&pages, (l * layer_bytes + k * len) as u64, len as u64)]).collect()
                })
                .collect();
            let events: Vec<CudaEvent> = (0..layers).map(|_| CudaEvent::new(&device, false).expect("event")).collect();
            let step: Vec<StepLayer<'_, '_>> = (0..layers)
                .map(|l| StepLayer {
                    reads: StepReads::Objects { keys: &key_refs[l], dsts: &dsts[l] },
                    done: Some(StreamSignal::RecordEvent(events[l].handle())),
                })
                .collect();
            let stream = CudaStream::new(&device).expect("stream");
            let other = CudaStream::new(&device).expect("stream");
            stream.spin(20_000_000).expect("spin");
            // SAFETY: the pages and events outlive the stream's work (synchronised below).
            let ticket = unsafe { store.step_on_stream(&step, stream.handle()) }.expect("step");
            for (l, event) in events.iter().enumerate() {
                other.wait_event(event, false).expect("wait");
                let at = (l * layer_bytes) as u64;
                // SAFETY: both live allocations; the range lies inside them.
                unsafe { other.copy_device(check.addr() + at, pages.addr() + at, layer_bytes) }.expect("copy");
            }
            other.synchronize().expect("sync");
            let results = ticket.wait(Duration::from_secs(10)).expect("ended");
            assert_eq!(results, vec![Ok(len); layers * per_layer], "{name}");
            let got = read_back(&check);
            for (l, layer) in keys.iter().enumerate() {
                for (k, key) in layer.iter().enumerate() {
                    let at = l * layer_bytes + k * len;
                    assert!(got[at..at + len] == value_for(key, 5, len)[..], "{name}: layer {l} key {k}");
                }
            }
            assert_eq!(ticket.keys_pinned(), 0);
        }
        assert_eq!(tcp.stream_host_bytes(), 0);
        assert_eq!(ucx.as_ref().map_or(0, |u| u.stream_host_bytes()), 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while owner.counters().leases_outstanding.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            assert!(std::time::Instant::now() < deadline, "leases still held");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop((unix, tcp, ucx));
        drop(owner);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Child process: reads through the owner at `KVTIDE_GPU_CHILD_SOCKET` into its own GPU.
    #[test]
    #[ignore = "run by a_second_process_reads_into_its_gpu as a child process"]
    fn gpu_child_reader() {
        let Ok(path) = std::env::var("KVTIDE_GPU_CHILD_SOCKET") else { return };
        let store = RemoteStore::connect_with(&path, ClientOptions::default()).expect("child connect");
        round_trip(&store, "child");
        println!("VERIFIED");
    }

    /// Child process: reads a batch into its GPU over and over until it is killed.
    #[test]
    #[ignore = "run by a_reader_killed_mid_copy_leaves_no_lease as a child process"]
    fn gpu_child_looper() {
        let Ok(path) = std::env::var("KVTIDE_GPU_LOOP_SOCKET") else { return };
        let store = RemoteStore::connect_with(&path, ClientOptions::default()).expect("child connect");
        let device = gpu();
        let pool = device.alloc(64 << 20).expect("alloc");
        let keys: Vec<Vec<u8>> = (0..16).map(|i| format!("loop/{i}").into_bytes()).collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let dsts: Vec<Vec<Region<'_>>> = (0..16).map(|i| vec![dev(&pool, i * (4 << 20), 4 << 20)]).collect();
        let mut announced = false;
        loop {
            let got = store.batch_get_into_multi_buffers(&key_refs, &dsts);
            assert!(got.iter().all(|r| r.is_ok()), "{got:?}");
            if !announced {
                println!("LOOPING");
                use std::io::Write;
                std::io::stdout().flush().expect("flush");
                announced = true;
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_reader_killed_mid_copy_leaves_no_lease() {
        use std::io::BufRead;
        let e = engine();
        let (owner, dir) = owner(&e, "killed");
        for i in 0..16 {
            let key = format!("loop/{i}").into_bytes();
            e.put(&key, &value_for(&key, 1, 4 << 20), PutOptions::UPSERT).expect("put");
        }
        let path = owner.unix_path().expect("unix").display().to_string();
        let exe = std::env::current_exe().expect("exe");
        let mut child = Command::new(exe)
            .args(["--ignored", "--exact", "cuda::gpu_child_looper", "--nocapture", "--test-threads=1"])
            .env("KVTIDE_GPU_LOOP_SOCKET", &path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("run the child");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = std::io::BufReader::new(stdout).lines();
        assert!(lines.any(|l| l.is_ok_and(|l| l.contains("LOOPING"))), "the child reads");
        std::thread::sleep(std::time::Duration::from_millis(300));
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            e.sync_shards().expect("sync");
            let outstanding = owner.counters().leases_outstanding.load(std::sync::atomic::Ordering::SeqCst);
            if outstanding == 0 && e.stats().held_resources().is_zero() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "still held: {outstanding} leases");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        drop(owner);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_second_process_reads_into_its_gpu() {
        let e = engine();
        let (owner, dir) = owner(&e, "child");
        let path = owner.unix_path().expect("unix").display().to_string();
        let exe = std::env::current_exe().expect("exe");
        let out = Command::new(exe)
            .args(["--ignored", "--exact", "cuda::gpu_child_reader", "--nocapture", "--test-threads=1"])
            .env("KVTIDE_GPU_CHILD_SOCKET", &path)
            .output()
            .expect("run the child");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("VERIFIED"),
            "child: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        e.sync_shards().expect("sync");
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(owner.counters().leases_outstanding.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(owner);
        let _ = std::fs::remove_dir_all(dir);
    }
}
