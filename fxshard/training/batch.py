"""This rank's share of a global batch, as the plan lays the inputs out.

A transformed module takes, on every rank, the inputs the plan's ``inputs=`` layouts
describe: rows of the batch over a data-parallel axis (``{"dp": Shard(0)}``), a piece of
the sequence over a context-parallel one (load-balanced: chunks ``i`` and ``2n-1-i``).
:func:`shard_inputs` cuts the global batch that every rank reads (same seed, same data
order) into exactly that, from the layouts the transform recorded on the graph's
inputs, so a training loop reads the same with and without dp or cp.

Example::

    plan = fxshard.Plan.from_hf(mesh, model).replace(inputs={"input_ids": {"dp": Shard(0)},
                                                             "labels": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, example_kwargs=batch)
    args, kwargs = fxshard.shard_inputs(sharded, **batch)      # this rank's rows
    loss = sharded(*args, **kwargs).loss                        # this rank's mean
    logged = fxshard.reduce_over(loss.detach(), op="avg")      # the mean over the mesh, on every rank
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxshard.runtime import collectives
from fxshard.runtime.context_parallel_ops import split_sequence
from fxshard.errors import PlanError
from fxshard.meta import KEY, TensorInfo

__all__ = ["shard_inputs"]


def shard_inputs(sharded: fx.GraphModule, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for this rank from the global ``args`` / ``kwargs``: every tensor
    input cut as its layout in the plan says (``Shard(d)`` over an axis: this rank's
    ``torch.chunk`` piece of dim ``d``; over a context-parallel axis: its sequence
    positions, load-balanced when the plan's :func:`fxshard.context_parallel` is); other
    inputs unchanged.  Needs the mesh the transform bound; no communication.

    Example: ``args, kwargs = fxshard.shard_inputs(sharded, input_ids=ids, labels=labels)``
    """
    if "fxshard_state" not in getattr(sharded, "meta", {}):
        raise PlanError("fxshard.shard_inputs: this module was not made by fxshard.transform\n"
                        "  fix: pass the module fxshard.transform returned")
    placeholders = [n for n in sharded.graph.nodes if n.op == "placeholder"]
    pytree_info = getattr(sharded.graph._codegen, "pytree_info", None)
    if pytree_info is not None and pytree_info.in_spec is not None:  # a captured model: inputs flattened by its spec
        import torch.fx._pytree as fx_pytree
        from torch.utils import _pytree as pytree

        flat = fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), pytree_info.in_spec)
        local = [_share(sharded, node, x) for node, x in zip(placeholders, flat)]
        out_args, out_kwargs = pytree.tree_unflatten(local, pytree_info.in_spec)
        return tuple(out_args), dict(out_kwargs)
    by_name = {n.target: n for n in placeholders}
    unknown = sorted(set(kwargs) - set(by_name))
    if unknown:
        raise PlanError(f"fxshard.shard_inputs: {unknown} are not inputs of the module (its inputs are {list(by_name)})")
    out_args = tuple(_share(sharded, node, x) for node, x in zip(placeholders, args))
    return out_args, {k: _share(sharded, by_name[k], v) for k, v in kwargs.items()}


def _share(sharded: fx.GraphModule, node: fx.Node, x: Any) -> Any:
    meta = node.meta.get(KEY)
    value = meta.value if meta is not None else None
    if not isinstance(x, torch.Tensor) or not isinstance(value, TensorInfo):
        return x
    cp_axes = sharded.meta.get("fxshard_context_parallel") or {}
    cuts = [(axis, p.dim) for axis, p in value.layout.items() if isinstance(p, Shard)]  # outer axes first
    # the sequence positions are picked from the global tensor (split_sequence reads a whole
    # one), then the other axes cut their dims: the same pieces when no two axes cut one dim
    sequence = [(a, d) for a, d in cuts if a in cp_axes]
    others = [(a, d) for a, d in cuts if a not in cp_axes]
    if sequence and len({d for _, d in cuts}) < len(cuts):
        raise PlanError(f"fxshard.shard_inputs: input {node.target!r} is cut on one dim by a context-parallel axis and "
                        f"another ({cuts}); cut it by hand with fxshard.split_sequence and fxshard.shard")
    _check_even(sharded, node, value, x, cuts)
    with torch.no_grad():
        t = x
        for axis, dim in sequence:
            t = split_sequence(t, axis, dim, load_balance=cp_axes[axis]["load_balance"])
        for axis, dim in others:
            t = collectives.shard(t, axis, dim)
        t = t if t is x else t.contiguous()
    return t.detach().requires_grad_(x.requires_grad) if t is not x else x


def _check_even(sharded: fx.GraphModule, node: fx.Node, value: TensorInfo, x: torch.Tensor, cuts) -> None:
    """A dim the example's axis divided must divide now: the program computes each rank's
    positions as its index times its own length, which holds only for equal pieces."""
    axes = sharded.meta.get("fxshard_mesh", {})
    for axis, dim in cuts:
        n = axes.get(axis, 1)
        if n > 1 and value.shape[dim] % n == 0 and x.size(dim) % n:
            raise PlanError(f"fxshard.shard_inputs: input {node.target!r} has {x.size(dim)} along dim {dim}, which the "
                            f"{n} ranks of axis {axis!r} do not divide; the program was transformed at "
                            f"{value.shape[dim]}, which they do, so it assumes equal pieces (each rank's positions are "
                            f"its index times its own length)\n  fix: pad dim {dim} to a multiple of {n}, or transform "
                            f"with an example whose dim {dim} the axis does not divide (the pieces' lengths are then "
                            f"exchanged at run time)")
