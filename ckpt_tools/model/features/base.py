"""A feature as one record (`Feature`): what the package knows of a ModelSpec feature beyond the layout table's rows
and the trainer's modules. The records live in this package's modules by area; `ckpt_tools.model.features.ALL` lists
them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def arg(args, name: str, default=None):
    """Megatron-LM's argument `name` of a checkpoint's Namespace; `default` where it is absent or None (an older
    Megatron-LM's Namespace lacks newer arguments)."""
    value = getattr(args, name, default)
    return default if value is None else value


def _none(spec) -> dict:
    return {}


def _no_flags(spec) -> str:
    return ""


def _expressible(spec) -> str | None:
    return None


def cannot_hold(field: str, why: str) -> Callable[[Any], str | None]:
    """A `refuse` for a feature Megatron-LM's forms cannot hold at all where the model has it (`field` true)."""
    def refuse(spec) -> str | None:
        if not getattr(spec, field):
            return None
        return f"{spec.architecture}: {why}: Megatron-LM's forms cannot hold this model; keep it in our format or HF"
    return refuse


@dataclass(frozen=True)
class Feature:
    """One ModelSpec feature (a field a family fixes; `None` in a ModelSpec means the family's default).

    allowed   the values a family that does not name the feature allows, its default first (a family's
              `features` names only what it allows otherwise);
    arg       Megatron-LM's argument that sets it, as a misfit message names it; None: Megatron-LM's arguments
              cannot say it (`refuse` gives the reason);
    read      a checkpoint's Megatron-LM arguments -> the feature's value;
    shown     the value in the argument's terms, for a misfit message (None: as is);
    write     the feature's Megatron-LM arguments of a written checkpoint ({} where it has none);
    flags     the load command's flags that Megatron-LM's --use-checkpoint-args does not restore;
    refuse    why Megatron-LM's forms cannot hold this model's value (None: they can)."""
    name: str
    allowed: tuple
    arg: str | None = None
    read: Callable[[Any], Any] | None = None
    shown: Callable[[Any], Any] | None = None
    write: Callable[[Any], dict] = _none
    flags: Callable[[Any], str] = _no_flags
    refuse: Callable[[Any], str | None] = _expressible
