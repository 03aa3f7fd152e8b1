"""Rules for attention: ``F.scaled_dot_product_attention`` (by heads, batch, or sequence
under context parallelism).  The rule of the sliding-window mask fxshard's capture builds
is registered where that op is defined (``fxshard.runtime.context_parallel_ops``)."""
from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.layout.op_rules.context import R, Ctx, layout_map, reduce_fix
from fxshard.layout.op_rules.table import register_rule
from fxshard.layout.placements import fmt_placement
from fxshard.meta import KEY, Rewrite, TensorInfo


@register_rule(F.scaled_dot_product_attention)
def sdpa(ctx: Ctx):
    """scaled_dot_product_attention: q/k/v sharded alike on batch or heads; sharded on
    the sequence dim only inside a context-parallel module on that axis, where the
    ``context_parallel`` pass replaces it (``Rewrite.CONTEXT_PARALLEL``)."""
    q, k, v = ctx.t(0, "query"), ctx.t(1, "key"), ctx.t(2, "value")
    mask = ctx.t(3, "attn_mask")
    nd = len(q.shape)
    cp = ctx.node.meta[KEY].extra.get("context_parallel")

    def one(axis):
        ps = {q.layout[axis], k.layout[axis], v.layout[axis]}
        if len(ps) != 1:
            raise ctx.fail(f"query, key and value have different layouts on axis {axis!r}", "shard q, k and v the same way (heads or batch)")
        (p,) = ps
        if isinstance(p, Replicate):
            if mask is not None and not isinstance(mask.layout[axis], Replicate):
                raise ctx.fail(f"attention mask is sharded on {axis!r} but q/k/v are Replicate", "keep the mask Replicate")
            return R
        if isinstance(p, Partial):
            raise ctx.fail(f"attention on Partial inputs on axis {axis!r}", reduce_fix(axis))
        if p.dim == nd - 2:
            return _context_parallel_attention(ctx, cp, axis, q, mask, nd)
        if p.dim > nd - 2:
            raise ctx.fail(f"attention inputs are sharded on the head dim (dim {p.dim}) on axis {axis!r}; attention needs whole heads",
                           "shard attention by heads (colwise q/k/v), by batch, or by sequence (fxshard.context_parallel)")
        if mask is not None:
            mp = mask.layout[axis]
            md = p.dim - (nd - len(mask.shape))
            if isinstance(mp, Replicate) and md >= 0 and mask.shape[md] != 1:
                raise ctx.fail(f"attention mask is Replicate but full-size on dim {p.dim} sharded on {axis!r}", "shard the mask like q/k/v or broadcast it on that dim")
            if not isinstance(mp, Replicate) and (mp != Shard(md) or mask.shape[md] != q.shape[p.dim]):
                raise ctx.fail(f"attention mask is {fmt_placement(mp)} on {axis!r} but q/k/v are sharded on dim {p.dim}: each "
                               f"rank would apply a mask that is not its own", "shard the mask on the dim q/k/v are sharded on, or keep it Replicate")
        return p

    return layout_map(ctx, one)


def _context_parallel_attention(ctx: Ctx, cp, axis: str, q: TensorInfo, mask: TensorInfo | None, nd: int):
    """Attention on q/k/v sharded on the sequence dim over ``axis``: legal inside a
    module the plan declares context-parallel on that axis.  The mask, if any, holds
    whole key rows: Replicate (each rank picks its query rows) or sharded on its query
    dim like q."""
    stack = list((ctx.node.meta.get("nn_module_stack") or {}).values())
    module = stack[-1][0] if stack else "the attention module"
    if cp is None or cp.axis != axis:
        where = f"context_parallel({cp.axis!r})" if cp is not None else "no context_parallel"
        raise ctx.fail(f"attention inputs are sharded on the sequence dim (dim {nd - 2}) on axis {axis!r}, and the plan "
                       f"says {where} for the module around this attention",
                       f"declare the module context-parallel on {axis!r}: {{{module!r}: fxshard.context_parallel({axis!r})}} "
                       f"(use its pattern, e.g. 'layers.*.attention'), or gather the sequence before attention")
    if ctx.node.kwargs.get("dropout_p", ctx.arg(4, None, 0.0)):
        raise ctx.fail("attention dropout under context parallelism: each rank would draw its own dropout mask of the "
                       "gathered keys, not a slice of the single-device one", "set the attention dropout to 0 (eval or dropout_p=0.0)")
    if mask is not None:
        mp, md = mask.layout[axis], len(mask.shape) - 2
        if mask.shape[-1] != q.shape[nd - 2]:
            raise ctx.fail(f"the attention mask has {mask.shape[-1]} key columns but the sequence has {q.shape[nd - 2]}",
                           "give the mask one column per key position")
        if isinstance(mp, Shard) and (mp.dim != md or mask.shape[md] != q.shape[nd - 2]):
            raise ctx.fail(f"attention mask is {fmt_placement(mp)} on {axis!r}: under context parallelism it must hold whole key "
                           f"rows, sharded only on its query dim (dim {md}) or Replicate",
                           f"shard the mask on dim {md} over {axis!r} (inputs={{'mask': {{{axis!r}: Shard({md})}}}}) or keep it Replicate")
        if isinstance(mp, Partial):
            raise ctx.fail(f"attention mask is Partial on {axis!r}", reduce_fix(axis))
    ctx.request_rewrite(Rewrite.CONTEXT_PARALLEL)
    return Shard(nd - 2)
