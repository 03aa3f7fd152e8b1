"""Rules for views and reshapes: ``view``/``reshape``/``flatten``, ``transpose``/``permute``,
``expand``, ``split``/``chunk``, ``cat``/``stack``, ``narrow``, ``repeat_interleave``.

A sharded dim may move, never be cut: a reshape keeps it the outermost of a merged
group, a split or cat leaves it whole.  The output of a fused projection
(``colwise(splits=...)``, ``TensorInfo.blocks``) may be split into its parts.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxshard.layout.op_rules.context import R, Ctx, layout_map, origin_of
from fxshard.layout.op_rules.numbers import number_axes, traced_int
from fxshard.layout.op_rules.pointwise import shard_broadcast
from fxshard.layout.op_rules.table import register_rule
from fxshard.layout.placements import fmt_layout
from fxshard.meta import Rewrite, TensorInfo


def view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape ``a -> b`` into groups of input dims and output dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i); pa *= a[i]; i += 1
            elif j < len(b):
                outs.append(j); pb *= b[j]; j += 1
            else:
                break
        groups.append((ins, outs))
    return groups


def _is_blocked_dim(x: TensorInfo, d: int) -> bool:
    """Does dim ``d`` of ``x`` carry the parts of a fused projection (``x.blocks``)?
    The parts are those of the dim sharded like the fused weight: of the sharded dims
    of their total size, the innermost (a linear's output features, not a batch dim
    sharded on another axis that happens to have that size)."""
    if x.blocks is None:
        return False
    dims = [p.dim for p in x.layout.values() if isinstance(p, Shard) and x.shape[p.dim] == sum(x.blocks)]
    return bool(dims) and d == max(dims)


def _blocked_view(ctx: Ctx, x: TensorInfo, axis: str, ins: list[int], outs: list[int], a, b) -> Shard | None:
    """The layout of a view of a fused projection's output (``colwise(splits=...)``)
    on the dim that carries the parts, or None when the view leaves that dim as it is.

    Each rank holds ``[its slice of part 0 | its slice of part 1 | ...]``: not a
    contiguous chunk of the dim, so the usual rule (the outermost output dim is
    sharded) would give wrong numbers.  The view is a shard only when it keeps the
    parts outermost: equal parts, the leading output dims enumerate exactly the parts
    (``[..., 3 * D] -> [..., 3, H, hd]``), and the first dim of the rest divides by the
    axis; then the dim after the parts is sharded.  Anything else is refused.
    """
    d = x.layout[axis].dim
    blocks = x.blocks
    ins_big = [i for i in ins if a[i] != 1]
    outs_big = [o for o in outs if b[o] != 1]
    if ins_big == [d] and len(outs_big) == 1 and b[outs_big[0]] == a[d]:
        return None  # the blocked dim passes through unchanged (squeeze/unsqueeze/other dims)
    k, n = len(blocks), ctx.axes[axis]
    if ins_big == [d] and len(set(blocks)) == 1:
        prod, j = 1, 0
        while j < len(outs_big) and prod < k:
            prod *= b[outs_big[j]]
            j += 1
        rest = outs_big[j:]
        if prod == k and rest and b[rest[0]] % n == 0:
            return Shard(rest[0])
    src = ctx.arg(0)
    view = [b[o] for o in outs]
    owner = f"module `{src.args[1]}`" if getattr(src.target, "__name__", "") == "region_output" else "the projection that produces it"
    raise ctx.fail(
        f"reshape {list(a)} -> {list(b)} splits dim {d} (sharded on {axis!r}) of {origin_of(src)}, a fused "
        f"projection's output (splits={list(blocks)}): each rank holds its slice of every part, "
        f"[part 0 slice | part 1 slice | ...], which is not a contiguous shard of the view {view} of that dim "
        f"(the fused layout does not match this grouped view)",
        f"drop splits= from colwise({axis!r}) of {owner} when the view's outermost dim ({view[0] if view else '?'}) "
        f"is what should be sharded (each rank then holds whole groups, e.g. torchtitan's n_kv groups of "
        f"[q heads, k, v]), or use separate projections for the parts; splits= fits only a view that keeps "
        f"the parts outermost ([..., {k}, ...] with equal parts)")


@register_rule(torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze, torch.view_as_complex,
               torch.view_as_real, "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze")
def reshape_like(ctx: Ctx):
    """view/reshape/flatten/unflatten/squeeze/unsqueeze/view_as_complex/view_as_real."""
    x = ctx.t(0)
    a, b = tuple(x.shape), tuple(ctx.val.shape)
    groups = view_groups(a, b)

    def one(axis):
        p = x.layout[axis]
        if not isinstance(p, Shard):
            return p
        for ins, outs in groups:
            if p.dim in ins:
                if _is_blocked_dim(x, p.dim):
                    blocked = _blocked_view(ctx, x, axis, ins, outs, a, b)
                    if blocked is not None:
                        return blocked
                if any(a[d] != 1 for d in ins[: ins.index(p.dim)]):
                    break
                o = next((d for d in outs if b[d] != 1), None)
                if o is None or (b[o] % ctx.axes[axis] and b[o] != a[p.dim]):  # unequal pieces: kept whole, never split
                    break
                if b[o] != a[p.dim] and a[p.dim] % ctx.axes[axis]:
                    break
                return Shard(o)
        fix = "keep the sharded dim the outermost of any merged group (e.g. shard heads, not head_dim), or make it Replicate before the reshape"
        n = ctx.axes[axis]
        if a[p.dim] % n:  # torch.chunk pieces of unequal size cannot be regrouped
            raise ctx.fail(f"reshape {list(a)} -> {list(b)} splits or merges dim {p.dim} of size {a[p.dim]}, which is "
                           f"sharded on {axis!r} in unequal pieces ({piece_sizes(a[p.dim], n)}), so they are not a shard of "
                           f"the result", f"use a size of {axis!r} that divides {a[p.dim]} (for heads: one that divides the "
                           f"head count), or make the dim Replicate before the reshape")
        for ins, outs in groups:  # [.., h * d] -> [.., h, d] with fewer heads than ranks: GQA's KV heads at a large tp
            real = [d for d in outs if b[d] != 1]
            if ins == [p.dim] and len(real) == 2 and b[real[0]] < n and n % b[real[0]] == 0:
                fix = (f"these are {b[real[0]]} heads on the {n} ranks of {axis!r}: plan the projection that makes them "
                       f"fxshard.colwise({axis!r}, heads={b[real[0]]}), so each head is held by the {n // b[real[0]]} ranks "
                       f"whose query heads use it; or " + fix)
        raise ctx.fail(f"reshape {list(a)} -> {list(b)} splits or merges dim {p.dim}, which is sharded on {axis!r}, "
                       "so the local pieces are not a shard of the result", fix)

    return layout_map(ctx, one)


def piece_sizes(size: int, n: int) -> str:
    """``"3, 3, 2"``: the sizes of ``torch.chunk``'s pieces of ``size`` over ``n`` ranks, for messages."""
    from fxshard.layout.placements import chunk

    return ", ".join(str(chunk(size, n, i)[1]) for i in range(n))


def like_other(rule: Callable) -> Callable:
    """``x.view_as(other)`` / ``reshape_as`` / ``expand_as``: each rank takes the *local*
    shape of ``other``, so the result is right only where that is the result's local
    shape (``other`` laid out like the result, where it is sharded)."""

    def wrapped(ctx: Ctx):
        out = rule(ctx)
        other = ctx.t(1)
        if other is not None:
            from fxshard.layout.placements import local_shape

            try:
                want = local_shape(ctx.val.shape, out, ctx.axes)
            except ValueError:
                want = None
            if want != tuple(other.local_shape):
                raise ctx.fail(f"{ctx.node.target} takes the local shape {list(other.local_shape)} of `{ctx.arg(1).name}` "
                               f"({fmt_layout(other.layout)}), but the result laid out {fmt_layout(out)} has local shape "
                               f"{list(want) if want else '?'}",
                               f"lay `{ctx.arg(1).name}` out like the result, or use view/expand with explicit sizes")
        return out

    wrapped.__name__ = f"{getattr(rule, '__name__', 'rule')} (like other)"
    return wrapped


def permute_like(kind: str):
    def rule(ctx: Ctx):
        x = ctx.t(0)
        nd = len(x.shape)
        if kind == "transpose":
            d0, d1 = ctx.arg(1, "dim0"), ctx.arg(2, "dim1")
            d0, d1 = d0 % nd, d1 % nd
            perm = list(range(nd)); perm[d0], perm[d1] = perm[d1], perm[d0]
        elif kind == "t":
            perm = list(range(nd))[::-1]
        else:
            dims = ctx.node.args[1:] if len(ctx.node.args) > 2 or isinstance(ctx.arg(1), int) else ctx.arg(1, "dims")
            perm = [d % nd for d in dims]
        inv = {src: dst for dst, src in enumerate(perm)}
        return layout_map(ctx, lambda axis: Shard(inv[x.layout[axis].dim]) if isinstance(x.layout[axis], Shard) else x.layout[axis])

    rule.__name__ = kind
    return rule


register_rule(torch.transpose, "transpose")(permute_like("transpose"))
register_rule(torch.permute, "permute")(permute_like("permute"))
register_rule(torch.t, "t")(permute_like("t"))


@register_rule("expand")
def expand(ctx: Ctx):
    """``x.expand(*sizes)``: sharded dims stay sharded.  (A Replicate dim sized at run time
    by a sharded dim gets the global size back from ``localize``; a broadcast that meets a
    sharded operand is sharded like it, see :func:`shard_broadcast`.)"""
    x = ctx.t(0)
    off = ctx.out_ndim - len(x.shape)
    return layout_map(ctx, lambda axis: Shard(x.layout[axis].dim + off) if isinstance(x.layout[axis], Shard) else x.layout[axis])


register_rule("view_as", "reshape_as")(like_other(reshape_like))
register_rule("expand_as")(like_other(expand))


@register_rule(torch.repeat_interleave, "repeat_interleave")
def repeat_interleave(ctx: Ctx):
    x = ctx.t(0)
    dim = ctx.arg(2, "dim")
    reps = ctx.arg(1, "repeats")

    def one(axis):
        p = x.layout[axis]
        if isinstance(p, Shard):
            if dim is None or not isinstance(reps, int):
                raise ctx.fail(f"repeat_interleave on a tensor sharded on {axis!r} needs an int repeats and a dim", "pass dim= and an int")
            return p
        return p

    return layout_map(ctx, one)


@register_rule(torch.split, torch.chunk, "split", "chunk")
def split(ctx: Ctx):
    """split/chunk.  Splitting a sharded dim is legal only into the parts of a fused
    projection (``colwise(splits=...)``), whose every part each rank holds a slice of."""
    x = ctx.t(0)
    nd = len(x.shape)
    dim = ctx.arg(2, "dim", 0)
    dim = dim + nd if dim < 0 else dim
    for axis, p in x.layout.items():
        if isinstance(p, Shard) and p.dim == dim:
            pieces = [v.shape[dim] for v in ctx.val]
            if x.blocks is None or tuple(pieces) != tuple(x.blocks):
                src = ctx.arg(0).name
                parts = f" (its parts are {list(x.blocks)})" if x.blocks else ""
                raise ctx.fail(f"split along dim {dim}, which is sharded on {axis!r}, into pieces {pieces}{parts}: each rank holds "
                               f"a slice of every piece only if the producing weight was sharded part by part",
                               f"shard the fused weight part by part: colwise({axis!r}, splits={pieces}) on the module that produces `{src}`")
    return [dict(x.layout) for _ in ctx.val]


def cat(stack: bool):
    def rule(ctx: Ctx):
        tensors = ctx.arg(0, "tensors")
        infos = [ctx.info_of(t) for t in tensors]
        nd = len(infos[0].shape)
        dim = ctx.arg(1, "dim", 0)
        dim = dim % (nd + 1 if stack else nd)

        def one(axis):
            ps = {ti.layout[axis] for ti in infos}
            shards = {p for p in ps if isinstance(p, Shard)}
            if not stack and len(shards) == 1 and ps - shards == {R}:  # MLA: cat([k_nope, k_pe.expand(...)])
                (sh,) = shards
                if all(ti.layout[axis] == sh or shard_broadcast(ctx, t, axis, sh.dim) for t, ti in zip(tensors, infos)):
                    ps = shards
            if len(ps) != 1:
                raise ctx.fail(f"{'stack' if stack else 'cat'} of tensors with different layouts on {axis!r}", "give all inputs the same layout")
            (p,) = ps
            if isinstance(p, Shard):
                if not stack and p.dim == dim:
                    raise ctx.fail(f"cat along dim {dim}, which is sharded on {axis!r}", "concatenate along another dim or make it Replicate")
                if stack and p.dim >= dim:
                    return Shard(p.dim + 1)
            return p

        return layout_map(ctx, one)

    rule.__name__ = "stack" if stack else "cat"
    return rule


register_rule(torch.cat, torch.concat)(cat(False))
register_rule(torch.stack)(cat(True))


@register_rule(torch.narrow, "narrow")
def narrow(ctx: Ctx):
    """``torch.narrow(x, dim, start, length)``: a slice of a dim that must not be sharded;
    ``start``/``length`` read at run time are rescaled to that dim by ``localize``.

    ``table.narrow(0, 0, S)`` of a Replicate table with ``S`` the length of a dim
    sharded on one context-parallel axis (rotary tables sliced to the sequence) is the
    table at this rank's positions: ``Shard(dim)`` there, and ``localize`` picks the
    rows (``Rewrite.NARROW_POSITIONS``)."""
    x = ctx.t(0)
    nd = len(x.shape)
    dim = traced_int(ctx, ctx.arg(1, "dim")) % nd
    start, length = ctx.arg(2, "start"), ctx.arg(3, "length")
    pos_axis = None
    if start == 0 and isinstance(length, fx.Node) and ctx.cp_axes:
        axes = number_axes(length)
        if axes is not None and len(axes) == 1 and next(iter(axes)) in ctx.cp_axes:
            (pos_axis,) = axes

    def one(axis):
        p = x.layout[axis]
        if isinstance(p, Shard) and p.dim == dim:
            raise ctx.fail(f"narrow of dim {dim}, which is sharded on {axis!r}", "narrow a Replicate dim, or narrow before sharding")
        if axis == pos_axis and isinstance(p, Replicate):
            ctx.request_rewrite(Rewrite.NARROW_POSITIONS)
            return Shard(dim)
        return p

    return layout_map(ctx, one)
