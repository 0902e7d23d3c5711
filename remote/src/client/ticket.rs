//! The ticket thread of `submit_batch_get`, for `RemoteStore` and `ClusterStore` alike.
//!
//! Owns the count of tickets in flight against `max_tickets_in_flight` (refused with `Busy`
//! past it) and the thread that runs the batch read and completes the ticket. Never reads
//! anything itself: the store's `CancellableRead::batch_get_cancellable` does, on that thread,
//! with the ticket's cancel flag.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvtide::{checks, BatchTicket, Error as StoreError, Region, Store, Ticket};

use crate::error::{Error, Result};

/// A batch read that stops early when `cancel` (if any) is set: the keys it had delivered keep their
/// results, the others report `Cancelled`, and nothing touches their destinations after it
/// returned.
pub(crate) trait CancellableRead {
    fn batch_get_cancellable(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        cancel: Option<&Arc<AtomicBool>>,
    ) -> Vec<Result<usize>>;
}

/// Starts `store.batch_get_cancellable(keys, dsts, cancel)` on a thread named `thread_name`
/// and returns its ticket; `in_flight` counts the tickets running, at most `limit` (`Busy`
/// past it). Cancelling the ticket stops the read where it is.
pub(crate) fn submit_batch_get<S>(
    store: S,
    in_flight: &Arc<AtomicU64>,
    limit: usize,
    thread_name: &str,
    keys: &[&[u8]],
    dsts: Vec<Vec<Region<'static>>>,
) -> Result<BatchTicket<Error>>
where
    S: Store<Error = Error> + CancellableRead + Send + 'static,
{
    checks::one_list_per_key(keys.len(), dsts.len(), "destination")?;
    if in_flight.fetch_add(1, Ordering::AcqRel) >= limit as u64 {
        in_flight.fetch_sub(1, Ordering::AcqRel);
        return Err(StoreError::Busy { limit }.into());
    }
    let (ticket, completion) = Ticket::pending();
    let owned_keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
    let worker_in_flight = Arc::clone(in_flight);
    let spawned = std::thread::Builder::new().name(thread_name.into()).spawn(move || {
        let results = if completion.is_cancelled() {
            owned_keys.iter().map(|_| Err(StoreError::Cancelled.into())).collect()
        } else {
            let keys: Vec<&[u8]> = owned_keys.iter().map(Vec::as_slice).collect();
            store.batch_get_cancellable(&keys, &dsts, Some(&completion.cancel_flag()))
        };
        worker_in_flight.fetch_sub(1, Ordering::AcqRel);
        completion.complete(results);
    });
    if let Err(e) = spawned {
        in_flight.fetch_sub(1, Ordering::AcqRel);
        return Err(StoreError::Io(format!("cannot start a ticket thread: {e}")).into());
    }
    Ok(ticket)
}
