"""The pipeline part of a plan: which mesh axis holds the stages, how many micro-batches,
which of torch's schedules runs them, where the model is cut."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from fxshard.errors import PlanError

# torch's schedules that run more than one stage per rank, and how a rank's stages are placed:
# "loop" (rank r holds stages r, r + pp, ...) or "v" (rank r holds stages r and 2 pp - 1 - r)
_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """Pipeline parallelism over mesh axis ``axis``; made by :func:`pipeline` (see there)."""

    axis: str
    microbatches: int
    schedule: str
    split: tuple[str, ...] | None
    virtual: int

    @property
    def schedule_class(self) -> type:
        """torch's schedule class of :attr:`schedule`."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        return get_schedule_class(self.schedule)

    @property
    def multi_stage(self) -> bool:
        """Does the schedule run several stages per rank (``virtual > 1``)?"""
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        return issubclass(self.schedule_class, PipelineScheduleMulti)

    @property
    def style(self) -> str:
        """``"v"`` (rank r holds stages r and 2 pp - 1 - r) or ``"loop"`` (r, r + pp, ...)."""
        return "v" if self.schedule_class.__name__.removeprefix("Schedule") in _V_SCHEDULES else "loop"

    def num_stages(self, pp: int) -> int:
        return pp * self.virtual

    def stages_of_rank(self, rank: int, pp: int) -> list[int]:
        """The stage indices pipeline rank ``rank`` (its coordinate on :attr:`axis`) holds, in order."""
        if self.style == "v":
            return [rank, 2 * pp - 1 - rank]
        return [rank + v * pp for v in range(self.virtual)]

    def rank_of_stage(self, stage: int, pp: int) -> int:
        if self.style == "v":
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def bubble(self, pp: int) -> float:
        """The idle fraction of the schedule in theory, with equal stages (GPipe / 1F1B:
        ``(pp - 1) / (M + pp - 1)``; interleaved: ``(pp - 1) / (v M + pp - 1)``, Megatron's)."""
        return (pp - 1) / (self.virtual * self.microbatches + pp - 1)


def pipeline(axis: str = "pp", microbatches: int = 1, schedule: str = "1F1B", split: Sequence[str] | None = None,
             virtual: int = 1) -> PipelineSpec:
    """Pipeline parallelism over mesh axis ``axis``: the model is cut into stages at
    transformer-block boundaries, each rank on ``axis`` holds its stage(s), and torch's
    ``torch.distributed.pipelining`` schedule ``schedule`` runs ``microbatches``
    micro-batches through them.

    Example::

        spec = fxshard.pipeline("pp", microbatches=4, schedule="1F1B")
        staged = fxshard.pipeline_transform(model, plan, spec, mesh, example_kwargs={"input_ids": ids, "labels": labels})
        loss = fxshard.train_step(staged, {"input_ids": ids, "labels": labels})

    ``schedule``: a name of torch's schedules (``get_schedule_class``): ``"GPipe"``, ``"1F1B"``,
    ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"`` (those three with
    ``virtual >= 2`` stages per rank), ``"ZBVZeroBubble"``, ``"DualPipeV"`` (``virtual=2``).
    ``split``: ``None`` balances the stages by cost (FLOPs, parameter bytes and activation bytes
    per block, the embedding and the head counted), or the FQN of the first block of each stage after the
    first (``["layers.2"]``; a suffix of the full FQN is enough).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    if not isinstance(axis, str) or not axis:
        raise PlanError(f"fxshard.pipeline: axis must be a mesh dim name, got {axis!r}\n  fix: fxshard.pipeline(\"pp\", ...)")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"fxshard.pipeline: microbatches must be a positive int, got {microbatches!r}\n"
                        f"  fix: microbatches=M with M dividing the batch (M >= the number of stages keeps the bubble small)")
    if not isinstance(virtual, int) or virtual < 1:
        raise PlanError(f"fxshard.pipeline: virtual must be a positive int (stages per rank), got {virtual!r}")
    try:
        cls = get_schedule_class(schedule)
    except (ValueError, TypeError) as e:
        raise PlanError(f"fxshard.pipeline: unknown schedule {schedule!r}: {e}\n"
                        f"  fix: schedule= one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                        f"ZBVZeroBubble, DualPipeV") from None
    name = cls.__name__.removeprefix("Schedule")
    if name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        raise PlanError(f"fxshard.pipeline: {schedule!r} is torch's base class, not a schedule\n"
                        f"  fix: schedule=\"1F1B\" (one stage per rank) or \"Interleaved1F1B\" with virtual=2")
    multi = issubclass(cls, PipelineScheduleMulti)
    if multi and name in _V_SCHEDULES and virtual != 2:
        raise PlanError(f"fxshard.pipeline: schedule {name!r} runs exactly 2 stages per rank (a V), got virtual={virtual}\n"
                        f"  fix: fxshard.pipeline({axis!r}, schedule={name!r}, virtual=2, ...)")
    if multi and virtual < 2:
        raise PlanError(f"fxshard.pipeline: schedule {name!r} runs several stages per rank, but virtual=1\n"
                        f"  fix: fxshard.pipeline({axis!r}, schedule={name!r}, virtual=2, ...), or schedule=\"1F1B\" for one "
                        f"stage per rank")
    if not multi and virtual > 1:
        raise PlanError(f"fxshard.pipeline: schedule {name!r} runs one stage per rank, but virtual={virtual}\n"
                        f"  fix: schedule=\"Interleaved1F1B\" (or another interleaved schedule) with virtual={virtual}, "
                        f"or virtual=1")
    if split is not None:
        if isinstance(split, str) or not all(isinstance(s, str) and s for s in split):
            raise PlanError(f"fxshard.pipeline: split must be a list of module FQNs (the first block of each stage after "
                            f"the first), got {split!r}\n  fix: split=[\"layers.2\"]")
        split = tuple(split)
    return PipelineSpec(axis, microbatches, name, split, virtual)


def check_plan_pipeline(spec, plan_axes) -> None:
    """``Plan(..., pipeline=spec)``: a :class:`PipelineSpec` on an axis the plan does not shard over."""
    if not isinstance(spec, PipelineSpec):
        raise PlanError(f"Plan(pipeline=...): expected fxshard.pipeline(\"pp\", ...), got {type(spec).__name__}\n  fix: "
                        f"Plan(mesh[\"tp\"], specs, pipeline=fxshard.pipeline(\"pp\", microbatches=4))")
    if spec.axis in plan_axes:
        others = [a for a in plan_axes if a != spec.axis]
        raise PlanError(f"Plan(pipeline=...): the pipeline axis {spec.axis!r} is an axis of the plan's mesh {list(plan_axes)}; "
                        f"a plan shards within a stage\n  fix: build the plan on the other axes, Plan(mesh[{others!r}], ...), "
                        f"and give the whole mesh to fxshard.pipeline_transform")
