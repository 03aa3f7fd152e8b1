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
from fxshard.errors import InternalError, PlanError
from fxshard.planner.calibration import Calibration, default_calibration, rank_memory_gib
from fxshard.planner.candidates import Candidate, accum_choices, candidate_from, divisibility, enumerate_candidates
from fxshard.planner.estimate import MEMORY_KEYS, RankEstimate, estimate
from fxshard.planner.facts import Captures, ProgramFacts, SubPlan, program_facts, register_plans
from fxshard.planner.model import PlannedModel
from fxshard.planner.offline import refuse_if_distributed
from fxshard.recipe.parallel_dims import ParallelDims

GIB = 1 << 30


@dataclass
class PlanEntry:
    """One candidate, predicted; ``reason`` says why it cannot run (``None``: it fits).
    ``accum``: the gradient-accumulation passes per step (the trainer's ``--accum``), the
    fewest that fit.  ``error``: the :class:`~fxshard.errors.InternalError` of its sub-plan,
    when planning it hit a bug in fxshard (the other entries are planned all the same)."""

    mesh: dict[str, int]  # {"dp", "tp", "pp", "cp", "ep"} -> degree
    microbatches: int
    schedule: str | None
    activation_checkpointing: str  # the trainer's --activation-checkpointing: none, selective, full
    memory: dict[str, float] = field(default_factory=dict)  # bytes on the fullest rank: params ... total
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per step, per axis, the busiest rank
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # per rank: the global batch's tokens over the step time and the ranks
    reason: str | None = None
    virtual: int = 1
    ranks: list[RankEstimate] = field(default_factory=list, repr=False)  # per pipeline rank
    candidate: Candidate | None = field(default=None, repr=False)
    accum: int = 1
    error: InternalError | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def mesh_spec(self) -> str:
        """The trainer's ``--mesh``: ``"dp=2,tp=2"``."""
        return self.candidate.mesh_spec

    @property
    def dims(self) -> ParallelDims:
        """The mesh as the trainer's typed state (what ``python -m fxshard train --mesh auto`` runs)."""
        return self.candidate.dims

    def trainer_flags(self) -> str:
        """``--mesh ... [--accum A [--accum-grads sharded]] [--microbatches M --schedule S]
        [--activation-checkpointing MODE]``."""
        return self.candidate.trainer_flags()


def plan_parallelism(model, world_size: int, *, memory_gib: float | None, example_kwargs: dict | None = None,
                     global_batch: int | None = None, seq: int | None = None, device=None,
                     candidates: list[dict] | None = None, dtype: str | None = None,
                     gpus_per_node: int | None = None, accum: int | None = None,
                     accum_grads: str | None = None, compiled: bool = False) -> list[PlanEntry]:
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
    ``None`` takes the device's (:func:`~fxshard.planner.calibration.rank_memory_gib`: a GPU's
    total, a CPU's memory over the ranks that share it; ``plan_parallelism.last_memory`` says
    which).  ``candidates``: evaluate just these (each a dict of axis degrees, optionally
    ``microbatches``, ``schedule``, ``activation_checkpointing`` (``"none"``, ``"selective"``,
    ``"full"``, ``"selective:K"``; ``True``: full), ``accum``).  Unless given, every candidate is
    predicted in each activation checkpointing mode (``none``, ``selective``, ``full``).

    Each candidate runs in the fewest gradient-accumulation passes that fit, unless it names
    its own or ``accum`` fixes them for all (the trainer's ``--accum``); between them FSDP2's
    gradients wait unsharded, or sharded where that does not fit, unless a candidate names its
    ``accum_grads`` or ``accum_grads`` fixes it for all (``--accum-grads``).  ``compiled``: the
    program runs compiled by inductor (the trainer's ``--compile inductor``): its elementwise
    ops are timed as the fused kernels they become (``fxshard/planner/fusion.py``; memory stays
    the eager program's, an upper bound).  A bug met while planning one sub-plan (a tp/cp/ep program) is an
    :class:`~fxshard.errors.InternalError` naming it, on that sub-plan's entries (``error``,
    and a ``reason`` starting ``internal error``); the other sub-plans are planned.
    """
    t0 = time.perf_counter()
    refuse_if_distributed()
    seq, global_batch = _sizes(seq, global_batch, example_kwargs)
    cal = device if isinstance(device, Calibration) else default_calibration(device)
    if memory_gib is None:
        memory_gib, where = rank_memory_gib(cal, world_size, this_machine=device is None)
    else:
        where = "given"
    plan_parallelism.last_memory = (float(memory_gib), where)
    bf16 = (dtype or cal.dtype) == "bf16"
    planned = PlannedModel.resolve(model)
    n_blocks = len(planned.block_names())
    node = gpus_per_node or cal.gpus_per_node
    if candidates is not None:
        cands = [candidate_from(c, world_size) for c in candidates]
        fixed_accum = ["accum" in spec for spec in candidates]  # by position: {"dp": 2} and {"dp": 2, "accum": 1} differ
        fixed_grads = ["accum_grads" in spec for spec in candidates]
    else:
        cands = enumerate_candidates(world_size, seq=seq, global_batch=global_batch, n_blocks=n_blocks,
                                     heads=planned.heads, experts=planned.experts, gpus_per_node=node)
        fixed_accum = [False] * len(cands)
        fixed_grads = [False] * len(cands)
    if accum is not None:
        cands = [c.with_accum(int(accum)) for c in cands]
        fixed_accum = [True] * len(cands)
    if accum_grads is not None:
        cands = [c.with_accum(c.accum, accum_grads) for c in cands]
        fixed_grads = [True] * len(cands)
    reasons = {c.key: divisibility(c, world_size, seq=seq, global_batch=global_batch, n_blocks=n_blocks,
                                   heads=planned.heads, experts=planned.experts) for c in cands}
    subplans = list(dict.fromkeys(c.subplan for c in cands if reasons[c.key] is None))
    captures = Captures(planned, seq)
    facts: dict[SubPlan, ProgramFacts | str | InternalError] = {}
    for sp in subplans:  # one at a time: a bug in one sub-plan's plan leaves the others' captures alone
        try:
            facts.update(register_plans(captures, [sp]))
        except Exception as e:  # noqa: BLE001 - not a refusal (PlanError): a bug, reported on its sub-plan
            facts[sp] = subplan_internal_error(sp, e)
    entries = []
    for c, fixed, grads_fixed in zip(cands, fixed_accum, fixed_grads):
        entry = PlanEntry(dict(c.mesh), c.microbatches, c.schedule, c.activation_checkpointing, virtual=c.virtual,
                          candidate=c, reason=reasons[c.key], accum=c.accum)
        entries.append(entry)
        if entry.reason is not None:
            continue
        sp = c.subplan
        if sp not in facts:
            try:
                facts[sp] = program_facts(captures, sp, torch.bfloat16 if bf16 else torch.float32)
            except PlanError as e:
                facts[sp] = str(e)
            except Exception as e:  # noqa: BLE001 - a bug in fxshard: this sub-plan's, not the plan's end
                facts[sp] = subplan_internal_error(sp, e)
        if isinstance(facts[sp], InternalError):
            _internal(entry, facts[sp])
            continue
        if isinstance(facts[sp], str):
            entry.reason = "plan refused: " + facts[sp].strip().splitlines()[0]
            continue
        choices = [c.accum] if fixed else accum_choices(c, global_batch)
        try:
            chosen, est = _fewest_passes(c, choices, facts[sp], memory_gib * GIB, grads_fixed, global_batch=global_batch,
                                         seq=seq, cal=cal, bf16=bf16, compiled=compiled)
        except Exception as e:  # noqa: BLE001 - the arithmetic's bug: this sub-plan's entries only
            _internal(entry, subplan_internal_error(sp, e))
            continue
        entry.candidate, entry.accum = chosen, chosen.accum
        entry.memory, entry.comm_bytes, entry.step_time_s, entry.ranks = est.memory, est.comm_bytes, est.step_time_s, est.ranks
        entry.tokens_per_s = global_batch * seq / est.step_time_s / world_size
        if est.memory["total"] > memory_gib * GIB:
            most = f" (in {chosen.accum} accumulation passes, the most)" if len(choices) > 1 else ""
            entry.reason = f"memory: {est.memory['total'] / GIB:.1f} GiB on a rank > {memory_gib:g} GiB{most}"
    entries.sort(key=_rank_key)
    plan_parallelism.last_seconds = time.perf_counter() - t0
    return entries


def _fewest_passes(c: Candidate, choices: list[int], facts: ProgramFacts, budget: float, grads_fixed: bool = False,
                   **kw):
    """The candidate in the fewest accumulation passes of ``choices`` (ascending) whose memory
    fits ``budget`` bytes, and its estimate; none fitting: the most passes (the least memory).
    Each pass adds its own costs (FSDP2's gathers, the kernels' fixed cost, a pipeline's fill),
    so the fewest passes that fit is the fastest.  From 2 passes on the memory only falls with
    more (the activations shrink, FSDP2's accumulated gradients stay), so a bisection finds them.
    Under FSDP2 (unless ``grads_fixed``) both places its gradients may wait between the passes
    are tried, unsharded and sharded (a reduce-scatter every pass: fewer passes may fit), and
    the faster that fits is taken (the one with less memory when neither does)."""
    tries = [_fewest_passes_of(c, choices, facts, budget, **kw)]
    sharded = c.with_accum(choices[-1], "sharded")
    if not grads_fixed and c.accum_grads != "sharded" and sharded.sharded_grads:
        tries.append(_fewest_passes_of(c.with_accum(c.accum, "sharded"), choices, facts, budget, **kw))
    fitting = [t for t in tries if t[1].memory["total"] <= budget]
    if fitting:
        return min(fitting, key=lambda t: t[1].step_time_s)
    return min(tries, key=lambda t: t[1].memory["total"])


def _fewest_passes_of(c: Candidate, choices: list[int], facts: ProgramFacts, budget: float, **kw):
    """:func:`_fewest_passes` with ``c``'s own ``accum_grads``: the bisection."""
    def at(i: int):
        cand = c.with_accum(choices[i])
        return cand, estimate(cand, facts, **kw)

    fits = lambda found: found[1].memory["total"] <= budget  # noqa: E731
    first = at(0)
    if fits(first) or len(choices) == 1:
        return first
    lo, hi = 1, len(choices) - 1
    found = at(hi)
    if not fits(found):
        return found
    while lo < hi:  # choices[hi] fits (found); the first that does
        mid = (lo + hi) // 2
        got = at(mid)
        if fits(got):
            hi, found = mid, got
        else:
            lo = mid + 1
    return found


def subplan_internal_error(subplan: SubPlan, e: BaseException) -> InternalError:
    """``e``, raised while planning ``subplan``, as the InternalError that names it (a bug in
    fxshard, not a refusal: the sub-plan's entries carry it, the other sub-plans are planned).

    Example: ``subplan_internal_error(SubPlan(tp=3), KeyError("x")).subplan   # SubPlan(tp=3)``"""
    inner = e.original if isinstance(e, InternalError) and e.original is not None else e
    located = e if isinstance(e, InternalError) else InternalError.from_exception("plan_parallelism", e)
    what = str(e).splitlines()[0] if isinstance(e, InternalError) else f"{type(e).__name__}: {e}"
    err = InternalError(located.pass_name, f"planning sub-plan {subplan}: {what}", original=inner,
                        location=located.location)
    err.subplan = subplan
    err.__cause__ = e
    return err


def _internal(entry: PlanEntry, err: InternalError) -> None:
    entry.error = err
    what = str(err).splitlines()[0].split(f"planning sub-plan {err.subplan}: ", 1)[-1]
    where = f" ({err.location})" if err.location else ""
    entry.reason = f"internal error in sub-plan {err.subplan}{where}: {what} (a bug in fxshard: please report it)"


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
    """The best ``top`` entries and the first ``rejected`` rejected ones, one line each
    (``accum``: gradient-accumulation passes per step; ``M``: the pipeline's micro-batches)."""
    fits = [e for e in entries if e.fits][:top]
    bad = [e for e in entries if not e.fits][:rejected]
    head = ["#", "mesh", "accum", "M", "schedule", "AC", *MEMORY_KEYS, "comm per step", "step s", "tokens/s/rank"]
    rows = []
    for i, e in enumerate(fits + bad):
        mem = [fmt_bytes(e.memory.get(k, 0)) for k in MEMORY_KEYS] if e.memory else [""] * len(MEMORY_KEYS)
        comm = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in e.comm_bytes.items()) or "-"
        rows.append([str(i + 1) if e.fits else "x", e.mesh_spec or "1", str(e.accum), str(e.microbatches), e.schedule or "-",
                     e.activation_checkpointing if e.activation_checkpointing != "none" else "-", *mem, comm,
                     f"{e.step_time_s:.3g}" if e.step_time_s is not None else "",
                     f"{e.tokens_per_s:,.0f}" if e.tokens_per_s is not None else ""])
    widths = [max(len(r[k]) for r in [head] + rows) for k in range(len(head))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(head, widths))]
    for e, r in zip(fits + bad, rows):
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
                     + ("" if e.fits else f"   rejected: {e.reason}"))
    return "\n".join(lines)


def _rank_key(e: PlanEntry):
    order = 0 if e.fits else (1 if e.reason.startswith("memory") else 2 if e.reason.startswith("plan") else
                              3 if e.reason.startswith("internal") else 4)
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
