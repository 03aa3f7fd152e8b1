"""grad_sync: one gradient all-reduce per (value, axis) on exactly the edges where a
replicated value meets a consumer that makes it non-replicated."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fxshard import MeshSpec, Plan, colwise, rowwise
from fxshard.runtime import collectives as runtime
from fxshard.meta import KEY
from fxshard.testing.models import llama, llama_plan, mlp, tokens

from equivalence import check_simulated

IDS = tokens(4, 8, 128)
COLLECTIVES = (runtime.all_reduce, runtime.reduce_scatter, runtime.all_gather, runtime.shard, runtime.all_to_all)


def _syncs(gm, axis=None):
    return [n for n in gm.graph.nodes if n.target is runtime.grad_sync and (axis is None or n.args[1] == axis)]


def test_megatron_copy_to_tensor_parallel_region(after_pass):
    """One sync per colwise group (q/k/v share one, w1/w3 share one), none elsewhere."""
    gm = after_pass("insert_grad_syncs", llama(n_layers=2), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    syncs = _syncs(gm)
    assert len(syncs) == 4 and all(s.args[1] == "tp" for s in syncs)
    assert [s.args[0].target for s in syncs] == [F.rms_norm] * 4  # the norm outputs entering q/k/v and w1/w3
    users = [sorted(u.meta[KEY].region for u in s.users if u.target is F.linear) for s in syncs[:2]]
    assert users == [["layers.0.attention.wk", "layers.0.attention.wq", "layers.0.attention.wv"],
                     ["layers.0.feed_forward.w1", "layers.0.feed_forward.w3"]]
    coll = syncs[0].meta[KEY].collective
    assert (coll.op, coll.axis, coll.fwd, coll.bwd) == ("grad_sync", "tp", "identity", "all-reduce")


def test_collectives_are_not_consumers(after_pass):
    gm = after_pass("insert_grad_syncs", llama(), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    for s in _syncs(gm):
        assert not all(u.target in COLLECTIVES for u in s.users), s.name


def test_replicated_parameters_under_a_batch_sharded_axis(after_pass):
    plan = Plan(MeshSpec(("dp", "tp"), (2, 2)), llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})
    gm = after_pass("insert_grad_syncs", llama(), plan, (IDS,))
    params = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.meta[KEY].value.requires_grad}
    synced = {s.args[0].target for s in _syncs(gm, "dp") if s.args[0].op == "get_attr"}
    assert synced == params, "every parameter is replicated on dp and meets the dp-sharded batch"
    assert not any(s.args[0].op == "placeholder" for s in _syncs(gm)), "int token ids need no gradient"


def test_sequence_parallel_folds_the_sync_into_the_gather(after_pass):
    """All-gathered inputs of the colwise groups get their sync folded: the gather's
    backward reduce-scatters, and no separate tp sync follows it."""
    gm = after_pass("insert_grad_syncs", llama(), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp", sequence_parallel=True)), (IDS,))
    gathers = [n for n in gm.graph.nodes if n.target is runtime.all_gather and n.meta[KEY].region
               and n.meta[KEY].region.startswith("layers.")]
    assert len(gathers) == 4 and all(g.kwargs.get("grad") == "partial" for g in gathers)
    assert "grad sync folded" in gathers[0].meta[KEY].collective.bwd
    assert not any(s.args[0] in gathers for s in _syncs(gm))
    # the replicated norm weights applied to sequence shards still need theirs
    norm_weights = {s.args[0].target for s in _syncs(gm, "tp") if s.args[0].op == "get_attr"}
    assert "layers.0.attention_norm.weight" in norm_weights and "norm.weight" in norm_weights


def test_input_gradient_of_a_replicated_input_simulated():
    """x enters a colwise fc1: its gradient is summed over tp (checked per rank)."""
    make = lambda: mlp(dim=32, hidden=64)
    plan = lambda mesh: Plan(mesh, {"fc1": colwise(), "fc2": rowwise()})
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))
    sharded = check_simulated(make, plan, (x,), {"tp": 4}, lr=0.2)
    assert [s.args[0].op for s in _syncs(sharded)] == ["placeholder"]
