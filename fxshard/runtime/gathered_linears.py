"""Column-parallel linears on a sequence-sharded input, Megatron's way: the input is
all-gathered for the matmuls, and *this rank's shard* is what the backward keeps.

Under sequence parallelism a block's q|k|v (and gate|up) projections read one input
gathered over the tensor axis: ``all_gather(x, "tp", 1, grad="partial")`` then a
``linear`` per weight.  Autograd would keep the gathered input (the whole sequence, on
every tp rank) for the weights' gradients; Megatron's ``LinearWithGradAccumulation``
keeps the local shard and gathers it again in the backward, so a tp rank keeps ``1/tp``
of it.  :func:`gathered_linears` is that, for every linear that reads the gathered value
(one gather forward, one again backward, one reduce-scatter of the input's gradient)::

    q, k, v = fxshard.gathered_linears(x, "tp", 1, [wq, wk, wv])     # x: [B, S/tp, H]

The numbers are those of the unfused program: under autocast the input, weights and
biases are cast as ``F.linear`` casts them (the gather then moves the cast input: the
same values, in half the bytes for bf16), and the gradients come back in their tensors'
dtypes.  ``passes/fuse_gathered_linears.py`` writes the calls; ``fxshard.comm_summary`` lists
their three collectives (docs/design.md §6).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from fxshard.runtime import collectives

__all__ = ["gathered_linears"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run ``F.linear`` in here, or None (no autocast)."""
    device = x.device.type
    if device != "meta" and x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


# a dtype of the same width to move a float dtype's bits as (one gloo and NCCL both gather)
_SAME_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.float16, torch.float16: torch.bfloat16,
              torch.float64: torch.int64}


def _gather_again(local: torch.Tensor, dim: int, ax) -> torch.Tensor:
    """The backward's gather of the shard the forward gathered.  It moves the shard's bits as
    another dtype: the same bytes, but a tensor no compiler pass takes for the forward's gather
    (inductor's CSE would merge the two gathers and keep the whole input for the backward)."""
    bits = _SAME_BITS.get(local.dtype)
    if bits is None:
        return collectives.raw_all_gather(local, dim, ax)
    return collectives.raw_all_gather(local.view(bits), dim, ax).view(local.dtype)


class _GatheredLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax, dim, n, *params):
        weights, biases = params[:n], params[n:]
        dtype = _compute_dtype(x)
        local = _cast(x, dtype)
        full = collectives.raw_all_gather(local, dim, ax)
        outs = tuple(F.linear(full, _cast(w, dtype), _cast(b, dtype)) for w, b in zip(weights, biases))
        ctx.ax, ctx.dim, ctx.n, ctx.dtype, ctx.x_dtype = ax, dim, n, dtype, x.dtype
        ctx.save_for_backward(local, *weights)  # a bias's gradient needs its dtype only
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in biases)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        local, *weights = ctx.saved_tensors
        full = _gather_again(local, ctx.dim, ctx.ax)  # the shard kept, gathered again
        rows = full.reshape(-1, full.shape[-1])
        needs_x = ctx.needs_input_grad[0]
        gx = None
        gws, gbs = [], []
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:
                gws.append(None)
                gbs.append(None)
                continue
            g_rows = g.reshape(-1, g.shape[-1])
            if needs_x:
                part = (g @ _cast(w, ctx.dtype)).to(ctx.x_dtype)
                gx = part if gx is None else gx + part
            gws.append((g_rows.t() @ rows).to(w.dtype) if ctx.needs_input_grad[4 + i] else None)
            b_dtype = ctx.bias_dtypes[i]
            gbs.append(g_rows.sum(0).to(b_dtype) if b_dtype is not None and ctx.needs_input_grad[4 + ctx.n + i] else None)
        gx_local = collectives.raw_reduce_scatter(gx, ctx.dim, ctx.ax) if gx is not None else None
        return (gx_local, None, None, None, *gws, *gbs)


def gathered_linears(x: torch.Tensor, axis: str, dim: int, weights: Sequence[torch.Tensor],
                     biases: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
    """``F.linear(all_gather(x, axis, dim), w, b)`` for each weight, keeping only ``x``
    (this rank's shard) for the backward, which gathers it again.  The backward
    reduce-scatters the input's gradient over ``axis`` (a gather with ``grad="partial"``:
    the linears' weights are sharded on ``axis``, so each rank's input gradient is a share).

    Example::

        q, k, v = fxshard.gathered_linears(x, "tp", 1, [wq, wk, wv])
    """
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"fxshard.gathered_linears: {len(weights)} weights and {len(biases)} biases")
    ax = collectives.comm_axis(axis, "gathered_linears")
    dim = dim % x.dim()
    if ax.size == 1:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    return _GatheredLinears.apply(x, ax, dim, len(weights), *weights, *biases)


torch.fx.wrap("gathered_linears")
gathered_linears.__module__ = "fxshard"  # reads as ``fxshard_gathered_linears(...)`` in generated code
