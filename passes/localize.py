"""localize: literal sizes of sharded dims become local sizes.

``x.view(bsz, seqlen, 8, 16)`` with the head dim sharded over ``tp=4`` becomes
``x.view(bsz, seqlen, 2, 16)``.  Sizes read at run time (``x.shape[0]``) stay as they
are, so the graph works for any batch or sequence length, but they must come from a
dim sharded the same way as the dim they size; ``-1`` is left to infer.

Reads:  ``.value`` (TensorInfo of results, SizeInfo of runtime sizes).
Writes: the size arguments of ``view``/``reshape``/``expand``/``unflatten``/
        ``new_*`` nodes and of ``split`` along a fused projection's sharded dim,
        run-time bounds of slices and ``narrow``; after ``arange(n)`` of a sharded
        size (``Rewrite.ARANGE_OFFSET``) an ``add`` of this rank's offset (its
        ``.value`` that of the arange), or on a load-balanced context-parallel axis
        ``fxshard.local_positions``; ``table.narrow(0, 0, S)`` of a context-parallel
        length (``Rewrite.NARROW_POSITIONS``) becomes ``table.index_select(0,
        local_positions(...))``.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxshard.runtime import collectives
from fxshard.errors import node_error
from fxshard.layout.placements import uneven_dims
from fxshard.layout.op_rules import piece_sizes, view_groups
from fxshard.meta import Rewrite, SizeInfo, TensorInfo, info
from fxshard.meta import PassContext

_SIZED_METHODS = {"view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "new_full"}


def _sizes_slot(node: fx.Node):
    """(args index holding the sizes, sizes list, packed-as-tuple?) or None."""
    if node.op == "call_method" and node.target in _SIZED_METHODS:
        if node.target == "new_full":
            return 1, list(node.args[1]), True
        rest = node.args[1:]
        if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
            return 1, list(rest[0]), True
        return 1, list(rest), False
    if node.op == "call_function" and node.target is torch.reshape:
        return 1, list(node.args[1]), True
    return None


def localize(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite literal global sizes of sharded dims to local sizes (in place).
    ``load_balanced``: context-parallel axes whose ranks hold two chunks of the
    sequence each (``context_parallel(load_balance=True)``): positions there are not
    an offset range."""
    axes, load_balanced = ctx.axes, ctx.load_balanced
    for node in list(gm.graph.nodes):
        if info(node).rewrite == Rewrite.NARROW_POSITIONS:
            info(node).rewrite = None
            _narrow_positions(gm.graph, node, load_balanced)
            continue
        if info(node).rewrite == Rewrite.WINDOW_ROWS:
            info(node).rewrite = None
            _window_rows(gm.graph, node, load_balanced)
            continue
        if node.target == "split" or node.target is torch.split:
            _split(node, axes)
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            _slice_bounds(node, axes)
            continue
        if node.target is torch.narrow or node.op == "call_method" and node.target == "narrow":
            _narrow_bounds(node, axes)
            continue
        out = info(node).value
        if not isinstance(out, TensorInfo):
            continue
        if info(node).rewrite == Rewrite.ARANGE_OFFSET:
            info(node).rewrite = None
            _arange_offset(gm.graph, node, out, load_balanced, axes)
            continue
        if node.op == "call_method" and node.target == "unflatten" or node.target is torch.unflatten:
            _unflatten(node, out, axes)
            continue
        slot = _sizes_slot(node)
        if slot is None:
            continue
        start, sizes, packed = slot
        if len(sizes) == 1 and isinstance(sizes[0], fx.Node) and isinstance(info(sizes[0]).value, SizeInfo) and isinstance(info(sizes[0]).value.axes, tuple):
            continue  # x.view(y.shape): sizes of a tensor with the same layout
        offset = len(out.shape) - len(sizes)
        new = [_local_size(node, s, d + offset, out, axes) for d, s in enumerate(_infer_uneven(node, sizes, offset, out, axes))]
        if new != sizes:
            args = list(node.args)
            if packed:
                args[start] = type(node.args[start])(new) if not isinstance(node.args[start], torch.Size) else tuple(new)
            else:
                args[start:] = new
            node.args = tuple(args)
    gm.recompile()
    return


def _sharding(out: TensorInfo, d: int) -> frozenset:
    return frozenset(a for a, p in out.layout.items() if isinstance(p, Shard) and p.dim == d)


def _infer_uneven(node, sizes: list, offset: int, out: TensorInfo, axes) -> list:
    """A literal size of a dim sharded in unequal pieces has no one local value: a ``view``,
    ``reshape`` or ``unflatten`` infers it (``-1``), an ``expand`` keeps the input's size
    (``-1``) where the input has that dim too; anything else is a PlanError."""
    uneven = [d - offset for d in uneven_dims(out.shape, out.layout, axes) if d >= offset]
    uneven = [i for i in uneven if isinstance(sizes[i], int) and sizes[i] != -1]
    if not uneven:
        return sizes
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    x = info(src).value if src is not None else None
    new = list(sizes)
    for i in uneven:
        d = i + offset
        reshaping = node.target in ("view", "reshape", "unflatten", torch.reshape, torch.unflatten)
        same = _same_dim(node, x, out, d)  # the input dim this one is (same size, same pieces)
        if reshaping and -1 not in new:
            new[i] = -1
        elif node.target == "expand" and same is not None:
            new[i] = -1
        elif reshaping and same is not None:  # x.view(-1, V): V is the input's own local size
            with node.graph.inserting_before(node):
                read = node.graph.call_method("size", (src, same))
            read.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
            read.meta["val"] = out.shape[d]
            info(read).value = SizeInfo(out.shape[d], _sharding(out, d))
            info(read).region, info(read).rule = info(node).region, "local size of an uneven dim"
            new[i] = read
        else:
            (axis,) = {a for dd, a in uneven_dims(out.shape, out.layout, axes).items() if dd == d}
            raise node_error(node, f"dim {d} of size {out.shape[d]} is sharded on {axis!r} in unequal pieces "
                                   f"(torch.chunk: {piece_sizes(out.shape[d], axes[axis])}), so its literal size {sizes[i]} "
                                   f"has no one local value",
                             f"size that dim with -1 or with a size read from the tensor (x.size({d})), or make it a "
                             f"multiple of {axes[axis]}")
    return new


def _same_dim(node, x, out: TensorInfo, d: int) -> int | None:
    """The dim of the input that dim ``d`` of the result is, unchanged (a reshape that
    keeps it whole, an expand that keeps its size), laid out the same; else None."""
    if not isinstance(x, TensorInfo):
        return None
    if node.target == "expand":
        k = d - (len(out.shape) - len(x.shape))
        k = k if k >= 0 and x.shape[k] == out.shape[d] else None
    else:
        k = None
        for ins, outs in view_groups(tuple(x.shape), tuple(out.shape)):
            whole_in, whole_out = [a for a in ins if x.shape[a] != 1], [o for o in outs if out.shape[o] != 1]
            if whole_out == [d] and len(whole_in) == 1 and x.shape[whole_in[0]] == out.shape[d]:
                k = whole_in[0]
    return k if k is not None and _sharding(x, k) == _sharding(out, d) else None


def _local_size(node, s, d, out: TensorInfo, axes):
    if d < 0:
        return s
    sharded = _sharding(out, d)
    if isinstance(s, fx.Node):
        return _rescaled(node, s, sharded, axes, f"dim {d}")
    if isinstance(s, int) and s != -1 and sharded:
        return s // math.prod(axes[a] for a in sharded)
    return s


def _rescaled(node: fx.Node, s: fx.Node, sharded: frozenset, axes, what: str):
    """A size read at run time is the *local* size of the dim it was read from: where
    it sizes a dim sharded differently (HF Llama under sequence parallelism reads the
    sequence length from its sequence-sharded input, then views the whole-sequence
    projections with it), it is rescaled by the ratio of the two shardings."""
    v = info(s).value
    src_axes = v.axes if isinstance(v, SizeInfo) else frozenset()
    if src_axes == sharded:
        return s
    if src_axes is None or isinstance(src_axes, tuple):
        raise node_error(node, f"{what} is sized by `{s.name}`, a size read at run time and combined in a way fxshard cannot "
                               f"follow, but that dim is sharded on {sorted(sharded)}",
                         "size that dim with a literal, or read the size from a tensor sharded the same way")
    have, want = math.prod(axes[a] for a in src_axes), math.prod(axes[a] for a in sharded)
    if isinstance(v.value, int) and (v.value % have or v.value % want):
        raise node_error(node, f"{what} is sized by `{s.name}`, read from a dim sharded on {sorted(src_axes)}, but that dim "
                               f"is sharded on {sorted(sharded)}, and a size of {v.value} is cut in unequal pieces, so no "
                               f"ratio turns one local size into the other",
                         "read the size from a tensor sharded the same way, or use sizes the axes divide")
    op, k = (operator.mul, have // want) if have % want == 0 else (operator.floordiv, want // have)
    if have % want and want % have:
        raise node_error(node, f"{what} is sized by `{s.name}`, read from a dim sharded on {sorted(src_axes)}, but that dim is "
                               f"sharded on {sorted(sharded)}, and the two shardings do not divide each other",
                         "read the size from a tensor sharded the same way")
    graph = node.graph
    with graph.inserting_before(node):
        scaled = graph.call_function(op, (s, k))
    scaled.meta.update({key: s.meta[key] for key in ("val", "nn_module_stack", "stack_trace") if key in s.meta})
    scaled.meta.update({key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta})
    info(scaled).value = SizeInfo(v.value, sharded)
    info(scaled).rule = "size rescaled to the result's sharding"
    return scaled


def _slice_bounds(node, axes):
    """``x[:S]`` with ``S`` read at run time: the bound must be in the units of the
    sliced dim of ``x``, which may be sharded differently from where ``S`` was read."""
    x = info(node.args[0]).value
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if isinstance(x, TensorInfo) and x.blocks is not None:
        _part_slice_bounds(node, x, idx, axes)
        return
    if not isinstance(x, TensorInfo) or Ellipsis in idx or None in idx:
        return
    new, changed = [], False
    for d, it in enumerate(idx):
        if isinstance(it, slice) and any(isinstance(b, fx.Node) for b in (it.start, it.stop, it.step)):
            sharded = _sharding(x, d)
            bounds = [(_rescaled(node, b, sharded, axes, f"the slice of dim {d}") if isinstance(b, fx.Node) and
                       isinstance(info(b).value, SizeInfo) else b) for b in (it.start, it.stop, it.step)]
            it2 = slice(*bounds)
            changed |= it2 != it
            it = it2
        new.append(it)
    if changed:
        node.args = (node.args[0], tuple(new) if isinstance(node.args[1], tuple) else new[0], *node.args[2:])


def _part_slice_bounds(node, x: TensorInfo, idx: tuple, axes) -> None:
    """``qkv[..., q:q + kv]`` of a fused projection's output sharded part by part: the
    rule admits literal bounds on part boundaries only, and every part is cut into
    equal slices, so the local bounds are the global ones divided by the axis size."""
    if None in idx or sum(1 for it in idx if it is Ellipsis) > 1:
        return
    dims, d = [], 0
    for it in idx:
        if it is Ellipsis:
            d += len(x.shape) - (len(idx) - 1)
            dims.append(None)
        else:
            dims.append(d)
            d += 1
    new = list(idx)
    for i, (it, d) in enumerate(zip(idx, dims)):
        if d is None or not isinstance(it, slice) or d >= len(x.shape) or x.shape[d] != sum(x.blocks):
            continue
        sharded = _sharding(x, d)
        if sharded and it != slice(None):
            k = math.prod(axes[a] for a in sharded)
            start, stop, _ = it.indices(x.shape[d])
            if any(p % k for p in x.blocks) and len(sharded) == 1:  # parts in torch.chunk pieces: bounds at run time
                if any(it2 is not Ellipsis and it2 != slice(None) for j, it2 in enumerate(idx) if j != i):
                    raise node_error(node, f"this slice of the fused parts {list(x.blocks)}, cut in unequal pieces on "
                                           f"{sorted(sharded)}, also indexes other dims", "slice the parts alone, then the rest")
                with node.graph.inserting_before(node):
                    span = node.graph.call_function(collectives.local_span, (list(x.blocks), next(iter(sharded)), start, stop))
                    lo = node.graph.call_function(operator.getitem, (span, 0))
                    length = node.graph.call_function(operator.getitem, (span, 1))
                    narrow = node.graph.call_method("narrow", (node.args[0], d, lo, length))
                for n in (span, lo, length, narrow):
                    n.meta.update({key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta})
                    info(n).region, info(n).rule = info(node).region, "this rank's piece of the parts"
                narrow.meta["val"], info(narrow).value = node.meta.get("val"), info(node).value
                node.replace_all_uses_with(narrow)
                node.graph.erase_node(node)
                return
            else:
                new[i] = slice(start // k, stop // k)
    if new != list(idx):
        node.args = (node.args[0], tuple(new) if isinstance(node.args[1], tuple) else new[0], *node.args[2:])


def _arange_offset(graph: fx.Graph, node: fx.Node, out: TensorInfo, load_balanced=(), axes=None) -> None:
    """``arange(n_local)`` counts from 0 on every rank; the single-device positions of
    this rank's shard start at ``index_on_axis * n_local``.  On a load-balanced axis
    they are two ranges: the arange becomes ``fxshard.local_positions``."""
    (axis,) = [a for a, p in out.layout.items() if isinstance(p, Shard)]
    if axis in load_balanced:
        _as_positions(graph, node, out, axis)
        return
    if axes is not None and out.shape[0] % axes[axis]:
        raise node_error(node, f"positions of a length {out.shape[0]} sharded on {axis!r} in unequal pieces: the rank's "
                               f"offset is not its index times its own length",
                         f"use a sequence length that {axis!r} divides")
    users = list(node.users)
    with graph.inserting_after(node):
        offset = graph.call_function(collectives.local_offset, (axis, node.args[-1], node))
    with graph.inserting_after(offset):
        shifted = graph.call_function(operator.add, (node, offset))
    for n, rule in ((offset, "rank offset"), (shifted, "arange offset")):
        n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
        info(n).region, info(n).rule = info(node).region, rule
    info(shifted).value = out
    shifted.meta["val"] = node.meta.get("val")
    for u in users:
        u.replace_input_with(node, shifted)


def _as_positions(graph: fx.Graph, node: fx.Node, out: TensorInfo, axis: str) -> None:
    """``arange(n)`` on a load-balanced axis: this rank's global positions."""
    from fxshard.runtime.context_parallel_ops import local_positions

    dtype = node.kwargs.get("dtype")
    with graph.inserting_before(node):
        pos = graph.call_function(local_positions, (axis, node.args[-1]),
                                  {"load_balance": True, "device": node.kwargs.get("device")})
        res = graph.call_method("to", (pos, dtype)) if dtype is not None and dtype != torch.int64 else pos
    for n in {pos, res}:
        n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "val") if k in node.meta})
        info(n).region, info(n).rule, info(n).value = info(node).region, "this rank's positions (load-balanced)", out
    node.replace_all_uses_with(res)
    graph.erase_node(node)


def _window_rows(graph: fx.Graph, node: fx.Node, load_balanced) -> None:
    """``sliding_window_mask(S, window, device)`` with ``S`` the local length of a
    context-parallel sequence: this rank's rows, keys in global order."""
    from fxshard.runtime.context_parallel_ops import sliding_window_rows

    out = info(node).value
    (axis,) = [a for a, p in out.layout.items() if isinstance(p, Shard)]
    length, window, device = node.args
    with graph.inserting_before(node):
        rows = graph.call_function(sliding_window_rows, (axis, length, window),
                                   {"load_balance": axis in load_balanced, "device": device})
    rows.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "val") if k in node.meta})
    info(rows).region, info(rows).value, info(rows).rule = info(node).region, out, "sliding-window rows of this rank"
    node.replace_all_uses_with(rows)
    graph.erase_node(node)


def _narrow_positions(graph: fx.Graph, node: fx.Node, load_balanced) -> None:
    """``table.narrow(dim, 0, S)`` with ``S`` the local length of a context-parallel
    sequence: the rows at this rank's global positions (``index_select``)."""
    import builtins

    from fxshard.runtime.context_parallel_ops import local_positions

    out = info(node).value
    x = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    length = node.args[3] if len(node.args) > 3 else node.kwargs["length"]
    (axis,) = [a for a, p in out.layout.items() if isinstance(p, Shard) and p.dim == dim % len(out.shape)
               and isinstance(info(x).value.layout[a], Replicate)]
    with graph.inserting_before(node):
        device = graph.call_function(builtins.getattr, (x, "device"))
        pos = graph.call_function(local_positions, (axis, length), {"load_balance": axis in load_balanced, "device": device})
        rows = graph.call_method("index_select", (x, dim, pos))
    n_local = out.local_shape[dim % len(out.shape)]
    for n in (device, pos, rows):
        n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
        info(n).region = info(node).region
    info(pos).value = TensorInfo({a: (Shard(0) if a == axis else p) for a, p in out.layout.items()},
                                 (out.shape[dim % len(out.shape)],), (n_local,), torch.int64)
    info(pos).rule = "this rank's positions"
    info(rows).value, info(rows).rule = out, "rows at this rank's positions"
    rows.meta["val"] = node.meta.get("val")
    node.replace_all_uses_with(rows)
    graph.erase_node(node)


def _narrow_bounds(node, axes):
    """``torch.narrow(cos, 0, 0, S)`` with ``S`` read at run time: like a slice bound,
    in the units of the narrowed dim."""
    x = info(node.args[0]).value
    if not isinstance(x, TensorInfo):
        return
    args = list(node.args)
    dim = args[1] if len(args) > 1 else node.kwargs.get("dim")
    dim = (info(dim).value.value if isinstance(dim, fx.Node) else dim) % len(x.shape)
    for i in (2, 3):
        if i < len(args) and isinstance(args[i], fx.Node) and isinstance(info(args[i]).value, SizeInfo):
            args[i] = _rescaled(node, args[i], _sharding(x, dim), axes, f"the narrow of dim {dim}")
    node.args = tuple(args)


def _unflatten(node, out: TensorInfo, axes):
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    sizes = list(node.args[2] if len(node.args) > 2 else node.kwargs["sizes"])
    dim = dim % (len(out.shape) - len(sizes) + 1)
    new = [_local_size(node, s, dim + i, out, axes) for i, s in enumerate(_infer_uneven(node, sizes, dim, out, axes))]
    if new != sizes:
        args = list(node.args)
        args[2] = tuple(new)
        node.args = tuple(args)


def _split(node, axes):
    """``split`` of a fused projection's output along its sharded dim: local part sizes."""
    x = info(node.args[0]).value
    if not isinstance(x, TensorInfo):
        return
    nd = len(x.shape)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim = dim % nd
    sharded = _sharding(x, dim)
    if not sharded:
        return
    k = math.prod(axes[a] for a in sharded)
    sizes = node.args[1]
    if any(p % k for p in ([sizes] if isinstance(sizes, int) else sizes)):
        if isinstance(sizes, int) or len(sharded) != 1:
            raise node_error(node, f"split into pieces of {sizes} along dim {dim}, sharded on {sorted(sharded)} in unequal "
                                   f"pieces, which have no one local size", f"use part sizes that {k} divides")
        (axis,) = sharded  # each part cut in torch.chunk pieces: the rank's sizes are read at run time
        with node.graph.inserting_before(node):
            local = node.graph.call_function(collectives.local_sizes, (list(sizes), axis))
        local.meta.update({key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta})
        info(local).region, info(local).rule = info(node).region, "this rank's part sizes"
        node.args = (node.args[0], local, *node.args[2:])
        return
    new = sizes // k if isinstance(sizes, int) else type(sizes)(s // k for s in sizes)
    node.args = (node.args[0], new, *node.args[2:])
