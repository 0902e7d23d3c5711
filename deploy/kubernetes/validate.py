#!/usr/bin/env python3
"""Checks the manifests in deploy/kubernetes/: each document against the Kubernetes schema of
the oldest version we support (strict: unknown fields are errors; kubernetes-validate bundles the
schemas, so this runs offline), then what the owner needs of them (one socket directory, probes
on /health and /ready, a grace that covers the stop budget, non-root).

    python3 -m pip install kubernetes-validate pyyaml
    python3 deploy/kubernetes/validate.py               # exit 1 on any error
    python3 deploy/kubernetes/validate.py --self-test   # broken copies must each be refused
"""

import copy
import pathlib
import sys

import kubernetes_validate
import yaml

HERE = pathlib.Path(__file__).resolve().parent
KUBERNETES_VERSION = "1.30.0"
SOCKET_DIR = "/run/kvtide"
HTTP_PORT = 7371
GRACE_SECONDS = 30  # the owner's stop budget (25 s) fits inside it
OWNER_UID = 10001


def documents():
    """(file name, document) for every YAML document under deploy/kubernetes/."""
    for path in sorted(HERE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path.name, doc


def schema_errors(doc):
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"schema: {e.message} at {'/'.join(str(p) for p in e.path)}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"schema: {e}"]
    return []


def pod_spec(doc):
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
        return doc["spec"]["template"]["spec"]
    return None


def mounts_socket_dir(spec, container):
    host_paths = {v["name"]: v.get("hostPath", {}).get("path") for v in spec.get("volumes", [])}
    return any(
        m["mountPath"] == SOCKET_DIR and host_paths.get(m["name"]) == SOCKET_DIR
        for m in container.get("volumeMounts", [])
    )


def probe_errors(owner):
    errors = []
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        get = owner.get(probe, {}).get("httpGet", {})
        port = get.get("port")
        ports = {p.get("name"): p["containerPort"] for p in owner.get("ports", [])}
        if get.get("path") != path or ports.get(port, port) != HTTP_PORT:
            errors.append(f"{probe} must ask {path} on port {HTTP_PORT}")
    return errors


def owner_errors(doc):
    """What the owner's DaemonSet must say."""
    spec = pod_spec(doc)
    errors = []
    if spec.get("terminationGracePeriodSeconds") != GRACE_SECONDS:
        errors.append(f"terminationGracePeriodSeconds must be {GRACE_SECONDS} (the stop budget is 25 s)")
    security = spec.get("securityContext", {})
    if not security.get("runAsNonRoot") or security.get("runAsUser") != OWNER_UID:
        errors.append(f"the owner runs as non-root uid {OWNER_UID}")
    owners = [c for c in spec["containers"] if c["name"] == "owner"]
    if len(owners) != 1:
        return errors + ["one container named owner"]
    errors += probe_errors(owners[0])
    if not mounts_socket_dir(spec, owners[0]):
        errors.append(f"the owner mounts the host directory {SOCKET_DIR} at {SOCKET_DIR}")
    return errors


def worker_errors(doc):
    """A pod that uses the owner: mounts the socket directory and is in the socket's group."""
    spec = pod_spec(doc)
    errors = []
    if OWNER_UID not in spec.get("securityContext", {}).get("supplementalGroups", []):
        errors.append(f"a worker is in the socket's group {OWNER_UID} (supplementalGroups)")
    for c in spec["containers"]:
        if not mounts_socket_dir(spec, c):
            errors.append(f"container {c['name']} mounts {SOCKET_DIR}")
        address = {e["name"]: e.get("value") for e in c.get("env", [])}.get("KVTIDE_ADDRESS")
        if address != f"unix:{SOCKET_DIR}/owner.sock":
            errors.append(f"container {c['name']} sets KVTIDE_ADDRESS=unix:{SOCKET_DIR}/owner.sock")
    return errors


def errors_of(doc):
    errors = schema_errors(doc)
    if doc.get("kind") == "DaemonSet" and doc["metadata"]["name"] == "kvtide-owner":
        errors += owner_errors(doc)
    elif pod_spec(doc) is not None:
        errors += worker_errors(doc)
    return errors


def check_all():
    kinds = set()
    failed = 0
    for name, doc in documents():
        kinds.add(doc.get("kind"))
        errors = errors_of(doc)
        label = f"{name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        for e in errors:
            print(f"FAIL {label}: {e}")
        if errors:
            failed += 1
        else:
            print(f"ok   {label} (Kubernetes {KUBERNETES_VERSION} schema, strict)")
    if not {"DaemonSet", "Pod"} <= kinds:
        print("FAIL deploy/kubernetes/ lacks the owner's DaemonSet or the worker pod")
        failed += 1
    return failed


def broken_copies():
    """(what was broken, document) pairs that must each fail."""
    docs = {doc["kind"]: doc for _, doc in documents()}
    daemonset, pod = docs["DaemonSet"], docs["Pod"]

    def changed(doc, change):
        doc = copy.deepcopy(doc)
        change(doc)
        return doc

    owner = lambda d: d["spec"]["template"]["spec"]["containers"][0]  # noqa: E731
    return [
        ("a misspelt field", changed(daemonset, lambda d: d["spec"]["template"]["spec"].update(
            terminationGracePeriodSecond=30))),
        ("a port that is not a number", changed(daemonset, lambda d: owner(d)["ports"][0].update(
            containerPort="7370x"))),
        ("no selector", changed(daemonset, lambda d: d["spec"].pop("selector"))),
        ("a grace shorter than the stop budget", changed(daemonset, lambda d: d["spec"]["template"]["spec"].update(
            terminationGracePeriodSeconds=10))),
        ("liveness on the wrong path", changed(daemonset, lambda d: owner(d)["livenessProbe"]["httpGet"].update(
            path="/metrics"))),
        ("the owner as root", changed(daemonset, lambda d: d["spec"]["template"]["spec"]["securityContext"].update(
            runAsUser=0))),
        ("a worker outside the socket's group", changed(pod, lambda d: d["spec"]["securityContext"].update(
            supplementalGroups=[]))),
        ("a worker on another socket path", changed(pod, lambda d: d["spec"]["containers"][0]["env"][0].update(
            value="unix:/var/lib/kvtide/owner.sock"))),
    ]


def self_test():
    """The checker refuses each broken copy (so a passing run means something)."""
    missed = 0
    for what, doc in broken_copies():
        errors = errors_of(doc)
        print(f"{'refused' if errors else 'MISSED '} {what}: {errors[0] if errors else 'no error'}")
        missed += not errors
    return missed


if __name__ == "__main__":
    bad = self_test() if "--self-test" in sys.argv[1:] else check_all()
    sys.exit(1 if bad else 0)
