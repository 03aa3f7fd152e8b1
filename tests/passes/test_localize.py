"""localize: literal sizes of sharded dims become local sizes; sizes read at run time
stay symbolic (and must come from a dim sharded the same way)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxshard
from fxshard import MeshSpec, Plan, PlanError, colwise
from fxshard.testing.models import llama, llama_plan, tokens

IDS = tokens(2, 8, 128)


def _sizes(gm, method):
    return [n.args[1:] for n in gm.graph.nodes if n.op == "call_method" and n.target == method]


def _literals(args):
    return tuple(a if not isinstance(a, fx.Node) else "run-time" for a in args)


@pytest.mark.parametrize("tp", [2, 4])
def test_head_counts_become_local(tp, before_pass, after_pass):
    model, plan = llama(n_heads=8, n_kv_heads=4), Plan(MeshSpec(("tp",), (tp,)), llama_plan("tp"))
    before = [_literals(a) for a in _sizes(before_pass("localize", model, plan, (IDS,)), "view")]
    after = [_literals(a) for a in _sizes(after_pass("localize", model, plan, (IDS,)), "view")]
    # q, k, v views of layer 0: (bsz, seqlen, heads, head_dim), bsz/seqlen read at run time
    assert before[:3] == [("run-time", "run-time", 8, 8), ("run-time", "run-time", 4, 8), ("run-time", "run-time", 4, 8)]
    assert after[:3] == [("run-time", "run-time", 8 // tp, 8), ("run-time", "run-time", 4 // tp, 8),
                         ("run-time", "run-time", 4 // tp, 8)]
    # the rope table view (replicated) keeps its sizes
    assert (1, "run-time", 1, 4) in after


def test_minus_one_is_left_to_infer(after_pass):
    gm = after_pass("localize", llama(n_heads=8, n_kv_heads=4), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    reshapes = [_literals(a) for a in _sizes(gm, "reshape")]
    assert ("run-time", "run-time", 4, -1, 2) in reshapes  # complex rope of q: 8 heads -> 4, -1 untouched


class Widen(nn.Module):
    """Views a column-parallel output with a size read from a replicated tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return self.fc(x).view(x.shape[0], x.shape[1], x.shape[2], 2)


def test_run_time_size_of_a_differently_sharded_dim_is_rescaled():
    """``x.shape[2]`` is read from a replicated dim (8) and sizes a dim sharded on tp
    (local 4): the size is divided at run time, and the numbers are the single-device ones."""
    from equivalence import check_simulated

    sharded = check_simulated(Widen, lambda mesh: Plan(mesh, {"fc": colwise()}), (torch.randn(2, 3, 8),), {"tp": 2})
    scaled = [n for n in sharded.graph.nodes if n.op == "call_function" and n.target is operator.floordiv]
    assert len(scaled) == 1 and scaled[0].args[1] == 2


class SequenceSharded(nn.Module):
    """HF Llama's pattern under sequence parallelism: the sequence length is read from
    the sequence-sharded input and sizes the whole-sequence output of a projection."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        bsz, seqlen = h.shape[0], h.shape[1]
        q = self.q(h).view(bsz, seqlen, 2, 4)
        return q.sum(-1)


def test_size_read_from_a_sequence_sharded_input_is_rescaled():
    from torch.distributed.tensor import Replicate, Shard

    from equivalence import check_simulated
    from fxshard import sequence_parallel

    def plan(mesh):
        return Plan(mesh, {"norm": sequence_parallel(), "q": colwise(inputs=Shard(1), out=Replicate())},
                    inputs={"x": {"tp": Shard(1)}})

    sharded = check_simulated(SequenceSharded, plan, (torch.randn(2, 8, 8),), {"tp": 2})
    assert any(n.op == "call_function" and n.target is operator.mul and n.args[1] == 2 for n in sharded.graph.nodes)
    check_simulated(SequenceSharded, plan, (torch.randn(3, 4, 8),), {"tp": 4}, example_inputs=(torch.randn(2, 8, 8),))


class SlicedMask(nn.Module):
    """nanoGPT's causal mask sliced by a length read from a sequence-sharded tensor."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.register_buffer("mask", torch.tril(torch.ones(16, 16)))
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        t = h.size(1)
        q = self.q(h)  # gathered: the whole sequence
        scores = q @ q.transpose(-2, -1)
        return scores.masked_fill(self.mask[:t, :t] == 0, 0.0).sum(-1)


def test_slice_bound_read_from_a_sharded_dim_is_rescaled():
    from torch.distributed.tensor import Replicate, Shard

    from equivalence import check_simulated
    from fxshard import sequence_parallel

    def plan(mesh):
        return Plan(mesh, {"norm": sequence_parallel(), "q": colwise(inputs=Shard(1), out=Replicate())},
                    inputs={"x": {"tp": Shard(1)}})

    check_simulated(SlicedMask, plan, (torch.randn(2, 8, 8),), {"tp": 2})
    check_simulated(SlicedMask, plan, (torch.randn(2, 8, 8),), {"tp": 4})


class _RopeNarrow(nn.Module):
    """Sequence-parallel norm, then a whole-sequence table narrowed to the length read from
    the sequence-sharded input (``torch.narrow(cos, 0, 0, S)``), gathered projections."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.register_buffer("cos", torch.randn(16, 8))

    def forward(self, x):
        h = self.norm(x)
        S = h.size(1)
        h = self.proj(h)
        return h * torch.narrow(self.cos, 0, 0, S)


def test_narrow_bound_read_from_a_sharded_dim_is_rescaled():
    """Regression (issue 15 fuzz): the length read from a sequence-sharded input narrowed a
    whole-sequence table to the local length (the program then failed or broadcast away)."""
    from torch.distributed.tensor import Replicate, Shard
    from equivalence import check_simulated
    import fxshard

    def plan(mesh):
        return Plan(mesh, {"norm": fxshard.sequence_parallel(), "proj": colwise(inputs=Shard(1), out=Replicate())},
                    inputs={"x": {"tp": Shard(1)}})

    check_simulated(_RopeNarrow, plan, (torch.randn(2, 8, 8),), {"tp": 2})
    check_simulated(_RopeNarrow, plan, (torch.randn(2, 8, 8),), {"tp": 4})


class FusedUneven(nn.Module):
    """A fused projection whose parts (30 and 18) the axis does not divide, cut by split or by slices."""

    def __init__(self, cut: str):
        super().__init__()
        torch.manual_seed(0)
        self.cut = cut
        self.w12 = nn.Linear(16, 48)
        self.out = nn.Linear(30, 16)
        self.gate = nn.Linear(18, 16)

    def forward(self, x):
        h = self.w12(x)
        a, b = h.split([30, 18], dim=-1) if self.cut == "split" else (h[..., :30], h[..., 30:])
        return self.out(torch.relu(a)) + self.gate(torch.tanh(b))


@pytest.mark.parametrize("cut", ["split", "slices"])
def test_uneven_parts_are_sized_at_run_time(cut):
    """Parts of 30 and 18 on 4 ranks: 8 + 5 rows on ranks 0-2, 6 + 3 on rank 3; the split sizes
    and slice bounds come from fxshard.local_sizes / local_span, the code is the same on every rank."""
    from equivalence import check_simulated

    plan = lambda mesh: Plan(mesh, {"w12": colwise(splits=[30, 18]), "out": fxshard.rowwise(), "gate": fxshard.rowwise()})  # noqa: E731
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    sharded = check_simulated(lambda: FusedUneven(cut), plan, (x,), {"tp": 4})
    assert ("fxshard_local_sizes([30, 18], 'tp')" if cut == "split" else "fxshard_local_span([30, 18], 'tp', 30, 48)") in sharded.code
    codes = {fxshard.transform(FusedUneven(cut), plan(MeshSpec(("tp",), (4,), coordinate=(r,))), (x,)).code for r in range(4)}
    assert len(codes) == 1
