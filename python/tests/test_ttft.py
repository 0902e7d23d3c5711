"""The time-to-first-token benchmark's load path (python/bench/ttft.py) on a CPU with a tiny
Llama: the page layouts round-trip through an embedded store into the model's cache (the first
token's logits bitwise equal to recomputing), and a prefix partly evicted between lookup and load
still gives the right first token (the pages before the first missing one are used, the rest is
recomputed). Skipped without torch and transformers."""

import importlib.util
from pathlib import Path

import pytest

import kvtide

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ttft.py"


@pytest.fixture(scope="module")
def ttft():
    spec = importlib.util.spec_from_file_location("ttft_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model(ttft):
    torch.set_grad_enabled(False)
    return ttft.build_model("tiny", torch.device("cpu"))


@pytest.fixture
def store():
    s = kvtide.Store(dram_bytes="64MiB", shards=2, pin_threads=False)
    yield s
    s.close()


def prompt(ttft, model, layout_name, n=128, page=16, tag="t"):
    dev = torch.device("cpu")
    tokens = torch.randint(0, model.config.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(n))
    ref_logits, cache = ttft.recompute(model, tokens, n, dev)
    geo = ttft.Geometry(model.config, n, page)
    ref_kv = ttft.reference_kv(cache, geo, dev)
    layout = ttft.LAYOUTS[layout_name](geo, dev)
    pr = ttft.Prompt(model, tokens, geo, layout, f"{tag}/{layout_name}")
    layout.fill_from_model_kv(ref_kv)
    return pr, ref_kv, ref_logits


@pytest.mark.parametrize("layout_name", ["hnd", "paged"])
def test_reload_gives_the_recomputed_first_token_bitwise(ttft, model, store, layout_name):
    pr, ref_kv, ref_logits = prompt(ttft, model, layout_name)
    pr.store_into(store)
    assert store.prefix_hits(pr.lookup_keys) == pr.g.P
    pr.layout.clear()
    logits, info = pr.load_batch(store)
    assert info == {"hits": pr.g.P, "used": pr.g.P}
    assert torch.equal(pr.layout.model_kv, ref_kv)
    assert torch.equal(logits, ref_logits)
    # The floor path (a raw copy of the same bytes) gives the same.
    host = pr.layout.dst.clone()
    pr.layout.clear()
    logits, _ = pr.floor(host)
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("layout_name", ["hnd", "paged"])
def test_a_prefix_evicted_between_lookup_and_load_is_recomputed(ttft, model, store, layout_name):
    pr, ref_kv, ref_logits = prompt(ttft, model, layout_name)
    g = pr.g
    pr.store_into(store)
    # Before the lookup: layer 0's last quarter of pages (the lookup sees 3/4 of the prefix).
    store.batch_remove([pr.keys[0][p] for p in range(3 * g.P // 4, g.P)])
    # Between lookup and load: two pages of the last layer from the middle on.
    between = [pr.keys[g.L - 1][g.P // 2], pr.keys[g.L - 1][g.P // 2 + 1]]
    pr.layout.clear()
    logits, info = pr.load_batch(store, evict=lambda: store.batch_remove(between))
    assert info == {"hits": 3 * g.P // 4, "used": g.P // 2}
    T = info["used"] * g.page
    assert torch.equal(pr.layout.model_kv[..., :T, :], ref_kv[..., :T, :])
    diff = (logits.float() - ref_logits.float()).abs().max().item()
    assert diff <= 2 ** -4 * ref_logits.float().abs().max().item()
    assert int(logits.argmax()) == int(ref_logits.argmax())
    # Nothing at all cached: the whole prefix is recomputed.
    store.batch_remove(pr.keys[0][: 3 * g.P // 4])
    logits, info = pr.load_batch(store)
    assert info == {"hits": 0, "used": 0}
    assert int(logits.argmax()) == int(ref_logits.argmax())


def test_valid_pages_stops_at_the_first_failed_fragment(ttft, model):
    pr, _, _ = prompt(ttft, model, "hnd", n=64)
    want, nf = pr.layout.frag_len, pr.nf
    full = [[want] * (pr.g.P * nf) for _ in range(pr.g.L)]
    assert pr.valid_pages(full, pr.g.P) == pr.g.P
    broken = [list(r) for r in full]
    broken[1][2 * nf + 3] = kvtide.NotFound("gone")
    assert pr.valid_pages(broken, pr.g.P) == 2
    broken[0][nf] = want - 1  # a short fragment counts as missing
    assert pr.valid_pages(broken, pr.g.P) == 1
