//! The ticket thread of `submit_batch_get`, for `RemoteStore` and `ClusterStore` alike.
//!
//! Owns the count of tickets in flight against `max_tickets_in_flight` (refused with `Busy`
//! past it) and the thread that runs the batch read and completes the ticket. Never reads
//! anything itself: the store's `batch_get_into_multi_buffers` does, on that thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvtide::{checks, BatchTicket, Error as StoreError, Region, Store, Ticket};

use crate::error::{Error, Result};

/// Starts `store.batch_get_into_multi_buffers(keys, dsts)` on a thread named `thread_name`
/// and returns its ticket; `in_flight` counts the tickets running, at most `limit` (`Busy`
/// past it). A ticket cancelled before its thread starts reading reports `Cancelled` per key.
pub(crate) fn submit_batch_get<S>(
    store: S,
    in_flight: &Arc<AtomicU64>,
    limit: usize,
    thread_name: &str,
    keys: &[&[u8]],
    dsts: Vec<Vec<Region<'static>>>,
) -> Result<BatchTicket<Error>>
where
    S: Store<Error = Error> + Send + 'static,
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
            store.batch_get_into_multi_buffers(&keys, &dsts)
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
