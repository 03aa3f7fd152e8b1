"""Layouts: one ``torch.distributed.tensor`` placement per mesh axis.

Plans write layouts by axis name (``{"tp": Shard(0)}``, an axis left out is
``Replicate()``).  Inside fxshard a layout is always *complete*: a dict with every
mesh axis in mesh order, and ``Shard`` dims made non-negative once the tensor rank
is known.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxshard.errors import PlanError

Layout = dict  # {axis_name: Placement}, complete and in mesh order

R = Replicate()


class DimBlocks(NamedTuple):
    """The part sizes of one dim of a packed tensor, each part sharded on its own
    (HF's fused experts ``gate_up_proj [E, 2I, H]``: dim 1 is gate | up).  A plain tuple
    of sizes (``colwise(splits=...)``) means the dim of the one axis that shards it."""

    dim: int
    sizes: tuple[int, ...]


class HeadReplicas(NamedTuple):
    """A parameter's dim 0 holds ``heads`` heads and is sharded over an ``axis`` with more
    ranks than that (``colwise(heads=2)`` on ``tp=4``): rank ``i`` of the axis holds head
    ``i // (size // heads)``, which the ``size // heads`` consecutive ranks share."""

    axis: str
    heads: int


def blocks_on(blocks, dim: int) -> tuple[int, ...] | None:
    """The part sizes ``blocks`` gives dim ``dim`` (None: the dim is cut whole)."""
    if blocks is None:
        return None
    if isinstance(blocks, DimBlocks):
        return tuple(blocks.sizes) if blocks.dim == dim else None
    return tuple(blocks)


def complete(layout: Mapping[str, Placement] | Placement | None, axes: Mapping[str, int], where: str = "") -> dict:
    """Fill missing axes with ``Replicate()``; reject unknown axes and non-placements."""

    if layout is None:
        layout = {}
    if isinstance(layout, Placement):
        if len(axes) != 1:
            raise PlanError(
                f"{where}: a bare placement {fmt_placement(layout)} is ambiguous on the mesh with axes "
                f"{list(axes)}; write it by axis name, e.g. {{{next(iter(axes))!r}: {layout!r}}}"
            )
        layout = {next(iter(axes)): layout}
    if not isinstance(layout, Mapping):
        raise PlanError(f"{where}: a layout is a dict {{axis_name: Placement}}, got {layout!r}")
    for axis, p in layout.items():
        if axis not in axes:
            raise PlanError(
                f"{where}: axis {axis!r} is not on the mesh (axes: {list(axes)}); "
                f"rename it to one of {list(axes)} or add it to the mesh"
            )
        if not isinstance(p, Placement):
            raise PlanError(f"{where}: layout on axis {axis!r} must be Shard(d), Replicate() or Partial(), got {p!r}")
    return {a: layout.get(a, R) for a in axes}


def normalize(layout: dict, ndim: int, where: str = "") -> dict:
    """Make Shard dims non-negative for a tensor of rank ``ndim``."""

    out = {}
    for axis, p in layout.items():
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise PlanError(f"{where}: Shard({p.dim}) on axis {axis!r} but the tensor has {ndim} dims")
            p = Shard(d)
        out[axis] = p
    return out


def is_replicate(layout: dict) -> bool:
    return all(isinstance(p, Replicate) for p in layout.values())


def local_shape(shape, layout: dict, axes: Mapping[str, int]) -> tuple[int, ...]:
    """Local (per-rank) shape of a tensor of global ``shape`` with ``layout``: ``torch.chunk``
    pieces, as DTensor's ``Shard``, so a dim that its axis does not divide is *uneven*
    (vocab 50257 on 4 ranks: 12565, 12565, 12565, 12562) and this is the largest piece,
    rank 0's.  A dim sharded over several axes must divide by their product, and no rank
    may be left without a piece (5 on 4 ranks: 2, 2, 1, 0): ValueError otherwise."""
    shape = list(shape)
    for d in range(len(shape)):
        over = [axes[a] for a, p in layout.items() if isinstance(p, Shard) and p.dim == d]
        if not over:
            continue
        n = 1
        for k in over:
            n *= k
        if len(over) > 1 and shape[d] % n:
            raise ValueError(f"dim {d} of size {shape[d]} is sharded over several axes, whose sizes together ({n}) do not divide it")
        if shape[d] % n and -(-shape[d] // n) * (n - 1) >= shape[d]:
            raise ValueError(f"dim {d} of size {shape[d]} leaves ranks without a piece")  # -1 in a view could not infer
        shape[d] = -(-shape[d] // n)
    return tuple(shape)


def uneven_dims(shape, layout: dict, axes: Mapping[str, int]) -> dict[int, str]:
    """``{dim: axis}`` of the dims that their axis shards in unequal ``torch.chunk`` pieces:
    every local size there differs by rank, so no literal can size it."""
    return {p.dim: a for a, p in layout.items() if isinstance(p, Shard) and p.dim < len(shape) and shape[p.dim] % axes[a]}


def chunk(size: int, n: int, i):
    """``torch.chunk(x, n)[i]`` along a dim of ``size``: ``(start, length)``; ``i`` may be a
    per-rank SymInt (simulated ranks)."""
    import torch

    step = -(-size // n) if size else 0
    start = torch.sym_min(i * step, size)
    return start, torch.sym_min(step, size - start)


def fmt_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    if isinstance(p, Replicate):
        return "R"
    return repr(p)


def fmt_layout(layout: dict | None) -> str:
    """``{tp: S(0), dp: R}`` written compactly, e.g. ``dp=R tp=S(0)``."""
    if layout is None:
        return "-"
    return " ".join(f"{a}={fmt_placement(p)}" for a, p in layout.items())


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def dtype_short(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else str(dtype).replace("torch.", "")
