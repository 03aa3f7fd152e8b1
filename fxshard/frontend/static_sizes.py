"""Input sizes the model's code fixed at capture, checked when the program is called.

fxshard captures batch and sequence dims as dynamic (``Dim.AUTO``), but torch.export keeps
a dim static where the model's code needs a number: a Python loop over the sequence
(Mamba's reference scan, used when its CUDA kernel is not installed, unrolls one step per
token), a size compared with a constant.  The program then computes that size and no
other; called on another, it would fail deep inside (or, for some code, compute on part of
the input).  ``frontend.capture`` records those dims (``gm.meta["static_input_dims"]``);
this module turns them into a check on the inputs of the transformed program (a forward
pre-hook; the pipeline's ``train_step`` checks its batch) that names the input, the dim
and the fix.

Example::

    sharded = fxshard.transform(jamba, plan, example_kwargs={"input_ids": ids_of_length_6})
    sharded(input_ids=ids_of_length_8)   # PlanError: input 'input_ids' dim 1 is fixed at 6 ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from fxshard.errors import PlanError
from fxshard.frontend.capture import flat_inputs
from fxshard.meta import KEY, TensorInfo


@dataclass(frozen=True)
class StaticSize:
    """Input ``name`` (placeholder ``index``) has ``local`` on ``dim`` on this rank: the
    model's code fixed the dim at ``size`` (global) when the program was captured."""

    index: int
    name: str
    dim: int
    local: int
    size: int


def static_input_sizes(gm: fx.GraphModule) -> list[StaticSize]:
    """The fixed input dims of a transformed program, with this rank's local sizes."""
    recorded = gm.meta.get("static_input_dims") or []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for name, dim, size in recorded:
        index = next((i for i, n in enumerate(placeholders) if n.name == name), None)
        if index is None:  # an input cut away (a pipeline's loss target)
            continue
        value = getattr(placeholders[index].meta.get(KEY), "value", None)
        local = value.local_shape[dim] if isinstance(value, TensorInfo) else size
        out.append(StaticSize(index, name, dim, local, size))
    return out


def check_static_sizes(sizes: Sequence[StaticSize], inputs: dict, model: str, microbatches: int = 1) -> None:
    """Raise a PlanError when an input of ``inputs`` (by name) differs from its fixed size.
    ``microbatches``: the inputs are a whole batch that a schedule splits on dim 0."""
    for s in sizes:
        x = inputs.get(s.name)
        if not isinstance(x, torch.Tensor) or x.dim() <= s.dim:
            continue
        got = x.shape[s.dim] // microbatches if s.dim == 0 else x.shape[s.dim]
        if got != s.local:
            per = " per micro-batch" if s.dim == 0 and microbatches > 1 else ""
            here = f" ({s.local} on this rank)" if s.local != s.size else ""
            raise PlanError(
                f"input {s.name!r} of {model} has {got} on dim {s.dim}{per}, but the program was captured with that dim "
                f"fixed at {s.size}{here}: the model's code needs a number there (torch.export kept it static, e.g. a "
                f"Python loop over the sequence, as Mamba's reference scan without its CUDA kernel), so the program "
                f"computes that size only\n  fix: transform with example inputs of the size you run (one program per "
                f"size: pad the batches to one length and transform at it)")


class StaticSizeGuard:
    """Forward pre-hook of a program with fixed input dims (:func:`guard_static_input_sizes`)."""

    def __init__(self, sizes: Sequence[StaticSize], model: str):
        self.sizes, self.model = tuple(sizes), model

    def __call__(self, module, args, kwargs):
        flat = flat_inputs(module, args, kwargs)
        check_static_sizes(self.sizes, {s.name: flat[s.index] for s in self.sizes if s.index < len(flat)}, self.model)
        return None


def guard_static_input_sizes(gm: fx.GraphModule) -> list[StaticSize]:
    """Give ``gm`` a pre-hook that checks its fixed input dims, if it has any; returns them."""
    sizes = static_input_sizes(gm)
    if sizes:
        gm.register_forward_pre_hook(StaticSizeGuard(sizes, gm.meta.get("model_class", type(gm).__name__)), with_kwargs=True)
    return sizes
