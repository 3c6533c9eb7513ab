"""The model's shape: what every tool needs to know to split, join, convert or rebuild it.

Field names are the trainer's config names; `from_megatron_args` maps Megatron-LM's argument names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckpt_tools.errors import ConfigError
from ckpt_tools.model.features import NAMES as FEATURE_NAMES


def _families():
    from ckpt_tools.model import families
    return families


def build_dataclass(cls, d: dict, what: str, hint: str):
    """cls(**d), refusing unknown keys and bad values with one ConfigError naming them."""
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(f"unknown {what} {', '.join(unknown)}: {hint}")
    try:
        return cls(**d)
    except TypeError as e:
        raise ConfigError(f"bad {what}: {e}") from None


# a hybrid family's layer symbols (megatron-core's HybridModel pattern; 'E' where the model has experts)
HYBRID_SYMBOLS = "M*-"
HYBRID_NAMES = {"M": "a Mamba-2 mixer", "*": "attention", "-": "an MLP", "E": "an MoE layer"}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the family (ckpt_tools/model/families): llama, mistral, qwen2, qwen3, phi3, gpt2
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int  # true vocab (tokenizer size); the embedding is padded beyond it
    num_query_groups: int | None = None  # None: = num_attention_heads (no GQA)
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # the share of each head's dims the rotary embedding turns, the first ones (GLM-4.5)
    tie_word_embeddings: bool | None = None  # None: the family's default (gpt2, gemma, ernie4_5 tied; most not)
    make_vocab_size_divisible_by: int = 128
    # Features (megatron-core TransformerConfig terms); None: the family's default, and a family refuses
    # values it cannot express (ckpt_tools.model.features lists them).
    activation: str | None = None  # swiglu (gated silu) | geglu_tanh (gated tanh-GELU) | gelu | gelu_tanh |
    # quick_geglu (gated x * sigmoid(1.702 x): megatron-core's quick_gelu, GPT-OSS's experts) | squared_relu
    # (relu(x)^2, not gated: megatron-core's squared_relu, Nemotron-H's relu2)
    normalization: str | None = None  # RMSNorm | LayerNorm
    add_bias_linear: bool | None = None  # biases on every linear layer
    add_qkv_bias: bool | None = None  # biases on the QKV projection only (Qwen2)
    qk_layernorm: bool | None = None  # a norm on queries and keys (Qwen3, OLMoE)
    qk_norm_across_heads: bool | None = None  # that norm spans all heads at once, not each head (OLMoE)
    position_embedding_type: str | None = None  # rope | learned_absolute | none (Nemotron-H: no positions at all)
    rotary_interleaved: bool | None = None  # RoPE turns adjacent pairs of dims (2j, 2j + 1), not the halves (ERNIE 4.5)
    rope_scaling: str | None = None  # None, llama3 (Llama 3.1 frequency scaling) or yarn (DeepSeek-V3, Kimi K2)
    rope_scaling_factor: float = 8.0  # llama3 scaling parameters (megatron-core's defaults)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # YaRN (rope_scaling yarn; rope_scaling_factor its factor, rope_original_max_position_embeddings its original
    # context): the frequencies blended between beta_fast and beta_slow rotations, cos/sin scaled by
    # mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim), MLA's softmax scale by mscale(factor,
    # rope_mscale_all_dim)^2 (megatron-core's and transformers' formulas)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    zero_centered_norm: bool | None = None  # norms scale by 1 + weight (Gemma; layernorm_zero_centered_gamma)
    scale_embeddings: bool | None = None  # embeddings times sqrt(hidden_size) (Gemma)
    # Mixture of experts (megatron-core's MoE layer with SequentialMLP experts); None: a dense model.
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # each expert's MLP width; None: ffn_hidden_size
    moe_router_topk: int = 2  # experts per token
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k, not renormalised (Qwen3-MoE's
    # norm_topk_prob false); else top-k of the logits, then softmax over those k (= Mixtral's renormalised top-k)
    moe_shared_expert_intermediate_size: int | None = None  # a shared expert every token goes through (Qwen2-MoE)
    moe_shared_expert_gate: bool | None = None  # its output scaled by sigmoid(gate_weight . x) (a feature: Qwen2-MoE)
    # DeepSeek-style routing (megatron-core's names): sigmoid scores, a bias that steers the choice only, the experts
    # in groups of which the best `moe_router_group_topk` are searched, the chosen weights scaled
    moe_router_score_function: str | None = None  # softmax | sigmoid (a feature)
    moe_router_enable_expert_bias: bool | None = None  # router.expert_bias (DeepSeek-V3's e_score_correction_bias)
    moe_router_num_groups: int | None = None  # None: no group-limited routing
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None  # None: 1 (DeepSeek-V3's routed_scaling_factor)
    # The blocks of each layer, in megatron-core HybridModel's symbols, a pair per layer: attention ('*', or '+' for
    # multi-latent attention) then its MLP ('-' dense, 'E' MoE). None: every layer alike (the features say which);
    # DeepSeek-V3's first dense layers are "*-" pairs before "*E" ones (megatron-core's moe_layer_freq). A hybrid
    # family's layer is one block, a symbol per layer ('M' a Mamba-2 mixer, '*' attention, '-' an MLP): its pattern
    # is always given (HF's hybrid_override_pattern / layers_block_type).
    layer_pattern: str | None = None
    # Multi-latent attention (DeepSeek-V2/V3; megatron-core's MLATransformerConfig): queries through a low-rank
    # projection (q_lora_rank; None: one projection), keys and values through a shared latent of kv_lora_rank; each
    # head's query and key a part without positions (qk_head_dim) and a rotary part (qk_pos_emb_head_dim)
    multi_latent_attention: bool | None = None  # a feature
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    # Multi-token prediction (DeepSeek-V3; megatron-core's mtp_num_layers, transformers' num_nextn_predict_layers):
    # that many MTP layers after the decoder, each predicting one token further. None: none.
    mtp_num_layers: int | None = None
    # GPT-OSS's attention and experts (megatron-core's names where it has them):
    softmax_type: str | None = None  # vanilla | learnable: a learned logit per head in each softmax's denominator (a
    # feature: megatron-core's core_attention.softmax_offset, transformers' GPT-OSS `sinks`)
    sliding_window: int | None = None  # windowed layers attend the last W positions, their own included (transformers'
    # sliding_window; megatron-core's window_size (W - 1, 0)); None: every layer attends to every earlier position
    window_attn_skip_freq: int | None = None  # with a window: every N-th layer (counted from 1) attends fully, the
    # others by the window (megatron-core's window_attn_skip_freq); None: every layer by the window
    glu_linear_offset: float | None = None  # a gated MLP's act(gate) * (up + offset) (a feature: megatron-core's
    # glu_linear_offset; GPT-OSS's experts 1)
    activation_clamp: float | None = None  # the gate clamped above, the up half on both sides, at this value
    # (megatron-core's activation_func_clamp_value, transformers' swiglu_limit)
    rope_truncate: bool = True  # YaRN's correction range rounded outwards to whole dims (transformers' truncate,
    # megatron-core's yarn_correction_range_round_to_int)
    # Mamba-2 mixers (megatron-core's MambaMixer; a hybrid family's 'M' layers): heads of mamba_head_dim channels
    # (d_inner = heads x head dim), a state of mamba_state_dim per group of heads, a causal depthwise convolution
    mamba_num_heads: int | None = None
    mamba_head_dim: int | None = None
    mamba_state_dim: int | None = None
    mamba_num_groups: int | None = None
    # Gated DeltaNet mixers (megatron-core's GatedDeltaNet; a 'G' attention half of a layer, Qwen3-Next's linear
    # attention): key heads of linear_key_head_dim, value heads of linear_value_head_dim (each key head serves
    # value heads / key heads of them), a causal depthwise convolution of linear_conv_kernel_dim over [q; k; v]
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    attention_output_gate: bool | None = None  # each head's attention output times sigmoid(a gate projected with q) (a
    # feature: megatron-core's attention_output_gate, Qwen3-Next's full attention)

    def __post_init__(self) -> None:
        from ckpt_tools.model import families
        self._check_types()
        family = families.get(self.architecture)
        object.__setattr__(self, "_hybrid", family.hybrid)  # asked per key (layer_symbols): not looked up each time
        unavailable = []  # every feature the family does not allow, named in one line
        for name in FEATURE_NAMES:
            allowed, value = family.allowed(name), getattr(self, name)
            if value is None and None not in allowed:
                object.__setattr__(self, name, allowed[0])
            elif value not in allowed:
                unavailable.append(f"{name} {value!r} is not available for {self.architecture}: expected "
                                   f"{' or '.join(map(repr, allowed))}")
        if unavailable:
            raise ConfigError("; ".join(unavailable))
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}: set kv_channels explicitly or change one of them"
                )
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by num_query_groups "
                f"{self.num_query_groups}: each query group must hold the same number of heads"
            )
        if (self.num_moe_experts is not None) != family.moe:
            raise ConfigError(f"num_moe_experts {self.num_moe_experts!r} does not fit {self.architecture}: "
                              + ("a mixture-of-experts family needs the number of experts" if family.moe else
                                 "a dense family has no experts (the MoE families are " +
                                 ", ".join(f.name for f in families.all_families() if f.moe) + ")"))
        if self.num_moe_experts is not None:
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            if self.moe_router_topk > self.num_moe_experts:
                raise ConfigError(f"moe_router_topk {self.moe_router_topk} exceeds num_moe_experts "
                                  f"{self.num_moe_experts}: each token picks at most every expert")
            if (self.moe_shared_expert_intermediate_size is not None) != family.shared_experts:
                raise ConfigError(f"moe_shared_expert_intermediate_size {self.moe_shared_expert_intermediate_size!r} "
                                  f"does not fit {self.architecture}: " + (
                                      "its MoE layers have a shared expert: give its width" if family.shared_experts
                                      else "its MoE layers have no shared expert"))
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError("moe_shared_expert_gate needs a shared expert (moe_shared_expert_intermediate_size)")
        self._check_blocks(family)
        if family.check is not None:
            family.check(self)

    def _check_blocks(self, family) -> None:
        """Multi-latent attention's sizes, grouped routing and the layer pattern: given where they mean something,
        absent where they do not, the pattern one pair per layer in the features' symbols."""
        mla = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        if self.multi_latent_attention:
            missing = [k for k in mla if getattr(self, k) is None]
            if missing:
                raise ConfigError(f"multi-latent attention needs {', '.join(missing)}: give them (DeepSeek's "
                                  f"kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)")
        else:
            given = [k for k in ("q_lora_rank",) + mla if getattr(self, k) is not None]
            if given:
                raise ConfigError(f"{', '.join(given)} given, but {self.architecture} has no multi-latent attention")
        rotated = self.kv_channels * self.rotary_percent
        if self.rotary_percent != 1.0 and not family.partial_rotary:
            raise ConfigError(f"rotary_percent {self.rotary_percent} (partial rotary embeddings) is not available for "
                              f"{self.architecture}: the families with it are " + ", ".join(
                                  f.name for f in _families().all_families() if f.partial_rotary))
        partial = self.rotary_percent != 1.0
        if partial and (not 0 < self.rotary_percent < 1 or rotated != int(rotated) or int(rotated) % 2):
            raise ConfigError(f"rotary_percent {self.rotary_percent} of head dim {self.kv_channels} is not an even "
                              f"number of dims: choose a share that turns whole pairs")
        if self.moe_router_topk_scaling_factor == 1:
            object.__setattr__(self, "moe_router_topk_scaling_factor", None)
        grouped = [k for k in ("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor")
                   if getattr(self, k) is not None]
        if grouped and not family.grouped_routing:
            raise ConfigError(f"{', '.join(grouped)} given, but {self.architecture}'s router has no grouped or "
                              f"scaled top-k (the families with one: " + ", ".join(
                                  f.name for f in _families().all_families() if f.grouped_routing) + ")")
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            raise ConfigError("moe_router_num_groups and moe_router_group_topk go together: give both or neither")
        if self.moe_router_num_groups is not None and self.num_moe_experts % self.moe_router_num_groups:
            raise ConfigError(f"num_moe_experts {self.num_moe_experts} is not divisible by moe_router_num_groups "
                              f"{self.moe_router_num_groups}: every group holds as many experts")
        self._check_mamba(family)
        self._check_linear_attention(family)
        if family.hybrid:
            self._check_hybrid_pattern()
        elif self.layer_pattern is not None:
            self._check_pattern(family)
        if self.sliding_window is not None and not family.windows:
            raise ConfigError(f"sliding_window {self.sliding_window} given, but {self.architecture} attends to every "
                              f"earlier position (the families with windows: " + ", ".join(
                                  f.name for f in _families().all_families() if f.windows) + ")")
        if not self.rope_truncate and (self.rope_scaling != "yarn" or not any(
                getattr(f, "truncate", False) for f in family.config)):
            raise ConfigError(f"rope_truncate false (YaRN's correction range unrounded) with rope_scaling "
                              f"{self.rope_scaling!r} for {self.architecture}: only YaRN in the families whose config "
                              f"says so (" + ", ".join(f.name for f in _families().all_families() if any(
                                  getattr(c, "truncate", False) for c in f.config)) + ") has it; set it true")
        if self.window_attn_skip_freq is not None and self.sliding_window is None:
            raise ConfigError(f"window_attn_skip_freq {self.window_attn_skip_freq} without a sliding_window: give the "
                              f"window or drop the frequency")
        offset = self.glu_linear_offset not in (None, 0.0) or self.activation_clamp is not None
        if offset and self.activation != "quick_geglu":
            raise ConfigError(f"glu_linear_offset / activation_clamp with activation {self.activation!r}: only "
                              f"quick_geglu (GPT-OSS's clamped SwiGLU) has them")
        if self.mtp_num_layers is not None and not family.mtp_layers:
            raise ConfigError(f"mtp_num_layers {self.mtp_num_layers} given, but {self.architecture} has no multi-token "
                              f"prediction layers (the families with them: " + ", ".join(
                                  f.name for f in _families().all_families() if f.mtp_layers) + ")")
        if self.mtp_num_layers is not None and self.tie_word_embeddings:
            raise ConfigError("multi-token prediction layers with tied embeddings are not converted (DeepSeek-V3's and "
                              "GLM-4.5's are untied): set tie_word_embeddings false")

    MAMBA_FIELDS = ("mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups")

    def _check_mamba(self, family) -> None:
        """Mamba-2's sizes: all given in a hybrid family (its pattern may hold 'M' layers), none elsewhere; the heads
        in whole groups."""
        given = [k for k in self.MAMBA_FIELDS if getattr(self, k) is not None]
        if not family.hybrid:
            if given:
                raise ConfigError(f"{', '.join(given)} given, but {self.architecture} has no Mamba layers (the hybrid "
                                  f"families: " + ", ".join(f.name for f in _families().all_families() if f.hybrid)
                                  + ")")
            return
        missing = [k for k in self.MAMBA_FIELDS if getattr(self, k) is None]
        if missing:
            raise ConfigError(f"a Mamba-2 mixer needs {', '.join(missing)}: give them (HF's mamba_num_heads, "
                              f"mamba_head_dim, ssm_state_size, n_groups)")
        if self.mamba_num_heads % self.mamba_num_groups:
            raise ConfigError(f"mamba_num_heads {self.mamba_num_heads} is not divisible by mamba_num_groups "
                              f"{self.mamba_num_groups}: every group holds as many heads")

    LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim")

    def _check_linear_attention(self, family) -> None:
        """Gated DeltaNet's sizes: all given in a family with such layers, none elsewhere; value heads in whole groups
        per key head."""
        given = [k for k in self.LINEAR_FIELDS if getattr(self, k) is not None]
        if not family.linear_attention:
            if given:
                raise ConfigError(f"{', '.join(given)} given, but {self.architecture} has no gated DeltaNet layers "
                                  f"(the families with them: " + ", ".join(
                                      f.name for f in _families().all_families() if f.linear_attention) + ")")
            return
        missing = [k for k in self.LINEAR_FIELDS if getattr(self, k) is None]
        if missing:
            raise ConfigError(f"a gated DeltaNet layer needs {', '.join(missing)}: give them (HF's names)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads {self.linear_num_value_heads} is not divisible by "
                              f"linear_num_key_heads {self.linear_num_key_heads}: each key head serves as many value "
                              f"heads")

    def _check_hybrid_pattern(self) -> None:
        """A hybrid family's pattern: a symbol per layer, each a block this version holds."""
        text = self.layer_pattern
        if not isinstance(text, str) or len(text) != self.num_layers:
            raise ConfigError(f"layer_pattern {text!r:.80} is not {self.num_layers} symbols (a hybrid model gives one "
                              f"per layer: 'M' Mamba-2, '*' attention, '-' MLP)")
        allowed = HYBRID_SYMBOLS + ("E" if self.is_moe else "")
        bad = sorted(set(text) - set(allowed))
        if bad:
            raise ConfigError(f"layer_pattern {text!r:.80}: symbol(s) {', '.join(map(repr, bad))} not read for "
                              f"{self.architecture} (its layers: " + ", ".join(
                                  f"{k!r} {HYBRID_NAMES[k]}" for k in allowed) + ")")
        if self.is_moe and "E" not in text:
            raise ConfigError(f"layer_pattern {text!r:.80} has no MoE layer ('E') but the model has experts")

    def _check_pattern(self, family) -> None:
        text, n = self.layer_pattern, self.num_layers
        attention = "+" if self.multi_latent_attention else "*G" if family.linear_attention else "*"
        mlps = ("-", "E") if self.is_moe else ("-",)
        pairs = [text[i:i + 2] for i in range(0, len(text), 2)] if isinstance(text, str) else []
        bad = [i for i, p in enumerate(pairs) if len(p) != 2 or p[0] not in attention or p[1] not in mlps]
        if len(pairs) != n or bad:
            raise ConfigError(f"layer_pattern {text!r:.80} is not {n} pairs of {' or '.join(map(repr, attention))} and "
                              f"{' or '.join(map(repr, mlps))} (one per layer: attention, then its MLP)")
        if self.is_moe and "E" not in text:
            raise ConfigError(f"layer_pattern {text!r:.80} has no MoE layer ('E') but the model has experts")
        mlps = text[1::2]
        if self.is_moe and "-" in mlps and not (family.dense_first and mlps == mlps.count("-") * "-" + mlps.count(
                "E") * "E"):
            raise ConfigError(f"layer_pattern {text!r:.80}: dense MLPs ('-') among the MoE layers, which "
                              f"{self.architecture}'s config.json cannot say" + (
                                  " (only its first layers may be dense: first_k_dense_replace)" if family.dense_first
                                  else " (every layer of it is an MoE layer)"))
        if text == self.uniform_pattern:
            object.__setattr__(self, "layer_pattern", None)  # one spelling of a uniform model

    def _check_types(self) -> None:
        """Each field of its type (a size a positive integer): a value read from a file may be anything."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), f.type.replace(" | None", "")
            if value is None and f.type.endswith("| None"):
                continue
            if kind == "int":
                ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "a positive integer"
            elif kind == "float":
                ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            elif kind == "bool":
                ok, want = isinstance(value, bool), "true or false"
            else:
                ok, want = isinstance(value, str), "a string"
            if not ok:
                raise ConfigError(f"model field {f.name} is {value!r:.60}, expected {want}")

    @property
    def gated_linear_unit(self) -> bool:
        return self.activation in ("swiglu", "geglu_tanh", "quick_geglu")

    @property
    def qkv_bias(self) -> bool:
        """megatron-core's linear_qkv has a bias when every linear has one or only QKV has."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def hybrid(self) -> bool:
        """A layer is one block (megatron-core HybridModel's index), not an attention + MLP pair."""
        return self._hybrid

    def layer_symbols(self, i: int) -> str:
        """The pattern's symbols of global layer i: its attention's and its MLP's, or a hybrid layer's one."""
        return self.pattern[i] if self.hybrid else self.pattern[2 * i:2 * i + 2]

    @property
    def uniform_pattern(self) -> str:
        return (("+" if self.multi_latent_attention else "*") + ("E" if self.is_moe else "-")) * self.num_layers

    @property
    def pattern(self) -> str:
        """The layer pattern, a pair of symbols per layer (see `layer_pattern`), derived where not given."""
        return self.layer_pattern or self.uniform_pattern

    def windowed(self, i: int) -> bool:
        """Whether global layer i attends by the sliding window (megatron-core's is_layer_window_attention)."""
        if self.sliding_window is None:
            return False
        return self.window_attn_skip_freq is None or (i + 1) % self.window_attn_skip_freq != 0

    def moe_layer(self, i: int) -> bool:
        """Whether global layer i's MLP is the MoE layer (else a dense MLP of ffn_hidden_size)."""
        return self.layer_symbols(i)[-1] == "E"

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tp_size: int) -> int:
        """Megatron's rule: pad the vocab to a multiple of make_vocab_size_divisible_by x TP."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def padded_vocab_keeping(self, tp_size: int, kept: int | None) -> int:
        """The padded vocab at TP `tp_size` when a checkpoint already has one: its own (`kept`) wherever it still
        fits (a multiple of TP, at least the true vocab), so its rows move unchanged; else Megatron's rule."""
        if kept is not None and kept % tp_size == 0 and kept >= self.vocab_size:
            return kept
        return self.padded_vocab_size(tp_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        known = ", ".join(f.name for f in dataclasses.fields(cls))
        return build_dataclass(cls, d, "model field(s)", f"known fields are {known}")

    def check_tp(self, tp_size: int) -> None:
        """Refuse a TP size that the sharded tensors cannot be divided by (one message for all)."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"TP {tp_size!r} is not a positive number: choose a TP size >= 1")
        problems = []
        for what, n in (("num_attention_heads", self.num_attention_heads),
                        ("num_query_groups", self.num_query_groups),
                        ("ffn_hidden_size", self.ffn_hidden_size),
                        ("moe_ffn_hidden_size", self.moe_ffn_hidden_size or tp_size),
                        ("mamba_num_heads", self.mamba_num_heads or tp_size),
                        ("mamba_num_groups", self.mamba_num_groups or tp_size),
                        ("linear_num_key_heads", self.linear_num_key_heads or tp_size),
                        ("linear_num_value_heads", self.linear_num_value_heads or tp_size)):
            if n % tp_size:
                problems.append(f"{what} {n} is not divisible by TP {tp_size}")
        if problems:
            raise ConfigError("; ".join(problems) + ": choose a TP size that divides them")
