"""shard_state: parameters and buffers become this rank's local shards.

Each parameter or buffer with a non-replicated layout is replaced by its local slice
under the same FQN (so ``state_dict`` keys do not change); tied parameters stay tied.
Replicated ones are cloned: until here the transform's copy shares the input model's
storage (no full copy of a large model is ever made), and training must not write
into the user's model.  On the meta device nothing is allocated.
The global layout and shape of every tensor are kept in ``ProgramMeta.state``
(``{fqn: (layout, global_shape)}``; fused parameters' part sizes in
``ProgramMeta.blocks``, replicated heads' :class:`~fxshard.layout.placements.HeadReplicas` in
``ProgramMeta.heads``), from which :func:`fxshard.full_state_dict`
gathers a full checkpoint and :func:`fxshard.load_full_state_dict` slices one.

Under simulated ranks (``LocalTensorMode``) the coordinate is per rank, so each
parameter becomes a LocalTensor holding every rank's shard; replicated ones become
per-rank copies, as every rank holds its own copy in a real run.

Parameters of local regions (``LocalRegion.params``) are sliced the same way; a
region's children owned by other ranks (module-list experts) are deleted.

Reads:  ``.value`` of ``get_attr`` nodes, ``.declared`` of local regions; the mesh coordinate.
Writes: module attributes; ``ProgramMeta.state``, ``.blocks``, ``.heads`` (:mod:`fxshard.meta`).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed._local_tensor import enabled_local_tensor_mode

from fxshard.layout.placements import HeadReplicas, is_replicate
from fxshard.plan.mesh import mesh_coordinate
from fxshard.errors import PlanError
from fxshard.meta import LocalRegion, TensorInfo, info
from fxshard.meta import PassContext, program_meta
from fxshard.state.shards import local_slice
from fxshard.state.module_state import attribute


def shard_state(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replace sharded parameters/buffers by local shards (in place)."""
    mesh = ctx.mesh
    layouts: dict[str, tuple[dict, tuple[int, ...]]] = {}
    blocks: dict[str, tuple[int, ...]] = {}
    heads: dict[str, HeadReplicas] = {}
    for node in gm.graph.nodes:
        v = info(node).value
        if node.op == "get_attr" and isinstance(v, TensorInfo):
            hr = info(node).extra.get("head_replicas")
            if hr is not None:  # the graph reads every head once per replica; the state holds it once
                heads[node.target] = hr
                v = TensorInfo(v.layout, tuple(attribute(gm, node.target).shape), v.local_shape, v.dtype)
            layouts[node.target] = (v.layout, v.shape)
            if v.blocks:
                blocks[node.target] = v.blocks
        elif node.op == "call_module" and isinstance(info(node).declared, LocalRegion):
            layouts.update(_local_region_state(gm, info(node).declared, mesh))
            blocks.update(info(node).declared.blocks)
    lm = enabled_local_tensor_mode()
    replaced: dict[int, torch.Tensor] = {}
    names = [(n, t, True) for n, t in gm.named_parameters(remove_duplicate=False)]
    names += [(n, t, False) for n, t in gm.named_buffers(remove_duplicate=False)]
    state = {}
    for fqn, t, is_param in names:
        layout, shape = layouts.get(fqn, (None, tuple(t.shape)))
        if layout is None:
            layout = next((layouts[o][0] for o, t2, _ in names if t2 is t and o in layouts), None)
        if layout is not None:
            state[fqn] = (layout, shape)
        if id(t) not in replaced:
            if layout is not None and not is_replicate(layout):
                local = local_slice(t.detach(), layout, mesh, blocks.get(fqn), heads.get(fqn)).clone()
            elif lm is not None:
                local = lm.rank_map(lambda r, t=t: t.detach().clone())
            else:  # the transform's copy aliases the input model's storage: own it now
                local = t.detach().clone()
            replaced[id(t)] = nn.Parameter(local, requires_grad=t.requires_grad) if is_param else local
        new = replaced[id(t)]
        if new is not t:
            owner, _, name = fqn.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            if is_param:
                mod._parameters[name] = new
            else:
                mod._buffers[name] = new
    program = program_meta(gm, create=True)
    program.state, program.blocks, program.heads = state, blocks, heads
    return


def _local_region_state(gm: fx.GraphModule, region: LocalRegion, mesh) -> dict:
    """A local region's tensors are no graph edges: their layouts come from the plan
    (``LocalRegion.params``).  Children owned by another rank (module-list experts)
    are deleted from this rank; the rest keep their FQNs."""
    if region.owners and enabled_local_tensor_mode() is not None:
        raise PlanError(f"local region {region.fqn!r}: its experts live on one rank each (a module list), which "
                        f"simulated ranks cannot hold; run it on real ranks")
    coord = mesh_coordinate(mesh) if region.owners else {}
    for child, (axis, index) in region.owners.items():
        if coord[axis] != index:
            parent, _, name = child.rpartition(".")
            del gm.get_submodule(parent)._modules[name]
    own = dict(gm.named_parameters(remove_duplicate=False))
    own.update(gm.named_buffers(remove_duplicate=False))
    return {fqn: (layout, tuple(own[fqn].shape)) for fqn, layout in region.params.items() if fqn in own}
