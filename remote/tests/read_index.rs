//! Same-host reads through the owner's read index: DRAM-resident objects read with no request,
//! every read API; what is removed, replaced or evicted never read from the index; a storm of
//! readers racing upserts, removes and eviction reading no torn or mixed value; an owner that
//! died never read through its index; clients without it (TCP, no shared arena, turned off)
//! leasing as before; and the index descriptor a client receives, sealed like the arena.

mod support;

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::{Error as StoreError, Fragment, PutOptions, Region, Store, StoreBuilder};
use kvtide_remote::protocol::{
    decode_index_map, frame, FrameHeader, Hello, HelloOk, Op, Request, HEADER_BYTES, HELLO_SHM_ATTACHED,
    HELLO_WANT_SHM, NONCE_BYTES,
};
use kvtide_remote::{ClientOptions, Error, Owner, OwnerConfig, ReadIndexCounts, RemoteStore};
use support::{options, recv_with_fd, temp_dir, unix_client, wait_idle};

/// An engine keeping a read index, and an owner sharing it on `dir/owner.sock`.
fn indexed_owner(dir: &std::path::Path, dram_bytes: u64, read_index: bool) -> Owner {
    let engine = Arc::new(
        StoreBuilder::new()
            .dram_bytes(dram_bytes)
            .shards(2)
            .pin_threads(false)
            .idle_spin_us(20)
            .register_fixed_buffers(false)
            .read_index(read_index)
            .open()
            .expect("open store"),
    );
    let config = OwnerConfig { unix_socket: Some(dir.join("owner.sock")), tcp: None, ..OwnerConfig::default() };
    Owner::start(engine, config).expect("start owner")
}

/// Requests the owner served, not counting the reports of reads made through the index.
fn requests(owner: &Owner) -> u64 {
    let c = owner.counters();
    c.requests.load(Ordering::SeqCst) - c.index_read_reports.load(Ordering::SeqCst)
}

/// A value that names its key and version in every 8-byte word, so a mix of two is visible.
fn versioned(key: u32, version: u32, len: usize) -> Vec<u8> {
    let word = (u64::from(key) << 32 | u64::from(version)).to_le_bytes();
    (0..len).map(|i| word[i % 8]).collect()
}

/// The (key, version) a whole value names, or None when it is torn or mixed.
fn version_of(value: &[u8]) -> Option<(u32, u32)> {
    if value.len() < 8 || !value.len().is_multiple_of(8) {
        return None;
    }
    let first = &value[..8];
    if !value.chunks(8).all(|w| w == first) {
        return None;
    }
    let w = u64::from_le_bytes(first.try_into().ok()?);
    Some(((w >> 32) as u32, w as u32))
}

#[test]
fn dram_objects_are_read_with_no_request_through_every_read_call() {
    let dir = temp_dir("ri-calls");
    let owner = indexed_owner(&dir, 64 << 20, true);
    let writer = unix_client(&owner);
    let reader = unix_client(&owner);
    assert!(reader.uses_read_index(), "a Unix client with the arena maps the read index");
    let keys: Vec<Vec<u8>> = (0..16).map(|i| format!("key-{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> = (0..16u32).map(|i| versioned(i, 1, 4096 * (1 + i as usize % 3))).collect();
    for (k, v) in keys.iter().zip(&values) {
        writer.put(k, v, PutOptions::INSERT).expect("put");
    }
    let before = requests(&owner);

    assert_eq!(reader.get(&keys[0]).expect("get"), values[0]);
    let mut buf = vec![0u8; 16 << 10];
    assert_eq!(reader.get_into(&keys[1], Region::host(&mut buf)).expect("get_into"), values[1].len());
    assert_eq!(&buf[..values[1].len()], &values[1][..]);
    // 4 KiB: what the leased path would stream through the socket.
    let mut small = vec![0u8; 4096];
    assert_eq!(reader.get_into(&keys[3], Region::host(&mut small)).expect("small"), 4096);
    assert_eq!(small, values[3]);

    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let dsts: Vec<Region<'_>> = bufs.iter_mut().map(|b| Region::host(b)).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let results = reader.batch_get_into(&key_refs, &dsts);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    drop(dsts);
    assert_eq!(bufs, values);

    // Each object scattered into two halves.
    let mut halves: Vec<(Vec<u8>, Vec<u8>)> =
        values.iter().map(|v| (vec![0u8; v.len() / 2], vec![0u8; v.len() - v.len() / 2])).collect();
    let lists: Vec<Vec<Region<'_>>> = halves.iter_mut().map(|(a, b)| vec![Region::host(a), Region::host(b)]).collect();
    let results = reader.batch_get_into_multi_buffers(&key_refs, &lists);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    drop(lists);
    for ((a, b), v) in halves.iter().zip(&values) {
        assert_eq!([a.as_slice(), b.as_slice()].concat(), *v);
    }

    // Ranges: two fragments of each of two keys into one buffer.
    let mut out = vec![0u8; 400];
    let frag =
        |key: &[u8], src_offset: u64, dst_offset: u64| Fragment { key: key.to_vec(), src_offset, dst_offset, len: 100 };
    let fragments =
        vec![vec![frag(&keys[4], 0, 0), frag(&keys[4], 1000, 100), frag(&keys[5], 8, 200), frag(&keys[5], 4000, 300)]];
    let results = reader.get_into_ranges(&[Region::host(&mut out)], &fragments);
    assert!(results[0].iter().all(|r| r == &Ok(100)), "{results:?}");
    assert_eq!(&out[..100], &values[4][..100]);
    assert_eq!(&out[100..200], &values[4][1000..1100]);
    assert_eq!(&out[200..300], &values[5][8..108]);
    assert_eq!(&out[300..], &values[5][4000..4100]);

    assert_eq!(requests(&owner), before, "no read sent a request");
    let counts = reader.read_index_counts();
    assert_eq!(counts, ReadIndexCounts { read: 1 + 1 + 1 + 16 + 16 + 2, leased: 0 });
    wait_idle(&owner);
}

/// Reads through the index reach the owner as reports: they count as its hits, and they keep
/// their objects warm, so a client that reads only through the index does not see its hot
/// objects evicted as if nobody read them.
#[test]
fn index_reads_count_as_hits_and_keep_their_objects_warm() {
    let dir = temp_dir("ri-warm");
    let owner = indexed_owner(&dir, 16 << 20, true);
    let engine = owner.engine();
    let store = unix_client(&owner);
    let value = |i: u32| versioned(i, 1, 256 << 10);
    let hot: Vec<Vec<u8>> = (0..8).map(|i| format!("hot-{i}").into_bytes()).collect();
    for (i, k) in hot.iter().enumerate() {
        store.put(k, &value(i as u32), PutOptions::INSERT).expect("put hot");
    }
    let hits_before = engine.stats().total.hits;
    let mut buf = vec![0u8; 256 << 10];
    // Eight times the DRAM in cold puts, each followed by a read of every hot object through
    // the index (reported ahead of the next put).
    for round in 0..512u32 {
        let cold = format!("cold-{round}").into_bytes();
        store.put(&cold, &value(1000 + round), PutOptions::INSERT).expect("put cold");
        for (i, k) in hot.iter().enumerate() {
            assert_eq!(store.get_into(k, Region::host(&mut buf)).expect("hot read"), buf.len(), "round {round}");
            assert_eq!(buf, value(i as u32));
        }
    }
    let counts = store.read_index_counts();
    assert!(counts.read >= 8 * 500, "the hot reads went through the index: {counts:?}");
    assert!(engine.stats().total.evictions > 0, "the cold puts evicted");
    // The last report goes out as the store drops, with no reply: wait for the owner to apply it.
    drop(store);
    let applied = |owner: &Owner| owner.counters().index_reads.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    while applied(&owner) < counts.read && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let reported = applied(&owner);
    assert_eq!(reported, counts.read, "every read through the index reported and counted");
    assert!(engine.stats().total.hits - hits_before >= reported, "reported reads count as hits");

    // A hostile report (a shard, slot or generation that names nothing) counts nothing, gets no
    // reply, and leaves the connection in step; reports hold nothing, so a hot object is
    // removed at once.
    let s = UnixStream::connect(owner.unix_path().expect("unix")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut p = Vec::new();
    Hello { client_nonce: [5; NONCE_BYTES], flags: 0 }.encode(&mut p);
    (&s).write_all(&frame(Op::Hello, 0, &p)).expect("hello");
    read_frame_with_fd(&s, Op::HelloOk);
    let mut p = Vec::new();
    Request::IndexReads { reads: vec![(999, 0, 0), (0, u32::MAX, 7), (1, 0, 12_345)] }.encode(&mut p);
    (&s).write_all(&frame(Op::IndexReads, 1, &p)).expect("report");
    let mut p = Vec::new();
    Request::Exists { keys: vec![hot[0].as_slice()] }.encode(&mut p);
    (&s).write_all(&frame(Op::Exists, 2, &p)).expect("exists");
    read_frame_with_fd(&s, Op::ExistsReply);
    assert_eq!(owner.counters().index_reads.load(Ordering::SeqCst), reported, "nothing counted");
    let remover = unix_client(&owner);
    remover.remove(&hot[0], false).expect("a read object is removed at once");
    wait_idle(&owner);
}

#[test]
fn what_the_index_cannot_answer_goes_the_leased_way_with_the_same_result() {
    let dir = temp_dir("ri-fallback");
    let owner = indexed_owner(&dir, 64 << 20, true);
    let store = unix_client(&owner);
    let value = versioned(1, 1, 8192);
    store.put(b"k", &value, PutOptions::INSERT).expect("put");
    // Too small a buffer, a wrong exact size, a range past the end, a missing key: the leased path
    // answers each, with the error the embedded engine gives.
    let mut small = vec![0u8; 100];
    assert_eq!(
        store.get_into(b"k", Region::host(&mut small)),
        Err(Error::Store(StoreError::BufferTooSmall { object_bytes: 8192, buffer_bytes: 100 }))
    );
    let mut exact = vec![0u8; 8000];
    let r = store.batch_get_into_multi_buffers(&[b"k"], &[vec![Region::host(&mut exact)]]);
    assert!(matches!(r[0], Err(Error::Store(StoreError::SizeMismatch { .. }))), "{r:?}");
    let mut out = vec![0u8; 100];
    let past = vec![vec![Fragment { key: b"k".to_vec(), src_offset: 8150, dst_offset: 0, len: 100 }]];
    let r = store.get_into_ranges(&[Region::host(&mut out)], &past);
    assert!(r[0][0].is_err(), "{r:?}");
    assert_eq!(store.get(b"missing"), Err(Error::Store(StoreError::NotFound)));
    let counts = store.read_index_counts();
    assert_eq!(counts.read, 0);
    assert_eq!(counts.leased, 4);
    wait_idle(&owner);
}

#[test]
fn removed_replaced_and_evicted_objects_are_never_read_from_the_index() {
    let dir = temp_dir("ri-change");
    // 2 shards of 2 MiB: a few dozen 64 KiB values evict the first ones.
    let owner = indexed_owner(&dir, 4 << 20, true);
    let writer = unix_client(&owner);
    let reader = unix_client(&owner);
    writer.put(b"k", &versioned(0, 1, 65536), PutOptions::INSERT).expect("put");
    assert_eq!(version_of(&reader.get(b"k").expect("v1")), Some((0, 1)));
    writer.put(b"k", &versioned(0, 2, 32768), PutOptions::UPSERT).expect("upsert");
    assert_eq!(version_of(&reader.get(b"k").expect("v2")), Some((0, 2)), "the upsert is read at once");
    writer.remove(b"k", false).expect("remove");
    assert_eq!(reader.get(b"k"), Err(Error::Store(StoreError::NotFound)), "the remove is seen at once");
    for i in 0..200u32 {
        writer.put(format!("e{i}").as_bytes(), &versioned(i, 1, 65536), PutOptions::UPSERT).expect("put");
    }
    let mut gone = 0;
    for i in 0..200u32 {
        match reader.get(format!("e{i}").as_bytes()) {
            Ok(v) => assert_eq!(version_of(&v), Some((i, 1))),
            Err(Error::Store(StoreError::NotFound)) => gone += 1,
            Err(e) => panic!("e{i}: {e}"),
        }
    }
    assert!(gone > 100, "eviction ran ({gone} of 200 gone)");
    assert!(reader.read_index_counts().read > 0);
    wait_idle(&owner);
}

/// Readers race writers that upsert (changing lengths), remove and overflow DRAM: every value
/// read, through the index or leased, is one whole version of its key.
#[test]
fn a_lease_storm_reads_no_torn_or_mixed_value() {
    const KEYS: u32 = 48;
    let dir = temp_dir("ri-storm");
    let owner = indexed_owner(&dir, 8 << 20, true);
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, torn) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut threads = Vec::new();
    for w in 0..2u32 {
        let store = unix_client(&owner);
        let stop = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            let mut version = 1u32;
            while !stop.load(Ordering::Relaxed) {
                version += 1;
                let key = (version * 7 + w) % KEYS;
                let name = format!("s{key}");
                if version.is_multiple_of(11) {
                    let _ = store.remove(name.as_bytes(), true);
                } else {
                    let len = 8 * (512 + (version as usize * 977) % 16384);
                    let _ = store.put(name.as_bytes(), &versioned(key, version, len), PutOptions::UPSERT);
                }
            }
        }));
    }
    let mut readers = Vec::new();
    for r in 0..3u32 {
        let store = unix_client(&owner);
        let (stop, reads, torn) = (Arc::clone(&stop), Arc::clone(&reads), Arc::clone(&torn));
        readers.push(std::thread::spawn(move || {
            let mut buf = vec![0u8; 8 * (512 + 16384)];
            let mut i = r;
            while !stop.load(Ordering::Relaxed) {
                i = i.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                let key = i % KEYS;
                let name = format!("s{key}");
                let check = |v: &[u8]| match version_of(v) {
                    Some((k, _)) if k == key => {}
                    _ => {
                        torn.fetch_add(1, Ordering::Relaxed);
                    }
                };
                if i.is_multiple_of(2) {
                    if let Ok(v) = store.get(name.as_bytes()) {
                        check(&v);
                    }
                } else if let Ok(n) = store.get_into(name.as_bytes(), Region::host(&mut buf)) {
                    check(&buf[..n]);
                }
                reads.fetch_add(1, Ordering::Relaxed);
            }
            store.read_index_counts()
        }));
    }
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().for_each(|t| t.join().expect("writer"));
    let counts: Vec<ReadIndexCounts> = readers.into_iter().map(|t| t.join().expect("reader")).collect();
    assert_eq!(torn.load(Ordering::Relaxed), 0, "torn or mixed values read");
    assert!(reads.load(Ordering::Relaxed) > 100);
    let indexed: u64 = counts.iter().map(|c| c.read).sum();
    assert!(indexed > 0, "the storm read through the index: {counts:?}");
    println!("storm: {} reads, through the index {counts:?}", reads.load(Ordering::Relaxed));
    wait_idle(&owner);
}

#[test]
fn clients_without_the_index_lease_as_before() {
    let dir = temp_dir("ri-without");
    let owner = indexed_owner(&dir, 32 << 20, true);
    let path = format!("unix:{}", owner.unix_path().expect("unix").display());
    let off = RemoteStore::connect_with(&path, ClientOptions { read_index: false, ..options() }).expect("connect");
    let socket =
        RemoteStore::connect_with(&path, ClientOptions { shared_memory: false, ..options() }).expect("connect");
    off.put(b"k", &versioned(1, 1, 65536), PutOptions::INSERT).expect("put");
    for store in [&off, &socket] {
        assert!(!store.uses_read_index());
        let before = requests(&owner);
        assert_eq!(version_of(&store.get(b"k").expect("get")), Some((1, 1)));
        assert!(requests(&owner) > before, "a leased read asks the owner");
        assert_eq!(store.read_index_counts(), ReadIndexCounts::default());
    }
    // An engine without an index: clients lease.
    let dir = temp_dir("ri-none");
    let plain = indexed_owner(&dir, 32 << 20, false);
    let store = unix_client(&plain);
    assert!(!store.uses_read_index());
    store.put(b"k", b"12345678", PutOptions::INSERT).expect("put");
    assert_eq!(store.get(b"k").expect("get"), b"12345678");
    wait_idle(&owner);
    wait_idle(&plain);
}

/// Connects, asks for shared memory, then for the read index; returns the index descriptor and
/// its announced length (the arena's descriptor, received with the hello, is dropped).
fn receive_index_fd(owner: &Owner) -> (OwnedFd, u64, HelloOk) {
    let s = UnixStream::connect(owner.unix_path().expect("unix")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut p = Vec::new();
    Hello { client_nonce: [5; NONCE_BYTES], flags: HELLO_WANT_SHM }.encode(&mut p);
    (&s).write_all(&frame(Op::Hello, 0, &p)).expect("hello");
    let (payload, _arena) = read_frame_with_fd(&s, Op::HelloOk);
    let hello = HelloOk::decode(&payload).expect("hello ok");
    assert!(hello.flags & HELLO_SHM_ATTACHED != 0);
    (&s).write_all(&frame(Op::ReadIndex, 7, &[])).expect("read index request");
    let (payload, fd) = read_frame_with_fd(&s, Op::IndexMap);
    let bytes = decode_index_map(&payload, 1 << 40).expect("index map");
    (fd.expect("the owner passes the index descriptor"), bytes, hello)
}

/// Reads one frame of `op`, and the descriptor passed with it.
fn read_frame_with_fd(s: &UnixStream, op: Op) -> (Vec<u8>, Option<OwnedFd>) {
    let mut buf = vec![0u8; 4096];
    let mut got = 0;
    let mut fd = None;
    loop {
        if got >= HEADER_BYTES {
            let h = FrameHeader::decode(&buf[..HEADER_BYTES], 4096).expect("header");
            if got >= HEADER_BYTES + h.payload_len as usize {
                assert_eq!(h.op, op);
                return (buf[HEADER_BYTES..HEADER_BYTES + h.payload_len as usize].to_vec(), fd);
            }
        }
        let (n, received) = recv_with_fd(s, &mut buf[got..]);
        assert!(n > 0, "the owner closed");
        got += n;
        fd = fd.or(received);
    }
}

#[test]
fn a_client_cannot_write_or_resize_the_read_index() {
    let dir = temp_dir("ri-sealed");
    let owner = indexed_owner(&dir, 32 << 20, true);
    unix_client(&owner).put(b"k", &versioned(1, 1, 4096), PutOptions::INSERT).expect("put");
    let (fd, bytes, _) = receive_index_fd(&owner);
    let t = fd.as_raw_fd();
    // SAFETY: stat is plain data that fstat fills for a descriptor we hold.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fstat(t, &mut st) }, 0);
    assert_eq!(st.st_mode & 0o777, 0o400, "the index memfd is private to the owner's user, read-only");
    assert_eq!(st.st_size as u64, bytes);
    // SAFETY: fcntl reads the seals of a descriptor we hold.
    let seals = unsafe { libc::fcntl(t, libc::F_GET_SEALS) };
    let wanted = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
    assert_eq!(seals & wanted, wanted, "the index memfd is sealed");
    let evil = [0xAAu8; 8];
    // SAFETY: pwrite/ftruncate/fcntl on a descriptor we hold, from a live array.
    unsafe {
        assert!(libc::pwrite(t, evil.as_ptr().cast(), 8, 4096) < 0, "pwrite");
        assert_ne!(libc::ftruncate(t, 0), 0, "ftruncate(0)");
        assert_ne!(libc::ftruncate(t, (bytes * 2) as libc::off_t), 0, "ftruncate(grow)");
        assert_ne!(libc::fcntl(t, libc::F_ADD_SEALS, libc::F_SEAL_WRITE), 0, "new seals");
    }
    for flags in [libc::MAP_SHARED, libc::MAP_SHARED_VALIDATE] {
        // SAFETY: asks for a new writable mapping at a kernel-chosen address; unmapped if made.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, flags, t, 0) };
        assert_eq!(p, libc::MAP_FAILED, "a writable shared mapping of the index");
    }
    let path = std::ffi::CString::new(format!("/proc/self/fd/{t}")).expect("path");
    // SAFETY: a valid NUL-terminated path; a descriptor made is closed at once.
    let reopened = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if reopened >= 0 {
        // SAFETY: a fresh descriptor we own; the same writes must fail through it.
        let owned = unsafe { OwnedFd::from_raw_fd(reopened) };
        // SAFETY: as above.
        unsafe {
            assert!(libc::pwrite(owned.as_raw_fd(), evil.as_ptr().cast(), 8, 4096) < 0, "pwrite reopened");
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                owned.as_raw_fd(),
                0,
            );
            assert_eq!(p, libc::MAP_FAILED, "a writable mapping through a reopened descriptor");
        }
    }
    // The value still reads whole.
    assert_eq!(version_of(&unix_client(&owner).get(b"k").expect("get")), Some((1, 1)));
}

#[test]
fn an_owner_that_died_is_never_read_through_its_index() {
    let dir = temp_dir("ri-died");
    let socket = dir.join("owner.sock");
    let mut child = std::process::Command::new(support::owner_binary())
        .args(["--unix", socket.to_str().expect("path"), "--tcp", "off", "--http-addr", "off", "--no-ssd"])
        .args(["--data-dir", dir.join("data").to_str().expect("path"), "--dram-bytes", "32MiB", "--shards", "2"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn owner");
    let store = support::wait_served(&mut child, &format!("unix:{}", socket.display()), 30);
    assert!(store.uses_read_index(), "the owner binary shares its read index");
    store.put(b"k", &versioned(1, 1, 65536), PutOptions::INSERT).expect("put");
    assert_eq!(version_of(&store.get(b"k").expect("get")), Some((1, 1)));
    let read = store.read_index_counts().read;
    assert_eq!(read, 1);
    child.kill().expect("kill");
    child.wait().expect("reap");
    let deadline = Instant::now() + Duration::from_millis(50);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
        assert!(store.get(b"k").is_err(), "a dead owner's index must not answer");
    }
    assert_eq!(store.read_index_counts().read, read, "nothing read through the dead owner's index");
    let _ = std::fs::remove_dir_all(&dir);
}
