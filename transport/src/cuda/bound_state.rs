//! The per-GPU state of stream-bound reads (`cuda::bound`): staging units bound to callers'
//! streams, and gate words.
//!
//! Owns, per GPU, the stream-bound staging units and the gate words. A unit is bound to one
//! stream while reads on it are in flight and shared by all of them: the stream runs their
//! copies and kernels in order, so a later read may reuse the buffer and the row ring at once.
//! A gate is a word of mapped pinned host memory a stream waits on before the copies of an
//! object still loading. A unit goes back to the idle units when its last share drops, a gate
//! word to the free words when its gate drops. It never enqueues work on a stream: `bound` does.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::driver::{alloc_mapped_host, check, Context};
use super::plan::Descriptor;
use crate::stream::{Gate, StreamHandle};
use crate::TransportError;

/// Gate word values: closed, the load landed, the load failed.
const GATE_CLOSED: u32 = 0;
pub(crate) const GATE_OK: u32 = 1;
const GATE_FAILED: u32 = 2;
/// Gate words per pinned block.
const GATES_PER_BLOCK: usize = 1024;
/// Gate blocks per GPU at most (gates are held only while a read waits on a load).
const MAX_GATE_BLOCKS: usize = 64;
/// The stream-bound staging pool of a store: how many units per GPU and how large.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamStaging {
    /// Units per GPU (0: stream-bound reads always copy directly).
    pub units: u32,
    /// Device buffer of each unit.
    pub unit_bytes: u64,
}

impl StreamStaging {
    /// Row-table entries of a unit: enough for 512-byte pages filling its buffer.
    fn rows_capacity(self) -> usize {
        (self.unit_bytes / 512).clamp(4096, 1 << 20) as usize
    }
}

/// One stream-bound staging unit: its device buffer and its row ring (mapped pinned host
/// memory the scatter kernels read in place). Each fill takes a contiguous run of the ring,
/// given back once the submission that enqueued it completed.
struct StreamUnit {
    buffer: sys::CUdeviceptr,
    bytes: u64,
    rows_host: *mut Descriptor,
    rows_device: sys::CUdeviceptr,
    rows_capacity: usize,
    /// Runs in use, oldest first: (owner submission, start, len, released).
    runs: std::collections::VecDeque<(u64, usize, usize, bool)>,
    next_row: usize,
}

// SAFETY: raw addresses owned by the pool; every use is ordered on the bound stream or behind
// the pool's mutex.
unsafe impl Send for StreamUnit {}

impl StreamUnit {
    /// A run of `n` rows for submission `owner`, or None when the ring has no room now.
    fn take_rows(&mut self, owner: u64, n: usize) -> Option<usize> {
        if n == 0 || n > self.rows_capacity {
            return None;
        }
        let start = match self.runs.front() {
            None => 0,
            Some(&(_, oldest, _, _)) => {
                let head = self.next_row;
                if head > oldest {
                    if head + n <= self.rows_capacity {
                        head
                    } else if n <= oldest {
                        0
                    } else {
                        return None;
                    }
                } else if head + n <= oldest {
                    head
                } else {
                    return None;
                }
            }
        };
        self.runs.push_back((owner, start, n, false));
        self.next_row = start + n;
        Some(start)
    }

    /// Gives back the runs of submission `owner` (reclaimed once the older runs are back too).
    fn release(&mut self, owner: u64) {
        for run in self.runs.iter_mut().filter(|r| r.0 == owner) {
            run.3 = true;
        }
        while self.runs.front().is_some_and(|r| r.3) {
            self.runs.pop_front();
        }
        if self.runs.is_empty() {
            self.next_row = 0;
        }
    }
}

/// A unit bound to a stream, and the submissions on that stream that share it.
struct BoundUnit {
    stream: StreamHandle,
    unit: StreamUnit,
    users: usize,
}

/// A GPU's stream-bound staging units.
#[derive(Default)]
struct StreamUnits {
    idle: Vec<StreamUnit>,
    bound: Vec<BoundUnit>,
    made: u32,
    next_owner: u64,
}

/// A submission's share of the unit bound to its stream; the last share gives the unit back.
pub(crate) struct UnitShare {
    units: Arc<Mutex<StreamUnits>>,
    stream: StreamHandle,
    owner: u64,
    pub(crate) buffer: sys::CUdeviceptr,
    pub(crate) bytes: u64,
}

// SAFETY: a device address and ids; the pool is behind its mutex.
unsafe impl Send for UnitShare {}

impl UnitShare {
    /// A run of `n` rows of the unit's ring: (host address, device address) of its first row.
    pub(crate) fn take_rows(&self, n: usize) -> Option<(*mut Descriptor, sys::CUdeviceptr)> {
        let mut units = self.units.lock().unwrap_or_else(|p| p.into_inner());
        let bound = units.bound.iter_mut().find(|b| b.stream == self.stream)?;
        let start = bound.unit.take_rows(self.owner, n)?;
        let host = bound.unit.rows_host.wrapping_add(start);
        let device = bound.unit.rows_device + (start * std::mem::size_of::<Descriptor>()) as u64;
        Some((host, device))
    }
}

impl Drop for UnitShare {
    fn drop(&mut self) {
        let mut units = self.units.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = units.bound.iter().position(|b| b.stream == self.stream) {
            units.bound[at].unit.release(self.owner);
            units.bound[at].users -= 1;
            if units.bound[at].users == 0 {
                let bound = units.bound.swap_remove(at);
                units.idle.push(bound.unit);
            }
        }
    }
}

/// A GPU's stream-bound state: its staging units and its gate words.
#[derive(Default)]
pub(crate) struct BoundState {
    units: Arc<Mutex<StreamUnits>>,
    gates: Arc<Mutex<GateSlab>>,
}

impl BoundState {
    /// Shares the unit bound to `stream`, binding an idle (or new) one when none is; None when
    /// every unit is bound to other streams.
    pub(crate) fn share_unit(
        &self,
        context: &Context,
        stream: StreamHandle,
        staging: StreamStaging,
    ) -> Result<Option<UnitShare>, TransportError> {
        let mut units = self.units.lock().unwrap_or_else(|p| p.into_inner());
        units.next_owner += 1;
        let owner = units.next_owner;
        if let Some(bound) = units.bound.iter_mut().find(|b| b.stream == stream) {
            bound.users += 1;
            let (buffer, bytes) = (bound.unit.buffer, bound.unit.bytes);
            return Ok(Some(UnitShare { units: Arc::clone(&self.units), stream, owner, buffer, bytes }));
        }
        let unit = match units.idle.iter().position(|u| u.bytes >= staging.unit_bytes) {
            Some(at) => units.idle.swap_remove(at),
            None if units.made < staging.units => {
                let unit = make_unit(context, staging)?;
                units.made += 1;
                unit
            }
            None => return Ok(None),
        };
        let (buffer, bytes) = (unit.buffer, unit.bytes);
        units.bound.push(BoundUnit { stream, unit, users: 1 });
        Ok(Some(UnitShare { units: Arc::clone(&self.units), stream, owner, buffer, bytes }))
    }

    /// Allocates every unit `staging` allows now.
    pub(crate) fn prepare_units(&self, context: &Context, staging: StreamStaging) -> Result<(), TransportError> {
        let mut units = self.units.lock().unwrap_or_else(|p| p.into_inner());
        while units.made < staging.units {
            let unit = make_unit(context, staging)?;
            units.idle.push(unit);
            units.made += 1;
        }
        Ok(())
    }

    /// A closed gate word of this GPU.
    pub(crate) fn gate(&self, context: &Context) -> Result<CudaGate, TransportError> {
        let mut slab = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        if slab.free.is_empty() {
            if slab.blocks.len() >= MAX_GATE_BLOCKS {
                return Err(TransportError::Cuda { op: "gate", detail: "every gate word is in use".into() });
            }
            context.bind()?;
            let bytes = GATES_PER_BLOCK * std::mem::size_of::<u32>();
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            let (host, device_addr) = alloc_mapped_host(bytes, flags)?;
            let block = slab.blocks.len();
            slab.blocks.push((host as usize, device_addr));
            slab.free.extend((0..GATES_PER_BLOCK).rev().map(|i| (block, i)));
        }
        let Some(slot) = slab.free.pop() else {
            return Err(TransportError::Cuda { op: "gate", detail: "no free gate word".into() });
        };
        let (host, device_addr) = slab.blocks[slot.0];
        let host = (host as *mut u32).wrapping_add(slot.1);
        // SAFETY: a slot of a live block, no longer waited on (see `CudaGate::drop`).
        unsafe { std::ptr::write_volatile(host, GATE_CLOSED) };
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(CudaGate {
            slab: Arc::clone(&self.gates),
            slot,
            host,
            device_addr: device_addr + (slot.1 * std::mem::size_of::<u32>()) as u64,
            state: AtomicU8::new(0),
        })
    }
}

/// Allocates a stream-bound unit on `context`'s GPU.
fn make_unit(context: &Context, staging: StreamStaging) -> Result<StreamUnit, TransportError> {
    context.bind()?;
    let rows_capacity = staging.rows_capacity();
    let mut buffer: sys::CUdeviceptr = 0;
    // SAFETY: writes one device pointer.
    check(unsafe { sys::cuMemAlloc_v2(&mut buffer, staging.unit_bytes as usize) }, "cuMemAlloc")?;
    let free_buffer = || {
        // SAFETY: allocated above, never used.
        let _ = unsafe { sys::cuMemFree_v2(buffer) };
    };
    let row_bytes = rows_capacity * std::mem::size_of::<Descriptor>();
    // DEVICEMAP lets the kernels read the rows in place.
    let (rows_host, rows_device) = match alloc_mapped_host(row_bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) {
        Ok(rows) => rows,
        Err(e) => {
            free_buffer();
            return Err(e);
        }
    };
    tracing::info!(gpu = context.ordinal, unit_bytes = staging.unit_bytes, "stream-bound staging unit allocated");
    Ok(StreamUnit {
        buffer,
        bytes: staging.unit_bytes,
        rows_host: rows_host.cast(),
        rows_device,
        rows_capacity,
        runs: Default::default(),
        next_row: 0,
    })
}

/// Gate words of one GPU: blocks of mapped pinned host memory and the free slots.
#[derive(Default)]
struct GateSlab {
    /// (host address, device address) of each block.
    blocks: Vec<(usize, sys::CUdeviceptr)>,
    free: Vec<(usize, usize)>,
}

// SAFETY: addresses of pinned allocations owned by the slab for the life of the process.
unsafe impl Send for GateSlab {}

/// A gate word of `GateSlab`.
pub(crate) struct CudaGate {
    slab: Arc<Mutex<GateSlab>>,
    slot: (usize, usize),
    host: *mut u32,
    pub(crate) device_addr: sys::CUdeviceptr,
    /// 0 closed, 1 opened ok, 2 opened failed.
    state: AtomicU8,
}

// SAFETY: the word is written with volatile stores by whoever opens the gate (once); the slot
// belongs to this gate until it drops.
unsafe impl Send for CudaGate {}
// SAFETY: as above; `state` is atomic.
unsafe impl Sync for CudaGate {}

impl Gate for CudaGate {
    fn open(&self, ok: bool) {
        let value = if ok { GATE_OK } else { GATE_FAILED };
        if self.state.compare_exchange(0, value as u8, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            // SAFETY: our slot of a live pinned block; the device only reads it.
            unsafe { std::ptr::write_volatile(self.host, value) };
            std::sync::atomic::fence(Ordering::SeqCst);
        }
    }

    fn state(&self) -> Option<bool> {
        match self.state.load(Ordering::Acquire) {
            0 => None,
            v => Some(v == GATE_OK as u8),
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for CudaGate {
    fn drop(&mut self) {
        // Nothing waits on a gate once every holder let go (the submission that waited on it
        // completed, so the stream passed the wait), but one that was never opened is opened
        // failed first in case a stream still does.
        self.open(false);
        self.slab.lock().unwrap_or_else(|p| p.into_inner()).free.push(self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(capacity: usize) -> StreamUnit {
        StreamUnit {
            buffer: 0,
            bytes: 0,
            rows_host: std::ptr::null_mut(),
            rows_device: 0,
            rows_capacity: capacity,
            runs: Default::default(),
            next_row: 0,
        }
    }

    #[test]
    fn the_row_ring_never_hands_out_rows_a_queued_kernel_may_still_read() {
        let mut u = unit(100);
        assert_eq!(u.take_rows(1, 40), Some(0));
        assert_eq!(u.take_rows(2, 40), Some(40));
        assert_eq!(u.take_rows(3, 30), None, "20 left at the end, 0 free at the start");
        u.release(2);
        assert_eq!(u.take_rows(3, 30), None, "run 2 is back, but behind run 1");
        u.release(1);
        assert_eq!(u.take_rows(3, 30), Some(0), "all back: the ring starts over");
        assert_eq!(u.take_rows(4, 60), Some(30));
        assert_eq!(u.take_rows(5, 11), None);
        u.release(3);
        assert_eq!(u.take_rows(5, 30), Some(0), "wraps into the space run 3 gave back");
        assert_eq!(u.take_rows(6, 1), None, "head meets the oldest live run");
        assert_eq!(u.take_rows(7, 101), None, "more than the ring");
        u.release(4);
        u.release(5);
        assert!(u.runs.is_empty());
    }
}
