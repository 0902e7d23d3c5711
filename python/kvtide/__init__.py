"""kvtide: a storage engine for LLM KV cache, for PyTorch inference workers.

``kvtide.Store(...)`` opens the engine embedded in this process; ``kvtide.connect(address)``
uses a ``kvtide-owner`` process over a Unix socket (with shared memory) or TCP. Both have the
same methods. Buffers are torch tensors (CPU or CUDA, contiguous), numpy arrays or any
buffer-protocol object (C-contiguous), or ``(address, size)`` pairs. Batch calls return one
result per key: the value, or the exception instance in its place; they never raise for one
bad key. ``kvtide.mooncake.MooncakeDistributedStore`` keeps Mooncake Store's Python API;
``kvtide.sglang`` and ``kvtide.vllm`` adapt kvtide to SGLang's HiCache storage and vLLM's KV
offloading.
"""

from kvtide._kvtide import (  # noqa: F401
    AlreadyExists,
    BufferTooSmall,
    Busy,
    Cancelled,
    ChunkHandle,
    Hold,
    Corrupted,
    CudaError,
    CudaUnavailable,
    Disconnected,
    InternalError,
    InvalidArgument,
    IoError,
    KvtideError,
    Leased,
    LeaseExpired,
    NoSpace,
    NotFound,
    NotPinned,
    Pinned,
    ProducerAborted,
    ProtocolError,
    PutStream,
    ShuttingDown,
    SizeMismatch,
    Store,
    StreamCapturing,
    StreamError,
    StreamExpired,
    StreamTicket,
    Ticket,
    Timeout,
    TooLarge,
    Unauthorized,
    __version__,
    connect,
    connect_cluster,
    cuda_built,
    ucx_version,
)


def ok(result):
    """True when one per-key result of a batch call is a success (not an exception)."""
    return not isinstance(result, BaseException)


__all__ = [name for name in dir() if not name.startswith("_")] + ["__version__"]
