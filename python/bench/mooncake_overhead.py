"""What the Mooncake drop-in class costs over kvtide.Store, in the same run.

4 KiB values: ``put`` (a new key each call), ``get`` (bytes back), ``put_from`` and ``get_into``
(raw pointers, Mooncake's zero-copy calls), on one store, embedded and through a kvtide-owner
this script starts (Unix socket with shared memory, and TCP), through:

- ``kvtide.Store`` itself;
- the least any Python wrapper costs: a function with a try around the Store call (the floor
  for a class that turns exceptions into return codes);
- ``kvtide.mooncake.MooncakeDistributedStore``;
- with ``--before FILE``, the class from another revision's mooncake.py too
  (``git show REV:python/kvtide/mooncake.py > /tmp/before.py``).

Calls are interleaved one by one between the sides, the order rotated each call, so drift and
other load hit all alike; each side's best round median is reported, with every round's median.
Prints one JSON line per (store, call) and a Markdown table.

    python3 python/bench/mooncake_overhead.py [--owner-bin PATH] [--before FILE]
        [--calls 3000] [--rounds 5]

Without --owner-bin it takes target/release/kvtide-owner, else target/debug (and says which).
"""

import argparse
import ctypes
import importlib.util
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "python" / "bench"))

from kvtide.mooncake import MooncakeDistributedStore  # noqa: E402
from owner_process import OwnerProcess, default_owner_binary  # noqa: E402

VALUE = 4096


def owner_binary(given):
    if given:
        return given, "given"
    found = default_owner_binary()
    if found is None:
        raise SystemExit("no kvtide-owner built; pass --owner-bin")
    return found


class Owner:
    """A kvtide-owner (DRAM only) on a temporary directory, on a Unix socket and on TCP."""

    def __init__(self, binary):
        self.dir = Path(tempfile.mkdtemp(prefix="kvtide-bench-owner-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.tcp = f"127.0.0.1:{port}"
        self.unix = f"unix:{self.dir / 'owner.sock'}"
        self.token_file = str(self.dir / "token")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIDE_")}
        env.update(KVTIDE_LOG="warn")
        self.process = OwnerProcess(binary, str(self.dir), ["--tcp", self.tcp, "--dram-bytes", "1GiB", "--shards",
                                                            "2", "--no-ssd"], env=env)
        self.process.connect(self.unix).close()

    def stop(self):
        self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def timed_rotating(sides):
    """Per-call medians (us) of each (fn, argument tuples) side, calls interleaved one by one and
    the order rotated each step (each side goes first as often as the others)."""
    times = [[] for _ in sides]
    clock = time.perf_counter
    n = len(sides)
    for i in range(min(len(args) for _, args in sides)):
        for j in range(n):
            k = (i + j) % n
            fn, args = sides[k]
            start = clock()
            fn(*args[i])
            times[k].append((clock() - start) * 1e6)
    return [statistics.median(t) for t in times]


def floor_of(fn):
    """The least any Python wrapper costs: one frame, a try, the call, a return."""
    def wrapper(*args):
        try:
            fn(*args)
        except Exception:
            pass
        return 0
    return wrapper


def side_tag(side):
    # Keys of one length on every side: a longer key costs a little more everywhere.
    return {"kvtide": "kv", "floor": "fl", "mooncake": "mc", "before": "bf"}[side]


def sides_for(call, store, clients, tag, calls, value, src_ptr, dst_ptr):
    """{side: maker of (fn, per-call argument tuples) for round r}: fresh keys per round and
    side, so every put is of a new key."""
    def keys(side, r):
        return [f"{tag}/{side_tag(side)}/{call}/{r}/{i}" for i in range(calls)]

    hot = f"{tag}/hot"
    if call == "put":
        kv = (store.put, lambda side, r: [(k, value) for k in keys(side, r)])
        mc = ("put", lambda side, r: [(k, value) for k in keys(side, r)])
    elif call == "get":
        kv = (store.get, lambda side, r: [(hot,)] * calls)
        mc = ("get", kv[1])
    elif call == "put_from":
        kv = (store.put_from, lambda side, r: [(k, (src_ptr, VALUE)) for k in keys(side, r)])
        mc = ("put_from", lambda side, r: [(k, src_ptr, VALUE) for k in keys(side, r)])
    else:
        kv = (store.get_into, lambda side, r: [(hot, (dst_ptr, VALUE))] * calls)
        mc = ("get_into", lambda side, r: [(hot, dst_ptr, VALUE)] * calls)
    out = {"kvtide": lambda r: (kv[0], kv[1]("kvtide", r)),
           "floor": lambda r: (floor_of(kv[0]), kv[1]("floor", r))}
    for name, client in clients.items():
        out[name] = (lambda client, name: lambda r: (getattr(client, mc[0]), mc[1](name, r)))(client, name)
    return out


def run(name, clients, calls, rounds):
    store = clients["mooncake"]._store  # every side hits the same kvtide.Store
    tag = f"bench/{name}"
    value = bytes(range(256)) * (VALUE // 256)
    src = (ctypes.c_ubyte * VALUE).from_buffer_copy(value)
    dst = (ctypes.c_ubyte * VALUE)()
    store.put(f"{tag}/hot", value, upsert=True)
    rows = []
    for call in ("put", "get", "put_from", "get_into"):
        makers = sides_for(call, store, clients, tag, calls, value, ctypes.addressof(src), ctypes.addressof(dst))
        medians = {side: [] for side in makers}
        for r in range(rounds):
            sides = {side: make(r) for side, make in makers.items()}
            for fn, args in sides.values():
                fn(*args[0])  # warm (the first put of a round's prefix)
            got = timed_rotating([(fn, args[1:]) for fn, args in sides.values()])
            for side, m in zip(sides, got):
                medians[side].append(m)
            if call.startswith("put"):
                for side in sides:  # keep the store's size bounded: drop this round's puts
                    store.batch_remove([f"{tag}/{side_tag(side)}/{call}/{r}/{i}" for i in range(calls)])
        best = {side: min(m) for side, m in medians.items()}
        row = {"store": name, "call": call, "value_bytes": VALUE, "calls_per_round": calls,
               **{f"{side}_us": round(b, 2) for side, b in best.items()},
               "overhead_us": round(best["mooncake"] - best["kvtide"], 2),
               "rounds": {side: [round(x, 2) for x in m] for side, m in medians.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def load_before(path):
    spec = importlib.util.spec_from_file_location("kvtide_mooncake_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MooncakeDistributedStore


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--owner-bin")
    p.add_argument("--before", help="a mooncake.py of another revision, measured alongside")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    binary, kind = owner_binary(a.owner_bin)
    print(f"# kvtide-owner: {binary} ({kind} build)", flush=True)
    os.environ.setdefault("KVTIDE_RUNTIME_PIN_THREADS", "false")
    os.environ.setdefault("KVTIDE_RUNTIME_SHARDS", "2")
    classes = {"mooncake": MooncakeDistributedStore}
    if a.before:
        classes["before"] = load_before(a.before)
    owner = Owner(binary)
    rows = []
    try:
        for name, address in (("embedded", "embedded"), ("owner-unix", owner.unix), ("owner-tcp", owner.tcp)):
            os.environ["KVTIDE_TOKEN_FILE"] = owner.token_file
            clients = {}
            for side, cls in classes.items():
                client = cls()
                assert client.setup("localhost", "P2PHANDSHAKE", 1 << 30, 64 << 20, "tcp", "", address) == 0
                clients[side] = client
            if "before" in clients:
                # Both classes on one store, so every side measures the same engine state.
                clients["before"]._store.close()
                clients["before"]._store = clients["mooncake"]._store
            rows += run(name, clients, a.calls, a.rounds)
            clients["mooncake"].close()
    finally:
        owner.stop()
    before = "before" in classes
    print("\n| store | call | kvtide.Store us | empty Python wrapper us | MooncakeDistributedStore us | "
          "drop-in - Store us |" + (" before us |" if before else ""))
    print("|---|---|---:|---:|---:|---:|" + ("---:|" if before else ""))
    for r in rows:
        print(f"| {r['store']} | {r['call']} | {r['kvtide_us']} | {r['floor_us']} | {r['mooncake_us']} "
              f"| {r['overhead_us']:+} |" + (f" {r['before_us']} |" if before else ""))


if __name__ == "__main__":
    main()
