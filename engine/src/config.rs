//! `StoreBuilder`: what users fill in (in code, from a TOML file or from `KVTIDE_*` variables).
//! It validates everything before any memory is mapped and derives the per-shard configs.

use std::path::Path;
use std::time::Duration;

use kvtide_tiers::eviction::EvictionPolicy;
use serde::Deserialize;

use crate::engine::Engine;
use crate::error::OpenError;

/// Builds an embedded store. Every field has a default; see each setter.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreBuilder {
    /// DRAM pool size. Default 1 GiB.
    #[serde(deserialize_with = "de_bytes")]
    pub dram_bytes: u64,
    /// Shard count. Default: the CPUs this process may run on.
    pub shards: Option<usize>,
    /// Longest key accepted. Default 1 KiB.
    pub max_key_bytes: usize,
    /// Largest value accepted. Default: one shard's slice.
    #[serde(deserialize_with = "de_bytes_opt")]
    pub max_value_bytes: Option<u64>,
    /// Eviction starts above this fraction of a shard's slice. Default 0.95.
    pub high_watermark: f64,
    /// ... and stops at this fraction. Default 0.85.
    pub low_watermark: f64,
    /// "lru" or "s3fifo".
    pub eviction: String,
    /// How long an idle shard spins before parking. Default 50 us.
    pub idle_spin_us: u64,
    /// How long a caller polls for a shard's reply before it blocks. Default 100 us: a blocked
    /// caller pays a wake-up (tens of microseconds, more in a VM) on every round trip.
    pub reply_spin_us: u64,
    /// Shards do not park while a GPU transfer that holds their leases is in flight, so its
    /// release and the caller's next request cost no wake-up. Default true.
    pub gpu_keep_shards_awake: bool,
    /// Pin shard threads to CPUs. Default true.
    pub pin_threads: bool,
    /// Register each arena slice with its ring as fixed buffers. Default true.
    pub register_fixed_buffers: bool,
    /// io_uring submission queue entries per shard. Default 256.
    pub ring_entries: u32,
    /// Async tickets allowed in flight at once. Default 1024.
    pub max_tickets_in_flight: usize,
    /// Objects per shard (bounds the allocator's node table). Default 1 Mi.
    pub max_objects_per_shard: u32,
    /// Leases per shard. Default 1 Mi.
    pub max_leases_per_shard: u32,
    /// Directory of the SSD tier. None (default): DRAM only.
    pub ssd_dir: Option<std::path::PathBuf>,
    /// SSD tier capacity. Default 8 GiB.
    #[serde(deserialize_with = "de_bytes")]
    pub ssd_bytes: u64,
    /// Segment file size. Default 64 MiB (smaller when the tier is small).
    #[serde(deserialize_with = "de_bytes")]
    pub ssd_segment_bytes: u64,
    /// Acknowledge puts only once they are durable on SSD. Default false (write-back on eviction).
    pub write_through: bool,
    /// SSD loads in flight per shard, in bytes; more wait. Default 64 MiB.
    #[serde(deserialize_with = "de_bytes")]
    pub restore_budget_bytes: u64,
    /// Keep objects read from SSD in DRAM. Default true.
    pub promote_on_hit: bool,
    /// A clean shutdown writes DRAM-only objects to the SSD tier, so the cache is warm after a
    /// restart. Default true.
    pub demote_on_shutdown: bool,
    /// How long a clean shutdown spends on that at most; what is not written by then is not kept
    /// (queued tombstones are written past it too: they keep older values from returning).
    /// Default 30 s.
    pub shutdown_flush_timeout_ms: u64,
    /// Stage fragmented GPU reads and writes through one device buffer with one scatter/gather
    /// kernel per fill (feature `cuda`). Default false: direct copies.
    pub gpu_staging: bool,
    /// Payload budget of that buffer, allocated lazily on the destination GPU. Default 256 MiB.
    #[serde(deserialize_with = "de_bytes")]
    pub gpu_staging_bytes: u64,
    /// Staging fills shrink towards the end of a request, down to about this size, so little
    /// scatter work is left once the last copy lands (0: fixed quarter-buffer fills).
    /// Default 4 MiB.
    #[serde(deserialize_with = "de_bytes")]
    pub gpu_staging_tail_bytes: u64,
    /// Run the SSD tier on the in-memory fault-injecting simulator instead of files (tests and
    /// benchmarks; nothing survives the process). Set with `simulated_ssd`.
    #[serde(skip)]
    pub simulated_ssd: Option<(u64, kvtide_tiers::ssd::SimFaults)>,
    /// Batched reads that touch the SSD are pipelined (sub-batch loads overlap transfers).
    /// Default true.
    pub restore_pipeline: bool,
    /// Target bytes per restore sub-batch (whole objects). Default 2 MiB (from `kvtide-bench restore`).
    #[serde(deserialize_with = "de_bytes")]
    pub restore_sub_batch_bytes: u64,
    /// Keys per restore sub-batch at most. Default 64.
    pub restore_sub_batch_keys: usize,
    /// Restore sub-batches in flight per request, 1..=8. Default 2.
    pub restore_window: usize,
    /// Staging bytes all restores may hold at once (per shard: at most half a slice).
    /// Default: a quarter of `dram_bytes`.
    #[serde(deserialize_with = "de_bytes_opt")]
    pub restore_staging_bytes: Option<u64>,
}

impl Default for StoreBuilder {
    fn default() -> Self {
        StoreBuilder {
            dram_bytes: 1 << 30,
            shards: None,
            max_key_bytes: 1024,
            max_value_bytes: None,
            high_watermark: 0.95,
            low_watermark: 0.85,
            eviction: "s3fifo".into(),
            idle_spin_us: 50,
            reply_spin_us: 100,
            gpu_keep_shards_awake: true,
            pin_threads: true,
            register_fixed_buffers: true,
            ring_entries: 256,
            max_tickets_in_flight: 1024,
            max_objects_per_shard: 1 << 20,
            max_leases_per_shard: 1 << 20,
            ssd_dir: None,
            ssd_bytes: 8 << 30,
            ssd_segment_bytes: 64 << 20,
            write_through: false,
            restore_budget_bytes: 64 << 20,
            promote_on_hit: true,
            demote_on_shutdown: true,
            shutdown_flush_timeout_ms: 30_000,
            gpu_staging: false,
            gpu_staging_bytes: 256 << 20,
            gpu_staging_tail_bytes: 4 << 20,
            simulated_ssd: None,
            restore_pipeline: true,
            restore_sub_batch_bytes: 2 << 20,
            restore_sub_batch_keys: 64,
            restore_window: 2,
            restore_staging_bytes: None,
        }
    }
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
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) gpu_keep_shards_awake: bool,
    pub(crate) pin_threads: bool,
    pub(crate) register_fixed_buffers: bool,
    pub(crate) ring_entries: u32,
    pub(crate) max_tickets_in_flight: usize,
    pub(crate) max_objects_per_shard: u32,
    pub(crate) max_leases_per_shard: u32,
    pub(crate) ssd: Option<SsdSettings>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) gpu_staging: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) gpu_staging_bytes: u64,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) gpu_staging_tail_bytes: u64,
    pub(crate) restore_pipeline: bool,
    pub(crate) restore_sub_batch_bytes: u64,
    pub(crate) restore_sub_batch_keys: usize,
    pub(crate) restore_window: usize,
    pub(crate) restore_staging_bytes: u64,
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
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Self {
            self.$name = value.into();
            self
        }
    };
}

impl StoreBuilder {
    /// Defaults.
    pub fn new() -> Self {
        Self::default()
    }

    setter!(/// DRAM pool size in bytes.
        dram_bytes: u64);
    setter!(/// Number of shards.
        shards: usize);
    setter!(/// Longest key accepted.
        max_key_bytes: usize);
    setter!(/// Largest value accepted.
        max_value_bytes: u64);
    setter!(/// Eviction high watermark (fraction of a shard).
        high_watermark: f64);
    setter!(/// Eviction low watermark (fraction of a shard).
        low_watermark: f64);
    setter!(/// Idle spin before parking, in microseconds.
        idle_spin_us: u64);
    setter!(/// How long a caller polls for a shard's reply before blocking, in microseconds.
        reply_spin_us: u64);
    setter!(/// Keep shards polling while a GPU transfer holds their leases.
        gpu_keep_shards_awake: bool);
    setter!(/// Pin shard threads to CPUs.
        pin_threads: bool);
    setter!(/// Register arena slices as io_uring fixed buffers.
        register_fixed_buffers: bool);
    setter!(/// io_uring entries per shard.
        ring_entries: u32);
    setter!(/// Async tickets allowed in flight.
        max_tickets_in_flight: usize);
    setter!(/// Objects per shard.
        max_objects_per_shard: u32);
    setter!(/// Leases per shard.
        max_leases_per_shard: u32);
    setter!(/// SSD tier capacity in bytes.
        ssd_bytes: u64);
    setter!(/// SSD segment file size in bytes.
        ssd_segment_bytes: u64);
    setter!(/// Acknowledge puts once durable on SSD.
        write_through: bool);
    setter!(/// SSD load bytes in flight per shard.
        restore_budget_bytes: u64);
    setter!(/// Keep objects read from SSD in DRAM.
        promote_on_hit: bool);
    setter!(/// Write DRAM-only objects to SSD on a clean shutdown.
        demote_on_shutdown: bool);
    setter!(/// Time a clean shutdown may spend writing to SSD, in milliseconds.
        shutdown_flush_timeout_ms: u64);
    setter!(/// Pipeline batched reads that touch the SSD.
        restore_pipeline: bool);
    setter!(/// Target bytes per restore sub-batch.
        restore_sub_batch_bytes: u64);
    setter!(/// Keys per restore sub-batch.
        restore_sub_batch_keys: usize);
    setter!(/// Restore sub-batches in flight per request.
        restore_window: usize);
    setter!(/// Staging bytes all restores may hold at once.
        restore_staging_bytes: u64);
    setter!(/// Stage fragmented GPU transfers through one device buffer (feature `cuda`).
        gpu_staging: bool);
    setter!(/// Size of the GPU staging buffer in bytes.
        gpu_staging_bytes: u64);
    setter!(/// Size the last staging fills of a request shrink to, in bytes (0: fixed fills).
        gpu_staging_tail_bytes: u64);

    /// Runs the SSD tier (`ssd_bytes`, `ssd_segment_bytes`) on the seeded in-memory simulator
    /// with these faults instead of files: for tests and benchmarks of the engine above the disk.
    pub fn simulated_ssd(mut self, seed: u64, faults: kvtide_tiers::ssd::SimFaults) -> Self {
        self.simulated_ssd = Some((seed, faults));
        self
    }

    /// Enables the SSD tier in `dir`.
    pub fn ssd_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.ssd_dir = Some(dir.into());
        self
    }

    /// Eviction policy.
    pub fn eviction(mut self, policy: EvictionPolicy) -> Self {
        self.eviction = policy.name().into();
        self
    }

    /// Parses TOML with the same field names (sizes may be numbers or strings like "8GiB").
    pub fn from_toml_str(text: &str) -> Result<Self, OpenError> {
        toml::from_str(text).map_err(|e| OpenError::Config(format!("TOML: {e}")))
    }

    /// Reads a TOML file.
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self, OpenError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|source| OpenError::ConfigFile { path: path.display().to_string(), source })?;
        Self::from_toml_str(&text)
    }

    /// Overrides fields from `KVTIDE_<FIELD>` environment variables (e.g. `KVTIDE_DRAM_BYTES=4GiB`,
    /// `KVTIDE_SHARDS=2`, `KVTIDE_EVICTION=s3fifo`).
    pub fn with_env(self) -> Result<Self, OpenError> {
        self.with_vars(std::env::vars())
    }

    /// `with_env` over an explicit list of variables (testable without touching the process).
    pub fn with_vars(mut self, vars: impl IntoIterator<Item = (String, String)>) -> Result<Self, OpenError> {
        for (name, value) in vars {
            let Some(field) = name.strip_prefix("KVTIDE_") else { continue };
            let bad = |what: &str| OpenError::Config(format!("{name}={value:?}: {what}"));
            let v = value.trim();
            match field {
                "DRAM_BYTES" => self.dram_bytes = parse_bytes(v).ok_or_else(|| bad("expected a size"))?,
                "SHARDS" => self.shards = Some(v.parse().map_err(|_| bad("expected a count"))?),
                "MAX_KEY_BYTES" => self.max_key_bytes = parse_bytes(v).ok_or_else(|| bad("expected a size"))? as usize,
                "MAX_VALUE_BYTES" => self.max_value_bytes = Some(parse_bytes(v).ok_or_else(|| bad("expected a size"))?),
                "HIGH_WATERMARK" => self.high_watermark = v.parse().map_err(|_| bad("expected a fraction"))?,
                "LOW_WATERMARK" => self.low_watermark = v.parse().map_err(|_| bad("expected a fraction"))?,
                "EVICTION" => self.eviction = v.to_string(),
                "IDLE_SPIN_US" => self.idle_spin_us = v.parse().map_err(|_| bad("expected microseconds"))?,
                "REPLY_SPIN_US" => self.reply_spin_us = v.parse().map_err(|_| bad("expected microseconds"))?,
                "GPU_KEEP_SHARDS_AWAKE" => {
                    self.gpu_keep_shards_awake = parse_bool(v).ok_or_else(|| bad("expected true/false"))?
                }
                "GPU_STAGING_TAIL_BYTES" => {
                    self.gpu_staging_tail_bytes = parse_bytes(v).ok_or_else(|| bad("expected a size"))?
                }
                "PIN_THREADS" => self.pin_threads = parse_bool(v).ok_or_else(|| bad("expected true/false"))?,
                "REGISTER_FIXED_BUFFERS" => {
                    self.register_fixed_buffers = parse_bool(v).ok_or_else(|| bad("expected true/false"))?
                }
                "RING_ENTRIES" => self.ring_entries = v.parse().map_err(|_| bad("expected a count"))?,
                "MAX_TICKETS_IN_FLIGHT" => {
                    self.max_tickets_in_flight = v.parse().map_err(|_| bad("expected a count"))?
                }
                "DEMOTE_ON_SHUTDOWN" => {
                    self.demote_on_shutdown = parse_bool(v).ok_or_else(|| bad("expected true/false"))?
                }
                "SHUTDOWN_FLUSH_TIMEOUT_MS" => {
                    self.shutdown_flush_timeout_ms = v.parse().map_err(|_| bad("expected milliseconds"))?
                }
                "GPU_STAGING" => self.gpu_staging = parse_bool(v).ok_or_else(|| bad("expected true/false"))?,
                "GPU_STAGING_BYTES" => self.gpu_staging_bytes = parse_bytes(v).ok_or_else(|| bad("expected a size"))?,
                // Variables for other tools (KVTIDE_LOG, bench settings) are not ours to refuse.
                _ => {}
            }
        }
        Ok(self)
    }

    /// Validates and derives the engine's configuration.
    pub(crate) fn validate(&self) -> Result<EngineConfig, OpenError> {
        let err = |m: String| Err(OpenError::Config(m));
        let shards = match self.shards {
            Some(0) => return err("shards must be at least 1".into()),
            Some(n) if n > 1024 => return err(format!("shards = {n}: at most 1024")),
            Some(n) => n,
            None => crate::shard::allowed_cpu_count(),
        };
        if !(self.low_watermark > 0.0 && self.low_watermark < self.high_watermark && self.high_watermark <= 1.0) {
            return err(format!(
                "watermarks must satisfy 0 < low ({}) < high ({}) <= 1",
                self.low_watermark, self.high_watermark
            ));
        }
        if self.max_key_bytes == 0 || self.max_key_bytes > (1 << 20) {
            return err(format!("max_key_bytes = {}: must be 1..=1 MiB", self.max_key_bytes));
        }
        if self.max_value_bytes == Some(0) {
            return err("max_value_bytes must be at least 1".into());
        }
        let Some(policy) = EvictionPolicy::parse(&self.eviction) else {
            return err(format!("eviction = {:?}: expected \"lru\" or \"s3fifo\"", self.eviction));
        };
        if !(8..=32768).contains(&self.ring_entries) || !self.ring_entries.is_power_of_two() {
            return err(format!("ring_entries = {}: a power of two in 8..=32768", self.ring_entries));
        }
        if self.max_tickets_in_flight == 0 || self.max_objects_per_shard == 0 || self.max_leases_per_shard == 0 {
            return err("max_tickets_in_flight, max_objects_per_shard and max_leases_per_shard must be positive".into());
        }
        if self.dram_bytes > isize::MAX as u64 {
            return err(format!("dram_bytes = {} does not fit this address space", self.dram_bytes));
        }
        // Staging offsets are 32-bit in the kernel's row table.
        if !(4096..=(1 << 32)).contains(&self.gpu_staging_bytes) {
            return err(format!("gpu_staging_bytes = {}: must be 4 KiB..=4 GiB", self.gpu_staging_bytes));
        }
        if self.gpu_staging_tail_bytes > self.gpu_staging_bytes {
            return err(format!(
                "gpu_staging_tail_bytes = {}: at most gpu_staging_bytes ({})",
                self.gpu_staging_tail_bytes, self.gpu_staging_bytes
            ));
        }
        // Spins are a latency trade; a second is never one.
        if self.idle_spin_us > 1_000_000 || self.reply_spin_us > 1_000_000 {
            return err("idle_spin_us and reply_spin_us must be at most 1 s".into());
        }
        let dir = match (&self.ssd_dir, &self.simulated_ssd) {
            (Some(dir), _) => Some(dir.clone()),
            (None, Some(_)) => Some(std::path::PathBuf::from("<simulated>")),
            (None, None) => None,
        };
        let ssd = match &dir {
            None => None,
            Some(dir) => {
                if self.ssd_bytes == 0 || self.restore_budget_bytes == 0 {
                    return err("ssd_bytes and restore_budget_bytes must be positive".into());
                }
                // Small tiers get smaller segments so each shard still has a few to rotate.
                let per_shard = self.ssd_bytes / shards as u64;
                let segment_bytes = self.ssd_segment_bytes.min((per_shard / 4) / 4096 * 4096).max(64 << 10);
                Some(SsdSettings {
                    dir: dir.clone(),
                    bytes: self.ssd_bytes,
                    segment_bytes,
                    write_through: self.write_through,
                    restore_budget_bytes: self.restore_budget_bytes,
                    promote_on_hit: self.promote_on_hit,
                    simulated: self.simulated_ssd.clone(),
                })
            }
        };
        if !(1..=8).contains(&self.restore_window)
            || self.restore_sub_batch_bytes == 0
            || self.restore_sub_batch_keys == 0
        {
            return err("restore_window must be 1..=8 and restore sub-batch limits positive".into());
        }
        Ok(EngineConfig {
            restore_pipeline: self.restore_pipeline,
            restore_sub_batch_bytes: self.restore_sub_batch_bytes,
            restore_sub_batch_keys: self.restore_sub_batch_keys,
            restore_window: self.restore_window,
            restore_staging_bytes: self.restore_staging_bytes.unwrap_or(self.dram_bytes / 4).max(1),
            ssd,
            gpu_staging: self.gpu_staging,
            gpu_staging_bytes: self.gpu_staging_bytes,
            gpu_staging_tail_bytes: self.gpu_staging_tail_bytes,
            shards,
            dram_bytes: self.dram_bytes,
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes,
            high_watermark: self.high_watermark,
            low_watermark: self.low_watermark,
            policy,
            idle_spin: Duration::from_micros(self.idle_spin_us),
            demote_on_shutdown: self.demote_on_shutdown,
            shutdown_flush_timeout: Duration::from_millis(self.shutdown_flush_timeout_ms),
            reply_spin: Duration::from_micros(self.reply_spin_us),
            gpu_keep_shards_awake: self.gpu_keep_shards_awake,
            pin_threads: self.pin_threads,
            register_fixed_buffers: self.register_fixed_buffers,
            ring_entries: self.ring_entries,
            max_tickets_in_flight: self.max_tickets_in_flight,
            max_objects_per_shard: self.max_objects_per_shard,
            max_leases_per_shard: self.max_leases_per_shard,
        })
    }

    /// Maps the arena, starts the shards and returns the engine.
    pub fn open(self) -> Result<Engine, OpenError> {
        Engine::open(self.validate()?)
    }
}

/// Parses "123", "64KiB", "8 GiB", "1.5GB", "512M" into bytes (binary units for K/M/G/T).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().ok()?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    let bytes = number * multiplier as f64;
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

fn parse_bool(text: &str) -> Option<bool> {
    match text.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Number(u64),
    Text(String),
}

fn de_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match Size::deserialize(d)? {
        Size::Number(n) => Ok(n),
        Size::Text(s) => parse_bytes(&s).ok_or_else(|| serde::de::Error::custom(format!("bad size {s:?}"))),
    }
}

fn de_bytes_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_bytes(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("64KiB"), Some(64 << 10));
        assert_eq!(parse_bytes("8 GiB"), Some(8 << 30));
        assert_eq!(parse_bytes("1.5m"), Some(3 << 19));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("12XB"), None);
    }

    #[test]
    fn toml_and_env_override_defaults() {
        let b =
            StoreBuilder::from_toml_str("dram_bytes = \"64MiB\"\nshards = 2\neviction = \"s3fifo\"\n").expect("toml");
        assert_eq!(b.dram_bytes, 64 << 20);
        assert_eq!(b.shards, Some(2));
        let b =
            b.with_vars([("KVTIDE_SHARDS".to_string(), "3".to_string()), ("PATH".into(), "/bin".into())]).expect("env");
        assert_eq!(b.shards, Some(3));
        let c = b.validate().expect("valid");
        assert_eq!(c.policy, EvictionPolicy::S3Fifo);
        assert!(!c.gpu_staging && c.gpu_staging_bytes == 256 << 20, "staging is opt-in, 256 MiB");
        let g = StoreBuilder::from_toml_str("gpu_staging = true\ngpu_staging_bytes = \"64MiB\"\n").expect("toml");
        let g = g.with_vars([("KVTIDE_GPU_STAGING_BYTES".to_string(), "32MiB".to_string())]).expect("env");
        assert!(g.gpu_staging);
        assert_eq!(g.validate().expect("valid").gpu_staging_bytes, 32 << 20);
    }

    #[test]
    fn latency_and_fill_settings_parse_and_are_bounded() {
        let d = StoreBuilder::new().validate().expect("valid");
        assert!(d.gpu_keep_shards_awake && d.reply_spin == Duration::from_micros(100));
        assert_eq!(d.gpu_staging_tail_bytes, 4 << 20);
        let vars = [
            ("KVTIDE_REPLY_SPIN_US", "0"),
            ("KVTIDE_GPU_KEEP_SHARDS_AWAKE", "off"),
            ("KVTIDE_GPU_STAGING_TAIL_BYTES", "16MiB"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let c = StoreBuilder::new().with_vars(vars).expect("env").validate().expect("valid");
        assert!(!c.gpu_keep_shards_awake && c.reply_spin.is_zero());
        assert_eq!(c.gpu_staging_tail_bytes, 16 << 20);
        let t = StoreBuilder::from_toml_str("gpu_staging_tail_bytes = \"0\"\nreply_spin_us = 20\n").expect("toml");
        assert_eq!(t.validate().expect("valid").gpu_staging_tail_bytes, 0);
        // A tail larger than the buffer, or a spin of more than a second, is refused.
        assert!(StoreBuilder::new().gpu_staging_bytes(8 << 20).gpu_staging_tail_bytes(16 << 20).validate().is_err());
        assert!(StoreBuilder::new().reply_spin_us(2_000_000).validate().is_err());
        assert!(StoreBuilder::new().with_vars([("KVTIDE_GPU_KEEP_SHARDS_AWAKE".into(), "maybe".into())]).is_err());
    }

    #[test]
    fn bad_config_is_a_clear_error() {
        assert!(StoreBuilder::from_toml_str("dram_bites = 1").is_err());
        assert!(StoreBuilder::new().shards(0).validate().is_err());
        assert!(StoreBuilder::new().low_watermark(0.99).validate().is_err());
        assert!(StoreBuilder::new().max_key_bytes(0).validate().is_err());
        assert!(StoreBuilder::new().ring_entries(100).validate().is_err());
        let mut b = StoreBuilder::new();
        b.eviction = "random".into();
        let e = b.validate().expect_err("bad policy");
        assert!(e.to_string().contains("random"), "{e}");
        assert!(StoreBuilder::new().with_vars([("KVTIDE_SHARDS".into(), "many".into())]).is_err());
        assert!(StoreBuilder::new().gpu_staging_bytes(100).validate().is_err());
        assert!(StoreBuilder::new().gpu_staging_bytes(8 << 30).validate().is_err());
    }
}
