"""A candidate's memory, communication and step time, by arithmetic on its sub-plan's facts.

Per pipeline rank (all ranks are alike without pp):

- **which blocks**: pp cuts the stack where ``fxshard.pipeline_transform`` cuts it: one function,
  ``fxshard.pipelining.stage_costs`` (FLOPs, parameter bytes, activation bytes of each unit, from
  the program's recorded shapes at one micro-batch, a block's whatever wraps it) and its balance;
- **memory**: parameters are the program's local shapes, divided by FSDP2 over dp x cp (dp
  under pp) the way the trainer's FSDP2 cuts them (``fsdp_shard_numel``: dim 0, or the first dim those
  ranks divide, such as an ep rank's stacked experts' dim 1; padded where none divides); gradients as many bytes (fp32), and under
  gradient accumulation (``accum > 1``) with FSDP2 the unsharded fp32 gradients it accumulates
  between the passes (the trainer's ``no_sync``: ``set_requires_gradient_sync(False)``; none with
  ``--accum-grads sharded``, which reduce-scatters every pass); AdamW
  two states of the same size.  Activations: what each block keeps for the backward at this
  micro-batch's rows, times the micro-batches in flight (1F1B: ``pp - rank``; GPipe: all;
  interleaved: torch's warm-up); with full activation checkpointing each block keeps its
  inputs and one block's recompute is alive; with selective (per op) also its saved ops'
  outputs (matmuls, attention, collectives: measured with the trainer's policy), and one
  block's recomputation of the rest; ``selective:K``: every K-th block in full.  ``transient``: under FSDP2, two blocks gathered
  (the current one and the prefetched) with one block's unsharded gradients, and the root's
  parameters, which FSDP2 keeps gathered from the forward to the backward; a pipeline stage under
  FSDP2 holds all its parameters gathered and its gradients unsharded through a pass (torch's
  schedule reshards and reduce-scatters after the pass's last backward);
- **communication** per step and axis, counted as ``fxshard.comm_summary`` counts (a call's
  larger buffer, sends and receives both): the program's collectives times the micro-batches
  (activations scaled to the micro-batch's rows), pp's sends and receives of what crosses each
  cut, the step's loss broadcast and tied-gradient sums, and FSDP2's all-gathers (forward,
  and again in the backward for blocks) and reduce-scatters;
- **time**: a roofline per micro-batch (matmul FLOPs at the calibrated rate, the bytes of every
  other kernel at the memory bandwidth, a fixed cost per kernel; ``compiled``: a block's as the
  kernels inductor fuses them into, ``fusion.py``, the root program's eager, as
  ``fxshard.compile`` leaves it; backward twice the forward,
  plus one forward of every checkpointed block under full checkpointing, the ops it does not
  save under selective), each collective's latency plus its
  ring bytes over its link (within a node or not, from where the axis's ranks sit), the
  pipeline's ``(M + pp - 1)`` slots of the slowest rank (interleaved: ``M + (pp - 1) / v``),
  FSDP2's transfers where they outlast the compute they overlap (the calibration's ``overlap``:
  all of it on GPUs, none on a CPU, whose cores run both) plus the first all-gather, and AdamW's
  pass over the rank's state.

Example::

    est = estimate(candidate, facts, global_batch=512, seq=8192, cal=Calibration.named("h100"))
    est.memory["total"], est.comm_bytes, est.step_time_s
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fxshard.plan.pipeline import pipeline
from fxshard.pipelining.stage_costs import balanced_stages
from fxshard.planner.calibration import Calibration
from fxshard.planner.candidates import Candidate
from fxshard.planner.facts import ROWS, ProgramFacts, UnitFacts
from fxshard.planner.offline import AFTER, BEFORE
from fxshard.recipe.parallel_dims import AXES as TRAINER_ORDER  # the mesh's dim order
from fxshard.training.fsdp import fsdp_shard_numel

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "transient", "loss", "total")


@dataclass
class RankEstimate:
    """One pipeline rank's share (the only one without pp)."""

    pp_rank: int
    stages: list[int]
    blocks: list[int]
    memory: dict[str, float]
    comm: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)  # per micro-batch: compute, comm; per step: fsdp, optimizer


@dataclass
class Estimate:
    ranks: list[RankEstimate]
    step_time_s: float

    @property
    def memory(self) -> dict[str, float]:
        """The fullest rank's memory."""
        return max(self.ranks, key=lambda r: r.memory["total"]).memory

    @property
    def comm_bytes(self) -> dict[str, float]:
        """Per axis, the most any rank moves in a step."""
        axes = {a for r in self.ranks for a in r.comm}
        return {a: max(r.comm.get(a, 0.0) for r in self.ranks) for a in TRAINER_ORDER if a in axes}


def estimate(c: Candidate, facts: ProgramFacts, *, global_batch: int, seq: int, cal: Calibration,
             bf16: bool = False, compiled: bool = False) -> Estimate:
    m = c.mesh
    dp, pp, v, M, A = m["dp"], m["pp"], c.virtual, c.microbatches, c.accum
    fsdp = dp * (m.get("cp", 1) if pp == 1 else 1)  # FSDP2 shards over dp x cp (the trainer's; under pp over dp)
    n = facts.n_blocks
    rows = c.micro_rows(global_batch)  # one micro-batch on one rank: of one of the A accumulation passes
    spec = _spec(c)
    stage_of_block = _stages(facts, c, global_batch) if pp > 1 else [0] * n
    num_stages = pp * v if pp > 1 else 1
    stage_blocks = [[i for i in range(n) if stage_of_block[i] == s] for s in range(num_stages)]
    act_scale = 0.5 if bf16 else 1.0
    ranks = []
    for r in range(pp):
        stages = spec.stages_of_rank(r, pp) if pp > 1 else [0]
        blocks = [i for s in stages for i in stage_blocks[s]]
        first, last = 0 in stages, num_stages - 1 in stages
        units = [facts.block(i) for i in blocks] + ([facts.before] if first else []) + ([facts.after] if last else [])
        params = sum(_fsdp_bytes(u.params, fsdp) for u in units)
        if last and not first:  # a tied embedding and head: the last stage holds a copy
            params += _fsdp_bytes([p for p in facts.before.params if p[0] in facts.tied], fsdp)
        ac_mode, ckpt = _checkpointed(c, blocks)
        act = sum(_stage_activations(facts, stage_blocks, s, num_stages, rows, ac_mode, ckpt) for s in stages)
        act *= _in_flight(c, r) / len(stages)
        # accumulating, FSDP2 keeps each block's unsharded gradient (fp32, its reduce dtype) until the last pass
        # (with --accum-grads sharded it reduce-scatters every pass instead: its sharded gradients accumulate);
        # under pp torch's schedule reduce-scatters after every pass, and holds the stage's instead (transient)
        accumulated = sum(u.param_bytes for u in units) if A > 1 and fsdp > 1 and pp == 1 and not c.sharded_grads else 0.0
        # the step's peak on the last stage: the loss's backward starts with every kept tensor alive; no block
        # is being recomputed then, so only what its gradients exceed a recomputation's working set by is added
        loss_working = facts.after.backward_working.at(rows) if last else 0.0
        memory = {"params": params, "grads": params + accumulated, "optimizer": 2 * params, "activations": act,
                  "transient": (_stage_held(units, bf16) if pp > 1 and fsdp > 1 else
                                _fsdp_transient(facts, blocks, first, last, fsdp, bf16)),
                  "loss": max(0.0, loss_working - _recompute_working(facts, blocks, rows, ac_mode, ckpt))}
        memory["total"] = sum(memory.values())
        comm, comm_s = _plan_comm(units, rows, M, bf16, m, cal, pipelined=pp > 1, recompute=len(ckpt) / len(blocks) if blocks else 0.0, mode=ac_mode)
        p2p, p2p_s = _p2p(facts, stage_blocks, stages, spec, c, r, rows, act_scale, m, cal)
        for a, b in p2p.items():
            comm[a] = comm.get(a, 0.0) + b
        comm = {a: b * A for a, b in comm.items()}  # each pass runs the program's collectives and the pipeline's sends
        fsdp_axis = "dp" if dp > 1 else "cp"  # the outer of FSDP2's axes: its link spans both
        fsdp_bytes, fsdp_s, first_gather_s = _fsdp_comm(units, fsdp, pp, bf16, m, cal, accum=A, axis=fsdp_axis,
                                                        reduce_every_pass=c.sharded_grads or pp > 1)
        if fsdp_bytes:
            comm[fsdp_axis] = comm.get(fsdp_axis, 0.0) + fsdp_bytes
        # fxshard.compile compiles the blocks; the root program (embedding, head, loss) stays eager
        fwd = sum(_forward_seconds(u, rows, cal, compiled and u.name not in (BEFORE, AFTER)) for u in units)
        recompute = sum(_recompute_seconds(facts.block(i), rows, cal, ac_mode, compiled) for i in ckpt)
        ranks.append(RankEstimate(r, stages, blocks, memory, comm, {
            "compute": 3 * fwd + recompute, "comm": comm_s + p2p_s, "fsdp": fsdp_s, "fsdp_exposed": first_gather_s,
            "optimizer": 7 * params / (cal.memory_gbps * 1e9)}))
    # ranks sharing a CPU's cores: computing together, each runs at cores / ranks of its speed alone; a rank
    # idle in a pipeline's bubble lends its core, so a pipeline takes at least the node's work over its cores
    ranks_per_node = min(_world(m), cal.gpus_per_node)
    shared = max(1.0, ranks_per_node / cal.cores) if cal.cores else 1.0
    slots = M + (pp - 1) / v if pp > 1 else 1
    if pp == 1:
        pipeline_s = max(rk.seconds["compute"] * shared + rk.seconds["comm"] for rk in ranks)
    else:
        per_mb = max(rk.seconds["compute"] + rk.seconds["comm"] for rk in ranks)
        node_work = sum(rk.seconds["compute"] for rk in ranks) * M * ranks_per_node / pp
        pipeline_s = max(slots * per_mb, node_work / cal.cores if cal.cores else 0.0)
    compute_s = max(rk.seconds["compute"] for rk in ranks) * M * A
    # each pass starts with an all-gather that nothing overlaps
    fsdp_s = max(max(0.0, rk.seconds["fsdp"] - cal.overlap * compute_s) + cal.overlap * A * rk.seconds["fsdp_exposed"]
                 for rk in ranks)
    step = A * pipeline_s + fsdp_s + max(rk.seconds["optimizer"] for rk in ranks) * shared
    return Estimate(ranks, step)


def _world(mesh: dict) -> int:
    return math.prod(mesh.values())


# ----------------------------------------------------------------------------- stages


def _spec(c: Candidate):
    if c.mesh["pp"] == 1:
        return None
    return pipeline("pp", microbatches=c.microbatches, schedule=c.schedule, virtual=c.virtual)


def _stages(facts: ProgramFacts, c: Candidate, global_batch: int) -> list[int]:
    """The stage of each block, where ``pipeline_transform`` cuts: ``fxshard.pipelining.stage_costs``'s
    balance of the same unit costs (whatever wraps the blocks: FSDP2, tp / cp / ep), each captured
    block standing for the blocks of its kind, at the trainer's example: one micro-batch of global
    rows (of one accumulation pass)."""
    rows = global_batch / (c.accum * c.microbatches) / ROWS
    # one cut per (rows, stages) of a program: the AC modes, schedules and accumulation passes of a
    # mesh share it (a dynamic program over 126 blocks is most of 405B's planning time)
    cache = vars(facts).setdefault("_stage_cuts", {})
    key = (rows, c.mesh["pp"] * c.virtual)
    if key not in cache:
        units = [BEFORE] + [facts.captured[facts.planned.source_block(i, facts.captured)] for i in range(facts.n_blocks)] + [AFTER]
        cache[key] = balanced_stages([facts.balance[u].scaled(rows) for u in units], key[1])
    return list(cache[key])


def _in_flight(c: Candidate, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak (in stage-sized units
    summed over its stages)."""
    pp, M, v = c.mesh["pp"], c.microbatches, c.virtual
    if pp == 1:
        return 1
    if c.schedule == "GPipe":
        return M * v
    if v == 1:
        return min(M, pp - pp_rank)
    return min(M * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)  # torch's interleaved warm-up, in stage chunks


# ----------------------------------------------------------------------------- memory


def _fsdp_bytes(params, dp: int) -> float:
    """What FSDP2 keeps of each parameter on one rank: the trainer's cut (``fsdp_shard_numel``:
    dim 0, or the first dim dp divides, such as an ep rank's stacked experts' dim 1), padded."""
    return sum(fsdp_shard_numel(shape, dp) * size for _, shape, size in params)


def _checkpointed(c: Candidate, blocks: list[int]) -> tuple[str, set[int]]:
    """The candidate's activation checkpointing mode (``none``, ``full``, ``selective``) and the
    blocks of this rank it checkpoints: all, or every K-th of the rank's (``selective:K``, in
    full), as ``fxshard.checkpoint_blocks`` counts them."""
    mode, every = c.checkpointing
    if mode == "none":
        return mode, set()
    return mode, {b for j, b in enumerate(blocks, 1) if j % every == 0}


def _stage_activations(facts: ProgramFacts, stage_blocks, s: int, num_stages: int, rows: float, mode: str | bool,
                       ckpt: set[int] | None = None) -> float:
    """Bytes stage ``s`` keeps for one micro-batch.  A block's output is counted in the block
    (its maker), so a stage that sends its last output on subtracts it, and a stage after the
    first keeps what it receives (the hidden state, rotary tables: what the blocks keep of
    what the part before them made).  ``mode``: the activation checkpointing of the blocks in
    ``ckpt`` (``True``: full on all): ``full`` keeps a block's inputs and one block's
    recomputation is alive at a time; ``selective`` keeps its inputs and its saved ops'
    outputs (measured with the trainer's policy), and the recomputation of the rest of one."""
    blocks = stage_blocks[s]
    if not blocks:
        return 0.0
    first_stage, last_stage = s == 0, s == num_stages - 1
    edge = facts.before.saved.at(rows) if first_stage else facts.before.shared.at(rows)
    if last_stage:
        edge += facts.after.saved.at(rows)
    mode = "full" if mode is True else "none" if mode is False else mode
    ckpt = set(blocks) if ckpt is None else ckpt & set(blocks)
    if mode == "none" or not ckpt:
        mode = "none"
    elif mode == "selective" or len(ckpt) < len(blocks):  # block by block: its own kept bytes
        kept = 0.0
        for i in blocks:
            u = facts.block(i)
            if i not in ckpt:
                kept += u.saved.at(rows)
            elif mode == "selective":  # its output (the next one's input) and its saved ops' outputs
                kept += _grad_inputs(u, rows) + u.selective_saved.at(rows)
            else:
                kept += _grad_inputs(u, rows)
        if not last_stage:
            kept -= _grad_inputs(facts.block(blocks[-1]), rows)  # its output is sent, not kept
        return edge + kept + _recompute_working(facts, blocks, rows, mode, ckpt)
    if mode == "full":  # each block keeps its inputs; one block's recompute is alive at a time
        kept = sum(_grad_inputs(facts.block(i), rows) for i in blocks[1:])
        if last_stage:
            kept += _grad_inputs(facts.block(blocks[-1]), rows)  # the last output, kept by the final norm
        return edge + kept + _recompute_working(facts, blocks, rows, mode, ckpt)
    kept = sum(facts.block(i).saved.at(rows) for i in blocks)
    if not last_stage:
        kept -= _grad_inputs(facts.block(blocks[-1]), rows)  # its output is sent, not kept
    return edge + kept


def _recompute_working(facts: ProgramFacts, blocks: list[int], rows: float, mode: str, ckpt: set[int]) -> float:
    """The largest recomputation among ``blocks`` alive at once: a checkpointed block's kept
    tensors, less its saved ops' outputs under selective (they are kept, not recomputed)."""
    return max((facts.block(i).saved.at(rows) - (facts.block(i).selective_saved.at(rows) if mode == "selective" else 0.0)
                for i in set(blocks) & ckpt if mode != "none"), default=0.0)


def _grad_inputs(u: UnitFacts, rows: float) -> float:
    """The bytes of a block's inputs that carry a gradient (the hidden state it takes)."""
    return sum(b.at(rows) for b, grad in u.inputs if grad)


def _stage_held(units: list[UnitFacts], bf16: bool) -> float:
    """A pipeline stage under FSDP2: torch's schedule runs each micro-batch's backward with
    ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``, then
    reduce-scatters once after the pass (``perform_reduce_grad``), so from the first backward on
    the stage's parameters stay gathered (the compute dtype) and its gradients unsharded (fp32,
    FSDP2's reduce dtype, in which it accumulates them)."""
    held = sum(u.param_bytes for u in units)
    return held * (0.5 if bf16 else 1.0) + held


def _fsdp_transient(facts: ProgramFacts, blocks: list[int], first: bool, last: bool, dp: int, bf16: bool) -> float:
    if dp == 1 or not blocks:
        return 0.0
    gathered = 0.5 if bf16 else 1.0  # FSDP2 gathers the compute dtype (mixed precision)
    block = max(facts.block(i).param_bytes for i in blocks)
    root = (facts.before.param_bytes if first else 0) + (facts.after.param_bytes if last else 0)
    return (2 * block + root) * gathered + block


# ----------------------------------------------------------------------------- communication and time


def _link(axis: str, mesh: dict, cal: Calibration):
    """The link an axis's collectives use: within a node when its ranks (consecutive at the
    stride of the axes after it in the mesh's order) all fit in one node."""
    stride = 1
    for a in reversed(TRAINER_ORDER):
        if a == axis:
            break
        stride *= mesh.get(a, 1)
    return cal.link("intra" if stride * mesh.get(axis, 1) <= cal.gpus_per_node else "inter")


def _collective_seconds(kind: str, nbytes: float, n: int, link) -> float:
    """A ring: ``2 (n - 1)`` steps for an all-reduce, ``n - 1`` for the others, one for a send."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1 if kind in ("all_gather", "reduce_scatter", "all_to_all") else 1
    return steps * (link.latency_us * 1e-6 + nbytes / n / (link.gbps * 1e9) * (1 if steps > 1 else n))


def _plan_comm(units, rows: float, M: int, bf16: bool, mesh: dict, cal: Calibration, pipelined: bool, recompute: float,
               mode: str = "full"):
    """Bytes per axis in a step, and seconds per micro-batch, of the program's own collectives.
    ``recompute``: the share of the blocks whose forward runs again in the backward; under
    ``full`` checkpointing all their forward collectives run again, under ``selective`` their
    all-gathers only (the other collectives' outputs are saved)."""
    bytes_, seconds = {}, 0.0
    for u in units:
        for f in u.comm:
            if f.guard and pipelined:
                continue
            again = recompute if mode == "full" or (mode == "selective" and f.kind == "all_gather") else 0.0
            times = 1 + again if f.phase == "forward" and u.name not in (BEFORE, AFTER) else 1
            b = f.bytes * f.scale(rows) * (0.5 if bf16 and f.floating else 1.0)
            bytes_[f.axis] = bytes_.get(f.axis, 0.0) + b * M * times
            seconds += times * _collective_seconds(f.kind, b, f.axis_size, _link(f.axis, mesh, cal))
    return bytes_, seconds


def _p2p(facts, stage_blocks, stages, spec, c: Candidate, r: int, rows: float, act_scale: float, mesh, cal):
    """pp's sends and receives on this rank (per step), and their seconds per micro-batch."""
    if spec is None:
        return {}, 0.0
    pp, M = mesh["pp"], c.microbatches
    num_stages = pp * c.virtual
    per_mb, seconds = 0.0, 0.0
    link = _link("pp", mesh, cal)
    for s in stages:
        if s > 0 and spec.rank_of_stage(s - 1, pp) != r:  # receive from the previous stage, send its gradients back
            inputs = facts.block(stage_blocks[s][0]).inputs
            per_mb += sum(b.at(rows) for b, _ in inputs) * act_scale + sum(b.at(rows) for b, g in inputs if g) * act_scale
        if s < num_stages - 1 and spec.rank_of_stage(s + 1, pp) != r:
            inputs = facts.block(stage_blocks[s + 1][0]).inputs
            sent = sum(b.at(rows) for b, _ in inputs) * act_scale
            grads = sum(b.at(rows) for b, g in inputs if g) * act_scale
            per_mb += sent + grads
            seconds += 2 * link.latency_us * 1e-6 + (sent + grads) / (link.gbps * 1e9)
    out = {"pp": per_mb * M + 4}  # + the loss, broadcast from the last stage's rank
    for a in ("dp", "cp"):  # the loss summed over the axes that share the batch
        if mesh[a] > 1:
            out[a] = 4.0
    holds = {0, num_stages - 1} & set(stages)
    if facts.tied and len(holds) == 1 and spec.rank_of_stage(0, pp) != spec.rank_of_stage(num_stages - 1, pp):
        out["pp"] += _fsdp_bytes([p for p in facts.before.params if p[0] in facts.tied], mesh["dp"])
    return out, seconds


def _fsdp_comm(units, dp: int, pp: int, bf16: bool, mesh: dict, cal: Calibration, accum: int = 1,
               axis: str = "dp", reduce_every_pass: bool = False):
    """FSDP2's bytes per step on this rank, the seconds they take, and the seconds of the first
    all-gather (nothing to overlap it with).  Each of ``accum`` passes gathers again; the
    reduce-scatter runs once, after the last (the passes before it under ``no_sync``), or
    every pass (``reduce_every_pass``: ``--accum-grads sharded``)."""
    if dp == 1:
        return 0.0, 0.0, 0.0
    link = _link(axis, mesh, cal)
    gather_size = 0.5 if bf16 else 1.0
    total, seconds, first = 0.0, 0.0, 0.0
    for u in units:
        padded = sum(fsdp_shard_numel(shape, dp) * dp * size for _, shape, size in u.params if shape)
        if not padded:
            continue
        # a block is gathered for its forward and again for its backward; under pp once a pass (fxshard.fully_shard
        # does not reshard a stage after the forward, and torch's schedule keeps it gathered until the last
        # micro-batch's backward); the root (before, after) once: it is not resharded in between
        gathers = (1 if u.name in (BEFORE, AFTER) or pp > 1 else 2) * accum
        g = padded * gather_size
        reduces = accum if reduce_every_pass else 1
        total += gathers * g + reduces * padded
        t = _collective_seconds("all_gather", g, dp, link)
        seconds += gathers * t + reduces * _collective_seconds("reduce_scatter", padded, dp, link)
        first = max(first, t)
    return total, seconds, first


def _recompute_seconds(u: UnitFacts, rows: float, cal: Calibration, mode: str, compiled: bool = False) -> float:
    """A checkpointed block's recomputation in the backward: its forward (``full``), or the
    ops selective checkpointing does not save (``selective``: norms, activations, rotary, every
    other ``mm``; attention's outputs are saved, so none of its FLOPs is recomputed)."""
    full = _forward_seconds(u, rows, cal, compiled)
    if mode != "selective":
        return full
    attention = u.attention_flops.at(rows)
    skipped = (_flop_seconds(u.selective_skip_flops.at(rows) - attention, attention, cal)
               + u.selective_skip_bytes.at(rows) / (cal.memory_gbps * 1e9) + u.selective_skip_kernels.at(rows) * cal.kernel_us * 1e-6)
    return max(0.0, full - skipped)


def _forward_seconds(u: UnitFacts, rows: float, cal: Calibration, compiled: bool = False) -> float:
    """One forward of ``u``: its matmuls, and its other kernels' bytes and fixed costs, eager
    or as inductor fuses them (``compiled``)."""
    attention = u.attention_flops.at(rows)
    other, kernels = (u.fused_bytes, u.fused_kernels) if compiled else (u.other_bytes, u.kernels)
    return (_flop_seconds(u.matmul_flops.at(rows) - attention, attention, cal) + other.at(rows) / (cal.memory_gbps * 1e9)
            + kernels.at(rows) * cal.kernel_us * 1e-6)


def _flop_seconds(matmul: float, attention: float, cal: Calibration) -> float:
    """Matmuls at the matmul rate, attention at its kernels' own (flash attention's)."""
    return matmul / (cal.matmul_tflops * 1e12) + attention / cal.attention_rate


__all__ = ["estimate", "Estimate", "RankEstimate", "MEMORY_KEYS"]
