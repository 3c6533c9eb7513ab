"""Import HF -> our format / the legacy form where some tensors' values are not their HF bytes: the byte path with
those tensors made by torch (verbs/hf_copy.made_by_torch) against the torch path that wrote the whole job before,
and against `cp -r` of the output.

Models (built by transformers from a config, saved by save_pretrained):
  gpt2         GPT-2 medium's shape in fp32 (1.4 GB): its Conv1D weights, most of the bytes, are transposed by torch;
  deepseek_v3  a DeepSeek-V3 of bf16 weights saved as transformers saves it, its router weight and expert bias in fp32
               (0.9 GB): the routers made by torch (kept in bf16), into our format their fresh fp32 masters written
               beside them (contract 2); every other tensor copied. The torch path took all of it before.
Each command a subprocess (`paths.import_hf`, as `ckpt import` calls it, `copy_bytes` on or off), warm page cache,
rounds alternating, median wall time, `sync` after each; peak RSS by GNU time.

Usage: python benchmarks/per_tensor_import.py [--repeats 3] [--quick] [--only gpt2 deepseek_v3] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from merge_reshard import MIB, child_env, run

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "gpt2": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024), "float32"),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=704, n_shared_experts=1, n_group=4,
        topk_group=2, first_k_dense_replace=1, num_nextn_predict_layers=0, vocab_size=32000, rms_norm_eps=1e-6,
        max_position_embeddings=4096), "bfloat16"),
}
QUICK = {"gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=64),
         "deepseek_v3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, moe_intermediate_size=32,
                             vocab_size=1000, max_position_embeddings=128)}
TARGETS = [("gpt2", "ours", 2, 2), ("gpt2", "torch", 2, 2), ("deepseek_v3", "ours", 2, 2),
           ("deepseek_v3", "torch", 2, 1)]


def make_hf(path: Path, arch: str, quick: bool) -> None:
    """The model by transformers (its own initialisation) saved by save_pretrained (DeepSeek's router weight and expert
    bias in fp32, as transformers keeps them)."""
    import torch
    import transformers
    cls, kwargs, dtype = MODELS[arch]
    config = getattr(transformers, cls)(**{**kwargs, **(QUICK[arch] if quick else {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
            module.weight.data = module.weight.data.float()
    model.save_pretrained(path, safe_serialization=True)


# the byte path's runs: a torch path that would run instead fails the benchmark (a stand-in for the importer module,
# which is not loaded, so torch is not imported for it)
NO_TORCH_PATH = ("import types; m = types.ModuleType('ckpt_tools.verbs.importer'); "
                 "m.checked = lambda *a, **k: sys.exit('the byte path declined the job'); "
                 "sys.modules['ckpt_tools.verbs.importer'] = m; ")


def command(src: Path, out: Path, form: str, tp: int, pp: int, copy_bytes: bool) -> list[str]:
    code = ("import sys; " + (NO_TORCH_PATH if copy_bytes else "") + "from ckpt_tools.verbs import paths; "
            "from ckpt_tools.verbs.request import Request; "
            f"paths.import_hf(sys.argv[1], sys.argv[2], Request({tp}, {pp}, form={form!r}), quiet=True, "
            f"copy_bytes={copy_bytes}, tuned=True)")
    return [sys.executable, "-c", code, str(src), str(out)]


PATHS_HEADER = ["output GB", "byte path s", "torch path s", "cp -r s", "byte / cp", "torch / cp", "torch / byte",
                "peak RSS MiB (byte / torch)"]


def timed_paths(commands: dict[str, list[str]], out: Path, work: Path, env: dict, repeats: int) -> list[str]:
    """The byte path's and the torch path's commands (`commands`, by those names), each followed by `cp -r` of its
    output OUT, rounds alternating: the cells of PATHS_HEADER (medians, their ratios, the peak RSS of each path)."""
    log = work / "log"
    times: dict[str, list] = {"byte path": [], "torch path": [], "cp -r": []}
    rss, nbytes = {}, 0
    for _ in range(repeats):
        for name, argv in commands.items():
            wall, peak, nbytes = run(argv, out, log, env, keep=True)
            times[name].append(wall)
            rss[name] = max(rss.get(name, 0), peak)
            wall, _, _ = run(["cp", "-r", str(out), str(work / "copy")], work / "copy", log)
            times["cp -r"].append(wall)
            shutil.rmtree(out)
    med = {k: statistics.median(v) for k, v in times.items()}
    return [f"{nbytes / 1e9:.2f}", f"{med['byte path']:.2f}", f"{med['torch path']:.2f}", f"{med['cp -r']:.2f}",
            f"{med['byte path'] / med['cp -r']:.2f}x", f"{med['torch path'] / med['cp -r']:.2f}x",
            f"{med['torch path'] / med['byte path']:.2f}x",
            f"{rss['byte path'] / MIB:.0f} / {rss['torch path'] / MIB:.0f}"]


def paths_args(doc: str, prefix: str) -> tuple[argparse.Namespace, int, Path]:
    """The command line of a byte-path-against-torch benchmark: (its arguments, the rounds, a fresh work dir)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny model, one round: a smoke run")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    a = ap.parse_args()
    return a, 1 if a.quick else a.repeats, Path(tempfile.mkdtemp(prefix=prefix, dir=a.workdir))


def print_table(header: list[str], rows: list[list[str]], markdown: Path | None) -> None:
    """The markdown table, printed, and written to MARKDOWN where given."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        markdown.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny models, one round: a smoke run")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="these models only (gpt2, deepseek_v3)")
    a = ap.parse_args()
    repeats = 1 if a.quick else a.repeats
    work = Path(tempfile.mkdtemp(prefix="ckpt-per-tensor-", dir=a.workdir))
    env = child_env(work)
    try:
        archs = a.only or list(MODELS)
        for arch in archs:
            make_hf(work / arch, arch, a.quick)
        rows = []
        for arch, form, tp, pp in (t for t in TARGETS if t[0] in archs):
            commands = {"byte path": command(work / arch, work / "out", form, tp, pp, True),
                        "torch path": command(work / arch, work / "out", form, tp, pp, False)}
            rows.append([f"{arch} -> {'ours' if form == 'ours' else 'legacy torch'} TP{tp}xPP{pp}",
                         *timed_paths(commands, work / "out", work, env, repeats)])
        print_table(["import"] + PATHS_HEADER, rows, a.markdown)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
