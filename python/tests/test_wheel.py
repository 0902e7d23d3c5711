"""The installed wheel: `kvtide` is imported from the virtual environment the wheel was installed
into (not the checkout), and the wheel's `kvtide-owner` console command starts an owner that a
Python client reaches over its Unix socket and that SIGTERM stops cleanly.

python/tests/run.sh sets PYTEST_KVTIDE_VENV to the venv it installed the wheel into; there (and
under CI) these tests fail instead of skipping when the package is not that installed wheel.
Elsewhere (a checkout on PYTHONPATH) they are reported skipped."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvtide

REPO = Path(__file__).resolve().parents[2]
VENV = os.environ.get("PYTEST_KVTIDE_VENV")
PACKAGE = Path(kvtide.__file__).resolve().parent


def installed_or_skip():
    """Fails under run.sh or CI unless kvtide is an installed wheel; elsewhere skips."""
    problem = None
    if PACKAGE.is_relative_to(REPO):
        problem = f"kvtide is imported from the checkout ({PACKAGE}), not from an installed wheel"
    elif VENV and not PACKAGE.is_relative_to(Path(VENV).resolve()):
        problem = f"kvtide is imported from {PACKAGE}, not from the wheel's venv {VENV}"
    if problem is None:
        return
    if VENV or os.environ.get("CI"):
        pytest.fail(problem + " (run the tests with: bash python/tests/run.sh)")
    pytest.skip(problem + "; bash python/tests/run.sh tests the wheel")


def test_kvtide_is_the_installed_wheel():
    installed_or_skip()
    from kvtide import _owner

    assert _owner.bundled_binary() is not None, f"the wheel carries no owner binary under {PACKAGE}"
    assert os.access(_owner.bundled_binary(), os.X_OK)
    assert kvtide.cuda_built(), "the wheel is built with the CUDA transport (loaded at run time)"
    if VENV:
        assert Path(sys.prefix).resolve() == Path(VENV).resolve(), f"pytest runs in {sys.prefix}, not {VENV}"


def owner_command():
    installed_or_skip()
    # pip puts console commands beside the interpreter (a venv's bin/, whether or not it is
    # activated); PATH is the fallback. `pip install --target DIR` makes none.
    beside = Path(sys.executable).parent / "kvtide-owner"
    command = str(beside) if os.access(beside, os.X_OK) else shutil.which("kvtide-owner")
    if not command and not (VENV or os.environ.get("CI")):
        pytest.skip("no kvtide-owner console command beside this interpreter or on PATH (an install "
                    "without scripts, e.g. pip install --target)")
    assert command, "no kvtide-owner console command on PATH (the wheel's [project.scripts])"
    if VENV:
        assert Path(command).resolve().parent == (Path(VENV) / "bin").resolve(), f"{command} is not the venv's"
    return command


def test_kvtide_owner_help():
    r = subprocess.run([owner_command(), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--data-dir" in r.stdout and "--tcp" in r.stdout, r.stdout[:2000]


def test_kvtide_owner_console_command_serves_and_stops_on_sigterm(tmp_path):
    command = owner_command()
    data = tmp_path / "owner"
    socket_path = data / "owner.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIDE_")}
    env.update(KVTIDE_LOG="warn", KVTIDE_RUNTIME_PIN_THREADS="false")
    # An owner with the HTTP listener (default 127.0.0.1:7371) takes a free port instead, so this
    # owner never collides with another test's.
    usage = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60).stdout
    http = ["--http-addr", "127.0.0.1:0"] if "--http-addr" in usage else []
    proc = subprocess.Popen(
        [command, "--data-dir", str(data), "--unix", str(socket_path), "--tcp", "off", "--no-ssd",
         "--dram-bytes", "64MiB", "--shards", "2", *http],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        store = connect_when_listening(proc, f"unix:{socket_path}")
        from kvtide import _owner

        # The console script execs the owner: the process we started is the bundled binary itself.
        assert Path(f"/proc/{proc.pid}/exe").resolve() == Path(_owner.bundled_binary()).resolve()
        value = os.urandom(100_000)
        store.put("wheel/a", value)
        assert store.get("wheel/a") == value
        assert store.exists("wheel/a") and not store.exists("wheel/missing")
        store.close()
        # So SIGTERM reaches the owner, and the exit code is the owner's clean-stop code.
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"kvtide-owner exited {proc.returncode} on SIGTERM: {err[-2000:]}"
        assert not socket_path.exists(), "a clean stop removes the socket"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def connect_when_listening(proc, address, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return kvtide.connect(address)
        except kvtide.KvtideError:
            if proc.poll() is not None:
                _, err = proc.communicate()
                pytest.fail(f"kvtide-owner exited {proc.returncode} before listening: {err[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"kvtide-owner did not listen on {address} within {timeout_s} s")
            time.sleep(0.05)


def test_owner_command_without_a_bundled_binary_says_what_to_do(monkeypatch, tmp_path, capsys):
    """A package built without build_wheel.sh (no kvtide/bin/kvtide-owner): exit code 2 and the
    commands that build the owner, not a traceback."""
    from kvtide import _owner

    monkeypatch.setattr(_owner, "BUNDLED", tmp_path / "bin" / "kvtide-owner")
    assert _owner.bundled_binary() is None
    assert _owner.main() == 2
    assert "build_wheel.sh" in capsys.readouterr().err
