//! Deterministic simulation of a shard with an SSD tier on the fault-injecting disk.
//!
//! Each seed drives one shard core through random puts and upserts (write-back or
//! write-through), gets, removes, crashes and clean shutdowns on a `SimDisk` that injects EIO,
//! short transfers, latency, torn and lost writes. After every restart a fresh core recovers from
//! what survived. Checked every step: no read returns bytes that differ from a version written
//! for that key; at run time a read sees the latest committed version; after a crash every
//! acknowledged-durable object is back byte-exact (unless an SSD eviction let objects leave);
//! after a clean restart every key reads its latest value or (with faults) is absent, never an
//! older one, and a key absent before stays absent; a key a restart found absent never comes
//! back at a later restart; held-resource counters return to zero.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use kvtide_tiers::dram::Arena;
use kvtide_tiers::eviction::EvictionPolicy;
use kvtide_tiers::ssd::{DiskIo, SimDisk, SimFaults, SimRng};

use super::*;

const SEGMENT_BYTES: u64 = 1 << 20;

thread_local! {
    /// Each core of a scenario gets a different (but reproducible) epoch seed, as a restarted
    /// process would.
    static EPOCH_SEED: std::cell::Cell<u64> = const { std::cell::Cell::new(1) };
}

fn new_core(arena: &Arc<Arena>, segments: u32, write_through: bool, promote: bool) -> ShardCore {
    core_with(arena, ssd_config(segments, write_through, promote))
}

fn ssd_config(segments: u32, write_through: bool, promote: bool) -> SsdConfig {
    SsdConfig {
        segments,
        segment_bytes: SEGMENT_BYTES,
        write_through,
        restore_budget_bytes: 256 << 10,
        promote_on_hit: promote,
        epoch_seed: EPOCH_SEED.with(|s| {
            let v = s.get();
            s.set(v.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407));
            v
        }),
        max_pending_tombstones: DEFAULT_MAX_PENDING_TOMBSTONES,
        // Small pieces, so progressive loads of the simulation's values take several reads.
        load_piece_bytes: 8 << 10,
    }
}

fn core_with(arena: &Arc<Arena>, ssd: SsdConfig) -> ShardCore {
    let slice = arena.slice(0).expect("slice");
    let config = ShardConfig {
        high_watermark_bytes: slice.len_bytes() as u64 * 95 / 100,
        low_watermark_bytes: slice.len_bytes() as u64 * 85 / 100,
        policy: EvictionPolicy::S3Fifo,
        align_bytes: 64,
        max_objects: 4096,
        max_leases: 4096,
    };
    let counters = Arc::new(ShardCounters::default());
    let index = crate::shard::published::IndexWriter::new(
        Arc::clone(&counters),
        config.max_objects,
        crate::shard::key_index_hash,
    );
    ShardCore::with_ssd(config, slice, counters, Some(ssd), index).expect("core")
}

/// Moves disk work until nothing is queued or in flight.
fn pump(core: &mut ShardCore, disk: &mut SimDisk) {
    let mut ops = Vec::new();
    let mut done = Vec::new();
    for round in 0..1_000_000 {
        if round % 200_000 == 199_999 && std::env::var("KVTIDE_SIM_TRACE").is_ok() {
            eprintln!("pump round {round}: {}", core.ssd.as_ref().map(|s| s.describe()).unwrap_or_default());
        }
        core.schedule_syncs();
        core.take_disk_ops(&mut ops);
        for op in ops.drain(..) {
            // SAFETY: op buffers are arena memory the core holds until the completion arrives,
            // and the arena outlives the disk's pending operations (we pump them all).
            unsafe { disk.submit(op) }.expect("sim queue never fills");
        }
        disk.reap(&mut done);
        let progressed = !done.is_empty();
        for c in done.drain(..) {
            core.on_disk_completion(c);
        }
        if !progressed && disk.in_flight() == 0 && core.disk_ops_in_flight() == 0 {
            return;
        }
    }
    panic!("disk work never settled: {}", core.ssd.as_ref().map(|s| s.describe()).unwrap_or_default());
}

fn run_batch<T: 'static>(
    core: &mut ShardCore,
    disk: &mut SimDisk,
    call: impl FnOnce(&mut ShardCore, Done<Vec<T>>),
) -> T {
    let cell = Rc::new(RefCell::new(None));
    let sink = Rc::clone(&cell);
    call(core, Box::new(move |mut v: Vec<T>| *sink.borrow_mut() = v.pop()));
    for _ in 0..1000 {
        if let Some(v) = cell.borrow_mut().take() {
            return v;
        }
        pump(core, disk);
    }
    panic!(
        "request never finished: {}; waiters {}, demoting {}",
        core.ssd.as_ref().map(|s| s.describe()).unwrap_or_default(),
        core.waiters.len(),
        core.demoting_bytes
    );
}

fn put(core: &mut ShardCore, disk: &mut SimDisk, key: &[u8], value: &[u8]) -> Result<()> {
    let grant = run_batch(core, disk, |c, d| c.reserve_batch(vec![(key.into(), value.len() as u64)], true, d))?;
    // SAFETY: the reservation gives us `len` exclusive bytes at grant.ptr.
    unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), grant.ptr.as_ptr(), value.len()) };
    run_batch(core, disk, |c, d| c.commit_batch(vec![grant.object], true, false, d))
}

fn get(core: &mut ShardCore, disk: &mut SimDisk, key: &[u8]) -> Result<Vec<u8>> {
    let grant = run_batch(core, disk, |c, d| c.lease_read_batch(vec![key.into()], None, false, d))?;
    // SAFETY: the lease keeps `len` bytes at grant.ptr in place until released below.
    let bytes = unsafe { std::slice::from_raw_parts(grant.ptr.as_ptr(), grant.len as usize) }.to_vec();
    core.release(grant.lease);
    Ok(bytes)
}

/// A read as the stream driver makes it: leased as soon as its SSD load starts, the value's
/// checked front compared with `expect` at every step of the disk while it grows. With
/// `give_up`, the lease goes back part-way (a dropped handle): `Ok(None)`. Whatever happens, the
/// load has ended when this returns.
fn early_get(
    core: &mut ShardCore,
    disk: &mut SimDisk,
    key: &[u8],
    expect: Option<&[u8]>,
    give_up: bool,
) -> Result<Option<Vec<u8>>> {
    let grant = run_batch(core, disk, |c, d| c.lease_read_batch(vec![key.into()], None, true, d))?;
    let read = |offset: u64, len: u64| {
        // SAFETY: the lease keeps the buffer in place; these bytes were reported checked (or
        // the object is DRAM-resident), so nothing writes them any more.
        unsafe { std::slice::from_raw_parts(grant.ptr.as_ptr().add(offset as usize), len as usize) }.to_vec()
    };
    let Some(landing) = grant.landing.clone() else {
        let bytes = read(0, grant.len);
        core.release(grant.lease);
        return Ok(Some(bytes));
    };
    for round in 0..1_000_000 {
        let (offset, ready, end) = landing.snapshot();
        if let (Some(offset), Some(expect)) = (offset, expect) {
            let front = read(offset, ready);
            assert!(expect.len() as u64 >= ready, "the front passed the value's end");
            assert_eq!(front, expect[..ready as usize], "the checked front differs from the written value");
        }
        match end {
            Some(Ok(())) => {
                let bytes = read(offset.unwrap_or(0), grant.len);
                core.release(grant.lease);
                return Ok(Some(bytes));
            }
            Some(Err(e)) => {
                core.release(grant.lease);
                return Err(e);
            }
            None if give_up && (ready > 0 || round > 3) => {
                core.release(grant.lease);
                pump(core, disk);
                return Ok(None);
            }
            None => pump_some(core, disk, 1),
        }
    }
    panic!("an early read's load never ended: {}", core.ssd.as_ref().map(|s| s.describe()).unwrap_or_default());
}

fn value(key: u32, version: u32, len: usize) -> Vec<u8> {
    let mut rng = SimRng::new(u64::from(key) << 32 | u64::from(version));
    let mut v: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    if len >= 8 {
        v[..4].copy_from_slice(&key.to_le_bytes());
        v[4..8].copy_from_slice(&version.to_le_bytes());
    }
    v
}

#[derive(Default)]
struct KeyModel {
    /// What a read must return now, if the key is present.
    latest: Option<Vec<u8>>,
    /// Every version ever offered for this key: a read may never return anything else.
    written: Vec<Vec<u8>>,
    /// The last operation was a put acknowledged durable.
    durable: Option<Vec<u8>>,
    /// A restart found the key absent and nothing put it since: no later restart may find it,
    /// unless it was evicted (not removed) with `evicted_value`, which may come back.
    absent_since_restart: bool,
    evicted_value: Option<Vec<u8>>,
    /// The value a remove since the last clean restart took away: a crash may undo the remove
    /// (its tombstone not yet durable), and the key may then leave again by eviction.
    removed_value: Option<Vec<u8>>,
    /// Values offered since the last restart: a put that failed may still have reached the
    /// disk, so a crash may bring one back (never anything older).
    offered_since_restart: Vec<Vec<u8>>,
}

struct Outcome {
    durable_checked: u64,
    crashes: u64,
    clean_restarts: u64,
    compactions: u64,
    evicted_segments: u64,
}

/// A clean shutdown as the shard loop runs it: flush dirty objects and tombstones, sync, settle.
fn clean_shutdown(core: &mut ShardCore, disk: &mut SimDisk) {
    for _ in 0..100_000 {
        if core.flush_for_shutdown(true, true) {
            core.sync_everything();
            pump(core, disk);
            if core.disk_ops_in_flight() == 0 && core.flush_for_shutdown(true, true) {
                return;
            }
        }
        pump_some(core, disk, 1);
    }
    panic!("clean shutdown never settled: {}", core.ssd.as_ref().map(|s| s.describe()).unwrap_or_default());
}

/// One scenario's state beside the core under test: the disk, the model of every key and what
/// was counted so far. The core stays with the caller, so a restart can drop it before its
/// successor is made, as a restarted process would.
struct Sim {
    seed: u64,
    segments: u32,
    write_through: bool,
    promote: bool,
    faults: SimFaults,
    rng: SimRng,
    arena: Arc<Arena>,
    disk: SimDisk,
    model: HashMap<u32, KeyModel>,
    version: u32,
    /// An SSD eviction happened: durable keys may have left legitimately.
    evicted: bool,
    out: Outcome,
}

/// What a clean shutdown saw before the restart, to judge each key after it.
struct BeforeRestart {
    present: HashMap<u32, bool>,
    /// Each key's state as `{:?}` writes it, for the failure messages.
    states: HashMap<u32, String>,
    /// Nothing could have been lost: faults were off and nothing was evicted or skipped.
    lossless: bool,
    tombstones_lost: bool,
    report: RecoveryReport,
}

fn ctx(seed: u64, step: usize) -> String {
    format!("seed {seed} step {step}")
}

/// The key `KVTIDE_SIM_KEY` names, traced on stderr.
fn traced_key() -> Option<u32> {
    std::env::var("KVTIDE_SIM_KEY").ok().and_then(|v| v.parse::<u32>().ok())
}

/// Prints every record of `key` on the disk, segment by segment.
fn dump_records(disk: &mut SimDisk, segments: u32, key: &[u8]) {
    for seg in 0..segments {
        let scan = kvtide_tiers::ssd::scan_segment(disk, seg).expect("scan");
        eprintln!("  seg {seg} epoch {:?} header seq {}", scan.epoch, scan.header_seq);
        for r in scan.records.iter().filter(|r| r.key == key) {
            eprintln!("    {:?} seq {} at {}", r.kind, r.seq, r.location.offset);
        }
    }
}

fn scenario(seed: u64, segments: u32, ops: usize) -> Outcome {
    if std::env::var("KVTIDE_SIM_TRACE").is_ok() {
        eprintln!("scenario seed {seed}, {segments} segments");
    }
    let (mut sim, mut core) = Sim::new(seed, segments);
    let keys = 24 + sim.rng.below(40) as u32;
    for step in 0..ops {
        let k = sim.rng.below(u64::from(keys)) as u32;
        let key = format!("k{k}").into_bytes();
        let trace = traced_key() == Some(k);
        match sim.rng.below(22) {
            0..=8 => sim.put(&mut core, step, k, &key, trace),
            9..=16 => sim.get(&mut core, step, k, &key),
            17 | 21 => sim.remove(&mut core, step, k, &key, trace),
            18 => pump(&mut core, &mut sim.disk),
            20 => core = sim.clean_restart(core, step),
            _ => core = sim.crash(core, step),
        }
        core.check_invariants().unwrap_or_else(|e| panic!("{}: {e}", ctx(seed, step)));
    }
    sim.finish(core)
}

impl Sim {
    fn new(seed: u64, segments: u32) -> (Sim, ShardCore) {
        let mut rng = SimRng::new(seed);
        let write_through = rng.below(2) == 0;
        let promote = rng.below(4) != 0;
        let faults = SimFaults {
            read_eio_ppm: [0, 0, 20_000, 50_000][rng.below(4) as usize],
            write_eio_ppm: [0, 0, 20_000, 50_000][rng.below(4) as usize],
            sync_eio_ppm: [0, 0, 0, 30_000][rng.below(4) as usize],
            short_ppm: [0, 100_000, 300_000][rng.below(3) as usize],
            max_delay_polls: rng.below(4) as u32,
            ..SimFaults::default()
        };
        let arena = Arena::new(2 << 20, 1).expect("arena");
        let mut disk = SimDisk::new(segments, SEGMENT_BYTES, seed ^ 0xD15C, faults.clone());
        let mut core = new_core(&arena, segments, write_through, promote);
        core.recover(&mut disk).expect("recover empty");
        let out = Outcome { durable_checked: 0, crashes: 0, clean_restarts: 0, compactions: 0, evicted_segments: 0 };
        let sim = Sim {
            seed,
            segments,
            write_through,
            promote,
            faults,
            rng,
            arena,
            disk,
            model: HashMap::new(),
            version: 0,
            evicted: false,
            out,
        };
        (sim, core)
    }

    /// A put of a new version of key `k`.
    fn put(&mut self, core: &mut ShardCore, step: usize, k: u32, key: &[u8], trace: bool) {
        self.version += 1;
        // Now and then a value of several checksum blocks (progressive loads release it
        // block by block).
        let len = if self.rng.below(8) == 0 {
            (64 << 10) + self.rng.below(200 << 10) as usize
        } else {
            1 + self.rng.below(40 << 10) as usize
        };
        let v = value(k, self.version, len);
        let m = self.model.entry(k).or_default();
        m.written.push(v.clone());
        m.offered_since_restart.push(v.clone());
        let r = put(core, &mut self.disk, key, &v);
        if trace {
            eprintln!("step {step}: put k{k} v{} len {len} -> {r:?}", self.version);
        }
        match r {
            Ok(()) => {
                m.latest = Some(v.clone());
                m.removed_value = None;
                m.durable = self.write_through.then_some(v);
                m.absent_since_restart = false;
                m.evicted_value = None;
            }
            // Reserve refused: the old version stays. A failed write-through commit
            // unlinked the old version too: the key is gone.
            Err(Error::NoSpace) | Err(Error::Io(_)) => {
                m.durable = None;
                if self.write_through {
                    m.latest = None;
                }
            }
            Err(e) => panic!("{}: put: {e}", ctx(self.seed, step)),
        }
    }

    /// A read of key `k` (now and then one granted while its object still loads).
    fn get(&mut self, core: &mut ShardCore, step: usize, k: u32, key: &[u8]) {
        let m = self.model.entry(k).or_default();
        let read = match self.rng.below(3) {
            0 => early_get(core, &mut self.disk, key, m.latest.as_deref(), self.rng.below(3) == 0),
            _ => get(core, &mut self.disk, key).map(Some),
        };
        match read {
            Ok(None) => {}
            Ok(Some(bytes)) => {
                let ver = |b: &[u8]| if b.len() >= 8 { u32::from_le_bytes([b[4], b[5], b[6], b[7]]) } else { 0 };
                assert!(
                    m.latest.as_ref() == Some(&bytes),
                    "{}: read of k{k} is not its latest version: got v{} ({} bytes), model {:?}, written {:?}",
                    ctx(self.seed, step),
                    ver(&bytes),
                    bytes.len(),
                    m.latest.as_ref().map(|l| (ver(l), l.len())),
                    m.written.iter().map(|w| ver(w)).collect::<Vec<_>>()
                );
            }
            Err(Error::NotFound) | Err(Error::Io(_)) | Err(Error::NoSpace) => {}
            Err(e) => panic!("{}: get: {e}", ctx(self.seed, step)),
        }
    }

    /// A remove of key `k`.
    fn remove(&mut self, core: &mut ShardCore, step: usize, k: u32, key: &[u8], trace: bool) {
        let m = self.model.entry(k).or_default();
        if trace {
            eprintln!("step {step}: remove k{k}");
        }
        match core.remove(key, false) {
            Ok(()) => {
                m.removed_value = m.latest.take();
                m.durable = None;
                m.evicted_value = None;
            }
            // The tier failed and could not keep it removed: nothing changed.
            Err(Error::Io(_)) => {
                assert!(core.ssd_failed(), "{}: remove of k{k} failed on a working tier", ctx(self.seed, step));
                assert_eq!(
                    core.counters().snapshot().ssd_write_failed,
                    1,
                    "{}: the failed tier shows",
                    ctx(self.seed, step)
                )
            }
            // Not there: evicted (it may come back with that value) or never put.
            Err(Error::NotFound) => {
                if let Some(v) = m.latest.take() {
                    m.evicted_value = Some(v);
                }
                m.durable = None;
            }
            Err(e) => panic!("{}: remove: {e}", ctx(self.seed, step)),
        }
    }

    /// Adds what `core` reclaimed to the outcome (a core's counters start at zero).
    fn count_reclaims(&mut self, core: &ShardCore) {
        self.evicted |= core.counters.ssd_evictions.load(RELAXED) > 0;
        self.out.compactions += core.counters.compactions.load(RELAXED);
        self.out.evicted_segments += core.counters.segments_reclaimed.load(RELAXED);
    }

    /// A fresh core recovering from the disk image.
    fn recover(&mut self, step: usize) -> (ShardCore, RecoveryReport) {
        let mut core = new_core(&self.arena, self.segments, self.write_through, self.promote);
        let report = core.recover(&mut self.disk).unwrap_or_else(|e| panic!("{}: recover: {e}", ctx(self.seed, step)));
        (core, report)
    }

    /// Clean shutdown and restart: every key present before reads its latest value after
    /// (DRAM-only objects were written out), every absent key stays absent.
    fn clean_restart(&mut self, mut core: ShardCore, step: usize) -> ShardCore {
        let faults_off = self.rng.below(2) == 0;
        if faults_off {
            self.disk.set_faults(SimFaults::default());
        }
        let present: HashMap<u32, bool> =
            self.model.keys().map(|&k| (k, core.find(format!("k{k}").as_bytes()).is_some())).collect();
        let states: HashMap<u32, String> = self
            .model
            .keys()
            .map(|&k| {
                let state = core.find(format!("k{k}").as_bytes()).map(|id| {
                    let o = &core.objects[id as usize];
                    (core.ssd_copy(id), o.dram.is_some(), core.facts(id).seq, o.io_refs, o.state)
                });
                (k, format!("{state:?}"))
            })
            .collect();
        let evictions_before = core.counters.ssd_evictions.load(RELAXED);
        let skipped_before = core.counters.tombstones_skipped.load(RELAXED);
        clean_shutdown(&mut core, &mut self.disk);
        let lossless = faults_off
            && core.counters.ssd_evictions.load(RELAXED) == evictions_before
            && core.counters.shutdown_flush_skipped.load(RELAXED) == 0
            && core.counters.tombstones_skipped.load(RELAXED) == skipped_before;
        let tombstones_lost = core.counters.tombstones_skipped.load(RELAXED) > 0;
        self.count_reclaims(&core);
        if let Some(tk) = traced_key() {
            self.trace_clean_shutdown(&core, step, tk, faults_off);
        }
        drop(core);
        self.out.clean_restarts += 1;
        self.disk.set_faults(SimFaults::default());
        let (mut core, report) = self.recover(step);
        let before = BeforeRestart { present, states, lossless, tombstones_lost, report };
        let keys: Vec<u32> = self.model.keys().copied().collect();
        for k in keys {
            self.check_after_clean_restart(&mut core, step, k, &before);
        }
        core.check_invariants().unwrap_or_else(|e| panic!("{}: after clean restart: {e}", ctx(self.seed, step)));
        self.disk.set_faults(self.faults.clone());
        core
    }

    fn trace_clean_shutdown(&mut self, core: &ShardCore, step: usize, tk: u32, faults_off: bool) {
        let tkey = format!("k{tk}").into_bytes();
        eprintln!(
            "step {step} clean shutdown (write-through {}, faults off {faults_off}): {}",
            self.write_through,
            core.ssd.as_ref().map(|s| s.describe()).unwrap_or_default()
        );
        for seg in 0..self.segments {
            let scan = kvtide_tiers::ssd::scan_segment(&mut self.disk, seg).expect("scan");
            for r in scan.records.iter().filter(|r| r.key == tkey) {
                eprintln!("  seg {seg} epoch {:?}: {:?} seq {} at {}", scan.epoch, r.kind, r.seq, r.location.offset);
            }
        }
    }

    /// Key `k` after a clean restart: its latest value (or, with faults, absent), never an
    /// older one; absent before, absent after.
    fn check_after_clean_restart(&mut self, core: &mut ShardCore, step: usize, k: u32, before: &BeforeRestart) {
        let (seed, segments, evicted) = (self.seed, self.segments, self.evicted);
        let Some(m) = self.model.get_mut(&k) else { return };
        let key = format!("k{k}").into_bytes();
        let was_present = before.present.get(&k).copied().unwrap_or(false);
        match get(core, &mut self.disk, &key) {
            Ok(bytes) => {
                // An evicted object may come back (a copy of its record made by a
                // reclaim the crash interrupted); a removed one never does.
                assert!(
                    was_present
                        || before.tombstones_lost
                        || m.latest.as_ref() == Some(&bytes)
                        || m.evicted_value.as_ref() == Some(&bytes),
                    "{}: k{k} was absent before a clean shutdown and came back",
                    ctx(seed, step)
                );
                // A lost tombstone (counted) may let an older version win; it is
                // still one written for this key.
                assert!(m.written.contains(&bytes), "{}: k{k} reads bytes never written", ctx(seed, step));
                if !before.tombstones_lost
                    && m.latest.as_ref() != Some(&bytes)
                    && m.evicted_value.as_ref() != Some(&bytes)
                {
                    dump_records(&mut self.disk, segments, &key);
                    let ver = |b: &[u8]| u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                    panic!(
                        "{}: k{k} reads v{} after a clean restart, latest {:?}; it was {}",
                        ctx(seed, step),
                        ver(&bytes),
                        m.latest.as_ref().map(|l| ver(l)),
                        before.states.get(&k).cloned().unwrap_or_default()
                    );
                }
                m.latest = Some(bytes);
                m.absent_since_restart = false;
            }
            Err(Error::NotFound) => {
                // Reads after the restart load objects, and a reclaim they start may
                // evict (counted) in a tier that is mostly live.
                let evicted_since = core.counters.ssd_evictions.load(RELAXED) > 0;
                assert!(
                    !(was_present && before.lossless && !evicted_since),
                    "{}: k{k} was present before a clean shutdown and is lost: it was {}; recovered {:?}; now {}",
                    ctx(seed, step),
                    before.states.get(&k).cloned().unwrap_or_default(),
                    before.report,
                    core.ssd.as_ref().map(|s| s.describe()).unwrap_or_default()
                );
                assert!(m.durable.is_none() || evicted, "{}: durable k{k} lost in a clean restart", ctx(seed, step));
                if !m.absent_since_restart {
                    m.evicted_value = m.latest.take();
                }
                m.latest = None;
                m.durable = None;
                m.absent_since_restart = true;
            }
            Err(e) => panic!("{}: read after a clean restart: {e}", ctx(seed, step)),
        }
        m.offered_since_restart.clear();
        m.removed_value = None;
    }

    /// Crash: whatever was in flight is lost; unsynced writes survive whole, torn or not at
    /// all. A new core recovers from the disk image.
    fn crash(&mut self, mut core: ShardCore, step: usize) -> ShardCore {
        pump_some(&mut core, &mut self.disk, self.rng.below(3) as usize);
        self.count_reclaims(&core);
        if let Some(tk) = traced_key() {
            self.trace_crash(&core, step, tk);
        }
        drop(core);
        self.disk.crash();
        self.out.crashes += 1;
        self.disk.set_faults(SimFaults::default());
        let (mut core, report) = self.recover(step);
        if let Some(tk) = traced_key() {
            let tkey = format!("k{tk}").into_bytes();
            eprintln!("  recovered {report:?}; traced key indexed: {}", core.find(&tkey[..]).is_some());
        }
        let keys: Vec<u32> = self.model.keys().copied().collect();
        for k in keys {
            self.check_after_crash(&mut core, step, k);
        }
        core.check_invariants().unwrap_or_else(|e| panic!("{}: after recovery: {e}", ctx(self.seed, step)));
        self.disk.set_faults(self.faults.clone());
        core
    }

    fn trace_crash(&self, core: &ShardCore, step: usize, tk: u32) {
        let c = core.counters.snapshot();
        let tkey = format!("k{tk}").into_bytes();
        let loc = core.find(&tkey[..]).map(|id| {
            let o = &core.objects[id as usize];
            (core.ssd_copy(id), o.dram.is_some(), core.facts(id).seq)
        });
        let segs: Vec<_> = (0..self.segments)
            .filter_map(|i| core.ssd.as_ref().and_then(|s| s.segments().get(i)).map(|g| (i, g.state, g.write_offset)))
            .collect();
        eprintln!(
            "step {step} crash: k{tk} at {loc:?}; reclaimed {} compactions {}; segs {segs:?}",
            c.segments_reclaimed, c.compactions
        );
    }

    /// Key `k` after a crash: bytes written for it, an acknowledged-durable version
    /// byte-exact, and a key a restart found absent stays absent.
    fn check_after_crash(&mut self, core: &mut ShardCore, step: usize, k: u32) {
        let (seed, segments) = (self.seed, self.segments);
        let Some(m) = self.model.get_mut(&k) else { return };
        let key = format!("k{k}").into_bytes();
        // Reads load objects, which may reclaim segments: keys checked after an SSD
        // eviction may have left legitimately.
        self.evicted |= core.counters.ssd_evictions.load(RELAXED) > 0;
        let evicted = self.evicted;
        match get(core, &mut self.disk, &key) {
            Ok(bytes) => {
                assert!(m.written.contains(&bytes), "{}: k{k} recovered bytes never written", ctx(seed, step));
                let evicted_comes_back =
                    m.evicted_value.as_ref() == Some(&bytes) || m.offered_since_restart.contains(&bytes);
                if m.absent_since_restart && !evicted_comes_back && core.counters.tombstones_skipped.load(RELAXED) == 0
                {
                    dump_records(&mut self.disk, segments, &key);
                    panic!("{}: k{k} was absent at an earlier restart and came back", ctx(seed, step));
                }
                m.latest = Some(bytes);
                m.absent_since_restart = false;
            }
            Err(Error::NotFound) => {
                if m.durable.is_some() && !evicted && std::env::var("KVTIDE_SIM_KEY").is_ok() {
                    for seg in 0..segments {
                        let scan = kvtide_tiers::ssd::scan_segment(&mut self.disk, seg).expect("scan");
                        for r in scan.records.iter().filter(|r| r.key == key) {
                            eprintln!(
                                "  seg {seg} epoch {:?}: {:?} seq {} at {}",
                                scan.epoch, r.kind, r.seq, r.location.offset
                            );
                        }
                    }
                }
                assert!(m.durable.is_none() || evicted, "{}: durable k{k} lost in the crash", ctx(seed, step));
                if !m.absent_since_restart {
                    // A crash may have undone a remove, and the key left again by eviction.
                    m.evicted_value = m.latest.take().or_else(|| m.removed_value.clone());
                }
                m.latest = None;
                m.absent_since_restart = true;
            }
            Err(e) => panic!("{}: read after recovery: {e}", ctx(seed, step)),
        }
        m.offered_since_restart.clear();
        if let (Some(d), false) = (&m.durable, evicted) {
            assert_eq!(m.latest.as_ref(), Some(d), "{}: durable k{k} came back as another version", ctx(seed, step));
            self.out.durable_checked += 1;
        }
    }

    /// The end of a scenario: every held resource given back, nothing pending.
    fn finish(mut self, mut core: ShardCore) -> Outcome {
        let seed = self.seed;
        pump(&mut core, &mut self.disk);
        let c = core.counters.snapshot();
        assert_eq!(
            (c.leases_held, c.writes_in_flight, c.retired_objects),
            (0, 0, 0),
            "seed {seed}: held resources at the end"
        );
        assert!(core.is_quiet(), "seed {seed}: work still pending");
        self.out.compactions += core.counters.compactions.load(RELAXED);
        self.out.evicted_segments += core.counters.segments_reclaimed.load(RELAXED);
        self.out
    }
}

/// Runs a few rounds of disk work (so crashes land mid-flight, not only at quiet points).
fn pump_some(core: &mut ShardCore, disk: &mut SimDisk, rounds: usize) {
    let mut ops = Vec::new();
    let mut done = Vec::new();
    for _ in 0..rounds {
        core.schedule_syncs();
        core.take_disk_ops(&mut ops);
        for op in ops.drain(..) {
            // SAFETY: as in `pump`; the crash that follows drops pending ops before the core.
            unsafe { disk.submit(op) }.expect("sim queue never fills");
        }
        disk.reap(&mut done);
        for c in done.drain(..) {
            core.on_disk_completion(c);
        }
    }
}

#[test]
fn one_seed_from_env() {
    if let Some(seed) = std::env::var("KVTIDE_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        let segments = std::env::var("KVTIDE_SIM_SEGMENTS").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
        let ops = if segments == 8 { 150 } else { 200 };
        scenario(seed, segments, ops);
    }
}

/// `KVTIDE_SIM_SEEDS`, else the full 2000 in an optimised build (`.ci/run` runs that as a step of
/// its own) and a representative 200 in a debug build, so the default test command stays short.
fn seeds() -> u64 {
    let full = if cfg!(debug_assertions) { 200 } else { 2000 };
    std::env::var("KVTIDE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(full)
}

#[test]
fn seeded_crash_and_fault_scenarios() {
    let mut durable_checked = 0;
    let mut crashes = 0;
    let mut clean_restarts = 0;
    for seed in 0..seeds() {
        let o = scenario(seed, 8, 150);
        durable_checked += o.durable_checked;
        crashes += o.crashes;
        clean_restarts += o.clean_restarts;
    }
    println!(
        "simulated {} seeds: {crashes} crashes, {clean_restarts} clean restarts, {durable_checked} durable objects checked after recovery",
        seeds()
    );
    assert!(crashes > seeds(), "scenarios must crash often");
    assert!(clean_restarts > seeds(), "scenarios must restart cleanly often");
    assert!(durable_checked > seeds(), "durability must be checked often");
}

#[test]
fn seeded_scenarios_with_segment_reclaim() {
    let (mut compactions, mut reclaimed) = (0, 0);
    for seed in 0..seeds() / 4 {
        let o = scenario(1_000_000 + seed, 3, 200);
        compactions += o.compactions;
        reclaimed += o.evicted_segments;
    }
    println!("reclaim scenarios: {reclaimed} segments reclaimed, {compactions} of them by compaction");
    assert!(compactions > 0 && reclaimed > compactions, "both compaction and whole-segment eviction must run");
}

#[test]
fn flipped_bit_reads_as_corrupted_and_neighbours_survive() {
    let arena = Arena::new(2 << 20, 1).expect("arena");
    let mut disk = SimDisk::new(4, SEGMENT_BYTES, 7, SimFaults::default());
    let mut core = new_core(&arena, 4, true, true);
    core.recover(&mut disk).expect("recover");
    let a = value(1, 1, 10_000);
    let b = value(2, 1, 10_000);
    put(&mut core, &mut disk, b"a", &a).expect("a");
    put(&mut core, &mut disk, b"b", &b).expect("b");
    pump(&mut core, &mut disk);
    drop(core);
    // Record "a" sits right after the segment header block: rot a byte of its value.
    disk.flip_bit(0, 4096 + 64 + 1 + 500, 3);
    let mut core = new_core(&arena, 4, true, true);
    let report = core.recover(&mut disk).expect("recover");
    assert_eq!(report.objects, 1, "the rotted record is skipped at scan: {report:?}");
    assert!(report.discarded.iter().any(|(_, _, why)| why.contains("checksum")), "{report:?}");
    assert_eq!(get(&mut core, &mut disk, b"a"), Err(Error::NotFound));
    assert_eq!(get(&mut core, &mut disk, b"b").expect("neighbour"), b);

    // Rot after recovery, found at read time: typed Corrupted, dropped from the index, and the
    // neighbour still reads fine.
    let c = value(3, 1, 5_000);
    put(&mut core, &mut disk, b"c", &c).expect("c");
    pump(&mut core, &mut disk);
    drop(core);
    let mut core = new_core(&arena, 4, true, true);
    core.recover(&mut disk).expect("recover");
    disk.flip_bit(0, 4096 + 12288 + 64 + 1 + 42, 1); // inside b's value
    assert!(matches!(get(&mut core, &mut disk, b"b"), Err(Error::Corrupted(_))));
    assert_eq!(get(&mut core, &mut disk, b"b"), Err(Error::NotFound), "a corrupted record is dropped");
    assert_eq!(get(&mut core, &mut disk, b"c").expect("c survives"), c);
    assert_eq!(core.counters.corrupted.load(RELAXED), 1);
    core.check_invariants().expect("invariants");
}

#[test]
fn a_reader_of_a_replaced_object_never_holds_up_a_reclaim() {
    let arena = Arena::new(2 << 20, 1).expect("arena");
    let mut disk = SimDisk::new(4, SEGMENT_BYTES, 11, SimFaults::default());
    let mut core = new_core(&arena, 4, true, true);
    core.recover(&mut disk).expect("recover");
    let v1 = value(1, 1, 20_000);
    put(&mut core, &mut disk, b"k", &v1).expect("v1, durable in the oldest segment");
    // A reader holds v1 (no TTL) while it is replaced; the old version lives on for it alone.
    let grant = run_batch(&mut core, &mut disk, |c, d| c.lease_read_batch(vec![b"k"[..].into()], None, false, d))
        .expect("lease");
    put(&mut core, &mut disk, b"k", &value(1, 2, 20_000)).expect("v2");
    // Cycle the tier several times over: every reclaim must finish, including the oldest one.
    for n in 0..400u32 {
        let key = format!("c{}", n % 4).into_bytes();
        put(&mut core, &mut disk, &key, &value(2 + n % 4, n, 40_000)).expect("churn put");
    }
    assert!(core.counters.segments_reclaimed.load(RELAXED) >= 8, "the tier must turn over");
    assert_eq!(core.counters.ssd_evictions.load(RELAXED), 0);
    // SAFETY: the lease keeps `len` bytes at grant.ptr in place until released below.
    let held = unsafe { std::slice::from_raw_parts(grant.ptr.as_ptr(), grant.len as usize) }.to_vec();
    assert_eq!(held, v1, "the reader's bytes stayed put");
    core.release(grant.lease);
    pump(&mut core, &mut disk);
    assert_eq!(get(&mut core, &mut disk, b"k").expect("v2"), value(1, 2, 20_000));
    core.check_invariants().expect("invariants");
    let c = core.counters.snapshot();
    assert_eq!((c.leases_held, c.retired_objects, c.writes_in_flight), (0, 0, 0));
}

#[test]
fn removes_past_the_tombstone_bound_are_refused_and_remove_nothing() {
    let arena = Arena::new(2 << 20, 1).expect("arena");
    let mut disk = SimDisk::new(4, SEGMENT_BYTES, 5, SimFaults::default());
    let mut core = core_with(&arena, SsdConfig { max_pending_tombstones: 2, ..ssd_config(4, true, true) });
    core.recover(&mut disk).expect("recover");
    for i in 0..3u32 {
        put(&mut core, &mut disk, format!("k{i}").as_bytes(), &value(i, 1, 5_000)).expect("durable put");
    }
    // Nothing moves the disk between these removes: their tombstones wait in the queue.
    core.remove(b"k0", false).expect("first tombstone queued");
    core.remove(b"k1", false).expect("second tombstone queued");
    assert_eq!(core.remove(b"k2", false), Err(Error::Busy { limit: 2 }), "the queue is full");
    assert_eq!(get(&mut core, &mut disk, b"k2").expect("a refused remove removed nothing"), value(2, 1, 5_000));
    // Once the disk moves, the queue drains and the remove goes through.
    pump(&mut core, &mut disk);
    assert_eq!(core.counters.tombstones_pending.load(RELAXED), 0);
    core.remove(b"k2", false).expect("room again");
    clean_shutdown(&mut core, &mut disk);
    let c = core.counters.snapshot();
    assert_eq!((c.tombstones, c.tombstones_pending, c.tombstones_skipped), (3, 0, 0));
    drop(core);
    let mut core = new_core(&arena, 4, true, true);
    core.recover(&mut disk).expect("recover");
    for i in 0..3u32 {
        assert_eq!(get(&mut core, &mut disk, format!("k{i}").as_bytes()), Err(Error::NotFound), "k{i} came back");
    }
}

#[test]
fn a_write_through_remove_answers_once_its_tombstone_is_durable() {
    let arena = Arena::new(2 << 20, 1).expect("arena");
    let mut disk = SimDisk::new(4, SEGMENT_BYTES, 13, SimFaults::default());
    let mut core = new_core(&arena, 4, true, true);
    core.recover(&mut disk).expect("recover");
    for i in 0..3u32 {
        put(&mut core, &mut disk, format!("k{i}").as_bytes(), &value(i, 1, 5_000)).expect("durable put");
    }
    let answered = Rc::new(RefCell::new(Vec::new()));
    for key in [&b"k0"[..], b"k1", b"missing"] {
        let sink = Rc::clone(&answered);
        core.remove_then(key, false, Box::new(move |r| sink.borrow_mut().push(r)));
    }
    // Gone at once for readers; a missing key is answered at once; the two removes wait.
    assert_eq!(get(&mut core, &mut disk, b"k0"), Err(Error::NotFound));
    assert_eq!(*answered.borrow(), vec![Err(Error::NotFound)]);
    assert!(!core.is_quiet(), "the removes wait for their tombstones");
    assert_eq!(core.counters.removes_awaiting_tombstone.load(RELAXED), 2);
    pump(&mut core, &mut disk);
    assert_eq!(*answered.borrow(), vec![Err(Error::NotFound), Ok(()), Ok(())]);
    assert!(core.is_quiet());
    assert_eq!(core.counters.removes_awaiting_tombstone.load(RELAXED), 0);
    // A crash right after the answers: the durable image keeps both removed.
    disk.crash();
    drop(core);
    let mut core = new_core(&arena, 4, true, true);
    core.recover(&mut disk).expect("recover");
    assert_eq!(get(&mut core, &mut disk, b"k0"), Err(Error::NotFound), "k0 came back");
    assert_eq!(get(&mut core, &mut disk, b"k1"), Err(Error::NotFound), "k1 came back");
    assert_eq!(get(&mut core, &mut disk, b"k2").expect("k2 kept"), value(2, 1, 5_000));
    // Without write-through the answer comes at once (and a crash may undo the remove).
    let mut core = new_core(&arena, 4, false, true);
    core.recover(&mut disk).expect("recover");
    let sink = Rc::clone(&answered);
    core.remove_then(b"k2", false, Box::new(move |r| sink.borrow_mut().push(r)));
    assert_eq!(answered.borrow().len(), 4, "answered before any disk work");
    assert_eq!(answered.borrow()[3], Ok(()));
}

#[test]
fn a_write_through_remove_whose_tombstone_cannot_be_written_is_answered_with_io() {
    let arena = Arena::new(2 << 20, 1).expect("arena");
    let mut disk = SimDisk::new(4, SEGMENT_BYTES, 17, SimFaults::default());
    let mut core = new_core(&arena, 4, true, true);
    core.recover(&mut disk).expect("recover");
    put(&mut core, &mut disk, b"k0", &value(0, 1, 5_000)).expect("durable put");
    // From now on every write and sync fails: the tombstone is tried, given up on, and said so.
    disk.set_faults(SimFaults { write_eio_ppm: 1_000_000, sync_eio_ppm: 1_000_000, ..SimFaults::default() });
    let answered = Rc::new(RefCell::new(Vec::new()));
    let sink = Rc::clone(&answered);
    core.remove_then(b"k0", false, Box::new(move |r| sink.borrow_mut().push(r)));
    assert_eq!(core.counters.removes_awaiting_tombstone.load(RELAXED), 1);
    for _ in 0..100 {
        if !answered.borrow().is_empty() {
            break;
        }
        pump(&mut core, &mut disk);
    }
    assert!(matches!(answered.borrow().as_slice(), [Err(Error::Io(_))]), "{:?}", answered.borrow());
    assert_eq!(get(&mut core, &mut disk, b"k0"), Err(Error::NotFound), "gone here all the same");
    assert!(core.counters.tombstones_skipped.load(RELAXED) >= 1);
    assert!(core.is_quiet(), "no remove left waiting");
    assert_eq!(core.counters.removes_awaiting_tombstone.load(RELAXED), 0);
}

#[test]
fn a_shutdown_past_its_deadline_still_writes_queued_tombstones() {
    let arena = Arena::new(2 << 20, 1).expect("arena");
    let mut disk = SimDisk::new(4, SEGMENT_BYTES, 9, SimFaults::default());
    let mut core = new_core(&arena, 4, false, true);
    core.recover(&mut disk).expect("recover");
    for i in 0..3u32 {
        put(&mut core, &mut disk, format!("k{i}").as_bytes(), &value(i, 1, 5_000)).expect("put");
    }
    // On SSD, then replaced and removed: the tombstones are only queued when time runs out.
    assert!(core.flush_for_shutdown(true, true) || core.disk_ops_in_flight() > 0);
    pump(&mut core, &mut disk);
    put(&mut core, &mut disk, b"k0", &value(0, 2, 5_000)).expect("upsert");
    core.remove(b"k1", false).expect("remove");
    core.remove(b"k2", false).expect("remove");
    let mut rounds = 0;
    while !core.flush_for_shutdown(true, false) {
        pump_some(&mut core, &mut disk, 1);
        rounds += 1;
        assert!(rounds < 10_000, "the shutdown never ended");
    }
    core.sync_everything();
    pump(&mut core, &mut disk);
    assert_eq!(core.counters.tombstones_pending.load(RELAXED), 0);
    drop(core);
    let mut core = new_core(&arena, 4, false, true);
    core.recover(&mut disk).expect("recover");
    // k0's new value had no time to be written: absent, never the old one.
    for i in 0..3u32 {
        assert_eq!(get(&mut core, &mut disk, format!("k{i}").as_bytes()), Err(Error::NotFound), "k{i}");
    }
}
