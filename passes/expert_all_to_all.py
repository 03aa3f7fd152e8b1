"""expert_all_to_all: all-to-all dispatch and combine around the experts of MoE regions.

In every expert-parallel local region (``fxshard.expert_parallel``) the call of the
experts, ``experts(x, num_tokens_per_expert)``, becomes::

    ep_exchange_counts = fxshard_ep_exchange_counts(counts, 'ep')            # all-to-all of the counts
    ep_dispatch = fxshard_ep_dispatch(x, counts, ep_exchange_counts, 'ep')   # all-to-all of the tokens
    x_ep = ep_dispatch[0];  counts_local = ep_dispatch[1];  ep_plan = ep_dispatch[2]
    experts = self.experts(x_ep, counts_local)                               # this rank's experts
    ep_combine = fxshard_ep_combine(experts, ep_plan, 'ep')                  # all-to-all back

so each rank's experts (``Shard(0)`` of the stacked weights, or its part of a module
list) process the tokens of every rank that chose them, and the results return to
their tokens in the original order.  Backward: the dispatch sends the gradients back
with the reverse all-to-all, the combine sends them to the experts' ranks.  When the
region runs as is (not traceable), the experts module's forward is wrapped instead
(:func:`fxshard.runtime.moe.around_experts`): the same communication, not shown as nodes.

Reads:  ``.declared`` (:class:`~fxshard.meta.LocalRegion` with ``.experts``).
Writes: count exchange / dispatch / combine nodes in the carved region graph, with
        ``.collective`` and, as ``.value``, the buffer each sends (from the local
        shapes local_regions recorded); ``.extra["expert_parallel"]`` on the region's node.
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxshard.errors import PlanError
from fxshard.meta import Collective, LocalRegion, TensorInfo, info
from fxshard.runtime.moe import ExpertParallelSpec, around_experts, ep_combine, ep_dispatch, ep_exchange_counts, swap_forward
from fxshard.meta import PassContext, program_meta

_COLLECTIVES = {
    ep_exchange_counts: ("ep_exchange_counts", "all-to-all (tokens per expert)", "none"),
    ep_dispatch: ("ep_dispatch", "all-to-all (tokens to their experts' ranks)", "all-to-all (grads back to the tokens' ranks)"),
    ep_combine: ("ep_combine", "all-to-all (results back to the tokens' ranks)", "all-to-all (grads to the experts' ranks)"),
}


def expert_all_to_all(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Insert the expert-parallel all-to-alls in every MoE region (in place)."""
    done = set()
    for node in gm.graph.nodes:
        region = info(node).declared
        if node.op != "call_module" or not isinstance(region, LocalRegion) or not isinstance(region.experts, ExpertParallelSpec):
            continue  # routed experts (fxshard.routed_experts) need no all-to-all: their tokens are on every rank
        if node.target in done:  # a block called twice is rewritten once
            continue
        done.add(node.target)
        spec = region.experts
        module = gm.get_submodule(node.target)
        calls = []
        if isinstance(module, fx.GraphModule):
            calls = [n for n in module.graph.nodes if n.op == "call_module" and n.target == spec.experts]
        for call in calls:
            _around(module.graph, call, spec.axis, region, program_meta(module).mesh or {})
        if calls:
            module.graph.lint()
            module.recompile()
            info(node).extra["expert_parallel"] = f"{len(calls)} experts call(s) in the graph"
        else:
            swap_forward(module.get_submodule(spec.experts), around_experts(spec.axis))
            info(node).extra["expert_parallel"] = "experts forward wrapped"
    return


def _around(graph: fx.Graph, call: fx.Node, axis: str, region: LocalRegion, axes: dict) -> None:
    if len(call.args) + len(call.kwargs) != 2:
        raise PlanError(f"expert_parallel on {region.fqn!r}: the experts are called as `{call.format_node()}`; the grouped "
                        f"convention is experts(x, num_tokens_per_expert) with two positional arguments")
    x, counts = list(call.args) + list(call.kwargs.values())
    with graph.inserting_before(call):
        counts_ep = _op(graph, ep_exchange_counts, (counts, axis), call, region, _sent(counts, axis, axes, sharded=False))
        dispatch = _op(graph, ep_dispatch, (x, counts, counts_ep, axis), call, region, _sent(x, axis, axes))
        x_ep, local_counts, plan = (graph.call_function(operator.getitem, (dispatch, i)) for i in range(3))
    for n, name in ((x_ep, "x_ep"), (local_counts, "counts_local"), (plan, "ep_plan")):
        n._rename(name)
        _meta(n, call, region)
    call.args, call.kwargs = (x_ep, local_counts), {}
    with graph.inserting_after(call):
        combined = _op(graph, ep_combine, (call, plan, axis), call, region, _sent(call, axis, axes))
    call.replace_all_uses_with(combined, delete_user_cb=lambda user: user is not combined)


def _sent(value: fx.Node, axis: str, axes: dict, sharded: bool = True) -> TensorInfo | None:
    """What a rank sends: ``value``'s local rows (recorded by local_regions); the rows
    of all ranks together are ``Shard(0)`` over the axis.  None when not recorded."""
    local = info(value).extra.get("local")
    if local is None or not axes:
        return None
    shape, dtype = local
    layout = {a: Shard(0) if a == axis and sharded else Replicate() for a in axes}
    glob = (shape[0] * axes[axis],) + tuple(shape[1:]) if sharded else shape
    return TensorInfo(layout, glob, tuple(shape), dtype)


def _op(graph: fx.Graph, fn, args, call: fx.Node, region: LocalRegion, sent: TensorInfo | None) -> fx.Node:
    node = graph.call_function(fn, args)
    op, fwd, bwd = _COLLECTIVES[fn]
    info(node).collective = Collective(op, args[-1], fwd, bwd, f"experts of {region.fqn}")
    info(node).value = sent  # the buffer it sends (dumps, fxshard.comm_summary)
    _meta(node, call, region)
    return node


def _meta(node: fx.Node, call: fx.Node, region: LocalRegion) -> None:
    info(node).region = region.fqn  # the dump's module column: the region, not the experts
    if "stack_trace" in call.meta:
        node.meta["stack_trace"] = call.meta["stack_trace"]
