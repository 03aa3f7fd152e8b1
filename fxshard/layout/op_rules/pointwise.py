"""Rules for elementwise ops: arithmetic, activations, casts and copies, with broadcasting.

What matters is how an op treats a Partial (unreduced) input: a sum of shares stays
one through ``+`` of shares and ``*`` by a replicated value, never through a
nonlinearity.  A Replicate operand that broadcasts against a sharded one may itself be
expanded sharded (:func:`shard_broadcast`), with no communication.
"""
from __future__ import annotations

import builtins
import operator
from dataclasses import replace

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.layout.op_rules.context import R, Ctx, flat_args, layout_map, op_name, origin_of, reduce_fix
from fxshard.layout.op_rules.numbers import scalar_value, traced_scalars
from fxshard.layout.op_rules.table import register_rule
from fxshard.layout.placements import local_shape
from fxshard.meta import KEY, TensorInfo


def pointwise(kind: str | None = None, tensor_positions: tuple[int, ...] | None = None):
    """Elementwise op with broadcasting.  ``kind`` says how it treats Partial inputs:
    ``"add"`` (all tensor operands Partial), ``"mul"`` (one Partial operand), ``"div"``
    (Partial numerator), ``"unary"`` (linear in its only tensor), None (nonlinear)."""

    def rule(ctx: Ctx):
        tensors = ctx.tensor_args()
        if not tensors and not isinstance(ctx.val, torch.Tensor):
            return scalar_value(ctx)  # arithmetic on Python numbers (1.0 / math.sqrt(k.size(-1)))
        if tensor_positions is not None:
            keep = {id(ctx.arg(i)) for i in tensor_positions}
            tensors = [(a, ti) for a, ti in tensors if id(a) in keep]
        scalars = [a for a in flat_args(ctx.node.args, ctx.node.kwargs) if isinstance(a, (int, float)) and not isinstance(a, bool)]
        scalars += [True for _ in traced_scalars(ctx)]  # a traced number counts as non-zero: its value may change
        nd = ctx.out_ndim

        def one(axis):
            shard_dims, partial, reps = set(), [], []
            for a, ti in tensors:
                p = ti.layout[axis]
                if isinstance(p, Shard):
                    shard_dims.add(p.dim + nd - len(ti.shape))
                elif isinstance(p, Partial):
                    partial.append((a, ti))
                else:
                    reps.append((a, ti))
            if partial:
                if shard_dims:
                    raise ctx.fail(f"elementwise {ctx.node.target} mixes Partial and Shard inputs on axis {axis!r}", reduce_fix(axis))
                ops = sorted({ti.layout[axis].reduce_op for _, ti in partial})
                if len(ops) > 1:  # a sum of shares plus a mean of shares is neither reduced afterwards
                    raise ctx.fail(f"{op_name(ctx.node)} combines Partial values that reduce differently ({', '.join(ops)}) "
                                   f"on axis {axis!r}", reduce_fix(axis))
                ok = (kind == "unary" and len(tensors) == 1) or (
                    kind == "add" and not reps and not any(scalars)) or (
                    kind == "add" and ops == ["avg"]) or (  # the mean of (a_r + c) is A + c
                    kind == "mul" and len(partial) == 1) or (
                    kind == "div" and len(partial) == 1 and partial[0][0] is ctx.arg(0))
                if not ok:
                    why = "is not linear" if kind is None else "is not linear in these operands"
                    raise ctx.fail(
                        f"{op_name(ctx.node)} {why}: it cannot run on a Partial (unreduced) value on axis {axis!r} "
                        f"(Partial from {', '.join(origin_of(a) for a, _ in partial)})",
                        _statistic_fix(partial[0][0], axis) or reduce_fix(axis))
                return partial[0][1].layout[axis]
            if not shard_dims:
                return R
            if len(shard_dims) > 1:
                raise ctx.fail(f"inputs are sharded on different dims {sorted(shard_dims)} of the result on axis {axis!r}",
                               "give both operands the same layout in the plan")
            (d,) = shard_dims
            for a, ti in reps:
                ad = d - (nd - len(ti.shape))
                if ad >= 0 and ti.shape[ad] != 1 and not shard_broadcast(ctx, a, axis, ad):
                    raise ctx.fail(
                        f"Replicate input `{a.name}` {list(ti.shape)} is combined elementwise with an input sharded on dim {d} "
                        f"on axis {axis!r}; its dim {ad} is full-size, not broadcast",
                        f"shard `{a.name}` the same way in the plan (e.g. declare its producing module's output Shard({d}) on {axis!r}), "
                        f"or make the other operand Replicate")
            return Shard(d)

        return layout_map(ctx, one)

    rule.__name__ = f"pointwise ({kind or 'nonlinear'})"
    return rule


register_rule(operator.add, operator.sub, torch.add, torch.sub, "add", "sub", "__add__")(pointwise("add"))
register_rule(operator.mul, torch.mul, "mul")(pointwise("mul"))
register_rule(operator.truediv, torch.div, "div")(pointwise("div"))
register_rule(operator.neg, torch.neg, F.dropout, "neg", "float", "half", "bfloat16", "double", "contiguous", "clone",
              "detach")(pointwise("unary"))
register_rule("to", "type_as")(pointwise("unary", tensor_positions=(0,)))  # the dtype/device argument is no operand
register_rule(
    operator.pow, operator.mod, builtins.abs,
    torch.rsqrt, torch.sqrt, torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.pow, torch.where,
    torch.abs, torch.clamp, torch.square, torch.polar, torch.relu, F.silu, F.gelu, F.relu, F.tanh, F.sigmoid,
    "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "relu", "abs", "sin", "cos", "masked_fill", "square", "clamp",
)(pointwise(None))


def _statistic_fix(a: fx.Node, axis: str) -> str | None:
    """The fix for a Partial that a mean or sum over a sharded dim made (a norm's
    statistic, ``x.pow(2).mean(-1)``): the plan can ask for that reduction."""
    seen = 0
    while isinstance(a, fx.Node) and seen < 8:
        meta = a.meta.get(KEY)
        if meta is None or not isinstance(meta.value, TensorInfo) or not isinstance(meta.value.layout[axis], Partial):
            return None
        if a.target in ("mean", "sum", torch.mean, torch.sum):
            src = a.args[0].meta[KEY].value if isinstance(a.args[0], fx.Node) and KEY in a.args[0].meta else None
            if not isinstance(src, TensorInfo) or not isinstance(src.layout[axis], Shard):
                return None
            stack = list((a.meta.get("nn_module_stack") or {}).values())
            module = meta.region or (stack[-1][0] if stack else "its module")
            return (f"`{a.name}` reduces dim {src.layout[axis].dim}, which is sharded on {axis!r}: for a norm over that dim "
                    f"plan {module!r} as fxshard.distributed_norm({axis!r}) (its statistics are all-reduced), or make "
                    f"that dim Replicate before the module")
        tensors = [x for x in a.all_input_nodes if isinstance(getattr(x.meta.get(KEY), "value", None), TensorInfo)]
        a, seen = (tensors[0] if tensors else None), seen + 1
    return None


def shard_broadcast(ctx: Ctx, a, axis: str, dim: int) -> bool:
    """Let the Replicate operand ``a`` of this node be ``Shard(dim)`` on ``axis``, if it is
    free: ``a`` is an ``expand`` that broadcasts a size-1 (or new) dim ``dim`` of a
    Replicate tensor and this node is its only user.  Every chunk of such a tensor is
    the same, so each rank expands to its local size instead (``localize`` shrinks a
    literal size) and no value moves; the gradient of the broadcast tensor is then
    summed over the ranks by ``grad_sync``.  MLA attention is the case: the shared
    rope key ``k_pe.expand(-1, n_heads, -1, -1)`` meets the head-sharded keys."""
    if not isinstance(a, fx.Node) or a.op != "call_method" or a.target != "expand" or len(a.users) != 1:
        return False
    out, src = ctx.info_of(a), ctx.info_of(a.args[0])
    if not isinstance(out, TensorInfo) or not isinstance(src, TensorInfo) or not isinstance(out.layout[axis], Replicate):
        return False
    sd = dim - (len(out.shape) - len(src.shape))
    if not (0 <= dim < len(out.shape)) or not (sd < 0 or src.shape[sd] == 1) or out.shape[dim] % ctx.axes[axis]:
        return False
    layout = {**out.layout, axis: Shard(dim)}
    a.meta[KEY].value = replace(out, layout=layout, local_shape=local_shape(out.shape, layout, ctx.axes))
    a.meta[KEY].rule = f"{a.meta[KEY].rule or 'expand'} (broadcast dim {dim} sharded like its user `{ctx.node.name}` on {axis!r})"
    return True
