//! The async batch read (`batch_get_into_multi_buffers`) as a task one shard drives.
//!
//! Owns the task: the shard leases the objects, plans them with the read path's planner and
//! delivers them through the transports the engine chose: CPU copies in bounded slices so no
//! single request stalls the loop, asynchronous transports (GPU) in one submission per round
//! whose completion the loop polls. It honours cancellation between slices (a submitted
//! asynchronous round runs to completion) and never leaves a lease it took unreleased, whatever
//! happened.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvtide_transport::{Direction, InFlight, Region, Transfer};

use super::gpu::GpuCounters;
use super::read::{plan_pieces, Want};
use super::transports::{Route, Transports};
use crate::error::{Error, Result};
use crate::shard::task::{ShardTask, TaskPoll};
use crate::shard::{ReadGrant, ShardCore};
use crate::ticket::BatchCollector;

/// Where the core drops a batch's grants once every key is leased.
type GrantCell = Rc<RefCell<Option<Vec<Result<ReadGrant>>>>>;

/// One key of an async batch read.
pub(crate) struct BatchGetItem {
    pub(crate) result_index: usize,
    pub(crate) key: Box<[u8]>,
    pub(crate) dsts: Vec<Region<'static>>,
    pub(crate) route: Route,
}

struct ItemState {
    item: BatchGetItem,
    grant: Option<ReadGrant>,
    /// Bytes still to arrive.
    bytes_left: u64,
    result: Option<Result<usize>>,
}

/// Planned transfers of one route, not yet submitted, and the item of each.
struct RouteBatch {
    route: Route,
    owners: Vec<usize>,
    transfers: Vec<Transfer>,
}

/// An asynchronous round's submission and the item of each of its transfers.
struct Submitted {
    inflight: InFlight,
    owners: Vec<usize>,
    route: Route,
}

/// Async `batch_get_into_multi_buffers` for the keys of one shard.
pub(crate) struct BatchGetTask {
    items: Vec<ItemState>,
    cancel: Arc<AtomicBool>,
    collector: Arc<BatchCollector>,
    transports: Transports,
    gpu_counters: Arc<GpuCounters>,
    /// Filled by the core once every key of the round is leased (SSD keys after their loads).
    grants: Option<GrantCell>,
    /// Items leased in the current round, in request order.
    round: Vec<usize>,
    /// Items refused with NoSpace this round (the batch did not fit in DRAM at once).
    retry: Vec<usize>,
    delivered_this_round: usize,
    /// Planned transfers for inline transports, copied a budget at a time: (item, transfer).
    inline: VecDeque<(usize, Transfer)>,
    /// Planned transfers for asynchronous transports, per route, not yet submitted.
    deferred: Vec<RouteBatch>,
    in_flight: Option<Submitted>,
}

// SAFETY: the Rc is created in `start` on the shard thread. Afterwards the task's clone is only
// touched on the shard thread, and the clone in the core's callback only under the core's lock
// (by the shard, or a caller the shard lends its core to, `lend`), which the shard also holds
// while it polls tasks: no two threads ever touch the Rc at once, and the lock orders them.
// Before `start` the task holds no Rc (grants is None), so moving it across threads is sound.
unsafe impl Send for BatchGetTask {}

impl BatchGetTask {
    pub(crate) fn new(
        items: Vec<BatchGetItem>,
        cancel: Arc<AtomicBool>,
        collector: Arc<BatchCollector>,
        transports: Transports,
        gpu_counters: Arc<GpuCounters>,
    ) -> Self {
        let items =
            items.into_iter().map(|item| ItemState { item, grant: None, bytes_left: 0, result: None }).collect();
        BatchGetTask {
            items,
            cancel,
            collector,
            transports,
            gpu_counters,
            grants: None,
            round: Vec::new(),
            retry: Vec::new(),
            delivered_this_round: 0,
            inline: VecDeque::new(),
            deferred: Vec::new(),
            in_flight: None,
        }
    }

    /// Leases `items` as one batch; their grants arrive in `self.grants`.
    fn lease_round(&mut self, core: &mut ShardCore, items: Vec<usize>) {
        let cell = Rc::new(RefCell::new(None));
        let sink = Rc::clone(&cell);
        let keys = items.iter().map(|&i| self.items[i].item.key.clone()).collect();
        self.grants = Some(cell);
        self.round = items;
        self.delivered_this_round = 0;
        core.lease_read_batch(keys, None, false, Box::new(move |grants| *sink.borrow_mut() = Some(grants)));
    }

    /// Takes the round's grants and plans each leased item (the read path's planner).
    fn plan_round(&mut self, core: &mut ShardCore, grants: Vec<Result<ReadGrant>>) {
        let mut deferred: Vec<RouteBatch> = Vec::new();
        for (&index, grant) in self.round.iter().zip(grants) {
            let state = &mut self.items[index];
            let grant = match grant {
                Err(Error::NoSpace) => {
                    self.retry.push(index);
                    continue;
                }
                Err(e) => {
                    state.result = Some(Err(e));
                    continue;
                }
                Ok(grant) => grant,
            };
            let pieces = match plan_pieces(grant.len, &state.item.dsts, Want::Whole) {
                Ok((pieces, _)) => pieces,
                Err(e) => {
                    core.release(grant.lease);
                    state.result = Some(Err(e));
                    continue;
                }
            };
            if grant.len == 0 {
                core.release(grant.lease);
                state.result = Some(Ok(0));
                self.delivered_this_round += 1;
                continue;
            }
            let transfer = Transfer { host: grant.ptr.as_ptr() as u64, host_len: grant.len, pieces };
            state.bytes_left = grant.len;
            state.grant = Some(grant);
            let route = state.item.route;
            if self.transports.get(route).completes_inline() {
                self.inline.push_back((index, transfer));
            } else {
                match deferred.iter_mut().find(|b| b.route == route) {
                    Some(batch) => {
                        batch.owners.push(index);
                        batch.transfers.push(transfer);
                    }
                    None => deferred.push(RouteBatch { route, owners: vec![index], transfers: vec![transfer] }),
                }
            }
        }
        self.deferred = deferred;
    }

    /// Ends an item: its lease goes back and its result is set.
    fn settle(&mut self, core: &mut ShardCore, index: usize, result: Result<()>) {
        let state = &mut self.items[index];
        let Some(grant) = state.grant.take() else { return };
        core.release(grant.lease);
        state.result = Some(result.map(|()| grant.len as usize));
        if state.result.as_ref().is_some_and(|r| r.is_ok()) {
            self.delivered_this_round += 1;
        }
    }

    /// Advances the round's asynchronous submission: submits it (unless cancelled first), then
    /// polls it. Some while it is not over.
    fn poll_async(&mut self, core: &mut ShardCore) -> Option<TaskPoll> {
        if self.in_flight.is_none() {
            let RouteBatch { route, owners, transfers } = self.deferred.pop()?;
            if self.cancel.load(Ordering::Acquire) {
                // Nothing of it submitted: stop here; every undelivered key reports Cancelled.
                self.finish(core);
                return Some(TaskPoll::Finished);
            }
            // SAFETY: every transfer's host bytes are leased by this task and stay leased until
            // the submission completed (`poll` true; dropping an unfinished `InFlight` waits for
            // it too). The destinations passed the transport's checks when the ticket was made,
            // and the submitter's `Region::from_raw` contract keeps them valid until the ticket
            // completes.
            match unsafe { self.transports.get(route).submit(Direction::HostToDevice, &transfers, None) } {
                Ok(inflight) => self.in_flight = Some(Submitted { inflight, owners, route }),
                Err(e) => {
                    if route == Route::Gpu {
                        self.gpu_counters.record(None, Direction::HostToDevice, owners.len() as u64);
                    }
                    let error: Error = e.into();
                    for index in owners {
                        self.settle(core, index, Err(error.clone()));
                    }
                    return Some(TaskPoll::Progressed);
                }
            }
        }
        let submitted = self.in_flight.as_mut()?;
        // Cancellation no longer matters: once submitted, the copies run to completion.
        if !submitted.inflight.poll() {
            return Some(TaskPoll::Polling);
        }
        let Submitted { mut inflight, owners, route } = self.in_flight.take()?;
        let results = inflight.take_results();
        let failed = results.iter().filter(|r| r.is_err()).count() as u64;
        if route == Route::Gpu {
            self.gpu_counters.record(Some(&inflight.summary()), Direction::HostToDevice, failed);
        }
        for (index, result) in owners.into_iter().zip(results) {
            self.settle(core, index, result.map_err(Error::from));
        }
        Some(TaskPoll::Progressed)
    }

    /// Copies planned inline transfers until the budget is spent. Some(Finished) when it was
    /// cancelled.
    fn copy_inline(&mut self, core: &mut ShardCore, budget_bytes: &mut u64) -> Option<TaskPoll> {
        while let Some((index, transfer)) = self.inline.pop_front() {
            if self.cancel.load(Ordering::Acquire) {
                // Everything not yet delivered (including a half-copied key) stays an error.
                self.inline.clear();
                self.finish(core);
                return Some(TaskPoll::Finished);
            }
            if *budget_bytes == 0 {
                self.inline.push_front((index, transfer));
                return Some(TaskPoll::Progressed);
            }
            let mut parts = transfer.split(*budget_bytes).into_iter();
            let Some(now) = parts.next() else { continue };
            let rest: Vec<Transfer> = parts.collect();
            if !rest.is_empty() {
                // One transfer of the remainder: its pieces stay in order.
                let pieces = rest.into_iter().flat_map(|t| t.pieces).collect();
                self.inline.push_front((index, Transfer { host: now.host, host_len: now.host_len, pieces }));
            }
            let bytes = now.bytes();
            let route = self.items[index].item.route;
            // SAFETY: the transfer's host bytes are leased by this task until `settle`; its
            // destinations passed the transport's checks and are 'static memory the submitter
            // handed over. An inline transport has completed before `submit` returns.
            let outcome = match unsafe { self.transports.get(route).submit(Direction::HostToDevice, &[now], None) } {
                Ok(inflight) => match inflight.wait().pop() {
                    Some(result) => result.map_err(Error::from),
                    None => Err(Error::Internal("an inline transfer gave no result")),
                },
                Err(e) => Err(e.into()),
            };
            *budget_bytes = budget_bytes.saturating_sub(bytes);
            match outcome {
                Ok(()) => {
                    let state = &mut self.items[index];
                    state.bytes_left = state.bytes_left.saturating_sub(bytes);
                    if state.bytes_left == 0 {
                        self.settle(core, index, Ok(()));
                    }
                }
                Err(e) => {
                    self.inline.retain(|(i, _)| *i != index);
                    self.settle(core, index, Err(e));
                }
            }
        }
        None
    }

    fn finish(&mut self, core: &mut ShardCore) {
        let mut part = Vec::with_capacity(self.items.len());
        for state in &mut self.items {
            if let Some(grant) = state.grant.take() {
                core.release(grant.lease);
            }
            let result = state.result.take().unwrap_or(Err(Error::Cancelled));
            part.push((state.item.result_index, result));
        }
        self.collector.complete_part(part);
    }
}

impl ShardTask for BatchGetTask {
    fn start(&mut self, core: &mut ShardCore) {
        let all = (0..self.items.len()).collect();
        self.lease_round(core, all);
    }

    fn poll(&mut self, core: &mut ShardCore, budget_bytes: &mut u64) -> TaskPoll {
        if let Some(cell) = &self.grants {
            let Some(grants) = cell.borrow_mut().take() else { return TaskPoll::Waiting };
            self.grants = None;
            self.plan_round(core, grants);
        }
        if let Some(poll) = self.poll_async(core) {
            if poll != TaskPoll::Progressed {
                return poll;
            }
            if self.in_flight.is_some() || !self.deferred.is_empty() {
                return TaskPoll::Progressed;
            }
        }
        if let Some(poll) = self.copy_inline(core, budget_bytes) {
            return poll;
        }
        // Keys that did not fit in DRAM with the rest get another round now that this round's
        // leases are released, as long as rounds keep delivering.
        let retry = std::mem::take(&mut self.retry);
        if !retry.is_empty() && self.delivered_this_round > 0 && !self.cancel.load(Ordering::Acquire) {
            self.lease_round(core, retry);
            return TaskPoll::Progressed;
        }
        for index in retry {
            self.items[index].result = Some(Err(Error::NoSpace));
        }
        self.finish(core);
        TaskPoll::Finished
    }
}
