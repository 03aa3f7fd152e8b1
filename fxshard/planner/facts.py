"""What one rank's program does, per unit, for one sub-plan: the expensive step, done once.

A *sub-plan* is the part of a mesh that changes the program: the degrees of ``tp``, ``cp``
and ``ep`` (and whether cp runs under pp, whose recipe gathers the sequence before the head).
``dp`` (FSDP2 divides what each rank stores, the program is the same) and ``pp`` (the program
is cut between blocks) are derived from these facts by arithmetic (``estimate.py``).

For a sub-plan the planner builds the recipe's plan (``fxshard.recipe.plan_for_mesh``, the trainer's)
on an offline mesh (``offline.py``), transforms the captured prefix of the model
(``model.py``: one block of each kind) and reads, per *unit* ("<before>" the first block, each
captured block, "<after>" the last with the loss):

- ``params``: the local shape of every parameter this rank holds (the transformed program's);
- ``comm``: the rows of ``fxshard.comm_summary`` of the program, per micro-batch;
- ``saved``, ``matmul_flops``, ``other_bytes``, ``kernels`` (and ``fused_bytes``,
  ``fused_kernels``: those of the program compiled, its elementwise ops fused), what selective activation
  checkpointing keeps and skips (``selective_*``) and the tensors a block takes from
  outside (what a pipeline cut in front of it sends): from two forward runs on the meta device
  at ``ROWS`` and ``2 ROWS`` rows, so that each is an :class:`Affine` function of the rows of
  a micro-batch (rotary tables do not grow with the batch, hidden states do); for the part
  after the blocks also ``backward_working``, the peak of its own backward (the loss's
  gradients of the logits), from a backward run of that part alone.

Example::

    facts = program_facts(PlannedModel.resolve(model), SubPlan(tp=2), seq=4096, captures={})
    facts.block(7).saved.at(rows=2)         # bytes block 7 keeps for the backward at 2 rows
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxshard.debug.comm_summary import comm_summary
from fxshard.errors import PlanError
from fxshard.meta import program_meta
from fxshard.frontend.trace import trace
from fxshard.plan.mesh import MeshSpec
from fxshard.pipelining.stage_costs import StageCost, unit_costs
from fxshard.plan.plan import Plan
from fxshard.planner.model import PlannedModel
from fxshard.planner.offline import AFTER, BEFORE, ForwardCounts, measure_forward, offline_mesh
from fxshard.recipe.parallel_dims import ParallelDims
from fxshard.recipe.plan_for_mesh import plan_for_mesh, sharded_logits
from fxshard.training.batch import equal_pieces
from fxshard.transform import transform

ROWS = 3  # the example's rows: no other dim of a small test model is 3, so a leading 3 is the batch
PARAM_SYNCS = ("grad_sync", "grad_sync_bucket")


@dataclass(frozen=True)
class SubPlan:
    """The degrees that change the program (1: the axis is not used): a candidate's
    :class:`~fxshard.recipe.parallel_dims.ParallelDims` less dp and pp.

    Example: ``SubPlan.of(ParallelDims(dp=2, pp=2, cp=2))`` -> ``SubPlan(cp=2, cp_gathered=True)``
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    cp_gathered: bool = False  # cp under pp: contiguous pieces, the final norm's output gathered

    @classmethod
    def of(cls, dims: ParallelDims) -> "SubPlan":
        """The sub-plan of a mesh: its tp, cp and ep, and whether cp's sequence is gathered before the head."""
        return cls(tp=dims.tp, cp=dims.cp, ep=dims.ep, cp_gathered=dims.gathers_sequence_before_head)

    @property
    def dims(self) -> ParallelDims:
        """The degrees of the program's axes (no dp, no pp: one stage's program, whatever the pipeline)."""
        return ParallelDims(tp=self.tp, cp=self.cp, ep=self.ep, spec=str(self))

    @property
    def axes(self) -> dict[str, int]:
        """The plan's axes in the trainer's mesh order (``cp, ep, tp``), sizes above 1."""
        return {a: n for a, n in (("cp", self.cp), ("ep", self.ep), ("tp", self.tp)) if n > 1}

    def __str__(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.axes.items()) or "one rank"


@dataclass(frozen=True)
class Affine:
    """``base + per_row * rows``."""

    base: float = 0.0
    per_row: float = 0.0

    def at(self, rows: float) -> float:
        return self.base + self.per_row * rows

    @classmethod
    def fit(cls, v1: float, v2: float, r1: int = ROWS, r2: int = 2 * ROWS) -> "Affine":
        per_row = (v2 - v1) / (r2 - r1)
        return cls(v1 - per_row * r1, per_row)

    def __add__(self, other: "Affine") -> "Affine":
        return Affine(self.base + other.base, self.per_row + other.per_row)

    def scaled(self, k: float) -> "Affine":
        return Affine(self.base * k, self.per_row * k)


@dataclass(frozen=True)
class CommFact:
    """One row of the program's comm summary; ``per_row``: its bytes grow with the micro-batch."""

    phase: str
    kind: str
    axis: str
    axis_size: int
    bytes: int
    wire_bytes: int
    per_row: bool
    floating: bool = True  # a floating-point payload: half the bytes when the run computes in bf16
    guard: bool = False  # the program's check of its input pieces (a pre-hook): not run by pipeline stages

    def scale(self, rows: float) -> float:
        return rows / ROWS if self.per_row else 1.0


@dataclass
class UnitFacts:
    name: str
    params: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)  # (fqn, local shape, item size)
    saved: Affine = Affine()
    shared: Affine = Affine()  # <before> only: what it makes that blocks keep (a later stage receives and keeps it)
    matmul_flops: Affine = Affine()
    attention_flops: Affine = Affine()  # of matmul_flops: attention's
    other_bytes: Affine = Affine()
    kernels: Affine = Affine()
    comm: list[CommFact] = field(default_factory=list)
    inputs: list[tuple[Affine, bool]] = field(default_factory=list)  # a block's tensors from outside: bytes, carries grad
    # under selective activation checkpointing (offline.measure_forward asks the trainer's op policy): the bytes of
    # the block's saved op outputs, and the forward's matmul FLOPs, other bytes and kernels its recomputation skips
    selective_saved: Affine = Affine()
    selective_skip_flops: Affine = Affine()
    selective_skip_bytes: Affine = Affine()
    selective_skip_kernels: Affine = Affine()
    backward_working: Affine = Affine()  # <after> only: the peak bytes its own backward makes (the logits' gradients)
    fused_bytes: Affine = Affine()  # other_bytes and kernels of the compiled program (inductor's fused kernels)
    fused_kernels: Affine = Affine()

    @property
    def param_bytes(self) -> int:
        return sum(_numel(shape) * size for _, shape, size in self.params)


@dataclass
class ProgramFacts:
    """The facts of one sub-plan's program (see the module docstring)."""

    subplan: SubPlan
    planned: PlannedModel
    units: dict[str, UnitFacts]
    captured: list[str]  # the program's block FQNs (the captured prefix)
    tied: list[str]  # parameters read both before and after the blocks (held by the first and last stage)
    # the costs fxshard.pipeline_transform balances its stages by, per unit, at ROWS rows (global shapes):
    # fxshard.pipelining.stage_costs.unit_costs of the program (the same under FSDP2, which splits the blocks out)
    balance: dict[str, StageCost] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def n_blocks(self) -> int:
        return self.planned.n_blocks(self.captured)

    def block(self, i: int) -> UnitFacts:
        """The facts of block ``i`` of the whole stack (a captured block of its kind)."""
        return self.units[self.captured[self.planned.source_block(i, self.captured)]]

    @property
    def before(self) -> UnitFacts:
        return self.units[BEFORE]

    @property
    def after(self) -> UnitFacts:
        return self.units[AFTER]


def build_subplan_plan(planned: PlannedModel, subplan: SubPlan, mesh):
    """The recipe's plan for ``subplan`` over ``mesh`` (the offline mesh of its axes): the
    plan the trainer runs within a stage (:func:`~fxshard.recipe.plan_for_mesh.plan_for_mesh`),
    cp's sequence gathered before the head when the sub-plan's mesh has pp; the plan of no
    sharding (a one-rank MeshSpec) when it has no axis.  A plan the model refuses is a PlanError.

    Example: ``build_subplan_plan(planned, SubPlan(tp=2), mesh).specs``   # Megatron's tp entries
    """
    plan = plan_for_mesh(planned.model, subplan.dims, mesh, gather_sequence_before_head=subplan.cp_gathered)
    if plan is None:
        return Plan(MeshSpec(("tp",), (1,)), {})
    return Plan(plan.mesh, plan.specs, plan.inputs)  # without FSDP2's axes: dp is not among the sub-plan's


class Captures:
    """The captured prefixes, one per plan *structure*: whether attention is context-parallel
    (the capture then builds no causal mask) and the plan's local regions (outlined at capture).
    Each is captured with the boundaries of every plan registered for it: a boundary no entry of
    the plan being transformed names is inert (the tests check tp=1 from a tp capture), so
    tp=1, 2, 4, 8 share one capture."""

    def __init__(self, planned: PlannedModel, seq: int):
        self.planned, self.seq = planned, seq
        self.specs: dict[tuple, dict] = {}
        self.axes: dict[tuple, set] = {}
        self.graphs: dict[tuple, fx.GraphModule] = {}

    @staticmethod
    def key(plan) -> tuple:
        cp = tuple(sorted((a, c.load_balance) for a, c in plan.context_parallel_axes().items()))
        return cp, tuple(sorted((p, repr(s)) for p, s in plan.specs.items() if s.local))

    def register(self, plan) -> None:
        specs = self.specs.setdefault(self.key(plan), {})
        self.axes.setdefault(self.key(plan), set()).update(plan.axes)
        for pattern, spec in plan.specs.items():
            specs.setdefault(pattern, spec)

    def graph(self, plan) -> fx.GraphModule:
        from fxshard.frontend.repeated_blocks import only_captured_blocks

        key = self.key(plan)
        if key not in self.graphs:
            self.register(plan)
            specs = self.specs[key]
            axes = sorted(self.axes[key])
            union = Plan(MeshSpec(axes, [2] * len(axes)), specs)
            model = self.planned.model
            scope = only_captured_blocks(model, self.planned.stamp) if self.planned.stamp is not None else contextlib.nullcontext()
            with scope:
                self.graphs[key] = trace(model, union, example_kwargs=self.example)
        return self.graphs[key]

    @property
    def example(self) -> dict:
        return {self.planned.input_name: torch.zeros(ROWS, self.seq, dtype=torch.long)}


def register_plans(captures: Captures, subplans) -> dict[SubPlan, str]:
    """Build every sub-plan's plan once, so that each capture holds the boundaries of all the
    plans it serves; returns the sub-plans the model refuses, with the PlanError's text."""
    refused = {}
    for sp in subplans:
        try:
            with offline_mesh(sp.axes) as mesh:
                captures.register(build_subplan_plan(captures.planned, sp, mesh))
        except PlanError as e:
            refused[sp] = str(e)
    return refused


def program_facts(captures: Captures, subplan: SubPlan, dtype: torch.dtype = torch.float32) -> ProgramFacts:
    """The facts of ``subplan``'s program, its forward run in ``dtype`` (bf16: the parameters
    FSDP2's mixed precision gathers).  A plan the model refuses is its ``PlanError``."""
    from fxshard.training.token_loss import token_loss_sum

    t0 = time.perf_counter()
    planned, seq = captures.planned, captures.seq
    name = planned.input_name
    example = captures.example
    with offline_mesh(subplan.axes) as mesh:
        plan = build_subplan_plan(planned, subplan, mesh)
        program = transform(captures.graph(plan), plan, example_kwargs=example, blocks="auto")
        program.to("meta")
        captured = list(program_meta(program).fsdp_units or ())
        units = {u: UnitFacts(u) for u in (BEFORE, *captured, AFTER)}
        unit_of_node = _top_level_units(program, captured)
        tied = _fill_params(units, program, captured, unit_of_node)  # fp32, as the trainer keeps them
        summary = comm_summary(program)
        pieces = equal_pieces(program)
        balance = {c.name: c for c in unit_costs(program, captured)}
        if dtype != torch.float32:
            program.to(dtype)
        seq_local = seq // subplan.cp
        vocab = sharded_logits(plan, planned.model) or ()  # loss parallel: the trainer's loss on vocab shards
        loss = lambda out, labels: token_loss_sum(out, labels, *vocab)  # noqa: E731
        runs = [measure_forward(program, name, rows, seq_local, loss, captured) for rows in (ROWS, 2 * ROWS)]
    _fill_counts(units, runs)
    # the trainer gives cp to FSDP2 (not under pp, where the sequence is gathered before the head): the program
    # it runs syncs no parameter gradient on cp; FSDP2's reduce-scatter there is estimate's
    param_syncs = _parameter_syncs(program, captured) if subplan.cp > 1 and not subplan.cp_gathered else set()
    for r in summary.rows:
        unit = next((b for b in captured if r.region == b or r.region.startswith(b + ".")), None)
        if r.axis == "cp" and (unit or "", r.node) in param_syncs:
            continue
        unit = unit or unit_of_node.get(r.node, AFTER)
        per_row = bool(r.shape) and r.shape[0] in (ROWS, ROWS * seq_local, ROWS * seq)
        units[unit].comm.append(CommFact(r.phase, r.kind, r.axis, r.axis_size, r.bytes, r.wire_bytes, per_row,
                                         r.dtype.is_floating_point))
    units[BEFORE].comm += _piece_check_rows(pieces, subplan.axes)
    units[AFTER].comm += _vocab_parallel_loss_rows(vocab, subplan, seq if subplan.cp_gathered else seq_local)
    return ProgramFacts(subplan, planned, units, captured, tied, balance, time.perf_counter() - t0)


def _parameter_syncs(program: fx.GraphModule, blocks: list[str]) -> set[tuple[str, str]]:
    """``(block or "", node)`` of the gradient syncs of values computed from parameters alone
    (no input above them): FSDP2 reduces those where it owns the axis."""
    out = set()
    for region, gm in [("", program)] + [(b, program.get_submodule(b)) for b in blocks]:
        fed = set()
        for n in gm.graph.nodes:
            if n.op == "placeholder" or any(a in fed for a in n.all_input_nodes):
                fed.add(n)
            elif n.op == "call_function" and getattr(n.target, "__name__", "") in PARAM_SYNCS:
                out.add((region, n.name))
    return out


def _vocab_parallel_loss_rows(vocab: tuple, subplan: SubPlan, tokens_per_row: int) -> list[CommFact]:
    """The trainer's loss on vocab shards (``token_loss_sum`` with ``Program.vocab_parallel``)
    runs outside the program, so the program's comm summary has none of its collectives: per
    token, three fp32 all-reduces on the vocab axis (the max, the sum of exponentials, the target
    logit) in the forward, none in the backward (``runtime.loss.vocab_parallel_token_losses``)."""
    if not vocab:
        return []
    axis, n = vocab[0], subplan.axes.get(vocab[0], 1)
    nbytes = ROWS * tokens_per_row * 4
    return [CommFact("forward", "all_reduce", axis, n, nbytes, int(round(nbytes * 2 * (n - 1) / n)), True, False)
            for _ in range(3)]


def _piece_check_rows(pieces, axes: dict[str, int]) -> list[CommFact]:
    """The all-reduces of int64s by which the ranks compare their input pieces before the
    program runs (``fxshard.training.batch.EqualPiecesGuard``): per axis, two ints per piece on
    it; then one int per piece over every other axis, for the mesh to agree."""
    if not pieces:
        return []
    by_axis: dict[str, int] = {}
    for p in pieces:
        by_axis[p.axis] = by_axis.get(p.axis, 0) + 1
    rows = [CommFact("forward", "all_reduce", a, axes[a], 16 * k, 16 * k, False, False, True) for a, k in by_axis.items()]
    others = [a for a, n in axes.items() if n > 1 and (len(by_axis) > 1 or a not in by_axis)]
    rows += [CommFact("forward", "all_reduce", a, axes[a], 8 * len(pieces), 8 * len(pieces), False, False, True) for a in others]
    return rows


def _fill_counts(units: dict[str, UnitFacts], runs: list[ForwardCounts]) -> None:
    small, large = runs
    for name, u in units.items():
        a, b = small.units.get(name), large.units.get(name)
        if a is None or b is None:
            continue
        u.saved = Affine.fit(a.saved, b.saved)
        u.shared = Affine.fit(a.shared, b.shared)
        u.matmul_flops = Affine.fit(a.matmul_flops, b.matmul_flops)
        u.attention_flops = Affine.fit(a.attention_flops, b.attention_flops)
        u.other_bytes = Affine.fit(a.other_bytes, b.other_bytes)
        u.kernels = Affine.fit(a.kernels, b.kernels)
        for f in ("selective_saved", "selective_skip_flops", "selective_skip_bytes", "selective_skip_kernels",
                  "backward_working", "fused_bytes", "fused_kernels"):
            setattr(u, f, Affine.fit(getattr(a, f), getattr(b, f)))
        u.inputs = [(Affine.fit(x, y), grad) for (x, grad), (y, _) in zip(small.inputs.get(name, ()), large.inputs.get(name, ()))]


def _top_level_units(program: fx.GraphModule, captured: list[str]) -> dict[str, str]:
    """The unit of each node of the program's own graph, by its place around the blocks."""
    units, current = {}, BEFORE
    for n in program.graph.nodes:
        if n.op == "call_module" and n.target in captured:
            units[n.name] = current = n.target
            continue
        if current != BEFORE and n.op not in ("placeholder", "get_attr"):
            current = AFTER
        units[n.name] = current if n.op != "get_attr" else ""
    return units


def _fill_params(units: dict[str, UnitFacts], program: fx.GraphModule, captured: list[str],
                 unit_of_node: dict[str, str]) -> list[str]:
    """Each parameter under the unit that holds it; returns the tied ones (read before and after)."""
    readers: dict[str, set[str]] = {}
    for n in program.graph.nodes:
        if n.op == "get_attr":
            readers.setdefault(n.target, set()).update(unit_of_node.get(u.name, AFTER) for u in n.users)
    tied, seen = [], set()
    names: dict[int, list[str]] = {}
    for fqn, p in program.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    for fqn, p in program.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        block = next((b for b in captured if fqn.startswith(b + ".")), None)
        read_by = set().union(*(readers.get(f, set()) for f in names[id(p)]))
        unit = block or (AFTER if read_by and read_by <= {AFTER} else BEFORE)
        units[unit].params.append((fqn, tuple(p.shape), p.element_size()))
        if block is None and BEFORE in read_by and AFTER in read_by:
            tied.append(fqn)
    return tied


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= _dim(d)
    return n


def _dim(d) -> int:
    """A size, or the example's value of a symbolic one."""
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else 1
