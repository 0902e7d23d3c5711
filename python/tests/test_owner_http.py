"""The owner's HTTP listener from Python with urllib, against the real kvtide-owner: /health,
/ready, /version, /metrics (build, process and SSD tier metrics, moving with traffic), 404 and
405, and POST /drain (ready turns 503, new connections are refused, the process keeps running)."""

import json
import time
import urllib.error
import urllib.request

import pytest

import kvtide
from conftest import Owner


def http(method, url):
    """(status, body) of one request; error statuses are answers too."""
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    # No proxy from the environment: the owner is on loopback.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sample(text, name):
    """The value of the Prometheus sample `name` (labels included), or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def ssd_owner():
    o = Owner(ssd="128MiB")
    yield o
    o.stop()


def test_routes_answer_with_metrics_that_move(ssd_owner):
    base = ssd_owner.http
    assert http("GET", base + "/health") == (200, "alive\n")
    assert http("GET", base + "/ready") == (200, "ready\n")
    status, body = http("GET", base + "/version")
    version = json.loads(body)
    assert status == 200 and version["protocol_version"] == 2 and version["version"]
    assert version["git"] is None or isinstance(version["git"], str)

    store = ssd_owner.connect("unix")
    for i in range(8):
        store.put(f"http/{i}", b"x" * 4096)
    status, metrics = http("GET", base + "/metrics")
    assert status == 200
    build = f'kvtide_build_info{{version="{version["version"]}",git="{version["git"] or ""}"}}'
    assert sample(metrics, build) == 1
    assert sample(metrics, "kvtide_objects") == 8
    assert sample(metrics, "kvtide_ssd_capacity_bytes") == 128 << 20
    assert sample(metrics, "kvtide_ssd_free_bytes") + sample(metrics, "kvtide_ssd_used_bytes") == 128 << 20
    assert sample(metrics, "kvtide_ssd_write_failed") == 0
    assert sample(metrics, "process_resident_memory_bytes") > 1e6
    assert sample(metrics, "process_open_fds") > 3
    assert abs(sample(metrics, "process_start_time_seconds") - time.time()) < 300
    assert sample(metrics, "process_cpu_seconds_total") > 0
    store.close()

    assert http("GET", base + "/nope")[0] == 404
    assert http("POST", base + "/metrics")[0] == 405
    assert http("GET", base + "/drain")[0] == 405


def test_drain_refuses_new_connections_and_the_owner_keeps_running():
    owner = Owner()
    try:
        store = owner.connect("unix")
        store.put("drain/kept", b"v" * 1000)
        store.close()
        status, body = http("POST", owner.http + "/drain")
        assert (status, body.startswith("drained")) == (200, True), body
        status, body = http("GET", owner.http + "/ready")
        assert status == 503 and body.startswith("draining"), body
        with pytest.raises(kvtide.KvtideError):
            kvtide.connect(owner.unix)
        assert http("GET", owner.http + "/health")[0] == 200
        status, metrics = http("GET", owner.http + "/metrics")
        assert status == 200 and sample(metrics, "kvtide_objects") == 1
        assert owner.proc.poll() is None, "the owner keeps running after a drain"
        assert http("POST", owner.http + "/drain")[0] == 200
    finally:
        owner.stop()
