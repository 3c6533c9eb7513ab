"""Merge and reshard Megatron-LM legacy checkpoints that the byte path took whole to torch before: the byte path as
it is now (each tensor copied as bytes, or made by the torch reader where its bytes are not the layout table's,
byte_index.Index.made) against the torch path, and against `cp -r` of the output.

Sources (a Qwen2 of multi-head attention with its QKV biases, bf16, imported from transformers' model by
`ckpt import --format torch`):
  vpp        Megatron-LM's interleaved pipeline, PP2 x VPP2 (TP2): every tensor is copied now;
  version0   TP2 x PP2 saved as a 2020 Megatron-LM did (checkpoint_version 0: fused QKV rows [3, np, hn] per rank, the
             inverse of Megatron-LM's fix_query_key_value_ordering): the QKV weights and biases are made by torch,
             the rest copied.
Each job: `ckpt merge --format hf` (the torch path: via=tensors) and `ckpt reshard --format torch_dist --tp 1 --pp 1`
(the torch path: copy_bytes=False). Each command a subprocess, warm page cache, rounds alternating, median wall time,
`sync` after each; peak RSS by GNU time. A byte-path run that the byte path declines fails the benchmark.

Usage: python benchmarks/per_tensor_megatron.py [--size-gb 1.0] [--repeats 3] [--quick] [--markdown FILE]
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from merge_reshard import CKPT, child_env
from per_tensor_import import PATHS_HEADER, paths_args, print_table, timed_paths

ROOT = Path(__file__).resolve().parent.parent
HEADS, HIDDEN, FFN, VOCAB = 16, 1024, 2816, 32000


def make_hf(path: Path, size_gb: float, quick: bool) -> None:
    """A Qwen2 (QKV biases) of multi-head attention (checkpoint_version 0 had no grouped-query attention) in bf16,
    layers a multiple of 4 (PP2 x VPP2), saved by transformers."""
    import torch
    import transformers
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN
    layers = 4 if quick else max(4, round((size_gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / per_layer / 4) * 4)
    config = transformers.Qwen2Config(
        hidden_size=64 if quick else HIDDEN, intermediate_size=176 if quick else FFN, num_hidden_layers=layers,
        num_attention_heads=4 if quick else HEADS, num_key_value_heads=4 if quick else HEADS,
        vocab_size=1000 if quick else VOCAB, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)


def as_version0(src: Path, heads: int, head_dim: int) -> None:
    """Each rank file as a 2020 Megatron-LM saved it: its model under the legacy model's names (`language_model.`,
    checkpoint_version 0 had no other), its fused QKV rows in that version's order [3, np, hn] (from megatron-core's
    [np, 3, hn]; `heads` per rank), its checkpoint_version 0."""
    import torch

    from ckpt_tools.model import names
    layer = {new: old for old, new in reversed(names.LEGACY_LAYER.items())}  # the first old name of each
    prefixes = {new: old for old, new in reversed(names.LEGACY_PREFIXES.items())}
    for path in sorted(src.glob("*/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)
        state["checkpoint_version"] = 0
        model = {}
        for name, t in state["model"].items():
            if t is None:  # an extra-state entry: the legacy model had none
                continue
            if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
                t = t.reshape((heads, 3, head_dim) + tuple(t.shape[1:])).transpose(0, 1).reshape(t.shape).clone()
            model[_legacy_name(name, layer, prefixes)] = t
        state["model"] = model
        torch.save(state, path)
        if names.from_legacy(_legacy_name("decoder.layers.0.mlp.linear_fc1.weight", layer, prefixes)) != \
                "decoder.layers.0.mlp.linear_fc1.weight":
            sys.exit("the legacy names do not read back")


def _legacy_name(name: str, layer: dict, prefixes: dict) -> str:
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        new = next(n for n in layer if rest.startswith(n))
        return f"language_model.encoder.layers.{index}.{layer[new]}{rest[len(new):]}"
    new = next(n for n in prefixes if name.startswith(n))
    return prefixes[new] + name[len(new):]


# the byte path's runs: a torch path that would run instead fails the benchmark
NO_TORCH_MERGE = ("import sys; from ckpt_tools.verbs.merge import merge, BYTES; "
                  "merge(sys.argv[1], sys.argv[2], quiet=True, via=BYTES)")
TORCH_MERGE = ("import sys; from ckpt_tools.verbs.merge import merge, TENSORS; "
               "merge(sys.argv[1], sys.argv[2], quiet=True, via=TENSORS)")


def reshard_command(src: Path, out: Path, copy_bytes: bool) -> list[str]:
    # the byte path alone (a source it declines fails the benchmark), or the source read through its torch reader
    head = "import sys; from ckpt_tools.verbs import paths; from ckpt_tools.verbs.request import Request; "
    byte = ("sys.exit('the byte path declined the job') if paths.by_bytes(sys.argv[1], sys.argv[2], "
            "Request(1, 1, form='torch_dist'), quiet=True) is None else None")
    torch_reader = ("paths.reshard(sys.argv[1], sys.argv[2], Request(1, 1, form='torch_dist'), quiet=True, "
                    "copy_bytes=False, tuned=True)")
    code = head + (byte if copy_bytes else torch_reader)
    return [sys.executable, "-c", code, str(src), str(out)]


def jobs(src: Path, out: Path) -> dict[str, dict[str, list[str]]]:
    return {"merge --format hf": {"byte path": [sys.executable, "-c", NO_TORCH_MERGE, str(src), str(out)],
                                  "torch path": [sys.executable, "-c", TORCH_MERGE, str(src), str(out)]},
            "reshard --format torch_dist --tp 1 --pp 1": {"byte path": reshard_command(src, out, True),
                                                          "torch path": reshard_command(src, out, False)}}


def main() -> None:
    a, repeats, work = paths_args(__doc__, "ckpt-per-tensor-mlm-")
    env = child_env(work)
    try:
        make_hf(work / "hf", a.size_gb, a.quick)
        sources = {"vpp": ["--tp", "2", "--pp", "2", "--vpp", "2"], "version0": ["--tp", "2", "--pp", "2"]}
        for name, layout in sources.items():
            subprocess.run(CKPT + ["import", str(work / "hf"), str(work / name), "--format", "torch", "--quiet",
                                   *layout], check=True, env=env)
        heads, hidden = (4, 64) if a.quick else (HEADS, HIDDEN)
        as_version0(work / "version0", heads // 2, hidden // heads)
        rows = [[name, job, *timed_paths(commands, work / "out", work, env, repeats)]
                for name in sources for job, commands in jobs(work / name, work / "out").items()]
        print_table(["source", "job"] + PATHS_HEADER, rows, a.markdown)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
