"""Parameter-free ``torch.nn`` leaves (``nn.Identity``, ``nn.Dropout``, activation
modules, ``nn.Flatten``, a loss module) in a torch.fx capture are pure functions:
``normalize`` inlines their forward, so layouts flow through them and the sharded
program equals the single-device one.  A leaf fxshard really cannot see inside (a
user's own leaf, a torch.nn module whose forward does not trace) is still refused."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import fxshard
from equivalence import Case, check_real_cases, check_simulated
from fxshard import MeshSpec, ModuleSpec, Plan, PlanError, colwise, rowwise

TP2 = MeshSpec(("tp",), (2,))


class LeafMLP(nn.Module):
    """A column- and a row-parallel linear with trivial leaves between and after them,
    one of them called with a keyword argument."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.id = nn.Identity()
        self.drop = nn.Dropout(0.0)
        self.act = nn.GELU()
        self.flat = nn.Flatten(0, 1)
        self.fc2 = nn.Linear(32, 16)
        self.out = nn.Identity()

    def forward(self, x):
        h = self.drop(self.id(self.fc1(x)))
        h = self.flat(self.act(input=h))
        return self.out(self.fc2(h))


class Opaque(nn.Module):
    """A user's leaf: fxshard is told not to look inside it."""

    def forward(self, x):
        return x * torch.sigmoid(x)


class WithOpaque(nn.Module):
    def __init__(self, leaf: nn.Module):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.leaf = leaf
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(self.leaf(self.fc1(x)))


def make_model():
    torch.manual_seed(0)
    return LeafMLP()


def make_plan(mesh):
    return Plan(mesh, {"fc1": colwise(), "fc2": rowwise()})


def make_plan_gathered_at_a_leaf(mesh):
    """The activation module's output is gathered (a boundary on an inlined leaf), the
    row-parallel linear takes it Replicate and keeps its own columns."""
    return Plan(mesh, {"fc1": colwise(), "act": ModuleSpec(out_dst={"tp": Replicate()}),
                       "fc2": rowwise(inputs=Replicate())})


X = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))


def test_trivial_leaves_are_inlined_and_readable():
    gm = fxshard.trace(make_model(), make_plan(TP2), (X,), capture="fx")
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["fc1", "id", "drop", "act", "flat", "fc2", "out"]
    sharded = fxshard.transform(gm, make_plan(TP2))
    assert not [n for n in sharded.graph.nodes if n.op == "call_module"]
    code = sharded.code
    assert "self.id" not in code and "self.out" not in code  # nn.Identity leaves no node at all
    assert "dropout(" in code and "gelu(" in code and ".flatten(0, 1)" in code
    gelu = next(n for n in sharded.graph.nodes if n.target is F.gelu)
    assert list(gelu.meta["nn_module_stack"])[-1] == "act"  # the inlined body keeps its module and source line
    assert "x * torch" not in code and gelu.meta["stack_trace"]


def test_trivial_leaves_simulated():
    check_simulated(make_model, make_plan, (X,), {"tp": 2})
    check_simulated(make_model, make_plan_gathered_at_a_leaf, (X,), {"tp": 2})


def test_trivial_leaves_real_gloo():
    check_real_cases(2, [Case(make_model, make_plan, (X,), {"tp": 2}, name="leaves between colwise and rowwise"),
                         Case(make_model, make_plan_gathered_at_a_leaf, (X,), {"tp": 2}, name="boundary on an inlined leaf")])


class _KeepOpaque(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Opaque) or super().is_leaf_module(m, qualname)


def test_a_users_leaf_is_still_refused():
    model = WithOpaque(Opaque())
    gm = fx.GraphModule(model, _KeepOpaque().trace(model))
    with pytest.raises(PlanError, match="cannot see inside this module call") as e:
        fxshard.transform(gm, make_plan(TP2), example_inputs=(X,))
    assert "module leaf (Opaque)" in str(e.value)


def test_a_torch_leaf_that_does_not_trace_is_still_refused():
    # nn.Softmax2d branches on its input's dim: fx cannot trace it, so it stays a leaf
    with pytest.raises(PlanError, match="cannot see inside this module call"):
        fxshard.transform(WithOpaque(nn.Softmax2d()), make_plan(TP2), example_inputs=(X,), capture="fx")


class LossHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = nn.Linear(16, 32, bias=False)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.loss(self.lm(x).flatten(0, 1), y)


def _loss_head():
    torch.manual_seed(1)
    return LossHead()


def test_a_loss_module_on_vocab_sharded_logits_is_loss_parallel():
    """The inlined F.cross_entropy of nn.CrossEntropyLoss meets vocab-sharded logits:
    loss parallel, no gather of the logits, and the single-device loss."""
    y = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(4))
    sharded = check_simulated(_loss_head, lambda mesh: Plan(mesh, {"lm": colwise(out=Shard(-1))}), (X, y), {"tp": 2},
                              loss_fn=lambda loss: loss, replicated_loss=True)
    assert "vocab_parallel_cross_entropy" in sharded.code and "all_gather" not in sharded.code
