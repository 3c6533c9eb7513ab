"""Forward passes of a checkpoint at any TP x PP layout: the trainer's own model, no training.

    torchrun --nproc-per-node TP*PP -m trainer.forward CKPT --tokens T.pt --out LOGITS.pt [--tp N --pp M]
                                                            [--mtp-out MTP.pt]

Weights come straight from the shard files when the layout is the checkpoint's own, otherwise
every tensor is joined from the source shards and re-split for this layout by the layout table
(an in-memory reshard). The last stage gathers the vocab-parallel logits over TP, drops the padding
rows, and TP rank 0 of it writes [batch, seq, true_vocab] fp32 logits to --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ckpt_tools import io
from ckpt_tools.errors import CkptError
from ckpt_tools.forms.shards import Reader, open_checkpoint
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.ranks import Rank
from trainer.layers import megatron_config
from trainer.model import GPTStage


def build_from_checkpoint(shards: Reader, tp_size: int, counts: list[int], device: torch.device,
                          dtype: torch.dtype = torch.float32) -> GPTStage:
    """This rank's stage at the target layout, with its weights loaded from the checkpoint."""
    meta, spec = shards.meta, shards.meta.spec
    spec.check_tp(tp_size)
    padded = spec.padded_vocab_keeping(tp_size, meta.padded_vocab)
    mcfg = megatron_config(spec, tp_size, len(counts), dtype, on_cpu=device.type == "cpu")
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    stage = GPTStage(spec, mcfg, tp_size=tp_size, pp_rank=pp_rank, layer_counts=counts, padded_vocab=padded)
    if tp_size == meta.tp_size and counts == meta.layer_counts and meta.ep_size == 1:
        state = shards.stage_state(Rank(tp_rank, pp_rank))
    else:
        state = {}
        for local, key in stage.global_keys().items():
            full = shards.full(shards.source_key(key))
            if torch.is_tensor(full) and layout.has_padded_rows(key, spec, len(counts)):
                full = shard_ops.pad_vocab(key, full, spec, padded) if full.shape[0] != padded else full
            state[local] = shard_ops.split(key, full, spec, tp_size, len(counts))[tp_rank]
    stage.load_state_dict(state, strict=True)
    return stage.to(device).eval()


@torch.no_grad()
def pipeline_logits(stage: GPTStage, tokens: torch.Tensor) -> torch.Tensor | None:
    """Run tokens [b, s] through all stages; the last stage returns full logits [b, s, true_vocab]."""
    spec = stage.spec
    b, s = tokens.shape
    if stage.pre_process:
        x = tokens
    else:
        x = torch.empty(s, b, spec.hidden_size, dtype=next(stage.parameters()).dtype, device=tokens.device)
        dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
    out = stage(x)
    if not stage.post_process:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return gathered_logits(stage, out)


def gathered_logits(stage: GPTStage, out: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [s, b, V/TP] -> [b, s, true vocab] fp32 (every TP rank)."""
    parts = [torch.empty_like(out) for _ in range(stage.tp_size)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    full = torch.cat(parts, dim=-1)
    return full.transpose(0, 1)[..., : stage.spec.vocab_size].float().contiguous()


def capture_hidden(stage: GPTStage) -> dict[str, torch.Tensor]:
    """Hooks that record this stage's hidden states as [batch, seq, hidden] fp32, by global name:
    `embedding`, `layer <i>` (the output of global layer i) and `final_norm`."""
    out: dict[str, torch.Tensor] = {}
    offset = sum(stage.layer_counts[: stage.pp_rank])

    def keep(name: str):
        def hook(module, inputs, output):
            out[name] = output.detach().transpose(0, 1).float().cpu()
        return hook

    if stage.pre_process:
        stage.embedding.register_forward_hook(keep("embedding"))
    for i, layer in enumerate(stage.decoder.layers):
        layer.register_forward_hook(keep(f"layer {offset + i}"))
    if stage.post_process:
        stage.decoder.final_layernorm.register_forward_hook(keep("final_norm"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.forward", description=__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--tokens", required=True, help="a torch file holding a LongTensor [batch, seq]")
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--layers-per-stage", default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="true vocab, for inputs that do not record it")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--hidden", action="store_true",
                   help="also save per-layer hidden states [batch, seq, hidden] to OUT.hidden<pp_rank>.pt")
    p.add_argument("--mtp-out", default=None,
                   help="a model with multi-token prediction layers: save their logits [depths, batch, seq, vocab]")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        shards = open_checkpoint(args.checkpoint, args.vocab_size)
        meta = shards.meta
        tp, pp = args.tp or meta.tp_size, args.pp or meta.pp_size
        explicit = [int(n) for n in args.layers_per_stage.split(",")] if args.layers_per_stage else None
        if explicit is None and pp == meta.pp_size:
            explicit = meta.layer_counts
        counts = layout.layers_per_stage(meta.spec.num_layers, pp, explicit)
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        world = int(os.environ["WORLD_SIZE"])
        if world != tp * pp:
            raise CkptError(f"forward at TP{tp} x PP{pp} needs {tp * pp} processes, found {world}: "
                            f"launch with torchrun --nproc-per-node {tp * pp}")
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        stage = build_from_checkpoint(shards, tp, counts, device, dtype)
        tokens = io.load_file(args.tokens, mmap=False).to(device)
        hidden = capture_hidden(stage) if args.hidden else None
        logits = pipeline_logits(stage, tokens)
        if hidden is not None and ps.get_tensor_model_parallel_rank() == 0:
            torch.save(hidden, f"{args.out}.hidden{ps.get_pipeline_model_parallel_rank()}.pt")
        mtp = [gathered_logits(stage, t) for t in stage.mtp_logits]
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
            torch.save(logits.cpu(), args.out)
            if args.mtp_out and mtp:
                torch.save(torch.stack(mtp).cpu(), args.mtp_out)
        dist.barrier()
        dist.destroy_process_group()
    except CkptError as e:
        print(f"error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
