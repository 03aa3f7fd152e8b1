"""Routed experts: MoE experts that are called with the routing, HF transformers' convention.

transformers 5.x keeps a MoE block's experts as one module whose weights are stacked
per expert, called with the router's choice::

    experts(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]
    experts.gate_up_proj [E, 2I, H]   (gate | up, packed)      experts.down_proj [E, H, I]

(Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, ...).  The router, the shared experts and
the shared-expert gate around it are ordinary graph code that the rules propagate; only
the experts, whose loop over the experts that received tokens is data-dependent, are an
opaque local region (a ``call_module``) run on local tensors.

:func:`routed_experts` shards them over an expert axis, a tensor axis, or both::

    plan = fxshard.Plan(mesh, {"model.layers.*.mlp.experts": fxshard.routed_experts(ep="ep", tp="tp")})

* ``ep``: rank ``i`` keeps experts ``[i * E/ep, (i+1) * E/ep)`` (every stacked weight
  ``Shard(0)``).  Its experts run on every token that chose them; the routing of the
  others is pointed at the sentinel expert (index ``E/ep``, which HF's experts skip)
  with weight 0.  Each rank holds a share of the MoE output: ``Partial`` over ``ep``.
* ``tp``: every expert is sharded like a SwiGLU MLP, the packed ``gate_up_proj`` part by
  part on its output dim (each rank keeps its rows of gate and of up), ``down_proj`` on
  its input dim.  Again each rank holds a share of the output: ``Partial`` over ``tp``.

The tokens and the routing enter ``Replicate()`` on both axes (fxshard gathers them if
they arrive sharded), the output leaves ``Replicate()`` (one all-reduce, shown in the
graph and in :func:`fxshard.comm_summary`), and the gradients of the tokens and the
routing weights are summed over both axes (``grad_sync`` nodes, the backward of HF's
``moe_tp_experts``).  Zero-token experts are just experts nothing chose: the routing is
dropless, so the numbers are one device's.

Stacked weights are named by the HF convention; ``tp_dims`` says how each one is
sharded on ``tp`` when a model differs (Llama-4 stores them transposed).

Sharded, HF's experts run :func:`grouped_experts_forward` (whatever kernel their config
names): the rank's (token, choice) rows sorted by local expert and one grouped GEMM
(:func:`grouped_mm`) per stacked weight, never a gather of an expert's weights per row;
shapes only on the meta device, in any dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.layout.placements import DimBlocks
from fxshard.plan.specs import ModuleSpec

__all__ = ["routed_experts", "RoutedExpertsSpec", "HF_TP_DIMS", "grouped_mm", "grouped_experts_forward",
           "follows_hf_experts", "use_grouped_experts"]

# HF's layout of fused experts: {weight: (dim sharded on tp, number of packed parts)}.
# gate_up_proj [E, 2I, H] is colwise (its output rows, gate | up); down_proj [E, H, I]
# rowwise (its input columns); a bias follows its weight's output dim.
HF_TP_DIMS: dict[str, tuple[int, int]] = {"gate_up_proj": (1, 2), "down_proj": (2, 1), "up_proj": (1, 1)}


@dataclass(repr=False)
class RoutedExpertsSpec(ModuleSpec):
    """A :class:`ModuleSpec` for routed experts (see :func:`routed_experts`)."""

    ep: str | None = None
    tp: str | None = None
    tp_dims: Mapping[str, tuple[int, int]] | None = None
    tokens: Placement = Replicate()
    dispatch: str = "gather"

    def __repr__(self) -> str:
        parts = [f"{k}={getattr(self, k)!r}" for k in ("ep", "tp") if getattr(self, k)]
        if self.tokens != Replicate():
            parts.append(f"tokens={self.tokens!r}")
        if self.dispatch != "gather":
            parts.append(f"dispatch={self.dispatch!r}")
        if self.tp_dims is not None:
            parts.append(f"tp_dims={dict(self.tp_dims)!r}")
        return f"routed_experts({', '.join(parts)})"

    # -- what regions asks of a preset that reads its module ------------------------

    def region_layouts(self, module: nn.Module, fqn: str, axes: dict[str, int]) -> tuple[dict, dict]:
        """``({relative name: layout}, {})``: every stacked weight ``Shard(0)`` on ``ep``;
        on ``tp`` the dims of :data:`HF_TP_DIMS` (or ``tp_dims``)."""
        layouts: dict[str, dict] = {}
        for name, t, layout, _ in self._placements(module, fqn, axes):
            layouts[name] = layout
        return layouts, {}

    def region_blocks(self, module: nn.Module, fqn: str, axes: dict[str, int]) -> dict[str, DimBlocks]:
        """``{relative name: DimBlocks}``: the packed parts of a weight sharded on ``tp``."""
        return {name: blocks for name, _, _, blocks in self._placements(module, fqn, axes) if blocks is not None}

    def n_experts(self, module: nn.Module) -> int:
        tensors = _stacked(module)
        return tensors[0][1].shape[0] if tensors else 0

    def _placements(self, module, fqn, axes):
        where = f"routed_experts on module {fqn!r}"
        for axis in (self.ep, self.tp):
            if axis is not None and axis not in axes:
                raise PlanError(f"{where}: axis {axis!r} is not on the mesh (axes: {list(axes)}); pass ep=/tp= mesh axes")
        tensors = _stacked(module)
        if not tensors:
            raise PlanError(f"{where}: {type(module).__name__} has no parameters; routed experts stack their weights "
                            f"as [num_experts, ...]")
        n_experts = tensors[0][1].shape[0]
        for name, t in tensors:
            if t.dim() < 2 or t.shape[0] != n_experts:
                raise PlanError(f"{where}: {name} has shape {tuple(t.shape)}, but routed experts stack every weight "
                                f"with the expert dim first ({n_experts} experts, from {tensors[0][0]}); "
                                f"shard this module with a hand-written ModuleSpec")
        if self.ep is not None and n_experts % axes[self.ep]:
            raise PlanError(f"{where}: {n_experts} experts cannot be split evenly over axis {self.ep!r} of size "
                            f"{axes[self.ep]}; use a number of experts divisible by {axes[self.ep]}")
        dims = dict(HF_TP_DIMS if self.tp_dims is None else self.tp_dims)
        out = []
        for name, t in tensors:
            layout = {self.ep: Shard(0)} if self.ep is not None else {}
            blocks = None
            if self.tp is not None:
                dim, parts = self._tp_dim(name, t, dims, where)
                n = axes[self.tp]
                size = t.shape[dim]
                if size % parts or (size // parts) % n:
                    raise PlanError(f"{where}: dim {dim} of {name} {tuple(t.shape)} is {parts} part(s) of {size // parts}, "
                                    f"which axis {self.tp!r} of size {n} does not divide; use a tp size that divides "
                                    f"the expert width, or shard the experts over ep only")
                layout[self.tp] = Shard(dim)
                blocks = DimBlocks(dim, (size // parts,) * parts) if parts > 1 else None
            out.append((name, t, layout, blocks))
        return out

    def _tp_dim(self, name: str, t: torch.Tensor, dims: dict, where: str) -> tuple[int, int]:
        if name in dims:
            dim, parts = dims[name]
            return (dim + t.dim() if dim < 0 else dim), parts
        weight = name[: -len("_bias")] if name.endswith("_bias") else None
        if weight in dims and t.dim() == 2:
            wdim, parts = dims[weight]
            # a bias [E, out] follows its weight's output rows; one on the input side is a whole vector per rank
            if (wdim + 3 if wdim < 0 else wdim) == 1:
                return 1, parts
            raise PlanError(f"{where}: {name} is the bias of {weight}, which is sharded on its input dim over {self.tp!r}: "
                            f"every rank would add the whole bias to its share of the output; shard the experts over "
                            f"ep only")
        raise PlanError(f"{where}: fxshard does not know how to shard {name} {tuple(t.shape)} over {self.tp!r} (it knows "
                        f"{sorted(dims)}); pass tp_dims={{{name!r}: (dim, parts)}}")


def _stacked(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if b.dim() > 0]


def routed_experts(ep: str | None = None, tp: str | None = None, *, tokens: Placement = Replicate(),
                   dispatch: str = "gather", tp_dims: Mapping[str, tuple[int, int]] | None = None) -> RoutedExpertsSpec:
    """Shard routed experts (HF's ``experts(hidden, top_k_index, top_k_weights)``) over
    an expert axis ``ep``, a tensor axis ``tp``, or both (see :mod:`fxshard.routed_experts`).

    ``tp_dims``: ``{weight name: (dim, parts)}``, the dim of each stacked weight that
    ``tp`` shards and how many packed parts it holds (default :data:`HF_TP_DIMS`).
    ``tokens``: how the tokens are laid out over ``ep`` around the experts.  ``Replicate()``
    (HF's EP): one all-reduce of the output.  ``Shard(0)``, for a batch sharded over ``ep``
    (``inputs={"input_ids": {"ep": Shard(0)}}``): the tokens and routing are all-gathered on
    entry and the output reduce-scattered back to each rank's own tokens.
    ``dispatch="all_to_all"`` (with ``tokens=Shard(0)``): each rank sends only the
    (token, choice) pairs whose expert another rank owns, with the count exchange and
    uneven all-to-alls of :func:`fxshard.ep_dispatch` / :func:`fxshard.ep_combine`, and
    gets their results back; per MoE layer it moves ``2k(ep-1)/ep`` token rows instead of
    the gather's ``2(ep-1)`` (less from ``ep > k``).  Its all-to-alls run inside the
    experts' call (data-dependent splits), so :func:`fxshard.comm_summary` does not list
    them, and simulated ranks cannot run them.

    Example::

        plan = fxshard.Plan(mesh, {"model.layers.*.mlp.experts": fxshard.routed_experts(ep="ep")})
        plan = fxshard.Plan.from_hf(mesh, model)   # the same, from HF's base_model_ep_plan / tp plan
    """
    if ep is None and tp is None:
        raise PlanError("routed_experts(): name the axis that splits the experts (ep=) or the one that shards each "
                        "expert (tp=), or both")
    if ep is not None and ep == tp:
        raise PlanError(f"routed_experts(ep={ep!r}, tp={tp!r}): the expert axis and the tensor axis must differ")
    if tokens != Replicate() and (ep is None or tokens != Shard(0)):
        raise PlanError(f"routed_experts(tokens={tokens!r}): the tokens around the experts are Replicate() or, with "
                        f"ep=, Shard(0) over ep (a batch sharded over ep)")
    if dispatch not in ("gather", "all_to_all"):
        raise PlanError(f"routed_experts(dispatch={dispatch!r}): use 'gather' (all-gather the tokens, reduce-scatter the "
                        f"output) or 'all_to_all' (send each token to its experts' ranks)")
    if dispatch == "all_to_all" and tokens != Shard(0):
        raise PlanError(f"routed_experts(dispatch='all_to_all') sends each rank's own tokens to their experts: it needs "
                        f"tokens=Shard(0) (a batch sharded over ep={ep!r}); with replicated tokens every rank already "
                        f"holds them all")
    axes = [a for a in (ep, tp) if a is not None]
    a2a = dispatch == "all_to_all"  # the tokens stay the rank's own; the output is its own tokens' (exact on ep)
    return RoutedExpertsSpec(
        inputs=tuple({a: Shard(0) if a2a and a == ep else Replicate() for a in axes} for _ in range(3)),
        out_src={a: Shard(0) if a2a and a == ep else Partial() for a in axes},
        out_dst={a: tokens if a == ep else Replicate() for a in axes},
        local=True,
        style="routed_experts",
        ep=ep, tp=tp, tp_dims=dict(tp_dims) if tp_dims is not None else None, tokens=tokens, dispatch=dispatch,
    )


# --------------------------------------------------------------------------- checking a sharding


def sharding_error(module: nn.Module, spec: RoutedExpertsSpec, axes: dict[str, int], example: list[torch.Tensor],
                   fqn: str = "") -> str | None:
    """Does ``spec`` shard this experts module correctly?  The experts are opaque (their
    forward is the model's code), so the claim that the ranks' outputs sum to the one
    device's is checked by running it: on random inputs shaped like ``example`` (the
    call's arguments; 8 tokens of the routed convention), the module with its full
    weights against the sum over every ``ep x tp`` coordinate of the module with that
    coordinate's shards (and, under ``ep``, the routing that coordinate sees).  Returns
    what differs, or None.  Skipped (None) on the meta device.

    This is what catches a plan that splits a packed ``gate | up`` weight in the middle
    (each rank would hold all of gate or all of up), or experts that ignore
    ``num_experts`` and so compute the sentinel expert.

    Example: ``sharding_error(experts, routed_experts(tp="tp"), {"tp": 2}, [hidden, top_k_index, top_k_weights])``
    """
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    params = dict(module.named_parameters())
    if not params or any(t.is_meta for t in params.values()):
        return None
    with maybe_disable_local_tensor_mode():  # one process plays every rank here, on plain tensors
        return _sharding_error(module, spec, axes, example, fqn)


def _sharding_error(module, spec, axes, example, fqn):
    params = dict(module.named_parameters())
    placements = spec._placements(module, fqn, axes)
    n_experts = spec.n_experts(module)
    ep_n = axes[spec.ep] if spec.ep is not None else 1
    tp_n = axes[spec.tp] if spec.tp is not None else 1
    n_local = n_experts // ep_n
    dtype = next(iter(params.values())).dtype
    args = _probe(example, n_experts, dtype)
    saved = {a: getattr(module, a) for a in ("num_experts", "_is_expert_parallel") if hasattr(module, a)}
    try:
        with torch.no_grad():
            full = module(*args)
            total = torch.zeros_like(full)
            for e in range(ep_n):
                r_args = list(args)
                if spec.ep is not None:
                    module.num_experts, module._is_expert_parallel = n_local, True
                    local = args[1] - e * n_local
                    foreign = (local < 0) | (local >= n_local)
                    r_args[1:3] = local.masked_fill(foreign, n_local), args[2].masked_fill(foreign, 0.0)
                for t in range(tp_n):
                    coord = {spec.ep: e, spec.tp: t}
                    shards = {name: _shard(p, layout, coord, axes, blocks) for name, p, layout, blocks in placements}
                    total += torch.func.functional_call(module, shards, tuple(r_args))
    except Exception as e:  # noqa: BLE001 - a module that cannot run on local shards is a wrong plan too
        return f"running it on one rank's shards failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for a, v in saved.items():
            setattr(module, a, v)
        if "_is_expert_parallel" not in saved and hasattr(module, "_is_expert_parallel"):
            del module._is_expert_parallel
    err = float((total - full).abs().max())
    scale = float(full.abs().max())
    if err > 1e-3 * max(scale, 1e-6):
        return f"the ranks' outputs add up to a value {err:.3g} away from one device's (whose largest entry is {scale:.3g})"
    return None


def _probe(example: list, n_experts: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Random arguments like ``example``: the routed convention gets 8 tokens, each
    choosing distinct experts; other calls keep their shapes."""
    g = torch.Generator().manual_seed(0)
    routed = len(example) >= 3 and example[1].dim() == 2 and not example[1].dtype.is_floating_point
    if routed:
        k = max(1, min(int(example[1].shape[-1]), n_experts))
        idx = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(8)]).to(example[1].dtype)
        return [torch.randn(8, int(example[0].shape[-1]), generator=g).to(dtype), idx,
                torch.rand(8, k, generator=g).to(example[2].dtype)] + \
               [torch.randn(tuple(a.shape), generator=g).to(a.dtype) for a in example[3:]]
    return [torch.randn(tuple(a.shape), generator=g).to(a.dtype) if a.dtype.is_floating_point
            else torch.randint(0, n_experts, tuple(a.shape), generator=g).to(a.dtype) for a in example]


def _shard(t: torch.Tensor, layout: dict, coord: dict, axes: dict, blocks) -> torch.Tensor:
    from fxshard.layout.placements import blocks_on

    for axis, p in layout.items():
        if isinstance(p, Shard):
            sizes = blocks_on(blocks, p.dim) or (t.shape[p.dim],)
            n = axes[axis]
            t = torch.cat([part.narrow(p.dim, coord[axis] * (part.shape[p.dim] // n), part.shape[p.dim] // n)
                           for part in t.split(list(sizes), p.dim)], p.dim)
    return t


# --------------------------------------------------------------------------- run time


def local_experts_forward(spec: RoutedExpertsSpec, n_local: int) -> Callable[[Callable], Callable]:
    """Forward wrapper of the experts on one ``ep`` rank: the routing is pointed at this
    rank's experts (local indices; the sentinel ``n_local`` with weight 0 for the
    others), then the module's own forward runs on its local weights."""
    axis = spec.ep

    def make(base):
        def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            top_k_index, top_k_weights = local_routing(top_k_index, top_k_weights, axis, n_local)
            return base(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)

        return forward

    return make


def dispatched_experts_forward(spec: RoutedExpertsSpec, n_experts: int, n_local: int) -> Callable[[Callable], Callable]:
    """Forward wrapper of the experts for ``dispatch="all_to_all"``: this rank's
    (token, choice) pairs, sorted by expert, go to the ranks that own their experts
    (count exchange, uneven all-to-all); the module's own forward runs on what this rank
    received, each row routed to its local expert with weight 1; the results come back in
    the pairs' order and are added to their tokens scaled by their routing weights, in
    the order HF's experts add them (by expert)."""
    from fxshard.runtime.moe import ep_combine, ep_dispatch, ep_exchange_counts

    axis = spec.ep

    def make(base):
        def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            k = top_k_index.shape[-1]
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            # (static shapes for torch.compile: a scatter-add, not bincount; a search, not repeat_interleave)
            counts = torch.zeros(n_experts, dtype=flat.dtype, device=flat.device).scatter_add(0, flat, torch.ones_like(flat))
            token = order // k
            counts_ep = ep_exchange_counts(counts, axis)
            x, local_counts, plan = ep_dispatch(hidden_states[token], counts, counts_ep, axis)
            rows = torch.arange(x.shape[0], device=x.device)
            expert = torch.searchsorted(local_counts.to(x.device).cumsum(0), rows, right=True)  # each row's local expert
            ones = torch.ones(x.shape[0], 1, dtype=top_k_weights.dtype, device=x.device)
            y = ep_combine(base(self, x, expert[:, None], ones, *args, **kwargs), plan, axis)
            w = top_k_weights.reshape(-1)[order].to(y.dtype)
            return torch.zeros_like(hidden_states).index_add(0, token, y * w[:, None])

        return forward

    return make


def local_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, axis: str, n_local: int):
    """The routing as this rank's experts see it: ``top_k_index`` minus the rank's first
    expert, and choices of other ranks' experts sent to the sentinel ``n_local`` with
    weight 0 (HF's experts skip it; the zero keeps it out of the router's gradient).

    Example: at ep=2 with 4 experts, rank 1 sees ``[[3, 0]]`` as ``[[1, 2]]`` (expert 0 is
    rank 0's) and its weights ``[[w0, w1]]`` as ``[[w0, 0]]``.
    """
    start = collectives.local_offset(axis, n_local, top_k_index)
    local = top_k_index - start
    foreign = (local < 0) | (local >= n_local)
    return local.masked_fill(foreign, n_local), top_k_weights.masked_fill(foreign, 0.0)


# --------------------------------------------------------------------------- grouped experts
#
# HF's experts (``@use_experts_implementation``) pick their kernel from the config:
# ``batched_mm`` gathers each (token, choice)'s expert weights, ``[N*k, 2I, H]`` (0.66 GiB
# per token per layer for Mixtral-8x7B), and torch's meta kernel of ``grouped_mm`` takes
# bf16 only, so neither serves a program captured and planned on the meta device in
# float32.  The sharded experts therefore run fxshard's own forward, whatever the config
# says: the (token, choice) rows sorted by local expert, and one grouped GEMM per weight
# over them (``fxshard::grouped_mm``: ``torch._grouped_mm`` where the device has it, a
# loop over the experts' contiguous row slices elsewhere, shapes only on meta).  What
# it keeps for the backward is O(rows x (hidden + expert width)), never a weight per row.


def _grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``[offs[g-1], offs[g])`` of ``x`` times ``w[g]``, one matmul per expert with rows;
    rows from ``offs[-1]`` on (the sentinel's) are zeros."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host sync for all the experts
        if end > start:
            torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


def _weight_grad_loop(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    """``[G, K, N]``: each expert's ``x_rows^T @ grad_rows`` (zeros for an expert without rows)."""
    out = x.new_zeros(groups, x.shape[1], grad.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end].t(), grad[start:end], out=out[g])
        start = end
    return out


_NATIVE: dict[tuple[str, torch.dtype], bool] = {}


def _has_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on this device type and dtype (both directions):
    probed once on a tiny problem.  torch 2.13 has it on CPU (fp32, bf16) and on CUDA from
    sm80; older builds have CUDA bf16 only, or nothing."""
    key = (device.type if device.index is None else str(device), dtype)
    if key not in _NATIVE:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                x = torch.ones(8, 8, device=device, dtype=dtype)
                w = torch.ones(2, 8, 8, device=device, dtype=dtype)
                offs = torch.tensor([4, 8], device=device, dtype=torch.int32)
                ok = bool(torch._grouped_mm(x, w, offs=offs).eq(8).all()) and \
                    bool(torch._grouped_mm(x.t(), x, offs=offs).eq(4).all())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _NATIVE[key] = ok
    return _NATIVE[key]


def _aligned(*ts: torch.Tensor) -> bool:
    """The native kernel's layout rule: 16-byte aligned data, every stride but the unit one
    a multiple of 16 bytes."""
    for t in ts:
        size = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


def _native(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.dtype == w.dtype and _aligned(x, w) and _has_native(x.device, x.dtype)


def _tail_zero(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The native kernel leaves rows past the last group unwritten: zero them (no host sync)."""
    rows = torch.arange(y.shape[0], device=y.device)
    return y.masked_fill((rows >= offs[-1].to(rows.dtype))[:, None], 0) if offs.numel() else y.zero_()


def _grouped_mm_impl(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, share: float = 1.0) -> torch.Tensor:
    if x.shape[0] and _native(x, w):
        return _tail_zero(torch._grouped_mm(x, w, offs=offs), offs)
    return _grouped_mm_loop(x, w, offs)


def _grouped_mm_backward_impl(x, w, offs, grad, share=1.0):
    grad = grad.contiguous()
    if x.shape[0] and _native(x, w) and _aligned(grad):
        gx = _tail_zero(torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs), offs)
        gw = torch._grouped_mm(x.t(), grad, offs=offs)
        return gx, gw
    return _grouped_mm_loop(grad, w.transpose(-2, -1), offs), _weight_grad_loop(x, grad, offs, w.shape[0])


# Custom ops: opaque to torch.compile and torch.export (one node each), shapes only on
# meta and fake tensors, and one FLOP formula for torch's counter and the planner.
torch.library.custom_op("fxshard::grouped_mm", _grouped_mm_impl, mutates_args=(),
                        schema="(Tensor x, Tensor w, Tensor offs, float share=1.0) -> Tensor")
torch.library.custom_op("fxshard::grouped_mm_backward", _grouped_mm_backward_impl, mutates_args=(),
                        schema="(Tensor x, Tensor w, Tensor offs, Tensor grad, float share=1.0) -> (Tensor, Tensor)")


@torch.library.register_fake("fxshard::grouped_mm")
def _grouped_mm_fake(x, w, offs, share=1.0):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.register_fake("fxshard::grouped_mm_backward")
def _grouped_mm_backward_fake(x, w, offs, grad, share=1.0):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w, memory_format=torch.contiguous_format)


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offs, *share = inputs
    ctx.share = share[0] if share else 1.0
    ctx.save_for_backward(x, w, offs)  # the rows (O(rows x K)) and the weights (parameters): nothing per row x weight


def _grouped_mm_grad(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx, gw = torch.ops.fxshard.grouped_mm_backward(x, w, offs, grad, ctx.share)
    return gx, gw, None, None


torch.library.register_autograd("fxshard::grouped_mm", _grouped_mm_grad, setup_context=_grouped_mm_setup)


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    # every row computed meets one expert's [K, N]; the kernels skip the sentinel's rows, so the
    # rows counted are the share expected to be this rank's (the routing is unknown on meta)
    @register_flop_formula(torch.ops.fxshard.grouped_mm)
    def _fwd(x_shape, w_shape, offs_shape, share=1.0, *args, out_shape=None, **kwargs) -> int:
        return 2 * round(x_shape[0] * share) * x_shape[1] * w_shape[-1]

    @register_flop_formula(torch.ops.fxshard.grouped_mm_backward)
    def _bwd(x_shape, w_shape, offs_shape, grad_shape, share=1.0, *args, out_shape=None, **kwargs) -> int:
        return 4 * round(x_shape[0] * share) * x_shape[1] * w_shape[-1]


_register_flops()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, share: float = 1.0) -> torch.Tensor:
    """Grouped GEMM: ``x [S, K]`` rows sorted by group, ``w [G, K, N]``, ``offs [G]`` the
    int32 end of each group's rows (``cumsum`` of the counts); row ``r`` of group ``g``
    gives ``x[r] @ w[g]``, rows from ``offs[-1]`` on give zeros.  ``torch._grouped_mm``
    where the device has it (and the layout suits it), a loop over the groups' row slices
    elsewhere; differentiable in ``x`` and ``w``; shapes only on meta.  ``share``: the
    fraction of the rows expected before ``offs[-1]`` (an ep rank's experts get ``1/ep`` of
    uniformly routed choices), what the FLOP counters count (torch's, the planner's).

    Example::

        y = grouped_mm(x_sorted, experts.gate_up_proj.transpose(-2, -1), counts.cumsum(0).int())
    """
    device = x.device.type
    if device != "meta" and torch.is_autocast_enabled(device):  # the custom op is not autocast's: cast as F.linear is
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
    elif x.dtype != w.dtype:
        x = x.to(w.dtype)
    return torch.ops.fxshard.grouped_mm(x, w, offs, share)


def follows_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers 5 experts module (``@use_experts_implementation``:
    stacked ``gate_up_proj`` / ``up_proj`` and ``down_proj``, its gate and layout flags),
    which :func:`grouped_experts_forward` computes.

    Example: ``follows_hf_experts(mixtral.model.layers[0].mlp.experts)`` -> ``True``
    """
    flags = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")
    if not all(hasattr(module, f) for f in flags) or not isinstance(getattr(module, "down_proj", None), torch.Tensor):
        return False
    first = "gate_up_proj" if module.has_gate else "up_proj"
    return isinstance(getattr(module, first, None), torch.Tensor) and (not module.has_gate or hasattr(module, "_apply_gate"))


def _grouped_linear(x, weight, offs, bias, experts, transposed, share):
    out = grouped_mm(x, weight if transposed else weight.transpose(-2, -1), offs, share)
    if bias is not None:
        out = out + bias[experts]  # a bias row per (token, choice): vectors, not matrices
    return out


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts (``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])``)
    as grouped GEMMs: the ``N*k`` (token, choice) rows sorted by expert, each weight applied
    by :func:`grouped_mm`, the results weighted and summed per token in HF's order.  Choices
    of the sentinel ``self.num_experts`` (other ranks' experts under ``ep``) sort last and
    are skipped.  One device's numbers: HF's ``grouped_mm`` / ``batched_mm`` to rounding.

    Example::

        swap_forward(experts, lambda base: grouped_experts_forward)   # what fxshard does to sharded experts
        y = experts(hidden, top_k_index, top_k_weights)
    """
    n_tokens, k = top_k_index.shape[0], top_k_index.shape[-1]
    first = self.gate_up_proj if self.has_gate else self.up_proj
    n_experts = int(getattr(self, "num_experts", first.shape[0]))
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, the sentinel's rows last
    experts = flat[order]
    # rows per expert, static shapes (a scatter-add, not bincount); the sentinel's count dropped
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.clamp(0, n_experts), torch.ones_like(flat))
    offs = counts[:n_experts].cumsum(0).to(torch.int32)
    if first.shape[0] > n_experts:  # weights of experts past num_experts (none on an ep rank): no rows
        offs = torch.cat([offs, offs[-1:].expand(first.shape[0] - n_experts)])
    valid = experts < n_experts
    experts = experts.clamp(max=n_experts - 1)
    x = hidden_states[order // k]  # [N*k, H]: each row's token, not its expert's weights
    bias = getattr(self, "gate_up_proj_bias" if self.has_gate else "up_proj_bias", None) if self.has_bias else None
    share = getattr(self, "_fxshard_row_share", 1.0)  # set by use_grouped_experts
    h = _grouped_linear(x, first, offs, bias, experts, self.is_transposed, share)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = _grouped_linear(h, self.down_proj, offs, getattr(self, "down_proj_bias", None) if self.has_bias else None,
                        experts, self.is_transposed, share)
    if self.has_post_expert_norm:
        y = self.post_expert_norm(y)
    # the sentinel's rows are finite (grouped_mm zeroes them): a zero weight drops them, and keeps them
    # out of the router's gradient
    weights = top_k_weights.reshape(-1)[order].masked_fill(~valid, 0.0)
    y = y * weights[:, None].to(y.dtype)
    # back to (token, choice) order (an index by the inverse permutation: its backward keeps the index
    # only, where index_copy's keeps the rows), then summed over the choices as HF's kernels sum them
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y = y[inverse]
    return y.view(n_tokens, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)  # (no token at all: [0, H])


def use_grouped_experts(module: nn.Module, row_share: float = 1.0) -> bool:
    """Make ``module`` (HF experts, see :func:`follows_hf_experts`) run
    :func:`grouped_experts_forward` whatever its config's ``_experts_implementation``;
    returns whether it did (other modules keep their forward).  ``row_share``: the share of
    its (token, choice) rows expected to be its own (``1/ep`` on an ep rank that sees every
    token), what its GEMMs' FLOPs count.

    Example: ``use_grouped_experts(model.model.layers[0].mlp.experts)``
    """
    if not follows_hf_experts(module) or getattr(type(module), "_fxshard_grouped", False):
        return False
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {"forward": grouped_experts_forward, "_fxshard_grouped": True,
                                                   "_fxshard_row_share": float(row_share),
                                                   "__module__": cls.__module__})
    return True
