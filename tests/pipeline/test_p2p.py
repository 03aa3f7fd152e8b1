"""``fxshard.comm_summary`` of a pipelined module equals what a training step really runs.

The reference is measured: a TorchDispatchMode records every ``c10d`` op (torch's p2p
``send`` / ``recv_``, ``broadcast_``, ``allreduce_``) and every functional collective a
``train_step`` runs on each real gloo rank: kind, bytes and (for p2p) the peer.  The
summary's rows, one per micro-batch and value, must be the same multiset on every rank.
The step runs on a batch of ``microbatches`` times the example's rows (the summary's
sizes are the example's, taken as one micro-batch) and other tensors than the example.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fxshard
from fxshard.pipelining import pipeline, pipeline_transform, train_step
from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

try:
    from harness import make_mesh, spawn
except ImportError:  # tests/ imported as a package
    from tests.harness import make_mesh, spawn

_FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
_C10D = {"send": "send", "recv_": "recv", "broadcast_": "broadcast", "allreduce_": "all_reduce"}


class _CommLog(TorchDispatchMode):
    """(kind, bytes, peer) of every c10d op and functional collective."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, int | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            x = args[0]
            nbytes = x.numel() * x.element_size() * (args[1] if name == "all_gather_into_tensor" else 1)
            self.calls.append((_FUNCTIONAL[name], nbytes, None))
        elif func.namespace == "c10d" and name in _C10D:
            (x,) = args[0]  # one tensor per op
            peer = args[2] if name in ("send", "recv_") else None  # the peer's rank in the pipeline group
            self.calls.append((_C10D[name], x.numel() * x.element_size(), peer))
        return func(*args, **(kwargs or {}))


def _check(family: str, mesh_shape: dict, schedule: str, microbatches: int, virtual: int) -> None:
    mesh = make_mesh(mesh_shape)
    model = tiny_model(family, num_hidden_layers=4)
    example_ids, example_labels = tiny_inputs(batch=2, seq=6, seed=2)
    spec = pipeline("pp", microbatches=microbatches, schedule=schedule, virtual=virtual)
    dp = mesh_shape.get("dp", 1)
    if "tp" in mesh_shape:
        plan = fxshard.Plan.from_hf(mesh["tp"], model).replace(pipeline=spec)
    else:
        plan = fxshard.Plan(mesh["dp"], {}, inputs={"input_ids": {"dp": Shard(0)}, "labels": {"dp": Shard(0)}}, pipeline=spec)
    staged = pipeline_transform(model, plan, mesh, example_kwargs={"input_ids": example_ids, "labels": example_labels})
    summary = fxshard.comm_summary(staged)
    name = f"{family} {mesh_shape} {schedule} M={microbatches} stage(s) {staged.stage_ids}"
    ids, labels = tiny_inputs(batch=2 * microbatches, seq=6, seed=1)  # M micro-batches of the example's size
    assert (labels == -100).any() and not torch.equal(ids[:2], example_ids)
    mine = (lambda t: t.chunk(dp)[mesh["dp"].get_local_rank()]) if dp > 1 else (lambda t: t)
    batch = {"input_ids": mine(ids), "labels": mine(labels)}
    train_step(staged, batch)  # the first step also sends torch's shape metadata: not a step's traffic
    with _CommLog() as log:
        train_step(staged, batch)
    measured = Counter(log.calls)
    static = Counter((r.kind, r.bytes, r.peer) for r in summary.rows)
    assert static == measured, (f"{name}: summary != measured\n  only in the summary: {static - measured}\n"
                                f"  only measured: {measured - static}\n{summary}")
    # per micro-batch: the same sends every time, and the stages' own collectives with them
    sends = summary.select("forward", "send")
    if sends:
        per_microbatch = Counter(r.microbatch for r in sends)
        assert set(per_microbatch) == set(range(microbatches)) and len(set(per_microbatch.values())) == 1, (name, per_microbatch)
    assert summary.count("backward", "broadcast", axis="pp") == 1, name
    # explain and dump read this rank's stages
    first = staged.stages[0]
    node = next(n.name for n in first.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    assert fxshard.explain(staged, node).startswith(f"(stage {staged.stage_ids[0]})"), name
    try:
        fxshard.explain(staged, "no_such_node")
        raise AssertionError(f"{name}: explain of an unknown node did not raise")
    except ValueError as e:
        assert "no stage this rank holds" in str(e), e
    assert f"== stage {staged.stage_ids[0]}" in fxshard.dump(staged), name
    text = str(summary)
    assert "send to" in text and "recv from" in text and "mb" in text.splitlines()[1], text


def _four_ranks(rank: int, world_size: int) -> None:
    # tensor-parallel stages (their all-reduces per micro-batch), an activation sharded on tp
    _check("llama", {"pp": 2, "tp": 2}, "1F1B", 2, 1)
    # a tied head (its gradient summed between the first and last stage), the batch on dp, interleaved stages
    _check("gpt2", {"pp": 2, "dp": 2}, "Interleaved1F1B", 2, 2)


@pytest.mark.sweep  # four real ranks, a minute: .ci/run's second stage, which CI reaches
def test_comm_summary_of_a_pipelined_step_equals_the_measured_p2p_and_collectives():
    spawn(_four_ranks, 4)
