//! The owner's HTTP listener, against the real `kvtide-owner` binary with a real HTTP client
//! (ureq): every route and its answers, 404 and 405, the drain (`/ready` 503, new connections
//! refused, a half-sent put finishing, the process still running), `/ready` turning 503 when a
//! stop begins, a slow, oversized or flooding client not holding the listener, and the default
//! address taken by another owner.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvtide::{PutOptions, Store};
use kvtide_remote::protocol::{frame, FrameHeader, Hello, Op, PutHead, HEADER_BYTES, NONCE_BYTES, PROTOCOL_VERSION};
use kvtide_remote::RemoteStore;

fn owner_binary() -> &'static str {
    env!("CARGO_BIN_EXE_kvtide-owner")
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvtide-http-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("dir");
    p
}

/// `kvtide-owner` on `dir` (Unix socket only, 2 shards, DRAM 64 MiB, info log piped) with `args`
/// added.
fn owner_command(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(owner_binary());
    command
        .args(["--data-dir", &dir.display().to_string(), "--tcp", "off", "--dram-bytes", "64MiB", "--shards", "2"])
        .args(args)
        .env("KVTIDE_LOG", "info")
        .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

/// A running `kvtide-owner` (killed when dropped), its HTTP address (read from its log line) and
/// its log so far.
struct Running {
    child: Option<Child>,
    http: SocketAddr,
    log: Arc<Mutex<String>>,
    dir: PathBuf,
}

impl Running {
    /// Starts the owner (`owner_command`) with `args` added (an `--http-addr` among them) and
    /// waits for its HTTP listener's log line.
    fn start(dir: &Path, args: &[&str]) -> Running {
        let mut child = owner_command(dir, args).spawn().expect("spawn kvtide-owner");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().expect("stderr");
        let collected = Arc::clone(&log);
        // Reads the log to its end (a full pipe would stall the owner), handing over the address.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("http_addr=").nth(1).and_then(|rest| rest.split_whitespace().next()) {
                    let _ = tx.send(addr.to_string());
                }
                collected.lock().expect("log").push_str(&(line + "\n"));
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("no `http_addr=` log line: {}", log.lock().expect("log"))
        });
        let mut http: SocketAddr = addr.parse().expect("the logged address parses");
        if http.ip().is_unspecified() {
            http.set_ip([127, 0, 0, 1].into());
        }
        Running { child: Some(child), http, log, dir: dir.to_path_buf() }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("owner.sock")
    }

    /// Polls `/ready` until 200; every earlier answer must be 503 "starting" while `/health`
    /// answers 200.
    fn wait_ready(&self) -> Duration {
        let started = Instant::now();
        loop {
            let (status, body) = get(&self.url("/ready"));
            if status == 200 {
                assert_eq!(body, "ready\n");
                return started.elapsed();
            }
            assert_eq!(status, 503, "{body}");
            assert!(body.starts_with("starting"), "{body}");
            assert_eq!(get(&self.url("/health")).0, 200);
            assert!(started.elapsed() < Duration::from_secs(60), "never ready");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the owner reserved room for a put whose value has not all arrived (it is in
    /// flight, not a connection waiting for its next request).
    fn wait_for_a_put_in_flight(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while sample(&get(&self.url("/metrics")).1, "kvtide_writes_in_flight") < Some(1.0) {
            assert!(Instant::now() < deadline, "the owner never started the put");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, and the exit status.
    fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill with a valid pid of our own child and a valid signal.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        child.wait().expect("reap")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// `GET url`: the status and the body.
fn get(url: &str) -> (u16, String) {
    let mut answer = agent().get(url).call().unwrap_or_else(|e| panic!("GET {url}: {e}"));
    (answer.status().as_u16(), answer.body_mut().read_to_string().expect("body"))
}

fn post(url: &str) -> (u16, String) {
    let mut answer = agent().post(url).send_empty().unwrap_or_else(|e| panic!("POST {url}: {e}"));
    (answer.status().as_u16(), answer.body_mut().read_to_string().expect("body"))
}

/// The value of the sample `name` (labels included, as written) in Prometheus text.
fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

/// A raw protocol connection holding a put half sent: the owner has a request in flight.
struct HalfSentPut {
    stream: UnixStream,
    rest: Vec<u8>,
}

impl HalfSentPut {
    fn start(socket: &Path, key: &[u8], value_bytes: usize) -> HalfSentPut {
        let mut stream = UnixStream::connect(socket).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut hello = Vec::new();
        Hello { client_nonce: [5; NONCE_BYTES], flags: 0 }.encode(&mut hello);
        stream.write_all(&frame(Op::Hello, 0, &hello)).expect("hello");
        assert_eq!(read_frame(&mut stream).expect("hello reply").op, Op::HelloOk);
        let value = vec![7u8; value_bytes];
        let mut put = Vec::new();
        PutHead::encode(&mut put, false, false, key, value.len() as u64);
        put.extend_from_slice(key);
        put.extend_from_slice(&value[..value_bytes / 2]);
        stream.write_all(&frame(Op::Put, 1, &put)).expect("half a put");
        HalfSentPut { stream, rest: value[value_bytes / 2..].to_vec() }
    }

    /// Sends the rest; the owner's reply.
    fn finish(mut self) -> Op {
        self.stream.write_all(&frame(Op::Data, 1, &self.rest)).expect("the rest of the put");
        read_frame(&mut self.stream).expect("the put's reply").op
    }
}

fn read_frame(stream: &mut UnixStream) -> Option<FrameHeader> {
    let mut header = [0u8; HEADER_BYTES];
    stream.read_exact(&mut header).ok()?;
    let h = FrameHeader::decode(&header, 64 << 20).expect("a valid header");
    let mut payload = vec![0u8; h.payload_len as usize];
    stream.read_exact(&mut payload).ok()?;
    Some(h)
}

/// A local address of this host off loopback (the one a default route leaves from), if any.
fn non_loopback_ip() -> Option<std::net::IpAddr> {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    probe.connect("10.255.255.1:9").ok()?;
    let ip = probe.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// With an SSD tier and the listener on every interface: `/health`, `/ready`, `/version`,
/// `/metrics` (build, process and SSD tier metrics, and the engine's moving with traffic), 404,
/// 405 with `Allow`, `POST /drain` refused off loopback, and `/ready` 503 "stopping" from the
/// stop signal on while a request still runs (with `/health` 200).
#[test]
fn every_route_answers_and_a_stop_turns_ready_off_first() {
    let dir = tmp("routes");
    let mut owner =
        Running::start(&dir, &["--http-addr", "0.0.0.0:0", "--ssd-bytes", "128MiB", "--shutdown-grace-ms", "8000"]);
    owner.wait_ready();
    assert_eq!(get(&owner.url("/health")), (200, "alive\n".into()));
    assert_eq!(get(&owner.url("/health?probe=1")).0, 200, "the query is ignored");

    let (status, version) = get(&owner.url("/version"));
    assert_eq!(status, 200);
    let version: serde_json::Value = serde_json::from_str(&version).expect("JSON");
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(version["protocol_version"], u64::from(PROTOCOL_VERSION));
    assert!(version["git"].is_string() || version["git"].is_null(), "{version}");

    let store = RemoteStore::connect(&format!("unix:{}", owner.socket().display())).expect("client");
    for i in 0..10u32 {
        store.put(format!("h/{i}").as_bytes(), &[3u8; 8192], PutOptions::INSERT).expect("put");
    }
    let (status, metrics) = get(&owner.url("/metrics"));
    assert_eq!(status, 200);
    let git = version["git"].as_str().unwrap_or("");
    let build = format!("kvtide_build_info{{version=\"{}\",git=\"{git}\"}}", env!("CARGO_PKG_VERSION"));
    assert_eq!(sample(&metrics, &build), Some(1.0), "{metrics}");
    assert_eq!(sample(&metrics, "kvtide_objects"), Some(10.0));
    assert_eq!(sample(&metrics, "kvtide_ssd_capacity_bytes"), Some((128u64 << 20) as f64));
    let free = sample(&metrics, "kvtide_ssd_free_bytes").expect("free");
    let used = sample(&metrics, "kvtide_ssd_used_bytes").expect("used");
    assert_eq!(free + used, (128u64 << 20) as f64);
    assert_eq!(sample(&metrics, "kvtide_ssd_write_failed"), Some(0.0));
    assert!(sample(&metrics, "process_cpu_seconds_total") > Some(0.0), "{metrics}");
    assert!(sample(&metrics, "process_resident_memory_bytes") > Some(1e6));
    assert!(sample(&metrics, "process_virtual_memory_bytes") >= sample(&metrics, "process_resident_memory_bytes"));
    assert!(sample(&metrics, "process_open_fds") > Some(3.0));
    assert!(sample(&metrics, "process_max_fds") >= sample(&metrics, "process_open_fds"));
    let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs_f64();
    let started = sample(&metrics, "process_start_time_seconds").expect("start time");
    assert!(started <= now + 1.0 && started > now - 120.0, "started {started}, now {now}");
    drop(store);

    assert_eq!(get(&owner.url("/nope")).0, 404);
    let answer = agent().post(&owner.url("/metrics")).send_empty().expect("POST /metrics");
    assert_eq!(answer.status().as_u16(), 405);
    assert_eq!(answer.headers().get("allow").and_then(|v| v.to_str().ok()), Some("GET"));
    let answer = agent().get(&owner.url("/drain")).call().expect("GET /drain");
    assert_eq!(answer.status().as_u16(), 405);
    assert_eq!(answer.headers().get("allow").and_then(|v| v.to_str().ok()), Some("POST"));
    match non_loopback_ip() {
        Some(ip) => {
            let url = format!("http://{}/drain", SocketAddr::new(ip, owner.http.port()));
            let (status, body) = post(&url);
            assert_eq!(status, 403, "from {ip}: {body}");
            assert_eq!(get(&format!("http://{}/health", SocketAddr::new(ip, owner.http.port()))).0, 200);
        }
        None => eprintln!("no address off loopback on this host: the drain's 403 is not exercised"),
    }
    assert_eq!(get(&owner.url("/ready")).0, 200, "still ready: nothing drained it");

    // A stop with a request in flight: the owner waits for it (up to the grace), and says so.
    let in_flight = HalfSentPut::start(&owner.socket(), b"late", 200_000);
    owner.wait_for_a_put_in_flight();
    let pid = owner.child.as_ref().expect("running").id();
    // SAFETY: kill with a valid pid of our own child and a valid signal.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, body) = get(&owner.url("/ready"));
        if status == 503 {
            assert_eq!(body, "stopping\n");
            break;
        }
        assert!(Instant::now() < deadline, "/ready still {status} after the stop signal");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(get(&owner.url("/health")).0, 200, "alive while it stops");
    assert_eq!(in_flight.finish(), Op::Ok, "the in-flight put finishes");
    let status = owner.child.take().expect("running").wait().expect("reap");
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POST /drain`: `/ready` turns 503 "draining", the socket refuses new connections, a put in
/// flight finishes, the answer comes once it did (200 "drained"), and the process keeps running
/// (HTTP answers) until it is stopped.
#[test]
fn a_drain_refuses_new_connections_and_lets_in_flight_requests_finish() {
    let dir = tmp("drain");
    let mut owner = Running::start(&dir, &["--http-addr", "127.0.0.1:0", "--no-ssd", "--shutdown-grace-ms", "10000"]);
    owner.wait_ready();
    let socket = format!("unix:{}", owner.socket().display());
    let idle = RemoteStore::connect(&socket).expect("client");
    idle.put(b"before", b"v", PutOptions::INSERT).expect("put");
    let in_flight = HalfSentPut::start(&owner.socket(), b"in-flight", 400_000);
    owner.wait_for_a_put_in_flight();

    let drain = {
        let url = owner.url("/drain");
        std::thread::spawn(move || post(&url))
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(&owner.url("/ready")) != (503, "draining\n".into()) {
        assert!(Instant::now() < deadline, "/ready never said draining");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(UnixStream::connect(owner.socket()).is_err(), "new connections are refused while draining");
    assert!(RemoteStore::connect(&socket).is_err());
    assert!(!drain.is_finished(), "the drain waits for the put in flight");
    assert_eq!(in_flight.finish(), Op::Ok, "the in-flight put finishes");
    let (status, body) = drain.join().expect("drain");
    assert_eq!((status, body.starts_with("drained")), (200, true), "{body}");

    let (status, body) = get(&owner.url("/ready"));
    assert_eq!((status, body.starts_with("draining")), (503, true), "{body}");
    assert_eq!(get(&owner.url("/health")).0, 200);
    let (status, metrics) = get(&owner.url("/metrics"));
    assert_eq!(status, 200);
    assert_eq!(sample(&metrics, "kvtide_objects"), Some(2.0), "the engine still runs: {metrics}");
    assert_eq!(sample(&metrics, "kvtide_owner_connections_open"), Some(0.0), "every connection ended");
    assert!(idle.get(b"before").is_err(), "the idle connection was closed and cannot reconnect");
    assert!(owner.child.as_mut().expect("running").try_wait().expect("wait").is_none(), "the owner runs on");
    assert_eq!(post(&owner.url("/drain")).0, 200, "a second drain: already drained");
    assert!(owner.stop().success());
    assert!(owner.log.lock().expect("log").contains("drained"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Slow, oversized and malformed requests get their error answers, and never keep `/health`
/// waiting; more requests than the listener answers at once get a quick 503, and once the slow
/// clients' deadline passed `/health` is 200 again.
#[test]
fn slow_oversized_and_flooding_clients_do_not_hold_the_listener() {
    let dir = tmp("hostile");
    let owner = Running::start(&dir, &["--http-addr", "127.0.0.1:0", "--no-ssd"]);
    owner.wait_ready();
    let raw = |request: &[u8]| {
        let mut s = TcpStream::connect(owner.http).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let _ = s.write_all(request);
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    };
    let mut huge = b"GET /metrics HTTP/1.1\r\nX-Filler: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 64 << 10));
    huge.extend_from_slice(b"\r\n\r\n");
    assert!(raw(&huge).starts_with("HTTP/1.1 431"));
    assert!(raw(b"POST /drain HTTP/1.1\r\nContent-Length: 100000\r\n\r\n").starts_with("HTTP/1.1 413"));
    assert!(raw(b"BOGUS\r\n\r\n").starts_with("HTTP/1.1 400"));

    // Slow clients: a request line started, never finished.
    let slow: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(owner.http).expect("connect");
            s.write_all(b"GET /metr").expect("partial");
            s
        })
        .collect();
    let asked = Instant::now();
    assert_eq!(get(&owner.url("/health")).0, 200);
    assert!(asked.elapsed() < Duration::from_millis(1000), "/health waited {:?}", asked.elapsed());
    for mut s in slow {
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "a slow client is timed out: {answer:?}");
    }

    // A flood of slow clients: past the listener's bound (16 requests at once) the accept thread
    // answers 503 at once, so the flood gets quick 503s, a probe an answer without waiting for
    // the slow ones' deadline, and each slow one its 408.
    let flood: Vec<TcpStream> = (0..100)
        .map(|_| {
            let mut s = TcpStream::connect(owner.http).expect("connect");
            let _ = s.write_all(b"GET /hea");
            s
        })
        .collect();
    let asked = Instant::now();
    let answer = raw(b"GET /health HTTP/1.1\r\n\r\n");
    assert!(asked.elapsed() < Duration::from_millis(1500), "answered after {:?}", asked.elapsed());
    assert!(answer.starts_with("HTTP/1.1 200") || answer.contains("busy"), "{answer:?}");
    let mut busy = 0;
    for mut s in flood {
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        if answer.starts_with("HTTP/1.1 503") && answer.contains("busy") {
            busy += 1;
        } else {
            assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
        }
    }
    assert!(busy > 0, "100 slow clients at once, none refused as busy");
    let deadline = Instant::now() + Duration::from_secs(10);
    while raw(b"GET /health HTTP/1.1\r\n\r\n").split("\r\n").next() != Some("HTTP/1.1 200 OK") {
        assert!(Instant::now() < deadline, "/health never recovered from the flood");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The default address (127.0.0.1:7371) taken, as by another owner on the host: the owner warns
/// and serves without HTTP. An address the operator set that is taken stops it with an error;
/// `KVTIDE_OWNER_HTTP_ADDR=off` turns the listener off.
#[test]
fn a_taken_default_address_turns_http_off_and_a_taken_chosen_one_is_an_error() {
    let dir = tmp("taken");
    // Held here, or already held by another process: taken either way.
    let _held = std::net::TcpListener::bind("127.0.0.1:7371");
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut child =
            owner_command(&dir, &[&["--no-ssd"], args].concat()).envs(env.iter().copied()).spawn().expect("spawn");
        let socket = format!("unix:{}", dir.join("owner.sock").display());
        let deadline = Instant::now() + Duration::from_secs(60);
        while RemoteStore::connect(&socket).is_err() {
            if child.try_wait().expect("wait").is_some() {
                break;
            }
            assert!(Instant::now() < deadline, "never served");
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: kill with a valid pid of our own child and a valid signal.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let out = child.wait_with_output().expect("reap");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, log) = run(&[], &[]);
    assert!(ok && log.contains("default HTTP address is taken") && !log.contains("HTTP listening"), "{log}");
    let (ok, log) = run(&["--http-addr", "127.0.0.1:7371"], &[]);
    assert!(!ok && log.contains("cannot listen for HTTP on 127.0.0.1:7371"), "{log}");
    let (ok, log) = run(&[], &[("KVTIDE_OWNER_HTTP_ADDR", "off")]);
    assert!(ok && !log.contains("HTTP listening") && !log.contains("default HTTP address"), "{log}");
    let (ok, log) = run(&["--http-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:1"], &[]);
    assert!(!ok && log.contains("name different listeners"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An SSD tier that stopped taking writes (every write and sync of the simulated disk fails):
/// `/ready` turns 503 and says why, and `kvtide_ssd_write_failed` is 1. In process: the
/// listener and the owner of the binary, over an engine on the simulated disk.
#[test]
fn an_ssd_tier_that_stopped_taking_writes_makes_the_owner_unready() {
    let dir = tmp("failed-tier");
    let always =
        kvtide::SimFaults { write_eio_ppm: 1_000_000, sync_eio_ppm: 1_000_000, ..kvtide::SimFaults::default() };
    let engine = std::sync::Arc::new(
        kvtide::StoreBuilder::new()
            .dram_bytes(32 << 20)
            .shards(1)
            .pin_threads(false)
            .ssd_bytes(64 << 20)
            .write_through(true)
            .simulated_ssd(3, always)
            .open()
            .expect("open"),
    );
    let config = kvtide_remote::OwnerConfig {
        unix_socket: Some(dir.join("owner.sock")),
        ..kvtide_remote::OwnerConfig::default()
    };
    let owner = Arc::new(kvtide_remote::Owner::start(Arc::clone(&engine), config).expect("owner"));
    let http = kvtide_remote::HttpServer::start("127.0.0.1:0".parse().expect("addr"), kvtide_remote::HttpState::new())
        .expect("listen");
    let url = |path: &str| format!("http://{}{path}", http.addr());
    assert_eq!(get(&url("/ready")), (503, "starting: the store is being opened\n".into()));
    http.state().serving(Arc::clone(&owner));
    let failed = |metrics: &str| sample(metrics, "kvtide_ssd_write_failed");
    assert_eq!(failed(&get(&url("/metrics")).1), Some(0.0));
    assert_eq!(get(&url("/ready")).0, 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0u32.. {
        // Write-through puts fail once the tier gave up; each one tries the disk.
        let _ = engine.put(format!("k{i}").as_bytes(), &[1u8; 100_000], PutOptions::UPSERT);
        let (status, why) = get(&url("/ready"));
        if status == 503 {
            assert!(why.contains("SSD tier stopped taking writes"), "{why}");
            break;
        }
        assert!(Instant::now() < deadline, "the tier never gave up: {:?}", engine.stats().total);
    }
    assert_eq!(failed(&get(&url("/metrics")).1), Some(1.0));
    assert_eq!(get(&url("/health")).0, 200);
    drop(http);
    owner.shutdown();
    engine.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}
