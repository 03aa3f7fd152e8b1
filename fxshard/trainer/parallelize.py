"""From ``--mesh`` to each rank's program: the recipe's plan of the mesh, the transform (or
the pipeline transform), the weights, FSDP2 and compile, each phase timed.

The plan of every axis is the recipe's (``fxshard.recipe.plan_for_mesh``: Megatron's tp with
sequence- and loss-parallel regions, cp, the dp inputs, FSDP2's axes), the one the planner
predicts; here it is carried out:

* ``tp`` / ``ep``: the program returns vocab-shard logits and the loop takes the
  vocab-parallel loss on them (``Program.vocab_parallel``);
* ``cp``: load-balanced; under pp contiguous, the final norm's output gathered so the last
  stage scores whole sequences (``Program.gathers_sequence``, docs/pipeline.md);
* ``dp``: FSDP2 shards the parameters over dp x cp (one flattened mesh dim, torchtitan's
  ``dp_shard_cp``; over cp alone when dp is 1), ``MixedPrecisionPolicy`` under ``--bf16``;
* ``dp_replicate``: the batch split over it too, FSDP2 replicating over it (HSDP);
* ``pp``: ``pipeline_transform`` over the whole mesh, ``--microbatches``, ``--schedule``.

Example::

    program = parallelize(model, source, dims, mesh, options, example, log=print)
    program.module        # a GraphModule, or a PipelinedModule under pp
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from fxshard.pipelining.train_step import pipeline_transform
from fxshard.recipe.parallel_dims import ParallelDims
from fxshard.recipe.plan_for_mesh import pipeline_spec, plan_for_mesh, sharded_logits
from fxshard.state.hf_checkpoint import load_hf_checkpoint
from fxshard.state.materialize import materialize
from fxshard.training.checkpointing import checkpoint_blocks, checkpoint_kwargs, checkpointed_blocks, parse_checkpointing
from fxshard.training.compile import compile as compile_blocks
from fxshard.training.fsdp import fully_shard
from fxshard.transform import transform
from fxshard.errors import PlanError
from fxshard.trainer.errors import TrainerError
from fxshard.trainer.models import ModelSource


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


def build_plan(model: nn.Module, source: ModelSource, dims: ParallelDims, mesh, opts: ParallelOptions,
               log: Callable[[str], None] | None = None):
    """The trainer's plan and pipeline spec for ``dims``: the recipe's plan of the mesh
    (:func:`fxshard.recipe.plan_for_mesh.plan_for_mesh`, ``None`` under pp alone) with the
    pipeline of ``--microbatches``, ``--schedule`` and ``--virtual-stages`` in it.  The plan
    depends on the model only (``source``, the ``--model`` it was built from, is taken for
    the callers that hold one; the recipe tells torchtitan's models from HF's by their class).

    Example::

        plan, spec = build_plan(model, source, ParallelDims(tp=2), mesh, ParallelOptions(), log=print)
        sharded_logits(plan, model)      # ('tp', 32000): the loss is vocab-parallel
    """
    spec = pipeline_spec(dims, opts.microbatches, opts.schedule, opts.virtual_stages)
    return plan_for_mesh(model, dims, mesh, pipeline=spec, log=log), spec


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
    return Program(module, pipelined=spec is not None, gathers_sequence=dims.gathers_sequence_before_head,
                   load_balanced_cp=dims.load_balanced_cp, timings=timings,
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
