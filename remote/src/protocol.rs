//! The wire protocol between `kvtide-owner` and `RemoteStore`: frame headers, message payloads,
//! and the validation of every field that arrives from the network.
//!
//! It is pure (no sockets, no engine), so both ends and the fuzz targets share one decoder. It
//! owns every bound check on received bytes: magic, version, operation, payload length, counts,
//! key lengths, indices and offsets are checked against the bytes actually present and the
//! configured limits before anything is allocated or touched. It never sizes an allocation from
//! a count it has not checked against the bytes that carry the counted items.
//!
//! Every operation is declared once, in the `wire_ops!` table below: its code, what the owner's
//! metrics count it as and, for a request read whole, its `Request` variant and decoder. `Op`,
//! its code lookup and names, `Request::op` and `Request::decode`'s dispatch all come from it.
//!
//! A frame is a 20-byte header and `payload_len` payload bytes (all integers little endian):
//!
//! ```text
//! magic u32 "KVTD" | version u16 | op u8 | flags u8 | request_id u64 | payload_len u32
//! ```
//!
//! Values larger than one chunk travel as a run of `Data` frames after the frame that announces
//! them, so neither side holds a whole object in a buffer: the receiver reads each chunk straight
//! into its destination (the owner's reservation, the client's buffer).

use kvtide::Error as StoreError;

use crate::Error;
use kvtide_transport::RegionError;

/// "KVTD".
pub const MAGIC: u32 = u32::from_le_bytes(*b"KVTD");
/// The only version this build speaks; a peer with another one gets `ProtocolVersion`.
pub const PROTOCOL_VERSION: u16 = 2;
/// Frame header size.
pub const HEADER_BYTES: usize = 20;
/// Challenge nonce size.
pub const NONCE_BYTES: usize = 32;
/// HMAC-SHA256 size.
pub const MAC_BYTES: usize = 32;
/// Longest key the wire can carry (u16 length); the owner's own limit is usually lower.
pub const MAX_WIRE_KEY_BYTES: usize = u16::MAX as usize;
/// Longest error message carried (longer ones are cut).
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Error index meaning "the whole request", not one of its items.
pub const WHOLE_REQUEST: u32 = u32::MAX;
/// Fixed part of a `Put` payload, before the key.
pub const PUT_HEAD_BYTES: usize = 12;

/// `Hello` flag: the client wants the arena mapping (Unix socket only).
pub const HELLO_WANT_SHM: u32 = 1;
/// `HelloOk` flag: the client must authenticate with `Auth` before anything else.
pub const HELLO_AUTH_REQUIRED: u32 = 1;
/// `HelloOk` flag: the arena memfd rides on this frame (`SCM_RIGHTS`).
pub const HELLO_SHM_ATTACHED: u32 = 2;

/// Declares every wire operation once: its code, what the owner's metrics count it as, and
/// for a request decoded whole, its `Request` variant (of the same name) and the function that
/// decodes its payload. From this table come `Op`, `Op::from_u8`, `Op::name`, `Op::kind`,
/// `Request::op` and `Request::decode`'s dispatch; adding an operation is one line here, its
/// variant and decoder (or reply encoder), and its handler.
macro_rules! wire_ops {
    (
        requests { $( $(#[$rdoc:meta])* $request:ident = $rcode:literal, $rkind:ident, $decode:ident; )* }
        streamed { $( $(#[$sdoc:meta])* $streamed:ident = $scode:literal, $skind:ident; )* }
        replies { $( $(#[$pdoc:meta])* $reply:ident = $pcode:literal; )* }
    ) => {
        /// Operations. Requests are below 64, replies from 64.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Op {
            $( $(#[$rdoc])* $request = $rcode, )*
            $( $(#[$sdoc])* $streamed = $scode, )*
            $( $(#[$pdoc])* $reply = $pcode, )*
        }

        impl Op {
            /// Every operation, in code order within requests, streamed frames and replies.
            pub const ALL: &'static [Op] = &[$( Op::$request, )* $( Op::$streamed, )* $( Op::$reply, )*];

            /// The operation with this code.
            pub fn from_u8(code: u8) -> Option<Op> {
                Some(match code {
                    $( $rcode => Op::$request, )*
                    $( $scode => Op::$streamed, )*
                    $( $pcode => Op::$reply, )*
                    _ => return None,
                })
            }

            /// The operation's name, as declared.
            pub fn name(self) -> &'static str {
                match self {
                    $( Op::$request => stringify!($request), )*
                    $( Op::$streamed => stringify!($streamed), )*
                    $( Op::$reply => stringify!($reply), )*
                }
            }

            /// What the owner's metrics count this operation as (replies: `Other`).
            pub fn kind(self) -> OpKind {
                match self {
                    $( Op::$request => OpKind::$rkind, )*
                    $( Op::$streamed => OpKind::$skind, )*
                    $( Op::$reply => OpKind::Other, )*
                }
            }
        }

        impl<'a> Request<'a> {
            /// Decodes the payload of a request frame of operation `op`.
            pub fn decode(op: Op, payload: &'a [u8], limits: &Limits) -> PResult<Request<'a>> {
                let mut r = Reader::new(payload);
                let request = match op {
                    $( Op::$request => $decode(&mut r, limits)?, )*
                    other => return Err(ProtocolError::Unexpected { expected: "a request", got: other }),
                };
                r.finish("request")?;
                Ok(request)
            }

            /// The operation code of this request.
            pub fn op(&self) -> Op {
                match self {
                    $( Request::$request { .. } => Op::$request, )*
                }
            }
        }
    };
}

wire_ops! {
    requests {
        Hello = 1, Other, decode_hello;
        Auth = 2, Other, decode_auth;
        Get = 11, Get, decode_get;
        GetRanges = 12, Get, decode_get_ranges;
        Exists = 13, Exists, decode_exists_request;
        Remove = 14, Remove, decode_remove;
        Pin = 15, Other, decode_pin;
        Unpin = 16, Other, decode_unpin;
        Stats = 17, Other, decode_stats;
        /// Releases leases granted by `Get` in lease mode. No reply.
        Release = 18, Other, decode_release;
        /// Opens a progressive put on this connection (its stream id is this request's id).
        PutOpen = 19, Put, decode_put_open;
        /// Publishes an open progressive put.
        PutSeal = 21, Put, decode_put_seal;
        /// Gives up an open progressive put.
        PutAbort = 22, Put, decode_put_abort;
        /// Reads a key as its unsealed progressive put lands (a plain streamed get without one).
        GetFollow = 23, Get, decode_get_follow;
        /// Many puts in one request, one `Statuses` reply: the values follow in `Data` frames or lie
        /// in the connection's put window.
        PutBatch = 24, Put, decode_put_batch;
        /// Many removes in one request, one `Statuses` reply.
        RemoveBatch = 25, Remove, decode_remove_batch;
        /// Asks for this connection's put window (Unix socket only): a `Window` reply carries it.
        PutWindow = 26, Put, decode_put_window;
        /// `Get` in lease mode, answered in parts (`GrantsPart` frames): the client copies each
        /// part and releases it before the owner leases more than two parts ahead.
        GetParts = 27, Get, decode_get_parts;
        /// One page of the keys that start with a prefix: a `KeyPage` reply.
        ScanKeys = 28, Other, decode_scan_keys;
        /// Asks for the owner's read index (Unix socket, arena shared): an `IndexMap` reply
        /// carries it.
        ReadIndex = 29, Other, decode_read_index;
        /// Asks the owner to read this connection's put values from the client's own memory
        /// (`process_vm_readv`): an `Ok` reply once it read the probe's nonce there.
        PutDirect = 31, Put, decode_put_direct;
        /// Reads this client made through the read index, for the owner's hit counts and
        /// eviction policy. No reply.
        IndexReads = 32, Other, decode_index_reads;
        /// Asks for the owner's UCX data plane (authenticated TCP connection): a `UcxReady`
        /// reply carries the owner's worker address and the arena's remote key.
        UcxAttach = 33, Other, decode_ucx_attach;
    }
    streamed {
        /// A put whose head (`PutHead`) and key the owner reads itself, then its value.
        Put = 10, Put;
        /// One chunk of an open progressive put; its bytes follow in `Data` frames.
        PutChunk = 20, Put;
        /// A chunk of a value (either direction).
        Data = 30, Other;
    }
    replies {
        HelloOk = 64;
        AuthOk = 65;
        Ok = 66;
        Error = 67;
        Object = 68;
        Abort = 69;
        End = 70;
        Grants = 71;
        ExistsReply = 72;
        StatsReply = 73;
        /// One status per item of a batch.
        Statuses = 74;
        /// The put window: its size, its memfd attached (`SCM_RIGHTS`).
        Window = 75;
        /// One part of the grants of a `GetParts` (the last one says so).
        GrantsPart = 76;
        /// Keys of a `ScanKeys` and the cursor of the next page.
        KeyPage = 77;
        /// The read index: its size, its memfd attached (`SCM_RIGHTS`).
        IndexMap = 78;
        /// The owner's UCX plane: version, arena range, worker address and remote key.
        UcxReady = 79;
    }
}

/// What an operation counts as in the owner's metrics (the `kind` label of its latency).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    Get,
    Put,
    Remove,
    Exists,
    Other,
}

impl OpKind {
    /// Every kind, in the order of its index (`kind as usize`).
    pub const ALL: [OpKind; 5] = [OpKind::Get, OpKind::Put, OpKind::Remove, OpKind::Exists, OpKind::Other];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            OpKind::Get => "get",
            OpKind::Put => "put",
            OpKind::Remove => "remove",
            OpKind::Exists => "exists",
            OpKind::Other => "other",
        }
    }
}

/// Why received bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad magic {found:#010x} (not a kvtide peer)")]
    BadMagic { found: u32 },
    #[error("peer speaks protocol version {theirs}, this side speaks {PROTOCOL_VERSION}")]
    Version { theirs: u16 },
    #[error("unknown operation {0}")]
    UnknownOp(u8),
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge { len: u64, max: u64 },
    #[error("truncated {what}")]
    Truncated { what: &'static str },
    #[error("{extra} unexpected trailing bytes after {what}")]
    TrailingBytes { what: &'static str, extra: usize },
    #[error("{count} {what} exceed the limit of {max}")]
    TooMany { what: &'static str, count: u64, max: u64 },
    #[error("invalid {what}")]
    Invalid { what: &'static str },
    #[error("expected {expected}, got {got:?}")]
    Unexpected { expected: &'static str, got: Op },
}

impl From<ProtocolError> for Error {
    fn from(e: ProtocolError) -> Error {
        match e {
            ProtocolError::Version { theirs } => Error::ProtocolVersion { ours: PROTOCOL_VERSION, theirs },
            other => Error::Protocol(other.to_string()),
        }
    }
}

type PResult<T> = std::result::Result<T, ProtocolError>;

/// Limits a receiver enforces on what it decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame payload.
    pub max_payload_bytes: u32,
    /// Most items (keys, fragments, leases) in one request or reply.
    pub max_items: u32,
    /// Longest key.
    pub max_key_bytes: u32,
    /// Largest value.
    pub max_value_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_payload_bytes: 4 << 20, max_items: 65_536, max_key_bytes: 1024, max_value_bytes: 1 << 40 }
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub version: u16,
    pub op: Op,
    pub flags: u8,
    pub request_id: u64,
    pub payload_len: u32,
}

impl FrameHeader {
    /// A header of this build's version.
    pub fn new(op: Op, request_id: u64, payload_len: u32) -> FrameHeader {
        FrameHeader { version: PROTOCOL_VERSION, op, flags: 0, request_id, payload_len }
    }

    /// The 20 header bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6] = self.op as u8;
        out[7] = self.flags;
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Decodes and validates a header: magic first, then version (so a peer of another version
    /// gets a clear `Version` error), then the operation and the payload length.
    pub fn decode(bytes: &[u8], max_payload_bytes: u32) -> PResult<FrameHeader> {
        let mut r = Reader::new(bytes);
        let magic = r.u32()?;
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic { found: magic });
        }
        let version = r.u16()?;
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::Version { theirs: version });
        }
        let code = r.u8()?;
        let op = Op::from_u8(code).ok_or(ProtocolError::UnknownOp(code))?;
        let flags = r.u8()?;
        let request_id = r.u64()?;
        let payload_len = r.u32()?;
        if payload_len > max_payload_bytes {
            return Err(ProtocolError::FrameTooLarge { len: payload_len.into(), max: max_payload_bytes.into() });
        }
        Ok(FrameHeader { version, op, flags, request_id, payload_len })
    }
}

/// Splits `bytes` into frames (header + payload slices), stopping at the first error or at an
/// incomplete frame (returned as `Truncated`). Used by tests and the frame-decoder fuzz target.
pub fn split_frames(bytes: &[u8], max_payload_bytes: u32) -> (Vec<(FrameHeader, &[u8])>, Option<ProtocolError>) {
    let mut frames = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        if rest.len() < HEADER_BYTES {
            return (frames, Some(ProtocolError::Truncated { what: "frame header" }));
        }
        let header = match FrameHeader::decode(&rest[..HEADER_BYTES], max_payload_bytes) {
            Ok(h) => h,
            Err(e) => return (frames, Some(e)),
        };
        let end = HEADER_BYTES + header.payload_len as usize;
        let Some(payload) = rest.get(HEADER_BYTES..end) else {
            return (frames, Some(ProtocolError::Truncated { what: "frame payload" }));
        };
        frames.push((header, payload));
        rest = &rest[end..];
    }
    (frames, None)
}

// ---- reading and writing payload fields ------------------------------------------------------

/// A bounds-checked cursor over a payload.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize, what: &'static str) -> PResult<&'a [u8]> {
        if n > self.buf.len() {
            return Err(ProtocolError::Truncated { what });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> PResult<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> PResult<u8> {
        Ok(self.array::<1>("u8")?[0])
    }

    pub fn u16(&mut self) -> PResult<u16> {
        Ok(u16::from_le_bytes(self.array("u16")?))
    }

    pub fn u32(&mut self) -> PResult<u32> {
        Ok(u32::from_le_bytes(self.array("u32")?))
    }

    pub fn u64(&mut self) -> PResult<u64> {
        Ok(u64::from_le_bytes(self.array("u64")?))
    }

    /// A key: u16 length (1..=max) and its bytes.
    pub fn key(&mut self, max_key_bytes: u32) -> PResult<&'a [u8]> {
        let len = self.u16()? as usize;
        if len == 0 || len > max_key_bytes as usize {
            return Err(ProtocolError::Invalid { what: "key length" });
        }
        self.take(len, "key")
    }

    /// A u32 count of items each at least `min_item_bytes` long: refused when above `max` or
    /// when the payload cannot hold that many items, so it is safe to reserve capacity for.
    pub fn count(&mut self, min_item_bytes: usize, max: u32, what: &'static str) -> PResult<usize> {
        let count = self.u32()?;
        if count > max {
            return Err(ProtocolError::TooMany { what, count: count.into(), max: max.into() });
        }
        let count = count as usize;
        if count.checked_mul(min_item_bytes).is_none_or(|bytes| bytes > self.remaining()) {
            return Err(ProtocolError::Truncated { what });
        }
        Ok(count)
    }

    /// Succeeds when every byte was consumed.
    pub fn finish(self, what: &'static str) -> PResult<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ProtocolError::TrailingBytes { what, extra: self.buf.len() })
        }
    }
}

/// Little-endian appends to a payload buffer.
pub trait Put {
    fn put_u8(&mut self, v: u8);
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
    /// u16 length + bytes (callers keep keys at most `MAX_WIRE_KEY_BYTES` long).
    fn put_key(&mut self, key: &[u8]);
}

impl Put for Vec<u8> {
    fn put_u8(&mut self, v: u8) {
        self.push(v);
    }
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_key(&mut self, key: &[u8]) {
        let len = key.len().min(MAX_WIRE_KEY_BYTES);
        self.put_u16(len as u16);
        self.extend_from_slice(&key[..len]);
    }
}

/// Starts a frame in `buf`; returns where it starts, for `end_frame`.
pub fn begin_frame(buf: &mut Vec<u8>, op: Op, request_id: u64) -> usize {
    let start = buf.len();
    buf.extend_from_slice(&FrameHeader::new(op, request_id, 0).encode());
    start
}

/// Fills in the payload length of the frame begun at `start`.
pub fn end_frame(buf: &mut [u8], start: usize) {
    let payload_len = (buf.len() - start - HEADER_BYTES) as u32;
    buf[start + 16..start + 20].copy_from_slice(&payload_len.to_le_bytes());
}

/// A whole frame with this payload.
pub fn frame(op: Op, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER_BYTES + payload.len());
    let start = begin_frame(&mut buf, op, request_id);
    buf.extend_from_slice(payload);
    end_frame(&mut buf, start);
    buf
}

// ---- handshake -------------------------------------------------------------------------------

/// The client's first frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub client_nonce: [u8; NONCE_BYTES],
    pub flags: u32,
}

impl Hello {
    pub fn encode(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&self.client_nonce);
        buf.put_u32(self.flags);
    }

    pub fn decode(payload: &[u8]) -> PResult<Hello> {
        let mut r = Reader::new(payload);
        let client_nonce = r.array("client nonce")?;
        let flags = r.u32()?;
        r.finish("hello")?;
        Ok(Hello { client_nonce, flags })
    }
}

/// The owner's answer to `Hello`: its limits, its challenge, and the arena it shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloOk {
    pub flags: u32,
    pub max_payload_bytes: u32,
    pub chunk_bytes: u32,
    pub max_items: u32,
    pub max_leases: u32,
    pub lease_ttl_ms: u32,
    pub max_key_bytes: u32,
    pub max_value_bytes: u64,
    pub server_nonce: [u8; NONCE_BYTES],
    /// Differs per owner start: a client keeps one mapping per instance.
    pub instance_id: u64,
    /// Length of the shared arena (0 without shared memory).
    pub arena_bytes: u64,
}

/// Smallest chunk and payload limit a peer may announce.
pub const MIN_CHUNK_BYTES: u32 = 4096;

impl HelloOk {
    pub fn encode(&self, buf: &mut Vec<u8>) {
        buf.put_u32(self.flags);
        buf.put_u32(self.max_payload_bytes);
        buf.put_u32(self.chunk_bytes);
        buf.put_u32(self.max_items);
        buf.put_u32(self.max_leases);
        buf.put_u32(self.lease_ttl_ms);
        buf.put_u32(self.max_key_bytes);
        buf.put_u64(self.max_value_bytes);
        buf.extend_from_slice(&self.server_nonce);
        buf.put_u64(self.instance_id);
        buf.put_u64(self.arena_bytes);
    }

    /// Decodes and checks that the announced limits are usable.
    pub fn decode(payload: &[u8]) -> PResult<HelloOk> {
        let mut r = Reader::new(payload);
        let hello = HelloOk {
            flags: r.u32()?,
            max_payload_bytes: r.u32()?,
            chunk_bytes: r.u32()?,
            max_items: r.u32()?,
            max_leases: r.u32()?,
            lease_ttl_ms: r.u32()?,
            max_key_bytes: r.u32()?,
            max_value_bytes: r.u64()?,
            server_nonce: r.array("server nonce")?,
            instance_id: r.u64()?,
            arena_bytes: r.u64()?,
        };
        r.finish("hello reply")?;
        if hello.chunk_bytes < MIN_CHUNK_BYTES || hello.chunk_bytes > hello.max_payload_bytes {
            return Err(ProtocolError::Invalid { what: "chunk size" });
        }
        if hello.max_key_bytes == 0 || hello.max_key_bytes as usize > MAX_WIRE_KEY_BYTES {
            return Err(ProtocolError::Invalid { what: "key limit" });
        }
        if hello.max_items == 0 {
            return Err(ProtocolError::Invalid { what: "item limit" });
        }
        if hello.flags & HELLO_SHM_ATTACHED != 0 && hello.arena_bytes == 0 {
            return Err(ProtocolError::Invalid { what: "arena size" });
        }
        Ok(hello)
    }

    /// The limits a client enforces on replies from this owner.
    pub fn limits(&self) -> Limits {
        Limits {
            max_payload_bytes: self.max_payload_bytes,
            max_items: self.max_items,
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes,
        }
    }
}

/// A 32-byte MAC payload (`Auth`, `AuthOk`).
pub fn decode_mac(payload: &[u8]) -> PResult<[u8; MAC_BYTES]> {
    let mut r = Reader::new(payload);
    let mac = r.array("mac")?;
    r.finish("mac")?;
    Ok(mac)
}

// ---- requests --------------------------------------------------------------------------------

/// How the owner checks an object's length before sending it (mirrors the embedded checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LenCheck {
    /// Any length (`get`).
    Any,
    /// At most this many bytes, else `BufferTooSmall` (`get_into`).
    AtMost(u64),
    /// Exactly this many bytes, else `SizeMismatch` (`batch_get_into_multi_buffers`).
    Exactly(u64),
}

impl LenCheck {
    fn encode(&self, buf: &mut Vec<u8>) {
        let (tag, value) = match *self {
            LenCheck::Any => (0, 0),
            LenCheck::AtMost(n) => (1, n),
            LenCheck::Exactly(n) => (2, n),
        };
        buf.put_u8(tag);
        buf.put_u64(value);
    }

    fn decode(r: &mut Reader<'_>) -> PResult<LenCheck> {
        let tag = r.u8()?;
        let value = r.u64()?;
        match tag {
            0 => Ok(LenCheck::Any),
            1 => Ok(LenCheck::AtMost(value)),
            2 => Ok(LenCheck::Exactly(value)),
            _ => Err(ProtocolError::Invalid { what: "length check" }),
        }
    }

    /// The error the embedded engine reports for an object of `len` bytes, if any.
    pub fn check(&self, len: u64) -> Result<(), StoreError> {
        match *self {
            LenCheck::AtMost(max) if len > max => {
                Err(StoreError::BufferTooSmall { object_bytes: len, buffer_bytes: max })
            }
            LenCheck::Exactly(n) if len != n => {
                Err(StoreError::SizeMismatch { object_bytes: len, destination_bytes: n })
            }
            _ => Ok(()),
        }
    }
}

/// One key of a `Get`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetItem<'a> {
    pub key: &'a [u8],
    pub check: LenCheck,
}

/// One fragment of a `GetRanges`: bytes `[src_offset, src_offset + len)` of `keys[key_index]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeItem {
    pub key_index: u32,
    pub src_offset: u64,
    pub len: u64,
}

/// `Get` flag: grant leases on the shared arena instead of streaming the bytes.
pub const GET_LEASE: u8 = 1;
/// `Put` flag: replace an existing object.
pub const PUT_UPSERT: u8 = 1;
/// `Put` flag: pin the object as it is published.
pub const PUT_PIN: u8 = 2;
/// `Remove` flag: remove even when leased or pinned.
pub const REMOVE_FORCE: u8 = 1;

/// Where the values of a `PutBatch` come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueSource {
    /// The values follow in `Data` frames, in item order.
    Stream = 0,
    /// Each value lies in the connection's put window at its offset.
    Window = 1,
    /// Each value lies in the client's memory at its segments; the owner reads them there
    /// (only on a connection whose `PutDirect` it accepted).
    Client = 2,
}

/// Most segments one value read from the client's memory may have.
pub const MAX_CLIENT_SEGMENTS: usize = 64;
/// Bytes of the nonce a `PutDirect` probe reads from the client.
pub const PROBE_BYTES: usize = 16;
/// Wire bytes of one client segment (address, length).
const CLIENT_SEGMENT_BYTES: usize = 16;

/// Where a value lies in the client's memory: (address, length) pairs in the client's address
/// space, kept as their wire bytes (validated: at most `MAX_CLIENT_SEGMENTS`, lengths summing
/// to the value's). Addresses are the client's to vouch for; the kernel checks them on read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientSegments<'a>(&'a [u8]);

impl<'a> ClientSegments<'a> {
    /// Appends `segments` in wire form (without their count) to `buf`.
    pub fn encode(segments: impl IntoIterator<Item = (u64, u64)>, buf: &mut Vec<u8>) {
        for (addr, len) in segments {
            buf.put_u64(addr);
            buf.put_u64(len);
        }
    }

    /// Segments from their wire form (as `encode` wrote them); None when `bytes` is not whole
    /// segments.
    pub fn from_wire(bytes: &'a [u8]) -> Option<ClientSegments<'a>> {
        bytes.len().is_multiple_of(CLIENT_SEGMENT_BYTES).then_some(ClientSegments(bytes))
    }

    pub fn len(&self) -> usize {
        self.0.len() / CLIENT_SEGMENT_BYTES
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The (address, length) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.0.chunks_exact(CLIENT_SEGMENT_BYTES).map(|c| {
            let (addr, len) = c.split_at(8);
            (
                u64::from_le_bytes(addr.try_into().unwrap_or_default()),
                u64::from_le_bytes(len.try_into().unwrap_or_default()),
            )
        })
    }
}

const MIN_KEY_BYTES: usize = 3; // u16 length + at least one byte
const PUT_ITEM_BYTES: usize = MIN_KEY_BYTES + 16;
const GET_ITEM_BYTES: usize = MIN_KEY_BYTES + 9;
const RANGE_ITEM_BYTES: usize = 20;

/// A request other than the streamed `Put`/`Data`, decoded and validated. Keys borrow the
/// payload; every vector was sized from a count checked against the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Hello(Hello),
    Auth {
        mac: [u8; MAC_BYTES],
    },
    Get {
        lease: bool,
        items: Vec<GetItem<'a>>,
    },
    GetRanges {
        keys: Vec<&'a [u8]>,
        fragments: Vec<RangeItem>,
    },
    Exists {
        keys: Vec<&'a [u8]>,
    },
    Remove {
        key: &'a [u8],
        force: bool,
    },
    Pin {
        key: &'a [u8],
    },
    Unpin {
        key: &'a [u8],
    },
    Stats,
    Release {
        leases: Vec<u64>,
    },
    /// A progressive put of `total_len` bytes in chunks of `chunk_bytes`.
    PutOpen {
        key: &'a [u8],
        total_len: u64,
        chunk_bytes: u64,
        upsert: bool,
        pin: bool,
    },
    PutSeal {
        stream: u64,
    },
    PutAbort {
        stream: u64,
    },
    GetFollow {
        key: &'a [u8],
    },
    /// Puts of `items`, their values from `source` (for `Stream`, `Data` frames of this request
    /// id, item after item).
    PutBatch {
        upsert: bool,
        pin: bool,
        source: ValueSource,
        items: Vec<PutItem<'a>>,
    },
    RemoveBatch {
        keys: Vec<&'a [u8]>,
        force: bool,
    },
    PutWindow,
    ReadIndex,
    /// Asks for puts read from the client's memory; the owner reads `PROBE_BYTES` at `probe`
    /// there and expects `nonce`.
    PutDirect {
        probe: u64,
        nonce: [u8; PROBE_BYTES],
    },
    /// `(shard, slot, generation)` of the read index entries read.
    IndexReads {
        reads: Vec<(u32, u32, u32)>,
    },
    GetParts {
        items: Vec<GetItem<'a>>,
    },
    /// The client's UCX plane version.
    UcxAttach {
        version: u32,
    },
    /// Keys that start with `prefix` (possibly empty), from `cursor`, at most `limit`.
    ScanKeys {
        prefix: &'a [u8],
        cursor: u64,
        limit: u32,
    },
}

/// One value of a `PutBatch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutItem<'a> {
    pub key: &'a [u8],
    pub len: u64,
    /// Where the value starts in the put window (0 for other sources).
    pub window_offset: u64,
    /// Where the value lies in the client's memory (empty for other sources).
    pub segments: ClientSegments<'a>,
}

impl<'a> Request<'a> {
    /// Appends this request's payload (the inverse of `decode`).
    pub fn encode(&self, buf: &mut Vec<u8>) {
        match self {
            Request::Hello(h) => h.encode(buf),
            Request::Auth { mac } => buf.extend_from_slice(mac),
            Request::Get { lease, items } => {
                buf.put_u8(if *lease { GET_LEASE } else { 0 });
                buf.put_u32(items.len() as u32);
                for item in items {
                    buf.put_key(item.key);
                    item.check.encode(buf);
                }
            }
            Request::GetRanges { keys, fragments } => {
                encode_keys(buf, keys);
                buf.put_u32(fragments.len() as u32);
                for f in fragments {
                    buf.put_u32(f.key_index);
                    buf.put_u64(f.src_offset);
                    buf.put_u64(f.len);
                }
            }
            Request::Exists { keys } => encode_keys(buf, keys),
            Request::Remove { key, force } => {
                buf.put_u8(if *force { REMOVE_FORCE } else { 0 });
                buf.put_key(key);
            }
            Request::Pin { key } | Request::Unpin { key } | Request::GetFollow { key } => buf.put_key(key),
            Request::Stats => {}
            Request::Release { leases } => {
                buf.put_u32(leases.len() as u32);
                leases.iter().for_each(|&l| buf.put_u64(l));
            }
            Request::PutOpen { key, total_len, chunk_bytes, upsert, pin } => {
                buf.put_u8(if *upsert { PUT_UPSERT } else { 0 } | if *pin { PUT_PIN } else { 0 });
                buf.put_key(key);
                buf.put_u64(*total_len);
                buf.put_u64(*chunk_bytes);
            }
            Request::PutSeal { stream } | Request::PutAbort { stream } => buf.put_u64(*stream),
            Request::PutBatch { upsert, pin, source, items } => {
                buf.put_u8(if *upsert { PUT_UPSERT } else { 0 } | if *pin { PUT_PIN } else { 0 });
                buf.put_u8(*source as u8);
                buf.put_u32(items.len() as u32);
                for item in items {
                    buf.put_key(item.key);
                    buf.put_u64(item.len);
                    match source {
                        ValueSource::Client => {
                            buf.put_u16(item.segments.len() as u16);
                            buf.extend_from_slice(item.segments.0);
                        }
                        ValueSource::Stream | ValueSource::Window => buf.put_u64(item.window_offset),
                    }
                }
            }
            Request::RemoveBatch { keys, force } => {
                buf.put_u8(if *force { REMOVE_FORCE } else { 0 });
                encode_keys(buf, keys);
            }
            Request::PutWindow | Request::ReadIndex => {}
            Request::UcxAttach { version } => buf.put_u32(*version),
            Request::PutDirect { probe, nonce } => {
                buf.put_u64(*probe);
                buf.extend_from_slice(nonce);
            }
            Request::IndexReads { reads } => {
                buf.put_u32(reads.len() as u32);
                for &(shard, slot, generation) in reads {
                    buf.put_u32(shard);
                    buf.put_u32(slot);
                    buf.put_u32(generation);
                }
            }
            Request::GetParts { items } => {
                buf.put_u32(items.len() as u32);
                for item in items {
                    buf.put_key(item.key);
                    item.check.encode(buf);
                }
            }
            Request::ScanKeys { prefix, cursor, limit } => {
                buf.put_u64(*cursor);
                buf.put_u32(*limit);
                buf.put_u16(prefix.len() as u16);
                buf.extend_from_slice(prefix);
            }
        }
    }
}

// ---- request decoders (one per request of the `wire_ops!` table) ---------------------------------

fn decode_hello<'a>(r: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    let payload = r.take(r.remaining(), "hello")?;
    Hello::decode(payload).map(Request::Hello)
}

fn decode_auth<'a>(r: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    let payload = r.take(r.remaining(), "mac")?;
    decode_mac(payload).map(|mac| Request::Auth { mac })
}

fn decode_get_items<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Vec<GetItem<'a>>> {
    let count = r.count(GET_ITEM_BYTES, limits.max_items, "keys")?;
    let mut items = Vec::with_capacity(count);
    for _ in 0..count {
        let key = r.key(limits.max_key_bytes)?;
        let check = LenCheck::decode(r)?;
        items.push(GetItem { key, check });
    }
    Ok(items)
}

fn decode_get<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let flags = r.u8()?;
    if flags & !GET_LEASE != 0 {
        return Err(ProtocolError::Invalid { what: "get flags" });
    }
    Ok(Request::Get { lease: flags & GET_LEASE != 0, items: decode_get_items(r, limits)? })
}

fn decode_get_parts<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    Ok(Request::GetParts { items: decode_get_items(r, limits)? })
}

fn decode_get_ranges<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let keys = decode_keys(r, limits)?;
    let count = r.count(RANGE_ITEM_BYTES, limits.max_items, "fragments")?;
    let mut fragments = Vec::with_capacity(count);
    for _ in 0..count {
        let item = RangeItem { key_index: r.u32()?, src_offset: r.u64()?, len: r.u64()? };
        if item.key_index as usize >= keys.len() {
            return Err(ProtocolError::Invalid { what: "fragment key index" });
        }
        // Ranges are checked against the object (overflow-safe) when it is leased, so a bad one
        // fails only its own fragment.
        fragments.push(item);
    }
    Ok(Request::GetRanges { keys, fragments })
}

fn decode_exists_request<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    Ok(Request::Exists { keys: decode_keys(r, limits)? })
}

/// The flags byte of a remove: whether it is forced.
fn decode_remove_flags(r: &mut Reader<'_>) -> PResult<bool> {
    let flags = r.u8()?;
    if flags & !REMOVE_FORCE != 0 {
        return Err(ProtocolError::Invalid { what: "remove flags" });
    }
    Ok(flags & REMOVE_FORCE != 0)
}

fn decode_remove<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let force = decode_remove_flags(r)?;
    Ok(Request::Remove { key: r.key(limits.max_key_bytes)?, force })
}

fn decode_remove_batch<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let force = decode_remove_flags(r)?;
    Ok(Request::RemoveBatch { keys: decode_keys(r, limits)?, force })
}

fn decode_pin<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    Ok(Request::Pin { key: r.key(limits.max_key_bytes)? })
}

fn decode_unpin<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    Ok(Request::Unpin { key: r.key(limits.max_key_bytes)? })
}

fn decode_get_follow<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    Ok(Request::GetFollow { key: r.key(limits.max_key_bytes)? })
}

fn decode_stats<'a>(_: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    Ok(Request::Stats)
}

fn decode_put_window<'a>(_: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    Ok(Request::PutWindow)
}

fn decode_read_index<'a>(_: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    Ok(Request::ReadIndex)
}

fn decode_ucx_attach<'a>(r: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    Ok(Request::UcxAttach { version: r.u32()? })
}

fn decode_put_direct<'a>(r: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    let probe = r.u64()?;
    let nonce = r.array("probe nonce")?;
    Ok(Request::PutDirect { probe, nonce })
}

/// The flags byte of a put: (upsert, pin).
fn decode_put_flags(r: &mut Reader<'_>) -> PResult<(bool, bool)> {
    let flags = r.u8()?;
    if flags & !(PUT_UPSERT | PUT_PIN) != 0 {
        return Err(ProtocolError::Invalid { what: "put flags" });
    }
    Ok((flags & PUT_UPSERT != 0, flags & PUT_PIN != 0))
}

fn decode_put_open<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let (upsert, pin) = decode_put_flags(r)?;
    let key = r.key(limits.max_key_bytes)?;
    let total_len = r.u64()?;
    let chunk_bytes = r.u64()?;
    if total_len > limits.max_value_bytes {
        return Err(ProtocolError::FrameTooLarge { len: total_len, max: limits.max_value_bytes });
    }
    if chunk_bytes == 0 {
        return Err(ProtocolError::Invalid { what: "chunk size" });
    }
    Ok(Request::PutOpen { key, total_len, chunk_bytes, upsert, pin })
}

fn decode_put_seal<'a>(r: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    Ok(Request::PutSeal { stream: r.u64()? })
}

fn decode_put_abort<'a>(r: &mut Reader<'a>, _: &Limits) -> PResult<Request<'a>> {
    Ok(Request::PutAbort { stream: r.u64()? })
}

fn decode_put_batch<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let (upsert, pin) = decode_put_flags(r)?;
    let source = match r.u8()? {
        0 => ValueSource::Stream,
        1 => ValueSource::Window,
        2 => ValueSource::Client,
        _ => return Err(ProtocolError::Invalid { what: "put source" }),
    };
    let min_item_bytes = if source == ValueSource::Client { MIN_KEY_BYTES + 10 } else { PUT_ITEM_BYTES };
    let count = r.count(min_item_bytes, limits.max_items, "puts")?;
    let mut items = Vec::with_capacity(count);
    for _ in 0..count {
        let key = r.key(limits.max_key_bytes)?;
        let len = r.u64()?;
        if len > limits.max_value_bytes {
            return Err(ProtocolError::FrameTooLarge { len, max: limits.max_value_bytes });
        }
        let item = match source {
            // Window ranges are checked against the window by the owner, which knows it.
            ValueSource::Window => PutItem { key, len, window_offset: r.u64()?, segments: ClientSegments::default() },
            ValueSource::Stream => {
                if r.u64()? != 0 {
                    return Err(ProtocolError::Invalid { what: "window offset of a streamed value" });
                }
                PutItem { key, len, window_offset: 0, segments: ClientSegments::default() }
            }
            ValueSource::Client => PutItem { key, len, window_offset: 0, segments: decode_segments(r, len)? },
        };
        items.push(item);
    }
    Ok(Request::PutBatch { upsert, pin, source, items })
}

/// A value's client segments: a u16 count (at most `MAX_CLIENT_SEGMENTS`), then the pairs,
/// whose lengths must add up to `len`.
fn decode_segments<'a>(r: &mut Reader<'a>, len: u64) -> PResult<ClientSegments<'a>> {
    let count = usize::from(r.u16()?);
    if count > MAX_CLIENT_SEGMENTS {
        return Err(ProtocolError::TooMany {
            what: "client segments",
            count: count as u64,
            max: MAX_CLIENT_SEGMENTS as u64,
        });
    }
    let segments = ClientSegments(r.take(count * CLIENT_SEGMENT_BYTES, "client segments")?);
    let total = segments.iter().try_fold(0u64, |sum, (_, n)| sum.checked_add(n));
    if total != Some(len) {
        return Err(ProtocolError::Invalid { what: "client segments that do not add up to the value" });
    }
    Ok(segments)
}

fn decode_scan_keys<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let cursor = r.u64()?;
    let limit = r.u32()?;
    if limit == 0 || limit > limits.max_items {
        return Err(ProtocolError::TooMany { what: "scan limit", count: limit.into(), max: limits.max_items.into() });
    }
    let len = r.u16()? as usize;
    if len > limits.max_key_bytes as usize {
        return Err(ProtocolError::Invalid { what: "prefix length" });
    }
    Ok(Request::ScanKeys { prefix: r.take(len, "prefix")?, cursor, limit })
}

fn decode_release<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let count = r.count(8, limits.max_items, "leases")?;
    let mut leases = Vec::with_capacity(count);
    for _ in 0..count {
        leases.push(r.u64()?);
    }
    Ok(Request::Release { leases })
}

fn decode_index_reads<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Request<'a>> {
    let count = r.count(12, limits.max_items, "index reads")?;
    let mut reads = Vec::with_capacity(count);
    for _ in 0..count {
        reads.push((r.u32()?, r.u32()?, r.u32()?));
    }
    Ok(Request::IndexReads { reads })
}

fn decode_keys<'a>(r: &mut Reader<'a>, limits: &Limits) -> PResult<Vec<&'a [u8]>> {
    let count = r.count(MIN_KEY_BYTES, limits.max_items, "keys")?;
    let mut keys = Vec::with_capacity(count);
    for _ in 0..count {
        keys.push(r.key(limits.max_key_bytes)?);
    }
    Ok(keys)
}

fn encode_keys(buf: &mut Vec<u8>, keys: &[&[u8]]) {
    buf.put_u32(keys.len() as u32);
    keys.iter().for_each(|k| buf.put_key(k));
}

/// Payload bytes of a `PutChunk` frame.
pub const PUT_CHUNK_HEAD_BYTES: usize = 20;

/// A `PutChunk` frame's payload: `stream u64 | index u32 | len u64`; `len` bytes of the chunk
/// follow in `Data` frames of the same request id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutChunkHead {
    pub stream: u64,
    pub index: u32,
    pub len: u64,
}

impl PutChunkHead {
    pub fn encode(&self, buf: &mut Vec<u8>) {
        buf.put_u64(self.stream);
        buf.put_u32(self.index);
        buf.put_u64(self.len);
    }

    /// Validates a `PutChunk` payload (exactly `PUT_CHUNK_HEAD_BYTES`; a chunk no longer than
    /// the largest value).
    pub fn decode(payload: &[u8], limits: &Limits) -> PResult<PutChunkHead> {
        let mut r = Reader::new(payload);
        let head = PutChunkHead { stream: r.u64()?, index: r.u32()?, len: r.u64()? };
        r.finish("put chunk head")?;
        if head.len > limits.max_value_bytes {
            return Err(ProtocolError::FrameTooLarge { len: head.len, max: limits.max_value_bytes });
        }
        Ok(head)
    }
}

/// The fixed start of a `Put` payload: `flags u8 | reserved u8 | key_len u16 | total_len u64`,
/// then the key, then the first bytes of the value ("inline"); the rest follows in `Data`
/// frames of the same request id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutHead {
    pub upsert: bool,
    pub pin: bool,
    pub key_len: u16,
    pub total_len: u64,
    /// Value bytes in the `Put` frame itself, after the key.
    pub inline_len: u64,
}

impl PutHead {
    /// Appends the fixed part (the caller appends the key and the inline bytes).
    pub fn encode(buf: &mut Vec<u8>, upsert: bool, pin: bool, key: &[u8], total_len: u64) {
        buf.put_u8(if upsert { PUT_UPSERT } else { 0 } | if pin { PUT_PIN } else { 0 });
        buf.put_u8(0);
        buf.put_u16(key.len().min(MAX_WIRE_KEY_BYTES) as u16);
        buf.put_u64(total_len);
    }

    /// Validates the fixed part of a `Put` whose whole payload is `payload_len` bytes.
    pub fn decode(head: &[u8], payload_len: u32, limits: &Limits) -> PResult<PutHead> {
        let mut r = Reader::new(head);
        let flags = r.u8()?;
        let reserved = r.u8()?;
        let key_len = r.u16()?;
        let total_len = r.u64()?;
        r.finish("put head")?;
        if flags & !(PUT_UPSERT | PUT_PIN) != 0 || reserved != 0 {
            return Err(ProtocolError::Invalid { what: "put flags" });
        }
        if key_len == 0 || u32::from(key_len) > limits.max_key_bytes {
            return Err(ProtocolError::Invalid { what: "key length" });
        }
        let Some(inline_len) = u64::from(payload_len).checked_sub((PUT_HEAD_BYTES + usize::from(key_len)) as u64)
        else {
            return Err(ProtocolError::Truncated { what: "put key" });
        };
        if total_len > limits.max_value_bytes {
            return Err(ProtocolError::FrameTooLarge { len: total_len, max: limits.max_value_bytes });
        }
        if inline_len > total_len {
            return Err(ProtocolError::Invalid { what: "put inline length" });
        }
        Ok(PutHead { upsert: flags & PUT_UPSERT != 0, pin: flags & PUT_PIN != 0, key_len, total_len, inline_len })
    }
}

// ---- replies ---------------------------------------------------------------------------------

/// `Object` frame: item `index` succeeded and `len` bytes follow in `Data` frames.
pub fn decode_object(payload: &[u8]) -> PResult<(u32, u64)> {
    let mut r = Reader::new(payload);
    let index = r.u32()?;
    let len = r.u64()?;
    r.finish("object")?;
    Ok((index, len))
}

/// Appends an `Object` payload.
pub fn encode_object(buf: &mut Vec<u8>, index: u32, len: u64) {
    buf.put_u32(index);
    buf.put_u64(len);
}

/// `Error` / `Abort` frame: item `index` (or `WHOLE_REQUEST`) failed.
pub fn decode_error_frame(payload: &[u8]) -> PResult<(u32, Error)> {
    let mut r = Reader::new(payload);
    let index = r.u32()?;
    let error = decode_error(&mut r)?;
    r.finish("error")?;
    Ok((index, error))
}

/// Appends an `Error` / `Abort` payload.
pub fn encode_error_frame(buf: &mut Vec<u8>, index: u32, error: &Error) {
    buf.put_u32(index);
    encode_error(buf, error);
}

/// One lease granted on the shared arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub lease: u64,
    /// Offset of the object's first byte within the arena mapping.
    pub offset: u64,
    pub len: u64,
}

impl Grant {
    /// Checks that the granted bytes lie inside an arena of `arena_bytes`.
    pub fn check(&self, arena_bytes: u64) -> PResult<()> {
        match self.offset.checked_add(self.len) {
            Some(end) if end <= arena_bytes => Ok(()),
            _ => Err(ProtocolError::Invalid { what: "grant outside the arena" }),
        }
    }
}

/// Appends a `Grants` payload.
pub fn encode_grants(buf: &mut Vec<u8>, ttl_ms: u32, grants: &[Result<Grant, Error>]) {
    buf.put_u32(ttl_ms);
    buf.put_u32(grants.len() as u32);
    grants.iter().for_each(|g| encode_grant(buf, g));
}

/// One grant (tag 0 and the lease, offset and length) or its error (tag 1).
fn encode_grant(buf: &mut Vec<u8>, grant: &Result<Grant, Error>) {
    match grant {
        Ok(g) => {
            buf.put_u8(0);
            buf.put_u64(g.lease);
            buf.put_u64(g.offset);
            buf.put_u64(g.len);
        }
        Err(e) => {
            buf.put_u8(1);
            encode_error(buf, e);
        }
    }
}

/// The inverse of `encode_grant`; a grant is checked against `arena_bytes`.
fn decode_grant(r: &mut Reader<'_>, arena_bytes: u64) -> PResult<Result<Grant, Error>> {
    match r.u8()? {
        0 => {
            let g = Grant { lease: r.u64()?, offset: r.u64()?, len: r.u64()? };
            g.check(arena_bytes)?;
            Ok(Ok(g))
        }
        1 => Ok(Err(decode_error(r)?)),
        _ => Err(ProtocolError::Invalid { what: "grant tag" }),
    }
}

/// Decodes a `Grants` payload; every grant is checked against `arena_bytes`.
pub fn decode_grants(payload: &[u8], max_items: u32, arena_bytes: u64) -> PResult<(u32, Vec<Result<Grant, Error>>)> {
    let mut r = Reader::new(payload);
    let ttl_ms = r.u32()?;
    let count = r.count(1 + 24, max_items, "grants")?;
    let mut grants = Vec::with_capacity(count);
    for _ in 0..count {
        grants.push(decode_grant(&mut r, arena_bytes)?);
    }
    r.finish("grants")?;
    Ok((ttl_ms, grants))
}

/// Appends a `Statuses` payload: per item 0 (done) or 1 and its error.
pub fn encode_statuses(buf: &mut Vec<u8>, statuses: &[Result<(), Error>]) {
    buf.put_u32(statuses.len() as u32);
    for status in statuses {
        match status {
            Ok(()) => buf.put_u8(0),
            Err(e) => {
                buf.put_u8(1);
                encode_error(buf, e);
            }
        }
    }
}

/// Decodes a `Statuses` payload.
pub fn decode_statuses(payload: &[u8], max_items: u32) -> PResult<Vec<Result<(), Error>>> {
    let mut r = Reader::new(payload);
    let count = r.count(1, max_items, "statuses")?;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(match r.u8()? {
            0 => Ok(()),
            1 => Err(decode_error(&mut r)?),
            _ => return Err(ProtocolError::Invalid { what: "status tag" }),
        });
    }
    r.finish("statuses")?;
    Ok(out)
}

/// Decodes a `Window` payload: the window's size, at least `min_bytes` and at most `max_bytes`.
pub fn decode_window(payload: &[u8], min_bytes: u64, max_bytes: u64) -> PResult<u64> {
    let mut r = Reader::new(payload);
    let bytes = r.u64()?;
    r.finish("window")?;
    if bytes < min_bytes || bytes > max_bytes {
        return Err(ProtocolError::Invalid { what: "put window size" });
    }
    Ok(bytes)
}

/// Decodes an `IndexMap` payload: the read index's length in bytes, at most `max_bytes`.
pub fn decode_index_map(payload: &[u8], max_bytes: u64) -> PResult<u64> {
    let mut r = Reader::new(payload);
    let bytes = r.u64()?;
    r.finish("index map")?;
    if bytes == 0 || bytes > max_bytes {
        return Err(ProtocolError::Invalid { what: "read index size" });
    }
    Ok(bytes)
}

/// Most bytes of a UCX worker address or packed remote key in a `UcxReady`.
pub const MAX_UCX_BLOB_BYTES: usize = 64 << 10;

/// A `UcxReady` reply: the owner's UCX plane. The digest covers every field before it, so a
/// blob damaged or cut on its way is refused before UCX is asked to unpack it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxReady {
    pub version: u32,
    /// The arena's address in the owner and its length: grants' offsets count from `base`.
    pub base: u64,
    pub len: u64,
    pub worker_address: Vec<u8>,
    pub rkey: Vec<u8>,
}

impl UcxReady {
    pub fn encode(&self, buf: &mut Vec<u8>) {
        let start = buf.len();
        buf.put_u32(self.version);
        buf.put_u64(self.base);
        buf.put_u64(self.len);
        buf.put_u32(self.worker_address.len() as u32);
        buf.extend_from_slice(&self.worker_address);
        buf.put_u32(self.rkey.len() as u32);
        buf.extend_from_slice(&self.rkey);
        let digest = xxhash_rust::xxh3::xxh3_64(&buf[start..]);
        buf.put_u64(digest);
    }

    /// Decodes and checks a `UcxReady` payload (blobs present, at most `MAX_UCX_BLOB_BYTES`,
    /// the arena range not wrapping, the digest right).
    pub fn decode(payload: &[u8]) -> PResult<UcxReady> {
        let mut r = Reader::new(payload);
        let version = r.u32()?;
        let base = r.u64()?;
        let len = r.u64()?;
        let mut blob = |what| -> PResult<Vec<u8>> {
            let n = r.u32()? as usize;
            if n == 0 || n > MAX_UCX_BLOB_BYTES {
                return Err(ProtocolError::Invalid { what });
            }
            Ok(r.take(n, what)?.to_vec())
        };
        let worker_address = blob("UCX worker address")?;
        let rkey = blob("UCX remote key")?;
        let covered = payload.len() - r.remaining();
        let digest = r.u64()?;
        r.finish("UCX plane")?;
        if digest != xxhash_rust::xxh3::xxh3_64(&payload[..covered]) {
            return Err(ProtocolError::Invalid { what: "UCX plane digest" });
        }
        if len == 0 || base.checked_add(len).is_none() {
            return Err(ProtocolError::Invalid { what: "UCX arena range" });
        }
        Ok(UcxReady { version, base, len, worker_address, rkey })
    }
}

/// One part of a `GetParts` answer: the grants of some of its items, by item index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantsPart {
    pub ttl_ms: u32,
    /// What comes after this part.
    pub next: NextPart,
    pub grants: Vec<(u32, Result<Grant, Error>)>,
}

/// What follows a `GrantsPart`, and what the owner waits for before it leases it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextPart {
    /// This is the last part.
    None,
    /// More parts follow; the next is leased once the client released this one (and every
    /// earlier one).
    AfterRelease,
    /// More parts follow; the next is leased once the client released every earlier part, while
    /// it still holds this one (so it may copy this part while the next is leased).
    WhileHeld,
}

impl GrantsPart {
    /// Appends a `GrantsPart` payload.
    pub fn encode(&self, buf: &mut Vec<u8>) {
        buf.put_u32(self.ttl_ms);
        buf.put_u8(match self.next {
            NextPart::AfterRelease => 0,
            NextPart::None => 1,
            NextPart::WhileHeld => 2,
        });
        buf.put_u32(self.grants.len() as u32);
        for (index, g) in &self.grants {
            buf.put_u32(*index);
            encode_grant(buf, g);
        }
    }

    /// Decodes a part of the answer to a request of `items` items; every index is checked
    /// against `items` and every grant against `arena_bytes`.
    pub fn decode(payload: &[u8], max_items: u32, items: usize, arena_bytes: u64) -> PResult<GrantsPart> {
        let mut r = Reader::new(payload);
        let ttl_ms = r.u32()?;
        let next = match r.u8()? {
            0 => NextPart::AfterRelease,
            1 => NextPart::None,
            2 => NextPart::WhileHeld,
            _ => return Err(ProtocolError::Invalid { what: "next-part flag" }),
        };
        let count = r.count(4 + 1 + 24, max_items, "grants")?;
        let mut grants = Vec::with_capacity(count);
        for _ in 0..count {
            let index = r.u32()?;
            if index as usize >= items {
                return Err(ProtocolError::Invalid { what: "grant index" });
            }
            grants.push((index, decode_grant(&mut r, arena_bytes)?));
        }
        r.finish("grants part")?;
        Ok(GrantsPart { ttl_ms, next, grants })
    }
}

/// The cursor a `KeyPage` sends for "no more pages".
const SCAN_DONE: u64 = u64::MAX;

/// Appends a `KeyPage` payload.
pub fn encode_key_page(buf: &mut Vec<u8>, page: &kvtide::KeyPage) {
    buf.put_u64(page.cursor.unwrap_or(SCAN_DONE));
    buf.put_u32(page.keys.len() as u32);
    for key in &page.keys {
        buf.put_key(key);
    }
}

/// Decodes a `KeyPage` payload.
pub fn decode_key_page(payload: &[u8], limits: &Limits) -> PResult<kvtide::KeyPage> {
    let mut r = Reader::new(payload);
    let cursor = r.u64()?;
    let count = r.count(MIN_KEY_BYTES, limits.max_items, "scanned keys")?;
    let mut keys = Vec::with_capacity(count);
    for _ in 0..count {
        keys.push(r.key(limits.max_key_bytes)?.to_vec());
    }
    r.finish("key page")?;
    Ok(kvtide::KeyPage { keys, cursor: (cursor != SCAN_DONE).then_some(cursor) })
}

/// Appends an `ExistsReply` payload.
pub fn encode_exists(buf: &mut Vec<u8>, found: &[Result<bool, Error>]) {
    buf.put_u32(found.len() as u32);
    for f in found {
        match f {
            Ok(present) => buf.put_u8(u8::from(*present)),
            Err(e) => {
                buf.put_u8(2);
                encode_error(buf, e);
            }
        }
    }
}

/// Decodes an `ExistsReply` payload.
pub fn decode_exists(payload: &[u8], max_items: u32) -> PResult<Vec<Result<bool, Error>>> {
    let mut r = Reader::new(payload);
    let count = r.count(1, max_items, "exists results")?;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(match r.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            2 => Err(decode_error(&mut r)?),
            _ => return Err(ProtocolError::Invalid { what: "exists tag" }),
        });
    }
    r.finish("exists results")?;
    Ok(out)
}

// ---- errors on the wire ------------------------------------------------------------------------

// Codes are part of the protocol: never renumber, only add.
const E_NOT_FOUND: u16 = 1;
const E_ALREADY_EXISTS: u16 = 2;
const E_NO_SPACE: u16 = 3;
const E_TOO_LARGE: u16 = 4;
const E_EMPTY_KEY: u16 = 5;
const E_OUT_OF_BOUNDS: u16 = 6;
const E_READ_ONLY: u16 = 7;
const E_NULL: u16 = 8;
const E_SIZE_MISMATCH: u16 = 9;
const E_BUFFER_TOO_SMALL: u16 = 10;
const E_INVALID_ARGUMENT: u16 = 11;
const E_CORRUPTED: u16 = 12;
const E_IO: u16 = 13;
const E_LEASE_EXPIRED: u16 = 14;
const E_LEASED: u16 = 15;
const E_PINNED: u16 = 16;
const E_NOT_PINNED: u16 = 17;
const E_CUDA_UNAVAILABLE: u16 = 18;
const E_BUSY: u16 = 19;
const E_CANCELLED: u16 = 20;
const E_SHUTTING_DOWN: u16 = 21;
const E_UNAUTHORIZED: u16 = 22;
const E_PROTOCOL_VERSION: u16 = 23;
const E_PROTOCOL: u16 = 24;
const E_PRODUCER_ABORTED: u16 = 25;
const E_STREAM_CAPTURING: u16 = 26;
const E_STREAM: u16 = 27;
const E_STREAM_EXPIRED: u16 = 28;
const E_OTHER: u16 = 100;

/// Labels that errors carry as `&'static str`, restored by name on the receiving side.
const LABELS: &[&str] = &["key", "value", "buffer", "object", "source", "destination", "fragment", "frame"];

fn label(text: &str) -> &'static str {
    LABELS.iter().copied().find(|l| *l == text).unwrap_or("field")
}

/// Appends one error: code u16 | a u64 | b u64 | c u64 | message (u16 length + UTF-8).
pub fn encode_error(buf: &mut Vec<u8>, error: &Error) {
    let (code, a, b, c, message): (u16, u64, u64, u64, String) = match error {
        Error::Store(e) => store_error_code(e),
        Error::Unauthorized(m) => (E_UNAUTHORIZED, 0, 0, 0, m.clone()),
        Error::ProtocolVersion { ours, theirs } => {
            (E_PROTOCOL_VERSION, (*ours).into(), (*theirs).into(), 0, String::new())
        }
        Error::Protocol(m) => (E_PROTOCOL, 0, 0, 0, m.clone()),
        // The failures only a client sees locally (and the owner's own reports) travel as their
        // message.
        other @ (Error::Disconnected(_) | Error::Timeout { .. } | Error::Remote(_)) => {
            (E_OTHER, 0, 0, 0, other.to_string())
        }
    };
    buf.put_u16(code);
    buf.put_u64(a);
    buf.put_u64(b);
    buf.put_u64(c);
    let mut end = message.len().min(MAX_MESSAGE_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    buf.put_u16(end as u16);
    buf.extend_from_slice(&message.as_bytes()[..end]);
}

/// The code and fields of an engine error.
fn store_error_code(error: &StoreError) -> (u16, u64, u64, u64, String) {
    match error {
        StoreError::NotFound => (E_NOT_FOUND, 0, 0, 0, String::new()),
        StoreError::AlreadyExists => (E_ALREADY_EXISTS, 0, 0, 0, String::new()),
        StoreError::NoSpace => (E_NO_SPACE, 0, 0, 0, String::new()),
        StoreError::TooLarge { what, len, max } => (E_TOO_LARGE, *len, *max, 0, (*what).to_string()),
        StoreError::EmptyKey => (E_EMPTY_KEY, 0, 0, 0, String::new()),
        StoreError::InvalidRange(RegionError::OutOfBounds { what, offset, len, bound }) => {
            (E_OUT_OF_BOUNDS, *offset, *len, *bound, (*what).to_string())
        }
        StoreError::InvalidRange(RegionError::ReadOnly) => (E_READ_ONLY, 0, 0, 0, String::new()),
        StoreError::InvalidRange(RegionError::Null) => (E_NULL, 0, 0, 0, String::new()),
        StoreError::SizeMismatch { object_bytes, destination_bytes } => {
            (E_SIZE_MISMATCH, *object_bytes, *destination_bytes, 0, String::new())
        }
        StoreError::BufferTooSmall { object_bytes, buffer_bytes } => {
            (E_BUFFER_TOO_SMALL, *object_bytes, *buffer_bytes, 0, String::new())
        }
        StoreError::InvalidArgument(m) => (E_INVALID_ARGUMENT, 0, 0, 0, m.clone()),
        StoreError::Corrupted(m) => (E_CORRUPTED, 0, 0, 0, m.clone()),
        StoreError::Io(m) => (E_IO, 0, 0, 0, m.clone()),
        StoreError::LeaseExpired => (E_LEASE_EXPIRED, 0, 0, 0, String::new()),
        StoreError::Leased => (E_LEASED, 0, 0, 0, String::new()),
        StoreError::Pinned => (E_PINNED, 0, 0, 0, String::new()),
        StoreError::NotPinned => (E_NOT_PINNED, 0, 0, 0, String::new()),
        StoreError::CudaUnavailable(why) => (E_CUDA_UNAVAILABLE, 0, 0, 0, (*why).to_string()),
        StoreError::Busy { limit } => (E_BUSY, *limit as u64, 0, 0, String::new()),
        StoreError::Cancelled => (E_CANCELLED, 0, 0, 0, String::new()),
        StoreError::ShuttingDown => (E_SHUTTING_DOWN, 0, 0, 0, String::new()),
        StoreError::ProducerAborted(why) => (E_PRODUCER_ABORTED, 0, 0, 0, why.clone()),
        StoreError::StreamCapturing(how) => (E_STREAM_CAPTURING, 0, 0, 0, (*how).to_string()),
        StoreError::Stream(why) => (E_STREAM, 0, 0, 0, why.clone()),
        StoreError::StreamExpired { ttl_ms } => (E_STREAM_EXPIRED, *ttl_ms, 0, 0, String::new()),
        // Everything else (internal errors, GPU failures, ...) travels as its message.
        other @ (StoreError::Cuda(_) | StoreError::Internal(_)) => (E_OTHER, 0, 0, 0, other.to_string()),
    }
}

/// Reads one error written by `encode_error`.
pub fn decode_error(r: &mut Reader<'_>) -> PResult<Error> {
    let code = r.u16()?;
    let a = r.u64()?;
    let b = r.u64()?;
    let c = r.u64()?;
    let len = r.u16()? as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::Invalid { what: "error message length" });
    }
    let message = std::str::from_utf8(r.take(len, "error message")?)
        .map_err(|_| ProtocolError::Invalid { what: "error message encoding" })?
        .to_string();
    let store = match code {
        E_NOT_FOUND => StoreError::NotFound,
        E_ALREADY_EXISTS => StoreError::AlreadyExists,
        E_NO_SPACE => StoreError::NoSpace,
        E_TOO_LARGE => StoreError::TooLarge { what: label(&message), len: a, max: b },
        E_EMPTY_KEY => StoreError::EmptyKey,
        E_OUT_OF_BOUNDS => {
            StoreError::InvalidRange(RegionError::OutOfBounds { what: label(&message), offset: a, len: b, bound: c })
        }
        E_READ_ONLY => StoreError::InvalidRange(RegionError::ReadOnly),
        E_NULL => StoreError::InvalidRange(RegionError::Null),
        E_SIZE_MISMATCH => StoreError::SizeMismatch { object_bytes: a, destination_bytes: b },
        E_BUFFER_TOO_SMALL => StoreError::BufferTooSmall { object_bytes: a, buffer_bytes: b },
        E_INVALID_ARGUMENT => StoreError::InvalidArgument(message),
        E_CORRUPTED => StoreError::Corrupted(message),
        E_IO => StoreError::Io(message),
        E_LEASE_EXPIRED => StoreError::LeaseExpired,
        E_LEASED => StoreError::Leased,
        E_PINNED => StoreError::Pinned,
        E_NOT_PINNED => StoreError::NotPinned,
        E_CUDA_UNAVAILABLE => StoreError::CudaUnavailable("reported by the owner"),
        E_BUSY => StoreError::Busy { limit: usize::try_from(a).unwrap_or(usize::MAX) },
        E_CANCELLED => StoreError::Cancelled,
        E_SHUTTING_DOWN => StoreError::ShuttingDown,
        E_PRODUCER_ABORTED => StoreError::ProducerAborted(message),
        E_STREAM_CAPTURING => {
            StoreError::StreamCapturing(if message == "invalidated" { "invalidated" } else { "active" })
        }
        E_STREAM => StoreError::Stream(message),
        E_STREAM_EXPIRED => StoreError::StreamExpired { ttl_ms: a },
        E_UNAUTHORIZED => return Ok(Error::Unauthorized(message)),
        // The sender's "ours" is the receiver's "theirs".
        E_PROTOCOL_VERSION => {
            return Ok(Error::ProtocolVersion {
                ours: u16::try_from(b).unwrap_or(u16::MAX),
                theirs: u16::try_from(a).unwrap_or(u16::MAX),
            })
        }
        E_PROTOCOL => return Ok(Error::Protocol(message)),
        _ => return Ok(Error::Remote(message)),
    };
    Ok(Error::Store(store))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_declared_op_has_one_code_and_one_name() {
        let mut codes = std::collections::HashSet::new();
        let mut names = std::collections::HashSet::new();
        for &op in Op::ALL {
            assert_eq!(Op::from_u8(op as u8), Some(op), "{}", op.name());
            assert!(codes.insert(op as u8) && names.insert(op.name()), "{} declared twice", op.name());
        }
        assert_eq!((0..=u8::MAX).filter_map(Op::from_u8).count(), Op::ALL.len());
        assert_eq!(Op::GetParts.kind(), OpKind::Get);
        assert_eq!(Op::PutChunk.kind(), OpKind::Put);
        assert_eq!(Op::Grants.kind(), OpKind::Other);
        let request = Request::Exists { keys: vec![b"k"] };
        assert_eq!(request.op(), Op::Exists);
        assert_eq!(request.op().name(), "Exists");
    }

    #[test]
    fn header_round_trip_and_checks() {
        let h = FrameHeader::new(Op::Get, 7, 100);
        let bytes = h.encode();
        assert_eq!(FrameHeader::decode(&bytes, 100), Ok(h));
        assert!(matches!(FrameHeader::decode(&bytes, 99), Err(ProtocolError::FrameTooLarge { .. })));
        let mut bad = bytes;
        bad[0] ^= 1;
        assert!(matches!(FrameHeader::decode(&bad, 100), Err(ProtocolError::BadMagic { .. })));
        let mut v2 = bytes;
        v2[4] = 9;
        assert_eq!(FrameHeader::decode(&v2, 100), Err(ProtocolError::Version { theirs: 9 }));
        let mut op = bytes;
        op[6] = 200;
        assert_eq!(FrameHeader::decode(&op, 100), Err(ProtocolError::UnknownOp(200)));
        assert!(matches!(FrameHeader::decode(&bytes[..10], 100), Err(ProtocolError::Truncated { .. })));
    }

    #[test]
    fn requests_round_trip() {
        let limits = Limits::default();
        let mut segments = Vec::new();
        ClientSegments::encode([(0x1000, 4), (0x2000, 8)], &mut segments);
        let requests = vec![
            Request::Get {
                lease: true,
                items: vec![
                    GetItem { key: b"a", check: LenCheck::Any },
                    GetItem { key: b"bb", check: LenCheck::Exactly(5) },
                    GetItem { key: b"c", check: LenCheck::AtMost(9) },
                ],
            },
            Request::GetRanges {
                keys: vec![b"k1", b"k2"],
                fragments: vec![RangeItem { key_index: 1, src_offset: 3, len: 4 }],
            },
            Request::Exists { keys: vec![b"x", b"y"] },
            Request::Remove { key: b"r", force: true },
            Request::Pin { key: b"p" },
            Request::Unpin { key: b"p" },
            Request::Stats,
            Request::Release { leases: vec![1, 2, 3] },
            Request::Auth { mac: [7; MAC_BYTES] },
            Request::Hello(Hello { client_nonce: [3; NONCE_BYTES], flags: HELLO_WANT_SHM }),
            Request::PutBatch {
                upsert: true,
                pin: false,
                source: ValueSource::Window,
                items: vec![
                    PutItem { key: b"a", len: 10, window_offset: 0, segments: ClientSegments::default() },
                    PutItem { key: b"bb", len: 0, window_offset: 10, segments: ClientSegments::default() },
                ],
            },
            Request::PutBatch {
                upsert: false,
                pin: true,
                source: ValueSource::Stream,
                items: vec![PutItem { key: b"s", len: 1 << 20, window_offset: 0, segments: ClientSegments::default() }],
            },
            Request::PutBatch {
                upsert: false,
                pin: false,
                source: ValueSource::Client,
                items: vec![
                    PutItem { key: b"c", len: 12, window_offset: 0, segments: ClientSegments(&segments) },
                    PutItem { key: b"e", len: 0, window_offset: 0, segments: ClientSegments::default() },
                ],
            },
            Request::PutDirect { probe: 0x7fff_0000_1000, nonce: [9; PROBE_BYTES] },
            Request::IndexReads { reads: vec![(0, 7, 3), (5, u32::MAX, 1)] },
            Request::RemoveBatch { keys: vec![b"x", b"yy"], force: true },
            Request::PutWindow,
            Request::ReadIndex,
            Request::UcxAttach { version: 7 },
            Request::GetParts {
                items: vec![
                    GetItem { key: b"a", check: LenCheck::Any },
                    GetItem { key: b"b", check: LenCheck::Exactly(4) },
                ],
            },
        ];
        for req in requests {
            let mut buf = Vec::new();
            req.encode(&mut buf);
            assert_eq!(Request::decode(req.op(), &buf, &limits).as_ref(), Ok(&req));
            // Every strict prefix is refused, never a panic.
            for cut in 0..buf.len() {
                assert!(Request::decode(req.op(), &buf[..cut], &limits).is_err() || cut == buf.len());
            }
        }
    }

    #[test]
    fn a_ucx_plane_answer_is_checked_whole_before_use() {
        let ready = UcxReady {
            version: 1,
            base: 0x7f00_0000_0000,
            len: 1 << 30,
            worker_address: vec![7; 90],
            rkey: vec![9; 40],
        };
        let mut buf = Vec::new();
        ready.encode(&mut buf);
        assert_eq!(UcxReady::decode(&buf), Ok(ready.clone()));
        for cut in 0..buf.len() {
            assert!(UcxReady::decode(&buf[..cut]).is_err(), "cut at {cut}");
        }
        for at in 0..buf.len() {
            let mut bad = buf.clone();
            bad[at] ^= 0x20;
            assert!(UcxReady::decode(&bad).is_err(), "a flipped byte at {at} was accepted");
        }
        let mut long = buf.clone();
        long.push(0);
        assert!(UcxReady::decode(&long).is_err());
        for broken in [
            UcxReady { worker_address: Vec::new(), ..ready.clone() },
            UcxReady { rkey: vec![1; MAX_UCX_BLOB_BYTES + 1], ..ready.clone() },
            UcxReady { len: 0, ..ready.clone() },
            UcxReady { base: u64::MAX - 5, ..ready.clone() },
        ] {
            let mut b = Vec::new();
            broken.encode(&mut b);
            assert!(UcxReady::decode(&b).is_err(), "{broken:?}");
        }
    }

    #[test]
    fn counts_are_checked_before_allocating() {
        let mut buf = Vec::new();
        buf.put_u32(u32::MAX);
        assert!(matches!(Request::decode(Op::Exists, &buf, &Limits::default()), Err(ProtocolError::TooMany { .. })));
        let mut buf = Vec::new();
        buf.put_u32(1000);
        assert!(matches!(Request::decode(Op::Exists, &buf, &Limits::default()), Err(ProtocolError::Truncated { .. })));
        let mut buf = Vec::new();
        buf.put_u32(1);
        buf.put_key(b"k");
        buf.put_u32(1);
        buf.put_u32(5); // key index out of range
        buf.put_u64(0);
        buf.put_u64(1);
        assert!(matches!(Request::decode(Op::GetRanges, &buf, &Limits::default()), Err(ProtocolError::Invalid { .. })));
    }

    #[test]
    fn put_batches_are_checked() {
        let limits = Limits { max_value_bytes: 1000, ..Limits::default() };
        let encode = |source: ValueSource, len: u64, window_offset: u64| {
            let mut buf = Vec::new();
            let segments = [0u8; 0];
            Request::PutBatch {
                upsert: false,
                pin: false,
                source,
                items: vec![PutItem { key: b"k", len, window_offset, segments: ClientSegments(&segments) }],
            }
            .encode(&mut buf);
            buf
        };
        assert!(Request::decode(Op::PutBatch, &encode(ValueSource::Window, 1000, 5), &limits).is_ok());
        let too_large = encode(ValueSource::Window, 1001, 0);
        assert!(matches!(Request::decode(Op::PutBatch, &too_large, &limits), Err(ProtocolError::FrameTooLarge { .. })));
        let streamed_offset = encode(ValueSource::Stream, 10, 5);
        assert!(matches!(Request::decode(Op::PutBatch, &streamed_offset, &limits), Err(ProtocolError::Invalid { .. })));
        let mut bad_source = encode(ValueSource::Window, 10, 0);
        bad_source[1] = 7;
        assert!(matches!(Request::decode(Op::PutBatch, &bad_source, &limits), Err(ProtocolError::Invalid { .. })));
        let mut bad_flags = encode(ValueSource::Window, 10, 0);
        bad_flags[0] = 0x80;
        assert!(matches!(Request::decode(Op::PutBatch, &bad_flags, &limits), Err(ProtocolError::Invalid { .. })));
        let mut many = vec![0u8, 0];
        many.put_u32(u32::MAX);
        assert!(matches!(Request::decode(Op::PutBatch, &many, &limits), Err(ProtocolError::TooMany { .. })));
    }

    #[test]
    fn client_segments_are_checked() {
        let limits = Limits { max_value_bytes: 1 << 20, ..Limits::default() };
        let encode = |len: u64, pairs: &[(u64, u64)]| {
            let mut segments = Vec::new();
            ClientSegments::encode(pairs.iter().copied(), &mut segments);
            let mut buf = Vec::new();
            Request::PutBatch {
                upsert: false,
                pin: false,
                source: ValueSource::Client,
                items: vec![PutItem { key: b"k", len, window_offset: 0, segments: ClientSegments(&segments) }],
            }
            .encode(&mut buf);
            buf
        };
        let decoded = |buf: &[u8]| Request::decode(Op::PutBatch, buf, &limits).map(|_| ());
        assert_eq!(decoded(&encode(12, &[(1, 4), (9, 8)])), Ok(()));
        // Lengths that do not add up, or that overflow while adding.
        assert!(matches!(decoded(&encode(13, &[(1, 4), (9, 8)])), Err(ProtocolError::Invalid { .. })));
        assert!(matches!(decoded(&encode(3, &[(1, u64::MAX), (9, 4)])), Err(ProtocolError::Invalid { .. })));
        // More segments than a value may have.
        let many: Vec<(u64, u64)> = (0..=MAX_CLIENT_SEGMENTS as u64).map(|i| (i, 1)).collect();
        assert!(matches!(decoded(&encode(many.len() as u64, &many)), Err(ProtocolError::TooMany { .. })));
        // A count that promises more segments than follow.
        let mut short = encode(12, &[(1, 4), (9, 8)]);
        short.truncate(short.len() - 1);
        assert!(matches!(decoded(&short), Err(ProtocolError::Truncated { .. })));
        assert!(ClientSegments::from_wire(&[0u8; 17]).is_none());
    }

    #[test]
    fn grant_parts_round_trip_and_are_checked() {
        for next in [NextPart::AfterRelease, NextPart::WhileHeld] {
            let mut buf = Vec::new();
            GrantsPart { ttl_ms: 5, next, grants: Vec::new() }.encode(&mut buf);
            assert_eq!(GrantsPart::decode(&buf, 16, 3, 1 << 20).map(|p| p.next), Ok(next));
            buf[4] = 3;
            assert!(GrantsPart::decode(&buf, 16, 3, 1 << 20).is_err(), "an unknown next-part flag");
        }
        let part = GrantsPart {
            ttl_ms: 1000,
            next: NextPart::None,
            grants: vec![
                (2, Ok(Grant { lease: 7, offset: 4096, len: 100 })),
                (0, Err(Error::from(StoreError::NotFound))),
            ],
        };
        let mut buf = Vec::new();
        part.encode(&mut buf);
        assert_eq!(GrantsPart::decode(&buf, 16, 3, 1 << 20), Ok(part));
        for cut in 0..buf.len() {
            assert!(GrantsPart::decode(&buf[..cut], 16, 3, 1 << 20).is_err());
        }
        assert!(GrantsPart::decode(&buf, 16, 2, 1 << 20).is_err(), "index past the request");
        assert!(GrantsPart::decode(&buf, 16, 3, 4100).is_err(), "grant outside the arena");
    }

    #[test]
    fn statuses_and_window_round_trip() {
        let statuses = vec![Ok(()), Err(Error::from(StoreError::AlreadyExists)), Ok(())];
        let mut buf = Vec::new();
        encode_statuses(&mut buf, &statuses);
        assert_eq!(decode_statuses(&buf, 16), Ok(statuses));
        for cut in 0..buf.len() {
            assert!(decode_statuses(&buf[..cut], 16).is_err());
        }
        assert!(matches!(decode_statuses(&buf, 2), Err(ProtocolError::TooMany { .. })));
        let mut window = Vec::new();
        window.put_u64(1 << 20);
        assert_eq!(decode_window(&window, 4096, 1 << 30), Ok(1 << 20));
        assert!(decode_window(&window, 4096, 1 << 19).is_err());
        assert!(decode_window(&window[..7], 4096, 1 << 30).is_err());
    }

    #[test]
    fn put_head_validation() {
        let limits = Limits { max_value_bytes: 1000, ..Limits::default() };
        let mut buf = Vec::new();
        PutHead::encode(&mut buf, true, false, b"key", 100);
        let head = PutHead::decode(&buf, (PUT_HEAD_BYTES + 3 + 40) as u32, &limits).expect("valid");
        assert_eq!(head, PutHead { upsert: true, pin: false, key_len: 3, total_len: 100, inline_len: 40 });
        assert!(PutHead::decode(&buf, 5, &limits).is_err());
        assert!(PutHead::decode(&buf, (PUT_HEAD_BYTES + 3 + 101) as u32, &limits).is_err());
        let mut big = Vec::new();
        PutHead::encode(&mut big, false, false, b"key", 1001);
        assert!(PutHead::decode(&big, (PUT_HEAD_BYTES + 3) as u32, &limits).is_err());
    }

    #[test]
    fn errors_round_trip() {
        // Every engine error that has a code, and every remote-only error the owner sends.
        let errors: Vec<Error> = vec![
            StoreError::NotFound.into(),
            StoreError::AlreadyExists.into(),
            StoreError::NoSpace.into(),
            StoreError::TooLarge { what: "key", len: 5, max: 4 }.into(),
            StoreError::EmptyKey.into(),
            StoreError::InvalidRange(RegionError::OutOfBounds { what: "object", offset: 1, len: 2, bound: 3 }).into(),
            StoreError::InvalidRange(RegionError::ReadOnly).into(),
            StoreError::InvalidRange(RegionError::Null).into(),
            StoreError::SizeMismatch { object_bytes: 1, destination_bytes: 2 }.into(),
            StoreError::BufferTooSmall { object_bytes: 3, buffer_bytes: 2 }.into(),
            StoreError::InvalidArgument("x".into()).into(),
            StoreError::Corrupted("crc".into()).into(),
            StoreError::Io("eio".into()).into(),
            StoreError::LeaseExpired.into(),
            StoreError::Leased.into(),
            StoreError::Pinned.into(),
            StoreError::NotPinned.into(),
            StoreError::Busy { limit: 9 }.into(),
            StoreError::Cancelled.into(),
            StoreError::ShuttingDown.into(),
            StoreError::ProducerAborted("it aborted".into()).into(),
            StoreError::StreamCapturing("invalidated").into(),
            StoreError::Stream("another GPU's stream".into()).into(),
            StoreError::StreamExpired { ttl_ms: 60_000 }.into(),
            Error::Unauthorized("bad mac".into()),
            Error::Protocol("truncated".into()),
        ];
        for e in errors {
            let mut buf = Vec::new();
            encode_error_frame(&mut buf, 3, &e);
            assert_eq!(decode_error_frame(&buf), Ok((3, e)));
        }
        // The version mismatch is seen from the other side.
        let mut buf = Vec::new();
        encode_error_frame(&mut buf, 0, &Error::ProtocolVersion { ours: 1, theirs: 2 });
        assert_eq!(decode_error_frame(&buf), Ok((0, Error::ProtocolVersion { ours: 2, theirs: 1 })));
        // The reason of a CUDA refusal is a static label; the code survives.
        let mut buf = Vec::new();
        encode_error(&mut buf, &StoreError::CudaUnavailable("no driver").into());
        assert_eq!(
            decode_error(&mut Reader::new(&buf)),
            Ok(StoreError::CudaUnavailable("reported by the owner").into())
        );
        // Errors without a code travel as their message.
        for (e, text) in [
            (Error::from(StoreError::Internal("boom")), "the engine broke an internal invariant: boom"),
            (StoreError::Cuda("launch".into()).into(), "GPU transfer failed: launch"),
            (Error::Remote("odd".into()), "the owner reported: odd"),
            (Error::Disconnected("reset".into()), "disconnected from the owner: reset"),
            (Error::Timeout { op: "get", timeout_ms: 5 }, "get timed out after 5 ms"),
        ] {
            let mut buf = Vec::new();
            encode_error(&mut buf, &e);
            assert_eq!(decode_error(&mut Reader::new(&buf)), Ok(Error::Remote(text.into())));
        }
    }

    #[test]
    fn grants_are_checked_against_the_arena() {
        let mut buf = Vec::new();
        encode_grants(&mut buf, 1000, &[Ok(Grant { lease: 1, offset: 10, len: 10 }), Err(StoreError::NotFound.into())]);
        let (ttl, grants) = decode_grants(&buf, 10, 20).expect("fits");
        assert_eq!(ttl, 1000);
        assert_eq!(grants.len(), 2);
        assert!(decode_grants(&buf, 10, 19).is_err());
        let mut buf = Vec::new();
        encode_grants(&mut buf, 1, &[Ok(Grant { lease: 1, offset: u64::MAX, len: 2 })]);
        assert!(decode_grants(&buf, 10, u64::MAX).is_err());
    }

    #[test]
    fn split_frames_stops_at_truncation() {
        let mut bytes = frame(Op::Stats, 1, &[]);
        bytes.extend_from_slice(&frame(Op::Pin, 2, &[1, 0, b'k']));
        let (frames, err) = split_frames(&bytes, 1024);
        assert_eq!(frames.len(), 2);
        assert!(err.is_none());
        let (frames, err) = split_frames(&bytes[..bytes.len() - 1], 1024);
        assert_eq!(frames.len(), 1);
        assert!(matches!(err, Some(ProtocolError::Truncated { .. })));
    }
}
