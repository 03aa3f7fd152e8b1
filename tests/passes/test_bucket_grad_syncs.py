"""bucket_grad_syncs: parameter gradient syncs coalesced into DDP-style buckets, exact
against one device, in backward order, capped, nested over two axes."""
from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.runtime import collectives as runtime
from fxshard.testing.models import gpt2, gpt2_plan, llama, llama_plan, tokens

from equivalence import check_simulated, cross_entropy
from harness import rank_map, rank_value, simulated

IDS, TGT = tokens(4, 8, 128), tokens(4, 8, 128, seed=2)


def _buckets(gm):
    return [n for n in gm.graph.nodes if n.target is runtime.grad_sync_bucket]


def _members(bucket):
    return [a.target for a in bucket.args[0]]


def test_one_bucket_of_every_norm_weight_under_sequence_parallelism():
    gm = fxshard.transform(llama(n_layers=2), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp", sequence_parallel=True)), (IDS,))
    (bucket,) = _buckets(gm)
    assert bucket.args[1] == "tp"
    # backward order: the final norm's gradient is complete first
    assert _members(bucket) == ["norm.weight", "layers.1.ffn_norm.weight", "layers.1.attention_norm.weight",
                                "layers.0.ffn_norm.weight", "layers.0.attention_norm.weight"]
    assert not [n for n in gm.graph.nodes if n.target is runtime.grad_sync and n.args[0].op == "get_attr"]
    assert "norm_weight_synced = grad_bucket[0]" in gm.code
    summary = fxshard.comm_summary(gm)
    rows = [r for r in summary.rows if r.op == "grad_sync_bucket"]
    assert [(r.phase, r.kind, r.shape) for r in rows] == [("backward", "all_reduce", (5 * 64,))]


def test_cap_splits_buckets_and_none_keeps_one_sync_per_parameter():
    plan = Plan(MeshSpec(("tp",), (2,)), llama_plan("tp", sequence_parallel=True))
    tiny = fxshard.transform(llama(n_layers=2), plan, (IDS,), bucket_cap_mb=2 * 64 * 4 / 2**20)  # two norm weights each
    # filled in backward order; in the graph each bucket sits before its first use
    assert [_members(b) for b in _buckets(tiny)] == [
        ["layers.0.attention_norm.weight"], ["layers.1.attention_norm.weight", "layers.0.ffn_norm.weight"],
        ["norm.weight", "layers.1.ffn_norm.weight"]]
    off = fxshard.transform(llama(n_layers=2), plan, (IDS,), bucket_cap_mb=None)
    assert not _buckets(off)
    assert len([n for n in off.graph.nodes if n.target is runtime.grad_sync]) == 5


def test_buckets_are_exact_with_sequence_parallel_gpt2():
    check_simulated(lambda: gpt2(), lambda mesh: Plan(mesh, gpt2_plan("tp", sequence_parallel=True)),
                    (IDS,), {"tp": 2}, loss_fn=cross_entropy, targets=(TGT,))


def test_nested_buckets_over_dp_and_tp_are_exact():
    """fxshard owns dp here: every weight syncs over dp (one bucket), the norm weights then over tp."""
    gm = check_simulated(lambda: llama(n_layers=2),
                         lambda mesh: Plan(mesh, llama_plan("tp", sequence_parallel=True), inputs={"tokens": {"dp": Shard(0)}}),
                         (IDS,), {"dp": 2, "tp": 2}, loss_fn=cross_entropy, targets=(TGT,))
    buckets = _buckets(gm)
    assert sorted(b.args[1] for b in buckets) == ["dp", "tp"]
    dp, tp = (next(b for b in buckets if b.args[1] == axis) for axis in ("dp", "tp"))
    assert all(a.target is operator.getitem and a.args[0] is dp for a in tp.args[0])  # the norms, out of the dp bucket
    assert len(tp.args[0]) == 5 and len(dp.args[0]) == len(list(llama(n_layers=2).parameters()))


def test_runtime_bucket_equals_separate_syncs_with_mixed_dtypes():
    with simulated({"tp": 2}) as mesh:
        fxshard.bind_mesh(mesh)
        a = rank_map(lambda r: torch.full((3,), 1.0 + r)).requires_grad_()
        b = rank_map(lambda r: torch.full((2, 2), 2.0 + r, dtype=torch.bfloat16)).requires_grad_()
        ya, yb = fxshard.grad_sync_bucket([a, b], "tp")
        (ya * rank_map(lambda r: torch.full((3,), float(r + 1)))).sum().backward()
        (yb.float() * 2).sum().backward()
        for r in range(2):
            torch.testing.assert_close(rank_value(a.grad, r), torch.full((3,), 3.0))  # 1 + 2
            assert rank_value(b.grad, r).dtype == torch.bfloat16
            torch.testing.assert_close(rank_value(b.grad, r), torch.full((2, 2), 4.0, dtype=torch.bfloat16))
