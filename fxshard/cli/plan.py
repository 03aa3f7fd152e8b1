"""``python -m fxshard plan``: the meshes a model can train on, best first (docs/planning.md).

    python -m fxshard plan --model path/to/Llama-3-8B --world 64 --memory-gib 80 --seq 8192 --batch 512 --device h100
    python -m fxshard plan --model llama --world 4 --seq 256 --batch 8 --candidates "tp=2;pp=2,tp=2,accum=2"
    torchrun --nproc-per-node 8 -m fxshard plan --calibrate h100-node.json      # this device and its links
    python -m fxshard plan --model DIR ... --device h100-node.json                # plan with the measured constants

The flags are ``train``'s: ``--batch`` (rows per optimizer step, over all ranks),
``--memory-gib`` (per rank; default the device's: a GPU's total, a CPU's memory over the ranks
that share it), ``--seq``, ``--accum`` (default: the fewest passes that fit, per candidate);
``--global-batch`` and ``--memory`` are deprecated spellings of the first two.

The table lists the best entries (rank, mesh, accumulation passes, micro-batches, schedule,
recomputation, the bytes of the fullest rank, the bytes each axis moves per step, the predicted
step time and tokens per second per rank), then the rejected ones with their reason; a sub-plan
that hit a bug in fxshard is listed as such (the others are planned).  The last line, ``best:``,
is the command that trains the best entry.  ``--json`` writes every entry.  A model, mesh or
file the planner cannot use is one line on stderr naming the fix, exit 2.  Under torchrun only
rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys


def add_parser(sub) -> None:
    """The ``plan`` sub-command of ``python -m fxshard``."""
    p = sub.add_parser("plan", help="rank the meshes of dp, tp, pp, cp, ep a model can train on (memory, communication, "
                                    "time per rank)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory or config.json (built on the meta device), or an HF model type")
    p.add_argument("--world", type=int, help="the number of ranks")
    p.add_argument("--memory-gib", "--memory", dest="memory_gib", type=float, default=None,
                   help="GiB per rank (default: the device's: a GPU's total, or this machine's memory over the ranks "
                        "that share it; --memory: deprecated spelling)")
    p.add_argument("--seq", type=int, help="tokens per row")
    p.add_argument("--batch", "--global-batch", dest="batch", type=int,
                   help="global batch: rows of --seq tokens per optimizer step, over all ranks (--global-batch: "
                        "deprecated spelling)")
    p.add_argument("--accum", type=int, default=None,
                   help="gradient-accumulation passes per step for every candidate (default: the fewest that fit)")
    p.add_argument("--accum-grads", choices=("unsharded", "sharded"), default=None,
                   help="where FSDP2's gradients wait between accumulation passes, for every candidate (default: "
                        "unsharded, or sharded where that does not fit)")
    p.add_argument("--data", nargs="+", default=None, metavar="FILE", help="the text files the best: line trains on")
    p.add_argument("--device", default=None, help="h100, h200, a100, cpu, or a --calibrate JSON (default: this machine)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPUs, fp32 on a CPU")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="the run compiles its blocks (the trainer's --compile): inductor's fused kernels are timed, "
                        "other backends fuse nothing (timed as eager)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks that share the fast links (default: the device's)")
    p.add_argument("--candidates", default=None,
                   help="evaluate just these, ';'-separated: 'tp=2;pp=2,tp=2,m=4,schedule=GPipe,ac;dp=4,accum=2' "
                        "(dp: the remaining ranks)")
    p.add_argument("--top", type=int, default=12, help="entries that fit to print")
    p.add_argument("--rejected", type=int, default=8, help="rejected entries to print")
    p.add_argument("--json", default=None, help="write every entry to this file")
    p.add_argument("--calibrate", metavar="OUT_JSON", default=None,
                   help="measure this device (and, under torchrun, the links) and write the constants, then exit")


def parse_candidates(text: str) -> list[dict]:
    """``"tp=2;pp=2,tp=2,m=4,ac"`` -> ``[{"tp": 2}, {"pp": 2, "tp": 2, "microbatches": 4, "activation_checkpointing": "full"}]``
    (``ac``: full activation checkpointing; ``ac=selective``, ``ac=none``, ``ac=selective:2``: that mode)
    (``accum=N``: that many accumulation passes; ``grads=sharded``: FSDP2's gradients reduce-scattered
    every pass, ``--accum-grads``)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        spec: dict = {}
        for part in filter(None, (p.strip() for p in item.split(","))):
            key, eq, value = part.partition("=")
            if key == "ac":
                spec["activation_checkpointing"] = value if eq else "full"
            elif key in ("dp", "tp", "pp", "cp", "ep", "m", "microbatches", "virtual", "accum") and value.isdigit():
                spec["microbatches" if key == "m" else key] = int(value)
            elif key == "schedule" and value:
                spec["schedule"] = value
            elif key == "grads" and value in ("unsharded", "sharded"):
                spec["accum_grads"] = value
            else:
                raise ValueError(f"--candidates {text!r}: {part!r} is not AXIS=N, m=N, accum=N, grads=sharded|unsharded, "
                                 f"schedule=NAME, ac or ac=MODE")
        out.append(spec)
    return out


def run_plan(args) -> int:
    from fxshard.errors import PlanError

    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank plans the same: one prints
    try:
        if args.calibrate:
            return _calibrate(args.calibrate, args.device)
        missing = [f"--{n.replace('_', '-')}" for n in ("model", "world", "seq", "batch") if getattr(args, n) is None]
        if missing:
            raise PlanError(f"{', '.join(missing)} missing\n  fix: python -m fxshard plan --model DIR_OR_TYPE --world N "
                            f"--seq S --batch B [--memory-gib GiB]")
        from fxshard.planner import format_table, plan_parallelism
        from fxshard.planner.calibration import default_calibration

        cal = default_calibration(args.device)
        candidates = parse_candidates(args.candidates) if args.candidates else None
        entries = plan_parallelism(args.model, args.world, memory_gib=args.memory_gib, seq=args.seq,
                                   global_batch=args.batch, device=cal if args.device else None, candidates=candidates,
                                   dtype=args.dtype, gpus_per_node=args.gpus_per_node, accum=args.accum,
                                   accum_grads=args.accum_grads, compiled=args.compile == "inductor")
    except (PlanError, ValueError) as e:
        if rank0:
            print(f"fxshard plan: error: {e}", file=sys.stderr, flush=True)
        return 2
    fits = sum(e.fits for e in entries)
    if not rank0:
        return 0 if fits else 1
    memory, where = plan_parallelism.last_memory
    print(f"fxshard plan: {args.model} on {args.world} ranks of {memory:.4g} GiB ({where}), seq {args.seq}, "
          f"batch {args.batch}: {fits} of {len(entries)} candidates fit ({plan_parallelism.last_seconds:.1f} s)")
    print(f"constants: {cal.describe()}")
    if args.compile:
        print(f"compiled with {args.compile}: " + ("elementwise ops timed as inductor's fused kernels"
                                                  if args.compile == "inductor" else "nothing fused, timed as eager"))
    print(format_table(entries, top=args.top, rejected=args.rejected))
    errors = list({id(e.error): e.error for e in entries if e.error is not None}.values())
    for err in errors:
        print(f"fxshard plan: sub-plan {err.subplan} not planned: {err}", file=sys.stderr, flush=True)
    if fits:
        print(f"best: {best_command(entries[0], args, cal)}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([_entry_json(e) for e in entries], fh, indent=1)
    return 0 if fits else 1


def best_command(entry, args, cal) -> str:
    """The command that trains ``entry``: torchrun over its ranks, ``train`` with the model, the
    sizes and every flag of the entry (``--data TEXT_FILES`` stands for the files when ``--data``
    was not given), in bf16 and compiled when the plan was.

    Example: ``torchrun --nproc-per-node 4 -m fxshard train --model llama --data TEXT_FILES --seq 256
    --batch 8 --mesh dp=2,tp=2 --accum 2``"""
    world, node = args.world, args.gpus_per_node or cal.gpus_per_node
    if world == 1:
        launch = ["python"]
    elif world <= node:
        launch = ["torchrun", "--nproc-per-node", str(world)]
    else:  # each node runs this with its rendezvous flags (torchrun --rdzv-endpoint ...)
        launch = ["torchrun", "--nnodes", str(-(-world // node)), "--nproc-per-node", str(node)]
    words = launch + ["-m", "fxshard", "train", "--model", args.model, "--data", *(args.data or ["TEXT_FILES"]),
                      "--seq", str(args.seq), "--batch", str(args.batch)]
    text = " ".join(shlex.quote(w) if w != "TEXT_FILES" else w for w in words)
    flags = entry.trainer_flags()
    bf16 = (args.dtype or cal.dtype) == "bf16"
    compiled = f" --compile {shlex.quote(args.compile)}" if args.compile else ""
    return text + (f" {flags}" if flags else "") + (" --bf16" if bf16 else "") + compiled


def _entry_json(e) -> dict:
    return {"mesh": e.mesh, "accum": e.accum, "microbatches": e.microbatches, "schedule": e.schedule, "virtual": e.virtual,
            "activation_checkpointing": e.activation_checkpointing, "memory": e.memory, "comm_bytes": e.comm_bytes,
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "reason": e.reason,
            "trainer_flags": e.trainer_flags() if e.candidate is not None else None,
            "error": str(e.error) if e.error is not None else None}


def _calibrate(path: str, device: str | None) -> int:
    import torch.distributed as dist

    from fxshard.planner.calibration import calibrate

    if "RANK" in __import__("os").environ and not dist.is_initialized():
        dist.init_process_group()  # under torchrun: the links are measured over the world
    cal = calibrate(device if device in (None, "cpu", "cuda") else None)
    if not dist.is_initialized() or dist.get_rank() == 0:
        cal.save(path)
        print(f"fxshard plan --calibrate: {cal.describe()}\nwritten to {path}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
