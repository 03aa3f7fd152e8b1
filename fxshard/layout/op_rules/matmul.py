"""Rules for linear algebra: ``F.linear`` (column- and row-parallel), ``matmul``, ``bmm``, ``outer``."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.layout.op_rules.context import R, Ctx, layout_map, reduce_fix
from fxshard.layout.op_rules.table import register_rule
from fxshard.layout.placements import fmt_placement
from fxshard.meta import Rewrite


@register_rule(F.linear)
def linear(ctx: Ctx):
    x, w, b = ctx.t(0, "input"), ctx.t(1, "weight"), ctx.t(2, "bias")
    n = len(x.shape)
    fqn = ctx.arg(1, "weight").target if isinstance(ctx.arg(1, "weight"), fx.Node) else "weight"
    pending = False

    def one(axis):
        nonlocal pending
        px, pw = x.layout[axis], w.layout[axis]
        pb = b.layout[axis] if b is not None else None
        if isinstance(pw, Replicate):
            if pb is not None and not isinstance(pb, Replicate):
                raise ctx.fail(f"bias is {fmt_placement(pb)} but the weight is Replicate on axis {axis!r}", "shard the bias like the weight (colwise)")
            if isinstance(px, Shard) and px.dim == n - 1:
                raise ctx.fail(f"input is sharded on its feature dim on axis {axis!r} but the weight `{fqn}` is Replicate",
                               f"make this linear rowwise({axis!r}) (weight Shard(1)), or make its input Replicate")
            if isinstance(px, Partial):
                pending = pending or b is not None
            return px
        if isinstance(pw, Shard) and pw.dim == 0:
            if not isinstance(px, Replicate):
                raise ctx.fail(f"column-parallel linear (`{fqn}` Shard(0) on {axis!r}) needs a Replicate input, got {fmt_placement(px)}",
                               f"declare the module's input Replicate on {axis!r} (colwise() does), so it is gathered/reduced on entry")
            if pb is not None and pb != Shard(0):
                raise ctx.fail(f"column-parallel linear needs its bias Shard(0) on {axis!r}, got {fmt_placement(pb)}", "shard the bias with the weight (colwise)")
            return Shard(n - 1)
        if isinstance(pw, Shard) and pw.dim == 1:
            if px != Shard(n - 1):
                raise ctx.fail(f"row-parallel linear (`{fqn}` Shard(1) on {axis!r}) needs its input Shard(-1), got {fmt_placement(px)}",
                               f"declare the module's input Shard(-1) on {axis!r} (rowwise() does)")
            if pb is not None and not isinstance(pb, Replicate):
                raise ctx.fail(f"row-parallel linear needs a Replicate bias on {axis!r}, got {fmt_placement(pb)}", "leave the bias out of params (it is added once after the reduction)")
            pending = pending or b is not None
            return Partial()
        raise ctx.fail(f"weight `{fqn}` has layout {fmt_placement(pw)} on {axis!r}", "use Shard(0) (colwise), Shard(1) (rowwise) or Replicate")

    out = layout_map(ctx, one)
    if pending:
        ctx.request_rewrite(Rewrite.DEFER_BIAS)
    return out


@register_rule(operator.matmul, torch.matmul, torch.bmm, "matmul")
def matmul(ctx: Ctx):
    a, b = ctx.t(0), ctx.t(1)
    na, nb, no = len(a.shape), len(b.shape), ctx.out_ndim
    if na < 2 or nb < 2:
        if a.layout == b.layout and all(isinstance(p, Replicate) for p in a.layout.values()):
            return a.layout
        raise ctx.fail("matmul with a 1-D operand on sharded inputs", "reshape to 2-D or keep the operands Replicate")

    def out_dim_a(d):
        return None if d == na - 1 else d + no - na

    def out_dim_b(d):
        return None if d == nb - 2 else d + no - nb

    def one(axis):
        pa, pb = a.layout[axis], b.layout[axis]
        if isinstance(pa, Replicate) and isinstance(pb, Replicate):
            return R
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            if isinstance(pa, Partial) and isinstance(pb, Replicate) or isinstance(pb, Partial) and isinstance(pa, Replicate):
                return pa if isinstance(pa, Partial) else pb  # bilinear: the Partial's kind (sum or avg) carries over
            raise ctx.fail(f"matmul of {fmt_placement(pa)} and {fmt_placement(pb)} on axis {axis!r}", reduce_fix(axis))
        da = out_dim_a(pa.dim) if isinstance(pa, Shard) else "R"
        db = out_dim_b(pb.dim) if isinstance(pb, Shard) else "R"
        if da is None and db is None:
            return Partial()
        if da is None or db is None:
            raise ctx.fail(f"only one operand is sharded on the contracted dim on axis {axis!r}", "shard both operands on the contracted dim, or neither")
        d = da if da != "R" else db
        if da != "R" and db != "R" and da != db:
            raise ctx.fail(f"operands sharded on different result dims ({da} and {db}) on axis {axis!r}", "shard them on the same batch dim")
        # a replicated operand must broadcast along the sharded batch dim
        for ti, nt, name in ((a, na, "left"), (b, nb, "right")):
            if isinstance(ti.layout[axis], Replicate):
                td = d - (no - nt)
                is_batch = 0 <= td < nt - 2
                if is_batch and ti.shape[td] != 1:
                    raise ctx.fail(f"the {name} operand is Replicate but full-size on batch dim {d} sharded on {axis!r}", "shard both operands on that dim")
        return Shard(d)

    return layout_map(ctx, one)


@register_rule(torch.outer)
def outer(ctx: Ctx):
    """``torch.outer(a, b)``: ``a`` runs along dim 0 of the result, ``b`` along dim 1;
    bilinear, so one Partial operand with the other Replicate stays Partial."""
    a, b = ctx.t(0), ctx.t(1)

    def one(axis):
        pa, pb = a.layout[axis], b.layout[axis]
        if isinstance(pa, Replicate) and isinstance(pb, Replicate):
            return R
        if isinstance(pa, Replicate) or isinstance(pb, Replicate):
            p, d = (pb, 1) if isinstance(pa, Replicate) else (pa, 0)
            return Shard(d) if isinstance(p, Shard) else p
        raise ctx.fail(f"outer of {fmt_placement(pa)} and {fmt_placement(pb)} on axis {axis!r}: only one operand may be "
                       f"sharded or Partial", "make one operand Replicate")

    return layout_map(ctx, one)
