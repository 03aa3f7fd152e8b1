"""``python -m fxshard plan``: the meshes a model can train on, best first (docs/planning.md).

    python -m fxshard plan --model path/to/Llama-3-8B --world 64 --memory 80 --seq 8192 --global-batch 512 --device h100
    python -m fxshard plan --model llama --world 4 --memory 2 --seq 256 --global-batch 8 --candidates "tp=2;pp=2,tp=2"
    torchrun --nproc-per-node 8 -m fxshard plan --calibrate h100-node.json      # this device and its links
    python -m fxshard plan --model DIR ... --device h100-node.json                # plan with the measured constants

The table lists the best entries (rank, mesh, micro-batches, schedule, recomputation, the bytes
of the fullest rank, the bytes each axis moves per step, the predicted step time and tokens per
second per rank), then the rejected ones with their reason.  ``--json`` writes every entry.
A model, mesh or file the planner cannot use is one line on stderr naming the fix, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    """The ``plan`` sub-command of ``python -m fxshard``."""
    p = sub.add_parser("plan", help="rank the meshes of dp, tp, pp, cp, ep a model can train on (memory, communication, "
                                    "time per rank)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory or config.json (built on the meta device), or an HF model type")
    p.add_argument("--world", type=int, help="the number of ranks")
    p.add_argument("--memory", type=float, default=None, help="GiB per rank (default: the device's)")
    p.add_argument("--seq", type=int, help="tokens per row")
    p.add_argument("--global-batch", type=int, help="rows per optimizer step, over all ranks")
    p.add_argument("--device", default=None, help="h100, h200, a100, cpu, or a --calibrate JSON (default: this machine)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPUs, fp32 on a CPU")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks that share the fast links (default: the device's)")
    p.add_argument("--candidates", default=None,
                   help="evaluate just these, ';'-separated: 'tp=2;pp=2,tp=2,m=4,schedule=GPipe,ac' (dp: the remaining ranks)")
    p.add_argument("--top", type=int, default=12, help="entries that fit to print")
    p.add_argument("--rejected", type=int, default=8, help="rejected entries to print")
    p.add_argument("--json", default=None, help="write every entry to this file")
    p.add_argument("--calibrate", metavar="OUT_JSON", default=None,
                   help="measure this device (and, under torchrun, the links) and write the constants, then exit")


def parse_candidates(text: str) -> list[dict]:
    """``"tp=2;pp=2,tp=2,m=4,ac"`` -> ``[{"tp": 2}, {"pp": 2, "tp": 2, "microbatches": 4, "activation_checkpointing": True}]``."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        spec: dict = {}
        for part in filter(None, (p.strip() for p in item.split(","))):
            key, eq, value = part.partition("=")
            if key == "ac" and not eq:
                spec["activation_checkpointing"] = True
            elif key in ("dp", "tp", "pp", "cp", "ep", "m", "microbatches", "virtual") and value.isdigit():
                spec["microbatches" if key == "m" else key] = int(value)
            elif key == "schedule" and value:
                spec["schedule"] = value
            else:
                raise ValueError(f"--candidates {text!r}: {part!r} is not AXIS=N, m=N, schedule=NAME or ac")
        out.append(spec)
    return out


def run_plan(args) -> int:
    from fxshard.errors import PlanError

    try:
        if args.calibrate:
            return _calibrate(args.calibrate, args.device)
        missing = [f"--{n.replace('_', '-')}" for n in ("model", "world", "seq", "global_batch") if getattr(args, n) is None]
        if missing:
            raise PlanError(f"{', '.join(missing)} missing\n  fix: python -m fxshard plan --model DIR_OR_TYPE --world N "
                            f"--memory GiB --seq S --global-batch B")
        from fxshard.planner import format_table, plan_parallelism
        from fxshard.planner.calibration import default_calibration

        cal = default_calibration(args.device)
        candidates = parse_candidates(args.candidates) if args.candidates else None
        entries = plan_parallelism(args.model, args.world, memory_gib=args.memory, seq=args.seq,
                                   global_batch=args.global_batch, device=cal, candidates=candidates, dtype=args.dtype,
                                   gpus_per_node=args.gpus_per_node)
    except (PlanError, ValueError) as e:
        print(f"fxshard plan: error: {e}", file=sys.stderr, flush=True)
        return 2
    fits = sum(e.fits for e in entries)
    print(f"fxshard plan: {args.model} on {args.world} ranks of {args.memory or cal.memory_gib} GiB, seq {args.seq}, "
          f"global batch {args.global_batch}: {fits} of {len(entries)} candidates fit "
          f"({plan_parallelism.last_seconds:.1f} s)")
    print(f"constants: {cal.describe()}")
    print(format_table(entries, top=args.top, rejected=args.rejected))
    if fits:
        print(f"best: python -m fxshard train {entries[0].trainer_flags()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([_entry_json(e) for e in entries], fh, indent=1)
    return 0 if fits else 1


def _entry_json(e) -> dict:
    return {"mesh": e.mesh, "microbatches": e.microbatches, "schedule": e.schedule, "virtual": e.virtual,
            "activation_checkpointing": e.activation_checkpointing, "memory": e.memory, "comm_bytes": e.comm_bytes,
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "reason": e.reason,
            "trainer_flags": e.trainer_flags()}


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
