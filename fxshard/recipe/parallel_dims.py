"""The parallel state of a training run: one typed object for ``--mesh``.

``ParallelDims.parse("dp=2,pp=2,tp=2", world_size=8)`` checks the axes and sizes before any
work, :meth:`ParallelDims.check` says whether the model, the batch and the sequence divide
over them (the trainer's and the planner's one set of rules), ``build_mesh`` makes the
``DeviceMesh`` in one fixed order (:data:`AXES`: ``pp, dp_replicate, dp, cp, ep, tp``, the
tensor-parallel ranks adjacent, as torchtitan lays them out), and the properties say which
ranks share a batch row, a sequence piece or a stage, and which axes FSDP2 shards the
parameters over (``dp`` and ``cp``: torchtitan's ``dp_shard_cp``) or replicates them over
(``dp_replicate``: HSDP).

Example::

    dims = ParallelDims.parse("dp=2,tp=2", world_size=4)
    mesh = dims.build_mesh("cpu")            # dims ("dp", "tp")
    dims.batch_ranks                         # 2: the global batch is split over dp
    dims.check(batch=8, seq=256, heads=4)    # a MeshError if something does not divide
    hsdp = ParallelDims.parse("dp_replicate=2,dp=2,cp=2", 8)
    hsdp.fsdp_axes, hsdp.batch_ranks           # ('dp', 'cp'), 4: the plan's dp is dp_replicate x dp_shard
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fxshard.errors import PlanError

AXES = ("pp", "dp_replicate", "dp", "cp", "ep", "tp")  # the mesh's dim order
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


class MeshError(PlanError):
    """A mesh that cannot run: an axis the text does not name well, or a size the model, the
    batch or the sequence does not divide.  ``reason`` is the rule broken, in one line (the
    planner's ``PlanEntry.reason``); the message adds the fix.

    Example::

        try:
            ParallelDims(tp=3).check(heads=4)
        except MeshError as e:
            e.reason                    # 'tp=3 does not divide the 4 attention heads'
    """

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(f"{reason}\n  fix: {fix}" if fix else reason)
        self.reason = reason


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
        axis, a repeated one, a size below 1, HSDP without dp or a product other than
        ``world_size`` is a :class:`MeshError` naming ``--mesh``."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, size = part.partition("=")
            name = name.strip()
            if not eq or not size.strip().isdigit():
                raise MeshError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE", "e.g. --mesh dp=2,tp=2")
            if name not in AXES:
                raise MeshError(f"--mesh {text!r}: unknown axis {name!r}", "the axes are " + "; ".join(
                    f"{a} ({AXIS_HELP[a]})" for a in ("dp", "tp", "pp", "cp", "ep", "dp_replicate")))
            if name in sizes:
                raise MeshError(f"--mesh {text!r}: axis {name!r} given twice")
            if int(size) < 1:
                raise MeshError(f"--mesh {text!r}: {name}={size}; a size is at least 1")
            sizes[name] = int(size)
        dims = cls(**sizes, spec=text)
        try:
            dims.check()
        except MeshError as e:
            raise MeshError(f"--mesh {text!r}: {e}") from None
        if dims.world_size != world_size:
            raise MeshError(f"--mesh {text or '(none)'} has {dims.world_size} ranks, but {world_size} processes run",
                            f"torchrun --nproc-per-node {dims.world_size} -m fxshard train ..., or a mesh whose "
                            f"sizes multiply to {world_size}")
        return dims

    def check(self, *, world_size: int | None = None, batch: int | None = None, accum: int = 1,
              microbatches: int = 1, schedule: str | None = None, virtual: int = 1, seq: int | None = None,
              heads: int | None = None, experts: int | None = None, n_blocks: int | None = None) -> None:
        """Raise a :class:`MeshError` for the first rule these degrees break, each checked when
        its argument is given: the ranks (``world_size``); a step's ``batch`` rows over the
        ``batch_ranks``, each rank's rows over ``accum`` passes and each pass over the
        pipeline's ``microbatches`` (``schedule``, ``virtual`` stages per rank); the attention
        ``heads`` over tp; the sequence ``seq`` over cp (in two pieces per rank when
        load-balanced: without pp); the routed ``experts`` over ep (``0``: the model has none); the stages over ``n_blocks``.

        Example::

            ParallelDims(dp=2, pp=2).check(world_size=4, batch=8, microbatches=4, schedule="1F1B", n_blocks=8)
        """
        if self.dp_replicate > 1 and self.dp == 1:
            raise MeshError(f"dp_replicate={self.dp_replicate} (HSDP) replicates the parameters over its ranks and FSDP2 "
                            f"shards them within each replica over dp (x cp), and dp is 1",
                            f"--mesh dp={self.dp_replicate} (FSDP2 over all of them), or dp_replicate=R,dp=N (HSDP)")
        if world_size is not None and self.world_size != world_size:
            raise MeshError(f"the mesh has {self.world_size} ranks, not {world_size}",
                            f"a mesh whose sizes multiply to {world_size}")
        if batch is not None:
            dp = f"dp={self.dp}" if self.dp_replicate == 1 else f"dp_replicate x dp = {self.batch_ranks}"
            if batch % self.batch_ranks:
                raise MeshError(f"{dp} does not divide the global batch of {batch} rows",
                                f"a batch that is a multiple of {self.batch_ranks}")
            rows = batch // self.batch_ranks
            if accum < 1 or rows % accum:
                raise MeshError(f"accum={accum} passes do not divide each dp rank's {rows} rows",
                                f"a batch that is a multiple of {self.batch_ranks * max(accum, 1)}")
            if (rows // accum) % microbatches:
                per = f"each pass's {rows // accum}" if accum > 1 else f"each dp rank's {rows}"
                raise MeshError(f"{microbatches} micro-batches do not divide {per} rows",
                                f"a batch that is a multiple of {self.batch_ranks * accum * microbatches}")
        if heads is not None and (self.tp > heads or heads % self.tp):
            raise MeshError(f"tp={self.tp} does not divide the {heads} attention heads", "a tp that divides them")
        if seq is not None and seq % self.sequence_pieces:
            raise MeshError(f"cp={self.cp} does not divide the sequence of {seq} tokens into {self.sequence_pieces} pieces",
                            f"a sequence that is a multiple of {self.sequence_pieces}")
        if self.ep > 1 and experts == 0:
            raise MeshError(f"ep={self.ep}: the model has no routed experts", "drop ep, or a mixture of experts")
        if self.ep > 1 and experts and experts % self.ep:
            raise MeshError(f"ep={self.ep} does not divide the {experts} experts", "an ep that divides them")
        if n_blocks is not None and self.pp * virtual > n_blocks:
            raise MeshError(f"pp={self.pp} x {virtual} stages per rank is more than the {n_blocks} blocks",
                            "fewer pipeline stages")
        if self.pp > 1 and virtual > 1 and microbatches % self.pp:
            raise MeshError(f"{schedule} needs micro-batches a multiple of pp={self.pp}",
                            f"--microbatches a multiple of {self.pp}")
        if self.pp > 1 and schedule is not None and schedule != "GPipe" and microbatches < self.pp:
            raise MeshError(f"{schedule} needs at least as many micro-batches as pp={self.pp} (torch refuses fewer)",
                            f"--microbatches {self.pp} or more")

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values()) if self.sizes else 1

    @property
    def sizes(self) -> dict[str, int]:
        """The axes in use (size > 1), in the mesh's order."""
        return {a: getattr(self, a) for a in AXES if getattr(self, a) > 1}

    @property
    def mesh_spec(self) -> str:
        """The trainer's ``--mesh`` for these degrees (``"dp=2,tp=2"``; ``""`` for one process)."""
        return ",".join(f"{a}={n}" for a, n in self.sizes.items())

    @property
    def gathers_sequence_before_head(self) -> bool:
        """cp under pp: contiguous sequence pieces, and the final norm's output gathered over
        cp so that the last stage scores whole sequences (docs/pipeline.md)."""
        return self.cp > 1 and self.pp > 1

    @property
    def load_balanced_cp(self) -> bool:
        """cp without pp: each rank holds two pieces of the sequence (one early, one late)."""
        return self.cp > 1 and self.pp == 1

    @property
    def sequence_pieces(self) -> int:
        """How many pieces each sequence is cut into over cp (two per rank when load-balanced)."""
        return 2 * self.cp if self.load_balanced_cp else self.cp

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
        cp = self.cp if not self.gathers_sequence_before_head else 1
        return tuple(a for a, n in (("dp", self.batch_ranks), ("cp", cp)) if n > 1)

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
