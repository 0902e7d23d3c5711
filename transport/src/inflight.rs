//! A submission's progress: the `InFlight` a transport returns for a batch and the `Progress`
//! each transport implements behind it.
//!
//! Owns how a caller polls, waits for and takes the per-transfer results of a submission, and
//! the rule that dropping an unfinished one waits for (or stops) whatever can still touch the
//! submitted memory. It never moves bytes or knows a transport: each transport's `Progress`
//! does that.

use std::time::{Duration, Instant};

use crate::transfer::Summary;
use crate::TransportError;

/// How long `InFlight::wait` spins on `poll` before it yields the CPU between polls.
const SPIN_BEFORE_YIELD: Duration = Duration::from_micros(50);

/// How a transport's submission advances. Dropping it before it completed must wait for (or
/// stop) everything that can still touch the submitted memory.
pub trait Progress: Send {
    /// Checks for completion without blocking (a failure path may drain); true once every
    /// transfer has its result and every resource the submission held went back.
    fn poll(&mut self) -> bool;
    /// The per-transfer results, once `poll` returned true.
    fn take_results(&mut self) -> Vec<Result<(), TransportError>>;
    /// What was submitted.
    fn summary(&self) -> Summary {
        Summary::default()
    }
    /// Blocks until `poll` would return true. The default spins briefly, then yields.
    fn block(&mut self) {
        poll_until_done(SPIN_BEFORE_YIELD, || self.poll());
    }
}

/// Calls `poll` until it returns true: spinning between calls for `spin`, then yielding the CPU.
pub(crate) fn poll_until_done(spin: Duration, mut poll: impl FnMut() -> bool) {
    let started = Instant::now();
    while !poll() {
        if started.elapsed() < spin {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// A submitted batch of transfers.
pub struct InFlight {
    progress: Box<dyn Progress>,
    done: bool,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").field("done", &self.done).finish()
    }
}

impl InFlight {
    /// A submission that advances through `progress`.
    pub fn new(progress: Box<dyn Progress>) -> InFlight {
        InFlight { progress, done: false }
    }

    /// A submission that completed inside `submit`.
    pub fn completed(results: Vec<Result<(), TransportError>>, summary: Summary) -> InFlight {
        InFlight::new(Box::new(Completed { results, summary }))
    }

    /// Checks for completion without blocking; true once every result is in.
    pub fn poll(&mut self) -> bool {
        if !self.done {
            self.done = self.progress.poll();
        }
        self.done
    }

    /// Blocks until complete and returns one result per transfer, in submission order.
    pub fn wait(mut self) -> Vec<Result<(), TransportError>> {
        if !self.done {
            self.progress.block();
            self.done = true;
        }
        self.progress.take_results()
    }

    /// The per-transfer results (after `poll` returned true).
    pub fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        self.progress.take_results()
    }

    /// Blocks until complete, leaving the results to `take_results`.
    pub fn block(&mut self) {
        if !self.done {
            self.progress.block();
            self.done = true;
        }
    }

    /// What was submitted.
    pub fn summary(&self) -> Summary {
        self.progress.summary()
    }
}

/// Results known at submission.
struct Completed {
    results: Vec<Result<(), TransportError>>,
    summary: Summary,
}

impl Progress for Completed {
    fn poll(&mut self) -> bool {
        true
    }

    fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        std::mem::take(&mut self.results)
    }

    fn summary(&self) -> Summary {
        self.summary.clone()
    }
}
