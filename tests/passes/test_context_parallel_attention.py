"""passes/context_parallel_attention.py: the attention of context-parallel modules, rewritten."""
import pytest
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard import MeshSpec, Plan, PlanError
from fxshard.meta import KEY
from fxshard.testing.models import llama, llama_plan, tokens

IDS = tokens(2, 16, 128)


def _plan(method, lb=True, extra=None, n=2):
    return Plan(MeshSpec(("cp", "tp"), (n, 2)) if extra else MeshSpec(("cp",), (n,)),
                {"layers.*.attention": fxshard.context_parallel("cp", method=method, load_balance=lb), **(extra or {})},
                inputs={"tokens": {"cp": Shard(1)}})


def test_allgather_nodes():
    gm = fxshard.transform(llama(), _plan("allgather"), (IDS,))
    gathers = [n for n in gm.graph.nodes if n.meta[KEY].collective is not None and n.meta[KEY].collective.op == "all_gather"]
    assert len(gathers) == 4  # K and V of 2 layers
    for g in gathers:
        assert g.args[1:] == ("cp", 2) and g.kwargs == {"grad": "partial"}  # grad_sync folded the dK/dV sum in
        assert g.meta[KEY].value.layout == {"cp": Replicate()}
    masks = [n for n in gm.graph.nodes if n.target is fxshard.context_parallel_mask]
    assert [m.kwargs for m in masks] == [{"load_balance": True, "is_causal": True}] * 2
    assert all(m.meta[KEY].value.local_shape == (8, 16) for m in masks)  # local queries x the whole sequence


def test_ring_node_keeps_the_query_layout():
    gm = fxshard.transform(llama(), _plan("ring", lb=False, extra=llama_plan("tp")), (IDS,))
    (ring, _) = [n for n in gm.graph.nodes if n.target is fxshard.ring_attention]
    assert ring.args[3] == "cp" and ring.kwargs == {"is_causal": True, "load_balance": False}
    assert ring.meta[KEY].value.layout == {"cp": Shard(2), "tp": Shard(1)}
    assert ring.meta[KEY].collective.op == "ring_attention"


def test_positions_from_the_rope_table():
    gm = fxshard.transform(llama(), _plan("allgather"), (IDS,))
    assert ".index_select(0, local_positions)" in gm.code  # freqs_cis rows at this rank's positions


def test_dropout_is_refused():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Drop(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Drop()

        def forward(self, x):
            return self.attn(x)

    plan = Plan(MeshSpec(("cp",), (2,)), {"attn": fxshard.context_parallel()}, inputs={"x": {"cp": Shard(2)}})
    with pytest.raises(PlanError, match="dropout"):
        fxshard.transform(M(), plan, (torch.randn(1, 2, 8, 4),))
