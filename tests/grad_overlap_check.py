"""Run under torchrun (DP ranks, gloo): the DP gradient reduction bucket by bucket during backward.

Each rank takes its own 2 micro-batches through a tiny Llama (argv[2]: fp32 or bf16). The reference is
independent of the optimizer: plain autograd on a copy of the same weights, each rank's `.grad` gathered
and summed by hand in fp32 (the gradient buffer's dtype). Then the trainer's optimizer (plain and distributed,
overlap on and off, buckets of a few thousand elements) reduces the same gradients. Writes a JSON report to
argv[1] per rank: for each mode, the buckets launched before backward returned, the buckets in all, and
whether every parameter's reduced gradient equals the reference bit for bit (and the largest relative
L2 difference: on GPUs some backward kernels, as the embedding's, sum in no fixed order). The distributed
optimizer then steps, and the next forward is watched: which weight all-gathers were still running after the
step, whether each module's buckets were waited for before that module ran, and how many buckets had been waited
for as each module started (overlap_param_gather)."""
import sys
import warnings

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rank_reports import write_reports
from trainer import data
from trainer.config import load_config
from trainer.optim import make_optimizer
from trainer.train import Stepper, build_stage, setup_distributed

MICRO_BATCHES = 2


def main(out: str, dtype: str) -> None:
    warnings.filterwarnings("ignore")
    base = ["tp_degree=1", "pp_degree=1", f"num_micro_batches={MICRO_BATCHES}", "micro_batch_size=1",
            f"dtype={dtype}", "ddp_bucket_size=3000", "gradient_accumulation_fusion=false", "cuda_graphs=false"]
    config = "fixtures/configs/tiny_llama.yaml"
    cfgs = {(distributed, overlap): load_config(config, base + [f"use_distributed_optimizer={str(distributed).lower()}",
                                                                f"overlap_grad_reduce={str(overlap).lower()}"])
            for distributed in (False, True) for overlap in (False, True)}
    device, dp = setup_distributed(cfgs[False, False])
    vocab = data.vocab_size(data.load_tokenizer(cfgs[False, False].tokenizer))
    gen = torch.Generator().manual_seed(11 + dist.get_rank())  # each DP rank its own tokens
    tokens = torch.randint(0, vocab, (MICRO_BATCHES, cfgs[False, False].seq_length + 1), generator=gen).to(device)

    # the reference: autograd's `.grad`, each rank's summed over DP by hand
    stage = build_stage(cfgs[False, False], vocab, device)
    weights = {k: v.clone() for k, v in stage.state_dict().items() if torch.is_tensor(v)}
    loss_fn = Stepper(cfgs[False, False], stage, device).loss_fn
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mine = {name: torch.zeros(p.shape, device=device) for name, p in stage.named_parameters()}  # fp32, as the buffer is
    for x, y in zip(inputs.chunk(MICRO_BATCHES), labels.chunk(MICRO_BATCHES)):
        stage.zero_grad(set_to_none=True)
        (loss_fn(stage(x), y) / MICRO_BATCHES).backward()
        for name, p in stage.named_parameters():
            mine[name] += p.grad.float()
    reference = {}
    for name, g in mine.items():
        gathered = [torch.empty_like(g) for _ in range(dp)]
        dist.all_gather(gathered, g, group=ps.get_data_parallel_group())
        reference[name] = sum(gathered)

    report = {}
    for (distributed, overlap), cfg in cfgs.items():
        stage = build_stage(cfg, vocab, device)
        stage.load_state_dict(weights, strict=False)
        opt = make_optimizer(stage, cfg)
        opt.zero_grad()
        Stepper(cfg, stage, device)(tokens)
        launched = sum(b.handle is not None for b in opt.buckets)
        full = opt._full(opt.reduced_grad().float())
        pairs = [(full[s:s + n].view_as(p), reference[name]) for (name, p), s, n in zip(opt.named, opt.starts, opt.sizes)]
        equal = all(torch.equal(a, b) for a, b in pairs)
        worst = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in pairs)
        report[f"{'distributed' if distributed else 'plain'}-{'overlap' if overlap else 'after'}"] = {
            "launched_during_backward": launched, "buckets": len(opt.buckets),
            "overlapped_buckets": sum(not b.deferred for b in opt.buckets), "equal_to_reference": equal,
            "max_rel_l2": worst}
        if distributed and overlap:
            report["param_gather"] = _watch_param_gathers(stage, opt, inputs.chunk(MICRO_BATCHES)[0])
    write_reports(report, out)


class _Watched:
    """A bucket's all-gather handle that notes when it is waited for."""

    def __init__(self, handle, waited: set, index: int):
        self.handle, self.waited, self.index = handle, waited, index

    def wait(self):
        self.handle.wait()
        self.waited.add(self.index)


def _watch_param_gathers(stage, opt, x: torch.Tensor) -> dict:
    """Step, then run a forward in which every module checks, as it starts, that its buckets were waited for, and
    notes how many had been waited for by then (all of them before the first module: no overlap left)."""
    opt.step(1e-3, 1.0)
    unwaited = [i for i, b in enumerate(opt.buckets) if b.gather is not None]
    waited: set[int] = set()
    for i in unwaited:
        opt.buckets[i].gather = _Watched(opt.buckets[i].gather, waited, i)
    early: list[str] = []
    counts: list[int] = []

    def check(module, _args):
        mine = {id(p) for p in module.parameters()}
        needs = {i for i, b in enumerate(opt.buckets) for j in b.params if id(opt.params[j]) in mine}
        if needs - waited:
            early.append(f"{type(module).__name__} ran before buckets {sorted(needs - waited)}")
        counts.append(len(waited))
    hooks = [m.register_forward_pre_hook(check) for m in stage.units()]
    stage(x)
    for h in hooks:
        h.remove()
    return {"unwaited_after_step": len(unwaited), "buckets": len(opt.buckets), "early": early,
            "waited_as_each_module_starts": counts, "waited": len(waited)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
