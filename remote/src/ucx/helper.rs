//! The UCX plane's own process: `kvtide-owner __ucx-plane`, started and restarted by the owner.
//!
//! Owns the process that UCX peers talk to: it maps the arena read-only from the descriptor the
//! owner passed (fd 3), registers that mapping for remote reads, writes its `UcxReady` (hex, one
//! line) on stdout and progresses its worker until stdin closes (the owner stopped or died).
//! Never sees the owner's token, memory or other descriptors: a peer that abuses UCX (its tcp
//! transport serves reads and writes at any address a peer names, and UCX 1.13 aborts the
//! process when a peer vanishes mid-get) reaches this process only, whose memory holds the
//! read-only arena mapping and UCX's own state.

use std::io::{BufRead, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{serve, Context, MemRegion, Transports, UcxError, Worker, MAX_UCX_WORKERS, UCX_PLANE_VERSION};
use crate::protocol::UcxReady;

/// The argument that starts the helper in `kvtide-owner`.
pub const UCX_PLANE_ARG: &str = "__ucx-plane";
/// The line after the last worker's.
const END_LINE: &str = "end";
/// The first line of a helper that could not serve starts with this, then says why.
const ERROR_PREFIX: &str = "error: ";
/// Lines the owner skips before the helper's answer (UCX's log lines).
const MAX_OTHER_LINES: usize = 64;
/// The most of that reason the owner keeps.
const MAX_REASON_BYTES: usize = 1024;
/// The descriptor the arena arrives on.
pub(super) const ARENA_FD: i32 = 3;

/// Runs the helper with `args` (after `UCX_PLANE_ARG`): `<arena bytes> <transports> <allow tcp
/// 0|1> <workers>`. Returns the exit code.
pub fn ucx_plane_main(args: &[String]) -> i32 {
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            // The owner reads why from the first line of stdout (and logs it); stderr is its.
            println!("{ERROR_PREFIX}{}", e.to_string().replace('\n', " "));
            eprintln!("kvtide UCX plane: {e}");
            1
        }
    }
}

fn run(args: &[String]) -> Result<(), UcxError> {
    let bad = |what: &'static str| UcxError::Transports(args.join(" "), what);
    let [len, list, allow_tcp, workers] = args else {
        return Err(bad("expected <arena bytes> <transports> <0|1> <workers>"));
    };
    let len: usize = len.parse().map_err(|_| bad("arena bytes"))?;
    let workers: usize = workers
        .parse()
        .ok()
        .filter(|n| (1..=MAX_UCX_WORKERS).contains(n))
        .ok_or_else(|| bad("a worker count out of range"))?;
    let transports = Transports::parse(list, allow_tcp == "1")?;
    // Die with the owner, whatever way it ends.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    // SAFETY: maps the descriptor the owner passed, read-only and shared; checked below.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, ARENA_FD, 0) };
    if base == libc::MAP_FAILED {
        return Err(UcxError::Call { call: "mmap", status: std::io::Error::last_os_error().to_string() });
    }
    // libucp loaded first (the confinement then lets its directory be read, for UCX's
    // modules), before UCX starts threads: what a peer that writes this process's memory
    // could do next is kept to this process (docs/owner.md).
    super::ucx_available().map_err(UcxError::Unavailable)?;
    let confinement = super::sandbox::confine();
    match (&confinement.landlock, &confinement.seccomp) {
        (Ok(abi), Ok(())) => eprintln!("kvtide UCX plane: confined (Landlock ABI {abi}, seccomp)"),
        (landlock, seccomp) => {
            eprintln!("kvtide UCX plane: NOT fully confined: Landlock {landlock:?}, seccomp {seccomp:?}")
        }
    }
    // The owner set UCX_NET_DEVICES (loopback only) and the tcp settings in its environment.
    let ctx = Context::new(&transports, true, &[])?;
    // SAFETY: the mapping stays until the process exits (never unmapped).
    let region = unsafe { MemRegion::read_only(&ctx, base.cast(), len) }?;
    let rkey = region.packed_rkey()?;
    // Workers of one context: the region's key serves gets through any of them.
    let mut served = Vec::with_capacity(workers);
    for _ in 0..workers {
        let worker = Worker::new(&ctx)?;
        let (address, fd) = (worker.address()?, worker.event_fd()?);
        served.push((worker, address, fd));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = Arc::clone(&stop);
    std::thread::spawn(move || {
        // Nothing is ever written to stdin: EOF means the owner is gone or stopping.
        let _ = std::io::stdin().lock().read_to_end(&mut Vec::new());
        stopping.store(true, Ordering::Release);
    });
    // A thread per worker, which it moves to and is the only user of (the first on this
    // thread); every worker is destroyed, its thread ended, before the region.
    let answered = std::thread::scope(|scope| {
        let mut served = served.into_iter();
        let Some((first, first_address, first_fd)) = served.next() else {
            return Err(UcxError::Plane("no worker".into()));
        };
        let mut addresses = vec![first_address];
        for (worker, address, fd) in served {
            let stop = &stop;
            let spawned = std::thread::Builder::new()
                .name("kvtide-ucx-worker".into())
                .spawn_scoped(scope, move || serve(&worker, fd, stop));
            match spawned {
                Ok(_) => addresses.push(address),
                // Not handed out: the others serve.
                Err(e) => eprintln!("kvtide UCX plane: a worker's thread did not start: {e}"),
            }
        }
        // One line per serving worker; the owner hands each attaching client one of them.
        let mut lines = String::new();
        for worker_address in addresses {
            let ready = UcxReady {
                version: UCX_PLANE_VERSION,
                base: base as u64,
                len: len as u64,
                worker_address,
                rkey: rkey.clone(),
            };
            lines.push_str(&ready_line(&ready));
        }
        lines.push_str(END_LINE);
        lines.push('\n');
        let mut out = std::io::stdout().lock();
        let written = out
            .write_all(lines.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| UcxError::Call { call: "stdout", status: e.to_string() });
        drop(out);
        if written.is_ok() {
            serve(&first, first_fd, &stop);
        }
        stop.store(true, Ordering::Release);
        written
    });
    drop(region);
    answered
}

/// A worker's `UcxReady` as the helper writes it: hex, one line.
fn ready_line(ready: &UcxReady) -> String {
    let mut encoded = Vec::new();
    ready.encode(&mut encoded);
    let mut line: String = encoded.iter().map(|b| format!("{b:02x}")).collect();
    line.push('\n');
    line
}

/// Reads what the helper serves from its stdout: a `UcxReady` per worker, then `END_LINE`, or
/// its reason for not serving, past at most `MAX_OTHER_LINES` other lines (UCX's own log lines,
/// should `UCX_LOG_FILE` send them there), all within a bounded number of bytes.
pub(super) fn read_ready(stdout: &mut impl BufRead) -> Result<Vec<UcxReady>, String> {
    // Hex of a `UcxReady`: at most two blobs of MAX_UCX_BLOB_BYTES and a few fields.
    let most = 4 * crate::protocol::MAX_UCX_BLOB_BYTES as u64 + 256;
    let mut reader = stdout.take((most + 2) * MAX_UCX_WORKERS as u64 + MAX_OTHER_LINES as u64 * 4096);
    let mut readies = Vec::new();
    let mut others = 0;
    loop {
        let mut line = String::new();
        (&mut reader).take(most).read_line(&mut line).map_err(|e| e.to_string())?;
        if line.is_empty() {
            return Err("the UCX plane process did not start".into());
        }
        if let Some(reason) = line.strip_prefix(ERROR_PREFIX) {
            let reason: String = reason.trim().chars().filter(|c| !c.is_control()).take(MAX_REASON_BYTES).collect();
            return Err(if reason.is_empty() { "it gave no reason".into() } else { reason });
        }
        let hex = line.trim();
        if hex == END_LINE {
            return if readies.is_empty() { Err("it serves no worker".into()) } else { Ok(readies) };
        }
        if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            others += 1;
            if others > MAX_OTHER_LINES {
                return Err("the UCX plane process did not start".into());
            }
            continue;
        }
        if !hex.len().is_multiple_of(2) || hex.len() > 4 * crate::protocol::MAX_UCX_BLOB_BYTES {
            return Err("its address line is malformed".into());
        }
        if readies.len() == MAX_UCX_WORKERS {
            return Err(format!("it serves more than {MAX_UCX_WORKERS} workers"));
        }
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|e| e.to_string())?;
        readies.push(UcxReady::decode(&bytes).map_err(|e| e.to_string())?);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helpers_lines_are_checked_and_bounded() {
        let ready = |worker: u8| UcxReady {
            version: 1,
            base: 4096,
            len: 1 << 20,
            worker_address: vec![worker; 30],
            rkey: vec![2; 20],
        };
        let hex_of = |r: &UcxReady| ready_line(r).trim_end().to_string();
        let hex = hex_of(&ready(1));
        assert_eq!(read_ready(&mut format!("{hex}\n{END_LINE}\n").as_bytes()), Ok(vec![ready(1)]));
        let three = format!("{hex}\n{}\n{}\n{END_LINE}\n", hex_of(&ready(2)), hex_of(&ready(3)));
        assert_eq!(read_ready(&mut three.as_bytes()), Ok(vec![ready(1), ready(2), ready(3)]), "a line per worker");
        assert!(read_ready(&mut format!("{hex}\n").as_bytes()).is_err(), "cut before its end line");
        assert!(read_ready(&mut format!("{END_LINE}\n").as_bytes()).is_err(), "no worker");
        let too_many = format!("{}{END_LINE}\n", format!("{hex}\n").repeat(MAX_UCX_WORKERS + 1));
        assert!(read_ready(&mut too_many.as_bytes()).is_err_and(|e| e.contains("more than")));
        let long = format!("{ERROR_PREFIX}{}\u{1b}[0m\n", "x".repeat(5000));
        assert_eq!(read_ready(&mut long.as_bytes()), Err("x".repeat(MAX_REASON_BYTES)), "its reason, bounded");
        let no_device = format!("{ERROR_PREFIX}{}\n", UcxError::NoDevice("rc,dc,ud".into()));
        assert!(read_ready(&mut no_device.as_bytes()).is_err_and(|e| e.contains("no device for the transports")));
        let after_logs = format!(
            "[1.2] [vm:1] ucp_context.c:1014 UCX WARN transports 'rc' are not available\n\n{hex}\n[log]\n{END_LINE}\n"
        );
        assert!(read_ready(&mut after_logs.as_bytes()).is_ok(), "UCX's log lines around the answer are skipped");
        let endless = "[log]\n".repeat(1000);
        assert!(read_ready(&mut endless.as_bytes()).is_err(), "only so many");
        for bad in ["", "\n", "zz\n", "abc\n", "\u{e9}\n", "0\u{e9}0\n", &format!("{}\n", &hex[..hex.len() - 2])] {
            assert!(read_ready(&mut format!("{bad}{END_LINE}\n").as_bytes()).is_err(), "{bad:?}");
        }
        let endless = "ab".repeat(4 * crate::protocol::MAX_UCX_BLOB_BYTES);
        assert!(read_ready(&mut endless.as_bytes()).is_err(), "an overlong line is refused");
    }
}
