"""Vocab-parallel embedding: every id, at every shard boundary, gives the single-device row."""
import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import MeshSpec, Plan, vocab_parallel
from harness import make_mesh, plain, rank_value, simulated, spawn
from torch.distributed.tensor import Shard

V, D = 16, 6


class Embed(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)
        with torch.no_grad():
            self.emb.weight.copy_(torch.arange(V * D, dtype=torch.float).view(V, D) / 7 + 1)

    def forward(self, ids):
        return self.emb(ids) * 2.0


def _ids(tp):
    boundaries = sorted({b for k in (tp,) for i in range(k) for b in (i * V // k, i * V // k - 1) if 0 <= b < V} | {0, V - 1})
    return torch.tensor([boundaries, list(reversed(boundaries))])


@pytest.mark.parametrize("tp,padding_idx", [(2, None), (4, None), (4, 5), (2, 8)])
def test_rows_and_gradients_simulated(tp, padding_idx):
    model = Embed(padding_idx)
    ids = _ids(tp)
    if padding_idx is not None:
        ids[0, 0] = padding_idx
    _check_rows_simulated(model, ids, tp)


def _check_rows_simulated(model, ids, tp):
    """Every rank's output rows equal one device's; each rank's weight gradient is its torch.chunk piece."""
    ref = model(ids)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    with simulated({"tp": tp}) as mesh:
        sharded = fxshard.transform(model, Plan(mesh, {"emb": vocab_parallel()}), (ids,))
        out = sharded(ids)
        (out * w).sum().backward()
        with plain():
            for r in range(tp):
                torch.testing.assert_close(rank_value(out, r), ref.detach(), rtol=0, atol=0)
                torch.testing.assert_close(rank_value(sharded.emb.weight.grad, r), model.emb.weight.grad.chunk(tp)[r])


def test_reduce_scatter_output_and_no_rank_literal():
    model = Embed()
    ids = torch.randint(0, V, (2, 8))
    codes = set()
    for coord in range(4):
        sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (4,), coordinate=(coord,)), {"emb": vocab_parallel(out=Shard(1))}), (ids,))
        codes.add(sharded.code)
        assert sharded.emb.vocab_start.tolist() == [coord * V // 4]  # the offset lives in a buffer
    assert len(codes) == 1, "the transformed code must not depend on the rank"
    code = codes.pop()
    assert "fxshard_reduce_scatter" in code and "vocab_start" in code
    assert "vocab_start" not in sharded.state_dict(), "the offset buffer is not part of the checkpoint"


@pytest.mark.parametrize("tp", [3, 6])
def test_vocab_the_axis_does_not_divide_simulated(tp):
    """16 rows on 3 ranks: torch.chunk pieces of 6, 6 and 4 (on 6: 3, 3, 3, 3, 3, 1); every id
    at every boundary gives the single-device row, and each rank's rows get their gradient."""
    model = Embed()
    ids = torch.tensor([list(range(V)), list(reversed(range(V)))])
    _check_rows_simulated(model, ids, tp)
    offline = fxshard.transform(model, Plan(MeshSpec(("tp",), (tp,), coordinate=(tp - 1,)), {"emb": vocab_parallel()}), (ids,))
    step = -(-V // tp)
    assert offline.emb.vocab_start.tolist() == [(tp - 1) * step]
    assert offline.emb.vocab_rows.tolist() == [V - (tp - 1) * step]  # the last rank's own row count


def test_a_rank_without_rows_is_a_plan_error():
    with pytest.raises(fxshard.PlanError, match=r"leaves ranks without a piece \(4, 4, 4, 4, 0\)"):
        fxshard.transform(Embed(), Plan(MeshSpec(("tp",), (5,)), {"emb": vocab_parallel()}), (torch.zeros(1, 2, dtype=torch.long),))


def _real(rank, world_size):
    model = Embed(padding_idx=3)
    ids = _ids(world_size)
    ref = model(ids)
    sharded = fxshard.transform(model, Plan(make_mesh({"tp": world_size}), {"emb": vocab_parallel()}), (ids,))
    torch.testing.assert_close(sharded(ids), ref.detach(), rtol=0, atol=0)


def test_real_gloo():
    spawn(_real, 2)
