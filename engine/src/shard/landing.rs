//! How much of an object being loaded from SSD has arrived, for a reader that starts before the
//! load ends (progressive and streaming reads).
//!
//! Owns the checked front of one load as its shard reports it. Never reports value bytes the SSD
//! tier has not checked against the record's checksums, and never leaves a waiter waiting once
//! the load ended. Bytes reported stay readable after a later failure (the reader's lease keeps
//! the buffer); only what never arrived fails.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};

/// What a reader that cannot block is told when the load ended: where the value starts in the
/// record image, or why the load failed.
pub(crate) type OnEnd = Box<dyn FnOnce(Result<u64>) + Send>;

/// The front of one load, shared by its shard and the readers that lease it early.
#[derive(Debug, Default)]
pub struct Landing {
    state: Mutex<LandingState>,
    changed: Condvar,
}

#[derive(Default)]
struct LandingState {
    /// Where the value starts in the record image (known with the first checked bytes).
    value_offset: Option<u64>,
    /// Value bytes checked, from the start.
    ready: u64,
    /// Ok once every byte is ready; the error once the load failed.
    end: Option<Result<()>>,
    /// Told once the load ends (stream-bound reads open their gates from here).
    on_end: Vec<OnEnd>,
}

impl std::fmt::Debug for LandingState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LandingState")
            .field("value_offset", &self.value_offset)
            .field("ready", &self.ready)
            .field("end", &self.end)
            .field("on_end", &self.on_end.len())
            .finish()
    }
}

impl Landing {
    fn lock(&self) -> MutexGuard<'_, LandingState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The first `value_bytes` of the value (at `value_offset` in the record image) are good.
    pub(crate) fn advance(&self, value_offset: u64, value_bytes: u64) {
        let mut state = self.lock();
        if state.end.is_some() {
            return;
        }
        state.value_offset = Some(value_offset);
        state.ready = state.ready.max(value_bytes);
        drop(state);
        self.changed.notify_all();
    }

    /// The load ended: every byte of a `len`-byte value at `value_offset` is good, or it failed.
    pub(crate) fn finish(&self, result: Result<(u64, u64)>) {
        let mut state = self.lock();
        if state.end.is_some() {
            return;
        }
        state.end = Some(match result {
            Ok((value_offset, len)) => {
                state.value_offset = Some(value_offset);
                state.ready = len;
                Ok(())
            }
            Err(e) => Err(e),
        });
        let told = std::mem::take(&mut state.on_end);
        let outcome = Self::outcome(&state);
        drop(state);
        self.changed.notify_all();
        for tell in told {
            tell(outcome.clone());
        }
    }

    fn outcome(state: &LandingState) -> Result<u64> {
        match (&state.end, state.value_offset) {
            (Some(Ok(())), Some(offset)) => Ok(offset),
            (Some(Err(e)), _) => Err(e.clone()),
            _ => Err(Error::Internal("a finished load has no value offset")),
        }
    }

    /// How the load ended (where the value starts, or its error); None while it runs.
    pub(crate) fn outcome_now(&self) -> Option<Result<u64>> {
        let state = self.lock();
        state.end.as_ref().map(|_| Self::outcome(&state))
    }

    /// Calls `tell` once the load ended (at once when it has), with where the value starts or
    /// the load's error. It runs on the shard that finishes the load, so it must be quick.
    pub(crate) fn on_end(&self, tell: OnEnd) {
        let mut state = self.lock();
        if state.end.is_none() {
            state.on_end.push(tell);
            return;
        }
        let outcome = Self::outcome(&state);
        drop(state);
        tell(outcome);
    }

    /// The load ended (well or not).
    pub(crate) fn ended(&self) -> bool {
        self.lock().end.is_some()
    }

    /// Value bytes good so far.
    #[cfg(test)]
    pub fn ready_bytes(&self) -> u64 {
        self.lock().ready
    }

    /// Where the value starts (once known), the value bytes good so far, and how the load ended
    /// (None while it runs).
    #[cfg(test)]
    pub(crate) fn snapshot(&self) -> (Option<u64>, u64, Option<Result<()>>) {
        let state = self.lock();
        (state.value_offset, state.ready, state.end.clone())
    }

    /// Blocks until the value's first `end` bytes are good (returns where the value starts in
    /// the record image), the load failed before them (its error), or `cancelled()` says to stop
    /// (`Cancelled`), checking every `nap`.
    pub(crate) fn wait_ready(&self, end: u64, nap: Duration, cancelled: impl Fn() -> bool) -> Result<u64> {
        let mut state = self.lock();
        loop {
            if let (Some(offset), true) = (state.value_offset, state.ready >= end) {
                return Ok(offset);
            }
            match &state.end {
                Some(Err(e)) => return Err(e.clone()),
                Some(Ok(())) => return Err(Error::Internal("a finished load has no value offset")),
                None => {}
            }
            if cancelled() {
                return Err(Error::Cancelled);
            }
            state = self.changed.wait_timeout(state, nap).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        // A load dropped unfinished (its shard stopped): whoever waits for its end is told.
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for tell in std::mem::take(&mut state.on_end) {
            tell(Err(Error::ShuttingDown));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn waiters_see_the_front_grow_and_the_failure_only_past_it() {
        let landing = Arc::new(Landing::default());
        let nap = Duration::from_millis(5);
        let waiter = {
            let landing = Arc::clone(&landing);
            std::thread::spawn(move || landing.wait_ready(100, Duration::from_secs(5), || false))
        };
        landing.advance(4096, 50);
        landing.advance(4096, 150);
        assert_eq!(waiter.join().expect("waiter"), Ok(4096), "woken when the front passed its end");
        landing.finish(Err(Error::Corrupted("block 3".into())));
        assert_eq!(landing.wait_ready(150, nap, || false), Ok(4096), "checked bytes stay usable");
        assert_eq!(landing.wait_ready(151, nap, || false), Err(Error::Corrupted("block 3".into())));
        landing.advance(4096, 1000);
        assert_eq!(landing.ready_bytes(), 150, "nothing moves after the end");
        let idle = Landing::default();
        assert_eq!(idle.wait_ready(1, nap, || true), Err(Error::Cancelled));
        idle.finish(Ok((64, 10)));
        assert_eq!(idle.wait_ready(10, nap, || false), Ok(64));
    }

    #[test]
    fn end_callbacks_run_once_whether_registered_before_or_after_the_end() {
        let told = Arc::new(Mutex::new(Vec::new()));
        let tell = |told: &Arc<Mutex<Vec<Result<u64>>>>| -> OnEnd {
            let told = Arc::clone(told);
            Box::new(move |r| told.lock().expect("lock").push(r))
        };
        let landing = Landing::default();
        landing.on_end(tell(&told));
        landing.advance(64, 10);
        assert!(told.lock().expect("lock").is_empty(), "not before the end");
        landing.finish(Ok((64, 100)));
        landing.on_end(tell(&told));
        landing.finish(Err(Error::Io("late".into())));
        assert_eq!(*told.lock().expect("lock"), vec![Ok(64), Ok(64)]);
        let failed = Landing::default();
        failed.on_end(tell(&told));
        failed.finish(Err(Error::Io("EIO".into())));
        let dropped = Landing::default();
        dropped.on_end(tell(&told));
        drop(dropped);
        let got = told.lock().expect("lock").clone();
        assert_eq!(&got[2..], &[Err(Error::Io("EIO".into())), Err(Error::ShuttingDown)]);
    }
}
