"""outline_regions: local regions traced inline become one ``call_module`` each.

``fxshard.trace`` keeps the plan's local regions (``ModuleSpec(local=True)``,
``fxshard.expert_parallel``) as leaf ``call_module`` s.  A graph from plain
``torch.fx.symbolic_trace`` may have traced through one instead: its nodes (found by
``nn_module_stack``) are moved into a sub-GraphModule that replaces the module under
the same FQN, and the graph calls it once.  The node set must be convex (no path
leaves the region and comes back in; checked with networkx); the error names the
node that breaks it.

Runs right after the copy in ``fxshard.transform``, before shapes are recorded
(data-dependent ops inside an MoE block cannot run on fake tensors; a region runs on
zeros instead, see ``fxshard.frontend.trace.record_shapes``).

Reads:  ``nn_module_stack``; the plan (which modules are local regions).
Writes: the region submodules; the ``call_module`` node (``nn_module_stack`` up to
        the region, ``stack_trace``, ``val`` when the nodes had one).
"""
from __future__ import annotations

import operator

import networkx as nx
import torch.fx as fx
import torch.nn as nn

from fxshard.errors import PlanError, node_error
from fxshard.meta import PassContext


def outline_regions(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Outline every local region that was traced inline (in place)."""
    plan = ctx.plan
    for fqn, mtype in _inline_regions(gm, plan).items():
        outline(gm, fqn, fqn, getattr(mtype, "__name__", "Region"))
    return


def _inline_regions(gm: fx.GraphModule, plan) -> dict[str, type]:
    """Outermost local regions whose nodes are in the graph (not a leaf call)."""
    found: dict[str, type] = {}
    for node in gm.graph.nodes:
        for qualname, mtype in (node.meta.get("nn_module_stack") or {}).values():
            hit = plan.match(qualname) if qualname else None
            if hit is not None and hit[1].local:
                if not (node.op == "call_module" and node.target == qualname):
                    found.setdefault(qualname, mtype)
                break  # outermost only: an inner region moves with its parent
    return found


def outline(gm: fx.GraphModule, qualname: str, prefix: str, class_name: str, order=None) -> fx.Node:
    """Move the nodes traced inside module ``qualname`` (by ``nn_module_stack``) into a
    sub-GraphModule at ``prefix`` (its path in ``gm``) and call it; returns the call.

    ``order(inputs) -> inputs`` may reorder the sub-graph's inputs (by default: order of
    first use).  Example: ``outline(gm, "layers.0.moe", "layers.0.moe", "MoE")``.
    """
    graph = gm.graph
    region = _members(graph, qualname, prefix)
    if not region:
        raise PlanError(f"module {qualname!r}: no node of the graph was traced in it, so it cannot be outlined")
    _check_convex(graph, region, qualname)
    members = set(region)
    inputs = []
    for n in region:
        inputs += [a for a in n.all_input_nodes if a not in members and a not in inputs]
    if order is not None:
        inputs = order(inputs)
    outputs = [n for n in region if any(u not in members for u in n.users)]
    sub = _subgraph(region, inputs, outputs, prefix)
    holder = _holder(gm, prefix)
    sub_gm = fx.GraphModule(holder, sub, class_name)
    call = _replace(graph, region, members, inputs, outputs, prefix, qualname)
    parent, _, name = prefix.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, sub_gm)
    graph.lint()
    gm.recompile()
    return call


def _holder(gm: fx.GraphModule, prefix: str) -> nn.Module:
    """The module at ``prefix``; a GraphModule keeps only modules that own something
    its graph uses, so a parameter-free region gets an empty one."""
    mod = gm
    for part in prefix.split("."):
        if not isinstance(getattr(mod, part, None), nn.Module):
            setattr(mod, part, nn.Module())
        mod = getattr(mod, part)
    return mod


def _members(graph: fx.Graph, qualname: str, prefix: str) -> list[fx.Node]:
    """Nodes traced in ``qualname``, plus ``get_attr`` s of its tensors used only there."""
    inside = [n for n in graph.nodes if n.op not in ("placeholder", "output")
              and any(q == qualname for q, _ in (n.meta.get("nn_module_stack") or {}).values())]
    ours = set(inside)
    for n in graph.nodes:  # a get_attr of the region's parameter, made outside its stack
        if n.op == "get_attr" and n not in ours and n.target.startswith(prefix + ".") and n.users and all(u in ours for u in n.users):
            ours.add(n)
    # get_attr of tensors outside the module stay outside (they become inputs)
    ours = {n for n in ours if n.op not in ("get_attr", "call_module") or n.target.startswith(prefix + ".")}
    return [n for n in graph.nodes if n in ours]


def _check_convex(graph: fx.Graph, region: list[fx.Node], qualname: str) -> None:
    """No path may leave the region and come back in: such a node would have to run
    both after and before the single call."""
    g = nx.DiGraph()
    g.add_nodes_from(graph.nodes)
    g.add_edges_from((n, u) for n in graph.nodes for u in n.users)
    src, dst = "__region_out__", "__region_in__"
    g.add_edges_from((src, n) for n in region)
    g.add_edges_from((n, dst) for n in region)
    members = set(region)
    between = (nx.descendants(g, src) & nx.ancestors(g, dst)) - members - {src, dst}
    if between:
        first = next(n for n in graph.nodes if n in between)
        raise node_error(first, f"cannot outline local region {qualname!r} into one call: this node runs outside the region "
                                f"on a value computed inside it, and the region uses its result (the region's nodes are not "
                                f"a convex set)",
                         "trace the model with fxshard.trace(model, plan, example_inputs), or pass the nn.Module to "
                         "fxshard.transform (local regions then stay leaf call_modules), or move that computation into "
                         "or out of the region")


def _subgraph(region, inputs, outputs, prefix: str) -> fx.Graph:
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta.update({k: v for k, v in a.meta.items() if k == "val"})
    for n in region:
        new = sub.node_copy(n, lambda x: env[x])
        if n.op in ("get_attr", "call_module"):
            new.target = n.target[len(prefix) + 1:]
        env[n] = new
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    return sub


def _replace(graph: fx.Graph, region, members, inputs, outputs, prefix: str, qualname: str) -> fx.Node:
    """Call the outlined module after the region's last node; nodes between the
    region's nodes that use its results move after the call (convexity allows it)."""
    first, last = region[0], region[-1]
    moved, tainted, n = [], set(members), first
    while n is not last:
        if n not in members and any(a in tainted for a in n.all_input_nodes):
            moved.append(n)
            tainted.add(n)
        n = n.next
    with graph.inserting_after(last):
        call = graph.call_module(prefix, tuple(inputs))
    stack = first.meta.get("nn_module_stack") or {}
    keep = {}
    for k, (q, t) in stack.items():
        keep[k] = (q, t)
        if q == qualname:
            break
    call.meta["nn_module_stack"] = keep
    if "stack_trace" in first.meta:
        call.meta["stack_trace"] = first.meta["stack_trace"]
    vals = [o.meta.get("val") for o in outputs]
    if all(v is not None for v in vals):
        call.meta["val"] = vals[0] if len(outputs) == 1 else tuple(vals)
    results = [call]
    if len(outputs) > 1:
        results, anchor = [], call
        for i in range(len(outputs)):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (call, i))
            anchor.meta.update({k: v for k, v in outputs[i].meta.items() if k == "val"})
            results.append(anchor)
    for o, r in zip(outputs, results):
        o.replace_all_uses_with(r, delete_user_cb=lambda user: user not in members)
    anchor = results[-1]
    for n in moved:
        anchor.append(n)
        anchor = n
    for n in reversed(region):
        graph.erase_node(n)
    return call
