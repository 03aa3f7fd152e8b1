"""context_parallel_attention: attention over a sequence sharded across the ranks of an axis.

Inside a module the plan declares context-parallel (:func:`fxshard.context_parallel`)
``propagate`` lets ``scaled_dot_product_attention`` take q/k/v sharded on the
sequence dim (``rewrite == Rewrite.CONTEXT_PARALLEL``).  Every rank holds the queries of
its own positions; this pass gives them the keys of the whole sequence:

* ``method="allgather"``: ``k`` and ``v`` are all-gathered along the sequence
  (``fxshard.all_gather``; ``grad_sync`` folds the sum of dK/dV into its backward,
  a reduce-scatter), and the attention gets the mask of local queries against the
  gathered keys (``fxshard.context_parallel_mask``: causal by global position, the
  model's own mask with its key columns in gathered order);
* ``method="ring"``: the attention becomes ``fxshard.ring_attention``, K/V blocks
  passed around the ring with an online-softmax merge.

A model mask that is Replicate with whole query rows first has this rank's rows
picked.  On a load-balanced axis every sequence-sharded value holds chunks ``i``
and ``2n-1-i``; a plan redistribution of such a value (a gather or a chunk on that
axis) would put rows in the wrong order and is refused.

Reads:  ``.rewrite == Rewrite.CONTEXT_PARALLEL``, ``.extra["context_parallel"]``, ``.value``,
        ``.redistribute``.
Writes: the attention node's target and arguments; new ``all_gather`` nodes with
        ``.collective``; ``.collective`` on ``ring_attention``; ``.value`` of new nodes.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxshard.runtime import collectives
from fxshard.runtime.context_parallel_ops import context_parallel_mask, local_positions, ring_attention
from fxshard.errors import PlanError, node_error
from fxshard.layout.placements import fmt_layout, local_shape
from fxshard.meta import Collective, Rewrite, TensorInfo, info
from fxshard.meta import PassContext


def context_parallel_attention(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite the attention of context-parallel modules (in place).  ``cp_axes``:
    ``{axis: ContextParallel}`` (:meth:`fxshard.Plan.context_parallel_axes`)."""
    axes, cp_axes = ctx.axes, ctx.cp_axes
    if not cp_axes:
        return
    _refuse_reorders(gm, {a for a, cp in cp_axes.items() if cp.load_balance})
    done = set()
    for node in list(gm.graph.nodes):
        if info(node).rewrite != Rewrite.CONTEXT_PARALLEL:
            continue
        cp = info(node).extra["context_parallel"]
        args = _bound(node)
        q, k, v = args["query"], args["key"], args["value"]
        qi = info(q).value
        nd = len(qi.shape)
        n = axes[cp.axis]
        if qi.shape[nd - 2] % n:
            raise node_error(node, f"context parallelism cuts the sequence into {n} pieces ({cp.axis}={n}), but it has "
                                   f"{qi.shape[nd - 2]} tokens, and the ring exchanges equal blocks",
                             f"use a sequence length divisible by {n} (pad it)")
        if cp.load_balance and qi.shape[nd - 2] % (2 * n):
            raise node_error(node, f"load-balanced context parallelism cuts the sequence into {2 * n} chunks (2 x {cp.axis}={n}), "
                                   f"but it has {qi.shape[nd - 2]} tokens",
                             f"use a sequence length divisible by {2 * n} (pad it), or context_parallel({cp.axis!r}, load_balance=False)")
        mask = args.get("attn_mask")
        if mask is not None:
            mask = _own_rows(gm.graph, node, q, mask, cp, axes)
        region = info(node).extra.get("context_parallel_module", "")
        if cp.method == "allgather":
            _allgather(gm.graph, node, q, k, v, mask, args, cp, axes, nd, region)
        else:
            _ring(node, q, k, v, mask, args, cp, axes, region)
        info(node).rewrite = None
        done.add(region)
    _check_every_module_attends(gm, cp_axes, done)
    gm.graph.lint()
    gm.recompile()
    return


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _bound(node: fx.Node) -> dict:
    """The attention's arguments by name (``F.scaled_dot_product_attention`` is a builtin)."""
    out = dict(zip(_SDPA_ARGS, node.args))
    out.update(node.kwargs)
    return out


def _copy_meta(new: fx.Node, node: fx.Node) -> None:
    new.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
    info(new).region = info(node).region


def _own_rows(graph: fx.Graph, node: fx.Node, q: fx.Node, mask: fx.Node, cp, axes) -> fx.Node:
    """A Replicate mask with whole query rows: the rows of this rank's positions."""
    mi = info(mask).value
    if not isinstance(mi, TensorInfo) or not isinstance(mi.layout[cp.axis], Replicate) or mi.shape[-2] == 1:
        return mask
    d = len(mi.shape) - 2
    with graph.inserting_before(node):
        length = graph.call_method("size", (q, -2))
        device = graph.call_function(getattr, (mask, "device"))
        pos = graph.call_function(local_positions, (cp.axis, length), {"load_balance": cp.load_balance, "device": device})
        rows = graph.call_method("index_select", (mask, d, pos))
    for n in (length, device, pos, rows):
        _copy_meta(n, node)
    layout = dict(mi.layout)
    layout[cp.axis] = Shard(d)
    info(rows).value = TensorInfo(layout, mi.shape, tuple(local_shape(mi.shape, layout, axes)), mi.dtype)
    info(rows).rule = "the mask rows of this rank's positions"
    return rows


def _allgather(graph, node, q, k, v, mask, args, cp, axes, nd, region):
    gathered = []
    for name, x in (("K", k), ("V", v)):
        xi = info(x).value
        with graph.inserting_before(node):  # named for the code: k_all, v_all
            g = graph.create_node("call_function", collectives.all_gather, (x, cp.axis, nd - 2), name=f"{name.lower()}_all")
        _copy_meta(g, node)
        layout = dict(xi.layout)
        layout[cp.axis] = Replicate()
        info(g).value = TensorInfo(layout, xi.shape, tuple(local_shape(xi.shape, layout, axes)), xi.dtype, xi.requires_grad)
        info(g).rule = "context parallel"
        info(g).collective = Collective("all_gather", cp.axis, "all-gather", "local chunk",
                                        f"context parallel: {name} of {region}")
        gathered.append(g)
    qi = info(q).value
    kw = {"load_balance": cp.load_balance, "is_causal": bool(args.get("is_causal", False))}
    if mask is not None:
        kw["attn_mask"] = mask
    with graph.inserting_before(node):
        m = graph.create_node("call_function", context_parallel_mask, (q, cp.axis), kw, name="cp_mask")
    _copy_meta(m, node)
    t = qi.shape[nd - 2]
    if mask is not None:
        mi = info(mask).value
        mshape, mdtype, mlayout = mi.shape, mi.dtype, dict(mi.layout)
    else:
        mshape, mdtype, mlayout = (t, t), torch.bool, {a: Replicate() for a in axes}
    mlayout[cp.axis] = Shard(len(mshape) - 2)
    info(m).value = TensorInfo(mlayout, tuple(mshape), tuple(local_shape(mshape, mlayout, axes)), mdtype)
    info(m).rule = "context parallel mask"
    new_kwargs = {"attn_mask": m}
    for key in ("scale", "enable_gqa"):
        if args.get(key) not in (None, False):
            new_kwargs[key] = args[key]
    node.args, node.kwargs = (q, *gathered), new_kwargs
    info(node).rule = f"attention on gathered K/V ({cp.axis})"


def _ring(node, q, k, v, mask, args, cp, axes, region):
    kw = {"attn_mask": mask, "is_causal": bool(args.get("is_causal", False)), "scale": args.get("scale"),
          "enable_gqa": bool(args.get("enable_gqa", False)), "load_balance": cp.load_balance}
    node.op, node.target = "call_function", ring_attention
    node._rename("ring_attention")  # the code reads `ring_attention = fxshard_ring_attention(q, k, v, 'cp', ...)`
    node.args, node.kwargs = (q, k, v, cp.axis), {key: val for key, val in kw.items() if val not in (None, False) or key == "load_balance"}
    info(node).rule = f"ring attention ({cp.axis})"
    info(node).collective = Collective("ring_attention", cp.axis, f"ring: {axes[cp.axis] - 1} hops of K and V",
                                       f"ring: {axes[cp.axis] - 1} hops of K, V, dK, dV and one of dK, dV",
                                       f"context parallel: attention of {region}")


def _refuse_reorders(gm: fx.GraphModule, balanced: set[str]) -> None:
    """A plan redistribution on a load-balanced axis would gather or chunk the sequence
    in rank order, which is not the order of the positions the ranks hold."""
    for node in gm.graph.nodes:
        red = info(node).redistribute
        if not red:
            continue
        src, dst = red
        for axis in balanced:
            a, b = src.get(axis, Replicate()), dst.get(axis, Replicate())
            if a != b and (isinstance(a, Shard) or isinstance(b, Shard)):
                raise node_error(node, f"the plan redistributes this value on {axis!r} ({fmt_layout(src)} -> {fmt_layout(dst)}), "
                                       f"but {axis!r} is load-balanced: each rank holds chunks i and 2n-1-i of the sequence, "
                                       f"not the contiguous slice a gather or chunk would assume",
                                 f"keep values sequence-sharded on {axis!r} (compute the loss on each rank's part, "
                                 f"fxshard.gather_sequence the output), or context_parallel({axis!r}, load_balance=False)")


def _check_every_module_attends(gm: fx.GraphModule, cp_axes: dict, done: set[str]) -> None:
    """A context-parallel module whose attention receives no sequence-sharded query is
    a plan that does not do what it says."""
    declared = {}
    for node in gm.graph.nodes:
        fqn = info(node).extra.get("context_parallel_module")
        if fqn is not None:
            declared.setdefault(fqn, info(node).extra["context_parallel"])
    for fqn, cp in declared.items():
        if fqn not in done:
            raise PlanError(f"module {fqn!r} is declared context_parallel({cp.axis!r}), but no scaled_dot_product_attention "
                            f"inside it receives a query sharded on the sequence over {cp.axis!r}; fix: shard the token inputs "
                            f"on the sequence dim (Plan(inputs={{'<ids>': {{{cp.axis!r}: Shard(1)}}}})) and point the entry at "
                            f"the module that calls the attention")
