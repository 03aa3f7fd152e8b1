"""fxshard.shards: the geometry of a rank's shard (runs of global indices per dim),
which materialize, load_hf_checkpoint and save/load read.  It must cut exactly where
shard_state's local_slice cuts, and follow torch.chunk where an axis does not divide."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from fxshard import MeshSpec
from fxshard.state.shards import local_slice
from fxshard.layout.placements import chunk as chunk_range
from fxshard.state.shards import assemble, boxes, local_shape, shard_runs


def _cut(full, runs):
    out = torch.empty(local_shape(runs), dtype=full.dtype)
    return assemble(runs, lambda box: full[box.glob], out)


@st.composite
def _cases(draw):
    ndim = draw(st.integers(1, 3))
    names = ("dp", "tp")[: draw(st.integers(1, 2))]
    sizes = tuple(draw(st.sampled_from([1, 2, 4])) for _ in names)
    coord = tuple(draw(st.integers(0, s - 1)) for s in sizes)
    layout = {}
    for a, n in zip(names, sizes):
        layout[a] = draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(ndim)]))
    blocks = None
    shape = []
    for d in range(ndim):
        # divisible by every axis sharding this dim (what the transform accepts)
        k = 1
        for a, n in zip(names, sizes):
            if layout[a] == Shard(d):
                k *= n
        shape.append(k * draw(st.integers(1, 3)))
    tp_dim = layout.get("tp")
    # a fused parameter (blocks) is sharded on one axis only, as plans shard parameters
    if isinstance(tp_dim, Shard) and sum(isinstance(p, Shard) for p in layout.values()) == 1 and draw(st.booleans()):
        n = sizes[names.index("tp")]
        blocks = tuple(n * draw(st.integers(1, 3)) for _ in range(draw(st.integers(2, 3))))
        shape[tp_dim.dim] = sum(blocks)
    return names, sizes, coord, layout, tuple(shape), blocks


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_runs_cut_where_local_slice_cuts(case):
    names, sizes, coord, layout, shape, blocks = case
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    mesh = MeshSpec(names, sizes, coordinate=coord)
    runs = shard_runs(layout, shape, dict(zip(names, sizes)), dict(zip(names, coord)), blocks)
    assert torch.equal(_cut(full, runs), local_slice(full, layout, mesh, blocks))


@given(st.integers(0, 20), st.integers(1, 8))
def test_uneven_axes_follow_torch_chunk(size, n):
    pieces = torch.arange(size).chunk(n)
    for i in range(n):
        start, length = chunk_range(size, n, i)
        want = pieces[i] if i < len(pieces) else torch.arange(0)
        assert torch.equal(torch.arange(size)[start:start + length], want)


def test_fused_parts_are_one_box_each_and_empty_ranks_none():
    runs = shard_runs({"tp": Shard(0)}, (12, 3), {"tp": 2}, {"tp": 1}, blocks=(4, 4, 4))
    assert [b.offsets for b in boxes(runs)] == [(2, 0), (6, 0), (10, 0)]
    # 3 rows on 4 ranks (torch.chunk: 1, 1, 1, 0): the last rank holds nothing
    assert list(boxes(shard_runs({"tp": Shard(0)}, (3, 2), {"tp": 4}, {"tp": 3}))) == []
