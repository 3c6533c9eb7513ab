"""Multi-token prediction (DeepSeek-V3's MTP) for the trainer: megatron-core's MultiTokenPredictionBlock as its local
spec holds and computes it, on the last pipeline stage.

Depth m (0 first) takes the previous depth's output (the decoder's after its final norm, for the first) and the
embedding of the tokens shifted m + 1 places left (the last ones zero, as megatron-core's roll fills them), each
normed (`hnorm`, `enorm`), concatenated [embedding; hidden] and projected back to the hidden size (`eh_proj`, a column
layer whose output every TP rank gathers), then a transformer layer like the decoder's last and a final norm; the
model's own output layer gives its logits, which predict the token m + 2 places ahead. The loss adds each depth's mean
cross entropy over the positions that have such a token, times `scale` / depths (megatron-core's
mtp_loss_scaling_factor); the reported loss is the model's own."""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ckpt_tools.model.spec import ModelSpec
from trainer.mla import GatherLastDim
from trainer.layers import make_norm, no_init, tp_group
from trainer.model import TransformerLayer


class MTPLayer(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, ep, moe_layer: str):
        super().__init__()
        h = spec.hidden_size
        # Registration order = megatron-core's state-dict order.
        self.enorm = make_norm(spec, config)
        self.hnorm = make_norm(spec, config)
        self.eh_proj = tensor_parallel.ColumnParallelLinear(2 * h, h, config=config, tp_group=tp_group(),
                                                            init_method=no_init, bias=False, gather_output=False)
        self.transformer_layer = TransformerLayer(spec, config, tp_size, ep, moe_layer, spec.num_layers - 1)
        self.final_layernorm = make_norm(spec, config)
        self.tp_size = tp_size

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, selective: bool = False) -> torch.Tensor:
        x, _ = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        if self.tp_size > 1:
            x = GatherLastDim.apply(x, self.eh_proj.tp_group)
        return self.final_layernorm(self.transformer_layer(x, rope, selective))


class MTPBlock(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, ep, moe_layer: str):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(spec, config, tp_size, ep, moe_layer)
                                    for _ in range(spec.mtp_num_layers))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, embedding: nn.Module, rope,
                selective: bool = False) -> list[torch.Tensor]:
        """Each depth's hidden states [s, b, h] (the output layer turns them into logits)."""
        out = []
        for layer in self.layers:
            tokens = torch.cat((tokens[:, 1:], torch.zeros_like(tokens[:, :1])), dim=1)  # megatron-core's roll
            hidden = layer(hidden, embedding(tokens), rope, selective)
            out.append(hidden)
        return out


def mtp_loss(loss_fn, logits: list[torch.Tensor], labels: torch.Tensor, scale: float) -> torch.Tensor:
    """scale / depths x the sum of each depth's mean cross entropy [s, b, V/TP] logits vs `labels` [b, s] shifted
    m + 1 places (the positions with a token that far ahead)."""
    s = labels.shape[1]
    total = sum(loss_fn(lg[:s - m - 1], labels[:, m + 1:]) for m, lg in enumerate(logits))
    return total * (scale / len(logits))
