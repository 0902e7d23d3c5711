//! Tickets: the handle of a non-blocking submission. Owns the hand-off of a result from the
//! shards that produce it to the caller that waits, polls or cancels; it never runs work itself.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};

/// A submitted operation: `wait` for its result, `is_ready` to poll, `cancel` to stop it early.
///
/// Dropping a ticket does not cancel the work: destinations given to a submission must stay
/// valid until it completes (the `'static` regions it takes guarantee that).
pub struct Ticket<T> {
    cell: Arc<TicketCell<T>>,
    cancel: Arc<AtomicBool>,
}

impl<T> std::fmt::Debug for Ticket<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("ready", &self.is_ready()).finish()
    }
}

pub(crate) struct TicketCell<T> {
    value: Mutex<Option<T>>,
    ready: AtomicBool,
    done: Condvar,
}

impl<T> TicketCell<T> {
    pub(crate) fn fulfil(&self, value: T) {
        let mut slot = self.value.lock().unwrap_or_else(|p| p.into_inner());
        *slot = Some(value);
        self.ready.store(true, Ordering::Release);
        self.done.notify_all();
    }
}

impl<T> Ticket<T> {
    pub(crate) fn new() -> (Ticket<T>, Arc<TicketCell<T>>, Arc<AtomicBool>) {
        let cell =
            Arc::new(TicketCell { value: Mutex::new(None), ready: AtomicBool::new(false), done: Condvar::new() });
        let cancel = Arc::new(AtomicBool::new(false));
        (Ticket { cell: Arc::clone(&cell), cancel: Arc::clone(&cancel) }, cell, cancel)
    }

    /// True once the result is available (`wait` will not block).
    pub fn is_ready(&self) -> bool {
        self.cell.ready.load(Ordering::Acquire)
    }

    /// Blocks until the result is available and returns it.
    pub fn wait(self) -> T {
        let mut slot = self.cell.value.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(value) = slot.take() {
                return value;
            }
            slot = self.cell.done.wait(slot).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits at most `timeout_ms`; true if the result is ready.
    pub fn wait_timeout_ms(&self, timeout_ms: u64) -> bool {
        let slot = self.cell.value.lock().unwrap_or_else(|p| p.into_inner());
        let (slot, _) = self
            .cell
            .done
            .wait_timeout_while(slot, Duration::from_millis(timeout_ms), |v| v.is_none())
            .unwrap_or_else(|p| p.into_inner());
        slot.is_some()
    }

    /// Asks the work to stop. Keys already delivered keep their results; every other key,
    /// including one whose copy had started, reports `Cancelled`. Wait for the ticket to know
    /// when the destinations are no longer touched.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }
}

/// Gathers per-key results from several shards into one ticket.
pub(crate) struct BatchCollector {
    results: Mutex<Vec<Result<usize>>>,
    parts_left: AtomicUsize,
    cell: Arc<TicketCell<Vec<Result<usize>>>>,
    tickets_in_flight: Arc<AtomicU64>,
}

impl BatchCollector {
    /// `results` holds the already-known outcomes (validation errors); `parts` shards will
    /// report the rest.
    pub(crate) fn new(
        results: Vec<Result<usize>>,
        parts: usize,
        cell: Arc<TicketCell<Vec<Result<usize>>>>,
        tickets_in_flight: Arc<AtomicU64>,
    ) -> Arc<BatchCollector> {
        tickets_in_flight.fetch_add(1, Ordering::Relaxed);
        let collector = Arc::new(BatchCollector {
            results: Mutex::new(results),
            parts_left: AtomicUsize::new(parts),
            cell,
            tickets_in_flight,
        });
        if parts == 0 {
            collector.finish();
        }
        collector
    }

    /// Records one shard's part; the last part fulfils the ticket.
    pub(crate) fn complete_part(&self, part: Vec<(usize, Result<usize>)>) {
        {
            let mut results = self.results.lock().unwrap_or_else(|p| p.into_inner());
            for (index, result) in part {
                if let Some(slot) = results.get_mut(index) {
                    *slot = result;
                }
            }
        }
        if self.parts_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finish();
        }
    }

    fn finish(&self) {
        let results = std::mem::take(&mut *self.results.lock().unwrap_or_else(|p| p.into_inner()));
        self.tickets_in_flight.fetch_sub(1, Ordering::Relaxed);
        self.cell.fulfil(results);
    }
}

/// Placeholder result for a key a shard has not reported yet.
pub(crate) fn pending() -> Result<usize> {
    Err(Error::Internal("key result never reported"))
}
