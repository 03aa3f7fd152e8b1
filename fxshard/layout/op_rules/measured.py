"""Rules for values only measured.

A value whose every use reads only its shape, dtype or device (``torch.ones_like(att[0, 0])``,
``x[0].size(-1)``, ``x.new_zeros(...)``), directly or through views and indexing, needs no
layout for its numbers, only the right *local shape*: what each rank's program computes from
it is built from that shape.  ``propagate`` finds such values (``shape_only_values``) and, where
the rule for their numbers refuses the op, lays them out by the rules below instead: the
layout whose local shape is what the op gives on each rank's local tensor.  A sharded dim an
int selects away leaves the global shape (Replicate); one kept whole stays sharded.
"""
from __future__ import annotations

import builtins
import operator
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxshard.layout.op_rules.context import R, Ctx, layout_map
from fxshard.layout.op_rules.factories import FILL_LIKE
from fxshard.layout.op_rules.indexing import index_map
from fxshard.layout.op_rules.numbers import traced_int
from fxshard.meta import TensorInfo


_MEASURING_METHODS = {"size", "dim", "new_empty", "new_zeros", "new_ones", "new_full", "get_device",
                      "is_floating_point", "is_complex", "element_size"}
_MEASURED_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "is_meta", "layout"}
_VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "t",
                 "contiguous", "to", "float", "half", "bfloat16", "double", "detach", "clone", "expand", "select",
                 "narrow", "type"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze,
                   torch.transpose, torch.permute, torch.t, torch.select, torch.narrow, torch.clone, torch.detach}


def _only_as_self(node: fx.Node, value: fx.Node, names=("input", "self")) -> bool:
    """``value`` is ``node``'s first argument (the tensor it measures or views) and no other."""
    first = node.args[0] if node.args else next((node.kwargs[k] for k in names if k in node.kwargs), None)
    if first is not value:
        return False
    rest = [*node.args[1:], *(v for k, v in node.kwargs.items() if node.args or k not in names)]
    found: list[fx.Node] = []
    fx.node.map_arg(rest, found.append)
    return value not in found


def measures(node: fx.Node, value: fx.Node) -> bool:
    """Does ``node`` read only the shape, dtype or device of ``value``?"""
    if node.op == "call_function" and node.target in FILL_LIKE:
        return _only_as_self(node, value)
    if node.op == "call_method" and node.target in _MEASURING_METHODS:
        return _only_as_self(node, value)
    if node.op == "call_function" and node.target is builtins.getattr:
        return node.args[0] is value and node.args[1] in _MEASURED_ATTRIBUTES
    return False


def views(node: fx.Node, value: fx.Node) -> bool:
    """Is ``node`` a view, index or cast of ``value`` (its result shaped from it)?"""
    if node.op == "call_method" and node.target in _VIEW_METHODS or node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
        return _only_as_self(node, value)
    return False


def _sliced_length_kept(ctx: Ctx, x: TensorInfo, axis: str, dim: int, s) -> bool:
    """Does slicing dim ``dim`` (sharded on ``axis`` only) with the literal slice ``s`` give
    every rank's local piece the length it gives the whole dim?"""
    from fxshard.layout.placements import chunk

    if not isinstance(s, slice) or not all(b is None or isinstance(b, int) for b in (s.start, s.stop, s.step)):
        return False
    if sum(1 for p in x.layout.values() if p == Shard(dim)) != 1:
        return False
    n, size = ctx.axes[axis], x.shape[dim]
    want = len(range(size)[s])
    return all(len(range(chunk(size, n, i)[1])[s]) == want for i in range(n))


def _measured_index(ctx: Ctx, x: TensorInfo, items: tuple):
    mapping, advanced, _ = index_map(ctx, items, len(x.shape))

    def one(axis):
        p = x.layout[axis]
        if not isinstance(p, Shard):
            return R  # Partial or Replicate: each rank holds the whole shape
        if advanced:
            raise ctx.fail(f"advanced indexing of a tensor sharded on {axis!r}", "make it Replicate before indexing")
        m = mapping[p.dim]
        if m is None:
            return R  # the sharded dim is selected away: the rest has its global shape on every rank
        if not isinstance(m, tuple) or m[1] == slice(None):
            return Shard(m[0] if isinstance(m, tuple) else m)
        if _sliced_length_kept(ctx, x, axis, p.dim, m[1]):
            return R
        raise ctx.fail(f"slicing dim {p.dim}, which is sharded on {axis!r}", "slice a Replicate dim")

    return layout_map(ctx, one)


def measured_getitem(ctx: Ctx):
    """``x[idx]`` whose result is only measured: the layout of its local shape."""
    idx = ctx.arg(1)
    return _measured_index(ctx, ctx.t(0), idx if isinstance(idx, tuple) else (idx,))


def measured_select(ctx: Ctx):
    """``x.select(dim, i)`` whose result is only measured."""
    x = ctx.t(0)
    dim = traced_int(ctx, ctx.arg(1, "dim")) % len(x.shape)
    return _measured_index(ctx, x, (slice(None),) * dim + (0,))


def measured_narrow(ctx: Ctx):
    """``x.narrow(dim, start, length)`` whose result is only measured."""
    x = ctx.t(0)
    dim = traced_int(ctx, ctx.arg(1, "dim")) % len(x.shape)
    start, length = ctx.arg(2, "start"), ctx.arg(3, "length")
    if not isinstance(start, int) or not isinstance(length, int):
        raise ctx.fail("narrow of a sharded dim by a length read at run time", "narrow a Replicate dim")
    return _measured_index(ctx, x, (slice(None),) * dim + (slice(start, start + length),))


def measured_rule(node: fx.Node) -> Callable | None:
    """The rule laying out ``node``'s local shape when only its shape is read, or None
    where the rule for its numbers already gives that (views keep sharded dims whole)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return measured_getitem
    if node.target in ("select", torch.select):
        return measured_select
    if node.target in ("narrow", torch.narrow):
        return measured_narrow
    return None
