"""vocab_parallel_embedding: lookups into a vocab-sharded embedding are masked,
shifted, looked up and zeroed; the vocab offset is a buffer, not a literal."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import MeshSpec, Plan, vocab_parallel

from equivalence import check_simulated
from harness import plain, rank_value, simulated

V, D = 16, 8
# first/last id of every shard at tp=2 and tp=4, and the padding id
IDS = torch.tensor([[0, 3, 4, 7, 8, 11], [12, 15, 5, 5, 2, 9]])


class Embed(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)

    def forward(self, ids):
        return self.emb(ids) * 2.0


def _embed(padding_idx=None):
    torch.manual_seed(0)
    return Embed(padding_idx)


def _plan(mesh):
    return Plan(mesh, {"emb": vocab_parallel()})


def test_lookup_is_masked_and_offset_by_a_buffer(after_pass):
    gm = after_pass("vocab_parallel_embedding", _embed(), _plan(MeshSpec(("tp",), (4,))), (IDS,))
    emb = next(n for n in gm.graph.nodes if n.target is F.embedding)
    masked_ids, weight = emb.args
    assert weight.target == "emb.weight" and masked_ids.target == "masked_fill"
    shifted = masked_ids.args[0]
    assert shifted.target is operator.sub and shifted.args[1].target == "emb.vocab_start"
    above = next(n for n in gm.graph.nodes if n.target is operator.ge)
    assert above.args == (shifted, 4), "ids at or past the local vocab size (V / tp) are outside"
    assert not any(isinstance(a, int) and a in (8, 12) for n in gm.graph.nodes for a in n.args), "no rank offsets in the code"
    (zeroed,) = [u for u in emb.users if u.target == "masked_fill"]
    assert zeroed.args[2] == 0.0
    assert torch.equal(gm.emb.vocab_start, torch.tensor([0, 4, 8, 12]))
    assert "vocab_start" in gm.emb._non_persistent_buffers_set


def test_each_rank_keeps_its_offset_and_the_code_is_the_same():
    codes = []
    for c in range(4):
        sharded = fxshard.transform(_embed(), _plan(MeshSpec(("tp",), (4,), coordinate=(c,))), (IDS,))
        assert torch.equal(sharded.emb.vocab_start, torch.tensor([4 * c]))
        assert torch.equal(sharded.emb.weight, _embed().emb.weight[4 * c:4 * c + 4])
        assert "emb.vocab_start" not in sharded.state_dict()
        codes.append(sharded.code)
    assert len(set(codes)) == 1


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("padding_idx", [None, 5])
def test_matches_the_single_device_embedding_simulated(tp, padding_idx):
    """Output and weight gradient (the padding row gets none) against nn.Embedding."""
    check_simulated(lambda: _embed(padding_idx), _plan, (IDS,), {"tp": tp}, lr=0.5)


def test_a_meta_models_offset_table_keeps_its_values_on_the_cpu():
    """materialize() copies the table to the device: on the meta device it would have no values."""
    sharded = fxshard.transform(_embed().to_empty(device="meta"), _plan(MeshSpec(("tp",), (4,), coordinate=(2,))),
                                (IDS.to("meta"),))
    assert sharded.emb.vocab_start.device.type == "cpu" and torch.equal(sharded.emb.vocab_start, torch.tensor([8]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("padding_idx", [None, 5])
def test_on_cuda_the_offset_table_lives_with_the_ids(padding_idx):
    """A CUDA model's ids minus a CPU offset table failed (seen on an H200 at tp=4)."""
    with simulated({"tp": 4}, "cuda") as mesh:
        with plain():
            ids, model = IDS.cuda(), _embed(padding_idx).cuda()
            want = _embed(padding_idx).cuda()(ids)
        sharded = fxshard.transform(model, _plan(mesh), (ids,))
        assert sharded.emb.vocab_start.device.type == "cuda"
        out = sharded(ids)
        for r in range(4):
            torch.testing.assert_close(rank_value(out, r), want)
