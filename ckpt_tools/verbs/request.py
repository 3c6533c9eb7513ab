"""What `ckpt reshard` and `ckpt import` are asked to write, as one record every path of a verb passes on.

`Request` is the command line's target: TP, PP, an uneven layer split, EP, VPP, the on-disk form, the megatron-core
model class, whether optimizer state goes along. `check()` refuses a request no source could satisfy (an option
that does not apply to the form) before anything is read. `resolve()` meets it with the source model: the (virtual)
stages' layer counts, the padded vocab, the EP and model class the output gets; the result is a `Layout`, which the
writers, the refusals of what Megatron-LM cannot express (to_megatron.check) and the summaries read. A new target
option is a field here, its refusal in `check` or `resolve`, its CLI option, and where it is used.
"""
from __future__ import annotations

from dataclasses import dataclass

from ckpt_tools.errors import ConfigError
from ckpt_tools.forms import forms, megatron_lm
from ckpt_tools.model import hybrid, layout
from ckpt_tools.model.ranks import Grid
from ckpt_tools.model.spec import ModelSpec

OURS = "ours"
# Megatron-LM's forms named on the command line but not written, each with why and what to pass instead
REFUSED = {megatron_lm.TORCH_DCP: (
    "Megatron-LM cannot load a torch_dcp checkpoint into a run: its loader calls optimizer.state_dict(is_loading="
    "True), which megatron-core's ChainedOptimizer does not take (Megatron-LM core_v0.16.1 to core_v0.19.0 and main), "
    "even for its own saves; an FSDP2 run (--use-torch-fsdp2) also loads --ckpt-format torch_dist: pass --format "
    "torch_dist (or fsdp_dtensor for Megatron-FSDP)")}
CHOICES = (OURS, *forms.WRITTEN, *REFUSED)
GPT, HYBRID = "gpt", "hybrid"  # --model: megatron-core's GPTModel or HybridModel


@dataclass(frozen=True)
class Request:
    """The target asked for. `layers`: an uneven split (None: even); `ep` None: the source's (1 from an HF model);
    `vpp`: model chunks per PP rank (Megatron-LM's interleaved pipeline); `model` None: the source's class."""
    tp: int = 1
    pp: int = 1
    layers: tuple[int, ...] | None = None
    ep: int | None = None
    vpp: int = 1
    form: str = OURS
    model: str | None = None
    optimizer: bool = True

    def __post_init__(self):
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def megatron(self) -> bool:
        """Whether the output is one of Megatron-LM's forms (else our format)."""
        return self.form != OURS

    def check(self) -> Request:
        """Refuses options that do not apply to the form, before anything is read or written; returns itself."""
        if self.form in REFUSED:
            raise ConfigError(f"--format {self.form} is not written: {REFUSED[self.form]}")
        written = forms.WRITTEN.get(self.form)  # None: ours
        if written is not None and written.whole_experts and self.ep not in (None, 1):
            raise ConfigError(f"--ep {self.ep} does not apply to {self.form}: it holds each expert once and "
                              f"Megatron-LM loads it at any --expert-model-parallel-size; drop --ep")
        if self.model is not None and not self.megatron:
            raise ConfigError(f"--model {self.model} applies to Megatron-LM's forms (--format torch_dist), not to "
                              f"ours, which holds GPTModel's keys: drop --model or pass --format torch_dist")
        if self.vpp < 1:
            raise ConfigError(f"--vpp {self.vpp}: give the model chunks per PP rank, 1 or more")
        if self.vpp > 1 and written is not None and not written.interleaved:
            at = "at PP 1" if not written.pipeline else "without interleaving"
            raise ConfigError(f"--vpp {self.vpp} with --format {self.form}: Megatron-LM's {self.form} form is written "
                              f"{at} by this version; drop --vpp, or pass --format {forms.only('interleaved')}")
        if self.vpp > 1 and not self.megatron:
            raise ConfigError(f"--vpp {self.vpp} applies to Megatron-LM's forms (an interleaved pipeline's model "
                              f"chunks), not to ours: pass --format torch_dist or torch, or --pp <PP x VPP> for as "
                              f"many stages in our format")
        return self

    def resolve(self, spec: ModelSpec, padded_now: int | None = None, source_ep: int = 1, meta=None) -> Layout:
        """The layout written for this source (`padded_now`: its padded vocab, kept where TP allows; `source_ep` and
        `meta`: its EP and model class, kept where the request leaves them); refused before anything is written."""
        counts, padded = layout.target_layout(spec, self.tp, self.pp, list(self.layers) if self.layers else None,
                                              padded_now, self.vpp)
        written = forms.WRITTEN.get(self.form)
        ep = 1 if written is not None and written.whole_experts else source_ep if self.ep is None else self.ep
        if not self.megatron:
            layout.check_ep(spec, ep)
        return Layout(self.form, self.tp, counts, padded, ep, self.vpp, model_of(self.model, meta))


@dataclass(frozen=True)
class Layout:
    """A resolved target: `counts` the layers of each (virtual) stage, in layer order (PP x VPP of them with an
    interleaved pipeline), `padded` the padded vocab."""
    form: str
    tp: int
    counts: list[int]
    padded: int
    ep: int = 1
    vpp: int = 1
    model: str = GPT

    @property
    def pp(self) -> int:
        """The stages written: PP x VPP virtual stages of an interleaved pipeline."""
        return len(self.counts)

    @property
    def pp_ranks(self) -> int:
        """The pipeline ranks (files) the stages go to."""
        return len(self.counts) // self.vpp

    def describe(self) -> str:
        """The layout as a summary names it: TP x PP (x EP), and x VPP for an interleaved pipeline."""
        return f"{Grid(self.tp, self.pp_ranks, self.ep)}" + (f" x VPP{self.vpp}" if self.vpp > 1 else "")


def model_of(model: str | None, meta=None) -> str:
    """The megatron-core model class a Megatron-LM output is saved for: the one asked for, else the source's (a
    HybridModel's checkpoint stays one), else GPTModel."""
    if model is not None:
        return model
    return HYBRID if meta is not None and (hybrid.of_meta(meta) is not None or meta.spec.hybrid) else GPT

