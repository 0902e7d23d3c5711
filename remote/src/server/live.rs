//! The settings a running owner may change (SIGHUP), as its threads read them.
//!
//! Owns `RunTimeSettings` (their names and checks) and `LiveSettings` (the atomics the connection
//! threads and the stop read). Never applies a setting that connections or the engine took at
//! start, and never stops anything itself (`stop` does).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::config::{OwnerConfig, OwnerError, MIN_STOP_BUDGET_MS};

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

    pub(super) fn check(&self) -> Result<(), OwnerError> {
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

    pub(super) fn get(&self) -> RunTimeSettings {
        RunTimeSettings {
            idle_timeout_ms: self.idle_timeout_ms.load(Ordering::Relaxed),
            shutdown_grace_ms: self.shutdown_grace_ms.load(Ordering::Relaxed),
            stop_budget_ms: self.stop_budget_ms.load(Ordering::Relaxed),
        }
    }

    pub(super) fn set(&self, settings: &RunTimeSettings) {
        self.idle_timeout_ms.store(settings.idle_timeout_ms, Ordering::Relaxed);
        self.shutdown_grace_ms.store(settings.shutdown_grace_ms, Ordering::Relaxed);
        self.stop_budget_ms.store(settings.stop_budget_ms, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_run_time_settings_are_refused() {
        let ok = RunTimeSettings { idle_timeout_ms: 1, shutdown_grace_ms: 0, stop_budget_ms: 1_000 };
        assert!(ok.check().is_ok());
        assert!(RunTimeSettings { idle_timeout_ms: 0, ..ok }.check().is_err());
        assert!(RunTimeSettings { stop_budget_ms: 999, ..ok }.check().is_err());
    }
}
