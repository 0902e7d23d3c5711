"""Runs Mooncake's own Python store tests, unchanged, against kvtide.mooncake.

    python3 python/tests/upstream/run_mooncake_tests.py /path/to/Mooncake [--owner-bin PATH]
        [--only SUBSTRING] [-k PYTEST_EXPR] [--keep] [--verbose]

It puts a shim package on ``sys.path`` in which ``mooncake.store`` is kvtide's class and types
(``from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction, ...``),
while Mooncake's pure-Python modules (``mooncake.structured_object_store``, ``buffer_pool``,
``mooncake_config``, ``async_store``) come from the checkout itself. The tests' master address
(``MASTER_SERVER``, ``MOONCAKE_MASTER``) is ``embedded`` (kvtide in the test process), except for
the modules that need several clients sharing one store, which get a kvtide-owner. Two owners
are started on the loopback addresses Mooncake's tests hard-code: 127.0.0.1:50051 (its master)
and 127.0.0.1:50052 (the real client a dummy client connects to).

Every test either passes or is listed, with the reason, in mooncake_expected.md next to this
file: a test outside that list that fails, or one in it that now passes, makes the exit status
non-zero. It is a developer tool: it needs a Mooncake checkout, which CI does not have
(python/tests/test_mooncake.py covers each behaviour for CI), a built kvtide-owner, and in this
Python pytest, numpy, torch and msgpack (Mooncake's structured_object_store imports it;
safetensors for its safetensor tests). The owners run without TCP auth, on loopback only.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

# Module -> where its store is. "embedded": MASTER_SERVER / MOONCAKE_MASTER = embedded (each
# client its own store, gone at close, as a Mooncake client's own segment is). "owner": those
# variables name the owner on 127.0.0.1:50051 (clients share one store). "pair": two processes
# run the script at once, `--client-id client1` and `client2`, as Mooncake's run_tests.sh does
# (its dummy clients meet in the owner on 127.0.0.1:50052).
MODULES = {
    "mooncake-wheel/tests/test_distributed_object_store.py": "embedded",
    "mooncake-wheel/tests/test_replicated_distributed_object_store.py": "owner",
    "mooncake-wheel/tests/test_put_get_tensor.py": "embedded",
    "mooncake-wheel/tests/test_dummy_client.py": "embedded",
    "mooncake-wheel/tests/test_multi_dummy_clients.py": "pair",
    "mooncake-wheel/tests/test_buffer_pool_native.py": "embedded",
    "mooncake-wheel/tests/test_structured_object_store.py": "embedded",
    "mooncake-wheel/tests/test_safetensor_functions.py": "embedded",
    "mooncake-wheel/tests/test_batch_replica_clear.py": "embedded",
    "mooncake-wheel/tests/test_distributed_object_store_cxl.py": "embedded",
    "mooncake-wheel/tests/test_import_structure.py": "embedded",
    "mooncake-wheel/tests/test_offload_on_eviction.py": "embedded",
    "mooncake-wheel/tests/test_promotion_on_hit.py": "embedded",
    "mooncake-wheel/tests/test_ssd_offload_in_evict.py": "embedded",
    "mooncake-wheel/tests/test_meta_server.py": "embedded",
    "mooncake-wheel/tests/test_mooncake_store_service_api.py": "embedded",
    "scripts/test_upsert_api.py": "embedded",
    "scripts/test_tensor_api.py": "embedded",
    "scripts/test_copy_move_api.py": "embedded",
    "scripts/test_async_store.py": "embedded",
    "scripts/test_drain_http_api.py": "embedded",
    "scripts/test_engram_store.py": "embedded",
}

SHIM_INIT = '''"""Shim: mooncake.store is kvtide.mooncake; the rest of the package is the checkout's."""
import os as _os
__path__ = [_os.path.dirname(__file__)] + [p for p in _os.environ["MOONCAKE_SHIM_PATH"].split(_os.pathsep) if p]
from mooncake.buffer_pool import BufferPool, RegisteredBufferPool  # noqa: E402,F401
'''

SHIM_STORE = '''"""Shim: Mooncake's store module, as kvtide.mooncake provides it."""
from kvtide.mooncake import *  # noqa: F401,F403
from kvtide.mooncake import (  # noqa: F401
    BufferHandle, BufferLease, BufferPool, MooncakeDistributedStore, ObjectDataType, RegisteredBufferLease,
    RegisteredBufferPool, ReplicateConfig, SoftPinAction, _deserialize_tensor, _serialize_tensor,
    _tensor_metadata_size,
)

# pybind11's export_values(): the enum members are module attributes too.
globals().update({m.name: m for m in ObjectDataType})
'''


def load_expected():
    """{module: {test id: reason}} from mooncake_expected.md (lines "- `module::test`: why")."""
    expected = {}
    text = (HERE / "mooncake_expected.md").read_text()
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("- `") or "`:" not in line:
            continue
        ident, _, why = line[3:].partition("`:")
        module, _, test = ident.partition("::")
        expected.setdefault(module, {})[test or "*"] = why.strip()
    return expected


def free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Owner:
    def __init__(self, binary, port, dram="4GiB"):
        self.dir = Path(tempfile.mkdtemp(prefix="kvtide-mooncake-owner-"))
        self.address = f"127.0.0.1:{port}"
        args = [binary, "--data-dir", str(self.dir), "--tcp", self.address, "--no-auth", "--dram-bytes", dram,
                "--shards", "2", "--no-ssd"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIDE_")}
        env.update(KVTIDE_LOG="warn", KVTIDE_RUNTIME_PIN_THREADS="false")
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL)
        deadline = time.time() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"kvtide-owner on {self.address} did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def owner_binary(given):
    if given:
        return given
    try:
        from kvtide._owner import bundled_binary  # the installed wheel's owner
    except ImportError:
        bundled_binary = None
    if bundled_binary and bundled_binary():
        return bundled_binary()
    for kind in ("release", "debug"):
        path = REPO / "target" / kind / "kvtide-owner"
        if path.exists():
            return str(path)
    raise SystemExit("no kvtide-owner: install the wheel, build it (cargo build -p kvtide-remote --bin kvtide-owner) "
                     "or pass --owner-bin")


def run_pair(path, env, args):
    """Both clients at once; each one's unittest exit status is its result."""
    procs = {cid: subprocess.Popen([sys.executable, str(path), "--client-id", cid], cwd=path.parent, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cid in ("client1", "client2")}
    results = {}
    for cid, proc in procs.items():
        out, _ = proc.communicate(timeout=args.timeout)
        if args.verbose:
            print(out)
        failed = proc.returncode != 0
        tail = " ".join(out.split())[-300:] if failed else ""
        results[f"TestMultiDummyClients::test_client_interaction[{cid}]"] = ("failed" if failed else "passed", tail)
    return results


def run_module(checkout, module, mode, shim, args, out_dir):
    path = checkout / module
    report = out_dir / (module.replace("/", "_") + ".xml")
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(shim), str(REPO / "python")] + [p for p in [env.get("PYTHONPATH")] if p]),
        MOONCAKE_SHIM_PATH=os.pathsep.join(
            [str(checkout / "mooncake-wheel" / "mooncake"), str(checkout / "mooncake-integration" / "store")]),
        MASTER_SERVER="embedded" if mode == "embedded" else "127.0.0.1:50051",
        MOONCAKE_MASTER="embedded" if mode == "embedded" else "127.0.0.1:50051",
        MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE",
        MC_METADATA_SERVER="P2PHANDSHAKE",
        # kvtide leases an object only while a read runs: nothing to wait out after a get.
        DEFAULT_KV_LEASE_TTL="1",
        PROTOCOL="tcp",
        # Mooncake's default segment sizes are GiBs; the embedded store maps its DRAM lazily.
        MOONCAKE_GLOBAL_SEGMENT_SIZE=env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE", str(512 << 20)),
        MOONCAKE_LOCAL_BUFFER_SIZE=env.get("MOONCAKE_LOCAL_BUFFER_SIZE", str(512 << 20)),
        KVTIDE_RUNTIME_PIN_THREADS="false",
        KVTIDE_RUNTIME_SHARDS="2",
    )
    env.pop("KVTIDE_TOKEN_FILE", None)
    if mode == "pair":
        started = time.time()
        return run_pair(path, env, args), time.time() - started
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           "--rootdir", str(path.parent), str(path)]
    if args.k:
        cmd += ["-k", args.k]
    started = time.time()
    proc = subprocess.run(cmd, cwd=path.parent, env=env, capture_output=not args.verbose, text=True,
                          timeout=args.timeout)
    elapsed = time.time() - started
    results = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            cls = case.get("classname", "")
            cls = "" if cls == path.stem else cls.removeprefix(path.stem + ".")
            name = f"{cls}::{case.get('name')}" if cls else case.get("name")
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, message = "failed", (child.get("message") or "").splitlines()[0:1]
                    message = message[0] if message else ""
                elif child.tag == "skipped":
                    outcome, message = "skipped", child.get("message") or ""
            results[name] = (outcome, message)
    if not results:
        tail = (proc.stdout or "")[-1500:] + (proc.stderr or "")[-1500:]
        results["<module>"] = ("failed", f"exit {proc.returncode}: " + " ".join(tail.split())[-300:])
    return results, elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkout", type=Path, help="a Mooncake checkout (its repository root)")
    p.add_argument("--owner-bin", help="kvtide-owner (default: the installed wheel's, else target/release, else target/debug)")
    p.add_argument("--only", help="run the modules whose path contains this")
    p.add_argument("-k", help="pytest -k expression")
    p.add_argument("--timeout", type=int, default=900, help="seconds per module")
    p.add_argument("--keep", action="store_true", help="keep the shim and reports")
    p.add_argument("--verbose", action="store_true", help="show pytest's output")
    args = p.parse_args()
    checkout = args.checkout.resolve()
    if not (checkout / "mooncake-wheel" / "tests").is_dir():
        raise SystemExit(f"{checkout} is not a Mooncake checkout (no mooncake-wheel/tests)")
    for port in (50051, 50052):
        if not free(port):
            raise SystemExit(f"127.0.0.1:{port} is in use: Mooncake's tests hard-code it for the owner")
    binary = owner_binary(args.owner_bin)
    work = Path(tempfile.mkdtemp(prefix="kvtide-mooncake-shim-"))
    (work / "mooncake").mkdir()
    (work / "mooncake" / "__init__.py").write_text(SHIM_INIT)
    (work / "mooncake" / "store.py").write_text(SHIM_STORE)
    expected = load_expected()
    owners = [Owner(binary, 50051), Owner(binary, 50052)]
    print(f"kvtide-owner: {binary}; shim: {work / 'mooncake'}")
    unexpected = []
    totals = {"passed": 0, "failed": 0, "skipped": 0, "expected": 0}
    try:
        for module, mode in MODULES.items():
            if args.only and args.only not in module:
                continue
            if not (checkout / module).exists():
                print(f"\n{module}: not in this checkout")
                continue
            results, elapsed = run_module(checkout, module, mode, work, args, work)
            known = expected.get(module, {})
            print(f"\n{module} ({mode}, {elapsed:.1f} s)")
            for name, (outcome, message) in sorted(results.items()):
                why = known.get(name) or known.get("*")
                if outcome == "failed" and why:
                    totals["expected"] += 1
                    print(f"  needs Mooncake  {name}: {why}")
                elif outcome == "failed":
                    totals["failed"] += 1
                    unexpected.append(f"{module}::{name}")
                    print(f"  FAILED          {name}: {message[:300]}")
                elif outcome == "passed" and why and name in known:
                    totals["passed"] += 1
                    unexpected.append(f"{module}::{name} (listed as needing Mooncake, but passes)")
                    print(f"  passes (listed) {name}")
                else:
                    totals[outcome] += 1
                    if outcome == "skipped" or args.verbose:
                        print(f"  {outcome:<15} {name}{': ' + message[:200] if message else ''}")
    finally:
        for o in owners:
            o.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\npassed {totals['passed']}, skipped {totals['skipped']}, need Mooncake-only infrastructure "
          f"{totals['expected']}, unexpected {len(unexpected)}")
    for u in unexpected:
        print(f"  unexpected: {u}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
