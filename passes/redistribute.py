"""redistribute: every declared layout change becomes explicit collective nodes.

Each boundary marker with ``.redistribute = (src, dst)`` is replaced by one
collective per mesh axis that changes, one axis at a time in the order that keeps a
dim sharded over several axes exact (see ``_steps``: undo from the innermost axis out,
redo from the outermost axis in).  The same change of the same value is emitted once (q, k and v
declared ``colwise(inputs=Shard(1))`` share one all-gather).  Markers without a
change simply disappear.  The collectives are
fxshard's runtime ops, called with the axis *name*, so the code reads the same on
every rank:

=====================  ===========================  =====================
change (one axis)      forward                      backward
=====================  ===========================  =====================
Partial -> Replicate   ``all_reduce(x, "tp")``      identity
P(avg) -> Replicate    ``all_reduce(x, "tp", "avg")`` scale by 1/n
Partial -> Shard(d)    ``reduce_scatter(x, "tp", d)`` all-gather
Shard(d) -> Replicate  ``all_gather(x, "tp", d)``   local chunk (or reduce-scatter, see grad_sync)
Replicate -> Shard(d)  ``shard(x, "tp", d)``        all-gather
Shard(i) -> Shard(j)   ``all_to_all(x, "tp", i, j)`` all-to-all back
=====================  ===========================  =====================

Reads:  ``.redistribute``, ``.value`` of markers.
Writes: collective nodes with ``.collective`` and ``.value``; removes the markers.
"""
from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.runtime import collectives
from fxshard.markers import is_marker
from fxshard.layout.placements import fmt_placement, local_shape
from fxshard.errors import node_error
from fxshard.meta import Boundary, Collective, TensorInfo, info
from fxshard.meta import PassContext


def _steps(src: dict, dst: dict) -> list[tuple[str, object, object]]:
    """The per-axis changes that turn ``src`` into ``dst``, in an order that is exact
    when one tensor dim is sharded over several axes.

    A dim sharded over several axes is chunked in mesh order (outer axis first, as
    DTensor does): on a ``(dp, tp)`` mesh ``{dp: S(0), tp: S(0)}`` puts chunk
    ``2 * i + j`` of 4 on rank ``(i, j)``.  So a gather over an axis is exact only while
    that axis is the innermost one sharding the dim, and a slice only appends an axis
    after every axis that already shards the dim.  An axis keeps its placement when it
    is unchanged and every outer axis sharding the same dim (before or after) keeps
    its own; the others are undone from the innermost axis out (reductions, gathers,
    and all-to-alls where the target dim nests right), then the remaining slices and
    reduce-scatters are done from the outer axis in.
    """
    axes = list(src)

    def on(layout: dict, dim: int, among) -> list[str]:
        return [a for a in among if isinstance(layout[a], Shard) and layout[a].dim == dim]

    kept: set[str] = set()
    for i, a in enumerate(axes):
        if src[a] != dst[a]:
            continue
        if isinstance(src[a], Shard):
            d = src[a].dim
            outer = set(on(src, d, axes[:i])) | set(on(dst, d, axes[:i]))
            if not outer <= kept:
                continue
        kept.add(a)

    cur, steps = dict(src), []

    def step(a, p):
        steps.append((a, cur[a], p))
        cur[a] = p

    for i in reversed(range(len(axes))):  # undo, innermost axis first
        a = axes[i]
        if a in kept:
            continue
        s, d = cur[a], dst[a]
        if isinstance(s, Partial) and isinstance(d, Replicate):
            step(a, d)
        elif isinstance(s, Shard):
            others = [b for b in on(cur, d.dim, axes) if b != a] if isinstance(d, Shard) else None
            if (isinstance(d, Shard) and d.dim != s.dim and set(others) <= kept
                    and others == on(dst, d.dim, axes[:i])):
                step(a, d)  # all-to-all: lands innermost on its target dim, where it belongs
            else:
                step(a, Replicate())
    for a in axes:  # redo, outermost axis first: slices and reduce-scatters nest in mesh order
        if cur[a] != dst[a]:
            step(a, dst[a])
    return steps


def _emit(graph: fx.Graph, x: fx.Node, axis: str, s, d, axes: dict[str, int]):
    if isinstance(s, Partial):
        avg = s.reduce_op == "avg"  # propagate admits sum and avg only
        if isinstance(d, Replicate):
            args = (x, axis, "avg") if avg else (x, axis)
            return graph.call_function(collectives.all_reduce, args), Collective(
                "all_reduce", axis, "all-reduce (avg)" if avg else "all-reduce", "scale by 1/n" if avg else "identity")
        if isinstance(d, Shard):
            args = (x, axis, d.dim, "avg") if avg else (x, axis, d.dim)
            return graph.call_function(collectives.reduce_scatter, args), Collective(
                "reduce_scatter", axis, "reduce-scatter (avg)" if avg else "reduce-scatter", "all-gather, 1/n" if avg else "all-gather")
    if isinstance(s, Shard) and isinstance(d, Replicate):
        size = info(x).value.shape[s.dim] if isinstance(info(x).value, TensorInfo) else None
        kwargs = {"size": size} if size is not None and size % axes[axis] else {}  # unequal pieces, padded on the wire
        return graph.call_function(collectives.all_gather, (x, axis, s.dim), kwargs), Collective("all_gather", axis, "all-gather", "local chunk")
    if isinstance(s, Replicate) and isinstance(d, Shard):
        return graph.call_function(collectives.shard, (x, axis, d.dim)), Collective("shard", axis, "local chunk", "all-gather")
    if isinstance(s, Shard) and isinstance(d, Shard):
        shape = info(x).value.shape if isinstance(info(x).value, TensorInfo) else None
        if shape is not None and (shape[s.dim] % axes[axis] or shape[d.dim] % axes[axis]):
            raise node_error(x, f"the change {fmt_placement(s)} -> {fmt_placement(d)} on {axis!r} of a tensor of shape "
                                f"{list(shape)} is an all-to-all of unequal pieces, which fxshard does not do",
                             f"go through Replicate, or use sizes {axis!r} divides")
        return graph.call_function(collectives.all_to_all, (x, axis, s.dim, d.dim)), Collective("all_to_all", axis, "all-to-all", "all-to-all")
    raise AssertionError(f"unsupported change {fmt_placement(s)} -> {fmt_placement(d)}")  # propagate rejects these


def redistribute(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replace boundary markers by collectives (in place)."""
    axes = ctx.axes
    graph = gm.graph
    emitted: dict[tuple, fx.Node] = {}  # one collective per (value, change): q/k/v share one all-gather
    for node in list(graph.nodes):
        if not is_marker(node):
            continue
        meta = info(node)
        x = node.args[0]
        if meta.redistribute is not None:
            src, dst = meta.redistribute
            out: TensorInfo = meta.value
            layout = dict(src)
            _, fqn, name = node.args
            for axis, s, d in _steps(src, dst):
                key = (x, axis, s, d)
                if key in emitted:
                    x = emitted[key]
                    layout[axis] = d
                    continue
                with graph.inserting_before(node):
                    new, coll = _emit(graph, x, axis, s, d, axes)
                layout[axis] = d
                kind = meta.declared.kind if isinstance(meta.declared, Boundary) else node.target.__name__[len("region_"):]
                coll.purpose = f"{kind} {name!r} of {fqn}"
                m = info(new)
                m.collective, m.region, m.rule = coll, meta.region, "redistribute"
                m.value = TensorInfo(dict(layout), out.shape, local_shape(out.shape, layout, axes), out.dtype, out.requires_grad)
                new.meta["val"] = node.meta.get("val")
                new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
                new.meta["stack_trace"] = node.meta.get("stack_trace")
                emitted[key] = x = new
        node.replace_all_uses_with(x)
        graph.erase_node(node)
    graph.lint()
    return
