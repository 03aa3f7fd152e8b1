"""insert_grad_syncs: sum the gradients that each rank holds only a share of.

With local tensors the gradient of a Replicate value is itself Replicate, *unless*
a consumer turns it into a non-replicated result on that axis (a replicated
activation entering a column-parallel linear, a replicated norm weight applied to a
sequence-sharded input, a replicated parameter under a batch-sharded axis): then
each rank holds only its share of the gradient.  This pass puts one ``grad_sync(x,
axis)`` node (identity forward, all-reduce backward) on exactly those consumer edges,
shared per (value, axis).  Collectives are not such consumers: their backward
already returns the gradient in the source layout.

When every consumer of an ``all_gather`` output needs the sync on the gather's axis,
the sync is folded into the gather (``grad="partial"``: its backward reduce-scatters
instead of all-reducing then chunking), which makes sequence parallelism as cheap
as Megatron's.

On an axis given to FSDP2 (``Plan(fsdp=...)``) FSDP2 averages every parameter's
gradient over the axis, so no sync is added there: the chain rule is linear in the
incoming gradient, so a parameter's mean over the ranks of its unsynced gradients is
the right one.  Only a value whose gradient can reach a floating-point graph input
(which no FSDP2 hook averages) gets a ``grad_sync(x, axis, "avg")`` there, or a summing
``grad_sync(x, axis)`` on a context-parallel axis given to FSDP2 (whose ranks' shares
FSDP2 sums there: ``fxshard.fully_shard`` sets its divide factor to the other axes).

A parameter whose heads are replicated over several ranks (``extra["head_replicas"]``,
from ``replicate_heads``) gets ``grad_sync(w, axis, replicas=r)``: each of the ``r`` ranks
holding a head computed the gradient of its own query heads only, and the head's
gradient is their sum; every copy then takes the same optimizer step.

Reads:  ``.value`` (layouts, requires_grad), ``.collective``, ``extra["head_replicas"]``.
Writes: ``grad_sync`` nodes with ``.collective``; ``grad="partial"`` on folded gathers.
"""
from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Replicate

from fxshard.errors import node_error
from fxshard.runtime import collectives
from fxshard.meta import Collective, TensorInfo, info
from fxshard.meta import PassContext


def _out_layouts(node) -> list[dict]:
    v = info(node).value
    if isinstance(v, TensorInfo):
        return [v.layout]
    if isinstance(v, tuple):
        return [t.layout for t in v if isinstance(t, TensorInfo)]
    return []


def _needs(value: fx.Node, consumer: fx.Node) -> tuple[str, ...]:
    """Axes on which ``consumer`` makes the gradient of Replicate ``value`` Partial."""
    v = info(value).value
    if not isinstance(v, TensorInfo) or not v.requires_grad or not v.dtype.is_floating_point and not v.dtype.is_complex:
        return ()
    if info(consumer).collective is not None:
        return ()
    outs = _out_layouts(consumer)
    done, x = set(), value  # axes a chain of syncs above already covers (a lifted region parameter)
    while isinstance(x, fx.Node) and info(x).collective is not None and info(x).collective.op == "grad_sync":
        done.add(info(x).collective.axis)
        x = x.args[0]
    return tuple(a for a, p in v.layout.items()
                 if a not in done and isinstance(p, Replicate) and any(not isinstance(o[a], Replicate) for o in outs))


def _from_float_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a floating-point graph input."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        v = info(n).value
        if n.op == "placeholder" and isinstance(v, TensorInfo) and (v.dtype.is_floating_point or v.dtype.is_complex):
            out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _from_parameters_only(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from parameters and buffers alone (no graph input above them): the
    gradient of such a value flows only into parameters, which FSDP2 reduces."""
    fed: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or any(a in fed for a in n.all_input_nodes):
            fed.add(n)
    return {n for n in graph.nodes if n not in fed and n.op != "output"}


def _check_partial_on(value: fx.Node, needs: dict, axes: tuple[str, ...], from_params: set) -> None:
    """On a context-parallel axis FSDP2 sums the ranks' gradients of a parameter: right when
    each rank holds its positions' share, twice the gradient where a rank's is already whole
    (a replicated parameter meeting an activation replicated over the axis, e.g. gathered
    over cp before the head).  Such a parameter is refused."""
    v = info(value).value
    if not isinstance(v, TensorInfo) or not v.requires_grad or not v.dtype.is_floating_point:
        return
    for consumer, synced in needs.items():
        if consumer in from_params or not _out_layouts(consumer):
            continue
        for axis in axes:
            if isinstance(v.layout.get(axis), Replicate) and axis not in synced:
                raise node_error(consumer, f"{value.name} (computed from parameters only) meets an activation replicated "
                                           f"over {axis!r} here, so each {axis!r} rank's gradient of it is already the "
                                           f"whole; FSDP2, given {axis!r} (Plan(fsdp=...)), would sum them",
                                 f"keep the activations sharded on {axis!r} where parameters meet them (score the loss "
                                 f"on sequence pieces), or leave {axis!r} out of fsdp= (fxshard then syncs what needs it)")


def _sync_head_replicas(gm: fx.GraphModule) -> None:
    for p in list(gm.graph.nodes):
        hr = info(p).extra.get("head_replicas") if p.op == "get_attr" else None
        v = info(p).value
        if hr is None or not isinstance(v, TensorInfo) or not v.requires_grad:
            continue
        replicas = (v.shape[0] // v.local_shape[0]) // hr.heads  # the axis size over the heads
        users = list(p.users)
        with gm.graph.inserting_after(p):
            s = gm.graph.call_function(collectives.grad_sync, (p, hr.axis), {"replicas": replicas})
        m = info(s)
        m.collective = Collective("grad_sync", hr.axis, "identity", f"all-reduce over the {replicas} ranks "
                                  f"sharing each head", f"grad of {p.name} (replicated heads)")
        m.value, m.region, m.rule = v, info(users[0]).region, "grad sync (replicated heads)"
        s.meta["val"] = p.meta.get("val")
        s.meta["nn_module_stack"] = users[0].meta.get("nn_module_stack", {})
        s.meta["stack_trace"] = users[0].meta.get("stack_trace")
        for u in users:
            u.replace_input_with(p, s)


def insert_grad_syncs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Insert gradient syncs on replicated-to-sharded consumer edges (in place)."""
    fsdp_axes, mean_axes = ctx.fsdp_axes, ctx.fsdp_mean_axes
    graph = gm.graph
    _sync_head_replicas(gm)
    order = {n: i for i, n in enumerate(graph.nodes)}
    from_inputs = _from_float_inputs(graph) if fsdp_axes else set()
    sum_axes = tuple(a for a in fsdp_axes if a not in mean_axes)  # context-parallel axes given to FSDP2
    from_params = _from_parameters_only(graph) if sum_axes else set()
    for value in list(graph.nodes):
        needs = {c: _needs(value, c) for c in list(value.users)}
        if sum_axes and value in from_params:
            _check_partial_on(value, needs, sum_axes, from_params)
        if fsdp_axes:  # FSDP2 reduces the parameters' gradients on these axes
            needs = {c: tuple(a for a in axes if a not in fsdp_axes or
                              (value in from_inputs if a in mean_axes else value not in from_params))
                     for c, axes in needs.items()}
        needs = {c: axes for c, axes in needs.items() if axes}
        if not needs:
            continue
        coll = info(value).collective
        grad_users = [u for u in value.users if _out_layouts(u)]  # shape reads carry no gradient
        if coll is not None and coll.op == "all_gather" and len(needs) == len(grad_users) and all(coll.axis in a for a in needs.values()):
            value.update_kwarg("grad", "partial")  # fold: backward reduce-scatters
            coll.bwd = "reduce-scatter (grad sync folded)"
            needs = {c: tuple(a for a in axes if a != coll.axis) for c, axes in needs.items()}
        synced: dict[tuple[str, ...], fx.Node] = {(): value}
        for consumer, axes in sorted(needs.items(), key=lambda kv: order[kv[0]]):
            prefix = ()
            for axis in axes:
                key = prefix + (axis,)
                if key not in synced:
                    with graph.inserting_before(consumer):
                        s = graph.call_function(collectives.grad_sync, (synced[prefix], axis),
                                                {"op": "avg"} if axis in mean_axes else {})
                    m = info(s)
                    m.collective = Collective("grad_sync", axis, "identity", "all-reduce", f"grad of {value.name}")
                    m.value, m.region, m.rule = info(value).value, info(consumer).region, "grad sync"
                    s.meta["val"] = value.meta.get("val")
                    s.meta["nn_module_stack"] = consumer.meta.get("nn_module_stack", {})
                    s.meta["stack_trace"] = consumer.meta.get("stack_trace")
                    synced[key] = s
                prefix = key
            consumer.replace_input_with(value, synced[prefix])
    graph.lint()
    return
