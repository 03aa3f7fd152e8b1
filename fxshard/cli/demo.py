"""The main job: a small Llama, tensor-parallel over real ranks, against one device.

On CPU it spawns ``--world-size`` gloo processes on 127.0.0.1; under ``torchrun`` on a
CUDA machine it uses NCCL, one GPU per rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxshard.testing import launch


def _train(model, step_inputs, steps, lr=0.05, show_progress=False):
    from fxshard.state.progress import progress

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    # a progress bar on long runs only (rank 0): short ones finish before it would say anything
    with progress(steps, "training", show=show_progress and steps >= 20, unit="step") as bar:
        for _ in range(steps):
            losses.append(_step(model, opt, step_inputs))
            bar.update()
    return losses


def _step(model, opt, step_inputs) -> float:
    ids, targets = step_inputs
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _rank_main(rank: int, world_size: int, args) -> None:
    import fxshard
    from fxshard.testing.models import llama, llama_plan, tokens

    from torch.distributed.device_mesh import init_device_mesh

    device = launch.device()
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    model = llama(seed=0, n_heads=8, n_kv_heads=4 if world_size <= 4 else world_size).to(device)
    ids = tokens(4, 16, model.args.vocab_size, seed=1).to(device)
    targets = tokens(4, 16, model.args.vocab_size, seed=2).to(device)
    reference = _train(llama(seed=0, n_heads=8, n_kv_heads=model.args.n_kv_heads).to(device), (ids, targets), args.steps,
                       show_progress=rank == 0)

    plan = fxshard.Plan(mesh, llama_plan("tp"))
    sharded = fxshard.transform(model, plan, example_inputs=(ids,))
    if rank == 0:
        print(f"fxshard demo: Llama (dim {model.args.dim}, {model.args.n_layers} layers, GQA {model.args.n_heads}/{model.args.n_kv_heads} heads) "
              f"on {world_size} {device} ranks ({dist.get_backend()})\n")
        print(fxshard.dump(sharded, region=f"{args.layer}.*"))
        print()
    losses = _train(sharded, (ids, targets), args.steps, show_progress=rank == 0)
    if rank == 0:
        print(f"{'step':>4}  {'fxshard loss':>13}  {'1-device loss':>13}  {'|diff|':>9}")
        for i, (a, b) in enumerate(zip(losses, reference)):
            print(f"{i:>4}  {a:>13.6f}  {b:>13.6f}  {abs(a - b):>9.2e}")
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"\nmax |loss difference| over {args.steps} SGD steps: {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"fxshard demo: sharded and single-device losses differ by {worst:.2e}")
    if getattr(args, "bench", False):
        _bench(rank, world_size, args, device, model)


def _bench(rank: int, world_size: int, args, device: str, model) -> None:
    """``--bench``: the step-time comparison (fxshard vs DTensor vs hand-written Megatron)
    of the demo model on these ranks; see ``fxshard.testing.bench`` and benchmarks/step_time.py."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.testing import bench

    a = model.args
    size = replace(bench.SIZES["small"], name="demo", dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads,
                   n_kv_heads=a.n_kv_heads, ffn_hidden=a.ffn_hidden, vocab_size=a.vocab_size, batch=4, seqlen=16)
    modes = [m for m in args.bench_modes.split(",") if m]
    mesh = init_device_mesh(device.split(":")[0], (world_size,), mesh_dim_names=("tp",))
    if rank == 0:
        print(f"\nstep time of the demo model ({size.describe()}), {world_size} {device} ranks, "
              f"median of {args.bench_iters} steps, contenders alternating:")
    rows = bench.time_on_mesh(mesh, [size], modes, warmup=2, iters=args.bench_iters, device=device)
    if rank == 0:
        print(bench.format_table(rows))
        print("megatron: hand-written column/row-parallel layers (fxshard.testing.bench.MegatronLlama); dtensor: "
              "parallelize_module with the same plan dict.  Full benchmark: python benchmarks/step_time.py")


def run_demo(args) -> int:
    """``python -m fxshard demo``: gloo processes on CPU, or torchrun's ranks (NCCL on CUDA)."""
    if getattr(args, "moe", False):
        from fxshard.testing.moe_models import run_moe_demo

        return run_moe_demo(args.world_size, args.steps, args.layer)
    launch.run(_rank_main, args.world_size, args)
    return 0
