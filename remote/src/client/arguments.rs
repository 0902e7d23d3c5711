//! The checks of a caller's arguments before anything is sent: keys against the owner's
//! limits, one region list per key, destination and source lists (GPU memory through the GPU
//! transport, all device lists of a call together; host memory through `kvtide::checks`).
//!
//! Owns the client's argument checks, shared by `RemoteStore` and `ClusterStore` (the list
//! count check), so both refuse the same arguments with the same errors as the embedded engine.
//! Never sends a frame and never touches a connection.

use kvtide::checks;
use kvtide::Error as StoreError;
use kvtide_transport::Region;

use super::gpu;
use super::Inner;
use crate::error::Result;
use crate::protocol::Limits;

/// Which way a list of regions is used.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Written by a read (must be writable).
    Destination,
    /// Read by a put.
    Source,
}

/// One region list per key (`what` names the lists: "source", "destination"), as every batch
/// call of `RemoteStore` and `ClusterStore` takes: `Err` holds the refusal once per key, what a
/// batch call returns when the counts differ.
pub(crate) fn lists_per_key<T: Clone>(
    keys: usize,
    lists: usize,
    what: &str,
) -> std::result::Result<(), Vec<Result<T>>> {
    checks::one_list_per_key(keys, lists, what).map_err(|e| vec![Err(e.into()); keys])
}

/// Checks `key` against the owner's limits: not empty, at most `max_key_bytes`.
pub(super) fn check_key(limits: &Limits, key: &[u8]) -> Result<()> {
    if key.is_empty() {
        return Err(StoreError::EmptyKey.into());
    }
    if key.len() > limits.max_key_bytes as usize {
        let max = u64::from(limits.max_key_bytes);
        return Err(StoreError::TooLarge { what: "key", len: key.len() as u64, max }.into());
    }
    Ok(())
}

/// The positions of the keys that pass `check_key`; each other key's error goes to its slot of
/// `results`.
pub(super) fn valid_keys<T>(limits: &Limits, keys: &[&[u8]], results: &mut [Result<T>]) -> Vec<usize> {
    let mut valid = Vec::with_capacity(keys.len());
    for (i, key) in keys.iter().enumerate() {
        match check_key(limits, key) {
            Ok(()) => valid.push(i),
            Err(e) => results[i] = Err(e),
        }
    }
    valid
}

/// A host destination: writable host memory.
pub(super) fn check_destination(dst: &Region<'_>) -> Result<()> {
    Ok(checks::host_destination(dst, "device destinations are not supported by the remote client yet")?)
}

/// A host source.
pub(super) fn check_source(src: &Region<'_>) -> Result<()> {
    Ok(checks::host_source(src, "device sources are not supported by the remote client yet")?)
}

impl Inner {
    /// Checks a key against the owner's limits (`check_key`).
    pub(super) fn validate_key(&self, limits: &Limits, key: &[u8]) -> Result<()> {
        check_key(limits, key)
    }

    /// Checks a destination list: GPU memory through the GPU transport, host memory writable.
    pub(super) fn check_destinations(&self, regions: &[Region<'_>]) -> Result<()> {
        self.check_destination_lists(&[regions]).pop().unwrap_or(Ok(()))
    }

    /// `check_destinations` for many lists; the GPU lists are checked together (one lookup per
    /// device allocation, not per list).
    pub(super) fn check_destination_lists(&self, lists: &[&[Region<'_>]]) -> Vec<Result<()>> {
        self.check_lists(lists, Use::Destination)
    }

    /// Checks source lists: GPU memory through the GPU transport (all lists together).
    pub(super) fn check_source_lists(&self, lists: &[&[Region<'_>]]) -> Vec<Result<()>> {
        self.check_lists(lists, Use::Source)
    }

    /// The one check of region lists: host lists region by region, the lists naming GPU
    /// memory together through the GPU transport. One result per list.
    fn check_lists(&self, lists: &[&[Region<'_>]], use_: Use) -> Vec<Result<()>> {
        let host = match use_ {
            Use::Destination => check_destination,
            Use::Source => check_source,
        };
        let mut out: Vec<Result<()>> = Vec::with_capacity(lists.len());
        let mut device = Vec::new();
        for (i, regions) in lists.iter().enumerate() {
            if gpu::names_device(regions) {
                device.push(i);
                out.push(Ok(()));
            } else {
                out.push(regions.iter().try_for_each(host));
            }
        }
        if !device.is_empty() {
            let device_lists: Vec<&[Region<'_>]> = device.iter().map(|&i| lists[i]).collect();
            let writable = use_ == Use::Destination;
            for (&i, checked) in device.iter().zip(self.gpu.check_lists(&device_lists, writable)) {
                out[i] = checked;
            }
        }
        out
    }
}
