//! Counters: each shard publishes relaxed atomics that only it writes, and readers of its
//! published index count their reads in stripes of their own (`ReaderCounters`); `stats()` sums
//! them without messaging the shards, so reading stats never waits behind work. Also owns the
//! counters of the streaming and progressive paths (`StreamCounters`), which both of those
//! paths bump. Never counts anything itself: the code that does the work bumps the counters.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Stripes of reader counters per shard: readers on up to this many threads never share one.
const READER_STRIPES: usize = 16;

/// What readers of a shard's published index count, striped by thread: every read bumps
/// several counters, and readers on other CPUs bumping the same words made those increments
/// the largest cost of a 4 KiB read after the copy. Gauges are summed with wrapping arithmetic
/// (a lease is often given back on another thread than the one that took it).
#[derive(Debug, Default)]
pub struct ReaderCounters {
    stripes: [ReaderStripe; READER_STRIPES],
}

/// One thread's share of `ReaderCounters`, alone on its cache lines.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct ReaderStripe {
    pub(crate) leases_held: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
}

impl ReaderCounters {
    /// This thread's stripe.
    pub(crate) fn mine(&self) -> &ReaderStripe {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % READER_STRIPES;
        }
        &self.stripes[STRIPE.with(|s| *s)]
    }

    /// (leases held, reads, hits, misses, bytes read) over every stripe.
    fn sum(&self) -> [u64; 5] {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        self.stripes.iter().fold([0u64; 5], |acc, s| {
            [
                acc[0].wrapping_add(r(&s.leases_held)),
                acc[1].wrapping_add(r(&s.reads)),
                acc[2].wrapping_add(r(&s.hits)),
                acc[3].wrapping_add(r(&s.misses)),
                acc[4].wrapping_add(r(&s.bytes_read)),
            ]
        })
    }
}

/// One shard's counters. Gauges (`*_held`, `bytes_used`, `objects`, ...) go up and down;
/// the rest only grow.
#[derive(Debug, Default)]
pub struct ShardCounters {
    pub capacity_bytes: AtomicU64,
    pub bytes_used: AtomicU64,
    pub objects: AtomicU64,
    pub pinned_objects: AtomicU64,
    pub retired_objects: AtomicU64,
    pub leases_held: AtomicU64,
    /// Leases taken through the published index, without a message to the shard (a gauge).
    pub published_leases_held: AtomicU64,
    /// Reads leased through the published index.
    pub published_reads: AtomicU64,
    pub writes_in_flight: AtomicU64,
    pub tasks_in_flight: AtomicU64,
    pub puts: AtomicU64,
    pub removes: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
    pub evictions: AtomicU64,
    pub no_space: AtomicU64,
    pub leases_expired: AtomicU64,
    pub stale_releases: AtomicU64,
    pub requests: AtomicU64,
    /// Requests a caller handled itself while the shard was idle (`lend`).
    pub served_by_callers: AtomicU64,
    pub wakeups: AtomicU64,
    pub parks: AtomicU64,
    pub dram_objects: AtomicU64,
    pub ssd_objects: AtomicU64,
    pub ssd_bytes: AtomicU64,
    pub demotions: AtomicU64,
    pub loads: AtomicU64,
    pub promotions: AtomicU64,
    pub ssd_read_bytes: AtomicU64,
    pub ssd_write_bytes: AtomicU64,
    pub syncs: AtomicU64,
    pub corrupted: AtomicU64,
    pub io_errors: AtomicU64,
    pub short_io: AtomicU64,
    pub tombstones: AtomicU64,
    pub tombstones_skipped: AtomicU64,
    pub segments_reclaimed: AtomicU64,
    pub ssd_evictions: AtomicU64,
    /// Written-back records found never to become durable (a write or sync before them in
    /// their segment failed); their objects were made dirty again or left the cache.
    pub ssd_records_lost: AtomicU64,
    pub restore_waits: AtomicU64,
    /// Loads of early leases (stream-bound and step reads) queued behind the restore budget:
    /// granted at once, their disk reads started as earlier loads end.
    pub deferred_loads: AtomicU64,
    pub recovered_objects: AtomicU64,
    pub recovery_discarded: AtomicU64,
    pub compactions: AtomicU64,
    pub compacted_records: AtomicU64,
    /// Objects written to SSD by a clean shutdown.
    pub shutdown_demotions: AtomicU64,
    /// Dirty objects a clean shutdown gave up writing: the tier could not make room for them
    /// (reclaims kept going without the flush getting shorter). Absent after the restart.
    pub shutdown_flush_skipped: AtomicU64,
    /// DRAM-only objects a clean shutdown left unwritten (past its deadline, skipped above, or
    /// `demote_on_shutdown` off), and their DRAM bytes: absent after the restart.
    pub shutdown_unflushed_objects: AtomicU64,
    pub shutdown_unflushed_bytes: AtomicU64,
    /// Writes that waited for a segment to be reclaimed.
    pub ssd_space_waits: AtomicU64,
    /// Tombstones queued, not yet written (a gauge).
    pub tombstones_pending: AtomicU64,
    /// Write-through removes not answered yet: their tombstones are not durable (a gauge).
    pub removes_awaiting_tombstone: AtomicU64,
    /// Reads through the published index, counted by the readers' threads (`snapshot` adds
    /// them to `published_leases_held`, `published_reads`, `hits`, `misses` and `bytes_read`).
    pub readers: ReaderCounters,
    /// 1 once the shard's SSD tier stopped taking writes (a gauge; see `ShardStats`).
    pub ssd_write_failed: AtomicU64,
    pub fixed_buffers_registered: AtomicBool,
}

/// A snapshot of one shard.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ShardStats {
    pub capacity_bytes: u64,
    pub bytes_used: u64,
    pub objects: u64,
    pub pinned_objects: u64,
    pub retired_objects: u64,
    pub leases_held: u64,
    pub published_leases_held: u64,
    pub published_reads: u64,
    pub writes_in_flight: u64,
    pub tasks_in_flight: u64,
    pub puts: u64,
    pub removes: u64,
    pub hits: u64,
    pub misses: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub evictions: u64,
    pub no_space: u64,
    pub leases_expired: u64,
    pub stale_releases: u64,
    pub requests: u64,
    /// Of `requests`, those a caller handled itself on its own thread while the shard was idle.
    pub served_by_callers: u64,
    pub wakeups: u64,
    pub parks: u64,
    pub dram_objects: u64,
    pub ssd_objects: u64,
    pub ssd_bytes: u64,
    pub demotions: u64,
    pub loads: u64,
    pub promotions: u64,
    pub ssd_read_bytes: u64,
    pub ssd_write_bytes: u64,
    pub syncs: u64,
    pub corrupted: u64,
    pub io_errors: u64,
    pub short_io: u64,
    pub tombstones: u64,
    pub tombstones_skipped: u64,
    pub segments_reclaimed: u64,
    pub ssd_evictions: u64,
    pub ssd_records_lost: u64,
    pub restore_waits: u64,
    pub deferred_loads: u64,
    pub recovered_objects: u64,
    pub recovery_discarded: u64,
    pub compactions: u64,
    pub compacted_records: u64,
    /// Objects written to SSD by a clean shutdown.
    pub shutdown_demotions: u64,
    pub shutdown_flush_skipped: u64,
    /// DRAM-only objects a clean shutdown left unwritten, and their DRAM bytes.
    pub shutdown_unflushed_objects: u64,
    pub shutdown_unflushed_bytes: u64,
    /// Writes that waited for a segment to be reclaimed.
    pub ssd_space_waits: u64,
    /// Tombstones queued, not yet written (a gauge).
    pub tombstones_pending: u64,
    /// Write-through removes not answered yet: their tombstones are not durable (a gauge;
    /// bounded by the tier's tombstone queue and the tombstones awaiting their sync).
    pub removes_awaiting_tombstone: u64,
    /// 1 once this shard's SSD tier stopped taking writes (a segment header failed every
    /// try); in the totals, the number of such shards. Removes and upserts of keys on SSD then
    /// fail with `Error::Io` instead of risking a return after a restart.
    pub ssd_write_failed: u64,
    /// The arena slice is registered with the ring as fixed buffers (SSD I/O then uses
    /// ReadFixed/WriteFixed). Only shards with an SSD tier register, piece by piece in idle
    /// turns after start-up, so this turns true a little after the store opened.
    pub fixed_buffers_registered: bool,
}

impl ShardCounters {
    /// Reads every counter (each one atomically; the set is not a single instant).
    pub fn snapshot(&self) -> ShardStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let [reader_leases, reader_reads, reader_hits, reader_misses, reader_bytes] = self.readers.sum();
        ShardStats {
            capacity_bytes: r(&self.capacity_bytes),
            bytes_used: r(&self.bytes_used),
            objects: r(&self.objects),
            pinned_objects: r(&self.pinned_objects),
            retired_objects: r(&self.retired_objects),
            leases_held: r(&self.leases_held),
            published_leases_held: r(&self.published_leases_held).wrapping_add(reader_leases),
            published_reads: r(&self.published_reads).wrapping_add(reader_reads),
            writes_in_flight: r(&self.writes_in_flight),
            tasks_in_flight: r(&self.tasks_in_flight),
            puts: r(&self.puts),
            removes: r(&self.removes),
            hits: r(&self.hits).wrapping_add(reader_hits),
            misses: r(&self.misses).wrapping_add(reader_misses),
            bytes_written: r(&self.bytes_written),
            bytes_read: r(&self.bytes_read).wrapping_add(reader_bytes),
            evictions: r(&self.evictions),
            no_space: r(&self.no_space),
            leases_expired: r(&self.leases_expired),
            stale_releases: r(&self.stale_releases),
            requests: r(&self.requests),
            served_by_callers: r(&self.served_by_callers),
            wakeups: r(&self.wakeups),
            parks: r(&self.parks),
            dram_objects: r(&self.dram_objects),
            ssd_objects: r(&self.ssd_objects),
            ssd_bytes: r(&self.ssd_bytes),
            demotions: r(&self.demotions),
            loads: r(&self.loads),
            promotions: r(&self.promotions),
            ssd_read_bytes: r(&self.ssd_read_bytes),
            ssd_write_bytes: r(&self.ssd_write_bytes),
            syncs: r(&self.syncs),
            corrupted: r(&self.corrupted),
            io_errors: r(&self.io_errors),
            short_io: r(&self.short_io),
            tombstones: r(&self.tombstones),
            tombstones_skipped: r(&self.tombstones_skipped),
            segments_reclaimed: r(&self.segments_reclaimed),
            ssd_evictions: r(&self.ssd_evictions),
            ssd_records_lost: r(&self.ssd_records_lost),
            restore_waits: r(&self.restore_waits),
            deferred_loads: r(&self.deferred_loads),
            recovered_objects: r(&self.recovered_objects),
            recovery_discarded: r(&self.recovery_discarded),
            compactions: r(&self.compactions),
            compacted_records: r(&self.compacted_records),
            shutdown_demotions: r(&self.shutdown_demotions),
            shutdown_flush_skipped: r(&self.shutdown_flush_skipped),
            shutdown_unflushed_objects: r(&self.shutdown_unflushed_objects),
            shutdown_unflushed_bytes: r(&self.shutdown_unflushed_bytes),
            ssd_space_waits: r(&self.ssd_space_waits),
            tombstones_pending: r(&self.tombstones_pending),
            removes_awaiting_tombstone: r(&self.removes_awaiting_tombstone),
            ssd_write_failed: r(&self.ssd_write_failed),
            fixed_buffers_registered: self.fixed_buffers_registered.load(Ordering::Relaxed),
        }
    }
}

/// What `Store::stats` returns: totals plus every shard.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Stats {
    pub total: ShardStats,
    pub shards: Vec<ShardStats>,
    /// Page backing of the DRAM arena ("hugetlb" or "thp-advised"); empty for remote stores.
    pub arena_backing: String,
    /// Transports the arena is registered with ("io_uring" per shard ring is in `shards`).
    pub arena_registered_with: Vec<String>,
    /// Async tickets not yet completed.
    pub tickets_in_flight: u64,
    /// GPU transfers (all zero without the `cuda` feature or before the first GPU call).
    pub gpu: GpuStats,
    /// Pipelined restores.
    pub restore: RestoreStats,
    /// Progressive and streaming transfers.
    pub stream: StreamStats,
}

/// Progressive and streaming transfer counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct StreamStats {
    /// Chunk handles whose transfers still run (or hold leases).
    pub handles_open: u64,
    /// Chunk handles made.
    pub handles: u64,
    pub chunks_delivered: u64,
    pub chunks_failed: u64,
    /// Chunks of SSD-resident objects that started before their object's load ended (its
    /// checked front had passed them).
    pub chunks_ahead_of_load: u64,
    /// Chunks submitted to a transport and not yet completed, now and at most.
    pub chunks_in_flight: u64,
    pub peak_chunks_in_flight: u64,
    /// Object bytes leased by chunk handles, now and at most.
    pub leased_bytes: u64,
    pub peak_leased_bytes: u64,
    /// Progressive puts not yet sealed, and their bytes.
    pub unsealed_objects: u64,
    pub unsealed_bytes: u64,
    /// Progressive puts sealed, aborted (or dropped, or failed to seal) and expired.
    pub sealed: u64,
    pub producer_aborts: u64,
    pub unsealed_expired: u64,
}

/// Pipelined restore counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RestoreStats {
    pub requests: u64,
    pub sub_batches: u64,
    pub credit_waits: u64,
    /// Staging credits held now (zero when no restore runs).
    pub credits_held_bytes: u64,
    pub peak_credits_bytes: u64,
    pub peak_request_staging_bytes: u64,
    /// Restores cancelled before every sub-batch was transferred.
    pub cancelled_requests: u64,
    /// Sub-batches that ended `Failed` (a key's load or copy failed).
    pub failed_sub_batches: u64,
    /// Sub-batches that ended `Draining` (their restore was cancelled).
    pub drained_sub_batches: u64,
    /// Time loaded sub-batches waited in `Ready` for the transfer stage, summed.
    pub ready_wait_us: u64,
}

impl Stats {
    /// Sums per-shard snapshots into `total`.
    pub fn from_shards(shards: Vec<ShardStats>) -> Stats {
        let mut t = ShardStats { fixed_buffers_registered: !shards.is_empty(), ..ShardStats::default() };
        for s in &shards {
            t.capacity_bytes += s.capacity_bytes;
            t.bytes_used += s.bytes_used;
            t.objects += s.objects;
            t.pinned_objects += s.pinned_objects;
            t.retired_objects += s.retired_objects;
            t.leases_held += s.leases_held;
            t.published_leases_held += s.published_leases_held;
            t.published_reads += s.published_reads;
            t.writes_in_flight += s.writes_in_flight;
            t.tasks_in_flight += s.tasks_in_flight;
            t.puts += s.puts;
            t.removes += s.removes;
            t.hits += s.hits;
            t.misses += s.misses;
            t.bytes_written += s.bytes_written;
            t.bytes_read += s.bytes_read;
            t.evictions += s.evictions;
            t.no_space += s.no_space;
            t.leases_expired += s.leases_expired;
            t.stale_releases += s.stale_releases;
            t.requests += s.requests;
            t.served_by_callers += s.served_by_callers;
            t.wakeups += s.wakeups;
            t.parks += s.parks;
            t.dram_objects += s.dram_objects;
            t.ssd_objects += s.ssd_objects;
            t.ssd_bytes += s.ssd_bytes;
            t.demotions += s.demotions;
            t.loads += s.loads;
            t.promotions += s.promotions;
            t.ssd_read_bytes += s.ssd_read_bytes;
            t.ssd_write_bytes += s.ssd_write_bytes;
            t.syncs += s.syncs;
            t.corrupted += s.corrupted;
            t.io_errors += s.io_errors;
            t.short_io += s.short_io;
            t.tombstones += s.tombstones;
            t.tombstones_skipped += s.tombstones_skipped;
            t.segments_reclaimed += s.segments_reclaimed;
            t.ssd_evictions += s.ssd_evictions;
            t.ssd_records_lost += s.ssd_records_lost;
            t.restore_waits += s.restore_waits;
            t.deferred_loads += s.deferred_loads;
            t.recovered_objects += s.recovered_objects;
            t.recovery_discarded += s.recovery_discarded;
            t.compactions += s.compactions;
            t.compacted_records += s.compacted_records;
            t.shutdown_demotions += s.shutdown_demotions;
            t.shutdown_flush_skipped += s.shutdown_flush_skipped;
            t.shutdown_unflushed_objects += s.shutdown_unflushed_objects;
            t.shutdown_unflushed_bytes += s.shutdown_unflushed_bytes;
            t.ssd_space_waits += s.ssd_space_waits;
            t.tombstones_pending += s.tombstones_pending;
            t.removes_awaiting_tombstone += s.removes_awaiting_tombstone;
            t.ssd_write_failed += s.ssd_write_failed;
            t.fixed_buffers_registered &= s.fixed_buffers_registered;
        }
        Stats { total: t, shards, ..Stats::default() }
    }

    /// Resources that must be back at zero when no work is running.
    pub fn held_resources(&self) -> HeldResources {
        HeldResources {
            leases: self.total.leases_held,
            published_leases: self.total.published_leases_held,
            writes_in_flight: self.total.writes_in_flight,
            tasks_in_flight: self.total.tasks_in_flight,
            retired_objects: self.total.retired_objects,
            tickets_in_flight: self.tickets_in_flight,
            restore_credits_bytes: self.restore.credits_held_bytes,
            stream_handles: self.stream.handles_open,
            stream_chunks_in_flight: self.stream.chunks_in_flight,
            stream_leased_bytes: self.stream.leased_bytes,
            unsealed_bytes: self.stream.unsealed_bytes,
            stream_bound_in_flight: self.gpu.stream_bound_in_flight,
            stream_bound_keys_pinned: self.gpu.stream_bound_keys_pinned,
            removes_awaiting_tombstone: self.total.removes_awaiting_tombstone,
        }
    }
}

/// GPU transfer counters of one store (feature `cuda`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct GpuStats {
    /// The DRAM arena is registered with CUDA (`cuMemHostRegister`, once per slice).
    pub arena_registered: bool,
    /// Time the registration took (lazily, at the first GPU call).
    pub registration_us: u64,
    /// Requests that took the staged path (staging buffer + one kernel per fill).
    pub staged_requests: u64,
    /// Requests that took the direct path.
    pub direct_requests: u64,
    /// Staging-buffer fills (one scatter or gather launch each).
    pub staged_fills: u64,
    pub kernel_launches: u64,
    /// `cuMemcpy{HtoD,DtoH}Async` calls.
    pub copy_calls: u64,
    /// `cuMemcpyBatchAsync` calls.
    pub batch_copy_calls: u64,
    pub bytes_to_device: u64,
    pub bytes_to_host: u64,
    /// Keys that failed in a GPU transfer.
    pub failed_keys: u64,
    /// Why requests fell back to the direct path (reason, count), "disabled" not counted.
    pub fallbacks: Vec<(String, u64)>,
    /// Time `batch_get_into_multi_buffers` to GPU spent, summed over calls, in microseconds:
    /// [validating keys and sending the lease requests, waiting for the grants, starting the
    /// staging copies (prestage), checking regions and building transfers, planning and
    /// submission, waiting on events].
    pub read_phase_us: [u64; 6],
    /// Time gathered writes from GPU memory spent, summed over calls (and over each call's
    /// parts), in microseconds: [validating keys and reserving (sources checked meanwhile),
    /// building the transfers, planning and submission, waiting on events, committing].
    pub write_phase_us: [u64; 5],
    /// Of that, the time until each call's first part was submitted: host work no copy
    /// overlaps, in microseconds, summed over calls.
    pub write_first_part_us: u64,
    /// Stream-bound reads (`*_on_stream`) made, and those whose stream has not yet passed their
    /// copies (or that still hold leases).
    pub stream_bound_reads: u64,
    pub stream_bound_in_flight: u64,
    /// Keys leased by stream-bound reads right now.
    pub stream_bound_keys_pinned: u64,
    /// Keys of stream-bound reads that were still loading from SSD: the stream waited on a
    /// gate for them.
    pub stream_bound_gated_keys: u64,
    /// Keys of stream-bound reads that failed (at the call, in the transfer or in their load).
    pub stream_bound_failed_keys: u64,
    /// Stream-bound reads whose stream did not pass their copies within `[gpu] stream_ttl_ms`:
    /// their leases were released and the read reported failed.
    pub stream_bound_expired: u64,
    /// Step calls (`step_on_stream`: every layer of a step in one call, one lease round trip)
    /// among the stream-bound reads, and the layers they carried.
    pub stream_steps: u64,
    pub stream_step_layers: u64,
    /// Host time of the stream-bound calls that submitted, summed, in microseconds: [checking
    /// the stream, leasing (a round trip through the shards), checking destinations and
    /// planning, enqueueing on the stream].
    pub stream_bound_call_us: [u64; 4],
}

/// Held-resource gauges; all zero when idle. Tests assert on this.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HeldResources {
    pub leases: u64,
    pub published_leases: u64,
    pub writes_in_flight: u64,
    pub tasks_in_flight: u64,
    pub retired_objects: u64,
    pub tickets_in_flight: u64,
    pub restore_credits_bytes: u64,
    pub stream_handles: u64,
    pub stream_chunks_in_flight: u64,
    pub stream_leased_bytes: u64,
    pub unsealed_bytes: u64,
    pub stream_bound_in_flight: u64,
    pub stream_bound_keys_pinned: u64,
    pub removes_awaiting_tombstone: u64,
}

impl HeldResources {
    /// True when nothing is held.
    pub fn is_zero(&self) -> bool {
        *self == HeldResources::default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use super::ShardCounters;

    #[test]
    fn reader_counts_of_many_threads_add_up_and_a_lease_given_back_elsewhere_nets_out() {
        let counters = ShardCounters::default();
        std::thread::scope(|s| {
            for _ in 0..20 {
                s.spawn(|| {
                    let mine = counters.readers.mine();
                    mine.leases_held.fetch_add(1, Relaxed);
                    mine.reads.fetch_add(1, Relaxed);
                    mine.hits.fetch_add(1, Relaxed);
                    mine.bytes_read.fetch_add(10, Relaxed);
                });
            }
        });
        // Given back on another thread than the one that took them.
        for _ in 0..20 {
            counters.readers.mine().leases_held.fetch_sub(1, Relaxed);
        }
        counters.readers.mine().misses.fetch_add(2, Relaxed);
        // The shard's own counts add to the readers'.
        counters.hits.fetch_add(1, Relaxed);
        counters.bytes_read.fetch_add(5, Relaxed);
        let stats = counters.snapshot();
        assert_eq!(stats.published_leases_held, 0);
        assert_eq!(stats.published_reads, 20);
        assert_eq!(stats.hits, 21);
        assert_eq!(stats.misses, 2);
        assert_eq!(stats.bytes_read, 205);
    }
}

/// Counters of the progressive and streaming paths.
#[derive(Default)]
pub(crate) struct StreamCounters {
    pub(crate) handles_open: AtomicU64,
    pub(crate) handles: AtomicU64,
    pub(crate) chunks_delivered: AtomicU64,
    pub(crate) chunks_failed: AtomicU64,
    pub(crate) chunks_ahead_of_load: AtomicU64,
    pub(crate) chunks_in_flight: AtomicU64,
    pub(crate) peak_chunks_in_flight: AtomicU64,
    pub(crate) leased_bytes: AtomicU64,
    pub(crate) peak_leased_bytes: AtomicU64,
    pub(crate) unsealed_objects: AtomicU64,
    pub(crate) unsealed_bytes: AtomicU64,
    pub(crate) sealed: AtomicU64,
    pub(crate) producer_aborts: AtomicU64,
    pub(crate) unsealed_expired: AtomicU64,
}

impl StreamCounters {
    pub(crate) fn snapshot(&self) -> StreamStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StreamStats {
            handles_open: get(&self.handles_open),
            handles: get(&self.handles),
            chunks_delivered: get(&self.chunks_delivered),
            chunks_failed: get(&self.chunks_failed),
            chunks_ahead_of_load: get(&self.chunks_ahead_of_load),
            chunks_in_flight: get(&self.chunks_in_flight),
            peak_chunks_in_flight: get(&self.peak_chunks_in_flight),
            leased_bytes: get(&self.leased_bytes),
            peak_leased_bytes: get(&self.peak_leased_bytes),
            unsealed_objects: get(&self.unsealed_objects),
            unsealed_bytes: get(&self.unsealed_bytes),
            sealed: get(&self.sealed),
            producer_aborts: get(&self.producer_aborts),
            unsealed_expired: get(&self.unsealed_expired),
        }
    }

    pub(crate) fn add(&self, counter: &AtomicU64, peak: &AtomicU64, n: u64) {
        let now = counter.fetch_add(n, Ordering::Relaxed) + n;
        peak.fetch_max(now, Ordering::Relaxed);
    }
}
