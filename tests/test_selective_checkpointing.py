"""Activation checkpointing modes (``fxshard.checkpoint_blocks(sharded, mode, every=)``,
docs/training.md): ``selective`` is torchtitan's op-level policy on fxshard's programs.

* what the forward leaves alive for the backward, measured (every storage an op made that is
  still referenced after the forward): ``none`` > ``selective`` > ``full``, with the same loss and
  gradients in every mode;
* selective saves the outputs of the program's all-reduces: its backward communicates what the
  program's backward does, full checkpointing's once more (the forward's collectives again);
* ``selective:K`` (every K-th block in full) and the refusals.

Autograd's ``saved_tensors_hooks`` cannot measure a checkpointed block: a non-reentrant checkpoint
installs its own hooks (the inner ones win) and selective checkpointing keeps its saved outputs in
its own cache, so the test counts live storages instead.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

transformers = pytest.importorskip("transformers")

import fxshard
from fxshard.training.checkpointing import parse_checkpointing

from test_hf_models import BATCH, hf_model


class _Alive(TorchDispatchMode):
    """Every storage an op outputs, held (use count + 1) so that after the forward a storage
    whose use count is above 1 is one something else still holds."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                s = t.untyped_storage()
                self.storages.setdefault(s.data_ptr(), s)
        return out

    def alive_bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages.values() if torch._C._storage_Use_Count(s._cdata) > 1)


PLAN = fxshard.Plan(fxshard.MeshSpec(("tp",), (1,)), {})
_CAPTURED = {}


def _program(mode: str, every: int = 1):
    """A one-rank program of the tiny llama (captured once: each program has its own parameters)."""
    if "graph" not in _CAPTURED:
        _CAPTURED["graph"] = fxshard.trace(hf_model("llama"), PLAN, example_kwargs=BATCH)
    program = fxshard.transform(_CAPTURED["graph"], PLAN, example_kwargs=BATCH, blocks="auto")
    if mode != "none":
        fxshard.checkpoint_blocks(program, mode, every=every)
    return program


_MEASURED = {}


def _measured(mode: str):
    if mode not in _MEASURED:
        _MEASURED[mode] = _kept_and_grads(_program(*mode) if isinstance(mode, tuple) else _program(mode))
    return _MEASURED[mode]


def _kept_and_grads(program):
    alive = _Alive()
    with alive:
        out = program(**BATCH)
    kept = alive.alive_bytes()
    out.loss.backward()
    return kept, out.loss.detach(), {n: p.grad for n, p in program.named_parameters()}


def test_selective_keeps_less_than_none_and_more_than_full_with_the_same_numbers():
    kept, loss, grads = {}, {}, {}
    for mode in ("none", "selective", "full"):
        kept[mode], loss[mode], grads[mode] = _measured(mode)
    assert kept["none"] > kept["selective"] > kept["full"], kept
    # the blocks' share: the embedding, the head and the loss keep the same in every mode
    assert kept["selective"] - kept["full"] < 0.8 * (kept["none"] - kept["full"]), kept
    for mode in ("selective", "full"):
        torch.testing.assert_close(loss[mode], loss["none"], rtol=0, atol=0)
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-6, atol=1e-7, msg=f"{mode}: {name}")


def test_every_kth_block_in_full():
    program = _program("full", every=2)
    assert fxshard.checkpointed_blocks(program) == ["model.layers.1"]
    assert fxshard.checkpointed_blocks(program, "selective") == []
    selective = _program("selective")
    assert fxshard.checkpointed_blocks(selective, "selective") == ["model.layers.0", "model.layers.1"]
    kept_half, loss_half, _ = _kept_and_grads(program)
    kept_none, loss_none, _ = _measured("none")
    kept_full, _, _ = _measured("full")
    assert kept_none > kept_half > kept_full and torch.equal(loss_half, loss_none)


def _backward_collectives(modes) -> dict[str, int]:
    """Per mode, the collectives one backward of a tp=2 program runs (torch's fake process
    group: shapes only, no peer)."""
    from fxshard.planner.offline import offline_mesh

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(func, "namespace", None) == "_c10d_functional" and func is not torch.ops._c10d_functional.wait_tensor.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    with offline_mesh({"tp": 2}) as mesh:
        model = hf_model("llama")
        plan = fxshard.Plan.from_hf(mesh, model)
        captured = fxshard.trace(model, plan, example_kwargs=BATCH)
        for mode in modes:
            program = fxshard.transform(captured, plan, example_kwargs=BATCH, blocks="auto")
            if mode != "none":
                fxshard.checkpoint_blocks(program, mode)
            loss = program(**BATCH).loss
            Count.n = 0
            with Count():
                loss.backward()
            counts[mode] = Count.n
    return counts


def test_selective_does_not_run_the_forwards_all_reduces_again():
    counts = _backward_collectives(("none", "selective", "full"))
    assert counts["selective"] == counts["none"] < counts["full"], counts


@pytest.mark.parametrize("text,want", [("none", ("none", 1)), ("full", ("full", 1)), ("selective", ("selective", 1)),
                                       ("selective:op", ("selective", 1)), ("selective:2", ("full", 2)),
                                       (True, ("full", 1)), (False, ("none", 1)), (None, ("none", 1))])
def test_parse_checkpointing(text, want):
    assert parse_checkpointing(text) == want


@pytest.mark.parametrize("text", ["partial", "selective:0", "full:2", "selective:x"])
def test_parse_checkpointing_refuses_with_the_modes(text):
    with pytest.raises(fxshard.PlanError, match="one of none, full, selective"):
        parse_checkpointing(text)


def test_checkpoint_blocks_refuses_an_unknown_mode():
    program = _program("none")
    with pytest.raises(fxshard.PlanError, match=r"mode 'op'\n  fix: 'full'.*or\s+'selective'"):
        fxshard.checkpoint_blocks(program, "op")
    with pytest.raises(fxshard.PlanError, match=r"every=0\n  fix"):
        fxshard.checkpoint_blocks(program, "full", every=0)
