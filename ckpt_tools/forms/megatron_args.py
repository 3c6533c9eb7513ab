"""Megatron-LM's `args` a written Megatron-LM checkpoint carries for a model and layout (the other way, the ModelSpec
and layout a checkpoint's args describe, is ckpt_tools.forms.megatron_spec; each feature's own arguments are its
record's, ckpt_tools.model.features).

Megatron-LM keeps its whole argparse.Namespace in every checkpoint. At load it compares a few fields with
the run's own (`check_checkpoint_args`: num_layers, hidden_size, num_attention_heads, add_position_embedding,
max_position_embeddings, make_vocab_size_divisible_by, padded_vocab_size, tokenizer_type, TP/PP for the legacy
form), and `--use-checkpoint-args` copies the model's fields from it (`load_args_from_checkpoint`). This module
writes the model's and the layout's fields under Megatron-LM's names, so that both work and the readers
(spec_from_args) get the same ModelSpec back. Fields about training (batch sizes, schedule) are left
to the run that loads the checkpoint.
"""
from __future__ import annotations

import argparse
import sys

from ckpt_tools.errors import ConfigError
from ckpt_tools.forms import forms, torchsave
# reading a checkpoint's args (-> ModelSpec and layout) is ckpt_tools.forms.megatron_spec
from ckpt_tools.forms.megatron_spec import LINEAR_FIELDS, MAMBA_ARGS, MLA_FIELDS
from ckpt_tools.model import features, hybrid
from ckpt_tools.model.spec import ModelSpec


def pipeline_split(counts: list[int]) -> dict:
    """Megatron-LM's arguments for a layers-per-stage split: an even split needs none; otherwise the first and
    last stage may differ from the (equal) middle ones."""
    pp = len(counts)
    if len(set(counts)) == 1:
        return {"decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None}
    middle = counts[1:-1]
    if pp > 2 and len(set(middle)) != 1:
        raise ConfigError(f"layers per stage {counts}: Megatron-LM can give only the first and last stage their own "
                          f"layer counts (--decoder-first/last-pipeline-num-layers), the middle ones must be equal: "
                          f"choose such a split")
    first = counts[0] if pp == 2 or counts[0] != middle[0] else None
    last = counts[-1] if pp == 2 or counts[-1] != middle[0] else None
    return {"decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last}


def moe_args(spec: ModelSpec, ep: int = 1) -> dict:
    """Megatron-LM's MoE arguments: every layer's MLP megatron-core's MoE layer with SequentialMLP experts (no
    grouped GEMM), top-k routing, a shared expert where the family has one, the load-balancing loss megatron-core's
    default (off); the routing features' arguments are theirs (ckpt_tools.model.features.moe)."""
    if not spec.is_moe:
        return {"num_experts": None, "expert_model_parallel_size": 1}
    return {"num_experts": spec.num_moe_experts, "moe_router_topk": spec.moe_router_topk,
            "moe_ffn_hidden_size": spec.moe_ffn_hidden_size, "moe_router_pre_softmax": spec.moe_router_pre_softmax,
            "moe_grouped_gemm": False,
            "moe_layer_freq": 1 if spec.layer_pattern is None else [int(spec.moe_layer(i)) for i in range(spec.num_layers)],
            "moe_shared_expert_intermediate_size": spec.moe_shared_expert_intermediate_size,
            "moe_shared_expert_overlap": False,
            "moe_router_num_groups": spec.moe_router_num_groups, "moe_router_group_topk": spec.moe_router_group_topk,
            "moe_router_topk_scaling_factor": spec.moe_router_topk_scaling_factor,
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "allgather",
            # megatron-core biases experts only unsplit (its TransformerConfig asserts ETP 1 with add_bias_linear);
            # torch_dist holds them whole, the legacy form is refused for them at TP > 1 (to_megatron.check)
            "expert_tensor_parallel_size": 1 if spec.add_bias_linear else None,
            "expert_model_parallel_size": ep}


def linear_args(spec: ModelSpec) -> dict:
    """Megatron-LM's gated DeltaNet arguments: --experimental-attention-variant gated_delta_net, its layers by
    --linear-attention-freq (a list, 1 for a DeltaNet layer), its sizes ({} for a model without)."""
    if spec.linear_num_key_heads is None:
        return {"experimental_attention_variant": None, "linear_attention_freq": None}
    return {"experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": [int(spec.layer_symbols(i)[0] == "G") for i in range(spec.num_layers)],
            **{k: getattr(spec, k) for k in LINEAR_FIELDS}}


def _torch_dtype(dtype: str):
    """torch.<dtype> where torch is loaded; else its stand-in, which pickles as torch.<dtype> (torchsave.Global): a
    process that writes without torch does not import it for one constant."""
    torch = sys.modules.get("torch")
    return getattr(torch, dtype) if torch is not None else torchsave.dtype_global(dtype)


def build_args(spec: ModelSpec, tp: int, counts: list[int], padded: int, dtype: str, ckpt_format: str,
               iteration: int = 0, tokenizer: str | None = None, ep: int = 1,
               pattern: hybrid.Pattern | None = None, vpp: int = 1) -> argparse.Namespace:
    """The Namespace for `spec` at TP `tp` x PP len(counts) (x EP `ep`), weights of dtype name `dtype`; with a
    `pattern`, a HybridModel's (pretrain_hybrid.py's --hybrid-layer-pattern: num_layers counts its indices, its
    '|' segments give the pipeline split). With `vpp` > 1 `counts` are an interleaved pipeline's PP x VPP virtual
    stages (even: --num-layers-per-virtual-pipeline-stage)."""
    features.check_expressible(spec)
    args = _gpt_args(spec, tp, counts, padded, dtype, ckpt_format, iteration, tokenizer, ep)
    vars(args).update(forms.get(ckpt_format).args)  # the form's own run (fsdp_dtensor: --use-megatron-fsdp)
    if vpp > 1:
        vars(args).update(pipeline_model_parallel_size=len(counts) // vpp, virtual_pipeline_model_parallel_size=vpp,
                          num_layers_per_virtual_pipeline_stage=counts[0], num_virtual_stages_per_pipeline_rank=None,
                          decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    if pattern is not None:  # (its 'G' layers by the pattern, not GPTModel's experimental attention variant)
        vars(args).update(num_layers=pattern.num_indices, is_hybrid_model=True, decoder_first_pipeline_num_layers=None,
                          decoder_last_pipeline_num_layers=None, experimental_attention_variant=None,
                          linear_attention_freq=None, **{hybrid.PATTERN: pattern.text})
    if spec.hybrid:  # Megatron-LM's Mamba-2 arguments (pretrain_hybrid.py)
        vars(args).update({k: getattr(spec, k) for k in MAMBA_ARGS})
    return args


def _gpt_args(spec: ModelSpec, tp: int, counts: list[int], padded: int, dtype: str, ckpt_format: str,
              iteration: int, tokenizer: str | None, ep: int) -> argparse.Namespace:
    gqa = spec.num_query_groups != spec.num_attention_heads
    pp = len(counts)
    return argparse.Namespace(
        # the model
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, group_query_attention=gqa,
        num_query_groups=spec.num_query_groups if gqa else 1, kv_channels=spec.kv_channels,
        max_position_embeddings=spec.max_position_embeddings,
        rotary_base=int(spec.rotary_base) if float(spec.rotary_base).is_integer() else spec.rotary_base,
        rotary_percent=spec.rotary_percent, rotary_seq_len_interpolation_factor=None,
        norm_epsilon=spec.norm_epsilon, **linear_args(spec), apply_residual_connection_post_layernorm=False,
        window_size=(spec.sliding_window - 1, 0) if spec.sliding_window is not None else None,
        window_attn_skip_freq=spec.window_attn_skip_freq,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by, padded_vocab_size=padded,
        vocab_size=spec.vocab_size, mtp_num_layers=spec.mtp_num_layers,
        **{k: getattr(spec, k) for k in MLA_FIELDS}, **moe_args(spec, ep), **features.megatron_args(spec),
        hidden_dropout=0.0, attention_dropout=0.0, apply_query_key_layer_scaling=False,
        # Transformer Engine's where megatron-core has no local module (zero-centred norms, gated DeltaNet)
        transformer_impl="transformer_engine" if spec.zero_centered_norm or spec.linear_num_key_heads else "local",
        use_legacy_models=False, spec=None,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer,
        # the layout
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        pipeline_model_parallel_layout=None, context_parallel_size=1,
        sequence_parallel=False, **pipeline_split(counts),
        # precision and the checkpoint itself
        bf16=dtype == "bfloat16", fp16=dtype == "float16", params_dtype=_torch_dtype(dtype),
        ckpt_format=ckpt_format, iteration=iteration, consumed_train_samples=0, consumed_valid_samples=0,
        no_save_optim=True, no_save_rng=True,
        # not Megatron-LM's (it ignores it): the HF family, for families that share one set of Megatron-LM
        # arguments (Mistral and Phi-3 are Llama's); spec_from_args reads it back
        hf_family=spec.architecture,
    )
