"""GPT-OSS (OpenAI's gpt-oss-20b / -120b): grouped-query attention with biases and a learned sink logit per head
(megatron-core's `softmax_type` learnable: `core_attention.softmax_offset`), sliding-window attention on alternate
layers (megatron-core's `window_size` (W - 1, 0) with `window_attn_skip_freq` 2: layers 0, 2, 4, ... windowed), YaRN
rotary embeddings with an unrounded correction range, and an MoE layer in every layer: a biased router and biased
experts whose SwiGLU is clamped (megatron-core's quick_geglu, `glu_linear_offset` 1, `activation_func_clamp_value`).

transformers stores each layer's experts stacked (`mlp.experts.gate_up_proj` [experts, hidden, 2 x ffn], its gate
and up columns interleaved; `down_proj` [experts, ffn, hidden]): each expert's megatron-core tensors are one slice of
them (ckpt_tools.model.hf, `gate_up_t` and `conv1d`).

Refused in one line: attention without biases (megatron-core biases every linear layer or only QKV, and GPT-OSS's
experts are biased), a swiglu_alpha other than 1.702 (megatron-core's quick_gelu fixes it), layer_types other than
every N-th layer full, experts of another width than intermediate_size.
"""
from ckpt_tools.errors import ConfigError
from ckpt_tools.model.families import (CONV1D, GATE_UP_T, QKV, SAME, VOCAB, Const, Derived, Family, Field, Name, Rope,
                                       llama)
from ckpt_tools.model.families.mixtral import TRAINING_ONLY

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
_A, _HA = _L + "self_attention.", _H + "self_attn."
_E, _HE = _L + "mlp.experts.local_experts.{e}.", _H + "mlp.experts."

NAMES = (
    Name("embedding.word_embeddings.weight", VOCAB, ("model.embed_tokens.weight",)),
    Name(_L + "input_layernorm.weight", SAME, (_H + "input_layernorm.weight",)),
    Name(_A + "core_attention.softmax_offset", SAME, (_HA + "sinks",)),
    Name(_A + "linear_proj.weight", SAME, (_HA + "o_proj.weight",)),
    Name(_A + "linear_proj.bias", SAME, (_HA + "o_proj.bias",)),
    Name(_A + "linear_qkv.weight", QKV, tuple(_HA + f"{p}_proj.weight" for p in "qkv")),
    Name(_A + "linear_qkv.bias", QKV, tuple(_HA + f"{p}_proj.bias" for p in "qkv")),
    Name(_L + "pre_mlp_layernorm.weight", SAME, (_H + "post_attention_layernorm.weight",)),
    Name(_L + "mlp.router.weight", SAME, (_H + "mlp.router.weight",)),
    Name(_L + "mlp.router.bias", SAME, (_H + "mlp.router.bias",)),
    # no `{e}` in the HF names: every expert's tensor is a slice of one stacked tensor
    Name(_E + "linear_fc1.weight", GATE_UP_T, (_HE + "gate_up_proj",)),
    Name(_E + "linear_fc1.bias", GATE_UP_T, (_HE + "gate_up_proj_bias",)),
    Name(_E + "linear_fc2.weight", CONV1D, (_HE + "down_proj",)),
    Name(_E + "linear_fc2.bias", SAME, (_HE + "down_proj_bias",)),
    Name("decoder.final_layernorm.weight", SAME, ("model.norm.weight",)),
    Name("output_layer.weight", VOCAB, ("lm_head.weight",)),
)

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' GptOssConfig rope_parameters where config.json gives none
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}


def _read_window(c: dict, out: dict, refuse) -> None:
    """sliding_window: transformers' 128 where absent; null: no window."""
    w = c.get("sliding_window", 128)
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
        refuse(f"sliding_window {w!r} (a number of positions >= 1, or null)")
    out["sliding_window"] = w


def _read_layer_types(c: dict, out: dict, refuse) -> None:
    """layer_types -> window_attn_skip_freq: every layer windowed (None), or every N-th layer full (megatron-core's
    window_attn_skip_freq N; transformers' default: N = 2)."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        refuse(f"layer_types {types!r:.80} is not {n} entries of {SLIDING!r} or {FULL!r}")
    if out.get("sliding_window") is None or FULL not in types:  # no window (windowed layers attend fully), or all
        out["window_attn_skip_freq"] = None
        return
    freq = types.index(FULL) + 1
    if types != [FULL if (i + 1) % freq == 0 else SLIDING for i in range(n)]:
        refuse(f"layer_types {types!r:.80}: megatron-core's window_attn_skip_freq makes every N-th layer full, the "
               f"others windowed")
    out["window_attn_skip_freq"] = freq


def _write_layer_types(spec) -> list[str]:
    return [SLIDING if spec.windowed(i) else FULL for i in range(spec.num_layers)]


def _read_alpha(c: dict, out: dict, refuse) -> None:
    alpha = c.get("swiglu_alpha", 1.702)
    if alpha != 1.702:
        refuse(f"swiglu_alpha {alpha!r} is not supported (megatron-core's quick_gelu fixes it at 1.702)")


def check(spec) -> None:
    if spec.moe_ffn_hidden_size != spec.ffn_hidden_size:
        raise ConfigError(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} differs from ffn_hidden_size "
                          f"{spec.ffn_hidden_size}: GPT-OSS's experts are intermediate_size wide")
    if spec.moe_router_pre_softmax:
        raise ConfigError("moe_router_pre_softmax true is not GPT-OSS's router (a softmax over the top-k logits): set "
                          "it false")
    if spec.activation_clamp is None:
        raise ConfigError("activation_clamp unset: transformers' GPT-OSS always clamps its experts' GLU (swiglu_limit; "
                          "megatron-core's --activation-func-clamp-value): give it")


FAMILY = Family(
    name="gpt_oss", model_type="gpt_oss", hf_class="GptOssForCausalLM", moe=True, windows=True,
    # the published checkpoints' MXFP4: the experts' weights (biases, router, attention, embeddings, head unquantized)
    mxfp4=(".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"),
    mxfp4_unconverted=("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"),
    features={"activation": ("quick_geglu",), "add_bias_linear": (True,),
              "rope_scaling": ("yarn", None), "tie_word_embeddings": (False,), "softmax_type": ("learnable",),
              # transformers' experts: gate * sigmoid(alpha * gate) * (up + 1)
              "glu_linear_offset": (1.0,)},
    names=NAMES, check=check,
    config=llama.config(
        1e-5, 64, 131072,
        Field("num_local_experts", "num_moe_experts", 128),
        Field("num_experts_per_tok", "moe_router_topk", 4),
        Derived("sliding_window", _read_window, lambda spec: spec.sliding_window),
        Derived("layer_types", _read_layer_types, _write_layer_types),
        Derived("swiglu_alpha", _read_alpha, lambda spec: 1.702),
        Field("swiglu_limit", "activation_clamp", 7.0),
        Const("attention_bias", True, "attention without biases: megatron-core biases every linear layer or only "
                                      "QKV, and GPT-OSS's experts are biased"),
        *TRAINING_ONLY,
        act=Const("hidden_act", "silu", accept=lambda v: True),  # not read by transformers' GPT-OSS
        rope=Rope(150000.0, truncate=True, default_params=YARN)),
)
