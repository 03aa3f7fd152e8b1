"""replicate_heads: more ranks on an axis than a projection has heads (``colwise(heads=n)``).

At ``tp=4`` the 2 KV heads of a GQA attention cannot be cut in 4.  As Megatron and
vLLM do, each rank then holds the KV head its query heads use, replicated over the
``tp / heads`` consecutive ranks that share it (rank ``i`` holds head ``i // (tp /
heads)``), and the gradients of those weights are summed over exactly these ranks.

This pass makes that an ordinary ``Shard``: it rewrites the *global* graph into the
equivalent one in which every KV head is stored ``replicas`` times, so the projection
has as many heads as the axis has ranks.  From the projection to the attention it
follows the head dim and scales the sizes that name it: the KV head count of a
``view``/``expand`` by ``replicas``, and the group size of HF's ``repeat_kv``
(``expand`` of a new dim, then ``reshape`` into the query heads),
``repeat_interleave``'s repeats, by ``1/replicas``; ``scaled_dot_product_attention(...,
enable_gqa=True)`` needs nothing.  Where the KV heads meet the query heads the shapes
are the model's again.  The rewritten shapes are then recomputed on fake tensors and
checked against what was expected, so a graph this pass does not understand is a
PlanError, never a different computation.  Every later pass sees the projection's
weight ``Shard(0)`` over the axis like any other.

The parameters themselves keep their real shapes: ``shard_state`` gives rank ``i`` the
rows of head ``i // replicas``, ``full_state_dict`` gathers one copy of each head;
``grad_sync`` sums the replicas' gradients (``grad_sync(w, "tp", replicas=2)``).

Reads:  ``.declared`` and ``extra["heads"]`` of ``get_attr`` nodes; ``node.meta["val"]``.
Writes: ``node.meta["val"]`` and size literals from each such projection to its
        attention; ``extra["head_replicas"]`` (a :class:`fxshard.layout.placements.HeadReplicas`)
        on the parameter's ``get_attr``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fxshard.markers import region_input, region_output
from fxshard.errors import PlanError
from fxshard.layout.placements import HeadReplicas
from fxshard.meta import info
from fxshard.layout.op_rules import rule_for, view_groups
from fxshard.meta import PassContext


@dataclass(frozen=True)
class _Heads:
    """Where a tensor on the way to the attention keeps its KV heads."""

    dim: int  # the dim that holds them
    unit: int  # elements of that dim per head (head_dim right after the projection, then 1)
    group: int | None = None  # the dim after it, expanded from 1 to the GQA group size (repeat_kv)


class _Rewrite:
    def __init__(self, gm: fx.GraphModule, replicas: int, module: str, axis: str):
        self.gm, self.replicas, self.module, self.axis = gm, replicas, module, axis
        self.heads: dict[fx.Node, _Heads | tuple] = {}  # tuple: a split's parts, by position
        self.ends: list[fx.Node] = []  # where the KV heads meet the query heads

    def fail(self, node: fx.Node, why: str) -> PlanError:
        return PlanError(
            f"module {self.module!r}: its heads are replicated over {self.replicas} ranks of axis {self.axis!r} "
            f"(colwise(heads=...) on an axis larger than the head count), but node `{node.name}` "
            f"({node.op} {getattr(node.target, '__name__', node.target)}) {why}\n"
            f"  fix: use an axis size that divides the head count, or leave {self.module!r} replicated")


def _shape(node) -> tuple[int, ...] | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


_SAME = {"contiguous", "float", "half", "bfloat16", "double", "to", "type_as", "clone", "detach"}
_ELEMENTWISE_FN = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub,
                   torch.mul, torch.div, torch.neg, F.dropout}
_ELEMENTWISE_METHOD = {"add", "sub", "mul", "div", "neg", "__add__"}


def replicate_heads(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite the projections planned ``colwise(heads=n)`` on an axis larger than ``n`` (in place)."""
    axes = ctx.axes
    by_linear: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        heads = info(node).extra.get("heads") if node.op == "get_attr" else None
        if heads is None:
            continue
        axis = _sharded_axis(node)
        if axis is None:
            continue
        n = axes[axis]
        module = node.target.rpartition(".")[0]
        if n <= heads:
            if heads % n:
                raise PlanError(f"module {module!r}: its {heads} heads cannot be cut over the {n} ranks of axis "
                                f"{axis!r}\n  fix: a size of {axis!r} that divides {heads}, or a multiple of it "
                                f"(each head is then replicated over {axis!r}/{heads} ranks)")
            continue
        if n % heads:
            raise PlanError(f"module {module!r}: axis {axis!r} has {n} ranks, which is not a multiple of its {heads} "
                            f"heads, so the ranks cannot share heads evenly\n  fix: a size of {axis!r} that divides "
                            f"{heads} or is a multiple of it")
        users = list(node.users)
        if len(users) != 1 or users[0].target is not F.linear or node not in users[0].args[1:3]:
            raise PlanError(f"module {module!r}: colwise(heads={heads}) replicates the heads of a linear layer's "
                            f"weight and bias, but {node.target!r} is used by {[u.name for u in users]}\n"
                            f"  fix: plan heads= only on the linear layer that projects to the heads")
        by_linear.setdefault(users[0], []).append(node)
    for linear, params in by_linear.items():
        _rewrite(gm, linear, params, axes)
    return


def _sharded_axis(node: fx.Node) -> str | None:
    axes = [a for a, p in (info(node).declared or {}).items() if isinstance(p, Shard)]
    if len(axes) > 1:
        raise PlanError(f"parameter {node.target!r}: colwise(heads=...) shards on one axis, but its layout shards on {axes}")
    return axes[0] if axes else None


def _rewrite(gm: fx.GraphModule, linear: fx.Node, params: list[fx.Node], axes: dict) -> None:
    heads = info(params[0]).extra["heads"]
    axis = _sharded_axis(params[0])
    replicas = axes[axis] // heads
    module = params[0].target.rpartition(".")[0]
    rw = _Rewrite(gm, replicas, module, axis)
    out = _shape(linear)
    if not out or out[-1] % heads:
        raise rw.fail(linear, f"has {out[-1] if out else '?'} output features, not a multiple of {heads} heads")
    for p in params:
        shape = tuple(_attr(gm, p).shape)
        if shape[0] != out[-1]:
            raise rw.fail(linear, f"reads {p.target!r} of shape {list(shape)}, whose dim 0 is not the {out[-1]} output features")
        info(p).extra["head_replicas"] = HeadReplicas(axis, heads)
    rw.heads[linear] = _Heads(len(out) - 1, out[-1] // heads)
    expected = {p: _scaled(tuple(_attr(gm, p).shape), 0, replicas) for p in params}
    expected[linear] = _scaled(out, len(out) - 1, replicas)
    pending = set(linear.users)  # users of the nodes that carry the heads, not yet followed
    for node in _after(linear):
        if not pending:
            break
        if node not in pending:
            continue
        pending.discard(node)
        h = _follow(rw, node)
        if h is _NO_TENSOR:
            continue
        if h is None:  # the KV heads met the query heads: the shape is the model's again
            rw.ends.append(node)
            expected[node] = _shape(node)
        else:
            rw.heads[node] = h
            pending |= set(node.users)
            if isinstance(h, _Heads):
                expected[node] = _scaled(_shape(node), h.dim, replicas) if h.group is None else _grouped(node, h, replicas)
    if not rw.ends:
        raise rw.fail(linear, "leads to no attention that reads its heads (no repeat_kv, repeat_interleave or "
                              "scaled_dot_product_attention(enable_gqa=True) was found)")
    _recompute(gm, params, expected, rw)


def _attr(gm: fx.GraphModule, p: fx.Node) -> torch.Tensor:
    owner, _, name = p.target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _after(node: fx.Node):
    n = node.next
    while n.op != "root":
        yield n
        n = n.next


def _scaled(shape, dim: int, factor: int) -> tuple[int, ...]:
    shape = list(shape)
    shape[dim] *= factor
    return tuple(shape)


def _grouped(node, h: _Heads, replicas: int) -> tuple[int, ...]:
    shape = list(_shape(node))
    shape[h.dim] *= replicas
    shape[h.group] //= replicas
    return tuple(shape)


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if _shape(a) is not None]


def _follow(rw: _Rewrite, node: fx.Node):
    """Where ``node``'s output keeps the heads (rewriting its size literals), None where the
    heads end, or a PlanError."""
    x = node.args[0] if node.args else None
    h = rw.heads.get(x) if isinstance(x, fx.Node) else None
    tgt, op = node.target, node.op
    if op == "call_function" and tgt in (region_input, region_output):
        return h
    if op == "call_function" and tgt is operator.getitem and isinstance(h, tuple):
        return h[node.args[1]]
    if isinstance(h, tuple):
        raise rw.fail(node, "uses the parts of a split whole")
    if op == "call_method" and tgt in _SAME:  # a second tensor (type_as, to) gives its dtype only
        return h
    if op == "call_method" and tgt == "size":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim is None or dim % len(_shape(x)) in (h.dim, h.group):
            raise rw.fail(node, "reads the size of the heads dim")
        return _NO_TENSOR
    if op == "call_function" and tgt is getattr and node.args[1] in ("dtype", "device"):
        return _NO_TENSOR
    if (op == "call_method" and tgt in ("transpose", "permute")) or (op == "call_function" and tgt in (torch.transpose, torch.permute)):
        return _permuted(rw, node, h)
    if (op == "call_method" and tgt == "unsqueeze") or (op == "call_function" and tgt is torch.unsqueeze):
        d = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
        d = d % (len(_shape(x)) + 1)
        return replace(h, dim=h.dim + (d <= h.dim), group=None if h.group is None else h.group + (d <= h.group))
    if op == "call_function" and tgt is operator.getitem:
        return _indexed(rw, node, h)
    if (op == "call_method" and tgt in ("view", "reshape", "flatten")) or (op == "call_function" and tgt in (torch.reshape, torch.flatten)):
        return _reshaped(rw, node, h)
    if op == "call_function" and tgt in (torch.view_as_complex, torch.view_as_real):
        return h  # adds or drops a trailing dim of 2, never the heads dim
    if op == "call_method" and tgt == "expand":
        return _expanded(rw, node, h)
    if op == "call_function" and tgt in (torch.cat, torch.concat):
        return _joined(rw, node, stack=False)
    if (op == "call_function" and tgt in _ELEMENTWISE_FN) or (op == "call_method" and tgt in _ELEMENTWISE_METHOD):
        return _elementwise(rw, node)
    if op == "call_function" and tgt in (F.rms_norm, F.layer_norm):
        _only_first(rw, node)
        nd = len(node.args[1]) if isinstance(node.args[1], (tuple, list)) else 1
        if h.dim >= len(_shape(x)) - nd:
            raise rw.fail(node, "normalizes over the heads dim")
        return h
    if (op == "call_method" and tgt in ("split", "chunk")) or (op == "call_function" and tgt in (torch.split, torch.chunk)):
        d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if d % len(_shape(x)) in (h.dim, h.group):
            raise rw.fail(node, "splits the heads dim")
        n = len(node.meta["val"])
        return (h,) * n
    if (op == "call_method" and tgt == "repeat_interleave") or (op == "call_function" and tgt is torch.repeat_interleave):
        return _repeated(rw, node, h)
    if op == "call_function" and tgt is F.scaled_dot_product_attention:
        return _attention(rw, node)
    kind = getattr(rule_for(node)[1], "__name__", "") if op in ("call_function", "call_method") else ""
    if kind.startswith("pointwise"):  # q/k norms written out (pow, rsqrt, ...), rope tables, masks
        return _elementwise(rw, node)
    if kind.startswith("reduction") or kind in ("softmax", "log_softmax"):
        return _reduced(rw, node, h, keeps=kind in ("softmax", "log_softmax"))
    if kind == "stack":  # interleaved rope: torch.stack((-x2, x1), -1)
        return _joined(rw, node, stack=True)
    raise rw.fail(node, "is an operation on the KV heads that fxshard cannot follow")


def _reduced(rw, node, h: _Heads, keeps: bool):
    """A reduction (or softmax) over dims other than the heads: each head's values stay its own."""
    nd = len(_shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or isinstance(dims, fx.Node):
        raise rw.fail(node, "reduces over every dim, the heads too")
    dims = {d % nd for d in (dims if isinstance(dims, (list, tuple)) else (dims,))}
    if h.dim in dims or h.group in dims:
        raise rw.fail(node, "reduces over the heads dim")
    keep = keeps or (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    shift = 0 if keep else sum(1 for d in dims if d < h.dim)
    out = replace(h, dim=h.dim - shift, group=None if h.group is None else h.group - (0 if keep else sum(1 for d in dims if d < h.group)))
    return (out, out) if isinstance(node.meta.get("val"), (tuple, list)) else out


_NO_TENSOR = _Heads(-1, 0)  # a size or dtype read: no tensor, nothing to rewrite


def _only_first(rw, node):
    if any(a in rw.heads for a in _tensor_args(node)[1:]):
        raise rw.fail(node, "combines KV heads with another tensor in a way fxshard cannot follow")


def _permuted(rw, node, h: _Heads) -> _Heads:
    nd = len(_shape(node.args[0]))
    if node.target in ("transpose", torch.transpose):
        a, b = (d % nd for d in node.args[1:3])
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    else:
        dims = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (list, tuple)) else node.args[1]
        perm = [d % nd for d in dims]
    return replace(h, dim=perm.index(h.dim), group=None if h.group is None else perm.index(h.group))


def _indexed(rw, node, h: _Heads) -> _Heads:
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    nd = len(_shape(node.args[0]))
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    full, out_dim, new = [], 0, {}
    for i in idx:
        if i is Ellipsis:
            full += [slice(None)] * (nd - n_real)
        else:
            full.append(i)
    full += [slice(None)] * (nd - sum(1 for i in full if i is not None))
    src = 0
    for i in full:
        if i is None:
            out_dim += 1
            continue
        if isinstance(i, fx.Node) or not isinstance(i, (int, slice)):
            raise rw.fail(node, "indexes the KV heads with a tensor")
        if src in (h.dim, h.group):
            if i != slice(None):
                raise rw.fail(node, "slices the heads dim")
            new[src] = out_dim
        if isinstance(i, slice):
            out_dim += 1
        src += 1
    return replace(h, dim=new[h.dim], group=None if h.group is None else new[h.group])


def _sizes_arg(node: fx.Node) -> tuple[list, int | None]:
    """(sizes, position) of a view/reshape/expand: ``x.view(a, b)`` or ``x.view([a, b])``."""
    if node.op == "call_function":  # torch.reshape(x, shape)
        return list(node.args[1]), 1
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        return list(node.args[1]), 1
    return list(node.args[1:]), None


def _set_sizes(node: fx.Node, sizes: list, position: int | None) -> None:
    if position is None:
        node.args = (node.args[0], *sizes)
    else:
        args = list(node.args)
        args[position] = type(node.args[position])(sizes)
        node.args = tuple(args)


def _scale_literal(rw, node, sizes: list, i: int, *, up: bool) -> None:
    s = sizes[i]
    if isinstance(s, bool) or not isinstance(s, int):
        raise rw.fail(node, f"sizes the heads dim with `{s}`, which fxshard cannot rescale (only int literals and -1)")
    if s == -1:
        return
    if up:
        sizes[i] = s * rw.replicas
    elif s % rw.replicas:
        raise rw.fail(node, f"repeats each KV head {s} times, which the {rw.replicas} replicas cannot share")
    else:
        sizes[i] = s // rw.replicas


def _reshaped(rw, node, h: _Heads):
    src, dst = _shape(node.args[0]), _shape(node)
    for ins, outs in view_groups(src, dst):
        if h.dim not in ins:
            continue
        ins = [d for d in ins if src[d] != 1 or d in (h.dim, h.group)]
        outs = [d for d in outs if dst[d] != 1]
        if h.group is not None:  # repeat_kv: [kv, group] -> [kv * group], the query heads
            if ins != [h.dim, h.group] or len(outs) != 1:
                raise rw.fail(node, "reshapes the repeated KV heads other than into the query heads")
            return None
        if ins[0] != h.dim:
            raise rw.fail(node, "merges the heads dim into a dim before it")
        unit = h.unit * _prod(src[d] for d in ins[1:])  # elements per head in this run of dims
        k, inner = 0, 1
        for d in reversed(outs[1:]):  # the trailing dims that lie inside one head
            if unit % (inner * dst[d]):
                break
            inner *= dst[d]
            k += 1
        if len(outs) - k != 1:
            raise rw.fail(node, "splits the heads dim in a way fxshard cannot follow")
        d = outs[0]
        if node.target in ("view", "reshape", torch.reshape):
            sizes, pos = _sizes_arg(node)
            _scale_literal(rw, node, sizes, d, up=True)
            _set_sizes(node, sizes, pos)
        return _Heads(d, unit // inner)
    raise rw.fail(node, "loses the heads dim")


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _expanded(rw, node, h: _Heads) -> _Heads:
    src, dst = _shape(node.args[0]), _shape(node)
    sizes, pos = _sizes_arg(node)
    off = len(dst) - len(src)
    d = h.dim + off
    _scale_literal(rw, node, sizes, d, up=True)
    group = None if h.group is None else h.group + off
    if group is None and d + 1 < len(dst) and src[d + 1 - off] == 1 and dst[d + 1] > 1:
        group = d + 1  # repeat_kv: the KV head's group of query heads
    if group is not None and src[group - off] == 1:
        _scale_literal(rw, node, sizes, group, up=False)
    _set_sizes(node, sizes, pos)
    return replace(h, dim=d, group=group)


def _joined(rw, node, stack: bool) -> _Heads:
    """``cat`` along another dim, or ``stack`` on a new one (interleaved rope), of tensors that
    all hold the KV heads in the same dim."""
    hs = {rw.heads.get(p) for p in node.args[0]}
    if len(hs) != 1 or None in hs:
        raise rw.fail(node, f"{'stacks' if stack else 'concatenates'} KV heads with other tensors")
    (h,) = hs
    d = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(_shape(node))
    if stack:
        return replace(h, dim=h.dim + (d <= h.dim), group=None if h.group is None else h.group + (d <= h.group))
    if d in (h.dim, h.group):
        raise rw.fail(node, "concatenates along the heads dim")
    return h


def _elementwise(rw, node) -> _Heads:
    out = _shape(node)
    found = None
    for a in _tensor_args(node):
        sa = _shape(a)
        off = len(out) - len(sa)
        h = rw.heads.get(a)
        if h is None:
            continue
        h = replace(h, dim=h.dim + off, group=None if h.group is None else h.group + off)
        if found is not None and found != h:
            raise rw.fail(node, "combines KV heads held in different dims")
        found = h
    for a in _tensor_args(node):
        if a in rw.heads:
            continue
        sa = _shape(a)
        off = len(out) - len(sa)
        for d in (found.dim, found.group):
            if d is not None and d - off >= 0 and sa[d - off] != 1:
                raise rw.fail(node, f"combines the KV heads with `{a.name}` {list(sa)}, which has their dim too")
    return found


def _repeated(rw, node, h: _Heads):
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None or dim % len(_shape(node.args[0])) != h.dim or h.unit != 1:
        raise rw.fail(node, "repeats along a dim other than the heads")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats % rw.replicas:
        raise rw.fail(node, f"repeats each KV head {repeats} times, which the {rw.replicas} replicas cannot share")
    if len(node.args) > 1:
        node.update_arg(1, repeats // rw.replicas)
    else:
        node.update_kwarg("repeats", repeats // rw.replicas)
    return None


def _attention(rw, node):
    q = node.args[0]
    if q in rw.heads or not node.kwargs.get("enable_gqa", False):
        raise rw.fail(node, "is an attention whose query heads fxshard cannot pair with the KV heads "
                            "(it needs enable_gqa=True, or repeat_kv/repeat_interleave before it)")
    for kv in node.args[1:3]:
        h = rw.heads.get(kv)
        if h is not None and (h.dim != len(_shape(kv)) - 3 or h.unit != 1 or h.group is not None):
            raise rw.fail(node, "reads the KV heads from a dim other than dim -3")
    return None


def _recompute(gm, params, expected: dict, rw: _Rewrite) -> None:
    """Run the rewritten nodes on fake tensors: every shape must be the one expected."""
    fake_mode = next(v.fake_mode for v in (n.meta.get("val") for n in expected) if hasattr(v, "fake_mode"))
    with fake_mode:
        for p in params:
            t = _attr(gm, p)
            p.meta["val"] = torch.empty(expected[p], dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
        for node in gm.graph.nodes:
            if node not in expected and node not in rw.heads:
                continue
            if node.op not in ("call_function", "call_method"):
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
            fn = getattr(args[0], node.target) if node.op == "call_method" else node.target
            if node.op == "call_method":
                args = args[1:]
            try:
                val = fn(*args, **kwargs)
            except Exception as e:
                raise rw.fail(node, f"fails once its KV heads are replicated ({type(e).__name__}: {e})") from None
            want = expected.get(node)
            if want is not None and tuple(val.shape) != tuple(want):
                raise rw.fail(node, f"has shape {list(val.shape)} once its KV heads are replicated, expected {list(want)}")
            node.meta["val"] = val
