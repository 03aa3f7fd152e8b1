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


def region_input(x: torch.Tensor, fqn: str, name: str) -> torch.Tensor:
    """Marks ``x`` entering module ``fqn`` as its forward argument ``name``."""
    return x


def region_output(x: torch.Tensor, fqn: str, name: str) -> torch.Tensor:
    """Marks ``x`` leaving module ``fqn`` as its output ``name``."""
    return x


torch.fx.wrap("region_input")
torch.fx.wrap("region_output")

MARKERS = (region_input, region_output)


def is_marker(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in MARKERS
