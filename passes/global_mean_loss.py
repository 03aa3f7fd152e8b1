"""global_mean_loss: a mean cross-entropy over tokens sharded on a context-parallel axis.

Each rank holds the logits of its part of the sequence.  The single-device loss is
the mean over *all* tokens, and ranks count different numbers of them once
``ignore_index`` targets (padding) or class weights enter, so the mean of the ranks'
means would be wrong.  ``F.cross_entropy(logits, target, reduction="mean")`` (or
``F.nll_loss``) whose tokens are sharded on such axes (``.extra["mean_axes"]``, set by
the rule) becomes ``fxshard.global_mean_cross_entropy(logits, target, axes, ...)``:
the local sum and the local count, each summed over the axes, then divided.  The
result is Replicate there.  Logits sharded on the vocab too are ``loss_parallel``'s.

Reads:  ``.rewrite == Rewrite.GLOBAL_MEAN``, ``.extra["mean_axes"]``.
Writes: retargets those nodes; ``.rule``.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F

from fxshard.errors import node_error
from fxshard.runtime.loss import global_mean_cross_entropy
from fxshard.meta import Rewrite, info
from fxshard.meta import PassContext

_NAMES = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def global_mean_loss(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite mean losses over sequence-sharded tokens (in place)."""
    for node in gm.graph.nodes:
        if info(node).rewrite != Rewrite.GLOBAL_MEAN:
            continue
        a = dict(zip(_NAMES, node.args))
        a.update(node.kwargs)
        for unsupported in ("size_average", "reduce"):
            if a.get(unsupported) is not None:
                raise node_error(node, f"the deprecated argument {unsupported}= is not supported", "use reduction=")
        kwargs = {"ignore_index": a.get("ignore_index", -100)}
        if a.get("weight") is not None:
            kwargs["weight"] = a["weight"]
        if node.target is F.nll_loss:
            kwargs["nll"] = True
        elif a.get("label_smoothing", 0.0):
            kwargs["label_smoothing"] = a["label_smoothing"]
        node.target = global_mean_cross_entropy
        node.args, node.kwargs = (a["input"], a["target"], tuple(info(node).extra["mean_axes"])), kwargs
        info(node).rule = "mean over every rank's tokens"
        info(node).rewrite = None
    gm.recompile()
    return
