//! A kvtide cluster on loopback: a real etcd (Debian's `etcd-server`, started here on free
//! ports) and `kvtide-owner` processes registered in it, driven through `ClusterStore`.
//!
//! Without an `etcd` binary these tests are reported ignored, with a line that says how to
//! install it, except under CI (`CI` set), where `.ci/run` installs it and its absence is a
//! failure. The file has its own harness (libtest-mimic) so a missing etcd shows as "ignored",
//! never as a pass.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::value_for;
use kvtide::{Error as E, Fragment, PutOptions, Region, Store, StoreBuilder};
use kvtide_remote::cluster::{ClusterError, Etcd, EtcdConfig, EtcdError};
use kvtide_remote::{ClusterOptions, ClusterStore, Error, Token};

/// Lease TTL of the owners here: short, so expiry tests are quick.
const TTL_S: u64 = 2;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A test's directory (etcd's data, the owners' SSD tiers, the token), removed when the test
/// ends, passed or failed: a cluster test writes a few hundred MiB.
struct TestDir(PathBuf);

impl std::ops::Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tmp(name: &str) -> TestDir {
    let p = std::env::temp_dir().join(format!("kvtide-cluster-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("test dir");
    // The cluster's token, shared by its owners and clients.
    Token::load_or_create(&p.join("token")).expect("token");
    TestDir(p)
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill with the pid of our own (not yet reaped) child and a valid signal.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
}

fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("etcd")).find(|p| p.is_file())
}

/// One etcd member on loopback ports, with its data directory (kept across `restart`).
struct EtcdServer {
    child: Option<Child>,
    dir: PathBuf,
    client: u16,
    peer: u16,
}

impl EtcdServer {
    /// Starts etcd, or None (test skipped) where it is not installed outside CI.
    fn start(dir: &Path) -> Option<EtcdServer> {
        if etcd_binary().is_none() {
            assert!(std::env::var_os("CI").is_none(), "etcd is required under CI (Debian package etcd-server)");
            eprintln!("skipped: no etcd binary on PATH (apt install etcd-server)");
            return None;
        }
        let mut server = EtcdServer { child: None, dir: dir.join("etcd"), client: 0, peer: 0 };
        // A port `free_port` found free can be taken by a test running beside this one before
        // etcd binds it; etcd then exits, and is started again on other ports.
        for attempt in 1..=5 {
            (server.client, server.peer) = (free_port(), free_port());
            // A failed attempt's member data names its ports.
            let _ = std::fs::remove_dir_all(&server.dir);
            match server.launch() {
                Ok(()) => return Some(server),
                Err(e) if attempt < 5 => eprintln!("etcd exited at start ({e}); trying other ports"),
                Err(e) => panic!("etcd did not start: {e}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// Starts etcd on its ports and waits until it answers. Err when it exited meanwhile.
    fn launch(&mut self) -> Result<(), String> {
        let client = format!("http://127.0.0.1:{}", self.client);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let log = std::fs::File::create(self.dir.with_extension("log")).expect("etcd log");
        let child = Command::new(etcd_binary().expect("etcd"))
            .args(["--name", "t", "--data-dir", &self.dir.display().to_string()])
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        // Held at once, so a panic below still kills it (`Drop`).
        self.child = Some(child);
        let etcd = Etcd::new(EtcdConfig::parse(&self.endpoint()).expect("endpoint")).expect("client");
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Err(e) = etcd.get_prefix(b"/") {
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                self.child = None;
                return Err(format!("{status}; its log is {}", self.dir.with_extension("log").display()));
            }
            assert!(Instant::now() < deadline, "etcd did not start: {e}");
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    fn endpoint(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client)
    }

    fn client(&self) -> Etcd {
        Etcd::new(EtcdConfig::parse(&self.endpoint()).expect("endpoint")).expect("client")
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One `kvtide-owner` registered in a cluster.
struct OwnerProc {
    child: Option<Child>,
    id: String,
    dir: PathBuf,
    tcp: u16,
    args: Vec<String>,
}

fn owner_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvtide-owner"))
}

impl OwnerProc {
    /// Starts owner `id` of cluster `name` (data in `root/id`, TCP with the token in
    /// `root/token`, 1 shard, small DRAM and SSD).
    fn start(etcd: &EtcdServer, name: &str, id: &str, root: &Path) -> OwnerProc {
        OwnerProc::start_with(etcd, name, id, root, &[])
    }

    /// `start` with more flags.
    fn start_with(etcd: &EtcdServer, name: &str, id: &str, root: &Path, extra: &[&str]) -> OwnerProc {
        let dir = root.join(id);
        let tcp = free_port();
        let args: Vec<String> = [
            "--data-dir",
            &dir.display().to_string(),
            "--tcp",
            &format!("127.0.0.1:{tcp}"),
            "--token-file",
            &root.join("token").display().to_string(),
            "--dram-bytes",
            "64MiB",
            "--ssd-bytes",
            "64MiB",
            "--ssd-segment-bytes",
            "4MiB",
            "--shards",
            "1",
            "--runtime-pin-threads",
            "false",
            "--cluster",
            &etcd.endpoint(),
            "--cluster-name",
            name,
            "--cluster-id",
            id,
            "--cluster-lease-ttl-s",
            &TTL_S.to_string(),
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        let mut owner = OwnerProc { child: None, id: id.into(), dir, tcp, args };
        owner.launch();
        owner
    }

    fn launch(&mut self) {
        let child = Command::new(owner_binary())
            .args(&self.args)
            .env("KVTIDE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvtide-owner");
        self.child = Some(child);
    }

    fn child(&self) -> &Child {
        self.child.as_ref().expect("running")
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(&child, libc::SIGTERM);
            let status = child.wait().expect("reap");
            assert!(status.success(), "owner {} stopped with {status}", self.id);
        }
    }
}

impl Drop for OwnerProc {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            signal(child, libc::SIGCONT);
        }
        self.kill();
    }
}

fn options(etcd: &EtcdServer, name: &str, root: &Path, replication: usize) -> ClusterOptions {
    let mut o = ClusterOptions::new(&etcd.endpoint(), name).expect("options");
    o.replication = replication;
    o.client.token = Some(Token::from_file(&root.join("token")).expect("token"));
    o.client.timeout_ms = 3000;
    o.client.connect_timeout_ms = 1000;
    o.refresh_ms = 100;
    o.retry_ms = 500;
    o.wait_for_members_ms = 30_000;
    o
}

/// Waits until the cluster lists exactly `ids`.
fn wait_members(cluster: &ClusterStore, ids: &[&str], timeout: Duration) -> Duration {
    let started = Instant::now();
    let want: BTreeSet<String> = ids.iter().map(|s| s.to_string()).collect();
    loop {
        let _ = cluster.refresh();
        let have: BTreeSet<String> = cluster.members().into_iter().map(|m| m.id).collect();
        if have == want {
            return started.elapsed();
        }
        assert!(started.elapsed() < timeout, "members {have:?}, expected {want:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Three owners up and a client that sees them.
fn three_owners(tag: &str, replication: usize) -> Option<(TestDir, EtcdServer, Vec<OwnerProc>, ClusterStore)> {
    three_owners_with(tag, replication, &[])
}

fn three_owners_with(
    tag: &str,
    replication: usize,
    extra: &[&str],
) -> Option<(TestDir, EtcdServer, Vec<OwnerProc>, ClusterStore)> {
    let root = tmp(tag);
    let etcd = EtcdServer::start(&root)?;
    let owners: Vec<OwnerProc> =
        ["a", "b", "c"].iter().map(|id| OwnerProc::start_with(&etcd, tag, id, &root, extra)).collect();
    let cluster = ClusterStore::connect(options(&etcd, tag, &root, replication)).expect("connect to the cluster");
    wait_members(&cluster, &["a", "b", "c"], Duration::from_secs(60));
    Some((root, etcd, owners, cluster))
}

fn lift<T>(r: Result<T, E>) -> Result<T, Error> {
    r.map_err(Error::Store)
}

/// The same script on the embedded engine and on the cluster: every answer must match.
fn script_matches(cluster: &ClusterStore, engine: &kvtide::Engine) {
    let keys: Vec<Vec<u8>> = (0..60).map(|i| format!("k/{i:03}").into_bytes()).collect();
    for (i, k) in keys.iter().enumerate() {
        let v = value_for(k, 1, 1 + i * 997 % 20_000);
        assert_eq!(cluster.put(k, &v, PutOptions::INSERT), lift(engine.put(k, &v, PutOptions::INSERT)), "put {i}");
    }
    // Insert of an existing key, upsert, bad keys.
    let v2 = value_for(&keys[0], 2, 3000);
    assert_eq!(cluster.put(&keys[0], &v2, PutOptions::INSERT), lift(engine.put(&keys[0], &v2, PutOptions::INSERT)));
    assert_eq!(cluster.put(&keys[0], &v2, PutOptions::UPSERT), lift(engine.put(&keys[0], &v2, PutOptions::UPSERT)));
    assert_eq!(cluster.put(b"", b"x", PutOptions::INSERT), lift(engine.put(b"", b"x", PutOptions::INSERT)));
    let long = vec![b'k'; 100_000];
    assert_eq!(cluster.get(&long), lift(engine.get(&long)));
    // Batched puts with a bad key among them.
    let bkeys: Vec<Vec<u8>> = (0..20).map(|i| format!("b/{i}").into_bytes()).collect();
    let mut refs: Vec<&[u8]> = bkeys.iter().map(Vec::as_slice).collect();
    refs[7] = b"";
    let vals: Vec<Vec<u8>> = bkeys.iter().map(|k| value_for(k, 1, 5000)).collect();
    let srcs: Vec<Vec<Region<'_>>> = vals.iter().map(|v| vec![Region::host_readonly(v)]).collect();
    let c = cluster.batch_put_from_multi_buffers(&refs, &srcs, PutOptions::INSERT);
    let e: Vec<_> =
        engine.batch_put_from_multi_buffers(&refs, &srcs, PutOptions::INSERT).into_iter().map(lift).collect();
    assert_eq!(c, e);

    for k in keys.iter().chain(&bkeys).chain([&b"missing".to_vec()]) {
        assert_eq!(cluster.get(k), lift(engine.get(k)), "get {}", String::from_utf8_lossy(k));
        let (mut a, mut b) = (vec![0u8; 20_000], vec![0u8; 20_000]);
        assert_eq!(cluster.get_into(k, Region::host(&mut a)), lift(engine.get_into(k, Region::host(&mut b))));
        assert_eq!(a, b);
    }
    // Scatter into two buffers each; one key missing, one with the wrong total size.
    let mut some: Vec<&[u8]> = keys[..30].iter().map(Vec::as_slice).collect();
    some.push(b"missing");
    let sizes: Vec<usize> = some.iter().map(|k| engine.get(k).map_or(10, |v| v.len())).collect();
    let mut wrong = sizes.clone();
    wrong[3] += 1;
    let run = |store: &dyn Fn(&[&[u8]], &[Vec<Region<'_>>]) -> Vec<Result<usize, Error>>| {
        let mut bufs: Vec<Vec<u8>> = wrong.iter().map(|&n| vec![0u8; n]).collect();
        let dsts: Vec<Vec<Region<'_>>> = bufs
            .iter_mut()
            .map(|b| {
                let half = b.len() / 2;
                let (x, y) = b.split_at_mut(half);
                vec![Region::host(x), Region::host(y)]
            })
            .collect();
        let r = store(&some, &dsts);
        drop(dsts);
        (r, bufs)
    };
    let c = run(&|k, d| cluster.batch_get_into_multi_buffers(k, d));
    let e = run(&|k, d| engine.batch_get_into_multi_buffers(k, d).into_iter().map(lift).collect());
    assert_eq!(c, e);
    // Each into the start of one buffer: larger, exact, one too small, a missing key.
    let room: Vec<usize> =
        sizes.iter().enumerate().map(|(i, &n)| if i == 5 { n - 1 } else { n + i % 3 * 100 }).collect();
    let read = |store: &dyn Fn(&[&[u8]], &[Region<'_>]) -> Vec<Result<usize, Error>>| {
        let mut bufs: Vec<Vec<u8>> = room.iter().map(|&n| vec![9u8; n]).collect();
        let dsts: Vec<Region<'_>> = bufs.iter_mut().map(|b| Region::host(b)).collect();
        let r = store(&some, &dsts);
        drop(dsts);
        (r, bufs)
    };
    let c = read(&|k, d| cluster.batch_get_into(k, d));
    let e = read(&|k, d| engine.batch_get_into(k, d).into_iter().map(lift).collect());
    assert_eq!(c, e);
    assert!(matches!(c.0[5], Err(Error::Store(kvtide::Error::BufferTooSmall { .. }))), "{:?}", c.0[5]);
    assert_eq!(c.0[0], Ok(sizes[0]));
    // Ranges: two buffers, fragments of keys on different owners.
    let frags: Vec<Vec<Fragment>> = vec![
        (0..10).map(|i| Fragment::new(keys[i].clone(), 0, i as u64 * 64, 64)).collect(),
        vec![Fragment::new(keys[20].clone(), 1, 0, 100), Fragment::new(b"missing".to_vec(), 0, 100, 8)],
    ];
    let (mut c0, mut c1, mut e0, mut e1) = (vec![0u8; 640], vec![0u8; 200], vec![0u8; 640], vec![0u8; 200]);
    let c = cluster.get_into_ranges(&[Region::host(&mut c0), Region::host(&mut c1)], &frags);
    let e = engine.get_into_ranges(&[Region::host(&mut e0), Region::host(&mut e1)], &frags);
    assert_eq!(c, e.into_iter().map(|r| r.into_iter().map(lift).collect::<Vec<_>>()).collect::<Vec<_>>());
    assert_eq!((c0, c1), (e0, e1));

    // Exists and a prefix chain spread over several owners.
    let chain: Vec<&[u8]> = keys[..40].iter().map(Vec::as_slice).collect();
    let owners: BTreeSet<String> = chain.iter().map(|k| cluster.placement(k)[0].clone()).collect();
    assert!(owners.len() >= 2, "the chain should span owners: {owners:?}");
    assert_eq!(cluster.prefix_hits(&chain), lift(engine.prefix_hits(&chain)));
    assert_eq!(cluster.remove(&keys[25], false), lift(engine.remove(&keys[25], false)));
    assert_eq!(cluster.prefix_hits(&chain), Ok(25));
    assert_eq!(cluster.prefix_hits(&chain), lift(engine.prefix_hits(&chain)));
    let mut probe: Vec<&[u8]> = chain.clone();
    probe.push(b"");
    assert_eq!(cluster.batch_exists(&probe), engine.batch_exists(&probe).into_iter().map(lift).collect::<Vec<_>>());

    // Pins, removes.
    assert_eq!(cluster.pin(&keys[1]), lift(engine.pin(&keys[1])));
    assert_eq!(cluster.remove(&keys[1], false), lift(engine.remove(&keys[1], false)));
    assert_eq!(cluster.unpin(&keys[1]), lift(engine.unpin(&keys[1])));
    assert_eq!(cluster.pin(b"missing"), lift(engine.pin(b"missing")));
    let rm: Vec<&[u8]> = vec![&keys[1], b"missing", &keys[2], b""];
    assert_eq!(
        cluster.batch_remove(&rm, false),
        engine.batch_remove(&rm, false).into_iter().map(lift).collect::<Vec<_>>()
    );

    // Scans return every key once, across owners.
    let scan = |store: &dyn Fn(u64) -> Result<kvtide::KeyPage, Error>| {
        let mut all = Vec::new();
        let mut cursor = 0;
        loop {
            let page = store(cursor).expect("scan");
            all.extend(page.keys);
            match page.cursor {
                Some(c) => cursor = c,
                None => break,
            }
        }
        all
    };
    let mut c = scan(&|cur| cluster.scan_keys(b"k/", cur, 7));
    let mut e = scan(&|cur| lift(engine.scan_keys(b"k/", cur, 7)));
    let len = c.len();
    c.sort();
    c.dedup();
    assert_eq!(c.len(), len, "a key came twice");
    e.sort();
    assert_eq!(c, e);

    // Non-blocking batch get (destinations of each object's exact size).
    let ks: Vec<&[u8]> = keys[10..15].iter().map(Vec::as_slice).collect();
    let mut outs: Vec<Vec<u8>> = ks.iter().map(|k| vec![0u8; engine.get(k).map_or(1, |v| v.len())]).collect();
    let dsts: Vec<Vec<Region<'static>>> = outs
        .iter_mut()
        // SAFETY: the buffers outlive the ticket, which is waited for below.
        .map(|b| vec![unsafe { Region::from_raw(b.as_mut_ptr() as u64, b.len(), kvtide::MemoryKind::Host) }])
        .collect();
    let ticket = cluster.submit_batch_get(&ks, dsts).expect("submit");
    let got = ticket.wait();
    for (i, r) in got.into_iter().enumerate() {
        let want = engine.get(ks[i]).expect("engine");
        assert_eq!(r, Ok(want.len()));
        assert_eq!(outs[i], want);
    }
}

fn engine() -> kvtide::Engine {
    StoreBuilder::new().dram_bytes(256 << 20).shards(2).pin_threads(false).idle_spin_us(20).open().expect("engine")
}

fn every_store_operation_through_the_cluster_matches_the_embedded_engine() {
    let Some((root, etcd, owners, cluster)) = three_owners("diff", 1) else { return };
    script_matches(&cluster, &engine());
    // Spread: every owner holds some of the keys.
    let stats = cluster.stats();
    assert_eq!(stats.shards.len(), 3, "one shard per owner");
    assert!(
        stats.shards.iter().all(|s| s.objects > 0),
        "{:?}",
        stats.shards.iter().map(|s| s.objects).collect::<Vec<_>>()
    );

    // The same over TCP (the token of the owners), and without the token.
    let mut tcp = options(&etcd, "diff", &root, 1);
    tcp.unix_on_same_host = false;
    let over_tcp = ClusterStore::connect(tcp.clone()).expect("connect over TCP");
    for k in 0..60 {
        let key = format!("k/{k:03}").into_bytes();
        assert_eq!(over_tcp.get(&key), cluster.get(&key), "key {k} over TCP");
    }
    let e2 = engine();
    // Start from the same state: the cluster's keys are removed first.
    let all: Vec<Vec<u8>> = {
        let mut v = Vec::new();
        let mut cursor = 0;
        loop {
            let page = over_tcp.scan_keys(b"", cursor, 1000).expect("scan");
            v.extend(page.keys);
            match page.cursor {
                Some(c) => cursor = c,
                None => break,
            }
        }
        v
    };
    let refs: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
    assert!(over_tcp.batch_remove(&refs, true).iter().all(Result::is_ok));
    assert_eq!(over_tcp.stats().total.objects, 0);
    script_matches(&over_tcp, &e2);
    e2.shutdown();
    tcp.client.token = None;
    let no_token = ClusterStore::connect(tcp).expect("membership needs no token");
    match no_token.get(b"k/000") {
        Err(Error::Unauthorized(_)) => {}
        other => panic!("a TCP client without the token must be refused, got {other:?}"),
    }
    drop(owners);
}

/// Owners serving the UCX plane (over UCX's tcp transport, loopback): a cluster client over TCP
/// with the plane attaches to every owner's and matches the embedded engine.
fn a_cluster_client_reads_over_each_owners_ucx_plane() {
    if let Err(why) = kvtide_remote::ucx_available() {
        assert!(std::env::var_os("CI").is_none(), "CI must have UCX: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let ucx = ["--ucx", "tcp", "--ucx-allow-tcp", "true"];
    let Some((root, etcd, owners, _)) = three_owners_with("ucx", 1, &ucx) else { return };
    let mut o = options(&etcd, "ucx", &root, 1);
    o.unix_on_same_host = false;
    o.client.ucx_transports = Some("tcp".into());
    o.client.ucx_allow_tcp = true;
    let cluster = ClusterStore::connect(o).expect("connect over TCP with the UCX plane");
    wait_members(&cluster, &["a", "b", "c"], Duration::from_secs(60));
    script_matches(&cluster, &engine());
    let mut planes = BTreeSet::new();
    for k in 0..60 {
        let key = format!("k/{k:03}").into_bytes();
        let member = cluster.owner_of(&key).expect("an owner");
        assert_eq!(member.data_plane(), kvtide_remote::DataPlane::Ucx, "key {k}");
        planes.insert(cluster.placement(&key)[0].clone());
    }
    assert_eq!(planes.len(), 3, "keys on every owner, each read over its plane");
    drop(owners);
}

fn replication_two_survives_sigkill_of_any_one_owner() {
    // Write-through: an owner killed and restarted still has what it acknowledged, so killing
    // the owners one after the other is one failure at a time (without it, the restarted
    // owner's DRAM copies are gone and a second kill would be a double failure).
    let Some((_root, etcd, mut owners, cluster)) = three_owners_with("kill", 2, &["--ssd-write-through", "true"])
    else {
        return;
    };
    let mut acked: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut n = 0u64;
    let mut put_some = |cluster: &ClusterStore, acked: &mut Vec<(Vec<u8>, Vec<u8>)>, count: usize| {
        for _ in 0..count {
            n += 1;
            let key = format!("r/{n}").into_bytes();
            let value = value_for(&key, 1, 1 + (n as usize * 7919) % 100_000);
            if cluster.put(&key, &value, PutOptions::INSERT).is_ok() {
                acked.push((key, value));
            }
        }
    };
    put_some(&cluster, &mut acked, 300);
    assert_eq!(acked.len(), 300, "all puts acknowledged with every owner up");
    for victim in 0..owners.len() {
        owners[victim].kill();
        // Right away (the member is still listed) and after its lease expired.
        for phase in ["before the lease expired", "after"] {
            for (key, value) in &acked {
                match cluster.get(key) {
                    Ok(got) => assert!(got == *value, "wrong bytes for {} {phase}", String::from_utf8_lossy(key)),
                    Err(e) => panic!(
                        "acknowledged {} lost with owner {} killed ({phase}): {e}; placed on {:?}; {:?}; again: {:?}",
                        String::from_utf8_lossy(key),
                        owners[victim].id,
                        cluster.placement(key),
                        cluster.routing(),
                        cluster.get(key).map(|v| v.len()),
                    ),
                }
            }
            put_some(&cluster, &mut acked, 50);
            if phase != "after" {
                let ids: Vec<&str> =
                    owners.iter().enumerate().filter(|(i, _)| *i != victim).map(|(_, o)| o.id.as_str()).collect();
                wait_members(&cluster, &ids, Duration::from_secs(TTL_S * 5));
            }
        }
        assert!(cluster.routing().member_failures > 0);
        // Back with its data directory, under the same id.
        owners[victim].launch();
        wait_members(&cluster, &["a", "b", "c"], Duration::from_secs(60));
    }
    for (key, value) in &acked {
        assert_eq!(cluster.get(key).as_ref(), Ok(value), "{}", String::from_utf8_lossy(key));
    }
    drop(etcd);
}

fn a_paused_owner_leaves_when_its_lease_expires_and_returns_on_sigcont() {
    let Some((_root, _etcd, owners, cluster)) = three_owners("pause", 1) else { return };
    let keys: Vec<Vec<u8>> = (0..300).map(|i| format!("p/{i}").into_bytes()).collect();
    for k in &keys {
        cluster.put(k, &value_for(k, 1, 4096), PutOptions::INSERT).expect("put");
    }
    let on_b: Vec<&Vec<u8>> = keys.iter().filter(|k| cluster.placement(k)[0] == "b").collect();
    assert!(!on_b.is_empty());
    signal(owners[1].child(), libc::SIGSTOP);
    let gone_after = wait_members(&cluster, &["a", "c"], Duration::from_secs(TTL_S * 5));
    eprintln!("paused owner left the membership {gone_after:?} after SIGSTOP (TTL {TTL_S} s)");
    // Its keys are misses now, never wrong bytes; the others are served.
    for k in &keys {
        match cluster.get(k) {
            Ok(v) => assert_eq!(v, value_for(k, 1, 4096)),
            Err(Error::Store(E::NotFound)) => assert!(on_b.contains(&k), "{} missed", String::from_utf8_lossy(k)),
            Err(e) => panic!("{e}"),
        }
    }
    signal(owners[1].child(), libc::SIGCONT);
    wait_members(&cluster, &["a", "b", "c"], Duration::from_secs(TTL_S * 10));
    for k in &on_b {
        assert_eq!(cluster.get(k), Ok(value_for(k, 1, 4096)), "served again after SIGCONT");
    }
}

fn an_owner_joining_during_a_load_keeps_every_answer_correct() {
    let root = tmp("join");
    let Some(etcd) = EtcdServer::start(&root) else { return };
    let _a = OwnerProc::start(&etcd, "join", "a", &root);
    let _b = OwnerProc::start(&etcd, "join", "b", &root);
    let cluster = Arc::new(ClusterStore::connect(options(&etcd, "join", &root, 1)).expect("connect"));
    wait_members(&cluster, &["a", "b"], Duration::from_secs(60));
    let keys: Vec<Vec<u8>> = (0..3000).map(|i| format!("j/{i}").into_bytes()).collect();
    for k in &keys {
        cluster.put(k, &value_for(k, 1, 2048), PutOptions::INSERT).expect("put");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (wrong, reads) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let readers: Vec<_> = (0..2)
        .map(|t| {
            let (cluster, stop, wrong, reads, keys) =
                (Arc::clone(&cluster), Arc::clone(&stop), Arc::clone(&wrong), Arc::clone(&reads), keys.clone());
            std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    let k = &keys[i % keys.len()];
                    match cluster.get(k) {
                        Ok(v) if v == value_for(k, 1, 2048) => {}
                        Ok(_) => {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::Store(E::NotFound)) => {
                            // A key that moved: refill it, as a cache user would.
                            let _ = cluster.put(k, &value_for(k, 1, 2048), PutOptions::INSERT);
                        }
                        Err(e) => panic!("read during the join: {e}"),
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                    i += 7;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let _c = OwnerProc::start(&etcd, "join", "c", &root);
    wait_members(&cluster, &["a", "b", "c"], Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader");
    }
    assert_eq!(wrong.load(Ordering::Relaxed), 0, "wrong bytes during the join");
    assert!(reads.load(Ordering::Relaxed) > 100);
    // Moved keys miss once and refill; none other moved.
    let moved: Vec<&Vec<u8>> = keys.iter().filter(|k| cluster.placement(k)[0] == "c").collect();
    let share = moved.len() as f64 / keys.len() as f64;
    assert!((0.25..0.42).contains(&share), "about 1/3 of the keys should move, {share}");
    for k in &keys {
        if !moved.contains(&k) {
            assert_eq!(cluster.get(k), Ok(value_for(k, 1, 2048)));
        } else if cluster.get(k).is_err() {
            cluster.put(k, &value_for(k, 1, 2048), PutOptions::INSERT).expect("refill");
            assert_eq!(cluster.get(k), Ok(value_for(k, 1, 2048)));
        }
    }
}

fn clients_and_owners_ride_out_an_etcd_restart() {
    let root = tmp("etcd-restart");
    let Some(mut etcd) = EtcdServer::start(&root) else { return };
    let _a = OwnerProc::start(&etcd, "er", "a", &root);
    let _b = OwnerProc::start(&etcd, "er", "b", &root);
    let cluster = Arc::new(ClusterStore::connect(options(&etcd, "er", &root, 1)).expect("connect"));
    wait_members(&cluster, &["a", "b"], Duration::from_secs(60));
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let load = {
        let (cluster, stop, failures) = (Arc::clone(&cluster), Arc::clone(&stop), Arc::clone(&failures));
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let k = format!("e/{n}").into_bytes();
                let v = value_for(&k, 1, 8192);
                if let Err(e) = cluster.put(&k, &v, PutOptions::INSERT) {
                    failures.lock().unwrap().push(format!("put {n}: {e}"));
                }
                match cluster.get(&k) {
                    Ok(got) if got == v => {}
                    other => failures.lock().unwrap().push(format!("get {n}: {other:?}")),
                }
            }
            n
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    etcd.kill();
    // Longer than the owners' lease TTL: etcd restores the leases when it comes back.
    std::thread::sleep(Duration::from_secs(TTL_S + 1));
    assert!(cluster.refresh().is_err(), "etcd is down");
    assert_eq!(cluster.members().len(), 2, "the last membership is kept");
    etcd.launch().expect("etcd restarts on its ports");
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let ops = load.join().expect("load");
    assert!(failures.lock().unwrap().is_empty(), "{:?}", failures.lock().unwrap());
    assert!(ops > 50, "{ops}");
    assert!(cluster.routing().membership_errors > 0);
    // Both owners are (or get) registered again, and a new one can join.
    wait_members(&cluster, &["a", "b"], Duration::from_secs(TTL_S * 10));
    let _c = OwnerProc::start(&etcd, "er", "c", &root);
    wait_members(&cluster, &["a", "b", "c"], Duration::from_secs(60));
}

use std::sync::Mutex;

fn bad_cluster_input_gives_clear_errors() {
    let root = tmp("bad");
    let Some(etcd) = EtcdServer::start(&root) else { return };
    let mut a = OwnerProc::start(&etcd, "bad", "a", &root);
    let cluster = ClusterStore::connect(options(&etcd, "bad", &root, 1)).expect("connect");
    wait_members(&cluster, &["a"], Duration::from_secs(60));
    cluster.put(b"x", b"value", PutOptions::INSERT).expect("put");

    // Unknown cluster name.
    let mut o = options(&etcd, "no-such-cluster", &root, 1);
    o.wait_for_members_ms = 0;
    let e = ClusterStore::connect(o).unwrap_err();
    assert!(matches!(e, ClusterError::NoMembers { .. }), "{e}");
    assert!(e.to_string().contains("no-such-cluster"), "{e}");
    // etcd down (nothing listens there).
    let dead = format!("etcd://127.0.0.1:{}", free_port());
    let e = ClusterStore::connect(ClusterOptions::new(&dead, "bad").expect("options")).unwrap_err();
    assert!(matches!(e, ClusterError::Etcd(EtcdError::Unreachable { .. })), "{e}");
    assert!(e.to_string().contains("unreachable"), "{e}");
    // Invalid settings.
    assert!(matches!(
        ClusterOptions::new("127.0.0.1:2379", "bad"),
        Err(ClusterError::Etcd(EtcdError::InvalidEndpoints { .. }))
    ));
    let mut o = options(&etcd, "bad/name", &root, 1);
    assert!(matches!(ClusterStore::connect(o.clone()), Err(ClusterError::Invalid(_))));
    o.name = "bad".into();
    o.replication = 0;
    assert!(matches!(ClusterStore::connect(o.clone()), Err(ClusterError::Invalid(_))));

    // An owner whose etcd is down, and one with a bad endpoint, exit with the reason.
    for (spec, why) in [(dead.as_str(), "unreachable"), ("etcd://", "invalid etcd endpoints")] {
        let out = Command::new(owner_binary())
            .args(["--data-dir", &root.join("x").display().to_string(), "--tcp", "127.0.0.1:0", "--no-ssd"])
            .args(["--dram-bytes", "32MiB", "--cluster", spec, "--cluster-name", "bad"])
            .env("KVTIDE_LOG", "error")
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(why), "{spec}: {stderr}");
    }
    // The same id as a live owner is refused (after waiting out one TTL for a dead holder).
    let mut twin = OwnerProc::start(&etcd, "bad", "a", &root.join("twin"));
    let status = twin.child.take().expect("child").wait_with_output().expect("wait");
    assert!(!status.status.success(), "a second owner under a live id must not start");

    // Garbage under the members prefix: skipped, reported, and the cluster still serves.
    let client = etcd.client();
    client.put(b"/kvtide/bad/owners/garbage", b"{not json", 0).expect("put garbage");
    client.put(b"/kvtide/bad/owners/liar", br#"{"id":"other","tcp":"127.0.0.1:1","generation":1}"#, 0).expect("put");
    cluster.refresh().expect("refresh");
    let invalid: HashMap<String, String> = cluster.invalid_members().into_iter().collect();
    assert_eq!(invalid.len(), 2, "{invalid:?}");
    assert!(invalid["/kvtide/bad/owners/garbage"].contains("not a member record"), "{invalid:?}");
    assert!(invalid["/kvtide/bad/owners/liar"].contains("under the key of"), "{invalid:?}");
    assert_eq!(cluster.members().len(), 1);
    assert_eq!(cluster.get(b"x"), Ok(b"value".to_vec()));
    assert_eq!(cluster.routing().invalid_members, 2);

    // `kvtide-owner cluster status` lists the member and the invalid entries.
    let out = Command::new(owner_binary())
        .args(["cluster", "status", "--cluster", &etcd.endpoint(), "--cluster-name", "bad"])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("1 member(s)") && text.contains(&format!("127.0.0.1:{}", a.tcp)), "{text}");
    assert!(text.contains("invalid entry /kvtide/bad/owners/garbage"), "{text}");
    let out = Command::new(owner_binary())
        .args(["cluster", "status", "--json", "--cluster", &etcd.endpoint(), "--cluster-name", "bad"])
        .output()
        .expect("status");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON status");
    assert_eq!(json["members"][0]["id"], "a");
    assert!(json["members"][0]["capacity_bytes"].as_u64().unwrap_or(0) >= 64 << 20, "{json}");
    let out = Command::new(owner_binary()).args(["cluster", "status", "--cluster", &dead]).output().expect("status");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("unreachable"));

    // A clean stop leaves the membership at once (lease revoked), not after the TTL.
    let started = Instant::now();
    a.stop();
    let left = wait_members(&cluster, &[], Duration::from_secs(TTL_S * 5));
    assert!(started.elapsed() < Duration::from_millis(TTL_S * 1000), "left after {left:?}");
    match cluster.get(b"x") {
        Err(Error::Disconnected(why)) => assert!(why.contains("no reachable owner"), "{why}"),
        other => panic!("{other:?}"),
    }
    let _ = std::fs::remove_dir_all(&a.dir);
}

fn the_owner_exports_its_membership_in_metrics() {
    let root = tmp("metrics");
    let Some(etcd) = EtcdServer::start(&root) else { return };
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let _owner = OwnerProc::start_with(&etcd, "m", "a", &root, &["--metrics-addr", &metrics]);
    let cluster = ClusterStore::connect(options(&etcd, "m", &root, 1)).expect("connect");
    wait_members(&cluster, &["a"], Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        use std::io::{Read, Write};
        let body = std::net::TcpStream::connect(("127.0.0.1", port)).ok().and_then(|mut s| {
            write!(s, "GET /metrics HTTP/1.1\r\nHost: k\r\n\r\n").ok()?;
            let mut t = String::new();
            s.read_to_string(&mut t).ok()?;
            Some(t)
        });
        let value = |name: &str| {
            body.as_deref().and_then(|b| {
                b.lines().find_map(|l| {
                    l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse::<f64>().ok())
                })
            })
        };
        if value("kvtide_cluster_registered") == Some(1.0)
            && value("kvtide_cluster_keepalives_total").unwrap_or(0.0) >= 1.0
        {
            assert_eq!(value("kvtide_cluster_registrations_total"), Some(1.0));
            assert_eq!(value("kvtide_cluster_lease_ttl_seconds"), Some(TTL_S as f64));
            break;
        }
        assert!(Instant::now() < deadline, "metrics: {body:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every test of this file, by name.
const TESTS: &[(&str, fn())] = &[
    (
        "every_store_operation_through_the_cluster_matches_the_embedded_engine",
        every_store_operation_through_the_cluster_matches_the_embedded_engine,
    ),
    ("replication_two_survives_sigkill_of_any_one_owner", replication_two_survives_sigkill_of_any_one_owner),
    (
        "a_paused_owner_leaves_when_its_lease_expires_and_returns_on_sigcont",
        a_paused_owner_leaves_when_its_lease_expires_and_returns_on_sigcont,
    ),
    (
        "an_owner_joining_during_a_load_keeps_every_answer_correct",
        an_owner_joining_during_a_load_keeps_every_answer_correct,
    ),
    ("clients_and_owners_ride_out_an_etcd_restart", clients_and_owners_ride_out_an_etcd_restart),
    ("bad_cluster_input_gives_clear_errors", bad_cluster_input_gives_clear_errors),
    ("the_owner_exports_its_membership_in_metrics", the_owner_exports_its_membership_in_metrics),
    ("a_cluster_client_reads_over_each_owners_ucx_plane", a_cluster_client_reads_over_each_owners_ucx_plane),
];

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let missing = etcd_binary().is_none();
    if missing {
        assert!(std::env::var_os("CI").is_none(), "etcd is required under CI (Debian package etcd-server)");
        eprintln!("cluster tests ignored: no etcd binary on PATH (install it: apt-get install etcd-server)");
    }
    let trials = TESTS
        .iter()
        .map(|&(name, test)| {
            libtest_mimic::Trial::test(name, move || {
                test();
                Ok(())
            })
            .with_ignored_flag(missing)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
