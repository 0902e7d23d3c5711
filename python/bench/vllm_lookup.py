"""How long vLLM's scheduler spends looking up a prompt's offloaded chunks in kvtide, and how
many store calls (round trips to the owner) that takes: kvtide.vllm's batched, held lookup
(driven by vLLM 0.34.0's own OffloadingConnector scheduler: get_num_new_matched_tokens, then the
step end) against the per-block way of the previous adapter (one synchronous batch_exists per
chunk on the scheduler thread).

For 1k, 8k and 32k-token prompts (16 tokens per block, one block per chunk, one rank), every
chunk stored in an owner beforehand, over its Unix socket with shared memory:
- "scheduler thread": time vLLM's scheduler thread spends in the connector for the request
  (every lookup pass and step end that found the answer missing or used it), the cost that
  holds up scheduling;
- "until answered": from the first lookup until vLLM's lookup returns the hit count (the
  background hold included);
- "store calls": calls to the store (each one round trip for these sizes);
and, as the floor, vLLM's own lookup loop over a manager that answers from memory.
The median of `--repeat` runs (a fresh request each run; holds released between runs).

    PYTHONPATH=python python python/bench/vllm_lookup.py [--owner target/release/kvtide-owner]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import kvtide

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from owner_process import OwnerProcess, default_owner_binary  # noqa: E402

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 65536, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "head_dim": 16,
}
BLOCK = 16


class Counting:
    """The store, counting calls by name (a lookup's store calls are its round trips)."""

    def __init__(self, store):
        self._store = store
        self.calls = {}

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kw)

        return call

    def count(self):
        return sum(self.calls.values())


def scheduler(address, model_dir, max_len):
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    vc = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=max_len),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_len, max_model_len=max_len,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config={"spec_name": "KvtideOffloadingSpec",
                                                                       "spec_module_path": "kvtide.vllm",
                                                                       "kvtide_address": address}))
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    blocks = max_len // BLOCK + 8
    kvc = KVCacheConfig(num_blocks=blocks, kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
                        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * blocks * 2, layers=layers,
                                                        layer_stride=spec.page_size_bytes * blocks,
                                                        block_stride=spec.page_size_bytes)])
    vc.cache_config.num_gpu_blocks = blocks
    return OffloadingConnector(vc, KVConnectorRole.SCHEDULER, kvc)


def request(rid, tokens):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def keys_of(req):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(h, 0) for h in req.block_hashes]


def new_way(conn, counting, tokens, rid):
    """vLLM's path: the lookups answer RETRY, the step end posts one hold, the next step's
    lookups hit."""
    from vllm.v1.core.sched.output import SchedulerOutput

    cs = conn.connector_scheduler
    req = request(rid, tokens)
    before = counting.count()
    t0 = time.perf_counter()
    conn.on_new_request(req)
    num, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.build_connector_meta(SchedulerOutput.make_empty())  # the step end
    busy = time.perf_counter() - t0
    while num is None:
        time.sleep(0.0002)  # the scheduler thread runs the model meanwhile
        t1 = time.perf_counter()
        if not conn.has_pending_push_work():
            num, _ = conn.get_num_new_matched_tokens(req, 0)
            conn.build_connector_meta(SchedulerOutput.make_empty())
            busy += time.perf_counter() - t1
    answered = time.perf_counter() - t0
    calls = counting.count() - before
    assert num == (len(tokens) - 1) // BLOCK * BLOCK, (num, len(tokens))
    # The request ends without loading: its holds go back.
    cs.manager.on_request_finished(cs._req_status.pop(rid).req_context)
    return busy, answered, calls


def floor(conn, tokens, rid):
    """vLLM's own lookup loop over a manager that answers HIT from memory: the part of the
    scheduler time that is vLLM's, whatever the store."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_offload.base import LookupResult

    cs = conn.connector_scheduler
    real = cs.manager
    lookup = real.lookup
    real.lookup = lambda key, ctx: LookupResult.HIT
    try:
        req = request(rid, tokens)
        t0 = time.perf_counter()
        conn.on_new_request(req)
        num, _ = conn.get_num_new_matched_tokens(req, 0)
        conn.build_connector_meta(SchedulerOutput.make_empty())
        elapsed = time.perf_counter() - t0
        assert num == (len(tokens) - 1) // BLOCK * BLOCK
        real.on_request_finished(cs._req_status.pop(rid).req_context)
    finally:
        real.lookup = lookup
    return elapsed, elapsed, 0


def old_way(store, prefix, keys):
    """The previous adapter: one synchronous batch_exists per chunk, on the scheduler thread."""
    calls = 0
    t0 = time.perf_counter()
    hits = 0
    for key in keys:
        found = store.batch_exists([f"{prefix}/{bytes(key).hex()}"])
        calls += 1
        if not all(f is True for f in found):
            break
        hits += 1
    elapsed = time.perf_counter() - t0
    assert hits == len(keys)
    return elapsed, elapsed, calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--owner", default=(default_owner_binary() or (None,))[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [1024, 8192, 32768]
    data = tempfile.mkdtemp(prefix="kvtide-vllm-lookup-")
    owner = OwnerProcess(args.owner, data, ["--dram-bytes", "1GiB", "--no-ssd", "--shards", "2"])
    sock = os.path.join(data, "owner.sock")
    address = f"unix:{sock}"
    setup = owner.connect(sock)
    model_dir = tempfile.mkdtemp(prefix="kvtide-vllm-model-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    conn = scheduler(address, model_dir, max(sizes) + 64)
    manager = conn.connector_scheduler.manager
    counting = Counting(manager._store)
    manager._store = counting
    prefix = next(iter(manager._rank_prefixes))
    rows = []
    for n in sizes:
        tokens = [(i * 7) % 250 + 1 for i in range(n + 1)]
        keys = keys_of(request("keys", tokens))
        names = [f"{prefix}/{bytes(k).hex()}" for k in keys]
        chunk = b"k" * 4096  # the lookup never reads the bytes
        for i in range(0, len(names), 512):
            setup.batch_put_from([*names[i:i + 512]], [chunk] * len(names[i:i + 512]), upsert=True)
        new = [new_way(conn, counting, tokens, f"r{n}-{r}") for r in range(args.repeat)]
        old = [old_way(setup, prefix, keys) for _ in range(args.repeat)]
        base = [floor(conn, tokens, f"f{n}-{r}") for r in range(args.repeat)]
        for way, runs in (("batched + held (kvtide.vllm)", new), ("per block (previous adapter)", old),
                          ("vLLM's loop alone (floor)", base)):
            rows.append({
                "tokens": n, "chunks": len(keys), "way": way,
                "scheduler_ms": statistics.median(r[0] for r in runs) * 1e3,
                "answered_ms": statistics.median(r[1] for r in runs) * 1e3,
                "store_calls": statistics.median(r[2] for r in runs),
            })
    held = setup.held_resources()
    conn.shutdown()
    setup.close()
    owner.stop()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"owner: {args.owner}")
    print(f"{'tokens':>6} {'chunks':>6}  {'way':30} {'scheduler ms':>12} {'answered ms':>12} {'store calls':>11}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['chunks']:>6}  {r['way']:30} {r['scheduler_ms']:12.3f} {r['answered_ms']:12.3f} "
              f"{r['store_calls']:11.0f}")
    print(f"held after the runs: holds {held['holds']}, leases {held['leases']}")


if __name__ == "__main__":
    main()
