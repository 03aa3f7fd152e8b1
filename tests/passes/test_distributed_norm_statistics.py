"""distributed_norm: a norm over a dim sharded by a colwise projection all-reduces its
[..., 1] statistics instead of gathering its input; exact forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan, PlanError, colwise, distributed_norm, rowwise
from fxshard.markers import region_output
from fxshard.meta import KEY

from equivalence import check_simulated

X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))


class WrittenOutRMSNorm(nn.Module):
    """OLMo2's / Llama's RMS norm, written with pow and mean as HF writes it."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


class QNorm(nn.Module):
    """A projection normalized over its whole (sharded) width, then projected back."""

    def __init__(self, norm: str, dim: int = 16, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj = nn.Linear(dim, width)
        self.q_norm = {"written": lambda: WrittenOutRMSNorm(width), "rms": lambda: nn.RMSNorm(width, eps=1e-6),
                       "layer": lambda: nn.LayerNorm(width)}[norm]()
        with torch.no_grad():
            for p in self.q_norm.parameters():
                p.normal_()
        self.o_proj = nn.Linear(width, dim)

    def forward(self, x):
        return self.o_proj(torch.tanh(self.q_norm(self.q_proj(x))))


def _plan(mesh):
    return Plan(mesh, {"q_proj": colwise(), "q_norm": distributed_norm(), "o_proj": rowwise()})


def _forward_collectives(gm):
    return [(n.target.__name__, tuple(n.meta["val"].shape)) for n in gm.graph.nodes
            if n.op == "call_function" and KEY in n.meta and n.meta[KEY].collective is not None
            and n.target.__name__ in ("all_reduce", "all_gather", "reduce_scatter")]


@pytest.mark.parametrize("norm,stats", [("written", 1), ("rms", 1), ("layer", 2)])
def test_exact_with_all_reduced_statistics(norm, stats):
    gm = check_simulated(lambda: QNorm(norm), _plan, (X,), {"tp": 2})
    calls = _forward_collectives(gm)
    assert calls.count(("all_reduce", (2, 5, 1))) == stats, calls  # statistics only: no activation is gathered
    assert calls.count(("all_reduce", (2, 5, 16))) == 1  # o_proj's own reduction
    assert len(calls) == stats + 1
    assert "grad_sync" in gm.code  # backward: the gradient of each replicated statistic is summed


def test_statistic_markers_reduce_only_what_is_partial(after_pass):
    gm = after_pass("propagate", QNorm("layer"), _plan(MeshSpec(("tp",), (2,))), (X,))
    markers = [n for n in gm.graph.nodes if n.target is region_output and n.meta[KEY].declared.kind == "statistic"]
    assert len(markers) == 2
    for m in markers:
        assert m.meta[KEY].redistribute == ({"tp": Partial("avg")}, {"tp": Replicate()})
    assert not [n for n in gm.graph.nodes if n.target is F.layer_norm], "the norm is written out as its means"


def test_replicated_input_keeps_the_norm_local():
    """On a 2-D mesh the norm's statistics are reduced on the axis that shards the width only."""
    plan = lambda mesh: Plan(mesh, {"q_proj": colwise(), "q_norm": distributed_norm(), "o_proj": rowwise()},
                             inputs={"x": {"dp": Shard(0)}})
    gm = check_simulated(lambda: QNorm("rms"), plan, (X,), {"dp": 2, "tp": 2})
    axes = {n.args[1] for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "all_reduce"}
    assert axes == {"tp"}


def test_half_precision_statistics_in_float32():
    gm = fxshard.transform(QNorm("rms").to(torch.bfloat16), _plan(MeshSpec(("tp",), (2,))), example_inputs=(X.bfloat16(),))
    means = [n for n in gm.graph.nodes if n.target == "mean"]
    assert means and all(n.meta["val"].dtype == torch.float32 for n in means)


def test_partial_input_is_a_plan_error():
    model = QNorm("rms")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = Plan(MeshSpec(("tp",), (2,)), {"q_proj": ModuleSpec(params={"weight": {"tp": Shard(1)}}, inputs={"tp": Shard(-1)},
                                                                out_src={"tp": Partial()}),
                                          "q_norm": distributed_norm(), "o_proj": rowwise()})
    with pytest.raises(PlanError, match=r"(?s)module 'q_norm'.*unreduced.*reduce it before module 'q_norm'"):
        fxshard.transform(model, plan, example_inputs=(X,))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the input model is untouched"


def test_norm_over_a_sharded_dim_without_the_preset_names_it():
    plan = Plan(MeshSpec(("tp",), (2,)), {"q_proj": colwise(), "o_proj": rowwise()})
    with pytest.raises(PlanError, match=r"(?s)module q_norm.*`mean` reduces dim 2.*distributed_norm\('tp'\)"):
        fxshard.transform(QNorm("written"), plan, example_inputs=(X,))
    with pytest.raises(PlanError, match=r"distributed_norm\('tp'\)"):
        fxshard.transform(QNorm("layer"), plan.replace(specs={**plan.specs, "q_norm": ModuleSpec(params={"weight": {"tp": Shard(0)}})}),
                          example_inputs=(X,))


def test_unknown_axis():
    with pytest.raises(PlanError, match="distributed_norm axis 'cp' is not an axis"):
        Plan(MeshSpec(("tp",), (2,)), {"q_norm": distributed_norm("cp")})
