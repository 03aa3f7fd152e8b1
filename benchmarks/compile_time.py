"""Compile time: the sharded Llama compiled whole vs block by block (``fxshard.compile``).

On 2 real gloo ranks, tp=2: ``fxshard.testing.models.llama`` (``--layers`` identical
decoder layers, tiny sizes) transformed with ``llama_plan("tp")``, then

* ``whole``: ``torch.compile(sharded, backend=...)``, one graph for the program;
* ``per-block``: ``fxshard.transform(..., blocks="auto")`` and
  ``fxshard.compile(sharded, backend=...)``: one graph per distinct block, reused by the
  identical ones (the embedding, final norm and head stay eager).

Compile time is the first training step's wall time (forward, cross-entropy, backward:
dynamo, AOTAutograd and the backend's compilation) minus the median of the next steps;
every run is a fresh pair of processes with inductor's and AOTAutograd's caches off,
after a warm-up compile of a small function (imports are not counted).  Outputs and
parameter gradients are compared with the eager program's; dynamo's graphs and graph
breaks are counted.  With ``--fsdp`` the same on a ``dp=2`` mesh under FSDP2
(``Plan(fsdp="dp")``, ``fxshard.fully_shard``): whole-program compile breaks at the hooks
of every block, per-block compile keeps the hooks outside.

    python benchmarks/compile_time.py                          # 16 layers, aot_eager and inductor
    python benchmarks/compile_time.py --backends aot_eager --layers 4 --fsdp
    python benchmarks/compile_time.py --backends inductor --cpp-wrapper   # one C++ compile per graph
    python benchmarks/compile_time.py --device cuda --world 1  # NCCL, one GPU per rank, Triton kernels

With ``--device cuda`` every run is a fresh ``torchrun`` of ``--world`` ranks on NCCL (one GPU
each; a single GPU gives a one-rank mesh, whose program still holds the sharded graph's
structure and its collectives).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe_machine, table, write_json  # noqa: E402

WAYS = ("whole", "per-block")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="decoder layers (identical)")
    p.add_argument("--backends", default="aot_eager,inductor", help="comma-separated torch.compile backends")
    p.add_argument("--steps", type=int, default=3, help="steps after the first (their median is the run time)")
    p.add_argument("--fsdp", action="store_true", help="also on a dp=2 mesh under FSDP2")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="inductor's cpp_wrapper: the graph's wrapper and kernels in one C++ compile per graph (default: "
                        "a Python wrapper, one C++ compile per distinct kernel)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: spawned gloo ranks; cuda: a torchrun of --world NCCL ranks per run")
    p.add_argument("--world", type=int, default=2, help="ranks (on cuda: GPUs) per run")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one run under torchrun
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/compile_time.json)")
    return p.parse_args(argv)


def _program(mesh_kind: str, way: str, layers: int, ids):
    import torch.distributed as dist
    import fxshard
    from fxshard.testing.models import llama, llama_plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    device, world = ids.device.type, dist.get_world_size()
    model = llama(n_layers=layers, rope="real").to(device)  # real rope: inductor has no complex codegen
    blocks = "auto" if way == "per-block" else None
    if mesh_kind == "tp":
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))
        return fxshard.transform(model, fxshard.Plan(mesh, llama_plan("tp")), (ids,), blocks=blocks)
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    plan = fxshard.Plan(mesh, {}, inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    return fxshard.fully_shard(fxshard.transform(model, plan, (ids,), blocks=blocks), mesh)


def _step(program, ids, tgt):
    import torch.nn.functional as F

    program.zero_grad(set_to_none=True)
    out = program(ids)
    F.cross_entropy(out.flatten(0, 1), tgt.flatten()).backward()
    return out.detach(), [p.grad.detach().clone() for p in program.parameters()]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(mesh_kind: str, way: str, backend: str, layers: int, steps: int, device: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import fxshard
    from fxshard.testing.models import tokens

    ids, tgt = tokens(4, 16, 128, seed=1).to(device), tokens(4, 16, 128, seed=2).to(device)
    if mesh_kind == "fsdp":  # this rank's part of the batch
        ids, tgt = (t.chunk(dist.get_world_size())[dist.get_rank()] for t in (ids, tgt))
    want = _step(_program(mesh_kind, way, layers, ids), ids, tgt)
    program = _program(mesh_kind, way, layers, ids)
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def counting(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(len(gm.graph.nodes))
        return lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(program, backend=counting) if way == "whole" else fxshard.compile(program, backend=counting)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    got = _step(compiled, ids, tgt)
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        _step(compiled, ids, tgt)
        sync()
        times.append(time.perf_counter() - t0)
    diff = max([(got[0] - want[0]).abs().max().item()]
               + [(_full(a) - _full(b)).abs().max().item() for a, b in zip(got[1], want[1])])
    t = torch.tensor([first, statistics.median(times), diff], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    first, steady, diff = t.tolist()
    return dict(mesh=f"{mesh_kind}{dist.get_world_size()}", device=device, backend=backend, way=way, layers=layers, compile_s=first - steady, first_step_s=first,
                step_ms=1e3 * steady, graphs=len(graphs), graph_nodes=graphs[:4], graph_breaks=sum(counters["graph_break"].values()),
                max_diff=diff)


def _worker(rank: int, world: int, config: tuple, out_path: str) -> None:
    """One (mesh, backend, way, layers, steps) in fresh processes: nothing compiled before is reused."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    mesh_kind, backend, way, layers, steps, cpp_wrapper, device = config
    if device == "cpu":
        torch.set_num_threads(1)
    torch._inductor.config.cpp_wrapper = cpp_wrapper
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    # imports and first-use costs (dynamo, AOTAutograd's partitioner, the backend), not counted
    torch.compile(lambda x: (x * 2).sin().sum(), backend=backend)(torch.randn(4, requires_grad=True, device=device)).backward()
    row = _run(mesh_kind, way, backend, layers, steps, device)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(row, fh)


def _one_run(config: tuple, world: int, out_path: str) -> None:
    """One run in fresh processes: spawned gloo ranks on CPU, or a ``torchrun`` of NCCL ranks."""
    if config[-1] == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from harness import spawn

        spawn(_worker, world, config, out_path, timeout=3600)
        return
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
           "--one", json.dumps(config), "--out", out_path]
    subprocess.run(cmd, check=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    if args.one is not None:  # a rank of one cuda run, under torchrun
        from fxshard.testing import launch

        launch.run(_worker, args.world, tuple(json.loads(args.one)), args.out)
        return 0

    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "row.json")
        for mesh_kind in ["tp"] + (["fsdp"] if args.fsdp else []):
            for backend in args.backends.split(","):
                for way in WAYS:
                    _one_run((mesh_kind, backend, way, args.layers, args.steps, args.cpp_wrapper, args.device),
                             args.world, out_path)
                    with open(out_path) as fh:
                        rows.append(json.load(fh))
                    if args.cpp_wrapper and backend == "inductor":
                        rows[-1]["backend"] = "inductor+cpp_wrapper"
                    r = rows[-1]
                    print(f"  {mesh_kind} {backend} {way}: compile {r['compile_s']:.1f} s, {r['graphs']} graphs", flush=True)
    print(f"compile time: the sharded fxshard.testing.models.llama ({args.layers} layers, dim 64), whole program vs "
          f"fxshard.compile (one graph per block); {args.world} {'gloo' if args.device == 'cpu' else 'NCCL'} ranks; "
          f"{time.monotonic() - t0:.0f} s")
    print(f"machine: {describe_machine()}")
    print(table(rows, [("mesh", "mesh", ""), ("backend", "backend", ""), ("way", "compiled", ""),
                       ("compile_s", "compile s", ".1f"), ("step_ms", "step ms", ".1f"), ("graphs", "graphs", "d"),
                       ("graph_breaks", "breaks", "d"), ("max_diff", "max |diff| vs eager", ".1e")]))
    bad = []
    for mesh_kind in dict.fromkeys(r["mesh"] for r in rows):
        for backend in dict.fromkeys(r["backend"] for r in rows):
            whole, block = (next(r for r in rows if (r["mesh"], r["backend"], r["way"]) == (mesh_kind, backend, w))
                            for w in WAYS)
            print(f"{mesh_kind:<5} {backend:<10} per-block / whole compile time = {block['compile_s'] / whole['compile_s']:.2f}"
                  f" ({block['compile_s']:.1f} s vs {whole['compile_s']:.1f} s)")
            bad += [r for r in (whole, block) if not r["max_diff"] <= 1e-4]
    path = write_json("compile_time", vars(args), rows, args.out)
    print(f"\nresults: {path}")
    if bad:
        print(f"ERROR: outputs or gradients differ from eager: {[(r['mesh'], r['backend'], r['way']) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
