#!/usr/bin/env bash
# Installs the inference engines that kvtide's adapter tests run inside: SGLang 0.5.23 and vLLM
# 0.34.0 with --no-deps, torch 2.14.1 (with its CUDA libraries: torch imports them even on a
# machine without a GPU) and only the pure-Python packages their imported modules need. Into the
# interpreter $PYTHON (default python3). pip's cache keeps a second run to seconds. The two
# engines pin different versions of some shared dependencies (transformers, xgrammar, ...), so pip
# warns about conflicts: requirements.txt holds versions under which both engines' modules that
# the tests import work.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
pip_install "torch==2.14.1"
pip_install --no-deps "sglang==0.5.23" "vllm==0.34.0" "torchvision==0.29.0"
pip_install -r "$here/requirements.txt"
"$PY" - <<'PY'
import importlib.metadata as md
print("engines:", ", ".join(f"{p} {md.version(p)}" for p in ("sglang", "vllm", "torch")))
PY
