"""`ckpt inspect`: a readable summary of a checkpoint in our format, from meta.json and the table."""
from __future__ import annotations

import math
from pathlib import Path

from ckpt_tools import checkpoint as fmt
from ckpt_tools import layout


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
            rule = layout.find_rule(key, meta.spec, meta.pp_size)
            if rule.shape is None or (key == "output_layer.weight" and meta.spec.tie_word_embeddings):
                continue
            shape = rule.shape(meta.spec, meta.padded_vocab)
            total += math.prod(shape)
            if rule.split == layout.VOCAB:
                padding += (meta.padded_vocab - meta.spec.vocab_size) * shape[1]
    return total, padding


def describe(src: str | Path, show_tensors: bool = False) -> str:
    ckpt = fmt.resolve(src)
    meta = fmt.Meta.read(ckpt)
    s, raw = meta.spec, meta.raw
    arch = (f"{s.architecture}: {s.num_layers} layers, hidden {s.hidden_size}, heads {s.num_attention_heads} "
            f"(query groups {s.num_query_groups}, head dim {s.kv_channels}), ffn {s.ffn_hidden_size}, "
            f"{s.normalization} (eps {s.norm_epsilon:g}), {'SwiGLU' if s.gated_linear_unit else 'GELU'}, "
            + (f"RoPE (base {s.rotary_base:g})" if s.position_embedding_type == "rope"
               else f"learned positions ({s.max_position_embeddings})")
            + f", {'tied' if s.tie_word_embeddings else 'untied'} embeddings"
            + (", biases" if s.add_bias_linear else ""))
    total, padding = parameter_count(meta)
    files = raw.get("files", {})
    size = sum(f["size"] for f in files.values())
    lines = [
        f"checkpoint  {ckpt}",
        f"iteration   {meta.iteration} ({raw.get('consumed_samples', 0):,} samples, {raw.get('tokens_seen', 0):,} tokens seen)",
        f"model       {arch}",
        f"vocab       {s.vocab_size:,} true, {meta.padded_vocab:,} padded ({meta.padded_vocab - s.vocab_size} padding rows)",
        f"layout      TP {meta.tp_size} x PP {meta.pp_size} (saved with DP {raw['parallel'].get('dp_size', '?')}); "
        f"layers per stage {','.join(map(str, meta.layer_counts))}",
        f"dtype       params {raw['dtypes']['params']}, optimizer master {raw['dtypes']['master']}",
        f"parameters  {total:,} ({total - padding:,} without vocab padding)",
        f"files       {len(files)} files, {human_bytes(size)}",
    ]
    width = max((len(n) for n in files), default=0)
    for name, rec in files.items():
        present = (ckpt / name).is_file()
        lines.append(f"  {name:<{width}}  {human_bytes(rec['size']):>10}  {'' if present else 'MISSING'}".rstrip())
    temps = fmt.leftover_temps(ckpt.parent)
    if temps:
        lines.append(f"note        incomplete checkpoint dir(s) left by an interrupted save: {', '.join(temps)}")
    if show_tensors:
        lines.append("tensors     (global key: full shape, split)")
        for pp_rank in range(meta.pp_size):
            for _, key in layout.stage_keys(s, meta.layer_counts, pp_rank):
                rule = layout.find_rule(key, s, meta.pp_size)
                if rule.shape is not None:
                    shape = "x".join(map(str, rule.shape(s, meta.padded_vocab)))
                    lines.append(f"  pp{pp_rank} {key}: {shape}, {rule.split}")
    return "\n".join(lines)
