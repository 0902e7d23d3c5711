"""One batch read of SSD-resident objects: through a kvtide-owner over TCP (one `batch_get_into`
from Python, the owner's streamed `Get`) and, as the same-run baseline, embedded (the engine's
restore pipeline in this process).

Each sample fills a store (1536 x 16 KiB by default, 256 MiB DRAM, 2 shards), shuts it down
cleanly (everything goes to SSD), reopens it (all SSD-resident), times one batch_get_into of
every key, checks the bytes, then times the same read again (now DRAM-resident).

usage: python3 ssd_batch_get.py OWNER_BINARY [OWNER_BINARY...] [--samples N] [--objects N]
       [--value-bytes N]
Needs the kvtide Python package; data goes to a temporary directory that is removed.
"""
import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import kvtide
from owner_process import OwnerProcess

PORT = 7399


def fill(store, keys, size):
    for i in range(0, len(keys), 128):
        vals = [np.full(size, (i + j) % 251, np.uint8) for j in range(len(keys[i:i + 128]))]
        assert all(kvtide.ok(r) for r in store.batch_put_from(keys[i:i + 128], vals))


def timed_reads(store, keys, size):
    out = [np.zeros(size, np.uint8) for _ in keys]
    t = time.perf_counter()
    got = store.batch_get_into(keys, out)
    first = (time.perf_counter() - t) * 1e3
    assert got == [size] * len(keys), [g for g in got if g != size][:3]
    assert all(out[i][0] == i % 251 and out[i][-1] == i % 251 for i in range(len(keys)))
    t = time.perf_counter()
    store.batch_get_into(keys, out)
    return first, (time.perf_counter() - t) * 1e3


def owner_samples(binary, keys, size, samples, data):
    def start():
        owner = OwnerProcess(binary, data, ["--dram-bytes", "256MiB", "--ssd-bytes", "1GiB",
                                            "--tcp", f"127.0.0.1:{PORT}", "--shards", "2"])
        return owner, owner.connect(f"127.0.0.1:{PORT}")

    def stop(owner, store):
        store.close()
        owner.stop()

    owner, store = start()
    fill(store, keys, size)
    stop(owner, store)
    for _ in range(samples):
        owner, store = start()
        yield timed_reads(store, keys, size)
        stop(owner, store)


def embedded_samples(keys, size, samples, data):
    settings = dict(dram_bytes="256MiB", ssd_bytes="1GiB", ssd_dir=data, runtime_shards=2)
    s = kvtide.Store(**settings)
    fill(s, keys, size)
    s.close()
    for _ in range(samples):
        s = kvtide.Store(**settings)
        yield timed_reads(s, keys, size)
        s.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("owners", nargs="+")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--objects", type=int, default=1536)
    ap.add_argument("--value-bytes", type=int, default=16 << 10)
    args = ap.parse_args()
    keys = [f"blk-{i}" for i in range(args.objects)]
    systems = [(f"owner over TCP ({os.path.basename(b)})", lambda d, b=b: owner_samples(b, keys, args.value_bytes,
                                                                                         args.samples, d))
               for b in args.owners]
    systems.append(("embedded", lambda d: embedded_samples(keys, args.value_bytes, args.samples, d)))
    print(f"{args.objects} x {args.value_bytes} B, one batch_get_into: SSD-resident ms / again (DRAM) ms")
    for name, samples in systems:
        data = tempfile.mkdtemp(prefix="kvtide-ssdbatch-")
        os.chmod(data, 0o700)
        try:
            figures = [f"{a:.1f} / {b:.1f}" for a, b in samples(data)]
        finally:
            shutil.rmtree(data, ignore_errors=True)
        print(f"{name}: " + ", ".join(figures))


if __name__ == "__main__":
    main()
