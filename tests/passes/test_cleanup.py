"""cleanup: a shard that undoes an all-gather goes (with it), dead nodes go, the
graph lints and its code is regenerated."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

import fxshard
from fxshard import MeshSpec, Plan, colwise, rowwise
from fxshard.runtime import collectives as runtime
from fxshard.testing.models import llama, llama_plan, tokens

from equivalence import check_simulated

X = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _two_linear():
    torch.manual_seed(0)
    return TwoLinear()


def _plan(mesh):
    """fc1 gathers its output, fc2 slices it again on entry: a redundant pair."""
    return Plan(mesh, {"fc1": colwise(out=Replicate()), "fc2": rowwise(inputs=Replicate())})


def _targets(gm):
    return [n.target for n in gm.graph.nodes]


def test_gather_then_shard_is_removed(before_pass):
    before = before_pass("cleanup", _two_linear(), _plan(MeshSpec(("tp",), (2,))), (X,))
    assert runtime.all_gather in _targets(before) and runtime.shard in _targets(before)
    after = fxshard.transform(_two_linear(), _plan(MeshSpec(("tp",), (2,))), (X,))
    assert runtime.all_gather not in _targets(after) and runtime.shard not in _targets(after)
    assert _targets(after).count(runtime.all_reduce) == 1


def test_without_the_pair_the_program_is_still_right_simulated():
    sharded = check_simulated(_two_linear, _plan, (X,), {"tp": 2}, lr=0.2)
    assert runtime.all_gather not in _targets(sharded)


def test_no_dead_nodes_and_regenerated_code():
    sharded = fxshard.transform(llama(), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (tokens(2, 8, 128),))
    sharded.graph.lint()
    dead = [n.name for n in sharded.graph.nodes if n.op not in ("output", "placeholder") and not n.users]
    assert dead == []
    assert "region_input" not in sharded.code and "region_output" not in sharded.code
    assert "fxshard_all_reduce(" in sharded.code and "fxshard_grad_sync(" in sharded.code
