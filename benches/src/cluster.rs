//! `cluster`: a kvtide cluster on this host: an etcd (`etcd` on PATH) and 1, 2 and 3
//! `kvtide-owner` processes (each with its own shards and data directory) registered in it.
//!
//! - Throughput: `--clients` threads get (a prefilled working set), then put (new keys, inserted
//!   once as a KV cache writes its blocks), values of each size through one `ClusterStore`;
//!   aggregate ops/s, GB/s, p50 and p99 per owner count. Baseline in the same run: the same
//!   threads through a direct `RemoteStore` to one owner (the cluster client's extra cost is the
//!   1-owner cluster row against it, both measured twice, interleaved).
//! - Failover: after SIGKILL of one of 2 owners, the time until a put of a key placed on it is
//!   acknowledged (routed around), and until the membership drops it (lease TTL).
//! - Join: the share of keys that miss right after a third owner joins two, against 1/3.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::{PutOptions, Region, Store};
use kvtide_remote::{ClientOptions, ClusterOptions, ClusterStore, RemoteStore};

use crate::hist::Histogram;
use crate::util::{fmt_bytes, parse_size};

/// Arguments of `kvtide-bench cluster`.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Value sizes.
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Owner counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub owners: Vec<usize>,
    /// Client threads.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Measured seconds per phase.
    #[arg(long, default_value_t = 2.0)]
    pub duration_secs: f64,
    /// Bytes of distinct values per cell.
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// DRAM of each owner.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub dram_bytes: u64,
    /// Shards of each owner.
    #[arg(long, default_value_t = 2)]
    pub shards: usize,
    /// Lease TTL of the owners (seconds).
    #[arg(long, default_value_t = 3)]
    pub lease_ttl_s: u64,
    /// Reach the owners by TCP instead of their Unix sockets.
    #[arg(long)]
    pub tcp: bool,
    /// The kvtide-owner binary (default: next to this one).
    #[arg(long)]
    pub owner_bin: Option<PathBuf>,
    /// The etcd binary.
    #[arg(long, default_value = "etcd")]
    pub etcd: String,
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Harness {
    dir: PathBuf,
    etcd: String,
    owner_bin: PathBuf,
    args: ClusterArgs,
}

impl Harness {
    /// Starts etcd on free loopback ports; returns it and its endpoint once it answers.
    fn start_etcd(&self) -> Result<(Proc, String), String> {
        let (client, peer) = (free_port()?, free_port()?);
        let (c, p) = (format!("http://127.0.0.1:{client}"), format!("http://127.0.0.1:{peer}"));
        let child = Command::new(&self.args.etcd)
            .args(["--name", "b", "--data-dir", &self.dir.join("etcd").display().to_string()])
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args([
                "--listen-peer-urls",
                &p,
                "--initial-advertise-peer-urls",
                &p,
                "--initial-cluster",
                &format!("b={p}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {} (apt install etcd-server): {e}", self.args.etcd))?;
        let endpoint = format!("etcd://127.0.0.1:{client}");
        let proc = Proc(child);
        wait_etcd(&endpoint)?;
        Ok((proc, endpoint))
    }

    /// Starts owner `id` of cluster `name`; returns it and its Unix socket.
    fn start_owner(&self, name: &str, id: &str) -> Result<(Proc, PathBuf), String> {
        let dir = self.dir.join(name).join(id);
        let child = Command::new(&self.owner_bin)
            .args(["--data-dir", &dir.display().to_string(), "--tcp", &format!("127.0.0.1:{}", free_port()?)])
            .args(["--token-file", &self.dir.join("token").display().to_string(), "--no-ssd"])
            .args(["--dram-bytes", &self.args.dram_bytes.to_string(), "--shards", &self.args.shards.to_string()])
            .args(["--cluster", &self.etcd, "--cluster-name", name, "--cluster-id", id])
            .args(["--cluster-lease-ttl-s", &self.args.lease_ttl_s.to_string()])
            .env("KVTIDE_LOG", "error")
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.owner_bin.display()))?;
        Ok((Proc(child), dir.join("owner.sock")))
    }

    fn options(&self, name: &str) -> Result<ClusterOptions, String> {
        let mut o = ClusterOptions::new(&self.etcd, name).map_err(|e| e.to_string())?;
        o.client = self.client()?;
        o.unix_on_same_host = !self.args.tcp;
        o.wait_for_members_ms = 60_000;
        o.refresh_ms = 100;
        Ok(o)
    }

    fn client(&self) -> Result<ClientOptions, String> {
        ClientOptions { shared_memory: !self.args.tcp, ..ClientOptions::default() }
            .token_file(self.dir.join("token"))
            .map_err(|e| e.to_string())
    }

    /// Connects and waits until `count` owners are members.
    fn cluster(&self, name: &str, count: usize) -> Result<ClusterStore, String> {
        let store = ClusterStore::connect(self.options(name)?).map_err(|e| e.to_string())?;
        wait_members(&store, count)?;
        Ok(store)
    }
}

fn wait_members(store: &ClusterStore, count: usize) -> Result<Duration, String> {
    let started = Instant::now();
    while store.members().len() != count {
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!("{} members, expected {count}", store.members().len()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(started.elapsed())
}

struct Phase {
    /// Gets that missed (and refilled the key).
    misses: u64,
    ops: u64,
    secs: f64,
    hist: Histogram,
}

/// `clients` threads calling `op(thread, i)` until the deadline.
fn drive(
    clients: usize,
    duration: Duration,
    op: &(dyn Fn(usize, u64) -> Result<(), String> + Sync),
) -> Result<Phase, String> {
    let start = Instant::now();
    let deadline = start + duration;
    let parts: Vec<Result<(u64, Histogram), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                s.spawn(move || {
                    let (mut n, mut hist) = (0u64, Histogram::default());
                    while Instant::now() < deadline {
                        let t0 = Instant::now();
                        op(c, n)?;
                        hist.record(t0.elapsed().as_nanos() as u64);
                        n += 1;
                    }
                    Ok((n, hist))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("client panicked".into()))).collect()
    });
    let mut phase = Phase { misses: 0, ops: 0, secs: start.elapsed().as_secs_f64(), hist: Histogram::default() };
    for p in parts {
        let (n, h) = p?;
        phase.ops += n;
        phase.hist.merge(&h);
    }
    Ok(phase)
}

/// Put then get phases of `size`-byte values through `store`.
fn measure<S: Store>(store: &S, args: &ClusterArgs, size: u64, tag: &str) -> Result<(Phase, Phase), String>
where
    S::Error: std::fmt::Display + PartialEq<kvtide::Error>,
{
    let keys = ((args.working_set / size) as usize).max(2 * args.clients);
    let value: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(29).wrapping_add(3)).collect();
    let key = |k: usize| format!("{tag}/{size}/{k}").into_bytes();
    for k in 0..keys {
        store.put(&key(k), &value, PutOptions::UPSERT).map_err(|e| format!("prefill: {e}"))?;
    }
    let duration = Duration::from_secs_f64(args.duration_secs);
    let clients = args.clients;
    let bufs: Vec<std::sync::Mutex<Vec<u8>>> =
        (0..clients).map(|_| std::sync::Mutex::new(vec![0u8; size as usize])).collect();
    let misses = std::sync::atomic::AtomicU64::new(0);
    let get = drive(clients, duration, &|c, n| {
        let mut buf = bufs[c].lock().map_err(|_| "poisoned")?;
        let k = key((c * 7919 + n as usize) % keys);
        let got = match store.get_into(&k, Region::host(&mut buf)) {
            Ok(got) => got,
            // Evicted (the pool is full of earlier cells' puts): refill, as a cache user does.
            Err(e) if e == kvtide::Error::NotFound => {
                misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return store.put(&k, &value, PutOptions::UPSERT).map_err(|e| format!("refill: {e}"));
            }
            Err(e) => return Err(format!("get: {e}")),
        };
        if got as u64 != size || (n == 0 && *buf != value) {
            return Err(format!("wrong value for {}", String::from_utf8_lossy(&k)));
        }
        Ok(())
    })?;
    // Puts of new keys (a KV cache's writes: content-addressed blocks, inserted once), after
    // the gets, whose keys they may evict.
    let round = PUT_ROUND.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let put = drive(clients, duration, &|c, n| {
        let k = format!("{tag}/{size}/new/{round}/{c}/{n}").into_bytes();
        store.put(&k, &value, PutOptions::INSERT).map_err(|e| format!("put: {e}"))
    })?;
    let get = Phase { misses: misses.into_inner(), ..get };
    Ok((put, get))
}

/// Distinguishes the put keys of repeated measurements.
static PUT_ROUND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn rate(p: &Phase) -> f64 {
    p.ops as f64 / p.secs.max(1e-9)
}

/// The better of two phases (by ops/s).
fn best(a: Phase, b: Phase) -> Phase {
    if rate(&a) >= rate(&b) {
        a
    } else {
        b
    }
}

fn line(what: &str, size: u64, p: &Phase) -> String {
    let gbs = p.ops as f64 * size as f64 / 1e9 / p.secs.max(1e-9);
    format!(
        "| {what} | {} | {:.0} | {:.2} | {:.0} | {:.0} | {:.1} |",
        fmt_bytes(size),
        p.ops as f64 / p.secs.max(1e-9),
        gbs,
        p.hist.quantile_us(0.5),
        p.hist.quantile_us(0.99),
        100.0 * p.misses as f64 / p.ops.max(1) as f64
    )
}

/// Runs `kvtide-bench cluster`.
pub fn run(args: &ClusterArgs) -> Result<(), String> {
    if args.owners.iter().any(|&n| n == 0 || n > 8) || args.clients == 0 || args.sizes.is_empty() {
        return Err("--owners within 1..=8, --clients and --sizes non-empty".into());
    }
    let dir = std::env::temp_dir().join(format!("kvtide-bench-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    kvtide_remote::Token::load_or_create(&dir.join("token"))?;
    let owner_bin = match &args.owner_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("kvtide-owner"),
    };
    let mut h = Harness { dir: dir.clone(), etcd: String::new(), owner_bin, args: args.clone() };
    let (etcd, endpoint) = h.start_etcd()?;
    h.etcd = endpoint;
    println!(
        "## cluster: {} owners, {} client threads, sizes {}, {} s per phase, {} per owner, {} shards, {}, {} CPUs",
        args.owners.iter().map(|n| n.to_string()).collect::<Vec<_>>().join("/"),
        args.clients,
        args.sizes.iter().map(|s| fmt_bytes(*s)).collect::<Vec<_>>().join("/"),
        args.duration_secs,
        fmt_bytes(args.dram_bytes),
        args.shards,
        if args.tcp { "TCP" } else { "Unix sockets + shared memory" },
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    println!("\n| path | size | ops/s | GB/s | p50 us | p99 us | get misses % |\n|---|---|---:|---:|---:|---:|---:|");
    let mut overhead = Vec::new();
    for &n in &args.owners {
        let name = format!("tp{n}");
        let owners: Vec<(Proc, PathBuf)> =
            (0..n).map(|i| h.start_owner(&name, &format!("o{i}"))).collect::<Result<_, _>>()?;
        let cluster = h.cluster(&name, n)?;
        for &size in &args.sizes {
            if n != 1 {
                let (put, get) = measure(&cluster, args, size, "c")?;
                println!("{}", line(&format!("cluster {n} owners put"), size, &put));
                println!("{}", line(&format!("cluster {n} owners get"), size, &get));
                continue;
            }
            // The same owner through both clients in the order direct, cluster, cluster, direct
            // (each client first once and last once), the better run of each counting: neither
            // gets the warmer arena or the quieter moment by its place in the order.
            let address =
                if args.tcp { cluster.members()[0].tcp.clone() } else { format!("unix:{}", owners[0].1.display()) };
            let direct = RemoteStore::connect_with(&address, h.client()?).map_err(|e| e.to_string())?;
            let (dput1, dget1) = measure(&direct, args, size, "d")?;
            let (put1, get1) = measure(&cluster, args, size, "c")?;
            let (put2, get2) = measure(&cluster, args, size, "c")?;
            let (dput2, dget2) = measure(&direct, args, size, "d")?;
            let (put, get) = (best(put1, put2), best(get1, get2));
            let (dput, dget) = (best(dput1, dput2), best(dget1, dget2));
            println!("{}", line("cluster 1 owner put", size, &put));
            println!("{}", line("cluster 1 owner get", size, &get));
            println!("{}", line("direct RemoteStore put (baseline)", size, &dput));
            println!("{}", line("direct RemoteStore get (baseline)", size, &dget));
            overhead.push((size, rate(&put) / rate(&dput), rate(&get) / rate(&dget)));
        }
        drop(cluster);
        drop(owners);
    }
    for (size, put, get) in overhead {
        println!("cluster client over direct RemoteStore, {}: put x{put:.3}, get x{get:.3}", fmt_bytes(size));
    }

    // Failover: SIGKILL one of two owners.
    let (a, _) = h.start_owner("fo", "a")?;
    let (mut b, _) = h.start_owner("fo", "b")?;
    let cluster = Arc::new(h.cluster("fo", 2)?);
    let on_b: Vec<Vec<u8>> = (0..10_000u32)
        .map(|i| format!("fo/{i}").into_bytes())
        .filter(|k| cluster.placement(k)[0] == "b")
        .take(2000)
        .collect();
    for k in on_b.iter().take(10) {
        cluster.put(k, b"v", PutOptions::UPSERT).map_err(|e| e.to_string())?;
    }
    let killed = Instant::now();
    let _ = b.0.kill();
    let _ = b.0.wait();
    let mut i = 10;
    let rerouted = loop {
        if cluster.put(&on_b[i % on_b.len()], b"v", PutOptions::UPSERT).is_ok() {
            break killed.elapsed();
        }
        i += 1;
        if killed.elapsed() > Duration::from_secs(60) {
            return Err("puts never routed around the killed owner".into());
        }
    };
    wait_members(&cluster, 1)?;
    let dropped = killed.elapsed();
    println!(
        "\nSIGKILL of 1 of 2 owners: puts of its keys acknowledged after {:.1} ms; membership dropped it after {:.2} s \
         (lease TTL {} s, target <= TTL + 1 s)",
        rerouted.as_secs_f64() * 1e3,
        dropped.as_secs_f64(),
        args.lease_ttl_s
    );
    drop(cluster);
    drop(a);

    // Join: a third owner joins two.
    let (ja, _) = h.start_owner("join", "a")?;
    let (jb, _) = h.start_owner("join", "b")?;
    let cluster = h.cluster("join", 2)?;
    let keys: Vec<Vec<u8>> = (0..6000u32).map(|i| format!("j/{i}").into_bytes()).collect();
    for k in &keys {
        cluster.put(k, &[7u8; 4096], PutOptions::UPSERT).map_err(|e| e.to_string())?;
    }
    let (jc, _) = h.start_owner("join", "c")?;
    wait_members(&cluster, 3)?;
    let misses = cluster
        .batch_exists(&keys.iter().map(Vec::as_slice).collect::<Vec<_>>())
        .iter()
        .filter(|r| !matches!(r, Ok(true)))
        .count();
    println!(
        "join of a 3rd owner: {} of {} keys missed right after ({:.3}; expected 1/3 = 0.333)",
        misses,
        keys.len(),
        misses as f64 / keys.len() as f64
    );
    let routing = cluster.routing();
    println!("routing counters of the last client: {routing:?}");
    drop((ja, jb, jc, cluster));
    drop(etcd);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Waits until etcd at `endpoint` answers.
fn wait_etcd(endpoint: &str) -> Result<(), String> {
    let config = kvtide_remote::cluster::EtcdConfig::parse(endpoint).map_err(|e| e.to_string())?;
    let etcd = kvtide_remote::cluster::Etcd::new(config).map_err(|e| e.to_string())?;
    let started = Instant::now();
    while let Err(e) = etcd.get_prefix(b"/") {
        if started.elapsed() > Duration::from_secs(30) {
            return Err(format!("etcd did not start: {e}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
