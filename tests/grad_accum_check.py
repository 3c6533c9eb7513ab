"""Run under torchrun (1 process, gloo): what fp32 gradient accumulation changes in a bf16 step.

A tiny bf16 Llama takes one global batch of N micro-batches three ways: the trainer with
`accumulate_allreduce_grads_in_fp32` on (each micro-batch's bf16 gradient added into the fp32 buffer)
and off (each added into a bf16 buffer, as autograd sums `.grad`), and, as the reference, plain autograd one micro-batch at a
time with each bf16 gradient summed in fp32 by hand. An fp32 copy of the same weights gives the exact
gradient. Writes a JSON report to argv[1]: whether the fp32 buffer equals the hand sum bit for bit,
and each accumulation's relative L2 error against the fp32 gradient."""
import json
import sys
import warnings

import torch

from trainer import data
from trainer.config import load_config
from trainer.optim import make_optimizer
from trainer.train import Stepper, build_stage, setup_distributed

MICRO_BATCHES = 32


def flat_grad(stage, cfg, device, tokens):
    opt = make_optimizer(stage, cfg)
    opt.zero_grad()
    Stepper(cfg, stage, device)(tokens)
    return opt.reduced_grad().float().clone()


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    base = ["tp_degree=1", "pp_degree=1", f"num_micro_batches={MICRO_BATCHES}", "micro_batch_size=1",
            "gradient_accumulation_fusion=false", "cuda_graphs=false"]  # what is checked: the unfused accumulation
    config = "fixtures/configs/tiny_llama.yaml"
    on = load_config(config, base + ["dtype=bf16", "accumulate_allreduce_grads_in_fp32=true"])
    off = load_config(config, base + ["dtype=bf16", "accumulate_allreduce_grads_in_fp32=false"])
    exact = load_config(config, base + ["dtype=fp32"])
    device, _ = setup_distributed(on)
    vocab = data.vocab_size(data.load_tokenizer(on.tokenizer))
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (MICRO_BATCHES, on.seq_length + 1), generator=gen)

    stages = {name: build_stage(cfg, vocab, device) for name, cfg in (("on", on), ("off", off), ("fp32", exact))}
    weights = stages["on"].state_dict()
    for stage in stages.values():  # the same bf16 weights everywhere (upcast for the fp32 copy)
        stage.load_state_dict({k: v.to(stage.state_dict()[k].dtype) if torch.is_tensor(v) else v
                               for k, v in weights.items()})
    grads = {name: flat_grad(stage, cfg, device, tokens)
             for (name, stage), cfg in zip(stages.items(), (on, off, exact))}

    # the reference: one micro-batch at a time on the `off` stage, each bf16 gradient added in fp32 by hand
    stage, loss_fn = stages["off"], Stepper(off, stages["off"], device).loss_fn
    opt = make_optimizer(stage, off)  # its bf16 buffer, zeroed before each micro-batch, holds that one's gradient
    by_hand = torch.zeros_like(grads["on"])
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for x, y in zip(inputs.chunk(MICRO_BATCHES), labels.chunk(MICRO_BATCHES)):
        opt.zero_grad()
        (loss_fn(stage(x), y) / MICRO_BATCHES).backward()
        by_hand += opt.main_grad.float()

    def rel(a):
        return float((a - grads["fp32"]).norm() / grads["fp32"].norm())

    report = {"micro_batches": MICRO_BATCHES, "fp32_buffer_equals_hand_sum": bool(torch.equal(grads["on"], by_hand)),
              "rel_error_fp32_accumulation": rel(grads["on"]), "rel_error_bf16_accumulation": rel(grads["off"]),
              "rel_error_hand_sum": rel(by_hand)}
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
