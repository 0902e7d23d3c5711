//! Lending an idle shard's core to a caller. Owns the lock around a shard's core and which
//! requests a caller may handle on it itself: the write path's reserve and commit, and the
//! other requests that touch only the core (exists, locate, remove, pin, unpin). A write
//! then costs no thread hop while the shard has nothing else to do, and the shard's invariants
//! hold as before, because the core is only ever run by one thread at a time.
//! Never lends the core in the middle of the shard's turn, never while its inbox holds a
//! request (a lent request would overtake it), and never runs tasks or I/O on a caller's
//! thread: a caller that leaves the loop work pokes it.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use parking_lot::{ArcMutexGuard, Mutex, RawMutex};

use super::core::ShardCore;
use super::inbox::Inbox;
use super::Request;

/// A shard's core as the shard and the callers it lends it to share it. `None` before the
/// shard thread built its core and after it dropped it.
pub(crate) type CoreCell = Arc<Mutex<Option<LentCore>>>;

/// A new, empty cell.
pub(crate) fn new_cell() -> CoreCell {
    Arc::new(Mutex::new(None))
}

/// The core inside its lock.
pub(crate) struct LentCore(ShardCore);

// SAFETY: a `LentCore` is only reached through its mutex, so one thread at a time runs the
// core and the lock orders every access after the last. What is not `Send` in it (callbacks
// of shard tasks that share `Rc` cells with the task) is created, called and dropped only while
// the lock is held, and the task's own half only on the shard thread while it holds the lock;
// the core is dropped on the shard thread (`LoopCore::drop`).
unsafe impl Send for LentCore {}

/// The shard thread's hold on its core: held through each turn, let go while it yields or
/// parks (`LoopCore::unlocked`) so callers can be served meanwhile.
pub(crate) struct LoopCore {
    guard: ArcMutexGuard<RawMutex, Option<LentCore>>,
}

impl LoopCore {
    /// Puts `core` into `cell` and holds it.
    pub(crate) fn hold(cell: &CoreCell, core: ShardCore) -> LoopCore {
        let mut guard = cell.lock_arc();
        *guard = Some(LentCore(core));
        LoopCore { guard }
    }

    /// Runs `f` with the core let go; callers may be served until it returns.
    pub(crate) fn unlocked<U>(this: &mut LoopCore, f: impl FnOnce() -> U) -> U {
        ArcMutexGuard::unlocked(&mut this.guard, f)
    }
}

impl Deref for LoopCore {
    type Target = ShardCore;

    fn deref(&self) -> &ShardCore {
        match self.guard.as_ref() {
            Some(core) => &core.0,
            None => unreachable!("the core leaves its cell only when the loop's hold drops"),
        }
    }
}

impl DerefMut for LoopCore {
    fn deref_mut(&mut self) -> &mut ShardCore {
        match self.guard.as_mut() {
            Some(core) => &mut core.0,
            None => unreachable!("the core leaves its cell only when the loop's hold drops"),
        }
    }
}

impl Drop for LoopCore {
    fn drop(&mut self) {
        // Dropped here, on the shard thread (after its ring: `ShardLoop` declares it first).
        drop(self.guard.take());
    }
}

/// Whether a caller may handle `request` on a lent core: requests that only touch the core and
/// whose caller waits for the answer. Not tasks (the loop advances them), not reads that may
/// start loads or set lease deadlines (the loop's timers and I/O follow them), not barriers
/// (answered by the loop's own turn); releases and aborts go one way from drops, straight to
/// the inbox.
fn lendable(request: &Request) -> bool {
    matches!(
        request,
        Request::Reserve { .. }
            | Request::Commit { .. }
            | Request::Exists { .. }
            | Request::Locate { .. }
            | Request::Remove { .. }
            | Request::Pin { .. }
            | Request::Unpin { .. }
    )
}

/// Handles `request` on the caller's thread when the shard is between turns with an empty
/// inbox; gives it back otherwise (it is then sent). Its reply goes where the shard's would.
pub(crate) fn serve_on_caller(cell: &CoreCell, inbox: &Inbox, request: Request) -> Result<(), Request> {
    if !lendable(&request) {
        return Err(request);
    }
    match lend(cell, inbox) {
        Some(lent) => {
            lent.run(|core| Some(super::serve::serve(core, request)));
            Ok(())
        }
        None => Err(request),
    }
}

/// The core lent to this thread for one request, when the shard is between turns with an
/// empty inbox.
pub(crate) fn lend<'a>(cell: &'a CoreCell, inbox: &'a Inbox) -> Option<Lent<'a>> {
    let guard = cell.try_lock()?;
    // Checked under the lock: the shard only takes requests from its inbox while it holds it.
    if guard.is_none() || !inbox.is_idle() {
        return None;
    }
    Some(Lent { guard, inbox })
}

/// A shard's core held by a caller for one request.
pub(crate) struct Lent<'a> {
    guard: parking_lot::MutexGuard<'a, Option<LentCore>>,
    inbox: &'a Inbox,
}

impl Lent<'_> {
    /// Runs `work` (one request's worth of core calls that start no task and wait for nothing),
    /// lets the core go, and pokes the shard when `work` left it loop work. Counted as a request
    /// served by a caller when `work` answered it (Some); None leaves it to a message.
    pub(crate) fn run<R>(mut self, work: impl FnOnce(&mut ShardCore) -> Option<R>) -> Option<R> {
        let Some(LentCore(core)) = self.guard.as_mut() else {
            unreachable!("`lend` only lends a cell that holds a core")
        };
        core.begin_lent_request();
        // Until `work` returns: a panic in it poisons the shard (before the lock is let go).
        let armed = PoisonOnUnwind(self.inbox);
        let out = work(core);
        std::mem::forget(armed);
        if out.is_some() {
            core.counters().requests.fetch_add(1, Relaxed);
            core.counters().served_by_callers.fetch_add(1, Relaxed);
        }
        let wants_turn = core.wants_turn();
        drop(self.guard);
        if wants_turn {
            self.inbox.poke();
        }
        out
    }
}

/// Poisons the shard's inbox when dropped: dropped only while a lent request unwinds.
struct PoisonOnUnwind<'a>(&'a Inbox);

impl Drop for PoisonOnUnwind<'_> {
    fn drop(&mut self) {
        tracing::error!("a caller panicked while it ran a shard's core; the shard stops");
        self.0.poison();
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use kvtide_tiers::eviction::EvictionPolicy;

    use super::*;
    use crate::shard::core::tests::core;

    #[test]
    fn a_panic_on_a_lent_core_poisons_the_shard_and_a_return_does_not() {
        let cell = new_cell();
        let inbox = Inbox::new().expect("inbox");
        let mut hold = LoopCore::hold(&cell, core(8 << 20, EvictionPolicy::Lru));
        LoopCore::unlocked(&mut hold, || {
            let lent = lend(&cell, &inbox).expect("an idle shard lends its core");
            assert_eq!(lent.run(|_| Some(7)), Some(7));
            assert!(!inbox.is_poisoned(), "a step that returned poisons nothing");
            let lent = lend(&cell, &inbox).expect("lent again");
            let caught = catch_unwind(AssertUnwindSafe(|| lent.run(|_| -> Option<()> { panic!("a bug in the core") })));
            assert!(caught.is_err());
            assert!(inbox.is_poisoned());
            assert!(lend(&cell, &inbox).is_none(), "a poisoned shard lends its core no more");
        });
        assert!(inbox.send(Request::Release { leases: Vec::new() }).is_err(), "and takes no requests");
    }
}
