"""Mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE; DeepSeek-V3 and GPT-OSS where megatron-core
loads what we write) against megatron-core's own MoE GPTModel and transformers' models: megatron-core's saves in every
Megatron-LM form (its experts split over TP or not) merge to transformers' logits, megatron-core loads what we write
(our format, torch_dist, legacy at EP > 1), experts move between expert-parallel ranks bit for bit, and the trainer
(its own MoE layer and megatron-core's MoELayer) trains with experts split over the data-parallel ranks.
DeepSeek-V3's MLA model, expert bias and multi-token prediction layers are in test_families_deepseek.py; the
families' common tests (import/reshard/merge, sharded forward, training) are in test_families.py, parametrized over
every family.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import train
from families_cases import CASES, TOKENS, VOCAB, hf_dirs, logits, rel  # noqa: F401 (hf_dirs: a fixture)
from safetensors.torch import load_file as load_safetensors

from ckpt_tools.model import hf
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_megatron_core_moe_checkpoints_merge_to_the_same_transformers_model(case, tmp_path):
    """megatron-core's own MoE GPTModel (SequentialMLP experts) at TP2 x EP2, saved as Megatron-LM does: torch_dist
    (experts on a stacked expert axis), legacy torch (mp_rank_TT_EEE dirs, each EP rank's experts under local
    indices) and legacy torch with Transformer Engine's names; each merges to a transformers MoE model whose logits
    are megatron-core's own, and resharding the legacy one to our format (EP2 -> EP4) changes nothing. The same
    weights loaded by megatron-core into its grouped-GEMM experts (GroupedMLP: weight1/weight2) and saved again, in
    torch_dist and legacy torch, and under TEGroupedMLP's legacy names, merge to the same tensors."""
    from conftest import torchrun
    model = {"architecture": case, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128, "norm_epsilon": 1e-5,
             "num_moe_experts": 4, **({"moe_ffn_hidden_size": 32, "moe_router_pre_softmax": True, "kv_channels": 24}
                                      if case == "qwen3_moe" else {}),
             **({"moe_ffn_hidden_size": 32, "moe_router_pre_softmax": True, "moe_shared_expert_intermediate_size": 48}
                if case == "qwen2_moe" else {})}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 1, "ep": 2, "iteration": 5,
                                                        "grouped": True}))
    torchrun(4, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    merged = {}
    for form in ("torch_dist", "torch", "torch_te"):
        merge(tmp_path / form, tmp_path / f"merged_{form}", vocab_size=VOCAB, quiet=True)
        cls, ours = logits(tmp_path / f"merged_{form}", tokens)
        assert cls == CASES[case][0].replace("Config", "ForCausalLM") and rel(ours, expected) < 1e-5, form
        merged[form] = load_safetensors(tmp_path / f"merged_{form}" / "model.safetensors")
    reshard(tmp_path / "torch", tmp_path / "ours", tp=1, pp=2, ep=4, vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "ours", tmp_path / "merged_ours", quiet=True)
    merged["ours"] = load_safetensors(tmp_path / "merged_ours" / "model.safetensors")
    # Megatron-LM's legacy form written from its torch_dist save by copying bytes (every expert at EP 1)
    from ckpt_tools.verbs import paths
    from ckpt_tools.verbs.request import Request

    # holding no optimizer state: not left to the torch reader
    assert paths.by_bytes(tmp_path / "torch_dist", tmp_path / "legacy", Request(1, 2, form="torch"),
                          vocab_size=VOCAB, quiet=True) is not None
    for form in ("grouped_torch_dist", "grouped_torch", "grouped_torch_te", "legacy"):
        merge(tmp_path / form, tmp_path / f"merged_{form}", vocab_size=VOCAB, quiet=True)
        merged[form] = load_safetensors(tmp_path / f"merged_{form}" / "model.safetensors")
    first = merged["torch_dist"]
    for form, tensors in merged.items():
        assert sorted(tensors) == sorted(first) and all(torch.equal(tensors[k], first[k]) for k in first), form
    assert_copied_with_experts_made(tmp_path / "grouped_torch", tmp_path, first)


def assert_copied_with_experts_made(src, tmp_path, expected: dict) -> None:
    """A legacy save whose experts' bytes are not the layout table's (grouped-GEMM blocks, or whole on every TP rank)
    goes the byte path with only its experts made by the torch reader, tensor by tensor: its merge and its byte copies
    into torch_dist, the legacy form and our format (reshard) hold `expected`'s tensors, bit for bit."""
    from ckpt_tools.forms.byte_ranges import ByteSource
    from ckpt_tools.model import layout
    from ckpt_tools.verbs import paths
    from ckpt_tools.verbs.request import Request
    source = ByteSource.open(src, VOCAB, False)
    made, copied = set(source.made), set(source.shards)
    source.close()
    assert made and copied and all(layout.expert_index(k) is not None for k in made), (made, copied)
    outs = [tmp_path / f"{src.name}_merged"]
    merge(src, outs[0], vocab_size=VOCAB, quiet=True)
    for form in ("torch_dist", "torch", "ours"):
        copy = tmp_path / f"{src.name}_{form}"
        assert paths.by_bytes(src, copy, Request(1, 1, form=form), vocab_size=VOCAB, quiet=True) is not None
        outs.append(tmp_path / f"{copy.name}_merged")
        merge(copy, outs[-1], vocab_size=VOCAB, quiet=True)
    for out in outs:
        tensors = load_safetensors(out / "model.safetensors")
        assert sorted(tensors) == sorted(expected) and all(torch.equal(tensors[k], expected[k]) for k in expected), out


def test_olmoe_norm_over_all_heads_split_over_tp_equals_transformers(tmp_path):
    """The trainer's OLMoE q/k norm at TP2 (each rank half the features, the squares summed over TP through autograd)
    against transformers' OlmoeRMSNorm over the whole width: output, input and weight gradients of each half."""
    from conftest import torchrun
    torchrun(2, ["tests/across_heads_norm_check.py", str(tmp_path / "errors.json")])
    for errors in json.loads((tmp_path / "errors.json").read_text()):
        assert all(e < 1e-6 for e in errors.values()), errors


@pytest.mark.slow
@pytest.mark.parametrize("case,form,written,loaded", [("mixtral", "torch_dist", (2, 2, 1), (2, 1, 2)),
                                                      ("qwen3_moe", "torch", (2, 1, 1), (2, 1, 1)),
                                                      ("qwen2_moe", "torch_dist", (1, 2, 1), (2, 1, 2)),
                                                      ("mixtral", "torch", (1, 2, 2), (1, 2, 2)),
                                                      ("deepseek_v3", "torch_dist", (2, 2, 1), (2, 1, 2)),
                                                      ("deepseek_v3", "torch", (2, 2, 1), (2, 2, 1)),
                                                      ("gpt_oss", "torch_dist", (2, 2, 1), (2, 1, 2)),
                                                      ("gpt_oss", "torch", (1, 2, 2), (1, 2, 2))])
def test_megatron_core_loads_the_moe_checkpoints_we_write(case, form, written, loaded, hf_dirs, tmp_path):
    """`ckpt import --format torch_dist|torch` of an MoE model: megatron-core's own MoE GPTModel loads it the way
    Megatron-LM does (torch_dist at another TP x PP and with EP2; torch per rank, strict, with EP2 from the
    mp_rank_TT_PPP_EEE dirs, each EP rank's experts under local indices) and gives transformers' logits; merging
    what we wrote gives the HF tensors back bit for bit."""
    from conftest import torchrun
    import_hf(hf_dirs[case], tmp_path / "megatron", tp=written[0], pp=written[1], ep=written[2], form=form, quiet=True)
    spec = hf.spec_from_hf(hf_dirs[case] / "config.json")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    tp, pp, ep = loaded
    cfg = {"model": spec.to_dict(), "tp": tp, "pp": pp, "ep": ep, "form": form, "load": str(tmp_path / "megatron"),
           "padded_vocab": spec.padded_vocab_size(written[0]), "tokens": str(tmp_path / "tokens.pt"),
           "out": str(tmp_path / "loaded.pt")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torchrun(tp * pp * ep, ["tests/mcore_load.py", str(tmp_path / "config.json")], timeout=600)
    result = torch.load(tmp_path / "loaded.pt", weights_only=False)
    if case == "deepseek_v3" and form == "torch_dist":  # the norms also under Transformer Engine's MLA names
        _te_aliases_share_bytes(next((tmp_path / "megatron").glob("*/.metadata")).parent)
    _, want = logits(hf_dirs[case], TOKENS)
    assert rel(result["logits"][..., :VOCAB], want) < 1e-5
    assert result["args"]["num_experts"] == spec.num_moe_experts
    merge(tmp_path / "megatron", tmp_path / "back", quiet=True)
    original = load_safetensors(hf_dirs[case] / "model.safetensors")
    back = load_safetensors(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)


def _te_aliases_share_bytes(iter_dir) -> None:
    """An MLA model's latent norms (and a dense layer's pre-MLP norm) are indexed under the local spec's names and
    Transformer Engine's, over the same bytes; an MoE layer's pre-MLP norm (its own module under both) once."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(iter_dir)).read_metadata()
    where = {(i.fqn, tuple(i.offset or ())): (s.relative_path, s.offset, s.length) for i, s in md.storage_data.items()}
    pairs = {"decoder.layers.0.self_attention.q_layernorm.weight":
             "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
             "decoder.layers.3.self_attention.kv_layernorm.weight":
             "decoder.layers.3.self_attention.linear_kv_up_proj.layer_norm_weight",
             "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"}
    for local, te in pairs.items():
        assert where[(local, (0,))] == where[(te, (0,))], (local, te)
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" not in md.state_dict_metadata


def test_experts_move_between_expert_parallel_ranks_bit_exactly(hf_dirs, tmp_path):
    """Mixtral imported at TP2 x PP2 x EP2 (each file: its stage's dense tensors and its two experts), resharded to
    TP1 x PP1 x EP4 and back to TP2 x PP2 without EP: every model file (the fresh optimizer is recorded, not written) is
    byte-identical to a direct
    import at TP2 x PP2, the EP4 checkpoint merges to the HF weights bit for bit, its sharded forward (the
    experts gathered from their EP ranks) gives transformers' logits, and written into Megatron-LM's forms (the
    torch_dist chunks copied from each EP rank's file; the legacy form at the source's EP2) it merges to the same
    weights."""
    from ckpt_tools.forms.checkpoint import Meta
    from ckpt_tools.hashing import hash_file
    from ckpt_tools.verbs import verify
    src = hf_dirs["mixtral"]
    import_hf(src, tmp_path / "ep2", tp=2, pp=2, ep=2, quiet=True)
    ep2 = tmp_path / "ep2" / "checkpoint-0"
    assert Meta.read(ep2).ep_size == 2
    assert (ep2 / "pytorch_model_tp_1_pp_1_ep_1.bin").is_file() and not (ep2 / "pytorch_model_tp_1_pp_1.bin").exists()
    local = torch.load(ep2 / "pytorch_model_tp_0_pp_0_ep_1.bin", weights_only=True)["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in local  # global expert 3, local 1
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in local
    reshard(tmp_path / "ep2", tmp_path / "ep4", tp=1, pp=1, ep=4, quiet=True)
    reshard(tmp_path / "ep4", tmp_path / "back", tp=2, pp=2, ep=1, quiet=True)
    import_hf(src, tmp_path / "direct", tp=2, pp=2, quiet=True, copy_bytes=False)  # the same archive writer
    back, direct = tmp_path / "back" / "checkpoint-0", tmp_path / "direct" / "checkpoint-0"
    names = sorted(p.name for p in direct.glob("*.bin"))
    assert names == sorted(p.name for p in back.glob("*.bin")) and len(names) == 4  # the fresh optimizer: recorded
    assert all(hash_file(back / n) == hash_file(direct / n) for n in names)
    merge(tmp_path / "ep4", tmp_path / "merged", quiet=True)
    original = load_safetensors(src / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original) and all(torch.equal(merged[k], original[k]) for k in original)
    tiers, _ = verify.run(tmp_path / "ep2", src, seq=48, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
    assert tiers[2].data["rel_l2"] < 1e-5
    for form in ("torch_dist", "torch"):  # each EP rank's experts into Megatron-LM's forms (legacy: at EP2), and back
        reshard(tmp_path / "ep2", tmp_path / form, tp=1, pp=2, form=form, optimizer=False, quiet=True)
        if form == "torch":
            assert sorted(p.name for p in (tmp_path / form / "release").glob("mp_rank_*")) == \
                [f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(2)]
        merge(tmp_path / form, tmp_path / f"{form}_merged", quiet=True)
        back = load_safetensors(tmp_path / f"{form}_merged" / "model.safetensors")
        assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original), form


def test_an_expert_parallel_size_the_model_cannot_take_is_refused(hf_dirs, tmp_path):
    from ckpt_tools.errors import ConfigError
    with pytest.raises(ConfigError, match="num_moe_experts 4 is not divisible by EP 3"):
        import_hf(hf_dirs["mixtral"], tmp_path / "out", tp=1, pp=1, ep=3, quiet=True)
    with pytest.raises(ConfigError, match="is dense: drop --ep"):
        import_hf(hf_dirs["qwen3"], tmp_path / "out", tp=1, pp=1, ep=2, quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case,tp,pp,ep", [("mixtral", 1, 2, 2), ("qwen3_moe", 2, 1, 1), ("qwen2_moe", 2, 1, 1)])
def test_megatron_core_moe_model_loads_our_shards(case, tp, pp, ep, hf_dirs, tmp_path):
    """megatron-core's own GPTModel with MoE layers (SequentialMLP experts; with EP, its expert parallelism over the
    data-parallel ranks) loads each rank's file of ours with strict=True, and its forward gives transformers'
    logits."""
    from conftest import torchrun
    import_hf(hf_dirs[case], tmp_path / "ours", tp=tp, pp=pp, ep=ep, optimizer=False, quiet=True)
    spec = hf.spec_from_hf(hf_dirs[case] / "config.json")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    cfg = {"model": spec.to_dict(), "tp": tp, "pp": pp, "ep": ep, "form": "ours", "load": str(tmp_path / "ours"),
           "padded_vocab": spec.padded_vocab_size(tp), "tokens": str(tmp_path / "tokens.pt"),
           "out": str(tmp_path / "logits.pt")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torchrun(tp * pp * ep, ["tests/mcore_load.py", str(tmp_path / "config.json")], timeout=600)
    theirs = torch.load(tmp_path / "logits.pt")["logits"][..., :VOCAB]
    _, want = logits(hf_dirs[case], TOKENS)
    assert rel(theirs, want) < 1e-5


@pytest.mark.slow
def test_trainer_splits_experts_over_data_parallel_ranks(tmp_path):
    """EP2 over DP2 (megatron-core's expert parallelism: each rank holds two of the four experts, tokens gathered
    and their outputs summed back across the EP group) trains the same curve as every expert on every rank; its
    checkpoint has a file per EP rank, which resharded to EP1 resumes the EP1 run's curve, and the EP1 checkpoint
    resharded to EP2 resumes at EP2. The load-balancing loss keeps the experts evenly loaded (the logged balance)."""
    moe = {"architecture": "mixtral", "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
           "tp_degree": 1, "pp_degree": 1, "train_iters": 6, "save_interval": 3, "num_micro_batches": 2}
    ep2 = train("tiny_llama.yaml", tmp_path / "ep2" / "save", 2, ep_degree=2, **moe)
    ep1 = train("tiny_llama.yaml", tmp_path / "ep1" / "save", 2, ep_degree=1, **moe)
    assert ep1[-1]["loss"] < ep1[0]["loss"] - 0.05, [m["loss"] for m in ep1]
    # the experts share the tokens: E x sum_e (share routed to e) x (mean probability of e) is 1 when even, 4 at worst
    assert all(m["moe_balance"] < 1.2 for m in ep1 + ep2), [m["moe_balance"] for m in ep1 + ep2]
    for a, b in zip(ep1, ep2):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        # the norms agree to fp32 summation order: without EP the norm is one fp32 sum over the whole flat buffer
        # (~5e-5 off a float64 sum on CPU), with EP a sum of per-parameter norms (~2e-6 off)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-4 * abs(a["grad_norm"]), (a, b)
    saved = tmp_path / "ep2" / "save" / "checkpoint-3"
    assert (saved / "pytorch_model_tp_0_pp_0_ep_1.bin").is_file()
    reshard(saved, tmp_path / "to_ep1" / "save", tp=1, pp=1, ep=1, quiet=True)
    resumed = train("tiny_llama.yaml", tmp_path / "to_ep1" / "save", 2, ep_degree=1, **moe)
    reshard(tmp_path / "ep1" / "save" / "checkpoint-3", tmp_path / "to_ep2" / "save", tp=1, pp=1, ep=2, quiet=True)
    resumed_ep2 = train("tiny_llama.yaml", tmp_path / "to_ep2" / "save", 2, ep_degree=2, **moe)
    for run in (resumed, resumed_ep2):
        assert [m["iteration"] for m in run] == [4, 5, 6]
        for a, b in zip(ep1[3:], run):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_trainer_trains_with_megatron_cores_own_moe_layer(arch, tmp_path):
    """`moe_layer: megatron_core`: megatron-core's MoELayer (TopKRouter, alltoall dispatcher over EP2, SequentialMLP
    experts, Qwen2-MoE's gated shared expert as its SharedExpertMLP, its load-balancing loss through
    MoEAuxLossAutoScaler) trains the curve of the trainer's own MoE layer from the same initial weights; its
    checkpoint holds the same keys, and the trainer's own layer resumes it on the same curve (and the other way
    round: Mixtral's from megatron-core's layer to ours, Qwen2-MoE's from ours to megatron-core's)."""
    moe = {"architecture": arch, "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
           "tp_degree": 1, "pp_degree": 1, "ep_degree": 2, "train_iters": 6, "save_interval": 3,
           "num_micro_batches": 2}
    if arch == "qwen2_moe":
        moe.update(moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48, moe_router_pre_softmax=True)
    theirs = train("tiny_llama.yaml", tmp_path / "mcore" / "save", 2, moe_layer="megatron_core", **moe)
    ours = train("tiny_llama.yaml", tmp_path / "ours" / "save", 2, moe_layer="ours", **moe)
    assert theirs[-1]["loss"] < theirs[0]["loss"] - 0.05, [m["loss"] for m in theirs]
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    src, layer, want = ("mcore", "ours", ours) if arch == "mixtral" else ("ours", "megatron_core", theirs)
    run = tmp_path / f"{src}_to_{layer}" / "save"
    reshard(tmp_path / src / "save" / "checkpoint-3", run, tp=1, pp=1, ep=2, quiet=True)
    resumed = train("tiny_llama.yaml", run, 2, moe_layer=layer, **moe)
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for a, b in zip(want[3:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)


@pytest.mark.slow
def test_megatron_core_moe_checkpoint_with_another_expert_tensor_parallel_size_merges(tmp_path):
    """megatron-core's MoE GPTModel at TP2 with its experts unsplit (--expert-tensor-parallel-size 1; the experts then
    lie whole on each TP rank), saved as Megatron-LM does: the torch_dist save (experts as global tensors, whatever
    their split) merges to a transformers Mixtral with megatron-core's own logits, and reshards into our format
    (experts split over TP as the dense layers) bit-exactly; the legacy form of such a run (each TP rank's file holds
    every expert whole) merges to the same tensors."""
    from conftest import torchrun
    model = {"architecture": "mixtral", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128,
             "norm_epsilon": 1e-5, "num_moe_experts": 4}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 1, "etp": 1, "iteration": 5}))
    torchrun(2, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    merge(tmp_path / "torch_dist", tmp_path / "merged", vocab_size=VOCAB, quiet=True)
    cls, ours = logits(tmp_path / "merged", tokens)
    assert cls == "MixtralForCausalLM" and rel(ours, expected) < 1e-5
    reshard(tmp_path / "torch_dist", tmp_path / "ours", tp=2, pp=1, vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "ours", tmp_path / "merged_ours", quiet=True)
    first = load_safetensors(tmp_path / "merged" / "model.safetensors")
    again = load_safetensors(tmp_path / "merged_ours" / "model.safetensors")
    assert sorted(again) == sorted(first) and all(torch.equal(again[k], first[k]) for k in first)
    assert_copied_with_experts_made(tmp_path / "torch", tmp_path, first)
