"""Save and resume the trainer's state in our checkpoint format (DESIGN.md Contract 2).

Every (tp, pp) rank of data-parallel rank 0 writes its own three files into a temp dir; global
rank 0 then writes meta.json (with the size and content hash of every file), renames the dir and
updates `latest` last. A crash at any point leaves the previous checkpoint and `latest` intact.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ckpt_tools import io
from ckpt_tools.errors import ConfigError, FormatError
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model import hf, layout
from ckpt_tools.model.ranks import Grid, Rank
from trainer.config import TrainConfig
from trainer.model import GPTStage
from trainer.optim import MasterAdamW

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _ranks() -> tuple[int, int, int]:
    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank())


def save(cfg: TrainConfig, stage: GPTStage, opt: MasterAdamW, iteration: int, consumed_samples: int,
         dp_size: int) -> Path | None:
    save_dir = Path(cfg.save_dir)
    tmp = save_dir / fmt.temp_name(iteration)
    tp_rank, pp_rank, dp_rank = _ranks()
    if dist.get_rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    records: dict[str, dict] = {}
    full_state = opt.state_by_key()  # with the distributed optimizer a gather over DP: every rank takes part
    ep_rank = _ep_rank(stage)
    writes = dp_rank == 0 if ep_rank is None else ps.get_expert_data_parallel_rank() == 0  # each EP rank its experts
    if writes:
        model_state = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in stage.state_dict().items()}
        optim_state = {k: {n: t.detach().cpu() for n, t in s.items()} for k, s in full_state.items()}
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
               "iteration": iteration, "consumed_samples": consumed_samples}
        rank = Rank(tp_rank, pp_rank, ep_rank)
        files = {fmt.model_file(rank): {"model": model_state},
                 fmt.optimizer_file(rank): {
                     "optimizer": optim_state,
                     "param_groups": opt.param_groups,
                     "scheduler": {"iteration": iteration, "lr": opt.param_groups[0]["lr"]},
                     "scaler": None},
                 fmt.rng_file(rank): rng}
        for name, obj in files.items():
            io.save_file(obj, tmp / name)
            records[name] = fmt.file_record(tmp / name)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    final = None
    if dist.get_rank() == 0:
        all_records = {k: v for r in gathered for k, v in sorted(r.items())}
        for f in hf.tokenizer_files(Path(cfg.tokenizer)):  # a checkpoint carries its tokenizer
            shutil.copyfile(f, tmp / f.name)
            all_records[f.name] = fmt.file_record(tmp / f.name)
        meta = _meta(cfg, stage, iteration, consumed_samples, dp_size, all_records)
        final = fmt.commit(save_dir, iteration, meta)
    dist.barrier()
    return final


def _ep_rank(stage: GPTStage) -> int | None:
    """This rank's EP coordinate in file names: None without expert parallelism."""
    return stage.ep[0] if stage.ep is not None else None


def _meta(cfg: TrainConfig, stage: GPTStage, iteration: int, consumed: int, dp_size: int, files: dict) -> dict:
    return fmt.build_meta(stage.spec, stage.tp_size, stage.layer_counts, stage.padded_vocab, iteration, consumed,
                          DTYPE_NAMES[cfg.dtype], dp_size, cfg.to_dict(), files, ep=stage.ep[1] if stage.ep else 1)


def _check_compatible(meta: fmt.Meta, stage: GPTStage) -> None:
    if meta.spec != stage.spec:
        diff = [f"{k}: {v} vs {getattr(stage.spec, k)}" for k, v in meta.spec.to_dict().items()
                if getattr(stage.spec, k) != v]
        raise ConfigError(f"{meta.path}: the checkpoint's model differs from the config ({'; '.join(diff)}): "
                          f"train with the checkpoint's model settings or start a new save_dir")
    ep = stage.ep[1] if stage.ep is not None else 1
    here = (stage.tp_size, len(stage.layer_counts), ep, stage.layer_counts, stage.padded_vocab)
    there = (meta.tp_size, meta.pp_size, meta.ep_size, meta.layer_counts, meta.padded_vocab)
    if here != there:
        grids = Grid(*there[:3]), Grid(*here[:3])
        raise ConfigError(
            f"{meta.dir}: saved at {grids[0]} (layers {there[3]}, padded vocab {there[4]}) but this run is {grids[1]} "
            f"(layers {here[3]}, padded vocab {here[4]}): run `ckpt reshard {meta.dir} OUT --tp {here[0]} --pp "
            f"{here[1]}{f' --ep {ep}' if meta.spec.is_moe else ''}` and resume from OUT")


def check_shard(path: Path, state: dict, stage: GPTStage, meta: fmt.Meta) -> None:
    """Keys exactly the stage's, shapes exactly the layout table's shard shapes; one error for all."""
    expected = list(stage.global_keys())
    problems = [f"missing tensor {k}" for k in expected if k not in state]
    problems += [f"unexpected tensor {k}" for k in state if k not in expected]
    keys = stage.global_keys()
    for k in expected:
        if k in state and torch.is_tensor(state[k]):
            want = layout.shard_shape(keys[k], meta.spec, meta.padded_vocab, meta.tp_size, meta.pp_size)
            if tuple(state[k].shape) != want:
                problems.append(f"{k} has shape {tuple(state[k].shape)}, expected {want}")
    if problems:
        raise FormatError(f"{path}: {'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}: "
                          f"the shard does not match meta.json; restore it from the source checkpoint")


def _read(path: Path, meta: fmt.Meta, entry: str | None = None, mmap: bool = True):
    """One file of the checkpoint: the size meta.json records, the allow-listed load, the expected entry."""
    problem = fmt.size_problem(meta, path) if path.is_file() else None
    if problem:
        raise FormatError(problem)
    obj = io.load_file(path, mmap=mmap)
    if entry is not None and not (isinstance(obj, dict) and isinstance(obj.get(entry), dict)):
        raise FormatError(f"{path}: holds no {entry!r} state dict: not a {entry} shard of this checkpoint; "
                          f"restore it from the source checkpoint")
    return obj


def _check_optimizer(path: Path, state: dict, stage: GPTStage) -> None:
    """Every parameter has master / exp_avg / exp_avg_sq of its shape and a step; one error for all."""
    problems = []
    for name, p in stage.named_parameters():
        s = state.get(name)
        if not isinstance(s, dict) or any(not torch.is_tensor(s.get(f)) for f in ("master", "exp_avg", "exp_avg_sq", "step")):
            problems.append(f"no complete state (master, exp_avg, exp_avg_sq, step) for {name}")
        elif any(tuple(s[f].shape) != tuple(p.shape) for f in ("master", "exp_avg", "exp_avg_sq")):
            problems.append(f"{name} state has shape {tuple(s['master'].shape)}, expected {tuple(p.shape)}")
    if problems:
        raise FormatError(f"{path}: {'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}: "
                          f"the optimizer shard does not match meta.json; restore it from the source checkpoint")


def load(ckpt_dir: Path, stage: GPTStage, opt: MasterAdamW) -> tuple[int, int]:
    """Restore model, optimizer and RNG; return (iteration, consumed_samples)."""
    meta = fmt.Meta.read(ckpt_dir)
    _check_compatible(meta, stage)
    tp_rank, pp_rank, _ = _ranks()
    rank = Rank(tp_rank, pp_rank, _ep_rank(stage))
    model_path = ckpt_dir / fmt.model_file(rank)
    if not model_path.is_file():
        raise FormatError(f"{model_path}: missing shard ({rank}) of a {meta.grid} checkpoint: restore the file")
    model_state = _read(model_path, meta, "model")["model"]
    check_shard(model_path, model_state, stage, meta)
    stage.params_ready(stage)  # a weight all-gather still running from a step before ends first
    stage.load_state_dict(model_state, strict=True)
    optim_path = ckpt_dir / fmt.optimizer_file(rank)
    recorded = meta.raw.get("files", {})
    for path in (optim_path, ckpt_dir / fmt.rng_file(rank)):
        if path.name in recorded and not path.is_file():
            raise FormatError(f"{path}: missing, but meta.json records it: restore it from the source checkpoint")
    if optim_path.is_file() and not meta.fresh_optimizer:
        optim_state = _read(optim_path, meta, "optimizer")["optimizer"]
        _check_optimizer(optim_path, optim_state, stage)
        opt.load_by_key(optim_state)
    else:  # the fresh optimizer meta.json records (its masters written where they carry more than the weights), or
        # none (`ckpt import --no-optimizer`): AdamW starts fresh from the weights
        written = _read(optim_path, meta, "optimizer")["optimizer"] if optim_path.is_file() else {}
        masters = {k: s["master"] for k, s in written.items()
                   if isinstance(s, dict) and torch.is_tensor(s.get("master"))}
        wrong = [k for k, p in stage.named_parameters() if k in masters and tuple(masters[k].shape) != tuple(p.shape)]
        if wrong:
            raise FormatError(f"{optim_path}: the master of {wrong[0]} has shape {tuple(masters[wrong[0]].shape)}, the "
                              f"parameter {tuple(dict(stage.named_parameters())[wrong[0]].shape)}: the optimizer shard "
                              f"does not match meta.json; restore it from the source checkpoint")
        opt.load_by_key({k: {"master": masters[k].float() if k in masters else p.detach().float(), "exp_avg": None,
                             "exp_avg_sq": None, "step": torch.tensor(0.0)} for k, p in stage.named_parameters()})
    rng_path = ckpt_dir / fmt.rng_file(rank)
    if not rng_path.is_file():  # imported weights: no RNG or data position yet
        return meta.iteration, int(meta.raw.get("consumed_samples", 0))
    rng = _read(rng_path, meta, mmap=False)
    try:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return int(rng["iteration"]), int(rng["consumed_samples"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise FormatError(f"{rng_path}: not an RNG state of this trainer ({type(e).__name__}: {e}): "
                          f"restore it from the source checkpoint") from None
