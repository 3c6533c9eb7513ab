"""`ckpt verify`'s judgement and report: the tiers' measures against their tolerances (tier 2: the first layer whose
hidden states differ; tier 3: logits' relative L2, KL, top-1 on decisive tokens, loss), bf16's tolerances from the
run's own noise floor (`calibrated`), and the report (a table; HDF5). verify.py runs the forwards they judge.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

TOLERANCES = {  # fp32: fixed; bf16: the floors of the run (calibrated()), these only bound them from below
    "fp32": {"hidden_rel": 1e-4, "logits_rel": 1e-4, "kl": 1e-8, "top1": 0.999},
    "bf16": {"hidden_rel": 1e-4, "logits_rel": 1e-4, "kl": 1e-8, "top1": 0.99},
}
NOISE_FACTOR = 3.0  # bf16 pair vs each side's own bf16-vs-fp32 spread (KL, quadratic in the logits: its square)
SIDE_RATIO = 10.0  # how much the two sides' own bf16 spreads may differ (docs/verify.md gives the measured ratios)


@dataclass
class Tier:
    name: str
    ok: bool = True
    lines: list[str] = field(default_factory=list)
    reason: str = ""
    data: dict = field(default_factory=dict)  # arrays and numbers for the report
    src_loads: bool = True  # tier 1 only: SRC's shards load and match the layout table (tiers 2-3 can run)

    def fail(self, reason: str) -> None:
        if self.ok:
            self.ok, self.reason = False, reason


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def tier2(a: dict, b: dict, order: list[str], tol: float | dict, name: str = "2 hidden states") -> Tier:
    """`tol`: one tolerance, or one per layer name (bf16: each layer's noise floor)."""
    tier = Tier(name)
    names = [n for n in order if n in a and n in b]
    rels = [rel_l2(a[n], b[n]) for n in names]
    maxabs = [float((a[n] - b[n]).abs().max()) for n in names]
    tols = [tol[n] if isinstance(tol, dict) else tol for n in names]
    tier.data.update(names=names, rel_l2=rels, max_abs=maxabs, tolerance=tols)
    for n, r, m, t in zip(names, rels, maxabs, tols):
        bad = not r <= t  # NaN or Inf is never within tolerance
        tier.lines.append(f"{n:<12} rel L2 {r:.2e}  max abs {m:.2e}  (tol {t:.2e}){'  <-- exceeds' if bad else ''}")
        if bad:
            tier.fail(f"{n} is the first layer whose hidden states differ (rel L2 {r:.2e} > {t:.2e})")
    return tier


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.double().log_softmax(-1)


def kl_per_token(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per token, from the two sides' log-probabilities (log_probs)."""
    return (la.exp() * (la - lb)).sum(-1)


def calibrated(low: tuple, ref: tuple, order: list[str], floor_tol: dict) -> tuple[dict, dict, str]:
    """bf16 tolerances from this run's noise floor: `low` = (mine, theirs) in bf16, `ref` = the same in fp32.
    Returns (per-layer hidden tolerances, logits tolerances, a line saying how they were set)."""
    (mine, theirs), (mine32, theirs32) = low, ref

    def floor_of(*values: float) -> float:  # a side that is not finite gives no floor: the fixed minimum judges
        return max(v if math.isfinite(v) else 0.0 for v in values)
    hidden = {}
    for n in order:
        if n in mine[0] and n in theirs[0]:
            floor = floor_of(rel_l2(mine[0][n], mine32[0][n]), rel_l2(theirs[0][n], theirs32[0][n]))
            hidden[n] = max(NOISE_FACTOR * floor, floor_tol["hidden_rel"])
    sides = (rel_l2(mine[1], mine32[1]), rel_l2(theirs[1], theirs32[1]))
    rel = floor_of(*sides)
    kl = floor_of(*(float(kl_per_token(log_probs(exact), log_probs(low)).mean())
                    for exact, low in ((mine32[1], mine[1]), (theirs32[1], theirs[1]))))
    logits = {"logits_rel": max(NOISE_FACTOR * rel, floor_tol["logits_rel"]),
              "kl": max(NOISE_FACTOR ** 2 * kl, floor_tol["kl"]), "top1": floor_tol["top1"],
              "sides": sides}
    how = (f"bf16 tolerances = {NOISE_FACTOR:g} x this run's noise floor (each side's own bf16 vs fp32): logits rel "
           f"L2 floor {rel:.2e} (SRC {sides[0]:.2e}, OTHER {sides[1]:.2e}), KL floor {kl:.2e} "
           f"({NOISE_FACTOR ** 2:g} x), hidden states per layer")
    return hidden, logits, how


def tier3(a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor, tol: dict, name: str = "3 logits") -> Tier:
    tier = Tier(name)
    la, lb = log_probs(a), log_probs(b)
    kl = kl_per_token(la, lb)  # KL(SRC || OTHER)
    top1 = (a.argmax(-1) == b.argmax(-1)).double()
    # A token is decisive when SRC's top-1 leads its runner-up by more than 4x the RMS logit
    # difference of the two sides: there the argmax must agree; closer calls are ties within noise.
    noise = float((a.double() - b.double()).pow(2).mean().sqrt())
    best = a.double().topk(2, -1).values
    decisive = (best[..., 0] - best[..., 1]) > 4 * noise
    ta, tb = a.topk(5, -1).indices, b.topk(5, -1).indices
    top5 = (ta[..., :, None] == tb[..., None, :]).any(-1).double().mean(-1)  # overlap of the top-5 sets
    target = tokens[:, 1:].cpu()
    loss = [float(torch.nn.functional.nll_loss(l[:, :-1].reshape(-1, l.shape[-1]), target.reshape(-1)))
            for l in (la, lb)]
    m = {"max_abs": float((a - b).abs().max()), "rel_l2": rel_l2(a, b), "kl_mean": float(kl.mean()),
         "kl_max": float(kl.max()), "top1": float(top1.mean()), "top5": float(top5.mean()),
         "loss_src": loss[0], "loss_other": loss[1], "decisive": float(decisive.double().mean()),
         "top1_decisive": float(top1[decisive].mean()) if decisive.any() else 1.0}
    tier.data.update(m, per_token_max_abs=(a - b).abs().amax(-1), per_token_kl=kl.float(), per_token_top1=top1,
                     per_token_decisive=decisive.double())
    tier.lines.append(f"rel L2 {m['rel_l2']:.2e} (tol {tol['logits_rel']:.2e}), max abs {m['max_abs']:.2e}, "
                      f"KL mean {m['kl_mean']:.2e} max {m['kl_max']:.2e} (tol {tol['kl']:.2e})")
    tier.lines.append(f"top-1 {m['top1']:.2%}, on decisive tokens ({m['decisive']:.1%} of all) {m['top1_decisive']:.2%} "
                      f"(tol {tol['top1']:.1%}), top-5 overlap {m['top5']:.2%}, "
                      f"loss {loss[0]:.4f} vs {loss[1]:.4f} (ppl {torch.tensor(loss).exp()[0]:.2f} vs "
                      f"{torch.tensor(loss).exp()[1]:.2f})")
    if not m["rel_l2"] <= tol["logits_rel"]:  # NaN or Inf is never within tolerance
        tier.fail(f"logits rel L2 {m['rel_l2']:.2e} > {tol['logits_rel']:.2e}")
    if not m["kl_mean"] <= tol["kl"]:
        tier.fail(f"logits KL {m['kl_mean']:.2e} > {tol['kl']:.2e}")
    sides = tol.get("sides")  # bf16: one side far noisier than the other is a fault of its bf16 path alone
    if sides and min(sides) > 0 and not max(sides) <= SIDE_RATIO * min(sides):
        tier.fail(f"one side's bf16 logits differ from its own fp32 ones {max(sides) / min(sides):.1f} x more than the "
                  f"other's ({sides[0]:.2e} vs {sides[1]:.2e}; more than {SIDE_RATIO:g} x): a fault of its bf16 path")
    if m["top1_decisive"] < tol["top1"]:
        tier.fail(f"top-1 agreement on decisive tokens {m['top1_decisive']:.2%} < {tol['top1']:.1%}")
    return tier


# ---------------------------------------------------------------- report
def table(tiers: list[Tier], settings: dict) -> str:
    head = (f"verify {settings['src']} vs {settings['other'] or '(itself)'} [{settings['other_model']}] on "
            f"{settings['device']} in {settings['dtype']}, {settings['batch']} x {settings['seq']} tokens "
            f"({settings['tokens']}), SRC at TP{settings['tp']} x PP{settings['pp']}")
    lines = [head]
    for t in tiers:
        lines.append(f"tier {t.name:<16} {'PASS' if t.ok else 'FAIL'}{'' if t.ok else '  ' + t.reason}")
        lines += [f"    {line}" for line in t.lines]
    return "\n".join(lines)


def write_report(path: str | Path, tiers: list[Tier], settings: dict) -> None:
    """HDF5: /settings attrs, one group per tier (attrs: ok, reason, scalars; datasets: arrays and lists)."""
    import h5py
    import numpy as np
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with h5py.File(tmp, "w") as f:
        s = f.create_group("settings")
        for k, v in settings.items():
            s.attrs[k] = v if type(v) in (int, float, bool) else str(v)
        for t in tiers:
            g = f.create_group(f"tier{t.name.split()[0]}")
            g.attrs["name"], g.attrs["ok"], g.attrs["reason"] = t.name, t.ok, t.reason
            g.create_dataset("lines", data=np.array(t.lines, dtype=h5py.string_dtype()))
            for k, v in t.data.items():
                if torch.is_tensor(v):
                    g.create_dataset(k, data=v.detach().cpu().float().numpy())
                elif isinstance(v, list) and v and isinstance(v[0], str):
                    g.create_dataset(k, data=np.array(v, dtype=h5py.string_dtype()))
                elif isinstance(v, list):
                    g.create_dataset(k, data=np.array(v, dtype=np.float64))
                else:
                    g.attrs[k] = v
    os.replace(tmp, path)
