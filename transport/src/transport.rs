//! The `Transport` trait: one interface for every way kvtide moves bytes.
//!
//! Owns the contract between the engine and a transport: the engine checks regions through
//! `check`, may start moving bytes early (`start_early`), submits a batch of `Transfer`s and
//! then polls (or waits for) the returned `InFlight` (`inflight`), which reports one result per
//! transfer.
//! A CPU copy completes inside `submit`; the CUDA transport completes on events; a transport
//! whose completions arrive from a NIC or a socket implements `Progress` the same way. It never
//! takes leases or looks up objects: the caller keeps the host bytes valid until completion.
//!
//! Completion is per transfer, so a caller that wants per-chunk completion (progressive
//! loads) submits an object as several transfers (`Transfer::split`) and sees each land on its
//! own. A transport bound to a caller's ordering (a caller-supplied CUDA stream) is a transport
//! value built for that caller, e.g. a `CudaCopier` carrying the stream: the engine picks the
//! transport per call (`RestoreOptions::host_transport` shows the pattern for host memory).

use std::any::Any;
use std::time::{Duration, Instant};

pub use crate::inflight::{InFlight, Progress};
use crate::region::{MemoryKind, Region};
use crate::stream::StreamSubmit;
use crate::transfer::{Direction, Summary, Transfer};
use crate::TransportError;

/// A way to move bytes between DRAM objects and some kind of memory.
pub trait Transport: Send + Sync {
    /// A short name for logs and stats ("memcpy", "cuda", ...).
    fn name(&self) -> &'static str;

    /// True when every transfer has completed by the time `submit` returns (CPU copies).
    /// Callers that must not stall (a shard loop) then bound the bytes they submit per step.
    fn completes_inline(&self) -> bool;

    /// Checks region lists before anything is submitted: `lists[i]` are the regions of owner
    /// `i` (a key, a buffer); `writable` for destinations. Returns each owner's first error
    /// (None: good). Nothing is ever submitted for an owner that failed here. The default
    /// accepts host memory only (writable for destinations): right for any CPU-copy transport.
    fn check(&self, lists: &[&[Region<'_>]], writable: bool) -> Vec<Option<TransportError>> {
        lists.iter().map(|regions| crate::region::check_host_list(regions, writable)).collect()
    }

    /// Starts moving the bytes of `objects` ((host address, length), in the order the later
    /// `submit` will name them) towards memory of `target`, before the destinations are
    /// checked. Touches no destination. `total_bytes`: the whole request's bytes, when more
    /// objects will follow through `extend_early` (an estimate is enough; 0: these are all).
    /// None when the transport has no early start.
    ///
    /// # Safety
    /// The objects' host bytes must stay valid and unchanged until the returned value was
    /// passed to `submit` (and that submission completed) or dropped.
    unsafe fn start_early(&self, objects: &[(u64, u64)], target: MemoryKind, total_bytes: u64) -> Option<EarlyStart> {
        let _ = (objects, target, total_bytes);
        None
    }

    /// Adds `objects` to `early`: the later `submit` names them right after the objects it has
    /// already. False when the transport could not; `early` then matches no submission, which
    /// discards it.
    ///
    /// # Safety
    /// As `start_early`, for the added objects.
    unsafe fn extend_early(&self, early: &mut EarlyStart, objects: &[(u64, u64)]) -> bool {
        let _ = (early, objects);
        false
    }

    /// Submits `transfers`; their results come back through the returned `InFlight`, one per
    /// transfer, in order. `early` continues a `start_early` of the same objects if it still
    /// fits, and is discarded otherwise.
    ///
    /// # Safety
    /// Every transfer's host bytes and every piece's memory must be valid (the pieces checked
    /// with `check`) and must not be touched by anyone else until the `InFlight` completed
    /// (`poll` returned true, `wait` returned, or it was dropped).
    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError>;

    /// The transport's stream-bound submissions, when it has them (the CUDA transport).
    fn on_stream(&self) -> Option<&dyn StreamSubmit> {
        None
    }

    /// Starts a request whose transfers are handed over in parts: each part starts moving when
    /// it is pushed, so the caller prepares the next part while the last one moves. `hint`
    /// bounds the whole request, so a transport can take what the request needs once. The
    /// default submits each part on its own.
    fn submit_parts<'t>(&'t self, direction: Direction, hint: PartsHint) -> Box<dyn Parts + 't> {
        let _ = hint;
        Box::new(EachPart { transport: self, direction, parts: Vec::new(), settled: 0 })
    }
}

/// Bounds of a request submitted in parts (`Transport::submit_parts`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartsHint {
    /// Bytes of every part together.
    pub bytes: u64,
    /// Pieces of every part together.
    pub pieces: usize,
}

/// A request submitted in parts. Dropping it unfinished waits for (or stops) everything
/// pushed, as dropping an `InFlight` does.
pub trait Parts {
    /// Queues `transfers` behind the parts pushed before. A part that cannot be submitted
    /// fails its own transfers only; `finish` reports them.
    ///
    /// # Safety
    /// As `Transport::submit`, until the `InFlight` that `finish` returns has completed (or
    /// this was dropped).
    unsafe fn push(&mut self, transfers: &[Transfer]);

    /// Results of pushed transfers that completed since the last call, in push order: a
    /// leading run (none after a transfer still in flight), so the caller can act on what has
    /// landed while later parts still move. Never blocks; called again and again, it reports
    /// every pushed transfer once it completed. `finish` still reports every transfer.
    fn take_settled(&mut self) -> Vec<Result<(), TransportError>>;

    /// One result per pushed transfer, in push order, once the returned `InFlight` completes.
    fn finish(self: Box<Self>) -> InFlight;
}

/// `Transport::submit_parts` through `submit`, one submission per part.
struct EachPart<'t, T: ?Sized> {
    transport: &'t T,
    direction: Direction,
    parts: Vec<Part>,
    /// Leading parts whose results `take_settled` reported.
    settled: usize,
}

/// One part of `EachPart`: submitted, completed (its results and summary kept for `finish`),
/// or failed with its transfer count.
enum Part {
    Submitted(InFlight),
    Completed(Vec<Result<(), TransportError>>, Summary),
    Failed(TransportError, usize),
}

impl<T: Transport + ?Sized> Parts for EachPart<'_, T> {
    unsafe fn push(&mut self, transfers: &[Transfer]) {
        // SAFETY: forwarded contract: the transfers stay valid until the joined submission
        // completed, which includes this one.
        let part = match unsafe { self.transport.submit(self.direction, transfers, None) } {
            Ok(inflight) => Part::Submitted(inflight),
            Err(e) => Part::Failed(e, transfers.len()),
        };
        self.parts.push(part);
    }

    fn take_settled(&mut self) -> Vec<Result<(), TransportError>> {
        let mut out = Vec::new();
        while let Some(part) = self.parts.get_mut(self.settled) {
            match part {
                Part::Submitted(inflight) => {
                    if !inflight.poll() {
                        break;
                    }
                    let results = inflight.take_results();
                    out.extend(results.iter().cloned());
                    *part = Part::Completed(results, inflight.summary());
                }
                Part::Completed(results, _) => out.extend(results.iter().cloned()),
                Part::Failed(e, n) => out.extend(std::iter::repeat_n(Err(e.clone()), *n)),
            }
            self.settled += 1;
        }
        out
    }

    fn finish(self: Box<Self>) -> InFlight {
        InFlight::new(Box::new(Joined { parts: self.parts }))
    }
}

/// The parts of `EachPart` as one submission.
struct Joined {
    parts: Vec<Part>,
}

impl Progress for Joined {
    fn poll(&mut self) -> bool {
        let mut done = true;
        for part in &mut self.parts {
            if let Part::Submitted(inflight) = part {
                done &= inflight.poll();
            }
        }
        done
    }

    fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        let mut out = Vec::new();
        for part in &mut self.parts {
            match part {
                Part::Submitted(inflight) => out.extend(inflight.take_results()),
                Part::Completed(results, _) => out.append(results),
                Part::Failed(e, n) => out.extend(std::iter::repeat_n(Err(e.clone()), *n)),
            }
        }
        out
    }

    fn summary(&self) -> Summary {
        let mut summary = Summary::default();
        for part in &self.parts {
            match part {
                Part::Submitted(inflight) => summary.absorb(&inflight.summary()),
                Part::Completed(_, part_summary) => summary.absorb(part_summary),
                Part::Failed(..) => {}
            }
        }
        summary
    }

    fn block(&mut self) {
        for part in &mut self.parts {
            if let Part::Submitted(inflight) = part {
                inflight.block();
            }
        }
    }
}

/// Work a transport started ahead of its submission (`Transport::start_early`). Dropping it
/// discards the work, waiting for whatever it had started.
pub struct EarlyStart(Box<dyn Any + Send>);

impl EarlyStart {
    /// Wraps a transport's own early-start state.
    pub fn new(state: Box<dyn Any + Send>) -> EarlyStart {
        EarlyStart(state)
    }

    /// The transport's state back (None: it was another transport's).
    pub fn take<T: Any>(self) -> Option<Box<T>> {
        self.0.downcast().ok()
    }

    /// The transport's state, in place (None: it is another transport's).
    pub fn get_mut<T: Any>(&mut self) -> Option<&mut T> {
        self.0.downcast_mut()
    }
}

impl std::fmt::Debug for EarlyStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EarlyStart")
    }
}

/// Memory no transport of this build or machine reaches (GPU memory without CUDA): every
/// check of a list that names such memory fails with the reason, and nothing is submitted.
#[derive(Clone, Debug)]
pub struct Unreachable {
    pub error: TransportError,
}

impl Transport for Unreachable {
    fn name(&self) -> &'static str {
        "unreachable"
    }

    fn completes_inline(&self) -> bool {
        true
    }

    fn check(&self, lists: &[&[Region<'_>]], writable: bool) -> Vec<Option<TransportError>> {
        lists
            .iter()
            .map(|regions| {
                if regions.iter().any(|r| !r.kind().is_host()) {
                    return Some(self.error.clone());
                }
                crate::region::check_host_list(regions, writable)
            })
            .collect()
    }

    unsafe fn submit(
        &self,
        _direction: Direction,
        transfers: &[Transfer],
        _early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        Ok(InFlight::completed(vec![Err(self.error.clone()); transfers.len()], Summary::default()))
    }
}

/// A transport paced to `bytes_per_sec`: completions arrive no sooner than the bytes would
/// take on a link of that speed. Models a PCIe link (or any slower transfer) in tests and
/// benchmarks on machines without one.
pub struct Throttled<T> {
    pub inner: T,
    pub bytes_per_sec: u64,
}

impl<T> std::fmt::Debug for Throttled<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttled").field("bytes_per_sec", &self.bytes_per_sec).finish()
    }
}

impl<T: Transport> Transport for Throttled<T> {
    fn name(&self) -> &'static str {
        "throttled"
    }

    fn completes_inline(&self) -> bool {
        false
    }

    fn check(&self, lists: &[&[Region<'_>]], writable: bool) -> Vec<Option<TransportError>> {
        self.inner.check(lists, writable)
    }

    unsafe fn start_early(&self, objects: &[(u64, u64)], target: MemoryKind, total_bytes: u64) -> Option<EarlyStart> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.start_early(objects, target, total_bytes) }
    }

    unsafe fn extend_early(&self, early: &mut EarlyStart, objects: &[(u64, u64)]) -> bool {
        // SAFETY: forwarded contract.
        unsafe { self.inner.extend_early(early, objects) }
    }

    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        let bytes: u64 = transfers.iter().map(Transfer::bytes).sum();
        let due = Instant::now() + Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec.max(1) as f64);
        // SAFETY: forwarded contract.
        let inner = unsafe { self.inner.submit(direction, transfers, early)? };
        Ok(InFlight::new(Box::new(Paced { inner, due })))
    }
}

struct Paced {
    inner: InFlight,
    due: Instant,
}

impl Progress for Paced {
    fn poll(&mut self) -> bool {
        self.inner.poll() && Instant::now() >= self.due
    }

    fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        self.inner.take_results()
    }

    fn summary(&self) -> Summary {
        self.inner.summary()
    }

    fn block(&mut self) {
        loop {
            let left = self.due.saturating_duration_since(Instant::now());
            if left > Duration::from_micros(200) {
                std::thread::sleep(left - Duration::from_micros(100));
            } else if self.poll() {
                return;
            } else if left.is_zero() {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::memcpy::MemcpyTransport;
    use crate::transfer::Piece;

    #[test]
    fn throttled_completes_no_sooner_than_its_link_allows_and_copies_every_byte() {
        let src: Vec<u8> = (0..=255u8).cycle().take(1 << 16).collect();
        let mut dst = vec![0u8; 1 << 16];
        let t = Transfer {
            host: src.as_ptr() as u64,
            host_len: src.len() as u64,
            pieces: vec![Piece { host_offset: 0, addr: dst.as_mut_ptr() as u64, len: 1 << 16, kind: MemoryKind::Host }],
        };
        // 64 KiB at 1 MiB/s: about 62 ms.
        let throttled = Throttled { inner: MemcpyTransport, bytes_per_sec: 1 << 20 };
        let started = Instant::now();
        // SAFETY: both buffers are live locals untouched until `wait` returned.
        let mut inflight = unsafe { throttled.submit(Direction::HostToDevice, &[t], None) }.expect("submit");
        assert!(!inflight.poll(), "a paced transfer is not complete at once");
        let results = inflight.wait();
        assert!(started.elapsed() >= Duration::from_millis(60));
        assert_eq!(results, vec![Ok(())]);
        assert_eq!(dst, src);
    }

    #[test]
    fn parts_through_submit_report_every_transfer_in_push_order() {
        let src: Vec<u8> = (0..=255u8).cycle().take(3 * 4096).collect();
        let mut dst = vec![0u8; 3 * 4096];
        let to = dst.as_mut_ptr() as u64;
        let transfer = |i: u64| Transfer {
            host: src.as_ptr() as u64 + i * 4096,
            host_len: 4096,
            pieces: vec![Piece { host_offset: 0, addr: to + i * 4096, len: 4096, kind: MemoryKind::Host }],
        };
        let throttled = Throttled { inner: MemcpyTransport, bytes_per_sec: 1 << 30 };
        let unreachable = Unreachable { error: TransportError::CudaUnavailable("none") };
        for transport in [&unreachable as &dyn Transport, &throttled] {
            let mut parts = transport.submit_parts(Direction::HostToDevice, PartsHint { bytes: 3 * 4096, pieces: 3 });
            // SAFETY: both buffers are live locals untouched until `wait` returned.
            unsafe {
                parts.push(&[transfer(0), transfer(1)]);
                parts.push(&[transfer(2)]);
            }
            let results = parts.finish().wait();
            assert_eq!(results.len(), 3);
            if transport.name() == "throttled" {
                assert!(results.iter().all(Result::is_ok));
                assert_eq!(dst, src, "both parts' bytes arrived");
            } else {
                assert!(results.iter().all(|r| matches!(r, Err(TransportError::CudaUnavailable(_)))));
                assert!(dst.iter().all(|&b| b == 0));
            }
        }
    }

    /// A transport whose `n`th submission completes once `open[n]` is set; its second
    /// submission fails at once.
    struct Gated {
        open: Arc<Vec<AtomicBool>>,
        submitted: AtomicUsize,
    }

    struct GatedInFlight {
        open: Arc<Vec<AtomicBool>>,
        n: usize,
        results: Vec<Result<(), TransportError>>,
    }

    impl Progress for GatedInFlight {
        fn poll(&mut self) -> bool {
            self.open[self.n].load(Ordering::SeqCst)
        }

        fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
            std::mem::take(&mut self.results)
        }
    }

    impl Transport for Gated {
        fn name(&self) -> &'static str {
            "gated"
        }

        fn completes_inline(&self) -> bool {
            false
        }

        fn check(&self, lists: &[&[Region<'_>]], _writable: bool) -> Vec<Option<TransportError>> {
            vec![None; lists.len()]
        }

        unsafe fn submit(
            &self,
            _: Direction,
            transfers: &[Transfer],
            _: Option<EarlyStart>,
        ) -> Result<InFlight, TransportError> {
            let n = self.submitted.fetch_add(1, Ordering::SeqCst);
            if n == 1 {
                return Err(TransportError::Io("the second submission fails".into()));
            }
            let results = vec![Ok(()); transfers.len()];
            Ok(InFlight::new(Box::new(GatedInFlight { open: Arc::clone(&self.open), n, results })))
        }
    }

    #[test]
    fn parts_through_submit_report_settled_transfers_as_a_leading_run() {
        let open: Arc<Vec<_>> = Arc::new((0..3).map(|_| AtomicBool::new(false)).collect());
        let gated = Gated { open: Arc::clone(&open), submitted: AtomicUsize::new(0) };
        let transfer = Transfer { host: 1, host_len: 0, pieces: Vec::new() };
        let mut parts = gated.submit_parts(Direction::DeviceToHost, PartsHint::default());
        // SAFETY: nothing is touched: the transport only counts.
        unsafe {
            parts.push(&[transfer.clone(), transfer.clone()]);
            parts.push(std::slice::from_ref(&transfer));
            parts.push(std::slice::from_ref(&transfer));
        }
        assert!(parts.take_settled().is_empty(), "the first part is still in flight");
        open[0].store(true, Ordering::SeqCst);
        let settled = parts.take_settled();
        assert_eq!(settled.len(), 3, "the first part and the failed second: {settled:?}");
        assert!(settled[..2].iter().all(Result::is_ok));
        assert!(matches!(settled[2], Err(TransportError::Io(_))));
        assert!(parts.take_settled().is_empty(), "reported once; the third part is in flight");
        open[2].store(true, Ordering::SeqCst);
        assert_eq!(parts.take_settled(), vec![Ok(())]);
        assert!(parts.take_settled().is_empty());
        let results = parts.finish().wait();
        assert_eq!(results.len(), 4, "finish still reports every transfer");
        assert!(results[..2].iter().all(Result::is_ok) && results[3].is_ok());
        assert!(matches!(results[2], Err(TransportError::Io(_))));
    }

    #[test]
    fn unreachable_memory_fails_its_check_and_its_submission() {
        let unreachable = Unreachable { error: TransportError::CudaUnavailable("no cuda in this build") };
        let mut buf = [0u8; 8];
        let host = Region::host(&mut buf);
        // SAFETY: never dereferenced: the check refuses it.
        let dev = unsafe { Region::from_raw(0x1000, 8, MemoryKind::Device { ordinal: 0 }) };
        let checks = unreachable.check(&[&[host], &[host, dev]], true);
        assert_eq!(checks[0], None);
        assert!(matches!(checks[1], Some(TransportError::CudaUnavailable(_))));
        let t = Transfer { host: 1, host_len: 8, pieces: Vec::new() };
        // SAFETY: nothing is touched.
        let results = unsafe { unreachable.submit(Direction::HostToDevice, &[t], None) }.expect("submit").wait();
        assert!(matches!(results[0], Err(TransportError::CudaUnavailable(_))));
    }
}
