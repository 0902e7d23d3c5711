"""A kvtide-owner process for the benchmarks in this folder: started on a data directory,
connected to once it listens, stopped with SIGTERM (a clean shutdown)."""
import os
import signal
import subprocess
import time
from pathlib import Path

import kvtide

REPO = Path(__file__).resolve().parents[2]


def default_owner_binary():
    """(path, where) of the owner to run when none is given: $KVTIDE_OWNER_BIN, else the one the
    installed kvtide wheel carries, else this checkout's target/release, else target/debug; None
    when there is none."""
    if os.environ.get("KVTIDE_OWNER_BIN"):
        return os.environ["KVTIDE_OWNER_BIN"], "KVTIDE_OWNER_BIN"
    try:
        from kvtide._owner import bundled_binary
    except ImportError:  # an older installed kvtide, without the console command
        bundled_binary = None
    if bundled_binary and bundled_binary():
        return bundled_binary(), "wheel"
    for kind in ("release", "debug"):
        path = REPO / "target" / kind / "kvtide-owner"
        if path.exists():
            return str(path), kind
    return None


class OwnerProcess:
    """`binary` serving `data` (mode 0700) with `args` (flags after `--data-dir`)."""

    def __init__(self, binary, data, args, env=None):
        self.binary, self.data = binary, data
        self.proc = subprocess.Popen([binary, "--data-dir", data, *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def connect(self, address):
        """A client of `address` (a socket path, "unix:PATH" or host:port; TCP uses the owner's
        token), once the owner listens there (20 s at most)."""
        token = os.path.join(self.data, "token")
        for _ in range(400):
            try:
                if ":" in address and not address.startswith(("/", "unix:")):
                    return kvtide.connect(address, token_file=token)
                return kvtide.connect(address)
            except Exception:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.proc.kill()
        raise SystemExit(f"{self.binary} did not start")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
