"""The one table of layout rules, and :func:`register_rule`, which fills it.

Each family module registers its rules next to their definitions, keyed by the ops they
cover, as DTensor's ``register_op_strategy`` does: ``RULES`` by function (``F.linear``,
``operator.add``, an aten overload), ``METHOD_RULES`` by ``Tensor`` method name
(``"view"``), ``INT_RULES`` for operators applied to Python ints only (``n // 2``).
``fxshard.layout.op_rules`` imports every family, so the table is whole once it is
imported; :func:`rule_for` looks a node up.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from fxshard.layout.op_rules.context import Ctx
from fxshard.meta import TensorInfo

RULES: dict[Any, Callable] = {}
METHOD_RULES: dict[str, Callable] = {}
INT_RULES: dict[Any, Callable] = {}


def register_rule(*targets, ints: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated rule for ``targets``: functions or ops (``F.linear``), and
    ``Tensor`` method names (``"linear"``); ``ints=True``: for those operators applied
    to Python ints only.  A target registered twice is a bug in the table (KeyError).

    Example::

        @register_rule(torch.outer)
        def outer(ctx: Ctx):
            ...

        register_rule(operator.add, torch.add, "add")(pointwise("add"))   # a rule made by a factory
    """

    def register(rule: Callable) -> Callable:
        for target in targets:
            table = INT_RULES if ints else METHOD_RULES if isinstance(target, str) else RULES
            if target in table:
                raise KeyError(f"a layout rule for {target!r} is registered twice: {table[target]} and {rule}")
            table[target] = rule
        return rule

    return register


def rule_for(node: fx.Node) -> tuple[str, Callable | None]:
    """(rule name, rule) for a call_function/call_method node; the rule is None for an op
    without one (``propagate`` then asks DTensor)."""
    if node.op == "call_method":
        fn = METHOD_RULES.get(node.target)
        return (node.target, fn)
    t = node.target
    if t in INT_RULES and not any(isinstance(Ctx.info_of(a), TensorInfo) for a in node.args):
        return ("int", INT_RULES[t])
    fn = RULES.get(t)
    return (getattr(fn, "__name__", "rule") if fn else "", fn)
