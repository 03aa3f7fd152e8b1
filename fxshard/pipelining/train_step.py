"""Running a pipelined program on ``torch.distributed.pipelining``, and one training step
that reads the same with and without pipeline parallelism."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from fxshard.errors import PlanError
from fxshard.plan.mesh import MeshSpec
from fxshard.plan.plan import Plan
from fxshard.frontend.static_sizes import StaticSize, check_static_sizes, static_input_sizes
from fxshard.frontend.trace import trace
from fxshard.runtime.collectives import hold_param_syncs, reduce_over
from fxshard.transform import transform

from fxshard.training.checkpointing import checkpoint_blocks, has_checkpointed_layers
from fxshard.training.grad_norm import track_parameters
from fxshard.meta import PipelineInfo, ProgramMeta, pipeline_of, program_meta

from fxshard.plan.pipeline import PipelineSpec
from .stages import LossProgram, StageCut, cut_stages, split_loss


class PipelinedModule(nn.Module):
    """This rank's stage(s) of a pipelined model (made by :func:`pipeline_transform`).

    Its parameters and buffers are the stage's, under the model's own FQNs
    (``named_parameters``, ``state_dict``, an optimizer over ``parameters()`` see this
    rank's share only); :attr:`stages` are the stage GraphModules (``fxshard.dump``-able),
    :attr:`stage_ids` their indices.  Run it with :func:`fxshard.pipelining.train_step`.

    Example::

        staged = pipeline_transform(model, plan, fxshard.pipeline("pp", microbatches=4), mesh,
                                    example_kwargs={"input_ids": ids, "labels": labels})
        opt = torch.optim.AdamW(staged.parameters())
        loss = train_step(staged, {"input_ids": ids, "labels": labels}); opt.step(); opt.zero_grad()
    """

    def __init__(self, cut: StageCut, spec: PipelineSpec, mesh, all_state: Sequence[tuple[str, torch.Tensor, bool]] = ()):
        super().__init__()
        pp_mesh = mesh[spec.axis]
        self.spec = spec
        self.pp_size = pp_mesh.size()
        self.pp_rank = pp_mesh.get_local_rank()
        self.pp_group = pp_mesh.get_group()
        self.num_stages = spec.num_stages(self.pp_size)
        self.stage_ids = spec.stages_of_rank(self.pp_rank, self.pp_size)
        self.input_names = list(cut.inputs)
        # the input dims the model's code fixed at capture (frontend.static_sizes): train_step checks them
        self.static_sizes: list[StaticSize] = []
        self.model_class = "the model"
        self.loss_program = cut.loss
        self.loss_axes = tuple(cut.loss_axes)
        self.batch_axes, self.batch_ranks = tuple(cut.batch_axes), cut.batch_ranks
        # FSDP2 averages gradients over its axis where fxshard sums: the losses are scaled up by its size
        self.fsdp_ranks = cut.fsdp_ranks
        self.cut_summary = cut.describe()
        self.stage_costs = list(cut.stage_costs)
        self.boundaries = list(cut.boundaries)
        self.tied_stages = dict(cut.tied)  # parameter FQN -> the stages that hold a copy
        # plain attributes, not submodules: the state is registered once, below, under its FQNs
        vars(self)["stages"] = [cut.stages[i] for i in self.stage_ids]
        non_persistent: set[str] = set()
        stage_state = []
        for st in self.stages:
            for prefix, m in st.named_modules():
                non_persistent.update(f"{prefix}.{b}" if prefix else b for b in m._non_persistent_buffers_set)
            stage_state += [*st.named_parameters(remove_duplicate=False), *st.named_buffers(remove_duplicate=False)]
        held = {id(t): t for _, t in stage_state}
        # in the model's order, with the model's other names of a held tensor (a tied head): a tensor's first
        # name is the model's, under which a checkpoint stores its optimizer state
        for fqn, t, is_param in all_state:
            if id(t) in held:
                self._register(fqn, t, is_param, fqn in non_persistent)
        for fqn, t in stage_state:
            self._register(fqn, t, isinstance(t, nn.Parameter), fqn in non_persistent)
        # the stages' program state (the first stage's; the layouts of all), and what makes this module
        # pipelined (fxshard.meta.pipeline_of: what the tools of fxshard.training, .state, .debug ask)
        first = program_meta(self.stages[0])
        self.meta = {}
        program = program_meta(self, create=True)
        for f in dataclasses.fields(ProgramMeta):
            if f.name not in ("state", "pipeline_stage", "pipeline"):
                setattr(program, f.name, getattr(first, f.name))
        program.pipeline = PipelineInfo(spec=spec, stage_ids=self.stage_ids, num_stages=self.num_stages,
                                        pp_size=self.pp_size, pp_rank=self.pp_rank)
        program.state = layouts = {}
        for st in self.stages:
            layouts.update(program_meta(st).state or {})
        # a tensor held under several names (a tied embedding and head) has its layout under one of them:
        # each of its names gets it, so that full_state_dict gathers the shards under every name
        named = [*self.named_parameters(remove_duplicate=False), *self.named_buffers(remove_duplicate=False)]
        layout_of = {id(t): layouts[fqn] for fqn, t in named if fqn in layouts}
        for fqn, t in named:
            if fqn not in layouts and id(t) in layout_of:
                layouts[fqn] = layout_of[id(t)]
        for st in self.stages:
            track_parameters(st)
        self._tied = _tied_groups(cut, spec, mesh, self.pp_rank, self.pp_size)
        line = _pp_line(mesh, spec.axis)
        self._global_rank_of_pp = line
        self._schedule = None
        self._schedule_shapes: tuple = ()
        self._count = None
        self._tied_unsynced: list | None = None  # tied gradients at their last sum, while no_sync holds it back

    def _register(self, fqn: str, t: torch.Tensor, is_param: bool, non_persistent: bool) -> None:
        owner_path, _, name = fqn.rpartition(".")
        owner: nn.Module = self
        for part in owner_path.split(".") if owner_path else ():
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        store = owner._parameters if is_param else owner._buffers
        store.setdefault(name, t)
        if non_persistent:
            owner._non_persistent_buffers_set.add(name)

    def forward(self, *args, **kwargs):
        raise PlanError("a pipelined module runs its stages under a schedule, not by a call\n  fix: loss = "
                        "fxshard.pipelining.train_step(staged, inputs) (forward and backward of all micro-batches)")

    def owned_parameters(self) -> list[torch.Tensor]:
        """This rank's parameters, a tied one only on the first pipeline rank that holds it (what
        ``fxshard.grad_norm`` sums on this rank: each parameter of the model once)."""
        skip = set()
        for fqn, stages in self.tied_stages.items():
            owner = min(self.spec.rank_of_stage(s, self.pp_size) for s in stages)
            if owner != self.pp_rank:
                skip.add(fqn)
        params = dict(self.named_parameters(remove_duplicate=False))
        skipped = {id(params[fqn]) for fqn in skip if fqn in params}
        out, seen = [], set()
        for q in params.values():
            if id(q) not in seen and id(q) not in skipped:
                out.append(q)
            seen.add(id(q))
        return out

    def comm_summary(self, region: str | None = None):
        """This rank's p2p sends and receives per micro-batch, its stages' collectives and the
        step's own (what ``fxshard.comm_summary`` calls on this module; see :mod:`.p2p`)."""
        from .p2p import pipeline_comm_summary

        return pipeline_comm_summary(self, region)

    def describe(self) -> str:
        """The stages (blocks, balance cost, the values sent to the next stage at the example's
        shapes), which this rank holds, and the schedule's bubble in theory.

        Example: ``print(staged.describe())``
        """
        spec = self.spec
        lines = [f"pipeline over {spec.axis!r} ({self.pp_size} ranks, {self.num_stages} stages), schedule {spec.schedule}, "
                 f"{spec.microbatches} micro-batches; this rank ({spec.axis}={self.pp_rank}) holds stage(s) {self.stage_ids}",
                 *self.cut_summary.splitlines(),
                 f"bubble in theory (equal stages): {spec.bubble(self.pp_size):.3f} = (pp - 1) / (virtual * M + pp - 1)"]
        if self.tied_stages:
            lines.append("tied parameters (gradients summed between their stages): " +
                         ", ".join(f"{fqn} in stages {ss}" for fqn, ss in sorted(self.tied_stages.items())))
        return "\n".join(lines)

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def sync_stage_state(self) -> None:
        """Point the stage GraphModules at this module's tensors again (after something, e.g.
        ``fxshard.materialize`` or ``load_state_dict(assign=True)``, replaced them by FQN)."""
        mine = dict(self.named_parameters(remove_duplicate=False))
        mine.update(self.named_buffers(remove_duplicate=False))
        for st in self.stages:
            changed = False
            for fqn, t in [*st.named_parameters(remove_duplicate=False), *st.named_buffers(remove_duplicate=False)]:
                new = mine.get(fqn)
                if new is not None and new is not t:
                    owner_path, _, name = fqn.rpartition(".")
                    owner = st.get_submodule(owner_path) if owner_path else st
                    (owner._parameters if name in owner._parameters else owner._buffers)[name] = new
                    changed = True
            if changed:  # fxshard.grad_norm finds a parameter's module and layout by the parameter
                track_parameters(st)

    def adopt_stage_state(self) -> None:
        """Register the stages' tensors under their FQNs again (after something replaced them on
        the stages, e.g. FSDP2's ``fully_shard``)."""
        for st in self.stages:
            for fqn, t in [*st.named_parameters(remove_duplicate=False), *st.named_buffers(remove_duplicate=False)]:
                owner_path, _, name = fqn.rpartition(".")
                owner = self.get_submodule(owner_path) if owner_path else self
                store = owner._parameters if name in owner._parameters else owner._buffers
                store[name] = t

    def schedule(self, loss_fn: Callable, shapes: tuple = ()):
        """torch's schedule over this rank's stages, made again when the batch's ``shapes``
        change (torch's stages size their p2p buffers on their first step)."""
        if self._schedule is None or self._schedule_shapes != shapes:
            self._schedule_shapes = shapes
            device = next((t.device for t in self.parameters()), torch.device("cpu"))
            stage_cls = _stage_class()
            stages = [stage_cls(st, i, self.num_stages, device, group=self.pp_group)
                      for st, i in zip(self.stages, self.stage_ids)]
            cls = self.spec.schedule_class
            try:
                self._schedule = cls(stages if self.spec.multi_stage else stages[0], n_microbatches=self.spec.microbatches,
                                     loss_fn=loss_fn, scale_grads=False)
            except (ValueError, AssertionError, RuntimeError) as e:
                raise PlanError(f"pipeline: torch's {cls.__name__} refuses this pipeline ({self.num_stages} stages over "
                                f"{self.pp_size} ranks, {self.spec.microbatches} micro-batches): {e}\n  fix: see the schedule's "
                                f"requirement above (often: micro-batches a multiple of the {self.spec.axis!r} size)") from e
        return self._schedule


def _contiguous_sends(ops: list) -> list:
    """The p2p ops with contiguous tensors: c10d sends a contiguous tensor only, and a stage may
    output a strided view (a transpose, an expand) or get such a gradient for its input."""
    for op in ops:
        if isinstance(op.tensor, torch.Tensor) and not op.tensor.is_contiguous():
            op.tensor = op.tensor.contiguous()
    return ops


@functools.cache
def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    class ContiguousSendStage(PipelineStage):
        """torch's ``PipelineStage`` sending its activations and input gradients contiguous
        (``isend`` of a non-contiguous tensor raises "input tensor has to be contiguous")."""

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            return _contiguous_sends(super().get_fwd_send_ops(fwd_chunk_id))

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            return _contiguous_sends(super().get_bwd_send_ops(bwd_chunk_id))

        def _to_tensor(self, arg):
            """torch's shape inference runs a later stage on tensors made from the shapes it
            receives, uninitialized: zeros instead, so that an index crossing a cut (Hunyuan-V4's
            top-k of an earlier layer's indexer) stays in bounds and no NaN is made."""
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor) and type(t) is torch.Tensor:
                with torch.no_grad():
                    t.zero_()
            return t

    return ContiguousSendStage


def pipeline_transform(model: nn.Module, plan, mesh, example_inputs: Sequence[Any] | None = None,
                       example_kwargs: dict | None = None, *, spec: PipelineSpec | None = None,
                       targets: Sequence[str] = ("labels",), **transform_kwargs) -> PipelinedModule:
    """Transform ``model`` by ``plan`` (over the mesh axes other than the pipeline's), cut the
    program into stages and keep this rank's: a :class:`PipelinedModule`.

    ``mesh``: the whole ``DeviceMesh``, with the pipeline axis among its dims; ``plan`` is built
    on the sub-mesh of the other dims (``mesh["tp"]``) with ``pipeline=fxshard.pipeline(...)``,
    or is ``None`` (pipeline parallelism alone; then pass ``spec=``).  ``targets``: inputs only
    the model's loss reads (HF ``labels``): the loss is cut out of the last stage and computed
    by the schedule (see :func:`train_step`).  Other keywords go to ``fxshard.transform``.  A
    model with activation checkpointing on (HF's ``gradient_checkpointing_enable()``) has the
    blocks of its stages checkpointed (:func:`fxshard.checkpoint_blocks`).

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        plan = fxshard.Plan.from_hf(mesh["tp"], model).replace(pipeline=fxshard.pipeline("pp", microbatches=4))
        staged = fxshard.pipeline_transform(model, plan, mesh, example_kwargs={"input_ids": ids, "labels": labels})
        loss = fxshard.train_step(staged, {"input_ids": ids, "labels": labels})
    """
    spec = spec if spec is not None else getattr(plan, "pipeline", None)
    if spec is None:
        raise PlanError("pipeline_transform: no pipeline spec\n  fix: Plan(..., pipeline=fxshard.pipeline(\"pp\", "
                        "microbatches=M)), or spec=fxshard.pipeline(...) with plan=None")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if spec.axis not in names:
        raise PlanError(f"pipeline: axis {spec.axis!r} is no dim of the mesh {names}\n  fix: init_device_mesh(..., "
                        f"mesh_dim_names=({spec.axis!r}, ...)) and fxshard.pipeline({spec.axis!r}, ...)")
    if plan is None:
        plan = Plan(_trivial_mesh(mesh, spec.axis), {})
    plan_axes = tuple(getattr(plan.mesh, "mesh_dim_names", None) or plan.axes)
    if spec.axis in plan_axes:
        raise PlanError(f"pipeline: the plan's mesh has the pipeline axis {spec.axis!r}; it shards within a stage\n  fix: "
                        f"build the plan on the other dims, fxshard.Plan(mesh[{[a for a in names if a != spec.axis]!r}], ...)")
    capture = {k: transform_kwargs.pop(k) for k in ("capture", "dynamic_shapes") if k in transform_kwargs}
    # the capture traces through activation checkpointing: put back on the stages' blocks, split out for it
    checkpoint = has_checkpointed_layers(model)
    if checkpoint and transform_kwargs.get("blocks") is None:
        transform_kwargs["blocks"] = "auto"
    # a bucket of gradient syncs reads parameters of several blocks: it would pull them into one stage
    if transform_kwargs.get("bucket_cap_mb"):
        raise PlanError("pipeline_transform: bucket_cap_mb= coalesces the gradient syncs of several blocks, which the "
                        "stages split\n  fix: leave bucket_cap_mb out (one sync per parameter under pp)")
    transform_kwargs["bucket_cap_mb"] = None
    # the model's loss is cut out before the transform: it runs on the last stage's output, per rank
    captured = trace(model, plan, example_inputs or (), example_kwargs, **capture)
    model_gm, loss = split_loss(captured, targets)
    model_plan = plan
    if loss is not None:
        for a, p in plan.inputs.get(loss.target, {}).items():
            if isinstance(p, Shard) and p.dim != 0:
                raise PlanError(f"pipeline: the target {loss.target!r} is sharded on dim {p.dim} over {a!r}; the last "
                                f"stage computes the model's loss on its own rows, which is exact only for a batch "
                                f"sharded on dim 0 (HF shifts the labels along the sequence: a rank's last label belongs "
                                f"to the next rank's tokens)\n  fix: shard the batch (dim 0) only; under context parallelism keep "
                                f"{loss.target!r} whole and gather the sequence before the head, e.g. {{\"model.norm\": "
                                f"fxshard.ModuleSpec(out_src={{{a!r}: Shard(1)}}, out_dst={{{a!r}: Replicate()}})}} with "
                                f"context_parallel({a!r}, load_balance=False); or pass loss_fn= with labels shifted beforehand")
        example_kwargs = {k: v for k, v in (example_kwargs or {}).items() if k != loss.target}
        model_plan = plan.replace(inputs={k: v for k, v in plan.inputs.items() if k != loss.target})
    # within a stage the plan is an ordinary one (fxshard.transform refuses a plan that carries a pipeline)
    model_plan = Plan(model_plan.mesh, model_plan.specs, inputs=model_plan.inputs, fsdp=model_plan.fsdp)
    gm = transform(model_gm, model_plan, example_inputs, example_kwargs, **transform_kwargs)
    pp = mesh[spec.axis].size()
    cut = cut_stages(gm, spec, spec.num_stages(pp), with_loss=False)
    if loss is not None:
        cut.loss = loss
        cut.loss_axes = _loss_axes(gm, plan, loss)
    # the axes whose ranks each hold a part of what a loss_fn scores (the batch on dp, a sequence left sharded
    # on cp): their per-rank means are averaged; an output gathered over an axis (cp before the head) is
    # scored whole on each of its ranks, whose gradients fxshard sums over the slices: counted once
    cut.batch_axes = _sharded_output_axes(gm, plan)
    cut.batch_ranks = math.prod(plan.axes[a] for a in cut.batch_axes)
    # the ranks FSDP2 averages over: its axes but context-parallel ones, over which it sums (fxshard.fully_shard)
    cut.fsdp_ranks = math.prod(plan.axes[a] for a in plan.fsdp_axes if a not in plan.context_parallel_axes())
    all_state = [(n, t, True) for n, t in gm.named_parameters(remove_duplicate=False)] + \
                [(n, t, False) for n, t in gm.named_buffers(remove_duplicate=False)]
    staged = PipelinedModule(cut, spec, mesh, all_state)
    staged.static_sizes, staged.model_class = static_input_sizes(gm), program_meta(gm).model_class or "the model"
    if checkpoint:
        checkpoint_blocks(staged)
    # torch's schedule checks its own requirements (DualPipeV: micro-batches >= stages; interleaved: a
    # multiple of the pp size) when made: made once here, they fail at the transform, not at the first step
    staged.schedule(lambda output, target: output)
    staged._schedule = None
    return staged


def _sharded_output_axes(gm, plan) -> tuple[str, ...]:
    """The axes an input of the plan is sharded on and an output of the program still is."""
    from fxshard.meta import KEY, TensorInfo

    inputs = {a for layout in plan.inputs.values() for a, p in layout.items() if isinstance(p, Shard)}
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    infos = [getattr(v.meta.get(KEY), "value", None) for v in values if isinstance(v, torch.fx.Node)]
    layouts = [ti.layout for ti in infos if isinstance(ti, TensorInfo)]
    return tuple(a for a in plan.axes if a in inputs and any(isinstance(lay.get(a), Shard) for lay in layouts))


def _loss_axes(gm, plan, loss: LossProgram) -> tuple[str, ...]:
    """The axes the target input is sharded on (the batch on ``dp``): the count of scored
    tokens and the loss are summed over them.  The values the loss reads (the logits) must
    be sharded the same way and no other (a vocab-sharded head under loss parallel is not)."""
    from torch.distributed.tensor import Replicate, Shard

    from fxshard.meta import KEY, TensorInfo

    target_layout = plan.inputs.get(loss.target, {})
    axes = tuple(a for a, p in target_layout.items() if isinstance(p, Shard))
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    for v in values:
        info = v.meta.get(KEY) if hasattr(v, "meta") else None
        ti = getattr(info, "value", None)
        if not isinstance(ti, TensorInfo):
            continue
        for axis, p in ti.layout.items():
            want = target_layout.get(axis, Replicate())
            if not (isinstance(p, Replicate) and isinstance(want, Replicate)) and p != want:
                raise PlanError(f"pipeline: the model's loss reads {v.name} laid out {axis}={p}, but its target "
                                f"{loss.target!r} is {axis}={want}; the last stage runs the loss on its own tensors\n  fix: "
                                f"a plan whose head output is replicated over {axis!r} (no loss parallel, the logits "
                                f"gathered), with the target sharded like the logits' batch")
    return axes


def train_step(sharded: nn.Module, inputs: dict, loss_fn: Callable | None = None, target: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Forward and backward of one batch; returns the loss, the same on every rank.

    Reads the same with and without pipeline parallelism: ``sharded`` is a module from
    ``fxshard.transform`` (one call ``sharded(**inputs)``, then backward) or a
    :class:`PipelinedModule` (the batch split into ``spec.microbatches`` micro-batches, run
    by the schedule).  ``inputs`` are what a call of the model takes (this rank's share as
    the plan lays it out), e.g. ``{"input_ids": ids, "labels": labels}``.  ``loss_fn=None``:
    the model's own loss (HF ``labels=``); under pp the loss is the mean over the scored
    tokens of the whole batch (micro-batches weighted by their token counts), the gradients
    those of one device on that batch.  ``loss_fn(output, target)``: a loss of the model's
    output (the last stage's) and ``target``, a mean over a micro-batch; micro-batch losses
    are averaged.  The optimizer step and ``zero_grad`` stay the caller's.

    Example::

        loss = fxshard.pipelining.train_step(staged, {"input_ids": ids, "labels": labels})
        opt.step(); opt.zero_grad()
    """
    if pipeline_of(sharded) is None:
        out = sharded(**inputs)
        if loss_fn is not None:
            loss = loss_fn(out, target)
        else:
            loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
            if loss is None:
                raise PlanError("train_step: the model returned no loss\n  fix: pass its labels in inputs, or "
                                "loss_fn=lambda output, target: ... and target=")
        loss.backward()
        return loss.detach()
    return _pipelined_step(sharded, inputs, loss_fn, target)


def eval_step(sharded: nn.Module, inputs: dict, loss_fn: Callable | None = None, target: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The loss of one batch without a backward (a held-out loss): :func:`train_step`'s loss,
    the same on every rank, and no gradient touched.  Call it under ``torch.no_grad()``.

    Example::

        with torch.no_grad():
            eval_loss = fxshard.pipelining.eval_step(staged, {"input_ids": ids, "labels": labels})
    """
    if pipeline_of(sharded) is None:
        out = sharded(**inputs)
        if loss_fn is not None:
            return loss_fn(out, target).detach()
        loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            raise PlanError("eval_step: the model returned no loss\n  fix: pass its labels in inputs, or "
                            "loss_fn=lambda output, target: ... and target=")
        return loss.detach()
    return _pipelined_step(sharded, inputs, loss_fn, target, backward=False)


def _pipelined_step(pm: PipelinedModule, inputs: dict, loss_fn, target, backward: bool = True) -> torch.Tensor:
    spec = pm.spec
    missing = [n for n in pm.input_names if n not in inputs]
    if missing:
        raise PlanError(f"train_step: inputs lack {missing}, which the first stage takes ({pm.input_names})\n  fix: "
                        f"pass every input the model was transformed with")
    args = [inputs[n] for n in pm.input_names]
    batch = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if batch is None or batch % spec.microbatches:
        raise PlanError(f"train_step: {spec.microbatches} micro-batches do not divide the batch of {batch}\n  fix: "
                        f"fxshard.pipeline({spec.axis!r}, microbatches=M) with M dividing {batch}, or a batch that "
                        f"M={spec.microbatches} divides")
    check_static_sizes(pm.static_sizes, dict(zip(pm.input_names, args)), pm.model_class, spec.microbatches)
    if loss_fn is None:
        program = pm.loss_program
        if program is None:
            raise PlanError("train_step: the pipelined model has no loss of its own (no target input among the "
                            "transformed inputs)\n  fix: pass loss_fn=lambda output, target: ... and target=")
        target = inputs.get(program.target)
        if target is None:
            raise PlanError(f"train_step: inputs lack {program.target!r}, which the model's loss reads\n  fix: pass it")
        # the batch's count of scored tokens: each micro-batch's summed loss is divided by it
        pm._count = program.count(target).to(torch.float32)
        if pm.loss_axes:  # the batch's scored tokens over the ranks that share it
            pm._count = reduce_over(pm._count, pm.loss_axes, "sum")

        def schedule_loss(output, tgt):
            outs = output if isinstance(output, tuple) else (output,)
            return program.summed(*outs, tgt) * (pm.fsdp_ranks / pm._count)
    else:
        if target is None:
            raise PlanError("train_step: loss_fn= needs target= (what the schedule splits with the batch and passes as "
                            "loss_fn(output, target))\n  fix: train_step(staged, inputs, loss_fn, target=labels)")
        # fxshard sums gradients over the batch's axes: each rank's mean counts 1 / ranks of the batch's
        share = spec.microbatches * pm.batch_ranks / pm.fsdp_ranks

        def schedule_loss(output, tgt):
            return loss_fn(output, tgt) / share
    pm._loss_fn = schedule_loss
    pm.sync_stage_state()
    shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in [*args, target])
    schedule = pm.schedule(lambda output, tgt: pm._loss_fn(output, tgt), shapes)
    losses: list = []
    step_args = args if pm.holds_first else ()
    # under fxshard.no_sync the tied copies' sum waits for the first step outside it, which sums
    # every gradient since the last sum (the one before the first held step)
    if not backward:
        schedule.eval(*step_args, target=target if pm.holds_last else None, losses=losses)
    elif pm._tied_unsynced is None:
        pm._tied_unsynced = _tied_grads_before(pm)
    else:  # zero_grad(set_to_none=True) within the held steps: nothing before it to keep
        pm._tied_unsynced = [None if p.grad is None else g for (_, p), g in zip(_tied_params(pm), pm._tied_unsynced)]
    if backward:
        schedule.step(*step_args, target=target if pm.holds_last else None, losses=losses)
    if pm.holds_last:
        total = torch.stack([l.detach().float() for l in losses]).sum() / pm.fsdp_ranks
    else:
        total = torch.zeros((), dtype=torch.float32, device=args[0].device if args else "cpu")
    src = pm._global_rank_of_pp[spec.rank_of_stage(pm.num_stages - 1, pm.pp_size)]
    dist.broadcast(total, src=src, group=pm.pp_group)
    if loss_fn is None and pm.loss_axes:
        total = reduce_over(total, pm.loss_axes, "sum")
    elif loss_fn is not None and pm.batch_axes:
        total = reduce_over(total, pm.batch_axes, "sum")
    if backward and not _param_syncs_held():
        _sum_tied_grads(pm, pm._tied_unsynced)
        pm._tied_unsynced = None
    return total


def _param_syncs_held() -> bool:
    """Inside ``fxshard.no_sync``? (``hold_param_syncs`` returns the setting it replaces.)"""
    held = hold_param_syncs(True)
    hold_param_syncs(held)
    return held


# ----------------------------------------------------------------------------- tied parameters


def _pp_lines(mesh, axis: str) -> list[list[int]]:
    """Global ranks of every line of the mesh along ``axis`` (each a pipeline), in a fixed order."""
    dim = mesh.mesh_dim_names.index(axis)
    ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
    return [[int(r) for r in row] for row in ranks]


def _pp_line(mesh, axis: str) -> list[int]:
    me = dist.get_rank()
    return next(line for line in _pp_lines(mesh, axis) if me in line)


def _tied_groups(cut: StageCut, spec: PipelineSpec, mesh, pp_rank: int, pp: int) -> list[tuple[Any, list[str]]]:
    """For each set of pipeline ranks that hold one tied parameter (the embedding and the
    head): a process group over them, in this rank's pipeline, and the FQNs; Megatron sums
    their gradients after backward so that the copies stay equal."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for fqn, stages in sorted(cut.tied.items()):
        ranks = tuple(sorted({spec.rank_of_stage(s, pp) for s in stages}))
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, []).append(fqn)
    groups = []
    me = dist.get_rank()
    for ranks, fqns in sorted(by_ranks.items()):
        for line in _pp_lines(mesh, spec.axis):  # every rank makes every group, in one order
            members = [line[r] for r in ranks]
            group = dist.new_group(members)
            if me in members:
                groups.append((group, fqns))
    return groups


def _tied_params(pm: PipelinedModule) -> list[tuple[Any, torch.Tensor]]:
    params = dict(pm.named_parameters(remove_duplicate=False))
    out, seen = [], set()
    for group, fqns in pm._tied:
        for fqn in fqns:
            p = params.get(fqn)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((group, p))
    return out


def _tied_grads_before(pm: PipelinedModule) -> list[torch.Tensor | None]:
    """The tied parameters' gradients before a step: what is accumulated from earlier steps
    (gradient accumulation) is summed already and must not be summed again (under
    ``fxshard.no_sync``: before the first of the steps whose sum is held back)."""
    return [None if p.grad is None else p.grad.clone() for _, p in _tied_params(pm)]


def _sum_tied_grads(pm: PipelinedModule, before: list[torch.Tensor | None]) -> None:
    """Megatron's embedding sync: this step's gradient of each tied copy summed over the
    stages that hold one, so the copies stay equal."""
    for (group, p), old in zip(_tied_params(pm), before):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
        old = old.to_local() if hasattr(old, "to_local") else old
        step = grad if old is None else grad - old
        dist.all_reduce(step, group=group)
        if old is not None:
            grad.copy_(old + step)


def _trivial_mesh(mesh, axis: str):
    """The mesh of a plan without sharding (pipeline parallelism alone): the mesh's other dims
    (all of size 1 then), or, for a mesh of the pipeline axis alone, a one-rank ``MeshSpec``
    (a plan of no sharding makes no collective, so it needs no process group)."""
    others = [a for a in mesh.mesh_dim_names if a != axis]
    if others:
        return mesh[others[0]] if len(others) == 1 else mesh[tuple(others)]
    return MeshSpec((f"{axis}_stage",), (1,))
