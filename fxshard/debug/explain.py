"""Why does a node have its layout?  The chain of rules and plan entries behind it.

Example::

    print(fxshard.explain(sharded, "linear_6"))

    linear_6 = F.linear(mul_2, layers_0_feed_forward_w2_weight, None)
      layout:  tp=P  local [2, 8, 64]  global [2, 8, 64]  float32
      module:  layers.0.feed_forward.w2  (plan entry 'layers.*.feed_forward.w2')
      source:  models.py:243  `return self.w2(F.silu(self.w1(x)) * self.w3(x))`

    tp=P because:
    linear_6  P  rule `linear` of (mul_2 S(2), layers_0_feed_forward_w2_weight S(1))
    +-- mul_2  S(2)  rule for operator.mul of (silu S(2), linear_5 S(2))
    |   +-- silu  S(2)  rule for F.silu of (linear_4 S(2))
    |   |   `-- linear_4  S(2)  rule `linear` of (grad_sync_1 R, layers_0_feed_forward_w1_weight S(0))
    |   |       `-- layers_0_feed_forward_w1_weight  S(0)  declared: parameter 'layers.0.feed_forward.w1.weight', plan entry 'layers.*.feed_forward.w1' params['weight']
    |   `-- linear_5  S(2)  ...
    `-- layers_0_feed_forward_w2_weight  S(1)  declared: parameter 'layers.0.feed_forward.w2.weight', plan entry 'layers.*.feed_forward.w2' params['weight']

For each mesh axis the explanation walks back through ``node.meta["fxshard"]``: the
layout rule that produced each value (``.rule``) and the layouts it saw
(``.value``), until it reaches a *declared* layout: a parameter's layout from the
plan (``.declared`` and ``.extra["pattern"]`` on ``get_attr``), a graph input's layout
(``Plan(inputs=...)``), or a redistribute collective at a module boundary (the
plan's ``inputs`` / ``out_dst``).  On a sharded or partial value it follows only the
inputs that carry the sharding; on a replicated value it follows every input.  Grad
syncs and collectives on other axes keep the layout and are walked through.
"""
from __future__ import annotations

import difflib
import operator
import os

import torch.fx as fx
from torch.distributed.tensor import Replicate

from fxshard.debug.graph_walk import block_links, flat_nodes, module_path
from fxshard.errors import source_line
from fxshard.errors import target_name
from fxshard.layout.placements import dtype_short, fmt_placement, fmt_shape
from fxshard.meta import KEY, SizeInfo, TensorInfo, pipeline_of, program_meta

__all__ = ["explain"]

_LEAF_RULES = ("plan input", "plan param", "replicated param")


def explain(gm: fx.GraphModule, node: str | fx.Node, axis: str | None = None, max_depth: int = 12) -> str:
    """Say why ``node`` (a name from ``gm.code`` / :func:`fxshard.dump`) has its layout.

    Example::

        print(fxshard.explain(sharded, "all_reduce"))        # a plan boundary
        print(fxshard.explain(sharded, "view_2", axis="tp"))  # one mesh axis only

    ``axis``: explain only this mesh axis (default: every axis).  ``max_depth``: how many
    steps back each chain goes before it says where to continue.  A pipelined module
    (``fxshard.pipeline_transform``): the node is looked up in this rank's stages.
    """
    if pipeline_of(gm) is not None:
        name = node.name if isinstance(node, fx.Node) else node
        holders = [(i, st) for i, st in zip(gm.stage_ids, gm.stages) if any(n.name == name for n in flat_nodes(st))]
        if not holders:
            raise ValueError(f"fxshard.explain: no stage this rank holds (stages {list(gm.stage_ids)}) has a node "
                             f"{name!r}; the names are those of fxshard.dump(staged), and another rank holds the other "
                             f"stages")
        i, st = holders[0]
        return f"(stage {i})\n" + explain(st, node if isinstance(node, str) else name, axis, max_depth)
    target = _find(gm, node)
    links = block_links(gm)
    value = _value(target)
    axes = list(program_meta(gm).mesh or {}) or (list(value.layout) if isinstance(value, TensorInfo) else [])
    if axis is not None:
        if axis not in axes:
            raise ValueError(f"fxshard.explain: axis {axis!r} is not on the mesh, whose axes are {axes}")
        axes = [axis]
    lines = _header(target, axes)
    if _layout(target, axes[0] if axes else "") is None:
        lines.append("")
        lines.append(_no_layout_reason(target))
        return "\n".join(lines)
    for a in axes:
        lines.append("")
        lines.append(f"{a}={_layout(target, a)} because:")
        lines += _Walk(a, max_depth, links).tree(target)
    return "\n".join(lines)


# --------------------------------------------------------------------------- node facts


def _find(gm: fx.GraphModule, node) -> fx.Node:
    nodes = list(flat_nodes(gm))  # the nodes of transformer blocks split out for FSDP2 too
    if isinstance(node, fx.Node):
        if node not in nodes:
            raise ValueError(f"fxshard.explain: node {node.name!r} is not a node of this GraphModule")
        return node
    names = {n.name: n for n in nodes}
    if node in names:
        return names[node]
    close = difflib.get_close_matches(str(node), list(names), n=5, cutoff=0.5)
    hint = f"; did you mean {close}?" if close else "; the names are those of gm.code and fxshard.dump(gm)"
    raise ValueError(f"fxshard.explain: the graph has no node {node!r}{hint}")


def _meta(node: fx.Node):
    return node.meta.get(KEY)


def _value(node: fx.Node):
    return getattr(_meta(node), "value", None)


def _layout(node: fx.Node, axis: str) -> str | None:
    """Placement of the node's value on ``axis`` as text; None for non-tensors."""
    v = _value(node)
    if isinstance(v, TensorInfo):
        return fmt_placement(v.layout.get(axis, Replicate()))
    if isinstance(v, tuple) and any(isinstance(t, TensorInfo) for t in v):
        return "(" + ", ".join(fmt_placement(t.layout.get(axis, Replicate())) if isinstance(t, TensorInfo) else "-" for t in v) + ")"
    return None


def _sharded(node: fx.Node, axis: str) -> bool:
    v = _value(node)
    infos = [v] if isinstance(v, TensorInfo) else [t for t in v if isinstance(t, TensorInfo)] if isinstance(v, tuple) else []
    return any(not isinstance(t.layout.get(axis, Replicate()), Replicate) for t in infos)


def _tensor_inputs(node: fx.Node, links: dict | None = None) -> list[fx.Node]:
    """Inputs that are tensors (or tuples of tensors); ints read from shapes are not followed.
    ``links``: across block calls (:func:`fxshard.debug.graph_walk.block_links`)."""
    inputs = [(links or {}).get(a, a) for a in node.all_input_nodes]
    return [a for a in inputs if _layout(a, "") is not None]


def _pattern(node: fx.Node) -> str | None:
    meta = _meta(node)
    return getattr(meta, "extra", {}).get("pattern") if meta is not None else None


def _arg_text(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (tuple, list)):
        inner = ", ".join(_arg_text(x) for x in a)
        return f"({inner}{',' if len(a) == 1 and isinstance(a, tuple) else ''})" if isinstance(a, tuple) else f"[{inner}]"
    return repr(a)


def _call_text(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"{node.name}: graph input"
    if node.op == "get_attr":
        return f"{node.name} = self.{node.target}"
    if node.op == "output":
        return f"return {_arg_text(node.args[0])}"
    args = [_arg_text(a) for a in node.args] + [f"{k}={_arg_text(v)}" for k, v in node.kwargs.items()]
    if node.op == "call_method":
        return f"{node.name} = {args[0]}.{node.target}({', '.join(args[1:])})"
    return f"{node.name} = {target_name(node)}({', '.join(args)})"


def _source(node: fx.Node) -> str:
    src = source_line(node)
    if not src:
        return ""
    loc, _, code = src.partition("  ")
    path, _, line = loc.rpartition(":")
    return f"{os.path.basename(path)}:{line}" + (f"  {code}" if code else "")


def _header(node: fx.Node, axes: list[str]) -> list[str]:
    lines = [_call_text(node)]
    v = _value(node)
    if isinstance(v, TensorInfo):
        lay = " ".join(f"{a}={_layout(node, a)}" for a in axes)
        lines.append(f"  layout:  {lay}  local {fmt_shape(v.local_shape)}  global {fmt_shape(v.shape)}  {dtype_short(v.dtype)}")
        hr = node.meta[KEY].extra.get("head_replicas") if node.op == "get_attr" else None
        if hr is not None:
            ranks = v.shape[0] // v.local_shape[0] // hr.heads
            lines.append(f"  heads:   {hr.heads}, each held by {ranks} ranks of {hr.axis!r} (colwise(heads={hr.heads})): the "
                         f"graph's global shape holds a head once per rank, the state {hr.heads * v.local_shape[0]} rows")
    elif isinstance(v, tuple) and _layout(node, axes[0] if axes else "") is not None:
        lines.append("  layout:  " + " ".join(f"{a}={_layout(node, a)}" for a in axes) + "  (tuple)")
    elif isinstance(v, SizeInfo):
        lines.append(f"  value:   int {v.value} (global), read at run time")
    module = module_path(node)
    if module:
        pattern = _pattern_of_region(node) if node.op != "get_attr" else None
        lines.append(f"  module:  {module}" + (f"  (plan entry {pattern!r})" if pattern else ""))
    src = _source(node)
    if src:
        lines.append(f"  source:  {src}")
    coll = getattr(_meta(node), "collective", None)
    if coll is not None:
        lines.append(f"  collective: {coll.op} on {coll.axis!r}: forward {coll.fwd}, backward {coll.bwd}"
                     + (f" ({coll.purpose})" if coll.purpose else ""))
    return lines


def _no_layout_reason(node: fx.Node) -> str:
    v = _value(node)
    if isinstance(v, SizeInfo):
        axes = v.axes if isinstance(v.axes, frozenset) else None
        if axes:
            return (f"not a tensor: an int read from a tensor dim sharded on {sorted(axes)}, so at run time it is "
                    f"the local size; it may only size a dim sharded the same way")
        return "not a tensor: an int read at run time from a dim that is not sharded (the same on every rank)"
    if node.op == "output":
        returned = [a for a in node.all_input_nodes if _layout(a, "") is not None]
        return "the graph output; it returns " + (", ".join(
            f"{a.name} ({' '.join(f'{ax}={_layout(a, ax)}' for ax in _value(a).layout) if isinstance(_value(a), TensorInfo) else _layout(a, '')})"
            for a in returned) or "no tensor") + ": explain those"
    return "no layout: this node's value is not a tensor fxshard tracks"


# --------------------------------------------------------------------------- the walk


class _Walk:
    """Depth-first walk back from a node on one axis, printed as a tree."""

    def __init__(self, axis: str, max_depth: int, links: dict | None = None):
        self.links = links or {}
        self.axis = axis
        self.max_depth = max_depth
        self.seen: set[fx.Node] = set()

    def tree(self, root: fx.Node) -> list[str]:
        out: list[str] = []
        self._visit(root, "", "", 0, out)
        return out

    def _visit(self, node: fx.Node, first: str, rest: str, depth: int, out: list[str]) -> None:
        line, children = self._step(node)
        head = f"{first}{node.name}  {_layout(node, self.axis)}  "
        if node in self.seen and children:
            out.append(head + "(explained above)")
            return
        self.seen.add(node)
        out.append(head + line)
        if children and depth >= self.max_depth:
            out.append(f"{rest}`-- ... (continue with fxshard.explain(gm, {children[0].name!r}))")
            return
        for i, child in enumerate(children):
            last = i == len(children) - 1
            self._visit(child, rest + ("`-- " if last else "+-- "), rest + ("    " if last else "|   "), depth + 1, out)

    def _step(self, node: fx.Node) -> tuple[str, list[fx.Node]]:
        """(why, inputs to explain next) for one node on this axis."""
        meta = _meta(node)
        rule = getattr(meta, "rule", None)
        coll = getattr(meta, "collective", None)
        if node.op == "placeholder":
            return self._graph_input(node), []
        if node.op == "get_attr":
            return self._parameter(node, rule), []
        if coll is not None and coll.op != "ring_attention":  # ring attention keeps q's layout: a rule
            return self._collective(node, coll, rule)
        bucket = node.args[0] if node.target is operator.getitem and node.args and isinstance(node.args[0], fx.Node) else None
        bucket_coll = getattr(_meta(bucket), "collective", None) if bucket is not None else None
        if bucket_coll is not None and bucket_coll.op == "grad_sync_bucket":
            src = bucket.args[0][node.args[1]]
            where = f" on {bucket_coll.axis!r}" if bucket_coll.axis != self.axis else ""
            return (f"grad sync in bucket {bucket.name}{where}: identity forward, its gradient all-reduced with the "
                    f"bucket's others (layout unchanged)", [self.links.get(src, src)])
        if node.op == "call_module" and rule and rule.startswith("local region"):
            pattern = _pattern(node)
            entry = f", plan entry {pattern!r}" if pattern else ""
            return f"declared: output of the local region {node.target!r} (out_src{entry}); it runs on local tensors", []
        inputs = _tensor_inputs(node, self.links)
        seen_by = ", ".join(f"{a.name} {_layout(a, self.axis)}" for a in inputs)
        why = f"{_rule_text(node, rule)}" + (f" of ({seen_by})" if inputs else "")
        carriers = [a for a in inputs if _sharded(a, self.axis)]
        return why, carriers if _sharded(node, self.axis) and carriers else inputs

    def _graph_input(self, node: fx.Node) -> str:
        if _sharded(node, self.axis):
            return f"declared: graph input {node.target!r}, Plan(inputs={{{node.target!r}: ...}})"
        return f"declared: graph input {node.target!r}, replicated (Plan inputs= does not shard it on {self.axis!r})"

    def _parameter(self, node: fx.Node, rule: str | None) -> str:
        pattern = _pattern(node)
        region = getattr(_meta(node), "region", None)
        target = str(node.target)
        owner, _, leaf = target.rpartition(".")
        if region and owner and not target.startswith(region + ".") and region.endswith("." + owner):
            target = f"{region}.{leaf}"  # read inside a block split out for FSDP2: relative to the block
        if rule not in _LEAF_RULES and rule:
            return f"made by the `{rule}` rewrite (a buffer fxshard adds; same code on every rank)"
        if _sharded(node, self.axis) and pattern:
            rel = target[len(region) + 1:] if region and target.startswith(region + ".") else target
            return f"declared: parameter {target!r}, plan entry {pattern!r} params[{rel!r}]"
        if pattern:
            return f"declared: parameter {target!r}, replicated on {self.axis!r} (plan entry {pattern!r} does not shard it there)"
        return f"declared: parameter {target!r}, replicated (no plan entry names it)"

    def _collective(self, node: fx.Node, coll, rule: str | None) -> tuple[str, list[fx.Node]]:
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        src = self.links.get(src, src)
        if coll.axis == self.axis and coll.op not in ("grad_sync", "grad_sync_bucket"):
            pattern = _pattern_of_region(node)
            where = coll.purpose or "a module boundary"
            entry = f", plan entry {pattern!r}" if pattern else ""
            came = f"{src.name} {_layout(src, self.axis)}" if src is not None else "?"
            return (f"declared: plan boundary ({where}{entry}): {coll.op} turns {came} into "
                    f"{_layout(node, self.axis)}", [])
        if coll.op == "grad_sync_bucket":
            what = f"grad sync bucket ({coll.purpose}): identity forward, one all-reduce of the gradients"
            if coll.axis != self.axis:
                what += f" on {coll.axis!r}"
            return what + " (layouts unchanged)", []
        if coll.op == "grad_sync":
            what = "grad sync: identity forward, all-reduces the gradient"
            if coll.axis != self.axis:
                what += f" on {coll.axis!r}"
            return what + " (layout unchanged)", [src] if src is not None else []
        return f"{coll.op} on {coll.axis!r}: layout on {self.axis!r} unchanged", [src] if src is not None else []


def _rule_text(node: fx.Node, rule: str | None) -> str:
    if rule in (None, "", "rule"):
        return f"rule for {target_name(node)}"
    if rule == "replicated (no rule)":
        return f"no layout rule for {target_name(node)}: allowed because every input is replicated"
    if rule in ("deferred bias", "vocab parallel", "loss parallel"):
        return f"`{rule}` rewrite"
    if rule.startswith("module "):
        return f"opaque region {rule[len('module '):]!r} (runs on local tensors; layout declared by the plan)"
    return f"rule `{rule}`"


def _pattern_of_region(node: fx.Node) -> str | None:
    """The plan entry of a collective's module: redistribute makes new nodes, so read it
    from another node of the same region (``extra["pattern"]``, written by ``regions``)."""
    pattern = _pattern(node)
    if pattern:
        return pattern
    region = getattr(_meta(node), "region", None)
    if not region:
        return None
    for other in node.graph.nodes:
        m = _meta(other)
        if m is not None and m.region == region and other.op != "get_attr" and m.extra.get("pattern"):
            return m.extra["pattern"]
    return None
