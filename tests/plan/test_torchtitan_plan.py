"""specs_from_torchtitan: torchtitan 0.3's own TP/SP plan for its Llama3, as fxshard specs."""
from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torchtitan")

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard import MeshSpec, ModuleSpec, Plan, PlanError, colwise, expert_parallel, rowwise, sequence_parallel, vocab_parallel
from fxshard.plan.importers.torchtitan_plan import specs_from_torchtitan, torchtitan_sharding_configs
from fxshard.testing.torchtitan_models import tiny_deepseek_v3, tiny_llama3, tiny_qwen3_moe

TP2 = MeshSpec(("tp",), (2,))
R = Replicate()


@pytest.fixture(scope="module")
def model():
    return tiny_llama3()


def _gather_input(arg: str) -> ModuleSpec:
    """torchtitan's attention/feed_forward under SP: sequence shard in, all-gathered on entry."""
    return ModuleSpec(inputs={arg: {"tp": R}}, in_src={arg: {"tp": Shard(1)}}, style="prepare_input")


def _heads_local() -> ModuleSpec:
    """torchtitan's inner attention: q/k/v and the output sharded on heads (dim 2)."""
    qkv = {n: {"tp": Shard(2)} for n in ("q_BLNH", "k_BLNH", "v_BLNH")}
    return ModuleSpec(inputs=qkv, in_src=dict(qkv), out_src={"tp": Shard(2)}, style="torchtitan")


def _sp_plan(lm_head_out):
    return {
        "tok_embeddings": vocab_parallel("tp", out=Shard(1)),
        "layers.*.attention": _gather_input("x_BLD"),
        "layers.*.attention.qkv_linear.wqkv": colwise("tp"),
        "layers.*.attention.inner_attention": _heads_local(),
        "layers.*.attention.wo": rowwise("tp", out=Shard(1)),
        "layers.*.feed_forward": _gather_input("x"),
        "layers.*.feed_forward.w1": colwise("tp"),
        "layers.*.feed_forward.w3": colwise("tp"),
        "layers.*.feed_forward.w2": rowwise("tp", out=Shard(1)),
        "layers.*.attention_norm": sequence_parallel("tp"),
        "layers.*.ffn_norm": sequence_parallel("tp"),
        "norm": replace(sequence_parallel("tp"), out_dst={"tp": R}),  # gathers before lm_head
        "lm_head": colwise("tp", out=lm_head_out),
    }


# ----------------------------------------------------------------------------- the converted plan


def test_tp_with_sequence_parallel_is_torchtitans_default(model):
    plan = Plan.from_torchtitan(TP2, model)
    assert plan.specs == _sp_plan(lm_head_out=R)
    assert plan.axes == {"tp": 2} and plan.inputs == {}


def test_loss_parallel_keeps_logits_vocab_sharded(model):
    plan = Plan.from_torchtitan(TP2, model, loss_parallel=True)
    assert plan.specs == _sp_plan(lm_head_out=Shard(-1))
    assert plan.specs["lm_head"].out_dst == {"tp": Shard(-1)}


def test_without_sequence_parallel_only_the_megatron_pairs_remain(model):
    plan = Plan.from_torchtitan(TP2, model, sequence_parallel=False)
    # norms and block inputs declare only Replicate (torchtitan's I/R): fxshard's default
    assert plan.specs == {
        "tok_embeddings": vocab_parallel("tp", out=R),
        "layers.*.attention.qkv_linear.wqkv": colwise("tp"),
        "layers.*.attention.inner_attention": _heads_local(),
        "layers.*.attention.wo": rowwise("tp"),
        "layers.*.feed_forward.w1": colwise("tp"),
        "layers.*.feed_forward.w3": colwise("tp"),
        "layers.*.feed_forward.w2": rowwise("tp"),
        "lm_head": colwise("tp", out=R),
    }


def test_classmethod_is_the_importer(model):
    assert Plan.from_torchtitan(TP2, model, loss_parallel=True).specs == specs_from_torchtitan(TP2, model, loss_parallel=True).specs


def test_patterns_fold_layers_and_match_the_model(model):
    plan = Plan.from_torchtitan(TP2, model)
    fqns = [n for n, _ in model.named_modules()]
    plan.check_patterns(fqns)
    assert not any(part.isdigit() for p in plan.specs for part in p.split("."))
    for i in range(2):
        assert plan.match(f"layers.{i}.attention.qkv_linear.wqkv")[0] == "layers.*.attention.qkv_linear.wqkv"
    assert plan.match("layers.0.attention.rope") is None  # its cache is Replicate: no entry


def test_separate_projections_and_tied_embeddings():
    model = tiny_llama3(fuse_qkv=False, enable_weight_tying=True)
    plan = Plan.from_torchtitan(TP2, model)
    for w in ("wq", "wk", "wv"):  # QKVLinear's one "wkv" config builds both wk and wv
        assert plan.specs[f"layers.*.attention.qkv_linear.{w}"] == colwise("tp")
    # one tied weight, sharded alike by both of its modules
    assert model.tok_embeddings.weight is model.lm_head.weight
    assert plan.specs["tok_embeddings"].params["weight"] == plan.specs["lm_head"].params["weight"] == {"tp": Shard(0)}


def test_dp_tp_mesh_converts_the_tp_axis_only(model):
    mesh = MeshSpec(("dp", "tp"), (2, 2))
    plan = Plan.from_torchtitan(mesh, model, inputs={"tokens": {"dp": Shard(0)}})
    assert plan.inputs == {"tokens": {"dp": Shard(0), "tp": R}}
    assert plan.specs == _sp_plan(lm_head_out=R)


def test_plan_is_read_from_torchtitan_not_reproduced(model):
    configs = torchtitan_sharding_configs(model, tp_degree=2)
    assert "layers.1.attention.wo" in configs and "layers.1.attention.qkv_linear" not in configs
    assert model.config.layers[0].attention.wo.sharding_config is None  # the model's config is left alone


# ----------------------------------------------------------------------------- MoE: expert parallelism


EP2 = MeshSpec(("ep",), (2,))
GROUPED = expert_parallel("ep", experts="routed_experts.inner_experts")


@pytest.mark.parametrize("factory", [tiny_qwen3_moe, tiny_deepseek_v3])
def test_ep_mesh_makes_each_moe_block_expert_parallel(factory):
    """torchtitan shards the grouped experts S(0) on EP: the MoE block becomes one
    expert-parallel region around them, and the batch is sharded over ep (DeepSeek-V3's
    dense first layer has no MoE: the pattern still covers the layers that do)."""
    plan = Plan.from_torchtitan(EP2, factory())
    assert plan.specs == {"layers.*.moe": GROUPED}
    assert plan.inputs == {"tokens": {"ep": Shard(0)}}


def test_ep_tp_mesh_shards_dense_modules_over_tp_and_experts_over_ep():
    plan = Plan.from_torchtitan(MeshSpec(("ep", "tp"), (2, 2)), tiny_qwen3_moe())
    assert plan.specs["layers.*.moe"] == GROUPED
    assert plan.specs["layers.*.attention.wo"] == rowwise("tp", out=Shard(1))
    assert not [p for p in plan.specs if p.startswith("layers.*.moe.")]  # the region runs as is inside
    assert plan.inputs == {"tokens": {"ep": Shard(0), "tp": R}}


def test_tp_mesh_makes_torchtitans_routed_experts_one_local_region():
    """TP-only MoE: torchtitan's local_map region with the grouped experts' hidden-dim
    shards folded in (a local region is opaque), Replicate tokens in, a Partial output."""
    plan = Plan.from_torchtitan(TP2, tiny_qwen3_moe(), sequence_parallel=False)
    spec = plan.specs["layers.*.moe.routed_experts"]
    assert spec.local and spec.out_src == {"tp": Partial()} and spec.out_dst == {"tp": Partial()}
    assert spec.params == {"inner_experts.w1_EFD": {"tp": Shard(1)}, "inner_experts.w2_EDF": {"tp": Shard(2)},
                           "inner_experts.w3_EFD": {"tp": Shard(1)}}
    assert spec.inputs["x_BLD"] == {"tp": R} and "layers.*.moe.routed_experts.inner_experts" not in plan.specs


def test_ep_mesh_on_a_dense_model_is_a_plan_error(model):
    with pytest.raises(PlanError, match="'ep' axis but torchtitan shards no experts of Llama3Model"):
        Plan.from_torchtitan(EP2, model)


# ----------------------------------------------------------------------------- no equivalent


def test_dist_gemm_backend_has_no_equivalent():
    model = tiny_llama3(tp_gemm_backend="dist_gemm")
    with pytest.raises(PlanError, match="AllGatherFusedQKVLinear.*tp_gemm_backend='default'"):
        Plan.from_torchtitan(TP2, model)


def test_local_map_on_an_unknown_module_has_no_equivalent(model, monkeypatch):
    import torchtitan.models.llama3.sharding as llama3_sharding
    from torchtitan.protocols.sharding import LocalMapConfig

    original = llama3_sharding.set_dense_ffn_sharding

    def with_local_map(cfg, **kw):
        original(cfg, **kw)
        cfg.sharding_config.local_map = LocalMapConfig(in_grad_placements=None)

    monkeypatch.setattr(llama3_sharding, "set_dense_ffn_sharding", with_local_map)
    with pytest.raises(PlanError, match=r"'layers\.0\.feed_forward' \(FeedForward\): local_map .* no fxshard equivalent"):
        Plan.from_torchtitan(TP2, model)


def test_tp_must_divide_the_kv_heads(model):
    with pytest.raises(PlanError, match=r"degree 4 .* must divide n_kv_heads \(2\)"):
        Plan.from_torchtitan(MeshSpec(("tp",), (4,)), model)


def test_axis_must_be_on_the_mesh(model):
    with pytest.raises(PlanError, match="neither axis 'mp' nor ep_axis 'ep' is on the mesh"):
        Plan.from_torchtitan(TP2, model, axis="mp")


def test_not_a_torchtitan_model():
    with pytest.raises(PlanError, match="expected a torchtitan model .* got Linear"):
        Plan.from_torchtitan(TP2, nn.Linear(4, 4))


# ----------------------------------------------------------------------------- the test model


def test_tiny_llama3_is_deterministic_and_returns_logits():
    a, b = tiny_llama3(), tiny_llama3()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, tiny_llama3(seed=1).lm_head.weight)
    tokens = torch.randint(0, 128, (2, 16))
    logits = a(tokens)
    assert logits.shape == (2, 16, 128) and logits.dtype == torch.float32
    assert torch.equal(logits, b(tokens))
    assert a.layers["0"].attention.rope.cache.shape == (64, 8)  # RoPE cache initialised (complex64)
    with pytest.raises(TypeError, match="unknown options"):
        tiny_llama3(hidden=3)


def test_tiny_llama3_exports_with_dynamic_batch_and_sequence():
    model = tiny_llama3()
    dims = {"tokens": {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}}
    ep = torch.export.export(model, (torch.randint(0, 128, (2, 16)),), dynamic_shapes=dims, strict=False)
    other = torch.randint(0, 128, (3, 9))
    torch.testing.assert_close(ep.module()(other), model(other))
