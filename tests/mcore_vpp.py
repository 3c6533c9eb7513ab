"""Interleaved (virtual) pipeline checkpoints written by megatron-core itself, for fixtures/megatron_vpp:

    python tests/mcore_vpp.py fixtures/megatron_vpp        # runs itself under torchrun (PP ranks, gloo, CPU)
    torchrun --nproc-per-node 2 tests/mcore_vpp.py load fixtures/megatron_vpp/reference.pt OUT.pt SAVE_DIR...
    torchrun --nproc-per-node 2 tests/mcore_vpp.py load-newest ...   # the same with megatron-core 0.19 (mcore_newest)

A Llama-style GPTModel (local spec, megatron-core 0.16.1) at TP1 x PP2 with 2 virtual stages per rank
(--num-layers-per-virtual-pipeline-stage 1, 4 layers): each rank builds its two model chunks (`vp_stage` 0 and 1;
chunk v of PP rank p holds the layers megatron-core's get_transformer_layer_offset gives it, layer v*PP + p), runs the
interleaved forward on fixed tokens (rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1; activations
sent between the ranks) and saves the chunks as Megatron-LM's save_checkpoint does with virtual pipeline stages:

    OUT/torch/       iter_0000007/mp_rank_00_00P/model_optim_rng.pt: {args, iteration, checkpoint_version,
                     model0: chunk 0's state_dict_for_save_checkpoint(), model1: chunk 1's, rng_state}
    OUT/torch_dist/  iter_0000007/: dist_checkpointing.save of {args, ..., model0: chunk 0's sharded_state_dict(),
                     model1: chunk 1's} (global keys: megatron-core places each chunk's layers itself)
    OUT/reference.pt {tokens, logits}: megatron-core's logits [b, s, padded vocab], fp32
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

MODEL = {"architecture": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 96, "vocab_size": 127, "max_position_embeddings": 16}
PP, VPP, ITERATION = 2, 2, 7


def _chunks(spec, padded: int, torch, seed: int = 1234):
    """This rank's model chunks, built as Megatron-LM's get_model builds them with virtual pipeline stages."""
    import megatron.core.models.gpt as gpt_module
    import mcore_reference_child as child
    from megatron.core import parallel_state as ps
    original = gpt_module.GPTModel
    chunks = []
    for v in range(VPP):
        def chunk(*args, v=v, **kwargs):
            kwargs["config"].virtual_pipeline_model_parallel_size = VPP
            return original(*args, **{**kwargs, "vp_stage": v,
                                      "pre_process": ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                                      "post_process": ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)})
        gpt_module.GPTModel = chunk  # what _build_model imports
        torch.manual_seed(seed + 10 * v + ps.get_pipeline_model_parallel_rank())
        chunks.append(child._build_model({**spec.to_dict(), "padded_vocab_size": padded}, 1, PP).eval())
    gpt_module.GPTModel = original
    return chunks


def _forward(chunks, tokens, torch):
    """The interleaved forward: chunk v of rank p runs after chunk v of rank p-1 (and chunk v-1 of the last rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    b, s = tokens.shape
    p = ps.get_pipeline_model_parallel_rank()
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s), 1).bool()[None, None]
    out = None
    for v, model in enumerate(chunks):
        if (v, p) != (0, 0):
            x = torch.empty(s, b, model.config.hidden_size)
            dist.recv(x, src=(p - 1) % PP)
            model.set_input_tensor(x)
        with torch.no_grad():
            out = model(tokens, positions, mask)
        if (v, p) != (VPP - 1, PP - 1):
            dist.send(out.contiguous(), dst=(p + 1) % PP)
    return out.float() if p == PP - 1 else None


def save(out: str) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    from mcore_checkpoints import _args, _perturb, _shim_cuda
    _shim_cuda(torch)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=PP,
                                 virtual_pipeline_model_parallel_size=VPP)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec.from_dict(MODEL)
    padded = spec.padded_vocab_size(1)
    chunks = _chunks(spec, padded, torch)
    for model in chunks:
        _perturb(model, torch)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = _forward(chunks, tokens, torch)
    out_dir = Path(out)
    if logits is not None:
        torch.save({"tokens": tokens, "logits": logits}, out_dir / "reference.pt")
    args = _args(spec, 1, PP, padded, ITERATION, "float32")
    args.virtual_pipeline_model_parallel_size = VPP
    args.num_layers_per_virtual_pipeline_stage = spec.num_layers // (PP * VPP)
    p = ps.get_pipeline_model_parallel_rank()
    name = f"iter_{ITERATION:07d}"
    common = {"args": args, "iteration": ITERATION, "checkpoint_version": 3.0}
    if dist.get_rank() == 0:
        (out_dir / "torch_dist" / name).mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({**common, **{f"model{v}": m.sharded_state_dict() for v, m in enumerate(chunks)}},
                            str(out_dir / "torch_dist" / name))
    path = out_dir / "torch" / name / f"mp_rank_00_{p:03d}" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    args.ckpt_format = "torch"
    torch.save({**common, "args": args, **{f"model{v}": m.state_dict_for_save_checkpoint() for v, m in
                                           enumerate(chunks)}}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        for form in ("torch", "torch_dist"):
            (out_dir / form / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    dist.destroy_process_group()


def load(reference: str, out: str, *save_dirs: str, newest: bool = False) -> None:
    """Megatron-LM's load_checkpoint of each SAVE_DIR into the interleaved chunks at PP x VPP as the checkpoint's args
    give them (as --use-checkpoint-args does): torch, chunk v of each rank's file `model<v>` into
    `load_state_dict(strict=True)`; torch_dist, `dist_checkpointing.load` of every chunk's sharded state dict; then the
    interleaved forward on REFERENCE's tokens. The last PP rank saves OUT {save dir: logits}. `newest`: with
    megatron-core 0.19 (tests/mcore_newest.py) instead of the installed 0.16.1."""
    import warnings
    warnings.filterwarnings("ignore")
    if newest:
        import mcore_newest
        mcore_newest.activate()
    import torch
    from mcore_checkpoints import _shim_cuda
    _shim_cuda(torch)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec.from_dict(MODEL)
    tokens = torch.load(reference, weights_only=True)["tokens"]
    found = {}
    for save_dir in save_dirs:
        root = Path(save_dir)
        tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        iter_dir = root / (tracker if tracker == "release" else f"iter_{int(tracker):07d}")
        dist_form = (iter_dir / "metadata.json").is_file()
        if dist_form:
            common = dist_checkpointing.load_common_state_dict(str(iter_dir))
        else:
            common = torch.load(iter_dir / f"mp_rank_00_{dist.get_rank():03d}" / "model_optim_rng.pt",
                                weights_only=False)
        args = common["args"]
        vpp = args.virtual_pipeline_model_parallel_size
        assert (args.pipeline_model_parallel_size, vpp) == (PP, VPP), (args.pipeline_model_parallel_size, vpp)
        assert args.num_layers_per_virtual_pipeline_stage == MODEL["num_layers"] // (PP * VPP)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=PP,
                                     virtual_pipeline_model_parallel_size=vpp)
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        torch.manual_seed(99)  # other weights than the checkpoint's: only a complete load gives its logits
        chunks = _chunks(spec, args.padded_vocab_size, torch)
        state = dist_checkpointing.load({f"model{v}": m.sharded_state_dict() for v, m in enumerate(chunks)},
                                        str(iter_dir)) if dist_form else common
        for v, model in enumerate(chunks):
            model.load_state_dict(state[f"model{v}"], strict=True)
        found[save_dir] = _forward(chunks, tokens, torch)
    if dist.get_rank() == PP - 1:
        torch.save(found, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 2:  # the maker: itself under torchrun
        import shutil
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        Path(sys.argv[1]).mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={PP}", __file__, "save",
                        sys.argv[1]], check=True)
        print(json.dumps(sorted(str(p.relative_to(sys.argv[1])) for p in Path(sys.argv[1]).rglob("*") if p.is_file())))
    elif sys.argv[1] in ("load", "load-newest"):  # under torchrun: load REFERENCE OUT SAVE_DIR...
        import functools

        from mcore_checkpoints import run_as_script
        run_as_script(functools.partial(load, newest=sys.argv[1] == "load-newest"), *sys.argv[2:])
    else:
        from mcore_checkpoints import run_as_script
        run_as_script(save, sys.argv[2])
