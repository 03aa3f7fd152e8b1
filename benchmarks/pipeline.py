"""Pipeline parallelism: step time, peak memory per stage, and the bubble measured
against the schedule's theory; fxshard's stages against torch's own ``pipeline()`` tracer
with the same split, schedule and micro-batches.

The model is fxshard's Llama (``fxshard.testing.models.llama``) with a token-mean
cross-entropy as the schedule's ``loss_fn``.  For each ``--pp`` and ``--schedules`` entry,
``pp`` gloo processes (one thread each) run:

* ``fxshard``: ``fxshard.pipelining.pipeline_transform`` (stages cut from the transformed
  graph, balanced by cost) and ``fxshard.pipelining.train_step``;
* ``torch pipeline()``: ``torch.distributed.pipelining.pipeline`` with ``SplitPoint``s at
  the blocks fxshard chose, ``pipe.build_stage``, the same schedule class.

Per stage: the median step time over ``--steps`` timed steps (after one warm-up), the
peak of the bytes allocated during one step (benchmarks/memory.py ``peak_bytes``: the
CPU allocator events of ``torch.profiler(profile_memory=True)``), and the busy time: the forward and
backward of one micro-batch on that stage alone (its recorded inputs, no communication)
times M.  Measured bubble = 1 - busy / step time (the stage's idle share); theory for
GPipe and 1F1B with equal stages: ``(pp - 1) / (M + pp - 1)``.  On a shared CPU the
busy time also absorbs the p2p copies, so the measured bubble is a lower bound.

    python benchmarks/pipeline.py
    python benchmarks/pipeline.py --pp 2 4 --microbatches 4 8 --layers 8 --dim 256
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe_machine, fmt_bytes, table, write_json  # noqa: E402
from memory import peak_bytes  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxshard  # noqa: E402
from fxshard.testing.launch import spawn  # noqa: E402
from fxshard.pipelining import pipeline, pipeline_transform, train_step  # noqa: E402
from fxshard.testing.models import llama, tokens  # noqa: E402
from fxshard.meta import program_meta  # noqa: E402


def token_mean_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _busy_time(stage_modules, recorded: list, repeat: int = 3) -> float:
    """Forward + backward of one micro-batch on this rank's stages alone (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for module, args in zip(stage_modules, recorded):
            args = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
            out = module(*args)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        best = min(best, time.perf_counter() - t0)
    for module in stage_modules:
        module.zero_grad(set_to_none=True)
    return best


def _record_inputs(modules) -> tuple[list, list]:
    recorded: list = [None] * len(modules)
    handles = []
    for i, m in enumerate(modules):
        def hook(_, args, i=i):
            if recorded[i] is None:
                recorded[i] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        handles.append(m.register_forward_pre_hook(hook))
    return recorded, handles


def _rank(rank: int, world_size: int, cfg: dict, schedule: str, microbatches: int, out: list) -> None:
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("pp", "tp"))
    model = llama(n_layers=cfg["layers"], dim=cfg["dim"], ffn_hidden=4 * cfg["dim"], n_heads=cfg["dim"] // 32,
                  n_kv_heads=cfg["dim"] // 64, vocab_size=cfg["vocab"], max_seq_len=cfg["seq"])
    batch = cfg["batch"]
    ids = tokens(batch, cfg["seq"], cfg["vocab"], seed=1)
    target = tokens(batch, cfg["seq"], cfg["vocab"], seed=2)
    spec = pipeline("pp", microbatches=microbatches, schedule=schedule)
    staged = pipeline_transform(model, None, mesh, example_inputs=(tokens(2, cfg["seq"], cfg["vocab"], seed=3),), spec=spec)
    rows = []

    def run_fxshard():
        train_step(staged, {"tokens": ids}, loss_fn=token_mean_ce, target=target)
        staged.zero_grad(set_to_none=True)

    rows.append(_measure("fxshard", run_fxshard, staged.stages, staged.stage_ids, staged.pp_group, cfg, microbatches))
    blocks = [b for st in staged.stages for b in program_meta(st).pipeline_stage.blocks]
    starts = _stage_starts(staged, world_size)
    try:
        rows.append(_torch_pipeline(model, starts, spec, mesh, ids, target, cfg, microbatches))
    except Exception as e:  # noqa: BLE001 -- reported, the benchmark goes on
        rows.append({"impl": "torch pipeline()", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
    for r in rows:
        r.update(stage=rank, blocks=f"{blocks[0]}..{blocks[-1]}", schedule=schedule, M=microbatches, pp=world_size,
                 theory=(world_size - 1) / (microbatches + world_size - 1))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out.extend(r for rs in gathered for r in rs)
        Path(cfg["tmp"]).write_text(repr(out))


def _stage_starts(staged, pp: int) -> list[str]:
    """The first block of every stage after the first (all ranks agree: the cut is the same everywhere)."""
    obj = [program_meta(staged.stages[0]).pipeline_stage.blocks[0]]
    gathered = [None] * pp
    dist.all_gather_object(gathered, obj, group=staged.pp_group)
    return [g[0] for g in gathered[1:]]


def _measure(impl: str, step, modules, stage_ids, group, cfg: dict, microbatches: int) -> dict:
    recorded, handles = _record_inputs(modules)
    step()  # warm-up; records one micro-batch's inputs of each stage
    for h in handles:
        h.remove()
    times = []
    for _ in range(cfg["steps"]):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = peak_bytes(step)
    step_s = statistics.median(times)
    busy = _busy_time(modules, recorded) * microbatches
    params = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    return {"impl": impl, "step_ms": step_s * 1e3, "busy_ms": busy * 1e3, "bubble": max(0.0, 1 - busy / step_s),
            "peak": peak, "params": params}


def _torch_pipeline(model, starts: list[str], spec, mesh, ids, target, cfg, microbatches: int) -> dict:
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining import pipeline as torch_pipeline

    mb = ids[: ids.shape[0] // microbatches]
    pipe = torch_pipeline(model, mb_args=(mb,), split_spec={s: SplitPoint.BEGINNING for s in starts})
    group = mesh["pp"].get_group()
    stage = pipe.build_stage(mesh["pp"].get_local_rank(), torch.device("cpu"), group)
    schedule = spec.schedule_class(stage, n_microbatches=microbatches, loss_fn=token_mean_ce)
    first = stage.is_first

    def step():
        schedule.step(*((ids,) if first else ()), target=target if stage.is_last else None)
        stage.submod.zero_grad(set_to_none=True)

    return _measure("torch pipeline()", step, [stage.submod], [stage.stage_index], group, cfg, microbatches)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B"])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import tempfile

    rows = []
    for pp in args.pp:
        for schedule in args.schedules:
            for m in args.microbatches:
                with tempfile.NamedTemporaryFile(suffix=".txt") as tmp:
                    cfg = dict(layers=args.layers, dim=args.dim, vocab=args.vocab, seq=args.seq, batch=args.batch,
                               steps=args.steps, tmp=tmp.name)
                    spawn(_rank, pp, cfg, schedule, m, [])
                    rows.extend(eval(Path(tmp.name).read_text()))  # noqa: S307 -- our own repr of plain dicts
    for r in rows:
        r["peak_h"] = fmt_bytes(r["peak"]) if "peak" in r else None
        r["params_h"] = fmt_bytes(r["params"]) if "params" in r else None
    print(describe_machine())
    print(f"fxshard Llama: {args.layers} layers, dim {args.dim}, vocab {args.vocab}; batch {args.batch} x seq {args.seq}; "
          f"gloo, 1 thread per rank")
    print(table(rows, [("impl", "impl", ""), ("pp", "pp", "d"), ("schedule", "schedule", ""), ("M", "M", "d"),
                       ("stage", "stage", "d"), ("blocks", "blocks", ""), ("step_ms", "step ms", ".1f"),
                       ("busy_ms", "busy ms", ".1f"), ("bubble", "bubble", ".2f"), ("theory", "theory", ".2f"),
                       ("peak_h", "peak", ""), ("params_h", "params", ""), ("error", "error", "")]))
    path = write_json("pipeline", vars(args), rows, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
