#!/usr/bin/env bash
# Set up the environment, then run the test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/setup_env.sh"
cd "$root"
# Two workers (pytest-xdist), a test module to each at a time (module fixtures built once): the multi-process tests
# wait on process start-up and pipes a good part of their time. Modules go out heaviest first (tests/conftest.py), not
# by their number of tests. CKPT_TEST_WORKERS=0 runs the suite in one process.
exec python -m pytest -q -ra -n "${CKPT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
