//! Typed memory regions: an address, a length and what kind of memory it is.
//!
//! A `Region` is a descriptor, like Dynamo KVBM's typed regions: safe constructors borrow host
//! slices (the borrow lasts as long as the region), `from_raw` is the unsafe door for device or
//! foreign memory. Owns the checks a region passes before any byte moves: bounds, with
//! overflow-safe arithmetic, and a host-only list's kinds and writability (`check_host_list`, the
//! default `Transport::check`). It never moves bytes.

use std::marker::PhantomData;

use crate::TransportError;

/// What kind of memory a region is in. It decides which transport can reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary pageable host memory.
    Host,
    /// Host memory registered with the DMA engines (CUDA pinned, RDMA registered).
    Pinned,
    /// GPU memory on the device with this ordinal.
    Device { ordinal: u32 },
}

impl MemoryKind {
    /// True for memory the CPU can read and write directly.
    #[inline]
    pub fn is_host(self) -> bool {
        matches!(self, MemoryKind::Host | MemoryKind::Pinned)
    }
}

/// A range check that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error("range [{offset}, {offset}+{len}) is outside a {bound}-byte {what}")]
    OutOfBounds { what: &'static str, offset: u64, len: u64, bound: u64 },
    #[error("destination region is read-only")]
    ReadOnly,
    #[error("region has a null address")]
    Null,
}

/// Where bytes come from or go to. `'a` is the borrow of the memory, `'static` for raw regions.
#[derive(Clone, Copy, Debug)]
pub struct Region<'a> {
    addr: u64,
    len: usize,
    kind: MemoryKind,
    writable: bool,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Region<'a> {
    /// A writable host buffer (a destination, or a source).
    pub fn host(buf: &'a mut [u8]) -> Region<'a> {
        Region {
            addr: buf.as_mut_ptr() as u64,
            len: buf.len(),
            kind: MemoryKind::Host,
            writable: true,
            _borrow: PhantomData,
        }
    }

    /// A read-only host buffer: usable as a source only.
    pub fn host_readonly(buf: &'a [u8]) -> Region<'a> {
        Region {
            addr: buf.as_ptr() as u64,
            len: buf.len(),
            kind: MemoryKind::Host,
            writable: false,
            _borrow: PhantomData,
        }
    }

    /// A region of memory the borrow checker cannot see: device memory, registered buffers,
    /// memory of another allocator.
    ///
    /// # Safety
    /// `[addr, addr+len)` must be valid memory of `kind`, readable (and writable when used as a
    /// destination), and must not be freed or used by anything else until the call (or the ticket
    /// of the call) that receives this region has completed.
    pub unsafe fn from_raw(addr: u64, len: usize, kind: MemoryKind) -> Region<'static> {
        Region { addr, len, kind, writable: true, _borrow: PhantomData }
    }

    /// Start address.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length region.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Memory kind.
    #[inline]
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// False for regions made from shared borrows.
    #[inline]
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Checks that `[offset, offset+len)` lies inside this region.
    #[inline]
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), RegionError> {
        check_range("buffer", offset, len, self.len as u64)
    }

    /// Checks that this region can receive bytes.
    #[inline]
    pub fn check_writable(&self) -> Result<(), RegionError> {
        if !self.writable {
            return Err(RegionError::ReadOnly);
        }
        if self.addr == 0 && self.len > 0 {
            return Err(RegionError::Null);
        }
        Ok(())
    }

    /// The sub-region `[offset, offset+len)`.
    pub fn slice(&self, offset: u64, len: u64) -> Result<Region<'a>, RegionError> {
        self.check_range(offset, len)?;
        Ok(Region { addr: self.addr + offset, len: len as usize, ..*self })
    }
}

/// Checks `[offset, offset+len)` against a `bound`-byte `what` without overflowing.
#[inline]
pub fn check_range(what: &'static str, offset: u64, len: u64, bound: u64) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        Some(end) if end <= bound => Ok(()),
        _ => Err(RegionError::OutOfBounds { what, offset, len, bound }),
    }
}

/// The first problem of a list of host regions: device memory, or (for destinations) a
/// read-only region.
pub fn check_host_list(regions: &[Region<'_>], writable: bool) -> Option<TransportError> {
    regions.iter().find_map(|r| {
        if !r.kind().is_host() {
            return Some(TransportError::CudaUnavailable("device regions need the cuda transport"));
        }
        if writable {
            return r.check_writable().err().map(TransportError::from);
        }
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_without_overflow() {
        let mut buf = [0u8; 16];
        let r = Region::host(&mut buf);
        assert!(r.check_range(0, 16).is_ok());
        assert!(r.check_range(16, 0).is_ok());
        assert!(r.check_range(15, 2).is_err());
        assert!(r.check_range(u64::MAX, 2).is_err());
        assert_eq!(r.slice(4, 8).map(|s| (s.addr() - r.addr(), s.len())), Ok((4, 8)));
    }

    #[test]
    fn readonly_regions_refuse_writes() {
        let buf = [0u8; 4];
        assert_eq!(Region::host_readonly(&buf).check_writable(), Err(RegionError::ReadOnly));
        let mut b2 = [0u8; 4];
        assert!(Region::host(&mut b2).check_writable().is_ok());
    }
}
