"""Fuzz: random damage to meta.json and to shard bytes of a small checkpoint, then merge / reshard / inspect.

Never a raw traceback (exit code 0 or 1, a failure is one `error:` line, no exception escapes the CLI), never
a half-written OUT, and never a different output without an error: whenever a command succeeds, its tensors
equal bit for bit those of the same command on the undamaged checkpoint. The exceptions are stated and
counted, not hidden:
- flipped bytes (in tensor data, or in a value the checks cannot judge), read WITHOUT --check-hashes: only
  sha256 can see them (by design, the size check cannot); with --check-hashes every byte mutation must be
  refused, and `inspect --tensors` must print exactly what it prints for the undamaged checkpoint or fail;
- meta.json edits that were re-sealed (checksum recomputed, or the checksum field deleted, which the
  format accepts as "I edited this on purpose") and change what the model is: whether the embeddings are
  tied (merge then drops the output layer, with a note). Every other re-sealed edit must give an error
  or the same tensors.

Bounded in time: CKPT_FUZZ_SECONDS (default 20) of mutations, seeded by CKPT_FUZZ_SEED (default 0); each
mutation i draws from Random(f"{seed}-{i}"), so a failure names the seed and index that reproduce it.
`pytest -s` prints the number of mutations tried and their outcome counts.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from bad_inputs import invoke, llama, make_ckpt
from safetensors.torch import load_file as load_safetensors

from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model.shard_ops import same_bits

SECONDS = float(os.environ.get("CKPT_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "0"))

# re-sealed meta.json edits that may legitimately change the output (they redefine the model)
SEMANTIC = ("model.tie_word_embeddings",)


# ---------------------------------------------------------------- comparing outputs
def same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.is_tensor(b) and same_bits(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def merged_tensors(out: Path) -> dict:
    return load_safetensors(out)


def resharded(out: Path) -> dict:
    """{file name: loaded object} of the model, optimizer and RNG shards of a reshard's OUT (meta.json
    differs legitimately: source dir, origin)."""
    ckpt = out / (out / fmt.LATEST).read_text().strip()
    return {p.name: torch.load(p, weights_only=True) for p in sorted(ckpt.glob("*.bin"))}


COMMANDS = {  # name -> (args after SRC OUT, reader of OUT or None)
    "merge": (["merge", "{src}", "{out}", "--format", "safetensors", "-q"], merged_tensors),
    "merge --check-hashes": (["merge", "{src}", "{out}", "--format", "safetensors", "-q", "--check-hashes"],
                             merged_tensors),
    "reshard": (["reshard", "{src}", "{out}", "--tp", "1", "--pp", "1", "-q"], resharded),
    "reshard --check-hashes": (["reshard", "{src}", "{out}", "--tp", "1", "--pp", "1", "-q", "--check-hashes"],
                               resharded),
    "inspect": (["inspect", "{src}"], None),
    "inspect --tensors": (["inspect", "{src}", "--tensors"], None),
}
META_COMMANDS = ("merge", "merge --check-hashes", "reshard", "inspect")
BYTE_COMMANDS = ("merge --check-hashes", "reshard --check-hashes", "merge", "reshard", "inspect --tensors")


# ---------------------------------------------------------------- mutations
def _paths(obj, prefix=()):
    """Every (path, value) of a JSON tree, containers included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _random_value(rng: random.Random, old):
    choices = [0, -1, 1, 2, 3, 7, 10**12, -(10**12), 0.5, -2.5, 1e308, float("nan"), "", "x", "llama", "gpt2",
               "float32", "bfloat16", True, False, None, [], [1, 3], [2, 2, 2], {}, {"a": 1}]
    if isinstance(old, bool):
        choices += [not old] * 4
    elif isinstance(old, int):
        choices += [old + rng.choice([-1, 1, 2, 128]), old * 2, old // 2, str(old), float(old)] * 2
    elif isinstance(old, float):
        choices += [old * 2, -old, str(old), int(old)] * 2
    elif isinstance(old, str):
        choices += [old + "x", old[:-1], old.upper(), 5] * 2
    elif isinstance(old, list):
        choices += [old[:-1], old + old[-1:], list(reversed(old)), {str(i): v for i, v in enumerate(old)}] * 2
    elif isinstance(old, dict):
        choices += [list(old.values()), list(old), dict(list(old.items())[:-1])] * 2
    return rng.choice(choices)


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def mutate_meta(rng: random.Random, text: str) -> tuple[str, str, str]:
    """(new meta.json text, description, seal) — seal: 'stale' (checksum left), 'resealed', 'unsealed'."""
    kind = rng.choice(["value", "value", "value", "delete", "type", "truncate", "bytes"])
    if kind == "truncate":
        n = rng.randrange(len(text))
        return text[:n], f"meta.json truncated to {n} chars", "n/a"
    if kind == "bytes":
        data = bytearray(text.encode())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return data.decode("latin-1"), "meta.json random bytes", "n/a"
    meta = json.loads(text)
    paths = [(p, v) for p, v in _paths(meta) if p and p[0] != "checksum"]
    path, old = rng.choice(paths)
    where = ".".join(map(str, path))
    if kind == "delete":
        parent_paths = [(p, v) for p, v in paths if isinstance(v, dict) and v] + [((), meta)]
        parent, obj = rng.choice(parent_paths)
        key = rng.choice(list(obj))
        del obj[key]
        where, desc = ".".join(map(str, parent + (key,))), "deleted"
    elif kind == "type":
        new = {int: str, float: str, str: lambda s: [s], bool: int, list: lambda v: {"0": v}, dict: lambda v: [v],
               type(None): lambda v: 0}[type(old)](old)
        _set(meta, path, new)
        desc = f"{old!r:.40} -> {new!r:.40} (type)"
    else:
        new = _random_value(rng, old)
        _set(meta, path, new)
        desc = f"{old!r:.40} -> {new!r:.40}"
    seal = rng.choice(["stale", "resealed", "unsealed"])
    if seal == "resealed":
        meta["checksum"] = fmt.meta_checksum(meta)
    elif seal == "unsealed":
        meta.pop("checksum", None)
    return json.dumps(meta, indent=2), f"meta.json {where}: {desc} [{seal}]", seal


def mutate_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str, str]:
    kind = rng.choice(["flip", "flip", "truncate", "append"])
    buf = bytearray(data)
    if kind == "flip":
        spots = sorted(rng.randrange(len(buf)) for _ in range(rng.randint(1, 8)))
        for i in spots:
            buf[i] ^= rng.randrange(1, 256)
        return bytes(buf), f"flipped bytes at {spots}", kind
    if kind == "truncate":
        n = rng.randrange(len(buf))
        return bytes(buf[:n]), f"truncated to {n} of {len(buf)} bytes", kind
    n = rng.randint(1, 64)
    return bytes(buf) + bytes(rng.randrange(256) for _ in range(n)), f"{n} bytes appended", kind


# ---------------------------------------------------------------- the run
def run_command(name: str, src: Path, out: Path):
    args, _ = COMMANDS[name]
    return invoke(*[a.format(src=src, out=out) for a in args])


def check_clean(name: str, res, out: Path, what: str) -> bool:
    """The invariants of every run; returns True when the command succeeded."""
    where = f"{what}: `{name}`"
    assert res.exception is None or isinstance(res.exception, SystemExit), \
        f"{where}: exception escaped the CLI: {res.exception!r:.400}\n{res.output}"
    assert "Traceback" not in res.output, f"{where}: traceback\n{res.output}"
    assert res.exit_code in (0, 1), f"{where}: exit code {res.exit_code}\n{res.output}"
    if res.exit_code == 1:
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{where}: not one error line\n{res.output}"
        assert not out.exists(), f"{where}: failed but left OUT"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, f"{where}: temp outputs left: {leftovers}"
    return res.exit_code == 0


def _same_output(name: str, out: Path, reference) -> bool:
    result = COMMANDS[name][1](out)
    if name.startswith("merge"):
        return list(result) == list(reference) and all(same_bits(result[k], reference[k]) for k in reference)
    return same_tree(result, reference)


def test_fuzz_meta_and_shard_bytes(tmp_path):
    ckpt = make_ckpt(tmp_path / "src", llama(), tp=2, pp=2)
    pristine = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    targets = sorted(n for n in pristine if n.endswith(".bin"))
    out = tmp_path / "work" / "OUT"
    out.parent.mkdir()

    reference = {}
    for name, (_, reader) in COMMANDS.items():
        res = run_command(name, ckpt, out)
        assert check_clean(name, res, out, "undamaged checkpoint"), res.output
        reference[name] = reader(out) if reader is not None else res.output
        shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)

    outcomes: Counter = Counter()
    allowed: Counter = Counter()
    tried = 0
    start = time.monotonic()
    deadline = start + SECONDS
    while time.monotonic() < deadline or tried < 10:
        rng = random.Random(f"{SEED}-{tried}")
        what_file = fmt.META if rng.random() < 0.5 else rng.choice(targets)
        if what_file == fmt.META:
            text, desc, seal = mutate_meta(rng, pristine[fmt.META].decode())
            (ckpt / fmt.META).write_bytes(text.encode("latin-1") if seal == "n/a" else text.encode())
            family, commands = ("meta/garbled" if seal == "n/a" else f"meta/{seal}"), META_COMMANDS
        else:
            data, desc, kind = mutate_bytes(rng, pristine[what_file])
            (ckpt / what_file).write_bytes(data)
            desc = f"{what_file}: {desc}"
            family, commands = f"bytes/{kind}", BYTE_COMMANDS
        what = f"mutation {tried} (CKPT_FUZZ_SEED={SEED}): {desc}"
        for name in commands:
            res = run_command(name, ckpt, out)
            if not check_clean(name, res, out, what):
                outcomes[(family, name, "error")] += 1
                continue
            if family.startswith("bytes") and "--check-hashes" in name:
                pytest.fail(f"{what}: `{name}` succeeded although a recorded file changed\n{res.output}")
            if COMMANDS[name][1] is None:  # inspect: meta.json's summary, which a byte mutation must not change
                if family.startswith("bytes"):
                    assert res.output == reference[name], f"{what}: `{name}` printed something else\n{res.output}"
                outcomes[(family, name, "same output" if family.startswith("bytes") else "ok")] += 1
                continue
            same = _same_output(name, out, reference[name])
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
            if same:
                outcomes[(family, name, "same output")] += 1
                continue
            if family == "bytes/flip" and "--check-hashes" not in name:
                allowed[("flipped bytes read without --check-hashes (only sha256 sees them)", name)] += 1
            elif family in ("meta/resealed", "meta/unsealed") and any(f"meta.json {k}:" in desc for k in SEMANTIC):
                allowed[(f"re-sealed model edit: {desc.split(':')[0][10:]}", name)] += 1
            else:
                pytest.fail(f"{what}: `{name}` succeeded with a DIFFERENT output than on the undamaged checkpoint\n"
                            f"{res.output}")
            outcomes[(family, name, "different output (allowed)")] += 1
        for n, data in pristine.items():  # restore
            if (ckpt / n).read_bytes() != data:
                (ckpt / n).write_bytes(data)
        tried += 1

    totals = Counter()
    for (_, _, outcome), n in outcomes.items():
        totals[outcome] += n
    print(f"\nfuzz: {tried} mutations in {time.monotonic() - start:.0f}s (CKPT_FUZZ_SEED={SEED}, "
          f"CKPT_FUZZ_SECONDS={SECONDS:g}), {sum(totals.values())} command runs: "
          + ", ".join(f"{outcome} {n}" for outcome, n in sorted(totals.items())) + "; per mutation family and command:")
    for (family, name, outcome), n in sorted(outcomes.items()):
        print(f"  {family:<15} {name:<24} {outcome:<28} {n}")
    for (why, name), n in sorted(allowed.items()):
        print(f"  allowed difference: {why} ({name}): {n}")
    assert tried >= 10
