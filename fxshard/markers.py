"""Module-boundary markers: identity ops that make a planned module's inputs and
outputs explicit edges of the graph.

``fxshard.trace`` (for modules traced through) and the ``normalize`` pass (for leaf
``call_module`` nodes) insert them; ``propagate`` attaches the layout change the plan
declares there; ``redistribute`` turns each marker into collectives or removes it.
They never survive ``transform``.
"""
from __future__ import annotations

import torch
import torch.fx

from fxshard.errors import PlanError


def region_input(x: torch.Tensor, fqn: str, name: str) -> torch.Tensor:
    """Marks ``x`` entering module ``fqn`` as its forward argument ``name``."""
    return x


def region_output(x: torch.Tensor, fqn: str, name: str) -> torch.Tensor:
    """Marks ``x`` leaving module ``fqn`` as its output ``name``."""
    return x


torch.fx.wrap("region_input")
torch.fx.wrap("region_output")

MARKERS = (region_input, region_output)


def mark_arguments(module, fqn: str, args, kwargs, mark):
    """Bind a call of ``module`` to its forward's signature and replace each argument
    by ``mark(value, argument_name)`` (which returns the value unchanged if it is not
    one to mark): inputs are marked by name, for every capture."""
    import inspect


    sig = inspect.signature(module.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise PlanError(f"module {fqn!r}: cannot bind its call to forward{sig}: {e}") from e
    for name, value in list(bound.arguments.items()):
        bound.arguments[name] = mark(value, name)
    return tuple(bound.args), dict(bound.kwargs)


def mark_outputs(out, fqn: str, out_names, mark):
    """``mark(value, output_name)`` on a module's output, or on each item of a tuple
    output (named by ``out_names``, else by position)."""

    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        names = out_names or tuple(str(i) for i in range(len(out)))
        if len(names) != len(out):
            raise PlanError(f"module {fqn!r}: out_names {tuple(names)} but its forward returns {len(out)} values")
        return type(out)(mark(v, n) for v, n in zip(out, names))
    return mark(out, (out_names or ("output",))[0])


def is_marker(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in MARKERS
