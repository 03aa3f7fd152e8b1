"""Seeing what happened: a table of the transformed graph, one row per node.

Example::

    print(fxshard.dump(sharded))
    print(fxshard.dump(sharded, region="layers.0.*"))   # one layer

Columns: node name, op, target, layout per mesh axis, local and global shape, module
(innermost module FQN) and source line.  Collective rows start with ``>>`` and
say what they do forward and backward.  The header counts the collectives and, for a
graph that communicates, the calls and bytes of one step forward and backward
(:func:`fxshard.comm_summary`).  A parameter whose heads are shared by several ranks
(``colwise(heads=2)`` at ``tp=4``) reads ``S(0) x2``: its global shape in the graph holds
each head once per rank that shares it.
"""
from __future__ import annotations


import torch.fx as fx

from fxshard.debug.graph_walk import block_module, flat_nodes, module_path, module_prefixes, short_source
from fxshard.errors import target_name
from fxshard.layout.placements import dtype_short, fmt_placement, fmt_shape
from fxshard.meta import KEY, SizeInfo, TensorInfo, pipeline_of, program_meta
from fxshard.plan.specs import pattern_regex


def _cells(node: fx.Node, axes: list[str]):
    meta = node.meta.get(KEY)
    v = meta.value if meta is not None else None
    if isinstance(v, TensorInfo):
        lay = [fmt_placement(v.layout[a]) for a in axes]
        hr = meta.extra.get("head_replicas") if node.op == "get_attr" else None
        if hr is not None:  # each head held by several ranks: the graph's global shape holds it once per rank
            lay = [f"{c} x{v.shape[0] // v.local_shape[0] // hr.heads}" if a == hr.axis else c for a, c in zip(axes, lay)]
        return lay, fmt_shape(v.local_shape), fmt_shape(v.shape), dtype_short(v.dtype)
    if isinstance(v, tuple) and v and all(isinstance(t, TensorInfo) for t in v):
        lay = ["(" + ",".join(fmt_placement(t.layout[a]) for t in v) + ")" for a in axes]
        return lay, " ".join(fmt_shape(t.local_shape) for t in v), " ".join(fmt_shape(t.shape) for t in v), dtype_short(v[0].dtype)
    if isinstance(v, SizeInfo):
        return ["" for _ in axes], "int", str(v.value), ""
    return ["" for _ in axes], "", "", ""


def dump(gm: fx.GraphModule, region: str | None = None, source: bool = True, recursive: bool = False) -> str:
    """The transformed graph as a text table (see module docstring).

    ``region``: an FQN pattern (``*`` wildcards, a trailing ``.*`` includes submodules)
    to show only the nodes of matching modules.  ``recursive``: also dump the graph of
    every local region (a ``call_module`` of a sub-GraphModule, e.g. an MoE block),
    after the table, with its collectives (the expert-parallel all-to-alls).
    Transformer blocks split out for FSDP2 are shown inline, one row per node.  A pipelined
    module (``fxshard.pipeline_transform``) is dumped stage by stage (this rank's).
    """
    if pipeline_of(gm) is not None:
        return "\n\n".join(f"== stage {i}\n" + dump(st, region, source, recursive) for i, st in zip(gm.stage_ids, gm.stages))
    axes = list(program_meta(gm).mesh or {})
    if not axes:
        axes = sorted({a for n in flat_nodes(gm) for a in (getattr(n.meta.get(KEY), "value", None).layout
                       if isinstance(getattr(n.meta.get(KEY), "value", None), TensorInfo) else {})})
    rx = None
    if region is not None:
        rx = pattern_regex(region[:-2]) if region.endswith(".*") else pattern_regex(region)
    rows = []
    for node in flat_nodes(gm):
        meta = node.meta.get(KEY)
        reg = module_path(node)
        if rx is not None and not any(rx.match(p) for p in module_prefixes(reg)):
            continue
        coll = meta.collective if meta else None
        lay, local, glob, dtype = _cells(node, axes)
        target = target_name(node)
        if coll is not None:
            target = f"{target}  [fwd {coll.fwd} | bwd {coll.bwd}]"
        rows.append([(">> " if coll else "   ") + node.name, node.op, target, *lay, local, glob, dtype, reg,
                     short_source(node) if source else ""])
    header = ["   node", "op", "target", *axes, "local", "global", "dtype", "module", "source" if source else ""]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    colls = [n for n in flat_nodes(gm) if n.meta.get(KEY) and n.meta[KEY].collective]
    counts: dict[str, int] = {}
    for n in colls:
        c = n.meta[KEY].collective
        counts[f"{c.op}@{c.axis}"] = counts.get(f"{c.op}@{c.axis}", 0) + 1
    mesh = " ".join(f"{a}={s}" for a, s in (program_meta(gm).mesh or {}).items())
    title = f"fxshard dump of {type(gm).__name__ if not hasattr(gm, '_get_name') else gm._get_name()}  mesh: {mesh or '?'}  " \
            f"nodes: {len(rows)}  collectives: {len(colls)}" + (f" ({', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))})" if counts else "")
    lines = [title]
    if colls:  # totals of the whole graph, forward and backward (fxshard.comm_summary has the rows)
        from fxshard.debug.comm_summary import comm_summary

        lines.append(f"communication per step: {comm_summary(gm).headline()}")
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if recursive:
        lines += _dump_regions(gm, rx, region, source)
    return "\n".join(lines)


def _dump_regions(gm: fx.GraphModule, rx, region, source: bool) -> list[str]:
    """The dumps of the local regions (sub-GraphModules) the graph calls."""
    out = []
    for node in gm.graph.nodes:
        block = block_module(gm, node)
        if block is not None:
            out += _dump_regions(block, rx, region, source)
            continue
        if node.op != "call_module" or (rx is not None and not any(rx.match(p) for p in module_prefixes(node.target))):
            continue
        sub = gm.get_submodule(node.target)
        if isinstance(sub, fx.GraphModule) and program_meta(sub).region == node.target:
            out += ["", f"-- local region {node.target} ({type(sub).__name__}), run on local tensors --",
                    dump(sub, None, source, recursive=True)]
    return out


