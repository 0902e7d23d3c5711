"""A step of paged KV read into a GPU through kvtide's three read forms, against one raw pinned
copy of the same bytes, with the host time of the calls and the store's phase counters.

The shape is the 1B Llama of `ttft.py` at 32k tokens by default: 16 layers of 512 pages, one
object per (layer, page) holding K then V (64 KiB each), read into a per-layer paged cache
[2, pages, 64 KiB] through a shuffled block table (2 fragments per object, 1 GiB in all). Forms,
each on one CUDA stream, timed from the first call to the stream drained (median of `--reps`
after one warm-up):
- `layerwise`: one `get_into_ranges_on_stream` per layer;
- `step`: one `step_ranges_on_stream` of every layer;
- `batch`: one blocking `get_into_ranges` of every layer.
`host` is the time the calls took to return. `call_us` is the store's `stream_bound_call_us`
over the form's calls (checking and leasing, waiting for the grants, planning, enqueueing).
Every read's per-fragment results are checked, and pages of the first and last layer byte for
byte. Stores: 4 shards with GPU staging (the default stream-bound units and 128 MiB units), 1
shard, and 4 shards without staging.

usage (GPU machine, the kvtide wheel): python3 python/bench/paged_reads.py [--layers 16]
    [--pages 512] [--half-bytes 65536] [--reps 5] [--stores 0,1,2,3]
"""
import argparse
import json
import time

import torch

import kvtide

MiB = 1 << 20
STORES = [dict(shards=4), dict(shards=4, gpu_stream_unit_bytes="128MiB"), dict(shards=1),
          dict(shards=4, gpu_staging=False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--half-bytes", type=int, default=64 * 1024, help="K (or V) of one page")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stores", type=lambda v: [int(i) for i in v.split(",")],
                    default=list(range(len(STORES))), help="which of the stores (indices, comma-separated)")
    args = ap.parse_args()
    L, P, half = args.layers, args.pages, args.half_bytes
    obj = 2 * half
    total = L * P * obj
    dev = torch.device("cuda")
    block_of = torch.randperm(P, generator=torch.Generator().manual_seed(1)).tolist()
    host = torch.randint(0, 255, (L, P, obj), dtype=torch.uint8).pin_memory()
    dst = torch.zeros((L, 2, P, half), dtype=torch.uint8, device=dev)
    keys = [[f"paged/L{l}/p{p}" for p in range(P)] for l in range(L)]
    frags = [[f for p in range(P) for f in ((keys[l][p], 0, block_of[p] * half, half),
                                            (keys[l][p], half, (P + block_of[p]) * half, half))]
             for l in range(L)]
    stream = torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name()}: {L} layers x {P} pages, objects of {obj} bytes, "
          f"{total / MiB:.0f} MiB", flush=True)

    def timed(fn):
        times, hosts = [], []
        for _ in range(args.reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hosts.append(fn())
            stream.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times[1:])[args.reps // 2], sorted(hosts[1:])[args.reps // 2]

    def raw():
        with torch.cuda.stream(stream):
            dst.view(-1).copy_(host.view(-1), non_blocking=True)
        return 0.0

    def landed():
        return all(torch.equal(dst[l, 0, block_of[p]].cpu(), host[l, p, :half])
                   and torch.equal(dst[l, 1, block_of[p]].cpu(), host[l, p, half:])
                   for l in (0, L - 1) for p in (0, P // 2, P - 1))

    def report(name, ms, host_ms, extra=""):
        print(f"{name}: {ms:.2f} ms ({total / ms / 1e6:.1f} GB/s) host {host_ms:.2f} ms {extra}", flush=True)

    report("raw one copy", *timed(raw))
    for settings in [STORES[i] for i in args.stores]:
        store = kvtide.Store(dram_bytes=total + 512 * MiB, pin_threads=False,
                             **{"gpu_staging": True, **settings})
        for l in range(L):
            base = host[l].data_ptr()
            res = store.batch_put_from_multi_buffers(keys[l], [[(base + p * obj, obj)] for p in range(P)],
                                                     upsert=True)
            assert all(kvtide.ok(r) for r in res), res[:3]

        def whole(results):
            assert results is not None and all(r == half for r in results), (results or [])[:4]

        def layerwise():
            t0 = time.perf_counter()
            tickets = [store.get_into_ranges_on_stream([dst[l]], [frags[l]], stream) for l in range(L)]
            spent = (time.perf_counter() - t0) * 1e3
            for t in tickets:
                whole(t.wait(60_000))
            return spent

        def step():
            t0 = time.perf_counter()
            ticket = store.step_ranges_on_stream([([dst[l]], [frags[l]]) for l in range(L)], stream)
            spent = (time.perf_counter() - t0) * 1e3
            whole(ticket.wait(60_000))
            return spent

        def batch():
            t0 = time.perf_counter()
            for results in store.get_into_ranges([dst[l] for l in range(L)], frags):
                whole(results)
            return (time.perf_counter() - t0) * 1e3

        for name, fn in (("layerwise", layerwise), ("step", step), ("batch", batch)):
            dst.zero_()
            before = store.stats()["gpu"]["stream_bound_call_us"]
            ms, host_ms = timed(fn)
            after = store.stats()["gpu"]["stream_bound_call_us"]
            call_us = [b - a for a, b in zip(before, after)]
            report(f"{json.dumps(settings)} {name}", ms, host_ms, f"landed={landed()} call_us={call_us}")
        report("raw one copy", *timed(raw))
        store.close()


if __name__ == "__main__":
    main()
