"""FSDP2 over a context-parallel axis (``Plan(fsdp=("dp", "cp"))`` / ``fsdp="cp"``), torchtitan's
``dp_shard_cp``: the parameters sharded over cp too, fxshard's own cp gradient syncs of
parameters handed to FSDP2, the sum convention over cp kept (FSDP2's divide factor).

* on 2 gloo ranks, cp=2: every parameter's gradient and the grad norm equal one device's,
  with and without FSDP2 over cp, and each rank holds half of every parameter;
* a parameter whose gradient is already whole on every cp rank (the sequence gathered over
  cp before the head) is refused: FSDP2 would sum two whole gradients.

The trainer's meshes (``--mesh cp=2,dp=2``, ``cp=2``, HSDP) are in tests/trainer/test_train_cli.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan, PlanError
from fxshard.testing.models import llama

from harness import make_mesh, spawn

B, S, V = 2, 16, 128


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _cp_plan(mesh, fsdp):
    return Plan(mesh, {"layers.*.attention": fxshard.context_parallel("cp", load_balance=False)},
                inputs={"tokens": {"cp": Shard(1)}}, fsdp=fsdp)


def _check_grads(rank: int, world_size: int) -> None:
    mesh = make_mesh({"cp": 2})
    ids, targets = _data()
    reference = llama(seed=0)
    (F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten(), reduction="sum") / ids.numel()).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    want_norm = torch.nn.utils.get_total_norm(list(want.values()))
    for fsdp in (None, "cp"):
        sharded = fxshard.transform(llama(seed=0), _cp_plan(mesh, fsdp), (ids,))
        if fsdp:
            fxshard.fully_shard(sharded, mesh)
        mine, my_targets = ids.chunk(2, 1)[rank], targets.chunk(2, 1)[rank]
        # this rank's positions' share of the global mean: the shares add up over cp
        loss = F.cross_entropy(sharded(mine).flatten(0, 1), my_targets.flatten(), reduction="sum") / ids.numel()
        loss.backward()
        for name, p in sharded.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"fsdp={fsdp} {name}: {m}")
            if fsdp:  # FSDP2's dim-0 piece of every parameter: half of it here
                assert isinstance(p, DTensor) and p.to_local().numel() * 2 == p.numel() or p.shape[0] % 2, name
        torch.testing.assert_close(fxshard.grad_norm(sharded), want_norm, rtol=1e-5, atol=1e-6)


def test_fsdp_over_cp_grads_match_one_device():
    spawn(_check_grads, 2)


def test_whole_gradient_on_cp_is_refused():
    """The final norm's output gathered over cp: the head's weight meets an activation replicated
    over cp, its gradient whole on each cp rank; FSDP2 over cp would sum them."""
    ids, _ = _data()
    mesh = MeshSpec(("cp",), (2,))
    specs = {"layers.*.attention": fxshard.context_parallel("cp", load_balance=False),
             "norm": ModuleSpec(out_src={"cp": Shard(1)}, out_dst={"cp": Replicate()})}
    fxshard.transform(llama(seed=0), Plan(mesh, specs, inputs={"tokens": {"cp": Shard(1)}}), (ids,))  # fxshard's syncs: fine
    with pytest.raises(PlanError, match=r"replicated over 'cp'.*would sum them"):
        fxshard.transform(llama(seed=0), Plan(mesh, specs, inputs={"tokens": {"cp": Shard(1)}}, fsdp="cp"), (ids,))
