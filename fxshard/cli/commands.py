"""``python -m fxshard dump``: transform a model offline and show the result.

Example::

    python -m fxshard dump 'fxshard.testing.models:llama(n_heads=8,n_kv_heads=4)' \\
        --plan fxshard.testing.models:llama_plan --mesh tp=4 --region layers.0
    python -m fxshard dump mypkg.model:build --plan mypkg.plans:tp_plan --mesh dp=2,tp=4 \\
        --example mypkg.model:example_inputs --format svg -o graph.svg

No process group is needed: the mesh is an :class:`fxshard.MeshSpec`.

``MODULE:NAME`` names a Python object; ``MODULE:NAME(key=value, ...)`` calls it with
literal arguments (each value is read with ``ast.literal_eval``).

* the model factory returns an ``nn.Module``;
* the plan is a dict ``{pattern: ModuleSpec}``, a ``Plan``, a factory returning one of
  those (called with the given arguments, or with none), or a function of the mesh
  (one required parameter) returning one of those; ``--plan auto`` is
  :func:`fxshard.auto_plan` on the mesh's first axis (the plan found goes to stderr);
* ``--example`` returns the single-device inputs (a tuple, or one tensor).  Without
  it, a model with ``.args.vocab_size`` gets ``tokens(2, 8, vocab_size)``.

Formats: ``text`` (:func:`fxshard.dump` and :func:`fxshard.comm_summary`), ``json``,
``dot`` (:mod:`fxshard.dump_formats`), ``svg`` (needs Graphviz and ``-o``).  ``--diff``
prints a unified diff of the traced code and the transformed code instead.  A plan
that does not fit prints the :class:`fxshard.PlanError` to stderr and exits 1; bad
command-line arguments exit 2.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import sys
from typing import Any, Callable

from fxshard.cli.extras import MissingExtra, missing_extra

FORMATS = ("text", "json", "dot", "svg")


class UsageError(Exception):
    """A command-line argument that cannot be used (exit status 2)."""


# --------------------------------------------------------------------------- arguments


def add_dump_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``fxshard dump`` (shared by ``python -m fxshard`` and :func:`main`)."""
    parser.add_argument("model", metavar="MODULE:FACTORY",
                        help="model factory, e.g. 'fxshard.testing.models:llama(n_heads=8,n_kv_heads=4)'")
    parser.add_argument("--plan", required=True, metavar="MODULE:PLAN",
                        help="plan dict / Plan / factory of one / function of the mesh, e.g. fxshard.testing.models:llama_plan; "
                             "'auto': fxshard.auto_plan on the mesh's first axis (printed to stderr)")
    parser.add_argument("--mesh", required=True, metavar="AXIS=SIZE[,AXIS=SIZE]", help="e.g. tp=4 or dp=2,tp=4")
    parser.add_argument("--example", metavar="MODULE:INPUTS",
                        help="factory of the single-device example inputs (default: tokens(2, 8, vocab) for a model with .args.vocab_size)")
    parser.add_argument("--format", choices=FORMATS, default="text")
    parser.add_argument("--region", metavar="PATTERN", help="only the modules matching PATTERN, e.g. 'layers.0' or 'layers.*.attention'")
    parser.add_argument("--diff", action="store_true", help="unified diff of the traced and the transformed code")
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout (required for svg)")
    return parser


def parse_mesh(text: str):
    """``"dp=2,tp=4"`` -> ``MeshSpec(("dp", "tp"), (2, 4))``."""
    from fxshard.plan.mesh import MeshSpec

    names, sizes = [], []
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.strip().isidentifier() or not size.strip().isdigit():
            raise UsageError(f"--mesh {text!r}: write AXIS=SIZE pairs separated by commas, e.g. tp=4 or dp=2,tp=4")
        names.append(name.strip())
        sizes.append(int(size))
    try:
        return MeshSpec(names, sizes)
    except ValueError as e:
        raise UsageError(f"--mesh {text!r}: {e}") from None


def parse_ref(text: str) -> tuple[str, str, tuple | None, dict]:
    """``"pkg.mod:name(1, key='v')"`` -> ``("pkg.mod", "name", (1,), {"key": "v"})``;
    ``args`` is None when there are no parentheses."""
    module, colon, rest = text.partition(":")
    if not colon or not module or not rest:
        raise UsageError(f"{text!r}: expected MODULE:NAME or MODULE:NAME(key=value, ...)")
    rest = rest.strip()
    if "(" not in rest:
        if not all(p.isidentifier() for p in rest.split(".")):
            raise UsageError(f"{text!r}: {rest!r} is not a Python name")
        return module, rest, None, {}
    try:
        call = ast.parse(rest, mode="eval").body
    except SyntaxError as e:
        raise UsageError(f"{text!r}: cannot parse the call {rest!r}: {e.msg}") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, (ast.Name, ast.Attribute)):
        raise UsageError(f"{text!r}: expected NAME(key=value, ...)")
    try:
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
    except ValueError:
        raise UsageError(f"{text!r}: argument values must be Python literals (numbers, strings, True/False/None, "
                         f"tuples, lists, dicts)") from None
    if any(k.arg is None for k in call.keywords):
        raise UsageError(f"{text!r}: **kwargs is not supported; write key=value")
    return module, ast.unparse(call.func), args, kwargs


def resolve(text: str) -> tuple[Any, tuple | None, dict]:
    """Import ``MODULE:NAME``; returns (object, args or None, kwargs)."""
    module_name, name, args, kwargs = parse_ref(text)
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        missing = missing_extra(e, repr(text))  # an HF model's module without transformers: name the extra
        if missing is not None:
            raise missing from None
        raise UsageError(f"{text!r}: cannot import module {module_name!r}: {e}") from None
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            close = difflib.get_close_matches(part, public, n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise UsageError(f"{text!r}: {getattr(obj, '__name__', module_name)!r} has no attribute {part!r}{hint}") from None
    return obj, args, kwargs


def _call(obj, args, kwargs, text: str, *first):
    """``obj(*first, *args, **kwargs)``; a non-callable object with no arguments is itself."""
    if args is None and not first and not callable(obj):
        return obj
    if not callable(obj):
        raise UsageError(f"{text!r}: {type(obj).__name__} is not callable")
    try:
        return obj(*first, *(args or ()), **kwargs)
    except Exception as e:  # the user's factory failed: say which one, keep it short
        missing = missing_extra(e, repr(text))
        if missing is not None:
            raise missing from None
        raise UsageError(f"{text!r} raised {type(e).__name__}: {e}") from e


def _wants_mesh(fn: Callable) -> bool:
    """A function with exactly one required positional parameter is a function of the mesh."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def load_model(text: str):
    import torch.nn as nn

    obj, args, kwargs = resolve(text)
    model = _call(obj, args, kwargs, text)
    if not isinstance(model, nn.Module):
        raise UsageError(f"{text!r} gave a {type(model).__name__}, not an nn.Module")
    return model


def load_plan(text: str, mesh):
    """Build the :class:`fxshard.Plan` named by ``--plan`` (see the module docstring)."""
    from fxshard.plan.plan import Plan

    obj, args, kwargs = resolve(text)
    if args is None and callable(obj) and not isinstance(obj, type) and _wants_mesh(obj):
        value = _call(obj, (), {}, text, mesh)
    else:
        value = _call(obj, args, kwargs, text)
    if callable(value) and not isinstance(value, (dict, Plan)):
        value = _call(value, (), {}, text, mesh)  # a factory that returned a function of the mesh
    if isinstance(value, Plan):
        if value.axes != dict(zip(mesh.names, mesh.sizes)):
            raise UsageError(f"{text!r} gave a Plan for the mesh {value.axes}, but --mesh is {mesh}; "
                             f"write the plan as a function of the mesh")
        return value
    if isinstance(value, dict):
        return Plan(mesh, value)
    raise UsageError(f"{text!r} gave a {type(value).__name__}; expected a dict {{pattern: ModuleSpec}}, a Plan, "
                     f"or a function of the mesh returning one")


def load_inputs(text: str | None, model) -> tuple:
    import torch

    if text is None:
        vocab = getattr(getattr(model, "args", None), "vocab_size", None)
        if vocab is None:
            raise UsageError(f"{type(model).__name__} has no .args.vocab_size, so fxshard cannot guess its inputs: "
                             f"pass --example MODULE:INPUTS_FACTORY")
        from fxshard.testing.models import tokens

        return (tokens(2, 8, int(vocab)),)
    obj, args, kwargs = resolve(text)
    value = _call(obj, args, kwargs, text)
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(value)
    raise UsageError(f"{text!r} gave a {type(value).__name__}; expected a tensor or a tuple of inputs")


# --------------------------------------------------------------------------- the command


def render_dump(gm, fmt: str, region: str | None, output: str | None) -> str | None:
    """The text to print for ``fmt`` (None when ``svg`` was written to ``output``)."""
    from fxshard.debug.comm_summary import comm_summary
    from fxshard.debug.dump import dump
    from fxshard.debug.formats import render, to_dot, to_json

    if fmt == "text":
        return dump(gm, region=region) + "\n\n" + str(comm_summary(gm, region)) + "\n"
    if fmt == "json":
        return to_json(gm, region)
    if fmt == "dot":
        return to_dot(gm, region)
    if output is None:
        raise UsageError("--format svg writes a file: add -o FILE.svg")
    render(gm, output, region)
    return None


def code_diff(traced, transformed) -> str:
    """Unified diff of the traced (``fxshard.trace``) and the transformed code."""
    a = traced.code.strip("\n").splitlines(keepends=False)
    b = transformed.code.strip("\n").splitlines(keepends=False)
    return "\n".join(difflib.unified_diff(a, b, "traced", "transformed", lineterm="")) + "\n"


def run_dump(args: argparse.Namespace) -> int:
    """Run ``fxshard dump`` with parsed arguments; returns the exit status."""
    from fxshard.errors import PlanError

    try:
        mesh = parse_mesh(args.mesh)
        model = load_model(args.model)
        inputs = load_inputs(args.example, model)
        if args.plan == "auto":  # fxshard.auto_plan on the first axis; the plan it found goes to stderr
            from fxshard.planner.auto_plan import auto_plan

            plan = auto_plan(model, mesh, inputs, axis=next(iter(mesh.names)))
            print(repr(plan), file=sys.stderr)
        else:
            plan = load_plan(args.plan, mesh)
        text = _transform_and_render(model, plan, inputs, args)
    except PlanError as e:
        print(f"fxshard dump: the plan does not fit the model:\n{e}", file=sys.stderr)
        return 1
    except (UsageError, MissingExtra) as e:
        print(f"fxshard dump: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. Graphviz missing
        print(f"fxshard dump: {e}", file=sys.stderr)
        return 1
    if text is None:
        print(f"wrote {args.output}", file=sys.stderr)
    elif args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _transform_and_render(model, plan, inputs, args) -> str | None:
    from fxshard.frontend.trace import trace
    from fxshard.transform import transform

    sharded = transform(model, plan, inputs)
    if args.diff:
        return code_diff(trace(model, plan, inputs), sharded)
    return render_dump(sharded, args.format, args.region, args.output)


def main(argv: list[str] | None = None) -> int:
    """``fxshard dump`` on its own: ``cli.main(["MODULE:FACTORY", "--plan", ..., "--mesh", "tp=2"])``."""
    parser = add_dump_arguments(argparse.ArgumentParser(prog="fxshard dump", description=__doc__.split("\n\n")[0]))
    return run_dump(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
