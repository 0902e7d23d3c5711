//! The membership view a `ClusterStore` routes by: the members as read at one time, their
//! placement seeds, and each member's health and connection (`Link`).
//!
//! Owns what the data path reads about the members, lock-free: a view is immutable once
//! published (a new membership is a new view), and a member's health (per-member atomic) and
//! connection (`OnceLock`) live in its `Link`, which moves on to the next view while the
//! member keeps its generation. Never talks to etcd and never routes a key itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::member::Member;
use super::placement;
use crate::client::RemoteStore;

/// One membership, as read at one time.
#[derive(Debug, Default)]
pub(super) struct View {
    /// Sorted by id.
    pub(super) members: Vec<Member>,
    pub(super) seeds: Vec<u64>,
    /// Member i's health and connection.
    pub(super) links: Vec<Arc<Link>>,
    /// Entries that did not parse: (key, why).
    pub(super) invalid: Vec<(String, String)>,
}

impl View {
    /// A view of `members` (sorted by id); a member that keeps its id and generation keeps its
    /// link from `previous` (its connection, and its down mark), any other gets a new one (a
    /// restarted owner gets a new connection, and with it a new mapping of its arena).
    pub(super) fn new(members: Vec<Member>, invalid: Vec<(String, String)>, previous: &View) -> View {
        let links = members
            .iter()
            .map(|m| {
                let kept = previous
                    .members
                    .iter()
                    .zip(&previous.links)
                    .find(|(p, _)| p.id == m.id && p.generation == m.generation);
                kept.map_or_else(|| Arc::new(Link::default()), |(_, link)| Arc::clone(link))
            })
            .collect();
        let seeds = members.iter().map(|m| placement::member_seed(&m.id)).collect();
        View { members, seeds, links, invalid }
    }

    /// `key`'s members, first-ranked first.
    pub(super) fn rank(&self, key: &[u8]) -> Vec<usize> {
        placement::ranked(placement::key_hash(key), &self.seeds)
    }

    /// Whether member `m` is marked down now.
    pub(super) fn is_down(&self, m: usize) -> bool {
        self.links[m].is_down()
    }
}

/// A member's health and connection, shared by the views that hold the member under the same
/// generation.
#[derive(Debug, Default)]
pub(super) struct Link {
    /// Until when the member is skipped, in ms since `epoch()` (0: never marked down).
    down_until_ms: AtomicU64,
    /// Made on first use.
    store: OnceLock<Arc<RemoteStore>>,
}

impl Link {
    /// Whether the member is marked down now.
    pub(super) fn is_down(&self) -> bool {
        let until = self.down_until_ms.load(Ordering::Relaxed);
        until != 0 && now_ms() < until
    }

    /// Marks the member down for `retry_ms`; true when it was up until now (the caller warns).
    pub(super) fn mark_down(&self, retry_ms: u64) -> bool {
        let now = now_ms();
        let before = self.down_until_ms.swap(now.saturating_add(retry_ms).max(1), Ordering::Relaxed);
        before <= now
    }

    /// The member's connection, made by `open` on first use (a failed attempt is not kept; two
    /// threads that race both connect and the first one kept serves both).
    pub(super) fn connection(
        &self,
        open: impl FnOnce() -> crate::error::Result<RemoteStore>,
    ) -> crate::error::Result<&Arc<RemoteStore>> {
        if let Some(store) = self.store.get() {
            return Ok(store);
        }
        let store = Arc::new(open()?);
        Ok(self.store.get_or_init(|| store))
    }
}

/// Milliseconds since the first call in this process (the clock of `Link::down_until_ms`),
/// at least 1.
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX).saturating_add(1)
}
