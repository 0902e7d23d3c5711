"""`batch_get_into` into buffers larger than the objects: one read of the batch, against the two
batched reads such a call needs without an at-most batch read (exact sizes first, which every
key fails with SizeMismatch, then the objects into the first bytes of their buffers), embedded
and through an owner over its Unix socket (shared memory) and TCP.

usage: python3 batch_get_into.py OWNER_BINARY [--keys 128] [--value-bytes 16384]
       [--buffer-bytes 20480] [--iters 300]
Prints the median time per call of each form, two rounds each, alternating.
"""
import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import kvtide
from owner_process import OwnerProcess


def bench(store, name, args):
    n, size = args.keys, args.value_bytes
    keys = [f"k{i}" for i in range(n)]
    assert all(kvtide.ok(r) for r in store.batch_put_from(keys, [np.full(size, i % 251, np.uint8) for i in range(n)],
                                                          upsert=True))
    bufs = [np.zeros(args.buffer_bytes, np.uint8) for _ in range(n)]

    def one_read():
        assert store.batch_get_into(keys, bufs) == [size] * n

    def two_reads():
        first = store.batch_get_into_multi_buffers(keys, [[b] for b in bufs])
        assert all(isinstance(r, kvtide.SizeMismatch) for r in first)
        assert store.batch_get_into_multi_buffers(keys, [[b[:size]] for b in bufs]) == [size] * n

    medians = {}
    for _ in range(2):
        for call, label in ((two_reads, "two reads"), (one_read, "batch_get_into")):
            for _ in range(20):
                call()
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            times.sort()
            medians.setdefault(label, []).append(times[len(times) // 2] * 1e6)
    assert all(b[0] == i % 251 and b[size - 1] == i % 251 for i, b in enumerate(bufs))
    for label, v in medians.items():
        print(f"{name}: {label}: p50 {' / '.join(f'{x:.0f}' for x in v)} us per call")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("owner")
    ap.add_argument("--keys", type=int, default=128)
    ap.add_argument("--value-bytes", type=int, default=16 << 10)
    ap.add_argument("--buffer-bytes", type=int, default=20 << 10)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    print(f"{args.keys} x {args.value_bytes} B objects into {args.buffer_bytes} B buffers")
    store = kvtide.Store(dram_bytes="256MiB", runtime_shards=2)
    bench(store, "embedded", args)
    store.close()
    data = tempfile.mkdtemp(prefix="kvtide-bgi-")
    os.chmod(data, 0o700)
    sock, port = os.path.join(data, "owner.sock"), 7398
    owner = OwnerProcess(args.owner, data, ["--dram-bytes", "256MiB", "--shards", "2", "--unix", sock,
                                            "--tcp", f"127.0.0.1:{port}"])
    try:
        unix = owner.connect(sock)
        bench(unix, "owner unix+shm", args)
        unix.close()
        tcp = owner.connect(f"127.0.0.1:{port}")
        bench(tcp, "owner tcp", args)
        tcp.close()
    finally:
        owner.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
