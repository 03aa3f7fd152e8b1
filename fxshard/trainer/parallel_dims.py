"""The trainer's parallel state: one typed object for ``--mesh``.

``ParallelDims.parse("dp=2,pp=2,tp=2")`` checks the axes and sizes before any work,
``build_mesh`` makes the ``DeviceMesh`` in one fixed order (``pp, dp, cp, ep, tp``: the
tensor-parallel ranks adjacent, as torchtitan lays them out), and the properties say
which ranks share a batch row, a sequence piece or a stage.

Example::

    dims = ParallelDims.parse("dp=2,tp=2", world_size=4)
    mesh = dims.build_mesh("cpu")            # dims ("dp", "tp")
    dims.batch_ranks                         # 2: the global batch is split over dp
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fxshard.trainer.errors import TrainerError

AXES = ("pp", "dp", "cp", "ep", "tp")
AXIS_HELP = {
    "dp": "data parallel: the batch split over its ranks, parameters sharded by FSDP2",
    "tp": "tensor parallel: the model's own plan (HF's base_model_tp_plan, torchtitan's plan)",
    "pp": "pipeline parallel: the blocks cut into stages (fxshard.pipeline_transform), --microbatches, --schedule",
    "cp": "context parallel: the sequence split over its ranks around each attention",
    "ep": "expert parallel: a mixture of experts' routed experts split over its ranks (HF's base_model_ep_plan)",
}


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism (1: not used); their product is the world size."""

    dp: int = 1
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
                                   + "; ".join(f"{a} ({AXIS_HELP[a]})" for a in ("dp", "tp", "pp", "cp", "ep")))
            if name in sizes:
                raise TrainerError(f"--mesh {text!r}: axis {name!r} given twice")
            if int(size) < 1:
                raise TrainerError(f"--mesh {text!r}: {name}={size}; a size is at least 1")
            sizes[name] = int(size)
        dims = cls(**sizes, spec=text)
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
        """How many ways the rows of a step are split (dp): each such rank reads its own rows."""
        return self.dp

    @property
    def plan_axes(self) -> dict[str, int]:
        """The axes a plan shards over within a stage (all but pp)."""
        return {a: n for a, n in self.sizes.items() if a != "pp"}

    def describe(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in self.sizes.items()) or "one process"

    def build_mesh(self, device_type: str):
        """The ``DeviceMesh`` of the axes in use (the process group must exist); ``None``
        for one process."""
        if not self.sizes:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(self.sizes.values()), mesh_dim_names=tuple(self.sizes))

    def dp_rank(self, mesh) -> int:
        return mesh["dp"].get_local_rank() if mesh is not None and self.dp > 1 else 0
