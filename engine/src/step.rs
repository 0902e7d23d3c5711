//! A step call (`step_on_stream`): every layer of an inference step read in one call, each
//! layer followed on the caller's stream by the signal its compute waits on.
//!
//! Owns the description of a step (its layers, their reads and signals, the layer bound) and the
//! whole-step checks both the engine and the remote client make before anything is leased or
//! enqueued. Never leases, plans or enqueues anything itself.

use kvtide_transport::{MemoryKind, Region, StreamHandle, StreamSignal};

use crate::api::Fragment;
use crate::error::{Error, Result};

/// Most layers one step call carries.
pub const MAX_STEP_LAYERS: usize = 1024;

/// What one layer of a step reads (`Engine::step_on_stream`).
#[derive(Clone, Copy, Debug)]
pub enum StepReads<'k, 'r> {
    /// Object i of `keys` scattered in order across `dsts[i]`, sizes adding up to the object
    /// (as `batch_get_into_multi_buffers_on_stream`).
    Objects { keys: &'k [&'k [u8]], dsts: &'k [Vec<Region<'r>>] },
    /// Byte ranges of objects into buffers (as `get_into_ranges_on_stream`).
    Ranges { buffers: &'k [Region<'r>], fragments: &'k [Vec<Fragment>] },
}

/// One layer of a step: its reads, and the signal enqueued after its copies.
#[derive(Clone, Copy, Debug)]
pub struct StepLayer<'k, 'r> {
    pub reads: StepReads<'k, 'r>,
    /// What the device waits on for this layer (None: nothing; the caller orders its own work
    /// on the stream).
    pub done: Option<StreamSignal>,
}

/// A step call's checks, before anything is leased or enqueued: at most `MAX_STEP_LAYERS`
/// layers, every signal well formed (no null event, no null or unaligned word), no signal on
/// stream 0 (it has no place for one), and no two reads writing the same device bytes (within
/// a layer or across layers; ranges of one buffer may share the buffer, not bytes). Host
/// destinations are the CPU's and are not checked here.
pub fn check(layers: &[StepLayer<'_, '_>], stream: StreamHandle) -> Result<()> {
    if layers.len() > MAX_STEP_LAYERS {
        return Err(Error::InvalidArgument(format!("a step of {} layers (at most {MAX_STEP_LAYERS})", layers.len())));
    }
    // (start, end, layer) of every device byte range written.
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(step_spans(layers));
    let device = |r: &Region<'_>| matches!(r.kind(), MemoryKind::Device { .. });
    for (l, layer) in layers.iter().enumerate() {
        if let Some(signal) = &layer.done {
            if stream == 0 {
                return Err(Error::InvalidArgument("stream 0 has no place for the layers' signals".into()));
            }
            signal.check().map_err(|e| Error::InvalidArgument(format!("layer {l}: {e}")))?;
        }
        match layer.reads {
            StepReads::Objects { dsts, .. } => {
                for r in dsts.iter().flatten().filter(|r| device(r) && !r.is_empty()) {
                    spans.push((r.addr(), r.addr().saturating_add(r.len() as u64), l));
                }
            }
            StepReads::Ranges { buffers, fragments } => {
                for (buffer, frags) in buffers.iter().zip(fragments).filter(|(b, _)| device(b)) {
                    for f in frags.iter().filter(|f| f.len > 0) {
                        let start = buffer.addr().saturating_add(f.dst_offset);
                        spans.push((start, start.saturating_add(f.len), l));
                    }
                }
            }
        }
    }
    // By start alone: two spans of one start overlap whichever comes first (neither is empty).
    spans.sort_unstable_by_key(|&(start, _, _)| start);
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::InvalidArgument(format!(
                "the step's device destinations overlap: layer {}'s [{:#x}, {:#x}) and layer {}'s [{:#x}, {:#x})",
                w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
            )));
        }
    }
    Ok(())
}

/// The most device spans `check` collects for `layers` (each destination region or fragment).
fn step_spans(layers: &[StepLayer<'_, '_>]) -> usize {
    layers
        .iter()
        .map(|l| match l.reads {
            StepReads::Objects { dsts, .. } => dsts.iter().map(Vec::len).sum(),
            StepReads::Ranges { fragments, .. } => fragments.iter().map(Vec::len).sum::<usize>(),
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(addr: u64, len: usize) -> Region<'static> {
        // SAFETY: the check reads addresses and lengths only; nothing is dereferenced.
        unsafe { Region::from_raw(addr, len, MemoryKind::Device { ordinal: 0 }) }
    }

    fn ranges(buffers: &[Region<'static>], fragments: &[Vec<Fragment>]) -> Result<()> {
        let layers = [StepLayer { reads: StepReads::Ranges { buffers, fragments }, done: None }];
        check(&layers, 7)
    }

    #[test]
    fn fragments_that_share_device_bytes_are_refused_in_any_order() {
        let buffer = [device(1 << 20, 1 << 16)];
        let frag = |dst: u64, len: u64| Fragment::new(b"k".to_vec(), 0, dst, len);
        // A shuffled page table: pages 3, 0, 2, 1 of 4 KiB each.
        let pages: Vec<Fragment> = [3u64, 0, 2, 1].iter().map(|p| frag(p * 4096, 4096)).collect();
        assert!(ranges(&buffer, std::slice::from_ref(&pages)).is_ok(), "disjoint pages pass");
        let empty_beside = [pages.clone(), vec![frag(0, 0)]].concat();
        assert!(ranges(&buffer, &[empty_beside]).is_ok(), "an empty fragment writes nothing");
        for bad in [
            vec![frag(4096, 4096), frag(4096, 1)],             // the same start
            vec![frag(8192, 4096), frag(0, 8193)],             // one byte into the next page
            vec![frag(0, 4096), frag(100, 10), frag(9000, 1)], // inside another
            vec![frag(12288, 4096), frag(0, 16384)],           // around every other
        ] {
            let e = ranges(&buffer, std::slice::from_ref(&bad)).expect_err("overlap");
            assert!(matches!(&e, Error::InvalidArgument(why) if why.contains("overlap")), "{bad:?}: {e}");
        }
    }
}
