"""Where a rank's local tensor sits inside the global one.

A layout (one placement per mesh axis) cuts a tensor dim by dim, so a rank's local
tensor is a *box product*: along each dim, its indices are a few runs of consecutive
global indices (one run, or one per part of a fused parameter such as ``qkv_proj``).
Every tensor-moving feature reads this geometry from here -- materializing and
initialising shards (:mod:`fxshard.materialize`), reading slices of an HF checkpoint
(:mod:`fxshard.hf_checkpoint`), writing and reading DCP chunks
(:mod:`fxshard.checkpoint`) -- so no two of them can disagree on which elements a rank
holds.  It is the same cut as ``shard_state``'s ``local_slice`` (tested to agree),
with ``torch.chunk`` semantics where an axis does not divide a dim (DTensor's
``Shard``: the last ranks hold less, possibly nothing).

Example::

    runs = shard_runs({"tp": Shard(0)}, (12, 4), {"tp": 4}, {"tp": 1})
    # [[(3, 3)], [(0, 4)]]: rows 3..5, all columns
    for box in boxes(runs):
        local[box.local] = full[box.glob]
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import Shard

from fxshard.layout.placements import HeadReplicas, blocks_on, chunk
from fxshard.plan.mesh import mesh_coordinate, mesh_shape
from fxshard.meta import program_meta

Run = tuple[int, int]  # (first global index, length)
Runs = list[list[Run]]  # per dim, in local order


def local_slice(t: torch.Tensor, layout: dict, mesh, blocks: tuple[int, ...] | None = None,
                heads: HeadReplicas | None = None) -> torch.Tensor:
    """This rank's shard of a global tensor (mesh axes in order: outer axes chunk first).
    With ``blocks`` (a fused parameter), each part of the sharded dim is sliced on its
    own and the slices are concatenated.  With ``heads`` (replicated heads), the dim is
    cut into ``heads.heads`` pieces on ``heads.axis``, each held by consecutive ranks."""
    axes, coord = mesh_shape(mesh), mesh_coordinate(mesh)
    lm = enabled_local_tensor_mode()
    if lm is not None and not hasattr(t, "_local_tensors"):
        t = lm.rank_map(lambda r, t=t: t.clone())  # per-rank copies, then per-rank slices
    for axis, p in layout.items():
        if isinstance(p, Shard):
            sizes = blocks_on(blocks, p.dim)
            parts = t.split(list(sizes), p.dim) if sizes else (t,)
            pieces = []
            ranks, index = axes[axis], coord[axis]
            if heads is not None and heads.axis == axis and ranks > heads.heads:
                ranks, index = heads.heads, index // (ranks // heads.heads)
            for part in parts:  # torch.chunk pieces: the last ranks hold less where the axis does not divide
                size = part.shape[p.dim]
                pieces.append(part.narrow(p.dim, index * (size // ranks), size // ranks) if size % ranks == 0
                              else part.narrow(p.dim, *chunk(size, ranks, index)))
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, p.dim)
    return t


def take(runs: list[Run], start: int, length: int) -> list[Run]:
    """The runs of local positions ``[start, start + length)`` of a dim made of ``runs``."""
    out, pos = [], 0
    for g, n in runs:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
    return out


def shard_runs(layout: dict | None, shape: Sequence[int], axes: dict, coord: dict,
               blocks: Sequence[int] | None = None, heads: HeadReplicas | None = None) -> Runs:
    """Runs of global indices per dim of this rank's shard of a tensor of global
    ``shape`` (outer mesh axes cut first, as ``local_slice``).  With ``blocks`` (the
    part sizes of a fused parameter's sharded dim), each part is cut on its own; with
    ``heads`` (replicated heads), the consecutive ranks sharing a head hold the same run."""
    runs: Runs = [[(0, int(s))] for s in shape]
    for axis, p in (layout or {}).items():
        if not isinstance(p, Shard):
            continue
        d, n, i = p.dim, axes[axis], coord[axis]
        if heads is not None and heads.axis == axis and n > heads.heads:
            n, i = heads.heads, i // (n // heads.heads)
        parts, pos = [], 0
        for size in (blocks_on(blocks, d) or (sum(k for _, k in runs[d]),)):
            parts.append((pos, size))
            pos += size
        cut = []
        for start, size in parts:
            s, k = chunk(size, n, i)
            cut += take(runs[d], start + s, k)
        runs[d] = cut
    return runs


def local_shape(runs: Runs) -> tuple[int, ...]:
    return tuple(sum(k for _, k in dim) for dim in runs)


@dataclass(frozen=True)
class Box:
    """One rectangular piece of a shard: ``local[box.local] == full[box.glob]``."""

    glob: tuple[slice, ...]
    local: tuple[slice, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(s.start for s in self.glob)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.glob)


def boxes(runs: Runs) -> Iterator[Box]:
    """The shard's rectangular pieces (one for an ordinary shard, one per part of a
    fused one); empty pieces (an uneven axis's last ranks) are skipped."""
    per_dim = []
    for dim in runs:
        pieces, pos = [], 0
        for g, n in dim:
            pieces.append((slice(g, g + n), slice(pos, pos + n)))
            pos += n
        per_dim.append(pieces)
    for combo in itertools.product(*per_dim):
        if all(g.stop > g.start for g, _ in combo):
            yield Box(tuple(g for g, _ in combo), tuple(loc for _, loc in combo))


def assemble(runs: Runs, read: Callable[[Box], torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (the local tensor) box by box from ``read(box)`` (the global
    tensor's ``box.glob`` piece, from a full tensor, a file or a shadow)."""
    with torch.no_grad():
        for box in boxes(runs):
            out[box.local].copy_(read(box))
    return out


def runs_of(gm, fqn: str, mesh, local: torch.Tensor) -> Runs:
    """The runs of ``gm``'s state tensor ``fqn`` on this rank (``gm`` from
    :func:`fxshard.transform`).  A tensor FSDP2 also sharded (a ``DTensor`` over the FSDP
    axis, cut in ``torch.chunk`` pieces of fxshard's shard along the dim its placement names: dim 0,
    or dim 1 of an ep rank's stacked experts, ``fxshard.fully_shard``'s rule) is cut once more."""
    from torch.distributed.tensor import DTensor

    from fxshard.plan.mesh import mesh_coordinate, mesh_shape

    program = program_meta(gm)
    layout, shape = program.state.get(fqn, (None, None))
    if shape is None:  # replicated everywhere (fxshard never read it): the local tensor is the whole
        shape = tuple(local.shape)
    runs = shard_runs(layout, shape, mesh_shape(mesh), mesh_coordinate(mesh), program.blocks.get(fqn),
                      program.heads.get(fqn))
    if isinstance(local, DTensor):  # FSDP2's mesh: 1-D, or HSDP's (replicate, shard)
        for i, p in enumerate(local.placements):
            if isinstance(p, Shard):
                k = local.device_mesh.get_local_rank(i)
                s, n = chunk(local.shape[p.dim], local.device_mesh.size(i), k)
                runs[p.dim] = take(runs[p.dim], s, n)
    return runs


def copies(layout: dict | None, axes: dict, heads: HeadReplicas | None = None, distinct_axes=()) -> int:
    """How many ranks of the mesh hold the same box as this one: the product of the
    sizes of the axes the layout does not shard (a replicated norm weight on ``tp=2``:
    2), the ``size // heads`` ranks that share a replicated KV head, and nothing over
    ``distinct_axes`` (axes on which each rank holds its own piece although the layout
    does not say so: FSDP2's piece, on whichever dim, a module-list expert that lives on one rank).
    A sum over boxes (a norm, a count) counts each box once by weighting it ``1 / copies``."""
    n = 1
    for axis, size in axes.items():
        p = (layout or {}).get(axis)
        if axis in distinct_axes:
            continue
        if isinstance(p, Shard):
            if heads is not None and heads.axis == axis and size > heads.heads:
                n *= size // heads.heads
            continue
        n *= size
    return n


def copies_of(gm, fqn: str, local: torch.Tensor, owned_axes: dict | None = None) -> int:
    """:func:`copies` of ``gm``'s state tensor ``fqn`` (``gm`` from :func:`fxshard.transform`),
    as this rank holds it: a ``DTensor`` that FSDP2 sharded is distinct over its mesh's
    sharded dims; ``owned_axes`` (``{fqn prefix: axis}``, from :func:`owned_children`)
    marks the children of local regions that live on one rank of an axis."""
    from torch.distributed.tensor import DTensor

    program = program_meta(gm)
    layout, _ = program.state.get(fqn, (None, None))
    distinct = set()
    replicas = 1
    if isinstance(local, DTensor):  # a flattened FSDP2 dim ("dp_cp") spans several of the plan's axes
        names = local.device_mesh.mesh_dim_names or ()
        spans = program.fsdp_mesh or {}
        for i, (name, p) in enumerate(zip(names, local.placements)):
            span = spans.get(name, (name,))
            if isinstance(p, Shard):
                distinct |= set(span)
            elif not span:  # HSDP's replicate dim: a part of the batch axis the shard dim is distinct over
                replicas *= local.device_mesh.size(i)
    for prefix, axis in (owned_axes or {}).items():
        if fqn.startswith(prefix + "."):
            distinct.add(axis)
    return copies(layout, program.mesh or {}, program.heads.get(fqn), distinct) * replicas


def owned_children(gm) -> dict[str, str]:
    """``{child fqn: axis}``: the children of ``gm``'s local regions that live on one rank
    of an axis each (module-list experts under expert parallelism)."""
    from fxshard.meta import KEY, LocalRegion

    out = {}
    for node in gm.graph.nodes:
        m = node.meta.get(KEY)
        region = getattr(m, "declared", None) if m is not None else None
        if isinstance(region, LocalRegion):
            out.update({child: axis for child, (axis, _) in region.owners.items()})
    return out
