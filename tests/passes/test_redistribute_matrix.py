"""redistribute against DTensor: every (src, dst) pair of layouts, forward and backward.

For each mesh ({"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}) and every pair of layouts
built from Replicate, Shard(0), Shard(1), Partial(sum) and Partial(avg) on each axis
(every combination across the two axes of the 2-D mesh), a module whose only job is
to take its input in ``dst`` is transformed from a graph input laid out ``src``.  On
the same per-rank local tensors, under simulated ranks:

* forward: fxshard's collective nodes give what ``DTensor.redistribute`` gives;
* backward: with a random upstream gradient (the same on the ranks where ``dst`` is
  Replicate, as a replicated gradient is), the input gradients agree too.

Deliberate differences, checked as such:

* a change *into* Partial (R -> P, S -> P, P(sum) <-> P(avg)) is a PlanError in
  fxshard: Partial is produced by ops, never by redistribution (DTensor partitions
  the value locally);
* a dim that one axis does not divide is cut in ``torch.chunk`` pieces as DTensor
  does (padded on the wire), but a dim sharded over several axes must divide by their
  product, an all-to-all of unequal pieces is refused, and so is a cut that leaves a rank
  without a piece (6 on 4 ranks: 2, 2, 2, 0): PlanErrors;
* the gradient of a ``Partial("avg")`` input is scaled by ``1/n`` per axis it is reduced over:
  fxshard differentiates each rank's local tensor (the rank's share entered the
  mean with weight ``1/n``, which is what the local op before it needs), while
  DTensor returns the gradient of the global value.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import fxshard
from fxshard.layout.placements import fmt_placement
from equivalence import coords_of
from fxshard import ModuleSpec, Plan, PlanError
from fxshard.meta import KEY
from harness import plain, rank_map, rank_value, simulated

PLACEMENTS = (Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg"))
MESHES = ({"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2})
EVEN = (8, 4)  # every dim divides every axis and their product
UNEVEN = (4, 6)  # dim 1 divides 2 but not 4 (on tp=4 its pieces would be 2, 2, 2, 0: refused)
UNEVEN_4 = (5, 7)  # on tp=4: 2, 2, 2, 1 and 2, 2, 2, 1


class Takes(nn.Module):
    """Returns its input; the plan says in which layout it takes it."""

    def forward(self, x):
        return x


class Redistribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Takes()

    def forward(self, x):
        return self.inner(x)


def _fmt(layout: dict) -> str:
    return ",".join(fmt_placement(p) for p in layout.values())


def _layouts(mesh_shape):
    return [dict(zip(mesh_shape, ps)) for ps in itertools.product(PLACEMENTS, repeat=len(mesh_shape))]


def _divides(shape, layout, mesh_shape) -> bool:
    """Every dim sharded over several axes divides by their product (one axis may cut unevenly)."""
    for d in range(len(shape)):
        over = [mesh_shape[a] for a, p in layout.items() if isinstance(p, Shard) and p.dim == d]
        if len(over) > 1 and shape[d] % math.prod(over):
            return False
    return True


def _divides_each(shape, layout, mesh_shape) -> bool:
    return all(shape[p.dim] % mesh_shape[a] == 0 for a, p in layout.items() if isinstance(p, Shard))


REFUSALS = {"a dim the axes do not divide": "together .* do not divide it", "a change into Partial": "into Partial",
            "a rank without a piece": "leaves ranks without a piece",
            "an all-to-all of unequal pieces": "all-to-all of unequal pieces"}


def _refused(src, dst, shape, mesh_shape) -> str | None:
    """Why fxshard refuses this change (deliberately), or None."""
    if not (_divides(shape, src, mesh_shape) and _divides(shape, dst, mesh_shape)):
        return "a dim the axes do not divide"
    for layout in (src, dst):
        for axis, p in layout.items():
            n = mesh_shape[axis]
            if isinstance(p, Shard) and shape[p.dim] % n and -(-shape[p.dim] // n) * (n - 1) >= shape[p.dim]:
                return "a rank without a piece"
    for axis in mesh_shape:
        if src[axis] != dst[axis] and isinstance(dst[axis], Partial):
            return "a change into Partial"
    for axis, n in mesh_shape.items():
        s, d = src[axis], dst[axis]
        if isinstance(s, Shard) and isinstance(d, Shard) and s != d and (shape[s.dim] % n or shape[d.dim] % n):
            return "an all-to-all of unequal pieces"
    return None


def _local_shape(shape, layout, mesh_shape, coord):
    """torch.chunk pieces, outer axes first (a dim on several axes divides)."""
    shape = list(shape)
    for axis, p in layout.items():
        if isinstance(p, Shard):
            step = -(-shape[p.dim] // mesh_shape[axis])
            shape[p.dim] = max(0, min(step, shape[p.dim] - coord[axis] * step))
    return shape


def _per_rank(shape, layout, mesh_shape, seed):
    """A LocalTensor that is a valid distributed tensor in ``layout``: ranks that differ
    only on axes where the layout is Replicate hold the same values, the others differ."""
    varying = [a for a, p in layout.items() if not isinstance(p, Replicate)]

    def value(r):
        coord = coords_of(r, mesh_shape)
        key = sum(coord[a] * 10 ** i for i, a in enumerate(varying))
        local = _local_shape(shape, layout, mesh_shape, coord)
        return torch.randn(local, generator=torch.Generator().manual_seed(seed * 1000 + key))

    return rank_map(value)


def _cases(mesh_shape, shape):
    for src in _layouts(mesh_shape):
        for dst in _layouts(mesh_shape):
            yield src, dst


def _check(mesh_shape: dict, shape: tuple, pairs) -> tuple[int, int]:
    """Run every (src, dst) pair on one simulated mesh; return (compared, refused)."""
    compared = refused = 0
    example = (torch.zeros(shape),)  # a plain tensor: under simulated ranks it would be per-rank
    with simulated(mesh_shape) as mesh:
        for src, dst in pairs:
            what = f"mesh {mesh_shape} shape {list(shape)}: {_fmt(src)} -> {_fmt(dst)}"
            plan = Plan(mesh, {"inner": ModuleSpec(inputs=dst)}, inputs={"x": src})
            why = _refused(src, dst, shape, mesh_shape)
            if why is not None:
                with pytest.raises(PlanError, match=REFUSALS[why]):
                    fxshard.transform(Redistribute(), plan, example_inputs=example)
                refused += 1
                continue
            sharded = fxshard.transform(Redistribute(), plan, example_inputs=example)
            (out,) = [n for n in sharded.graph.nodes if n.op == "output"]
            assert out.args[0].meta[KEY].value.layout == dst, what

            x = _per_rank(shape, src, mesh_shape, seed=1)
            grad = _per_rank(shape, dst, mesh_shape, seed=2)
            mine = x.clone().requires_grad_()
            y = sharded(mine)
            y.backward(grad)

            theirs = x.clone().requires_grad_()
            dt = DTensor.from_local(theirs, mesh, tuple(src.values()), run_check=False,
                                    shape=torch.Size(shape), stride=example[0].stride())
            want = dt.redistribute(mesh, tuple(dst.values())).to_local()
            if _divides_each(shape, src, mesh_shape) and _divides_each(shape, dst, mesh_shape):
                want.backward(grad)
                want_grad = theirs.grad
            else:  # DTensor's backward cannot hash ragged simulated shapes: run what it does, dst -> src, forward
                back = tuple(Replicate() if isinstance(p, Partial) and not isinstance(d, Partial) else p
                             for p, d in zip(src.values(), dst.values()))
                want_grad = DTensor.from_local(grad, mesh, tuple(dst.values()), run_check=False, shape=torch.Size(shape),
                                               stride=example[0].stride()).redistribute(mesh, back).to_local()

            scale = math.prod(mesh_shape[a] for a, p in src.items() if p == Partial("avg") and dst[a] != p)
            for r in range(math.prod(mesh_shape.values())):
                torch.testing.assert_close(rank_value(y, r), rank_value(want, r), msg=lambda m: f"{what}: forward, rank {r}: {m}")
                torch.testing.assert_close(rank_value(mine.grad, r) * scale, rank_value(want_grad, r),
                                           msg=lambda m: f"{what}: input gradient, rank {r}: {m}")
            compared += 1
    return compared, refused


@pytest.mark.parametrize("mesh_shape", MESHES[:2], ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()))
@pytest.mark.parametrize("shape", [EVEN, UNEVEN, UNEVEN_4], ids=["even", "uneven", "uneven both dims"])
def test_one_axis_matrix(mesh_shape, shape):
    compared, refused = _check(mesh_shape, shape, _cases(mesh_shape, shape))
    assert compared + refused == len(PLACEMENTS) ** 2
    assert compared >= (9 if shape == EVEN else 4)


_2D = MESHES[2]
_SRC_2D = _layouts(_2D)


@pytest.mark.parametrize("src", _SRC_2D, ids=_fmt)
def test_two_axes_matrix(src):
    """Every dst for this src on the 2 x 2 mesh, with dims that divide."""
    compared, refused = _check(_2D, EVEN, [(src, dst) for dst in _layouts(_2D)])
    assert compared + refused == len(PLACEMENTS) ** 2 and compared > 0


@pytest.mark.slow
def test_two_axes_matrix_uneven():
    """On the 2 x 2 mesh a dim of 6 divides either axis but not both (a PlanError,
    never a crash); the pairs that leave it whole or on one axis still run."""
    compared, refused = _check(_2D, UNEVEN, _cases(_2D, UNEVEN))
    assert compared + refused == len(PLACEMENTS) ** 4 and compared > 0 and refused > 0


def test_nested_shard_order_regression():
    """Found by the fuzz (issue 15): ``{dp: S(0), tp: R} -> {dp: S(1), tp: S(1)}`` sliced tp
    before the dp all-to-all, leaving rank (i, j) with chunk 2j+i of dim 1; and
    ``{dp: S(1), tp: S(1)} -> {dp: R, tp: S(1)}`` gathered only over dp."""
    pairs = [({"dp": Shard(0), "tp": Replicate()}, {"dp": Shard(1), "tp": Shard(1)}),
             ({"dp": Shard(1), "tp": Shard(1)}, {"dp": Replicate(), "tp": Shard(1)}),
             ({"dp": Shard(1), "tp": Shard(1)}, {"dp": Shard(0), "tp": Shard(1)})]
    assert _check(_2D, EVEN, pairs) == (3, 0)
