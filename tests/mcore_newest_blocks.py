"""megatron-core's own models of the newer blocks, built on the CPU for tests/mcore_newest.py (the reference of what
Megatron-LM saves today): HybridStack's submodules from megatron-core's local layers (attention, MLP, MoE halves,
Mamba-2 layers, gated DeltaNet layers), its HybridModel / 0.16's MambaModel of a Mamba hybrid, its GPTModel of
Qwen3-Next, and the stand-ins their GPU-only imports need (mamba_ssm's gated norm, fla's l2norm, Transformer Engine's
zero-centred RMSNorm: the same parameters; no kernel runs here)."""
from __future__ import annotations

import copy
import importlib.machinery
import sys
import types

def _hybrid_spec(spec, torch, older: bool = False):
    """HybridStack's submodules from megatron-core's local GPT layer spec: '*' its attention half, '-' its MLP half,
    'E' its MoE MLP; each with the key map the local spec declares (torch_dist then holds Transformer Engine's names,
    as a GPU run's TE layers save them)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    if older:  # megatron-core 0.16's MambaStack (its layers the same classes)
        from megatron.core.ssm import mamba_block as hybrid_block
        from megatron.core.ssm.mamba_block import MambaStack as HybridStack
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as HybridStackSubmodules
    else:
        from megatron.core.models.hybrid import hybrid_block
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    dense = get_gpt_layer_local_spec(normalization=spec.normalization, qk_layernorm=spec.qk_layernorm).submodules
    hybrid_block.TENorm = dense.input_layernorm  # the final norm: megatron-core's torch norm, not TE's
    mamba = {}
    if spec.hybrid:  # megatron-core's MambaLayer and MambaMixer, its in_proj / out_proj the local parallel linears, the
        # layer's norm its own module, saved under the name Transformer Engine's fused in_proj gives it
        from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
        from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        mamba["mamba_layer"] = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=dense.input_layernorm, mamba_bda=dense.self_attn_bda,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                                out_proj=RowParallelLinear)),
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"}))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=dense.input_layernorm, self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))
    moe = None
    if spec.is_moe:
        sub = get_gpt_layer_local_spec(normalization=spec.normalization, qk_layernorm=spec.qk_layernorm,
                                       num_experts=spec.num_moe_experts).submodules
        moe = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda))
    if spec.linear_num_key_heads is not None:  # Qwen3-Next's blocks: 'G' gated DeltaNet, '*' gated attention, 'E'
        # MoE, every norm zero-centred (Transformer Engine's, stood in), each under Transformer Engine's names
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        hybrid_block.TENorm = ZeroCenteredRMSNorm
        mamba["gdn_layer"] = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=ZeroCenteredRMSNorm, self_attn_bda=dense.self_attn_bda,
            self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear)),
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.in_proj.layer_norm_"}))
        attention = copy.deepcopy(attention)
        attention.submodules.input_layernorm = ZeroCenteredRMSNorm
        attention.submodules.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
        attention.submodules.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
        moe.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention, mlp_layer=mlp, **({"moe_layer": moe} if moe is not None else {}), **mamba))


def _mamba_hybrid(spec, cfg: dict, padded: int):
    """megatron-core 0.19's HybridModel of a Mamba hybrid (its config from the spec, as Megatron-LM's arguments give
    it: squared-ReLU MLPs, no positions, the Mamba-2 sizes)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig
    if cfg.get("mcore") != "0.16":
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    config = TransformerConfig(
        num_layers=len(cfg["pattern"].replace("|", "")), hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size, kv_channels=spec.kv_channels, layernorm_epsilon=spec.norm_epsilon,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=cfg["pp"], hidden_dropout=0.0,
        attention_dropout=0.0, normalization=spec.normalization, gated_linear_unit=False, activation_func=squared_relu,
        add_bias_linear=False, bias_activation_fusion=False, mamba_state_dim=spec.mamba_state_dim,
        mamba_head_dim=spec.mamba_head_dim, mamba_num_groups=spec.mamba_num_groups,
        mamba_num_heads=spec.mamba_num_heads)
    stages = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                  post_process=parallel_state.is_pipeline_last_stage(),
                  share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="none")
    if cfg.get("mcore") == "0.16":
        from megatron.core.models.mamba.mamba_model import MambaModel
        return MambaModel(config=config, mamba_stack_spec=_hybrid_spec(spec, torch, older=True), vocab_size=padded,
                          max_sequence_length=spec.max_position_embeddings, hybrid_override_pattern=cfg["pattern"],
                          **stages)
    return HybridModel(config=config, hybrid_stack_spec=_hybrid_spec(spec, torch), vocab_size=padded,
                       max_sequence_length=spec.max_position_embeddings, hybrid_layer_pattern=cfg["pattern"], **stages)


class ZeroCenteredRMSNorm:
    """Transformer Engine's RMSNorm with zero_centered_gamma (x / rms(x) * (1 + w), its weight starting at 0), which
    megatron-core builds for --apply-layernorm-1p and has no local module for: a stand-in of the same parameters."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kw):
        import torch

        class Norm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
                self.eps = eps

            def forward(self, x):
                y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
                return (y * (1 + self.weight.float())).to(x.dtype)
        return Norm()


def _qwen3_next(spec, cfg: dict, padded: int):
    """megatron-core 0.19's GPTModel of Qwen3-Next (the layers Megatron-LM builds for --experimental-attention-variant
    gated_delta_net, from its local modules): its GatedDeltaNet (deterministic mode: its own torch conv and chunked
    delta rule), its gated attention (attention_output_gate) with per-head q/k norms and partial RoPE, its MoE with a
    gated shared expert; every norm zero-centred (--apply-layernorm-1p), saved under Transformer Engine's names."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    config = _qwen3_next_config(spec, cfg)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    block.layer_norm = ZeroCenteredRMSNorm
    block.layer_specs = [copy.deepcopy(layer) for layer in block.layer_specs]  # one spec object per layer
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    first = get_transformer_layer_offset(config)  # this pipeline stage's layers: from its first global one
    for i, layer in enumerate(block.layer_specs, start=first):
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if spec.layer_symbols(i)[0] == "G":
            sub.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear))
            sub.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
        else:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
            sub.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=padded,
                    max_sequence_length=spec.max_position_embeddings,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope",
                    rotary_percent=spec.rotary_percent, rotary_base=int(spec.rotary_base))


def _qwen3_next_config(spec, cfg: dict):
    """megatron-core's TransformerConfig of Qwen3-Next (GPTModel: a layer per pair; HybridModel: a layer per index)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    hybrid = cfg["kind"] == "hybrid"
    return TransformerConfig(
        num_layers=spec.num_layers * (2 if hybrid else 1), hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, ffn_hidden_size=spec.ffn_hidden_size, kv_channels=spec.kv_channels,
        layernorm_epsilon=spec.norm_epsilon, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=cfg["pp"],
        hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, bias_activation_fusion=False,
        qk_layernorm=True, attention_output_gate=True, deterministic_mode=True,
        num_moe_experts=spec.num_moe_experts, moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_pre_softmax=spec.moe_router_pre_softmax,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size, moe_shared_expert_gate=True,
        moe_layer_freq=1 if hybrid else [1] * spec.num_layers,
        **{k: getattr(spec, k) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                         "linear_value_head_dim", "linear_conv_kernel_dim")})


def stub_fla() -> None:
    """The `fla` (flash-linear-attention) modules megatron-core's GatedDeltaNet imports: its l2norm (x / sqrt(sum x^2 +
    1e-6)), the GPU kernels refusing to run (deterministic mode runs megatron-core's own torch conv and delta rule)."""
    import torch

    def l2norm(x, dim: int = -1, eps: float = 1e-6, **kw):
        return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)

    def kernel(*args, **kwargs):
        raise RuntimeError("fla's GPU kernels: deterministic mode does not call them")

    for name in ("fla", "fla.modules", "fla.modules.convolution", "fla.modules.l2norm", "fla.ops",
                 "fla.ops.gated_delta_rule"):
        module = types.ModuleType(name)
        module.__spec__, module.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules[name] = module
    sys.modules["fla.modules.convolution"].causal_conv1d = kernel
    sys.modules["fla.modules.l2norm"].l2norm = l2norm
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = kernel


def stub_mamba_ssm() -> None:
    """The `mamba_ssm` package megatron-core's MambaMixer imports (its GPU kernels): the gated norm as a module of its
    weight, the scans refusing to run. megatron-core then builds, saves and loads its Mamba layers on the CPU; their
    forward needs the real kernels."""
    import torch

    class RMSNorm(torch.nn.Module):  # mamba_ssm.ops.triton.layernorm_gated.RMSNorm's parameters
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
            self.register_parameter("bias", None)

    def kernel(*args, **kwargs):
        raise RuntimeError("Mamba-2's scan needs mamba_ssm's GPU kernels")

    names = ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.ops.triton.layernorm_gated",
             "mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.selective_state_update")
    for name in names:
        module = types.ModuleType(name)
        module.__spec__, module.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules[name] = module
    sys.modules["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm = RMSNorm
    for name in ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"):
        setattr(sys.modules["mamba_ssm.ops.triton.ssd_combined"], name, kernel)
    sys.modules["mamba_ssm.ops.triton.selective_state_update"].selective_state_update = kernel
