"""GPT-2 and fused-projection Llama with deferred biases, vocab-parallel embeddings,
sequence parallel and loss parallel: equal to the single-device model, exactly."""
import functools

import pytest
import torch

import fxshard
from equivalence import Case, check_real_cases, check_simulated, cross_entropy, weighted_sum
from fxshard import Plan
from fxshard.testing.models import LlamaArgs, WithLoss, gpt2, gpt2_plan, llama, llama_plan, tokens

V = 128


# Top-level factories: the real-process checks pickle them.
def gpt2_with_loss(tied):
    return WithLoss(gpt2(tied=tied))


def gpt2_50257_with_loss(tied):
    """GPT-2's real vocabulary, which no tp size divides: 50257 = 4 x 12564 + 1."""
    return WithLoss(gpt2(tied=tied, vocab_size=50257))


def gpt2_logits(tied):
    return gpt2(tied=tied)


def fused_llama_with_loss():
    return WithLoss(llama(n_heads=8, n_kv_heads=4, fused_qkv=True, fused_w13=True))


def gpt2_loss_plan(mesh, sp):
    return Plan(mesh, {"model." + k: v for k, v in gpt2_plan(sequence_parallel=sp, loss_parallel=True).items()})


def gpt2_logits_plan(mesh, sp):
    return Plan(mesh, gpt2_plan(sequence_parallel=sp))


def fused_llama_plan(mesh, sp):
    args = LlamaArgs(n_heads=8, n_kv_heads=4)
    plan = llama_plan(fused=True, sequence_parallel=sp, loss_parallel=True, args=args)
    return Plan(mesh, {"model." + k: v for k, v in plan.items()})


def _loss_case(model, plan, mesh_shape, **kw):
    ids, tgt = tokens(2, 8, V, seed=0), tokens(2, 8, V, seed=1)
    tgt[1, :2] = -100  # ignored tokens take part too
    return Case(model, plan, (ids, tgt), mesh_shape, loss_fn=weighted_sum, targets=(torch.tensor(1.0),), **kw)


def _vocab_50257_case(tied, mesh_shape, **kw):
    ids, tgt = tokens(2, 8, 50257, seed=0), tokens(2, 8, 50257, seed=1)
    ids[0, :4] = torch.tensor([0, 12565, 37694, 50256])  # first and last rows, either side of a rank's boundary
    tgt[0, :4] = torch.tensor([12564, 37695, 50256, 0])
    tgt[1, :2] = -100
    return Case(functools.partial(gpt2_50257_with_loss, tied), functools.partial(gpt2_loss_plan, sp=False), (ids, tgt),
                mesh_shape, loss_fn=weighted_sum, targets=(torch.tensor(1.0),), **kw)


def _logits_case(model, plan, mesh_shape, **kw):
    ids, tgt = tokens(2, 8, V, seed=0), tokens(2, 8, V, seed=1)
    return Case(model, plan, (ids,), mesh_shape, loss_fn=cross_entropy, targets=(tgt,), **kw)


def _simulate(case: Case):
    check_simulated(case.model_factory, case.plan_factory, case.inputs, case.mesh_shape,
                    loss_fn=case.loss_fn, targets=case.targets)


@pytest.mark.parametrize("tp,tied,sp", [(2, False, False), (2, True, True), (4, False, True), (4, True, False)])
def test_gpt2_loss_parallel_simulated(tp, tied, sp):
    _simulate(_loss_case(functools.partial(gpt2_with_loss, tied), functools.partial(gpt2_loss_plan, sp=sp), {"tp": tp}))


@pytest.mark.parametrize("sp", [False, True])
def test_gpt2_logits_simulated(sp):
    _simulate(_logits_case(functools.partial(gpt2_logits, False), functools.partial(gpt2_logits_plan, sp=sp), {"tp": 2}))


@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])
def test_fused_llama_simulated(tp, sp):
    _simulate(_loss_case(fused_llama_with_loss, functools.partial(fused_llama_plan, sp=sp), {"tp": tp}))


def test_split_of_a_fused_weight_needs_splits():
    model = llama(fused_qkv=True)
    with pytest.raises(fxshard.PlanError, match=r"colwise\('tp', splits=\[64, 32, 32\]\)"):
        fxshard.transform(model, Plan(fxshard.MeshSpec(("tp",), (2,)), {"layers.*.attention.wqkv": fxshard.colwise()}),
                          (tokens(1, 4, V),))


def test_bad_splits_are_plan_errors():
    model = llama(fused_qkv=True)
    mesh = fxshard.MeshSpec(("tp",), (2,))
    with pytest.raises(fxshard.PlanError, match="add up to 96"):
        fxshard.transform(model, Plan(mesh, {"layers.*.attention.wqkv": fxshard.colwise(splits=[64, 16, 16])}), (tokens(1, 4, V),))
    with pytest.raises(fxshard.PlanError, match=r"into pieces \[64, 32, 32\] \(its parts are \[62, 34, 32\]\)"):
        fxshard.transform(model, Plan(fxshard.MeshSpec(("tp",), (4,)), {"layers.*.attention.wqkv": fxshard.colwise(splits=[62, 34, 32])}),
                          (tokens(1, 4, V),))


def test_real_tp2():
    check_real_cases(2, [
        _loss_case(functools.partial(gpt2_with_loss, True), functools.partial(gpt2_loss_plan, sp=True), {"tp": 2}, name="gpt2 tied sp lp"),
        _loss_case(functools.partial(gpt2_with_loss, False), functools.partial(gpt2_loss_plan, sp=False), {"tp": 2}, name="gpt2 lp"),
        _logits_case(functools.partial(gpt2_logits, False), functools.partial(gpt2_logits_plan, sp=True), {"tp": 2}, name="gpt2 sp logits"),
        _loss_case(fused_llama_with_loss, functools.partial(fused_llama_plan, sp=True), {"tp": 2}, name="fused llama sp lp"),
    ])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_vocab_50257_tp4_vocab_parallel_and_loss_parallel_simulated(tied):
    """Ranks hold 12565, 12565, 12565 and 12562 rows of the embedding (and of the tied head):
    the lookups, the loss and every gradient equal one device's; the code is the same on every rank."""
    _simulate(_vocab_50257_case(tied, {"tp": 4}))
    sharded = fxshard.transform(gpt2_50257_with_loss(tied), gpt2_loss_plan(fxshard.MeshSpec(("tp",), (4,)), sp=False),
                                _vocab_50257_case(tied, {"tp": 4}).inputs)
    assert sharded.model.wte.vocab_start.tolist() == [0] and "vocab_size = 50257" in sharded.code
    assert "12565" not in sharded.code and "12562" not in sharded.code  # no rank's local size is a literal


def test_real_tp4():
    check_real_cases(4, [
        _vocab_50257_case(True, {"tp": 4}, name="gpt2 vocab 50257 lp tp4"),
        _loss_case(functools.partial(gpt2_with_loss, False), functools.partial(gpt2_loss_plan, sp=True), {"tp": 4}, name="gpt2 sp lp tp4"),
        _loss_case(fused_llama_with_loss, functools.partial(fused_llama_plan, sp=False), {"tp": 4}, name="fused llama lp tp4"),
    ])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sp", [False, True])
def test_gpt2_sweep_simulated(tp, tied, sp):
    _simulate(_loss_case(functools.partial(gpt2_with_loss, tied), functools.partial(gpt2_loss_plan, sp=sp), {"tp": tp}))
