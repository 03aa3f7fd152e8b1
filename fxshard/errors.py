"""Errors fxshard raises: PlanError for a plan that cannot be carried out, and
InternalError for a bug in fxshard itself.

Every PlanError names *where* (module FQN, graph node, source line), *what* (the
layouts involved, per mesh axis) and *the fix* (the plan change that would work).  An
InternalError names the pass, the original exception and where it was raised, and asks
for a report: it is never a PlanError, so nothing takes it for a refusal of the plan.
"""
from __future__ import annotations

import os
import traceback

import torch.fx as fx


class PlanError(ValueError):
    """A sharding plan that does not fit the model or the mesh."""


class SignatureMismatchError(PlanError, TypeError):
    """A user-supplied function (a local region's ``compute=``) whose signature does not
    match the module's forward: a plan error, and a ``TypeError`` as a bad call is."""


class PlacementMismatchError(PlanError):
    """A layout declared in the plan (``out_src`` / preset ``inputs``) differs from the
    layout that propagation derived for that value."""


class InternalError(RuntimeError):
    """A bug in fxshard, never a refusal of the plan: an exception other than a
    PlanError inside a pass or the capture, or a pass that broke the contract of the
    pass table (``fxshard.transform.PIPELINE``: what it requires and ensures).

    It is not a PlanError on purpose: whoever tries plans and takes a PlanError for "this
    plan does not fit" (``fxshard.auto_plan``) lets it through, so that a bug never
    silently changes the plan picked.  ``pass_name``: the pass (or ``"capture"``);
    ``original``: the exception raised inside it, if any (also ``__cause__``);
    ``location``: ``file:line, function`` of the innermost frame in fxshard.

    Example::

        try:
            sharded = fxshard.transform(model, plan, example_inputs=(x,))
        except fxshard.InternalError as e:   # please report it, with the message
            print(e.pass_name, e.location, repr(e.original))   # localize localize.py:58, localize KeyError('boom')
    """

    def __init__(self, pass_name: str, problem: str, *, original: BaseException | None = None, location: str = "",
                 node: fx.Node | None = None):
        self.pass_name, self.original, self.location = pass_name, original, location
        where = "the capture" if pass_name == "capture" else f"pass {pass_name}"
        lines = [f"internal error in {where}{f' ({location})' if location else ''}: {problem}"]
        if node is not None:
            lines.append(f"  node:    `{node.name}` ({target_name(node)}) in module {module_of(node)}")
            src = source_line(node)
            if src:
                lines.append(f"  source:  {src}")
        lines.append("  this is a bug in fxshard, not a problem with the plan or the model: please report it with this "
                     "message and the traceback")
        super().__init__("\n".join(lines))

    @classmethod
    def from_exception(cls, pass_name: str, e: BaseException, node: fx.Node | None = None) -> "InternalError":
        """The InternalError for ``e`` raised inside ``pass_name``, located at the innermost
        frame of fxshard's own code in its traceback."""
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _ours(f.filename)]
        location = f"{os.path.relpath(frames[-1].filename, _ROOT)}:{frames[-1].lineno}, {frames[-1].name}" if frames else ""
        return cls(pass_name, f"{type(e).__name__}: {e}", original=e, location=location, node=node)


_PKG = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PKG)
_PASSES = os.path.join(_ROOT, "passes")


def _ours(path: str) -> bool:
    """A frame of fxshard's package or of its passes."""
    d = os.path.dirname(os.path.abspath(path))
    return d == _PKG or d.startswith(_PKG + os.sep) or d == _PASSES


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
