"""Rules for indexing and lookups: ``x[idx]`` (basic and advanced) and ``F.embedding``."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.layout.op_rules.context import Ctx, layout_map
from fxshard.layout.op_rules.table import register_rule
from fxshard.layout.placements import fmt_placement
from fxshard.meta import Rewrite, SizeInfo, TensorInfo


@register_rule(operator.getitem)
def getitem(ctx: Ctx):
    src, idx = ctx.arg(0), ctx.arg(1)
    v = ctx.info_of(src)
    if isinstance(v, (list, tuple)):
        return v[idx].layout if isinstance(v[idx], TensorInfo) else v[idx]
    if isinstance(v, SizeInfo):
        return SizeInfo(v.value[idx], v.axes[idx] if isinstance(v.axes, tuple) else None)
    if not isinstance(v, TensorInfo):
        return None
    items = idx if isinstance(idx, tuple) else (idx,)
    mapping, advanced, advanced_out = index_map(ctx, items, len(v.shape))

    index_tensors = [(it, ctx.info_of(it)) for it in items if isinstance(ctx.info_of(it), TensorInfo)]

    def one(axis):
        p = v.layout[axis]
        sharded_index = [(it, ti) for it, ti in index_tensors if not isinstance(ti.layout[axis], Replicate)]
        if sharded_index:
            # each rank gathers the entries of its own index shard: a shard of the result only for one
            # index tensor into a Replicate tensor (the index dims replace the indexed dim in place)
            (it, ti) = sharded_index[0]
            if (len(sharded_index) == 1 and len(advanced) == len(index_tensors) and isinstance(p, Replicate)
                    and isinstance(ti.layout[axis], Shard) and all(t.dtype is not torch.bool for _, t in index_tensors)):
                # the index tensors broadcast together (HF's mask: cumsum[batch_idx, kv_idx]); the others must
                # not vary along the sharded dim, and the broadcast dims stand where the indices were when
                # they are adjacent, else in front
                nb = max(len(t.shape) for _, t in index_tensors)
                bd = nb - len(ti.shape) + ti.layout[axis].dim
                if all(len(t.shape) - nb + bd < 0 or t.shape[len(t.shape) - nb + bd] == 1 for o, t in index_tensors if o is not it):
                    adjacent = advanced == list(range(advanced[0], advanced[0] + len(advanced)))
                    return Shard((advanced_out[0] if adjacent else 0) + bd)
            raise ctx.fail(f"indexing with `{it.name}`, which is {fmt_placement(ti.layout[axis])} on {axis!r}, into a "
                           f"{fmt_placement(p)} tensor", "make the index Replicate")
        if isinstance(p, Replicate) or isinstance(p, Partial):
            return p
        m = mapping.get(p.dim)
        if p.dim in advanced or advanced:
            raise ctx.fail(f"advanced indexing of a tensor sharded on {axis!r}", "make it Replicate before indexing")
        if m is None:
            raise ctx.fail(f"indexing selects single entries of dim {p.dim}, which is sharded on {axis!r}", "make that dim Replicate before indexing")
        if isinstance(m, tuple):
            o, s = m
            if s != slice(None) and block_slice(v, p.dim, s) is None:
                if v.blocks is not None and v.shape[p.dim] == sum(v.blocks):
                    raise ctx.fail(f"slicing dim {p.dim} (sharded on {axis!r}, made of the parts {list(v.blocks)}) at {s.start}:{s.stop}, "
                                   f"not at the parts' boundaries", "slice whole parts, or give colwise(splits=...) the parts this code slices")
                raise ctx.fail(f"slicing dim {p.dim}, which is sharded on {axis!r}",
                               "slice a Replicate dim, or slice before sharding; for a fused projection sliced into its parts "
                               "(Phi-3's qkv[..., :q_size]) give it colwise(splits=[sizes of the parts])")
            return Shard(o)
        return Shard(m)

    return layout_map(ctx, one)


def index_map(ctx: Ctx, items: tuple, nd: int):
    """Where each dim of a tensor goes under ``x[items]``: ``{dim: out_dim}`` for dims kept
    whole, ``{dim: (out_dim, slice)}`` for sliced ones, ``{dim: None}`` for dims an int
    selects away; and the input and output dims of advanced (tensor) indices."""
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    mapping, advanced, advanced_out, in_d, out_d = {}, [], [], 0, 0
    for it in items:
        if it is None:
            out_d += 1
        elif it is Ellipsis:
            for _ in range(nd - consumed):
                mapping[in_d] = out_d; in_d += 1; out_d += 1
        elif isinstance(it, slice):
            mapping[in_d] = (out_d, it); in_d += 1; out_d += 1
        elif isinstance(it, int) or isinstance(ctx.info_of(it), SizeInfo):
            mapping[in_d] = None; in_d += 1
        else:
            advanced.append(in_d); advanced_out.append(out_d); in_d += 1; out_d += 1
    while in_d < nd:
        mapping[in_d] = out_d; in_d += 1; out_d += 1
    return mapping, advanced, advanced_out


def block_slice(v: TensorInfo, dim: int, s: slice) -> tuple[int, ...] | None:
    """The parts of a fused projection's output (``v.blocks``) that the literal slice
    ``s`` of its blocked ``dim`` selects whole, or None.  Each rank holds its slice of
    every part, so such a slice is its local part slices: ``localize`` divides the
    bounds by the axis size."""
    size = v.shape[dim]
    if v.blocks is None or size != sum(v.blocks) or s.step not in (None, 1):
        return None
    if not all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in (s.start, s.stop)):
        return None
    start, stop, _ = s.indices(size)
    edges = [0]
    for b in v.blocks:
        edges.append(edges[-1] + b)
    if start not in edges or stop not in edges or start >= stop:
        return None
    return tuple(v.blocks[edges.index(start):edges.index(stop)])


@register_rule(F.embedding)
def embedding(ctx: Ctx):
    ids, w = ctx.t(0, "input"), ctx.t(1, "weight")
    nd = ctx.out_ndim
    vocab = False

    def one(axis):
        nonlocal vocab
        pi, pw = ids.layout[axis], w.layout[axis]
        if isinstance(pw, Replicate):
            if isinstance(pi, Partial):
                raise ctx.fail("embedding ids cannot be Partial", "make the ids Replicate")
            return pi
        if not isinstance(pi, Replicate):
            raise ctx.fail(f"sharded embedding weight ({fmt_placement(pw)}) needs Replicate ids on {axis!r}, got {fmt_placement(pi)}",
                           "shard the ids on another axis, or keep them Replicate")
        if pw == Shard(1):
            return Shard(nd - 1)
        if pw == Shard(0):
            vocab = True
            return Partial()
        raise ctx.fail(f"embedding weight layout {fmt_placement(pw)} on {axis!r}", "use Shard(0) (vocab_parallel), Shard(1) (colwise) or Replicate")

    out = layout_map(ctx, one)
    if vocab:
        ctx.request_rewrite(Rewrite.VOCAB_PARALLEL_EMBEDDING)
    return out
