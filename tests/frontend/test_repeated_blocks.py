"""Capturing a repeated block once (fxshard/frontend/repeated_blocks.py): the stamped graph
is, block by block, the graph a full capture gives, and trains the same; blocks that
differ are captured in full, and the program says so."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

import fxshard
from equivalence import Case, check_real_cases
from fxshard.frontend.capture import capture
from fxshard.frontend.repeated_blocks import _sources, block_graph, plan_stamping
from fxshard.testing.hf_tiny import tiny_inputs, tiny_model
from fxshard.meta import program_meta

ALTERNATING = ["sliding_attention", "full_attention"] * 4
FAMILIES = {
    "llama": dict(num_hidden_layers=5),  # dense
    "mixtral": dict(num_hidden_layers=5),  # MoE
    "deepseek_v3": dict(num_hidden_layers=6),  # a dense layer first, MoE after
    "gemma2": dict(num_hidden_layers=8, layer_types=ALTERNATING),  # sliding-window and full attention alternate
    "gpt2": dict(n_layer=5),  # Conv1D, a tied head
}


def _batch():
    ids, labels = tiny_inputs(2, 8)  # distinct tensors, labels padded with -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gemma2", "gpt2"])  # MoE: deepseek_v3 here, mixtral on gloo below
def test_stamped_blocks_are_the_fully_captured_blocks(family):
    model = tiny_model(family, **FAMILIES[family])
    plan = fxshard.Plan.from_hf(fxshard.MeshSpec(("tp",), (2,)), model)
    batch = _batch()
    stamped = capture(model, plan, example_kwargs=batch)
    full = capture(model, plan, example_kwargs=batch, repeated_blocks=False)
    stamp, _ = plan_stamping(model)
    assert program_meta(stamped).capture_blocks.startswith(f"stamped {len(stamp.names) - stamp.captured} of {len(stamp.names)}")
    assert len(stamped.graph.nodes) == len(full.graph.nodes)
    for i in range(len(stamp.names)):
        assert block_graph(stamped, stamp.prefix(i)) == block_graph(full, stamp.prefix(i)), stamp.prefix(i)
    assert set(stamped.state_dict()) == set(model.state_dict())
    run = _batch()  # other tensors than the example's
    want = model(**run)
    got = stamped(**run)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)


def test_kinds_pick_sources_after_a_predecessor_of_the_same_kind():
    assert _sources([0, 0, 0, 0, 0, 0], 3) == {3: 2, 4: 2, 5: 2}
    assert _sources([0, 1, 0, 1, 0, 1, 0, 1], 6) == {6: 5, 7: 4} or _sources([0, 1, 0, 1, 0, 1, 0, 1], 6) == {6: 4, 7: 5}
    assert _sources([0, 1, 1, 1, 1, 1], 3) is None  # (1, 1) captured once: unchecked
    assert _sources([0, 1, 1, 1, 1, 1], 4) == {4: 3, 5: 3}
    assert _sources([0, 1, 2, 3, 4, 5], 3) is None


class _Block(nn.Module):
    def __init__(self, width: int, scale: float):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.scale = scale  # differs on every block: left out of the kind, so the graphs must show it

    def forward(self, x):
        return x + self.proj(x) * self.scale


class _Stack(nn.Module):
    def __init__(self, widths, scales):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(w, s) for w, s in zip(widths, scales))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_that_differ_in_the_graph_are_captured_in_full_and_warn():
    torch.manual_seed(0)
    model = _Stack([8] * 5, [1.0, 2.0, 3.0, 4.0, 5.0])
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match="blocks captured in full: blocks.1 and blocks.2, of one kind, are not the same graph"):
        gm = capture(model, None, (x,))
    assert program_meta(gm).capture_blocks.startswith("captured in full")
    y = torch.randn(3, 8)
    torch.testing.assert_close(gm(y), model(y))


def test_blocks_of_different_configs_are_captured_in_full():
    torch.manual_seed(0)
    model = _Stack([8] * 5, [1.0] * 5)
    same = capture(model, None, (torch.randn(2, 8),))
    assert program_meta(same).capture_blocks == "stamped 2 of 5 blocks of blocks from 3 captured"
    per_layer = nn.Sequential(nn.Linear(8, 8), _Stack([8, 8, 8, 8], [1.0] * 4))
    per_layer[1].blocks[2].proj = nn.Linear(8, 8, bias=False)  # one block's own config
    gm = capture(per_layer, None, (torch.randn(2, 8),))
    assert program_meta(gm).capture_blocks.startswith("captured in full: the blocks of 1.blocks are not repeats")


def _plan(mesh, family):
    return fxshard.Plan.from_hf(mesh, tiny_model(family, **FAMILIES[family]))


def _stamped(sharded, mesh, rank, world_size):
    assert program_meta(sharded).capture_blocks.startswith("stamped"), program_meta(sharded).capture_blocks


def _logits(out):
    return out.logits


def _loss(out):
    return out.loss


def test_stamped_programs_train_like_one_device_real_gloo():
    """tp=2 on gloo: alternating attention and MoE models, captured with stamped blocks,
    against one device (outputs, gradients, a step later)."""
    cases = [Case(functools.partial(tiny_model, f, **FAMILIES[f]), functools.partial(_plan, family=f), (), {"tp": 2},
                  kwargs=_batch(), select=_logits, loss_fn=_loss, replicated_loss=True, lr=0.2, post=_stamped,
                  name=f"stamped {f}") for f in ("gemma2", "mixtral")]
    check_real_cases(2, cases)
