"""distributed_norm_statistics: norms over a sharded dim reduce their statistics, not their input.

A ``distributed_norm`` region (OLMo2's q/k norms over the whole projected width)
receives its input sharded on the normalized dim.  Each of its means and sums is a
per-rank partial statistic; this pass puts a *statistic* marker after it, which
``propagate`` turns into ``Partial -> Replicate`` when the reduced dim is indeed
sharded (an all-reduce of the ``[..., 1]`` statistic, ``redistribute`` emits it) and
into nothing otherwise.  ``F.rms_norm`` and ``F.layer_norm`` are first written out
as the means they take, computed in float32 like torch's kernels do for half inputs:

    rms_norm:   x * rsqrt(mean(x * x) + eps) * w
    layer_norm: (x - mean(x)) * rsqrt(mean((x - mean(x))^2) + eps) * w + b

so a layer norm costs two all-reduces (mean, then variance: the two-pass form keeps
the variance exact) and an RMS norm one.  The backward of each is the all-reduce's
(``grad_sync`` sums the gradient of the replicated statistic over the ranks).

Reads:  ``.extra["distributed_norm"]`` (regions), ``node.meta["val"]``.
Writes: new nodes with ``val``, ``nn_module_stack``, ``.region`` and ``.extra`` of the
        node they come from; ``region_output`` markers with a
        :class:`fxshard.meta.Boundary` of kind ``"statistic"`` in ``.declared``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

from fxshard.markers import region_output
from fxshard.errors import node_error
from fxshard.meta import Boundary, info
from fxshard.meta import PassContext

_REDUCTIONS = {("call_method", "mean"), ("call_method", "sum"), ("call_function", torch.mean), ("call_function", torch.sum)}


def distributed_norm_statistics(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Write out the norms of ``distributed_norm`` regions and mark their statistics (in place)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if "distributed_norm" in info(node).extra and node.op == "call_function" and node.target in (F.rms_norm, F.layer_norm):
            _write_out(graph, node)
    for node in list(graph.nodes):
        axis = info(node).extra.get("distributed_norm")
        if axis is not None and (node.op, node.target) in _REDUCTIONS:
            _mark_statistic(graph, node, axis)
    graph.lint()
    return


class _Emitter:
    """Emits nodes before ``anchor`` that carry its module stack, region and a ``val``
    computed from their arguments' fake values."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor = graph, anchor

    def __call__(self, op: str, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        node.meta["val"] = self._value(op, target, args, kwargs)
        for key in ("nn_module_stack", "stack_trace"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        src, meta = info(self.anchor), info(node)
        meta.region, meta.extra = src.region, dict(src.extra)
        return node


    def _value(self, op, target, args, kwargs):
        from torch._guards import detect_fake_mode

        mode = detect_fake_mode([n.meta.get("val") for n in self.anchor.all_input_nodes])
        owner = self.graph.owning_module

        def val(n: fx.Node):
            if n.op == "get_attr":  # parameters get their fake value in propagate: make one here
                t = owner.get_parameter(n.target) if n.target in dict(owner.named_parameters()) else owner.get_buffer(n.target)
                return mode.from_tensor(t) if mode is not None else t
            return n.meta.get("val")

        a, kw = fx.node.map_arg((args, kwargs), val)
        fn = getattr(torch.Tensor, target) if op == "call_method" else target
        return fn(*a, **kw)


def _write_out(graph: fx.Graph, node: fx.Node) -> None:
    layer = node.target is F.layer_norm
    names = ("input", "normalized_shape", "weight", "bias", "eps") if layer else ("input", "normalized_shape", "weight", "eps")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    x, shape = bound["input"], bound["normalized_shape"]
    weight, bias = bound.get("weight"), bound.get("bias")
    k = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
    if k != 1:
        raise node_error(node, f"a distributed_norm region normalizes over {shape!r}; fxshard writes out norms over the last "
                               f"dim only", "normalize over the last dim, or keep this norm's input Replicate")
    val = x.meta["val"]
    eps = bound.get("eps")
    if eps is None:  # F.rms_norm's default: the input dtype's machine epsilon
        eps = torch.finfo(val.dtype).eps
    emit = _Emitter(graph, node)
    half = val.dtype in (torch.float16, torch.bfloat16)
    h = emit("call_method", "float", x) if half else x
    if layer:
        h = emit("call_function", operator.sub, h, emit("call_method", "mean", h, -1, keepdim=True))
    stat = emit("call_method", "mean", emit("call_function", operator.mul, h, h), -1, keepdim=True)
    y = emit("call_function", operator.mul, h, emit("call_function", torch.rsqrt, emit("call_function", operator.add, stat, eps)))
    if half:
        y = emit("call_method", "to", y, val.dtype)
    if isinstance(weight, fx.Node):
        y = emit("call_function", operator.mul, y, weight)
    if isinstance(bias, fx.Node):
        y = emit("call_function", operator.add, y, bias)
    node.replace_all_uses_with(y)
    graph.erase_node(node)


def _mark_statistic(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    """Route every use of the reduction ``node`` through a statistic marker."""
    src = info(node)
    fqn = src.region
    with graph.inserting_after(node):
        marker = graph.call_function(region_output, (node, fqn, node.name))
    node.replace_all_uses_with(marker, delete_user_cb=lambda u: u is not marker)
    marker.meta["val"] = node.meta.get("val")
    for key in ("nn_module_stack", "stack_trace"):
        if key in node.meta:
            marker.meta[key] = node.meta[key]
    meta = info(marker)
    meta.region, meta.extra = fqn, dict(src.extra)
    meta.declared = Boundary(fqn, node.name, "statistic", dst={axis: Replicate()})
