"""Walking a transformed graph the way the passes saw it: into the blocks split out for
FSDP2, and by the module each node came from.  Shared by the dump, the explanation,
the export formats and the communication summary."""
from __future__ import annotations

import operator
import os

import torch.fx as fx

from fxshard.errors import source_line
from fxshard.meta import KEY, program_meta


def short_source(node: fx.Node) -> str:
    """``file.py:line`` of the user code behind ``node`` (``""`` when unknown)."""
    src = source_line(node)
    if not src:
        return ""
    loc = src.split("  ", 1)[0]
    path, _, line = loc.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else loc


def block_module(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The transformer block (a sub-GraphModule made for FSDP2, ``passes/split_blocks``)
    that ``node`` calls, if it is such a call."""
    if node.op != "call_module":
        return None
    sub = gm.get_submodule(node.target)
    return sub if isinstance(sub, fx.GraphModule) and program_meta(sub).block == node.target else None


def flat_nodes(gm: fx.GraphModule):
    """The graph's nodes, with each block call replaced by the block's own nodes (its
    inputs and output left out): the graph as the passes saw it."""
    for node in gm.graph.nodes:
        sub = block_module(gm, node)
        if sub is None:
            yield node
        else:
            yield from (n for n in flat_nodes(sub) if n.op not in ("placeholder", "output"))


def block_links(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Across the calls of blocks split out for FSDP2: a block's input is the caller's
    argument, a block's call (or its ``getitem``) is the value the block returns."""
    links: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        sub = block_module(gm, node)
        if sub is None:
            continue
        links.update(block_links(sub))
        inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
        links.update({ph: arg for ph, arg in zip(inner, node.args) if isinstance(arg, fx.Node)})
        out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        if isinstance(out, fx.Node):
            links[node] = out
        else:
            for user in node.users:
                if user.target is operator.getitem and isinstance(out[user.args[1]], fx.Node):
                    links[user] = out[user.args[1]]
    for a, b in list(links.items()):  # chains: a block's input that is another block's output
        while b in links:
            b = links[b]
        links[a] = b
    return links


def module_path(node: fx.Node) -> str:
    """FQN of the innermost module the node was traced in (boundary markers and the
    nodes made from them keep their module's FQN)."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        return list(stack.values())[-1][0]
    meta = node.meta.get(KEY)
    if meta is not None and meta.region:
        return meta.region
    if node.op == "get_attr" and "." in node.target:
        return node.target.rsplit(".", 1)[0]
    return ""


def module_prefixes(fqn: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``: the modules an FQN is inside, for matching patterns."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))] or [""]
