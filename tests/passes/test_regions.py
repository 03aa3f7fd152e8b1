"""regions: the plan attached to the graph (regions, declared layouts, boundaries)."""
from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard import MeshSpec, Plan
from fxshard.boundary import region_input, region_output
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
