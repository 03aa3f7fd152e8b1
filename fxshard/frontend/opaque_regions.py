"""Local regions under ``torch.export``: the region's call stays one node.

A local region (``ModuleSpec(local=True)``: :func:`fxshard.routed_experts`,
:func:`fxshard.expert_parallel`) runs its own forward on local tensors, so the graph must
hold its *call*, not the ops of its forward (which export would trace through, with the
global number of experts and the routing of one device baked in).  While exporting,
the region's forward is replaced by one ``fxshard::local_region`` custom op that takes
the call's tensors; afterwards each such node becomes ``call_module(fqn, args)`` on the
region's own module, exactly what :func:`fxshard.trace` makes of a leaf module, so no
pass sees how the graph was captured.

The op's output shapes come from running the region's forward once on export's fake
tensors with tracing switched off (nothing of it is recorded): a data-dependent size
becomes an unbacked symbol, as it would in the graph.

Example (what ``capture`` does)::

    with opaque_local_regions(model, plan) as calls:
        ep = torch.export.export(model, args, kwargs, strict=False)
    gm = ep.module()
    restore_local_region_calls(gm, model, calls)   # fxshard::local_region -> call_module
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

_CALLS: dict[int, "_Call"] = {}  # call id -> what one region call looked like (this process's captures)
_IDS = itertools.count()


@dataclass
class _Call:
    fqn: str
    in_spec: Any                # pytree spec of (args, kwargs)
    leaves: list                # their leaves, tensors as None (filled from the op's inputs)
    out_spec: Any               # pytree spec of the forward's result
    outputs: list[torch.Tensor]  # fake outputs: the op's shapes


@torch.library.custom_op("fxshard::local_region", mutates_args=())
def local_region(tensors: list[torch.Tensor], fqn: str, call: int) -> list[torch.Tensor]:
    """Placeholder for a local region's call while exporting; never runs (capture turns
    it into a ``call_module``)."""
    raise RuntimeError(f"fxshard::local_region({fqn!r}) only marks a region's call during capture; fxshard.trace "
                       f"turns it into a call of the module")


@local_region.register_fake
def _(tensors, fqn, call):
    return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device) for o in _CALLS[call].outputs]


def _opaque_forward(module: nn.Module, fqn: str, ids: list[int], shapes=None):
    original = module.forward
    shapes = shapes or original  # what runs for the output shapes

    @functools.wraps(original)  # the boundary hooks bind arguments by the forward's signature
    def forward(*args, **kwargs):
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        with disable_proxy_modes_tracing(), torch.no_grad():
            result = shapes(*args, **kwargs)  # on fake tensors, not recorded: the output shapes
        outs, out_spec = pytree.tree_flatten(result)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            from fxshard.errors import PlanError
            raise PlanError(f"local region {fqn!r} returns {type(result).__name__} with non-tensor parts; a local "
                            f"region returns a tensor or a tuple of tensors")
        call = next(_IDS)
        _CALLS[call] = _Call(fqn, in_spec, [None if isinstance(x, torch.Tensor) else x for x in leaves], out_spec, outs)
        ids.append(call)
        return pytree.tree_unflatten(torch.ops.fxshard.local_region(tensors, fqn, call), out_spec)

    return forward


@contextlib.contextmanager
def opaque_local_regions(model: nn.Module, plan):
    """While exporting, every module the plan makes a local region calls one
    ``fxshard::local_region`` op; yields the list of call ids recorded."""
    ids: list[int] = []
    patched = []
    try:
        if plan is not None:
            for fqn, module in model.named_modules():
                hit = plan.match(fqn)
                if hit is not None and hit[1].local:
                    module.forward = _opaque_forward(module, fqn, ids, _shape_forward(module, hit[1]))
                    patched.append(module)
        yield ids
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def _shape_forward(module: nn.Module, spec):
    """HF's routed experts run fxshard's grouped forward once transformed: so do they for the
    shapes (HF's own kernel may have no fake implementation: torch's grouped_mm takes bf16
    only on meta)."""
    from fxshard.runtime.routed_experts import RoutedExpertsSpec, follows_hf_experts, grouped_experts_forward

    if isinstance(spec, RoutedExpertsSpec) and follows_hf_experts(module):
        return functools.partial(grouped_experts_forward, module)
    return None


def restore_local_region_calls(gm: fx.GraphModule, model: nn.Module, ids: list[int]) -> None:
    """Each ``fxshard::local_region`` node becomes ``call_module(fqn, args, kwargs)`` on the
    model's module (shared, never written: the transform works on a copy)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.fxshard.local_region.default:
            continue
        tensors, fqn, call_id = node.args
        call = _CALLS.pop(call_id)
        it = iter(tensors)
        leaves = [next(it) if x is None else x for x in call.leaves]
        args, kwargs = pytree.tree_unflatten(leaves, call.in_spec)
        _set_submodule(gm, fqn, model.get_submodule(fqn))
        with graph.inserting_before(node):
            new = graph.call_module(fqn, tuple(args), dict(kwargs))
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "nn_module_stack")})
        stack = node.meta.get("nn_module_stack") or {}
        new.meta["nn_module_stack"] = {k: v for k, v in stack.items() if _qualname(v) != fqn}  # as a leaf call: its parents
        vals = node.meta.get("val")
        single = call.out_spec.num_leaves == 1 and call.out_spec.is_leaf()
        if vals is not None:
            new.meta["val"] = vals[0] if single else tuple(vals)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                if single:
                    user.replace_all_uses_with(new)
                    graph.erase_node(user)
                else:
                    user.args = (new, user.args[1])
            else:
                raise RuntimeError(f"fxshard::local_region({fqn!r}) used by {user.format_node()}, expected getitem")
        graph.erase_node(node)
    for call_id in ids:
        _CALLS.pop(call_id, None)
    graph.lint()


def _qualname(entry) -> str:
    path = entry[0] if isinstance(entry, tuple) else entry
    return path.removeprefix("L['self'].") if isinstance(path, str) else path


def _set_submodule(gm: fx.GraphModule, fqn: str, module: nn.Module) -> None:
    parent = gm
    *path, name = fqn.split(".")
    for part in path:
        if not hasattr(parent, part):
            parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    parent._modules[name] = module
