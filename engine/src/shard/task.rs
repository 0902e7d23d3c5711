//! Work a shard advances a bounded slice at a time between other work.
//!
//! Owns the task trait the shard loop drives (`ShardTask`) and what one poll reports
//! (`TaskPoll`). Never knows what a task does: the tasks themselves (the async batch read, a
//! stream-bound watch) live with the engine above.

use super::core::ShardCore;

/// What one poll of a task did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TaskPoll {
    /// Done: results reported, everything it held released.
    Finished,
    /// Moved forward; poll again soon.
    Progressed,
    /// Waiting for something that wakes the shard (an SSD load, a message); nothing to do now.
    Waiting,
    /// Waiting for something that does not wake the shard (an asynchronous transport's
    /// completion, a CUDA event): the loop keeps polling (yielding between turns) instead of
    /// parking.
    Polling,
}

/// Something the shard loop drives until it is finished.
pub(crate) trait ShardTask: Send {
    /// Called once, on the shard, when the task arrives.
    fn start(&mut self, core: &mut ShardCore);
    /// Advances, spending at most `budget_bytes` of copying.
    fn poll(&mut self, core: &mut ShardCore, budget_bytes: &mut u64) -> TaskPoll;
    /// True when a shard that is stopping may drop the task instead of waiting for it to
    /// finish (its drop then finishes it: a stream-bound watch waits for its stream there).
    fn dropped_at_shutdown(&self) -> bool {
        false
    }
}
