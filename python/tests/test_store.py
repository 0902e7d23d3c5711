"""kvtide.Store, embedded and through an owner (Unix socket with shared memory, and TCP):
every method, per-key errors, bad buffers, handles, threads."""

import threading
import time

import numpy as np
import pytest

import kvtide
from conftest import cuda_devices


def value(n, seed=0):
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def test_put_get_exists_remove(store, k):
    v = value(4096, 1)
    store.put(k("a"), v)
    assert store.get(k("a")) == v.tobytes()
    assert store.exists(k("a")) is True
    assert store.exists(k("missing")) is False
    assert store.get_size(k("a")) == 4096
    store.remove(k("a"))
    assert store.exists(k("a")) is False
    with pytest.raises(kvtide.NotFound):
        store.get(k("a"))
    with pytest.raises(kvtide.NotFound):
        store.remove(k("a"))


def test_insert_only_unless_upsert(store, k):
    store.put(k("a"), b"first")
    with pytest.raises(kvtide.AlreadyExists):
        store.put(k("a"), b"second")
    assert store.get(k("a")) == b"first"
    store.put(k("a"), b"second!", upsert=True)
    assert store.get(k("a")) == b"second!"


def test_keys_may_be_str_or_bytes(store, k):
    store.put(k("s").encode(), b"bytes key")
    assert store.get(k("s")) == b"bytes key"
    with pytest.raises(kvtide.InvalidArgument):
        store.put(12, b"x")
    with pytest.raises(kvtide.InvalidArgument):
        store.put("", b"x")


def test_gather_put_and_scatter_get(store, k):
    parts = [value(100, 1), bytearray(b"middle"), memoryview(value(50, 2))]
    store.put_from(k("g"), parts)
    whole = b"".join(bytes(p) for p in parts)
    a, b = np.zeros(100, np.uint8), np.zeros(len(whole) - 100, np.uint8)
    [n] = store.batch_get_into_multi_buffers([k("g")], [[a, b]])
    assert n == len(whole)
    assert a.tobytes() + b.tobytes() == whole


def test_batches_return_per_key_results(store, k):
    keys = [k(f"b{i}") for i in range(8)]
    vals = [value(1000 + i, i) for i in range(8)]
    assert store.batch_put_from(keys, vals) == [None] * 8
    again = store.batch_put_from(keys[:2] + [k("new")], [vals[0], vals[1], b"n"])
    assert isinstance(again[0], kvtide.AlreadyExists) and isinstance(again[1], kvtide.AlreadyExists)
    assert again[2] is None
    dsts = [np.zeros(2000, np.uint8) for _ in range(9)]
    got = store.batch_get_into(keys + [k("absent")], dsts)
    assert got[:8] == [1000 + i for i in range(8)]
    assert isinstance(got[8], kvtide.NotFound)
    for i in range(8):
        assert dsts[i][: 1000 + i].tobytes() == vals[i].tobytes()
    assert store.batch_exists(keys[:2] + [k("absent")]) == [True, True, False]
    assert store.prefix_hits(keys[:3] + [k("absent")] + keys[3:]) == 3
    sizes = store.batch_get_size([keys[0], k("absent")])
    assert sizes[0] == 1000 and isinstance(sizes[1], kvtide.NotFound)
    removed = store.batch_remove([keys[0], k("absent"), keys[1]])
    assert removed[0] is None and isinstance(removed[1], kvtide.NotFound) and removed[2] is None
    store.batch_remove(keys[2:] + [k("new")])


def test_batch_get_into_under_upserts_that_change_the_size(store, k):
    """Buffers at least as large as every version: a concurrent upsert that changes the object's
    size never makes a read fail or return another version's bytes half-copied."""
    key = k("resized")
    versions = [b"a" * 3000, b"b" * 5000]
    store.put(key, versions[0], upsert=True)
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            store.put(key, versions[i % 2], upsert=True)

    t = threading.Thread(target=writer)
    t.start()
    try:
        buf = np.zeros(10000, np.uint8)
        deadline = time.monotonic() + 1.5
        reads = 0
        while time.monotonic() < deadline:
            [n] = store.batch_get_into([key], [buf])
            assert not isinstance(n, Exception), f"read {reads}: {n!r}"
            assert buf[:n].tobytes() in versions
            reads += 1
    finally:
        stop.set()
        t.join()
    store.remove(key)


def test_multi_buffer_puts_and_one_bad_key(store, k):
    keys = [k("m0"), "", k("m2")]
    res = store.batch_put_from_multi_buffers(keys, [[b"ab", b"cd"], [b"x"], [value(10)]])
    assert res[0] is None and isinstance(res[1], kvtide.InvalidArgument) and res[2] is None
    assert store.get(k("m0")) == b"abcd"
    out = [[np.zeros(4, np.uint8)], [np.zeros(1, np.uint8)], [np.zeros(11, np.uint8)]]
    got = store.batch_get_into_multi_buffers(keys, out)
    assert got[0] == 4 and isinstance(got[1], kvtide.InvalidArgument)
    assert isinstance(got[2], kvtide.SizeMismatch), "scatter lists must add up to the object's size exactly"
    store.batch_remove([k("m0"), k("m2")])


def test_bad_destination_buffers(store, k):
    store.put(k("v"), value(10))
    with pytest.raises(kvtide.BufferTooSmall):
        store.get_into(k("v"), np.zeros(4, np.uint8))
    with pytest.raises(kvtide.InvalidArgument, match="read-only"):
        store.get_into(k("v"), bytes(64))
    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(kvtide.InvalidArgument, match="read-only"):
        store.get_into(k("v"), ro)
    with pytest.raises(kvtide.InvalidArgument, match="contiguous"):
        store.get_into(k("v"), np.zeros((8, 8), np.uint8)[:, :2])
    with pytest.raises(kvtide.InvalidArgument, match="not a buffer"):
        store.get_into(k("v"), object())
    with pytest.raises(kvtide.InvalidArgument):
        store.get_into(k("v"), "a str")
    # Sizes are bytes whatever the dtype: 3 float32 are 12 bytes (room for 10), 2 are 8.
    f = np.zeros(3, np.float32)
    assert store.get_into(k("v"), f) == 10
    assert f.view(np.uint8)[:10].tobytes() == value(10).tobytes()
    with pytest.raises(kvtide.BufferTooSmall):
        store.get_into(k("v"), np.zeros(2, np.float32))
    [r] = store.batch_get_into_multi_buffers([k("v")], [[np.zeros(3, np.float32)]])
    assert isinstance(r, kvtide.SizeMismatch)
    # A bad buffer in a batch fails its own key; its neighbours are read or written.
    ok, bad = store.batch_get_into([k("v"), k("v")], [np.zeros(16, np.uint8), bytes(16)])
    assert ok == 10 and isinstance(bad, kvtide.InvalidArgument) and "read-only" in str(bad)
    out = np.zeros(10, np.uint8)
    res = store.batch_get_into_multi_buffers([k("v"), k("v")], [[object()], [out]])
    assert isinstance(res[0], kvtide.InvalidArgument) and res[1] == 10 and out.tobytes() == value(10).tobytes()
    res = store.batch_put_from([k("w1"), k("w2"), k("w3")], [b"one", "not a buffer", np.zeros((4, 4))[:, :2]])
    assert res[0] is None and isinstance(res[1], kvtide.InvalidArgument) and isinstance(res[2], kvtide.InvalidArgument)
    assert store.batch_exists([k("w1"), k("w2"), k("w3")]) == [True, False, False]
    ranges = store.get_into_ranges([bytes(8), np.zeros(8, np.uint8)], [[(k("v"), 0, 0, 4)], [(k("v"), 0, 0, 8), (k("v"), 2, 0, 2)]])
    assert isinstance(ranges[0][0], kvtide.InvalidArgument) and ranges[1] == [8, 2]
    # A key list and a buffer list of different lengths is an error of the call.
    with pytest.raises(kvtide.InvalidArgument):
        store.batch_get_into([k("v")], [np.zeros(16, np.uint8), np.zeros(16, np.uint8)])
    store.remove(k("w1"))
    store.remove(k("v"))


def test_raw_address_pairs(store, k):
    src = value(256, 3)
    store.put_from(k("raw"), (src.ctypes.data, src.nbytes))
    dst = np.zeros(256, np.uint8)
    assert store.get_into(k("raw"), (dst.ctypes.data, dst.nbytes)) == 256
    assert np.array_equal(src, dst)
    with pytest.raises(kvtide.InvalidArgument, match="null"):
        store.get_into(k("raw"), (0, 16))
    with pytest.raises(kvtide.InvalidArgument):
        store.get_into(k("raw"), (-1, 16))
    store.remove(k("raw"))


def test_ranges(store, k):
    store.put(k("r"), value(100, 5))
    buf = np.zeros(64, np.uint8)
    res = store.get_into_ranges(
        [buf], [[(k("r"), 10, 0, 20), (k("r"), 90, 20, 20), (k("nope"), 0, 40, 4), (k("r"), 0, 60, 10)]]
    )
    [[a, b, c, d]] = res
    assert a == 20 and isinstance(b, kvtide.InvalidArgument) and isinstance(c, kvtide.NotFound)
    assert isinstance(d, kvtide.InvalidArgument), "past the end of the 64-byte buffer"
    assert buf[:20].tobytes() == value(100, 5)[10:30].tobytes()
    store.remove(k("r"))


def test_pins(store, k):
    store.put(k("p"), b"pinned", pin=True)
    with pytest.raises(kvtide.Pinned):
        store.remove(k("p"))
    store.unpin(k("p"))
    with pytest.raises(kvtide.NotPinned):
        store.unpin(k("p"))
    store.pin(k("p"))
    store.remove(k("p"), force=True)
    with pytest.raises(kvtide.NotFound):
        store.pin(k("p"))


def test_ticket(store, k):
    keys = [k(f"t{i}") for i in range(4)]
    store.batch_put_from(keys, [value(5000, i) for i in range(4)])
    dsts = [[np.zeros(5000, np.uint8)] for _ in range(4)] + [[np.zeros(1, np.uint8)]]
    t = store.submit_batch_get(keys + [k("absent")], dsts)
    res = t.wait()
    assert res[:4] == [5000] * 4 and isinstance(res[4], kvtide.NotFound)
    assert t.is_ready() and t.wait() == res or True
    for i in range(4):
        assert dsts[i][0].tobytes() == value(5000, i).tobytes()
    t2 = store.submit_batch_get(keys, [[np.zeros(5000, np.uint8)] for _ in range(4)])
    t2.cancel()
    for r in t2.wait(timeout_ms=10_000):
        assert r == 5000 or isinstance(r, kvtide.Cancelled)
    del t2
    store.batch_remove(keys)


def test_ticket_cancel_stops_a_read_in_flight(store, k, request):
    """Ticket.cancel reaches a batch read that is running: delivered keys are whole, the rest
    report Cancelled, nothing stays held (the fixture checks), and the keys read again after.
    Over TCP, 32 MiB stream for longer than the cancel takes to arrive: some keys are cancelled."""
    n, size = 32, 1 << 20
    keys = [k(f"c{i}") for i in range(n)]
    vals = [value(size, i) for i in range(n)]
    store.batch_put_from(keys, vals)
    dsts = [[np.zeros(size, np.uint8)] for _ in range(n)]
    t = store.submit_batch_get(keys, dsts)
    t.cancel()
    res = t.wait(timeout_ms=30_000)
    cancelled = 0
    for i, r in enumerate(res):
        if isinstance(r, kvtide.Cancelled):
            cancelled += 1
        else:
            assert r == size, r
            assert dsts[i][0].tobytes() == vals[i].tobytes()
    if request.node.callspec.params["store"] == "tcp":
        assert cancelled > 0, res
    del t
    again = [[np.zeros(size, np.uint8)] for _ in range(n)]
    assert store.batch_get_into_multi_buffers(keys, again) == [size] * n
    assert all(again[i][0].tobytes() == vals[i].tobytes() for i in range(n))
    store.batch_remove(keys)


def test_progressive_put_and_chunked_reads(store, k):
    data = value(10_000, 9)
    ps = store.progressive_put(k("pp"), len(data), 4096)
    assert ps.num_chunks() == 3 and ps.total_bytes() == len(data)
    for i in reversed(range(ps.num_chunks())):
        a, b = ps.chunk_range(i)
        ps.put_chunk(i, data[a:b])
    assert not store.exists(k("pp")), "invisible until sealed"
    ps.seal()
    dst = np.zeros(len(data), np.uint8)
    with store.progressive_get(k("pp"), dst, 3000) as h:
        assert h.num_chunks() == 4
        h.wait_all()
        assert h.status() == {"state": "done"}
        assert all(h.is_chunk_ready(i) for i in range(4))
    assert np.array_equal(dst, data)
    bufs = [np.zeros(100, np.uint8), np.zeros(50, np.uint8)]
    h = store.streaming_batch_get_buffer_ranges(bufs, [[(k("pp"), 0, 0, 100)], [(k("nope"), 0, 0, 50)]], 64)
    assert h.chunk_place(0) == (0, 0, 64)
    with pytest.raises(kvtide.KvtideError):
        h.wait_all()
    st = h.status()
    assert st["state"] == "failed" and isinstance(st["error"], kvtide.NotFound)
    assert bufs[0].tobytes() == data[:100].tobytes()
    h.close()
    aborted = store.progressive_put(k("ab"), 10, 5)
    aborted.put_chunk(0, b"12345")
    aborted.abort()
    assert not store.exists(k("ab"))
    with pytest.raises(kvtide.InvalidArgument):
        aborted.seal()
    store.remove(k("pp"))


def test_threads_run_while_a_call_waits(store, k):
    """A reader blocks in wait_all on an unsealed put; the producer runs in this thread. With
    the GIL held by the waiting call, the producer could never write and this would hang."""
    data = value(8192, 4)
    ps = store.progressive_put(k("live"), len(data), 1024)
    dst = np.zeros(len(data), np.uint8)
    h = store.progressive_get_unsealed(k("live"), dst, 1024)
    done = threading.Event()
    errors = []

    def reader():
        try:
            h.wait_all()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        done.set()

    t = threading.Thread(target=reader)
    t.start()
    for i in range(ps.num_chunks()):
        a, b = ps.chunk_range(i)
        ps.put_chunk(i, data[a:b])
        assert not done.is_set() or i == ps.num_chunks() - 1
    ps.seal()
    assert done.wait(30), "the reader never finished"
    t.join()
    assert not errors and np.array_equal(dst, data)
    h.close()
    store.remove(k("live"))


def test_concurrent_threads(store, k):
    def work(n):
        for i in range(50):
            key = k(f"c{n}/{i}")
            store.put(key, value(2048, n + i))
            out = np.zeros(2048, np.uint8)
            assert store.get_into(key, out) == 2048 and np.array_equal(out, value(2048, n + i))
            store.remove(key)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_stats_and_close(store, k):
    store.put(k("s"), b"x" * 100)
    st = store.stats()
    assert st["total"]["objects"] >= 1 and "gpu" in st and "restore" in st
    assert store.max_value_bytes() > 0
    store.remove(k("s"))


def test_stream_bound_needs_cuda(store, k):
    store.put(k("gpu"), b"abc")
    dst = np.zeros(3, np.uint8)
    # Stream 0 is the blocking read, on any build.
    t = store.batch_get_into_multi_buffers_on_stream([k("gpu")], [[dst]], 0)
    assert t.status() == "done" and t.results() == [3] and dst.tobytes() == b"abc"
    # Without the CUDA transport, or with it (the wheel's build) but no libcuda or no GPU.
    if not kvtide.cuda_built() or cuda_devices() == 0:
        with pytest.raises(kvtide.CudaUnavailable):
            store.batch_get_into_multi_buffers_on_stream([k("gpu")], [[dst]], 12345)
    with pytest.raises(kvtide.InvalidArgument, match="CUDA stream"):
        store.get_into_ranges_on_stream([dst], [[(k("gpu"), 0, 0, 3)]], "not a stream")

    # Stream-like objects: torch's (cuda_stream), cuda.core's (__cuda_stream__), cuda-python's
    # CUstream (int()); stream 0 of each is the blocking read.
    class TorchLike:
        cuda_stream = 0

    class CoreLike:
        def __cuda_stream__(self):
            return (0, 0)

    class IntLike:
        def __int__(self):
            return 0

    for stream in (TorchLike(), CoreLike(), IntLike()):
        dst[:] = 0
        t = store.get_into_ranges_on_stream([dst], [[(k("gpu"), 0, 0, 3)]], stream)
        assert t.results() == [3] and dst.tobytes() == b"abc"
    store.remove(k("gpu"))


def test_step_on_stream_with_stream_zero_and_its_refusals(store, k):
    """A step on stream 0 reads every layer before returning, results layer after layer, for
    whole objects and for ranges; signals need a stream, a layer has one signal, one per layer;
    without CUDA a real stream is refused. The copies on a stream are checked on the GPU
    machine (test_gpu.py)."""
    store.put(k("a"), b"abc")
    store.put(k("b"), b"defgh")
    a, b, c = np.zeros(3, np.uint8), np.zeros(5, np.uint8), np.zeros(2, np.uint8)
    t = store.step_on_stream([([k("a")], [[a]]), ([k("b"), k("missing")], [[b], [c]])], 0)
    res = t.results()
    assert res[:2] == [3, 5] and isinstance(res[2], kvtide.NotFound)
    assert a.tobytes() == b"abc" and b.tobytes() == b"defgh"
    dst = np.zeros(4, np.uint8)
    t = store.step_ranges_on_stream([([dst], [[(k("a"), 1, 0, 2)]]), ([dst], [[(k("b"), 3, 2, 2)]])], 0)
    assert t.results() == [2, 2] and dst.tobytes() == b"bcgh"
    with pytest.raises(kvtide.InvalidArgument, match="stream 0"):
        store.step_on_stream([([k("a")], [[a]])], 0, events=[12345])
    with pytest.raises(kvtide.InvalidArgument, match="one per layer"):
        store.step_on_stream([([k("a")], [[a]])], 0, events=[1, 2])
    with pytest.raises(kvtide.InvalidArgument, match="one signal per layer"):
        store.step_on_stream([([k("a")], [[a]])], 0x5EED, events=[1], flags=[(64, 1)])
    with pytest.raises(kvtide.InvalidArgument, match="aligned"):
        store.step_on_stream([([k("a")], [[a]])], 0x5EED, flags=[(65, 1)])
    if not cuda_devices():
        with pytest.raises(kvtide.KvtideError):
            store.step_on_stream([([k("a")], [[a]])], 0x5EED, events=[7])
    store.batch_remove([k("a"), k("b")])


def test_client_variables_are_not_refused_as_settings(monkeypatch, owner):
    """KVTIDE_ADDRESS (the adapters' variable) and this suite's own variables are not settings:
    neither the embedded engine nor the owner refuses to start because they are set."""
    monkeypatch.setenv("KVTIDE_ADDRESS", owner.unix)
    monkeypatch.setenv("KVTIDE_OWNER_FROM_PATH", "1")
    with kvtide.Store(env=True, dram_bytes="16MiB", shards=1, pin_threads=False) as s:
        s.put("k", b"v")
        assert s.get("k") == b"v"
    monkeypatch.setenv("KVTIDE_DRAM_BYTEZ", "1GiB")
    with pytest.raises(kvtide.InvalidArgument, match="KVTIDE_DRAM_BYTEZ"):
        kvtide.Store(env=True, dram_bytes="16MiB", shards=1, pin_threads=False)


def test_the_owner_starts_with_the_adapters_variable_set(monkeypatch):
    from conftest import Owner

    monkeypatch.setenv("KVTIDE_ADDRESS", "unix:/nonexistent/owner.sock")
    o = Owner(dram="16MiB")
    try:
        with kvtide.connect(o.unix) as s:
            s.put("k", b"v")
            assert s.get("k") == b"v"
    finally:
        o.stop()
