"""Every parameter and buffer of a module under every FQN, through graph surgery.

``fx.GraphModule`` keeps only the attributes its graph reads, and
``delete_all_unused_submodules`` drops modules no node calls.  A tied weight read under
one of its names (GPT-2's ``transformer.wte.weight`` read as ``lm_head.weight``) or a
parameter the graph never uses would vanish, and ``state_dict`` keys would no longer be
the model's.  These helpers keep them.

Example::

    state = named_state(gm)
    gm.delete_all_unused_submodules()
    add_missing_state(gm, state)      # what drop_unused_modules(gm) does
"""
from __future__ import annotations

import torch
import torch.nn as nn


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Every parameter and buffer under every name, tied ones included: (fqn, tensor, is_param)."""
    return ([(n, t, True) for n, t in module.named_parameters(remove_duplicate=False)]
            + [(n, t, False) for n, t in module.named_buffers(remove_duplicate=False)])


def add_missing_state(module: nn.Module, tensors) -> None:
    """Register each ``(fqn, tensor, is_param)`` that ``module`` lacks, creating plain
    parent modules on the way."""
    for fqn, t, is_param in tensors:
        owner_path, _, name = fqn.rpartition(".")
        owner = module
        for part in owner_path.split(".") if owner_path else ():
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        store = owner._parameters if is_param else owner._buffers
        if name not in store:
            store[name] = t


def drop_unused_modules(gm) -> None:
    """``gm.delete_all_unused_submodules()``, keeping every parameter and buffer."""
    state = named_state(gm)
    gm.delete_all_unused_submodules()
    add_missing_state(gm, state)
