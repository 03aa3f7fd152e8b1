"""torchtitan 0.3's MoE decoders (Qwen3-MoE; DeepSeek-V3 with shared experts, MLA and a
dense first layer) under expert parallelism with torchtitan's own plan converted
(``Plan.from_torchtitan`` on an ``ep`` mesh): counts exchanged, tokens dispatched to
the experts' ranks and combined back with uneven all-to-alls, equal to one device in
real gloo processes (all-to-alls with data-dependent splits cannot run on simulated
ranks)."""
import functools

import pytest
import torch

pytest.importorskip("torchtitan")

import fxshard
from equivalence import Case, check_real_cases, cross_entropy
from test_moe import CountAllToAll
from fxshard.testing.torchtitan_models import tiny_deepseek_v3, tiny_qwen3_moe
from fxshard.meta import program_meta

V = 128
# torchtitan's GroupedExperts compute in bfloat16 whatever the model's dtype: a
# dispatched token meets its experts in another order than on one device, so the
# bf16 sums of the expert weights' gradients round differently (~1e-5).
ATOL = 1e-4


def _data(b=4, s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, s), generator=g), torch.randint(0, V, (b, s), generator=g)


IDS, TGT = _data()


def titan_plan(factory, mesh):
    return fxshard.Plan.from_torchtitan(mesh, factory())


def starved_deepseek_v3():
    """Sigmoid routing (DeepSeek-V3 671B's) with torchtitan's load-balancing bias
    pushing experts 2 and 3 out of every top-k: rank 1 of ep=2 receives no token."""
    model = tiny_deepseek_v3(score_func="sigmoid")
    for layer in model.layers.values():
        if getattr(layer, "moe", None) is not None:
            layer.moe.expert_bias_E[2:] = -1e4
    return model


def _check_dispatch(sharded, mesh, rank, world_size):
    """One count exchange, dispatch and combine per MoE layer forward, the dispatch's
    and combine's mirror backward; a full checkpoint gathers every expert back."""
    n_moe = sum(1 for layer in tiny_deepseek_v3().layers.values() if getattr(layer, "moe", None) is not None)
    ids = IDS.chunk(world_size)[rank]
    with CountAllToAll() as fwd:
        out = sharded(ids)
    with CountAllToAll() as bwd:
        out.float().pow(2).mean().backward()
    assert (fwd.calls, bwd.calls) == (3 * n_moe, 2 * n_moe), (fwd.calls, bwd.calls)
    full = fxshard.full_state_dict(sharded)
    single = tiny_deepseek_v3().state_dict()
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in single.items()}
    w1 = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
    torch.testing.assert_close(full[w1].chunk(world_size)[rank], sharded.get_parameter(w1).detach())


def _case(factory, name, **kw):
    return Case(factory, functools.partial(titan_plan, factory), (IDS,), {"ep": 2}, loss_fn=cross_entropy,
                targets=(TGT,), lr=0.5, atol=ATOL, name=name, **kw)


def test_torchtitan_moe_ep2_real():
    check_real_cases(2, [
        _case(tiny_qwen3_moe, "torchtitan Qwen3-MoE ep=2"),
        _case(tiny_deepseek_v3, "torchtitan DeepSeek-V3 ep=2 (shared experts)", post=_check_dispatch),
        _case(starved_deepseek_v3, "torchtitan DeepSeek-V3 ep=2, sigmoid routing, rank 1's experts get no token"),
    ])


def test_torchtitan_moe_plan_transforms_offline():
    """The converted plan on a mesh spec: the MoE blocks are expert-parallel regions
    whose experts hold their ep shard; the dense first layer is untouched."""
    plan = fxshard.Plan.from_torchtitan(fxshard.MeshSpec(("ep",), (2,)), tiny_deepseek_v3())
    sharded = fxshard.transform(tiny_deepseek_v3(), plan, example_inputs=(IDS,))
    assert program_meta(sharded).captured_by == "torch.export"
    w1 = sharded.get_parameter("layers.1.moe.routed_experts.inner_experts.w1_EFD")
    assert tuple(w1.shape) == (2, 32, 64)  # 4 experts, 2 per rank
    assert tuple(sharded.get_parameter("layers.0.feed_forward.w1.weight").shape) == (128, 64)
    assert "autocast" not in sharded.code  # the router's float32 autocast casts nothing on CPU: inlined
