"""One rank of tests/mcore_reference.py: builds megatron-core's GPTModel (local spec) on CPU over gloo
and writes its state dict's (key, shape, dtype) list as JSON. Run as
``python mcore_reference_child.py --child RANK CONFIG.json OUT.json`` by mcore_reference.py (whose
docstring says how the model is built and why)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    for name in ("megatron", "megatron.core", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def expert_tp(spec, tp: int) -> int:
    """megatron-core's expert tensor-parallel size for a model: TP, or 1 for biased experts (its TransformerConfig
    asserts it: GPT-OSS)."""
    return 1 if spec.is_moe and spec.add_bias_linear else tp


def _build_model(model: dict, tp: int, pp: int, grouped: bool = False):
    """megatron-core's GPTModel, local spec; an MoE model's experts are SequentialMLP, or with `grouped` the
    GroupedMLP of --moe-grouped-gemm without Transformer Engine (built on CPU for its state dicts only: its
    forward needs the grouped_gemm CUDA package)."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ckpt_tools.model.spec import ModelSpec

    fields = {k: v for k, v in model.items() if k not in ("padded_vocab_size", "ep", "etp") and v is not None}
    s = ModelSpec.from_dict({"vocab_size": 1, **fields})  # the family's defaults for unset features
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    activation = {"swiglu": F.silu, "gelu": F.gelu, "quick_geglu": quick_gelu,
                  "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[s.activation]
    mla = {}
    if s.softmax_type == "learnable":  # GPT-OSS: sinks, windows, the clamped GLU of +1 (megatron-core's names)
        mla.update(softmax_type="learnable", glu_linear_offset=s.glu_linear_offset,
                   activation_func_clamp_value=s.activation_clamp,
                   window_size=(s.sliding_window - 1, 0) if s.sliding_window else None,
                   window_attn_skip_freq=s.window_attn_skip_freq)
    if s.multi_latent_attention:  # DeepSeek-V3: MLATransformerConfig, plain RoPE (its default is YaRN), routing
        from megatron.core.transformer.transformer_config import MLATransformerConfig as TransformerConfig
        mla = dict(multi_latent_attention=True, q_lora_rank=s.q_lora_rank, kv_lora_rank=s.kv_lora_rank,
                   qk_head_dim=s.qk_head_dim, qk_pos_emb_head_dim=s.qk_pos_emb_head_dim, v_head_dim=s.v_head_dim,
                   rotary_base=s.rotary_base, apply_rope_fusion=False,
                   **(dict(rope_type="yarn", rotary_scaling_factor=s.rope_scaling_factor, mscale=s.rope_mscale,
                           mscale_all_dim=s.rope_mscale_all_dim, beta_fast=s.rope_beta_fast, beta_slow=s.rope_beta_slow,
                           original_max_position_embeddings=s.rope_original_max_position_embeddings)
                      if s.rope_scaling == "yarn" else dict(rope_type="rope")))
    if s.is_moe and (s.moe_router_score_function == "sigmoid" or s.layer_pattern is not None):
        mla.update(moe_router_score_function=s.moe_router_score_function,
                   moe_router_enable_expert_bias=s.moe_router_enable_expert_bias,
                   moe_router_num_groups=s.moe_router_num_groups, moe_router_group_topk=s.moe_router_group_topk,
                   moe_router_topk_scaling_factor=s.moe_router_topk_scaling_factor, moe_router_dtype="fp32",
                   moe_layer_freq=[int(s.moe_layer(i)) for i in range(s.num_layers)])
    config = TransformerConfig(
        num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_attention_heads,
        num_query_groups=s.num_query_groups, ffn_hidden_size=s.ffn_hidden_size, kv_channels=s.kv_channels,
        layernorm_epsilon=s.norm_epsilon, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        hidden_dropout=0.0, attention_dropout=0.0, normalization=s.normalization,
        gated_linear_unit=s.gated_linear_unit, activation_func=activation, add_bias_linear=s.add_bias_linear,
        add_qkv_bias=s.add_qkv_bias, qk_layernorm=s.qk_layernorm, rotary_interleaved=bool(s.rotary_interleaved),
        bias_activation_fusion=False,
        **({"num_moe_experts": s.num_moe_experts, "moe_router_topk": s.moe_router_topk,
            "moe_ffn_hidden_size": s.moe_ffn_hidden_size, "moe_router_pre_softmax": s.moe_router_pre_softmax,
            "moe_grouped_gemm": grouped, "moe_token_dispatcher_type": "allgather",
            "expert_model_parallel_size": int(model.get("ep", 1)),
            "moe_shared_expert_intermediate_size": s.moe_shared_expert_intermediate_size,
            "moe_shared_expert_gate": bool(s.moe_shared_expert_gate),
            "expert_tensor_parallel_size": int(model.get("etp") or expert_tp(s, tp))} if s.is_moe else {}),
        **mla, **({"mtp_num_layers": s.mtp_num_layers} if s.mtp_num_layers else {}),
    )
    tied = s.tie_word_embeddings
    if s.rope_scaling == "yarn" and not s.multi_latent_attention:  # GPTModel's own YaRN reads these attributes
        for ours, theirs in (("rope_scaling_factor", "rotary_scaling_factor"),
                             ("rope_original_max_position_embeddings", "original_max_position_embeddings"),
                             ("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow"),
                             ("rope_mscale", "mscale"), ("rope_mscale_all_dim", "mscale_all_dim"),
                             ("rope_truncate", "correction_range_round_to_int")):
            setattr(config, f"yarn_{theirs}", getattr(s, ours))
        pos_kw = dict(position_embedding_type="yarn", rotary_base=s.rotary_base)
    elif s.position_embedding_type == "rope":
        pos_kw = dict(position_embedding_type="rope", rotary_base=s.rotary_base, rotary_percent=s.rotary_percent,
                      rope_scaling=s.rope_scaling == "llama3", rope_scaling_factor=s.rope_scaling_factor)
    else:
        pos_kw = dict(position_embedding_type="learned_absolute")

    if s.multi_latent_attention or s.layer_pattern is not None:  # per-layer specs (moe_layer_freq a list)
        spec = _block_spec(config, s.multi_latent_attention)
    else:
        spec = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=s.qk_layernorm,
                                        num_experts=s.num_moe_experts, moe_grouped_gemm=grouped)
    mtp = {}
    if s.mtp_num_layers:  # DeepSeek-V3's multi-token prediction layers (on the last stage), as Megatron-LM builds them
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        mtp["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    if grouped and importlib.util.find_spec("megatron.core.transformer.moe.grouped_gemm_util") is not None:
        from megatron.core.transformer.moe import grouped_gemm_util  # the legacy GroupedMLP's (gone in 0.19)
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=int(model["padded_vocab_size"]),
        max_sequence_length=s.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tied,
        **pos_kw, **mtp,
    )


def _block_spec(config, mla: bool):
    """megatron-core's own local decoder block spec (dense or MoE per layer by moe_layer_freq); an MLA model's core
    attention replaced: the local DotProductAttention does not take the key / value widths MLA passes it (and
    Transformer Engine's needs CUDA). The replacement is plain causal softmax attention at MLA's softmax scale; every
    projection, norm, rotary embedding and the routing are megatron-core's own."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention
    multi_latent_attention.HAVE_TE = False  # no Transformer Engine here (its stand-ins fail isinstance checks)

    class CoreAttention(torch.nn.Module):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **kw):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kw):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    for layer in block.layer_specs if mla else ():
        layer.submodules.self_attention.submodules.core_attention = CoreAttention
    return block


def _child_main(rank: int, cfg_path: str, out_path: str) -> int:
    import traceback

    _quiet()
    tmp_out = out_path + ".tmp"
    try:
        cfg = json.loads(Path(cfg_path).read_text())
        tp, pp = int(cfg["tp"]), int(cfg["pp"])

        import datetime

        import torch

        torch.set_num_threads(1)
        import trainer  # noqa: F401 (megatron-core imported as the trainer imports it: no CPU torch.compile wrappers)
        # megatron-core's tied-embedding setup calls ``weight.data.cuda()`` before the
        # all-reduce between first and last PP stage; keep tensors on CPU instead.
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
        _quiet()  # importing megatron may have reset filters

        torch.distributed.init_process_group(
            "gloo",
            rank=rank,
            world_size=tp * pp,
            timeout=datetime.timedelta(seconds=120),
        )
        from megatron.core import parallel_state

        _quiet()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        torch.manual_seed(1234)
        gpt = _build_model(cfg["model"], tp, pp)
        entries = []
        for k, v in gpt.state_dict().items():
            if isinstance(v, torch.Tensor):
                entries.append([k, list(v.shape), str(v.dtype).removeprefix("torch.")])
            else:
                entries.append([k, None, None])
        result = {
            "rank": rank,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "entries": entries,
        }
        Path(tmp_out).write_text(json.dumps(result))
        os.replace(tmp_out, out_path)
        # Keep ranks together so nobody tears the store down under a slower peer.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return 0
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        tb = traceback.format_exc()
        try:
            if not Path(out_path).exists():
                Path(tmp_out).write_text(json.dumps({"rank": rank, "error": tb}))
                os.replace(tmp_out, out_path)
        finally:
            sys.stderr.write(tb)
            sys.stderr.flush()
        return 1


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--child":
    # Run as a script, sys.path[0] is tests/; drop it so nothing there can shadow a package.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    # os._exit: skip interpreter teardown (gloo/megatron atexit hooks can hang).
    sys.stdout.flush()
    _code = _child_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
