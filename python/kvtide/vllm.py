"""A vLLM KV offloading spec on kvtide (the ``vllm.v1.kv_offload`` interface of vLLM 0.34.0).

vLLM's ``OffloadingConnector`` loads it by name::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvtideOffloadingSpec",
        "spec_module_path": "kvtide.vllm", "kvtide_address": "unix:/run/kvtide/owner.sock"}}'

``kvtide_address`` (or ``KVTIDE_ADDRESS``) names a ``kvtide-owner`` shared by the scheduler and
every worker; without one, each process opens kvtide embedded (``kvtide_settings``, a dict of
``kvtide.Store`` keywords) and only that process sees its blocks. One offloaded chunk (vLLM's
``OffloadKey``) of one worker rank is one object, ``{prefix}/{rank}/{key hex}``: the
concatenation of the chunk's device blocks, data ref after data ref, in vLLM's file layout
(offset ``(ref * blocks_per_chunk + block) * block_bytes``). A chunk is a hit when every rank's
object exists. Transfers run on a small thread pool, after a CUDA event recorded at submission
(when torch has CUDA) says the device data is ready; GPU addresses need the package built with
the ``cuda`` feature.
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import kvtide

try:  # vLLM's factory checks issubclass against its own base class.
    from vllm.v1.kv_offload.base import (  # type: ignore
        LoadStoreSpec,
        LookupResult,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
    )
    from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups  # type: ignore
except ImportError:  # pragma: no cover - exercised whenever vLLM is absent (CI)
    from kvtide._vllm_base import (
        LoadStoreSpec,
        LookupResult,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        RequestOffloadingContext,
        TransferResult,
        iter_pointer_groups,
    )

__all__ = ["KvtideOffloadingSpec", "KvtideOffloadingManager", "KvtideOffloadingWorker", "KvtideLoadStoreSpec"]


def _open_store(extra):
    address = extra.get("kvtide_address") or os.environ.get("KVTIDE_ADDRESS")
    if address:
        return kvtide.connect(address)
    return kvtide.Store(env=True, **dict(extra.get("kvtide_settings", {})))


class KvtideLoadStoreSpec(LoadStoreSpec):
    """The chunks a transfer reads or writes, by vLLM key."""

    def __init__(self, keys):
        self.keys = list(keys)

    def __repr__(self):
        return f"KvtideLoadStoreSpec({len(self.keys)} keys)"


class _Names:
    def __init__(self, prefix, world_size):
        self.prefix = prefix
        self.world_size = max(1, int(world_size))

    def object(self, key, rank):
        return f"{self.prefix}/{rank}/{bytes(key).hex()}"

    def all_ranks(self, key):
        return [self.object(key, r) for r in range(self.world_size)]


class KvtideOffloadingManager(OffloadingManager):
    """Scheduler side: a chunk is a HIT when every rank's object is in kvtide. kvtide does its
    own eviction, so nothing is tracked here; a chunk evicted between lookup and load fails
    that load, which vLLM recomputes."""

    def __init__(self, store, names):
        self.store = store
        self.names = names

    def lookup(self, key, req_context):
        found = self.store.batch_exists(self.names.all_ranks(key))
        return LookupResult.HIT if all(f is True for f in found) else LookupResult.MISS

    def prepare_load(self, keys, req_context):
        return KvtideLoadStoreSpec(keys)

    def prepare_store(self, keys, req_context):
        keys = list(keys)
        objects = [o for k in keys for o in self.names.all_ranks(k)]
        found = self.store.batch_exists(objects) if objects else []
        per = self.names.world_size
        missing = [k for i, k in enumerate(keys) if not all(f is True for f in found[i * per:(i + 1) * per])]
        return PrepareStoreOutput(keys_to_store=missing, store_spec=KvtideLoadStoreSpec(missing), evicted_keys=[])

    def on_new_request(self, req_context):
        return RequestOffloadingContext()


def _chunk_ops(device_ptrs, keys, blocks_per_chunk):
    """Per key: [(device address, bytes, offset in the object)], as vLLM's file workers lay a
    chunk out."""
    out = []
    key_idx = 0
    for g in iter_pointer_groups(device_ptrs, blocks_per_chunk):
        dev_blk = 0
        for i in range(g.n_chunks):
            start = g.skip if i == 0 else 0
            n_blks = min(blocks_per_chunk - start, g.group_size - dev_blk)
            ops = []
            for d in range(g.n_data_refs):
                base = g.dev_ptr_offset + d * g.group_size + dev_blk
                blk_size = int(device_ptrs.sizes[base])
                for b in range(n_blks):
                    idx = base + b
                    ops.append((int(device_ptrs.ptrs[idx]), int(device_ptrs.sizes[idx]),
                                (d * blocks_per_chunk + start + b) * blk_size))
            out.append((keys[key_idx], ops))
            key_idx += 1
            dev_blk += n_blks
    if key_idx != len(keys):
        raise ValueError(f"{len(keys)} keys for {key_idx} chunks")
    return out


def _ready_event():
    """A CUDA event on the current stream, so a transfer starts after the KV it moves is
    written (None without torch CUDA)."""
    try:
        import torch

        if torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
            return event
    except ImportError:
        pass
    return None


class KvtideOffloadingWorker(OffloadingWorker):
    """Worker side: stores gather a chunk's device blocks into one object; loads read each block
    back from its offset. Jobs run on a thread pool (the GIL is released while kvtide moves
    bytes); ``get_finished`` reports them once."""

    def __init__(self, store, names, rank, blocks_per_chunk, threads=4):
        self.store = store
        self.names = names
        self.rank = rank
        self.blocks_per_chunk = max(1, int(blocks_per_chunk))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtide-vllm")
        self._jobs = {}
        self._lock = threading.Lock()

    def _submit(self, job_id, fn, *args):
        event = _ready_event()
        started = time.perf_counter()

        def run():
            if event is not None:
                event.synchronize()
            return fn(*args)

        with self._lock:
            self._jobs[job_id] = (self._pool.submit(run), started)
        return True

    def _store(self, chunks):
        # An object is a whole chunk: its blocks must tile it from offset 0. A partial chunk (a
        # store starting inside one) is not stored, and the job reports failure.
        whole = []
        for key, ops in chunks:
            ops = sorted(ops, key=lambda o: o[2])
            at = 0
            for _, size, offset in ops:
                if offset != at:
                    break
                at += size
            else:
                whole.append((key, ops))
        names = [self.names.object(k, self.rank) for k, _ in whole]
        sources = [[(ptr, size) for ptr, size, _ in ops] for _, ops in whole]
        results = self.store.batch_put_from_multi_buffers(names, sources) if whole else []
        ok = len(whole) == len(chunks) and all(r is None or isinstance(r, kvtide.AlreadyExists) for r in results)
        return ok, sum(size for _, ops in whole for _, size, _ in ops)

    def _load(self, chunks):
        buffers, fragments = [], []
        for key, ops in chunks:
            name = self.names.object(key, self.rank)
            for ptr, size, offset in ops:
                buffers.append((ptr, size))
                fragments.append([(name, offset, 0, size)])
        results = self.store.get_into_ranges(buffers, fragments)
        ok = all(isinstance(r, int) and not isinstance(r, bool) for per in results for r in per)
        return ok, sum(size for _, ops in chunks for _, size, _ in ops)

    def submit_store(self, job_id, device_ptrs, dst_spec):
        chunks = _chunk_ops(device_ptrs, dst_spec.keys, self.blocks_per_chunk)
        return self._submit(job_id, self._store, chunks)

    def submit_load(self, job_id, src_spec, device_ptrs, expedited=False):
        chunks = _chunk_ops(device_ptrs, src_spec.keys, self.blocks_per_chunk)
        return self._submit(job_id, self._load, chunks)

    def get_finished(self):
        done = []
        with self._lock:
            for job_id, (future, started) in list(self._jobs.items()):
                if future.done():
                    del self._jobs[job_id]
                    try:
                        ok, size = future.result()
                    except Exception:  # a failed transfer is reported, never raised
                        ok, size = False, None
                    done.append(TransferResult(job_id=job_id, success=ok, transfer_size=size,
                                               transfer_time=time.perf_counter() - started))
        return done

    def wait(self, job_ids):
        with self._lock:
            futures = [self._jobs[j][0] for j in job_ids if j in self._jobs]
        for f in futures:
            f.exception()

    def shutdown(self):
        self._pool.shutdown(wait=True)


class KvtideOffloadingSpec(OffloadingSpec):
    """The spec vLLM's ``OffloadingConnector`` builds from ``kv_connector_extra_config``."""

    def __init__(self, config):
        super().__init__(config)
        extra = dict(config.extra_config or {})
        parallel = config.parallel
        model = getattr(getattr(config, "model", None), "name", "model")
        prefix = extra.get("kvtide_prefix") or f"vllm/{str(model).replace('/', '-')}"
        self.names = _Names(prefix, getattr(parallel, "world_size", 1))
        self.rank = getattr(parallel, "rank", 0)
        self._extra = extra
        self._store = None

    def store(self):
        if self._store is None:
            self._store = _open_store(self._extra)
        return self._store

    def get_manager(self):
        return KvtideOffloadingManager(self.store(), self.names)

    def get_worker(self, kv_caches):
        return KvtideOffloadingWorker(self.store(), self.names, self.rank, self.config.cache.blocks_per_chunk,
                                      int(self._extra.get("kvtide_threads", 4)))
