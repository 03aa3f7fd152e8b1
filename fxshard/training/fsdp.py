"""FSDP2 over the data-parallel axis of a transformed module.

fxshard shards within the model (tp, sp, ep) in the graph; the data-parallel axis
belongs to PyTorch's FSDP2.  A plan gives it the axis with ``Plan(..., fsdp="dp")``:
the transform then adds no gradient sync on that axis, keeps one submodule per
transformer block (``sharded.layers[i]``), and buckets the other axes' gradient
syncs within each block.  :func:`fully_shard` applies FSDP2's ``fully_shard`` over
``mesh["dp"]`` to each block, then to the root.

Example::

    mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
    plan = fxshard.Plan(mesh, llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, (tokens,))
    fxshard.fully_shard(sharded, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    loss = F.cross_entropy(sharded(my_tokens).flatten(0, 1), my_targets.flatten())  # this rank's mean
    loss.backward()   # gradients: the mean over dp (FSDP2's convention), summed over tp by fxshard

Until :func:`fully_shard` has run, calling the module raises ``PlanError``: no one
would sync the gradients over the axis.
"""
from __future__ import annotations

import torch.fx as fx
from torch.distributed._local_tensor import enabled_local_tensor_mode

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.meta import pipeline_of, program_meta
from fxshard.training.grad_norm import track_parameters

__all__ = ["fully_shard"]


def fully_shard(sharded: fx.GraphModule, mesh=None, *, axis: str | None = None, **fsdp_kwargs) -> fx.GraphModule:
    """Apply FSDP2's ``fully_shard`` over ``mesh[axis]`` to each transformer block of
    ``sharded`` (an :func:`fxshard.transform` result whose plan has ``fsdp=axis``), then
    to ``sharded`` itself; in place, returns ``sharded``.

    ``mesh``: the plan's ``DeviceMesh`` (default: the bound one); ``axis``: default the
    plan's ``fsdp`` axis; ``fsdp_kwargs`` go to every ``fully_shard`` call
    (``mp_policy=``, ``reshard_after_forward=``, ...).  Blocks already wrapped by hand
    (``torch.distributed.fsdp.fully_shard(sharded.layers[0], ...)``) are left as they are.
    A pipelined module (:func:`fxshard.pipeline_transform`): the same on each of this rank's
    stages (each block, then the stage); the module's parameters become the stages' new ones.

    Example: ``fxshard.fully_shard(sharded, mesh)``, ``fxshard.fully_shard(staged, mesh["dp"])``
    """
    if pipeline_of(sharded) is not None:  # this rank's stages: FSDP2 on each
        # the stages must hold this module's tensors (fxshard.materialize replaced them by FQN), or
        # FSDP2 would shard the meta tensors the stages were cut with
        sharded.sync_stage_state()
        for stage in sharded.stages:
            fully_shard(stage, mesh, axis=axis, **fsdp_kwargs)
        sharded.adopt_stage_state()
        return sharded
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    owned = program_meta(sharded).fsdp if isinstance(sharded, fx.GraphModule) else None
    if owned is None:
        raise PlanError("fxshard.fully_shard: this module's plan gives no mesh axis to FSDP2, so fxshard syncs the gradients "
                        "on every axis itself and FSDP2 would sync them a second time\n  fix: transform with "
                        "Plan(mesh, ..., fsdp='dp') (the data-parallel axis)")
    if axis is not None and axis != owned:
        raise PlanError(f"fxshard.fully_shard(axis={axis!r}): the plan gives axis {owned!r} to FSDP2, not {axis!r}\n"
                        f"  fix: call fxshard.fully_shard(sharded, mesh) (axis {owned!r}), or transform with Plan(..., fsdp={axis!r})")
    if enabled_local_tensor_mode() is not None:
        raise PlanError("fxshard.fully_shard: FSDP2 needs real ranks; simulated ranks (LocalTensorMode) cannot run it")
    mesh = collectives.bound_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise PlanError(f"fxshard.fully_shard: FSDP2 needs a DeviceMesh (init_device_mesh), got {mesh}; an offline "
                        f"MeshSpec transform cannot run")
    names = mesh.mesh_dim_names or ()
    if owned not in names:
        raise PlanError(f"fxshard.fully_shard: the mesh has axes {list(names)}, not the plan's FSDP axis {owned!r}\n"
                        f"  fix: pass the mesh the plan was made with")
    dp_mesh = mesh[owned] if len(names) > 1 else mesh
    for fqn in program_meta(sharded).fsdp_units or ():
        block = sharded.get_submodule(fqn)
        if not isinstance(block, FSDPModule):
            torch_fully_shard(block, mesh=dp_mesh, **fsdp_kwargs)
    if not isinstance(sharded, FSDPModule):
        torch_fully_shard(sharded, mesh=dp_mesh, **fsdp_kwargs)
    track_parameters(sharded)  # FSDP2 replaced the parameters by DTensors
    return sharded


def require_fully_shard(gm: fx.GraphModule, axis: str) -> None:
    """Mark ``gm`` as owing axis ``axis`` to FSDP2: calling it before :func:`fully_shard`
    raises (its gradients on the axis would never be synced)."""
    program_meta(gm, create=True).fsdp = axis
    gm.register_forward_pre_hook(_check_fully_sharded)


def _check_fully_sharded(module, args) -> None:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        axis = program_meta(module).fsdp
        raise PlanError(f"this module's plan gives axis {axis!r} to FSDP2 (Plan(fsdp={axis!r})), so fxshard syncs no "
                        f"gradient on it, and FSDP2 is not applied yet\n  fix: call fxshard.fully_shard(sharded, mesh) "
                        f"before the first step (or transform without fsdp= to let fxshard sum the gradients over {axis!r})")
