"""HuggingFace names and conversions: megatron-core full (TP=1) tensors <-> transformers tensors.

One row per megatron-core key: the HF name(s) it becomes and the conversion kind. How a tensor is
split across TP ranks is NOT here (that is `layout`); this module only sees full tensors.

Conversion kinds:
  same      the tensor as is
  vocab     rows beyond the true vocab (padding) dropped; re-padded with zeros on import
  qkv       grouped QKV [per group: q heads; k; v] -> q_proj, k_proj, v_proj (heads in order)
  gated     SwiGLU fc1 [gate; up] -> gate_proj, up_proj
  conv1d    transposed (HF GPT-2 Conv1D stores [in, out])
  c_attn    grouped QKV -> one [q; k; v] tensor (whole blocks, not per head), transposed for weights

Every kind is a list of row ranges of the full tensor per HF tensor (`hf_rows`), then a transpose for
the 2-D tensors of TRANSPOSED kinds: `to_hf` and the torch-free merge both take them from there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools import layout
from ckpt_tools.errors import ConfigError, FormatError, LayoutError
from ckpt_tools.spec import ModelSpec

if TYPE_CHECKING:
    import torch

SAME, VOCAB, QKV, GATED, CONV1D, C_ATTN = "same", "vocab", "qkv", "gated", "conv1d", "c_attn"


@dataclass(frozen=True)
class Name:
    key: str  # megatron-core key, `{i}` = global layer index
    kind: str
    hf: tuple[str, ...]  # HF name(s), `{i}` = layer index


_L, _LL, _GL = "decoder.layers.{i}.", "model.layers.{i}.", "transformer.h.{i}."
NAMES: dict[str, tuple[Name, ...]] = {
    "llama": (
        Name("embedding.word_embeddings.weight", VOCAB, ("model.embed_tokens.weight",)),
        Name(_L + "input_layernorm.weight", SAME, (_LL + "input_layernorm.weight",)),
        Name(_L + "self_attention.linear_proj.weight", SAME, (_LL + "self_attn.o_proj.weight",)),
        Name(_L + "self_attention.linear_qkv.weight", QKV,
             tuple(_LL + f"self_attn.{p}_proj.weight" for p in "qkv")),
        Name(_L + "pre_mlp_layernorm.weight", SAME, (_LL + "post_attention_layernorm.weight",)),
        Name(_L + "mlp.linear_fc1.weight", GATED, (_LL + "mlp.gate_proj.weight", _LL + "mlp.up_proj.weight")),
        Name(_L + "mlp.linear_fc2.weight", SAME, (_LL + "mlp.down_proj.weight",)),
        Name("decoder.final_layernorm.weight", SAME, ("model.norm.weight",)),
        Name("output_layer.weight", VOCAB, ("lm_head.weight",)),
    ),
    "gpt2": (
        Name("embedding.word_embeddings.weight", VOCAB, ("transformer.wte.weight",)),
        Name("embedding.position_embeddings.weight", SAME, ("transformer.wpe.weight",)),
        Name(_L + "input_layernorm.weight", SAME, (_GL + "ln_1.weight",)),
        Name(_L + "input_layernorm.bias", SAME, (_GL + "ln_1.bias",)),
        Name(_L + "self_attention.linear_proj.weight", CONV1D, (_GL + "attn.c_proj.weight",)),
        Name(_L + "self_attention.linear_proj.bias", SAME, (_GL + "attn.c_proj.bias",)),
        Name(_L + "self_attention.linear_qkv.weight", C_ATTN, (_GL + "attn.c_attn.weight",)),
        Name(_L + "self_attention.linear_qkv.bias", C_ATTN, (_GL + "attn.c_attn.bias",)),
        Name(_L + "pre_mlp_layernorm.weight", SAME, (_GL + "ln_2.weight",)),
        Name(_L + "pre_mlp_layernorm.bias", SAME, (_GL + "ln_2.bias",)),
        Name(_L + "mlp.linear_fc1.weight", CONV1D, (_GL + "mlp.c_fc.weight",)),
        Name(_L + "mlp.linear_fc1.bias", SAME, (_GL + "mlp.c_fc.bias",)),
        Name(_L + "mlp.linear_fc2.weight", CONV1D, (_GL + "mlp.c_proj.weight",)),
        Name(_L + "mlp.linear_fc2.bias", SAME, (_GL + "mlp.c_proj.bias",)),
        Name("decoder.final_layernorm.weight", SAME, ("transformer.ln_f.weight",)),
        Name("decoder.final_layernorm.bias", SAME, ("transformer.ln_f.bias",)),
    ),
}


def hf_keys(spec: ModelSpec) -> list[tuple[str, Name, list[str]]]:
    """(megatron-core global key, row, HF names) for every tensor an HF model of `spec` holds, in order.

    `_extra_state` has no HF counterpart; a tied output layer is the embedding in HF.
    """
    rows = {n.key: n for n in NAMES[spec.architecture]}
    out = []
    for local, key in layout.stage_keys(spec, [spec.num_layers], 0):
        if layout.find_rule(key, spec, 1).split == layout.EXTRA:
            continue
        pattern = layout.pattern_of(key)
        if pattern not in rows:
            raise LayoutError(f"{key}: no HuggingFace name for it in the {spec.architecture} mapping")
        i = layout.layer_index(key)
        out.append((key, rows[pattern], [h.format(i=i) for h in rows[pattern].hf]))
    return out


TRANSPOSED = (CONV1D, C_ATTN)  # HF GPT-2's Conv1D stores a weight [in, out]: these kinds' 2-D tensors are transposed


def hf_rows(kind: str, spec: ModelSpec, rows: int) -> list[layout.Rows]:
    """For each HF tensor of a conversion kind, the row ranges of the full megatron-core tensor (of `rows`
    rows) that it is made of, in order; a TRANSPOSED kind then transposes a 2-D result."""
    if kind in (SAME, CONV1D):
        return [[(0, rows)]]
    if kind == VOCAB:
        return [[(0, spec.vocab_size)]]
    if kind == QKV:
        return list(layout.qkv_head_rows(spec))
    if kind == GATED:  # [gate; up]
        return [[(0, rows // 2)], [(rows // 2, rows)]]
    if kind == C_ATTN:
        return [[r for part in layout.qkv_head_rows(spec) for r in part]]
    raise LayoutError(f"unknown conversion kind {kind}")


def hf_shapes(kind: str, spec: ModelSpec, full_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of the tensors that to_hf makes of a full tensor of `full_shape`."""
    shapes = [(sum(b - a for a, b in rows),) + tuple(full_shape[1:]) for rows in hf_rows(kind, spec, full_shape[0])]
    return [s[::-1] if kind in TRANSPOSED and len(s) == 2 else s for s in shapes]


def to_hf(kind: str, full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """A full megatron-core tensor -> its HF tensor(s). Works on meta tensors (shape planning)."""
    if kind == VOCAB:  # refuses a tensor with fewer rows than the true vocab
        return [layout.trim_vocab("embedding.word_embeddings.weight", full, spec)]
    parts = [full if rows == [(0, full.shape[0])] else layout.take_rows(full, rows)
             for rows in hf_rows(kind, spec, full.shape[0])]
    return [t.t() if kind in TRANSPOSED and t.dim() == 2 else t for t in parts]


def from_hf(kind: str, tensors: list[torch.Tensor], spec: ModelSpec, padded_vocab: int) -> torch.Tensor:
    """Inverse of to_hf; vocab tensors come back padded to `padded_vocab` with zero rows."""
    if kind == SAME:
        return tensors[0]
    if kind == VOCAB:
        return layout.pad_vocab("embedding.word_embeddings.weight", tensors[0], spec, padded_vocab)
    if kind == QKV:
        return layout.qkv_join_heads(*tensors, spec)
    if kind == GATED:
        import torch
        return torch.cat(tensors, dim=0)
    if kind == CONV1D:
        return tensors[0].t()
    if kind == C_ATTN:
        whole = tensors[0].t() if tensors[0].dim() == 2 else tensors[0]
        q, k, v = whole.chunk(3, dim=0)
        return layout.qkv_join_heads(q, k, v, spec)
    raise LayoutError(f"unknown conversion kind {kind}")


# ---------------------------------------------------------------- config.json
GPT2_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


def hf_config(spec: ModelSpec, dtype: str, bos: int | None, eos: int | None) -> dict:
    """config.json for transformers' LlamaConfig / GPT2Config, weights of dtype `dtype` ("bfloat16", ...):
    every field that changes the math is set explicitly (transformers fills the rest with its defaults).
    Written without importing transformers, which would cost seconds per merge."""
    common = {"vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_word_embeddings,
              "bos_token_id": bos, "eos_token_id": eos, "dtype": dtype, "use_cache": True}
    if spec.architecture == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
                "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_attention_heads,
                "num_key_value_heads": spec.num_query_groups, "head_dim": spec.kv_channels, "hidden_act": "silu",
                "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": spec.norm_epsilon,
                "rope_parameters": {"rope_type": "default", "rope_theta": float(spec.rotary_base)},
                "rope_theta": float(spec.rotary_base), "attention_bias": False, "attention_dropout": 0.0,
                "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
            "n_embd": spec.hidden_size, "n_layer": spec.num_layers, "n_head": spec.num_attention_heads,
            "n_inner": spec.ffn_hidden_size, "n_positions": spec.max_position_embeddings,
            "layer_norm_epsilon": spec.norm_epsilon, "activation_function": GPT2_ACT[spec.activation],
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "initializer_range": 0.02}


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
    raise ConfigError(f"{path}: {what}: only plain Llama and GPT-2 models can be imported")


def spec_from_hf(config_path: Path) -> ModelSpec:
    """ModelSpec of an HF Llama / GPT-2 config.json; anything that the shard format cannot express is refused."""
    try:
        c = json.loads(Path(config_path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path}: unreadable config.json ({e}): pass a HuggingFace model dir") from None
    if not isinstance(c, dict):
        raise ConfigError(f"{config_path}: holds a JSON {type(c).__name__}, not an object: pass a HuggingFace model dir")
    try:
        return _spec_from_config(c, config_path)
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


def _spec_from_config(c: dict, config_path: Path) -> ModelSpec:
    kind = c.get("model_type")
    if kind == "llama":
        rope = c.get("rope_parameters") or {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
        if c.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            _refuse(config_path, f"rope scaling {rope.get('rope_type') or c.get('rope_scaling')} is not supported")
        for flag in ("attention_bias", "mlp_bias"):
            if c.get(flag):
                _refuse(config_path, f"{flag}=true is not supported")
        if c.get("hidden_act", "silu") != "silu":
            _refuse(config_path, f"hidden_act {c['hidden_act']!r} is not silu")
        heads = c["num_attention_heads"]
        return ModelSpec(
            architecture="llama", num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
            num_attention_heads=heads, ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"],
            num_query_groups=c.get("num_key_value_heads") or heads,
            kv_channels=c.get("head_dim") or c["hidden_size"] // heads,
            max_position_embeddings=c.get("max_position_embeddings", 2048), norm_epsilon=c.get("rms_norm_eps", 1e-6),
            rotary_base=float(rope.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))
    if kind == "gpt2":
        act = {v: k for k, v in GPT2_ACT.items()}.get(c.get("activation_function", "gelu_new"))
        if act is None:
            _refuse(config_path, f"activation_function {c.get('activation_function')!r} is not gelu or gelu_new")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if c.get(flag):
                _refuse(config_path, f"{flag}=true is not supported")
        if c.get("scale_attn_weights", True) is False:
            _refuse(config_path, "scale_attn_weights=false is not supported")
        return ModelSpec(
            architecture="gpt2", num_layers=c["n_layer"], hidden_size=c["n_embd"], num_attention_heads=c["n_head"],
            ffn_hidden_size=c.get("n_inner") or 4 * c["n_embd"], vocab_size=c["vocab_size"],
            max_position_embeddings=c.get("n_positions", 1024), norm_epsilon=c.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=True, activation=act)
    _refuse(config_path, f"model_type {kind!r}")
    raise AssertionError  # unreachable


class HFTensors:
    """The tensors of an HF model dir (model.safetensors or an index of several) or of one
    safetensors file, read lazily."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if hf_dir.is_file():
            hf_dir, files = hf_dir.parent, [hf_dir.name]
        elif index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (hf_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise FormatError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json: only safetensors "
                              f"weights are imported (convert .bin weights with transformers' save_pretrained)")
        self._handles = {}
        self.where: dict[str, str] = {}
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise FormatError(f"{path}: listed in the index but missing: download it again")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a damaged header
                raise FormatError(f"{path}: not a readable safetensors file ({e}): download or merge it again") from None
            self._handles[name] = handle
            for key in handle.keys():
                self.where[key] = name

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.where[name]].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.where[name]].get_slice(name).get_shape())


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")


def tokenizer_files(directory: Path) -> list[Path]:
    return [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
