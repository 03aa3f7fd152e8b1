"""Expert parallelism for a Mixtral-style model, on 2 CPU processes (gloo).

    python examples/mixtral.py

A tiny Mixtral (attention + sparse MoE blocks with a ``gate`` and an ``nn.ModuleList``
of SwiGLU experts) is trained for a few SGD steps with its experts split over an
``"ep"`` mesh axis and the batch sharded over the same axis, and compared with the
same model on one device.

What fxshard does with the plan below:

* every ``layers.*.block_sparse_moe`` stays one ``call_module`` of the transformed
  graph, run on the rank's own tokens; fxshard runs the block with the default router
  (softmax in float32, top-k, renormalize) and, around the experts, exchanges the
  token counts, dispatches the tokens to the ranks owning their experts and combines
  the results back (three all-to-alls forward, two backward);
* each rank keeps half of the expert list, under the single-device names
  (rank 0: ``experts.0`` / ``experts.1``, rank 1: ``experts.2`` / ``experts.3``);
* the attention, norms, router and embeddings are replicated; since the batch is
  sharded, their gradients are summed over ``"ep"``, all in one bucketed all-reduce
  (a ``grad_sync_bucket`` node; the router's weight enters the MoE block synced).

Gradients are those of the *sum* of the per-rank losses, so the single-device
reference below uses ``reduction="sum"`` on the full batch.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fxshard
from fxshard.runtime.moe import expert_parallel, softmax_topk
from fxshard.testing.launch import spawn
from fxshard.testing.moe_models import mixtral

WORLD = 2
STEPS = 3


def train(model, ids, targets, steps=STEPS, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def main(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 16), generator=g)  # the global batch; every rank builds the same
    targets = torch.randint(0, 128, (4, 16), generator=g)

    model = mixtral(seed=0, n_experts=4, top_k=2)
    plan = fxshard.Plan(mesh, {
        "layers.*.block_sparse_moe": expert_parallel("ep", router=softmax_topk()),
    }, inputs={"x": {"ep": Shard(0)}})
    sharded = fxshard.transform(model, plan, example_inputs=(ids,))
    if rank == 0:
        print(fxshard.dump(sharded, region="layers.0.block_sparse_moe", recursive=True, source=False))
        print()
    print(f"rank {rank} holds experts", [k for k in sharded.state_dict() if k.startswith("layers.0.block_sparse_moe.experts.") and k.endswith("w1.weight")])

    mine = slice(rank * 2, rank * 2 + 2)  # this rank's half of the batch
    ours = [fxshard.all_reduce(loss, "ep").item() for loss in train(sharded, ids[mine], targets[mine])]
    reference = [loss.item() for loss in train(mixtral(seed=0, n_experts=4, top_k=2), ids, targets)]
    if rank == 0:
        print(f"\n{'step':>4}  {'expert parallel':>15}  {'one device':>12}")
        for i, (a, b) in enumerate(zip(ours, reference)):
            print(f"{i:>4}  {a:>15.5f}  {b:>12.5f}")
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, reference))
        assert worst < 1e-5, f"losses differ by {worst:.2e} (relative)"
        print(f"max relative difference {worst:.1e}: the same training run")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(main, WORLD)
