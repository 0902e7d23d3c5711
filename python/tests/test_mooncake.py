"""kvtide.mooncake.MooncakeDistributedStore as Mooncake users call it: setup, every method,
return codes instead of exceptions, embedded and through an owner."""

import ctypes
import re
import threading
import time

import numpy as np
import pytest

from kvtide import mooncake
from kvtide.mooncake import (
    INVALID_PARAMS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    MooncakeDistributedStore,
    ReplicateConfig,
)


@pytest.fixture(params=["embedded", "unix", "tcp"])
def mc(request, owner, monkeypatch):
    s = MooncakeDistributedStore()
    if request.param == "embedded":
        monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
        monkeypatch.setenv("KVTIDE_RUNTIME_SHARDS", "2")
        rc = s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", "embedded")
    elif request.param == "unix":
        rc = s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", owner.unix)
    else:
        monkeypatch.setenv("KVTIDE_TOKEN_FILE", owner.token_file)
        rc = s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                      "master_server_addr": owner.tcp})
    assert rc == 0
    yield s
    assert s.close() == 0
    assert s.close() == 0, "close is idempotent"


def buf(n, seed=0):
    a = ((np.arange(n) * 31 + seed) % 251).astype(np.uint8)
    return a, a.ctypes.data


def test_put_get_is_exist_remove(mc, k):
    assert mc.put(k("a"), b"hello") == 0
    assert mc.get(k("a")) == b"hello"
    assert mc.is_exist(k("a")) == 1
    assert mc.is_exist(k("missing")) == 0
    assert mc.get(k("missing")) == b"", "a miss is empty bytes, not an exception"
    assert mc.get_size(k("a")) == 5
    assert mc.get_size(k("missing")) == OBJECT_NOT_FOUND
    assert mc.put(k("a"), b"other") == 0, "put of an existing key succeeds"
    assert mc.get(k("a")) == b"hello", "... and keeps the old value"
    assert mc.upsert(k("a"), b"replaced") == 0
    assert mc.get(k("a")) == b"replaced"
    assert mc.remove(k("a")) == 0
    assert mc.remove(k("a")) == OBJECT_NOT_FOUND
    assert mc.put(k("empty"), b"") == INVALID_PARAMS
    assert mc.put("", b"x") == INVALID_PARAMS
    with pytest.raises(TypeError):
        mc.put(k("x"), 12345)


def test_raw_pointer_calls(mc, k):
    src, ptr = buf(4096, 1)
    assert mc.register_buffer(ptr, src.nbytes) == 0
    assert mc.put_from(k("p"), ptr, src.nbytes) == 0
    dst, dptr = buf(8192)
    dst[:] = 0
    assert mc.get_into(k("p"), dptr, dst.nbytes) == 4096
    assert np.array_equal(dst[:4096], src)
    small, sptr = buf(100)
    assert mc.get_into(k("p"), sptr, 100) == INVALID_PARAMS, "too small a buffer"
    assert mc.get_into(k("missing"), dptr, dst.nbytes) == OBJECT_NOT_FOUND
    assert mc.put_from(k("zero"), ptr, 0) == 0 and mc.is_exist(k("zero")) == 0, "size 0 stores nothing"
    assert mc.unregister_buffer(ptr) == 0
    assert mc.unregister_buffer(ptr) == INVALID_PARAMS
    mc.remove(k("p"))


def test_batches(mc, k):
    keys = [k(f"b{i}") for i in range(6)]
    srcs = [buf(1000 + i, i) for i in range(6)]
    assert mc.batch_put_from(keys, [p for _, p in srcs], [a.nbytes for a, _ in srcs]) == [0] * 6
    assert mc.batch_put_from(keys[:1], [srcs[0][1]], [10, 20]) == [INVALID_PARAMS]
    dsts = [buf(2000) for _ in range(7)]
    got = mc.batch_get_into(keys + [k("absent")], [p for _, p in dsts], [2000] * 7)
    assert got[:6] == [1000 + i for i in range(6)] and got[6] == OBJECT_NOT_FOUND
    for i in range(6):
        assert np.array_equal(dsts[i][0][: 1000 + i], srcs[i][0])
    tiny = buf(10)
    assert mc.batch_get_into([keys[0]], [tiny[1]], [10]) == [INVALID_PARAMS]
    assert mc.batch_get_into([], [], []) == []
    assert mc.batch_is_exist(keys[:2] + [k("absent")]) == [1, 1, 0]
    assert mc.get_batch(keys[:2] + [k("absent")]) == [srcs[0][0].tobytes(), srcs[1][0].tobytes(), b""]
    assert mc.get_batch([]) == [b""], "Mooncake's quirk for no keys"
    assert mc.put_batch([k("pb1"), k("pb2")], [b"one", b"two"]) == 0
    assert mc.put_batch([k("pb1")], [b"one", b"two"]) == INVALID_PARAMS
    assert mc.upsert_batch([k("pb1")], [b"uno"]) == 0 and mc.get(k("pb1")) == b"uno"
    assert mc.put_batch([k("pb3")], [b""]) == INVALID_PARAMS
    assert mc.upsert_batch([k("pb1"), k("pb3")], [b"dos", b""]) == INVALID_PARAMS, "an empty value, as put_batch"
    assert mc.get(k("pb1")) == b"uno" and mc.is_exist(k("pb3")) == 0, "nothing stored"
    assert mc.batch_remove([k("pb1"), k("absent")]) == [0, OBJECT_NOT_FOUND]
    mc.batch_remove(keys + [k("pb2")])


def test_multi_buffers(mc, k):
    a, ap = buf(300, 1)
    b, bp = buf(200, 2)
    assert mc.batch_put_from_multi_buffers([k("m")], [[ap, bp]], [[300, 200]]) == [0]
    x, xp = buf(100)
    y, yp = buf(600)
    x[:] = 0
    y[:] = 0
    # Buffers larger than the object: filled in order, as Mooncake does.
    assert mc.batch_get_into_multi_buffers([k("m"), k("absent")], [[xp, yp], [xp]], [[100, 600], [100]]) == [
        500, OBJECT_NOT_FOUND]
    whole = np.concatenate([a, b])
    assert np.array_equal(np.concatenate([x, y[:400]]), whole)
    assert mc.batch_get_into_multi_buffers([k("m")], [[xp]], [[100]]) == [INVALID_PARAMS], "too small"
    mc.remove(k("m"))


def test_parts_buffers_and_ranges(mc, k):
    assert mc.put_parts(k("parts"), b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert mc.get(k("parts")) == b"abcdef"
    with pytest.raises(RuntimeError):
        mc.put_parts(k("bad"), np.zeros((2, 2), np.uint8))
    assert mc.put_parts(k("none")) == 0 and mc.is_exist(k("none")) == 0
    h = mc.get_buffer(k("parts"))
    assert bytes(h) == b"abcdef" and h.size() == 6 and len(h) == 6
    assert ctypes.string_at(h.ptr(), 6) == b"abcdef"
    assert mc.get_buffer(k("absent")) is None
    assert [bytes(x) if x is not None else None for x in mc.batch_get_buffer([k("parts"), k("absent")])] == [
        b"abcdef", None]
    out, op = buf(16)
    out[:] = 0
    res = mc.get_into_ranges([op], [[k("parts"), k("absent")]], [[0, 8]], [[2, 0]], [[3, 2]])
    assert res == [[3, OBJECT_NOT_FOUND]] and out[:3].tobytes() == b"cde"
    mc.remove(k("parts"))


def test_pins_and_leases(mc, k):
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert mc.put(k("pinned"), b"x" * 100, cfg) == 0
    assert mc.remove(k("pinned")) == OBJECT_HAS_LEASE
    assert mc.remove(k("pinned"), force=True) == 0
    cfg2 = ReplicateConfig()
    cfg2.prefer_alloc_in_same_node = True
    assert mc.put(k("same-node"), b"x", cfg2) == INVALID_PARAMS
    assert "replica_num=1" in str(ReplicateConfig())


def test_remove_all_and_by_regex(mc, k):
    for name in ["r/1", "r/2", "s/1", "s/22"]:
        assert mc.put(k(name), name.encode()) == 0
    assert mc.remove_by_regex("^" + re.escape(k("s/")) + r"\d$") == 1
    assert mc.is_exist(k("s/1")) == 0 and mc.is_exist(k("s/22")) == 1
    assert mc.remove_by_regex("(") == INVALID_PARAMS
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert mc.put(k("pinned"), b"p", cfg) == 0
    removed = mc.remove_all()
    assert removed >= 3
    assert mc.is_exist(k("pinned")) == 1, "pinned objects are skipped without force"
    assert mc.remove_all(force=True) >= 1
    assert mc.is_exist(k("pinned")) == 0


def test_removes_by_pattern_page_through_the_keys(mc, k, monkeypatch):
    import kvtide.mooncake as mooncake

    monkeypatch.setattr(mooncake, "_SCAN_PAGE", 2)
    for i in range(7):
        assert mc.put(k(f"paged/{i}"), b"v") == 0
    assert mc.remove_by_regex("^" + re.escape(k("paged/")) + "[0-4]$") == 5
    assert [mc.is_exist(k(f"paged/{i}")) for i in range(7)] == [0, 0, 0, 0, 0, 1, 1]


def test_batch_reads_into_larger_buffers_under_size_changing_upserts(mc, k):
    """Buffers larger than every version while another thread upserts other sizes: each read
    returns one whole version, never an error for a size the caller did not pass."""
    key = k("resized")
    versions = [b"a" * 3000, b"b" * 5000]
    assert mc.upsert(key, versions[0]) == 0
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            mc.upsert(key, versions[i % 2])

    t = threading.Thread(target=writer)
    t.start()
    try:
        out, ptr = buf(10000)
        half = 6000
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            [n] = mc.batch_get_into([key], [ptr], [10000])
            assert n in (3000, 5000), n
            assert out[:n].tobytes() in versions
            [m] = mc.batch_get_into_multi_buffers([key], [[ptr, ptr + half]], [[half, 10000 - half]])
            assert m in (3000, 5000), m
            assert out[:m].tobytes() in versions
    finally:
        stop.set()
        t.join()
    assert mc.remove(key) == 0


def test_a_key_removed_between_the_reads_of_larger_buffers_is_a_miss(mc, k):
    """Scattered reads into buffers larger than the object take more than one read; a remove
    landing between them answers OBJECT_NOT_FOUND, as a miss does (not INVALID_PARAMS)."""
    key = k("gone")
    assert mc.put(key, b"x" * 1000) == 0
    real = mc._store

    class RemovedAfterTheFirstRead:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_get_into_multi_buffers(self, keys, lists):
            results = real.batch_get_into_multi_buffers(keys, lists)
            real.remove(key)
            return results

    out, ptr = buf(4096)
    mc._store = RemovedAfterTheFirstRead()
    try:
        assert mc.batch_get_into_multi_buffers([key], [[ptr]], [[4096]]) == [OBJECT_NOT_FOUND]
    finally:
        mc._store = real
    assert mc.batch_get_into_multi_buffers([key], [[ptr]], [[4096]]) == [OBJECT_NOT_FOUND]


def test_lifecycle_and_not_set_up():
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.put("k", b"v") == INVALID_PARAMS
    assert s.get("k") == b""
    assert s.get_into("k", 1, 1) == INVALID_PARAMS
    assert s.is_exist("k") == INVALID_PARAMS
    assert s.batch_put_from_multi_buffers(["k"], [[1]], [[1]]) == []
    assert s.batch_get_into(["k"], [1], [1]) == [INVALID_PARAMS]
    assert s.get_buffer("k") is None
    assert s.close() == 0
    with pytest.raises(TypeError):
        s.setup("host", "meta")
    assert s.setup({"local_hostname": "h"}) == INVALID_PARAMS, "metadata_server is required"
    bad_size = {"local_hostname": "h", "metadata_server": "x", "global_segment_size": "lots"}
    assert s.setup(bad_size) == INVALID_PARAMS, "an unreadable size is a bad argument, not an exception"
    assert s.setup("h", "meta", "lots", 16 << 20, "tcp", "", "embedded") == INVALID_PARAMS
    assert s.setup_dummy("lots", 16 << 20, "embedded") == INVALID_PARAMS
    assert s.init_all("tcp", "", "lots") == INVALID_PARAMS
    assert s.setup("h", "meta", 16 << 20, 16 << 20, "tcp", "", "unix:/nonexistent/kvtide.sock") == mooncake.RPC_FAIL


def test_setup_embedded_with_ssd(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
    monkeypatch.setenv("KVTIDE_SSD_BYTES", "128MiB")  # KVTIDE_* settings apply to the embedded store
    s = MooncakeDistributedStore()
    assert s.setup("h", "meta", 32 << 20, 0, "tcp", "", "embedded", None, True, str(tmp_path / "ssd")) == 0
    assert s.get_hostname() == "h" and s.health_check() == 0
    assert s.put("durable", b"kept") == 0
    assert s.close() == 0
    t = MooncakeDistributedStore()
    assert t.setup("h", "meta", 32 << 20, 0, "tcp", "", "embedded", None, True, str(tmp_path / "ssd")) == 0
    assert t.get("durable") == b"kept", "a clean close writes DRAM to the SSD tier"
    t.close()


def test_error_codes_map_every_exception():
    import kvtide

    assert mooncake.error_code(kvtide.NotFound("x")) == OBJECT_NOT_FOUND
    assert mooncake.error_code(kvtide.SizeMismatch("x")) == INVALID_PARAMS
    assert mooncake.error_code(kvtide.Timeout("x")) == mooncake.RPC_TIMEOUT
    assert mooncake.error_code(kvtide.InternalError("x")) == mooncake.INTERNAL_ERROR


def test_a_value_that_is_not_a_stored_tensor_reads_as_none(mc, k):
    """Stored bytes are outside input: a wrong magic, a truncated header, an unknown dtype or a
    body that does not match the shape gives None, never an exception or a wrong tensor."""
    import struct

    torch = pytest.importorskip("torch")
    good = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert mc.put_tensor(k("t/good"), good) == 0
    assert torch.equal(mc.get_tensor(k("t/good")), good)
    head = b"KVTT" + struct.pack("<HH", 7, 2) + b"float32" + struct.pack("<2q", 2, 3)
    bad = {
        "magic": b"XXXX" + head[4:] + bytes(24),
        "truncated": head[:12],
        "dtype": b"KVTT" + struct.pack("<HH", 7, 1) + b"nothing" + struct.pack("<q", 4) + bytes(16),
        "short body": head + bytes(23),
        "negative": b"KVTT" + struct.pack("<HH", 7, 1) + b"float32" + struct.pack("<q", -1),
    }
    for name, raw in bad.items():
        assert mc.put(k("t/" + name), raw) == 0
        assert mc.get_tensor(k("t/" + name)) is None, name
