"""Activation checkpointing per transformer block: ``fxshard.checkpoint_blocks(sharded, mode)``.

A captured graph has no checkpoint left in it: ``torch.export`` traces through HF's
``gradient_checkpointing`` (and through ``torch.utils.checkpoint``), so the sharded program
would keep every activation of every block for the backward.  This re-applies it where
torchtitan applies it, per transformer block: each block that :func:`fxshard.transform`
splits out (``blocks="auto"``, or ``Plan(fsdp=...)``) runs its forward under
``torch.utils.checkpoint.checkpoint`` (non-reentrant).  Three modes, torchtitan's:

- ``"full"``: the block keeps its inputs and recomputes everything else in the backward.
  The block's collectives are recomputed with it (as with DTensor and torchtitan's full AC),
  so a tensor-parallel block communicates its forward twice.
- ``"selective"``: op-level selective checkpointing (torch's
  ``create_selective_checkpoint_contexts``, torchtitan's ``SelectiveAC`` policy,
  :func:`selective_policy`): the outputs of matmuls (every other ``mm``, as torchtitan),
  attention kernels, ``topk`` and ``max``, and of the program's all-reduces, reduce-scatters
  and all-to-alls (MoE dispatch, the context-parallel ring) are saved; the rest (norms,
  activation functions, rotary, casts, reshapes, and all-gathers, whose output is the axis's
  size times its input) is recomputed.  A saved collective is not run again by the
  recomputation; an all-gather is, by every rank of its group in the same block in the same
  order (the backward runs the same program on each), as under full checkpointing.
- ``every=K`` (the trainer's ``selective:K``, torchtitan's layer-level selective AC): only
  every K-th block of this rank (the K-th, 2K-th, ...) is checkpointed, in full; the others
  keep all their activations.

The numbers are those of the program without checkpointing in every mode.
:func:`fxshard.transform` applies ``"full"`` by itself to a model whose HF decoder layers have
``gradient_checkpointing`` on (``model.gradient_checkpointing_enable()``), splitting the
blocks for it.  FSDP2's hooks stay outside the checkpointed forward (they unshard once
more for the recomputation, as they do for torchtitan's), and :func:`fxshard.compile`
compiles the checkpointed forward (dynamo's checkpoint operator).

Example::

    sharded = fxshard.transform(model, plan, (ids,), blocks="auto")
    fxshard.checkpoint_blocks(sharded, "selective")   # before or after fxshard.fully_shard / fxshard.compile
"""
from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fxshard.errors import PlanError
from fxshard.meta import program_meta, programs_of

__all__ = ["checkpoint_blocks", "checkpointed_blocks", "has_checkpointed_layers", "parse_checkpointing",
           "selective_policy", "checkpoint_kwargs", "MODES"]

MODES = ("none", "selective", "full")  # the trainer's --activation-checkpointing (and selective:K)

_aten = torch.ops.aten
# matmuls whose every other output torchtitan recomputes (the first, third, ... of a block are saved)
_ALTERNATED_MMS = {_aten.mm.default, _aten.linear.default}


@functools.lru_cache(maxsize=None)
def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing saves (torchtitan's ``_get_default_save_ops``):
    the compute-intensive ops of torch's partitioner (mm, bmm, addmm, the flash / efficient
    attention kernels, ...), every attention kernel of ``scaled_dot_product_attention`` (the
    CPU's included), ``max`` (low-precision scales) and ``topk`` (an MoE router's choice, kept
    stable), and grouped GEMMs (routed experts)."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "max", "topk", "linear", "_grouped_mm"):
        packet = getattr(_aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return frozenset(ops)


_c10d = torch.ops._c10d_functional
# collectives that run again in the recomputation, as torchtitan's policy has them: an all-gather's output is
# the axis's size times its input (sequence parallel's whole sequence before each column-parallel matmul)
_RECOMPUTED_COLLECTIVES = {_c10d.all_gather_into_tensor.default, _c10d.wait_tensor.default}


def _saved_collective(func) -> bool:
    """A communication op whose output selective checkpointing saves: fxshard's all-reduces,
    reduce-scatters and all-to-alls (``_c10d_functional``; torchtitan saves its reduce-scatters
    and all-to-alls) and c10d's own; not an all-gather (recomputed, as torchtitan does: every
    rank of its group recomputes the same block in the same order, so it cannot deadlock), nor
    ``wait_tensor``, which returns the tensor it waits for (recomputed on a saved collective's
    output it has nothing to wait for)."""
    return getattr(func, "namespace", None) in ("_c10d_functional", "c10d") and func not in _RECOMPUTED_COLLECTIVES


def selective_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh op-level policy for one checkpointed forward (it counts the matmuls it sees):
    ``MUST_SAVE`` for a collective other than an all-gather (:func:`_saved_collective`), a
    device-to-host copy, and the ops of :func:`_saved_ops` except every second ``mm``
    (torchtitan's balance of memory and recomputation); ``PREFER_RECOMPUTE`` for the rest.  The planner classifies a forward's ops with the same
    policy (``fxshard.planner.offline``), so what it predicts is what the trainer keeps.

    Example: ``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=lambda:
    create_selective_checkpoint_contexts(selective_policy()))``
    """
    counts = {"forward": 0, "recompute": 0}
    saved = _saved_ops()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if _saved_collective(func):
            return CheckpointPolicy.MUST_SAVE
        if (func is _aten._to_copy.default and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
                and str(kwargs.get("device", "")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE  # a copy to the host: a sync not to repeat
        if func in _ALTERNATED_MMS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy())


def checkpoint_kwargs(mode: str) -> dict:
    """The keywords of ``torch.utils.checkpoint.checkpoint`` for ``mode`` (``"full"`` or
    ``"selective"``): non-reentrant, and the op-level policy for selective.  HF's
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` takes them as they are.

    Example: ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs("selective"))``
    """
    if mode == "full":
        return {"use_reentrant": False}
    if mode == "selective":
        return {"use_reentrant": False, "context_fn": _selective_contexts}
    raise PlanError(f"activation checkpointing mode {mode!r}: the modes that recompute are 'full' and 'selective'")


def parse_checkpointing(text: str | bool | None) -> tuple[str, int]:
    """``(mode, every)`` of the trainer's ``--activation-checkpointing``: ``"none"``, ``"full"``,
    ``"selective"`` (per op; also ``"selective:op"``) or ``"selective:K"`` (every K-th block in
    full: ``("full", K)``).  ``True`` is ``"full"`` and ``False`` / ``None`` ``"none"`` (the old
    boolean).  A malformed value is a PlanError.

    Example: ``parse_checkpointing("selective:2")   # ("full", 2)``
    """
    if text is None or text is False:
        return "none", 1
    if text is True:
        return "full", 1
    mode, _, option = str(text).strip().partition(":")
    if mode in ("none", "full") and not option:
        return mode, 1
    if mode == "selective" and option in ("", "op"):
        return "selective", 1
    if mode == "selective" and option.isdigit() and int(option) >= 1:
        return ("full", int(option))
    raise PlanError(f"activation checkpointing {text!r}: one of none, full, selective (per op) or selective:K (every "
                    f"K-th block in full, K >= 1)")


def checkpoint_blocks(sharded: nn.Module, mode: str = "full", every: int = 1) -> nn.Module:
    """Run the forward of the transformer blocks of ``sharded`` under activation checkpointing
    (in place; returns ``sharded``).  ``sharded`` is a program from :func:`fxshard.transform`
    with its blocks split out, or a pipelined module (this rank's stages).  ``mode``:
    ``"full"`` or ``"selective"`` (see the module docstring); ``every``: checkpoint only the
    K-th, 2K-th, ... block of this rank.  Blocks checkpointed already are left as they are.

    Example: ``fxshard.checkpoint_blocks(fxshard.transform(model, plan, (ids,), blocks="auto"), "selective")``
    """
    if mode not in ("full", "selective"):
        raise PlanError(f"fxshard.checkpoint_blocks: mode {mode!r}\n  fix: 'full' (recompute the whole block) or "
                        f"'selective' (keep matmul, attention and collective outputs, recompute the rest)")
    if not isinstance(every, int) or every < 1:
        raise PlanError(f"fxshard.checkpoint_blocks: every={every!r}\n  fix: a whole number >= 1 (1: every block)")
    programs = programs_of(sharded)
    if not all(isinstance(p, fx.GraphModule) and program_meta(p).fsdp_units for p in programs):
        raise PlanError(f"fxshard.checkpoint_blocks: this {type(sharded).__name__} has no transformer blocks split out, "
                        f"so there is no block to checkpoint\n  fix: transform with blocks='auto' (or an FQN pattern such "
                        f"as blocks='layers.*')")
    position = 0
    for program in programs:
        for fqn in program_meta(program).fsdp_units:
            position += 1
            if position % every:
                continue
            block = program.get_submodule(fqn)
            if program_meta(block).activation_checkpoint:
                continue
            program_meta(block, create=True).activation_checkpoint = mode
            block.forward = types.MethodType(checkpointed(block.forward, mode), block)
    return sharded


def checkpointed(forward, mode: str = "full"):
    """``forward`` (a bound method or a function of the block) run under non-reentrant
    activation checkpointing of ``mode``; what :func:`fxshard.compile` compiles for a
    checkpointed block."""
    inner = getattr(forward, "__func__", forward)  # the function: bound again to the block below
    kwargs = checkpoint_kwargs(mode if isinstance(mode, str) else "full")

    def run(self, *args, **kw):
        return torch.utils.checkpoint.checkpoint(inner, self, *args, **kwargs, **kw)

    run.__name__ = getattr(inner, "__name__", "forward")
    return run


def checkpointed_blocks(sharded: nn.Module, mode: str | None = None) -> list[str]:
    """The FQNs of the blocks whose forward runs checkpointed (in ``mode`` only, if given).

    Example: ``fxshard.checkpointed_blocks(sharded)   # ['model.layers.0', 'model.layers.1']``
    """
    out = []
    for p in programs_of(sharded):
        if not isinstance(p, fx.GraphModule):
            continue
        for fqn in program_meta(p).fsdp_units or ():
            m = program_meta(p.get_submodule(fqn)).activation_checkpoint
            if m and (mode is None or _mode_name(m) == mode):
                out.append(fqn)
    return out


def _mode_name(m) -> str:
    return m if isinstance(m, str) else "full"


def has_checkpointed_layers(model: nn.Module) -> bool:
    """Whether ``model`` asks for activation checkpointing that its capture would lose: an HF
    layer with ``gradient_checkpointing`` on, or a module wrapped by torch's
    ``checkpoint_wrapper`` (torchtitan's activation checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(getattr(m, "gradient_checkpointing", False) is True or isinstance(m, CheckpointWrapper)
               for m in model.modules())
