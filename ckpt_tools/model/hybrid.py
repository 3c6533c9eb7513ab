"""megatron-core's `HybridModel` (0.19's successor to GPTModel): a stack of blocks, one per layer index, chosen by a
pattern (Megatron-LM's `--hybrid-layer-pattern`, `hybrid_override_pattern` in older saves):

    *  attention (self_attention.*, its norm input_layernorm)     -  dense MLP (mlp.*, its norm pre_mlp_layernorm)
    E  MoE MLP (mlp.router, mlp.experts, pre_mlp_layernorm)      |  a pipeline segment ends   /  MTP depths follow
    M  Mamba-2 (mixer.*, its norm)   G  gated DeltaNet   D  DeepSeek sparse attention   +  MLA

A pattern with Mamba-2 layers is a hybrid family's (Nemotron-H): each of its indices is one layer of the layout table.

A GPTModel layer is the pair "attention + MLP": the layout table's layer i is the pattern's pair i, its attention at
index 2i and its MLP at 2i+1 (`*-*-...` is a Llama, `*E*E...` a mixture of experts). This module is the one place
that knows how the pattern places the table's layer tensors: it maps the table's keys to a HybridModel's and back,
and gives the pipeline split the pattern's segments make. Blocks the table has no rows for yet are refused in one
line naming the symbol. The final norm is `decoder.final_norm` (GPTModel's `decoder.final_layernorm`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt_tools.errors import ConfigError

ATTENTION, MLP, MOE, PIPE, MTP, MAMBA, GDN = "*", "-", "E", "|", "/", "M", "G"
PATTERN = "hybrid_layer_pattern"  # Megatron-LM's argument; a Megatron-LM source's Meta.raw keeps it under this key
_UNSUPPORTED = {"D": "DeepSeek sparse attention", "+": "multi-latent attention"}
# a layer tensor's block, by its name within the layer (the layout table's local-spec names)
_ATTENTION_PARTS = ("input_layernorm.", "self_attention.")  # attention's, or a gated DeltaNet's ('G')
_MLP_PARTS = ("pre_mlp_layernorm.", "mlp.")
FINAL = ("decoder.final_layernorm.", "decoder.final_norm.")  # (GPTModel's, HybridModel's)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Pattern:
    """A parsed layer pattern of attention + MLP pairs: `text` as recorded, `moe` whether the MLPs are MoE layers,
    `segments` the pipeline segments' lengths in layer indices (None: the pattern has no '|'). `single`: a Mamba
    hybrid's pattern (it holds 'M'), each index one layer of the layout table (a hybrid family's: 'M', '*', '-')."""
    text: str
    moe: bool
    segments: tuple[int, ...] | None
    single: bool = False

    @classmethod
    def parse(cls, text: str, where: str = "hybrid_layer_pattern") -> Pattern:
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{where} is {text!r:.40}, expected a layer pattern such as '*-*-'")
        if MTP in text:
            raise ConfigError(f"{where} {text!r}: multi-token prediction depths ('{MTP}') are not read by this "
                              f"version: convert the checkpoint without them (a pattern of '*', '-', 'E' and '|')")
        main = text.replace(PIPE, "")
        if MAMBA in main:
            return cls._single(text, where)
        known = {ATTENTION, GDN, MLP, MOE}
        for symbol in main:
            if symbol not in known:
                what = _UNSUPPORTED.get(symbol)
                raise ConfigError(f"{where} {text!r}: layer symbol {symbol!r} ("
                                  + (f"{what} blocks, not read by this version" if what else "not a layer symbol")
                                  + "): this version reads patterns of attention + MLP pairs ('*-', '*E')")
        pairs = [main[i:i + 2] for i in range(0, len(main), 2)]
        bad = [i for i, p in enumerate(pairs) if len(p) != 2 or p[0] not in (ATTENTION, GDN) or p[1] not in (MLP, MOE)]
        if bad:
            i = bad[0]
            raise ConfigError(f"{where} {text!r}: layer indices {2 * i}-{2 * i + 1} are {pairs[i]!r}, expected an "
                              f"attention layer followed by an MLP ('*-' or '*E'): this version reads patterns of "
                              f"attention + MLP pairs, as GPT models are")
        kinds = {p[1] for p in pairs}
        segments = None
        if PIPE in text:
            segments = tuple(len(s) for s in text.split(PIPE))
            for i, segment in enumerate(text.split(PIPE)):
                if not segment:
                    raise ConfigError(f"{where} {text!r}: pipeline segment {i} is empty (a stage without layers), "
                                      f"which this version does not read: every stage holds attention + MLP pairs")
                if len(segment) % 2:
                    raise ConfigError(f"{where} {text!r}: pipeline segment {segment!r} splits an attention + MLP "
                                      f"pair: this version reads segments of whole pairs")
        return cls(text, MOE in kinds, segments)

    @classmethod
    def _single(cls, text: str, where: str) -> Pattern:
        """A Mamba hybrid's pattern: Mamba-2, attention and MLP layers, one per index."""
        bad = sorted(set(text) - set(MAMBA + ATTENTION + MLP + PIPE))
        if bad:
            what = {MOE: "MoE layers in a Mamba hybrid (Nemotron 3's), not read by this version",
                    **{k: f"{v} blocks, not read by this version" for k, v in _UNSUPPORTED.items()}}
            raise ConfigError(f"{where} {text!r:.80}: layer symbol {bad[0]!r} ({what.get(bad[0], 'not a layer symbol')})"
                              f": this version reads Mamba hybrids of 'M', '*' and '-' layers")
        segments = tuple(len(s) for s in text.split(PIPE)) if PIPE in text else None
        if segments is not None and 0 in segments:
            raise ConfigError(f"{where} {text!r:.80}: a pipeline segment is empty (a stage without layers), which this "
                              f"version does not read")
        return cls(text, False, segments, True)

    @classmethod
    def for_layers(cls, counts: list[int], layers: str, single: bool = False) -> Pattern:
        """The pattern of a model of these per-stage layer counts and layer pattern (ModelSpec.pattern): a GPT model's
        pairs, or a hybrid model's layers (`single`), a segment per pipeline stage."""
        if single:  # a hybrid family's layers, one per index, whether or not a Mamba layer is among them
            starts = [sum(counts[:p]) for p in range(len(counts) + 1)]
            return cls._single(PIPE.join(layers[starts[p]:starts[p + 1]] for p in range(len(counts))), PATTERN)
        pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
        starts = [sum(counts[:p]) for p in range(len(counts) + 1)]
        return cls.parse(PIPE.join("".join(pairs[starts[p]:starts[p + 1]]) for p in range(len(counts))))

    @property
    def num_indices(self) -> int:
        """Megatron-LM's num_layers: one per symbol."""
        return len(self.text.replace(PIPE, ""))

    @property
    def num_layers(self) -> int:
        """The layout table's layers (attention + MLP pairs; a Mamba hybrid's indices)."""
        return self.num_indices if self.single else self.num_indices // 2

    def stage_counts(self, pp_size: int, first: int | None = None, last: int | None = None) -> list[int]:
        """Layout-table layers on each PP stage: the pattern's segments, or, when it has none, megatron-core's split
        of its layer indices (select_pipeline_segment: even, or `first` / `last` indices on the first / last stage
        and the rest even); each stage's share must be whole pairs."""
        if self.segments is not None:
            if len(self.segments) != pp_size:
                raise ConfigError(f"hybrid_layer_pattern {self.text!r} has {len(self.segments)} pipeline segments "
                                  f"but pipeline_model_parallel_size is {pp_size}: virtual pipeline stages are not "
                                  f"read by this version")
            if first is not None or last is not None:
                raise ConfigError(f"hybrid_layer_pattern {self.text!r} has '|' segments and the args set "
                                  f"decoder_first/last_pipeline_num_layers too: megatron-core refuses both at once")
            return list(self.segments) if self.single else [n // 2 for n in self.segments]
        n = self.num_indices
        ends = [x for x in (first, last) if x is not None]
        middle = pp_size - len(ends)
        rest = n - sum(ends)
        if (middle and rest % middle) or (not middle and rest) or rest < 0:
            raise ConfigError(f"hybrid_layer_pattern {self.text!r}: its {n} layer indices do not split into "
                              f"{pp_size} pipeline stages (first {first}, last {last}): the args are inconsistent")
        counts = [rest // middle if middle else 0] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        if self.single:
            if 0 in counts:
                raise ConfigError(f"hybrid_layer_pattern {self.text!r}: its {n} layer indices split into stages of "
                                  f"{counts}, a stage without layers, which this version does not read")
            return counts
        if any(c % 2 or c == 0 for c in counts):
            raise ConfigError(f"hybrid_layer_pattern {self.text!r}: its {n} layer indices split into stages of "
                              f"{counts} indices, not whole attention + MLP pairs on every stage, which this version "
                              f"reads")
        return [c // 2 for c in counts]


def to_hybrid(key: str, single: bool = False) -> str:
    """A layout-table key (layer i: GPTModel's numbering) -> its HybridModel key (index 2i or 2i+1; a Mamba hybrid's
    layer i is index i, `single`)."""
    m = _LAYER.match(key)
    if m is None or single:
        return FINAL[1] + key[len(FINAL[0]):] if key.startswith(FINAL[0]) else key
    i, name = int(m.group(1)), m.group(2)
    return f"decoder.layers.{2 * i + _block(key, name)}.{name}"


def from_hybrid(key: str, single: bool = False) -> str:
    """A HybridModel key -> the layout table's (the inverse of to_hybrid); a tensor of one block at an index the
    pattern gives the other (an MLP's at an attention index) is a ConfigError naming both."""
    m = _LAYER.match(key)
    if m is None or single:
        return FINAL[0] + key[len(FINAL[1]):] if key.startswith(FINAL[1]) else key
    j, name = int(m.group(1)), m.group(2)
    block = _block(key, name)
    if j % 2 != block:
        kinds = ("an attention", "an MLP")
        raise ConfigError(f"tensor {key} belongs to {kinds[block]} block, but the layer pattern makes index {j} "
                          f"{kinds[j % 2]} layer: the pattern in the args and the weights disagree")
    return f"decoder.layers.{j // 2}.{name}"


def _block(key: str, name: str) -> int:
    """0 for an attention block's tensor, 1 for an MLP block's."""
    if name.startswith(_ATTENTION_PARTS):
        return 0
    if name.startswith(_MLP_PARTS):
        return 1
    raise ConfigError(f"tensor {key}: not a part of an attention or MLP block")


def pattern_of(args) -> Pattern | None:
    """The pattern a Megatron-LM Namespace records (None: a GPTModel run). A HybridModel's args without one (the
    deprecated attention / MLP ratios) are refused."""
    text = getattr(args, PATTERN, None) or getattr(args, "hybrid_override_pattern", None)
    if text is None:
        ratios = [k for k in ("hybrid_attention_ratio", "hybrid_mlp_ratio") if getattr(args, k, None)]
        if ratios or getattr(args, "is_hybrid_model", False):
            raise ConfigError(f"a HybridModel's args without a layer pattern ({', '.join(ratios) or 'is_hybrid_model'}"
                              f" set, no hybrid_layer_pattern): this version reads the pattern only; save the run "
                              f"with --hybrid-layer-pattern")
        return None
    return Pattern.parse(text, PATTERN if getattr(args, PATTERN, None) else "hybrid_override_pattern")


def of_meta(meta) -> Pattern | None:
    """The pattern of a Megatron-LM source's Meta (None: a GPTModel's, or our format, which holds GPTModel's keys)."""
    text = meta.raw.get(PATTERN)
    return Pattern.parse(text) if text else None
