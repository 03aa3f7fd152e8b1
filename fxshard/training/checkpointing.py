"""Activation checkpointing per transformer block: ``fxshard.checkpoint_blocks(sharded)``.

A captured graph has no checkpoint left in it: ``torch.export`` traces through HF's
``gradient_checkpointing`` (and through ``torch.utils.checkpoint``), so the sharded program
would keep every activation of every block for the backward.  This re-applies it where
torchtitan applies it, per transformer block: each block that :func:`fxshard.transform`
splits out (``blocks="auto"``, or ``Plan(fsdp=...)``) runs its forward under
``torch.utils.checkpoint.checkpoint`` (non-reentrant), which keeps the block's inputs and
recomputes the rest in the backward.  The block's collectives are recomputed with it (as
with DTensor and torchtitan's full AC), so a tensor-parallel block communicates its forward
twice.  The numbers are those of the program without checkpointing.

:func:`fxshard.transform` applies it by itself to a model whose HF decoder layers have
``gradient_checkpointing`` on (``model.gradient_checkpointing_enable()``), splitting the
blocks for it.  FSDP2's hooks stay outside the checkpointed forward (they unshard once
more for the recomputation, as they do for torchtitan's), and :func:`fxshard.compile`
compiles the checkpointed forward (dynamo's checkpoint operator).

Example::

    sharded = fxshard.transform(model, plan, (ids,), blocks="auto")
    fxshard.checkpoint_blocks(sharded)          # before or after fxshard.fully_shard / fxshard.compile
"""
from __future__ import annotations

import types

import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint

from fxshard.errors import PlanError
from fxshard.meta import program_meta, programs_of

__all__ = ["checkpoint_blocks", "checkpointed_blocks", "has_checkpointed_layers"]


def checkpoint_blocks(sharded: nn.Module) -> nn.Module:
    """Run the forward of every transformer block of ``sharded`` under activation
    checkpointing (in place; returns ``sharded``).  ``sharded`` is a program from
    :func:`fxshard.transform` with its blocks split out, or a pipelined module (this rank's
    stages).  Blocks checkpointed already are left as they are.

    Example: ``fxshard.checkpoint_blocks(fxshard.transform(model, plan, (ids,), blocks="auto"))``
    """
    programs = programs_of(sharded)
    if not all(isinstance(p, fx.GraphModule) and program_meta(p).fsdp_units for p in programs):
        raise PlanError(f"fxshard.checkpoint_blocks: this {type(sharded).__name__} has no transformer blocks split out, "
                        f"so there is no block to checkpoint\n  fix: transform with blocks='auto' (or an FQN pattern such "
                        f"as blocks='layers.*')")
    for program in programs:
        for fqn in program_meta(program).fsdp_units:
            block = program.get_submodule(fqn)
            if program_meta(block).activation_checkpoint:
                continue
            program_meta(block, create=True).activation_checkpoint = True
            block.forward = types.MethodType(checkpointed(block.forward), block)
    return sharded


def checkpointed(forward):
    """``forward`` (a bound method or a function of the block) run under non-reentrant
    activation checkpointing; what :func:`fxshard.compile` compiles for a checkpointed block."""
    inner = getattr(forward, "__func__", forward)  # the function: bound again to the block below

    def run(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(inner, self, *args, use_reentrant=False, **kwargs)

    run.__name__ = getattr(inner, "__name__", "forward")
    return run


def checkpointed_blocks(sharded: nn.Module) -> list[str]:
    """The FQNs of the blocks whose forward runs checkpointed.

    Example: ``fxshard.checkpointed_blocks(sharded)   # ['model.layers.0', 'model.layers.1']``
    """
    return [fqn for p in programs_of(sharded) if isinstance(p, fx.GraphModule) for fqn in program_meta(p).fsdp_units or ()
            if program_meta(p.get_submodule(fqn)).activation_checkpoint]


def has_checkpointed_layers(model: nn.Module) -> bool:
    """Whether ``model`` asks for activation checkpointing that its capture would lose: an HF
    layer with ``gradient_checkpointing`` on, or a module wrapped by torch's
    ``checkpoint_wrapper`` (torchtitan's activation checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(getattr(m, "gradient_checkpointing", False) is True or isinstance(m, CheckpointWrapper)
               for m in model.modules())
