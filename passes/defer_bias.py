"""defer_bias: the bias of a row-parallel linear is added once, after the reduction.

``linear(x, w, b)`` whose output is ``Partial`` would add ``b`` on every rank and the
reduction would sum it N times.  The linear becomes ``linear(x, w)``, the reduction
(the module's output boundary) follows, then ``+ b`` exactly once, the same op as on
one device, so the output and the bias gradient are exact.  When the reduction is a
reduce-scatter onto the bias dim, the bias is sliced to the local shard first.

Reads:  ``.rewrite == Rewrite.DEFER_BIAS`` on linear nodes, ``.redistribute`` and ``.value``
        of the boundary marker that consumes them.
Writes: moves the bias; the new ``add`` (and slice) nodes get ``.value``/``.rule``.
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from fxshard.runtime import collectives
from fxshard.markers import region_output
from fxshard.errors import node_error
from fxshard.meta import Collective, Rewrite, TensorInfo, info
from fxshard.meta import PassContext


_VIEWS = ("view", "reshape")


def _boundary_after_views(node: fx.Node, ndim: int) -> fx.Node | None:
    """The output marker the linear's value reaches, through views that keep its last
    (bias) dim: transformers' ``Conv1D`` computes on ``[B*S, in]`` and views the result
    back to ``[B, S, out]`` before it leaves the module."""
    cur = node
    while len(cur.users) == 1:
        (user,) = cur.users
        if user.target is region_output:
            return user
        val, prev = user.meta.get("val"), cur.meta.get("val")
        keeps_bias_dim = val is not None and prev is not None and val.shape[-1] == prev.shape[-1]
        if not (user.op == "call_method" and user.target in _VIEWS and keeps_bias_dim):
            return None
        cur = user
    return None


def defer_bias(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Move biases of Partial-output linears after their reduction (in place)."""
    for node in list(gm.graph.nodes):
        if info(node).rewrite != Rewrite.DEFER_BIAS:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        out = info(node).value
        partial_axes = [a for a, p in out.layout.items() if isinstance(p, Partial)]
        marker = _boundary_after_views(node, len(out.shape))
        red = info(marker).redistribute if marker is not None else None
        if red is None or any(isinstance(red[1][a], Partial) for a in partial_axes):
            raise node_error(node, f"this linear has a bias and its output is Partial on {partial_axes}, but the output is not "
                                   "reduced at the module boundary, so the bias cannot be added exactly once",
                             "give the module an output layout (rowwise(out=Replicate()) or out=Shard(1)), or drop the bias")
        node.args = (node.args[0], node.args[1])
        node.kwargs = {}
        dst: TensorInfo = info(marker).value
        b_info: TensorInfo = info(bias).value
        b, cur, b_layout = bias, marker, dict(b_info.layout)
        for axis in partial_axes:  # reduce-scatter onto the bias dim: add this rank's slice of the bias
            p = dst.layout[axis]
            if isinstance(p, Shard) and p.dim == len(dst.shape) - 1:
                with gm.graph.inserting_after(cur):
                    b = cur = gm.graph.call_function(collectives.shard, (b, axis, 0))
                b_layout[axis] = Shard(0)
                info(b).collective = Collective("shard", axis, "local slice", "all-gather", f"bias of {info(node).region}")
                info(b).value = TensorInfo(dict(b_layout), b_info.shape, (dst.local_shape[-1],), b_info.dtype, b_info.requires_grad)
        with gm.graph.inserting_after(cur):
            add = gm.graph.call_function(operator.add, (marker, b))
        marker.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
        for n in (add,) + ((b,) if b is not bias else ()):
            n.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            n.meta["stack_trace"] = node.meta.get("stack_trace")
        info(add).value = TensorInfo(dict(dst.layout), dst.shape, dst.local_shape, dst.dtype, True)
        info(add).rule = "deferred bias"
        info(add).region = info(node).region
        add.meta["val"] = marker.meta.get("val")
        info(node).rewrite = None  # done (the row's ensures checks that none is left)
    gm.graph.lint()
    return
