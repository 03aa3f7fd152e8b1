"""What a layout rule sees (:class:`Ctx`) and the helpers every family of rules uses.

A rule is ``rule(ctx) -> layout``: it reads the node, the mesh axes and the layouts of
its arguments through ``ctx``, and returns the output layout, one per output for a
tuple, or a :class:`~fxshard.meta.SizeInfo` for ints read from shapes.  It reasons one
mesh axis at a time (:func:`layout_map`): placements on different axes are independent.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from fxshard.errors import PlanError, node_error
from fxshard.layout.placements import fmt_layout
from fxshard.meta import KEY, Rewrite, TensorInfo

R = Replicate()


class Ctx:
    """What a rule sees: the node, the mesh axes, argument infos and the global output value."""

    def __init__(self, node: fx.Node, axes: dict[str, int], fsdp_axes: tuple[str, ...] = (), cp_axes: tuple[str, ...] = ()):
        self.node = node
        self.axes = axes
        self.fsdp_axes = fsdp_axes  # axes whose gradients FSDP2 averages (Plan(fsdp=...))
        self.cp_axes = cp_axes  # axes the sequence is sharded on (fxshard.context_parallel)
        self.val = node.meta.get("val")

    # -- arguments ---------------------------------------------------------------------
    def arg(self, i: int, name: str | None = None, default=None):
        if i < len(self.node.args):
            return self.node.args[i]
        if name is not None and name in self.node.kwargs:
            return self.node.kwargs[name]
        return default

    @staticmethod
    def info_of(a) -> Any:
        if isinstance(a, fx.Node):
            m = a.meta.get(KEY)
            return None if m is None else m.value
        return None

    def t(self, i: int, name: str | None = None) -> TensorInfo | None:
        v = self.info_of(self.arg(i, name))
        return v if isinstance(v, TensorInfo) else None

    def tensor_args(self) -> list[tuple[Any, TensorInfo]]:
        out = []
        for a in flat_args(self.node.args, self.node.kwargs):
            v = self.info_of(a)
            if isinstance(v, TensorInfo):
                out.append((a, v))
        return out

    @property
    def out_ndim(self) -> int:
        if not isinstance(self.val, torch.Tensor):
            raise self.fail(f"this op's recorded value is {type(self.val).__name__}, not a tensor, but its rule needs the "
                            f"tensor result's shape", "pass example_inputs to fxshard.transform, or file an issue for this op")
        return self.val.dim()

    # -- errors ---------------------------------------------------------------------
    def fail(self, problem: str, fix: str) -> PlanError:
        ins = [f"{a.name} {fmt_layout(ti.layout)}" for a, ti in self.tensor_args()]
        if ins:
            problem = f"{problem}\n  inputs:  " + "; ".join(ins)
        return node_error(self.node, problem, fix)

    # -- graph rewrites ----------------------------------------------------------------
    def request_rewrite(self, rewrite: Rewrite) -> None:
        """Ask the pass ``rewrite.pass_name`` to rewrite this node: the layout this rule
        returns holds once it has (see :class:`fxshard.meta.Rewrite`)."""
        self.node.meta[KEY].rewrite = rewrite


def flat_args(args, kwargs) -> list:
    """The leaves of a node's args and kwargs, through tuples, lists and dicts."""
    out = []

    def walk(x):
        if isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        else:
            out.append(x)

    walk(args)
    walk(kwargs)
    return out


def reduce_fix(axis: str) -> str:
    """The fix for a Partial value an op cannot take on ``axis``: reduce it at its module's boundary."""
    return ("reduce the value before this op: give the module that produced the Partial an output layout on "
            f"{axis!r} (rowwise(out=Replicate()) or ModuleSpec(out_dst={{{axis!r}: Replicate()}}))")


def layout_map(ctx: Ctx, fn: Callable[[str], Any]) -> dict:
    """The layout ``{axis: fn(axis)}``: a rule decides each mesh axis on its own."""
    return {axis: fn(axis) for axis in ctx.axes}


def origin_of(node: fx.Node) -> str:
    """How a value reads in a message: markers name their module."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") in ("region_output", "region_input"):
        kind = "output" if node.target.__name__ == "region_output" else "input"
        return f"the {kind} of module `{node.args[1]}`"
    return f"`{node.name}`"


def op_name(node: fx.Node) -> str:
    """The op's bare name for messages: ``add``, ``softmax``, ``view``."""
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))
