"""A 2-layer MLP with biases, planned with hand-written ModuleSpecs (no presets):
fc1 column-parallel, fc2 row-parallel with its bias added once after the reduction.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard import ModuleSpec, Plan
from fxshard.testing.models import mlp

from equivalence import Case, check_real_cases, check_simulated
from harness import plain, rank_map, rank_value, simulated
from fxshard.meta import program_meta

DIM, HIDDEN = 32, 64
X = torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(0))
X30 = torch.randn(4, 8, 30, generator=torch.Generator().manual_seed(1))

make_mlp = functools.partial(mlp, seed=0, dim=DIM, hidden=HIDDEN)


def fc1_spec(axis: str = "tp") -> ModuleSpec:
    """Column-parallel: weight and bias split by rows, input replicated, output sharded
    on the hidden dim (and left sharded for fc2)."""
    return ModuleSpec(params={"weight": {axis: Shard(0)}, "bias": {axis: Shard(0)}},
                      inputs={axis: Replicate()}, out_src={axis: Shard(-1)})


def fc2_spec(axis: str = "tp", out=Replicate()) -> ModuleSpec:
    """Row-parallel: weight split by columns, bias replicated (deferred past the
    reduction), output produced Partial and redistributed to ``out``."""
    return ModuleSpec(params={"weight": {axis: Shard(1)}}, inputs={axis: Shard(-1)},
                      out_src={axis: Partial()}, out_dst={axis: out})


def mlp_plan(mesh, out=Replicate(), batch_on_dp: bool = False):
    return Plan(mesh, {"fc1": fc1_spec(), "fc2": fc2_spec(out=out)},
                inputs={"x": {"dp": Shard(0)}} if batch_on_dp else None)


OUTS = {"replicate": Replicate(), "shard_seq": Shard(1), "shard_feature": Shard(-1)}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("out", list(OUTS))
def test_mlp_simulated(tp, out):
    """Output all-reduced, or reduce-scattered on the sequence dim or on the bias dim
    (then each rank adds its slice of the bias)."""
    check_simulated(make_mlp, functools.partial(mlp_plan, out=OUTS[out]), (X,), {"tp": tp}, lr=0.2)


def test_mlp_dp_tp_simulated():
    check_simulated(make_mlp, functools.partial(mlp_plan, batch_on_dp=True), (X,), {"dp": 2, "tp": 2}, lr=0.2)


def test_mlp_real():
    """4 gloo ranks: tp=4 (replicated and feature-sharded output), dp=2 x tp=2 with
    the batch sharded on dp (tp=2 groups), and a hidden size 4 does not divide."""
    check_real_cases(4, [
        Case(make_mlp, mlp_plan, (X,), {"tp": 4}, lr=0.2, name="tp=4"),
        Case(make_mlp, functools.partial(mlp_plan, out=Shard(-1)), (X,), {"tp": 4}, lr=0.2, name="tp=4 out S(-1)"),
        Case(make_mlp, functools.partial(mlp_plan, batch_on_dp=True), (X,), {"dp": 2, "tp": 2}, lr=0.2, name="dp=2 x tp=2"),
        # width and hidden 30 on 4 ranks: torch.chunk pieces 8, 8, 8, 6; the output reduce-scattered
        # into them and the gradient all-gathered back, padded on the wire
        Case(functools.partial(mlp, seed=0, dim=30, hidden=30), functools.partial(mlp_plan, out=Shard(-1)), (X30,), {"tp": 4},
             lr=0.2, name="tp=4 width 30"),
    ])


# ----------------------------------------------------------------------------- exact bias


def _integer_mlp() -> nn.Module:
    """float64, integer-valued weights and ReLU: every sum is exact, in any order."""
    model = mlp(seed=0, dim=DIM, hidden=HIDDEN, act="relu").double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, generator=g).double())
    return model


@pytest.mark.parametrize("tp", [2, 4])
def test_deferred_bias_is_exact(tp):
    """The sharded output and bias gradient are bit-identical to one device's: the bias
    is added once, after the all-reduce (no ``b / n`` share per rank)."""
    model = _integer_mlp()
    x = torch.randint(-3, 4, (4, 8, DIM), generator=torch.Generator().manual_seed(2)).double()
    want = model(x)
    want.sum().backward()
    with simulated({"tp": tp}) as mesh:
        sharded = fxshard.transform(model, mlp_plan(mesh), (x,))
        out = sharded(rank_map(lambda r: x.clone()))
        out.sum().backward()
        bias_grad = sharded.get_parameter("fc2.bias").grad
        for r in range(tp):
            with plain():
                assert torch.equal(rank_value(out, r), want), f"rank {r}: output differs"
                assert torch.equal(rank_value(bias_grad, r), model.fc2.bias.grad), f"rank {r}: fc2.bias grad differs"
    bias = next(n for n in sharded.graph.nodes if n.op == "get_attr" and n.target == "fc2.bias")
    (add,) = bias.users
    assert [a.target for a in add.args if a is not bias] == [fxshard.all_reduce], "bias must be added after the all-reduce"


@pytest.mark.parametrize("hidden,tp", [(30, 4), (10, 3), (7, 4)], ids=["30 on 4", "10 on 3", "7 on 4"])
def test_hidden_the_axis_does_not_divide_simulated(hidden, tp):
    """torch.chunk pieces (8, 8, 8, 6 of 30): exact forward, backward and SGD steps; the
    generated code is the same on every rank (no local size in it)."""
    sharded = check_simulated(functools.partial(mlp, seed=0, dim=DIM, hidden=hidden), mlp_plan, (X,), {"tp": tp})
    layout, shape = program_meta(sharded).state["fc1.weight"]
    assert shape == (hidden, DIM) and layout == {"tp": Shard(0)}


@pytest.mark.parametrize("out", [Replicate(), Shard(-1)], ids=["all-reduce", "reduce-scatter"])
def test_uneven_output_gathered_or_scattered_simulated(out):
    """fc2's output dim (30) cut unevenly: a padded reduce-scatter, gathered back in the test."""
    check_simulated(functools.partial(mlp, seed=0, dim=30, hidden=HIDDEN), functools.partial(mlp_plan, out=out), (X30,), {"tp": 4})


def test_a_rank_left_without_a_piece_is_a_plan_error():
    """5 on 4 ranks would be 2, 2, 1, 0: a rank without hidden units (and a -1 in a view could not infer)."""
    with pytest.raises(fxshard.PlanError, match=r"leaves ranks without a piece \(2, 2, 1, 0\)"):
        fxshard.transform(mlp(seed=0, dim=DIM, hidden=5), mlp_plan(fxshard.MeshSpec(("tp",), (4,))), (X,))
