"""bind_runtime: the program's mesh, bound for the collectives it calls.

The generated code names mesh axes (``fxshard.all_reduce(x, "tp")``); the runtime
resolves them on the mesh bound here (:func:`fxshard.bind_mesh`).  The process groups
of gradient syncs over ranks that share a KV head are made now, on every rank, never
while a program runs.  The mesh and the context-parallel axes are recorded on the
program, for the state, training and debugging tools.

Runs on every rank (under simulated ranks: inside their LocalTensorMode).
Reads:  ``ctx.mesh``, ``ctx.cp_axes``; ``grad_sync`` calls with ``replicas=``.
Writes: the runtime's bound mesh; ``gm.meta["fxshard_mesh"]``, ``gm.meta["fxshard_context_parallel"]``.
"""
from __future__ import annotations

import torch.fx as fx

from fxshard.meta import PassContext
from fxshard.runtime import collectives


def bind_runtime(gm: fx.GraphModule, ctx: PassContext) -> None:
    collectives.bind_mesh(ctx.mesh)
    collectives.bind_replica_groups(gm)
    gm.meta["fxshard_mesh"] = dict(ctx.axes)
    gm.meta["fxshard_context_parallel"] = {a: {"method": cp.method, "load_balance": cp.load_balance}
                                           for a, cp in ctx.cp_axes.items()}
