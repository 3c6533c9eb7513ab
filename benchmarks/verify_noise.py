"""The bf16 noise floors `ckpt verify` judges by, and the signal of real faults, on a TRAINED tiny model.

    python benchmarks/verify_noise.py [--iters 300] [--device cpu]

Trains the tiny Llama (TP1, loss well below uniform), merges it to HF, reshards it to TP2 and PP2, then verifies
on the fixture corpus (real text): each layout against the HF merge, and the TP1 checkpoint against HF copies with
one fault each (tests/test_verify.py's catalogue), in bf16. Prints one table: per run, the logits noise floor
(max of each side's own bf16-vs-fp32 rel L2), the bf16 pair's rel L2 and its tolerance (3 x floor), the fp32
pair's rel L2, the first layer over tolerance and the verdict.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layouts", default="tp1,tp2,pp2", help="of the correct runs (one GPU: tp1)")
    args = parser.parse_args()
    from conftest import train
    from test_verify import CORPUS, FAULTS, _faulty

    from ckpt_tools.verbs import verify
    from ckpt_tools.verbs.merge import merge
    from ckpt_tools.verbs.reshard import reshard
    from ckpt_tools.verbs.tiers import NOISE_FACTOR
    with tempfile.TemporaryDirectory(prefix="verify-noise-") as work:
        root = Path(work)
        metrics = train("tiny_llama.yaml", root / "tp1", 1, tp_degree=1, pp_degree=1, train_iters=args.iters,
                        num_micro_batches=1, micro_batch_size=8, lr=2e-2, min_lr=2e-3, log_interval=50)
        merge(root / "tp1", root / "hf", quiet=True)
        reshard(root / "tp1", root / "tp2", tp=2, pp=1, quiet=True)
        reshard(root / "tp1", root / "pp2", tp=1, pp=2, quiet=True)
        runs = [(f"{layout} vs HF merge", root / layout, root / "hf") for layout in args.layouts.split(",")]
        runs += [(f"fault: {f}", root / "tp1", _faulty(root / "hf", root / f.replace(" ", "_"), f)) for f in FAULTS]
        rows = []
        for name, src, other in runs:
            tiers, settings = verify.run(src, other, device=args.device, dtype="bf16", tokens_file=CORPUS, batch=2,
                                         seq=64)
            by = {t.name.split()[0]: t for t in tiers}
            floor = settings["tolerances"]["logits_rel"] / NOISE_FACTOR
            failed = next((t for t in tiers if not t.ok), None)
            rows.append((name, floor, by["3"].data["rel_l2"], settings["tolerances"]["logits_rel"],
                         by["3f"].data["rel_l2"], by["3"].data["loss_src"], failed.reason if failed else "PASS"))
    print(f"tiny llama trained {args.iters} iterations (final loss {metrics[-1]['loss']:.3f}), bf16 on {args.device}, "
          f"2 x 64 tokens of fixtures/corpus.txt")
    print("| run | logits floor | bf16 pair rel L2 | tolerance | fp32 pair rel L2 | loss | verdict |")
    print("|---|---|---|---|---|---|---|")
    for name, floor, pair, tol, exact, loss, verdict in rows:
        print(f"| {name} | {floor:.2e} | {pair:.2e} | {tol:.2e} | {exact:.2e} | {loss:.3f} | {verdict} |")


if __name__ == "__main__":
    main()
