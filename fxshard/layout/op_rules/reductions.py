"""Rules for reductions, norms and losses: ``sum``/``mean``/``amax``, ``softmax``,
``layer_norm``/``rms_norm``, ``cross_entropy``/``nll_loss``.

Reducing a sharded dim leaves a Partial (a sum or a mean of shares) where that is
exact, and is refused where it is not (a max, a mean over unequal pieces, a softmax).
A norm over a sharded dim is ``fxshard.distributed_norm``'s business, never a rule's.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard.layout.op_rules.context import R, Ctx, layout_map, reduce_fix
from fxshard.layout.op_rules.numbers import traced_int
from fxshard.layout.op_rules.table import register_rule
from fxshard.layout.placements import fmt_placement
from fxshard.meta import KEY, Rewrite, SizeInfo


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
        dims = _dims(traced_int(ctx, ctx.arg(1, "dim")), nd)
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

        out = layout_map(ctx, one)
        if isinstance(ctx.val, (tuple, list)):  # x.max(dim) -> (values, indices), laid out alike
            return [out, dict(out)]
        return out

    rule.__name__ = f"reduction ({kind})"
    return rule


register_rule(torch.sum, "sum")(reduction("sum"))
register_rule(torch.mean, "mean")(reduction("mean"))
register_rule(torch.amax, "amax")(reduction("amax"))
register_rule("max")(reduction("max"))


def softmax(log: bool):
    def rule(ctx: Ctx):
        x = ctx.t(0)
        nd = len(x.shape)
        d = traced_int(ctx, ctx.arg(1, "dim"))
        d = d + nd if d < 0 else d

        def one(axis):
            p = x.layout[axis]
            if isinstance(p, Partial):
                raise ctx.fail(f"softmax of a Partial value on axis {axis!r}", reduce_fix(axis))
            if isinstance(p, Shard) and p.dim == d:
                if log:  # loss parallel: a global log-sum-exp, the result stays sharded
                    ctx.request_rewrite(Rewrite.LOSS_PARALLEL)
                    return p
                raise ctx.fail(f"softmax over dim {d}, which is sharded on {axis!r}",
                               "keep the softmax dim Replicate (for the vocab dim of a loss, use log_softmax or cross_entropy: loss parallel)")
            return p

        return layout_map(ctx, one)

    rule.__name__ = "log_softmax" if log else "softmax"
    return rule


register_rule(torch.softmax, F.softmax, "softmax")(softmax(False))
register_rule(torch.log_softmax, F.log_softmax, "log_softmax")(softmax(True))


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

        return layout_map(ctx, one)

    rule.__name__ = "norm"
    return rule


register_rule(F.layer_norm)(norm(((2, "weight"), (3, "bias"))))
register_rule(F.rms_norm)(norm(((2, "weight"),)))


@register_rule(F.cross_entropy, F.nll_loss)
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
            ctx.request_rewrite(Rewrite.LOSS_PARALLEL)
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

    out = layout_map(ctx, one)
    meta = ctx.node.meta[KEY]
    if meta.extra.get("mean_axes") and meta.rewrite is None:
        ctx.request_rewrite(Rewrite.GLOBAL_MEAN)  # loss_parallel, if it applies, takes mean_axes along
    return out
