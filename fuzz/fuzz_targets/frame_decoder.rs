//! Fuzzes the owner's and the client's frame decoder: any byte stream is split into frames
//! (magic, version, operation and payload length checked before a payload is sliced), and every
//! frame's payload goes through the decoder of its operation. Nothing may panic, a decoded
//! header re-encodes to itself, a decoded request survives encode/decode unchanged, and no
//! accepted frame claims more bytes than the limit.
#![no_main]

use kvtide_remote::protocol::{
    decode_error_frame, decode_exists, decode_grants, decode_object, split_frames, FrameHeader, HelloOk, Limits, Op,
    PutHead, Request, UcxReady, HEADER_BYTES, MAX_UCX_BLOB_BYTES, PUT_HEAD_BYTES,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the payload limit, so small and large limits are both explored.
    let Some((&pick, stream)) = data.split_first() else { return };
    let max = (u32::from(pick) + 1) * 256;
    let limits = Limits { max_payload_bytes: max, max_items: 64, max_key_bytes: 300, max_value_bytes: 1 << 30 };
    let (frames, _error) = split_frames(stream, max);
    let mut consumed = 0usize;
    for (header, payload) in frames {
        assert!(header.payload_len <= max);
        assert_eq!(payload.len(), header.payload_len as usize);
        assert_eq!(FrameHeader::decode(&header.encode(), max), Ok(header));
        consumed += HEADER_BYTES + payload.len();
        match header.op {
            Op::Put => {
                if payload.len() >= PUT_HEAD_BYTES {
                    if let Ok(head) = PutHead::decode(&payload[..PUT_HEAD_BYTES], header.payload_len, &limits) {
                        assert!(head.inline_len <= head.total_len && head.total_len <= limits.max_value_bytes);
                        assert!(PUT_HEAD_BYTES + usize::from(head.key_len) + head.inline_len as usize == payload.len());
                    }
                }
            }
            Op::HelloOk => {
                if let Ok(h) = HelloOk::decode(payload) {
                    assert!(h.chunk_bytes <= h.max_payload_bytes);
                }
            }
            Op::Grants => {
                if let Ok((_, grants)) = decode_grants(payload, limits.max_items, 1 << 20) {
                    for g in grants.into_iter().flatten() {
                        assert!(g.offset.checked_add(g.len).is_some_and(|end| end <= 1 << 20));
                    }
                }
            }
            Op::ExistsReply => {
                if let Ok(found) = decode_exists(payload, limits.max_items) {
                    assert!(found.len() <= limits.max_items as usize);
                }
            }
            Op::UcxReady => {
                // What a client hands UCX: only a plane that decodes whole, digest and all.
                if let Ok(ready) = UcxReady::decode(payload) {
                    assert!(!ready.worker_address.is_empty() && ready.worker_address.len() <= MAX_UCX_BLOB_BYTES);
                    assert!(!ready.rkey.is_empty() && ready.rkey.len() <= MAX_UCX_BLOB_BYTES);
                    assert!(ready.len > 0 && ready.base.checked_add(ready.len).is_some());
                    let mut again = Vec::new();
                    ready.encode(&mut again);
                    assert_eq!(again, payload);
                }
            }
            Op::Error | Op::Abort => drop(decode_error_frame(payload)),
            Op::Object => drop(decode_object(payload)),
            op => {
                if let Ok(request) = Request::decode(op, payload, &limits) {
                    let mut again = Vec::new();
                    request.encode(&mut again);
                    assert_eq!(Request::decode(op, &again, &limits).as_ref(), Ok(&request));
                }
            }
        }
    }
    assert!(consumed <= stream.len());
});
