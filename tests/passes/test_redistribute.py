"""redistribute: every declared layout change becomes explicit collective nodes, one
mesh axis at a time, called with the axis name."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan, colwise, rowwise
from fxshard.runtime import collectives as runtime
from fxshard.markers import is_marker
from fxshard.meta import KEY
from fxshard.testing.models import mlp

from equivalence import check_simulated

X = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))
make_mlp = functools.partial(mlp, dim=32, hidden=64)
R = Replicate()

# name -> (plan entries, the collectives the plan asks for: (op, args after x))
ONE_AXIS = {
    "P->R": ({"fc1": colwise(), "fc2": rowwise()}, [(runtime.all_reduce, ("tp",))]),
    "P->S(1)": ({"fc1": colwise(), "fc2": rowwise(out=Shard(1))}, [(runtime.reduce_scatter, ("tp", 1))]),
    "S->R": ({"fc1": colwise(out=Replicate())}, [(runtime.all_gather, ("tp", 2))]),
    "R->S": ({"fc2": rowwise(inputs=Replicate())}, [(runtime.shard, ("tp", 2)), (runtime.all_reduce, ("tp",))]),
    "S(2)->S(1)": ({"fc1": colwise(out=Shard(1))}, [(runtime.all_to_all, ("tp", 2, 1))]),
}

_2D = ("dp", "tp")
TWO_AXES = {
    # gathers run from the innermost axis out, so the tp chunks nest inside the dp chunks
    "S,S->R,R": ({"fc1": ModuleSpec(params={"weight": {a: Shard(0) for a in _2D}, "bias": {a: Shard(0) for a in _2D}},
                                    inputs={a: R for a in _2D}, out_src={a: Shard(-1) for a in _2D},
                                    out_dst={a: R for a in _2D})},
                 [(runtime.all_gather, ("tp", 2)), (runtime.all_gather, ("dp", 2))]),
    # local slices from the outer axis in; reductions from the inner axis out
    "R,R->S,S ... P,P->R,R": ({"fc2": ModuleSpec(params={"weight": {a: Shard(1) for a in _2D}},
                                                 inputs={a: Shard(-1) for a in _2D},
                                                 out_src={a: Partial() for a in _2D}, out_dst={a: R for a in _2D})},
                              [(runtime.shard, ("dp", 2)), (runtime.shard, ("tp", 2)),
                               (runtime.all_reduce, ("tp",)), (runtime.all_reduce, ("dp",))]),
}


def _collectives(gm):
    ops = (runtime.all_reduce, runtime.reduce_scatter, runtime.all_gather, runtime.shard, runtime.all_to_all)
    return [(n.target, n.args[1:]) for n in gm.graph.nodes if n.target in ops]


def _check_structure(gm, want):
    assert not any(is_marker(n) for n in gm.graph.nodes), "markers are replaced"
    assert _collectives(gm) == want
    for n in gm.graph.nodes:
        if n.target in [op for op, _ in want]:
            coll = n.meta[KEY].collective
            assert coll is not None and coll.axis == n.args[1] and coll.purpose, n.name


@pytest.mark.parametrize("case", list(ONE_AXIS))
def test_one_axis(case, after_pass):
    specs, want = ONE_AXIS[case]
    _check_structure(after_pass("redistribute", make_mlp(), Plan(MeshSpec(("tp",), (2,)), specs), (X,)), want)
    check_simulated(make_mlp, lambda mesh: Plan(mesh, specs), (X,), {"tp": 2}, lr=0.2)


@pytest.mark.parametrize("case", list(TWO_AXES))
def test_two_axes_one_at_a_time(case, after_pass):
    specs, want = TWO_AXES[case]
    _check_structure(after_pass("redistribute", make_mlp(), Plan(MeshSpec(_2D, (2, 2)), specs), (X,)), want)
    check_simulated(make_mlp, lambda mesh: Plan(mesh, specs), (X,), {"dp": 2, "tp": 2}, lr=0.2)


def test_unchanged_boundaries_leave_no_node(before_pass, after_pass):
    """A marker whose layout does not change (colwise input already Replicate) just goes."""
    plan = Plan(MeshSpec(("tp",), (2,)), {"fc1": colwise(), "fc2": rowwise()})
    before = before_pass("redistribute", make_mlp(), plan, (X,))
    after = after_pass("redistribute", make_mlp(), plan, (X,))
    markers = [n for n in before.graph.nodes if is_marker(n)]
    changing = [n for n in markers if n.meta[KEY].redistribute is not None]
    assert len(markers) == 4 and len(changing) == 1
    assert len(after.graph.nodes) == len(before.graph.nodes) - len(markers) + len(changing)


class _MeanPool(torch.nn.Module):
    def forward(self, h):
        return h.mean(-1)


class _PoolHead(torch.nn.Module):
    """A column-parallel projection, then a mean over its sharded features (Partial("avg"))."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 16)
        self.pool = _MeanPool()

    def forward(self, x):
        return self.pool(self.proj(x))


def test_partial_avg_is_all_reduced_as_a_mean():
    """A mean over a sharded dim is Partial("avg"): ``all_reduce(x, "tp", "avg")``, whose
    backward scales by 1/n (the weight each rank's share had in the mean)."""
    specs = {"proj": colwise(out=Shard(-1)), "pool": ModuleSpec(inputs={"tp": Shard(-1)}, out_dst={"tp": R})}
    gm = fxshard.transform(_PoolHead(), Plan(MeshSpec(("tp",), (2,)), specs), example_inputs=(X,))
    assert _collectives(gm) == [(runtime.all_reduce, ("tp", "avg"))]
    check_simulated(_PoolHead, lambda mesh: Plan(mesh, specs), (X,), {"tp": 2}, lr=0.2)
    check_simulated(_PoolHead, lambda mesh: Plan(mesh, specs), (X,), {"tp": 4}, lr=0.2)
