"""shard_state: parameters and buffers become this rank's shards under the same FQNs;
the global layout and shape of each are kept in ProgramMeta.state (fxshard.meta.program_meta(gm).state)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan
from fxshard.testing.models import gpt2, gpt2_plan, llama, llama_plan, mlp, tokens

from equivalence import slice_for
from harness import plain, rank_value, simulated
from fxshard.meta import program_meta

IDS = tokens(2, 8, 128)


@pytest.mark.parametrize("c", range(4))
def test_local_shards_under_the_same_names(c):
    model = llama(n_heads=8, n_kv_heads=4)
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (4,), coordinate=(c,)), llama_plan("tp")), (IDS,))
    full = dict(model.named_parameters())
    state = program_meta(sharded).state
    assert dict(sharded.named_parameters()).keys() == full.keys()
    assert sharded.state_dict().keys() == model.state_dict().keys()
    for fqn, p in sharded.named_parameters():
        layout, shape = state[fqn]
        assert shape == tuple(full[fqn].shape)
        assert isinstance(p, nn.Parameter) and p.requires_grad
        assert torch.equal(p, slice_for(full[fqn], layout, {"tp": c}, {"tp": 4})), fqn
    assert state["layers.0.attention.wq.weight"][0] == {"tp": Shard(0)}
    assert state["layers.0.attention.wo.weight"][0] == {"tp": Shard(1)}
    assert state["norm.weight"][0] == {"tp": Replicate()}
    assert sharded.get_parameter("layers.0.attention.wk.weight").shape == (8, 64)


def test_two_axes_on_one_dim_nest_outer_first():
    """Shard(0) on dp and on tp: dp picks a half, tp a quarter inside it (DTensor order)."""
    both = {a: Shard(0) for a in ("dp", "tp")}
    plan_specs = {"fc1": ModuleSpec(params={"weight": both, "bias": both}, inputs={"dp": Replicate(), "tp": Replicate()},
                                    out_src={"dp": Shard(-1), "tp": Shard(-1)}, out_dst={"dp": Replicate(), "tp": Replicate()})}
    model = mlp(dim=32, hidden=64)
    w = model.fc1.weight
    for dp, tp in itertools.product(range(2), range(2)):
        mesh = MeshSpec(("dp", "tp"), (2, 2), coordinate=(dp, tp))
        sharded = fxshard.transform(model, Plan(mesh, plan_specs), (torch.randn(2, 32),))
        start = dp * 32 + tp * 16
        assert torch.equal(sharded.fc1.weight, w[start:start + 16])


def test_tied_parameters_stay_tied():
    model = gpt2(tied=True)
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), gpt2_plan("tp")), (IDS,))
    assert sharded.wte.weight is sharded.lm_head.weight
    assert sharded.wte.weight.shape == (64, 64)
    assert program_meta(sharded).state["lm_head.weight"][0] == {"tp": Shard(0)}


def test_simulated_ranks_hold_their_own_shards():
    model = llama(n_heads=8, n_kv_heads=4)
    with simulated({"tp": 4}) as mesh:
        sharded = fxshard.transform(model, Plan(mesh, llama_plan("tp")), (IDS,))
        wq, norm = sharded.get_parameter("layers.0.attention.wq.weight"), sharded.get_parameter("norm.weight")
        with plain():
            for r in range(4):
                assert torch.equal(rank_value(wq, r), model.layers[0].attention.wq.weight[16 * r:16 * (r + 1)])
                assert torch.equal(rank_value(norm, r), model.norm.weight)
            assert rank_value(norm, 0) is not rank_value(norm, 1), "every rank owns its copy of a replicated parameter"
