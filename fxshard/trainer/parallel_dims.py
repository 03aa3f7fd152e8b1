"""The trainer's parallel state: one typed object for ``--mesh``.

``ParallelDims.parse("dp=2,pp=2,tp=2")`` checks the axes and sizes before any work,
``build_mesh`` makes the ``DeviceMesh`` in one fixed order (``pp, dp_replicate, dp, cp,
ep, tp``: the tensor-parallel ranks adjacent, as torchtitan lays them out), and the
properties say which ranks share a batch row, a sequence piece or a stage, and which
axes FSDP2 shards the parameters over (``dp`` and ``cp``: torchtitan's ``dp_shard_cp``)
or replicates them over (``dp_replicate``: HSDP).

Example::

    dims = ParallelDims.parse("dp=2,tp=2", world_size=4)
    mesh = dims.build_mesh("cpu")            # dims ("dp", "tp")
    dims.batch_ranks                         # 2: the global batch is split over dp
    hsdp = ParallelDims.parse("dp_replicate=2,dp=2,cp=2", 8)
    hsdp.fsdp_axes, hsdp.batch_ranks           # ('dp', 'cp'), 4: the plan's dp is dp_replicate x dp_shard
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fxshard.trainer.errors import TrainerError

AXES = ("pp", "dp_replicate", "dp", "cp", "ep", "tp")
AXIS_HELP = {
    "dp": "data parallel: the batch split over its ranks, parameters sharded by FSDP2",
    "dp_replicate": "replicated data parallel (HSDP, with dp): the batch split over its ranks too, parameters "
                    "replicated over them and sharded by FSDP2 within each replica (over dp x cp)",
    "tp": "tensor parallel: the model's own plan (HF's base_model_tp_plan, torchtitan's plan)",
    "pp": "pipeline parallel: the blocks cut into stages (fxshard.pipeline_transform), --microbatches, --schedule",
    "cp": "context parallel: the sequence split over its ranks around each attention, parameters sharded by "
          "FSDP2 over dp x cp",
    "ep": "expert parallel: a mixture of experts' routed experts split over its ranks (HF's base_model_ep_plan)",
}


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism (1: not used); their product is the world size."""

    dp: int = 1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    spec: str = field(default="", compare=False)

    @classmethod
    def parse(cls, text: str, world_size: int) -> "ParallelDims":
        """``"dp=2,tp=2"`` -> ``ParallelDims(dp=2, tp=2)``; ``""`` is one process.  An unknown
        axis, a repeated one, a size below 1 or a product other than ``world_size`` is a
        :class:`TrainerError`."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, size = part.partition("=")
            name = name.strip()
            if not eq or not size.strip().isdigit():
                raise TrainerError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE\n  fix: e.g. --mesh dp=2,tp=2")
            if name not in AXES:
                raise TrainerError(f"--mesh {text!r}: unknown axis {name!r}\n  fix: the axes are "
                                   + "; ".join(f"{a} ({AXIS_HELP[a]})" for a in ("dp", "tp", "pp", "cp", "ep", "dp_replicate")))
            if name in sizes:
                raise TrainerError(f"--mesh {text!r}: axis {name!r} given twice")
            if int(size) < 1:
                raise TrainerError(f"--mesh {text!r}: {name}={size}; a size is at least 1")
            sizes[name] = int(size)
        dims = cls(**sizes, spec=text)
        if dims.dp_replicate > 1 and dims.dp == 1:
            raise TrainerError(f"--mesh {text!r}: dp_replicate={dims.dp_replicate} (HSDP) replicates the parameters over "
                               f"its ranks and FSDP2 shards them within each replica over dp (x cp), and dp is 1\n  fix: "
                               f"--mesh dp={dims.dp_replicate} (FSDP2 over all of them), or dp_replicate=R,dp=N (HSDP)")
        if dims.world_size != world_size:
            raise TrainerError(f"--mesh {text or '(none)'} has {dims.world_size} ranks, but {world_size} processes run\n  "
                               f"fix: torchrun --nproc-per-node {dims.world_size} -m fxshard train ..., or a mesh whose "
                               f"sizes multiply to {world_size}")
        return dims

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values()) if self.sizes else 1

    @property
    def sizes(self) -> dict[str, int]:
        """The axes in use (size > 1), in the mesh's order."""
        return {a: getattr(self, a) for a in AXES if getattr(self, a) > 1}

    @property
    def batch_ranks(self) -> int:
        """How many ways the rows of a step are split (dp_replicate x dp): each such rank
        reads its own rows."""
        return self.dp_replicate * self.dp

    @property
    def batch_axes(self) -> list[str]:
        """The mesh axes that split the rows: ``["dp"]`` (under HSDP the dim flattened from
        ``dp_replicate`` x ``dp_shard``, of ``batch_ranks`` ranks), or none."""
        return ["dp"] if self.batch_ranks > 1 else []

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The plan's axes FSDP2 owns (its ``fsdp=``): ``dp`` and ``cp``, the parameters
        sharded over their product (under HSDP replicated over ``dp_replicate``, sharded over
        ``dp_shard`` x ``cp``).  Under pp not cp: the last stage gathers the sequence over cp
        before the head, whose gradient is then whole on every cp rank (fxshard syncs cp's
        shares there; FSDP2 would sum whole ones)."""
        return tuple(a for a, n in (("dp", self.batch_ranks), ("cp", self.cp if self.pp == 1 else 1)) if n > 1)

    @property
    def fsdp_shard_ranks(self) -> int:
        """How many ranks share each parameter's pieces (dp x cp, dp under pp; 1: no FSDP2)."""
        return self.dp * (self.cp if "cp" in self.fsdp_axes else 1)

    @property
    def hsdp(self) -> dict[str, tuple[str, str]] | None:
        """HSDP's split of the batch axis, ``fxshard.fully_shard(..., replicate=)``'s argument:
        ``{"dp": ("dp_replicate", "dp_shard")}``; ``None`` without dp_replicate."""
        return {"dp": ("dp_replicate", "dp_shard")} if self.dp_replicate > 1 else None

    @property
    def plan_axes(self) -> dict[str, int]:
        """The axes a plan shards over within a stage (all but pp; dp_replicate x dp as one dp)."""
        axes = {a: n for a, n in self.sizes.items() if a not in ("pp", "dp_replicate")}
        if self.dp_replicate > 1:
            axes = {"dp": self.batch_ranks, **{a: n for a, n in axes.items() if a != "dp"}}
        return axes

    def describe(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in self.sizes.items()) or "one process"

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` of the axes in use (the process group must exist); ``None``
        for one process.  Under HSDP its dims are ``dp_replicate, dp_shard`` where the batch
        axis is, and ``dp`` their flattening (the plan's, the data's and the loss's axis)."""
        if not self.sizes:
            return None
        import warnings

        from torch.distributed.device_mesh import init_device_mesh

        if self.dp_replicate == 1:
            return init_device_mesh(device_type, tuple(self.sizes.values()), mesh_dim_names=tuple(self.sizes))
        dims = {("dp_shard" if a == "dp" else a): n for a, n in self.sizes.items()}
        dims["dp_shard"] = self.dp
        dims = {a: dims[a] for a in ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp") if a in dims}
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        # mesh["dp"] (a flattened dim sliced from its root) is how the trainer reaches the batch axis
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh

    def dp_rank(self, mesh) -> int:
        """This rank's index among the ``batch_ranks`` row readers."""
        return mesh["dp"].get_local_rank() if mesh is not None and self.batch_ranks > 1 else 0
