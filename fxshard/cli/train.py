"""``python -m fxshard train`` and ``python -m fxshard export``: the trainer's command lines.

    torchrun --nproc-per-node 4 -m fxshard train --model path/to/checkpoint --data book.txt \\
        --mesh dp=2,tp=2 --steps 100 --log-dir runs/a --ckpt-dir ckpt --export-hf out/model
    python -m fxshard export ckpt/step000100 out/model

A flag, file or mesh the trainer cannot run is said on stderr before any work, with exit
status 2 (:class:`fxshard.trainer.errors.TrainerError`); under torchrun once, by the first
rank that failed (:func:`run_train`). Ctrl-C ends with one line naming the last committed
checkpoint (exit status 130).
"""
from __future__ import annotations

import argparse
import os
import sys

from fxshard.recipe.parallel_dims import ParallelDims
from fxshard.trainer.arguments import add_export_arguments, add_train_arguments
from fxshard.trainer.errors import TrainerError


def add_parsers(sub) -> None:
    """The ``train`` and ``export`` sub-commands of ``python -m fxshard``."""
    add_train_arguments(sub.add_parser("train", help="train a model on text files, any mesh of dp, tp, pp, cp, ep",
                                       formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    add_export_arguments(sub.add_parser("export", help="a trainer checkpoint as an HF checkpoint (save_pretrained)"))


def resolve_auto_mesh(args) -> ParallelDims:
    """``--mesh auto``: the best entry of ``fxshard.plan_parallelism`` for this model, process
    count, ``--seq``, ``--batch`` and ``--memory-gib`` (default: the device's, a CPU's memory
    over ``LOCAL_WORLD_SIZE``; every rank plans the same, before the process group exists),
    timed compiled under ``--compile inductor``, with the gradient-accumulation passes
    (``--accum``: kept when above 1) and where FSDP2's gradients wait between them
    (``--accum-grads``: kept when given), the pipeline flags
    and activation checkpointing it names unless given; ``args`` is updated in place, the
    choice printed by rank 0, and its :class:`~fxshard.recipe.parallel_dims.ParallelDims` returned.

    Example: ``resolve_auto_mesh(args).mesh_spec``   # 'dp=2,tp=2', now also ``args.mesh``"""
    import os

    from fxshard.errors import PlanError
    from fxshard.planner import plan_parallelism
    from fxshard.trainer.loop import VOCAB_MULTIPLE
    from fxshard.trainer.models import ModelSource, parse_overrides

    world = int(os.environ.get("WORLD_SIZE", "1"))
    source = ModelSource.resolve(args.model, parse_overrides(args.model_config), seed=args.seed)
    source.positions = args.seq
    model = source.build_meta(source.vocab_size(-(-257 // VOCAB_MULTIPLE) * VOCAB_MULTIPLE))
    try:
        entries = plan_parallelism(model, world, memory_gib=args.memory_gib, seq=args.seq, global_batch=args.batch,
                                   device="cpu" if args.device == "cpu" else None, dtype="bf16" if args.bf16 else "fp32",
                                   accum=args.accum if args.accum > 1 else None, accum_grads=args.accum_grads,
                                   compiled=args.compile == "inductor")
    except PlanError as e:
        raise TrainerError(f"--mesh auto: the planner refused: {e}") from None
    best = next((e for e in entries if e.fits), None)
    if best is None:
        why = entries[0].reason if entries else "no candidate"
        raise TrainerError(f"--mesh auto: no mesh of {world} processes fits ({why})\n  fix: more processes or "
                           f"--memory-gib, a smaller --batch or --seq; python -m fxshard plan lists every candidate")
    dims = best.dims
    args.mesh = dims.mesh_spec
    args.accum = best.accum  # the planner's passes (the user's, when --accum was above 1)
    if args.accum_grads is None and best.candidate.sharded_grads:  # unsharded does not fit: reduce-scatter each pass
        args.accum_grads = "sharded"
    if dims.pp > 1:
        args.microbatches = args.microbatches or best.microbatches
        args.schedule = args.schedule or best.schedule
        args.virtual_stages = args.virtual_stages or (best.virtual if best.virtual > 1 else None)
    if args.activation_checkpointing is None:  # not given: the planner's mode (none, selective or full)
        args.activation_checkpointing = best.activation_checkpointing
    args.memory_gib = None  # spent: the run itself has no use for it
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"mesh auto: {best.trainer_flags() or 'one process'} (predicted {best.step_time_s:.3g} s a step, "
              f"{best.memory['total'] / 2**30:.2f} GiB on the fullest rank; python -m fxshard plan lists every "
              f"candidate)", flush=True)
    return dims


def run_train(args) -> int:
    """The trainer's top level: the run's exit status, and what a failed or stopped run says,
    said once.  Under torchrun the worker then exits at once with that status
    (:func:`_exit_worker`).

    * a TrainerError / PlanError (a flag, file, mesh or checkpoint it cannot use): its message
      on stderr, exit status 2; under torchrun only from the first rank that failed (rank 0
      for what every rank checks before the processes meet), the other ranks exit 2 silently;
    * any other error under torchrun: the first rank's traceback, once; exit status 1;
    * Ctrl-C (SIGINT, which torchrun passes on to its workers): one line naming the last
      committed checkpoint, from rank 0; exit status 130.
    """
    status = _train_status(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _exit_worker(status)
    return status


def _exit_worker(status: int) -> None:
    """End a torchrun worker whose run is over (its checkpoints committed, its log closed, its
    process group destroyed) without the interpreter's teardown: under load, c10d's background
    threads can abort a process while it tears down ("terminate called without an active
    exception", SIGABRT), and torchrun would report a finished run as failed.  Python-level
    finalizers (multiprocessing's) still run; the output is flushed."""
    import multiprocessing.util

    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _train_status(args) -> int:
    from fxshard.errors import PlanError
    from fxshard.trainer.loop import claim_failure, interrupted_message, let_rank_0_report, run

    try:
        if args.mesh == "auto":
            resolve_auto_mesh(args)
        return run(args)
    except KeyboardInterrupt:  # before the run began (run() says its own)
        if int(os.environ.get("RANK", "0")) == 0:
            print(interrupted_message(args.ckpt_dir), file=sys.stderr, flush=True)
        return 130
    except (TrainerError, PlanError) as e:
        if claim_failure():
            print(f"fxshard train: error: {e}", file=sys.stderr, flush=True)
        else:
            let_rank_0_report()
        return 2
    except ImportError:  # a missing extra: python -m fxshard names it
        raise
    except Exception:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            raise
        if claim_failure():  # the first rank's traceback; the others' are its echo (peers gone)
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        return 1


def run_export(args) -> int:
    from fxshard.trainer.export import export_checkpoint
    from fxshard.trainer.models import require

    from fxshard.errors import PlanError

    try:
        require("transformers")
        out = export_checkpoint(args.checkpoint, args.output, args.model_dir)
    except (TrainerError, PlanError) as e:
        print(f"fxshard export: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {args.checkpoint} to {out}", flush=True)
    return 0
