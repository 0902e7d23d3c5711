//! Stream-bound transfers: copies ordered on a caller's device stream, so that whatever the
//! caller enqueues on that stream afterwards (an event record, a kernel, a graph launch) sees
//! the bytes, and the host never waits for them.
//!
//! Owns the contract between the engine and a transport that can bind copies to a caller's
//! stream: the stream check (which GPU, not being captured), gates (a word in host memory the
//! device waits on before the copies of an object that is still loading; opened by the engine
//! once the load ended, skipping those copies when it failed), the submission, whose
//! `InFlight` completes once the stream has passed the copies, and the signals a step enqueues
//! after each layer's copies (`StreamSignal`). It never takes leases: the
//! engine keeps the host bytes leased until that completion.

use std::sync::Arc;

use crate::inflight::InFlight;
use crate::transfer::Transfer;
use crate::TransportError;

/// A device stream handle as the caller's runtime gives it (`CUstream`, `cudaStream_t`,
/// `torch.cuda.Stream.cuda_stream`). 0 is not a stream: callers keep the blocking path.
pub type StreamHandle = u64;

/// A completion the device can wait on, enqueued on a caller's stream after a step's layer
/// (`StreamSubmit::signal`): the caller's event recorded, or the caller's flag word written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamSignal {
    /// Record this event (`CUevent`, e.g. `torch.cuda.Event(external=True).cuda_event`): another
    /// stream or a captured graph waits on it.
    RecordEvent(u64),
    /// Write `value` to the 4-byte word at `addr` (device memory, or host memory mapped for the
    /// device: `cuStreamWriteValue32`): a kernel spinning on it, or a stream waiting on it.
    WriteValue { addr: u64, value: u32 },
}

impl StreamSignal {
    /// The checks that need no driver: a null event, or a null or unaligned word.
    pub fn check(&self) -> Result<(), TransportError> {
        match *self {
            StreamSignal::RecordEvent(0) => Err(TransportError::Signal("the event is null".into())),
            StreamSignal::WriteValue { addr, .. } if addr == 0 || !addr.is_multiple_of(4) => {
                Err(TransportError::Signal(format!("the flag word's address {addr:#x} is null or not 4-byte aligned")))
            }
            _ => Ok(()),
        }
    }
}

/// A word in host memory that device work waits on (`Transport::on_stream` submissions of
/// objects still loading). Opened once; dropping a gate that was never opened opens it failed,
/// so no stream can wait on it forever.
pub trait Gate: Send + Sync {
    /// Opens the gate: `ok` lets the gated copies run, false makes them skip.
    fn open(&self, ok: bool);
    /// Whether it was opened, and how (None: still closed).
    fn state(&self) -> Option<bool>;
    /// The gate's own type, for the transport that made it.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A transport's stream-bound submissions (`Transport::on_stream`).
pub trait StreamSubmit: Send + Sync {
    /// Checks that `stream` can carry copies now and returns its GPU's ordinal. Refuses a
    /// stream that is being captured into a graph (`StreamCapturing`).
    fn check_stream(&self, stream: StreamHandle) -> Result<u32, TransportError>;

    /// A closed gate for copies on GPU `ordinal`.
    fn gate(&self, ordinal: u32) -> Result<Arc<dyn Gate>, TransportError>;

    /// Allocates and compiles now what stream-bound submissions to GPU `ordinal` need, so that
    /// later ones allocate and compile nothing.
    fn prepare(&self, ordinal: u32) -> Result<(), TransportError>;

    /// Enqueues `transfers` (host to device, checked with the transport's `check`, every device
    /// piece on the stream's GPU) on `stream`, in order. Transfer `i` first waits for
    /// `gates[i]` when set; if that gate opens failed, its copies do not touch the destination
    /// (where the transport can skip them: see its docs) and its bytes are reported by the
    /// caller, not here. The returned `InFlight` completes once the stream has passed every
    /// copy; the copies themselves are already ordered before anything enqueued on `stream`
    /// after this returns.
    ///
    /// # Safety
    /// Every transfer's host bytes and every destination must stay valid, and the host bytes
    /// unchanged, until the returned `InFlight` completed. Dropping it unfinished blocks until
    /// the stream passed the copies, which requires every gate to open.
    unsafe fn submit_on_stream(
        &self,
        stream: StreamHandle,
        transfers: &[Transfer],
        gates: &[Option<Arc<dyn Gate>>],
    ) -> Result<InFlight, TransportError>;

    /// Enqueues `signal` on `stream`, behind everything enqueued on it before (a step's layer's
    /// copies): the device sees the signal only once it passed them.
    ///
    /// # Safety
    /// The event must be a live event of the stream's context, or the word a live 4-byte word
    /// the device may write, until the stream passed the signal.
    unsafe fn signal(&self, stream: StreamHandle, signal: StreamSignal) -> Result<(), TransportError>;
}
