"""The adapter tests run inside the real engines. Where they are missing those tests skip, and
this file says so with the install command; under CI (`CI` set, where `.ci/run` installs them) a
missing or other version is a failure, so the adapter tests can never pass by skipping."""

import importlib.metadata
import os

import pytest

ENGINES = {"sglang": "0.5.23", "vllm": "0.34.0"}
INSTALL = "bash python/tests/engines/install.sh"


@pytest.mark.parametrize("package", sorted(ENGINES))
def test_the_engine_the_adapter_supports_is_installed(package):
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version == ENGINES[package]:
        return
    found = f"{package} {version}" if version else f"no {package}"
    message = f"{found} installed; the adapter tests need {package} {ENGINES[package]} ({INSTALL})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
