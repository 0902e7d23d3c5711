//! Python-facing operations composed of `Store` calls, generic over the store. Owns the call
//! Python callers expect that the `Store` trait does not have as one method: object sizes.
//! Never reaches past the trait.

use kvtide::{Error, Region, Store};

/// The object's size when `e` says the destination sizes did not match it.
fn mismatch(e: &Error) -> Option<u64> {
    match e {
        Error::SizeMismatch { object_bytes, .. } => Some(*object_bytes),
        _ => None,
    }
}

fn as_store<E: Into<kvtide_remote::Error> + Clone>(e: &E) -> Option<kvtide::Error> {
    e.clone().into().as_store().cloned()
}

/// The size of each key's object: a batched read into no destination, which every store
/// answers with the object's size (`SizeMismatch`) and moves no byte for (an empty object
/// reads as 0).
pub fn sizes<S: Store>(s: &S, keys: &[Vec<u8>]) -> Vec<Result<u64, S::Error>>
where
    S::Error: Into<kvtide_remote::Error> + Clone,
{
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let lists: Vec<Vec<Region<'_>>> = keys.iter().map(|_| Vec::new()).collect();
    s.batch_get_into_multi_buffers(&key_refs, &lists)
        .into_iter()
        .map(|r| match r {
            Ok(n) => Ok(n as u64),
            Err(e) => match as_store(&e).as_ref().and_then(mismatch) {
                Some(object_bytes) => Ok(object_bytes),
                None => Err(e),
            },
        })
        .collect()
}
