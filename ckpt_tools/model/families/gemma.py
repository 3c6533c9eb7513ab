"""Gemma (1): Llama's layers with zero-centred RMSNorm weights (the norm scales by 1 + w, w stored as is, as
megatron-core's layernorm_zero_centered_gamma does), embeddings scaled by sqrt(hidden), a gated tanh-GELU MLP,
tied embeddings, explicit head_dim. Megatron-LM's GPTModel has no embedding scaling: Gemma is written to HF and
our format, not to Megatron-LM's forms."""
from ckpt_tools.model.families import Const, Family, anything, llama


def tanh_gelu(v) -> bool:
    return v in ("gelu_pytorch_tanh", "gelu")  # transformers reads a legacy "gelu" as the tanh approximation


FAMILY = Family(
    name="gemma", model_type="gemma", hf_class="GemmaForCausalLM",
    features={"activation": ("geglu_tanh",), "zero_centered_norm": (True,),
              "scale_embeddings": (True,), "tie_word_embeddings": (True,)},
    names=llama.NAMES,
    config=llama.config(1e-6, 256, 8192,
                        Const("hidden_activation", None, "an MLP activation other than tanh-GELU", accept=tanh_gelu),
                        Const("attention_bias", False, "biases on q, k, v and o"),
                        Const("use_bidirectional_attention", None, "bidirectional attention",
                              accept=lambda v: not v),
                        Const("pad_token_id", None, accept=anything),
                        act=Const("hidden_act", "gelu_pytorch_tanh", "an MLP activation other than tanh-GELU",
                                  accept=tanh_gelu),
                        tied=True),
)
