"""cleanup: dead code, redundant redistribute pairs, lint, recompile.

Removes a ``shard`` that directly undoes an ``all_gather`` on the same axis and dim
(or the reverse), drops nodes whose results nobody uses (shape reads left over from
tracing, markers' inputs), lints the graph and regenerates ``gm.code``.

Reads:  ``.collective``.  Writes: nothing new.
"""
from __future__ import annotations

import torch.fx as fx

from fxshard.state.module_state import drop_unused_modules

from fxshard.runtime import collectives
from fxshard.frontend.capture import mutates
from fxshard.meta import PassContext

_INVERSE = {collectives.shard: collectives.all_gather, collectives.all_gather: collectives.shard}


def cleanup(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Simplify and recompile (in place)."""
    graph = gm.graph
    for node in list(graph.nodes):
        inner = node.args[0] if node.args else None
        if (node.op == "call_function" and node.target in _INVERSE and isinstance(inner, fx.Node)
                and inner.target is _INVERSE[node.target] and inner.args[1:3] == node.args[1:3]
                and inner.kwargs.get("grad", "replicate") == "replicate"):
            node.replace_all_uses_with(inner.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=mutates)
    graph.lint()
    drop_unused_modules(gm)
    gm.recompile()
    return
