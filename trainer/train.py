"""The training loop: TP x PP x DP under torchrun (gloo on CPU, NCCL on GPUs).

TP: megatron-core's parallel layers. PP: torch.distributed.pipelining, 1F1B over micro-batches
(under PP the micro-batches are the gradient accumulation). DP: the optimizer averages the
gradients over the data-parallel group bucket by bucket while backward runs (trainer/optim.py;
torch DDP's reducer does not accept the several in-flight forwards of 1F1B: "rebuilt parameter
indices" assert), or reduce-scatters them with the distributed optimizer. SP: megatron-core's sequence parallelism, the
norms' gradients all-reduced over TP. global batch = micro_batch_size x num_micro_batches x DP, as in Megatron.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ckpt_tools.errors import CkptError, ConfigError
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model import layout
from trainer import checkpoint, data, graphs, mcore_moe
from trainer.config import TrainConfig, load_config
from trainer.loss import VocabParallelLoss
from trainer.layers import megatron_config
from trainer.model import GPTStage, initialize
from trainer.moe import AuxLoss, MoE
from trainer.mtp import mtp_loss
from trainer.optim import MasterAdamW, lr_at, make_optimizer


def seed_globals(seed: int) -> None:
    """The process's global RNGs (torch's, Python's, numpy's) seeded from the config's seed and the pipeline rank, as
    Megatron-LM's _set_random_seed seeds them: a run is reproducible, the RNG states its checkpoints save included (a
    resume then restores them). The weights' initialisation and the data order have generators of their own."""
    import random

    import numpy as np
    seed += 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_distributed(cfg: TrainConfig) -> tuple[torch.device, int]:
    """Process group + megatron-core parallel state; returns (device, DP size)."""
    if "RANK" not in os.environ:  # plain `python -m trainer`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    world = int(os.environ["WORLD_SIZE"])
    dp = cfg.data_parallel_size(world)  # before any process group: a bad layout fails fast
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
        if any("expandable_segments:True" in os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF",
                                                                             "PYTORCH_ALLOC_CONF")):
            # collectives captured in CUDA graphs (trainer/graphs.py) on expandable segments: Megatron-LM requires
            # NCCL's registration of their buffers off there (an illegal memory access otherwise, its check says)
            os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
    else:
        if cfg.sequence_parallelism:
            raise ConfigError("sequence_parallelism needs CUDA GPUs (megatron-core's sequence-parallel layers "
                              "allocate their gather buffers on CUDA): set it to false on CPU")
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp_degree,
                                 pipeline_model_parallel_size=cfg.pp_degree,
                                 expert_model_parallel_size=cfg.ep_degree)
    return device, dp


def build_stage(cfg: TrainConfig, vocab_size: int, device: torch.device, resume: fmt.Meta | None = None) -> GPTStage:
    """This rank's stage, initialized; a checkpoint to resume from decides the padded vocab and an
    uneven layer split it was saved with (after `ckpt reshard` they need not be this TP's default)."""
    spec = cfg.model_spec(vocab_size)
    explicit = cfg.layers_per_stage
    padded = spec.padded_vocab_keeping(cfg.tp_degree, resume.padded_vocab if resume is not None else None)
    if resume is not None and explicit is None and resume.pp_size == cfg.pp_degree:
        explicit = resume.layer_counts
    counts = layout.layers_per_stage(spec.num_layers, cfg.pp_degree, explicit)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    mcfg = megatron_config(spec, cfg.tp_degree, cfg.pp_degree, dtype, on_cpu=device.type == "cpu",
                           sequence_parallel=cfg.sequence_parallelism, moe_aux_loss_coeff=cfg.moe_aux_loss_coeff)
    ep = (ps.get_expert_model_parallel_rank(), cfg.ep_degree) if cfg.ep_degree > 1 else None
    stage = GPTStage(spec, mcfg, tp_size=cfg.tp_degree, pp_rank=ps.get_pipeline_model_parallel_rank(),
                     layer_counts=counts, padded_vocab=padded, recompute=cfg.recompute, ep=ep,
                     moe_layer=cfg.moe_layer).to(device)
    initialize(stage, cfg.seed, ps.get_tensor_model_parallel_rank())
    if cfg.compile:
        for layer in stage.decoder.layers:
            layer.compile(dynamic=False)
    return stage


class Stepper:
    """Runs one global batch's forward and backward on this rank; returns its mean loss (last stage). The layers
    are captured as CUDA graphs where trainer/graphs.py allows, before the first step (and again where an optimizer
    made since has moved the weights or their gradient buffer: the graphs hold those addresses)."""

    def __init__(self, cfg: TrainConfig, stage: GPTStage, device: torch.device):
        self.cfg, self.stage, self.device = cfg, stage, device
        self.captured, self.graphs = graphs.plan(stage, cfg.cuda_graphs, device, cfg.recompute)
        self.copies = graphs.copies(cfg.pp_degree, stage.pp_rank, cfg.num_micro_batches)
        if self.captured and self.copies > 1:
            self.graphs += f", {self.copies} copies (1F1B keeps {self.copies} micro-batches in flight on this stage)"
        self.graphs_at = None
        self.loss_fn = VocabParallelLoss(compile=cfg.compile)
        self.schedule = None
        if cfg.pp_degree > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B
            pipe = PipelineStage(stage, ps.get_pipeline_model_parallel_rank(), cfg.pp_degree, device,
                                 group=ps.get_pipeline_model_parallel_group(), **self._stage_args(cfg, stage))
            self.schedule = Schedule1F1B(pipe, n_microbatches=cfg.num_micro_batches, loss_fn=self.loss_fn)

    @staticmethod
    def _stage_args(cfg: TrainConfig, stage: GPTStage) -> dict:
        """The stage's input and output as meta tensors (torch.distributed.pipelining's static metadata): without them
        torch infers the shapes by running the stage, which torch >= 2.13 does with gradients on real, uninitialised
        tensors (a backward whose fused weight gradients would land in the optimizer's buffer, a forward that would
        take a copy of the CUDA graphs). Token ids [b, s] into the first stage, hidden states [s, b, h] (s / TP under
        sequence parallelism) between stages, this TP rank's logits [s, b, vocab / TP] out of the last."""
        b, s, h = cfg.micro_batch_size, cfg.seq_length, stage.spec.hidden_size
        dtype = next(stage.parameters()).dtype
        hidden = torch.empty(s // (stage.tp_size if cfg.sequence_parallelism else 1), b, h, dtype=dtype, device="meta",
                             requires_grad=True)  # gradients flow back through it
        inputs = torch.empty(b, s, dtype=torch.long, device="meta") if stage.pre_process else hidden
        outputs = torch.empty(s, b, stage.output_layer.weight.shape[0], dtype=dtype, device="meta",
                              requires_grad=True) if stage.post_process else hidden
        return {"input_args": inputs, "output_args": outputs}

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor | None:
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.captured:
            self._capture()
            self.stage.graph_turns.start_step()
        if self.schedule is not None:
            return self._pipelined(inputs, labels)
        losses = []
        n = self.cfg.num_micro_batches
        AuxLoss.scale = 1.0 / n  # the MoE load-balancing loss, divided as the LM loss is
        if self.cfg.moe_layer == "megatron_core":
            mcore_moe.set_aux_loss_scale(1.0 / n)
        for x, y in zip(inputs.chunk(n), labels.chunk(n)):
            loss = self.loss_fn(self.stage(x), y)
            extra = mtp_loss(self.loss_fn, self.stage.mtp_logits, y, self.cfg.mtp_loss_scale) \
                if self.stage.mtp_logits else 0.0  # reported apart from the model's own (megatron-core logs it so)
            ((loss + extra) / n).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _capture(self) -> None:
        first = next(self.stage.parameters())
        at = (first.data_ptr(), first.main_grad.data_ptr() if hasattr(first, "main_grad") else None)
        if at != self.graphs_at:
            self.stage.params_ready(self.stage)  # the distributed optimizer's weight all-gathers end first
            seq = self.cfg.seq_length // (self.cfg.tp_degree if self.cfg.sequence_parallelism else 1)
            graphs.capture(self.stage, self.captured, (seq, self.cfg.micro_batch_size, self.stage.spec.hidden_size),
                           first.dtype, self.copies)
            self.graphs_at = at

    def _pipelined(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        AuxLoss.scale = 1.0  # the schedule divides the gradients by the micro-batches at the end
        if self.cfg.moe_layer == "megatron_core":
            mcore_moe.set_aux_loss_scale(1.0)
        if self.stage.pre_process:
            self.schedule.step(inputs)
            return None
        if self.stage.post_process:
            losses: list[torch.Tensor] = []
            # the logits not kept: the schedule would hold them, and through their history the graphed layers, to the
            # next step (and past graphs.release)
            self.schedule.step(target=labels, losses=losses, return_outputs=False)
            return torch.stack([l.detach() for l in losses]).mean()
        self.schedule.step()
        return None


def graph_counts(stage: GPTStage) -> list[int]:
    """(layers captured as CUDA graphs, their replays so far) summed over the pipeline's stages (every PP rank calls
    it): the logging rank, on the last stage, reports the whole model's."""
    counts = [len(stage.graphed), stage.graph_replays]
    if len(stage.layer_counts) == 1:
        return counts
    t = torch.tensor(counts, dtype=torch.long, device=next(stage.parameters()).device)
    dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    return t.tolist()


def sync_sequence_parallel_grads(stage: GPTStage, opt: MasterAdamW) -> None:
    """Under SP a norm (or a row-parallel bias) saw only this rank's part of the sequence, and a per-head
    q/k norm saw only this rank's heads: sum their gradients over TP, as megatron-core's
    finalize_model_grads does for parameters marked `sequence_parallel` and for q/k layernorms."""
    grads = [g for p in stage.parameters() if (g := opt.grad_of(p)) is not None and (
        (stage.sequence_parallel and getattr(p, "sequence_parallel", False)) or getattr(p, "partial_over_tp", False))]
    if stage.tp_size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])


def sync_tied_embeddings(stage: GPTStage, opt: MasterAdamW) -> None:
    """With tied embeddings and PP > 1 the first and last stages hold copies; sum their grads."""
    if not (layout.aliases(stage.spec) and len(stage.layer_counts) > 1 and ps.is_rank_in_embedding_group()):
        return
    weight = stage.embedding.word_embeddings.weight if stage.pre_process else stage.output_layer.weight
    dist.all_reduce(opt.grad_of(weight), group=ps.get_embedding_group())


class Logger:
    """One rank (last stage, TP 0, DP 0) prints and appends metrics.jsonl in the save dir."""

    def __init__(self, cfg: TrainConfig, active: bool):
        self.active, self.path = active, Path(cfg.save_dir) / "metrics.jsonl"

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"iter {record['iteration']:5d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tokens/s", flush=True)

    def say(self, text: str) -> None:
        if dist.get_rank() == 0:
            print(text, flush=True)


def train_step(cfg: TrainConfig, stage: GPTStage, stepper: Stepper, opt: MasterAdamW, tokens: torch.Tensor,
               lr: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One optimizer step on one global batch; (mean loss on the last stage, grad norm), on device."""
    opt.zero_grad()
    loss = stepper(tokens)  # most gradient buckets are being DP-reduced already (overlap_grad_reduce)
    sync_sequence_parallel_grads(stage, opt)  # on gradients kept out of those buckets until now
    sync_tied_embeddings(stage, opt)
    # the loss's mean over DP before the step: after it, this collective would queue behind the distributed
    # optimizer's weight all-gathers, which the next forward waits for layer by layer
    if loss is not None and opt.dp > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        loss /= opt.dp
    # the pipeline schedule's backward is of the sum over micro-batches (it divides `.grad`, which the flat buffer
    # has already taken); the unpipelined one divides each micro-batch's loss
    norm = opt.step(lr, cfg.gradient_clipping, 1.0 / cfg.num_micro_batches if stepper.schedule is not None else 1.0)
    return loss, norm


def train(cfg: TrainConfig) -> None:
    cfg.check_data_paths()
    device, dp = setup_distributed(cfg)
    seed_globals(cfg.seed)
    tokenizer = data.load_tokenizer(cfg.tokenizer)
    if dist.get_rank() == 0:
        prefix = data.prepare_dataset(cfg.corpus, cfg.tokenizer, cfg.data_cache_dir)
    else:
        prefix = None
    box = [prefix]
    dist.broadcast_object_list(box, src=0)
    dataset = data.TokenDataset(box[0], cfg.seq_length, cfg.seed)
    source = Path(cfg.load) if cfg.load else Path(cfg.save_dir)
    ckpt_dir = fmt.resolve(source) if cfg.load else fmt.find_latest(source)
    resume = fmt.Meta.read(ckpt_dir) if ckpt_dir is not None else None
    stage = build_stage(cfg, data.vocab_size(tokenizer), device, resume)
    opt = make_optimizer(stage, cfg)
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    logger = Logger(cfg, stage.post_process and tp_rank == 0 and dp_rank == 0)
    for name in fmt.leftover_temps(cfg.save_dir):
        logger.say(f"note: {Path(cfg.save_dir) / name} is an incomplete checkpoint left by an interrupted save; "
                   f"it is ignored and will be replaced")
    iteration, consumed = 0, 0
    if ckpt_dir is not None:
        iteration, consumed = checkpoint.load(ckpt_dir, stage, opt)
        logger.say(f"resumed from {ckpt_dir} at iteration {iteration}")
    stepper = Stepper(cfg, stage, device)
    local_batch = cfg.micro_batch_size * cfg.num_micro_batches
    global_batch = local_batch * dp
    logger.say(f"training {stage.spec.architecture}: TP{cfg.tp_degree} x PP{cfg.pp_degree} x DP{dp}"
               f"{f' (EP{cfg.ep_degree})' if cfg.ep_degree > 1 else ''}, "
               f"global batch {global_batch} x {cfg.seq_length} tokens, iterations {iteration} -> {cfg.train_iters}")
    if device.type == "cuda":
        logger.say(stepper.graphs)
    saved_iteration, first_iteration = None, iteration
    clock, clock_iteration = time.perf_counter(), iteration
    while iteration < cfg.train_iters:
        tokens = dataset.batch(consumed + dp_rank * local_batch, local_batch).to(device)
        lr = lr_at(cfg, iteration)
        loss, norm = train_step(cfg, stage, stepper, opt, tokens, lr)
        iteration += 1
        consumed += global_batch
        if iteration % cfg.log_interval == 0 or iteration == cfg.train_iters:
            graphed = graph_counts(stage)
            if loss is not None:
                loss, norm = float(loss), float(norm)  # the only host syncs of a step, and only here
                now = time.perf_counter()
                rate = (iteration - clock_iteration) * global_batch * cfg.seq_length / (now - clock)
                clock, clock_iteration = now, iteration
                record = {"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": rate,
                          "graphed_layers": graphed[0], "graph_replays": graphed[1]}
                balance = [m.balance for m in stage.modules() if isinstance(m, MoE) and m.balance is not None]
                if balance:  # the last micro-batch's, mean over this stage's MoE layers: 1 = experts evenly loaded
                    record["moe_balance"] = float(torch.stack(balance).mean())
                logger.log(record)
        if cfg.save_interval and iteration % cfg.save_interval == 0:
            checkpoint.save(cfg, stage, opt, iteration, consumed, dp)
            saved_iteration = iteration
    if iteration > first_iteration and saved_iteration != iteration:
        checkpoint.save(cfg, stage, opt, iteration, consumed, dp)
        saved_iteration = iteration
    if saved_iteration is not None:
        logger.say(f"saved {Path(cfg.save_dir) / fmt.checkpoint_name(saved_iteration)}")
    graphs.release(stage)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        train(load_config(args.config, args.set))
    except CkptError as e:
        if args.debug:
            raise
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 1
    return 0
