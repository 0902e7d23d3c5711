//! Put values read straight out of a same-host client's memory (`process_vm_readv`): the one
//! copy a put needs (client buffer to arena reservation), the client writing nothing of the
//! owner's memory.
//!
//! Owns the check that lets a connection put this way and the reads themselves. Never reads a
//! process other than the one that connected (`SO_PEERPIDFD`), one with a uid or gid that is not
//! the owner's (the kernel's ptrace check would let a privileged owner read anyone), one whose
//! probe did not show the client's nonce, or one that has exited: a read that ends after the
//! client's process exited is thrown away.

use std::io;

use kvtide::Error as StoreError;
use kvtide_transport::memcpy::copy_nontemporal;

use crate::protocol::{ClientSegments, PutItem, MAX_CLIENT_SEGMENTS, PROBE_BYTES};
use crate::sock::{Pidfd, Stream};

/// Why a connection may not put from its memory (the client then puts through its window).
/// Every failure to read the client's memory gets the same message, so a refusal tells nothing
/// of another process's address space.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refusal {
    #[error("puts from the client's memory need a Unix connection from a process visible here")]
    NotLocal,
    #[error(
        "puts from the client's memory need Linux 6.5 or later (SO_PEERPIDFD), which names the connecting process"
    )]
    NoPeerPidfd,
    #[error(
        "the client runs as user {client}, the owner as {owner}: puts from its memory are for the owner's own user"
    )]
    OtherUser { client: u32, owner: u32 },
    #[error("the owner cannot read this client's memory (it needs the owner's user and group ids in every field, a dumpable process and the probe's bytes at the probe's address)")]
    Unreadable,
}

/// Why one value could not be read from the client's memory.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReadFailure {
    #[error("the value's memory in the client could not be read ({0})")]
    Fault(io::Error),
    #[error("the value's memory in the client ended after {read} of {len} bytes")]
    Short { read: u64, len: u64 },
    #[error("the client's process exited while its values were read")]
    Exited,
    #[error("the owner's thread reading the value failed")]
    Helper,
}

/// Bytes read from the client at a time into a buffer that stays in cache, then streamed into
/// the reservation with non-temporal stores: the kernel's copy straight into the reservation
/// reads every destination line before writing it, which made it 1.5x slower on this project's
/// machines (docs/benchmarks.md).
const BOUNCE_BYTES: usize = 128 << 10;

std::thread_local! {
    /// Each reading thread's bounce buffer.
    static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A batch at least this large is read by two threads (where a core is free): a lone client
/// waits for its batch with its own core idle.
const SPLIT_READ_BYTES: u64 = 4 << 20;

/// What `ClientMemory::read_all` did: bytes read, and the items that failed with why.
pub(super) struct BatchRead {
    pub bytes: u64,
    pub failed: Vec<(usize, ReadFailure)>,
}

/// Whether every uid (real, effective, saved, filesystem) and every gid of process `pid` are
/// `uid` and `gid` (`/proc/<pid>/status`; the caller checks afterwards that the process it holds
/// a pidfd of is still alive, so the file was that process's).
fn ids_are(pid: libc::pid_t, uid: u32, gid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    let all = |field: &str, want: u32| {
        status.lines().find_map(|l| l.strip_prefix(field)).is_some_and(|ids| {
            let ids: Vec<&str> = ids.split_whitespace().collect();
            ids.len() == 4 && ids.iter().all(|id| id.parse::<u32>() == Ok(want))
        })
    };
    all("Uid:", uid) && all("Gid:", gid)
}

/// A connection's client process, whose memory the owner may read put values from.
#[derive(Debug)]
pub(super) struct ClientMemory {
    process: Pidfd,
}

impl ClientMemory {
    /// Checks that the process that connected `stream` runs with this process's user and group
    /// ids, and reads `PROBE_BYTES` at `probe` there, which must be `nonce`.
    pub(super) fn grant(stream: &Stream, probe: u64, nonce: &[u8; PROBE_BYTES]) -> Result<ClientMemory, Refusal> {
        let cred = stream.peer_cred().ok_or(Refusal::NotLocal)?;
        // SAFETY: geteuid and getegid cannot fail.
        let (owner_uid, owner_gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        if cred.uid != owner_uid {
            return Err(Refusal::OtherUser { client: cred.uid, owner: owner_uid });
        }
        // The process that connected, not whichever process holds its pid now or holds the
        // socket: a socket handed to another process still names the one that connected.
        let process = stream.peer_pidfd().ok_or(Refusal::NoPeerPidfd)?;
        // Every id of that process, now, is the owner's: reading it gives the owner nothing its
        // own user and group could not read, even where the owner could read more (root).
        if !ids_are(process.pid(), owner_uid, owner_gid) || process.exited() {
            return Err(Refusal::Unreadable);
        }
        let memory = ClientMemory { process };
        let mut seen = [0u8; PROBE_BYTES];
        let read = memory.read_range(&[(probe, PROBE_BYTES as u64)], 0, &mut seen);
        if read.is_err() || memory.process.exited() || seen != *nonce {
            return Err(Refusal::Unreadable);
        }
        Ok(memory)
    }

    /// Reads a value's `segments` of the client's memory into `dst` (as long as they are);
    /// an error when any byte could not be read or the client exited meanwhile.
    pub(super) fn read(&self, segments: ClientSegments<'_>, dst: &mut [u8]) -> Result<(), ReadFailure> {
        let pairs: Vec<(u64, u64)> = segments.iter().collect();
        debug_assert!(pairs.len() <= MAX_CLIENT_SEGMENTS);
        let len = dst.len() as u64;
        if pairs.iter().try_fold(0u64, |sum, &(_, n)| sum.checked_add(n)) != Some(len) {
            return Err(ReadFailure::Short { read: 0, len });
        }
        BOUNCE.with_borrow_mut(|bounce| {
            if bounce.len() < BOUNCE_BYTES {
                bounce.resize(BOUNCE_BYTES, 0);
            }
            let mut pos = 0u64;
            for chunk in dst.chunks_mut(BOUNCE_BYTES) {
                let staged = &mut bounce[..chunk.len()];
                self.read_range(&pairs, pos, staged)?;
                // SAFETY: `chunk` and `staged` are distinct slices of the same length.
                unsafe { copy_nontemporal(chunk.as_mut_ptr(), staged.as_ptr(), chunk.len()) };
                pos += chunk.len() as u64;
            }
            Ok(())
        })?;
        if self.process.exited() {
            return Err(ReadFailure::Exited);
        }
        Ok(())
    }

    /// Reads every item's value into its reservation (`dsts[i]`; an item without one is skipped,
    /// its error already known), large batches on two threads when `split`.
    pub(super) fn read_all(
        &self,
        items: &[PutItem<'_>],
        dsts: Vec<Result<&mut [u8], StoreError>>,
        split: bool,
    ) -> BatchRead {
        let mut jobs: Vec<(usize, ClientSegments<'_>, &mut [u8])> = items
            .iter()
            .zip(dsts)
            .enumerate()
            .filter_map(|(i, (item, dst))| dst.ok().map(|dst| (i, item.segments, dst)))
            .collect();
        let total: u64 = jobs.iter().map(|j| j.2.len() as u64).sum();
        let read = |jobs: &mut [(usize, ClientSegments<'_>, &mut [u8])]| {
            let mut done = BatchRead { bytes: 0, failed: Vec::new() };
            for (i, segments, dst) in jobs.iter_mut() {
                match self.read(*segments, dst) {
                    Ok(()) => done.bytes += dst.len() as u64,
                    Err(e) => done.failed.push((*i, e)),
                }
            }
            done
        };
        if !split || total < SPLIT_READ_BYTES || jobs.len() < 2 {
            return read(&mut jobs);
        }
        // Split where the first part holds about half the bytes (and at least one item each).
        let mut half = 0u64;
        let cut = jobs
            .iter()
            .position(|j| {
                half += j.2.len() as u64;
                half >= total / 2
            })
            .map_or(1, |p| p + 1)
            .clamp(1, jobs.len() - 1);
        let (first, second) = jobs.split_at_mut(cut);
        let second_items: Vec<usize> = second.iter().map(|j| j.0).collect();
        let (mut done, helper) = std::thread::scope(|s| {
            // No thread to be had (a process limit): this thread reads both halves.
            match std::thread::Builder::new().name("kvtide-read".into()).spawn_scoped(s, || read(second)) {
                Ok(helper) => (read(first), Some(helper.join())),
                Err(_) => (read(first), None),
            }
        });
        match helper {
            Some(Ok(more)) => {
                done.bytes += more.bytes;
                done.failed.extend(more.failed);
            }
            // Only a bug panics a read; its items then fail rather than publish.
            Some(Err(_)) => done.failed.extend(second_items.into_iter().map(|i| (i, ReadFailure::Helper))),
            None => {
                let more = read(&mut jobs[cut..]);
                done.bytes += more.bytes;
                done.failed.extend(more.failed);
            }
        }
        done
    }

    /// Reads bytes `[start, start + out.len())` of the concatenated `pairs` into `out`.
    fn read_range(&self, pairs: &[(u64, u64)], start: u64, out: &mut [u8]) -> Result<(), ReadFailure> {
        let len = out.len() as u64;
        let mut read = 0u64;
        // The kernel stops at the first fault; what was read before it is reported, then the
        // next call starts at the fault and fails with it.
        while read < len {
            let mut skip = start + read;
            let remote: Vec<libc::iovec> = pairs
                .iter()
                .filter_map(|&(addr, n)| {
                    if skip >= n {
                        skip -= n;
                        return None;
                    }
                    let iov = libc::iovec {
                        iov_base: addr.wrapping_add(skip) as *mut libc::c_void,
                        iov_len: (n - skip) as usize,
                    };
                    skip = 0;
                    Some(iov)
                })
                .collect();
            let at = read as usize;
            let local = libc::iovec { iov_base: out[at..].as_mut_ptr().cast(), iov_len: out.len() - at };
            // SAFETY: the local iovec is `out`'s unread tail, memory we own and may write (the
            // kernel writes at most its length); the remote iovecs name the client's memory,
            // which the kernel checks (a bad address is EFAULT, never a write here).
            let n = unsafe {
                libc::process_vm_readv(self.process.pid(), &local, 1, remote.as_ptr(), remote.len() as libc::c_ulong, 0)
            };
            if n < 0 {
                return Err(ReadFailure::Fault(io::Error::last_os_error()));
            }
            if n == 0 {
                return Err(ReadFailure::Short { read, len });
            }
            read += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_memory() -> ClientMemory {
        ClientMemory { process: Pidfd::open(std::process::id() as libc::pid_t).expect("own pidfd") }
    }

    #[test]
    fn values_of_several_segments_are_read_across_bounce_chunks() {
        let memory = own_memory();
        let parts: Vec<Vec<u8>> =
            [100_000usize, 3, 250_000].iter().enumerate().map(|(p, &n)| vec![p as u8 + 1; n]).collect();
        let mut wire = Vec::new();
        ClientSegments::encode(parts.iter().map(|p| (p.as_ptr() as u64, p.len() as u64)), &mut wire);
        let segments = ClientSegments::from_wire(&wire).expect("segments");
        let mut dst = vec![0u8; parts.iter().map(Vec::len).sum()];
        memory.read(segments, &mut dst).expect("read");
        assert_eq!(dst, parts.concat());
        // Lengths that do not add up to the destination, and an address nobody maps.
        assert!(matches!(memory.read(segments, &mut dst[1..]), Err(ReadFailure::Short { .. })));
        let mut bad = Vec::new();
        ClientSegments::encode([(8, 64)], &mut bad);
        let bad = ClientSegments::from_wire(&bad).expect("segments");
        assert!(matches!(memory.read(bad, &mut [0u8; 64]), Err(ReadFailure::Fault(_))));
    }
}
