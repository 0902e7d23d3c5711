#!/usr/bin/env bash
# Builds the kvtide wheel: the abi3 manylinux wheel of the Python package with the CUDA transport
# compiled in (libcuda is loaded at run time) and the release `kvtide-owner` inside it
# (kvtide/bin/kvtide-owner, run by the `kvtide-owner` console command).
#
#   bash python/build_wheel.sh [OUT_DIR]     # default OUT_DIR: target/wheels
#
# Prints the wheel's path and size, and its path alone as the last line (for scripts).
# The owner binary is copied into the package only for the build and removed afterwards, so a
# checkout never runs a stale copy (and git ignores it).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$repo/target/wheels}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

command -v maturin >/dev/null ||
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore 'maturin>=1.5,<2'

target_dir="$(cd "$repo" && cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"

start=$(date +%s)
echo "== building kvtide-owner (release, CUDA in)"
# Features resolved together with the extension's (-p kvtide-python, only the owner's binary built):
# the libraries both link are then compiled once, not once per feature set (maturin's build below
# reuses them).
(cd "$repo" && cargo build --release --locked -p kvtide-remote -p kvtide-python --bin kvtide-owner \
    --features kvtide-remote/cuda,kvtide-python/cuda)

bundled="$repo/python/kvtide/bin/kvtide-owner"
mkdir -p "$(dirname "$bundled")"
trap 'rm -f "$bundled"; rmdir "$(dirname "$bundled")" 2>/dev/null || true' EXIT
# The release profile keeps line tables (debug = 1) for profiling; the wheel ships without them.
strip -o "$bundled" "$target_dir/release/kvtide-owner"
chmod 0755 "$bundled"

echo "== building the wheel (maturin, release, abi3)"
rm -f "$out"/kvtide-*.whl
(cd "$repo/python" && maturin build --release --locked -o "$out")
wheel="$(ls "$out"/kvtide-*.whl)"
python3 - "$wheel" <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
names = wheel.namelist()
missing = [n for n in ("kvtide/bin/kvtide-owner", "kvtide/_owner.py") if n not in names]
if missing or not any(n.startswith("kvtide/_kvtide") for n in names):
    sys.exit(f"{sys.argv[1]} lacks {missing or 'the extension module'}")
if not (wheel.getinfo("kvtide/bin/kvtide-owner").external_attr >> 16) & 0o100:
    sys.exit(f"{sys.argv[1]}: kvtide/bin/kvtide-owner is not executable in the wheel")
PY
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1), $(stat -c %s "$wheel") bytes) built in $(( $(date +%s) - start )) s"
echo "$wheel"
