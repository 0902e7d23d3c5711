"""Store.hold, the read leases kvtide.vllm keeps from a lookup to its load, on the embedded
store and through an owner (Unix socket with shared memory, and TCP):
per-key results, partial and whole release, a held object surviving a flood and a forced-free
remove attempt, the TTL, close, and held_resources counting holds and back to zero."""

import time

import pytest

import kvtide
from conftest import embedded_store, wait_idle


@pytest.fixture(params=["embedded", "unix", "tcp"])
def holder(request, owner):
    s = embedded_store() if request.param == "embedded" else owner.connect(request.param)
    yield s
    held = wait_idle(s)
    s.close()
    assert all(v == 0 for v in held.values()), f"resources still held after the test: {held}"


def test_per_key_results_and_release(holder, k):
    holder.put(k("a"), b"a" * 100)
    holder.put(k("b"), b"b" * 50)
    h = holder.hold([k("a"), k("missing"), k("b"), b""], ttl_ms=30_000)
    r = h.results
    assert r[0] == 100 and r[2] == 50
    assert isinstance(r[1], kvtide.NotFound) and isinstance(r[3], kvtide.InvalidArgument)
    assert h.held() == [True, False, True, False] and h.active and len(h) == 4
    held = holder.held_resources()
    assert held["holds"] == 1 and held["held_keys"] == 2 and held["leases"] == 2
    # Held objects are not removed unless forced.
    with pytest.raises(kvtide.Leased):
        holder.remove(k("a"))
    assert h.release([k("b"), k("missing"), k("other")]) == 1
    assert h.held() == [True, False, False, False]
    assert holder.held_resources()["held_keys"] == 1
    assert h.release() == 1 and h.release() == 0
    assert not h.active and h.held() == [False] * 4
    holder.remove(k("a"))


def test_context_manager_and_ttl(holder, k):
    holder.put(k("a"), b"x")
    with holder.hold([k("a")], ttl_ms=30_000) as h:
        assert h.held() == [True]
    assert h.held() == [False]
    h = holder.hold([k("a")], ttl_ms=200)
    assert 0 < h.expires_in_ms <= 200
    time.sleep(0.3)
    assert h.held() == [False] and h.expires_in_ms == 0
    assert holder.held_resources()["holds"] == 0
    assert h.release() == 0
    for bad in (0, 10**8):
        with pytest.raises(kvtide.InvalidArgument, match="ttl_ms"):
            holder.hold([k("a")], ttl_ms=bad)


def test_close_ends_every_hold(owner, k):
    for s in (embedded_store(), owner.connect("unix")):
        s.put(k("a"), b"x")
        h = s.hold([k("a")], ttl_ms=30_000)
        s.close()
        assert h.held() == [False] and h.release() == 0
    probe = owner.connect("unix")
    assert wait_idle(probe)["leases"] == 0
    probe.close()


def test_a_held_object_survives_a_flood():
    s = kvtide.Store(dram_bytes="4MiB", shards=1, pin_threads=False)
    value = b"v" * (64 << 10)
    for i in range(8):
        s.put(f"keep/{i}", value)
    h = s.hold([f"keep/{i}" for i in range(4)], ttl_ms=30_000)
    for i in range(160):  # 10 MiB through 4 MiB of DRAM
        try:
            s.put(f"flood/{i}", value)
        except kvtide.KvtideError:
            pass
    present = s.batch_exists([f"keep/{i}" for i in range(8)])
    assert present[:4] == [True] * 4, "held objects stay"
    assert present[4:] == [False] * 4, "the flood evicted the others"
    assert s.get("keep/0") == value
    h.release()
    assert all(v == 0 for v in wait_idle(s).values())
    s.close()


def test_a_held_object_survives_another_clients_flood_over_tcp(k):
    """A TCP client cannot map the arena, yet its hold keeps objects in place as well."""
    from conftest import Owner

    o = Owner(dram="8MiB")
    try:
        s, flooder = o.connect("tcp"), o.connect("unix")
        value = b"v" * (256 << 10)
        keep = [k(f"keep/{i}") for i in range(8)]
        for key in keep:
            s.put(key, value)
        h = s.hold(keep[:4], ttl_ms=30_000)
        assert h.results == [len(value)] * 4
        for i in range(128):  # 32 MiB through 8 MiB of DRAM
            try:
                flooder.put(k(f"flood/{i}"), value)
            except kvtide.KvtideError:
                pass
        present = s.batch_exists(keep)
        assert present[:4] == [True] * 4, "held objects stay"
        assert present[4:] == [False] * 4, "the flood evicted the others"
        assert s.get(keep[0]) == value
        h.release()
        assert all(v == 0 for v in wait_idle(s).values())
        s.close()
        flooder.close()
    finally:
        o.stop()
