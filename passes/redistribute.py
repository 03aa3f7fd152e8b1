"""redistribute: every declared layout change becomes explicit collective nodes.

Each boundary marker with ``.redistribute = (src, dst)`` is replaced by one
collective per mesh axis that changes (multi-axis changes are decomposed one axis at
a time: reductions and gathers from the innermost axis out, then local slices, then
all-to-alls).  The same change of the same value is emitted once (q, k and v
declared ``colwise(inputs=Shard(1))`` share one all-gather).  Markers without a
change simply disappear.  The collectives are
fxshard's runtime ops, called with the axis *name*, so the code reads the same on
every rank:

=====================  ===========================  =====================
change (one axis)      forward                      backward
=====================  ===========================  =====================
Partial -> Replicate   ``all_reduce(x, "tp")``      identity
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

from fxshard import runtime
from fxshard.boundary import is_marker
from fxshard.layout import fmt_placement, local_shape
from fxshard.meta import Collective, TensorInfo, info


def _steps(src: dict, dst: dict) -> list[tuple[str, object, object]]:
    """Order of per-axis changes: reduce/gather (inner axes first), slice, all-to-all."""
    changed = [a for a in src if src[a] != dst[a]]
    first = [a for a in reversed(changed) if isinstance(src[a], Partial) or isinstance(dst[a], Replicate)]
    slices = [a for a in changed if isinstance(src[a], Replicate)]
    a2a = [a for a in changed if isinstance(src[a], Shard) and isinstance(dst[a], Shard)]
    return [(a, src[a], dst[a]) for a in first + slices + a2a]


def _emit(graph: fx.Graph, x: fx.Node, axis: str, s, d):
    if isinstance(s, Partial) and isinstance(d, Replicate):
        return graph.call_function(runtime.all_reduce, (x, axis)), Collective("all_reduce", axis, "all-reduce", "identity")
    if isinstance(s, Partial) and isinstance(d, Shard):
        return graph.call_function(runtime.reduce_scatter, (x, axis, d.dim)), Collective("reduce_scatter", axis, "reduce-scatter", "all-gather")
    if isinstance(s, Shard) and isinstance(d, Replicate):
        return graph.call_function(runtime.all_gather, (x, axis, s.dim)), Collective("all_gather", axis, "all-gather", "local chunk")
    if isinstance(s, Replicate) and isinstance(d, Shard):
        return graph.call_function(runtime.shard, (x, axis, d.dim)), Collective("shard", axis, "local chunk", "all-gather")
    if isinstance(s, Shard) and isinstance(d, Shard):
        return graph.call_function(runtime.all_to_all, (x, axis, s.dim, d.dim)), Collective("all_to_all", axis, "all-to-all", "all-to-all")
    raise AssertionError(f"unsupported change {fmt_placement(s)} -> {fmt_placement(d)}")  # propagate rejects these


def redistribute(gm: fx.GraphModule, axes: dict[str, int]) -> fx.GraphModule:
    """Replace boundary markers by collectives (in place)."""
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
                    new, coll = _emit(graph, x, axis, s, d)
                layout[axis] = d
                coll.purpose = f"{'input' if node.target.__name__ == 'region_input' else 'output'} {name!r} of {fqn}"
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
    return gm
