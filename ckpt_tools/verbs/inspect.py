"""`ckpt inspect`: a readable summary of a checkpoint in our format, from meta.json and the table."""
from __future__ import annotations

import math
from pathlib import Path

from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model import hybrid, layout


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def parameter_count(meta: fmt.Meta) -> tuple[int, int]:
    """(parameters of the full model, of them padding rows): each tensor once, tied copies once."""
    total = padding = 0
    for pp_rank in range(meta.pp_size):
        for _, key in layout.stage_keys(meta.spec, meta.layer_counts, pp_rank):
            shape = layout.full_shape(key, meta.spec, meta.padded_vocab, meta.pp_size)
            if shape is None or layout.alias_of(key, meta.spec):
                continue
            total += math.prod(shape)
            if layout.has_padded_rows(key, meta.spec, meta.pp_size):
                padding += (meta.padded_vocab - meta.spec.vocab_size) * shape[1]
    return total, padding


# Resident memory of the processes themselves, rounded up from what benchmarks/merge_reshard.py measures
# (~30 MiB for a torch-free merge: Python, click and the toolkit; ~230 MiB once torch is imported).
PROCESS_RAM, TORCH_PROCESS_RAM = 64 << 20, 400 << 20


def needs(meta: fmt.Meta) -> dict[str, int]:
    """Bytes merge writes (HF, the checkpoint's dtype) and the peak RAM merge and reshard need, in bytes.

    Each holds at most two copies of one full tensor on top of the process, so none grows with the
    number of layers: merge's torch path a join and its converted copy (output dtype), reshard a join and
    its re-padded copy (fp32 optimizer fields). Merge's torch-free path (our own checkpoints, no dtype
    conversion) copies file to file and holds only the rows of a tensor it must assemble in memory: a
    row-parallel join, or a GPT-2 Conv1D weight with its transposed copy; a tensor whose HF values are arithmetic
    (Qwen3-Next's norm offsets) it joins and has torch make, and then the process holds torch as well. A merge of
    more than one output file writes two at once, each with its own such buffer.
    """
    from ckpt_tools.forms.dtypes import ELEMENT_SIZES
    from ckpt_tools.model import conversions
    from ckpt_tools.verbs.plan import plan
    size = ELEMENT_SIZES.get(meta.params_dtype, 4)
    merged = largest = buffered = 0
    made = False  # a tensor the byte path has torch make
    for e in plan(meta.spec, meta.padded_vocab, "hf"):
        merged += e.nbytes(meta.params_dtype)
        shape = layout.full_shape(e.key, meta.spec, meta.padded_vocab, 1)
        n = math.prod(shape)
        largest = max(largest, n)
        if layout.find_rule(e.key, meta.spec, 1).dim == 1:
            buffered = max(buffered, n)
        if e.kind in conversions.TRANSPOSED and len(shape) == 2 or e.kind in conversions.ARITHMETIC:
            buffered = max(buffered, 2 * n)
        made = made or e.kind in conversions.ARITHMETIC
    from ckpt_tools.verbs.merge import FILES_AT_ONCE, MAX_SHARD_SIZE
    at_once = min(FILES_AT_ONCE, -(-merged // MAX_SHARD_SIZE))  # output files written at once (the default size)
    return {"merge_bytes": merged,
            "merge_ram": (TORCH_PROCESS_RAM if made else PROCESS_RAM) + at_once * buffered * size,
            "merge_torch_free": not made,
            "merge_ram_torch": TORCH_PROCESS_RAM + 2 * largest * max(size, 2),
            "reshard_ram": TORCH_PROCESS_RAM + 2 * largest * 4}


def needs_line(meta: fmt.Meta) -> str:
    n = needs(meta)
    path = "torch-free path" if n["merge_torch_free"] else "byte path, its arithmetic tensors made by torch"
    merge = (f"merge ~{human_bytes(n['merge_ram'])} ({path}) / ~{human_bytes(n['merge_ram_torch'])} "
             "(with --dtype, --check-hashes)" if meta.source == "ckpt-tools" else
             f"merge ~{human_bytes(n['merge_ram_torch'])}")
    return (f"merge writes {human_bytes(n['merge_bytes'])} ({meta.params_dtype}); peak RAM {merge}, "
            f"reshard ~{human_bytes(n['reshard_ram'])}; none grows with the number of layers")


def describe(src: str | Path, show_tensors: bool = False, vocab_size: int | None = None) -> str:
    from ckpt_tools.forms.shards import open_checkpoint
    reader = open_checkpoint(src, vocab_size)
    meta = reader.meta
    ckpt = meta.dir
    s, raw = meta.spec, meta.raw
    heads = (f"multi-latent attention (q latent {s.q_lora_rank}, kv latent {s.kv_lora_rank}, head dims "
             f"{s.qk_head_dim} + {s.qk_pos_emb_head_dim} rotary, v {s.v_head_dim})" if s.multi_latent_attention
             else f"query groups {s.num_query_groups}, head dim {s.kv_channels}"
             + (f", rotary on {s.rotary_percent:g} of it" if s.rotary_percent != 1 else ""))
    dense = 0 if s.hybrid else s.pattern[1::2].count("-")
    act = {"swiglu": "SwiGLU", "quick_geglu": "clamped SwiGLU", "geglu_tanh": "GeGLU", "squared_relu": "squared ReLU"}
    arch = (f"{s.architecture}: {s.num_layers} layers"
            + (f" ({s.pattern}: M Mamba-2, * attention, - MLP; Mamba {s.mamba_num_heads} heads of "
               f"{s.mamba_head_dim}, {s.mamba_num_groups} groups, state {s.mamba_state_dim})" if s.hybrid else "")
            + f", hidden {s.hidden_size}, heads {s.num_attention_heads} ({heads}), ffn {s.ffn_hidden_size}, "
            f"{s.normalization} (eps {s.norm_epsilon:g}), {act.get(s.activation, 'GELU')}, "
            + (f"RoPE (base {s.rotary_base:g}{', interleaved' if s.rotary_interleaved else ''})"
               if s.position_embedding_type == "rope"
               else "no positions" if s.position_embedding_type == "none"
               else f"learned positions ({s.max_position_embeddings})")
            + f", {'tied' if s.tie_word_embeddings else 'untied'} embeddings"
            + (", biases" if s.add_bias_linear else "")
            + (f", {s.num_moe_experts} experts (top-{s.moe_router_topk}, {s.moe_ffn_hidden_size} wide"
               + (f", {s.moe_router_score_function} scores" if s.moe_router_score_function != "softmax" else "")
               + (", expert bias" if s.moe_router_enable_expert_bias else "")
               + (f", best {s.moe_router_group_topk} of {s.moe_router_num_groups} groups" if s.moe_router_num_groups
                  else "")
               + (f", weights x {s.moe_router_topk_scaling_factor:g}" if s.moe_router_topk_scaling_factor else "")
               + (f", shared expert {s.moe_shared_expert_intermediate_size} wide"
                  if s.moe_shared_expert_intermediate_size else "") + ")"
               + (f" in {s.num_layers - dense} layers, {dense} dense" if dense else "") if s.is_moe else ""))
    total, padding = parameter_count(meta)
    files = raw.get("files", {})
    size = sum(f["size"] for f in files.values())
    lines = [
        f"checkpoint  {ckpt}",
        f"iteration   {meta.iteration} ({raw.get('consumed_samples') or 0:,} samples, {raw.get('tokens_seen') or 0:,} tokens seen)",
        f"model       {arch}",
        f"vocab       {s.vocab_size:,} true, {meta.padded_vocab:,} padded ({meta.padded_vocab - s.vocab_size} padding rows)",
        f"layout      TP {meta.tp_size} x PP {meta.pp_size}{f' x EP {meta.ep_size}' if meta.ep_size > 1 else ''} (saved with DP {raw['parallel'].get('dp_size') or '?'}"
        + (f"; an interleaved pipeline, PP {meta.pp_size // raw['virtual_pipeline_model_parallel_size']} x VPP "
           f"{raw['virtual_pipeline_model_parallel_size']}, read as its virtual stages in layer order"
           if raw.get("virtual_pipeline_model_parallel_size") else "") + "); "
        f"layers per stage {','.join(map(str, meta.layer_counts))}",
        f"dtype       params {raw['dtypes']['params']}, optimizer master {raw['dtypes']['master']}"
        + (" (the fresh optimizer of iteration 0, recorded in meta.json and made from the weights: zero moments, step 0"
           + (", its fp32 masters written where they carry more than the weights)" if
              any(n.startswith("optimizer_") for n in raw.get("files", {})) else ", not written)")
           if meta.fresh_optimizer else ""),
        f"parameters  {total:,} ({total - padding:,} without vocab padding)",
        f"needs       {needs_line(meta)}",
        f"files       {len(files)} files, {human_bytes(size)}" if files else f"source      {meta.source} checkpoint"
        + (f" of a HybridModel, layer pattern {pattern.text!r}" if (pattern := hybrid.of_meta(meta)) else ""),
    ]
    width = max((len(n) for n in files), default=0)
    for name, rec in files.items():
        present = (ckpt / name).is_file()
        lines.append(f"  {name:<{width}}  {human_bytes(rec['size']):>10}  {'' if present else 'MISSING'}".rstrip())
    temps = fmt.leftover_temps(ckpt.parent) if meta.source == "ckpt-tools" else []
    if temps:
        lines.append(f"note        incomplete checkpoint dir(s) left by an interrupted save: {', '.join(temps)}")
    if show_tensors:  # the listing is the table's; the shards are loaded (allow-list) and checked against it
        from ckpt_tools.errors import FormatError, collect
        collect(reader.validate()[:5], FormatError)
        reader.close()
        lines.append("tensors     (global key: full shape, split)")
        for pp_rank in range(meta.pp_size):
            for _, key in layout.stage_keys(s, meta.layer_counts, pp_rank):
                rule = layout.find_rule(key, s, meta.pp_size)
                if rule.shape is not None:
                    shape = "x".join(map(str, rule.shape(s, meta.padded_vocab)))
                    lines.append(f"  pp{pp_rank} {key}: {shape}, {rule.split}")
    return "\n".join(lines)


# ---------------------------------------------------------------- --plan N: a team's split and its time
SAMPLE = 256 << 20  # bytes each measuring thread copies


def team_plan(src: str | Path, nproc: int, bandwidth: float | None = None, vocab_size: int | None = None) -> str:
    """How N processes (ckpt_tools.team) would split SRC's files (the bytes a reshard or merge of it moves, each
    process a contiguous run balanced by bytes, as team.split plans every output), and the time that takes at a
    bandwidth: `bandwidth` (MB/s for the whole node), else measured by copying part of SRC's largest file with
    min(N, cores) threads at once into a temp file (the system's temp dir) and fsyncing it."""
    import os

    from ckpt_tools.errors import ConfigError
    from ckpt_tools.forms.shards import open_checkpoint
    from ckpt_tools.team import split
    if nproc < 1:
        raise ConfigError(f"--plan {nproc}: give the number of processes, 1 or more")
    meta = open_checkpoint(src, vocab_size).meta
    files = sorted(p for p in meta.dir.rglob("*") if p.is_file())
    sizes = [p.stat().st_size for p in files]
    owners = split(sizes, nproc)
    measured = bandwidth is None
    if measured:
        bandwidth = _measure(max(files, key=lambda p: p.stat().st_size), min(nproc, os.cpu_count() or 1))
    per_process = bandwidth * 1e6 / nproc  # the node's bandwidth shared by its processes
    lines = [f"plan        {nproc} process(es) over {len(files)} files, {human_bytes(sum(sizes))}; "
             f"{'measured' if measured else 'given'} node bandwidth {bandwidth:,.0f} MB/s"]
    worst = 0.0
    for p in range(nproc):
        mine = [(f, n) for f, n, o in zip(files, sizes, owners) if o == p]
        nbytes = sum(n for _, n in mine)
        seconds = nbytes / per_process
        worst = max(worst, seconds)
        where = f"{mine[0][0].relative_to(meta.dir)} .. {mine[-1][0].relative_to(meta.dir)}" if mine else "-"
        lines.append(f"  process {p}: {len(mine)} files, {human_bytes(nbytes)}, ~{seconds:,.1f} s  ({where})")
    lines.append(f"expected    ~{worst:,.1f} s for the slowest process (plus a few seconds of start-up per "
                 f"process); more processes help while the disk or the network, not one core, is the limit")
    return "\n".join(lines)


def _measure(path: Path, threads: int) -> float:
    """MB/s of `threads` concurrent copies of (up to) SAMPLE bytes each of `path` into a temp file, fsynced."""
    import os
    import tempfile
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ckpt_tools.durable import copy_range
    size = path.stat().st_size
    chunk = max(1, min(SAMPLE, size // threads))
    src = os.open(path, os.O_RDONLY)
    fd, name = tempfile.mkstemp(prefix="ckpt-plan-")
    try:
        def copy(i: int) -> None:
            copy_range(src, (i * chunk) % max(1, size - chunk + 1), fd, i * chunk, chunk)
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(copy, range(threads)))
        os.fsync(fd)
        return threads * chunk / (time.perf_counter() - start) / 1e6
    finally:
        os.close(src)
        os.close(fd)
        os.unlink(name)
