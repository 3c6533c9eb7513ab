"""Training throughput and MFU on GPUs: the bundled trainer next to HF LlamaForCausalLM (sdpa) and
megatron-core's GPTModel (local spec), all measured in one run of this script.

    python benchmarks/train_throughput.py                      # one GPU: hf, mcore, ours (eager), ours (compiled)
    python benchmarks/train_throughput.py --rows "hf mcore ours hf:mb=4 mcore:mb=4 ours:mb=4"   # + 4 micro-batches a step
    python benchmarks/train_throughput.py --rows "ours:tp=2 ours:pp=2,mb=8 ours:dp=2" --markdown t.md
    python benchmarks/train_throughput.py --quick --rows "hf ours:compile=0" --steps 1 --warmup 1   # smoke run, CPU too

Model (the issue's): Llama-style, hidden 2048, 22 layers, 32 heads, 4 query groups, ffn 5632,
vocab 32000, seq 2048, micro-batch 2, bf16. The trainer keeps fp32 master weights (Megatron's
mixed precision); the two references step AdamW on their bf16 parameters directly (pure bf16), as in
the issue's reference figures. Tokens are random ids (throughput does not depend on them).

MFU = tokens/s per GPU x (6 x parameters without the input embedding + 12 x layers x hidden x seq)
/ 989e12 (H100/H200 dense bf16 peak). Each row runs in its own process (under torchrun with as many
GPUs as TP x PP x DP), `--warmup` steps untimed, then `--steps` steps timed with a CUDA sync at both
ends and none in between. Peak memory is torch's max allocated, the largest over the ranks.

A row is `NAME[:key=value,...]`: NAME hf | mcore | ours; keys tp, pp, dp, mb (micro-batches per
step, gradients accumulated; all three), sp (sequence parallelism), recompute (selective|full),
distopt (distributed optimizer), acc32 (ours: micro-batch gradients accumulated and DP-reduced in fp32,
default 1; 0 accumulates them in bf16), compile (torch.compile the layers and the loss; default 1 for ours),
moe (a mixture-of-experts model of that many experts, top-2: MOE_MODEL, hf is then MixtralForCausalLM; ours
eager, its expert loop has data-dependent shapes), ep (ours: experts split over that many of the DP ranks) and
mcoremoe (ours: 1 trains the MoE layers with megatron-core's own MoELayer, `moe_layer: megatron_core`), overlap
(ours and ddp rows: 0 DP-reduces the gradients after backward instead of bucket by bucket during it), bucket (ours
and ddp rows: the DP reduction's bucket size in elements; 0, the default, is Megatron's max(40M, 1M x DP)), pgather
(ours, distributed optimizer: 0 waits for the new weights' all-gathers in the step, not in the next forward), model
(1b, the default, or 7b: MODEL_7B, the Llama-2-7B shape), layers (the model's depth), graphs (ours: 0 runs the layers
without CUDA graphs, trainer/graphs.py) and fusion (ours: 0 adds the weight gradients into the fp32 buffer after their
GEMM instead of in it, trainer/wgrad.py), split (ours: the pipeline stages' layer counts, e.g. 12/10 at pp=2; default
even).
"vs 1 GPU" is a row's MFU over the first 1-GPU row's of the same code and model (1b, 7b or MoE), so a TP2 row of
twice the layers compares with a TP1 row of half as many: per-GPU scaling. For the trainer that is its first compiled
1-GPU row; for megatron-core, its first `mcore:ddp=1` row: key ddp (mcore; implied by dp > 1) wraps GPTModel in
megatron-core's own DistributedDataParallel with fp32 gradients and masters (`mcore_ddp`), the reference for what data
parallelism costs on the machine, e.g. --rows "mcore:ddp=1 mcore:dp=2 ours ours:dp=2"

MoE model (Mixtral-shaped, small): hidden 1024, 8 layers, 16 heads, 4 query groups, 8 experts of ffn 2816, top-2,
vocab 32000, seq 2048, micro-batch 2; MFU counts the active parameters (2 experts a token, and the router).
THROUGHPUT_PROFILE=DIR writes a kernel table of 2 more steps per row, THROUGHPUT_TRACE=DIR a chrome trace.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEAK_FLOPS = 989e12
MODEL = dict(num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4, ffn_hidden_size=5632,
             vocab_size=32000, seq_length=2048, micro_batch_size=2)
QUICK = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
             vocab_size=4096, seq_length=256, micro_batch_size=2)
# the Llama-2-7B shape (hidden 4096, 32 heads, ffn 11008, seq 4096) with as many layers as a row asks for
MODEL_7B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32, ffn_hidden_size=11008,
                vocab_size=32000, seq_length=4096, micro_batch_size=1)
QUICK_7B = dict(QUICK, num_query_groups=8)
MOE_MODEL = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=2816,
                 vocab_size=32000, seq_length=2048, micro_batch_size=2, moe_router_topk=2)
QUICK_MOE = dict(QUICK, num_layers=2, moe_router_topk=2)
DEFAULT_ROWS = "hf mcore ours:compile=0 ours"


def parse_row(text: str) -> dict:
    name, _, rest = text.partition(":")
    row = {"name": name, "tp": 1, "pp": 1, "dp": 1, "mb": 1, "sp": 0, "recompute": "", "distopt": 0, "compile": 1,
           "moe": 0, "ep": 1, "acc32": 1, "mcoremoe": 0, "overlap": 1, "model": "1b", "layers": 0, "ddp": 0,
           "bucket": 0, "pgather": 1, "graphs": 1, "fusion": 1, "split": ""}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        if k not in row or k == "name":
            raise SystemExit(f"row {text!r}: unknown key {k!r}; known: {', '.join(list(row)[1:])}")
        row[k] = v if k in ("recompute", "model", "split") else int(v)
    if row["model"] not in ("1b", "7b") or (row["model"] == "7b" and row["moe"]):
        raise SystemExit(f"row {text!r}: model is 1b or 7b (dense)")
    if name not in ("hf", "mcore", "ours") or (name != "ours" and row["tp"] * row["pp"] * row["dp"] > 1
                                                and not (name == "mcore" and row["tp"] * row["pp"] == 1)):
        raise SystemExit(f"row {text!r}: NAME is hf, mcore or ours; ours runs on several GPUs, mcore with dp only")
    if row["name"] == "mcore" and row["dp"] > 1:
        row["ddp"] = 1
    if row["ddp"] and (name != "mcore" or row["moe"]):
        raise SystemExit(f"row {text!r}: ddp is a key of mcore's dense rows")
    if row["moe"] and (name == "mcore" or row["compile"] and "compile=1" in rest):
        raise SystemExit(f"row {text!r}: MoE rows are hf or ours, ours eager")
    if row["mcoremoe"] and not (row["moe"] and name == "ours"):
        raise SystemExit(f"row {text!r}: mcoremoe is a key of ours' MoE rows")
    if row["ep"] > 1 and (not row["moe"] or row["dp"] % row["ep"]):
        raise SystemExit(f"row {text!r}: ep needs moe and divides dp")
    if row["split"] and (name != "ours" or len(row["split"].split("/")) != row["pp"]
                         or not all(n.isdigit() for n in row["split"].split("/"))):
        raise SystemExit(f"row {text!r}: split is a key of ours' rows, one layer count per stage (12/10 at pp=2)")
    if row["moe"]:
        row["compile"] = 0
    row["gpus"] = row["tp"] * row["pp"] * row["dp"]
    return row


def model_of(row: dict, quick: bool) -> dict:
    """The model a row trains: the dense 1.1B one, the 7B shape (model=7b), or with moe=E the MoE one with E
    experts; layers=N changes its depth."""
    if row["moe"]:
        m = dict(QUICK_MOE if quick else MOE_MODEL, num_moe_experts=row["moe"])
    elif row["model"] == "7b":
        m = dict(QUICK_7B if quick else MODEL_7B)
    else:
        m = dict(QUICK if quick else MODEL)
    if row["layers"]:
        m["num_layers"] = row["layers"]
    return m


def flops_per_token(m: dict) -> float:
    h, layers, s = m["hidden_size"], m["num_layers"], m["seq_length"]
    kv = h // m["num_attention_heads"] * m["num_query_groups"]
    mlp = 3 * h * m["ffn_hidden_size"]
    if m.get("num_moe_experts"):  # the active parameters: top-k experts a token, and the router
        mlp = m["moe_router_topk"] * mlp + h * m["num_moe_experts"]
    per_layer = h * (h + 2 * kv) + h * h + mlp + 2 * h
    params = layers * per_layer + h + h * m["vocab_size"]  # + final norm + output layer; no input embedding
    return 6 * params + 12 * layers * h * s


# ---------------------------------------------------------------- the workers (one process per rank)
def ours(row: dict, m: dict):
    from trainer.config import TrainConfig
    from trainer.optim import make_optimizer
    from trainer.train import Stepper, build_stage, setup_distributed, train_step
    moe = {"architecture": "mixtral", "ep_degree": row["ep"],
           "moe_layer": "megatron_core" if row["mcoremoe"] else "ours"} if m.get("num_moe_experts") else \
        {"architecture": "llama"}
    cfg = TrainConfig.from_dict(dict(
        max_position_embeddings=m["seq_length"], dtype="bf16", **moe,
        tp_degree=row["tp"], pp_degree=row["pp"], num_micro_batches=row["mb"],
        sequence_parallelism=bool(row["sp"]), recompute_granularity=row["recompute"] or None,
        use_distributed_optimizer=bool(row["distopt"]), compile=bool(row["compile"]),
        accumulate_allreduce_grads_in_fp32=bool(row["acc32"]), overlap_grad_reduce=bool(row["overlap"]),
        overlap_param_gather=bool(row["pgather"]), cuda_graphs=bool(row["graphs"]),
        gradient_accumulation_fusion=bool(row["fusion"]), **({"ddp_bucket_size": row["bucket"]} if row["bucket"] else {}),
        **({"layers_per_stage": [int(n) for n in row["split"].split("/")]} if row["split"] else {}),
        lr=1e-4, min_lr=1e-5, lr_warmup_iters=0, **{k: v for k, v in m.items() if k != "vocab_size"}))
    device, _ = setup_distributed(cfg)
    stage = build_stage(cfg, m["vocab_size"], device)
    opt, stepper = make_optimizer(stage, cfg), Stepper(cfg, stage, device)
    batch = cfg.micro_batch_size * cfg.num_micro_batches

    def step(tokens):
        loss, _ = train_step(cfg, stage, stepper, opt, tokens, cfg.lr)
        return loss
    return step, batch, device


def hf(row: dict, m: dict):
    import torch
    import transformers
    sizes = dict(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
                 num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_query_groups"],
                 intermediate_size=m["ffn_hidden_size"], max_position_embeddings=m["seq_length"],
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
    if m.get("num_moe_experts"):
        config, cls = transformers.MixtralConfig(**sizes, num_local_experts=m["num_moe_experts"],
                                                 num_experts_per_tok=m["moe_router_topk"]), transformers.MixtralForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with device:
        model = cls._from_config(config, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(tokens):
        for x in tokens[:, :-1].chunk(row["mb"]):
            loss = model(input_ids=x, labels=x).loss
            (loss / row["mb"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, m["micro_batch_size"] * row["mb"], device


def mcore(row: dict, m: dict):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(1)  # the world's other ranks are data-parallel
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                            num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
                            ffn_hidden_size=m["ffn_hidden_size"], params_dtype=torch.bfloat16, bf16=True,
                            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=m["vocab_size"],
                     max_sequence_length=m["seq_length"], position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(device=device, dtype=torch.bfloat16)
    s = m["seq_length"]
    positions = torch.arange(s, device=device)[None].expand(m["micro_batch_size"], s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), diagonal=1)
    if row["ddp"]:
        return mcore_ddp(row, cfg, model, positions, mask), m["micro_batch_size"] * row["mb"], device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(tokens):
        for t in tokens.chunk(row["mb"]):
            loss = model(t[:, :-1], positions, mask, labels=t[:, 1:]).mean()
            (loss / row["mb"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, m["micro_batch_size"] * row["mb"], device


def mcore_ddp(row: dict, cfg, model, positions, mask):
    """megatron-core's own DistributedDataParallel, as Megatron-LM's --bf16 runs it: gradients accumulated and
    all-reduced in fp32 (`grad_reduce_in_fp32`), in its default buckets, overlapped with backward unless overlap=0;
    micro-batches but the last under `no_sync`. The step is Megatron's mixed precision, reduced to its kernels: fused
    AdamW on fp32 masters whose gradients are the fp32 grad buffer, copied back to the bf16 weights. It is the
    independent reference for what data parallelism costs this model on this machine."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=bool(row["overlap"]), bucket_size=row["bucket"] or None), model)
    params = [p for p in ddp.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]
    for master, p in zip(masters, params):
        master.grad = p.main_grad  # a view of the fp32 buffer megatron-core reduces into
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def step(tokens):
        ddp.zero_grad_buffer()
        chunks = tokens.chunk(row["mb"])
        for i, t in enumerate(chunks):
            last = i == len(chunks) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ddp(t[:, :-1], positions, mask, labels=t[:, 1:]).mean()
                (loss / row["mb"]).backward()
        ddp.finish_grad_sync()
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        return loss
    return step


def profile_steps(step, batches: list, sync, row: dict) -> None:
    """THROUGHPUT_PROFILE=DIR: a kernel table of 2 more steps; THROUGHPUT_TRACE=DIR: their chrome trace."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    rank = dist.get_rank() if dist.is_initialized() else 0
    for env, activities in (("THROUGHPUT_PROFILE", [ProfilerActivity.CUDA]),
                            ("THROUGHPUT_TRACE", [ProfilerActivity.CPU, ProfilerActivity.CUDA])):
        if not os.environ.get(env):
            continue
        with profile(activities=activities) as prof:
            for i in range(2):
                step(batches[i % 4])
            sync()
        name = Path(os.environ[env]) / f"{row['name']}-{row['compile']}-{row['gpus']}-r{rank}"
        name.parent.mkdir(parents=True, exist_ok=True)
        if env == "THROUGHPUT_TRACE":
            prof.export_chrome_trace(str(name) + ".json")
        else:
            Path(str(name) + ".txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))


def worker(row: dict, m: dict, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.manual_seed(0)
    build = {"ours": ours, "hf": hf, "mcore": mcore}[row["name"]]
    start = time.perf_counter()
    step, batch, device = build(row, m)
    built = time.perf_counter() - start
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, m["vocab_size"], (batch, m["seq_length"] + 1), device=device, generator=gen)
               for _ in range(4)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(warmup):
        step(batches[i % 4])
    sync()
    first = time.perf_counter()
    for i in range(steps):
        loss = step(batches[i % 4])
    sync()
    elapsed = time.perf_counter() - first
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        profile_steps(step, batches, sync, row)
    result = {"step_s": elapsed / steps, "peak_gib": peak / 2**30,
              "loss": float(loss) if loss is not None else None, "build_s": built, "batch": batch,
              "warmup_s": first - start - built}
    results = [result]
    if dist.is_initialized() and dist.get_world_size() > 1:
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


# ---------------------------------------------------------------- the driver
def run_row(row: dict, text: str, args, m: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        me = [str(Path(__file__).resolve()), "--worker", text, "--json", str(out), "--steps", str(args.steps),
              "--warmup", str(args.warmup)] + (["--quick"] if args.quick else [])
        if row["gpus"] > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={row['gpus']}", *me]
        else:
            cmd = [sys.executable, *me]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            return {"error": " | ".join(tail)}
        results = json.loads(out.read_text())
    step_s = max(r["step_s"] for r in results)
    tokens = results[0]["batch"] * row["dp"] * m["seq_length"]
    return {"tokens_per_s": tokens / step_s, "step_s": step_s, "peak_gib": max(r["peak_gib"] for r in results),
            "loss": next((r["loss"] for r in results if r["loss"] is not None), None),
            "tokens_per_step": tokens, "build_s": results[0]["build_s"], "warmup_s": results[0]["warmup_s"]}


def describe(row: dict) -> str:
    accumulate = f", {row['mb']} micro-batches" if row["mb"] > 1 else ""
    if row["name"] == "hf":
        return f"HF {'MixtralForCausalLM' if row['moe'] else 'LlamaForCausalLM'}, sdpa, pure bf16 AdamW" + accumulate
    if row["name"] == "mcore" and row["ddp"]:
        overlap = "overlapped with backward" if row["overlap"] else "after backward"
        bucket = f", buckets of {row['bucket'] / 1e6:g}M" if row["bucket"] else ""
        return (f"megatron-core GPTModel, local spec, DP{row['dp']} in megatron-core's DistributedDataParallel (fp32 "
                f"grads, reduced {overlap}{bucket}), fp32 masters" + accumulate)
    if row["name"] == "mcore":
        return "megatron-core GPTModel, local spec, pure bf16 AdamW" + accumulate
    parts = ([f"7B shape, {row['layers'] or MODEL_7B['num_layers']} layers"] if row["model"] == "7b" else []) + \
        [f"TP{row['tp']} PP{row['pp']} DP{row['dp']}"] + ([f"EP{row['ep']}"] if row["ep"] > 1 else [])
    parts += [f"MoE {row['moe']} experts top-2"] if row["moe"] else []
    parts += ["megatron-core's MoELayer"] if row["mcoremoe"] else []
    parts += ["SP"] if row["sp"] else []
    parts += [f"{row['recompute']} recompute"] if row["recompute"] else []
    parts += ["dist. optimizer"] if row["distopt"] else []
    parts += ["weights gathered in the step"] if row["distopt"] and not row["pgather"] else []
    parts += [f"layers {row['split']}"] if row["split"] else []
    parts += [f"{row['mb']} micro-batches"] if row["mb"] > 1 else []
    parts += ["grads accumulated in bf16"] if not row["acc32"] else []
    parts += ["DP reduction after backward"] if not row["overlap"] and row["dp"] > 1 else []
    parts += [f"buckets of {row['bucket'] / 1e6:g}M"] if row["bucket"] else []
    parts += ["no CUDA graphs"] if not row["graphs"] else []
    parts += ["wgrad added after the GEMM"] if not row["fusion"] else []
    return "trainer, " + ", ".join(parts) + (", compiled" if row["compile"] else ", eager") + ", fp32 masters"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--markdown")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        row = parse_row(args.worker)
        return worker(row, model_of(row, args.quick), args.steps, args.warmup, args.json)
    m = QUICK if args.quick else MODEL
    import torch
    rows = [(text, parse_row(text)) for text in args.rows.split()]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    fpt = flops_per_token(m)
    header = (f"{torch.cuda.device_count()} x {gpu}, torch {torch.__version__}; model: {m['num_layers']} layers, hidden "
              f"{m['hidden_size']}, seq {m['seq_length']}, micro-batch {m['micro_batch_size']}; "
              f"{fpt / 1e9:.2f} GFLOP/token; {args.steps} timed steps after {args.warmup}")
    big = next((model_of(row, args.quick) for _, row in rows if row["model"] == "7b"), None)
    if big is not None:
        header += (f"; 7B-shape rows: hidden {big['hidden_size']}, {big['num_attention_heads']} heads, ffn "
                   f"{big['ffn_hidden_size']}, seq {big['seq_length']}, micro-batch {big['micro_batch_size']}")
    moe = next((model_of(row, args.quick) for _, row in rows if row["moe"]), None)
    if moe is not None:
        header += (f"; MoE rows: {moe['num_layers']} layers, hidden {moe['hidden_size']}, {moe['num_moe_experts']} experts "
                   f"of ffn {moe['ffn_hidden_size']}, top-{moe['moe_router_topk']}, "
                   f"{flops_per_token(moe) / 1e9:.2f} GFLOP/token (active)")
    print(header, flush=True)
    lines = ["| row | GPUs | tokens/step | tokens/s | tokens/s/GPU | MFU | vs 1 GPU | step ms | peak GiB/GPU | loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    single: dict[tuple, float] = {}  # per code and model kind: the first 1-GPU row's MFU
    for text, row in rows:
        r = run_row(row, text, args, model_of(row, args.quick))
        fpt = flops_per_token(model_of(row, args.quick))
        if "error" in r:
            line = f"| {describe(row)} | {row['gpus']} | failed: {r['error'][-300:]} |"
        else:
            per_gpu = r["tokens_per_s"] / row["gpus"]
            mfu = per_gpu * fpt / PEAK_FLOPS
            kind = (row["name"], row["ddp"], row["moe"], row["model"])
            if row["gpus"] == 1 and (row["name"] == "ours" and (row["compile"] or row["moe"]) or row["ddp"]):
                single.setdefault(kind, mfu)  # the same code's 1-GPU row of the same model (its depth may differ)
            base = single.get(kind)
            scale = f"{mfu / base:.2f}" if base else "-"
            line = (f"| {describe(row)} | {row['gpus']} | {r['tokens_per_step']:,} | {r['tokens_per_s']:,.0f} | "
                    f"{per_gpu:,.0f} | {mfu:.1%} | {scale} | {r['step_s'] * 1e3:.0f} | "
                    f"{r['peak_gib']:.1f} | {r['loss']:.3f} |")
        lines.append(line)
        print(line, flush=True)
    if args.markdown:
        Path(args.markdown).write_text(header + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
