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


def target_name(node: fx.Node) -> str:
    """How a node's target reads in messages and dumps: ``F.linear``, ``Tensor.view``, ``fxshard.all_reduce``."""
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op in ("call_module", "get_attr", "placeholder", "output"):
        return str(t)
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", str(t))
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if mod.startswith("torch._C._nn"):
        return f"F.{name}"
    if mod.startswith("torch.nn.functional"):
        return f"F.{name}"
    if mod.startswith("torch") and not mod.startswith("torch._"):
        return f"torch.{name}" if mod in ("torch", "torch.functional") else f"{mod}.{name}"
    if mod.startswith("fxshard"):
        return f"fxshard.{name}"
    return f"{mod}.{name}" if mod else name



def node_error(node: fx.Node, problem: str, fix: str, cls: type[PlanError] = PlanError) -> PlanError:
    """Build a PlanError that points at ``node``."""
    lines = [f"cannot shard node `{node.name}` ({target_name(node)}) in module {module_of(node)}"]
    src = source_line(node)
    if src:
        lines.append(f"  source:  {src}")
    lines.append(f"  problem: {problem}")
    lines.append(f"  fix:     {fix}")
    return cls("\n".join(lines))
