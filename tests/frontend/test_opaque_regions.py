"""Local regions under torch.export: the region's call stays one ``call_module`` node (the
form fxshard.trace gives a leaf), whatever its forward does inside."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

import fxshard
from fxshard import MeshSpec, Plan, PlanError, routed_experts
from fxshard.frontend.capture import capture


def test_hf_experts_are_one_call_each():
    pytest.importorskip("transformers")
    from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

    model = tiny_model("mixtral")
    ids, _ = tiny_inputs()
    plan = Plan(MeshSpec(("ep",), (2,)), {"model.layers.*.mlp.experts": routed_experts(ep="ep")})
    gm = capture(model, plan, example_kwargs={"input_ids": ids})
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not any("local_region" in str(n.target) for n in gm.graph.nodes)
    assert all(len(n.args) == 3 and tuple(n.meta["val"].shape) == (16, 64) for n in calls)
    assert 'mlp.experts(' in gm.code  # reads as the model's own call
    assert gm.get_submodule("model.layers.0.mlp.experts") is model.model.layers[0].mlp.experts  # shared, never written
    assert all("forward" not in vars(m) for m in model.modules())  # the model's forwards are its own again
    torch.testing.assert_close(gm(input_ids=ids).logits, model(input_ids=ids).logits)


class ListBlock(nn.Linear):
    def forward(self, x):
        return {"y": super().forward(x), "n": 3}


def test_a_region_returning_non_tensors_is_a_plan_error():
    model = nn.Sequential(nn.Linear(4, 4), ListBlock(4, 4))
    plan = Plan(MeshSpec(("tp",), (2,)), {"1": fxshard.ModuleSpec(local=True, out_src={"tp": Replicate()})})
    with pytest.raises(PlanError, match=r"local region '1' returns dict with non-tensor parts"):
        capture(model, plan, example_inputs=(torch.randn(2, 4),))
