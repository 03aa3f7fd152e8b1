"""record_shapes: the global shapes of a graph that was captured without them.

``fxshard.trace`` records a fake tensor with the global shape in every node's
``meta["val"]``; a GraphModule from plain ``torch.fx.symbolic_trace`` has none.  With
the single-device example inputs (``ctx.example_inputs``) this pass runs the graph on
fake tensors (torch.fx's FakeTensorProp, local regions on zeros); without them, a graph
missing shapes is refused.

Reads:  ``ctx.example_inputs``.
Writes: ``node.meta["val"]``.
"""
from __future__ import annotations

import builtins

import torch
import torch.fx as fx

from fxshard.errors import PlanError
from fxshard.frontend.trace import record_shapes as record_fake_shapes
from fxshard.meta import PassContext

_NON_TENSOR_ATTRS = frozenset({"device", "dtype", "layout", "is_cuda", "is_sparse", "is_meta", "is_quantized"})


def record_shapes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Record the example's shapes on ``gm`` (in place), or check that they are there."""
    if ctx.shapes_recorded:
        return
    if ctx.example_inputs is not None:
        record_fake_shapes(gm, ctx.example_inputs)
    elif any("val" not in n.meta for n in gm.graph.nodes if makes_tensor(n)):
        raise PlanError("this GraphModule has no recorded shapes: pass example_inputs= (the single-device inputs) "
                        "to fxshard.transform, or trace it with fxshard.trace(model, plan, example_inputs)")


def makes_tensor(n: fx.Node) -> bool:
    """Must ``n`` carry a recorded ``val``?  Shape recording (FakeTensorProp) leaves none on
    values without a shape: a tensor's ``.device``/``.dtype`` (``torch.arange(T,
    device=ids.device)``), a placeholder left at its non-tensor default (``targets=None``),
    and a call that returns None, which nothing reads (timm's input check ``torch._assert``)."""
    if n.op in ("output", "get_attr") or n.op.startswith("call_") and not n.users:
        return False
    if n.op == "call_function" and n.target is builtins.getattr and len(n.args) > 1 and n.args[1] in _NON_TENSOR_ATTRS:
        return False
    if n.op == "placeholder" and n.args and not isinstance(n.args[0], torch.Tensor):
        return False  # its default value is used when no example is given for it
    return True
