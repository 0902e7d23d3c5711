//! The owner's counters and its Prometheus endpoint: `GET /metrics` on a loopback address.
//!
//! Owns `OwnerCounters` (the service's own counters, which the owner's connections update), the
//! request latency histograms they record into (kinds from the operation table in `protocol`),
//! the mapping from the engine's `Stats` and those counters to metric names and types (read at
//! each scrape, nothing copied in between), and the endpoint's listener and thread. It never
//! depends on the owner service that feeds it (`server` imports it, not the reverse), never answers
//! anything but `GET /metrics` (other paths: 404), serves one scraper at a time with a short
//! deadline per connection, and never takes a lock of the data path while it encodes. Loopback
//! only is enforced where the address is configured (`[owner] metrics_addr`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// A scraper's request head larger than this is refused.
const MAX_REQUEST_HEAD: usize = 8 << 10;
/// A scraper has this long to send its request and take the reply.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(2);

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

    /// The owner's own counters and gauges.
    fn encode_owner(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        use Kind::{Counter, Gauge};
        let (c, r) = (&self.counters, load);
        let owner: [(&str, &str, Kind, u64); 12] = [
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

/// The running `/metrics` endpoint; dropping it stops it.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer").field("addr", &self.addr).finish()
    }
}

impl MetricsServer {
    /// Listens on `addr` (the caller checked it is loopback) and serves the owner's metrics.
    pub(crate) fn start(
        addr: SocketAddr,
        engine: Arc<Engine>,
        counters: Arc<OwnerCounters>,
    ) -> std::io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let mut registry = Registry::default();
        registry.register_collector(Box::new(OwnerCollector { engine, counters }));
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name("kvtide-metrics".into()).spawn(move || {
            for conn in listener.incoming() {
                if stopping.load(Ordering::Acquire) {
                    return;
                }
                if let Ok(conn) = conn {
                    if let Err(e) = serve_scrape(conn, &registry) {
                        tracing::debug!(error = %e, "metrics scrape failed");
                    }
                }
            }
        })?;
        Ok(MetricsServer { addr, stop, thread: Some(thread) })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept loop, which sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(500));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Answers one scraper: the request head (within `MAX_REQUEST_HEAD` and `SCRAPE_DEADLINE`),
/// then the metrics or a 404, and closes.
fn serve_scrape(mut conn: TcpStream, registry: &Registry) -> std::io::Result<()> {
    let deadline = Instant::now() + SCRAPE_DEADLINE;
    conn.set_read_timeout(Some(SCRAPE_DEADLINE))?;
    conn.set_write_timeout(Some(SCRAPE_DEADLINE))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_REQUEST_HEAD || Instant::now() > deadline {
            return respond(&mut conn, "431 Request Header Fields Too Large", "text/plain", b"request too large\n");
        }
        let n = conn.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if method != b"GET" {
        return respond(&mut conn, "405 Method Not Allowed", "text/plain", b"GET only\n");
    }
    if path != b"/metrics" {
        return respond(&mut conn, "404 Not Found", "text/plain", b"try /metrics\n");
    }
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, registry) {
        Ok(()) => {
            respond(&mut conn, "200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", body.as_bytes())
        }
        Err(_) => respond(&mut conn, "500 Internal Server Error", "text/plain", b"encoding failed\n"),
    }
}

fn respond(conn: &mut TcpStream, status: &str, content_type: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes())?;
    conn.write_all(body)?;
    conn.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

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
