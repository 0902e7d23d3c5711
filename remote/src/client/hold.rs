//! Holds through the owner: read leases a caller keeps across calls (`RemoteStore::hold`), so the
//! objects it found stay in place until it has read them.
//!
//! Owns the client side of holds: one connection per `RemoteStore`, kept out of the pool (the owner
//! keeps a connection's leases until they are released or the connection closes), the lease-mode
//! `Get` that takes a hold's leases on it, the one-way `Release` that gives them back
//! (`release_hold`, the TTL, `close_holds`), the reaper thread that releases holds whose TTL
//! passed, and the count of what is held. Holds work on every connection to an owner: one that
//! cannot map the arena (TCP) gets grants with lengths only. It never reports a key held after the
//! hold's TTL, after its release, or after the connection that held it was lost (then every hold on
//! it is lost at once, and the owner has dropped their leases).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use kvtide::Error as StoreError;

use super::arguments::valid_keys;
use super::conn::{Conn, LEASE_MARGIN};
use super::Inner;
use super::{batches, RemoteStore};
use crate::error::Result;
use crate::protocol::{GetItem, LenCheck};
use crate::wire::WireError;

/// Longest TTL a hold may ask for (the owner's `lease_ttl_ms` may shorten it further).
pub const MAX_HOLD_TTL_MS: u64 = 3_600_000;

/// How often the reaper looks at the holds when none expires sooner (so it notices that the
/// store was dropped).
const REAPER_IDLE: Duration = Duration::from_millis(100);

/// What `RemoteStore::hold` took: the hold's id (for `release_hold` and `hold_status`), one
/// result per key (the object's length while held, or why it is not held) and when the hold
/// ends at the latest.
#[derive(Debug)]
pub struct HoldGranted {
    pub id: u64,
    pub results: Vec<Result<u64>>,
    pub expires_at: Instant,
}

/// The holds of one `RemoteStore`.
#[derive(Default)]
pub(super) struct Holds {
    state: Mutex<HoldState>,
    /// Wakes the reaper when a hold with an earlier deadline arrives.
    wake: Condvar,
}

#[derive(Default)]
struct HoldState {
    /// The connection the leases are held on (None until the first hold, and after it was lost).
    conn: Option<Conn>,
    /// Bumped whenever `conn` is dropped: holds of an older generation were lost with it.
    generation: u64,
    next_id: u64,
    live: HashMap<u64, Entry>,
    reaper_started: bool,
    closed: bool,
}

struct Entry {
    generation: u64,
    /// Per key: the owner's lease id while held.
    leases: Vec<Option<u64>>,
    held: usize,
    expires_at: Instant,
}

impl Entry {
    fn alive(&self, generation: u64, now: Instant) -> bool {
        self.generation == generation && now < self.expires_at && self.held > 0
    }
}

impl HoldState {
    /// Drops the hold connection: the owner releases every lease it held.
    fn lose_conn(&mut self) {
        if self.conn.take().is_some() {
            self.generation += 1;
        }
        let generation = self.generation;
        self.live.retain(|_, e| e.generation == generation);
    }

    /// Sends a one-way release of `leases` on the hold connection; a connection that cannot
    /// send it is dropped (which releases everything it held).
    fn send_release(&mut self, inner: &Inner, leases: Vec<u64>) {
        if leases.is_empty() {
            return;
        }
        let Some(conn) = self.conn.as_mut() else { return };
        let rid = inner.pool.next_request.fetch_add(1, Ordering::Relaxed);
        if conn.send_release(rid, leases).is_err() {
            self.lose_conn();
        }
    }

    /// Releases every hold whose TTL passed; returns the earliest deadline still ahead.
    fn reap(&mut self, inner: &Inner, now: Instant) -> Option<Instant> {
        let generation = self.generation;
        let mut released = Vec::new();
        let mut next: Option<Instant> = None;
        self.live.retain(|_, e| {
            if e.generation != generation {
                return false;
            }
            if now >= e.expires_at {
                released.extend(e.leases.iter().flatten().copied());
                return false;
            }
            next = Some(next.map_or(e.expires_at, |n| n.min(e.expires_at)));
            true
        });
        self.send_release(inner, released);
        next
    }
}

impl Holds {
    fn lock(&self) -> std::sync::MutexGuard<'_, HoldState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Confirms the releases sent on the hold connection (one round trip when it has any), so
    /// the owner has applied them before the caller's next request on another connection.
    pub(super) fn confirm(&self, inner: &Inner) {
        let mut st = self.lock();
        let Some(conn) = st.conn.as_mut() else { return };
        if conn.unconfirmed.is_empty() {
            return;
        }
        let rid = inner.pool.next_request.fetch_add(1, Ordering::Relaxed);
        if conn.round_trip(rid).is_err() {
            st.lose_conn();
        }
    }
}

/// Releases holds as their TTL passes, until the store is dropped.
fn reaper(inner: Weak<Inner>) {
    loop {
        let Some(store) = inner.upgrade() else { return };
        let mut st = store.holds.lock();
        if st.closed {
            return;
        }
        let now = Instant::now();
        let next = st.reap(&store, now);
        let wait = next.map_or(REAPER_IDLE, |t| t.saturating_duration_since(now).min(REAPER_IDLE));
        let _ = store.holds.wake.wait_timeout(st, wait.max(Duration::from_millis(1)));
    }
}

impl RemoteStore {
    /// Takes read leases on every present key of `keys` and keeps them until `release_hold`,
    /// `ttl_ms` (at most the owner's `lease_ttl_ms` less a margin), `close_holds` or the loss of
    /// the connection holding them: while held, an object stays in place (the owner cannot
    /// evict it). One result per key: the object's length, or why it is not held (`NotFound`,
    /// `Busy` past the owner's `max_leases_per_connection`, ...). Works over TCP and Unix
    /// sockets alike (an owner of an earlier version refuses it without the arena mapped). An
    /// empty `keys` only checks that holds are possible.
    pub fn hold(&self, keys: &[&[u8]], ttl_ms: u64) -> Result<HoldGranted> {
        if ttl_ms == 0 || ttl_ms > MAX_HOLD_TTL_MS {
            return Err(StoreError::InvalidArgument(format!(
                "hold ttl_ms = {ttl_ms}: expected 1 to {MAX_HOLD_TTL_MS}"
            ))
            .into());
        }
        let limits = self.inner.pool.limits()?;
        let mut results: Vec<Result<u64>> =
            (0..keys.len()).map(|_| Err(StoreError::Internal("hold: key never answered").into())).collect();
        let valid = valid_keys(&limits, keys, &mut results);
        let holds = &self.inner.holds;
        let mut st = holds.lock();
        if st.closed {
            return Err(StoreError::ShuttingDown.into());
        }
        let mut retried = false;
        let (leases, expires_at) = loop {
            let (mut conn, reused) = match st.conn.take() {
                Some(c) => (c, true),
                None => (self.inner.pool.open()?, false),
            };
            let owner_ttl = Duration::from_millis(u64::from(conn.hello.lease_ttl_ms)).saturating_sub(LEASE_MARGIN);
            let ttl = Duration::from_millis(ttl_ms).min(owner_ttl);
            if ttl.is_zero() {
                st.conn = Some(conn);
                return Err(StoreError::InvalidArgument("the owner's lease TTL is too short for holds".into()).into());
            }
            let sent = Instant::now();
            let (leases, failed) = self.lease_batches(&mut conn, keys, &valid, &mut results);
            match failed {
                None => {
                    st.conn = Some(conn);
                    break (leases, sent + ttl);
                }
                Some(e) => {
                    // Whatever this connection held is gone with it, earlier holds included.
                    drop(conn);
                    st.generation += 1;
                    st.live.clear();
                    let first_request_failed = leases.iter().all(Option::is_none);
                    if reused
                        && !retried
                        && first_request_failed
                        && matches!(e, WireError::Closed(_) | WireError::Io(_))
                    {
                        // A pooled-style reconnect: the owner restarted or closed the idle
                        // connection before this hold.
                        retried = true;
                        continue;
                    }
                    return Err(e.into_error("hold", self.inner.pool.options.timeout_ms));
                }
            }
        };
        let id = self.record(&mut st, leases, expires_at)?;
        Ok(HoldGranted { id, results, expires_at })
    }

    /// Takes leases on `conn` for the keys at positions `valid`, in as many requests as the
    /// owner's limits need: per key its lease id (its length or why not in `results`), and the
    /// failure that lost the connection midway, if one did.
    fn lease_batches(
        &self,
        conn: &mut Conn,
        keys: &[&[u8]],
        valid: &[usize],
        results: &mut [Result<u64>],
    ) -> (Vec<Option<u64>>, Option<WireError>) {
        // Without the arena mapped the grants carry lengths only (offset 0).
        let arena_bytes = conn.arena().map_or(u64::MAX, |a| a.len());
        let key_lens: Vec<usize> = valid.iter().map(|&i| keys[i].len()).collect();
        let max_items = (conn.limits.max_items as usize).max(1);
        let mut leases: Vec<Option<u64>> = vec![None; keys.len()];
        for (start, end) in batches(&key_lens, 11, max_items, &conn.limits) {
            let items: Vec<GetItem<'_>> =
                valid[start..end].iter().map(|&i| GetItem { key: keys[i], check: LenCheck::Any }).collect();
            let rid = self.inner.pool.next_request.fetch_add(1, Ordering::Relaxed);
            match conn.lease_all(rid, items, arena_bytes) {
                Ok(Ok((_, grants))) => {
                    for (&i, grant) in valid[start..end].iter().zip(grants) {
                        match grant {
                            Ok(g) => {
                                leases[i] = Some(g.lease);
                                results[i] = Ok(g.len);
                            }
                            Err(e) => results[i] = Err(e),
                        }
                    }
                }
                // The owner refused the request as a whole (answered, so the connection is
                // still in step): its keys are not held.
                Ok(Err(e)) => valid[start..end].iter().for_each(|&i| results[i] = Err(e.clone())),
                Err(e) => return (leases, Some(e)),
            }
        }
        (leases, None)
    }

    /// Files a hold of `leases` until `expires_at` (when any key is held, starting the reaper
    /// if it is not running yet); returns its id.
    fn record(&self, st: &mut HoldState, leases: Vec<Option<u64>>, expires_at: Instant) -> Result<u64> {
        let held = leases.iter().flatten().count();
        st.next_id += 1;
        let id = st.next_id;
        if held > 0 {
            let generation = st.generation;
            st.live.insert(id, Entry { generation, leases, held, expires_at });
            if !st.reaper_started {
                let weak = Arc::downgrade(&self.inner);
                std::thread::Builder::new()
                    .name("kvtide-remote-holds".into())
                    .spawn(move || reaper(weak))
                    .map_err(|e| StoreError::Io(format!("cannot start the hold reaper thread: {e}")))?;
                st.reaper_started = true;
            }
            self.inner.holds.wake.notify_all();
        }
        Ok(id)
    }

    /// Releases hold `id`'s leases: all of them (`which` None) or those of the keys at these
    /// positions. Returns how many were still held and are now released; 0 for a hold that
    /// ended (released, expired or lost). The release is one-way (no round trip).
    pub fn release_hold(&self, id: u64, which: Option<&[usize]>) -> usize {
        let mut st = self.inner.holds.lock();
        let now = Instant::now();
        let generation = st.generation;
        let Some(entry) = st.live.get_mut(&id) else { return 0 };
        if !entry.alive(generation, now) {
            // Lease ids are the connection's own: only a hold of the current connection has
            // leases to give back (expired, not reaped yet).
            let leases: Vec<u64> = if entry.generation == generation {
                entry.leases.iter().flatten().copied().collect()
            } else {
                Vec::new()
            };
            st.live.remove(&id);
            st.send_release(&self.inner, leases);
            return 0;
        }
        let mut released = Vec::new();
        match which {
            None => released.extend(entry.leases.iter_mut().filter_map(Option::take)),
            Some(positions) => {
                for &i in positions {
                    if let Some(lease) = entry.leases.get_mut(i).and_then(Option::take) {
                        released.push(lease);
                    }
                }
            }
        }
        entry.held -= released.len();
        if entry.held == 0 {
            st.live.remove(&id);
        }
        let n = released.len();
        st.send_release(&self.inner, released);
        n
    }

    /// Per key of hold `id`, whether it is held now; None once the hold ended (released,
    /// expired or lost with its connection).
    pub fn hold_status(&self, id: u64) -> Option<Vec<bool>> {
        let st = self.inner.holds.lock();
        let entry = st.live.get(&id)?;
        entry.alive(st.generation, Instant::now()).then(|| entry.leases.iter().map(Option::is_some).collect())
    }

    /// `(holds, keys)` held now: the holds with a key still held, and those keys.
    pub fn holds_held(&self) -> (u64, u64) {
        let st = self.inner.holds.lock();
        let now = Instant::now();
        st.live.values().filter(|e| e.alive(st.generation, now)).fold((0, 0), |(h, k), e| (h + 1, k + e.held as u64))
    }

    /// Makes sure the owner applied the releases of holds sent so far (a round trip on the hold
    /// connection when it sent any since its last reply), so statistics read next count them.
    pub fn confirm_hold_releases(&self) {
        self.inner.holds.confirm(&self.inner);
    }

    /// Ends every hold: the hold connection is closed (the owner drops its leases) and later
    /// `hold` calls fail with `ShuttingDown`.
    pub fn close_holds(&self) {
        let holds = &self.inner.holds;
        let mut st = holds.lock();
        st.lose_conn();
        st.generation += 1;
        st.live.clear();
        st.closed = true;
        holds.wake.notify_all();
    }
}
