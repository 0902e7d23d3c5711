#!/usr/bin/env bash
# The Python tests against the installed wheel, not the checkout (README's test command and CI run
# this): builds the wheel (python/build_wheel.sh: release, CUDA compiled in, kvtide-owner inside),
# installs it into a fresh virtual environment that also sees the system python3's packages
# (torch and the inference engines that engines/install.sh puts there), and runs pytest from
# python/tests, where the checkout's package is not on sys.path. The tests' owner is the wheel's
# (`kvtide-owner` on the venv's PATH). Arguments go to pytest (default: -q, every test here).
#
#   bash python/tests/run.sh [PYTEST ARGS...]
#   KVTIDE_WHEEL=path/to/kvtide-*.whl bash python/tests/run.sh   # test a wheel built before
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
PY="${PYTHON:-python3}"

wheel="${KVTIDE_WHEEL:-}"
if [[ -z "$wheel" ]]; then
    bash "$repo/python/build_wheel.sh" "$repo/target/wheels"
    wheel="$(ls "$repo"/target/wheels/kvtide-*.whl)"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/kvtide-wheel-venv.XXXXXX")"
trap 'rm -rf "$work"' EXIT
venv="$work/venv"
echo "== a fresh virtual environment ($venv, with the system site-packages) and the wheel in it"
"$PY" -m venv --system-site-packages "$venv"
pip_install() { "$venv/bin/python" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
start=$(date +%s%N)
# --ignore-installed: a kvtide installed into the system python3 (visible here) must not count.
pip_install --no-deps --ignore-installed "$wheel"
echo "installed $(basename "$wheel") in $(( ($(date +%s%N) - start) / 1000000 )) ms"
"$venv/bin/python" -c 'import numpy, pytest' 2>/dev/null || pip_install pytest numpy
(cd / && env -u PYTHONPATH "$venv/bin/python" -c '
import sys, kvtide
if not kvtide.__file__.startswith(sys.prefix + "/"):
    sys.exit(f"kvtide imports from {kvtide.__file__}, not from the venv {sys.prefix}")')

echo "== pytest against the installed wheel"
cd "$here"
args=("$@")
(( ${#args[@]} )) || args=(-q .)
# PYTEST_KVTIDE_VENV: test_wheel.py fails (not skips) unless kvtide is this venv's installed wheel.
# KVTIDE_* variables this script reads are unset: the owner refuses KVTIDE_* variables it does not know.
# The base interpreter's bin folder follows the venv's: console tools the system packages installed
# there (ninja, which SGLang's extension build runs) stay on PATH.
base_bin="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
env -u PYTHONPATH -u KVTIDE_OWNER_BIN -u KVTIDE_WHEEL PYTEST_KVTIDE_VENV="$venv" PATH="$venv/bin:$base_bin:$PATH" \
    "$venv/bin/python" -m pytest "${args[@]}"
