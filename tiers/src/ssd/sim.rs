//! A deterministic, seeded, fault-injecting disk.
//!
//! Owns an in-memory image of every segment file: what a read sees now (`current`) and what
//! survives a crash (`durable`). It injects EIO, short reads and writes, latency (completions
//! held back for some polls), torn writes and crashes that lose unsynced writes, wholly or in
//! part. It never invents bytes: a crash leaves each unsynced write absent, whole, or a sector
//! prefix of it, as a real disk can.

use std::collections::VecDeque;

use super::disk::{DiskCompletion, DiskIo, DiskOp, DiskOpKind, FileId};

/// Sector size for torn writes.
const SECTOR_BYTES: usize = 512;

/// Fault rates, in parts per million per operation.
#[derive(Clone, Debug, Default)]
pub struct SimFaults {
    pub read_eio_ppm: u32,
    pub write_eio_ppm: u32,
    pub sync_eio_ppm: u32,
    pub short_ppm: u32,
    /// Completions are delayed by 0..=max_delay_polls reaps.
    pub max_delay_polls: u32,
    /// Wall-clock service time per operation (0 in deterministic tests): a slow disk for
    /// engine-level tests that run real threads.
    pub latency_us: u64,
    /// Extra wall-clock time per MiB transferred.
    pub us_per_mib: u64,
}

/// splitmix64: small, seeded, good enough to pick faults.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn chance_ppm(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.below(1_000_000) < u64::from(ppm)
    }
}

struct Pending {
    ready_at: u64,
    ready_time: Option<std::time::Instant>,
    op: DiskOp,
    /// Decided at submit: Err(errno) or the byte count to transfer.
    outcome: Result<usize, i32>,
    /// For syncs: the writes (by sequence) this sync covers.
    covers_upto: u64,
}

struct UnsyncedWrite {
    seq: u64,
    offset: u64,
    data: Vec<u8>,
}

/// The simulated disk. See the module comment.
pub struct SimDisk {
    file_bytes: u64,
    current: Vec<Vec<u8>>,
    durable: Vec<Vec<u8>>,
    unsynced: Vec<Vec<UnsyncedWrite>>,
    pending: VecDeque<Pending>,
    faults: SimFaults,
    rng: SimRng,
    polls: u64,
    write_seq: u64,
    busy_until: Option<std::time::Instant>,
    /// Counts of injected faults, for test reports.
    pub injected: SimInjected,
}

/// What the simulator injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimInjected {
    pub eio: u64,
    pub short: u64,
    pub torn_on_crash: u64,
    pub lost_on_crash: u64,
    pub crashes: u64,
}

// SAFETY: the raw pointers a SimDisk holds are those of submitted operations, which the
// submitter keeps valid until they are reaped (the DiskIo contract); nothing in them is tied to
// the thread that submitted, and the disk is used by one owner at a time (`&mut self`).
unsafe impl Send for SimDisk {}

impl SimDisk {
    /// `files` zero-filled files of `file_bytes` each.
    pub fn new(files: u32, file_bytes: u64, seed: u64, faults: SimFaults) -> SimDisk {
        SimDisk {
            file_bytes,
            current: (0..files).map(|_| vec![0u8; file_bytes as usize]).collect(),
            durable: (0..files).map(|_| vec![0u8; file_bytes as usize]).collect(),
            unsynced: (0..files).map(|_| Vec::new()).collect(),
            pending: VecDeque::new(),
            faults,
            rng: SimRng::new(seed),
            polls: 0,
            write_seq: 0,
            busy_until: None,
            injected: SimInjected::default(),
        }
    }

    /// Changes the fault rates (e.g. none during recovery checks).
    pub fn set_faults(&mut self, faults: SimFaults) {
        self.faults = faults;
    }

    /// Power loss: in-flight operations vanish; each write not yet synced is lost, kept, or
    /// torn to a sector prefix. Afterwards reads see exactly what survived.
    pub fn crash(&mut self) {
        self.injected.crashes += 1;
        self.pending.clear();
        for file in 0..self.current.len() {
            let mut image = self.durable[file].clone();
            for write in std::mem::take(&mut self.unsynced[file]) {
                let start = write.offset as usize;
                match self.rng.below(3) {
                    0 => self.injected.lost_on_crash += 1,
                    1 => image[start..start + write.data.len()].copy_from_slice(&write.data),
                    _ => {
                        let sectors = write.data.len().div_ceil(SECTOR_BYTES);
                        let keep = (self.rng.below(sectors as u64) as usize * SECTOR_BYTES).min(write.data.len());
                        image[start..start + keep].copy_from_slice(&write.data[..keep]);
                        self.injected.torn_on_crash += 1;
                    }
                }
            }
            self.durable[file] = image.clone();
            self.current[file] = image;
        }
    }

    /// Flips one bit of a file image (both current and durable): a rotted sector.
    pub fn flip_bit(&mut self, file: FileId, offset: u64, bit: u8) {
        let f = file as usize;
        self.current[f][offset as usize] ^= 1 << (bit % 8);
        self.durable[f][offset as usize] ^= 1 << (bit % 8);
    }

    fn in_bounds(&self, file: FileId, offset: u64, len: u32) -> bool {
        (file as usize) < self.current.len()
            && offset.checked_add(u64::from(len)).is_some_and(|end| end <= self.file_bytes)
    }

    fn complete(&mut self, p: Pending) -> DiskCompletion {
        let op = p.op;
        let file = op.file as usize;
        let result = match (p.outcome, op.kind) {
            (Err(errno), _) => -i64::from(errno),
            (Ok(n), DiskOpKind::Read { buf, offset, .. }) => {
                let start = offset as usize;
                // SAFETY: the submitter guaranteed `buf` is valid for `len >= n` bytes until this
                // completion is reaped; the source range was bounds-checked at submit.
                unsafe { std::ptr::copy_nonoverlapping(self.current[file][start..start + n].as_ptr(), buf, n) };
                n as i64
            }
            (Ok(n), DiskOpKind::Write { buf, offset, .. }) => {
                // SAFETY: as for reads: `buf` is valid for `len >= n` bytes until reaped.
                let data = unsafe { std::slice::from_raw_parts(buf, n) }.to_vec();
                let start = offset as usize;
                self.current[file][start..start + n].copy_from_slice(&data);
                self.write_seq += 1;
                self.unsynced[file].push(UnsyncedWrite { seq: self.write_seq, offset, data });
                n as i64
            }
            (Ok(_), DiskOpKind::Sync) => {
                let upto = p.covers_upto;
                let (synced, rest): (Vec<_>, Vec<_>) =
                    std::mem::take(&mut self.unsynced[file]).into_iter().partition(|w| w.seq <= upto);
                for w in synced {
                    let start = w.offset as usize;
                    self.durable[file][start..start + w.data.len()].copy_from_slice(&w.data);
                }
                self.unsynced[file] = rest;
                0
            }
        };
        DiskCompletion { token: op.token, result }
    }
}

/// The current time, read only when some pending operation has a wall-clock deadline.
fn p_now(pending: &VecDeque<Pending>) -> Option<std::time::Instant> {
    pending.iter().any(|p| p.ready_time.is_some()).then(std::time::Instant::now)
}

impl DiskIo for SimDisk {
    unsafe fn submit(&mut self, op: DiskOp) -> Result<(), DiskOp> {
        let delay = if self.faults.max_delay_polls > 0 {
            self.rng.below(u64::from(self.faults.max_delay_polls) + 1)
        } else {
            0
        };
        let outcome = match op.kind {
            DiskOpKind::Read { len, offset, .. } | DiskOpKind::Write { len, offset, .. } => {
                let eio_ppm = if matches!(op.kind, DiskOpKind::Read { .. }) {
                    self.faults.read_eio_ppm
                } else {
                    self.faults.write_eio_ppm
                };
                if !self.in_bounds(op.file, offset, len) {
                    Err(libc::EINVAL)
                } else if self.rng.chance_ppm(eio_ppm) {
                    self.injected.eio += 1;
                    Err(libc::EIO)
                } else if len > SECTOR_BYTES as u32 && self.rng.chance_ppm(self.faults.short_ppm) {
                    self.injected.short += 1;
                    let sectors = u64::from(len) / SECTOR_BYTES as u64;
                    let n = (SECTOR_BYTES as u64 * (1 + self.rng.below(sectors.saturating_sub(1).max(1))))
                        .min(u64::from(len) - 1);
                    Ok(n as usize)
                } else {
                    Ok(len as usize)
                }
            }
            DiskOpKind::Sync => {
                if (op.file as usize) >= self.current.len() {
                    Err(libc::EBADF)
                } else if self.rng.chance_ppm(self.faults.sync_eio_ppm) {
                    self.injected.eio += 1;
                    Err(libc::EIO)
                } else {
                    Ok(0)
                }
            }
        };
        // A sync covers the writes completed so far (not those still pending).
        let covers_upto = self.write_seq;
        let bytes = match op.kind {
            DiskOpKind::Read { len, .. } | DiskOpKind::Write { len, .. } => u64::from(len),
            DiskOpKind::Sync => 0,
        };
        let service_us = self.faults.latency_us + self.faults.us_per_mib * bytes / (1 << 20);
        // Operations are served one after another, like one queue on one device.
        let ready_time = (service_us > 0).then(|| {
            let start = self.busy_until.map_or(std::time::Instant::now(), |b| b.max(std::time::Instant::now()));
            let done = start + std::time::Duration::from_micros(service_us);
            self.busy_until = Some(done);
            done
        });
        self.pending.push_back(Pending { ready_at: self.polls + delay, ready_time, op, outcome, covers_upto });
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<DiskCompletion>) {
        self.polls += 1;
        let mut still = VecDeque::with_capacity(self.pending.len());
        let now = p_now(&self.pending);
        while let Some(p) = self.pending.pop_front() {
            if p.ready_at <= self.polls && p.ready_time.is_none_or(|t| now.is_some_and(|n| t <= n)) {
                let c = self.complete(p);
                out.push(c);
            } else {
                still.push_back(p);
            }
        }
        self.pending = still;
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn read_at(&mut self, file: FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let f = self.current.get(file as usize).ok_or_else(|| std::io::Error::from_raw_os_error(libc::EBADF))?;
        let start = (offset as usize).min(f.len());
        let n = buf.len().min(f.len() - start);
        buf[..n].copy_from_slice(&f[start..start + n]);
        Ok(n)
    }

    fn file_count(&self) -> u32 {
        self.current.len() as u32
    }

    fn file_bytes(&self) -> u64 {
        self.file_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(disk: &mut SimDisk) -> Vec<DiskCompletion> {
        let mut out = Vec::new();
        while disk.in_flight() > 0 {
            disk.reap(&mut out);
        }
        out
    }

    #[test]
    fn writes_are_visible_then_durable_after_sync() {
        let mut disk = SimDisk::new(1, 1 << 16, 1, SimFaults::default());
        let data = vec![7u8; 4096];
        // SAFETY: `data` outlives the run below, which reaps the completion.
        unsafe {
            disk.submit(DiskOp {
                token: 1,
                file: 0,
                kind: DiskOpKind::Write { buf: data.as_ptr(), len: 4096, offset: 8192 },
            })
            .expect("submit");
        }
        assert_eq!(run(&mut disk), vec![DiskCompletion { token: 1, result: 4096 }]);
        let mut back = vec![0u8; 4096];
        disk.read_at(0, 8192, &mut back).expect("read");
        assert_eq!(back, data);
        // SAFETY: a sync carries no memory.
        unsafe { disk.submit(DiskOp { token: 2, file: 0, kind: DiskOpKind::Sync }).expect("sync") };
        run(&mut disk);
        disk.crash();
        disk.read_at(0, 8192, &mut back).expect("read");
        assert_eq!(back, data, "synced data survives a crash");
    }

    #[test]
    fn crash_loses_or_tears_unsynced_writes_only() {
        let mut seen_lost = false;
        let mut seen_torn_or_whole = false;
        for seed in 0..40 {
            let mut disk = SimDisk::new(1, 1 << 16, seed, SimFaults::default());
            let data = vec![0xABu8; 8192];
            // SAFETY: `data` outlives the run below.
            unsafe {
                disk.submit(DiskOp {
                    token: 1,
                    file: 0,
                    kind: DiskOpKind::Write { buf: data.as_ptr(), len: 8192, offset: 0 },
                })
                .expect("submit");
            }
            run(&mut disk);
            disk.crash();
            let mut back = vec![0u8; 8192];
            disk.read_at(0, 0, &mut back).expect("read");
            let kept = back.iter().take_while(|&&b| b == 0xAB).count();
            assert!(back[kept..].iter().all(|&b| b == 0), "only a prefix survives (seed {seed})");
            assert_eq!(kept % SECTOR_BYTES, 0);
            seen_lost |= kept == 0;
            seen_torn_or_whole |= kept > 0;
        }
        assert!(seen_lost && seen_torn_or_whole);
    }

    #[test]
    fn faults_are_injected_deterministically() {
        let faults =
            SimFaults { read_eio_ppm: 300_000, short_ppm: 300_000, max_delay_polls: 3, ..SimFaults::default() };
        let results = |seed| {
            let mut disk = SimDisk::new(1, 1 << 20, seed, faults.clone());
            let mut buf = vec![0u8; 1 << 16];
            for token in 0..50 {
                // SAFETY: `buf` outlives the run below; every completion is reaped before return.
                unsafe {
                    disk.submit(DiskOp {
                        token,
                        file: 0,
                        kind: DiskOpKind::Read { buf: buf.as_mut_ptr(), len: 1 << 16, offset: 0 },
                    })
                    .expect("submit");
                }
            }
            let out = run(&mut disk);
            (out, disk.injected)
        };
        let (a, ia) = results(9);
        let (b, ib) = results(9);
        assert_eq!(a, b);
        assert_eq!(ia, ib);
        assert!(ia.eio > 0 && ia.short > 0);
        assert!(a.iter().all(|c| c.result == -i64::from(libc::EIO) || (c.result > 0 && c.result <= 1 << 16)));
    }
}
