"""Loss parallel: cross-entropy on vocab-sharded logits without gathering them.

Each rank holds ``[..., V/n]`` logits.  Three scalar-per-token reductions over the
axis replace the gather: the max (for stability, no gradient), the sum of
exponentials and the target logit.  The ``loss_parallel`` pass rewrites
``F.cross_entropy`` / ``F.log_softmax`` + ``F.nll_loss`` on vocab-sharded logits into
these functions; they are also public for losses computed outside the graph.  A loss
taken eagerly on a program's vocab-shard logits (the trainer's, under loss parallel) uses
:func:`vocab_parallel_token_losses`, whose backward keeps the logits alone.

Example::

    local_logits = sharded(tokens)                 # [B, S, V/n]: colwise(out=Shard(-1)) head
    loss = fxshard.vocab_parallel_cross_entropy(local_logits.flatten(0, 1), targets.flatten(), "tp")
"""
from __future__ import annotations

import torch
import torch.fx

from fxshard.runtime import collectives
from fxshard.runtime.collectives import comm_axis


def _all_reduce_max(x: torch.Tensor, axis: str) -> torch.Tensor:
    ax = comm_axis(axis, "vocab_parallel_log_softmax")
    if ax.size == 1:
        return x
    return collectives.raw_all_reduce(x, ax, "max")


def _log_sum_exp(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Replicated ``logsumexp`` over a dim sharded on ``axis`` (keepdim)."""
    shift = _all_reduce_max(x.detach().amax(dim, keepdim=True), axis)
    return shift + collectives.all_reduce((x - shift).exp().sum(dim, keepdim=True), axis).log()


def vocab_parallel_log_softmax(local_logits: torch.Tensor, axis: str, dim: int = -1) -> torch.Tensor:
    """``log_softmax`` over a dim sharded on ``axis``; returns this rank's shard.

    Forward: all-reduce(max) of the per-row max (no gradient), all-reduce(sum) of
    the per-row sum of exponentials.  The replicated log-sum-exp is subtracted from a
    sharded tensor, so its gradient is Partial: a grad sync (all-reduce backward)
    sums it, exactly as the grad-sync rule does in the graph.
    """
    return local_logits - collectives.grad_sync(_log_sum_exp(local_logits, axis, dim), axis)


def _rows(x: torch.Tensor, target: torch.Tensor):
    """[N, C] or [N, C, d1, ...] -> ([M, C], [M]) with the class dim last."""
    if x.dim() == 2:
        return x, target
    c = x.size(1)
    return x.movedim(1, -1).reshape(-1, c), target.reshape(-1)


def _reduce(per_token: torch.Tensor, valid: torch.Tensor, reduction: str, shape, mean_axes=()) -> torch.Tensor:
    if reduction == "none":
        return per_token.reshape(shape)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return _global_mean(per_token.sum(), valid.sum(), mean_axes)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _global_mean(total: torch.Tensor, count: torch.Tensor, axes) -> torch.Tensor:
    """``total / count`` with both summed over ``axes`` (tokens sharded there).  The sum
    of the totals is an all-reduce with identity backward: each rank's tokens get the
    gradient ``1 / global count``, as on one device."""
    count = count.to(total.dtype)
    for axis in axes:
        ax = comm_axis(axis, "global_mean_cross_entropy")
        if ax.size > 1:
            total = collectives.all_reduce(total, axis)
            count = collectives.raw_all_reduce(count.detach(), ax)
    return total / count


def _pick(local: torch.Tensor, t: torch.Tensor, axis: str, vocab_size: int | None = None) -> torch.Tensor:
    """``local[i, t[i]]`` for class-sharded rows, summed over the axis (replicated).
    ``vocab_size``: the global class count where the axis does not divide it: rank ``i``'s
    classes then start at ``i * ceil(V / n)`` (``torch.chunk``), not at ``i * n_local``."""
    n_local = local.size(-1)
    step = n_local if vocab_size is None else -(-vocab_size // collectives.axis_size(axis))
    local_t = t - collectives.local_offset(axis, step, t)
    owned = (local_t >= 0) & (local_t < n_local)
    picked = local.gather(-1, local_t.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
    return collectives.all_reduce(picked * owned.to(picked.dtype), axis)


def _sum_over(x: torch.Tensor, axis: str) -> torch.Tensor:
    ax = comm_axis(axis, "vocab_parallel_cross_entropy")
    return x if ax.size == 1 else collectives.raw_all_reduce(x, ax)


class _VocabParallelTokenLoss(torch.autograd.Function):
    """Per-token cross-entropy of rows ``[N, V/n]`` whose classes are sharded on ``axis``
    (Megatron's ``VocabParallelCrossEntropy``): forward all-reduces three numbers per token
    (max, sum of exponentials, target logit); backward is local, ``softmax - onehot`` of
    this rank's classes, recomputed from the saved logits and log-sum-exp.  It keeps the
    logits in their own dtype and one float per token: no fp32 copy of the logits and no
    ``exp`` of them outlive the forward (the loss is often the largest activation)."""

    @staticmethod
    def forward(ctx, x, t, axis, step, ignore_index):
        xf = x.float()
        shift = xf.amax(-1)
        ax = comm_axis(axis, "vocab_parallel_cross_entropy")
        if ax.size > 1:
            shift = collectives.raw_all_reduce(shift, ax, "max")
        lse = shift + _sum_over((xf - shift.unsqueeze(-1)).exp().sum(-1), axis).log()
        n_local = x.size(-1)
        local_t = t - collectives.local_offset(axis, step, t)
        owned = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.clamp(0, n_local - 1)
        picked = _sum_over(xf.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * owned.to(xf.dtype), axis)
        valid = t != ignore_index
        ctx.save_for_backward(x, lse, local_t, owned & valid, valid)
        return torch.where(valid, lse - picked, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, grad):
        x, lse, local_t, hit, valid = ctx.saved_tensors
        g = torch.where(valid, grad, torch.zeros_like(grad)).unsqueeze(-1)
        soft = (x.float() - lse.unsqueeze(-1)).exp()
        soft.scatter_add_(-1, local_t.unsqueeze(-1), -hit.to(soft.dtype).unsqueeze(-1))
        return (soft * g).to(x.dtype), None, None, None, None


def vocab_parallel_token_losses(local_logits: torch.Tensor, target: torch.Tensor, axis: str = "tp",
                                ignore_index: int = -100, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy ``[N]`` of logits ``[N, V/n]`` sharded on ``axis`` (0 where the
    target is ``ignore_index``), for a loss taken eagerly outside the program (the trainer's
    ``token_loss_sum``): the numbers of :func:`vocab_parallel_cross_entropy` with
    ``reduction="none"``, but the backward keeps only the logits, in their own dtype, and one
    float per token (Megatron's ``VocabParallelCrossEntropy``), where the composite form keeps
    an fp32 ``exp`` of the logits.  Inside a compiled graph the ``loss_parallel`` pass uses the
    composite form: AOTAutograd's partitioner may recompute this function's forward
    all-reduces in the backward.

    Example: ``vocab_parallel_token_losses(local_logits.flatten(0, 1), labels.flatten(), "tp").sum()``
    """
    step = local_logits.size(-1) if vocab_size is None else -(-vocab_size // collectives.axis_size(axis))
    return _VocabParallelTokenLoss.apply(local_logits, target, axis, step, ignore_index)


def vocab_parallel_nll_loss(local_logp: torch.Tensor, target: torch.Tensor, axis: str,
                            ignore_index: int = -100, reduction: str = "mean", mean_axes: tuple[str, ...] = (),
                            vocab_size: int | None = None) -> torch.Tensor:
    """``nll_loss`` of log-probabilities whose class dim (dim 1) is sharded on ``axis``.

    The target entry is picked on the rank that owns it and summed over the axis
    (all-reduce, identity backward); the result is replicated.  ``mean_axes``: axes
    the tokens are sharded on (context parallelism): the mean is over all of them.
    ``vocab_size``: the global class count, needed where the axis does not divide it.
    """
    logp, t = _rows(local_logp, target)
    picked = _pick(logp, t, axis, vocab_size)
    valid = t != ignore_index
    per_token = torch.where(valid, -picked, torch.zeros_like(picked))
    return _reduce(per_token, valid, reduction, target.shape, mean_axes)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, axis: str = "tp",
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0, mean_axes: tuple[str, ...] = (),
                                 vocab_size: int | None = None) -> torch.Tensor:
    """``F.cross_entropy`` of logits whose class dim (dim 1, or the last dim of 2-D
    logits) is sharded on ``axis``; the full logits are never gathered.

    Same semantics as ``F.cross_entropy`` for ``ignore_index``, ``reduction`` in
    {mean, sum, none} and ``label_smoothing`` (class weights are not supported).
    ``mean_axes``: axes the tokens are sharded on (context parallelism): the mean is
    over the tokens of all their ranks.
    ``vocab_size``: the global class count, needed
    where the axis does not divide it (GPT-2's 50257 on 4 ranks: ``torch.chunk`` pieces
    of 12565, 12565, 12565 and 12562 classes).
    """
    x, t = _rows(local_logits, target)
    # loss_i = logsumexp_i - x[i, t_i]: every term is replicated, so no grad sync is needed.
    lse = _log_sum_exp(x, axis, -1).squeeze(-1)
    per_token = lse - _pick(x, t, axis, vocab_size)
    if label_smoothing > 0.0:
        n_classes = vocab_size or x.size(-1) * collectives.axis_size(axis)
        smooth = lse - collectives.all_reduce(x.sum(-1), axis) / n_classes
        per_token = (1.0 - label_smoothing) * per_token + label_smoothing * smooth
    valid = t != ignore_index
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return _reduce(per_token, valid, reduction, target.shape, mean_axes)


def global_mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor, axes: tuple[str, ...], weight=None,
                              ignore_index: int = -100, label_smoothing: float = 0.0, nll: bool = False) -> torch.Tensor:
    """``F.cross_entropy(..., reduction="mean")`` (``F.nll_loss`` with ``nll=True``) of
    tokens sharded over ``axes`` (a context-parallel sequence): the mean over the
    tokens of all ranks, ``ignore_index`` targets and class weights counted globally.
    Replicated over ``axes``.

    Example: ``loss = fxshard.global_mean_cross_entropy(logits.flatten(0, 1), targets.flatten(), ("cp",))``
    """
    import torch.nn.functional as F

    if nll:
        total = F.nll_loss(logits, target, weight=weight, ignore_index=ignore_index, reduction="sum")
    else:
        total = F.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index, reduction="sum",
                                label_smoothing=label_smoothing)
    valid = target != ignore_index
    count = valid.sum() if weight is None else (weight[target.clamp(min=0)] * valid).sum()
    return _global_mean(total, count, axes)


for _fn in (vocab_parallel_log_softmax, vocab_parallel_nll_loss, vocab_parallel_cross_entropy, global_mean_cross_entropy):
    _fn.__module__ = "fxshard"
    torch.fx.wrap(_fn.__name__)
del _fn
