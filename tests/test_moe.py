"""Expert parallelism on an attention + MoE transformer (grouped experts), real gloo ranks.

Every case compares with the single-device model on the full batch: outputs, input
and parameter gradients (router included) at two steps, and outputs after two SGD
steps (fp32, atol 1e-5).  The batch is sharded over ``ep``, so the reference
optimizes the sum of the per-rank losses (tests/equivalence.py).

Routings: the model's own; experts 0 and 1 forced for every token (experts 2 and 3,
all of rank 1's, get no token: rank 1 receives nothing); top-1 to expert 3 (every
token of rank 0 goes to one remote expert, rank 0 receives nothing).
"""
import functools

import torch
import torch.fx
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fxshard
from equivalence import Case, check_real_cases
from fxshard import MeshSpec, Plan
from fxshard.meta import info, program_meta
from fxshard.testing.moe_models import GroupedMoE, moe_plan, moe_transformer, route_to

X = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))


def _model(routing=None, traced=False, **kw):
    model = moe_transformer(0, **kw)
    if routing:
        route_to(model, routing)
    return torch.fx.symbolic_trace(model) if traced else model


class UntraceableMoE(GroupedMoE):
    """The grouped block with data-dependent Python: fx cannot trace it, so the region
    runs as is and expert parallelism wraps the experts' forward instead."""

    def forward(self, x):
        if x.shape[0] == 0:
            return x
        return super().forward(x)


def _untraceable_model():
    model = moe_transformer(0)
    for layer in model.layers:
        block = UntraceableMoE(model.args)
        block.load_state_dict(layer.moe.state_dict())
        layer.moe = block
    return model


def _plan(mesh, tp=None):
    return Plan(mesh, moe_plan("ep", tp), inputs={"x": {"ep": Shard(0)}})


class CountAllToAll(TorchDispatchMode):
    """Counts the all_to_all_single calls that reach the process group."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _count_all_to_alls(sharded, mesh, rank, world_size):
    """Per MoE layer: count exchange, dispatch and combine forward; the dispatch's
    and combine's mirror backward (the counts carry no gradient).  And a full
    checkpoint of the sharded experts."""
    n_layers = 2
    x = X.chunk(world_size)[rank].clone().requires_grad_()
    with CountAllToAll() as fwd:
        out = sharded(x)
    with CountAllToAll() as bwd:
        out.sum().backward()
    assert (fwd.calls, bwd.calls) == (3 * n_layers, 2 * n_layers), (fwd.calls, bwd.calls)
    # a full checkpoint gathers the experts back: single-device keys and shapes
    full = fxshard.full_state_dict(sharded)
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in moe_transformer(0).state_dict().items()}
    torch.testing.assert_close(full["layers.0.moe.experts.w1"].chunk(world_size)[rank],
                               sharded.get_parameter("layers.0.moe.experts.w1").detach())
    for i in range(n_layers):
        region = sharded.get_submodule(f"layers.{i}.moe")
        ops = [n.target.__name__ for n in region.graph.nodes if n.op == "call_function" and n.target.__module__ == "fxshard"]
        assert [o for o in ops if o.startswith("ep_")] == ["ep_exchange_counts", "ep_dispatch", "ep_combine"], ops


def test_moe_real_ep2():
    check_real_cases(2, [
        Case(_model, _plan, (X,), {"ep": 2}, post=_count_all_to_alls, name="grouped ep=2"),
        Case(functools.partial(_model, [0, 1]), _plan, (X,), {"ep": 2}, name="ep=2, experts 2 and 3 get no token"),
        Case(functools.partial(_model, [3], top_k=1), _plan, (X,), {"ep": 2}, name="ep=2, top-1 to remote expert 3"),
        Case(functools.partial(_model, traced=True, experts_impl="gather"), _plan, (X,), {"ep": 2},
             name="ep=2, plain symbolic_trace (region outlined)"),
        Case(_untraceable_model, _plan, (X,), {"ep": 2}, post=_check_wrapped, name="ep=2, region run as is"),
    ])


def _check_wrapped(sharded, mesh, rank, world_size):
    node = next(n for n in sharded.graph.nodes if n.op == "call_module" and n.target == "layers.0.moe")
    assert info(node).extra["region"].startswith("as is: TraceError"), info(node).extra
    assert info(node).extra["expert_parallel"] == "experts forward wrapped"


def test_moe_real_tp2_ep2():
    tp_plan = functools.partial(_plan, tp="tp")
    check_real_cases(4, [
        Case(_model, tp_plan, (X,), {"tp": 2, "ep": 2}, name="tp=2 x ep=2"),
        Case(functools.partial(_model, [2, 3]), tp_plan, (X,), {"tp": 2, "ep": 2},
             name="tp=2 x ep=2, rank 0's experts get no token"),
    ])


# --------------------------------------------------------------------------- dumps (offline)


def _offline():
    plan = Plan(MeshSpec(("ep",), (2,)), moe_plan("ep"), inputs={"x": {"ep": Shard(0)}})
    return fxshard.transform(moe_transformer(0), plan, example_inputs=(X,))


def test_dump_shows_each_moe_block_as_one_row_with_its_declared_layout():
    sharded = _offline()
    text = fxshard.dump(sharded, region="layers.*.moe", source=False)
    rows = [l.split() for l in text.splitlines()[3:]]
    # the routers' parameters, read by the caller to sync their gradients in the bucket, show as rows too
    assert sorted(r[2] for r in rows if r[1] == "get_attr") == [f"layers.{i}.moe.gate.{w}" for i in (0, 1) for w in ("bias", "weight")]
    rows = [r for r in rows if r[1] != "get_attr"]
    assert [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows] == [
        ("layers_0_moe", "call_module", "layers.0.moe", "S(0)", "[2,", "8,"),
        ("layers_1_moe", "call_module", "layers.1.moe", "S(0)", "[2,", "8,"),
    ]


def test_recursive_dump_shows_the_all_to_alls():
    sharded = _offline()
    text = fxshard.dump(sharded, region="layers.0.*", recursive=True, source=False)
    assert "-- local region layers.0.moe (GroupedMoE), run on local tensors --" in text
    region = text.split("-- local region layers.0.moe")[1]
    rows = {l.split()[1]: l for l in region.splitlines() if l.startswith(">> ")}
    assert set(rows) == {"ep_exchange_counts", "ep_dispatch", "ep_combine"}  # the router's grad sync is the caller's
    assert "fxshard.ep_dispatch" in rows["ep_dispatch"] and "[32, 32]" in rows["ep_dispatch"]  # 16 tokens x top-2 sent
    assert "collectives: 3 (ep_combine@ep x1, ep_dispatch@ep x1, ep_exchange_counts@ep x1)" in region
    code = sharded.get_submodule("layers.0.moe").code
    assert "fxshard_ep_dispatch(" in code and "fxshard_ep_combine(experts, ep_plan, 'ep')" in code
    assert "self.experts(x_ep, counts_local)" in code


def test_expert_weights_are_sharded_and_router_replicated():
    sharded = _offline()
    state = program_meta(sharded).state
    assert state["layers.0.moe.experts.w1"] == ({"ep": Shard(0)}, (4, 32, 32))
    assert tuple(sharded.get_parameter("layers.0.moe.experts.w1").shape) == (2, 32, 32)
    assert tuple(sharded.get_parameter("layers.0.moe.gate.weight").shape) == (4, 32)
    assert set(sharded.state_dict()) == set(moe_transformer(0).state_dict())
