"""Other processes: a client killed while it holds leases and an unsealed put leaves nothing
behind in the owner; settings reach the embedded engine from keywords, files and variables."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import kvtide
from conftest import wait_idle

CHILD = textwrap.dedent(
    """
    import sys, time, numpy as np, kvtide
    store = kvtide.connect(sys.argv[1])
    key = sys.argv[2]
    put = store.progressive_put(key, 8 << 20, 1 << 20)
    put.put_chunk(0, np.ones(1 << 20, np.uint8))
    dst = np.zeros(8 << 20, np.uint8)
    follow = store.progressive_get_unsealed(key, dst, 1 << 20)
    follow.wait_chunk(0)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_killed_client_leaves_nothing_held(owner, kind):
    address = owner.unix if kind == "unix" else owner.tcp
    env = dict(os.environ)
    if kind == "tcp":
        env["KVTIDE_TOKEN_FILE"] = owner.token_file
    child = subprocess.Popen([sys.executable, "-c", CHILD, address, f"crash/{kind}"], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        store = owner.connect(kind)
        held = store.held_resources()
        assert held["unsealed_bytes"] > 0, f"the child's unsealed put is held: {held}"
        child.send_signal(signal.SIGKILL)
        child.wait()
        held = wait_idle(store)
        assert all(v == 0 for v in held.values()), f"held after the client was killed: {held}"
        assert not store.exists(f"crash/{kind}"), "an unsealed put never becomes visible"
        store.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_settings_from_keywords_files_and_variables(tmp_path, monkeypatch):
    with pytest.raises(kvtide.InvalidArgument, match="unknown setting"):
        kvtide.Store(dram_bytez="64MiB")
    with pytest.raises(kvtide.InvalidArgument, match="ambiguous"):
        kvtide.Store(staging_bytes="1MiB")
    with pytest.raises(kvtide.InvalidArgument, match="could not open"):
        kvtide.Store(dram_bytes="lots")
    config = tmp_path / "kvtide.toml"
    config.write_text('[dram]\nbytes = "48MiB"\n[runtime]\nshards = 3\npin_threads = false\n')
    with kvtide.Store(str(config)) as s:
        assert len(s.stats()["shards"]) == 3
    monkeypatch.setenv("KVTIDE_RUNTIME_SHARDS", "1")
    with kvtide.Store(str(config), env=True, max_key_bytes=16) as s:
        assert len(s.stats()["shards"]) == 1
        with pytest.raises(kvtide.TooLarge):
            s.put("k" * 17, b"x")
    with kvtide.Store(dram_bytes=32 << 20, runtime_shards=2, pin_threads=False, ssd_dir=tmp_path / "ssd",
                      ssd_bytes="64MiB", write_through=True) as s:
        s.put("durable", b"on disk before the put returned")
        assert s.stats()["total"]["ssd_write_bytes"] > 0
    with kvtide.Store(dram_bytes=32 << 20, shards=2, pin_threads=False, ssd_dir=str(tmp_path / "ssd"),
                      ssd_bytes="64MiB") as s:
        assert s.get("durable") == b"on disk before the put returned"
    s.close()
    with pytest.raises(kvtide.ShuttingDown):
        s.get("durable")


def test_connect_takes_every_client_option(owner, k):
    """Each ``kvtide.connect`` keyword reaches the client; held_resources lists every gauge."""
    store = owner.connect(
        "unix", timeout_ms=5_000, connect_timeout_ms=2_000, shared_memory=False, max_idle_connections=2,
        max_tickets_in_flight=8, max_stream_handles=4, max_stream_host_bytes=1 << 20, spin_us=0,
        gpu_staging=True)
    try:
        assert not store.uses_shared_memory
        store.put(k("opt"), b"v")
        assert store.get(k("opt")) == b"v"
        held = store.held_resources()
        assert set(held) >= {"leases", "tickets_in_flight", "stream_handles", "stream_bound_keys_pinned"}
        assert all(v == 0 for v in held.values()), held
    finally:
        store.close()
    with pytest.raises(TypeError):
        owner.connect("unix", max_stream_host_bytez=1)
