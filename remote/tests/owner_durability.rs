//! Through the owner process on the real disk: objects a client saw acknowledged (write-through)
//! survive SIGKILL of `kvtide-owner` while their segments are reclaimed, and the advertised
//! maximum value is storable through it.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::churn::{once_key, CHURN_BYTES, CHURN_KEYS, CHURN_PUTS, HOT_BYTES, ONCE, ONCE_BYTES};
use common::value_for;
use kvtide::{PutOptions, Store};
use kvtide_remote::{ClientOptions, RemoteStore};
use support::{owner_binary, wait_served};

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kvtide-owner-durability-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// Starts `kvtide-owner` on `dir` (write-through, 1 shard, 32 MiB DRAM, 64 MiB SSD in 4 MiB
/// segments, Unix socket only) and waits until a client can connect.
fn start_owner(dir: &Path) -> (std::process::Child, RemoteStore) {
    std::fs::create_dir_all(dir).expect("data dir");
    let config = dir.join("owner.toml");
    std::fs::write(
        &config,
        format!(
            "[owner]\ndata_dir = {:?}\ntcp = \"off\"\n[dram]\nbytes = \"32MiB\"\n[ssd]\nbytes = \"64MiB\"\n\
             segment_bytes = \"4MiB\"\nwrite_through = true\n[runtime]\nshards = 1\npin_threads = false\n",
            dir.display().to_string()
        ),
    )
    .expect("config");
    let child = Command::new(owner_binary())
        .args(["--config", &config.display().to_string()])
        .env("KVTIDE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvtide-owner");
    let mut child = child;
    let store = wait_served(&mut child, &format!("unix:{}", dir.join("owner.sock").display()), 60);
    (child, store)
}

#[test]
fn through_the_owner_acknowledged_objects_survive_sigkill_and_the_maximum_is_storable() {
    let dir = tmp("owner-kill");
    let (mut owner, store) = start_owner(&dir);
    store.put(b"hot/object", &value_for(b"hot/object", 1, HOT_BYTES), PutOptions::INSERT).expect("hot");
    for i in 0..ONCE {
        store.put(&once_key(i), &value_for(&once_key(i), 1, ONCE_BYTES), PutOptions::INSERT).expect("once");
    }
    for n in 0..CHURN_PUTS / 2 {
        let key = format!("churn/{}", n % CHURN_KEYS).into_bytes();
        store.put(&key, &value_for(&key, n, CHURN_BYTES), PutOptions::UPSERT).expect("churn");
    }
    // The advertised maximum through the owner, and put-and-pin.
    let max = store.max_value_bytes().expect("limits") as usize;
    let big = value_for(b"max", 3, max);
    store.put(b"max", &big, PutOptions::INSERT).unwrap_or_else(|e| panic!("put of max_value_bytes ({max}): {e}"));
    assert_eq!(store.get(b"max").expect("read right after the put"), big);
    store.put(b"pinned", &[7u8; 4096], PutOptions::INSERT.pinned()).expect("put and pin");
    assert_eq!(store.unpin(b"pinned"), Ok(()), "the put pinned it once");
    let s = store.stats().total;
    assert!(s.segments_reclaimed > 5, "the churn must reclaim segments: {s:?}");
    assert_eq!(s.ssd_evictions, 0, "{s:?}");
    owner.kill().expect("SIGKILL the owner");
    owner.wait().expect("reap");
    drop(store);
    let (mut owner, store) = start_owner(&dir);
    let hot = store.get(b"hot/object").expect("hot/object after SIGKILL of the owner");
    assert_eq!(hot, value_for(b"hot/object", 1, HOT_BYTES));
    for i in 0..ONCE {
        assert_eq!(
            store.get(&once_key(i)).unwrap_or_else(|e| panic!("once/{i} lost with the owner: {e}")),
            value_for(&once_key(i), 1, ONCE_BYTES)
        );
    }
    owner.kill().expect("stop the owner");
    owner.wait().expect("reap");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts `kvtide-owner` on `dir` with the SSD tier sized by default (from free disk space) and
/// the shard count by default, and waits until a client can connect.
fn start_with_default_sizes(dir: &Path) -> (std::process::Child, RemoteStore) {
    let child = Command::new(owner_binary())
        .args(["--data-dir", &dir.display().to_string(), "--tcp", "off", "--dram-bytes", "64MiB"])
        .env("KVTIDE_LOG", "warn")
        .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvtide-owner");
    let mut child = child;
    let store = wait_served(&mut child, &format!("unix:{}", dir.join("owner.sock").display()), 120);
    (child, store)
}

fn stop(mut owner: std::process::Child) {
    // SAFETY: kill with a valid pid of our own child and a valid signal.
    unsafe { libc::kill(owner.id() as libc::pid_t, libc::SIGTERM) };
    let status = owner.wait().expect("reap");
    assert!(status.success(), "a clean stop exits 0: {status}");
}

/// The first start sizes the SSD tier from free disk space and preallocates it, which changes
/// the free space the next start sees; more is taken between the starts. Every start with the
/// same (default) settings still opens the directory and serves the same objects.
#[test]
fn an_owner_with_default_sizes_restarts_after_free_space_changed() {
    let dir = tmp("default-sizes");
    std::fs::create_dir_all(&dir).expect("dir");
    let (owner, store) = start_with_default_sizes(&dir);
    let keys: Vec<Vec<u8>> = (0..50u32).map(|i| format!("restart/{i}").into_bytes()).collect();
    for key in &keys {
        store.put(key, &value_for(key, 7, 100_000), PutOptions::INSERT).expect("put");
    }
    drop(store);
    stop(owner);
    let tiered = dir.join("ssd/FORMAT").exists();
    // Take 512 MiB more of the disk (fallocate: no bytes written).
    let filler = dir.join("filler");
    let file = std::fs::File::create(&filler).expect("filler");
    // SAFETY: fallocate on a descriptor we own; no pointers are passed.
    let taken = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, 512 << 20) } == 0;
    for round in 0..2 {
        let (owner, store) = start_with_default_sizes(&dir);
        if tiered {
            for key in &keys {
                let got = store
                    .get(key)
                    .unwrap_or_else(|e| panic!("{} after restart {round}: {e}", String::from_utf8_lossy(key)));
                assert_eq!(got, value_for(key, 7, 100_000));
            }
        }
        drop(store);
        stop(owner);
    }
    eprintln!("SSD tier: {tiered}; filler taken: {taken}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--version` answers; a fatal error is printed once and exits non-zero.
#[test]
fn the_command_line_reports_its_version_and_a_fatal_error_once() {
    let out = Command::new(owner_binary()).arg("--version").output().expect("run --version");
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("kvtide-owner {}", env!("CARGO_PKG_VERSION")));
    let out = Command::new(owner_binary()).arg("--bogus-flag").env("KVTIDE_LOG", "info").output().expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("--bogus-flag").count(), 1, "printed once: {stderr}");
}

/// Under a supervisor: READY=1 once the owner serves and STOPPING=1 when it stops, on
/// `NOTIFY_SOCKET`; `kvtide-owner status` answers while it serves and fails once it stopped.
#[test]
fn the_owner_notifies_its_supervisor_and_answers_status() {
    let dir = tmp("notify");
    std::fs::create_dir_all(&dir).expect("dir");
    let notify_path = dir.join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).expect("bind notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let owner = Command::new(owner_binary())
        .args(["--data-dir", &dir.display().to_string(), "--tcp", "off", "--dram-bytes", "64MiB", "--no-ssd"])
        .env("KVTIDE_LOG", "warn")
        .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
        .env("NOTIFY_SOCKET", &notify_path)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn kvtide-owner");
    let mut buf = [0u8; 512];
    let n = notify.recv(&mut buf).expect("READY from the owner");
    let ready = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready}");
    let socket = format!("unix:{}", dir.join("owner.sock").display());
    let out = Command::new(owner_binary()).args(["status", &socket]).output().expect("status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("serving"), "{text} {}", String::from_utf8_lossy(&out.stderr));
    stop(owner);
    let n = notify.recv(&mut buf).expect("STOPPING from the owner");
    assert!(String::from_utf8_lossy(&buf[..n]).lines().any(|l| l == "STOPPING=1"));
    let out = Command::new(owner_binary()).args(["status", &socket]).output().expect("status");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no owner serving"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The flags of the systemd unit's ExecStart and of the container image's entry point, after
/// the binary.
fn deploy_flags() -> Vec<(&'static str, Vec<String>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let unit = std::fs::read_to_string(root.join("deploy/kvtide-owner.service")).expect("unit");
    let exec = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("ExecStart");
    let mut unit_args: Vec<String> = exec.split_whitespace().map(String::from).collect();
    assert!(unit_args.remove(0).ends_with("/kvtide-owner"));
    let docker = std::fs::read_to_string(root.join("deploy/Dockerfile")).expect("Dockerfile");
    let entry = docker.lines().find_map(|l| l.strip_prefix("ENTRYPOINT ")).expect("ENTRYPOINT");
    let mut image_args: Vec<String> =
        entry.trim_matches(['[', ']']).split(',').map(|a| a.trim().trim_matches('"').to_string()).collect();
    assert!(image_args.remove(0).ends_with("/kvtide-owner"));
    vec![("systemd unit", unit_args), ("container image", image_args)]
}

/// The unit's and the image's command lines start this binary: both serve the one socket path,
/// /run/kvtide/owner.sock, mode 0660 for the kvtide group; with their data directory, socket,
/// group and TCP address moved somewhere private, each serves and answers `status`.
#[test]
fn the_deploy_command_lines_start_an_owner() {
    for (what, args) in deploy_flags() {
        let dir = tmp(&format!("deploy-{}", what.replace(' ', "-")));
        std::fs::create_dir_all(&dir).expect("dir");
        let mut args = args.clone();
        let value_of = |args: &[String], flag: &str| {
            let at = args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{what} sets {flag}"));
            (at + 1, args[at + 1].clone())
        };
        assert_eq!(value_of(&args, "--unix-socket").1, "/run/kvtide/owner.sock", "{what}");
        assert_eq!(value_of(&args, "--socket-mode").1, "0660", "{what}");
        assert_eq!(value_of(&args, "--socket-group").1, "kvtide", "{what}");
        let socket_path = dir.join("run/owner.sock");
        // SAFETY: getegid has no inputs and cannot fail.
        let gid = unsafe { libc::getegid() };
        for (flag, value) in [
            ("--data-dir", dir.display().to_string()),
            ("--tcp", "127.0.0.1:0".to_string()),
            ("--unix-socket", socket_path.display().to_string()),
            ("--socket-group", gid.to_string()),
        ] {
            let (at, _) = value_of(&args, flag);
            args[at] = value;
        }
        let mut owner = Command::new(owner_binary())
            .args(&args)
            .args(["--dram-bytes", "64MiB"])
            .env("KVTIDE_LOG", "warn")
            .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn");
        let socket = format!("unix:{}", socket_path.display());
        drop(wait_served(&mut owner, &socket, 60));
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&socket_path).expect("socket");
        assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, gid), "{what}");
        let out = Command::new(owner_binary()).args(["status", &socket]).output().expect("status");
        assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
        stop(owner);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A child owner killed if the test fails before it stopped it.
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn scrape(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: kvtide\r\n\r\n").expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("response");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    (head.to_string(), body.to_string())
}

/// The value of the sample `name` (with its labels, as written) in Prometheus text.
fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

/// `--metrics-addr` (the HTTP listener's deprecated alias): Prometheus text of the engine's and the
/// owner's counters, which move with the traffic; other paths are 404.
#[test]
fn the_metrics_endpoint_serves_prometheus_text_that_moves() {
    let dir = tmp("metrics");
    std::fs::create_dir_all(&dir).expect("dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
    let metrics = format!("127.0.0.1:{port}");
    let owner = Command::new(owner_binary())
        .args(["--data-dir", &dir.display().to_string(), "--tcp", "off", "--dram-bytes", "64MiB", "--no-ssd"])
        .args(["--metrics-addr", &metrics])
        .env("KVTIDE_LOG", "warn")
        .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut owner = KillOnDrop(Some(owner));
    let socket = format!("unix:{}", dir.join("owner.sock").display());
    let store = wait_served(owner.0.as_mut().expect("running"), &socket, 60);
    let (head, before) = scrape(&metrics, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // Every sample line is `name{labels} value`; the text ends with # EOF.
    for line in before.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample: {line}"));
        assert!(name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_'), "{line}");
        assert!(value.parse::<f64>().is_ok() || value == "+Inf" || value == "NaN", "{line}");
    }
    assert_eq!(before.lines().last(), Some("# EOF"));
    // Reads through the read index never reach the owner: this client leases, so every get is
    // a request the latency histogram counts.
    let leased = RemoteStore::connect_with(&socket, ClientOptions { read_index: false, ..ClientOptions::default() })
        .expect("leasing client");
    for i in 0..20u32 {
        store.put(format!("m/{i}").as_bytes(), &[1u8; 4096], PutOptions::INSERT).expect("put");
        leased.get(format!("m/{i}").as_bytes()).expect("get");
    }
    let _ = store.get(b"absent");
    // A request's latency is recorded once its reply went out, so the last one may land just
    // after the client saw the reply: scrape until it is in.
    let get_count = "kvtide_owner_request_seconds_bucket{le=\"+Inf\",kind=\"get\"}";
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let (_, after) = scrape(&metrics, "/metrics");
        if sample(&after, get_count) >= Some(21.0) || Instant::now() > deadline {
            break after;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(sample(&before, "kvtide_objects"), Some(0.0));
    assert_eq!(sample(&after, "kvtide_objects"), Some(20.0));
    // No read is in progress between scrapes: no lease of either kind is held.
    assert_eq!(sample(&after, "kvtide_leases_held"), Some(0.0));
    assert_eq!(sample(&after, "kvtide_published_leases_held"), Some(0.0));
    assert!(sample(&after, "kvtide_puts_total") >= Some(20.0), "{after}");
    assert!(sample(&after, "kvtide_misses_total") > sample(&before, "kvtide_misses_total"));
    assert!(sample(&after, "kvtide_owner_request_seconds_count{kind=\"put\"}") >= Some(20.0), "{after}");
    assert!(sample(&after, get_count) >= Some(21.0), "{after}");
    assert!(sample(&after, "kvtide_owner_rejected_total{reason=\"busy\"}").is_some());
    let (head, _) = scrape(&metrics, "/other");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    drop((store, leased));
    stop(owner.0.take().expect("running"));
    // `--metrics-addr` is the HTTP listener's deprecated alias: an address it names that cannot be
    // bound stops the owner, as `--http-addr` does.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let taken = taken.local_addr().expect("addr").to_string();
    let out = Command::new(owner_binary())
        .args(["--data-dir", &dir.display().to_string(), "--tcp", "off", "--no-ssd", "--metrics-addr", &taken])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("cannot listen for HTTP"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The command line as an operator meets it: `--help` lists every setting's flag, `--version`,
/// `--print-config` prints a TOML file of the effective values, `--log-format json` logs JSON
/// objects, and a bad flag is one clear error.
#[test]
fn the_command_line_lists_every_setting_and_prints_its_configuration() {
    use kvtide::settings::Settings;
    let run = |args: &[&str]| Command::new(owner_binary()).args(args).env("KVTIDE_LOG", "info").output().expect("run");
    let help = run(&["--help"]);
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let all = kvtide_remote::OwnerSettings::default();
    for (group, fields) in all.groups() {
        for f in fields {
            let flag = format!("--{}", kvtide_remote::flag_name(group, f.name));
            assert!(help.contains(&flag), "--help lacks {flag} ([{group}] {})", f.name);
        }
    }
    let version = run(&["--version"]);
    assert_eq!(String::from_utf8_lossy(&version.stdout).trim(), format!("kvtide-owner {}", env!("CARGO_PKG_VERSION")));
    let bad = run(&["--dram-bytez", "1GiB"]);
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.starts_with("kvtide-owner: ") && stderr.contains("--dram-bytez"), "{stderr}");

    let dir = tmp("print-config");
    std::fs::create_dir_all(&dir).expect("dir");
    let d = dir.display().to_string();
    let printed = run(&["--data-dir", &d, "--no-ssd", "--tcp", "off", "--dram-bytes", "64MiB", "--print-config"]);
    assert!(printed.status.success(), "{}", String::from_utf8_lossy(&printed.stderr));
    let text = String::from_utf8_lossy(&printed.stdout).to_string();
    assert!(text.contains("bytes = 67108864  # flag --dram-bytes"), "{text}");
    let table: toml::Table = text.parse().expect("the printed configuration is TOML");
    assert_eq!(table["owner"]["tcp"].as_str(), Some("off"));
    assert!(!dir.join("owner.sock").exists(), "printing the configuration starts nothing");

    // JSON logs: every line the owner writes to stderr is one JSON object.
    let mut owner = Command::new(owner_binary())
        .args(["--data-dir", &d, "--no-ssd", "--tcp", "off", "--dram-bytes", "64MiB", "--log-format", "json"])
        .env("KVTIDE_RUNTIME_PIN_THREADS", "false")
        .env("KVTIDE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    drop(wait_served(&mut owner, &format!("unix:{}", dir.join("owner.sock").display()), 60));
    // SAFETY: kill with a valid pid of our own child and a valid signal.
    unsafe { libc::kill(owner.id() as libc::pid_t, libc::SIGTERM) };
    let mut logs = String::new();
    std::io::Read::read_to_string(owner.stderr.as_mut().expect("stderr"), &mut logs).expect("logs");
    assert!(owner.wait().expect("reap").success());
    let lines: Vec<&str> = logs.lines().collect();
    assert!(lines.len() >= 2, "{logs}");
    for line in lines {
        assert!(line.starts_with('{') && line.ends_with('}') && line.contains("\"level\""), "not JSON: {line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a new user does: `kvtide-owner` with no flags at all, under a fresh HOME (no data
/// directory variables), stopped and started again: both starts serve, on the default socket,
/// and the second one still has what the first stored.
#[test]
fn the_owner_with_no_flags_under_a_fresh_home_starts_twice() {
    let home = tmp("fresh-home");
    std::fs::create_dir_all(&home).expect("home");
    let socket = format!("unix:{}", home.join(".local/share/kvtide/owner.sock").display());
    let start = || {
        let child = Command::new(owner_binary())
            .env_clear()
            .env("HOME", &home)
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("KVTIDE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut child = KillOnDrop(Some(child));
        let store = wait_served(child.0.as_mut().expect("running"), &socket, 60);
        (child, store)
    };
    let (mut first, store) = start();
    store.put(b"fresh/kept", &[9u8; 10_000], PutOptions::INSERT).expect("put");
    drop(store);
    let mut owner = first.0.take().expect("running");
    let mut stderr = owner.stderr.take().expect("stderr");
    stop(owner);
    let mut logs = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut logs).expect("logs");
    // The first start sized an SSD tier from the free disk space, or went DRAM only, saying so,
    // where less than 2 GiB was free; only an SSD tier keeps objects across a restart.
    let with_ssd = home.join(".local/share/kvtide/ssd/FORMAT").exists();
    assert_eq!(logs.contains("too little free disk space for an SSD tier; DRAM only"), !with_ssd, "{logs}");
    let (mut second, store) = start();
    if with_ssd {
        assert_eq!(store.get(b"fresh/kept").expect("kept across the restart"), vec![9u8; 10_000]);
    } else {
        eprintln!("DRAM only (too little free disk space here): the restart starts empty");
        assert_eq!(store.get(b"fresh/kept"), Err(kvtide_remote::Error::Store(kvtide::Error::NotFound)));
    }
    drop(store);
    stop(second.0.take().expect("running"));
    let _ = std::fs::remove_dir_all(&home);
}
