"""Capture that helps: a cache filled on the first call is warmed (or the error names
the set-up to call), HF encoder-decoders capture with no cache, and a program
transformed on the meta device says to call ``fxshard.materialize`` when called on
real inputs."""
import math

import pytest
import torch
import torch.nn as nn
import transformers

import fxshard
from fxshard import MeshSpec, Plan, PlanError, colwise, rowwise


class LazyTable(nn.Module):
    """Fills a table on its first call, with Python math on the positions (litgpt's and
    torchtune's rotary caches do this): export alone cannot (data-dependent ``tolist``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.table = None

    def forward(self, x):
        if self.table is None:
            positions = torch.arange(x.shape[1]).tolist()
            self.table = torch.tensor([[math.cos(p / 10 ** (i / 8)) for i in range(8)] for p in positions])
        return self.down(self.up(x * self.table).relu())


def test_cache_filled_on_first_call_is_warmed():
    model = LazyTable()
    example = torch.randn(2, 4, 8)
    gm = fxshard.trace(model, None, (example,), capture="export")
    assert "table" in dict(gm.named_buffers()) and "table" not in gm.state_dict()
    x = torch.randn(2, 4, 8, requires_grad=True)
    got, want = gm(x), LazyTable()(x)
    torch.testing.assert_close(got, want)


def test_cache_filled_on_first_call_transforms():
    model = LazyTable()
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), {"up": colwise(), "down": rowwise()}),
                                example_inputs=(torch.randn(2, 4, 8),), capture="export")
    assert sharded.get_buffer("table").shape == (4, 8)


class NeedsSetup(nn.Module):
    """torchtune style: the caches must be set up before the first call."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.cache = None

    def setup_caches(self, seq_len):
        self.cache = torch.zeros(seq_len, 8)

    def forward(self, x):
        return self.proj(x) + self.cache.sum(0)


def test_cache_that_needs_a_setup_call_is_a_plan_error_naming_it():
    model = nn.Sequential(NeedsSetup())
    with pytest.raises(PlanError, match=r"model\.0\.setup_caches\(\.\.\.\)"):
        fxshard.trace(model, None, (torch.randn(2, 4, 8),), capture="export")
    model[0].setup_caches(4)
    gm = fxshard.trace(model, None, (torch.randn(2, 4, 8),), capture="export")
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(gm(x), model(x))


def test_hf_encoder_decoder_captures_with_no_cache():
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=128, decoder_start_token_id=0,
        dropout_rate=0.0))
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(3, 128, (2, 8), generator=g), torch.randint(3, 128, (2, 6), generator=g)
    gm = fxshard.trace(model, None, example_kwargs={"input_ids": torch.randint(3, 128, (2, 8), generator=g),
                                                    "labels": torch.randint(3, 128, (2, 6), generator=g)})
    labels[:, :2] = -100
    out, ref = gm(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert "past_key_values" not in out.keys()
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.logits, ref.logits)
    # the model's own configs are as they were (the decoder stack holds a copy of its own)
    assert model.config.use_cache and model.decoder.config.use_cache


def test_meta_program_called_before_materialize_names_materialize():
    with torch.device("meta"):
        model = LazyTable()
        model.table = torch.ones(4, 8)
    sharded = fxshard.transform(model, Plan(MeshSpec(("tp",), (1,)), {}),  # (an offline mesh of one: it can run)
                                example_inputs=(torch.randn(2, 4, 8, device="meta"),), capture="export")
    with pytest.raises(PlanError, match=r"fxshard\.materialize"):
        sharded(torch.randn(2, 4, 8))
    assert sharded(torch.randn(2, 4, 8, device="meta")).is_meta  # shape checks on meta stay possible

    def init(m):
        m.up.reset_parameters()
        m.down.reset_parameters()
        m.table = torch.ones(4, 8)

    fxshard.materialize(sharded, model, init=init)
    assert sharded(torch.randn(2, 4, 8)).shape == (2, 4, 8)
    # the meta check is gone once every tensor is real; the table fixes the sequence at 4, which stays checked
    assert [type(h).__name__ for h in sharded._forward_pre_hooks.values()] == ["StaticSizeGuard"]
    with pytest.raises(PlanError, match="input 'x' of LazyTable has 5 on dim 1"):
        sharded(torch.randn(2, 5, 8))
