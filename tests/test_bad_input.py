"""Bad input, table-driven: every kind of damaged or wrong input gets ONE line `error: ...` naming the
file / tensor / rank with what was expected and found, exit code 1, no traceback, and no OUT (nor a
`.OUT.tmp-*` beside it). The inputs come from bad_inputs.py (the `bases` fixture is in conftest.py);
the rows for damaged checkpoints are here, those for wrong arguments and foreign inputs in
bad_input_foreign.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import bad_input_foreign  # noqa: F401 - registers the table's rows for arguments and foreign inputs
import pytest
import torch
from bad_inputs import (
    CASES,
    OUT,
    Bases,
    M,
    O,
    R,
    assert_no_out,
    case,
    ckpt_of,
    copy_save,
    error_line,
    flip_tensor_bytes,
    invoke,
    read_meta,
    resave,
    reseal,
    tree,
    truncate,
)

from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model.families import names as family_names

# ---------------------------------------------------------------- the table: damaged checkpoints
# (the rows for wrong arguments and foreign inputs are in bad_input_foreign.py)
def _copy(b: Bases, tmp: Path, which: str = "base") -> Path:
    return copy_save(getattr(b, which), tmp / "src")

FAMILY_NAMES = ", ".join(family_names())


@case("missing model shard", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / M(1, 1)).unlink()
    return ["merge", ck, tmp / OUT], [f"{M(1, 1)}: missing shard (TP rank 1, PP rank 1) of a TP2 x PP2", "restore"], tmp / OUT


@case("missing optimizer shard", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / O(0, 0)).unlink()  # the first one: not taken for "saved without optimizer"
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{O(0, 0)}: missing shard (TP rank 0, PP rank 0)"], tmp / OUT)


@case("missing rng file recorded in meta.json", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / R(0, 0)).unlink()
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{R(0, 0)}: missing, but meta.json records it"], tmp / OUT)


@case("extra shard", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ck / M(1, 0), ck / M(2, 0))
    return (["merge", ck, tmp / OUT], [f"{M(2, 0)}: extra shard, not part of a TP2 x PP2 checkpoint", "remove it"],
            tmp / OUT)


@case("shard of another checkpoint (same size), --check-hashes", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.other) / M(1, 0), ck / M(1, 0))
    return (["merge", ck, tmp / OUT, "--check-hashes"], [f"{M(1, 0)}: xxh3_128 differs from meta.json"], tmp / OUT)


@case("shard of another checkpoint (same size), no hashes: TP replicas differ", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.other) / M(1, 0), ck / M(1, 0))
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            ["decoder.layers.0.input_layernorm.weight: replicated tensor differs between TP rank 0 and TP rank 1"],
            tmp / OUT)


@case("shard of another checkpoint (other size: mismatched meta)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.tp1) / M(0, 1), ck / M(0, 1))
    size = (ck / M(0, 1)).stat().st_size
    recorded = read_meta(ck)["files"][M(0, 1)]["size"]
    return (["merge", ck, tmp / OUT], [f"{M(0, 1)}: {size} bytes, meta.json records {recorded}",
                                       "from another checkpoint"], tmp / OUT)


@case("truncated shard", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    truncate(ck / M(0, 1))
    recorded = read_meta(ck)["files"][M(0, 1)]["size"]
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "2"],
            [f"{M(0, 1)}: {recorded // 2} bytes, meta.json records {recorded}", "truncated"], tmp / OUT)


@case("truncated shard, no size recorded", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    truncate(ck / M(1, 1), 0.7)
    reseal(ck, lambda m: m.update(files={}))  # a meta.json without records (as older tools write)
    return (["merge", ck, tmp / OUT], [f"{M(1, 1)}: not a readable torch file", "truncated or corrupt"], tmp / OUT)


@case("flipped bytes in tensor data, --check-hashes", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    flip_tensor_bytes(ck / M(0, 1))
    return (["merge", ck, tmp / OUT, "--format", "safetensors", "--check-hashes"],
            [f"{M(0, 1)}: xxh3_128 differs from meta.json"], tmp / OUT)


@case("flipped bytes in optimizer tensor data, --check-hashes", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    flip_tensor_bytes(ck / O(1, 0))
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1", "--check-hashes"],
            [f"{O(1, 0)}: xxh3_128 differs from meta.json"], tmp / OUT)


@case("flipped bytes in tensor data", "verify", table=True)
def _(b, tmp):
    ck = _copy(b, tmp, "single")  # TP1 x PP1: its forward passes (which still run) are one process each
    flip_tensor_bytes(ck / M(0, 0))
    return (["verify", ck, "--device", "cpu", "--batch", "1", "--seq-len", "16"],
            ["verify failed: tier 1", f"{M(0, 0)}: xxh3_128 differs"], None)


@case("missing model shard", "verify", table=True)
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / M(0, 0)).unlink()
    return (["verify", ck, "--device", "cpu"], ["verify failed: tier 1", f"{M(0, 0)}: missing"], None)


@case("tensor of the wrong shape", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(0, 1), lambda o: o["model"].update({"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(64, 47)}))
    return (["merge", ck, tmp / OUT], [(f"{M(0, 1)}: decoder.layers.0.mlp.linear_fc2.weight has shape (64, 47), "
                                        f"the layout table says (64, 48)")], tmp / OUT)


@case("tensor of the wrong dtype", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    resave(ck, M(1, 0), lambda o: o["model"].update({key: o["model"][key].to(torch.bfloat16)}))
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{M(1, 0)}: {key} is torch.bfloat16, meta.json says float32"], tmp / OUT)


@case("shard saved at another TP (shapes wrong)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.tp1) / M(0, 0), ck / M(0, 0))
    reseal(ck)
    return (["merge", ck, tmp / OUT], [(f"{M(0, 0)}: embedding.word_embeddings.weight has shape (256, 64), "
                                        f"the layout table says (128, 64)")], tmp / OUT)


@case("inconsistent PP split across files", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    for t in (0, 1):  # stage 1 of a 1,3 split beside stage 0 of a 2,2 split
        shutil.copy(ckpt_of(b.uneven) / M(t, 1), ck / M(t, 1))
    reseal(ck)
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{M(0, 1)}: unexpected tensor decoder.layers.2.input_layernorm.weight"], tmp / OUT)


@case("meta.json's TP disagrees with the files", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: m["parallel"].update(tp_size=1))
    return (["merge", ck, tmp / OUT], [f"{M(1, 0)}: extra shard, not part of a TP1 x PP2 checkpoint"], tmp / OUT)


@case("unknown tensor key inside a shard", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(1, 1), lambda o: o["model"].update({"decoder.layers.0.mlp.router.weight": torch.zeros(4, 64)}))
    return (["merge", ck, tmp / OUT], [f"{M(1, 1)}: unexpected tensor decoder.layers.0.mlp.router.weight"], tmp / OUT)


@case("missing tensor key inside a shard", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(0, 1), lambda o: o["model"].pop("decoder.layers.1.pre_mlp_layernorm.weight"))
    return (["reshard", ck, tmp / OUT, "--tp", "2", "--pp", "1"],
            [f"{M(0, 1)}: missing tensor decoder.layers.1.pre_mlp_layernorm.weight", "TP rank 0, PP rank 1"],
            tmp / OUT)


@case("shard that is not a state dict", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    torch.save([1, 2, 3], ck / M(1, 0))
    reseal(ck)
    return (["merge", ck, tmp / OUT], [f"{M(1, 0)}: holds no 'model' state dict"], tmp / OUT)


@case("meta.json edited (checksum mismatch)", "inspect")
def _(b, tmp):
    ck = _copy(b, tmp)
    meta = read_meta(ck)
    meta["iteration"] = 7
    (ck / fmt.META).write_text(json.dumps(meta))
    return ["inspect", ck], [f"{fmt.META}: content does not match its checksum", "restore it"], None


@case("meta.json edited (checksum mismatch)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    meta = read_meta(ck)
    meta["parallel"]["layers_per_stage"] = [1, 3]
    (ck / fmt.META).write_text(json.dumps(meta))
    return ["merge", ck.parent, tmp / OUT], [f"{fmt.META}: content does not match its checksum"], tmp / OUT


@case("meta.json not JSON", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / fmt.META).write_text('{"format": "ckpt-tools/1", "iteration": ')
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"], [f"{fmt.META}: malformed meta.json (JSONDecodeError"],
            tmp / OUT)


@case("meta.json lacks fields", "inspect")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: [m.pop(k) for k in ("parallel", "vocab")])
    return ["inspect", ck], [f"{fmt.META}: meta.json lacks parallel, vocab"], None


@case("meta.json missing (checkpoint dir)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / fmt.META).unlink()
    return ["merge", ck, tmp / OUT], [f"{ck}: neither a checkpoint dir (no meta.json)", M(0, 0)], tmp / OUT


@case("meta.json missing (save dir)", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / fmt.META).unlink()
    return (["reshard", ck.parent, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"latest names '{ck.name}' but {ck / fmt.META} does not exist"], tmp / OUT)


@case("unsupported architecture in meta.json", "inspect")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: m["model"].update(architecture="mamba"))
    return ["inspect", ck], [f"{fmt.META}: unknown architecture 'mamba': expected one of {FAMILY_NAMES}"], None


@case("unsupported architecture in meta.json", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: m["model"].update(architecture="bert"))
    return ["merge", ck, tmp / OUT], [f"{fmt.META}: unknown architecture 'bert'"], tmp / OUT


@case("`latest` names a missing dir", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck.parent / fmt.LATEST).write_text("checkpoint-999\n")
    return (["merge", ck.parent, tmp / OUT], ["latest names 'checkpoint-999' but", "checkpoint-999/meta.json does not exist"],
            tmp / OUT)


@case("--vocab-size disagrees with meta.json", "merge")
def _(b, tmp):
    return (["merge", b.base, tmp / OUT, "--vocab-size", "300"],
            ["records a true vocab of 250, --vocab-size says 300", "drop --vocab-size"], tmp / OUT)


@case("--from-master-weights without optimizer shards", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    for t in (0, 1):
        for p in (0, 1):
            (ck / O(t, p)).unlink()
    reseal(ck, lambda m: m.update(files={n: r for n, r in m["files"].items() if not n.startswith("optimizer_")}))
    return (["merge", ck, tmp / OUT, "--from-master-weights"], [f"{ck}: no optimizer shards with fp32 master weights",
                                                                "merge without --from-master-weights"], tmp / OUT)


@case("wrong tensor shape", "inspect --tensors")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(1, 1), lambda o: o["model"].update({"output_layer.weight": torch.zeros(256, 64)}))
    return (["inspect", ck, "--tensors"],
            [f"{M(1, 1)}: output_layer.weight has shape (256, 64), the layout table says (128, 64)"], None)


@pytest.mark.parametrize("build,table", CASES)
def test_bad_input(build, table, bases, tmp_path):
    args, expected, out = build(bases, tmp_path)
    line = error_line(invoke(*args), table=table)
    for text in expected:
        assert text in line, f"{text!r} not in {line!r}"
    if out is not None:
        assert_no_out(out)


def test_table_covers_enough_kinds():
    kinds = {p.id.split(":", 1)[1] for p in CASES}
    verbs = {p.id.split(":", 1)[0].split()[0] for p in CASES}
    assert len(kinds) >= 20, sorted(kinds)
    assert verbs >= {"merge", "reshard", "import", "verify", "inspect"}, verbs


@pytest.mark.parametrize("verb", ["merge", "reshard"])
def test_existing_out_is_never_touched_without_force(verb, bases, tmp_path):
    out = tmp_path / OUT
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    before = tree(out)
    args = ["merge", bases.base, out] if verb == "merge" else ["reshard", bases.base, out, "--tp", "1", "--pp", "1"]
    line = error_line(invoke(*args))
    assert f"{out}: already exists" in line and "--force" in line
    assert tree(out) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{OUT}.")]


def test_debug_shows_the_traceback(bases, tmp_path):
    ck = copy_save(bases.base, tmp_path / "src")
    (ck / M(1, 1)).unlink()
    result = invoke("--debug", "merge", ck, tmp_path / OUT)
    assert result.exit_code == 1 and result.exception is not None and not isinstance(result.exception, SystemExit)
    assert "missing shard" in str(result.exception)
    assert_no_out(tmp_path / OUT)
