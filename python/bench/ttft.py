#!/usr/bin/env python3
"""Time to first token (TTFT): a prompt's prefix KV reloaded through kvtide against recomputing it.

A transformers Llama of a real architecture (Llama-3-8B's sizes, and a 1B one that fits any card)
is built in code and randomly initialised in bf16 on the GPU (no weights are downloaded; timing
does not depend on the values). A prompt is an N-token prefix plus one last token. For each N:

- recompute: prefill of the N-token prefix (an empty DynamicCache), then the forward of the last
  token: the first token's logits. (`recompute-1pass`, one forward of all N+1 tokens, is also
  measured.)
- kvtide: the prefix's KV, produced once by that prefill and stored through kvtide in an engine's
  page layout, is looked up (`prefix_hits`), loaded back into the model's cache on the GPU, and
  only the last token is forwarded. Stores: `dram` (embedded `kvtide.Store`), `owner` (a
  same-host `kvtide-owner`, `kvtide.connect("unix:...")`), `ssd` (an embedded store with an SSD
  tier whose DRAM (1 GiB) is smaller than the 8B model's KV at 16k and 32k tokens; after the KV
  is stored, 4 MiB filler objects of twice its DRAM push every KV object out to SSD, and
  `promote_on_hit=false` keeps them there: every timed read comes from the disk, checked with the
  store's `loads` and `ssd_read_bytes` counters). Reads:
  - `batch`: one `get_into_ranges` of every layer into the GPU cache tensors, then the forward;
  - `layerwise`: per layer `get_into_ranges_on_stream` on a load stream and a torch.cuda.Event
    recorded after it; a forward pre-hook on each decoder layer makes the compute stream wait on
    that layer's event (the eager forward, per-layer events), so layer i computes while later
    layers load;
  - `graph`: the same reads, then ONE replay of a CUDA graph of the last token's forward captured
    once, whose layers wait on those events (external event waits): the seed-000 pattern;
  - `step` and `graph-step`: `layerwise` and `graph` with every layer's read and its event in
    ONE `step_ranges_on_stream` call (one lease round trip per step).
- floor: the same bytes in pinned host memory copied to the GPU with one raw copy
  (`tensor.copy_(pinned, non_blocking=True)`), then the forward (`floor`); and per layer on the
  load stream overlapped with the forward like `layerwise` (`floor-layerwise`).
- forward: the last token's forward alone with the KV already in place (what every mode adds).

Layouts (the object of one (layer, page) holds that page's K then V):
- `paged` (the first, measured everywhere): vLLM's layout, a per-layer paged GPU cache
  [2, blocks, page, kv_heads, head_dim] with a shuffled block table: 2 fragments per object (K
  block, V block). The model's cache (a DynamicCache's [1, kv_heads, N, head_dim] tensors) is then
  gathered from the pages on the GPU, as a paged-attention kernel would read them; every mode,
  the floor included, pays that gather.
- `hnd` (on the DRAM store only): each of K and V as [kv_heads, page, head_dim] (FlashInfer's HND
  page), read straight into the model's cache: 2 x kv_heads fragments per object. It shows what
  the per-fragment cost of a read does at 8-16 KiB fragments.
All reads use `get_into_ranges` with one tensor per layer (a raw (address, size) pair per page
costs a CUDA pointer query each; a tensor view per page about 0.8 us of Python each).

Correctness: the first token's logits after every reload are compared with recompute's, bitwise
(the decode kernels are the same and so must be the bytes), and the reloaded KV with the
prefill's. Bad input: the load path handles a prefix partly evicted between lookup and load: the
lookup counts the leading pages present, the per-fragment results of the read say which loaded,
the pages up to the first missing one are used and the rest of the prefix is recomputed with
them as past (run at the smallest length unless `--no-evict-test`: objects removed before the
lookup and between lookup and load).

usage (GPU machine, the kvtide wheel: CUDA built in; --owner-bin defaults to the wheel's owner):
  python3 python/bench/ttft.py --out OUT --owner-bin .device/bin/kvtide-owner \
      [--models llama3-1b,llama3-8b] [--tokens 4096,16384,32768] [--page 64]
Writes OUT/ttft.json, OUT/ttft.svg (and .png with matplotlib) and prints a table.
"""
import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kvtide

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from owner_process import OwnerProcess, default_owner_binary  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20

# Llama-3 shapes. head_dim is given explicitly so the KV geometry does not depend on defaults.
CONFIGS = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # For tests on a CPU.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, rope_theta=10000.0,
                 max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# The model


def build_model(name, device, seed=0):
    """A randomly initialised LlamaForCausalLM of `name`'s shape, in bf16, created on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIGS[name])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    return model


def make_cache(model, ks, vs):
    """A DynamicCache whose layers hold the given [1, kv_heads, T, head_dim] tensors as they are
    (no copy): the model's cache, as the decode step reads and extends it."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if ks[0].shape[-2] == 0:
        return cache
    for layer, k, v in zip(cache.layers, ks, vs):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


class Hooks:
    """Forward pre-hooks on the decoder layers: when armed, layer i makes the current (compute)
    stream wait on `events[i]` and then runs `gather(i)` (the paged layout's copy into the
    model's cache), before its attention reads the cache."""

    def __init__(self, model):
        self.events = None
        self.gather = None
        self.handles = [layer.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(model.model.layers)]

    def _hook(self, i):
        def hook(_module, _args):
            if self.events is not None:
                torch.cuda.current_stream().wait_event(self.events[i])
            if self.gather is not None:
                self.gather(i)
        return hook

    @contextlib.contextmanager
    def armed(self, events=None, gather=None):
        self.events, self.gather = events, gather
        try:
            yield
        finally:
            self.events = self.gather = None

    def remove(self):
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def masks_as_in_eager():
    """While a CUDA graph is captured, transformers builds an explicit attention mask instead of
    the `None` it passes in eager mode for one query token (`is_tracing` is true while a stream
    captures), which changes SDPA's kernel and the logits' bits. The graph here has fixed shapes
    and no padding, so the eager decision is valid: let the mask code see no tracing."""
    import transformers.masking_utils as mu

    saved = mu.is_tracing
    mu.is_tracing = lambda *a, **k: False
    try:
        yield
    finally:
        mu.is_tracing = saved


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# KV geometry, object names and page layouts


def page_hashes(tokens, n_pages, page, tag):
    """An engine's page names: a hash chain over the pages' tokens (vLLM/SGLang style), so a page
    names its whole prefix."""
    h = hashlib.blake2b(tag.encode(), digest_size=16).digest()
    out = []
    raw = tokens.to(torch.int64).cpu().numpy()
    for p in range(n_pages):
        h = hashlib.blake2b(h + raw[p * page:(p + 1) * page].tobytes(), digest_size=16).digest()
        out.append(h.hex())
    return out


class Geometry:
    def __init__(self, cfg, n_tokens, page):
        self.L = cfg.num_hidden_layers
        self.H = cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.N, self.page = n_tokens, page
        assert n_tokens % page == 0, "the prefix must be whole pages"
        self.P = n_tokens // page
        self.esz = 2  # bf16
        self.head_page = page * self.D * self.esz  # one head's rows of one page
        self.half = self.H * self.head_page  # K (or V) of one page
        self.obj = 2 * self.half  # one (layer, page) object
        self.layer_bytes = self.P * self.obj
        self.total = self.L * self.layer_bytes


class Layout:
    """Where each (layer, page) object's bytes go on the GPU and how the model's cache is made
    from them.

    `model_kv` is the model's cache for all layers: [L, 2, 1, H, N, D] (K = [l, 0], V = [l, 1],
    each a [1, H, N, D] DynamicCache tensor). `dst` is what kvtide reads into (per layer
    `dst[l]`): `model_kv` itself (hnd) or the paged cache (paged)."""

    name = ""

    def __init__(self, geo, device):
        self.g, self.device = geo, device
        g = geo
        self.model_kv = torch.zeros((g.L, 2, 1, g.H, g.N, g.D), dtype=torch.bfloat16, device=device)

    def layer_buffers(self):
        return [self.dst[l] for l in range(self.g.L)]

    def fragments(self, keys):
        """Per layer, the (key, src_offset, dst_offset, length) fragments of every page, page
        after page (`frags_per_page` each), offsets into `dst[l]`."""
        raise NotImplementedError

    def sources(self, buf, l, p):
        """(address, length) pairs of the object (l, p) in a tensor shaped like `dst`."""
        raise NotImplementedError

    def gather(self, l, G):
        """Make the model's cache of layer l from the first G pages (nothing for hnd)."""

    def model_views(self, G):
        T = G * self.g.page
        ks = [self.model_kv[l, 0][:, :, :T] for l in range(self.g.L)]
        vs = [self.model_kv[l, 1][:, :, :T] for l in range(self.g.L)]
        return ks, vs

    def fill_from_model_kv(self, ref):
        """Put the reference KV ([L, 2, 1, H, N, D]) in `dst`'s layout (to store it from there)."""
        raise NotImplementedError

    def clear(self):
        self.model_kv.zero_()
        if self.dst is not self.model_kv:
            self.dst.zero_()


class HndLayout(Layout):
    name = "hnd"
    frag_len_attr = "head_page"

    def __init__(self, geo, device):
        super().__init__(geo, device)
        self.dst = self.model_kv
        self.frags_per_page = 2 * geo.H
        self.frag_len = geo.head_page

    def fragments(self, keys):
        g = self.g
        row = g.D * g.esz
        out = []
        for l in range(g.L):
            frags = []
            for p in range(g.P):
                key = keys[l][p]
                for kind in (0, 1):
                    for h in range(g.H):
                        j = kind * g.H + h
                        frags.append((key, j * g.head_page, (j * g.N + p * g.page) * row, g.head_page))
            out.append(frags)
        return out

    def sources(self, buf, l, p):
        g = self.g
        base = buf[l].data_ptr()
        row = g.D * g.esz
        return [(base + ((kind * g.H + h) * g.N + p * g.page) * row, g.head_page) for kind in (0, 1) for h in range(g.H)]

    def fill_from_model_kv(self, ref):
        self.dst.copy_(ref)


class PagedLayout(Layout):
    name = "paged"

    def __init__(self, geo, device, seed=1):
        super().__init__(geo, device)
        g = geo
        gen = torch.Generator().manual_seed(seed)
        self.block_table = torch.randperm(g.P, generator=gen)  # page p lives in block block_table[p]
        self.bt = self.block_table.to(device)
        self.bt_list = self.block_table.tolist()
        self.dst = torch.zeros((g.L, 2, g.P, g.page, g.H, g.D), dtype=torch.bfloat16, device=device)
        self.frags_per_page = 2
        self.frag_len = g.half

    def fragments(self, keys):
        g = self.g
        out = []
        for l in range(g.L):
            frags = []
            for p in range(g.P):
                b = self.bt_list[p]
                frags.append((keys[l][p], 0, b * g.half, g.half))
                frags.append((keys[l][p], g.half, (g.P + b) * g.half, g.half))
            out.append(frags)
        return out

    def sources(self, buf, l, p):
        g = self.g
        base = buf[l].data_ptr()
        b = self.bt_list[p]
        return [(base + b * g.half, g.half), (base + (g.P + b) * g.half, g.half)]

    def gather(self, l, G):
        g = self.g
        T = G * g.page
        if G == 0:
            return
        bt = self.bt[:G]
        for kind in (0, 1):
            pages = self.dst[l, kind].index_select(0, bt)  # [G, page, H, D]
            self.model_kv[l, kind, 0, :, :T].copy_(pages.reshape(T, g.H, g.D).transpose(0, 1))

    def fill_from_model_kv(self, ref):
        g = self.g
        for l in range(g.L):
            for kind in (0, 1):
                self.dst[l, kind, self.bt] = ref[l, kind, 0].transpose(0, 1).reshape(g.P, g.page, g.H, g.D)


LAYOUTS = {"hnd": HndLayout, "paged": PagedLayout}


# ---------------------------------------------------------------------------------------------
# The load path: lookup, read, check the per-fragment results, use what loaded, recompute the rest


class StepTicket:
    """A step call's one ticket (results layer after layer) as per-layer tickets."""

    def __init__(self, ticket, counts):
        self.ticket, self.counts = ticket, counts

    def per_layer(self):
        return [_LayerOfStep(self, i) for i in range(len(self.counts))]


class _LayerOfStep:
    def __init__(self, step, i):
        self.step, self.i = step, i

    def wait(self, timeout_ms):
        results = self.step.ticket.wait(timeout_ms)
        if results is None:
            return None
        start = sum(self.step.counts[:self.i])
        return results[start:start + self.step.counts[self.i]]


class Prompt:
    """One prompt: its tokens (N prefix + 1 last), its KV geometry, its objects' names, a layout's
    fragments, and the model calls that produce the first token's logits."""

    def __init__(self, model, tokens, geo, layout, tag):
        self.model, self.g, self.layout = model, geo, layout
        self.device = layout.device
        self.ids = tokens.to(self.device)
        hashes = page_hashes(tokens[:geo.N], geo.P, geo.page, tag)
        self.keys = [[f"ttft/{tag}/L{l:02d}/{h}" for h in hashes] for l in range(geo.L)]
        self.all_keys = [k for layer in self.keys for k in layer]
        self.lookup_keys = self.keys[0]
        self.frags = layout.fragments(self.keys)
        self.nf = layout.frags_per_page
        self.last = self.ids[geo.N:geo.N + 1][None]
        self.pos = torch.tensor([[geo.N]], device=self.device)
        self.events = None
        if self.device.type == "cuda":
            self.load_stream = torch.cuda.Stream(self.device)
            self.events = [torch.cuda.Event(external=True) for _ in range(geo.L)]

    # -- model calls

    def forward_last(self, cache):
        out = self.model(input_ids=self.last, past_key_values=cache, position_ids=self.pos, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1]

    def forward_loaded(self, G, gather_all=True):
        """The first token's logits from the first G pages in place (`dst`): the rest of the
        prefix recomputed with them as past, then the last token."""
        g, lay = self.g, self.layout
        if gather_all:
            for l in range(g.L):
                lay.gather(l, G)
        ks, vs = lay.model_views(G)
        cache = make_cache(self.model, ks, vs)
        T = G * g.page
        if T < g.N:  # recompute the missing part of the prefix with the loaded pages as past
            pos = torch.arange(T, g.N, device=self.device)[None]
            self.model(input_ids=self.ids[T:g.N][None], past_key_values=cache, position_ids=pos, use_cache=True,
                       logits_to_keep=1)
        return self.forward_last(cache)

    # -- per-fragment results

    def valid_pages(self, results, G):
        """The leading pages whose every fragment, on every layer, loaded whole."""
        want = self.layout.frag_len
        good = G
        for res in results:
            if res.count(want) == len(res):
                continue
            for i, r in enumerate(res):
                if not (isinstance(r, int) and r == want):
                    good = min(good, i // self.nf)
                    break
        return good

    def frags_for(self, l, G):
        f = self.frags[l]
        return f if G == self.g.P else f[:G * self.nf]

    # -- the modes

    def load_batch(self, store, evict=None):
        """Blocking: lookup, one read of every layer into the GPU, then the forward."""
        G = min(store.prefix_hits(self.lookup_keys), self.g.P)
        if evict:
            evict()
        res = store.get_into_ranges(self.layout.layer_buffers(), [self.frags_for(l, G) for l in range(self.g.L)])
        good = self.valid_pages(res, G)
        return self.forward_loaded(good), {"hits": G, "used": good}

    def issue_layerwise(self, store, G):
        tickets = []
        for l in range(self.g.L):
            tickets.append(store.get_into_ranges_on_stream([self.layout.dst[l]], [self.frags_for(l, G)],
                                                           self.load_stream))
            self.events[l].record(self.load_stream)
        return tickets

    def issue_step(self, store, G):
        """Every layer's read and its event in ONE step call (one lease round trip)."""
        layers = [([self.layout.dst[l]], [self.frags_for(l, G)]) for l in range(self.g.L)]
        ticket = store.step_ranges_on_stream(layers, self.load_stream, events=self.events)
        return StepTicket(ticket, [len(self.frags_for(l, G)) for l in range(self.g.L)])

    def check_tickets(self, tickets, G):
        results = []
        for t in tickets:
            r = t.wait(60_000)
            if r is None:
                raise RuntimeError("a stream-bound read did not end in 60 s")
            results.append(r)
        return self.valid_pages(results, G)

    def load_layerwise(self, store, hooks, evict=None, step=False):
        """Per-layer stream-bound reads (or one step call), the eager forward waiting per layer
        on their events."""
        G = min(store.prefix_hits(self.lookup_keys), self.g.P)
        if evict:
            evict()
        tickets = self.issue_step(store, G).per_layer() if step else self.issue_layerwise(store, G)
        ks, vs = self.layout.model_views(G)
        with hooks.armed(self.events, (lambda l: self.layout.gather(l, G)) if self.layout.name == "paged" else None):
            if G == self.g.P:
                logits = self.forward_last(make_cache(self.model, ks, vs))
            else:
                logits = None
        good = self.check_tickets(tickets, G)
        if good < self.g.P or logits is None:
            # Some pages did not load (or the lookup found fewer): the pages before the first
            # missing one are in place; recompute the rest.
            logits = self.forward_loaded(good)
        return logits, {"hits": G, "used": good}

    def capture_graph(self, hooks):
        """One CUDA graph of the last token's forward over the whole prefix, each layer waiting on
        its (external) event and, paged, gathering its pages first."""
        g = self.g
        stream = torch.cuda.Stream(self.device)
        for e in self.events:
            e.record(self.load_stream)
        stream.wait_stream(torch.cuda.current_stream())
        gather = (lambda l: self.layout.gather(l, g.P)) if self.layout.name == "paged" else None
        graph = torch.cuda.CUDAGraph()
        with hooks.armed(self.events, gather), masks_as_in_eager(), torch.cuda.stream(stream):
            ks, vs = self.layout.model_views(g.P)
            self.forward_last(make_cache(self.model, ks, vs))  # warm-up on the capture stream
            stream.synchronize()
            ks, vs = self.layout.model_views(g.P)
            cache = make_cache(self.model, ks, vs)  # made before the capture: it creates tensors
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                logits = self.forward_last(cache)
                tok = logits.argmax()
        stream.synchronize()
        self.graph = (graph, stream, logits, tok)

    def load_graph(self, store, step=False):
        graph, stream, logits, tok = self.graph
        G = min(store.prefix_hits(self.lookup_keys), self.g.P)
        if G < self.g.P:
            return self.load_batch(store)
        tickets = self.issue_step(store, G).per_layer() if step else self.issue_layerwise(store, G)
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        int(tok)
        good = self.check_tickets(tickets, G)
        if good < self.g.P:
            return self.forward_loaded(good), {"hits": G, "used": good}
        return logits.clone(), {"hits": G, "used": good}

    def floor(self, host):
        """One raw pinned copy of every layer's bytes, then the forward."""
        self.layout.dst.copy_(host, non_blocking=True)
        return self.forward_loaded(self.g.P), {}

    def floor_layerwise(self, host, hooks):
        g = self.g
        with torch.cuda.stream(self.load_stream):
            for l in range(g.L):
                self.layout.dst[l].copy_(host[l], non_blocking=True)
                self.events[l].record(self.load_stream)
        ks, vs = self.layout.model_views(g.P)
        with hooks.armed(self.events, (lambda l: self.layout.gather(l, g.P)) if self.layout.name == "paged" else None):
            logits = self.forward_last(make_cache(self.model, ks, vs))
        return logits, {}

    # -- storing

    def store_into(self, store, chunk_bytes=64 * MiB):
        """Write every (layer, page) object from `dst` (the GPU), gathered from its fragments, in
        batches of at most `chunk_bytes` (a store with a small DRAM and an SSD tier makes room by
        writing back; a batch that finds none yet (`NoSpace`) is retried)."""
        g = self.g
        items = [(self.keys[l][p], self.layout.sources(self.layout.dst, l, p)) for l in range(g.L) for p in range(g.P)]
        chunk_keys = max(1, chunk_bytes // g.obj)
        for i in range(0, len(items), chunk_keys):
            part = items[i:i + chunk_keys]
            for attempt in range(200):
                res = store.batch_put_from_multi_buffers([k for k, _ in part], [s for _, s in part], upsert=True)
                bad = [(it, r) for it, r in zip(part, res) if not kvtide.ok(r)]
                if not bad:
                    break
                if not all(isinstance(r, kvtide.NoSpace) for _, r in bad) or attempt == 199:
                    raise RuntimeError(f"{len(bad)} puts failed, first: {bad[0][1]!r}")
                part = [it for it, _ in bad]
                time.sleep(0.02)

    def remove_from(self, store):
        store.batch_remove(self.all_keys, force=True)


def recompute(model, ids, N, device):
    """Prefill of the N-token prefix, then the last token: (logits, the prefill's cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=ids[None, :N], past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = model(input_ids=ids[None, N:N + 1], past_key_values=cache, position_ids=torch.tensor([[N]], device=device),
                use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cache


def recompute_1pass(model, ids, N):
    out = model(input_ids=ids[None, :N + 1], use_cache=False, logits_to_keep=1)
    return out.logits[0, -1]


def reference_kv(cache, geo, device):
    """The prefix's KV from a cache of N+1 tokens, as [L, 2, 1, H, N, D]."""
    ref = torch.empty((geo.L, 2, 1, geo.H, geo.N, geo.D), dtype=torch.bfloat16, device=device)
    for l, layer in enumerate(cache.layers):
        ref[l, 0].copy_(layer.keys[:, :, :geo.N])
        ref[l, 1].copy_(layer.values[:, :, :geo.N])
    return ref


def compare(logits, ref):
    import math

    a, b = logits.float(), ref.float()
    top = float(b.abs().max())
    return {
        "bitwise": bool(torch.equal(logits, ref)),
        "max_abs_diff": float((a - b).abs().max()),
        "ref_max_abs": top,
        # one bf16 unit in the last place at the largest logit (8 significant bits)
        "ulp_at_max": 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 0.0,
        "argmax_equal": bool(int(a.argmax()) == int(b.argmax())),
    }


# ---------------------------------------------------------------------------------------------
# Stores


class Owner:
    """A kvtide-owner on a temporary data directory (DRAM only), reached over its Unix socket."""

    def __init__(self, binary, dram_bytes, shards):
        self.dir = tempfile.mkdtemp(prefix="kvtide-ttft-owner-")
        self.address = f"unix:{os.path.join(self.dir, 'owner.sock')}"
        self.process = OwnerProcess(binary, self.dir, ["--dram-bytes", str(dram_bytes), "--no-ssd", "--shards",
                                                       str(shards), "--tcp", "off", "--max-leases-per-connection",
                                                       "65536"], env=dict(os.environ, KVTIDE_LOG="warn"))
        self.process.connect(self.address).close()

    def connect(self, **kw):
        return kvtide.connect(self.address, **kw)

    def stop(self):
        self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def ssd_stats(store):
    t = store.stats()["total"]
    return {k: t.get(k, 0) for k in ("ssd_read_bytes", "ssd_write_bytes", "loads", "dram_objects", "ssd_objects",
                                      "promotions", "demotions")}


def push_out_to_ssd(store, dram_bytes):
    """Filler objects (4 MiB) of twice the store's DRAM: every earlier object leaves DRAM for the
    SSD (measured on the CPU: all 2048 objects of a 512 MiB set loaded from SSD afterwards with
    256 MiB of DRAM; larger filler objects left a few percent in DRAM)."""
    import numpy as np

    chunk = min(4 * MiB, store.max_value_bytes() // 2)
    filler = np.zeros(chunk, np.uint8)
    n = 2 * dram_bytes // chunk + 1
    for i in range(0, n, 64):
        names = [f"ttft/filler/{j}" for j in range(i, min(n, i + 64))]
        store.batch_put_from(names, [filler] * len(names), upsert=True)


def disk_read_gbps(ssd_dir, want_bytes, timeout=120):
    """`dd iflag=direct bs=8M` over the tier's segment files (the largest first): the disk's own
    sequential O_DIRECT read rate, as a baseline for the SSD mode."""
    files = []
    for root, _, names in os.walk(ssd_dir):
        for n in names:
            if n.endswith(".kvt"):
                p = os.path.join(root, n)
                files.append((os.path.getsize(p), p))
    files.sort(reverse=True)
    total, t0 = 0, time.perf_counter()
    for size, p in files:
        if total >= want_bytes:
            break
        r = subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=8M", "iflag=direct"], capture_output=True,
                           timeout=timeout)
        if r.returncode != 0:
            return None
        total += size
    dt = time.perf_counter() - t0
    return {"bytes": total, "seconds": dt, "gbps": total / dt / 1e9 if dt > 0 else None}


# ---------------------------------------------------------------------------------------------
# Timing


def time_mode(fn, prep, reps, warmup, device, check=None):
    """Median wall time of `fn` (host clock from the call to the first token known on the host),
    after `prep` (not timed) before each run; `check(logits)` (not timed) after each run."""
    out = None
    times, checks = [], []
    for i in range(warmup + reps):
        prep()
        sync(device)
        t0 = time.perf_counter()
        logits, info = fn()
        tok = int(logits.argmax())
        sync(device)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        if check is not None:
            checks.append(check(logits))
        out = (logits, info, tok)
    return statistics.median(times), times, out, checks


def run_model(args, name, device, results):
    model = build_model(name, device)
    cfg = model.config
    hooks = Hooks(model)
    full = sorted(args.tokens)
    lengths = sorted(set(full) | set(args.recompute_only))
    largest = Geometry(cfg, max(full), args.page)
    log(f"== {name}: {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads x {largest.D}, "
        f"KV {largest.total / largest.N / 1024:.0f} KiB/token, {largest.total / GiB:.2f} GiB at {largest.N} tokens, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
    mres = results["models"].setdefault(name, {"kv_bytes_per_token": largest.total // largest.N, "lengths": {}})

    stores = {}
    cuda = device.type == "cuda"
    dram_bytes = max(GiB, int(largest.total * 1.4) + 256 * MiB)
    if "dram" in args.stores:
        stores["dram"] = kvtide.Store(dram_bytes=dram_bytes, shards=args.shards, gpu_staging=cuda)
    owner = None
    if "owner" in args.stores:
        owner = Owner(args.owner_bin, dram_bytes, args.shards)
        stores["owner"] = owner.connect(gpu_staging=cuda) if cuda else owner.connect()
    ssd_dir = None
    if "ssd" in args.stores:
        ssd_dir = tempfile.mkdtemp(prefix="kvtide-ttft-ssd-", dir=args.ssd_dir)
        ssd_dram = args.ssd_dram_bytes
        stores["ssd"] = kvtide.Store(dram_bytes=ssd_dram, ssd_dir=ssd_dir, ssd_bytes=max(4 * GiB, 4 * largest.total),
                                     promote_on_hit=False, shards=args.shards, gpu_staging=cuda)
    if cuda:
        for s in stores.values():
            s.prepare_gpu(device.index or 0)

    try:
        for N in lengths:
            gen = torch.Generator().manual_seed(1000 + N)
            tokens = torch.randint(0, cfg.vocab_size, (N + 1,), generator=gen)
            ids = tokens.to(device)
            lres = mres["lengths"].setdefault(str(N), {"modes": {}, "checks": {}})
            reps = args.reps_recompute
            t_rec, ts, (ref_logits, _, ref_tok), _ = time_mode(lambda: (recompute(model, ids, N, device)[0], {}),
                                                               lambda: None, reps, 1, device)
            lres["modes"]["recompute"] = {"ms": t_rec * 1e3, "runs_ms": [t * 1e3 for t in ts]}
            t_1p, ts1, (l1p, _, _), _ = time_mode(lambda: (recompute_1pass(model, ids, N), {}), lambda: None,
                                               max(1, reps - 1), 1, device)
            lres["modes"]["recompute-1pass"] = {"ms": t_1p * 1e3, "runs_ms": [t * 1e3 for t in ts1]}
            lres["checks"]["recompute-1pass"] = compare(l1p, ref_logits)
            log(f"[{name} N={N}] recompute {t_rec * 1e3:.1f} ms (1-pass {t_1p * 1e3:.1f} ms)")
            if N not in full:
                continue
            # The prefill's KV, the reference for every reload.
            ref_logits, cache = recompute(model, ids, N, device)
            geo = Geometry(cfg, N, args.page)
            ref_kv = reference_kv(cache, geo, device)
            del cache
            lres["kv_bytes"] = geo.total
            for lname in args.layouts:
                run_layout(args, name, device, model, hooks, tokens, geo, lname, ref_kv, ref_logits, stores, lres,
                           ssd_dir, N == min(full))
            del ref_kv
            if cuda:
                torch.cuda.empty_cache()
            with open(os.path.join(args.out, "ttft.json"), "w") as f:  # kept if the run is cut short
                json.dump(results, f, indent=1)
        if ssd_dir and cuda:
            results.setdefault("disk", {})[name] = disk_read_gbps(ssd_dir, largest.total)
        for sname, s in stores.items():
            try:
                mres.setdefault("store_stats", {})[sname] = {"gpu": s.stats().get("gpu"), "total": ssd_stats(s)}
            except Exception as e:  # noqa: BLE001
                mres.setdefault("store_stats", {})[sname] = repr(e)
    finally:
        for s in stores.values():
            s.close()
        if owner:
            owner.stop()
        if ssd_dir:
            shutil.rmtree(ssd_dir, ignore_errors=True)
        hooks.remove()
        del model
        if cuda:
            torch.cuda.empty_cache()


def run_layout(args, name, device, model, hooks, tokens, geo, lname, ref_kv, ref_logits, stores, lres, ssd_dir,
               smallest):
    cuda = device.type == "cuda"
    layout = LAYOUTS[lname](geo, device)
    tag = f"{name}/{lname}/p{geo.page}/bf16"
    pr = Prompt(model, tokens, geo, layout, tag)
    suffix = "" if lname == args.layouts[0] else f"@{lname}"
    layout.fill_from_model_kv(ref_kv)
    host = layout.dst.cpu().pin_memory() if cuda else layout.dst.cpu().clone()
    t0 = time.perf_counter()
    # The first layout is measured on every store, the others on the embedded DRAM store.
    layout_stores = {k: v for k, v in stores.items() if lname == args.layouts[0] or k == "dram"}
    put_ms = {}
    for sname, s in layout_stores.items():
        t = time.perf_counter()
        pr.store_into(s)
        sync(device)
        put_ms[sname] = (time.perf_counter() - t) * 1e3
        if sname == "ssd":
            push_out_to_ssd(s, args.ssd_dram_bytes)
    lres.setdefault("put_ms", {})[lname] = put_ms
    log(f"[{name} N={geo.N} {lname}] stored {geo.L * geo.P} objects of {geo.obj // 1024} KiB "
        f"({geo.total / GiB:.2f} GiB) in {(time.perf_counter() - t0):.1f} s: {put_ms}")

    def prep():
        layout.clear()

    def record(mode, fn, reps, warmup=1, store=None):
        before = ssd_stats(store) if store is not None else None

        def check(logits):
            return (bool(torch.equal(logits, ref_logits)), bool(torch.equal(layout.model_kv, ref_kv)),
                    float((logits.float() - ref_logits.float()).abs().max()))
        try:
            t, ts, (logits, info, tok), checks = time_mode(fn, prep, reps, warmup, device, check)
        except Exception as e:  # noqa: BLE001
            lres["modes"][mode + suffix] = {"error": repr(e)}
            log(f"  {mode + suffix}: FAILED {e!r}")
            return None
        entry = {"ms": t * 1e3, "runs_ms": [x * 1e3 for x in ts], **info}
        if store is not None:
            after = ssd_stats(store)
            entry["ssd_read_bytes_per_run"] = (after["ssd_read_bytes"] - before["ssd_read_bytes"]) / (reps + warmup)
            entry["ssd_loads_per_run"] = (after["loads"] - before["loads"]) / (reps + warmup)
            entry["objects"] = geo.L * geo.P
        chk = compare(logits, ref_logits)
        chk["kv_equal"] = bool(torch.equal(layout.model_kv, ref_kv))
        chk["runs"] = len(checks)
        chk["runs_logits_bitwise"] = sum(c[0] for c in checks)
        chk["runs_kv_equal"] = sum(c[1] for c in checks)
        chk["max_abs_diff_all_runs"] = max(c[2] for c in checks)
        lres["modes"][mode + suffix] = entry
        lres["checks"][mode + suffix] = chk
        log(f"  {mode + suffix:22s} {t * 1e3:9.2f} ms  runs with logits bitwise {chk['runs_logits_bitwise']}/"
            f"{chk['runs']}, KV bitwise {chk['runs_kv_equal']}/{chk['runs']}, max|d| {chk['max_abs_diff_all_runs']:.3g}"
            + (f" from SSD per run: {entry['ssd_read_bytes_per_run'] / GiB:.2f} GiB, "
               f"{entry['ssd_loads_per_run']:.0f}/{entry['objects']} objects" if store is not None else ""))
        return t

    reps_for = lambda sname: args.reps_ssd if sname == "ssd" else args.reps  # noqa: E731

    # The forward alone, the KV already in place.
    layout.model_kv.copy_(ref_kv)
    def forward_only():
        return pr.forward_loaded(geo.P, gather_all=False), {}
    t, ts, (lg, _, _), fchecks = time_mode(forward_only, lambda: None, args.reps, 1, device,
                                           lambda lg: (bool(torch.equal(lg, ref_logits)),
                                                       float((lg.float() - ref_logits.float()).abs().max())))
    lres["modes"]["forward" + suffix] = {"ms": t * 1e3, "runs_ms": [x * 1e3 for x in ts]}
    chk = compare(lg, ref_logits)
    chk.update(runs=len(fchecks), runs_logits_bitwise=sum(c[0] for c in fchecks),
               max_abs_diff_all_runs=max(c[1] for c in fchecks))
    lres["checks"]["forward" + suffix] = chk
    log(f"  {'forward' + suffix:22s} {t * 1e3:9.2f} ms  runs with logits bitwise {chk['runs_logits_bitwise']}/"
        f"{chk['runs']}, max|d| {chk['max_abs_diff_all_runs']:.3g} (no kvtide: the KV copied on the device)")

    record("floor", lambda: pr.floor(host), args.reps)
    if cuda:
        record("floor-layerwise", lambda: pr.floor_layerwise(host, hooks), args.reps)
    for sname, s in layout_stores.items():
        st = s if sname == "ssd" else None
        record(f"{sname}-batch", lambda: pr.load_batch(s), reps_for(sname), store=st)
        if cuda and (sname != "ssd" or geo.total <= args.ssd_layerwise_max_bytes):
            record(f"{sname}-layerwise", lambda: pr.load_layerwise(s, hooks), reps_for(sname), store=st)
            record(f"{sname}-step", lambda: pr.load_layerwise(s, hooks, step=True), reps_for(sname), store=st)
    if cuda and not args.no_graph and lname == args.layouts[0]:
        try:
            layout.clear()
            pr.capture_graph(hooks)
            lres["graph"] = "one CUDA graph captured"
        except Exception as e:  # noqa: BLE001
            pr.graph = None
            lres["graph"] = f"capture failed: {e!r}"
            log(f"  graph capture failed: {e!r}")
        if pr.graph is not None:
            for sname, s in layout_stores.items():
                if sname != "ssd":  # from SSD the reads, not the launches, are the time
                    record(f"{sname}-graph", lambda: pr.load_graph(s), reps_for(sname))
                    record(f"{sname}-graph-step", lambda: pr.load_graph(s, step=True), reps_for(sname))
            pr.graph = None

    if smallest and args.evict_test:
        evict_test(pr, layout_stores, hooks, ref_kv, ref_logits, lres, suffix, cuda)

    for s in layout_stores.values():
        pr.remove_from(s)
    del host
    if cuda:
        torch.cuda.empty_cache()


def evict_test(pr, stores, hooks, ref_kv, ref_logits, lres, suffix, cuda):
    """Objects removed before the lookup (layer 0, from 3/4 of the pages on: the lookup finds
    fewer) and between the lookup and the load (layer L/2, pages P/2..P/2+2, and the last
    layer's page P/2+1): the load must use pages [0, P/2) and recompute the rest."""
    g = pr.g
    P, L = g.P, g.L
    before = [pr.keys[0][p] for p in range(3 * P // 4, P)]
    between = [pr.keys[L // 2][p] for p in range(P // 2, min(P, P // 2 + 3))] + [pr.keys[L - 1][min(P - 1, P // 2 + 1)]]
    expect = P // 2
    ways = [("batch", lambda s, ev: pr.load_batch(s, evict=ev))]
    if cuda:
        ways.append(("layerwise", lambda s, ev: pr.load_layerwise(s, hooks, evict=ev)))
    out = lres.setdefault("evict_test", {})
    for sname, s in stores.items():
        for wname, way in ways:
            pr.layout.fill_from_model_kv(ref_kv)
            sync(pr.device)
            pr.store_into(s)  # everything present again
            s.batch_remove(before, force=True)
            pr.layout.clear()
            sync(pr.device)
            logits, info = way(s, lambda: s.batch_remove(between, force=True))
            sync(pr.device)
            chk = compare(logits, ref_logits)
            T = info["used"] * g.page
            chk["prefix_kv_equal"] = bool(torch.equal(pr.layout.model_kv[..., :T, :] if T else ref_kv[..., :0, :],
                                                      ref_kv[..., :T, :]))
            chk.update(info)
            chk["expected_used"] = expect
            tol = 2 ** -4 * chk["ref_max_abs"]
            chk["tolerance"] = tol
            chk["ok"] = (info["used"] == expect and chk["prefix_kv_equal"] and chk["max_abs_diff"] <= tol)
            out[f"{sname}-{wname}{suffix}"] = chk
            log(f"  evict {sname}-{wname}{suffix}: lookup {info['hits']}/{P} pages, used {info['used']} "
                f"(expected {expect}), prefix KV equal={chk['prefix_kv_equal']}, logits max|d|="
                f"{chk['max_abs_diff']:.3g} (tol {tol:.3g}, |ref|max {chk['ref_max_abs']:.3g}), "
                f"argmax equal={chk['argmax_equal']} -> {'OK' if chk['ok'] else 'FAIL'}")
    # the objects are removed by the caller


# ---------------------------------------------------------------------------------------------
# Report: table and plot

PLOT_MODES = ["recompute", "floor", "floor-layerwise", "dram-batch", "dram-layerwise", "dram-graph", "owner-batch",
              "owner-layerwise", "owner-graph", "ssd-batch", "ssd-layerwise", "dram-batch@hnd", "dram-layerwise@hnd",
              "dram-graph@hnd", "ssd-batch@hnd"]


def crossover(results):
    """Per model and length: the disk read rate at which an SSD reload takes as long as
    recomputing (KV bytes / (recompute - forward)), and where the measured rates put it."""
    out = {}
    for name, m in results["models"].items():
        per_tok = m["kv_bytes_per_token"]
        rows = []
        # the last token's forward (the same computation in every layout: the fastest run of it)
        fwd = {int(n): min(e["ms"] for k, e in v["modes"].items() if k.split("@")[0] == "forward" and "ms" in e)
               for n, v in m["lengths"].items() if any(k.split("@")[0] == "forward" for k in v["modes"])}
        for n, v in sorted(m["lengths"].items(), key=lambda x: int(x[0])):
            n = int(n)
            rec = v["modes"]["recompute"]["ms"]
            # the forward measured at the nearest length that has one
            f = fwd[min(fwd, key=lambda x: abs(x - n))] if fwd else 0.0
            need = n * per_tok / max(rec - f, 1e-3) / 1e6  # GB/s
            rows.append({"tokens": n, "recompute_ms": rec, "forward_ms": f, "breakeven_gbps": need})
        out[name] = {"rows": rows}
    return out


def write_plot(results, path_base):
    models = list(results["models"])
    series = {}
    for name in models:
        lens = results["models"][name]["lengths"]
        for mode in PLOT_MODES:
            pts = sorted((int(n), v["modes"][mode]["ms"]) for n, v in lens.items()
                         if mode in v["modes"] and "ms" in v["modes"][mode])
            if pts:
                series[(name, mode)] = pts
    title = f"Time to first token, {results['env'].get('gpu', '?')}"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        plt = None
    if plt is not None:
        fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
        for ax, name in zip(axes[0], models):
            for mode in PLOT_MODES:
                pts = series.get((name, mode))
                if not pts:
                    continue
                style = "--" if "layerwise" in mode else ":" if "graph" in mode else "-"
                palette = ["black", "0.45", "0.65", "tab:blue", "tab:blue", "tab:blue", "tab:green", "tab:green",
                           "tab:green", "tab:red", "tab:red", "tab:purple", "tab:purple", "tab:purple", "tab:orange"]
                color = palette[PLOT_MODES.index(mode) % len(palette)]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o", ms=3,
                        lw=2 if mode == "recompute" else 1.2, label=mode)
            disk = (results.get("disk") or {}).get(name)
            if disk and disk.get("gbps"):
                per_tok = results["models"][name]["kv_bytes_per_token"]
                co = results["crossover"][name]
                xs = [r["tokens"] for r in co["rows"]]
                ax.plot(xs, [r["tokens"] * per_tok / disk["gbps"] / 1e6 + r["forward_ms"] for r in co["rows"]],
                        color="brown", lw=0.8, ls="-.",
                        label=f"disk model ({disk['gbps']:.2f} GB/s dd)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens (cached prefix)")
            ax.set_ylabel("TTFT (ms)")
            ax.set_title(f"{name}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path_base + ".svg")
        fig.savefig(path_base + ".png", dpi=110)
        plt.close(fig)
        return
    # No matplotlib: a plain SVG, log-log, one polyline per mode and model.
    import math
    W, Hh, pad = 900, 520, 60
    pts_all = [p for s in series.values() for p in s]
    if not pts_all:
        return
    x0, x1 = math.log2(min(p[0] for p in pts_all)), math.log2(max(p[0] for p in pts_all))
    y0, y1 = math.log10(min(p[1] for p in pts_all)), math.log10(max(p[1] for p in pts_all))
    X = lambda x: pad + (math.log2(x) - x0) / max(x1 - x0, 1e-9) * (W - 2 * pad)  # noqa: E731
    Y = lambda y: Hh - pad - (math.log10(y) - y0) / max(y1 - y0, 1e-9) * (Hh - 2 * pad)  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
              "#17becf", "#000000", "#aaaaaa"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{Hh}" font-family="sans-serif" font-size="11">',
             f'<text x="{W / 2}" y="20" text-anchor="middle">{title} (log-log)</text>']
    for i, ((name, mode), pts) in enumerate(sorted(series.items())):
        c = colors[PLOT_MODES.index(mode) % len(colors)]
        dash = ' stroke-dasharray="4,3"' if name != models[-1] else ""
        parts.append(f'<polyline fill="none" stroke="{c}"{dash} points="' + " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts) + '"/>')
        parts.append(f'<text x="{W - pad + 5}" y="{40 + 12 * i}" fill="{c}">{name} {mode}</text>')
    parts.append("</svg>")
    with open(path_base + ".svg", "w") as f:
        f.write("\n".join(parts))


def print_table(results):
    for name, m in results["models"].items():
        log(f"\n{name}: TTFT in ms (median); speed-up = recompute / best kvtide DRAM mode")
        cols = ["recompute", "recompute-1pass", "forward", "floor", "floor-layerwise", "dram-batch", "dram-layerwise",
                "dram-graph", "owner-batch", "owner-layerwise", "owner-graph", "ssd-batch", "ssd-layerwise",
                "floor@hnd", "dram-batch@hnd", "dram-layerwise@hnd"]
        log("tokens | " + " | ".join(cols))
        for n, v in sorted(m["lengths"].items(), key=lambda x: int(x[0])):
            cells = []
            for c in cols:
                e = v["modes"].get(c)
                cells.append(f"{e['ms']:.1f}" if e and "ms" in e else ("err" if e else "-"))
            log(f"{n} | " + " | ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ttft-out")
    ap.add_argument("--models", default="llama3-1b,llama3-8b")
    ap.add_argument("--tokens", default="4096,16384,32768", help="prefix lengths measured in every mode")
    ap.add_argument("--recompute-only", default="1024,2048,8192",
                    help="more prefix lengths measured by recompute only (for the SSD crossover)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--layouts", default="paged,hnd",
                    help="the first is measured on every store and in every mode, the others on the DRAM store")
    ap.add_argument("--stores", default="dram,owner,ssd")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--reps-ssd", type=int, default=3)
    ap.add_argument("--reps-recompute", type=int, default=3)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--ssd-dir", default=None, help="where the SSD tier's directory is made (a disk, not tmpfs)")
    ap.add_argument("--ssd-dram-bytes", type=int, default=GiB)
    ap.add_argument("--ssd-layerwise-max-bytes", type=int, default=GiB,
                    help="the layerwise read from SSD only up to this much KV (it is slow: see the docs)")
    ap.add_argument("--owner-bin", default=(default_owner_binary() or (".device/bin/kvtide-owner",))[0])
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-evict-test", dest="evict_test", action="store_false")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    args.tokens = [int(x) for x in args.tokens.split(",") if x]
    args.recompute_only = [int(x) for x in args.recompute_only.split(",") if x]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.stores = [x for x in args.stores.split(",") if x]
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    torch.set_grad_enabled(False)
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "kvtide": kvtide.__version__, "kvtide_cuda": kvtide.cuda_built(), "device": str(device),
           "command": " ".join(sys.argv)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    results = {"env": env, "args": {k: v for k, v in vars(args).items()}, "models": {}}
    log(json.dumps(env))
    for name in args.models.split(","):
        run_model(args, name, device, results)
        # Written after each model, so a run cut short keeps what it measured.
        results["crossover"] = crossover(results)
        with open(os.path.join(args.out, "ttft.json"), "w") as f:
            json.dump(results, f, indent=1)
        print_table(results)
        log(json.dumps(results["crossover"]))
        write_plot(results, os.path.join(args.out, "ttft"))


if __name__ == "__main__":
    main()
