"""Our checkpoint directory (DESIGN.md Contract 2): names, meta.json, locating, atomic commit.

SAVE_DIR/latest names the newest complete `checkpoint-<iteration>` dir; each holds meta.json and
per (tp, pp) rank `pytorch_model_tp_<t>_pp_<p>.bin`, `optimizer_tp_<t>_pp_<p>.bin`,
`rng_tp_<t>_pp_<p>.bin`. A checkpoint is written into `.checkpoint-<iteration>.tmp` and renamed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_tools import durable, hashing, io
from ckpt_tools.errors import ConfigError, FormatError
from ckpt_tools.model import layout
from ckpt_tools.model.ranks import Grid, Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team

FORMAT = "ckpt-tools/1"
META = "meta.json"
LATEST = "latest"
PARAMS_DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZER_FIELDS = ("master", "exp_avg", "exp_avg_sq")  # per parameter in an optimizer shard, beside its step


def model_file(rank: Rank) -> str:
    return f"pytorch_model_{rank.tag}.bin"


def optimizer_file(rank: Rank) -> str:
    return f"optimizer_{rank.tag}.bin"


def rng_file(rank: Rank) -> str:
    return f"rng_{rank.tag}.bin"


def checkpoint_name(iteration: int) -> str:
    return f"checkpoint-{iteration}"


def temp_name(iteration: int) -> str:
    return f".checkpoint-{iteration}.tmp"


@dataclass(frozen=True)
class Meta:
    """meta.json, read back: what a reader needs to interpret the shards."""
    path: Path
    raw: dict
    spec: ModelSpec
    tp_size: int
    pp_size: int
    layer_counts: list[int]
    padded_vocab: int
    iteration: int
    source: str = "ckpt-tools"  # or "megatron-lm" / "torch_dist" (Contract 3; ckpt_tools/forms/): for display
    root: Path | None = None  # the checkpoint dir when it is not path.parent (Megatron-LM's iter_N dir)
    ep_size: int = 1  # expert parallelism: each (TP, PP, EP) file holds its stage's dense tensors and its experts

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> Meta:
        path = Path(ckpt_dir) / META
        if not path.is_file():
            raise FormatError(f"{path}: not found: {ckpt_dir} is not a complete checkpoint "
                              f"(pass a checkpoint-N dir or a save dir holding `latest`)")
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise TypeError(f"top level is a {type(raw).__name__}, not an object")
            missing = [k for k in ("model", "parallel", "vocab", "iteration", "dtypes", "files") if k not in raw]
            if missing:
                raise FormatError(f"{path}: meta.json lacks {', '.join(missing)}: restore it from the source checkpoint")
            if raw.get("format") != FORMAT:
                raise FormatError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}: not a checkpoint of "
                                  f"this format; restore meta.json from the source checkpoint")
            if "checksum" in raw and raw["checksum"] != meta_checksum(raw):
                raise FormatError(f"{path}: content does not match its checksum: meta.json was edited or damaged "
                                  f"after it was written; restore it (or delete its \"checksum\" field to accept the edit)")
            par = raw["parallel"]
            spec = ModelSpec.from_dict(raw["model"])
            _check_fields(path, raw, spec)
            return cls(path=path, raw=raw, spec=spec, tp_size=par["tp_size"],
                       pp_size=par["pp_size"], layer_counts=list(par["layers_per_stage"]),
                       padded_vocab=raw["vocab"]["padded"], iteration=raw["iteration"], ep_size=par.get("ep_size", 1))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"{path}: malformed meta.json ({type(e).__name__}: {e}): "
                              f"restore it from the source checkpoint") from None
        except ConfigError as e:  # ModelSpec refused meta.json's model (e.g. an unknown architecture)
            raise ConfigError(f"{path}: {e}") from None

    @property
    def dir(self) -> Path:
        return self.root if self.root is not None else self.path.parent

    @property
    def grid(self) -> Grid:
        return Grid(self.tp_size, self.pp_size, self.ep_size)

    def rank_keys(self, rank: Rank, owned: bool = False) -> list[tuple[str, str]]:
        """(file-local key, global key) of every tensor one rank's file holds; `owned`: only those read from it (a
        dense tensor's replicas on EP ranks > 0 left out)."""
        keys = layout.stage_keys(self.spec, self.layer_counts, rank.pp, rank.ep, self.ep_size)
        if owned and rank.ep not in (None, 0):
            keys = [(local, key) for local, key in keys if layout.expert_index(key) is not None]
        return keys

    @property
    def fresh_optimizer(self) -> bool:
        """meta.json records a fresh optimizer (iteration 0: zero moments, fp32 masters equal to the weights, step 0)
        that is not written: whoever needs it makes it from the weights (contract 2)."""
        return self.raw.get(FRESH) is True

    @property
    def params_dtype(self) -> str:
        return self.raw.get("dtypes", {}).get("params", "float32")


def _check_fields(path: Path, raw: dict, spec: ModelSpec) -> None:
    """The fields readers rely on, of the types they need (a value in a file may be anything)."""
    def is_int(v, least: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    def refuse(field: str, value, want: str) -> None:
        raise FormatError(f"{path}: {field} is {value!r:.60}, expected {want}: restore meta.json from the "
                          f"source checkpoint")
    par, vocab, dtypes, files = (raw[k] for k in ("parallel", "vocab", "dtypes", "files"))
    for name, value in (("parallel", par), ("vocab", vocab), ("dtypes", dtypes), ("files", files)):
        if not isinstance(value, dict):
            refuse(name, value, "an object")
    for k in ("tp_size", "pp_size"):
        if not is_int(par.get(k), 1):
            refuse(f"parallel.{k}", par.get(k), "a positive integer")
    ep = par.get("ep_size", 1)
    if not is_int(ep, 1) or (ep > 1 and (spec.num_moe_experts or 1) % ep):
        refuse("parallel.ep_size", ep, f"a positive integer dividing the experts ({spec.num_moe_experts or 'none'})")
    counts = par.get("layers_per_stage")
    if not (isinstance(counts, list) and all(is_int(n, 1) for n in counts) and len(counts) == par["pp_size"]
            and sum(counts) == spec.num_layers):
        refuse("parallel.layers_per_stage", counts,
               f"{par['pp_size']} positive layer counts that sum to num_layers {spec.num_layers}")
    if not is_int(vocab.get("padded"), spec.vocab_size):
        refuse("vocab.padded", vocab.get("padded"), f"an integer >= the true vocab {spec.vocab_size}")
    if "true" in vocab and vocab["true"] != spec.vocab_size:
        refuse("vocab.true", vocab["true"], f"model.vocab_size {spec.vocab_size} (the true vocab is recorded twice)")
    if not is_int(raw["iteration"], 0):
        refuse("iteration", raw["iteration"], "an integer >= 0")
    if FRESH in raw and (raw[FRESH] is not True or raw["iteration"] != 0):
        refuse(FRESH, raw[FRESH], "true, at iteration 0 only (the fresh optimizer is iteration 0's)")
    for k in ("consumed_samples", "tokens_seen"):
        if raw.get(k) is not None and not is_int(raw[k], 0):
            refuse(k, raw[k], "an integer >= 0")
    for k in ("params", "master"):
        if dtypes.get(k) not in PARAMS_DTYPES:
            refuse(f"dtypes.{k}", dtypes.get(k), "float32, bfloat16 or float16")
    if raw.get("config") is not None and not isinstance(raw["config"], dict):
        refuse("config", raw["config"], "an object")
    for name, record in files.items():
        if not (isinstance(record, dict) and is_int(record.get("size"), 0) and hashing.record_hash(record)):
            refuse(f"files.{name}", record, f'a record {{"size": bytes, "{hashing.HASH}" (or "sha256"): hex digest}}')


def resolve(src: str | Path) -> Path:
    """A checkpoint dir, or a save dir whose `latest` names one -> the checkpoint dir."""
    src = Path(src)
    if (src / META).is_file():
        return src
    latest = src / LATEST
    if latest.is_file():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise FormatError(f"{latest}: unreadable ({type(e).__name__}): it must name a checkpoint-N dir; "
                              f"fix it or pass a checkpoint-N dir explicitly") from None
        target = src / name
        if not (target / META).is_file():
            old = sorted(src.glob(f".{name}.old*"))
            hint = (f"an interrupted save left the previous copy in {old[0]}: rename it to {name}" if old
                    else "pass a checkpoint-N dir explicitly")
            raise FormatError(f"{latest} names {name!r} but {target / META} does not exist: {hint}")
        return target
    if not src.exists():
        raise FormatError(f"{src}: no such directory")
    if not src.is_dir():
        raise FormatError(f"{src}: is a file; pass a checkpoint-N dir or a save dir holding `latest`")
    found = sorted(p.name for p in src.iterdir())[:8]
    raise FormatError(f"{src}: neither a checkpoint dir (no {META}) nor a save dir (no {LATEST}); "
                      f"it holds: {', '.join(found) or 'nothing'}")


def find_latest(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a save dir, or None when it has none yet."""
    save_dir = Path(save_dir)
    if not (save_dir / LATEST).is_file():
        return None
    return resolve(save_dir)


def leftover_temps(save_dir: str | Path) -> list[str]:
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    return sorted(p.name for p in save_dir.iterdir()
                  if (p.name.startswith(".checkpoint-") and (p.name.endswith(".tmp") or ".old" in p.name))
                  or p.name.startswith(f".{LATEST}.tmp"))  # a kill while `latest` was rewritten


def layout_summary(spec: ModelSpec, pp_size: int) -> dict[str, str]:
    return {r.name: r.split for r in layout.rules_for(spec, pp_size)}


def size_problem(meta: Meta, path: Path) -> str | None:
    """The cheap integrity check every reader makes of a present file: the size meta.json records (if it does)."""
    record = meta.raw.get("files", {}).get(path.name)
    if isinstance(record, dict) and path.stat().st_size != record.get("size"):
        return (f"{path}: {path.stat().st_size} bytes, meta.json records {record.get('size')}: "
                f"the file is truncated or from another checkpoint; restore it")
    return None


def check_files(meta: Meta, names: Container[str] | None = None) -> list[str]:
    """Every file meta.json records (or those of them in `names`): present, the recorded size, the recorded hash."""
    problems = []
    for name, rec in meta.raw.get("files", {}).items():
        if names is not None and name not in names:
            continue
        path = meta.dir / name
        if not path.is_file():
            problems.append(f"{path}: missing, but meta.json records it: restore it from the source checkpoint")
        elif size_problem(meta, path):
            problems.append(size_problem(meta, path))
        elif (recorded := hashing.record_hash(rec)) is None:
            problems.append(f"{path}: meta.json's record {rec!r:.80} names no content hash ({' or '.join(hashing.HASHES)})"
                            f": restore meta.json from the source checkpoint")
        elif hashing.hash_file(path, recorded[0]) != recorded[1]:
            problems.append(f"{path}: {recorded[0]} differs from meta.json: the file changed after it was saved; "
                            f"restore it from the source checkpoint")
    return problems


def check_hashes(meta: Meta, team: Team = SOLO) -> None:
    """--check-hashes: refuse a checkpoint any of whose recorded files is missing, resized or changed (in a team, each
    process hashes its run of the files, balanced by their bytes, and every process hears of every problem)."""
    files = meta.raw.get("files", {})
    owners = team.split([int(rec.get("size") or 0) for rec in files.values()])
    mine = {name for name, owner in zip(files, owners) if owner == team.rank}
    problems = [p for found in team.share(lambda: check_files(meta, mine)) for p in found]
    if problems:
        raise FormatError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def extra_shards(meta: Meta) -> list[str]:
    """Shard files in the checkpoint dir that its TP x PP layout does not have, as one-line problems."""
    names = {name(rank) for name in (model_file, optimizer_file) for rank in meta.grid.ranks()}
    return [f"{f}: extra shard, not part of a {meta.grid} checkpoint: remove it or fix "
            f"meta.json" for f in sorted(meta.dir.glob("*_tp_*_pp_*.bin"))
            if f.name not in names and not f.name.startswith("rng_")]


def shard_problems(meta: Meta, path: Path, state: dict, rank: Rank, is_tensor: Callable[[Any], bool],
                   made: frozenset[str] = frozenset()) -> list[str]:
    """What is wrong with one model shard's state dict, as one-line problems: keys other than the layout
    table's for its stage, a tensor of another shape than the table's shard shape or of another dtype than
    meta.json's. `is_tensor` says what a tensor is: torch's, or a torch-free record with .shape and .dtype. `made`:
    file-local keys left to the torch reader, which checks them as it decodes them (byte_index)."""
    expected = [(local, key) for local, key in meta.rank_keys(rank) if local not in made]
    want = {local for local, _ in expected}
    fix = "restore the shard from the source checkpoint"
    problems = [f"{path}: missing tensor {k}, which the layout table puts on {rank}: "
                f"{fix}" for k, key in expected if k not in state  # a missing _extra_state holds no weights
                and layout.holds_weights(key, meta.spec, meta.pp_size)]
    problems += [f"{path}: unexpected tensor {k}, not in the layout table of this {meta.spec.architecture} model at "
                 f"PP{meta.pp_size}: remove it or {fix}" for k in state if k not in want]
    for local, key in expected:
        shape = layout.shard_shape(key, meta.spec, meta.padded_vocab, meta.tp_size, meta.pp_size)
        if shape is None or local not in state:
            continue
        t = state[local]
        if not is_tensor(t):
            problems.append(f"{path}: {local} is a {type(t).__name__}, not a tensor: {fix}")
        elif tuple(t.shape) != shape:
            problems.append(f"{path}: {local} has shape {tuple(t.shape)}, the layout table says {shape} "
                            f"({meta.grid}): {fix}")
        elif meta.params_dtype in PARAMS_DTYPES and str(t.dtype).removeprefix("torch.") != (
                kept := layout.dtype_of(key, meta.spec, meta.params_dtype, meta.pp_size)):
            problems.append(f"{path}: {local} is {t.dtype}, meta.json says {kept}: {fix}")
    return problems


def file_record(path: Path) -> dict:
    return {"size": path.stat().st_size, hashing.HASH: hashing.hash_file(path)}


def meta_checksum(meta: dict) -> str:
    """sha256 of meta.json's content without its own `checksum` field (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_meta(path: Path, meta: dict) -> None:
    """meta.json, sealed with a checksum of its content, so an edited or damaged meta.json is noticed."""
    io.write_json_atomic(path, {**meta, "checksum": meta_checksum(meta)})


FRESH = "fresh_optimizer"  # meta.json: true where the optimizer is the fresh one of iteration 0, not written
FRESH_EXTRAS = {"param_groups": [], "scheduler": {"iteration": 0}, "scaler": None}  # its file's extras, if written


def build_meta(spec: ModelSpec, tp: int, counts: list[int], padded: int, iteration: int, consumed: int,
               params_dtype: str, dp_size: int | None, config: dict, files: dict, origin: dict | None = None,
               ep: int = 1, fresh_optimizer: bool = False) -> dict:
    """meta.json of a checkpoint in our format: the one place that knows its fields (torch-free: the torch-free
    import writes it too)."""
    from ckpt_tools import package_version
    seq = config.get("seq_length")
    meta = {
        "format": FORMAT, "iteration": iteration, "consumed_samples": consumed,
        "tokens_seen": consumed * seq if seq else None,
        "model": spec.to_dict(),
        "parallel": {"tp_size": tp, "pp_size": len(counts), "dp_size": dp_size, "layers_per_stage": list(counts)},
        "vocab": {"true": spec.vocab_size, "padded": padded, "divisible_by": spec.make_vocab_size_divisible_by,
                  "padding": "zeros"},
        "dtypes": {"params": params_dtype, "master": "float32"},
        "layout": layout_summary(spec, len(counts)),
        "config": {**config, "tp_degree": tp, "pp_degree": len(counts), "layers_per_stage": list(counts)},
        "versions": {"torch": package_version("torch"), "megatron-core": package_version("megatron-core"),
                     "ckpt-tools": package_version()},
        "files": files,
    }
    if ep > 1:  # recorded only with an EP axis: checkpoints without one keep their meta.json as it was
        meta["parallel"]["ep_size"] = ep
    if origin is not None:
        meta["origin"] = origin
    if fresh_optimizer:
        meta[FRESH] = True
    return meta


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing dirs in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or filesystem cannot, and the caller renames twice instead."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def commit(save_dir: str | Path, iteration: int, meta: dict) -> Path:
    """Write meta.json into the temp dir, rename it to checkpoint-N, then update `latest` (last)."""
    save_dir = Path(save_dir)
    tmp = save_dir / temp_name(iteration)
    final = save_dir / checkpoint_name(iteration)
    write_meta(tmp / META, meta)
    durable.fsync_dir(tmp)
    old = None
    if final.exists() and _exchange(tmp, final):  # one atomic step: `latest` never names a missing dir
        old = tmp  # now holds the previous checkpoint-N, removed below
    else:
        if final.exists():  # no atomic exchange here: a kill between the two renames leaves the old copy
            old = save_dir / f".{final.name}.old{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
    durable.fsync_dir(save_dir)
    io.write_text_atomic(save_dir / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
