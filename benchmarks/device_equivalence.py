"""Equivalence on simulated ranks, on any device: the sharded training step gives the
single-device loss, before and after an SGD step, for each model and plan.

``--tp`` ranks are simulated in one process (fake process group + ``LocalTensorMode``),
so a single GPU checks a tp=4 program (``benchmarks/gpu.sh`` runs it with
``--device cuda``).  Every rank's loss must match the single-device loss.

    python benchmarks/equivalence.py                  # CPU, tp=4
    python benchmarks/equivalence.py --device cuda
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe_machine, plain, rank_value, simulated, table, write_json  # noqa: E402

import torch  # noqa: E402

import fxshard  # noqa: E402
from fxshard.testing.models import WithLoss, gpt2, gpt2_plan, llama, llama_plan, tokens  # noqa: E402

CASES = {
    "llama_dense": (lambda: llama(seed=0, n_heads=8, n_kv_heads=4), lambda: llama_plan("tp")),
    "llama_sp_loss_parallel": (lambda: llama(seed=0, n_heads=8, n_kv_heads=4),
                               lambda: llama_plan("tp", sequence_parallel=True, loss_parallel=True)),
    "gpt2_sp_loss_parallel": (lambda: gpt2(seed=0), lambda: gpt2_plan("tp", sequence_parallel=True, loss_parallel=True)),
}


def _sgd_losses(module, ids, tgt, steps: int = 2, lr: float = 0.1) -> list:
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = module(ids, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def check(name: str, tp: int, device: str) -> dict:
    make_model, make_plan = CASES[name]
    t0 = time.perf_counter()
    with simulated({"tp": tp}, device) as mesh:
        with plain():
            model = WithLoss(make_model()).to(device)
            ids, tgt = tokens(2, 16, 128, seed=1).to(device), tokens(2, 16, 128, seed=2).to(device)
            reference = [x.item() for x in _sgd_losses(WithLoss(make_model()).to(device), ids, tgt)]
        plan = fxshard.Plan(mesh, {"model." + k: v for k, v in make_plan().items()})
        sharded = fxshard.transform(model, plan, (ids, tgt))
        losses = _sgd_losses(sharded, ids, tgt)
        per_rank = [[rank_value(x, r).item() for r in range(tp)] for x in losses]
    diff = max(abs(v - ref) for vals, ref in zip(per_rank, reference) for v in vals)
    return dict(case=name, tp=tp, device=device, loss_step0=reference[0], loss_step1=reference[1], max_abs_diff=diff,
                ok="yes" if diff < 1e-4 else "NO", seconds=time.perf_counter() - t0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = [check(c, args.tp, args.device) for c in args.cases.split(",") if c]
    print(f"equivalence on {args.tp} simulated ranks, {args.device}: sharded vs single-device loss, 2 SGD steps")
    print(f"machine: {describe_machine()}\n")
    print(table(rows, [("case", "case", ""), ("tp", "tp", "d"), ("device", "device", ""), ("loss_step0", "loss 0", ".6f"),
                       ("loss_step1", "loss 1", ".6f"), ("max_abs_diff", "max |diff|", ".2e"), ("ok", "ok", ""),
                       ("seconds", "s", ".1f")]))
    path = write_json("equivalence", dict(tp=args.tp, device=args.device), rows, args.out)
    print(f"results: {path}")
    return 0 if all(r["ok"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
