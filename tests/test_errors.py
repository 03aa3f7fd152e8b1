"""Plans that cannot be carried out: a PlanError that names the thing and the fix, and
the input GraphModule left exactly as it was."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard
from fxshard import MeshSpec, ModuleSpec, PlacementMismatchError, Plan, PlanError, colwise, rowwise
from fxshard.meta import KEY
from fxshard.testing.models import gpt2, llama, llama_plan, mlp, tokens

IDS = tokens(2, 8, 128)
X = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))


def tp(n: int = 2) -> MeshSpec:
    return MeshSpec(("tp",), (n,))


def _snapshot(gm: torch.fx.GraphModule):
    return gm.code, {k: v.clone() for k, v in gm.state_dict().items()}, [dict(n.meta) for n in gm.graph.nodes]


def fails_cleanly(model, plan, inputs, *fragments, cls=PlanError, tracer: str = "fx") -> str:
    """Transform a traced ``model``; expect ``cls`` whose message holds every fragment,
    and the GraphModule unchanged (code, state_dict, node metadata)."""
    gm = fxshard.trace(model, plan, inputs) if tracer == "fxshard" else torch.fx.symbolic_trace(model)
    code, state, metas = _snapshot(gm)
    with pytest.raises(cls) as err:
        fxshard.transform(gm, plan, example_inputs=inputs)
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} missing from the message:\n{msg}"
    assert gm.code == code, "the input GraphModule's code changed"
    now = gm.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state), "its state_dict changed"
    assert [dict(n.meta) for n in gm.graph.nodes] == metas, "its node metadata changed"
    assert not any(KEY in n.meta for n in gm.graph.nodes)
    return msg


def with_spec(pattern: str, spec: ModuleSpec) -> dict:
    return {**llama_plan("tp"), pattern: spec}


# ----------------------------------------------------------------------------- the plan vs the model


@pytest.mark.parametrize("tracer", ["fx", "fxshard"])
def test_pattern_that_matches_no_module(tracer):
    fails_cleanly(llama(), Plan(tp(), {"layers.*.attention.wqq": colwise()}), (IDS,),
                  "'layers.*.attention.wqq'", "matches no module", "closest module FQNs", "'layers.0.attention.wq'",
                  "Fix the pattern", tracer=tracer)


def test_axis_not_on_the_mesh():
    """Validated when the plan is built, before any graph is touched."""
    with pytest.raises(PlanError) as err:
        Plan(tp(), {"layers.*.attention.wq": colwise("mp")})
    for fragment in ("'layers.*.attention.wq'", "axis 'mp' is not on the mesh", "['tp']", "rename it"):
        assert fragment in str(err.value)
    with pytest.raises(PlanError, match="axis 'dp' is not on the mesh"):
        Plan(tp(), llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})


def test_sharded_dim_not_divisible():
    """64 features on 3 ranks are torch.chunk pieces, but the heads view cannot regroup them."""
    fails_cleanly(llama(n_heads=8, n_kv_heads=4), Plan(tp(3), llama_plan("tp")), (IDS,),
                  "layers.0.attention", "dim 2 of size 64, which is sharded on 'tp' in unequal pieces (22, 22, 20)",
                  "use a size of 'tp' that divides 64")


def test_out_src_that_disagrees_with_propagation():
    spec = dataclasses.replace(colwise(), out_src={"tp": Replicate()})
    msg = fails_cleanly(llama(), Plan(tp(), with_spec("layers.*.attention.wq", spec)), (IDS,),
                        "layers.0.attention.wq", "out_src tp=R", "derived tp=S(2)", "declare out_src={'tp': Shard(dim=2)}",
                        cls=PlacementMismatchError, tracer="fxshard")
    assert "source:" in msg and "models.py" in msg  # the user's line (fxshard.trace records stack traces)


def test_input_that_arrives_in_another_layout_than_declared():
    """rowwise() says its input arrives Shard(-1); a replicated input must be declared."""
    fails_cleanly(mlp(), Plan(tp(), {"fc1": rowwise()}), (X,),
                  "input 'input' of module 'fc1'", "arrives as tp=R", "tp=S(2)", "inputs={'tp': Replicate()}",
                  cls=PlacementMismatchError)


def test_colwise_and_rowwise_swapped_on_an_mlp():
    """rowwise on the first linear, colwise on the second: the error names the swap and both
    modules, not inputs= (which would all-gather and keep the wrong plan)."""
    msg = fails_cleanly(mlp(), Plan(tp(), {"fc1": rowwise(), "fc2": colwise()}), (X,),
                        "module 'fc1' is row-parallel", "'fc2', is column-parallel", "the two look swapped",
                        "swap them: colwise() on 'fc1' and rowwise() on 'fc2'", cls=PlacementMismatchError)
    assert msg.index("swap them") < msg.index("inputs={'tp': Replicate()}")  # the swap first, the other reading after


@pytest.mark.parametrize("torch_styles", [False, True], ids=["fxshard", "Plan.from_torch"])
def test_colwise_and_rowwise_swapped_on_attention(torch_styles):
    """wq/wk/wv rowwise and wo colwise: the first projection and the output one are named."""
    if torch_styles:
        plan = Plan.from_torch(tp(), {**{f"layers.*.attention.{w}": RowwiseParallel() for w in ("wq", "wk", "wv")},
                                      "layers.*.attention.wo": ColwiseParallel()})
    else:
        plan = Plan(tp(), {**{f"layers.*.attention.{w}": rowwise() for w in ("wq", "wk", "wv")},
                           "layers.*.attention.wo": colwise()})
    fails_cleanly(llama(n_heads=8, n_kv_heads=4), plan, (IDS,),
                  "module 'layers.0.attention.wq' is row-parallel", "'layers.0.attention.wo', is column-parallel",
                  "look swapped", "colwise() on 'layers.0.attention.wq' and rowwise() on 'layers.0.attention.wo'",
                  cls=PlacementMismatchError)


def test_rowwise_alone_on_a_replicated_input_is_no_swap():
    """No column-parallel module after it: the message stays about the input layout."""
    msg = fails_cleanly(mlp(), Plan(tp(), {"fc1": rowwise(), "fc2": rowwise()}), (X,),
                        "input 'input' of module 'fc1'", "inputs={'tp': Replicate()}", cls=PlacementMismatchError)
    assert "swapped" not in msg


def test_nonlinearity_on_a_partial_value():
    """A row-parallel fc1 kept Partial on exit, followed by GELU."""
    fails_cleanly(mlp(), Plan(tp(), {"fc1": rowwise(inputs=Replicate(), out=Partial())}), (X,),
                  "`gelu`", "<top level>", "gelu is not linear", "Partial", "axis 'tp'", "out_dst={'tp': Replicate()}")


def test_module_spec_keeping_partial_before_silu():
    spec = ModuleSpec(params={"weight": {"tp": Shard(1)}}, inputs={"tp": Shard(-1)},
                      out_src={"tp": Partial()}, out_dst={"tp": Partial()})
    fails_cleanly(llama(), Plan(tp(), with_spec("layers.*.feed_forward.w1", spec)), (IDS,),
                  "`silu`", "layers.0.feed_forward (FeedForward)", "silu is not linear", "tp=P",
                  "rowwise(out=Replicate())")


def test_norm_over_a_sharded_dim():
    plan = Plan(tp(), {"layers.*.attention_norm": ModuleSpec(inputs={"tp": Shard(-1)})})
    fails_cleanly(llama(norm="module"), plan, (IDS,),
                  "`rms_norm`", "layers.0.attention_norm (RMSNorm)", "reduces over dim 2, which is sharded on 'tp'",
                  "sequence_parallel('tp')")
    # written out: the mean over the sharded dim is Partial, and the `+ eps` cannot take it
    fails_cleanly(llama(norm="written"), plan, (IDS,), "layers.0.attention_norm", "Partial", "axis 'tp'", tracer="fxshard")


def test_boundary_of_a_module_traced_through_by_plain_symbolic_trace():
    """Plain symbolic_trace leaves no boundary markers on modules it traces through:
    the declared inputs would be ignored, so it is an error that says how to trace."""
    plan = Plan(tp(), {"layers.*.attention_norm": ModuleSpec(inputs={"tp": Shard(-1)})})
    fails_cleanly(llama(norm="written"), plan, (IDS,), "'layers.*.attention_norm'", "'layers.0.attention_norm'",
                  "no boundary", "fxshard.trace(model, plan, example_inputs)")


def test_tied_parameters_with_conflicting_layouts():
    fails_cleanly(gpt2(tied=True), Plan(tp(), {"lm_head": colwise()}), (IDS,),
                  "tied parameters", "'wte.weight'", "'lm_head.weight'", "Replicate (not in plan)",
                  "give every name of a tied parameter the same layout")


def test_wrong_parameter_name():
    fails_cleanly(mlp(), Plan(tp(), {"fc1": ModuleSpec(params={"wieght": {"tp": Shard(0)}})}), (X,),
                  "'fc1'", "no parameter or buffer 'wieght'", "['bias', 'weight']", "fix the name in params=")


def test_wrong_input_name():
    fails_cleanly(mlp(), Plan(tp(), {}, inputs={"tokens": {"tp": Shard(0)}}), (X,),
                  "'tokens'", "['x']", "fix the name in inputs=")


def test_from_torch_with_a_style_class():
    with pytest.raises(PlanError) as err:
        Plan.from_torch(tp(), {"fc1": ColwiseParallel, "fc2": RowwiseParallel()})
    assert "'fc1'" in str(err.value) and "write an instance, ColwiseParallel()" in str(err.value)


def test_torch_style_in_a_plain_plan():
    with pytest.raises(PlanError, match="Plan.from_torch"):
        Plan(tp(), {"fc1": ColwiseParallel()})


def test_transform_module_without_example_inputs():
    with pytest.raises(PlanError, match="example_inputs"):
        fxshard.transform(mlp(), Plan(tp(), {}))


def test_traced_graph_with_recorded_shapes_needs_no_example_inputs():
    """fxshard.trace(..., example_inputs) records shapes; transforming its graph without
    example_inputs used to be refused because `getattr(ids, "device")` (from
    ``torch.arange(T, device=ids.device)``) has no ``val``: only tensors carry one."""
    plan = Plan(tp(), {"h.*.attn.c_attn": colwise(splits=[64, 64, 64]), "h.*.attn.c_proj": rowwise()})
    model = gpt2()
    gm = fxshard.trace(model, plan, example_inputs=(IDS,))
    assert any(n.target is getattr and n.args[1] == "device" and "val" not in n.meta for n in gm.graph.nodes)
    sharded = fxshard.transform(gm, plan)
    again = fxshard.transform(gm, plan, example_inputs=(IDS,))
    assert sharded.code == again.code


def test_graph_without_recorded_shapes_is_refused():
    with pytest.raises(PlanError, match=r"no recorded shapes: pass example_inputs="):
        fxshard.transform(torch.fx.symbolic_trace(gpt2()), Plan(tp(), {}))


class _CheckedInput(torch.nn.Module):
    """Checks its input size with ``torch._assert``, as timm's PatchEmbed does: fx records a
    node that returns None, and FakeTensorProp records no value for it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        torch._assert(x.shape[-1] == 32, "the model takes 32 features")
        return self.fc2(torch.relu(self.fc1(x)))


def test_traced_graph_with_a_node_returning_none_needs_no_example_inputs():
    """A node nothing reads (``torch._assert``) needs no recorded value: its graph used to
    be refused as one without recorded shapes (auto_plan then refused every candidate)."""
    plan = Plan(tp(), {"fc1": colwise(), "fc2": rowwise()})
    gm = fxshard.trace(_CheckedInput(), plan, example_inputs=(X,))
    assert any(n.target is torch._assert and "val" not in n.meta for n in gm.graph.nodes)
    assert fxshard.transform(gm, plan).code == fxshard.transform(gm, plan, example_inputs=(X,)).code


def _broken_pass(monkeypatch, name: str, run) -> None:
    import importlib

    module = importlib.import_module("fxshard.transform")  # the module: fxshard.transform is the function
    rows = tuple(dataclasses.replace(p, run=run) if p.name == name else p for p in module.PIPELINE)
    monkeypatch.setattr(module, "PIPELINE", rows)


def test_an_exception_inside_a_pass_is_an_internal_error_not_a_plan_error(monkeypatch):
    from fxshard.passes.localize import localize

    def broken(gm, ctx):
        localize(gm, dataclasses.replace(ctx, axes={}))  # a KeyError deep inside the real pass

    _broken_pass(monkeypatch, "localize", broken)
    with pytest.raises(fxshard.InternalError) as e:
        fxshard.transform(llama(n_layers=1), Plan(tp(), llama_plan("tp")), example_inputs=(IDS,))
    err = e.value
    assert not isinstance(err, PlanError), "a bug is never a refusal of the plan"
    assert err.pass_name == "localize" and isinstance(err.original, KeyError) and err.__cause__ is err.original
    assert re.fullmatch(r"(fxshard|passes)/[\w/]+\.py:\d+, \S+", err.location), err.location  # the innermost frame of fxshard
    assert str(err).startswith(f"internal error in pass localize ({err.location}): KeyError: 'tp'")
    assert "this is a bug in fxshard" in str(err) and "please report it" in str(err)


def test_a_layout_rule_that_crashes_is_an_internal_error_naming_the_node(monkeypatch):
    from fxshard.layout.op_rules import RULES

    def crashes(ctx):
        raise KeyError("boom")

    monkeypatch.setitem(RULES, torch.nn.functional.linear, crashes)
    with pytest.raises(fxshard.InternalError, match=r"(?s)internal error in pass propagate \(passes/propagate.py:\d+, \w+\): "
                                                    r"KeyError: 'boom'.*node:    `\w+` \(F.linear\) in module fc1 ") as e:
        fxshard.transform(mlp(), Plan(tp(), {"fc1": colwise(), "fc2": rowwise()}), example_inputs=(X,))
    assert e.value.pass_name == "propagate"
