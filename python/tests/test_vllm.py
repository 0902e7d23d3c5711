"""kvtide.vllm inside real vLLM 0.34.0: vLLM's own Scheduler with its OffloadingConnector in the
scheduler role, and an OffloadingConnector in the worker role on CPU tensors, both built by
vLLM's factories from a real VllmConfig (a tiny local model config; no GPU, no download). A
"model" writes a deterministic KV per block (a function of the block's token prefix and
layer) for the tokens it computes and checks the KV of every block before them, so a loaded
block that is not byte-exact fails the test.

Covered: the whole path (lookup -> update_state_after_alloc -> build_connector_meta -> worker
load/store -> get_finished) embedded and through an owner, including a load that starts inside
a chunk; the naming matrix (the same configuration hits, each single difference misses and never
loads other bytes); an eviction between lookup and load that does not fail the load thanks to
the hold (and the same flood failing it, reported, with holds off); TCP without holds; KV
events; bad configuration refused at construction; holds and leases back to zero afterwards."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import BlockRemoved, BlockStored, NullEventPublisher  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import get_offload_block_hash, make_offload_key  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import kvtide  # noqa: E402
import kvtide.vllm as kv_vllm  # noqa: E402
from conftest import Owner, wait_idle  # noqa: E402

BLOCK = 16  # tokens per GPU block
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "head_dim": 16,
}
EMBEDDED = {"kvtide_settings": {"dram_bytes": "64MiB", "shards": 2, "pin_threads": False}}

init_none_hash(sha256)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two local model directories with the same tiny config (two model names)."""
    dirs = []
    for name in ("tiny-a", "tiny-b"):
        d = tmp_path_factory.mktemp(name)
        (d / "config.json").write_text(json.dumps(TINY_LLAMA))
        dirs.append(str(d))
    return dirs


def vllm_config(model, extra, *, dtype="bfloat16", cache_dtype="auto", block_size=BLOCK, tp=1, pp=1, rank=0,
                revision=None, quantization=None, events=False, on_load_failure="fail"):
    mc = ModelConfig(model=model, dtype=dtype, skip_tokenizer_init=True, max_model_len=4096, revision=revision)
    if quantization is not None:
        mc.quantization = quantization
    return VllmConfig(
        model_config=mc,
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank),
        cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=16, max_model_len=4096,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_load_failure_policy=on_load_failure,
            kv_connector_extra_config={"spec_name": "KvtideOffloadingSpec", "spec_module_path": "kvtide.vllm",
                                       **extra}),
    )


def kv_cache_config(vc, num_blocks):
    """One full-attention group over LAYERS, sized as this rank's share of the KV heads."""
    kv_dtype = vc.model_config.dtype if vc.cache_config.cache_dtype == "auto" else torch.float8_e4m3fn
    heads = max(1, TINY_LLAMA["num_key_value_heads"] // vc.parallel_config.tensor_parallel_size)
    spec = FullAttentionSpec(block_size=vc.cache_config.block_size, num_kv_heads=heads,
                             head_size=TINY_LLAMA["head_dim"], dtype=kv_dtype)
    page = spec.page_size_bytes
    vc.cache_config.num_gpu_blocks = num_blocks
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=LAYERS,
                                        layer_stride=page * num_blocks, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    ), page


def fake_kv(layer, prefix, page, rank=0):
    """The "model's" KV of the block ending `prefix` in `layer` on `rank` (ranks hold different
    heads): a pure function of the three."""
    seed = sha256((layer, rank, tuple(prefix)))
    return torch.frombuffer(bytearray((seed * (page // len(seed) + 1))[:page]), dtype=torch.uint8)


class Published(NullEventPublisher):
    """vLLM's event publisher, keeping what the scheduler publishes."""

    def __init__(self, events):
        self.kept = events

    def publish(self, batch):
        self.kept.extend(batch.events)


class Engine:
    """One vLLM engine in this process: vLLM's Scheduler (its OffloadingConnector in the
    scheduler role) and one worker OffloadingConnector per rank on CPU tensors, their outputs
    merged by vLLM's KVOutputAggregator. `step()` does what the model runners do around a
    forward pass."""

    def __init__(self, model, extra, num_blocks=64, **cfg):
        self.vc = vllm_config(model, extra, **cfg)
        self.kvc, self.page = kv_cache_config(self.vc, num_blocks)
        self.world = self.vc.parallel_config.world_size
        block_size = self.vc.cache_config.block_size
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=self.kvc, log_stats=True, block_size=block_size,
                               structured_output_manager=StructuredOutputManager(self.vc))
        self.workers, self.caches = [], []
        for rank in range(self.world):
            vc = self.vc if rank == 0 else vllm_config(model, extra, **dict(cfg, rank=rank))
            worker = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER,
                                                         kv_cache_config=self.kvc)
            caches = {layer: torch.zeros(num_blocks, self.page, dtype=torch.uint8) for layer in LAYERS}
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.caches.append(caches)
        self.aggregator = KVOutputAggregator(self.world)
        self.events = []
        if self.vc.kv_events_config is not None:
            self.sched.kv_event_publisher = Published(self.events)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.prompts = {}
        self.computed = {}  # req_id -> tokens the model computed (the rest came from kvtide)
        self.checked = {}  # req_id -> blocks whose KV the model found byte-exact before computing
        self.failed_loads = set()

    @property
    def worker(self):
        return self.workers[0]

    @property
    def manager(self):
        return self.sched.connector.connector_scheduler.manager

    @property
    def store(self):
        return self.manager._store

    def add(self, rid, tokens):
        self.prompts[rid] = list(tokens)
        self.computed[rid] = 0
        self.checked[rid] = 0
        self.sched.add_request(Request(request_id=rid, prompt_token_ids=list(tokens), pooling_params=None,
                                       sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                                       block_hasher=self.hasher))

    def abort(self, rid):
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def step(self, before_load=None):
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        bs = self.vc.cache_config.block_size
        ran = list(so.num_scheduled_tokens)
        outputs = []
        wrong = []
        for rank, (w, caches) in enumerate(zip(self.workers, self.caches)):
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if before_load is not None and rank == 0:
                before_load(so)
            w.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
            for rid, n in so.num_scheduled_tokens.items():
                start = self.sched.requests[rid].num_computed_tokens - n
                blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
                tokens = self.prompts[rid]
                # Attention reads every earlier block: each must hold the model's own KV.
                for i in range(start // bs):
                    for layer in LAYERS:
                        want = fake_kv(layer, tokens[:(i + 1) * bs], self.page, rank)
                        if not torch.equal(caches[layer][blocks[i]], want):
                            wrong.append(f"{rid}: rank {rank} block {i} {layer} is not its KV")
                    if rank == 0:
                        self.checked[rid] = max(self.checked[rid], i + 1)
                for i in range(start // bs, (start + n) // bs):
                    for layer in LAYERS:
                        caches[layer][blocks[i]] = fake_kv(layer, tokens[:(i + 1) * bs], self.page, rank)
            w.wait_for_save()
            results = w.get_transfer_results(so.finished_req_ids)
            self.failed_loads |= results.failed_recving
            out = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                    finished_recving=results.finished_recving or None,
                                    failed_recving=results.failed_recving,
                                    kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=ran, sampled_token_ids=[[7] for _ in ran],
                                             kv_connector_output=out))
        # After vLLM's own checks (a failed sync load raises in get_finished, after the forward).
        assert not wrong, wrong
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] += n
        self.sched.update_from_output(so, self.aggregator.aggregate(outputs))
        # The forward pass: vLLM's scheduler thread waits here, so background lookups run.
        time.sleep(0.002)
        return so

    def settle(self, max_steps=400):
        """Steps until no request and no transfer or lookup is left."""
        for _ in range(max_steps):
            self.step()
            if not self.sched.requests and not self.sched.connector.has_pending_push_work():
                return
        raise AssertionError("the engine did not settle")

    def lookup_answered(self, timeout=10.0):
        """Steps until the background lookups queued so far are answered."""
        self.step()
        deadline = time.time() + timeout
        while self.manager.has_pending_work():
            assert time.time() < deadline, "the lookup was never answered"
            time.sleep(0.002)

    def keys_of(self, tokens):
        """vLLM's OffloadKeys of a prompt's chunks (group 0)."""
        bpc = self.sched.connector.connector_scheduler.config.blocks_per_chunk
        req = Request(request_id="keys", prompt_token_ids=list(tokens), pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=1), block_hasher=self.hasher)
        return [make_offload_key(h, 0) for h in req.block_hashes[bpc - 1::bpc]]

    def names_of(self, tokens):
        return [n for key in self.keys_of(tokens) for n in self.manager._names(key)]

    def close(self):
        self.sched.connector.shutdown()
        for w in self.workers:
            w.shutdown()


def prompt(seed, chunks=3, tail=5, bpc=2):
    return [(seed * 31 + i) % 250 + 1 for i in range(chunks * bpc * BLOCK + tail)]


def assert_idle(store):
    held = wait_idle(store)
    assert all(v == 0 for v in held.values()), f"still held: {held}"


@pytest.fixture(params=["embedded", "owner"])
def extra(request, owner):
    if request.param == "embedded":
        return dict(EMBEDDED, blocks_per_chunk=2)
    return {"kvtide_address": owner.unix, "blocks_per_chunk": 2}


@pytest.fixture(scope="module")
def small_owner():
    """An owner with little DRAM, for the eviction tests."""
    o = Owner(dram="4MiB")
    yield o
    o.stop()


# ---- the whole path ---------------------------------------------------------------------------------


def test_store_then_load_in_another_engine_byte_exact(models, extra):
    writer = Engine(models[0], extra)
    tokens = prompt(1)
    writer.add("w", tokens)
    writer.settle()
    assert writer.computed["w"] == len(tokens)
    names = writer.names_of(tokens)
    assert len(names) == 3 and all(r is True for r in writer.store.batch_exists(names))
    assert writer.manager.round_trips <= 2, "one batched lookup for the whole prompt"

    reader = Engine(models[0], extra)
    reader.add("r", tokens + [9, 9, 9])
    reader.settle()
    # 96 of the 104 tokens came from kvtide; the model computed only the rest, after checking
    # every loaded block byte for byte.
    assert reader.computed["r"] == len(tokens) + 3 - 96
    assert reader.checked["r"] == 6
    assert not reader.failed_loads

    # A load that starts inside a chunk: the reader's GPU cache already holds block 0 of
    # another prompt sharing it, so only the chunks' later blocks are read.
    other = tokens[:BLOCK] + prompt(2)[BLOCK:]
    writer.add("w2", other)
    writer.settle()
    reader.add("warm", other[:BLOCK + 3])
    reader.settle()
    reader.add("r2", other + [5])
    reader.settle()
    assert reader.computed["r2"] == len(other) + 1 - 96 + 0 and reader.checked["r2"] == 6
    assert not reader.failed_loads
    for e in (writer, reader):
        e.close()
    if "kvtide_settings" in extra:
        return
    store = kvtide.connect(extra["kvtide_address"])
    assert_idle(store)
    store.close()


def test_holds_and_leases_back_to_zero(models):
    """Embedded, where this process sees every gauge: holds while a load is prepared, none after."""
    extra = dict(EMBEDDED, blocks_per_chunk=2)
    writer = Engine(models[0], extra)
    tokens, other = prompt(3), prompt(4)
    writer.add("w", tokens)
    writer.add("w2", other)
    writer.settle()
    reader = Engine(models[0], extra)
    reader.add("r", tokens + [1])
    reader.lookup_answered()
    held = reader.store.held_resources()
    assert held["holds"] == 1 and held["held_keys"] == 3 and held["leases"] == 3
    reader.settle()
    assert reader.computed["r"] == 1 + len(tokens) - 96
    assert_idle(reader.store)
    # A request that finishes (here: aborted) while its lookup holds chunks gives them back.
    reader.add("gone", other + [2, 3])
    reader.lookup_answered()
    assert reader.store.held_resources()["held_keys"] == 3
    reader.abort("gone")
    reader.settle()
    assert_idle(reader.store)
    writer.close()
    reader.close()


# ---- names: no aliasing -----------------------------------------------------------------------------


def _writer(models, extra, tokens, **cfg):
    """An engine of configuration `cfg` (every rank) that stored `tokens`' chunks."""
    writer = Engine(models[0], extra, **cfg)
    writer.add("w", tokens)
    writer.settle()
    return writer


def _hits(engine, tokens):
    """Tokens vLLM's scheduler would load for `tokens` (its own lookup path)."""
    engine.add("probe", tokens + [1])
    engine.lookup_answered()
    num, _ = engine.sched.connector.get_num_new_matched_tokens(engine.sched.requests["probe"], 0)
    engine.abort("probe")
    engine.settle()
    return num


VARIANTS = {
    "model name": dict(model=1),
    "revision": dict(revision="v2"),
    "cache tag": dict(extra={"kvtide_cache_tag": "tuned-weights-2"}),
    "model dtype fp16": dict(dtype="float16"),
    "kv cache fp8": dict(cache_dtype="fp8"),
    "quantization": dict(quantization="fp8"),
    "block size 32": dict(block_size=32),
    "blocks per chunk 1": dict(extra={"blocks_per_chunk": 1}),
    "TP4 reading TP2xPP2": dict(tp=4, writer=dict(tp=2, pp=2)),
    "TP2xPP2 reading TP4": dict(tp=2, pp=2, writer=dict(tp=4)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_single_difference_misses(models, variant):
    v = dict(VARIANTS[variant])
    base_extra = dict(EMBEDDED, blocks_per_chunk=2)
    writer_cfg = v.pop("writer", {})
    tokens = prompt(10 + list(VARIANTS).index(variant))
    writer = _writer(models, base_extra, tokens, **writer_cfg)
    same = Engine(models[0], base_extra, **writer_cfg)
    assert _hits(same, tokens) == 96, "the same configuration hits"
    reader_extra = dict(base_extra, **v.pop("extra", {}))
    model = models[v.pop("model", 0)]
    reader = Engine(model, reader_extra, **v)
    # Never a hit, and no name the writer used.
    assert _hits(reader, tokens) == 0
    assert not set(reader.manager._rank_prefixes) & set(writer.manager._rank_prefixes)
    # And a load of the writer's keys by this configuration fails instead of reading them.
    worker = reader.worker.connector_worker.worker
    with pytest.raises(AssertionError):
        _load_directly(reader, worker, writer.keys_of(tokens)[:1])
    for e in (writer, same, reader):
        e.close()


def _load_directly(engine, worker, keys):
    """Submits a load of `keys` into blocks 0.. of `engine` and asserts it succeeded."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    bpc = engine.sched.connector.connector_scheduler.config.blocks_per_chunk
    spec = GPULoadStoreSpec(list(range(bpc * len(keys))), group_sizes=[bpc * len(keys)], block_indices=[0])
    ptrs = resolve_device_pointers(spec, engine.worker.connector_worker._kv_caches)
    assert worker.submit_load(999, kv_vllm.KvtideLoadStoreSpec(keys), ptrs)
    worker.wait({999})
    (result,) = [r for r in worker.get_finished() if r.job_id == 999]
    assert result.success, "the load failed"


def test_an_object_of_the_wrong_size_is_never_stored_or_loaded(models):
    extra = dict(EMBEDDED, blocks_per_chunk=2)
    engine = Engine(models[0], extra)
    tokens = prompt(40)
    names = engine.names_of(tokens)
    engine.store.put(names[0], b"x" * 100)  # someone else's object under the first chunk's name
    engine.add("w", tokens)
    engine.settle()
    # The first chunk's store failed (vLLM keeps it unpublished); the others were stored.
    assert engine.store.batch_get_size(names)[0] == 100
    worker = engine.worker.connector_worker.worker
    with pytest.raises(AssertionError):
        _load_directly(engine, worker, engine.keys_of(tokens)[:1])
    engine.close()


# ---- holds: an eviction between lookup and load ------------------------------------------------------


@pytest.mark.parametrize("where", ["embedded", "owner"])
@pytest.mark.parametrize("holds", [True, False], ids=["held", "not-held"])
def test_a_flood_between_lookup_and_load(models, small_owner, where, holds, monkeypatch):
    if where == "embedded":
        extra = {"kvtide_settings": {"dram_bytes": "4MiB", "shards": 1, "pin_threads": False}, "blocks_per_chunk": 2}
        flood_store = None
    else:
        extra = {"kvtide_address": small_owner.unix, "blocks_per_chunk": 2}
        flood_store = small_owner.connect("unix")
    if not holds:
        monkeypatch.setattr(kv_vllm, "_holds_supported", lambda store: False)
    extra["sync_load_budget_bytes"] = 1 << 30  # loads run within the step: a failure would raise
    writer = Engine(models[0], extra)
    # Fresh objects for each case: one already read survives a flood on its own (the store keeps
    # what was reused), which is not what this test is about.
    seed = 50 + 2 * (2 * (where == "owner") + holds)
    tokens, spare = prompt(seed), prompt(seed + 1)
    writer.add("w", tokens)
    writer.add("w2", spare)
    writer.settle()
    store = flood_store or writer.store
    reader = Engine(models[0], extra)
    reader.add("r", tokens + [4])
    reader.lookup_answered()
    value = b"f" * (64 << 10)

    def flood(tag):
        for i in range(160):  # 10 MiB through 4 MiB of DRAM
            try:
                store.put(f"flood/{tag}/{i}", value)
            except kvtide.KvtideError:
                pass

    def flood_until_spare_gone(tag):
        # A loaded machine may fail some of a flood's puts (swallowed above): flood again, a
        # bounded number of times, until the spare prompt's chunks are out.
        for round_ in range(8):
            flood(f"{tag}{round_}")
            if not any(r is True for r in store.batch_exists(writer.names_of(spare))):
                return

    def load_after_floods():
        # Another tenant writes between the lookup and prepare_load ...
        flood("a")
        # ... and between prepare_load and the worker's load.
        reader.step(before_load=lambda so: flood_until_spare_gone("b"))
        assert not any(r is True for r in store.batch_exists(writer.names_of(spare))), "the flood evicted the rest"
        reader.settle()

    if holds:
        load_after_floods()
        assert not reader.failed_loads
        assert reader.computed["r"] == len(tokens) + 1 - 96 and reader.checked["r"] == 6
    else:
        # Without a hold the chunks were evicted and the sync load fails: vLLM raises (its
        # request already ran on the unloaded KV). The failure is reported, never a success.
        with pytest.raises(RuntimeError, match="sync load job .* failed"):
            load_after_floods()
    for e in (writer, reader):
        e.close()
    if flood_store is not None:
        assert_idle(flood_store)
        flood_store.close()


def test_tcp_holds_and_a_forced_removal_reports_a_failed_load(models, owner):
    extra = {"kvtide_address": owner.tcp, "kvtide_connect": {"token_file": owner.token_file}, "blocks_per_chunk": 2}
    writer = Engine(models[0], extra)
    tokens = prompt(60)
    writer.add("w", tokens)
    writer.settle()
    assert writer.manager._spec.holds is True, "a TCP client holds chunks too"
    reader = Engine(models[0], extra, on_load_failure="recompute")
    reader.add("r", tokens + [1])
    reader.lookup_answered()
    # The objects are removed by force after the lookup (a hold keeps them from eviction, not
    # from a forced removal): the load fails, vLLM is told, and recomputes.
    assert all(r is None for r in writer.store.batch_remove(writer.names_of(tokens), force=True))
    reader.settle()
    assert reader.failed_loads == {"r"}
    assert reader.computed["r"] == len(tokens) + 1
    for e in (writer, reader):
        e.close()
    Engine(models[0], dict(extra, kvtide_require_hold=True)).close()


# ---- KV events --------------------------------------------------------------------------------------


def external(key):
    """The block hash of an OffloadKey as vLLM's events carry it."""
    return maybe_convert_block_hash(BlockHash(get_offload_block_hash(key)))


def test_kv_events_for_stores_and_removals(models):
    extra = dict(EMBEDDED, blocks_per_chunk=2)
    engine = Engine(models[0], extra, events=True)
    tokens = prompt(70)
    engine.add("w", tokens)
    engine.settle()
    keys = engine.keys_of(tokens)
    stored = [e for e in engine.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(stored) == len(keys), engine.events
    assert {e.block_hashes[0] for e in stored} == {external(k) for k in keys}
    # The objects go (evicted, or removed by another tenant): the next lookup that misses them
    # announces their removal.
    engine.store.batch_remove(engine.names_of(tokens), force=True)
    reader = Engine(models[0], extra, events=True)
    reader.manager._announced.update(engine.manager._announced)  # as if this engine had stored them
    reader.add("again", tokens + [1])
    reader.settle()
    removed = [e for e in reader.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert {h for e in removed for h in e.block_hashes} >= {external(keys[0])}
    engine.close()
    reader.close()


# ---- configuration refused at construction ------------------------------------------------------------


@pytest.mark.parametrize("bad, error, match", [
    ({"kvtide_adress": "unix:/x"}, kv_vllm.ConfigError, "unknown kv_connector_extra_config keys"),
    ({"kvtide_address": "unix:/nonexistent/owner.sock"}, ConnectionError, "cannot reach the kvtide owner"),
    ({"kvtide_address": ""}, kv_vllm.ConfigError, "non-empty string"),
    ({"kvtide_hold_ttl_ms": 10}, kv_vllm.ConfigError, "kvtide_hold_ttl_ms"),
    ({"kvtide_threads": "4"}, kv_vllm.ConfigError, "kvtide_threads"),
    ({"kvtide_settings": {"dram_bytes": "nonsense"}}, kv_vllm.ConfigError, "embedded kvtide store"),
    ({"canonical_layout": True}, kv_vllm.ConfigError, "canonical_layout"),
])
def test_bad_configuration_is_refused_at_construction(models, bad, error, match):
    extra = {**EMBEDDED, **bad} if "kvtide_address" not in bad else bad
    vc = vllm_config(models[0], extra)
    kvc, _ = kv_cache_config(vc, 16)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(error, match=match):
            OffloadingConnector(vc, role, kvc)


def test_the_spec_is_found_by_vllms_factory(models):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    vc = vllm_config(models[0], EMBEDDED)
    cls = OffloadingSpecFactory.get_spec_cls(vc.kv_transfer_config.kv_connector_extra_config)
    assert cls is kv_vllm.KvtideOffloadingSpec


@pytest.mark.parametrize("fake, match", [
    ("m = types.ModuleType('vllm'); m.__version__ = '0.33.1'; sys.modules['vllm'] = m", "found vLLM 0.33.1"),
    ("sys.modules['vllm'] = None", "vLLM is not importable"),
])
def test_another_vllm_is_refused_with_the_supported_version(fake, match):
    code = f"import sys, types; {fake}\nimport kvtide.vllm"
    python_dir = str(Path(kv_vllm.__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": python_dir, "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "0.34.0" in r.stderr and match in r.stderr, r.stderr[-2000:]


def test_replicated_layout_names_one_object_for_all_tp_ranks(models):
    """vLLM's replicated_layout (pure MLA, TP only): every TP rank holds the same bytes, so they
    share one name, which vLLM's worker lets rank 0 alone write (spec.replicated_layout)."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

    specs = {}
    # Built here without the connector, so the spec needs the user's cache tag to name bytes.
    tagged = dict(EMBEDDED, kvtide_cache_tag="mla-test")
    for replicated in (False, True):
        for rank in (0, 1):
            vc = vllm_config(models[0], tagged, tp=2, rank=rank)
            kvc, _ = kv_cache_config(vc, 16)
            config = dataclasses.replace(build_offloading_config(vc, kvc), replicated_layout=replicated)
            specs[replicated, rank] = kv_vllm.KvtideOffloadingSpec(config)
    assert specs[False, 0].namespace.prefix != specs[False, 1].namespace.prefix
    assert len(specs[False, 0].namespaces) == 2
    assert specs[True, 0].namespace.prefix == specs[True, 1].namespace.prefix
    assert len(specs[True, 0].namespaces) == 1 and specs[True, 0].replicated_layout
    assert specs[True, 0].namespace.prefix != specs[False, 0].namespace.prefix
    for spec in specs.values():
        spec.close()


def test_a_spec_built_outside_the_connector_needs_a_cache_tag(models):
    """Without the connector's VllmConfig the names would miss revision, quantization and head
    layout, so two such models could share names: the spec refuses unless the user names the
    bytes with a cache tag."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

    vc = vllm_config(models[0], EMBEDDED)
    kvc, _ = kv_cache_config(vc, 16)
    with pytest.raises(ValueError, match="kvtide_cache_tag"):
        kv_vllm.KvtideOffloadingSpec(build_offloading_config(vc, kvc))
