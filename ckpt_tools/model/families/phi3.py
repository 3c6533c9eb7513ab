"""Phi-3: Llama's math with fused HF tensors: `qkv_proj` is [all q; all k; all v] rows and `gate_up_proj`
is [gate; up], which is megatron-core's own fc1 layout."""
from ckpt_tools.model.families import OMIT, QKV_FUSED, SAME, VOCAB, Const, Family, Name, anything, heads_dim, llama

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
NAMES = (
    Name("embedding.word_embeddings.weight", VOCAB, ("model.embed_tokens.weight",)),
    Name(_L + "input_layernorm.weight", SAME, (_H + "input_layernorm.weight",)),
    Name(_L + "self_attention.linear_proj.weight", SAME, (_H + "self_attn.o_proj.weight",)),
    Name(_L + "self_attention.linear_qkv.weight", QKV_FUSED, (_H + "self_attn.qkv_proj.weight",)),
    Name(_L + "pre_mlp_layernorm.weight", SAME, (_H + "post_attention_layernorm.weight",)),
    Name(_L + "mlp.linear_fc1.weight", SAME, (_H + "mlp.gate_up_proj.weight",)),
    Name(_L + "mlp.linear_fc2.weight", SAME, (_H + "mlp.down_proj.weight",)),
    Name("decoder.final_layernorm.weight", SAME, ("model.norm.weight",)),
    Name("output_layer.weight", VOCAB, ("lm_head.weight",)),
)

FAMILY = Family(
    name="phi3", model_type="phi3", hf_class="Phi3ForCausalLM",
    names=NAMES,
    config=llama.config(1e-5, heads_dim, 4096,
                        Const("sliding_window", None, "sliding-window attention: megatron-core's GPTModel attends "
                                                      "to every earlier position"),
                        Const("resid_pdrop", 0.0, accept=anything), Const("embd_pdrop", 0.0, accept=anything),
                        Const("original_max_position_embeddings", OMIT, accept=anything),
                        Const("pad_token_id", None, accept=anything)),  # transformers' default 32000 may be past the vocab
)
