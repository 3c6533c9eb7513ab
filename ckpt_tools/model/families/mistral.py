"""Mistral: Llama's layers with an explicit head_dim (head_dim x heads may differ from hidden); no sliding window."""
from ckpt_tools.model.families import Const, Family, heads_dim, llama

FAMILY = Family(
    name="mistral", model_type="mistral", hf_class="MistralForCausalLM",
    names=llama.NAMES,
    config=llama.config(1e-6, heads_dim, 4096 * 32,
                        Const("sliding_window", None, "sliding-window attention: megatron-core's GPTModel attends "
                                                      "to every earlier position; set it to null only if the model "
                                                      "was trained without it")),
)
