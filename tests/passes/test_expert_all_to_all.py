"""expert_parallel: count exchange, dispatch and combine around the experts call, and the
runtime all-to-alls themselves (uneven splits, empty experts and ranks) on real gloo ranks."""
import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.meta import info
from fxshard.runtime.moe import ep_combine, ep_dispatch, ep_exchange_counts, expert_parallel, softmax_topk
from fxshard.testing.moe_models import moe_transformer
from harness import make_mesh, spawn

X = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))


def _transform(model, spec=None, ep=2):
    plan = Plan(MeshSpec(("ep",), (ep,)), {"layers.*.moe": spec or expert_parallel("ep")}, inputs={"x": {"ep": Shard(0)}})
    return fxshard.transform(model, plan, (X,))


def test_all_to_alls_around_the_experts_call():
    sharded = _transform(moe_transformer(0))
    region = sharded.get_submodule("layers.0.moe")
    code = [l.strip() for l in region.code.splitlines()]
    start = next(i for i, l in enumerate(code) if l.startswith("ep_exchange_counts"))
    assert [l.split(";")[0] for l in code[start:start + 7]] == [
        "ep_exchange_counts = fxshard_ep_exchange_counts(bincount, 'ep')",
        "ep_dispatch = fxshard_ep_dispatch(getitem_5, bincount, ep_exchange_counts, 'ep')",
        "x_ep = ep_dispatch[0]",
        "counts_local = ep_dispatch[1]",
        "ep_plan = ep_dispatch[2]",
        "experts = self.experts(x_ep, counts_local)",
        "ep_combine = fxshard_ep_combine(experts, ep_plan, 'ep')",
    ]
    node = next(n for n in sharded.graph.nodes if n.target == "layers.0.moe")
    assert info(node).extra["expert_parallel"] == "1 experts call(s) in the graph"
    colls = {n.name: info(n).collective for n in region.graph.nodes if info(n).collective is not None}
    assert colls["ep_dispatch"].bwd.startswith("all-to-all") and colls["ep_exchange_counts"].bwd == "none"


def test_preset_is_data():
    spec = expert_parallel("ep")
    assert spec == expert_parallel("ep") and spec != expert_parallel("ep", experts="ffn")
    assert spec.local and spec.inputs == {"ep": Shard(0)} and spec.in_src == {"ep": Shard(0)}
    assert expert_parallel("ep", inputs=Replicate(), out=Replicate()).out_dst == {"ep": Replicate()}
    assert expert_parallel("ep", router=softmax_topk(2)) == expert_parallel("ep", router=softmax_topk(2))
    assert "expert_parallel('ep', experts='experts')" in repr(Plan(MeshSpec(("ep",), (2,)), {"m": spec}))


def test_replicated_batch_is_chunked_on_entry_and_gathered_on_exit():
    plan = Plan(MeshSpec(("ep",), (2,)), {"layers.*.moe": expert_parallel("ep", inputs=Replicate(), out=Replicate())})
    sharded = fxshard.transform(moe_transformer(0), plan, (X,))
    ops = [(n.target.__name__, n.args[1]) for n in sharded.graph.nodes if n.op == "call_function"
           and getattr(n.target, "__module__", "") == "fxshard" and n.target is not fxshard.grad_sync_bucket]
    assert ops == [("shard", "ep"), ("all_gather", "ep")] * 2
    # the routers' weights, read by the regions, sync in one bucket with the rest
    (bucket,) = [n for n in sharded.graph.nodes if n.target is fxshard.grad_sync_bucket]
    assert [a.target for a in bucket.args[0]] == [f"layers.{i}.moe.gate.{w}" for i in (1, 0) for w in ("weight", "bias")]


class Stacked(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        for i, s in enumerate(shapes):
            self.register_parameter(f"w{i}", nn.Parameter(torch.zeros(s)))


class Block(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.gate = nn.Linear(32, 4)
        self.experts = experts

    def forward(self, x):
        return x


class Host(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.moe = Block(experts)

    def forward(self, x):
        return self.moe(x)


@pytest.mark.parametrize("experts, spec, message", [
    (Stacked([(4, 8)]), expert_parallel("ep", experts="ffn"), "has no submodule 'ffn'"),
    (Stacked([(4, 8), (3, 8)]), expert_parallel("ep"), r"experts.w1 has shape \(3, 8\).*expert dim first"),
    (Stacked([(3, 8)]), expert_parallel("ep"), "3 experts cannot be split evenly over axis 'ep' of size 2"),
    (nn.ModuleList([nn.Linear(2, 2)] * 4), expert_parallel("ep"), r"needs its router: expert_parallel\('ep', router="),
], ids=["no child", "not stacked", "not divisible", "list without router"])
def test_plan_errors(experts, spec, message):
    plan = Plan(MeshSpec(("ep",), (2,)), {"moe": spec}, inputs={"x": {"ep": Shard(0)}})
    with pytest.raises(fxshard.PlanError, match=message):
        fxshard.transform(Host(experts), plan, (torch.randn(4, 32),))


# --------------------------------------------------------------------------- the runtime ops, real ranks

# tokens per global expert sent by each rank (4 experts, 2 per rank)
ROUTINGS = [
    {0: [3, 0, 2, 1], 1: [0, 0, 4, 0]},  # expert 1 gets nothing, rank 1 sends nothing to rank 0
    {0: [0, 0, 0, 0], 1: [1, 2, 0, 3]},  # rank 0 has no tokens at all
    {0: [2, 1, 0, 0], 1: [3, 0, 0, 0]},  # rank 1 receives nothing
]


def _tokens(rank, counts):
    return torch.arange(sum(counts) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank


def _expert_ids(counts):
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


def _ops(rank, world_size):
    fxshard.bind_mesh(make_mesh({"ep": world_size}))
    per = 2
    for routing in ROUTINGS:
        counts = torch.tensor(routing[rank])
        x = _tokens(rank, routing[rank]).requires_grad_()
        counts_ep = ep_exchange_counts(counts, "ep")
        assert counts_ep.tolist() == [routing[j][rank * per:(rank + 1) * per] for j in range(world_size)]
        x_ep, local, plan = ep_dispatch(x, counts, counts_ep, "ep")
        # by local expert, then by source rank, then in the source's order
        want = []
        for e in range(rank * per, (rank + 1) * per):
            for j in range(world_size):
                want.append(_tokens(j, routing[j])[_expert_ids(routing[j]) == e])
        torch.testing.assert_close(x_ep, torch.cat(want), rtol=0, atol=0)
        assert local.tolist() == [sum(routing[j][e] for j in range(world_size)) for e in range(rank * per, (rank + 1) * per)]
        # "experts": expert e scales by (e + 1); results must come back in the original order
        scale = (torch.repeat_interleave(torch.arange(per), local) + rank * per + 1).to(x.dtype)
        y = ep_combine(x_ep * scale[:, None], plan, "ep")
        factor = (_expert_ids(routing[rank]) + 1).to(x.dtype)[:, None]
        torch.testing.assert_close(y, x.detach() * factor, rtol=0, atol=0)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank))
        y.backward(g)
        torch.testing.assert_close(x.grad, g * factor, rtol=0, atol=0)


def test_dispatch_combine_uneven_and_empty_real():
    spawn(_ops, 2)
