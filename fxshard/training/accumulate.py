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

``no_sync(sharded, sharded_grads=True)``: FSDP2 reduce-scatters in every backward and its
gradients accumulate sharded (torchtitan's and ZeRO-3's accumulation): between passes a rank
holds 1/dp of the gradients, not the unsharded fp32 gradients of the whole model part it runs,
for one reduce-scatter per pass instead of one per step.  fxshard's own syncs of replicated
parameters are held back either way (their gradients are whole on every rank anyway).

Inside a compiled graph (``fxshard.compile``'s blocks, ``torch.compile``) the syncs are not
held back: a traced backward keeps no state from one call to the next, so each backward
there syncs its gradients (the same numbers, ``k`` all-reduces instead of one; FSDP2's
hooks, outside the graphs, still skip theirs).  ``no_sync`` warns once when it meets
compiled blocks.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch.fx as fx
import torch.nn as nn

from fxshard.runtime import collectives
from fxshard.training.compile import compiled_blocks

__all__ = ["no_sync"]


@contextlib.contextmanager
def no_sync(module: nn.Module, sharded_grads: bool = False) -> Iterator[None]:
    """Backward passes inside accumulate gradients without syncing parameters' gradients
    (fxshard's and FSDP2's); the first backward after the block syncs the sum.
    ``sharded_grads``: FSDP2 still reduce-scatters in each backward, so that its gradients
    accumulate sharded (less memory, more reduce-scatters; see the module docstring).

    Example: ``with fxshard.no_sync(sharded): (loss / k).backward()``
    """
    from torch.distributed.fsdp import FSDPModule

    fsdp = [] if sharded_grads else [m for m in module.modules() if isinstance(m, FSDPModule)]
    if isinstance(module, fx.GraphModule) and compiled_blocks(module):
        warnings.warn("fxshard.no_sync: the gradient syncs inside compiled blocks run in every backward (a compiled "
                      "graph holds nothing back between backwards): the same gradients, more all-reduces",
                      stacklevel=3)
    previous = collectives.hold_param_syncs(True)
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        collectives.hold_param_syncs(previous)
        for m in fsdp:
            m.set_requires_gradient_sync(True, recurse=False)
