#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its test extras. torch is pinned first to
# the CPU build, so that no dependency pulls the multi-GB CUDA build. Sourced by demo.sh and test.sh.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${CKPT_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q torch==2.13.0
fi
log=$(mktemp)
"$py" -m pip install -q -e "$root[test]" >"$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
# megatron-core 0.19.2, the newest release, unpacked beside the installed one (its wheel says Python >= 3.12; its
# Python code runs here on CPU: tests/mcore_newest.py): the tests' reference for what Megatron-LM saves and loads today
newest="$venv/megatron-core-0.19.2"
if [ ! -f "$newest/megatron/core/__init__.py" ]; then
  rm -rf "$newest" "$newest.tmp"  # an unpacking that died part-way
  wheels=$(mktemp -d)
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$wheels" megatron-core==0.19.2 \
    >"$log" 2>&1 || { cat "$log"; rm -rf "$log" "$wheels"; exit 1; }
  "$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$wheels"/*.whl "$newest.tmp"
  mv "$newest.tmp" "$newest"
  rm -rf "$wheels"
fi
rm -f "$log"
export PATH="$venv/bin:$PATH"
