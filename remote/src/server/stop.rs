//! The owner's stop within a budget, and the few settings a running owner may change.
//!
//! Owns how a stop spends `stop_budget_ms` (grace for in-flight requests first, then the
//! engine's flush of DRAM-only objects to SSD with the rest, less a reserve for the last syncs
//! and the exit) and the values SIGHUP may change at run time (`RunTimeSettings`). Never decides
//! what the engine flushes, and never changes a setting that connections or the engine took at
//! start.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvtide::Store;

use super::config::OwnerConfig;
use super::{Owner, OwnerError};

/// The smallest stop budget accepted.
pub(super) const MIN_STOP_BUDGET_MS: u64 = 1_000;
/// Reserve at the end of the budget for the syncs after the flush and the exit, at most this
/// (else a tenth of the budget).
const MAX_STOP_RESERVE_MS: u64 = 2_000;

/// The settings a running owner applies when they change (`kvtide-owner` re-reads them on
/// SIGHUP). Everything else takes a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunTimeSettings {
    /// `[owner] idle_timeout_ms`: connections that park from now on use it.
    pub idle_timeout_ms: u64,
    /// `[owner] shutdown_grace_ms`: the next stop's grace.
    pub shutdown_grace_ms: u64,
    /// `[owner] stop_budget_ms`: the next stop's budget.
    pub stop_budget_ms: u64,
}

impl RunTimeSettings {
    /// Their names under `[owner]`, as the settings file spells them.
    pub const NAMES: [&'static str; 3] = ["idle_timeout_ms", "shutdown_grace_ms", "stop_budget_ms"];

    fn check(&self) -> Result<(), OwnerError> {
        if self.idle_timeout_ms == 0 {
            return Err(OwnerError::Config("idle_timeout_ms must be positive".into()));
        }
        if self.stop_budget_ms < MIN_STOP_BUDGET_MS {
            return Err(OwnerError::Config(format!("stop_budget_ms must be at least {MIN_STOP_BUDGET_MS}")));
        }
        Ok(())
    }
}

/// The run-time settings as the owner's threads read them.
#[derive(Debug)]
pub(super) struct LiveSettings {
    idle_timeout_ms: AtomicU64,
    shutdown_grace_ms: AtomicU64,
    stop_budget_ms: AtomicU64,
}

impl LiveSettings {
    pub(super) fn new(config: &OwnerConfig) -> LiveSettings {
        LiveSettings {
            idle_timeout_ms: AtomicU64::new(config.idle_timeout_ms),
            shutdown_grace_ms: AtomicU64::new(config.shutdown_grace_ms),
            stop_budget_ms: AtomicU64::new(config.stop_budget_ms),
        }
    }

    pub(super) fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms.load(Ordering::Relaxed))
    }

    fn get(&self) -> RunTimeSettings {
        RunTimeSettings {
            idle_timeout_ms: self.idle_timeout_ms.load(Ordering::Relaxed),
            shutdown_grace_ms: self.shutdown_grace_ms.load(Ordering::Relaxed),
            stop_budget_ms: self.stop_budget_ms.load(Ordering::Relaxed),
        }
    }
}

/// How a stop of `budget` spends it, as offsets from the signal: in-flight requests get
/// `grace`, the flush ends by `flush_by`, the rest is the reserve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopPlan {
    pub grace: Duration,
    pub flush_by: Duration,
}

impl StopPlan {
    /// Grace: `min(grace_ms, 2/5 of the budget)`; the reserve: a tenth of the budget, at most
    /// 2 s; the flush: what lies between.
    pub fn new(budget_ms: u64, grace_ms: u64) -> StopPlan {
        let reserve_ms = (budget_ms / 10).min(MAX_STOP_RESERVE_MS);
        StopPlan {
            grace: Duration::from_millis(grace_ms.min(budget_ms * 2 / 5)),
            flush_by: Duration::from_millis(budget_ms - reserve_ms),
        }
    }
}

/// What a stop did, for its log line.
#[derive(Clone, Copy, Debug)]
pub struct StopReport {
    pub plan: StopPlan,
    /// From the signal until every connection ended.
    pub drained: Duration,
    /// From the signal until the engine stopped (flush and syncs done).
    pub stopped: Duration,
    /// DRAM-only objects written to SSD, and those left unwritten (absent after the restart).
    pub flushed_objects: u64,
    pub unflushed_objects: u64,
    pub unflushed_bytes: u64,
}

impl Owner {
    /// The settings this owner applies at run time, as they are now.
    pub fn run_time_settings(&self) -> RunTimeSettings {
        self.shared.live.get()
    }

    /// Applies new run-time settings (checked first; nothing changes when they are invalid).
    pub fn apply_run_time_settings(&self, settings: RunTimeSettings) -> Result<(), OwnerError> {
        settings.check()?;
        let live = &self.shared.live;
        live.idle_timeout_ms.store(settings.idle_timeout_ms, Ordering::Relaxed);
        live.shutdown_grace_ms.store(settings.shutdown_grace_ms, Ordering::Relaxed);
        live.stop_budget_ms.store(settings.stop_budget_ms, Ordering::Relaxed);
        Ok(())
    }

    /// Stops serving and then the engine within `stop_budget_ms` of `signalled`: in-flight
    /// requests get the plan's grace, then the engine flushes DRAM-only objects to SSD until the
    /// plan's `flush_by` (what it did not write is counted; queued tombstones are still written
    /// after it). Idempotent with `shutdown`.
    pub fn stop_within_budget(&self, signalled: Instant) -> StopReport {
        let live = self.shared.live.get();
        let plan = StopPlan::new(live.stop_budget_ms, live.shutdown_grace_ms);
        self.shutdown_with_grace(plan.grace);
        let drained = signalled.elapsed();
        tracing::info!(
            drained_ms = drained.as_millis() as u64,
            flush_until_ms = plan.flush_by.as_millis() as u64,
            "stop: connections closed; flushing DRAM-only objects to SSD"
        );
        let engine = &self.shared.engine;
        engine.shutdown_by(signalled + plan.flush_by);
        let total = engine.stats().total;
        StopReport {
            plan,
            drained,
            stopped: signalled.elapsed(),
            flushed_objects: total.shutdown_demotions,
            unflushed_objects: total.shutdown_unflushed_objects,
            unflushed_bytes: total.shutdown_unflushed_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_fits_the_budget_grace_first() {
        let p = StopPlan::new(25_000, 10_000);
        assert_eq!((p.grace, p.flush_by), (Duration::from_secs(10), Duration::from_secs(23)));
        // A long grace is cut to 2/5 of the budget; the reserve is a tenth of a small budget.
        let p = StopPlan::new(5_000, 10_000);
        assert_eq!((p.grace, p.flush_by), (Duration::from_secs(2), Duration::from_millis(4_500)));
        let p = StopPlan::new(1_000, 0);
        assert_eq!((p.grace, p.flush_by), (Duration::ZERO, Duration::from_millis(900)));
    }

    #[test]
    fn invalid_run_time_settings_are_refused() {
        let ok = RunTimeSettings { idle_timeout_ms: 1, shutdown_grace_ms: 0, stop_budget_ms: 1_000 };
        assert!(ok.check().is_ok());
        assert!(RunTimeSettings { idle_timeout_ms: 0, ..ok }.check().is_err());
        assert!(RunTimeSettings { stop_budget_ms: 999, ..ok }.check().is_err());
    }
}
