//! A real process is killed with SIGKILL while it writes (write-through), removes and evicts
//! under load; after each kill the store reopens, every object acknowledged durable reads back
//! byte-exact (or as a later version whose put had started), and every key whose remove was
//! acknowledged stays absent (unless a put of it had started since). 20 rounds by default;
//! `KVTIDE_CRASH_ROUNDS=200 cargo test --release --test crash` for a longer run.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::value_for;
use kvtide::{Engine, PutOptions, Store, StoreBuilder};
use rand::{rngs::StdRng, Rng, SeedableRng};

const KEYS: u64 = 160;
const VALUE_BYTES: usize = 16 << 10;
const PUTS_PER_ROUND: u64 = 300;

fn open(dir: &Path) -> Engine {
    StoreBuilder::new()
        .dram_bytes(4 << 20)
        .shards(2)
        .pin_threads(false)
        .idle_spin_us(10)
        .ssd_dir(dir)
        .ssd_bytes(512 << 20)
        .ssd_segment_bytes(8 << 20)
        .write_through(true)
        .open()
        .expect("open")
}

fn key(k: u64) -> Vec<u8> {
    format!("crash/{k}").into_bytes()
}

/// The child: puts until killed, announcing each attempt and each durable acknowledgement.
#[test]
#[ignore = "run by crash_rounds as a child process"]
fn crash_child() {
    let Ok(dir) = std::env::var("KVTIDE_CRASH_DIR") else { return };
    let round: u64 = std::env::var("KVTIDE_CRASH_ROUND").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
    let store = open(Path::new(&dir));
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY").expect("stdout");
    out.flush().expect("flush");
    let mut rng = StdRng::seed_from_u64(round);
    for n in 0..PUTS_PER_ROUND {
        let k = rng.random_range(0..KEYS);
        let version = round * 1_000_000 + n;
        if rng.random_range(0..4) == 0 {
            writeln!(out, "RMTRY {k} 0").expect("stdout");
            out.flush().expect("flush");
            // Absent either way once this returns (NotFound: nothing was there to remove).
            if matches!(store.remove(&key(k), true), Ok(()) | Err(kvtide::Error::NotFound)) {
                writeln!(out, "RMACK {k} 0").expect("stdout");
                out.flush().expect("flush");
            }
            continue;
        }
        writeln!(out, "TRY {k} {version}").expect("stdout");
        out.flush().expect("flush");
        let value = value_for(&key(k), version, VALUE_BYTES);
        if store.put(&key(k), &value, PutOptions::UPSERT).is_ok() {
            writeln!(out, "ACK {k} {version}").expect("stdout");
            out.flush().expect("flush");
        }
    }
    writeln!(out, "DONE").expect("stdout");
    out.flush().expect("flush");
    // Wait to be killed.
    std::thread::sleep(Duration::from_secs(60));
}

/// What was last acknowledged for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Acked {
    /// A put of this version, durable.
    Version(u64),
    /// A remove (or a restart that found the key absent).
    Removed,
}

#[derive(Default, Clone)]
struct KeyState {
    acked: Option<Acked>,
    /// Versions attempted after it (they may or may not have reached the disk).
    tried_after: Vec<u64>,
    /// A remove attempted after it and not acknowledged (it may or may not have happened).
    remove_tried: bool,
}

#[test]
fn crash_rounds() {
    let rounds: u64 = std::env::var("KVTIDE_CRASH_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(20);
    let dir: PathBuf = std::env::temp_dir().join(format!("kvtide-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let exe = std::env::current_exe().expect("test binary");
    let mut rng = StdRng::seed_from_u64(0xC0FFEE);
    let mut keys: HashMap<u64, KeyState> = HashMap::new();
    let mut checked = 0u64;
    let mut acks_total = 0u64;
    let mut removes_total = 0u64;
    for round in 0..rounds {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("KVTIDE_CRASH_DIR", &dir)
            .env("KVTIDE_CRASH_ROUND", (round + 1).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Wait for the store to open, then kill at a random moment.
        let ready_deadline = Instant::now() + Duration::from_secs(60);
        let mut lines = Vec::new();
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) if line.ends_with("READY") => break,
                Ok(line) => lines.push(line),
                Err(_) => assert!(Instant::now() < ready_deadline, "child never opened the store"),
            }
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(5..250)));
        if round % 2 == 1 {
            // Every other round dies right after a remove was acknowledged: its tombstone must
            // be durable by then.
            let until = Instant::now() + Duration::from_secs(2);
            while let Ok(line) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                let acked_remove = line.starts_with("RMACK");
                lines.push(line);
                if acked_remove {
                    break;
                }
            }
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reap child");
        reader.join().expect("reader");
        lines.extend(rx.try_iter());
        for line in &lines {
            let mut parts = line.split_whitespace();
            let (Some(kind), Some(k), Some(v)) = (parts.next(), parts.next(), parts.next()) else { continue };
            let (Ok(k), Ok(v)) = (k.parse::<u64>(), v.parse::<u64>()) else { continue };
            let state = keys.entry(k).or_default();
            match kind {
                "TRY" => state.tried_after.push(v),
                "ACK" => {
                    state.acked = Some(Acked::Version(v));
                    state.tried_after.clear();
                    state.remove_tried = false;
                    acks_total += 1;
                }
                "RMTRY" => state.remove_tried = true,
                "RMACK" => {
                    state.acked = Some(Acked::Removed);
                    state.tried_after.clear();
                    state.remove_tried = false;
                    removes_total += 1;
                }
                _ => {}
            }
        }
        // Reopen in this process and check every acknowledged object.
        let store = open(&dir);
        for (&k, state) in &keys {
            let Some(acked) = state.acked else { continue };
            let version = match acked {
                Acked::Version(v) => Some(v),
                Acked::Removed => None,
            };
            let allowed = || version.into_iter().chain(state.tried_after.iter().copied());
            match store.get(&key(k)) {
                Ok(bytes) => {
                    let ok = allowed().any(|v| bytes == value_for(&key(k), v, VALUE_BYTES));
                    assert!(
                        ok,
                        "round {round}: key {k} ({acked:?}) read back bytes of no acknowledged or attempted version"
                    );
                }
                Err(kvtide::Error::NotFound) => assert!(
                    version.is_none() || state.remove_tried,
                    "round {round}: durable key {k} {acked:?} lost after SIGKILL"
                ),
                Err(e) => panic!("round {round}: key {k} ({acked:?}) unreadable after SIGKILL: {e}"),
            }
            checked += 1;
        }
        // What came back is now the state to build on: later rounds may overwrite it.
        for (&k, state) in keys.iter_mut() {
            let version = match state.acked {
                Some(Acked::Version(v)) => Some(v),
                _ => None,
            };
            match store.get(&key(k)) {
                Ok(bytes) => {
                    let all = version.into_iter().chain(state.tried_after.iter().copied());
                    if let Some(v) = all.into_iter().find(|&v| bytes == value_for(&key(k), v, VALUE_BYTES)) {
                        state.acked = Some(Acked::Version(v));
                    }
                }
                Err(_) if state.acked.is_some() || !state.tried_after.is_empty() => state.acked = Some(Acked::Removed),
                Err(_) => {}
            }
            state.tried_after.clear();
            state.remove_tried = false;
        }
        assert_eq!(store.stats().total.segments_reclaimed, 0, "the tier must not fill in this test");
        drop(store);
    }
    println!(
        "{rounds} SIGKILL rounds: {acks_total} durable puts and {removes_total} removes acknowledged, {checked} reads checked after restart"
    );
    assert!(acks_total > 0 && removes_total > 0, "the child must get some puts and removes acknowledged");
    let _ = std::fs::remove_dir_all(&dir);
}
