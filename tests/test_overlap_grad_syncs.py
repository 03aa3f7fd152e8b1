"""Overlapped gradient syncs (``transform(..., overlap_grad_syncs=True)``, the default): a
bucket's all-reduce is started in its backward and waited on at the end of the backward.
On real gloo ranks: the same outputs, gradients, clipped norms and parameters as the
synchronous path (bitwise) and as one device, over 2 steps with ``no_sync`` accumulation;
the order of events shows the earlier layers' backward running while the first bucket
is on the wire; a parameter with another, unsynced use, an earlier ``.grad``,
``torch.autograd.grad`` and ``torch.compile`` get what the synchronous path gives."""
import contextlib
import copy

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fxshard
from fxshard.runtime import collectives
from fxshard.testing.models import llama, tokens
from harness import make_mesh, spawn

STEPS, ACCUM, DP, MAX_NORM, LR = 2, 2, 2, 0.5, 0.1
LAYER_MB = 0.07  # a bucket a little larger than one layer's weights (64 x 64 x 4 + 3 x 64 x 128 floats): several buckets
_c10d = torch.ops._c10d_functional


def _batch(step: int):
    """The global batch of a step: 8 rows (4 per dp rank, 2 per micro-batch), distinct targets."""
    return tokens(8, 8, 128, seed=10 + step), tokens(8, 8, 128, seed=20 + step)


def _one_device(model):
    """The reference: the whole batch on one device, the mean of the 4 micro-batches' losses."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outs, grads, norms = [], [], []
    for step in range(STEPS):
        ids, tgt = _batch(step)
        opt.zero_grad(set_to_none=True)
        logits = model(ids)
        outs.append(logits.detach())
        (F.cross_entropy(logits.flatten(0, 1), tgt.flatten()) / 1.0).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
    return outs, grads, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _accumulated(sharded, rank: int):
    """2 steps of 2 micro-batches on this rank's rows, the first under ``no_sync``; the loss
    scaled by 1 / (ACCUM * DP): fxshard sums the gradients over dp."""
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    outs, grads, norms = [], [], []
    for step in range(STEPS):
        ids, tgt = (t.chunk(DP)[rank] for t in _batch(step))
        opt.zero_grad(set_to_none=True)
        for k, (i, t) in enumerate(zip(ids.chunk(ACCUM), tgt.chunk(ACCUM))):
            with fxshard.no_sync(sharded) if k < ACCUM - 1 else contextlib.nullcontext():
                logits = sharded(i)
                outs.append(logits.detach())
                (F.cross_entropy(logits.flatten(0, 1), t.flatten()) / (ACCUM * DP)).backward()
        assert collectives.held_back() == 0 and collectives.started_grad_syncs() == 0
        grads.append({n: p.grad.clone() for n, p in sharded.named_parameters()})
        norms.append(fxshard.clip_grad_norm_(sharded, MAX_NORM))
        opt.step()
    return outs, grads, norms, {n: p.detach().clone() for n, p in sharded.named_parameters()}


class _Events(TorchDispatchMode):
    """The all-reduces started, the waits, and the matmuls of a backward, in order."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _c10d.all_reduce.default:
            self.events.append(("start", out.data_ptr()))
        elif func is _c10d.wait_tensor.default:
            self.events.append(("wait", args[0].data_ptr()))
        elif func is torch.ops.aten.mm.default:
            self.events.append(("mm", None))
        return out


def _backward_events(sharded, rank: int) -> list:
    ids, tgt = (t.chunk(DP)[rank] for t in _batch(0))
    loss = F.cross_entropy(sharded(ids).flatten(0, 1), tgt.flatten())
    with _Events() as seen:
        loss.backward()
    return seen.events


def _check_event_order(synced, overlapped, rank: int) -> None:
    starts = lambda events: [i for i, (kind, _) in enumerate(events) if kind == "start"]
    events = _backward_events(synced, rank)
    assert len(starts(events)) >= 3, events  # several buckets
    for i in starts(events):  # synchronous: each all-reduce waited on at once
        assert events[i + 1] == ("wait", events[i][1]), events
    events = _backward_events(overlapped, rank)
    first, mms = starts(events)[0], [i for i, (kind, _) in enumerate(events) if kind == "mm"]
    waits = {ptr: i for i, (kind, ptr) in enumerate(events) if kind == "wait"}
    assert sorted(waits) == sorted(ptr for kind, ptr in events if kind == "start"), events  # each waited on once
    # the earlier layers' backward runs while the first bucket (the last layer's) is on the wire,
    # and every bucket is waited on after the last matmul of the backward
    assert sum(first < i < waits[events[first][1]] for i in mms) >= 10, events
    assert min(waits.values()) > max(mms), events


def _shared_parameter(overlap: bool, prior: bool, rank: int, by_grad: bool = False):
    """A parameter synced through a bucket and also used without a sync (a use whose
    gradient is complete already), maybe with an earlier ``.grad``."""
    p = torch.nn.Parameter(torch.arange(3.0) + 1)
    if prior:
        p.grad = torch.full((3,), 0.25)
    (y,) = fxshard.grad_sync_bucket([p], "dp", overlap=overlap)
    loss = (y * (rank + 1)).sum() + (p * p).sum()
    if by_grad:
        return torch.autograd.grad(loss, [p])[0], p.grad
    loss.backward()
    return p.grad


def _check(rank: int, world_size: int) -> None:
    mesh = make_mesh({"dp": DP})
    model = llama(n_layers=2)
    plan = fxshard.Plan(mesh, {}, inputs={"tokens": {"dp": Shard(0)}})
    example = (tokens(8, 8, 128, seed=99),)
    synced = fxshard.transform(model, plan, example, bucket_cap_mb=LAYER_MB, overlap_grad_syncs=False)
    overlapped = fxshard.transform(model, plan, example, bucket_cap_mb=LAYER_MB)
    buckets = [n for n in overlapped.graph.nodes if n.target is fxshard.grad_sync_bucket]
    assert len(buckets) >= 3 and all(n.kwargs.get("overlap") for n in buckets)
    assert not any(n.kwargs.get("overlap") for n in synced.graph.nodes if n.target is fxshard.grad_sync_bucket)
    # the same collectives, listed the same way
    assert str(fxshard.comm_summary(synced)) == str(fxshard.comm_summary(overlapped))

    want_outs, want_grads, want_norms, want_params = _one_device(model)
    got_sync = _accumulated(synced, rank)
    got = _accumulated(overlapped, rank)
    for a, b in zip(got, got_sync):  # outputs, gradients, norms, parameters: bitwise the synchronous path's
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    outs, grads, norms, params = got
    for step in range(STEPS):
        mine = want_outs[step].chunk(DP)[rank].chunk(ACCUM)
        for k in range(ACCUM):
            torch.testing.assert_close(outs[step * ACCUM + k], mine[k], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(norms[step], want_norms[step], rtol=1e-5, atol=1e-6)
        for name, g in want_grads[step].items():
            torch.testing.assert_close(grads[step][name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{step} {name}: {m}")
    for name, p in want_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6)

    _check_event_order(synced, overlapped, rank)

    # a parameter's other use and its earlier .grad: what autograd's AccumulateGrad gives
    for prior in (False, True):
        want = (0.25 if prior else 0.0) + 2 * (torch.arange(3.0) + 1) + sum(r + 1 for r in range(world_size))
        assert torch.equal(_shared_parameter(True, prior, rank), _shared_parameter(False, prior, rank))
        torch.testing.assert_close(_shared_parameter(True, prior, rank), want)
    # torch.autograd.grad stores no .grad: the bucket hands its gradient back at once
    g, stored = _shared_parameter(True, False, rank, by_grad=True)
    torch.testing.assert_close(g, 2 * (torch.arange(3.0) + 1) + 3)
    assert stored is None and collectives.started_grad_syncs() == 0

    # torch.compile: the synchronous path inside the compiled backward, the same gradients
    compiled = torch.compile(overlapped, backend="aot_eager")
    for module in (overlapped, compiled):
        overlapped.zero_grad(set_to_none=True)
        ids, tgt = (t.chunk(DP)[rank] for t in _batch(0))
        F.cross_entropy(module(ids).flatten(0, 1), tgt.flatten()).backward()
        if module is overlapped:
            eager = {n: p.grad.clone() for n, p in overlapped.named_parameters()}
    assert collectives.started_grad_syncs() == 0
    for name, p in overlapped.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], rtol=1e-5, atol=1e-6)


def test_overlapped_grad_syncs_real_gloo():
    spawn(_check, 2)
