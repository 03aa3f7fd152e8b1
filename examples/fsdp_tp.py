"""Tensor parallelism by fxshard, data parallelism by FSDP2, on 4 CPU processes (gloo).

    python examples/fsdp_tp.py

A small Llama trains a few AdamW steps on a ``dp x tp = 2 x 2`` mesh and is compared
with the same model on one device, on the whole batch.

What happens:

* the plan is Megatron's sequence parallelism over ``"tp"`` (``llama_plan``), with
  the batch sharded over ``"dp"`` and ``fsdp="dp"``: the axis belongs to FSDP2, so
  fxshard adds no gradient sync there, and the transformed module calls one
  submodule per transformer block (``sharded.layers[i]``);
* ``fxshard.fully_shard`` applies FSDP2's ``fully_shard`` over ``mesh["dp"]`` to each
  block, then to the root: per block, FSDP2 all-gathers the parameters before the
  block runs and reduce-scatters their gradients (the mean over dp) after it;
* inside each block, the norm weights' gradients (each tp rank holds a share: they
  are applied to sequence shards) are all-reduced over ``"tp"`` in one bucket;
* each rank's loss is the mean over its half of the batch; FSDP2's mean over dp
  makes it train on the mean over the whole batch, as one device does.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fxshard
from fxshard.testing.launch import spawn
from fxshard.testing.models import llama, llama_plan

WORLD = 4
STEPS = 3


def train(model, ids, targets, steps=STEPS, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def main(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 16), generator=g)  # the global batch; every rank builds the same
    targets = torch.randint(0, 128, (4, 16), generator=g)
    model = llama(seed=0)
    reference = copy.deepcopy(model)

    plan = fxshard.Plan(mesh, llama_plan("tp", sequence_parallel=True), inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, example_inputs=(ids,))
    fxshard.fully_shard(sharded, mesh)
    if rank == 0:
        print(sharded.code)  # the root: embedding, one call per block, norm, head
        print(fxshard.comm_summary(sharded))

    dp = mesh.get_local_rank("dp")
    mine = slice(dp * 2, dp * 2 + 2)  # this rank's half of the batch
    ours = []
    for loss in train(sharded, ids[mine], targets[mine]):
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        ours.append(loss.item() / 2)
    one_device = [loss.item() for loss in train(reference, ids, targets)]
    full = fxshard.full_state_dict(sharded)  # a collective: every rank gets whole tensors
    worst_param = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    if rank == 0:
        print(f"\n{'step':>4}  {'fxshard + FSDP2':>15}  {'one device':>12}")
        for i, (a, b) in enumerate(zip(ours, one_device)):
            print(f"{i:>4}  {a:>15.5f}  {b:>12.5f}")
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, one_device))
        assert worst < 1e-5 and worst_param < 1e-4, f"losses differ by {worst:.2e}, parameters by {worst_param:.2e}"
        print(f"max relative loss difference {worst:.1e}, largest parameter difference {worst_param:.1e}: the same run")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(main, WORLD)
