"""Expert parallelism: MoE blocks as opaque local regions with all-to-all dispatch.

An MoE block routes tokens with data-dependent shapes that no static layout rule can
describe, so fxshard keeps the whole block as one *local region*: a ``call_module``
node that runs on this rank's local tokens, whose output layout is declared by the
plan.  Inside the region, around the call of the experts, fxshard exchanges the
per-expert token counts, dispatches the tokens to the ranks that own their experts
(``all_to_all_single`` with uneven splits), runs the local experts and sends the
results back in the original order::

    plan = fxshard.Plan(mesh, {"layers.*.moe": fxshard.expert_parallel("ep")},
                        inputs={"tokens": {"ep": Shard(0)}})
    sharded = fxshard.transform(model, plan, example_inputs=(tokens,))
    print(fxshard.dump(sharded, recursive=True))   # the all-to-alls inside each block

The region's generated code reads::

    ep_exchange_counts = fxshard_ep_exchange_counts(bincount, 'ep')
    ep_dispatch = fxshard_ep_dispatch(getitem_5, bincount, ep_exchange_counts, 'ep')
    x_ep = ep_dispatch[0]
    counts_local = ep_dispatch[1]
    ep_plan = ep_dispatch[2]
    experts = self.experts(x_ep, counts_local)
    ep_combine = fxshard_ep_combine(experts, ep_plan, 'ep')

**The grouped experts convention.**  The child named by ``experts`` is called as
``experts(x, num_tokens_per_expert) -> y``: ``x`` is ``[T, D]`` tokens sorted by
expert, ``num_tokens_per_expert`` is ``[E]`` (the global number of experts), and its
weights are stacked with the expert dim first (``w1: [E, ...]``).  They are sharded
``Shard(0)`` over the axis: rank ``i`` keeps experts ``[i * E/ep, (i+1) * E/ep)`` and is
called with its tokens and counts for those experts only.

**Module-list experts** (Mixtral style: ``gate`` + ``experts: nn.ModuleList``): with
``router=`` fxshard runs the block itself (:func:`routed_forward`): ``router(module,
gate(x))`` picks the experts, the tokens are sorted by expert and the list is called
in the grouped convention through :class:`ExpertList`.  The list becomes an
``ExpertList`` keyed by the global expert index, and each rank keeps only its own
experts: rank ``i`` holds ``experts.{j}`` for its ``j``, under the single-device
``state_dict`` keys; the other experts are deleted from the rank (they live on their
owners), so ``full_state_dict`` returns only this rank's experts of such a list.

**Gradients.**  Dispatch and combine are ``autograd.Function`` s: the backward of the
dispatch is the reverse all-to-all of the token gradients, and vice versa.  Expert
weights get the gradient of every token routed to them, from every rank.  Replicated
parameters of the region (the router) get their gradients summed over the axes on
which the region's input is sharded, exactly like replicated parameters outside
regions: over a batch-sharded axis fxshard computes the gradient of the *sum* of the
per-rank losses (scale the loss by ``1 / ep`` for the mean).

**User compute functions.**  ``ModuleSpec(local=True, compute=fn)`` runs
``fn(module, *forward_args)`` instead of the module's forward, on local tensors;
:func:`check_compute_signature` checks ``fn`` against the forward at transform time.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import Placement, Shard

from fxshard.runtime import collectives
from fxshard.errors import PlanError, SignatureMismatchError
from fxshard.plan.specs import ModuleSpec

__all__ = [
    "expert_parallel",
    "ExpertParallelSpec",
    "SoftmaxTopK",
    "softmax_topk",
    "ExpertList",
    "routed_forward",
    "check_compute_signature",
    "ep_exchange_counts",
    "ep_dispatch",
    "ep_combine",
    "EPPlan",
]

_c10d = torch.ops._c10d_functional


# --------------------------------------------------------------------------- routers


@dataclass(frozen=True)
class SoftmaxTopK:
    """The default router: softmax over the gate logits in float32, top-k, renormalize.

    ``router(module, logits) -> (weights [T, k] float32, experts [T, k] int64)``;
    ``top_k=None`` reads ``module.top_k``.  Mixtral's routing, as in HF transformers.
    """

    top_k: int | None = None

    def __call__(self, module: nn.Module, logits: torch.Tensor):
        k = self.top_k if self.top_k is not None else module.top_k
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


def softmax_topk(top_k: int | None = None) -> SoftmaxTopK:
    """The default router (see :class:`SoftmaxTopK`).

    Example: ``expert_parallel("ep", router=softmax_topk(2))``
    """
    return SoftmaxTopK(top_k)


# --------------------------------------------------------------------------- the preset


@dataclass(repr=False)
class ExpertParallelSpec(ModuleSpec):
    """A :class:`ModuleSpec` for an expert-parallel MoE block (see :func:`expert_parallel`)."""

    axis: str = "ep"
    experts: str = "experts"
    router: Callable | None = None
    gate: str = "gate"

    def __repr__(self) -> str:
        parts = [repr(self.axis), f"experts={self.experts!r}"]
        if self.router is not None:
            parts += [f"router={self.router!r}", f"gate={self.gate!r}"]
        return f"expert_parallel({', '.join(parts)}) [inputs={self.in_src}, out={self.out_dst}]"

    def region_layouts(self, module: nn.Module, fqn: str, axes: dict[str, int]) -> tuple[dict, dict]:
        """``({relative param name: layout}, {relative child name: (axis, index)})``:
        grouped expert weights are ``Shard(0)``; module-list experts are owned by one rank."""
        where = f"expert_parallel on module {fqn!r}"
        experts = _submodule(module, self.experts)
        if not isinstance(experts, nn.Module):
            children = [n for n, _ in module.named_modules() if n]
            raise PlanError(f"{where}: the module has no submodule {self.experts!r} (it has {children[:8]}); "
                            f"pass experts= the (dotted) name of its experts module")
        n = axes[self.axis]
        if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
            return {}, self._list_owners(module, experts, n, where)
        return self._stacked_layouts(experts, n, where), {}

    def _list_owners(self, module, experts, n, where) -> dict:
        if self.router is None:
            raise PlanError(f"{where}: {self.experts!r} is a list of {len(experts)} expert modules, so fxshard runs the "
                            f"block itself and needs its router: expert_parallel({self.axis!r}, router=fxshard.softmax_topk(k))")
        if not isinstance(getattr(module, self.gate, None), nn.Module):
            raise PlanError(f"{where}: the block has no gate module {self.gate!r}; pass gate= the name of its router linear")
        if len(experts) % n:
            raise PlanError(f"{where}: {len(experts)} experts cannot be split evenly over axis {self.axis!r} of size {n}; "
                            f"use a number of experts divisible by {n}")
        per_rank = len(experts) // n
        names = [str(i) for i in range(len(experts))] if isinstance(experts, nn.ModuleList) else list(experts.keys())
        return {f"{self.experts}.{name}": (self.axis, i // per_rank) for i, name in enumerate(names)}

    def _stacked_layouts(self, experts, n, where) -> dict:
        tensors = list(experts.named_parameters()) + list(experts.named_buffers())
        if not tensors:
            raise PlanError(f"{where}: {self.experts!r} has no parameters to shard")
        n_experts = tensors[0][1].shape[0] if tensors[0][1].dim() else 0
        for name, t in tensors:
            if t.dim() == 0 or t.shape[0] != n_experts:
                raise PlanError(f"{where}: {self.experts}.{name} has shape {tuple(t.shape)}, but grouped experts stack "
                                f"their weights with the expert dim first ({n_experts} experts, from "
                                f"{self.experts}.{tensors[0][0]}); stack every weight as [num_experts, ...]")
        if n_experts % n:
            raise PlanError(f"{where}: {n_experts} experts cannot be split evenly over axis {self.axis!r} of size {n}; "
                            f"use a number of experts divisible by {n}")
        return {f"{self.experts}.{name}": {self.axis: Shard(0)} for name, _ in tensors}

    def n_experts(self, module: nn.Module) -> int:
        experts = module.get_submodule(self.experts)
        if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
            return len(experts)
        return next(iter(experts.parameters())).shape[0]


def expert_parallel(axis: str = "ep", *, experts: str = "experts", inputs: Placement = Shard(0),
                    out: Placement = Shard(0), router: Callable | None = None, gate: str = "gate") -> ExpertParallelSpec:
    """Expert-parallel MoE block: an opaque local region whose experts are split over ``axis``.

    The block runs on this rank's tokens (``Shard(0)`` over ``axis`` on entry: the
    batch); its router and token permutation are the user's code.  Around the call
    ``experts(x, num_tokens_per_expert)`` (grouped convention, see :mod:`fxshard.moe`)
    fxshard exchanges counts, dispatches tokens to the experts' ranks and combines the
    results back.  ``inputs`` is the layout the block's input arrives in on ``axis``
    (``Replicate()``: each rank takes its chunk), ``out`` the layout on exit.

    ``router=`` (for ``gate`` + ``experts: nn.ModuleList`` blocks, Mixtral style): fxshard
    runs the block itself, ``router(module, gate(x)) -> (weights, experts)``;
    :func:`softmax_topk` is the default (softmax in float32, top-k, renormalize), and
    the output is the routing-weighted sum of the experts' outputs.

    Example::

        plan = fxshard.Plan(mesh, {"layers.*.moe": fxshard.expert_parallel("ep")},
                            inputs={"tokens": {"ep": Shard(0)}})
        plan = fxshard.Plan(mesh, {"layers.*.block_sparse_moe":
                                   fxshard.expert_parallel("ep", router=fxshard.softmax_topk(2))}, ...)
    """
    return ExpertParallelSpec(
        inputs={axis: Shard(0)},
        in_src={axis: inputs},
        out_src={axis: Shard(0)},
        out_dst={axis: out},
        local=True,
        style="expert_parallel",
        axis=axis,
        experts=experts,
        router=router,
        gate=gate,
    )


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    """``module``'s descendant at the dotted ``name`` (torchtitan nests its grouped
    experts: ``routed_experts.inner_experts``), ``None`` if there is none."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


# --------------------------------------------------------------------------- module-list experts


class ExpertList(nn.ModuleDict):
    """A list of expert modules called in the grouped convention
    ``experts(x, num_tokens_per_expert) -> y``.

    Keys are global expert indices (``"0"``, ``"1"``, ...), so ``state_dict`` keys are
    those of the ``nn.ModuleList`` it replaces; an expert-parallel rank keeps only its
    own experts, in index order, and gets counts for those only.

    Example::

        experts = ExpertList.from_list(block.experts)
        y = experts(x_sorted_by_expert, torch.bincount(expert_ids, minlength=len(experts)))
    """

    @classmethod
    def from_list(cls, experts: nn.ModuleList) -> "ExpertList":
        return cls({str(i): m for i, m in enumerate(experts)})

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        sizes = num_tokens_per_expert.tolist()
        if len(sizes) != len(self):
            raise ValueError(f"ExpertList holds {len(self)} experts ({list(self.keys())}) but got counts for {len(sizes)}")
        outs = [expert(chunk) for expert, chunk in zip(self.values(), torch.split(x, sizes))]
        return torch.cat(outs) if outs else x


def routed_forward(spec: ExpertParallelSpec, n_experts: int) -> Callable:
    """The forward fxshard runs for an ``expert_parallel(router=...)`` block.

    ``forward(module, x)``: flatten the tokens, ``router(module, gate(x))``, sort the
    (token, choice) pairs by expert, call ``experts(x_sorted, counts)`` and add each
    result, scaled by its routing weight, to its token.  Traceable by torch.fx, so the
    all-to-alls that expert parallelism inserts around the experts call are graph nodes.
    """
    router, gate, experts = spec.router, spec.gate, spec.experts

    def forward(module, x):
        h = x.reshape(-1, x.shape[-1])
        weights, selected = router(module, getattr(module, gate)(h))
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_experts)
        token = order // selected.shape[-1]
        y = getattr(module, experts)(h[token], counts)
        y = y * weights.reshape(-1, 1)[order].to(y.dtype)
        return torch.zeros_like(h).index_add(0, token, y).view_as(x)

    return forward


# --------------------------------------------------------------------------- compute signature


def check_compute_signature(module: nn.Module, fn: Callable, fqn: str = "") -> None:
    """Check a region's compute function ``fn(module, *forward_args)`` against the
    module's forward; ``SignatureMismatchError`` (a PlanError and a TypeError) naming the parameter on the first violation.

    Rules: no ``*args``/``**kwargs``; every parameter after the module is a parameter
    of the forward; the positional ones are an in-order subsequence of the forward's
    positional parameters; every required forward parameter is accepted.

    Example::

        def fn(block, x, mask=None): ...          # Block.forward(self, x, mask=None)
        check_compute_signature(block, fn)        # ok
    """
    where = f"compute function {getattr(fn, '__qualname__', fn)!r} of local region {fqn!r}" if fqn else \
        f"compute function {getattr(fn, '__qualname__', fn)!r}"
    fwd = inspect.signature(module.forward).parameters
    fwd_name = f"{type(module).__name__}.forward{inspect.signature(module.forward)}"
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise SignatureMismatchError(f"{where}: its first parameter must be the module (fn(module, *forward_args))")
    own = params[1:]
    for p in own:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            star = "*" if p.kind is inspect.Parameter.VAR_POSITIONAL else "**"
            raise SignatureMismatchError(f"{where}: parameter '{star}{p.name}' is not allowed; name the forward parameters it takes, as in {fwd_name}")
    for p in own:
        if p.name not in fwd:
            raise SignatureMismatchError(f"{where}: parameter {p.name!r} is not a parameter of {fwd_name}")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    fwd_order = [n for n, q in fwd.items() if q.kind in positional]
    last = -1
    for p in own:
        if p.kind not in positional:
            continue
        if p.name not in fwd_order:
            raise SignatureMismatchError(f"{where}: positional parameter {p.name!r} is keyword-only in {fwd_name}; make it keyword-only (after *)")
        idx = fwd_order.index(p.name)
        if idx < last:
            raise SignatureMismatchError(f"{where}: positional parameter {p.name!r} comes after {fwd_order[last]!r}, but {fwd_name} "
                            f"takes it before; keep the forward's order")
        last = idx
    names = {p.name for p in own}
    for name, q in fwd.items():
        required = q.default is inspect.Parameter.empty and q.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if required and name not in names:
            raise SignatureMismatchError(f"{where}: it does not accept {name!r}, a required parameter of {fwd_name}")


# --------------------------------------------------------------------------- runtime: dispatch / combine


class EPPlan:
    """What one dispatch did, for the matching combine: rows sent to / received from
    each rank, and the permutation from (source rank, expert) to (expert, source rank)
    order of the received rows."""

    __slots__ = ("send", "recv", "perm")

    def __init__(self, send: list[int], recv: list[int], perm: torch.Tensor):
        self.send, self.recv, self.perm = send, recv, perm

    def __repr__(self) -> str:
        return f"EPPlan(send={self.send}, recv={self.recv})"


def _no_simulation(op: str) -> None:
    if enabled_local_tensor_mode() is not None:
        raise NotImplementedError(
            f"fxshard.{op}: expert-parallel all-to-alls have data-dependent, uneven splits that simulated ranks "
            f"(LocalTensorMode) cannot run; run expert parallelism on real ranks (e.g. tests/harness.spawn with gloo)")


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], ax) -> torch.Tensor:
    """Uneven all-to-all along dim 0: ``in_splits[j]`` rows go to rank ``j``."""
    if ax.size == 1:
        return x
    return _c10d.wait_tensor(_c10d.all_to_all_single(x.contiguous(), out_splits, in_splits, ax.group_name))


class _Dispatch(torch.autograd.Function):
    """Tokens to the experts' ranks, regrouped by local expert.  Backward: the
    gradients go back the reverse way."""

    @staticmethod
    def forward(ctx, x, ax, plan):
        ctx.ax, ctx.plan = ax, plan
        return _all_to_all(x, plan.recv, plan.send, ax).index_select(0, plan.perm)

    @staticmethod
    def backward(ctx, g):
        p = ctx.plan
        g_by_source = torch.empty_like(g).index_copy_(0, p.perm, g)
        return _all_to_all(g_by_source, p.send, p.recv, ctx.ax), None, None


class _Combine(torch.autograd.Function):
    """Expert outputs back to the tokens' ranks, in the original order.  Backward:
    the gradients go to the experts' ranks, regrouped like the dispatch."""

    @staticmethod
    def forward(ctx, y, ax, plan):
        ctx.ax, ctx.plan = ax, plan
        y_by_source = torch.empty_like(y).index_copy_(0, plan.perm, y)
        return _all_to_all(y_by_source, plan.send, plan.recv, ax)

    @staticmethod
    def backward(ctx, g):
        p = ctx.plan
        return _all_to_all(g, p.recv, p.send, ctx.ax).index_select(0, p.perm), None, None


def ep_exchange_counts(counts: torch.Tensor, axis: str) -> torch.Tensor:
    """All-to-all of the per-expert token counts.

    ``counts``: ``[E]``, this rank's tokens per (global) expert.  Returns ``[ep, E/ep]``:
    row ``j`` is the number of tokens rank ``j`` sends to each of this rank's experts.
    No gradient.
    """
    ax = collectives.comm_axis(axis, "ep_exchange_counts")
    _no_simulation("ep_exchange_counts")
    counts = counts.reshape(-1)
    if counts.numel() % ax.size:
        raise ValueError(f"fxshard.ep_exchange_counts: {counts.numel()} experts do not split evenly over axis {axis!r} of size {ax.size}")
    per_rank = counts.numel() // ax.size
    recv = _all_to_all(counts.to(torch.int64), [per_rank] * ax.size, [per_rank] * ax.size, ax)
    return recv.view(ax.size, per_rank)


def ep_dispatch(x: torch.Tensor, counts: torch.Tensor, counts_ep: torch.Tensor, axis: str):
    """Send the tokens to the ranks that own their experts.

    ``x``: ``[T, D]`` tokens sorted by global expert; ``counts``: ``[E]``;
    ``counts_ep``: the result of :func:`ep_exchange_counts`.  Returns ``(x_ep,
    local_counts, plan)``: the tokens this rank's experts process, grouped by local
    expert (from every rank), their counts per local expert, and the
    :class:`EPPlan` that :func:`ep_combine` needs.  Backward: the reverse all-to-all.
    """
    ax = collectives.comm_axis(axis, "ep_dispatch")
    _no_simulation("ep_dispatch")
    n, per_rank = counts_ep.shape
    send, recv = torch.stack([counts.reshape(n, per_rank).sum(1), counts_ep.sum(1)]).tolist()
    if torch.compiler.is_compiling():  # the splits are unbacked sizes there: assert, do not branch on them
        torch._check(x.size(0) == sum(send), lambda: "fxshard.ep_dispatch: the token count and the counts differ")
    elif x.size(0) != sum(send):
        raise ValueError(f"fxshard.ep_dispatch: {x.size(0)} tokens but the counts add up to {sum(send)}")
    # Received rows come by source rank, then expert; the experts want them by expert.
    # (each received row's (source rank, expert) segment, by a search: no data-dependent output shape)
    bounds = counts_ep.reshape(-1).to(x.device).cumsum(0)
    segment = torch.searchsorted(bounds, torch.arange(sum(recv), device=x.device), right=True)
    perm = torch.argsort((segment % per_rank) * n + segment // per_rank, stable=True)
    plan = EPPlan(send, recv, perm)
    return _Dispatch.apply(x, ax, plan), counts_ep.sum(0), plan


def ep_combine(y: torch.Tensor, plan: EPPlan, axis: str) -> torch.Tensor:
    """Send the experts' outputs back to the tokens' ranks, in the order the tokens
    had before :func:`ep_dispatch`.  Backward: the gradients go the dispatch's way."""
    ax = collectives.comm_axis(axis, "ep_combine")
    _no_simulation("ep_combine")
    return _Combine.apply(y, ax, plan)


torch.fx.wrap("ep_exchange_counts")
torch.fx.wrap("ep_dispatch")
torch.fx.wrap("ep_combine")

# Generated code names them ``fxshard_ep_dispatch(...)`` (the package re-exports them).
for _op in (ep_exchange_counts, ep_dispatch, ep_combine):
    _op.__module__ = "fxshard"
del _op


# --------------------------------------------------------------------------- opaque regions at run time


def swap_forward(module: nn.Module, make_forward: Callable[[Callable], Callable]) -> nn.Module:
    """Give ``module`` (in place) a forward built from its current one, keeping its
    parameters, children and FQNs: its class becomes a subclass of the same name."""
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {"forward": make_forward(cls.forward), "__module__": cls.__module__})
    return module


def with_grad_sync(syncs: dict[str, tuple[str, ...]]) -> Callable[[Callable], Callable]:
    """Forward wrapper: the named parameters enter through ``grad_sync`` on the given
    axes (identity forward, all-reduce of the gradient backward)."""
    from torch.nn.utils.stateless import _reparametrize_module

    def make(base):
        def forward(self, *args, **kwargs):
            synced = {}
            for name, axes in syncs.items():
                t = self.get_parameter(name)
                for axis in axes:
                    t = collectives.grad_sync(t, axis)
                synced[name] = t
            with _reparametrize_module(self, synced):
                return base(self, *args, **kwargs)

        return forward

    return make


def with_compute(fn: Callable) -> Callable[[Callable], Callable]:
    """Forward wrapper: the region runs ``fn(module, ...)`` instead of its forward."""

    def make(base):
        def forward(self, *args, **kwargs):
            return fn(self, *args, **kwargs)

        return forward

    return make


def around_experts(axis: str) -> Callable[[Callable], Callable]:
    """Forward wrapper for an experts module that a region could not show as a graph
    node: count exchange, dispatch, local experts, combine."""

    def make(base):
        def forward(self, x, num_tokens_per_expert):
            counts_ep = ep_exchange_counts(num_tokens_per_expert, axis)
            x_ep, local_counts, plan = ep_dispatch(x, num_tokens_per_expert, counts_ep, axis)
            return ep_combine(base(self, x_ep, local_counts), plan, axis)

        return forward

    return make
