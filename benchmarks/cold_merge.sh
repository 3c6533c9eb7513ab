#!/bin/bash
# Cold `ckpt merge SRC -> HF` by two trees of this project against `cp -r` of the output, in alternating rounds, the
# page cache dropped before each command (needs root) and `sync` after it: the figures of docs/benchmarks.md's cold
# merge sections.
#
#   bash benchmarks/cold_merge.sh SRC OLD_TREE NEW_TREE [ROUNDS] [WORK]
#
# OLD_TREE and NEW_TREE are checkouts (e.g. `git worktree add /tmp/old HEAD~1` and this one); each runs its own
# ckpt_tools through PYTHON (default: this checkout's .venv). Prints one line per command: round, which, seconds.
# Needs root (drop_caches) and bc.
set -euo pipefail
src=$(realpath "$1"); old=$(realpath "$2"); new=$(realpath "$3"); rounds=${4:-3}; work=$(realpath "${5:-$(mktemp -d)}")
py=${PYTHON:-$(dirname "$(realpath "$0")")/../.venv/bin/python}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
timed() { local s e; s=$(date +%s.%N); "$@" > /dev/null; sync; e=$(date +%s.%N); echo "$e - $s" | bc; }
for r in $(seq "$rounds"); do
  for which in old new; do
    tree=$old; [ "$which" = new ] && tree=$new
    rm -rf "$work/out"; drop
    # run from the tree: `python -m` puts the working directory first on sys.path
    echo "round $r merge-$which $(cd "$tree" && timed env PYTHONPATH="$tree" "$py" -m ckpt_tools.cli merge "$src" \
      "$work/out" --format hf --quiet)"
  done
  rm -rf "$work/cp"; drop
  echo "round $r cp $(timed cp -r "$work/out" "$work/cp")"
  rm -rf "$work/cp"
done
rm -rf "$work/out"
[ -n "${5:-}" ] || rmdir "$work"
