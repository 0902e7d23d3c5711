//! A real process is killed with SIGKILL while it writes (write-through) and evicts under load;
//! after each kill the store reopens and every object acknowledged durable reads back
//! byte-exact (or as a later version whose put had started). 20 rounds by default;
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

#[derive(Default, Clone)]
struct KeyState {
    /// Latest version acknowledged durable.
    acked: Option<u64>,
    /// Versions attempted after it (they may or may not have reached the disk).
    tried_after: Vec<u64>,
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
                    state.acked = Some(v);
                    state.tried_after.clear();
                    acks_total += 1;
                }
                _ => {}
            }
        }
        // Reopen in this process and check every acknowledged object.
        let store = open(&dir);
        for (&k, state) in &keys {
            let Some(acked) = state.acked else { continue };
            let bytes = store
                .get(&key(k))
                .unwrap_or_else(|e| panic!("round {round}: durable key {k} v{acked} lost after SIGKILL: {e}"));
            let ok = std::iter::once(acked)
                .chain(state.tried_after.iter().copied())
                .any(|v| bytes == value_for(&key(k), v, VALUE_BYTES));
            assert!(ok, "round {round}: key {k} read back bytes of no acknowledged or attempted version");
            checked += 1;
        }
        // What came back is now the state to build on: later rounds may overwrite it.
        for (&k, state) in keys.iter_mut() {
            if let Ok(bytes) = store.get(&key(k)) {
                let all = state.acked.into_iter().chain(state.tried_after.iter().copied());
                if let Some(v) = all.into_iter().find(|&v| bytes == value_for(&key(k), v, VALUE_BYTES)) {
                    state.acked = Some(v);
                    state.tried_after.clear();
                }
            }
        }
        assert_eq!(store.stats().total.segments_reclaimed, 0, "the tier must not fill in this test");
        drop(store);
    }
    println!("{rounds} SIGKILL rounds: {acks_total} durable puts acknowledged, {checked} reads checked after restart");
    assert!(acks_total > 0, "the child must get some puts acknowledged");
    let _ = std::fs::remove_dir_all(&dir);
}
