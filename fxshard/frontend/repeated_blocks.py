"""Capture a repeated block once: export the first few blocks, stamp the others.

``torch.export`` spends most of a deep model's capture on symbolic-shape arithmetic that
is the same for every decoder layer (Llama-3-8B: 32 identical layers).  Here the model's
stack of blocks (its largest ``ModuleList`` / ``ModuleDict`` of blocks) is cut, for the
export only, to the shortest prefix that holds every *kind* of block twice; the graph of
each later block is then stamped from a captured block of its kind, with its own
parameters, module names and boundary markers.

A block's kind is its class, its parameters' names, shapes and dtypes, and every plain
attribute of it and its submodules (``attention_type``, ``sliding_window``,
``is_sliding``, the MoE or dense MLP it owns...), except attributes that differ on every
block (``layer_idx``, torchtitan's ``layer_id`` and ``weight_init_std``).  Layers that
alternate (sliding-window / full attention) or change (dense first, MoE after) are
several kinds; the stamp for block ``i`` comes from a captured block of the same kind
whose predecessor is of the same kind as block ``i - 1``, and every such pair of kinds is
captured twice.

Nothing is taken on trust: every two captured blocks of one pair must be the same graph
up to their names (node by node: op, target, literal arguments, and every input either
inside the block, the same node outside it, or the same position in the preceding
block), which catches an index-dependent constant, a per-layer lifted tensor or an
input chosen by position outside the block.  Whatever does not fit (one kind per block,
a block whose values are used outside the stack, a mismatch) is captured in full, and
``ProgramMeta.capture_blocks`` says which way and why (a mismatch also warns).

Example::

    gm = fxshard.trace(hf_llama, plan, example_kwargs={"input_ids": ids})
    program_meta(gm).capture_blocks   # 'stamped 30 of 32 blocks of model.layers from 2 captured'
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxshard.state.module_state import add_missing_state, named_state

_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


@dataclass
class StampPlan:
    """How to capture ``container``'s blocks: the first ``captured`` are exported, block
    ``i >= captured`` is stamped from block ``source[i]``."""

    container: str
    names: list[str]
    kinds: list[int]
    captured: int
    source: dict[int, int]

    def prefix(self, i: int) -> str:
        return f"{self.container}.{self.names[i]}" if self.container else self.names[i]

    def describe(self) -> str:
        n = len(self.names)
        return f"stamped {n - self.captured} of {n} blocks of {self.container} from {self.captured} captured"


class StampMismatch(Exception):
    """Two captured blocks of one kind are not the same graph: capture in full."""


def plan_stamping(model: nn.Module) -> tuple[StampPlan | None, str]:
    """The stamping of ``model``'s block stack, or ``None`` and why not."""
    container, blocks = _block_stack(model)
    if container is None:
        return None, "no stack of blocks (a ModuleList or ModuleDict of 4 or more modules with parameters)"
    names = list(blocks)
    kinds = _kinds([blocks[n] for n in names])
    n = len(names)
    for k in range(2, n - 1):
        source = _sources(kinds, k)
        if source is not None:
            return StampPlan(container, names, kinds, k, source), ""
    return None, f"the blocks of {container} are not repeats of a few kinds ({len(set(kinds))} kinds in {n} blocks)"


@contextlib.contextmanager
def only_captured_blocks(model: nn.Module, stamp: StampPlan):
    """For the export: ``stamp.container`` holds only its first ``stamp.captured`` blocks."""
    holder = model.get_submodule(stamp.container)
    kept = holder._modules
    holder._modules = type(kept)((name, kept[name]) for name in stamp.names[:stamp.captured])
    try:
        yield
    finally:
        holder._modules = kept


def stamp_blocks(gm: fx.GraphModule, model: nn.Module, stamp: StampPlan) -> None:
    """Stamp blocks ``stamp.captured ..`` into ``gm`` (in place), after checking that the
    captured blocks of each kind are the same graph; :class:`StampMismatch` if not."""
    segments = [_segment(gm, stamp.prefix(i)) for i in range(stamp.captured)]
    if any(not s for s in segments):
        raise StampMismatch("a captured block left no nodes in the graph")
    members = {n: i for i, seg in enumerate(segments) for n in seg}
    for i, seg in enumerate(segments):
        for n in seg:
            for user in n.users:
                j = members.get(user)
                if j is None and i != stamp.captured - 1:
                    raise StampMismatch(f"{user.name} outside the blocks reads {n.name} of {stamp.prefix(i)}")
                if j is not None and j not in (i, i + 1):
                    raise StampMismatch(f"{stamp.prefix(j)} reads {n.name} of {stamp.prefix(i)}, not its predecessor")
    by_pair: dict[tuple[int, int], list[int]] = {}  # blocks of one kind after blocks of one kind
    for i in range(1, stamp.captured):
        by_pair.setdefault((stamp.kinds[i - 1], stamp.kinds[i]), []).append(i)
    for same in by_pair.values():
        for a in same[:-1]:
            _check_same(segments, members, stamp, a, same[-1])
    _add_state(gm, model, stamp)
    outputs = [n for n in segments[-1] if any(u not in members for u in n.users)]
    readers = {n: [u for u in n.users if u not in members] for n in outputs}  # the final norm, the head...
    graph = gm.graph
    last = segments[-1]
    previous = list(last)  # the nodes of block i - 1, by position
    anchor = last[-1].next
    for i in range(stamp.captured, len(stamp.names)):
        r = stamp.source[i]
        rename = _renamer(stamp.prefix(r), stamp.prefix(i))
        copies: dict[fx.Node, fx.Node] = {}
        position = {n: k for k, n in enumerate(segments[r - 1])}

        def arg(x, copies=copies, position=position, previous=previous, rename=rename):
            if isinstance(x, fx.Node):
                if x in copies:
                    return copies[x]
                if x in position:
                    return previous[position[x]]
                return x  # shared by every block: masks, positions, sizes
            return rename(x)

        with graph.inserting_before(anchor):
            for n in segments[r]:
                new = graph.create_node(n.op, rename(n.target) if n.op in ("get_attr", "call_module") else n.target,
                                        fx.node.map_aggregate(n.args, arg), fx.node.map_aggregate(n.kwargs, arg))
                new.meta = {k: v for k, v in n.meta.items() if k != "nn_module_stack"}
                if "nn_module_stack" in n.meta:
                    new.meta["nn_module_stack"] = {rename(k): (rename(fqn), t) for k, (fqn, t) in n.meta["nn_module_stack"].items()}
                if n.op == "call_module":
                    _set_submodule(gm, new.target, model.get_submodule(new.target))
                copies[n] = new
        previous = [copies[n] for n in segments[r]]
    # what read the last captured block (the final norm, the head) reads the last block
    final = {n: k for k, n in enumerate(last)}
    for n, users in readers.items():
        for user in users:
            user.replace_input_with(n, previous[final[n]])
    gm.graph.lint()
    gm.recompile()


def block_graph(gm: fx.GraphModule, prefix: str) -> list[tuple]:
    """The nodes of block ``prefix`` as comparable tuples (op, target, arguments with
    inputs by position inside the block or by target outside, the block's own name
    written ``<block>``): equal for a stamped and a fully captured block."""
    seg = _segment(gm, prefix)
    index = {n: k for k, n in enumerate(seg)}
    rename = _renamer(prefix, "<block>")

    def norm(x):
        if isinstance(x, fx.Node):
            return ("in", index[x]) if x in index else ("out", x.op, rename(str(x.target)))
        return rename(x)

    return [(n.op, rename(str(n.target)) if n.op in ("get_attr", "call_module") else str(n.target),
             fx.node.map_aggregate(n.args, norm), fx.node.map_aggregate(n.kwargs, norm)) for n in seg]


# --------------------------------------------------------------------------- internals


def _block_stack(model: nn.Module) -> tuple[str | None, dict[str, nn.Module]]:
    """The module list or dict holding the most parameters, if it has 4+ blocks."""
    best, best_size = None, 0
    for fqn, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) >= 4:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size and all(any(True for _ in c.parameters()) for c in m._modules.values()):
                best, best_size = fqn, size
    if best is None or not best:
        return None, {}
    return best, dict(model.get_submodule(best)._modules)


def _kinds(blocks: list[nn.Module]) -> list[int]:
    """Blocks with the same class, parameters and attributes are of one kind; an attribute
    that differs on every block (an index) is left out."""
    attrs = [_attributes(b) for b in blocks]
    keys = set().union(*attrs)
    varying = {k for k in keys if len({repr(a.get(k)) for a in attrs}) == len(blocks)}
    signatures = []
    for b, a in zip(blocks, attrs):
        params = tuple((n, tuple(t.shape), t.dtype) for n, t, _ in named_state(b))
        signatures.append((type(b), params, tuple(sorted((k, repr(v)) for k, v in a.items() if k not in varying))))
    order: dict[Any, int] = {}
    return [order.setdefault(s, len(order)) for s in signatures]


def _attributes(block: nn.Module) -> dict[str, Any]:
    out = {}
    for name, m in block.named_modules():
        out[f"{name}:type"] = type(m)
        for k, v in vars(m).items():
            if k.startswith("_") or k == "training":
                continue
            out[f"{name}:{k}"] = v if isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)) \
                else ("object", type(v).__name__, id(v))
    return out


def _sources(kinds: list[int], k: int) -> dict[int, int] | None:
    """With the first ``k`` blocks captured: for each later block ``i``, the last captured
    block ``r`` with ``(kind[r - 1], kind[r]) == (kind[i - 1], kind[i])`` (a block's graph
    may read its predecessor's values by position), every such pair captured twice (to be
    checked against each other; block 0 reads no block), and the last block of the kind of
    the last captured one; else ``None``."""
    n = len(kinds)
    if kinds[n - 1] != kinds[k - 1]:
        return None
    captured = [(kinds[r - 1], kinds[r]) for r in range(1, k)]
    source = {}
    for i in range(k, n):
        pair = (kinds[i - 1], kinds[i])
        if captured.count(pair) < 2:
            return None
        source[i] = max(r for r in range(1, k) if (kinds[r - 1], kinds[r]) == pair)
    return source


def _segment(gm: fx.GraphModule, prefix: str) -> list[fx.Node]:
    """The nodes of block ``prefix``: traced inside it (``nn_module_stack``), and the
    ``get_attr`` nodes of its parameters."""
    dotted = prefix + "."
    out = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if n.target.startswith(dotted):
                out.append(n)
        elif n.op not in ("placeholder", "output"):
            stack = n.meta.get("nn_module_stack") or {}
            if any(fqn == prefix or fqn.startswith(dotted) for fqn, _ in stack.values()):
                out.append(n)
    return out


def _renamer(old: str, new: str):
    dotted_old, dotted_new = old + ".", new + "."
    flat_old, flat_new = old.replace(".", "_") + "_", new.replace(".", "_") + "_"

    def rename(x):
        if isinstance(x, str):
            if x == old:
                return new
            if x.startswith(dotted_old):
                return dotted_new + x[len(dotted_old):]
            if flat_old in x:  # export's nn_module_stack keys: 'L__self___model_layers_0_mlp'
                return x.replace(flat_old, flat_new)
        return x

    return rename


def _check_same(segments, members, stamp: StampPlan, a: int, b: int) -> None:
    sa, sb = segments[a], segments[b]
    why = f"{stamp.prefix(a)} and {stamp.prefix(b)}, of one kind, are not the same graph"
    if len(sa) != len(sb):
        raise StampMismatch(f"{why}: {len(sa)} nodes against {len(sb)}")
    ia, ib = {n: k for k, n in enumerate(sa)}, {n: k for k, n in enumerate(sb)}
    rename = _renamer(stamp.prefix(a), stamp.prefix(b))

    def same(x, y) -> bool:
        if isinstance(x, fx.Node) != isinstance(y, fx.Node):
            return False
        if isinstance(x, fx.Node):
            if x in ia or y in ib:
                return ia.get(x) == ib.get(y) and x in ia and y in ib
            ma, mb = members.get(x), members.get(y)
            if ma is None or mb is None:
                return x is y  # shared by both blocks
            if ma != a - 1 or mb != b - 1:
                return False
            return segments[ma].index(x) == segments[mb].index(y)
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return type(x) is type(y) and len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, slice) and isinstance(y, slice):
            return same(x.start, y.start) and same(x.stop, y.stop) and same(x.step, y.step)
        return type(x) is type(y) and rename(x) == y

    for x, y in zip(sa, sb):
        target_x = rename(x.target) if x.op in ("get_attr", "call_module") else x.target
        if x.op != y.op or target_x != y.target or not same(x.args, y.args) or not same(x.kwargs, y.kwargs):
            raise StampMismatch(f"{why}: {x.format_node()} against {y.format_node()}")


def _add_state(gm: fx.GraphModule, model: nn.Module, stamp: StampPlan) -> None:
    """The parameters and buffers of the stamped blocks, under their FQNs (the model's
    tensors, shared: capture never writes them)."""
    prefixes = tuple(stamp.prefix(i) + "." for i in range(stamp.captured, len(stamp.names)))
    add_missing_state(gm, [(fqn, t, p) for fqn, t, p in named_state(model) if fqn.startswith(prefixes)])


def _set_submodule(gm: fx.GraphModule, fqn: str, module: nn.Module) -> None:
    parent = gm
    *path, name = fqn.split(".")
    for part in path:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]
    parent._modules[name] = module


def fallback_note(why: str, mismatch: bool) -> str:
    """What ``ProgramMeta.capture_blocks`` says of a full capture; a mismatch also warns
    (it costs a second export)."""
    if mismatch:
        warnings.warn(f"fxshard capture: blocks captured in full: {why}", stacklevel=3)
    return f"captured in full: {why}"
