//! Spreading one call's per-page host work over a few threads (`parallel::map_chunks`).
//!
//! Owns when a call's per-page passes (checking destination lists, planning pieces) are large
//! enough to split, and how: contiguous chunks of about equal page counts, one on the calling
//! thread and the rest on scoped threads, results concatenated in order. A staged GPU read of
//! 147,456 pages spends milliseconds on these passes before its first scatter can start, while
//! its bulk copies run into the staging buffer; split four ways that drops below the copies.
//! It never keeps a thread past the call, never splits a call under `MIN_PAGES_PER_THREAD`
//! pages a thread, and never changes a result: each chunk runs the same code the whole would.

use std::num::NonZeroUsize;
use std::sync::OnceLock;

/// Pages a thread must get before a split pays for starting it (a thread start costs about as
/// much as checking and planning a few thousand pages).
const MIN_PAGES_PER_THREAD: usize = 16_384;

/// At most this many threads work on one call, the caller's included.
const MAX_THREADS: usize = 4;

/// Threads one call may use: the machine's cores, at most `MAX_THREADS`.
fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get).clamp(1, MAX_THREADS))
}

/// Into how many chunks `pages` pages of work split on `threads` threads.
fn chunks_for(pages: usize, threads: usize) -> usize {
    (pages / MIN_PAGES_PER_THREAD).clamp(1, threads.max(1))
}

/// Cuts `items` into `chunks` contiguous ranges of about equal weight (`pages` of each item).
fn cut<T>(items: &[T], pages: &impl Fn(&T) -> usize, total: usize, chunks: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::with_capacity(chunks);
    let (mut start, mut seen) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        seen += pages(item);
        // Close a chunk once it holds its share of the pages seen so far.
        if out.len() + 1 < chunks && seen * chunks >= total * (out.len() + 1) {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    out.push(start..items.len());
    out
}

/// `work(chunk, offset)` over contiguous chunks of `items` (offset: the chunk's first index),
/// split over threads when their `pages` add up to enough; the chunks' outputs concatenated in
/// order, exactly what `work(items, 0)` would return.
pub(crate) fn map_chunks<T: Sync, R: Send>(
    items: &[T],
    pages: impl Fn(&T) -> usize,
    work: impl Fn(&[T], usize) -> Vec<R> + Sync,
) -> Vec<R> {
    let threads = threads();
    if threads < 2 || items.len() < 2 {
        return work(items, 0);
    }
    let total: usize = items.iter().map(&pages).sum();
    split(items, &pages, total, chunks_for(total, threads), &work)
}

fn split<T: Sync, R: Send>(
    items: &[T],
    pages: &impl Fn(&T) -> usize,
    total: usize,
    chunks: usize,
    work: &(impl Fn(&[T], usize) -> Vec<R> + Sync),
) -> Vec<R> {
    if chunks < 2 {
        return work(items, 0);
    }
    let ranges = cut(items, pages, total, chunks);
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranges[1..]
            .iter()
            .map(|range| {
                let range = range.clone();
                scope.spawn(move || work(&items[range.clone()], range.start))
            })
            .collect();
        let mut out = work(&items[ranges[0].clone()], 0);
        for handle in handles {
            match handle.join() {
                Ok(part) => out.extend(part),
                // A panic in `work` is a bug; carry it to the caller as if it ran there.
                Err(payload) => std::panic::resume_unwind(payload),
            }
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_item_once_in_order_with_about_equal_pages() {
        let items: Vec<usize> = (0..1000).map(|i| 1 + (i * 7919) % 97).collect();
        let total: usize = items.iter().sum();
        for chunks in 1..=6 {
            let ranges = cut(&items, &|&p| p, total, chunks);
            assert_eq!(ranges.len(), chunks);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[chunks - 1].end, items.len());
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            for r in &ranges {
                let share: usize = items[r.clone()].iter().sum();
                assert!(share.abs_diff(total / chunks) <= 97, "{chunks} chunks: {share} of {total}");
            }
        }
    }

    #[test]
    fn a_split_returns_what_one_pass_returns() {
        let items: Vec<u64> = (0..50_000).collect();
        let work = |chunk: &[u64], offset: usize| -> Vec<(usize, u64)> {
            chunk.iter().enumerate().map(|(i, v)| (offset + i, v * 3)).collect()
        };
        let whole = work(&items, 0);
        for chunks in [1, 2, 3, 4] {
            assert_eq!(split(&items, &|_| 1, items.len(), chunks, &work), whole, "{chunks} chunks");
        }
        assert_eq!(map_chunks(&items, |_| 1, work), whole);
        assert_eq!(chunks_for(1000, 4), 1);
        assert_eq!(chunks_for(3 * MIN_PAGES_PER_THREAD, 4), 3);
        assert_eq!(chunks_for(100 * MIN_PAGES_PER_THREAD, 4), 4);
        assert_eq!(chunks_for(100 * MIN_PAGES_PER_THREAD, 1), 1);
    }
}
