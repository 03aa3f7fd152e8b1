"""Gradient norm and clipping of a transformed module: the whole model's norm, the same
on every rank, equal to the single-device one.

A transformed module's parameters are this rank's shards, so torch's
``clip_grad_norm_`` sees a part of the gradient (at tp=2 every rank computes another
norm, clips by another factor, and replicated parameters drift apart).  Here each rank
sums ``|g|^p`` over the boxes it holds, weights each by ``1 / copies`` (how many ranks
hold the same box: :func:`fxshard.state.shards.copies`, the one place that knows replicas
over an axis, KV heads shared by ``tp/n`` ranks, FSDP2's dim-0 pieces and experts that
live on one rank), and the sums are all-reduced over the mesh, one collective per
axis: each element of the model's gradient is counted exactly once.

Example::

    loss.backward()
    norm = fxshard.clip_grad_norm_(sharded, max_norm=1.0)   # instead of torch.nn.utils.clip_grad_norm_
    opt.step()

``torch.nn.utils.clip_grad_norm_`` called on the parameters of a module that fxshard
shards, or of a pipelined one (``fxshard.pipeline_transform``: a rank holds its stages'
parameters, so torch would take one stage's norm), raises a ``PlanError`` that says so
(the guard is installed by the first :func:`fxshard.transform`); on other modules it is
torch's, unchanged.  :func:`clip_grad_norm_` itself refuses a list of a pipelined module's
parameters in the same way: the norm over every stage needs the module
(``fxshard.clip_grad_norm_(staged, max_norm)``).
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.fx as fx

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.meta import pipeline_of, program_meta
from fxshard.state.shards import copies, copies_of, owned_children

__all__ = ["clip_grad_norm_", "grad_norm", "track_parameters"]

# id(parameter) -> (weakref to it, weakref to its transformed module, fqn)
_OWNER: dict[int, tuple] = {}


def track_parameters(gm: fx.GraphModule) -> None:
    """Remember which transformed module and FQN each parameter of ``gm`` belongs to
    (``fxshard.transform`` calls it, and ``fxshard.fully_shard`` again once FSDP2 has
    replaced the parameters), so that a list of parameters can be clipped and torch's
    own ``clip_grad_norm_`` can be caught on them."""
    module_ref = weakref.ref(gm)
    for fqn, p in gm.named_parameters(remove_duplicate=False):
        key = id(p)
        _OWNER[key] = (weakref.ref(p, lambda _, key=key: _OWNER.pop(key, None)), module_ref, fqn)
    _guard_torch_clip()


def _owner(p: torch.Tensor):
    entry = _OWNER.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    gm = entry[1]()
    return None if gm is None else (gm, entry[2])


def grad_norm(module_or_params, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """The norm of the whole model's gradient (float32, the same on every rank).

    ``module_or_params``: a module from :func:`fxshard.transform` (also after
    :func:`fxshard.fully_shard`), a pipelined one from :func:`fxshard.pipeline_transform`
    (the norm over every stage; a tied parameter's copies, equal after ``train_step``, count
    once), or an iterable of a module's parameters.  A collective: call it on every rank.
    ``norm_type``: any p, ``inf`` or 0, as torch's.

    Example: ``norm = fxshard.grad_norm(sharded)``
    """
    if not isinstance(module_or_params, (torch.nn.Module, torch.Tensor)):
        module_or_params = list(module_or_params)  # an iterator is read twice below
    pipelined = pipeline_of(module_or_params) is not None
    if not pipelined:
        _refuse_stage_params(module_or_params, "fxshard.grad_norm", "fxshard.grad_norm(staged)")
    total = _pipeline_norm(module_or_params, norm_type) if pipelined else _norm(module_or_params, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped; "
                           f"to disable this error and scale the gradients by the non-finite norm anyway, set "
                           f"error_if_nonfinite=False")
    return total


def _pipeline_norm(staged, norm_type: float) -> torch.Tensor:
    """The norm over every stage of a pipelined module (:func:`fxshard.meta.pipeline_of`):
    this rank's stages' norm over the plan's axes, then over the pipeline ranks."""
    p = float(norm_type)
    staged.sync_stage_state()
    mine = staged.owned_parameters()
    local = _norm(mine, norm_type) if mine else torch.zeros(())
    local = local.detach().float().clone()
    if p == math.inf:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=staged.pp_group)
        return local
    power = local if p in (0.0, 1.0) else local.pow(p)  # _norm took the p-th root over the plan's axes
    dist.all_reduce(power, group=staged.pp_group)
    return power if p in (0.0, 1.0) else power.pow(1.0 / p)


def _norm(module_or_params, norm_type: float) -> torch.Tensor:
    groups = _by_module(module_or_params)
    p = float(norm_type)
    total = None
    for gm, named in groups.items():
        if gm is None:
            part = _plain_sum([q.grad for _, q in named], p)
        else:
            part = _module_sum(gm, named, p)
        if part is not None:
            total = part if total is None else (torch.maximum(total, part) if p == math.inf else total + part)
    if total is None:
        return torch.tensor(0.0)
    if p not in (0.0, 1.0, math.inf):
        total = total.pow(1.0 / p)
    return total


def clip_grad_norm_(module_or_params, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Scale the gradients in place so that the whole model's norm is at most
    ``max_norm``; returns the norm before clipping (the same on every rank).

    The sharded counterpart of ``torch.nn.utils.clip_grad_norm_``, with its arguments
    (``foreach`` is accepted for compatibility).  A collective: call it on every rank.

    Example::

        loss.backward()
        fxshard.clip_grad_norm_(sharded, 1.0)
        opt.step()
    """
    params = [q for _, q in _named_params(module_or_params)]
    if pipeline_of(module_or_params) is None:
        _refuse_stage_params(params, "fxshard.clip_grad_norm_", "fxshard.clip_grad_norm_(staged, max_norm)")
    total = grad_norm(params if not isinstance(module_or_params, torch.nn.Module) else module_or_params,
                      norm_type, error_if_nonfinite)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for q in params:
            g = q.grad
            if g is None:
                continue
            local = g.to_local() if _is_dtensor(g) else g
            local.mul_(coef.to(local.device, local.dtype))
    return total


# ----------------------------------------------------------------------------- the sums


def _named_params(module_or_params) -> list[tuple[str | None, torch.Tensor]]:
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.named_parameters())
    if isinstance(module_or_params, torch.Tensor):
        return [(None, module_or_params)]
    return [(None, q) for q in module_or_params]


def _by_module(module_or_params) -> dict:
    """``{transformed module or None: [(fqn, parameter)]}``; ``None`` holds plain parameters."""
    if isinstance(module_or_params, torch.nn.Module) and program_meta(module_or_params).state is not None:
        return {module_or_params: list(module_or_params.named_parameters())}
    groups: dict = {}
    for _, q in _named_params(module_or_params):
        hit = _owner(q)
        gm, fqn = hit if hit is not None else (None, None)
        groups.setdefault(gm, []).append((fqn, q))
    if None in groups and len(groups) > 1:
        raise PlanError(f"fxshard.clip_grad_norm_: {len(groups[None])} of the parameters belong to no module fxshard "
                        f"transformed, the others to one it did, so it cannot tell which ranks hold copies of the former\n"
                        f"  fix: clip the transformed module's parameters and the others in separate calls, or transform "
                        f"the whole model")
    return groups


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _power_sum(g: torch.Tensor, p: float) -> torch.Tensor:
    local = g.to_local() if _is_dtensor(g) else g
    if p == math.inf:
        return local.detach().abs().max().float() if local.numel() else torch.zeros((), device=local.device)
    n = torch.linalg.vector_norm(local.detach(), p, dtype=torch.float32)
    return n if p in (0.0, 1.0) else n.pow(p)


def _plain_sum(grads, p: float) -> torch.Tensor | None:
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    parts = torch.stack([_power_sum(g, p).to(grads[0].device) for g in grads])
    return parts.max() if p == math.inf else parts.sum()


def _module_sum(gm: fx.GraphModule, named, p: float) -> torch.Tensor | None:
    """This module's ``sum |g|^p`` (``max |g|`` for inf) over the mesh, each element once."""
    owned = owned_children(gm)
    with_grad = [(fqn, q) for fqn, q in named if q.grad is not None]
    device = with_grad[0][1].grad.device if with_grad else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float32, device=device)
    for fqn, q in with_grad:
        s = _power_sum(q.grad, p).to(device)
        # a box that ``c`` ranks hold is counted ``1/c`` times on each (max needs no weight)
        local = torch.maximum(local, s) if p == math.inf else local + s / copies_of(gm, fqn, q, owned)
    axes = list(program_meta(gm).mesh or {})
    return collectives.reduce_over(local, axes, "max" if p == math.inf else "sum") if axes else local


# ----------------------------------------------------------------------------- torch's own, caught


def _stage_param(p: torch.Tensor) -> tuple[str, int] | None:
    """``(fqn, stage)`` if ``p`` is a parameter of a pipeline stage (also once FSDP2 has
    replaced it: ``fxshard.fully_shard`` tracks the new one)."""
    hit = _owner(p)
    if hit is None:
        return None
    gm, fqn = hit
    stage = program_meta(gm).pipeline_stage
    return None if stage is None else (fqn, stage.stage)


def _refuse_stage_params(module_or_params, called: str, fix: str) -> None:
    """A PlanError when ``module_or_params`` holds a parameter of a pipeline stage: on its
    own, a rank has its stages' parameters only, and their norm is not the model's."""
    hit = next((h for h in (_stage_param(q) for _, q in _named_params(module_or_params)) if h is not None), None)
    if hit is not None:
        fqn, stage = hit
        raise PlanError(f"{called} on the parameters of a pipelined module: {fqn!r} is a parameter of stage {stage}, and "
                        f"this rank holds its stages' parameters only, so the norm would be theirs, not the model's, and "
                        f"each pipeline rank would clip by another factor\n  fix: {fix} with staged the module "
                        f"fxshard.pipeline_transform returned (the same arguments): the norm over every stage, the same "
                        f"on every rank")


def _sharded_by_fxshard(p: torch.Tensor) -> str | None:
    """The FQN of ``p`` if it is a shard that fxshard cut (some rank holds another box)."""
    hit = _owner(p)
    if hit is None:
        return None
    gm, fqn = hit
    program = program_meta(gm)
    axes = program.mesh or {}
    layout, _ = (program.state or {}).get(fqn, (None, None))
    return fqn if copies(layout, axes, program.heads.get(fqn)) < math.prod(axes.values()) else None


def _guard_torch_clip() -> None:
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    if getattr(utils.clip_grad_norm_, "fxshard_guard", False):
        return
    original = utils.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_guarded(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        _refuse_stage_params(params, "torch.nn.utils.clip_grad_norm_", "fxshard.clip_grad_norm_(staged, max_norm)")
        sharded = next((fqn for fqn in map(_sharded_by_fxshard, params) if fqn is not None), None)
        if sharded is not None:
            raise PlanError(f"torch.nn.utils.clip_grad_norm_ on the parameters of a module fxshard shards: {sharded!r} is "
                            f"this rank's shard, so torch would compute each rank's own norm and clip each by another "
                            f"factor\n  fix: call fxshard.clip_grad_norm_(sharded, max_norm) (the same arguments): the "
                            f"whole model's norm, the same on every rank")
        return original(params, *args, **kwargs)

    clip_grad_norm_guarded.fxshard_guard = True
    utils.clip_grad_norm_ = clip_grad_norm_guarded
    clip_grad.clip_grad_norm_ = clip_grad_norm_guarded
