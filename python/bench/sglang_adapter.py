"""The SGLang adapter's cost over kvtide's own batch calls, in the same run.

A 64-page ``batch_get_v1`` / ``batch_set_v1`` of ``kvtide.sglang.KvtideHiCacheStorage`` on a real
SGLang 0.5.23 host pool (``MHATokenToKVPoolHost``, CPU), against the kvtide batch call it makes
(``batch_get_into_multi_buffers`` / ``batch_put_from_multi_buffers``) on the same objects, the same
host pages and the same store, called with its names and buffers built once. The adapter's call
also includes what any zero-copy backend pays inside SGLang: the pool's
``get_page_buffer_meta``, which is timed on its own as well. Writes time fresh objects: the batch
is removed (untimed) before every write. Embedded, and through a kvtide-owner over its Unix socket.
The two sides alternate call by call; one JSON line per case with the medians and their ratio.

    PYTHONPATH=python python3 python/bench/sglang_adapter.py --owner-bin target/release/kvtide-owner
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from owner_process import OwnerProcess, default_owner_binary  # noqa: E402


def host_pool(layout, layers, heads, head_dim, page, pages):
    import torch
    import sglang.srt.mem_cache.pool_host.common as common
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    common._cuda_host_register = lambda *a, **k: None  # no CUDA here to pin with
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page, hicache_mem_layout=layout))
    kv = MHATokenToKVPool(size=pages * page, page_size=page, dtype=torch.bfloat16, head_num=heads,
                          head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False)
    pool = build_kv_host_pool(kv_pool=kv, page_size=page)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)
    return pool


def case(store, layout, layers, heads, head_dim, page, pages, iters):
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    import kvtide.sglang as ksg

    pool = host_pool(layout, layers, heads, head_dim, page, pages)
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name=f"bench-{layout}-{page}", extra_config={"interface_v1": 1})
    backend = ksg.KvtideHiCacheStorage(cfg, {}, store=store)
    backend.register_mem_pool_host(pool)
    keys = [f"{i:064x}" for i in range(pages)]
    indices = torch.arange(pages * page, dtype=torch.int64)
    names = backend._kv.objects(keys)
    bufs, page_bytes = backend._kv.buffers(keys, indices)

    def raw_get():
        return store.batch_get_into_multi_buffers(names, bufs)

    def raw_set():
        return store.batch_put_from_multi_buffers(names, bufs)

    def meta():
        return pool.get_page_buffer_meta(indices)

    def adapter_get():
        return backend.batch_get_v1(keys, indices)

    def adapter_set():
        return backend.batch_set_v1(keys, indices)

    out = []
    for op, raw, adapter in (("get", raw_get, adapter_get), ("set", raw_set, adapter_set)):
        times = {"kvtide": [], "adapter": [], "meta": []}
        if op == "get":
            store.batch_remove(names)
            assert adapter_set() == [True] * pages
        for i in range(iters + 20):
            for side, fn in (("kvtide", raw), ("adapter", adapter), ("meta", meta)):
                if op == "set" and side != "meta":
                    store.batch_remove(names)
                start = time.perf_counter()
                res = fn()
                elapsed = (time.perf_counter() - start) * 1e6
                if side == "adapter":
                    assert res == [True] * pages, res[:4]
                elif side == "kvtide":
                    want = page_bytes if op == "get" else None
                    assert all(r == want for r in res), res[:4]
                if i >= 20:
                    times[side].append(elapsed)
        med = {k: statistics.median(v) for k, v in times.items()}
        out.append({"op": f"batch_{op}_v1", "layout": layout, "pages": pages, "page_bytes": page_bytes,
                    "buffers_per_page": len(bufs[0]), "kvtide_us": round(med["kvtide"], 1),
                    "adapter_us": round(med["adapter"], 1), "get_page_buffer_meta_us": round(med["meta"], 1),
                    "ratio": round(med["adapter"] / med["kvtide"], 3),
                    "ratio_without_meta": round((med["adapter"] - med["meta"]) / med["kvtide"], 3)})
    store.batch_remove(names)
    return out


CASES = [  # layout, layers, heads, head_dim, tokens per page
    ("page_first", 4, 2, 64, 16),     # 32 KiB pages, 2 buffers each
    ("page_first", 32, 8, 128, 16),   # 2 MiB pages, 2 buffers each
    ("layer_first", 32, 8, 128, 16),  # 2 MiB pages, 64 buffers each
]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--owner-bin", default=(default_owner_binary() or ("target/release/kvtide-owner",))[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--shards", type=int, default=2)
    a = p.parse_args()

    import kvtide

    dram = "1GiB"
    embedded = kvtide.Store(dram_bytes=dram, shards=a.shards, pin_threads=False)
    for line in [r for c in CASES for r in case(embedded, *c, a.pages, a.iters)]:
        print(json.dumps({"where": "embedded", **line}), flush=True)
    embedded.close()
    with tempfile.TemporaryDirectory(prefix="kvtide-sglang-bench-") as data:
        os.chmod(data, 0o700)
        sock = os.path.join(data, "owner.sock")
        with socket.socket() as s:  # the owner also listens on TCP; a free port, not its default
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        owner = OwnerProcess(a.owner_bin, data, ["--dram-bytes", dram, "--shards", str(a.shards), "--no-ssd",
                                                 "--unix", sock, "--tcp", f"127.0.0.1:{port}"])
        try:
            remote = owner.connect(sock)
            for line in [r for c in CASES for r in case(remote, *c, a.pages, a.iters)]:
                print(json.dumps({"where": "owner (unix socket)", "owner": a.owner_bin, **line}), flush=True)
            remote.close()
        finally:
            owner.stop()


if __name__ == "__main__":
    main()
