"""Translate the aten-level training IR of ``torch.export`` into the torch-level
vocabulary of fxshard's graphs (``F.linear``, ``Tensor.view``, ``x[:, :8]`` ...).

Why: the layout rules, the specialized rewrites (deferred bias, vocab-parallel
embedding, loss parallel) and ``localize`` speak the torch-level vocabulary that
``torch.fx.symbolic_trace`` produces; translating here keeps every pass ignorant of
how a graph was captured, and the generated code reads like the model's own source
(``x.view(...)`` rather than ``torch.ops.aten.view.default(...)``).

Only ops with an exact torch-level equivalent are translated; every other aten op
stays as it is and gets its layout from DTensor's sharding propagation
(:mod:`fxshard.dtensor_rules`).  Export's runtime checks (``_assert_tensor_metadata``,
``_assert_scalar``, ...) are dropped: they check *global* shapes and dtypes, which a
sharded rank does not have.

Example::

    translate_aten(gm)          # in place; returns the number of nodes translated
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten
_INT64_MAX = 2 ** 63 - 1

# Export's runtime checks; they have no users and check global properties.
DROPPED = {
    aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default, aten._assert_async.msg, aten._assert_async.default,
    aten._functional_assert_async.msg,
}

Spec = tuple[str, Any, tuple, dict]  # (op, target, args, kwargs) of the replacement node


def _method(name: str, n_args: int | None = None) -> Callable[..., Spec]:
    """aten op -> ``Tensor.<name>``, positional arguments kept (the first ``n_args``)."""
    def tr(args, kwargs, node):
        return "call_method", name, tuple(args[:n_args] if n_args else args), dict(kwargs)
    return tr


def _function(fn: Callable, n_args: int | None = None) -> Callable[..., Spec]:
    def tr(args, kwargs, node):
        return "call_function", fn, tuple(args[:n_args] if n_args else args), dict(kwargs)
    return tr


def _new(name: str) -> Callable[..., Spec]:
    """``aten.new_empty(x, size, dtype=, device=, pin_memory=)`` -> ``x.new_empty(size, ...)``
    (export spells out the defaults; the method reads them from ``x``)."""
    def tr(args, kwargs, node):
        kw = {k: v for k, v in kwargs.items() if v is not None and (k, v) != ("pin_memory", False)}
        return "call_method", name, tuple(args), kw
    return tr


def _binary(fn: Callable) -> Callable[..., Spec]:
    """add/sub with ``alpha`` have no operator form: keep them as aten."""
    def tr(args, kwargs, node):
        if kwargs.get("alpha", 1) != 1 or len(args) > 2:
            return None
        return "call_function", fn, tuple(args), {}
    return tr


def _embedding(args, kwargs, node):
    weight, ids, *rest = args
    padding_idx = rest[0] if rest else kwargs.get("padding_idx", -1)
    return "call_function", F.embedding, (ids, weight), {
        "padding_idx": None if padding_idx == -1 else padding_idx, "max_norm": None, "norm_type": 2.0,
        "scale_grad_by_freq": rest[1] if len(rest) > 1 else kwargs.get("scale_grad_by_freq", False),
        "sparse": rest[2] if len(rest) > 2 else kwargs.get("sparse", False)}


def _sdpa(args, kwargs, node):
    names = ("attn_mask", "dropout_p", "is_causal")
    kw = {k: v for k, v in zip(names, args[3:])}
    kw.update(kwargs)
    return "call_function", F.scaled_dot_product_attention, tuple(args[:3]), kw


def _layer_norm(args, kwargs, node):
    return "call_function", F.layer_norm, tuple(args[:5]), {}


def _addmm(args, kwargs, node):
    """``addmm(bias, x, w)`` is transformers' ``Conv1D`` (GPT-2): weight ``[in, out]``.
    As ``F.linear(x, w.t(), bias)`` it is a linear like any other, so the bias, vocab
    and loss rewrites and the colwise/rowwise rules apply; ``t`` maps the Conv1D weight
    layout (``Shard(1)`` colwise) to the linear one (``Shard(0)``)."""
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return None
    bias, x, w = args
    graph = node.graph
    with graph.inserting_before(node):
        wt = graph.call_method("t", (w,))
    wt.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
    return "call_function", F.linear, (x, wt, bias), {}


def _arange(args, kwargs, node):
    kw = {k: v for k, v in kwargs.items() if k in ("dtype", "device") and v is not None}
    return "call_function", torch.arange, tuple(args), kw


def _index(args, kwargs, node):
    """``index(x, [i, None, j])``: ``x[i, :, j]`` (``None`` there keeps a dim whole)."""
    x, indices = args
    return "call_function", operator.getitem, (x, tuple(slice(None) if i is None else i for i in indices)), {}


def _slice(args, kwargs, node):
    x, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1:])[:5]
    nd = node.args[0].meta["val"].dim()
    dim = dim % nd
    start = None if start in (0, None) else start
    end = None if end is None or (isinstance(end, int) and end >= _INT64_MAX) else end
    step = None if step in (1, None) else step
    return "call_function", operator.getitem, (x, (slice(None),) * dim + (slice(start, end, step),)), {}


def _select(args, kwargs, node):
    x, dim, index = args
    nd = node.args[0].meta["val"].dim()
    return "call_function", operator.getitem, (x, (slice(None),) * (dim % nd) + (index,)), {}


def _reduce(name: str):
    def tr(args, kwargs, node):
        kw = {k: v for k, v in kwargs.items() if k != "dtype" or v is not None}
        return "call_method", name, tuple(args), kw
    return tr


def _softmax(name: str):
    def tr(args, kwargs, node):
        x, dim, *rest = args
        if rest and isinstance(rest[0], bool):  # _softmax(x, dim, half_to_float)
            if rest[0]:
                return None
            rest = []
        kw = {"dtype": rest[0]} if rest and rest[0] is not None else {}
        kw.update({k: v for k, v in kwargs.items() if v is not None})
        return "call_method", name, (x, dim), kw
    return tr


def _to(args, kwargs, node):
    """to / _to_copy: a dtype (and device) change; layout and memory format are the default."""
    x, *rest = args
    kw = {k: v for k, v in kwargs.items() if k in ("dtype", "device") and v is not None}
    if rest:
        kw["dtype"] = rest[0]
    if set(kwargs) - {"dtype", "device", "layout", "pin_memory", "non_blocking", "copy", "memory_format"}:
        return None
    return "call_method", "to", (x,), kw


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _cross_entropy(args, kwargs, node):
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    kw = dict(zip(names, args[2:]))
    kw.update(kwargs)
    kw["reduction"] = _REDUCTIONS[kw.get("reduction", 1)]
    if kw.get("weight") is None:
        kw.pop("weight", None)
    return "call_function", F.cross_entropy, tuple(args[:2]), kw


def _dropout(args, kwargs, node):
    x, p, train = args
    return "call_function", F.dropout, (x, p, train), {}


def _gelu(args, kwargs, node):
    return "call_function", F.gelu, (args[0],), {"approximate": kwargs.get("approximate", args[1] if len(args) > 1 else "none")}


TRANSLATIONS: dict[Any, Callable[..., Spec | None]] = {
    aten.linear.default: _function(F.linear),
    aten.addmm.default: _addmm,
    aten.embedding.default: _embedding,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _function(F.rms_norm),
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.dropout.default: _dropout,
    aten.silu.default: _function(F.silu),
    aten.gelu.default: _gelu,
    aten.relu.default: _function(F.relu),
    aten.matmul.default: _function(torch.matmul),
    aten.bmm.default: _function(torch.bmm),
    aten.mm.default: _function(torch.matmul),
    aten.add.Tensor: _binary(operator.add), aten.add.Scalar: _binary(operator.add),
    aten.sub.Tensor: _binary(operator.sub), aten.sub.Scalar: _binary(operator.sub),
    aten.mul.Tensor: _function(operator.mul), aten.mul.Scalar: _function(operator.mul),
    aten.div.Tensor: _function(operator.truediv), aten.div.Scalar: _function(operator.truediv),
    aten.neg.default: _function(operator.neg),
    aten.pow.Tensor_Scalar: _method("pow"),
    aten.rsqrt.default: _method("rsqrt"), aten.sqrt.default: _method("sqrt"), aten.exp.default: _method("exp"),
    aten.log.default: _method("log"), aten.tanh.default: _method("tanh"), aten.sigmoid.default: _method("sigmoid"),
    aten.sin.default: _method("sin"), aten.cos.default: _method("cos"), aten.abs.default: _method("abs"),
    aten.mean.dim: _reduce("mean"), aten.sum.dim_IntList: _reduce("sum"), aten.amax.default: _reduce("amax"),
    aten.softmax.int: _softmax("softmax"), aten._softmax.default: _softmax("softmax"),
    aten.log_softmax.int: _softmax("log_softmax"), aten._log_softmax.default: _softmax("log_softmax"),
    aten.view.default: _method("view"), aten._unsafe_view.default: _method("view"),
    aten.reshape.default: _method("reshape"),
    aten.transpose.int: _method("transpose"), aten.permute.default: _method("permute"), aten.t.default: _method("t"),
    aten.unsqueeze.default: _method("unsqueeze"), aten.squeeze.dim: _method("squeeze"), aten.squeeze.dims: _method("squeeze"),
    aten.expand.default: _method("expand", 2),
    aten.contiguous.default: _method("contiguous", 1), aten.clone.default: _method("clone", 1),
    aten.detach.default: _method("detach"),
    aten.to.dtype: _to, aten.to.dtype_layout: _to, aten._to_copy.default: _to, aten.type_as.default: _method("type_as"),
    aten.split.Tensor: _function(torch.split), aten.split_with_sizes.default: _function(torch.split),
    aten.chunk.default: _function(torch.chunk),
    aten.cat.default: _function(torch.cat), aten.stack.default: _function(torch.stack),
    aten.slice.Tensor: _slice, aten.select.int: _select,
    aten.index.Tensor: _index, aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten.masked_fill.Scalar: _method("masked_fill"), aten.masked_fill.Tensor: _method("masked_fill"),
    aten.sym_size.int: _method("size"),
    aten.flatten.using_ints: _method("flatten"), aten.unflatten.int: _method("unflatten"),
    aten.view_as_complex.default: _function(torch.view_as_complex), aten.view_as_real.default: _function(torch.view_as_real),
    aten.new_empty.default: _new("new_empty"), aten.new_zeros.default: _new("new_zeros"), aten.new_ones.default: _new("new_ones"),
}


def translate_aten(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s aten nodes to their torch-level form, in place; drop export's
    runtime checks.  Node names and metadata are kept.  Returns the count translated."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in DROPPED:
            if not node.users:
                graph.erase_node(node)
            continue
        tr = TRANSLATIONS.get(node.target)
        spec = tr(list(node.args), dict(node.kwargs), node) if tr is not None else None
        if spec is None:
            continue
        op, target, args, kwargs = spec
        if target is operator.getitem and all(s == slice(None) for s in args[1]):
            node.replace_all_uses_with(args[0])  # a full slice is the tensor itself
            graph.erase_node(node)
            continue
        # in place, so the node keeps its name (names are never reused in a graph) and metadata
        node.op, node.target = op, target
        node.args, node.kwargs = tuple(args), kwargs
        if target == "size" and isinstance(args[0], fx.Node) and args[0].op == "placeholder":
            node._rename(f"{args[0].name}_size_{args[1]}")
        count += 1
    graph.lint()
    return count
