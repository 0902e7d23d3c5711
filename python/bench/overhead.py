"""Per-call overhead of the Python layer against the Rust API, in the same run.

The workload of `kvtide-bench py-call`: 128 x 64 KiB values in an embedded store, read in one
batch call into one buffer (a torch CPU tensor, or CUDA pages of one device tensor with
`--target cuda`), as `get_into_ranges` (one buffer, 128 fragments) and as
`batch_get_into_multi_buffers` (128 page views of the tensor). Prints one JSON line per case with
the Python and Rust per-call medians, the difference in microseconds and the ratio.

    python3 python/bench/overhead.py --bench-bin target/release/kvtide-bench [--target cuda]
"""

import argparse
import json
import statistics
import subprocess
import time

import kvtide


def python_case(target, form, keys, value_bytes, iters, shards, staged):
    import torch

    total = keys * value_bytes
    store = kvtide.Store(dram_bytes=max(total * 4, 256 << 20), shards=shards, gpu_staging=staged)
    names = [f"py-call/{i}" for i in range(keys)]
    for i, name in enumerate(names):
        store.put(name, torch.full((value_bytes,), i % 251, dtype=torch.uint8).numpy())
    device = "cuda" if target == "cuda" else "cpu"
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    if form == "ranges":
        fragments = [[(name, 0, i * value_bytes, value_bytes) for i, name in enumerate(names)]]

        def call():
            return store.get_into_ranges([buf], fragments)
    else:
        pages = [[buf[i * value_bytes:(i + 1) * value_bytes]] for i in range(keys)]

        def call():
            return store.batch_get_into_multi_buffers(names, pages)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        res = call()
    flat = [r for per in res for r in per] if form == "ranges" else res
    assert all(r == value_bytes for r in flat), flat[:4]
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    sync()
    store.close()
    return statistics.median(times), statistics.fmean(times)


def rust_case(bench, target, form, keys, value_bytes, iters, shards, staged):
    cmd = [bench, "py-call", "--target", target, "--form", form, "--keys", str(keys), "--value-bytes",
           str(value_bytes), "--iters", str(iters), "--shards", str(shards)]
    if staged:
        cmd.append("--staged")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = json.loads(out.strip().splitlines()[-1])
    return line["us_median"], line["us_mean"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench-bin", required=True)
    p.add_argument("--target", default="host", choices=["host", "cuda"])
    p.add_argument("--keys", type=int, default=128)
    p.add_argument("--value-bytes", type=int, default=64 << 10)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--staged", action="store_true")
    a = p.parse_args()
    for form in ["ranges", "multi"]:
        # Interleaved three times, so drift of a noisy machine hits both sides; the best median
        # of each side is reported.
        rust, py = [], []
        for _ in range(3):
            rust.append(rust_case(a.bench_bin, a.target, form, a.keys, a.value_bytes, a.iters, a.shards, a.staged))
            py.append(python_case(a.target, form, a.keys, a.value_bytes, a.iters, a.shards, a.staged))
        r = min(x[0] for x in rust)
        q = min(x[0] for x in py)
        print(json.dumps({"bench": "python-overhead", "target": a.target, "form": form, "keys": a.keys,
                          "value_bytes": a.value_bytes, "staged": a.staged, "rust_us_median": round(r, 2),
                          "python_us_median": round(q, 2), "added_us": round(q - r, 2),
                          "python_over_rust": round(q / r, 4)}))


if __name__ == "__main__":
    main()
