"""register_program: the finished program, known to the training tools.

Every parameter is remembered with its program and FQN, so that
:func:`fxshard.clip_grad_norm_` takes a plain list of them and torch's own
``clip_grad_norm_`` is caught on them (it would give every rank a different norm).
With ``Plan(fsdp=axes)`` the program refuses to run until :func:`fxshard.fully_shard`
has been applied (fxshard syncs no gradient on that axis).

Reads:  ``ctx.fsdp_axes``; the program's parameters.
Writes: ``ProgramMeta.fsdp`` and a forward pre-hook (FSDP2 only); the parameter registry.
"""
from __future__ import annotations

import torch.fx as fx

from fxshard.meta import PassContext
from fxshard.training.fsdp import require_fully_shard
from fxshard.training.grad_norm import track_parameters


def register_program(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.fsdp_axes:
        require_fully_shard(gm, tuple(ctx.fsdp_axes))
    track_parameters(gm)
