"""`ckpt import` (HF -> shards): the Python API, which paths.import_hf runs as the command line does, and `checked`,
an HF model read through torch and checked against its config.json, for the import's writers (verbs/hf_copy.py for
Megatron-LM's forms, verbs/ours_copy.py for ours) where they do not copy its bytes (FP8 or MXFP4 weights, stacked
experts, names or shapes that disagree: then said in one line).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ckpt_tools.errors import FormatError
from ckpt_tools.forms.hf_tensors import HFTensors
from ckpt_tools.forms.writers import dtype_name
from ckpt_tools.model import conversions, hf, layout
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs.request import Request


def import_hf(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, layers: list[int] | None = None,
              dtype: torch.dtype | None = None, force: bool = False, quiet: bool = False, copy_bytes: bool = True,
              team: Team = SOLO, **asked) -> str:
    """`asked`: the rest of the target, request.Request's fields (form, optimizer, ep, vpp, model). `copy_bytes`
    False: every tensor made by torch from the HF model's reader (paths.import_hf)."""
    from ckpt_tools.verbs import paths
    return paths.import_hf(hf_dir, out, Request(tp, pp, layers, **asked), dtype_name(dtype) if dtype else None, force,
                           quiet, team, copy_bytes)


def checked(hf_dir: Path, dtype: str | None) -> tuple:
    """An HF model read through torch's safetensors reader (forms/hf_tensors.py: FP8 and MXFP4 weights dequantized,
    stacked experts sliced), checked against its config.json: (spec, the reader, rows: key -> (hf.Name, HF names), the
    weights' dtype name: `dtype`, else the HF embedding's). Names or shapes that disagree are one line."""
    source = HFTensors(hf_dir)
    spec = hf.spec_of_model(hf_dir, source.where)
    padded = spec.padded_vocab_size(1)  # HF shapes do not depend on the padding
    rows = {key: (row, names) for key, row, names in hf.hf_keys(spec)}
    wanted = {n for _, names in rows.values() for n in names}
    extra = sorted(set(source.where) - {hf.part_of(n)[0] for n in wanted} - hf.tied_head(spec))
    missing = sorted(n for n in wanted if not source.holds(n))
    copies = hf.check_copies(source, spec, hf_dir)  # MTP layers' copies of the embedding and head
    extra = [n for n in extra if n not in copies]
    if not missing and extra and all(n.startswith("mtp.") for n in extra):
        raise FormatError(f"{hf_dir}: {len(extra)} multi-token prediction tensors ({', '.join(extra[:2])} ...), which "
                          f"transformers' {spec.architecture} does not load and this version does not convert: save "
                          f"the model without them (transformers' save_pretrained drops them) to convert the rest")
    if missing or extra:
        what = "; ".join(x for x in (f"missing {', '.join(missing[:4])}" if missing else "",
                                     f"unexpected {', '.join(extra[:4])}" if extra else "") if x)
        raise FormatError(f"{hf_dir}: tensors do not match a {spec.architecture} model of this config.json ({what}): "
                          f"the weights and config.json disagree")
    wrong = [f"{name} {list(source.shape(name))}, expected {n} slices first"  # a stacked tensor: one slice per expert
             for name, n in hf.slice_counts(wanted).items() if source.shape(name)[0] != n]
    for key, (row, names) in rows.items():
        for name, shape in zip(names, conversions.hf_shapes(row.kind, spec, layout.full_shape(key, spec, padded))):
            if source.shape(name) != tuple(shape):
                wrong.append(f"{name} {list(source.shape(name))}, expected {list(shape)}")
    if wrong:
        raise FormatError(f"{hf_dir}: tensor shapes do not match a {spec.architecture} model of this config.json "
                          f"({'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}): "
                          f"the weights and config.json disagree")
    params = dtype or dtype_name(source.get(rows["embedding.word_embeddings.weight"][1][0]).dtype)
    return spec, source, rows, params
