"""Context parallelism at run time: attention over a sequence sharded across ranks.

The ``context_parallel`` pass rewrites the attention of a context-parallel module
(:func:`fxshard.context_parallel`) into calls of this module; the rest of the model
runs on each rank's part of the sequence as it is (everything but attention is
token-wise).  Which global positions a rank holds is fixed per mesh axis:

* contiguous (``load_balance=False``): rank ``i`` of ``n`` holds ``i*T/n : (i+1)*T/n``;
* load-balanced (``load_balance=True``): the sequence is cut into ``2n`` chunks and
  rank ``i`` holds chunks ``i`` and ``2n-1-i``, so that every rank does the same causal
  work (rank 0 holds the first and the last chunk).

Everything here computes positions from the rank's index on the axis and the local
length at run time: the generated code is the same on every rank.

==========================  ===================================================
op                          what it does
==========================  ===================================================
``local_positions``         global positions of this rank's tokens
``context_parallel_mask``   the mask of local queries against the gathered keys
``ring_attention``          attention with K/V blocks passed around the ring
``split_sequence``          this rank's part of a global tensor (its inputs)
``gather_sequence``         the global tensor from every rank's part
``sliding_window_rows``     this rank's rows of a sliding-window causal mask
==========================  ===================================================

Example (the all-gather method, as the pass writes it)::

    k_all = fxshard.all_gather(k, "cp", 2, grad="partial")    # backward: reduce-scatter
    v_all = fxshard.all_gather(v, "cp", 2, grad="partial")
    mask = fxshard.context_parallel_mask(q, "cp", load_balance=True)
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx
from torch.distributed._local_tensor import LocalIntNode, enabled_local_tensor_mode
from torch.distributed.tensor import Shard

from fxshard.layout.op_rules.context import R, Ctx
from fxshard.layout.op_rules.numbers import number_axes, sharded_source
from fxshard.layout.op_rules.table import register_rule
from fxshard.meta import Rewrite, program_meta
from fxshard.runtime import collectives
from fxshard.runtime.collectives import bound_mesh, comm_axis, local_index, mesh_axis

_c10d = torch.ops._c10d_functional

__all__ = ["local_positions", "context_parallel_mask", "ring_attention", "split_sequence", "gather_sequence",
           "sliding_window_mask", "sliding_window_rows"]


# --------------------------------------------------------------------------- positions


def _positions_of(index: int, n_local: int, n: int, load_balance: bool, device=None) -> torch.Tensor:
    """Global positions held by the rank at ``index`` of ``n`` (``n_local`` tokens)."""
    if not load_balance:
        return torch.arange(index * n_local, (index + 1) * n_local, device=device)
    if n_local % 2:
        raise ValueError(f"fxshard: a load-balanced context-parallel rank holds two equal chunks, but its part of the "
                         f"sequence has {n_local} tokens; use a sequence length divisible by {2 * n} (2 x the axis size)")
    c = n_local // 2
    return torch.cat([torch.arange(index * c, (index + 1) * c, device=device),
                      torch.arange((2 * n - 1 - index) * c, (2 * n - index) * c, device=device)])


def _all_positions(n_local: int, n: int, load_balance: bool, device=None) -> torch.Tensor:
    """Global positions of the tokens of a tensor gathered in rank order."""
    if not load_balance:
        return torch.arange(n_local * n, device=device)
    return torch.cat([_positions_of(i, n_local, n, True, device) for i in range(n)])


def _per_rank(axis: str, fn):
    """``fn(index_on_axis)``: a tensor, or under simulated ranks a LocalTensor of each
    rank's ``fn(its index)`` (SymInt arithmetic with tensors is not simulated)."""
    ax = mesh_axis(axis)
    lm = enabled_local_tensor_mode()
    if lm is None:
        return fn(int(local_index(ax)))
    ints = bound_mesh().get_local_rank(axis).node._local_ints
    return lm.rank_map(lambda r: fn(ints[r]))


def local_positions(axis: str, n_local: int, *, load_balance: bool = False, device=None) -> torch.Tensor:
    """Global positions (int64, ``[n_local]``) of this rank's tokens on ``axis``.

    Example: at ``cp=2`` with ``load_balance=True`` and 4 local tokens of 8, rank 0
    holds ``[0, 1, 6, 7]`` and rank 1 ``[2, 3, 4, 5]``.
    """
    n = mesh_axis(axis).size
    return _per_rank(axis, lambda i: _positions_of(i, n_local, n, load_balance, device))


# --------------------------------------------------------------------------- all-gather method


def context_parallel_mask(q: torch.Tensor, axis: str, *, load_balance: bool = False, is_causal: bool = True,
                          attn_mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The attention mask of this rank's queries (``q [..., T_local, D]``) against the
    keys gathered over ``axis`` in rank order (``[..., T_local * n, D]``).

    ``is_causal``: a query attends to keys at global positions up to its own.
    ``attn_mask``: the model's own mask for these queries, its key dim in global
    order (``[..., T_local or 1, T]``, boolean or additive); its columns are put in
    the gathered order.  Returns a boolean mask, an additive one if ``attn_mask`` is,
    or None when there is nothing to mask.
    """
    n = mesh_axis(axis).size
    t = q.size(-2)
    kv = _all_positions(t, n, load_balance, q.device)
    mask = None
    if attn_mask is not None:
        mask = attn_mask.index_select(-1, kv) if load_balance and n > 1 else attn_mask
    if not is_causal:
        return mask
    q_pos = _per_rank(axis, lambda i: _positions_of(i, t, n, load_balance, q.device))
    causal = q_pos[:, None] >= kv[None, :]
    if mask is None:
        return causal
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


# --------------------------------------------------------------------------- ring method


def _ring_shift(x: torch.Tensor, ax) -> torch.Tensor:
    """Send ``x`` to the next rank on the axis and receive the previous rank's (one
    all-to-all whose only non-empty piece goes to the neighbour)."""
    n = ax.size
    flat = x.contiguous().view(-1)
    numel = flat.numel()

    def splits(index: int):
        to_next = [numel if j == (index + 1) % n else 0 for j in range(n)]
        from_prev = [numel if j == (index - 1) % n else 0 for j in range(n)]
        return to_next, from_prev

    if enabled_local_tensor_mode() is None:
        send, recv = splits(int(local_index(ax)))
    else:  # per-rank split sizes as SymInts of the simulated ranks
        ints = bound_mesh().get_local_rank(ax.name).node._local_ints
        per = {r: splits(i) for r, i in ints.items()}
        send = [torch.SymInt(LocalIntNode({r: s[0][j] for r, s in per.items()})) for j in range(n)]
        recv = [torch.SymInt(LocalIntNode({r: s[1][j] for r, s in per.items()})) for j in range(n)]
    out = _c10d.wait_tensor(_c10d.all_to_all_single(flat, recv, send, ax.group_name))
    return out.view(x.shape)


def _block_bias(q_pos, k_pos, is_causal: bool, mask_cols: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """Additive bias (0 / -inf, or the model's float mask) of one block of scores."""
    bias = None
    if mask_cols is not None:
        bias = torch.zeros(mask_cols.shape, dtype=dtype, device=mask_cols.device).masked_fill(~mask_cols, float("-inf")) \
            if mask_cols.dtype == torch.bool else mask_cols.to(dtype)
    if is_causal:
        causal = torch.zeros((q_pos.numel(), k_pos.numel()), dtype=dtype, device=q_pos.device).masked_fill(
            q_pos[:, None] < k_pos[None, :], float("-inf"))
        bias = causal if bias is None else bias + causal
    return bias


class _RingAttention(torch.autograd.Function):
    """Blockwise attention over K/V blocks visiting every rank of the axis.

    Forward: at step ``s`` this rank holds the K/V block of rank ``index - s``; the
    block's output and log-sum-exp are merged into the running ones (an online
    softmax), then the block moves on to the next rank.  Backward: the same ring, each
    block's gradients computed from the saved global output and log-sum-exp
    (FlashAttention's backward: nothing of size ``T x T`` is kept) with the dK/dV
    accumulators travelling with their block; one last hop brings them home.

    Where the rank is known (real ranks) and the mask is the causal one, each step
    computes only the part of the block below the diagonal: nothing above it, whole
    blocks below it without a mask, and under load balancing half a block off the
    diagonal (the first chunk of keys, or the last chunk of queries).  On CPU each
    block runs torch's fused flash kernel; elsewhere, or for an additive mask that
    needs its gradient, a float32 kernel written out here, a chunk of query rows at a
    time.
    """

    @staticmethod
    def forward(ctx, q, k, v, ax, attn_mask, is_causal, scale, load_balance, rep):
        n, t = ax.size, q.size(-2)
        index = None if enabled_local_tensor_mode() is not None else int(local_index(ax))
        mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
        fused = q.device.type == "cpu" and not mask_grad
        acc = _acc(q.dtype)
        q_pos = _per_rank(ax.name, lambda i: _positions_of(i, t, n, load_balance, q.device))
        out = torch.zeros(q.shape[:-1] + (v.size(-1),), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kb, vb = k, v
        for step in range(n):
            k_pos = _per_rank(ax.name, lambda i: _positions_of((i - step) % n, t, n, load_balance, q.device))
            for rows, cols, causal, bias in _visible(index, step, n, t, load_balance, is_causal, q_pos, k_pos, attn_mask, q.dtype):
                o_b, lse_b = _block_forward(q[..., rows, :], kb[..., cols, :], vb[..., cols, :], causal, bias, scale, rep, fused)
                out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], o_b, lse_b)
            if step + 1 < n:
                kb, vb = _ring_shift(kb, ax), _ring_shift(vb, ax)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, attn_mask if attn_mask is not None else torch.empty(0))
        ctx.ax, ctx.is_causal, ctx.scale, ctx.load_balance, ctx.rep = ax, is_causal, scale, load_balance, rep
        ctx.has_mask, ctx.index, ctx.fused = attn_mask is not None, index, fused
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        attn_mask = attn_mask if ctx.has_mask else None
        ax, n, t, rep = ctx.ax, ctx.ax.size, q.size(-2), ctx.rep
        dout = dout.contiguous()
        q_pos = _per_rank(ax.name, lambda i: _positions_of(i, t, n, ctx.load_balance, q.device))
        acc = _acc(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[4]
        dmask = torch.zeros(attn_mask.shape, dtype=acc, device=q.device) if mask_grad else None
        fused = ctx.fused and not mask_grad
        kb, vb = k, v
        for step in range(n):
            k_pos = _per_rank(ax.name, lambda i: _positions_of((i - step) % n, t, n, ctx.load_balance, q.device))
            parts = _visible(ctx.index, step, n, t, ctx.load_balance, ctx.is_causal, q_pos, k_pos, attn_mask, q.dtype)
            for rows, cols, causal, bias in parts:
                dq_b, dk_b, dv_b, dbias = _block_backward(
                    dout[..., rows, :], q[..., rows, :], kb[..., cols, :], vb[..., cols, :], out[..., rows, :],
                    lse[..., rows], causal, bias, ctx.scale, rep, fused, dmask is not None)
                dq[..., rows, :] += dq_b
                dk[..., cols, :] += dk_b
                dv[..., cols, :] += dv_b
                if dbias is not None:  # an additive mask enters the scores as they are: its gradient is dS
                    dmask = dmask.index_add(-1, k_pos, _sum_to(dbias, dmask.shape[:-1] + (dbias.size(-1),)))
            # the block and its accumulators move on; after the last step one hop brings them home
            if step + 1 < n:
                kb, vb = _ring_shift(kb, ax), _ring_shift(vb, ax)
            dk, dv = _ring_shift(dk, ax), _ring_shift(dv, ax)
        dmask = dmask.to(attn_mask.dtype) if dmask is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dmask, None, None, None, None


_ALL = slice(None)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring accumulates in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _visible(index, step, n, t, load_balance, is_causal, q_pos, k_pos, attn_mask, dtype):
    """The parts of step ``step``'s block that have visible keys: a list of ``(query rows,
    key columns, causal, additive bias or None)``; ``causal`` parts are square and
    diagonal (top-left aligned ``is_causal``).

    With the rank known and no model mask, the parts follow from the chunk layout and
    need no bias: contiguous, a block before ours is whole, ours is causal, later ones
    are skipped; load-balanced (our chunks ``a = i`` and ``b = 2n-1-i``, the block's
    ``j`` and ``2n-1-j``), a block with ``j < i`` is seen through its first chunk by all
    our queries, one with ``j > i`` whole by our second chunk, and ours is ``a->a``
    causal, ``b->a`` whole, ``b->b`` causal.  Otherwise (simulated ranks run in lock
    step; a model mask) the whole block with the bias of the positions."""
    if index is not None and attn_mask is None:
        if not is_causal:
            return [(_ALL, _ALL, False, None)]
        j = (index - step) % n
        if not load_balance:
            return [(_ALL, _ALL, j == index, None)] if j <= index else []
        h = t // 2
        first, second = slice(0, h), slice(h, None)
        if j == index:
            return [(first, first, True, None), (second, first, False, None), (second, second, True, None)]
        return [(_ALL, first, False, None)] if j < index else [(second, _ALL, False, None)]
    bias = _block_bias(q_pos, k_pos, is_causal, _cols(attn_mask, k_pos), dtype)
    return [(_ALL, _ALL, False, bias)]


def _dead_rows(bias):
    """Query rows whose every key is masked in this block (their block softmax is empty)."""
    return None if bias is None else ~(bias > float("-inf")).any(-1)


def _block_forward(q, k, v, causal, bias, scale, rep, fused):
    """``(out, lse)`` (in the accumulation dtype) of ``q`` attending to one block; rows
    that see no key of it get ``lse = -inf`` and a zero output."""
    acc = _acc(q.dtype)
    if fused:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _heads(k, rep), _heads(v, rep), 0.0, causal, attn_mask=bias, scale=scale)
        o, lse = o.to(acc), lse.to(acc)
    else:
        qf, kf, vf = q.to(acc), _heads(k.to(acc), rep), _heads(v.to(acc), rep)
        outs, lses = [], []
        for rows in _row_chunks(q.size(-2)):
            s = (qf[..., rows, :] @ kf.transpose(-2, -1)).mul_(scale)
            if bias is not None:
                s.add_(_mask_rows(bias, rows))
            if causal:
                s.add_(_causal_rows(rows, q.size(-2), s.device))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = s.sub_(m).exp_()
            l = p.sum(-1, keepdim=True)
            outs.append((p @ vf) / l)
            lses.append((m + l.log()).squeeze(-1))
        o, lse = torch.cat(outs, -2), torch.cat(lses, -1)
    dead = _dead_rows(bias)
    if dead is not None:
        lse = lse.masked_fill(dead, float("-inf"))
        o = o.masked_fill(dead.unsqueeze(-1), 0.0)
    return o, lse


def _merge(out, lse, o_b, lse_b):
    """Online-softmax merge of a block's (output, log-sum-exp) into the running ones."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return out * torch.exp(lse - safe).unsqueeze(-1) + o_b * torch.exp(lse_b - safe).unsqueeze(-1), new


def _block_backward(do, q, k, v, out, lse, causal, bias, scale, rep, fused, want_dbias):
    """Gradients of one block from the global output and log-sum-exp of its rows:
    ``(dq, dk, dv, d bias or None)``, in the accumulation dtype."""
    acc = _acc(q.dtype)
    if fused:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, _heads(k, rep), _heads(v, rep), out, lse.to(torch.float32) if q.dtype != torch.float64 else lse, 0.0,
            causal, attn_mask=bias, scale=scale)
        return dq.to(acc), _unheads(dk.to(acc), rep), _unheads(dv.to(acc), rep), None
    qf, kf, vf, dof, of = q.to(acc), _heads(k.to(acc), rep), _heads(v.to(acc), rep), do.to(acc), out.to(acc)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    dq = torch.zeros_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    dbias = []
    for rows in _row_chunks(q.size(-2)):
        qc, doc = qf[..., rows, :], dof[..., rows, :]
        s = (qc @ kf.transpose(-2, -1)).mul_(scale)
        if bias is not None:
            s.add_(_mask_rows(bias, rows))
        if causal:
            s.add_(_causal_rows(rows, q.size(-2), s.device))
        p = s.sub_(finite[..., rows, :]).exp_()  # the softmax probabilities of this block
        delta = (doc * of[..., rows, :]).sum(-1, keepdim=True)
        dv += p.transpose(-2, -1) @ doc
        ds = (doc @ vf.transpose(-2, -1)).sub_(delta).mul_(p)
        dq[..., rows, :] = (ds @ kf) * scale
        dk += (ds.transpose(-2, -1) @ qc) * scale
        if want_dbias:
            dbias.append(ds)
    return dq, _unheads(dk, rep), _unheads(dv, rep), torch.cat(dbias, -2) if want_dbias else None


_ROWS = 512  # query rows per chunk of the float32 block kernel: [B, H, 512, T/n] scores at a time


def _causal_rows(rows: slice, t: int, device) -> torch.Tensor:
    """The ``0 / -inf`` causal bias of query rows ``rows`` of a square ``t x t`` block."""
    r = torch.arange(t, device=device)[rows]
    return torch.zeros(r.numel(), t, device=device).masked_fill(r[:, None] < torch.arange(t, device=device)[None, :],
                                                               float("-inf"))


def _row_chunks(t: int):
    return [slice(r, min(r + _ROWS, t)) for r in range(0, t, _ROWS)]


def _mask_rows(attn_mask, rows):
    if attn_mask is None or attn_mask.size(-2) == 1:
        return attn_mask
    return attn_mask[..., rows, :]


def _sum_to(g: torch.Tensor, shape) -> torch.Tensor:
    """``g`` summed over the dims a tensor of ``shape`` was broadcast along."""
    lead = g.dim() - len(shape)
    g = g.sum(tuple(range(lead))) if lead else g
    dims = tuple(d for d, s in enumerate(shape) if s == 1 and g.size(d) != 1)
    return g.sum(dims, keepdim=True) if dims else g


def _heads(x, rep: int):
    """K/V heads repeated for grouped-query attention (``enable_gqa``)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def _unheads(g, rep: int):
    """Gradient of :func:`_heads`: the repeated heads' gradients summed."""
    if rep == 1:
        return g
    return g.unflatten(-3, (g.size(-3) // rep, rep)).sum(-3)


def _cols(attn_mask, k_pos):
    return None if attn_mask is None else attn_mask.index_select(-1, k_pos)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, *, attn_mask: Optional[torch.Tensor] = None,
                   is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                   load_balance: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``q, k, v`` sharded on the sequence dim
    (``-2``) over ``axis``, with K/V blocks passed around the ring.

    ``attn_mask``: the model's mask for this rank's queries, key dim in global order
    (``[..., T_local or 1, T]``).  Communication: ``n-1`` hops of K and V forward,
    ``n-1`` hops of K, V, dK, dV and one of dK, dV backward.  Memory: one block of
    scores at a time; the output and its log-sum-exp are kept for backward.

    Example: ``out = fxshard.ring_attention(q, k, v, "cp", is_causal=True)``
    """
    ax = comm_axis(axis, "ring_attention")
    rep = q.size(-3) // k.size(-3) if enable_gqa else 1
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if ax.size == 1:
        import torch.nn.functional as F
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    return _RingAttention.apply(q, k, v, ax, attn_mask, is_causal, scale, load_balance, rep)


# --------------------------------------------------------------------------- sliding windows


@torch.library.custom_op("fxshard::sliding_window_mask", mutates_args=())
def sliding_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """The ``[length, length]`` boolean mask of causal attention within a window: query
    ``q`` sees keys ``q - window < k <= q`` (transformers' ``sliding_window``).

    One graph node (a custom op) so that fxshard can lay it out: under context
    parallelism each rank builds the rows of its own positions
    (:func:`sliding_window_rows`), whole key rows in global order.
    """
    return _window(torch.arange(length, device=device), length, window, device)


@sliding_window_mask.register_fake
def _(length, window, device):
    return torch.empty((length, length), dtype=torch.bool, device=device)


# its layout rule, registered next to the op (as DTensor's op strategies are)
@register_rule(torch.ops.fxshard.sliding_window_mask.default)
def sliding_window_mask_layout(ctx: Ctx):
    """``fxshard::sliding_window_mask(length, window, device)``: ``[T, T]`` built from a
    length.  A length read from a dim sharded on one context-parallel axis gives each
    rank the rows of its positions (``Shard(0)`` there, whole key rows); ``localize``
    builds them (``Rewrite.WINDOW_ROWS``)."""
    length = ctx.arg(0)
    axes = number_axes(length) if isinstance(length, torch.fx.Node) else frozenset()
    if axes is None or len(axes) > 1 or (axes and next(iter(axes)) not in ctx.cp_axes):
        raise ctx.fail(f"a sliding-window mask sized by `{getattr(length, 'name', length)}`, read from {sharded_source(length)}",
                       "shard the sequence on a context-parallel axis (fxshard.context_parallel), or size the mask with a "
                       "length that is not sharded")
    if axes:
        ctx.request_rewrite(Rewrite.WINDOW_ROWS)
        (axis,) = axes
        return {a: Shard(0) if a == axis else R for a in ctx.axes}
    return {a: R for a in ctx.axes}


def _window(q_pos: torch.Tensor, length: int, window: int, device) -> torch.Tensor:
    k = torch.arange(length, device=device)[None, :]
    q = q_pos[:, None]
    return (k <= q) & (k > q - window)


def sliding_window_rows(axis: str, n_local: int, window: int, *, load_balance: bool = False, device=None) -> torch.Tensor:
    """This rank's rows (``[n_local, n_local * n]``, keys in global order) of
    :func:`sliding_window_mask` for a sequence sharded on ``axis``.

    Example: ``mask = fxshard.sliding_window_rows("cp", t_local, 4096, load_balance=True, device=x.device)``
    """
    n = mesh_axis(axis).size
    return _per_rank(axis, lambda i: _window(_positions_of(i, n_local, n, load_balance, device), n_local * n, window, device))


# --------------------------------------------------------------------------- inputs and outputs


def _load_balance_of(axis: str, load_balance: Optional[bool], sharded) -> bool:
    if load_balance is not None:
        return load_balance
    if sharded is not None:
        cp = (program_meta(sharded).context_parallel or {}).get(axis)
        if cp is not None:
            return cp["load_balance"]
    return True


def split_sequence(x: torch.Tensor, axis: str = "cp", dim: int = 1, *, load_balance: Optional[bool] = None,
                   sharded=None) -> torch.Tensor:
    """This rank's part of the global tensor ``x`` along ``dim`` (the sequence) on
    ``axis``: what a context-parallel model takes as input on this rank.

    ``load_balance``: as in the plan's :func:`fxshard.context_parallel` (or read from
    ``sharded``, the transformed module; default True).  Needs a bound mesh
    (``fxshard.transform`` binds one).

    Example: ``logits = sharded(fxshard.split_sequence(ids, "cp", sharded=sharded))``
    """
    lb = _load_balance_of(axis, load_balance, sharded)
    n = mesh_axis(axis).size
    d = dim % x.dim()
    if x.size(d) % (2 * n if lb else n):
        raise ValueError(f"fxshard.split_sequence: dim {d} of size {x.size(d)} does not divide into "
                         f"{2 * n if lb else n} chunks (axis {axis!r} of size {n}{', load-balanced' if lb else ''})")
    t = x.size(d) // n
    return _per_rank(axis, lambda i: x.index_select(d, _positions_of(i, t, n, lb, x.device)))


def gather_sequence(x: torch.Tensor, axis: str = "cp", dim: int = 1, *, load_balance: Optional[bool] = None,
                    sharded=None) -> torch.Tensor:
    """The global tensor from every rank's part along ``dim`` (the inverse of
    :func:`split_sequence`; an all-gather, differentiable).

    Example: ``full_logits = fxshard.gather_sequence(sharded(local_ids), "cp", sharded=sharded)``
    """
    lb = _load_balance_of(axis, load_balance, sharded)
    n = mesh_axis(axis).size
    d = dim % x.dim()
    full = collectives.all_gather(x, axis, d)
    if not lb or n == 1:
        return full
    order = _all_positions(x.size(d), n, True, x.device)
    return full.index_select(d, torch.argsort(order))


for _fn in (local_positions, context_parallel_mask, ring_attention, split_sequence, gather_sequence, sliding_window_rows):
    _fn.__module__ = "fxshard"
    torch.fx.wrap(_fn.__name__)
del _fn
