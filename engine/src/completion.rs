//! `Completion`: the producing side of a `Ticket`, for `Store` implementations outside this
//! crate (the remote client). Owns handing one value to a ticket and reading its cancel flag;
//! never runs or schedules the work itself.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::ticket::{Ticket, TicketCell};

/// Fulfils the ticket `Ticket::pending` returned with it. Dropping it unfulfilled leaves the
/// ticket waiting forever, so a producer completes it on every path.
pub struct Completion<T> {
    cell: Arc<TicketCell<T>>,
    cancel: Arc<AtomicBool>,
}

impl<T> std::fmt::Debug for Completion<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion").field("cancelled", &self.is_cancelled()).finish()
    }
}

impl<T> Ticket<T> {
    /// A ticket not yet fulfilled, and the `Completion` that fulfils it.
    pub fn pending() -> (Ticket<T>, Completion<T>) {
        let (ticket, cell, cancel) = Ticket::new();
        (ticket, Completion { cell, cancel })
    }
}

impl<T> Completion<T> {
    /// True once the ticket's holder asked for the work to stop.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    /// The ticket's cancel flag, for work that checks it where `is_cancelled` cannot reach (a
    /// read that runs on a connection).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancel)
    }

    /// Hands `value` to the ticket and wakes its waiters.
    pub fn complete(self, value: T) {
        self.cell.fulfil(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_fulfils_its_ticket_and_sees_cancel() {
        let (ticket, completion) = Ticket::<u32>::pending();
        assert!(!ticket.is_ready());
        assert!(!completion.is_cancelled());
        ticket.cancel();
        assert!(completion.is_cancelled());
        completion.complete(7);
        assert!(ticket.is_ready());
        assert_eq!(ticket.wait(), 7);
    }
}
