"""torch and CUDA (run on the H200 with `-m gpu`; skipped where torch or a GPU is missing):
CUDA tensors as destinations and sources, embedded and through an owner; staged reads into a
paged KV tensor; the seed 000 pattern in PyTorch terms (one captured CUDA graph waiting on
per-layer external events, kvtide stream-bound reads and event records outside it, replayed for
several steps); the Mooncake class's tensor helpers."""

import numpy as np
import pytest

import kvtide
from conftest import ucx_store

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not kvtide.cuda_built(), reason="needs the package built with the cuda feature"),
]


def pattern(n, seed):
    return torch.arange(n, dtype=torch.int64).mul_(2654435761).add_(seed).remainder_(251).to(torch.uint8)


def connected(owner, kind):
    """The owner over its Unix socket (the arena mapped) or over TCP with the UCX plane (the
    bytes land in a pinned bounce, then go to the GPU)."""
    if kind == "ucx":
        return ucx_store(owner)
    return owner.connect("unix")


@pytest.fixture(params=["embedded", "unix", "ucx"])
def gstore(request, owner):
    if request.param == "embedded":
        s = kvtide.Store(dram_bytes="1GiB", shards=4)
    else:
        s = connected(owner, request.param)
    yield s
    s.close()


def test_cuda_tensors_as_sources_and_destinations(gstore, k):
    src = pattern(1 << 20, 1).cuda()
    gstore.put(k("gpu-src"), src)
    assert gstore.get(k("gpu-src")) == src.cpu().numpy().tobytes()
    cpu = pattern(300_000, 2)
    gstore.put(k("cpu-src"), cpu)
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    assert gstore.get_into(k("gpu-src"), dst) == 1 << 20
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    pages = torch.zeros((8, 128 << 10), dtype=torch.uint8, device="cuda")
    other = torch.zeros(300_000, dtype=torch.uint8, device="cuda")
    spare = torch.zeros(16, dtype=torch.uint8, device="cuda")
    got = gstore.batch_get_into_multi_buffers([k("gpu-src"), k("cpu-src"), k("absent")],
                                              [[pages[i] for i in range(8)], [other], [spare]])
    assert got[0] == 1 << 20 and got[1] == 300_000 and isinstance(got[2], kvtide.NotFound)
    torch.cuda.synchronize()
    assert torch.equal(other.cpu(), cpu)
    assert torch.equal(pages.flatten(), src)
    t_cpu = torch.zeros(300_000, dtype=torch.uint8)
    assert gstore.get_into(k("cpu-src"), t_cpu) == 300_000 and torch.equal(t_cpu, cpu)
    with pytest.raises(kvtide.InvalidArgument, match="contiguous"):
        gstore.get_into(k("cpu-src"), torch.zeros((1000, 1000), dtype=torch.uint8, device="cuda").t())
    raw = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    assert gstore.get_into(k("gpu-src"), (raw.data_ptr(), raw.numel())) == 1 << 20, "a device address by pointer"
    torch.cuda.synchronize()
    assert torch.equal(raw, src)
    gstore.batch_remove([k("gpu-src"), k("cpu-src")])


def test_staged_reads_into_a_paged_kv_tensor(k):
    store = kvtide.Store(dram_bytes="1GiB", shards=4, gpu_staging=True)
    pages, page = 512, 4 << 10
    kv = torch.zeros((pages, page), dtype=torch.uint8, device="cuda")
    names = [k(f"blk{i}") for i in range(64)]
    values = [pattern(page * 4, i) for i in range(64)]
    store.batch_put_from(names, values)
    # Each 16 KiB block lands in 4 scattered pages.
    perm = torch.randperm(pages)[: 64 * 4].tolist()
    frags = [[(names[i], j * page, perm[i * 4 + j] * page, page) for i in range(64) for j in range(4)]]
    res = store.get_into_ranges([kv], frags)
    assert all(r == page for r in res[0])
    torch.cuda.synchronize()
    for i in range(64):
        for j in range(4):
            assert torch.equal(kv[perm[i * 4 + j]].cpu(), values[i][j * page:(j + 1) * page])
    assert store.stats()["gpu"]["staged_requests"] > 0
    store.close()


@pytest.mark.parametrize("kind", ["embedded", "unix", "ucx"])
def test_stream_bound_reads_feed_one_captured_graph(owner, k, kind):
    store = kvtide.Store(dram_bytes="1GiB", shards=4) if kind == "embedded" else connected(owner, kind)
    layers, page = 4, 256 << 10
    kv = torch.zeros((layers, page), dtype=torch.uint8, device="cuda")
    out = torch.zeros((layers, page), dtype=torch.int32, device="cuda")
    events = [torch.cuda.Event(external=True) for _ in range(layers)]
    store.prepare_gpu(0)
    compute = torch.cuda.Stream()
    load = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(compute):
        with torch.cuda.graph(graph, stream=compute):
            for layer in range(layers):
                compute.wait_event(events[layer])
                out[layer].copy_(kv[layer].to(torch.int32) * 2)
    steps = 4
    for step in range(steps):
        for layer in range(layers):
            store.put(k(f"s{step}/l{layer}"), pattern(page, 100 * step + layer))
    for step in range(steps):
        tickets = []
        for layer in range(layers):
            tickets.append(store.batch_get_into_multi_buffers_on_stream([k(f"s{step}/l{layer}")], [[kv[layer]]], load))
            events[layer].record(load)
        with torch.cuda.stream(compute):
            graph.replay()
        compute.synchronize()
        for layer in range(layers):
            expected = pattern(page, 100 * step + layer).to(torch.int32).cuda() * 2
            assert torch.equal(out[layer], expected), f"step {step} layer {layer}"
        for t in tickets:
            assert t.wait(10_000) == [page]
    # Reads are refused on a stream being captured.
    capture = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        capture.capture_begin()
        try:
            out[0].add_(0)
            with pytest.raises(kvtide.StreamCapturing):
                store.batch_get_into_multi_buffers_on_stream([k("s0/l0")], [[kv[0]]], s)
        finally:
            capture.capture_end()
    store.batch_remove([k(f"s{s_}/l{l_}") for s_ in range(steps) for l_ in range(layers)])
    store.close()


def test_mooncake_tensor_helpers(owner, k):
    from kvtide.mooncake import MooncakeDistributedStore

    mc = MooncakeDistributedStore()
    assert mc.setup("h", "meta", 64 << 20, 0, "tcp", "", owner.unix) == 0
    t = torch.randn(64, 32, dtype=torch.bfloat16)
    assert mc.put_tensor(k("t"), t) == 0
    assert torch.equal(mc.get_tensor(k("t")), t)
    g = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6)
    assert mc.put_tensor(k("g"), g) == 0
    assert torch.equal(mc.get_tensor(k("g")), g.cpu())
    assert mc.put_tensor_with_tp(k("tp"), g, tp_size=2, split_dim=1) == 0
    assert torch.equal(mc.get_tensor_with_tp(k("tp"), tp_rank=1, tp_size=2), g.cpu()[:, 3:])
    assert mc.get_tensor(k("absent")) is None
    small = np.zeros(4096, np.uint8)
    assert mc.get_tensor_into(k("t"), small.ctypes.data, small.nbytes) is None, "4 KiB of data plus a header"
    buf = np.zeros(8192, np.uint8)
    view = mc.get_tensor_into(k("t"), buf.ctypes.data, buf.nbytes)
    assert torch.equal(view, t)
    assert mc.batch_put_tensor([k("b1"), k("b2")], [t, t]) == [0, 0]
    assert all(torch.equal(x, t) for x in mc.batch_get_tensor([k("b1"), k("b2")]))
    mc.batch_remove([k("t"), k("g"), k("tp_tp_0"), k("tp_tp_1"), k("b1"), k("b2")])
    mc.close()


def test_mooncake_stream_bound_reads_on_a_torch_stream(owner, k):
    """The Mooncake class's stream-bound calls: per layer a read on a load stream and an event
    after it; the compute stream waits on each event, then checks every byte; the handles end
    with every key read and nothing leased."""
    from kvtide.mooncake import MooncakeDistributedStore

    mc = MooncakeDistributedStore()
    assert mc.setup("localhost", "P2PHANDSHAKE", 1 << 30, 16 << 20, "tcp", "", owner.unix) == 0
    layers, page = 4, 64 << 10
    kv = [torch.zeros(2 * page, dtype=torch.uint8, device="cuda") for _ in range(layers)]
    for layer in range(layers):
        for half in range(2):
            assert mc.put(k(f"mc/l{layer}/{half}"), pattern(page, 10 * layer + half).numpy().tobytes()) == 0
    load, compute = torch.cuda.Stream(), torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(layers)]
    handles = []
    for layer in range(layers):
        keys = [k(f"mc/l{layer}/0"), k(f"mc/l{layer}/1")]
        ptrs = [[kv[layer].data_ptr()], [kv[layer].data_ptr() + page]]
        handles.append(mc.batch_get_into_multi_buffers_on_stream(keys, ptrs, [[page], [page]], load.cuda_stream))
        events[layer].record(load)
    for layer in range(layers):
        compute.wait_event(events[layer])
    compute.synchronize()
    for layer in range(layers):
        expected = torch.cat([pattern(page, 10 * layer), pattern(page, 10 * layer + 1)]).cuda()
        assert torch.equal(kv[layer], expected), f"layer {layer}"
        assert handles[layer].wait(10_000) == [page, page]
        assert handles[layer].keys_pinned() == 0
    # The step call: every layer in one call, each layer's event recorded after its copies.
    for layer in range(layers):
        kv[layer].zero_()
    h = mc.batch_get_into_multi_buffers_step_on_stream(
        [[k(f"mc/l{layer}/0"), k(f"mc/l{layer}/1")] for layer in range(layers)],
        [[[kv[layer].data_ptr()], [kv[layer].data_ptr() + page]] for layer in range(layers)],
        [[[page], [page]] for _ in range(layers)], load.cuda_stream, events=events)
    for layer in range(layers):
        compute.wait_event(events[layer])
    compute.synchronize()
    for layer in range(layers):
        expected = torch.cat([pattern(page, 10 * layer), pattern(page, 10 * layer + 1)]).cuda()
        assert torch.equal(kv[layer], expected), f"step layer {layer}"
    assert h.wait(10_000) == [[page, page]] * layers
    # Ranges: the second half of layer 0's first page into a registered device buffer.
    dst = torch.zeros(page, dtype=torch.uint8, device="cuda")
    assert mc.register_buffer(dst.data_ptr(), page) == 0
    h = mc.get_into_ranges_on_stream([dst.data_ptr()], [[k("mc/l0/0")]], [[[0]]], [[[page // 2]]], [[[page // 2]]],
                                     stream_ptr=load.cuda_stream)
    load.synchronize()
    assert h.wait(10_000) == [[[page // 2]]]
    assert torch.equal(dst[:page // 2], pattern(page, 0)[page // 2:].cuda())
    mc.unregister_buffer(dst.data_ptr())
    mc.batch_remove([k(f"mc/l{layer}/{half}") for layer in range(layers) for half in range(2)])
    mc.close()


def test_step_on_stream_one_call_per_step_under_one_graph(gstore, k):
    """The seed-000 step with the step call: a graph captured once whose layer l waits on event
    l (external) and computes on the layer's KV; per step ONE step_on_stream reads every layer
    and records every event, then the graph replays. Every byte is checked for four steps, and
    a flags variant writes one word per layer that the compute stream waits on."""
    layers, page = 4, 256 << 10
    kv = [torch.zeros(page, dtype=torch.uint8, device="cuda") for _ in range(layers)]
    out = [torch.zeros(page, dtype=torch.int32, device="cuda") for _ in range(layers)]
    events = [torch.cuda.Event(external=True) for _ in range(layers)]
    load, compute = torch.cuda.Stream(), torch.cuda.Stream()
    for e in events:
        e.record(load)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(compute):
        with torch.cuda.graph(graph, stream=compute):
            for layer in range(layers):
                compute.wait_event(events[layer])
                out[layer].copy_(kv[layer].to(torch.int32) * 2)
    steps = 4
    for step in range(steps):
        for layer in range(layers):
            gstore.put(k(f"st{step}/l{layer}"), pattern(page, 100 * step + layer))
    for step in range(steps):
        t = gstore.step_on_stream([([k(f"st{step}/l{layer}")], [[kv[layer]]]) for layer in range(layers)], load,
                                  events=events)
        with torch.cuda.stream(compute):
            graph.replay()
        compute.synchronize()
        for layer in range(layers):
            expected = pattern(page, 100 * step + layer).to(torch.int32).cuda() * 2
            assert torch.equal(out[layer], expected), f"step {step} layer {layer}"
        assert t.wait(10_000) == [page] * layers
    # Flags: one int32 word per layer; the compute stream waits until the step wrote each.
    words = torch.zeros(layers, dtype=torch.int32, device="cuda")
    for layer in range(layers):
        kv[layer].zero_()
    t = gstore.step_on_stream([([k(f"st0/l{layer}")], [[kv[layer]]]) for layer in range(layers)], load,
                              flags=[(words[layer].data_ptr(), layer + 1) for layer in range(layers)])
    load.synchronize()
    assert words.tolist() == [1, 2, 3, 4]
    for layer in range(layers):
        assert torch.equal(kv[layer].cpu(), pattern(page, layer)), f"flags layer {layer}"
    assert t.wait(10_000) == [page] * layers
    gstore.batch_remove([k(f"st{s_}/l{l_}") for s_ in range(steps) for l_ in range(layers)])
