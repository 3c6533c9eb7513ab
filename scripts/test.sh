#!/usr/bin/env bash
# Set up the environment, then run the test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/setup_env.sh"
cd "$root"
exec python -m pytest -q -ra "$@"
