//! What a connection holds against the owner's limits: request bytes (`Budget`, a guaranteed
//! share per connection plus a shared pool), leases (`HeldLeases`) and its put window
//! (`OwnedWindow`), each counted in its gauge and given back when dropped.
//!
//! Owns the accounting of those limits. Never reads or writes a socket and never decides what a
//! refused request is answered (the handlers do).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kvtide::ObjectLease;

use super::config::OwnerConfig;
use crate::metrics::OwnerCounters;
use crate::shm::PutWindow;

/// The budget of request bytes held in memory: each connection's guaranteed share, and a pool
/// for the part of larger requests beyond a share. A connection serves its requests in order and
/// holds at most one permit, so shares are never oversubscribed and the total stays within
/// `max_buffered_bytes` (`validate` checks that the shares fit).
pub(super) struct Budget {
    pub(super) pool_used_bytes: Mutex<u64>,
    pub(super) freed: Condvar,
    pub(super) pool_bytes: u64,
    pub(super) share_bytes: u64,
}

pub(super) struct Permit<'a> {
    budget: &'a Budget,
    gauge: &'a AtomicU64,
    bytes: u64,
    pooled_bytes: u64,
}

impl Budget {
    pub(super) fn new(config: &OwnerConfig) -> Budget {
        let share_bytes = config.connection_share_bytes();
        let reserved = share_bytes.saturating_mul(config.max_connections as u64);
        Budget {
            pool_used_bytes: Mutex::new(0),
            freed: Condvar::new(),
            pool_bytes: config.max_buffered_bytes.saturating_sub(reserved),
            share_bytes,
        }
    }

    /// Takes `bytes` for one request: up to the connection's share at once, the rest from the
    /// pool, waiting up to `wait` for room there; None when there was none. `gauge` counts the
    /// bytes held.
    pub(super) fn acquire<'a>(&'a self, bytes: u64, wait: Duration, gauge: &'a AtomicU64) -> Option<Permit<'a>> {
        let pooled_bytes = bytes.saturating_sub(self.share_bytes);
        if pooled_bytes > 0 {
            let used = self.pool_used_bytes.lock().unwrap_or_else(|p| p.into_inner());
            let (mut used, _) = self
                .freed
                .wait_timeout_while(used, wait, |used| *used + pooled_bytes > self.pool_bytes)
                .unwrap_or_else(|p| p.into_inner());
            if *used + pooled_bytes > self.pool_bytes {
                return None;
            }
            *used += pooled_bytes;
        }
        gauge.fetch_add(bytes, Ordering::Relaxed);
        Some(Permit { budget: self, gauge, bytes, pooled_bytes })
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.pooled_bytes > 0 {
            let mut used = self.budget.pool_used_bytes.lock().unwrap_or_else(|p| p.into_inner());
            *used -= self.pooled_bytes;
            self.budget.freed.notify_all();
        }
        self.gauge.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// The leases a connection holds, by id; given back (and uncounted) when dropped.
pub(super) struct HeldLeases {
    pub(super) map: HashMap<u64, ObjectLease>,
    pub(super) counters: Arc<OwnerCounters>,
}

impl std::ops::Deref for HeldLeases {
    type Target = HashMap<u64, ObjectLease>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::DerefMut for HeldLeases {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

impl Drop for HeldLeases {
    fn drop(&mut self) {
        let n = self.map.len() as u64;
        if n > 0 {
            self.counters.leases_outstanding.fetch_sub(n, Ordering::Relaxed);
        }
        ObjectLease::release_all(std::mem::take(&mut self.map).into_values());
    }
}

/// A connection's put window, counted in `put_window_bytes` until dropped.
pub(super) struct OwnedWindow {
    pub(super) window: PutWindow,
    pub(super) counters: Arc<OwnerCounters>,
}

impl std::ops::Deref for OwnedWindow {
    type Target = PutWindow;
    fn deref(&self) -> &PutWindow {
        &self.window
    }
}

impl Drop for OwnedWindow {
    fn drop(&mut self) {
        self.counters.put_window_bytes.fetch_sub(self.window.len(), Ordering::Relaxed);
    }
}
