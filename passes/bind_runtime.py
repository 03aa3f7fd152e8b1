"""bind_runtime: the program's mesh, bound for the collectives it calls.

The generated code names mesh axes (``fxshard.all_reduce(x, "tp")``); the runtime
resolves them on the mesh bound here (:func:`fxshard.bind_mesh`).  The process groups
of gradient syncs over ranks that share a KV head are made now, on every rank, never
while a program runs.  The mesh and the context-parallel axes are recorded on the
program, for the state, training and debugging tools.

Runs on every rank (under simulated ranks: inside their LocalTensorMode).
Reads:  ``ctx.mesh``, ``ctx.cp_axes``; ``grad_sync`` calls with ``replicas=``.
Writes: the runtime's bound mesh; ``ProgramMeta.mesh``, ``ProgramMeta.context_parallel``.
"""
from __future__ import annotations

import torch.fx as fx

from fxshard.meta import PassContext, program_meta
from fxshard.runtime import collectives


def bind_runtime(gm: fx.GraphModule, ctx: PassContext) -> None:
    collectives.bind_mesh(ctx.mesh)
    collectives.bind_replica_groups(gm)
    program = program_meta(gm, create=True)
    program.mesh = dict(ctx.axes)
    program.context_parallel = {a: {"method": cp.method, "load_balance": cp.load_balance} for a, cp in ctx.cp_axes.items()}
