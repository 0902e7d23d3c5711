//! Python-facing operations composed of `Store` calls, generic over the store. Owns the two
//! calls Python callers expect that the `Store` trait does not have as one method: "each object
//! into the start of its own buffer, at least as large" (`get_into` for a batch) and object
//! sizes. Never reaches past the trait.

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

/// Object i into the start of `dsts[i]` (at least as large): one batched read, then one more
/// for the objects smaller than their buffer (the batch call wants exact sizes). A key whose
/// size changed again between the two (an upsert in between) is read once more on its own with
/// `get_into`, which takes whatever fits: the caller never sees a size it did not pass.
pub fn get_into_each<S: Store>(s: &S, keys: &[Vec<u8>], dsts: &[Region<'static>]) -> Vec<Result<usize, S::Error>>
where
    S::Error: Into<kvtide_remote::Error> + Clone,
{
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let lists: Vec<Vec<Region<'_>>> = dsts.iter().map(|d| vec![*d]).collect();
    let mut results = s.batch_get_into_multi_buffers(&key_refs, &lists);
    let mut again = Vec::new();
    for (i, r) in results.iter_mut().enumerate() {
        let Err(e) = r else { continue };
        let Some(object_bytes) = as_store(e).as_ref().and_then(mismatch) else { continue };
        let buffer_bytes = dsts[i].len() as u64;
        if object_bytes > buffer_bytes {
            *r = Err(Error::BufferTooSmall { object_bytes, buffer_bytes }.into());
        } else if let Ok(part) = dsts[i].slice(0, object_bytes) {
            again.push((i, part));
        }
    }
    if again.is_empty() {
        return results;
    }
    let retry_keys: Vec<&[u8]> = again.iter().map(|(i, _)| key_refs[*i]).collect();
    let retry_dsts: Vec<Vec<Region<'_>>> = again.iter().map(|(_, part)| vec![*part]).collect();
    for ((i, _), r) in again.iter().zip(s.batch_get_into_multi_buffers(&retry_keys, &retry_dsts)) {
        let resized = matches!(&r, Err(e) if as_store(e).as_ref().and_then(mismatch).is_some());
        results[*i] = if resized { s.get_into(key_refs[*i], dsts[*i]) } else { r };
    }
    results
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
