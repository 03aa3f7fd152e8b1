"""defer_bias: a row-parallel linear drops its bias; the bias is added once after the
module's reduction (sliced when the reduction scatters onto the bias dim)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard import MeshSpec, Plan, PlanError, colwise, rowwise
from fxshard.runtime import collectives as runtime
from fxshard.markers import region_output
from fxshard.meta import KEY

X = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))


def _plan(out):
    return Plan(MeshSpec(("tp",), (2,)), {"fc1": colwise(), "fc2": rowwise(out=out)})


def _model():
    from fxshard.testing.models import mlp
    return mlp(dim=32, hidden=64)


def _fc2(gm):
    return [n for n in gm.graph.nodes if n.target is F.linear][1]


def test_bias_added_once_after_the_reduction(before_pass, after_pass):
    before = _fc2(before_pass("defer_bias", _model(), _plan(Replicate()), (X,)))
    assert before.args[2].target == "fc2.bias"
    gm = after_pass("defer_bias", _model(), _plan(Replicate()), (X,))
    lin = _fc2(gm)
    assert len(lin.args) == 2 and not lin.kwargs, "the linear no longer adds the bias"
    (marker,) = lin.users
    assert marker.target is region_output and marker.meta[KEY].redistribute == ({"tp": Partial()}, {"tp": Replicate()})
    (add,) = marker.users
    assert add.target is operator.add and add.args[1].target == "fc2.bias"
    assert add.meta[KEY].rule == "deferred bias" and add.meta[KEY].value.layout == {"tp": Replicate()}
    assert [n.op for n in add.users] == ["output"]


def test_reduce_scatter_onto_the_bias_dim_slices_the_bias(after_pass):
    gm = after_pass("defer_bias", _model(), _plan(Shard(-1)), (X,))
    add = next(n for n in gm.graph.nodes if n.meta.get(KEY) and n.meta[KEY].rule == "deferred bias")
    sliced = add.args[1]
    assert sliced.target is runtime.shard and sliced.args[0].target == "fc2.bias" and sliced.args[1:] == ("tp", 0)
    assert sliced.meta[KEY].value.local_shape == (16,)
    assert add.meta[KEY].value.local_shape == (2, 4, 16)


def test_reduce_scatter_onto_another_dim_keeps_the_bias(after_pass):
    gm = after_pass("defer_bias", _model(), _plan(Shard(1)), (X,))
    add = next(n for n in gm.graph.nodes if n.meta.get(KEY) and n.meta[KEY].rule == "deferred bias")
    assert add.args[1].op == "get_attr" and add.meta[KEY].value.local_shape == (2, 2, 32)


def test_partial_output_with_a_bias_is_an_error():
    import fxshard

    with pytest.raises(PlanError) as err:
        fxshard.transform(_model(), _plan(Partial()), (X,))
    msg = str(err.value)
    assert "fc2" in msg and "bias" in msg and "rowwise(out=Replicate())" in msg
