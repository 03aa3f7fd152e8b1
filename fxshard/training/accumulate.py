"""Gradient accumulation: ``with fxshard.no_sync(sharded):`` (DDP's name).

Inside the block, backward passes accumulate each rank's gradient without the
gradient syncs of parameters: fxshard's bucketed syncs of replicated parameters hold
their share back (:func:`fxshard.runtime.collectives.hold_param_syncs`) and FSDP2 skips its
reduce-scatter (``set_requires_gradient_sync(False)``).  The first backward after the
block adds what was held back and syncs the sum once, so ``k`` micro-batches cost one
sync per bucket and the result equals one device on the whole batch.  Syncs of
activations (the gradient of a replicated activation entering a column-parallel
linear) run in every backward: the rest of that backward needs them.

Example::

    for i, micro in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else fxshard.no_sync(sharded):
            (sharded(**micro).loss / len(micro_batches)).backward()
    fxshard.clip_grad_norm_(sharded, 1.0)
    opt.step()

As with DDP, the optimizer must step only after a backward outside the block.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from fxshard.runtime import collectives

__all__ = ["no_sync"]


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients without syncing parameters' gradients
    (fxshard's and FSDP2's); the first backward after the block syncs the sum.

    Example: ``with fxshard.no_sync(sharded): (loss / k).backward()``
    """
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    previous = collectives.hold_param_syncs(True)
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        collectives.hold_param_syncs(previous)
        for m in fsdp:
            m.set_requires_gradient_sync(True, recurse=False)
