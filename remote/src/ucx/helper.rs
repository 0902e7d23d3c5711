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

use super::{serve, Context, MemRegion, Transports, UcxError, Worker, UCX_PLANE_VERSION};
use crate::protocol::UcxReady;

/// The argument that starts the helper in `kvtide-owner`.
pub const UCX_PLANE_ARG: &str = "__ucx-plane";
/// The descriptor the arena arrives on.
pub(super) const ARENA_FD: i32 = 3;

/// Runs the helper with `args` (after `UCX_PLANE_ARG`): `<arena bytes> <transports> <allow tcp
/// 0|1>`. Returns the exit code.
pub fn ucx_plane_main(args: &[String]) -> i32 {
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvtide UCX plane: {e}");
            1
        }
    }
}

fn run(args: &[String]) -> Result<(), UcxError> {
    let bad = |what: &'static str| UcxError::Transports(args.join(" "), what);
    let [len, list, allow_tcp] = args else { return Err(bad("expected <arena bytes> <transports> <0|1>")) };
    let len: usize = len.parse().map_err(|_| bad("arena bytes"))?;
    let transports = Transports::parse(list, allow_tcp == "1")?;
    // Die with the owner, whatever way it ends.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    // SAFETY: maps the descriptor the owner passed, read-only and shared; checked below.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, ARENA_FD, 0) };
    if base == libc::MAP_FAILED {
        return Err(UcxError::Call { call: "mmap", status: std::io::Error::last_os_error().to_string() });
    }
    let ctx = Context::new(&transports, true)?;
    // SAFETY: the mapping stays until the process exits (never unmapped).
    let region = unsafe { MemRegion::read_only(&ctx, base.cast(), len) }?;
    let worker = Worker::new(&ctx)?;
    let ready = UcxReady {
        version: UCX_PLANE_VERSION,
        base: base as u64,
        len: len as u64,
        worker_address: worker.address()?,
        rkey: region.packed_rkey()?,
    };
    let mut encoded = Vec::new();
    ready.encode(&mut encoded);
    let line: String = encoded.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| UcxError::Call { call: "stdout", status: e.to_string() })?;
    drop(out);
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = Arc::clone(&stop);
    std::thread::spawn(move || {
        // Nothing is ever written to stdin: EOF means the owner is gone or stopping.
        let _ = std::io::stdin().lock().read_to_end(&mut Vec::new());
        stopping.store(true, Ordering::Release);
    });
    serve(&worker, worker.event_fd()?, &stop);
    drop(worker);
    drop(region);
    Ok(())
}

/// Reads the helper's first line: its `UcxReady`.
pub(super) fn read_ready(stdout: &mut impl BufRead) -> Result<UcxReady, String> {
    let mut line = String::new();
    // Hex of a `UcxReady`: at most two blobs of MAX_UCX_BLOB_BYTES and a few fields.
    let most = 4 * crate::protocol::MAX_UCX_BLOB_BYTES as u64 + 256;
    stdout.take(most).read_line(&mut line).map_err(|e| e.to_string())?;
    let hex = line.trim();
    if hex.is_empty() || !hex.len().is_multiple_of(2) || hex.len() > 4 * crate::protocol::MAX_UCX_BLOB_BYTES {
        return Err("the UCX plane process did not start".into());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|e| e.to_string())?;
    UcxReady::decode(&bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helpers_line_is_checked_and_bounded() {
        let ready = UcxReady { version: 1, base: 4096, len: 1 << 20, worker_address: vec![1; 30], rkey: vec![2; 20] };
        let mut encoded = Vec::new();
        ready.encode(&mut encoded);
        let hex: String = encoded.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(read_ready(&mut format!("{hex}\n").as_bytes()), Ok(ready));
        for bad in ["", "\n", "zz\n", "abc\n", &format!("{}\n", &hex[..hex.len() - 2])] {
            assert!(read_ready(&mut bad.as_bytes()).is_err(), "{bad:?}");
        }
        let endless = "ab".repeat(4 * crate::protocol::MAX_UCX_BLOB_BYTES);
        assert!(read_ready(&mut endless.as_bytes()).is_err(), "an overlong line is refused");
    }
}
