"""propagate: forward layout propagation in topological order.

Every value gets its layout per mesh axis, global and local shape.  Layouts enter at
graph inputs (``Plan(inputs=...)``) and parameters (``params``) and change *only* at
the boundary markers where the plan declares them; everywhere else the rule table
(:mod:`fxshard.layout.op_rules`) derives the output layout from the inputs or raises a
PlanError that names the node and the plan change that would fix it.  fxshard never
inserts communication the plan did not ask for.

Reads:  ``node.meta["val"]`` (global fake values), ``node.meta["fxshard"].declared``.
Writes: ``.value`` (TensorInfo / SizeInfo / tuple), ``.rule``, ``.redistribute`` on
        boundary markers whose layout changes, ``.rewrite`` (a :class:`fxshard.meta.Rewrite`)
        on nodes whose layout holds once the pass it names has rewritten them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.markers import region_input, region_output
from fxshard.errors import InternalError, PlacementMismatchError, PlanError, node_error
from fxshard.layout.placements import fmt_layout, is_replicate, local_shape, normalize
from fxshard.meta import KEY, LocalRegion, PassContext, TensorInfo, info
from fxshard.layout.dtensor_rules import dtensor_layout
from fxshard.layout.op_rules import (FILL_LIKE, Ctx, block_slice, measured_rule, measures, rank_dependent_numbers, rule_for,
                           scalar_value, views)
from fxshard.state.module_state import attribute


def propagate(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Annotate every node with its layout (in place).  ``fsdp_axes``: the axes whose
    gradients FSDP2 averages (``Plan(fsdp=...)``; rules may follow its convention);
    ``cp_axes``: the axes the plan shards the sequence on (``fxshard.context_parallel``)."""
    axes, fsdp_axes, cp_axes = ctx.axes, ctx.fsdp_mean_axes, tuple(ctx.cp_axes)
    measured = shape_only_values(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        try:
            _propagate_node(gm, node, axes, fsdp_axes, cp_axes, measured)
        except PlanError:
            raise
        except Exception as e:  # a rule's own failure: a bug, reported at the node it failed on
            raise InternalError.from_exception("propagate", e, node=node) from e
    return


def shape_only_values(graph: fx.Graph) -> set[fx.Node]:
    """The values whose every use reads only their shape, dtype or device, directly
    (``.shape``, ``.size()``, ``torch.ones_like``, ``new_zeros`` ...) or through views,
    indexing and casts that are themselves such values: nanoGPT variants' causal mask
    ``torch.ones_like(att[0, 0], dtype=torch.bool).tril()``.  Their numbers are never
    read, so only their local shape must be right (:func:`fxshard.layout.op_rules.measured_rule`)."""
    found: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output") or not node.users:
            continue
        if all(measures(u, node) or (u in found and views(u, node)) for u in node.users):
            found.add(node)
    return found


def _propagate_node(gm: fx.GraphModule, node: fx.Node, axes, fsdp_axes=(), cp_axes=(), measured=frozenset()) -> None:
    meta = info(node)
    if node.op == "placeholder":
        meta.value = _tensor(node, meta.declared, axes, requires_grad=True, what=f"graph input {node.target!r}")
        meta.rule = "plan input"
    elif node.op == "get_attr":
        attr = attribute(gm, node.target)
        if isinstance(attr, torch.Tensor):
            node.meta.setdefault("val", attr)
            meta.value = _tensor(node, meta.declared, axes, requires_grad=attr.requires_grad, what=f"parameter {node.target!r}")
            meta.rule = "plan param" if not is_replicate(meta.declared) else "replicated param"
            if "splits" in meta.extra:
                meta.value.blocks = _check_splits(node, meta.value, meta.extra["splits"], axes)
    elif node.target is region_input:
        _enter(node, axes)
    elif node.target is region_output:
        _exit(node, axes)
    elif node.op == "call_module" and isinstance(meta.declared, LocalRegion):
        _local_region(node, axes)
    else:
        _apply_rule(node, axes, fsdp_axes, cp_axes, measured)
    if node not in measured:  # a fused output only measured: its parts' order is never read
        _flow_blocks(node)


def _check_splits(node, value: TensorInfo, splits, axes):
    sharded = [(a, p.dim) for a, p in value.layout.items() if isinstance(p, Shard)]
    if len(sharded) != 1:
        raise node_error(node, f"splits={list(splits)} needs the parameter sharded on exactly one axis, got {fmt_layout(value.layout)}",
                         "shard the fused parameter on one axis")
    axis, dim = sharded[0]
    if sum(splits) != value.shape[dim]:
        raise node_error(node, f"splits={list(splits)} add up to {sum(splits)}, but dim {dim} of {node.target!r} has size {value.shape[dim]}",
                         f"give the sizes of the fused parts, which add up to {value.shape[dim]}")
    return tuple(splits)  # a part the axis does not divide is cut in torch.chunk pieces, as a whole dim is


_BLOCK_PRESERVING = {"contiguous", "float", "to", "clone", "type_as", "half", "bfloat16"}


def _flow_blocks(node: fx.Node) -> None:
    """Carry the part sizes of a fused projection's output to the split that uses it."""
    out = info(node).value
    if isinstance(out, (TensorInfo, tuple)):
        _check_blocked_use(node, out)
    if not isinstance(out, TensorInfo):
        return
    if node.op == "call_function" and node.target is torch.nn.functional.linear:
        w = info(node.args[1]).value
        if w.blocks and any(p == Shard(0) for p in w.layout.values()):
            out.blocks = w.blocks
        return
    if node.op == "call_method" and node.target == "t":  # a Conv1D weight [in, out] read as a linear one
        src = info(node.args[0]).value
        if isinstance(src, TensorInfo) and src.blocks:
            out.blocks = src.blocks
        return
    if node.op == "call_method" and node.target in ("view", "reshape"):  # Conv1D: [B*S, 3H] -> [B, S, 3H]
        src = info(node.args[0]).value
        if isinstance(src, TensorInfo) and src.blocks and _blocked_dim_kept(src, out):
            out.blocks = src.blocks
        return
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], (tuple, slice)):
        src = info(node.args[0]).value  # qkv[..., q:]: the parts the slice keeps
        kept = _sliced_blocks(src, node.args[1]) if isinstance(src, TensorInfo) and src.blocks else None
        if kept is not None and len(kept) > 1:
            out.blocks = kept
        return
    preserving = (node.target in (region_input, region_output) or node.target in FILL_LIKE
                  or (node.op == "call_method" and node.target in _BLOCK_PRESERVING))
    src = info(node.args[0]).value if preserving and node.args and isinstance(node.args[0], fx.Node) else None
    if isinstance(src, TensorInfo) and src.blocks and src.layout == out.layout and src.shape == out.shape:
        out.blocks = src.blocks


def _sliced_blocks(src: TensorInfo, idx) -> tuple[int, ...] | None:
    d = _blocked_dim(src)
    items = idx if isinstance(idx, tuple) else (idx,)
    if d is None or None in items or sum(1 for it in items if it is Ellipsis) > 1:
        return None
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items = items[:e] + (slice(None),) * (len(src.shape) - len(items) + 1) + items[e + 1:]
    if d >= len(items) or not isinstance(items[d], slice) or any(not isinstance(it, slice) for it in items[:d]):
        return None
    return block_slice(src, d, items[d])


def _blocked_dim(ti: TensorInfo) -> int | None:
    dims = [p.dim for p in ti.layout.values() if isinstance(p, Shard) and ti.shape[p.dim] == sum(ti.blocks)]
    return max(dims) if dims else None


def _check_blocked_use(node: fx.Node, out) -> None:
    """A fused projection's output holds on each rank its slice of every part
    ([part 0 slice | part 1 slice | ...]), not a contiguous chunk: only ops that know
    that may take it (a split into the parts, a view keeping the parts outermost, the
    linear that makes it, a boundary, a cast) or ops that keep it as it is (elementwise
    ops, which pass the parts on).  Anything else would read it as a contiguous shard."""
    blocked = [(a, v) for a in node.all_input_nodes for v in [info(a).value] if isinstance(v, TensorInfo) and v.blocks]
    if not blocked or node.op in ("get_attr", "placeholder", "output"):
        return
    if node.op == "call_function" and node.target is torch.nn.functional.linear and all(a is not node.args[0] for a, _ in blocked):
        return  # the fused weight (and bias) of the projection itself
    known = {"view", "reshape", "split", "chunk", "t", "size", "dim"} | _BLOCK_PRESERVING
    if (node.target in (region_input, region_output, torch.split, torch.chunk, *FILL_LIKE)
            or (node.op == "call_method" and node.target in known)):
        return
    if not isinstance(out, TensorInfo):
        if isinstance(out, tuple):
            raise _blocked_error(node, blocked[0])
        return
    if (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], (tuple, slice))
            and _sliced_blocks(blocked[0][1], node.args[1]) is not None):
        return  # whole parts sliced out (Phi-3's qkv[..., :q_size])
    rule = rule_for(node)[1] if node.op in ("call_function", "call_method") else None
    if getattr(rule, "__name__", "").startswith("pointwise"):
        # elementwise: fine when every operand sharded on that dim is fused alike and the dim stays
        parts = {v.blocks for _, v in blocked}
        d = _blocked_dim(blocked[0][1])
        others = [a for a in node.all_input_nodes for v in [info(a).value] if isinstance(v, TensorInfo) and not v.blocks
                  and any(isinstance(p, Shard) and p.dim - len(v.shape) == d - len(blocked[0][1].shape) for p in v.layout.values())]
        if len(parts) == 1 and not others and d is not None and out.shape[d + len(out.shape) - len(blocked[0][1].shape)] == sum(blocked[0][1].blocks):
            out.blocks = blocked[0][1].blocks
            return
    raise _blocked_error(node, blocked[0])


def _blocked_error(node, blocked):
    a, v = blocked
    return node_error(node, f"`{a.name}` is the output of a fused projection (splits={list(v.blocks)}): each rank holds its "
                            f"slice of every part, not a contiguous shard, and this op would read it as one",
                      "split it into its parts right after the projection (split/chunk into exactly those sizes), or "
                      "drop splits= from its colwise()")


def _blocked_dim_kept(src: TensorInfo, out: TensorInfo) -> bool:
    """Is the fused parts' sharded dim carried whole through a reshape (neither split nor
    merged)?  Other sharded dims may merge (``[B*S, 3H] -> [B, S, 3H]`` with the batch
    sharded over dp): the view's rule has checked them."""
    d = _blocked_dim(src)
    axes = [a for a, p in src.layout.items() if p == Shard(d)] if d is not None else []
    return bool(axes) and all(isinstance(out.layout[a], Shard) and out.shape[out.layout[a].dim] == src.shape[d] for a in axes)


def _tensor(node, layout, axes, requires_grad, what) -> TensorInfo | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    layout = normalize(layout, val.dim(), what)
    try:
        local = local_shape(val.shape, layout, axes)
    except ValueError:
        raise _not_dividing(node, val.shape, layout, axes, what) from None
    return TensorInfo(layout, tuple(val.shape), local, val.dtype, requires_grad)


def _not_dividing(node, shape, layout, axes, what):
    """PlanError for a sharded dim that its axes do not divide (together: a dim sharded
    over ``dp`` and ``tp`` needs a multiple of ``dp * tp``)."""
    for d in range(len(shape)):
        over = [a for a, p in layout.items() if isinstance(p, Shard) and p.dim == d]
        n = 1
        for a in over:
            n *= axes[a]
        if over and shape[d] % n:
            if len(over) == 1:
                if -(-shape[d] // n) * (n - 1) < shape[d]:
                    continue  # unequal torch.chunk pieces, every rank holding one
                pieces = [min(-(-shape[d] // n), max(0, shape[d] - i * -(-shape[d] // n))) for i in range(n)]
                problem = (f"dim {d} of size {shape[d]} cut in torch.chunk pieces over the {n} ranks of axis {over[0]!r} "
                           f"leaves ranks without a piece ({', '.join(map(str, pieces))})")
                fix = f"use fewer ranks on {over[0]!r} for this dim, make it at least {n} and ideally a multiple, or shard another dim"
            else:
                problem = (f"dim {d} of size {shape[d]} is sharded over axes {over}, whose sizes together ({n}) "
                           f"do not divide it")
                fix = f"make dim {d} a multiple of {n}, shard it over one of {over} only, or use smaller axes"
            return node_error(node, f"{what}: {problem}", fix)
    raise AssertionError("every sharded dim divides")  # only called when local_shape failed


def _wrap(node, value, axes, requires_grad):
    """Turn a rule's result (layout / list of layouts / SizeInfo) into node values."""
    val = node.meta.get("val")
    if isinstance(value, dict):
        if not isinstance(val, torch.Tensor):
            raise node_error(node, "no global shape was recorded for this node", "pass example_inputs to fxshard.transform")
        return _tensor(node, value, axes, requires_grad, f"result of `{node.name}`")
    if isinstance(value, list):
        return tuple(_tensor_from(v, lay, node, axes, requires_grad) for v, lay in zip(val, value))
    return value


def _tensor_from(val, layout, node, axes, requires_grad):
    if not isinstance(val, torch.Tensor):
        return None  # a non-tensor item of a tuple result (a local region's int or None output): no layout
    try:
        return TensorInfo(layout, tuple(val.shape), local_shape(val.shape, layout, axes), val.dtype, requires_grad)
    except ValueError:
        raise _not_dividing(node, val.shape, layout, axes, f"result of `{node.name}`") from None


def _inputs_require_grad(node) -> bool:
    grads = []
    for a in node.all_input_nodes:
        v = info(a).value
        if isinstance(v, TensorInfo):
            grads.append(v.requires_grad)
        elif isinstance(v, tuple):
            grads.extend(t.requires_grad for t in v if isinstance(t, TensorInfo))
    return any(grads)


def _apply_rule(node: fx.Node, axes, fsdp_axes=(), cp_axes=(), measured=frozenset()):
    try:
        _apply_value_rule(node, axes, fsdp_axes, cp_axes)
    except PlanError as refusal:
        # a value only measured needs its local shape, not its numbers (shape_only_values)
        rule = measured_rule(node) if node in measured else None
        if rule is None:
            raise
        try:
            layout = rule(Ctx(node, axes, fsdp_axes, cp_axes))
        except PlanError:
            raise refusal from None
        meta = info(node)
        meta.value = _wrap(node, layout, axes, False)  # no gradient reaches a value only measured
        meta.rule = f"{rule_for(node)[0] or node.target}: only its shape is read"
        meta.rewrite = None


def _apply_value_rule(node: fx.Node, axes, fsdp_axes=(), cp_axes=()):
    meta = info(node)
    ctx = Ctx(node, axes, fsdp_axes, cp_axes)
    tensors = ctx.tensor_args()
    requires_grad = _inputs_require_grad(node)
    if node.op == "call_module":
        name, rule = f"module {node.target}", None
    else:
        name, rule = rule_for(node)
    if rule is None:
        if node.op != "call_module" and (tensors or isinstance(node.meta.get("val"), torch.Tensor)):
            rank_dependent_numbers(ctx)
        # An op without a rule on non-replicated inputs: DTensor's sharding propagation
        # decides, without redistributing (fxshard.dtensor_rules).
        if node.op != "call_module" and any(not is_replicate(ti.layout) for _, ti in tensors):
            meta.rule = "DTensor strategy"
            meta.value = _wrap(node, dtensor_layout(ctx), axes, requires_grad)
            return
        if node.op == "call_module" and any(not is_replicate(ti.layout) for _, ti in tensors):
            raise ctx.fail("fxshard cannot see inside this module call and it receives non-replicated inputs",
                           "make its inputs Replicate in the plan, or declare it a local region (ModuleSpec(local=True))")
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            meta.value = _wrap(node, {a: Replicate() for a in axes}, axes, requires_grad)
        elif isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val) and val:
            meta.value = _wrap(node, [{a: Replicate() for a in axes} for _ in val], axes, requires_grad)
        elif isinstance(val, (int, float, torch.SymInt, torch.SymFloat)):
            meta.value = scalar_value(ctx)  # the same on every rank only if its inputs are
        meta.rule = "replicated (no rule)"
        return
    meta.rule = name
    meta.value = _wrap(node, rule(ctx), axes, requires_grad)


def _local_region(node: fx.Node, axes):
    """An opaque region's output layout is declared (``out_src``), not derived.  Its
    inputs arrive through markers, redistributed; on an axis the plan leaves out the
    output keeps the layout its inputs arrive in (as at any module boundary), which
    must then be the same for all of them."""
    meta = info(node)
    region: LocalRegion = meta.declared
    ins = [(a, ti) for a, ti in Ctx(node, axes).tensor_args()]
    for a, ti in ins:
        for axis, p in ti.layout.items():
            if isinstance(p, Partial):
                raise node_error(node, f"local region {region.fqn!r} receives `{a.name}` as Partial on axis {axis!r}; it runs on "
                                       f"local tensors, so each rank would see only a share of the value",
                                 f"declare the region's inputs= {{{axis!r}: Replicate()}} (or Shard) in plan entry {region.pattern!r}")
    outs = region.outs if isinstance(region.outs, tuple) else (region.outs,)
    arrived = {}
    for axis in axes:
        placements = {repr(ti.layout[axis]): ti.layout[axis] for _, ti in ins}
        if len(placements) > 1 and any(axis not in o for o in outs):
            raise node_error(node, f"local region {region.fqn!r} receives inputs laid out differently on axis {axis!r} "
                                   f"({', '.join(f'`{a.name}` {fmt_layout(ti.layout)}' for a, ti in ins)}), and its plan "
                                   f"entry does not say how its output is laid out on {axis!r}",
                             f"add {axis!r} to out_src of plan entry {region.pattern!r}")
        arrived[axis] = next(iter(placements.values()), Replicate())
    layouts = [{a: o.get(a, arrived[a]) for a in axes} for o in outs]
    requires_grad = _inputs_require_grad(node) or bool(region.params)
    meta.value = _wrap(node, layouts if isinstance(region.outs, tuple) else layouts[0], axes, requires_grad)
    meta.rule = "local region (declared out_src)"


def _enter(node: fx.Node, axes):
    """region_input: the plan's required layout replaces the incoming one."""
    meta = info(node)
    src = info(node.args[0]).value
    b = meta.declared
    if not isinstance(src, TensorInfo):
        meta.value = src
        return
    nd = len(src.shape)
    where = f"input {b.name!r} of module {b.fqn!r}" if b else ""
    if b is not None and b.expected is not None:
        expected = normalize(b.expected, nd, where)
        partial = [a for a in expected if expected[a] != src.layout[a] and isinstance(src.layout[a], Partial)]
        if partial:
            raise node_error(node, f"{where} arrives as {fmt_layout(src.layout)} (unreduced) but the plan says it arrives as "
                                   f"{fmt_layout(expected)}",
                             f"reduce it before module {b.fqn!r}: give the module that produces it an output layout on "
                             f"{partial[0]!r} (rowwise(out=Shard(-1)) or ModuleSpec(out_dst={{{partial[0]!r}: Replicate()}}))",
                             PlacementMismatchError)
        if any(expected[a] != src.layout[a] for a in expected):  # axes the plan leaves out keep what arrives
            _raise_if_swapped(node, b, src, expected, nd, where)
            raise node_error(node, f"{where} arrives as {fmt_layout(src.layout)} but the plan says it arrives as {fmt_layout(expected)}",
                             f"declare inputs={_suggest(src.layout, expected)} in that preset (the module then redistributes it), "
                             f"or change the producer's output layout", PlacementMismatchError)
    required = b.required if b is not None else None
    _change_layout(node, src, normalize(required, nd, where) if required is not None else {}, axes, where, "plan boundary (input)")


def _raise_if_swapped(node, b, src, expected, nd, where):
    """A row-parallel module expecting its input sharded on the last dim that feeds a
    column-parallel one: the plan has the two swapped; say so rather than suggest inputs=."""
    for a, p in expected.items():
        if p == Shard(nd - 1) and p != src.layout[a] and not isinstance(src.layout[a], Partial):
            col = swapped_linears(node, a)
            if col is not None:
                raise node_error(node, f"{where} arrives as {fmt_layout(src.layout)} but the plan says it arrives as "
                                       f"{fmt_layout(expected)}: module {b.fqn!r} is row-parallel and the module its output "
                                       f"feeds, {col!r}, is column-parallel; the two look swapped",
                                 f"swap them: colwise() on {b.fqn!r} and rowwise() on {col!r} (a column-parallel linear "
                                 f"takes the replicated input and shards its output, the row-parallel one after it reduces); "
                                 f"only if {b.fqn!r} is meant to be row-parallel on this input, declare "
                                 f"inputs={_suggest(src.layout, expected)} in its preset",
                                 PlacementMismatchError)


def _exit(node: fx.Node, axes):
    """region_output: check out_src, then redistribute to out_dst."""
    meta = info(node)
    src = info(node.args[0]).value
    b = meta.declared
    if not isinstance(src, TensorInfo):
        meta.value = src
        return
    nd = len(src.shape)
    if b is not None and b.kind == "statistic":  # distributed_norm: reduce a partial statistic, leave the rest
        reduce = {a: p for a, p in b.dst.items() if isinstance(src.layout[a], Partial)}
        _change_layout(node, src, reduce, axes, f"statistic {b.name!r} of module {b.fqn!r}", "distributed_norm statistic")
        return
    where = f"output {b.name!r} of module {b.fqn!r}" if b else ""
    if b is not None and b.src is not None:
        declared = normalize(b.src, nd, where)
        if any(declared[a] != src.layout[a] for a in declared):
            raise node_error(node, f"{where}: the plan declares out_src {fmt_layout(declared)} but propagation derived {fmt_layout(src.layout)}",
                             f"declare out_src={_suggest(src.layout, declared)} or change the module's parameter/input layouts", PlacementMismatchError)
    declared_dst = b.dst if b is not None else None
    _change_layout(node, src, normalize(declared_dst, nd, where) if declared_dst is not None else {}, axes, where, "plan boundary (output)")


def _change_layout(node, src: TensorInfo, declared: dict, axes, where: str, rule: str) -> None:
    """A boundary marker's value: the declared axes change, the others keep what arrives;
    a change is recorded for ``redistribute``."""
    meta = info(node)
    dst = {**src.layout, **declared}
    _check_transition(node, src.layout, dst, where)
    if src.blocks is not None:
        _check_blocks_kept(node, src, dst, where)
    meta.value = _wrap(node, dst, axes, src.requires_grad)
    meta.rule = rule
    if dst != src.layout:
        meta.redistribute = (src.layout, dst)


def _check_transition(node, src, dst, where):
    for axis in src:
        s, d = src[axis], dst[axis]
        if s == d:
            continue
        if isinstance(d, Partial):
            raise node_error(node, f"{where}: the plan asks to turn {s} into Partial on axis {axis!r}",
                             "Partial is produced by ops (a row-parallel linear), never by redistribution; declare Replicate or Shard")
        if isinstance(s, Partial) and s.reduce_op not in ("sum", "avg"):
            raise node_error(node, f"{where}: reducing a Partial({s.reduce_op}) value on axis {axis!r} is not supported",
                             "reduce it where it is produced, or return it as is")


def _check_blocks_kept(node, src: TensorInfo, dst: dict, where: str) -> None:
    """A fused projection's output (``colwise(splits=...)``) holds on each rank its slice
    of every part, not a contiguous chunk: a collective on its sharded dim would put
    the parts' slices in the wrong order."""
    for axis, p in src.layout.items():
        if isinstance(p, Shard) and src.shape[p.dim] == sum(src.blocks) and dst[axis] != p:
            raise node_error(node, f"{where}: the output of a fused projection (splits={list(src.blocks)}) is sharded part "
                                   f"by part on dim {p.dim}; redistributing it to {fmt_layout(dst)} would interleave the "
                                   f"parts' slices",
                             f"split it into its parts first and redistribute those, or drop splits= (a plain colwise "
                             f"output gathers to the whole projection)")


def _suggest(layout, axes=None) -> str:
    """``layout`` as plan code: the ``axes`` the plan declared (a Replicate among them
    too, or the suggestion would read ``{}``), else its non-replicated axes."""
    keep = (lambda a, p: a in axes) if axes is not None else (lambda a, p: not isinstance(p, Replicate))
    return "{" + ", ".join(f"{a!r}: {p!r}" for a, p in layout.items() if keep(a, p)) + "}"


def swapped_linears(node: fx.Node, axis: str) -> str | None:
    """The FQN of the column-parallel module fed by the row-parallel one whose input
    marker ``node`` is, if there is one: a plan with ``rowwise`` then ``colwise`` (an
    MLP's ``w1: rowwise(), w2: colwise()``, attention's ``wq: rowwise(), wo: colwise()``)
    has the two swapped.  Reads the boundaries ``regions`` declared (``node.meta``); a
    module is column-parallel when its output is declared produced ``Shard`` on its last
    dim on ``axis``, row-parallel when ``Partial``.

    Example: ``swapped_linears(w1_input_marker, "tp")`` is ``"w2"`` for that MLP plan.
    """
    def boundary(n):
        meta = n.meta.get(KEY)
        return getattr(meta, "declared", None) if meta is not None else None

    def produces(fqn: str):
        """The layout the module ``fqn`` is declared to produce on ``axis``, and the rank of its output."""
        for n in node.graph.nodes:
            b = boundary(n)
            if n.target is region_output and b is not None and b.fqn == fqn and b.src and axis in b.src:
                val = n.meta.get("val")
                return b.src[axis], getattr(val, "ndim", None)
        return None, None

    mine = boundary(node)
    if mine is None or not isinstance(produces(mine.fqn)[0], Partial):
        return None
    seen, todo = set(), list(node.users)
    while todo:  # the first planned modules downstream of this one's output
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        b = boundary(n)
        if n.target is region_input and b is not None and b.fqn != mine.fqn:
            p, ndim = produces(b.fqn)
            if isinstance(p, Shard) and (p.dim == -1 or (ndim is not None and p.dim == ndim - 1)):
                return b.fqn
            continue  # another planned module: look no further on this path
        todo.extend(n.users)
    return None
