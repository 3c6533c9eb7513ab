"""Megatron-LM's `args` for a model and layout: what a written Megatron-LM checkpoint carries.

Megatron-LM keeps its whole argparse.Namespace in every checkpoint. At load it compares a few fields with
the run's own (`check_checkpoint_args`: num_layers, hidden_size, num_attention_heads, add_position_embedding,
max_position_embeddings, make_vocab_size_divisible_by, padded_vocab_size, tokenizer_type, TP/PP for the legacy
form), and `--use-checkpoint-args` copies the model's fields from it (`load_args_from_checkpoint`). This module
writes the model's and the layout's fields under Megatron-LM's names, so that both work and the readers
(megatron_lm.spec_from_args) get the same ModelSpec back. Fields about training (batch sizes, schedule) are left
to the run that loads the checkpoint.
"""
from __future__ import annotations

import argparse
import sys

from ckpt_tools import torchsave
from ckpt_tools.errors import ConfigError
from ckpt_tools.spec import ModelSpec

# Megatron-LM's --rope-scaling applies megatron-core's fixed llama3 frequency bounds.
MCORE_LLAMA3 = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                "rope_original_max_position_embeddings": 8192}


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


def check_expressible(spec: ModelSpec) -> None:
    """Refuse what Megatron-LM's arguments cannot say (llama3 bounds other than megatron-core's, Gemma's scaled
    embeddings and zero-centred norms, OLMoE's q/k norms over all heads)."""
    if spec.qk_norm_across_heads:
        raise ConfigError(f"{spec.architecture}: its q/k norms span all heads, megatron-core's qk_layernorm normalises "
                          f"each head: Megatron-LM's forms cannot hold this model; keep it in our format or HF")
    if spec.scale_embeddings or spec.zero_centered_norm:
        raise ConfigError(f"{spec.architecture}: megatron-core's GPTModel has no embedding scaling (and zero-centred "
                          f"norms only with Transformer Engine): Megatron-LM's forms cannot hold this model; keep it "
                          f"in our format or HF")
    if spec.rope_scaling == "llama3":
        odd = [f"{k} {getattr(spec, k)} (Megatron-LM: {v})" for k, v in MCORE_LLAMA3.items() if getattr(spec, k) != v]
        if odd:
            raise ConfigError(f"llama3 rope scaling with {', '.join(odd)}: Megatron-LM's --use-rope-scaling fixes "
                              f"these, so the written model would differ; keep the model in our format or HF")


def moe_args(spec: ModelSpec, ep: int = 1) -> dict:
    """Megatron-LM's MoE arguments: every layer's MLP megatron-core's MoE layer with SequentialMLP experts (no
    grouped GEMM), top-k routing, a shared expert where the family has one, the load-balancing loss megatron-core's
    default (off)."""
    if not spec.is_moe:
        return {"num_experts": None, "expert_model_parallel_size": 1}
    return {"num_experts": spec.num_moe_experts, "moe_router_topk": spec.moe_router_topk,
            "moe_ffn_hidden_size": spec.moe_ffn_hidden_size, "moe_router_pre_softmax": spec.moe_router_pre_softmax,
            "moe_grouped_gemm": False, "moe_layer_freq": 1,
            "moe_shared_expert_intermediate_size": spec.moe_shared_expert_intermediate_size,
            "moe_shared_expert_gate": bool(spec.moe_shared_expert_gate), "moe_shared_expert_overlap": False,
            "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
            "moe_router_num_groups": None, "moe_router_topk_scaling_factor": None,
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "allgather", "expert_tensor_parallel_size": None,
            "expert_model_parallel_size": ep}


def _torch_dtype(dtype: str):
    """torch.<dtype> where torch is loaded; else its stand-in, which pickles as torch.<dtype> (torchsave.Global): a
    process that writes without torch does not import it for one constant."""
    torch = sys.modules.get("torch")
    return getattr(torch, dtype) if torch is not None else torchsave.dtype_global(dtype)


def build_args(spec: ModelSpec, tp: int, counts: list[int], padded: int, dtype: str, ckpt_format: str,
               iteration: int = 0, tokenizer: str | None = None, ep: int = 1) -> argparse.Namespace:
    """The Namespace for `spec` at TP `tp` x PP len(counts) (x EP `ep`), weights of dtype name `dtype`."""
    check_expressible(spec)
    rope = spec.position_embedding_type == "rope"
    gqa = spec.num_query_groups != spec.num_attention_heads
    pp = len(counts)
    return argparse.Namespace(
        # the model
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, group_query_attention=gqa,
        num_query_groups=spec.num_query_groups if gqa else 1, kv_channels=spec.kv_channels,
        max_position_embeddings=spec.max_position_embeddings,
        # Megatron-LM's default (its parser's, and its Llama 3 example's): megatron-core's GPTModel goes by
        # position_embedding_type; check_checkpoint_args compares this flag with the run's
        position_embedding_type=spec.position_embedding_type, add_position_embedding=True,
        use_rotary_position_embeddings=rope, rotary_base=int(spec.rotary_base) if float(spec.rotary_base).is_integer()
        else spec.rotary_base, rotary_percent=1.0, rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None, use_rope_scaling=spec.rope_scaling == "llama3",
        rope_scaling_factor=spec.rope_scaling_factor,
        normalization=spec.normalization, norm_epsilon=spec.norm_epsilon, apply_layernorm_1p=False,
        qk_layernorm=spec.qk_layernorm, apply_residual_connection_post_layernorm=False,
        swiglu=spec.activation == "swiglu", openai_gelu=False, squared_relu=False, quick_geglu=False,
        bias_gelu_fusion=spec.add_bias_linear and spec.activation == "gelu_tanh", bias_swiglu_fusion=True,
        add_bias_linear=spec.add_bias_linear, add_qkv_bias=spec.qkv_bias,
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by, padded_vocab_size=padded,
        vocab_size=spec.vocab_size, multi_latent_attention=False, mtp_num_layers=None, **moe_args(spec, ep),
        hidden_dropout=0.0, attention_dropout=0.0, apply_query_key_layer_scaling=False,
        transformer_impl="local", use_legacy_models=False, spec=None,
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
        # arguments (Mistral and Phi-3 are Llama's); megatron_lm.spec_from_args reads it back
        hf_family=spec.architecture,
    )
