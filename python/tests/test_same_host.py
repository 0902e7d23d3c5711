"""Same-host paths through a real kvtide-owner process: reads through its read index (no request)
and puts the owner reads straight from this process's memory (one copy), reached from
``kvtide.connect`` and the Mooncake class alike, with the bytes checked and the paths counted."""

import numpy as np
import pytest

from kvtide.mooncake import MooncakeDistributedStore

N, SIZE = 16, 64 << 10


def values(seed):
    return [((np.arange(SIZE) * 7 + seed * 13 + i) % 251).astype(np.uint8) for i in range(N)]


def round_trip(store, prefix, seed):
    keys = [f"{prefix}/{i}" for i in range(N)]
    vals = values(seed)
    assert all(r is None for r in store.batch_put_from(keys, vals, upsert=True))
    dsts = [np.zeros(SIZE, np.uint8) for _ in range(N)]
    assert store.batch_get_into(keys, dsts) == [SIZE] * N
    for got, want in zip(dsts, vals):
        assert np.array_equal(got, want)
    one = np.zeros(SIZE, np.uint8)
    assert store.get_into(keys[0], one) == SIZE and np.array_equal(one, vals[0])
    return keys


def test_connect_reads_through_the_index_and_puts_from_its_memory(owner, k):
    store = owner.connect("unix")
    try:
        assert store.same_host_counts() == {"index_reads": 0, "index_misses": 0, "direct_put_bytes": 0}
        keys = round_trip(store, k("fast"), 1)
        counts = store.same_host_counts()
        assert counts["direct_put_bytes"] == N * SIZE, counts
        assert counts["index_reads"] == N + 1, counts
        # An upsert between reads: the index serves the new bytes, never the old ones.
        newer = np.full(SIZE, 9, np.uint8)
        store.put_from(keys[3], newer, upsert=True)
        dst = np.zeros(SIZE, np.uint8)
        assert store.get_into(keys[3], dst) == SIZE and np.array_equal(dst, newer)
        assert store.same_host_counts()["index_reads"] == N + 2
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["unix-off", "tcp"])
def test_the_same_bytes_without_the_same_host_paths(owner, k, kind):
    if kind == "tcp":
        store = owner.connect("tcp")
    else:
        store = owner.connect("unix", read_index=False, direct_puts=False)
    try:
        round_trip(store, k(kind), 2)
        assert store.same_host_counts() == {"index_reads": 0, "index_misses": 0, "direct_put_bytes": 0}
    finally:
        store.close()


def test_the_mooncake_class_gets_the_same_host_paths(owner, k):
    mc = MooncakeDistributedStore()
    assert mc.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", owner.unix) == 0
    try:
        vals = values(3)
        keys = [k(f"mc/{i}") for i in range(N)]
        assert mc.batch_put_from(keys, [v.ctypes.data for v in vals], [SIZE] * N) == [0] * N
        dsts = [np.zeros(SIZE, np.uint8) for _ in range(N)]
        assert mc.batch_get_into(keys, [d.ctypes.data for d in dsts], [SIZE] * N) == [SIZE] * N
        assert all(np.array_equal(d, v) for d, v in zip(dsts, vals))
        counts = mc._store.same_host_counts()
        assert counts["index_reads"] >= N and counts["direct_put_bytes"] >= N * SIZE, counts
    finally:
        assert mc.close() == 0
