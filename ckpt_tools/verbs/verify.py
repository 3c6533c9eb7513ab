"""`ckpt verify`: prove by weights and forward passes that two forms of a model are the same model.

Tier 1 (weights): every tensor of OTHER equals the join of SRC's shards after the documented
  transforms (QKV / gate-up split, vocab trim, GPT-2 transpose), bit for bit when dtypes match;
  every source tensor used once, none missing, none extra. Without OTHER: sizes and content hashes against
  meta.json, and every shard's keys and shapes against the layout table.
Tier 2 (hidden states): SRC's sharded model at its native TP x PP (torchrun) and OTHER's model
  (transformers for an HF dir, the trainer's model for shards) on the same tokens; the FIRST layer
  whose hidden states differ beyond the tolerance is named.
Tier 3 (logits): max abs and relative L2 error, KL divergence, top-1 / top-5 agreement, loss and
  perplexity of each side, against dtype-dependent tolerances (docs/verify.md).

In bf16, both sides also run in fp32. The fp32 pair is judged with fp32's tight tolerances (tiers 2f, 3f):
that is where a fault shows, whatever the precision asked for. The bf16 pair is judged against the noise floor of
this very run: each side's own bf16-vs-fp32 difference (per layer, for the logits, for the KL), times
NOISE_FACTOR. Two correct bf16 implementations differ by about as much as each differs from fp32 (sqrt 2 times,
for independent rounding), so a fixed constant tuned on random weights is not used: trained models' peaked
logits have a far larger bf16 spread.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ckpt_tools.errors import CkptError
from ckpt_tools.forms import hf_tensors, readers
from ckpt_tools.forms.shards import Reader, open_checkpoint
from ckpt_tools.model import conversions, hf, layout, shard_ops
from ckpt_tools.ports import free_port
from ckpt_tools.team import SOLO, Alone, Team
from ckpt_tools.verbs.plan import HF, SAFETENSORS, plan
from ckpt_tools.verbs.tiers import TOLERANCES, Tier, calibrated, tier2, tier3


def other_kind(path: Path) -> str:
    """OTHER's kind: an HF dir, a safetensors file, or sharded (forms/readers.py tells which)."""
    form = readers.detect(path)
    return {readers.HF: HF, readers.SAFETENSORS: SAFETENSORS}.get(form, "shards")


# ---------------------------------------------------------------- tier 1
def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(b.shape)}, expected {tuple(a.shape)}"
    d = (a.float() - b.float()).abs()
    flat = int(d.view(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), d.shape))
    return f"{int((d > 0).sum())} element(s) differ, max abs {float(d.max()):.3g} at {list(index)}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact, after casting the source to the other's dtype (a merge with --dtype casts)."""
    return tuple(a.shape) == tuple(b.shape) and shard_ops.same_bits(a.to(b.dtype), b)


def integrity(src: Reader, tier: Tier, team: Team = SOLO) -> None:
    """Sizes and content hashes of every recorded file (in a team, each process its run of the files); every shard's keys and
    shapes as the layout table says."""
    meta = src.meta
    recorded, file_problems = src.file_problems(team)
    file_problems = [p for found in team.share(lambda: file_problems) for p in found]
    for problem in file_problems:
        tier.fail(problem)
    if recorded:
        tier.lines.append(f"{recorded} files: sizes and content hashes checked against meta.json")
    problems = src.validate()
    for p in problems:
        tier.fail(p)
    tier.src_loads = not problems  # a file that only differs from its hash record still runs, to name the layer
    tier.lines.append(f"{meta.tp_size * meta.pp_size} model shards: keys and shapes checked against the layout table"
                      + (f" ({len(problems)} problem(s))" if problems else ""))


def tier1(src: Reader, other: Path | None, team: Team = SOLO) -> Tier:
    """In a team, each process compares its run of the tensors (balanced by their bytes) and process 0 words the
    whole."""
    tier = Tier("1 weights")
    integrity(src, tier, team)
    if other is None:
        return tier
    kind = other_kind(other)
    spec, padded = src.meta.spec, src.meta.padded_vocab
    mismatched: list[str] = []
    if kind == "shards":
        theirs = open_checkpoint(other)
        fields = [None] + (["master", "exp_avg", "exp_avg_sq"] if src.has_optimizer() and theirs.has_optimizer() else [])
        keys = [k for k in src.keys() if layout.holds_weights(k, spec, src.meta.pp_size)]
        missing = [k for k in keys if k not in theirs.keys()]
        extra = [k for k in theirs.keys() if k not in src.keys()
                 and layout.holds_weights(k, theirs.meta.spec, theirs.meta.pp_size)]
        both = [k for k in keys if k in theirs.keys()]
        owners = team.split([math.prod(layout.full_shape(k, spec, padded, src.meta.pp_size)) for k in both])
        compared = exact = 0
        for key in (k for k, owner in zip(both, owners) if owner == team.rank):
            for f in fields if layout.has_optimizer_state(key, spec, src.meta.pp_size) else fields[:1]:
                a, b = src.full(key, f), theirs.full(key, f)
                if layout.has_padded_rows(key, spec, None):  # compare the true rows
                    a, b = a[: spec.vocab_size], b[: spec.vocab_size]
                compared += 1
                if _same(a, b):
                    exact += 1
                else:
                    mismatched.append(f"{key}{'' if f is None else f' [{f}]'}: {_diff(a, b)}")
            src.release()
            theirs.release()
    else:
        tensors = hf_tensors.HFTensors(other)
        entries = plan(spec, padded, kind)
        owners = team.split([e.nbytes("float32") for e in entries])
        compared = exact = 0
        for e in (e for e, owner in zip(entries, owners) if owner == team.rank):
            converted = conversions.to_hf(e.kind, src.full(e.key), spec)
            for name, a in zip(e.names, converted):
                if not tensors.holds(name):
                    continue
                compared += 1
                b = tensors.get(name)
                # in the narrower of the two dtypes: an import with --dtype (or of FP8 blocks, dequantized in fp32)
                # cast the HF tensor to the weights' dtype once
                if _same(b, a) if b.element_size() > a.element_size() else _same(a, b):
                    exact += 1
                else:
                    mismatched.append(f"{e.key} -> {name}: {_diff(a, b)}")
            src.release()
        wanted = {n for e in entries for n in e.names}
        missing = sorted(n for n in wanted if not tensors.holds(n))
        extra = sorted(set(tensors.where) - {hf.part_of(n)[0] for n in wanted})
    found = team.share(lambda: (compared, exact, mismatched))  # in the tensors' order: the processes' runs in turn
    compared, exact = sum(c for c, _, _ in found), sum(x for _, x, _ in found)
    mismatched = [m for _, _, part in found for m in part]
    tier.lines.append(f"{compared} tensors compared: {exact} bit-exact, {len(mismatched)} differ, "
                      f"{len(missing)} missing, {len(extra)} extra")
    tier.lines += [f"differs: {m}" for m in mismatched[:10]]
    tier.data.update(compared=compared, exact=exact, mismatched=mismatched, missing=missing, extra=extra)
    if mismatched:  # the changed tensor is the most useful thing to name, before file-level findings
        tier.ok, tier.reason = False, f"tensor {mismatched[0]}" + (f"; also {tier.reason}" if tier.reason else "")
    elif missing or extra:
        what = [f"{len(items)} {word} ({', '.join(items[:3])}{' ...' if len(items) > 3 else ''})"
                for word, items in (("missing", missing), ("extra", extra)) if items]
        tier.fail(f"{other}: {' and '.join(what)} tensor(s) against SRC: OTHER is not a complete conversion of "
                  f"SRC; merge or reshard SRC again")
    return tier


# ---------------------------------------------------------------- forward passes
TEAM_ENV = ("CKPT_TEAM", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # a team's process 0 starts torchrun runs of its own


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TEAM_ENV and not k.startswith("TORCHELASTIC_")}
    return {**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def sharded_forward(ckpt: Path, tokens: torch.Tensor, work: Path, tp: int, pp: int, dtype: str, device: str, tag: str,
                    vocab_size: int | None = None, layers: list[int] | None = None) -> tuple[dict, torch.Tensor]:
    """Hidden states by name and logits [b, s, vocab] of the trainer's model at TP x PP (torchrun)."""
    tok, out = work / "tokens.pt", work / f"{tag}.pt"
    torch.save(tokens, tok)
    args = ["-m", "trainer.forward", str(ckpt), "--tokens", str(tok), "--out", str(out), "--tp", str(tp),
            "--pp", str(pp), "--dtype", dtype, "--device", device, "--hidden"]
    if vocab_size is not None:
        args += ["--vocab-size", str(vocab_size)]
    if layers is not None:
        args += ["--layers-per-stage", ",".join(map(str, layers))]
    if tp * pp == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp * pp}",
               f"--master-port={free_port()}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        errors = [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("error")]
        raise CkptError(errors[0] if errors else f"sharded forward of {ckpt} failed (exit {proc.returncode}): "
                        f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    hidden: dict[str, torch.Tensor] = {}
    for p in range(pp):
        hidden.update(torch.load(f"{out}.hidden{p}.pt", weights_only=True))
    return hidden, torch.load(out, weights_only=True)


@torch.no_grad()
def hf_forward(hf_dir: Path, tokens: torch.Tensor, dtype: str, device: str, num_layers: int) -> tuple[dict, torch.Tensor]:
    """transformers' own model; hidden states renamed to the trainer's names (HF's last one is after the final norm)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype).to(device).eval()
    out = model(tokens.to(device), output_hidden_states=True)
    hs = [h.float().cpu() for h in out.hidden_states]
    names = ["embedding"] + [f"layer {i}" for i in range(num_layers - 1)] + ["final_norm"]
    return dict(zip(names, hs)), out.logits.float().cpu()


# ---------------------------------------------------------------- tiers 2 and 3
def make_tokens(src: Reader, other: Path | None, text_file: Path | None, batch: int, seq: int, seed: int) -> torch.Tensor:
    spec = src.meta.spec
    seq = min(seq, spec.max_position_embeddings)
    if text_file is None:
        return torch.randint(0, spec.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    tok_dir = next((d for d in (src.meta.dir, other) if d is not None and d.is_dir() and hf.tokenizer_files(d)), None)
    if tok_dir is None:
        raise CkptError(f"{text_file}: no tokenizer to read it with: neither {src.meta.dir} nor OTHER holds "
                        f"tokenizer files; pass token ids instead (omit --tokens for random ids)")
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(tok_dir))(Path(text_file).read_text())["input_ids"]
    rows = min(batch, len(ids) // seq)
    if rows < 1:
        raise CkptError(f"{text_file}: {len(ids)} tokens, fewer than one sequence of {seq}: give a longer text or a smaller --seq-len")
    return torch.tensor(ids[: rows * seq]).view(rows, seq)


def run(src: str | Path, other: str | Path | None = None, *, device: str | None = None, dtype: str = "fp32",
        tokens_file: str | Path | None = None, batch: int = 4, seq: int = 128, seed: int = 0,
        vocab_size: int | None = None, team: Team = SOLO) -> tuple[list[Tier], dict]:
    """All tiers; returns them and the run's settings (for the report). In a team the processes share tier 1's
    work; process 0 alone runs the forward passes (the others return tier 1 only)."""
    shards = open_checkpoint(src, vocab_size)
    meta = shards.meta
    other_path = Path(other) if other is not None else None
    if other_path is not None and not other_path.exists():
        raise CkptError(f"{other_path}: no such file or directory: pass a merged HF dir, a safetensors file or a checkpoint")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_device(device, meta.tp_size * meta.pp_size)
    tokens = make_tokens(shards, other_path, Path(tokens_file) if tokens_file else None, batch, seq, seed)
    tiers = [tier1(shards, other_path, team)]
    shards.close()
    if not team.lead:
        return tiers, {}
    try:  # process 0 alone from here on: in a team, the others have ended
        return _forward_tiers(tiers, meta, other_path, tokens, tokens_file, device, dtype, seed, vocab_size)
    except CkptError as e:
        if team.size == 1:
            raise
        raise Alone(str(e)) from None


def _forward_tiers(tiers: list[Tier], meta, other_path: Path | None, tokens: torch.Tensor,
                   tokens_file: str | Path | None, device: str, dtype: str, seed: int,
                   vocab_size: int | None) -> tuple[list[Tier], dict]:
    """Tiers 2 and 3 after tier 1 (none where SRC's shards do not load), and the run's settings."""
    tol = TOLERANCES[dtype]
    settings = {"src": str(meta.dir), "other": str(other_path) if other_path else "", "device": device,
                "dtype": dtype, "tp": meta.tp_size, "pp": meta.pp_size,
                "tokens": "random" if tokens_file is None else str(tokens_file), "batch": tokens.shape[0],
                "seq": tokens.shape[1], "seed": seed, "torch": torch.__version__}
    if not tiers[0].src_loads:  # SRC's shards cannot be loaded into the model: tier 1 names why, no forward pass
        return tiers, {**settings, "other_model": "not run: SRC's shards do not load", "tolerances": tol}
    order = ["embedding"] + [f"layer {i}" for i in range(meta.spec.num_layers)] + ["final_norm"]
    with tempfile.TemporaryDirectory(prefix="ckpt-verify-") as work:
        work = Path(work)
        mine, theirs, label = _forwards(meta, other_path, tokens, work, dtype, device, vocab_size)
        if dtype == "fp32":
            tiers += [tier2(mine[0], theirs[0], order, tol["hidden_rel"]), tier3(mine[1], theirs[1], tokens, tol)]
            return tiers, {**settings, "other_model": label, "tolerances": tol}
        exact = TOLERANCES["fp32"]
        mine32, theirs32, _ = _forwards(meta, other_path, tokens, work, "fp32", device, vocab_size, "-fp32")
    hidden, logits, how = calibrated((mine, theirs), (mine32, theirs32), order, tol)
    tiers += [tier2(mine32[0], theirs32[0], order, exact["hidden_rel"], "2f hidden, fp32"),
              tier3(mine32[1], theirs32[1], tokens, exact, "3f logits, fp32"),
              tier2(mine[0], theirs[0], order, hidden), tier3(mine[1], theirs[1], tokens, logits)]
    tiers[-1].lines.append(how)
    return tiers, {**settings, "other_model": label, "tolerances": {**logits, "method": how}}


def _forwards(meta, other_path: Path | None, tokens: torch.Tensor, work: Path, dtype: str, device: str,
              vocab_size: int | None, tag: str = "") -> tuple[tuple, tuple, str]:
    """(SRC's hidden states and logits, OTHER's, OTHER's model in words) in one compute dtype."""
    mine = sharded_forward(meta.dir, tokens, work, meta.tp_size, meta.pp_size, dtype, device, f"src{tag}", vocab_size,
                           meta.layer_counts)
    kind = other_kind(other_path) if other_path is not None else None
    if kind == HF:
        return mine, hf_forward(other_path, tokens, dtype, device, meta.spec.num_layers), "transformers"
    if kind == "shards":
        o = open_checkpoint(other_path).meta
        theirs = sharded_forward(o.dir, tokens, work, o.tp_size, o.pp_size, dtype, device, f"other{tag}", None,
                                 o.layer_counts)
        return mine, theirs, f"trainer TP{o.tp_size} x PP{o.pp_size}"
    # alone, or a safetensors file already proven equal to SRC's join in tier 1
    return mine, sharded_forward(meta.dir, tokens, work, 1, 1, dtype, device, f"merged{tag}", vocab_size), \
        "TP1 x PP1 join"


def _check_device(device: str, needed: int) -> None:
    if device == "cuda":
        have = torch.cuda.device_count()
        if have == 0:
            raise CkptError("--device cuda but no CUDA device is visible: use --device cpu")
        if have < needed:
            raise CkptError(f"the sharded model needs {needed} GPUs (TP x PP), {have} visible: run on a machine with "
                            f"{needed} GPUs, or with --device cpu")
