//! `remote`: put and get throughput and p50/p99 latency of a `kvtide-owner` (run as a separate
//! process) through `RemoteStore`, over the Unix socket with shared memory and over TCP, for each
//! value size and client count. In the same run: Redis (`redis-server`, SET/GET through a small
//! RESP client, over TCP and over its Unix socket) with the same sizes, client counts, keys and
//! durations, and a plain `memcpy` of the same bytes, the limit of the shared-memory get path.
//! With `--transport ucx`: kvtide over its UCX plane against its own TCP path and raw UCX
//! (`ucx_perftest -t ucp_get`, one process pair per client, the same transports and sizes).
//!
//! Each client is a thread with its own connection. Put phase: each client upserts its own keys
//! in turn. Get phase: each client reads every key of the working set in turn into a reused
//! buffer (the values were written by the put phase). Keys: the working set divided by the value
//! size, at least two per client.

use std::io::{BufRead, BufReader, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtide::{PutOptions, Region, Store, StoreBuilder};
use kvtide_remote::{ClientOptions, Owner, OwnerConfig, RemoteStore};

use crate::hist::Histogram;
use crate::util::{fmt_bytes, json_str, parse_size};

/// Arguments of `kvtide-bench remote`.
#[derive(clap::Args, Debug, Clone)]
pub struct RemoteArgs {
    /// Value sizes.
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,16MiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Client counts.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub clients: Vec<usize>,
    /// Measured seconds per phase (put, get) per system and cell.
    #[arg(long, default_value_t = 2.0)]
    pub duration_secs: f64,
    /// Bytes of distinct values per cell (keys = this / size, at least 2 per client).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// DRAM pool of the owner (raised where a shard could not hold a cell's working set).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub dram_bytes: u64,
    /// Owner shards (default: one per CPU).
    #[arg(long)]
    pub shards: Option<usize>,
    /// The Redis server binary.
    #[arg(long, default_value = "redis-server")]
    pub redis_server: String,
    /// Only measure kvtide (and memcpy).
    #[arg(long)]
    pub skip_redis: bool,
    /// Keys per call. Above 1, kvtide's puts and gets are batched calls
    /// (`batch_put_from_multi_buffers`, `batch_get_into_multi_buffers`), Redis is skipped, and
    /// the baseline is memcpy of the same bytes.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Also print one JSON line per result.
    #[arg(long)]
    pub json: bool,
    /// Draw the get latency CDF of every system at the first size and client count into this
    /// SVG file.
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
    /// `all`: shared memory, Unix and TCP (and Redis); `ucx`: the UCX plane, TCP and raw
    /// `ucx_perftest` gets.
    #[arg(long, default_value = "all", value_parser = ["all", "ucx"])]
    pub transport: String,
    /// UCX transports of the plane and of `ucx_perftest` (`UCX_TLS`); tcp is allowed here.
    #[arg(long, default_value = "tcp")]
    pub ucx_tls: String,
    /// The `ucx_perftest` binary (Debian: ucx-utils).
    #[arg(long, default_value = "ucx_perftest")]
    pub ucx_perftest: String,
    /// UCX workers of the owner's plane (0: the owner's default, one per CPU up to 16).
    #[arg(long, default_value_t = 0)]
    pub ucx_workers: usize,
}

/// Arguments of the hidden `remote-owner` subcommand (the owner process of `remote`).
#[derive(clap::Args, Debug, Clone)]
pub struct RemoteOwnerArgs {
    #[arg(long)]
    pub unix: PathBuf,
    #[arg(long, default_value = "127.0.0.1:0")]
    pub tcp: SocketAddr,
    #[arg(long, value_parser = parse_size)]
    pub dram_bytes: u64,
    #[arg(long)]
    pub shards: Option<usize>,
    /// Connections served at once (the owner's default when left out).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Serve the UCX plane over these transports (tcp allowed).
    #[arg(long)]
    pub ucx: Option<String>,
    /// UCX workers of the plane (0: the owner's default).
    #[arg(long, default_value_t = 0)]
    pub ucx_workers: usize,
}

/// Runs the owner until its stdin closes; prints `READY <tcp addr>` once serving.
pub fn run_owner(args: &RemoteOwnerArgs) -> Result<(), String> {
    // KVTIDE_* variables tune engine settings that have no flag here (KVTIDE_RUNTIME_IDLE_SPIN_US, ...).
    let mut builder =
        StoreBuilder::new().with_env().map_err(|e| e.to_string())?.dram_bytes(args.dram_bytes).read_index(true);
    builder.runtime.shards = args.shards;
    let engine = Arc::new(builder.open().map_err(|e| format!("open: {e}"))?);
    let config = OwnerConfig {
        unix_socket: Some(args.unix.clone()),
        tcp: Some(args.tcp),
        // Loopback benchmark: the token handshake costs one round trip per connection only.
        allow_unauthenticated_loopback: true,
        max_connections: args.max_connections.unwrap_or(OwnerConfig::default().max_connections),
        ucx_transports: args.ucx.clone(),
        ucx_allow_tcp: true,
        ucx_workers: args.ucx_workers,
        // This binary hosts the plane's process (`main` hands it the argument).
        ucx_program: Some(std::env::current_exe().map_err(|e| e.to_string())?),
        ..OwnerConfig::default()
    };
    if args.max_connections.is_some() {
        kvtide_remote::raise_descriptor_limit().map_err(|e| format!("descriptor limit: {e}"))?;
    }
    let owner = Owner::start(Arc::clone(&engine), config).map_err(|e| e.to_string())?;
    let addr = owner.tcp_addr().ok_or("no tcp address")?;
    println!("READY {addr}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    owner.shutdown();
    drop(owner);
    engine.shutdown();
    Ok(())
}

/// A connection of one system.
trait Client: Send {
    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), String>;
    /// Reads `key` into `buf` (value-sized); returns the length.
    fn get(&mut self, key: &[u8], buf: &mut [u8]) -> Result<usize, String>;
    /// Puts `value` under every key, in one call where the system has one.
    /// Puts `values[i]` under `keys[i]`, in one call where the system has one.
    fn put_batch(&mut self, keys: &[&[u8]], values: &[Vec<u8>]) -> Result<(), String> {
        keys.iter().zip(values).try_for_each(|(k, v)| self.put(k, v))
    }
    /// Reads `keys[i]` into `bufs[i]` (value-sized), in one call where the system has one.
    fn get_batch(&mut self, keys: &[&[u8]], bufs: &mut [Vec<u8>]) -> Result<(), String> {
        keys.iter().zip(bufs.iter_mut()).try_for_each(|(k, b)| self.get(k, b).map(|_| ()))
    }
}

struct Kvtide(RemoteStore);

impl Client for Kvtide {
    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.0.put(key, value, PutOptions::UPSERT).map_err(|e| e.to_string())
    }
    fn get(&mut self, key: &[u8], buf: &mut [u8]) -> Result<usize, String> {
        self.0.get_into(key, Region::host(buf)).map_err(|e| e.to_string())
    }
    fn put_batch(&mut self, keys: &[&[u8]], values: &[Vec<u8>]) -> Result<(), String> {
        let sources: Vec<Vec<Region<'_>>> = values.iter().map(|v| vec![Region::host_readonly(v)]).collect();
        self.0
            .batch_put_from_multi_buffers(keys, &sources, PutOptions::UPSERT)
            .into_iter()
            .try_for_each(|r| r.map_err(|e| e.to_string()))
    }
    fn get_batch(&mut self, keys: &[&[u8]], bufs: &mut [Vec<u8>]) -> Result<(), String> {
        let dsts: Vec<Vec<Region<'_>>> = bufs.iter_mut().map(|b| vec![Region::host(b)]).collect();
        self.0
            .batch_get_into_multi_buffers(keys, &dsts)
            .into_iter()
            .try_for_each(|r| r.map(|_| ()).map_err(|e| e.to_string()))
    }
}

/// A minimal RESP2 client: SET and GET, values written and read without extra copies.
struct Redis<S: Read + Write> {
    reader: BufReader<S>,
    line: String,
}

impl<S: Read + Write> Redis<S> {
    fn new(stream: S) -> Self {
        Redis { reader: BufReader::with_capacity(64 << 10, stream), line: String::new() }
    }

    fn read_line(&mut self) -> Result<&str, String> {
        self.line.clear();
        self.reader.read_line(&mut self.line).map_err(|e| e.to_string())?;
        if self.line.is_empty() {
            return Err("redis closed the connection".into());
        }
        Ok(self.line.trim_end())
    }

    /// Sends one command; arguments are sent from the caller's memory (no copy of a value).
    fn command(&mut self, parts: &[&[u8]]) -> Result<(), String> {
        let prefixes: Vec<Vec<u8>> = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let head = if i == 0 { format!("*{}\r\n", parts.len()) } else { String::new() };
                format!("{head}${}\r\n", p.len()).into_bytes()
            })
            .collect();
        let mut slices = Vec::with_capacity(parts.len() * 3);
        for (prefix, part) in prefixes.iter().zip(parts) {
            slices.push(IoSlice::new(prefix));
            slices.push(IoSlice::new(part));
            slices.push(IoSlice::new(b"\r\n"));
        }
        let stream = self.reader.get_mut();
        let mut slices: &mut [IoSlice<'_>] = &mut slices;
        while !slices.is_empty() {
            let n = stream.write_vectored(slices).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("redis accepted no bytes".into());
            }
            IoSlice::advance_slices(&mut slices, n);
        }
        Ok(())
    }
}

impl<S: Read + Write + Send> Client for Redis<S> {
    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.command(&[b"SET", key, value])?;
        let line = self.read_line()?;
        if line == "+OK" {
            Ok(())
        } else {
            Err(format!("SET: {line}"))
        }
    }

    fn get(&mut self, key: &[u8], buf: &mut [u8]) -> Result<usize, String> {
        self.command(&[b"GET", key])?;
        let line = self.read_line()?;
        let len: i64 = line.strip_prefix('$').and_then(|n| n.parse().ok()).ok_or_else(|| format!("GET: {line}"))?;
        if len < 0 {
            return Err("GET: missing key".into());
        }
        let len = len as usize;
        let dst = buf.get_mut(..len).ok_or("GET: value larger than the buffer")?;
        self.reader.read_exact(dst).map_err(|e| e.to_string())?;
        let mut crlf = [0u8; 2];
        self.reader.read_exact(&mut crlf).map_err(|e| e.to_string())?;
        Ok(len)
    }
}

/// How to open one client of a system.
#[derive(Clone)]
enum System {
    KvtideShm(String),
    /// The same Unix socket with `shared_memory: false`: values stream through the socket.
    KvtideUnix(String),
    KvtideTcp(String),
    /// TCP control connection, bytes over the UCX plane with these transports.
    KvtideUcx(String, String),
    RedisTcp(SocketAddr),
    RedisUnix(PathBuf),
}

impl System {
    fn name(&self) -> &'static str {
        match self {
            System::KvtideShm(_) => "kvtide unix+shm",
            System::KvtideUnix(_) => "kvtide unix",
            System::KvtideTcp(_) => "kvtide tcp",
            System::KvtideUcx(..) => "kvtide ucx",
            System::RedisTcp(_) => "redis tcp",
            System::RedisUnix(_) => "redis unix",
        }
    }

    fn connect(&self) -> Result<Box<dyn Client>, String> {
        Ok(match self {
            System::KvtideShm(addr) => {
                // KVTIDE_READ_INDEX=0 measures the leased path alone.
                let options = ClientOptions::from_env().map_err(|e| e.to_string())?;
                let store = RemoteStore::connect_with(addr, options).map_err(|e| e.to_string())?;
                if !store.uses_shared_memory() {
                    return Err("the owner did not share its arena".into());
                }
                Box::new(Kvtide(store))
            }
            System::KvtideUnix(addr) => {
                let options = ClientOptions { shared_memory: false, ..ClientOptions::default() };
                Box::new(Kvtide(RemoteStore::connect_with(addr, options).map_err(|e| e.to_string())?))
            }
            System::KvtideTcp(addr) => {
                Box::new(Kvtide(RemoteStore::connect_with(addr, ClientOptions::default()).map_err(|e| e.to_string())?))
            }
            System::KvtideUcx(addr, tls) => {
                let options = ClientOptions {
                    ucx_transports: Some(tls.clone()),
                    ucx_allow_tcp: true,
                    ..ClientOptions::default()
                };
                let store = RemoteStore::connect_with(addr, options).map_err(|e| e.to_string())?;
                if store.data_plane() != kvtide_remote::DataPlane::Ucx {
                    return Err("the client did not attach to the owner's UCX plane".into());
                }
                Box::new(Kvtide(store))
            }
            System::RedisTcp(addr) => {
                let s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                Box::new(Redis::new(s))
            }
            System::RedisUnix(path) => Box::new(Redis::new(UnixStream::connect(path).map_err(|e| e.to_string())?)),
        })
    }
}

/// One phase's merged results.
#[derive(Default, Clone)]
pub(crate) struct Phase {
    pub(crate) ops: u64,
    pub(crate) bytes: u64,
    pub(crate) secs: f64,
    pub(crate) hist: Histogram,
}

impl Phase {
    fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.secs.max(1e-9)
    }
    fn gb_per_sec(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.secs.max(1e-9)
    }
}

pub(crate) struct Row {
    pub(crate) size: u64,
    pub(crate) clients: usize,
    pub(crate) system: &'static str,
    pub(crate) put: Option<Phase>,
    pub(crate) get: Phase,
}

fn key_of(size: u64, k: usize) -> Vec<u8> {
    format!("bench/{size}/{k:06}").into_bytes()
}

/// Runs `clients` threads of `work` for `duration`; each returns (ops, bytes, histogram).
fn drive<F>(clients: usize, duration: Duration, work: F) -> Result<Phase, String>
where
    F: Fn(usize, Instant) -> Result<(u64, u64, Histogram), String> + Sync,
{
    let start = Instant::now();
    let deadline = start + duration;
    let parts: Vec<Result<(u64, u64, Histogram), String>> = std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = (0..clients).map(|c| scope.spawn(move || work(c, deadline))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("client thread panicked".into()))).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let mut phase = Phase { secs, ..Phase::default() };
    for p in parts {
        let (ops, bytes, hist) = p?;
        phase.ops += ops;
        phase.bytes += bytes;
        phase.hist.merge(&hist);
    }
    Ok(phase)
}

fn measure(
    system: &System,
    size: u64,
    clients: usize,
    keys: usize,
    batch: usize,
    duration: Duration,
) -> Result<Row, String> {
    let value: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(7)).collect();
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(std::sync::Mutex::new(system.connect()?));
    }
    // Every key exists before the measured phases.
    {
        let mut first = conns[0].lock().map_err(|_| "poisoned")?;
        for k in 0..keys {
            first.put(&key_of(size, k), &value).map_err(|e| format!("{} prefill: {e}", system.name()))?;
        }
    }
    let put = drive(clients, duration, |c, deadline| {
        let mut conn = conns[c].lock().map_err(|_| "poisoned")?;
        let mine: Vec<Vec<u8>> = (c..keys).step_by(clients).map(|k| key_of(size, k)).collect();
        // Each client's values in buffers of its own (clients are processes of their own), and a
        // batch's in one buffer each, as a caller saving distinct blocks has them.
        let values: Vec<Vec<u8>> = (0..batch).map(|_| value.clone()).collect();
        let (mut ops, mut hist) = (0u64, Histogram::default());
        while Instant::now() < deadline {
            let picked: Vec<&[u8]> = (0..batch).map(|j| mine[(ops as usize + j) % mine.len()].as_slice()).collect();
            let t0 = Instant::now();
            if batch == 1 { conn.put(picked[0], &values[0]) } else { conn.put_batch(&picked, &values) }
                .map_err(|e| format!("{} put: {e}", system.name()))?;
            hist.record(t0.elapsed().as_nanos() as u64);
            ops += batch as u64;
        }
        Ok((ops, ops * size, hist))
    })?;
    let get = drive(clients, duration, |c, deadline| {
        let mut conn = conns[c].lock().map_err(|_| "poisoned")?;
        let mut bufs: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; size as usize]).collect();
        // Keys made before the clock starts: formatting them is no part of a get.
        let names: Vec<Vec<u8>> = (0..keys).map(|k| key_of(size, k)).collect();
        let (mut ops, mut hist) = (0u64, Histogram::default());
        while Instant::now() < deadline {
            let refs: Vec<&[u8]> = (0..batch).map(|j| names[(c * 7919 + ops as usize + j) % keys].as_slice()).collect();
            let t0 = Instant::now();
            if batch == 1 {
                let n = conn.get(refs[0], &mut bufs[0]).map_err(|e| format!("{} get: {e}", system.name()))?;
                if n as u64 != size {
                    return Err(format!("{}: wrong length for {}", system.name(), String::from_utf8_lossy(refs[0])));
                }
            } else {
                conn.get_batch(&refs, &mut bufs).map_err(|e| format!("{} get: {e}", system.name()))?;
            }
            hist.record(t0.elapsed().as_nanos() as u64);
            if ops == 0 && bufs.iter().any(|b| *b != value) {
                return Err(format!("{}: wrong value for {}", system.name(), String::from_utf8_lossy(refs[0])));
            }
            ops += batch as u64;
        }
        Ok((ops, ops * size, hist))
    })?;
    Ok(Row { size, clients, system: system.name(), put: Some(put), get })
}

/// `memcpy` of `size`-byte values (from `batch` buffers in turn, as the systems' calls take them)
/// into successive slots of a working set of the systems' size (split among the threads): the one
/// copy an embedded put makes, which a put through the owner can at best reach. The destination is
/// touched once before the clock starts.
fn memcpy_put_row(
    size: u64,
    clients: usize,
    batch: usize,
    working_set: u64,
    duration: Duration,
) -> Result<Row, String> {
    let slots = (working_set / clients as u64 / size).max(2) as usize;
    let mut arenas: Vec<std::sync::Mutex<Vec<u8>>> =
        (0..clients).map(|_| std::sync::Mutex::new(vec![1u8; slots * size as usize])).collect();
    let put = drive(clients, duration, |c, deadline| {
        let values: Vec<Vec<u8>> = (0..batch).map(|_| vec![7u8; size as usize]).collect();
        let mut arena = arenas[c].lock().map_err(|_| "poisoned")?;
        let (mut ops, mut hist) = (0u64, Histogram::default());
        while Instant::now() < deadline {
            let at = (ops as usize % slots) * size as usize;
            let t0 = Instant::now();
            arena[at..at + size as usize].copy_from_slice(&values[ops as usize % batch]);
            std::hint::black_box(&mut arena[at]);
            hist.record(t0.elapsed().as_nanos() as u64);
            ops += 1;
        }
        Ok((ops, ops * size, hist))
    })?;
    arenas.clear();
    Ok(Row { size, clients, system: "memcpy into a working set", put: Some(put), get: Phase::default() })
}

/// `memcpy` of `size`-byte values from a working set of the same size as the systems' (split
/// among the threads) into a reused buffer, on `clients` threads: what the shared-memory get path can at best reach.
fn memcpy_row(size: u64, clients: usize, batch: usize, working_set: u64, duration: Duration) -> Result<Row, String> {
    let per_thread_values = (working_set / clients as u64 / size).max(2) as usize;
    let get = drive(clients, duration, |_, deadline| {
        let src: Vec<Vec<u8>> = (0..per_thread_values).map(|i| vec![i as u8; size as usize]).collect();
        // As many destinations as one call of the systems fills: a batch's buffers are not all
        // in cache, a single value's is.
        let mut dst: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; size as usize]).collect();
        let (mut ops, mut hist) = (0u64, Histogram::default());
        while Instant::now() < deadline {
            let t0 = Instant::now();
            let d = &mut dst[ops as usize % batch];
            d.copy_from_slice(&src[ops as usize % src.len()]);
            std::hint::black_box(d);
            hist.record(t0.elapsed().as_nanos() as u64);
            ops += 1;
        }
        Ok((ops, ops * size, hist))
    })?;
    Ok(Row { size, clients, system: "memcpy (best of 2)", put: None, get })
}

struct RedisServer {
    child: Child,
    tcp: SocketAddr,
    unix: PathBuf,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis(binary: &str, dir: &Path) -> Result<RedisServer, String> {
    // A free port: bind, read it, release it for redis.
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let unix = dir.join("redis.sock");
    let child = Command::new(binary)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--protected-mode", "no", "--daemonize", "no", "--unixsocketperm", "700", "--loglevel", "warning"])
        .arg("--unixsocket")
        .arg(&unix)
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {binary} ({e}); install it with `apt-get install -y redis-server`"))?;
    let server = RedisServer { child, tcp: SocketAddr::from(([127, 0, 0, 1], port)), unix };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(s) = TcpStream::connect(server.tcp) {
            let mut r = Redis::new(s);
            if r.command(&[b"PING"]).is_ok() && r.read_line().map(|l| l == "+PONG").unwrap_or(false) {
                break;
            }
        }
        if Instant::now() > deadline {
            return Err("redis-server did not answer PING".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(server)
}

struct OwnerProcess {
    child: Child,
    unix: PathBuf,
    tcp: SocketAddr,
}

impl Drop for OwnerProcess {
    fn drop(&mut self) {
        drop(self.child.stdin.take()); // EOF: the owner shuts down
        let _ = self.child.wait();
    }
}

/// The owner's DRAM: `--dram-bytes`, raised so that every shard could hold a cell's whole
/// working set and one upsert in flight per client of the largest value. Keys hash unevenly
/// and an upsert holds its new copy beside the old until it commits, so with many shards (one
/// per CPU) and large values a pool sized for the working set alone evicts keys the gets then
/// miss.
fn owner_dram_bytes(args: &RemoteArgs) -> u64 {
    let shards = args.shards.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())) as u64;
    let clients = args.clients.iter().copied().max().unwrap_or(1);
    let need = args
        .sizes
        .iter()
        .map(|&size| {
            let keys = ((args.working_set / size.max(1)) as usize).max(2 * clients * args.batch);
            shards * (keys + clients * args.batch) as u64 * size
        })
        .max()
        .unwrap_or(0);
    args.dram_bytes.max(need)
}

fn start_owner(args: &RemoteArgs, dir: &Path) -> Result<OwnerProcess, String> {
    let unix = dir.join("owner.sock");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.arg("remote-owner").arg("--unix").arg(&unix).arg("--dram-bytes").arg(owner_dram_bytes(args).to_string());
    if let Some(s) = args.shards {
        cmd.arg("--shards").arg(s.to_string());
    }
    if args.transport == "ucx" {
        cmd.arg("--ucx").arg(&args.ucx_tls).arg("--ucx-workers").arg(args.ucx_workers.to_string());
    }
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().map_err(|e| e.to_string())?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).map_err(|e| e.to_string())?;
    let tcp = line
        .trim()
        .strip_prefix("READY ")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("owner did not start: {line:?}"))?;
    Ok(OwnerProcess { child, unix, tcp })
}

/// Runs `kvtide-bench remote`.
pub fn run(args: &RemoteArgs) -> Result<(), String> {
    if args.sizes.is_empty() || args.clients.is_empty() || args.clients.contains(&0) {
        return Err("--sizes and --clients must be non-empty and positive".into());
    }
    let dir = std::env::temp_dir().join(format!("kvtide-bench-remote-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let owner = start_owner(args, &dir)?;
    if args.batch == 0 {
        return Err("--batch must be positive".into());
    }
    let ucx = args.transport == "ucx";
    let redis =
        if ucx || args.skip_redis || args.batch > 1 { None } else { Some(start_redis(&args.redis_server, &dir)?) };
    let duration = Duration::from_secs_f64(args.duration_secs.max(0.1));
    println!(
        "## remote: sizes {}, clients {:?}, {} keys per call, {} s per phase, working set {}, owner DRAM {}, {} CPUs",
        args.sizes.iter().map(|s| fmt_bytes(*s)).collect::<Vec<_>>().join("/"),
        args.clients,
        args.batch,
        args.duration_secs,
        fmt_bytes(args.working_set),
        fmt_bytes(owner_dram_bytes(args)),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let unix = format!("unix:{}", owner.unix.display());
    let mut systems = if ucx {
        vec![System::KvtideUcx(owner.tcp.to_string(), args.ucx_tls.clone()), System::KvtideTcp(owner.tcp.to_string())]
    } else {
        vec![System::KvtideShm(unix.clone()), System::KvtideUnix(unix), System::KvtideTcp(owner.tcp.to_string())]
    };
    if let Some(r) = &redis {
        systems.push(System::RedisUnix(r.unix.clone()));
        systems.push(System::RedisTcp(r.tcp));
    }
    let mut rows = Vec::new();
    let bar = crate::util::steps((args.sizes.len() * args.clients.len()) as u64, "remote: cells");
    for &size in &args.sizes {
        for &clients in &args.clients {
            bar.set_message(format!("{} x{clients}", fmt_bytes(size)));
            let keys = ((args.working_set / size) as usize).max(2 * clients * args.batch);
            // The limit is measured before and after the systems; the better run counts, so a
            // burst of other load on the machine cannot make the limit look low.
            let before = memcpy_row(size, clients, args.batch, args.working_set, duration)?;
            for system in &systems {
                eprintln!("  {} x{clients} {} ...", system.name(), fmt_bytes(size));
                rows.push(measure(system, size, clients, keys, args.batch, duration)?);
            }
            if ucx {
                let kvtide_rate = rows
                    .iter()
                    .find(|r| r.size == size && r.clients == clients && r.system == "kvtide ucx")
                    .map_or(100.0, |r| r.get.ops_per_sec());
                rows.push(crate::ucx_perftest::get_row(args, size, clients, kvtide_rate, duration)?);
            }
            let after = memcpy_row(size, clients, args.batch, args.working_set, duration)?;
            rows.push(if after.get.ops_per_sec() > before.get.ops_per_sec() { after } else { before });
            rows.push(memcpy_put_row(size, clients, args.batch, args.working_set, duration)?);
            bar.inc(1);
            if let Some(r) = &redis {
                // Free redis memory between cells.
                if let Ok(s) = TcpStream::connect(r.tcp) {
                    let mut c = Redis::new(s);
                    let _ = c.command(&[b"FLUSHALL"]).and_then(|()| c.read_line().map(|_| ()));
                }
            }
        }
    }
    bar.finish_and_clear();
    drop(owner);
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
    print_table(&rows, args.json);
    if let Some(path) = &args.plot {
        let (size, clients) = (args.sizes[0], args.clients[0]);
        let series: Vec<(String, &Histogram)> = rows
            .iter()
            .filter(|r| r.size == size && r.clients == clients && r.get.hist.count() > 0)
            .map(|r| (r.system.to_string(), &r.get.hist))
            .collect();
        let title = format!("get latency, {} values, {clients} client(s), {} per call", fmt_bytes(size), args.batch);
        crate::plot::latency_cdfs(path, &title, &series)?;
        println!("latency CDFs: {}", path.display());
    }
    Ok(())
}

fn print_table(rows: &[Row], json: bool) {
    println!();
    println!("| value | clients | system | put ops/s | put GB/s | put p50 / p99 µs | get ops/s | get GB/s | get p50 / p99 µs |");
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let put = r.put.as_ref().map_or_else(
            || "–| – | –".to_string(),
            |p| {
                format!(
                    "{:.0} | {:.2} | {:.0} / {:.0}",
                    p.ops_per_sec(),
                    p.gb_per_sec(),
                    p.hist.quantile_us(0.5),
                    p.hist.quantile_us(0.99)
                )
            },
        );
        println!(
            "| {} | {} | {} | {} | {:.0} | {:.2} | {:.1} / {:.1} |",
            fmt_bytes(r.size),
            r.clients,
            r.system,
            put,
            r.get.ops_per_sec(),
            r.get.gb_per_sec(),
            r.get.hist.quantile_us(0.5),
            r.get.hist.quantile_us(0.99)
        );
        if json {
            let p = r.put.clone().unwrap_or_default();
            println!(
                "{{\"bench\":\"remote\",\"value_bytes\":{},\"clients\":{},\"system\":{},\"put_ops_per_sec\":{:.1},\
                 \"put_p50_us\":{:.1},\"put_p99_us\":{:.1},\"get_ops_per_sec\":{:.1},\"get_gb_per_sec\":{:.3},\
                 \"get_p50_us\":{:.1},\"get_p99_us\":{:.1}}}",
                r.size,
                r.clients,
                json_str(r.system),
                p.ops_per_sec(),
                p.hist.quantile_us(0.5),
                p.hist.quantile_us(0.99),
                r.get.ops_per_sec(),
                r.get.gb_per_sec(),
                r.get.hist.quantile_us(0.5),
                r.get.hist.quantile_us(0.99)
            );
        }
    }
    if rows.iter().any(|r| r.system == crate::ucx_perftest::SYSTEM) {
        print_ucx_ratios(rows);
        return;
    }
    println!();
    println!("Ratios (same run; > 1 means kvtide is faster):");
    println!("| value | clients | shm get / memcpy | shm put / memcpy into a working set | shm get / redis unix get | tcp get / redis tcp get | shm put / redis unix put | tcp put / redis tcp put |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let find = |size: u64, clients: usize, system: &str| {
        rows.iter().find(|r| r.size == size && r.clients == clients && r.system == system)
    };
    let mut cells: Vec<(u64, usize)> = rows.iter().map(|r| (r.size, r.clients)).collect();
    cells.dedup();
    for (size, clients) in cells {
        let get = |s: &str| find(size, clients, s).map(|r| r.get.ops_per_sec());
        let put = |s: &str| find(size, clients, s).and_then(|r| r.put.as_ref().map(Phase::ops_per_sec));
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "–".into(),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            fmt_bytes(size),
            clients,
            ratio(get("kvtide unix+shm"), get("memcpy (best of 2)")),
            ratio(put("kvtide unix+shm"), put("memcpy into a working set")),
            ratio(get("kvtide unix+shm"), get("redis unix")),
            ratio(get("kvtide tcp"), get("redis tcp")),
            ratio(put("kvtide unix+shm"), put("redis unix")),
            ratio(put("kvtide tcp"), put("redis tcp")),
        );
    }
}

/// The UCX plane's ratios: kvtide over UCX against raw UCX gets and against its own TCP path.
fn print_ucx_ratios(rows: &[Row]) {
    println!();
    println!("Ratios (same run; get throughput):");
    println!("| value | clients | kvtide ucx / ucx_perftest ucp_get | kvtide ucx / kvtide tcp |");
    println!("|---|---|---:|---:|");
    let get = |size: u64, clients: usize, system: &str| {
        rows.iter().find(|r| r.size == size && r.clients == clients && r.system == system).map(|r| r.get.gb_per_sec())
    };
    let mut cells: Vec<(u64, usize)> = rows.iter().map(|r| (r.size, r.clients)).collect();
    cells.dedup();
    for (size, clients) in cells {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "–".into(),
        };
        let ucx = get(size, clients, "kvtide ucx");
        println!(
            "| {} | {} | {} | {} |",
            fmt_bytes(size),
            clients,
            ratio(ucx, get(size, clients, crate::ucx_perftest::SYSTEM)),
            ratio(ucx, get(size, clients, "kvtide tcp")),
        );
    }
}
