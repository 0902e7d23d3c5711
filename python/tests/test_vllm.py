"""kvtide.vllm.KvtideOffloadingSpec against vLLM's KV offloading contract (vLLM 0.34.0): the
spec built from an OffloadingConfig, the scheduler-side manager (per-chunk lookups, stores only
of what is missing) and the worker (async stores and loads of device blocks by pointer, results
reported once, failures reported and never raised). Host arrays stand in for GPU blocks."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvtide._vllm_base import DevicePointers
from kvtide.vllm import KvtideOffloadingSpec, LookupResult

BLOCK = 256  # bytes per block per data ref
BLOCKS = 8


def spec(rank, extra, world_size=2, blocks_per_chunk=2):
    config = SimpleNamespace(
        extra_config=extra,
        cache=SimpleNamespace(blocks_per_chunk=blocks_per_chunk, tokens_per_hash=16),
        parallel=SimpleNamespace(rank=rank, world_size=world_size),
        model=SimpleNamespace(name="org/model"),
    )
    return KvtideOffloadingSpec(config)


class KvCache:
    """Two data refs (K and V), BLOCKS blocks of BLOCK bytes each."""

    def __init__(self, seed):
        self.k = ((np.arange(BLOCKS * BLOCK) * 3 + seed) % 256).astype(np.uint8)
        self.v = ((np.arange(BLOCKS * BLOCK) * 5 + seed) % 256).astype(np.uint8)

    def pointers(self, block_ids, first_block_index=0):
        """vLLM's canonical order: for each data ref, for each block."""
        ptrs = [a.ctypes.data + b * BLOCK for a in (self.k, self.v) for b in block_ids]
        return DevicePointers(ptrs=np.array(ptrs, np.uint64), sizes=np.full(len(ptrs), BLOCK, np.uint64),
                              group_block_counts=(len(block_ids),), group_data_ref_counts=(2,),
                              block_indices=(first_block_index,))

    def block(self, b):
        return self.k[b * BLOCK:(b + 1) * BLOCK], self.v[b * BLOCK:(b + 1) * BLOCK]


def finish(worker, job_ids, timeout=30):
    worker.wait(set(job_ids))
    deadline = time.time() + timeout
    results = {}
    while set(results) != set(job_ids) and time.time() < deadline:
        for r in worker.get_finished():
            assert r.job_id not in results, "each job is reported once"
            results[r.job_id] = r
    return results


@pytest.fixture(params=["embedded", "unix"])
def extra(request, owner, k):
    prefix = k("vllm")
    if request.param == "embedded":
        shared = {"kvtide_settings": {"dram_bytes": "64MiB", "shards": 2, "pin_threads": False},
                  "kvtide_prefix": prefix}
        # Scheduler and workers of one process share one embedded store.
        return shared
    return {"kvtide_address": owner.unix, "kvtide_prefix": prefix}


def test_store_lookup_and_load_chunks(extra):
    specs = [spec(r, extra) for r in range(2)]
    if "kvtide_settings" in extra:
        for s in specs[1:]:
            s._store = specs[0].store()
    manager = specs[0].get_manager()
    workers = [s.get_worker(None) for s in specs]
    caches = [KvCache(seed=r + 1) for r in range(2)]
    keys = [b"chunk-a" + bytes(4), b"chunk-b" + bytes(4)]
    ctx = SimpleNamespace(req_id="r1")
    assert [manager.lookup(key, ctx) for key in keys] == [LookupResult.MISS] * 2
    out = manager.prepare_store(keys, ctx)
    assert out.keys_to_store == keys and out.evicted_keys == []
    # Each rank stores its own shard of both chunks (blocks 0..3: two chunks of two blocks).
    for r, w in enumerate(workers):
        assert w.submit_store(10 + r, caches[r].pointers([0, 1, 2, 3]), out.store_spec)
    results = finish(workers[0], [10]) | finish(workers[1], [11])
    assert all(r.success for r in results.values()) and results[10].transfer_size == 8 * BLOCK
    assert [manager.lookup(key, ctx) for key in keys] == [LookupResult.HIT] * 2
    assert manager.prepare_store(keys, ctx).keys_to_store == [], "stored chunks are not stored again"
    # Load both chunks into blocks 4..7 of fresh caches.
    fresh = [KvCache(seed=100 + r) for r in range(2)]
    load_spec = manager.prepare_load(keys, ctx)
    for r, w in enumerate(workers):
        assert w.submit_load(20 + r, load_spec, fresh[r].pointers([4, 5, 6, 7]))
    results = finish(workers[0], [20]) | finish(workers[1], [21])
    assert all(r.success for r in results.values())
    for r in range(2):
        for i, b in enumerate([4, 5, 6, 7]):
            assert np.array_equal(fresh[r].block(b)[0], caches[r].block(i)[0])
            assert np.array_equal(fresh[r].block(b)[1], caches[r].block(i)[1])
    # A load that starts inside a chunk (block index 1): the chunk's second block, then a whole
    # chunk.
    part = KvCache(seed=7)
    assert workers[0].submit_load(30, manager.prepare_load(keys, ctx), part.pointers([5, 6, 7], first_block_index=1))
    assert finish(workers[0], [30])[30].success
    for b, src in zip([5, 6, 7], [1, 2, 3]):
        assert np.array_equal(part.block(b)[0], caches[0].block(src)[0])
        assert np.array_equal(part.block(b)[1], caches[0].block(src)[1])
    for w in workers:
        w.shutdown()


def test_failures_are_reported_not_raised(extra):
    s = spec(0, extra, world_size=1)
    manager, worker = s.get_manager(), s.get_worker(None)
    ctx = SimpleNamespace(req_id="r2")
    missing = [b"never-stored"]
    assert manager.lookup(missing[0], ctx) == LookupResult.MISS
    cache = KvCache(seed=1)
    assert worker.submit_load(1, manager.prepare_load(missing, ctx), cache.pointers([0, 1]))
    assert finish(worker, [1])[1].success is False
    # A store that starts inside a chunk cannot make a whole object: reported failed.
    assert worker.submit_store(2, cache.pointers([1], first_block_index=1), manager.prepare_store(missing, ctx).store_spec)
    assert finish(worker, [2])[2].success is False
    assert manager.lookup(missing[0], ctx) == LookupResult.MISS
    assert worker.get_finished() == []
    worker.shutdown()
