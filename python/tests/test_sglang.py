"""kvtide.sglang inside SGLang 0.5.23: SGLang's own code calls the adapter.

SGLang's ``StorageBackendFactory`` creates the dynamic backend; its cache controllers
(``HybridCacheController`` under a real ``UnifiedRadixCache``, and the base ``HiCacheController``)
back pages up from, and prefetch them into, its real host pools on CPU; ``check_hicache_events``
runs with metrics on. Embedded and through a kvtide-owner over its Unix socket.

Faked, because they cannot exist without an accelerator: ``cudaHostRegister`` (host pools are
pinned for DMA; here a no-op, and the generic interface's pages are left unpinned), the
device-to-host copy kernels (the tests write the host pages a device backup would have filled),
and the NPU's split MLA device buffers behind the ``page_first_kv_split`` layout (CPU tensors).
SGLang's page hash is its own C++ extension, built on first use with ninja.
"""

import ctypes
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from array import array

import pytest

import kvtide

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

if shutil.which("ninja") is None and os.path.exists(os.path.join(os.path.dirname(sys.executable), "ninja")):
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import sglang.srt.mem_cache.pool_host.common as pool_host_common  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

import kvtide.sglang as ksg  # noqa: E402

PS = 4
SETTINGS = {"dram_bytes": "64MiB", "shards": 2, "pin_threads": False}
BASE = {"backend_name": "kvtide", "module_path": "kvtide.sglang", "class_name": "KvtideHiCacheStorage"}


@pytest.fixture(autouse=True)
def no_cuda_pinning(monkeypatch):
    monkeypatch.setattr(pool_host_common, "_cuda_host_register", lambda *a, **k: None)


@pytest.fixture
def single_rank():
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        yield


@pytest.fixture(params=["embedded", "unix"])
def where(request, owner):
    """Extra-config keys that put the backend's store embedded, or on the shared owner."""
    if request.param == "embedded":
        return {"kvtide_settings": SETTINGS}
    return {"kvtide_address": owner.unix}


@pytest.fixture
def model(request):
    """A model name of this test's own: the owner is shared, names are per model."""
    return f"model-{request.node.name}"


def publish(**kw):
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=kw.pop("page_size", PS), **kw))


# ---- pages, addressed through the pool's own page buffer metadata ---------------------------------

def _page_meta(pool, indices, split=0):
    if split:
        return pool.get_split_heads_page_buffer_meta(indices, split)
    return pool.get_page_buffer_meta(indices)


def pages_of(pool, indices, split=0):
    """Each page's bytes (its buffers, in order); with ``split``, each head group's."""
    ptrs, sizes = _page_meta(pool, indices, split)
    n = len(indices) // pool.page_size * (split or 1)
    per = len(ptrs) // n
    return [b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))
            for i in range(n)]


def fill(pool, indices, seed):
    """Random bytes into the pages (standing in for a device backup)."""
    g = torch.Generator().manual_seed(seed)
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    for p, s in zip(ptrs, sizes):
        src = torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g)
        ctypes.memmove(p, src.data_ptr(), s)
    return pages_of(pool, indices)


def indices(pages, first=0):
    return torch.arange(first * PS, (first + pages) * PS, dtype=torch.int64)


def hashes(n, salt=0):
    return get_storage_hash_str(list(range(salt, salt + n * PS)), None, page_size=PS)


# ---- real host pools and backends (the backend-level tests) ---------------------------------------

def host_pool(layout="page_first", dtype=torch.bfloat16, mla=False, heads=2, page_size=PS):
    publish(page_size=page_size, hicache_mem_layout=layout,
            hicache_io_backend="direct" if layout == "page_first_direct" else "kernel")
    if mla:
        kv = MLATokenToKVPool(size=64, page_size=page_size, dtype=dtype, kv_lora_rank=16, qk_rope_head_dim=8,
                              layer_num=2, device="cpu", enable_memory_saver=False)
    else:
        kv = MHATokenToKVPool(size=64, page_size=page_size, dtype=dtype, head_num=heads, head_dim=8, layer_num=2,
                              device="cpu", enable_memory_saver=False)
    return build_kv_host_pool(kv_pool=kv, page_size=page_size)


def split_mla_pool():
    """An MLA host pool in the NPU's page_first_kv_split layout (its device buffers as CPU tensors)."""
    layers, tokens, rank, rope = 2, 64, 16, 8
    buffers = MLASplitBuffers(k=torch.zeros(layers, tokens, 1, rank, dtype=torch.bfloat16),
                              v=torch.zeros(layers, tokens, 1, rope, dtype=torch.bfloat16), index_k=None,
                              index_scales=None, index_layer_indices=(), k_width=rank, v_width=rope, index_width=0)
    info = MLABufferInfo(buffers=buffers, data_ptrs=None, layer_indices=tuple(range(layers)), device_layer_num=layers,
                         page_size=PS, kv_lora_rank=rank, qk_rope_head_dim=rope, kv_cache_dim=rank + rope,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PS, "page_first_kv_split", pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers - 1,
                                target_layer_num=layers)


def storage_config(extra, model="m", tp=(0, 1), pp=(0, 1), mla=False, metrics=False, tp_lcm=None, split=False):
    return HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=True, model_name=model, tp_lcm_size=tp_lcm,
                                should_split_heads=split, extra_config=dict(extra))


def backend(pool, extra, store=None, **cfg):
    """As SGLang's controller attaches it: the factory, then the pool registration. With ``store``
    (one embedded store several backends share) the class is built directly."""
    config = storage_config({**BASE, **extra}, **cfg)
    if store is not None:
        b = ksg.KvtideHiCacheStorage(config, {}, store=store)
    else:
        b = StorageBackendFactory.create_backend("dynamic", config, pool)
    b.register_mem_pool_host(pool)
    return b


# ---- construction and attach -----------------------------------------------------------------------

def test_the_factory_builds_it_from_the_dynamic_config(owner, model):
    pool = host_pool()
    b = backend(pool, {"interface_v1": 1, "kvtide_address": owner.unix}, model=model)
    assert type(b).__name__ == "KvtideHiCacheStorage"
    assert isinstance(b, HiCacheStorage), "SGLang's own base class, never a copy"
    assert b.store.is_remote and b.interface_v1
    assert ksg.SUPPORTED_SGLANG == sglang.__version__ == "0.5.23"
    b.close()


def test_the_documented_config_is_what_sglang_parses_and_attaches(owner):
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    doc = ksg.__doc__
    text = doc[doc.index("'{") + 1:doc.index("}'") + 1]
    extra = HybridCacheController.parse_storage_backend_extra_config(text)[0]
    assert extra["kvtide_address"] == "unix:/run/kvtide/owner.sock"
    extra["kvtide_address"] = owner.unix  # the documented socket path, on this test's owner
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    assert b.interface_v1 and b.store.is_remote
    b.close()


@pytest.mark.parametrize("extra, message", [
    ({"kvtide_adress": "unix:/x"}, "unknown extra-config key 'kvtide_adress'"),
    ({"kvtide_address": 5}, "'kvtide_address' is 5"),
    ({"kvtide_settings": "64MiB"}, "'kvtide_settings' is '64MiB'"),
    ({"interface_v1": 2}, "'interface_v1' is 2"),
    ({"kvtide_cache_tag": ""}, "'kvtide_cache_tag' is ''"),
    ({"kvtide_address": "unix:/x", "kvtide_settings": {}}, "not both"),
    ({"kvtide_connect": {"timeout_ms": 5}}, "'kvtide_connect' needs 'kvtide_address'"),
    ({"kvtide_settings": {"no_such_setting": 1}}, "cannot open kvtide embedded"),
])
def test_bad_extra_config_fails_at_construction(extra, message):
    error = kvtide.KvtideError if "embedded" in message else ksg.ConfigError
    with pytest.raises(error, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config({**BASE, **extra}), None)


def test_an_unreachable_owner_fails_at_construction_naming_it(tmp_path):
    address = f"unix:{tmp_path}/no-owner.sock"
    with pytest.raises(kvtide.KvtideError, match=f"cannot reach the kvtide owner at '{address}'"):
        StorageBackendFactory.create_backend("dynamic", storage_config({**BASE, "kvtide_address": address}), None)


def test_no_model_identity_is_refused_before_any_io(tmp_path):
    # The address is unreachable: the identity check must come first, so nothing is ever named without it.
    extra = {**BASE, "kvtide_address": f"unix:{tmp_path}/no-owner.sock"}
    with pytest.raises(ksg.IdentityError, match="no model identity"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra, model=None), None)
    b = StorageBackendFactory.create_backend("dynamic", storage_config(
        {**BASE, "kvtide_cache_tag": "llama-3-8b@abc", "kvtide_settings": SETTINGS}, model=None), None)
    b.close()


def test_pools_it_cannot_address_fail_the_attach():
    extra = {**BASE, "kvtide_settings": SETTINGS}
    # The generic interface needs SGLang's flat page copy, which the split layout has not.
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, mla=True), None)
    with pytest.raises(ksg.ConfigError, match="generic interface cannot copy this layout"):
        b.register_mem_pool_host(split_mla_pool())
    # An allocator-only MLA anchor (no host buffer) has no pages to move.
    logical = MLATokenToKVPoolHost(
        MLAHostAllocation(dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=24,
                          size_per_token=96), 2.0, 0, PS, "page_first", pin_memory=False, device="cpu",
        device_capacity_tokens=64, start_layer=0, end_layer=1, target_layer_num=2)
    b = StorageBackendFactory.create_backend("dynamic", storage_config({**extra, "interface_v1": 1}, mla=True), None)
    with pytest.raises(ksg.ConfigError, match="logical anchor"):
        b.register_mem_pool_host(logical)
    with pytest.raises(ksg.ConfigError, match="without registering its host KV pool"):
        b.on_host_pools_registered()
    b.close()


def _load_adapter_copy():
    spec = importlib.util.spec_from_file_location("kvtide_sglang_probe", ksg.__file__)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_another_sglang_version_or_none_is_refused_naming_the_supported_one(monkeypatch):
    _load_adapter_copy()  # the installed one is accepted
    monkeypatch.setattr(sglang, "__version__", "0.5.22")
    with pytest.raises(ImportError, match=r"supports SGLang 0\.5\.23 only, but SGLang 0\.5\.22 is installed"):
        _load_adapter_copy()
    monkeypatch.setattr(sglang, "__version__", "0.5.23+cu129")
    _load_adapter_copy()
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match=r"SGLang 0\.5\.23, which is not installed.*sglang==0\.5\.23"):
        _load_adapter_copy()


# ---- pages in place, per layout --------------------------------------------------------------------

POOLS = {
    "mha-page_first": dict(layout="page_first"),
    "mha-page_first_direct": dict(layout="page_first_direct"),
    "mha-layer_first": dict(layout="layer_first"),
    "mha-page_head": dict(layout="page_head"),
    "mla-page_first": dict(layout="page_first", mla=True),
    "mla-layer_first": dict(layout="layer_first", mla=True),
    "mla-page_first_kv_split": None,
}


@pytest.mark.parametrize("kind", list(POOLS))
def test_pages_round_trip_byte_exact_in_every_layout(where, model, kind):
    spec = POOLS[kind]
    mla = spec is None or spec.get("mla", False)
    make = split_mla_pool if spec is None else (lambda: host_pool(**spec))
    src, dst = make(), make()
    b = backend(src, {"interface_v1": 1, **where}, model=model, mla=mla)
    keys = hashes(6)
    want = fill(src, indices(6), seed=1)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys[:4], indices(4)) == [True] * 4
    assert b.batch_set_v1(keys[:4], indices(4)) == [True] * 4, "storing a page again succeeds"
    assert b.batch_exists(keys) == 4 and b.batch_exists(keys[1:]) == 3
    b.register_mem_pool_host(dst)
    fill(dst, indices(8), seed=2)
    # Pages 0..3 into host slots 3..6 of another pool; page 4 was never stored.
    assert b.batch_get_v1(keys[:5], indices(5, first=3)) == [True] * 4 + [False]
    assert pages_of(dst, indices(4, first=3)) == want[:4]
    b.clear()
    assert b.batch_exists(keys) == 0
    b.close()


def test_per_page_results_never_raise_and_never_report_other_bytes(where, model):
    pool = host_pool()
    b = backend(pool, {"interface_v1": 1, **where}, model=model)
    keys = hashes(3)
    fill(pool, indices(3), seed=3)
    assert b.batch_set_v1(keys, indices(3)) == [True] * 3
    b.store.remove(b._kv.prefix + keys[1])
    assert b.batch_exists(keys) == 1
    assert b.batch_get_v1(keys, indices(3, first=4)) == [True, False, True]
    # An object of another size under a page's name: the read fails, the write is not "stored".
    b.store.put(b._kv.prefix + keys[1], b"short")
    assert b.batch_get_v1(keys, indices(3, first=4)) == [True, False, True]
    assert b.batch_set_v1(keys, indices(3)) == [True, False, True]
    assert b.batch_set_v1(keys, indices(2)) == [False] * 3, "a host index count that is not the pages'"
    assert b.batch_get_v1(keys, torch.arange(5)) == [False] * 3
    b.clear()
    b.close()
    assert b.batch_get_v1(keys, indices(3)) == [False] * 3, "a closed store fails the pages, never raises"


def test_calls_before_the_pool_is_registered_do_no_io(where, model):
    b = StorageBackendFactory.create_backend("dynamic", storage_config({**BASE, "interface_v1": 1, **where},
                                                                       model=model), None)
    keys = hashes(2)
    assert b.batch_exists(keys) == 0 and b.batch_set_v1(keys, indices(2)) == [False, False]
    assert b.batch_get_v1(keys, indices(2)) == [False, False] and b.get(keys[0]) is None
    b.close()


# ---- what a page's name says -----------------------------------------------------------------------

VARIANTS = {
    "model": dict(model="model-b"),
    "cache tag": dict(extra={"kvtide_cache_tag": "finetune-7"}),
    "dtype (same size)": dict(pool=dict(dtype=torch.float16)),
    "dtype (fp8)": dict(pool=dict(dtype=torch.float8_e4m3fn)),
    "quantization": dict(quantization="fp8"),
    "tp size": dict(tp=(0, 4)),
    "tp rank": dict(tp=(1, 2)),
    "pp": dict(pp=(0, 2)),
    "page size": dict(pool=dict(page_size=8)),
    "layout (same size)": dict(pool=dict(layout="layer_first")),
    "heads": dict(pool=dict(heads=4)),
    "mla": dict(mla=True, pool=dict(mla=True)),
    "generic interface": dict(v1=False),
}


@pytest.mark.parametrize("variant", ["same config"] + list(VARIANTS))
def test_a_reader_of_another_configuration_misses(where, owner, model, variant):
    """One difference in what fixes a page's bytes: batch_exists 0, batch_get false, the reader's
    pages untouched; the same configuration hits byte-exact."""
    shared = kvtide.Store(**SETTINGS) if "kvtide_settings" in where else None
    writer_pool = host_pool()
    w = backend(writer_pool, {"interface_v1": 1, **where}, store=shared, model=model, tp=(0, 2))
    keys = hashes(4)
    want = fill(writer_pool, indices(4), seed=4)
    assert w.batch_set_v1(keys, indices(4)) == [True] * 4
    v = VARIANTS.get(variant, {})
    reader_pool = host_pool(**v.get("pool", {}))
    if v.get("quantization"):
        publish(quantization=v["quantization"])  # read from SGLang's published model config
    n = 4 * PS // reader_pool.page_size
    before = fill(reader_pool, torch.arange(n * reader_pool.page_size), seed=5)
    extra = {"interface_v1": 0 if v.get("v1") is False else 1, **where, **v.get("extra", {})}
    if extra["interface_v1"] == 0:
        reader_pool.pin_memory = False
    r = backend(reader_pool, extra, store=shared, model=v.get("model", model), tp=v.get("tp", (0, 2)),
                pp=v.get("pp", (0, 1)), mla=v.get("mla", False))
    publish()
    rkeys = keys[:n]
    if variant == "same config":
        assert r.batch_exists(rkeys) == 4
        assert r.batch_get_v1(rkeys, torch.arange(16)) == [True] * 4
        assert pages_of(reader_pool, torch.arange(16)) == want
        w.clear()
        return
    assert r.namespaces["kv"].prefix != w.namespaces["kv"].prefix
    assert r.batch_exists(rkeys) == 0
    if r.interface_v1:
        assert r.batch_get_v1(rkeys, torch.arange(n * reader_pool.page_size)) == [False] * n
    else:
        assert r.batch_get(rkeys, [reader_pool.get_dummy_flat_data_page() for _ in rkeys]) == [None] * n
    assert pages_of(reader_pool, torch.arange(n * reader_pool.page_size)) == before
    # The reader's own writes do not collide with the writer's objects, and vice versa.
    if r.interface_v1:
        assert r.batch_set_v1(rkeys, torch.arange(n * reader_pool.page_size)) == [True] * n
    assert w.batch_get_v1(keys, indices(4, first=8)) == [True] * 4
    assert pages_of(writer_pool, indices(4, first=8)) == want
    w.clear()
    r.clear()


def test_mla_pages_are_one_object_for_every_tp_rank(where, model):
    shared = kvtide.Store(**SETTINGS) if "kvtide_settings" in where else None
    src, dst = host_pool(mla=True), host_pool(mla=True)
    rank0 = backend(src, {"interface_v1": 1, **where}, store=shared, model=model, tp=(0, 2), mla=True)
    rank1 = backend(dst, {"interface_v1": 1, **where}, store=shared, model=model, tp=(1, 2), mla=True)
    assert rank0.config.is_storage_writer and not rank1.config.is_storage_writer
    assert rank0.namespaces["kv"].prefix == rank1.namespaces["kv"].prefix
    keys = hashes(3)
    want = fill(src, indices(3), seed=6)
    assert rank0.batch_set_v1(keys, indices(3)) == [True] * 3
    assert rank1.batch_exists(keys) == 3
    assert rank1.batch_get_v1(keys, indices(3, first=2)) == [True] * 3
    assert pages_of(dst, indices(3, first=2)) == want
    # MHA keeps one object per rank.
    mha0 = backend(host_pool(), {"interface_v1": 1, **where}, store=shared, model=model, tp=(0, 2))
    mha1 = backend(host_pool(), {"interface_v1": 1, **where}, store=shared, model=model, tp=(1, 2))
    assert mha0.namespaces["kv"].prefix != mha1.namespaces["kv"].prefix
    rank0.clear()


def test_ranks_of_different_tp_sizes_share_head_groups_with_tp_lcm_size(where, model):
    """A TP1 writer with tp_lcm_size 2 stores each page as two head-group objects; each TP2 rank
    reads its own group. Without tp_lcm_size a TP2 rank misses."""
    shared = kvtide.Store(**SETTINGS) if "kvtide_settings" in where else None
    writer_pool = host_pool(layout="page_head", heads=4)
    w = backend(writer_pool, {"interface_v1": 1, **where}, store=shared, model=model, tp=(0, 1), tp_lcm=2, split=True)
    keys = hashes(3)
    fill(writer_pool, indices(3), seed=7)
    groups = pages_of(writer_pool, indices(3), split=2)  # page 0 group 0, page 0 group 1, ...
    assert w.batch_set_v1(keys, indices(3)) == [True] * 3
    for rank in (0, 1):
        pool = host_pool(layout="page_head", heads=2)
        r = backend(pool, {"interface_v1": 1, **where}, store=shared, model=model, tp=(rank, 2), tp_lcm=2)
        assert r.batch_exists(keys) == 3
        assert r.batch_get_v1(keys, indices(3, first=1)) == [True] * 3
        assert pages_of(pool, indices(3, first=1)) == groups[rank::2]
        plain = backend(host_pool(layout="page_head", heads=2), {"interface_v1": 1, **where}, store=shared,
                        model=model, tp=(rank, 2))
        assert plain.batch_exists(keys) == 0
    w.clear()


# ---- SGLang's controllers and radix cache ----------------------------------------------------------

def radix_cache(extra, model, layout="page_first", mla=False, swa=False, mamba=False, metrics=False):
    """A real UnifiedRadixCache whose init_hicache attaches the backend through SGLang's assembler and
    HybridCacheController; prefetches allowed from one page on."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    ps = 1 if mamba else PS
    from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE

    args = ServerArgs(model_path="dummy", page_size=ps)
    args._mamba_cache_chunk_size = max(CHUNK_SIZE, ps)
    set_global_server_args_for_scheduler(args)
    dtype = torch.bfloat16
    rtp = ReqToTokenPool(size=10, max_context_len=512, device="cpu", enable_memory_saver=False)
    components = (ComponentType.FULL,)
    window = None
    if swa:
        window, components = 2 * ps, (ComponentType.FULL, ComponentType.SWA)
        kv = SWAKVPool(size=256, size_swa=256, page_size=ps, dtype=dtype, head_num=2, head_dim=8,
                       swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu")
        alloc = SWATokenToKVPoolAllocator(size=256, size_swa=256, page_size=ps, dtype=dtype, device="cpu",
                                          kvcache=kv, need_sort=False)
    elif mamba:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.environ import envs

        components = (ComponentType.FULL, ComponentType.MAMBA)
        with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
            shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=2,
                                            head_dim=16, state_size=8, conv_kernel=4)
            params = Mamba2CacheParams(shape=shape, layers=[0, 2])
        rtp = HybridReqToTokenPool(size=10, mamba_size=20, mamba_spec_state_size=10, max_context_len=512,
                                   device="cpu", enable_memory_saver=False, cache_params=params,
                                   mamba_layer_ids=[0, 2], enable_mamba_extra_buffer=False,
                                   speculative_num_draft_tokens=3)
        kv = HybridLinearKVPool(size=256, dtype=dtype, page_size=ps, head_num=2, head_dim=8,
                                full_attention_layer_ids=[1, 3], device="cpu", enable_memory_saver=False,
                                mamba_pool=rtp.mamba_pool)
        alloc = TokenToKVPoolAllocator(size=256, dtype=dtype, device="cpu", kvcache=kv, need_sort=False)
    else:
        if mla:
            kv = MLATokenToKVPool(size=256, page_size=ps, dtype=dtype, kv_lora_rank=16, qk_rope_head_dim=8,
                                  layer_num=2, device="cpu", enable_memory_saver=False)
        else:
            kv = MHATokenToKVPool(size=256, page_size=ps, dtype=dtype, head_num=2, head_dim=8, layer_num=2,
                                  device="cpu", enable_memory_saver=False)
        alloc = TokenToKVPoolAllocator(size=256, dtype=dtype, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=ps, disable=False,
                             sliding_window_size=window, tree_components=components, enable_metrics=metrics)
    cache = UnifiedRadixCache(params=params)
    args = ServerArgs(model_path="dummy", served_model_name=model, page_size=ps, hicache_mem_layout=layout,
                      hicache_io_backend="direct" if layout == "page_first_direct" else "kernel",
                      hicache_write_policy="write_through", hicache_storage_backend="dynamic",
                      hicache_storage_backend_extra_config=json.dumps({**BASE, "prefetch_threshold": 1, **extra}))
    if mamba:
        args._mamba_cache_chunk_size = max(CHUNK_SIZE, ps)
    set_global_server_args_for_scheduler(args)
    cache.init_hicache(args, params)
    cc = cache.cache_controller
    cc.prefetch_capacity_limit = cc.mem_pool_host.size
    if not extra.get("interface_v1"):
        # The generic interface allocates its flat page copies pinned like the pool.
        cc.storage_host_pool.pin_memory = False
    return cache


def back_up(cache, tokens, extra_pools=None):
    """What write_backup_storage hands the controller for a host-resident span; the host pages are
    filled as a device backup would. Waits for the controller's backup verdict."""
    cc = cache.cache_controller
    keys = get_storage_hash_str(tokens, None, page_size=cc.page_size)
    host = cc.mem_pool_host.alloc(len(tokens))
    want = fill(cc.storage_host_pool, host, seed=len(tokens))
    cc.write_storage(host, tokens, keys, None, **({"extra_pools": extra_pools(keys)} if extra_pools else {}))
    op = cc.ack_backup_queue.get(timeout=20)
    return op, host, want


def prefetch(cache, tokens, rid):
    request = CacheRequestHandle(rid, 0)
    cache.prefetch_from_storage(request, cache.root_node_handle(), array("q", tokens), None, None)
    op = cache.ongoing_prefetch[request].operation
    deadline = time.time() + 20
    while not cache.check_prefetch_progress(request):
        assert time.time() < deadline, "the prefetch did not finish"
        cache.check_hicache_events()
        time.sleep(0.005)
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    return op, match


LAYOUTS = [("page_first", False), ("page_first_direct", False), ("layer_first", False), ("page_head", False),
           ("page_first", True), ("page_first_direct", True), ("layer_first", True)]


@pytest.mark.parametrize("layout, mla", LAYOUTS, ids=[f"{'mla' if m else 'mha'}-{lay}" for lay, m in LAYOUTS])
def test_the_radix_cache_backs_up_and_prefetches_byte_exact(where, model, single_rank, layout, mla):
    cache = radix_cache({"interface_v1": 1, **where}, model, layout=layout, mla=mla)
    cc = cache.cache_controller
    assert type(cc).__name__ == "HybridCacheController" and cc.page_get_func == cc._page_get_zero_copy
    tokens = list(range(100, 100 + 5 * PS))
    op, host, want = back_up(cache, tokens)
    assert op.completed_tokens == len(tokens)
    got, match = prefetch(cache, tokens, "r1")
    assert got.completed_tokens == len(tokens) and match.host_hit_length == len(tokens)
    assert not set(got.host_indices.tolist()) & set(host.tolist())
    assert pages_of(cc.storage_host_pool, got.host_indices) == want
    cc.storage_backend.clear()
    cc._stop_storage_threads()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_without_interface_v1_the_generic_path_hits(where, model, single_rank, layout):
    cache = radix_cache({**where}, model, layout=layout)
    cc = cache.cache_controller
    assert cc.page_get_func == cc._generic_page_get
    tokens = list(range(200, 200 + 3 * PS))
    op, _, want = back_up(cache, tokens)
    assert op.completed_tokens == len(tokens)
    assert cc.storage_backend.batch_exists(get_storage_hash_str(tokens, None, page_size=PS)) == 3
    got, match = prefetch(cache, tokens, "r1")
    assert match.host_hit_length == len(tokens)
    assert pages_of(cc.storage_host_pool, got.host_indices) == want
    cc.storage_backend.clear()
    cc._stop_storage_threads()


def test_a_sliding_window_model_stores_and_hits_its_window(where, model, single_rank):
    cache = radix_cache({"interface_v1": 1, **where}, model, swa=True)
    cc = cache.cache_controller
    swa_host = cc.mem_pool_host.entry_map[PoolName.SWA].host_pool
    window = 2
    swa_idx = cc.mem_pool_host.alloc(window * PS, pool=PoolName.SWA)
    swa_want = fill(swa_host, swa_idx, seed=11)
    tokens = list(range(300, 300 + 5 * PS))
    # The SWA component's BACKUP_STORAGE transfer: the trailing window's pages.
    op, _, want = back_up(cache, tokens, lambda keys: [PoolTransfer(
        name=PoolName.SWA, host_indices=swa_idx, keys=keys[-window:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert op.completed_tokens == len(tokens) and op.pool_storage_result.extra_pool_hit_pages == {PoolName.SWA: 2}
    got, match = prefetch(cache, tokens, "r1")
    assert match.host_hit_length == len(tokens) and match.swa_host_hit_length == window * PS
    assert pages_of(cc.storage_host_pool, got.host_indices) == want
    swa = next(t for t in got.pool_transfers if t.name == PoolName.SWA)
    assert pages_of(swa_host, swa.host_indices) == swa_want
    cc.storage_backend.clear()
    cc._stop_storage_threads()


def test_a_mamba_model_stores_and_hits_its_state(where, model, single_rank):
    cache = radix_cache({"interface_v1": 1, **where}, model, mamba=True)
    cc = cache.cache_controller
    mamba_host = cc.mem_pool_host.entry_map[PoolName.MAMBA].host_pool
    slot = cc.mem_pool_host.alloc(1, pool=PoolName.MAMBA)
    state = fill(mamba_host, slot, seed=12)
    tokens = list(range(400, 406))
    op, _, want = back_up(cache, tokens, lambda keys: [PoolTransfer(
        name=PoolName.MAMBA, host_indices=slot, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert op.completed_tokens == len(tokens) and op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1}
    got, match = prefetch(cache, tokens, "r1")
    assert match.host_hit_length == len(tokens) and match.mamba_host_hit_length == 1
    assert pages_of(cc.storage_host_pool, got.host_indices) == want
    m = next(t for t in got.pool_transfers if t.name == PoolName.MAMBA)
    assert pages_of(mamba_host, m.host_indices) == state
    # A span whose trailing state was never stored has no restorable prefix.
    other = get_storage_hash_str(list(range(500, 506)), None, page_size=1)
    b = cc.storage_backend
    b.batch_set_v1(other, cc.mem_pool_host.alloc(6))
    result = b.batch_exists_v2(other, [PoolTransfer(name=PoolName.MAMBA, keys=["x"],
                                                    hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert result.kv_hit_pages == 0 and result.extra_pool_hit_pages == {PoolName.KV: 6}
    b.clear()
    cc._stop_storage_threads()


def test_hit_policies_of_batch_exists_v2(where, model, single_rank):
    cache = radix_cache({"interface_v1": 1, **where}, model, swa=True)
    b = cache.cache_controller.storage_backend
    swa_host = cache.cache_controller.mem_pool_host.entry_map[PoolName.SWA].host_pool
    keys = hashes(6, salt=900)
    assert b.batch_set_v1(keys, indices(6)) == [True] * 6
    # SWA objects for pages 0, 1, 3, 4 (page 2 and 5 missing).
    have = [0, 1, 3, 4]
    got = b.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.cat([indices(1, p) for p in have]),
                                       keys=[keys[p] for p in have])])
    assert got == {PoolName.SWA: [True] * 4}
    trailing = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=["a", "b"],
                                                     hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    # Stop points whose 2-page window is complete: 1 (window clipped at the start), 2 and 5.
    assert trailing.restorable_prefix_pages == [1, 2, 5] and trailing.kv_hit_pages == 5
    every = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert every.restorable_prefix_pages == [1, 2] and every.extra_pool_hit_pages[PoolName.SWA] == 2
    unknown = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER)])
    assert unknown.kv_hit_pages == 0
    assert b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices(2), keys=keys[:3])]) == \
        {PoolName.SWA: [False] * 3}, "3 keys with 2 pages of indices"
    assert b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=indices(1), keys=keys[:1])]) == \
        {PoolName.INDEXER: [False]}
    before = pages_of(swa_host, indices(2, first=10))
    assert b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices(2, first=10),
                                        keys=[keys[2], keys[3]])]) == {PoolName.SWA: [False, True]}
    assert pages_of(swa_host, indices(1, first=10)) == before[:1]
    b.clear()
    cache.cache_controller._stop_storage_threads()


@pytest.fixture
def fresh_metrics():
    """SGLang registers its Prometheus series once per process; a second cache in the same process
    would register them again, so the series this test's cache adds are dropped after it."""
    from prometheus_client import REGISTRY

    before = set(REGISTRY._collector_to_names)
    yield
    for collector in set(REGISTRY._collector_to_names) - before:
        REGISTRY.unregister(collector)


def test_metrics_on_for_many_scheduler_steps(where, model, single_rank, fresh_metrics):
    """check_hicache_events logs the backend's StorageMetrics every step (a dict crashed it)."""
    cache = radix_cache({"interface_v1": 1, **where}, model, metrics=True)
    cc = cache.cache_controller
    assert cache.enable_storage_metrics and cache.storage_metrics_collector is not None
    seen = StorageMetrics()
    real = cc.storage_backend.get_stats

    def spy():
        metrics = real()
        assert type(metrics) is StorageMetrics
        for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
            getattr(seen, name).extend(getattr(metrics, name))
        return metrics

    cc.storage_backend.get_stats = spy
    steps, pages = 12, 3
    for step in range(steps):
        tokens = list(range(1000 * (step + 1), 1000 * (step + 1) + pages * PS))
        keys = get_storage_hash_str(tokens, None, page_size=PS)
        host = cc.mem_pool_host.alloc(len(tokens))
        cc.write_storage(host, tokens, keys, None)
        deadline = time.time() + 20
        while cc.storage_backend.batch_exists(keys) < pages:
            assert time.time() < deadline
            cache.check_hicache_events()
            time.sleep(0.005)
        prefetch(cache, tokens, f"r{step}")
    for _ in range(5):
        cache.check_hicache_events()
    assert seen.backup_pgs == [pages] * steps and seen.prefetch_pgs == [pages] * steps
    assert len(seen.backup_bandwidth) == steps and all(0 < bw < 1e4 for bw in seen.backup_bandwidth)
    assert len(seen.prefetch_bandwidth) == steps and all(0 < bw < 1e4 for bw in seen.prefetch_bandwidth)
    cc.storage_backend.clear()
    cc._stop_storage_threads()


def test_the_base_controller_with_the_split_mla_layout(where, model, single_rank):
    """SGLang's HiCacheController (the pre-hybrid controller), its backup thread and prefetch threads;
    the test plays the scheduler thread that allocates the prefetch's host pages."""
    publish(hicache_mem_layout="page_first_kv_split")
    kv = MLATokenToKVPool(size=64, page_size=PS, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
                          layer_num=2, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=64, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    host = split_mla_pool()
    cc = HiCacheController(alloc, host, PS, None, threading.Event(), storage_backend="dynamic", model_name=model,
                           storage_backend_extra_config={**BASE, "interface_v1": 1, **where})
    assert cc.storage_config.is_mla_model and cc.page_set_func == cc._page_set_zero_copy
    tokens = list(range(12))
    keys = get_storage_hash_str(tokens, None, page_size=PS)
    src = host.alloc(len(tokens))
    want = fill(host, src, seed=13)
    cc.write_storage(src, tokens, keys)
    assert cc.ack_backup_queue.get(timeout=20).completed_tokens == len(tokens)
    cc.prefetch("r", tokens)
    hit = cc.prefetch_hit_queue.get(timeout=20)
    assert hit.storage_hit_count == len(tokens)
    hit.host_indices = host.alloc(hit.storage_hit_count)
    cc.prefetch_buffer.put(hit)
    done = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=20)
        if ack.completed_req:
            break
        done = ack.completed_tokens
    assert done == len(tokens)
    assert pages_of(host, hit.host_indices) == want
    cc.storage_backend.clear()
    cc._stop_storage_threads()


def test_the_controller_attach_fails_with_the_reason(single_rank):
    """A pool the adapter cannot serve fails SGLang's attach (at startup), not its first backup."""
    publish(hicache_mem_layout="page_first_kv_split")
    kv = MLATokenToKVPool(size=64, page_size=PS, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
                          layer_num=2, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=64, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    with pytest.raises(ValueError, match="the generic interface cannot copy this layout"):
        HiCacheController(alloc, split_mla_pool(), PS, None, threading.Event(), storage_backend="dynamic",
                          model_name="m", storage_backend_extra_config={**BASE, "kvtide_settings": SETTINGS})
