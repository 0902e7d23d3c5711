//! The one place the owner writes reply frames: a handler names its answer (`Reply`) and
//! `Connection::reply` queues it (`Reply::push`) on the connection's write buffer;
//! `Reply::frame` builds the same bytes for a socket that has no connection yet (a refusal at
//! accept).
//!
//! Owns the mapping from an answer to its operation code and payload encoder. Never flushes
//! (the connection loop and the handlers that must flush do) and never sends value bytes (`Data`
//! frames go out through `FrameIo::push_data` as their chunks are ready).

use crate::error::{Error, Result};
use crate::protocol::{
    begin_frame, encode_error_frame, encode_exists, encode_grants, encode_key_page, encode_object, encode_statuses,
    end_frame, Grant, GrantsPart, HelloOk, Op, UcxReady, MAC_BYTES,
};
use crate::wire::FrameIo;

/// An answer to a request, as the handler decided it.
pub(super) enum Reply<'r> {
    /// `HelloOk`: the owner's limits and challenge.
    HelloOk(&'r HelloOk),
    /// `AuthOk`: the owner's proof that it knows the token too.
    AuthOk(&'r [u8; MAC_BYTES]),
    /// `Ok`: the request succeeded.
    Ok,
    /// `Error` about item `index` (`WHOLE_REQUEST`: the request itself).
    Error { index: u32, error: &'r Error },
    /// `Abort`: item `index`'s bytes stop part way.
    Abort { index: u32, error: &'r Error },
    /// `Object`: item `index` follows, `len` bytes in `Data` frames.
    Object { index: u32, len: u64 },
    /// `End`: a streamed answer is complete.
    End,
    /// `Grants`: leases of a lease-mode `Get`, valid for `ttl_ms`.
    Grants { ttl_ms: u32, grants: &'r [Result<Grant>] },
    /// `GrantsPart`: one part of a `GetParts`.
    GrantsPart(&'r GrantsPart),
    /// `ExistsReply`: per key, whether it exists.
    Exists(&'r [Result<bool>]),
    /// `StatsReply`: the engine's statistics, as TOML.
    Stats(&'r str),
    /// `Statuses`: per item of a batch, its outcome.
    Statuses(&'r [Result<()>]),
    /// `Window`: the put window's size (its memfd rides on the flush).
    Window { bytes: u64 },
    /// `IndexMap`: the read index's length (its memfd rides on the flush).
    IndexMap { bytes: u64 },
    /// `UcxReady`: the owner's UCX plane.
    UcxReady(&'r UcxReady),
    /// `KeyPage`: one page of a `ScanKeys`.
    KeyPage(&'r kvtide::KeyPage),
}

impl Reply<'_> {
    /// The operation code of this answer.
    fn op(&self) -> Op {
        match self {
            Reply::HelloOk(_) => Op::HelloOk,
            Reply::AuthOk(_) => Op::AuthOk,
            Reply::Ok => Op::Ok,
            Reply::Error { .. } => Op::Error,
            Reply::Abort { .. } => Op::Abort,
            Reply::Object { .. } => Op::Object,
            Reply::End => Op::End,
            Reply::Grants { .. } => Op::Grants,
            Reply::GrantsPart(_) => Op::GrantsPart,
            Reply::Exists(_) => Op::ExistsReply,
            Reply::Stats(_) => Op::StatsReply,
            Reply::Statuses(_) => Op::Statuses,
            Reply::Window { .. } => Op::Window,
            Reply::IndexMap { .. } => Op::IndexMap,
            Reply::UcxReady(_) => Op::UcxReady,
            Reply::KeyPage(_) => Op::KeyPage,
        }
    }

    /// Appends this answer's payload.
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::HelloOk(hello) => hello.encode(out),
            Reply::AuthOk(proof) => out.extend_from_slice(&proof[..]),
            Reply::Ok | Reply::End => {}
            Reply::Error { index, error } | Reply::Abort { index, error } => encode_error_frame(out, *index, error),
            Reply::Object { index, len } => encode_object(out, *index, *len),
            Reply::Grants { ttl_ms, grants } => encode_grants(out, *ttl_ms, grants),
            Reply::GrantsPart(part) => part.encode(out),
            Reply::Exists(found) => encode_exists(out, found),
            Reply::Stats(text) => out.extend_from_slice(text.as_bytes()),
            Reply::Statuses(statuses) => encode_statuses(out, statuses),
            Reply::Window { bytes } | Reply::IndexMap { bytes } => out.extend_from_slice(&bytes.to_le_bytes()),
            Reply::UcxReady(ready) => ready.encode(out),
            Reply::KeyPage(page) => encode_key_page(out, page),
        }
    }

    /// Queues this answer to request `request_id` on `io`'s write buffer (`Connection::reply`).
    pub(super) fn push(&self, io: &mut FrameIo, request_id: u64) {
        let start = io.begin(self.op(), request_id);
        self.encode(io.out());
        io.end(start);
    }

    /// This answer to request `request_id` as a whole frame, for a socket without a connection.
    pub(super) fn frame(&self, request_id: u64) -> Vec<u8> {
        let mut frame = Vec::new();
        let start = begin_frame(&mut frame, self.op(), request_id);
        self.encode(&mut frame);
        end_frame(&mut frame, start);
        frame
    }
}
