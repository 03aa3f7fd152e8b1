"""Gradient clipping under pipeline parallelism, on 2 real gloo ranks (docs/pipeline.md).

A pipeline rank holds its stages' parameters only, so torch's ``clip_grad_norm_`` on them
would return that stage's norm, with no error, and each rank would clip by another factor.
It must raise a PlanError naming ``fxshard.clip_grad_norm_(staged, ...)``: on the module's
parameters, on a list of one stage's, on FSDP2's DTensor parameters of a stage; so must
fxshard's own ``clip_grad_norm_`` / ``grad_norm`` given such a list.  ``fxshard.clip_grad_norm_``
given the pipelined module returns one device's norm on every rank and clips as one device.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import fxshard
from fxshard.pipelining import pipeline, pipeline_transform, train_step
from fxshard.testing.models import llama, tokens

try:
    from harness import make_mesh, spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, spawn

ATOL = 1e-5
MAX_NORM = 0.5


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensor gradient


def _cross_entropy(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _check(fsdp: bool) -> None:
    mesh = make_mesh({"pp": 2, "dp": 1})
    model = llama(n_layers=4)
    reference = copy.deepcopy(model)
    ids, target = tokens(4, 8, 128, seed=1), tokens(4, 8, 128, seed=2)
    spec = pipeline("pp", microbatches=2, schedule="1F1B")
    plan = fxshard.Plan(mesh["dp"], {}, inputs={"tokens": {"dp": Shard(0)}}, fsdp="dp" if fsdp else None, pipeline=spec)
    staged = pipeline_transform(model, plan, mesh, example_inputs=(tokens(2, 6, 128, seed=3),))
    if fsdp:
        fxshard.fully_shard(staged, mesh["dp"])
        assert all(hasattr(p, "full_tensor") for p in staged.parameters()), "FSDP2 did not wrap the stage's parameters"
    name = f"pp=2{' FSDP2' if fsdp else ''} stage {staged.stage_ids}"
    train_step(staged, {"tokens": ids}, loss_fn=_cross_entropy, target=target)
    _cross_entropy(reference(ids), target).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])

    # what torch's clip would take: this stage's norm, not the model's (the reason for the guard)
    grads = {n: _full(p.grad).clone() for n, p in staged.named_parameters()}
    own = torch.nn.utils.get_total_norm(list(grads.values()))
    assert own < want - 1e-3, f"{name}: this stage's norm {float(own)} is the model's {float(want)}: nothing to guard"

    stage_params = list(staged.stages[0].parameters())
    for what, params in [("the module's parameters", staged.parameters()), ("a list of one stage's", stage_params),
                         ("one parameter", stage_params[0])]:
        with pytest.raises(fxshard.PlanError, match=r"(?s)clip_grad_norm_ on the parameters of a pipelined module.*"
                                                    r"fix: fxshard\.clip_grad_norm_\(staged, max_norm\)"):
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            raise AssertionError(f"{name}: torch's clip_grad_norm_ on {what} did not raise")
    with pytest.raises(fxshard.PlanError, match=r"fxshard\.clip_grad_norm_ on the parameters of a pipelined module"):
        fxshard.clip_grad_norm_(list(staged.parameters()), MAX_NORM)
    with pytest.raises(fxshard.PlanError, match=r"(?s)fxshard\.grad_norm on the parameters.*fix: fxshard\.grad_norm\(staged\)"):
        fxshard.grad_norm(staged.parameters())
    for n, p in staged.named_parameters():  # refused before touching a gradient
        assert torch.equal(_full(p.grad), grads[n]), f"{name}: {n}'s gradient changed by a refused call"

    # fxshard's, on the module: one device's norm on every rank, and one device's clipped gradients
    norm = fxshard.clip_grad_norm_(staged, MAX_NORM)
    torch.testing.assert_close(norm, want, atol=ATOL, rtol=ATOL, msg=lambda m: f"{name}: the norm over every stage: {m}")
    norms = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(norms, norm.detach().float().reshape(()))
    assert all(torch.equal(n, norms[0]) for n in norms), f"{name}: the ranks' norms differ: {norms}"
    torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)  # torch's, unchanged on a plain module
    ref = dict(reference.named_parameters())
    for n, p in staged.named_parameters():
        torch.testing.assert_close(_full(p.grad), ref[n].grad, atol=ATOL, rtol=ATOL, msg=lambda m: f"{name}: clipped {n}: {m}")


def _two_ranks(rank: int, world_size: int) -> None:
    _check(fsdp=False)
    _check(fsdp=True)


def test_torch_clip_on_pipelined_parameters_raises_and_fxshard_clip_is_one_devices():
    spawn(_two_ranks, 2)
