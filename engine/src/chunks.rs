//! Chunk handles: per-chunk completion of a progressive or streaming transfer.
//!
//! Owns the state every chunk of one transfer goes through (pending, then done or failed, once)
//! and the hand-off of that state from the driver that moves the bytes to any number of
//! threads that wait on it or poll it. It never moves bytes itself. Every chunk settles exactly
//! once: the driver settles what it delivered, and whatever it did not deliver is failed when
//! it stops (`ChunkSink`'s drop), so no waiter can hang on a chunk nobody will complete.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::Error;

/// Where one chunk lands: the destination buffer (its index in the call's buffers; 0 for a
/// single destination) and the byte range inside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkPlace {
    pub buffer: usize,
    pub range: Range<u64>,
}

/// What a chunk is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChunkState<E> {
    Pending,
    Done,
    Failed(E),
}

/// What a whole handle is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandleStatus<E> {
    /// Some chunks are still pending; `done` have landed, `failed` have failed.
    Pending { done: usize, failed: usize, total: usize },
    /// Every chunk landed.
    Done,
    /// Every chunk settled and at least one failed: the first failed chunk (in chunk order) and
    /// its error.
    Failed { chunk: usize, error: E },
}

struct Inner<E> {
    states: Vec<ChunkState<E>>,
    pending: usize,
    /// Chunks in the order they settled; `poll` hands out those past `polled`.
    settled: Vec<usize>,
    polled: usize,
}

/// The shared state of one handle.
pub(crate) struct Chunks<E> {
    places: Vec<ChunkPlace>,
    inner: Mutex<Inner<E>>,
    changed: Condvar,
    cancel: AtomicBool,
}

impl<E: Clone> Chunks<E> {
    fn lock(&self) -> MutexGuard<'_, Inner<E>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Settles chunk `i` (a chunk settles once; later calls are ignored).
    fn settle(&self, i: usize, state: ChunkState<E>) -> bool {
        let mut inner = self.lock();
        match inner.states.get(i) {
            Some(ChunkState::Pending) => {}
            _ => return false,
        }
        inner.states[i] = state;
        inner.pending -= 1;
        inner.settled.push(i);
        drop(inner);
        self.changed.notify_all();
        true
    }
}

/// Creates a handle over `places` and the sink its driver settles chunks through (the embedded
/// engine's drivers, and the remote client's).
pub fn chunk_pair<E: Clone + From<Error>>(places: Vec<ChunkPlace>) -> (ChunkHandle<E>, ChunkSink<E>) {
    let n = places.len();
    let chunks = Arc::new(Chunks {
        places,
        inner: Mutex::new(Inner {
            states: vec![ChunkState::Pending; n],
            pending: n,
            settled: Vec::with_capacity(n),
            polled: 0,
        }),
        changed: Condvar::new(),
        cancel: AtomicBool::new(false),
    });
    (ChunkHandle { chunks: Arc::clone(&chunks) }, ChunkSink { chunks })
}

/// The driver's side: settles chunks; every chunk still pending when it drops fails with
/// Cancelled (the driver stopped without it: the handle was dropped, or the driver failed).
pub struct ChunkSink<E: Clone + From<Error>> {
    chunks: Arc<Chunks<E>>,
}

impl<E: Clone + From<Error>> ChunkSink<E> {
    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.chunks.places.len()
    }

    /// True without chunks (never: every handle has at least one).
    pub fn is_empty(&self) -> bool {
        self.chunks.places.is_empty()
    }

    /// Where chunk `i` lands.
    pub fn place(&self, i: usize) -> &ChunkPlace {
        &self.chunks.places[i]
    }

    /// Chunk `i` landed.
    pub fn done(&self, i: usize) {
        self.chunks.settle(i, ChunkState::Done);
    }

    /// Chunk `i` failed.
    pub fn fail(&self, i: usize, error: E) {
        self.chunks.settle(i, ChunkState::Failed(error));
    }

    /// True once the handle was dropped: start nothing new.
    pub fn cancelled(&self) -> bool {
        self.chunks.cancel.load(Ordering::Acquire)
    }
}

impl<E: Clone + From<Error>> Drop for ChunkSink<E> {
    fn drop(&mut self) {
        let error = E::from(Error::Cancelled);
        for i in 0..self.chunks.places.len() {
            self.chunks.settle(i, ChunkState::Failed(error.clone()));
        }
    }
}

/// The handle of a progressive or streaming transfer: its chunks become usable one by one.
///
/// Chunk `i` covers `chunk_place(i)` of the destinations. A chunk is pending, then done or
/// failed, once. Every call that waits returns once its chunk settled; nothing waits on a chunk
/// forever, because a driver that stops fails every chunk it did not deliver.
///
/// Dropping the handle cancels what has not started and waits for nothing; the transfers in
/// flight finish in the background and only then give back their leases and credits. The
/// destinations of a dropped handle may still be written until those transfers finish: keep
/// them valid (the `'static` regions the calls take say so), or `wait_all` before dropping.
pub struct ChunkHandle<E: Clone = Error> {
    chunks: Arc<Chunks<E>>,
}

impl<E: Clone> std::fmt::Debug for ChunkHandle<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkHandle").field("chunks", &self.chunks.places.len()).finish()
    }
}

impl<E: Clone + From<Error>> ChunkHandle<E> {
    /// Cancels what has not started, as dropping the handle does, but keeps the handle: a caller
    /// that must know when its destinations are no longer written cancels, then `wait_all`s.
    pub fn cancel(&self) {
        self.chunks.cancel.store(true, Ordering::Release);
    }

    /// Number of chunks.
    pub fn num_chunks(&self) -> usize {
        self.chunks.places.len()
    }

    /// Byte range of chunk `i` in its destination buffer (`chunk_place` names the buffer).
    pub fn chunk_range(&self, i: usize) -> Option<Range<u64>> {
        self.chunks.places.get(i).map(|p| p.range.clone())
    }

    /// Destination buffer and byte range of chunk `i`.
    pub fn chunk_place(&self, i: usize) -> Option<&ChunkPlace> {
        self.chunks.places.get(i)
    }

    /// True once chunk `i` landed (false for a pending, failed or unknown chunk).
    pub fn is_chunk_ready(&self, i: usize) -> bool {
        matches!(self.chunks.lock().states.get(i), Some(ChunkState::Done))
    }

    /// Chunk `i`'s state now.
    pub fn chunk_state(&self, i: usize) -> Option<ChunkState<E>> {
        self.chunks.lock().states.get(i).cloned()
    }

    fn check_index(&self, i: usize) -> Result<(), E> {
        if i >= self.num_chunks() {
            return Err(E::from(Error::InvalidArgument(format!(
                "chunk {i} does not exist (the handle has {} chunks)",
                self.num_chunks()
            ))));
        }
        Ok(())
    }

    /// Blocks until chunk `i` settled: Ok once it landed, its error if it failed.
    pub fn wait_chunk(&self, i: usize) -> Result<(), E> {
        self.check_index(i)?;
        let mut inner = self.chunks.lock();
        loop {
            match &inner.states[i] {
                ChunkState::Pending => {}
                ChunkState::Done => return Ok(()),
                ChunkState::Failed(e) => return Err(e.clone()),
            }
            inner = self.chunks.changed.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// `wait_chunk` for at most `timeout_ms`: Ok(true) once it landed, Ok(false) when the time
    /// ran out with the chunk still pending, its error if it failed.
    pub fn wait_chunk_timeout(&self, i: usize, timeout_ms: u64) -> Result<bool, E> {
        self.check_index(i)?;
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let mut inner = self.chunks.lock();
        loop {
            match &inner.states[i] {
                ChunkState::Pending => {}
                ChunkState::Done => return Ok(true),
                ChunkState::Failed(e) => return Err(e.clone()),
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            inner = self.chunks.changed.wait_timeout(inner, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// The chunks that settled (landed or failed) since the last `poll`, in the order they
    /// settled; never blocks. `chunk_state` tells which failed.
    pub fn poll(&self) -> Vec<usize> {
        let mut inner = self.chunks.lock();
        let fresh = inner.settled[inner.polled..].to_vec();
        inner.polled = inner.settled.len();
        fresh
    }

    /// Blocks until every chunk settled: Ok when all landed, else the first failed chunk's
    /// error (in chunk order). Nothing of the transfer touches the destinations afterwards.
    pub fn wait_all(&self) -> Result<(), E> {
        let mut inner = self.chunks.lock();
        while inner.pending > 0 {
            inner = self.chunks.changed.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
        drop(inner);
        match self.status() {
            HandleStatus::Failed { error, .. } => Err(error),
            _ => Ok(()),
        }
    }

    /// The whole handle's state now.
    pub fn status(&self) -> HandleStatus<E> {
        let inner = self.chunks.lock();
        let total = inner.states.len();
        if inner.pending > 0 {
            let failed = inner.states.iter().filter(|s| matches!(s, ChunkState::Failed(_))).count();
            return HandleStatus::Pending { done: total - inner.pending - failed, failed, total };
        }
        match inner.states.iter().enumerate().find_map(|(i, s)| match s {
            ChunkState::Failed(e) => Some((i, e.clone())),
            _ => None,
        }) {
            Some((chunk, error)) => HandleStatus::Failed { chunk, error },
            None => HandleStatus::Done,
        }
    }

    /// A handle whose chunks are all settled already (the remote client's buffered results,
    /// calls refused before anything started).
    pub fn settled(places: Vec<ChunkPlace>, states: Vec<ChunkState<E>>) -> ChunkHandle<E> {
        let (handle, sink) = chunk_pair(places);
        for (i, state) in states.into_iter().enumerate() {
            match state {
                ChunkState::Done => sink.done(i),
                ChunkState::Failed(e) => sink.fail(i, e),
                ChunkState::Pending => {}
            }
        }
        handle
    }
}

impl<E: Clone> Drop for ChunkHandle<E> {
    fn drop(&mut self) {
        self.chunks.cancel.store(true, Ordering::Release);
    }
}

/// Cuts `len` bytes at `dst_offset` of `buffer` into chunks of at most `chunk_bytes`. An empty
/// range is one empty chunk, so every fragment has a chunk that reports its result.
/// Callers bound the count first (`chunk_count`); the arithmetic saturates.
pub fn cut(buffer: usize, dst_offset: u64, len: u64, chunk_bytes: u64) -> impl Iterator<Item = ChunkPlace> {
    let chunk_bytes = chunk_bytes.max(1);
    let n = chunk_count(len, chunk_bytes);
    let last = dst_offset.saturating_add(len);
    (0..n).map(move |c| {
        let start = dst_offset.saturating_add(c.saturating_mul(chunk_bytes));
        let end = start.saturating_add(chunk_bytes).min(last);
        ChunkPlace { buffer, range: start..end }
    })
}

/// Chunks of `len` bytes cut at `chunk_bytes` (an empty range is one chunk).
pub fn chunk_count(len: u64, chunk_bytes: u64) -> u64 {
    len.div_ceil(chunk_bytes.max(1)).max(1)
}

/// Most chunks one handle or progressive put has (a larger `chunk_bytes` covers more bytes).
pub const MAX_CHUNKS: u64 = 1 << 20;

/// `InvalidArgument` when `chunks` exceed `MAX_CHUNKS`.
pub fn check_chunk_count(chunks: u64) -> Result<(), Error> {
    if chunks > MAX_CHUNKS {
        return Err(Error::InvalidArgument(format!(
            "{chunks} chunks exceed the limit of {MAX_CHUNKS}; use a larger chunk_bytes"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(n: usize) -> Vec<ChunkPlace> {
        cut(0, 0, n as u64 * 10, 10).collect()
    }

    #[test]
    fn cutting_covers_the_range_and_gives_an_empty_range_one_chunk() {
        let chunks: Vec<_> = cut(2, 100, 25, 10).collect();
        assert_eq!(chunks.iter().map(|c| c.range.clone()).collect::<Vec<_>>(), vec![100..110, 110..120, 120..125]);
        assert!(chunks.iter().all(|c| c.buffer == 2));
        assert_eq!(cut(0, 7, 0, 10).map(|c| c.range).collect::<Vec<_>>(), vec![7..7]);
        assert_eq!(cut(0, 0, 10, 10).count(), 1);
        assert_eq!(cut(0, 0, 10, 0).count(), 10, "a zero chunk size is one byte");
    }

    #[test]
    fn a_settled_handle_answers_at_once() {
        let h: ChunkHandle = ChunkHandle::settled(
            places(3),
            vec![ChunkState::Done, ChunkState::Failed(Error::NotFound), ChunkState::Done],
        );
        assert!(h.is_chunk_ready(0) && !h.is_chunk_ready(1) && !h.is_chunk_ready(9));
        assert_eq!(h.wait_chunk(1), Err(Error::NotFound));
        assert_eq!(h.wait_chunk_timeout(2, 0), Ok(true));
        assert_eq!(h.wait_all(), Err(Error::NotFound));
        assert_eq!(h.status(), HandleStatus::Failed { chunk: 1, error: Error::NotFound });
        assert_eq!(h.poll(), vec![0, 1, 2]);
        assert!(h.poll().is_empty());
        assert!(matches!(h.wait_chunk(3), Err(Error::InvalidArgument(_))));
        assert_eq!(h.chunk_range(2), Some(20..30));
        assert_eq!(h.chunk_range(3), None);
    }

    #[test]
    fn a_chunk_settles_once_and_a_dropped_sink_fails_the_rest() {
        let (h, sink) = chunk_pair::<Error>(places(4));
        sink.done(1);
        sink.fail(1, Error::NotFound);
        assert!(h.is_chunk_ready(1), "a settled chunk does not change");
        assert_eq!(h.status(), HandleStatus::Pending { done: 1, failed: 0, total: 4 });
        sink.fail(2, Error::Io("disk".into()));
        drop(sink);
        assert_eq!(h.wait_chunk(0), Err(Error::Cancelled));
        assert_eq!(h.wait_chunk(2), Err(Error::Io("disk".into())));
        assert_eq!(h.wait_all(), Err(Error::Cancelled), "the first failed chunk in chunk order");
        assert_eq!(h.poll(), vec![1, 2, 0, 3]);
    }

    #[test]
    fn dropping_the_handle_tells_the_driver_and_moving_it_keeps_its_state() {
        let (h, sink) = chunk_pair::<Error>(places(2));
        sink.done(0);
        let moved = h;
        assert!(moved.is_chunk_ready(0) && !sink.cancelled());
        drop(moved);
        assert!(sink.cancelled());
    }

    #[test]
    fn waiters_on_several_threads_all_wake_for_landings_and_failures() {
        let (h, sink) = chunk_pair::<Error>(places(64));
        let h = Arc::new(h);
        std::thread::scope(|s| {
            let waiters: Vec<_> = (0..8)
                .map(|t| {
                    let h = Arc::clone(&h);
                    s.spawn(move || {
                        let mut seen = Vec::new();
                        for i in (t..64).step_by(3) {
                            seen.push((i, h.wait_chunk(i)));
                        }
                        let all = h.wait_all();
                        (seen, all)
                    })
                })
                .collect();
            let pollers: Vec<_> = (0..2)
                .map(|_| {
                    let h = Arc::clone(&h);
                    s.spawn(move || {
                        let mut got = Vec::new();
                        while got.len() < 64 {
                            let fresh = h.poll();
                            got.extend(fresh);
                            if !matches!(h.status(), HandleStatus::Pending { .. }) {
                                got.extend(h.poll());
                                break;
                            }
                            std::thread::yield_now();
                        }
                        got
                    })
                })
                .collect();
            for i in 0..64 {
                if i == 40 {
                    sink.fail(i, Error::Corrupted("chunk 40".into()));
                } else if i < 50 {
                    sink.done(i);
                }
                if i % 7 == 0 {
                    std::thread::yield_now();
                }
            }
            drop(sink);
            for w in waiters {
                let (seen, all) = w.join().expect("waiter");
                for (i, r) in seen {
                    match i {
                        40 => assert_eq!(r, Err(Error::Corrupted("chunk 40".into()))),
                        i if i < 50 => assert_eq!(r, Ok(()), "chunk {i}"),
                        _ => assert_eq!(r, Err(Error::Cancelled), "chunk {i}"),
                    }
                }
                assert_eq!(all, Err(Error::Corrupted("chunk 40".into())));
            }
            let mut polled: Vec<usize> = pollers.into_iter().flat_map(|p| p.join().expect("poller")).collect();
            polled.sort_unstable();
            assert_eq!(polled, (0..64).collect::<Vec<_>>(), "two pollers split the chunks, each once");
        });
    }

    #[test]
    fn a_timed_wait_times_out_on_a_pending_chunk() {
        let (h, sink) = chunk_pair::<Error>(places(1));
        assert_eq!(h.wait_chunk_timeout(0, 5), Ok(false));
        sink.done(0);
        assert_eq!(h.wait_chunk_timeout(0, 5), Ok(true));
    }
}
