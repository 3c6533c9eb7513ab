"""The GPT model of one pipeline stage, built from megatron-core's tensor-parallel layers.

The module tree mirrors megatron-core's `GPTModel` with `get_gpt_layer_local_spec`, so that its
`state_dict()` holds the same keys, shapes and element order (DESIGN.md Contract 1). Activations
are [seq, batch, hidden] as in megatron-core. Megatron's GPTModel forward needs CUDA; these
layers run on CPU with gloo as well as on GPUs with NCCL.
"""
from __future__ import annotations

import zlib
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_tools.errors import ConfigError
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.spec import ModelSpec
from trainer import mcore_moe
from trainer.attention import SelfAttention
from trainer.layers import Embedding, RowParallelLinear, make_norm, no_init, rope_tables, tp_group
from trainer.moe import MoE

if TYPE_CHECKING:
    from trainer.graphs import Turns


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's quick_gelu: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


class MLP(nn.Module):
    """The dense MLP, or one expert of an MoE layer (`width` its ffn size)."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, width: int | None = None):
        super().__init__()
        width = width or spec.ffn_hidden_size
        self.gated = spec.gated_linear_unit
        self.gate_act = {"swiglu": F.silu, "quick_geglu": quick_gelu}.get(spec.activation,
                                                                          partial(F.gelu, approximate="tanh"))
        self.clamp, self.offset = spec.activation_clamp, spec.glu_linear_offset
        self.approximate = "tanh" if spec.activation == "gelu_tanh" else "none"
        self.squared = spec.activation == "squared_relu"
        fc1_rows = width * (2 if self.gated else 1)
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            spec.hidden_size, fc1_rows, config=config, tp_group=tp_group(), init_method=no_init, bias=spec.add_bias_linear,
            gather_output=False)
        self.linear_fc2 = RowParallelLinear(
            width, spec.hidden_size, config=config, tp_group=tp_group(), init_method=no_init,
            bias=spec.add_bias_linear, input_is_parallel=True, skip_bias_add=False)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = x.chunk(2, dim=-1)  # this rank's [gate_r; up_r]
            if self.clamp is not None:  # GPT-OSS: the gate clamped above, the up half on both sides
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            return self.gate_act(gate) * (up + self.offset) if self.offset else self.gate_act(gate) * up
        if self.squared:
            return F.relu(x).square()
        return F.gelu(x, approximate=self.approximate)

    def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:
        x, _ = self.linear_fc1(x)
        x = checkpoint(self.activation, x, use_reentrant=False) if selective else self.activation(x)
        x, _ = self.linear_fc2(x)
        return x


class TransformerLayer(nn.Module):
    """Selective recompute (Megatron-LM's --recompute-activations) recomputes the attention core and
    the MLP activation in backward: the big, cheap activations; full recompute wraps the layer."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, ep: tuple[int, int] | None = None,
                 moe_layer: str = "ours", index: int = 0):
        """`index`: the layer's global number (the layer pattern says whether its MLP is an MoE layer)."""
        super().__init__()
        self.input_layernorm = make_norm(spec, config)
        if spec.multi_latent_attention:
            from trainer.mla import MLASelfAttention  # it builds on this module's layers
            self.self_attention = MLASelfAttention(spec, config, tp_size)
        elif spec.layer_symbols(index)[0] == "G":
            from trainer.gdn import GatedDeltaNet  # it builds on this module's layers
            self.self_attention = GatedDeltaNet(spec, config, tp_size)
        else:
            self.self_attention = SelfAttention(spec, config, tp_size, index)
        self.pre_mlp_layernorm = make_norm(spec, config)
        if not spec.moe_layer(index):
            self.mlp = MLP(spec, config)
        elif moe_layer == "megatron_core":  # megatron-core's MoELayer itself (trainer/mcore_moe.py)
            self.mlp = mcore_moe.build(spec, config, ep[1] if ep is not None else 1)
        else:
            self.mlp = MoE(spec, config, MLP, ep)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                selective: bool = False) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), rope, selective)
        return x + self.mlp(self.pre_mlp_layernorm(x), selective)


class HybridLayer(nn.Module):
    """A hybrid model's layer: one block by its pattern symbol (megatron-core HybridModel's MambaLayer, or a
    TransformerLayer of attention or of an MLP only), behind its own norm, added to the residual."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, index: int):
        super().__init__()
        self.symbol = spec.layer_symbols(index)
        if self.symbol == "M":
            from trainer.mamba import MambaMixer
            self.norm = make_norm(spec, config)
            self.mixer = MambaMixer(spec, config, tp_size, tp_group(), no_init)
        elif self.symbol == "*":
            self.input_layernorm = make_norm(spec, config)
            self.self_attention = SelfAttention(spec, config, tp_size, index)
        else:
            self.pre_mlp_layernorm = make_norm(spec, config)
            self.mlp = MLP(spec, config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                selective: bool = False) -> torch.Tensor:
        if self.symbol == "M":
            return x + self.mixer(self.norm(x))
        if self.symbol == "*":
            return x + self.self_attention(self.input_layernorm(x), rope, selective)
        return x + self.mlp(self.pre_mlp_layernorm(x), selective)


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, num_layers: int, post_process: bool,
                 ep: tuple[int, int] | None = None, moe_layer: str = "ours", first: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(
            HybridLayer(spec, config, tp_size, first + i) if spec.hybrid else
            TransformerLayer(spec, config, tp_size, ep, moe_layer, first + i) for i in range(num_layers))
        self.final_layernorm = make_norm(spec, config) if post_process else None


def ready(module: nn.Module) -> None:
    """The weights of `module` are in place (always, unless an optimizer says otherwise)."""


class GPTStage(nn.Module):
    """One pipeline stage: embedding on the first, layers, final norm + output layer on the last.

    forward: tokens [b, s] (first stage) or hidden [s, b, h] -> hidden [s, b, h] or, on the last
    stage, vocab-parallel logits [s, b, padded_vocab / TP].
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig, *, tp_size: int, pp_rank: int,
                 layer_counts: list[int], padded_vocab: int, recompute: str | None = None,
                 ep: tuple[int, int] | None = None, moe_layer: str = "ours"):
        """`ep`: (EP rank, EP size) when an MoE model's experts are split over expert-parallel ranks. `moe_layer`:
        an MoE model's MLPs, trainer/moe.py's ("ours") or megatron-core's MoELayer ("megatron_core")."""
        super().__init__()
        self.ep = ep
        self.spec, self.padded_vocab, self.recompute = spec, padded_vocab, recompute
        self.sequence_parallel = config.sequence_parallel
        self.tp_size, self.pp_rank, self.layer_counts = tp_size, pp_rank, list(layer_counts)
        self.pre_process = pp_rank == 0
        self.post_process = pp_rank == len(layer_counts) - 1
        if self.pre_process:
            self.embedding = Embedding(spec, config, padded_vocab)
        self.decoder = Decoder(spec, config, tp_size, layer_counts[pp_rank], self.post_process, ep, moe_layer,
                               sum(layer_counts[:pp_rank]))
        self.share_weight = self.pre_process and spec.tie_word_embeddings
        # called with each module before its forward: the distributed optimizer waits there for the new weights'
        # all-gathers it left running (trainer/optim.py)
        self.params_ready = ready
        self.mtp_logits: list[torch.Tensor] = []  # the last forward's multi-token prediction logits, depth by depth
        # layers captured as CUDA graphs (trainer/graphs.py): local index -> the graphed layer's copies (one per
        # micro-batch a pipeline schedule keeps in flight), replayed while training on inputs of the captured shape
        # and dtype; `graph_turns` the copies' turns (graphs.Turns)
        self.graphed: dict[int, tuple[nn.Module, ...]] = {}
        self.graphed_shape: tuple | None = None
        self.graph_turns: Turns | None = None
        self.graph_replays = 0
        if self.post_process and spec.mtp_num_layers:  # megatron-core's MTP block, between decoder and output layer
            if not self.pre_process:
                raise ConfigError("multi-token prediction layers need the embedding on the last pipeline stage, which "
                                  "this trainer keeps only at PP 1: train or run it at pp_degree 1")
            from trainer.mtp import MTPBlock  # it builds on this module's layers
            self.mtp = MTPBlock(spec, config, tp_size, ep, moe_layer)
        if self.post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                spec.hidden_size, padded_vocab, config=config, tp_group=tp_group(), init_method=no_init, bias=False,
                gather_output=False, skip_weight_param_allocation=self.share_weight)

    def units(self) -> list[nn.Module]:
        """The modules the forward runs, in its order; `params_ready` is called with each before it runs."""
        units = [self.embedding] if self.pre_process else []
        units += list(self.decoder.layers)
        return units + ([self.decoder.final_layernorm] + ([self.mtp] if self.spec.mtp_num_layers else []) +
                        [self.output_layer] if self.post_process else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x
        if self.pre_process:
            self.params_ready(self.embedding)
            x = self.embedding(x)
        rope = None
        if self.spec.position_embedding_type == "rope":  # over the whole sequence, also under SP
            seq = x.shape[0] * (self.tp_size if self.sequence_parallel else 1)
            rope = rope_tables(self.spec, seq, x.device)
        mode = self.recompute if self.training else None
        replay = self.graphed if self.training and torch.is_grad_enabled() and \
            (tuple(x.shape), x.dtype) == self.graphed_shape else {}
        copy = None
        for i, layer in enumerate(self.decoder.layers):
            self.params_ready(layer)
            if i in replay:
                copy = self.graph_turns.take(x) if copy is None else copy  # this micro-batch's copy of the graphs
                x = replay[i][copy](x)
                self.graph_replays += 1
            elif mode == "full":
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope, mode == "selective")
        if not self.post_process:
            return x
        self.params_ready(self.decoder.final_layernorm)
        self.params_ready(self.output_layer)
        x = self.decoder.final_layernorm(x)
        weight = self.embedding.word_embeddings.weight if self.share_weight else None
        if self.spec.mtp_num_layers:
            self.params_ready(self.mtp)
            self.mtp_logits = [self.output_layer(h, weight=weight)[0]
                               for h in self.mtp(x, tokens, self.embedding, rope, mode == "selective")]
        logits, _ = self.output_layer(x, weight=weight)
        return logits

    def global_keys(self) -> dict[str, str]:
        """Stage-local state-dict key -> global key (layer numbers re-based over all stages)."""
        ep_rank, ep_size = self.ep or (None, 1)
        return dict(layout.stage_keys(self.spec, self.layer_counts, self.pp_rank, ep_rank, ep_size))


def _init_std(key: str, spec: ModelSpec, std: float) -> float | None:
    """Megatron's init: N(0, std) weights, output projections scaled by 1/sqrt(2L), norms 1, biases 0."""
    if key.endswith((".bias", ".expert_bias")):
        return None
    if "layernorm" in key or key.endswith("norm.weight"):
        return None if spec.zero_centered_norm else -1.0  # a scale of one: ones, or zeros when zero-centred
    if key.endswith(("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")):
        return std / (2.0 * spec.num_layers) ** 0.5
    return std


def full_init(key: str, spec: ModelSpec, padded_vocab: int, seed: int, std: float = 0.02) -> torch.Tensor:
    """The full (TP=1) fp32 initial tensor of a global key, the same whatever the TP/PP layout."""
    shape = layout.full_shape(key, spec, padded_vocab, pp_size=None)
    if ".mixer." in key or spec.linear_num_key_heads is not None:  # Mamba's and gated DeltaNet's own inits
        from trainer.gdn import full_init as gdn_init
        from trainer.mamba import full_init as mamba_init
        own = mamba_init(key, spec) if ".mixer." in key else gdn_init(key, spec)
        if own is not None:
            return own
    kind = _init_std(key, spec, std)
    if kind is None:
        return torch.zeros(shape)
    if kind < 0:
        return torch.ones(shape)
    name = layout.alias_of(key, spec) or key  # a tied output layer starts as the embedding it copies
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full = torch.empty(shape).normal_(0.0, kind, generator=gen)
    if layout.has_padded_rows(key, spec, None):
        full[spec.vocab_size:] = 0.0  # padding rows start at zero
    return full


@torch.no_grad()
def initialize(stage: GPTStage, seed: int, tp_rank: int) -> None:
    """Fill every parameter (and persistent buffer) from its full init tensor split by the layout table."""
    keys = stage.global_keys()
    pp_size = len(stage.layer_counts)
    for local, param in (*stage.named_parameters(), *((k, b) for k, b in stage.named_buffers() if k in keys)):
        g = keys[local]
        full = full_init(g, stage.spec, stage.padded_vocab, seed)
        shard = shard_ops.split(g, full, stage.spec, stage.tp_size, pp_size)[tp_rank]
        param.copy_(shard)
