"""loss_parallel: cross-entropy on vocab-sharded logits without gathering them.

``F.cross_entropy(logits, target, ...)`` whose logits are sharded on the class dim
becomes ``fxshard.vocab_parallel_cross_entropy(logits, target, axis, ...)``;
``F.log_softmax`` over a sharded dim becomes ``fxshard.vocab_parallel_log_softmax``
(its result stays sharded) and the ``F.nll_loss`` that consumes it
``fxshard.vocab_parallel_nll_loss``.  Only scalar-per-token values are reduced over
the axis (max, sum of exponentials, target logit); no node holds full-vocab logits.

Reads:  ``.rewrite == Rewrite.LOSS_PARALLEL``, ``.value`` of the logits.
Writes: retargets those nodes; ``.rule``.
"""
from __future__ import annotations

import inspect

import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fxshard.errors import node_error
from fxshard.runtime.loss import vocab_parallel_cross_entropy, vocab_parallel_log_softmax, vocab_parallel_nll_loss
from fxshard.meta import Rewrite, info
from fxshard.meta import PassContext


def _bound(fn, node: fx.Node) -> dict:
    args = node.args[1:] if node.op == "call_method" else node.args
    first = (node.args[0],) if node.op == "call_method" else ()
    return dict(inspect.signature(fn).bind(*first, *args, **node.kwargs).arguments)


def _vocab_axis(node: fx.Node, x: fx.Node, dim: int) -> str:
    layout = info(x).value.layout
    nd = len(info(x).value.shape)
    axes = [a for a, p in layout.items() if isinstance(p, Shard) and p.dim == dim % nd]
    if len(axes) != 1:
        raise node_error(node, f"loss parallel needs the class dim sharded on exactly one axis, got {axes}", "shard the vocab on one axis")
    return axes[0]


def loss_parallel(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite losses over vocab-sharded logits (in place).  ``axes``: the mesh axis sizes;
    a vocab the axis does not divide is passed on as ``vocab_size=`` (its ranks hold
    unequal ``torch.chunk`` pieces)."""
    axes = ctx.axes
    for node in gm.graph.nodes:
        if info(node).rewrite != Rewrite.LOSS_PARALLEL:
            continue
        target = node.target
        if target is F.cross_entropy or target is F.nll_loss:
            a = _bound(target, node)
            x = a["input"]
            axis = _vocab_axis(node, x, 1 if len(info(x).value.shape) > 1 else 0)
            for unsupported in ("size_average", "reduce"):
                if a.get(unsupported) is not None:
                    raise node_error(node, f"the deprecated argument {unsupported}= is not supported", "use reduction=")
            kwargs = {"ignore_index": a.get("ignore_index", -100), "reduction": a.get("reduction", "mean")}
            if info(node).extra.get("mean_axes"):  # tokens sharded on a context-parallel axis too
                kwargs["mean_axes"] = tuple(info(node).extra["mean_axes"])
            vocab = info(x).value.shape[1 if len(info(x).value.shape) > 1 else 0]
            if axes is not None and vocab % axes[axis]:
                kwargs["vocab_size"] = vocab
            if target is F.cross_entropy:
                kwargs["label_smoothing"] = a.get("label_smoothing", 0.0)
                node.target = vocab_parallel_cross_entropy
            else:
                node.target = vocab_parallel_nll_loss
            node.args, node.kwargs = (x, a["target"], axis), kwargs
        else:  # log_softmax (function or method)
            fn = F.log_softmax
            a = _bound(fn, node)
            if a.get("dtype") is not None:
                raise node_error(node, "log_softmax(dtype=...) is not supported on sharded logits", "cast the logits first")
            dim = a["dim"]
            axis = _vocab_axis(node, a["input"], dim)
            node.op, node.target = "call_function", vocab_parallel_log_softmax
            node.args, node.kwargs = (a["input"], axis, dim), {}
        info(node).rule = "loss parallel"
        info(node).rewrite = None
    gm.recompile()
    return
