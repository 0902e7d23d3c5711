//! Fuzzes the owner's request validation: `op | max_items | max_key_bytes (u16) | payload`.
//! Whatever the payload, decoding never panics and never allocates from an unchecked count,
//! and an accepted request honours every limit: item counts, key lengths (1..=max), fragment
//! key indices, put lengths (inline <= total <= max value), batched puts (lengths, window
//! offsets only for window values, client segments only for client values, at most
//! `MAX_CLIENT_SEGMENTS` of them adding up to the value), scan prefixes and limits, progressive put heads and chunk heads. Accepted requests round-trip.
#![no_main]

use kvtide_remote::protocol::{
    Limits, Op, PutChunkHead, PutHead, Request, ValueSource, MAX_CLIENT_SEGMENTS, PUT_HEAD_BYTES,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let Some(op) = Op::from_u8(data[0]) else { return };
    let limits = Limits {
        max_payload_bytes: 1 << 20,
        max_items: u32::from(data[1]) + 1,
        max_key_bytes: u32::from(u16::from_le_bytes([data[2], data[3]])).max(1),
        max_value_bytes: 1 << 24,
    };
    let payload = &data[4..];
    if op == Op::Put {
        if payload.len() >= PUT_HEAD_BYTES {
            if let Ok(head) = PutHead::decode(&payload[..PUT_HEAD_BYTES], payload.len() as u32, &limits) {
                assert!(head.key_len >= 1 && u32::from(head.key_len) <= limits.max_key_bytes);
                assert!(head.inline_len <= head.total_len && head.total_len <= limits.max_value_bytes);
            }
        }
        return;
    }
    if op == Op::PutChunk {
        if let Ok(head) = PutChunkHead::decode(payload, &limits) {
            assert!(head.len <= limits.max_value_bytes);
            let mut again = Vec::new();
            head.encode(&mut again);
            assert_eq!(again, payload);
        }
        return;
    }
    let Ok(request) = Request::decode(op, payload, &limits) else { return };
    let key_ok = |k: &[u8]| !k.is_empty() && k.len() <= limits.max_key_bytes as usize;
    let max = limits.max_items as usize;
    match &request {
        Request::Get { items, .. } | Request::GetParts { items } => {
            assert!(items.len() <= max && items.iter().all(|i| key_ok(i.key)));
        }
        Request::GetRanges { keys, fragments } => {
            assert!(keys.len() <= max && fragments.len() <= max && keys.iter().all(|k| key_ok(k)));
            assert!(fragments.iter().all(|f| (f.key_index as usize) < keys.len()));
        }
        Request::Exists { keys } => assert!(keys.len() <= max && keys.iter().all(|k| key_ok(k))),
        Request::Remove { key, .. } | Request::Pin { key } | Request::Unpin { key } | Request::GetFollow { key } => {
            assert!(key_ok(key))
        }
        Request::Release { leases } => assert!(leases.len() <= max),
        Request::IndexReads { reads } => assert!(reads.len() <= max),
        Request::PutOpen { key, total_len, chunk_bytes, .. } => {
            assert!(key_ok(key) && *total_len <= limits.max_value_bytes && *chunk_bytes >= 1);
        }
        Request::PutBatch { source, items, .. } => {
            assert!(items.len() <= max && items.iter().all(|i| key_ok(i.key) && i.len <= limits.max_value_bytes));
            assert!(*source == ValueSource::Window || items.iter().all(|i| i.window_offset == 0));
            for item in items {
                if *source == ValueSource::Client {
                    assert!(item.segments.len() <= MAX_CLIENT_SEGMENTS);
                    assert_eq!(item.segments.iter().map(|(_, n)| u128::from(n)).sum::<u128>(), u128::from(item.len));
                } else {
                    assert!(item.segments.is_empty());
                }
            }
        }
        Request::RemoveBatch { keys, .. } => assert!(keys.len() <= max && keys.iter().all(|k| key_ok(k))),
        Request::ScanKeys { prefix, limit, .. } => {
            assert!(prefix.len() <= limits.max_key_bytes as usize && *limit >= 1 && *limit as usize <= max)
        }
        Request::Hello(_)
        | Request::Auth { .. }
        | Request::Stats
        | Request::PutSeal { .. }
        | Request::PutAbort { .. }
        | Request::PutWindow
        | Request::ReadIndex
        | Request::PutDirect { .. }
        | Request::UcxAttach { .. } => {}
    }
    let mut again = Vec::new();
    request.encode(&mut again);
    assert_eq!(Request::decode(op, &again, &limits).as_ref(), Ok(&request));
});
