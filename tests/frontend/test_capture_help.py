"""Capture that helps: a cache filled on the first call is warmed (or the error names
the set-up to call), HF encoder-decoders capture with no cache, and a program
transformed on the meta device says to call ``fxshard.materialize`` when called on
real inputs."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
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


class BufferCache(dict):
    """OLMo-core's ``BufferCache``: tables shared by the blocks, kept out of the module's buffers."""


class CachedRotary(nn.Module):
    """OLMo-core's ``RotaryEmbedding`` (``olmo_core.nn.rope``): the sine and cosine tables are
    computed on the first call and kept in the cache for every later one that is no longer."""

    def __init__(self, head_dim, cache):
        super().__init__()
        self.head_dim, self._cache = head_dim, cache

    def tables(self, seq_len):
        sin, cos = self._cache.get("rope_pos_sin"), self._cache.get("rope_pos_cos")
        if sin is not None and cos is not None and sin.shape[-2] >= seq_len:
            return sin[:seq_len], cos[:seq_len]
        inv_freq = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim)
        freqs = torch.einsum("i , j -> i j", torch.arange(seq_len, dtype=torch.float), inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        self._cache["rope_pos_sin"], self._cache["rope_pos_cos"] = positions.sin(), positions.cos()
        return self._cache["rope_pos_sin"], self._cache["rope_pos_cos"]

    def forward(self, q, k):
        sin, cos = self.tables(q.shape[2])

        def rotate(t):
            t1, t2 = t.chunk(2, -1)
            return t * cos + torch.cat((-t2, t1), -1) * sin

        return rotate(q), rotate(k)


class CachedRotaryLM(nn.Module):
    """Two attention blocks sharing one rotary cache, as OLMo-core's Llama and OLMo-2 do."""

    def __init__(self, vocab=64, dim=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        cache = BufferCache()
        self.heads, self.emb, self.head = heads, nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.w_q, block.w_k, block.w_v, block.w_out = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            block.rope = CachedRotary(dim // heads, cache)
            self.blocks.append(block)

    def forward(self, ids):
        x = self.emb(ids)
        b, s, d = x.shape
        for block in self.blocks:
            q, k, v = (w(x).view(b, s, self.heads, -1).transpose(1, 2) for w in (block.w_q, block.w_k, block.w_v))
            q, k = block.rope(q, k)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block.w_out(out.transpose(1, 2).reshape(b, s, d))
        return self.head(x)


def _rotary_plan(mesh):
    return Plan(mesh, {"blocks.*.w_q": colwise(), "blocks.*.w_k": colwise(), "blocks.*.w_v": colwise(),
                       "blocks.*.w_out": rowwise()})


def test_a_cache_filled_while_captured_is_left_as_it_was_and_the_model_captures_again():
    """OLMo-core's Llama and OLMo-2: the capture filled the rotary cache with fake tensors, and the
    next capture stopped at one ("We found a fake tensor in the exported program constant's list",
    blocks.0.rope); now the cache is left as the capture found it."""
    model = CachedRotaryLM()
    ids = torch.randint(0, 64, (2, 6))
    for _ in range(3):  # the second stopped at the fake tensor
        fxshard.trace(model, None, (ids,), capture="export")
    assert dict(model.blocks[0].rope._cache) == {}
    program = fxshard.transform(model, Plan(MeshSpec(("tp",), (1,)), {}), (ids,), capture="export")
    x = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(program(x), model(x))  # the table is computed in the graph, at any length
    warm = model.blocks[0].rope._cache["rope_pos_sin"]  # filled by the eager call: a real table, kept
    fxshard.trace(model, None, (ids,), capture="export")
    assert model.blocks[0].rope._cache["rope_pos_sin"] is warm


def test_a_model_with_a_cached_rotary_table_is_exact_at_tp2():
    """Logits, every gradient and a step later at tp=2 against one device: the table the
    capture computes in the graph is the one the cache would hold."""
    from equivalence import check_simulated
    from fxshard.testing.models import tokens

    check_simulated(CachedRotaryLM, _rotary_plan, (tokens(2, 8, 64),), {"tp": 2}, example_inputs=(tokens(2, 8, 64, seed=1),))
