"""What each model family (ckpt_tools/model/families) reads from and writes to a config, no model built:

- every family writes a config.json that it reads back as the same ModelSpec, and declares a default for every
  feature field;
- a transformers config field a family cannot honour is refused in one line naming the file, and a ModelSpec field a
  family cannot hold is refused (ConfigError) when the spec is made;
- a YaRN that Megatron-LM's arguments cannot say is refused for its forms, and the load command names the rotary flags
  --use-checkpoint-args does not restore.

The families as whole models (transformers, megatron-core, the trainer) are proven in test_families.py.
"""
from __future__ import annotations

import json
import re

import pytest
from families_cases import OWN_FIELDS, VOCAB

from ckpt_tools.errors import ConfigError
from ckpt_tools.model import families, features, hf
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.verbs.request import Layout


def test_family_records_map_their_config_both_ways():
    """Each family writes a config.json that it reads back as the same spec, and names a feature
    (ckpt_tools.model.features) only where the values it allows differ from the feature's own."""
    for family in families.all_families():
        assert all(allowed != features.BY_NAME[f].allowed for f, allowed in family.features.items()), family.name
        spec = ModelSpec(architecture=family.name, num_layers=2, hidden_size=64, num_attention_heads=4,
                         num_query_groups=4 if family.name in ("gpt2", "deepseek_v3") else 2, ffn_hidden_size=96,
                         vocab_size=VOCAB, kv_channels=16, max_position_embeddings=128,
                         **({"num_moe_experts": 4, "moe_router_topk": 2} if family.moe else {}),
                         **({"moe_shared_expert_intermediate_size": 48} if family.shared_experts else {}),
                         **OWN_FIELDS.get(family.name, {}))
        config = hf.hf_config(spec, "float32", 1, 2)
        assert config["model_type"] == family.model_type
        back = ModelSpec.from_dict(family.spec_fields(config, pytest.fail))
        assert back == spec, family.name


@pytest.mark.parametrize("changes,expected", [
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window 4096 is not supported (sliding-window"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is not supported"),
    ({"model_type": "seed_oss", "attention_bias": False}, "attention_bias=false is not supported (Q, K and V without"),
    ({"model_type": "seed_oss", "attention_out_bias": True}, "attention_out_bias=true is not supported"),
    ({"model_type": "seed_oss", "mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"model_type": "glm", "attention_bias": False}, "attention_bias=false is not supported (Q, K and V without"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope scaling longrope"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, "mlp_only_layers [0] is not supported (layers with a dense"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
    ({"model_type": "mixtral", "num_experts_per_tok": 5}, "moe_router_topk 5 exceeds num_moe_experts 4"),
    ({"model_type": "deepseek_v3", "rope_interleave": False}, "rope_interleave=false is not supported"),
    ({"model_type": "deepseek_v3", "norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
    ({"model_type": "deepseek_v3", "rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05 is not 1e-6"),
    ({"model_type": "deepseek_v3", "n_group": 2, "topk_group": 2}, "topk_group 2: transformers scores a group"),
    ({"model_type": "deepseek_v3", "first_k_dense_replace": 2}, "first_k_dense_replace 2 with 2 layers"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "truncate": False}},
     "yarn with truncate false or an explicit attention_factor is not supported"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn"}}, "yarn without a factor"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 0,
                                                       "mscale_all_dim": 1.0}},
     "yarn with mscale 0 and mscale_all_dim"),
    ({"model_type": "qwen3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling 'yarn' is not"),
    ({"model_type": "glm4_moe", "norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"model_type": "gpt_oss", "attention_bias": False}, "attention_bias=false is not supported (attention without"),
    ({"model_type": "gpt_oss", "swiglu_alpha": 1.5}, "swiglu_alpha 1.5 is not supported"),
    ({"model_type": "gpt_oss", "layer_types": ["full_attention", "sliding_attention"]},
     "megatron-core's window_attn_skip_freq makes every N-th layer full"),
    ({"model_type": "gpt_oss", "sliding_window": 0}, "sliding_window 0 (a number of positions"),
    ({"model_type": "nemotron_h", "layers_block_type": ["linear_attention", "moe"]}, "MoE layers ('E' in 'ME'"),
    ({"model_type": "nemotron_h", "conv_kernel": 2}, "conv_kernel 2 is not supported (a convolution of another"),
    ({"model_type": "nemotron_h", "mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported"),
    ({"model_type": "nemotron_h", "layer_norm_epsilon": 1e-6}, "megatron-core's gated norm inside each mixer fixes"),
    ({"model_type": "nemotron_h", "mamba_num_heads": 3}, "mamba_num_heads 3 is not divisible by mamba_num_groups 2"),
    ({"model_type": "nemotron_h", "layers_block_type": ["linear_attention", "convolution"]},
     "layers_block_type ['linear_attention', 'convolution']"),
    ({"model_type": "qwen3_next", "mlp_only_layers": [1]}, "mlp_only_layers [1] is not supported (layers with a dense"),
    ({"model_type": "qwen3_next", "attention_bias": True}, "attention_bias=true is not supported"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "sliding_attention"]},
     "layer_types ['linear_attention', 'sliding_attention'] is not 2 entries"),
    ({"model_type": "qwen3_next", "linear_num_value_heads": 3}, "linear_num_value_heads 3 is not divisible by"),
])
def test_fields_a_family_cannot_honour_are_refused(changes, expected, tmp_path):
    moe = {"num_moe_experts": 4} if families.get(changes["model_type"]).moe else {}
    if families.get(changes["model_type"]).shared_experts:
        moe["moe_shared_expert_intermediate_size"] = 48
    spec = ModelSpec(architecture=changes["model_type"], num_layers=2, hidden_size=64, num_attention_heads=4,
                     ffn_hidden_size=96, vocab_size=VOCAB, **moe, **OWN_FIELDS.get(changes["model_type"], {}))
    config = {**hf.hf_config(spec, "float32", None, None), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(Exception) as e:
        hf.spec_from_hf(path)
    assert expected in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("fields,expected", [
    ({"architecture": "gpt_oss", "num_moe_experts": 4, "rope_scaling": "yarn"},
     "activation_clamp unset: transformers' GPT-OSS always clamps"),
    ({"architecture": "gpt_oss", "num_moe_experts": 4, "activation_clamp": 7.0, "rope_scaling": None,
      "rope_truncate": False}, "rope_truncate false (YaRN's correction range unrounded) with rope_scaling None"),
    ({"architecture": "deepseek_v3", "rope_truncate": False, "rope_scaling": "yarn", **OWN_FIELDS["deepseek_v3"],
      "num_moe_experts": 4, "moe_shared_expert_intermediate_size": 48},
     "only YaRN in the families whose config says so"),
    ({"architecture": "llama", "sliding_window": 8}, "sliding_window 8 given, but llama attends to every earlier"),
    ({"architecture": "llama", "rotary_interleaved": True}, "rotary_interleaved True is not available for llama"),
    ({"architecture": "ernie4_5", "rotary_interleaved": False},
     "rotary_interleaved False is not available for ernie4_5"),
    ({"architecture": "llama", "activation_clamp": 7.0},
     "glu_linear_offset / activation_clamp with activation 'swiglu'"),
    ({"architecture": "llama", "mamba_num_heads": 8}, "mamba_num_heads given, but llama has no Mamba layers"),
    ({"architecture": "nemotron_h", **OWN_FIELDS["nemotron_h"], "mamba_state_dim": None},
     "a Mamba-2 mixer needs mamba_state_dim"),
    ({"architecture": "nemotron_h", **OWN_FIELDS["nemotron_h"], "layer_pattern": "M*-"},
     "layer_pattern 'M*-' is not 2 symbols"),
    ({"architecture": "nemotron_h", **OWN_FIELDS["nemotron_h"], "layer_pattern": "M+"},
     "symbol(s) '+' not read for nemotron_h"),
    ({"architecture": "qwen3", "linear_num_key_heads": 2}, "linear_num_key_heads given, but qwen3 has no gated"),
    ({"architecture": "qwen3_next", **OWN_FIELDS["qwen3_next"], "num_moe_experts": 4,
      "moe_shared_expert_intermediate_size": 48, "layer_pattern": "GEG-"}, "layer_pattern 'GEG-': dense MLPs"),
])
def test_model_fields_a_family_cannot_hold_are_refused(fields, expected):
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 96, "vocab_size": VOCAB}
    with pytest.raises(ConfigError, match=re.escape(expected)):
        ModelSpec(**{**base, **fields})


def test_yarn_megatron_lm_cannot_say_is_not_written_in_its_forms():
    """megatron-core's MLA takes YaRN's original context and betas from its config defaults (4096, 32, 1: no
    Megatron-LM argument sets them): a DeepSeek-V3 of another original context is refused for Megatron-LM's forms
    in one line, and the load command names the rotary flags --use-checkpoint-args does not restore."""
    from pathlib import Path

    from ckpt_tools.errors import ConfigError
    from ckpt_tools.verbs import to_megatron
    fields = {**OWN_FIELDS["deepseek_v3"], "rope_scaling": "yarn", "rope_scaling_factor": 40.0,
              "rope_mscale_all_dim": 1.0}
    spec = ModelSpec(architecture="deepseek_v3", num_layers=2, hidden_size=64, num_attention_heads=4,
                     num_query_groups=4, ffn_hidden_size=96, vocab_size=VOCAB, num_moe_experts=4, moe_router_topk=2,
                     moe_shared_expert_intermediate_size=48, **{**fields, "rope_original_max_position_embeddings": 32})
    with pytest.raises(ConfigError, match="YaRN with rope_original_max_position_embeddings 32 \\(Megatron-LM: 4096\\)"):
        features.check_expressible(spec)
    ok = ModelSpec(**{**spec.to_dict(), "rope_original_max_position_embeddings": 4096})
    features.check_expressible(ok)
    line = to_megatron.loads_with(Path("out"), Layout("torch_dist", 1, [spec.num_layers], 128), spec=ok)
    assert "--rope-type yarn --rotary-scaling-factor 40 --mscale 1 --mscale-all-dim 1" in line, line


# GlmConfig keeps a null head_dim and num_key_value_heads as null (its model cannot be built from them): no null case
@pytest.mark.parametrize("model_type,config_class,nulls", [("seed_oss", "SeedOssConfig", True),
                                                           ("ernie4_5", "Ernie4_5Config", True),
                                                           ("glm", "GlmConfig", False)])
def test_families_read_the_defaults_transformers_assumes(model_type, config_class, nulls, tmp_path):
    """SeedOssConfig, Ernie4_5Config and GlmConfig: without head_dim 128, with null hidden / heads; without
    num_key_value_heads their own count (8, 2, 2), with null one per head; ERNIE 4.5 tied and at rope theta 500000,
    GLM-4 rotating half of each head, unless told. A config that leaves them out is read as transformers builds the
    model."""
    import transformers
    base = {"model_type": model_type, "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 16}
    for extra in ({}, {"head_dim": None, "num_key_value_heads": None}) if nulls else ({},):
        theirs = getattr(transformers, config_class)(**{k: v for k, v in {**base, **extra}.items()
                                                          if k != "model_type"})
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        spec = hf.spec_from_hf(tmp_path / "config.json")
        assert (spec.kv_channels, spec.num_query_groups, spec.tie_word_embeddings, spec.rotary_base,
                spec.rotary_percent, spec.norm_epsilon) == (
            theirs.head_dim, theirs.num_key_value_heads, theirs.tie_word_embeddings,
            theirs.rope_parameters["rope_theta"], theirs.rope_parameters.get("partial_rotary_factor", 1.0),
            theirs.rms_norm_eps), extra
