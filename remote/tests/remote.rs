//! The owner service and `RemoteStore`, on loopback only: every API operation over TCP and over
//! Unix socket + shared memory compared byte for byte with the embedded engine; 32 concurrent
//! clients; a client killed while it holds a lease; malformed, truncated, oversized and
//! wrong-version frames; wrong tokens; the owner restarted under its clients.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::value_for;
use kvtide::{Engine, Error as StoreError, Fragment, PutOptions, Region, RegionError, Store, StoreBuilder};
use kvtide_remote::protocol::{
    decode_error_frame, decode_grants, decode_object, decode_statuses, frame, ClientSegments, FrameHeader, GetItem,
    Hello, HelloOk, LenCheck, Limits, Op, PutHead, PutItem, RangeItem, Request, UcxReady, ValueSource, HEADER_BYTES,
    HELLO_SHM_ATTACHED, HELLO_WANT_SHM, MAGIC, NONCE_BYTES, PROBE_BYTES, PROTOCOL_VERSION,
};
use kvtide_remote::{ClientOptions, DataPlane, Error, Owner, OwnerConfig, OwnerError, RemoteStore, Token};
use support::{options, recv_with_fd, temp_dir, token, unix_client, wait_idle, window_client};

fn engine(dram_bytes: u64) -> Arc<Engine> {
    support::engine(dram_bytes, 2)
}

/// An owner on `dir/owner.sock` and TCP `tcp` (port 0: any), token-authenticated.
fn owner(engine: &Arc<Engine>, dir: &Path, tcp: SocketAddr) -> Owner {
    let config = OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        tcp: Some(tcp),
        tcp_token: Some(token()),
        shutdown_grace_ms: 2_000,
        ..OwnerConfig::default()
    };
    Owner::start(Arc::clone(engine), config).expect("start owner")
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

fn tcp_client(owner: &Owner) -> RemoteStore {
    let addr = owner.tcp_addr().expect("tcp");
    let store = RemoteStore::connect_with(&addr.to_string(), options()).expect("connect tcp");
    assert!(!store.uses_shared_memory());
    store
}

/// A Unix-socket client that does not map the arena: values come through the socket.
fn unix_stream_client(owner: &Owner) -> RemoteStore {
    let path = owner.unix_path().expect("unix").display().to_string();
    let store = RemoteStore::connect_with(&path, ClientOptions { shared_memory: false, ..options() })
        .expect("connect unix without shared memory");
    assert!(!store.uses_shared_memory());
    store
}

/// One shard over `dram_bytes` and a simulated SSD of eight times that (`seed`, `faults`),
/// further set by `tune`.
fn sim_ssd_engine(
    dram_bytes: u64,
    seed: u64,
    faults: kvtide::SimFaults,
    tune: impl FnOnce(StoreBuilder) -> StoreBuilder,
) -> Arc<Engine> {
    let builder = StoreBuilder::new()
        .dram_bytes(dram_bytes)
        .shards(1)
        .pin_threads(false)
        .idle_spin_us(20)
        .register_fixed_buffers(false)
        .ssd_bytes(8 * dram_bytes)
        .ssd_segment_bytes(dram_bytes)
        .simulated_ssd(seed, faults);
    Arc::new(tune(builder).open().expect("open store"))
}

/// `batch_get_into` of `keys` (object i written as `value_for(key, i, len)`) through `store`
/// into buffers of `len` bytes: every result and every byte checked.
fn assert_batch_get_into(what: &str, store: &RemoteStore, keys: &[Vec<u8>], len: usize) {
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let dsts: Vec<Region<'_>> = bufs.iter_mut().map(|b| Region::host(b)).collect();
    let got = store.batch_get_into(&refs, &dsts);
    drop(dsts);
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r, &Ok(len), "{what}: key {i}");
        assert!(bufs[i] == value_for(&keys[i], i as u64, len), "{what}: bytes of {i}");
    }
}

// ---- every operation, compared with the embedded engine ---------------------------------------

/// What one step of the script observed: results and the bytes that landed in buffers.
#[derive(Debug, PartialEq)]
enum Seen {
    Unit(Result<(), Error>),
    Bytes(Result<Vec<u8>, Error>),
    Len(Result<usize, Error>, Vec<u8>),
    Many(Vec<Result<usize, Error>>, Vec<u8>),
    Units(Vec<Result<(), Error>>),
    Ranges(Vec<Vec<Result<usize, Error>>>, Vec<u8>),
    Bools(Vec<Result<bool, Error>>),
    Hits(Result<usize, Error>),
    Objects(u64, u64),
    Keys(Result<Vec<Vec<u8>>, Error>),
}

/// Any store's result as this crate's error (the embedded engine's errors become `Error::Store`).
fn one<T, E: Into<Error>>(r: Result<T, E>) -> Result<T, Error> {
    r.map_err(Into::into)
}

fn many<T, E: Into<Error>>(v: Vec<Result<T, E>>) -> Vec<Result<T, Error>> {
    v.into_iter().map(one).collect()
}

fn ranges<T, E: Into<Error>>(v: Vec<Vec<Result<T, E>>>) -> Vec<Vec<Result<T, Error>>> {
    v.into_iter().map(many).collect()
}

fn script<S: Store>(store: &S) -> Vec<Seen>
where
    S::Error: Into<Error>,
{
    let mut seen = Vec::new();
    let small = value_for(b"small", 0, 100);
    let medium = value_for(b"medium", 0, 200 << 10);
    let large = value_for(b"large", 0, (3 << 20) + 17); // several chunks
    let long_key = vec![b'k'; 2000];
    seen.push(Seen::Unit(one(store.put(b"small", &small, PutOptions::INSERT))));
    seen.push(Seen::Unit(one(store.put(b"medium", &medium, PutOptions::INSERT))));
    seen.push(Seen::Unit(one(store.put(b"large", &large, PutOptions::INSERT))));
    seen.push(Seen::Unit(one(store.put(b"empty", &[], PutOptions::INSERT))));
    seen.push(Seen::Unit(one(store.put(b"small", &small, PutOptions::INSERT)))); // AlreadyExists
    seen.push(Seen::Unit(one(store.put(b"small", &medium[..500], PutOptions::UPSERT))));
    seen.push(Seen::Unit(one(store.put(b"", &small, PutOptions::INSERT)))); // EmptyKey
    seen.push(Seen::Unit(one(store.put(&long_key, &small, PutOptions::INSERT)))); // TooLarge key
    seen.push(Seen::Unit(one(store.put(b"huge", &vec![1u8; 40 << 20], PutOptions::INSERT)))); // TooLarge value
    let (a, b, c) = (value_for(b"a", 1, 70_000), value_for(b"b", 1, 1), value_for(b"c", 1, 2 << 20));
    let sources = [Region::host_readonly(&a), Region::host_readonly(&b), Region::host_readonly(&c)];
    seen.push(Seen::Unit(one(store.put_from(b"gathered", &sources, PutOptions::INSERT))));
    let batch_keys: [&[u8]; 3] = [b"b1", b"", b"b3"];
    let batch_sources = vec![
        vec![Region::host_readonly(&a)],
        vec![Region::host_readonly(&b)],
        vec![Region::host_readonly(&b), Region::host_readonly(&c)],
    ];
    seen.push(Seen::Units(many(store.batch_put_from_multi_buffers(&batch_keys, &batch_sources, PutOptions::INSERT))));
    seen.push(Seen::Units(many(store.batch_put_from_multi_buffers(
        &batch_keys,
        &batch_sources[..1],
        PutOptions::INSERT,
    ))));

    for key in [&b"small"[..], b"medium", b"large", b"empty", b"gathered", b"b3", b"missing", b""] {
        seen.push(Seen::Bytes(one(store.get(key))));
    }
    for (key, size) in [(&b"medium"[..], 200 << 10), (b"medium", 300 << 10), (b"medium", 1000), (b"missing", 10)] {
        let mut buf = vec![0u8; size];
        let r = store.get_into(key, Region::host(&mut buf));
        seen.push(Seen::Len(one(r), buf));
    }
    let ro = vec![0u8; 100];
    seen.push(Seen::Len(one(store.get_into(b"small", Region::host_readonly(&ro))), ro.clone()));

    // Scatter: exact split, wrong total, missing key, mismatched argument lengths.
    let mut pages = vec![0u8; (200 << 10) + 3 * 4096 + 500];
    {
        let (p0, rest) = pages.split_at_mut(100 << 10);
        let (p1, rest) = rest.split_at_mut(100 << 10);
        let (p2, rest) = rest.split_at_mut(4096);
        let (p3, p4) = rest.split_at_mut(4096);
        let keys: [&[u8]; 4] = [b"medium", b"small", b"missing", b"large"];
        let (p2a, p2b) = p2.split_at_mut(400);
        let dsts = vec![
            vec![Region::host(p0), Region::host(p1)],
            vec![Region::host(p2a), Region::host(&mut p2b[..100])],
            vec![Region::host(p3)],
            vec![Region::host(p4)],
        ];
        let r = store.batch_get_into_multi_buffers(&keys, &dsts);
        seen.push(Seen::Many(many(r), Vec::new()));
        let r = store.batch_get_into_multi_buffers(&keys, &dsts[..2]);
        seen.push(Seen::Many(many(r), Vec::new()));
    }
    seen.push(Seen::Many(Vec::new(), pages));

    // Each object into the start of its buffer: larger, exact, too small, missing, empty key,
    // a read-only buffer, mismatched argument lengths.
    let mut bufs = [vec![0u8; (200 << 10) + 9], vec![0u8; 500], vec![0u8; 50], vec![0u8; 10], vec![0u8; 10]];
    {
        let keys: [&[u8]; 6] = [b"medium", b"small", b"large", b"missing", b"", b"small"];
        let ro = vec![0u8; 600];
        let mut dsts: Vec<Region<'_>> = bufs.iter_mut().map(|b| Region::host(b)).collect();
        dsts.push(Region::host_readonly(&ro));
        let r = store.batch_get_into(&keys, &dsts);
        seen.push(Seen::Many(many(r), Vec::new()));
        let r = store.batch_get_into(&keys, &dsts[..2]);
        seen.push(Seen::Many(many(r), Vec::new()));
    }
    seen.push(Seen::Many(Vec::new(), bufs.concat()));

    // Ranges, including every per-fragment failure.
    let mut buf0 = vec![0u8; 600_000];
    let mut buf1 = vec![0u8; 100];
    let fragments = vec![
        vec![
            Fragment::new(b"large".to_vec(), 100, 0, 200_000),
            Fragment::new(b"medium".to_vec(), 0, 200_000, 300),
            Fragment::new(b"small".to_vec(), 490, 500_000, 20), // past the object
            Fragment::new(b"medium".to_vec(), 0, 599_990, 20),  // past the buffer
            Fragment::new(b"zz".to_vec(), 0, 0, 1),             // missing key
            Fragment::new(b"large".to_vec(), u64::MAX, 0, 2),   // overflow
            Fragment::new(b"large".to_vec(), 3 << 20, 300_000, 17),
        ],
        vec![Fragment::new(b"gathered".to_vec(), 69_990, 0, 100)],
        vec![Fragment::new(b"small".to_vec(), 0, 0, 1)], // no such buffer
    ];
    {
        let buffers = [Region::host(&mut buf0), Region::host(&mut buf1)];
        let r = store.get_into_ranges(&buffers, &fragments);
        seen.push(Seen::Ranges(ranges(r), Vec::new()));
    }
    buf0.extend_from_slice(&buf1);
    seen.push(Seen::Ranges(Vec::new(), buf0));

    let keys: [&[u8]; 6] = [b"small", b"medium", b"large", b"nope", b"", b"gathered"];
    seen.push(Seen::Bools(many(store.batch_exists(&keys))));
    seen.push(Seen::Bools(many(vec![store.exists(b"small"), store.exists(b"nope"), store.exists(b"")])));
    seen.push(Seen::Hits(one(store.prefix_hits(&keys))));
    seen.push(Seen::Hits(one(store.prefix_hits(&keys[..3]))));
    seen.push(Seen::Hits(one(store.prefix_hits(&[b"small", b""]))));

    // Pins and removes.
    seen.push(Seen::Unit(one(store.pin(b"small"))));
    seen.push(Seen::Unit(one(store.pin(b"nope"))));
    seen.push(Seen::Unit(one(store.remove(b"small", false))));
    seen.push(Seen::Unit(one(store.unpin(b"small"))));
    seen.push(Seen::Unit(one(store.unpin(b"small"))));
    seen.push(Seen::Unit(one(store.pin(b"medium"))));
    seen.push(Seen::Unit(one(store.remove(b"medium", true))));
    seen.push(Seen::Unit(one(store.remove(b"small", false))));
    seen.push(Seen::Unit(one(store.remove(b"small", false))));
    seen.push(Seen::Unit(one(store.remove(b"", false))));
    // A batch of removes: pinned without force, missing, empty key, a key twice.
    seen.push(Seen::Unit(one(store.pin(b"b1"))));
    let doomed: [&[u8]; 6] = [b"b1", b"b3", b"missing", b"", b"gathered", b"gathered"];
    seen.push(Seen::Units(many(store.batch_remove(&doomed, false))));
    seen.push(Seen::Units(many(store.batch_remove(&[b"b1"], true))));
    seen.push(Seen::Bools(many(store.batch_exists(&keys))));
    seen.push(Seen::Bools(many(store.batch_exists(&doomed))));

    // Async batch get into owned buffers.
    let mut out_a = vec![0u8; 3 << 20];
    let mut out_b = vec![0u8; 17];
    let mut out_c = vec![0u8; 10];
    // SAFETY: the three buffers outlive the ticket, which is waited for below, and nothing else
    // touches them meanwhile.
    let dsts = unsafe {
        vec![
            vec![
                Region::from_raw(out_a.as_mut_ptr() as u64, out_a.len(), kvtide::MemoryKind::Host),
                Region::from_raw(out_b.as_mut_ptr() as u64, out_b.len(), kvtide::MemoryKind::Host),
            ],
            vec![Region::from_raw(out_c.as_mut_ptr() as u64, out_c.len(), kvtide::MemoryKind::Host)],
        ]
    };
    let ticket = store.submit_batch_get(&[b"large", b"gone"], dsts).expect("submit");
    seen.push(Seen::Many(many(ticket.wait()), [out_a, out_b, out_c].concat()));
    let stats = store.stats();
    seen.push(Seen::Objects(stats.total.objects, stats.total.bytes_used));
    // Every key, in pages of two, sorted (the page boundaries are the store's own).
    let mut scanned = Ok(Vec::new());
    let mut cursor = Some(0);
    while let (Some(at), Ok(keys)) = (cursor, scanned.as_mut()) {
        match one(store.scan_keys(b"", at, 2)) {
            Ok(page) => {
                keys.extend(page.keys);
                cursor = page.cursor;
            }
            Err(e) => scanned = Err(e),
        }
    }
    if let Ok(keys) = scanned.as_mut() {
        keys.sort();
    }
    seen.push(Seen::Keys(scanned));
    seen.push(Seen::Keys(one(store.scan_keys(b"b", 0, 100)).map(|p| p.keys)));
    seen.push(Seen::Keys(one(store.scan_keys(&long_key, 0, 10)).map(|p| p.keys)));
    seen.push(Seen::Keys(one(store.scan_keys(b"", 1 << 40, 10)).map(|p| p.keys)));
    seen
}

fn assert_same(what: &str, expected: &[Seen], got: &[Seen]) {
    assert_eq!(expected.len(), got.len(), "{what}: step count");
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        if e != g {
            let short = |s: &Seen| {
                let t = format!("{s:?}");
                t.chars().take(600).collect::<String>()
            };
            panic!("{what}: step {i} differs\n embedded: {}\n remote:   {}", short(e), short(g));
        }
    }
}

#[test]
fn every_operation_matches_the_embedded_engine_over_tcp_and_unix_shm() {
    let embedded = engine(64 << 20);
    let expected = script(&*embedded);
    assert!(matches!(expected[8], Seen::Unit(Err(Error::Store(StoreError::TooLarge { what: "value", .. })))));

    let dir = temp_dir("every-op");
    let unix_engine = engine(64 << 20);
    let unix_owner = owner(&unix_engine, &dir.join(""), any_port());
    let unix = unix_client(&unix_owner);
    assert_same("unix+shm", &expected, &script(&unix));
    wait_idle(&unix_owner);
    assert!(unix_owner.counters().leases_granted.load(Ordering::SeqCst) > 0, "gets went through leases");

    let dir2 = temp_dir("every-op-tcp");
    let tcp_engine = engine(64 << 20);
    let tcp_owner = owner(&tcp_engine, &dir2, any_port());
    let tcp = tcp_client(&tcp_owner);
    assert_same("tcp", &expected, &script(&tcp));
    assert_eq!(tcp_owner.counters().leases_granted.load(Ordering::SeqCst), 0, "TCP streams");
    wait_idle(&tcp_owner);

    // The same over a Unix socket without shared memory (streamed).
    let dir3 = temp_dir("every-op-unix-stream");
    let stream_engine = engine(64 << 20);
    let stream_owner = owner(&stream_engine, &dir3, any_port());
    let streamed = unix_stream_client(&stream_owner);
    assert_same("unix stream", &expected, &script(&streamed));
    wait_idle(&stream_owner);
    for d in [dir, dir2, dir3] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// An owner serving the UCX plane over UCX's tcp transport on loopback (`tcp` is allowed
/// explicitly), token-authenticated; None when libucp cannot be loaded here, which fails the
/// test under CI (`.ci/run` installs UCX).
fn ucx_owner(engine: &Arc<Engine>, dir: &Path) -> Option<Owner> {
    ucx_owner_with(engine, dir, |_| {})
}

/// `ucx_owner` with `configure` applied to its configuration.
fn ucx_owner_with(engine: &Arc<Engine>, dir: &Path, configure: impl FnOnce(&mut OwnerConfig)) -> Option<Owner> {
    if let Err(why) = kvtide_remote::ucx_available() {
        assert!(std::env::var_os("CI").is_none(), "CI must have UCX: {why}");
        eprintln!("skipped: {why}");
        return None;
    }
    let mut config = OwnerConfig { unix_socket: Some(dir.join("owner.sock")), ..ucx_config(any_port()) };
    configure(&mut config);
    let owner = Owner::start(Arc::clone(engine), config).expect("start owner with the UCX plane");
    let plane = owner.ucx_plane().expect("a plane");
    assert!(plane.serving && plane.pid.is_some() && plane.restarts == 0, "the plane's process runs: {plane:?}");
    Some(owner)
}

/// A token-authenticated TCP owner on `tcp` whose UCX plane runs over UCX's tcp transport.
fn ucx_config(tcp: SocketAddr) -> OwnerConfig {
    OwnerConfig {
        tcp: Some(tcp),
        tcp_token: Some(token()),
        shutdown_grace_ms: 2_000,
        ucx_transports: Some("tcp".into()),
        ucx_allow_tcp: true,
        ucx_program: Some(support::owner_binary()),
        ..OwnerConfig::default()
    }
}

fn ucx_options() -> ClientOptions {
    ClientOptions { ucx_transports: Some("tcp".into()), ucx_allow_tcp: true, ..options() }
}

/// A client attached to `owner`'s UCX plane; one that lands while the plane's process restarts
/// (after a test killed a peer or the process) reads over TCP, so a new one is made until one
/// attaches (10 s at most).
fn ucx_client(owner: &Owner) -> RemoteStore {
    let addr = owner.tcp_addr().expect("tcp").to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let store = RemoteStore::connect_with(&addr, ucx_options()).expect("connect over tcp with UCX");
        if store.data_plane() == DataPlane::Ucx {
            return store;
        }
        assert!(Instant::now() < deadline, "not attached: {:?}", store.ucx_refusal());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every operation over the UCX plane (leases on the TCP connection, bytes by one-sided UCX
/// gets) matches the embedded engine byte for byte and per key, and every lease goes back.
#[test]
fn every_operation_matches_the_embedded_engine_over_the_ucx_plane() {
    let embedded = engine(64 << 20);
    let expected = script(&*embedded);
    let dir = temp_dir("every-op-ucx");
    let ucx_engine = engine(64 << 20);
    let Some(owner) = ucx_owner(&ucx_engine, &dir) else { return };
    let store = ucx_client(&owner);
    assert_same("ucx", &expected, &script(&store));
    assert!(owner.counters().ucx_attached.load(Ordering::SeqCst) > 0);
    assert!(owner.counters().leases_granted.load(Ordering::SeqCst) > 0, "reads went through leases");
    wait_idle(&owner);
    assert_eq!(owner.counters().leases_outstanding.load(Ordering::SeqCst), 0, "every lease back");
    drop(store);
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// The plane's address and keys go only to a TCP connection past its handshake, in this
/// plane's version; a client whose owner serves no plane, or refuses it, reads over TCP.
#[test]
fn the_ucx_plane_is_given_only_after_authentication_and_in_its_version() {
    let dir = temp_dir("ucx-refusals");
    let engine = engine(32 << 20);
    let Some(guarded) = ucx_owner(&engine, &dir) else { return };
    let attached = || guarded.counters().ucx_attached.load(Ordering::SeqCst);
    let attach = |version| Request::UcxAttach { version };

    // Before the token proof: refused, the connection closed.
    let mut raw = Raw::tcp(&guarded);
    raw.handshake(false);
    raw.request(&attach(kvtide_remote::UCX_PLANE_VERSION), 1);
    assert!(matches!(raw.expect_error(), Error::Unauthorized(_) | Error::Protocol(_)));
    raw.expect_closed();
    // Over the Unix socket (which maps the arena instead).
    let mut raw = Raw::unix(&guarded);
    raw.handshake(false);
    raw.request(&attach(kvtide_remote::UCX_PLANE_VERSION), 1);
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(m)) if m.contains("Unix")));
    assert_eq!(attached(), 0, "no plane given");

    // Past the handshake (an owner without a token, on loopback): another version is refused
    // and the connection goes on; this version gets a plane that checks out.
    let open_dir = temp_dir("ucx-open");
    let open = Owner::start(
        Arc::clone(&engine),
        OwnerConfig {
            unix_socket: None,
            tcp: Some(any_port()),
            allow_unauthenticated_loopback: true,
            ucx_transports: Some("tcp".into()),
            ucx_allow_tcp: true,
            ucx_program: Some(support::owner_binary()),
            ..OwnerConfig::default()
        },
    )
    .expect("start an open owner");
    let mut raw = Raw::tcp(&open);
    raw.handshake(false);
    raw.request(&attach(kvtide_remote::UCX_PLANE_VERSION + 1), 1);
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(m)) if m.contains("version")));
    raw.request(&attach(kvtide_remote::UCX_PLANE_VERSION), 2);
    let (h, payload) = raw.recv().expect("the plane");
    assert_eq!((h.op, h.request_id), (Op::UcxReady, 2));
    let ready = UcxReady::decode(&payload).expect("a plane that checks out");
    assert_eq!(ready.version, kvtide_remote::UCX_PLANE_VERSION);
    assert!(ready.len >= 32 << 20 && !ready.rkey.is_empty() && !ready.worker_address.is_empty());
    assert_eq!(open.counters().ucx_attached.load(Ordering::SeqCst), 1);
    drop(open);

    // An owner without the plane: the client reads over TCP.
    let plain_dir = temp_dir("ucx-plain");
    let plain = owner(&engine, &plain_dir, any_port());
    let store = RemoteStore::connect_with(&plain.tcp_addr().expect("tcp").to_string(), ucx_options()).expect("connect");
    assert_eq!(store.data_plane(), DataPlane::Socket);
    let why = store.ucx_refusal().expect("a reason");
    assert!(why.contains("serves no UCX data plane"), "{why}");
    store.put(b"k", b"over tcp", PutOptions::INSERT).expect("put");
    assert_eq!(store.get(b"k").expect("get"), b"over tcp");
    drop(store);
    wait_idle(&plain);
    for d in [dir, open_dir, plain_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A client asking for transports that are not network ones, or for tcp without allowing it,
/// is refused at connect; so is an owner configured that way.
#[test]
fn ucx_transports_that_reach_into_memory_are_refused() {
    let dir = temp_dir("ucx-config");
    let engine = engine(16 << 20);
    let base = OwnerConfig { unix_socket: None, tcp: Some(any_port()), tcp_token: Some(token()), ..Default::default() };
    for (list, allow_tcp) in
        [("tcp", false), ("sm", true), ("posix,tcp", true), ("^ib", true), ("all", true), ("", true)]
    {
        let config = OwnerConfig { ucx_transports: Some(list.into()), ucx_allow_tcp: allow_tcp, ..base.clone() };
        match Owner::start(Arc::clone(&engine), config) {
            Err(OwnerError::Config(why)) => assert!(why.contains("UCX transports"), "{list}: {why}"),
            Err(e) => panic!("{list}: {e}"),
            Ok(_) => panic!("{list:?} (allow tcp {allow_tcp}) was accepted"),
        }
    }
    let no_tcp = OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        tcp: None,
        tcp_token: None,
        ucx_transports: Some("rc".into()),
        ..base.clone()
    };
    assert!(matches!(Owner::start(Arc::clone(&engine), no_tcp), Err(OwnerError::Config(m)) if m.contains("TCP")));
    let too_many = OwnerConfig {
        ucx_transports: Some("rc".into()),
        ucx_workers: kvtide_remote::MAX_UCX_WORKERS + 1,
        ..base.clone()
    };
    assert!(
        matches!(Owner::start(Arc::clone(&engine), too_many), Err(OwnerError::Config(m)) if m.contains("ucx_workers"))
    );
    let owner = owner(&engine, &dir, any_port());
    let addr = owner.tcp_addr().expect("tcp").to_string();
    for (list, allow_tcp) in [("tcp", false), ("cma", true), ("xpmem", true)] {
        let o = ClientOptions { ucx_transports: Some(list.into()), ucx_allow_tcp: allow_tcp, ..options() };
        match RemoteStore::connect_with(&addr, o) {
            Err(Error::Store(StoreError::InvalidArgument(why))) => assert!(why.contains("UCX transports"), "{why}"),
            Err(e) => panic!("{list}: {e}"),
            Ok(_) => panic!("client {list:?} accepted"),
        }
    }
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// An owner asked for the plane over RDMA on a host without an RDMA NIC (CI's and this
/// project's machines) serves over TCP and says why: in its state, and to every client that
/// asks for the plane, whose reads stay right over the socket. On a host with a NIC the plane
/// serves instead, and the client attaches.
#[test]
fn rdma_on_a_host_without_a_nic_says_why_and_reads_stay_on_tcp() {
    if let Err(why) = kvtide_remote::ucx_available() {
        assert!(std::env::var_os("CI").is_none(), "CI must have UCX: {why}");
        return;
    }
    let dir = temp_dir("ucx-no-nic");
    let engine = engine(16 << 20);
    let config = OwnerConfig { ucx_transports: Some("rdma".into()), ucx_allow_tcp: false, ..ucx_config(any_port()) };
    let owner = Owner::start(Arc::clone(&engine), config).expect("the owner starts without its plane");
    let addr = owner.tcp_addr().expect("tcp").to_string();
    let options = ClientOptions { ucx_transports: Some("rdma".into()), ..options() };
    let store = RemoteStore::connect_with(&addr, options).expect("connect");
    let value = value_for(b"k", 1, 300_000);
    store.put(b"k", &value, PutOptions::INSERT).expect("put");
    assert_eq!(store.get(b"k").expect("get"), value);
    if owner.ucx_plane().is_some() {
        eprintln!("this host has an RDMA device: the plane serves");
        assert_eq!(store.data_plane(), DataPlane::Ucx, "{:?}", store.ucx_refusal());
    } else {
        assert_eq!(store.data_plane(), DataPlane::Socket);
        let why = store.ucx_refusal().expect("the client knows why it is not on the plane");
        assert!(why.contains("not serving") && why.contains("no device for the transports"), "{why}");
        assert!(why.contains("rc,dc,ud"), "names the transports: {why}");
    }
    drop(store);
    wait_idle(&owner);
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// The owner restarts on the same port: the client's UCX endpoint and remote key belong to the
/// old owner; its next call reconnects, attaches to the new plane and reads the new bytes.
#[test]
fn a_ucx_client_reattaches_after_an_owner_restart() {
    let dir = temp_dir("ucx-restart");
    let first_engine = engine(32 << 20);
    let Some(first) = ucx_owner(&first_engine, &dir) else { return };
    let port = first.tcp_addr().expect("tcp");
    let store = ucx_client(&first);
    let one = value_for(b"x", 1, 3 << 20);
    store.put(b"x", &one, PutOptions::INSERT).expect("put");
    assert_eq!(store.get(b"x").expect("get"), one);
    first.shutdown();
    first_engine.shutdown();
    drop(first);
    assert!(matches!(store.get(b"x"), Err(Error::Disconnected(_))));

    let second_engine = engine(32 << 20);
    let config = OwnerConfig { unix_socket: None, ..ucx_config(port) };
    let second = Owner::start(Arc::clone(&second_engine), config).expect("restart");
    assert_eq!(store.get(b"x"), Err(Error::Store(StoreError::NotFound)));
    let two = value_for(b"x", 2, (3 << 20) + 5);
    store.put(b"x", &two, PutOptions::INSERT).expect("put after restart");
    assert_eq!(store.get(b"x").expect("get after restart"), two);
    assert_eq!(store.data_plane(), DataPlane::Ucx, "attached to the new plane");
    assert!(second.counters().ucx_attached.load(Ordering::SeqCst) > 0);
    wait_idle(&second);
    let _ = std::fs::remove_dir_all(dir);
}

/// Child process: reads a large object over the UCX plane in a loop until killed.
#[test]
#[ignore = "run by a_ucx_client_killed_mid_read_leaves_nothing_held as a child process"]
fn ucx_child_reader() {
    let Ok(addr) = std::env::var("KVTIDE_UCX_CHILD_ADDR") else { return };
    let mut store = RemoteStore::connect_with(&addr, ucx_options()).expect("child connect");
    // The plane's process may be restarting (an earlier child's death can abort it): this client
    // then reads over TCP; the child waits for a client on the plane.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.data_plane() != DataPlane::Ucx {
        assert!(Instant::now() < deadline, "child: {:?}", store.ucx_refusal());
        assert_eq!(store.get(b"big").expect("child read over TCP").len(), 16 << 20);
        std::thread::sleep(Duration::from_millis(200));
        store = RemoteStore::connect_with(&addr, ucx_options()).expect("child connect");
    }
    let mut buf = vec![0u8; 16 << 20];
    for i in 0.. {
        store.get_into(b"big", Region::host(&mut buf)).expect("child read");
        if i == 2 {
            println!("READING");
            std::io::stdout().flush().expect("flush");
        }
    }
}

/// A UCX client killed while its reads are in flight: the owner drops its leases, its UCX
/// plane keeps serving, and the next client reads the right bytes.
#[test]
fn a_ucx_client_killed_mid_read_leaves_nothing_held() {
    let dir = temp_dir("ucx-killed");
    let engine = engine(64 << 20);
    let Some(owner) = ucx_owner(&engine, &dir) else { return };
    let big = value_for(b"big", 3, 16 << 20);
    ucx_client(&owner).put(b"big", &big, PutOptions::INSERT).expect("put");
    for _ in 0..2 {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "ucx_child_reader", "--ignored", "--nocapture", "--test-threads=1"])
            .env("KVTIDE_UCX_CHILD_ADDR", owner.tcp_addr().expect("tcp").to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().expect("stdout");
        let reading = BufReader::new(stdout).lines().any(|l| l.map(|l| l.contains("READING")).unwrap_or(false));
        assert!(reading, "the child read over UCX");
        std::thread::sleep(Duration::from_millis(30));
        child.kill().expect("kill child");
        child.wait().expect("reap child");
        wait_idle(&owner);
        // UCX 1.13 may abort the plane's process when a peer vanishes mid-get over tcp: the
        // owner restarts it and never goes down itself.
        let deadline = Instant::now() + Duration::from_secs(10);
        while owner.ucx_plane().is_some_and(|p| !p.serving) {
            assert!(Instant::now() < deadline, "the UCX plane's process was not restarted");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let store = ucx_client(&owner);
    assert_eq!(store.get(b"big").expect("get after the kills"), big);

    // The plane's process killed: the owner restarts it; a client attached to the old one
    // fails that read (never returns bytes it did not read) and attaches to the new one.
    let restarts = owner.ucx_plane().expect("a plane").restarts;
    kill_ucx_plane_process(&owner);
    let deadline = Instant::now() + Duration::from_secs(10);
    while owner.ucx_plane().is_none_or(|p| !p.serving || p.restarts <= restarts) {
        assert!(Instant::now() < deadline, "the UCX plane's process was not restarted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut buf = vec![0u8; 16 << 20];
    match store.get_into(b"big", Region::host(&mut buf)) {
        Ok(n) => assert_eq!(&buf[..n], &big[..], "a read that succeeded has the right bytes"),
        Err(e) => assert!(matches!(e, Error::Disconnected(_) | Error::Timeout { .. }), "{e:?}"),
    }
    assert_eq!(store.get(b"big").expect("read again"), big);
    assert_eq!(ucx_client(&owner).get(b"big").expect("a new client"), big);

    // A plane process that stops answering (SIGSTOP): the read over the plane fails at the
    // client's deadline without a byte reported, its endpoint and connection go (so do their
    // leases), and the call runs once more over TCP (the plane is not asked again for a while):
    // right bytes, or an error, never others. Once the process runs again (UCX 1.13 may then abort it, for the get it owes the closed endpoint, and
    // the owner restarts it) the next read is right, and a new client attaches.
    let addr = owner.tcp_addr().expect("tcp").to_string();
    let quick =
        RemoteStore::connect_with(&addr, ClientOptions { timeout_ms: 1_000, ..ucx_options() }).expect("connect");
    assert_eq!(quick.get(b"big").expect("before the stop"), big);
    let pid = ucx_plane_pid(&owner);
    // SAFETY: kill with a pid and a signal.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stalled = quick.get_into(b"big", Region::host(&mut buf));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    match stalled {
        Ok(n) => {
            assert_eq!(&buf[..n], &big[..], "read again over TCP: the right bytes");
            assert!(quick.ucx_refusal().is_some_and(|why| why.contains("failed")), "{:?}", quick.ucx_refusal());
        }
        Err(e) => assert!(matches!(e, Error::Timeout { .. } | Error::Disconnected(_)), "{e:?}"),
    }
    wait_idle(&owner);
    assert_eq!(quick.get(b"big").expect("after the process runs again"), big);
    // A client that attaches while the plane's process is stopped: its first read of the plane
    // (made at attach, since creating an endpoint sends nothing) gets no answer, so it reads
    // over TCP and says why.
    let pid = ucx_plane_pid(&owner);
    // SAFETY: kill with a pid and a signal.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let late = RemoteStore::connect_with(&addr, ucx_options()).map(|s| (s.get(b"big"), s));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let (got, late) = late.expect("connect while the plane is stopped");
    assert_eq!(got.expect("read over TCP"), big);
    assert_eq!(late.data_plane(), DataPlane::Socket);
    let why = late.ucx_refusal().unwrap_or_default();
    assert!(why.contains("cannot be reached"), "{why}");
    drop(late);
    // Ranges whose leased read over the plane stalls: the call runs once more on a connection
    // that is not on the plane (the client keeps off it for a while), over the stream.
    let deadline = Instant::now() + Duration::from_secs(10);
    let ranged = loop {
        let c =
            RemoteStore::connect_with(&addr, ClientOptions { timeout_ms: 1_000, ..ucx_options() }).expect("connect");
        if c.data_plane() == DataPlane::Ucx {
            break c;
        }
        assert!(Instant::now() < deadline, "not attached: {:?}", c.ucx_refusal());
        std::thread::sleep(Duration::from_millis(100));
    };
    let pid = ucx_plane_pid(&owner);
    let mut out = vec![0u8; 8192];
    let frags =
        vec![vec![Fragment::new(b"big".to_vec(), 1000, 0, 4096), Fragment::new(b"big".to_vec(), 9 << 20, 4096, 4096)]];
    // SAFETY: kill with a pid and a signal.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let got = ranged.get_into_ranges(&[Region::host(&mut out)], &frags);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert_eq!(got, vec![vec![Ok(4096), Ok(4096)]], "{:?}", ranged.ucx_refusal());
    assert!(out[..4096] == big[1000..5096] && out[4096..] == big[9 << 20..(9 << 20) + 4096]);
    drop(ranged);
    let deadline = Instant::now() + Duration::from_secs(10);
    while owner.ucx_plane().is_some_and(|p| !p.serving) {
        assert!(Instant::now() < deadline, "the UCX plane's process was not restarted");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(ucx_client(&owner).get(b"big").expect("a client after the stall"), big);
    // The client that was kept off the plane asks for it again once the retry interval passed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while quick.data_plane() != DataPlane::Ucx {
        assert!(Instant::now() < deadline, "back on the plane: {:?}", quick.ucx_refusal());
        assert_eq!(quick.get(b"big").expect("read"), big);
        std::thread::sleep(Duration::from_millis(200));
    }
    drop((store, quick));
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// The plane's process is confined before UCX starts in it: run as the plane confines itself,
/// `kvtide-owner` cannot read or write files outside the system's, open a Unix-domain socket or
/// run a program (what a peer that took over the process would try next: the token file, the
/// owner's socket, a shell), while UCX's network sockets and system files stay usable; the
/// serving plane's process runs under the seccomp filter with no_new_privs.
#[test]
fn the_ucx_plane_process_is_confined() {
    let dir = temp_dir("ucx-confined");
    let secret = dir.join("token");
    std::fs::write(&secret, b"secret").expect("write");
    let out = Command::new(support::owner_binary())
        .arg(kvtide_remote::UCX_PLANE_CONFINED_ARG)
        .arg(&secret)
        .output()
        .expect("run the check");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let verdict = |what: &str| {
        text.lines().find_map(|l| l.strip_prefix(&format!("{what} "))).unwrap_or_else(|| panic!("{what}: {text}"))
    };
    let landlock = verdict("landlock").starts_with("Ok");
    let seccomp = verdict("seccomp").starts_with("Ok");
    eprintln!("{text}");
    if landlock {
        assert_eq!(verdict("read"), "denied", "{text}");
        assert_eq!(verdict("write"), "denied", "{text}");
        assert!(!dir.join("token.written").exists());
    }
    if seccomp {
        assert_eq!(verdict("unix-socket"), "denied", "{text}");
        assert_eq!(verdict("io-uring"), "denied", "{text}");
    }
    if landlock || seccomp {
        assert_eq!(verdict("exec"), "denied", "{text}");
    }
    assert_eq!(verdict("inet-socket"), "ALLOWED", "{text}");
    assert_eq!(verdict("system-read"), "ALLOWED", "{text}");
    let engine = engine(16 << 20);
    let Some(owner) = ucx_owner(&engine, &dir) else { return };
    let status = std::fs::read_to_string(format!("/proc/{}/status", ucx_plane_pid(&owner))).expect("status");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
    if seccomp {
        assert!(status.contains("Seccomp:\t2"), "{status}");
    }
    assert_eq!(ucx_client(&owner).get(b"absent"), Err(Error::Store(StoreError::NotFound)));
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// The local addresses of the TCP sockets process `pid` listens on (hex, as /proc/net has them).
fn listening_addresses(pid: u32) -> Vec<String> {
    tcp_sockets(pid, "0A")
}

/// The local addresses (hex, as /proc/net/tcp writes them) of process `pid`'s TCP sockets in
/// `state` ("0A": listening, "01": established).
fn tcp_sockets(pid: u32, state: &str) -> Vec<String> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
        .collect();
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == state && inodes.iter().any(|i| i == f[9]) {
                out.push(f[1].to_string());
            }
        }
    }
    out
}

/// A plane of several workers hands attaching clients one each, in turn: with three workers,
/// three clients' reads are served through three different listening ports of the plane's
/// process (a worker each), and every read is right.
#[test]
fn the_ucx_planes_workers_each_serve_their_share_of_the_clients() {
    let dir = temp_dir("ucx-workers");
    let engine = engine(16 << 20);
    let Some(owner) = ucx_owner_with(&engine, &dir, |c| c.ucx_workers = 3) else { return };
    let plane = owner.ucx_plane().expect("a plane");
    assert_eq!(plane.workers, 3, "{plane:?}");
    let clients: Vec<RemoteStore> = (0..3).map(|_| ucx_client(&owner)).collect();
    let value = |i: usize| vec![i as u8 + 1; 256 << 10];
    for (i, c) in clients.iter().enumerate() {
        c.put(format!("k{i}").as_bytes(), &value(i), PutOptions::INSERT).expect("put");
    }
    for c in &clients {
        for i in 0..3 {
            let mut buf = vec![0u8; 256 << 10];
            assert_eq!(c.get_into(format!("k{i}").as_bytes(), Region::host(&mut buf)).expect("get"), 256 << 10);
            assert_eq!(buf, value(i));
        }
    }
    let pid = ucx_plane_pid(&owner) as u32;
    let listening = listening_addresses(pid);
    let port = |a: &String| a.rsplit(':').next().map(str::to_string);
    let served: std::collections::BTreeSet<String> = tcp_sockets(pid, "01")
        .iter()
        .filter(|a| listening.iter().any(|l| port(l) == port(a)))
        .filter_map(port)
        .collect();
    assert_eq!(served.len(), 3, "the clients' connections reach three workers' ports: {served:?} of {listening:?}");
    drop(clients);
    wait_idle(&owner);
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// UCX's tcp transport serves any address a peer names, so with an owner on loopback both the
/// plane's process and the client listen on the loopback interface only (UCX_NET_DEVICES=lo):
/// no host on the network reaches either. The plane runs with kvtide's tcp settings.
#[test]
fn ucx_over_tcp_to_a_loopback_owner_listens_on_loopback_only() {
    let dir = temp_dir("ucx-lo");
    let engine = engine(16 << 20);
    let Some(owner) = ucx_owner(&engine, &dir) else { return };
    let store = ucx_client(&owner);
    store.put(b"k", b"v", PutOptions::INSERT).expect("put");
    assert_eq!(store.get(b"k").expect("get"), b"v");
    let loopback = |a: &String| a.starts_with("0100007F:") || a.starts_with("00000000000000000000000001000000:");
    let environ = std::fs::read(format!("/proc/{}/environ", ucx_plane_pid(&owner))).expect("environ");
    let environ: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
    let serving = kvtide_remote::UcxTransports::parse("tcp", true).expect("tcp").serving_env(true);
    assert!(!serving.is_empty() || std::env::var_os("UCX_TCP_TX_SEG_SIZE").is_some());
    for (var, value) in serving {
        let set = format!("{var}={value}");
        assert!(environ.contains(&set.as_bytes()), "the plane's settings: {set}");
    }
    let plane = listening_addresses(ucx_plane_pid(&owner) as u32);
    assert!(!plane.is_empty(), "the plane listens");
    assert!(plane.iter().all(loopback), "the plane listens beyond loopback: {plane:?}");
    let mine = listening_addresses(std::process::id());
    assert!(mine.iter().all(loopback), "this process (the client) listens beyond loopback: {mine:?}");
    drop(store);
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// Kills `owner`'s UCX plane process.
fn kill_ucx_plane_process(owner: &Owner) {
    // SAFETY: kill with a pid and a signal.
    assert_eq!(unsafe { libc::kill(ucx_plane_pid(owner), libc::SIGKILL) }, 0);
}

/// The pid of `owner`'s UCX plane process (waiting for one that serves, 10 s at most).
fn ucx_plane_pid(owner: &Owner) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(pid) = owner.ucx_plane().and_then(|p| p.pid) {
            return pid as i32;
        }
        assert!(Instant::now() < deadline, "no UCX plane process");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Over a Unix socket with the arena mapped, a read of one key into a small host buffer comes
/// through the socket (no lease); larger ones, batches and `get` (whose size the client cannot
/// know) through the arena; the bytes and the per-key errors are the same either way.
#[test]
fn small_reads_stream_through_the_socket_even_with_the_arena_mapped() {
    let dir = temp_dir("small-reads");
    let engine = engine(64 << 20);
    let owner = owner(&engine, &dir, any_port());
    let store = unix_client(&owner);
    let granted = || owner.counters().leases_granted.load(Ordering::SeqCst);
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("small-{i}").into_bytes()).collect();
    for (i, key) in keys.iter().enumerate() {
        store.put(key, &value_for(key, 1, 100 + i), PutOptions::default()).expect("put");
    }
    store.put(b"big", &value_for(b"big", 1, 200_000), PutOptions::default()).expect("put big");

    // One key into an 8 KiB buffer streams; too small a buffer and a missing key fail as ever.
    let mut buf = vec![0u8; 8 << 10];
    let n = store.get_into(&keys[3], Region::host(&mut buf)).expect("small get_into");
    assert_eq!(&buf[..n], &value_for(&keys[3], 1, 103)[..]);
    let mut tiny = vec![0u8; 10];
    assert!(matches!(
        store.get_into(&keys[3], Region::host(&mut tiny)),
        Err(Error::Store(StoreError::BufferTooSmall { .. }))
    ));
    assert!(matches!(store.get_into(b"missing", Region::host(&mut buf)), Err(Error::Store(StoreError::NotFound))));
    let mut exact = vec![0u8; 104];
    let one = store.batch_get_into_multi_buffers(&[&keys[4][..]], &[vec![Region::host(&mut exact)]]);
    assert_eq!(*one[0].as_ref().expect("a batch of one small key"), 104);
    assert_eq!(exact, value_for(&keys[4], 1, 104));
    assert_eq!(granted(), 0, "the small reads leased nothing through the arena");

    // A batch leases through the arena, with the same per-key results.
    let mut outs: Vec<Vec<u8>> = (0..keys.len()).map(|i| vec![0u8; 100 + i]).collect();
    outs[5] = vec![0u8; 7]; // the wrong size fails that key alone
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let dsts: Vec<Vec<Region<'_>>> = outs.iter_mut().map(|o| vec![Region::host(o)]).collect();
    let results = store.batch_get_into_multi_buffers(&refs, &dsts);
    for (i, r) in results.iter().enumerate() {
        if i == 5 {
            assert!(matches!(r, Err(Error::Store(StoreError::SizeMismatch { .. }))), "{r:?}");
        } else {
            assert_eq!(*r.as_ref().expect("small batch key"), 100 + i);
        }
    }
    for (i, out) in outs.iter().enumerate().filter(|(i, _)| *i != 5) {
        assert_eq!(out, &value_for(&keys[i], 1, 100 + i), "key {i}");
    }
    assert_eq!(granted(), 39, "the batch leased every key that fit");

    // A large buffer and `get` read through the arena.
    let mut large = vec![0u8; 200_000];
    assert_eq!(store.get_into(b"big", Region::host(&mut large)).expect("big"), 200_000);
    assert_eq!(large, value_for(b"big", 1, 200_000));
    assert_eq!(granted(), 40);
    assert_eq!(store.get(&keys[0]).expect("get"), value_for(&keys[0], 1, 100));
    assert_eq!(granted(), 41, "a get of unknown size leases");
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

// ---- concurrency ---------------------------------------------------------------------------

#[test]
fn thirty_two_concurrent_clients_mixing_operations() {
    let dir = temp_dir("concurrent");
    let engine = engine(256 << 20);
    let owner = owner(&engine, &dir, any_port());
    let shared_keys: Vec<Vec<u8>> = (0..16).map(|i| format!("shared/{i}").into_bytes()).collect();
    let setup = unix_client(&owner);
    for k in &shared_keys {
        setup.put(k, &value_for(k, 0, 50_000), PutOptions::INSERT).expect("shared put");
    }
    let unix_path = owner.unix_path().expect("unix").display().to_string();
    let tcp_addr = owner.tcp_addr().expect("tcp").to_string();
    let deadline = Instant::now() + Duration::from_secs(4);
    std::thread::scope(|scope| {
        for t in 0..32u64 {
            let (unix_path, tcp_addr, shared_keys) = (&unix_path, &tcp_addr, &shared_keys);
            scope.spawn(move || {
                let address = if t % 2 == 0 { format!("unix:{unix_path}") } else { tcp_addr.clone() };
                let store = RemoteStore::connect_with(&address, options()).expect("connect");
                let mut round = 0u64;
                while Instant::now() < deadline || round < 3 {
                    let key = format!("client{t}/{}", round % 4).into_bytes();
                    let size = 1000 + ((t * 7919 + round * 104_729) % 300_000) as usize;
                    let value = value_for(&key, round, size);
                    store.put(&key, &value, PutOptions::UPSERT).expect("put");
                    assert_eq!(store.get(&key).expect("get"), value, "client {t} round {round}");
                    let mut buf = vec![0u8; size];
                    assert_eq!(store.get_into(&key, Region::host(&mut buf)), Ok(size));
                    assert_eq!(buf, value);
                    let shared = &shared_keys[(round as usize + t as usize) % shared_keys.len()];
                    let mut halves = vec![0u8; 50_000];
                    let (h0, h1) = halves.split_at_mut(25_000);
                    let r = store.batch_get_into_multi_buffers(
                        &[shared, &key],
                        &[vec![Region::host(h0), Region::host(h1)], vec![Region::host(&mut buf)]],
                    );
                    assert_eq!(r, vec![Ok(50_000), Ok(size)]);
                    assert_eq!(halves, value_for(shared, 0, 50_000));
                    assert_eq!(store.batch_exists(&[shared, b"never"]), vec![Ok(true), Ok(false)]);
                    if round % 3 == 2 {
                        assert_eq!(store.remove(&key, false), Ok(()));
                        assert_eq!(store.get(&key), Err(Error::Store(StoreError::NotFound)));
                    }
                    round += 1;
                }
            });
        }
    });
    assert!(owner.counters().connections_accepted.load(Ordering::SeqCst) >= 33);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

// ---- raw protocol helpers ------------------------------------------------------------------------

trait Wire: Read + Write + Send {
    /// Shuts the write side: the owner sees the connection closed by its client.
    fn shutdown_write(&self);
}
impl Wire for UnixStream {
    fn shutdown_write(&self) {
        self.shutdown(std::net::Shutdown::Write).expect("shutdown");
    }
}
impl Wire for TcpStream {
    fn shutdown_write(&self) {
        self.shutdown(std::net::Shutdown::Write).expect("shutdown");
    }
}

/// A hand-driven connection for feeding the owner bad frames.
struct Raw {
    stream: Box<dyn Wire>,
}

impl Raw {
    fn unix(owner: &Owner) -> Raw {
        let s = UnixStream::connect(owner.unix_path().expect("unix")).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        Raw { stream: Box::new(s) }
    }

    fn tcp(owner: &Owner) -> Raw {
        let s = TcpStream::connect(owner.tcp_addr().expect("tcp")).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        Raw { stream: Box::new(s) }
    }

    fn send(&mut self, bytes: &[u8]) {
        // The owner may answer a bad header and close before the rest of the frame is written:
        // what it answered is still there to read, and the tests check that.
        if let Err(e) = self.stream.write_all(bytes) {
            let closed = matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset);
            assert!(closed, "send: {e}");
        }
    }

    /// The next frame, or None at end of stream.
    fn recv(&mut self) -> Option<(FrameHeader, Vec<u8>)> {
        let mut header = [0u8; HEADER_BYTES];
        if self.stream.read_exact(&mut header).is_err() {
            return None;
        }
        let h = FrameHeader::decode(&header, 64 << 20).expect("owner sent a valid header");
        let mut payload = vec![0u8; h.payload_len as usize];
        self.stream.read_exact(&mut payload).ok()?;
        Some((h, payload))
    }

    fn expect_error(&mut self) -> Error {
        let (h, payload) = self.recv().expect("an error reply");
        assert_eq!(h.op, Op::Error, "expected an error frame");
        decode_error_frame(&payload).expect("error payload").1
    }

    fn expect_closed(&mut self) {
        assert!(self.recv().is_none(), "the owner closes the connection");
    }

    /// Hello, optionally asking for shared memory (the descriptor is dropped by plain reads).
    fn handshake(&mut self, want_shm: bool) -> HelloOk {
        let mut p = Vec::new();
        Hello { client_nonce: [5; NONCE_BYTES], flags: u32::from(want_shm) }.encode(&mut p);
        self.send(&frame(Op::Hello, 0, &p));
        let (h, payload) = self.recv().expect("hello reply");
        assert_eq!(h.op, Op::HelloOk);
        HelloOk::decode(&payload).expect("hello ok")
    }

    fn request(&mut self, request: &Request<'_>, rid: u64) {
        let mut p = Vec::new();
        request.encode(&mut p);
        self.send(&frame(request.op(), rid, &p));
    }
}

fn header(op: u8, version: u16, rid: u64, payload_len: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&MAGIC.to_le_bytes());
    h.extend_from_slice(&version.to_le_bytes());
    h.push(op);
    h.push(0);
    h.extend_from_slice(&rid.to_le_bytes());
    h.extend_from_slice(&payload_len.to_le_bytes());
    h
}

// ---- a client killed mid-read ---------------------------------------------------------------------

/// Child process: reads through a real client, then takes a lease on a large object through
/// the raw protocol and never finishes the copy. The parent kills it there.
#[test]
#[ignore = "run by killed_client_mid_read_releases_its_leases as a child process"]
fn remote_child_reader() {
    let Ok(path) = std::env::var("KVTIDE_REMOTE_CHILD_SOCKET") else { return };
    let store = RemoteStore::connect_with(&format!("unix:{path}"), options()).expect("child connect");
    for _ in 0..5 {
        assert_eq!(store.get(b"big").expect("child get").len(), 8 << 20);
    }
    let s = UnixStream::connect(&path).expect("child raw connect");
    let mut raw = Raw { stream: Box::new(s) };
    raw.handshake(true);
    raw.request(&Request::Get { lease: true, items: vec![GetItem { key: b"big", check: LenCheck::Any }] }, 1);
    let (h, _) = raw.recv().expect("grants");
    assert_eq!(h.op, Op::Grants);
    println!("HOLDING");
    std::io::stdout().flush().expect("flush");
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn killed_client_mid_read_releases_its_leases() {
    let dir = temp_dir("killed");
    let engine = engine(64 << 20);
    let owner = owner(&engine, &dir, any_port());
    let big = value_for(b"big", 0, 8 << 20);
    unix_client(&owner).put(b"big", &big, PutOptions::INSERT).expect("put");

    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "remote_child_reader", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KVTIDE_REMOTE_CHILD_SOCKET", owner.unix_path().expect("unix"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let holding = lines.any(|l| l.map(|l| l.contains("HOLDING")).unwrap_or(false));
    assert!(holding, "the child reached its lease");
    owner.engine().sync_shards().expect("sync");
    assert_eq!(owner.counters().leases_outstanding.load(Ordering::SeqCst), 1);
    assert_eq!(owner.engine().stats().total.leases_held, 1, "the child's lease pins the object");
    child.kill().expect("kill child");
    child.wait().expect("reap child");
    wait_idle(&owner);

    // A streaming reader (no shared memory) that goes away after the first chunk of 8 MiB.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.request(&Request::Get { lease: false, items: vec![GetItem { key: b"big", check: LenCheck::Any }] }, 1);
    let (h, _) = raw.recv().expect("object header");
    assert_eq!(h.op, Op::Object);
    let (h, chunk) = raw.recv().expect("first chunk");
    assert_eq!(h.op, Op::Data);
    assert_eq!(&chunk[..], &big[..chunk.len()]);
    drop(raw);
    wait_idle(&owner);

    // The owner keeps serving.
    assert_eq!(tcp_client(&owner).get(b"big").expect("get after kill"), big);
    assert_eq!(unix_client(&owner).get(b"big").expect("get after kill"), big);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

// ---- malformed frames ------------------------------------------------------------------------------

#[test]
fn malformed_truncated_oversized_and_wrong_version_frames() {
    let dir = temp_dir("malformed");
    let engine = engine(64 << 20);
    let owner = owner(&engine, &dir, any_port());
    let good = unix_client(&owner);
    good.put(b"k", b"value", PutOptions::INSERT).expect("put");

    // Wrong version at the handshake: a clear ProtocolVersion error, then the close.
    let mut raw = Raw::unix(&owner);
    let mut hello = Vec::new();
    Hello { client_nonce: [1; NONCE_BYTES], flags: 0 }.encode(&mut hello);
    raw.send(&header(Op::Hello as u8, PROTOCOL_VERSION + 98, 0, hello.len() as u32));
    raw.send(&hello);
    // Decoded from the receiver's side: "ours" is the version this (raw) client spoke.
    assert_eq!(raw.expect_error(), Error::ProtocolVersion { ours: PROTOCOL_VERSION + 98, theirs: PROTOCOL_VERSION });
    raw.expect_closed();

    // Bad magic.
    let mut raw = Raw::unix(&owner);
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(matches!(raw.expect_error(), Error::Protocol(_)));
    raw.expect_closed();

    // Oversized frame after the handshake.
    let mut raw = Raw::unix(&owner);
    let limits = raw.handshake(false).limits();
    raw.send(&header(Op::Exists as u8, PROTOCOL_VERSION, 7, limits.max_payload_bytes + 1));
    assert!(matches!(raw.expect_error(), Error::Protocol(m) if m.contains("exceeds")));
    raw.expect_closed();

    // Unknown operation.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.send(&header(250, PROTOCOL_VERSION, 7, 0));
    assert!(matches!(raw.expect_error(), Error::Protocol(_)));
    raw.expect_closed();

    // Malformed payloads get an error reply and the connection carries on.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    let mut huge_count = Vec::new();
    huge_count.extend_from_slice(&u32::MAX.to_le_bytes());
    raw.send(&frame(Op::Exists, 1, &huge_count));
    assert!(matches!(raw.expect_error(), Error::Protocol(m) if m.contains("exceed")));
    let mut lying_count = Vec::new();
    lying_count.extend_from_slice(&1000u32.to_le_bytes());
    lying_count.extend_from_slice(&[1, 0, b'k']);
    raw.send(&frame(Op::Exists, 2, &lying_count));
    assert!(matches!(raw.expect_error(), Error::Protocol(m) if m.contains("truncated")));
    let mut bad_key = Vec::new();
    bad_key.extend_from_slice(&1u32.to_le_bytes());
    bad_key.extend_from_slice(&[0xFF, 0xFF]); // 65535-byte key, longer than the owner allows
    raw.send(&frame(Op::Exists, 3, &bad_key));
    assert!(matches!(raw.expect_error(), Error::Protocol(_)));
    let mut bad_range = Vec::new();
    Request::GetRanges { keys: vec![b"k"], fragments: vec![] }.encode(&mut bad_range);
    bad_range.truncate(bad_range.len() - 4);
    bad_range.extend_from_slice(&1u32.to_le_bytes());
    bad_range.extend_from_slice(&9u32.to_le_bytes()); // key index 9 of 1
    bad_range.extend_from_slice(&[0; 16]);
    raw.send(&frame(Op::GetRanges, 4, &bad_range));
    assert!(matches!(raw.expect_error(), Error::Protocol(m) if m.contains("index")));
    raw.send(&frame(Op::Release, 5, &{
        let mut p = Vec::new();
        Request::Release { leases: vec![42, 43] }.encode(&mut p);
        p
    }));
    raw.request(&Request::Exists { keys: vec![b"k", b"nope"] }, 6);
    let (h, _) = raw.recv().expect("exists reply on the same connection");
    assert_eq!((h.op, h.request_id), (Op::ExistsReply, 6));
    assert_eq!(owner.counters().unknown_releases.load(Ordering::SeqCst), 2);
    // Data outside a put closes the connection.
    raw.send(&frame(Op::Data, 9, b"stray"));
    assert!(matches!(raw.expect_error(), Error::Protocol(_)));
    raw.expect_closed();

    // A put whose inline bytes exceed its announced length.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    let mut p = Vec::new();
    PutHead::encode(&mut p, false, false, b"p", 4);
    p.extend_from_slice(b"p");
    p.extend_from_slice(b"too many bytes");
    raw.send(&frame(Op::Put, 1, &p));
    assert!(matches!(raw.expect_error(), Error::Protocol(_)));
    raw.expect_closed();

    // A put truncated mid-value: the reservation is aborted.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    let mut p = Vec::new();
    PutHead::encode(&mut p, false, false, b"cut", 1 << 20);
    p.extend_from_slice(b"cut");
    p.extend_from_slice(&[7u8; 1000]);
    raw.send(&frame(Op::Put, 1, &p));
    raw.send(&header(Op::Data as u8, PROTOCOL_VERSION, 1, 100_000));
    raw.send(&[7u8; 5000]);
    drop(raw);
    // A frame truncated mid-header, then a close.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.send(&header(Op::Stats as u8, PROTOCOL_VERSION, 1, 0)[..11]);
    drop(raw);
    // Garbage before the handshake over TCP.
    let mut raw = Raw::tcp(&owner);
    raw.send(&[0u8; 64]);
    assert!(matches!(raw.expect_error(), Error::Protocol(_)));
    raw.expect_closed();

    // A request before authentication on TCP is refused.
    let mut raw = Raw::tcp(&owner);
    let hello = raw.handshake(false);
    assert!(hello.flags & kvtide_remote::protocol::HELLO_AUTH_REQUIRED != 0);
    raw.request(&Request::Stats, 1);
    assert!(matches!(raw.expect_error(), Error::Unauthorized(_)));
    raw.expect_closed();

    // Everyone else carried on.
    assert_eq!(good.get(b"k").expect("get"), b"value");
    assert_eq!(tcp_client(&owner).get(b"k").expect("get"), b"value");
    assert_eq!(good.get(b"cut"), Err(Error::Store(StoreError::NotFound)));
    assert!(owner.counters().protocol_errors.load(Ordering::SeqCst) >= 8);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_client_reports_an_owner_of_another_version() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut hello = [0u8; HEADER_BYTES + NONCE_BYTES + 4];
        s.read_exact(&mut hello).expect("hello");
        s.write_all(&header(Op::HelloOk as u8, PROTOCOL_VERSION + 1, 0, 0)).expect("reply");
    });
    let err = RemoteStore::connect_with(&addr.to_string(), options()).expect_err("version mismatch");
    assert_eq!(err, Error::ProtocolVersion { ours: PROTOCOL_VERSION, theirs: PROTOCOL_VERSION + 1 });
    fake.join().expect("fake owner");
}

// ---- authentication --------------------------------------------------------------------------------

#[test]
fn wrong_or_missing_token_is_unauthorized() {
    let dir = temp_dir("auth");
    let engine = engine(32 << 20);
    let owner = owner(&engine, &dir, any_port());
    let addr = owner.tcp_addr().expect("tcp").to_string();
    let wrong = ClientOptions { token: Some(Token::new(b"another-token-0123456789").expect("token")), ..options() };
    assert!(matches!(RemoteStore::connect_with(&addr, wrong), Err(Error::Unauthorized(_))));
    let none = ClientOptions { token: None, ..options() };
    assert!(matches!(RemoteStore::connect_with(&addr, none), Err(Error::Unauthorized(_))));
    assert!(owner.counters().auth_failures.load(Ordering::SeqCst) >= 1);
    // The right token works, and the Unix socket needs none (file permissions guard it).
    let ok = tcp_client(&owner);
    ok.put(b"a", b"b", PutOptions::INSERT).expect("put");
    let unix_path = owner.unix_path().expect("unix").to_path_buf();
    let unix = RemoteStore::connect_with(&format!("unix:{}", unix_path.display()), ClientOptions::default())
        .expect("unix needs no token");
    assert_eq!(unix.get(b"a").expect("get"), b"b");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&unix_path).expect("socket").permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is private to its user");

    // TCP without a token is refused unless explicitly allowed on loopback.
    let no_token = OwnerConfig { tcp: Some(any_port()), ..OwnerConfig::default() };
    assert!(matches!(Owner::start(Arc::clone(&engine), no_token), Err(OwnerError::Config(_))));
    let public = OwnerConfig {
        tcp: Some("0.0.0.0:0".parse().expect("addr")),
        allow_unauthenticated_loopback: true,
        ..OwnerConfig::default()
    };
    assert!(matches!(Owner::start(Arc::clone(&engine), public), Err(OwnerError::Config(_))));
    let open = Owner::start(
        Arc::clone(&engine),
        OwnerConfig { tcp: Some(any_port()), allow_unauthenticated_loopback: true, ..OwnerConfig::default() },
    )
    .expect("loopback without auth");
    let anon = RemoteStore::connect_with(&open.tcp_addr().expect("tcp").to_string(), ClientOptions::default())
        .expect("no token needed");
    assert_eq!(anon.get(b"a").expect("get"), b"b");
    let _ = std::fs::remove_dir_all(dir);
}

// ---- owner restart and shutdown ----------------------------------------------------------------

#[test]
fn owner_restarted_under_clients() {
    let dir = temp_dir("restart");
    let first_engine = engine(32 << 20);
    let first = owner(&first_engine, &dir, any_port());
    let port = first.tcp_addr().expect("tcp");
    let unix = unix_client(&first);
    let tcp = tcp_client(&first);
    unix.put(b"x", b"one", PutOptions::INSERT).expect("put");
    assert_eq!(tcp.get(b"x").expect("get"), b"one");

    first.shutdown();
    first_engine.shutdown();
    drop(first);
    for store in [&unix, &tcp] {
        match store.get(b"x") {
            Err(Error::Disconnected(why)) => assert!(why.contains("connect"), "{why}"),
            other => panic!("expected Disconnected while the owner is down, got {other:?}"),
        }
        assert!(matches!(store.put(b"y", b"v", PutOptions::INSERT), Err(Error::Disconnected(_))));
    }

    let second_engine = engine(32 << 20);
    let second = owner(&second_engine, &dir, port);
    // The same clients reconnect on their next call; the old objects are gone with the old pool.
    assert_eq!(unix.get(b"x"), Err(Error::Store(StoreError::NotFound)));
    unix.put(b"x", b"two", PutOptions::INSERT).expect("put after restart");
    assert_eq!(tcp.get(b"x").expect("tcp after restart"), b"two");
    assert_eq!(unix.get(b"x").expect("unix after restart"), b"two");
    assert!(unix.uses_shared_memory(), "the new arena is mapped");
    wait_idle(&second);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn shutdown_finishes_in_flight_requests() {
    let dir = temp_dir("shutdown");
    let engine = engine(64 << 20);
    let owner = owner(&engine, &dir, any_port());
    // A put whose value is half sent when shutdown starts.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    let value = value_for(b"late", 0, 200_000);
    let mut p = Vec::new();
    PutHead::encode(&mut p, false, false, b"late", value.len() as u64);
    p.extend_from_slice(b"late");
    p.extend_from_slice(&value[..100_000]);
    raw.send(&frame(Op::Put, 1, &p));
    std::thread::sleep(Duration::from_millis(50));
    let owner = Arc::new(owner);
    let stopping = {
        let owner = Arc::clone(&owner);
        std::thread::spawn(move || owner.shutdown())
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(owner.unix_path().is_some_and(|p| !p.exists()), "no new connections once stopping");
    raw.send(&frame(Op::Data, 1, &value[100_000..]));
    let (h, _) = raw.recv().expect("the in-flight put is answered");
    assert_eq!(h.op, Op::Ok);
    raw.expect_closed();
    stopping.join().expect("shutdown");
    assert_eq!(engine.get(b"late").expect("committed"), value);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn connection_limit_answers_busy() {
    let dir = temp_dir("limit");
    let engine = engine(32 << 20);
    let config = OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        max_connections: 2,
        shutdown_grace_ms: 1000,
        ..OwnerConfig::default()
    };
    let owner = Owner::start(Arc::clone(&engine), config).expect("owner");
    let path = format!("unix:{}", owner.unix_path().expect("unix").display());
    let a = RemoteStore::connect_with(&path, ClientOptions::default()).expect("first");
    let b = RemoteStore::connect_with(&path, ClientOptions::default()).expect("second");
    let refused = RemoteStore::connect_with(&path, ClientOptions::default()).err();
    assert_eq!(refused, Some(Error::Store(StoreError::Busy { limit: 2 })));
    let message = refused.map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains("connections") && !message.contains("ticket"), "{message}");
    drop((a, b));
    let deadline = Instant::now() + Duration::from_secs(5);
    while owner.counters().connections_open.load(Ordering::SeqCst) > 0 {
        assert!(Instant::now() < deadline, "connections close");
        std::thread::sleep(Duration::from_millis(10));
    }
    RemoteStore::connect_with(&path, ClientOptions::default()).expect("room again");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn protocol_limits_are_enforced_on_both_ends() {
    // Decoder-level checks the owner relies on (the fuzz targets drive the same functions).
    let limits = Limits { max_items: 4, ..Limits::default() };
    let mut p = Vec::new();
    Request::Exists { keys: vec![b"a"; 5] }.encode(&mut p);
    assert!(Request::decode(Op::Exists, &p, &limits).is_err());
    let region_err = Error::Store(StoreError::InvalidRange(RegionError::ReadOnly));
    let mut buf = Vec::new();
    kvtide_remote::protocol::encode_error(&mut buf, &region_err);
    let mut r = kvtide_remote::protocol::Reader::new(&buf);
    assert_eq!(kvtide_remote::protocol::decode_error(&mut r), Ok(region_err));
}

/// Writes the committed seed corpus of the protocol fuzz targets (`fuzz/corpus/*/seed-*`):
/// `KVTIDE_WRITE_FUZZ_SEEDS=1 cargo test -p kvtide-remote --test remote write_fuzz_seeds -- --ignored`.
#[test]
#[ignore = "regenerates fuzz/corpus seeds"]
fn write_fuzz_seeds() {
    if std::env::var("KVTIDE_WRITE_FUZZ_SEEDS").is_err() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    let requests: Vec<Request<'_>> = vec![
        Request::Hello(Hello { client_nonce: [9; NONCE_BYTES], flags: 1 }),
        Request::Auth { mac: [3; 32] },
        Request::Get {
            lease: true,
            items: vec![
                GetItem { key: b"layer0/block7", check: LenCheck::Any },
                GetItem { key: b"k2", check: LenCheck::Exactly(4096) },
            ],
        },
        Request::Get { lease: false, items: vec![GetItem { key: b"a", check: LenCheck::AtMost(65536) }] },
        Request::GetRanges {
            keys: vec![b"a", b"bb"],
            fragments: vec![
                kvtide_remote::protocol::RangeItem { key_index: 1, src_offset: 10, len: 20 },
                kvtide_remote::protocol::RangeItem { key_index: 0, src_offset: 0, len: 1 },
            ],
        },
        Request::Exists { keys: vec![b"x", b"yy", b"zzz"] },
        Request::Remove { key: b"r", force: true },
        Request::Pin { key: b"p" },
        Request::Unpin { key: b"p" },
        Request::Stats,
        Request::Release { leases: vec![1, 2, 3] },
    ];
    let mut stream = vec![15u8]; // limit byte of frame_decoder
    let (frames_dir, requests_dir) = (root.join("frame_decoder"), root.join("request_validation"));
    std::fs::create_dir_all(&frames_dir).expect("dir");
    std::fs::create_dir_all(&requests_dir).expect("dir");
    for (i, request) in requests.iter().enumerate() {
        let mut payload = Vec::new();
        request.encode(&mut payload);
        let f = frame(request.op(), i as u64 + 1, &payload);
        stream.extend_from_slice(&f);
        std::fs::write(frames_dir.join(format!("seed-{i:02}")), [&[15u8][..], &f].concat()).expect("write");
        let mut v = vec![request.op() as u8, 7, 0, 1];
        v.extend_from_slice(&payload);
        std::fs::write(requests_dir.join(format!("seed-{i:02}")), v).expect("write");
    }
    // A put with inline bytes, its data frame, replies of each kind, and a truncated tail.
    let mut put = Vec::new();
    PutHead::encode(&mut put, true, false, b"key", 10);
    put.extend_from_slice(b"key");
    put.extend_from_slice(b"01234");
    stream.extend_from_slice(&frame(Op::Put, 50, &put));
    stream.extend_from_slice(&frame(Op::Data, 50, b"56789"));
    let mut v = vec![Op::Put as u8, 7, 0, 1];
    v.extend_from_slice(&put);
    std::fs::write(requests_dir.join("seed-put"), v).expect("write");
    let mut grants = Vec::new();
    kvtide_remote::protocol::encode_grants(
        &mut grants,
        1000,
        &[
            Ok(kvtide_remote::protocol::Grant { lease: 1, offset: 4096, len: 100 }),
            Err(Error::Store(StoreError::NotFound)),
        ],
    );
    stream.extend_from_slice(&frame(Op::Grants, 51, &grants));
    let mut err = Vec::new();
    kvtide_remote::protocol::encode_error_frame(
        &mut err,
        2,
        &Error::Store(StoreError::SizeMismatch { object_bytes: 1, destination_bytes: 2 }),
    );
    stream.extend_from_slice(&frame(Op::Error, 52, &err));
    let mut exists = Vec::new();
    kvtide_remote::protocol::encode_exists(
        &mut exists,
        &[Ok(true), Ok(false), Err(Error::Store(StoreError::EmptyKey))],
    );
    stream.extend_from_slice(&frame(Op::ExistsReply, 53, &exists));
    std::fs::write(frames_dir.join("seed-stream"), &stream).expect("write");
    std::fs::write(frames_dir.join("seed-truncated"), &stream[..stream.len() - 7]).expect("write");
}

#[test]
fn an_owner_that_stops_answering_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let fake = std::thread::spawn(move || {
        // First connection: never answers the hello.
        let (silent, _) = listener.accept().expect("accept");
        // Second: completes the handshake, then never answers a request.
        let (mut s, _) = listener.accept().expect("accept");
        let mut hello = [0u8; HEADER_BYTES + NONCE_BYTES + 4];
        s.read_exact(&mut hello).expect("hello");
        let ok = HelloOk {
            flags: 0,
            max_payload_bytes: 1 << 20,
            chunk_bytes: 1 << 16,
            max_items: 16,
            max_leases: 16,
            lease_ttl_ms: 60_000,
            max_key_bytes: 64,
            max_value_bytes: 1 << 20,
            server_nonce: [0; NONCE_BYTES],
            instance_id: 1,
            arena_bytes: 0,
        };
        let mut p = Vec::new();
        ok.encode(&mut p);
        s.write_all(&frame(Op::HelloOk, 0, &p)).expect("hello ok");
        let mut sink = [0u8; 256];
        let _ = s.read(&mut sink);
        std::thread::sleep(Duration::from_millis(1500));
        drop((silent, s));
    });
    let quick = ClientOptions { timeout_ms: 300, connect_timeout_ms: 300, ..ClientOptions::default() };
    let started = Instant::now();
    let err = RemoteStore::connect_with(&addr.to_string(), quick.clone()).expect_err("no hello reply");
    assert_eq!(err, Error::Timeout { op: "handshake", timeout_ms: 300 });
    let store = RemoteStore::connect_with(&addr.to_string(), quick).expect("handshake completes");
    assert_eq!(store.get(b"k"), Err(Error::Timeout { op: "get", timeout_ms: 300 }));
    assert!(started.elapsed() < Duration::from_secs(3), "timeouts bound each request");
    fake.join().expect("fake owner");
}

// ---- the shared arena descriptor in a hostile client's hands ------------------------------------

/// A Unix connection that asked for shared memory, and the descriptor (if any) the owner passed
/// with its hello reply, received with `SCM_RIGHTS` as `RemoteStore` does.
fn shm_handshake(owner: &Owner) -> (Raw, HelloOk, Option<OwnedFd>) {
    let s = UnixStream::connect(owner.unix_path().expect("unix")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut p = Vec::new();
    Hello { client_nonce: [5; NONCE_BYTES], flags: HELLO_WANT_SHM }.encode(&mut p);
    (&s).write_all(&frame(Op::Hello, 0, &p)).expect("hello");
    let mut buf = vec![0u8; 4096];
    let mut got = 0;
    let mut fd = None;
    loop {
        if got >= HEADER_BYTES {
            let h = FrameHeader::decode(&buf[..HEADER_BYTES], 4096).expect("hello reply header");
            if got >= HEADER_BYTES + h.payload_len as usize {
                assert_eq!(got, HEADER_BYTES + h.payload_len as usize, "nothing follows the hello reply");
                assert_eq!(h.op, Op::HelloOk);
                let hello = HelloOk::decode(&buf[HEADER_BYTES..got]).expect("hello ok");
                return (Raw { stream: Box::new(s) }, hello, fd);
            }
        }
        let (n, received) = recv_with_fd(&s, &mut buf[got..]);
        assert!(n > 0, "the owner closed during the handshake");
        got += n;
        if received.is_some() {
            assert!(fd.is_none(), "one descriptor");
            fd = received;
        }
    }
}

/// Every way a holder of the arena descriptor `fd` might change arena bytes or the arena's size,
/// aimed at `[offset, offset + 8)` of an object; returns the attempts that worked. `arena_bytes`
/// is the arena's length. Reopening the descriptor for writing (`/proc/self/fd`) is tried too,
/// and the attempts repeated on whatever that yields.
fn arena_write_attempts(fd: RawFd, offset: u64, arena_bytes: u64) -> Vec<String> {
    let mut worked = Vec::new();
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).expect("path");
    let mut targets = vec![("received descriptor".to_string(), fd, None)];
    for (name, flags) in [("O_RDWR", libc::O_RDWR), ("O_WRONLY", libc::O_WRONLY)] {
        // SAFETY: a valid NUL-terminated path; the result is checked.
        let reopened = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
        if reopened >= 0 {
            // SAFETY: a fresh descriptor nothing else owns.
            let owned = unsafe { OwnedFd::from_raw_fd(reopened) };
            targets.push((format!("/proc/self/fd reopened {name}"), reopened, Some(owned)));
        }
    }
    let evil = *b"EVILEVIL";
    let page = 4096u64;
    for (what, t, _owned) in &targets {
        let t = *t;
        let mut record = |attempt: &str, ok: bool| {
            if ok {
                worked.push(format!("{attempt} through the {what}"));
            }
        };
        // SAFETY: pwrite reads 8 bytes from a live array.
        record("pwrite", unsafe { libc::pwrite(t, evil.as_ptr().cast(), 8, offset as libc::off_t) } >= 0);
        // SAFETY: lseek and write on a descriptor we hold, from a live array.
        record("write", unsafe {
            libc::lseek(t, offset as libc::off_t, libc::SEEK_SET) >= 0 && libc::write(t, evil.as_ptr().cast(), 8) >= 0
        });
        // SAFETY: a new mapping at a kernel-chosen address; unmapped again if it was made.
        let shared_rw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                arena_bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                t,
                0,
            )
        };
        record("mmap(PROT_WRITE, MAP_SHARED)", shared_rw != libc::MAP_FAILED);
        if shared_rw != libc::MAP_FAILED {
            // SAFETY: the mapping made just above.
            unsafe { libc::munmap(shared_rw, arena_bytes as usize) };
        }
        // SAFETY: as above.
        let shared_ro =
            unsafe { libc::mmap(std::ptr::null_mut(), arena_bytes as usize, libc::PROT_READ, libc::MAP_SHARED, t, 0) };
        if shared_ro != libc::MAP_FAILED {
            // SAFETY: changes the protection of the mapping made just above, then unmaps it.
            let upgraded =
                unsafe { libc::mprotect(shared_ro, arena_bytes as usize, libc::PROT_READ | libc::PROT_WRITE) };
            record("mprotect(PROT_WRITE) of a shared read-only mapping", upgraded == 0);
            // SAFETY: as above.
            unsafe { libc::munmap(shared_ro, arena_bytes as usize) };
        }
        let hole = offset / page * page;
        // SAFETY: plain syscalls on a descriptor we hold.
        record(
            "fallocate(PUNCH_HOLE)",
            unsafe {
                libc::fallocate(
                    t,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    hole as libc::off_t,
                    page as libc::off_t,
                )
            } == 0,
        );
        // SAFETY: as above.
        record(
            "fallocate(grow)",
            unsafe { libc::fallocate(t, 0, arena_bytes as libc::off_t, page as libc::off_t) } == 0,
        );
        // SAFETY: as above.
        record("F_ADD_SEALS(F_SEAL_WRITE)", unsafe { libc::fcntl(t, libc::F_ADD_SEALS, libc::F_SEAL_WRITE) } == 0);
        // SAFETY: as above.
        record("ftruncate(grow)", unsafe { libc::ftruncate(t, (arena_bytes + page) as libc::off_t) } == 0);
        // Last: before the fix this shrink made the owner die of SIGBUS.
        // SAFETY: as above.
        record("ftruncate(0)", unsafe { libc::ftruncate(t, 0) } == 0);
    }
    worked
}

/// Child process: runs `arena_write_attempts` as an unprivileged user on descriptor 3.
#[test]
#[ignore = "run by a_client_cannot_write_or_shrink_the_shared_arena as a child process"]
fn arena_descriptor_child() {
    let Ok(spec) = std::env::var("KVTIDE_ARENA_CHILD") else { return };
    let (offset, arena_bytes) = spec.split_once(':').expect("offset:len");
    // SAFETY: getuid has no inputs.
    let uid = unsafe { libc::getuid() };
    let worked = arena_write_attempts(3, offset.parse().expect("offset"), arena_bytes.parse().expect("len"));
    println!("UID {uid} WORKED {worked:?}");
}

#[test]
fn a_client_cannot_write_or_shrink_the_shared_arena() {
    let dir = temp_dir("sealed");
    let engine = engine(32 << 20);
    let owner = owner(&engine, &dir, any_port());
    let victim = value_for(b"victim", 0, 100_000);
    unix_client(&owner).put(b"victim", &victim, PutOptions::INSERT).expect("put");

    let (mut raw, hello, fd) = shm_handshake(&owner);
    assert!(hello.flags & HELLO_SHM_ATTACHED != 0);
    let fd = fd.expect("the owner passes the arena descriptor");
    raw.request(&Request::Get { lease: true, items: vec![GetItem { key: b"victim", check: LenCheck::Any }] }, 1);
    let (h, payload) = raw.recv().expect("grants");
    assert_eq!(h.op, Op::Grants);
    let (_ttl_ms, grants) = kvtide_remote::protocol::decode_grants(&payload, 16, hello.arena_bytes).expect("grants");
    let grant = grants[0].clone().expect("granted");

    // SAFETY: stat is plain data that fstat fills for a descriptor we hold.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    assert_eq!(st.st_mode & 0o777, 0o400, "the arena memfd is private to the owner's user, read-only");
    // SAFETY: fcntl reads the seals of a descriptor we hold.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    let wanted = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
    assert_eq!(seals & wanted, wanted, "the arena memfd is sealed");

    let worked = arena_write_attempts(fd.as_raw_fd(), grant.offset, hello.arena_bytes);
    assert!(worked.is_empty(), "a client changed the arena: {worked:?}");

    // The same as an unprivileged user (reopening for writing fails outright there).
    // SAFETY: getuid has no inputs.
    if unsafe { libc::getuid() } == 0 {
        use std::os::unix::process::CommandExt;
        let raw_fd = fd.as_raw_fd();
        let mut child = Command::new(std::env::current_exe().expect("test binary"));
        child
            .args(["--exact", "arena_descriptor_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("KVTIDE_ARENA_CHILD", format!("{}:{}", grant.offset, hello.arena_bytes))
            .uid(65534)
            .gid(65534)
            .stdout(Stdio::piped());
        // SAFETY: dup2 is async-signal-safe; it gives the child the descriptor as fd 3.
        unsafe {
            child.pre_exec(
                move || if libc::dup2(raw_fd, 3) < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) },
            );
        }
        let out = child.output().expect("run child");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("UID 65534 WORKED []"), "unprivileged child: {text}");
    } else {
        println!("not root: the unprivileged-user variant runs as this user only");
    }

    // A private copy-on-write mapping may be written, but only the client's copy changes.
    let len = hello.arena_bytes as usize;
    // SAFETY: a new private mapping at a kernel-chosen address, unmapped below.
    let private = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, fd.as_raw_fd(), 0)
    };
    assert_ne!(private, libc::MAP_FAILED);
    // SAFETY: grant.offset + 8 lies inside the private mapping of `len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(b"EVILEVIL".as_ptr(), private.cast::<u8>().add(grant.offset as usize), 8);
        libc::munmap(private, len);
    }
    raw.request(&Request::Release { leases: vec![grant.lease] }, 2);
    drop(raw);

    // Well-behaved clients still read the original bytes, over shared memory and over TCP.
    assert_eq!(unix_client(&owner).get(b"victim").expect("unix get"), victim);
    assert_eq!(tcp_client(&owner).get(b"victim").expect("tcp get"), victim);
    let fresh = value_for(b"after", 0, 3 << 20);
    unix_client(&owner).put(b"after", &fresh, PutOptions::INSERT).expect("the owner still writes its arena");
    assert_eq!(unix_client(&owner).get(b"after").expect("get"), fresh);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn with_the_arena_unshared_unix_clients_get_no_descriptor_and_socket_copies() {
    let dir = temp_dir("unshared");
    let engine = engine(32 << 20);
    let config = OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        share_arena: false,
        shutdown_grace_ms: 1_000,
        ..OwnerConfig::default()
    };
    let owner = Owner::start(Arc::clone(&engine), config).expect("owner");

    // A client that asks for the arena gets no descriptor. A lease-mode get only holds the
    // object (a client's hold): its grant carries the length, never where the object lies.
    let (mut raw, hello, fd) = shm_handshake(&owner);
    assert!(fd.is_none(), "no descriptor crosses the socket");
    assert_eq!((hello.flags & HELLO_SHM_ATTACHED, hello.arena_bytes), (0, 0));
    engine.put(b"held", &[7u8; 4096], PutOptions::INSERT).expect("put");
    raw.request(&Request::Get { lease: true, items: vec![GetItem { key: b"held", check: LenCheck::Any }] }, 1);
    let (h, payload) = raw.recv().expect("a reply");
    assert_eq!(h.op, Op::Grants);
    let (_, grants) = decode_grants(&payload, 16, u64::MAX).expect("grants");
    let grant = grants[0].as_ref().expect("held");
    assert_eq!((grant.offset, grant.len), (0, 4096), "no arena offset for a connection without the arena");
    raw.request(&Request::Release { leases: vec![grant.lease] }, 2);
    drop(raw);

    // RemoteStore notices and streams: every read and write still works.
    let path = format!("unix:{}", owner.unix_path().expect("unix").display());
    let store = RemoteStore::connect_with(&path, options()).expect("connect");
    assert!(!store.uses_shared_memory());
    let value = value_for(b"k", 0, (2 << 20) + 5);
    store.put(b"k", &value, PutOptions::INSERT).expect("put");
    assert_eq!(store.get(b"k").expect("get"), value);
    let mut buf = vec![0u8; value.len()];
    assert_eq!(store.get_into(b"k", Region::host(&mut buf)), Ok(value.len()));
    assert_eq!(buf, value);
    let mut part = vec![0u8; 100];
    let r = store.get_into_ranges(&[Region::host(&mut part)], &[vec![Fragment::new(b"k".to_vec(), 1000, 0, 100)]]);
    assert_eq!(r, vec![vec![Ok(100)]]);
    assert_eq!(part, value[1000..1100]);
    assert_eq!(owner.counters().leases_granted.load(Ordering::SeqCst), 1, "only the hold leased: reads streamed");
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

// ---- hostile peers: slow handshakes, slow requests, idle connections, floods ---------------------

/// An owner with small limits and short deadlines (Unix socket, and TCP with the token).
fn guarded_owner(engine: &Arc<Engine>, dir: &Path, tweak: impl FnOnce(&mut OwnerConfig)) -> Owner {
    let mut config = OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        tcp: Some(any_port()),
        tcp_token: Some(token()),
        max_connections: 8,
        max_unauthenticated_connections: 2,
        handshake_timeout_ms: 300,
        payload_timeout_ms: 400,
        idle_timeout_ms: 500,
        shutdown_grace_ms: 1_000,
        ..OwnerConfig::default()
    };
    tweak(&mut config);
    Owner::start(Arc::clone(engine), config).expect("start owner")
}

/// Waits until no connection, handshake or buffered request byte is held by the owner.
fn wait_gauges_zero(owner: &Owner) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let c = owner.counters();
        let held = (
            c.connections_open.load(Ordering::SeqCst),
            c.handshakes_open.load(Ordering::SeqCst),
            c.buffered_bytes.load(Ordering::SeqCst),
            c.put_window_bytes.load(Ordering::SeqCst),
        );
        if held == (0, 0, 0, 0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still held (connections, handshakes, buffered bytes, put window bytes): {held:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `bytes` one at a time until the owner closes the connection; returns how
/// long after connecting that was (None if it never did within `give_up`).
/// The socket's read timeout paces the bytes; `stop` ends it early.
fn trickle_until_closed(
    mut s: impl Read + Write,
    bytes: &[u8],
    give_up: Duration,
    stop: &AtomicBool,
) -> Option<Duration> {
    let started = Instant::now();
    let mut sent = 0;
    let mut sink = [0u8; 4096];
    while started.elapsed() < give_up && !stop.load(Ordering::SeqCst) {
        if sent < bytes.len() {
            if s.write_all(&bytes[sent..sent + 1]).is_err() {
                return Some(started.elapsed());
            }
            sent += 1;
        }
        // The read timeout (`gap`) paces the trickle; a read of 0 is the owner's close.
        match s.read(&mut sink) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return Some(started.elapsed()),
        }
    }
    None
}

#[test]
fn a_streamed_get_to_a_reader_that_trickles_ends_within_the_io_timeout() {
    let dir = temp_dir("trickle-get");
    let engine = engine(64 << 20);
    let owner = guarded_owner(&engine, &dir, |c| {
        c.io_timeout_ms = 300;
        c.idle_timeout_ms = 60_000;
    });
    let big = value_for(b"big", 0, 16 << 20);
    unix_client(&owner).put(b"big", &big, PutOptions::INSERT).expect("put");
    // A streaming reader (no shared memory) that takes 4 KiB every 20 ms: every send of a 1 MiB
    // chunk makes progress, but slower than the I/O timeout allows for the whole chunk.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.request(&Request::Get { lease: false, items: vec![GetItem { key: b"big", check: LenCheck::Any }] }, 1);
    let started = Instant::now();
    let mut sink = [0u8; 4096];
    let mut read = 0usize;
    let closed = loop {
        match raw.stream.read(&mut sink) {
            Ok(0) | Err(_) => break started.elapsed(),
            Ok(n) => read += n,
        }
        assert!(started.elapsed() < Duration::from_secs(20), "still streaming after {read} bytes");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(read < big.len(), "the owner gave up before the end ({read} bytes read)");
    assert!(closed < Duration::from_secs(10), "closed after {closed:?}");
    // The object's lease went with the connection: it is removable, and nothing is held.
    wait_idle(&owner);
    unix_client(&owner).remove(b"big", false).expect("remove after the reader left");
    wait_gauges_zero(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// A streamed batch of SSD-resident keys to a reader slower than the lease TTL: the keys of a
/// part leased ahead are leased again when a quarter of their sending window (the TTL less the
/// I/O timeout) went by before their turn, so every key still arrives whole (no `LeaseExpired`
/// abort), and nothing stays held.
#[test]
fn a_streamed_batch_to_a_slow_reader_leases_again_what_waited_too_long() {
    let dir = temp_dir("slow-batch");
    let engine = sim_ssd_engine(8 << 20, 5, kvtide::SimFaults::default(), |b| b);
    let owner = guarded_owner(&engine, &dir, |c| {
        c.lease_ttl_ms = 3_000;
        c.io_timeout_ms = 500;
        c.chunk_bytes = 64 << 10;
    });
    let len = 512 << 10;
    let key = |i: u64| format!("slow/{i}").into_bytes();
    for i in 0..40u64 {
        engine.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    engine.sync_shards().expect("sync");
    // The first eight are on SSD only (the rest filled DRAM): more than one part.
    let keys: Vec<Vec<u8>> = (0..8u64).map(key).collect();
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    let items = keys.iter().map(|k| GetItem { key: k, check: LenCheck::Any }).collect();
    raw.request(&Request::Get { lease: false, items }, 1);
    // About 1 s per object (64 KiB frames), against a window of 2.5 s in which sends must start
    // (the TTL less the I/O timeout): an object leased at most 0.625 s before its turn is sent
    // well within it, while the next part's leases, taken a part (two objects) earlier, age
    // past it.
    let answer = read_streamed(&mut raw, |_| {}, || std::thread::sleep(Duration::from_millis(125)));
    assert_eq!(answer.failed, 0, "no key aborted");
    assert_eq!(answer.indices(), (0..8).collect::<Vec<u32>>(), "every key once");
    for (i, bytes) in &answer.objects {
        let i = u64::from(*i);
        assert!(*bytes == value_for(&key(i), i, len), "bytes of {i}");
    }
    drop(raw);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// A batch of SSD-resident objects when DRAM has room for only one at a time (the rest is
/// pinned): the owner leases a part while the part before is still held, so a load may find no
/// room; such keys are leased again alone at the end, and every key arrives whole, streamed or
/// through the shared arena.
#[test]
fn batch_keys_that_find_no_room_beside_a_held_part_are_read_alone() {
    let dir = temp_dir("no-room");
    let engine = sim_ssd_engine(8 << 20, 11, kvtide::SimFaults::default(), |b| b.promote_on_hit(false));
    let owner = owner(&engine, &dir, any_port());
    let len = (5 << 20) / 2;
    let key = |i: u64| format!("room/{i}").into_bytes();
    for i in 0..4u64 {
        engine.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    // Half of DRAM pinned: one 2.5 MiB load fits beside it, two do not.
    engine.put(b"pinned", &vec![7u8; 4 << 20], PutOptions::INSERT.pinned()).expect("pinned put");
    engine.sync_shards().expect("sync");
    let keys: Vec<Vec<u8>> = (0..4u64).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let clients =
        [("unix+shm", unix_client(&owner)), ("tcp", tcp_client(&owner)), ("unix stream", unix_stream_client(&owner))];
    for (name, client) in &clients {
        assert_batch_get_into(name, client, &keys, len);
        wait_idle(&owner);
        // Destinations that cannot hold them (none at all: how sizes are asked for): answered
        // with the objects' sizes, and nothing loaded.
        let loads = engine.stats().total.loads;
        let none: Vec<Vec<Region<'_>>> = refs.iter().map(|_| Vec::new()).collect();
        let mismatch = StoreError::SizeMismatch { object_bytes: len as u64, destination_bytes: 0 };
        for r in client.batch_get_into_multi_buffers(&refs, &none) {
            assert_eq!(r, Err(Error::Store(mismatch.clone())), "{name}");
        }
        // One key at a time too.
        for i in 0..refs.len() {
            let one = client.batch_get_into_multi_buffers(&refs[i..=i], &none[i..=i]);
            assert_eq!(one, vec![Err(Error::Store(mismatch.clone()))], "{name}: key {i} alone");
        }
        assert_eq!(engine.stats().total.loads, loads, "{name}: sizes asked for without a load");
    }
    drop(clients);
    let _ = std::fs::remove_dir_all(dir);
}

/// A batch read's ticket cancelled while its keys still load from the SSD, over each way a client
/// reads (TCP streams, a Unix socket with the arena's leased parts, a Unix socket without it): the
/// keys delivered before the cancel are whole and right, the others report `Cancelled`, the owner
/// and its engine hold nothing afterwards, and the same client then reads every key.
#[test]
fn a_batch_read_cancelled_mid_flight_stops_and_leaves_nothing_held() {
    let dir = temp_dir("cancel");
    // 1 MiB takes 25 ms to load: 24 of them at least 0.6 s, on one shard.
    let faults = kvtide::SimFaults { latency_us: 1_000, us_per_mib: 24_000, ..kvtide::SimFaults::default() };
    let engine = sim_ssd_engine(8 << 20, 29, faults, |b| b.promote_on_hit(false));
    let owner = owner(&engine, &dir, any_port());
    let (n, len) = (24usize, 1usize << 20);
    let key = |i: usize| format!("cancel/{i}").into_bytes();
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    for (i, k) in keys.iter().enumerate() {
        engine.put(k, &value_for(k, i as u64, len), PutOptions::INSERT).expect("put");
    }
    engine.put(b"filler", &vec![5u8; 7 << 20], PutOptions::INSERT).expect("filler");
    engine.sync_shards().expect("sync");
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let clients =
        [("tcp", tcp_client(&owner)), ("unix+shm", unix_client(&owner)), ("unix stream", unix_stream_client(&owner))];
    for (name, client) in &clients {
        let loads = engine.stats().total.loads;
        let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; len]).collect();
        // SAFETY: the buffers outlive the ticket, which is waited for below, and nothing else
        // touches them meanwhile.
        let dsts: Vec<Vec<Region<'static>>> = bufs
            .iter_mut()
            .map(|b| vec![unsafe { Region::from_raw(b.as_mut_ptr() as u64, b.len(), kvtide::MemoryKind::Host) }])
            .collect();
        let ticket = client.submit_batch_get(&refs, dsts).expect("submit");
        std::thread::sleep(Duration::from_millis(60));
        ticket.cancel();
        let results = ticket.wait();
        let mut cancelled = 0;
        for (i, r) in results.iter().enumerate() {
            match r {
                Ok(got) => {
                    assert_eq!(*got, len, "{name}: key {i}");
                    assert!(bufs[i] == value_for(&keys[i], i as u64, len), "{name}: bytes of key {i}");
                }
                Err(Error::Store(StoreError::Cancelled)) => cancelled += 1,
                Err(e) => panic!("{name}: key {i}: {e}"),
            }
        }
        assert!(cancelled > 0, "{name}: the cancel came while keys were still loading: {results:?}");
        // The owner stopped: it loaded fewer objects than the batch has.
        wait_idle(&owner);
        assert!(engine.stats().total.loads - loads < n as u64, "{name}: the owner went on loading");
        assert_batch_get_into(name, client, &keys, len);
        wait_idle(&owner);
    }
    drop(clients);
    let _ = std::fs::remove_dir_all(dir);
}

/// Ranges of one large SSD-resident object in two buffers (the key twice in one streamed
/// `GetRanges`): the owner leases the key once for both, where two leases would load it twice
/// into a DRAM slice that holds one copy.
#[test]
fn streamed_ranges_of_one_large_object_in_two_buffers_load_it_once() {
    let dir = temp_dir("twice");
    let engine = sim_ssd_engine(16 << 20, 17, kvtide::SimFaults::default(), |b| b.promote_on_hit(false));
    let owner = owner(&engine, &dir, any_port());
    let len = 10 << 20;
    let value = value_for(b"big", 1, len);
    engine.put(b"big", &value, PutOptions::INSERT).expect("put");
    engine.put(b"filler", &vec![3u8; 12 << 20], PutOptions::INSERT).expect("filler");
    engine.sync_shards().expect("sync");
    let half = (len / 2) as u64;
    let frags =
        vec![vec![Fragment::new(b"big".to_vec(), 0, 0, half)], vec![Fragment::new(b"big".to_vec(), half, 0, half)]];
    for (name, client) in [("tcp", tcp_client(&owner)), ("unix+shm", unix_client(&owner))] {
        let (mut a, mut b) = (vec![0u8; len / 2], vec![0u8; len / 2]);
        let loads = engine.stats().total.loads;
        let got = client.get_into_ranges(&[Region::host(&mut a), Region::host(&mut b)], &frags);
        assert_eq!(got, vec![vec![Ok(len / 2)], vec![Ok(len / 2)]], "{name}");
        assert!(a[..] == value[..len / 2] && b[..] == value[len / 2..], "{name}: bytes");
        assert_eq!(engine.stats().total.loads, loads + 1, "{name}: loaded once");
        wait_idle(&owner);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A shard with two lease slots: a streamed batch's parts get `Busy` for most of their keys;
/// those are leased again alone at the end, so every key still arrives.
#[test]
fn a_streamed_batch_beyond_the_shards_lease_slots_reads_every_key() {
    let dir = temp_dir("few-leases");
    let engine =
        sim_ssd_engine(8 << 20, 13, kvtide::SimFaults::default(), |b| b.max_leases_per_shard(2).promote_on_hit(false));
    let owner = owner(&engine, &dir, any_port());
    let len = 256 << 10;
    let key = |i: u64| format!("few/{i}").into_bytes();
    for i in 0..48u64 {
        engine.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    engine.sync_shards().expect("sync");
    // The first sixteen are on SSD only.
    let keys: Vec<Vec<u8>> = (0..16u64).map(key).collect();
    assert_batch_get_into("tcp", &tcp_client(&owner), &keys, len);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// A streamed answer as a raw reader saw it: each `Object`'s index and bytes, in arrival order,
/// and how many `Error` and `Abort` frames came.
struct Streamed {
    objects: Vec<(u32, Vec<u8>)>,
    failed: usize,
}

impl Streamed {
    /// The indices answered with an object, sorted.
    fn indices(&self) -> Vec<u32> {
        let mut indices: Vec<u32> = self.objects.iter().map(|(i, _)| *i).collect();
        indices.sort_unstable();
        indices
    }
}

/// Reads a streamed answer as `read_streamed` does, with what `loads_started` said when the
/// first object went out.
fn read_streamed_counting_loads(raw: &mut Raw, loads_started: impl Fn() -> u64) -> (Streamed, Option<u64>) {
    let mut at_first_object = None;
    let answer = read_streamed(
        raw,
        |_| {
            at_first_object.get_or_insert_with(&loads_started);
        },
        || {},
    );
    (answer, at_first_object)
}

/// Reads a streamed `Get` or `GetRanges` answer up to `End`: `at_object` runs as each `Object`
/// frame arrives (before its bytes), `after_data` after each `Data` frame (a slow reader waits
/// there).
fn read_streamed(raw: &mut Raw, mut at_object: impl FnMut(u32), mut after_data: impl FnMut()) -> Streamed {
    let mut answer = Streamed { objects: Vec::new(), failed: 0 };
    loop {
        let (h, payload) = raw.recv().expect("a frame");
        match h.op {
            Op::Object => {
                let (index, _) = decode_object(&payload).expect("object");
                at_object(index);
                answer.objects.push((index, Vec::new()));
            }
            Op::Data => {
                answer.objects.last_mut().expect("data after an object").1.extend_from_slice(&payload);
                after_data();
            }
            Op::Abort | Op::Error => answer.failed += 1,
            Op::End => return answer,
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn hello_frame() -> Vec<u8> {
    let mut p = Vec::new();
    Hello { client_nonce: [7; NONCE_BYTES], flags: 0 }.encode(&mut p);
    frame(Op::Hello, 0, &p)
}

#[test]
fn slow_handshakes_have_a_total_deadline_and_never_take_authenticated_slots() {
    let dir = temp_dir("slowloris");
    let engine = engine(32 << 20);
    let owner = guarded_owner(&engine, &dir, |c| {
        c.max_connections = 4;
        c.max_unauthenticated_connections = 2;
    });
    let addr = owner.tcp_addr().expect("tcp");
    let gap = Duration::from_millis(50);
    // Ten TCP peers send their hello one byte every 50 ms (the whole hello would take 2.8 s).
    let attackers: Vec<_> = (0..10)
        .map(|_| {
            let s = TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(gap)).expect("timeout");
            std::thread::spawn(move || {
                trickle_until_closed(s, &hello_frame(), Duration::from_secs(6), &AtomicBool::new(false))
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));

    // Meanwhile every authenticated slot is free for real clients: Unix ones at once, and a TCP
    // one as soon as an unauthenticated slot is (within the 300 ms handshake deadline).
    let unix: Vec<RemoteStore> = (0..3).map(|_| unix_client(&owner)).collect();
    for (i, store) in unix.iter().enumerate() {
        let key = format!("k{i}");
        store.put(key.as_bytes(), b"value", PutOptions::INSERT).expect("put");
        assert_eq!(store.get(key.as_bytes()).expect("get"), b"value");
    }
    let started = Instant::now();
    let tcp = loop {
        match RemoteStore::connect_with(&addr.to_string(), options()) {
            Ok(store) => break store,
            Err(Error::Store(StoreError::Busy { .. })) if started.elapsed() < Duration::from_secs(3) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("TCP client during the attack: {e}"),
        }
    };
    assert_eq!(tcp.get(b"k0").expect("tcp get"), b"value");

    // Each attacker was cut off by the total deadline (or refused at once), although it kept sending.
    for a in attackers {
        let closed = a.join().expect("attacker").expect("the owner closed the slow handshake");
        assert!(closed < Duration::from_millis(1500), "a trickled hello held its slot for {closed:?}");
    }
    let c = owner.counters();
    assert!(c.handshake_timeouts.load(Ordering::SeqCst) >= 2, "the slot holders timed out");
    assert!(c.connections_refused.load(Ordering::SeqCst) >= 8, "the others were refused");
    drop((unix, tcp));
    wait_gauges_zero(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_slow_request_holds_only_its_own_share_of_the_budget() {
    let dir = temp_dir("slow-request");
    let engine = engine(32 << 20);
    // Shares of 2 MiB / 16 = 128 KiB per connection, and a pool of 1 MiB for larger requests.
    // The payload deadline (1.5 s) is longer than the victims need, so only the shares keep them
    // from waiting behind the slow requests.
    let owner = guarded_owner(&engine, &dir, |c| {
        c.max_buffered_bytes = 2 << 20;
        c.max_payload_bytes = 512 << 10;
        c.chunk_bytes = 256 << 10;
        c.payload_timeout_ms = 1_500;
    });
    let unix = unix_client(&owner);
    let tcp = tcp_client(&owner);
    unix.put(b"v", b"victim value", PutOptions::INSERT).expect("put");

    // A put whose value stops coming: its data frame is bound by the same deadline.
    let mut slow_put = Raw::unix(&owner);
    slow_put.handshake(false);
    let mut p = Vec::new();
    PutHead::encode(&mut p, false, false, b"slow-put", 200_000);
    p.extend_from_slice(b"slow-put");
    p.extend_from_slice(&[7u8; 1000]);
    slow_put.send(&frame(Op::Put, 1, &p));
    slow_put.send(&header(Op::Data as u8, PROTOCOL_VERSION, 1, 199_000));
    let slow_put = std::thread::spawn(move || {
        let started = Instant::now();
        slow_put.send(&[7u8; 10]);
        slow_put.expect_closed();
        started.elapsed()
    });
    // Five authenticated peers announce 512 KiB requests and send them a byte every 20 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..5)
        .map(|_| {
            let mut s = UnixStream::connect(owner.unix_path().expect("unix")).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            s.write_all(&hello_frame()).expect("hello");
            let mut reply = [0u8; HEADER_BYTES];
            s.read_exact(&mut reply).expect("hello reply");
            let h = FrameHeader::decode(&reply, 4096).expect("header");
            assert_eq!(h.op, Op::HelloOk);
            s.read_exact(&mut vec![0u8; h.payload_len as usize]).expect("hello reply");
            s.write_all(&header(Op::Exists as u8, PROTOCOL_VERSION, 1, 512 << 10)).expect("request");
            s.set_read_timeout(Some(Duration::from_millis(20))).expect("timeout");
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || trickle_until_closed(s, &vec![0u8; 512 << 10], Duration::from_secs(6), &stop))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));

    // Other clients' requests fit their own shares: none waits for the slow ones.
    let started = Instant::now();
    for _ in 0..20 {
        assert_eq!(unix.get(b"v").expect("unix get"), b"victim value");
        assert_eq!(tcp.get(b"v").expect("tcp get"), b"victim value");
        assert_eq!(tcp.batch_exists(&[b"v", b"w"]), vec![Ok(true), Ok(false)]);
    }
    assert!(started.elapsed() < Duration::from_secs(1), "gets stalled for {:?}", started.elapsed());

    // The two slow requests that got room in the pool were cut off by the payload deadline, well
    // before 6 s of trickling; the three waiting for room give up.
    let mut cut = 0;
    while cut < 2 {
        let ended = attackers.iter().filter(|a| a.is_finished()).count();
        assert!(started.elapsed() < Duration::from_secs(3), "slow requests still held after {ended} ended");
        cut = ended;
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::SeqCst);
    let closed: Vec<Option<Duration>> = attackers.into_iter().map(|a| a.join().expect("attacker")).collect();
    assert!(closed.iter().flatten().count() >= 2, "{closed:?}");
    let put_closed = slow_put.join().expect("slow put");
    assert!(put_closed < Duration::from_secs(3), "a stalled put value lived {put_closed:?}");
    assert_eq!(unix.get(b"slow-put"), Err(Error::Store(StoreError::NotFound)), "its reservation was aborted");
    assert!(owner.counters().payload_timeouts.load(Ordering::SeqCst) >= 3);
    // With the pool free again, a request larger than a share is served.
    let keys: Vec<Vec<u8>> = (0..3000).map(|i| format!("{i:0>60}").into_bytes()).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    assert!(tcp.batch_exists(&key_refs).iter().all(|r| *r == Ok(false)), "a 190 KiB request");
    assert_eq!(owner.counters().buffered_bytes.load(Ordering::SeqCst), 0);
    drop((unix, tcp));
    wait_gauges_zero(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn idle_connections_are_closed_but_not_under_their_leases() {
    let dir = temp_dir("idle");
    let engine = engine(32 << 20);
    let owner = guarded_owner(&engine, &dir, |c| {
        c.max_connections = 4;
        c.io_timeout_ms = 1_000;
        c.lease_ttl_ms = 2_000;
    });
    let store = unix_client(&owner);
    store.put(b"k", b"value", PutOptions::INSERT).expect("put");
    // Three idle connections and the store's pooled one fill the four slots.
    let mut idle: Vec<Raw> = (0..3)
        .map(|_| {
            let mut raw = Raw::unix(&owner);
            raw.handshake(false);
            raw
        })
        .collect();
    let path = format!("unix:{}", owner.unix_path().expect("unix").display());
    assert_eq!(RemoteStore::connect_with(&path, options()).err(), Some(Error::Store(StoreError::Busy { limit: 4 })));

    // The owner closes them after 500 ms without a request.
    let started = Instant::now();
    for raw in &mut idle {
        raw.expect_closed();
    }
    assert!(started.elapsed() < Duration::from_millis(1500), "idle connections lived {:?}", started.elapsed());
    assert!(owner.counters().idle_closed.load(Ordering::SeqCst) >= 3);
    // The store's pooled connection was closed too: the next call reconnects by itself.
    assert_eq!(store.get(b"k").expect("get after idling"), b"value");
    let other = RemoteStore::connect_with(&path, options()).expect("room again");

    // A connection holding a lease is kept until the lease's TTL, then closed when idle.
    let mut holder = Raw::unix(&owner);
    holder.handshake(true);
    holder.request(&Request::Get { lease: true, items: vec![GetItem { key: b"k", check: LenCheck::Any }] }, 1);
    let (h, payload) = holder.recv().expect("grants");
    assert_eq!(h.op, Op::Grants);
    let (_, grants) = kvtide_remote::protocol::decode_grants(&payload, 16, u64::MAX).expect("grants");
    let lease = grants[0].clone().expect("granted").lease;
    std::thread::sleep(Duration::from_millis(900));
    holder.request(&Request::Release { leases: vec![lease] }, 2);
    holder.request(&Request::Exists { keys: vec![b"k"] }, 3);
    let (h, _) = holder.recv().expect("still open while it held a lease");
    assert_eq!((h.op, h.request_id), (Op::ExistsReply, 3));
    let started = Instant::now();
    holder.expect_closed();
    assert!(started.elapsed() < Duration::from_millis(1500));
    drop((store, other, idle, holder));
    wait_gauges_zero(&owner);
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn refusing_a_flood_never_stalls_the_accept_loop() {
    let dir = temp_dir("flood");
    let engine = engine(32 << 20);
    let owner = guarded_owner(&engine, &dir, |c| {
        c.max_connections = 1;
        c.max_unauthenticated_connections = 1;
        c.handshake_timeout_ms = 10_000;
        c.idle_timeout_ms = 10_000;
    });
    // Both kinds of slot are held: one Unix client, one TCP peer that stays silent.
    let holder = unix_client(&owner);
    let silent = TcpStream::connect(owner.tcp_addr().expect("tcp")).expect("connect");
    while owner.counters().handshakes_open.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    // 300 connections that send nothing and wait for the owner's answer: each gets `Busy` at
    // once (before, each refusal waited 100 ms for the client to say something).
    let started = Instant::now();
    for i in 0..300 {
        let mut raw = if i % 3 == 0 {
            let s = TcpStream::connect(owner.tcp_addr().expect("tcp")).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            Raw { stream: Box::new(s) }
        } else {
            Raw::unix(&owner)
        };
        assert_eq!(raw.expect_error(), Error::Store(StoreError::Busy { limit: 1 }), "connection {i}");
        raw.expect_closed();
    }
    assert!(started.elapsed() < Duration::from_secs(5), "300 refusals took {:?}", started.elapsed());
    assert!(owner.counters().connections_refused.load(Ordering::SeqCst) >= 300);
    // The held slots still serve; freed, they take new clients.
    assert_eq!(holder.get(b"nothing"), Err(Error::Store(StoreError::NotFound)));
    drop((holder, silent));
    wait_gauges_zero(&owner);
    let tcp = tcp_client(&owner);
    assert_eq!(tcp.get(b"nothing"), Err(Error::Store(StoreError::NotFound)));
    drop(tcp);
    wait_gauges_zero(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

// ---- progressive and streaming reads ---------------------------------------------------------

fn leaked(len: usize) -> &'static mut [u8] {
    Box::leak(vec![0u8; len].into_boxed_slice())
}

#[test]
fn progressive_and_streaming_reads_through_the_owner() {
    let dir = temp_dir("stream");
    let e = engine(64 << 20);
    let owner = owner(&e, &dir, any_port());
    let unix = unix_client(&owner);
    let tcp = tcp_client(&owner);
    let path = owner.unix_path().expect("unix").display().to_string();
    let streamed = unix_stream_client(&owner);
    let len = (5 << 20) + 11;
    let value = value_for(b"big", 1, len);
    tcp.put(b"big", &value, PutOptions::INSERT).expect("put");
    tcp.put(b"small", b"0123456789", PutOptions::INSERT).expect("put small");
    for (name, client) in [("unix+shm", &unix), ("tcp", &tcp), ("unix stream", &streamed)] {
        let dst = leaked(len + 7);
        let addr = dst.as_ptr() as usize;
        let h = client.progressive_get(b"big", Region::host(dst), 1 << 20).expect("progressive_get");
        assert_eq!(h.num_chunks(), 6, "{name}");
        h.wait_chunk(0).expect("chunk 0");
        // SAFETY: chunk 0 landed; nothing writes its range any more.
        assert_eq!(unsafe { std::slice::from_raw_parts(addr as *const u8, 1 << 20) }, &value[..1 << 20], "{name}");
        h.wait_all().expect("every chunk");
        // SAFETY: every chunk settled.
        let got = unsafe { std::slice::from_raw_parts(addr as *const u8, len + 7) };
        assert_eq!(&got[..len], &value[..], "{name}");
        assert_eq!(&got[len..], &[0u8; 7], "{name}: bytes past the object untouched");
        // Errors found before the first byte are the call's.
        assert_eq!(
            client.progressive_get(b"nope", Region::host(leaked(8)), 4).err(),
            Some(StoreError::NotFound.into())
        );
        assert_eq!(
            client.progressive_get(b"small", Region::host(leaked(9)), 4).err(),
            Some(StoreError::BufferTooSmall { object_bytes: 10, buffer_bytes: 9 }.into()),
            "{name}"
        );
        assert!(matches!(
            client.progressive_get(b"small", Region::host(leaked(10)), 0),
            Err(Error::Store(StoreError::InvalidArgument(_)))
        ));
        assert_eq!(client.progressive_get(b"", Region::host(leaked(10)), 4).err(), Some(StoreError::EmptyKey.into()));
        // Streaming ranges: chunks in the caller's order, a bad fragment fails alone.
        let (b0, b1) = (leaked(3 << 20), leaked(64));
        let (a0, a1) = (b0.as_ptr() as usize, b1.as_ptr() as usize);
        let frags = vec![
            vec![Fragment::new(b"big".to_vec(), 100, 0, 3 << 20), Fragment::new(b"missing".to_vec(), 0, 0, 5)],
            vec![Fragment::new(b"small".to_vec(), 2, 0, 8), Fragment::new(b"small".to_vec(), 5, 8, 10)],
        ];
        let h = client
            .streaming_batch_get_buffer_ranges(&[Region::host(b0), Region::host(b1)], &frags, 1 << 20)
            .expect("streaming");
        assert_eq!(h.num_chunks(), 6);
        assert_eq!(h.wait_all().err(), Some(StoreError::NotFound.into()), "{name}");
        assert!((0..3).all(|i| h.is_chunk_ready(i)) && h.is_chunk_ready(4), "{name}");
        assert!(matches!(
            h.chunk_state(5),
            Some(kvtide::ChunkState::Failed(Error::Store(StoreError::InvalidRange(_))))
        ));
        // SAFETY: every chunk settled.
        unsafe {
            assert_eq!(std::slice::from_raw_parts(a0 as *const u8, 3 << 20), &value[100..100 + (3 << 20)]);
            assert_eq!(std::slice::from_raw_parts(a1 as *const u8, 8), b"23456789");
        }
        // Handles are bounded per client (a bound of zero refuses every one).
        let none = RemoteStore::connect_with(
            &if name == "tcp" { owner.tcp_addr().expect("tcp").to_string() } else { path.clone() },
            ClientOptions { max_stream_handles: 0, shared_memory: name == "unix+shm", ..options() },
        )
        .expect("connect");
        let busy = Some(Error::from(StoreError::Busy { limit: 0 }));
        assert_eq!(none.progressive_get(b"big", Region::host(leaked(len)), 64 << 10).err(), busy);
        assert_eq!(none.streaming_batch_get_buffer_ranges(&[Region::host(leaked(8))], &[vec![]], 8).err(), busy);
        // A handle dropped at once leaves the client usable.
        drop(client.progressive_get(b"big", Region::host(leaked(len)), 64 << 10).expect("dropped handle"));
        assert_eq!(client.get(b"small").expect("the client still works"), b"0123456789");
    }
    // Dropped handles finish in the background.
    std::thread::sleep(Duration::from_millis(200));
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// An SSD-resident object read through the owner: over a socket stream the owner leases it as
/// its load starts and sends each frame once the load's checked front passed it; over shared
/// memory the lease is granted once it is loaded. Bytes are exact either way, and a load that
/// fails fails the chunks (streamed) or the call (shared memory), never with wrong bytes.
#[test]
fn ssd_resident_objects_stream_through_the_owner() {
    let slow = |faults: kvtide::SimFaults| sim_ssd_engine(8 << 20, 3, faults, |b| b);
    let key = |i: u64| format!("ssd/{i}").into_bytes();
    let len = 3 << 20;
    let dir = temp_dir("ssd-stream");
    let e = slow(kvtide::SimFaults { us_per_mib: 5_000, ..kvtide::SimFaults::default() });
    let owner = owner(&e, &dir, any_port());
    let clients =
        [("unix+shm", unix_client(&owner)), ("tcp", tcp_client(&owner)), ("unix stream", unix_stream_client(&owner))];
    for i in 0..6u64 {
        e.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    e.sync_shards().expect("sync");
    for (n, (name, client)) in clients.iter().enumerate() {
        // Each client reads a key that is on SSD only (the reads before promoted theirs).
        let i = n as u64;
        let loads = e.stats().total.loads;
        let dst = leaked(len);
        let addr = dst.as_ptr() as usize;
        let h = client.progressive_get(&key(i), Region::host(dst), 256 << 10).expect("progressive_get");
        h.wait_all().expect("every chunk");
        // SAFETY: every chunk settled.
        let got = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        assert_eq!(got, &value_for(&key(i), i, len)[..], "{name}");
        assert_eq!(e.stats().total.loads, loads + 1, "{name}: the object came from SSD");
        assert_eq!(client.get(&key(i + 3)).expect("get"), value_for(&key(i + 3), i + 3, len), "{name}");
    }
    // A batch of SSD-resident keys through the shared arena: leased in parts as the restore
    // pipeline splits them, loaded side by side, every byte checked; a batch three times larger
    // than DRAM streams through it part by part.
    let batch_len = 512 << 10;
    let batch_key = |i: u64| format!("ssd-batch/{i}").into_bytes();
    for i in 0..48u64 {
        e.put(&batch_key(i), &value_for(&batch_key(i), i, batch_len), PutOptions::INSERT).expect("put");
    }
    e.sync_shards().expect("sync");
    // Streamed, eight of them (on SSD only: those written after them filled DRAM) are leased in
    // the restore pipeline's parts, so several loads have started before the first object goes
    // out (key after key, only one would have); every key is answered once, with its bytes.
    let loads = e.stats().total.loads;
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    let first: Vec<Vec<u8>> = (8..16u64).map(batch_key).collect();
    let items = first.iter().map(|k| GetItem { key: k, check: LenCheck::Any }).collect();
    raw.request(&Request::Get { lease: false, items }, 1);
    let (answer, loads_at_first_object) = read_streamed_counting_loads(&mut raw, || e.stats().total.loads - loads);
    assert_eq!((answer.failed, answer.indices()), (0, (0..8).collect()), "every key once");
    for (index, bytes) in &answer.objects {
        let i = 8 + u64::from(*index);
        assert!(*bytes == value_for(&batch_key(i), i, batch_len), "streamed bytes of {i}");
    }
    assert!(loads_at_first_object >= Some(2), "loads started before the first object: {loads_at_first_object:?}");
    // Ranges of eight others (also on SSD only) the same way: most of each (more than the
    // socket buffers, so the owner is still sending the first when the test looks), several
    // loads started before the first fragment goes out, every fragment answered once.
    let loads = e.stats().total.loads;
    let others: Vec<Vec<u8>> = (24..32u64).map(batch_key).collect();
    let range_len = batch_len - 1008;
    let fragments =
        (0..8u32).map(|k| RangeItem { key_index: k, src_offset: 1000 + u64::from(k), len: range_len as u64 }).collect();
    raw.request(&Request::GetRanges { keys: others.iter().map(Vec::as_slice).collect(), fragments }, 2);
    let (answer, loads_at_first_object) = read_streamed_counting_loads(&mut raw, || e.stats().total.loads - loads);
    assert_eq!((answer.failed, answer.indices()), (0, (0..8).collect()), "every fragment once");
    for (index, bytes) in &answer.objects {
        let k = u64::from(*index);
        let want = value_for(&batch_key(24 + k), 24 + k, batch_len);
        let from = 1000 + k as usize;
        assert!(bytes[..] == want[from..from + range_len], "range of key {}", 24 + k);
    }
    assert!(loads_at_first_object >= Some(2), "ranges: loads started first: {loads_at_first_object:?}");
    drop(raw);
    for count in [8u64, 48] {
        let keys: Vec<Vec<u8>> = (0..count).map(batch_key).collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut bufs: Vec<Vec<u8>> = (0..count).map(|_| vec![0u8; batch_len]).collect();
        let dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b)]).collect();
        let loads = e.stats().total.loads;
        let got = clients[0].1.batch_get_into_multi_buffers(&key_refs, &dsts);
        drop(dsts);
        for (i, r) in got.iter().enumerate() {
            assert_eq!(r, &Ok(batch_len), "batch of {count}: key {i}");
            assert!(bufs[i] == value_for(&keys[i], i as u64, batch_len), "batch of {count}: bytes of {i}");
        }
        assert!(e.stats().total.loads > loads, "batch of {count}: loaded from SSD");
        wait_gauge(&owner.counters().leases_outstanding, 0, "leases after the batch");
        // The same batch streamed over TCP and the Unix socket, loaded part by part.
        for (name, client) in &clients[1..] {
            let mut bufs: Vec<Vec<u8>> = (0..count).map(|_| vec![0u8; batch_len]).collect();
            let dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b)]).collect();
            let loads = e.stats().total.loads;
            let got = client.batch_get_into_multi_buffers(&key_refs, &dsts);
            drop(dsts);
            for (i, r) in got.iter().enumerate() {
                assert_eq!(r, &Ok(batch_len), "{name}, batch of {count}: key {i}");
                assert!(bufs[i] == value_for(&keys[i], i as u64, batch_len), "{name}, batch of {count}: bytes of {i}");
            }
            // Three times DRAM: loaded from SSD whatever the reads before promoted.
            if count == 48 {
                assert!(e.stats().total.loads > loads, "{name}, batch of {count}: loaded from SSD");
            }
        }
        wait_idle(&owner);
    }
    // Ranges of every key of a batch three times the DRAM stream through in parts too.
    let mut out = vec![0u8; 48 * 100];
    let frags = vec![(0..48u64).map(|i| Fragment::new(batch_key(i), 1000 + i, i * 100, 100)).collect::<Vec<_>>()];
    for (name, client) in &clients {
        out.fill(0);
        let got = client.get_into_ranges(&[Region::host(&mut out)], &frags);
        for i in 0..48usize {
            assert_eq!(got[0][i], Ok(100), "{name}: range of key {i}");
            let want = value_for(&batch_key(i as u64), i as u64, batch_len);
            assert!(out[i * 100..(i + 1) * 100] == want[1000 + i..1100 + i], "{name}: bytes of range {i}");
        }
    }
    wait_gauge(&owner.counters().leases_outstanding, 0, "leases after the ranges");
    // A client that sends another request instead of releasing its parts loses its
    // connection, and with it every lease.
    let keys: Vec<Vec<u8>> = (0..48u64).map(batch_key).collect();
    let mut raw = Raw::unix(&owner);
    raw.handshake(true);
    let items = keys.iter().map(|k| GetItem { key: k, check: LenCheck::Any }).collect();
    raw.request(&Request::GetParts { items }, 1);
    let mut parts = 0;
    loop {
        let (h, _) = raw.recv().expect("a part or the error");
        match h.op {
            Op::GrantsPart => {
                parts += 1;
                if parts == 1 {
                    raw.request(&Request::Exists { keys: vec![b"x"] }, 2);
                }
            }
            Op::Error => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(parts <= 2, "the owner waits for releases after two parts, sent {parts}");
    raw.expect_closed();
    drop(raw);
    drop(clients);
    wait_idle(&owner);
    drop(owner);

    // Every read fails: streamed chunks fail with Io, a shared-memory lease fails the call.
    let e = slow(kvtide::SimFaults { read_eio_ppm: 1_000_000, ..kvtide::SimFaults::default() });
    let owner = self::owner(&e, &dir, any_port());
    for i in 0..6u64 {
        e.put(&key(i), &value_for(&key(i), i, len), PutOptions::INSERT).expect("put");
    }
    e.sync_shards().expect("sync");
    let tcp = tcp_client(&owner);
    let h = tcp.progressive_get(&key(0), Region::host(leaked(len)), 256 << 10).expect("the object's length is known");
    assert!(matches!(h.wait_all(), Err(Error::Store(StoreError::Io(_)))), "{:?}", h.status());
    assert!(matches!(tcp.get(&key(1)), Err(Error::Store(StoreError::Io(_)))));
    let unix = unix_client(&owner);
    assert!(matches!(
        unix.progressive_get(&key(2), Region::host(leaked(len)), 256 << 10),
        Err(Error::Store(StoreError::Io(_)))
    ));
    drop(h);
    drop((tcp, unix));
    wait_idle(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn progressive_puts_through_the_owner_are_followed_and_end_with_their_connection() {
    use kvtide_remote::protocol::PutChunkHead;
    let dir = temp_dir("put-stream");
    let e = engine(64 << 20);
    let owner = owner(&e, &dir, any_port());
    for (name, client) in [("unix", unix_client(&owner)), ("tcp", tcp_client(&owner))] {
        let key = format!("p/{name}").into_bytes();
        let value = value_for(&key, 1, (3 << 20) + 5);
        let mut put = client.progressive_put(&key, value.len() as u64, 1 << 20, PutOptions::INSERT).expect("open");
        assert_eq!(put.num_chunks(), 4);
        // A reader on the owner's engine follows the remote producer.
        let dst = leaked(value.len());
        let addr = dst.as_ptr() as usize;
        let h = e.progressive_get_unsealed(&key, Region::host(dst), 1 << 20).expect("follow");
        let chunk = |i: usize| {
            let r = put.chunk_range(i).expect("range");
            value[r.start as usize..r.end as usize].to_vec()
        };
        let chunks: Vec<Vec<u8>> = (0..4).map(chunk).collect();
        put.put_chunk(0, Region::host_readonly(&chunks[0])).expect("chunk 0");
        h.wait_chunk(0).expect("the follower has chunk 0 before the rest is written");
        assert_eq!(put.put_chunk(0, Region::host_readonly(&chunks[0])), Err(StoreError::AlreadyExists.into()));
        assert!(matches!(
            put.put_chunk(1, Region::host_readonly(&chunks[0][..10])),
            Err(Error::Store(StoreError::SizeMismatch { .. }))
        ));
        put.put_chunk(3, Region::host_readonly(&chunks[3])).expect("chunk 3");
        assert_eq!(client.exists(&key), Ok(false), "{name}: invisible before the seal");
        assert!(matches!(put.seal(), Err(Error::Store(StoreError::InvalidArgument(m))) if m.contains("[1, 2]")));
        put.put_chunk(2, Region::host_readonly(&chunks[2])).expect("chunk 2");
        put.put_chunk(1, Region::host_readonly(&chunks[1])).expect("chunk 1");
        put.seal().expect("seal");
        drop(put);
        h.wait_all().expect("the follower got every chunk");
        // SAFETY: every chunk settled.
        assert_eq!(unsafe { std::slice::from_raw_parts(addr as *const u8, value.len()) }, &value[..]);
        assert_eq!(client.get(&key).expect("sealed"), value, "{name}");
        // Dropping an unsealed stream aborts it, for readers on the owner and through it.
        let dropped = client.progressive_put(b"dropped", 4096, 1024, PutOptions::INSERT).expect("open");
        let h = e.progressive_get_unsealed(b"dropped", Region::host(leaked(4096)), 1024).expect("follow");
        let remote_reader =
            client.progressive_get_unsealed(b"dropped", Region::host(leaked(4096)), 1024).expect("remote follow");
        dropped.put_chunk(0, Region::host_readonly(&[9u8; 1024])).expect("chunk 0");
        remote_reader.wait_chunk(0).expect("a remote reader gets chunk 0 before the rest is written");
        drop(dropped);
        assert!(matches!(h.wait_all(), Err(StoreError::ProducerAborted(_))), "{name}");
        assert!(
            matches!(remote_reader.wait_all(), Err(Error::Store(StoreError::ProducerAborted(_)))),
            "{name}: {:?}",
            remote_reader.status()
        );
        // A remote reader that follows a remote producer to the seal; without an open put the
        // same call reads the sealed object.
        let key2 = format!("followed/{name}").into_bytes();
        let value2 = value_for(&key2, 2, (2 << 20) + 3);
        let mut put2 = client.progressive_put(&key2, value2.len() as u64, 1 << 20, PutOptions::INSERT).expect("open");
        let dst2 = leaked(value2.len());
        let addr2 = dst2.as_ptr() as usize;
        let reader = client.progressive_get_unsealed(&key2, Region::host(dst2), 512 << 10).expect("remote follow");
        for i in 0..put2.num_chunks() {
            let r = put2.chunk_range(i).expect("range");
            put2.put_chunk(i, Region::host_readonly(&value2[r.start as usize..r.end as usize])).expect("chunk");
        }
        put2.seal().expect("seal");
        drop(put2);
        reader.wait_all().expect("the remote reader got every chunk");
        // SAFETY: every chunk settled.
        assert_eq!(unsafe { std::slice::from_raw_parts(addr2 as *const u8, value2.len()) }, &value2[..]);
        let dst3 = leaked(value2.len());
        let addr3 = dst3.as_ptr() as usize;
        client.progressive_get_unsealed(&key2, Region::host(dst3), 1 << 20).expect("sealed").wait_all().expect("all");
        // SAFETY: every chunk settled.
        assert_eq!(unsafe { std::slice::from_raw_parts(addr3 as *const u8, value2.len()) }, &value2[..]);
        assert_eq!(
            client.progressive_get_unsealed(b"never", Region::host(leaked(8)), 4).err(),
            Some(StoreError::NotFound.into())
        );
        assert_eq!(client.get(b"small-after").err(), Some(StoreError::NotFound.into()), "the client carries on");
    }
    // A producer whose connection dies mid-chunk: its put is aborted, its readers fail, nothing
    // stays held.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.request(&Request::PutOpen { key: b"raw", total_len: 8192, chunk_bytes: 4096, upsert: false, pin: false }, 5);
    let (h, _) = raw.recv().expect("put open reply");
    assert_eq!(h.op, Op::Ok);
    let follower = e.progressive_get_unsealed(b"raw", Region::host(leaked(8192)), 4096).expect("follow");
    let mut head = Vec::new();
    PutChunkHead { stream: 5, index: 0, len: 4096 }.encode(&mut head);
    raw.send(&frame(Op::PutChunk, 6, &head));
    raw.send(&frame(Op::Data, 6, &[1u8; 100]));
    drop(raw);
    assert!(matches!(follower.wait_all(), Err(StoreError::ProducerAborted(_))));
    assert_eq!(e.exists(b"raw"), Ok(false));
    drop(follower);
    std::thread::sleep(Duration::from_millis(100));
    wait_idle(&owner);
    assert_eq!(e.stats().stream.unsealed_objects, 0);
    let _ = std::fs::remove_dir_all(dir);
}

// ---- batches through the owner ----------------------------------------------------------------

/// Batch requests the owner served so far (a get's release frame is a request of its own, so
/// the plain request count would include those).
fn requests(owner: &Owner) -> u64 {
    owner.counters().batch_requests.load(Ordering::SeqCst)
}

#[test]
fn batches_through_the_owner_take_one_request_per_group() {
    let engine = engine(256 << 20);
    let dir = temp_dir("batches");
    let owner = guarded_owner(&engine, &dir, |c| {
        c.put_window_bytes = 4 << 20;
        c.idle_timeout_ms = 60_000;
        c.payload_timeout_ms = 10_000;
    });
    let clients = [("unix", unix_client(&owner)), ("window", window_client(&owner)), ("tcp", tcp_client(&owner))];
    for (name, store) in clients {
        // 40 values that fit a 2 MiB window half, 2 that do not (streamed), an empty one, and
        // two bad keys that fail only themselves.
        let mut keys: Vec<Vec<u8>> = (0..40).map(|i| format!("{name}-small-{i}").into_bytes()).collect();
        keys.push(format!("{name}-large-0").into_bytes());
        keys.push(format!("{name}-large-1").into_bytes());
        keys.push(format!("{name}-empty").into_bytes());
        keys.push(Vec::new());
        keys.push(vec![b'k'; 2000]);
        let lens: Vec<usize> = keys
            .iter()
            .enumerate()
            .map(|(i, _)| {
                if i < 40 {
                    64 << 10
                } else if i < 42 {
                    3 << 20
                } else {
                    0
                }
            })
            .collect();
        let values: Vec<Vec<u8>> = keys.iter().zip(&lens).map(|(k, &len)| value_for(k, 1, len)).collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        // The first value comes from two regions, to check the gather into the window.
        let mut sources: Vec<Vec<Region<'_>>> = values.iter().map(|v| vec![Region::host_readonly(v)]).collect();
        sources[0] = vec![Region::host_readonly(&values[0][..1000]), Region::host_readonly(&values[0][1000..])];
        let before = requests(&owner);
        let results = store.batch_put_from_multi_buffers(&key_refs, &sources, PutOptions::default());
        let put_requests = requests(&owner) - before;
        for (i, r) in results.iter().enumerate().take(43) {
            assert_eq!(r, &Ok(()), "{name}: put {i}");
        }
        assert_eq!(results[43], Err(StoreError::EmptyKey.into()), "{name}");
        assert!(matches!(results[44], Err(Error::Store(StoreError::TooLarge { what: "key", .. }))), "{name}");
        // Unix, read from the client's memory: one request. Through the window: five groups of
        // small values (an eighth of the window each), the large ones streamed, the empty one.
        // TCP: one streamed request.
        let most = if name == "window" { 7 } else { 1 };
        assert!(put_requests <= most, "{name}: {put_requests} requests for 45 puts");
        assert_eq!(store.uses_shared_memory(), name != "tcp");

        let mut bufs: Vec<Vec<u8>> = lens[..43].iter().map(|&len| vec![0u8; len]).collect();
        let dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b)]).collect();
        let got = store.batch_get_into_multi_buffers(&key_refs[..43], &dsts);
        drop(dsts);
        for (i, r) in got.iter().enumerate() {
            assert_eq!(r, &Ok(lens[i]), "{name}: get {i}");
            assert!(bufs[i] == values[i], "{name}: bytes of {i}");
        }

        // Again without upsert: existing keys fail alone, a new key in the same batch lands.
        let again: Vec<&[u8]> = vec![key_refs[0], b"fresh", key_refs[41]];
        let srcs = vec![vec![Region::host_readonly(&values[0])], vec![Region::host_readonly(b"new")], vec![]];
        let results = store.batch_put_from_multi_buffers(&again, &srcs, PutOptions::default());
        assert_eq!(results, vec![Err(StoreError::AlreadyExists.into()), Ok(()), Err(StoreError::AlreadyExists.into())]);
        // With upsert, a value changes in place.
        let newer = value_for(key_refs[1], 2, 64 << 10);
        let results = store.batch_put_from_multi_buffers(
            &[key_refs[1]],
            &[vec![Region::host_readonly(&newer)]],
            PutOptions { upsert: true, pin: false },
        );
        assert_eq!(results, vec![Ok(())]);
        assert!(store.get(key_refs[1]).expect("upserted") == newer, "{name}: upsert");

        let before = requests(&owner);
        let mut doomed: Vec<&[u8]> = key_refs[..43].to_vec();
        doomed.push(b"fresh");
        doomed.push(b"never-stored");
        doomed.push(b"");
        let removed = store.batch_remove(&doomed, false);
        assert_eq!(requests(&owner) - before, 1, "{name}: one remove request");
        assert!(removed[..44].iter().all(|r| r.is_ok()), "{name}: {removed:?}");
        assert_eq!(removed[44], Err(StoreError::NotFound.into()));
        assert_eq!(removed[45], Err(StoreError::EmptyKey.into()));
        assert!(store.batch_exists(&doomed[..45]).into_iter().all(|r| r == Ok(false)), "{name}: all gone");
        let windows = owner.counters().put_window_bytes.load(Ordering::SeqCst);
        match name {
            "unix" => {
                assert_eq!(windows, 0, "no window for direct puts");
                assert!(owner.counters().direct_put_bytes.load(Ordering::SeqCst) >= 40 * (64 << 10));
            }
            "window" => assert_eq!(windows, 4 << 20, "one window"),
            _ => {}
        }
    }
    wait_idle(&owner);
    wait_gauges_zero(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn put_windows_are_bounded_and_a_refused_client_puts_over_the_socket() {
    let engine = engine(64 << 20);
    let dir = temp_dir("windows");
    let owner = guarded_owner(&engine, &dir, |c| {
        c.put_window_bytes = 1 << 20;
        c.max_put_window_bytes = 1 << 20;
        c.idle_timeout_ms = 60_000;
    });
    let value = value_for(b"w", 1, 100_000);
    // A client whose puts the owner reads from its memory takes no window.
    let direct = unix_client(&owner);
    direct.put(b"direct", &value, PutOptions::default()).expect("direct put");
    assert_eq!(owner.counters().put_window_bytes.load(Ordering::SeqCst), 0);
    assert_eq!(owner.counters().direct_put_bytes.load(Ordering::SeqCst), value.len() as u64);
    let first = window_client(&owner);
    first.put(b"first", &value, PutOptions::default()).expect("first put");
    assert_eq!(owner.counters().put_window_bytes.load(Ordering::SeqCst), 1 << 20);
    let second = window_client(&owner);
    second.put(b"second", &value, PutOptions::default()).expect("second put, over the socket");
    assert_eq!(owner.counters().put_windows_refused.load(Ordering::SeqCst), 1);
    assert!(second.get(b"second").expect("second") == value);
    assert!(first.get(b"second").expect("seen by the first") == value);
    drop((direct, first, second));
    wait_gauges_zero(&owner);

    // Without windows, Unix puts travel over the socket.
    drop(owner);
    let owner = guarded_owner(&engine, &dir, |c| c.put_window_bytes = 0);
    let store = window_client(&owner);
    store.put(b"no-window", &value, PutOptions::default()).expect("put");
    assert!(store.get(b"no-window").expect("get") == value);
    assert_eq!(owner.counters().put_window_bytes.load(Ordering::SeqCst), 0);
    drop(store);
    wait_gauges_zero(&owner);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn hostile_batches_fail_only_what_they_must() {
    let engine = engine(64 << 20);
    let dir = temp_dir("hostile-batches");
    let owner = guarded_owner(&engine, &dir, |c| {
        c.put_window_bytes = 1 << 20;
        c.idle_timeout_ms = 60_000;
    });
    let put = |window: bool, items: Vec<PutItem<'static>>| Request::PutBatch {
        upsert: false,
        pin: false,
        source: if window { ValueSource::Window } else { ValueSource::Stream },
        items,
    };
    let item = |key: &'static [u8], len: u64, window_offset: u64| PutItem {
        key,
        len,
        window_offset,
        segments: ClientSegments::default(),
    };

    // A window batch on a connection without a window: refused whole, the connection goes on.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.request(&put(true, vec![item(b"a", 10, 0)]), 1);
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(_))));
    raw.request(&Request::Exists { keys: vec![b"a"] }, 2);
    assert_eq!(raw.recv().expect("exists").0.op, Op::ExistsReply);

    // With a window: a range outside it fails its own item only; a second window is refused.
    raw.request(&Request::PutWindow, 3);
    let (h, payload) = raw.recv().expect("window");
    assert_eq!((h.op, payload.len()), (Op::Window, 8));
    raw.request(&Request::PutWindow, 4);
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(_))));
    let items = vec![item(b"outside", 10, (1 << 20) - 5), item(b"wrapping", 10, u64::MAX - 3), item(b"inside", 10, 0)];
    raw.request(&put(true, items), 5);
    let (h, payload) = raw.recv().expect("statuses");
    assert_eq!(h.op, Op::Statuses);
    let statuses = decode_statuses(&payload, 16).expect("statuses");
    assert!(matches!(statuses[0], Err(Error::Store(StoreError::InvalidRange(_)))), "{statuses:?}");
    assert!(matches!(statuses[1], Err(Error::Store(StoreError::InvalidRange(_)))), "{statuses:?}");
    assert_eq!(statuses[2], Ok(()));
    assert_eq!(engine.exists(b"outside"), Ok(false), "a failed item is not published");
    assert_eq!(engine.get(b"inside").expect("inside"), vec![0u8; 10]);
    assert_eq!(owner.counters().put_window_bytes.load(Ordering::SeqCst), 1 << 20);
    drop(raw);

    // TCP connections get no window.
    let open_tcp = Owner::start(
        Arc::clone(&engine),
        OwnerConfig { tcp: Some(any_port()), allow_unauthenticated_loopback: true, ..OwnerConfig::default() },
    )
    .expect("loopback owner");
    let mut raw = Raw::tcp(&open_tcp);
    raw.handshake(false);
    raw.request(&Request::PutWindow, 1);
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(_))));
    drop(raw);
    drop(open_tcp);

    // A streamed batch whose value frame is longer than its item: the connection is closed and
    // nothing of the batch is published.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.request(&put(false, vec![item(b"long", 4, 0)]), 1);
    raw.send(&frame(Op::Data, 1, &[7u8; 8]));
    assert!(matches!(raw.expect_error(), Error::Protocol(_)));
    raw.expect_closed();
    assert_eq!(engine.exists(b"long"), Ok(false));
    // A streamed batch cut short by a vanishing client publishes nothing either.
    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    raw.request(&put(false, vec![item(b"cut", 8192, 0)]), 1);
    raw.send(&frame(Op::Data, 1, &[7u8; 4096]));
    drop(raw);
    wait_idle(&owner);
    wait_gauges_zero(&owner);
    assert_eq!(engine.exists(b"cut"), Ok(false));
    assert!(engine.stats().held_resources().is_zero());
    let _ = std::fs::remove_dir_all(dir);
}

/// Puts whose values the owner reads from the client's memory: only after a probe showed the
/// client's nonce, only within what the client's process can be read at, one item failing alone,
/// and nothing published once the client shut its connection.
#[test]
fn direct_puts_read_only_what_the_client_named_and_fail_alone() {
    let engine = engine(64 << 20);
    let dir = temp_dir("direct-puts");
    let owner = guarded_owner(&engine, &dir, |c| c.idle_timeout_ms = 60_000);
    let direct = |items: Vec<PutItem<'_>>| {
        let mut p = Vec::new();
        Request::PutBatch { upsert: true, pin: false, source: ValueSource::Client, items }.encode(&mut p);
        p
    };
    let segments = |pairs: &[(u64, u64)]| {
        let mut wire = Vec::new();
        ClientSegments::encode(pairs.iter().copied(), &mut wire);
        wire
    };
    let value = b"one copy, read by the owner".to_vec();
    let whole = segments(&[(value.as_ptr() as u64, value.len() as u64)]);
    let item = |key: &'static [u8], wire: &'static [u8], len: u64| PutItem {
        key,
        len,
        window_offset: 0,
        segments: ClientSegments::from_wire(wire).expect("segments"),
    };
    let whole: &'static [u8] = Box::leak(whole.into_boxed_slice());

    let mut raw = Raw::unix(&owner);
    raw.handshake(false);
    // Not granted yet: the batch is refused whole, the connection goes on.
    raw.send(&frame(Op::PutBatch, 1, &direct(vec![item(b"early", whole, value.len() as u64)])));
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(_))));
    // A probe whose address does not hold the nonce is refused and counted.
    let nonce = [0x5a_u8; PROBE_BYTES];
    let elsewhere = [0u8; PROBE_BYTES];
    raw.request(&Request::PutDirect { probe: elsewhere.as_ptr() as u64, nonce }, 2);
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(_))));
    raw.request(&Request::PutDirect { probe: 8, nonce }, 3);
    assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(_))));
    assert_eq!(owner.counters().direct_puts_refused.load(Ordering::SeqCst), 2);
    raw.request(&Request::PutDirect { probe: nonce.as_ptr() as u64, nonce }, 4);
    assert_eq!(raw.recv().expect("granted").0.op, Op::Ok);

    // An unmapped address fails its own item; a value in two pieces is read whole.
    let unmapped: &'static [u8] = Box::leak(segments(&[(8, 16)]).into_boxed_slice());
    let (a, b) = value.split_at(5);
    let pieces: &'static [u8] = Box::leak(
        segments(&[(a.as_ptr() as u64, a.len() as u64), (b.as_ptr() as u64, b.len() as u64)]).into_boxed_slice(),
    );
    let items = vec![
        item(b"unmapped", unmapped, 16),
        item(b"whole", whole, value.len() as u64),
        item(b"pieces", pieces, value.len() as u64),
    ];
    raw.send(&frame(Op::PutBatch, 5, &direct(items)));
    let (h, payload) = raw.recv().expect("statuses");
    assert_eq!(h.op, Op::Statuses);
    let statuses = decode_statuses(&payload, 16).expect("statuses");
    assert!(matches!(statuses[0], Err(Error::Store(StoreError::InvalidArgument(_)))), "{statuses:?}");
    assert_eq!(statuses[1..], [Ok(()), Ok(())]);
    assert_eq!(engine.exists(b"unmapped"), Ok(false), "a failed item is not published");
    assert_eq!(engine.get(b"whole").expect("whole"), value);
    assert_eq!(engine.get(b"pieces").expect("pieces"), value);
    assert_eq!(owner.counters().direct_put_bytes.load(Ordering::SeqCst), 2 * value.len() as u64);

    // A client that shuts its connection while the owner reads: nothing of that batch, nor of
    // the one queued behind it, is published (the owner is still reading the first 24 MiB when
    // the shutdown arrives).
    let big = vec![7u8; 24 << 20];
    let big_wire: &'static [u8] = Box::leak(segments(&[(big.as_ptr() as u64, big.len() as u64)]).into_boxed_slice());
    raw.send(&frame(Op::PutBatch, 6, &direct(vec![item(b"big", big_wire, big.len() as u64)])));
    raw.send(&frame(Op::PutBatch, 7, &direct(vec![item(b"after", whole, value.len() as u64)])));
    raw.stream.shutdown_write();
    raw.expect_closed();
    wait_idle(&owner);
    assert_eq!(engine.exists(b"big"), Ok(false));
    assert_eq!(engine.exists(b"after"), Ok(false));
    drop(raw);

    // An owner with direct puts off refuses the probe; TCP connections are refused too.
    let off = Owner::start(
        Arc::clone(&engine),
        OwnerConfig {
            unix_socket: Some(dir.join("off.sock")),
            tcp: Some(any_port()),
            allow_unauthenticated_loopback: true,
            direct_puts: false,
            ..OwnerConfig::default()
        },
    )
    .expect("owner");
    for mut raw in [Raw::unix(&off), Raw::tcp(&off)] {
        raw.handshake(false);
        raw.request(&Request::PutDirect { probe: nonce.as_ptr() as u64, nonce }, 1);
        assert!(matches!(raw.expect_error(), Error::Store(StoreError::InvalidArgument(_))));
    }
    drop(off);
    wait_gauges_zero(&owner);
    assert!(engine.stats().held_resources().is_zero());
    let _ = std::fs::remove_dir_all(dir);
}

/// A read's lease release travels without a reply; a `remove` right after the read, on another
/// pooled connection of the same client, must still never find the object leased by that read.
#[test]
fn remove_right_after_a_read_never_sees_the_readers_own_lease() {
    let engine = engine(64 << 20);
    let dir = temp_dir("read-then-remove");
    let owner = owner(&engine, &dir, any_port());
    let store = unix_client(&owner);
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let store = &store;
            s.spawn(move || {
                let mut out = vec![0u8; 4096];
                for i in 0..200u32 {
                    let key = format!("rr/{t}/{i}").into_bytes();
                    store.put(&key, &[t; 4096], PutOptions::INSERT).expect("put");
                    assert_eq!(store.get_into(&key, Region::host(&mut out)), Ok(4096));
                    let removed = if i % 2 == 0 {
                        store.remove(&key, false)
                    } else {
                        store.batch_remove(&[key.as_slice()], false).pop().expect("one result")
                    };
                    assert_eq!(removed, Ok(()), "key {t}/{i}");
                }
            });
        }
    });
    wait_idle(&owner);
    owner.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

/// A DRAM-resident batch through the shared arena comes in parts of at most 256 keys; the
/// client may keep a part (`WhileHeld`) while the owner leases the next, and must give back the
/// earlier ones first. The whole batch reads byte for byte, and no lease is left.
#[test]
fn dram_batches_come_in_parts_a_client_may_hold_while_the_next_is_leased() {
    use kvtide_remote::protocol::{GrantsPart, NextPart};
    let e = engine(64 << 20);
    let dir = temp_dir("dram-parts");
    let owner = owner(&e, &dir, any_port());
    let keys: Vec<Vec<u8>> = (0..600u64).map(|i| format!("dram-part/{i}").into_bytes()).collect();
    for (i, k) in keys.iter().enumerate() {
        e.put(k, &value_for(k, i as u64, 1000 + i), PutOptions::INSERT).expect("put");
    }
    let client = unix_client(&owner);
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut bufs: Vec<Vec<u8>> = (0..600).map(|i| vec![0u8; 1000 + i]).collect();
    let dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b)]).collect();
    let got = client.batch_get_into_multi_buffers(&key_refs, &dsts);
    drop(dsts);
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r, &Ok(1000 + i), "key {i}");
        assert!(bufs[i] == value_for(&keys[i], i as u64, 1000 + i), "bytes of key {i}");
    }
    // The last part's release is sent, not waited for, before the call returns.
    wait_gauge(&owner.counters().leases_outstanding, 0, "leases after the batch");

    // The same batch by hand: hold each part until the next arrived.
    let mut raw = Raw::unix(&owner);
    raw.handshake(true);
    let items = keys.iter().map(|k| GetItem { key: k, check: LenCheck::Any }).collect();
    raw.request(&Request::GetParts { items }, 1);
    let mut held: Option<Vec<u64>> = None;
    let (mut granted, mut parts, mut kept) = (0, 0, 0);
    loop {
        let (h, payload) = raw.recv().expect("a part");
        assert_eq!(h.op, Op::GrantsPart);
        let part = GrantsPart::decode(&payload, 1 << 16, keys.len(), 1 << 40).expect("part");
        assert!(part.grants.len() <= 256, "{} grants in one part", part.grants.len());
        granted += part.grants.len();
        parts += 1;
        let leases: Vec<u64> = part.grants.iter().map(|(_, g)| g.as_ref().expect("granted").lease).collect();
        // The earlier part goes back only now: the owner leased this one while it was held.
        if let Some(earlier) = held.take() {
            raw.request(&Request::Release { leases: earlier }, 1);
        }
        match part.next {
            NextPart::WhileHeld => {
                kept += 1;
                held = Some(leases);
            }
            NextPart::AfterRelease => raw.request(&Request::Release { leases }, 1),
            NextPart::None => {
                raw.request(&Request::Release { leases }, 1);
                break;
            }
        }
    }
    assert_eq!(granted, keys.len());
    assert_eq!((parts, kept), (3, 2), "600 keys in parts of 256, each but the last kept");
    drop(raw);
    drop(client);
    wait_idle(&owner);
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// An SSD-resident part spans one sub-batch per shard; each shard's grants go out as soon as
/// that shard's loads ended. Shard 0's disk is busy with another reader's loads, shard 1's is
/// idle: shard 1's keys come first, in a frame of their own the client may hold, then shard 0's.
#[test]
fn an_ssd_part_goes_out_shard_by_shard_as_each_shard_lands() {
    use kvtide_remote::protocol::{GrantsPart, NextPart};
    let dir = temp_dir("landed");
    let faults = kvtide::SimFaults { latency_us: 500, us_per_mib: 40_000, ..kvtide::SimFaults::default() };
    let e = sim_ssd_engine(32 << 20, 31, faults, |b| b.shards(2).promote_on_hit(false));
    let owner = owner(&e, &dir, any_port());
    let len = 256 << 10;
    let on_shard = |shard: usize, prefix: &str, n: usize| -> Vec<Vec<u8>> {
        (0..)
            .map(|i| format!("{prefix}/{i}").into_bytes())
            .filter(|k| kvtide::shard_of_key(k, 2) == shard)
            .take(n)
            .collect()
    };
    let (slow, fast, busy) = (on_shard(0, "slow", 4), on_shard(1, "fast", 4), on_shard(0, "busy", 10));
    for k in slow.iter().chain(&fast) {
        e.put(k, &value_for(k, 1, len), PutOptions::INSERT).expect("put");
    }
    for k in &busy {
        e.put(k, &vec![9u8; 1 << 20], PutOptions::INSERT).expect("put busy");
    }
    for i in 0..64u64 {
        e.put(format!("filler/{i}").as_bytes(), &vec![3u8; 1 << 20], PutOptions::INSERT).expect("filler");
    }
    e.sync_shards().expect("sync");
    // Shard 0's disk: 10 MiB of another reader's loads, about 0.4 s; the read below starts once
    // the first of them landed (not after a fixed sleep, which a loaded machine outlasts).
    let loads_before = e.stats().total.loads;
    let busy_engine = Arc::clone(&e);
    let reader = std::thread::spawn(move || {
        let refs: Vec<&[u8]> = busy.iter().map(Vec::as_slice).collect();
        let leases = busy_engine.lease_batch(&refs, 30_000);
        assert!(leases.iter().all(Result::is_ok), "the busy reader's loads");
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats().total.loads == loads_before {
        assert!(Instant::now() < deadline, "the busy reader's loads never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let keys: Vec<&Vec<u8>> = slow.iter().chain(&fast).collect();
    let mut raw = Raw::unix(&owner);
    raw.handshake(true);
    let items = keys.iter().map(|k| GetItem { key: k, check: LenCheck::Any }).collect();
    raw.request(&Request::GetParts { items }, 1);
    let mut frames: Vec<(Vec<usize>, NextPart)> = Vec::new();
    let mut held: Vec<u64> = Vec::new();
    loop {
        let (h, payload) = raw.recv().expect("a part");
        assert_eq!(h.op, Op::GrantsPart);
        let part = GrantsPart::decode(&payload, 1 << 16, keys.len(), 1 << 40).expect("part");
        let indices: Vec<usize> = part.grants.iter().map(|(i, _)| *i as usize).collect();
        let leases: Vec<u64> = part.grants.iter().map(|(_, g)| g.as_ref().expect("granted").lease).collect();
        frames.push((indices, part.next));
        raw.request(&Request::Release { leases: std::mem::take(&mut held) }, 1);
        held = leases;
        if part.next == NextPart::None {
            raw.request(&Request::Release { leases: std::mem::take(&mut held) }, 1);
            break;
        }
    }
    reader.join().expect("busy reader");
    let fast_first: Vec<usize> = (slow.len()..keys.len()).collect();
    let slow_last: Vec<usize> = (0..slow.len()).collect();
    let sorted = |v: &[usize]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v
    };
    assert_eq!(frames.len(), 2, "one frame per shard: {frames:?}");
    assert_eq!(sorted(&frames[0].0), fast_first, "the idle shard's keys first: {frames:?}");
    assert_eq!(frames[0].1, NextPart::WhileHeld, "held while the other shard lands");
    assert_eq!(sorted(&frames[1].0), slow_last, "{frames:?}");
    drop(raw);
    wait_idle(&owner);
    drop(owner);
    let _ = std::fs::remove_dir_all(dir);
}

/// Waits until `gauge` reads `want` (10 s at most).
fn wait_gauge(gauge: &std::sync::atomic::AtomicU64, want: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while gauge.load(Ordering::SeqCst) != want {
        assert!(Instant::now() < deadline, "{what}: {} (want {want})", gauge.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Idle connections cost no thread: they park between requests (with their leases), each wakes
/// on its next request, a busy client is served meanwhile, and parked connections still close
/// at their idle timeout and at shutdown.
#[test]
fn idle_connections_park_without_a_thread_and_wake_on_their_next_request() {
    let e = engine(64 << 20);
    let dir = temp_dir("parked");
    let owner = guarded_owner(&e, &dir, |c| {
        c.max_connections = 400;
        c.idle_timeout_ms = 60_000;
    });
    e.put(b"k", &[7u8; 5000], PutOptions::UPSERT).expect("put");
    let path = owner.unix_path().expect("unix").display().to_string();
    let idle: Vec<RemoteStore> = (0..200)
        .map(|_| {
            RemoteStore::connect_with(&path, ClientOptions { shared_memory: false, ..options() }).expect("connect")
        })
        .collect();
    // And one with the shared arena mapped.
    let mapped = unix_client(&owner);
    let counters = owner.counters();
    wait_gauge(&counters.connections_parked, 201, "parked connections");
    wait_gauge(&counters.connection_threads, 0, "connection threads");
    assert_eq!(counters.connections_open.load(Ordering::SeqCst), 201);
    // A busy client is served (its connection gets a thread, then parks again).
    let busy = unix_client(&owner);
    for _ in 0..100 {
        assert_eq!(busy.get(b"k").expect("get"), vec![7u8; 5000]);
    }
    // Every parked connection wakes on its next request.
    for (i, client) in idle.iter().enumerate() {
        assert_eq!(client.get(b"k").expect("get"), vec![7u8; 5000], "client {i}");
    }
    wait_gauge(&counters.connections_parked, 202, "parked again");
    wait_gauge(&counters.connection_threads, 0, "threads given back");
    drop(idle);
    drop((mapped, busy));
    wait_gauge(&counters.connections_open, 0, "closed with their clients");
    wait_gauge(&counters.connections_parked, 0, "nothing parked");
    wait_idle(&owner);

    // A parked connection still closes at its idle timeout.
    drop(owner);
    let owner = guarded_owner(&e, &dir, |c| {
        c.idle_timeout_ms = 300;
        c.shutdown_grace_ms = 10_000;
    });
    let client = unix_client(&owner);
    let closed = owner.counters().idle_closed.load(Ordering::SeqCst);
    wait_gauge(&owner.counters().connections_open, 0, "idle timeout");
    assert!(owner.counters().idle_closed.load(Ordering::SeqCst) > closed);
    assert_eq!(client.get(b"k").expect("a new connection"), vec![7u8; 5000]);
    // Shutdown closes parked connections at once, without waiting out its grace.
    let started = Instant::now();
    drop(owner);
    assert!(started.elapsed() < Duration::from_secs(5), "shutdown waited {:?}", started.elapsed());
    drop(client);
    let _ = std::fs::remove_dir_all(dir);
}
