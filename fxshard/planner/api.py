"""``fxshard.plan_parallelism``: the meshes a model can train on, ranked by predicted step time.

The layers (docs/planning.md): the model (``model.py``) -> the candidates and their
divisibility (``candidates.py``) -> per sub-plan the program's facts (``facts.py``, once per
distinct tp / cp / ep) -> memory, communication and time by arithmetic (``estimate.py``,
constants from ``calibration.py``) -> the ranking here.

Example::

    entries = fxshard.plan_parallelism("path/to/Llama-3-8B", 64, memory_gib=80, seq=8192,
                                       global_batch=512, device="h100")
    best = entries[0]
    best.mesh_spec, best.step_time_s, best.memory["total"] / 2**30     # 'dp=64', 4.1, 52.3
    print(format_table(entries))
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fxshard.debug.comm_summary import fmt_bytes
from fxshard.errors import PlanError
from fxshard.planner.calibration import Calibration, default_calibration
from fxshard.planner.candidates import Candidate, candidate_from, divisibility, enumerate_candidates
from fxshard.planner.estimate import MEMORY_KEYS, RankEstimate, estimate
from fxshard.planner.facts import Captures, ProgramFacts, SubPlan, program_facts, register_plans
from fxshard.planner.model import PlannedModel
from fxshard.planner.offline import refuse_if_distributed

GIB = 1 << 30


@dataclass
class PlanEntry:
    """One candidate, predicted; ``reason`` says why it cannot run (``None``: it fits)."""

    mesh: dict[str, int]  # {"dp", "tp", "pp", "cp", "ep"} -> degree
    microbatches: int
    schedule: str | None
    activation_checkpointing: bool
    memory: dict[str, float] = field(default_factory=dict)  # bytes on the fullest rank: params ... total
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per step, per axis, the busiest rank
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # per rank: the global batch's tokens over the step time and the ranks
    reason: str | None = None
    virtual: int = 1
    ranks: list[RankEstimate] = field(default_factory=list, repr=False)  # per pipeline rank
    candidate: Candidate | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def mesh_spec(self) -> str:
        """The trainer's ``--mesh``: ``"dp=2,tp=2"``."""
        return self.candidate.mesh_spec

    def trainer_flags(self) -> str:
        """``--mesh ... [--microbatches M --schedule S] [--activation-checkpointing]``."""
        return self.candidate.trainer_flags()


def plan_parallelism(model, world_size: int, *, memory_gib: float | None, example_kwargs: dict | None = None,
                     global_batch: int | None = None, seq: int | None = None, device=None,
                     candidates: list[dict] | None = None, dtype: str | None = None,
                     gpus_per_node: int | None = None) -> list[PlanEntry]:
    """Every candidate mesh of ``world_size`` ranks for training ``model``, best first: those
    that fit ``memory_gib`` per rank by predicted step time, then the rejected with their reason.

    Example::

        entries = fxshard.plan_parallelism(model, 8, memory_gib=80, seq=4096, global_batch=64, device="h100")
        entries[0].mesh_spec            # 'dp=4,tp=2'
        fxshard.plan_parallelism(model, 4, memory_gib=16, seq=512, global_batch=8,
                                 candidates=[{"tp": 2}, {"pp": 2, "tp": 2}])   # just those two (dp: the rest)

    ``model``: an ``nn.Module``, a checkpoint directory or ``config.json`` (built on the meta
    device), or an HF model type.  ``seq`` and ``global_batch`` (rows of ``seq`` tokens per
    optimizer step) may come from ``example_kwargs={"input_ids": ids}``.  ``device``: a
    :class:`Calibration`, a preset name (``"h100"``, ``"h200"``, ``"a100"``, ``"cpu"``), a JSON
    file of ``python -m fxshard plan --calibrate``, or ``None`` (this machine's).  ``dtype``:
    ``"bf16"`` (FSDP2's mixed precision; the default on GPUs) or ``"fp32"``.  ``memory_gib``:
    ``None`` takes the device's.  ``candidates``: evaluate just these (each a dict of axis
    degrees, optionally ``microbatches``, ``schedule``, ``activation_checkpointing``).
    """
    t0 = time.perf_counter()
    refuse_if_distributed()
    seq, global_batch = _sizes(seq, global_batch, example_kwargs)
    cal = device if isinstance(device, Calibration) else default_calibration(device)
    memory_gib = memory_gib if memory_gib is not None else cal.memory_gib
    if memory_gib is None:
        raise PlanError(f"plan_parallelism: how much memory has a rank?\n  fix: memory_gib=80 (the {cal.name} "
                        f"calibration does not say)")
    bf16 = (dtype or cal.dtype) == "bf16"
    planned = PlannedModel.resolve(model)
    n_blocks = len(planned.block_names())
    node = gpus_per_node or cal.gpus_per_node
    if candidates is not None:
        cands = [candidate_from(c, world_size) for c in candidates]
    else:
        cands = enumerate_candidates(world_size, seq=seq, global_batch=global_batch, n_blocks=n_blocks,
                                     heads=planned.heads, experts=planned.experts, gpus_per_node=node)
    reasons = {c.key: divisibility(c, world_size, seq=seq, global_batch=global_batch, n_blocks=n_blocks,
                                   heads=planned.heads, experts=planned.experts) for c in cands}
    subplans = list(dict.fromkeys(c.subplan for c in cands if reasons[c.key] is None))
    captures = Captures(planned, seq)
    refused = register_plans(captures, subplans)
    facts: dict[SubPlan, ProgramFacts | str] = dict(refused)
    entries = []
    for c in cands:
        entry = PlanEntry(dict(c.mesh), c.microbatches, c.schedule, c.activation_checkpointing, virtual=c.virtual,
                          candidate=c, reason=reasons[c.key])
        entries.append(entry)
        if entry.reason is not None:
            continue
        sp = c.subplan
        if sp not in facts:
            try:
                facts[sp] = program_facts(captures, sp, torch.bfloat16 if bf16 else torch.float32)
            except PlanError as e:
                facts[sp] = str(e)
        if isinstance(facts[sp], str):
            entry.reason = "plan refused: " + facts[sp].strip().splitlines()[0]
            continue
        est = estimate(c, facts[sp], global_batch=global_batch, seq=seq, cal=cal, bf16=bf16)
        entry.memory, entry.comm_bytes, entry.step_time_s, entry.ranks = est.memory, est.comm_bytes, est.step_time_s, est.ranks
        entry.tokens_per_s = global_batch * seq / est.step_time_s / world_size
        if est.memory["total"] > memory_gib * GIB:
            entry.reason = f"memory: {est.memory['total'] / GIB:.1f} GiB on a rank > {memory_gib:g} GiB"
    entries.sort(key=_rank_key)
    plan_parallelism.last_seconds = time.perf_counter() - t0
    return entries


def best_mesh(model_source_or_model, world_size: int, memory_gib: float | None, seq: int, global_batch: int,
              **kwargs) -> str:
    """The ``--mesh`` of the best candidate that fits (``"dp=2,tp=2"``; ``""`` for one rank).

    Example: ``best_mesh("path/to/checkpoint", 8, 80, seq=4096, global_batch=64, device="h100")``

    A PlanError naming the fix when nothing fits.  Other keywords go to :func:`plan_parallelism`.
    """
    entries = plan_parallelism(model_source_or_model, world_size, memory_gib=memory_gib, seq=seq,
                               global_batch=global_batch, **kwargs)
    if not entries or not entries[0].fits:
        why = entries[0].reason if entries else "no candidate"
        raise PlanError(f"no mesh of {world_size} ranks fits (the closest: {entries[0].mesh_spec if entries else '-'}, "
                        f"{why})\n  fix: more ranks or memory, a smaller global batch or sequence, or "
                        f"--activation-checkpointing candidates (python -m fxshard plan ... lists them all)")
    return entries[0].mesh_spec


def format_table(entries: list[PlanEntry], top: int = 12, rejected: int = 8) -> str:
    """The best ``top`` entries and the first ``rejected`` rejected ones, one line each."""
    fits = [e for e in entries if e.fits][:top]
    bad = [e for e in entries if not e.fits][:rejected]
    head = ["#", "mesh", "M", "schedule", "AC", "params", "grads", "optimizer", "activations", "transient", "total",
            "comm per step", "step s", "tokens/s/rank"]
    rows = []
    for i, e in enumerate(fits + bad):
        mem = [fmt_bytes(e.memory.get(k, 0)) for k in MEMORY_KEYS] if e.memory else [""] * len(MEMORY_KEYS)
        comm = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in e.comm_bytes.items()) or "-"
        rows.append([str(i + 1) if e.fits else "x", e.mesh_spec or "1", str(e.microbatches), e.schedule or "-",
                     "yes" if e.activation_checkpointing else "", *mem, comm,
                     f"{e.step_time_s:.3g}" if e.step_time_s is not None else "",
                     f"{e.tokens_per_s:,.0f}" if e.tokens_per_s is not None else ""])
    widths = [max(len(r[k]) for r in [head] + rows) for k in range(len(head))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(head, widths))]
    for e, r in zip(fits + bad, rows):
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
                     + ("" if e.fits else f"   rejected: {e.reason}"))
    return "\n".join(lines)


def _rank_key(e: PlanEntry):
    order = 0 if e.fits else (1 if e.reason.startswith("memory") else 2 if e.reason.startswith("plan") else 3)
    return order, e.step_time_s if e.step_time_s is not None else float("inf"), e.memory.get("total", 0)


def _sizes(seq, global_batch, example_kwargs) -> tuple[int, int]:
    ids = next((v for v in (example_kwargs or {}).values() if isinstance(v, torch.Tensor) and v.dim() == 2), None)
    if seq is None and ids is not None:
        seq = ids.shape[1]
    if global_batch is None and ids is not None:
        global_batch = ids.shape[0]
    if seq is None or global_batch is None:
        raise PlanError("plan_parallelism: the sequence length and the global batch (rows per optimizer step) set "
                        "the activations and the time\n  fix: seq=..., global_batch=... (or example_kwargs="
                        "{'input_ids': ids} of the global batch)")
    return int(seq), int(global_batch)
