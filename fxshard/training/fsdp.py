"""FSDP2 over the data-parallel axes of a transformed module.

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

Several axes (``Plan(..., fsdp=("dp", "cp"))``) shard the parameters over their product,
a flattened mesh dim named ``"dp_cp"`` (torchtitan's ``dp_shard_cp``).  A context-parallel
axis among them keeps fxshard's convention: its ranks' gradient shares are summed (FSDP2's
divide factor is set to the size of the other axes).  HSDP: the plan's batch axis ``dp`` is
a flattened mesh dim, ``mesh["dp_replicate", "dp_shard"]._flatten("dp")``, and
``replicate={"dp": ("dp_replicate", "dp_shard")}`` runs FSDP2 over the 2-D mesh
``(dp_replicate, dp_shard_cp)``: replicated over the first, sharded over the second; the
gradients are still averaged over all of dp.

Each parameter is cut on the dim :func:`fsdp_shard_dim` names: dim 0 (FSDP2's default)
unless the FSDP ranks do not divide it, then the first dim they divide.  An expert-parallel
rank's stacked experts (``[E/ep, 2I, H]``) over more FSDP ranks than it has experts are cut
on dim 1, as torchtitan's ``Shard(1)``: on dim 0 the whole expert would stay on one rank.
The planner's memory model takes the same function (:func:`fsdp_shard_numel`).

Until :func:`fully_shard` has run, calling the module raises ``PlanError``: no one
would sync the gradients over the axis.
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch.fx as fx
from torch.distributed._local_tensor import enabled_local_tensor_mode

from fxshard.runtime import collectives
from fxshard.errors import PlanError
from fxshard.meta import pipeline_of, program_meta
from fxshard.training.grad_norm import track_parameters

__all__ = ["fully_shard", "fsdp_shard_dim", "fsdp_shard_numel"]


def fully_shard(sharded: fx.GraphModule, mesh=None, *, axis: str | tuple[str, ...] | None = None,
                replicate: dict[str, tuple[str, str]] | None = None, **fsdp_kwargs) -> fx.GraphModule:
    """Apply FSDP2's ``fully_shard`` over the plan's FSDP axes of ``mesh`` to each
    transformer block of ``sharded`` (an :func:`fxshard.transform` result whose plan has
    ``fsdp=axis`` or ``fsdp=(axes...)``), then to ``sharded`` itself; in place, returns
    ``sharded``.

    ``mesh``: the plan's ``DeviceMesh`` or any mesh with the FSDP axes as dims (default:
    the bound one); ``axis``: default the plan's ``fsdp`` axes (given, they must be the
    plan's); ``replicate``: HSDP, ``{plan axis: (replicate dim, shard dim)}`` where the plan's
    axis is the flattening of those two mesh dims: FSDP2 on the 2-D mesh (the replicate dim,
    the shard dim x the other FSDP axes), replicated outside, sharded inside; ``fsdp_kwargs`` go to every
    ``fully_shard`` call (``mp_policy=``, ``reshard_after_forward=``, ...).  Each parameter
    is cut on :func:`fsdp_shard_dim`'s dim (a ``shard_placement_fn=`` given here replaces
    that rule, and the planner's figures with it).  Blocks
    already wrapped by hand (``torch.distributed.fsdp.fully_shard(sharded.layers[0], ...)``)
    are left as they are.  A pipelined module (:func:`fxshard.pipeline_transform`): the
    same on each of this rank's stages (each block, then the stage), with
    ``reshard_after_forward=False`` unless given (one all-gather a pass, not one per
    micro-batch); the module's parameters become the stages' new ones.

    Example: ``fxshard.fully_shard(sharded, mesh)``, ``fxshard.fully_shard(staged, mesh)``,
    ``fxshard.fully_shard(sharded, mesh, replicate={"dp": ("dp_replicate", "dp_shard")})``
    (a mesh with dims ``dp_replicate, dp_shard, tp`` and ``dp`` flattened from the first two)
    """
    if pipeline_of(sharded) is not None:  # this rank's stages: FSDP2 on each
        # the stages must hold this module's tensors (fxshard.materialize replaced them by FQN), or
        # FSDP2 would shard the meta tensors the stages were cut with
        sharded.sync_stage_state()
        # torch's schedule keeps a stage's parameters gathered from its first backward to the pass's end;
        # resharding after each micro-batch's forward would gather them again for every micro-batch, for
        # no lower peak (torchtitan's default under pp, as here unless given)
        fsdp_kwargs.setdefault("reshard_after_forward", False)
        for stage in sharded.stages:
            fully_shard(stage, mesh, axis=axis, replicate=replicate, **fsdp_kwargs)
        sharded.adopt_stage_state()
        return sharded
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    program = program_meta(sharded) if isinstance(sharded, fx.GraphModule) else None
    owned = _axes(program.fsdp) if program is not None else ()
    if not owned:
        raise PlanError("fxshard.fully_shard: this module's plan gives no mesh axis to FSDP2, so fxshard syncs the gradients "
                        "on every axis itself and FSDP2 would sync them a second time\n  fix: transform with "
                        "Plan(mesh, ..., fsdp='dp') (the data-parallel axis)")
    if axis is not None and set(_axes(axis)) != set(owned):
        raise PlanError(f"fxshard.fully_shard(axis={axis!r}): the plan gives {_show(owned)} to FSDP2, not {axis!r}\n"
                        f"  fix: call fxshard.fully_shard(sharded, mesh) (axes {_show(owned)}), or transform with "
                        f"Plan(..., fsdp={axis!r})")
    replicate = dict(replicate or {})
    if len(replicate) > 1 or any(a not in owned or len(dims) != 2 for a, dims in replicate.items()):
        raise PlanError(f"fxshard.fully_shard(replicate={replicate!r}): HSDP takes one of the plan's FSDP axes "
                        f"{_show(owned)} and the two mesh dims it is flattened from, (replicate, shard)\n  fix: "
                        f"replicate={{'dp': ('dp_replicate', 'dp_shard')}} with mesh['dp_replicate', 'dp_shard']._flatten('dp')")
    if enabled_local_tensor_mode() is not None:
        raise PlanError("fxshard.fully_shard: FSDP2 needs real ranks; simulated ranks (LocalTensorMode) cannot run it")
    mesh = collectives.bound_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise PlanError(f"fxshard.fully_shard: FSDP2 needs a DeviceMesh (init_device_mesh), got {mesh}; an offline "
                        f"MeshSpec transform cannot run")
    names = mesh.mesh_dim_names or ()
    missing = [a for a in (*owned, *(d for dims in replicate.values() for d in dims)) if not _has_dim(mesh, a)]
    if missing:
        raise PlanError(f"fxshard.fully_shard: the mesh has axes {list(names)}, not the plan's FSDP axes {_show(missing)}\n"
                        f"  fix: pass the mesh the plan was made with")
    fsdp_mesh, spans = _fsdp_mesh(mesh, owned, replicate)
    if "shard_placement_fn" not in fsdp_kwargs:
        fsdp_kwargs["shard_placement_fn"] = _placement_over(fsdp_mesh.size(fsdp_mesh.ndim - 1))  # the shard dim
    for fqn in program.fsdp_units or ():
        block = sharded.get_submodule(fqn)
        if not isinstance(block, FSDPModule):
            torch_fully_shard(block, mesh=fsdp_mesh, **fsdp_kwargs)
    if not isinstance(sharded, FSDPModule):
        torch_fully_shard(sharded, mesh=fsdp_mesh, **fsdp_kwargs)
    program.fsdp_mesh = spans
    cp_axes = [a for a in owned if a in (program.context_parallel or {})]
    if cp_axes:
        # FSDP2 divides by every rank it reduces over; over cp fxshard's convention is the sum (each
        # rank's gradient is its positions' share), so divide by the batch axes only
        factor = float(math.prod((program.mesh or {})[a] for a in owned if a not in cp_axes))
        sum_only = _backend(fsdp_mesh) != "nccl"  # PREMUL_SUM is NCCL's: elsewhere sum, then divide
        for m in sharded.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(factor)
                if sum_only:
                    m.set_force_sum_reduction_for_comms(True)
    track_parameters(sharded)  # FSDP2 replaced the parameters by DTensors
    return sharded


def fsdp_shard_dim(shape: Sequence[int], ranks: int) -> int:
    """The dim FSDP2 cuts a parameter of (this rank's) ``shape`` on over ``ranks`` ranks:
    dim 0 when ``ranks`` divides it, else the first dim ``ranks`` divides, else dim 0
    (FSDP2 pads it: ``torch.chunk`` pieces; it cuts no other dim unevenly).  The rule of
    :func:`fully_shard` and of the planner's memory model.

    Why: an expert-parallel rank's stacked experts have ``E/ep`` rows on dim 0; over more
    FSDP ranks than that, dim 0 would leave each expert whole on one rank (Mixtral-8x7B at
    ep=8, dp=8: 1 expert per ep rank, 5.6 billion parameters on one rank of 8), so torchtitan
    shards them on dim 1.

    Example: ``fsdp_shard_dim((1, 28672, 4096), 8) == 1``, ``fsdp_shard_dim((32000, 4096), 8) == 0``,
    ``fsdp_shard_dim((7, 5), 2) == 0`` (nothing divides: dim 0, padded)
    """
    for dim, size in enumerate(shape):
        if size > 0 and size % ranks == 0:
            return dim
    return 0


def fsdp_shard_numel(shape: Sequence[int], ranks: int) -> int:
    """How many elements of a parameter of (this rank's) ``shape`` one of ``ranks`` FSDP2
    ranks stores (padding included: FSDP2 allocates every rank's piece at the largest
    piece's size), cut on :func:`fsdp_shard_dim`.  The planner's parameter, gradient and
    optimizer bytes, and its all-gather sizes (``ranks *`` this).

    Example: ``fsdp_shard_numel((1, 28672, 4096), 8) == 28672 * 4096 // 8``,
    ``fsdp_shard_numel((7, 5), 2) == 4 * 5``
    """
    if not shape:  # a 0-d parameter (FSDP2 cuts none): whole on every rank
        return 1
    if math.prod(shape) == 0:
        return 0
    dim = fsdp_shard_dim(shape, ranks)
    return -(-shape[dim] // ranks) * (math.prod(shape) // shape[dim])


def _placement_over(ranks: int):
    """FSDP2's ``shard_placement_fn``: each parameter on :func:`fsdp_shard_dim`'s dim."""
    from torch.distributed.tensor import Shard

    def placement(param):
        return Shard(fsdp_shard_dim(tuple(param.shape), ranks))

    return placement


def _axes(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _show(axes) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def _fsdp_mesh(mesh, owned: tuple[str, ...], replicate: dict):
    """The mesh FSDP2 runs on, and ``{its dim: the plan axes its pieces are distinct over}``:
    1-D over the plan's FSDP axes (several flattened into one dim, ``"dp_cp"``), or under
    HSDP 2-D ``(dp_replicate, dp_shard_cp)`` (the replicate dim spans no axis whole)."""
    names = mesh.mesh_dim_names or ()
    shard = tuple(replicate[a][1] if a in replicate else a for a in owned)
    if len(shard) == 1:
        s_name, s_mesh = shard[0], (mesh if names == shard else _dim(mesh, shard[0]))
    else:
        s_name = "_".join(shard)
        s_mesh = mesh[shard]._flatten(s_name)
    if not replicate:
        return s_mesh, {s_name: owned}
    ((_, (r_name, _)),) = replicate.items()
    with warnings.catch_warnings():  # slicing a flattened dim from its root: the 2-D mesh HSDP takes
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        hsdp = mesh[(r_name, s_name)]
    return hsdp, {r_name: (), s_name: owned}


def _dim(mesh, name: str):
    with warnings.catch_warnings():  # a flattened dim ("dp" under HSDP) sliced from its root
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[name]


def _has_dim(mesh, name: str) -> bool:
    if name in (mesh.mesh_dim_names or ()):
        return True
    try:
        _dim(mesh, name)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _backend(mesh) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(mesh.get_group(mesh.ndim - 1)))


def require_fully_shard(gm: fx.GraphModule, axes: tuple[str, ...]) -> None:
    """Mark ``gm`` as owing ``axes`` to FSDP2: calling it before :func:`fully_shard`
    raises (its gradients on the axes would never be synced)."""
    program_meta(gm, create=True).fsdp = _axes(axes)
    gm.register_forward_pre_hook(_check_fully_sharded)


def _check_fully_sharded(module, args) -> None:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        axis = _show(program_meta(module).fsdp)
        raise PlanError(f"this module's plan gives axis {axis} to FSDP2 (Plan(fsdp={axis})), so fxshard syncs no "
                        f"gradient on it, and FSDP2 is not applied yet\n  fix: call fxshard.fully_shard(sharded, mesh) "
                        f"before the first step (or transform without fsdp= to let fxshard sum the gradients over {axis})")
