"""From ``--mesh`` to each rank's program: the plan of every axis, the transform (or the
pipeline transform), the weights, FSDP2 and compile, each phase timed.

* ``tp`` / ``ep``: the model's own plan (``Plan.from_hf``, ``Plan.from_torchtitan``);
* ``cp``: every attention module context-parallel, the token input sharded on its
  sequence dim (load-balanced; under pp contiguous, with the final norm's output gathered
  so the last stage scores whole sequences: the recipe of docs/pipeline.md);
* ``dp``: the token input sharded on its batch dim, FSDP2 on the axis
  (``MixedPrecisionPolicy`` under ``--bf16``);
* ``pp``: ``pipeline_transform`` over the whole mesh, ``--microbatches``, ``--schedule``.

Example::

    program = parallelize(model, source, dims, mesh, options, example, log=print)
    program.module        # a GraphModule, or a PipelinedModule under pp
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from fxshard.pipelining.train_step import pipeline_transform
from fxshard.plan.pipeline import pipeline
from fxshard.plan.plan import Plan
from fxshard.plan.specs import ModuleSpec, context_parallel
from fxshard.state.hf_checkpoint import load_hf_checkpoint
from fxshard.state.materialize import materialize
from fxshard.training.compile import compile as compile_blocks
from fxshard.training.fsdp import fully_shard
from fxshard.transform import transform
from fxshard.errors import PlanError
from fxshard.trainer.errors import TrainerError
from fxshard.trainer.models import ModelSource
from fxshard.trainer.parallel_dims import ParallelDims


@dataclass
class ParallelOptions:
    """The flags that shape the program (see ``python -m fxshard train --help``)."""

    microbatches: int = 1
    schedule: str = "1F1B"
    virtual_stages: int | None = None
    bf16: bool = False
    compile: str | None = None
    activation_checkpointing: bool = False
    device: str = "cpu"


@dataclass
class Program:
    """Each rank's module and what the loop needs to know about it."""

    module: nn.Module
    pipelined: bool
    gathers_sequence: bool = False  # pp x cp: the last stage scores whole sequences
    load_balanced_cp: bool = False
    timings: dict[str, float] = field(default_factory=dict)


def attention_pattern(model: nn.Module) -> str:
    """The FQN pattern of the attention module of every block (``model.layers.*.self_attn``)."""
    found = set()
    for name, m in model.named_modules():
        if re.search(r"\.\d+\.[^.]+$", name) and type(m).__name__.endswith("Attention"):
            found.add(re.sub(r"\.\d+\.", ".*.", name))
    if len(found) != 1:
        raise TrainerError(f"--mesh cp=...: cannot tell the attention module of each block of {type(model).__name__} "
                           f"(found {sorted(found) or 'none'})\n  fix: a model whose blocks hold one '*Attention' module "
                           f"(HF decoders do), or no cp axis")
    return found.pop()


def final_norm_name(model: nn.Module) -> str:
    """The norm after the last block (``model.norm``): under pp x cp its output is gathered."""
    for name in ("model.norm", "norm", "transformer.ln_f", "model.final_layernorm"):
        try:
            model.get_submodule(name)
            return name
        except AttributeError:
            continue
    raise TrainerError(f"--mesh pp=..,cp=..: no final norm found in {type(model).__name__} (model.norm)\n  fix: "
                       f"drop pp or cp for this model")


def build_plan(model: nn.Module, source: ModelSource, dims: ParallelDims, mesh, opts: ParallelOptions):
    """The plan over the mesh's axes other than pp (``None`` under pp alone), the pipeline spec in it."""
    plan_axes = dims.plan_axes
    spec = None
    if dims.pp > 1:
        virtual = opts.virtual_stages or (2 if _multi_stage(opts.schedule) else 1)
        spec = pipeline("pp", microbatches=opts.microbatches, schedule=opts.schedule, virtual=virtual)
    if not plan_axes:
        return None, spec
    sub = mesh[tuple(plan_axes)] if len(plan_axes) > 1 else mesh[next(iter(plan_axes))]
    if source.kind == "torchtitan":
        if dims.ep > 1 or dims.cp > 1:
            raise TrainerError(f"--mesh {dims.spec}: {source.name} is a dense model with torchtitan's TP plan; ep and cp "
                               f"are not offered for it\n  fix: dp, tp and pp; or an HF model")
        plan = Plan.from_torchtitan(sub, model) if dims.tp > 1 else Plan(sub, {})
    elif dims.tp > 1 or dims.ep > 1:
        if dims.ep > 1 and not getattr(model.config.get_text_config(), "base_model_ep_plan", None):
            raise TrainerError(f"--mesh {dims.spec}: ep shards a mixture of experts' routed experts, and "
                               f"{type(model).__name__} has none (its config has no base_model_ep_plan)\n  fix: drop ep, or "
                               f"an MoE model (mixtral, qwen3_moe, ...)")
        plan = Plan.from_hf(sub, model)
    else:
        plan = Plan(sub, {})
    specs, inputs = dict(plan.specs), {k: dict(v) for k, v in plan.inputs.items()}
    name = source.input_name
    from torch.distributed.tensor import Replicate, Shard

    if dims.cp > 1:
        pattern = attention_pattern(model)
        if pattern in specs:
            raise TrainerError(f"--mesh {dims.spec}: the model's plan already has an entry for {pattern}; cp would replace it")
        specs[pattern] = context_parallel("cp", load_balance=dims.pp == 1)
        inputs.setdefault(name, {})["cp"] = Shard(1)
        if dims.pp > 1:
            specs[final_norm_name(model)] = ModuleSpec(out_src={"cp": Shard(1)}, out_dst={"cp": Replicate()})
    if dims.dp > 1:
        inputs.setdefault(name, {})["dp"] = Shard(0)
    return Plan(sub, specs, inputs=inputs, fsdp="dp" if dims.dp > 1 else None, pipeline=spec), spec


def _multi_stage(schedule: str) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    try:
        return issubclass(get_schedule_class(schedule), PipelineScheduleMulti)
    except ValueError as e:
        raise TrainerError(f"--schedule {schedule}: {e}") from None


def parallelize(model: nn.Module, source: ModelSource, dims: ParallelDims, mesh, opts: ParallelOptions,
                example: torch.Tensor, log: Callable[[str], None]) -> Program:
    """Each rank's program for ``model`` (on the meta device when its weights come from a
    checkpoint directory), ready to train; logs a line per phase with its seconds.
    ``example``: single-device token ids of one micro-batch (global rows)."""
    plan, spec = build_plan(model, source, dims, mesh, opts)
    if opts.activation_checkpointing:
        _enable_activation_checkpointing(model, source)
    timings: dict[str, float] = {}
    kwargs = {source.input_name: example}
    t0 = time.perf_counter()
    try:
        if spec is not None:
            module = pipeline_transform(model, plan, mesh, example_kwargs=kwargs, spec=spec,
                                                **({"blocks": "auto"} if opts.compile else {}))
        else:
            module = transform(model, plan, example_kwargs=kwargs, blocks="auto" if opts.compile else None,
                                       timings=timings)
    except PlanError as e:
        raise TrainerError(f"--mesh {dims.spec} with --model {source.name}: the plan does not fit the model:\n{e}") from None
    capture = timings.get("capture", 0.0)
    log(f"startup: capture {capture:.1f} s, transform {time.perf_counter() - t0 - capture:.1f} s"
        if capture else f"startup: capture + transform {time.perf_counter() - t0:.1f} s")
    if source.loads_weights_per_rank:
        t0 = time.perf_counter()
        materialize(module, model, device=opts.device, init=None)
        # under pp a rank holds its stages' tensors only: the checkpoint's others are not its to read
        load_hf_checkpoint(module, source.name, model=model, strict=spec is None, show_progress=False)
        log(f"startup: load {source.name} (this rank's slices) {time.perf_counter() - t0:.1f} s")
    if dims.dp > 1:
        fsdp_kwargs = {}
        if opts.bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            log("startup: bf16 by FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)")
        fully_shard(module, mesh["dp"] if spec is not None else mesh, **fsdp_kwargs)
    if opts.compile:
        t0 = time.perf_counter()
        compile_blocks(module, backend=opts.compile)
        log(f"startup: compile set up ({opts.compile}, one graph per block; compiled at the first step) "
            f"{time.perf_counter() - t0:.1f} s")
    return Program(module, pipelined=spec is not None, gathers_sequence=dims.cp > 1 and spec is not None,
                   load_balanced_cp=dims.cp > 1 and spec is None, timings=timings)


def _enable_activation_checkpointing(model: nn.Module, source: ModelSource) -> None:
    """HF's ``gradient_checkpointing_enable()``: fxshard keeps it per block of the program."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise TrainerError(f"--activation-checkpointing: {source.name} has no gradient_checkpointing_enable()\n  fix: "
                           f"an HF model, or drop the flag")
    model.gradient_checkpointing_enable()
