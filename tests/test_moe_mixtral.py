"""Mixtral-style MoE (``gate`` + ``experts: nn.ModuleList``) on real gloo ranks.

One spawn of 2 processes runs every case against the single-device model on the full
batch (outputs, input and parameter gradients, outputs after two SGD steps; the
reference optimizes the sum of the per-rank losses, see tests/equivalence.py):

* ``expert_parallel("ep", router=softmax_topk())``: fxshard runs the block, each rank
  keeps its half of the expert list under the single-device FQNs;
* the same with a routing that leaves experts 2 and 3 -- all of rank 1's experts --
  without tokens;
* the HF forward itself (not traceable by fx) as an opaque data-parallel region,
  run as is, its replicated router and experts synced through their forward;
* a user ``compute=`` function (traceable) in place of the forward.
"""
import functools

import torch
from torch.distributed.tensor import Shard

import fxshard
from equivalence import Case, check_real_cases
from fxshard.meta import info
from fxshard.runtime.moe import ExpertList, softmax_topk
from fxshard.testing.moe_models import MixtralSparseMoE, mixtral_plan, moe_transformer, route_to

N_EXPERTS = 4


def _model(routing=None):
    model = moe_transformer(0, style="mixtral", n_experts=N_EXPERTS)
    return route_to(model, routing) if routing else model


def _ep_plan(mesh):
    return fxshard.Plan(mesh, mixtral_plan("ep"), inputs={"x": {"ep": Shard(0)}})


def _dp_plan(mesh, compute=None):
    spec = fxshard.ModuleSpec(local=True, inputs={"dp": Shard(0)}, out_src={"dp": Shard(0)}, compute=compute)
    return fxshard.Plan(mesh, {"layers.*.block_sparse_moe": spec}, inputs={"x": {"dp": Shard(0)}})


def sorted_compute(block, hidden_states):
    """A user compute function: top-k routing with the tokens sorted by expert."""
    bsz, seqlen, dim = hidden_states.shape
    h = hidden_states.reshape(bsz * seqlen, dim)
    weights, selected = softmax_topk()(block, block.gate(h))
    out = torch.zeros_like(h)
    for e in range(N_EXPERTS):
        hit = (selected == e).to(h.dtype) * weights  # [T, k]: weight of expert e for each token
        out = out + block.experts[e](h) * hit.sum(-1, keepdim=True)
    return out.reshape(bsz, seqlen, dim)


def _check_ep_layout(sharded, mesh, rank, world_size):
    """Each rank keeps its experts, under their single-device names; the others are gone."""
    per_rank = N_EXPERTS // world_size
    for i in range(2):
        experts = sharded.get_submodule(f"layers.{i}.block_sparse_moe.experts")
        assert isinstance(experts, ExpertList)
        assert list(experts.keys()) == [str(rank * per_rank + j) for j in range(per_rank)]
    keys = [k for k in sharded.state_dict() if ".experts." in k]
    assert keys and all(int(k.split(".experts.")[1].split(".")[0]) // per_rank == rank for k in keys), keys
    region = [n for n in sharded.graph.nodes if n.op == "call_module" and n.target == "layers.0.block_sparse_moe"]
    assert info(region[0]).extra["region"] == "carved"


def _check_as_is(sharded, mesh, rank, world_size):
    node = next(n for n in sharded.graph.nodes if n.op == "call_module" and n.target == "layers.0.block_sparse_moe")
    assert info(node).extra["region"].startswith("as is"), info(node).extra
    assert isinstance(sharded.get_submodule("layers.0.block_sparse_moe"), MixtralSparseMoE)


def test_mixtral_real_ep2():
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))
    check_real_cases(2, [
        Case(_model, _ep_plan, (x,), {"ep": 2}, post=_check_ep_layout, name="mixtral ep=2"),
        Case(functools.partial(_model, [0, 1]), _ep_plan, (x,), {"ep": 2}, name="mixtral ep=2, rank 1's experts idle"),
        Case(_model, _dp_plan, (x,), {"dp": 2}, post=_check_as_is, name="HF forward as an opaque dp region"),
        Case(_model, functools.partial(_dp_plan, compute=sorted_compute), (x,), {"dp": 2}, name="compute= on dp"),
    ])
