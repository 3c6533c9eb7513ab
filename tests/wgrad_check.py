"""The fused weight-gradient accumulation (trainer/wgrad.py) and the optimizer's hook on this CPU: megatron-core's
fused backward runs here too (its GEMM is torch's addmm_ for an fp32 buffer; its placeholder is allocated on the CPU),
so the gradient buffer a step fills with the fusion on must equal the one it fills with the fusion off, for every
kind of weight: dense linears, the tied embedding (a placeholder of zeros beside the lookup's real gradient), MoE
experts through their linear layers and through the grouped GEMM that reads their weights directly (real gradients
where megatron-core's linears are bypassed). Run under torchrun, one process:

    torchrun --nproc-per-node 1 tests/wgrad_check.py OUT.json
"""
from __future__ import annotations

import json
import sys
import warnings

import torch

from trainer import data, wgrad
from trainer.config import load_config
from trainer.moe import Experts
from trainer.optim import make_optimizer
from trainer.train import Stepper, build_stage, setup_distributed

CASES = {"llama": ("tiny_llama.yaml", {}), "gpt2-tied": ("tiny_gpt2.yaml", {}),
         "mixtral-loop": ("tiny_llama.yaml", {"architecture": "mixtral", "num_moe_experts": 4}),
         "mixtral-grouped": ("tiny_llama.yaml", {"architecture": "mixtral", "num_moe_experts": 4})}


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's fused backward allocates its placeholder there
    calls = []
    accumulate = wgrad.TORCH_WGRAD.wgrad_gemm_accum_fp32
    wgrad.TORCH_WGRAD.wgrad_gemm_accum_fp32 = lambda *a: (calls.append(1), accumulate(*a))
    wgrad.install()
    report, vocab = {}, None
    for name, (config, model) in CASES.items():
        Experts._grouped = (lambda self, x: True) if name.endswith("grouped") else (lambda self, x: False)
        sets = ["tp_degree=1", "pp_degree=1", "num_micro_batches=2", "moe_aux_loss_coeff=0.01"]
        sets += [f"{k}={v}" for k, v in model.items()]
        cfg = load_config(f"fixtures/configs/{config}", sets)
        device, _ = setup_distributed(cfg) if not report else (torch.device("cpu"), 1)
        vocab = vocab or data.vocab_size(data.load_tokenizer(cfg.tokenizer))
        tokens = torch.randint(0, vocab, (2 * cfg.micro_batch_size, cfg.seq_length + 1),
                               generator=torch.Generator().manual_seed(3))
        grads = []
        for fused in (False, True):
            stage = build_stage(cfg, vocab, device)
            opt = make_optimizer(stage, cfg)
            covered = wgrad.enable(stage) if fused else 0
            opt.zero_grad()
            calls.clear()
            Stepper(cfg, stage, device)(tokens)
            grads.append((opt.main_grad.clone(), covered, len(calls)))
        (plain, _, unfused_calls), (fused_grad, covered, fused_calls) = grads
        worst = float((fused_grad - plain).abs().max() / plain.abs().max())
        report[name] = {"covered": covered, "worst": worst, "accumulations": [unfused_calls, fused_calls], "zero_fraction_plain": float((plain == 0).float().mean()),
                        "zero_fraction_fused": float((fused_grad == 0).float().mean())}
    json.dump(report, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
