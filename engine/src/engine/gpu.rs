//! GPU setup and GPU counters.
//!
//! Owns the store's staging policy, the lazy `cuMemHostRegister` of the DRAM arena, the
//! transport that reaches GPU memory (the CUDA transport with feature `cuda`; without it, or
//! without a driver, a transport that refuses GPU memory with `CudaUnavailable`) and the GPU
//! counters. It never moves bytes itself: the read and write paths do, through the transport
//! it hands out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvtide_tiers::dram::Arena;
use kvtide_transport::cuda::plan::{Fallback, StagingPolicy};
use kvtide_transport::{Direction, Summary, Transport, TransportError, Unreachable};

use crate::config::EngineConfig;
use crate::stats::GpuStats;

/// The store's GPU state.
pub(crate) struct GpuState {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    policy: StagingPolicy,
    /// Stream-bound staging units per GPU and their size.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    stream_units: (u32, u64),
    /// The transport for GPU memory, made at first use (with the arena registration).
    transport: Mutex<Option<Arc<dyn Transport>>>,
    counters: Arc<GpuCounters>,
}

/// When a read's phases ended, for the phase counters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    pub(crate) started: Instant,
    pub(crate) sent_at: Instant,
    pub(crate) granted_at: Instant,
    pub(crate) early_at: Instant,
    pub(crate) planned_at: Instant,
    pub(crate) submitted_at: Instant,
}

#[derive(Default)]
pub(crate) struct GpuCounters {
    send_us: AtomicU64,
    grant_us: AtomicU64,
    prestage_us: AtomicU64,
    plan_us: AtomicU64,
    submit_us: AtomicU64,
    wait_us: AtomicU64,
    write_us: [AtomicU64; 5],
    write_first_part_us: AtomicU64,
    registered: AtomicU64,
    registration_us: AtomicU64,
    staged_requests: AtomicU64,
    direct_requests: AtomicU64,
    fills: AtomicU64,
    kernel_launches: AtomicU64,
    copy_calls: AtomicU64,
    batch_calls: AtomicU64,
    bytes_to_device: AtomicU64,
    bytes_to_host: AtomicU64,
    failed_keys: AtomicU64,
    fallbacks: Mutex<HashMap<&'static str, u64>>,
    pub(crate) bound_reads: AtomicU64,
    pub(crate) bound_in_flight: AtomicU64,
    pub(crate) bound_keys_pinned: AtomicU64,
    pub(crate) bound_gated_keys: AtomicU64,
    pub(crate) bound_failed_keys: AtomicU64,
    pub(crate) bound_expired: AtomicU64,
    pub(crate) bound_steps: AtomicU64,
    pub(crate) bound_step_layers: AtomicU64,
    bound_call_us: [AtomicU64; 4],
}

impl GpuCounters {
    /// One submission to GPU memory (None: it failed to submit) and how many of its transfers
    /// failed.
    pub(crate) fn record(&self, summary: Option<&Summary>, direction: Direction, failed: u64) {
        let c = self;
        c.failed_keys.fetch_add(failed, Relaxed);
        let Some(summary) = summary else { return };
        if summary.staged {
            c.staged_requests.fetch_add(1, Relaxed);
        } else {
            c.direct_requests.fetch_add(1, Relaxed);
        }
        if let Some(reason) = summary.fallback {
            if reason != Fallback::Disabled {
                *c.fallbacks.lock().unwrap_or_else(|p| p.into_inner()).entry(reason.name()).or_default() += 1;
            }
        }
        c.fills.fetch_add(summary.fills, Relaxed);
        c.kernel_launches.fetch_add(summary.kernel_launches, Relaxed);
        c.copy_calls.fetch_add(summary.copy_calls, Relaxed);
        c.batch_calls.fetch_add(summary.batch_calls, Relaxed);
        let bytes = match direction {
            Direction::HostToDevice => &c.bytes_to_device,
            Direction::DeviceToHost => &c.bytes_to_host,
        };
        bytes.fetch_add(summary.bytes, Relaxed);
    }

    /// A stream-bound call's phase boundaries: start, stream checked, leases granted, planned,
    /// submitted.
    pub(crate) fn record_bound_call(&self, at: [Instant; 5]) {
        for (phase, w) in at.windows(2).enumerate() {
            let us = w[1].saturating_duration_since(w[0]).as_micros() as u64;
            self.bound_call_us[phase].fetch_add(us, Relaxed);
        }
    }

    /// A gathered write's time per phase over its parts (reserving with the sources checked
    /// meanwhile, building transfers, submitting, waiting, committing) and until its first part
    /// was submitted.
    pub(crate) fn record_write(&self, spent: [std::time::Duration; 5], first_part: std::time::Duration) {
        for (phase, d) in spent.iter().enumerate() {
            self.write_us[phase].fetch_add(d.as_micros() as u64, Relaxed);
        }
        self.write_first_part_us.fetch_add(first_part.as_micros() as u64, Relaxed);
    }

    /// A blocking read's phases, ending now.
    pub(crate) fn record_timing(&self, t: &Timing) {
        let us = |a: Instant, b: Instant| b.saturating_duration_since(a).as_micros() as u64;
        self.send_us.fetch_add(us(t.started, t.sent_at), Relaxed);
        self.grant_us.fetch_add(us(t.sent_at, t.granted_at), Relaxed);
        self.prestage_us.fetch_add(us(t.granted_at, t.early_at), Relaxed);
        self.plan_us.fetch_add(us(t.early_at, t.planned_at), Relaxed);
        self.submit_us.fetch_add(us(t.planned_at, t.submitted_at), Relaxed);
        self.wait_us.fetch_add(us(t.submitted_at, Instant::now()), Relaxed);
    }
}

impl GpuState {
    pub(crate) fn new(config: &EngineConfig) -> GpuState {
        GpuState {
            policy: StagingPolicy {
                enabled: config.gpu_staging,
                buffer_bytes: config.gpu_staging_bytes,
                tail_fill_bytes: config.gpu_staging_tail_bytes,
            },
            stream_units: (config.gpu_stream_units, config.gpu_stream_unit_bytes),
            transport: Mutex::new(None),
            counters: Arc::new(GpuCounters::default()),
        }
    }

    pub(crate) fn counters(&self) -> &Arc<GpuCounters> {
        &self.counters
    }

    pub(crate) fn stats(&self) -> GpuStats {
        let c = &self.counters;
        let mut fallbacks: Vec<(String, u64)> =
            c.fallbacks.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.to_string(), *v)).collect();
        fallbacks.sort();
        GpuStats {
            arena_registered: c.registered.load(Relaxed) > 0,
            registration_us: c.registration_us.load(Relaxed),
            staged_requests: c.staged_requests.load(Relaxed),
            direct_requests: c.direct_requests.load(Relaxed),
            staged_fills: c.fills.load(Relaxed),
            kernel_launches: c.kernel_launches.load(Relaxed),
            copy_calls: c.copy_calls.load(Relaxed),
            batch_copy_calls: c.batch_calls.load(Relaxed),
            bytes_to_device: c.bytes_to_device.load(Relaxed),
            bytes_to_host: c.bytes_to_host.load(Relaxed),
            failed_keys: c.failed_keys.load(Relaxed),
            fallbacks,
            read_phase_us: [
                c.send_us.load(Relaxed),
                c.grant_us.load(Relaxed),
                c.prestage_us.load(Relaxed),
                c.plan_us.load(Relaxed),
                c.submit_us.load(Relaxed),
                c.wait_us.load(Relaxed),
            ],
            write_phase_us: std::array::from_fn(|i| c.write_us[i].load(Relaxed)),
            write_first_part_us: c.write_first_part_us.load(Relaxed),
            stream_bound_reads: c.bound_reads.load(Relaxed),
            stream_bound_in_flight: c.bound_in_flight.load(Relaxed),
            stream_bound_keys_pinned: c.bound_keys_pinned.load(Relaxed),
            stream_bound_gated_keys: c.bound_gated_keys.load(Relaxed),
            stream_bound_failed_keys: c.bound_failed_keys.load(Relaxed),
            stream_bound_expired: c.bound_expired.load(Relaxed),
            stream_steps: c.bound_steps.load(Relaxed),
            stream_step_layers: c.bound_step_layers.load(Relaxed),
            stream_bound_call_us: std::array::from_fn(|i| c.bound_call_us[i].load(Relaxed)),
        }
    }

    /// The transport for GPU memory. The first call loads the driver and registers the arena
    /// (timed and logged); a machine without CUDA gets a transport that refuses GPU memory.
    pub(crate) fn transport(&self, arena: &Arena) -> Arc<dyn Transport> {
        let mut slot = self.transport.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(transport) = slot.as_ref() {
            return Arc::clone(transport);
        }
        let made = match self.open_cuda(arena) {
            Ok(transport) => transport,
            Err(error) => Arc::new(Unreachable { error }) as Arc<dyn Transport>,
        };
        *slot = Some(Arc::clone(&made));
        made
    }

    #[cfg(feature = "cuda")]
    fn open_cuda(&self, arena: &Arena) -> Result<Arc<dyn Transport>, TransportError> {
        use kvtide_transport::cuda::{CudaCopier, CudaTransport, StreamStaging};
        let stream_staging = StreamStaging { units: self.stream_units.0, unit_bytes: self.stream_units.1 };
        let transport = CudaTransport::get()?;
        let registered = transport
            .registrar()
            .map_err(|e| e.to_string())
            .and_then(|registrar| arena.register_with(&registrar).map_err(|e| e.to_string()));
        match registered {
            Ok(elapsed) => {
                self.counters.registered.store(1, Relaxed);
                self.counters.registration_us.store(elapsed.as_micros() as u64, Relaxed);
                tracing::info!(
                    dram_bytes = arena.len_bytes(),
                    slices = arena.slice_count(),
                    elapsed_ms = elapsed.as_millis() as u64,
                    "DRAM arena registered with CUDA (cuMemHostRegister per slice)"
                );
            }
            // Copies still work from unregistered memory (the driver stages them), slower.
            Err(e) => tracing::warn!(error = %e, "could not register the DRAM arena with CUDA"),
        }
        Ok(Arc::new(CudaCopier { transport, policy: self.policy, stream_staging }))
    }

    #[cfg(not(feature = "cuda"))]
    fn open_cuda(&self, _arena: &Arena) -> Result<Arc<dyn Transport>, TransportError> {
        Err(TransportError::CudaUnavailable("GPU memory needs the cuda feature"))
    }
}
