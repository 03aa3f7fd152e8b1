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

Plain tensor attributes (``self.mask = torch.tril(...)`` in ``__init__``, a rotary
table set by ``setup_caches()``, the constants ``torch.export`` lifts) are no state of
``nn.Module``: ``.to()``, ``deepcopy`` of a tree and ``fx.GraphModule`` lose or
duplicate them.  :func:`register_attribute_buffers` makes every one the graph reads a
non-persistent buffer under its FQN (not in ``state_dict``, as on the model), so every
later step (copy, sharding, ``materialize``, ``.to(device)``) treats it as a buffer::

    register_attribute_buffers(gm, model)   # gm.attn.mask is now a buffer, state_dict unchanged
"""
from __future__ import annotations

import contextlib

from typing import Any

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


def attribute_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every plain tensor attribute (neither parameter nor buffer) of ``module`` and its
    submodules: ``(fqn, tensor)``."""
    return [(f"{prefix}.{name}" if prefix else name, v) for prefix, mod in module.named_modules()
            for name, v in vars(mod).items() if isinstance(v, torch.Tensor)]


def graph_attribute_tensors(gm) -> list[tuple[str, torch.Tensor]]:
    """The plain tensor attributes ``gm``'s graph reads (``get_attr`` targets that are
    neither parameters nor buffers): ``(fqn, tensor)``."""
    out, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in seen:
            continue
        seen.add(node.target)
        owner, leaf = _owner(gm, node.target)
        if owner is not None and isinstance(vars(owner).get(leaf), torch.Tensor):
            out.append((node.target, vars(owner)[leaf]))
    return out


def register_attribute_buffers(gm, model: nn.Module | None = None) -> list[str]:
    """Make every plain tensor ``gm``'s graph reads a non-persistent buffer; returns their FQNs.

    With ``model`` (the module ``gm`` was captured from), a tensor fx named
    ``_tensor_constant0`` (or made a persistent buffer) that is a plain attribute of
    the model is moved to the model's FQN (``attn.mask``), and every ``get_attr``
    tensor that is no parameter or buffer of the model becomes non-persistent, so
    ``gm.state_dict()`` has the model's keys.

    Example::

        gm = torch.fx.symbolic_trace(model)      # model.attn.mask is a plain attribute
        register_attribute_buffers(gm, model)    # gm.attn.mask: a non-persistent buffer
    """
    model_state = {fqn for fqn, _, _ in named_state(model)} if model is not None else None
    model_attrs: dict[int, str] = {}
    for fqn, t in attribute_tensors(model) if model is not None else ():
        model_attrs.setdefault(id(t), fqn)  # the tensor object the model holds: its name there
    taken = {fqn for fqn, _, _ in named_state(gm)}
    done: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        if node.target in done:
            node.target = done[node.target]
            continue
        owner, leaf = _owner(gm, node.target)
        value = vars(owner).get(leaf) if owner is not None else None
        if value is None and owner is not None and model_state is not None and node.target not in model_state:
            value = owner._buffers.get(leaf)  # fx registered the attribute as a (persistent) buffer
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue
        name = model_attrs.get(id(value), node.target)
        if name != node.target and name in taken:
            name = node.target
        vars(owner).pop(leaf, None)
        owner._buffers.pop(leaf, None)
        owner._non_persistent_buffers_set.discard(leaf)
        new_owner, new_leaf = _owner(gm, name, create=True)
        new_owner._buffers[new_leaf] = value
        new_owner._non_persistent_buffers_set.add(new_leaf)
        taken.add(name)
        done[node.target] = name
        node.target = name
    if done and hasattr(gm, "recompile"):
        gm.recompile()
    return sorted(set(done.values()))


@contextlib.contextmanager
def attributes_as_buffers(module: nn.Module):
    """While the block runs, every plain tensor attribute of ``module`` is a
    non-persistent buffer of its owner (so ``torch.fx`` reads it by name, ``get_attr
    attn.mask``, instead of folding ``self.mask == 0`` into an anonymous constant);
    afterwards each is a plain attribute again, holding what the block left there."""
    moved = []
    for fqn, t in attribute_tensors(module):
        owner, leaf = _owner(module, fqn)
        if leaf in owner._buffers or leaf in owner._parameters:
            continue
        del vars(owner)[leaf]
        owner._buffers[leaf] = t
        owner._non_persistent_buffers_set.add(leaf)
        moved.append((owner, leaf))
    try:
        yield
    finally:
        for owner, leaf in moved:
            owner._non_persistent_buffers_set.discard(leaf)
            value = owner._buffers.pop(leaf, None)
            vars(owner)[leaf] = value


def _owner(module: nn.Module, fqn: str, create: bool = False):
    """``(owning module, leaf name)`` of ``fqn``; owner None where a module on the path is missing."""
    path, _, leaf = fqn.rpartition(".")
    owner = module
    for part in path.split(".") if path else ():
        if part not in owner._modules:
            if not create:
                return None, leaf
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]
    return owner, leaf


def drop_unused_modules(gm) -> None:
    """``gm.delete_all_unused_submodules()``, keeping every parameter and buffer."""
    state = named_state(gm)
    gm.delete_all_unused_submodules()
    add_missing_state(gm, state)


_REQUIRED = object()


def attribute(module: nn.Module, target: str, default: Any = _REQUIRED) -> Any:
    """The object at the dotted path ``target`` under ``module`` (a ``get_attr`` node's
    target: a parameter, buffer, plain tensor or submodule); ``default`` where there is
    none, if given, else ``AttributeError``.

    Example: ``attribute(gm, "layers.0.attention.wq.weight")``.
    """
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part, _REQUIRED)
        if obj is _REQUIRED:
            if default is _REQUIRED:
                raise AttributeError(f"{type(module).__name__} has no attribute {target!r} (no {part!r})")
            return default
    return obj
