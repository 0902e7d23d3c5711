//! `StoreBuilder`: what users fill in (in code, from a TOML file or from `KVTIDE_*` variables),
//! grouped as `[dram]`, `[ssd]`, `[restore]`, `[gpu]`, `[runtime]` and `[stream]`, each setting declared once
//! (`settings_group!`). Owns validating everything before any memory is mapped and deriving the
//! engine's configuration; never maps memory or starts shards itself (`StoreBuilder::open`, in
//! `engine/open.rs`, does).

use std::path::Path;
use std::time::Duration;

use kvtide_tiers::eviction::EvictionPolicy;

use crate::error::OpenError;
pub use crate::settings::parse_bytes;
use crate::settings::{self, Field, Settings};

crate::settings_group! {
    /// `[dram]`: the DRAM pool and its per-shard tables (`KVTIDE_DRAM_*`).
    pub struct DramGroup = "dram" {
        /// DRAM pool size. Default 1 GiB.
        bytes: u64 = 1 << 30, Bytes, eg "64MiB";
        /// Eviction starts above this fraction of a shard's slice. Default 0.95.
        high_watermark: f64 = 0.95, Fraction, eg "0.9";
        /// ... and stops at this fraction. Default 0.85.
        low_watermark: f64 = 0.85, Fraction, eg "0.8";
        /// "lru" or "s3fifo" (default).
        eviction: String = "s3fifo".into(), Text, eg "lru";
        /// Objects per shard (sizes the allocator's node table and the key table's reserved room; at most 2^29 - 1). Default 1 Mi.
        max_objects_per_shard: u32 = 1 << 20, Count, eg "4096";
        /// Leases per shard. Default 1 Mi.
        max_leases_per_shard: u32 = 1 << 20, Count, eg "8192";
    }
}

crate::settings_group! {
    /// `[ssd]`: the SSD tier (`KVTIDE_SSD_*`). It exists when `dir` is set.
    pub struct SsdGroup = "ssd" {
        /// Directory of the SSD tier. None (default): DRAM only.
        dir: Option<std::path::PathBuf> = None, Path, eg "/tmp/kvtide-settings-example";
        /// SSD tier capacity. Default 8 GiB.
        bytes: u64 = 8 << 30, Bytes, eg "256MiB";
        /// Segment file size. Default 64 MiB (smaller when the tier is small); at most 16 TiB.
        segment_bytes: u64 = 64 << 20, Bytes, eg "4MiB";
        /// Acknowledge puts only once they are durable on SSD. Default false (write-back on
        /// eviction).
        write_through: bool = false, Bool, eg "true";
        /// Keep objects read from SSD in DRAM. Default true.
        promote_on_hit: bool = true, Bool, eg "off";
        /// A clean shutdown writes DRAM-only objects to the SSD tier, so the cache is warm after a
        /// restart. Default true.
        demote_on_shutdown: bool = true, Bool, eg "0";
        /// How long a clean shutdown spends on that at most; what is not written by then is not
        /// kept (queued tombstones are written past it too: they keep older values from
        /// returning). Default 30 s. `kvtide-owner` also ends it within `[owner] stop_budget_ms`.
        shutdown_flush_timeout_ms: u64 = 30_000, Count, eg "1500";
    }
}

crate::settings_group! {
    /// `[restore]`: batched reads that touch the SSD (`KVTIDE_RESTORE_*`).
    pub struct RestoreGroup = "restore" {
        /// SSD loads in flight per shard, in bytes; more wait. Default 64 MiB.
        budget_bytes: u64 = 64 << 20, Bytes, eg "16MiB";
        /// Batched reads that touch the SSD are pipelined (sub-batch loads overlap transfers).
        /// Default true.
        pipeline: bool = true, Bool, eg "false";
        /// Target bytes per restore sub-batch (whole objects). Default 2 MiB (from
        /// `kvtide-bench restore`).
        sub_batch_bytes: u64 = 2 << 20, Bytes, eg "1MiB";
        /// Keys per restore sub-batch at most. Default 64.
        sub_batch_keys: usize = 64, Count, eg "32";
        /// Bytes of restore sub-batches one request may keep requested per shard ahead of its
        /// transfers (loading or loaded, not yet transferred; at least one sub-batch). A request
        /// starts two sub-batches deep and deepens while its loads lag its transfers.
        /// Default: twice `budget_bytes`, room for the disk queue a whole-batch request gets
        /// beside loaded sub-batches waiting for their transfer.
        ahead_bytes: Option<u64> = None, Bytes, eg "32MiB";
        /// Staging bytes all restores may hold at once (per shard: at most half a slice).
        /// Default: a quarter of `[dram] bytes`.
        staging_bytes: Option<u64> = None, Bytes, eg "8MiB";
    }
}

crate::settings_group! {
    /// `[gpu]`: GPU destinations and sources (feature `cuda`; `KVTIDE_GPU_*`).
    pub struct GpuGroup = "gpu" {
        /// Stage fragmented GPU reads and writes through one device buffer with one
        /// scatter/gather kernel per fill. Default false: direct copies.
        staging: bool = false, Bool, eg "on";
        /// Payload budget of that buffer, allocated lazily on the destination GPU. Default 256 MiB.
        staging_bytes: u64 = 256 << 20, Bytes, eg "64MiB";
        /// Staging fills shrink towards the end of a request, down to about this size, so little
        /// scatter work is left once the last copy lands (0: fixed quarter-buffer fills).
        /// Default 4 MiB.
        staging_tail_bytes: u64 = 4 << 20, Bytes, eg "1MiB";
        /// Shards do not park while a GPU transfer that holds their leases is in flight, so its
        /// release and the caller's next request cost no wake-up. Default true.
        keep_shards_awake: bool = true, Bool, eg "false";
        /// Staging units per GPU for stream-bound reads (`*_on_stream`): reads on one stream
        /// share a unit, so this many streams stage at once before the next falls back to
        /// direct copies. Default 4.
        stream_units: u32 = 4, Count, eg "8";
        /// Device buffer of each stream-bound staging unit. Default 32 MiB.
        stream_unit_bytes: u64 = 32 << 20, Bytes, eg "64MiB";
        /// Backstop for a stream-bound read whose stream never passes its copies: after this
        /// long its leases are released and the read reported failed (`StreamExpired`). Default 60 s.
        stream_ttl_ms: u64 = 60_000, Count, eg "10000";
    }
}

crate::settings_group! {
    /// `[runtime]`: shards, their threads and rings, and per-call limits (`KVTIDE_RUNTIME_*`).
    pub struct RuntimeGroup = "runtime" {
        /// Shard count. Default: the shard count of the SSD directory when it has one (its
        /// layout), else the CPUs this process may run on.
        shards: Option<usize> = None, Count, eg "3";
        /// Longest key accepted. Default 1 KiB.
        max_key_bytes: usize = 1024, Bytes, eg "512";
        /// Largest value accepted. Default: what one shard can store and keep.
        max_value_bytes: Option<u64> = None, Bytes, eg "1MiB";
        /// How long an idle shard spins before parking. Default 50 us.
        idle_spin_us: u64 = 50, Count, eg "20";
        /// How long a caller polls for a shard's reply before it blocks. Default 100 us: a
        /// blocked caller pays a wake-up (tens of microseconds, more in a VM) on every round trip.
        reply_spin_us: u64 = 100, Count, eg "0";
        /// Pin shard threads to CPUs. Default true.
        pin_threads: bool = true, Bool, eg "no";
        /// Register each arena slice with its ring as fixed buffers. Default true.
        register_fixed_buffers: bool = true, Bool, eg "false";
        /// Shards use io_uring (default true). Where it is refused (the default seccomp profiles
        /// of Docker 25+ and containerd block it), a DRAM-only store parks its shards with poll(2)
        /// on their eventfds instead, by itself; false asks for that. An SSD tier needs io_uring.
        io_uring: bool = true, Bool, eg "false";
        /// io_uring submission queue entries per shard. Default 256.
        ring_entries: u32 = 256, Count, eg "128";
        /// Async tickets allowed in flight at once. Default 1024.
        max_tickets_in_flight: usize = 1024, Count, eg "16";
    }
}

crate::settings_group! {
    /// `[stream]`: progressive and streaming transfers (`KVTIDE_STREAM_*`).
    pub struct StreamGroup = "stream" {
        /// Chunks of one handle in flight at once: a large read never holds more than this many
        /// chunks of transport work (staging, copies) at a time. Default 4.
        window_chunks: usize = 4, Count, eg "2";
        /// Chunk handles whose transfers run at once; more are refused with Busy. Default 256.
        max_handles: usize = 256, Count, eg "8";
        /// How long a progressive put may stay unsealed; then it is aborted and the readers that
        /// follow it fail with ProducerAborted. Default 60 s.
        unsealed_ttl_ms: u64 = 60_000, Count, eg "2500";
        /// Bytes of unsealed progressive puts a shard holds at most. Default: a quarter of a
        /// shard's DRAM slice.
        unsealed_bytes_per_shard: Option<u64> = None, Bytes, eg "4MiB";
    }
}

/// Builds an embedded store. Every setting has a default and lives in its group (`[dram]`,
/// `[ssd]`, `[restore]`, `[gpu]`, `[runtime]`, `[stream]`); the fluent setters below cover them.
#[derive(Clone, Debug, Default)]
pub struct StoreBuilder {
    pub dram: DramGroup,
    pub ssd: SsdGroup,
    pub restore: RestoreGroup,
    pub gpu: GpuGroup,
    pub runtime: RuntimeGroup,
    pub stream: StreamGroup,
    /// Run the SSD tier on the in-memory fault-injecting simulator instead of files (tests and
    /// benchmarks; nothing survives the process). Set with `simulated_ssd`; never from text.
    pub simulated_ssd: Option<(u64, kvtide_tiers::ssd::SimFaults)>,
    /// Keep a read index (`Engine::read_index`): where every DRAM-resident object lies, in a
    /// sealed shared memfd an owner hands its same-host clients, so they read without a round
    /// trip. Set with `read_index`; `kvtide-owner` sets it when it shares its arena.
    pub read_index: bool,
}

/// Forwards `Settings` to the named groups of `self`.
macro_rules! settings_of_groups {
    ($($group:ident: $ty:ty),* $(,)?) => {
        fn groups(&self) -> Vec<(&'static str, &'static [$crate::settings::Field])> {
            vec![$((<$ty as $crate::settings::SettingGroup>::NAME, <$ty as $crate::settings::SettingGroup>::FIELDS)),*]
        }

        fn set(&mut self, group: &str, field: &str, text: &str) -> Result<bool, String> {
            $(
                if group == <$ty as $crate::settings::SettingGroup>::NAME {
                    return $crate::settings::SettingGroup::set(&mut self.$group, field, text);
                }
            )*
            Ok(false)
        }

        fn show(&self, group: &str, field: &str) -> Option<String> {
            $(
                if group == <$ty as $crate::settings::SettingGroup>::NAME {
                    return $crate::settings::SettingGroup::show(&self.$group, field);
                }
            )*
            None
        }
    };
}

impl Settings for StoreBuilder {
    settings_of_groups!(
        dram: DramGroup,
        ssd: SsdGroup,
        restore: RestoreGroup,
        gpu: GpuGroup,
        runtime: RuntimeGroup,
        stream: StreamGroup,
    );
}

/// What the engine derives from a validated builder.
#[derive(Clone, Debug)]
pub(crate) struct EngineConfig {
    pub(crate) shards: usize,
    pub(crate) dram_bytes: u64,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_value_bytes: Option<u64>,
    pub(crate) high_watermark: f64,
    pub(crate) low_watermark: f64,
    pub(crate) policy: EvictionPolicy,
    pub(crate) idle_spin: Duration,
    pub(crate) demote_on_shutdown: bool,
    pub(crate) shutdown_flush_timeout: Duration,
    pub(crate) reply_spin: Duration,
    pub(crate) gpu_keep_shards_awake: bool,
    pub(crate) pin_threads: bool,
    pub(crate) register_fixed_buffers: bool,
    pub(crate) io_uring: bool,
    pub(crate) ring_entries: u32,
    pub(crate) max_tickets_in_flight: usize,
    pub(crate) max_objects_per_shard: u32,
    pub(crate) max_leases_per_shard: u32,
    pub(crate) ssd: Option<SsdSettings>,
    pub(crate) gpu_staging: bool,
    pub(crate) gpu_staging_bytes: u64,
    pub(crate) gpu_staging_tail_bytes: u64,
    pub(crate) gpu_stream_units: u32,
    pub(crate) gpu_stream_unit_bytes: u64,
    pub(crate) gpu_stream_ttl: Duration,
    pub(crate) restore_pipeline: bool,
    pub(crate) restore_sub_batch_bytes: u64,
    pub(crate) restore_sub_batch_keys: usize,
    pub(crate) restore_ahead_bytes: u64,
    pub(crate) restore_staging_bytes: u64,
    pub(crate) stream_window_chunks: usize,
    pub(crate) stream_max_handles: usize,
    pub(crate) unsealed_ttl: Duration,
    pub(crate) unsealed_bytes_per_shard: u64,
    pub(crate) read_index: bool,
}

/// The SSD tier's derived settings.
#[derive(Clone, Debug)]
pub(crate) struct SsdSettings {
    pub(crate) dir: std::path::PathBuf,
    pub(crate) bytes: u64,
    pub(crate) segment_bytes: u64,
    pub(crate) write_through: bool,
    pub(crate) restore_budget_bytes: u64,
    pub(crate) promote_on_hit: bool,
    pub(crate) simulated: Option<(u64, kvtide_tiers::ssd::SimFaults)>,
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty => $group:ident.$field:ident) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.$group.$field = value.into();
            self
        }
    };
}

impl StoreBuilder {
    /// Defaults.
    pub fn new() -> Self {
        Self::default()
    }

    setter!(/// DRAM pool size in bytes (`[dram] bytes`).
        dram_bytes: u64 => dram.bytes);
    setter!(/// Number of shards (`[runtime] shards`).
        shards: usize => runtime.shards);
    setter!(/// Longest key accepted (`[runtime] max_key_bytes`).
        max_key_bytes: usize => runtime.max_key_bytes);
    setter!(/// Largest value accepted (`[runtime] max_value_bytes`).
        max_value_bytes: u64 => runtime.max_value_bytes);
    setter!(/// Eviction high watermark, a fraction of a shard (`[dram] high_watermark`).
        high_watermark: f64 => dram.high_watermark);
    setter!(/// Eviction low watermark, a fraction of a shard (`[dram] low_watermark`).
        low_watermark: f64 => dram.low_watermark);
    setter!(/// Idle spin before parking, in microseconds (`[runtime] idle_spin_us`).
        idle_spin_us: u64 => runtime.idle_spin_us);
    setter!(/// How long a caller polls for a shard's reply before blocking, in microseconds
        /// (`[runtime] reply_spin_us`).
        reply_spin_us: u64 => runtime.reply_spin_us);
    setter!(/// Keep shards polling while a GPU transfer holds their leases (`[gpu] keep_shards_awake`).
        gpu_keep_shards_awake: bool => gpu.keep_shards_awake);
    setter!(/// Pin shard threads to CPUs (`[runtime] pin_threads`).
        pin_threads: bool => runtime.pin_threads);
    setter!(/// Register arena slices as io_uring fixed buffers (`[runtime] register_fixed_buffers`).
        register_fixed_buffers: bool => runtime.register_fixed_buffers);
    setter!(/// Use io_uring in the shards; false parks DRAM-only shards with poll(2)
        /// (`[runtime] io_uring`).
        io_uring: bool => runtime.io_uring);
    setter!(/// io_uring entries per shard (`[runtime] ring_entries`).
        ring_entries: u32 => runtime.ring_entries);
    setter!(/// Async tickets allowed in flight (`[runtime] max_tickets_in_flight`).
        max_tickets_in_flight: usize => runtime.max_tickets_in_flight);
    setter!(/// Objects per shard (`[dram] max_objects_per_shard`).
        max_objects_per_shard: u32 => dram.max_objects_per_shard);
    setter!(/// Leases per shard (`[dram] max_leases_per_shard`).
        max_leases_per_shard: u32 => dram.max_leases_per_shard);
    setter!(/// SSD tier capacity in bytes (`[ssd] bytes`).
        ssd_bytes: u64 => ssd.bytes);
    setter!(/// SSD segment file size in bytes (`[ssd] segment_bytes`).
        ssd_segment_bytes: u64 => ssd.segment_bytes);
    setter!(/// Acknowledge puts once durable on SSD (`[ssd] write_through`).
        write_through: bool => ssd.write_through);
    setter!(/// SSD load bytes in flight per shard (`[restore] budget_bytes`).
        restore_budget_bytes: u64 => restore.budget_bytes);
    setter!(/// Keep objects read from SSD in DRAM (`[ssd] promote_on_hit`).
        promote_on_hit: bool => ssd.promote_on_hit);
    setter!(/// Write DRAM-only objects to SSD on a clean shutdown (`[ssd] demote_on_shutdown`).
        demote_on_shutdown: bool => ssd.demote_on_shutdown);
    setter!(/// Time a clean shutdown may spend writing to SSD, in milliseconds
        /// (`[ssd] shutdown_flush_timeout_ms`).
        shutdown_flush_timeout_ms: u64 => ssd.shutdown_flush_timeout_ms);
    setter!(/// Pipeline batched reads that touch the SSD (`[restore] pipeline`).
        restore_pipeline: bool => restore.pipeline);
    setter!(/// Target bytes per restore sub-batch (`[restore] sub_batch_bytes`).
        restore_sub_batch_bytes: u64 => restore.sub_batch_bytes);
    setter!(/// Keys per restore sub-batch (`[restore] sub_batch_keys`).
        restore_sub_batch_keys: usize => restore.sub_batch_keys);
    setter!(/// Restore bytes one request keeps loading ahead per shard (`[restore] ahead_bytes`).
        restore_ahead_bytes: u64 => restore.ahead_bytes);
    setter!(/// Staging bytes all restores may hold at once (`[restore] staging_bytes`).
        restore_staging_bytes: u64 => restore.staging_bytes);
    setter!(/// Chunks of one chunk handle in flight at once (`[stream] window_chunks`).
        stream_window_chunks: usize => stream.window_chunks);
    setter!(/// Chunk handles running at once (`[stream] max_handles`).
        stream_max_handles: usize => stream.max_handles);
    setter!(/// Lifetime of an unsealed progressive put, in milliseconds (`[stream] unsealed_ttl_ms`).
        unsealed_ttl_ms: u64 => stream.unsealed_ttl_ms);
    setter!(/// Unsealed progressive-put bytes per shard (`[stream] unsealed_bytes_per_shard`).
        unsealed_bytes_per_shard: u64 => stream.unsealed_bytes_per_shard);
    setter!(/// Stage fragmented GPU transfers through one device buffer, feature `cuda`
        /// (`[gpu] staging`).
        gpu_staging: bool => gpu.staging);
    setter!(/// Size of the GPU staging buffer in bytes (`[gpu] staging_bytes`).
        gpu_staging_bytes: u64 => gpu.staging_bytes);
    setter!(/// Size the last staging fills of a request shrink to, in bytes, 0 for fixed fills
        /// (`[gpu] staging_tail_bytes`).
        gpu_staging_tail_bytes: u64 => gpu.staging_tail_bytes);
    setter!(/// Staging units per GPU for stream-bound reads (`[gpu] stream_units`).
        gpu_stream_units: u32 => gpu.stream_units);
    setter!(/// Device buffer of each stream-bound staging unit, in bytes (`[gpu] stream_unit_bytes`).
        gpu_stream_unit_bytes: u64 => gpu.stream_unit_bytes);
    setter!(/// Backstop lifetime of a stream-bound read whose stream never passes its copies, in
        /// milliseconds (`[gpu] stream_ttl_ms`).
        gpu_stream_ttl_ms: u64 => gpu.stream_ttl_ms);

    /// Runs the SSD tier (`ssd_bytes`, `ssd_segment_bytes`) on the seeded in-memory simulator
    /// with these faults instead of files: for tests and benchmarks of the engine above the disk.
    pub fn simulated_ssd(mut self, seed: u64, faults: kvtide_tiers::ssd::SimFaults) -> Self {
        self.simulated_ssd = Some((seed, faults));
        self
    }

    /// Keeps a read index for an owner's same-host clients (see the field).
    pub fn read_index(mut self, on: bool) -> Self {
        self.read_index = on;
        self
    }

    /// Enables the SSD tier in `dir` (`[ssd] dir`).
    pub fn ssd_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.ssd.dir = Some(dir.into());
        self
    }

    /// Eviction policy (`[dram] eviction`).
    pub fn eviction(mut self, policy: EvictionPolicy) -> Self {
        self.dram.eviction = policy.name().into();
        self
    }

    /// Every setting: (group, field), for documentation and tests.
    pub fn fields() -> Vec<(&'static str, &'static Field)> {
        StoreBuilder::default().groups().into_iter().flat_map(|(g, fs)| fs.iter().map(move |f| (g, f))).collect()
    }

    /// Parses TOML sections with the groups' names (`[dram]\nbytes = "4GiB"`; sizes may be
    /// numbers or strings like "8GiB"). An unknown section or key is an error that names the
    /// closest valid one.
    pub fn from_toml_str(text: &str) -> Result<Self, OpenError> {
        let mut builder = StoreBuilder::default();
        settings::apply_toml(&mut builder, text).map_err(OpenError::Config)?;
        Ok(builder)
    }

    /// Reads a TOML file.
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self, OpenError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|source| OpenError::ConfigFile { path: path.display().to_string(), source })?;
        Self::from_toml_str(&text)
    }

    /// Overrides settings from `KVTIDE_<GROUP>_<FIELD>` environment variables (e.g.
    /// `KVTIDE_DRAM_BYTES=4GiB`, `KVTIDE_RUNTIME_SHARDS=2`, `KVTIDE_SSD_WRITE_THROUGH=true`).
    /// Any other `KVTIDE_*` variable not on `settings::NON_SETTING_VARIABLES` is an error that
    /// names the closest setting.
    pub fn with_env(self) -> Result<Self, OpenError> {
        self.with_vars(std::env::vars())
    }

    /// `with_env` over an explicit list of variables (testable without touching the process).
    pub fn with_vars(mut self, vars: impl IntoIterator<Item = (String, String)>) -> Result<Self, OpenError> {
        settings::apply_variables(&mut self, vars).map_err(OpenError::Config)?;
        Ok(self)
    }

    /// Validates and derives the engine's configuration. The groups are checked in a fixed
    /// order, so the first problem reported does not depend on how the checks are split.
    pub(crate) fn validate(&self) -> Result<EngineConfig, OpenError> {
        let shards = self.shard_count()?;
        let policy = self.check_dram_and_runtime()?;
        self.check_gpu_and_spins()?;
        let ssd = self.ssd_settings(shards)?;
        self.check_restore_and_stream()?;
        Ok(self.engine_config(shards, policy, ssd))
    }

    /// The shard count: as set, else the SSD directory's recorded layout, else the CPUs.
    fn shard_count(&self) -> Result<usize, OpenError> {
        let err = |m: String| Err(OpenError::Config(m));
        Ok(match self.runtime.shards {
            Some(0) => return err("[runtime] shards must be at least 1".into()),
            Some(n) if n > 1024 => return err(format!("[runtime] shards = {n}: at most 1024")),
            Some(n) => n,
            // An SSD directory's shard count is part of its layout: a restart under another CPU
            // mask adopts it instead of refusing the directory.
            None => self
                .ssd
                .dir
                .as_deref()
                .filter(|_| self.simulated_ssd.is_none())
                .and_then(|dir| kvtide_tiers::ssd::RecordedLayout::read(dir).ok().flatten())
                .map_or_else(crate::shard::allowed_cpu_count, |layout| layout.shards),
        })
    }

    /// Checks the `[dram]` and `[runtime]` limits and parses the eviction policy.
    fn check_dram_and_runtime(&self) -> Result<EvictionPolicy, OpenError> {
        let err = |m: String| Err(OpenError::Config(m));
        if !(self.dram.low_watermark > 0.0
            && self.dram.low_watermark < self.dram.high_watermark
            && self.dram.high_watermark <= 1.0)
        {
            return err(format!(
                "[dram] watermarks must satisfy 0 < low ({}) < high ({}) <= 1",
                self.dram.low_watermark, self.dram.high_watermark
            ));
        }
        if self.runtime.max_key_bytes == 0 || self.runtime.max_key_bytes > (1 << 20) {
            return err(format!("[runtime] max_key_bytes = {}: must be 1..=1 MiB", self.runtime.max_key_bytes));
        }
        if self.runtime.max_value_bytes == Some(0) {
            return err("[runtime] max_value_bytes must be at least 1".into());
        }
        let Some(policy) = EvictionPolicy::parse(&self.dram.eviction) else {
            return err(format!("[dram] eviction = {:?}: expected \"lru\" or \"s3fifo\"", self.dram.eviction));
        };
        if !(8..=32768).contains(&self.runtime.ring_entries) || !self.runtime.ring_entries.is_power_of_two() {
            return err(format!("[runtime] ring_entries = {}: a power of two in 8..=32768", self.runtime.ring_entries));
        }
        if self.runtime.max_tickets_in_flight == 0
            || self.dram.max_objects_per_shard == 0
            || self.dram.max_leases_per_shard == 0
        {
            return err("[runtime] max_tickets_in_flight, [dram] max_objects_per_shard and max_leases_per_shard must be positive".into());
        }
        // Object ids index the eviction policy's links, which keep them in 29 bits.
        if self.dram.max_objects_per_shard > kvtide_tiers::eviction::MAX_ENTRY_ID + 1 {
            return err(format!(
                "[dram] max_objects_per_shard = {}: at most {}",
                self.dram.max_objects_per_shard,
                kvtide_tiers::eviction::MAX_ENTRY_ID + 1
            ));
        }
        if self.dram.bytes > isize::MAX as u64 {
            return err(format!("[dram] bytes = {} does not fit this address space", self.dram.bytes));
        }
        Ok(policy)
    }

    /// Checks the `[gpu]` sizes and the `[runtime]` spins.
    fn check_gpu_and_spins(&self) -> Result<(), OpenError> {
        let err = |m: String| Err(OpenError::Config(m));
        // Staging offsets are 32-bit in the kernel's row table.
        if !(4096..=(1 << 32)).contains(&self.gpu.staging_bytes) {
            return err(format!("[gpu] staging_bytes = {}: must be 4 KiB..=4 GiB", self.gpu.staging_bytes));
        }
        if !(4096..=(1 << 32)).contains(&self.gpu.stream_unit_bytes) || self.gpu.stream_units > 64 {
            return err(format!(
                "[gpu] stream_unit_bytes = {}: must be 4 KiB..=4 GiB; stream_units = {}: at most 64",
                self.gpu.stream_unit_bytes, self.gpu.stream_units
            ));
        }
        if self.gpu.stream_ttl_ms == 0 {
            return err("[gpu] stream_ttl_ms must be positive".into());
        }
        if self.gpu.staging_tail_bytes > self.gpu.staging_bytes {
            return err(format!(
                "[gpu] staging_tail_bytes = {}: at most staging_bytes ({})",
                self.gpu.staging_tail_bytes, self.gpu.staging_bytes
            ));
        }
        // Spins are a latency trade; a second is never one.
        if self.runtime.idle_spin_us > 1_000_000 || self.runtime.reply_spin_us > 1_000_000 {
            return err("[runtime] idle_spin_us and reply_spin_us must be at most 1 s".into());
        }
        Ok(())
    }

    /// The SSD tier's settings (None without one), segments sized for `shards`.
    fn ssd_settings(&self, shards: usize) -> Result<Option<SsdSettings>, OpenError> {
        let err = |m: String| Err(OpenError::Config(m));
        let dir = match (&self.ssd.dir, &self.simulated_ssd) {
            (Some(dir), _) => Some(dir.clone()),
            (None, Some(_)) => Some(std::path::PathBuf::from("<simulated>")),
            (None, None) => None,
        };
        let ssd = match &dir {
            None => None,
            Some(dir) => {
                if self.ssd.bytes == 0 || self.restore.budget_bytes == 0 {
                    return err("[ssd] bytes and [restore] budget_bytes must be positive".into());
                }
                // Object records keep SSD offsets in 32-bit counts of 4 KiB blocks.
                if self.ssd.segment_bytes > u64::from(u32::MAX) * 4096 {
                    return err(format!("[ssd] segment_bytes = {}: at most 16 TiB", self.ssd.segment_bytes));
                }
                // Small tiers get smaller segments so each shard still has a few to rotate.
                let per_shard = self.ssd.bytes / shards as u64;
                let segment_bytes = self.ssd.segment_bytes.min((per_shard / 4) / 4096 * 4096).max(64 << 10);
                Some(SsdSettings {
                    dir: dir.clone(),
                    bytes: self.ssd.bytes,
                    segment_bytes,
                    write_through: self.ssd.write_through,
                    restore_budget_bytes: self.restore.budget_bytes,
                    promote_on_hit: self.ssd.promote_on_hit,
                    simulated: self.simulated_ssd.clone(),
                })
            }
        };
        Ok(ssd)
    }

    /// Checks the `[restore]` and `[stream]` limits.
    fn check_restore_and_stream(&self) -> Result<(), OpenError> {
        let err = |m: String| Err(OpenError::Config(m));
        if self.restore.ahead_bytes == Some(0) || self.restore.sub_batch_bytes == 0 || self.restore.sub_batch_keys == 0
        {
            return err("[restore] ahead_bytes and the sub-batch limits must be positive".into());
        }
        if !(1..=1024).contains(&self.stream.window_chunks) || self.stream.max_handles == 0 {
            return err("[stream] window_chunks must be 1..=1024 and max_handles positive".into());
        }
        if self.stream.unsealed_ttl_ms == 0 || self.stream.unsealed_bytes_per_shard == Some(0) {
            return err("[stream] unsealed_ttl_ms and unsealed_bytes_per_shard must be positive".into());
        }
        Ok(())
    }

    /// The engine's configuration from checked settings.
    fn engine_config(&self, shards: usize, policy: EvictionPolicy, ssd: Option<SsdSettings>) -> EngineConfig {
        EngineConfig {
            stream_window_chunks: self.stream.window_chunks,
            stream_max_handles: self.stream.max_handles,
            unsealed_ttl: Duration::from_millis(self.stream.unsealed_ttl_ms),
            unsealed_bytes_per_shard: self
                .stream
                .unsealed_bytes_per_shard
                .unwrap_or(self.dram.bytes / shards as u64 / 4)
                .max(1),
            restore_pipeline: self.restore.pipeline,
            restore_sub_batch_bytes: self.restore.sub_batch_bytes,
            restore_sub_batch_keys: self.restore.sub_batch_keys,
            restore_ahead_bytes: self.restore.ahead_bytes.unwrap_or(self.restore.budget_bytes.saturating_mul(2)).max(1),
            restore_staging_bytes: self.restore.staging_bytes.unwrap_or(self.dram.bytes / 4).max(1),
            ssd,
            gpu_staging: self.gpu.staging,
            gpu_staging_bytes: self.gpu.staging_bytes,
            gpu_staging_tail_bytes: self.gpu.staging_tail_bytes,
            gpu_stream_units: self.gpu.stream_units,
            gpu_stream_unit_bytes: self.gpu.stream_unit_bytes,
            gpu_stream_ttl: Duration::from_millis(self.gpu.stream_ttl_ms),
            shards,
            dram_bytes: self.dram.bytes,
            max_key_bytes: self.runtime.max_key_bytes,
            max_value_bytes: self.runtime.max_value_bytes,
            high_watermark: self.dram.high_watermark,
            low_watermark: self.dram.low_watermark,
            policy,
            idle_spin: Duration::from_micros(self.runtime.idle_spin_us),
            demote_on_shutdown: self.ssd.demote_on_shutdown,
            shutdown_flush_timeout: Duration::from_millis(self.ssd.shutdown_flush_timeout_ms),
            reply_spin: Duration::from_micros(self.runtime.reply_spin_us),
            gpu_keep_shards_awake: self.gpu.keep_shards_awake,
            pin_threads: self.runtime.pin_threads,
            register_fixed_buffers: self.runtime.register_fixed_buffers,
            io_uring: self.runtime.io_uring,
            ring_entries: self.runtime.ring_entries,
            max_tickets_in_flight: self.runtime.max_tickets_in_flight,
            max_objects_per_shard: self.dram.max_objects_per_shard,
            max_leases_per_shard: self.dram.max_leases_per_shard,
            read_index: self.read_index,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Every setting's value as `{:?}` writes it, keyed by `group.field`.
    fn shown(b: &StoreBuilder) -> Vec<(String, String)> {
        StoreBuilder::fields()
            .into_iter()
            .map(|(g, f)| (format!("{g}.{}", f.name), b.show(g, f.name).expect("declared")))
            .collect()
    }

    #[test]
    fn every_setting_is_reachable_as_a_variable_and_in_toml() {
        let defaults = StoreBuilder::default();
        let fields = StoreBuilder::fields();
        assert_eq!(fields.len(), 40, "dram 6, ssd 7, restore 6, gpu 7, runtime 10, stream 4");
        let all_vars: Vec<(String, String)> =
            fields.iter().map(|(g, f)| (settings::variable_name(g, f.name), f.example.to_string())).collect();
        let by_env = StoreBuilder::new().with_vars(all_vars).expect("every variable at its example");
        let mut text = String::new();
        for (group, fields) in defaults.groups() {
            text.push_str(&format!("[{group}]\n"));
            for f in fields {
                let value = match f.kind {
                    settings::Kind::Count | settings::Kind::Fraction => f.example.to_string(),
                    settings::Kind::Bool => settings::parse_bool(f.example).expect("boolean example").to_string(),
                    _ => format!("{:?}", f.example),
                };
                text.push_str(&format!("{} = {value}\n", f.name));
            }
        }
        let by_toml = StoreBuilder::from_toml_str(&text).expect("every key at its example");
        for ((name, default), ((_, env), (_, toml))) in
            shown(&defaults).into_iter().zip(shown(&by_env).into_iter().zip(shown(&by_toml)))
        {
            assert_ne!(env, default, "{name}: the variable did not reach the builder");
            assert_eq!(env, toml, "{name}: the variable and the TOML key disagree");
        }
        // The examples are valid together, and the derived configuration carries them.
        let c = by_env.validate().expect("the examples validate");
        assert_eq!((c.dram_bytes, c.shards, c.max_key_bytes, c.max_value_bytes), (64 << 20, 3, 512, Some(1 << 20)));
        assert_eq!((c.high_watermark, c.low_watermark, c.policy), (0.9, 0.8, EvictionPolicy::Lru));
        assert_eq!((c.max_objects_per_shard, c.max_leases_per_shard), (4096, 8192));
        assert_eq!((c.idle_spin, c.reply_spin), (Duration::from_micros(20), Duration::ZERO));
        assert!(!c.pin_threads && !c.register_fixed_buffers && !c.gpu_keep_shards_awake && !c.demote_on_shutdown);
        assert!(!c.io_uring);
        assert_eq!((c.ring_entries, c.max_tickets_in_flight), (128, 16));
        assert_eq!(c.shutdown_flush_timeout, Duration::from_millis(1500));
        assert!(c.gpu_staging && c.gpu_staging_bytes == 64 << 20 && c.gpu_staging_tail_bytes == 1 << 20);
        assert_eq!((c.gpu_stream_units, c.gpu_stream_unit_bytes), (8, 64 << 20));
        assert_eq!(c.gpu_stream_ttl, Duration::from_millis(10_000));
        assert!(!c.restore_pipeline);
        assert_eq!(
            (c.restore_sub_batch_bytes, c.restore_sub_batch_keys, c.restore_ahead_bytes),
            (1 << 20, 32, 32 << 20)
        );
        assert_eq!(c.restore_staging_bytes, 8 << 20);
        let ssd = c.ssd.expect("[ssd] dir enables the tier");
        assert_eq!(ssd.dir, std::path::PathBuf::from("/tmp/kvtide-settings-example"));
        assert_eq!((ssd.bytes, ssd.segment_bytes, ssd.restore_budget_bytes), (256 << 20, 4 << 20, 16 << 20));
        assert!(ssd.write_through && !ssd.promote_on_hit);
        assert_eq!((c.stream_window_chunks, c.stream_max_handles), (2, 8));
        assert_eq!((c.unsealed_ttl, c.unsealed_bytes_per_shard), (Duration::from_millis(2500), 4 << 20));
    }

    #[test]
    fn toml_and_env_override_defaults() {
        let b =
            StoreBuilder::from_toml_str("[dram]\nbytes = \"64MiB\"\neviction = \"s3fifo\"\n[runtime]\nshards = 2\n")
                .expect("toml");
        assert_eq!(b.dram.bytes, 64 << 20);
        assert_eq!(b.runtime.shards, Some(2));
        let b = b
            .with_vars(vars(&[("KVTIDE_RUNTIME_SHARDS", "3"), ("PATH", "/bin"), ("KVTIDE_LOG", "debug")]))
            .expect("env");
        assert_eq!(b.runtime.shards, Some(3));
        let c = b.validate().expect("valid");
        assert_eq!(c.policy, EvictionPolicy::S3Fifo);
        assert!(!c.gpu_staging && c.gpu_staging_bytes == 256 << 20, "staging is opt-in, 256 MiB");
        let g = StoreBuilder::from_toml_str("[gpu]\nstaging = true\nstaging_bytes = \"64MiB\"\n").expect("toml");
        let g = g.with_vars(vars(&[("KVTIDE_GPU_STAGING_BYTES", "32MiB")])).expect("env");
        assert!(g.gpu.staging);
        assert_eq!(g.validate().expect("valid").gpu_staging_bytes, 32 << 20);
        // The variables that used to be read silently or not at all.
        let w = StoreBuilder::new()
            .with_vars(vars(&[
                ("KVTIDE_SSD_WRITE_THROUGH", "true"),
                ("KVTIDE_SSD_BYTES", "2GiB"),
                ("KVTIDE_SSD_DIR", "/x"),
            ]))
            .expect("env");
        assert!(w.ssd.write_through);
        assert_eq!((w.ssd.bytes, w.ssd.dir.clone()), (2 << 30, Some(std::path::PathBuf::from("/x"))));
    }

    #[test]
    fn unknown_names_fail_with_the_closest_valid_one() {
        let e = StoreBuilder::new().with_vars(vars(&[("KVTIDE_WRITE_THROUGH", "true")])).expect_err("unknown");
        assert_eq!(
            e.to_string(),
            "invalid configuration: unknown variable KVTIDE_WRITE_THROUGH; did you mean KVTIDE_SSD_WRITE_THROUGH?"
        );
        let e = StoreBuilder::new().with_vars(vars(&[("KVTIDE_SHARDS", "2")])).expect_err("unknown");
        assert!(e.to_string().contains("did you mean KVTIDE_RUNTIME_SHARDS?"), "{e}");
        let e = StoreBuilder::new().with_vars(vars(&[("KVTIDE_DRAM_BYTS", "1GiB")])).expect_err("unknown");
        assert!(e.to_string().contains("did you mean KVTIDE_DRAM_BYTES?"), "{e}");
        let e = StoreBuilder::from_toml_str("[dram]\nbites = 1\n").expect_err("unknown key");
        assert!(e.to_string().contains("unknown key bites in [dram]; did you mean bytes?"), "{e}");
        let e = StoreBuilder::from_toml_str("[ssd]\nbudget_bytes = 1\n").expect_err("key of another group");
        assert!(e.to_string().contains("did you mean [restore] budget_bytes?"), "{e}");
        let e = StoreBuilder::from_toml_str("[drams]\nbytes = 1\n").expect_err("unknown section");
        assert!(e.to_string().contains("unknown section [drams]; did you mean [dram]?"), "{e}");
        let e = StoreBuilder::from_toml_str("write_through = true\n").expect_err("key outside a section");
        assert!(e.to_string().contains("did you mean [ssd] write_through?"), "{e}");
        // The tools' and tests' own variables are never refused.
        let others: Vec<(String, String)> = settings::NON_SETTING_VARIABLES
            .iter()
            .map(|(name, _)| (if name.ends_with('_') { format!("{name}X") } else { name.to_string() }, "1".into()))
            .collect();
        StoreBuilder::new().with_vars(others).expect("non-setting variables are ignored");
    }

    #[test]
    fn latency_and_fill_settings_parse_and_are_bounded() {
        let d = StoreBuilder::new().validate().expect("valid");
        assert!(d.gpu_keep_shards_awake && d.reply_spin == Duration::from_micros(100));
        assert_eq!(d.gpu_staging_tail_bytes, 4 << 20);
        let v = vars(&[
            ("KVTIDE_RUNTIME_REPLY_SPIN_US", "0"),
            ("KVTIDE_GPU_KEEP_SHARDS_AWAKE", "off"),
            ("KVTIDE_GPU_STAGING_TAIL_BYTES", "16MiB"),
        ]);
        let c = StoreBuilder::new().with_vars(v).expect("env").validate().expect("valid");
        assert!(!c.gpu_keep_shards_awake && c.reply_spin.is_zero());
        assert_eq!(c.gpu_staging_tail_bytes, 16 << 20);
        let t = StoreBuilder::from_toml_str("[gpu]\nstaging_tail_bytes = \"0\"\n[runtime]\nreply_spin_us = 20\n")
            .expect("toml");
        assert_eq!(t.validate().expect("valid").gpu_staging_tail_bytes, 0);
        // A tail larger than the buffer, or a spin of more than a second, is refused.
        assert!(StoreBuilder::new().gpu_staging_bytes(8 << 20).gpu_staging_tail_bytes(16 << 20).validate().is_err());
        assert!(StoreBuilder::new().reply_spin_us(2_000_000).validate().is_err());
        assert!(StoreBuilder::new().with_vars(vars(&[("KVTIDE_GPU_KEEP_SHARDS_AWAKE", "maybe")])).is_err());
    }

    #[test]
    fn bad_config_is_a_clear_error() {
        assert!(StoreBuilder::from_toml_str("[dram]\nbytes = \"lots\"").is_err());
        assert!(StoreBuilder::new().shards(0).validate().is_err());
        assert!(StoreBuilder::new().max_objects_per_shard((1 << 29) - 1).validate().is_ok());
        let e = StoreBuilder::new().max_objects_per_shard(1 << 29).validate().expect_err("above 2^29 - 1");
        assert!(e.to_string().contains("max_objects_per_shard"), "{e}");
        assert!(StoreBuilder::new().low_watermark(0.99).validate().is_err());
        assert!(StoreBuilder::new().max_key_bytes(0).validate().is_err());
        assert!(StoreBuilder::new().ring_entries(100).validate().is_err());
        // Segments past 2^32 blocks of 4 KiB do not fit an object's packed SSD location.
        let huge = StoreBuilder::new().ssd_dir("/nonexistent").ssd_bytes(1 << 50).ssd_segment_bytes(17 << 40);
        let e = huge.validate().expect_err("segments over 16 TiB");
        assert!(e.to_string().contains("segment_bytes"), "{e}");
        let mut b = StoreBuilder::new();
        b.dram.eviction = "random".into();
        let e = b.validate().expect_err("bad policy");
        assert!(e.to_string().contains("random"), "{e}");
        let e = StoreBuilder::new().with_vars(vars(&[("KVTIDE_RUNTIME_SHARDS", "many")])).expect_err("not a count");
        assert!(e.to_string().contains("KVTIDE_RUNTIME_SHARDS"), "{e}");
        assert!(StoreBuilder::new().gpu_staging_bytes(100).validate().is_err());
        assert!(StoreBuilder::new().gpu_staging_bytes(8 << 30).validate().is_err());
    }
}
