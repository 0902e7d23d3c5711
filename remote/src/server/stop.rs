//! How the owner's stop spends its budget.
//!
//! Owns how a stop spends `stop_budget_ms` (grace for in-flight requests first, then the
//! engine's flush of DRAM-only objects to SSD with the rest, less a reserve for the last syncs
//! and the exit): `StopPlan`, and `StopReport` for the log line. Never stops anything itself
//! (`Owner::stop_within_budget` does) and never decides what the engine flushes.

use std::time::Duration;

/// Reserve at the end of the budget for the syncs after the flush and the exit, at most this
/// (else a tenth of the budget).
const MAX_STOP_RESERVE_MS: u64 = 2_000;

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
}
