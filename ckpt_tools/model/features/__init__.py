"""Model features as units: each ModelSpec feature a family fixes (the norm, the activation, biases, q/k norms,
positions, tying, MoE routing, ...) is one `Feature` record (`features/base.py`) in this package's module of its area,
holding its allowed values and default, and Megatron-LM's arguments for it both ways (read, written, the load
command's flags, the refusal where Megatron-LM's forms cannot hold it). What it adds to the layout table (its rows'
`when`), to the trainer (its module) and to a family's config.json (the family's `config`) stays there.

Adding a feature: its record in the area's module (or a new one), its line in `ALL`, its ModelSpec field (`spec.py`,
default None: the family's default), and the families that allow other values than its default name them.
"""
from __future__ import annotations

from ckpt_tools.errors import ConfigError
from ckpt_tools.model.features import attention, embeddings, mlp, moe, norms, positions
from ckpt_tools.model.features.base import Feature

# In the order a misfit message names them.
ALL: tuple[Feature, ...] = (
    mlp.ACTIVATION, norms.NORMALIZATION, positions.POSITIONS, mlp.BIAS, attention.QKV_BIAS, norms.QK_NORM,
    positions.ROPE_SCALING, embeddings.TIED, moe.SHARED_EXPERT_GATE, attention.MLA, moe.SCORE_FUNCTION,
    moe.EXPERT_BIAS, attention.SOFTMAX, mlp.GLU_OFFSET, norms.ZERO_CENTERED, attention.OUTPUT_GATE,
    norms.QK_NORM_ACROSS_HEADS, embeddings.SCALED, positions.ROTARY_INTERLEAVED,
)
BY_NAME: dict[str, Feature] = {f.name: f for f in ALL}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def from_megatron(args) -> dict:
    """A checkpoint's Megatron-LM arguments -> the ModelSpec feature fields they say (those Megatron-LM can say)."""
    return {f.name: f.read(args) for f in ALL if f.read is not None}


def misfits(bad: dict) -> list[str]:
    """Features that fit no family, {feature: (found, allowed values)}, in Megatron-LM's argument terms."""
    out = []
    for f in ALL:
        if f.name in bad and f.arg is not None:
            found, allowed = bad[f.name]
            shown = f.shown or (lambda v: v)
            if shown(found) not in {shown(v) for v in allowed}:
                wants = sorted({repr(shown(v)) for v in allowed})
                out.append(f"{f.arg}={shown(found)!r} (needs {' or '.join(wants)})")
    return out


def megatron_args(spec) -> dict:
    """The features' Megatron-LM arguments of a written checkpoint."""
    out: dict = {}
    for f in ALL:
        written = f.write(spec)
        if out.keys() & written.keys():  # each argument has one owner
            raise ValueError(f"{f.name} writes {sorted(out.keys() & written.keys())}, another feature's arguments")
        out.update(written)
    return out


def load_flags(spec) -> str:
    """The load command's flags of the features that Megatron-LM's --use-checkpoint-args does not restore."""
    return "".join(f.flags(spec) for f in ALL)


def check_expressible(spec) -> None:
    """Refuse a model whose features Megatron-LM's arguments cannot say (ConfigError, the first feature's reason)."""
    for f in ALL:
        why = f.refuse(spec)
        if why is not None:
            raise ConfigError(why)
