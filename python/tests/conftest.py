"""Fixtures: an embedded store, and a kvtide-owner process reached over its Unix socket (shared
memory) and over TCP (token). The owner binary is $KVTIDE_OWNER_BIN, else the one the installed
wheel carries (python/tests/run.sh), else the one cargo builds for this checkout
(`cargo build -p kvtide-remote --bin kvtide-owner`)."""

import ctypes
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import kvtide

REPO = Path(__file__).resolve().parents[2]


def owner_binary():
    path = os.environ.get("KVTIDE_OWNER_BIN")
    if path:
        return path
    try:
        from kvtide._owner import bundled_binary
    except ImportError:  # an older installed kvtide, without the console command
        bundled_binary = None
    if bundled_binary and bundled_binary():
        return bundled_binary()
    found = shutil.which("kvtide-owner")
    if found and os.environ.get("KVTIDE_OWNER_FROM_PATH"):
        return found
    subprocess.run(["cargo", "build", "-q", "-p", "kvtide-remote", "--bin", "kvtide-owner"], cwd=REPO, check=True)
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=REPO, check=True, capture_output=True
    )
    return str(Path(json.loads(meta.stdout)["target_directory"]) / "debug" / "kvtide-owner")


def cuda_devices():
    """GPUs the CUDA driver sees (0 without libcuda or a GPU), asked the way kvtide asks: through
    libcuda, loaded at run time."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Owner:
    """A kvtide-owner on a temporary data directory (DRAM only unless `ssd`)."""

    def __init__(self, dram="64MiB", ssd=None, extra=()):
        self.dir = Path(tempfile.mkdtemp(prefix="kvtide-py-owner-"))
        self.port = free_port()
        # Its own HTTP port: several owners run at once, and the default (7371) is one per host.
        self.http_port = free_port()
        args = [owner_binary(), "--data-dir", str(self.dir), "--tcp", f"127.0.0.1:{self.port}", "--dram-bytes", dram,
                "--shards", "2", "--http-addr", f"127.0.0.1:{self.http_port}", *extra]
        args += ["--ssd-bytes", ssd] if ssd else ["--no-ssd"]
        env = dict(os.environ, KVTIDE_LOG="warn", KVTIDE_RUNTIME_PIN_THREADS="false")
        # These two are this file's, not the owner's: it refuses KVTIDE_OWNER_* variables it does not know.
        env.pop("KVTIDE_OWNER_BIN", None)
        env.pop("KVTIDE_OWNER_FROM_PATH", None)
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL)
        self.unix = f"unix:{self.dir / 'owner.sock'}"
        self.tcp = f"127.0.0.1:{self.port}"
        self.token_file = str(self.dir / "token")
        self.http = f"http://127.0.0.1:{self.http_port}"
        deadline = time.time() + 60
        while True:
            try:
                kvtide.connect(self.unix).close()
                break
            except kvtide.KvtideError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"kvtide-owner did not start (exit {self.proc.poll()})")
                time.sleep(0.05)

    def connect(self, kind="unix", **kw):
        if kind == "unix":
            return kvtide.connect(self.unix, **kw)
        return kvtide.connect(self.tcp, token_file=self.token_file, **kw)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# The session's owner serves its UCX plane over UCX's tcp transport (loopback here), so every
# store test also runs with reads over UCX.
UCX_ARGS = ("--ucx", "tcp", "--ucx-allow-tcp", "true")


@pytest.fixture(scope="session")
def owner():
    o = Owner(extra=UCX_ARGS)
    yield o
    o.stop()


def ucx_store(owner):
    """A client of `owner` reading over its UCX plane (asserted); skipped where UCX is not
    installed, except under CI (which installs it)."""
    if kvtide.ucx_version() is None:
        assert not os.environ.get("CI"), "CI must have UCX (libucx0)"
        pytest.skip("UCX is not installed here")
    # UCX 1.13 aborts the plane's process when a tcp peer vanishes mid-get (a test that cancels or
    # closes a read in flight); the owner restarts it, and a client that lands meanwhile reads over
    # TCP. A new client is made until one attaches.
    deadline = time.time() + 15
    while True:
        s = owner.connect("tcp", ucx="tcp", ucx_allow_tcp=True)
        if s.data_plane == "ucx":
            return s
        s.close()
        assert time.time() < deadline, f"the client reads over {s.data_plane}, not the UCX plane"
        time.sleep(0.1)


def embedded_store(**kw):
    settings = dict(dram_bytes="64MiB", shards=2, pin_threads=False)
    settings.update(kw)
    return kvtide.Store(**settings)


@pytest.fixture(params=["embedded", "unix", "tcp", "ucx"])
def store(request, owner):
    """The same tests against the embedded engine and the owner over its transports (TCP with
    the UCX plane too). Each test's keys are its own (the owner is shared): use the `k` fixture."""
    if request.param == "embedded":
        s = embedded_store()
    elif request.param == "ucx":
        s = ucx_store(owner)
    else:
        s = owner.connect(request.param)
    yield s
    held = wait_idle(s)
    s.close()
    assert all(v == 0 for v in held.values()), f"resources still held after the test: {held}"


@pytest.fixture
def k(request):
    """A key maker unique to this test (and backend)."""
    prefix = request.node.name

    def make(name):
        return f"{prefix}/{name}"

    return make


def wait_idle(s, timeout=10.0):
    """held_resources once all are zero (or the last reading after `timeout`)."""
    deadline = time.time() + timeout
    while True:
        held = s.held_resources()
        if all(v == 0 for v in held.values()) or time.time() > deadline:
            return held
        time.sleep(0.02)
