"""check_fsdp_axis: on the axes the plan gives to FSDP2, no parameter is sharded, and
on the batch ones nothing is communicated.

Runs only with ``Plan(fsdp=axis)`` (or several axes).  FSDP2 shards the parameters on
those axes itself; fxshard must not shard a parameter there.  On a batch axis FSDP2
averages the gradients, so fxshard must not communicate there either.  A context-parallel
axis given to FSDP2 (``fsdp=("dp", "cp")``) keeps its collectives (attention's KV, the
loss's global count): its ranks' gradient shares are summed, as fxshard's syncs would.

Reads:  ``.value`` of ``get_attr`` nodes, ``.collective``.
Writes: nothing (raises a PlanError at the node).
"""
from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Replicate

from fxshard.errors import node_error
from fxshard.meta import PassContext, TensorInfo, info


def check_fsdp_axis(gm: fx.GraphModule, ctx: PassContext) -> None:
    """On an axis FSDP2 owns only the batch may be sharded: FSDP2 averages every
    parameter's gradient there, which is right only for a per-rank objective.  A
    parameter sharded on the axis, or a collective on it (a gathered batch, a reduced
    Partial), would train on a wrong gradient (a replicated loss: ``1/n`` of it), so the
    plan is refused at the node."""
    mean_axes = ctx.fsdp_mean_axes
    for node in gm.graph.nodes:
        m = info(node)
        v = m.value
        for axis in ctx.fsdp_axes:
            if node.op == "get_attr" and isinstance(v, TensorInfo) and not isinstance(v.layout.get(axis), Replicate):
                raise node_error(node, f"parameter {node.target!r} is laid out {v.layout[axis]} on {axis!r}, an axis the "
                                       f"plan gives to FSDP2, which shards parameters there itself",
                                 f"keep parameters Replicate on {axis!r} (shard them over another axis), or leave {axis!r} "
                                 f"out of fsdp=")
        coll = m.collective
        if coll is not None and coll.axis in mean_axes and coll.op not in ("grad_sync", "grad_sync_bucket"):
            axis = coll.axis
            raise node_error(node, f"the plan makes fxshard communicate on {axis!r} ({coll.op}: {coll.purpose or 'a layout change'}), "
                                   f"the axis it gives to FSDP2; FSDP2 averages the gradients over it, which is right only "
                                   f"when every rank's output covers its own share of the batch",
                             f"leave layouts on {axis!r} as they arrive (the batch Shard(0) from the inputs to the outputs), "
                             f"or drop fsdp={axis!r} and let fxshard sum the gradients over {axis!r}")
