"""local_regions / outline_regions: opaque regions as one call_module, carved or run as is."""
import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

import fxshard
from equivalence import check_simulated
from fxshard import MeshSpec, ModuleSpec, Plan
from fxshard.meta import LocalRegion, info
from fxshard.testing.moe_models import GroupedExperts, MixtralSparseMoE, moe_plan, moe_transformer

X = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))


def _region_node(gm, fqn):
    return next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == fqn)


def _ep_plan(sizes=(("ep", 2),), inputs=None):
    names, ns = zip(*sizes)
    return Plan(MeshSpec(names, ns), moe_plan("ep"), inputs={"x": inputs or {"ep": Shard(0)}})


def test_carved_region_keeps_fqns_untraceable_children_stay_leaves():
    model = moe_transformer(0)
    sharded = fxshard.transform(model, _ep_plan(), (X,))
    region = sharded.get_submodule("layers.0.moe")
    assert isinstance(region, torch.fx.GraphModule) and type(region).__name__ == "GroupedMoE"
    assert info(_region_node(sharded, "layers.0.moe")).extra["region"] == "carved"
    calls = [n.target for n in region.graph.nodes if n.op == "call_module"]
    assert calls == ["experts"]  # the loop experts (.tolist()) stay a leaf; the gate became F.linear
    assert isinstance(region.experts, GroupedExperts)
    # the router's parameters need a grad sync: the region takes them as inputs, synced by the caller
    assert [n.target for n in region.graph.nodes if n.op == "get_attr"] == []
    assert [n.name for n in region.graph.nodes if n.op == "placeholder"] == ["x", "gate_weight_synced", "gate_bias_synced"]
    call = _region_node(sharded, "layers.0.moe")
    assert {k: a.name for k, a in call.kwargs.items()} == {"gate_weight_synced": "layers_0_moe_gate_weight_synced",
                                                            "gate_bias_synced": "layers_0_moe_gate_bias_synced"}
    assert set(sharded.state_dict()) == set(model.state_dict())
    assert isinstance(info(_region_node(sharded, "layers.0.moe")).declared, LocalRegion)


def test_router_grad_sync_on_every_batch_sharded_axis():
    """dp x ep with the batch sharded on both: the router syncs on both axes; the
    expert weights (Shard(0) on ep, replicated on dp) sync on dp, inside the leaf
    experts' forward."""
    sharded = fxshard.transform(moe_transformer(0), _ep_plan((("dp", 2), ("ep", 2)), {"dp": Shard(0), "ep": Shard(0)}),
                                (torch.randn(8, 8, 32),))
    region = sharded.get_submodule("layers.0.moe")
    buckets = {n.args[1]: n for n in sharded.graph.nodes if n.target is fxshard.grad_sync_bucket}
    assert sorted(n.args[1] for n in sharded.graph.nodes if n.target is fxshard.grad_sync_bucket) == ["dp", "ep"]
    router = {f"layers.0.moe.gate.{w}" for w in ("weight", "bias")}
    assert router <= {a.target for a in buckets["dp"].args[0]}  # the router, read outside, syncs on dp, then ep
    assert router <= {buckets["dp"].args[0][a.args[1]].target for a in buckets["ep"].args[0]}
    experts = region.experts
    assert type(experts) is not GroupedExperts and type(experts).__bases__ == (GroupedExperts,)
    assert set(dict(experts.named_parameters())) == {"w1", "w2", "w3"}


def test_batch_replicated_region_has_no_grad_sync():
    """A local region whose input is replicated: every rank computes the whole
    gradient of its parameters, nothing to sum."""
    spec = ModuleSpec(local=True, out_src={})
    sharded = fxshard.transform(moe_transformer(0), Plan(MeshSpec(("dp",), (2,)), {"layers.*.moe": spec}), (X,))
    region = sharded.get_submodule("layers.0.moe")
    assert not [n for n in region.graph.nodes if n.target is fxshard.grad_sync]


def test_untraceable_region_runs_as_is():
    spec = ModuleSpec(local=True, inputs={"dp": Shard(0)}, out_src={"dp": Shard(0)})
    model = moe_transformer(0, style="mixtral")
    sharded = fxshard.transform(model, Plan(MeshSpec(("dp",), (2,)), {"layers.*.block_sparse_moe": spec},
                                            inputs={"x": {"dp": Shard(0)}}), (X,))
    why = info(_region_node(sharded, "layers.0.block_sparse_moe")).extra["region"]
    assert why.startswith("as is: TraceError"), why
    block = sharded.get_submodule("layers.0.block_sparse_moe")
    assert isinstance(block, MixtralSparseMoE) and type(block) is not MixtralSparseMoE  # forward wrapped for grad syncs
    assert set(sharded.state_dict()) == set(model.state_dict())


def test_region_traced_inline_is_outlined():
    gm = torch.fx.symbolic_trace(moe_transformer(0, experts_impl="gather"))
    assert not any(n.op == "call_module" and n.target == "layers.0.moe" for n in gm.graph.nodes)
    sharded = fxshard.transform(gm, _ep_plan(), (X,))
    assert [n.target for n in sharded.graph.nodes if n.op == "call_module"] == ["layers.0.moe", "layers.1.moe"]
    region = sharded.get_submodule("layers.0.moe")
    assert type(region).__name__ == "GroupedMoE"
    assert [n.target for n in region.graph.nodes if n.op == "call_module"] == ["experts"]  # outlined too, for the all-to-alls
    assert set(sharded.state_dict()) == set(gm.state_dict())


class Inner(nn.Module):
    def forward(self, x):
        return torch.sin(torch.relu(x)) + 1


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x) * 2


def test_outlining_a_non_convex_region_names_the_node():
    gm = torch.fx.symbolic_trace(Outer())
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    sin = next(n for n in gm.graph.nodes if n.target is torch.sin)
    with gm.graph.inserting_after(relu):
        outside = gm.graph.call_function(torch.neg, (relu,))  # no nn_module_stack: outside the region
    sin.replace_input_with(relu, outside)
    gm.recompile()
    plan = Plan(MeshSpec(("dp",), (2,)), {"inner": ModuleSpec(local=True, out_src={})})
    with pytest.raises(fxshard.PlanError, match=r"(?s)cannot shard node `neg`.*not a convex set") as err:
        fxshard.transform(gm, plan, (torch.randn(3),))
    assert "'inner'" in str(err.value) and "fxshard.trace" in str(err.value)


def test_outline_keeps_values_used_outside():
    class TwoOut(nn.Module):
        def forward(self, x):
            a = torch.relu(x)
            return a, a.sin()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.two = TwoOut()

        def forward(self, x):
            a, b = self.two(x)
            return a * b

    gm = torch.fx.symbolic_trace(Net())
    x = torch.randn(5)
    plan = Plan(MeshSpec(("dp",), (2,)), {"two": ModuleSpec(local=True, out_src=({}, {}))})
    sharded = fxshard.transform(gm, plan, (x,))
    torch.testing.assert_close(sharded(x), gm(x))
    assert [n.target for n in sharded.graph.nodes if n.op == "call_module"] == ["two"]


def test_local_region_errors_name_the_fix():
    with pytest.raises(fxshard.PlanError, match="declared, not derived.*out_src="):
        fxshard.transform(moe_transformer(0), Plan(MeshSpec(("ep",), (2,)), {"layers.*.moe": ModuleSpec(local=True)}), (X,))
    plan = Plan(MeshSpec(("ep",), (2,)), {**moe_plan("ep"), "layers.*.moe.gate": fxshard.colwise("ep")},
                inputs={"x": {"ep": Shard(0)}})
    with pytest.raises(fxshard.PlanError, match="'layers.0.moe.gate' inside the region"):
        fxshard.transform(moe_transformer(0), plan, (X,))

    class Pair(nn.Module):
        def forward(self, a, b):
            return a + b

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, a, b):
            return self.pair(a, b)

    spec = ModuleSpec(local=True, out_src={})  # inputs arrive differently on dp, output layout on dp not declared
    plan = Plan(MeshSpec(("dp",), (2,)), {"pair": spec}, inputs={"a": {"dp": Shard(0)}})
    with pytest.raises(fxshard.PlanError, match="add 'dp' to out_src"):
        fxshard.transform(TwoInputs(), plan, (torch.randn(4, 2), torch.randn(4, 2)))


# --------------------------------------------------------------------------- simulated ranks


class RowLoop(nn.Module):
    """A token-wise block fx cannot trace (it iterates over its input)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.stack([F.gelu(self.fc(row)) for row in x])


class Traceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 1.5))

    def forward(self, x):
        return F.gelu(self.fc(x)) * self.scale


class Net(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.block = block
        self.post = nn.Linear(8, 4)

    def forward(self, x):
        return self.post(self.block(self.pre(x)))


def _net(block_cls):
    torch.manual_seed(0)
    return Net(block_cls())


def _dp_plan(mesh):
    spec = ModuleSpec(local=True, inputs={"dp": Shard(0)}, out_src={"dp": Shard(0)})
    return Plan(mesh, {"block": spec}, inputs={"x": {"dp": Shard(0)}})


@pytest.mark.parametrize("block_cls", [Traceable, RowLoop], ids=["carved", "as is"])
def test_data_parallel_local_region_simulated(block_cls):
    """Replicated region parameters under a batch-sharded axis: summed gradients, as outside."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    sharded = check_simulated(lambda: _net(block_cls), _dp_plan, (x,), {"dp": 2})
    assert info(_region_node(sharded, "block")).extra["region"].startswith("carved" if block_cls is Traceable else "as is")


# --------------------------------------------------------------------------- several outputs, one out_src


class TwoOutputs(nn.Module):
    def forward(self, x):
        a = torch.relu(x)
        return a, a.sin()


class TwoOutputsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.two = TwoOutputs()

    def forward(self, x):
        a, b = self.two(self.pre(x))
        return a * b


def _two_outputs():
    torch.manual_seed(0)
    return TwoOutputsNet()


def _two_plan(out_src, out_names=None):
    spec = ModuleSpec(local=True, inputs={"dp": Shard(0)}, out_src=out_src, out_names=out_names)
    return lambda mesh: Plan(mesh, {"two": spec}, inputs={"x": {"dp": Shard(0)}})


@pytest.mark.parametrize("out_src", [{"dp": Shard(0)}, Shard(0)], ids=["layout", "bare placement"])
def test_one_out_src_lays_out_every_output(out_src):
    """A single layout for a multi-output region applies to each output (used to raise
    TypeError: 'NoneType' object is not iterable in regions)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    sharded = check_simulated(_two_outputs, _two_plan(out_src), (x,), {"dp": 2})
    assert info(_region_node(sharded, "two")).declared.outs == ({"dp": Shard(0)}, {"dp": Shard(0)})


@pytest.mark.parametrize("out_src,out_names,fragment", [
    (({"dp": Shard(0)},), None, "out_src=({'dp': Shard(dim=0)}, {...})"),
    (({"dp": Shard(0)}, None), None, "out_src=({'dp': Shard(dim=0)}, {...})"),
    ({"a": {"dp": Shard(0)}}, ("a", "b"), "out_src={'a': {'dp': Shard(dim=0)}, 'b': {...}}"),
], ids=["short tuple", "None entry", "missing name"])
def test_missing_output_layout_names_region_output_and_fix(out_src, out_names, fragment):
    plan = _two_plan(out_src, out_names)(MeshSpec(("dp",), (2,)))
    with pytest.raises(fxshard.PlanError) as err:
        fxshard.transform(_two_outputs(), plan, (torch.randn(4, 8),))
    msg = str(err.value)
    name = "'b'" if out_names else "'1'"
    for part in ("local region 'two'", f"no layout for output {name}", "declared, never derived", fragment,
                 "one layout for all of them"):
        assert part in msg, f"{part!r} missing from:\n{msg}"


def test_out_src_for_outputs_the_region_lacks():
    with pytest.raises(fxshard.PlanError, match=r"out_src has 3 layouts, but the module returns 2 outputs"):
        fxshard.transform(_two_outputs(), _two_plan(({}, {}, {}))(MeshSpec(("dp",), (2,))), (torch.randn(4, 8),))
    with pytest.raises(fxshard.PlanError, match=r"out_src names outputs \['c'\], but the module's outputs are \['a', 'b'\]"):
        fxshard.transform(_two_outputs(), _two_plan({"a": {}, "c": {}}, ("a", "b"))(MeshSpec(("dp",), (2,))), (torch.randn(4, 8),))


class TensorAndSize(nn.Module):
    def forward(self, x):
        return torch.relu(x), x.size(0)


class TensorAndSizeNet(nn.Module):
    def __init__(self, use_size):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(8, 8)
        self.two = TensorAndSize()
        self.use_size = use_size

    def forward(self, x):
        a, n = self.two(self.pre(x))
        return a * n if self.use_size else a


def test_non_tensor_output_of_a_region_has_no_layout():
    """One layout for (tensor, int): the int gets none (used to raise AttributeError in
    propagate); the int, a size of the region's local input, cannot enter tensor math."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    plan = _two_plan({"dp": Shard(0)})
    check_simulated(lambda: TensorAndSizeNet(False), plan, (x,), {"dp": 2})
    with pytest.raises(fxshard.PlanError, match="(?s)`mul`.*the output of module `two`, which runs on local tensors"):
        fxshard.transform(TensorAndSizeNet(True), plan(MeshSpec(("dp",), (2,))), (x,))
