//! Opening an engine (`StoreBuilder::open`): the arena, the data directory, one shard thread
//! per slice, recovery.
//!
//! Owns the derivation of each shard's settings (watermarks, object table size, SSD segments,
//! the largest storable value) from the validated configuration, and the start-up order: every
//! shard recovers its segments in parallel and the engine opens only when all of them did. It
//! never leaves a shard running when another failed to start.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use kvtide_tiers::dram::read_index::ReadIndex;
use kvtide_tiers::dram::Arena;
use kvtide_tiers::ssd::{DataDir, SimDisk};

use super::{gpu, progressive, restore, Engine, OBJECT_ALIGN_BYTES};
use crate::config::{EngineConfig, SsdSettings, StoreBuilder};
use crate::error::OpenError;
use crate::shard::core::{RecoveryReport, SsdConfig};
use crate::shard::published::IndexWriter;
use crate::shard::{spawn_shard, DiskBackend, RuntimeConfig, ShardConfig, ShardCore, ShardThread, StartingShard};
use crate::stats::ShardCounters;

impl StoreBuilder {
    /// Maps the arena, starts the shards and returns the engine.
    pub fn open(self) -> Result<Engine, OpenError> {
        Engine::open(self.validate()?)
    }
}

impl Engine {
    pub(crate) fn open(config: EngineConfig) -> Result<Engine, OpenError> {
        let arena = Arena::new(config.dram_bytes as usize, config.shards)?;
        let slice_bytes = arena.slice_bytes() as u64;
        let keep_awake = Arc::new(AtomicUsize::new(0));
        let stop_deadline = Arc::new(OnceLock::new());
        let data_dir = match &config.ssd {
            Some(ssd) if ssd.simulated.is_none() => {
                Some(DataDir::open(&ssd.dir, ssd.bytes, config.shards, ssd.segment_bytes)?)
            }
            _ => None,
        };
        let read_index = match config.read_index {
            true => Some(ReadIndex::new(&arena, read_index_entries(&config, slice_bytes))?),
            false => None,
        };
        let (starting, max_value_bytes) =
            start_shards(&config, &arena, read_index.as_ref(), data_dir.as_ref(), &keep_awake, &stop_deadline)?;
        let Running { shards, joins, recovery } = wait_for_recovery(starting)?;
        tracing::info!(
            shards = config.shards,
            dram_bytes = arena.len_bytes(),
            policy = config.policy.name(),
            "kvtide engine open"
        );
        let credits = restore::CreditBroker::new(
            config.shards,
            config.restore_staging_bytes,
            config.restore_staging_bytes.min(slice_bytes / 2),
        );
        Ok(Engine {
            gpu: gpu::GpuState::new(&config),
            shards,
            joins: Mutex::new(joins),
            arena,
            read_index,
            max_value_bytes,
            tickets_in_flight: Arc::new(AtomicU64::new(0)),
            shutting_down: AtomicBool::new(false),
            recovery,
            credits,
            restore: restore::RestoreCounters::default(),
            keep_awake,
            stop_deadline,
            streams: Arc::default(),
            unsealed: Arc::new(progressive::UnsealedPuts::new(
                config.shards,
                config.unsealed_bytes_per_shard,
                config.unsealed_ttl,
            )),
            next_watch_shard: Default::default(),
            config,
        })
    }
}

/// Entries of the read index per shard: one per 4 KiB of the shard's slice (64 bytes each, so
/// 1/64 of the DRAM pool's address space, touched as objects are published), within the
/// objects a shard may hold and at least 1024.
fn read_index_entries(config: &EngineConfig, slice_bytes: u64) -> usize {
    let per_4k = usize::try_from(slice_bytes / 4096).unwrap_or(usize::MAX);
    per_4k.min(config.max_objects_per_shard as usize).max(1024)
}

/// Spawns one shard thread per arena slice; each starts recovering at once. Returns them and the
/// largest value every shard can store. A shard that fails to spawn stops those already started.
fn start_shards(
    config: &EngineConfig,
    arena: &Arc<Arena>,
    read_index: Option<&Arc<ReadIndex>>,
    data_dir: Option<&DataDir>,
    keep_awake: &Arc<AtomicUsize>,
    stop_deadline: &Arc<OnceLock<Instant>>,
) -> Result<(Vec<StartingShard>, u64), OpenError> {
    let slice_bytes = arena.slice_bytes() as u64;
    let mut max_value_bytes = config.max_value_bytes.unwrap_or(slice_bytes).min(slice_bytes);
    let cpus = crate::shard::allowed_cpus();
    let mut starting = Vec::with_capacity(config.shards);
    for index in 0..config.shards {
        let slice = arena.slice(index)?;
        let shard_config = shard_config(config, slice_bytes);
        let (ssd_config, disk, fits) = match &config.ssd {
            Some(ssd) => ssd_settings(config, ssd, &shard_config, index, slice_bytes, data_dir)?,
            None => {
                // DRAM only: an object alone above the high watermark would be evicted at once.
                // (Allocations round up to the object alignment.)
                let fits = shard_config.high_watermark_bytes / OBJECT_ALIGN_BYTES * OBJECT_ALIGN_BYTES;
                (None, DiskBackend::None, fits.max(1))
            }
        };
        max_value_bytes = max_value_bytes.min(fits);
        let counters = Arc::new(ShardCounters::default());
        let core_slice = slice.clone();
        let core_counters = Arc::clone(&counters);
        let mut writer =
            IndexWriter::new(Arc::clone(&counters), shard_config.max_objects, crate::shard::key_index_hash);
        if let Some(mirror) = read_index.and_then(|r| r.writer(index)) {
            writer = writer.with_mirror(mirror);
        }
        let published = Arc::clone(writer.shared());
        let make_core = move || ShardCore::with_ssd(shard_config, core_slice, core_counters, ssd_config, writer);
        let runtime = RuntimeConfig {
            ring_entries: config.ring_entries,
            idle_spin: config.idle_spin,
            demote_on_shutdown: config.demote_on_shutdown,
            shutdown_flush_timeout: config.shutdown_flush_timeout,
            keep_awake: Arc::clone(keep_awake),
            stop_deadline: Arc::clone(stop_deadline),
            pin_to_cpu: (config.pin_threads && !cpus.is_empty()).then(|| cpus[index % cpus.len()]),
            register_fixed_buffers: config.register_fixed_buffers,
            io_uring: config.io_uring,
        };
        match spawn_shard(index, make_core, counters, published, slice, disk, runtime) {
            Ok(started) => starting.push(started),
            Err(e) => {
                stop_all(starting.into_iter().filter_map(|s| s.wait().ok()).map(|(t, _)| t));
                return Err(e);
            }
        }
    }
    Ok((starting, max_value_bytes))
}

/// One shard's limits, from the validated configuration and its slice's size.
fn shard_config(config: &EngineConfig, slice_bytes: u64) -> ShardConfig {
    ShardConfig {
        high_watermark_bytes: (slice_bytes as f64 * config.high_watermark) as u64,
        low_watermark_bytes: (slice_bytes as f64 * config.low_watermark) as u64,
        policy: config.policy,
        align_bytes: OBJECT_ALIGN_BYTES,
        // The allocator reserves its node table up front: size it for an average object
        // of 4 KiB at most, so a small pool does not pay for a million-entry table.
        max_objects: config.max_objects_per_shard.min((slice_bytes / 4096).max(1024) as u32),
        max_leases: config.max_leases_per_shard,
    }
}

/// Shard `index`'s SSD settings, its disk and the largest value it can store beside the tier.
fn ssd_settings(
    config: &EngineConfig,
    ssd: &SsdSettings,
    shard_config: &ShardConfig,
    index: usize,
    slice_bytes: u64,
    data_dir: Option<&DataDir>,
) -> Result<(Option<SsdConfig>, DiskBackend, u64), OpenError> {
    let segments = match data_dir {
        Some(dir) => dir.segments_per_shard,
        None => (ssd.bytes / config.shards as u64 / ssd.segment_bytes).max(2) as u32,
    };
    let disk = match (data_dir, &ssd.simulated) {
        (Some(dir), _) => DiskBackend::Files(dir.open_shard(index)?),
        (None, Some((seed, faults))) => DiskBackend::Simulated(Box::new(SimDisk::new(
            segments,
            ssd.segment_bytes,
            seed.wrapping_add(index as u64),
            faults.clone(),
        ))),
        (None, None) => DiskBackend::None,
    };
    // The advertised maximum must be storable: a record fits a segment, and it
    // fits the slice beside the tier's scratch without crossing the watermark.
    let fits = crate::shard::largest_value_bytes(
        slice_bytes,
        shard_config.high_watermark_bytes,
        segments,
        ssd.segment_bytes,
        config.max_key_bytes,
    );
    let ssd_config = SsdConfig {
        segments,
        segment_bytes: ssd.segment_bytes,
        write_through: ssd.write_through,
        restore_budget_bytes: ssd.restore_budget_bytes,
        promote_on_hit: ssd.promote_on_hit,
        epoch_seed: random_seed(index),
        max_pending_tombstones: crate::shard::DEFAULT_MAX_PENDING_TOMBSTONES,
        load_piece_bytes: crate::shard::core::DEFAULT_LOAD_PIECE_BYTES,
    };
    Ok((Some(ssd_config), disk, fits))
}

/// Shards that recovered and run: their threads, their joins and what each recovery found.
struct Running {
    shards: Vec<ShardThread>,
    joins: Vec<JoinHandle<()>>,
    recovery: Vec<RecoveryReport>,
}

/// Shards recover their SSD segments in parallel; waits for all of them. When one failed, the
/// others are stopped and its error returned.
fn wait_for_recovery(starting: Vec<StartingShard>) -> Result<Running, OpenError> {
    let mut recovery = Vec::with_capacity(starting.len());
    let mut shards = Vec::with_capacity(starting.len());
    let mut joins = Vec::with_capacity(starting.len());
    let mut failure = None;
    for started in starting {
        match started.wait() {
            Ok((mut thread, report)) => {
                recovery.push(report);
                if let Some(join) = thread.join.take() {
                    joins.push(join);
                }
                shards.push(thread);
            }
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        for shard in &shards {
            shard.inbox.close();
        }
        for join in joins {
            let _ = join.join();
        }
        return Err(e);
    }
    Ok(Running { shards, joins, recovery })
}

/// Stops shards that started while another failed to.
fn stop_all(shards: impl Iterator<Item = ShardThread>) {
    for mut shard in shards {
        shard.stop();
    }
}

/// A seed that differs per shard and per process start (segment epochs must never repeat).
fn random_seed(shard: usize) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into the buffer we pass; failure leaves zeroes,
    // and the time and pid below still make the seed unique per start.
    unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    u64::from_le_bytes(bytes) ^ nanos ^ (u64::from(std::process::id()) << 32) ^ (shard as u64).wrapping_mul(0x9E37_79B9)
}
