"""Owner start to ready: the time from spawning kvtide-owner to the first 200 on its `/ready`
(store open and recovered, sockets listening, SSD tier writable), with the default settings
(DRAM and SSD tier sized from this host's memory and free disk) on a fresh data directory, and
again on the same directory (a restart: the SSD tier's recovery included). Each start is stopped
with SIGTERM before the next. Prints one JSON line per case with every run and the median.

    python3 python/bench/owner_ready.py --owner-bin target/release/kvtide-owner [--runs 5]

Only the data directory and the two TCP ports are given (the default ports may be taken on a
shared host); nothing else is set.
"""

import argparse
import json
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_ready(binary, data):
    """Seconds from spawn to the first 200 on /ready; the owner is stopped afterwards."""
    http = free_port()
    args = [binary, "--data-dir", data, "--tcp", f"127.0.0.1:{free_port()}", "--http-addr", f"127.0.0.1:{http}"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    started = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                with opener.open(f"http://127.0.0.1:{http}/ready", timeout=10) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - started
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None:
                raise SystemExit(f"{binary} exited ({proc.returncode}) before it was ready")
            time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--owner-bin", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp", help="data directories go under this one")
    args = parser.parse_args()
    cases = {"fresh data directory": [], "restart (SSD recovery)": []}
    for _ in range(args.runs):
        data = tempfile.mkdtemp(prefix="kvtide-ready-", dir=args.dir)
        try:
            cases["fresh data directory"].append(start_to_ready(args.owner_bin, data))
            cases["restart (SSD recovery)"].append(start_to_ready(args.owner_bin, data))
        finally:
            shutil.rmtree(data, ignore_errors=True)
    for case, runs in cases.items():
        ms = [round(r * 1000, 1) for r in runs]
        print(json.dumps({"case": case, "median_ms": round(statistics.median(runs) * 1000, 1), "runs_ms": ms}))


if __name__ == "__main__":
    main()
