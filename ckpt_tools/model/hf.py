"""HuggingFace names and conversions: megatron-core full (TP=1) tensors <-> transformers tensors.

Each family's record (ckpt_tools/model/families) holds one row per megatron-core key: the HF name(s) it
becomes and the conversion kind. How a tensor is
split across TP ranks is NOT here (that is `layout`); this module only sees full tensors.

Conversion kinds:
  same      the tensor as is
  vocab     rows beyond the true vocab (padding) dropped; re-padded with zeros on import
  qkv       grouped QKV [per group: q heads; k; v] -> q_proj, k_proj, v_proj (heads in order)
  gated     SwiGLU fc1 [gate; up] -> gate_proj, up_proj
  conv1d    transposed (HF GPT-2 Conv1D stores [in, out])
  qkv_fused grouped QKV -> one [q; k; v] tensor (whole blocks, not per head): Phi-3's qkv_proj
  c_attn    qkv_fused, transposed for weights (GPT-2)
  gate_up_t gated, its gate and up rows interleaved (gate 0, up 0, gate 1, ...), transposed for weights (GPT-OSS)

An HF name without the `{e}` of its expert row is a stacked tensor: every expert's is one slice of it, on a first axis
of the experts (GPT-OSS's `mlp.experts.gate_up_proj` [experts, hidden, 2 x ffn]). Such a slice is named `name[e]`
(`part_of`); merge writes the slices of one name one after another as one tensor (`stacked`).

Every kind is a list of row ranges of the full tensor per HF tensor (`hf_rows`), then a transpose for
the 2-D tensors of TRANSPOSED kinds: `to_hf` and the torch-free merge both take them from there.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from ckpt_tools.errors import ConfigError, FormatError, LayoutError
from ckpt_tools.model import families, layout
from ckpt_tools.model.families import Name
from ckpt_tools.model.spec import ModelSpec


def hf_keys(spec: ModelSpec) -> list[tuple[str, Name, list[str]]]:
    """(megatron-core global key, row, HF names) for every tensor an HF model of `spec` holds, in order.

    `_extra_state` has no HF counterpart; a tied output layer is the embedding in HF.
    """
    rows = {n.key: n for n in families.get(spec.architecture).names}
    out = []
    for local, key in layout.stage_keys(spec, [spec.num_layers], 0):
        if not layout.holds_weights(key, spec, 1):
            continue
        pattern = layout.pattern_of(key)
        if pattern not in rows:
            raise LayoutError(f"{key}: no HuggingFace name for it in the {spec.architecture} mapping")
        out.append((key, rows[pattern], [_hf_name(h, key, spec) for h in rows[pattern].hf]))
    return out


def _hf_name(template: str, key: str, spec: ModelSpec) -> str:
    """The HF name of a megatron-core key: the template's layer and expert filled in, or for an expert's key whose
    template has no `{e}`, its slice of the stacked tensor (`name[e]`)."""
    e = layout.expert_index(key)
    name = template.format(i=hf_layer(key, spec), e=e)
    return name if e is None or "{e}" in template else f"{name}[{e}]"


_PART = re.compile(r"^(.+)\[(\d+)\]$")


def part_of(name: str) -> tuple[str, int | None]:
    """(the HF tensor's name, the slice's index) of a slice of a stacked tensor (`name[e]`); (name, None) otherwise."""
    m = _PART.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def slice_counts(names) -> dict[str, int]:
    """The stacked tensors among HF names (their slices `name[e]`) and how many slices each has."""
    counts: dict[str, int] = {}
    for n in names:
        base, e = part_of(n)
        if e is not None:
            counts[base] = max(counts.get(base, 0), e + 1)
    return counts


def stacked(tensors: list[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the tensors a file holds, the slices of a stacked tensor (0, 1, ... in order, of one
    dtype and shape) as the one tensor they make, [slices, *shape], where its first slice is."""
    out: list[tuple[str, str, tuple[int, ...]]] = []
    at: dict[str, int] = {}
    for name, dtype, shape in tensors:
        base, e = part_of(name)
        if e is None:
            out.append((name, dtype, tuple(shape)))
            continue
        if base not in at:
            at[base] = len(out)
            out.append((base, dtype, (0,) + tuple(shape)))
        _, d, s = out[at[base]]
        if e != s[0] or (d, s[1:]) != (dtype, tuple(shape)):
            raise LayoutError(f"{name}: a slice of a stacked tensor out of order (slices 0, 1, ... of one shape and "
                              f"dtype)")
        out[at[base]] = (base, d, (e + 1,) + s[1:])
    return out


def hf_layer(key: str, spec: ModelSpec) -> int | None:
    """The HF layer number of a megatron-core key: its decoder layer's, or for multi-token prediction depth m the
    layer after the decoder's m-th (DeepSeek-V3's `model.layers.61.` in a 61-layer model)."""
    m = layout.mtp_index(key)
    return layout.layer_index(key) if m is None else spec.num_layers + m


def hf_copies(spec: ModelSpec) -> list[tuple[str, Name, str]]:
    """(megatron-core key, row, HF name) of each copy an HF model holds of a tensor it also holds under its own
    name: DeepSeek-V3's multi-token prediction layers each carry the embedding and the output head
    (`model.layers.<n>.embed_tokens.weight`, `...shared_head.head.weight`), which megatron-core shares with the
    model's own."""
    family = families.get(spec.architecture)
    rows = {n.key: n for n in family.names}
    return [(key, rows[key], name.format(i=spec.num_layers + m))
            for m in range(spec.mtp_num_layers or 0) for key, name in family.mtp_copies]


def fresh_masters(rows: dict, spec: ModelSpec, params: str, dtype_of, pp: int) -> set[str]:
    """The tensors whose fresh optimizer's fp32 masters an HF import writes (contract 2: the masters are written only
    where they are not the weights): trained tensors kept in a dtype other than fp32 (`params`, a dtype name, or their
    layout row's own) whose HF tensors are in another, holding values the kept dtype rounds (fp32, FP8 blocks or fp16
    kept in bf16, bf16 in fp16). `rows`: key -> (hf.Name, HF names); `dtype_of`: an HF tensor's dtype name."""
    out = set()
    for key, (_, names) in rows.items():
        kept = layout.dtype_of(key, spec, params, None)
        if kept != "float32" and layout.has_optimizer_state(key, spec, pp) and any(dtype_of(n) != kept for n in names):
            out.add(key)
    return out


def tied_head(spec: ModelSpec) -> set[str]:
    """The HF tensors of the model's aliased rows (a tied output layer: the head), which a tied model may save as
    well, which transformers ties to the embedding on load and megatron-core does not hold: read past, not unknown
    tensors. A family whose output layer is always tied has no row for it: transformers' `lm_head.weight`."""
    rows = {n.key: n for n in families.get(spec.architecture).names}
    return {h for copy in layout.aliases(spec) for h in (rows[copy].hf if copy in rows else ("lm_head.weight",))}


def check_copies(source, spec: ModelSpec, hf_dir: Path) -> set[str]:
    """The copies (hf_copies) an HF model's weights (`source`, an HFTensors) hold, each checked equal to the tensor it
    copies: megatron-core keeps one, so a copy that differs would be lost (refused, naming both)."""
    import torch
    held = set()
    for key, row, name in hf_copies(spec):
        if name not in source.where:
            continue
        own = row.hf[0]
        if source.shape(name) != source.shape(own) or not torch.equal(source.get(name), source.get(own)):
            raise FormatError(f"{hf_dir}: {name} differs from {own}, which it copies (megatron-core's multi-token "
                              f"prediction layers share the model's {key}): make them equal or drop the copy")
        held.add(name)
    return held




# ---------------------------------------------------------------- config.json
def hf_config(spec: ModelSpec, dtype: str, bos: int | None, eos: int | None) -> dict:
    """config.json for the family's transformers class, weights of dtype `dtype` ("bfloat16", ...): every
    field that changes the math is set explicitly (transformers fills the rest with its defaults).
    Written without importing transformers, which would cost seconds per merge."""
    return families.get(spec.architecture).hf_config(spec, dtype, bos, eos)


def special_ids(tokenizer_dir: Path | None) -> tuple[int | None, int | None]:
    """(bos, eos) token ids from a tokenizer dir's JSON files (tokenizer_config.json names the tokens,
    tokenizer.json maps them to ids), without loading a tokenizer."""
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return None, None
    names: dict = {}
    for f in ("special_tokens_map.json", "tokenizer_config.json"):
        if (tokenizer_dir / f).is_file():
            names.update({k: v for k, v in json.loads((tokenizer_dir / f).read_text()).items()
                          if k in ("bos_token", "eos_token") and v})
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab = tok.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        ids = {**vocab, **ids}

    def lookup(name: str) -> int | None:
        token = names.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        return ids.get(token) if token is not None else None
    return lookup("bos_token"), lookup("eos_token")


def _refuse(path: Path, what: str) -> None:
    raise ConfigError(f"{path}: {what}: the supported families are {', '.join(families.names())} "
                      f"(see docs/families.md)")


def spec_of_model(hf_dir: Path, names) -> ModelSpec:
    """ModelSpec of an HF model dir whose weights hold the tensors `names`: its config.json's, with the multi-token
    prediction layers its weights hold (transformers writes num_nextn_predict_layers 1 and builds none: a model it
    saved holds none and is imported without)."""
    spec = spec_from_hf(Path(hf_dir) / "config.json")
    if not families.get(spec.architecture).mtp_layers:
        return spec
    beyond = sorted(n for n in names if (i := layer_number(n)) is not None and i >= spec.num_layers)
    if beyond and spec.mtp_num_layers is None:
        raise FormatError(f"{hf_dir}: {beyond[0]} ({len(beyond)} tensors of layers numbered from {spec.num_layers}) "
                          f"but config.json's num_nextn_predict_layers is 0: set it to the number of multi-token "
                          f"prediction layers the weights hold")
    return spec if beyond or spec.mtp_num_layers is None else dataclasses.replace(spec, mtp_num_layers=None)


def spec_from_hf(config_path: Path) -> ModelSpec:
    """ModelSpec of an HF config.json of a known family; anything the family cannot express is refused."""
    try:
        c = json.loads(Path(config_path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path}: unreadable config.json ({e}): pass a HuggingFace model dir") from None
    if not isinstance(c, dict):
        raise ConfigError(f"{config_path}: holds a JSON {type(c).__name__}, not an object: pass a HuggingFace model dir")
    family = families.by_model_type(c.get("model_type"))
    if family is None:
        _refuse(config_path, f"model_type {c.get('model_type')!r}")
    try:
        return ModelSpec.from_dict(family.spec_fields(c, lambda what: _refuse(config_path, what)))
    except ConfigError as e:  # ModelSpec's own checks (e.g. heads vs query groups) get the file named
        if str(e).startswith(str(config_path)):
            raise
        raise ConfigError(f"{config_path}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"{config_path}: lacks {e.args[0]!r}, which a {c.get('model_type')} config.json needs: "
                          f"fix config.json or save the model again with transformers") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ConfigError(f"{config_path}: malformed config.json ({type(e).__name__}: {e}): "
                          f"fix config.json or save the model again with transformers") from None


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_number(name: str) -> int | None:
    """The decoder layer an HF tensor name belongs to (model.layers.<i>.), or None."""
    m = _HF_LAYER.match(name)
    return int(m.group(1)) if m else None


from ckpt_tools.model.fp8 import QUANTIZATION  # noqa: E402


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"
TEMPLATES_DIR = "additional_chat_templates"  # transformers 5 saves named chat templates there
ORIGINAL_CONFIG = "hf_config.json"  # an imported model's own config.json, kept beside our shards


def tokenizer_files(directory: Path) -> list[Path]:
    return [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]


def carried_files(directory: Path) -> list[Path]:
    """Every file of an HF model dir that is not weights and that a merge must give back: tokenizer files and chat
    templates (also named ones in additional_chat_templates/), generation_config.json, and the model's own
    config (`hf_config.json` in our checkpoints)."""
    names = (*TOKENIZER_FILES, GENERATION_CONFIG, ORIGINAL_CONFIG)
    found = [directory / n for n in names if (directory / n).is_file()]
    templates = directory / TEMPLATES_DIR
    return found + (sorted(p for p in templates.iterdir() if p.is_file()) if templates.is_dir() else [])


def copy_carried(src: Path, dest: Path, hf_dir: bool = False) -> list[Path]:
    """carried_files(src) into dest (an HF dir's config.json as hf_config.json when `hf_dir`); the copies."""
    import shutil
    out = []
    files = carried_files(src) + ([src / "config.json"] if hf_dir and (src / "config.json").is_file() else [])
    for f in files:
        rel = f.relative_to(src)
        target = dest / (ORIGINAL_CONFIG if hf_dir and rel == Path("config.json") else rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        out.append(target)
    return out


def merged_config(ours: dict, spec: ModelSpec, carried: Path | None) -> dict:
    """config.json of a merge: the imported model's own config (every field we do not compute: token ids,
    model-specific extras) with the fields that follow from the weights (sizes, features, rope, dtype) ours."""
    path = carried / ORIGINAL_CONFIG if carried is not None else None
    if path is None or not path.is_file():
        return ours
    try:
        original = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({e}): restore it from the HF model dir (its config.json)") from None
    if not isinstance(original, dict) or original.get("model_type") != ours["model_type"]:
        return ours
    out = {**ours, **{k: v for k, v in original.items() if k != "transformers_version"}}
    for key in families.get(spec.architecture).computed_keys():
        if key in ours:
            out[key] = ours[key]
    if "torch_dtype" in original:
        out["torch_dtype"] = ours["dtype"]
    if "rope_parameters" in ours:
        out.pop("rope_scaling", None)  # the older spelling of what rope_parameters now says
    if QUANTIZATION in ours:
        out[QUANTIZATION] = ours[QUANTIZATION]
    else:
        out.pop(QUANTIZATION, None)  # how the source stored its weights (FP8 blocks), not how the merge does
    return out
