"""Megatron-FSDP's `--ckpt-format fsdp_dtensor`, written by `ckpt reshard/import --format fsdp_dtensor`:
torch.distributed.checkpoint's files as the torch_dist writer (forms/megatron_write.py) streams them, under the
model's own keys. What Megatron-LM's load_checkpoint reads with --use-megatron-fsdp --ckpt-format fsdp_dtensor
--no-load-rng, and --no-load-optim for the weights alone (PP 1; the reader is forms/torch_dist.py).

With optimizer state (`resume`), as Megatron-FSDP's distributed optimizer saves it
(`sharded_state_dict(..., metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})`): the model entries are the fp32
main weights (the masters), each parameter's Adam state is `optimizer.state.module.module.module.<name>.{exp_avg,
exp_avg_sq,step}` (the step a float32 scalar, a SwiGLU fc1's per half), its param group's settings are bytes entries
`optimizer.param_to_group_meta.module.module.module.<name>.<setting>` (megatron-core's load rebuilds the groups from
them and checks that the parameters of one group agree), and the scheduler's are `opt_param_scheduler.<setting>`.
A parameter's group is the source's group of its kind: weight decay off (wd_mult 0) for a 1-D tensor or a bias, as
megatron-core's default `no_weight_decay_cond` says, and the experts' own groups (is_expert_parallel); of several such
groups, the one of lr_mult 1 without a decoupled LR, else none (refused in one line: which parameters took another
learning rate is not in the source).
"""
from __future__ import annotations

import struct

from ckpt_tools.errors import ConfigError, LayoutError
from ckpt_tools.forms import megatron_lm
from ckpt_tools.forms.megatron_resume import ResumeState, decayed
from ckpt_tools.forms.megatron_write import CHECKPOINT_VERSION, DistWriter
from ckpt_tools.forms.torch_dist import FSDP_HALVES
from ckpt_tools.forms.torch_dist_names import Placed, dcp_candidates
from ckpt_tools.model import layout
from ckpt_tools.model.ranks import Rank
from ckpt_tools.model.rules import GATED


def _setting(group: dict, name: str, default: float):
    """A group's setting under its name or NeMo's (`pre_<name>`), as megatron-core reads it."""
    return group.get(name, group.get(f"pre_{name}", default))


STATE = "optimizer.state.module.module."  # + the model key without its leading "model.": module.<name>
GROUP_META = "optimizer.param_to_group_meta.module.module."
SCHEDULER = "opt_param_scheduler."


class FsdpWriter(DistWriter):
    """Each tensor global (one chunk per TP shard's piece) under `model.module.<name>`, per layer: the local spec's
    names, and Transformer Engine's (fused norms; grouped experts `mlp.experts.linear_fc1.weight<e>`) as second
    index entries over the same bytes, so that either spec's run finds its keys; a SwiGLU fc1 as its halves
    `<name>_w` (gate) and `<name>_v` (up), as Megatron-FSDP's handle_swiglu_in_state_dict names them; the common state
    as bytes entries (args, iteration, checkpoint_version), no common.pt or metadata.json; no `_extra_state`
    (Megatron-FSDP drops it on save and load)."""

    def __init__(self, *args, resume: ResumeState | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.resume = resume
        self._aliases: dict[str, str] = {}  # every stored name -> the other spec's (the same in every process)
        for p in range(self.pp):
            for _, key in layout.stage_keys(self.spec, self.counts, p):
                names = dcp_candidates(key, self.spec, megatron_lm.FSDP_MODEL)
                if len(names) > 1:
                    self._aliases[names[0][0]] = names[1][0]
        self._groups = self._param_groups() if resume is not None else {}

    def _params(self) -> list[tuple[str, str]]:
        """(layout key, stored name) of every parameter with optimizer state."""
        return [(key, self.stored(key)[0]) for _, key in layout.stage_keys(self.spec, self.counts, 0)
                if layout.has_optimizer_state(key, self.spec, self.pp) and self.saves(key, Rank(0, 0))]

    def _halves(self, key: str, name: str) -> list[str]:
        """The names a parameter's Adam state is saved under: a SwiGLU fc1's two halves (its group settings stay
        under the whole name, as Megatron-FSDP's handle_swiglu_in_state_dict leaves them), else its own."""
        gated = layout.find_rule(key, self.spec, self.pp).split == GATED and self.spec.activation == "swiglu"
        return [name + half for half in FSDP_HALVES] if gated else [name]

    def _param_groups(self) -> dict[str, dict]:
        """Each parameter's group settings (stored name -> the source's group of its kind, without its params and
        step); refused in one line, before anything is written, where the source has no group of that kind."""
        chosen = {}
        for key, name in self._params():
            no_decay = not decayed(key, layout.full_shape(key, self.spec, self.padded, self.pp))
            expert = layout.expert_index(key) is not None or ".experts." in key
            fits = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in self.resume.param_groups
                    if (float(_setting(g, "wd_mult", 1.0)) == 0.0) == no_decay
                    and bool(g.get("is_expert_parallel")) == expert]
            plain = [g for g in fits if float(_setting(g, "lr_mult", 1.0)) == 1.0 and not g.get("is_decoupled_lr")]
            fits = plain if len({repr(sorted(g.items())) for g in fits}) > 1 else fits
            if len({repr(sorted(g.items())) for g in fits}) != 1:
                raise ConfigError(f"{self.dir}: the optimizer's param groups hold "
                                  f"{'none' if not fits else f'{len(fits)} different ones'} for {key} (weight decay "
                                  f"{'off' if no_decay else 'on'}{', an expert' if expert else ''}): Megatron-FSDP's "
                                  f"form names each parameter's group; pass --format torch_dist, or --no-optimizer")
            chosen[name] = fits[0]
        return chosen

    def weights_from_masters(self, key: str) -> bool:
        """Whether the model entry of `key` is its fp32 master (Megatron-FSDP's main weights), not the weights."""
        return self.resume is not None and layout.has_optimizer_state(key, self.spec, self.pp)

    def entry(self, fqn: str, field: str | None) -> str:
        return fqn  # named in `placed`, after a SwiGLU half's suffix

    @staticmethod
    def _named(fqn: str, field: str | None) -> str:
        """The stored name of what is put: the model entry, or the optimizer field's entry of that parameter."""
        if field in (None, "master"):
            return fqn
        return f"{STATE}{fqn.removeprefix('model.')}.{field}"

    def stored(self, key: str) -> tuple[str, Placed]:
        return dcp_candidates(key, self.spec, megatron_lm.FSDP_MODEL)[0]

    def alias(self, fqn: str) -> str | None:
        if fqn.startswith(STATE):  # an optimizer entry: its parameter's other name, the field after it
            name, field = fqn[len(STATE):].rsplit(".", 1)
            other = self.alias("model." + name)
            return None if other is None else f"{STATE}{other.removeprefix('model.')}.{field}"
        for half in FSDP_HALVES:  # a SwiGLU half: its whole tensor's other name, the half's suffix after it
            if fqn.endswith(half) and fqn[:-len(half)] in self._aliases:
                return self._aliases[fqn[:-len(half)]] + half
        return self._aliases.get(fqn)

    def placed(self, key, fqn, layer, full, p, field=None):
        if layout.find_rule(key, self.spec, self.pp).split != GATED or self.spec.activation != "swiglu":
            stored, offsets, sizes, shape = super().placed(key, fqn, layer, full, p)
            return self._named(stored, field), offsets, sizes, shape
        half = full[0] // 2
        second = p.start >= half
        if p.stop > half and not second:
            raise LayoutError(f"{key}: rows {p.start}-{p.stop} cross its SwiGLU halves: not a piece Megatron-FSDP saves")
        offsets = (p.start - half * second,) + (0,) * (len(full) - 1)
        return (self._named(fqn + FSDP_HALVES[second], field), offsets, (p.stop - p.start,) + tuple(full[1:]),
                (half,) + tuple(full[1:]))

    def put_extra(self, pp_rank: int, key: str) -> None:
        return  # Megatron-FSDP saves and loads no _extra_state

    def put_norm_extras(self, pp_rank: int) -> None:
        return

    def end_stage(self, pp_rank: int, iteration: int) -> None:
        if pp_rank == 0:  # the common state, in the first rank's file (as Megatron-LM's rank 0 saves it)
            for name, obj in (("args", self.args), ("checkpoint_version", CHECKPOINT_VERSION),
                              ("iteration", iteration)):
                self.put_object(Rank(0, 0), name, obj)
            if self.resume is not None:
                self._put_optimizer_entries()
        super().end_stage(pp_rank, iteration)

    def _put_optimizer_entries(self) -> None:
        """Each parameter's Adam step and group settings (under either spec's name), and the scheduler's state."""
        step = struct.pack("<f", float(self.resume.step))
        for key, name in self._params():
            for half in self._halves(key, name):
                self.put_chunk(Rank(0, 0), f"{STATE}{half.removeprefix('model.')}.step", "float32", (), (), (), step)
            settings = self._groups[name]
            for stored in filter(None, (name, self.alias(name))):
                for setting, value in settings.items():
                    self.put_object(Rank(0, 0), f"{GROUP_META}{stored.removeprefix('model.')}.{setting}", value)
        for setting, value in self.resume.scheduler.items():
            self.put_object(Rank(0, 0), SCHEDULER + setting, value)

    def write_common(self, iteration: int, common: dict | None) -> None:
        return  # the common state is bytes entries of the index
