//! The owner's metrics in Prometheus text: what `GET /metrics` of the HTTP listener answers.
//!
//! Owns `OwnerCounters` (the service's own counters, which the owner's connections update), the
//! request latency histograms they record into (kinds from the operation table in `protocol`),
//! the mapping from the engine's `Stats` and those counters to metric names and types (read at
//! each scrape, nothing copied in between), the build information and the process metrics
//! (read from `/proc/self`). It never depends on the owner service that feeds it (`server`
//! imports it, not the reverse), never listens itself (`http` does), and never takes a lock of
//! the data path while it encodes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvtide::{Engine, Store};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::protocol::{Op, OpKind};

/// Request kinds the latency histograms are kept for (the `kind` label): one per `OpKind`,
/// as the operation table in `protocol` assigns them.
const KINDS: [OpKind; OpKind::ALL.len()] = OpKind::ALL;

/// Latency buckets: upper bounds of 1 µs doubling up to about 8 s, then +Inf.
const LATENCY_BUCKETS: usize = 24;

/// Time to serve each request, by kind: from its header read to its reply flushed. Counted in
/// atomics (no lock on the request path), read at each scrape.
#[derive(Default)]
pub struct RequestLatency {
    kinds: [KindLatency; KINDS.len()],
}

#[derive(Default)]
struct KindLatency {
    /// Requests per bucket (not cumulative); the last one is +Inf.
    buckets: [AtomicU64; LATENCY_BUCKETS + 1],
    sum_ns: AtomicU64,
}

impl std::fmt::Debug for RequestLatency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestLatency").finish_non_exhaustive()
    }
}

impl RequestLatency {
    /// Records one request of operation `op` that took `took`.
    pub fn record(&self, op: Op, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let k = &self.kinds[op.kind() as usize];
        k.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        k.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let mut family = encoder.encode_descriptor(
            "kvtide_owner_request_seconds",
            "time to serve a request, from its header to its reply flushed, by kind",
            None,
            prometheus_client::metrics::MetricType::Histogram,
        )?;
        for (kind, k) in KINDS.iter().zip(&self.kinds) {
            let buckets: Vec<(f64, u64)> = (0..=LATENCY_BUCKETS)
                .map(|i| {
                    let bound = if i == LATENCY_BUCKETS { f64::INFINITY } else { 1e-6 * (1u64 << i) as f64 };
                    (bound, k.buckets[i].load(Ordering::Relaxed))
                })
                .collect();
            let count = buckets.iter().map(|b| b.1).sum();
            let sum = k.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
            family
                .encode_family(&[("kind", kind.label())])?
                .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        Ok(())
    }
}

/// The bucket of a latency of `ns`: the first whose bound (1 µs << i) it does not exceed.
fn bucket_of(ns: u64) -> usize {
    let us = ns.div_ceil(1000);
    if us <= 1 {
        return 0;
    }
    ((64 - (us - 1).leading_zeros()) as usize).min(LATENCY_BUCKETS)
}

/// Counters of the service itself (the engine's are in `Store::stats`). Gauges (`*_open`,
/// `buffered_bytes`) return to zero when the clients are gone.
#[derive(Debug, Default)]
pub struct OwnerCounters {
    pub connections_accepted: AtomicU64,
    /// Refused with `Busy` (no free slot), at accept or when a TCP peer authenticated.
    pub connections_refused: AtomicU64,
    /// Connections holding a connection slot (gauge).
    pub connections_open: AtomicU64,
    /// TCP connections in their handshake, holding an unauthenticated slot (gauge).
    pub handshakes_open: AtomicU64,
    /// Handshakes that did not finish within `handshake_timeout_ms`.
    pub handshake_timeouts: AtomicU64,
    /// Connections closed because a frame did not arrive within `payload_timeout_ms`.
    pub payload_timeouts: AtomicU64,
    /// Connections closed after `idle_timeout_ms` without a request.
    pub idle_closed: AtomicU64,
    /// Request bytes buffered now (gauge).
    pub buffered_bytes: AtomicU64,
    pub requests: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub auth_failures: AtomicU64,
    pub leases_granted: AtomicU64,
    pub leases_outstanding: AtomicU64,
    pub unknown_releases: AtomicU64,
    pub busy_replies: AtomicU64,
    /// Bytes of the put windows that connections hold now (gauge).
    pub put_window_bytes: AtomicU64,
    /// Put windows refused because `max_put_window_bytes` was reached.
    pub put_windows_refused: AtomicU64,
    /// Value bytes read straight from clients' memory (puts of connections that asked for it).
    pub direct_put_bytes: AtomicU64,
    /// Connections whose ask to put from their memory was refused (they put through the window).
    pub direct_puts_refused: AtomicU64,
    /// TCP connections given the UCX plane (`UcxAttach` answered).
    pub ucx_attached: AtomicU64,
    /// Reads clients made through the read index and reported (`IndexReads`), of objects still
    /// there when the report came.
    pub index_reads: AtomicU64,
    /// `IndexReads` frames received (each also counts in `requests`).
    pub index_read_reports: AtomicU64,
    /// Requests of a batch (`PutBatch`, `RemoveBatch`) and the items they carried.
    pub batch_requests: AtomicU64,
    pub batch_items: AtomicU64,
    /// Time to serve each request (from its first byte to its reply flushed), by kind.
    pub latency: RequestLatency,
    /// Threads serving connections now (gauge): connections in a request, their handshake, or
    /// shortly after their last request.
    pub connection_threads: Arc<AtomicU64>,
    /// Connections parked without a thread between requests (gauge).
    pub connections_parked: Arc<AtomicU64>,
    /// Cluster membership (all zero unless the owner registered in a cluster).
    pub cluster: Arc<crate::cluster::RegistrationCounters>,
}

/// Reads the engine's statistics and the owner's counters at each scrape.
struct OwnerCollector {
    engine: Arc<Engine>,
    counters: Arc<OwnerCounters>,
}

impl std::fmt::Debug for OwnerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerCollector").finish_non_exhaustive()
    }
}

/// Counter or gauge.
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
}

fn emit(encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, kind: Kind, value: u64) -> std::fmt::Result {
    match kind {
        Kind::Counter => {
            let metric = ConstCounter::new(value);
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
        }
        Kind::Gauge => {
            let metric = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
        }
    }
}

impl Collector for OwnerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        self.encode_engine(&mut encoder)?;
        self.encode_ssd_tier(&mut encoder)?;
        self.encode_owner(&mut encoder)?;
        self.encode_cluster(&mut encoder)?;
        self.encode_rejected(&mut encoder)?;
        self.counters.latency.encode(&mut encoder)
    }
}

/// A counter's or gauge's current value.
fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

impl OwnerCollector {
    /// The engine's statistics.
    fn encode_engine(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use Kind::{Counter, Gauge};
        let stats = self.engine.stats();
        let t = &stats.total;
        let (g, st) = (&stats.gpu, &stats.stream);
        let engine: [(&str, &str, Kind, u64); 37] = [
            ("kvtide_capacity_bytes", "DRAM arena bytes", Gauge, t.capacity_bytes),
            ("kvtide_dram_used_bytes", "DRAM arena bytes in use", Gauge, t.bytes_used),
            ("kvtide_objects", "objects stored (DRAM and SSD)", Gauge, t.objects),
            ("kvtide_dram_objects", "objects resident in DRAM", Gauge, t.dram_objects),
            ("kvtide_ssd_objects", "objects on the SSD tier", Gauge, t.ssd_objects),
            ("kvtide_ssd_used_bytes", "SSD tier bytes in use", Gauge, t.ssd_bytes),
            ("kvtide_pinned_objects", "pinned objects", Gauge, t.pinned_objects),
            ("kvtide_leases_held", "object leases held by readers", Gauge, t.leases_held),
            (
                "kvtide_published_leases_held",
                "object leases held by readers through the published index (no shard message)",
                Gauge,
                t.published_leases_held,
            ),
            ("kvtide_writes_in_flight", "writes not yet published", Gauge, t.writes_in_flight),
            ("kvtide_puts", "puts published", Counter, t.puts),
            ("kvtide_removes", "removes", Counter, t.removes),
            ("kvtide_hits", "reads that found their key", Counter, t.hits),
            ("kvtide_misses", "reads that did not find their key", Counter, t.misses),
            ("kvtide_bytes_written", "value bytes written", Counter, t.bytes_written),
            ("kvtide_bytes_read", "value bytes read", Counter, t.bytes_read),
            ("kvtide_evictions", "objects evicted from DRAM (dropped or demoted)", Counter, t.evictions),
            ("kvtide_no_space", "writes refused for lack of space", Counter, t.no_space),
            ("kvtide_leases_expired", "leases reclaimed after their TTL", Counter, t.leases_expired),
            ("kvtide_demotions", "objects written from DRAM to SSD", Counter, t.demotions),
            ("kvtide_loads", "objects loaded from SSD", Counter, t.loads),
            ("kvtide_ssd_read_bytes", "bytes read from the SSD tier", Counter, t.ssd_read_bytes),
            ("kvtide_ssd_write_bytes", "bytes written to the SSD tier", Counter, t.ssd_write_bytes),
            ("kvtide_ssd_evictions", "objects dropped from the SSD tier", Counter, t.ssd_evictions),
            ("kvtide_ssd_corrupted", "SSD records that failed their checksum", Counter, t.corrupted),
            ("kvtide_ssd_io_errors", "SSD I/O errors", Counter, t.io_errors),
            ("kvtide_restore_requests", "pipelined restores", Counter, stats.restore.requests),
            ("kvtide_restore_sub_batches", "restore sub-batches", Counter, stats.restore.sub_batches),
            (
                "kvtide_restore_credits_held_bytes",
                "restore staging credits held",
                Gauge,
                stats.restore.credits_held_bytes,
            ),
            ("kvtide_gpu_bytes_to_device", "bytes copied to GPUs", Counter, g.bytes_to_device),
            ("kvtide_gpu_bytes_to_host", "bytes copied from GPUs", Counter, g.bytes_to_host),
            ("kvtide_gpu_staged_requests", "GPU requests on the staged path", Counter, g.staged_requests),
            ("kvtide_gpu_direct_requests", "GPU requests on the direct path", Counter, g.direct_requests),
            ("kvtide_gpu_failed_keys", "keys that failed in a GPU transfer", Counter, g.failed_keys),
            ("kvtide_stream_handles_open", "chunk handles running", Gauge, st.handles_open),
            ("kvtide_stream_chunks_delivered", "chunks delivered", Counter, st.chunks_delivered),
            ("kvtide_stream_unsealed_bytes", "bytes of unsealed puts", Gauge, st.unsealed_bytes),
        ];
        for (name, help, kind, value) in engine {
            emit(encoder, name, help, kind, value)?;
        }
        Ok(())
    }

    /// The SSD tier's capacity, its free bytes (capacity less the bytes of the records it
    /// holds) and whether it stopped taking writes; capacity and free only with an SSD tier.
    fn encode_ssd_tier(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let t = self.engine.stats().total;
        if let Some(capacity) = self.engine.ssd_capacity_bytes() {
            emit(encoder, "kvtide_ssd_capacity_bytes", "SSD tier capacity ([ssd] bytes)", Kind::Gauge, capacity)?;
            let free = capacity.saturating_sub(t.ssd_bytes);
            emit(encoder, "kvtide_ssd_free_bytes", "SSD tier bytes not held by records", Kind::Gauge, free)?;
        }
        let failed = u64::from(t.ssd_write_failed > 0);
        let help = "1 when the SSD tier stopped taking writes after repeated disk failures (then /ready is 503)";
        emit(encoder, "kvtide_ssd_write_failed", help, Kind::Gauge, failed)
    }

    /// The owner's own counters and gauges.
    fn encode_owner(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use Kind::{Counter, Gauge};
        let (c, r) = (&self.counters, load);
        let owner: [(&str, &str, Kind, u64); 16] = [
            ("kvtide_owner_connection_threads", "threads serving connections now", Gauge, r(&c.connection_threads)),
            (
                "kvtide_owner_connections_parked",
                "idle connections parked without a thread",
                Gauge,
                r(&c.connections_parked),
            ),
            ("kvtide_owner_connections_accepted", "connections accepted", Counter, r(&c.connections_accepted)),
            ("kvtide_owner_connections_open", "connections holding a slot", Gauge, r(&c.connections_open)),
            ("kvtide_owner_handshakes_open", "TCP connections in their handshake", Gauge, r(&c.handshakes_open)),
            ("kvtide_owner_requests", "requests served", Counter, r(&c.requests)),
            ("kvtide_owner_leases_granted", "leases granted to clients", Counter, r(&c.leases_granted)),
            ("kvtide_owner_leases_outstanding", "leases clients hold", Gauge, r(&c.leases_outstanding)),
            ("kvtide_owner_buffered_bytes", "request bytes buffered", Gauge, r(&c.buffered_bytes)),
            ("kvtide_owner_put_window_bytes", "bytes of put windows held", Gauge, r(&c.put_window_bytes)),
            (
                "kvtide_owner_direct_put_bytes",
                "value bytes read straight from clients' memory",
                Counter,
                r(&c.direct_put_bytes),
            ),
            (
                "kvtide_owner_index_reads",
                "reads clients made through the read index, as they reported them",
                Counter,
                r(&c.index_reads),
            ),
            (
                "kvtide_owner_index_read_reports",
                "frames reporting reads through the read index",
                Counter,
                r(&c.index_read_reports),
            ),
            ("kvtide_owner_ucx_attached", "TCP connections given the UCX plane", Counter, r(&c.ucx_attached)),
            ("kvtide_owner_batch_requests", "batched requests", Counter, r(&c.batch_requests)),
            ("kvtide_owner_batch_items", "items of batched requests", Counter, r(&c.batch_items)),
        ];
        for (name, help, kind, value) in owner {
            emit(encoder, name, help, kind, value)?;
        }
        Ok(())
    }

    /// The owner's cluster membership.
    fn encode_cluster(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use Kind::{Counter, Gauge};
        let (k, r) = (&self.counters.cluster, load);
        let cluster: [(&str, &str, Kind, u64); 5] = [
            ("kvtide_cluster_registered", "1 while this owner's cluster record is kept alive", Gauge, r(&k.registered)),
            ("kvtide_cluster_keepalives", "lease keep-alives etcd accepted", Counter, r(&k.keepalives)),
            (
                "kvtide_cluster_keepalive_failures",
                "keep-alives or record updates that failed",
                Counter,
                r(&k.keepalive_failures),
            ),
            (
                "kvtide_cluster_registrations",
                "registrations (more than 1: the lease was lost and taken again)",
                Counter,
                r(&k.registrations),
            ),
            ("kvtide_cluster_lease_ttl_seconds", "the lease TTL etcd granted", Gauge, r(&k.lease_ttl_s)),
        ];
        for (name, help, kind, value) in cluster {
            emit(encoder, name, help, kind, value)?;
        }
        Ok(())
    }

    /// Requests and connections refused or closed, one family labelled by reason.
    fn encode_rejected(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let (c, r) = (&self.counters, load);
        let rejected = [
            ("busy", r(&c.busy_replies)),
            ("connection_limit", r(&c.connections_refused)),
            ("auth", r(&c.auth_failures)),
            ("protocol", r(&c.protocol_errors)),
            ("handshake_timeout", r(&c.handshake_timeouts)),
            ("payload_timeout", r(&c.payload_timeouts)),
            ("idle", r(&c.idle_closed)),
            ("put_window_limit", r(&c.put_windows_refused)),
            ("direct_put", r(&c.direct_puts_refused)),
            ("unknown_release", r(&c.unknown_releases)),
        ];
        let probe = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "kvtide_owner_rejected",
            "requests and connections refused or closed, by reason",
            None,
            probe.metric_type(),
        )?;
        for (reason, value) in rejected {
            ConstCounter::new(value).encode(family.encode_family(&[("reason", reason)])?)?;
        }
        Ok(())
    }
}

/// The owner's metrics in Prometheus text (OpenMetrics): build and process metrics always, and
/// the engine's and the service's once the owner serves (`served`: its engine and counters).
pub(crate) fn encode_text(served: Option<(Arc<Engine>, Arc<OwnerCounters>)>) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(BuildInfo));
    registry.register_collector(Box::new(ProcessCollector));
    if let Some((engine, counters)) = served {
        registry.register_collector(Box::new(OwnerCollector { engine, counters }));
    }
    let mut body = String::new();
    prometheus_client::encoding::text::encode(&mut body, &registry)?;
    Ok(body)
}

/// The version this owner was built from: the crate version, and the git commit when the build
/// had one (`build.rs`).
pub(crate) const VERSION: &str = env!("CARGO_PKG_VERSION");
pub(crate) const GIT_COMMIT: Option<&str> = option_env!("BUILD_GIT_COMMIT");

/// `kvtide_build_info{version, git} 1`.
#[derive(Debug)]
struct BuildInfo;

impl Collector for BuildInfo {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let metric = ConstGauge::new(1i64);
        let help = "always 1; the labels say which build runs (git: the commit, when the build had one)";
        let mut family = encoder.encode_descriptor("kvtide_build_info", help, None, metric.metric_type())?;
        let labels = [("version", VERSION), ("git", GIT_COMMIT.unwrap_or(""))];
        metric.encode(family.encode_family(&labels)?)
    }
}

/// The process metrics Prometheus' own process collector exports, read from `/proc/self` at
/// each scrape (a metric whose source cannot be read is left out).
#[derive(Debug)]
struct ProcessCollector;

/// What `/proc/self/stat` and its neighbours say about this process.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    start_time_seconds: f64,
}

impl ProcessStats {
    /// Parses `/proc/self/stat` (`ticks_per_second`, `page_bytes` from sysconf; `boot_time_s`
    /// from `/proc/stat`'s btime). The command name (field 2) is in parentheses and may hold
    /// spaces: fields are counted after its closing one.
    fn parse(stat: &str, ticks_per_second: f64, page_bytes: u64, boot_time_s: u64) -> Option<ProcessStats> {
        let after_name = &stat[stat.rfind(')')? + 1..];
        // Fields from 3 (state) on: utime is field 14, stime 15, starttime 22, vsize 23, rss 24.
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        Some(ProcessStats {
            cpu_seconds: (field(14)? + field(15)?) as f64 / ticks_per_second,
            resident_bytes: field(24)? * page_bytes,
            virtual_bytes: field(23)?,
            start_time_seconds: boot_time_s as f64 + field(22)? as f64 / ticks_per_second,
        })
    }

    fn read() -> Option<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let boot_time_s = boot.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok())?;
        // SAFETY: sysconf only reads a configuration value.
        let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        if ticks <= 0 || page <= 0 {
            return None;
        }
        ProcessStats::parse(&stat, ticks as f64, page as u64, boot_time_s)
    }
}

/// Descriptors open now (entries of `/proc/self/fd`, less the one reading it) and the soft limit.
fn descriptors() -> (Option<u64>, Option<u64>) {
    let open = std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count().saturating_sub(1) as u64);
    // SAFETY: rlimit is plain data that getrlimit fills in.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: getrlimit writes into the valid `limit`.
    let max = (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit.rlim_cur);
    (open, max)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let gauge = |encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, value: f64| {
            let metric = ConstGauge::new(value);
            metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
        };
        if let Some(p) = ProcessStats::read() {
            let cpu = ConstCounter::new(p.cpu_seconds);
            let help = "user and system CPU time spent, in seconds";
            cpu.encode(encoder.encode_descriptor("process_cpu_seconds", help, None, cpu.metric_type())?)?;
            gauge(&mut encoder, "process_resident_memory_bytes", "resident memory size", p.resident_bytes as f64)?;
            gauge(&mut encoder, "process_virtual_memory_bytes", "virtual memory size", p.virtual_bytes as f64)?;
            let help = "start time of the process since the Unix epoch, in seconds";
            gauge(&mut encoder, "process_start_time_seconds", help, p.start_time_seconds)?;
        }
        let (open, max) = descriptors();
        if let Some(open) = open {
            gauge(&mut encoder, "process_open_fds", "open file descriptors", open as f64)?;
        }
        if let Some(max) = max {
            gauge(&mut encoder, "process_max_fds", "the open file descriptor limit (soft)", max as f64)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_stats_are_read_after_the_command_name_even_when_it_holds_spaces_and_parentheses() {
        // Fields 1..24 of /proc/<pid>/stat: utime 300 and stime 100 ticks, starttime 5000
        // ticks after boot, vsize 123456789, rss 1000 pages.
        let stat = "42 (kv tide) x) S 1 42 42 0 -1 4194560 100 0 0 0 300 100 0 0 20 0 9 0 5000 123456789 1000 rest";
        let p = ProcessStats::parse(stat, 100.0, 4096, 1_700_000_000).expect("parsed");
        assert_eq!(
            p,
            ProcessStats {
                cpu_seconds: 4.0,
                resident_bytes: 4_096_000,
                virtual_bytes: 123_456_789,
                start_time_seconds: 1_700_000_050.0
            }
        );
        assert_eq!(ProcessStats::parse("42 (truncated) S 1 2", 100.0, 4096, 0), None);
        let own = ProcessStats::read().expect("this process's /proc/self/stat");
        assert!(own.resident_bytes > 0 && own.virtual_bytes >= own.resident_bytes, "{own:?}");
    }

    #[test]
    fn latencies_land_in_the_first_bucket_whose_bound_they_do_not_exceed() {
        for (ns, bucket) in [(0, 0), (1000, 0), (1001, 1), (2000, 1), (2001, 2), (4000, 2), (1_000_000, 10)] {
            assert_eq!(bucket_of(ns), bucket, "{ns} ns");
        }
        assert_eq!(bucket_of(u64::MAX), LATENCY_BUCKETS, "past the last bound: +Inf");
        let latency = RequestLatency::default();
        latency.record(Op::Get, Duration::from_micros(3));
        latency.record(Op::GetParts, Duration::from_secs(100));
        let get = &latency.kinds[0];
        assert_eq!(get.buckets[2].load(Ordering::Relaxed), 1);
        assert_eq!(get.buckets[LATENCY_BUCKETS].load(Ordering::Relaxed), 1);
        assert_eq!(get.sum_ns.load(Ordering::Relaxed), 100_000_003_000);
    }
}
