"""The embeddings' features: the output layer tied to the word embeddings, and Gemma's embeddings scaled by
sqrt(hidden)."""
from __future__ import annotations

from ckpt_tools.model.features.base import Feature, arg, cannot_hold

TIED = Feature(
    "tie_word_embeddings", (False, True), "untie_embeddings_and_output_weights",
    read=lambda args: not arg(args, "untie_embeddings_and_output_weights", False),
    shown=lambda tied: not tied,
    write=lambda spec: {"untie_embeddings_and_output_weights": not spec.tie_word_embeddings})


SCALED = Feature("scale_embeddings", (False,), refuse=cannot_hold(
    "scale_embeddings", "megatron-core's GPTModel has no embedding scaling"))
