"""kvtide.sglang.KvtideHiCacheStorage against SGLang's HiCache storage contract (SGLang
0.5.23): constructed as the dynamic backend factory does, pages read and written in place
through a host pool's page buffer metadata, leading-hit counts, per-page results."""

import importlib

import numpy as np
import pytest

import kvtide
from kvtide.sglang import HiCacheStorageConfig, HiCacheStorageExtraInfo, KvtideHiCacheStorage


class FakeHostPool:
    """A page-first MHA (or MLA) host pool: page p of a token index lies contiguous in the K
    and V buffers, as SGLang's HostKVCache.get_page_buffer_meta describes it."""

    def __init__(self, pages, page_size=4, token_bytes=64, mla=False, seed=0):
        self.page_size = page_size
        self.token_bytes = token_bytes
        self.mla = mla
        n = pages * page_size * token_bytes
        self.k = ((np.arange(n) * 7 + seed) % 256).astype(np.uint8)
        self.v = ((np.arange(n) * 13 + seed) % 256).astype(np.uint8)

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        page_bytes = self.page_size * self.token_bytes
        for p in range(len(indices) // self.page_size):
            start = int(indices[p * self.page_size]) * self.token_bytes
            ptrs.append(self.k.ctypes.data + start)
            sizes.append(page_bytes)
            if not self.mla:
                ptrs.append(self.v.ctypes.data + start)
                sizes.append(page_bytes)
        return ptrs, sizes

    def page(self, token_index):
        s = token_index * self.token_bytes
        e = s + self.page_size * self.token_bytes
        return self.k[s:e].copy(), (None if self.mla else self.v[s:e].copy())


def config(tp_rank=0, mla=False, extra=None):
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="m", extra_config=extra)


@pytest.fixture(params=["embedded", "unix"])
def extra(request, owner):
    if request.param == "embedded":
        return {"kvtide_settings": {"dram_bytes": "64MiB", "shards": 2, "pin_threads": False}}
    return {"kvtide_address": owner.unix}


def indices(pages, page_size=4, first=0):
    return np.arange(first * page_size, (first + pages) * page_size)


@pytest.mark.parametrize("mla", [False, True])
def test_pages_round_trip_in_place(extra, k, mla):
    # The dynamic factory constructs backend_class(storage_config, kwargs).
    backend = KvtideHiCacheStorage(config(mla=mla, extra=extra), {})
    src = FakeHostPool(8, mla=mla, seed=3)
    backend.register_mem_pool_host(src)
    keys = [k(f"page{i}") for i in range(6)]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:4], indices(4), HiCacheStorageExtraInfo()) == [True] * 4
    assert backend.batch_set_v1(keys[:4], indices(4)) == [True] * 4, "storing a page again succeeds"
    assert backend.batch_exists(keys) == 4, "the leading run of stored pages"
    assert backend.batch_exists(keys[1:]) == 3
    dst = FakeHostPool(8, mla=mla, seed=99)
    backend.register_mem_pool_host(dst)
    # Pages 0..3 into host slots 4..7 of another pool; page 4 was never stored.
    got = backend.batch_get_v1(keys[:5], indices(5, first=3))
    assert got == [True, True, True, True, False]
    for p in range(4):
        assert np.array_equal(dst.page((3 + p) * 4)[0], src.page(p * 4)[0])
        if not mla:
            assert np.array_equal(dst.page((3 + p) * 4)[1], src.page(p * 4)[1])
    backend.clear()
    assert backend.batch_exists(keys) == 0
    backend.close()


def test_a_half_missing_page_is_a_miss_and_ranks_do_not_share_pages(extra, k):
    rank0 = KvtideHiCacheStorage(config(tp_rank=0, extra=extra), {})
    rank1 = KvtideHiCacheStorage(config(tp_rank=1, extra=extra), {})
    pool = FakeHostPool(4)
    rank0.register_mem_pool_host(pool)
    rank1.register_mem_pool_host(pool)
    keys = [k(f"p{i}") for i in range(3)]
    assert rank0.batch_set_v1(keys, indices(3)) == [True] * 3
    assert rank1.batch_exists(keys) == 0, "each TP rank has its own shard of a page"
    rank0.store.remove(f"{keys[1]}_0_v")
    assert rank0.batch_exists(keys) == 1, "K without V is a miss"
    assert rank0.batch_get_v1(keys, indices(3)) == [True, False, True]
    wrong = FakeHostPool(4, token_bytes=32)
    rank0.register_mem_pool_host(wrong)
    assert rank0.batch_get_v1(keys[:1], indices(1)) == [False], "a page of another size fails, never raises"
    rank0.clear()
    rank0.close()
    rank1.close()


def test_generic_interface(extra, k):
    backend = KvtideHiCacheStorage(config(extra=extra), {})
    page = np.arange(256, dtype=np.uint8)
    assert backend.set(k("flat"), page) is True
    assert backend.exists(k("flat")) and not backend.exists(k("absent"))
    out = np.zeros(256, np.uint8)
    assert backend.get(k("flat"), out) is out and np.array_equal(out, page)
    outs = [np.zeros(256, np.uint8), np.zeros(256, np.uint8)]
    got = backend.batch_get([k("flat"), k("absent")], outs)
    assert got[0] is outs[0] and got[1] is None
    assert backend.batch_set([k("a"), k("b")], [page, page]) is True
    raw = np.zeros(256, np.uint8)
    assert backend.get(k("a"), raw.ctypes.data, 256) == raw.ctypes.data and np.array_equal(raw, page)
    assert isinstance(backend.get_stats(), dict)
    backend.clear()
    backend.close()


def test_the_factory_can_load_it():
    module = importlib.import_module("kvtide.sglang")
    cls = getattr(module, "KvtideHiCacheStorage")
    from kvtide.sglang import HiCacheStorage

    assert issubclass(cls, HiCacheStorage)
    with pytest.raises(kvtide.KvtideError):
        cls(config(extra={"kvtide_address": "unix:/nonexistent/owner.sock"}), {})
