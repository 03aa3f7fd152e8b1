"""Layout rules: how each op maps the layouts of its inputs to the layout of its output.

One rule per family of ops, looked up by ``RULES[target]`` (functions) or
``METHOD_RULES[name]`` (``Tensor`` methods).  A rule sees a :class:`Ctx` and returns
the output layout (a complete dict), a list of layouts for tuple outputs, or a
:class:`~fxshard.meta.SizeInfo` for ints read from shapes.  Rules reason one mesh axis
at a time: placements on different axes are independent.

A rule never changes a layout to make an op fit: when an op cannot run on what it
receives, it raises a PlanError through ``ctx.fail`` that names the node and says
which plan change would make it fit.
"""
from __future__ import annotations

import builtins
import math
import operator
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.runtime import context_parallel_ops  # noqa: F401 - registers the fxshard::sliding_window_mask op the table names
from fxshard.errors import PlanError, node_error
from fxshard.layout.placements import fmt_layout, fmt_placement, local_shape
from fxshard.meta import KEY, SizeInfo, TensorInfo

R = Replicate()


class Ctx:
    """What a rule sees: the node, the mesh axes, argument infos and the global output value."""

    def __init__(self, node: fx.Node, axes: dict[str, int], fsdp_axes: tuple[str, ...] = (), cp_axes: tuple[str, ...] = ()):
        self.node = node
        self.axes = axes
        self.fsdp_axes = fsdp_axes  # axes whose gradients FSDP2 averages (Plan(fsdp=...))
        self.cp_axes = cp_axes  # axes the sequence is sharded on (fxshard.context_parallel)
        self.val = node.meta.get("val")

    # -- arguments ---------------------------------------------------------------------
    def arg(self, i: int, name: str | None = None, default=None):
        if i < len(self.node.args):
            return self.node.args[i]
        if name is not None and name in self.node.kwargs:
            return self.node.kwargs[name]
        return default

    @staticmethod
    def info_of(a) -> Any:
        if isinstance(a, fx.Node):
            m = a.meta.get(KEY)
            return None if m is None else m.value
        return None

    def t(self, i: int, name: str | None = None) -> TensorInfo | None:
        v = self.info_of(self.arg(i, name))
        return v if isinstance(v, TensorInfo) else None

    def tensor_args(self) -> list[tuple[Any, TensorInfo]]:
        out = []
        for a in _flat(self.node.args, self.node.kwargs):
            v = self.info_of(a)
            if isinstance(v, TensorInfo):
                out.append((a, v))
        return out

    @property
    def out_ndim(self) -> int:
        if not isinstance(self.val, torch.Tensor):
            raise self.fail(f"this op's recorded value is {type(self.val).__name__}, not a tensor, but its rule needs the "
                            f"tensor result's shape", "pass example_inputs to fxshard.transform, or file an issue for this op")
        return self.val.dim()

    # -- errors ---------------------------------------------------------------------
    def fail(self, problem: str, fix: str) -> PlanError:
        ins = [f"{a.name} {fmt_layout(ti.layout)}" for a, ti in self.tensor_args()]
        if ins:
            problem = f"{problem}\n  inputs:  " + "; ".join(ins)
        return node_error(self.node, problem, fix)


def _flat(args, kwargs):
    out = []

    def walk(x):
        if isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        else:
            out.append(x)

    walk(args)
    walk(kwargs)
    return out


def reduce_fix(axis: str) -> str:
    return ("reduce the value before this op: give the module that produced the Partial an output layout on "
            f"{axis!r} (rowwise(out=Replicate()) or ModuleSpec(out_dst={{{axis!r}: Replicate()}}))")


def _layout_map(ctx: Ctx, fn: Callable[[str], Any]) -> dict:
    return {axis: fn(axis) for axis in ctx.axes}


def shard_broadcast(ctx: Ctx, a, axis: str, dim: int) -> bool:
    """Let the Replicate operand ``a`` of this node be ``Shard(dim)`` on ``axis``, if it is
    free: ``a`` is an ``expand`` that broadcasts a size-1 (or new) dim ``dim`` of a
    Replicate tensor and this node is its only user.  Every chunk of such a tensor is
    the same, so each rank expands to its local size instead (``localize`` shrinks a
    literal size) and no value moves; the gradient of the broadcast tensor is then
    summed over the ranks by ``grad_sync``.  MLA attention is the case: the shared
    rope key ``k_pe.expand(-1, n_heads, -1, -1)`` meets the head-sharded keys."""
    if not isinstance(a, fx.Node) or a.op != "call_method" or a.target != "expand" or len(a.users) != 1:
        return False
    out, src = ctx.info_of(a), ctx.info_of(a.args[0])
    if not isinstance(out, TensorInfo) or not isinstance(src, TensorInfo) or not isinstance(out.layout[axis], Replicate):
        return False
    sd = dim - (len(out.shape) - len(src.shape))
    if not (0 <= dim < len(out.shape)) or not (sd < 0 or src.shape[sd] == 1) or out.shape[dim] % ctx.axes[axis]:
        return False
    layout = {**out.layout, axis: Shard(dim)}
    a.meta[KEY].value = replace(out, layout=layout, local_shape=local_shape(out.shape, layout, ctx.axes))
    a.meta[KEY].rule = f"{a.meta[KEY].rule or 'expand'} (broadcast dim {dim} sharded like its user `{ctx.node.name}` on {axis!r})"
    return True


# ----------------------------------------------------------------------------- pointwise

LINEAR_UNARY = "unary"


def pointwise(kind: str | None = None, tensor_positions: tuple[int, ...] | None = None):
    """Elementwise op with broadcasting.  ``kind`` says how it treats Partial inputs:
    ``"add"`` (all tensor operands Partial), ``"mul"`` (one Partial operand), ``"div"``
    (Partial numerator), ``"unary"`` (linear in its only tensor), None (nonlinear)."""

    def rule(ctx: Ctx):
        tensors = ctx.tensor_args()
        if not tensors and not isinstance(ctx.val, torch.Tensor):
            return scalar_value(ctx)  # arithmetic on Python numbers (1.0 / math.sqrt(k.size(-1)))
        if tensor_positions is not None:
            keep = {id(ctx.arg(i)) for i in tensor_positions}
            tensors = [(a, ti) for a, ti in tensors if id(a) in keep]
        scalars = [a for a in _flat(ctx.node.args, ctx.node.kwargs) if isinstance(a, (int, float)) and not isinstance(a, bool)]
        scalars += [True for _ in _traced_scalars(ctx)]  # a traced number counts as non-zero: its value may change
        nd = ctx.out_ndim

        def one(axis):
            shard_dims, partial, reps = set(), [], []
            for a, ti in tensors:
                p = ti.layout[axis]
                if isinstance(p, Shard):
                    shard_dims.add(p.dim + nd - len(ti.shape))
                elif isinstance(p, Partial):
                    partial.append((a, ti))
                else:
                    reps.append((a, ti))
            if partial:
                if shard_dims:
                    raise ctx.fail(f"elementwise {ctx.node.target} mixes Partial and Shard inputs on axis {axis!r}", reduce_fix(axis))
                ops = sorted({ti.layout[axis].reduce_op for _, ti in partial})
                if len(ops) > 1:  # a sum of shares plus a mean of shares is neither reduced afterwards
                    raise ctx.fail(f"{_name(ctx.node)} combines Partial values that reduce differently ({', '.join(ops)}) "
                                   f"on axis {axis!r}", reduce_fix(axis))
                ok = (kind == "unary" and len(tensors) == 1) or (
                    kind == "add" and not reps and not any(scalars)) or (
                    kind == "add" and ops == ["avg"]) or (  # the mean of (a_r + c) is A + c
                    kind == "mul" and len(partial) == 1) or (
                    kind == "div" and len(partial) == 1 and partial[0][0] is ctx.arg(0))
                if not ok:
                    why = "is not linear" if kind is None else "is not linear in these operands"
                    raise ctx.fail(
                        f"{_name(ctx.node)} {why}: it cannot run on a Partial (unreduced) value on axis {axis!r} "
                        f"(Partial from {', '.join(_origin(a) for a, _ in partial)})",
                        _statistic_fix(partial[0][0], axis) or reduce_fix(axis))
                return partial[0][1].layout[axis]
            if not shard_dims:
                return R
            if len(shard_dims) > 1:
                raise ctx.fail(f"inputs are sharded on different dims {sorted(shard_dims)} of the result on axis {axis!r}",
                               "give both operands the same layout in the plan")
            (d,) = shard_dims
            for a, ti in reps:
                ad = d - (nd - len(ti.shape))
                if ad >= 0 and ti.shape[ad] != 1 and not shard_broadcast(ctx, a, axis, ad):
                    raise ctx.fail(
                        f"Replicate input `{a.name}` {list(ti.shape)} is combined elementwise with an input sharded on dim {d} "
                        f"on axis {axis!r}; its dim {ad} is full-size, not broadcast",
                        f"shard `{a.name}` the same way in the plan (e.g. declare its producing module's output Shard({d}) on {axis!r}), "
                        f"or make the other operand Replicate")
            return Shard(d)

        return _layout_map(ctx, one)

    rule.__name__ = f"pointwise ({kind or 'nonlinear'})"
    return rule


def _origin(node: fx.Node) -> str:
    """How a value reads in a message: markers name their module."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") in ("region_output", "region_input"):
        kind = "output" if node.target.__name__ == "region_output" else "input"
        return f"the {kind} of module `{node.args[1]}`"
    return f"`{node.name}`"


def _statistic_fix(a: fx.Node, axis: str) -> str | None:
    """The fix for a Partial that a mean or sum over a sharded dim made (a norm's
    statistic, ``x.pow(2).mean(-1)``): the plan can ask for that reduction."""
    seen = 0
    while isinstance(a, fx.Node) and seen < 8:
        meta = a.meta.get(KEY)
        if meta is None or not isinstance(meta.value, TensorInfo) or not isinstance(meta.value.layout[axis], Partial):
            return None
        if a.target in ("mean", "sum", torch.mean, torch.sum):
            src = a.args[0].meta[KEY].value if isinstance(a.args[0], fx.Node) and KEY in a.args[0].meta else None
            if not isinstance(src, TensorInfo) or not isinstance(src.layout[axis], Shard):
                return None
            stack = list((a.meta.get("nn_module_stack") or {}).values())
            module = meta.region or (stack[-1][0] if stack else "its module")
            return (f"`{a.name}` reduces dim {src.layout[axis].dim}, which is sharded on {axis!r}: for a norm over that dim "
                    f"plan {module!r} as fxshard.distributed_norm({axis!r}) (its statistics are all-reduced), or make "
                    f"that dim Replicate before the module")
        tensors = [x for x in a.all_input_nodes if isinstance(getattr(x.meta.get(KEY), "value", None), TensorInfo)]
        a, seen = (tensors[0] if tensors else None), seen + 1
    return None


def _name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


# ----------------------------------------------------------------------------- Python numbers

# Python numbers in the graph (``k.size(-1)``, ``math.sqrt`` of it, ``1.0 / ...``) are values
# without a layout: they get a SizeInfo whose ``axes`` says whether every rank sees the
# single-device value.  ``frozenset()``: yes (computed from literals and from sizes of
# dims that are not sharded).  A non-empty set: the local size of a dim sharded on those
# axes (each rank sees its own, smaller, number), which may size a dim sharded the same
# way (localize) but never enter the arithmetic of a tensor.  ``None``: derived from
# such a size in a way fxshard does not follow (``math.sqrt(local_size)``).

def _number_axes(a, depth: int = 0):
    """``frozenset()`` when the traced number ``a`` is the same on every rank as on one
    device, else the axes it depends on (``None``: unknown).  Nodes without a SizeInfo
    (made by an op without a rule) are judged by their inputs."""
    if not isinstance(a, fx.Node):
        return frozenset()
    v = Ctx.info_of(a)
    if isinstance(v, SizeInfo):
        return v.axes if not isinstance(v.axes, tuple) else (frozenset() if not any(v.axes) else None)
    if isinstance(v, TensorInfo):
        return frozenset() if all(isinstance(p, Replicate) for p in v.layout.values()) else None
    if v is not None or depth > 32:
        return None
    out = frozenset()
    for x in a.all_input_nodes:
        ax = _number_axes(x, depth + 1)
        if ax is None or ax:
            return None
    return out


def _sharded_source(a: fx.Node) -> str:
    """Where a rank-dependent number comes from, for messages: the size read from a
    sharded dim (``x.size(-1)``), found through the ops that combined it."""
    seen, todo = set(), [a]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        v = Ctx.info_of(n)
        if isinstance(v, SizeInfo) and v.axes:
            axes = sorted(v.axes) if not isinstance(v.axes, tuple) else sorted({x for ax in v.axes if ax for x in ax})
            return f"`{n.name}`, the size of a dim sharded on {axes}"
        if n.op == "call_module":
            return f"the output of module `{n.target}`, which runs on local tensors"
        todo.extend(n.all_input_nodes)
    return "the size of a sharded dim"


def _is_number_node(a) -> bool:
    if not isinstance(a, fx.Node):
        return False
    v = Ctx.info_of(a)
    if isinstance(v, SizeInfo):
        return not isinstance(v.value, (tuple, list, torch.Size))
    val = a.meta.get("val")
    return v is None and isinstance(val, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(val, bool)


def _traced_scalars(ctx: Ctx) -> list[fx.Node]:
    """The traced Python numbers among a tensor op's operands; PlanError for one whose
    value differs across ranks (derived from the size of a sharded dim)."""
    out = []
    for a in _flat(ctx.node.args, ctx.node.kwargs):
        if not _is_number_node(a):
            continue
        axes = _number_axes(a)
        if axes is None or axes:
            raise ctx.fail(
                f"operand `{a.name}` is a number computed at run time from {_sharded_source(a)}: each rank sees its "
                f"local size, not the single-device one, so this op would compute with another number than on one device",
                "use the global size as a literal (e.g. a module attribute such as self.head_dim), or read the size "
                "from a dim that is not sharded")
        out.append(a)
    return out


def scalar_value(ctx: Ctx) -> SizeInfo:
    """An op on Python numbers only (``math.sqrt(n)``, ``1.0 / n``, ``max(n, 1)``): its value
    is the same on every rank when its inputs are; anything derived from a sharded
    size is not followed (``axes=None``).  ``int_arith`` keeps the sizes it can follow."""
    axes = frozenset()
    for a in _flat(ctx.node.args, ctx.node.kwargs):
        ax = _number_axes(a)
        if ax is None or ax:
            axes = None
            break
    return SizeInfo(ctx.val, axes)


def scalar_or(tensor_rule: Callable | None):
    """``scalar_value`` when the op sees no tensor (``math.sqrt(n)``), else ``tensor_rule``
    (None: a PlanError, the op has no rule for tensors)."""

    def rule(ctx: Ctx):
        if not ctx.tensor_args() and not isinstance(ctx.val, torch.Tensor):
            return scalar_value(ctx)
        if tensor_rule is None:
            raise ctx.fail(f"{_name(ctx.node)} on a tensor has no layout rule", "make its input a Python number, or file an issue for a rule")
        return tensor_rule(ctx)

    rule.__name__ = "number arithmetic" if tensor_rule is None else getattr(tensor_rule, "__name__", "rule")
    return rule


# ----------------------------------------------------------------------------- linear algebra

def linear(ctx: Ctx):
    x, w, b = ctx.t(0, "input"), ctx.t(1, "weight"), ctx.t(2, "bias")
    n = len(x.shape)
    fqn = ctx.arg(1, "weight").target if isinstance(ctx.arg(1, "weight"), fx.Node) else "weight"
    pending = False

    def one(axis):
        nonlocal pending
        px, pw = x.layout[axis], w.layout[axis]
        pb = b.layout[axis] if b is not None else None
        if isinstance(pw, Replicate):
            if pb is not None and not isinstance(pb, Replicate):
                raise ctx.fail(f"bias is {fmt_placement(pb)} but the weight is Replicate on axis {axis!r}", "shard the bias like the weight (colwise)")
            if isinstance(px, Shard) and px.dim == n - 1:
                raise ctx.fail(f"input is sharded on its feature dim on axis {axis!r} but the weight `{fqn}` is Replicate",
                               f"make this linear rowwise({axis!r}) (weight Shard(1)), or make its input Replicate")
            if isinstance(px, Partial):
                pending = pending or b is not None
            return px
        if isinstance(pw, Shard) and pw.dim == 0:
            if not isinstance(px, Replicate):
                raise ctx.fail(f"column-parallel linear (`{fqn}` Shard(0) on {axis!r}) needs a Replicate input, got {fmt_placement(px)}",
                               f"declare the module's input Replicate on {axis!r} (colwise() does), so it is gathered/reduced on entry")
            if pb is not None and pb != Shard(0):
                raise ctx.fail(f"column-parallel linear needs its bias Shard(0) on {axis!r}, got {fmt_placement(pb)}", "shard the bias with the weight (colwise)")
            return Shard(n - 1)
        if isinstance(pw, Shard) and pw.dim == 1:
            if px != Shard(n - 1):
                raise ctx.fail(f"row-parallel linear (`{fqn}` Shard(1) on {axis!r}) needs its input Shard(-1), got {fmt_placement(px)}",
                               f"declare the module's input Shard(-1) on {axis!r} (rowwise() does)")
            if pb is not None and not isinstance(pb, Replicate):
                raise ctx.fail(f"row-parallel linear needs a Replicate bias on {axis!r}, got {fmt_placement(pb)}", "leave the bias out of params (it is added once after the reduction)")
            pending = pending or b is not None
            return Partial()
        raise ctx.fail(f"weight `{fqn}` has layout {fmt_placement(pw)} on {axis!r}", "use Shard(0) (colwise), Shard(1) (rowwise) or Replicate")

    out = _layout_map(ctx, one)
    if pending:
        ctx.node.meta[KEY].rewrite = "defer_bias"
    return out


def matmul(ctx: Ctx):
    a, b = ctx.t(0), ctx.t(1)
    na, nb, no = len(a.shape), len(b.shape), ctx.out_ndim
    if na < 2 or nb < 2:
        if a.layout == b.layout and all(isinstance(p, Replicate) for p in a.layout.values()):
            return a.layout
        raise ctx.fail("matmul with a 1-D operand on sharded inputs", "reshape to 2-D or keep the operands Replicate")

    def out_dim_a(d):
        return None if d == na - 1 else d + no - na

    def out_dim_b(d):
        return None if d == nb - 2 else d + no - nb

    def one(axis):
        pa, pb = a.layout[axis], b.layout[axis]
        if isinstance(pa, Replicate) and isinstance(pb, Replicate):
            return R
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            if isinstance(pa, Partial) and isinstance(pb, Replicate) or isinstance(pb, Partial) and isinstance(pa, Replicate):
                return pa if isinstance(pa, Partial) else pb  # bilinear: the Partial's kind (sum or avg) carries over
            raise ctx.fail(f"matmul of {fmt_placement(pa)} and {fmt_placement(pb)} on axis {axis!r}", reduce_fix(axis))
        da = out_dim_a(pa.dim) if isinstance(pa, Shard) else "R"
        db = out_dim_b(pb.dim) if isinstance(pb, Shard) else "R"
        if da is None and db is None:
            return Partial()
        if da is None or db is None:
            raise ctx.fail(f"only one operand is sharded on the contracted dim on axis {axis!r}", "shard both operands on the contracted dim, or neither")
        d = da if da != "R" else db
        if da != "R" and db != "R" and da != db:
            raise ctx.fail(f"operands sharded on different result dims ({da} and {db}) on axis {axis!r}", "shard them on the same batch dim")
        # a replicated operand must broadcast along the sharded batch dim
        for ti, nt, name in ((a, na, "left"), (b, nb, "right")):
            if isinstance(ti.layout[axis], Replicate):
                td = d - (no - nt)
                is_batch = 0 <= td < nt - 2
                if is_batch and ti.shape[td] != 1:
                    raise ctx.fail(f"the {name} operand is Replicate but full-size on batch dim {d} sharded on {axis!r}", "shard both operands on that dim")
        return Shard(d)

    return _layout_map(ctx, one)


def outer(ctx: Ctx):
    """``torch.outer(a, b)``: ``a`` runs along dim 0 of the result, ``b`` along dim 1;
    bilinear, so one Partial operand with the other Replicate stays Partial."""
    a, b = ctx.t(0), ctx.t(1)

    def one(axis):
        pa, pb = a.layout[axis], b.layout[axis]
        if isinstance(pa, Replicate) and isinstance(pb, Replicate):
            return R
        if isinstance(pa, Replicate) or isinstance(pb, Replicate):
            p, d = (pb, 1) if isinstance(pa, Replicate) else (pa, 0)
            return Shard(d) if isinstance(p, Shard) else p
        raise ctx.fail(f"outer of {fmt_placement(pa)} and {fmt_placement(pb)} on axis {axis!r}: only one operand may be "
                       f"sharded or Partial", "make one operand Replicate")

    return _layout_map(ctx, one)


def sdpa(ctx: Ctx):
    """scaled_dot_product_attention: q/k/v sharded alike on batch or heads; sharded on
    the sequence dim only inside a context-parallel module on that axis, where the
    ``context_parallel`` pass replaces it (``rewrite = "context_parallel"``)."""
    q, k, v = ctx.t(0, "query"), ctx.t(1, "key"), ctx.t(2, "value")
    mask = ctx.t(3, "attn_mask")
    nd = len(q.shape)
    cp = ctx.node.meta[KEY].extra.get("context_parallel")

    def one(axis):
        ps = {q.layout[axis], k.layout[axis], v.layout[axis]}
        if len(ps) != 1:
            raise ctx.fail(f"query, key and value have different layouts on axis {axis!r}", "shard q, k and v the same way (heads or batch)")
        (p,) = ps
        if isinstance(p, Replicate):
            if mask is not None and not isinstance(mask.layout[axis], Replicate):
                raise ctx.fail(f"attention mask is sharded on {axis!r} but q/k/v are Replicate", "keep the mask Replicate")
            return R
        if isinstance(p, Partial):
            raise ctx.fail(f"attention on Partial inputs on axis {axis!r}", reduce_fix(axis))
        if p.dim == nd - 2:
            return _context_parallel_attention(ctx, cp, axis, q, mask, nd)
        if p.dim > nd - 2:
            raise ctx.fail(f"attention inputs are sharded on the head dim (dim {p.dim}) on axis {axis!r}; attention needs whole heads",
                           "shard attention by heads (colwise q/k/v), by batch, or by sequence (fxshard.context_parallel)")
        if mask is not None:
            mp = mask.layout[axis]
            md = p.dim - (nd - len(mask.shape))
            if isinstance(mp, Replicate) and md >= 0 and mask.shape[md] != 1:
                raise ctx.fail(f"attention mask is Replicate but full-size on dim {p.dim} sharded on {axis!r}", "shard the mask like q/k/v or broadcast it on that dim")
            if not isinstance(mp, Replicate) and (mp != Shard(md) or mask.shape[md] != q.shape[p.dim]):
                raise ctx.fail(f"attention mask is {fmt_placement(mp)} on {axis!r} but q/k/v are sharded on dim {p.dim}: each "
                               f"rank would apply a mask that is not its own", "shard the mask on the dim q/k/v are sharded on, or keep it Replicate")
        return p

    return _layout_map(ctx, one)


def _context_parallel_attention(ctx: Ctx, cp, axis: str, q: TensorInfo, mask: TensorInfo | None, nd: int):
    """Attention on q/k/v sharded on the sequence dim over ``axis``: legal inside a
    module the plan declares context-parallel on that axis.  The mask, if any, holds
    whole key rows: Replicate (each rank picks its query rows) or sharded on its query
    dim like q."""
    stack = list((ctx.node.meta.get("nn_module_stack") or {}).values())
    module = stack[-1][0] if stack else "the attention module"
    if cp is None or cp.axis != axis:
        where = f"context_parallel({cp.axis!r})" if cp is not None else "no context_parallel"
        raise ctx.fail(f"attention inputs are sharded on the sequence dim (dim {nd - 2}) on axis {axis!r}, and the plan "
                       f"says {where} for the module around this attention",
                       f"declare the module context-parallel on {axis!r}: {{{module!r}: fxshard.context_parallel({axis!r})}} "
                       f"(use its pattern, e.g. 'layers.*.attention'), or gather the sequence before attention")
    if ctx.node.kwargs.get("dropout_p", ctx.arg(4, None, 0.0)):
        raise ctx.fail("attention dropout under context parallelism: each rank would draw its own dropout mask of the "
                       "gathered keys, not a slice of the single-device one", "set the attention dropout to 0 (eval or dropout_p=0.0)")
    if mask is not None:
        mp, md = mask.layout[axis], len(mask.shape) - 2
        if mask.shape[-1] != q.shape[nd - 2]:
            raise ctx.fail(f"the attention mask has {mask.shape[-1]} key columns but the sequence has {q.shape[nd - 2]}",
                           "give the mask one column per key position")
        if isinstance(mp, Shard) and (mp.dim != md or mask.shape[md] != q.shape[nd - 2]):
            raise ctx.fail(f"attention mask is {fmt_placement(mp)} on {axis!r}: under context parallelism it must hold whole key "
                           f"rows, sharded only on its query dim (dim {md}) or Replicate",
                           f"shard the mask on dim {md} over {axis!r} (inputs={{'mask': {{{axis!r}: Shard({md})}}}}) or keep it Replicate")
        if isinstance(mp, Partial):
            raise ctx.fail(f"attention mask is Partial on {axis!r}", reduce_fix(axis))
    ctx.node.meta[KEY].rewrite = "context_parallel"
    return Shard(nd - 2)


# ----------------------------------------------------------------------------- reductions, norms

def _traced_int(ctx: Ctx, d):
    """A dim argument computed while tracing (``x.ndim - 1``): its value, which must be
    the same on every rank (the rank of a tensor always is)."""
    if isinstance(d, (tuple, list)):
        return type(d)(_traced_int(ctx, x) for x in d)
    if not isinstance(d, fx.Node):
        return d
    v = ctx.info_of(d)
    if isinstance(v, SizeInfo) and v.axes == frozenset() and isinstance(v.value, int):
        return v.value
    raise ctx.fail(f"the dim `{d.name}` is computed at run time from {_sharded_source(d)}, so ranks may see different values",
                   "pass the dim as a literal")


def _dims(d, nd) -> list[int]:
    if d is None:
        return list(range(nd))
    if isinstance(d, int):
        d = [d]
    return [x + nd if x < 0 else x for x in d]


def reduction(kind: str):
    """sum/mean-like reductions: reducing a sharded dim leaves a Partial (sum or avg)."""

    def rule(ctx: Ctx):
        x = ctx.t(0)
        nd = len(x.shape)
        dims = _dims(_traced_int(ctx, ctx.arg(1, "dim")), nd)
        keep = ctx.arg(2, "keepdim", ctx.node.kwargs.get("keepdim", False))

        def one(axis):
            p = x.layout[axis]
            if isinstance(p, Partial):
                if kind in ("sum", "mean"):
                    return p
                raise ctx.fail(f"{kind} of a Partial value on axis {axis!r}", reduce_fix(axis))
            if isinstance(p, Shard):
                if p.dim in dims:
                    if kind == "sum":
                        return Partial()
                    if kind == "mean":
                        if x.shape[p.dim] % ctx.axes[axis]:  # unequal pieces: the mean of the means is not the mean
                            raise ctx.fail(f"mean over dim {p.dim} of size {x.shape[p.dim]}, which is sharded on {axis!r} "
                                           f"in unequal pieces, so the average of the ranks' means is not the mean",
                                           f"sum over the dim and divide by {x.shape[p.dim]}, or make the dim a multiple "
                                           f"of {ctx.axes[axis]}")
                        return Partial("avg")
                    raise ctx.fail(f"{kind} over dim {p.dim}, which is sharded on {axis!r}", "make that dim Replicate before the reduction")
                return Shard(p.dim if keep else p.dim - sum(1 for d in dims if d < p.dim))
            return R

        out = _layout_map(ctx, one)
        if isinstance(ctx.val, (tuple, list)):  # x.max(dim) -> (values, indices), laid out alike
            return [out, dict(out)]
        return out

    rule.__name__ = f"reduction ({kind})"
    return rule


def softmax(log: bool):
    def rule(ctx: Ctx):
        x = ctx.t(0)
        nd = len(x.shape)
        d = _traced_int(ctx, ctx.arg(1, "dim"))
        d = d + nd if d < 0 else d

        def one(axis):
            p = x.layout[axis]
            if isinstance(p, Partial):
                raise ctx.fail(f"softmax of a Partial value on axis {axis!r}", reduce_fix(axis))
            if isinstance(p, Shard) and p.dim == d:
                if log:  # loss parallel: a global log-sum-exp, the result stays sharded
                    ctx.node.meta[KEY].rewrite = "loss_parallel"
                    return p
                raise ctx.fail(f"softmax over dim {d}, which is sharded on {axis!r}",
                               "keep the softmax dim Replicate (for the vocab dim of a loss, use log_softmax or cross_entropy: loss parallel)")
            return p

        return _layout_map(ctx, one)

    rule.__name__ = "log_softmax" if log else "softmax"
    return rule


def norm(weight_positions: tuple[tuple[int, str], ...]):
    """layer_norm / rms_norm: the normalized (trailing) dims must not be sharded."""

    def rule(ctx: Ctx):
        x = ctx.t(0, "input")
        nd = len(x.shape)
        shape = ctx.arg(1, "normalized_shape")
        if isinstance(shape, fx.Node):  # read at run time: nanoGPT's F.layer_norm(x, self.weight.shape, ...)
            v = ctx.info_of(shape)
            shape = v.value if isinstance(v, SizeInfo) else shape.meta.get("val")
        if not isinstance(shape, (int, tuple, list, torch.Size)):
            raise ctx.fail(f"cannot tell how many dims this norm normalizes (normalized_shape is {shape!r})",
                           "pass normalized_shape as ints or as a tensor's .shape")
        k = 1 if isinstance(shape, int) else len(shape)
        weights = [(ctx.arg(i, name), ctx.t(i, name)) for i, name in weight_positions if ctx.t(i, name) is not None]

        def one(axis):
            p = x.layout[axis]
            if isinstance(p, Partial):
                raise ctx.fail(f"normalization of a Partial value on axis {axis!r}", reduce_fix(axis))
            if isinstance(p, Shard) and p.dim >= nd - k:
                raise ctx.fail(f"the norm reduces over dim {p.dim}, which is sharded on {axis!r}",
                               f"give the norm a Replicate input on {axis!r}, sequence_parallel({axis!r}) to shard the sequence "
                               f"instead, or plan {ctx.node.meta[KEY].region or 'its module'!r} as fxshard.distributed_norm({axis!r}) "
                               f"to normalize the sharded dim with all-reduced statistics")
            for a, ti in weights:
                if not isinstance(ti.layout[axis], Replicate):
                    raise ctx.fail(f"norm parameter `{a.name}` is {fmt_placement(ti.layout[axis])} on {axis!r}", "keep norm parameters Replicate")
            return p

        return _layout_map(ctx, one)

    rule.__name__ = "norm"
    return rule


def embedding(ctx: Ctx):
    ids, w = ctx.t(0, "input"), ctx.t(1, "weight")
    nd = ctx.out_ndim
    vocab = False

    def one(axis):
        nonlocal vocab
        pi, pw = ids.layout[axis], w.layout[axis]
        if isinstance(pw, Replicate):
            if isinstance(pi, Partial):
                raise ctx.fail("embedding ids cannot be Partial", "make the ids Replicate")
            return pi
        if not isinstance(pi, Replicate):
            raise ctx.fail(f"sharded embedding weight ({fmt_placement(pw)}) needs Replicate ids on {axis!r}, got {fmt_placement(pi)}",
                           "shard the ids on another axis, or keep them Replicate")
        if pw == Shard(1):
            return Shard(nd - 1)
        if pw == Shard(0):
            vocab = True
            return Partial()
        raise ctx.fail(f"embedding weight layout {fmt_placement(pw)} on {axis!r}", "use Shard(0) (vocab_parallel), Shard(1) (colwise) or Replicate")

    out = _layout_map(ctx, one)
    if vocab:
        ctx.node.meta[KEY].rewrite = "vocab_parallel_embedding"
    return out


def cross_entropy(ctx: Ctx):
    """cross_entropy / nll_loss.  Logits sharded on the class dim -> loss parallel
    (rewritten by the ``loss_parallel`` pass); sharded on a batch dim -> Partial for
    sum (each rank's loss covers its tokens); a mean over tokens sharded on a
    context-parallel axis is the mean over all of them, Replicate (``extra["mean_axes"]``,
    rewritten by ``global_mean_loss`` or ``loss_parallel``)."""
    x, target = ctx.t(0, "input"), ctx.t(1, "target")
    reduction_ = ctx.node.kwargs.get("reduction", "mean")
    class_dim = 1 if len(x.shape) > 1 else 0
    weight = ctx.arg(2, "weight")

    def one(axis):
        px, pt = x.layout[axis], target.layout[axis]
        if isinstance(px, Partial):
            raise ctx.fail(f"cross-entropy of Partial logits on axis {axis!r}", reduce_fix(axis))
        if isinstance(px, Shard) and px.dim == class_dim:
            if weight is not None:
                raise ctx.fail("class weights are not supported with vocab-sharded logits", "drop weight= or gather the logits (out=Replicate())")
            if not isinstance(pt, Replicate):
                raise ctx.fail(f"vocab-parallel cross-entropy needs Replicate targets on {axis!r}", "keep targets Replicate on the vocab axis")
            ctx.node.meta[KEY].rewrite = "loss_parallel"
            return R
        if isinstance(px, Shard):
            td = px.dim if px.dim < class_dim else px.dim - 1
            if pt != Shard(td):
                raise ctx.fail(f"logits are sharded on dim {px.dim} but targets are {fmt_placement(pt)} on {axis!r}", "shard logits and targets on the same batch dim")
            if reduction_ == "mean" and axis in ctx.fsdp_axes:
                # FSDP2's convention: the objective is the mean over the axis of each rank's loss
                return Partial("avg")
            if reduction_ == "mean" and axis in ctx.cp_axes:
                # the sequence is sharded: the mean over every token of every rank (global_mean_loss)
                ctx.node.meta[KEY].extra.setdefault("mean_axes", []).append(axis)
                return R
            if reduction_ == "mean":
                # the mean over all targets is not the mean of the ranks' means: they count different
                # numbers of targets once ignore_index (HF's -100 padding) or class weights enter
                raise ctx.fail(f"a mean cross-entropy over logits sharded on batch dim {px.dim} on {axis!r}: each rank would "
                               f"average over its own targets, and the mean of those means is not the mean over all "
                               f"targets when ranks count different numbers of them (ignore_index, class weights)",
                               "use reduction='sum' and divide by the global number of targets, compute the loss "
                               "outside the graph on each rank's output, or give the axis to FSDP2 (Plan(..., "
                               f"fsdp={axis!r}), whose convention is the mean of the ranks' losses)")
            return {"none": Shard(td), "sum": Partial()}[reduction_]
        if not isinstance(pt, Replicate):
            raise ctx.fail(f"targets are sharded on {axis!r} but logits are Replicate", "shard logits and targets the same way")
        return R

    out = _layout_map(ctx, one)
    meta = ctx.node.meta[KEY]
    if meta.extra.get("mean_axes") and meta.rewrite is None:
        meta.rewrite = "global_mean"  # loss_parallel, if it applies, takes mean_axes along
    return out


# ----------------------------------------------------------------------------- shape ops

def view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape ``a -> b`` into groups of input dims and output dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i); pa *= a[i]; i += 1
            elif j < len(b):
                outs.append(j); pb *= b[j]; j += 1
            else:
                break
        groups.append((ins, outs))
    return groups


def _is_blocked_dim(x: TensorInfo, d: int) -> bool:
    """Does dim ``d`` of ``x`` carry the parts of a fused projection (``x.blocks``)?
    The parts are those of the dim sharded like the fused weight: of the sharded dims
    of their total size, the innermost (a linear's output features, not a batch dim
    sharded on another axis that happens to have that size)."""
    if x.blocks is None:
        return False
    dims = [p.dim for p in x.layout.values() if isinstance(p, Shard) and x.shape[p.dim] == sum(x.blocks)]
    return bool(dims) and d == max(dims)


def _blocked_view(ctx: Ctx, x: TensorInfo, axis: str, ins: list[int], outs: list[int], a, b) -> Shard | None:
    """The layout of a view of a fused projection's output (``colwise(splits=...)``)
    on the dim that carries the parts, or None when the view leaves that dim as it is.

    Each rank holds ``[its slice of part 0 | its slice of part 1 | ...]``: not a
    contiguous chunk of the dim, so the usual rule (the outermost output dim is
    sharded) would give wrong numbers.  The view is a shard only when it keeps the
    parts outermost: equal parts, the leading output dims enumerate exactly the parts
    (``[..., 3 * D] -> [..., 3, H, hd]``), and the first dim of the rest divides by the
    axis; then the dim after the parts is sharded.  Anything else is refused.
    """
    d = x.layout[axis].dim
    blocks = x.blocks
    ins_big = [i for i in ins if a[i] != 1]
    outs_big = [o for o in outs if b[o] != 1]
    if ins_big == [d] and len(outs_big) == 1 and b[outs_big[0]] == a[d]:
        return None  # the blocked dim passes through unchanged (squeeze/unsqueeze/other dims)
    k, n = len(blocks), ctx.axes[axis]
    if ins_big == [d] and len(set(blocks)) == 1:
        prod, j = 1, 0
        while j < len(outs_big) and prod < k:
            prod *= b[outs_big[j]]
            j += 1
        rest = outs_big[j:]
        if prod == k and rest and b[rest[0]] % n == 0:
            return Shard(rest[0])
    src = ctx.arg(0)
    view = [b[o] for o in outs]
    owner = f"module `{src.args[1]}`" if getattr(src.target, "__name__", "") == "region_output" else "the projection that produces it"
    raise ctx.fail(
        f"reshape {list(a)} -> {list(b)} splits dim {d} (sharded on {axis!r}) of {_origin(src)}, a fused "
        f"projection's output (splits={list(blocks)}): each rank holds its slice of every part, "
        f"[part 0 slice | part 1 slice | ...], which is not a contiguous shard of the view {view} of that dim "
        f"(the fused layout does not match this grouped view)",
        f"drop splits= from colwise({axis!r}) of {owner} when the view's outermost dim ({view[0] if view else '?'}) "
        f"is what should be sharded (each rank then holds whole groups, e.g. torchtitan's n_kv groups of "
        f"[q heads, k, v]), or use separate projections for the parts; splits= fits only a view that keeps "
        f"the parts outermost ([..., {k}, ...] with equal parts)")


def reshape_like(ctx: Ctx):
    """view/reshape/flatten/unflatten/squeeze/unsqueeze/view_as_complex/view_as_real."""
    x = ctx.t(0)
    a, b = tuple(x.shape), tuple(ctx.val.shape)
    groups = view_groups(a, b)

    def one(axis):
        p = x.layout[axis]
        if not isinstance(p, Shard):
            return p
        for ins, outs in groups:
            if p.dim in ins:
                if _is_blocked_dim(x, p.dim):
                    blocked = _blocked_view(ctx, x, axis, ins, outs, a, b)
                    if blocked is not None:
                        return blocked
                if any(a[d] != 1 for d in ins[: ins.index(p.dim)]):
                    break
                o = next((d for d in outs if b[d] != 1), None)
                if o is None or (b[o] % ctx.axes[axis] and b[o] != a[p.dim]):  # unequal pieces: kept whole, never split
                    break
                if b[o] != a[p.dim] and a[p.dim] % ctx.axes[axis]:
                    break
                return Shard(o)
        fix = "keep the sharded dim the outermost of any merged group (e.g. shard heads, not head_dim), or make it Replicate before the reshape"
        n = ctx.axes[axis]
        if a[p.dim] % n:  # torch.chunk pieces of unequal size cannot be regrouped
            raise ctx.fail(f"reshape {list(a)} -> {list(b)} splits or merges dim {p.dim} of size {a[p.dim]}, which is "
                           f"sharded on {axis!r} in unequal pieces ({piece_sizes(a[p.dim], n)}), so they are not a shard of "
                           f"the result", f"use a size of {axis!r} that divides {a[p.dim]} (for heads: one that divides the "
                           f"head count), or make the dim Replicate before the reshape")
        for ins, outs in groups:  # [.., h * d] -> [.., h, d] with fewer heads than ranks: GQA's KV heads at a large tp
            real = [d for d in outs if b[d] != 1]
            if ins == [p.dim] and len(real) == 2 and b[real[0]] < n and n % b[real[0]] == 0:
                fix = (f"these are {b[real[0]]} heads on the {n} ranks of {axis!r}: plan the projection that makes them "
                       f"fxshard.colwise({axis!r}, heads={b[real[0]]}), so each head is held by the {n // b[real[0]]} ranks "
                       f"whose query heads use it; or " + fix)
        raise ctx.fail(f"reshape {list(a)} -> {list(b)} splits or merges dim {p.dim}, which is sharded on {axis!r}, "
                       "so the local pieces are not a shard of the result", fix)

    return _layout_map(ctx, one)


def piece_sizes(size: int, n: int) -> str:
    """``"3, 3, 2"``: the sizes of ``torch.chunk``'s pieces of ``size`` over ``n`` ranks, for messages."""
    from fxshard.state.shards import chunk_range

    return ", ".join(str(chunk_range(size, n, i)[1]) for i in range(n))


def like_other(rule: Callable) -> Callable:
    """``x.view_as(other)`` / ``reshape_as`` / ``expand_as``: each rank takes the *local*
    shape of ``other``, so the result is right only where that is the result's local
    shape (``other`` laid out like the result, where it is sharded)."""

    def wrapped(ctx: Ctx):
        out = rule(ctx)
        other = ctx.t(1)
        if other is not None:
            from fxshard.layout.placements import local_shape

            try:
                want = local_shape(ctx.val.shape, out, ctx.axes)
            except ValueError:
                want = None
            if want != tuple(other.local_shape):
                raise ctx.fail(f"{ctx.node.target} takes the local shape {list(other.local_shape)} of `{ctx.arg(1).name}` "
                               f"({fmt_layout(other.layout)}), but the result laid out {fmt_layout(out)} has local shape "
                               f"{list(want) if want else '?'}",
                               f"lay `{ctx.arg(1).name}` out like the result, or use view/expand with explicit sizes")
        return out

    wrapped.__name__ = f"{getattr(rule, '__name__', 'rule')} (like other)"
    return wrapped


def permute_like(kind: str):
    def rule(ctx: Ctx):
        x = ctx.t(0)
        nd = len(x.shape)
        if kind == "transpose":
            d0, d1 = ctx.arg(1, "dim0"), ctx.arg(2, "dim1")
            d0, d1 = d0 % nd, d1 % nd
            perm = list(range(nd)); perm[d0], perm[d1] = perm[d1], perm[d0]
        elif kind == "t":
            perm = list(range(nd))[::-1]
        else:
            dims = ctx.node.args[1:] if len(ctx.node.args) > 2 or isinstance(ctx.arg(1), int) else ctx.arg(1, "dims")
            perm = [d % nd for d in dims]
        inv = {src: dst for dst, src in enumerate(perm)}
        return _layout_map(ctx, lambda axis: Shard(inv[x.layout[axis].dim]) if isinstance(x.layout[axis], Shard) else x.layout[axis])

    rule.__name__ = kind
    return rule


def copy_into(ctx: Ctx):
    """``dst.copy_(src)`` (an in-place slice assignment, ``k[..., 64:] = k_pe``): each rank
    writes its part of ``src`` into its part of ``dst``, so ``src`` must be laid out like
    ``dst`` or be Replicate and broadcast along the dims ``dst`` is sharded on."""
    dst, src = ctx.t(0), ctx.t(1)
    off = len(dst.shape) - len(src.shape)

    def one(axis):
        pd, ps = dst.layout[axis], src.layout[axis]
        if isinstance(ps, Shard):
            ps = Shard(ps.dim + off)  # in dst's dims (src broadcasts from the right)
        if ps == pd:
            if isinstance(pd, Shard) and src.shape[pd.dim - off] != dst.shape[pd.dim]:
                raise ctx.fail(f"copies a value sharded on a broadcast dim into one sharded on dim {pd.dim} on {axis!r}",
                               "make the copied value Replicate")
            return pd
        if isinstance(ps, Replicate) and isinstance(pd, Shard):
            sd = pd.dim - off
            if sd < 0 or src.shape[sd] == 1 or shard_broadcast(ctx, ctx.arg(1), axis, sd):
                return pd
        raise ctx.fail(f"copies a {fmt_placement(ps)} value into a {fmt_placement(pd)} one on axis {axis!r}: the ranks' "
                       "parts do not line up", "give the copied value the layout of its destination in the plan, or make both Replicate")

    return _layout_map(ctx, one)


def fresh_like(ctx: Ctx):
    """``x.new_empty(sizes)`` / ``new_zeros`` / ``new_ones``: a new tensor, Replicate --
    unless it is a buffer assembled from parts written into it that are sharded alike
    (HF's MLA keys: ``k = kv.new_empty(...)``, ``k[..., :nope].copy_(k_nope)`` with
    ``k_nope`` head-sharded): then every rank builds its own part, sharded like them
    (``localize`` shrinks a literal size), and a Replicate part written next must be
    broadcast along that dim (``copy_``)."""
    nd = ctx.out_ndim

    def one(axis):
        proposed = set(_written_parts(ctx.node, nd, axis))
        return proposed.pop() if len(proposed) == 1 else R

    return _layout_map(ctx, one)


def _written_parts(buffer: fx.Node, nd: int, axis: str):
    """The ``Shard`` s on ``axis`` (in ``buffer``'s dims) of values already laid out that are
    copied into ``buffer`` or into a basic slice of it that keeps that dim whole."""
    for view in buffer.users:
        if view.op == "call_function" and view.target is operator.getitem:
            dims = _basic_slices(view.args[1], nd)
            if dims is None:
                continue
        else:
            view, dims = buffer, [slice(None)] * nd
        for w in view.users if view is not buffer else [view]:
            if not (w.op == "call_function" and w.target is torch.ops.aten.copy_.default or w.op == "call_method" and w.target == "copy_"):
                continue
            if w.args[0] is not view:
                continue
            src = Ctx.info_of(w.args[1])
            p = src.layout.get(axis) if isinstance(src, TensorInfo) else None
            if isinstance(p, Shard):
                d = p.dim + nd - len(src.shape)
                if 0 <= d < nd and dims[d] == slice(None):
                    yield Shard(d)


def _basic_slices(idx, nd: int) -> list | None:
    """``x[idx]`` as one slice per dim of ``x`` when ``idx`` is slices and ``...`` only (a
    view that keeps every dim), else None."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if not all(isinstance(i, slice) or i is Ellipsis for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (nd - len(items) + 1) + items[at + 1:]
    return items + [slice(None)] * (nd - len(items)) if len(items) <= nd else None


def narrow(ctx: Ctx):
    """``torch.narrow(x, dim, start, length)``: a slice of a dim that must not be sharded;
    ``start``/``length`` read at run time are rescaled to that dim by ``localize``.

    ``table.narrow(0, 0, S)`` of a Replicate table with ``S`` the length of a dim
    sharded on one context-parallel axis (rotary tables sliced to the sequence) is the
    table at this rank's positions: ``Shard(dim)`` there, and ``localize`` picks the
    rows (``rewrite = "narrow_positions"``)."""
    x = ctx.t(0)
    nd = len(x.shape)
    dim = _traced_int(ctx, ctx.arg(1, "dim")) % nd
    start, length = ctx.arg(2, "start"), ctx.arg(3, "length")
    pos_axis = None
    if start == 0 and isinstance(length, fx.Node) and ctx.cp_axes:
        axes = _number_axes(length)
        if axes is not None and len(axes) == 1 and next(iter(axes)) in ctx.cp_axes:
            (pos_axis,) = axes

    def one(axis):
        p = x.layout[axis]
        if isinstance(p, Shard) and p.dim == dim:
            raise ctx.fail(f"narrow of dim {dim}, which is sharded on {axis!r}", "narrow a Replicate dim, or narrow before sharding")
        if axis == pos_axis and isinstance(p, Replicate):
            ctx.node.meta[KEY].rewrite = "narrow_positions"
            return Shard(dim)
        return p

    return _layout_map(ctx, one)


def rank_dependent_numbers(ctx: Ctx) -> None:
    """PlanError when an op without a rule of its own receives a number (or a shape)
    read from a sharded dim: each rank would pass its local size, and nothing
    rescales it (``torch.narrow(cos, 0, 0, S)`` with S of a sequence-sharded input)."""
    for a in _flat(ctx.node.args, ctx.node.kwargs):
        v = ctx.info_of(a)
        if isinstance(v, SizeInfo) and isinstance(v.axes, tuple):
            dependent = any(ax is None or ax for ax in v.axes)
        elif _is_number_node(a):
            axes = _number_axes(a)
            dependent = axes is None or bool(axes)
        else:
            continue
        if dependent:
            raise ctx.fail(f"{_name(ctx.node)} has no layout rule and takes `{a.name}`, computed at run time from "
                           f"{_sharded_source(a)}: each rank would pass its local size, not the single-device one",
                           "pass the global size as a literal (e.g. a module attribute), read it from a dim that is not "
                           "sharded, or file an issue for a rule of this op")


def expand(ctx: Ctx):
    """``x.expand(*sizes)``: sharded dims stay sharded.  (A Replicate dim sized at run time
    by a sharded dim gets the global size back from ``localize``; a broadcast that meets a
    sharded operand is sharded like it, see :func:`shard_broadcast`.)"""
    x = ctx.t(0)
    off = ctx.out_ndim - len(x.shape)
    return _layout_map(ctx, lambda axis: Shard(x.layout[axis].dim + off) if isinstance(x.layout[axis], Shard) else x.layout[axis])


def triangle(ctx: Ctx):
    """``tril`` / ``triu``: a mask over the last two dims by their positions.  Other dims
    may be sharded (the heads of a causal mask ``[H, T, T]``); the last two must be whole,
    or a rank would compare its local positions.  It is linear: a Partial stays one."""
    x = ctx.t(0, "input")
    nd = len(x.shape)

    def one(axis):
        p = x.layout[axis]
        if isinstance(p, Shard) and p.dim >= nd - 2:
            raise ctx.fail(f"{_name(ctx.node)} over dim {p.dim}, which is sharded on {axis!r}: each rank would mask by "
                           f"its local positions", "build the mask before sharding that dim, or keep it Replicate")
        return p

    return _layout_map(ctx, one)


def repeat_interleave(ctx: Ctx):
    x = ctx.t(0)
    dim = ctx.arg(2, "dim")
    reps = ctx.arg(1, "repeats")

    def one(axis):
        p = x.layout[axis]
        if isinstance(p, Shard):
            if dim is None or not isinstance(reps, int):
                raise ctx.fail(f"repeat_interleave on a tensor sharded on {axis!r} needs an int repeats and a dim", "pass dim= and an int")
            return p
        return p

    return _layout_map(ctx, one)


def split(ctx: Ctx):
    """split/chunk.  Splitting a sharded dim is legal only into the parts of a fused
    projection (``colwise(splits=...)``), whose every part each rank holds a slice of."""
    x = ctx.t(0)
    nd = len(x.shape)
    dim = ctx.arg(2, "dim", 0)
    dim = dim + nd if dim < 0 else dim
    for axis, p in x.layout.items():
        if isinstance(p, Shard) and p.dim == dim:
            pieces = [v.shape[dim] for v in ctx.val]
            if x.blocks is None or tuple(pieces) != tuple(x.blocks):
                src = ctx.arg(0).name
                parts = f" (its parts are {list(x.blocks)})" if x.blocks else ""
                raise ctx.fail(f"split along dim {dim}, which is sharded on {axis!r}, into pieces {pieces}{parts}: each rank holds "
                               f"a slice of every piece only if the producing weight was sharded part by part",
                               f"shard the fused weight part by part: colwise({axis!r}, splits={pieces}) on the module that produces `{src}`")
    return [dict(x.layout) for _ in ctx.val]


def cat(stack: bool):
    def rule(ctx: Ctx):
        tensors = ctx.arg(0, "tensors")
        infos = [ctx.info_of(t) for t in tensors]
        nd = len(infos[0].shape)
        dim = ctx.arg(1, "dim", 0)
        dim = dim % (nd + 1 if stack else nd)

        def one(axis):
            ps = {ti.layout[axis] for ti in infos}
            shards = {p for p in ps if isinstance(p, Shard)}
            if not stack and len(shards) == 1 and ps - shards == {R}:  # MLA: cat([k_nope, k_pe.expand(...)])
                (sh,) = shards
                if all(ti.layout[axis] == sh or shard_broadcast(ctx, t, axis, sh.dim) for t, ti in zip(tensors, infos)):
                    ps = shards
            if len(ps) != 1:
                raise ctx.fail(f"{'stack' if stack else 'cat'} of tensors with different layouts on {axis!r}", "give all inputs the same layout")
            (p,) = ps
            if isinstance(p, Shard):
                if not stack and p.dim == dim:
                    raise ctx.fail(f"cat along dim {dim}, which is sharded on {axis!r}", "concatenate along another dim or make it Replicate")
                if stack and p.dim >= dim:
                    return Shard(p.dim + 1)
            return p

        return _layout_map(ctx, one)

    rule.__name__ = "stack" if stack else "cat"
    return rule


def getitem(ctx: Ctx):
    src, idx = ctx.arg(0), ctx.arg(1)
    v = ctx.info_of(src)
    if isinstance(v, (list, tuple)):
        return v[idx].layout if isinstance(v[idx], TensorInfo) else v[idx]
    if isinstance(v, SizeInfo):
        return SizeInfo(v.value[idx], v.axes[idx] if isinstance(v.axes, tuple) else None)
    if not isinstance(v, TensorInfo):
        return None
    items = idx if isinstance(idx, tuple) else (idx,)
    mapping, advanced, advanced_out = _index_map(ctx, items, len(v.shape))

    index_tensors = [(it, ctx.info_of(it)) for it in items if isinstance(ctx.info_of(it), TensorInfo)]

    def one(axis):
        p = v.layout[axis]
        sharded_index = [(it, ti) for it, ti in index_tensors if not isinstance(ti.layout[axis], Replicate)]
        if sharded_index:
            # each rank gathers the entries of its own index shard: a shard of the result only for one
            # index tensor into a Replicate tensor (the index dims replace the indexed dim in place)
            (it, ti) = sharded_index[0]
            if (len(sharded_index) == 1 and len(advanced) == len(index_tensors) and isinstance(p, Replicate)
                    and isinstance(ti.layout[axis], Shard) and all(t.dtype is not torch.bool for _, t in index_tensors)):
                # the index tensors broadcast together (HF's mask: cumsum[batch_idx, kv_idx]); the others must
                # not vary along the sharded dim, and the broadcast dims stand where the indices were when
                # they are adjacent, else in front
                nb = max(len(t.shape) for _, t in index_tensors)
                bd = nb - len(ti.shape) + ti.layout[axis].dim
                if all(len(t.shape) - nb + bd < 0 or t.shape[len(t.shape) - nb + bd] == 1 for o, t in index_tensors if o is not it):
                    adjacent = advanced == list(range(advanced[0], advanced[0] + len(advanced)))
                    return Shard((advanced_out[0] if adjacent else 0) + bd)
            raise ctx.fail(f"indexing with `{it.name}`, which is {fmt_placement(ti.layout[axis])} on {axis!r}, into a "
                           f"{fmt_placement(p)} tensor", "make the index Replicate")
        if isinstance(p, Replicate) or isinstance(p, Partial):
            return p
        m = mapping.get(p.dim)
        if p.dim in advanced or advanced:
            raise ctx.fail(f"advanced indexing of a tensor sharded on {axis!r}", "make it Replicate before indexing")
        if m is None:
            raise ctx.fail(f"indexing selects single entries of dim {p.dim}, which is sharded on {axis!r}", "make that dim Replicate before indexing")
        if isinstance(m, tuple):
            o, s = m
            if s != slice(None) and block_slice(v, p.dim, s) is None:
                if v.blocks is not None and v.shape[p.dim] == sum(v.blocks):
                    raise ctx.fail(f"slicing dim {p.dim} (sharded on {axis!r}, made of the parts {list(v.blocks)}) at {s.start}:{s.stop}, "
                                   f"not at the parts' boundaries", "slice whole parts, or give colwise(splits=...) the parts this code slices")
                raise ctx.fail(f"slicing dim {p.dim}, which is sharded on {axis!r}",
                               "slice a Replicate dim, or slice before sharding; for a fused projection sliced into its parts "
                               "(Phi-3's qkv[..., :q_size]) give it colwise(splits=[sizes of the parts])")
            return Shard(o)
        return Shard(m)

    return _layout_map(ctx, one)


def _index_map(ctx: Ctx, items: tuple, nd: int):
    """Where each dim of a tensor goes under ``x[items]``: ``{dim: out_dim}`` for dims kept
    whole, ``{dim: (out_dim, slice)}`` for sliced ones, ``{dim: None}`` for dims an int
    selects away; and the input and output dims of advanced (tensor) indices."""
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    mapping, advanced, advanced_out, in_d, out_d = {}, [], [], 0, 0
    for it in items:
        if it is None:
            out_d += 1
        elif it is Ellipsis:
            for _ in range(nd - consumed):
                mapping[in_d] = out_d; in_d += 1; out_d += 1
        elif isinstance(it, slice):
            mapping[in_d] = (out_d, it); in_d += 1; out_d += 1
        elif isinstance(it, int) or isinstance(ctx.info_of(it), SizeInfo):
            mapping[in_d] = None; in_d += 1
        else:
            advanced.append(in_d); advanced_out.append(out_d); in_d += 1; out_d += 1
    while in_d < nd:
        mapping[in_d] = out_d; in_d += 1; out_d += 1
    return mapping, advanced, advanced_out


# ----------------------------------------------------------------------------- values only measured
#
# A value whose every use reads only its shape, dtype or device (``torch.ones_like(att[0, 0])``,
# ``x[0].size(-1)``, ``x.new_zeros(...)``), directly or through views and indexing, needs no
# layout for its numbers, only the right *local shape*: what each rank's program computes from
# it is built from that shape.  ``propagate`` finds such values (``shape_only_values``) and, where
# the rule for their numbers refuses the op, lays them out by the rules below instead: the
# layout whose local shape is what the op gives on each rank's local tensor.  A sharded dim an
# int selects away leaves the global shape (Replicate); one kept whole stays sharded.

_aten = torch.ops.aten
FILL_LIKE = (torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like, torch.rand_like,
             torch.randn_like, torch.randint_like,  # and as torch.export records them:
             _aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default, _aten.full_like.default,
             _aten.rand_like.default, _aten.randn_like.default, _aten.randint_like.default, _aten.randint_like.low_dtype)
_MEASURING_METHODS = {"size", "dim", "new_empty", "new_zeros", "new_ones", "new_full", "get_device",
                      "is_floating_point", "is_complex", "element_size"}
_MEASURED_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "is_meta", "layout"}
_VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "t",
                 "contiguous", "to", "float", "half", "bfloat16", "double", "detach", "clone", "expand", "select",
                 "narrow", "type"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze,
                   torch.transpose, torch.permute, torch.t, torch.select, torch.narrow, torch.clone, torch.detach}


def fill_like(ctx: Ctx):
    """``torch.ones_like(x)`` and the other ``*_like``: a new tensor of ``x``'s *local* shape
    on each rank.  Constant (or random) fill has no position, so that is the global result
    laid out like ``x`` -- except that a Partial ``x`` has the whole shape on each rank:
    the result is Replicate there."""
    x = ctx.t(0, "input")
    if x is None:
        return {a: R for a in ctx.axes}
    return _layout_map(ctx, lambda axis: R if isinstance(x.layout[axis], Partial) else x.layout[axis])


def _only_as_self(node: fx.Node, value: fx.Node, names=("input", "self")) -> bool:
    """``value`` is ``node``'s first argument (the tensor it measures or views) and no other."""
    first = node.args[0] if node.args else next((node.kwargs[k] for k in names if k in node.kwargs), None)
    if first is not value:
        return False
    rest = [*node.args[1:], *(v for k, v in node.kwargs.items() if node.args or k not in names)]
    found: list[fx.Node] = []
    fx.node.map_arg(rest, found.append)
    return value not in found


def measures(node: fx.Node, value: fx.Node) -> bool:
    """Does ``node`` read only the shape, dtype or device of ``value``?"""
    if node.op == "call_function" and node.target in FILL_LIKE:
        return _only_as_self(node, value)
    if node.op == "call_method" and node.target in _MEASURING_METHODS:
        return _only_as_self(node, value)
    if node.op == "call_function" and node.target is builtins.getattr:
        return node.args[0] is value and node.args[1] in _MEASURED_ATTRIBUTES
    return False


def views(node: fx.Node, value: fx.Node) -> bool:
    """Is ``node`` a view, index or cast of ``value`` (its result shaped from it)?"""
    if node.op == "call_method" and node.target in _VIEW_METHODS or node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
        return _only_as_self(node, value)
    return False


def _sliced_length_kept(ctx: Ctx, x: TensorInfo, axis: str, dim: int, s) -> bool:
    """Does slicing dim ``dim`` (sharded on ``axis`` only) with the literal slice ``s`` give
    every rank's local piece the length it gives the whole dim?"""
    from fxshard.state.shards import chunk_range

    if not isinstance(s, slice) or not all(b is None or isinstance(b, int) for b in (s.start, s.stop, s.step)):
        return False
    if sum(1 for p in x.layout.values() if p == Shard(dim)) != 1:
        return False
    n, size = ctx.axes[axis], x.shape[dim]
    want = len(range(size)[s])
    return all(len(range(chunk_range(size, n, i)[1])[s]) == want for i in range(n))


def _measured_index(ctx: Ctx, x: TensorInfo, items: tuple):
    mapping, advanced, _ = _index_map(ctx, items, len(x.shape))

    def one(axis):
        p = x.layout[axis]
        if not isinstance(p, Shard):
            return R  # Partial or Replicate: each rank holds the whole shape
        if advanced:
            raise ctx.fail(f"advanced indexing of a tensor sharded on {axis!r}", "make it Replicate before indexing")
        m = mapping[p.dim]
        if m is None:
            return R  # the sharded dim is selected away: the rest has its global shape on every rank
        if not isinstance(m, tuple) or m[1] == slice(None):
            return Shard(m[0] if isinstance(m, tuple) else m)
        if _sliced_length_kept(ctx, x, axis, p.dim, m[1]):
            return R
        raise ctx.fail(f"slicing dim {p.dim}, which is sharded on {axis!r}", "slice a Replicate dim")

    return _layout_map(ctx, one)


def measured_getitem(ctx: Ctx):
    """``x[idx]`` whose result is only measured: the layout of its local shape."""
    idx = ctx.arg(1)
    return _measured_index(ctx, ctx.t(0), idx if isinstance(idx, tuple) else (idx,))


def measured_select(ctx: Ctx):
    """``x.select(dim, i)`` whose result is only measured."""
    x = ctx.t(0)
    dim = _traced_int(ctx, ctx.arg(1, "dim")) % len(x.shape)
    return _measured_index(ctx, x, (slice(None),) * dim + (0,))


def measured_narrow(ctx: Ctx):
    """``x.narrow(dim, start, length)`` whose result is only measured."""
    x = ctx.t(0)
    dim = _traced_int(ctx, ctx.arg(1, "dim")) % len(x.shape)
    start, length = ctx.arg(2, "start"), ctx.arg(3, "length")
    if not isinstance(start, int) or not isinstance(length, int):
        raise ctx.fail("narrow of a sharded dim by a length read at run time", "narrow a Replicate dim")
    return _measured_index(ctx, x, (slice(None),) * dim + (slice(start, start + length),))


def measured_rule(node: fx.Node) -> Callable | None:
    """The rule laying out ``node``'s local shape when only its shape is read, or None
    where the rule for its numbers already gives that (views keep sharded dims whole)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return measured_getitem
    if node.target in ("select", torch.select):
        return measured_select
    if node.target in ("narrow", torch.narrow):
        return measured_narrow
    return None


def block_slice(v: TensorInfo, dim: int, s: slice) -> tuple[int, ...] | None:
    """The parts of a fused projection's output (``v.blocks``) that the literal slice
    ``s`` of its blocked ``dim`` selects whole, or None.  Each rank holds its slice of
    every part, so such a slice is its local part slices: ``localize`` divides the
    bounds by the axis size."""
    size = v.shape[dim]
    if v.blocks is None or size != sum(v.blocks) or s.step not in (None, 1):
        return None
    if not all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in (s.start, s.stop)):
        return None
    start, stop, _ = s.indices(size)
    edges = [0]
    for b in v.blocks:
        edges.append(edges[-1] + b)
    if start not in edges or stop not in edges or start >= stop:
        return None
    return tuple(v.blocks[edges.index(start):edges.index(stop)])


# ----------------------------------------------------------------------------- sizes

def _dim_axes(ti: TensorInfo, d: int) -> frozenset:
    return frozenset(a for a, p in ti.layout.items() if isinstance(p, Shard) and p.dim == d)


def size(ctx: Ctx):
    x = ctx.t(0)
    d = ctx.arg(1, "dim")
    nd = len(x.shape)
    if d is None:
        return SizeInfo(tuple(x.shape), tuple(_dim_axes(x, i) for i in range(nd)))
    d = d % nd
    return SizeInfo(x.shape[d], _dim_axes(x, d))


def getattr_rule(ctx: Ctx):
    x = ctx.t(0)
    attr = ctx.arg(1)
    if x is not None and attr == "shape":
        return SizeInfo(tuple(x.shape), tuple(_dim_axes(x, i) for i in range(len(x.shape))))
    if x is not None and attr == "ndim":
        return SizeInfo(len(x.shape), frozenset())
    if x is not None and attr in ("T", "mT", "mH", "H"):
        nd = len(x.shape)
        perm = list(range(nd))[::-1] if attr in ("T", "H") else list(range(nd - 2)) + [nd - 1, nd - 2]
        inv = {src: dst for dst, src in enumerate(perm)}
        return _layout_map(ctx, lambda axis: Shard(inv[x.layout[axis].dim]) if isinstance(x.layout[axis], Shard) else x.layout[axis])
    return None


def int_arith(op):
    def rule(ctx: Ctx):
        parts = [ctx.info_of(a) if isinstance(a, fx.Node) else a for a in ctx.node.args]
        axes = [p.axes if isinstance(p, SizeInfo) else frozenset() for p in parts]
        if any(a is None or isinstance(a, tuple) for a in axes):
            return SizeInfo(ctx.val, None)
        sharded = [a for a in axes if a]
        if not sharded:
            return SizeInfo(ctx.val, frozenset())
        if op in (operator.mul, operator.floordiv) and len(sharded) == 1 and (op is operator.mul or axes[0]):
            return SizeInfo(ctx.val, sharded[0])
        return SizeInfo(ctx.val, None)

    rule.__name__ = "int arithmetic"
    return rule


def factory(ctx: Ctx):
    """torch.arange/zeros/ones/full/empty: a new tensor, Replicate, sized by literals or
    by sizes every rank sees alike.  A size of a sharded dim (each rank's local size)
    would build a local tensor that is not the single-device one laid out Replicate
    (``arange(local_t)`` gives the first positions, not this rank's), so it is refused --
    except ``arange(n)`` with ``n`` the size of a dim sharded on one axis (HF's mask
    builder: ``torch.arange(batch_size)``): that is ``Shard(0)`` there, and ``localize``
    adds this rank's offset (``rewrite = "arange_offset"``)."""
    if ctx.node.target is torch.arange and _arange_of_size(ctx.node) is not None:
        axes = _number_axes(_arange_of_size(ctx.node))
        if axes is not None and len(axes) == 1 and isinstance(ctx.val, torch.Tensor):
            ctx.node.meta[KEY].rewrite = "arange_offset"
            (axis,) = axes
            return {a: Shard(0) if a == axis else R for a in ctx.axes}
    for a in _flat(ctx.node.args, ctx.node.kwargs):
        if isinstance(a, fx.Node) and (isinstance(ctx.info_of(a), SizeInfo) or _is_number_node(a)):
            axes = _number_axes(a)
            if axes is None or axes:
                raise ctx.fail(f"{_name(ctx.node)} is sized by `{a.name}`, computed at run time from {_sharded_source(a)}: each rank "
                               f"would build a tensor from its local size, not the single-device tensor",
                               "size it with a literal (the global size) or with a size read from a dim that is not sharded")
    if not isinstance(ctx.val, torch.Tensor):
        return scalar_value(ctx)
    return {axis: R for axis in ctx.axes}


def sliding_window_mask(ctx: Ctx):
    """``fxshard::sliding_window_mask(length, window, device)``: ``[T, T]`` built from a
    length.  A length read from a dim sharded on one context-parallel axis gives each
    rank the rows of its positions (``Shard(0)`` there, whole key rows); ``localize``
    builds them (``rewrite = "window_rows"``)."""
    length = ctx.arg(0)
    axes = _number_axes(length) if isinstance(length, fx.Node) else frozenset()
    if axes is None or len(axes) > 1 or (axes and next(iter(axes)) not in ctx.cp_axes):
        raise ctx.fail(f"a sliding-window mask sized by `{getattr(length, 'name', length)}`, read from {_sharded_source(length)}",
                       "shard the sequence on a context-parallel axis (fxshard.context_parallel), or size the mask with a "
                       "length that is not sharded")
    if axes:
        ctx.node.meta[KEY].rewrite = "window_rows"
        (axis,) = axes
        return {a: Shard(0) if a == axis else R for a in ctx.axes}
    return {a: R for a in ctx.axes}


def _arange_of_size(node: fx.Node) -> fx.Node | None:
    """``n`` of ``torch.arange(n)`` / ``torch.arange(0, n)`` read at run time, else None."""
    args = node.args
    if len(args) == 1 and isinstance(args[0], fx.Node):
        return args[0]
    if len(args) == 2 and args[0] == 0 and not isinstance(args[0], bool) and isinstance(args[1], fx.Node):
        return args[1]
    return None


# ----------------------------------------------------------------------------- the table

_add, _mul, _div = pointwise("add"), pointwise("mul"), pointwise("div")
_unary, _nonlin = pointwise("unary"), pointwise(None)
_type_as = pointwise("unary", tensor_positions=(0,))

RULES: dict[Any, Callable] = {
    torch.ops.aten.copy_.default: copy_into,
    operator.add: _add, operator.sub: _add, operator.mul: _mul, operator.truediv: _div, operator.neg: _unary,
    operator.pow: _nonlin, operator.matmul: matmul, operator.getitem: getitem, builtins.getattr: getattr_rule,
    torch.add: _add, torch.sub: _add, torch.mul: _mul, torch.div: _div, torch.neg: _unary,
    torch.rsqrt: _nonlin, torch.sqrt: _nonlin, torch.exp: _nonlin, torch.log: _nonlin, torch.tanh: _nonlin,
    torch.sigmoid: _nonlin, torch.sin: _nonlin, torch.cos: _nonlin, torch.pow: _nonlin, torch.where: _nonlin,
    torch.abs: _nonlin, torch.clamp: _nonlin, torch.square: _nonlin, torch.polar: _nonlin, torch.outer: outer,
    torch.matmul: matmul, torch.bmm: matmul,
    torch.softmax: softmax(False), F.softmax: softmax(False), F.log_softmax: softmax(True), torch.log_softmax: softmax(True),
    F.silu: _nonlin, F.gelu: _nonlin, F.relu: _nonlin, torch.relu: _nonlin, F.tanh: _nonlin, F.sigmoid: _nonlin,
    F.dropout: _unary, F.linear: linear, F.embedding: embedding,
    F.layer_norm: norm(((2, "weight"), (3, "bias"))), F.rms_norm: norm(((2, "weight"),)), F.scaled_dot_product_attention: sdpa,
    F.cross_entropy: cross_entropy, F.nll_loss: cross_entropy,
    torch.reshape: reshape_like, torch.flatten: reshape_like, torch.unflatten: reshape_like,
    torch.squeeze: reshape_like, torch.unsqueeze: reshape_like,
    torch.view_as_complex: reshape_like, torch.view_as_real: reshape_like,
    torch.transpose: permute_like("transpose"), torch.permute: permute_like("permute"), torch.t: permute_like("t"),
    torch.repeat_interleave: repeat_interleave, torch.split: split, torch.chunk: split, torch.narrow: narrow,
    torch.cat: cat(False), torch.concat: cat(False), torch.stack: cat(True),
    torch.sum: reduction("sum"), torch.mean: reduction("mean"), torch.amax: reduction("amax"),
    operator.mod: _nonlin, builtins.abs: _nonlin,
    torch.arange: factory, torch.zeros: factory, torch.ones: factory, torch.full: factory, torch.empty: factory,
    **{f: fill_like for f in FILL_LIKE}, torch.tril: triangle, torch.triu: triangle,
    torch.ops.aten.tril.default: triangle, torch.ops.aten.triu.default: triangle,
}
RULES[torch.ops.fxshard.sliding_window_mask.default] = sliding_window_mask
# Python numbers: math.* (fx autowraps the math module) and builtins a capture may record.
RULES.update({f: scalar_or(None) for f in vars(math).values() if callable(f) and f not in RULES})
RULES.update({f: scalar_or(None) for f in (builtins.min, builtins.max, builtins.round, builtins.int, builtins.float)})

METHOD_RULES: dict[str, Callable] = {
    "copy_": copy_into, "new_empty": fresh_like, "new_zeros": fresh_like, "new_ones": fresh_like, "new_full": fresh_like,
    "add": _add, "sub": _add, "mul": _mul, "div": _div, "neg": _unary, "__add__": _add,
    "float": _unary, "half": _unary, "bfloat16": _unary, "double": _unary, "to": _type_as, "type_as": _type_as,
    "contiguous": _unary, "clone": _unary, "detach": _unary,
    "pow": _nonlin, "rsqrt": _nonlin, "sqrt": _nonlin, "exp": _nonlin, "log": _nonlin, "tanh": _nonlin,
    "sigmoid": _nonlin, "relu": _nonlin, "abs": _nonlin, "sin": _nonlin, "cos": _nonlin, "masked_fill": _nonlin,
    "square": _nonlin, "clamp": _nonlin,
    "softmax": softmax(False), "log_softmax": softmax(True), "matmul": matmul,
    "view": reshape_like, "reshape": reshape_like, "flatten": reshape_like, "unflatten": reshape_like,
    "squeeze": reshape_like, "unsqueeze": reshape_like, "view_as": like_other(reshape_like), "reshape_as": like_other(reshape_like),
    "transpose": permute_like("transpose"), "permute": permute_like("permute"), "t": permute_like("t"),
    "expand": expand, "expand_as": like_other(expand), "repeat_interleave": repeat_interleave,
    "split": split, "chunk": split, "narrow": narrow,
    "sum": reduction("sum"), "mean": reduction("mean"), "amax": reduction("amax"), "max": reduction("max"),
    "size": size, "dim": lambda ctx: SizeInfo(len(ctx.t(0).shape), frozenset()),
    "tril": triangle, "triu": triangle,
}

INT_RULES = {operator.mul: int_arith(operator.mul), operator.floordiv: int_arith(operator.floordiv),
             operator.add: int_arith(operator.add), operator.sub: int_arith(operator.sub)}


def rule_for(node: fx.Node) -> tuple[str, Callable | None]:
    """(rule name, rule) for a call_function/call_method node."""
    if node.op == "call_method":
        fn = METHOD_RULES.get(node.target)
        return (node.target, fn)
    t = node.target
    if t in INT_RULES and not any(isinstance(Ctx.info_of(a), TensorInfo) for a in node.args):
        return ("int", INT_RULES[t])
    fn = RULES.get(t)
    return (getattr(fn, "__name__", "rule") if fn else "", fn)
