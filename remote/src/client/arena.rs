//! The owner's arena as a connection reads it: mapped (same host, `shm.rs`) or over the UCX
//! plane (`ucx/`), one type for every leased read.
//!
//! Owns the choice of how granted bytes are copied out (a memcpy from the mapping, or UCX gets)
//! and the way GPU destinations are reached from each (straight from the registered mapping, or
//! through a pinned bounce the gets land in). Never decides what may be read: every range it is
//! given was granted under a lease and is checked against the arena's length here.

use std::cell::RefCell;
use std::sync::Arc;

use kvtide::Error as StoreError;
use kvtide_transport::{Direction, Region, Transfer};

use super::gpu::{self, ClientGpu};
use crate::error::{Error, Result};
use crate::shm::ShmMapping;
use crate::ucx::UcxArena;

/// UCX gets collected for one `flush`: (arena offset, destination address, length).
type Pending = RefCell<Vec<(u64, u64, u64)>>;

/// Where a connection reads granted ranges from.
#[derive(Clone)]
pub(super) enum Arena {
    /// The arena mapped read-only into this process (Unix socket).
    Mapped(Arc<ShmMapping>),
    /// The owner's arena read with one-sided UCX gets (TCP control connection).
    Ucx(Arc<UcxArena>),
    /// As `Ucx`, with the gets of host copies collected and posted together by `flush` (the
    /// objects and fragments of one part in flight at once).
    UcxBatch(Arc<UcxArena>, Pending),
}

impl Arena {
    pub(super) fn len(&self) -> u64 {
        match self {
            Arena::Mapped(m) => m.len(),
            Arena::Ucx(u) | Arena::UcxBatch(u, _) => u.len(),
        }
    }

    /// The mapping, when the arena is mapped here.
    pub(super) fn mapping(&self) -> Option<&Arc<ShmMapping>> {
        match self {
            Arena::Mapped(m) => Some(m),
            Arena::Ucx(_) | Arena::UcxBatch(..) => None,
        }
    }

    /// This arena with its UCX host copies collected until `flush` (a mapped one as it is).
    pub(super) fn batched(self) -> Arena {
        match self {
            Arena::Ucx(u) => Arena::UcxBatch(u, RefCell::default()),
            other => other,
        }
    }

    /// Posts the collected gets and waits for them: Ok when every one completed (nothing was
    /// collected, or the arena copies at once), else the error that fails every copy collected.
    pub(super) fn flush(&self) -> Result<()> {
        let Arena::UcxBatch(u, pending) = self else { return Ok(()) };
        let pieces = std::mem::take(&mut *pending.borrow_mut());
        if pieces.is_empty() {
            return Ok(());
        }
        // SAFETY: every piece was collected by `copy_out`/`copy_out_across`, whose callers lent
        // its destination writable and its range leased until after this flush (their contract).
        unsafe { u.read(&pieces) }.map_err(Error::from)
    }

    /// Reads `pieces` now (UCX) or collects them (`UcxBatch`).
    ///
    /// # Safety
    /// As `copy_out`, for each piece; with `UcxBatch` until the next `flush` returned.
    unsafe fn get(u: &UcxArena, pending: Option<&Pending>, pieces: Vec<(u64, u64, u64)>) -> Result<()> {
        for &(offset, _, n) in &pieces {
            if offset.checked_add(n).is_none_or(|end| end > u.len()) {
                return Err(Error::Protocol(format!("grant [{offset}, +{n}) lies outside the {}-byte arena", u.len())));
            }
        }
        match pending {
            Some(p) => {
                p.borrow_mut().extend(pieces);
                Ok(())
            }
            // SAFETY: forwarded contract.
            None => unsafe { u.read(&pieces) }.map_err(Error::from),
        }
    }

    /// Copies `len` bytes at `offset` of the arena to `dst` (with `UcxBatch`, at the next
    /// `flush`).
    ///
    /// # Safety
    /// `[dst, dst + len)` must be valid host memory for writes, and the range must be covered by
    /// a lease the owner granted and has not released (with `UcxBatch`: both until the next
    /// `flush` returned).
    pub(super) unsafe fn copy_out(&self, offset: u64, len: u64, dst: *mut u8) -> Result<()> {
        match self {
            // SAFETY: forwarded contract.
            Arena::Mapped(m) => unsafe { m.copy_out(offset, len, dst) },
            // SAFETY: forwarded contract.
            Arena::Ucx(u) => unsafe { Arena::get(u, None, vec![(offset, dst as u64, len)]) },
            // SAFETY: forwarded contract.
            Arena::UcxBatch(u, p) => unsafe { Arena::get(u, Some(p), vec![(offset, dst as u64, len)]) },
        }
    }

    /// Copies `len` bytes at `offset`, in order, across host `regions` (over UCX: one get per
    /// region, all in flight together). `BufferTooSmall` when the regions hold fewer.
    ///
    /// # Safety
    /// As `copy_out`, for each region.
    pub(super) unsafe fn copy_out_across(&self, offset: u64, len: u64, regions: &[Region<'_>]) -> Result<()> {
        match self {
            // SAFETY: forwarded contract.
            Arena::Mapped(m) => unsafe { m.copy_out_across(offset, len, regions) },
            Arena::Ucx(u) | Arena::UcxBatch(u, _) => {
                let mut pieces = Vec::with_capacity(regions.len());
                let mut pos = 0;
                for r in regions {
                    if pos == len {
                        break;
                    }
                    let take = (r.len() as u64).min(len - pos);
                    pieces.push((offset + pos, r.addr(), take));
                    pos += take;
                }
                if pos != len {
                    return Err(StoreError::BufferTooSmall { object_bytes: len, buffer_bytes: pos }.into());
                }
                let pending = match self {
                    Arena::UcxBatch(_, p) => Some(p),
                    _ => None,
                };
                // SAFETY: forwarded contract; each piece lies in its region.
                unsafe { Arena::get(u, pending, pieces) }
            }
        }
    }

    /// `len` bytes at `offset` in a new vector, read now (never collected: the vector is
    /// this call's).
    ///
    /// # Safety
    /// The range must be leased as `copy_out` says.
    pub(super) unsafe fn copy_out_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let n = usize::try_from(len).map_err(|_| Error::Protocol(format!("{len} bytes do not fit memory")))?;
        // The length is the owner's: checked against the arena before anything is allocated,
        // and an allocation that fails is an error, not an abort.
        match self {
            Arena::Mapped(m) => m.addr_of(offset, len).map(drop)?,
            Arena::Ucx(u) | Arena::UcxBatch(u, _) => u.check(offset, len)?,
        }
        let mut v = Vec::<u8>::new();
        v.try_reserve_exact(n).map_err(|e| Error::Protocol(format!("{len} bytes granted: {e}")))?;
        // SAFETY: v has room for len bytes; the copy writes exactly those or fails (then set_len
        // is not reached).
        unsafe {
            match self {
                Arena::Mapped(m) => m.copy_out(offset, len, v.as_mut_ptr())?,
                Arena::Ucx(u) | Arena::UcxBatch(u, _) => {
                    Arena::get(u, None, vec![(offset, v.as_mut_ptr() as u64, len)])?
                }
            }
            v.set_len(n);
        }
        Ok(v)
    }

    /// Copies `len` bytes at `offset` into the device (and host) `regions`: from the mapping
    /// the caller submits the returned transfer itself (one submission per part); over UCX the
    /// bytes land in a pinned bounce first and the copy is done here (`None` returned).
    ///
    /// # Safety
    /// The range must be leased as `copy_out` says; the regions' device pieces must have been
    /// checked by the GPU transport and be lent writable for the call.
    pub(super) unsafe fn to_device(
        &self,
        gpu: &ClientGpu,
        offset: u64,
        len: u64,
        regions: &[Region<'_>],
    ) -> Result<Option<Transfer>> {
        let regions = gpu::covering(regions, len)?;
        match self {
            Arena::Mapped(m) => Ok(Some(Transfer::in_order(m.addr_of(offset, len)?, len, &regions))),
            Arena::Ucx(u) | Arena::UcxBatch(u, _) => {
                let n = usize::try_from(len).map_err(|_| Error::Protocol(format!("{len} bytes do not fit memory")))?;
                let bounce = gpu.take_bounce(gpu::ordinal_of(&regions), n);
                // SAFETY: the bounce holds at least n writable bytes, ours until given back (the
                // get is made now, never collected); the range's lease is the caller's contract.
                let landed = unsafe { Arena::get(u, None, vec![(offset, bounce.ptr() as u64, len)]) };
                let copied = landed.and_then(|()| {
                    let transfer = Transfer::in_order(bounce.ptr() as u64, len, &regions);
                    // SAFETY: the bounce holds the bytes and is untouched until the copy
                    // returned; the device pieces are the caller's contract.
                    unsafe { gpu.copy(Direction::HostToDevice, &[transfer]) }
                        .pop()
                        .unwrap_or(Err(StoreError::Internal("a copy result was missing").into()))
                });
                gpu.give_bounce(bounce);
                copied.map(|()| None)
            }
        }
    }

    /// `to_device`, with the copy from the mapping done here too.
    ///
    /// # Safety
    /// As `to_device`.
    pub(super) unsafe fn to_device_now(
        &self,
        gpu: &ClientGpu,
        offset: u64,
        len: u64,
        regions: &[Region<'_>],
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        match unsafe { self.to_device(gpu, offset, len, regions) }? {
            // SAFETY: the mapping's bytes are leased (contract) and the device pieces checked.
            Some(transfer) => unsafe { gpu.copy(Direction::HostToDevice, &[transfer]) }
                .pop()
                .unwrap_or(Err(StoreError::Internal("a copy result was missing").into())),
            None => Ok(()),
        }
    }
}
