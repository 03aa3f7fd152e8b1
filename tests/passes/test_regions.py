"""regions: the plan attached to the graph (regions, declared layouts, boundaries)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard.runtime import collectives as runtime

from fxshard import MeshSpec, Plan
from fxshard.markers import region_input, region_output
from fxshard.meta import KEY, Boundary
from fxshard.testing.models import llama, llama_plan, tokens

MESH = MeshSpec(("dp", "tp"), (2, 2))
IDS = tokens(4, 8, 128)
R = Replicate()


def _plan():
    return Plan(MESH, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})


def _by_target(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


def test_regions_adds_no_nodes(before_pass, after_pass):
    model = llama()
    assert before_pass("regions", model, _plan(), (IDS,)).code == after_pass("regions", model, _plan(), (IDS,)).code


def test_declared_layouts_of_params_and_inputs(after_pass):
    gm = after_pass("regions", llama(), _plan(), (IDS,))
    d = lambda target: _by_target(gm, target).meta[KEY].declared
    assert d("tokens") == {"dp": Shard(0), "tp": R}
    assert d("layers.0.attention.wq.weight") == {"dp": R, "tp": Shard(0)}
    assert d("layers.1.feed_forward.w2.weight") == {"dp": R, "tp": Shard(1)}
    assert d("layers.0.attention_norm.weight") == {"dp": R, "tp": R}  # not in the plan: complete Replicate
    assert d("tok_embeddings.weight") == {"dp": R, "tp": R}


def test_boundaries_hold_only_the_axes_the_plan_names(after_pass):
    """A "tp" preset on a dp x tp mesh says nothing about dp: the batch sharding on
    dp passes through the module boundary untouched."""
    gm = after_pass("regions", llama(), _plan(), (IDS,))
    marks = {(n.target, n.args[1]): n.meta[KEY].declared for n in gm.graph.nodes if n.target in (region_input, region_output)}
    wq_in = marks[(region_input, "layers.0.attention.wq")]
    assert isinstance(wq_in, Boundary) and wq_in.kind == "input" and wq_in.name == "input"
    assert wq_in.required == {"tp": R} and wq_in.expected == {"tp": R}
    wo_out = marks[(region_output, "layers.1.attention.wo")]
    assert wo_out.kind == "output" and wo_out.src == {"tp": Partial()} and wo_out.dst == {"tp": R}
    assert len(marks) == 2 * 2 * 7  # input and output markers of 7 planned linears in 2 layers


def test_region_is_the_innermost_planned_module(after_pass):
    gm = after_pass("regions", llama(), _plan(), (IDS,))
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert [n.meta[KEY].region for n in linears[:4]] == [
        "layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv", "layers.0.attention.wo"]
    assert linears[-1].meta[KEY].region is None  # the LM head is not planned
    sdpa = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    assert sdpa.meta[KEY].region is None  # attention itself is not planned
    assert _by_target(gm, "layers.0.attention.wq.weight").meta[KEY].region == "layers.0.attention.wq"


class _Takes(torch.nn.Module):
    def forward(self, x):
        return x


class _TakesInLayout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Takes()

    def forward(self, x):
        return self.inner(x) * 2


def test_module_without_ops_of_its_own_keeps_its_boundary():
    """Regression (issue 15): a planned module that only returns its input left no node
    in its own scope, so its plan entry "matched no module"; its markers now sit in
    its scope and its ``inputs=`` is honoured."""
    from torch.distributed.tensor import Shard
    from fxshard.runtime import collectives as runtime

    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {"inner": fxshard.ModuleSpec(inputs={"tp": Shard(0)})})
    gm = fxshard.transform(_TakesInLayout(), plan, example_inputs=(torch.randn(4, 2),))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is runtime.shard


def test_inputs_by_argument_name_with_bare_placements():
    """Regression (issue 15): ``inputs={"input": Replicate()}`` names nn.Linear's
    argument ``input``; it was read as a layout on a mesh axis named "input"."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    mesh = fxshard.MeshSpec(("tp",), (2,))
    by_name = fxshard.Plan(mesh, {"0": fxshard.ModuleSpec(params={"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}},
                                                          inputs={"input": Replicate()}, out_src={"tp": Shard(-1)},
                                                          out_dst={"tp": Replicate()})},
                           inputs={"input": {"tp": Shard(1)}})
    gm = fxshard.transform(model, by_name, example_inputs=(torch.randn(2, 4),))
    # the input gathered for the linear (its gather and the linear fused: fxshard.gathered_linears)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][:1] in ([runtime.all_gather], [fxshard.gathered_linears])


def test_inputs_naming_no_argument_and_no_axis():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {"0": fxshard.ModuleSpec(inputs={"x": Replicate()})})
    with pytest.raises(fxshard.PlanError, match=r"inputs names \['x'\], which are neither arguments of Linear.forward \['input'\] nor mesh axes \['tp'\]"):
        fxshard.transform(model, plan, example_inputs=(torch.randn(2, 4),))


def test_inputs_mixing_axes_and_names():
    with pytest.raises(fxshard.PlanError, match="mixes mesh axes and argument/output names"):
        fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {"0": fxshard.ModuleSpec(inputs={"tp": Replicate(), "x": Shard(0)})})


class _Functional(torch.nn.Module):
    """Uses its child's weight directly, never calling the child."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 8, bias=False)

    def forward(self, x):
        return F.linear(x, self.proj.weight)


def test_boundaries_of_a_module_that_is_never_called():
    """Regression (issue 15): ``F.linear(x, self.proj.weight)`` with ``"proj": colwise()``
    sharded the weight and silently dropped ``out=Replicate()``: the output came back
    Shard(-1)."""
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {"proj": fxshard.colwise(out=Replicate())})
    with pytest.raises(fxshard.PlanError, match=r"never calls it: its parameters are used directly \(by `linear`\)"):
        fxshard.transform(_Functional(), plan, example_inputs=(torch.randn(2, 4),))
    params_only = fxshard.Plan(plan.mesh, {"proj": fxshard.ModuleSpec(params={"weight": {"tp": Shard(0)}})})
    gm = fxshard.transform(_Functional(), params_only, example_inputs=(torch.randn(2, 4),))
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert out.args[0].meta[KEY].value.layout == {"tp": Shard(1)}


class _TiedFused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_tied_parameters_fused_differently_are_refused():
    """Regression (issue 15 fuzz): a vocab-parallel embedding tied to a head with
    ``splits=`` was sliced once, contiguously, while the head's metadata said part by part:
    ``full_state_dict`` returned a permuted head."""
    plan = fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {"embed": fxshard.vocab_parallel(),
                                                          "head": fxshard.colwise(splits=[4, 12], out=Replicate())})
    with pytest.raises(fxshard.PlanError, match=r"tied parameters \['embed.weight', 'head.weight'\] are fused differently"):
        fxshard.transform(_TiedFused(), plan, example_inputs=(torch.randint(0, 16, (2, 4)),))
