"""Rules for ops that make new tensors: ``torch.arange``/``zeros``/``ones``/``full``/``empty``,
``*_like``, ``x.new_*``, ``tril``/``triu`` masks, and ``copy_`` into a buffer.

A new tensor is Replicate unless its layout follows from the tensor it is made like or
the parts written into it: each rank then builds its own part.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.layout.op_rules.context import R, Ctx, flat_args, layout_map, op_name
from fxshard.layout.op_rules.numbers import is_number_node, number_axes, scalar_value, sharded_source
from fxshard.layout.op_rules.pointwise import shard_broadcast
from fxshard.layout.op_rules.table import register_rule
from fxshard.layout.placements import fmt_placement
from fxshard.meta import Rewrite, SizeInfo, TensorInfo


@register_rule(torch.arange, torch.zeros, torch.ones, torch.full, torch.empty)
def factory(ctx: Ctx):
    """torch.arange/zeros/ones/full/empty: a new tensor, Replicate, sized by literals or
    by sizes every rank sees alike.  A size of a sharded dim (each rank's local size)
    would build a local tensor that is not the single-device one laid out Replicate
    (``arange(local_t)`` gives the first positions, not this rank's), so it is refused --
    except ``arange(n)`` with ``n`` the size of a dim sharded on one axis (HF's mask
    builder: ``torch.arange(batch_size)``): that is ``Shard(0)`` there, and ``localize``
    adds this rank's offset (``Rewrite.ARANGE_OFFSET``)."""
    if ctx.node.target is torch.arange and _arange_of_size(ctx.node) is not None:
        axes = number_axes(_arange_of_size(ctx.node))
        if axes is not None and len(axes) == 1 and isinstance(ctx.val, torch.Tensor):
            ctx.request_rewrite(Rewrite.ARANGE_OFFSET)
            (axis,) = axes
            return {a: Shard(0) if a == axis else R for a in ctx.axes}
    for a in flat_args(ctx.node.args, ctx.node.kwargs):
        if isinstance(a, fx.Node) and (isinstance(ctx.info_of(a), SizeInfo) or is_number_node(a)):
            axes = number_axes(a)
            if axes is None or axes:
                raise ctx.fail(f"{op_name(ctx.node)} is sized by `{a.name}`, computed at run time from {sharded_source(a)}: each rank "
                               f"would build a tensor from its local size, not the single-device tensor",
                               "size it with a literal (the global size) or with a size read from a dim that is not sharded")
    if not isinstance(ctx.val, torch.Tensor):
        return scalar_value(ctx)
    return {axis: R for axis in ctx.axes}


def _arange_of_size(node: fx.Node) -> fx.Node | None:
    """``n`` of ``torch.arange(n)`` / ``torch.arange(0, n)`` read at run time, else None."""
    args = node.args
    if len(args) == 1 and isinstance(args[0], fx.Node):
        return args[0]
    if len(args) == 2 and args[0] == 0 and not isinstance(args[0], bool) and isinstance(args[1], fx.Node):
        return args[1]
    return None


_aten = torch.ops.aten
FILL_LIKE = (torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like, torch.rand_like,
             torch.randn_like, torch.randint_like,  # and as torch.export records them:
             _aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default, _aten.full_like.default,
             _aten.rand_like.default, _aten.randn_like.default, _aten.randint_like.default, _aten.randint_like.low_dtype)


@register_rule(*FILL_LIKE)
def fill_like(ctx: Ctx):
    """``torch.ones_like(x)`` and the other ``*_like``: a new tensor of ``x``'s *local* shape
    on each rank.  Constant (or random) fill has no position, so that is the global result
    laid out like ``x`` -- except that a Partial ``x`` has the whole shape on each rank:
    the result is Replicate there."""
    x = ctx.t(0, "input")
    if x is None:
        return {a: R for a in ctx.axes}
    return layout_map(ctx, lambda axis: R if isinstance(x.layout[axis], Partial) else x.layout[axis])


@register_rule("new_empty", "new_zeros", "new_ones", "new_full")
def fresh_like(ctx: Ctx):
    """``x.new_empty(sizes)`` / ``new_zeros`` / ``new_ones``: a new tensor, Replicate --
    unless it is a buffer assembled from parts written into it that are sharded alike
    (HF's MLA keys: ``k = kv.new_empty(...)``, ``k[..., :nope].copy_(k_nope)`` with
    ``k_nope`` head-sharded): then every rank builds its own part, sharded like them
    (``localize`` shrinks a literal size), and a Replicate part written next must be
    broadcast along that dim (``copy_``)."""
    nd = ctx.out_ndim

    def one(axis):
        proposed = set(_written_parts(ctx.node, nd, axis))
        return proposed.pop() if len(proposed) == 1 else R

    return layout_map(ctx, one)


def _written_parts(buffer: fx.Node, nd: int, axis: str):
    """The ``Shard`` s on ``axis`` (in ``buffer``'s dims) of values already laid out that are
    copied into ``buffer`` or into a basic slice of it that keeps that dim whole."""
    for view in buffer.users:
        if view.op == "call_function" and view.target is operator.getitem:
            dims = _basic_slices(view.args[1], nd)
            if dims is None:
                continue
        else:
            view, dims = buffer, [slice(None)] * nd
        for w in view.users if view is not buffer else [view]:
            if not (w.op == "call_function" and w.target is torch.ops.aten.copy_.default or w.op == "call_method" and w.target == "copy_"):
                continue
            if w.args[0] is not view:
                continue
            src = Ctx.info_of(w.args[1])
            p = src.layout.get(axis) if isinstance(src, TensorInfo) else None
            if isinstance(p, Shard):
                d = p.dim + nd - len(src.shape)
                if 0 <= d < nd and dims[d] == slice(None):
                    yield Shard(d)


def _basic_slices(idx, nd: int) -> list | None:
    """``x[idx]`` as one slice per dim of ``x`` when ``idx`` is slices and ``...`` only (a
    view that keeps every dim), else None."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if not all(isinstance(i, slice) or i is Ellipsis for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (nd - len(items) + 1) + items[at + 1:]
    return items + [slice(None)] * (nd - len(items)) if len(items) <= nd else None


@register_rule(torch.ops.aten.copy_.default, "copy_")
def copy_into(ctx: Ctx):
    """``dst.copy_(src)`` (an in-place slice assignment, ``k[..., 64:] = k_pe``): each rank
    writes its part of ``src`` into its part of ``dst``, so ``src`` must be laid out like
    ``dst`` or be Replicate and broadcast along the dims ``dst`` is sharded on."""
    dst, src = ctx.t(0), ctx.t(1)
    off = len(dst.shape) - len(src.shape)

    def one(axis):
        pd, ps = dst.layout[axis], src.layout[axis]
        if isinstance(ps, Shard):
            ps = Shard(ps.dim + off)  # in dst's dims (src broadcasts from the right)
        if ps == pd:
            if isinstance(pd, Shard) and src.shape[pd.dim - off] != dst.shape[pd.dim]:
                raise ctx.fail(f"copies a value sharded on a broadcast dim into one sharded on dim {pd.dim} on {axis!r}",
                               "make the copied value Replicate")
            return pd
        if isinstance(ps, Replicate) and isinstance(pd, Shard):
            sd = pd.dim - off
            if sd < 0 or src.shape[sd] == 1 or shard_broadcast(ctx, ctx.arg(1), axis, sd):
                return pd
        raise ctx.fail(f"copies a {fmt_placement(ps)} value into a {fmt_placement(pd)} one on axis {axis!r}: the ranks' "
                       "parts do not line up", "give the copied value the layout of its destination in the plan, or make both Replicate")

    return layout_map(ctx, one)


@register_rule(torch.tril, torch.triu, torch.ops.aten.tril.default, torch.ops.aten.triu.default, "tril", "triu")
def triangle(ctx: Ctx):
    """``tril`` / ``triu``: a mask over the last two dims by their positions.  Other dims
    may be sharded (the heads of a causal mask ``[H, T, T]``); the last two must be whole,
    or a rank would compare its local positions.  It is linear: a Partial stays one."""
    x = ctx.t(0, "input")
    nd = len(x.shape)

    def one(axis):
        p = x.layout[axis]
        if isinstance(p, Shard) and p.dim >= nd - 2:
            raise ctx.fail(f"{op_name(ctx.node)} over dim {p.dim}, which is sharded on {axis!r}: each rank would mask by "
                           f"its local positions", "build the mask before sharding that dim, or keep it Replicate")
        return p

    return layout_map(ctx, one)
