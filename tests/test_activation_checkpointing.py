"""Activation checkpointing per block (``fxshard.checkpoint_blocks``, docs/training.md).

The capture traces through HF's ``gradient_checkpointing``: ``fxshard.transform`` puts it
back per decoder layer, and the sharded program keeps fewer tensors for the backward (the
blocks' inputs) with the numbers of one device (simulated tp=2 here; on real gloo under
FSDP2 x tp in tests/test_fsdp.py and compiled in tests/test_regional_compile.py)."""
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fxshard
from equivalence import check_simulated
from harness import simulated

from test_hf_models import BATCH, CHECK, hf_model, hf_plan


def _with_checkpointing(family: str):
    model = hf_model(family)
    model.gradient_checkpointing_enable()
    return model


def _saved_for_backward(program) -> int:
    """How many tensors the forward keeps for the backward."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        program(**BATCH).loss
    return count


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_gradient_checkpointing_is_kept_per_block_and_exact(family):
    sharded = check_simulated(functools.partial(_with_checkpointing, family), functools.partial(hf_plan, family=family),
                              (), {"tp": 2}, kwargs=BATCH, **CHECK)
    layers = "transformer.h" if family == "gpt2" else "model.layers"
    assert fxshard.checkpointed_blocks(sharded) == [f"{layers}.0", f"{layers}.1"]
    plain = fxshard.transform(hf_model(family), hf_plan(fxshard.MeshSpec(("tp",), (2,)), family), example_kwargs=BATCH)
    assert fxshard.checkpointed_blocks(plain) == []
    with simulated({"tp": 2}) as mesh:
        fxshard.bind_mesh(mesh)
        kept, every = _saved_for_backward(sharded), _saved_for_backward(plain)
    assert kept < every / 2, (kept, every)  # the blocks keep their inputs, not their activations


def test_checkpoint_blocks_needs_blocks_and_applies_once():
    plan = hf_plan(fxshard.MeshSpec(("tp",), (2,)), "llama")
    whole = fxshard.transform(hf_model("llama"), plan, example_kwargs=BATCH)
    with pytest.raises(fxshard.PlanError, match=r"no transformer blocks split out.*\n  fix: transform with blocks='auto'"):
        fxshard.checkpoint_blocks(whole)
    split = fxshard.transform(hf_model("llama"), plan, example_kwargs=BATCH, blocks="auto")
    fxshard.checkpoint_blocks(split)
    forward = split.model.layers[0].forward
    assert fxshard.checkpoint_blocks(split) is split and split.model.layers[0].forward == forward


def test_pipeline_transform_keeps_hf_gradient_checkpointing():
    """Rank 0 of a fake pp=2 group: its stage's decoder layers are checkpointed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        model = hf_model("llama")
        model.gradient_checkpointing_enable()
        staged = fxshard.pipeline_transform(model, None, mesh, example_kwargs=BATCH, spec=fxshard.pipeline("pp", microbatches=2))
        assert fxshard.checkpointed_blocks(staged) == ["model.layers.0"]
    finally:
        dist.destroy_process_group()
