"""From ``--mesh`` to each rank's program: the plan of every axis, the transform (or the
pipeline transform), the weights, FSDP2 and compile, each phase timed.

* ``tp`` / ``ep``: the model's own plan (``Plan.from_hf``, ``Plan.from_torchtitan``), under tp
  sequence- and loss-parallel (Megatron's program; :func:`build_plan`): the program returns
  vocab-shard logits and the loop takes the vocab-parallel loss on them (``Program.vocab_parallel``);
* ``cp``: every attention module context-parallel, the token input sharded on its
  sequence dim (load-balanced; under pp contiguous, with the final norm's output gathered
  so the last stage scores whole sequences: the recipe of docs/pipeline.md);
* ``dp``: the token input sharded on its batch dim; FSDP2 shards the parameters over
  dp x cp (one flattened mesh dim, torchtitan's ``dp_shard_cp``; over cp alone when dp
  is 1), ``MixedPrecisionPolicy`` under ``--bf16``;
* ``dp_replicate``: the batch split over it too, FSDP2 replicating over it (HSDP);
* ``pp``: ``pipeline_transform`` over the whole mesh, ``--microbatches``, ``--schedule``.

Example::

    program = parallelize(model, source, dims, mesh, options, example, log=print)
    program.module        # a GraphModule, or a PipelinedModule under pp
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn

from fxshard.pipelining.train_step import pipeline_transform
from fxshard.plan.pipeline import pipeline
from fxshard.plan.plan import Plan
from fxshard.plan.specs import ModuleSpec, context_parallel, pattern_regex
from fxshard.state.hf_checkpoint import load_hf_checkpoint
from fxshard.state.materialize import materialize
from fxshard.training.checkpointing import checkpoint_blocks, checkpoint_kwargs, checkpointed_blocks, parse_checkpointing
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
    activation_checkpointing: str | bool | None = "none"  # none, full, selective, selective:K (bool: the old flag)
    device: str = "cpu"


@dataclass
class Program:
    """Each rank's module and what the loop needs to know about it."""

    module: nn.Module
    pipelined: bool
    gathers_sequence: bool = False  # pp x cp: the last stage scores whole sequences
    load_balanced_cp: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    vocab_parallel: tuple[str, int] | None = None  # (axis, vocab): its logits are vocab shards (loss parallel)


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


def build_plan(model: nn.Module, source: ModelSource, dims: ParallelDims, mesh, opts: ParallelOptions,
               log: Callable[[str], None] | None = None):
    """The plan over the mesh's axes other than pp (``None`` under pp alone), the pipeline spec in it.

    Under tp the plan is Megatron's: the model's own plan with sequence parallelism (norms,
    residuals and dropout on sequence shards between the tp regions: reduce-scatter /
    all-gather where plain TP all-reduces) and loss parallelism (the LM head's logits stay
    vocab-sharded; the loop takes the loss on the shards, :func:`sharded_logits`).  A model
    whose structure sequence parallelism cannot cover falls back to plain TP, said by ``log``.

    Example::

        plan, spec = build_plan(model, source, ParallelDims(tp=2), mesh, ParallelOptions(), log=print)
        sharded_logits(plan, model)      # ('tp', 32000): the loss is vocab-parallel
    """
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
        # torchtitan's own plan: sequence parallel (its default) and its loss-parallel head
        plan = Plan.from_torchtitan(sub, model, loss_parallel=True) if dims.tp > 1 else Plan(sub, {})
    elif dims.tp > 1 or dims.ep > 1:
        if dims.ep > 1 and not getattr(model.config.get_text_config(), "base_model_ep_plan", None):
            raise TrainerError(f"--mesh {dims.spec}: ep shards a mixture of experts' routed experts, and "
                               f"{type(model).__name__} has none (its config has no base_model_ep_plan)\n  fix: drop ep, or "
                               f"an MoE model (mixtral, qwen3_moe, ...)")
        plan = _hf_plan(sub, model, dims, log) if dims.tp > 1 else Plan.from_hf(sub, model)
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
            norm = final_norm_name(model)
            key = next((p for p in specs if pattern_regex(p).fullmatch(norm)), norm)
            old = specs.get(key)  # under sequence parallelism: the norm on (cp, tp) sequence shards
            specs[key] = ModuleSpec(out_src={"cp": Shard(1)}, out_dst={"cp": Replicate()}) if old is None else replace(
                old, out_src={**(old.out_src or {}), "cp": Shard(1)},
                out_dst={**(old.out_dst or old.out_src or {}), "cp": Replicate()})
    for axis in dims.batch_axes:  # the rows over dp_replicate, then within it over dp
        inputs.setdefault(name, {})[axis] = Shard(0)
    return Plan(sub, specs, inputs=inputs, fsdp=dims.fsdp_axes or None, pipeline=spec), spec


def _hf_plan(sub, model: nn.Module, dims: ParallelDims, log: Callable[[str], None] | None) -> Plan:
    """HF's plan with sequence and loss parallelism; each that this model's structure
    refuses is dropped with a line saying why (plain TP computes the same numbers)."""
    try:
        return Plan.from_hf(sub, model, sequence_parallel=True, loss_parallel=True)
    except PlanError as e:
        first = str(e)
    for sp, lp in ((False, True), (True, False)):
        try:
            plan = Plan.from_hf(sub, model, sequence_parallel=sp, loss_parallel=lp)
        except PlanError:
            continue
        if log is not None:
            log(f"tp: {'loss parallel only' if lp else 'sequence parallel only'} for {type(model).__name__}: "
                f"{first.splitlines()[0]}")
        return plan
    if log is not None:
        log(f"tp: plain tensor parallel (no sequence or loss parallel) for {type(model).__name__}: "
            f"{first.splitlines()[0]}")
    return Plan.from_hf(sub, model)


def sharded_logits(plan: Plan | None, model: nn.Module) -> tuple[str, int] | None:
    """``(axis, vocab size)`` when ``plan`` leaves the logits vocab-sharded (loss parallel:
    a head whose output stays ``Shard(-1)``), else None.  The loop then takes the loss on
    each rank's vocab shard (``token_loss_sum(..., vocab_axis=axis, vocab_size=vocab)``).

    Example: ``sharded_logits(Plan.from_hf(mesh, model, loss_parallel=True), model)`` -> ``('tp', 32000)``
    """
    from torch.distributed.tensor import Shard

    if plan is None:
        return None
    head = getattr(model, "get_output_embeddings", lambda: None)()  # HF; torchtitan's head is `lm_head` / `output`
    head = head if head is not None else getattr(model, "lm_head", None) or getattr(model, "output", None)
    fqn = next((f for f, m in model.named_modules() if m is head), None) if isinstance(head, nn.Module) else None
    if fqn is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return None
    spec = next((s for p, s in plan.specs.items() if pattern_regex(p).fullmatch(fqn)), None)
    out = (spec.out_dst if spec.out_dst is not None else spec.out_src) if spec is not None else None
    axes = [a for a, p in out.items() if isinstance(p, Shard) and p.dim in (-1, 2)] if isinstance(out, dict) else []
    return (axes[0], int(head.weight.shape[0])) if len(axes) == 1 else None


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
    plan, spec = build_plan(model, source, dims, mesh, opts, log=log)
    checkpointing = _checkpointing_mode(opts)  # (mode, every): the blocks are split out for it
    split = bool(opts.compile) or checkpointing[0] != "none"
    timings: dict[str, float] = {}
    kwargs = {source.input_name: example}
    t0 = time.perf_counter()
    try:
        if spec is not None:
            module = pipeline_transform(model, plan, mesh, example_kwargs=kwargs, spec=spec,
                                                **({"blocks": "auto"} if split else {}))
        else:
            module = transform(model, plan, example_kwargs=kwargs, blocks="auto" if split else None,
                                       timings=timings)
    except PlanError as e:
        raise TrainerError(f"--mesh {dims.spec} with --model {source.name}: the plan does not fit the model:\n{e}") from None
    _enable_activation_checkpointing(module, checkpointing, log)
    capture = timings.get("capture", 0.0)
    log(f"startup: capture {capture:.1f} s, transform {time.perf_counter() - t0 - capture:.1f} s"
        if capture else f"startup: capture + transform {time.perf_counter() - t0:.1f} s")
    if source.loads_weights_per_rank:
        t0 = time.perf_counter()
        materialize(module, model, device=opts.device, init=None)
        # under pp a rank holds its stages' tensors only: the checkpoint's others are not its to read
        load_hf_checkpoint(module, source.name, model=model, strict=spec is None, show_progress=False)
        log(f"startup: load {source.name} (this rank's slices) {time.perf_counter() - t0:.1f} s")
    if dims.fsdp_axes:  # FSDP2 shards over dp x cp (torchtitan's dp_shard_cp), replicated over dp_replicate
        fsdp_kwargs = {}
        if opts.bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            log("startup: bf16 by FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)")
        fully_shard(module, mesh, replicate=dims.hsdp, **fsdp_kwargs)
    if opts.compile:
        t0 = time.perf_counter()
        compile_blocks(module, backend=opts.compile)
        log(f"startup: compile set up ({opts.compile}, one graph per block; compiled at the first step) "
            f"{time.perf_counter() - t0:.1f} s")
    return Program(module, pipelined=spec is not None, gathers_sequence=dims.cp > 1 and spec is not None,
                   load_balanced_cp=dims.cp > 1 and spec is None, timings=timings,
                   vocab_parallel=sharded_logits(plan, model))


def _checkpointing_mode(opts: ParallelOptions) -> tuple[str, int]:
    """``(mode, every)`` of ``--activation-checkpointing``, or the TrainerError that says the modes."""
    try:
        return parse_checkpointing(opts.activation_checkpointing)
    except PlanError as e:
        raise TrainerError(f"--activation-checkpointing: {e}") from None


def _enable_activation_checkpointing(module: nn.Module, checkpointing: tuple[str, int], log: Callable[[str], None]) -> None:
    """Checkpoint the blocks of the transformed program (``fxshard.checkpoint_blocks``): ``full``,
    ``selective`` per op (matmul, attention and collective outputs saved: the recomputation
    communicates nothing), or every K-th block in full.  Under pp, on this rank's stages."""
    mode, every = checkpointing
    if mode == "none":
        return
    checkpoint_blocks(module, mode, every=every)
    done = checkpointed_blocks(module)
    log(f"activation checkpointing: {mode}{f' every {every} blocks' if every > 1 else ''} on {len(done)} block(s) "
        f"of this rank")


def enable_hf_checkpointing(model: nn.Module, text: str | bool | None, name: str = "the model") -> None:
    """``--activation-checkpointing`` on a one-process HF model: HF's ``gradient_checkpointing_enable``
    with fxshard's checkpoint keywords (the selective policy for ``selective``), and ``selective:K``
    on every K-th decoder layer only.  A model without HF's method is a TrainerError.

    Example: ``enable_hf_checkpointing(model, "selective")``
    """
    mode, every = parse_checkpointing(text)
    if mode == "none":
        return
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise TrainerError(f"--activation-checkpointing {text} in one process: {name} has no "
                           f"gradient_checkpointing_enable()\n  fix: an HF model, a --mesh (fxshard checkpoints the "
                           f"program's blocks), or drop the flag")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(mode))
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for i, layer in enumerate(layers, 1):
        if i % every:
            layer.gradient_checkpointing = False  # selective:K: the K-th, 2K-th, ... layer only
