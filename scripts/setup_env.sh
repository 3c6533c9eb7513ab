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
rm -f "$log"
export PATH="$venv/bin:$PATH"
