"""vLLM's KV offloading interface, for machines without vLLM.

A copy of the parts of ``vllm.v1.kv_offload.base`` and ``vllm.v1.kv_offload.pointer_utils``
(vLLM 0.34.0) that an offloading spec implements or receives: ``OffloadingSpec``,
``OffloadingManager``, ``OffloadingWorker``, ``LoadStoreSpec``, ``PrepareStoreOutput``,
``LookupResult``, ``RequestOffloadingContext``, ``TransferResult``, ``DevicePointers`` and
``iter_pointer_groups``. ``kvtide.vllm`` subclasses vLLM's own classes when vLLM is installed
(its spec factory checks ``issubclass``), and these otherwise.
"""

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NamedTuple, Optional


class LookupResult(Enum):
    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()
    RETRY = auto()


class OffloadPolicy(Enum):
    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: Optional[dict] = None
    kv_hints: Any = None
    _state: Any = field(default=None, repr=False)


class LoadStoreSpec:
    """Metadata a worker uses to load (and store) blocks."""


@dataclass
class PrepareStoreOutput:
    keys_to_store: list
    store_spec: LoadStoreSpec
    evicted_keys: list


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: Optional[int] = None
    transfer_time: Optional[float] = None


@dataclass
class DevicePointers:
    """Flat arrays in canonical order: for each group, for each data_ref in the group, for each
    block in the group: ptrs[i], sizes[i]."""

    ptrs: Any
    sizes: Any
    group_block_counts: tuple
    group_data_ref_counts: tuple
    block_indices: tuple


class DevicePointerGroupInfo(NamedTuple):
    group_idx: int
    group_size: int
    n_data_refs: int
    skip: int
    n_chunks: int
    dev_ptr_offset: int


def iter_pointer_groups(device_ptrs, blocks_per_chunk):
    dev_ptr_offset = 0
    for group_idx, (group_size, n_data_refs, block_idx) in enumerate(
            zip(device_ptrs.group_block_counts, device_ptrs.group_data_ref_counts, device_ptrs.block_indices)):
        if group_size == 0:
            continue
        skip = block_idx % blocks_per_chunk
        n_chunks = -(-(group_size + skip) // blocks_per_chunk)
        yield DevicePointerGroupInfo(group_idx, group_size, n_data_refs, skip, n_chunks, dev_ptr_offset)
        dev_ptr_offset += group_size * n_data_refs


class OffloadingManager(ABC):
    @property
    def lock(self):
        return nullcontext()

    @abstractmethod
    def lookup(self, key, req_context) -> LookupResult: ...

    @abstractmethod
    def prepare_load(self, keys, req_context) -> LoadStoreSpec: ...

    def complete_load(self, keys, req_context):
        return

    @abstractmethod
    def prepare_store(self, keys, req_context) -> Optional[PrepareStoreOutput]: ...

    def complete_store(self, keys, req_context, success: bool = True):
        return

    @abstractmethod
    def on_new_request(self, req_context) -> RequestOffloadingContext: ...

    def on_request_finished(self, req_context) -> None:
        return

    def take_events(self):
        return ()

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> None:
        return

    def shutdown(self) -> None:
        return


class OffloadingWorker(ABC):
    @abstractmethod
    def submit_store(self, job_id: int, device_ptrs, dst_spec) -> bool: ...

    @abstractmethod
    def submit_load(self, job_id: int, src_spec, device_ptrs, expedited: bool = False) -> bool: ...

    @abstractmethod
    def get_finished(self) -> list: ...

    @abstractmethod
    def wait(self, job_ids: set) -> None: ...

    def shutdown(self) -> None:
        return


class OffloadingSpec(ABC):
    def __init__(self, config):
        self.config = config
        self.extra_config = config.extra_config
        self.blocks_per_chunk = config.cache.blocks_per_chunk

    @abstractmethod
    def get_manager(self) -> OffloadingManager: ...

    @abstractmethod
    def get_worker(self, kv_caches) -> OffloadingWorker: ...
