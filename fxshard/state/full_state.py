"""Full (unsharded) checkpoints of a transformed GraphModule.

Example::

    sd = fxshard.full_state_dict(sharded)      # collective: every rank gets full tensors
    fxshard.load_full_state_dict(sharded, sd)  # every rank keeps its slice

On a module that FSDP2 also sharded (:func:`fxshard.fully_shard`), a parameter is a
``DTensor`` over the FSDP axis whose local tensor is fxshard's shard: it is gathered
over that axis first, then over fxshard's axes (and sliced the other way round).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fxshard.runtime import collectives
from fxshard.layout.placements import blocks_on
from fxshard.meta import program_meta
from fxshard.state.shards import local_slice


def _layouts(gm: fx.GraphModule) -> dict:
    state = program_meta(gm).state
    if state is None:
        raise ValueError("this GraphModule was not produced by fxshard.transform (no ProgramMeta.state)")
    return state


def full_state_dict(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Gather every sharded tensor over its mesh axes; returns the single-device
    ``state_dict`` (same keys).  A collective: call it on every rank."""
    layouts = _layouts(gm)
    blocks = program_meta(gm).blocks
    heads = program_meta(gm).heads
    out = {}
    for fqn, t in gm.state_dict().items():
        layout, shape = layouts.get(fqn, (None, None))
        t = t.detach()
        if isinstance(t, DTensor):  # FSDP2's shard of fxshard's shard
            t = t.full_tensor()
        if layout is not None:
            for axis, p in reversed(list(layout.items())):  # innermost axis first
                if isinstance(p, Shard):
                    parts = blocks_on(blocks.get(fqn), p.dim)
                    if parts:  # gather each part of a fused parameter on its own (torch.chunk pieces of each)
                        local = t.split(collectives.local_sizes(parts, axis), p.dim)
                        t = torch.cat([collectives.all_gather(x, axis, p.dim, size=s) for x, s in zip(local, parts)], p.dim)
                    else:  # the global size: unequal pieces where the axis does not divide it
                        t = collectives.all_gather(t, axis, p.dim, size=_gathered_size(shape, p.dim, fqn, heads, axis))
                    hr = heads.get(fqn)
                    if hr is not None and hr.axis == axis and collectives.axis_size(axis) > hr.heads:
                        # every head arrives once per rank that shares it: keep one copy
                        replicas = collectives.axis_size(axis) // hr.heads
                        t = t.unflatten(p.dim, (hr.heads, replicas, -1)).select(p.dim + 1, 0).flatten(p.dim, p.dim + 1)
        out[fqn] = t.clone()
    return out


def _gathered_size(shape, dim: int, fqn: str, heads: dict, axis: str) -> int | None:
    hr = heads.get(fqn)
    if shape is None or (hr is not None and hr.axis == axis):
        return None  # replicated heads: every rank holds a whole head
    return shape[dim]


def load_full_state_dict(gm: fx.GraphModule, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a single-device ``state_dict``: every rank copies its slice in place."""
    layouts = _layouts(gm)
    mesh = collectives.bound_mesh()
    own = gm.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for fqn, t in own.items():
            if fqn not in state_dict:
                continue
            full = state_dict[fqn]
            layout, shape = layouts.get(fqn, (None, tuple(t.shape)))
            if tuple(full.shape) != tuple(shape):
                raise ValueError(f"load_full_state_dict: {fqn} has shape {tuple(full.shape)}, expected the global shape {tuple(shape)}")
            mine = (local_slice(full, layout, mesh, program_meta(gm).blocks.get(fqn),
                                program_meta(gm).heads.get(fqn)) if layout is not None else full)
            if isinstance(t, DTensor):  # FSDP2's shard of it: sliced locally, the same on every rank
                mine = distribute_tensor(mine.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None).to_local()
                t = t.to_local()
            t.copy_(mine)
