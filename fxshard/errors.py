"""Errors fxshard raises for a plan that cannot be carried out.

Every message names *where* (module FQN, graph node, source line), *what* (the
layouts involved, per mesh axis) and *the fix* (the plan change that would work).
"""
from __future__ import annotations

import os

import torch.fx as fx


class PlanError(ValueError):
    """A sharding plan that does not fit the model or the mesh."""


class SignatureMismatchError(PlanError, TypeError):
    """A user-supplied function (a local region's ``compute=``) whose signature does not
    match the module's forward: a plan error, and a ``TypeError`` as a bad call is."""


class PlacementMismatchError(PlanError):
    """A layout declared in the plan (``out_src`` / preset ``inputs``) differs from the
    layout that propagation derived for that value."""


_PKG = os.path.dirname(os.path.abspath(__file__))
_PASSES = os.path.join(os.path.dirname(_PKG), "passes")


def _internal(path: str) -> bool:
    """Frames of torch and of fxshard's own machinery (capture hooks included); its test
    and demo models (``fxshard.testing``) are user code."""
    d = os.path.dirname(os.path.abspath(path))
    ours = d == _PKG or d.startswith(_PKG + os.sep) or d in (_PASSES, os.path.join(_PKG, "passes"))
    return "/torch/" in path or (ours and d != os.path.join(_PKG, "testing"))


def source_line(node: fx.Node) -> str | None:
    """``file:line  code`` of the user code that produced ``node``: the innermost
    frame of its stack trace outside torch and fxshard."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [l.strip() for l in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if not lines[i].startswith("File "):
            continue
        try:
            path = lines[i].split('"')[1]
            lineno = lines[i].split("line ")[1].split(",")[0]
        except IndexError:
            continue
        if _internal(path):
            continue
        code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
        return f"{path}:{lineno}  `{code}`" if code else f"{path}:{lineno}"
    return None


def module_of(node: fx.Node) -> str:
    """Innermost module FQN (and type) that ``node`` was traced in."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "<top level>"
    fqn, mtype = list(stack.values())[-1]
    name = getattr(mtype, "__name__", None) or str(mtype).rsplit(".", 1)[-1].rstrip("'>")
    return f"{fqn or '<root>'} ({name})"


def node_error(node: fx.Node, problem: str, fix: str, cls: type[PlanError] = PlanError) -> PlanError:
    """Build a PlanError that points at ``node``."""
    from .layout import target_name  # local import: layout imports nothing from here

    lines = [f"cannot shard node `{node.name}` ({target_name(node)}) in module {module_of(node)}"]
    src = source_line(node)
    if src:
        lines.append(f"  source:  {src}")
    lines.append(f"  problem: {problem}")
    lines.append(f"  fix:     {fix}")
    return cls("\n".join(lines))


def swapped_linears(node: fx.Node, axis: str) -> str | None:
    """The FQN of the column-parallel module fed by the row-parallel one whose input
    marker ``node`` is, if there is one: a plan with ``rowwise`` then ``colwise`` (an
    MLP's ``w1: rowwise(), w2: colwise()``, attention's ``wq: rowwise(), wo: colwise()``)
    has the two swapped.  Reads the boundaries ``regions`` declared (``node.meta``); a
    module is column-parallel when its output is declared produced ``Shard`` on its last
    dim on ``axis``, row-parallel when ``Partial``.

    Example: ``swapped_linears(w1_input_marker, "tp")`` is ``"w2"`` for that MLP plan.
    """
    from torch.distributed.tensor import Partial, Shard

    from .boundary import region_input, region_output
    from .meta import KEY

    def boundary(n):
        meta = n.meta.get(KEY)
        return getattr(meta, "declared", None) if meta is not None else None

    def produces(fqn: str):
        """The layout the module ``fqn`` is declared to produce on ``axis``, and the rank of its output."""
        for n in node.graph.nodes:
            b = boundary(n)
            if n.target is region_output and b is not None and b.fqn == fqn and b.src and axis in b.src:
                val = n.meta.get("val")
                return b.src[axis], getattr(val, "ndim", None)
        return None, None

    mine = boundary(node)
    if mine is None or not isinstance(produces(mine.fqn)[0], Partial):
        return None
    seen, todo = set(), list(node.users)
    while todo:  # the first planned modules downstream of this one's output
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        b = boundary(n)
        if n.target is region_input and b is not None and b.fqn != mine.fqn:
            p, ndim = produces(b.fqn)
            if isinstance(p, Shard) and (p.dim == -1 or (ndim is not None and p.dim == ndim - 1)):
                return b.fqn
            continue  # another planned module: look no further on this path
        todo.extend(n.users)
    return None
