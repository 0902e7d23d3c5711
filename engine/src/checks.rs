//! Argument checks every `Store` implementation shares (the embedded engine here, the remote
//! client in `kvtide-remote`), so both refuse the same arguments with the same errors. Owns
//! host-only region checks, region lengths and the fragments of `get_into_ranges`; never
//! touches a shard or the arena. Each failure is the caller's typed error for that key or
//! fragment only.

use kvtide_transport::{MemoryKind, Region};

use crate::api::Fragment;
use crate::error::{Error, Result};

/// A destination a host-memory path can write: host memory, writable. `device` says why a
/// device region is refused here.
pub fn host_destination(dst: &Region<'_>, device: &'static str) -> Result<()> {
    if let MemoryKind::Device { .. } = dst.kind() {
        return Err(Error::CudaUnavailable(device));
    }
    dst.check_writable()?;
    Ok(())
}

/// A source a host-memory path can read. `device` says why a device region is refused here.
pub fn host_source(src: &Region<'_>, device: &'static str) -> Result<()> {
    if let MemoryKind::Device { .. } = src.kind() {
        return Err(Error::CudaUnavailable(device));
    }
    Ok(())
}

/// A batch call names one region list per key; `what` names the lists ("source",
/// "destination").
pub fn one_list_per_key(keys: usize, lists: usize, what: &str) -> Result<()> {
    if keys != lists {
        return Err(Error::InvalidArgument(format!("{keys} keys but {lists} {what} lists")));
    }
    Ok(())
}

/// `get_into_ranges` and its stream-bound forms take one fragment list per buffer at most.
pub fn fragment_lists(buffers: usize, lists: usize) -> Result<()> {
    if lists > buffers {
        return Err(Error::InvalidArgument(format!("fragments for {lists} buffers but only {buffers} buffers")));
    }
    Ok(())
}

/// The bytes `regions` cover together.
pub fn total_len(regions: &[Region<'_>]) -> Result<u64> {
    regions
        .iter()
        .try_fold(0u64, |acc, r| acc.checked_add(r.len() as u64))
        .ok_or_else(|| Error::InvalidArgument("region lengths overflow".into()))
}

/// The fragments of a `get_into_ranges` call that pass their checks, as (buffer, fragment): the
/// buffer exists and passes `check_buffer(index, buffer)`, the destination range lies inside
/// it and `check_key` accepts the key. The others get their error in `results` (`E` is the
/// store's error type).
pub fn checked_fragments<E: From<Error>>(
    buffers: &[Region<'_>],
    fragments: &[Vec<Fragment>],
    results: &mut [Vec<Result<usize, E>>],
    check_buffer: impl Fn(usize, &Region<'_>) -> Result<(), E>,
    check_key: impl Fn(&[u8]) -> Result<(), E>,
) -> Vec<(usize, usize)> {
    let mut passed = Vec::new();
    for (b, frags) in fragments.iter().enumerate() {
        for (f, frag) in frags.iter().enumerate() {
            let checked = buffers
                .get(b)
                .ok_or_else(|| {
                    E::from(Error::InvalidArgument(format!(
                        "fragments for buffer {b} but only {} buffers",
                        buffers.len()
                    )))
                })
                .and_then(|buffer| {
                    check_buffer(b, buffer)?;
                    buffer.check_range(frag.dst_offset, frag.len).map_err(|e| E::from(e.into()))?;
                    check_key(&frag.key)
                });
            match checked {
                Ok(()) => passed.push((b, f)),
                Err(e) => results[b][f] = Err(e),
            }
        }
    }
    passed
}
