"""normalize: leaf modules that own parameters become functional calls on get_attr
inputs; planned leaves get region markers around the call."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxshard import MeshSpec, ModuleSpec, Plan, colwise, rowwise
from fxshard.markers import region_input, region_output

TP2 = MeshSpec(("tp",), (2,))


class Leaves(nn.Module):
    """One of every leaf normalize knows, a parameter-free one it inlines (Softplus),
    and one it does not know (PReLU, which owns a parameter)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8, padding_idx=1)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8, eps=1e-6)
        self.fc1 = nn.Linear(8, 12)
        self.act = nn.GELU(approximate="tanh")
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Linear(12, 8, bias=False)
        self.relu = nn.ReLU()
        self.soft = nn.Softplus(beta=2.0)
        self.other = nn.PReLU()

    def forward(self, ids):
        h = self.rms(self.ln(self.emb(ids)))
        return self.other(self.soft(self.relu(self.fc2(self.drop(self.act(self.fc1(h)))))))


IDS = torch.tensor([[0, 1, 5, 15], [3, 1, 2, 9]])


def _model():
    torch.manual_seed(0)
    m = Leaves()
    with torch.no_grad():
        m.ln.weight.uniform_(0.5, 1.5)
        m.rms.weight.uniform_(0.5, 1.5)
    return m


def test_leaves_become_functional_calls(after_pass):
    model = _model()
    gm = after_pass("functionalize_leaves", model, Plan(TP2, {}), (IDS,))
    mods = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert mods == ["other"], "only the unknown leaf stays a call_module"
    fns = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    for fn in (F.embedding, F.layer_norm, F.rms_norm, F.linear, F.gelu, F.dropout, F.relu, F.softplus):
        assert fn in fns, fn
    soft = next(n for n in gm.graph.nodes if n.target is F.softplus)  # inlined, its attributes as constants
    assert soft.kwargs.get("beta", soft.args[1] if len(soft.args) > 1 else None) == 2.0
    # every parameter use is a get_attr edge into the functional call
    lin = [n for n in gm.graph.nodes if n.target is F.linear]
    assert [(a.op, a.target) for a in lin[0].args[1:]] == [("get_attr", "fc1.weight"), ("get_attr", "fc1.bias")]
    assert lin[1].args[2] is None  # fc2 has no bias
    emb = next(n for n in gm.graph.nodes if n.target is F.embedding)
    assert emb.kwargs["padding_idx"] == 1
    gelu = next(n for n in gm.graph.nodes if n.target is F.gelu)
    assert gelu.kwargs == {"approximate": "tanh"}
    # the functional graph computes what the modules did
    torch.testing.assert_close(gm(IDS), model(IDS), rtol=0, atol=0)


def test_new_nodes_keep_module_stack_and_shapes(after_pass):
    gm = after_pass("functionalize_leaves", _model(), Plan(TP2, {}), (IDS,))
    lin = next(n for n in gm.graph.nodes if n.target is F.linear)
    assert list(lin.meta["nn_module_stack"].values())[-1][0] == "fc1"
    assert tuple(lin.meta["val"].shape) == (2, 4, 12)
    rms = next(n for n in gm.graph.nodes if n.target is F.rms_norm)
    assert list(rms.meta["nn_module_stack"].values())[-1][0] == "rms"


def test_planned_leaves_get_boundary_markers(after_pass):
    plan = Plan(TP2, {"fc1": colwise(), "fc2": rowwise(), "ln": ModuleSpec(params={})})
    gm = after_pass("functionalize_leaves", _model(), plan, (IDS,))
    marks = [(n.target.__name__, n.args[1], n.args[2]) for n in gm.graph.nodes if n.target in (region_input, region_output)]
    # ln declares no boundary (params only): no markers
    assert marks == [("region_input", "fc1", "input"), ("region_output", "fc1", "output"),
                     ("region_input", "fc2", "input"), ("region_output", "fc2", "output")]
    lin = next(n for n in gm.graph.nodes if n.target is F.linear)
    assert lin.args[0].target is region_input and list(lin.users)[0].target is region_output


def test_local_region_stays_a_module(after_pass):
    plan = Plan(TP2, {"fc1": ModuleSpec(local=True, out_src={"tp": torch.distributed.tensor.Replicate()})})
    gm = after_pass("functionalize_leaves", _model(), plan, (IDS,))
    assert "fc1" in [n.target for n in gm.graph.nodes if n.op == "call_module"]
