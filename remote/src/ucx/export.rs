//! The owner's side of the UCX plane: the helper process that serves it (`helper.rs`), started,
//! watched and restarted here.
//!
//! Owns the helper's life (spawned with only the arena's read-only descriptor, UCX's own
//! environment and a pipe on stdin whose close stops it; restarted after a pause when it dies)
//! and the `UcxReady` of the running helper, which authenticated clients are given. Never runs
//! UCX in the owner's process and never grants anything: which ranges a client may read is
//! decided by leases on the control connection.

use std::io::BufReader;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::helper::{read_ready, ARENA_FD, UCX_PLANE_ARG};
use super::{Transports, UResult, UcxError};
use crate::protocol::UcxReady;

/// How often the watcher looks at the helper, and the pause before a restart.
const WATCH_MS: u64 = 100;
const RESTART_PAUSE_MS: u64 = 500;
/// How long a starting helper may take to say what it serves.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// The UCX plane's process as the owner sees it (`Owner::ucx_plane`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UcxPlaneState {
    /// The process runs and clients are given its address.
    pub serving: bool,
    /// Its pid while it runs.
    pub pid: Option<u32>,
    /// Times it was started again after it ended.
    pub restarts: u64,
    /// Its UCX workers (each on its own thread) while it runs; attaching clients are handed
    /// one each, in turn.
    pub workers: usize,
}

/// How to start the helper.
struct Launch {
    program: PathBuf,
    transports: Transports,
    arena_fd: OwnedFd,
    arena_bytes: u64,
    /// The owner listens on loopback only: so does a tcp-only plane.
    loopback: bool,
    /// UCX workers the helper serves with.
    workers: usize,
}

/// The running helper: its process, its stdin (closed to stop it) and what it serves.
struct Running {
    child: Child,
    /// Never written: closing it tells the helper to stop.
    stdin: ChildStdin,
    /// One per worker.
    ready: Vec<UcxReady>,
    /// The worker the next attaching client is handed.
    next: usize,
}

struct State {
    running: Mutex<Option<Running>>,
    stopping: AtomicBool,
    stopped: Condvar,
    restarts: AtomicU64,
}

/// The owner's UCX plane (dropped: the helper is stopped).
pub(crate) struct UcxExport {
    state: Arc<State>,
    watcher: Option<JoinHandle<()>>,
}

impl UcxExport {
    /// Starts the helper `program` (`kvtide-owner`) serving the arena behind `arena_fd` (a
    /// read-only descriptor of `arena_bytes`) over `transports` with `workers` UCX workers, and
    /// a thread that restarts it.
    pub(crate) fn start(
        program: PathBuf,
        transports: Transports,
        arena_fd: OwnedFd,
        arena_bytes: u64,
        loopback: bool,
        workers: usize,
    ) -> UResult<UcxExport> {
        let launch = Launch { program, transports, arena_fd, arena_bytes, loopback, workers };
        let state = Arc::new(State {
            running: Mutex::new(None),
            stopping: AtomicBool::new(false),
            stopped: Condvar::new(),
            restarts: AtomicU64::new(0),
        });
        let watched = Arc::clone(&state);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        // The watcher starts every helper, the first too: a helper dies with the thread that
        // started it (PR_SET_PDEATHSIG), and the watcher lives as long as the export.
        let watcher = std::thread::Builder::new()
            .name("kvtide-ucx-watch".into())
            .spawn(move || {
                let first = spawn(&launch);
                let ok = first.is_ok();
                match first {
                    Ok(running) => {
                        tracing::info!(
                            transports = launch.transports.as_str(),
                            arena_bytes = launch.arena_bytes,
                            pid = running.child.id(),
                            workers = running.ready.len(),
                            "UCX data plane serving the arena from its own process"
                        );
                        *watched.running.lock().unwrap_or_else(|p| p.into_inner()) = Some(running);
                        let _ = started_tx.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = started_tx.send(Err(e));
                    }
                }
                if ok {
                    watch(&watched, &launch);
                }
            })
            .map_err(|e| UcxError::Call { call: "spawn", status: e.to_string() })?;
        let started = started_rx
            .recv()
            .unwrap_or_else(|_| Err(UcxError::Call { call: "spawn", status: "the watcher ended".into() }));
        if let Err(e) = started {
            let _ = watcher.join();
            return Err(e);
        }
        Ok(UcxExport { state, watcher: Some(watcher) })
    }

    /// What an authenticated client is given, while the helper runs (looked at now, so a
    /// helper that just died is not handed out until its successor serves): its workers in
    /// turn, so clients spread over their threads.
    pub(crate) fn ready(&self) -> Option<UcxReady> {
        let mut running = self.state.running.lock().unwrap_or_else(|p| p.into_inner());
        let r = running.as_mut()?;
        if !matches!(r.child.try_wait(), Ok(None)) {
            return None;
        }
        let ready = r.ready.get(r.next % r.ready.len().max(1)).cloned();
        r.next = r.next.wrapping_add(1);
        ready
    }

    /// The helper's state now.
    pub(crate) fn state(&self) -> UcxPlaneState {
        let mut running = self.state.running.lock().unwrap_or_else(|p| p.into_inner());
        let serving = running
            .as_mut()
            .and_then(|r| matches!(r.child.try_wait(), Ok(None)).then(|| (r.child.id(), r.ready.len())));
        UcxPlaneState {
            serving: serving.is_some(),
            pid: serving.map(|(pid, _)| pid),
            restarts: self.state.restarts.load(Ordering::Relaxed),
            workers: serving.map_or(0, |(_, workers)| workers),
        }
    }
}

impl Drop for UcxExport {
    fn drop(&mut self) {
        self.state.stopping.store(true, Ordering::Release);
        self.state.stopped.notify_all();
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
    }
}

/// Starts the helper and reads what it serves.
fn spawn(launch: &Launch) -> UResult<Running> {
    let fail = UcxError::Plane;
    let mut command = Command::new(&launch.program);
    command
        .arg(UCX_PLANE_ARG)
        .arg(launch.arena_bytes.to_string())
        .arg(launch.transports.as_str())
        .arg(if launch.transports.has_tcp() { "1" } else { "0" })
        .arg(launch.workers.to_string())
        .env_clear()
        .envs(std::env::vars().filter(|(k, _)| k.starts_with("UCX_") || k == "PATH" || k == "LD_LIBRARY_PATH"))
        // UCX logs to stdout by default, where the helper answers the owner.
        .env("UCX_LOG_FILE", std::env::var("UCX_LOG_FILE").unwrap_or_else(|_| "stderr".into()))
        .envs(launch.transports.serving_env(launch.loopback))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let fd = launch.arena_fd.as_raw_fd();
    if fd <= 2 {
        // The child's stdin, stdout and stderr are set up over these before pre_exec runs.
        return Err(fail(format!("the arena's descriptor is {fd}, one of the standard streams")));
    }
    // SAFETY: between fork and exec only dup2 and fcntl run (async-signal-safe); they give the
    // child the arena's read-only descriptor as fd 3 without close-on-exec, nothing else (dup2
    // onto itself leaves the flag, so then it is cleared by hand).
    unsafe {
        command.pre_exec(move || {
            let done = if fd == ARENA_FD { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, ARENA_FD) };
            if done < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| fail(format!("{}: {e}", launch.program.display())))?;
    let stdin = child.stdin.take().ok_or_else(|| fail("no stdin".into()))?;
    let stdout = child.stdout.take().ok_or_else(|| fail("no stdout".into()))?;
    // Its first line, within START_TIMEOUT: a helper stuck in UCX's start-up is killed (its
    // stdout then ends, and the reading thread with it).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(read_ready(&mut BufReader::new(stdout)));
    });
    let outcome = rx.recv_timeout(START_TIMEOUT).unwrap_or_else(|_| Err("it did not start in time".into()));
    match outcome {
        Ok(ready) if ready.iter().all(|r| r.len == launch.arena_bytes) && ready.len() <= launch.workers => {
            Ok(Running { child, stdin, ready, next: 0 })
        }
        outcome => {
            let _ = child.kill();
            let _ = child.wait();
            Err(fail(outcome.err().unwrap_or_else(|| "it served another length or more workers than asked".into())))
        }
    }
}

/// Restarts the helper whenever it dies, until the export is dropped (then stops it: stdin
/// closed, and killed if it is still there after a grace).
fn watch(state: &State, launch: &Launch) {
    let lock = || state.running.lock().unwrap_or_else(|p| p.into_inner());
    let mut running = lock();
    while !state.stopping.load(Ordering::Acquire) {
        let exited = match running.as_mut().map(|r| r.child.try_wait()) {
            Some(Ok(Some(status))) => Some(status.to_string()),
            Some(Err(e)) => Some(e.to_string()),
            Some(Ok(None)) => None,
            None => Some("not running".into()),
        };
        if let Some(why) = exited {
            *running = None;
            tracing::error!(reason = %why, "the UCX plane process ended; restarting it");
            running = state
                .stopped
                .wait_timeout(running, Duration::from_millis(RESTART_PAUSE_MS))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if state.stopping.load(Ordering::Acquire) {
                break;
            }
            // Unlocked while it starts (up to START_TIMEOUT): attaches are answered meanwhile
            // (refused: restarting). One that started as the export stops is stopped below.
            drop(running);
            let started = spawn(launch);
            running = lock();
            match started {
                Ok(r) => {
                    state.restarts.fetch_add(1, Ordering::Relaxed);
                    *running = Some(r);
                }
                Err(e) => tracing::error!(error = %e, "cannot restart the UCX plane process"),
            }
            continue;
        }
        running =
            state.stopped.wait_timeout(running, Duration::from_millis(WATCH_MS)).unwrap_or_else(|p| p.into_inner()).0;
    }
    if let Some(mut r) = running.take() {
        drop(r.stdin);
        for _ in 0..20 {
            if matches!(r.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(WATCH_MS / 2));
        }
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
}
