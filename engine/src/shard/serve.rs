//! One request handled on a shard's core.
//!
//! Owns what each `Request` asks of the core and how its reply goes back. Never decides which
//! thread runs it: the shard loop (`runtime`) and a caller the shard lends its core to (`lend`)
//! both call `serve`.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::core::ShardCore;
use super::task::ShardTask;
use super::Request;

/// Handles `request` on `core`: on the shard thread, or on a caller's while the shard lends it
/// its core (`lend`). A task is started and handed back for the loop to advance.
pub(crate) fn serve(core: &mut ShardCore, request: Request) -> Option<Box<dyn ShardTask>> {
    // A reply whose caller gave up is simply dropped; the caller's guard cleans up.
    match request {
        Request::LeaseRead { keys, ttl, early, reply } => {
            let deadline = ttl.map(|ttl| Instant::now() + ttl);
            core.lease_read_batch(keys, deadline, early, Box::new(move |grants| drop(reply.send(grants))));
        }
        Request::LeaseObjects { objects, reply } => {
            let _ = reply.send(objects.into_iter().map(|object| core.lease_object(object)).collect());
        }
        Request::Release { leases } => leases.into_iter().for_each(|lease| core.release(lease)),
        Request::Reserve { items, upsert, reply } => {
            core.reserve_batch(items, upsert, Box::new(move |grants| drop(reply.send(grants))));
        }
        Request::Commit { objects, upsert, pin, reply } => {
            core.commit_batch(objects, upsert, pin, Box::new(move |results| drop(reply.send(results))));
        }
        Request::Abort { objects } => objects.into_iter().for_each(|object| core.abort(object)),
        Request::Exists { keys, reply } => {
            let found = keys.iter().map(|key| core.exists(key)).collect();
            let _ = reply.send(found);
        }
        Request::Locate { keys, reply } => {
            let found = keys.iter().map(|key| core.locate(key)).collect();
            let _ = reply.send(found);
        }
        Request::Remove { key, force, reply } => {
            core.remove_then(&key, force, Box::new(move |result| drop(reply.send(result))));
        }
        Request::Pin { key, reply } => {
            let _ = reply.send(core.pin(&key));
        }
        Request::Unpin { key, reply } => {
            let _ = reply.send(core.unpin(&key));
        }
        Request::Task(mut task) => {
            core.counters().tasks_in_flight.fetch_add(1, Relaxed);
            task.start(core);
            return Some(task);
        }
        Request::ScanKeys { prefix, from, limit, reply } => {
            let _ = reply.send(core.scan_keys(&prefix, from, limit));
        }
        Request::Barrier { reply } => {
            // Leases given back through the published index before the barrier count too.
            core.take_published_news();
            let _ = reply.send(());
        }
    }
    None
}
