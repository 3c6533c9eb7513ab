"""Writing Megatron-LM checkpoints (`ckpt import/reshard --format torch_dist|torch`), proven against megatron-core:

- megatron-core's own GPTModel, built at a TP x PP other than the written one (torch_dist) or at the written one
  (torch), loads our output with its own loader (`dist_checkpointing.load` / `load_state_dict(strict=True)`,
  tests/mcore_load.py) and its forward gives transformers' logits on the HF source (fp32, < 1e-5); our reader is
  not involved;
- round trips are bit-exact: HF -> torch_dist / torch -> HF, and megatron-core's own torch_dist -> ours ->
  torch_dist -> HF;
- a target Megatron-LM cannot take is one line, before anything is written.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import torchrun
from families_cases import hf_model as family_model
from safetensors.torch import load_file as load_safetensors
from test_families import same_optimizer
from test_import import VOCAB, hf_model
from test_reshard import assert_nothing_written, one_line_error, run

from ckpt_tools.errors import ConfigError
from ckpt_tools.forms import megatron_lm
from ckpt_tools.forms.megatron_args import pipeline_split
from ckpt_tools.model import hf
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-write")
    dirs = {}
    for arch in ("llama", "llama_tied", "gpt2"):
        dirs[arch] = root / arch
        hf_model(arch).save_pretrained(dirs[arch], safe_serialization=True)
    # QKV biases; per-head q/k norms with head_dim x heads != hidden; MLA, MTP and an fp32 expert bias
    # Mamba-2 and gated DeltaNet: 3-D convolution weights, a norm offset
    for case in ("qwen2_tied", "qwen3", "deepseek_v3", "qwen3_next", "nemotron_h"):
        dirs[case] = root / case
        family_model(case).save_pretrained(dirs[case], safe_serialization=True)
    return dirs


def same_tensors(a, b) -> None:
    x, y = load_safetensors(a / "model.safetensors"), load_safetensors(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for name, t in x.items():
        assert y[name].dtype == t.dtype and torch.equal(y[name], t), name


# (HF model, form, written TP x PP, TP x PP megatron-core loads it at); "resharded": imported into ours at TP1 x PP1,
# then `reshard --format torch` (the legacy files written by copying bytes, forms/legacy_copy.py)
# (an import into torch_dist saves row-parallel tensors as row chunks: megatron-core's TP2 takes its columns from them)
# (GPT-2 into the legacy form: its transposed Conv1D weights made by torch inside the byte path, hf_copy.made_by_torch)
LOADS = [("llama", "torch_dist", (2, 2), (1, 2)), ("llama", "torch_dist", (2, 2), (2, 1)),
         ("gpt2", "torch_dist", (2, 2), (2, 1)), ("gpt2", "torch", (2, 2), (2, 2)),
         ("llama_tied", "torch", (2, 2), (2, 2)), ("qwen2_tied", "torch_dist", (1, 2), (2, 2)),
         ("qwen3", "torch", (2, 1), (2, 1)), ("gpt2", "resharded", (2, 2), (2, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("arch,form,written,loaded", LOADS, ids=[f"{a}-{f}-tp{w[0]}pp{w[1]}-as-tp{l[0]}pp{l[1]}"
                                                                 for a, f, w, l in LOADS])
def test_megatron_core_loads_what_we_write(arch, form, written, loaded, hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM
    src, out = hf_dirs[arch], tmp_path / "megatron"
    if form == "resharded":
        import_hf(src, tmp_path / "ours", tp=1, pp=1, optimizer=False, quiet=True)
        from ckpt_tools.verbs import paths
        from ckpt_tools.verbs.request import Request
        form, line = "torch", paths.by_bytes(tmp_path / "ours", out, Request(*written, form="torch"), quiet=True)
        assert line is not None  # written by copying bytes, not left to the torch path
    else:
        line = import_hf(src, out, tp=written[0], pp=written[1], form=form, quiet=True)
    assert f"--ckpt-format {form}" in line
    assert (out / megatron_lm.TRACKER).read_text() == "release"
    spec = hf.spec_from_hf(src / "config.json")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp_path / "tokens.pt")
    config = {"model": spec.to_dict(), "padded_vocab": spec.padded_vocab_size(written[0]), "tp": loaded[0],
              "pp": loaded[1], "form": form, "load": str(out), "tokens": str(tmp_path / "tokens.pt"),
              "out": str(tmp_path / "loaded.pt")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torchrun(loaded[0] * loaded[1], ["tests/mcore_load.py", str(tmp_path / "config.json")], timeout=600)
    result = torch.load(tmp_path / "loaded.pt", weights_only=False)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(tokens).logits
    ours = result["logits"][..., :VOCAB]
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-5
    args = result["args"]  # what Megatron-LM's check_checkpoint_args and --use-checkpoint-args read
    assert (args["num_layers"], args["hidden_size"], args["num_attention_heads"]) == (
        spec.num_layers, spec.hidden_size, spec.num_attention_heads)
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == written
    assert args["padded_vocab_size"] == spec.padded_vocab_size(written[0]) and result["iteration"] == 0
    assert args["untie_embeddings_and_output_weights"] == (not spec.tie_word_embeddings)


@pytest.mark.parametrize("form", ["torch_dist", "torch"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_to_megatron_to_hf_is_bit_exact(arch, form, hf_dirs, tmp_path):
    import_hf(hf_dirs[arch], tmp_path / "megatron", tp=2, pp=2, form=form, quiet=True)
    merge(tmp_path / "megatron", tmp_path / "back", quiet=True)
    same_tensors(hf_dirs[arch], tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == \
        json.loads((hf_dirs[arch] / "config.json").read_text())["model_type"]


@pytest.mark.slow
def test_megatron_to_ours_to_megatron_is_bit_exact(tmp_path):
    """megatron-core's own torch_dist save (TP2 x PP2) -> ours at TP1 x PP2 -> torch_dist at TP2 x PP1: the same
    tensors as merging megatron-core's save directly."""
    model = {"architecture": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 2, "iteration": 5,
                                                      "forward": False}))
    torchrun(4, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    reshard(tmp_path / "torch_dist", tmp_path / "ours", tp=1, pp=2, vocab_size=VOCAB, quiet=True)
    line = reshard(tmp_path / "ours", tmp_path / "again", tp=2, pp=1, form="torch_dist", quiet=True, optimizer=False)
    assert "weights only" in line
    merge(tmp_path / "torch_dist", tmp_path / "direct", vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "again", tmp_path / "round", quiet=True)
    same_tensors(tmp_path / "direct", tmp_path / "round")


@pytest.mark.parametrize("args,expected", [
    (["--tp", "3"], "not divisible by TP 3"),
    (["--pp", "5"], "PP 5 needs at least one layer per stage but the model has 4"),
])
def test_a_target_the_model_cannot_take_is_refused_before_writing(args, expected, hf_dirs, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(run("import", hf_dirs["llama"], out, *args, "--format", "torch_dist", "-q"))
    assert expected in line, line
    assert_nothing_written(out)


def test_optimizer_state_is_not_dropped_silently(llama_run, tmp_path):
    """The legacy torch form is written without optimizer state: asked for it, the state is not dropped."""
    out = tmp_path / "out"
    line = one_line_error(run("reshard", llama_run[0], out, "--tp", "1", "--pp", "1", "--format", "torch", "-q"))
    assert "holds optimizer state" in line and "--no-optimizer" in line and "--format torch_dist" in line, line
    assert_nothing_written(out)


# ------------------------------------------------------------ optimizer state into torch_dist
OPT_FORMS = ["plain/torch", "dist/torch", "dist/torch_dist", "dist_buckets/torch_dist", "dist/torch_dist_full"]
IDENTIFIERS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
FIELD_NAMES = (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def whole_tensors(iter_dir, scratch) -> dict:
    """Every tensor of a torch_dist checkpoint, whole, read by torch's own DCP reader (never ours)."""
    from mcore_resume import full_tensors
    return full_tensors(iter_dir, scratch)


def with_full_schedule(src, dst):
    """A copy of a fixture whose opt_param_scheduler is what megatron-core's OptimizerParamScheduler.state_dict()
    holds (the fixtures' script saved only two of its keys)."""
    import shutil
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    shutil.copytree(src, dst)
    sched = OptimizerParamScheduler(SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=1e-2, min_lr=1e-3,
                                    lr_warmup_steps=2, lr_decay_steps=12, lr_decay_style="cosine", start_wd=0.1,
                                    end_wd=0.1, wd_incr_steps=12, wd_incr_style="constant")
    sched.num_steps = 6
    for path in list(dst.glob("iter_*/common.pt")) + list(dst.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False, map_location="cpu")  # saved on a GPU
        state["opt_param_scheduler"] = sched.state_dict()
        torch.save(state, path)
    return dst


def test_a_schedule_megatron_lm_cannot_load_is_one_line(tmp_path):
    from test_megatron_optimizer import FIXTURES
    out = tmp_path / "out"
    line = one_line_error(run("reshard", FIXTURES / "dist" / "torch_dist", out, "--tp", "1", "--pp", "1", "--format",
                              "torch_dist", "--vocab-size", "120", "-q"))
    assert "common.pt" in line and "lacks min_lr" in line and "--no-optimizer" in line, line
    assert_nothing_written(out)


@pytest.mark.parametrize("form", OPT_FORMS)
def test_megatron_optimizer_state_is_written_as_megatron_core_writes_it(form, tmp_path):
    """megatron-core's optimizer state (every form it saves, fixtures/megatron_optimizer) resharded into torch_dist
    at TP2 x PP2: read back by torch's DCP reader, every fp32 master and Adam moment is megatron-core's own
    (reference.pt, from the optimizer object) bit for bit, under the keys and with the common.pt of megatron-core's
    own fully_reshardable save. That megatron-core's DistributedOptimizer resumes from it is tests/test_gpu.py's."""
    from test_megatron_optimizer import FIXTURES
    from test_megatron_optimizer import VOCAB as FIXTURE_VOCAB
    from test_megatron_optimizer import reference

    from ckpt_tools.forms.torch_dist_names import stacked_key
    out = tmp_path / "out"
    src = with_full_schedule(FIXTURES / form, tmp_path / "src")
    line = reshard(src, out, tp=2, pp=2, vocab_size=FIXTURE_VOCAB, quiet=True, form="torch_dist")
    assert "model + optimizer" in line and "--use-distributed-optimizer" in line, line
    assert (out / megatron_lm.TRACKER).read_text() == "3"
    own_dir = FIXTURES / "dist" / "torch_dist_full" / "iter_0000003"
    got, own = whole_tensors(out / "iter_0000003", tmp_path / "a.pt"), whole_tensors(own_dir, tmp_path / "b.pt")
    assert sorted(got) == sorted(own)
    compared = 0
    for key, fields in reference(form).items():
        if key == "_buffers":
            continue
        fqn, layer = stacked_key(key)
        for field, name in FIELD_NAMES:
            whole = got[f"optimizer.state.{name}.{fqn}"]
            assert torch.equal(whole if layer is None else whole[layer], fields[field]), (key, field)
            compared += 1
    assert compared == 15 * 3
    common = torch.load(out / "iter_0000003" / "common.pt", weights_only=False)
    mine = torch.load(own_dir / "common.pt", weights_only=False)
    assert common["content_metadata"] == mine["content_metadata"]
    assert common["optimizer"]["param_state_sharding_type"] == mine["optimizer"]["param_state_sharding_type"]
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert [[g[k] for k in IDENTIFIERS] for g in groups] == \
        [[g[k] for k in IDENTIFIERS] for g in mine["optimizer"]["optimizer"]["param_groups"]]
    assert all(g["step"] == 3 and type(g["step"]) is int and "params" not in g for g in groups)  # as FusedAdam's
    args = common["args"]
    assert common["iteration"] == args.iteration == 3 and args.use_distributed_optimizer and args.no_save_rng
    assert not args.no_save_optim


@pytest.mark.slow
def test_our_optimizer_state_goes_to_torch_dist_and_back(llama_run, tmp_path):
    """Our trainer's checkpoint (TP2 x PP2) -> torch_dist at TP1 x PP2: torch's DCP reader finds its optimizer state
    whole; megatron-core's own scheduler takes the written schedule; back in our format at TP2 x PP2 every optimizer
    tensor is the trainer's, bit for bit."""
    from types import SimpleNamespace

    from mcore_resume import same_as_ours
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ckpt_tools.forms.shards import open_checkpoint
    save = llama_run[0]
    reshard(save, tmp_path / "mlm", tp=1, pp=2, form="torch_dist", quiet=True)
    reshard(save, tmp_path / "tp1", tp=1, pp=1, quiet=True)
    iteration = open_checkpoint(save).meta.iteration
    iter_dir = tmp_path / "mlm" / f"iter_{iteration:07d}"
    result = same_as_ours(tmp_path / "tp1", whole_tensors(iter_dir, tmp_path / "a.pt"), False)
    assert result["compared"] == 3 * 27 and not result["missing"] and not result["differ"], result
    assert result["step"] == float(iteration)
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    assert [g["wd_mult"] for g in common["optimizer"]["optimizer"]["param_groups"]] == [1.0, 0.0]
    holder = SimpleNamespace(param_groups=[{}])
    sched = OptimizerParamScheduler(holder, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=1,
                                    lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=1,
                                    wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)
    sched.load_state_dict(common["opt_param_scheduler"])  # megatron-core's own reading of it: every key it needs
    config = json.loads((save / f"checkpoint-{iteration}" / "meta.json").read_text())["config"]
    assert sched.max_lr == config["lr"] and sched.min_lr == config["min_lr"]
    assert sched.num_steps == iteration * 8 == common["args"].consumed_train_samples  # global batch 8
    reshard(tmp_path / "mlm", tmp_path / "back", tp=2, pp=2, quiet=True)
    for t in range(2):
        for p in range(2):
            same_optimizer(save, tmp_path / "back", f"checkpoint-{iteration}/optimizer_tp_{t}_pp_{p}.bin")


def test_layer_splits_megatron_lm_can_express():
    assert pipeline_split([2, 2, 2]) == {"decoder_first_pipeline_num_layers": None,
                                         "decoder_last_pipeline_num_layers": None}
    assert pipeline_split([1, 3]) == {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}
    assert pipeline_split([1, 2, 2, 3]) == {"decoder_first_pipeline_num_layers": 1,
                                            "decoder_last_pipeline_num_layers": 3}
    with pytest.raises(ConfigError, match="the middle ones must be equal"):
        pipeline_split([2, 1, 3, 2])


@pytest.mark.slow
def test_verify_takes_the_written_checkpoint(hf_dirs, tmp_path):
    from ckpt_tools.verbs import verify
    import_hf(hf_dirs["llama_tied"], tmp_path / "megatron", tp=2, pp=1, form="torch_dist", quiet=True)
    tiers, _ = verify.run(tmp_path / "megatron", hf_dirs["llama_tied"], seq=32, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]


def test_param_groups_megatron_core_cannot_match_are_one_line(tmp_path):
    """A source whose param groups lack megatron-core's group identifiers: one line naming the file, nothing written;
    --no-optimizer still writes the weights."""
    import shutil

    from test_megatron_optimizer import FIXTURES
    src = with_full_schedule(FIXTURES / "dist" / "torch_dist_full", tmp_path / "src")
    common_pt = src / "iter_0000003" / "common.pt"
    common = torch.load(common_pt, weights_only=False)
    for g in common["optimizer"]["optimizer"]["param_groups"]:
        del g["wd_mult"]
    torch.save(common, common_pt)
    out = tmp_path / "out"
    line = one_line_error(run("reshard", src, out, "--tp", "2", "--pp", "1", "--format", "torch_dist",
                              "--vocab-size", "120", "-q"))
    assert "common.pt" in line and "wd_mult" in line and "--no-optimizer" in line, line
    assert_nothing_written(out)
    assert run("reshard", src, out, "--tp", "2", "--pp", "1", "--format", "torch_dist", "--vocab-size", "120",
               "--no-optimizer", "-q").exit_code == 0


def test_optimizer_state_megatron_lm_could_not_resume_from_is_not_written(hf_dirs, tmp_path):
    """An imported checkpoint's fresh state (iteration 0, which Megatron-LM does not load) goes as weights only,
    saying so; a Megatron-LM run resharded into our format, whose config does not give its schedule, is refused
    rather than given a made-up one."""
    from test_megatron_optimizer import FIXTURES
    import_hf(hf_dirs["llama"], tmp_path / "ours", tp=1, pp=1, quiet=True)
    line = reshard(tmp_path / "ours", tmp_path / "mlm", tp=2, pp=1, form="torch_dist", quiet=True)
    assert "weights only (release)" in line and "fresh one of iteration 0" in line, line
    assert (tmp_path / "mlm" / megatron_lm.TRACKER).read_text() == "release"
    src = with_full_schedule(FIXTURES / "dist" / "torch_dist", tmp_path / "src")
    reshard(src, tmp_path / "again", tp=1, pp=1, vocab_size=120, quiet=True)
    out = tmp_path / "out"
    line = one_line_error(run("reshard", tmp_path / "again", out, "--tp", "1", "--pp", "1", "--format", "torch_dist",
                              "-q"))
    assert "meta.json" in line and "does not say" in line and "--no-optimizer" in line, line
    assert_nothing_written(out)


def test_an_expert_parallel_size_for_torch_dist_is_refused_before_writing(tmp_path):
    """torch_dist holds each expert once and Megatron-LM takes its EP at load: `--ep 2` with it is one line, nothing
    written. (The legacy form takes `--ep`: a dir per EP rank; tests/test_families.py.)"""
    from bad_inputs import make_ckpt

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec("mixtral", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=96, vocab_size=256, max_position_embeddings=128, num_moe_experts=4)
    ck = make_ckpt(tmp_path / "src", spec, tp=1, pp=1, optimizer=False)
    out = tmp_path / "out"
    line = one_line_error(run("reshard", ck, out, "--tp", "1", "--pp", "1", "--ep", "2", "--format", "torch_dist"))
    assert "--ep 2 does not apply to torch_dist" in line and "drop --ep" in line
    assert_nothing_written(out)
