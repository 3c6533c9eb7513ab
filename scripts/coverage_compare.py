"""Did a change of the test suite lose code paths? Two coverage runs of the suite (`coverage json` of each, ckpt_tools/
and trainer/, subprocesses included) compared by function: a function the old suite ran and the new one does not is
a path lost.

    COVERAGE_RCFILE=RC coverage run -m pytest ...   (RC: parallel, `patch = subprocess`, source_pkgs ckpt_tools,
    coverage combine; coverage json -o old.json      trainer; docs/testing.md gives the whole recipe)
    python scripts/coverage_compare.py old.json new.json

Functions are matched by their qualified name within the package (modules are split and renamed between trees: a
name found in several files counts as run if any of them ran). Prints the totals of each run, the functions of both
trees that the old run ran and the new one did not (with their file), and the files whose share of lines run fell.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def functions(report: dict) -> dict[str, tuple[bool, list[str]]]:
    """qualified name -> (run by the suite in some file, the files holding it)."""
    ran: dict[str, bool] = defaultdict(bool)
    where: dict[str, list[str]] = defaultdict(list)
    for path, entry in report["files"].items():
        for name, fn in entry.get("functions", {}).items():
            if not name:  # a module's top level
                continue
            ran[name] |= fn["summary"]["covered_lines"] > 0
            where[name].append(path)
    return {name: (ran[name], where[name]) for name in where}


def main(old_path: str, new_path: str) -> int:
    old, new = (json.load(open(p)) for p in (old_path, new_path))
    a, b = functions(old), functions(new)
    for label, report, fns in (("old", old, a), ("new", new, b)):
        t = report["totals"]
        print(f"{label}: {t['covered_lines']} of {t['num_statements']} lines run ({t['percent_covered']:.2f}%), "
              f"{sum(r for r, _ in fns.values())} of {len(fns)} functions")
    both = sorted(set(a) & set(b))
    lost = [n for n in both if a[n][0] and not b[n][0]]
    gained = [n for n in both if b[n][0] and not a[n][0]]
    print(f"functions in both trees: {len(both)}; run by the old suite only: {len(lost)}; by the new one only: "
          f"{len(gained)}")
    for n in lost:
        print(f"  lost: {n} ({', '.join(b[n][1])})")
    fell = []
    for path in sorted(set(old["files"]) & set(new["files"])):
        po, pn = (r["files"][path]["summary"]["percent_covered"] for r in (old, new))
        if pn < po - 0.5:
            fell.append((path, po, pn))
    print(f"files in both trees: {len(set(old['files']) & set(new['files']))}; share of lines run fell by more than "
          f"half a point: {len(fell)}")
    for path, po, pn in fell:
        print(f"  {path}: {po:.1f}% -> {pn:.1f}%")
    return 1 if lost else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/coverage_compare.py OLD.json NEW.json (coverage json of each run)")
    sys.exit(main(sys.argv[1], sys.argv[2]))
