//! Reads made through the owner's read index, reported to the owner in batches (`IndexReads`)
//! so that they count as its hits and keep their objects warm in its eviction policy, as reads
//! through a request do.
//!
//! Owns the buffer of unreported reads and when a report goes out: ahead of the next request any
//! call sends (in the same write, so the owner counts the reads before it serves that request),
//! on its own once it holds `REPORT_AFTER` reads or `REPORT_EVERY` passed since the last report,
//! and when the store is dropped. Never opens a connection or waits for one to report (a report
//! of its own goes out on an idle pooled connection, else later), and never holds more than
//! `MAX_UNREPORTED` reads: past that, reads go unreported, as the owner's own access queue drops
//! records under a read storm (recency is approximate; bytes are never wrong).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::conn::Conn;
use crate::protocol::Request;

/// Reads gathered before a report goes out on its own.
const REPORT_AFTER: usize = 256;
/// Longest a read waits for its report while the client goes on reading.
const REPORT_EVERY: Duration = Duration::from_millis(20);
/// Unreported reads kept at most.
const MAX_UNREPORTED: usize = 4096;

/// An index entry read: `(shard, slot, generation)`.
type EntryRead = (u32, u32, u32);

/// Index entries read and not yet reported, and when the last report went out.
pub(super) struct IndexReadLog {
    pending: Mutex<(Vec<EntryRead>, Instant)>,
}

impl Default for IndexReadLog {
    fn default() -> Self {
        IndexReadLog { pending: Mutex::new((Vec::new(), Instant::now())) }
    }
}

impl IndexReadLog {
    /// Notes `entries` read; true when a report of its own is due.
    pub(super) fn note(&self, entries: &[EntryRead]) -> bool {
        if entries.is_empty() {
            return false;
        }
        let mut g = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let room = MAX_UNREPORTED.saturating_sub(g.0.len());
        g.0.extend_from_slice(&entries[..entries.len().min(room)]);
        g.0.len() >= REPORT_AFTER || g.1.elapsed() >= REPORT_EVERY
    }

    /// Appends the pending reads to `conn`'s write buffer as `IndexReads` frames of request id
    /// `rid` (sent with the connection's next flush); false when nothing was pending.
    pub(super) fn push_to(&self, conn: &mut Conn, rid: u64) -> bool {
        let reads = {
            let mut g = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            if g.0.is_empty() {
                return false;
            }
            g.1 = Instant::now();
            std::mem::take(&mut g.0)
        };
        let max = (conn.limits.max_items as usize).max(1);
        for part in reads.chunks(max) {
            conn.push(rid, &Request::IndexReads { reads: part.to_vec() });
        }
        true
    }
}
