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


def test_the_first_bucket_the_backward_completes_is_small_as_ddps():
    """As DDP's, the first bucket the backward completes holds at most 1 MiB (a larger gradient
    gets one alone), so its all-reduce starts while the rest of the backward runs; the other
    buckets fill up to the cap; exact; waiting at once, every bucket has the cap."""
    big = dict(vocab_size=4096, dim=128)  # the embedding and the head 2 MiB each, a layer 0.4 MiB

    def plan(mesh):
        return Plan(mesh, {}, inputs={"tokens": {"dp": Shard(0)}})

    gm = check_simulated(lambda: llama(**big), plan, (IDS,), {"dp": 2}, loss_fn=cross_entropy, targets=(TGT,))
    *rest, first = _buckets(gm)  # in the graph, the bucket the backward completes first comes last
    assert _members(first) == ["output.weight"] and first.kwargs.get("overlap")
    assert len(rest) == 1 and len(_members(rest[0])) == len(list(llama(**big).parameters())) - 1
    small = fxshard.transform(llama(**big), plan(MeshSpec(("dp",), (2,))), (IDS,), bucket_cap_mb=0.5)
    assert _members(_buckets(small)[-1]) == ["output.weight"]  # a cap under 1 MiB is the first bucket's too
    sizes = [sum(v.numel() * 4 for v in b.meta["val"]) for b in _buckets(small)]
    assert len(sizes) == 4 and all(s <= 2**19 or len(_members(b)) == 1 for s, b in zip(sizes, _buckets(small)))
    waiting = fxshard.transform(llama(**big), plan(MeshSpec(("dp",), (2,))), (IDS,), overlap_grad_syncs=False)
    assert len(_buckets(waiting)) == 1
