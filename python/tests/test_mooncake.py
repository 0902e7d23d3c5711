"""kvtide.mooncake.MooncakeDistributedStore as Mooncake users call it: setup, every method,
return codes instead of exceptions, embedded and through an owner. Each behaviour that
Mooncake's own upstream tests check (python/tests/upstream/run_mooncake_tests.py runs them
against this class, given a Mooncake checkout) is checked here directly, so CI, which has no
checkout, keeps it."""

import ctypes
import gc
import os
import re
import struct
import threading
import time
import weakref

import numpy as np
import pytest

import kvtide
from kvtide import mooncake
from kvtide.mooncake import (
    INVALID_PARAMS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    BufferPool,
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)


def setup_args(address, local=16 << 20):
    return ("localhost", "P2PHANDSHAKE", 64 << 20, local, "tcp", "", address)


@pytest.fixture(params=["embedded", "unix", "tcp", "ucx"])
def mc(request, owner, monkeypatch):
    s = MooncakeDistributedStore()
    if request.param == "embedded":
        monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
        monkeypatch.setenv("KVTIDE_RUNTIME_SHARDS", "2")
        rc = s.setup(*setup_args("embedded"))
    elif request.param == "unix":
        rc = s.setup(*setup_args(owner.unix))
    else:
        monkeypatch.setenv("KVTIDE_TOKEN_FILE", owner.token_file)
        if request.param == "ucx":
            if kvtide.ucx_version() is None:
                assert not os.environ.get("CI"), "CI must have UCX (libucx0)"
                pytest.skip("UCX is not installed here")
            # The owner's plane runs over UCX's tcp transport here (conftest.UCX_ARGS).
            monkeypatch.setenv("KVTIDE_UCX_TRANSPORTS", "tcp")
            monkeypatch.setenv("KVTIDE_UCX_ALLOW_TCP", "1")
        rc = s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                      "master_server_addr": owner.tcp})
        # While the owner restarts its plane's process (conftest.ucx_store says why), a client
        # reads over TCP: set up again until one attaches.
        deadline = time.time() + 15
        while request.param == "ucx" and rc == 0 and s._store.data_plane != "ucx" and time.time() < deadline:
            s.close()
            time.sleep(0.1)
            rc = s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                          "master_server_addr": owner.tcp})
    assert rc == 0
    if request.param == "ucx":
        assert s._store.data_plane == "ucx"
    yield s
    assert s.close() == 0
    assert s.close() == 0, "close is idempotent"


@pytest.fixture
def embedded(monkeypatch):
    monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
    monkeypatch.setenv("KVTIDE_RUNTIME_SHARDS", "2")
    s = MooncakeDistributedStore()
    assert s.setup(*setup_args("embedded")) == 0
    yield s
    s.close()


def buf(n, seed=0):
    a = ((np.arange(n) * 31 + seed) % 251).astype(np.uint8)
    return a, a.ctypes.data


# ---- bytes, return codes --------------------------------------------------------------------


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
    assert mc.put(k("np"), np.arange(4, dtype=np.float32)) == 0
    assert mc.get_size(k("np")) == 16, "a buffer's byte length"
    assert mc.remove(k("a")) == 0
    assert mc.remove(k("a")) == OBJECT_NOT_FOUND
    assert mc.put(k("empty"), b"") == INVALID_PARAMS
    assert mc.put(k("empty"), np.zeros((3, 0), np.uint8)) == INVALID_PARAMS
    assert mc.put("", b"x") == INVALID_PARAMS
    for bad in (12345, "text", [1, 2], (1, 2)):
        with pytest.raises(TypeError):
            mc.put(k("x"), bad)
    with pytest.raises(TypeError):
        mc.put(5, b"x")
    with pytest.raises(TypeError):
        mc.get(5)
    with pytest.raises(TypeError):
        mc.put(key_arg_name_error=k("x"), value=b"x")
    mc.remove(k("np"))


def test_the_fast_paths_answer_as_the_methods_do(mc, k):
    """put/upsert/get/get_into/put_from/batch_get_into run as closures on a set-up store; each
    edge case answers the same through the closure and through the class's method."""
    assert mc.__dict__.get("put") is not None, "fast paths installed at setup"
    cls = MooncakeDistributedStore
    out, ptr = buf(64)
    src, sptr = buf(32, 3)
    for fast, slow in ((mc.put, lambda *a: cls.put(mc, *a)), (mc.upsert, lambda *a: cls.upsert(mc, *a))):
        for key, value in ((k("f"), b"v1"), (k("f"), b"v2"), ("", b"x"), (k("g"), b"")):
            assert fast(key, value) == slow(key, value), (key, value)
    for key in (k("f"), k("missing"), ""):
        assert mc.get(key) == cls.get(mc, key)
        assert mc.get_into(key, ptr, 64) == cls.get_into(mc, key, ptr, 64)
        assert mc.get_into(key, ptr, 1) == cls.get_into(mc, key, ptr, 1)
        pf = key + "/pf" if key else ""
        assert mc.put_from(pf, sptr, 32) == cls.put_from(mc, pf, sptr, 32)
    assert mc.batch_get_into([k("f"), k("missing")], [ptr, ptr], [64, 64]) == cls.batch_get_into(
        mc, [k("f"), k("missing")], [ptr, ptr], [64, 64])
    with pytest.raises(TypeError):
        mc.get_into(k("f"), -1, 8)
    mc.batch_remove([k("f"), k("f/pf")])
    mc.close()
    assert "put" not in mc.__dict__, "closed: the methods answer (not set up)"
    assert mc.put(k("f"), b"v") == INVALID_PARAMS and mc.get(k("f")) == b""


def test_fast_paths_respect_subclasses_and_do_not_keep_the_store_alive(monkeypatch):
    monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")

    class Counting(MooncakeDistributedStore):
        calls = 0

        def put(self, key, value, config=None):
            Counting.calls += 1
            return super().put(key, value, config)

    s = Counting()
    assert s.setup(*setup_args("embedded")) == 0
    assert s.put("k", b"v") == 0 and Counting.calls == 1, "an override is not shadowed"
    assert "get" in s.__dict__
    ref = weakref.ref(s)
    gc.disable()
    try:
        del s
        assert ref() is None, "the closures hold the instance weakly: dropping it frees it at once"
    finally:
        gc.enable()


def test_a_zero_local_buffer_fails_the_copying_writes(monkeypatch):
    """Mooncake stages put/put_parts/put_batch/upsert values in the local buffer: with a size of
    0 they fail and store nothing. The zero-copy calls need no local buffer."""
    monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
    s = MooncakeDistributedStore()
    assert s.setup(*setup_args("embedded", local=0)) == 0
    assert s.put("k", b"value") != 0 and s.is_exist("k") == 0
    assert s.upsert("k", b"value") == INVALID_PARAMS
    assert s.put_parts("k", b"a", b"b") == INVALID_PARAMS
    assert s.put_batch(["k"], [b"v"]) == INVALID_PARAMS
    src, ptr = buf(16)
    assert s.put_from("k", ptr, 16) == 0 and s.get("k") == src.tobytes()
    s.close()


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
    assert mc.get_into(k("p"), 0, 100) == INVALID_PARAMS, "a null pointer"
    assert mc.put_from(k("zero"), ptr, 0) == 0 and mc.is_exist(k("zero")) == 0, "size 0 stores nothing"
    assert mc.upsert_from(k("p"), ptr, 10) == 0 and mc.get_size(k("p")) == 10
    assert mc.unregister_buffer(ptr) == 0
    assert mc.unregister_buffer(ptr) == INVALID_PARAMS
    with pytest.raises(TypeError):
        mc.register_buffer(-1, 10)
    mc.remove(k("p"))


def test_batches(mc, k):
    keys = [k(f"b{i}") for i in range(6)]
    srcs = [buf(1000 + i, i) for i in range(6)]
    assert mc.batch_put_from(keys, [p for _, p in srcs], [a.nbytes for a, _ in srcs]) == [0] * 6
    assert mc.batch_put_from(keys[:1], [srcs[0][1]], [10, 20]) == [INVALID_PARAMS]
    assert mc.batch_put_from([], [], []) == []
    dsts = [buf(2000) for _ in range(7)]
    got = mc.batch_get_into(keys + [k("absent")], [p for _, p in dsts], [2000] * 7)
    assert got[:6] == [1000 + i for i in range(6)] and got[6] == OBJECT_NOT_FOUND
    for i in range(6):
        assert np.array_equal(dsts[i][0][: 1000 + i], srcs[i][0])
    tiny = buf(10)
    assert mc.batch_get_into([keys[0]], [tiny[1]], [10]) == [INVALID_PARAMS]
    assert mc.batch_get_into([], [], []) == []
    assert mc.batch_get_into(keys[:2], [tiny[1]], [10]) == [INVALID_PARAMS] * 2
    assert mc.batch_is_exist(keys[:2] + [k("absent")]) == [1, 1, 0]
    assert mc.batch_is_exist([]) == []
    assert mc.get_batch(keys[:2] + [k("absent")]) == [srcs[0][0].tobytes(), srcs[1][0].tobytes(), b""]
    assert mc.get_batch([]) == [b""], "Mooncake's quirk for no keys"
    assert mc.put_batch([k("pb1"), k("pb2")], [b"one", b"two"]) == 0
    assert mc.put_batch([k("pb1")], [b"one", b"two"]) == INVALID_PARAMS
    assert mc.upsert_batch([k("pb1")], [b"uno"]) == 0 and mc.get(k("pb1")) == b"uno"
    assert mc.put_batch([k("pb3")], [b""]) == INVALID_PARAMS
    assert mc.upsert_batch([k("pb1"), k("pb3")], [b"dos", b""]) == INVALID_PARAMS, "an empty value, as put_batch"
    assert mc.get(k("pb1")) == b"uno" and mc.is_exist(k("pb3")) == 0, "nothing stored"
    assert mc.batch_upsert_from([k("pb1")], [srcs[0][1]], [7]) == [0] and mc.get_size(k("pb1")) == 7
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
    assert np.array_equal(np.concatenate([x, y[:400]]), np.concatenate([a, b]))
    assert mc.batch_get_into_multi_buffers([k("m")], [[xp]], [[100]]) == [INVALID_PARAMS], "too small"
    mc.remove(k("m"))


def test_parts_and_buffers(mc, k):
    assert mc.put_parts(k("parts"), b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert mc.get(k("parts")) == b"abcdef"
    with pytest.raises(RuntimeError):
        mc.put_parts(k("bad"), np.zeros((2, 2), np.uint8))
    assert mc.put_parts(k("none")) == 0 and mc.is_exist(k("none")) == 0
    assert mc.upsert_parts(k("parts"), b"xy") == 0 and mc.get(k("parts")) == b"xy"
    h = mc.get_buffer(k("parts"))
    assert bytes(h) == b"xy" and h.size() == 2 and len(h) == 2
    assert ctypes.string_at(h.ptr(), 2) == b"xy"
    assert mc.get_buffer(k("absent")) is None
    assert [bytes(x) if x is not None else None for x in mc.batch_get_buffer([k("parts"), k("absent")])] == [
        b"xy", None]
    assert mc.batch_get_buffer([]) == []
    mc.remove(k("parts"))


# ---- get_into_ranges: Mooncake's nested shape -------------------------------------------------


def test_get_into_ranges_takes_and_returns_the_nested_shape(mc, k):
    """Mooncake's own case: per buffer its keys, per key its ranges (dst, src, size), and the
    same nesting back, one int per range."""
    data1 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    data2 = b"abcdefghijklmnopqrstuvwxyz0123456789"
    assert mc.put(k("r1"), data1) == 0 and mc.put(k("r2"), data2) == 0
    b0, b1 = (ctypes.c_ubyte * 32)(), (ctypes.c_ubyte * 32)()
    p0, p1 = ctypes.addressof(b0), ctypes.addressof(b1)
    assert mc.register_buffer(p0, 32) == 0 and mc.register_buffer(p1, 32) == 0
    ctypes.memset(b0, ord("_"), 32)
    ctypes.memset(b1, ord("_"), 32)
    res = mc.get_into_ranges(
        [p0, p1],
        [[k("r1"), k("r2")], [k("r2"), k("r1")]],
        [[[0, 20], [8]], [[4], [16]]],
        [[[1, 30], [2]], [[0], [10]]],
        [[[4, 3], [5]], [[6], [4]]],
    )
    assert res == [[[4, 3], [5]], [[6], [4]]]
    assert bytes(b0[0:4]) == data1[1:5] and bytes(b0[8:13]) == data2[2:7] and bytes(b0[20:23]) == data1[30:33]
    assert bytes(b1[4:10]) == data2[0:6] and bytes(b1[16:20]) == data1[10:14]
    assert bytes(b0[4:8]) == b"____", "nothing outside the ranges"

    # One key's lists disagree: its ranges fail (one entry per destination offset); the
    # neighbour key with no ranges keeps its empty row.
    res = mc.get_into_ranges([p0], [[k("r1"), k("r2")]], [[[0], []]], [[[0, 1], []]], [[[], []]])
    assert len(res) == 1 and len(res[0]) == 2 and res[0][0][0] < 0 and res[0][1] == []
    # A source range past the object, a destination range past the registered buffer.
    assert mc.get_into_ranges([p0], [[k("r1")]], [[[0]]], [[[len(data1) - 1]]], [[[4]]])[0][0][0] == INVALID_PARAMS
    assert mc.get_into_ranges([p0], [[k("r1")]], [[[30]]], [[[0]]], [[[4]]])[0][0][0] == INVALID_PARAMS
    # A missing key fails its ranges only.
    res = mc.get_into_ranges([p0], [[k("missing"), k("r1")]], [[[0], [8]]], [[[0], [0]]], [[[4], [4]]])
    assert res == [[[OBJECT_NOT_FOUND], [4]]]
    # Top-level lists of other lengths: every range fails, in the callers' shape.
    assert mc.get_into_ranges([p0, p1], [[k("r1")]], [[[0]]], [[[0]]], [[[4]]]) == [
        [[INVALID_PARAMS]], [[INVALID_PARAMS]]]
    # An unregistered buffer: Mooncake bounds ranges by the registered region, so none is read.
    other = (ctypes.c_ubyte * 32)()
    assert mc.get_into_ranges([ctypes.addressof(other)], [[k("r1")]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]
    # A pointer inside a registered region is bounded by that region's end.
    assert mc.get_into_ranges([p0 + 28], [[k("r1")]], [[[0, 2]]], [[[0, 0]]], [[[4, 4]]]) == [[[4, INVALID_PARAMS]]]
    with pytest.raises(TypeError):
        mc.get_into_ranges([p0], [[k("r1")]], [[[-1]]], [[[0]]], [[[4]]])
    assert mc.get_into_ranges([], [], [], [], []) == []
    mc.unregister_buffer(p0)
    mc.unregister_buffer(p1)
    mc.batch_remove([k("r1"), k("r2")])


def test_stream_bound_calls_with_stream_zero_are_the_blocking_calls(mc, k):
    """``batch_get_into_multi_buffers_on_stream`` and ``get_into_ranges_on_stream`` with stream
    0 answer exactly as the blocking calls; a stream that cannot carry copies (no CUDA here, or
    not a stream on a GPU machine) answers a negative code per key before anything is copied,
    with a handle that is done and holds nothing. The copies on a real stream are checked on the
    GPU machine (test_gpu.py)."""
    a, ap = buf(300, 1)
    b, bp = buf(200, 2)
    assert mc.batch_put_from_multi_buffers([k("s")], [[ap, bp]], [[300, 200]]) == [0]
    x, xp = buf(100)
    y, yp = buf(600)
    x[:] = 0
    y[:] = 0
    got = mc.batch_get_into_multi_buffers_on_stream([k("s"), k("absent")], [[xp, yp], [xp]], [[100, 600], [100]], 0)
    assert got == [500, OBJECT_NOT_FOUND]
    assert np.array_equal(np.concatenate([x, y[:400]]), np.concatenate([a, b]))
    x[:] = 0
    h = mc.batch_get_into_multi_buffers_on_stream([k("s"), k("absent")], [[xp, yp], [xp]], [[100, 400], [100]],
                                                  0x5EED)
    assert h.is_done() and h.keys_pinned() == 0
    codes = h.wait()
    assert len(codes) == 2 and all(c < 0 for c in codes), codes
    assert not x.any(), "nothing copied"
    # Mismatched lists: INVALID_PARAMS per key, as the blocking call.
    assert mc.batch_get_into_multi_buffers_on_stream([k("s")], [[xp]], [[100, 1]], 0x5EED).wait() == [INVALID_PARAMS]
    with pytest.raises(TypeError):
        mc.batch_get_into_multi_buffers_on_stream([k("s")], [[xp]], [[100]], -1)

    buffer = (ctypes.c_ubyte * 64)()
    p = ctypes.addressof(buffer)
    assert mc.register_buffer(p, 64) == 0
    args = ([p], [[k("s"), k("absent")]], [[[0], [8]]], [[[1], [0]]], [[[4], [4]]])
    assert mc.get_into_ranges_on_stream(*args, stream_ptr=0) == [[[4], [OBJECT_NOT_FOUND]]]
    assert bytes(buffer[0:4]) == a[1:5].tobytes()
    ctypes.memset(buffer, 0, 64)
    res = mc.get_into_ranges_on_stream(*args, stream_ptr=0x5EED).wait()
    assert len(res) == 1 and len(res[0]) == 2 and all(r[0] < 0 for r in res[0]), res
    assert bytes(buffer) == bytes(64)
    # Unregistered buffers answer INVALID_PARAMS without reaching the store.
    other = (ctypes.c_ubyte * 8)()
    assert mc.get_into_ranges_on_stream([ctypes.addressof(other)], [[k("s")]], [[[0]]], [[[0]]], [[[4]]],
                                        stream_ptr=0x5EED).wait() == [[[INVALID_PARAMS]]]
    mc.unregister_buffer(p)
    mc.remove(k("s"))


def test_step_on_stream_answers_per_layer_and_refuses_bad_steps(mc, k):
    """The step call with stream 0 reads every layer (one list of ints per layer); bad list
    lengths and signals on stream 0 answer a code per key; the copies on a stream are checked on
    the GPU machine."""
    a, ap = buf(300, 1)
    b, bp = buf(200, 2)
    assert mc.put_from(k("l0"), ap, 300) == 0 and mc.put_from(k("l1"), bp, 200) == 0
    x, xp = buf(300)
    y, yp = buf(200)
    z, zp = buf(10)
    x[:] = 0
    y[:] = 0
    h = mc.batch_get_into_multi_buffers_step_on_stream([[k("l0")], [k("l1"), k("absent")]], [[[xp]], [[yp], [zp]]],
                                                       [[[300]], [[200], [10]]], 0)
    assert h.is_done() and h.wait() == [[300], [200, OBJECT_NOT_FOUND]]
    assert np.array_equal(x, a) and np.array_equal(y, b)
    bad = mc.batch_get_into_multi_buffers_step_on_stream([[k("l0")]], [[[xp]]], [[[300], [1]]], 0)
    assert bad.wait() == [[INVALID_PARAMS]]
    signal_on_zero = mc.batch_get_into_multi_buffers_step_on_stream([[k("l0")]], [[[xp]]], [[[300]]], 0, events=[7])
    assert signal_on_zero.wait() == [[INVALID_PARAMS]]
    mc.batch_remove([k("l0"), k("l1")])


# ---- ReplicateConfig, SoftPinAction, config validation -----------------------------------------


def test_replicate_config_fields_and_types():
    config = ReplicateConfig()
    assert config.replica_num == 1 and config.soft_pin_action == SoftPinAction.PRESERVE
    assert config.soft_pin_ttl_ms is None and config.preferred_segment == "" and config.group_ids is None
    assert config.data_type == ObjectDataType.UNKNOWN
    config.soft_pin_ttl_ms = 1000
    assert config.soft_pin_ttl_ms == 1000
    config.soft_pin_ttl_ms = None
    assert config.soft_pin_ttl_ms is None
    for bad in (-1, 1 << 64, "10"):
        with pytest.raises(TypeError):
            config.soft_pin_ttl_ms = bad
    with pytest.raises(TypeError):
        config.soft_pin_action = 1  # an int is not a SoftPinAction (pybind11's enum)
    with pytest.raises(TypeError):
        config.replica_num = -1
    with pytest.raises(TypeError):
        config.preferred_segments = "node1"
    with pytest.raises(AttributeError):
        config.no_such_field = 1
    config.replica_num = 3
    config.soft_pin_action = SoftPinAction.ENABLE
    config.preferred_segment = "node1:12345"
    text = str(config)
    assert "replica_num: 3" in text and "soft_pin_action: ENABLE" in text and "node1:12345" in text
    assert [a.value for a in SoftPinAction] == [0, 1, 2]


def test_soft_pin_and_replica_settings_are_validated_as_mooncake_does(mc, k):
    key = k("soft")
    enable = ReplicateConfig()
    enable.soft_pin_action = SoftPinAction.ENABLE
    enable.soft_pin_ttl_ms = 1000
    assert mc.put(key, b"soft-pin", enable) == 0
    preserve_ttl = ReplicateConfig()
    preserve_ttl.soft_pin_ttl_ms = 1000
    assert mc.upsert(key, b"x", preserve_ttl) == INVALID_PARAMS, "a TTL needs ENABLE"
    assert mc.put(k("other"), b"x", preserve_ttl) == INVALID_PARAMS
    disable_ttl = ReplicateConfig()
    disable_ttl.soft_pin_action = SoftPinAction.DISABLE
    disable_ttl.soft_pin_ttl_ms = 1000
    assert mc.upsert(key, b"x", disable_ttl) == INVALID_PARAMS
    too_long = ReplicateConfig()
    too_long.soft_pin_action = SoftPinAction.ENABLE
    too_long.soft_pin_ttl_ms = 24 * 3600 * 1000 + 1
    assert mc.upsert(key, b"x", too_long) == INVALID_PARAMS, "at most 24 hours"
    assert mc.get(key) == b"soft-pin", "no rejected write landed"
    assert mc.upsert(key, b"y") == 0
    disable = ReplicateConfig()
    disable.soft_pin_action = SoftPinAction.DISABLE
    assert mc.upsert(key, b"z", disable) == 0 and mc.get(key) == b"z"

    src, ptr = buf(8)
    for field, value in (("replica_num", 0), ("nof_replica_num", 1), ("prefer_alloc_in_same_node", True)):
        bad = ReplicateConfig()
        setattr(bad, field, value)
        assert mc.put(k("bad"), b"x", bad) == INVALID_PARAMS, field
        assert mc.put_from(k("bad"), ptr, 8, bad) == INVALID_PARAMS, field
        assert mc.batch_put_from([k("bad")], [ptr], [8], bad) == [INVALID_PARAMS], field
        assert mc.put_parts(k("bad"), b"x", config=bad) == INVALID_PARAMS, field
    dfs = ReplicateConfig()
    dfs.dfs_replica_num = 1
    assert mc.put(k("bad"), b"x", dfs) == mooncake.DFS_SERVICE_UNAVAILABLE
    groups = ReplicateConfig()
    groups.group_ids = ["g1"]
    assert mc.put_batch([k("g1"), k("g2")], [b"a", b"b"], groups) == INVALID_PARAMS, "one group id per key"
    assert mc.is_exist(k("bad")) == 0 and mc.is_exist(k("g1")) == 0
    two = ReplicateConfig()
    two.replica_num = 2
    assert mc.put(k("two"), b"x", two) == 0, "replica counts are accepted (one copy kept)"
    with pytest.raises(TypeError):
        mc.put(k("x"), b"x", {"replica_num": 1})
    mc.batch_remove([key, k("two")])


def test_pins_and_leases(mc, k):
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert mc.put(k("pinned"), b"x" * 100, cfg) == 0
    assert mc.remove(k("pinned")) == OBJECT_HAS_LEASE
    assert mc.remove(k("pinned"), force=True) == 0


# ---- setup, hostname, lifecycle ------------------------------------------------------------------


def test_protocol_rdma_reads_over_the_ucx_plane_where_it_can(owner, monkeypatch, k):
    """protocol="rdma" asks for the owner's UCX plane on RDMA transports: this owner serves its
    plane over tcp only (conftest.UCX_ARGS), so the client says why and reads over TCP, with the
    same bytes."""
    monkeypatch.setenv("KVTIDE_TOKEN_FILE", owner.token_file)
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "rdma", "", owner.tcp) == 0
    assert s._store.data_plane == "socket"
    if kvtide.ucx_version() is not None:
        # Without an RDMA NIC here: "UCX found no device for the transports ..."; with one: the
        # tcp-only plane cannot be reached over RDMA.
        assert s._store.ucx_refusal, "the client says why it is not on the plane"
    value = bytes(range(256)) * 1000
    assert s.put(k("rdma"), value) == 0
    assert s.get(k("rdma")) == value
    assert s.close() == 0


def test_setup_forms_sizes_and_hostname(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
    s = MooncakeDistributedStore()
    assert s.setup(*setup_args("embedded")) == 0
    host, _, port = s.get_hostname().partition(":")
    assert host == "localhost" and 12300 <= int(port) <= 14300, "a port is reserved, as Mooncake's client does"
    other = MooncakeDistributedStore()
    assert other.setup(*setup_args("embedded")) == 0
    assert other.get_hostname() != s.get_hostname(), "two clients on a host never share a name"
    other.close()
    assert s.setup("node7:4242", "meta", 16 << 20, 16 << 20, "tcp", "", "embedded") == 0
    assert s.get_hostname() == "node7:4242", "a given port is kept"
    s.close()
    assert s.get_hostname() == ""

    def config(**kw):
        return dict({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                     "master_server_addr": "embedded"}, **kw)

    for ok in (config(global_segment_size="16MB", local_buffer_size="16 MB"), config(global_segment_size=32 << 20),
               config(local_buffer_size="1.5k", enable_ssd_offload="false")):
        assert s.setup(ok) == 0, ok
        assert s.put("k", b"v") == 0 and s.get("k") == b"v"
    assert s.setup(config=config()) == 0, "the dict by keyword, as Mooncake's overload"
    for bad in (config(global_segment_size="50%"), config(local_buffer_size="lots"), config(global_segment_size=100),
                config(client_http_port="x"), {"local_hostname": "h"}, config(metadata_server="")):
        assert s.setup(bad) != 0, bad
    s.close()
    with pytest.raises(TypeError):
        s.setup("host", "meta")
    with pytest.raises(TypeError):
        s.setup("h", "meta", "16MB", 16 << 20, "tcp", "", "embedded")
    with pytest.raises(TypeError):
        s.setup("h", "meta", -1, 16 << 20, "tcp", "", "embedded")
    assert s.setup("", "meta", 16 << 20, 16 << 20, "tcp", "", "embedded") == INVALID_PARAMS
    assert s.setup("h", "meta", 16 << 20, 16 << 20, "tcp", "", "unix:/nonexistent/kvtide.sock") == mooncake.RPC_FAIL


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
    assert s.get_hostname() == ""
    assert s.alloc_from_mem_pool(64) == 0
    assert s.get_into_ranges([1], [["k"]], [[[0]]], [[[0]]], [[[1]]]) == [[[INVALID_PARAMS]]]
    assert s.put_tensor_from("k", 1, 400) == INVALID_PARAMS
    assert s.batch_put_tensor_from(["k"], [1], [400]) == [INVALID_PARAMS]
    assert s.batch_get_tensor_with_tp_into(["k"], [1], [1], tp_size=2) == [None]
    assert s.close() == 0
    assert s.init_all("tcp", "", 16 << 20) == 0 and s.init_all("tcp", "", 16 << 20) == INVALID_PARAMS
    assert s.get_hostname() == "localhost:12345"
    s.close()


def test_setup_embedded_with_ssd(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
    monkeypatch.setenv("KVTIDE_SSD_BYTES", "128MiB")  # KVTIDE_* settings apply to the embedded store
    s = MooncakeDistributedStore()
    assert s.setup("h", "meta", 32 << 20, 0, "tcp", "", "embedded", None, True, str(tmp_path / "ssd")) == 0
    assert s.health_check() == 0
    assert s.put_parts("durable", b"kept") == INVALID_PARAMS, "no local buffer"
    src = np.frombuffer(b"kept", np.uint8).copy()
    assert s.put_from("durable", src.ctypes.data, 4) == 0
    assert s.close() == 0
    t = MooncakeDistributedStore()
    assert t.setup("h", "meta", 32 << 20, 0, "tcp", "", "embedded", None, True, str(tmp_path / "ssd")) == 0
    assert t.get("durable") == b"kept", "a clean close writes DRAM to the SSD tier"
    t.close()


def test_each_close_and_setup_is_a_fresh_embedded_store(embedded):
    """Mooncake's teardown drops the client's segment: an embedded store goes with the client."""
    assert embedded.put("k", b"v") == 0
    assert embedded.close() == 0
    assert embedded.setup(*setup_args("embedded")) == 0
    assert embedded.get("k") == b""


# ---- removal ---------------------------------------------------------------------------------------


def test_remove_all_and_by_regex(mc, k):
    for name in ["r/1", "r/2", "s/1", "s/22"]:
        assert mc.put(k(name), name.encode()) == 0
    assert mc.remove_by_regex("^" + re.escape(k("s/")) + r"\d$") == 1
    assert mc.is_exist(k("s/1")) == 0 and mc.is_exist(k("s/22")) == 1
    assert mc.remove_by_regex("(") == INVALID_PARAMS
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert mc.put(k("pinned"), b"p", cfg) == 0
    assert mc.remove_all() >= 3
    assert mc.is_exist(k("pinned")) == 1, "pinned objects are skipped without force"
    assert mc.remove_all(force=True) >= 1
    assert mc.is_exist(k("pinned")) == 0


def test_removes_by_pattern_page_through_the_keys(mc, k, monkeypatch):
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
        deadline = time.monotonic() + 1.0
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


def test_error_codes_map_every_exception():
    assert mooncake.error_code(kvtide.NotFound("x")) == OBJECT_NOT_FOUND
    assert mooncake.error_code(kvtide.SizeMismatch("x")) == INVALID_PARAMS
    assert mooncake.error_code(kvtide.Timeout("x")) == mooncake.RPC_TIMEOUT
    assert mooncake.error_code(kvtide.StreamCapturing("x")) == mooncake.TRANSFER_FAIL
    assert mooncake.error_code(kvtide.InternalError("x")) == mooncake.INTERNAL_ERROR


# ---- client memory: alloc_from_mem_pool, BufferPool ---------------------------------------------


def test_alloc_from_mem_pool_is_the_dummy_clients_and_bounded(owner, monkeypatch):
    monkeypatch.setenv("KVTIDE_TOKEN_FILE", owner.token_file)
    real = MooncakeDistributedStore()
    assert real.setup(*setup_args(owner.unix)) == 0
    assert real.alloc_from_mem_pool(4096) == 0, "a real client has no memory pool (Mooncake returns 0)"
    real.close()
    s = MooncakeDistributedStore()
    assert s.setup_dummy(64 << 10, 16 << 20, owner.tcp) == 0
    assert s.get_hostname() == "", "Mooncake's dummy client has no hostname"
    p = s.alloc_from_mem_pool(32 << 10)
    q = s.alloc_from_mem_pool(32 << 10)
    assert p and q and p != q
    assert s.alloc_from_mem_pool(1) == 0, "mem_pool_size is the bound"
    assert s.alloc_from_mem_pool(0) == 0
    ctypes.memmove(p, b"0123456789", 10)
    assert s.put_from("pool/k", p, 10) == 0
    # Pool memory is client memory: it bounds get_into_ranges without a registration.
    assert s.get_into_ranges([q], [["pool/k"]], [[[0]]], [[[2]]], [[[4]]]) == [[[4]]]
    assert ctypes.string_at(q, 4) == b"2345"
    assert s.get_into_ranges([q + (32 << 10) - 2], [["pool/k"]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]
    s.remove("pool/k")
    with pytest.raises(TypeError):
        s.alloc_from_mem_pool(-1)
    s.close()
    assert s.alloc_from_mem_pool(16) == 0


def test_buffer_pool_leases_local_buffer_then_overflow(embedded, k):
    pool = BufferPool(embedded, min_size_class=4096, alignment=4096)
    lease = pool.acquire(1234)
    assert lease.size == 1234 and lease.ptr % 64 == 0
    lease.buffer[:4] = b"abcd"
    assert bytes(lease.buffer[:4]) == b"abcd"
    assert ctypes.string_at(lease.ptr, 4) == b"abcd"
    # A lease is registered memory: a destination of get_into_ranges and a source of put_from.
    assert embedded.put_from(k("lease"), lease.ptr, 4) == 0 and embedded.get(k("lease")) == b"abcd"
    assert embedded.get_into_ranges([lease.ptr + 8], [[k("lease")]], [[[0]]], [[[1]]], [[[3]]]) == [[[3]]]
    assert bytes(lease.buffer[8:11]) == b"bcd"
    lease.release()
    lease.release()  # idempotent
    with pytest.raises(RuntimeError):
        lease.buffer
    big = pool.acquire(16 << 20)  # the whole local buffer
    spill = pool.acquire(1024, block=False)  # room in the pool's bound, none in the local buffer
    assert spill.size == 1024 and pool.stats()["overflow_count"] == 1
    assert embedded.register_buffer(spill.ptr, 1) == 0, "overflow regions are registered with the store"
    spill.release()
    big.release()
    assert pool.stats()["leases"] == 0 and pool.stats()["bytes"] == 0
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_buffer_pool_bounds_and_waits(embedded):
    pool = BufferPool(embedded, min_size_class=4096, max_size_class=4096, alignment=4096, max_regions=1,
                      block_on_exhaustion=False)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    lease.release()
    pool.close()

    pool = BufferPool(embedded, min_size_class=4096, alignment=4096, max_regions=1)
    first = pool.acquire(1)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(1, timeout=10.0)))
    t.start()
    first.release()
    t.join(timeout=20)
    assert not t.is_alive() and got[0].size == 1, "a blocked acquire takes the released room"
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(1, timeout=0.05)
    with pytest.raises(RuntimeError, match="non-negative"):
        pool.acquire(1, timeout=-1)
    got[0].release()
    with pytest.raises(RuntimeError, match="capacity"):
        pool.acquire((1 << 64) - 1)
    for size in (0, 1, 128 * 1024 + 1):
        with pool.acquire(size) as lease:
            assert lease.size == size and len(lease.buffer) == size
    pool.close()


def test_buffer_pool_views_keep_their_lease(embedded):
    pool = BufferPool(embedded, 4096, min_size_class=4096, alignment=4096)
    lease = pool.acquire(4)
    view = lease.buffer
    view[:] = b"test"
    with pytest.raises(RuntimeError, match="exported views"):
        lease.release()
    del view
    gc.collect()
    lease.release()
    # A view outliving its dropped lease keeps the region leased (never handed out again).
    lease = pool.acquire(8)
    view = lease.buffer
    del lease
    gc.collect()
    assert pool.stats()["leases"] == 1
    del view
    gc.collect()
    assert pool.stats()["leases"] == 0
    pool.close()


def test_buffer_pool_refuses_what_mooncake_refuses(monkeypatch, embedded):
    with pytest.raises(RuntimeError, match="alignment"):
        BufferPool(embedded, 1 << 20, alignment=12345)
    with pytest.raises(RuntimeError, match="positive"):
        BufferPool(embedded, min_size_class=0)
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(MooncakeDistributedStore())
    with pytest.raises(RuntimeError):
        BufferPool(object())
    monkeypatch.setenv("KVTIDE_RUNTIME_PIN_THREADS", "false")
    no_local = MooncakeDistributedStore()
    assert no_local.setup(*setup_args("embedded", local=0)) == 0
    with pytest.raises(RuntimeError, match="local buffer"):
        BufferPool(no_local)
    no_local.close()


# ---- tensors, in Mooncake's object layout -------------------------------------------------------


def test_tensor_objects_use_mooncakes_layout(embedded, k):
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert embedded.put_tensor(k("t"), t) == 0
    raw = embedded.get(k("t"))
    assert len(raw) == 304 + 48 and mooncake._tensor_metadata_size() == 304
    magic, version, header_size, dtype, ndim, kind, _, offset, nbytes = struct.unpack_from("<IHHiiIIQQ", raw)
    assert (magic, version, header_size, dtype, ndim, kind, offset, nbytes) == (0x4D4F4F4E, 1, 304, 0, 2, 0, 304, 48)
    assert struct.unpack_from("<8q", raw, 40) == (3, 4, -1, -1, -1, -1, -1, -1), "global shape"
    assert struct.unpack_from("<8q", raw, 104) == (3, 4, -1, -1, -1, -1, -1, -1), "local shape"
    assert raw[304:] == t.numpy().tobytes()
    meta, ptr, n, owner = mooncake._serialize_tensor(t)
    assert meta == raw[:304] and ptr == t.data_ptr() and n == 48 and owner is not None
    assert torch.equal(mooncake._deserialize_tensor(raw), t)
    with pytest.raises(ValueError):
        mooncake._deserialize_tensor(raw[:-1])
    with pytest.raises(ValueError):
        mooncake._serialize_tensor(torch.zeros(2, dtype=torch.complex64))
    # An object written by hand in Mooncake's layout reads back.
    hand = struct.pack("<IHHiiIIQQ", 0x4D4F4F4E, 1, 304, 6, 1, 0, 0, 304, 8) + struct.pack(
        "<8q8qII", 2, *[-1] * 7, 2, *[-1] * 7, 0, 0) + bytes(128) + struct.pack("<2i", 7, -8)
    assert embedded.put(k("hand"), hand) == 0
    got = embedded.get_tensor(k("hand"))
    assert got.dtype == torch.int32 and got.tolist() == [7, -8]
    embedded.batch_remove([k("t"), k("hand")])


def test_tensor_round_trips_and_batches(mc, k):
    torch = pytest.importorskip("torch")
    tensors = [torch.tensor([1.0, 2.0], dtype=torch.float32), torch.tensor([1, 2, 3], dtype=torch.int32),
               torch.tensor([True, False]), torch.randn(4, 3).to(torch.bfloat16), torch.empty((2, 0, 3)),
               torch.arange(6, dtype=torch.int64).reshape(2, 3).t()]  # non-contiguous: stored contiguous
    keys = [k(f"t{i}") for i in range(len(tensors))]
    for key, t in zip(keys, tensors):
        assert mc.put_tensor(key, t) == 0
        got = mc.get_tensor(key)
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape) and torch.equal(got, t)
    assert mc.get_tensor(k("absent")) is None
    assert mc.put_tensor(k("bad"), np.zeros(3)) == INVALID_PARAMS
    assert mc.put_tensor(k("bad"), torch.zeros(2, dtype=torch.complex64)) == INVALID_PARAMS
    assert mc.put_tensor(k("bad"), torch.zeros([1] * 9)) == INVALID_PARAMS, "at most 8 dims"
    new = [torch.arange(8, dtype=torch.float32), torch.arange(12, dtype=torch.int32)]
    assert mc.batch_upsert_tensor(keys[:2], new) == [0, 0]
    assert all(torch.equal(g, t) for g, t in zip(mc.batch_get_tensor(keys[:2]), new))
    assert mc.batch_upsert_tensor(keys[:2], new[:1]) == [INVALID_PARAMS] * 2
    assert mc.batch_upsert_tensor([], []) == []
    assert mc.batch_put_tensor([k("bp1"), k("bp2")], [new[0], "not a tensor"]) == [0, INVALID_PARAMS]
    assert mc.upsert_tensor(keys[0], tensors[0]) == 0 and torch.equal(mc.get_tensor(keys[0]), tensors[0])
    mc.batch_remove(keys + [k("bp1")])


def test_tensors_from_and_into_caller_memory(mc, k):
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert mc.put_tensor(k("src"), t) == 0
    size = mc.get_size(k("src"))
    area = (ctypes.c_ubyte * 8192)()
    ptr = ctypes.addressof(area)
    view = mc.get_tensor_into(k("src"), ptr, 8192)
    assert torch.equal(view, t)
    view[0, 0] = 99.0  # a view of the caller's buffer
    assert struct.unpack_from("<f", bytes(area[304:308]))[0] == 99.0
    assert mc.get_tensor_into(k("src"), ptr, 100) is None and mc.get_tensor_into(k("src"), 0, 8192) is None
    assert mc.put_tensor_from(k("from"), ptr, size) == 0
    assert mc.get_tensor(k("from"))[0, 0].item() == 99.0
    assert mc.upsert_tensor_from(k("from"), ptr, size) == 0
    assert mc.put_tensor_from(k("bad"), ptr, size - 1) == INVALID_PARAMS, "sizes must agree with the metadata"
    assert mc.put_tensor_from(k("bad"), ptr, 100) == INVALID_PARAMS, "shorter than the metadata"
    assert mc.put_tensor_from(k("bad"), 0, size) == INVALID_PARAMS
    junk = (ctypes.c_ubyte * 400)()
    assert mc.put_tensor_from(k("bad"), ctypes.addressof(junk), 400) == INVALID_PARAMS, "no metadata"
    assert mc.is_exist(k("bad")) == 0
    keys = [k("b1"), k("b2")]
    assert mc.batch_put_tensor_from(keys, [ptr, ptr], [size, size]) == [0, 0]
    assert mc.batch_upsert_tensor_from(keys, [ptr, ptr], [size, size]) == [0, 0]
    assert mc.batch_put_tensor_from(keys, [ptr, ctypes.addressof(junk)], [size, 400]) == [INVALID_PARAMS] * 2, \
        "one bad buffer fails the batch, as Mooncake checks all first"
    assert mc.batch_put_tensor_from(keys, [ptr], [size]) == [INVALID_PARAMS] * 2
    assert mc.batch_put_tensor_from([], [], []) == []
    got = mc.batch_get_tensor_into(keys + [k("absent")], [ptr, ptr + 4096, ptr], [4096, 4096, 4096])
    assert torch.equal(got[0], got[1]) and got[2] is None
    assert mc.batch_get_tensor_into(keys, [ptr], [4096]) == [INVALID_PARAMS] * 2
    assert mc.batch_get_tensor_into(keys, [ptr, 0], [4096, 4096]) == [INVALID_PARAMS] * 2
    mc.batch_remove([k("src"), k("from")] + keys)


def test_tensor_parallel_shards(mc, k):
    torch = pytest.importorskip("torch")
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert mc.put_tensor_with_tp(k("tp"), t, tp_size=2, split_dim=1) == 0
    for rank, part in enumerate(torch.chunk(t, 2, dim=1)):
        assert torch.equal(mc.get_tensor_with_tp(k("tp"), tp_rank=rank, tp_size=2), part)
    raw = mc.get(k("tp_tp_1"))
    assert struct.unpack_from("<I", raw, 16)[0] == 1, "a SHARD object"
    assert struct.unpack_from("<2q", raw, 40) == (4, 6) and struct.unpack_from("<2q", raw, 104) == (4, 3)
    # One axis: count, reserved; kind TP, index 0, rank 1 of 2, split dim 1, reserved, local extent 3.
    assert struct.unpack_from("<II6iq", raw, 168) == (1, 0, 1, 0, 1, 2, 1, 0, 3)
    assert mc.put_tensor_with_tp(k("uneven"), t, tp_size=4, split_dim=1) == INVALID_PARAMS, "only even splits"
    assert mc.put_tensor_with_tp(k("uneven"), t, tp_size=2, split_dim=2) == INVALID_PARAMS
    assert mc.is_exist(k("uneven_tp_0")) == 0
    assert torch.equal(mc.get_tensor_with_tp(k("tp_tp_0")), torch.chunk(t, 2, dim=1)[0]), "tp_size 1: the key itself"
    assert mc.batch_put_tensor_with_tp([k("b1"), k("b2")], [t, None], tp_size=2) == [0, INVALID_PARAMS]
    assert [x.shape for x in mc.batch_get_tensor_with_tp([k("b1")], tp_rank=1, tp_size=2)] == [(2, 6)]

    # From and into caller memory.
    area = (ctypes.c_ubyte * 8192)()
    ptr = ctypes.addressof(area)
    assert mc.put_tensor(k("full"), t) == 0
    size = mc.get_into(k("full"), ptr, 8192)
    assert mc.put_tensor_with_tp_from(k("f"), ptr, size, tp_size=2, split_dim=0) == 0
    got = mc.get_tensor_with_tp_into(k("f"), ptr + 4096, 4096, tp_rank=1, tp_size=2)
    assert torch.equal(got, t[2:])
    assert mc.put_tensor_with_tp_from(k("f1"), ptr, size) == 0 and torch.equal(mc.get_tensor(k("f1")), t)
    assert mc.put_tensor_with_tp_from(k("bad"), ptr, 100, tp_size=2) == INVALID_PARAMS
    assert mc.put_tensor_with_tp_from(k("bad"), 0, size, tp_size=2) == INVALID_PARAMS
    junk = (ctypes.c_ubyte * 400)()
    res = mc.batch_put_tensor_with_tp_from([k("g1"), k("g2")], [ptr, ctypes.addressof(junk)], [size, 400], tp_size=2)
    assert res == [0, INVALID_PARAMS], "per key"
    assert mc.batch_put_tensor_with_tp_from([k("g1")], [ptr], [size, size], tp_size=2) == [INVALID_PARAMS]
    into = mc.batch_get_tensor_with_tp_into([k("g1"), k("f")], [ptr + 4096, ptr + 6144], [2048, 2048], tp_rank=0,
                                            tp_size=2)
    assert torch.equal(into[0], t[:2]) and torch.equal(into[1], t[:2])
    mc.remove_by_regex("^" + re.escape(k("")))


def test_pub_tensors_and_safetensors(mc, k, tmp_path):
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32)
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert mc.pub_tensor(k("p"), t, cfg) == 0 and torch.equal(mc.get_tensor(k("p")), t)
    assert mc.upsert_pub_tensor(k("p"), t + 1) == 0 and torch.equal(mc.get_tensor(k("p")), t + 1)
    cfg.preferred_segments = ["only-one"]
    assert mc.pub_tensor(k("q"), t, cfg) == INVALID_PARAMS, "preferred_segments one per replica"
    assert mc.batch_pub_tensor([k("q")], [t], cfg) == [INVALID_PARAMS]
    assert mc.batch_pub_tensor([k("q1"), k("q2")], [t, t]) == [0, 0]
    assert mc.batch_upsert_pub_tensor([k("q1")], [t + 2]) == [0] and torch.equal(mc.get_tensor(k("q1")), t + 2)
    assert mc.pub_tensor_with_tp(k("ptp"), t.reshape(2, 3), tp_size=2) == 0
    assert mc.batch_pub_tensor_with_tp([k("bptp")], [t.reshape(2, 3)], tp_size=2) == [0]
    assert torch.equal(mc.get_tensor_with_tp(k("bptp"), tp_rank=1, tp_size=2), t.reshape(2, 3)[1:])
    pytest.importorskip("safetensors")
    path = str(tmp_path / "t.safetensors")
    assert mc.save_tensor_to_safetensor(k("p"), path) == 0
    assert mc.save_tensor_to_safetensor(k("absent"), path + "2") == mooncake.FILE_NOT_FOUND
    loaded = mc.load_tensor_from_safetensor(k("copy"), path)
    assert torch.equal(loaded, t + 1) and torch.equal(mc.get_tensor(k("copy")), t + 1)
    assert mc.load_tensor_from_safetensor(k("x"), str(tmp_path / "missing")) is None
    mc.remove_by_regex("^" + re.escape(k("")))


def test_a_value_that_is_not_a_tensor_object_reads_as_none(embedded, k):
    """Stored bytes are outside input: every field of the metadata is checked (Mooncake's
    ValidateTensorMetadata), and a bad one gives None, never an exception or a wrong tensor."""
    torch = pytest.importorskip("torch")
    assert embedded.put_tensor(k("good"), torch.arange(2, dtype=torch.int32)) == 0
    good = embedded.get(k("good"))
    assert embedded.get_tensor(k("good")) is not None

    def patched(offset, fmt, value):
        raw = bytearray(good)
        struct.pack_into(fmt, raw, offset, value)
        return bytes(raw)

    bad = {
        "magic": patched(0, "<I", 0x4B565454),
        "version": patched(4, "<H", 2),
        "header size": patched(6, "<H", 305),
        "dtype": patched(8, "<i", 15),
        "ndim": patched(12, "<i", 9),
        "layout kind": patched(16, "<I", 2),
        "data offset": patched(24, "<Q", 303),
        "data bytes": patched(32, "<Q", 4),
        "negative dim": patched(104, "<q", -2),
        "shape and bytes disagree": patched(104, "<q", 3),
        "dim past ndim": patched(112, "<q", 5),
        "axis count": patched(168, "<I", 5),
        "truncated": good[:300],
        "short body": good[:-1],
    }
    for name, raw in bad.items():
        assert embedded.put(k("bad/" + name), raw) == 0
        assert embedded.get_tensor(k("bad/" + name)) is None, name
        area = (ctypes.c_ubyte * 1024)()
        assert embedded.get_tensor_into(k("bad/" + name), ctypes.addressof(area), 1024) is None, name
