//! Transfer descriptors: what a transport moves, whatever the memory on either side.
//!
//! Owns the batch vocabulary every transport speaks: a `Transfer` is one object's host bytes
//! (leased or reserved DRAM) and the `Piece`s they map to (GPU pages, caller buffers, later
//! remote memory), each piece one (source, destination, length) descriptor. A transport reports
//! one completion per transfer; a caller that wants finer completions submits finer transfers
//! (`Transfer::split`). Also owns what a submission reports back (`Summary`, with the `Fallback`
//! that sent a GPU request down the direct path). It never validates memory: the engine and the
//! transports do that.

use std::ops::Range;

use crate::region::{MemoryKind, Region};

/// Which way the bytes of a transfer move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Reads: from the object's host bytes (the DRAM arena) to the pieces (GPU pages).
    HostToDevice,
    /// Writes: from the pieces (GPU pages) into the object's host bytes (an arena reservation).
    DeviceToHost,
}

/// One contiguous run between an object's host bytes and a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Offset inside the object's host bytes.
    pub host_offset: u64,
    /// Address of the page side (device memory, or host memory for mixed requests).
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// What the page side is.
    pub kind: MemoryKind,
}

/// One object's transfer: its host bytes and the pieces they map to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// Address of the object's first byte in host memory (leased or reserved arena bytes).
    pub host: u64,
    /// Length of the object's host bytes.
    pub host_len: u64,
    /// Where its bytes go (or come from).
    pub pieces: Vec<Piece>,
}

impl Transfer {
    /// The host byte range the pieces touch, `[start, end)`; `0..0` without pieces.
    pub fn span(&self) -> Range<u64> {
        let (mut start, mut end) = (u64::MAX, 0);
        for p in &self.pieces {
            start = start.min(p.host_offset);
            end = end.max(p.host_offset + p.len);
        }
        if start == u64::MAX {
            return 0..0;
        }
        start..end.max(start)
    }

    /// Bytes this transfer moves.
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }
}

impl Transfer {
    /// An object's bytes laid end to end over `regions` (their lengths add up to the part of
    /// the object they cover, starting at offset 0).
    pub fn in_order(host: u64, host_len: u64, regions: &[Region<'_>]) -> Transfer {
        Transfer { host, host_len, pieces: Transfer::pieces_in_order(regions).collect() }
    }

    /// The pieces of `in_order`: `regions` one after another from the object's first byte.
    pub fn pieces_in_order<'a>(regions: &'a [Region<'_>]) -> impl Iterator<Item = Piece> + 'a {
        regions.iter().scan(0u64, |offset, r| {
            let piece = Piece { host_offset: *offset, addr: r.addr(), len: r.len() as u64, kind: r.kind() };
            *offset += r.len() as u64;
            Some(piece)
        })
    }

    /// The transfer cut into consecutive transfers of at most `max_bytes` each (pieces split
    /// where needed), in order; together they move exactly the bytes of `self`. Lets an inline
    /// transport bound the work of one step, and a caller see per-chunk completions.
    pub fn split(&self, max_bytes: u64) -> Vec<Transfer> {
        let max_bytes = max_bytes.max(1);
        let mut out = Vec::new();
        let mut current = Transfer { host: self.host, host_len: self.host_len, pieces: Vec::new() };
        let mut room = max_bytes;
        for piece in &self.pieces {
            let mut done = 0;
            while done < piece.len || (piece.len == 0 && done == 0) {
                if room == 0 {
                    out.push(std::mem::replace(
                        &mut current,
                        Transfer { host: self.host, host_len: self.host_len, pieces: Vec::new() },
                    ));
                    room = max_bytes;
                }
                let n = (piece.len - done).min(room);
                current.pieces.push(Piece {
                    host_offset: piece.host_offset + done,
                    addr: piece.addr + done,
                    len: n,
                    kind: piece.kind,
                });
                done += n;
                room -= n;
                if piece.len == 0 {
                    break;
                }
            }
        }
        if !current.pieces.is_empty() || out.is_empty() {
            out.push(current);
        }
        out
    }
}

/// Why a request takes the direct path instead of the staged one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fallback {
    /// Staging is off for this store.
    Disabled,
    /// Nothing to move.
    Empty,
    /// A page is host memory.
    NotDevice,
    /// Pages on more than one GPU.
    SeveralDevices,
    /// Two destination pages overlap.
    Overlap,
    /// An object does not fit the buffer.
    TooLarge,
    /// Every object goes to one contiguous page: staging would only add a pass.
    NotFragmented,
    /// Another request holds the staging buffer.
    Busy,
    /// The scatter/gather kernel could not be compiled or loaded (no NVRTC, say).
    KernelUnavailable,
    /// The staging buffer could not be allocated.
    NoBuffer,
}

impl Fallback {
    /// Short name for logs and stats.
    pub fn name(self) -> &'static str {
        match self {
            Fallback::Disabled => "disabled",
            Fallback::Empty => "empty",
            Fallback::NotDevice => "not-device",
            Fallback::SeveralDevices => "several-devices",
            Fallback::Overlap => "overlap",
            Fallback::TooLarge => "too-large",
            Fallback::NotFragmented => "not-fragmented",
            Fallback::Busy => "busy",
            Fallback::KernelUnavailable => "kernel-unavailable",
            Fallback::NoBuffer => "no-buffer",
        }
    }
}

/// What a submission did (for stats and tests). Transports fill what applies to them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// `None` for staged, the reason for direct.
    pub fallback: Option<Fallback>,
    /// True when the staged path ran.
    pub staged: bool,
    /// Staging-buffer fills (one kernel launch each).
    pub fills: u64,
    /// Scatter or gather kernel launches.
    pub kernel_launches: u64,
    /// Individual async copy calls (`cuMemcpy{HtoD,DtoH}Async`).
    pub copy_calls: u64,
    /// `cuMemcpyBatchAsync` calls.
    pub batch_calls: u64,
    /// Bytes moved between host and device.
    pub bytes: u64,
}

impl Summary {
    /// Adds a part's summary to the request's: counts add up, the request is staged when any
    /// part was, and the last direct part's reason stays.
    pub fn absorb(&mut self, part: &Summary) {
        self.fallback = part.fallback.or(self.fallback);
        self.staged |= part.staged;
        self.fills += part.fills;
        self.kernel_launches += part.kernel_launches;
        self.copy_calls += part.copy_calls;
        self.batch_calls += part.batch_calls;
        self.bytes += part.bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_every_byte_once_in_order() {
        let t = Transfer {
            host: 0x1000,
            host_len: 100,
            pieces: vec![
                Piece { host_offset: 0, addr: 0x9000, len: 30, kind: MemoryKind::Host },
                Piece { host_offset: 30, addr: 0x5000, len: 70, kind: MemoryKind::Host },
            ],
        };
        for max in [1, 7, 30, 31, 64, 100, 1000] {
            let parts = t.split(max);
            assert!(parts.iter().all(|p| p.bytes() <= max && p.host == t.host));
            let flat: Vec<(u64, u64)> = parts
                .iter()
                .flat_map(|p| p.pieces.iter())
                .flat_map(|p| (0..p.len).map(move |i| (p.host_offset + i, p.addr + i)))
                .collect();
            let want: Vec<(u64, u64)> =
                t.pieces.iter().flat_map(|p| (0..p.len).map(move |i| (p.host_offset + i, p.addr + i))).collect();
            assert_eq!(flat, want, "max {max}");
        }
        let empty = Transfer { host: 1, host_len: 0, pieces: Vec::new() };
        assert_eq!(empty.split(8).len(), 1);
    }
}
