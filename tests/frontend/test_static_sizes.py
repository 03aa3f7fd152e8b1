"""An input dim the model's code fixes (a Python loop over the sequence): the capture says
so, the program runs exactly at that size and refuses another with a PlanError naming the
input, the dim and the fix, as a transformed program and as a pipeline's train_step."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import PlanError

from harness import plain, rank_value, simulated
from fxshard.meta import program_meta


class Scan(nn.Module):
    """A recurrence written as Mamba's reference scan: one Python step per token."""

    def __init__(self, vocab=32, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.decay = nn.Parameter(torch.rand(dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        state = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(input_ids.shape[1]):  # export specializes the sequence length here
            state = state * self.decay + x[:, t]
            outs.append(state)
        return self.head(torch.stack(outs, 1))


def _ids(batch, seq, seed=0):
    return torch.randint(0, 32, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_a_fixed_sequence_runs_exactly_at_its_size_and_is_refused_at_another():
    with simulated({"tp": 2}) as mesh:
        with plain():
            model, ids, other = Scan(), _ids(2, 6), _ids(2, 8, seed=1)
            want = model(ids)
        with pytest.warns(UserWarning, match="fixes 'input_ids' dim 1 at 6"):
            sharded = fxshard.transform(model, fxshard.Plan(mesh, {"head": fxshard.colwise("tp")}), (ids,))
        assert program_meta(sharded).static_input_dims == [("input_ids", 1, 6)]
        outs = [rank_value(sharded(ids), r) for r in range(2)]  # the head's vocab halves
        torch.testing.assert_close(torch.cat(outs, -1) if outs[0].shape[-1] == 16 else outs[1], want)
        with pytest.raises(PlanError, match=r"input 'input_ids' of Scan has 8 on dim 1, but the program was captured with "
                                            r"that dim fixed at 6(.|\n)*fix: transform with example inputs of the size"):
            sharded(other)
        # the batch stays dynamic
        sharded(_ids(4, 6, seed=2))


def test_a_dynamic_model_gets_no_check():
    class Mean(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 8)

        def forward(self, input_ids):
            return self.emb(input_ids).mean(1)

    sharded = fxshard.transform(Mean(), fxshard.Plan(fxshard.MeshSpec(("tp",), (2,)), {}), (_ids(2, 6),), capture="export")
    assert program_meta(sharded).static_input_dims == [] and not sharded._forward_pre_hooks


def test_hf_jamba_without_mamba_kernels_is_checked():
    """Jamba's Mamba layers fall back to a Python scan over the sequence without mamba_ssm."""
    from fxshard.testing.hf_tiny import tiny_inputs
    from pipeline.test_train_step import four_block_model

    with simulated({"tp": 1}) as mesh:
        with plain():
            model = four_block_model("jamba")
            (ids, labels), (other_ids, other_labels) = tiny_inputs(2, 6, seed=2), tiny_inputs(2, 8, seed=1)
            want = model(input_ids=ids, labels=labels).loss
        with pytest.warns(UserWarning, match="JambaForCausalLM: the model's code fixes 'input_ids' dim 1 at 6"):
            sharded = fxshard.transform(model, fxshard.Plan(mesh, {}), example_kwargs={"input_ids": ids, "labels": labels})
        got = sharded(input_ids=ids, labels=labels)
        torch.testing.assert_close(getattr(got, "loss", None) if not isinstance(got, dict) else got["loss"], want)
        with pytest.raises(PlanError, match="input 'input_ids' of JambaForCausalLM has 8 on dim 1"):
            sharded(input_ids=other_ids, labels=other_labels)


def test_a_pipelines_train_step_checks_the_micro_batches():
    """Rank 0 of a fake pp=2 group: train_step refuses before any communication."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class TwoScans(nn.Module):
        def __init__(self):
            super().__init__()
            self.scan = Scan()
            self.layers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])

        def forward(self, input_ids):
            x = self.scan(input_ids)
            for layer in self.layers:
                x = layer(x)
            return x

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        with pytest.warns(UserWarning, match="fixes 'input_ids' dim 1 at 6"):
            staged = fxshard.pipeline_transform(TwoScans(), None, mesh, example_inputs=(_ids(2, 6),),
                                                spec=fxshard.pipeline("pp", microbatches=2))
        with pytest.raises(PlanError, match="input 'input_ids' of TwoScans has 8 on dim 1"):
            fxshard.pipelining.train_step(staged, {"input_ids": _ids(4, 8)}, lambda out, tgt: out.sum(),
                                          target=torch.zeros(4))
    finally:
        dist.destroy_process_group()


class Windows(nn.Module):
    """Pools the sequence in windows of 4 and takes a shortcut for a single window: at an
    example of 6 tokens export fixes the number of windows at 1 (``Eq(s//4, 1)``) while the
    sequence dim itself stays symbolic (DeepSeek-V4's compressor does the same)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        windows = h.shape[1] // 4
        pooled = h[:, :4 * windows].unflatten(1, (windows, 4)).mean(2)
        summary = pooled.squeeze(1) if windows == 1 else pooled.sum(1)
        return h + summary.unsqueeze(1)


def test_a_size_derived_from_a_dynamic_dim_runs_where_it_holds_and_is_refused_elsewhere():
    model = Windows()
    sharded = fxshard.transform(model, fxshard.Plan(fxshard.MeshSpec(("tp",), (1,)), {}), (torch.randn(2, 6, 8),))
    assert [r[:2] + r[4:5] for r in program_meta(sharded).input_dim_ranges] == [("x", 1, (("(size//4)", 1),))]
    for length in (4, 5, 7):  # one window of 4, as in the example: exact
        x = torch.randn(3, length, 8)
        torch.testing.assert_close(sharded(x), model(x))
    for length, windows in ((8, 2), (3, 0)):
        with pytest.raises(PlanError, match=rf"(?s)input 'x' of Windows has {length} on dim 1, where \(x.shape\[1\]//4\) "
                                            rf"is {windows}, but the program was captured with \(x.shape\[1\]//4\) fixed at "
                                            rf"1.*fix: transform with example inputs of the size you run"):
            sharded(torch.randn(2, length, 8))


def test_hf_deepseek_v4_transformed_at_6_tokens_is_refused_at_8_and_12():
    """DeepSeek-V4's compressor: windows of 4 tokens, one at 6; export narrows the sequence
    to 4..7 and fixes the number of windows; 8 and 12 crashed deep inside ("the expanded size
    of the tensor (9) must match the existing size (10)")."""
    from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

    model = tiny_model("deepseek_v4")
    (ids, _), (same, _) = tiny_inputs(2, 6, seed=2), tiny_inputs(2, 5, seed=3)
    sharded = fxshard.transform(model, fxshard.Plan(fxshard.MeshSpec(("tp",), (1,)), {}),
                                example_kwargs={"input_ids": tiny_inputs(2, 6, seed=1)[0]})
    for x in (ids, same):
        torch.testing.assert_close(sharded(input_ids=x).logits, model(input_ids=x).logits)
    for length in (8, 12):
        with pytest.raises(PlanError, match=rf"(?s)input 'input_ids' of DeepseekV4ForCausalLM has {length} on dim 1, "
                                            rf"where \(input_ids.shape\[1\]//4\) is {length // 4}.*fixed at 1.*\(4 to 7\)"
                                            rf".*fix: transform with example inputs of the size you run"):
            sharded(input_ids=tiny_inputs(2, length, seed=4)[0])
