//! Work a shard advances a bounded slice at a time between other work.
//!
//! Owns the async batch read: the shard leases the objects, copies them into the caller's
//! destinations in bounded slices so no single request stalls the loop, honours cancellation
//! between slices and releases every lease it took, whatever happened.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvtide_transport::Region;

use super::core::{ReadGrant, ShardCore};
use crate::error::{Error, Result};
use crate::ticket::BatchCollector;

/// What one poll of a task did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TaskPoll {
    /// Done: results reported, everything it held released.
    Finished,
    /// Moved forward; poll again soon.
    Progressed,
    /// Waiting for something that wakes the shard (an SSD load, a message); nothing to do now.
    Waiting,
    /// Waiting for something that does not wake the shard (a CUDA event): the loop keeps
    /// polling (yielding between turns) instead of parking. Only GPU tickets (feature `cuda`)
    /// return it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Polling,
}

/// Something the shard loop drives until it is finished.
pub(crate) trait ShardTask: Send {
    /// Called once, on the shard, when the task arrives.
    fn start(&mut self, core: &mut ShardCore);
    /// Advances, spending at most `budget_bytes` of copying.
    fn poll(&mut self, core: &mut ShardCore, budget_bytes: &mut u64) -> TaskPoll;
}

/// How an async batch reaches GPU memory (feature `cuda`): built by the engine once the device
/// pointers were checked. The task submits a round's copies with it on engine-owned streams and
/// polls their CUDA events from the shard loop (`TaskPoll::Polling`), holding the leases until
/// the events fired.
#[cfg(feature = "cuda")]
#[derive(Clone)]
pub(crate) struct GpuCopier {
    pub(crate) transport: Arc<kvtide_transport::cuda::CudaTransport>,
    pub(crate) policy: kvtide_transport::cuda::plan::StagingPolicy,
    /// Called once per round: what was submitted (None: the submission failed) and how many keys
    /// failed.
    #[allow(clippy::type_complexity)]
    pub(crate) report: Arc<dyn Fn(Option<&kvtide_transport::cuda::Summary>, u64) + Send + Sync>,
}

/// A round's GPU submission: the copies in flight and, per transfer, the item it delivers.
#[cfg(feature = "cuda")]
struct GpuRound {
    inflight: kvtide_transport::cuda::InFlight,
    owners: Vec<usize>,
}

/// Where the core drops a batch's grants once every key is leased.
type GrantCell = Rc<RefCell<Option<Vec<Result<ReadGrant>>>>>;

/// One key of an async batch read.
pub(crate) struct BatchGetItem {
    pub(crate) result_index: usize,
    pub(crate) key: Box<[u8]>,
    pub(crate) dsts: Vec<Region<'static>>,
}

struct ItemState {
    item: BatchGetItem,
    grant: Option<ReadGrant>,
    copied_bytes: u64,
    result: Option<Result<usize>>,
}

/// Async `batch_get_into_multi_buffers` for the keys of one shard.
pub(crate) struct BatchGetTask {
    items: Vec<ItemState>,
    cursor: usize,
    cancel: Arc<AtomicBool>,
    collector: Arc<BatchCollector>,
    /// Filled by the core once every key of the round is leased (SSD keys after their loads).
    grants: Option<GrantCell>,
    /// Items leased in the current round, in request order.
    round: Vec<usize>,
    /// Items refused with NoSpace this round (the batch did not fit in DRAM at once).
    retry: Vec<usize>,
    delivered_this_round: usize,
    /// Set when some destination is GPU memory: rounds go through the CUDA transport.
    #[cfg(feature = "cuda")]
    gpu: Option<GpuCopier>,
    #[cfg(feature = "cuda")]
    in_flight: Option<GpuRound>,
}

// SAFETY: the Rc is created in `start` on the shard thread and only touched there afterwards;
// before `start` the task holds no Rc (grants is None), so moving it across threads is sound.
unsafe impl Send for BatchGetTask {}

impl BatchGetTask {
    pub(crate) fn new(items: Vec<BatchGetItem>, cancel: Arc<AtomicBool>, collector: Arc<BatchCollector>) -> Self {
        let items =
            items.into_iter().map(|item| ItemState { item, grant: None, copied_bytes: 0, result: None }).collect();
        BatchGetTask {
            items,
            cursor: 0,
            cancel,
            collector,
            grants: None,
            round: Vec::new(),
            retry: Vec::new(),
            delivered_this_round: 0,
            #[cfg(feature = "cuda")]
            gpu: None,
            #[cfg(feature = "cuda")]
            in_flight: None,
        }
    }

    /// Sends this task's rounds through the CUDA transport when some destination is GPU memory.
    #[cfg(feature = "cuda")]
    pub(crate) fn with_gpu(mut self, copier: Option<GpuCopier>) -> Self {
        let device = self
            .items
            .iter()
            .flat_map(|s| &s.item.dsts)
            .any(|r| matches!(r.kind(), kvtide_transport::MemoryKind::Device { .. }));
        if device {
            self.gpu = copier;
        }
        self
    }

    /// Runs the current round on the GPU: submits every leased key's copies at once (unless
    /// cancelled first), then polls the events. Returns `Some` while the round is not over;
    /// `None` once every key of the round has its result and its lease back.
    #[cfg(feature = "cuda")]
    fn poll_gpu(&mut self, core: &mut ShardCore) -> Option<TaskPoll> {
        use kvtide_transport::cuda::plan::{Direction, Piece, Transfer};
        let copier = self.gpu.clone()?;
        if self.in_flight.is_none() {
            if self.cursor >= self.round.len() {
                return None;
            }
            if self.cancel.load(Ordering::Acquire) {
                // Nothing submitted yet: stop here; every undelivered key reports Cancelled.
                self.finish(core);
                return Some(TaskPoll::Finished);
            }
            let mut transfers = Vec::with_capacity(self.round.len());
            let mut owners = Vec::with_capacity(self.round.len());
            for &index in &self.round {
                let state = &self.items[index];
                let Some(grant) = state.grant else { continue };
                let mut offset = 0;
                let pieces = state
                    .item
                    .dsts
                    .iter()
                    .map(|r| {
                        let piece = Piece { host_offset: offset, addr: r.addr(), len: r.len() as u64, kind: r.kind() };
                        offset += r.len() as u64;
                        piece
                    })
                    .collect();
                transfers.push(Transfer { host: grant.ptr.as_ptr() as u64, host_len: grant.len, pieces });
                owners.push(index);
            }
            self.cursor = self.round.len();
            if transfers.is_empty() {
                return None;
            }
            // SAFETY: every transfer's host bytes are leased by this task and stay leased until
            // the round's events fired (or the streams were drained after a failure: `poll`
            // returns true only then; dropping an unfinished `InFlight` drains too). The device
            // pages were checked with cuPointerGetAttributes by the engine before the ticket was
            // made, and the submitter's `Region::from_raw` contract keeps every destination
            // valid until the ticket completes.
            match unsafe {
                kvtide_transport::cuda::submit(&copier.transport, Direction::HostToDevice, &transfers, copier.policy)
            } {
                Ok(inflight) => self.in_flight = Some(GpuRound { inflight, owners }),
                Err(e) => {
                    let error: Error = e.into();
                    (copier.report)(None, owners.len() as u64);
                    for index in owners {
                        let state = &mut self.items[index];
                        if let Some(grant) = state.grant.take() {
                            core.release(grant.lease);
                        }
                        state.result = Some(Err(error.clone()));
                    }
                    return None;
                }
            }
        }
        let round = self.in_flight.as_mut()?;
        // Cancellation no longer matters: once submitted, the copies run to their events.
        if !round.inflight.poll() {
            return Some(TaskPoll::Polling);
        }
        let GpuRound { mut inflight, owners } = self.in_flight.take()?;
        let results = inflight.take_results();
        let mut failed = 0;
        for (index, result) in owners.into_iter().zip(results) {
            let state = &mut self.items[index];
            let Some(grant) = state.grant.take() else { continue };
            // The events fired (or the streams were drained): the lease can go.
            core.release(grant.lease);
            state.result = Some(match result {
                Ok(()) => {
                    state.copied_bytes = grant.len;
                    self.delivered_this_round += 1;
                    Ok(grant.len as usize)
                }
                Err(e) => {
                    failed += 1;
                    Err(e.into())
                }
            });
        }
        (copier.report)(Some(inflight.summary()), failed);
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

impl BatchGetTask {
    /// Leases `items` as one batch; their grants arrive in `self.grants`.
    fn lease_round(&mut self, core: &mut ShardCore, items: Vec<usize>) {
        let cell = Rc::new(RefCell::new(None));
        let sink = Rc::clone(&cell);
        let keys = items.iter().map(|&i| self.items[i].item.key.clone()).collect();
        self.grants = Some(cell);
        self.round = items;
        self.cursor = 0;
        self.delivered_this_round = 0;
        core.lease_read_batch(keys, None, Box::new(move |grants| *sink.borrow_mut() = Some(grants)));
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
            for (&index, grant) in self.round.iter().zip(grants) {
                let state = &mut self.items[index];
                match grant {
                    Err(Error::NoSpace) => self.retry.push(index),
                    Ok(grant) => {
                        let dst_bytes = state.item.dsts.iter().map(|d| d.len() as u64).sum::<u64>();
                        if dst_bytes != grant.len {
                            core.release(grant.lease);
                            state.result = Some(Err(Error::SizeMismatch {
                                object_bytes: grant.len,
                                destination_bytes: dst_bytes,
                            }));
                        } else {
                            state.grant = Some(grant);
                        }
                    }
                    Err(e) => state.result = Some(Err(e)),
                }
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(poll) = self.poll_gpu(core) {
            return poll;
        }
        while self.cursor < self.round.len() {
            if self.cancel.load(Ordering::Acquire) {
                // Everything not yet delivered (including a half-copied key) stays an error.
                self.finish(core);
                return TaskPoll::Finished;
            }
            let state = &mut self.items[self.round[self.cursor]];
            let Some(grant) = state.grant else {
                self.cursor += 1;
                continue;
            };
            if *budget_bytes == 0 {
                return TaskPoll::Progressed;
            }
            // Copy the next piece: walk the destinations to the one holding `copied_bytes`.
            let mut dst_start = 0u64;
            for dst in &state.item.dsts {
                let dst_len = dst.len() as u64;
                if state.copied_bytes < dst_start + dst_len && *budget_bytes > 0 {
                    let within = state.copied_bytes - dst_start;
                    let n = (dst_len - within).min(*budget_bytes);
                    // SAFETY: the lease keeps `grant.ptr[..grant.len]` in place; copied_bytes + n
                    // <= grant.len because the destinations add up to grant.len (checked at start)
                    // and the destination region is 'static memory the submitter handed over.
                    let copied = unsafe {
                        let src = Region::from_raw(
                            grant.ptr.as_ptr() as u64,
                            grant.len as usize,
                            kvtide_transport::MemoryKind::Host,
                        );
                        kvtide_transport::copy_regions(&src, state.copied_bytes, dst, within, n)
                    };
                    if let Err(e) = copied {
                        state.result = Some(Err(e.into()));
                        core.release(grant.lease);
                        state.grant = None;
                        break;
                    }
                    state.copied_bytes += n;
                    *budget_bytes -= n;
                }
                dst_start += dst_len;
            }
            if state.grant.is_some() && state.copied_bytes == grant.len {
                core.release(grant.lease);
                state.grant = None;
                state.result = Some(Ok(grant.len as usize));
                self.delivered_this_round += 1;
            }
            if state.grant.is_none() {
                self.cursor += 1;
            }
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
