"""Run under torchrun on CUDA GPUs (world = TP): megatron-core's real GPTModel (local spec) forward
vs the trainer's GPTStage forward on the same weights. Writes a JSON report to argv[1].

    torchrun --nproc-per-node TP tests/gpu_mcore_forward.py OUT.json ARCH DTYPE [CKPT TOKENS LOGITS]

With CKPT (a PP=1 checkpoint of ours at TP = world), the weights come from it and the full
megatron-core logits [b, s, true_vocab] (fp32) are saved to LOGITS, for comparison with transformers.
"""
import sys
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from rank_reports import write_reports
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from ckpt_tools.forms.shards import open_checkpoint
from ckpt_tools.model.spec import ModelSpec
from trainer.forward import build_from_checkpoint
from trainer.layers import megatron_config
from trainer.model import GPTStage, initialize


def mcore_model(spec: ModelSpec, tp: int, dtype: torch.dtype, padded_vocab: int) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, ffn_hidden_size=spec.ffn_hidden_size, kv_channels=spec.kv_channels,
        tensor_model_parallel_size=tp, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        normalization=spec.normalization, gated_linear_unit=spec.gated_linear_unit,
        activation_func=F.silu if spec.gated_linear_unit else partial(F.gelu, approximate=
                                                                      "tanh" if spec.activation == "gelu_tanh" else "none"), add_bias_linear=spec.add_bias_linear,
        layernorm_epsilon=spec.norm_epsilon, hidden_dropout=0.0, attention_dropout=0.0,
        rotary_interleaved=bool(spec.rotary_interleaved))
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization=spec.normalization),
                    vocab_size=padded_vocab, max_sequence_length=spec.max_position_embeddings,
                    position_embedding_type=spec.position_embedding_type, rotary_base=int(spec.rotary_base),
                    share_embeddings_and_output_weights=spec.tie_word_embeddings).cuda().to(dtype)
    # .to(dtype): what megatron's Float16Module does to a bf16 model (its position embedding is built fp32)


def main(out: str, arch: str, dtype_name: str, ckpt: str | None = None, tokens_path: str | None = None,
         logits_out: str | None = None) -> None:
    warnings.filterwarnings("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    spec = ModelSpec(arch, num_layers=4, hidden_size=256, num_attention_heads=8,
                     num_query_groups=None if arch == "gpt2" else 2, ffn_hidden_size=512, vocab_size=1000,
                     max_position_embeddings=256, tie_word_embeddings=arch != "llama",
                     **({"add_bias_linear": True} if arch == "ernie4_5" else {}))  # ERNIE 4.5: interleaved RoPE
    if ckpt is None:
        ours = GPTStage(spec, megatron_config(spec, tp, 1, dtype, on_cpu=False), tp_size=tp, pp_rank=0,
                        layer_counts=[spec.num_layers], padded_vocab=spec.padded_vocab_size(tp)).cuda()
        initialize(ours, seed=3, tp_rank=ps.get_tensor_model_parallel_rank())
        tokens = torch.randint(0, spec.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    else:
        shards = open_checkpoint(ckpt)
        spec = shards.meta.spec
        ours = build_from_checkpoint(shards, tp, [spec.num_layers], torch.device("cuda"), dtype)
        tokens = torch.load(tokens_path, weights_only=True).cuda()
    ref = mcore_model(spec, tp, dtype, ours.padded_vocab)
    missing = ref.load_state_dict(ours.state_dict(), strict=True)
    seq = tokens.shape[1]
    positions = torch.arange(seq, device="cuda")[None].expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device="cuda"), diagonal=1)
    with torch.no_grad():
        a = ours.eval()(tokens).transpose(0, 1).float()  # [b, s, V/tp]
        b = ref.eval()(tokens, positions, mask).float()
    rel = ((a - b).norm() / b.norm()).item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    report = {"arch": arch, "dtype": dtype_name, "tp": tp, "rank": rank, "rel_l2": rel,
              "max_abs": (a - b).abs().max().item(), "top1_agreement_local_shard": top1,
              "load_state_dict": str(missing), "device": torch.cuda.get_device_name()}
    if logits_out is not None:
        parts = [torch.empty_like(b) for _ in range(tp)]
        dist.all_gather(parts, b.contiguous(), group=ps.get_tensor_model_parallel_group())
        if rank == 0:
            torch.save(torch.cat(parts, -1)[..., : spec.vocab_size].cpu(), logits_out)
    write_reports(report, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
