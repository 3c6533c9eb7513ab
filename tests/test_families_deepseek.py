"""DeepSeek-V3's parts beyond the common MoE, against megatron-core's own MLA GPTModel and transformers' DeepseekV3:

- megatron-core's MLA model (latent norms, a dense first layer, sigmoid routing with an expert bias, group-limited
  top-k, a shared expert) saves torch_dist and legacy checkpoints that merge to transformers' model with its logits;
- the expert bias stays float32 in a bf16 model through import, reshard and merge;
- multi-token prediction layers: megatron-core's reach transformers' layout and come back (megatron-core loads what
  we write, the trainer's forward gives both depths' logits), the trainer trains them at TP2 x EP2 and resumes at
  TP1 x EP1, and the layouts where megatron-core holds them otherwise (GLM-4.5's MTP too) are refused in one line.

The other MoE families against megatron-core's MoE model are in test_families_moe.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import train
from families_cases import VOCAB, hf_model, logits, rel
from safetensors.torch import load_file as load_safetensors

from ckpt_tools.model import hf
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.reshard import reshard


DEEPSEEK = {"architecture": "deepseek_v3", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
            "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128, "norm_epsilon": 1e-6,
            "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 12, "qk_pos_emb_head_dim": 8, "v_head_dim": 12,
            "num_moe_experts": 8, "moe_router_topk": 4, "moe_ffn_hidden_size": 32,
            "moe_shared_expert_intermediate_size": 32, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
            "moe_router_topk_scaling_factor": 2.5, "layer_pattern": "+-+E+E+E"}


@pytest.mark.slow
def test_megatron_core_deepseek_v3_checkpoints_merge_to_the_same_transformers_model(tmp_path):
    """megatron-core's own MLA GPTModel (MLATransformerConfig, its local layer spec: column-parallel down projections,
    q/kv latent norms, the MLA rotary layout; a dense first layer by moe_layer_freq, then MoE layers with sigmoid
    routing, an expert bias, group-limited top-k and scaled weights, and a shared expert) at TP2 x PP2, saved in
    torch_dist and the legacy form: each merges to transformers' DeepseekV3ForCausalLM whose logits are
    megatron-core's own, the same tensors from both forms."""
    from conftest import torchrun
    (tmp_path / "config.json").write_text(json.dumps({"model": DEEPSEEK, "tp": 2, "pp": 2, "iteration": 5}))
    torchrun(4, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    merged = {}
    for form in ("torch_dist", "torch"):
        merge(tmp_path / form, tmp_path / f"merged_{form}", vocab_size=VOCAB, quiet=True)
        cls, ours = logits(tmp_path / f"merged_{form}", tokens)
        assert cls == "DeepseekV3ForCausalLM" and rel(ours, expected) < 1e-5, (form, rel(ours, expected))
        merged[form] = load_safetensors(tmp_path / f"merged_{form}" / "model.safetensors")
    a, b = merged["torch_dist"], merged["torch"]
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_expert_bias_stays_float32_in_a_bf16_model(tmp_path):
    """DeepSeek-V3 in bf16: transformers keeps e_score_correction_bias in float32, as megatron-core keeps its
    router.expert_bias; import (bf16 weights), reshard and merge keep it float32 and bit for bit, and the imported
    shards pass the checkpoint's own shape and dtype checks."""
    from ckpt_tools.forms.shards import open_checked
    from transformers import AutoModelForCausalLM
    hf_model("deepseek_v3").save_pretrained(tmp_path / "fp32")
    src = tmp_path / "hf"  # loaded in bf16 by transformers (which keeps the bias float32) and saved
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(src)
    original = load_safetensors(src / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert original[bias].dtype == torch.float32 and original["model.norm.weight"].dtype == torch.bfloat16
    import_hf(src, tmp_path / "ours", tp=2, pp=2, ep=2, quiet=True)
    open_checked(tmp_path / "ours")  # the layout table's dtypes: bf16 weights, the float32 bias
    # the fresh optimizer: recorded; written, alone, only the masters that carry more than bf16 (the float32 router
    # weights transformers keeps; the bias, a buffer, has none)
    from ckpt_tools.forms import checkpoint as fmt
    from ckpt_tools.model.ranks import Rank
    written = set()
    for rank in (Rank(t, p, e) for t in range(2) for p in range(2) for e in range(2)):
        state = torch.load(tmp_path / "ours" / "checkpoint-0" / fmt.optimizer_file(rank),
                           weights_only=True)["optimizer"]
        assert all(set(s) == {"master"} for s in state.values())
        written |= set(state)
    assert written == {"decoder.layers.0.mlp.router.weight", "decoder.layers.1.mlp.router.weight"}  # stage-local
    reshard(tmp_path / "ours", tmp_path / "re", tp=1, pp=1, quiet=True)
    merge(tmp_path / "re", tmp_path / "merged", quiet=True)
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert merged[bias].dtype == torch.float32 and torch.equal(merged[bias], original[bias])
    assert merged["model.norm.weight"].dtype == torch.bfloat16


@pytest.mark.slow
def test_megatron_core_mtp_layers_reach_transformers_layout_and_come_back(tmp_path):
    """DeepSeek-V3 with a multi-token prediction layer, megatron-core's own (get_gpt_mtp_block_spec: enorm, hnorm, a
    column-parallel eh_proj, the decoder's last layer, a final norm; the model's embedding and output layer) at TP2 x
    PP2, saved in torch_dist: it merges to DeepSeek-V3's published HF layout (`model.layers.<n>.` after the decoder's,
    with its copies of the embedding and head, num_nextn_predict_layers 1) whose decoder gives megatron-core's logits in
    transformers; imported back at TP2 x EP2, the trainer's forward gives megatron-core's own logits of the model AND of
    the MTP depth; written to torch_dist at TP1 x PP2, megatron-core loads it (strict) and gives both again. The legacy
    form at PP2 (its last stage holds an embedding copy) is refused in one line."""
    from conftest import torchrun
    from safetensors.torch import save_file

    from ckpt_tools.errors import ConfigError, FormatError
    model = {**DEEPSEEK, "mtp_num_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 2, "iteration": 5}))
    torchrun(4, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    expected_mtp = torch.load(tmp_path / "mtp_logits.pt")[..., :VOCAB]
    merge(tmp_path / "torch_dist", tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    cls, ours = logits(tmp_path / "hf", tokens)
    assert cls == "DeepseekV3ForCausalLM" and rel(ours, expected) < 1e-5
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tensors = load_safetensors(tmp_path / "hf" / "model.safetensors")
    mtp = {k[len("model.layers.4."):] for k in tensors if k.startswith("model.layers.4.")}
    layer = {k[len("model.layers.3."):] for k in tensors if k.startswith("model.layers.3.")}
    assert mtp == layer | {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                           "embed_tokens.weight", "shared_head.head.weight"}
    assert torch.equal(tensors["model.layers.4.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors["model.layers.4.shared_head.head.weight"], tensors["lm_head.weight"])
    assert tensors["model.layers.4.eh_proj.weight"].shape == (64, 128)
    import_hf(tmp_path / "hf", tmp_path / "ours", tp=2, pp=1, ep=2, quiet=True)
    reshard(tmp_path / "ours", tmp_path / "ours_tp2", tp=2, pp=1, quiet=True)  # the trainer's forward: EP1
    torchrun(2, ["-m", "trainer.forward", str(tmp_path / "ours_tp2"), "--tokens", str(tmp_path / "tokens.pt"),
                 "--out", str(tmp_path / "trainer.pt"), "--mtp-out", str(tmp_path / "trainer_mtp.pt")])
    assert rel(torch.load(tmp_path / "trainer.pt"), expected) < 1e-5
    assert rel(torch.load(tmp_path / "trainer_mtp.pt"), expected_mtp) < 1e-5
    reshard(tmp_path / "ours", tmp_path / "megatron", tp=1, pp=2, form="torch_dist", quiet=True)
    spec = hf.spec_from_hf(tmp_path / "hf" / "config.json")
    cfg = {"model": spec.to_dict(), "tp": 1, "pp": 2, "form": "torch_dist", "load": str(tmp_path / "megatron"),
           "padded_vocab": spec.padded_vocab_size(2), "tokens": str(tmp_path / "tokens.pt"),
           "out": str(tmp_path / "loaded.pt")}
    (tmp_path / "load.json").write_text(json.dumps(cfg))
    torchrun(2, ["tests/mcore_load.py", str(tmp_path / "load.json")], timeout=600)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert rel(loaded["logits"][..., :VOCAB], expected) < 1e-5
    assert rel(loaded["mtp_logits"][..., :VOCAB], expected_mtp) < 1e-5 and loaded["args"]["mtp_num_layers"] == 1
    merge(tmp_path / "megatron", tmp_path / "back", quiet=True)
    back = load_safetensors(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    from ckpt_tools.verbs import hf_copy  # the byte path takes an MTP model (its copies checked byte for byte)
    from ckpt_tools.verbs.request import Request
    assert hf_copy.import_hf(tmp_path / "hf", tmp_path / "bytes", Request(2, 2, form="torch_dist"),
                             quiet=True) is not None
    merge(tmp_path / "bytes", tmp_path / "back_bytes", quiet=True)
    again = load_safetensors(tmp_path / "back_bytes" / "model.safetensors")
    assert sorted(again) == sorted(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)
    with pytest.raises(ConfigError, match="multi-token prediction layers at PP 2 in the legacy form"):
        merge(tmp_path / "torch", tmp_path / "legacy", vocab_size=VOCAB, quiet=True)
    with pytest.raises(ConfigError, match="multi-token prediction layers at PP 2 in Megatron-LM's torch form"):
        reshard(tmp_path / "ours", tmp_path / "legacy", tp=1, pp=2, form="torch", quiet=True)
    assert not (tmp_path / "legacy").exists()
    copy = dict(tensors, **{"model.layers.4.embed_tokens.weight": tensors["model.embed_tokens.weight"] * 2})
    (tmp_path / "bad").mkdir()
    save_file(copy, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(FormatError, match="model.layers.4.embed_tokens.weight differs from model.embed_tokens.weight"):
        import_hf(tmp_path / "bad", tmp_path / "out", tp=1, pp=1, quiet=True)


@pytest.mark.slow
def test_trainer_trains_mtp_layers_at_tp2_ep2_and_resumes_elsewhere(tmp_path):
    """DeepSeek-V3 with a multi-token prediction layer (MLA, a dense first layer, sigmoid-routed experts with a
    shared expert) trains at TP2 x EP2 (4 processes, DP2) with the MTP loss (weight 0.3) and its MTP layer's weights
    move; its checkpoint resharded to TP1 x EP1 resumes on the same curve at DP1; a run without the MTP loss
    (weight 0) takes another path from the same start."""
    import torch as t
    model = {"architecture": "deepseek_v3", "num_query_groups": 4, "norm_epsilon": 1e-6, "q_lora_rank": 24,
             "kv_lora_rank": 16, "qk_head_dim": 12, "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "num_moe_experts": 4,
             "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 32,
             "moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5,
             "layer_pattern": "+-+E+E+E", "mtp_num_layers": 1}
    common = {**model, "pp_degree": 1, "train_iters": 6, "save_interval": 3, "mtp_loss_scale": 0.3}
    first = train("tiny_llama.yaml", tmp_path / "run" / "save", 4, tp_degree=2, ep_degree=2, num_micro_batches=1,
                  **common)
    assert first[-1]["loss"] < first[0]["loss"] - 0.05, [m["loss"] for m in first]
    files = [tmp_path / "run" / "save" / f"checkpoint-{i}" / "pytorch_model_tp_1_pp_0_ep_1.bin" for i in (3, 6)]
    a, b = (t.load(f, weights_only=True)["model"]["mtp.layers.0.eh_proj.weight"] for f in files)
    assert a.shape == (32, 128) and not t.equal(a, b)
    reshard(tmp_path / "run" / "save" / "checkpoint-3", tmp_path / "re" / "save", tp=1, pp=1, ep=1, quiet=True)
    resumed = train("tiny_llama.yaml", tmp_path / "re" / "save", 1, tp_degree=1, ep_degree=1, num_micro_batches=2,
                    **common)
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for x, y in zip(first[3:], resumed):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x, y)
    reshard(tmp_path / "run" / "save" / "checkpoint-3", tmp_path / "plain" / "save", tp=1, pp=1, ep=1, quiet=True)
    plain = train("tiny_llama.yaml", tmp_path / "plain" / "save", 1, tp_degree=1, ep_degree=1, num_micro_batches=2,
                  **{**common, "mtp_loss_scale": 0.0, "train_iters": 5})
    assert plain[-1]["iteration"] == 5 and abs(plain[-1]["loss"] - resumed[1]["loss"]) > 1e-4 * abs(plain[-1]["loss"])


def test_mtp_layers_are_refused_where_megatron_core_holds_them_otherwise():
    """A HybridModel's MTP layers follow its own pattern, the legacy form keeps an embedding copy at PP > 1, and the
    trainer keeps the MTP embedding at PP 1 only: each is refused before anything is written, in one line."""
    from layout_cases import llama

    from ckpt_tools.errors import ConfigError
    from ckpt_tools.verbs import to_megatron
    from ckpt_tools.verbs.request import Layout
    from trainer.config import TrainConfig
    spec = llama(architecture="glm4_moe", num_moe_experts=4, moe_shared_expert_intermediate_size=48, mtp_num_layers=1)
    with pytest.raises(ConfigError, match="multi-token prediction layers in a HybridModel"):
        to_megatron.check(spec, Layout("torch_dist", 1, [4], 1024, model="hybrid"), "float32", where="out")
    with pytest.raises(ConfigError, match="multi-token prediction layers at PP 2 in Megatron-LM's torch form"):
        to_megatron.check(spec, Layout("torch", 1, [2, 2], 1024), "float32", where="out")
    to_megatron.check(spec, Layout("torch_dist", 1, [2, 2], 1024), "float32", where="out")  # at PP2: written
    with pytest.raises(ConfigError, match="multi-token prediction layers train here at pp_degree 1"):
        TrainConfig(model={**spec.to_dict(), "mtp_num_layers": 1}, pp_degree=2)
    with pytest.raises(ConfigError, match="mtp_num_layers 1 given, but llama has no multi-token prediction layers"):
        llama(mtp_num_layers=1)
