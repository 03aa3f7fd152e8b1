"""The data of :func:`fxshard.dump` in machine-readable and drawable forms.

Example::

    open("graph.json", "w").write(fxshard.to_json(sharded))
    g = fxshard.to_networkx(sharded)            # networkx.DiGraph, same attributes
    open("graph.dot", "w").write(fxshard.to_dot(sharded, region="layers.0"))
    fxshard.render(sharded, "graph.svg")         # needs Graphviz's `dot`

Every node record holds: ``name``, ``op``, ``target``, ``layout`` (placement per mesh
axis, e.g. ``{"tp": "S(0)"}``; a list of such dicts for tuple values), ``local_shape``,
``shape`` (global), ``dtype``, ``module`` (innermost module FQN), ``source``
(``file.py:line``, base name only, so the output is the same on every machine),
``rule`` (the layout rule or plan entry that produced the layout) and ``collective``
(``{op, axis, fwd, bwd, purpose}`` on communication nodes, else ``None``).  Ints read
from shapes at run time have ``value`` (their traced global value) instead of shapes.

In DOT, modules are nested clusters; nodes are coloured by layout (Replicate grey,
Shard blue, Partial orange, a value sharded on one axis and partial on another
purple); collectives are red-bordered hexagons, parameters cylinders, graph inputs
and outputs house shapes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import torch
import torch.fx as fx

from fxshard.debug.comm_summary import in_region
from fxshard.debug.graph_walk import short_source, block_links, flat_nodes, module_path
from fxshard.errors import target_name
from fxshard.layout.placements import dtype_short, fmt_placement
from fxshard.meta import KEY, SizeInfo, TensorInfo, program_meta

__all__ = ["node_records", "edge_records", "to_json", "to_networkx", "to_dot", "render"]


# --------------------------------------------------------------------------- records


def _mesh(gm: fx.GraphModule) -> dict[str, int]:
    mesh = dict(program_meta(gm).mesh or {})
    if mesh:
        return mesh
    axes: dict[str, int] = {}
    for n in gm.graph.nodes:
        v = getattr(n.meta.get(KEY), "value", None)
        if isinstance(v, TensorInfo):
            axes.update({a: 0 for a in v.layout})  # size unknown
    return axes


def _value_fields(value: Any, axes: list[str]) -> dict:
    if isinstance(value, TensorInfo):
        return {"layout": {a: fmt_placement(value.layout[a]) for a in axes if a in value.layout},
                "local_shape": list(value.local_shape), "shape": list(value.shape), "dtype": dtype_short(value.dtype)}
    if isinstance(value, tuple) and value and all(isinstance(t, TensorInfo) for t in value):
        return {"layout": [{a: fmt_placement(t.layout[a]) for a in axes if a in t.layout} for t in value],
                "local_shape": [list(t.local_shape) for t in value], "shape": [list(t.shape) for t in value],
                "dtype": [dtype_short(t.dtype) for t in value]}
    fields: dict = {"layout": None, "local_shape": None, "shape": None, "dtype": None}
    if isinstance(value, SizeInfo):
        fields["value"] = _jsonable(value.value)
    return fields


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list, torch.Size)):
        return [_jsonable(x) for x in v]
    return str(v)


def _included(gm: fx.GraphModule, region: str | None) -> list[fx.Node]:
    return [n for n in flat_nodes(gm) if in_region(module_path(n), region)]


def node_records(gm: fx.GraphModule, region: str | None = None) -> list[dict]:
    """One dict per node (see the module docstring), in graph order.

    ``region``: a module pattern as in :func:`fxshard.dump` (``"layers.0"``).
    """
    axes = list(_mesh(gm))
    records = []
    for node in _included(gm, region):
        meta = node.meta.get(KEY)
        coll = getattr(meta, "collective", None)
        rec = {"name": node.name, "op": node.op, "target": target_name(node),
               **_value_fields(getattr(meta, "value", None), axes),
               "module": module_path(node), "source": short_source(node) or None,
               "rule": getattr(meta, "rule", None),
               "collective": None if coll is None else {
                   "op": coll.op, "axis": coll.axis, "fwd": coll.fwd, "bwd": coll.bwd, "purpose": coll.purpose}}
        records.append(rec)
    return records


def edge_records(gm: fx.GraphModule, region: str | None = None) -> list[tuple[str, str]]:
    """``(producer, consumer)`` node names, one per data dependency between included nodes."""
    keep = set(_included(gm, region))
    links = block_links(gm)  # across the calls of blocks split out for FSDP2
    return [(links.get(a, a).name, n.name) for n in flat_nodes(gm) if n in keep for a in n.all_input_nodes
            if links.get(a, a) in keep]


# --------------------------------------------------------------------------- JSON / networkx


def to_json(gm: fx.GraphModule, region: str | None = None, indent: int | None = None) -> str:
    """``{"model", "mesh", "nodes": [...], "edges": [[src, dst], ...]}`` as a JSON string.

    Example::

        data = json.loads(fxshard.to_json(sharded))
        [n["name"] for n in data["nodes"] if n["collective"]]   # the communication nodes

    By default each node record and each edge is one line (diff-friendly);
    ``indent=2`` pretty-prints everything.
    """
    data = {"model": gm._get_name(), "mesh": _mesh(gm), "nodes": node_records(gm, region),
            "edges": [list(e) for e in edge_records(gm, region)]}
    if indent is not None:
        return json.dumps(data, indent=indent)
    nodes = ",\n".join("  " + json.dumps(r) for r in data["nodes"])
    edges = ",\n".join("  " + json.dumps(e) for e in data["edges"])
    return (f'{{"model": {json.dumps(data["model"])}, "mesh": {json.dumps(data["mesh"])},\n'
            f'"nodes": [\n{nodes}\n],\n"edges": [\n{edges}\n]}}\n')


def to_networkx(gm: fx.GraphModule, region: str | None = None):
    """A ``networkx.DiGraph``: one node per graph node (keyed by name) with the record's
    fields as attributes; ``graph.graph`` holds ``model`` and ``mesh``.

    Example::

        g = fxshard.to_networkx(sharded)
        g.nodes["linear"]["layout"]            # {'tp': 'S(2)'}
        nx.shortest_path(g, "tokens", "all_reduce")
    """
    import networkx as nx

    g = nx.DiGraph(model=gm._get_name(), mesh=_mesh(gm))
    for rec in node_records(gm, region):
        g.add_node(rec["name"], **{k: v for k, v in rec.items() if k != "name"})
    g.add_edges_from(edge_records(gm, region))
    return g


# --------------------------------------------------------------------------- DOT

_COLORS = {"replicate": "#e0e0e0", "shard": "#9ecae1", "partial": "#fdae6b", "mixed": "#c7a6e0"}


def _layout_class(layout) -> str:
    """replicate / shard / partial / mixed (shard and partial on different axes)."""
    layouts = layout if isinstance(layout, list) else [layout] if layout else []
    marks = {p[0] for lay in layouts for p in lay.values()}
    if "P" in marks and "S" in marks:
        return "mixed"
    if "P" in marks:
        return "partial"
    if "S" in marks:
        return "shard"
    return "replicate"


def _q(text: Any) -> str:
    """A DOT double-quoted string."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _fmt_layout(layout) -> str:
    if layout is None:
        return ""
    if isinstance(layout, list):
        return " | ".join(_fmt_layout(l) for l in layout)
    return " ".join(f"{a}={p}" for a, p in layout.items())


def _fmt_shapes(shape) -> str:
    if shape is None:
        return ""
    if shape and isinstance(shape[0], list):
        return " ".join(_fmt_shapes(s) for s in shape)
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _dot_node(rec: dict) -> str:
    coll = rec["collective"]
    title = rec["name"] if rec["target"] in (rec["name"], "") else f"{rec['name']}\n{rec['target']}"
    if coll is not None:
        title = f"{rec['name']}\n{coll['op']} on {coll['axis']}\nfwd {coll['fwd']}\nbwd {coll['bwd']}"
    lines = [title]
    if rec["layout"] is not None:
        lines.append(f"{_fmt_layout(rec['layout'])}  {_fmt_shapes(rec['local_shape'])}")
    elif "value" in rec:
        lines.append(f"int {rec['value']}")
    attrs = {"label": "\n".join(lines), "fillcolor": _COLORS[_layout_class(rec["layout"])],
             "tooltip": "  ".join(t for t in (rec["module"] or "<top level>", rec["source"] or "",
                                               f"global {_fmt_shapes(rec['shape'])}" if rec["shape"] else "") if t)}
    if coll is not None:
        attrs.update(shape="hexagon", color="#d62728", penwidth="2.5", style="filled,bold")
    elif rec["op"] == "get_attr":
        attrs["shape"] = "cylinder"
    elif rec["op"] == "placeholder":
        attrs["shape"] = "invhouse"
    elif rec["op"] == "output":
        attrs["shape"] = "house"
    return f"{_q(rec['name'])} [" + ", ".join(f"{k}={_q(v)}" for k, v in attrs.items()) + "];"


def _module_tree(records: list[dict]) -> dict:
    """{"nodes": [records at this level], "children": {name: subtree}} from module FQNs."""
    root: dict = {"nodes": [], "children": {}}
    for rec in records:
        tree = root
        for part in rec["module"].split(".") if rec["module"] else []:
            tree = tree["children"].setdefault(part, {"nodes": [], "children": {}})
        tree["nodes"].append(rec)
    return root


def _emit_tree(tree: dict, fqn: str, depth: int, out: list[str], ids: dict[str, int]) -> None:
    pad = "  " * depth
    for rec in tree["nodes"]:
        out.append(pad + _dot_node(rec))
    for name, child in tree["children"].items():
        sub = f"{fqn}.{name}" if fqn else name
        ids[sub] = len(ids)
        out.append(f"{pad}subgraph {_q(f'cluster_{ids[sub]}')} {{")
        out.append(f"{pad}  label={_q(sub)}; style=\"rounded\"; color=\"#999999\"; fontname=\"Helvetica\";")
        _emit_tree(child, sub, depth + 1, out, ids)
        out.append(pad + "}")


def to_dot(gm: fx.GraphModule, region: str | None = None) -> str:
    """Graphviz DOT source: modules as nested clusters, nodes coloured by layout,
    collectives as red hexagons (see the module docstring).

    Example::

        open("layer0.dot", "w").write(fxshard.to_dot(sharded, region="layers.0"))
        # dot -Tsvg layer0.dot -o layer0.svg
    """
    records = node_records(gm, region)
    mesh = " ".join(f"{a}={n}" for a, n in _mesh(gm).items())
    out = [f"digraph {_q(gm._get_name())} {{",
           f"  graph [label={_q(f'{gm._get_name()}  mesh: {mesh}')}, labelloc=\"t\", rankdir=\"TB\", fontname=\"Helvetica\"];",
           "  node [shape=\"box\", style=\"filled,rounded\", fontname=\"Helvetica\", fontsize=\"10\"];",
           "  edge [color=\"#555555\"];"]
    _emit_tree(_module_tree(records), "", 1, out, {})
    out += [f"  {_q(a)} -> {_q(b)};" for a, b in edge_records(gm, region)]
    out.append("}")
    return "\n".join(out) + "\n"


def render(gm: fx.GraphModule, path: str | os.PathLike, region: str | None = None) -> str:
    """Draw the graph with Graphviz: the format is the file extension (``.svg``,
    ``.png``, ``.pdf``).  Returns ``path``.

    Example::

        fxshard.render(sharded, "layer0.svg", region="layers.0")

    Raises ``RuntimeError`` when Graphviz's ``dot`` is not installed.
    """
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError("fxshard.render needs Graphviz's `dot` program, which is not on PATH: install Graphviz "
                           "(`apt-get install graphviz`, `brew install graphviz` or `conda install graphviz`), "
                           "or write fxshard.to_dot(gm) to a file and render it elsewhere")
    path = os.fspath(path)
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "svg"
    proc = subprocess.run([dot, f"-T{fmt}", "-o", path], input=to_dot(gm, region).encode(), capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"Graphviz `dot -T{fmt}` failed: {proc.stderr.decode(errors='replace').strip()}")
    return path
