"""Reading real Megatron-LM checkpoints (DESIGN.md Contract 3): the save dir, its forms, and the
legacy `--ckpt-format torch` reader:

    CKPT/latest_checkpointed_iteration.txt                       "100" or "release"
    CKPT/iter_0000100/mp_rank_<TT>/model_optim_rng.pt            torch, PP = 1
    CKPT/iter_0000100/mp_rank_<TT>_<PPP>/model_optim_rng.pt      torch, PP > 1
    CKPT/iter_0000100/{metadata.json, .metadata, *.distcp, common.pt}   torch_dist (forms/torch_dist.py)
    CKPT/release/...                                             when the tracker says "release"

Each legacy file holds `args` (an argparse.Namespace), `model` (megatron-core GPTModel state dict, the
layout table's keys with stage-local layer numbers; local-spec or Transformer Engine names, see
names.py), `iteration`, `checkpoint_version`, `rng_state`, `optimizer`, `opt_param_scheduler`. Only
`args` and the model keys of the (tp0, pp0) file are read here, through io.load_file's allow-list;
forms/megatron_torch.py reads the tensors later. Argument names are
Megatron-LM's; two were renamed when the arguments became generated from TransformerConfig
(norm_epsilon -> layernorm_epsilon, apply_layernorm_1p -> layernorm_zero_centered_gamma), and
older Namespaces lack newer arguments, so every lookup has a default (megatron_spec.py maps them to a
ModelSpec).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ckpt_tools import io
from ckpt_tools.errors import ConfigError, FormatError
from ckpt_tools.forms.checkpoint import Meta
from ckpt_tools.forms.megatron_spec import expert_parallel, expert_tensor_parallel, layout_of, virtual_stages
from ckpt_tools.model import hybrid, layout, names
from ckpt_tools.model.features.base import arg
from ckpt_tools.model.ranks import Grid, Rank
from ckpt_tools.model.spec import ModelSpec

TRACKER = "latest_checkpointed_iteration.txt"
DISTRIB_OPTIM = "distrib_optim.pt"  # the distributed optimizer's state beside a legacy rank file
FILE = "model_optim_rng.pt"
RELEASE = "release"
_ITER_DIR = re.compile(r"^iter_\d{7,}$")
def _mp_rank(rank: Rank, pp_size: int) -> str:
    """Megatron-LM's rank dir: mp_rank_TT, then _PPP with pipeline parallelism, then _EEE with expert parallelism."""
    return (f"mp_rank_{rank.tp:02d}" + (f"_{rank.pp:03d}" if pp_size > 1 else "")
            + (f"_{rank.ep:03d}" if rank.ep is not None else ""))


def model_path(iter_dir: Path, rank: Rank, pp_size: int) -> Path:
    """Megatron-LM's get_checkpoint_name: iter_dir/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt."""
    return Path(iter_dir) / _mp_rank(rank, pp_size) / FILE


def _is_iter_dir(path: Path) -> bool:
    return (path.name == RELEASE or bool(_ITER_DIR.match(path.name))) and path.is_dir()


TORCH, TORCH_DIST, TORCH_DCP, FSDP_DTENSOR = "torch", "torch_dist", "torch_dcp", "fsdp_dtensor"
FSDP_MODEL = "model.module."  # Megatron-FSDP's model keys (fsdp_dtensor); torch_dcp's are model.<name>
DIST_MARKERS = ("metadata.json", ".metadata")  # metadata.json: dist_checkpointing; .metadata: DCP


def is_megatron_lm(path) -> bool:
    """A Megatron-LM save dir (holds the tracker) or one iter_NNNNNNN / release dir of one."""
    path = Path(path)
    if (path / TRACKER).is_file():
        return True
    return _is_iter_dir(path) and (any(p.is_dir() for p in path.glob("mp_rank_*"))
                                   or any((path / n).is_file() for n in DIST_MARKERS))


def by_dcp(iter_dir: Path) -> bool:
    """Written through torch.distributed.checkpoint (torch_dist, torch_dcp or fsdp_dtensor), told from the files'
    names alone; else the legacy per-rank files."""
    return (iter_dir / "metadata.json").is_file() or ((iter_dir / ".metadata").is_file()
                                                      and not any(iter_dir.glob("mp_rank_*")))


def dcp_form(iter_dir: Path, index) -> str:
    """torch_dcp or fsdp_dtensor: a .metadata without metadata.json, told apart by its model keys."""
    if not any(k.startswith("model.") for k in index.tensors) or "args" not in index.blobs:
        raise FormatError(f"{iter_dir}: a .metadata without metadata.json, but no model.* tensors and args: not a "
                          f"Megatron-LM torch_dcp or fsdp_dtensor checkpoint; restore it from the source")
    return FSDP_DTENSOR if any(k.startswith(FSDP_MODEL) for k in index.tensors) else TORCH_DCP


def resolve_iter_dir(path: Path) -> Path:
    """A Megatron-LM save dir (through its tracker) or iter dir -> the iter dir to read."""
    return _iter_dir(Path(path))


def _iter_dir(path: Path) -> Path:
    """The top dir (via the tracker) or an iter dir -> the iter dir to read."""
    tracker = path / TRACKER
    if not tracker.is_file():
        if _is_iter_dir(path):
            return path
        raise FormatError(f"{path}: not a Megatron-LM checkpoint (no {TRACKER}, not an iter_NNNNNNN or "
                          f"{RELEASE} dir): pass the --save dir of the run or one of its iteration dirs")
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{tracker}: unreadable ({type(e).__name__}): it must hold an iteration number "
                          f"or 'release'; pass an iter_NNNNNNN dir directly") from None
    if text == RELEASE:
        name = RELEASE
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise FormatError(f"{tracker}: holds {text[:40]!r}, expected an iteration number or 'release': "
                          f"fix the file or pass an iter_NNNNNNN dir directly")
    if not (path / name).is_dir():
        found = sorted(p.name for p in path.iterdir() if _is_iter_dir(p))
        raise FormatError(f"{tracker} names {text!r} but {path / name} does not exist (found: "
                          f"{', '.join(found) or 'no iteration dirs'}): fix the tracker or pass an existing iter dir")
    return path / name


def _first_file(iter_dir: Path) -> Path:
    """The (tp0, pp0[, ep0]) file, named any way (args say which naming is right; checked later)."""
    names = list(dict.fromkeys(model_path(iter_dir, rank, pp_size) for rank in (Rank(0, 0), Rank(0, 0, 0))
                               for pp_size in (1, 2)))  # mp_rank_00_000 is both PP rank 0's and EP rank 0's
    for path in names:
        if path.is_file():
            return path
    raise FormatError(f"{iter_dir}: none of {', '.join(p.parent.name for p in names)} holds {FILE}: the TP rank 0 / "
                      f"PP rank 0 file is missing; restore it from the source")


def _check_rank_dirs(iter_dir: Path, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    grid = Grid(tp_size, pp_size, ep_size)
    ranks = grid.ranks()
    expected = {_mp_rank(rank, pp_size) for rank in ranks}
    what = f"{grid} (from args) expects {_mp_rank(ranks[0], pp_size)}..{_mp_rank(ranks[-1], pp_size)}"
    missing = sorted(n for n in expected if not (iter_dir / n / FILE).is_file())
    if missing:
        raise FormatError(f"{iter_dir / missing[0] / FILE}: missing ({len(missing)} of {len(expected)} rank files "
                          f"missing): {what}; restore the missing rank dirs from the source")
    extra = sorted(p.name for p in iter_dir.glob("mp_rank_*") if p.name not in expected)
    if extra:
        raise FormatError(f"{iter_dir / extra[0]}: unexpected rank dir ({len(extra)} extra: {', '.join(extra[:4])}): "
                          f"{what}; the dir mixes checkpoints of different parallel layouts, remove the extra dirs")


def _check_model_keys(path: Path, state: dict) -> None:
    model = state.get("model")
    if not isinstance(model, dict):
        raise FormatError(f"{path}: no 'model' state dict (found {', '.join(sorted(map(str, state))[:8])}): "
                          f"not a single-chunk Megatron-LM model file; pass a GPT checkpoint saved by pretrain_gpt.py")
    qkv_order(path, state)


def qkv_order(path: Path, state: dict) -> int | None:
    """The legacy fused-QKV row order to undo: 0 ([3, np, hn] per TP rank, checkpoint_version 0) or 1 ([np, hn, 3],
    version 1.0); None when the rows are megatron-core's ([np, 3, hn]: versions 2.0 and 3.0, and every
    megatron-core model). What Megatron-LM's fix_query_key_value_ordering undoes at load."""
    model = state.get("model")
    version = state.get("checkpoint_version", 0)
    if not (isinstance(model, dict) and names.is_legacy(model)):
        return None
    if not isinstance(version, (int, float)) or isinstance(version, bool) or version not in (0, 1, 2, 3):
        raise FormatError(f"{path}: checkpoint_version {version!r} is not one Megatron-LM has written (0, 1.0, 2.0, "
                          f"3.0): the file is damaged or not Megatron-LM's; restore it from the source")
    if version >= 2:
        return None
    args = state.get("args")
    if arg(args, "group_query_attention", False) and arg(args, "num_query_groups", None) != arg(
            args, "num_attention_heads", None):
        raise FormatError(f"{path}: checkpoint_version {version} with grouped-query attention, which no Megatron-LM "
                          f"of that version wrote: the file is damaged; restore it from the source")
    return int(version)


def qkv_runs(order: int, heads_per_rank: int, head_dim: int) -> list[tuple[int, int]]:
    """The rows of one TP rank's fused QKV weight or bias in a legacy row order (qkv_order), as runs (first stored row,
    rows) in megatron-core's order [np, 3, hn]: order 0 stores [3, np, hn] (a run of hn rows per head and q, k or v),
    order 1 [np, hn, 3] (one row per run)."""
    if order == 0:
        return [((t * heads_per_rank + n) * head_dim, head_dim) for n in range(heads_per_rank) for t in range(3)]
    return [((n * head_dim + h) * 3 + t, 1) for n in range(heads_per_rank) for t in range(3) for h in range(head_dim)]


QKV = ("linear_qkv.weight", "linear_qkv.bias")  # the fused QKV tensors a legacy row order applies to


def reorder_qkv(t, order: int, heads_per_rank: int, head_dim: int, where: object = None):
    """One TP rank's fused QKV weight or bias from a legacy row order (qkv_order) to [np, 3, hn]."""
    import torch
    if t.dim() == 0 or t.shape[0] != 3 * heads_per_rank * head_dim:
        raise FormatError(f"{where}: fused QKV of shape {tuple(t.shape)}, expected {3 * heads_per_rank * head_dim} rows "
                          f"(3 x {heads_per_rank} heads a rank x {head_dim}): the file is damaged; restore it from the "
                          f"source")
    return torch.cat([t[a:a + n] for a, n in qkv_runs(order, heads_per_rank, head_dim)])


def expert_weight(key: str, spec: ModelSpec) -> bool:
    """A tensor of an expert (weights or biases): what a legacy file of experts held whole (ETP 1) or grouped holds
    otherwise than the layout table's shards."""
    return layout.expert_index(key) is not None and layout.holds_weights(key, spec, None)


def args_of(path: Path, state) -> object:
    """The `args` Namespace of a legacy file or of a torch_dist checkpoint's common state."""
    args = state.get("args") if isinstance(state, dict) else None
    if args is None or not hasattr(args, "num_layers"):
        raise FormatError(f"{path}: holds no Megatron-LM 'args' Namespace: cannot tell the model or its "
                          f"parallel layout; pass a checkpoint saved by Megatron-LM's training loop")
    return args


def meta_of(path: Path, iter_dir: Path, args, state: dict, spec: ModelSpec, tp: int, pp: int, counts: list[int],
            padded: int, source: str, ep: int = 1) -> Meta:
    """The Meta of a Megatron-LM checkpoint (any form): `path` holds its args, `state` its common state."""
    if not isinstance(padded, int) or isinstance(padded, bool):
        raise FormatError(f"{path}: padded_vocab_size is {padded!r:.40}, expected an integer: the args are damaged; "
                          f"restore the file from the source")
    if spec.vocab_size > padded:
        raise ConfigError(f"{path}: true vocab {spec.vocab_size} exceeds padded_vocab_size {padded}: "
                          f"pass the tokenizer's vocab size with --vocab-size")
    iteration = state.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise FormatError(f"{path}: 'iteration' is {iteration!r:.40}, expected an integer >= 0 (Megatron-LM always "
                          f"saves it): the file is damaged; restore it from the source")
    dtype = "bfloat16" if arg(args, "bf16", False) else "float16" if arg(args, "fp16", False) else "float32"
    raw = {
        "format": source,
        "model": spec.to_dict(),
        "parallel": {"tp_size": tp, "pp_size": pp, "dp_size": None, "layers_per_stage": counts},
        "vocab": {"true": spec.vocab_size, "padded": padded, "divisible_by": spec.make_vocab_size_divisible_by,
                  "padding": "unknown"},
        "iteration": iteration,
        "consumed_samples": arg(args, "consumed_train_samples"),
        "dtypes": {"params": dtype, "master": "float32"},
        "files": {},
        "checkpoint_version": state.get("checkpoint_version"),
    }
    pattern = hybrid.pattern_of(args)
    if pattern is not None:  # a HybridModel's: written again where the output is Megatron-LM's
        raw[hybrid.PATTERN] = pattern.text
    return Meta(path=path, raw=raw, spec=spec, tp_size=tp, pp_size=pp, layer_counts=counts, padded_vocab=padded,
                iteration=iteration, source=source, root=iter_dir, ep_size=ep)


def model_state(obj, where: object = None, split: bool = True) -> dict | None:
    """A legacy file's model state dict with the layout table's names (Transformer Engine's renamed, a legacy
    model's flattened and renamed, GroupedMLP's experts split unless `split` is False: `where` names the file)."""
    model = obj.get("model") if isinstance(obj, dict) else None
    if not isinstance(model, dict):
        return None
    if names.is_legacy(model):
        return {names.from_legacy(k): v for k, v in names.flatten(model).items()}
    fused = next((k for k in model if names.is_mla_te(k)), None)
    if fused is not None:
        raise FormatError(f"{where}: {fused}: a multi-latent attention model under Transformer Engine's spec, whose "
                          f"legacy files keep the down projections whole on every TP rank, which this version does "
                          f"not read in the legacy form: save the run with --ckpt-format torch_dist (read at any "
                          f"layout)")
    state = {names.from_te_grouped(names.from_te(k)): v for k, v in model.items() if not names.te_module_extra(k)}
    state.pop(None, None)
    try:
        pattern = hybrid.pattern_of(obj.get("args"))
        if pattern is not None:  # a HybridModel's: per layer index, each stage's from 0
            state = {hybrid.from_hybrid(names.from_mamba(k), pattern.single): v for k, v in state.items()}
    except ConfigError as e:
        raise FormatError(f"{where}: {e}; restore the checkpoint from the source") from None
    if split and grouped_experts(model):
        _split_grouped(where, state, arg(obj.get("args"), "num_experts", 0) // arg(obj.get("args"),
                                                                                    "expert_model_parallel_size", 1))
    return state


def grouped_experts(model: dict) -> bool:
    """The legacy GroupedMLP's experts (--moe-use-legacy-grouped-gemm): a layer's local experts in two tensors."""
    return any(str(k).endswith(GROUPED) for k in model)


GROUPED = (".mlp.experts.weight1", ".mlp.experts.weight2")  # a layer's legacy GroupedMLP tensors


def _split_grouped(where: object, state: dict, local: int) -> None:
    """GroupedMLP's weight1 [hidden, E_local * fc1 rows] and weight2 [E_local * ffn, hidden] (each expert's block is
    its SequentialMLP weight transposed, as megatron-core's GroupedMLP views them: [E_local, hidden, fc1 rows] and
    [E_local, ffn, hidden]) -> each expert's tensors under the table's names (copies: a transpose is not a byte
    range)."""
    for key in [k for k in state if k.endswith(GROUPED)]:
        w, base = state.pop(key), key[:-len("weight1")]
        fc1 = key.endswith("1")
        if local < 1 or w.dim() != 2 or w.shape[1 if fc1 else 0] % local:
            raise FormatError(f"{where}: {key}: grouped experts of shape {tuple(w.shape)} do not split into {local} local "
                              f"experts (num_experts / expert_model_parallel_size in the args): the args or the "
                              f"file are damaged; restore them from the source")
        blocks = w.reshape(local, w.shape[0], -1) if fc1 else w.reshape(local, -1, w.shape[1])
        for e in range(local):
            state[f"{base}local_experts.{e}.linear_fc{1 if fc1 else 2}.weight"] = blocks[e].t().contiguous()


def read_meta(path, vocab_size: int | None = None, load: Callable = io.load_file) -> Meta:
    """A Megatron-LM save dir or iter dir in the torch form -> Meta (source 'megatron-lm', root = the iter dir).
    `load` reads the first rank's file: torch's allow-listed loader, or the torch-free torchfile.read."""
    iter_dir = _iter_dir(Path(path))
    first = _first_file(iter_dir)
    state = load(first)
    args = args_of(first, state)
    spec, tp, pp, counts = layout_of(first, args, vocab_size)
    ep = expert_parallel(args)
    if expert_tensor_parallel(args) == 1 and tp > 1 and ep > 1:
        raise ConfigError(f"{first}: experts whole (expert_tensor_parallel_size 1) at TP {tp} with EP {ep} in the legacy "
                          f"form: megatron-core then spreads the experts over the TP ranks too, which this version does "
                          f"not read; save the run with --ckpt-format torch_dist")
    if expert_tensor_parallel(args) not in (tp, 1):
        raise ConfigError(f"{first}: expert_tensor_parallel_size {expert_tensor_parallel(args)} differs from "
                          f"tensor_model_parallel_size {tp} and from 1: this version reads the legacy form's experts "
                          f"split over TP as the dense layers, or whole (ETP 1); save the run with --ckpt-format "
                          f"torch_dist")
    _check_rank_dirs(iter_dir, tp, pp, ep)
    vpp, counts = virtual_stages(first, args, counts)
    _check_model_keys(first, chunk(state, 0, vpp, first))
    padded = arg(args, "padded_vocab_size")
    if padded is None:
        padded = model_state(chunk(state, 0, vpp, first), first,
                             split=False)["embedding.word_embeddings.weight"].shape[0] * tp
    if spec.mtp_num_layers and pp * vpp > 1:
        raise ConfigError(f"{first}: multi-token prediction layers at PP {pp * vpp} in the legacy form (its last stage "
                          f"keeps an embedding copy of its own): not read by this version; save the run with "
                          f"--ckpt-format torch_dist, or at PP 1")
    meta = meta_of(first, iter_dir, args, state, spec, tp, pp * vpp, counts, padded, "megatron-lm", ep)
    if vpp > 1:  # an interleaved pipeline, read as PP x VPP stages in layer order (virtual_file gives each one's file)
        meta.raw[VIRTUAL] = vpp
    if expert_tensor_parallel(args) != tp:  # experts whole in every TP rank's file (ETP 1)
        meta.raw[WHOLE_EXPERTS] = True
    return meta


WHOLE_EXPERTS = "experts_whole"  # in Meta.raw: a legacy file holds its experts whole (ETP 1 at TP > 1)


VIRTUAL = "virtual_pipeline_model_parallel_size"  # in an interleaved pipeline's Meta.raw: its VPP


def virtual_file(meta: Meta, rank: Rank) -> tuple[Rank, int, int]:
    """(the rank whose file holds it, its model chunk, that file's PP size) of a rank of a Megatron-LM checkpoint as
    read: virtual stage s of an interleaved pipeline is chunk s // PP of PP rank s % PP; else (rank, 0, PP)."""
    vpp = meta.raw.get(VIRTUAL, 1)
    pp = meta.pp_size // vpp
    return Rank(rank.tp, rank.pp % pp, rank.ep), rank.pp // pp, pp


def chunk_ranks(rank: Rank, pp: int, vpp: int) -> list[Rank]:
    """The virtual stages whose model chunks the legacy file of `rank` (of PP `pp`) holds, in chunk order: chunk v is
    stage v * PP + rank.pp (virtual_file's inverse); [rank] without an interleaved pipeline."""
    return [Rank(rank.tp, v * pp + rank.pp, rank.ep) for v in range(vpp)]


def chunk_name(v: int, vpp: int) -> str:
    """The key of model chunk v in a legacy file: `model`, or `model<v>` with virtual pipeline stages."""
    return f"model{v}" if vpp > 1 else "model"


def chunk(obj, v: int, vpp: int, where: object):
    """A legacy file's object with its model chunk `v` as its `model` (Megatron-LM saves chunk v as `model<v>` when
    there are virtual pipeline stages)."""
    if vpp == 1 or not isinstance(obj, dict):
        return obj
    if not isinstance(obj.get(f"model{v}"), dict):
        found = ", ".join(sorted(k for k in map(str, obj) if k.startswith("model"))) or "none"
        raise FormatError(f"{where}: no model chunk 'model{v}' (found {found}), but the args say {vpp} virtual pipeline "
                          f"stages: the file is damaged or not this checkpoint's; restore it from the source")
    return {**obj, "model": obj[f"model{v}"]}
