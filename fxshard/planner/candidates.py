"""The meshes worth evaluating, and the divisibility that rules others out before any work.

A :class:`Candidate` is a mesh (a :class:`~fxshard.recipe.parallel_dims.ParallelDims` over the
trainer's axes ``dp``, ``tp``, ``pp``, ``cp``, ``ep``: ``python -m fxshard train --mesh``; HSDP's
``dp_replicate`` is not searched), the pipeline's micro-batches and schedule, and whether blocks
recompute their activations.  :func:`enumerate_candidates` lists every way to factor the world
size, pruned by what the model and the batch allow (what must divide is
:meth:`ParallelDims.check <fxshard.recipe.parallel_dims.ParallelDims.check>`'s, the trainer's
rules; the node and long-sequence limits are the planner's own choices):

- ``tp`` divides the attention heads and stays within a node (``gpus_per_node``): across
  nodes its per-layer all-reduces would run at the network's speed;
- ``cp`` is tried only when the sequence is long (``long_seq``, default 16384 tokens) and
  must divide it (twice over when load-balanced, i.e. without pp);
- ``ep`` only for a mixture of experts, dividing the experts;
- ``pp`` at most the number of blocks; micro-batches ``M`` in ``pp, 2 pp, 4 pp`` dividing each
  data-parallel rank's rows; schedules ``1F1B`` and ``Interleaved1F1B`` (2 stages per rank,
  ``M`` a multiple of pp);
- ``dp`` divides the global batch;
- ``accum``: gradient accumulation, the trainer's ``--accum`` (torchtitan's local batch against
  its global batch): each dp rank's rows run in ``accum`` passes of ``rows / accum`` rows (each
  pass the pipeline's ``M`` micro-batches under pp), one optimizer step after the last.  It is
  not enumerated: ``plan_parallelism`` takes, for each candidate, the fewest passes that fit
  (:func:`accum_choices` lists them: more passes only add per-pass costs);
- ``accum_grads``: under FSDP2 with accumulation, where the gradients wait between the passes
  (the trainer's ``--accum-grads``): ``unsharded`` (FSDP2 holds them whole, in fp32, and
  reduce-scatters once a step) or ``sharded`` (a reduce-scatter every pass, torchtitan's: 1/dp
  of the memory); ``plan_parallelism`` takes ``sharded`` where ``unsharded`` does not fit.

Each candidate is tried with each activation checkpointing mode of the trainer: ``none``,
``selective`` (per op) and ``full``.  A candidate the user
names that breaks a rule is kept, with the rule as its reason.

Example::

    for cand, why in enumerate_candidates(64, planned, seq=8192, global_batch=512, n_blocks=32):
        print(cand.mesh_spec, why)        # "dp=8,tp=8" None
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fxshard.errors import PlanError
from fxshard.planner.facts import SubPlan
from fxshard.recipe.parallel_dims import AXES, MeshError, ParallelDims
from fxshard.training.checkpointing import parse_checkpointing

SEARCHED_AXES = tuple(a for a in AXES if a != "dp_replicate")  # in the mesh's order; HSDP is not searched
ACCUM_GRADS = ("unsharded", "sharded")  # the trainer's --accum-grads


@dataclass(frozen=True)
class Candidate:
    """One configuration of the trainer: mesh (``dims``), micro-batches, schedule,
    recomputation, and ``accum`` gradient-accumulation passes per optimizer step (``--accum``).

    Example::

        c = Candidate.make({"dp": 2, "tp": 2})
        c.dims, c.mesh_spec          # ParallelDims(dp=2, tp=2), 'dp=2,tp=2'
    """

    dims: ParallelDims = field(hash=False, compare=False)
    microbatches: int = 1
    schedule: str | None = None
    virtual: int = 1
    activation_checkpointing: str = "none"  # none, selective, full, selective:K (the trainer's flag)
    key: tuple = ()
    accum: int = 1
    accum_grads: str = "unsharded"  # under FSDP2 with accum > 1: unsharded (held) or sharded (reduce-scattered)

    @classmethod
    def make(cls, mesh: dict | ParallelDims, microbatches: int = 1, schedule: str | None = None, virtual: int = 1,
             activation_checkpointing: str | bool = "none", accum: int = 1,
             accum_grads: str = "unsharded") -> "Candidate":
        """``mesh``: a ParallelDims, or a dict of degrees (``{"dp": 2, "tp": 2}``; absent axes 1)."""
        dims = mesh if isinstance(mesh, ParallelDims) else ParallelDims(**{a: int(mesh.get(a, 1)) for a in SEARCHED_AXES})
        activation_checkpointing = checkpointing_name(activation_checkpointing)
        if accum_grads not in ACCUM_GRADS:
            raise PlanError(f"candidate accum_grads={accum_grads!r}: not a choice of the trainer's --accum-grads\n"
                            f"  fix: one of {', '.join(ACCUM_GRADS)}")
        degrees = tuple(getattr(dims, a) for a in SEARCHED_AXES)
        key = (degrees, microbatches, schedule, virtual, activation_checkpointing, accum, accum_grads)
        return cls(dims, microbatches, schedule, virtual, activation_checkpointing, key, accum, accum_grads)

    @property
    def mesh(self) -> dict[str, int]:
        """The degree of every searched axis, in the mesh's order (``{"pp": 1, "dp": 2, ...}``)."""
        return {a: getattr(self.dims, a) for a in SEARCHED_AXES}

    def with_accum(self, accum: int, accum_grads: str | None = None) -> "Candidate":
        """The same configuration in ``accum`` passes per step (and ``accum_grads`` when given)."""
        return Candidate.make(self.dims, self.microbatches, self.schedule, self.virtual, self.activation_checkpointing,
                              accum, accum_grads or self.accum_grads)

    @property
    def sharded_grads(self) -> bool:
        """FSDP2 reduce-scatters every pass (``accum_grads="sharded"`` where it changes anything:
        under pp torch's schedule reduce-scatters after every pass whatever it says)."""
        return (self.accum_grads == "sharded" and self.accum > 1 and self.dims.fsdp_shard_ranks > 1
                and self.dims.pp == 1)

    def micro_rows(self, global_batch: int) -> float:
        """The rows one rank runs at once: a dp rank's rows over the passes and the pipeline's micro-batches."""
        return global_batch / (self.mesh["dp"] * self.accum * self.microbatches)

    @property
    def checkpointing(self) -> tuple[str, int]:
        """``(mode, every)``: ``("selective", 1)``; ``selective:K`` is ``("full", K)``."""
        return parse_checkpointing(self.activation_checkpointing)

    @property
    def subplan(self) -> SubPlan:
        return SubPlan.of(self.dims)

    @property
    def mesh_spec(self) -> str:
        """The trainer's ``--mesh`` (``"dp=2,tp=2"``; ``""`` for one process)."""
        return self.dims.mesh_spec

    def trainer_flags(self) -> str:
        """The flags of ``python -m fxshard train`` that run this candidate."""
        flags = [f"--mesh {self.mesh_spec}"] if self.mesh_spec else []
        if self.accum > 1:
            flags.append(f"--accum {self.accum}")
        if self.sharded_grads:
            flags.append("--accum-grads sharded")
        if self.mesh["pp"] > 1:
            flags += [f"--microbatches {self.microbatches}", f"--schedule {self.schedule}"]
            if self.virtual > 1:
                flags.append(f"--virtual-stages {self.virtual}")
        if self.activation_checkpointing != "none":
            flags.append(f"--activation-checkpointing {self.activation_checkpointing}")
        return " ".join(flags)


def divisibility(c: Candidate, world: int, *, seq: int, global_batch: int, n_blocks: int, heads: int | None,
                 experts: int | None) -> str | None:
    """Why ``c`` cannot run (the first rule of ``ParallelDims.check`` it breaks), or ``None``.
    ``experts``: the model's routed experts (``None``: it has none)."""
    try:
        c.dims.check(world_size=world, batch=global_batch, accum=c.accum, microbatches=c.microbatches,
                     schedule=c.schedule, virtual=c.virtual, seq=seq, heads=heads, experts=experts or 0,
                     n_blocks=n_blocks)
    except MeshError as e:
        return e.reason
    return None


def enumerate_candidates(world: int, *, seq: int, global_batch: int, n_blocks: int, heads: int | None,
                         experts: int | None, gpus_per_node: int, long_seq: int = 16384,
                         schedules=("1F1B", "Interleaved1F1B"),
                         checkpointing=("none", "selective", "full")) -> list[Candidate]:
    """Every candidate the rules of the module docstring allow (the rules are checked again,
    with reasons, by :func:`divisibility`)."""
    out = []
    for tp in _divisors(world):
        if tp > gpus_per_node:
            continue
        for cp in _divisors(world // tp):
            if cp > 1 and seq < long_seq:
                continue
            for ep in _divisors(world // (tp * cp)):
                for pp in _divisors(world // (tp * cp * ep)):
                    dims = ParallelDims(dp=world // (tp * cp * ep * pp), tp=tp, pp=pp, cp=cp, ep=ep)
                    try:  # the rules a mesh breaks whatever its micro-batches and schedule
                        dims.check(batch=global_batch, heads=heads, experts=experts or 0, n_blocks=n_blocks)
                    except MeshError:
                        continue
                    for ac in checkpointing:
                        if pp == 1:
                            out.append(Candidate.make(dims, activation_checkpointing=ac))
                            continue
                        for m in (pp, 2 * pp, 4 * pp):
                            for schedule in schedules:
                                virtual = 2 if schedule.startswith("Interleaved") else 1
                                out.append(Candidate.make(dims, m, schedule, virtual, ac))
    return out


def accum_choices(c: Candidate, global_batch: int) -> list[int]:
    """The passes ``c`` may take, fewest first: divisors of a dp rank's rows whose passes the
    pipeline's micro-batches divide (``[1]`` when the rows do not split)."""
    if global_batch % c.mesh["dp"]:
        return [1]
    rows = global_batch // c.mesh["dp"]
    return [a for a in _divisors(rows) if (rows // a) % c.microbatches == 0] or [1]


def candidate_from(spec: dict, world: int, default_microbatches=None) -> Candidate:
    """A user's candidate: ``{"tp": 2}`` (dp takes the remaining ranks), optionally with
    ``microbatches``, ``schedule``, ``virtual``, ``activation_checkpointing``, ``accum``
    (absent: the planner takes the fewest passes that fit; see :func:`accum_choices`),
    ``accum_grads`` (absent: ``sharded`` only where ``unsharded`` does not fit)."""
    mesh = {a: int(spec[a]) for a in SEARCHED_AXES if a in spec}
    if "dp" not in mesh:
        rest = 1
        for n in mesh.values():
            rest *= n
        mesh["dp"] = max(1, world // rest)
    pp = mesh.get("pp", 1)
    schedule = spec.get("schedule", "1F1B" if pp > 1 else None)
    virtual = int(spec.get("virtual", 2 if schedule and schedule.startswith("Interleaved") else 1))
    microbatches = int(spec.get("microbatches", default_microbatches or (2 * pp if pp > 1 else 1)))
    return Candidate.make(mesh, microbatches if pp > 1 else 1, schedule, virtual, spec.get("activation_checkpointing", "none"),
                          int(spec.get("accum", 1)), spec.get("accum_grads", "unsharded"))


def checkpointing_name(value: str | bool | None) -> str:
    """The trainer's ``--activation-checkpointing`` value for a candidate's: ``True`` is
    ``"full"``, ``False`` / ``None`` ``"none"``, ``"selective:op"`` ``"selective"``; a mode the
    trainer does not take is a PlanError."""
    mode, every = parse_checkpointing(value)
    if every > 1:
        return f"selective:{every}"
    return mode


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
