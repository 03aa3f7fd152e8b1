"""Rules for Python numbers and sizes: ``x.size(-1)``, ``x.shape``, ``math.sqrt(k)``, ``n // 2``.

Python numbers in the graph (``k.size(-1)``, ``math.sqrt`` of it, ``1.0 / ...``) are values
without a layout: they get a SizeInfo whose ``axes`` says whether every rank sees the
single-device value.  ``frozenset()``: yes (computed from literals and from sizes of
dims that are not sharded).  A non-empty set: the local size of a dim sharded on those
axes (each rank sees its own, smaller, number), which may size a dim sharded the same
way (localize) but never enter the arithmetic of a tensor.  ``None``: derived from
such a size in a way fxshard does not follow (``math.sqrt(local_size)``).
"""
from __future__ import annotations

import builtins
import math
import operator
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxshard.layout.op_rules.context import Ctx, flat_args, layout_map, op_name
from fxshard.layout.op_rules.table import register_rule
from fxshard.meta import SizeInfo, TensorInfo


def number_axes(a, depth: int = 0):
    """``frozenset()`` when the traced number ``a`` is the same on every rank as on one
    device, else the axes it depends on (``None``: unknown).  Nodes without a SizeInfo
    (made by an op without a rule) are judged by their inputs."""
    if not isinstance(a, fx.Node):
        return frozenset()
    v = Ctx.info_of(a)
    if isinstance(v, SizeInfo):
        return v.axes if not isinstance(v.axes, tuple) else (frozenset() if not any(v.axes) else None)
    if isinstance(v, TensorInfo):
        return frozenset() if all(isinstance(p, Replicate) for p in v.layout.values()) else None
    if v is not None or depth > 32:
        return None
    out = frozenset()
    for x in a.all_input_nodes:
        ax = number_axes(x, depth + 1)
        if ax is None or ax:
            return None
    return out


def sharded_source(a: fx.Node) -> str:
    """Where a rank-dependent number comes from, for messages: the size read from a
    sharded dim (``x.size(-1)``), found through the ops that combined it."""
    seen, todo = set(), [a]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        v = Ctx.info_of(n)
        if isinstance(v, SizeInfo) and v.axes:
            axes = sorted(v.axes) if not isinstance(v.axes, tuple) else sorted({x for ax in v.axes if ax for x in ax})
            return f"`{n.name}`, the size of a dim sharded on {axes}"
        if n.op == "call_module":
            return f"the output of module `{n.target}`, which runs on local tensors"
        todo.extend(n.all_input_nodes)
    return "the size of a sharded dim"


def is_number_node(a) -> bool:
    if not isinstance(a, fx.Node):
        return False
    v = Ctx.info_of(a)
    if isinstance(v, SizeInfo):
        return not isinstance(v.value, (tuple, list, torch.Size))
    val = a.meta.get("val")
    return v is None and isinstance(val, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(val, bool)


def traced_scalars(ctx: Ctx) -> list[fx.Node]:
    """The traced Python numbers among a tensor op's operands; PlanError for one whose
    value differs across ranks (derived from the size of a sharded dim)."""
    out = []
    for a in flat_args(ctx.node.args, ctx.node.kwargs):
        if not is_number_node(a):
            continue
        axes = number_axes(a)
        if axes is None or axes:
            raise ctx.fail(
                f"operand `{a.name}` is a number computed at run time from {sharded_source(a)}: each rank sees its "
                f"local size, not the single-device one, so this op would compute with another number than on one device",
                "use the global size as a literal (e.g. a module attribute such as self.head_dim), or read the size "
                "from a dim that is not sharded")
        out.append(a)
    return out


def scalar_value(ctx: Ctx) -> SizeInfo:
    """An op on Python numbers only (``math.sqrt(n)``, ``1.0 / n``, ``max(n, 1)``): its value
    is the same on every rank when its inputs are; anything derived from a sharded
    size is not followed (``axes=None``).  ``int_arith`` keeps the sizes it can follow."""
    axes = frozenset()
    for a in flat_args(ctx.node.args, ctx.node.kwargs):
        ax = number_axes(a)
        if ax is None or ax:
            axes = None
            break
    return SizeInfo(ctx.val, axes)


def scalar_or(tensor_rule: Callable | None):
    """``scalar_value`` when the op sees no tensor (``math.sqrt(n)``), else ``tensor_rule``
    (None: a PlanError, the op has no rule for tensors)."""

    def rule(ctx: Ctx):
        if not ctx.tensor_args() and not isinstance(ctx.val, torch.Tensor):
            return scalar_value(ctx)
        if tensor_rule is None:
            raise ctx.fail(f"{op_name(ctx.node)} on a tensor has no layout rule", "make its input a Python number, or file an issue for a rule")
        return tensor_rule(ctx)

    rule.__name__ = "number arithmetic" if tensor_rule is None else getattr(tensor_rule, "__name__", "rule")
    return rule


def traced_int(ctx: Ctx, d):
    """A dim argument computed while tracing (``x.ndim - 1``): its value, which must be
    the same on every rank (the rank of a tensor always is)."""
    if isinstance(d, (tuple, list)):
        return type(d)(traced_int(ctx, x) for x in d)
    if not isinstance(d, fx.Node):
        return d
    v = ctx.info_of(d)
    if isinstance(v, SizeInfo) and v.axes == frozenset() and isinstance(v.value, int):
        return v.value
    raise ctx.fail(f"the dim `{d.name}` is computed at run time from {sharded_source(d)}, so ranks may see different values",
                   "pass the dim as a literal")


def rank_dependent_numbers(ctx: Ctx) -> None:
    """PlanError when an op without a rule of its own receives a number (or a shape)
    read from a sharded dim: each rank would pass its local size, and nothing
    rescales it (``torch.narrow(cos, 0, 0, S)`` with S of a sequence-sharded input)."""
    for a in flat_args(ctx.node.args, ctx.node.kwargs):
        v = ctx.info_of(a)
        if isinstance(v, SizeInfo) and isinstance(v.axes, tuple):
            dependent = any(ax is None or ax for ax in v.axes)
        elif is_number_node(a):
            axes = number_axes(a)
            dependent = axes is None or bool(axes)
        else:
            continue
        if dependent:
            raise ctx.fail(f"{op_name(ctx.node)} has no layout rule and takes `{a.name}`, computed at run time from "
                           f"{sharded_source(a)}: each rank would pass its local size, not the single-device one",
                           "pass the global size as a literal (e.g. a module attribute), read it from a dim that is not "
                           "sharded, or file an issue for a rule of this op")


# ----------------------------------------------------------------------------- sizes

def _dim_axes(ti: TensorInfo, d: int) -> frozenset:
    return frozenset(a for a, p in ti.layout.items() if isinstance(p, Shard) and p.dim == d)


@register_rule("size")
def size(ctx: Ctx):
    x = ctx.t(0)
    d = ctx.arg(1, "dim")
    nd = len(x.shape)
    if d is None:
        return SizeInfo(tuple(x.shape), tuple(_dim_axes(x, i) for i in range(nd)))
    d = d % nd
    return SizeInfo(x.shape[d], _dim_axes(x, d))


@register_rule(builtins.getattr)
def getattr_rule(ctx: Ctx):
    x = ctx.t(0)
    attr = ctx.arg(1)
    if x is not None and attr == "shape":
        return SizeInfo(tuple(x.shape), tuple(_dim_axes(x, i) for i in range(len(x.shape))))
    if x is not None and attr == "ndim":
        return SizeInfo(len(x.shape), frozenset())
    if x is not None and attr in ("T", "mT", "mH", "H"):
        nd = len(x.shape)
        perm = list(range(nd))[::-1] if attr in ("T", "H") else list(range(nd - 2)) + [nd - 1, nd - 2]
        inv = {src: dst for dst, src in enumerate(perm)}
        return layout_map(ctx, lambda axis: Shard(inv[x.layout[axis].dim]) if isinstance(x.layout[axis], Shard) else x.layout[axis])
    return None


def int_arith(op):
    def rule(ctx: Ctx):
        parts = [ctx.info_of(a) if isinstance(a, fx.Node) else a for a in ctx.node.args]
        axes = [p.axes if isinstance(p, SizeInfo) else frozenset() for p in parts]
        if any(a is None or isinstance(a, tuple) for a in axes):
            return SizeInfo(ctx.val, None)
        sharded = [a for a in axes if a]
        if not sharded:
            return SizeInfo(ctx.val, frozenset())
        if op in (operator.mul, operator.floordiv) and len(sharded) == 1 and (op is operator.mul or axes[0]):
            return SizeInfo(ctx.val, sharded[0])
        return SizeInfo(ctx.val, None)

    rule.__name__ = "int arithmetic"
    return rule


for _op in (operator.mul, operator.floordiv, operator.add, operator.sub):  # on ints only; on tensors: pointwise
    register_rule(_op, ints=True)(int_arith(_op))


@register_rule("dim")
def dim(ctx: Ctx):
    """``x.dim()``: the same on every rank."""
    return SizeInfo(len(ctx.t(0).shape), frozenset())


# Python numbers: math.* (fx autowraps the math module) and builtins a capture may record
register_rule(*(f for f in vars(math).values() if callable(f)), builtins.min, builtins.max, builtins.round, builtins.int,
              builtins.float)(scalar_or(None))
