"""kvtide.connect_cluster against a real etcd and two kvtide-owner processes on loopback, and
Mooncake's setup with an etcd:// address. Skipped without an etcd binary, except under CI."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import kvtide
from conftest import free_port, owner_binary
from kvtide.mooncake import MooncakeDistributedStore


def _etcd():
    path = shutil.which("etcd")
    if path is None:
        assert not os.environ.get("CI"), "etcd is required under CI (Debian package etcd-server)"
        pytest.skip("no etcd binary on PATH (apt install etcd-server)")
    return path


@pytest.fixture(scope="module")
def cluster():
    etcd_bin = _etcd()
    root = Path(tempfile.mkdtemp(prefix="kvtide-py-cluster-"))
    client, peer = free_port(), free_port()
    curl, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    etcd = subprocess.Popen(
        [etcd_bin, "--name", "t", "--data-dir", str(root / "etcd"), "--listen-client-urls", curl,
         "--advertise-client-urls", curl, "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
         "--initial-cluster", f"t={purl}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"etcd://127.0.0.1:{client}"
    token = root / "token"
    token.write_text("c" * 64)
    token.chmod(0o600)
    env = dict(os.environ, KVTIDE_LOG="warn", KVTIDE_RUNTIME_PIN_THREADS="false")
    env.pop("KVTIDE_OWNER_BIN", None)
    owners = []
    try:
        # An owner refuses to start while etcd does not answer: wait for etcd first.
        etcd_deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()
                break
            except OSError:
                assert etcd.poll() is None, "etcd exited at start"
                assert time.time() < etcd_deadline, "etcd did not start listening"
                time.sleep(0.05)
        for oid in ("a", "b"):
            owners.append(subprocess.Popen(
                [owner_binary(), "--data-dir", str(root / oid), "--tcp", f"127.0.0.1:{free_port()}", "--token-file",
                 str(token), "--dram-bytes", "64MiB", "--no-ssd", "--shards", "1", "--cluster", endpoint,
                 "--cluster-name", "py", "--cluster-id", oid, "--cluster-lease-ttl-s", "2"],
                env=env, stdout=subprocess.DEVNULL, stderr=open(root / f"owner-{oid}.log", "wb")))
        deadline = time.time() + 60
        while True:
            try:
                store = kvtide.connect_cluster(endpoint, "py", token_file=str(token))
                if len(store.cluster_info()["members"]) == 2:
                    store.close()
                    break
                store.close()
            except kvtide.KvtideError:
                pass
            assert time.time() < deadline, "the cluster did not come up"
            for oid, o in zip("ab", owners):
                # The owner's own words say why (a port taken meanwhile, etcd not up yet, ...).
                assert o.poll() is None, f"owner {oid} exited: {(root / f'owner-{oid}.log').read_text()[-2000:]}"
            time.sleep(0.1)
        yield endpoint, str(token)
    finally:
        for o in owners:
            o.terminate()
            o.wait()
        etcd.kill()
        etcd.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_connect_cluster_serves_every_call_and_spreads_keys(cluster, shared_memory):
    endpoint, token = cluster
    tag = "shm" if shared_memory else "tcp"
    store = kvtide.connect_cluster(endpoint, "py", token_file=token, shared_memory=shared_memory, replication=2)
    info = store.cluster_info()
    assert sorted(m["id"] for m in info["members"]) == ["a", "b"]
    keys = [f"{tag}/{i}" for i in range(40)]
    for i, key in enumerate(keys):
        store.put(key, bytes([i]) * (100 + i))
    assert store.get(keys[3]) == bytes([3]) * 103
    results = store.batch_exists(keys + [f"{tag}/missing"])
    assert results == [True] * 40 + [False]
    assert store.prefix_hits(keys) == 40
    store.remove(keys[10])
    assert store.prefix_hits(keys) == 10
    with pytest.raises(kvtide.NotFound):
        store.get(keys[10])
    with pytest.raises(kvtide.AlreadyExists):
        store.put(keys[0], b"other")
    store.put(keys[0], b"other", upsert=True)
    assert store.get(keys[0]) == b"other"
    # Replication 2 on 2 owners: every owner holds every key.
    stats = store.stats()
    assert stats["total"]["objects"] >= 2 * 39
    routing = store.cluster_info()["routing"]
    assert routing["member_requests"] > 0 and routing["members"] == 2
    with pytest.raises(kvtide.InvalidArgument, match="cluster store"):
        store.prepare_gpu(0)
    store.close()


def test_bad_cluster_arguments_raise_clear_errors(cluster):
    endpoint, token = cluster
    with pytest.raises(kvtide.InvalidArgument, match="no owner is registered"):
        kvtide.connect_cluster(endpoint, "no-such-cluster", token_file=token)
    with pytest.raises(kvtide.InvalidArgument, match="etcd://"):
        kvtide.connect_cluster("127.0.0.1:2379", "py")
    with pytest.raises(kvtide.InvalidArgument, match="replication"):
        kvtide.connect_cluster(endpoint, "py", replication=0)
    with pytest.raises(kvtide.Disconnected, match="unreachable"):
        kvtide.connect_cluster(f"etcd://127.0.0.1:{free_port()}", "py")
    with pytest.raises(kvtide.InvalidArgument, match="not a cluster store"):
        kvtide.Store(dram_bytes="16MiB", shards=1, pin_threads=False).cluster_info()


def test_mooncake_setup_takes_an_etcd_cluster_address(cluster, monkeypatch):
    endpoint, token = cluster
    monkeypatch.setenv("KVTIDE_TOKEN_FILE", token)
    store = MooncakeDistributedStore()
    assert store.setup("host", endpoint, 16 << 20, 16 << 20, "tcp", "", endpoint + "/py") == 0
    assert store.put("mc/key", b"value") == 0
    assert store.get("mc/key") == b"value"
    assert store.is_exist("mc/key") == 1
    assert store.remove("mc/key") == 0
    assert store.get("mc/key") == b""
    store.close()
