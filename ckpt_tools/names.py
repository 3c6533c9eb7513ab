"""Other names of the layout table's keys, as data: what a Megatron-LM checkpoint may call a tensor.

megatron-core's local spec names a layer's norms `input_layernorm` / `pre_mlp_layernorm`; Transformer Engine
fuses them into the following linear (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.
layer_norm_weight`). torch_dist checkpoints always use the Transformer Engine names: megatron-core's local spec
declares this very map (`sharded_state_dict_keys_map`) so that both specs save one form. A legacy `torch`
checkpoint has the names of the spec it was trained with.
"""
from __future__ import annotations

TE_NAMES = {  # local spec name (within a layer) -> Transformer Engine name
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def to_te(name: str) -> str:
    """A layer's key (or its part after `decoder.layers.<i>.`) in Transformer Engine's naming."""
    for local, te in TE_NAMES.items():
        if name.startswith(local) or f".{local}" in name:
            return name.replace(local, te, 1)
    return name


def from_te(name: str) -> str:
    """The inverse of to_te: a Transformer Engine name -> the layout table's (local spec) name."""
    for local, te in TE_NAMES.items():
        if name.startswith(te) or f".{te}" in name:
            return name.replace(te, local, 1)
    return name
